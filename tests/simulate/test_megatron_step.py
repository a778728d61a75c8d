"""A plan run by Megatron-LM with 16-bit gradients: its optimizer steps from fp32 copies of every
gradient it steps, made at once (`rules.megatron_buffers`); with fp32 gradients, from the buffer."""

import math
from dataclasses import replace
from pathlib import Path

from mist.hardware import load_profile
from mist.plan import Offload, load_plan
from mist.rules.optimizer_step import STEP_CHUNK
from mist.simulate.plan_sim import simulate_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(dtype: str, zero: int, grad_dtype=None, optimizer_offload=0.0):
    plan = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-dp2-recompute.json")  # dp 2, one stage
    t = replace(plan.training, param_dtype=dtype, compute_dtype=dtype, grad_dtype=grad_dtype)
    stages = tuple(replace(s, zero=zero, offload=Offload(optimizer=optimizer_offload)) for s in plan.stages)
    return replace(plan, training=t, stages=stages)


def test_the_step_holds_an_fp32_copy_of_what_the_rank_steps():
    prof = load_profile("l4")
    for dtype in ("fp16", "bf16"):
        for zero in (0, 1):
            plan = _plan(dtype, zero)
            mist = simulate_plan(plan, prof).stages
            megatron = simulate_plan(replace(plan, engine="megatron"), prof).stages
            for a, b, s in zip(mist, megatron, plan.stages):
                assert a.state_bytes == b.state_bytes
                params = b.memory_breakdown["weights_bytes"] // 2  # 16-bit weights, all on the rank
                stepped = math.ceil(params / s.dp) if zero == 1 else params
                assert b.step_peak_bytes - b.state_bytes == 4 * stepped, (dtype, zero)
                # Mist's runtime converts one piece at a time
                assert a.step_peak_bytes - a.state_bytes <= 4 * STEP_CHUNK < 4 * stepped


def test_fp32_gradients_an_offloaded_optimizer_and_megatron_fsdp_step_as_mist_s_runtime_does():
    prof = load_profile("l4")
    for plan in (_plan("bf16", 1, "fp32"), _plan("fp16", 1, optimizer_offload=0.5), _plan("fp16", 2)):
        mist = simulate_plan(plan, prof).stages
        megatron = simulate_plan(replace(plan, engine="megatron"), prof).stages
        assert [s.step_peak_bytes for s in mist] == [s.step_peak_bytes for s in megatron]
