"""Timers and the time budget shared by the profiling measurements.

`time_op(fn, dev)` returns the median seconds of one call of `fn`:

* CPU: every call timed on its own with `perf_counter` (the median shrugs off the noise of a
  busy machine); the op's dispatch cost is part of its time, as it is when a model runs.
* CUDA: back-to-back calls between two CUDA events, in three batches, median of the batch means;
  tiny kernels therefore measure max(kernel, host issue), big ones the kernel alone.

The repetition count adapts to the call's duration (`target_s` of timing per measurement).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mist.dtypes import DTYPE_BYTES


@dataclass
class Device:
    """Where measurements run: kind "cpu" or "cuda", plus the torch device and dtype."""

    kind: str
    dtype_name: str = "fp32"
    index: int = 0

    @property
    def torch_device(self):
        import torch  # lazy: keeps torch out of `import mist.profiling`

        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    @property
    def dtype(self):
        from mist.models.dtypes import torch_dtype  # lazy: torch only when measuring

        return torch_dtype(self.dtype_name)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype_name]

    def sync(self) -> None:
        if self.kind == "cuda":
            import torch  # lazy: keeps torch out of `import mist.profiling`

            torch.cuda.synchronize(self.index)


def one_call_s(fn, dev: Device, warmup: int = 1) -> float:
    """Seconds of one call of `fn` after `warmup` calls (a rough size for repetition counts)."""
    for _ in range(warmup):
        fn()
    dev.sync()
    t0 = time.perf_counter()
    fn()
    dev.sync()
    return max(time.perf_counter() - t0, 1e-7)


def time_op(
    fn,
    dev: Device,
    target_s: float = 0.02,
    min_reps: int = 3,
    max_reps: int = 200,
    warmup: int = 1,
    stat: str = "median",
) -> float:
    """Median (or with stat="min" the best, STREAM-style for bandwidths) seconds of one call of
    `fn` on `dev` (see module docstring)."""
    pick = np.min if stat == "min" else np.median
    one = one_call_s(fn, dev, warmup)
    reps = int(np.clip(target_s / one, min_reps, max_reps))
    if dev.kind == "cuda":
        import torch  # lazy: keeps torch out of `import mist.profiling`

        per = max(1, reps // 3)
        means = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per):
                fn()
            end.record()
            end.synchronize()
            means.append(start.elapsed_time(end) * 1e-3 / per)
        return float(pick(means))
    times = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(pick(times))


def warm_up(dev: Device, seconds: float = 0.3) -> None:
    """Run GEMMs for `seconds` before timing: wakes the thread pools (and, on a CPU, outlasts other
    libraries' spinning worker threads, e.g. a BLAS used by numpy just before) and the clocks."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    x = torch.randn(256, 256, device=dev.torch_device).to(dev.dtype)
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            for _ in range(4):
                x @ x
            dev.sync()


def wall_of(fn, dev: Device) -> float:
    """Wall seconds of one call of `fn`, synchronized (for loops that time themselves)."""
    dev.sync()
    t0 = time.perf_counter()
    fn()
    dev.sync()
    return time.perf_counter() - t0


@dataclass
class Budget:
    """A wall-clock budget split into phases by share; time a phase leaves unused goes to the rest."""

    total_s: float
    shares: dict  # phase -> weight
    start: float = field(default_factory=time.perf_counter)
    excluded_s: float = 0.0  # time left out of the budget (`exclude`)
    _done: set = field(default_factory=set)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return max(0.0, self.total_s - self.elapsed())

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` just spent out of the budget (a fixed cost no budget could shorten)."""
        self.start += seconds
        self.excluded_s += seconds

    def phase_deadline(self, phase: str) -> float:
        """perf_counter time by which `phase` should end: its share of what is left."""
        left = [p for p in self.shares if p not in self._done]
        weight = sum(self.shares[p] for p in left) or 1.0
        self._done.add(phase)
        return time.perf_counter() + self.remaining() * self.shares.get(phase, 0.0) / weight
