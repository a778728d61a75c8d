"""Leave-one-out accuracy of the GPU profiles (`mist.hardware`).

* Aceso GPUs (L4, A100, A10G, V100): for each model size, build the profile from the OTHER sizes'
  op-profile rows only and predict that size's per-op forward/backward times of the GPT layer
  (qkv, dense, GEMM-1, GEMM-2, attention score/context, softmax, attention dropout, layernorm,
  gelu) at every micro-batch, t = 1.
* H200: drop each GEMM-grid / attention-table node and predict it from its grid neighbours (what
  a lookup between nodes does); drop each bandwidth-bound elementwise row and refit its class.

    python benchmarks/profile_accuracy.py [--data DATA] [--out benchmarks/results/profile_accuracy.md]

DATA is the raw measurement folder the profiles were built from (the one holding `gpus/`; default:
$MIST_RAW_DATA). Only its H200 part is in this repository (`data/`): see data/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))  # the offline profile builders (not installed)

from profile_build import aceso, aceso_fit, flash, h200  # noqa: E402
from profile_build.common import fit_floor_plus_rate, read_json  # noqa: E402

GPUS = ("l4", "a100-sxm4-40gb", "a10g", "v100-sxm2-32gb")
OP_CLASS = {
    "enc-attention-qkv": "qkv",
    "enc-attention-dense": "dense",
    "enc-MLP-GEMM-1": "GEMM-1",
    "enc-MLP-GEMM-2": "GEMM-2",
    "enc-attention-score": "score (bmm)",
    "enc-attention-context": "context (bmm)",
    "enc-attention-softmax": "softmax",
    "enc-attention-dropout": "attn dropout",
    "enc-1st-layernorm": "layernorm",
    "enc-2nd-layernorm": "layernorm",
    "enc-MLP-gelu": "gelu",
}
CLASS_ORDER = list(dict.fromkeys(OP_CLASS.values()))


def _stats(errs) -> str:
    a = np.abs(np.asarray(errs)) * 100
    return f"{np.median(a):.1f} | {np.mean(a):.1f} | {len(a)}"


def _signed(errs) -> str:
    return f"{np.median(errs) * 100:+.1f}"


# ---------------------------------------------------------------------------- Aceso GPUs
def aceso_loo(data: Path, base):
    eff = flash.h200_efficiency(base.attention, base.gemm.extra["plateau_flops"])
    calib = flash.l4_flash_calibration(
        data / "gpus" / "l4" / "op-db", eff, base.attention.s_axis, base.attention.d_axis
    )
    errs = defaultdict(list)  # (gpu, class, dir) -> [rel err]
    by_size = defaultdict(list)  # (gpu, size) -> [rel err]
    for gpu in GPUS:
        cfg = aceso.GPUS[gpu]
        records = aceso.read_profiles(data / "gpus" / gpu, cfg["folders"])
        sizes = [s for s in aceso.SIZE_ORDER if any(r.size == s for r in records)]
        for size in sizes:
            prof = aceso_fit.build(data, gpu, base, exclude_sizes={size}, flash_calib=calib)
            for r in records:
                if r.size != size or r.t != 1:
                    continue
                for op, cls in OP_CLASS.items():
                    if aceso.LAYER_OPS[op] != "linear" and r.algo != 0:
                        continue  # non-linear rows are identical in both algo files
                    fwd_terms, bwd_terms = aceso.row_terms(
                        op, r.hidden, r.heads, cfg["seq"], r.b, 1, cfg["wgrad_in_bwd"]
                    )
                    for direction, terms, meas in (
                        ("fwd", fwd_terms, r.times[op][0]),
                        ("bwd", bwd_terms, r.times[op][1]),
                    ):
                        if meas is None:
                            continue
                        e = aceso.predict(prof, terms, direction == "bwd") / meas - 1.0
                        errs[(gpu, cls, direction)].append(e)
                        by_size[(gpu, size)].append(e)
    return errs, by_size


# ---------------------------------------------------------------------------- H200
def _neighbour_loo(log_t: np.ndarray, skip_axes=()):
    """Predict each node from the midpoint of its two neighbours along each axis (log space)."""
    preds = []
    for idx in np.ndindex(log_t.shape):
        est = []
        for ax in range(log_t.ndim):
            if ax in skip_axes:
                continue
            lo, hi = list(idx), list(idx)
            lo[ax] -= 1
            hi[ax] += 1
            if lo[ax] >= 0 and hi[ax] < log_t.shape[ax]:
                est.append(0.5 * (log_t[tuple(lo)] + log_t[tuple(hi)]))
        if est:
            preds.append((idx, float(np.mean(est))))
    return preds


def h200_gemm_loo(base, data: Path):
    g = base.gemm
    filled = {tuple(x) for x in g.extra["filled"]}
    log_t = np.log(g.times_s)
    out = {"all": [], "gpu": []}
    for idx, est in _neighbour_loo(log_t):
        key = (g.m_axis[idx[0]], g.n_axis[idx[1]], g.k_axis[idx[2]])
        if key in filled:
            continue
        e = np.exp(est - log_t[idx]) - 1.0
        out["all"].append(e)
        if g.times_s[idx] >= 50e-6:
            out["gpu"].append(e)
    # the fill rule (constant efficiency of the lower neighbours) used for the 10 missing points
    fill = []
    m, n, k = np.meshgrid(g.m_axis, g.n_axis, g.k_axis, indexing="ij")
    rate = 2.0 * m * n * k / g.times_s
    for idx in np.ndindex(g.times_s.shape):
        key = (g.m_axis[idx[0]], g.n_axis[idx[1]], g.k_axis[idx[2]])
        if key in filled or g.times_s[idx] < 50e-6:
            continue
        nb = []
        for ax in range(3):
            lo = list(idx)
            lo[ax] -= 1
            if lo[ax] >= 0 and (g.m_axis[lo[0]], g.n_axis[lo[1]], g.k_axis[lo[2]]) not in filled:
                nb.append(np.log(rate[tuple(lo)]))
        if nb:
            pred_rate = np.exp(np.mean(nb))
            fill.append(rate[idx] / pred_rate - 1.0)
    out["fill"] = fill
    return out


def h200_attention_loo(base):
    a = base.attention
    out = {}
    for key, times in (("fwd", a.fwd_s), ("bwd", a.bwd_s)):
        log_t = np.log(times)
        all_e, gpu_e = [], []
        for idx, est in _neighbour_loo(log_t, skip_axes=(3,)):  # d has only two values
            e = np.exp(est - log_t[idx]) - 1.0
            all_e.append(e)
            if times[idx] >= (0.1e-3 if key == "fwd" else 0.3e-3):
                gpu_e.append(e)
        out[key] = (all_e, gpu_e)
    return out


def h200_elementwise_loo(data: Path):
    rows = read_json(data / "gpus" / "h200" / "elementwise.json")["rows"]
    out = defaultdict(list)
    for op, (io_f, io_b) in h200.IO_BYTES.items():
        sel = [r for r in rows if r["op"] == op and r["bytes_io"] >= h200.LARGE_BYTES]
        for direction, io, key in (("fwd", io_f, "fwd_ms"), ("bwd", io_b, "bwd_ms")):
            x = np.array([io * r["bytes_io"] for r in sel], float)
            t = np.array([r[key] for r in sel]) * 1e-3
            for i in range(len(sel)):
                mask = np.arange(len(sel)) != i
                rate, c = fit_floor_plus_rate(x[mask], t[mask])
                out[(op, direction)].append((c + x[i] / rate) / t[i] - 1.0)
    return out


def l4_op_db_check(data: Path):
    """Shipped-style L4 profile vs the Mist op-db (an independent L4 run, not used for the GEMM fit)."""
    prof = aceso_fit.build(data, "l4", h200.build(data))
    op_db = data / "gpus" / "l4" / "op-db"
    out = defaultdict(list)
    for key, v in read_json(op_db / "mist.modules.fused_dense.fused_dense_func.json").items():
        sh = flash._shapes(key)
        m = int(np.prod(sh["x"][:-1]))
        n, k = sh["weight"]
        out[("fused_dense (GEMM)", "fwd")].append(prof.gemm_time(m, n, k) / v["fwd"][1] - 1)
        out[("fused_dense (GEMM)", "bwd = dX + dW")].append(
            (prof.gemm_time(m, k, n) + prof.gemm_time(n, k, m)) / v["bwd"][1] - 1
        )
    for key, v in read_json(op_db / "mist.modules.flash_attn.flash_attn_qkvpacked_func.json").items():
        b, s, _, heads, d = flash._shapes(key)["qkv"]
        for direction in ("fwd", "bwd"):
            pred = prof.attention_time(b, heads, heads, s, d, True, direction == "bwd")
            out[("flash_attn (calibration points)", direction)].append(pred / v[direction][1] - 1)
    return out


# ---------------------------------------------------------------------------- report
def report(data: Path) -> str:
    t_start = time.perf_counter()
    base = h200.build(data)
    errs, by_size = aceso_loo(data, base)
    lines = [
        "# GPU profile accuracy (leave-one-out)",
        "",
        "Generated by `benchmarks/profile_accuracy.py`. Error = predicted / measured − 1;",
        "columns give the median and mean of |error| in %, the number of predictions, and the",
        "median signed error (bias) in %.",
        "",
        "## Aceso op-profiles: leave one model size out (t = 1, every micro-batch)",
        "",
        "For each size the profile is rebuilt from the other sizes' rows only; the held-out size's",
        "layer rows are predicted as the sum of the kernels they run (`tools/profile_build/aceso.py`, `row_terms`).",
        "Linear backward = dX GEMM only on L4/A100/V100 (their profiles exclude dW), dX + dW on A10G.",
        "L4: the GEMM table and the binary class are calibrated on the original runtime's op-db",
        "(`tools/profile_build/op_db.py`), which times the same linear layers about 9 % faster than the",
        "Aceso rows; a negative L4 GEMM bias against the Aceso rows is therefore expected.",
        "",
        "| GPU | op | dir | median % | mean % | n | bias % |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for gpu in GPUS:
        for cls in CLASS_ORDER:
            for d in ("fwd", "bwd"):
                e = errs.get((gpu, cls, d))
                if e:
                    lines.append(f"| {gpu} | {cls} | {d} | {_stats(e)} | {_signed(e)} |")
    lines += [
        "",
        "### Per held-out size (all ops and directions)",
        "",
        "| GPU | held-out size | median % | mean % | n | bias % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (gpu, size), e in by_size.items():
        lines.append(f"| {gpu} | {size} | {_stats(e)} | {_signed(e)} |")
    lines += [
        "",
        "### Summary per GPU",
        "",
        "| GPU | GEMM rows (linear + bmm) median % | memory-bound rows median % | all median % | all mean % |",
        "|---|---:|---:|---:|---:|",
    ]
    for gpu in GPUS:
        gemm_e = [x for (g, c, _), v in errs.items() if g == gpu and c in CLASS_ORDER[:6] for x in v]
        mem_e = [x for (g, c, _), v in errs.items() if g == gpu and c not in CLASS_ORDER[:6] for x in v]
        all_e = gemm_e + mem_e
        lines.append(
            f"| {gpu} | {np.median(np.abs(gemm_e)) * 100:.1f} | {np.median(np.abs(mem_e)) * 100:.1f} | "
            f"{np.median(np.abs(all_e)) * 100:.1f} | {np.mean(np.abs(all_e)) * 100:.1f} |"
        )

    lines += [
        "",
        "### L4 cross-check against the Mist op-db (independent run; GEMMs not used for fitting)",
        "",
        "The flash-attention points are the calibration data of the L4 attention table (in-sample).",
        "",
        "| op | dir | median % | mean % | n | bias % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (op, d), e in l4_op_db_check(data).items():
        lines.append(f"| {op} | {d} | {_stats(e)} | {_signed(e)} |")

    g = h200_gemm_loo(base, data)
    att = h200_attention_loo(base)
    ew = h200_elementwise_loo(data)
    lines += [
        "",
        "## H200: drop one table node, predict it from its neighbours",
        "",
        "GEMM grid: log-time midpoint of the two neighbours along each axis that has both (averaged over",
        'axes), i.e. what an interpolated lookup returns with that node missing. "≥ 50 µs" excludes the',
        "launch-floor region (~15 µs, where nodes differ only by timing noise). The fill rule is the",
        "constant-efficiency extrapolation from lower neighbours used for the 10 unmeasured large GEMMs.",
        "Attention: the same along b, heads and s (d has only two values), on the profile's tables",
        "(backward = measured minus the backward()-call cost).",
        "",
        "| table | subset | median % | mean % | n | bias % |",
        "|---|---|---:|---:|---:|---:|",
        f"| GEMM | all interior nodes | {_stats(g['all'])} | {_signed(g['all'])} |",
        f"| GEMM | nodes ≥ 50 µs | {_stats(g['gpu'])} | {_signed(g['gpu'])} |",
        f"| GEMM | fill rule, nodes ≥ 50 µs | {_stats(g['fill'])} | {_signed(g['fill'])} |",
    ]
    for key in ("fwd", "bwd"):
        all_e, gpu_e = att[key]
        bound = "0.1 ms" if key == "fwd" else "0.3 ms"
        lines.append(f"| attention {key} | all interior nodes | {_stats(all_e)} | {_signed(all_e)} |")
        lines.append(f"| attention {key} | nodes ≥ {bound} | {_stats(gpu_e)} | {_signed(gpu_e)} |")
    lines += [
        "",
        "## H200 memory-bound ops: drop one bandwidth-bound row (≥ 128 MiB), refit, predict it",
        "",
        "| op | dir | median % | mean % | n | bias % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (op, d), e in ew.items():
        lines.append(f"| {op} | {d} | {_stats(e)} | {_signed(e)} |")
    h = base.host
    lines += [
        "",
        "## Host overhead used by `stream_time` (H200 calibration, reused by the other profiles)",
        "",
        f"- forward: {h.fwd_op_s * 1e6:.1f} µs per aten op; backward: {h.bwd_op_s * 1e6:.1f} µs per node; "
        f"once per backward() call: {h.backward_call_s * 1e6:.0f} µs.",
        f"- {h.source}.",
        "",
        f"_Run time {time.perf_counter() - t_start:.1f} s._",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("MIST_RAW_DATA")
    ap.add_argument("--data", type=Path, default=Path(default) if default else None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "profile_accuracy.md")
    args = ap.parse_args(argv)
    if args.data is None or not (args.data / "gpus").is_dir():
        ap.error("name the raw measurement set (the folder holding gpus/) with --data or MIST_RAW_DATA.")
    text = report(args.data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
