"""`mist tune --compile-blocks`: the search covers what compiled blocks run
(`mist.rules.compiled_blocks`: what eager blocks run, ZB-H1 included), its plan says so and
re-simulates to its prediction through the compiled analysis, and the spaces that stand for other
frameworks refuse it."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mist.analysis import prefetch
from mist.cli import main
from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.plan_sim import simulate_plan
from mist.specs.loading import load_model
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.intra import StageTables
from mist.tune.result import TRACING
from mist.tune.run import compiles_by_default, run_space_either_blocks
from mist.tune.search import tune
from mist.tune.space import get_space

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "benchmarks" / "models" / "loop-llama.yaml")
PROFILE = str(ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json")
ARGS = ["tune", "--model", MODEL, "--gpu", PROFILE, "--gpus-per-node", "2", "--seq", "256", "--global-batch", "8"]


def test_compiled_tune_stays_inside_what_compiled_blocks_run(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # a memory limit that makes the eager search recompute or offload (selective parts included);
    # tp 1: each tensor-, sequence- and context-parallel block is a capture of its own (half this
    # test's time), and those analyses are checked in tests/analysis/test_compiled_block.py
    main([*ARGS, "--compile-blocks", "--tp", "1", "--memory-limit", "0.3", "-o", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)
    plan = load_plan(str(out))
    assert plan.training.compile_blocks
    # the limit is met by recomputing or offloading, which compiled blocks run
    assert any(
        s.recompute_layers or s.recompute_attention or s.recompute_activation or any(s.offload.as_tuple())
        for s in plan.stages
    )
    again = simulate_plan(plan, load_profile(PROFILE))
    assert again.iteration_time_s == pytest.approx(res["predicted"]["iteration_time_s"], rel=1e-12)


def test_compiled_stages_choose_what_eager_stages_choose_with_dropout():
    """With attention dropout a compiled stage may recompute its attention core on any tp, as an
    eager stage may (a rank's own masks are redrawn from the kept seed, `mist.rules.compiled_blocks`)."""
    model = replace(load_model(MODEL), attention_dropout=0.1)

    def choices(compiled: bool) -> set:
        tables = StageTables(
            model, load_profile(PROFILE), 256, False, get_space("full"), 1, 1, 1, 2, 2, 8, False, compiled=compiled
        )
        return {(tdb[0], sel[0]) for tdb, sel in tables.stage_choices()}

    assert choices(True) == choices(False) == {(1, False), (1, True), (2, False), (2, True)}


def test_framework_spaces_refuse_compiled_blocks(capsys):
    with pytest.raises(SystemExit) as e:
        main([*ARGS, "--compile-blocks", "--target", "megatron"])
    assert e.value.code == 2
    assert "--compile-blocks searches the full, mist-paper, torchtitan-0.3 spaces, not megatron-0.19" in (
        capsys.readouterr().err
    )


def test_torchtitan_plans_for_its_compiled_blocks(tmp_path, capsys):
    """torchtitan compiles each decoder block as Mist does: its space is searched with compiled
    blocks, each candidate priced by the framework search's evaluator as `mist simulate` prices
    it, and the plan exports with torchtitan's compile flags."""
    from mist.tune.baselines import _Evaluator

    out = tmp_path / "plan.json"
    main([*ARGS, "--compile-blocks", "--target", "torchtitan", "-o", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)
    plan = load_plan(str(out))
    assert plan.training.compile_blocks
    again = simulate_plan(plan, load_profile(PROFILE))
    assert again.iteration_time_s == pytest.approx(res["predicted"]["iteration_time_s"], rel=1e-12)
    ev = _Evaluator(plan.model, plan.cluster, plan.training, load_profile(PROFILE))
    assert ev.cost(plan.micro_batches, plan.stages).time == pytest.approx(again.iteration_time_s, rel=1e-12)
    main(["export", str(out), "--to", "torchtitan", "-o", str(tmp_path / "tt"), "--json"])
    args = json.loads(capsys.readouterr().out)["args"]
    assert args[args.index("--compile.enable") + 1 : args.index("--compile.enable") + 3] == [
        "--compile.components",
        "model",
    ]


def test_compiled_blocks_search_zero_bubble_priced_as_simulated():
    """ZB-H1 with compiled blocks: the W of each stage is its blocks' weight-gradient graphs
    (`mist.models.weight_split`), and the tuner's price of its plan is the simulator's."""
    model, prof = load_model(MODEL), load_profile(PROFILE)
    training = TrainingSpec(seq_len=256, global_batch=8, compile_blocks=True)
    cluster = ClusterSpec(gpu=PROFILE, nodes=1, gpus_per_node=2)
    sp = replace(
        get_space("full"), schedules=("zb-h1",), pp_values=(2,), tp_values=(1,), virtual_stages=(1,), seed_space=None
    )
    res = tune(model, cluster, training, prof, sp)
    assert res.plan.schedule == "zb-h1" and res.plan.training.compile_blocks
    again = simulate_plan(res.plan, prof)
    assert again.iteration_time_s == res.predicted.iteration_time_s
    # the last stage's W (the first stage runs its backward whole at W)
    assert again.stages[-1].weight_grad_time_s > 0


def test_gpu_profiles_search_compiled_and_eager_blocks_unless_told(tmp_path, capsys):
    """Without --compile-blocks or --no-compile, a GPU profile is searched with compiled and with
    eager blocks in the spaces that run compiled ones, and the faster plan is kept; a CPU profile,
    and the spaces of frameworks that run their own eager blocks, are searched with eager ones
    (`mist.tune.run.compiles_by_default`)."""
    l4, cpu = load_profile("l4"), load_profile(PROFILE)
    assert all(compiles_by_default(s, l4) for s in ("full", "mist-paper", "torchtitan-0.3"))
    others = ("megatron", "deepspeed", "aceso", "megatron-paper", "megatron-0.19", "deepspeed-0.19")
    assert not any(compiles_by_default(s, l4) for s in others)
    assert not compiles_by_default("full", cpu)
    tiny = str(ROOT / "tests" / "data" / "tiny-llama.yaml")
    args = ["tune", "--model", tiny, "--gpu", "l4", "--gpus-per-node", "1", "--seq", "256", "--global-batch", "4"]
    res = {}
    for extra in ([], ["--compile-blocks"], ["--no-compile"]):
        out = tmp_path / f"plan{len(extra)}{extra[0] if extra else ''}.json"
        main([*args, *extra, "-o", str(out), "--json"])
        r = json.loads(capsys.readouterr().out)
        res[tuple(extra)] = (r["predicted"]["iteration_time_s"], load_plan(str(out)).training.compile_blocks, r)
    (t, compiled, r), (tc, _, rc), (te, _, re) = res[()], res[("--compile-blocks",)], res[("--no-compile",)]
    assert res[("--compile-blocks",)][1] is True and res[("--no-compile",)][1] is False
    assert t == min(tc, te) and compiled is (tc < te)
    assert r["candidates_evaluated"] == rc["candidates_evaluated"] + re["candidates_evaluated"]


def test_the_default_search_tells_its_progress_which_blocks_it_searches(monkeypatch, tmp_path):
    """`mist tune`'s progress line names the search running (eager blocks, then compiled ones),
    and says when the layers of each are traced, those the full space's seed search traces
    included: an empty trace cache here; the compiled search misses fewer traces than start the
    worker processes (the compiled block's family and the head), which this process traces ahead
    of the search, told all the same."""
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MIST_TRACE_WORKERS", "2")
    here, real = [], prefetch.TracePool._trace_here
    monkeypatch.setattr(
        prefetch.TracePool, "_trace_here", lambda pool, todo, told: here.append(todo) or real(pool, todo, told)
    )
    seen: list[tuple] = []
    run_space_either_blocks(
        "full",
        load_model(str(ROOT / "tests" / "data" / "tiny-llama.yaml")),
        ClusterSpec(gpu="l4", nodes=1, gpus_per_node=1),
        TrainingSpec(seq_len=256, global_batch=4),
        load_profile("l4"),
        progress=lambda *told: seen.append(told),
    )
    labels = [told[3] for told in seen]
    order = ["eager blocks: " + TRACING, "eager blocks", "compiled blocks: " + TRACING, "compiled blocks"]
    assert labels == [label for label in order for _ in range(labels.count(label))]
    assert all(labels.count(label) > 0 for label in order)
    assert any(f[0].compiled and f[0].part == "block" for todo in here for f in todo)
    # while tracing: variants done of those missing, and no plan yet
    tracing = [told for told in seen if told[3].endswith(TRACING)]
    assert all(0 < done <= total and best == float("inf") for done, total, best, _ in tracing)
