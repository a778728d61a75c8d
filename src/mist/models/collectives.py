"""Tensor-parallel communication used by the model modules.

The autograd functions here are Megatron-style conjugate pairs (identity forward / all-reduce
backward, and the reverse). With `group=None` they are a TP *shard built without a process
group*: the collective is skipped (single process), but it is still announced to observers, so
that `mist.analysis` records every collective the real run would issue, at the place it issues
it. This is the one instrumentation point of the model code.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

Observer = Callable[[str, torch.Tensor, int], None]
_observers: list[Observer] = []


@contextmanager
def observe_collectives(fn: Observer):
    """Call `fn(op_name, tensor, group_size)` for every TP collective issued inside the block."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


class TPGroup:
    """A tensor-parallel group: its size, this rank's index, and the process group (or None)."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} of {size}")
        self.size, self.rank, self.group = size, rank, group

    def __repr__(self) -> str:
        return f"TPGroup(size={self.size}, rank={self.rank}, group={'yes' if self.group else 'none'})"


class VocabShard(torch.nn.Module):
    """Base of the vocabulary-parallel modules: rank r of t holds rows [r·V/t, (r+1)·V/t)."""

    def __init__(self, spec, tp: TPGroup | None):
        super().__init__()
        tp = tp or TPGroup()
        spec.check_tp(tp.size)
        self.spec, self.tp = spec, tp
        self.vocab_local = spec.vocab_size // tp.size
        self.vocab_start = tp.rank * self.vocab_local


def _announce(op: str, x: torch.Tensor, tp: TPGroup) -> None:
    for fn in list(_observers):
        fn(op, x, tp.size)


def all_reduce_(x: torch.Tensor, tp: TPGroup, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over the TP group in place (`op`: "sum" or "max")."""
    if tp.size == 1:
        return x
    _announce("all_reduce", x, tp)
    if tp.group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=tp.group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce_(g.contiguous(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce_(x.contiguous(), tp)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel op)."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel op)."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)
