"""Flash-attention tables for GPUs without a measured flash grid.

The shape dependence comes from the H200 table: for each (s, d) the efficiency of the H200
flash kernel relative to the H200 GEMM plateau, e(s, d) (median over its GPU-bound rows). A target
GPU's kernel time is then ``floor + FLOPs / (e(s, d) · plateau_target · calib)``, where
``plateau_target`` is the target's large-GEMM FLOP/s and ``calib`` corrects for the kernel
generation: the H200 kernel (torch 2.11 on sm90) is relatively faster than FlashAttention-2 on
Ampere/Ada. ``calib`` is measured on L4 from the Mist op-db (FlashAttention-2 fp16 forward and
backward versus the op-db's own fused_dense GEMMs, same run and clocks) and reused, labelled, for
other GPUs without flash data.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mist.hardware.attention import AttentionTable
from profile_build.common import read_json

FWD_GPU_BOUND_S = 0.1e-3  # H200 rows above these times are taken as GPU-bound
BWD_GPU_BOUND_S = 0.3e-3


def h200_efficiency(table: AttentionTable, plateau: float) -> dict:
    """{"fwd"|"bwd": e[s_index, d_index]}: flash FLOP/s (causal-effective) / GEMM plateau."""
    b, h, s, d = np.meshgrid(table.b_axis, table.heads_axis, table.s_axis, table.d_axis, indexing="ij")
    flops = AttentionTable.causal_flops(b, h, s, d)
    out = {}
    for key, times, bound in (("fwd", table.fwd_s, FWD_GPU_BOUND_S), ("bwd", table.bwd_s, BWD_GPU_BOUND_S)):
        rate = flops / times / plateau
        e = np.zeros((len(table.s_axis), len(table.d_axis)))
        for i in range(len(table.s_axis)):
            for j in range(len(table.d_axis)):
                r = rate[:, :, i, j]
                ok = times[:, :, i, j] >= bound
                e[i, j] = np.median(r[ok]) if ok.any() else r.max()
        out[key] = e
    return out


def synthesize(h200_table: AttentionTable, eff: dict, plateau: float, calib: dict, source: str) -> AttentionTable:
    """Attention table on the H200 axes for a GPU with GEMM plateau `plateau` (FLOP/s)."""
    t = h200_table
    b, h, s, d = np.meshgrid(t.b_axis, t.heads_axis, t.s_axis, t.d_axis, indexing="ij")
    flops = AttentionTable.causal_flops(b, h, s, d)
    times = {}
    for key, floor in (("fwd", t.fwd_floor_s), ("bwd", t.bwd_floor_s)):
        e = eff[key][None, None, :, :] * calib[key]
        times[key] = floor + flops / (e * plateau)
    return AttentionTable(
        b_axis=t.b_axis,
        heads_axis=t.heads_axis,
        s_axis=t.s_axis,
        d_axis=t.d_axis,
        fwd_s=times["fwd"],
        bwd_s=times["bwd"],
        fwd_floor_s=t.fwd_floor_s,
        bwd_floor_s=t.bwd_floor_s,
        source=source,
        extra={"plateau_flops": plateau, "calib": dict(calib)},
    )


_SHAPE = re.compile(r"'(\w+)': TensorSpec\(shape=\(([\d, ]+)\)")


def _shapes(key: str) -> dict:
    return {name: tuple(int(v) for v in dims.split(",") if v.strip()) for name, dims in _SHAPE.findall(key)}


def l4_flash_calibration(op_db: Path, eff: dict, s_axis, d_axis, gemm_rate: float | None = None) -> dict:
    """calib[fwd|bwd] = (FA2 rate / GEMM rate) / e_H200(s, d), median over the op-db points.

    gemm_rate: the L4 GEMM plateau the table will be synthesized with (building the L4 profile
    itself: the synthesized table then reproduces the measured FA2 points); None: the median rate
    of the op-db's own linear layers (same run and clocks; the ratio reused for other GPUs)."""
    op_db = Path(op_db)
    if gemm_rate is None:
        dense = read_json(op_db / "mist.modules.fused_dense.fused_dense_func.json")
        rates = []
        for key, v in dense.items():
            sh = _shapes(key)
            x, w = sh["x"], sh["weight"]
            m = int(np.prod(x[:-1]))
            n, k = w
            rates.append(2.0 * m * n * k / v["fwd"][1])
        gemm_rate = float(np.median(rates))
    flash = read_json(op_db / "mist.modules.flash_attn.flash_attn_qkvpacked_func.json")
    ratios = {"fwd": [], "bwd": []}
    for key, v in flash.items():
        b, s, _, heads, d = _shapes(key)["qkv"]
        flops = float(AttentionTable.causal_flops(b, heads, s, d))
        i = int(np.argmin(np.abs(np.log(np.asarray(s_axis, float) / s))))
        j = int(np.argmin(np.abs(np.log(np.asarray(d_axis, float) / d))))
        for key2 in ("fwd", "bwd"):
            ratios[key2].append(flops / v[key2][1] / gemm_rate / eff[key2][i, j])
    calib = {k: float(np.median(v)) for k, v in ratios.items()}
    calib["gemm_rate"] = gemm_rate
    calib["points"] = len(flash)
    return calib
