"""Build helpers: the datasheet figures and the floor-plus-rate fit (installed, `mist.hardware.datasheet`
and `mist.hardware.fitting`, since `mist profile` uses them too), build constants, reading the data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mist.hardware.datasheet import DATASHEET
from mist.hardware.fitting import fit_floor_plus_rate
from mist.units import GiB

__all__ = [
    "DATASHEET",
    "GDDR6_24GB_USABLE_GIB",
    "GiB",
    "MEMORY_OP_FLOOR_S",
    "PCIE_EFFICIENCY",
    "fit_floor_plus_rate",
    "fmt_rate",
    "geomean",
    "read_json",
]

#: Usable memory of the GDDR6 24 GB cards: the Mist artifact's L4 hardware template (22.488 GiB,
#: what nvidia-smi reports with ECC on).
GDDR6_24GB_USABLE_GIB = 22.488

#: Host-link efficiency applied to datasheet PCIe figures where nothing was measured (DATA/README.md §5).
PCIE_EFFICIENCY = 0.8

#: Launch floor of a tiny memory-bound kernel on the GPU (not measurable from the host-bound
#: small-shape rows; typical launch-to-completion of a trivial CUDA kernel). Host overhead is
#: modelled separately (`mist.hardware.host`).
MEMORY_OP_FLOOR_S = 3e-6


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def geomean(values) -> float:
    v = np.asarray(values, float)
    return float(np.exp(np.mean(np.log(v))))


def fmt_rate(bps: float) -> str:
    return f"{bps / 1e9:.0f} GB/s"
