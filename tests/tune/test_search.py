"""The tuner end to end: its plans re-simulate to exactly its prediction, it is never slower
than a baseline's best (their spaces are inside ours), the paper space keeps its limits."""

import json
from dataclasses import replace

import pytest

from mist.cli import main
from mist.hardware import load_profile
from mist.simulate.plan_sim import simulate_plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import run_space
from mist.tune.search import g_values, stage_meshes


@pytest.fixture(scope="module")
def case():
    return (
        get_preset("gpt3-1.3b"),
        ClusterSpec("l4", 1, 4),
        TrainingSpec(seq_len=2048, global_batch=64, flash_attention=True),
        load_profile("l4"),
    )


@pytest.fixture(scope="module")
def results(case):
    return {sp: run_space(sp, *case) for sp in ("full", "mist-paper", "megatron", "deepspeed", "aceso")}


def test_tuned_plan_resimulates_exactly(case, results):
    r = results["full"]
    assert r.plan is not None and r.predicted.fits
    again = simulate_plan(r.plan, case[3])
    assert again.iteration_time_s == r.predicted.iteration_time_s
    assert r.candidates_evaluated > 1000


@pytest.mark.parametrize("baseline", ["megatron", "deepspeed", "aceso", "mist-paper"])
def test_full_space_never_slower_than_a_baseline(results, baseline):
    ours, theirs = results["full"].iteration_time_s, results[baseline].iteration_time_s
    assert theirs is not None
    assert ours <= theirs * (1 + 1e-9)


def test_same_gradient_dtype_megatron_lies_inside_the_full_space(case):
    """With fp32 gradients for everyone the Megatron plans are literally in the full space."""
    model, cluster, training, prof = case
    t32 = replace(training, grad_dtype="fp32")
    full, meg = (run_space(sp, model, cluster, t32, prof) for sp in ("full", "megatron"))
    assert full.plan.training.grad_dtype == meg.plan.training.grad_dtype == "fp32"
    assert full.iteration_time_s <= meg.iteration_time_s * (1 + 1e-9)


def test_paper_space_limits(results):
    p = results["mist-paper"].plan
    assert p.micro_batches & (p.micro_batches - 1) == 0
    assert len({s.tp for s in p.stages}) == 1
    assert all(s.micro_batch in (1, 2, 4) and s.zero >= 1 for s in p.stages)
    mean = round(24 / len(p.stages))
    assert all(abs(s.layers - mean) <= 2 for s in p.stages)


def test_meshes_and_g_values():
    assert stage_meshes(ClusterSpec("l4", 2, 8), 24) == [(1, 2, 8), (2, 1, 8), (4, 1, 4), (8, 1, 2), (16, 1, 1)]
    assert g_values(24, "divisors") == [1, 2, 3, 4, 6, 8, 12, 24]
    assert g_values(24, "pow2") == [1, 2, 4, 8]


def test_tune_cli_json_and_plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    main(
        [
            "tune",
            "--model",
            "gpt3-1.3b",
            "--gpu",
            "l4",
            "--gpus-per-node",
            "2",
            "--global-batch",
            "32",
            "--no-compile",
            "--json",
            "-o",
            str(out),
        ]
    )
    r = json.loads(capsys.readouterr().out)
    for k in ("plan", "predicted", "tuning_time_s", "candidates_evaluated"):
        assert k in r
    main(["simulate", str(out), "--json"])
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == r["predicted"]["iteration_time_s"]


def test_nothing_fits_exits_2_with_memory_reason(capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "tune",
                "--model",
                "llama-70b",
                "--gpu",
                "l4",
                "--gpus-per-node",
                "1",
                "--global-batch",
                "4",
                "--no-compile",
            ]
        )
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    # 70B on one 24 GiB L4: either the GPU or (with everything offloaded) the host runs out
    assert "GiB" in err and ("needs at least" in err or "need at least" in err)


def test_attention_recompute_is_searched_without_flash_and_resimulates():
    """The knob reaches the plan and `simulate` costs it the same way (a space that forces it on)."""
    from dataclasses import replace

    from mist.tune.intra import StageTables
    from mist.tune.search import tune
    from mist.tune.space import get_space

    spec, prof = get_preset("gpt3-1.3b"), load_profile("l4")
    full = get_space("full")
    args = (spec, prof, 2048)
    rest = (full, 1, 8, 1, 2, 2, 32, False)
    assert StageTables(*args, True, *rest).selective_choices() == [(False, False), (False, True)]
    assert StageTables(*args, False, *rest).selective_choices() == [
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    ]
    paper = StageTables(*args, False, get_space("mist-paper"), *rest[1:]).selective_choices()
    assert paper == [(False, False)]
    forced = replace(full, name="forced", recompute_attention=(True,), recompute_activation=(False,), seed_space=None)
    training = TrainingSpec(seq_len=2048, global_batch=32, flash_attention=False)
    r = tune(spec, ClusterSpec("l4", 1, 2), training, prof, forced)
    assert r.plan is not None
    assert all(s.recompute_attention for s in r.plan.stages)
    assert simulate_plan(r.plan, prof).iteration_time_s == r.predicted.iteration_time_s
    plain = tune(spec, ClusterSpec("l4", 1, 2), training, prof, replace(forced, recompute_attention=(False,)))
    assert not any(s.recompute_attention for s in plain.plan.stages)
    assert plain.iteration_time_s != r.iteration_time_s


def test_activation_recompute_is_searched_and_resimulates():
    """Forced on, every stage of the plan re-runs its MLP activation, `simulate` reproduces the
    tuner's time, and where memory is tight (GPT-7B on 8 L4) the full space uses it and is faster
    than the same space without it."""
    from dataclasses import replace

    from mist.tune.search import tune
    from mist.tune.space import get_space

    spec, prof = get_preset("gpt3-1.3b"), load_profile("l4")
    training = TrainingSpec(seq_len=2048, global_batch=32)
    forced = replace(get_space("full"), name="forced", recompute_activation=(True,), seed_space=None)
    r = tune(spec, ClusterSpec("l4", 1, 2), training, prof, forced)
    assert all(s.recompute_activation for s in r.plan.stages)
    assert simulate_plan(r.plan, prof).iteration_time_s == r.predicted.iteration_time_s

    spec = get_preset("gpt3-7b")
    training = TrainingSpec(seq_len=2048, global_batch=128)
    cluster = ClusterSpec("l4", 1, 8)
    full = tune(spec, cluster, training, prof, "full")
    without = tune(
        spec, cluster, training, prof, replace(get_space("full"), name="no-act", recompute_activation=(False,))
    )
    assert any(s.recompute_activation for s in full.plan.stages)
    assert full.iteration_time_s < without.iteration_time_s
    assert simulate_plan(full.plan, prof).iteration_time_s == full.predicted.iteration_time_s
