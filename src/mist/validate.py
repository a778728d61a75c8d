"""`mist validate`: run a plan with the runtime and put the measurement next to the prediction.

Errors are signed and relative, (predicted − measured) / measured. When the profile was written
by `mist profile` on this kind of device, a quick re-measurement of a few of its own
micro-benchmarks tells whether the machine has drifted (> 10 %) since the profile was taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mist.checks import is_int
from mist.errors import MistInputError
from mist.plan import Plan, load_plan
from mist.profiling.drift import check as drift_check
from mist.runtime.allocator_trace import TRACED_STEPS
from mist.runtime.config import TrainConfig
from mist.runtime.launch import train_command
from mist.simulate.plan_sim import simulate_plan
from mist.simulate.prediction import Prediction

MIN_STEPS = 2  # the first step warms up (allocations, caches); the measurement is of the later ones

# per-stage quantities compared: (error name, key in both the prediction and the metrics)
STAGE_ERRORS = (
    ("stable_time", "stable_time_s"),
    ("delta_time", "delta_time_s"),
    ("weight_grad_time", "weight_grad_time_s"),  # ZB-H1 stages but the first (None elsewhere)
    ("peak_memory", "peak_memory_bytes"),
    ("state_memory", "state_bytes"),
    ("saved_activations", "saved_activation_peak_bytes"),
    ("host_states", "host_state_bytes"),
    ("host_activations", "host_activation_peak_bytes"),
    ("host_optimizer_grads", "host_optimizer_grad_bytes"),
)


def allocator_prediction(stage) -> int:
    """What a traced CPU run's allocator peak is compared with: the stage's device peak plus its
    host peak, since on a CPU both live in one memory (equal to the device peak without offload;
    with it an upper bound, as the two peaks need not fall at one moment)."""
    return stage.peak_memory_bytes + stage.host_peak_bytes


def _rel(pred, meas):
    if pred is None or meas in (None, 0):
        return None
    return (pred - meas) / meas


@dataclass(frozen=True)
class Validation:
    """A run of a plan next to its prediction."""

    predicted: Prediction
    measured: dict  # the runtime's metrics, as its rank 0 wrote them (`Trainer.metrics`)
    # signed relative errors: "step_time" one number, each `STAGE_ERRORS` name one per stage
    # (None where either side has no value)
    errors: dict
    warnings: tuple[str, ...]  # why the profile may not describe these devices
    drift: dict | None  # the quick re-measurement of the profile's micro-benchmarks, where run

    def to_json(self) -> dict:
        out = {
            "predicted": self.predicted.to_json(),
            "measured": self.measured,
            "errors": self.errors,
            "warnings": list(self.warnings),
        }
        if self.drift is not None:
            out["drift"] = self.drift
        return out


def validate(plan: Plan, profile, metrics: dict, drift: dict | None = None) -> Validation:
    """Combine a simulation of `plan` on `profile` with the runtime's `metrics`: the plan as Mist's
    runtime ran it (`Plan.engine` "mist", whatever framework it was tuned for)."""
    pred = simulate_plan(replace(plan, engine="mist"), profile)
    # the runtime's step is one iteration: G micro-batches, the optimizer step included
    pairs = list(zip(pred.stages, metrics.get("stages", [])))
    errors = {
        "step_time": _rel(pred.iteration_time_s, metrics.get("step_time_s")),
        **{name: [_rel(getattr(ps, key), ms.get(key)) for ps, ms in pairs] for name, key in STAGE_ERRORS},
        # traced CPU runs only (None elsewhere)
        "allocator_peak": [_rel(allocator_prediction(ps), ms.get("allocator_peak_bytes")) for ps, ms in pairs],
    }
    return Validation(pred, metrics, errors, tuple(mismatch(plan, profile)), drift)


def mismatch(plan: Plan, profile) -> list[str]:
    """Sentences on why the profile may not describe the devices this plan runs on."""
    fp = getattr(profile, "fingerprint", None) or {}
    k, world = fp.get("processes"), plan.cluster.world_size
    if fp.get("device_kind") == "cpu" and k and int(k) != world:
        return [
            f"this CPU profile describes one device of a {k}-process run (its thread count, its busy "
            f"neighbours), but the plan runs {world} processes: expect its times not to apply."
        ]
    return []


def run_and_validate(
    plan_path: str, profile, steps: int, local: bool, check_drift: bool, trace_memory: bool = False
) -> Validation | None:
    """`validate` of a run of the plan file (None on a rank of a torchrun launch other than 0);
    `trace_memory`: a CPU run also measures its allocator peak over its first TRACED_STEPS steps,
    which are then not timed."""
    least = TRACED_STEPS + 1 if trace_memory else MIN_STEPS
    if not is_int(steps) or steps < least:
        why = (
            f"the first {TRACED_STEPS} steps run under the memory trace"
            if trace_memory
            else "the first step is warm-up"
        )
        raise MistInputError(
            f"mist validate needs --steps of at least {least}, because {why} and only the later ones "
            f"are measured, got {steps!r}."
        )
    plan = load_plan(plan_path)
    drift = None
    fp = getattr(profile, "fingerprint", None) or {}
    if check_drift and fp.get("device_kind"):
        drift = drift_check(profile, quick=True)
    metrics = train_command(plan_path, TrainConfig(steps=steps, log=False, trace_memory=trace_memory), local)
    if metrics is None:  # a non-zero rank under torchrun
        return None
    return validate(plan, profile, metrics, drift)
