"""The outcome of one tuning run: the best plan a search space holds, and what it cost to find."""

from __future__ import annotations

from dataclasses import dataclass

from mist.plan import Plan
from mist.simulate.prediction import Prediction

# what a search's progress is told while worker processes trace the layer variants it will read
TRACING = "tracing layer variants"


def _the_budget(time_budget: float | None) -> str:
    return "The time budget" + (
        f" of {time_budget:g} s" if time_budget is not None and time_budget < float("inf") else ""
    )


def budget_words(time_budget: float | None) -> str:
    """The sentence that tells a user a plan comes from a search its time budget cut short."""
    return (
        f"{_the_budget(time_budget)} ran out before the search was complete: this is the best plan of the "
        "part it searched; a larger --time-budget may find a faster one."
    )


def no_plan_in_budget_words(time_budget: float | None, space: str = "") -> str:
    """The reason a search its time budget cut short gives when it found no fitting plan."""
    return f"{_the_budget(time_budget)} ran out before any fitting {space + ' ' if space else ''}plan was found."


@dataclass
class TuneResult:
    space: str  # "megatron", "deepspeed", "aceso", "full", "mist-paper", ...
    plan: Plan | None  # best feasible plan (None if nothing fits)
    predicted: Prediction | None  # simulate_plan(plan, profile)
    tuning_time_s: float
    candidates_evaluated: int  # plans (or strategies) whose cost was evaluated
    infeasible_reason: str | None  # one sentence when plan is None
    # the time budget ran out before the space was searched through: `plan` is the best of what
    # was searched, which a longer budget may beat (`BUDGET_WORDS` says so to the user)
    budget_ran_out: bool = False

    @property
    def iteration_time_s(self) -> float | None:
        return None if self.predicted is None else self.predicted.iteration_time_s

    def to_json(self) -> dict:
        return {
            "space": self.space,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "tuning_time_s": self.tuning_time_s,
            "candidates_evaluated": self.candidates_evaluated,
            "infeasible_reason": self.infeasible_reason,
            "budget_ran_out": self.budget_ran_out,
        }
