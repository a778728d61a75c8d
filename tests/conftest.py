"""Test-suite settings.

Tests marked `gpu` need a CUDA device and are skipped where PyTorch sees none (`python -m pytest
-m gpu` runs only them, on a GPU machine).

Compiled blocks build scalar C++ kernels here (`TORCHINDUCTOR_VEC_ISA_OK=0`, inherited by every
process a test starts). What the tests check of a compiled block is decided before Inductor
writes its kernels: the graphs AOTAutograd partitions, what they save, the buffers Inductor's
scheduler allocates, and losses within the equivalence tolerance. Building Inductor's vectorized
CPU kernels takes about twice as long (one GPT block's two compiles, cold: 30.7 s against 16.8 s)
and starts each process with seconds of instruction-set probing. The benchmarks run Inductor's
defaults; set the variable to 1 to run the tests with them too."""

import os

import pytest

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if not gpu_tests:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in gpu_tests:
        item.add_marker(skip)
