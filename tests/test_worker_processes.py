"""`mist.worker_processes`: messages pass through, a worker that dies without a word and a run
past its deadline both end the wait instead of hanging it."""

import multiprocessing as mp
import os

import pytest

from mist.worker_processes import WorkerDied, WorkerTimeout, poll_messages, start_workers

CTX = mp.get_context("fork")


def _report(rank, q):
    q.put(("ok", rank))


def _die(rank, q):
    if rank == 1:
        os._exit(3)
    q.put(("ok", rank))


def _silent(rank, q):
    pass


def _join(procs):
    for p in procs:
        p.join(timeout=10)


def test_messages_pass_through():
    q = CTX.Queue()
    procs = start_workers(CTX, _report, [(r, q) for r in range(3)])
    got = set()
    for kind, rank in poll_messages(q, procs, interval_s=0.05):
        got.add((kind, rank))
        if len(got) == 3:
            break
    _join(procs)
    assert got == {("ok", 0), ("ok", 1), ("ok", 2)}


def test_a_dead_worker_ends_the_wait():
    q = CTX.Queue()
    procs = start_workers(CTX, _die, [(r, q) for r in range(2)])
    with pytest.raises(WorkerDied) as exc:
        for _ in poll_messages(q, procs, interval_s=0.05):  # worker 0's message, if it comes first
            pass
    _join(procs)
    assert (exc.value.index, exc.value.exitcode) == (1, 3)


def test_a_finished_worker_is_not_reported_dead():
    q = CTX.Queue()
    procs = start_workers(CTX, _die, [(r, q) for r in range(2)])
    _join(procs)
    with pytest.raises(WorkerTimeout):
        for _ in poll_messages(q, procs, finished={1}, timeout_s=0.3, interval_s=0.05):
            pass


def test_the_deadline_ends_the_wait():
    q = CTX.Queue()
    procs = start_workers(CTX, _silent, [(0, q)], daemon=True)
    with pytest.raises(WorkerTimeout) as exc:
        for _ in poll_messages(q, procs, timeout_s=0.2, interval_s=0.05):
            pass
    _join(procs)
    assert exc.value.timeout_s == 0.2 and procs[0].daemon
