"""1F1B pipeline iteration time from each stage's steady time and one-off extras.

The Mist paper's closed form (docs/references.md) charges one extra D_i per stage and lets it hide behind
Σ_{j<i} T_j. The two one-offs happen at opposite ends of the iteration, on side streams:
the first micro-batch's extra (the deferred optimizer step, re-gather, swaps) can run while a
stage waits for its first input, i.e. behind the upstream forwards Σ_{j<i} F_j; the last
micro-batch's extra (final gradient reduction, grad swap-out) runs after the stage's last
backward while the upstream stages drain, i.e. behind Σ_{j<i} B_j. So, with T_i = F_i + B_i:

    T_iter = (G − 1)·max_i T_i + Σ_i T_i
             + max(0, max_i (X_i − Σ_{j<i} F_j)) + max(0, max_i (Y_i − Σ_{j<i} B_j))

(X: first-micro-batch extra, Y: last-micro-batch extra; with X = D, Y = 0 and F = T it is
Mist's form.) `event_schedule` plays the same stages through an explicit 1F1B schedule with the
same side-stream semantics; tests hold the closed form against it, and the timeline uses it.
"""

from __future__ import annotations

import numpy as np

from mist.rules.pipeline_order import FORWARD, depends_on, one_f_one_b
from mist.simulate.op_program import play_stages, stage_waits


def iteration_time(T, G: int, first=None, last=None, fwd=None):
    """Vectorized over leading candidate axes: every argument has shape (..., S)."""
    T = np.asarray(T, dtype=np.float64)
    F = T if fwd is None else np.asarray(fwd, dtype=np.float64)
    Bk = T - F if fwd is not None else T
    out = (G - 1) * T.max(axis=-1) + T.sum(axis=-1)
    if first is not None:
        X = np.asarray(first, dtype=np.float64)
        out = out + np.maximum(0.0, np.max(X - (np.cumsum(F, axis=-1) - F), axis=-1))
    if last is not None:
        Y = np.asarray(last, dtype=np.float64)
        out = out + np.maximum(0.0, np.max(Y - (np.cumsum(Bk, axis=-1) - Bk), axis=-1))
    return out


def one_f_one_b_order(stage: int, num_stages: int, G: int) -> list[tuple[str, int]]:
    """Operation order of one stage: warm-up forwards, then one forward/one backward, cool-down
    (`mist.rules.pipeline_order`, the order the runtime's `PipelineSchedule` runs)."""
    return list(one_f_one_b(stage, num_stages, G))


def event_schedule(fwd, bwd, first_extra, last_extra, G: int):
    """Start/end of every forward and backward on every stage, and the one-offs.

    fwd[i], bwd[i]: stable forward / backward time of stage i. first_extra[i] runs from the
    start of the iteration and must finish before stage i's first forward; last_extra[i] runs
    after stage i's last backward and does not block other stages.
    Returns (iteration time, events: list of (stage, kind, micro-batch, start, end)) with kind
    "F", "B", "X" (first extra) or "Y" (last extra).
    """
    S = len(fwd)
    orders = [one_f_one_b(i, S, G) for i in range(S)]
    return play_stages(
        orders,
        stage_waits(depends_on, S),
        lambda kind, i: fwd[i] if kind == FORWARD else bwd[i],
        first_extra,
        last_extra,
        G,
        "1F1B",
    )
