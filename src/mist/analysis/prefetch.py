"""Trace the layer analyses a search is about to read in worker processes, ahead of it.

A first search of a model traces tens of layer variants (TP degrees, recomputation, sequence and
context parallelism), each taking a fraction of a second of one core (a compiled block, seconds);
the search itself then reads them from the disk cache. `TracePool.prefetch` traces the missing
ones in parallel, one variant per task (the variants of a compiled block that share a capture, one
task), into that cache, so a first run takes about the trace time over the number of
cores. The workers are forked (Linux), so they start in milliseconds with the parent's imports
and need no `if __name__ == "__main__"` guard in a user's script, which spawned workers would
(each re-imports the main module); each runs torch on one thread, the way forked workers must
when the parent may have started torch's thread pool. They live as long as the pool.

Nothing is prefetched without a disk cache (the workers hand their traces back through it), with
one core or off Linux. Fewer than `MIN_PARALLEL` missing traces are traced in this process, ahead
of the search all the same (told and timed as the workers' are). MIST_TRACE_WORKERS sets the
number of workers (0 or 1: trace in the process when the search reads a layer, as without this
module). A trace that fails (in a worker or ahead in this process) is left to the search, which
traces it again and reports the error there; a worker that dies (killed, out of memory) ends the
prefetching, and the search traces in-process.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

import torch

from mist.analysis import disk_cache, layer
from mist.analysis.layer import AnalysisRequest
from mist.torch_compat import symbolic_fake_mode

# below this many missing traces, starting the workers does not pay: their first traces (about
# a second each to warm up the fake-tensor machinery, against a few tenths of a second a trace
# after it) cost more than the parallelism saves
MIN_PARALLEL = 6


def default_workers() -> int:
    """MIST_TRACE_WORKERS, else the CPUs this process may run on (at most 8)."""
    env = os.environ.get("MIST_TRACE_WORKERS", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        cpus = os.cpu_count() or 1
    return min(cpus, 8)


def _start_worker() -> None:
    """A forked worker runs torch on one thread, and forgets the analyses its parent holds in
    memory: a task then reads its analysis from the disk cache or traces it and writes it there.
    (A parent's analysis that is not on disk, read while another cache folder was set, would
    otherwise come back from memory and never be written: the next search would trace it again.)"""
    torch.set_num_threads(1)
    layer._analyze.cache_clear()
    layer._training_graphs.cache_clear()


def _trace(family: tuple[AnalysisRequest, ...]) -> int:
    """Trace a family of analyses in this worker; the number traced."""
    done = 0
    for req in family:
        try:
            req.run()
        except Exception:  # noqa: BLE001 - the search traces it again and reports it
            continue
        done += 1
    return done


def _family(req: AnalysisRequest) -> AnalysisRequest:
    """What `req` shares a capture with: a compiled block's plain, fully recomputed and
    split-backward analyses are traced from one capture of its training graphs
    (`mist.analysis.layer._training_graphs`), so one worker traces them all."""
    if not req.compiled:
        return req
    return replace(req, recompute=req.recompute if isinstance(req.recompute, str) else False, compiled=True)


def _cost(family: tuple[AnalysisRequest, ...]) -> tuple:
    # the longest traces first (context parallelism, large TP groups, compiled families,
    # recomputation), so that the workers finish together
    req = family[0]
    return (-req.cp, -req.tp, -len(family), req.recompute is not True, req.part != "block")


class TracePool:
    """Worker processes that trace `AnalysisRequest`s into the disk cache (a context manager)."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else workers
        self.traced = 0  # analyses traced by the workers so far
        self.seconds = 0.0  # wall time spent waiting for them (what a warm disk cache saves)
        self._executor: ProcessPoolExecutor | None = None

    def prefetch(self, requests: Iterable[AnalysisRequest], progress=None) -> int:
        """Trace the requests the disk cache lacks, in parallel; the number traced.
        `progress(done, total)`, when given, is called as each task ends (in analyses: `total` is
        the number missing from the cache)."""
        if self.workers < 2 or not disk_cache.enabled() or not sys.platform.startswith("linux"):
            return 0
        families: dict[AnalysisRequest, list[AnalysisRequest]] = {}
        for r in dict.fromkeys(requests):
            if not r.on_disk():
                families.setdefault(_family(r), []).append(r)
        todo = sorted((tuple(f) for f in families.values()), key=_cost)
        if not todo:
            return 0
        if sum(map(len, todo)) < (2 if self._executor is not None else MIN_PARALLEL) or len(todo) < 2:
            return self._trace_here(todo, progress)
        t0 = time.perf_counter()
        if self._executor is None:
            # the tracing machinery's imports (a ShapeEnv pulls in sympy and torch._dynamo: about
            # 1.4 s of one core) happen here once, and every forked worker inherits them, rather
            # than each worker importing them for its first trace
            symbolic_fake_mode()
            self._executor = ProcessPoolExecutor(
                max_workers=min(self.workers, len(todo)),
                mp_context=multiprocessing.get_context("fork"),
                initializer=_start_worker,
            )
        total, ended, done = sum(map(len, todo)), 0, 0
        try:
            tasks = {self._executor.submit(_trace, family): len(family) for family in todo}
            for task in as_completed(tasks):
                done += task.result()
                ended += tasks[task]
                if progress is not None:
                    progress(ended, total)
        except BrokenProcessPool:  # a worker died (killed, out of memory): trace in the process
            self.close()
            self.workers = 0
            return 0
        self.traced += done
        self.seconds += time.perf_counter() - t0
        return done

    def _trace_here(self, todo: list[tuple[AnalysisRequest, ...]], progress) -> int:
        """Too few traces to start workers for: trace them in this process, now rather than when
        the search reads them, so that their time is told (`progress`) and counted (`seconds`)
        as the workers' is."""
        t0, total, ended, done = time.perf_counter(), sum(map(len, todo)), 0, 0
        for family in todo:
            done += _trace(family)
            ended += len(family)
            if progress is not None:
                progress(ended, total)
        self.traced += done
        self.seconds += time.perf_counter() - t0
        return done

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> TracePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
