"""`mist tune --compile-blocks`: the search stays inside what compiled blocks can run
(`mist.rules.compiled_blocks`), its plan says so and re-simulates to its prediction through the
compiled analysis, and the spaces that stand for other frameworks refuse it."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mist.cli import main
from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.plan_sim import simulate_plan
from mist.specs.loading import load_model
from mist.tune.space import compiled_space, get_space

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
    assert plan.schedule != "zb-h1"
    # the limit is met by recomputing or offloading, which compiled blocks run
    assert any(
        s.recompute_layers or s.recompute_attention or s.recompute_activation or any(s.offload.as_tuple())
        for s in plan.stages
    )
    again = simulate_plan(plan, load_profile(PROFILE))
    assert again["iteration_time_s"] == pytest.approx(res["predicted"]["iteration_time_s"], rel=1e-12)


def test_compiled_space_keeps_every_knob_compiled_blocks_run():
    full, compiled = get_space("full"), compiled_space(get_space("full"), load_model(MODEL))
    assert "zb-h1" in full.schedules and "zb-h1" not in compiled.schedules
    for knob in ("cp_values", "recompute_attention", "recompute_activation", "tp_values", "sequence_parallel"):
        assert getattr(compiled, knob) == getattr(full, knob), knob


def test_compiled_space_keeps_dropout_on_the_shared_stream():
    """Attention dropout: one tensor-parallel rank a stage; hidden dropout: no sequence
    parallelism (`mist.rules.compiled_blocks`); the rest of the space stays."""
    full, model = get_space("full"), load_model(MODEL)
    attn = compiled_space(full, replace(model, attention_dropout=0.1))
    assert attn.tp_values == (1,) and attn.cp_values == full.cp_values
    hidden = compiled_space(full, replace(model, hidden_dropout=0.1))
    assert hidden.tp_values is None and hidden.sequence_parallel == (False,)


def test_compiled_tune_refuses_tensor_parallel_attention_dropout(tmp_path, capsys):
    model = tmp_path / "m.yaml"
    model.write_text(Path(MODEL).read_text() + "attention_dropout: 0.1\n")
    args = [a if a != MODEL else str(model) for a in ARGS]
    with pytest.raises(SystemExit) as e:
        main([*args, "--compile-blocks", "--no-flash", "--tp", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "compiled blocks drop attention probabilities only with tp = 1, not 2" in err


def test_framework_spaces_refuse_compiled_blocks(capsys):
    with pytest.raises(SystemExit) as e:
        main([*ARGS, "--compile-blocks", "--target", "megatron"])
    assert e.value.code == 2
    assert "--compile-blocks searches the full and mist-paper spaces" in capsys.readouterr().err
