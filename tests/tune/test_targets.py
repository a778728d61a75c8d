"""Target spaces (`mist tune --target megatron|deepspeed|torchtitan`): every tuned plan exports
as it is, and Mist's full space is never predicted slower than a target's best plan."""

import importlib
import json
from dataclasses import replace

import pytest

from mist.cli import main
from mist.export.megatron import problems as megatron_problems
from mist.export.megatron import runs_training
from mist.hardware import load_profile
from mist.plan import Plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import ALL_SPACES, TARGET_SPACES, run_space
from mist.tune.targets import deepspeed_candidates, megatron_candidates, torchtitan_candidates

# the paper's llama-2.7b rotates a quarter of each head; torchtitan's llama3 rotates all of it
LLAMA = replace(get_preset("llama-2.7b"), rotary_fraction=1.0, name="llama-2.7b-rope")
MODELS = ("gpt3-1.3b", "llama-2.7b-rope", "falcon-1.3b")


def model(m):
    return LLAMA if m == LLAMA.name else get_preset(m)


CLUSTERS = (("l4", 2), ("a100", 4), ("h200", 8))
FAMILIES = {"megatron": ("gpt", "llama"), "deepspeed": ("gpt", "llama", "falcon"), "torchtitan": ("llama",)}
# the default run tunes each target and model on the first cluster (the full space too); the
# others go through the same code
COVERED_BY = "tests/tune/test_targets.py::test_tuned_plan_exports_and_full_space_is_no_slower"
CASES = [
    pytest.param(target, m, gpu, n, marks=() if (gpu, n) == CLUSTERS[0] else pytest.mark.extended(COVERED_BY))
    for target in TARGET_SPACES
    for m in MODELS
    for gpu, n in CLUSTERS
    if model(m).family in FAMILIES[target]
]
# the full space is searched (unbudgeted) on these clusters for every model
FULL_CLUSTERS = (("l4", 2), ("h200", 8))

_results: dict = {}


def setup(m, gpu, n):
    training = TrainingSpec(seq_len=2048, global_batch=8 * n)  # bf16: every target trains in it
    return model(m), ClusterSpec(gpu, 1, n), training, load_profile(gpu)


def tuned(space, m, gpu, n):
    key = (space, m, gpu, n)
    if key not in _results:
        _results[key] = run_space(space, *setup(m, gpu, n), time_budget=None if space == "full" else 20)
    return _results[key]


def test_spaces_registered_beside_the_paper_era_ones():
    assert TARGET_SPACES == {"megatron": "megatron-0.19", "deepspeed": "deepspeed-0.19", "torchtitan": "torchtitan-0.3"}
    for name in ("megatron", "deepspeed", "megatron-paper", *TARGET_SPACES.values()):
        assert name in ALL_SPACES
    from mist.tune.space import SPACE_LABELS  # what `mist compare` says each space is

    assert set(SPACE_LABELS) == set(ALL_SPACES)
    assert all(SPACE_LABELS[b].startswith("paper-era") for b in ("megatron", "deepspeed", "aceso", "megatron-paper"))


@pytest.mark.parametrize("target,m,gpu,n", CASES)
def test_tuned_plan_exports_and_full_space_is_no_slower(target, m, gpu, n, tmp_path):
    res = tuned(TARGET_SPACES[target], m, gpu, n)
    assert res.plan is not None, res.infeasible_reason
    assert res.predicted.fits
    assert res.plan.engine == target  # priced as the framework's runtime keeps sent outputs
    exporter = importlib.import_module(f"mist.export.{target}")
    assert exporter.problems(res.plan) == []
    rec = exporter.write(res.plan, tmp_path)
    assert rec.target == target and all((tmp_path / f).exists() for f in rec.files)
    if (gpu, n) in FULL_CLUSTERS:
        full = tuned("full", m, gpu, n)
        assert full.plan is not None
        t_full, t_target = full.predicted.iteration_time_s, res.predicted.iteration_time_s
        assert t_full <= t_target * (1 + 1e-9), f"full {t_full:.4f} s slower than {target} {t_target:.4f} s"


def test_uniform_knobs_and_target_rules():
    spec, cluster, training, _ = setup(LLAMA.name, "h200", 8)
    for cands in (megatron_candidates, deepspeed_candidates, torchtitan_candidates):
        for _, stages in cands(spec, cluster, training):
            assert len({(s.dp, s.tp, s.micro_batch, s.zero, s.offload.optimizer) for s in stages}) == 1
    mg = list(megatron_candidates(spec, cluster, training))
    assert {s.offload.optimizer for _, st in mg for s in st} == {0.0, 0.5, 1.0}
    ds = list(deepspeed_candidates(spec, cluster, training))
    assert all(s.offload.grads == s.offload.optimizer for _, st in ds for s in st)
    assert {s.offload.optimizer for _, st in ds for s in st if s.zero == 3} >= {0.25, 0.5, 0.75, 1.0}
    tt = list(torchtitan_candidates(spec, cluster, training))
    assert {s.zero for _, st in tt for s in st} == {0, 1, 2, 3}
    # FSDP2 runs as ZeRO-1 under a pipeline, as ZeRO-2/3 without one; CPU offload without one only
    assert all((s.zero == 1) == (len(st) > 1 and s.zero > 0) for _, st in tt for s in st)
    assert all(len(st) == 1 for _, st in tt for s in st if any(s.offload.as_tuple()))
    assert all(s.recompute_layers in (0, s.layers) for _, st in tt for s in st)


def test_megatron_uneven_split_and_fp32_grads():
    model30 = replace(LLAMA, num_layers=30)  # pp 4 does not divide 30
    _, cluster, training, _ = setup(LLAMA.name, "h200", 8)
    training = runs_training(training)  # as tune_target costs the space
    splits = {tuple(s.layers for s in st) for _, st in megatron_candidates(model30, cluster, training)}
    assert (8, 8, 7, 7) in splits and (30,) in splits
    uneven = [
        Plan(model=model30, cluster=cluster, training=training, micro_batches=G, stages=st)
        for G, st in megatron_candidates(model30, cluster, training)
        if len(st) == 4 and st[0].chunk_layers is None
    ]
    assert any(megatron_problems(p) == [] for p in uneven)  # exported as --pipeline-model-parallel-layout
    res = tuned("megatron-0.19", LLAMA.name, "h200", 8)
    assert res.plan.training.grad_dtype == "fp32"


def test_megatron_space_searches_named_16bit_gradients():
    """Gradients in the parameters' dtype, when the training names them, are searched as Megatron-LM
    runs them (`--grad-reduce-in-bf16`): half the fp32 gradient buffer's bytes, and the optimizer's
    fp32 copies of the rank's shard at the step; unnamed, the space keeps fp32 gradients."""
    from mist.export.megatron import training_args
    from mist.simulate.plan_sim import simulate_plan

    spec, cluster, training, profile = setup("gpt3-1.3b", "l4", 2)
    named = replace(training, grad_dtype=training.param_dtype)
    assert runs_training(named) == named and runs_training(training).grad_dtype == "fp32"
    res = run_space("megatron-0.19", spec, cluster, named, profile, time_budget=20)
    plan = res.plan
    assert plan.engine == "megatron" and plan.training.grad_dtype == "bf16" and megatron_problems(plan) == []
    assert "--grad-reduce-in-bf16" in training_args(plan)
    sim = simulate_plan(plan, profile)
    assert res.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=1e-12)
    fp32 = simulate_plan(replace(plan, training=runs_training(training)), profile)
    for s, a, b in zip(plan.stages, sim.stages, fp32.stages):
        params = a.memory_breakdown["weights_bytes"] // 2  # bf16 weights, all on the rank
        assert b.memory_breakdown["grads_bytes"] == 2 * a.memory_breakdown["grads_bytes"]
        shard = -(-params // s.dp) if s.zero == 1 else params
        assert a.step_peak_bytes - a.state_bytes == 4 * shard


def test_megatron_and_torchtitan_search_virtual_stages():
    """v = 2 and 4 with equal chunks where G is a multiple of pp (the full space's chunk rule), every
    candidate exported as it is; DeepSpeed has no interleaved schedule."""
    spec, cluster, training, profile = setup(LLAMA.name, "h200", 8)  # 32 blocks
    training = runs_training(training)
    for cands in (megatron_candidates, torchtitan_candidates):
        inter = [(G, st) for G, st in cands(spec, cluster, training) if st[0].chunk_layers]
        vs = {len(st[0].chunk_layers) for _, st in inter}
        assert vs == {2, 4}
        for G, st in inter:
            pp, v = len(st), len(st[0].chunk_layers)
            assert G % pp == 0 and all(s.chunk_layers == (32 // (pp * v),) * v for s in st)
        problems = importlib.import_module(f"mist.export.{cands.__name__.split('_')[0]}").problems
        for G, st in inter[:: max(1, len(inter) // 20)]:
            plan = Plan(spec, cluster, training, G, st, virtual_stages=len(st[0].chunk_layers))
            assert problems(plan) == [], problems(plan)
    assert not any(st[0].chunk_layers for _, st in deepspeed_candidates(spec, cluster, training))
    # interleaved candidates are costed (memoized per rank and chunk) as `mist simulate` prices the plan
    from mist.simulate.gpu_fit import ALLOCATOR_MARGIN
    from mist.simulate.plan_sim import simulate_plan
    from mist.tune.baselines import _Evaluator

    ev = _Evaluator(spec, cluster, training, profile, engine="megatron")
    inter = [(G, st) for G, st in megatron_candidates(spec, cluster, training) if st[0].chunk_layers]
    for G, st in inter[:: max(1, len(inter) // 12)]:
        plan = ev.plan(G, st)
        assert plan.virtual_stages == len(st[0].chunk_layers) and plan.engine == "megatron"
        c, sim = ev.cost(G, st), simulate_plan(plan, profile)
        assert c.time == pytest.approx(sim.iteration_time_s, rel=1e-12) and c.fits == sim.fits
        needs = [s.peak_memory_bytes * (1 + ALLOCATOR_MARGIN) for s in sim.stages]
        assert list(c.needs) == pytest.approx(needs, rel=1e-9)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_megatron_state_bytes_per_parameter(dtype):
    """The Megatron space costs what Megatron-LM holds: with 16-bit parameters fp32 gradients, so
    6 + 12/dp bytes per parameter with the distributed optimizer (ZeRO-1) and 18 without."""
    from mist.simulate.precision import precision_for
    from mist.simulate.states import unit_states

    P, dp, G = 8 * 1024 * 1024, 8, 4  # a unit whose parameters split evenly over dp
    prec = precision_for(
        runs_training(TrainingSpec(seq_len=2048, global_batch=64, param_dtype=dtype)), load_profile("h200")
    )
    for zero, per_param in ((1, 6 + 12 / dp), (0, 18)):
        w, g, o = unit_states(P, dp, zero, 0.0, 0.0, 0.0, G, prec)
        assert (float(w) + float(g) + float(o)) / P == per_param, (zero, w, g, o)


def test_refusals():
    res = run_space("torchtitan-0.3", *setup("gpt3-1.3b", "l4", 2))
    assert res.plan is None and res.infeasible_reason.startswith("torchtitan has no model for gpt3-1.3b")
    res = run_space("megatron-0.19", *setup("falcon-1.3b", "l4", 2))
    assert res.plan is None and "falcon" in res.infeasible_reason


def test_cli_target(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["tune", "--model", "llama3-8b", "--gpu", "h200", "--gpus-per-node", "2", "--global-batch", "16"]
    main([*args, "--target", "torchtitan", "--no-compile", "--time-budget", "10", "-o", str(out), "--json"])
    assert json.loads(capsys.readouterr().out)["space"] == "torchtitan-0.3" and out.exists()
    for extra, says in (
        (["--target", "megatron", "--space", "full"], "either --space or --target"),
        (["--target", "jax"], "Unknown --target"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*args, *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tune", "--model", "gpt3-1.3b", "--target", "torchtitan"])
    assert e.value.code == 2 and "torchtitan has no model for gpt3-1.3b" in capsys.readouterr().err


def test_what_the_full_plan_needs_beyond_each_target():
    """`mist compare` names, per target, the knobs of Mist's plan the framework cannot run: the
    exporters' own refusals, each under a short name."""
    from pathlib import Path

    from mist.plan import load_plan
    from mist.tune.compare import beyond_target, knob_label

    plan = load_plan(Path(__file__).parents[2] / "examples" / "llama-7b-8xl4-mixed.json")
    mg = beyond_target(plan, "megatron")
    for knob in ("per-stage dp", "per-stage tp", "per-stage micro_batch", "per-stage ZeRO", "activation offload"):
        assert knob in mg, mg
    assert "per-stage recompute depth" in mg and "per-stage offload" in mg
    assert "16-bit gradients" not in mg  # Megatron-LM keeps them with fp16 (`--grad-reduce-in-bf16` with bf16)
    ds = beyond_target(plan, "deepspeed")
    assert "fractional offload" in ds and "tp with a pipeline" in ds and "ZeRO-2/3 with a pipeline" in ds
    assert "model architecture" in beyond_target(plan, "torchtitan")  # llama-7b rotates a quarter of each head
    assert len(mg) == len(set(mg))
    assert knob_label("a sentence no pattern knows about at all") == "a sentence no pattern knows about …"
    # interleaving: only DeepSpeed refuses it (Megatron-LM's layout and torchtitan's Interleaved1F1B run it)
    chunks = tuple(replace(s, chunk_layers=(s.layers // 2, s.layers - s.layers // 2)) for s in plan.stages)
    inter = replace(plan, virtual_stages=2, stages=chunks)
    assert "interleaved 1F1B" in beyond_target(inter, "deepspeed")
    for target in ("megatron", "torchtitan"):
        assert not any("interleaved" in k for k in beyond_target(inter, target))
        assert beyond_target(inter, target) == beyond_target(plan, target)
    # a plan the target runs as it is needs nothing beyond it
    res = tuned("megatron-0.19", LLAMA.name, "h200", 8)
    assert beyond_target(res.plan, "megatron") == []
