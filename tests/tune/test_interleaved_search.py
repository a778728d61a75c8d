"""Interleaved 1F1B in the tuner: the chunk counts it tries, its plans re-simulate to exactly its
price, and a space with v searched is never slower than the same space without."""

from dataclasses import replace

import pytest

from mist.hardware import load_profile
from mist.simulate.plan_sim import simulate_plan
from mist.simulate.precision import precision_for
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.interleaved import best_interleaved, chunk_counts
from mist.tune.intra import StageTables
from mist.tune.search import build_plan, tune
from mist.tune.space import get_space


@pytest.fixture(scope="module")
def case():
    return (
        get_preset("gpt3-1.3b"),
        ClusterSpec("l4", 1, 4),
        TrainingSpec(seq_len=2048, global_batch=64, flash_attention=True),
        load_profile("l4"),
    )


def test_chunk_counts_follow_the_frameworks_constraints():
    assert chunk_counts(24, 2, 8, (1, 2, 4)) == [2, 4]
    assert chunk_counts(24, 4, 8, (1, 2, 4)) == [2]  # 24 blocks are not 16 equal chunks
    assert chunk_counts(24, 4, 6, (1, 2, 4)) == []  # G not a multiple of pp
    assert chunk_counts(24, 1, 8, (1, 2, 4)) == []  # no pipeline
    assert chunk_counts(24, 2, 8, (1,)) == []


@pytest.mark.parametrize("pp,G,v", [(2, 8, 2), (4, 16, 2), (2, 16, 4)])
def test_interleaved_split_resimulates_exactly(case, pp, G, v):
    model, cluster, training, prof = case
    sp = get_space("full")
    tables = StageTables(
        model,
        prof,
        training.seq_len,
        training.flash_attention,
        sp,
        pp,
        G,
        1,
        4 // pp,
        4,
        training.global_batch,
        False,
        precision_for(training, prof),
    )
    found = best_interleaved(tables, model.num_layers, v)
    assert found is not None
    plan = build_plan(model, cluster, training, G, found.strategies, v)
    assert all(s.chunks() == (24 // (pp * v),) * v for s in plan.stages)
    pred = simulate_plan(plan, prof)
    assert pred.fits
    assert pred.iteration_time_s == pytest.approx(found.time, rel=1e-12)


def test_searching_v_is_never_slower_and_plain_space_stays_plain(case):
    model, cluster, training, prof = case
    sp = replace(get_space("full"), pp_values=(2,), seed_space=None)
    with_v = tune(model, cluster, training, prof, sp)
    without = tune(model, cluster, training, prof, replace(sp, virtual_stages=(1,)))
    assert without.plan.virtual_stages == 1
    assert with_v.iteration_time_s <= without.iteration_time_s * (1 + 1e-12)
    again = simulate_plan(with_v.plan, prof)
    assert again.iteration_time_s == with_v.iteration_time_s
