"""A CPU run's allocator peak: the most bytes PyTorch's CPU allocator held at once.

On a GPU the runtime reports `torch.cuda.max_memory_allocated`, which counts every tensor, operator
temporaries included. PyTorch keeps no such statistic for its CPU allocator, so a CPU run reports
only what it accounts tensor by tensor (`runtime.memory`), without the temporaries — and the
simulator's peak, whose largest term is a phase's transient, went unchecked there.

With `TrainConfig.trace_memory`, a CPU rank records its allocator's events with `torch.profiler`
(`profile_memory=True`) from before its model and states are built to the end of its first
`TRACED_STEPS` steps (the second one runs what the first set up: the deferred optimizer work, the
lazy weight updates), and takes the most bytes live at once from the first step on (`mark`):
building the stage holds the modules' initial fp32 parameters while it copies them into the flat
units, and on a GPU those live in host memory, not on the device. The profiler records every
operator as well, so the traced steps are not timed (`Trainer.metrics` leaves them out).

Releases on another thread: the profiler sees a gloo worker thread only while it runs a work (see
gloo's copies below), not when it drops the work after. A tensor whose last reference a gloo work
object drops is released there, unseen. Such a block is noticed when its address is handed out
again, and counted as live until then, so the peak is an upper bound by at most those blocks;
`AllocatorPeak.unseen_releases` counts them. A gloo thread drops a work just after marking it
done, so it drops it last when the caller drops the collective's tensors at once. While a trace
records, every collective Mist issues therefore settles once done (`models.collectives.settled`:
`GLOO_SETTLE_S`, a sleep while the caller still holds the tensors), and the caller's own release
is the last one, seen; so do the functional collectives of compiled blocks, whose graphs can drop
a reduced tensor right after its wait (`models.collectives.settling`). A block whose release is
unseen and whose address is never handed out again stays counted to the end, not in
`unseen_releases`: before compiled waits settled, one compiled GPT block's all-reduced output
(4 MiB) did so in each of two traced runs of the CPU loop's tensor-parallel plan.

Gloo's copies: gloo copies a collective's input or output into buffers of its own (a reduce-scatter
its whole input, an all-gather its output), which NCCL, working in place, does not make, and the
simulator does not price. A work object that a gloo thread drops last releases its copy unseen, so
such a copy stayed in the peak of a busy machine's run (a block's flat gradient, +3 % against the
prediction under the suite's load, −0.02 % otherwise). Mist issues its collectives inside
`models.collectives.issuing()`, and the blocks allocated there are left out of the peak: it is
what Mist itself holds. Some copies are made on gloo's thread instead (an all-gather's flat
output): gloo runs a work under its caller's thread-local state, so the profiler records that
thread's allocations while the work runs, which for a collective issued ahead can be after the
`issuing()` span has ended. Only the blocks allocated on the thread that steps the rank count
(`torch_compat.allocation_events`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mist.models.collectives import ISSUING, settling
from mist.torch_compat import allocation_events, marked_spans, marked_time

TRACED_STEPS = 2
GLOO_SETTLE_S = 0.002  # long against the few instructions a gloo thread runs to drop a done work
_MARK = "mist::allocator_trace::steps"


@dataclass(frozen=True)
class AllocatorPeak:
    peak_bytes: int  # the most bytes live at once
    unseen_releases: int  # blocks released on an unprofiled thread, found by their address's reuse


def _live_walk(events: list[tuple[int, int, int]], leave_out: list[tuple[int, int]] = ()):
    """At each of (time, address, ±bytes) events in time order: (time, bytes live just after it,
    the live blocks {address: (time allocated, bytes)}, whether it found a block released unseen).
    The one rule `live_curve` and `blocks_at_most` count by (their docstrings)."""
    live: dict[int, tuple[int, int]] = {}
    total = 0
    for t, addr, nbytes in events:
        unseen = nbytes > 0 and addr in live  # released unseen (module docstring) before reuse
        if addr in live:
            total -= live.pop(addr)[1]
        if nbytes > 0 and not any(a <= t <= b for a, b in leave_out):
            live[addr] = (t, nbytes)
            total += nbytes
        yield t, total, live, unseen


def live_curve(
    events: list[tuple[int, int, int]], leave_out: list[tuple[int, int]] = ()
) -> tuple[list[tuple[int, int]], int]:
    """(time, bytes live just after it) at each of (time, address, ±bytes) events in time order,
    and how many blocks were released unseen (module docstring). The profiler reports no release
    of a block allocated before it started, so a release counts only with its allocation. Blocks
    allocated within a `leave_out` (start, end) span are not counted, nor their releases."""
    out, unseen = [], 0
    for t, total, _, was_unseen in _live_walk(events, leave_out):
        out.append((t, total))
        unseen += was_unseen
    return out, unseen


def blocks_at_most(
    events: list[tuple[int, int, int]], leave_out: list[tuple[int, int]] = ()
) -> tuple[int, list[tuple[int, int, int]]]:
    """The most bytes live at once over `events`, counted as `live_curve` counts, and the blocks
    live where it was first reached: (time allocated, address, bytes) each."""
    best: tuple[int, list[tuple[int, int, int]]] = (0, [])
    for _, total, live, _ in _live_walk(events, leave_out):
        if total > best[0]:
            best = (total, [(t0, addr, n) for addr, (t0, n) in live.items()])
    return best


def peak_of(
    events: list[tuple[int, int, int]], since: int | None = None, leave_out: list[tuple[int, int]] = ()
) -> AllocatorPeak:
    """The peak of (time, address, ±bytes) events in time order, over those at or after time
    `since` (all by default; the bytes live before it count), without the blocks allocated within
    `leave_out` spans: `live_curve`'s."""
    curve, unseen = live_curve(events, leave_out)
    before = [v for t, v in curve if since is not None and t < since]
    return AllocatorPeak(max([before[-1] if before else 0, *(v for t, v in curve[len(before) :])]), unseen)


class AllocatorTrace:
    """Started on construction; `stop` ends the recording and keeps its `result`."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._prof.start()
        self._settling = settling(GLOO_SETTLE_S)
        self._settling.__enter__()
        self.result: AllocatorPeak | None = None

    def mark(self) -> None:
        """The first step starts: the peak is taken from here on."""
        with torch.profiler.record_function(_MARK):
            pass

    def stop(self) -> AllocatorPeak:
        if self._prof is not None:
            self._settling.__exit__(None, None, None)
            self._prof.stop()
            since = marked_time(self._prof, _MARK)
            copies = marked_spans(self._prof, ISSUING)
            self.result = peak_of(allocation_events(self._prof, thread_of=_MARK), since, copies)
            self._prof = None
        assert self.result is not None
        return self.result
