"""Vendor datasheet figures of the GPUs Mist ships profiles for.

`mist profile` uses them for the peak FLOP/s and HBM bandwidth of a recognised GPU (a measured
GEMM plateau understates the peak used for MFU); the offline profile builders
(`tools/profile_build`) use them for every shipped profile.
"""

from __future__ import annotations

#: NVIDIA datasheet figures. Dense bf16/fp16 tensor FLOP/s; memory in GiB as marketed; PCIe is
#: the bidirectional total per GPU (one direction is half).
DATASHEET = {
    "h200": dict(peak_flops=989e12, hbm=4.8e12, memory_gib=141, pcie_total=128e9, label="H200 SXM"),
    "h100": dict(peak_flops=989e12, hbm=3.35e12, memory_gib=80, pcie_total=128e9, label="H100 SXM5"),
    "a100-sxm4-40gb": dict(peak_flops=312e12, hbm=1.555e12, memory_gib=40, pcie_total=64e9, label="A100 SXM4 40GB"),
    "l4": dict(peak_flops=121e12, hbm=300e9, memory_gib=24, pcie_total=64e9, label="L4"),
    # A10G: NVIDIA publishes no sheet; A10 figures, to be read as an upper bound.
    "a10g": dict(
        peak_flops=125e12,
        hbm=600e9,
        memory_gib=24,
        pcie_total=64e9,
        label="A10G",
        sheet="A10 figures, an upper bound for A10G",
    ),
    # V100: fp16 tensor peak (no bf16 on V100).
    "v100-sxm2-32gb": dict(peak_flops=125e12, hbm=900e9, memory_gib=32, pcie_total=32e9, label="V100 SXM2 32GB"),
}
