"""How a worker process uses the host CPU. A CPU "cluster" of K worker processes on one machine is
K devices of ⌊cores / K⌋ intra-op threads each. `mist train` runs its CPU ranks so and
`mist profile --device cpu --processes K` measures one such device, so that the profile describes
the ranks that will run the plan.

GPU ranks use the host CPU too: the offloaded fraction of the optimizer steps there (CPU AdamW).
The K ranks of a node share its cores, so each GPU rank also gets ⌊cores / K⌋ threads
(`setup_gpu_rank`), and `mist profile --device cuda` measures the host AdamW with that many
threads while the node's other K − 1 ranks step at the same time. Left alone, a GPU rank would run
with whatever the launcher chose: torchrun sets OMP_NUM_THREADS=1 when it starts several processes
per node (one thread: a host step several times slower than profiled), and processes started
without it each take every core (K-fold oversubscription). `MIST_HOST_THREADS` overrides the share.

Both also keep freed memory in the process heap (`keep_heap_pages`). By default glibc serves
allocations of 32 MiB and more (a moving threshold) with fresh mmap'ed pages and returns them on
free, so every large training temporary (logits, their gradient, a weight gradient of the head)
is page-faulted in again on each use: thousands of page faults per step, a few percent of a CPU
step. Micro-benchmarks that reuse their buffers never see that
cost, so the runtime and the profiler run with the same allocator settings. The price is resident
memory: the process keeps what it freed mapped (a repeated allocation pattern settles after a few
steps, tests/test_cpu_workers.py), as caching allocators do."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from mist.errors import MistInputError

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30  # return heap memory to the OS only past 1 GiB free at its top


HOST_THREADS_ENV = "MIST_HOST_THREADS"


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset or a cgroup cpuset leave it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """A worker's share of the cores when `workers` processes run on this machine at once; or
    MIST_HOST_THREADS when set (an integer in [1, host_cores()], else MistInputError: more threads
    than cores only oversubscribes them, and absurd counts fail to start threads at all)."""
    fixed = os.environ.get(HOST_THREADS_ENV)
    if fixed is not None:
        text = fixed.strip()
        n = int(text) if text.isascii() and text.isdigit() else 0
        if n < 1:
            raise MistInputError(f"{HOST_THREADS_ENV} must be a positive integer, got {fixed!r}.")
        cores = host_cores()
        if n > cores:
            raise MistInputError(
                f"{HOST_THREADS_ENV} must be between 1 and {cores}, the cores this process may use, got {n}."
            )
        return n
    return max(1, host_cores() // max(1, int(workers)))


def setup_gpu_rank(threads: int) -> None:
    """A GPU rank's intra-op threads for its host work (the CPU part of the optimizer step)."""
    import torch  # lazy: keeps torch out of the CLI start-up

    torch.set_num_threads(int(threads))


def setup_cpu_worker(threads: int) -> None:
    """Make this process one CPU device: `threads` intra-op threads and the heap kept."""
    import torch  # lazy: keeps torch out of the CLI start-up

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
