"""The L4 operator database of the original Mist runtime (`gpus/l4/op-db/*.json`, DATA/README.md
§3.4) and the calibrations of the L4 profile it justifies.

The op-db was recorded by the original runtime's own profiler (CUDA-event timings of each
operator, fp16, GPT-1.3B shapes at micro-batch 1–8), on the machines whose training runs the
profile is meant to predict. The Aceso op-profiles the L4 profile is fitted on are host wall-clock
around synchronized loops (§3.1 caveat 7) from another profiling run; on the shapes both sources
hold they disagree (`benchmarks/decomposition.py`). Where the op-db times the very kernel the
profile prices, the op-db is taken as the reference:

* GEMM: the Aceso-fitted table's above-floor time is scaled by the median of op-db / table over
  every `fused_dense_func` row (forward: one GEMM; backward: dX + dW). The shape dependence stays
  the Aceso fit's (it spans 1.3B–22B; the op-db only 1.3B).
* Binary pointwise (the `binary` class: residual adds, products): floor + bytes / bandwidth fitted
  to the op-db `add` rows (`_operator.add`, `torch.add`: one aten add of two fp16 tensors), with
  the aten-level byte count (two inputs + one output), on rows whose bytes exceed twice the L2
  cache (smaller rows are served from the 48 MB L2 or host-bound).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from profile_build.common import MEMORY_OP_FLOOR_S, fit_floor_plus_rate, read_json

#: L4 L2 cache (NVIDIA Ada L4 datasheet: 48 MB). Pointwise rows whose bytes fit in twice this are
#: partly served from cache and are not used for a DRAM bandwidth.
L4_L2_BYTES = 48 * 2**20
ELEM = 2  # fp16
_SHAPE = re.compile(r"'(\w+)': TensorSpec\(shape=\(([\d, ]*)\)")
DENSE = "mist.modules.fused_dense.fused_dense_func"
ADDS = ("_operator.add", "torch.add")


def shapes(key: str) -> dict:
    """{argument name: shape tuple} of an op-db key (a NodeSpec text)."""
    return {name: tuple(int(v) for v in dims.split(",") if v.strip()) for name, dims in _SHAPE.findall(key)}


def rows(op_db: Path, stem: str) -> list[tuple[dict, float, float]]:
    """[(shapes, fwd_s, bwd_s)] of one op-db file (median times)."""
    path = Path(op_db) / f"{stem}.json"
    return [(shapes(k), v["fwd"][1], v["bwd"][1]) for k, v in read_json(path).items()]


def dense_gemms(op_db: Path) -> list[tuple[tuple, float, float]]:
    """[((m, n, k), fwd_s, bwd_s)] of the op-db linear layers: y[m,n] = x[m,k] w[n,k]ᵀ."""
    out = []
    for sh, fwd, bwd in rows(op_db, DENSE):
        x, w = sh["x"], sh["weight"]
        out.append(((int(np.prod(x[:-1])), int(w[0]), int(w[1])), fwd, bwd))
    return out


def gemm_scale(op_db: Path, gemm_time, floor_s: float) -> tuple[float, dict]:
    """Median of (op-db − floors) / (table − floors) over the linear rows, forward and backward
    (dX (m,k,n) + dW (n,k,m)); the factor to apply to the table's above-floor time."""
    ratios = []
    for (m, n, k), fwd, bwd in dense_gemms(op_db):
        pf = float(gemm_time(m, n, k))
        pb = float(gemm_time(m, k, n)) + float(gemm_time(n, k, m))
        ratios.append((fwd - floor_s) / (pf - floor_s))
        ratios.append((bwd - 2 * floor_s) / (pb - 2 * floor_s))
    r = np.asarray(ratios)
    return float(np.median(r)), {"points": len(r), "min": float(r.min()), "max": float(r.max())}


def binary_bandwidth(op_db: Path) -> tuple[float, dict]:
    """DRAM bandwidth (B/s) of the aten add kernel: t − floor = bytes / bw on the op-db add rows
    larger than 2 × L2 (forward times: the kernel the profile prices in both phases)."""
    x, t = [], []
    for stem in ADDS:
        for sh, fwd, _ in rows(op_db, stem):
            a = next(iter(sh.values()))
            nbytes = 3 * int(np.prod(a)) * ELEM  # two inputs + one output
            if nbytes > 2 * L4_L2_BYTES:
                x.append(nbytes)
                t.append(fwd - MEMORY_OP_FLOOR_S)
    bw, _ = fit_floor_plus_rate(np.asarray(x, float), np.asarray(t, float), intercept=False)
    return float(bw), {"points": len(x), "bytes": [min(x), max(x)]}
