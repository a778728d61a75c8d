"""The non-interleaved 1F1B order of one pipeline stage's forwards and backwards.

Stage i of S runs, over G micro-batches:

- warm-up: the forwards of the first min(S − 1 − i, G) micro-batches (the deeper stages need
  that many in flight before the first gradient comes back);
- steady state: the forward of the next micro-batch, then the backward of the oldest one, until
  every forward has run;
- cool-down: the remaining backwards, oldest first.

The last stage has no warm-up (a forward, then its backward); the first has the longest. Each
micro-batch's backward on stage i waits for its backward on stage i + 1, its forward for its
forward on stage i − 1. The runtime's `PipelineSchedule` runs this order and the simulator's
`event_schedule` times it.
"""

from __future__ import annotations

from mist.rules.values import maximum, minimum

FORWARD, BACKWARD = "F", "B"


def warmup_forwards(stage, stages, micro_batches):
    """Forwards stage `stage` of `stages` runs before its first backward."""
    return minimum(stages - 1 - stage, micro_batches)


def earlier_in_flight(stage, stages, micro_batches):
    """Micro-batches whose saved activations a stage holds at its peak besides the one it runs:
    min(S − 1 − i, G − 1), at least 0 (the peak is after the forward that follows the warm-up)."""
    return maximum(0, minimum(stages - 1 - stage, micro_batches - 1))


def depends_on(kind: str, stage: int, m: int, stages: int) -> tuple[str, int, int] | None:
    """The operation (kind, stage, micro-batch) that (kind, m) on `stage` waits for beyond its own
    stage's order: F its F upstream, B its B downstream (the last stage's its own F); None for the
    first stage's F."""
    if kind == FORWARD:
        return (FORWARD, stage - 1, m) if stage > 0 else None
    return (BACKWARD, stage + 1, m) if stage < stages - 1 else (FORWARD, stage, m)


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """(kind, micro-batch) of every operation of stage `stage` of `stages`, in order; kind is
    `FORWARD` or `BACKWARD`."""
    warm = warmup_forwards(stage, stages, micro_batches)
    ops = [(FORWARD, g) for g in range(warm)]
    for k in range(micro_batches - warm):
        ops += [(FORWARD, warm + k), (BACKWARD, k)]
    ops += [(BACKWARD, g) for g in range(micro_batches - warm, micro_batches)]
    return tuple(ops)
