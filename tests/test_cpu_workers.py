"""Worker set-up: ⌊cores / K⌋ threads (CPU devices, and GPU ranks for their host AdamW, also under
torchrun's OMP_NUM_THREADS=1), and freed memory kept in the heap so that the large temporaries of
every training step stop being page-faulted in afresh (measured with the kernel's own minor-fault
counter, in fresh processes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mist.cpu_workers import HOST_THREADS_ENV, host_cores, threads_per_worker
from mist.errors import MistInputError

SRC = Path(__file__).resolve().parents[1] / "src"

# one "step": a 64 MiB and a 32 MiB temporary, written and freed; the minor page faults of the
# last 5 of 15 steps
STEPS = """
import resource, sys, torch
from mist.cpu_workers import keep_heap_pages
print(keep_heap_pages() if sys.argv[1] == "keep" else "default")
torch.set_num_threads(1)
def step():
    x = torch.empty(16 * 2**20).fill_(1.0)
    y = torch.empty(8 * 2**20).fill_(2.0)
    del x, y
for _ in range(10):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def faults(mode: str) -> tuple[str, int]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, env=env, check=True, timeout=120
    ).stdout.split()
    return out[0], int(out[1])


def test_threads_per_worker(monkeypatch):
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    cores = host_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores * 2) == 1


def test_host_threads_override(monkeypatch):
    cores = host_cores()
    for n in {1, cores}:
        monkeypatch.setenv(HOST_THREADS_ENV, str(n))
        assert threads_per_worker(1) == threads_per_worker(64) == n
    for bad in ("0", "-2", "four", "", "1e3", "²"):
        monkeypatch.setenv(HOST_THREADS_ENV, bad)
        with pytest.raises(MistInputError, match=f"{HOST_THREADS_ENV} must be a positive integer"):
            threads_per_worker(2)


def test_host_threads_above_the_cores_are_refused(monkeypatch):
    """More threads than cores only oversubscribes them (100000 failed to start threads at all)."""
    cores = host_cores()
    for many in (cores + 1, 100000):
        monkeypatch.setenv(HOST_THREADS_ENV, str(many))
        with pytest.raises(MistInputError) as e:
            threads_per_worker(2)
        assert str(e.value) == (
            f"{HOST_THREADS_ENV} must be between 1 and {cores}, the cores this process may use, got {many}."
        )


def test_gpu_rank_threads_beat_torchruns_default():
    """torchrun exports OMP_NUM_THREADS=1 to every process of a multi-process node; a GPU rank
    still gets its share of the cores for the host AdamW."""
    code = (
        "import torch; from mist.cpu_workers import setup_gpu_rank; "
        "print(torch.get_num_threads()); setup_gpu_rank(2); print(torch.get_num_threads())"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120
    ).stdout.split()
    assert out == ["1", "2"]


def test_kept_heap_pages_stop_the_page_faults_of_repeated_temporaries():
    ok, kept = faults("keep")
    _, default = faults("default")
    assert ok == "True"  # glibc: mallopt took both settings
    pages = 5 * (96 * 2**20) // 4096  # what fresh mappings fault in over 5 steps
    assert default > pages // 2, default  # glibc's default maps them afresh every step
    # kept in the heap: no faults, or (depending on where the interpreter's own small allocations
    # landed) the heap grows once past the 64 MiB temporary — never the every-step re-faulting
    assert kept <= (64 * 2**20) // 4096, kept
