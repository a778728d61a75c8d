"""The record of what a framework's runtime holds on the device beyond Mist's runtime's states
(`mist.rules.deepspeed_buffers`, `mist.rules.megatron_buffers`), which the stage composition adds
to its peaks (`mist.simulate.stage_compose`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineHeld:
    """Device bytes a stage holds beyond its states: at its forward peak, through every backward,
    through the whole run (`always`), and at once after the last backward (the pipeline's
    reduction and the step) in place of Mist's runtime's fp32 step piece (None: priced as Mist's
    runtime's)."""

    backward: float
    step: float | None
    always: float = 0.0
    forward: float = 0.0
