"""Simulate a whole plan: every stage's schedule, the 1F1B pipeline, memory, throughput, MFU."""

from __future__ import annotations

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
        out.append(StageInput(
            first=i == 0, last=i == S - 1, index=i, num_stages=S,
            layers=np.array([s.layers]), recompute=np.array([s.recompute_layers]),
            b=np.array([s.micro_batch]), dp=np.array([s.dp]), tp=s.tp, zero=np.array([s.zero]),
            wo=np.array([s.offload.weights]), go=np.array([s.offload.grads]),
            oo=np.array([s.offload.optimizer]), ao=np.array([s.offload.activations]),
            G=plan.micro_batches, nodes=s.nodes, gpus_per_node=s.gpus_per_node,
            cluster_gpus_per_node=plan.cluster.gpus_per_node))
    return out


def host_check(plan: Plan, profile, per_gpu_bytes: list[float]) -> dict:
    """Host memory per node (every GPU's offloaded bytes, `StageResult.host`) against the node's RAM."""
    cap, source = node_host_memory(plan.cluster, profile)
    per_node = node_usage([s.gpus for s in plan.stages], per_gpu_bytes, plan.cluster.gpus_per_node)
    over = [(j, b) for j, b in enumerate(per_node) if cap is not None and b > cap]
    problems = [f"node {j} needs {b / 2**30:.2f} GiB of host memory for offloaded states and "
                f"activations, {(b - cap) / 2**30:.2f} GiB over its {cap / 2**30:.1f} GiB ({source})"
                for j, b in over]
    return {"per_node_bytes": [int(round(b)) for b in per_node],
            "capacity_per_node_bytes": None if cap is None else int(cap), "source": source,
            "fits": not over, "problems": problems}


def simulate_plan(plan: Plan, profile, with_events: bool = False) -> dict:
    t = plan.training
    results = []
    prec = precision_for(t, profile)
    for st, s in zip(stage_inputs(plan), plan.stages):
        model = StageModel(plan.model, profile, s.tp, t.flash_attention, t.seq_len, prec,
                           attention_recompute=s.recompute_attention,
                           activation_recompute=s.recompute_activation)
        results.append(model.evaluate(st))
    T = np.array([float(r.T[0]) for r in results])
    F = np.array([float(r.fwd[0]) for r in results])
    X = np.array([float(r.first_extra[0]) for r in results])
    Y = np.array([float(r.last_extra[0]) for r in results])
    G = plan.micro_batches
    it = float(iteration_time(T, G, first=X, last=Y, fwd=F))
    tokens = t.global_batch * t.seq_len
    # model FLOPs of one iteration: every stage's per-micro-batch FLOPs × its dp × G (no recompute)
    flops = sum(float(r.flops_per_microbatch[0]) * s.tp * s.dp * G for r, s in zip(results, plan.stages))
    gpus = plan.cluster.world_size
    capacity = profile.memory_bytes
    stages = []
    fits = True
    problems = []
    for i, (r, s) in enumerate(zip(results, plan.stages)):
        peak = float(r.peak[0])
        need = peak * (1 + ALLOCATOR_MARGIN)
        ok = need <= capacity
        fits &= ok
        if not ok:
            problems.append(f"stage {i} needs {need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + "
                            f"{ALLOCATOR_MARGIN:.0%} allocator margin), {(need - capacity) / 2**30:.2f} GiB "
                            f"over the {capacity / 2**30:.1f} GiB of a {profile.name}")
        stages.append({
            "stable_time_s": float(r.T[0]), "delta_time_s": float(r.D[0]),
            "first_microbatch_extra_s": float(r.first_extra[0]),
            "last_microbatch_extra_s": float(r.last_extra[0]),
            "peak_memory_bytes": int(round(peak)),
            "fwd_peak_bytes": int(round(float(r.fwd_peak[0]))),
            "bwd_peak_bytes": int(round(float(r.bwd_peak[0]))),
            "memory_breakdown": {k: int(round(float(v[0]))) for k, v in r.memory_breakdown.items()},
            # the two terms the runtime accounts tensor by tensor (see `mist.runtime.memory`)
            "state_bytes": int(round(sum(float(r.memory_breakdown[k][0])
                                         for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")))),
            "saved_activation_peak_bytes": int(round(float(r.saved_peak[0]))),
            # host memory per GPU of the stage (the runtime's metrics carry the same three terms)
            **{f"host_{k}": int(round(float(v[0]))) for k, v in r.host.items()},
            "time_breakdown": {k: float(v[0]) for k, v in r.time_breakdown.items()},
            "delta_breakdown": {k: float(v[0]) for k, v in r.delta_breakdown.items()},
            "fits": bool(ok),
        })
    host = host_check(plan, profile, [st["host_peak_bytes"] for st in stages])
    fits &= host["fits"]
    problems += host["problems"]
    out = {
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
    if with_events:
        fwd, bwd = list(F), list(T - F)
        ev_time, events = event_schedule(fwd, bwd, list(X), list(Y), G)
        out["_events"] = events
        out["_channels"] = [{k: float(v[0]) for k, v in r.channels.items()} for r in results]
        out["_stable"] = [(f, b) for f, b in zip(fwd, bwd)]
        out["event_iteration_time_s"] = ev_time
    return out
