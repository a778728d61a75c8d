"""Reading the Aceso op-profiles (`op-profiles*/gpt_<size>_mbs<b>_tp<t>_algo<k>.csv`,
DATA/README.md §3.1) and describing each GPT-layer row as the kernels it runs.

Caveats applied here: times are µs (converted to s); values >= 1e6 are sentinels (missing);
rows are fp16; TP communication is inside t > 1 rows, so only communication-free rows are used
at t > 1 (column-parallel forward linears, attention bmm/softmax/dropout, gelu); the linear
backward excludes the weight-gradient GEMM on L4/A100/V100 but includes it on A10G.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

#: hidden size and attention heads per model-size tag (DATA/README.md §3.1, inferred from the sizes)
GPT_SHAPES = {
    "1_3B": (2048, 32),
    "2_6B": (2560, 32),
    "6_7B": (4096, 32),
    "13B": (5120, 40),
    "20B": (6144, 64),
    "22B": (6144, 64),
    "40B": (8192, 64),
}
SIZE_ORDER = list(GPT_SHAPES)
ELEM = 2  # fp16 bytes

#: Per GPU folder: sequence length, whether linear backward includes dW, op-profile folders.
GPUS = {
    "l4": dict(seq=2048, wgrad_in_bwd=False, folders=("op-profiles",)),
    "a100-sxm4-40gb": dict(seq=4096, wgrad_in_bwd=False, folders=("op-profiles", "op-profiles-larger-models")),
    "a10g": dict(seq=2048, wgrad_in_bwd=True, folders=("op-profiles",)),
    "v100-sxm2-32gb": dict(seq=2048, wgrad_in_bwd=False, folders=("op-profiles",)),
}

SENTINEL = 1e6
_NAME = re.compile(r"gpt_(?P<size>.+)_mbs(?P<b>\d+)_tp(?P<t>\d+)_algo(?P<algo>\d)\.csv$")

#: the GPT-layer rows the profiles and the leave-one-out study use, with their op class
LAYER_OPS = {
    "enc-attention-qkv": "linear",
    "enc-attention-dense": "linear",
    "enc-MLP-GEMM-1": "linear",
    "enc-MLP-GEMM-2": "linear",
    "enc-attention-score": "bmm",
    "enc-attention-context": "bmm",
    "enc-attention-softmax": "softmax",
    "enc-attention-dropout": "dropout",
    "enc-1st-layernorm": "layernorm",
    "enc-2nd-layernorm": "layernorm",
    "enc-MLP-gelu": "gelu",
}


@dataclass(frozen=True)
class OpProfile:
    """One CSV: a model size at micro-batch b, TP degree t, partition algorithm."""

    size: str
    b: int
    t: int
    algo: int
    folder: str
    times: dict  # op_name -> (fwd_s or None, bwd_s or None)

    @property
    def hidden(self) -> int:
        return GPT_SHAPES[self.size][0]

    @property
    def heads(self) -> int:
        return GPT_SHAPES[self.size][1]


def _seconds(text: str):
    v = float(text)
    return None if v >= SENTINEL or v <= 0 else v * 1e-6


def read_profiles(gpu_dir: Path, folders) -> list[OpProfile]:
    out = []
    for folder in folders:
        for path in sorted((Path(gpu_dir) / folder).glob("gpt_*.csv")):
            m = _NAME.search(path.name)
            if not m:
                continue
            with path.open() as fh:
                times = {
                    r["op_name"]: (_seconds(r["forward-compute"]), _seconds(r["backward-compute"]))
                    for r in csv.DictReader(fh)
                }
            out.append(OpProfile(m["size"], int(m["b"]), int(m["t"]), int(m["algo"]), folder, times))
    return out


# ---------------------------------------------------------------------------- kernels per row
def gemm(m, n, k, batch=1):
    return ("gemm", m, n, k, batch)


def mem(cls, nbytes):
    return ("mem", cls, nbytes)


def linear_terms(m, n, k, wgrad):
    """y[m,n] = x[m,k] w[n,k]^T: forward, backward (dX, + dW if the profile included it)."""
    bwd = [gemm(m, k, n)] + ([gemm(n, k, m)] if wgrad else [])
    return [gemm(m, n, k)], bwd


def row_terms(op: str, h: int, heads: int, seq: int, b: int, t: int, wgrad: bool):
    """(forward kernels, backward kernels) of one GPT-layer row at TP degree t (column split)."""
    m = b * seq
    d = h // heads
    batch = b * heads // t
    T = m * h * ELEM  # one [b·s, h] activation
    S = b * (heads // t) * seq * seq * ELEM  # one attention-probability tensor
    F = m * (4 * h // t) * ELEM  # one MLP-intermediate tensor
    if op == "enc-attention-qkv":
        return linear_terms(m, 3 * h // t, h, wgrad)
    if op == "enc-attention-dense":
        return linear_terms(m, h, h // t, wgrad)
    if op == "enc-MLP-GEMM-1":
        return linear_terms(m, 4 * h // t, h, wgrad)
    if op == "enc-MLP-GEMM-2":
        return linear_terms(m, h, 4 * h // t, wgrad)
    if op == "enc-attention-score":  # q kᵀ: dQ = dS k, dK = dSᵀ q
        return [gemm(seq, seq, d, batch)], [gemm(seq, d, seq, batch), gemm(seq, d, seq, batch)]
    if op == "enc-attention-context":  # p v: dP = dO vᵀ, dV = pᵀ dO
        return [gemm(seq, d, seq, batch)], [gemm(seq, seq, d, batch), gemm(seq, d, seq, batch)]
    if op == "enc-attention-softmax":  # fused scale-mask-softmax: y = f(x); dx = f(dy, y)
        return [mem("softmax", 2 * S)], [mem("softmax", 3 * S)]
    if op == "enc-attention-dropout":  # y, uint8 mask; dx = dy * mask
        return [mem("dropout", 2.5 * S)], [mem("dropout", 2.5 * S)]
    if op in ("enc-1st-layernorm", "enc-2nd-layernorm", "final-layernorm"):
        return [mem("layernorm", 2 * T)], [mem("layernorm", 3 * T)]
    if op == "enc-MLP-gelu":  # Megatron bias-gelu: dx = f(dy, x)
        return [mem("gelu", 2 * F)], [mem("gelu", 3 * F)]
    if op in ("enc-post-attention-dropout", "enc-post-MLP-dropout"):  # bias-dropout-add
        return [mem("binary", 3.5 * T)], [mem("binary", 2.5 * T)]
    raise KeyError(op)


def comm_free(op: str, t: int, algo: int, backward: bool) -> bool:
    """Whether the row's time at TP degree t contains no collective (DATA/README.md §3.1 caveat 2)."""
    if t == 1:
        return True
    if op in ("enc-attention-qkv", "enc-MLP-GEMM-1"):  # column-parallel with algo 0
        return algo == 0 and not backward
    if op in ("enc-attention-dense", "enc-MLP-GEMM-2"):  # row-parallel: forward all-reduce
        return False
    if op in (
        "enc-attention-score",
        "enc-attention-context",
        "enc-attention-softmax",
        "enc-attention-dropout",
        "enc-MLP-gelu",
    ):
        return True
    return False  # layernorms/dropouts around the block may carry sequence-parallel comm


def predict(profile, terms, backward: bool) -> float:
    """Sum of the predicted kernel times of one row."""
    total = 0.0
    for term in terms:
        if term[0] == "gemm":
            total += float(profile.gemm_time(*term[1:]))
        else:
            total += float(profile.memory_op_time(term[1], term[2], backward))
    return total
