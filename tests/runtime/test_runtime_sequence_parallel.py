"""Sequence parallelism (Megatron-style, with tensor parallelism) equals single-process training.

Under sequence parallelism a stage's TP ranks hold 1/tp of the sequence between the blocks
(norms, residuals, the block outputs): column-parallel linears all-gather their input, row-parallel
ones reduce-scatter their output, and the norm weights' and post-reduction biases' gradients are
summed over the TP group. Every family alone; with dp, ZeRO, recomputation and offloading in one
plan; in pipelines whose neighbouring stages differ in tp and in sequence parallelism (the
boundary pieces then carry sequence ranges, `runtime.handoff`); and interleaved, with different
dp/tp per stage. Same tolerance and plain-PyTorch reference as `test_runtime_equivalence.py`; the simulator's device states and
saved-activation peaks equal the runtime's to the byte (a CPU profile: the traces are the CPU's).
"""

from dataclasses import replace

import pytest
from rt_helpers import CFG, CPU_PROFILE, SEQ, SPECS, compare, make_plan, reference, run_plan

from mist.hardware import load_profile
from mist.plan import Offload, Plan, StageStrategy
from mist.simulate.plan_sim import simulate_plan
from mist.specs.training import ClusterSpec, TrainingSpec

SPECS.setdefault("gpt4", replace(SPECS["gpt"], num_layers=4, name="tiny-gpt4"))
SPECS.setdefault("falcon4", replace(SPECS["falcon"], num_layers=4, name="tiny-falcon4"))

MIXED = dict(dp=2, zero=3, G=2, recompute=1, offload=dict(weights=0.5, grads=0.5, optimizer=0.5, activations=0.5))

SINGLE = [
    ("gpt", "tp2", dict(tp=2)),
    ("llama", "tp2", dict(tp=2)),
    ("falcon", "tp2", dict(tp=2)),
    ("gpt", "tp2-nonflash-attention-recompute", dict(tp=2, flash=False, recompute_attention=True)),
    ("llama", "tp2-activation-recompute-G2", dict(tp=2, G=2, recompute_activation=True)),
    *[(f, "tp2-mixed", dict(tp=2, **MIXED)) for f in ("gpt", "llama", "falcon")],
]


@pytest.mark.parametrize("family,name,kw", SINGLE, ids=[f"{f}-{n}" for f, n, _ in SINGLE])
def test_sequence_parallel_matches_single_process(family, name, kw):
    plan = make_plan(family, sequence_parallel=True, gpu=CPU_PROFILE, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch, plan.training.flash_attention)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    compare(family, res, ref)
    _memory_matches(plan, res)


def _memory_matches(plan: Plan, res: dict) -> None:
    pred = simulate_plan(plan, load_profile(CPU_PROFILE))
    for p, m in zip(pred.stages, res["metrics"]["stages"]):
        for k in ("state_bytes", "saved_activation_peak_bytes"):
            assert getattr(p, k) == m[k], k


def pp_plan(family: str, stages: list[dict], G: int = 2, b: int = 2, v: int = 1, schedule: str = "1f1b") -> Plan:
    sts = tuple(
        StageStrategy(
            layers=s["layers"],
            nodes=1,
            gpus_per_node=s.get("dp", 1) * s.get("tp", 1) * s.get("cp", 1),
            micro_batch=b // s.get("dp", 1),
            dp=s.get("dp", 1),
            tp=s.get("tp", 1),
            zero=s.get("zero", 0),
            recompute_layers=s.get("recompute", 0),
            offload=Offload(**s.get("offload", {})),
            sequence_parallel=s.get("sp", False),
            chunk_layers=s.get("chunks"),
            cp=s.get("cp", 1),
        )
        for s in stages
    )
    return Plan(
        model=SPECS[family],
        cluster=ClusterSpec(gpu=CPU_PROFILE, nodes=1, gpus_per_node=sum(s.gpus for s in sts)),
        training=TrainingSpec(seq_len=SEQ, global_batch=b * G, param_dtype="fp32", compute_dtype="fp32"),
        micro_batches=G,
        stages=sts,
        virtual_stages=v,
        schedule=schedule,
    )


SP2 = dict(tp=2, sp=True)
PIPELINES = [
    ("llama", "sp-tp2|sp-tp2", [dict(layers=2, **SP2), dict(layers=1, **SP2)], {}),
    ("gpt4", "sp-tp2|tp1", [dict(layers=3, **SP2), dict(layers=1)], {}),
    ("falcon4", "dp2|sp-tp2", [dict(layers=1, dp=2), dict(layers=3, **SP2)], {}),
    ("llama", "sp-tp2|tp2", [dict(layers=2, **SP2), dict(layers=1, tp=2)], {}),
    (
        "gpt4",
        "v2-sp-tp2|sp-tp2-zero1-recompute",
        [dict(layers=2, chunks=(1, 1), **SP2), dict(layers=2, chunks=(1, 1), zero=1, recompute=1, **SP2)],
        dict(v=2),
    ),
    (
        "falcon4",
        "v2-sp-tp2|dp2-zero1-offload",
        [
            dict(layers=2, chunks=(1, 1), **SP2),
            dict(layers=2, chunks=(1, 1), dp=2, zero=1, offload=dict(optimizer=0.5)),
        ],
        dict(v=2),
    ),
]


@pytest.mark.parametrize("family,name,stages,kw", PIPELINES, ids=[f"{f}-{n}" for f, n, _, _ in PIPELINES])
def test_sequence_parallel_pipelines_match_single_process(family, name, stages, kw):
    plan = pp_plan(family, stages, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    compare(family, res, ref)
    _memory_matches(plan, res)
