"""Roofline profiles of GPUs without measurements, scaled from a measured one by datasheet ratios.

H100 SXM5 from H200: same tensor peak (989 TFLOP/s dense) and clocks, so compute-bound kernels
keep their H200 times; HBM is 3.35 instead of 4.8 TB/s, so memory-bound kernels slow down by
4.8/3.35 and GEMMs are bounded below by their operand traffic at the H100's effective bandwidth
(datasheet × the H200's measured copy efficiency). Flash attention is compute-bound: H200 times.
Host overheads and the PCIe Gen5 host link are assumed equal to the H200 machine's.
"""

from __future__ import annotations

import numpy as np

from mist.hardware.attention import AttentionTable
from mist.hardware.gemm import GemmTable
from mist.hardware.memory_ops import MemoryOpModel
from mist.hardware.profile import GpuProfile
from profile_build.common import DATASHEET, GiB


def scale_from(base: GpuProfile, name: str) -> GpuProfile:
    sheet = DATASHEET[name]
    base_sheet = DATASHEET[base.name]
    bw_ratio = sheet["hbm"] / base_sheet["hbm"]
    flops_ratio = sheet["peak_flops"] / base_sheet["peak_flops"]
    copy_bw = base.fingerprint["copy_bandwidth"] * bw_ratio

    g = base.gemm
    m, n, k = np.meshgrid(g.m_axis, g.n_axis, g.k_axis, indexing="ij")
    traffic = g.element_bytes * (m * k + n * k + m * n) / copy_bw
    gemm = GemmTable(
        g.m_axis,
        g.n_axis,
        g.k_axis,
        np.maximum(g.times_s / flops_ratio, traffic),
        g.floor_s,
        copy_bw,
        source=f"roofline: {base.name} GEMM table / peak ratio {flops_ratio:.2f}, bounded by operand traffic at "
        f"{copy_bw / 1e12:.2f} TB/s",
    )
    a = base.attention
    attention = AttentionTable(
        a.b_axis,
        a.heads_axis,
        a.s_axis,
        a.d_axis,
        a.fwd_s / flops_ratio,
        a.bwd_s / flops_ratio,
        a.fwd_floor_s,
        a.bwd_floor_s,
        source=f"roofline: {base.name} flash table / peak ratio {flops_ratio:.2f} (compute-bound)",
    )
    mo = base.memory_ops
    memory_ops = MemoryOpModel(
        bandwidth={c: {d: v * bw_ratio for d, v in bw.items()} for c, bw in mo.bandwidth.items()},
        floor_s=mo.floor_s,
        sources={c: f"roofline: {base.name} x HBM ratio {bw_ratio:.3f}" for c in mo.bandwidth},
    )
    ratio = base.memory_bytes / (base_sheet["memory_gib"] * GiB)
    return GpuProfile(
        name=name,
        provenance=(f"roofline: datasheet {sheet['label']} figures scaled from measured {base.name} (no measurements)"),
        measured=False,
        memory_bytes=int(sheet["memory_gib"] * GiB * ratio),
        peak_flops=sheet["peak_flops"],
        hbm_bandwidth=sheet["hbm"],
        h2d_bandwidth=base.h2d_bandwidth,
        d2h_bandwidth=base.d2h_bandwidth,
        bidir_bandwidth=base.bidir_bandwidth,
        adam_gpu_s_per_param=base.adam_gpu_s_per_param / bw_ratio,
        adam_cpu_s_per_param=base.adam_cpu_s_per_param,
        gemm=gemm,
        attention=attention,
        memory_ops=memory_ops,
        host=base.host,
        sources={
            "memory_bytes": f"datasheet {sheet['memory_gib']} GB x {ratio:.4f} ({base.name} torch-reported / datasheet)",
            "peak_flops": f"datasheet: {sheet['peak_flops'] / 1e12:.0f} TFLOP/s dense",
            "hbm_bandwidth": f"datasheet: {sheet['hbm'] / 1e12:.2f} TB/s",
            "host_link": f"assumed: {base.name} measured pinned rates (same PCIe generation)",
            "adam": f"scaled: {base.name} GPU AdamW x HBM ratio; CPU AdamW of the {base.name} host",
            "gemm": gemm.source,
            "attention": attention.source,
            "memory_ops": f"roofline: {base.name} bandwidths x {bw_ratio:.3f}",
            "host": f"assumed: {base.name} host calibration",
        },
        fingerprint={"derived_from": base.name, "base_fingerprint": base.fingerprint},
        notes=["not measured: validate with `mist profile` on the target before trusting plans"],
    )
