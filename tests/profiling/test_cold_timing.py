"""`time_op(cold=True)` on a CPU: the caches are emptied before every timed call, outside the time."""

import time

from mist.profiling.timing import FLUSH_MIN_BYTES, Device, cache_flush, last_level_cache_bytes, time_op


def _cpu(root, n, caches):
    for index, (level, size, shared) in enumerate(caches):
        d = root / f"cpu{n}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, text in (("level", level), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{text}\n")
    (root / f"cpu{n}" / "cache" / "uevent").write_text("")


def test_the_last_level_caches_are_the_distinct_caches_of_the_highest_level(tmp_path):
    # two core complexes of two CPUs, each with its own 32 MiB L3; private L1/L2
    for n in range(4):
        ccd = "0-1" if n < 2 else "2-3"
        _cpu(tmp_path, n, ((1, "48K", n), (1, "32K", n), (2, "1024K", n), (3, "32768K", ccd)))
    assert last_level_cache_bytes(tmp_path, [0, 1]) == 32 * 2**20  # one complex: counted once
    assert last_level_cache_bytes(tmp_path, [1, 2]) == 64 * 2**20
    assert last_level_cache_bytes(tmp_path, range(4)) == 64 * 2**20
    assert last_level_cache_bytes(tmp_path, [7]) is None  # a CPU the OS lists no cache for
    # one cache shared by every core: its size
    _cpu(tmp_path / "one", 0, ((2, "2048K", "0"), (3, "16M", "0-1")))
    _cpu(tmp_path / "one", 1, ((2, "2048K", "1"), (3, "16M", "0-1")))
    assert last_level_cache_bytes(tmp_path / "one", [0, 1]) == 16 * 2**20


def test_the_flush_writes_twice_the_last_level_cache():
    llc = last_level_cache_bytes() or 0
    flush = cache_flush()
    assert flush.nbytes == max(2 * llc, FLUSH_MIN_BYTES)
    assert flush.nbytes >= 2 * llc


def test_every_cold_call_follows_a_flush_whose_time_is_not_counted():
    flush = cache_flush()
    seen = []

    def call():  # the flush buffer's value says which flush ran last
        seen.append(int(flush._buf[0]))

    t = time_op(call, Device("cpu"), target_s=0.001, min_reps=6, cold=True)
    timed = seen[2:]  # one_call_s's warm-up and sizing calls run without a flush
    assert len(timed) >= 6
    assert all(a != b for a, b in zip(timed, timed[1:]))

    t0 = time.perf_counter()
    flush()
    flush_s = time.perf_counter() - t0
    assert t < flush_s / 10, (t, flush_s)

    seen.clear()
    time_op(call, Device("cpu"), target_s=0.001, min_reps=6)
    assert len(set(seen)) == 1  # warm calls: no flush between them
