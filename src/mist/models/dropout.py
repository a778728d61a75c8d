"""Dropout in the blocks and on the embedding output, and the random streams that make it correct
under tensor parallelism and recomputation.

Where. `ModelSpec.attention_dropout` drops the attention probabilities (`mist.models.attention`);
`ModelSpec.hidden_dropout` drops each block's attention and MLP outputs before their residual add
(falcon: their sum, once; `mist.models.block`) and the embedding output, after GPT's learned
positions are added (`mist.models.embedding`), as Megatron-LM (its embedding dropout is
`--hidden-dropout`), GPT-2 (`embd_pdrop`) and GPT-NeoX do. The hidden dropouts all go through
`hidden_dropout` below, which picks their stream.

The op. `dropout` is aten's `native_dropout` called directly: the one operator a GPU runs for
F.dropout, which on a CPU would instead run bernoulli_ and a multiply and keep a mask in the
activation dtype. `native_dropout` keeps a bool mask (1 byte an element) on both, so the CPU
trace of `mist.analysis` and a CPU run keep what a GPU keeps. It drops only in training mode
(`module.training`); evaluation (`eval()`) and a zero probability are the identity, no op.

Two random streams, one rule (Megatron-LM's "model-parallel" RNG tracker, reduced to what Mist's
blocks need):

  shared stream     torch's default generator of the device. Seeded identically on the ranks of
                    one tensor-parallel group, so they draw identical masks for the tensors they
                    hold whole: the hidden dropouts without sequence parallelism, whose inputs
                    (the reduced attention and MLP outputs, the embedding output) are replicated
                    over the group.
  tensor-parallel   a per-rank stream, for the dropouts of what the rank holds alone: the
  stream            attention probabilities of its own heads, and under sequence parallelism
                    the hidden dropouts of its own sequence shard. Only with tp > 1; with one
                    rank the shared stream is already the rank's own. Each draw takes the
                    stream's next seed (a mix of the stream's seed and the draw's number in the
                    step, `rank_seed`) and runs with the device's generator seeded by it, the
                    shared stream's state set aside and put back after. A draw is thus a
                    function of its seed: a recomputed region that is handed the seed its
                    forward took draws the same mask.

`seed_dropout(seed, step, stage, dp_rank, tp_rank)` seeds both at the start of every training
step from the run's seed and the step: the shared stream from (seed, step, stage, dp rank), the
tensor-parallel one from those and the tp rank. Re-seeding per step makes the masks a function of
the step alone, so that a run resumed from a checkpoint draws the masks an uninterrupted run draws,
with no generator state in the checkpoint. Different pipeline stages and data-parallel ranks draw
independent masks (different layers; different samples).

Compiled blocks (`mist.rules.compiled_blocks`): Inductor generates the shared stream's dropouts,
from seeds it draws off the default generator (other masks than eager's, alike on the ranks of a
tensor-parallel group); the tensor-parallel stream's take their seed from the operator
`mist::rank_seed` and draw through `mist::seeded_dropout`, which Inductor runs as they are, and
are eager's.

Recomputation re-runs a forward and must draw the same masks: `checkpoint` below preserves the
default generator's state (torch's `preserve_rng_state`) and the tensor-parallel stream's draw
count (restored around the re-run), only when the model has dropout: otherwise it keeps
`preserve_rng_state=False`, which spares a generator-state copy per call. The attention core
takes its draw's seed before its recomputed region (`mist.models.attention`), so that a compiled
block's partitioner, which re-runs the region's operators in the backward graph, re-runs the
draw with the seed the forward took (kept for backward: a host scalar).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from mist.models.collectives import TPGroup


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """x with each element zeroed with probability p and the rest scaled by 1/(1 − p), in training;
    x itself otherwise (see the module docstring for why `native_dropout`)."""
    if not training or p <= 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


def hidden_dropout(x: torch.Tensor, p: float, tp: TPGroup, training: bool) -> torch.Tensor:
    """The hidden dropout of an activation in the residual stream's layout (a block's reduced
    attention or MLP output, the embedding output): held whole by every TP rank, from the shared
    stream (identical masks); under sequence parallelism this rank's own sequence shard, from the
    tensor-parallel stream. x itself outside training or at p = 0."""
    if not training or p <= 0.0:
        return x
    if not tp.sp:
        return dropout(x, p, True)
    return rank_dropout(x, p, tp)


def rank_dropout(x: torch.Tensor, p: float, tp: TPGroup, seed=None) -> torch.Tensor:
    """x's dropout (training, p > 0) from this rank's tensor-parallel stream: the part of a tensor
    the rank holds alone (its heads' attention probabilities; its sequence shard). `seed`: the
    draw's seed, taken from the stream by the caller (`rank_seed`; the attention core's is taken
    before a recomputed region, so that its re-run draws the same mask); else taken here. With one
    tensor-parallel rank the shared stream is the rank's own. Inside a compiled block the draw is
    one opaque operator, `mist::seeded_dropout`, that draws the mask eager blocks draw: Inductor's
    own dropout draws from the default generator alone (`mist.rules.compiled_blocks`)."""
    if tp.size == 1:
        return dropout(x, p, True)
    if seed is None:
        seed = rank_seed(tp, x)
    if torch.compiler.is_compiling():
        return _seeded_dropout_op(x, p, seed)[0]
    return _seeded_native_dropout(x, p, seed)[0]


def _seeded_native_dropout(x: torch.Tensor, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`native_dropout` of x with the device's generator seeded by `seed`: (output, bool mask). The
    one draw of a rank's own mask, eager or inside `mist::seeded_dropout`."""
    with _seeded(seed, x):
        return torch.native_dropout(x, p, True)


def rank_seed(tp: TPGroup, like: torch.Tensor):
    """The seed of this rank's next draw from its tensor-parallel stream (None with one rank, whose
    draws are the shared stream's): an int, or inside a compiled block a host int64 scalar tensor
    from `mist::rank_seed` (`like`, the tensor the seed is for, orders the draw after it)."""
    if tp.size == 1:
        return None
    if torch.compiler.is_compiling():
        return _rank_seed_op(like)
    return _TP.next_seed()


@torch.library.custom_op("mist::rank_seed", mutates_args=())
def _rank_seed_op(like: torch.Tensor) -> torch.Tensor:
    """The next seed of this rank's tensor-parallel stream, as a host int64 scalar (`like` only
    orders the draw in the graph)."""
    return torch.tensor(_TP.next_seed(), dtype=torch.int64)


@_rank_seed_op.register_fake
def _(like):
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("mist::seeded_dropout", mutates_args=())
def _seeded_dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`native_dropout` of x with the device's generator seeded by `seed` (a host scalar):
    (output, bool mask). A function of its inputs, so a recomputed region may run it again."""
    return _seeded_native_dropout(x, p, int(seed))


@_seeded_dropout_op.register_fake
def _(x, p, seed):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _seeded_dropout_setup(ctx, inputs, output) -> None:
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _seeded_dropout_backward(ctx, grad, _grad_mask):
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - ctx.p)), None, None


_seeded_dropout_op.register_autograd(_seeded_dropout_backward, setup_context=_seeded_dropout_setup)


# ------------------------------------------------------------------ the tensor-parallel stream
class _TPStream:
    """This process's tensor-parallel stream: a seed, and how many draws it has given this step.
    Draw k is made with the device's generator seeded by a mix of the two."""

    def __init__(self) -> None:
        self.seed = 0x6D697374  # until `seed_dropout` (a tracer or a test building shards by hand)
        self.draws = 0

    def next_seed(self) -> int:
        self.draws += 1
        return _mix(self.seed, self.draws - 1)


_TP = _TPStream()


def _generator(like: torch.Tensor) -> torch.Generator:
    """The default generator of `like`'s device."""
    d = like.device
    if d.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if d.index is None else d.index]
    return torch.default_generator


@contextmanager
def _seeded(seed: int, like: torch.Tensor):
    """Inside, the default generator of `like`'s device is seeded by `seed`; after, it is back in
    the state it had before (the shared stream is left where it was)."""
    gen = _generator(like)
    shared = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(shared)


@contextmanager
def tp_stream(tp: TPGroup, like: torch.Tensor):
    """Draw from the tensor-parallel stream inside (one draw: the stream's next seed, for a tensor
    of `like`'s device): the shared stream's state is set aside and comes back unchanged after. A
    no-op with one TP rank."""
    if tp.size == 1:
        yield
        return
    with _seeded(_TP.next_seed(), like):
        yield


def seed_dropout(seed: int, step: int, stage: int, dp_rank: int, tp_rank: int) -> None:
    """Seed this rank's two streams for training step `step` (the rule of the module docstring)."""
    torch.manual_seed(_mix(seed, step, stage, dp_rank))  # every device's default generator
    _TP.seed = _mix(seed, step, stage, dp_rank, "tp", tp_rank)
    _TP.draws = 0


def _mix(*parts) -> int:
    """A 63-bit seed from the parts (distinct parts give unrelated seeds)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# ------------------------------------------------------------------ recomputation
class _Replaying:
    """fn, run first as the forward and then as checkpoint's re-run in backward, drawing from the
    tensor-parallel stream what the forward drew: the stream's draw count at the forward is put
    back for the re-run, and its later count restored after it."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.snapshot = _TP.draws
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            return self.fn(*args)
        later = _TP.draws
        _TP.draws = self.snapshot
        try:
            return self.fn(*args)
        finally:
            _TP.draws = later


def checkpoint(fn, *args, dropout: bool):
    """Reentrant `torch.utils.checkpoint` of fn(*args), replaying fn's dropout masks in the re-run
    when `dropout` (the model has dropout), without the generator-state copies otherwise. Inside a
    compiled block the non-reentrant form, which dynamo traces as a region that the partitioner
    recomputes in the backward graph instead of saving its insides (Inductor's masks there come
    from seeds the forward graph drew and the partitioner keeps: `mist.rules.compiled_blocks`)."""
    if torch.compiler.is_compiling():
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    if not dropout:
        return torch_checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=False)
    return torch_checkpoint(_Replaying(fn), *args, use_reentrant=True, preserve_rng_state=True)
