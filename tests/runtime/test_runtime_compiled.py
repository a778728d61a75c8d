"""Plans with compiled blocks (`training.compile_blocks`: Inductor, on the CPU backend here) equal
single-process eager training — losses, gradient norms and every updated weight, the tolerance of
the other equivalence tests — under data parallelism with ZeRO-3, whole-block recomputation,
optimizer and activation offload and materialised attention; in an interleaved pipeline; under
tensor and sequence parallelism with one layer recomputed whole and the other's attention and
activation recomputed (selective); under context with tensor parallelism (the collectives
inside the compiled graphs, on gloo; the rotary positions of the rank's two chunks); and in a
ZB-H1 pipeline, whose weight-gradient pass runs each block's compiled W graph. (Tensor
parallelism without the others is checked against the eager block's collectives in
tests/analysis/test_compiled_block.py, and runs in the CPU loop.) And the simulator's states and
saved activations (on the device and offloaded to the host), priced from the captured graphs, are
the runtime's to the byte."""

from dataclasses import replace

import pytest
from rt_helpers import CFG, CPU_PROFILE, compare, compiled_plan, make_plan, reference, run_plan
from test_runtime_interleaved import interleaved_plan
from test_runtime_pipeline import pp_plan

from mist.hardware import load_profile
from mist.simulate.plan_sim import simulate_plan

CASES = [
    (
        "gpt",
        "dp2-zero3-recompute1-opt0.5-act0.5-bmm",
        lambda: make_plan(
            "gpt", dp=2, zero=3, recompute=1, offload={"optimizer": 0.5, "activations": 0.5}, flash=False
        ),
    ),
    ("falcon4", "interleaved-v2-G4", lambda: interleaved_plan("falcon4", G=4)),
    (
        "gpt",
        "tp2-sp-recompute1+attn+act-act0.5-bmm",
        lambda: make_plan(
            "gpt",
            tp=2,
            sequence_parallel=True,
            recompute=1,
            recompute_attention=True,
            recompute_activation=True,
            offload={"activations": 0.5},
            flash=False,
        ),
    ),
    (
        "llama",
        "cp2-tp2",
        lambda: make_plan("llama", cp=2, tp=2),
    ),
    (
        "llama",
        "zb-h1-pp2-2+1-G3",
        lambda: replace(pp_plan("llama", stages=[dict(layers=2), dict(layers=1)], G=3), schedule="zb-h1"),
    ),
]


# compiled tensor- and sequence-parallel blocks with selective recomputation also run, rank by
# rank against eager blocks, in test_runtime_dropout.py; their whole-block recomputation's graphs
# are checked in tests/analysis/test_compiled_block.py
EXTENDED = {
    "gpt-tp2-sp-recompute1+attn+act-act0.5-bmm": pytest.mark.extended(
        "tests/runtime/test_runtime_dropout.py::test_compiled_blocks_draw_each_rank_s_own_masks_as_eager_blocks_do"
    )
}


@pytest.mark.parametrize(
    "family,name,build",
    [pytest.param(f, n, b, id=f"{f}-{n}", marks=EXTENDED.get(f"{f}-{n}", ())) for f, n, b in CASES],
)
def test_compiled_plan_matches_single_process(family, name, build):
    plan = compiled_plan(build())
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch, flash=plan.training.flash_attention)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    print(f"{family}-{name}: {compare(family, res, ref)}")
    pred = simulate_plan(plan, load_profile(CPU_PROFILE))
    for p, m in zip(pred.stages, res["metrics"]["stages"]):
        for k in ("state_bytes", "saved_activation_peak_bytes", "host_activation_peak_bytes"):
            assert getattr(p, k) == m[k], k
    if any(s.offload.activations > 0 for s in plan.stages):
        assert any(m["host_activation_peak_bytes"] > 0 for m in res["metrics"]["stages"])
