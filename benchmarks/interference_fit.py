"""Fit-error table of the interference model and the fitted communication bandwidths.

    PYTHONPATH=src python benchmarks/interference_fit.py [--data DATA] [--shipped]

Refits every GPU with overlap-benchmark data (DATA: the raw measurement folder, default
$MIST_RAW_DATA, not part of this repository: see data/README.md; `fit_gpu` of
the offline overlap fit, including the leave-one-layout-out refits) and checks the refit against
the shipped `overlap/<gpu>.json`; with --shipped (or without the data folder) it reports the
numbers recorded in the shipped files. Prints Markdown and writes benchmarks/results/interference_fit.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tools"))  # the offline overlap fit (not installed)

from mist.hardware.dp_links import load_dp_links  # noqa: E402
from mist.hardware.interference import (  # noqa: E402
    InterferenceModel,
    load_interference,
    load_overlap_doc,
    overlap_time,
)
from profile_build.fit_overlap import OVERLAP_GPUS, fit_gpu  # noqa: E402


def _e(d):
    return f"{100 * d['median']:.1f} / {100 * d['mean']:.1f}"


def _gb(x):
    return f"{x / 1e9:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("MIST_RAW_DATA") or "")
    ap.add_argument("--shipped", action="store_true", help="report the shipped files, no refit")
    ap.add_argument("-o", "--out", default=str(ROOT / "results" / "interference_fit.md"))
    a = ap.parse_args(argv)

    docs, notes = {}, []
    for gpu in OVERLAP_GPUS:
        shipped = load_overlap_doc(gpu)
        have_data = bool(a.data) and (Path(a.data) / "gpus" / gpu / "overlap-bench").is_dir()
        if a.shipped or not have_data:
            docs[gpu] = shipped
            notes.append(f"- {gpu}: numbers recorded in the shipped overlap/{gpu}.json")
            continue
        t0 = time.perf_counter()
        doc = fit_gpu(Path(a.data), gpu, loo=True)
        dt = time.perf_counter() - t0
        docs[gpu] = doc
        diff = np.abs(InterferenceModel.from_json(doc["interference"]).vector() - load_interference(gpu).vector()).max()
        same = all(doc["fit_errors"][k] == shipped["fit_errors"][k] for k in doc["fit_errors"])
        notes.append(
            f"- {gpu}: refitted from {a.data} in {dt:.1f} s (incl. {len(doc['g2g_allgather'])} "
            f"leave-one-layout-out refits); max |factor − shipped| = {diff:.1e}; "
            f"errors identical to the shipped file: {same}"
        )

    out = ["# Interference model fit (overlap benchmark of the Mist artifact)", ""]
    out += [
        "Absolute relative error of predicted vs measured latency on the mixed rows (≥ 2 active channels,",
        "std/mean ≤ 0.1), **median / mean in %**. Standalone inputs: measured compute-alone time, predicted",
        "G2G / C2G / G2C times. *Fitted*: 28 factors fitted on all layouts. *Leave-one-layout-out*: factors and",
        "host-copy fits refitted without the held-out layout, predicting its rows. *Pairs additive*: fitted",
        "pairs only, larger sets composed additively (how the H200 fallback is built). *Serial sum* = Σ X,",
        "*max* = perfect overlap.",
        "",
    ]
    out += [
        "| GPU | layouts | rows | fitted | leave-one-layout-out | serial sum | max | pairs additive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gpu, d in docs.items():
        e = d["fit_errors"]
        loo = _e(e["leave_one_layout_out"]) if "leave_one_layout_out" in e else "–"
        out.append(
            f"| {gpu} | {len(d['g2g_allgather'])} | {e['fitted']['rows']} | **{_e(e['fitted'])}** | {loo} | "
            f"{_e(e['serial_sum'])} | {_e(e['max'])} | {_e(e['pairs_additive'])} |"
        )
    out += ["", "Fitted error by number of active channels (median %):", ""]
    for gpu, d in docs.items():
        by = d["fit_errors"]["fitted"].get("median_by_active_channels", {})
        out.append(
            f"- {gpu}: "
            + ", ".join(f"{k} channels {100 * v:.1f}" for k, v in by.items())
            + f"; rows dropped for std/mean > 0.1: {d['fit_errors']['fitted'].get('rows_dropped_std', '?')}"
        )

    out += [
        "",
        "## Fitted communication bandwidths",
        "",
        "G2G: all-gather, t = alpha + (P−1)/P·bytes/busbw, bytes = total output; all groups of the layout run",
        "at once. GB/s = 10⁹ B/s.",
        "",
        "| GPU | inter × intra | busbw (GB/s) | alpha (ms) | median fit error (%) |",
        "|---|---|---|---|---|",
    ]
    for gpu, d in docs.items():
        for f in d["g2g_allgather"].values():
            out.append(
                f"| {gpu} | {f['inter']} × {f['intra']} | {_gb(f['busbw_Bps'])} | {1e3 * f['alpha_s']:.3f} | "
                f"{100 * f['median_rel_error']:.2f} |"
            )
    out += [
        "",
        "Host copies (per GPU, all 8 GPUs of the node copying at once) and the cross-node NIC model",
        "t = alpha + G·(n−1)/n·bytes/B_nic + (k−1)/k·bytes/busbw_intra(k):",
        "",
        "| GPU | C2G GB/s | G2C GB/s | B_nic per node GB/s | cross-node alpha (ms) | cross-node median error (%) |",
        "|---|---|---|---|---|---|",
    ]
    for gpu, d in docs.items():
        h, x = d["host_links"], d.get("internode")
        xs = (
            f"{_gb(x['nic_Bps_per_node'])} | {1e3 * x['alpha_s']:.3f} | {100 * x['median_rel_error']:.1f}"
            if x
            else "– | – | –"
        )
        out.append(f"| {gpu} | {_gb(h['c2g']['bw_Bps'])} | {_gb(h['g2c']['bw_Bps'])} | {xs} |")

    out += [
        "",
        "## DP / cross-node link parameters shipped (overlap/dp_links.json)",
        "",
        "| GPU | B_nic per node GB/s | source | p2p intra GB/s | source | p2p inter GB/s | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu in ("a100-sxm4-40gb", "v100-sxm2-16gb", "l4", "a10g", "v100-sxm2-32gb", "h100", "h200"):
        dl = load_dp_links(gpu)

        def cell(part, key):
            d = getattr(dl, part)
            if not d:
                return "– | –"
            return f"{_gb(d[key])} | {d['provenance'].split(':')[0]}"

        out.append(
            f"| {gpu} | {cell('internode', 'nic_Bps_per_node')} | {cell('p2p_intra', 'bw_Bps')} | "
            f"{cell('p2p_inter', 'bw_Bps')} |"
        )

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10e-3, size=(1_000_000, 4)) * (rng.random((1_000_000, 4)) > 0.2)
    m = load_interference("a100-sxm4-40gb")
    overlap_time(x[:1000], m)
    t0 = time.perf_counter()
    overlap_time(x, m)
    dt = time.perf_counter() - t0
    out += (
        [
            "",
            f"`overlap_time` throughput: 10⁶ candidates in {1e3 * dt:.0f} ms (numpy, one core).",
            "",
            "## Provenance",
            "",
        ]
        + notes
        + [""]
    )
    text = "\n".join(out)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
