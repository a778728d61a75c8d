"""1F1B pipeline iteration time from the stages' steady time T and one-off extra D.

Closed form (formulas.md §8):
    T_iter = (G − 1)·max_i T_i + Σ_i T_i + max(0, max_i (D_i − Σ_{j<i} T_j))
The slowest stage sets the steady state, one micro-batch fills and drains the pipeline, and a
stage's one-off work hides in the Σ_{j<i} T_j it waits before its first input arrives.

`event_schedule` plays the same stages through an explicit non-interleaved 1F1B schedule with
per-micro-batch durations; tests hold the closed form against it, and the timeline uses it.
"""

from __future__ import annotations

import numpy as np


def iteration_time(T, D, G: int):
    """Vectorized over a leading candidate axis: T, D of shape (..., S)."""
    T, D = np.asarray(T, dtype=np.float64), np.asarray(D, dtype=np.float64)
    before = np.cumsum(T, axis=-1) - T
    exposed = np.maximum(0.0, np.max(D - before, axis=-1))
    return (G - 1) * T.max(axis=-1) + T.sum(axis=-1) + exposed


def one_f_one_b_order(stage: int, num_stages: int, G: int) -> list[tuple[str, int]]:
    """Operation order of one stage: warm-up forwards, then one forward/one backward, cool-down."""
    warm = min(num_stages - 1 - stage, G)
    ops = [("F", m) for m in range(warm)]
    f, bk = warm, 0
    while f < G:
        ops.append(("F", f))
        f += 1
        ops.append(("B", bk))
        bk += 1
    while bk < G:
        ops.append(("B", bk))
        bk += 1
    return ops


def event_schedule(fwd, bwd, first_extra, last_extra, G: int):
    """Start/end of every forward and backward on every stage.

    fwd[i], bwd[i]: stable forward / backward time of stage i; the first micro-batch's forward
    takes first_extra[i] longer and the last micro-batch's backward last_extra[i] longer.
    Returns (iteration time, events: list of (stage, "F"/"B", micro-batch, start, end)).
    """
    S = len(fwd)
    done: dict = {}
    clock = [0.0] * S
    orders = [one_f_one_b_order(i, S, G) for i in range(S)]
    pos = [0] * S
    events = []
    progress = True
    while progress:
        progress = False
        for i in range(S):
            while pos[i] < len(orders[i]):
                kind, m = orders[i][pos[i]]
                if kind == "F":
                    dep = done.get(("F", i - 1, m)) if i > 0 else 0.0
                    dur = fwd[i] + (first_extra[i] if m == 0 else 0.0)
                else:
                    dep = done.get(("B", i + 1, m)) if i < S - 1 else done.get(("F", i, m))
                    dur = bwd[i] + (last_extra[i] if m == G - 1 else 0.0)
                if dep is None:
                    break
                start = max(clock[i], dep)
                end = start + dur
                done[(kind, i, m)] = end
                clock[i] = end
                events.append((i, kind, m, start, end))
                pos[i] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise RuntimeError("1F1B schedule deadlocked")
    return max(clock), events
