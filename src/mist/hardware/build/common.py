"""Shared build helpers: vendor datasheet figures, small robust fits, reading the shared data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

GiB = 2**30

#: NVIDIA datasheet figures (data/README.md §6). Dense bf16/fp16 tensor FLOP/s; memory in GiB as
#: marketed; PCIe is the bidirectional total per GPU (one direction is half).
DATASHEET = {
    "h200": dict(peak_flops=989e12, hbm=4.8e12, memory_gib=141, pcie_total=128e9, label="H200 SXM"),
    "h100": dict(peak_flops=989e12, hbm=3.35e12, memory_gib=80, pcie_total=128e9, label="H100 SXM5"),
    "a100-sxm4-40gb": dict(peak_flops=312e12, hbm=1.555e12, memory_gib=40, pcie_total=64e9, label="A100 SXM4 40GB"),
    "l4": dict(peak_flops=121e12, hbm=300e9, memory_gib=24, pcie_total=64e9, label="L4"),
    # A10G: NVIDIA publishes no sheet; A10 figures, to be read as an upper bound.
    "a10g": dict(peak_flops=125e12, hbm=600e9, memory_gib=24, pcie_total=64e9, label="A10G", sheet="A10 figures, an upper bound for A10G"),
    # V100: fp16 tensor peak (no bf16 on V100).
    "v100-sxm2-32gb": dict(peak_flops=125e12, hbm=900e9, memory_gib=32, pcie_total=32e9, label="V100 SXM2 32GB"),
}

#: Usable memory of the GDDR6 24 GB cards: the Mist artifact's L4 hardware template (22.488 GiB,
#: what nvidia-smi reports with ECC on), reference/mist-system.md §9.2.
GDDR6_24GB_USABLE_GIB = 22.488

#: Host-link efficiency applied to datasheet PCIe figures where nothing was measured (README §5).
PCIE_EFFICIENCY = 0.8

#: Launch floor of a tiny memory-bound kernel on the GPU (not measurable from the host-bound
#: small-shape rows; typical launch-to-completion of a trivial CUDA kernel). Host overhead is
#: modelled separately (`mist.hardware.host`).
MEMORY_OP_FLOOR_S = 3e-6


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def fit_floor_plus_rate(x, t, intercept=True):
    """Fit t ≈ c + x / r with c >= 0 (r > 0), minimizing relative error. Returns (r, c)."""
    x = np.asarray(x, float)
    t = np.asarray(t, float)
    cols = [np.ones_like(x), x] if intercept else [x]
    a = np.stack(cols, axis=1) / t[:, None]
    coef, _ = nnls(a, np.ones_like(t))
    c = coef[0] if intercept else 0.0
    slope = coef[-1]
    return (1.0 / slope if slope > 0 else np.inf), float(c)


def geomean(values) -> float:
    v = np.asarray(values, float)
    return float(np.exp(np.mean(np.log(v))))


def fmt_rate(bps: float) -> str:
    return f"{bps / 1e9:.0f} GB/s"
