"""Test-suite settings.

Tests marked `gpu` need a CUDA device and are skipped where PyTorch sees none (`python -m pytest
-m gpu` runs only them, on a GPU machine).

Compiled blocks build scalar C++ kernels here (`TORCHINDUCTOR_VEC_ISA_OK=0`, inherited by every
process a test starts). What the tests check of a compiled block is decided before Inductor
writes its kernels: the graphs AOTAutograd partitions, what they save, the buffers Inductor's
scheduler allocates, and losses within the equivalence tolerance. Building Inductor's vectorized
CPU kernels takes about twice as long (one GPT block's two compiles, cold: 30.7 s against 16.8 s)
and starts each process with seconds of instruction-set probing. The benchmarks run Inductor's
defaults; set the variable to 1 to run the tests with them too.

Tests marked `extended` are further cases of a mechanism that a test of the default run checks
too (another model family, cluster or parallel layout through the same code); each names that
test. The default run leaves them out (pytest reports them as deselected, not as passed), which
keeps it near ten minutes on two cores; `--extended` runs the whole suite."""

import os

import pytest

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the tests marked `extended` (the whole suite; the default run leaves them out)",
    )


_LEFT_OUT = "tests marked extended were left out (--extended runs them too)"


def pytest_report_header(config):
    return None if config.getoption("extended") else _LEFT_OUT


def pytest_terminal_summary(terminalreporter, config):
    """Said at the end too, which a quiet run (`-q`, no header) and the xdist controller (whose
    workers deselect them) would not show otherwise."""
    if not config.getoption("extended"):
        terminalreporter.write_line(_LEFT_OUT)


def pytest_collection_modifyitems(config, items):
    _check_covered_by(items)
    if not config.getoption("extended"):
        left_out = [item for item in items if "extended" in item.keywords]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if "extended" not in item.keywords]
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if not gpu_tests:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in gpu_tests:
        item.add_marker(skip)


def _check_covered_by(items) -> None:
    """Each `extended` test names, as a node id, a test of the default run that checks its
    mechanism: where that test's file was collected, the named test must be among it and not be
    `extended` itself."""
    default = [item.nodeid for item in items if "extended" not in item.keywords]
    files = {nodeid.split("::")[0] for nodeid in default} | {item.nodeid.split("::")[0] for item in items}
    for item in items:
        mark = item.get_closest_marker("extended")
        if mark is None:
            continue
        covered_by = mark.kwargs.get("covered_by") or (mark.args[0] if mark.args else None)
        if not covered_by:
            raise pytest.UsageError(f"{item.nodeid} is marked extended without naming the default test that covers it")
        if covered_by.split("::")[0] not in files:
            continue  # that file is not part of this run
        if not any(n == covered_by or n.startswith(covered_by + "[") for n in default):
            raise pytest.UsageError(
                f"{item.nodeid} is marked extended, covered by {covered_by}, which the default run lacks"
            )
