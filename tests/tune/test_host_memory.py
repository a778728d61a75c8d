"""Host memory: where a node's RAM comes from, how GPUs map onto nodes, and that simulate, the
tuner and the baselines keep offloaded bytes within it."""

from dataclasses import replace

import pytest

from mist.errors import MistInputError
from mist.hardware import load_profile
from mist.hardware.host_memory import TYPICAL_NODES, node_host_memory, node_usage
from mist.plan import plan_from_dict
from mist.simulate.plan_sim import simulate_plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import run_space
from mist.units import GiB


def test_capacity_comes_from_the_cluster_then_the_profile_then_the_typical_node():
    l4 = load_profile("l4")
    cap, src = node_host_memory(ClusterSpec("l4", 1, 4, host_memory_gib=100), l4)
    assert cap == 100 * GiB and "cluster" in src
    cap, src = node_host_memory(ClusterSpec("l4", 1, 4), replace(l4, host_memory_per_gpu=10 * GiB))
    assert cap == 40 * GiB and "profile" in src
    cap, src = node_host_memory(ClusterSpec("l4", 1, 4), l4)
    assert cap == TYPICAL_NODES["l4"][0] * 4 * GiB and "g2-standard-96" in src
    cap, src = node_host_memory(ClusterSpec("l4", 1, 4), replace(l4, name="my-gpu"))
    assert cap is None and "--host-memory" in src


def test_profile_round_trips_its_host_memory():
    from mist.hardware.profile import GpuProfile

    p = replace(load_profile("h200"), host_memory_per_gpu=123.0 * GiB)
    assert GpuProfile.from_dict(p.to_dict()).host_memory_per_gpu == 123.0 * GiB
    assert "host_memory_per_gpu" not in load_profile("h200").to_dict()


def test_nodes_hold_consecutive_ranks():
    # stages of 2, 2 and 4 GPUs on nodes of 4: node 0 = stages 0 and 1, node 1 = stage 2
    assert node_usage([2, 2, 4], [1.0, 10.0, 100.0], 4) == [22.0, 400.0]
    # a stage across two nodes of 2
    assert node_usage([4], [3.0], 2) == [6.0, 6.0]


@pytest.mark.parametrize("bad", [-1, 0, True, "lots", float("inf"), float("nan"), 1e308])
def test_cluster_rejects_a_bad_host_memory(bad):
    with pytest.raises(MistInputError, match="host_memory_gib"):
        ClusterSpec("l4", 1, 2, host_memory_gib=bad)


def test_plan_without_the_field_reads_and_writes_as_before():
    c = ClusterSpec("l4", 1, 2)
    assert "host_memory_gib" not in c.to_dict()
    assert ClusterSpec(**ClusterSpec("l4", 1, 2, host_memory_gib=64).to_dict()).host_memory_gib == 64


def _offload_plan(host_gib=None):
    cluster = {"gpu": "l4", "nodes": 1, "gpus_per_node": 2}
    if host_gib is not None:
        cluster["host_memory_gib"] = host_gib
    return plan_from_dict(
        {
            "model": "gpt3-2.7b",
            "cluster": cluster,
            "training": {"seq_len": 2048, "global_batch": 8},
            "micro_batches": 4,
            "stages": [
                {
                    "layers": 32,
                    "nodes": 1,
                    "gpus_per_node": 2,
                    "micro_batch": 1,
                    "dp": 2,
                    "tp": 1,
                    "zero": 1,
                    "recompute_layers": 32,
                    "offload": {"weights": 0.5, "grads": 1.0, "optimizer": 1.0, "activations": 0.5},
                }
            ],
        }
    )


def test_simulate_checks_every_node_against_its_ram():
    prof = load_profile("l4")
    roomy = simulate_plan(_offload_plan(), prof)
    h = roomy.host_memory
    st = roomy.stages[0]
    assert st.host_peak_bytes == (st.host_state_bytes + st.host_optimizer_grad_bytes + st.host_activation_peak_bytes)
    # ZeRO-1 over 2.7B parameters: 12 bytes of optimizer state per parameter, half on each GPU
    assert 0.45 * 2.7e9 * 12 < st.host_state_bytes < 0.75 * 2.7e9 * 16
    assert h.per_node_bytes == (2 * st.host_peak_bytes,) and h.fits and roomy.fits
    tight = simulate_plan(_offload_plan(host_gib=h.per_node_bytes[0] / GiB * 0.9), prof)
    assert not tight.fits and not tight.host_memory.fits
    assert any("host memory" in m for m in tight.memory_problems)
    assert all(s.fits for s in tight.stages)  # the GPUs themselves are fine


@pytest.fixture(scope="module")
def squeezed():
    """gpt3-1.3b on 2 L4s held to 9 GiB per GPU: it needs offloading to fit."""
    prof = replace(load_profile("l4"), memory_bytes=9 * GiB)
    return get_preset("gpt3-1.3b"), TrainingSpec(seq_len=2048, global_batch=16), prof


@pytest.mark.parametrize("space", ["full", "deepspeed"])
def test_tuners_keep_offloading_within_the_host_memory(squeezed, space):
    model, training, prof = squeezed
    free = run_space(space, model, ClusterSpec("l4", 1, 2), training, prof)
    assert free.plan is not None
    used = free.predicted.host_memory.per_node_bytes[0]
    assert used > 1 * GiB  # offloading is what makes it fit
    budget = used / GiB * 0.6
    held = run_space(space, model, ClusterSpec("l4", 1, 2, host_memory_gib=budget), training, prof)
    if held.plan is not None:
        again = simulate_plan(held.plan, prof)
        assert again.fits and again.host_memory.per_node_bytes[0] <= budget * GiB
        assert held.iteration_time_s >= free.iteration_time_s * (1 - 1e-9)
    else:
        assert "host memory" in held.infeasible_reason


def test_tuner_says_when_host_memory_is_what_is_missing(squeezed):
    model, training, prof = squeezed
    r = run_space("full", model, ClusterSpec("l4", 1, 2, host_memory_gib=0.01), training, prof)
    assert r.plan is None
    assert r.infeasible_reason.startswith("No configuration fits the host memory")
