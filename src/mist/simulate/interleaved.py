"""Interleaved 1F1B pipeline time: p ranks of v chunks each (`mist.rules.interleaved_order`).

Every chunk (r, c) has a steady forward f[r, c] and backward b[r, c] per micro-batch, a first
micro-batch extra X[r, c] (its share of the lazy optimizer step, swaps) and a last micro-batch
extra Y[r, c] (its final gradient reduction), as a stage has in `pipeline`. The extras run on a
rank's side stream: the X of its chunks one after another from the start of the iteration, chunk
c's first forward waiting for X[r, 0..c]; each chunk's Y after its last backward, without
blocking compute.

`interleaved_event_schedule` plays the exact order; `interleaved_iteration_time` is the fast path
the tuner and `mist simulate` use, the 1F1B closed form over chunk-ops:

    T_iter = (G·v − 1)·max_r t_r + Σ_r t_r
             + max(0, max_r (X_r − Σ_{j<r} f_j)) + max(0, max_r (Y_r − Σ_{j<r} b_j))

with t_r = (1/v)·Σ_c (f + b)[r, c] a rank's mean chunk time (the bottleneck rank runs G·v of
them, the others fill and drain the pipeline once, each rank for one chunk), f_j, b_j the mean
chunk forward and backward, X_r the rank's first-chunk extra X[r, 0] and Y_r its first chunk's
(the rank's last backward is chunk 0's) — plus what the other chunks' extras add beyond the
time their first forward (last backward) leaves them, which the closed form takes as
max(0, X[r, c] − c·p·t_r) summed over c ≥ 1. With v = 1 it is `pipeline.iteration_time`. It
reduces to the inter-stage program's form, so `tune.inter.best_split` searches it unchanged
(`rank_summary` gives the per-rank inputs). Tests hold it against the event schedule on random
imbalanced pipelines.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from mist.rules.interleaved_order import (
    chunks_in_flight,
    depends_on,
    held_after_forwards,
    interleaved_one_f_one_b,
)
from mist.rules.interleaved_sends import (
    FREES,
    KEEPS,
    WAITS,
    HeldSends,
    held_at_ops,
    held_beside,
    held_sends,
    kept_outputs,
)
from mist.rules.pipeline_order import FORWARD
from mist.simulate.op_program import dependency_order
from mist.simulate.pipeline import iteration_time
from mist.simulate.stage_records import HeldStates


def rank_summary(f, b, X, Y, ranks: int):
    """Per-rank inputs of the closed form from per-chunk arrays of shape (..., v): the mean chunk
    time t, its forward part, and the rank's effective first and last extras."""
    f, b = np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64)
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    v = f.shape[-1]
    t = (f + b).mean(axis=-1)
    # a later chunk's first forward comes c·p chunk-ops after chunk 0's (its last backward the
    # same before chunk 0's): that much of its extra hides
    lead = np.arange(v) * ranks * t[..., None]
    x = X[..., 0] + np.maximum(0.0, X[..., 1:] - lead[..., 1:]).sum(axis=-1)
    y = Y[..., 0] + np.maximum(0.0, Y[..., 1:] - lead[..., 1:]).sum(axis=-1)
    return t, f.mean(axis=-1), x, y


def interleaved_iteration_time(f, b, X, Y, G: int):
    """Fast path: arrays of shape (..., p, v) (rank, chunk); vectorized over leading axes."""
    f = np.asarray(f, dtype=np.float64)
    p, v = f.shape[-2], f.shape[-1]
    t, fm, x, y = rank_summary(f, b, X, Y, p)
    return iteration_time(t, G * v, first=x, last=y, fwd=fm)


def _key(rank: int, op: tuple) -> tuple:
    kind, m, c = op
    return (kind, rank, c, m)


def _depends(ranks: int, chunks: int):
    return lambda r, op: depends_on(op[0], op[1], r, op[2], ranks, chunks)


def interleaved_event_schedule(f, b, X, Y, G: int):
    """Start/end of every chunk-op of every rank: (iteration time, events), events as
    (rank, kind, micro-batch, start, end, chunk), kind "F", "B", "X" or "Y". Arguments are
    per-chunk lists of lists [rank][chunk]."""
    p, v = len(f), len(f[0])
    orders = [interleaved_one_f_one_b(r, p, v, G) for r in range(p)]
    # the side stream's X: chunk c's first forward waits for X[r, 0..c]
    x_ready = [np.cumsum(X[r]).tolist() for r in range(p)]
    events: list = []
    for r in range(p):
        start = 0.0
        for c in range(v):
            if X[r][c] > 0:
                events.append((r, "X", 0, start, start + X[r][c], c))
            start += X[r][c]
    done: dict = {}
    clock = [0.0] * p
    last_b = [[0.0] * v for _ in range(p)]
    for r, (kind, m, c), src in dependency_order(orders, _depends(p, v), _key, "interleaved 1F1B"):
        dep = 0.0 if src is None else done[src]
        if kind == FORWARD:
            if m == 0:
                dep = max(dep, x_ready[r][c])
            dur = f[r][c]
        else:
            dur = b[r][c]
        s = max(clock[r], dep)
        done[(kind, r, c, m)] = s + dur
        clock[r] = s + dur
        events.append((r, kind, m, s, s + dur, c))
        if kind != FORWARD:
            last_b[r][c] = s + dur
    ends = []
    for r in range(p):
        side = 0.0
        for c in sorted(range(v), key=lambda c: last_b[r][c]):
            s = max(side, last_b[r][c])
            side = s + Y[r][c]
            if Y[r][c] > 0:
                events.append((r, "Y", G - 1, s, side, c))
        ends.append(max(clock[r], side))
    return max(ends), events


@lru_cache(maxsize=64)
def _program(p: int, v: int, G: int) -> tuple:
    """The chunk-ops of every rank in one order that respects every dependency (it does not depend
    on the durations), each as (rank, chunk, forward?, index of the op it waits for or −1, whether
    it is the chunk's first forward). Found by playing the orders as `interleaved_event_schedule`
    does, without times."""
    orders = [interleaved_one_f_one_b(r, p, v, G) for r in range(p)]
    index: dict = {}
    prog: list[tuple[int, int, bool, int, bool]] = []
    for r, (kind, m, c), src in dependency_order(orders, _depends(p, v), _key, "interleaved 1F1B"):
        fwd = kind == FORWARD
        index[(kind, r, c, m)] = len(prog)
        prog.append((r, c, fwd, -1 if src is None else index[src], fwd and m == 0))
    return tuple(prog)


def interleaved_recurrence(f, b, X, Y, G: int):
    """The event schedule's iteration time as a recurrence over the chunk-ops in dependency order,
    vectorized over leading candidate axes: arrays of shape (..., p, v). The same semantics as
    `interleaved_event_schedule` (tests hold them equal); what `mist simulate` reports for an
    interleaved plan and what the tuner's final price of one is."""
    f, b = np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64)
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    p, v = f.shape[-2], f.shape[-1]
    lead = np.broadcast_shapes(f.shape, b.shape, X.shape, Y.shape)[:-2]
    x_ready = np.cumsum(np.broadcast_to(X, lead + (p, v)), axis=-1)
    clock = [np.zeros(lead) for _ in range(p)]
    last_b = np.zeros(lead + (p, v))
    ends: list[np.ndarray] = []
    for r, c, fwd, dep, first in _program(p, v, G):
        start = clock[r] if dep < 0 else np.maximum(clock[r], ends[dep])
        if first:
            start = np.maximum(start, x_ready[..., r, c])
        end = start + (f[..., r, c] if fwd else b[..., r, c])
        clock[r] = end
        ends.append(end)
        if not fwd:
            last_b[..., r, c] = end
    # each rank's side stream runs its chunks' Y in the order their last backwards end (the
    # interleaved order ends chunk v − 1 first, chunk 0 last)
    Yb = np.broadcast_to(Y, lead + (p, v))
    out = np.zeros(lead)
    for r in range(p):
        side = np.zeros(lead)
        for c in range(v - 1, -1, -1):
            side = np.maximum(side, last_b[..., r, c]) + Yb[..., r, c]
        out = np.maximum(out, np.maximum(clock[r], side))
    return out


@lru_cache(maxsize=256)
def _held(rank: int, ranks: int, v: int, G: int) -> np.ndarray:
    return np.array(held_after_forwards(rank, ranks, v, G), dtype=np.float64)


def held_saved_peak(rank: int, ranks: int, G: int, saved) -> np.ndarray:
    """The most saved-activation bytes rank `rank` holds under the interleaved order, the chunk it
    runs included: `saved` (..., v) is what one micro-batch keeps on each chunk (vectorized over
    leading candidate axes). With equal chunks it is `chunks_in_flight` times a chunk's."""
    saved = np.asarray(saved, dtype=np.float64)
    return np.einsum("...v,mv->...m", saved, _held(rank, ranks, saved.shape[-1], G)).max(axis=-1)


def interleaved_in_flight(rank: int, ranks: int, G: int, saved):
    """`StageInput.in_flight` of an interleaved rank (the stage model's count of earlier
    micro-batches held, each the rank's whole saved activations): its `held_saved_peak` in
    whole-rank micro-batches, less the one it runs. A rank that keeps no saved activations on the
    device (all offloaded) counts its chunks in flight as equal shares (for its host memory)."""
    saved = np.asarray(saved, dtype=np.float64)
    v = saved.shape[-1]
    total = saved.sum(axis=-1)
    equal = np.full(total.shape, chunks_in_flight(rank, ranks, v, G) / v)
    held = np.divide(held_saved_peak(rank, ranks, G, saved), total, out=equal, where=total > 0)
    return held - 1


def beside_embedding(ranks: int, G: int, saved, sends: str) -> HeldStates:
    """Rank 0's `HeldStates` beside the embedding: the other micro-batch chunks it holds as each
    forward of its first chunk starts and each backward of it ends, as `saved` (..., v) weighs
    them, with its sends held then (`sends`: how its engine holds them,
    `rules.interleaved_sends.held_beside`)."""
    saved = np.asarray(saved, dtype=np.float64)
    return _weighed(held_beside(0, ranks, saved.shape[-1], G, 0, sends), saved)


def held_at_blocks(rank: int, ranks: int, G: int, saved, sends: str, chunk: int | None = None) -> HeldStates:
    """Rank `rank`'s `HeldStates` at its blocks: the micro-batch chunks it holds as each of its
    forwards and backwards starts (of `chunk` only, if given: the last rank's last chunk, where the
    head runs), the operation's own included, as `saved` (..., v) weighs them, with its sends held
    then (`rules.interleaved_sends.held_at_ops`)."""
    saved = np.asarray(saved, dtype=np.float64)
    return _weighed(held_at_ops(rank, ranks, saved.shape[-1], G, sends, chunk), saved)


def held_states(
    rank: int, ranks: int, G: int, saved, sends: str, first: bool = True, last: bool = True
) -> tuple[HeldStates | None, HeldStates, HeldStates | None]:
    """The `HeldStates` an interleaved rank's memory is priced with (`StageInput`'s and
    `compose`'s `beside_embedding`, `at_blocks`, `at_head`): beside the embedding on rank 0 (of
    the model's first stage, `first`), at its blocks, at the head's chunk on the last rank (of
    its last, `last`)."""
    saved = np.asarray(saved, dtype=np.float64)
    head = saved.shape[-1] - 1
    return (
        beside_embedding(ranks, G, saved, sends) if rank == 0 and first else None,
        held_at_blocks(rank, ranks, G, saved, sends),
        held_at_blocks(rank, ranks, G, saved, sends, head) if rank == ranks - 1 and last else None,
    )


def _weighed(states, saved: np.ndarray) -> HeldStates:
    """`HeldStates` of (forward, backward) `HeldBeside` states: each state's chunks weighed by
    their saved bytes per micro-batch `saved` (..., v), in whole-rank micro-batches
    (`interleaved_in_flight`'s unit; equal shares where a rank keeps none on the device)."""
    v = saved.shape[-1]
    total = saved.sum(axis=-1)

    def weigh(side) -> tuple:
        out = []
        for h in side:
            n = np.asarray(h.others, dtype=np.float64)
            equal = np.full(total.shape, n.sum() / v)
            out.append((np.divide(saved @ n, total, out=equal, where=total > 0), h.outputs, h.gradients))
        return tuple(out)

    fwd, bwd = states
    return HeldStates(weigh(fwd), weigh(bwd))


def interleaved_rank_input(st, rank: int, ranks: int, G: int, saved):
    """An interleaved rank's `StageInput` from its plain one `st`: its in-flight count and its
    chunks (v, the last axis of its chunks' `saved` per micro-batch), which set what it holds
    beside its saved activations (each chunk's last unit, every in-flight output where its engine
    keeps them), and what it holds of its sends where it holds them as Mist's runtime does
    (`st.holds_sends`); what it holds as each operation starts, where its blocks peak; rank 0 also
    what it holds where the embedding runs, the last rank where the head does."""
    saved = np.asarray(saved, dtype=np.float64)
    v = saved.shape[-1]
    beside, at_blocks, at_head = held_states(rank, ranks, G, saved, _sends(st), st.first, st.last)
    return replace(
        st,
        in_flight=float(interleaved_in_flight(rank, ranks, G, saved)),
        chunks=v,
        held_sends=rank_sends(st, rank, ranks, v, G),
        beside_embedding=beside,
        at_blocks=at_blocks,
        at_head=at_head,
    )


def rank_sends(st, rank: int, ranks: int, chunks: int, G: int) -> HeldSends:
    """What an interleaved rank holds of its sends (`rules.pipeline_outputs`): as Mist's runtime
    waits for them (`st.holds_sends`), every in-flight chunk's output where the engine keeps them
    (`st.keeps_outputs`), else no output; and, but on Mist's runtime, the gradient sent last."""
    sends = _sends(st)
    if sends == WAITS:
        return held_sends(rank, ranks, chunks, G)
    if sends == KEEPS:
        return kept_outputs(rank, ranks, chunks, G)
    return HeldSends(0, 0, 1)


def _sends(st) -> str:
    """How the engine of stage input `st` holds its sends (`rules.interleaved_sends.held_beside`)."""
    return WAITS if st.holds_sends else KEEPS if st.keeps_outputs else FREES
