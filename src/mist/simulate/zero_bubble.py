"""ZB-H1 pipeline time: each stage's backward split into B (input gradient) and W (weight
gradients), played in the order of `mist.rules.zero_bubble_order`.

Every stage i has a steady forward f[i], input-gradient pass b[i] and weight-gradient pass w[i]
per micro-batch (f + b + w is its 1F1B steady time T), a first micro-batch extra X[i] (the lazy
optimizer step, gathers, swaps) and a last micro-batch extra Y[i] (the final gradient reduction),
on a side stream as in `pipeline`: X runs from the start of the iteration and the stage's first
forward waits for it; Y runs after the stage's last operation — its last W, where the last
gradients appear — without blocking anything.

`zb_event_schedule` plays the order event by event (what `--timeline` draws);
`zb_recurrence` is the same schedule compiled into a recurrence over the operations in
dependency order, vectorized over leading candidate axes — the fast path that `mist simulate`
reports and the tuner's price of a chosen plan (tests hold the two equal on random imbalanced
pipelines). Where the tuner must rank many layer splits it uses the closed form
`zb_iteration_time`, 1F1B's (`pipeline.iteration_time`, T = f + b + w) less the W's that fill
the bubble:

    T_iter = (G − 1)·max_i T_i + Σ_{i<S−1} (f_i + b_i − w_i) + T_{S−1}
             + max(0, max_i (X_i − Σ_{j<i} f_j)) + max(0, max_i (Y_i − Σ_{j<i} (b_j + w_j)))

exact for equal stages and w ≤ f + b: G·(f + b + w) + (S − 1)·(f + b − w), the paper's bubble
(S − 1)(T_F + T_B − T_W) against 1F1B's (S − 1)(T_F + T_B + T_W). Each stage adds its own term
to the sum, so the inter-stage program searches it as it searches 1F1B (`tune.zero_bubble`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mist.rules.zero_bubble_order import (
    FORWARD,
    INPUT_GRAD,
    depends_on,
    held_after_forwards,
    held_at_weight_passes,
    zb_h1,
)
from mist.simulate.op_program import dependency_order, play_stages, stage_key, stage_waits
from mist.simulate.pipeline import iteration_time
from mist.simulate.stage_records import ZeroBubbleHeld


def zb_event_schedule(f, b, w, X, Y, G: int):
    """Start/end of every operation of every stage: (iteration time, events), events as
    (stage, kind, micro-batch, start, end) with kind "F", "B", "W", "X" or "Y". Arguments are
    per-stage sequences."""
    S = len(f)
    orders = [zb_h1(i, S, G) for i in range(S)]
    dur = {FORWARD: f, INPUT_GRAD: b}
    return play_stages(
        orders,
        stage_waits(depends_on, S),
        lambda kind, i: dur.get(kind, w)[i],
        X,
        Y,
        G,
        "ZB-H1",
    )


@lru_cache(maxsize=64)
def _program(S: int, G: int) -> tuple[tuple[int, int, int, bool], ...]:
    """Every stage's operations in one order that respects every dependency (it does not depend
    on the durations), each as (stage, kind 0/1/2 for F/B/W, index of the operation it waits for
    or −1, whether it is the stage's first forward)."""
    orders = [zb_h1(i, S, G) for i in range(S)]
    index: dict = {}
    prog: list[tuple[int, int, int, bool]] = []
    for i, (kind, m), src in dependency_order(orders, stage_waits(depends_on, S), stage_key, "ZB-H1"):
        index[stage_key(i, (kind, m))] = len(prog)
        prog.append((i, "FBW".index(kind), -1 if src is None else index[src], kind == FORWARD and m == 0))
    return tuple(prog)


def zb_recurrence(f, b, w, X, Y, G: int):
    """The event schedule's iteration time, vectorized over leading candidate axes: arrays of
    shape (..., S). The same semantics as `zb_event_schedule` (tests hold them equal)."""
    parts = [np.asarray(a, dtype=np.float64) for a in (f, b, w, X, Y)]
    shape = np.broadcast_shapes(*(a.shape for a in parts))
    f, b, w, X, Y = (np.broadcast_to(a, shape) for a in parts)
    S, lead = shape[-1], shape[:-1]
    dur = (f, b, w)
    clock = [np.zeros(lead) for _ in range(S)]
    ends: list[np.ndarray] = []
    for i, kind, dep, first in _program(S, G):
        start = clock[i] if dep < 0 else np.maximum(clock[i], ends[dep])
        if first:
            start = np.maximum(start, X[..., i])
        end = start + dur[kind][..., i]
        clock[i] = end
        ends.append(end)
    out = np.zeros(lead)
    for i in range(S):
        out = np.maximum(out, clock[i] + Y[..., i])
    return out


def bubble_fill(w):
    """What each stage's W takes off the 1F1B closed form (arrays (..., S)): 2·w_i on every stage
    but the last — its W's are no longer in the fill and drain, where 1F1B has them twice."""
    w = np.asarray(w, dtype=np.float64)
    fill = 2 * w
    fill[..., -1] = 0.0
    return fill


def zb_iteration_time(f, b, w, X, Y, G: int):
    """The closed form above, vectorized over leading candidate axes (arrays (..., S))."""
    f, b, w = (np.asarray(a, dtype=np.float64) for a in (f, b, w))
    T = f + b + w
    return iteration_time(T, G, first=X, last=Y, fwd=f) - bubble_fill(w).sum(axis=-1)


@lru_cache(maxsize=256)
def _held(stage: int, stages: int, G: int, at_w: bool) -> np.ndarray:
    pairs = (held_at_weight_passes if at_w else held_after_forwards)(stage, stages, G)
    return np.array(pairs, dtype=np.float64).reshape(-1, 2)


def _most(pairs: np.ndarray, saved, extra):
    """The pair (held, waiting) of `pairs` that holds the most bytes, per candidate."""
    saved, extra = np.broadcast_arrays(np.asarray(saved, dtype=np.float64), np.asarray(extra, dtype=np.float64))
    if len(pairs) == 0:
        return np.zeros(saved.shape), np.zeros(saved.shape)
    total = saved[..., None] * pairs[:, 0] + extra[..., None] * pairs[:, 1]
    k = np.argmax(total, axis=-1)
    return pairs[k, 0], pairs[k, 1]


def zb_held(stage: int, stages: int, G: int, saved, wg: StageWeightGrad) -> tuple[np.ndarray, ZeroBubbleHeld]:
    """What stage `stage` holds under ZB-H1, with `saved` the saved activations of one
    micro-batch and `wg` its W (`stage_weight_grad`), vectorized over candidates: (earlier
    micro-batches held at its forward peak, a `ZeroBubbleHeld`). At a forward the pair of
    `held_after_forwards` that holds the most bytes; at a W the pair of `held_at_weight_passes`
    (the micro-batch in W counted, no forward running), with W's largest weight gradient on top."""
    earlier, waiting = _most(_held(stage, stages, G, False), saved, wg.waiting_bytes)
    w_held, w_waiting = _most(_held(stage, stages, G, True), saved, wg.waiting_bytes)
    # the first stage runs its backward whole (`runtime.zero_bubble`): a block's node lets go of
    # all it held once it returns (a compiled block runs its W inside), so none is kept beyond a
    # plain backward's
    first = stage == 0
    above = None if first else wg.block_held
    over = None if first else wg.block_b_over
    head_b = None if first else wg.head_b_peak
    return earlier, ZeroBubbleHeld(
        waiting,
        wg.grad_bytes,
        w_held,
        w_waiting,
        wg.transient_bytes,
        above,
        over,
        wg.head_held,
        head_b,
        wg.keeps_input and not first,
    )


@dataclass(frozen=True)
class StageWeightGrad:
    """One micro-batch's W on a stage (arrays over micro-batch sizes): its seconds, what the
    micro-batch keeps from B to W beyond the blocks' saved activations (the output gradients W
    reads, less the saved tensors W does not read, which B lets go of on a stage after the first;
    the head's included), and the head's saved activations (last stage; else 0), which a
    micro-batch waiting for its W keeps too — under 1F1B the last stage frees them at once."""

    seconds: np.ndarray
    grad_bytes: np.ndarray
    head_saved_bytes: np.ndarray
    transient_bytes: np.ndarray  # the most it adds at once over what it starts with (`stage_weight_grad`)
    # through the blocks' B (the graph kept: a stage after the first): what one block keeps once
    # its own B is done, beyond its saved activations (below 0: it let go of those W does not
    # read); what a block's B holds at its peak over its plain backward's
    # (`LayerTerms.b_pass_over`; None: priced as the plain backward); and what the head keeps
    # from its B (the saved activations W reads and its output gradients)
    block_held: np.ndarray | None = None
    block_b_over: np.ndarray | None = None
    head_held: np.ndarray | float = 0.0
    # the head's B peak where B runs without its weight gradient and lets go (None: its plain
    # backward's); whether a micro-batch past its B keeps its received input: the autograd graph
    # kept to W holds it (the leaf of the stage's input gradient), though B let go of it as saved
    head_b_peak: np.ndarray | None = None
    keeps_input: bool = False

    @property
    def waiting_bytes(self) -> np.ndarray:
        """What a micro-batch waiting for its W holds beside the stage's saved activations."""
        return self.grad_bytes + self.head_saved_bytes

    def with_grad_handling(self, grads_per_microbatch) -> np.ndarray:
        """W's seconds with the gradient handling the parameters' gradients trigger (the flat
        units' per-micro-batch adds or copies, `StageResult.grads_per_microbatch`): the runtime
        runs it where they appear, in W, not in B."""
        return self.seconds + np.asarray(grads_per_microbatch, dtype=np.float64)


def stage_weight_grad(model, b, layers, recompute, first: bool, last: bool, lets_go: bool = True) -> StageWeightGrad:
    """W of one micro-batch of a stage of `model` (a `simulate.stage.StageModel`), vectorized
    over the micro-batch sizes `b`: its blocks that are not recomputed whole (a checkpointed
    block's backward runs whole inside B), with the embedding's on the first stage and the head's
    on the last (`simulate.weight_grad`). `lets_go`: the engine lets go in B of the saved tensors
    W does not read (`rules.zero_bubble_order.lets_go_in_b`; a split compiled block is priced so
    either way: only Mist's runtime splits one)."""
    b = np.asarray(b, dtype=np.float64)
    blk, ix = model._terms("block", b)
    plain = np.asarray(layers, dtype=np.float64) - np.asarray(recompute, dtype=np.float64)
    w = plain * blk.wgrad[ix]
    head = head_held = np.zeros_like(w)
    head_b = None
    if first:
        # the first stage runs its backward whole (`runtime.zero_bubble`): its largest weight
        # gradient with nothing released, and nothing of it kept beyond a plain backward's
        held = plain * blk.wgrad_held[ix]
        out = np.where(plain > 0, blk.wgrad_out[ix], 0.0)
        for part, on in (("pre", True), ("post", last)):
            if on:
                lt, jx = model._terms(part, b)
                w, held = w + lt.wgrad[jx], held + lt.wgrad_held[jx]
                out = np.maximum(out, lt.wgrad_out[jx])
                if part == "post":
                    head, head_held = lt.saved[jx], lt.saved[jx] + lt.wgrad_held[jx]
        return StageWeightGrad(w, held, head, out, blk.wgrad_held[ix], None, head_held)
    # a later stage's B lets go of the saved tensors W does not read (`runtime.activations`), so a
    # micro-batch past its B keeps of each layer what W reads and the output gradients W takes;
    # W runs node by node, the blocks' in order and then the head's, each releasing what it read
    # (`analysis.weight_pass`), so the most it adds at once is a block's, or the head's less what
    # the blocks released before it
    assert blk.saved_unread_by_w is not None and blk.wgrad_freed_kept is not None, "layer_terms sets them"
    unread = blk.saved_unread_by_w[ix] if lets_go else 0.0
    freed = blk.wgrad_freed[ix] if lets_go else blk.wgrad_freed_kept[ix]
    held = plain * (blk.wgrad_held[ix] - unread)
    out = np.where(plain > 0, blk.wgrad_peak[ix], 0.0)
    if last:
        lt, jx = model._terms("post", b)
        assert lt.saved_unread_by_w is not None, "layer_terms sets it"
        gone = lt.saved_unread_by_w[jx] if lets_go else 0.0
        w, held = w + lt.wgrad[jx], held + lt.wgrad_held[jx] - gone
        out = np.maximum(out, lt.wgrad_peak[jx] - plain * freed)
        head, head_held = lt.saved[jx], lt.saved[jx] - gone + lt.wgrad_held[jx]
        if lets_go and lt.b_pass_over is not None:  # its B, without its weight gradient
            head_b = lt.bwd_peak[jx] + lt.b_pass_over[jx]
    # B's peaks are traced as Mist's runtime runs B (an eager layer's letting go, a split block's
    # graph); an engine that keeps every saved tensor is priced with the plain backward's
    over = None if blk.b_pass_over is None or not (lets_go or blk.split) else blk.b_pass_over[ix]
    return StageWeightGrad(w, held, head, out, blk.wgrad_held[ix] - unread, over, head_held, head_b, lets_go)


def split_backward(T, fwd, w):
    """Per stage (F, B, W) from a stage's steady time T, its forward part and its W seconds: B is
    the rest of the backward (W at most the whole backward)."""
    T, fwd = np.asarray(T, dtype=np.float64), np.asarray(fwd, dtype=np.float64)
    bwd = T - fwd
    w = np.minimum(np.asarray(w, dtype=np.float64), bwd)
    return fwd, bwd - w, w
