"""`time_op(cold=True)` on a CPU: the caches are emptied before every timed call, outside the time."""

import time

from mist.profiling.timing import FLUSH_MIN_BYTES, Device, cache_flush, last_level_cache_bytes, time_op


def test_the_last_level_cache_is_the_largest_size_the_os_lists(tmp_path):
    for index, size in (("index0", "48K"), ("index1", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert last_level_cache_bytes(tmp_path) == 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") is None


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
