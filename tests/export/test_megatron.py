"""`mist export --to megatron`: the launch script, its arguments, refusals, approximation, and
Megatron's own argument validation on the exported arguments.

The framework tests run megatron-core 0.19.2's `parse_args`, `validate_args` and
`core_transformer_config_from_args` (tests/export/megatron_check.py, in a subprocess). That version
declares Python >= 3.12; they run it from the wheel that .ci/targets/megatron.sh unzips into
.ci/vendor/, under this project's Python 3.11 with a one-line `typing.override` shim. If it is not
unpacked these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mist.export import export_plan
from mist.export import megatron as mg
from mist.export.common import PLACEHOLDER
from mist.export.records import NotExpressible
from mist.plan import Offload, Plan, StageStrategy, load_plan
from mist.rules.interleaved_order import chunk_of
from mist.specs.presets import PRESETS
from mist.specs.training import ClusterSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CHECKER = Path(__file__).with_name("megatron_check.py")


def make_plan(
    model: str,
    nodes: int,
    gpn: int,
    layers: list[int],
    tp: int,
    mb: int,
    G: int,
    zero: int = 0,
    recompute: list[int] | None = None,
    optimizer_offload: float = 0.0,
    attention: bool = False,
    dtype: str = "bf16",
    grad_dtype: str | None = None,
    seq: int = 2048,
    chunks: list[tuple[int, ...]] | None = None,
    sp: bool | None = None,
    cp: int = 1,
) -> Plan:
    """A plan with one mesh on every stage (the GPUs split evenly over len(layers) stages);
    `chunks` (blocks per model chunk of each stage) makes it interleaved. Sequence parallelism
    (`sp`) defaults to on where tp > 1, as Megatron-LM's recipes run tensor parallelism."""
    S, world = len(layers), nodes * gpn
    g = world // S
    s_nodes, s_gpn = (1, g) if g <= gpn else (g // gpn, gpn)
    dp = g // (tp * cp)
    stages = tuple(
        StageStrategy(
            layers=L,
            nodes=s_nodes,
            gpus_per_node=s_gpn,
            micro_batch=mb,
            dp=dp,
            tp=tp,
            zero=zero,
            recompute_layers=(recompute or [0] * S)[i],
            offload=Offload(optimizer=optimizer_offload),
            recompute_attention=attention,
            chunk_layers=chunks[i] if chunks else None,
            sequence_parallel=tp > 1 if sp is None else sp,
            cp=cp,
        )
        for i, L in enumerate(layers)
    )
    if grad_dtype is None and dtype != "fp32":  # as the target space costs 16-bit parameters: fp32 gradients
        grad_dtype = "fp32"
    training = TrainingSpec(
        seq_len=seq, global_batch=mb * dp * G, param_dtype=dtype, compute_dtype=dtype, grad_dtype=grad_dtype
    )
    v = len(chunks[0]) if chunks else 1
    return Plan(PRESETS[model], ClusterSpec("h100", nodes, gpn), training, G, stages, model_ref=model, virtual_stages=v)


# GPT, Llama with GQA (Llama 3 8B, 70B), paper Llama with partial rotary; × tp/pp/dp × recompute × ZeRO × offload
MATRIX = {
    # context parallelism: 2 ranks of each sequence × tp 2 with sequence parallelism, 2 data replicas
    "llama3-gqa-pp2-cp2-tp2-zero1": make_plan("llama3-8b", 2, 8, [16, 16], 2, 1, 16, zero=1, seq=32768, cp=2),
    "gpt-pp2-tp2-block-zero1": make_plan("gpt3-1.3b", 1, 8, [12, 12], 2, 2, 8, zero=1, recompute=[4, 4]),
    "gpt-pp4-uneven-selective-fp16": make_plan(
        "gpt3-1.3b", 2, 8, [5, 7, 6, 6], 2, 1, 16, attention=True, dtype="fp16", grad_dtype="fp32"
    ),
    "gpt-pp1-dp4-fp32": make_plan("gpt3-2.7b", 1, 4, [32], 1, 4, 2, dtype="fp32"),
    # 16-bit gradients: fp16's default, bf16 with --grad-reduce-in-bf16
    "gpt-pp2-dp4-fp16-grads": make_plan("gpt3-1.3b", 1, 8, [12, 12], 1, 2, 8, zero=1, dtype="fp16", grad_dtype="fp16"),
    "llama3-gqa-pp1-tp2-bf16-grads": make_plan("llama3-8b", 1, 8, [32], 2, 1, 8, zero=1, grad_dtype="bf16"),
    "llama3-gqa-pp2-tp4-offload": make_plan(
        "llama3-8b", 2, 8, [15, 17], 4, 1, 32, zero=1, recompute=[15, 16], optimizer_offload=0.5
    ),
    "llama3-gqa-pp1-tp8-zero2": make_plan("llama3-8b", 1, 8, [32], 8, 2, 4, zero=2, seq=8192),
    "llama-paper-pp4-zero3-fp32grads": make_plan(
        "llama-7b", 4, 8, [7, 9, 8, 8], 2, 1, 16, zero=3, recompute=[3, 3, 3, 3], grad_dtype="fp32"
    ),
    "llama70b-gqa-pp8-tp4-full-offload": make_plan(
        "llama3-70b", 4, 8, [10] * 8, 4, 1, 64, zero=1, recompute=[10] * 8, optimizer_offload=1.0, seq=4096
    ),
    # interleaved 1F1B: 4 ranks × 2 equal chunks, 1 block of every chunk recomputed
    "gpt-pp4-v2-block": make_plan("gpt3-1.3b", 1, 8, [6] * 4, 2, 1, 8, zero=1, recompute=[2] * 4, chunks=[(3, 3)] * 4),
    # interleaved 1F1B: 2 ranks × 4 uneven chunks, up to 4 blocks of every chunk recomputed, offload
    "llama3-gqa-pp2-v4-uneven": make_plan(
        "llama3-8b",
        2,
        8,
        [16, 16],
        4,
        1,
        8,
        zero=1,
        recompute=[15, 15],
        optimizer_offload=0.5,
        chunks=[(3, 5, 4, 4), (5, 3, 4, 4)],
    ),
}


def exported(plan: Plan, tmp_path: Path, name: str = "out"):
    done, ran = export_plan(plan, "megatron", tmp_path / name)
    return done, tmp_path / name


def script_argv(out_dir: Path, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Run the written script with a fake `torchrun` on PATH: the arguments it hands pretrain_gpt.py
    and the CUDA_DEVICE_MAX_CONNECTIONS it exported."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    tr = fake / "torchrun"
    tr.write_text('#!/usr/bin/env bash\necho "CDMC=${CUDA_DEVICE_MAX_CONNECTIONS-unset}"\nprintf "%s\\n" "$@"\n')
    tr.chmod(tr.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env["PATH"] = f"{fake}:{env['PATH']}"
    p = subprocess.run(["bash", str(out_dir / mg.SCRIPT)], capture_output=True, text=True, env=env, check=True)
    lines = p.stdout.splitlines()
    argv = lines[1:]
    entry = argv.index(mg.ENTRY)
    return argv[entry + 1 :], {"CDMC": lines[0].split("=", 1)[1]}


def runnable(args: list[str], plan: Plan) -> list[str]:
    """The exported arguments with the data/tokenizer/checkpoint placeholders swapped for Megatron's
    mock data and null tokenizer (the only edit the tests make)."""
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--data-path", "--save", "--load", "--split", "--tokenizer-model", "--tokenizer-type"):
            i += 2
            continue
        out.append(args[i])
        i += 1
    assert PLACEHOLDER not in out
    return out + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(plan.model.vocab_size)]


def megatron_validate(cases: list[dict]) -> list[dict]:
    """Megatron's own checks on each case, in one subprocess; fails loudly if Megatron is missing."""
    p = subprocess.run(
        [sys.executable, str(CHECKER)], input=json.dumps(cases), capture_output=True, text=True, timeout=240
    )
    assert p.returncode == 0, f"Megatron checker failed (is .ci/targets/megatron.sh run?):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout)


# ------------------------------------------------------------------------ arguments (no framework)
def test_gpt_script_args(tmp_path):
    plan = MATRIX["gpt-pp2-tp2-block-zero1"]
    done, out = exported(plan, tmp_path)
    assert done.files == (mg.SCRIPT,) and done.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    a = " ".join(done.args)
    for flag in (
        "--num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16",
        "--position-embedding-type learned_absolute --normalization LayerNorm",
        "--micro-batch-size 2 --global-batch-size 32",
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*12|t*12L",
        "--sequence-parallel --use-distributed-optimizer",
        "--recompute-granularity full --recompute-method block --recompute-num-layers 4",
        f"--data-path {PLACEHOLDER}",
    ):
        assert flag in a
    assert "--swiglu" not in a and "--group-query-attention" not in a


def test_sequence_parallel_is_the_plans():
    """--sequence-parallel exactly when the plan's stages use it; stages that differ are refused
    (one flag for the pipeline), and the nearest plan turns it on wherever tp > 1."""
    on = make_plan("gpt3-1.3b", 1, 8, [12, 12], tp=2, mb=2, G=8)
    off = make_plan("gpt3-1.3b", 1, 8, [12, 12], tp=2, mb=2, G=8, sp=False)
    assert "--sequence-parallel" in mg.parallel_args(on)
    assert "--sequence-parallel" not in mg.parallel_args(off) and mg.problems(off) == []
    mixed = replace(off, stages=(on.stages[0], off.stages[1]))
    (why,) = mg.problems(mixed)
    assert "stage 1 does not use sequence parallelism but stage 0 does" in why
    assert all(s.sequence_parallel for s in mg.nearest(mixed).stages)


def test_context_parallel_args():
    plan = MATRIX["llama3-gqa-pp2-cp2-tp2-zero1"]
    assert mg.problems(plan) == []
    a = " ".join(mg.parallel_args(plan))
    assert "--tensor-model-parallel-size 2" in a and "--context-parallel-size 2 --cp-comm-type allgather" in a


def test_llama_gqa_args():
    a = " ".join(mg.pretrain_args(MATRIX["llama3-gqa-pp2-tp4-offload"]))
    for flag in (
        "--group-query-attention --num-query-groups 8",
        "--position-embedding-type rope --normalization RMSNorm --swiglu",
        "--untie-embeddings-and-output-weights",
        "--pipeline-model-parallel-layout Et*15|t*17L",
        "--recompute-num-layers 16",  # 16 ≥ stage 0's 15: all of stage 0, 16 of stage 1
        "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --use-precision-aware-optimizer",
    ):
        assert flag in a


def test_zero_levels_map_to_distributed_optimizer_and_megatron_fsdp():
    z2 = mg.pretrain_args(MATRIX["llama3-gqa-pp1-tp8-zero2"])
    assert " ".join(z2).count("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads ") == 1
    assert "--ckpt-format" in z2 and mg.environment(MATRIX["llama3-gqa-pp1-tp8-zero2"]) == {}
    z3 = " ".join(mg.pretrain_args(MATRIX["llama-paper-pp4-zero3-fp32grads"]))
    assert "--data-parallel-sharding-strategy optim_grads_params" in z3 and "--rotary-percent 0.25" in z3
    assert "--use-distributed-optimizer" not in " ".join(mg.pretrain_args(MATRIX["gpt-pp1-dp4-fp32"]))
    # Llama 3's rotary base; Megatron's default (10000) is left implicit
    assert "--rotary-base 500000" in " ".join(mg.pretrain_args(MATRIX["llama3-gqa-pp1-tp8-zero2"]))
    assert "--rotary-base" not in z3


@pytest.mark.parametrize("name", ["gpt-pp2-tp2-block-zero1", "llama3-gqa-pp1-tp8-zero2", "gpt-pp1-dp4-fp32"])
def test_args_are_exactly_what_the_script_passes(name, tmp_path):
    done, out = exported(MATRIX[name], tmp_path)
    argv, env = script_argv(out, tmp_path)
    assert argv == list(done.args)
    assert env["CDMC"] == done.env.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")


def test_interleaved_plan_is_a_layout_of_chunks():
    plan = MATRIX["llama3-gqa-pp2-v4-uneven"]
    a = mg.pretrain_args(plan)
    # segment c·pp + r is chunk c of rank r
    assert a[a.index("--pipeline-model-parallel-layout") + 1] == "Et*3|t*5|t*5|t*3|t*4|t*4|t*4|t*4L"
    assert a[a.index("--recompute-num-layers") + 1] == "4"  # per chunk: 3+4+4+4 and 4+3+4+4 = 15
    assert mg.problems(plan) == [] and mg.nearest(plan) == plan
    for flag in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"):
        assert flag not in a  # Megatron takes one of the three; the layout says v and the chunks


def test_interleaved_recompute_that_no_n_gives_is_refused_and_rounded_up():
    plan = MATRIX["llama3-gqa-pp2-v4-uneven"]
    odd = replace(plan, stages=(replace(plan.stages[0], recompute_layers=14), plan.stages[1]))  # 3+4+4+3
    (why,) = mg.problems(odd)
    assert why.startswith("stage 0 recomputes 14 of its 16 blocks (3+4+4+3 of its chunks of 3+5+4+4)")
    assert "every model chunk (--recompute-num-layers)" in why
    near = mg.nearest(odd)
    assert [s.recompute_layers for s in near.stages] == [15, 15] and mg.problems(near) == []
    assert near.virtual_stages == 4


def test_refusals_name_stage_and_knob():
    base = MATRIX["gpt-pp2-tp2-block-zero1"]
    s0, s1 = base.stages

    def with_s1(**kw):
        return replace(base, stages=(s0, replace(s1, **kw)))

    cases = {
        "stage 1 recomputes 0 of its 12 blocks but stage 0 recomputes 4 (recompute_layers)": with_s1(
            recompute_layers=0
        ),
        "stage 1 uses ZeRO-3 but stage 0 uses ZeRO-1": with_s1(zero=3),
        "stage 1 offloads 50% of its weights (offload.weights 0.5)": with_s1(offload=Offload(weights=0.5)),
        "stage 1 offloads 30% of its activations (offload.activations 0.3)": with_s1(offload=Offload(activations=0.3)),
        "stage 1 offloads 0.2 of its optimizer state but stage 0 offloads 0": with_s1(offload=Offload(optimizer=0.2)),
        "stage 1 recomputes only its MLP activation (recompute_activation)": with_s1(
            recompute_layers=4, recompute_activation=True
        ),
        "stage 1 recomputes the attention core of its other blocks (recompute_attention)": with_s1(
            recompute_layers=4, recompute_attention=True
        ),
    }
    for sentence, plan in cases.items():
        found = mg.problems(plan)
        assert any(sentence in p for p in found), (sentence, found)
    for plan in MATRIX.values():
        assert mg.problems(plan) == []


def test_precision_and_selective_recompute():
    plan = MATRIX["gpt-pp1-dp4-fp32"]
    mixed = replace(plan, training=replace(plan.training, param_dtype="fp32", compute_dtype="bf16"))
    assert "(training.param_dtype)" in mg.problems(mixed)[0]
    assert mg.nearest(mixed).training.param_dtype == "bf16" and mg.problems(mg.nearest(mixed)) == []
    sel = MATRIX["gpt-pp4-uneven-selective-fp16"]
    some = replace(sel, stages=(replace(sel.stages[0], recompute_attention=False), *sel.stages[1:]))
    assert (
        "stage 0 does not recompute the attention core (recompute_attention) but stage 1 does" in mg.problems(some)[0]
    )
    assert all(s.recompute_attention for s in mg.nearest(some).stages)
    a = " ".join(mg.pretrain_args(sel))
    assert "--recompute-granularity selective --recompute-modules core_attn" in a and "--fp16" in a
    assert "--accumulate-allreduce-grads-in-fp32" in a


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_gradients_export_with_megatron_s_own_flags(dtype):
    """Megatron keeps 16-bit gradients by default with fp16 and with `--grad-reduce-in-bf16` with
    bf16 (whose default is fp32): both export as they are, and `nearest` keeps them."""
    plan = make_plan("gpt3-1.3b", 1, 8, [24], 1, 2, 4, zero=1, dtype=dtype)
    low = replace(plan, training=replace(plan.training, grad_dtype=dtype))
    assert mg.problems(low) == [] and mg.nearest(low).training == low.training
    args = mg.pretrain_args(low)
    assert "--accumulate-allreduce-grads-in-fp32" not in args
    assert ("--grad-reduce-in-bf16" in args) == (dtype == "bf16")
    fp32 = mg.pretrain_args(plan)  # fp32 gradients
    assert ("--accumulate-allreduce-grads-in-fp32" in fp32) == (dtype == "fp16") and "--grad-reduce-in-bf16" not in fp32


def test_falcon_is_refused():
    plan = make_plan("falcon-7b", 1, 8, [16, 16], 1, 1, 8)
    assert "falcon" in mg.problems(plan)[0]
    with pytest.raises(NotExpressible, match="Megatron-LM"):
        mg.nearest(plan)


def test_nearest_of_a_mixed_plan_runs_and_keeps_gpus_and_batch():
    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")
    assert mg.problems(plan)
    near = mg.nearest(plan)
    assert mg.problems(near) == []
    assert near.training.global_batch == plan.training.global_batch
    assert sum(s.gpus for s in near.stages) == plan.cluster.world_size
    assert [s.layers for s in near.stages] == [s.layers for s in plan.stages]
    s = near.stages[0]
    # memory-safe rounding: the most recomputation, ZeRO and optimizer offload of any stage
    assert (s.zero, s.offload.optimizer) == (2, 0.875)
    assert [x.recompute_layers for x in near.stages] == [7, 7, 7, 7]
    assert all(x.offload.activations == 0 for x in near.stages)


def test_nearest_of_an_exportable_plan_is_itself():
    for plan in MATRIX.values():
        assert mg.nearest(plan) == plan


# --------------------------------------------------------------------------------------- CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mist", "export", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_json_refusal_and_approximate(tmp_path):
    plan = MATRIX["llama3-gqa-pp2-tp4-offload"]
    plan.save(tmp_path / "plan.json")
    p = run_cli(str(tmp_path / "plan.json"), "--to", "megatron", "-o", str(tmp_path / "a"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["target"] == "megatron" and doc["files"] == [mg.SCRIPT]
    assert doc["args"] == mg.pretrain_args(plan) and doc["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert (tmp_path / "a" / mg.SCRIPT).is_file()

    mixed = str(EXAMPLES / "llama-7b-8xl4-mixed.json")
    p = run_cli(mixed, "--to", "megatron", "-o", str(tmp_path / "b"))
    assert p.returncode == 2
    msg = p.stderr.strip()
    assert msg.count("\n") == 0 and "stage 3 has dp 1 but stage 0 has 2" in msg and "--approximate" in msg

    p = run_cli(mixed, "--to", "megatron", "-o", str(tmp_path / "c"), "--approximate", "--json")
    assert p.returncode == 0, p.stderr
    assert "--recompute-num-layers" in json.loads(p.stdout)["args"]
    assert "approximated: the plan predicts" in p.stderr


# ------------------------------------------------------------------ Megatron's own validation
def _case(plan: Plan, args: list[str], env: dict[str, str]) -> dict:
    return {"args": runnable(args, plan), "world_size": plan.cluster.world_size, "env": env}


def test_megatron_accepts_the_matrix_and_its_negative_cases(tmp_path):
    """One Megatron process checks every exported plan (its tp/pp/dp, micro-batch, number of
    micro-batches and per-stage layers must be the plan's) and the cases it must reject."""
    names, cases, plans = [], [], []
    for name, plan in MATRIX.items():
        done, _ = exported(plan, tmp_path, name)
        names.append(name)
        plans.append(plan)
        cases.append(_case(plan, list(done.args), dict(done.env)))

    offload = MATRIX["llama3-gqa-pp2-tp4-offload"]
    off_args = mg.pretrain_args(offload)
    fsdp = MATRIX["llama3-gqa-pp1-tp8-zero2"]
    uneven = MATRIX["gpt-pp4-uneven-selective-fp16"]
    bad_layout = [a.replace("Et*5|", "Et*4|") for a in mg.pretrain_args(uneven)]
    interleaved = MATRIX["llama3-gqa-pp2-v4-uneven"]
    negatives = {
        # we always pair the offload fraction with the precision-aware optimizer: Megatron requires it
        "in conjunction with `--use-precision-aware-optimizer`": _case(
            offload, [a for a in off_args if a != "--use-precision-aware-optimizer"], mg.environment(offload)
        ),
        # we export CUDA_DEVICE_MAX_CONNECTIONS=1 for tp > 1: Megatron asserts it
        "CUDA_DEVICE_MAX_CONNECTIONS": _case(offload, off_args, {}),
        # ... and leave it unset under Megatron-FSDP, which rejects 1
        "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS": _case(
            fsdp, mg.pretrain_args(fsdp), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        ),
        # a layout must hold every layer (ours is built from the plan's stages)
        "must match num_layers": _case(uneven, bad_layout, mg.environment(uneven)),
        # an interleaved layout has pp·v segments (ours: every chunk of every stage)
        "must be divisible by pipeline_model_parallel_size": _case(
            interleaved,
            [a.replace("Et*3|", "Et*1|t*2|") for a in mg.pretrain_args(interleaved)],
            mg.environment(interleaved),
        ),
        # Megatron takes the virtual stages from the layout or a flag, not both
        "No more than one of the following arguments": _case(
            interleaved,
            mg.pretrain_args(interleaved) + ["--num-virtual-stages-per-pipeline-rank", "4"],
            mg.environment(interleaved),
        ),
        # we refuse activation offload; Megatron's layer-level offload rejects pipelines
        "Pipeline parallelism with CPU offloading": _case(
            uneven, mg.pretrain_args(uneven) + ["--cpu-offloading-num-layers", "2"], mg.environment(uneven)
        ),
    }
    results = megatron_validate(cases + list(negatives.values()))

    for name, plan, r in zip(names, plans, results):
        _check_against_plan(name, plan, r)
        s, m = plan.stages[0], plan.model
        assert r["num_query_groups"] == m.num_kv_heads, name
        assert r["normalization"] == ("LayerNorm" if m.family == "gpt" else "RMSNorm"), name
        assert r["gated_linear_unit"] == (m.family == "llama"), name
        n = mg.block_recompute(plan)
        if n:
            assert (r["recompute_granularity"], r["recompute_method"], r["recompute_num_layers"]) == (
                "full",
                "block",
                n,
            )
        elif s.recompute_attention:
            assert (r["recompute_granularity"], r["recompute_modules"]) == ("selective", ["core_attn"]), name
        else:
            assert r["recompute_granularity"] is None, name
        assert r["distributed_optimizer"] == (s.zero >= 1), name  # Megatron-FSDP turns it on too
        assert r["fsdp"] == (s.zero >= 2), name
        if s.zero >= 2:
            assert r["sharding"] == mg.ZERO_FSDP[s.zero], name
        assert r["offload_fraction"] == s.offload.optimizer, name
        assert (r["bf16"], r["fp16"]) == (plan.training.param_dtype == "bf16", plan.training.param_dtype == "fp16")
        assert r["grads_fp32"] == (plan.training.grad_dtype == "fp32"), name

    for (expected, _), r in zip(negatives.items(), results[len(cases) :]):
        assert not r["ok"] and expected in r["error"], (expected, r)


def _check_against_plan(name: str, plan: Plan, r: dict) -> None:
    assert r["ok"], (name, r.get("error"))
    s = plan.stages[0]
    got = (r["tp"], r["pp"], r["dp"], r["micro_batch"], r["num_microbatches"])
    assert got == (s.tp, plan.num_stages, s.dp, s.micro_batch, plan.micro_batches), name
    assert (r["stage_layers"] or [r["num_layers"]]) == [x.layers for x in plan.stages], name
    v = plan.virtual_stages
    assert (r["vp"], r["config_vp"]) == ((v, v) if v > 1 else (None, None)), name
    if plan.num_stages > 1:
        assert r["chunk_layers"] == [list(x.chunks()) for x in plan.stages], name
    if v > 1:  # Megatron's interleaved schedule: groups of pp micro-batches, Mist's forward order
        G, pp = plan.micro_batches, plan.num_stages
        assert r["microbatch_group"] == pp and G % pp == 0, name
        assert [tuple(x) for x in r["forward_order"]] == [chunk_of(k, pp, v, True) for k in range(G * v)], name


def test_tuned_plans_export_and_megatron_accepts_them(tmp_path):
    """Plans from `mist tune` (Megatron's space, and Mist's full space through --approximate's
    nearest plan) export and pass Megatron's validation with their own grid and layout."""
    from mist.hardware.registry import load_profile
    from mist.tune.run import run_space

    profile = load_profile("h100")
    plans = {}
    for space, model, (nodes, gpn), seq, B in (
        ("megatron", "llama-7b", (4, 4), 2048, 128),
        ("full", "llama-7b", (4, 4), 2048, 128),
        ("full", "gpt3-1.3b", (1, 8), 2048, 64),
    ):
        training = TrainingSpec(seq_len=seq, global_batch=B)
        best = run_space(space, PRESETS[model], ClusterSpec("h100", nodes, gpn), training, profile, time_budget=20).plan
        assert best is not None
        plans[f"{space}-{model}"] = mg.nearest(best)
    cases = []
    for name, plan in plans.items():
        done, _ = exported(plan, tmp_path, name)
        cases.append(_case(plan, list(done.args), dict(done.env)))
    for (name, plan), r in zip(plans.items(), megatron_validate(cases)):
        _check_against_plan(name, plan, r)
