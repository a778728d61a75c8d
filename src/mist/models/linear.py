"""Tensor-parallel linear layers (Megatron-style column and row parallelism).

A layer holds only its rank's shard; `full_weight_slice` tells which slice of the full
(unsharded) weight that is, so that a single-process model and its TP shards can be initialised
identically (the runtime copies slices of one seeded full model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.checkpointing import act_linear
from mist.models.collectives import TPGroup, copy_to_tp, reduce_from_tp


def _shard(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} {n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W split by output rows; the input gradient is all-reduced in backward."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp = tp
        self.out_local = _shard(out_features, tp, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_local, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W split by input columns; partial outputs are all-reduced in forward.

    `reduce=False` leaves the partial sum to the caller (Falcon sums attention and MLP partials
    and reduces once). The bias is added after the reduction, once. `act`: the input is the
    pre-activation and `act` is applied here and re-run in backward instead of kept.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool,
        dtype: torch.dtype,
        device=None,
        reduce: bool = True,
    ):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.in_local = _shard(in_features, tp, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor, act=None) -> torch.Tensor:
        y = F.linear(x, self.weight) if act is None else act_linear(x, self.weight, act)
        if self.reduce:
            y = reduce_from_tp(y, self.tp)
            if self.bias is not None:
                y = y + self.bias
        return y
