"""Build L4 / A100 / A10G / V100 profiles from the Aceso op-profiles (plus op-db, overlap-bench).

GEMM model, fitted per GPU on the communication-free forward rows (linears at t = 1 with both
partition algorithms, column-parallel linears at t > 1, attention score/context bmm at every t)::

    t = t0 + (2·M·n·k) / R + 2·(β_w·n·k + β_x·M·k + β_y·M·n),      M = batch · m

a launch floor plus a compute term plus one traffic term per operand (a smoothed roofline;
non-negative least squares on relative error, rows off by > 50 % from a first fit dropped as
outliers). It is evaluated on a log2 grid and stored as a GEMM table, so lookups behave like the
measured H200 table. Backward rows are not used for the fit: on L4/A100/V100 they lack the
weight-gradient GEMM.

Memory-bound classes (layernorm, softmax, attention dropout, bias-gelu, bias-dropout-add) get
``t = floor + bytes / bw`` per direction with the aten-level byte counts of `aceso.row_terms`
(the same 3 µs launch floor as every profile; a free intercept came out at 0–40 µs, small next
to these rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from mist.hardware.gemm import GemmTable
from mist.hardware.memory_ops import CLASSES, MemoryOpModel
from mist.hardware.profile import GpuProfile
from profile_build import aceso, flash, op_db
from profile_build.common import (
    DATASHEET,
    GDDR6_24GB_USABLE_GIB,
    MEMORY_OP_FLOOR_S,
    PCIE_EFFICIENCY,
    GiB,
    fit_floor_plus_rate,
)
from profile_build.hostlink import fit_host_link

GRID_M = [2.0**i for i in range(7, 18)]  # 128 … 131072
GRID_NK = [2.0**i for i in range(5, 18)]  # 32 … 131072
OUTLIER_LOG_RATIO = np.log(1.5)
LINEAR_ROWS = ("enc-attention-qkv", "enc-attention-dense", "enc-MLP-GEMM-1", "enc-MLP-GEMM-2")
BMM_ROWS = ("enc-attention-score", "enc-attention-context")
MEMORY_ROWS = {
    "layernorm": ("enc-1st-layernorm", "enc-2nd-layernorm"),
    "softmax": ("enc-attention-softmax",),
    "dropout": ("enc-attention-dropout",),
    "gelu": ("enc-MLP-gelu",),
    "binary": ("enc-post-attention-dropout", "enc-post-MLP-dropout"),
}


# ---------------------------------------------------------------------------- samples
def _fwd_gemm_samples(profiles, seq, wgrad):
    """(m, n, k, batch, t) of communication-free forward GEMM rows."""
    out = []
    for p in profiles:
        for op in LINEAR_ROWS + BMM_ROWS:
            fwd_s = p.times.get(op, (None, None))[0]
            if fwd_s is None or not aceso.comm_free(op, p.t, p.algo, backward=False):
                continue
            if op in BMM_ROWS and p.algo != 0:  # algo only changes linears: avoid duplicates
                continue
            fwd_terms, _ = aceso.row_terms(op, p.hidden, p.heads, seq, p.b, p.t, wgrad)
            ((_, m, n, k, batch),) = fwd_terms
            out.append((m, n, k, batch, fwd_s))
    return np.array(out, float)


def _features(m, n, k, batch, elem=2):
    mm = m * batch
    return np.stack([2.0 * mm * n * k, elem * n * k, elem * mm * k, elem * mm * n], axis=-1)


def fit_gemm(samples: np.ndarray, t0: float):
    """NNLS of t - t0 = features · (1/R, 1/bw_w, 1/bw_x, 1/bw_y) on relative error, one outlier pass."""
    m, n, k, batch, t = samples.T
    feats = _features(m, n, k, batch)
    keep = np.ones(len(t), dtype=bool)
    for _ in range(2):
        coef, _ = nnls(feats[keep] / t[keep, None], 1.0 - t0 / t[keep])
        pred = t0 + feats @ coef
        keep = np.abs(np.log(pred / t)) < OUTLIER_LOG_RATIO
    resid = np.log(pred[keep] / t[keep])
    return coef, {"n": int(len(t)), "outliers": int((~keep).sum()), "rms_log_err": float(np.sqrt(np.mean(resid**2)))}


def gemm_table(coef, t0: float, roofline_bw: float, source: str, extra: dict) -> GemmTable:
    m, n, k = np.meshgrid(GRID_M, GRID_NK, GRID_NK, indexing="ij")
    times = t0 + _features(m, n, k, 1.0) @ coef
    inv = lambda v: (1.0 / v) if v > 0 else None  # noqa: E731
    extra = dict(extra)
    extra.update(
        {
            "model": "t = t0 + 2MNK/R + 2(NK/bw_w + MK/bw_x + MN/bw_y)",
            "t0_s": t0,
            "R_flops": inv(coef[0]),
            "bw_w": inv(coef[1]),
            "bw_x": inv(coef[2]),
            "bw_y": inv(coef[3]),
        }
    )
    return GemmTable(GRID_M, GRID_NK, GRID_NK, times, t0, roofline_bw, source=source, extra=extra)


def _memory_samples(profiles, seq, rows):
    """{(fwd|bwd): (bytes, t)} for the given memory-bound rows (communication-free only)."""
    out = {"fwd": ([], []), "bwd": ([], [])}
    for p in profiles:
        if p.algo != 0:  # memory-bound rows are identical across algos
            continue
        for op in rows:
            if op not in p.times:
                continue
            fwd_terms, bwd_terms = aceso.row_terms(op, p.hidden, p.heads, seq, p.b, p.t, False)
            for key, terms, idx in (("fwd", fwd_terms, 0), ("bwd", bwd_terms, 1)):
                t = p.times[op][idx]
                if t is None or not aceso.comm_free(op, p.t, p.algo, key == "bwd"):
                    continue
                if p.t > 1 and op in ("enc-1st-layernorm", "enc-2nd-layernorm"):
                    continue
                out[key][0].append(terms[0][2])
                out[key][1].append(t)
    return out


def fit_memory_classes(profiles, seq, hbm: float):
    """Effective bandwidth per class and direction: t = floor + bytes / bw, capped at the datasheet HBM."""
    bw, src = {}, {}
    for cls, rows in MEMORY_ROWS.items():
        samples = _memory_samples(profiles, seq, rows)
        bw[cls] = {}
        for key, (x, t) in samples.items():
            x, t = np.array(x), np.array(t) - MEMORY_OP_FLOOR_S
            rate, _ = fit_floor_plus_rate(x, t, intercept=False)
            keep = np.abs(np.log(x / rate / t)) < OUTLIER_LOG_RATIO  # robust pass
            rate, _ = fit_floor_plus_rate(x[keep], t[keep], intercept=False)
            bw[cls][key] = min(rate, hbm)
        capped = [k for k in ("fwd", "bwd") if bw[cls][k] == hbm]
        src[cls] = f"fitted: op-profile rows {', '.join(rows)} ({len(samples['fwd'][0])} fwd samples)" + (
            f"; {'/'.join(capped)} capped at datasheet HBM bandwidth" if capped else ""
        )
    return bw, src


# ---------------------------------------------------------------------------- profile
def build(
    data: Path,
    gpu: str,
    h200: GpuProfile,
    exclude_sizes=(),
    flash_calib: dict | None = None,
) -> GpuProfile:
    """Profile of `gpu` (a key of `aceso.GPUS`) from its op-profiles, omitting `exclude_sizes`."""
    data = Path(data)
    cfg = aceso.GPUS[gpu]
    gpu_dir = data / "gpus" / gpu
    sheet = DATASHEET[gpu]
    profiles = [p for p in aceso.read_profiles(gpu_dir, cfg["folders"]) if p.size not in exclude_sizes]
    sizes = sorted({p.size for p in profiles}, key=aceso.SIZE_ORDER.index)
    seq = cfg["seq"]
    copy_eff = h200.fingerprint["copy_bandwidth"] / h200.hbm_bandwidth
    roofline_bw = sheet["hbm"] * copy_eff

    # GEMM
    t0 = h200.gemm.floor_s
    samples = _fwd_gemm_samples(profiles, seq, cfg["wgrad_in_bwd"])
    coef, stats = fit_gemm(samples, t0)
    source = (
        f"fitted: {gpu} Aceso op-profiles fp16 seq {seq} ({stats['n']} forward GEMM rows of sizes "
        f"{'/'.join(sizes)}, {stats['outliers']} outliers dropped, rms log error "
        f"{stats['rms_log_err']:.3f}); floor t0 assumed = H200 measured F.linear floor"
    )
    own_db = gpu_dir / "op-db"
    if own_db.is_dir():  # the original runtime's own timings of the same kernels (op_db.py)
        fitted = gemm_table(coef, t0, roofline_bw, source=source, extra=stats)
        scale, info = op_db.gemm_scale(own_db, fitted.time, t0)
        coef = coef * scale
        stats = dict(stats, op_db_scale=scale)
        source += (
            f"; above-floor time x{scale:.3f} = median op-db / fit over the {info['points']} op-db linear "
            f"timings (fwd, dX + dW; range {info['min']:.2f}-{info['max']:.2f})"
        )
    gemm = gemm_table(coef, t0, roofline_bw, source=source, extra=stats)
    plateau = float(gemm.flops_rate(8192, 8192, 8192))

    # attention
    eff = flash.h200_efficiency(h200.attention, h200.gemm.extra["plateau_flops"])
    if flash_calib is None:  # own FA2 timings: calibrated against this profile's plateau (op_db.py)
        flash_calib = flash.l4_flash_calibration(
            data / "gpus" / "l4" / "op-db",
            eff,
            h200.attention.s_axis,
            h200.attention.d_axis,
            gemm_rate=plateau if own_db.is_dir() else None,
        )
    kind = "FlashAttention-2 measured on L4 (op-db)" if gpu == "l4" else "L4 FlashAttention-2 calibration reused"
    if gpu.startswith("v100"):
        kind += "; V100 (sm70) has no FlashAttention-2, SDPA would use the memory-efficient kernel: likely optimistic"
    attention = flash.synthesize(
        h200.attention,
        eff,
        plateau,
        {"fwd": flash_calib["fwd"], "bwd": flash_calib["bwd"]},
        source=(
            f"scaled: H200 flash efficiency per (s, d) x {gpu} GEMM plateau {plateau / 1e12:.0f} TFLOP/s x "
            f"kernel calibration fwd {flash_calib['fwd']:.2f} / bwd {flash_calib['bwd']:.2f} ({kind}); "
            "floors = H200's"
        ),
    )

    # memory-bound ops
    bw, src = fit_memory_classes(profiles, seq, sheet["hbm"])
    src["binary"] += " (Megatron fused bias-dropout-add, used as the binary pointwise class)"
    if own_db.is_dir():  # the aten add kernel itself, timed by the original runtime (op_db.py)
        rate, info = op_db.binary_bandwidth(own_db)
        bw["binary"] = {"fwd": min(rate, sheet["hbm"]), "bwd": min(rate, sheet["hbm"])}
        src["binary"] = (
            f"fitted: op-db add rows ({info['points']} rows of {info['bytes'][0] / 2**20:.0f}-{info['bytes'][1] / 2**20:.0f} MiB "
            "> 2x L2; two inputs + one output), both directions"
        )
    bw["rmsnorm"], src["rmsnorm"] = bw["layernorm"], "proxy: layernorm class (no RMSNorm rows)"
    bw["swiglu"], src["swiglu"] = bw["gelu"], "proxy: bias-gelu class (no SwiGLU rows)"
    bw["cross_entropy"], src["cross_entropy"] = (
        bw["softmax"],
        "proxy: softmax class (post-process row mixes the LM-head GEMM)",
    )
    measured = ("layernorm", "softmax", "dropout", "gelu", "binary")
    bw["elementwise"] = {d: float(np.median([bw[c][d] for c in measured])) for d in ("fwd", "bwd")}
    src["elementwise"] = "generic fallback: median of the fitted classes"
    bw["copy"], src["copy"] = bw["elementwise"], "proxy: generic elementwise"
    assert set(bw) == set(CLASSES)
    memory_ops = MemoryOpModel(bandwidth=bw, floor_s=MEMORY_OP_FLOOR_S, sources=src)

    # host link
    link = fit_host_link(gpu_dir / "overlap-bench") if (gpu_dir / "overlap-bench").is_dir() else None
    if link is None:
        one_way = sheet["pcie_total"] / 2 * PCIE_EFFICIENCY
        h200_bidir_ratio = h200.bidir_bandwidth / (h200.h2d_bandwidth + h200.d2h_bandwidth)
        link = {
            "h2d": one_way,
            "d2h": one_way,
            "bidir": 2 * one_way * h200_bidir_ratio,
            "source": (
                f"datasheet: PCIe {sheet['pcie_total'] / 1e9:.0f} GB/s total -> {one_way / 1e9:.1f} GB/s per "
                f"direction (x{PCIE_EFFICIENCY}); both ways x{h200_bidir_ratio:.2f} as on H200; one GPU alone, "
                "not shared"
            ),
        }

    # memory capacity
    ratio = h200.memory_bytes / (DATASHEET["h200"]["memory_gib"] * GiB)
    if sheet["memory_gib"] == 24:
        memory = int(GDDR6_24GB_USABLE_GIB * GiB)
        mem_src = f"Mist artifact L4 template: {GDDR6_24GB_USABLE_GIB} GiB usable of 24 GB GDDR6" + (
            "" if gpu == "l4" else " (assumed same for A10G)"
        )
    else:
        memory = int(sheet["memory_gib"] * GiB * ratio)
        mem_src = f"datasheet {sheet['memory_gib']} GB x {ratio:.4f} (H200 torch-reported / datasheet)"

    adam_gpu = h200.adam_gpu_s_per_param * h200.hbm_bandwidth / sheet["hbm"]
    wgrad = "includes" if cfg["wgrad_in_bwd"] else "excludes"
    return GpuProfile(
        name=gpu,
        provenance=(
            f"fitted: {sheet['label']} Aceso op-profiles (Mist artifact, fp16, seq {seq}; sizes {'/'.join(sizes)}); "
            "attention scaled from H200"
        ),
        measured=True,
        memory_bytes=memory,
        peak_flops=sheet["peak_flops"],
        hbm_bandwidth=sheet["hbm"],
        h2d_bandwidth=float(link["h2d"]),
        d2h_bandwidth=float(link["d2h"]),
        bidir_bandwidth=float(link["bidir"]),
        adam_gpu_s_per_param=adam_gpu,
        adam_cpu_s_per_param=h200.adam_cpu_s_per_param,
        gemm=gemm,
        attention=attention,
        memory_ops=memory_ops,
        host=h200.host.__class__(
            fwd_op_s=h200.host.fwd_op_s,
            bwd_op_s=h200.host.bwd_op_s,
            backward_call_s=h200.host.backward_call_s,
            source="assumed: H200 host calibration (this GPU's host was not measured in a host-bound regime)",
        ),
        sources={
            "memory_bytes": mem_src,
            "peak_flops": f"datasheet: {sheet.get('sheet', sheet['label'])} dense fp16 tensor "
            f"{sheet['peak_flops'] / 1e12:.0f} TFLOP/s",
            "hbm_bandwidth": f"datasheet: {sheet.get('sheet', sheet['label'])} {sheet['hbm'] / 1e9:.0f} GB/s",
            "host_link": link["source"],
            "adam": (
                "scaled: H200 fused AdamW x HBM bandwidth ratio (GPU); borrowed: the H200 host's "
                "measured step of the runtime's fused host AdamW (CPU; this GPU's host unknown; "
                "one process of 16 threads alone on its host: a node's ranks stepping at once "
                "share its memory bandwidth, not modelled here)"
            ),
            "gemm": gemm.source,
            "attention": attention.source,
            "memory_ops": "fitted: op-profile memory-bound rows (see memory_ops.sources)",
            "host": "assumed: H200 host calibration",
            "linear_backward": f"op-profile linear backward {wgrad} the weight-gradient GEMM (not used for fitting)",
        },
        fingerprint={
            "source": f"data/gpus/{gpu}/{'+'.join(cfg['folders'])}",
            "dtype": "fp16",
            "seq": seq,
            "gemm_plateau_flops": plateau,
        },
        notes=[
            "op-profile times are host wall-clock around synchronized loops (README 3.1.7)",
        ],
    )
