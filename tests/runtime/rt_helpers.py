"""Shared helpers of the runtime tests: tiny models, plans, and the single-process reference."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed  # (imported before forking the workers: fast start)

from mist.models import CausalLM, init_weights
from mist.plan import Offload, Plan, StageStrategy
from mist.runtime import TrainConfig, spawn_local
from mist.runtime.data import SyntheticData
from mist.runtime.optimizer import lr_at
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

# the CPU profile, so that the simulator can price a plan run here (memory is device-independent)
CPU_PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "profiles" / "cpu-loop.json")

SEQ = 16

SPECS = {
    # GPT: LayerNorm, GELU, learned positions, biases, tied embeddings
    "gpt": ModelSpec(
        family="gpt",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=256,
        vocab_size=128,
        tie_embeddings=True,
        bias=True,
        max_position_embeddings=32,
        name="tiny-gpt",
    ),
    # Llama: RMSNorm, SwiGLU, rotary, grouped-query attention (2 KV heads for 4 query heads)
    "llama": ModelSpec(
        family="llama",
        num_layers=3,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        vocab_size=128,
        name="tiny-llama",
    ),
    # Falcon: parallel attention + MLP, one KV head (MQA: copied to both TP ranks), partial rotary
    "falcon": ModelSpec(
        family="falcon",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=1,
        ffn_hidden_size=256,
        vocab_size=128,
        rotary_fraction=0.5,
        name="tiny-falcon",
    ),
}

# Adam's update is lr·m/(√v + eps): with a tiny eps it turns rounding noise in gradients that are
# mathematically zero (e.g. the k bias, whose gradient vanishes under softmax shift invariance)
# into full-size updates. eps = 1e-4 bounds that amplification (|Δupdate| ≤ lr·|Δg|/eps) while
# typical gradients (~1e-3–1e-2 per element) still dominate it; the clip norm 0.5 is below every
# step's gradient norm, so clipping is always active.
CFG = dict(
    steps=3, lr=1e-2, warmup_steps=1, min_lr_ratio=0.1, weight_decay=0.1, max_grad_norm=0.5, eps=1e-4, seed=3, log=False
)
RTOL, ATOL = 1e-4, 1e-5


def make_plan(
    family: str,
    *,
    dp=1,
    tp=1,
    zero=0,
    G=1,
    b=2,
    recompute=0,
    offload=None,
    flash=True,
    param_dtype="fp32",
    compute_dtype=None,
    gpu="cpu",
    recompute_attention=False,
    recompute_activation=False,
    grad_dtype=None,
    sequence_parallel=False,
    cp=1,
) -> Plan:
    spec = SPECS[family]
    gpus = dp * tp * cp
    stage = StageStrategy(
        layers=spec.num_layers,
        nodes=1,
        gpus_per_node=gpus,
        micro_batch=b,
        dp=dp,
        tp=tp,
        zero=zero,
        recompute_layers=recompute,
        offload=Offload(**(offload or {})),
        recompute_attention=recompute_attention,
        recompute_activation=recompute_activation,
        sequence_parallel=sequence_parallel,
        cp=cp,
    )
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu=gpu, nodes=1, gpus_per_node=gpus),
        training=TrainingSpec(
            seq_len=SEQ,
            global_batch=b * dp * G,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype or param_dtype,
            flash_attention=flash,
            grad_dtype=grad_dtype,
        ),
        micro_batches=G,
        stages=(stage,),
    )


def run_plan(plan: Plan, **over) -> dict:
    """Train on forked worker processes (fast: this process already imported torch.distributed)."""
    cfg = TrainConfig(**{**CFG, **over})
    return spawn_local(plan, cfg, want_state=True, start_method="fork")


_REF: dict = {}


def reference(family: str, global_batch: int, flash: bool = True, **over) -> dict:
    """Plain PyTorch: the full model on the whole global batch, AdamW, clipping, the schedule."""
    key = (family, global_batch, flash, tuple(sorted(over.items())))
    if key in _REF:
        return _REF[key]
    c = {**CFG, **over}
    spec = SPECS[family]
    torch.manual_seed(0)
    model = CausalLM(spec, flash=flash, dtype=torch.float32)
    init_weights(model, c["seed"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=c["lr"],
        betas=(0.9, 0.95),
        eps=c["eps"],
        foreach=False,
    )
    data = SyntheticData(spec.vocab_size, SEQ, global_batch, c["seed"])
    losses, norms = [], []
    for step in range(c["steps"]):
        lr = lr_at(step, c["lr"], c["warmup_steps"], c["steps"], c["min_lr_ratio"])
        for grp in opt.param_groups:
            grp["lr"] = lr
        batch = data.global_batch(step)
        opt.zero_grad(set_to_none=True)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_grad_norm"])
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    out = {"losses": losses, "grad_norms": norms, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}
    _REF[key] = out
    return out


def compare(family: str, res: dict, ref: dict, rtol=RTOL, atol=ATOL) -> dict:
    """Assert losses, gradient norms and every updated weight match; return the max errors."""
    m = res["metrics"]
    loss_err = max(abs(a - b) for a, b in zip(m["losses"], ref["losses"]))
    norm_err = max(abs(a - b) / b for a, b in zip(m["grad_norms"], ref["grad_norms"]))
    assert len(m["losses"]) == len(ref["losses"])
    for a, b in zip(m["losses"], ref["losses"]):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=atol), (m["losses"], ref["losses"])
    for a, b in zip(m["grad_norms"], ref["grad_norms"]):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=atol), (m["grad_norms"], ref["grad_norms"])
    w_err = 0.0
    assert set(res["state"]) == set(ref["state"])
    for name, want in ref["state"].items():
        got = torch.from_numpy(res["state"][name])
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda s, n=name: f"{n}: {s}")
        w_err = max(w_err, (got - want).abs().max().item())
    return {"loss": loss_err, "grad_norm_rel": norm_err, "weight": w_err}


def compiled_plan(plan: Plan) -> Plan:
    """`plan` with its blocks compiled (`training.compile_blocks`), priced on the CPU profile."""
    return replace(
        plan, cluster=replace(plan.cluster, gpu=CPU_PROFILE), training=replace(plan.training, compile_blocks=True)
    )


def on_two_gloo_ranks(fn, timeout: float = 60.0) -> dict:
    """{rank: fn(rank)} from two forked processes joined by a gloo process group."""
    import queue as queue_mod
    import traceback

    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from mist.runtime.launch import free_port

    def worker(rank: int, port: int, q) -> None:
        try:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            try:
                out = fn(rank)
            finally:
                dist.destroy_process_group()
            q.put(("ok", rank, out))
        except BaseException:  # noqa: BLE001 - reported to the parent
            q.put(("error", rank, traceback.format_exc()))

    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            kind, rank, payload = q.get(timeout=timeout)
            assert kind == "ok", payload
            res[rank] = payload
    except queue_mod.Empty:
        pytest.fail("a gloo worker did not answer")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return res
