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
  tensor-parallel   a per-rank stream, used under `tp_stream(tp)` (a fork: the default
  stream            generator's state is swapped in and out) for the dropouts of what the rank
                    holds alone: the attention probabilities of its own heads, and under sequence
                    parallelism the hidden dropouts of its own sequence shard. Only with tp > 1;
                    with one rank the shared stream is already the rank's own.

`seed_dropout(seed, step, stage, dp_rank, tp_rank)` seeds both at the start of every training
step from the run's seed and the step: the shared stream from (seed, step, stage, dp rank), the
tensor-parallel one from those and the tp rank. Re-seeding per step makes the masks a function of
the step alone, so that a run resumed from a checkpoint draws the masks an uninterrupted run draws,
with no generator state in the checkpoint. Different pipeline stages and data-parallel ranks draw
independent masks (different layers; different samples).

Compiled blocks (`mist.rules.compiled_blocks`): Inductor generates the shared stream's dropouts,
from seeds it draws off the default generator (other masks than eager's, alike on the ranks of a
tensor-parallel group); the tensor-parallel stream's go through `rank_dropout`'s operator
`mist::rank_dropout`, which Inductor runs as it is, and are eager's.

Recomputation re-runs a forward and must draw the same masks: `checkpoint` below preserves the
default generator's state (torch's `preserve_rng_state`) and the tensor-parallel stream's
(a snapshot taken at the forward, restored around the re-run), only when the model has dropout:
otherwise it keeps `preserve_rng_state=False`, which spares a generator-state copy per call.
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


def rank_dropout(x: torch.Tensor, p: float, tp: TPGroup) -> torch.Tensor:
    """x's dropout (training, p > 0) from this rank's tensor-parallel stream: the part of a tensor
    the rank holds alone (its heads' attention probabilities; its sequence shard). Inside a compiled
    block one opaque operator, `mist::rank_dropout`, that draws the same masks: Inductor's own
    dropout draws from the default generator alone (`mist.rules.compiled_blocks`)."""
    if tp.size > 1 and torch.compiler.is_compiling():
        return _rank_dropout_op(x, p)[0]
    with tp_stream(tp, x):
        return dropout(x, p, True)


@torch.library.custom_op("mist::rank_dropout", mutates_args=())
def _rank_dropout_op(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`native_dropout` of x from this rank's tensor-parallel stream: (output, bool mask)."""
    with _rank_stream(x):
        out, mask = torch.native_dropout(x, p, True)
    return out, mask


@_rank_dropout_op.register_fake
def _(x, p):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _rank_dropout_setup(ctx, inputs, output) -> None:
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _rank_dropout_backward(ctx, grad, _grad_mask):
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - ctx.p)), None


_rank_dropout_op.register_autograd(_rank_dropout_backward, setup_context=_rank_dropout_setup)


# ------------------------------------------------------------------ the tensor-parallel stream
class _TPStream:
    """This process's tensor-parallel stream: a seed, and per device the generator state reached."""

    def __init__(self) -> None:
        self.seed = 0x6D697374  # until `seed_dropout` (a tracer or a test building shards by hand)
        self.states: dict[torch.device, torch.Tensor] = {}

    def state(self, device: torch.device) -> torch.Tensor:
        if device not in self.states:
            self.states[device] = torch.Generator(device).manual_seed(self.seed).get_state()
        return self.states[device]


_TP = _TPStream()


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _device(x: torch.Tensor) -> torch.device:
    d = x.device
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


@contextmanager
def tp_stream(tp: TPGroup, like: torch.Tensor):
    """Draw from the tensor-parallel stream inside (for a tensor of `like`'s device): the shared
    stream's state is set aside and comes back unchanged after. A no-op with one TP rank."""
    if tp.size == 1:
        yield
        return
    with _rank_stream(like):
        yield


@contextmanager
def _rank_stream(like: torch.Tensor):
    device = _device(like)
    shared = _get_state(device)
    _set_state(_TP.state(device), device)
    try:
        yield
    finally:
        _TP.states[device] = _get_state(device)
        _set_state(shared, device)


def seed_dropout(seed: int, step: int, stage: int, dp_rank: int, tp_rank: int) -> None:
    """Seed this rank's two streams for training step `step` (the rule of the module docstring)."""
    torch.manual_seed(_mix(seed, step, stage, dp_rank))  # every device's default generator
    _TP.seed = _mix(seed, step, stage, dp_rank, "tp", tp_rank)
    _TP.states.clear()


def _mix(*parts) -> int:
    """A 63-bit seed from the parts (distinct parts give unrelated seeds)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# ------------------------------------------------------------------ recomputation
class _Replaying:
    """fn, run first as the forward and then as checkpoint's re-run in backward, drawing from the
    tensor-parallel stream what the forward drew: the stream's states at the forward are put back
    for the re-run, and the stream's later states restored after it."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.snapshot = dict(_TP.states)  # (tensors get_state made: not mutated in place later)
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            return self.fn(*args)
        later = dict(_TP.states)
        _TP.states.clear()
        _TP.states.update(self.snapshot)
        try:
            return self.fn(*args)
        finally:
            _TP.states.clear()
            _TP.states.update(later)


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
