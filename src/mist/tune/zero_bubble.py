"""The ZB-H1 zero-bubble schedule in the tuner: one more schedule per (pp, G, mesh, TP degree).

A stage under ZB-H1 holds every micro-batch until its weight-gradient pass W, and the output
gradients of those past their input-gradient pass B (`simulate.zero_bubble.zb_held`): its
frontier is recomputed with that memory, over the strategies the runtime can split
(`rules.zero_bubble_order.zb_h1_problem`: no recomputation, ZeRO ≤ 2, no weight or activation
offload). Each point carries its steady forward F,
B and W (`zero_bubble.stage_weight_grad`, from the traced weight-gradient operators) and its
extras X, Y.

The layer split is searched near the balanced one (each stage ⌊L/pp⌋ − 1 … ⌈L/pp⌉ + 1 blocks)
by the inter-stage program `inter.best_split` under ZB-H1's closed form
(`zero_bubble.zb_iteration_time`: 1F1B's with T = F + B + W, each stage's Σ term U less the W's
that fill the bubble) and the chosen split is priced by the exact recurrence
`zero_bubble.zb_recurrence`, the number `mist simulate` reports for the plan.

Names: L the model's blocks, pp the pipeline depth, G micro-batches per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from mist.plan import Plan
from mist.rules.zero_bubble_order import ZB_H1
from mist.simulate.gpu_fit import fits_gpu
from mist.simulate.stage_compose import compose
from mist.simulate.zero_bubble import stage_weight_grad, zb_held, zb_recurrence
from mist.tune.inter import best_split
from mist.tune.intra import Options, pareto_2d, sample_frontier


@dataclass
class ZeroBubbleOptions(Options):
    """A stage's ZB-H1 frontier: the closed form's (T, F, X, Y) and Σ term U, and every point's
    B and W."""

    B: np.ndarray = field(default_factory=lambda: np.zeros(0))
    W: np.ndarray = field(default_factory=lambda: np.zeros(0))
    U: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass(frozen=True)
class ZeroBubbleSplit:
    """The best ZB-H1 plan of one (pp, G, mesh): its exact time and its strategies."""

    time: float
    strategies: list


def _runnable(grid) -> np.ndarray:
    """The strategies of a grid that ZB-H1 can split (`rules.zero_bubble_order.zb_h1_problem`;
    recomputation aside: the options use none)."""
    return (grid.zero <= 2) & (grid.offload_weights == 0) & (grid.offload_activations == 0)


# no selective recomputation either (`zb_h1_problem`), and no sequence parallelism
_SEL = (False, False)


def zb_analyses(tables, tp_fixed=None) -> list:
    """The layer analyses (`AnalysisRequest`) the ZB-H1 options of `tables` read."""
    if _SEL not in tables.selective_choices():
        return []
    return [r for tp in sorted({c[0] for c in tables.tp_choices(tp_fixed)}) for r in tables.model(tp, _SEL).analyses()]


def stage_options(tables, i: int, layers: int, tp_fixed=None) -> ZeroBubbleOptions:
    """Frontier of stage i holding `layers` blocks under ZB-H1 (no recomputation)."""
    pp, G = tables.pp, tables.G
    first, last = i == 0, i == pp - 1
    cols: list = []
    metas: list = []
    sel = _SEL
    choices = tables.tp_choices(tp_fixed) if sel in tables.selective_choices() else []
    for tp, dp, b in choices:
        if False not in tables.sp_choices(tp):  # (ZB-H1 runs no sequence parallelism: `zb_h1_problem`)
            continue
        grid, comp = tables.components(tp, dp, b, first, last, sel)
        wg = stage_weight_grad(tables.model(tp, sel), np.array([float(b)]), layers, 0, first, last)
        saved = compose(comp, layers, np.zeros((1, 1)), 0, G).saved_per_microbatch
        earlier, held = zb_held(i, pp, G, saved, wg)
        r = compose(comp, layers, np.zeros((1, 1)), earlier, G, held)
        tables.evaluated += r.T.size
        ok = fits_gpu(r.peak, tables.profile) & _runnable(grid)[:, None]
        if tables.host_cap is not None and ok.any():
            ok &= np.broadcast_to(r.host["peak_bytes"], ok.shape) <= tables.host_cap
        if not ok.any():
            continue
        si, ci = np.nonzero(ok)
        T, F = r.T[si, ci], r.fwd[si, ci]
        W = np.minimum(wg.with_grad_handling(r.grads_per_microbatch[si, ci]), T - F)
        cols.append((T, F, r.first_extra[si, ci], r.last_extra[si, ci], T - F - W, W))
        metas.append((tp, dp, b, sel, grid, si, np.zeros(len(si), dtype=int)))
    if not cols:
        z = np.zeros(0)
        return ZeroBubbleOptions(z, z, z, z, [])
    T, F, X, Y, Bk, W = (np.concatenate([c[j] for c in cols]) for j in range(6))
    front = pareto_2d(T, X + Y)
    keep = sample_frontier(front, tables.space.frontier_points)
    bounds = np.cumsum([0] + [len(m[5]) for m in metas])
    strategies = []
    for k in keep:
        j = int(np.searchsorted(bounds, k, side="right") - 1)
        strategies.append(tables._strategy(layers, metas[j], k - bounds[j]))
    # the closed form's Σ term (`zero_bubble.bubble_fill`: the last stage keeps its W's in it)
    U = T - (0.0 if last else 2.0) * W
    return ZeroBubbleOptions(T[keep], F[keep], X[keep], Y[keep], strategies, B=Bk[keep], W=W[keep], U=U[keep])


def best_zero_bubble(tables, L: int, tp_fixed=None) -> ZeroBubbleSplit | None:
    """The best ZB-H1 plan for this (pp, G, mesh): the closed form ranks the splits near the
    balanced one, the recurrence prices the chosen one."""
    pp, G = tables.pp, tables.G
    if pp < 2:
        return None
    lo, hi = max(1, L // pp - 1), min(L - pp + 1, -(-L // pp) + 1)
    options = []
    for i in range(pp):
        row = {}
        for n in range(lo, hi + 1):
            opt = stage_options(tables, i, n, tp_fixed)
            if len(opt.T):
                row[n] = opt
        if not row:
            return None
        options.append(row)
    split = best_split(options, L, G, lmin=lo, lmax=hi)
    if split is None:
        return None
    chosen = [options[i][n] for i, n in enumerate(split.layers)]
    f, b, w, x, y = (
        np.array([getattr(o, a)[k] for o, k in zip(chosen, split.choice)]) for a in ("F", "B", "W", "X", "Y")
    )
    time = float(zb_recurrence(f, b, w, x, y, G))
    return ZeroBubbleSplit(time, [o.strategies[k] for o, k in zip(chosen, split.choice)])


def as_zero_bubble(plan: Plan) -> Plan:
    """The same plan running ZB-H1."""
    return replace(plan, schedule=ZB_H1)
