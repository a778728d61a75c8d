"""Distributed training equals single-process training.

Every plan below runs 3 steps of AdamW (clipping always active, warm-up + cosine schedule) on
forked CPU worker processes with gloo, fp32; the losses, the global gradient norms and every
updated weight must equal plain PyTorch on the same full model and the same global batch
(rtol 1e-4, atol 1e-5; measured errors are ≤ 1e-6 on the weights and ≤ 5e-7 on the losses).
Tiny models: GPT (biases, tied embeddings, learned positions), Llama (GQA 4/2) and Falcon
(parallel block, MQA: the single KV head is copied to both TP ranks, partial rotary).
"""

import pytest
import torch
from rt_helpers import CFG, compare, make_plan, reference, run_plan

FAMILIES = ("gpt", "llama", "falcon")

CASES = [
    # layouts, every family
    *[(f, "dp2", dict(dp=2)) for f in FAMILIES],
    *[(f, "tp2", dict(tp=2)) for f in FAMILIES],
    *[(f, "tp2xdp2", dict(tp=2, dp=2)) for f in FAMILIES],
    # ZeRO over dp 2, every family
    *[(f, f"zero{z}", dict(dp=2, zero=z)) for f in FAMILIES for z in (1, 2, 3)],
    # recomputation of the last blocks
    ("gpt", "recompute1-tp2", dict(tp=2, recompute=1)),
    ("llama", "recompute-all", dict(recompute=3)),
    ("falcon", "recompute2-zero1", dict(dp=2, zero=1, recompute=2)),
    # attention recomputation of the other blocks (non-flash: the materialised scores are dropped)
    ("llama", "attention-recompute1-tp2-nonflash", dict(tp=2, recompute=1, recompute_attention=True, flash=False)),
    (
        "gpt",
        "attention-recompute-activations0.5-nonflash",
        dict(dp=2, recompute_attention=True, flash=False, offload=dict(activations=0.5)),
    ),
    # MLP activation recomputation of the other blocks (fc2 re-runs it in backward)
    ("gpt", "activation-recompute1-dp2", dict(dp=2, recompute=1, recompute_activation=True)),
    (
        "llama",
        "activation-recompute-tp2-activations0.5",
        dict(tp=2, recompute_activation=True, offload=dict(activations=0.5)),
    ),
    (
        "falcon",
        "attention+activation-recompute-tp2-nonflash",
        dict(tp=2, recompute_attention=True, recompute_activation=True, flash=False),
    ),
    # G > 1 micro-batches (ZeRO 0/1 reduce once at the last, ZeRO 2 every micro-batch)
    ("gpt", "G4", dict(G=4)),
    ("llama", "G2-zero2", dict(G=2, dp=2, zero=2)),
    ("falcon", "G2-zero0", dict(G=2, dp=2)),
    # each offload kind at 0.5 and 1.0
    ("gpt", "weights0.5-zero0", dict(dp=2, offload=dict(weights=0.5))),
    ("llama", "weights1.0-zero3", dict(dp=2, zero=3, offload=dict(weights=1.0))),
    ("falcon", "grads0.5-zero2-G2", dict(dp=2, zero=2, G=2, offload=dict(grads=0.5))),
    ("gpt", "grads1.0-zero1-G2", dict(dp=2, zero=1, G=2, offload=dict(grads=1.0))),
    ("llama", "optimizer0.5-zero1", dict(dp=2, zero=1, offload=dict(optimizer=0.5))),
    ("falcon", "optimizer1.0-zero0", dict(dp=2, offload=dict(optimizer=1.0))),
    ("gpt", "activations0.5-tp2", dict(tp=2, offload=dict(activations=0.5))),
    ("llama", "activations1.0-recompute1", dict(dp=2, zero=2, recompute=1, offload=dict(activations=1.0))),
    # everything at once
    *[
        (
            f,
            "mixed",
            dict(
                dp=2,
                tp=2,
                zero=3,
                G=2,
                recompute=1,
                offload=dict(weights=0.5, grads=0.5, optimizer=0.5, activations=0.5),
            ),
        )
        for f in FAMILIES
    ],
    (
        "llama",
        "mixed-zero1-all-offloaded",
        dict(dp=2, zero=1, G=2, recompute=1, offload=dict(weights=1.0, grads=1.0, optimizer=1.0, activations=1.0)),
    ),
    ("falcon", "zero2-weights1.0-tp2xdp2-nonflash", dict(dp=2, tp=2, zero=2, flash=False, offload=dict(weights=1.0))),
]


@pytest.mark.parametrize("family,name,kw", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_matches_single_process(family, name, kw):
    plan = make_plan(family, **kw)
    res = run_plan(plan)
    ref = reference(family, plan.training.global_batch, plan.training.flash_attention)
    assert all(n > CFG["max_grad_norm"] for n in ref["grad_norms"])  # clipping is exercised
    compare(family, res, ref)
    stage = res["metrics"]["stages"][0]
    off = kw.get("offload", {})
    if any(off.get(k) for k in ("weights", "grads", "optimizer")):
        assert stage["host_state_bytes"] > 0
    else:
        assert stage["host_state_bytes"] == 0
    assert (stage["activation_bytes_offloaded"] > 0) == bool(off.get("activations"))


def test_updates_are_large_against_the_tolerance():
    """A wrong update would show: most weights move by far more than the tolerance."""
    ref = reference("llama", 2)
    from rt_helpers import ATOL, SPECS

    from mist.models import CausalLM, init_weights

    init = CausalLM(SPECS["llama"], dtype=torch.float32)
    init_weights(init, CFG["seed"])
    moved = torch.cat([(ref["state"][n] - p.detach()).abs().flatten() for n, p in init.named_parameters()])
    assert (moved > 100 * ATOL).float().mean() > 0.9


def test_two_runs_give_identical_losses_and_weights():
    plan = make_plan(
        "falcon",
        dp=2,
        tp=2,
        zero=3,
        G=2,
        recompute=1,
        offload=dict(weights=0.5, grads=0.5, optimizer=0.5, activations=0.5),
    )
    a, b = run_plan(plan), run_plan(plan)
    assert a["metrics"]["losses"] == b["metrics"]["losses"]
    assert a["metrics"]["grad_norms"] == b["metrics"]["grad_norms"]
    for n in a["state"]:
        assert (a["state"][n] == b["state"][n]).all(), n


@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16")])
def test_low_precision_tracks_fp32(dtypes):
    """bf16 / fp16 (dynamic loss scaling) working weights with fp32 masters, and fp32 weights with
    bf16 autocast: the losses stay within 1e-3 of the fp32 reference and no step is skipped."""
    plan = make_plan("llama", dp=2, zero=2, G=2, param_dtype=dtypes[0], compute_dtype=dtypes[1])
    res = run_plan(plan)
    ref = reference("llama", plan.training.global_batch)
    m = res["metrics"]
    assert m["skipped_steps"] == 0
    for got, want in zip(m["losses"], ref["losses"]):
        assert got == pytest.approx(want, rel=1e-3)
    for n, want in ref["state"].items():
        assert (torch.from_numpy(res["state"][n]) - want).abs().max() < 3 * CFG["lr"]


def test_offloading_and_zero3_lower_the_accounted_peak():
    base = run_plan(make_plan("gpt"))["metrics"]["stages"][0]
    off = run_plan(make_plan("gpt", offload=dict(weights=1.0, grads=1.0, optimizer=1.0, activations=1.0)))["metrics"][
        "stages"
    ][0]
    assert off["peak_memory_bytes"] < base["peak_memory_bytes"]
    assert off["host_state_bytes"] > 0 and base["host_state_bytes"] == 0
    assert "accounted" in base["peak_memory_source"]
    dp0 = run_plan(make_plan("llama", dp=2))["metrics"]["stages"][0]["peak_memory_bytes"]
    dp3 = run_plan(make_plan("llama", dp=2, zero=3))["metrics"]["stages"][0]["peak_memory_bytes"]
    assert dp3 < dp0
