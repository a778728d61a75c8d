"""Baseline search spaces — Megatron-LM, DeepSpeed, Aceso — costed by Mist's own simulator.

Each baseline enumerates (or, for Aceso, walks) the plans its system can express and keeps the
feasible one with the smallest predicted iteration time. Every candidate is costed exactly as
`mist.simulate.plan_sim.simulate_plan` costs it — the same `StageModel` per stage, the same 1F1B
closed form `pipeline.iteration_time`, the same allocator margin — with each stage's result
memoized, because a candidate usually differs from the previous one in one or two stages. The
winner is re-simulated with `simulate_plan`; should the memoized path ever disagree with it (the
simulator changed under us), the search is rerun calling `simulate_plan` for every candidate.
Interleaved candidates (the target spaces' virtual pipeline stages: stages with `chunk_layers`)
are costed the same way, each rank's chunks memoized with it and played through the interleaved
order (`simulate.interleaved.interleaved_recurrence`), as `simulate_plan` plays them.

Rules shared by all three (as the Mist paper's evaluation tuned the baselines):
  * every stage has the same GPU count: pp divides the world size; a stage's mesh is whole nodes
    (nodes/pp × gpus_per_node) when pp ≤ nodes, else a power-of-two slice of one node
    (1 × world/pp); TP stays within a node and divides the heads, FFN and vocabulary;
  * micro_batch × dp × G = global batch on every stage (G = gradient-accumulation steps);
  * pipeline depth pp is a power of two, at most the layer count.
(Names: L the model's blocks, pp the pipeline depth, G micro-batches per iteration, B the
global batch.)

Megatron-LM (core_r0.4.0): power-of-two (dp, tp, pp), dp·tp·pp = world size; Megatron's own rule
  for the layer split — pp must divide the layer count, every stage gets L/pp layers (core_r0.4.0
  asserts it; uneven first/last stages came later); micro-batch ∈ {1, 2, 4, 8}; full recompute of
  every layer on or off; the distributed optimizer (ZeRO-1) whenever dp > 1; no offload. With bf16
  parameters Megatron accumulates and reduces gradients in fp32 (`arguments.py` sets
  accumulate_allreduce_grads_in_fp32 for bf16; its distributed-optimizer guide gives 6 + 12/dp
  bytes per parameter for "bf16 param, fp32 grads"), so its plans carry grad_dtype fp32 then.
DeepSpeed (0.12 + Megatron-DeepSpeed): pp ∈ powers of two, tp ∈ powers of two within a node
  (tp = 1 is plain DeepSpeed, tp > 1 Megatron-DeepSpeed), dp the rest; layers split as
  DeepSpeed's `partition_uniform` does (as even as possible, the first L mod pp stages take one
  more); ZeRO 0–3 (> 0 only when dp > 1); with pp > 1 only ZeRO 0/1 (DeepSpeed's pipeline engine
  rejects ZeRO-2/3) and no offload; with pp = 1 also ZeRO-Offload (optimizer states to the CPU,
  offload.optimizer = 1, with ZeRO ≥ 1, or ZeRO-0 when dp = 1) and with ZeRO-3 ZeRO-Infinity (weights, grads and
  optimizer states offloaded); micro-batch ∈ {1, 2, 4, 8, 16}; full recompute on or off.
Aceso (EuroSys'24): iterative bottleneck alleviation per (pp, b) configuration, pp a power of two,
  b ∈ {1, 2, 4, 8}. It starts balanced (uniform split as above, no recompute, tp 1, ZeRO-1 when
  dp > 1) and repeatedly takes the bottleneck stage — the one furthest over memory if the plan
  does not fit, else the one with the largest steady (stable) micro-batch time — and tries: move
  its boundary layer to a neighbour (which recomputes it or not), change its recomputed blocks by
  ±1 or ±2, toggle its recompute (none ↔ all), toggle the recomputation of single operators of
  its other blocks (Aceso's recomputation is per operator: the MLP activation, and without flash
  attention the attention core), halve or double its tp (dp the other way, its
  micro-batch rescaled so b·dp stays B/G). The best move is taken; a move that does not beat the
  best plan so far is a "hop", and the walk ends after 7 hops in a row without improvement, when
  no unvisited move is left, or at the time budget (200 s, or `time_budget`, shared among the
  configurations). Stages may end with different tp/dp, recompute and layer counts. No offload.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from mist.analysis.prefetch import TracePool
from mist.hardware.host_memory import node_host_memory, node_usage
from mist.plan import Offload, Plan, StageStrategy
from mist.rules.compiled_blocks import compile_mode
from mist.rules.zero_bubble_order import SCHEDULES
from mist.simulate.gpu_fit import NEED_WORDS, need_bytes, outside_words, usable_bytes
from mist.simulate.interleaved import interleaved_rank_input, interleaved_recurrence
from mist.simulate.pipeline import iteration_time
from mist.simulate.plan_sim import chunk_inputs, simulate_plan, stage_inputs
from mist.simulate.precision import precision_for
from mist.simulate.stage import StageModel
from mist.simulate.stage_records import HeldStates
from mist.specs.model import ModelSpec
from mist.specs.presets import preset_ref
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.intra import micro_batch_sizes
from mist.tune.result import TuneResult, no_plan_in_budget_words
from mist.tune.space import SearchSpace, tp_degrees
from mist.units import GiB

MEGATRON_MICRO_BATCHES = (1, 2, 4, 8)
DEEPSPEED_MICRO_BATCHES = (1, 2, 4, 8, 16)
ACESO_MICRO_BATCHES = (1, 2, 4, 8)
ACESO_BUDGET_S = 200.0
ACESO_MAX_HOPS = 7

__all__ = [
    "tune_megatron",
    "tune_deepspeed",
    "tune_aceso",
    "stage_mesh",
    "even_split",
    "ACESO_BUDGET_S",
    "ACESO_MAX_HOPS",
]


# ------------------------------------------------------------------ shared rules
def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def stage_mesh(cluster: ClusterSpec, pp: int) -> tuple[int, int] | None:
    """(nodes, gpus_per_node) of every stage when the cluster is cut into pp equal stages."""
    W = cluster.world_size
    if pp < 1 or W % pp:
        return None
    if pp <= cluster.nodes:
        return (cluster.nodes // pp, cluster.gpus_per_node) if cluster.nodes % pp == 0 else None
    per = W // pp
    if cluster.gpus_per_node % per or not _is_pow2(per):
        return None
    return (1, per)


def even_split(L: int, pp: int) -> list[int]:
    """Layers per stage, as even as possible; the first L mod pp stages take one more."""
    q, r = divmod(L, pp)
    return [q + 1] * r + [q] * (pp - r)


def _depths(model: ModelSpec, cluster: ClusterSpec):
    """Power-of-two pipeline depths pp ≤ L with a valid equal stage mesh, and that mesh."""
    for pp in _pow2_upto(min(model.num_layers, cluster.world_size)):
        mesh = stage_mesh(cluster, pp)
        if mesh is not None:
            yield pp, mesh


# ------------------------------------------------------------------ costing
@dataclass(frozen=True)
class _Cost:
    time: float  # predicted iteration time (s)
    fits: bool
    stage_times: tuple  # steady time of one micro-batch, per stage
    needs: tuple  # peak × (1 + allocator margin), per stage (bytes)
    capacity: float = math.inf

    @property
    def objective(self) -> tuple:
        """Feasible plans by time; infeasible ones after them, by total then worst overshoot."""
        if self.fits:
            return (0, self.time, 0.0)
        return (1, sum(max(0.0, n - self.capacity) for n in self.needs), max(self.needs))


class _Evaluator:
    """Costs (G, stages) candidates exactly as simulate_plan does, memoized per stage."""

    def __init__(
        self, model, cluster, training, profile, exact: bool = False, model_ref=None, pool=None, engine: str = "mist"
    ):
        self.model, self.cluster, self.training, self.profile = model, cluster, training, profile
        self.exact, self.model_ref = exact, model_ref
        self.engine = engine  # what runs the candidates (`Plan.engine`)
        self.pool: TracePool | None = pool  # traces the layers a batch of candidates reads (`warm`)
        self.capacity = float(usable_bytes(profile))
        self.host_cap = node_host_memory(cluster, profile)[0]  # per node (None: not checked)
        self.count = 0
        self.min_need = math.inf
        self.cut_short = False  # the deadline stopped a search with candidates left to cost
        self._stage: dict = {}
        self._plans: dict = {}
        self._models: dict = {}

    def plan(self, G: int, stages) -> Plan:
        """The candidate as a plan; stages with `chunk_layers` make it interleaved (v chunks each)."""
        chunks = stages[0].chunk_layers
        return Plan(
            model=self.model,
            cluster=self.cluster,
            training=self.training,
            micro_batches=G,
            stages=tuple(stages),
            model_ref=self.model_ref,
            virtual_stages=len(chunks) if chunks else 1,
            engine=self.engine,
        )

    def _stage_model(self, s: StageStrategy) -> StageModel:
        key = (s.tp, s.recompute_attention, s.recompute_activation, s.sequence_parallel, s.cp)
        m = self._models.get(key)
        if m is None:
            t = self.training
            m = self._models[key] = StageModel(
                self.model,
                self.profile,
                s.tp,
                t.flash_attention,
                t.seq_len,
                precision_for(t, self.profile),
                s.recompute_attention,
                s.recompute_activation,
                s.sequence_parallel,
                s.cp,
                # the blocks as `simulate_plan` prices them: the candidates run 1F1B, plain or
                # interleaved (`plan`), never ZB-H1
                compile_mode(t.compile_blocks, SCHEDULES[0]),
                # (a larger micro-batch, which a space seldom costs, is computed on its own)
                batch_sizes=micro_batch_sizes(t.global_batch, SearchSpace.b_max),
            )
        return m

    def cost(self, G: int, stages: tuple) -> _Cost:
        key = (G, stages)
        c = self._plans.get(key)
        if c is not None:
            return c
        if self.exact:
            sim = simulate_plan(self.plan(G, stages), self.profile)
            c = _Cost(
                sim.iteration_time_s,
                sim.fits,
                tuple(s.stable_time_s for s in sim.stages),
                tuple(float(need_bytes(s.peak_memory_bytes)) for s in sim.stages),
                self.capacity,
            )
        else:
            pp = len(stages)
            interleaved = stages[0].chunk_layers is not None
            rows: list = [self._stage.get((i, pp, G, s)) for i, s in enumerate(stages)]
            if any(r is None for r in rows):
                plan = self.plan(G, stages)
                inputs = stage_inputs(plan)  # validates the plan
                chunks = chunk_inputs(plan, inputs) if interleaved else [None] * pp
                for i, (st, s) in enumerate(zip(inputs, stages)):
                    if rows[i] is None:
                        rows[i] = self._stage[(i, pp, G, s)] = self._row(i, pp, G, s, st, chunks[i])
            T, F, X, Y, P, H = (np.array(col) for col in zip(*(r[:6] for r in rows)))
            if interleaved:  # the chunks played through the interleaved order, as simulate_plan does
                cf, cb, cx, cy = (np.array([r[6][j] for r in rows]) for j in range(4))
                it = float(interleaved_recurrence(cf, cb, cx, cy, G))
            else:
                it = float(iteration_time(T, G, first=X, last=Y, fwd=F))
            needs = tuple(float(need_bytes(p)) for p in P)
            host_ok = (
                self.host_cap is None
                or max(node_usage([s.gpus for s in stages], list(H), self.cluster.gpus_per_node)) <= self.host_cap
            )
            c = _Cost(
                it, host_ok and all(n <= self.capacity for n in needs), tuple(float(t) for t in T), needs, self.capacity
            )
        self._plans[key] = c
        self.count += 1
        self.min_need = min(self.min_need, max(c.needs))
        return c

    def warm(self, candidates) -> None:
        """Evaluate the stage rows that `cost` will need for `candidates` in batches: one
        `StageModel.evaluate` per stage model and stage position over all their strategies (the
        arrays of a `StageInput`), element for element what one evaluation each gives; for an
        interleaved candidate its chunks first, then its ranks with their in-flight counts."""
        if self.exact:
            return
        if self.pool is not None:  # the layers these candidates read, traced in parallel first
            self.pool.prefetch(r for _, stages in candidates for s in stages for r in self._stage_model(s).analyses())
        plain: dict = {}  # row key -> (model, input)
        chunk_jobs: dict = {}  # chunk key -> (model, chunk input)
        ranks = []  # (row key, model, input, stage index, pp, G, chunk keys)
        for G, stages in candidates:
            pp = len(stages)
            keys = [(i, pp, G, s) for i, s in enumerate(stages)]
            if all(k in self._stage for k in keys):
                continue
            interleaved = stages[0].chunk_layers is not None
            try:
                plan = self.plan(G, stages)
                inputs = stage_inputs(plan)
                chunks = chunk_inputs(plan, inputs) if interleaved else None
            except ValueError:
                continue  # (`cost` raises it for the candidate)
            for i, (key, st, s) in enumerate(zip(keys, inputs, stages)):
                if key in self._stage:
                    continue
                m = self._stage_model(s)
                if chunks is None:
                    plain[key] = (m, st)
                    continue
                cks = [_chunk_key(s, c) for c in chunks[i]]
                chunk_jobs.update({ck: (m, c) for ck, c in zip(cks, chunks[i]) if ck not in self._stage})
                ranks.append((key, m, st, i, pp, G, cks))
        self._stage.update(zip(plain, _evaluate_many(list(plain.values()), _ROW_COLS)))
        self._stage.update(zip(chunk_jobs, _evaluate_many(list(chunk_jobs.values()), _CHUNK_COLS)))
        jobs = []
        for _, m, st, i, pp, G, cks in ranks:
            saved = np.array([self._stage[ck][0] for ck in cks])
            jobs.append((m, interleaved_rank_input(st, i, pp, G, saved)))
        for (key, *_, cks), (peak, host) in zip(ranks, _evaluate_many(jobs, ("peak", "host_peak"))):
            self._stage[key] = _interleaved_row([self._stage[ck] for ck in cks], peak, host)

    def _row(self, i: int, pp: int, G: int, s: StageStrategy, st, chunks) -> tuple:
        """Stage i's (T, F, X, Y, peak, host peak) and, for an interleaved stage (`chunks`, its
        chunks' inputs), its chunks' (forward, backward, first, last) times: the rank's memory
        with its chunks' in-flight activations, its times their sums (as `simulate_plan`)."""
        m = self._stage_model(s)
        if chunks is None:
            return _evaluate_many([(m, st)], _ROW_COLS)[0]
        cs = [self._chunk(m, s, c) for c in chunks]
        saved = np.array([c[0] for c in cs])
        r = m.evaluate(interleaved_rank_input(st, i, pp, G, saved))
        return _interleaved_row(cs, float(r.peak[0]), float(r.host["peak_bytes"][0]))

    def _chunk(self, m: StageModel, s: StageStrategy, c) -> tuple:
        """A chunk's `_CHUNK_COLS`, memoized (`_chunk_key`)."""
        key = _chunk_key(s, c)
        r = self._stage.get(key)
        if r is None:
            r = self._stage[key] = _evaluate_many([(m, c)], _CHUNK_COLS)[0]
        return r


def _chunk_key(s: StageStrategy, c) -> tuple:
    """What a chunk's result depends on: its rank's strategy, its blocks and recomputed ones,
    whether it holds the embedding or head, the pipeline's chunks and G (not its position, as a
    chunk's input holds no in-flight count)."""
    return ("chunk", s, c.first, c.last, c.num_stages, c.G, int(c.layers[0]), int(c.recompute[0]))


def _interleaved_row(cs: list, peak: float, host_peak: float) -> tuple:
    """An interleaved rank's row from its chunks' `_CHUNK_COLS` and its memory peaks."""
    f, t, x, y = (tuple(c[k] for c in cs) for k in (1, 2, 3, 4))
    per_chunk = (f, tuple(a - b for a, b in zip(t, f)), x, y)
    return (sum(t), sum(f), sum(x), sum(y), peak, host_peak, per_chunk)


# what a stage row keeps of a `StageResult`, and what a chunk's keeps
_ROW_COLS = ("T", "fwd", "first_extra", "last_extra", "peak", "host_peak")
_CHUNK_COLS = ("saved_per_microbatch", "fwd", "T", "first_extra", "last_extra")


def _evaluate_many(jobs: list, cols: tuple) -> list[tuple]:
    """`cols` of each (stage model, single-strategy input) job, evaluated in batches: the jobs
    of one model whose inputs differ only in their strategy arrays (and in-flight count) share
    one `evaluate`."""
    groups: dict = {}
    for n, (m, st) in enumerate(jobs):
        batched = _BATCHED + (("in_flight",) if st.in_flight is not None else ())
        # (an interleaved rank's `HeldStates` vary with its chunks as `in_flight` does; their
        # states' sends are the rank's, set by the shared fields)
        shared = (id(m), batched) + tuple(
            getattr(st, f.name) for f in fields(st) if f.name not in batched and f.name not in _HELD_STATES
        )
        groups.setdefault(shared, (m, batched, []))[2].append((n, st))
    out: list = [None] * len(jobs)
    for m, batched, members in groups.values():
        sts = [st for _, st in members]
        r = m.evaluate(
            replace(
                sts[0],
                **{f: np.concatenate([np.ravel(getattr(st, f)) for st in sts]) for f in batched},
                **{f: _joined([getattr(st, f) for st in sts]) for f in _HELD_STATES},
            )
        )
        columns = [r.host["peak_bytes"] if c == "host_peak" else getattr(r, c) for c in cols]
        for j, (n, _) in enumerate(members):
            out[n] = tuple(float(np.ravel(c)[j]) for c in columns)
    return out


_HELD_STATES = ("beside_embedding", "at_blocks", "at_head")  # `HeldStates` fields, joined over a batch


def _joined(besides: list) -> HeldStates | None:
    """One `HeldStates` of a batch from its members' (each state's micro-batches side by
    side), or None where the members have none."""
    if besides[0] is None:
        return None

    def join(side: str) -> tuple:
        states = zip(*(getattr(b, side) for b in besides))
        return tuple((np.concatenate([np.ravel(n) for n, _, _ in st]), st[0][1], st[0][2]) for st in states)

    return HeldStates(join("forward"), join("backward"))


# candidates costed per batch (`_Evaluator.warm`), and the fields of a stage that vary within one
_BATCH = 256
_BATCHED = (
    "layers",
    "recompute",
    "b",
    "dp",
    "zero",
    "offload_weights",
    "offload_grads",
    "offload_optimizer",
    "offload_activations",
)


def _best_of(ev: _Evaluator, candidates, deadline: float):
    best, best_c = None, None
    it = iter(candidates)
    while batch := list(itertools.islice(it, _BATCH)):
        ev.warm(batch)
        for G, stages in batch:
            c = ev.cost(G, stages)
            if c.fits and (best_c is None or c.time < best_c.time):
                best, best_c = (G, stages), c
        if time.monotonic() > deadline:
            ev.cut_short = ev.cut_short or next(it, None) is not None
            break
    return best


def _run(
    space: str, search, model, cluster, training, profile, time_budget, none_reason: str, engine: str = "mist"
) -> TuneResult:
    """The fastest plan that fits of the space `search` walks, its candidates run by `engine`."""
    t0 = time.monotonic()
    budget = math.inf if time_budget is None else float(time_budget)
    ref = preset_ref(model)
    traced = 0.0  # wall seconds the pools' workers spent tracing
    for exact in (False, True):
        with TracePool() as pool:
            ev = _Evaluator(model, cluster, training, profile, exact=exact, model_ref=ref, pool=pool, engine=engine)
            best = search(ev, t0, budget)
        traced += pool.seconds
        if best is None:
            break
        plan = ev.plan(*best)
        sim = simulate_plan(plan, profile)
        fast = ev.cost(*best)
        if exact or (
            sim.fits == fast.fits and math.isclose(sim.iteration_time_s, fast.time, rel_tol=1e-9, abs_tol=1e-12)
        ):
            return TuneResult(
                space=space,
                plan=plan,
                predicted=sim,
                tuning_time_s=time.monotonic() - t0,
                candidates_evaluated=ev.count,
                infeasible_reason=None if sim.fits else "; ".join(sim.memory_problems),
                budget_ran_out=ev.cut_short,
                tracing_time_s=traced,
            )
    if ev.cut_short:
        reason = no_plan_in_budget_words(budget, space, traced)
    elif ev.count == 0:
        reason = (
            f"No {space} candidate exists for {model.name or 'the model'} on "
            f"{cluster.world_size} GPUs with global batch {training.global_batch}: {none_reason}."
        )
    elif ev.min_need <= ev.capacity:
        reason = (
            f"No {space} plan fits: those that fit the GPUs need more host memory for their "
            f"offloaded states and activations than a node has ({node_host_memory(cluster, profile)[1]})."
        )
    else:
        reason = (
            f"No {space} plan fits: the least memory any of its {ev.count} candidates needs is "
            f"{ev.min_need / GiB:.2f} GiB on its fullest GPU ({NEED_WORDS}), over the "
            f"{ev.capacity / GiB:.1f} GiB of a {profile.name}{outside_words(profile)}."
        )
    return TuneResult(
        space=space,
        plan=None,
        predicted=None,
        tuning_time_s=time.monotonic() - t0,
        candidates_evaluated=ev.count,
        infeasible_reason=reason,
        budget_ran_out=ev.cut_short,
        tracing_time_s=traced,
    )


def _run_enumerated(
    space: str, candidates, model, cluster, training, profile, time_budget, none_reason: str
) -> TuneResult:
    """`_run` of a space that is a list: the fastest plan that fits among `candidates()` (a fresh
    iterator for each of `_run`'s passes) costed before the time budget runs out."""
    return _run(
        space,
        lambda ev, t0, budget: _best_of(ev, candidates(), t0 + budget),
        model,
        cluster,
        training,
        profile,
        time_budget,
        none_reason,
    )


# ------------------------------------------------------------------ Megatron-LM
def _megatron_candidates(model, cluster, training, micro_batches=None, recompute=("full", "none")):
    L, B = model.num_layers, training.global_batch
    micro_batches = micro_batches or MEGATRON_MICRO_BATCHES
    for pp, (n, g) in _depths(model, cluster):
        if L % pp:  # Megatron-LM (core_r0.4.0): num_layers divisible by pp
            continue
        l = L // pp
        for tp in tp_degrees(model, g):
            dp = n * g // tp
            if not _is_pow2(dp):
                continue
            zero = 1 if dp > 1 else 0
            for b in micro_batches:
                if B % (b * dp):
                    continue
                for rc in [l if r == "full" else 0 for r in recompute]:
                    s = StageStrategy(
                        layers=l, nodes=n, gpus_per_node=g, micro_batch=b, dp=dp, tp=tp, zero=zero, recompute_layers=rc
                    )
                    yield B // (b * dp), (s,) * pp


def megatron_training(training: TrainingSpec) -> TrainingSpec:
    """The training as Megatron-LM runs it: fp32 gradients with bf16 parameters (see above)."""
    return replace(training, grad_dtype="fp32") if training.param_dtype == "bf16" else training


def tune_megatron(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile, time_budget: float | None = None
) -> TuneResult:
    """Megatron-LM's space: power-of-two (dp, tp, pp), uniform split, all-or-nothing recompute."""
    training = megatron_training(training)
    return _run_enumerated(
        "megatron",
        lambda: _megatron_candidates(model, cluster, training),
        model,
        cluster,
        training,
        profile,
        time_budget,
        "power-of-two (dp, tp, pp) with pp dividing the layers and micro-batch "
        f"{'/'.join(map(str, MEGATRON_MICRO_BATCHES))} must divide the batch over the GPUs",
    )


def tune_megatron_paper(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile, time_budget: float | None = None
) -> TuneResult:
    """Megatron-LM as the Mist paper's evaluation tuned it: full
    recomputation always on, micro-batch 1/2/4, distributed optimizer; otherwise as above."""
    training = megatron_training(training)
    return _run_enumerated(
        "megatron-paper",
        lambda: _megatron_candidates(model, cluster, training, (1, 2, 4), ("full",)),
        model,
        cluster,
        training,
        profile,
        time_budget,
        "power-of-two (dp, tp, pp) with pp dividing the layers and micro-batch 1/2/4 "
        "must divide the batch over the GPUs",
    )


# ------------------------------------------------------------------ DeepSpeed
def _deepspeed_candidates(model, cluster, training):
    L, B = model.num_layers, training.global_batch
    full = Offload(weights=1.0, grads=1.0, optimizer=1.0)
    for pp, (n, g) in _depths(model, cluster):
        layers = even_split(L, pp)
        for tp in tp_degrees(model, g):
            dp = n * g // tp
            if dp == 1:
                zeros = [0]
            else:
                zeros = [0, 1, 2, 3] if pp == 1 else [0, 1]
            variants = [(z, Offload()) for z in zeros]
            if pp == 1:  # DeepSpeed offloads only without pipeline parallelism
                variants += [(z, Offload(optimizer=1.0)) for z in (zeros[1:] or [0])]  # ZeRO-Offload
                if 3 in zeros:
                    variants.append((3, full))  # ZeRO-Infinity
            for b in DEEPSPEED_MICRO_BATCHES:
                if B % (b * dp):
                    continue
                for z, off in variants:
                    for full_rc in (True, False):
                        yield (
                            B // (b * dp),
                            tuple(
                                StageStrategy(
                                    layers=l,
                                    nodes=n,
                                    gpus_per_node=g,
                                    micro_batch=b,
                                    dp=dp,
                                    tp=tp,
                                    zero=z,
                                    recompute_layers=l if full_rc else 0,
                                    offload=off,
                                )
                                for l in layers
                            ),
                        )


def tune_deepspeed(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile, time_budget: float | None = None
) -> TuneResult:
    """DeepSpeed's space: ZeRO 0–3, ZeRO-Offload/-Infinity (pp = 1), PP, Megatron-DeepSpeed TP."""
    return _run_enumerated(
        "deepspeed",
        lambda: _deepspeed_candidates(model, cluster, training),
        model,
        cluster,
        training,
        profile,
        time_budget,
        f"micro-batch {'/'.join(map(str, DEEPSPEED_MICRO_BATCHES))} × dp must divide the batch",
    )


# ------------------------------------------------------------------ Aceso
def _aceso_start(model, cluster, training, pp, mesh, b):
    n, g = mesh
    dp = n * g
    B = training.global_batch
    if B % (b * dp):
        return None
    stages = tuple(
        StageStrategy(
            layers=l, nodes=n, gpus_per_node=g, micro_batch=b, dp=dp, tp=1, zero=1 if dp > 1 else 0, recompute_layers=0
        )
        for l in even_split(model.num_layers, pp)
    )
    return B // (b * dp), stages


def _aceso_moves(stages: tuple, i: int, samples: int, tp_opts: list[int], flash: bool) -> list[tuple]:
    """Neighbours of a plan that change its bottleneck stage i (samples = b·dp per stage)."""
    pp, s = len(stages), stages[i]
    out = []

    def put(changes: dict):
        new = list(stages)
        for j, v in changes.items():
            new[j] = v
        out.append(tuple(new))

    if s.layers > 1:  # move the boundary layer to a neighbour, which recomputes it or not
        src = replace(s, layers=s.layers - 1, recompute_layers=min(s.recompute_layers, s.layers - 1))
        for j in (i - 1, i + 1):
            if 0 <= j < pp:
                d = stages[j]
                for rc in sorted({d.recompute_layers, d.recompute_layers + 1}):
                    put({i: src, j: replace(d, layers=d.layers + 1, recompute_layers=rc)})
    for delta in (1, 2, -1, -2):
        r = s.recompute_layers + delta
        if 0 <= r <= s.layers:
            put({i: replace(s, recompute_layers=r)})
    put({i: replace(s, recompute_layers=0 if s.recompute_layers else s.layers)})
    # Aceso recomputes single operators: the MLP activation, and without flash the attention core
    put({i: replace(s, recompute_activation=not s.recompute_activation)})
    if not flash:
        put({i: replace(s, recompute_attention=not s.recompute_attention)})
    for tp in (s.tp * 2, s.tp // 2):
        if tp in tp_opts:
            dp = s.gpus // tp
            if samples % dp == 0:
                put({i: replace(s, tp=tp, dp=dp, micro_batch=samples // dp, zero=1 if dp > 1 else 0)})
    return list(dict.fromkeys(o for o in out if o != stages))


def _aceso_walk(ev: _Evaluator, G: int, start: tuple, deadline: float, tp_opts: list[int]):
    flash = ev.training.flash_attention
    samples = start[0].micro_batch * start[0].dp
    cur, cur_c = start, ev.cost(G, start)
    best, best_c = cur, cur_c
    visited = {cur}
    hops = 0
    while True:
        if time.monotonic() >= deadline:
            ev.cut_short = True  # the walk had not settled: Aceso's search is bounded by its budget
            break
        if cur_c.fits:
            i = max(range(len(cur)), key=lambda k: cur_c.stage_times[k])
        else:
            i = max(range(len(cur)), key=lambda k: cur_c.needs[k])
        moves = [m for m in _aceso_moves(cur, i, samples, tp_opts, flash) if m not in visited]
        if not moves:
            break
        scored = [(ev.cost(G, m).objective, k) for k, m in enumerate(moves)]
        obj, k = min(scored)
        cur = moves[k]
        cur_c = ev.cost(G, cur)
        visited.add(cur)
        if obj < best_c.objective:
            best, best_c, hops = cur, cur_c, 0
        else:
            hops += 1
            if hops >= ACESO_MAX_HOPS:
                break
    return best, best_c


def tune_aceso(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile, time_budget: float | None = None
) -> TuneResult:
    """Aceso-style iterative bottleneck alleviation over heterogeneous per-stage strategies."""

    def search(ev, t0, budget):
        total = ACESO_BUDGET_S if time_budget is None else float(time_budget)
        configs = []
        for pp, mesh in _depths(model, cluster):
            tp_opts = tp_degrees(model, mesh[1])
            for b in ACESO_MICRO_BATCHES:
                st = _aceso_start(model, cluster, training, pp, mesh, b)
                if st is not None:
                    configs.append((st, tp_opts))
        best, best_c = None, None
        for k, ((G, start), tp_opts) in enumerate(configs):
            now = time.monotonic()
            left = max(0.0, t0 + total - now)  # out of time: only the balanced start is costed
            found, c = _aceso_walk(ev, G, start, now + left / (len(configs) - k), tp_opts)
            if c.fits and (best_c is None or c.time < best_c.time):
                best, best_c = (G, found), c
        return best

    return _run(
        "aceso",
        search,
        model,
        cluster,
        training,
        profile,
        time_budget,
        f"micro-batch {'/'.join(map(str, ACESO_MICRO_BATCHES))} × the GPUs of a stage must divide the batch",
    )
