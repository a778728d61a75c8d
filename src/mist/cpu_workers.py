"""How a CPU worker process is set up. A CPU "cluster" of K worker processes on one machine is K
devices of ⌊cores / K⌋ intra-op threads each. `mist train` runs its CPU ranks so and
`mist profile --device cpu --processes K` measures one such device, so that the profile describes
the ranks that will run the plan.

Both also keep freed memory in the process heap (`keep_heap_pages`). By default glibc serves
allocations of 32 MiB and more (a moving threshold) with fresh mmap'ed pages and returns them on
free, so every large training temporary (logits, their gradient, a weight gradient of the head)
is page-faulted in again on each use: measured on this project's 2-core machine, 8–27 thousand
faults and 25–30 ms of a 1.4 s step. Micro-benchmarks that reuse their buffers never see that
cost, so the runtime and the profiler run with the same allocator settings. The price is resident
memory: the process keeps what it freed mapped (a repeated 64 + 32 MiB pattern settles at about
290 MiB more RSS after a few steps, tests/test_cpu_workers.py), as caching allocators do."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30   # return heap memory to the OS only past 1 GiB free at its top


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


def setup_cpu_worker(threads: int) -> None:
    """Make this process one CPU device: `threads` intra-op threads and the heap kept."""
    import torch

    torch.set_num_threads(int(threads))
    keep_heap_pages()


def keep_heap_pages() -> bool:
    """Serve large allocations from the heap and keep freed pages mapped (glibc `mallopt`);
    False, changing nothing, where the C library has no `mallopt` (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
