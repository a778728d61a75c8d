"""`mist tune`: the outer loops (pipeline depth S, gradient accumulation G, and for the paper's
space one TP degree for all stages) around intra-stage frontiers and the inter-stage program.

Pruning: a (S, G) pair is skipped when a lower bound — every block at its fastest steady time,
spread perfectly over S stages, for G + S − 1 micro-batch slots — is not below the best plan
found so far. The search first uses strategies without weight/gradient offload (they add PCIe
traffic every micro-batch); only when nothing fits does it open those knobs as well.
"""

from __future__ import annotations

import math

import time
from dataclasses import dataclass, replace

import numpy as np

from mist.hardware.host_memory import node_host_memory
from mist.plan import Offload, Plan, StageStrategy
from mist.simulate.plan_sim import ALLOCATOR_MARGIN, simulate_plan
from mist.simulate.precision import precision_for
from mist.specs.model import ModelSpec
from mist.specs.presets import preset_ref
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.inter import best_split
from mist.tune.intra import StageTables
from mist.tune.result import TuneResult, public_prediction
from mist.tune.space import SearchSpace, get_space


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (trial division up to √n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def stage_meshes(cluster: ClusterSpec, L: int) -> list[tuple[int, int, int]]:
    """(S, nodes per stage, GPUs per node per stage) for every pipeline depth with equal meshes."""
    out = []
    N, K = cluster.nodes, cluster.gpus_per_node
    for S in _divisors(N * K):
        if S > L:
            continue
        if S <= N:
            if N % S == 0:
                out.append((S, N // S, K))
        elif S % N == 0 and K % (S // N) == 0:
            out.append((S, 1, K // (S // N)))
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


def tune(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, profile,
         space: str | SearchSpace = "full", time_budget: float | None = None,
         progress=None) -> TuneResult:
    """Search the space for the fastest plan that fits. `progress(done, total, best_s)` is
    called after every (S, G) pair when given."""
    sp = get_space(space) if isinstance(space, str) else space
    t0 = time.perf_counter()
    L, B = model.num_layers, training.global_batch
    best = _Best()
    evaluated = 0
    min_peak = min_host = np.inf
    budget_hit = False
    node_host, host_source = node_host_memory(cluster, profile)
    host_cap = None if node_host is None else node_host / cluster.gpus_per_node
    if sp.seed_space:
        # a quick search of a sub-space first: its plan is a plan of this space too, and its
        # time is an incumbent that prunes most of the larger search (under this space's limits
        # on the pipeline depth and TP degrees)
        sub = replace(get_space(sp.seed_space), pp_values=sp.pp_values, tp_values=sp.tp_values)
        seed = tune(model, cluster, training, profile, sub, time_budget)
        evaluated += seed.candidates_evaluated
        if seed.plan is not None:
            best = _Best(seed.iteration_time_s, seed.plan)
    meshes = [m for m in stage_meshes(cluster, L) if sp.pp_values is None or m[0] in sp.pp_values]
    combos = [(m, G) for m in meshes for G in g_values(B, sp.g_policy)]
    # visit promising pairs first: moderate pipelines and many micro-batches per iteration
    combos.sort(key=lambda x: (abs(np.log2(x[0][0]) - np.log2(max(1, cluster.world_size) ** 0.5)), -x[1]))
    phases = (True,) if sp.wg_policy == "always" else (False, True)
    if all(v == 0 for v in sp.wo) and all(v == 0 for v in sp.go):
        phases = (False,)
    for with_wg in phases:
        done = 0
        for (S, nodes, gpn), G in combos:
            if time_budget is not None and time.perf_counter() - t0 > time_budget:
                budget_hit = True
                break
            tps = [None]
            if sp.uniform_tp:
                tps = [t for t in (1, 2, 4, 8, 16) if t <= gpn]
            for tp_fixed in tps:
                tables = StageTables(model, profile, training.seq_len, training.flash_attention, sp, S, G,
                                     nodes, gpn, cluster.gpus_per_node, B, with_wg,
                                     precision_for(training, profile), host_cap)
                if not tables.tp_choices(tp_fixed):
                    continue
                lb_layer = tables.min_layer_time()
                if (G + S - 1) * lb_layer * L / S >= best.objective:
                    continue
                lo, hi = 1, L - S + 1
                if sp.layer_slack is not None:
                    mean = round(L / S)
                    lo, hi = max(1, mean - sp.layer_slack), min(hi, mean + sp.layer_slack)
                    if S == 1 or G == 1:
                        lo = hi = L // S if L % S == 0 else mean
                # a stage of l blocks takes at least l·lb_layer per micro-batch, so G times that
                # bounds the iteration from below: longer stages cannot beat the incumbent
                if np.isfinite(best.objective):
                    hi = min(hi, max(lo, int(best.objective / (G * lb_layer))))
                options = []
                for i in range(S):
                    row = {}
                    for l in range(lo, hi + 1):
                        opt = tables.options(i, l, tp_fixed)
                        if l >= -(-L // S):   # some stage of every split holds this many blocks
                            min_peak = min(min_peak, opt.min_peak)
                            min_host = min(min_host, opt.min_host)
                        if len(opt.T):
                            row[l] = opt
                    options.append(row)
                evaluated += tables.evaluated
                split = best_split(options, L, G, lmin=lo, lmax=hi, bound=best.objective)
                if split is not None and split.objective < best.objective:
                    strategies = [options[i][l].strategies[k] for i, (l, k) in enumerate(zip(split.layers, split.choice))]
                    best = _Best(split.objective, build_plan(model, cluster, training, S, nodes, gpn, G,
                                                             split.layers, strategies))
            done += 1
            if progress is not None:
                progress(done, len(combos), best.objective)
        if best.plan is not None or budget_hit:
            break
    elapsed = time.perf_counter() - t0
    if best.plan is None:
        reason = _infeasible(min_peak, min_host, profile, host_cap, host_source, L)
        if budget_hit:
            reason = f"The time budget of {time_budget:g} s ran out before any fitting plan was found."
        return TuneResult(sp.name, None, None, elapsed, evaluated, reason)
    plan = best.plan
    predicted = public_prediction(simulate_plan(plan, profile))
    return TuneResult(sp.name, plan, predicted, elapsed, evaluated, None)


def _gib(n: float) -> str:
    """Bytes as GiB for a message, with three significant digits below 10 GiB (1e-9 GiB is not 0.0)."""
    g = n / 2**30
    return f"{g:.1f} GiB" if g >= 10 else f"{g:.3g} GiB"


def _infeasible(min_peak, min_host, profile, host_cap, host_source, L) -> str:
    """Why nothing fits. min_peak / min_host: the least GPU memory, and the least host memory where
    it fits the GPU, of any stage holding the most blocks of its split (a bound on every split)."""
    need = min_peak * (1 + ALLOCATOR_MARGIN)
    if not np.isfinite(min_peak):
        return "No configuration of this space applies to this model and cluster."
    if need > profile.memory_bytes:
        return (f"No configuration fits: in every split the stage with the most blocks needs at least "
                f"{_gib(need)} per GPU (peak + {ALLOCATOR_MARGIN:.0%} allocator margin), against the "
                f"{_gib(profile.memory_bytes)} of a {profile.name}.")
    if np.isfinite(min_host) and min_host > host_cap:
        return (f"No configuration fits the host memory: where the stage with the most blocks fits the GPUs, "
                f"its offloaded states and activations need at least {_gib(min_host)} of host memory "
                f"per GPU, against {_gib(host_cap)} ({host_source}).")
    host = "" if host_cap is None else f" and {_gib(host_cap)} of host memory per GPU"
    return (f"No configuration fits: single stages fit the {_gib(profile.memory_bytes)} of a "
            f"{profile.name}{host}, but no split of the {L} blocks fits every stage at once.")


def build_plan(model, cluster, training, S, nodes, gpn, G, layers, strategies) -> Plan:
    stages = []
    for l, st in zip(layers, strategies):
        stages.append(StageStrategy(
            layers=int(l), nodes=nodes, gpus_per_node=gpn, micro_batch=int(st["b"]), dp=int(st["dp"]),
            tp=int(st["tp"]), zero=int(st["zero"]), recompute_layers=int(st["recompute"]),
            offload=Offload(weights=st["wo"], grads=st["go"], optimizer=st["oo"], activations=st["ao"]),
            recompute_attention=bool(st.get("attn", False)), recompute_activation=bool(st.get("act", False))))
    return Plan(model=model, cluster=cluster, training=training, micro_batches=G, stages=tuple(stages),
                model_ref=preset_ref(model))
