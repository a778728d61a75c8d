"""Interleaved 1F1B (v model chunks per pipeline rank) equals single-process training.

Two ranks of two chunks over 4-block models (GPT's tied embedding on the model's first and last
chunk, which sit on different ranks), with G = 2 and 4, and one plan that mixes interleaving with
data parallelism, ZeRO-1, recomputation and optimizer offloading. Same tolerance and reference
as `test_runtime_pipeline.py`; the simulator's device states and saved-activation peak per rank
(its chunks in flight under the interleaved order) equal the runtime's to the byte."""

from dataclasses import replace

import pytest
from rt_helpers import CFG, CPU_PROFILE, SEQ, SPECS, compare, reference, run_plan

from mist.hardware import load_profile
from mist.plan import Offload, Plan, StageStrategy
from mist.simulate.plan_sim import simulate_plan
from mist.specs.training import ClusterSpec, TrainingSpec

SPECS.setdefault("gpt4", replace(SPECS["gpt"], num_layers=4, name="tiny-gpt4"))
SPECS.setdefault("falcon4", replace(SPECS["falcon"], num_layers=4, name="tiny-falcon4"))
# a CPU profile, so that the simulator traces for the device the workers run on


def interleaved_plan(family: str, G: int, dp: int = 1, mixed: bool = False, b: int = 2) -> Plan:
    spec = SPECS[family]
    stages = tuple(
        StageStrategy(
            layers=2,
            nodes=1,
            gpus_per_node=dp,
            micro_batch=b,
            dp=dp,
            tp=1,
            zero=1 if mixed and i == 0 else 0,
            recompute_layers=1 if mixed and i == 0 else 0,
            offload=Offload(optimizer=1.0) if mixed and i == 1 else Offload(),
            chunk_layers=(1, 1),
        )
        for i in range(2)
    )
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu=CPU_PROFILE, nodes=1, gpus_per_node=2 * dp),
        training=TrainingSpec(seq_len=SEQ, global_batch=b * dp * G, param_dtype="fp32", compute_dtype="fp32"),
        micro_batches=G,
        stages=stages,
        virtual_stages=2,
    )


@pytest.mark.parametrize(
    "family,kw",
    [("gpt4", dict(G=2)), ("falcon4", dict(G=4)), ("gpt4", dict(G=2, dp=2, mixed=True, b=1))],
    ids=["gpt4-v2-G2", "falcon4-v2-G4", "gpt4-v2-dp2-zero1-recompute|offload"],
)
def test_interleaved_matches_single_process(family, kw):
    plan = interleaved_plan(family, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    errs = compare(family, res, ref)
    print(f"{family}-{kw}: {errs}")
    pred = simulate_plan(plan, load_profile(CPU_PROFILE))
    assert len(res["metrics"]["stages"]) == 2
    for p, m in zip(pred.stages, res["metrics"]["stages"]):
        for k in ("state_bytes", "saved_activation_peak_bytes"):
            assert getattr(p, k) == m[k], k


def test_interleaved_checkpoint_resumes(tmp_path):
    """4 steps = 2 steps, a checkpoint of every chunk's units, and 2 resumed steps."""
    import numpy as np

    plan = interleaved_plan("gpt4", G=2)
    full = run_plan(plan, steps=4)
    ck = str(tmp_path / "ck")
    first = run_plan(plan, steps=4, checkpoint_dir=ck, stop_after=2)
    resumed = run_plan(plan, steps=4, checkpoint_dir=ck, resume=True)
    got = first["metrics"]["losses"] + resumed["metrics"]["losses"]
    np.testing.assert_allclose(got, full["metrics"]["losses"], rtol=0, atol=1e-6)
    for k, v in full["state"].items():
        np.testing.assert_allclose(resumed["state"][k], v, rtol=0, atol=1e-6, err_msg=k)
