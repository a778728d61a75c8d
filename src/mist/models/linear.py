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


class _GatherLinears(torch.autograd.Function):
    """Under sequence parallelism: y_i = gather(x) W_iᵀ + b_i from this rank's sequence shard x,
    for column-parallel linears that share x (one; or a Falcon block's QKV and first MLP
    projection; at most two). The shard is gathered once and only the shard is kept for backward; the backward
    gathers it again once for the weight gradients and reduce-scatters the summed input gradient
    once (Megatron-LM's sequence-parallel linear; Korthikanti et al. 2022 count the norm outputs
    at s/t for this reason). Arguments: x, tp, then each linear's weight and bias (or None)."""

    @staticmethod
    def forward(ctx, x, tp, w1, b1, w2=None, b2=None):
        # (named arguments, not *args: dynamo traces this function's forward without grad, under
        # a checkpointed compiled block, and mis-binds ctx with a variable argument list)
        weights, biases = (w1,) if w2 is None else (w1, w2), (b1,) if w2 is None else (b1, b2)
        ctx.tp, ctx.has_bias = tp, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        full = gather_seq(x, tp)
        flat = full.reshape(-1, full.shape[-1])
        outs = []
        for w, b in zip(weights, biases):
            y = torch.mm(flat, w.t()) if b is None else torch.addmm(b, flat, w.t())
            # not a view of y (as F.linear's result is with a bias): the rotary rotates it in place
            outs.append(torch.ops.aten._unsafe_view(y, (*full.shape[:-1], y.shape[-1])))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        x, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads: list = [None] * 4
        flat_g = [g.reshape(-1, g.shape[-1]) for g in gs]
        if any(need[2::2]):
            full = gather_seq(x, ctx.tp)
            full = full.reshape(-1, full.shape[-1])
            for i, g in enumerate(flat_g):
                if need[2 + 2 * i]:
                    grads[2 * i] = g.t().matmul(full.to(g.dtype))
            del full
        for i, g in enumerate(flat_g):
            if ctx.has_bias[i] and need[3 + 2 * i]:
                grads[2 * i + 1] = g.sum(0)
        gx = None
        if need[0]:
            gx = flat_g[0].matmul(weights[0].to(gs[0].dtype))
            for g, w in zip(flat_g[1:], weights[1:]):
                gx = torch.addmm(gx, g, w.to(g.dtype))
            gx = scatter_seq(gx.view(*gs[0].shape[:-1], gx.shape[-1]), ctx.tp).to(x.dtype)
        return (gx, None, *grads)


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias, tp: TPGroup) -> torch.Tensor:
    """F.linear of the gathered sequence shards x (see `_GatherLinears`)."""
    return _GatherLinears.apply(x, tp, weight, bias)[0]


def column_parallel(x: torch.Tensor, linears: list[ColumnParallelLinear], tp: TPGroup) -> list[torch.Tensor]:
    """The outputs of column-parallel linears that share their input x, which enters the
    tensor-parallel region once: one all-reduce of the summed input gradient in backward, or under
    sequence parallelism one gather forward and one gather and reduce-scatter backward
    (`_GatherLinears`)."""
    if tp.sp:
        if len(linears) > 2:
            raise ValueError("column_parallel shares one input between at most two linears")
        return list(_GatherLinears.apply(x, tp, *(t for lin in linears for t in (lin.weight, lin.bias))))
    x = copy_to_tp(x, tp)
    return [F.linear(x, lin.weight, lin.bias) for lin in linears]


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
        return column_parallel(x, [self], self.tp)[0]


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
