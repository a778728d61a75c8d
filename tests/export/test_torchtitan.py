"""`mist export --to torchtitan`: the arguments and config module written for a plan, what is
refused and approximated, and torchtitan 0.3.0's own code accepting the exports
(`torchtitan_checks.py`; needs `bash .ci/targets/torchtitan.sh`)."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torchtitan_checks import build_meshes, meta_model, parse, require_torchtitan, unknown_fqns

from mist.cli import main
from mist.export import export_plan
from mist.export import torchtitan as tt
from mist.export.common import PLACEHOLDER
from mist.export.records import NotExpressible
from mist.plan import Offload, Plan, StageStrategy, load_plan
from mist.specs.loading import load_model
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

LLAMA3_8B = load_model("llama3-8b")  # GQA, a torchtitan registry flavour
LLAMA2_7B = load_model("llama2-7b")  # multi-head attention, vocabulary 32000: a generated model
SMALL_GQA = ModelSpec("llama", 12, 1024, 16, 4, 2816, 32000, norm_eps=1e-6, name="small-gqa")  # generated
GPT = load_model("gpt3-1.3b")
FALCON = load_model("falcon-7b")


def stage(layers, gpus, mb, dp, tp, zero=3, rc=0, nodes=1, **kw) -> StageStrategy:
    kw.setdefault("sequence_parallel", tp > 1)  # torchtitan's tensor parallelism always shards the sequence
    return StageStrategy(layers, nodes, gpus // nodes, mb, dp, tp, zero, rc, **kw)


def make(model, stages, B, G, nodes=1, gpn=8, seq=2048, v=1, schedule="1f1b", **train) -> Plan:
    train.setdefault("grad_dtype", "fp32")  # torchtitan reduces and keeps gradients in fp32
    return Plan(
        model=model,
        cluster=ClusterSpec("h100", nodes, gpn),
        training=TrainingSpec(seq_len=seq, global_batch=B, **train),
        micro_batches=G,
        stages=tuple(stages),
        virtual_stages=v,
        schedule=schedule,
    )


def pp2_uneven(
    m,
):  # dp 2 × tp 2 × pp 2, FSDP (ZeRO-1 under a pipeline), the last 3 of 15 and all of the rest recomputed
    L = m.num_layers
    return make(
        m,
        [stage(L // 2 - 1, 4, 2, 2, 2, zero=1, rc=3), stage(L - L // 2 + 1, 4, 2, 2, 2, zero=1, rc=L - L // 2 + 1)],
        32,
        8,
    )


def dp8_ddp_full(m):  # replicated data parallelism on 8 GPUs, every block recomputed
    return make(m, [stage(m.num_layers, 8, 2, 8, 1, zero=0, rc=m.num_layers)], 64, 4)


def pp4_tp2_ddp(m):  # 2 nodes × 8: pp 4, dp 2 replicated, tp 2, no recompute
    n = m.num_layers // 4
    stages = [stage(n, 4, 1, 2, 2, zero=0) for _ in range(3)] + [stage(m.num_layers - 3 * n, 4, 1, 2, 2, zero=0)]
    return make(m, stages, 16, 8, nodes=2)


def dp16_offload(m):  # 2 nodes, no pipeline, dp 16 FSDP (ZeRO-3) with all state on the CPU
    on = Offload(1.0, 1.0, 1.0, 0.0)
    return make(m, [stage(m.num_layers, 16, 1, 16, 1, rc=m.num_layers, nodes=2, offload=on)], 64, 4, nodes=2, seq=4096)


def tp4_single_stage(m):  # no pipeline: dp 2 × tp 4, gradient accumulation 4
    return make(m, [stage(m.num_layers, 8, 1, 2, 4, rc=0)], 8, 4)


def pp2_interleaved_uneven(m):  # interleaved 1F1B: 2 ranks × 2 uneven chunks, 3 blocks of rank 0 recomputed
    h, q = m.num_layers // 2, m.num_layers // 4
    stages = [
        stage(h, 4, 2, 2, 2, zero=1, rc=3, chunk_layers=(q - 1, h - q + 1)),
        stage(m.num_layers - h, 4, 2, 2, 2, zero=1, chunk_layers=(m.num_layers - h - q + 1, q - 1)),
    ]
    return make(m, stages, 32, 8, v=2)


def pp4_interleaved_full(m):  # interleaved 1F1B: 4 ranks × 2 chunks, tp 2, every block recomputed
    n = m.num_layers // 4
    chunks = (n // 2, n - n // 2)
    stages = [stage(n, 2, 1, 1, 2, zero=0, rc=n, chunk_layers=chunks) for _ in range(4)]
    return make(m, stages, 8, 8, v=2)


PLANS = {
    f.__name__: f
    for f in (
        pp2_uneven,
        dp8_ddp_full,
        pp4_tp2_ddp,
        dp16_offload,
        tp4_single_stage,
        pp2_interleaved_uneven,
        pp4_interleaved_full,
    )
}
MODELS = {"llama3-8b": LLAMA3_8B, "llama2-7b": LLAMA2_7B, "small-gqa": SMALL_GQA}


def value(args, flag):
    a = list(args)
    return a[a.index(flag) + 1] if flag in a else None


def script_args(path: Path) -> list[str]:
    """The words of the launch script's TORCHTITAN_ARGS array, as bash would split them."""
    text = path.read_text()
    body = text.split("TORCHTITAN_ARGS=(\n", 1)[1].split("\n)\n", 1)[0]
    return shlex.split(body)


# ------------------------------------------------------------------ arguments (no torchtitan)
def test_registry_model_pipeline_fsdp_args(tmp_path):
    plan = make(LLAMA3_8B, [stage(15, 4, 2, 2, 2, zero=1, rc=15), stage(17, 4, 2, 2, 2, zero=1, rc=17)], 32, 8)
    done = tt.write(plan, tmp_path)
    a = list(done.args)
    assert a[:4] == ["--module", "llama3", "--config", "llama3_8b"]
    assert done.files == ("run_torchtitan.sh",)
    expect = {
        "--parallelism.data_parallel_replicate_degree": "1",
        "--parallelism.data_parallel_shard_degree": "2",
        "--parallelism.tensor_parallel_degree": "2",
        "--parallelism.pipeline_parallel_degree": "2",
        "--parallelism.fsdp_reshard_after_forward": None,  # torchtitan's default under a pipeline
        "--parallelism.pipeline_parallel_schedule": "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size": "2",
        "--training.local_batch_size": "16",  # micro-batch 2 × 8 micro-batches, split by the pipeline
        "--training.global_batch_size": "32",
        "--training.seq_len": "2048",
        "--training.mixed_precision_param": "bfloat16",
        "--hf_assets_path": PLACEHOLDER,
    }
    assert {k: value(a, k) for k in expect} == expect
    parts = a[a.index("--parallelism.module_fqns_per_model_part") + 1 :][:2]
    assert parts[0].split(",")[:2] == ["tok_embeddings", "layers.0"] and parts[0].endswith("layers.14")
    assert parts[1].startswith("layers.15,") and parts[1].endswith("layers.31,norm,lm_head")
    assert "--training.disable_cuda_graphs" in a and a[-1] == "activation-checkpoint:full"
    assert script_args(tmp_path / "run_torchtitan.sh") == a
    assert done.env == {"NNODES": "1", "NPROC_PER_NODE": "8"}


@pytest.mark.parametrize(
    "zero, dp, replicate, shard, reshard",
    [(0, 8, "8", "1", None), (2, 8, "1", "8", "never"), (3, 8, "1", "8", "always")],
)
def test_zero_levels(zero, dp, replicate, shard, reshard):
    a = tt.args(make(LLAMA3_8B, [stage(32, 8, 1, dp, 1, zero=zero)], 8 * 4, 4))
    assert value(a, "--parallelism.data_parallel_replicate_degree") == replicate
    assert value(a, "--parallelism.data_parallel_shard_degree") == shard
    assert value(a, "--parallelism.fsdp_reshard_after_forward") == reshard


def test_without_pipeline_torchtitan_accumulates_gradients():
    a = tt.args(tp4_single_stage(LLAMA3_8B))
    assert value(a, "--training.local_batch_size") == "1"  # global 8 / (local 1 × dp 2) = 4 accumulation steps
    assert value(a, "--training.global_batch_size") == "8"
    assert "--parallelism.module_fqns_per_model_part" not in a and "--training.disable_cuda_graphs" not in a
    assert a[-1] == "activation-checkpoint:none"


def test_per_stage_recompute_and_custom_model_write_a_module(tmp_path):
    plan = pp2_uneven(SMALL_GQA)  # stage 0: last 3 of 5 blocks; stage 1: all 7
    assert tt.recomputed_layers(plan) == [[2, 3, 4], list(range(5, 12))]
    done = tt.write(plan, tmp_path)
    assert done.files == ("run_torchtitan.sh", "mist_torchtitan_plan.py")
    assert done.args[:4] == ("--module", "mist_torchtitan_plan", "--config", "mist_plan")
    assert not any(w.startswith("activation-checkpoint:") for w in done.args)  # the module's policy
    text = (tmp_path / "mist_torchtitan_plan.py").read_text()
    assert "RECOMPUTED_LAYERS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]" in text
    assert "DIM, N_LAYERS, N_HEADS, N_KV_HEADS = 1024, 12, 16, 4" in text
    assert "FFN_DIM, VOCAB, NORM_EPS, TIE = 2816, 32000, 1e-06, False" in text
    assert "MAX_SEQ_LEN, ROPE_THETA = 8192, 10000.0" in text  # the model's rotary base (torchtitan's llama3: 500000)
    assert tt.registry_flavour(replace(LLAMA3_8B, rope_theta=10000.0)) is None
    compile(text, "mist_torchtitan_plan.py", "exec")


def test_interleaved_plan_is_interleaved1f1b_with_a_part_per_chunk():
    plan = pp2_interleaved_uneven(SMALL_GQA)  # chunks 2+4 and 4+2 of the 12 blocks
    a = tt.args(plan)
    assert value(a, "--parallelism.pipeline_parallel_schedule") == "Interleaved1F1B"
    assert value(a, "--parallelism.pipeline_parallel_degree") == "2"
    parts = a[a.index("--parallelism.module_fqns_per_model_part") + 1 :][:4]
    # part c·pp + r is chunk c of rank r: rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1
    assert parts == [
        "tok_embeddings,layers.0,layers.1",
        "layers.2,layers.3,layers.4,layers.5",
        "layers.6,layers.7,layers.8,layers.9",
        "layers.10,layers.11,norm,lm_head",
    ]
    # rank 0 recomputes 3 blocks spread over its chunks (2 + 1): the last ones of each
    assert tt.recomputed_layers(plan) == [[0, 1, 9], []]
    assert tt.problems(plan) == [] and tt.nearest(plan) == plan


@pytest.mark.parametrize("pp, v, G", [(2, 2, 4), (2, 4, 8), (4, 2, 8), (4, 4, 12), (3, 2, 9)])
def test_torch_interleaved1f1b_runs_the_order_mist_simulates(pp, v, G):
    """torch.distributed.pipelining's Interleaved1F1B (what torchtitan builds) orders every rank's
    forwards and backwards as `mist.rules.interleaved_order` does, when G is a multiple of pp."""
    require_torchtitan()
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from mist.rules.interleaved_order import interleaved_one_f_one_b

    # the per-rank order is computed from these four numbers (its __init__ needs live stages)
    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, G // pp)  # as its __init__ does
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches = v, pp, G
    sched.microbatches_per_round = G // rounds
    kind = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    for r in range(pp):
        ops = [a for a in sched._calculate_single_rank_operations(r) if a is not None]
        torch_order = [(kind[a.computation_type], a.microbatch_index, a.stage_index) for a in ops]
        mist_order = [(k, m, c * pp + r) for k, m, c in interleaved_one_f_one_b(r, pp, v, G)]
        assert torch_order == mist_order


def test_offload_all_is_the_cpu_offload_flag():
    assert "--training.enable_cpu_offload" in tt.args(dp16_offload(LLAMA3_8B))
    assert "--training.enable_cpu_offload" not in tt.args(pp2_uneven(LLAMA3_8B))


# ------------------------------------------------------------------ refusals and nearest
def refused(plan) -> str:
    return tt.problems(plan)[0]


def test_gpt_and_falcon_are_refused_in_one_sentence():
    gpt = make(GPT, [stage(24, 8, 1, 8, 1)], 8, 1)
    assert "gpt model" in refused(gpt) and "no GPT-style" in refused(gpt)
    falcon = make(FALCON, [stage(32, 8, 1, 8, 1)], 8, 1)
    assert "falcon model" in refused(falcon)
    with pytest.raises(NotExpressible, match=r"^torchtitan cannot run this plan or any near it: the model is a gpt"):
        tt.nearest(gpt)


@pytest.mark.parametrize(
    "change, words",
    [
        (
            dict(offload=Offload(optimizer=0.5)),
            "stage 1 offloads part of its state (offload.weights 0, offload.grads 0",
        ),
        (dict(offload=Offload(activations=0.25)), "stage 1 offloads 25% of its activations (offload.activations 0.25)"),
        (dict(zero=3), "stage 1 uses ZeRO-3 (zero 3) under a pipeline"),
        (dict(recompute_attention=True), "stage 1 recomputes the attention core of its other blocks"),
        (dict(recompute_activation=True), "stage 1 recomputes the MLP activation of its other blocks"),
        (dict(tp=1, dp=4, micro_batch=1, sequence_parallel=False), "stage 1 has dp 4 but stage 0 has 2"),
    ],
)
def test_stage_knobs_are_named(change, words):
    plan = pp2_uneven(LLAMA3_8B)
    s1 = replace(plan.stages[1], recompute_layers=4, **change)
    bad = replace(plan, stages=(plan.stages[0], s1))
    found = tt.problems(bad)
    assert any(words in p for p in found), found
    near = tt.nearest(bad)
    assert tt.problems(near) == []
    assert near.cluster == bad.cluster and near.training.global_batch == bad.training.global_batch
    assert [s.layers for s in near.stages] == [s.layers for s in bad.stages]


def test_fp16_and_partial_rotary_are_named_and_approximated():
    plan = make(replace(SMALL_GQA, rotary_fraction=0.25), [stage(12, 8, 1, 8, 1)], 8, 1, param_dtype="fp16")
    found = tt.problems(plan)
    assert "rotary_fraction 0.25" in found[0] and any("fp16 (param_dtype)" in p for p in found)
    near = tt.nearest(plan)
    assert tt.problems(near) == [] and near.model.rotary_fraction == 1.0 and near.training.param_dtype == "bf16"


def test_pipeline_fsdp_is_zero_1_and_gradients_are_fp32():
    """torch.distributed.pipelining keeps FSDP2's whole parameters and gradients until the last
    micro-batch's backward: a pipeline plan with ZeRO-2/3 or CPU offload is not what runs."""
    plan = pp2_uneven(LLAMA3_8B)
    assert tt.problems(plan) == []
    on = Offload(1.0, 1.0, 1.0, 0.0)
    off = replace(plan, stages=tuple(replace(s, zero=3, offload=on) for s in plan.stages))
    found = tt.problems(off)
    assert any("stage 0 uses ZeRO-3 (zero 3) under a pipeline" in p for p in found), found
    assert any("stage 0 offloads all its state under a pipeline" in p for p in found), found
    near = tt.nearest(off)
    assert {(s.zero, s.offload) for s in near.stages} == {(1, Offload())} and tt.problems(near) == []
    single = dp16_offload(LLAMA3_8B)
    assert "stage 0 uses ZeRO-1 (zero 1)" in refused(replace(single, stages=(replace(single.stages[0], zero=1),)))
    bf16 = replace(plan, training=replace(plan.training, grad_dtype=None))
    assert "the plan keeps bf16 gradients (training.grad_dtype)" in refused(bf16)
    assert tt.nearest(bf16).training == tt.runs_training(bf16.training) == plan.training


def test_unequal_stage_gpus_and_tied_pipeline_cannot_be_approximated():
    uneven = make(LLAMA3_8B, [stage(16, 2, 2, 2, 1), stage(16, 4, 1, 4, 1)], 8, 2, gpn=6)
    assert "stage 1 has 4 GPUs but stage 0 has 2" in refused(uneven)
    with pytest.raises(NotExpressible, match="same GPUs"):
        tt.nearest(uneven)
    tied = pp2_uneven(replace(SMALL_GQA, tie_embeddings=True))
    assert "tie_embeddings" in refused(tied)


def test_mixed_example_nearest(tmp_path):
    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")
    near = tt.nearest(plan)
    assert tt.problems(near) == []
    assert {(s.dp, s.tp, s.micro_batch, s.zero) for s in near.stages} == {(2, 1, 2, 1)}  # FSDP under a pipeline
    assert all(s.offload == Offload() for s in near.stages)  # no CPU offload under a pipeline
    assert [s.recompute_layers for s in near.stages] == [7, 5, 3, 0]
    with pytest.raises(NotExpressible, match=r"^torchtitan cannot run this plan: "):
        export_plan(plan, "torchtitan", tmp_path)


# ------------------------------------------------------------------ the CLI
def test_cli_json_is_what_the_script_passes(tmp_path, capsys):
    src = tmp_path / "plan.json"
    pp2_uneven(LLAMA3_8B).save(src)
    main(["export", str(src), "--to", "torchtitan", "-o", str(tmp_path / "out"), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"target", "files", "env", "args"} and got["target"] == "torchtitan"
    assert got["args"] == script_args(tmp_path / "out" / "run_torchtitan.sh")
    assert sorted(got["files"]) == sorted(p.name for p in (tmp_path / "out").iterdir())


def test_cli_refuses_with_exit_2_naming_the_knob(tmp_path, capsys):
    src = tmp_path / "plan.json"
    plan = pp2_uneven(LLAMA3_8B)
    replace(plan, stages=(plan.stages[0], replace(plan.stages[1], offload=Offload(optimizer=0.5)))).save(src)
    with pytest.raises(SystemExit) as e:
        main(["export", str(src), "--to", "torchtitan", "-o", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2
    assert "stage 1 offloads part of its state" in err and "offload.optimizer 0.5" in err


def test_cli_approximate_prints_both_predictions(tmp_path, capsys):
    main(
        [
            "export",
            str(EXAMPLES / "llama-7b-8xl4-mixed.json"),
            "--to",
            "torchtitan",
            "-o",
            str(tmp_path),
            "--approximate",
        ]
    )
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "approximated: the plan predicts" in err and "the exported nearest plan" in err
    assert (tmp_path / "mist_torchtitan_plan.py").is_file()


# ------------------------------------------------------------------ torchtitan's own code
CASES = [(m, p) for m in MODELS for p in PLANS]


@pytest.mark.parametrize("model_name, plan_name", CASES)
def test_torchtitan_accepts_the_export(model_name, plan_name, tmp_path):
    require_torchtitan()
    plan = PLANS[plan_name](MODELS[model_name])
    done = tt.write(plan, tmp_path)
    cfg = parse(done.args, tmp_path)
    check_layout(cfg, plan)
    check_meshes(cfg, plan)
    check_model(cfg, plan)


def test_torchtitan_accepts_the_approximated_mixed_example(tmp_path):
    require_torchtitan()
    plan = tt.nearest(load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json"))
    cfg = parse(tt.write(plan, tmp_path).args, tmp_path)
    check_layout(cfg, plan)
    check_meshes(cfg, plan)
    check_model(cfg, plan)


def check_layout(cfg, plan):
    s0, p, t = plan.stages[0], cfg.parallelism, cfg.training
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == s0.dp
    assert (p.data_parallel_shard_degree > 1) == (s0.dp > 1 and s0.zero >= 1)  # ZeRO-1: under a pipeline only
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (s0.tp, plan.num_stages)
    assert t.global_batch_size == plan.training.global_batch and t.seq_len == plan.training.seq_len
    if plan.num_stages > 1:  # torchtitan's pipeline runs local / microbatch micro-batches per step
        assert p.pipeline_parallel_microbatch_size == s0.micro_batch
        assert t.local_batch_size // p.pipeline_parallel_microbatch_size == plan.micro_batches
        check_parts(p, plan)
    else:  # gradient accumulation steps = global / (local × dp)
        assert t.global_batch_size // (t.local_batch_size * s0.dp) == plan.micro_batches
    assert t.enable_cpu_offload == (s0.offload.optimizer == 1.0)
    check_recompute(cfg.activation_checkpoint, plan)


def check_parts(p, plan):
    """The model parts' blocks are the plan's chunks, and torchtitan's own stage assignment for the
    schedule gives every rank its chunks in order."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, get_schedule_class

    blocks = [sum(f.startswith("layers.") for f in part) for part in p.module_fqns_per_model_part]
    assert blocks == [s.chunks()[c] for c in range(plan.virtual_stages) for s in plan.stages]
    pp, parts = plan.num_stages, len(blocks)
    for r, s in enumerate(plan.stages):
        mine = _get_pp_rank_to_stage_indices_mapping(r, pp, p.pipeline_parallel_schedule, parts)
        assert [blocks[i] for i in mine] == list(s.chunks())
    interleaved = get_schedule_class(p.pipeline_parallel_schedule) is ScheduleInterleaved1F1B
    assert interleaved == (plan.virtual_stages > 1)


def check_recompute(ac, plan):
    from torchtitan.distributed.activation_checkpoint import FullAC

    mode = tt.ac_mode(plan)
    if mode == "none":
        assert ac is None
    elif mode == "full":
        assert type(ac) is FullAC.Config
    else:
        policy = ac.build()
        assert isinstance(policy, FullAC)
        assert ac.layer_ids == [i for ids in tt.recomputed_layers(plan) for i in ids]


def check_meshes(cfg, plan):
    s0, world = plan.stages[0], plan.cluster.world_size
    groups = build_meshes(cfg.parallelism, world)
    # Mist's layout: a stage's GPUs are consecutive ranks, tp innermost
    if s0.tp > 1:
        assert groups["tp"] == list(range(s0.tp))
    if plan.num_stages > 1:
        assert groups["pp"] == [i * s0.gpus for i in range(plan.num_stages)]
    if s0.dp > 1:
        assert groups["batch"] == [i * s0.tp for i in range(s0.dp)]
    with pytest.raises(AssertionError, match="Invalid parallel dims"):  # torchtitan asserts it
        build_meshes(cfg.parallelism, world * 2)


def check_model(cfg, plan):
    model = meta_model(cfg)
    if plan.num_stages > 1:
        parts = cfg.parallelism.module_fqns_per_model_part
        assert unknown_fqns(model, parts) == []
        assert sorted(f for part in parts for f in part) == sorted(
            [n for n, _ in model.named_children() if n != "layers"] + [f"layers.{i}" for i in range(len(model.layers))]
        )
    assert sum(p.numel() for p in model.parameters()) == plan.model.total_params()
    if tt.ac_mode(plan) == "blocks":  # the generated policy wraps exactly the plan's recomputed blocks
        cfg.activation_checkpoint.build().apply(model)
        wrapped = [int(i) for i, b in model.layers.named_children() if type(b).__name__ == "CheckpointWrapper"]
        assert wrapped == sorted(i for ids in tt.recomputed_layers(plan) for i in ids)


def tyro_error(args, out_dir, capsys) -> str:
    """The message torchtitan's config manager exits with (tyro prints it boxed to stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse(args, out_dir)
    return " ".join(w for w in capsys.readouterr().err.split() if w != "│")


def test_torchtitan_rejects_what_we_refuse(tmp_path, capsys):
    require_torchtitan()
    a = list(tt.write(pp2_uneven(LLAMA3_8B), tmp_path).args)
    # a micro-batch that does not divide the local batch
    bad = a.copy()
    bad[bad.index("--parallelism.pipeline_parallel_microbatch_size") + 1] = "3"
    assert "must be evenly divisible by parallelism.pipeline_parallel_microbatch_size" in tyro_error(
        bad, tmp_path, capsys
    )
    # CUDA graphs under a pipeline (why the export always passes --training.disable_cuda_graphs)
    no_flag = [w for w in a if w != "--training.disable_cuda_graphs"]
    assert "CUDA graphs do not support pipeline parallelism" in tyro_error(no_flag, tmp_path, capsys)
    # tp 8 over 4 KV heads (we refuse: "does not divide the model's 4 KV heads")
    small = make(SMALL_GQA, [stage(12, 8, 1, 1, 8)], 4, 4)
    assert "KV heads" in refused(small)
    cfg = parse(["--module", "llama3", "--config", "llama3_8b"], tmp_path)
    cfg.parallelism.tensor_parallel_degree = 16  # 8 KV heads
    with pytest.raises(ValueError, match="n_kv_heads"):
        meta_model(cfg)
    # a misspelt module name parses but names no module of the model
    parts = [p.split(",") for p in a[a.index("--parallelism.module_fqns_per_model_part") + 1 :][:2]]
    parts[1][-1] = "output"
    assert unknown_fqns(meta_model(parse(a, tmp_path)), parts) == ["output"]


def test_tensor_parallelism_without_sequence_parallelism_is_refused():
    """torchtitan's tensor-parallel plan always shards the sequence between the TP regions: a plan
    with tp > 1 and no sequence parallelism is refused, and its nearest plan turns it on."""
    plan = make(LLAMA3_8B, [stage(32, 8, 1, 4, 2, zero=2, sequence_parallel=False)], B=8, G=2)
    (why,) = tt.problems(plan)
    assert "stage 0 has tp 2 without sequence parallelism" in why
    near = tt.nearest(plan)
    assert near.stages[0].sequence_parallel and tt.problems(near) == []


def test_zero_bubble_plan_exports_a_schedule_torch_validates(tmp_path):
    """A ZB-H1 plan runs from `zb_h1_schedule.csv`: torch.distributed.pipelining's own parser,
    `_validate_schedule` and its comms lowering + simulation accept Mist's order (no deadlock, every
    F before its I before its W), and torchtitan's config takes the file."""
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _simulate_comms_compute,
        _validate_schedule,
    )

    S, G = 4, 8
    stages = [stage(8, 2, 1, 2, 1, zero=1) for _ in range(S)]
    plan = make(LLAMA3_8B, stages, B=16, G=G, schedule="zb-h1")
    assert tt.problems(plan) == []
    done, _ = export_plan(plan, "torchtitan", tmp_path)
    assert tt.ZB_CSV in done.files
    assert f'"$HERE/{tt.ZB_CSV}"' in (tmp_path / tt.SCRIPT).read_text()
    rows = (tmp_path / tt.ZB_CSV).read_text().splitlines()
    actions = {r: [_Action.from_str(a) for a in row.split(",")] for r, row in enumerate(rows)}
    assert len(actions) == S and all(len(a) == 3 * G for a in actions.values())
    assert _validate_schedule(actions, S, S, G) == {i: i for i in range(S)}
    _simulate_comms_compute(_add_send_recv(actions, lambda s: s, S), lambda s: s, S)
    cfg = parse(list(done.args), tmp_path)
    assert cfg.parallelism.pipeline_parallel_schedule_csv == tt.ZB_CSV
    # a nearest plan keeps the schedule where its stages can still split B from W
    assert tt.nearest(plan).schedule == "zb-h1"


def test_context_parallel_plan_exports_with_mists_rank_groups(tmp_path):
    """cp 2 × tp 2 (sequence-parallel) × dp 2 with FSDP2: torchtitan's config and ParallelDims take
    it, and rank 0's context-parallel, tensor-parallel and data-parallel groups are Mist's (tp
    fastest, then cp, then dp). A cp plan without ZeRO is refused (torchtitan shards over cp)."""
    plan = make(LLAMA3_8B, [stage(32, 8, 1, 2, 2, zero=2, cp=2)], B=4, G=2, seq=8192)
    assert tt.problems(plan) == []
    done, _ = export_plan(plan, "torchtitan", tmp_path)
    cfg = parse(list(done.args), tmp_path)
    assert cfg.parallelism.context_parallel_degree == 2
    meshes = build_meshes(cfg.parallelism, 8)
    assert meshes["cp"] == [0, 2] and meshes["tp"] == [0, 1] and meshes["batch"] == [0, 4]
    plain = make(LLAMA3_8B, [stage(32, 8, 1, 2, 2, zero=0, cp=2)], B=4, G=2, seq=8192)
    assert any("cp 2 without ZeRO" in p for p in tt.problems(plain))
    assert tt.nearest(plain).stages[0].zero == 2


def test_zero_bubble_with_compiled_blocks_exports_as_one_f_one_b():
    """torch.distributed.pipelining splits a backward at the autograd graph's nodes (its own
    `stage_backward_input` / `stage_backward_weight`, what its I and W actions run); a block that
    torch.compile wraps whole is one node (AOTAutograd's, whichever backend: `aot_eager` here for
    speed), so I runs its whole backward and W runs it again. Mist does not export that: the
    nearest plan is 1F1B."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    run = torch.compile(block, backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    out = run(x)
    calls = []
    out.grad_fn.register_prehook(lambda g: calls.append(1))
    params = list(block.parameters())
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
    assert len(calls) == 1 and all(p.grad is None for p in params)
    stage_backward_weight(iter(params), groups)
    assert len(calls) == 2 and all(p.grad is not None for p in params)

    stages = [stage(8, 2, 1, 2, 1, zero=1) for _ in range(4)]
    plan = make(LLAMA3_8B, stages, B=16, G=8, schedule="zb-h1", compile_blocks=True)
    (why,) = tt.problems(plan)
    assert "zb-h1 schedule with compiled blocks" in why
    near = tt.nearest(plan)
    assert near.schedule == "1f1b" and near.training.compile_blocks and tt.problems(near) == []
