"""The host AdamW as a GPU rank of a K-rank node gets it: ⌊cores / K⌋ threads while K − 1
neighbour processes run the same step (real spawned processes)."""

import torch

from mist.cpu_workers import host_cores
from mist.profiling.compute import measure_host_adam
from mist.profiling.neighbours import Neighbours


def test_adam_neighbours_step_until_stopped():
    busy = Neighbours(1, 1, work="adam", size=2**16).start()  # start() waits for a first step
    try:
        assert len(busy._procs) == 1 and busy._procs[0].is_alive()
    finally:
        busy.stop()
    assert busy._procs == []


def test_rank_share_of_the_host():
    threads = torch.get_num_threads()
    m = measure_host_adam(2**20, 2)
    assert m["host_ranks"] == 2 and m["host_threads"] == max(1, host_cores() // 2)
    assert 1e-12 < m["host_s_per_param"] < 1e-6
    assert torch.get_num_threads() == threads  # the caller's threads are restored
