"""The prediction of a whole plan as records: what `simulate_plan` returns, what the tuners keep
for their best plan and what `mist validate` puts next to a measurement.

`Prediction.to_json()` is the object `mist simulate --json` prints; its keys are the field names,
so a record's attribute and its JSON key are one name (the runtime's metrics use the same names
for what it measures: `mist.validate.STAGE_ERRORS`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage (rank) of a plan: times of one micro-batch, memory of one GPU."""

    stable_time_s: float  # T: forward + backward of a steady micro-batch
    delta_time_s: float  # D: the once-per-iteration extra (first + last micro-batch)
    first_microbatch_extra_s: float
    last_microbatch_extra_s: float
    peak_memory_bytes: int  # the largest of the forward, backward and optimizer-step peaks
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    step_peak_bytes: int  # the states and the optimizer step's largest fp32 gradient piece
    memory_breakdown: Mapping[str, int]  # named terms of the peak
    state_bytes: int  # weights + gradients + optimizer states on the device
    saved_activation_peak_bytes: int  # saved activations on the device at most
    # host memory per GPU of the stage (the runtime's metrics carry the same terms)
    host_state_bytes: int
    host_optimizer_grad_bytes: int
    host_activation_peak_bytes: int
    host_peak_bytes: int
    time_breakdown: Mapping[str, float]  # named terms of T
    delta_breakdown: Mapping[str, float]  # named terms of D
    fits: bool  # its peak with the allocator margin fits the GPU
    weight_grad_time_s: float | None = None  # a ZB-H1 stage's W of one micro-batch (else None)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("memory_breakdown", "time_breakdown", "delta_breakdown"):
            d[k] = dict(d[k])
        if self.weight_grad_time_s is None:  # written for ZB-H1 plans only
            del d["weight_grad_time_s"]
        return d


@dataclass(frozen=True)
class HostMemory:
    """Host memory per node (every GPU's offloaded bytes) against the node's RAM."""

    per_node_bytes: tuple[int, ...]
    capacity_per_node_bytes: int | None  # None: unknown, not checked
    source: str  # where the capacity comes from
    fits: bool
    problems: tuple[str, ...]  # one sentence per node over its capacity

    def to_json(self) -> dict:
        return {
            "per_node_bytes": list(self.per_node_bytes),
            "capacity_per_node_bytes": self.capacity_per_node_bytes,
            "source": self.source,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Prediction:
    """A plan on a GPU profile: one training iteration's time, throughput and MFU, whether every
    stage fits its GPU and every node's host memory, and each stage's prediction."""

    iteration_time_s: float
    schedule: str
    throughput_samples_per_s: float
    tokens_per_s: float
    mfu: float
    fits: bool
    memory_problems: tuple[str, ...]  # why it does not fit, one sentence each
    capacity_bytes: int  # what PyTorch's allocator can have on one GPU
    host_memory: HostMemory
    gpu: str
    profile: str  # the profile's provenance
    stages: tuple[StagePrediction, ...]

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["memory_problems"] = list(self.memory_problems)
        d["host_memory"] = self.host_memory.to_json()
        d["stages"] = [s.to_json() for s in self.stages]
        return d
