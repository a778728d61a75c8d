"""Rules every target shares: one global device mesh and micro-batch size, placeholders."""

from __future__ import annotations

from dataclasses import replace

from mist.export.records import NotExpressible
from mist.plan import Offload, Plan, StageStrategy
from mist.rules.zero_bubble_order import SCHEDULES

# what the user must fill in before launching (data, tokenizer, checkpoints, hosts)
PLACEHOLDER = "__FILL_IN__"


def uniform_mesh_problems(plan: Plan, target_name: str) -> list[str]:
    """Sentences for the stages whose dp, tp or micro-batch differ from stage 0's: every
    target runs one global mesh and one micro-batch size."""
    s0 = plan.stages[0]
    problems = []
    for i, s in enumerate(plan.stages[1:], start=1):
        for knob in ("dp", "tp", "micro_batch"):
            if getattr(s, knob) != getattr(s0, knob):
                problems.append(
                    f"stage {i} has {knob} {getattr(s, knob)} but stage 0 has {getattr(s0, knob)}, and "
                    f"{target_name} runs one {knob} for the whole pipeline"
                )
    return problems


def sequence_parallel_problems(plan: Plan, target_name: str, always: bool = False) -> list[str]:
    """Sentences for the stages whose sequence parallelism the target cannot follow: it has one
    setting for the whole pipeline (stage 0's), or (`always`) shards the sequence whenever tp > 1."""
    s0 = plan.stages[0]
    out = []
    for i, s in enumerate(plan.stages):
        if always and s.tp > 1 and not s.sequence_parallel:
            out.append(
                f"stage {i} has tp {s.tp} without sequence parallelism, and {target_name}'s tensor parallelism "
                "always shards the sequence of the norms and residuals"
            )
        elif i and s.sequence_parallel != s0.sequence_parallel:
            out.append(
                f"stage {i} {'uses' if s.sequence_parallel else 'does not use'} sequence parallelism but stage 0 "
                f"{'does' if s0.sequence_parallel else 'does not'}, and {target_name} has one setting for the "
                "whole pipeline"
            )
    return out


def schedule_problems(plan: Plan, target_name: str) -> list[str]:
    """A zero-bubble plan: none of the targets runs ZB-H1 as such (torchtitan's zero-bubble
    schedules are interleaved or V-shaped)."""
    if plan.schedule == SCHEDULES[0]:
        return []
    return [f"its {plan.schedule} schedule (split backward) has no {target_name} equivalent, which runs 1F1B"]


def compile_problems(plan: Plan, target_name: str) -> list[str]:
    """Compiled blocks (`training.compile_blocks`), for a target that runs its own blocks."""
    if not plan.training.compile_blocks:
        return []
    return [
        f"its decoder blocks run compiled by Inductor (training.compile_blocks), and {target_name} runs its own "
        "eager and hand-fused blocks"
    ]


def eager_blocks(plan: Plan) -> Plan:
    """`plan` with eager blocks (the nearest plans of the targets that do not compile them)."""
    if not plan.training.compile_blocks:
        return plan
    return replace(plan, training=replace(plan.training, compile_blocks=False))


def one_f_one_b(plan: Plan) -> Plan:
    """`plan` on the 1F1B schedule (the nearest plans start from it)."""
    return plan if plan.schedule == SCHEDULES[0] else replace(plan, schedule=SCHEDULES[0])


def plain_pipeline(plan: Plan) -> Plan:
    """`plan` as plain 1F1B: every stage keeps its layers as one chunk (the nearest plans start
    from it)."""
    plan = one_f_one_b(plan)
    if plan.virtual_stages == 1:
        return plan
    return replace(plan, virtual_stages=1, stages=tuple(replace(s, chunk_layers=None) for s in plan.stages))


def refuse(problems: list[str], target_name: str) -> None:
    """Raise the first problem as one sentence (exit 2 in the CLI)."""
    if problems:
        raise NotExpressible(
            f"{target_name} cannot run this plan: {problems[0]} (export with --approximate for the "
            f"nearest plan it can run)."
        )


def with_stages(plan: Plan, stages: list[StageStrategy]) -> Plan:
    """`plan` with its stages replaced (checked again by `Plan`)."""
    return replace(plan, stages=tuple(stages))


def without_offload(s: StageStrategy, keep: tuple[str, ...] = ()) -> StageStrategy:
    """`s` with every offload fraction not named in `keep` set to 0."""
    kw = {k: (getattr(s.offload, k) if k in keep else 0.0) for k in ("weights", "grads", "optimizer", "activations")}
    return replace(s, offload=Offload(**kw))
