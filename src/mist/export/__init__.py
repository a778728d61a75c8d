"""`mist export`: a plan as the launch files of Megatron-LM, DeepSpeed or torchtitan.

Each target module has `problems(plan) -> list[str]` (the knobs it cannot express, one sentence
each, naming the stage), `nearest(plan) -> Plan` (the closest plan it can run) and
`write(plan, out_dir) -> Export` (the files its users launch). `export_plan` refuses a plan with
problems unless asked to approximate it.
"""

from __future__ import annotations

from pathlib import Path

from mist.export import deepspeed, megatron, torchtitan
from mist.export.common import refuse
from mist.export.records import Export, NotExpressible
from mist.plan import Plan

TARGETS = {"megatron": megatron, "deepspeed": deepspeed, "torchtitan": torchtitan}
TARGET_NAMES = {"megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "torchtitan": "torchtitan"}

__all__ = ["TARGETS", "Export", "NotExpressible", "export_plan"]


def export_plan(plan: Plan, target: str, out_dir: str | Path, approximate: bool = False) -> tuple[Export, Plan]:
    """(what was written, the plan it was written for: `plan` itself, or its nearest runnable
    plan with `approximate`)."""
    if target not in TARGETS:
        raise NotExpressible(f"--to must be one of {', '.join(TARGETS)}, not {target!r}.")
    mod = TARGETS[target]
    if approximate:
        plan = mod.nearest(plan)
    refuse(mod.problems(plan), TARGET_NAMES[target])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return mod.write(plan, out), plan
