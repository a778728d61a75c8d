"""A search its time budget cuts short says so (`TuneResult.budget_ran_out`, the CLI's sentence);
a search that went through its whole space does not, however long it took."""

import json
import re

import pytest

from mist.cli import main
from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import run_space

TRAINING = TrainingSpec(seq_len=2048, global_batch=64, flash_attention=True)


@pytest.fixture(scope="module")
def prof():
    return load_profile("l4")


def test_the_full_space_cut_short_says_so_and_its_plan_is_no_faster(prof):
    model, cluster = get_preset("gpt3-1.3b"), ClusterSpec("l4", 1, 4)
    whole = run_space("full", model, cluster, TRAINING, prof)
    assert whole.plan is not None and not whole.budget_ran_out
    cut = run_space("full", model, cluster, TRAINING, prof, time_budget=0.3)
    assert cut.budget_ran_out
    assert cut.candidates_evaluated < whole.candidates_evaluated
    if cut.plan is not None:  # the best of a part of the space cannot beat the best of all of it
        assert cut.iteration_time_s >= whole.iteration_time_s
    else:
        assert "time budget of 0.3 s ran out" in cut.infeasible_reason
    assert whole.to_json()["budget_ran_out"] is False and cut.to_json()["budget_ran_out"] is True


@pytest.mark.parametrize("space", ["deepspeed", "aceso"])
def test_a_baseline_cut_short_says_so(space, prof):
    model, cluster = get_preset("gpt3-1.3b"), ClusterSpec("l4", 2, 8)
    training = TrainingSpec(seq_len=2048, global_batch=256, flash_attention=True)
    whole = run_space(space, model, cluster, training, prof)
    cut = run_space(space, model, cluster, training, prof, time_budget=0.01)
    assert not whole.budget_ran_out and cut.budget_ran_out
    assert cut.candidates_evaluated < whole.candidates_evaluated
    assert cut.plan is not None and cut.iteration_time_s >= whole.iteration_time_s


def test_a_space_searched_through_in_one_batch_is_not_cut(prof):
    """Megatron-LM's space on 2 GPUs is a few dozen candidates, costed in one batch: complete even
    when that batch takes longer than the budget."""
    model, cluster = get_preset("gpt3-1.3b"), ClusterSpec("l4", 1, 2)
    res = run_space("megatron", model, cluster, TRAINING, prof, time_budget=1e-6)
    assert res.plan is not None and not res.budget_ran_out


def test_the_cli_tells_the_user_and_the_json_records_it(capsys, monkeypatch, tmp_path):
    args = ["--model", "gpt3-1.3b", "--gpu", "l4", "--gpus-per-node", "4", "--global-batch", "64"]
    # an empty trace cache: tracing the layers spends the budget before a plan is costed, and the
    # user is told so, and that a rerun reads the traces from disk
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MIST_TRACE_WORKERS", "2")
    with pytest.raises(SystemExit) as exit_:
        main(["tune", *args, "--no-compile", "--time-budget", "0.3"])
    said = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2 and "The time budget of 0.3 s ran out before any fitting plan was found." in said
    assert re.search(r"Tracing the model's layer variants took \d+\.\d s of it; they are cached on disk now", said)
    main(["tune", *args, "--no-compile", "--json"])
    whole = json.loads(capsys.readouterr().out)
    assert whole["budget_ran_out"] is False and whole["tracing_time_s"] < whole["tuning_time_s"]
    main(["tune", *args, "--no-compile", "--time-budget", "0.3"])
    out = " ".join(capsys.readouterr().out.split())
    assert "The time budget of 0.3 s ran out before the search was complete" in out
    assert "Tracing" not in out and "tracing layer variants" not in out
    main(["compare", *args, "--time-budget", "0.3", "--json"])
    rows = json.loads(capsys.readouterr().out)["spaces"]
    assert next(r for r in rows if r["space"] == "full")["budget_ran_out"] is True
    assert all(0 <= r["tracing_time_s"] <= r["tuning_time_s"] for r in rows)
    # the table shows each space's tracing time beside its tuning time (none now: all cached)
    main(["compare", *args, "--time-budget", "0.3"])
    table = capsys.readouterr().out
    assert "(tracing)" in table and re.search(r"│ +full │.*│ +\d+\.\d \(0\.0\)\*? │", table), table
    assert "what tracing layer variants took" not in " ".join(table.split())
