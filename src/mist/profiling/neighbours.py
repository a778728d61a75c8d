"""Busy neighbours for CPU profiles.

A CPU "cluster" of K worker processes is K devices on one machine that share its caches and
memory bandwidth: while one rank computes, the other K − 1 do too, and each kernel runs slower
than it does alone (small GEMMs and streaming element-wise work alike). So
`mist profile --device cpu --processes K` measures its compute tables while K − 1 neighbour
processes (each with the same thread count) run a training-like mix — mostly GEMMs, some
streaming element-wise work — and `mist validate`'s drift
check re-measures under the same load. The neighbours are spawned (not forked: a forked child must
not start OpenMP threads after its parent ran parallel torch code).

The host AdamW of a GPU node is shared the same way: the K ranks of a node step their offloaded
optimizer fractions on the same cores and memory channels at the same time (every stage steps
lazily during its first micro-batch). `mist profile --device cuda` measures it with K − 1
neighbours that run the same host AdamW (`work="adam"`).
"""

from __future__ import annotations

import multiprocessing as mp


def _busy(ready, stop, threads: int, work: str, size: int) -> None:  # pragma: no cover - neighbour process
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    if work == "adam":
        from mist.runtime.optimizer import adamw_  # lazy: keeps torch out of `import mist.profiling`

        p, m, v = (torch.zeros(size) for _ in range(3))
        g = torch.full_like(p, 1e-3)
        step = 0
        while True:
            step += 1
            adamw_(
                p,
                m,
                v,
                g,
                step=step,
                lr=1e-4,
                beta1=0.9,
                beta2=0.95,
                eps=1e-8,
                weight_decay=0.1,
                decay_ranges=[(0, size)],
            )
            ready.set()
            if stop.is_set():
                return
    x, w = torch.randn(256, 512), torch.randn(2048, 512)
    a, b = torch.randn(4_000_000), torch.randn(4_000_000)
    with torch.no_grad():
        F.linear(x, w)
        ready.set()
        while not stop.is_set():
            for _ in range(4):
                F.linear(x, w)
            a.add_(b)


WORKS = ("train", "adam")


class Neighbours:
    """`count` busy processes of `threads` threads, from `start()` until `stop()` (a context
    manager), running `work`: "train" (GEMMs and streaming element-wise ops) or "adam" (host
    AdamW steps over `size` fp32 parameters)."""

    def __init__(self, count: int, threads: int, work: str = "train", size: int = 4 * 2**20):
        if work not in WORKS:
            raise ValueError(f"unknown neighbour work {work!r}")
        self.count, self.threads = max(0, int(count)), int(threads)
        self.work, self.size = work, int(size)
        self._procs, self._stop = [], None

    def start(self, timeout_s: float = 120.0) -> Neighbours:
        if self.count == 0:
            return self
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        readies = [ctx.Event() for _ in range(self.count)]
        self._procs = [
            ctx.Process(target=_busy, args=(r, self._stop, self.threads, self.work, self.size), daemon=True)
            for r in readies
        ]
        for p in self._procs:
            p.start()
        for r in readies:
            if not r.wait(timeout_s):
                self.stop()
                raise RuntimeError("a busy neighbour process did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._procs, self._stop = [], None

    def __enter__(self) -> Neighbours:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
