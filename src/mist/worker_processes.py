"""Start worker processes and follow them through the one queue they report on.

`mist train --local` (`runtime.launch.spawn_local`) and `mist profile --processes K`
(`profiling.comm.run_workers`) both start K processes that put their results, errors and progress
on a shared queue, and wait for those messages. A worker that dies without a word (a crash in C,
the kernel's out-of-memory killer) puts nothing on the queue, so waiting on the queue alone could
hang for ever: `poll_messages` wakes every `interval_s` and ends with `WorkerDied` once a worker
has exited with a non-zero code, or with `WorkerTimeout` once the deadline has passed. What the
messages mean, when the wait is over and how the processes are ended stay with the callers.
"""

from __future__ import annotations

import math
import queue as queue_mod
import time
from collections.abc import Container, Iterator, Sequence

POLL_S = 0.5  # how often an empty queue is checked for dead workers and the deadline


class WorkerDied(Exception):
    """Worker `index` exited with the non-zero `exitcode` (negative: killed by that signal)."""

    def __init__(self, index: int, exitcode: int):
        super().__init__(f"worker {index} exited with code {exitcode}")
        self.index, self.exitcode = index, exitcode


class WorkerTimeout(Exception):
    """The workers did not finish within `timeout_s` seconds."""

    def __init__(self, timeout_s: float):
        super().__init__(f"the workers did not finish within {timeout_s:.0f} s")
        self.timeout_s = timeout_s


def start_workers(ctx, target, args: Sequence[tuple], daemon: bool | None = None) -> list:
    """One started process of multiprocessing context `ctx` per tuple of `args`, each running
    `target(*that tuple)`."""
    procs = [ctx.Process(target=target, args=a, daemon=daemon) for a in args]
    for p in procs:
        p.start()
    return procs


def poll_messages(
    q, procs: Sequence, *, finished: Container[int] = (), timeout_s: float | None = None, interval_s: float = POLL_S
) -> Iterator:
    """The messages the workers put on `q`, as they come, until the caller stops iterating.

    Raises WorkerDied when the queue stays empty for `interval_s` and a worker whose index is not
    in `finished` (the caller may keep adding to it) has exited with a non-zero code, and
    WorkerTimeout once `timeout_s` seconds (None: no limit) have passed since the first message
    was asked for."""
    limit = math.inf if timeout_s is None else float(timeout_s)
    end = time.perf_counter() + limit
    while True:
        if time.perf_counter() > end:
            raise WorkerTimeout(limit)
        try:
            msg = q.get(timeout=interval_s)
        except queue_mod.Empty:
            for i, p in enumerate(procs):
                if i not in finished and p.exitcode not in (None, 0):
                    raise WorkerDied(i, p.exitcode) from None
            continue
        yield msg
