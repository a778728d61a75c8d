"""Test-suite settings: tests marked `gpu` need a CUDA device and are skipped where PyTorch sees
none (`python -m pytest -m gpu` runs only them, on a GPU machine)."""

import pytest


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
