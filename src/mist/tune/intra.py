"""Intra-stage tuning: every strategy of a stage evaluated at once, infeasible ones dropped, the
rest reduced to a Pareto frontier of (steady time T, one-off extra D) per (stage, layers).

The stage cost model is `mist.simulate.stage`: `components` is computed once per strategy batch
(per TP degree, micro-batch and stage kind), and `compose` turns it into time and memory for
every (layers, recomputed blocks, in-flight micro-batches) by broadcasting — the same code that
`mist simulate` runs, so the tuner's numbers are the simulator's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from mist.simulate.plan_sim import ALLOCATOR_MARGIN
from mist.simulate.stage import StageInput, StageModel, compose
from mist.tune.space import SearchSpace


@dataclass
class Options:
    """Frontier points of one (stage index, layer count): arrays over points + their strategies."""
    T: np.ndarray
    F: np.ndarray
    X: np.ndarray
    Y: np.ndarray
    strategies: list = field(default_factory=list)   # dicts: tp, dp, b, zero, wo, go, oo, ao, recompute, attn, act
    min_peak: float = float("inf")                     # least memory any strategy reached
    min_host: float = float("inf")                     # least host memory of those that fit the GPU


def _expand(x):
    """Give every per-strategy array a trailing axis (so it broadcasts against a c-grid)."""
    if isinstance(x, dict):
        return {k: _expand(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_expand(v) for v in x)
    if isinstance(x, np.ndarray) and x.ndim == 1:
        return x[:, None]
    return x


def pareto_2d(T: np.ndarray, D: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (T, D), ordered by T."""
    order = np.lexsort((D, T))
    d = D[order]
    prev_best = np.concatenate(([np.inf], np.minimum.accumulate(d)[:-1]))
    return order[d < prev_best - 1e-12]


def sample_frontier(idx: np.ndarray, k: int) -> np.ndarray:
    """At most k frontier points, always the fastest and the one with the least extra."""
    if len(idx) <= k:
        return idx
    pick = np.unique(np.round(np.linspace(0, len(idx) - 1, k)).astype(int))
    return idx[pick]


class StageTables:
    """Components per (tp, b, dp, stage kind) for one (model, GPU, seq, S, G, mesh), cached."""

    def __init__(self, spec, profile, seq: int, flash: bool, space: SearchSpace, S: int, G: int,
                 nodes: int, gpn: int, cluster_gpn: int, global_batch: int, with_wg: bool,
                 precision=None, host_cap: float | None = None):
        self.spec, self.profile, self.seq, self.flash, self.space = spec, profile, seq, flash, space
        self.S, self.G, self.nodes, self.gpn, self.cluster_gpn = S, G, nodes, gpn, cluster_gpn
        self.B, self.with_wg, self.precision = global_batch, with_wg, precision
        # host RAM per GPU: the node's over its GPUs, so that any stages sharing a node fit it
        self.host_cap = host_cap
        self._models: dict = {}
        self._comps: dict = {}
        self.evaluated = 0

    def model(self, tp: int, sel: tuple = (False, False)) -> StageModel:
        if (tp, sel) not in self._models:
            self._models[tp, sel] = StageModel(self.spec, self.profile, tp, self.flash, self.seq, self.precision,
                                               attention_recompute=sel[0], activation_recompute=sel[1])
        return self._models[tp, sel]

    def selective_choices(self) -> list[tuple[bool, bool]]:
        """(attention, activation) recomputation of the blocks not checkpointed whole. Attention
        only without flash attention: with it the core keeps little (q, k, v, output)."""
        attn = (False,) if self.flash else tuple(self.space.attention_recompute)
        return list(itertools.product(attn, self.space.activation_recompute))

    def tp_choices(self, tp_fixed: int | None = None) -> list[tuple[int, int, int]]:
        """(tp, dp, b) triples allowed for a stage of this mesh."""
        n = self.nodes * self.gpn
        out = []
        for tp in (2 ** i for i in range(8)):
            if tp > self.gpn or self.gpn % tp or n % tp:
                continue
            if tp_fixed is not None and tp != tp_fixed:
                continue
            if self.space.tp_values is not None and tp not in self.space.tp_values:
                continue
            if self.spec.num_heads % tp or self.spec.ffn_hidden_size % tp or self.spec.vocab_size % tp:
                continue
            if self.spec.num_kv_heads % tp and tp % self.spec.num_kv_heads:
                continue
            dp = n // tp
            if self.B % (self.G * dp):
                continue
            b = self.B // (self.G * dp)
            if b > self.space.b_max or (self.space.b_values is not None and b not in self.space.b_values):
                continue
            out.append((tp, dp, b))
        return out

    def strategy_grid(self, dp: int) -> dict:
        sp = self.space
        zeros = [z for z in sp.zero_levels if dp > 1 or z == min(sp.zero_levels)]
        if self.with_wg:
            wg = [(w, g) for w in sp.wo for g in sp.go if (w <= g if sp.name == "full" else (w == 0 or g > 0))]
        else:
            wg = [(0.0, 0.0)]
        rows = [(z, w, g, o, a) for z, (w, g), o, a in itertools.product(zeros, wg, sp.oo, sp.ao)]
        arr = np.array(rows, dtype=np.float64)
        return {"zero": arr[:, 0], "wo": arr[:, 1], "go": arr[:, 2], "oo": arr[:, 3], "ao": arr[:, 4]}

    def components(self, tp: int, dp: int, b: int, first: bool, last: bool, sel: tuple = (False, False)):
        key = (tp, dp, b, first, last, sel)
        if key not in self._comps:
            grid = self.strategy_grid(dp)
            n = len(grid["zero"])
            st = StageInput(first=first, last=last, index=0, num_stages=self.S, layers=np.ones(n),
                            recompute=np.zeros(n), b=np.full(n, b), dp=np.full(n, dp), tp=tp,
                            zero=grid["zero"], wo=grid["wo"], go=grid["go"], oo=grid["oo"], ao=grid["ao"],
                            G=self.G, nodes=self.nodes, gpus_per_node=self.gpn,
                            cluster_gpus_per_node=self.cluster_gpn)
            comp = self.model(tp, sel).components(st)
            self._comps[key] = (grid, _expand(comp))
        return self._comps[key]

    def options(self, i: int, layers: int, tp_fixed: int | None = None) -> Options:
        """Frontier of stage i holding `layers` blocks."""
        first, last = i == 0, i == self.S - 1
        in_flight = max(0, min(self.S - 1 - i, self.G - 1))
        sp = self.space
        if sp.recompute == "none":
            cs = np.array([0])
        elif sp.recompute == "all_or_nothing":
            cs = np.array(sorted({0, layers}))
        else:
            cs = np.arange(layers + 1)
        Ts, Fs, Xs, Ys, metas = [], [], [], [], []
        min_peak = min_host = np.inf
        cap = self.profile.memory_bytes / (1 + ALLOCATOR_MARGIN)
        for (tp, dp, b), sel in itertools.product(self.tp_choices(tp_fixed), self.selective_choices()):
            grid, comp = self.components(tp, dp, b, first, last, sel)
            r = compose(comp, layers, cs[None, :], in_flight, self.G)
            self.evaluated += r.T.size
            peak = r.peak
            min_peak = min(min_peak, float(peak.min()))
            ok = peak <= cap
            if self.host_cap is not None and ok.any():
                host = np.broadcast_to(r.host["peak_bytes"], ok.shape)
                min_host = min(min_host, float(host[ok].min()))
                ok &= host <= self.host_cap
            if not ok.any():
                continue
            si, ci = np.nonzero(ok)
            Ts.append(r.T[si, ci])
            Fs.append(r.fwd[si, ci])
            Xs.append(r.first_extra[si, ci])
            Ys.append(r.last_extra[si, ci])
            metas.append((tp, dp, b, sel, grid, si, cs[ci]))
        if not Ts:
            return Options(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), [], min_peak, min_host)
        T, F, X, Y = (np.concatenate(v) for v in (Ts, Fs, Xs, Ys))
        keep = sample_frontier(pareto_2d(T, X + Y), sp.frontier_points)
        # map kept indices back to strategies
        bounds = np.cumsum([0] + [len(m[5]) for m in metas])
        strategies = []
        for k in keep:
            j = int(np.searchsorted(bounds, k, side="right") - 1)
            tp, dp, b, sel, grid, si, cc = metas[j]
            q = k - bounds[j]
            s = int(si[q])
            strategies.append({"tp": tp, "dp": dp, "b": b, "zero": int(grid["zero"][s]),
                               "wo": float(grid["wo"][s]), "go": float(grid["go"][s]),
                               "oo": float(grid["oo"][s]), "ao": float(grid["ao"][s]),
                               "recompute": int(cc[q]), "attn": bool(sel[0]), "act": bool(sel[1])})
        return Options(T[keep], F[keep], X[keep], Y[keep], strategies, min_peak, min_host)

    def min_layer_time(self) -> float:
        """A lower bound on a block's steady time on any stage (for pruning)."""
        best = np.inf
        for tp, dp, b in self.tp_choices():
            for first, last in ((False, False),):
                _, comp = self.components(tp, dp, b, first, last)
                best = min(best, float(np.min(np.minimum(comp["f_no"] + comp["b_no"], comp["f_ck"] + comp["b_ck"]))))
        return best
