"""Host memory of offloading, byte for byte: what `mist simulate` predicts per stage (offloaded
state tails, the CPU AdamW's fp32 gradient copies, offloaded saved activations of every micro-batch
in flight) is what the runtime holds in host memory, on gloo CPU workers."""

from pathlib import Path

import pytest
from rt_helpers import SEQ, SPECS, run_plan

from mist.hardware import load_profile
from mist.plan import Offload, Plan, StageStrategy
from mist.simulate.plan_sim import simulate_plan
from mist.specs.training import ClusterSpec, TrainingSpec

# any CPU profile: bytes depend on the plan and the traced (CPU) tensors, not on its timings
CPU_PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "profiles" / "cpu-loop.json"
KEYS = ("host_state_bytes", "host_activation_peak_bytes", "host_optimizer_grad_bytes")


def _plan(stages, G, gpus):
    spec = SPECS["llama"]
    return Plan(
        model=spec,
        cluster=ClusterSpec("cpu", 1, gpus),
        training=TrainingSpec(seq_len=SEQ, global_batch=8, param_dtype="fp32", compute_dtype="fp32"),
        micro_batches=G,
        stages=tuple(stages),
    )


def _stage(layers, gpus, b, zero=0, recompute=0, **offload):
    return StageStrategy(
        layers=layers,
        nodes=1,
        gpus_per_node=gpus,
        micro_batch=b,
        dp=gpus,
        tp=1,
        zero=zero,
        recompute_layers=recompute,
        offload=Offload(**offload),
    )


PLANS = {
    # every kind at once, ZeRO-1 over dp 2, a recomputed block, two micro-batches
    "dp2": _plan(
        [_stage(3, 2, 2, zero=1, recompute=1, weights=0.5, grads=0.75, optimizer=0.5, activations=0.5)], G=2, gpus=2
    ),
    # a pipeline: stage 0 holds 1 earlier micro-batch in flight; ZeRO-3 with G = 1 on stage 1
    "pp2": _plan(
        [
            _stage(2, 1, 4, optimizer=1.0, activations=0.375),
            _stage(1, 1, 4, zero=3, recompute=1, weights=0.25, grads=0.5, activations=1.0),
        ],
        G=2,
        gpus=2,
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_host_bytes_match_the_prediction(name):
    plan = PLANS[name]
    pred = simulate_plan(plan, load_profile(str(CPU_PROFILE))).stages
    meas = run_plan(plan, steps=2)["metrics"]["stages"]
    for i, (p, m) in enumerate(zip(pred, meas)):
        for k in KEYS:
            assert getattr(p, k) == m[k], (name, i, k)
        assert p.host_peak_bytes == sum(getattr(p, k) for k in KEYS)
    assert all(p.host_state_bytes > 0 and p.host_activation_peak_bytes > 0 for p in pred)
    assert pred[0].host_optimizer_grad_bytes > 0


@pytest.mark.parametrize("flash", [True, False])
def test_selective_recomputation_saved_bytes_match_the_prediction(flash):
    """Blocks re-running their MLP activation (and, without flash, their attention core) next to
    a recomputed block, with half the saved activations offloaded: the saved bytes left on the
    device and the offloaded ones equal the prediction to the byte."""
    from dataclasses import replace

    st = replace(
        _stage(3, 2, 2, zero=1, recompute=1, activations=0.5), recompute_activation=True, recompute_attention=not flash
    )
    plan = _plan([st], G=2, gpus=2)
    plan = replace(plan, training=replace(plan.training, flash_attention=flash))
    pred = simulate_plan(plan, load_profile(str(CPU_PROFILE))).stages[0]
    plain = simulate_plan(
        replace(plan, stages=(replace(st, recompute_activation=False, recompute_attention=False),)),
        load_profile(str(CPU_PROFILE)),
    ).stages[0]
    meas = run_plan(plan, steps=2)["metrics"]["stages"][0]
    for k in ("saved_activation_peak_bytes", "host_activation_peak_bytes", "state_bytes"):
        assert getattr(pred, k) == meas[k], k
    assert pred.saved_activation_peak_bytes < plain.saved_activation_peak_bytes
