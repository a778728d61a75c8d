"""Interleaved 1F1B in the tuner: v model chunks per pipeline rank as one more dimension of the
inter-stage search.

For a (pp, G, mesh) and a v the layer split is fixed — balanced chunks, L/(pp·v) blocks each (as
Megatron-LM requires: the blocks divide evenly over the pp·v chunks) — so only the strategy of
each rank is chosen. A rank's strategy applies to all its chunks (and each chunk recomputes the
same number of its blocks). Its memory is the whole rank's with the interleaved schedule's
in-flight micro-batch chunks (`plan_sim.interleaved_in_flight`); its time is its chunks', each
priced as a stage of the chunk pipeline (the simulator's `chunk_inputs`: its own edges, p2p at
both ends, the embedding on the model's first chunk, the head on its last). The frontier points
per rank are summarized for the closed form of `simulate.interleaved` (`rank_summary`), which
`inter.best_split` searches with G·v chunk-ops; the chosen split is then priced by the exact
recurrence, the number `mist simulate` reports for the plan.

Names: L the model's blocks, pp the ranks, v chunks per rank, G micro-batches per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from mist.plan import StageStrategy
from mist.rules.interleaved_sends import WAITS, held_sends
from mist.rules.pipeline_outputs import keeps_sent_outputs
from mist.simulate.gpu_fit import fits_gpu
from mist.simulate.interleaved import (
    held_states,
    interleaved_in_flight,
    interleaved_recurrence,
    rank_summary,
)
from mist.simulate.stage_compose import compose
from mist.tune.inter import best_split
from mist.tune.intra import Options, pareto_2d, sample_frontier


@dataclass
class ChunkOptions(Options):
    """A rank's frontier for the closed form (T, F, X, Y per `rank_summary`) with every point's
    per-chunk forward, backward and extras (points × v) for the exact price."""

    chunk_f: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))
    chunk_b: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))
    chunk_x: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))
    chunk_y: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))


@dataclass(frozen=True)
class InterleavedSplit:
    """The best interleaved plan of one (pp, G, mesh, v): its exact time and its strategies."""

    time: float
    strategies: list[StageStrategy]


def chunk_counts(L: int, pp: int, G: int, values: tuple) -> list[int]:
    """The v ≥ 2 of `values` that apply: a pipeline, G a multiple of pp, L/(pp·v) whole blocks."""
    if pp < 2 or G % pp:
        return []
    return [v for v in values if v >= 2 and L % (pp * v) == 0]


def _recompute_per_chunk(space, lc: int) -> np.ndarray:
    """Blocks each chunk recomputes whole, as the space allows for a chunk of `lc` blocks."""
    if space.recompute == "none":
        return np.array([0])
    if space.recompute == "all_or_nothing":
        return np.array(sorted({0, lc}))
    return np.arange(lc + 1)


def _pick(a, shape, si, ki):
    """The feasible points (si, ki) of an array broadcast to (strategies, recompute)."""
    return np.broadcast_to(a, shape)[si, ki]


def rank_options(tables, r: int, v: int, lc: int, tp_fixed=None) -> ChunkOptions:
    """Frontier of rank r holding v chunks of lc blocks each."""
    pp, G = tables.pp, tables.G
    ks = _recompute_per_chunk(tables.space, lc)
    kinds = [(r == 0 and c == 0, r == pp - 1 and c == v - 1) for c in range(v)]
    parts: list = []
    for (tp, dp, b), sel in tables.stage_choices(tp_fixed):
        grid, comp = tables.components(tp, dp, b, r == 0, r == pp - 1, sel, chunks=v)
        # every chunk kind's times and saved activations (strategies × recompute)
        res = {kind: compose(tables.components(tp, dp, b, *kind, sel)[1], lc, ks[None, :], 0, G) for kind in set(kinds)}
        shape = np.broadcast_shapes(*(x.T.shape for x in res.values()))
        saved = np.stack([np.broadcast_to(res[k].saved_per_microbatch, shape) for k in kinds], axis=-1)
        # the full space plans for Mist's runtime (`rules.pipeline_outputs`)
        held = interleaved_in_flight(r, pp, G, saved)
        beside, at_blocks, at_head = held_states(r, pp, G, saved, WAITS)
        mem = compose(
            comp,
            lc * v,
            v * ks[None, :],
            held,
            G,
            chunks=v,
            keeps_outputs=keeps_sent_outputs("mist", v),
            held=held_sends(r, pp, v, G),
            beside_embedding=beside,
            at_blocks=at_blocks,
            at_head=at_head,
        )
        tables.evaluated += mem.T.size
        ok = np.broadcast_to(fits_gpu(mem.peak, tables.profile), shape).copy()
        if tables.host_cap is not None and ok.any():
            ok &= np.broadcast_to(mem.host["peak_bytes"], shape) <= tables.host_cap
        if not ok.any():
            continue
        si, ki = np.nonzero(ok)

        fw = {k: _pick(x.fwd, shape, si, ki) for k, x in res.items()}
        per_kind = {
            k: (
                fw[k],
                _pick(x.T, shape, si, ki) - fw[k],
                _pick(x.first_extra, shape, si, ki),
                _pick(x.last_extra, shape, si, ki),
            )
            for k, x in res.items()
        }
        chunk = [np.stack([per_kind[k][j] for k in kinds], axis=-1) for j in range(4)]
        parts.append((chunk, (tp, dp, b, sel, grid, si, v * ks[ki])))
    if not parts:
        z = np.zeros(0)
        return ChunkOptions(z, z, z, z, [])
    cf, cb, cx, cy = (np.concatenate([c[j] for c, _ in parts]) for j in range(4))
    t, fm, x, y = rank_summary(cf, cb, cx, cy, pp)
    keep = sample_frontier(pareto_2d(t, x + y), tables.space.frontier_points)
    bounds = np.cumsum([0] + [len(m[5]) for _, m in parts])
    strategies = []
    for k in keep:
        j = int(np.searchsorted(bounds, k, side="right") - 1)
        st = tables._strategy(lc * v, parts[j][1], k - bounds[j])
        strategies.append(replace(st, chunk_layers=(lc,) * v))
    return ChunkOptions(
        t[keep],
        fm[keep],
        x[keep],
        y[keep],
        strategies,
        chunk_f=cf[keep],
        chunk_b=cb[keep],
        chunk_x=cx[keep],
        chunk_y=cy[keep],
    )


def best_interleaved(tables, L: int, v: int, tp_fixed=None) -> InterleavedSplit | None:
    """The best plan of v chunks per rank for this (pp, G, mesh): the closed form ranks the
    splits, the recurrence prices the chosen one."""
    pp, G = tables.pp, tables.G
    lc = L // (pp * v)
    options = []
    for r in range(pp):
        opt = rank_options(tables, r, v, lc, tp_fixed)
        if not len(opt.T):
            return None
        options.append({lc * v: opt})
    split = best_split(options, L, G * v, lmin=lc * v, lmax=lc * v)
    if split is None:
        return None
    chosen = [options[r][lc * v] for r in range(pp)]
    f, b, x, y = (
        np.stack([getattr(o, a)[k] for o, k in zip(chosen, split.choice)])
        for a in ("chunk_f", "chunk_b", "chunk_x", "chunk_y")
    )
    time = float(interleaved_recurrence(f, b, x, y, G))
    return InterleavedSplit(time, [o.strategies[k] for o, k in zip(chosen, split.choice)])
