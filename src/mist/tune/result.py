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


def _tracing_words(time_budget: float | None, tracing_s: float) -> str:
    # said where tracing took a tenth of the budget or more: a rerun reads the traces from disk
    if time_budget is None or tracing_s < 0.1 * time_budget:
        return ""
    return (
        f" Tracing the model's layer variants took {tracing_s:.1f} s of it; they are cached on disk now, "
        "and a rerun reads them instead."
    )


def budget_words(time_budget: float | None, tracing_s: float = 0.0) -> str:
    """The sentence that tells a user a plan comes from a search its time budget cut short (and,
    where tracing the layers took a good share of that budget, that a rerun will not)."""
    return (
        f"{_the_budget(time_budget)} ran out before the search was complete: this is the best plan of the "
        "part it searched; a larger --time-budget may find a faster one." + _tracing_words(time_budget, tracing_s)
    )


def no_plan_in_budget_words(time_budget: float | None, space: str = "", tracing_s: float = 0.0) -> str:
    """The reason a search its time budget cut short gives when it found no fitting plan."""
    return f"{_the_budget(time_budget)} ran out before any fitting {space + ' ' if space else ''}plan was found." + (
        _tracing_words(time_budget, tracing_s)
    )


@dataclass
class TuneResult:
    space: str  # "megatron", "deepspeed", "aceso", "full", "mist-paper", ...
    plan: Plan | None  # best feasible plan (None if nothing fits)
    predicted: Prediction | None  # simulate_plan(plan, profile)
    tuning_time_s: float
    candidates_evaluated: int  # plans (or strategies) whose cost was evaluated
    infeasible_reason: str | None  # one sentence when plan is None
    # the time budget ran out before the space was searched through: `plan` is the best of what
    # was searched, which a longer budget may beat (`budget_words` says so to the user)
    budget_ran_out: bool = False
    # of tuning_time_s, the wall time the worker processes spent tracing layer variants into the
    # disk cache (`mist.analysis.prefetch`): a rerun of the same model reads them instead
    tracing_time_s: float = 0.0

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
            "tracing_time_s": self.tracing_time_s,
        }
