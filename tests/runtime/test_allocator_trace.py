"""The CPU allocator trace (`runtime.allocator_trace`): its peak is the most bytes live at once,
releases seen on another thread's behalf are found by address, and a traced CPU run reports the
peak that `mist validate` compares with the simulator's."""

import torch

from mist.runtime.allocator_trace import AllocatorPeak, AllocatorTrace, peak_of


def test_peak_of_pairs_each_release_with_its_allocation():
    events = [(0, 100, 40), (1, 200, 25), (2, 100, -40), (3, 300, 10), (4, 300, -10), (5, 200, -25)]
    assert peak_of(events) == AllocatorPeak(peak_bytes=65, unseen_releases=0)


def test_a_release_seen_only_by_its_addresss_reuse_is_counted_once():
    # block 100 (40 B) released on another thread, unseen; its address comes back for 30 B
    events = [(0, 100, 40), (1, 200, 25), (2, 100, 30), (3, 400, 20)]
    assert peak_of(events) == AllocatorPeak(peak_bytes=75, unseen_releases=1)


def test_a_release_of_a_block_from_before_the_trace_is_ignored():
    assert peak_of([(0, 100, -64), (1, 200, 8)]) == AllocatorPeak(peak_bytes=8, unseen_releases=0)


def test_the_peak_since_a_time_counts_what_was_live_before_it():
    events = [(0, 100, 50), (1, 100, -50), (2, 200, 30), (3, 300, 5), (4, 300, -5), (5, 400, 1)]
    assert peak_of(events, since=2) == AllocatorPeak(peak_bytes=35, unseen_releases=0)
    assert peak_of(events, since=4) == AllocatorPeak(peak_bytes=35, unseen_releases=0)  # (live at 4: 35)
    assert peak_of(events, since=9) == AllocatorPeak(peak_bytes=31, unseen_releases=0)  # what is left


def test_the_trace_sees_the_tensors_made_while_it_runs():
    before = torch.empty(1 << 20, dtype=torch.uint8)  # not counted: made before the trace
    trace = AllocatorTrace()
    a = torch.empty(4 << 20, dtype=torch.uint8)
    b = torch.empty(8 << 20, dtype=torch.uint8)
    del a, before
    c = torch.empty(2 << 20, dtype=torch.uint8)
    peak = trace.stop()
    del b, c
    assert peak == AllocatorPeak(peak_bytes=12 << 20, unseen_releases=0)
    assert trace.stop() is peak  # stopped once


def test_the_peak_is_taken_from_the_mark_on():
    trace = AllocatorTrace()
    a = torch.empty(16 << 20, dtype=torch.uint8)  # building: the initial copies
    kept = torch.empty(4 << 20, dtype=torch.uint8)
    del a
    trace.mark()
    b = torch.empty(8 << 20, dtype=torch.uint8)
    del b
    peak = trace.stop()
    del kept
    assert peak == AllocatorPeak(peak_bytes=12 << 20, unseen_releases=0)
