"""`mist compare`: the best plan of every space under the one cost model, and for each framework
target what Mist's best plan uses that the framework cannot run (what Mist's runtime buys)."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from mist.plan import Plan
from mist.tune.run import ALL_SPACES, TARGET_SPACES, run_space

# Short names of the knobs behind the exporters' refusals (`mist.export.<target>.problems`), in the
# order they are listed; a refusal no pattern names is shown by its own first words.
_KNOB_LABELS = (
    (r"has (dp|tp|micro_batch) \S+ but stage", "per-stage {0}"),
    (r"ZeRO-\d but stage|has zero \d but stage", "per-stage ZeRO"),
    (r"under a pipeline, and torchtitan|pipeline engine allows ZeRO", "ZeRO-2/3 with a pipeline"),
    (r"uses ZeRO-1 \(zero 1\), and torchtitan", "ZeRO-1 without a pipeline"),
    (r"pipeline engine has no tensor parallelism", "tp with a pipeline"),
    (r"\(recompute_layers\)", "per-stage recompute depth"),
    (r"recompute_attention", "attention-core recompute"),
    (r"recompute_activation", "MLP-activation recompute"),
    (r"offload\.activations", "activation offload"),
    (r"offload\.optimizer \S+\) with ZeRO|offloads part of its state|of its gradients but", "fractional offload"),
    (r"optimizer (state )?but stage|differ in CPU offload|all its state under a pipeline", "per-stage offload"),
    (r"virtual_stages", "interleaved 1F1B"),  # only DeepSpeed refuses it
    (r"schedule \(split backward\)", "ZB-H1 schedule"),
    (r"without sequence parallelism", "tp without sequence parallelism"),
    (r"uses sequence parallelism, which", "sequence parallelism"),
    (r"sequence parallelism but stage", "per-stage sequence parallelism"),
    (r"has cp \d+: DeepSpeed", "context parallelism"),
    (r"cp \d+ without ZeRO", "context parallelism without ZeRO"),
    (r"grad_dtype", "16-bit gradients"),
    (r"param_dtype|compute_dtype", "precision"),
    (r"the model is a|rotary_fraction|bias true|tie_embeddings", "model architecture"),
)


def knob_label(problem: str) -> str:
    """The short name of the knob an exporter's refusal sentence is about."""
    for pattern, label in _KNOB_LABELS:
        m = re.search(pattern, problem)
        if m:
            return label.format(*m.groups())
    return " ".join(problem.split()[:6]) + " …"


def beyond_target(plan, target: str) -> list[str]:
    """The knobs of `plan` that `target` (megatron, deepspeed, torchtitan) cannot run, each once."""
    exporter = importlib.import_module(f"mist.export.{target}")
    return list(dict.fromkeys(knob_label(p) for p in exporter.problems(plan)))


def short_summary(plan) -> str:
    st, t = plan.stages, plan.training
    grads = f", {t.grad_dtype} grads" if t.grad_dtype not in (None, t.param_dtype) else ""
    v = plan.virtual_stages
    chunks = f" × {v} chunks (interleaved)" if v > 1 else (", ZB-H1" if plan.schedule != "1f1b" else "")
    parts = [f"G {plan.micro_batches}{grads}, {len(st)} stage(s){chunks}"]
    for s in st:
        off = "/".join(f"{v:g}" for v in s.offload.as_tuple())
        rc = (
            f"rc{s.recompute_layers}"
            + ("+attn" if s.recompute_attention else "")
            + ("+act" if s.recompute_activation else "")
        )
        parts.append(
            f"[{s.layers}L b{s.micro_batch} dp{s.dp}{f' cp{s.cp}' if s.cp > 1 else ''} "
            f"tp{s.tp}{'+sp' if s.sequence_parallel else ''} z{s.zero} {rc}"
            + (f" off {off}" if any(s.offload.as_tuple()) else "")
            + "]"
        )
    return " ".join(parts)


@dataclass(frozen=True)
class SpaceOutcome:
    """One search space's best plan in a comparison."""

    space: str
    iteration_time_s: float | None  # None: no plan fits
    throughput_samples_per_s: float | None
    tuning_time_s: float
    tracing_time_s: float  # of tuning_time_s, tracing layer variants (`TuneResult.tracing_time_s`)
    candidates_evaluated: int
    speedup_of_full: float | None  # this space's time / Mist's full space's
    plan: Plan | None
    infeasible_reason: str | None
    budget_ran_out: bool
    plan_summary: str | None  # `short_summary` of the plan
    # a framework target's space: what Mist's full plan uses that the framework cannot run
    full_plan_needs: tuple[str, ...] | None

    def to_json(self) -> dict:
        d: dict[str, object] = {
            "space": self.space,
            "iteration_time_s": self.iteration_time_s,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "tuning_time_s": self.tuning_time_s,
            "tracing_time_s": self.tracing_time_s,
            "candidates_evaluated": self.candidates_evaluated,
            "speedup_of_full": self.speedup_of_full,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "infeasible_reason": self.infeasible_reason,
            "budget_ran_out": self.budget_ran_out,
        }
        if self.plan_summary is not None:
            d["plan_summary"] = self.plan_summary
        if self.full_plan_needs is not None:
            d["full_plan_needs"] = list(self.full_plan_needs)
        return d


@dataclass(frozen=True)
class Comparison:
    """The best plan of every compared space for one model, cluster and training setup."""

    model: str
    gpu: str
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    flash_attention: bool
    spaces: tuple[SpaceOutcome, ...]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "flash_attention": self.flash_attention,
            "spaces": [r.to_json() for r in self.spaces],
        }


def compare_spaces(model, cluster, training, profile, time_budget=None, spaces=ALL_SPACES) -> Comparison:
    """Tune every space in `spaces` (each within `time_budget`) and set their best plans side by side."""
    results = {sp: run_space(sp, model, cluster, training, profile, time_budget) for sp in spaces}
    ours = results.get("full")
    ours_t = ours.iteration_time_s if ours is not None else None
    rows = []
    for sp, r in results.items():
        it = r.iteration_time_s
        target = next((t for t, name in TARGET_SPACES.items() if name == sp), None)
        needs = None
        if target is not None and ours is not None and ours.plan is not None:
            needs = tuple(beyond_target(ours.plan, target))
        rows.append(
            SpaceOutcome(
                space=sp,
                iteration_time_s=it,
                throughput_samples_per_s=training.global_batch / it if it else None,
                tuning_time_s=r.tuning_time_s,
                tracing_time_s=r.tracing_time_s,
                candidates_evaluated=r.candidates_evaluated,
                speedup_of_full=(it / ours_t) if (it and ours_t) else None,
                plan=r.plan,
                infeasible_reason=r.infeasible_reason,
                budget_ran_out=r.budget_ran_out,
                plan_summary=short_summary(r.plan) if r.plan is not None else None,
                full_plan_needs=needs,
            )
        )
    return Comparison(
        model=model.name,
        gpu=profile.name,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        seq_len=training.seq_len,
        global_batch=training.global_batch,
        flash_attention=training.flash_attention,
        spaces=tuple(rows),
    )
