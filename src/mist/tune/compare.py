"""`mist compare`: the best plan of every space under the one cost model."""

from __future__ import annotations

from mist.tune.run import ALL_SPACES, run_space


def short_summary(plan) -> str:
    st, t = plan.stages, plan.training
    grads = f", {t.grad_dtype} grads" if t.grad_dtype not in (None, t.param_dtype) else ""
    parts = [f"G {plan.micro_batches}{grads}, {len(st)} stage(s)"]
    for s in st:
        off = "/".join(f"{v:g}" for v in s.offload.as_tuple())
        rc = (
            f"rc{s.recompute_layers}"
            + ("+attn" if s.recompute_attention else "")
            + ("+act" if s.recompute_activation else "")
        )
        parts.append(
            f"[{s.layers}L b{s.micro_batch} dp{s.dp} tp{s.tp} z{s.zero} {rc}"
            + (f" off {off}" if any(s.offload.as_tuple()) else "")
            + "]"
        )
    return " ".join(parts)


def compare_spaces(model, cluster, training, profile, time_budget=None, spaces=ALL_SPACES) -> dict:
    results = {sp: run_space(sp, model, cluster, training, profile, time_budget) for sp in spaces}
    ours = results.get("full")
    ours_t = ours.iteration_time_s if ours is not None else None
    rows = []
    for sp, r in results.items():
        it = r.iteration_time_s
        row = {
            "space": sp,
            "iteration_time_s": it,
            "throughput_samples_per_s": training.global_batch / it if it else None,
            "tuning_time_s": r.tuning_time_s,
            "candidates_evaluated": r.candidates_evaluated,
            "speedup_of_full": (it / ours_t) if (it and ours_t) else None,
            "plan": r.plan.to_dict() if r.plan else None,
            "infeasible_reason": r.infeasible_reason,
        }
        if r.plan is not None:
            row["plan_summary"] = short_summary(r.plan)
        rows.append(row)
    return {
        "model": model.name,
        "gpu": profile.name,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "seq_len": training.seq_len,
        "global_batch": training.global_batch,
        "flash_attention": training.flash_attention,
        "spaces": rows,
    }
