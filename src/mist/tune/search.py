"""`mist tune`: the outer loops (pipeline depth pp, gradient accumulation G, and for the paper's
space one TP degree for all stages) around intra-stage frontiers and the inter-stage program;
for each (pp, G) also interleaved 1F1B with the space's chunk counts v (`tune.interleaved`) and
the zero-bubble ZB-H1 schedule when the space has it (`tune.zero_bubble`).

Pruning: a (pp, G) pair is skipped when a lower bound — every block at its fastest steady time,
spread perfectly over pp stages, for G + pp − 1 micro-batch slots — is not below the best plan
found so far. The search first uses strategies without weight/gradient offload (they add PCIe
traffic every micro-batch); only when nothing fits does it open those knobs as well.

Names: L the model's blocks, pp the pipeline depth (stages), G micro-batches per iteration, B the
global batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from mist.analysis.prefetch import TracePool
from mist.hardware.host_memory import node_host_memory
from mist.plan import Plan, StageStrategy
from mist.rules.compiled_blocks import compile_mode
from mist.rules.zero_bubble_order import ZB_H1
from mist.simulate.gpu_fit import NEED_WORDS, need_bytes, outside_words, usable_bytes
from mist.simulate.plan_sim import simulate_plan
from mist.simulate.precision import precision_for
from mist.specs.model import ModelSpec
from mist.specs.presets import preset_ref
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.inter import best_split
from mist.tune.interleaved import best_interleaved, chunk_counts
from mist.tune.intra import StageTables
from mist.tune.result import TRACING, TuneResult, no_plan_in_budget_words
from mist.tune.space import MAX_UNIFORM_TP, SearchSpace, get_space, tp_degrees
from mist.tune.zero_bubble import as_zero_bubble, best_zero_bubble, zb_analyses


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (trial division up to √n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def stage_meshes(cluster: ClusterSpec, L: int) -> list[tuple[int, int, int]]:
    """(pp, nodes per stage, GPUs per node per stage) for every pipeline depth pp ≤ L (the
    model's blocks) with equal meshes."""
    out = []
    N, K = cluster.nodes, cluster.gpus_per_node
    for pp in _divisors(N * K):
        if pp > L:
            continue
        if pp <= N:
            if N % pp == 0:
                out.append((pp, N // pp, K))
        elif pp % N == 0 and K % (pp // N) == 0:
            out.append((pp, 1, K // (pp // N)))
    return out


def g_values(B: int, policy: str) -> list[int]:
    gs = _divisors(B)
    if policy == "pow2":
        gs = [g for g in gs if g & (g - 1) == 0]
    return gs


@dataclass
class _Best:
    objective: float = np.inf
    plan: Plan | None = None


@dataclass
class _Search:
    """What a search has found so far; its loops update it."""

    best: _Best = field(default_factory=_Best)
    evaluated: int = 0
    min_peak: float = np.inf  # see `_infeasible`
    min_host: float = np.inf
    t0: float = 0.0  # when the search started (perf_counter), and its time budget
    time_budget: float | None = None
    pool: TracePool | None = None  # traces the layers ahead of the search (see `_prefetch`)


def tune(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    profile,
    space: str | SearchSpace = "full",
    time_budget: float | None = None,
    progress=None,
) -> TuneResult:
    """Search the space for the fastest plan that fits. `progress(done, total, best_s)` is
    called after every (pp, G) pair when given, and, while the worker processes trace the layer
    variants the search will read, `progress(done, total, inf, TRACING)` (`done` of `total`
    variants: what a first search of a model spends most of its time on)."""
    with TracePool() as pool:
        return _tune(model, cluster, training, profile, space, time_budget, progress, pool)


def _tune(model, cluster, training, profile, space, time_budget, progress, pool: TracePool | None) -> TuneResult:
    sp = get_space(space) if isinstance(space, str) else space
    t0 = time.perf_counter()
    L, B = model.num_layers, training.global_batch
    state = _Search(t0=t0, time_budget=time_budget, pool=pool)
    budget_hit = False
    node_host, host_source = node_host_memory(cluster, profile)
    host_cap = None if node_host is None else node_host / cluster.gpus_per_node
    if sp.seed_space:
        _seed(state, sp.seed_space, sp, model, cluster, training, profile, time_budget, progress)
    combos = _combos(cluster, sp, L, B)
    phases = (True,) if sp.wg_policy == "always" else (False, True)
    if all(v == 0 for v in sp.offload_weights) and all(v == 0 for v in sp.offload_grads):
        phases = (False,)
    for cp in _cp_values(sp, training, cluster.gpus_per_node):
        if cp > 1 and state.best.plan is not None and not _activation_bound(state.best.plan):
            break
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            budget_hit = True  # a context-parallel degree left unsearched
            break
        near, cp_sp = combos, sp
        if cp > 1 and state.best.plan is not None:
            near, cp_sp = _around(combos, state.best.plan, cp), _no_more_tp(sp, state.best.plan)
        budget_hit = _search_phases(
            state, cp_sp, phases, near, cp, model, cluster, training, profile, host_cap, progress
        )
        if budget_hit:
            break
    elapsed = time.perf_counter() - t0
    traced = 0.0 if pool is None else pool.seconds
    if state.best.plan is None:
        reason = _infeasible(state.min_peak, state.min_host, profile, host_cap, host_source, L)
        if budget_hit:
            reason = no_plan_in_budget_words(time_budget, tracing_s=traced)
        return TuneResult(sp.name, None, None, elapsed, state.evaluated, reason, budget_hit, traced)
    plan = state.best.plan
    predicted = simulate_plan(plan, profile)
    return TuneResult(sp.name, plan, predicted, elapsed, state.evaluated, None, budget_hit, traced)


def _search_phases(state, sp, phases, combos, cp, model, cluster, training, profile, host_cap, progress) -> bool:
    """Search every (pp, G) pair with context parallelism cp, first without weight/gradient
    offload, then with it if nothing fit; True when the time budget ran out."""
    t0, budget = state.t0, state.time_budget
    _prefetch(state, sp, combos, cp, model, cluster, training, profile, progress)
    for with_wg in phases:
        done = 0
        for (pp, nodes, gpn), G in combos:
            if budget is not None and time.perf_counter() - t0 > budget:
                return True
            if gpn % cp:
                continue
            mesh = (pp, nodes, gpn)
            tables = _stage_tables(sp, mesh, G, with_wg, host_cap, cp, model, cluster, training, profile)
            zb = _zero_bubble_tables(tables, sp, mesh, G, with_wg, host_cap, cp, model, cluster, training, profile)
            for tp_fixed in _tp_loop(sp, model, gpn):
                _search_tables(state, tables, tp_fixed, model, cluster, training)
                _search_interleaved(state, tables, tp_fixed, model, cluster, training)
                _search_zero_bubble(state, zb, tp_fixed, model, cluster, training)
            done += 1
            if progress is not None:
                progress(done, len(combos), state.best.objective)
        if state.best.plan is not None:
            return False
    return False


def _prefetch(
    state: _Search, sp: SearchSpace, combos: list, cp: int, model, cluster, training, profile, progress=None
) -> None:
    """Trace every layer analysis the (pp, G) pairs' stage tables will read, in parallel worker
    processes (`mist.analysis.prefetch`), before the search reads them one by one."""
    if state.pool is None:
        return
    requests = []
    for mesh, G in combos:
        if mesh[2] % cp:
            continue
        tables = _stage_tables(sp, mesh, G, False, None, cp, model, cluster, training, profile)
        requests += [r for tp in _tp_loop(sp, model, mesh[2]) for r in tables.analyses(tp)]
        zb = _zero_bubble_tables(tables, sp, mesh, G, False, None, cp, model, cluster, training, profile)
        if zb is not tables:  # (the same tables' analyses are requested above)
            requests += [r for tp in _tp_loop(sp, model, mesh[2]) for r in zb_analyses(zb, tp)]
    told = None if progress is None else lambda done, total: progress(done, total, float("inf"), TRACING)
    state.pool.prefetch(requests, told)


def _stage_tables(
    sp: SearchSpace, mesh, G: int, with_wg: bool, host_cap, cp: int, model, cluster, training, profile, schedule="1f1b"
):
    """The stage tables of one (pp, nodes, gpus per node) mesh and G, for `schedule` (how it runs
    compiled blocks: `rules.compiled_blocks.compile_mode`)."""
    pp, nodes, gpn = mesh
    return StageTables(
        model,
        profile,
        training.seq_len,
        training.flash_attention,
        sp,
        pp,
        G,
        nodes,
        gpn,
        cluster.gpus_per_node,
        training.global_batch,
        with_wg,
        precision_for(training, profile),
        host_cap,
        cp,
        compile_mode(training.compile_blocks, schedule),
    )


def _zero_bubble_tables(
    tables: StageTables,
    sp: SearchSpace,
    mesh,
    G: int,
    with_wg: bool,
    host_cap,
    cp: int,
    model,
    cluster,
    training,
    profile,
) -> StageTables:
    """The stage tables ZB-H1 is searched in: `tables` (those of the other schedules), or, for
    compiled blocks, their own, whose blocks compile the backward split (`rules.compiled_blocks`)."""
    if not training.compile_blocks or ZB_H1 not in sp.schedules:
        return tables
    return _stage_tables(sp, mesh, G, with_wg, host_cap, cp, model, cluster, training, profile, ZB_H1)


def _tp_loop(sp: SearchSpace, model, gpn: int) -> list:
    """The TP degree every stage shares, one search each (the mist-paper space), or [None]."""
    return tp_degrees(model, gpn, MAX_UNIFORM_TP) if sp.uniform_tp else [None]


def _around(combos: list, plan: Plan, cp: int) -> list:
    """The (mesh, G) pairs a context-parallel refinement of `plan` (found without it) searches:
    its pipeline mesh, with its G (the micro-batch cp times larger) or cp·G (the same micro-batch:
    fewer data replicas run more micro-batches). A local search: context parallelism changes a
    plan's activation memory, not where its pipeline is cut."""
    s0 = plan.stages[0]
    mesh = (plan.num_stages, s0.nodes, s0.gpus_per_node)
    return [(m, G) for m, G in combos if m == mesh and G in (plan.micro_batches, plan.micro_batches * cp)]


def _no_more_tp(sp: SearchSpace, plan: Plan) -> SearchSpace:
    """`sp` limited to the TP degrees up to the largest of `plan`'s stages: the context-parallel
    refinement takes its cp ranks from the data replicas or from the TP group, never adds TP (both
    split the activations of a sequence; a plan that did not need more TP without context
    parallelism does not with it). It also spares the traces of larger TP shards under cp."""
    top = max(s.tp for s in plan.stages)
    allowed = [t for t in (sp.tp_values or [2**i for i in range(top.bit_length())]) if t <= top]
    return replace(sp, tp_values=tuple(allowed))


def _activation_bound(plan: Plan) -> bool:
    """Whether a plan pays for its activations' memory (recomputation of any kind, activation
    offload): only then can context parallelism, which moves activation memory to more ranks at
    the price of the K/V exchange, make it faster. (A pruning rule of the search: it can miss a
    pipeline that would gain from the larger G that fewer data replicas allow.)"""
    return any(
        s.recompute_layers or s.recompute_attention or s.recompute_activation or s.offload.activations
        for s in plan.stages
    )


def _seed(
    state: _Search, seed_space: str, sp: SearchSpace, model, cluster, training, profile, time_budget, progress=None
) -> None:
    """A quick search of a sub-space first: its plan is a plan of this space too, and its time is
    an incumbent that prunes most of the larger search (under this space's limits on the
    pipeline depth and TP degrees). Its tracing is told to `progress` (the layers it traces are
    most of what the larger search reads); its (pp, G) pairs are not, being another space's."""
    sub = replace(get_space(seed_space), pp_values=sp.pp_values, tp_values=sp.tp_values)
    told = None if progress is None else lambda *a: a[3:] == (TRACING,) and progress(*a)
    seed = _tune(model, cluster, training, profile, sub, time_budget, told, state.pool)
    state.evaluated += seed.candidates_evaluated
    if seed.plan is not None and seed.iteration_time_s is not None:  # (a plan comes with its time)
        state.best = _Best(seed.iteration_time_s, seed.plan)


def _cp_values(sp: SearchSpace, training: TrainingSpec, gpn: int) -> list[int]:
    """The context-parallel degrees to try: the space's, with flash attention, dividing the
    stage mesh's GPUs per node and splitting the sequence into 2·cp chunks."""
    if not training.flash_attention:
        return [1]
    return [cp for cp in sp.cp_values if cp == 1 or (gpn % cp == 0 and training.seq_len % (2 * cp) == 0)]


def _combos(cluster: ClusterSpec, sp: SearchSpace, L: int, B: int) -> list:
    """((pp, nodes, gpus per node), G) pairs of the space, promising ones first: moderate
    pipelines and many micro-batches per iteration."""
    meshes = [m for m in stage_meshes(cluster, L) if sp.pp_values is None or m[0] in sp.pp_values]
    combos = [(m, G) for m in meshes for G in g_values(B, sp.g_policy)]
    combos.sort(key=lambda x: (abs(np.log2(x[0][0]) - np.log2(max(1, cluster.world_size) ** 0.5)), -x[1]))
    return combos


def _search_tables(state: _Search, tables: StageTables, tp_fixed, model, cluster, training) -> None:
    """Search one (pp, G, mesh, TP degree): every stage's frontiers, then the best split."""
    if not tables.tp_choices(tp_fixed):
        return
    pp, G, L = tables.pp, tables.G, model.num_layers
    lb_layer = tables.min_layer_time()
    if (G + pp - 1) * lb_layer * L / pp >= state.best.objective:
        return
    lo, hi = _layer_range(tables.space, L, pp, G, lb_layer, state.best.objective)
    before = tables.evaluated
    options = _stage_options(state, tables, L, lo, hi, tp_fixed)
    state.evaluated += tables.evaluated - before
    split = best_split(options, L, G, lmin=lo, lmax=hi, bound=state.best.objective)
    if split is not None and split.objective < state.best.objective:
        strategies = [options[i][l].strategies[k] for i, (l, k) in enumerate(zip(split.layers, split.choice))]
        state.best = _Best(split.objective, build_plan(model, cluster, training, G, strategies))


def _search_interleaved(state: _Search, tables: StageTables, tp_fixed, model, cluster, training) -> None:
    """Search one (pp, G, mesh, TP degree) with v ≥ 2 chunks per rank, for each v of the space
    that applies (`interleaved.chunk_counts`)."""
    pp, G, L = tables.pp, tables.G, model.num_layers
    vs = chunk_counts(L, pp, G, tables.space.virtual_stages)
    if not vs or not tables.tp_choices(tp_fixed):
        return
    lb_layer = tables.min_layer_time()
    for v in vs:
        # the bubble shrinks by v: G + (pp − 1)/v micro-batch slots of the fastest blocks
        if (G + (pp - 1) / v) * lb_layer * L / pp >= state.best.objective:
            continue
        before = tables.evaluated
        found = best_interleaved(tables, L, v, tp_fixed)
        state.evaluated += tables.evaluated - before
        if found is not None and found.time < state.best.objective:
            state.best = _Best(found.time, build_plan(model, cluster, training, G, found.strategies, v))


def _search_zero_bubble(state: _Search, tables: StageTables, tp_fixed, model, cluster, training) -> None:
    """Search one (pp, G, mesh, TP degree) under the ZB-H1 schedule when the space has it
    (`tune.zero_bubble`)."""
    pp, G, L = tables.pp, tables.G, model.num_layers
    if ZB_H1 not in tables.space.schedules or pp < 2 or not tables.tp_choices(tp_fixed):
        return
    # ZB-H1 still runs G micro-batches through the bottleneck stage
    if G * tables.min_layer_time() * L / pp >= state.best.objective:
        return
    before = tables.evaluated
    found = best_zero_bubble(tables, L, tp_fixed)
    state.evaluated += tables.evaluated - before
    if found is not None and found.time < state.best.objective:
        plan = build_plan(model, cluster, training, G, found.strategies)
        state.best = _Best(found.time, as_zero_bubble(plan))


def _layer_range(sp: SearchSpace, L: int, pp: int, G: int, lb_layer: float, incumbent: float) -> tuple[int, int]:
    """The fewest and the most blocks a stage may hold."""
    lo, hi = 1, L - pp + 1
    if sp.layer_slack is not None:
        mean = round(L / pp)
        lo, hi = max(1, mean - sp.layer_slack), min(hi, mean + sp.layer_slack)
        if pp == 1 or G == 1:
            lo = hi = L // pp if L % pp == 0 else mean
    # a stage of l blocks takes at least l·lb_layer per micro-batch, so G times that
    # bounds the iteration from below: longer stages cannot beat the incumbent
    if np.isfinite(incumbent):
        hi = min(hi, max(lo, int(incumbent / (G * lb_layer))))
    return lo, hi


def _stage_options(state: _Search, tables: StageTables, L: int, lo: int, hi: int, tp_fixed) -> list[dict]:
    """options[i][l]: the frontier of stage i holding l blocks (those with any point)."""
    options = []
    for i in range(tables.pp):
        row = {}
        for l in range(lo, hi + 1):
            opt = tables.options(i, l, tp_fixed)
            if l >= -(-L // tables.pp):  # some stage of every split holds this many blocks
                state.min_peak = min(state.min_peak, opt.min_peak)
                state.min_host = min(state.min_host, opt.min_host)
            if len(opt.T):
                row[l] = opt
        options.append(row)
    return options


def _gib(n: float) -> str:
    """Bytes as GiB for a message, with three significant digits below 10 GiB (1e-9 GiB is not 0.0)."""
    g = n / 2**30
    return f"{g:.1f} GiB" if g >= 10 else f"{g:.3g} GiB"


def _infeasible(min_peak, min_host, profile, host_cap, host_source, L) -> str:
    """Why nothing fits. min_peak / min_host: the least GPU memory, and the least host memory where
    it fits the GPU, of any stage holding the most blocks of its split (a bound on every split)."""
    need = float(need_bytes(min_peak))
    if not np.isfinite(min_peak):
        return "No configuration of this space applies to this model and cluster."
    if need > usable_bytes(profile):
        return (
            f"No configuration fits: in every split the stage with the most blocks needs at least "
            f"{_gib(need)} per GPU ({NEED_WORDS}), against the "
            f"{_gib(usable_bytes(profile))} of a {profile.name}{outside_words(profile)}."
        )
    if np.isfinite(min_host) and min_host > host_cap:
        return (
            f"No configuration fits the host memory: where the stage with the most blocks fits the GPUs, "
            f"its offloaded states and activations need at least {_gib(min_host)} of host memory "
            f"per GPU, against {_gib(host_cap)} ({host_source})."
        )
    host = "" if host_cap is None else f" and {_gib(host_cap)} of host memory per GPU"
    return (
        f"No configuration fits: single stages fit the {_gib(profile.memory_bytes)} of a "
        f"{profile.name}{host}, but no split of the {L} blocks fits every stage at once."
    )


def build_plan(model, cluster, training, G: int, strategies: list[StageStrategy], virtual_stages: int = 1) -> Plan:
    """The plan of one stage strategy per stage (the frontier points the split chose)."""
    return Plan(
        model=model,
        cluster=cluster,
        training=training,
        micro_batches=G,
        stages=tuple(strategies),
        model_ref=preset_ref(model),
        virtual_stages=virtual_stages,
    )
