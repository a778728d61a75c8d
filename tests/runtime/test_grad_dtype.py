"""fp32 gradient accumulation with 16-bit parameters (`TrainingSpec.grad_dtype = "fp32"`).

Each micro-batch's bf16/fp16 gradients are added into an fp32 buffer (by per-parameter hooks
where it is the whole gradient on the device, else flattened) and the data-parallel reduction
runs on fp32 (as Megatron-LM does for bf16): checked on one `FlatUnit` over two gloo
ranks (the accumulator holds the exact fp32 sum of the bf16 gradients), through `mist train`
against the fp32 single-process reference (DP and PP with tied embeddings), and byte for byte
against the simulator's device-resident states.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from rt_helpers import CFG, SEQ, SPECS, make_plan, on_two_gloo_ranks, reference, run_plan
from torch import nn

from mist.plan import Offload, Plan, StageStrategy
from mist.runtime.flat import Comms, FlatUnit
from mist.runtime.memory import MemoryAccount
from mist.runtime.param_role import ParamRole
from mist.specs.training import ClusterSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ one FlatUnit, dp 2

G = 3  # micro-batches
SHAPES = ((5, 3), (8,))  # 23 elements: padded to Np = 24, shards of S = 12
N = sum(int(np.prod(s)) for s in SHAPES)
NP, S = 24, 12
# (zero, gradient offload fraction)
UNIT_CASES = ((0, 0.0), (1, 0.0), (2, 0.0), (0, 0.5), (2, 0.5))


def _coef(rank: int, g: int, shape) -> torch.Tensor:
    """bf16 gradients k · 2^-10 with |k| ≤ 255: exact in bf16, and every sum of G · dp of them is
    exact in fp32, while bf16 sums of them round."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * g + len(shape))
    k = torch.randint(-255, 256, shape, generator=gen)
    return (k.to(torch.float32) * 2.0**-10).to(torch.bfloat16)


def _run_unit(rank: int, zero: int, grads: float, grad_dtype) -> dict:
    mod = nn.Module()
    names = [f"p{i}" for i in range(len(SHAPES))]
    for name, shape in zip(names, SHAPES):
        setattr(mod, name, nn.Parameter(torch.randn(shape)))
    params = [(n, getattr(mod, n), [(mod, n)]) for n in names]
    infos = [ParamRole(decay=len(s) > 1) for s in SHAPES]
    mem = MemoryAccount()
    u = FlatUnit(
        "unit",
        params,
        infos,
        dtype=torch.bfloat16,
        device="cpu",
        comms=Comms(2, rank, dist.group.WORLD),
        zero=zero,
        weights=0.0,
        grads=grads,
        optimizer=0.0,
        micro_batches=G,
        memory=mem,
        grad_dtype=grad_dtype,
    )
    persistent = mem.persistent
    for g in range(G):
        u.start_micro_batch(g, last=g == G - 1)
        loss = sum((getattr(mod, n) * _coef(rank, g, s)).sum() for n, s in zip(names, SHAPES))
        loss.backward()
        u.finish_micro_batch()
    og = u.opt_grad
    assert og is u.acc and mem.transient == 0
    return {
        "dtype": str(og.dtype),
        "grad_views": u.grad_views,
        "in_place": u.in_place,
        "L": u.L,
        "values": og.read(0, u.L, "cpu", torch.float32).clone().numpy(),
        "acc_device_bytes": u.acc.device_bytes,
        "acc_dev_len": u.acc.dev_len,
        "persistent": persistent,
        "peak_over_persistent": mem.peak - persistent,
    }


def _all_units(rank: int) -> dict:
    return {
        (z, go, str(gd)): _run_unit(rank, z, go, gd) for z, go in UNIT_CASES for gd in (torch.bfloat16, torch.float32)
    }


@pytest.fixture(scope="module")
def unit_results():
    return on_two_gloo_ranks(_all_units)


def _reference_flat() -> np.ndarray:
    """The dp-averaged sum of every rank's micro-batch gradients, in float64 (exact here)."""
    flat = np.zeros(NP)
    for r in range(2):
        for g in range(G):
            flat[:N] += np.concatenate([_coef(r, g, s).double().numpy().ravel() for s in SHAPES])
    return flat / 2


@pytest.mark.parametrize("zero,grads", UNIT_CASES)
def test_fp32_accumulator_holds_the_exact_sum_of_the_bf16_gradients(unit_results, zero, grads):
    want = _reference_flat()
    assert np.all(want.astype(np.float32) == want)  # representable: the fp32 sum is exact
    bf16_inexact = False
    for rank in range(2):
        fp32, bf16 = (unit_results[rank][(zero, grads, d)] for d in ("torch.float32", "torch.bfloat16"))
        lo = rank * S if zero >= 1 else 0
        ref = want[lo : lo + fp32["L"]]
        # fp32: an fp32 buffer (never .grad views), exactly the sum; where it is the whole flat
        # gradient on the device, each .grad is added into it by a hook (nothing flattened),
        # otherwise the flat gradient is counted with its own bytes: Np fp32 elements
        in_place = zero <= 1 and grads == 0.0
        assert fp32["dtype"] == "torch.float32" and not fp32["grad_views"]
        assert fp32["in_place"] == in_place
        assert np.array_equal(fp32["values"].astype(np.float64), ref), (zero, grads, rank)
        assert fp32["peak_over_persistent"] == (0 if in_place else NP * 4)
        # bf16 (grad_dtype = the parameter dtype): the old behaviour — a bf16 buffer, the .grad
        # views of it where it is the whole flat gradient on the device, rounded sums
        assert bf16["dtype"] == "torch.bfloat16"
        assert bf16["grad_views"] == (zero <= 1 and grads == 0.0)
        assert bf16["peak_over_persistent"] == (0 if bf16["grad_views"] else NP * 2)
        np.testing.assert_allclose(bf16["values"], ref, rtol=2**-6, atol=2**-10)
        bf16_inexact |= not np.array_equal(bf16["values"].astype(np.float64), ref)
        # the accumulator's device part: twice the bytes of the bf16 one, same elements
        assert fp32["acc_dev_len"] == bf16["acc_dev_len"]
        assert fp32["acc_device_bytes"] == 2 * bf16["acc_device_bytes"] == 4 * fp32["acc_dev_len"]
        assert fp32["persistent"] - bf16["persistent"] == 2 * fp32["acc_dev_len"]
    assert bf16_inexact  # the values are chosen so that bf16 accumulation rounds


# ------------------------------------------------------------------ mist train, end to end

SPECS.setdefault("gpt4", replace(SPECS["gpt"], num_layers=4, name="tiny-gpt4"))


def _pp_plan(family: str, layers, *, dp=1, G=2, b=2, zero=0, dtype="bf16", grad_dtype="fp32", gpu="cpu") -> Plan:
    spec = SPECS[family]
    sts = tuple(
        StageStrategy(layers=n, nodes=1, gpus_per_node=dp, micro_batch=b, dp=dp, tp=1, zero=zero, offload=Offload())
        for n in layers
    )
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu=gpu, nodes=1, gpus_per_node=dp * len(layers)),
        training=TrainingSpec(
            seq_len=SEQ, global_batch=b * dp * G, param_dtype=dtype, compute_dtype=dtype, grad_dtype=grad_dtype
        ),
        micro_batches=G,
        stages=sts,
    )


E2E = [
    # ZeRO 1 with G > 1: bf16 gradients would accumulate in place in .grad views; fp32 flattens
    ("llama", "dp2-zero1-G2", lambda: make_plan("llama", dp=2, zero=1, G=2, param_dtype="bf16", grad_dtype="fp32")),
    # ZeRO 2, half of the blocks' gradient accumulators on the host (fp32 there too)
    (
        "falcon",
        "dp2-zero2-G2-grads0.5",
        lambda: make_plan("falcon", dp=2, zero=2, G=2, param_dtype="bf16", grad_dtype="fp32", offload=dict(grads=0.5)),
    ),
    # fp16 with dynamic loss scaling: the scaled fp16 gradients summed in fp32
    ("gpt", "dp2-zero0-G2-fp16", lambda: make_plan("gpt", dp=2, G=2, param_dtype="fp16", grad_dtype="fp32")),
    # pipeline, tied embeddings on the first and the last stage (summed in fp32 after the step)
    ("gpt4", "pp2-3+1-G3", lambda: _pp_plan("gpt4", (3, 1), G=3)),
    ("gpt", "pp2xdp2-zero1", lambda: _pp_plan("gpt", (1, 1), dp=2, zero=1)),
]


@pytest.mark.parametrize("family,name,make", E2E, ids=[n for _, n, _ in E2E])
def test_fp32_gradients_with_16bit_weights_track_fp32(family, name, make):
    """Same tolerance as `test_low_precision_tracks_fp32`: losses within 1e-3 (relative) of the
    fp32 reference, every weight within 3 · lr, no skipped step."""
    plan = make()
    assert plan.training.grad_dtype == "fp32" and plan.training.param_dtype in ("bf16", "fp16")
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch)
    m = res["metrics"]
    assert m["skipped_steps"] == 0
    assert all(np.isfinite(m["losses"])) and len(m["losses"]) == CFG["steps"]
    for got, want in zip(m["losses"], ref["losses"]):
        assert got == pytest.approx(want, rel=1e-3)
    for got, want in zip(m["grad_norms"], ref["grad_norms"]):
        assert got == pytest.approx(want, rel=2e-2)
    for n, want in ref["state"].items():
        assert (torch.from_numpy(res["state"][n]) - want).abs().max() < 3 * CFG["lr"], n


# ------------------------------------------------------------------ states vs. the simulator

STATES = [
    ("gpt-dp2-zero1-G2", lambda gd: make_plan("gpt", dp=2, zero=1, G=2, param_dtype="bf16", grad_dtype=gd)),
    (
        "llama-dp2-zero2-G2-offload",
        lambda gd: make_plan(
            "llama",
            dp=2,
            zero=2,
            G=2,
            param_dtype="bf16",
            grad_dtype=gd,
            offload=dict(grads=0.5, weights=0.5, optimizer=0.5),
        ),
    ),
    ("gpt-pp2-zero0", lambda gd: _pp_plan("gpt", (1, 1), grad_dtype=gd)),
]


@pytest.mark.parametrize("name,make", STATES, ids=[n for n, _ in STATES])
def test_device_states_match_the_simulator_with_fp32_gradients(name, make):
    """`mist validate`'s state bytes: the runtime's device-resident states equal the simulator's
    to the byte, and the fp32 gradient buffers are twice the bf16 ones (4 bytes × the
    simulator's element count)."""
    from mist.hardware import load_profile
    from mist.simulate.plan_sim import simulate_plan

    prof = load_profile(str(ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json"))
    runs = {}
    for gd in ("fp32", None):
        plan = make(gd)
        meas = run_plan(plan, steps=1)["metrics"]["stages"]
        pred = simulate_plan(plan, prof).stages
        runs[gd] = (meas, pred)
        for i, (ms, ps) in enumerate(zip(meas, pred)):
            assert ms["state_bytes"] == ps.state_bytes, (gd, i, ms["state_bytes"], ps.state_bytes)
            assert ms["host_state_bytes"] == ps.host_state_bytes, (gd, i)
    for (m32, p32), (m16, p16) in zip(zip(*runs["fp32"]), zip(*runs[None])):
        g32, g16 = p32.memory_breakdown["grads_bytes"], p16.memory_breakdown["grads_bytes"]
        assert g16 > 0 and g32 == 2 * g16  # 4 bytes against 2 for the same elements
        assert m32["state_bytes"] - m16["state_bytes"] == g32 - g16
