"""Pipeline parallelism (non-interleaved 1F1B) equals single-process training.

Plans of 2–3 stages with uneven layer splits, data and tensor parallelism inside the stages (the
same on every stage, or different dp / tp / micro-batch per stage), per-stage ZeRO /
recomputation / offloading, and G not a multiple of the number of stages; GPT's tied embeddings
live on the first and the last stage (their gradients are summed). Same tolerance
and the same plain-PyTorch reference as `test_runtime_equivalence.py`.
"""

from dataclasses import replace

import pytest
from rt_helpers import CFG, SEQ, SPECS, compare, reference, run_plan

from mist.plan import Offload, Plan, StageStrategy
from mist.specs.training import ClusterSpec, TrainingSpec

# 4-layer variants for the 3 + 1 splits (the reference reads the spec from SPECS)
SPECS.setdefault("gpt4", replace(SPECS["gpt"], num_layers=4, name="tiny-gpt4"))
SPECS.setdefault("falcon4", replace(SPECS["falcon"], num_layers=4, name="tiny-falcon4"))


def pp_plan(family: str, stages: list[dict], *, dp=1, tp=1, G=2, b=2) -> Plan:
    """Stages of `layers` with dp/tp/b by default, or their own (dp × b equal on every stage)."""
    spec = SPECS[family]
    sts = []
    for s in stages:
        sdp, stp = s.get("dp", dp), s.get("tp", tp)
        sts.append(
            StageStrategy(
                layers=s["layers"],
                nodes=1,
                gpus_per_node=sdp * stp,
                micro_batch=s.get("b", b * dp // sdp),
                dp=sdp,
                tp=stp,
                zero=s.get("zero", 0),
                recompute_layers=s.get("recompute", 0),
                offload=Offload(**s.get("offload", {})),
                sequence_parallel=s.get("sp", False),
            )
        )
    gpus = sum(s.gpus for s in sts)
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=gpus),
        training=TrainingSpec(seq_len=SEQ, global_batch=b * dp * G, param_dtype="fp32", compute_dtype="fp32"),
        micro_batches=G,
        stages=tuple(sts),
    )


L = lambda *n: [dict(layers=k) for k in n]  # noqa: E731


def MIXED(a, b):
    return [
        dict(layers=a, zero=1, recompute=a),
        dict(layers=b, offload=dict(optimizer=1.0)),
    ]


CASES = [
    # uneven layers (GPT: tied embeddings across the first and the last stage)
    ("gpt4", "pp2-3+1", dict(stages=L(3, 1), G=2)),
    ("llama", "pp2-2+1", dict(stages=L(2, 1), G=2)),
    ("falcon4", "pp2-3+1", dict(stages=L(3, 1), G=2)),
    # PP 2 × DP 2
    ("gpt", "pp2xdp2", dict(stages=L(1, 1), dp=2, G=2)),
    ("llama", "pp2xdp2", dict(stages=L(2, 1), dp=2, G=2)),
    ("falcon", "pp2xdp2", dict(stages=L(1, 1), dp=2, G=2)),
    # recompute + ZeRO 1 on stage 0, optimizer offload on stage 1 (dp 2)
    ("gpt", "pp2-zero1-recompute|offload", dict(stages=MIXED(1, 1), dp=2, G=2)),
    ("llama", "pp2-zero1-recompute|offload", dict(stages=MIXED(2, 1), dp=2, G=2)),
    ("falcon", "pp2-zero1-recompute|offload", dict(stages=MIXED(1, 1), dp=2, G=2)),
    # G not a multiple of S, and G < S - 1 + 1 (a clipped warm-up) on three stages
    ("gpt", "pp2-G3", dict(stages=L(1, 1), G=3)),
    ("llama", "pp3-G4", dict(stages=L(1, 1, 1), G=4)),
    ("llama", "pp3-G1", dict(stages=L(1, 1, 1), G=1)),
    # TP inside the stages, ZeRO 3 on a tied GPT
    ("falcon", "pp2xtp2", dict(stages=L(1, 1), tp=2, G=3)),
    ("gpt", "pp2-zero3-G3", dict(stages=[dict(layers=1, zero=3), dict(layers=1, zero=3)], dp=2, G=3)),
    # stages with different dp, tp and micro-batch: rows of a micro-batch from several senders,
    # gradients rescaled by dp_i / dp_(i+1); GPT's tied embedding reduced over both stages' copies
    ("llama", "dp2|tp2", dict(stages=[dict(layers=2, dp=2, b=1), dict(layers=1, tp=2)], G=2)),
    ("gpt", "tp2|dp2", dict(stages=[dict(layers=1, tp=2), dict(layers=1, dp=2, b=1)], G=2)),
    ("falcon", "dp2b1|dp1b2", dict(stages=[dict(layers=1, dp=2, b=1), dict(layers=1)], G=2)),
    ("gpt", "dp3b1|dp1b3", dict(stages=[dict(layers=1, dp=3, b=1), dict(layers=1)], b=3, G=2)),
    (
        "gpt",
        "dp2-zero2-recompute|tp2-zero3",
        dict(stages=[dict(layers=1, dp=2, b=1, zero=2, recompute=1), dict(layers=1, tp=2, zero=3)], G=3),
    ),
    (
        "llama",
        "pp3-dp1|dp2-zero1-recompute|tp2",
        dict(stages=[dict(layers=1), dict(layers=1, dp=2, b=1, zero=1, recompute=1), dict(layers=1, tp=2)], G=3),
    ),
]


@pytest.mark.parametrize("family,name,kw", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_pipeline_matches_single_process(family, name, kw):
    plan = pp_plan(family, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    errs = compare(family, res, ref)
    print(f"{family}-{name}: {errs}")
    m = res["metrics"]
    assert len(m["stages"]) == plan.num_stages and m["world_size"] == plan.cluster.world_size
    for st, s in zip(m["stages"], plan.stages):
        assert (st["host_state_bytes"] > 0) == bool(s.offload.optimizer)
