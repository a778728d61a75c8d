"""The ZB-H1 schedule (`runtime.zero_bubble`) equals single-process training: 2- and 3-stage
plans, fp32, losses, gradient norms and every updated weight against the plain-PyTorch reference
(the same tolerance as `test_runtime_pipeline.py`), with data parallelism and ZeRO inside the
stages, tensor parallelism, GPT's biases and tied embeddings, Llama's RMSNorm and SwiGLU,
Falcon's parallel blocks, and G both above and below the number of stages. The simulator's ZB-H1
memory — every micro-batch held until its W — is the runtime's to the byte."""

from dataclasses import replace

import pytest
from rt_helpers import CFG, CPU_PROFILE, SPECS, compare, reference, run_plan
from test_runtime_pipeline import pp_plan

from mist.hardware import load_profile
from mist.simulate.plan_sim import simulate_plan

SPECS.setdefault("gpt4", replace(SPECS["gpt"], num_layers=4, name="tiny-gpt4"))

L = lambda *n: [dict(layers=k) for k in n]  # noqa: E731

CASES = [
    ("gpt4", "pp2-3+1-G4", dict(stages=L(3, 1), G=4)),
    ("llama", "pp3-G4", dict(stages=L(1, 1, 1), G=4)),
    ("llama", "pp3-G2", dict(stages=L(1, 1, 1), G=2)),
    ("gpt", "pp2xdp2-zero2|zero1", dict(stages=[dict(layers=1, zero=2), dict(layers=1, zero=1)], dp=2, G=3)),
    ("falcon", "pp2xtp2", dict(stages=L(1, 1), tp=2, G=3)),
]


def _zero_bubble(plan):
    # the CPU profile, so that the simulator can price the plan (memory is device-independent)
    return replace(plan, cluster=replace(plan.cluster, gpu=CPU_PROFILE), schedule="zb-h1")


@pytest.mark.parametrize("family,name,kw", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_zero_bubble_matches_single_process(family, name, kw):
    plan = _zero_bubble(pp_plan(family, **kw))
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])
    errs = compare(family, res, ref)
    print(f"{family}-{name}: {errs}")
    # the saved activations the runtime accounts tensor by tensor — every micro-batch held until
    # its W — are the simulator's ZB-H1 memory model to the byte, and so are the states
    pred = simulate_plan(plan, load_profile(CPU_PROFILE))
    for p, m in zip(pred.stages, res["metrics"]["stages"]):
        for k in ("state_bytes", "saved_activation_peak_bytes"):
            assert getattr(p, k) == m[k], k
