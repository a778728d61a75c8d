"""One rule decides whether a stage fits a GPU (`mist.simulate.gpu_fit`): the simulator, `mist
estimate`, the tuner and the baselines agree on it at its edge, and device memory that a profile
measured outside PyTorch's allocator (the CUDA context) comes off what the allocator can have."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.estimate import estimate
from mist.simulate.gpu_fit import ALLOCATOR_MARGIN, fits_gpu, need_bytes, usable_bytes
from mist.simulate.plan_sim import simulate_plan
from mist.specs.loading import load_model
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.baselines import tune_megatron
from mist.tune.search import tune

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = str(Path(__file__).resolve().parents[1] / "data" / "tiny-llama.yaml")
MiB = 2**20


def test_need_and_capacity():
    l4 = load_profile("l4")
    assert l4.outside_allocator_bytes is None and usable_bytes(l4) == l4.memory_bytes
    ctx = replace(l4, outside_allocator_bytes=512 * MiB)
    assert usable_bytes(ctx) == l4.memory_bytes - 512 * MiB
    edge = usable_bytes(ctx) / (1 + ALLOCATOR_MARGIN)
    assert need_bytes(edge) == pytest.approx(usable_bytes(ctx))
    assert list(fits_gpu([edge * 0.999, edge * 1.001], ctx)) == [True, False]


def test_simulated_plan_at_the_edge_does_not_fit_once_the_context_is_counted():
    plan = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json")
    l4 = load_profile("l4")
    peak = max(s.peak_memory_bytes for s in simulate_plan(plan, l4).stages)
    # a GPU with 100 MiB more than the stage needs: it fits, until 200 MiB are outside the allocator
    roomy = replace(l4, memory_bytes=int(need_bytes(peak)) + 100 * MiB)
    assert simulate_plan(plan, roomy).fits
    sim = simulate_plan(plan, replace(roomy, outside_allocator_bytes=200 * MiB))
    assert not sim.fits and sim.capacity_bytes == roomy.memory_bytes - 200 * MiB
    msg = next(m for m in sim.memory_problems if m.startswith("stage"))
    assert "left to PyTorch's allocator (0.20 GiB are in use outside it)" in msg, msg


def test_estimate_fits_with_the_margin_and_without_the_context():
    spec = load_model("gpt3-1.3b")
    l4 = load_profile("l4")
    peak = estimate(spec, l4, 2048, 1).model.peak_bytes
    for memory, outside, fits in (
        (int(need_bytes(peak)) + MiB, None, True),
        (peak + MiB, None, False),  # the peak alone fits; with the allocator margin it does not
        (int(need_bytes(peak)) + MiB, 2 * MiB, False),
    ):
        prof = replace(l4, memory_bytes=memory, outside_allocator_bytes=outside)
        m = estimate(spec, prof, 2048, 1).model
        assert (m.fits, m.capacity_bytes) == (fits, memory - (outside or 0))


def test_tuner_and_baseline_refuse_what_only_the_context_makes_too_big():
    spec = load_model(TINY)
    cluster = ClusterSpec("l4", 1, 1)
    training = TrainingSpec(seq_len=64, global_batch=4)
    l4 = load_profile("l4")
    free = tune(spec, cluster, training, l4)
    assert free.plan is not None
    # the whole device but 1 MiB is the CUDA context's: nothing the tuner knows fits in what is left
    crowded = replace(l4, outside_allocator_bytes=l4.memory_bytes - MiB)
    res = tune(spec, cluster, training, crowded)
    assert res.plan is None and "in use outside it" in res.infeasible_reason, res.infeasible_reason
    base = tune_megatron(spec, cluster, training, crowded)
    assert base.plan is None and "in use outside it" in base.infeasible_reason, base.infeasible_reason


def test_memory_limit_must_leave_room_above_the_context(tmp_path, capsys):
    from mist.cli import main

    d = load_profile("l4").to_dict()
    d["outside_allocator_bytes"] = 2**30
    path = tmp_path / "l4-measured.json"
    path.write_text(json.dumps(d))
    with pytest.raises(SystemExit) as e:
        main(["tune", "--model", TINY, "--gpu", str(path), "--memory-limit", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-limit must lie in (1.00, " in err[0], err
    assert "above what is in use outside PyTorch's allocator), got 0.5." in err[0], err
