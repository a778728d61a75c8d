"""The CPU loop end to end through the command line: `mist tune` of a small GPT and Llama on the
committed CPU profile of this machine type (data parallel, a 2-stage pipeline, tensor parallel, and
a memory limit that forces offloading), `mist validate` of each plan on 2 gloo worker processes
(benchmarks/cpu_loop.py, its quick case set, `--profile`). The benchmark's own run measures a fresh
profile first; a freshly measured profile driving the tuner and the simulator is checked in
tests/profiling/test_profiling_cpu.py, and here the plans are the same on every run.

Memory is checked where the runtime accounts it tensor by tensor: device-resident states and the
saved activations kept on the device (also when a fraction of them is offloaded), and the host bytes
of what is offloaded, must match the prediction to the byte. Step time depends on how busy the
machine is, so here it is only checked to be measured and reported: the benchmark's table gives each
plan's error and whether the target (median |error| ≤ 25 %, none over 35 %) was met.
"""

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_loop  # noqa: E402


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_loop")
    # (the memory is checked to the byte whatever the timings)
    profile = ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json"
    assert cpu_loop.main(["--cases", "quick", "--steps", "4", "--profile", str(profile), "--out", str(out)]) == 0
    return json.loads((out / "cpu_loop.json").read_text()), (out / "cpu_loop.md").read_text()


def test_the_loop_covers_dp_pp_tp_and_memory_optimizations(loop):
    data, md = loop
    plans = [c["plan"] for c in data["cases"]]
    stages = [s for p in plans for s in p["stages"]]
    assert any(len(p["stages"]) == 2 for p in plans)
    assert any(s["dp"] == 2 for s in stages) and any(s["tp"] == 2 for s in stages)
    assert any(s["recompute_layers"] > 0 or any(v > 0 for v in s["offload"].values()) for s in stages)
    for p in plans:  # tuned for this CPU profile, in its dtype
        assert p["training"]["param_dtype"] == p["training"]["compute_dtype"] == "fp32"
    assert md.count("\n| ") == len(plans) + 1  # header + one row per plan


def test_states_and_saved_activations_match_the_runtime(loop):
    data, _ = loop
    for c in data["cases"]:
        for s in c["stages"]:
            for k in ("state_bytes", "saved_activation_peak_bytes") + cpu_loop.HOST_KEYS:
                assert s[k]["predicted"] == s[k]["measured"], (c["case"], k)
    # (whether a tuned plan offloads at all depends on the profile measured in the run; plans that
    # offload every kind on purpose are checked to the byte in tests/runtime/test_host_memory_runtime.py)


def test_step_time_errors_are_reported(loop):
    data, md = loop
    errs = [abs(c["step_time_error"]) for c in data["cases"]]
    assert errs and all(math.isfinite(e) for e in errs), errs
    s = data["summary"]
    assert s["median_abs_time_error"] == statistics.median(errs) and s["max_abs_time_error"] == max(errs)
    assert s["time_target_met"] == (statistics.median(errs) <= 0.25 and max(errs) <= 0.35)
    assert f"median |error| {s['median_abs_time_error']:.1%}" in md and "target: median ≤ 25%" in md
