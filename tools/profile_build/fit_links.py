"""Fit the intra-node collective models from the raw measurements and write links/*.json.

    PYTHONPATH=tools python -m profile_build.fit_links --data DATA -o src/mist/hardware/links

Sources: `op-profiles/prim_*_<op>_<n>gpus.csv` (MiB, ms; sentinels ≥ 1e6 dropped). data_size is
the full buffer for all-reduce and reduce-scatter and the per-rank input for all-gather
(see DATA/README.md §3.2). For H200/H100 no multi-GPU data exist: NVLink 4 datasheet figures.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from mist.hardware.collectives import OPS, datasheet_links, ring_factor
from mist.units import MiB

GPU_DIRS = {
    "a100-sxm4-40gb": ["op-profiles", "op-profiles-larger-models"],
    "l4": ["op-profiles"],
    "a10g": ["op-profiles"],
    "v100-sxm2-32gb": ["op-profiles"],
}


def _points(folder: Path, op: str, n: int):
    xs, ys = [], []
    for f in folder.glob(f"prim_gpt_*_{op}_{n}gpus.csv"):
        with open(f) as fh:
            for row in list(csv.reader(fh))[1:]:
                mb, ms = float(row[0]), float(row[1])
                if mb >= 1e6 or ms >= 1e6:
                    continue
                full = mb * MiB * (n if op == "all_gather" else 1)
                xs.append(full)
                ys.append(ms / 1e3)
    return np.array(xs), np.array(ys)


def fit(xs, ys, op: str, n: int):
    """Least squares of t = alpha + f·bytes/busbw, relative residuals (each point counts alike)."""
    f = float(ring_factor(op, n))
    A = np.stack([np.ones_like(xs), f * xs], axis=1) / ys[:, None]
    coef, *_ = np.linalg.lstsq(A, np.ones_like(ys), rcond=None)
    alpha, inv_bw = max(coef[0], 0.0), max(coef[1], 1e-15)
    pred = alpha + f * xs * inv_bw
    err = float(np.median(np.abs(pred - ys) / ys))
    return alpha, 1.0 / inv_bw, err


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="the measurement data folder (holds gpus/)")
    ap.add_argument("-o", "--out", default="src/mist/hardware/links")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for gpu, dirs in GPU_DIRS.items():
        fits, errs = {}, {}
        for op in OPS:
            for n in (2, 4, 8):
                xs, ys = [], []
                for d in dirs:
                    x, y = _points(Path(a.data) / "gpus" / gpu / d, op, n)
                    xs.append(x)
                    ys.append(y)
                x, y = np.concatenate(xs), np.concatenate(ys)
                if len(x) < 3:
                    continue
                alpha, bw, err = fit(x, y, op, n)
                fits.setdefault(op, {})[str(n)] = [alpha, bw]
                errs[f"{op}/{n}"] = round(err, 4)
        doc = {
            "gpu": gpu,
            "provenance": f"measured: Mist artifact collectives of {gpu} (prim_*.csv, one node), ring alpha-beta fit",
            "fits": fits,
            "median_rel_error": errs,
        }
        (out / f"{gpu}.json").write_text(json.dumps(doc, indent=1))
        print(
            gpu,
            {k: round(v[1] / 1e9, 1) for k, v in fits.get("all_reduce", {}).items()},
            "GB/s busbw AR;",
            "median fit error",
            max(errs.values()) if errs else None,
        )
    # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction; NCCL ring reaches ~80 %.
    for gpu in ("h200", "h100"):
        lm = datasheet_links(
            gpu,
            busbw=0.8 * 450e9,
            alpha=20e-6,
            provenance="datasheet: NVLink 4 (450 GB/s per direction) × 0.8 ring "
            "efficiency, 20 µs latency; no measurements",
        )
        (out / f"{gpu}.json").write_text(json.dumps(lm.to_json(), indent=1))


if __name__ == "__main__":
    main()
