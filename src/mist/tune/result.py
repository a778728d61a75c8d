"""The outcome of one tuning run: the best plan a search space holds, and what it cost to find."""

from __future__ import annotations

from dataclasses import dataclass

from mist.plan import Plan


@dataclass
class TuneResult:
    space: str  # "megatron", "deepspeed", "aceso", "full", "mist-paper", ...
    plan: Plan | None  # best feasible plan (None if nothing fits)
    predicted: dict | None  # simulate_plan(plan, profile)
    tuning_time_s: float
    candidates_evaluated: int  # plans (or strategies) whose cost was evaluated
    infeasible_reason: str | None  # one sentence when plan is None

    @property
    def iteration_time_s(self) -> float | None:
        return None if self.predicted is None else self.predicted["iteration_time_s"]

    def to_json(self) -> dict:
        return {
            "space": self.space,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "predicted": self.predicted,
            "tuning_time_s": self.tuning_time_s,
            "candidates_evaluated": self.candidates_evaluated,
            "infeasible_reason": self.infeasible_reason,
        }
