"""Intra-stage tuning: every strategy of a stage evaluated at once, infeasible ones dropped, the
rest reduced to a Pareto frontier of (steady time T, one-off extra D) per (stage, layers).

The stage cost model is `mist.simulate.stage`: `components` is computed once per strategy batch
(per TP degree, micro-batch and stage kind), and `compose` turns it into time and memory for
every (layers, recomputed blocks, in-flight micro-batches) by broadcasting — the same code that
`mist simulate` runs, so the tuner's numbers are the simulator's. A frontier point's strategy is
the plan's own record, `plan.StageStrategy`.

Names: pp the pipeline depth, G micro-batches per iteration, B the global batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from mist.plan import Offload, StageStrategy
from mist.rules.pipeline_order import earlier_in_flight
from mist.simulate.gpu_fit import fits_gpu
from mist.simulate.stage import StageModel
from mist.simulate.stage_compose import compose
from mist.simulate.stage_records import StageComponents, StageInput
from mist.tune.space import MAX_TP, SearchSpace, tp_degrees


@dataclass
class Options:
    """Frontier points of one (stage index, layer count): arrays over points + their strategies."""

    T: np.ndarray
    F: np.ndarray
    X: np.ndarray
    Y: np.ndarray
    strategies: list[StageStrategy] = field(default_factory=list)
    min_peak: float = float("inf")  # least memory any strategy reached
    min_host: float = float("inf")  # least host memory of those that fit the GPU


@dataclass(frozen=True)
class StrategyGrid:
    """The ZeRO levels and offload fractions searched for one dp, as arrays over strategies."""

    zero: np.ndarray
    offload_weights: np.ndarray
    offload_grads: np.ndarray
    offload_optimizer: np.ndarray
    offload_activations: np.ndarray

    def __len__(self) -> int:
        return len(self.zero)


def _expand(x):
    """Give every per-strategy array a trailing axis (so it broadcasts against a c-grid)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x)(**{f.name: _expand(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, dict):
        return {k: _expand(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_expand(v) for v in x)
    if isinstance(x, np.ndarray) and x.ndim == 1:
        return x[:, None]
    return x


def pareto_2d(T: np.ndarray, D: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (T, D), ordered by T (of equal points, the first)."""
    # Most candidates are far from the frontier: those that a few pivots (the fastest point, the
    # one with the least extra, the best of both scaled) dominate are dropped before the sort.
    # Each comes after its pivot in the (T, D) order with no smaller D, so it is not on the
    # frontier and lowers no later point's running minimum; points equal to a pivot stay, so the
    # first of equal points is still the one kept.
    idx = np.arange(len(T))
    if len(T) > 64:
        span_t, span_d = np.ptp(T), np.ptp(D)
        if np.isfinite(span_t) and np.isfinite(span_d):
            score = (T - T.min()) / (span_t or 1.0) + (D - D.min()) / (span_d or 1.0)
            drop = np.zeros(len(T), dtype=bool)
            for p in (int(np.argmin(T)), int(np.argmin(D)), int(np.argmin(score))):
                drop |= (T >= T[p]) & (D >= D[p]) & ((T > T[p]) | (D > D[p]))
            idx = idx[~drop]
    order = idx[np.lexsort((D[idx], T[idx]))]
    d = D[order]
    prev_best = np.concatenate(([np.inf], np.minimum.accumulate(d)[:-1]))
    return order[d < prev_best - 1e-12]


def sample_frontier(idx: np.ndarray, k: int, also: int | None = None) -> np.ndarray:
    """At most k frontier points, always the fastest and the one with the least extra, plus the
    point at position `also` of `idx` when given (the order of `idx` is kept)."""
    if len(idx) <= k:
        return idx
    pick = np.round(np.linspace(0, len(idx) - 1, k)).astype(int)
    if also is not None:
        pick = np.append(pick, also)
    return idx[np.unique(pick)]


def micro_batch_sizes(global_batch: int, most: int) -> tuple[int, ...]:
    """The micro-batch sizes up to `most` that a plan of `global_batch` may run (its divisors:
    global batch = G · dp · b)."""
    return tuple(b for b in range(1, min(global_batch, most) + 1) if global_batch % b == 0)


class StageTables:
    """Components per (tp, b, dp, stage kind) for one (model, GPU, seq, pp, G, mesh), cached."""

    def __init__(
        self,
        spec,
        profile,
        seq: int,
        flash: bool,
        space: SearchSpace,
        pp: int,
        G: int,
        nodes: int,
        gpn: int,
        cluster_gpn: int,
        global_batch: int,
        with_wg: bool,
        precision=None,
        host_cap: float | None = None,
        cp: int = 1,
        compiled: bool | str = False,
    ):
        self.spec, self.profile, self.seq, self.flash, self.space = spec, profile, seq, flash, space
        # the blocks compiled (`training.compile_blocks`), as the schedule runs them
        # (`mist.rules.compiled_blocks.compile_mode`)
        self.compiled = compiled
        self.pp, self.G, self.nodes, self.gpn, self.cluster_gpn = pp, G, nodes, gpn, cluster_gpn
        self.B, self.with_wg, self.precision = global_batch, with_wg, precision
        # every micro-batch size the space allows for this global batch (with any G and dp)
        self.batch_sizes = tuple(
            b for b in micro_batch_sizes(global_batch, space.b_max) if space.b_values is None or b in space.b_values
        )
        # host RAM per GPU: the node's over its GPUs, so that any stages sharing a node fit it
        self.host_cap = host_cap
        self.cp = cp  # context parallelism of every stage (its ranks count as replicas below)
        self._models: dict = {}
        self._comps: dict = {}
        self.evaluated = 0

    def model(self, tp: int, sel: tuple = (False, False)) -> StageModel:
        """The stage model of TP degree `tp` and `sel` = (attention recompute, activation
        recompute[, sequence parallelism]) (`stage_choices`)."""
        if (tp, sel) not in self._models:
            self._models[tp, sel] = StageModel(
                self.spec,
                self.profile,
                tp,
                self.flash,
                self.seq,
                self.precision,
                recompute_attention=sel[0],
                recompute_activation=sel[1],
                sequence_parallel=len(sel) > 2 and bool(sel[2]),
                cp=self.cp,
                compiled=self.compiled,
                batch_sizes=self.batch_sizes,
            )
        return self._models[tp, sel]

    def stage_choices(self, tp_fixed: int | None = None) -> list[tuple[tuple[int, int, int], tuple]]:
        """((tp, dp, b), sel) of every layout and model variant a stage may take: sel is
        (attention recompute, activation recompute, sequence parallelism), the last tried only
        where tp > 1."""
        out = []
        for tdb, (attn, act) in itertools.product(self.tp_choices(tp_fixed), self.selective_choices()):
            for sp in self.sp_choices(tdb[0]):
                out.append((tdb, (attn, act, bool(sp))))
        return out

    def sp_choices(self, tp: int) -> tuple:
        """The sequence parallelism a stage of `tp` may take: the space's where it can split the
        sequence (or each of the 2·cp chunks) over tp, else none."""
        split = tp * (2 * self.cp if self.cp > 1 else 1)
        return tuple(self.space.sequence_parallel) if tp > 1 and self.seq % split == 0 else (False,)

    def analyses(self, tp_fixed: int | None = None) -> list:
        """The layer analyses (`AnalysisRequest`) every stage choice's model reads."""
        return [r for tdb, sel in self.stage_choices(tp_fixed) for r in self.model(tdb[0], sel).analyses()]

    def selective_choices(self) -> list[tuple[bool, bool]]:
        """(attention, activation) recomputation of the blocks not checkpointed whole. Attention
        only without flash attention: with it the core keeps little (q, k, v, output)."""
        attn = (False,) if self.flash else tuple(self.space.recompute_attention)
        return list(itertools.product(attn, self.space.recompute_activation))

    def tp_choices(self, tp_fixed: int | None = None) -> list[tuple[int, int, int]]:
        """(tp, dp, b) triples allowed for a stage of this mesh (dp: data replicas; with context
        parallelism a replica is cp × tp GPUs of one node)."""
        n = self.nodes * self.gpn
        out = []
        for tp in tp_degrees(self.spec, self.gpn, MAX_TP):
            if tp_fixed is not None and tp != tp_fixed:
                continue
            if self.space.tp_values is not None and tp not in self.space.tp_values:
                continue
            if self.gpn % (tp * self.cp):
                continue
            dp = n // (tp * self.cp)
            if self.B % (self.G * dp):
                continue
            b = self.B // (self.G * dp)
            if b > self.space.b_max or (self.space.b_values is not None and b not in self.space.b_values):
                continue
            out.append((tp, dp, b))
        return out

    def strategy_grid(self, dp: int) -> StrategyGrid:
        sp = self.space
        zeros = [z for z in sp.zero_levels if dp > 1 or z == min(sp.zero_levels)]
        if self.with_wg:
            wg = [
                (w, g)
                for w in sp.offload_weights
                for g in sp.offload_grads
                if (w <= g if sp.name == "full" else (w == 0 or g > 0))
            ]
        else:
            wg = [(0.0, 0.0)]
        rows = [
            (z, w, g, o, a)
            for z, (w, g), o, a in itertools.product(zeros, wg, sp.offload_optimizer, sp.offload_activations)
        ]
        if not self.with_wg and any(g > 0 for g in sp.offload_grads):
            # the gradients of the optimizer's host share go to the host anyway: offloading them as
            # far (ZeRO-Offload's pairing) sends them during backward instead of after it, which
            # is no extra traffic, so it is searched before weight and gradient offload open up
            rows += [
                (z, 0.0, o, o, a)
                for z, o, a in itertools.product(zeros, sp.offload_optimizer, sp.offload_activations)
                if o > 0 and o in sp.offload_grads
            ]
        arr = np.array(rows, dtype=np.float64)
        return StrategyGrid(
            zero=arr[:, 0],
            offload_weights=arr[:, 1],
            offload_grads=arr[:, 2],
            offload_optimizer=arr[:, 3],
            offload_activations=arr[:, 4],
        )

    def components(
        self, tp: int, dp: int, b: int, first: bool, last: bool, sel: tuple = (False, False), chunks: int = 1
    ) -> tuple[StrategyGrid, StageComponents]:
        """A stage's components over the strategy grid; `chunks`: those of an interleaved rank
        evaluated whole (`StageInput.chunks`)."""
        key = (tp, dp, b, first, last, sel, chunks)
        if key not in self._comps:
            grid = self.strategy_grid(dp * self.cp)
            n = len(grid)
            st = StageInput(
                first=first,
                last=last,
                index=0,
                num_stages=self.pp,
                layers=np.ones(n),
                recompute=np.zeros(n),
                b=np.full(n, b),
                dp=np.full(n, dp * self.cp),  # the replicas of a shard: dp × cp
                tp=tp,
                zero=grid.zero,
                offload_weights=grid.offload_weights,
                offload_grads=grid.offload_grads,
                offload_optimizer=grid.offload_optimizer,
                offload_activations=grid.offload_activations,
                G=self.G,
                nodes=self.nodes,
                gpus_per_node=self.gpn,
                cluster_gpus_per_node=self.cluster_gpn,
                chunks=chunks,
            )
            comp = self.model(tp, sel).components(st)
            self._comps[key] = (grid, _expand(comp))
        return self._comps[key]

    def _recompute_grid(self, layers: int) -> np.ndarray:
        """The numbers of recomputed blocks the space allows for a stage of `layers` blocks."""
        sp = self.space
        if sp.recompute == "none":
            return np.array([0])
        if sp.recompute == "all_or_nothing":
            return np.array(sorted({0, layers}))
        return np.arange(layers + 1)

    def options(self, i: int, layers: int, tp_fixed: int | None = None) -> Options:
        """Frontier of stage i holding `layers` blocks."""
        first, last = i == 0, i == self.pp - 1
        in_flight = earlier_in_flight(i, self.pp, self.G)
        cs = self._recompute_grid(layers)
        Ts, Fs, Xs, Ys, metas = [], [], [], [], []
        min_peak = min_host = np.inf
        for (tp, dp, b), sel in self.stage_choices(tp_fixed):
            grid, comp = self.components(tp, dp, b, first, last, sel)
            r = compose(comp, layers, cs[None, :], in_flight, self.G)
            self.evaluated += r.T.size
            peak = r.peak
            min_peak = min(min_peak, float(peak.min()))
            ok = fits_gpu(peak, self.profile)
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
        front = pareto_2d(T, X + Y)
        # the sampled frontier always keeps the point a one-stage pipeline would pick (G·T + X + Y,
        # its exact iteration time): sampling alone can drop it
        alone = int(np.argmin(self.G * T[front] + X[front] + Y[front]))
        keep = sample_frontier(front, self.space.frontier_points, also=alone)
        # map kept indices back to strategies
        bounds = np.cumsum([0] + [len(m[5]) for m in metas])
        strategies = []
        for k in keep:
            j = int(np.searchsorted(bounds, k, side="right") - 1)
            q = k - bounds[j]
            strategies.append(self._strategy(layers, metas[j], q))
        return Options(T[keep], F[keep], X[keep], Y[keep], strategies, min_peak, min_host)

    def _strategy(self, layers: int, meta: tuple, q: int) -> StageStrategy:
        """The strategy of point q of one (tp, dp, b, selective) batch of `options`."""
        tp, dp, b, sel, grid, si, cc = meta
        s = int(si[q])
        return StageStrategy(
            layers=int(layers),
            nodes=self.nodes,
            gpus_per_node=self.gpn,
            micro_batch=int(b),
            dp=int(dp),
            tp=int(tp),
            zero=int(grid.zero[s]),
            recompute_layers=int(cc[q]),
            offload=Offload(
                weights=float(grid.offload_weights[s]),
                grads=float(grid.offload_grads[s]),
                optimizer=float(grid.offload_optimizer[s]),
                activations=float(grid.offload_activations[s]),
            ),
            recompute_attention=bool(sel[0]),
            recompute_activation=bool(sel[1]),
            sequence_parallel=len(sel) > 2 and bool(sel[2]),
            cp=self.cp,
        )

    def min_layer_time(self) -> float:
        """A lower bound on a block's steady time on any stage (for pruning)."""
        best = np.inf
        for tp, dp, b in self.tp_choices():
            for first, last in ((False, False),):
                _, comp = self.components(tp, dp, b, first, last)
                best = min(
                    best, float(np.min(np.minimum(comp.plain.fwd + comp.plain.bwd, comp.ckpt.fwd + comp.ckpt.bwd)))
                )
        return best
