"""Timers and the time budget shared by the profiling measurements.

`time_op(fn, dev)` returns the median seconds of one call of `fn`:

* CPU: every call timed on its own with `perf_counter` (the median shrugs off the noise of a
  busy machine); the op's dispatch cost is part of its time, as it is when a model runs. With
  `cold=True` (the operators of a layer: GEMMs, attention, memory-bound ops) the caches are
  emptied before each timed call (`CacheFlush`, untimed): in a training step an operator's
  operands and output come from memory, not from a cache that a loop over the same tensors keeps
  warm (see `CacheFlush`).
* CUDA: back-to-back calls between two CUDA events, in three batches, median of the batch means;
  tiny kernels therefore measure max(kernel, host issue), big ones the kernel alone.

The repetition count adapts to the call's duration (`target_s` of timing per measurement).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

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


FLUSH_MIN_BYTES = 64 * 2**20
COLD_MAX_REPS = 25  # each cold call also pays a flush (a few ms): fewer repetitions of tiny ops
CPU_ROOT = Path("/sys/devices/system/cpu")


def _size_bytes(text: str) -> int | None:
    """A sysfs cache size ("32768K") in bytes; None where it is not one."""
    unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    digits = text.rstrip("KMGkmg")
    return int(digits) * unit if digits.isdigit() else None


def last_level_cache_bytes(root: Path = CPU_ROOT, cpus: Iterable[int] | None = None) -> int | None:
    """Bytes of the last-level caches the CPUs this process may run on (`cpus`, default its
    affinity) reach, as Linux lists them (`root`/cpuN/cache/index*/{level,size,shared_cpu_list}):
    the size of each distinct cache of the highest level, summed. A CPU whose cores share one
    last-level cache counts it once; one split into core complexes (AMD's CCDs, each with its own
    L3) counts every complex its threads run on, since a timed call's threads fill each of them.
    None where the OS lists no cache."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    caches: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it): bytes
    for cpu in cpus:
        for entry in (root / f"cpu{cpu}" / "cache").glob("index*"):
            try:
                level = int((entry / "level").read_text())
                size = _size_bytes((entry / "size").read_text().strip())
                shared = (entry / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if size is not None:
                caches[(level, shared)] = size
    if not caches:
        return None
    top = max(level for level, _ in caches)
    return sum(size for (level, _), size in caches.items() if level == top)


class CacheFlush:
    """Empties the CPU caches of the data a timed call would otherwise find there: writes a buffer
    of twice the last-level caches (`last_level_cache_bytes`, at least FLUSH_MIN_BYTES); torch's
    `fill_` splits it over the intra-op threads, so threads spread over core complexes write about
    twice each complex's own cache. Why the profile times a layer's
    operators cold: a training step's working set (weights, saved activations, gradients) is many
    times the last-level cache and each tensor is touched by a few operators, so a GEMM reads its
    operands from memory and writes a freshly allocated output (whose lines are read before they
    are written), while a loop over the same tensors finds them in the cache. Measured on the CPU
    loop's GEMM shapes on a 2-core AMD EPYC (32 MiB L3), alone, flush vs none: +1.3 to +3.2 % in
    sum, +3 to +8 % for the smallest ([1024, 512] x [512, 512]); `benchmarks/results/cpu_block_ops.md`."""

    def __init__(self):
        import torch  # lazy: keeps torch out of `import mist.profiling`

        self.nbytes = max(2 * (last_level_cache_bytes() or 0), FLUSH_MIN_BYTES)
        self._buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self._round = 0

    def __call__(self) -> None:
        self._round ^= 1
        self._buf.fill_(self._round)


_flush: CacheFlush | None = None


def cache_flush() -> CacheFlush:
    """The process's one `CacheFlush` (its buffer allocated once)."""
    global _flush
    if _flush is None:
        _flush = CacheFlush()
    return _flush


def time_op(
    fn,
    dev: Device,
    target_s: float = 0.02,
    min_reps: int = 3,
    max_reps: int = 200,
    warmup: int = 1,
    stat: str = "median",
    cold: bool = False,
) -> float:
    """Median (or with stat="min" the best, STREAM-style for bandwidths) seconds of one call of
    `fn` on `dev` (see module docstring); `cold`: on a CPU, each call with emptied caches."""
    pick = np.min if stat == "min" else np.median
    one = one_call_s(fn, dev, warmup)
    flush = cache_flush() if cold and dev.kind == "cpu" else None
    if flush is not None:
        max_reps = max(min_reps, min(max_reps, COLD_MAX_REPS))
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
        if flush is not None:
            flush()
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
