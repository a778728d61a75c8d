"""Tensor-parallel communication used by the model modules.

The autograd functions here are Megatron-style conjugate pairs (identity forward / all-reduce
backward, and the reverse; all-gather of the sequence forward / reduce-scatter backward, and the
reverse, for sequence parallelism). With `group=None` they are a TP *shard built without a process
group*: the collective is skipped (single process), but it is still announced to observers, so
that `mist.analysis` records every collective the real run would issue, at the place it issues
it. This is the one instrumentation point of the model code.

Every collective a real run issues (here and in the runtime's flat units) is issued inside
`issuing()`, a profiler range: what gloo allocates there is its own copies, which NCCL does not
make, and a CPU run's allocator trace leaves them out (`runtime.allocator_trace`). While a trace
records, each collective also settles once done (`settled`), so that the tensors it read or wrote
are released on the caller's thread, where the trace sees it. Compiled blocks issue functional
collectives instead, whose waits Inductor's code calls by name; those settle too (`settling`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

Observer = Callable[[str, torch.Tensor, int], None]
_observers: list[Observer] = []
ISSUING = "mist::collective"


_settle_s = 0.0  # set while a CPU run's allocator trace records (`settling`)


@contextmanager
def issuing() -> Iterator[None]:
    """The profiler range a collective is issued in (module docstring); a synchronous collective
    settles as it ends (`settled`)."""
    with torch.profiler.record_function(ISSUING):
        yield
    settled()


def settled() -> None:
    """Called once a collective is done, while its caller still holds the collective's tensors:
    while an allocator trace records, gloo's worker thread is given the moment it takes to drop
    its work, so that the tensors are released where the trace sees it
    (`runtime.allocator_trace.GLOO_SETTLE_S`); otherwise nothing."""
    if _settle_s:
        time.sleep(_settle_s)


@contextmanager
def settling(seconds: float) -> Iterator[None]:
    """Collectives settle for `seconds` once done, inside the block, also those of compiled
    blocks (`_settling_compiled_waits`)."""
    global _settle_s
    before, _settle_s = _settle_s, seconds
    undo = _settling_compiled_waits() if seconds else None
    try:
        yield
    finally:
        if undo is not None:
            undo()
        _settle_s = before


def _settling_compiled_waits() -> Callable[[], None]:
    """Make the waits of compiled graphs settle (`settled`) until the returned function is called.

    A compiled block's collective is a functional one (`_compiled_sum` and the like): Inductor's
    code issues it, waits with `torch.ops._c10d_functional.wait_tensor.default`, looked up by name
    at each call, and can drop the reduced tensor right after (a block's last all-reduce: one
    fused kernel later, when the graph returns). Gloo's worker thread holds the tensor in its work
    until it drops the work, so the release could be its, unseen by the trace. The name is bound
    to a wait that settles while the graph still holds the tensor — but only outside compilation:
    Inductor's passes recognise the wait by that same attribute (`node.target is …default`), so
    while dynamo or AOTAutograd compiles (a frame, or a backward compiled at its first call) the
    operator itself is bound there.

    Inductor also reads the name once, outside any compilation: its lowerings are keyed by the
    operators the packet holds when `torch._inductor.lowering` is first imported, which
    `torch.compile` does as a block is wrapped. Imported while the settling wait was bound, the
    real wait had no lowering: Inductor ran it as an opaque kernel whose output it took for a new
    buffer and handed the reduced tensor's memory to a later result while a saved tensor still
    viewed it (wrong gradients and 4 MiB less saved per tensor-parallel GPT block of the CPU loop),
    and stored that code in its cache, where later runs of the same graph found it. So the
    lowerings are registered first."""
    import torch._inductor.lowering  # noqa: F401  (lazy: only a traced CPU run settles)
    from torch._dynamo.callback import callback_handler

    packet = torch.ops._c10d_functional.wait_tensor
    wait = packet.default
    if not isinstance(wait, torch._ops.OpOverload):  # within another `settling`: bound already
        return lambda: None

    def settling_wait(t: torch.Tensor) -> torch.Tensor:
        out = wait(t)
        settled()
        return out

    def bind_settling(_args=None) -> None:
        packet.default = settling_wait

    def bind_operator(_args=None) -> None:
        packet.default = wait

    callback_handler.register_start_callback(bind_operator)
    callback_handler.register_end_callback(bind_settling)
    bind_settling()

    def undo() -> None:
        callback_handler.remove_start_callback(bind_operator)
        callback_handler.remove_end_callback(bind_settling)
        bind_operator()

    return undo


@contextmanager
def observe_collectives(fn: Observer):
    """Call `fn(op_name, tensor, group_size)` for every TP collective issued inside the block."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


class CPGroup:
    """A context-parallel group: its size, this rank's index, and the process group (or None: a
    shard built without one, as `mist.analysis` traces it; the collectives are then announced
    but skipped)."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid context-parallel rank {rank} of {size}")
        self.size, self.rank, self.group = size, rank, group

    def __repr__(self) -> str:
        return f"CPGroup(size={self.size}, rank={self.rank}, group={'yes' if self.group else 'none'})"


class TPGroup:
    """A tensor-parallel group: its size, this rank's index, and the process group (or None).

    `sequence_parallel` (Megatron-style, Korthikanti et al. 2022): between the tensor-parallel
    regions — norms, residuals, the block's input and output — each rank holds 1/size of the
    sequence, [b, s/size, h]; a column-parallel linear all-gathers its input (and keeps only the
    shard for backward, re-gathering it there), a row-parallel linear reduce-scatters its output.
    Only meaningful with size > 1 (`sp` is False otherwise).

    `cp`: the context-parallel group this rank's TP group sits in (`mist.models.context_parallel`):
    the layers then hold 2 of the sequence's 2·cp chunks; attention and the position tables use it.
    """

    def __init__(
        self, size: int = 1, rank: int = 0, group=None, sequence_parallel: bool = False, cp: CPGroup | None = None
    ):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} of {size}")
        self.size, self.rank, self.group = size, rank, group
        self.sp = bool(sequence_parallel) and size > 1
        self.cp = cp or CPGroup()

    def __repr__(self) -> str:
        sp = ", sequence_parallel" if self.sp else ""
        return f"TPGroup(size={self.size}, rank={self.rank}, group={'yes' if self.group else 'none'}{sp})"


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


# ------------------------------------------------------------------ inside a compiled block
# Dynamo traces PyTorch's functional collectives (`_c10d_functional`: a new output tensor, then a
# wait) into the graphs AOTAutograd hands to Inductor, so a compiled block's collectives are graph
# operators that the analysis reads where they run (`mist.analysis.compiled`). A shard built without
# a process group (the analysis's capture) names none: its graphs are traced, never run.
UNGROUPED = "mist-no-process-group"


def _group_name(g: TPGroup | CPGroup) -> str:
    return UNGROUPED if g.group is None else g.group.group_name


def _compiled_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    f = torch.ops._c10d_functional
    return f.wait_tensor(f.all_reduce(x, "sum", _group_name(tp)))


def _compiled_gather(x: torch.Tensor, g: TPGroup | CPGroup) -> torch.Tensor:
    """[t·b, ...]: the ranks' x concatenated along dim 0 (t = g.size)."""
    f = torch.ops._c10d_functional
    return f.wait_tensor(f.all_gather_into_tensor(x, g.size, _group_name(g)))


def _compiled_scatter(chunks: torch.Tensor, g: TPGroup | CPGroup) -> torch.Tensor:
    """This rank's slice of the sum of [t·b, ...] along dim 0 (t = g.size)."""
    f = torch.ops._c10d_functional
    return f.wait_tensor(f.reduce_scatter_tensor(chunks, "sum", g.size, _group_name(g)))


def all_reduce_(x: torch.Tensor, tp: TPGroup, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over the TP group in place (`op`: "sum" or "max")."""
    if tp.size == 1:
        return x
    if torch.compiler.is_compiling():  # a new tensor: callers inside blocks take the result
        if op != "sum":
            raise ValueError("compiled blocks reduce by sum only")
        return _compiled_sum(x, tp)
    _announce("all_reduce", x, tp)
    if tp.group is not None:
        with issuing():
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


# ------------------------------------------------------------------ sequence parallelism
# The sequence is dimension 1 of the [b, s, ...] activations. A collective's announced tensor is
# its full buffer (all-gather: the gathered output; reduce-scatter: the unreduced input), the
# bytes the ring model `hardware.collectives` is written in.


def gather_stacked(x: torch.Tensor, g: TPGroup | CPGroup) -> torch.Tensor:
    """Every rank's x in one [g.size, *x.shape] buffer (an all-gather over g; inside a compiled
    block the functional one)."""
    if torch.compiler.is_compiling():
        return _compiled_gather(x.contiguous(), g).view(g.size, *x.shape)
    buf = x.new_empty((g.size, *x.shape))
    _announce("all_gather", buf, g)
    if g.group is not None:
        x = x.contiguous()
        with issuing():
            dist.all_gather(list(buf.unbind(0)), x, group=g.group)
    return buf


def gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[b, s/t, ...] shards → [b, s, ...] on every rank: the shards gathered into one [t, b, s/t,
    ...] buffer, then laid out sequence-major (a copy, unless b = 1, where it is a view)."""
    buf = gather_stacked(x, tp)
    b, sl = x.shape[0], x.shape[1]
    return buf.transpose(0, 1).reshape(b, tp.size * sl, *x.shape[2:])


def scatter_seq(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[b, s, ...] partial sums → this rank's [b, s/t, ...] shard of their sum: the sequence
    chunks laid out rank-major (a copy, unless b = 1), then reduce-scattered."""
    b, s = y.shape[0], y.shape[1]
    if s % tp.size:
        raise ValueError(f"sequence length {s} is not divisible by tensor-parallel size {tp.size}")
    chunks = y.reshape(b, tp.size, s // tp.size, *y.shape[2:]).transpose(0, 1).contiguous()
    if torch.compiler.is_compiling():
        return _compiled_scatter(chunks.flatten(0, 1), tp)
    _announce("reduce_scatter", chunks, tp)
    out = chunks.new_empty(chunks.shape[1:])
    if tp.group is not None:
        with issuing():
            dist.reduce_scatter(out, list(chunks.unbind(0)), group=tp.group)
    return out


def own_chunk(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's sequence chunk of a [b, s, ...] tensor every rank holds whole (no collective)."""
    n = x.shape[1] // tp.size
    return x[:, tp.rank * n : (tp.rank + 1) * n].contiguous()


def _conjugate(name: str, forward, backward) -> type:
    """An autograd function running forward(x, tp) and, on the gradient, backward(g, tp)."""

    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, g):
        return backward(g, ctx.tp), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_ScatterToSP = _conjugate("_ScatterToSP", scatter_seq, gather_seq)
_SplitToSP = _conjugate("_SplitToSP", own_chunk, gather_seq)
_GatherFromSP = _conjugate("_GatherFromSP", gather_seq, own_chunk)
_SumGradOverTP = _conjugate("_SumGradOverTP", lambda p, tp: p.view_as(p), lambda g, tp: all_reduce_(g.contiguous(), tp))


def scatter_to_sp(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Reduce-scatter of partial sums forward, all-gather of the gradient backward (the output of
    a row-parallel op under sequence parallelism)."""
    return _ScatterToSP.apply(y, tp)


def split_to_sp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's chunk of a tensor every rank holds whole forward, all-gather backward."""
    return _SplitToSP.apply(x, tp)


def gather_from_sp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather of the shards forward; backward, this rank's chunk of a gradient that every rank
    holds whole."""
    return _GatherFromSP.apply(x, tp)


def sp_shared(p: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """A parameter every rank holds whole but, under sequence parallelism, applies to its own
    sequence chunk only (norm weights, biases added after a reduce-scatter): its gradient is the
    sum of the ranks' partial gradients, all-reduced in backward where it is made."""
    return _SumGradOverTP.apply(p, tp) if tp.sp else p
