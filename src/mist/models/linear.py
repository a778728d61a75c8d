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
from mist.models.collectives import (
    TPGroup,
    copy_to_tp,
    gather_seq,
    reduce_from_tp,
    scatter_seq,
    scatter_to_sp,
    sp_shared,
)


def _shard(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} {n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class _GatherLinear(torch.autograd.Function):
    """Under sequence parallelism: y = gather(x) Wᵀ + bias from this rank's sequence shard x. Only
    the shard is kept for backward; the backward gathers it again for the weight gradient and
    reduce-scatters the input gradient (Megatron-LM's sequence-parallel linear; Korthikanti et al.
    2022 count the norm outputs at s/t for this reason)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        full = gather_seq(x, tp)
        flat = full.reshape(-1, full.shape[-1])
        y = torch.mm(flat, weight.t()) if bias is None else torch.addmm(bias, flat, weight.t())
        # not a view of y (as F.linear's result is with a bias): the rotary rotates it in place
        return torch.ops.aten._unsafe_view(y, (*full.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[1]:
            full = gather_seq(x, ctx.tp)
            gw = g.reshape(-1, g.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]).to(g.dtype))
            del full
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0)
        if ctx.needs_input_grad[0]:
            gx = scatter_seq(g.matmul(weight.to(g.dtype)), ctx.tp).to(x.dtype)
        return gx, gw, gb, None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias, tp: TPGroup) -> torch.Tensor:
    """F.linear of the gathered sequence shards x (see `_GatherLinear`)."""
    return _GatherLinear.apply(x, weight, bias, tp)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W split by output rows; the input gradient is all-reduced in backward (under
    sequence parallelism the input is this rank's sequence shard: gathered first, and the input
    gradient reduce-scattered)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp = tp
        self.out_local = _shard(out_features, tp, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_local, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sp:
            return gather_linear(x, self.weight, self.bias, self.tp)
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W split by input columns; partial outputs are all-reduced in forward.

    `reduce=False` leaves the partial sum to the caller (Falcon sums attention and MLP partials
    and reduces once). The bias is added after the reduction, once. `act`: the input is the
    pre-activation and `act` is applied here and re-run in backward instead of kept. Under
    sequence parallelism the reduction is a reduce-scatter to this rank's sequence shard.
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
            y = reduce_scatter_or_all_reduce(y, self.tp)
            if self.bias is not None:
                y = y + sp_shared(self.bias, self.tp)
        return y


def reduce_scatter_or_all_reduce(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of a row-parallel op's partial outputs: this rank's sequence shard of it under
    sequence parallelism, the whole of it otherwise."""
    return scatter_to_sp(y, tp) if tp.sp else reduce_from_tp(y, tp)
