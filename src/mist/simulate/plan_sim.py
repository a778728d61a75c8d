"""Simulate a whole plan: every stage's schedule, the 1F1B pipeline, memory, throughput, MFU.

`simulate_plan` returns the prediction (the dict `mist simulate --json` prints); `plan_timeline`
returns the same iteration played event by event as a `Timeline` record (what `--timeline`
draws); `simulate_with_timeline` gives both from one evaluation of the stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist.hardware.host_memory import node_host_memory, node_usage
from mist.plan import Plan
from mist.simulate.pipeline import event_schedule, iteration_time
from mist.simulate.precision import precision_for
from mist.simulate.stage import StageInput, StageModel

# The caching allocator rounds and fragments: feasibility keeps this fraction of the capacity
# free on top of the predicted peak allocated bytes (a named, calibratable assumption; Mist's
# original used a fixed 0.88 of capacity plus hand-tuned per-knob factors).
ALLOCATOR_MARGIN = 0.05


def stage_inputs(plan: Plan) -> list[StageInput]:
    S = plan.num_stages
    out = []
    for i, s in enumerate(plan.stages):
        out.append(
            StageInput(
                first=i == 0,
                last=i == S - 1,
                index=i,
                num_stages=S,
                layers=np.array([s.layers]),
                recompute=np.array([s.recompute_layers]),
                b=np.array([s.micro_batch]),
                dp=np.array([s.dp]),
                tp=s.tp,
                zero=np.array([s.zero]),
                offload_weights=np.array([s.offload.weights]),
                offload_grads=np.array([s.offload.grads]),
                offload_optimizer=np.array([s.offload.optimizer]),
                offload_activations=np.array([s.offload.activations]),
                G=plan.micro_batches,
                nodes=s.nodes,
                gpus_per_node=s.gpus_per_node,
                cluster_gpus_per_node=plan.cluster.gpus_per_node,
            )
        )
    return out


def host_check(plan: Plan, profile, per_gpu_bytes: list[float]) -> dict:
    """Host memory per node (every GPU's offloaded bytes, `StageResult.host`) against the node's RAM."""
    cap, source = node_host_memory(plan.cluster, profile)
    per_node = node_usage([s.gpus for s in plan.stages], per_gpu_bytes, plan.cluster.gpus_per_node)
    over = [(j, b) for j, b in enumerate(per_node) if cap is not None and b > cap]
    problems = (
        []
        if cap is None
        else [
            f"node {j} needs {b / 2**30:.2f} GiB of host memory for offloaded states and "
            f"activations, {(b - cap) / 2**30:.2f} GiB over its {cap / 2**30:.1f} GiB ({source})"
            for j, b in over
        ]
    )
    return {
        "per_node_bytes": [int(round(b)) for b in per_node],
        "capacity_per_node_bytes": None if cap is None else int(cap),
        "source": source,
        "fits": not over,
        "problems": problems,
    }


@dataclass(frozen=True)
class Timeline:
    """One iteration of a plan played through an explicit 1F1B schedule (what `--timeline` draws).

    events: (stage, kind, micro-batch, start s, end s), kind "F" forward, "B" backward, "X" the
    first micro-batch's one-off, "Y" the last one's. channels: per stage, the standalone seconds of
    each transfer channel ("G2G", "C2G", "G2C", ...). stable: per stage, its stable forward and
    backward seconds. iteration_time_s is the closed form `simulate_plan` reports;
    event_iteration_time_s the same iteration played event by event."""

    iteration_time_s: float
    event_iteration_time_s: float
    events: tuple[tuple[int, str, int, float, float], ...]
    channels: tuple[dict[str, float], ...]
    stable: tuple[tuple[float, float], ...]


def _stage_results(plan: Plan, profile) -> list:
    """Every stage's `StageResult` (one candidate each)."""
    t = plan.training
    results = []
    prec = precision_for(t, profile)
    for st, s in zip(stage_inputs(plan), plan.stages):
        model = StageModel(
            plan.model,
            profile,
            s.tp,
            t.flash_attention,
            t.seq_len,
            prec,
            recompute_attention=s.recompute_attention,
            recompute_activation=s.recompute_activation,
        )
        results.append(model.evaluate(st))
    return results


def _pipeline(plan: Plan, results: list):
    """Per-stage stable time T, forward F, first and last extras X, Y, and the iteration time."""
    T = np.array([float(r.T[0]) for r in results])
    F = np.array([float(r.fwd[0]) for r in results])
    X = np.array([float(r.first_extra[0]) for r in results])
    Y = np.array([float(r.last_extra[0]) for r in results])
    it = float(iteration_time(T, plan.micro_batches, first=X, last=Y, fwd=F))
    return T, F, X, Y, it


def _stage_prediction(i: int, r, capacity: float, profile) -> tuple[dict, str | None]:
    """Stage i's entry of the prediction, and the sentence saying why it does not fit (or None)."""
    peak = float(r.peak[0])
    need = peak * (1 + ALLOCATOR_MARGIN)
    ok = need <= capacity
    problem = None
    if not ok:
        problem = (
            f"stage {i} needs {need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + "
            f"{ALLOCATOR_MARGIN:.0%} allocator margin), {(need - capacity) / 2**30:.2f} GiB "
            f"over the {capacity / 2**30:.1f} GiB of a {profile.name}"
        )
    entry = {
        "stable_time_s": float(r.T[0]),
        "delta_time_s": float(r.D[0]),
        "first_microbatch_extra_s": float(r.first_extra[0]),
        "last_microbatch_extra_s": float(r.last_extra[0]),
        "peak_memory_bytes": int(round(peak)),
        "fwd_peak_bytes": int(round(float(r.fwd_peak[0]))),
        "bwd_peak_bytes": int(round(float(r.bwd_peak[0]))),
        "memory_breakdown": {k: int(round(float(v[0]))) for k, v in r.memory_breakdown.items()},
        # the two terms the runtime accounts tensor by tensor (see `mist.runtime.memory`)
        "state_bytes": int(
            round(sum(float(r.memory_breakdown[k][0]) for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")))
        ),
        "saved_activation_peak_bytes": int(round(float(r.saved_peak[0]))),
        # host memory per GPU of the stage (the runtime's metrics carry the same three terms)
        **{f"host_{k}": int(round(float(v[0]))) for k, v in r.host.items()},
        "time_breakdown": {k: float(v[0]) for k, v in r.time_breakdown.items()},
        "delta_breakdown": {k: float(v[0]) for k, v in r.delta_breakdown.items()},
        "fits": bool(ok),
    }
    return entry, problem


def _prediction(plan: Plan, profile, results: list) -> dict:
    t = plan.training
    _, _, _, _, it = _pipeline(plan, results)
    G = plan.micro_batches
    tokens = t.global_batch * t.seq_len
    # model FLOPs of one iteration: every stage's per-micro-batch FLOPs × its dp × G (no recompute)
    flops = sum(float(r.flops_per_microbatch[0]) * s.tp * s.dp * G for r, s in zip(results, plan.stages))
    gpus = plan.cluster.world_size
    capacity = profile.memory_bytes
    entries = [_stage_prediction(i, r, capacity, profile) for i, r in enumerate(results)]
    stages = [e for e, _ in entries]
    problems = [p for _, p in entries if p is not None]
    fits = all(st["fits"] for st in stages)
    host = host_check(plan, profile, [st["host_peak_bytes"] for st in stages])
    fits &= host["fits"]
    problems += host["problems"]
    return {
        "iteration_time_s": it,
        "throughput_samples_per_s": t.global_batch / it,
        "tokens_per_s": tokens / it,
        "mfu": flops / it / (gpus * profile.peak_flops),
        "fits": bool(fits),
        "memory_problems": problems,
        "capacity_bytes": int(capacity),
        "host_memory": {k: v for k, v in host.items() if k != "problems"},
        "gpu": profile.name,
        "profile": profile.provenance,
        "stages": stages,
    }


def _timeline(plan: Plan, results: list) -> Timeline:
    T, F, X, Y, it = _pipeline(plan, results)
    fwd, bwd = list(F), list(T - F)
    ev_time, events = event_schedule(fwd, bwd, list(X), list(Y), plan.micro_batches)
    return Timeline(
        iteration_time_s=it,
        event_iteration_time_s=ev_time,
        events=tuple(events),
        channels=tuple({k: float(v[0]) for k, v in r.channels.items()} for r in results),
        stable=tuple((float(f), float(b)) for f, b in zip(fwd, bwd)),
    )


def simulate_plan(plan: Plan, profile) -> dict:
    """The prediction of `plan` on `profile`: iteration time, throughput, MFU, whether it fits, and
    per stage its times, memory and host memory (the dict `mist simulate --json` prints)."""
    return _prediction(plan, profile, _stage_results(plan, profile))


def plan_timeline(plan: Plan, profile) -> Timeline:
    """One iteration of `plan` on `profile` event by event (see `Timeline`)."""
    return _timeline(plan, _stage_results(plan, profile))


def simulate_with_timeline(plan: Plan, profile) -> tuple[dict, Timeline]:
    """`simulate_plan` and `plan_timeline` from one evaluation of the stages."""
    results = _stage_results(plan, profile)
    return _prediction(plan, profile, results), _timeline(plan, results)
