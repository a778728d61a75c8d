"""Context parallelism equals single-process training.

A stage's cp ranks each hold 2 of the sequence's 2·cp chunks (load-balanced: chunks c and
2·cp − 1 − c); attention all-gathers K and V (`mist.models.context_parallel`), the rotary and
learned position tables follow the rank's positions, and gradients are averaged over the dp × cp
replicas. Every family alone (GPT's learned positions, Llama's GQA, Falcon's parallel block with
tp 2 and sequence parallelism); with dp, ZeRO, recomputation and offloading in one plan; a
pipeline with different tp per stage; interleaved; ZB-H1. Same tolerance and plain-PyTorch
reference as `test_runtime_equivalence.py`; the simulator's device states and saved-activation
peaks equal the runtime's to the byte (a CPU profile: the traces are the CPU's).
"""

from dataclasses import replace

import pytest
from rt_helpers import CFG, CPU_PROFILE, SPECS, compare, make_plan, reference, run_plan
from test_runtime_sequence_parallel import _memory_matches, pp_plan

SPECS.setdefault("llama4", replace(SPECS["llama"], num_layers=4, name="tiny-llama4"))


SINGLE = [
    ("gpt", "cp2", dict(cp=2)),
    ("llama", "cp2", dict(cp=2)),
    ("falcon", "cp2-tp2-sp", dict(cp=2, tp=2, sequence_parallel=True)),
    (
        "llama",
        "cp2-dp2-zero2-recompute-offload",
        dict(
            cp=2,
            dp=2,
            zero=2,
            G=2,
            recompute=1,
            recompute_activation=True,
            offload=dict(optimizer=0.5, activations=0.5),
        ),
    ),
]


@pytest.mark.parametrize("family,name,kw", SINGLE, ids=[f"{f}-{n}" for f, n, _ in SINGLE])
def test_context_parallel_matches_single_process(family, name, kw):
    plan = make_plan(family, gpu=CPU_PROFILE, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    compare(family, res, ref)
    _memory_matches(plan, res)


CP2 = dict(cp=2)
PIPELINES = [
    ("llama", "cp2|cp2-tp2-sp", [dict(layers=2, **CP2), dict(layers=1, tp=2, sp=True, **CP2)], {}),
    (
        "gpt4",
        "v2-cp2|cp2-recompute",
        [dict(layers=2, chunks=(1, 1), **CP2), dict(layers=2, chunks=(1, 1), recompute=1, **CP2)],
        dict(v=2),
    ),
    ("gpt4", "zb-h1-cp2|cp2", [dict(layers=3, **CP2), dict(layers=1, **CP2)], dict(schedule="zb-h1", G=4)),
    # everything in one plan: interleaving, context and sequence parallelism, ZeRO over the cp
    # replicas, recomputation, optimizer and activation offload
    (
        "llama4",
        "v2-cp2-tp2-sp-zero1-recompute-offload|cp2-activations",
        [
            dict(layers=2, chunks=(1, 1), tp=2, sp=True, zero=1, recompute=1, offload=dict(optimizer=0.5), **CP2),
            dict(layers=2, chunks=(1, 1), offload=dict(activations=0.5), **CP2),
        ],
        dict(v=2),
    ),
]


@pytest.mark.parametrize("family,name,stages,kw", PIPELINES, ids=[f"{f}-{n}" for f, n, _, _ in PIPELINES])
def test_context_parallel_pipelines_match_single_process(family, name, stages, kw):
    plan = pp_plan(family, stages, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    compare(family, res, ref)
    _memory_matches(plan, res)
