"""mist train refuses, before any worker allocates, a plan whose states do not fit the node's RAM."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mist.hardware import load_profile
from mist.plan import plan_from_dict
from mist.runtime.preflight import available_memory, node_state_bytes
from mist.simulate.plan_sim import simulate_plan

ROOT = Path(__file__).resolve().parents[2]


def _plan(model, tp, gpu="l4"):
    return plan_from_dict(
        {
            "model": model,
            "cluster": {"gpu": gpu, "nodes": 1, "gpus_per_node": 8},
            "training": {"seq_len": 2048, "global_batch": 64},
            "micro_batches": 16,
            "stages": [
                {
                    "layers": 15,
                    "nodes": 1,
                    "gpus_per_node": 4,
                    "micro_batch": tp,
                    "dp": 4 // tp,
                    "tp": tp,
                    "zero": 1,
                    "recompute_layers": 15,
                    "offload": {"optimizer": 0.5, "weights": 0.25, "grads": 0.5},
                },
                {
                    "layers": 9,
                    "nodes": 1,
                    "gpus_per_node": 4,
                    "micro_batch": tp,
                    "dp": 4 // tp,
                    "tp": tp,
                    "zero": 2,
                    "recompute_layers": 1,
                    "offload": {"optimizer": 1.0},
                },
            ],
        }
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_node_bytes_are_the_simulated_states_or_a_lower_bound(tp):
    plan = _plan("gpt3-1.3b", tp)
    st = simulate_plan(plan, load_profile("l4")).stages
    on_cpu = sum((s.state_bytes + s.host_state_bytes) * 4 for s in st)  # 4 ranks a stage
    on_host = sum(s.host_state_bytes * 4 for s in st)
    got_cpu, got_host = node_state_bytes(plan, range(8), "cpu"), node_state_bytes(plan, range(8), "cuda")
    if tp == 1:  # the unsharded block count is exact: the same bytes as the simulator's
        assert (got_cpu, got_host) == (on_cpu, on_host)
    else:  # replicated norms are counted once over tp: never more than the real bytes
        assert 0.95 * on_cpu < got_cpu <= on_cpu and 0.95 * on_host < got_host <= on_host
    # a node with only stage 1's ranks holds only stage 1's states
    assert node_state_bytes(plan, range(4, 8), "cuda") == pytest.approx(st[1].host_state_bytes * 4, rel=0.05)


def test_train_refuses_a_plan_beyond_this_machines_memory(tmp_path):
    plan = plan_from_dict(
        {
            "model": "llama-70b",
            "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 1},
            "training": {"seq_len": 64, "global_batch": 1, "param_dtype": "fp32", "compute_dtype": "fp32"},
            "micro_batches": 1,
            "stages": [{"layers": 80, "nodes": 1, "gpus_per_node": 1, "micro_batch": 1, "dp": 1, "tp": 1}],
        }
    )
    need = node_state_bytes(plan, range(1), "cpu")
    assert need > 1e12 and (available_memory() or 0) < need  # 70B parameters × 20 bytes
    path = tmp_path / "plan.json"
    plan.save(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-m", "mist", "train", str(path), "--local", "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "GiB of memory available" in r.stderr and "need at least" in r.stderr
