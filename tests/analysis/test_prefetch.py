"""Tracing ahead of a search in worker processes (`mist.analysis.prefetch`): what the stage
tables ask for is everything their terms read, the workers' traces land in the disk cache and
are the ones the process would have made, and nothing runs without a cache or with one worker."""

import sympy

from mist.analysis import layer
from mist.analysis.prefetch import TracePool
from mist.hardware import load_profile
from mist.simulate import layer_terms as lt
from mist.specs.presets import get_preset
from mist.tune.intra import StageTables
from mist.tune.space import get_space


def _tables(cp=1):
    spec, prof = get_preset("llama-1.3b"), load_profile("h200")
    return StageTables(spec, prof, 4096, True, get_space("full"), 1, 4, 1, 4, 4, 16, False, cp=cp)


def _count_traces(monkeypatch) -> list:
    """The traces this process makes from now on (its in-memory caches emptied)."""
    made = []
    real = layer._trace_and_analyze

    def counted(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(layer, "_trace_and_analyze", counted)
    layer._analyze.cache_clear()
    lt._layer_terms.cache_clear()
    return made


def test_prefetched_analyses_leave_the_search_nothing_to_trace(monkeypatch, tmp_path):
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    tables = _tables(cp=2)
    requests = tables.analyses()
    # every stage choice (tp 1 and 2 beside cp 2 in 4 GPUs, SP, activation recompute) × layers
    assert {r.tp for r in requests} == {1, 2} and {r.part for r in requests} == {"pre", "block", "post"}
    assert {(r.tp, r.sequence_parallel, r.recompute) for r in requests if r.part == "block"} >= {
        (1, False, False),
        (1, False, True),
        (2, True, "activation"),
        (2, False, True),
    }
    made = _count_traces(monkeypatch)
    told: list[tuple[int, int]] = []
    with TracePool(workers=2) as pool:
        traced = pool.prefetch(requests, lambda done, total: told.append((done, total)))
    assert traced == len(set(requests)) and all(r.on_disk() for r in requests)
    # progress as each task ends, in analyses, up to all of them
    assert len(told) > 1 and {t for _, t in told} == {traced} and told[-1][0] == traced
    assert [d for d, _ in told] == sorted({d for d, _ in told})
    assert made == []  # the workers traced, not this process
    b = [1, 2]
    for tdb, sel in tables.stage_choices():
        m = tables.model(tdb[0], sel)
        for part in ("pre", "block", "post"):
            m._terms(part, b)
    assert made == []  # ... and the terms read only what was prefetched
    # a worker's trace is the one this process makes
    block = next(r for r in requests if r.part == "block" and r.tp == 2 and r.recompute is True)
    loaded = block.run()
    monkeypatch.setenv("MIST_CACHE_DIR", "off")
    layer._analyze.cache_clear()
    fresh = block.run()
    assert len(made) == 2  # (b symbolic and b = 1)
    assert sympy.expand(loaded.saved_bytes - fresh.saved_bytes) == 0 and loaded.records == fresh.records
    assert sympy.expand(loaded.unit_batch.saved_bytes - fresh.unit_batch.saved_bytes) == 0


def test_nothing_is_prefetched_without_a_cache_or_a_second_worker(monkeypatch, tmp_path):
    requests = _tables().analyses()
    monkeypatch.setenv("MIST_CACHE_DIR", "off")
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests) == 0
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    with TracePool(workers=1) as pool:
        assert pool.prefetch(requests) == 0
    monkeypatch.setenv("MIST_TRACE_WORKERS", "0")
    assert TracePool().workers == 0
    assert not any(r.on_disk() for r in requests)


def test_a_worker_that_dies_leaves_the_tracing_to_the_process(monkeypatch, tmp_path):
    """A worker killed mid-trace (here it exits at once) ends the prefetching without an error;
    the pool then traces nothing more, and the analyses stay for the search to trace."""
    import os

    from mist.analysis.layer import AnalysisRequest

    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(AnalysisRequest, "run", lambda self: os._exit(3))
    requests = _tables().analyses()
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests) == 0 and pool.workers == 0
        assert pool.prefetch(requests) == 0
    assert not any(r.on_disk() for r in requests)


def test_what_this_process_holds_in_memory_is_still_written_to_the_cache_folder(monkeypatch, tmp_path):
    """Analyses this process read under one cache folder, prefetched under another (empty): the
    forked workers do not take them from the memory they inherit, they trace them into the new
    folder, so a next search there finds them on disk and traces nothing."""
    spec = get_preset("gpt3-1.3b")
    requests = [layer.AnalysisRequest(spec, part, 1, True, "bf16", "cuda") for part in ("pre", "block", "post")]
    requests += [
        layer.AnalysisRequest(spec, "block", tp, True, "bf16", "cuda", rc) for tp in (2, 4) for rc in (False, True)
    ]
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path / "first"))
    for r in requests:
        r.run()  # in this process's memory now
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path / "second"))
    assert not any(r.on_disk() for r in requests)
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests) == len(requests)
    assert all(r.on_disk() for r in requests)
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests) == 0 and pool.seconds == 0.0


def test_too_few_traces_for_workers_are_traced_here_told_and_timed(monkeypatch, tmp_path):
    """Fewer missing traces than `MIN_PARALLEL` start no workers: this process traces them at
    once, tells each as it ends and counts their time, as it does the workers' (what `mist tune`
    shows as tracing); a second call finds them all on disk."""
    from mist.analysis import prefetch

    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    spec = get_preset("gpt3-1.3b")
    requests = [layer.AnalysisRequest(spec, part, 1, True, "bf16", "cuda") for part in ("pre", "block", "post")]
    assert len(requests) < prefetch.MIN_PARALLEL
    made = _count_traces(monkeypatch)
    told: list[tuple[int, int]] = []
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests, lambda done, total: told.append((done, total))) == 3
        assert pool._executor is None and pool.traced == 3 and pool.seconds > 0
    assert told == [(1, 3), (2, 3), (3, 3)]
    assert len(made) == 6 and all(r.on_disk() for r in requests)  # (b symbolic and b = 1, each)
    with TracePool(workers=2) as pool:
        assert pool.prefetch(requests) == 0 and pool.seconds == 0.0
    assert len(made) == 6
