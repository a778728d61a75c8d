"""A search its time budget cuts short says so (`TuneResult.budget_ran_out`, the CLI's sentence);
a search that went through its whole space does not, however long it took."""

import json

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


def test_the_cli_tells_the_user_and_the_json_records_it(capsys):
    args = ["--model", "gpt3-1.3b", "--gpu", "l4", "--gpus-per-node", "4", "--global-batch", "64"]
    # the whole search first: it also traces the layers, which a budget of 0.3 s would otherwise
    # spend before it costed a single plan (a cold trace cache, as when this test runs alone)
    main(["tune", *args, "--no-compile", "--json"])
    assert json.loads(capsys.readouterr().out)["budget_ran_out"] is False
    main(["tune", *args, "--no-compile", "--time-budget", "0.3"])
    out = capsys.readouterr().out
    assert "The time budget of 0.3 s ran out before the search was complete" in " ".join(out.split())
    main(["compare", *args, "--time-budget", "0.3", "--json"])
    rows = json.loads(capsys.readouterr().out)["spaces"]
    assert next(r for r in rows if r["space"] == "full")["budget_ran_out"] is True
