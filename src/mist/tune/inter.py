"""Inter-stage optimization: layers per stage and one frontier point per stage, minimizing the
1F1B iteration time of `mist.simulate.pipeline`:

    (G − 1)·max_i T_i + Σ_i T_i + max(0, max_i (X_i − Σ_{j<i} F_j)) + max(0, max_i (Y_i − Σ_{j<i} B_j))

Dynamic program over stages in pipeline order. A partial solution (stages 0..i−1 covering `a`
layers) is summarized by six numbers: Σ T, max T, Σ F (P), Σ B (Q) and the two exposures so far.
The final objective is monotone in each (smaller Σ T, max T and exposures, larger P and Q are
never worse), so a cell (i, a) need only keep its non-dominated partial solutions — that is
exact. Two exact reductions keep the cells small: P (Q) is clipped at the largest first (last)
extra any later stage could have, beyond which more hiding capacity is worthless; and partial
solutions whose lower bound (objective so far plus the least Σ T the remaining stages can add)
is not below the incumbent are dropped. `max_states` caps a cell as a safety valve; when it binds,
the program runs again with `wide_states` below the split found (usually far fewer partial
solutions survive that bound), which keeps a larger search space from returning a worse plan than
a smaller one (the tuning-time study, benchmarks/results/tuning_time.md); `exact` reports whether
the cap still bound. Tests hold the program against brute force.

Names: L the model's blocks, pp the number of stages (len(options)), G micro-batches per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Split:
    objective: float
    layers: list[int]
    choice: list[int]  # index of the frontier point per stage
    exact: bool


def _objective(V, G):
    return (G - 1) * V[:, 1] + V[:, 0] + np.maximum(V[:, 4], 0) + np.maximum(V[:, 5], 0)


def _nondominated(V: np.ndarray, key: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Rows of V (n × 6, every column 'smaller is better') not dominated by another row.

    Rows are taken in order of `key` (a lower bound of the objective, so a dominating row comes
    before the rows it dominates); each kept row removes, in one vectorized sweep, every later
    row it dominates. Stops after `limit` kept rows."""
    order = np.argsort(key, kind="stable")
    V = V[order]
    n = len(V)
    alive = np.ones(n, dtype=bool)
    kept = []
    i = 0
    while i < n:
        i += int(np.argmax(alive[i:]))  # next row still alive
        if not alive[i]:
            break
        kept.append(i)
        if limit is not None and len(kept) >= limit:
            break
        alive[i + 1 :] &= ~np.all(V[i] <= V[i + 1 :] + 1e-12, axis=1)
        i += 1
    return order[np.array(kept, dtype=int)]


def _sum_term(opt) -> np.ndarray:
    """What a frontier point adds to the Σ term: its T, or the schedule's own term when the
    options carry one (`U`: ZB-H1's T less the W's that fill the bubble, `tune.zero_bubble`)."""
    u = getattr(opt, "U", None)
    return opt.T if u is None else u


def _min_remaining(options, L, lmin, lmax):
    """rem[i][a]: least Σ T of stages i..pp−1 covering L − a layers (inf if impossible)."""
    pp = len(options)
    rem = [dict() for _ in range(pp + 1)]
    rem[pp] = {L: 0.0}
    for i in range(pp - 1, -1, -1):
        for a in range(0, L + 1):
            best = np.inf
            for l in range(lmin, lmax + 1):
                nxt = rem[i + 1].get(a + l)
                opt = options[i].get(l)
                if nxt is None or opt is None or len(opt.T) == 0:
                    continue
                best = min(best, float(_sum_term(opt).min()) + nxt)
            if best < np.inf:
                rem[i][a] = best
    return rem


def best_split(
    options,
    L: int,
    G: int,
    lmin: int = 1,
    lmax: int | None = None,
    max_states: int = 64,
    bound: float = np.inf,
    wide_states: int = 512,
) -> Split | None:
    """options[i][l] -> object with arrays T, F, X, Y (frontier of stage i with l layers), and
    optionally U, its term of the Σ (default T).

    Returns the best split, or None when no split is feasible (or none is below `bound`)."""
    pp = len(options)
    lmax = L if lmax is None else lmax
    rem = _min_remaining(options, L, lmin, lmax)
    if 0 not in rem[0]:
        return None
    # the largest first/last extras any stage ≥ i could bring (for clipping P and Q)
    xcap, ycap = np.zeros(pp + 1), np.zeros(pp + 1)
    for i in range(pp - 1, -1, -1):
        xs = [float(o.X.max()) for o in options[i].values() if len(o.T)]
        ys = [float(o.Y.max()) for o in options[i].values() if len(o.T)]
        xcap[i] = max([xcap[i + 1]] + xs)
        ycap[i] = max([ycap[i + 1]] + ys)
    best: Split | None
    if bound == np.inf:  # a quick incumbent: the same program keeping one state per cell
        quick = _run(options, L, G, lmin, lmax, 1, np.inf, rem, xcap, ycap)
        if quick is None:
            return None
        bound = quick.objective * (1 + 1e-9) + 1e-12
        best = _run(options, L, G, lmin, lmax, max_states, bound, rem, xcap, ycap) or quick
    else:
        best = _run(options, L, G, lmin, lmax, max_states, bound, rem, xcap, ycap)
    if best is not None and not best.exact and wide_states > max_states:
        wider = _run(options, L, G, lmin, lmax, wide_states, best.objective, rem, xcap, ycap)
        if wider is not None and wider.objective < best.objective:
            best = wider
    return best


def _run(options, L, G, lmin, lmax, max_states, bound, rem, xcap, ycap) -> Split | None:
    pp = len(options)
    exact = True
    cells: dict[int, tuple[np.ndarray, list]] = {0: (np.zeros((1, 6)), [None])}
    hist = []
    for i in range(pp):
        nxt: dict = {}
        for a, (V, _) in cells.items():
            for l in range(lmin, lmax + 1):
                na = a + l
                if na not in rem[i + 1]:
                    continue
                opt = options[i].get(l)
                if opt is None or len(opt.T) == 0:
                    continue
                T, F, X, Y = opt.T, opt.F, opt.X, opt.Y
                P, Q = -V[:, 2:3], -V[:, 3:4]
                newV = np.stack(
                    np.broadcast_arrays(
                        V[:, 0:1] + _sum_term(opt)[None, :],
                        np.maximum(V[:, 1:2], T[None, :]),
                        -np.minimum(P + F[None, :], xcap[i + 1]),
                        -np.minimum(Q + (T - F)[None, :], ycap[i + 1]),
                        np.maximum(V[:, 4:5], X[None, :] - P),
                        np.maximum(V[:, 5:6], Y[None, :] - Q),
                    ),
                    axis=-1,
                ).reshape(-1, 6)
                lower = _objective(newV, G) + rem[i + 1][na]
                rows = np.nonzero(lower < bound)[0]
                if not len(rows):
                    continue
                src = [(a, int(r // len(T)), l, int(r % len(T))) for r in rows]
                part = nxt.setdefault(na, ([], [], []))
                part[0].append(newV[rows])
                part[1].append(lower[rows])
                part[2].extend(src)
        cells = {}
        for na, (Vs, lows, src) in nxt.items():
            V, low = np.concatenate(Vs), np.concatenate(lows)
            keep = _nondominated(V, low, limit=max_states)
            if len(keep) >= max_states and max_states < len(V):
                exact = False  # the cap may have cut non-dominated states
            cells[na] = (V[keep], [src[k] for k in keep])
        if not cells:
            return None
        hist.append(cells)
    if L not in cells:
        return None
    V, _ = cells[L]
    obj = _objective(V, G)
    r = int(np.argmin(obj))
    layers, choice = [], []
    a, row = L, r
    for i in range(pp - 1, -1, -1):
        prev_a, prev_row, l, k = hist[i][a][1][row]
        layers.append(l)
        choice.append(k)
        a, row = prev_a, prev_row
    return Split(float(obj[r]), layers[::-1], choice[::-1], exact)
