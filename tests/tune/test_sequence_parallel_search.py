"""Sequence parallelism in the search: the full space tries it on every stage with tp > 1, a
tuned plan carries it and `mist simulate` reproduces the tuner's prediction; the same plan without
it keeps more activation memory."""

from dataclasses import replace

from mist.hardware import load_profile
from mist.plan import StageStrategy
from mist.simulate.plan_sim import simulate_plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.intra import StageTables
from mist.tune.search import _no_more_tp, build_plan, tune
from mist.tune.space import get_space


def test_stage_choices_try_sequence_parallelism_only_with_tp():
    spec, prof = get_preset("llama-7b"), load_profile("l4")
    tables = StageTables(spec, prof, 2048, True, get_space("full"), 1, 8, 1, 4, 4, 32, False)
    choices = tables.stage_choices()
    assert {(tdb[0], sel[2]) for tdb, sel in choices} == {(1, False), (2, False), (2, True), (4, False), (4, True)}
    paper = StageTables(spec, prof, 2048, True, get_space("mist-paper"), 1, 8, 1, 4, 4, 32, False)
    assert not any(sel[2] for _, sel in paper.stage_choices())


def test_tuned_sequence_parallel_plan_resimulates_and_saves_memory():
    spec, prof = get_preset("llama-7b"), load_profile("l4")
    training = TrainingSpec(seq_len=4096, global_batch=8)
    forced = replace(
        get_space("full"),
        name="forced-sp",
        tp_values=(2,),
        sequence_parallel=(True,),
        virtual_stages=(1,),
        seed_space=None,
    )
    r = tune(spec, ClusterSpec("l4", 1, 4), training, prof, forced)
    assert r.plan is not None
    assert all(s.tp == 2 and s.sequence_parallel for s in r.plan.stages)
    sim = simulate_plan(r.plan, prof)
    assert sim.iteration_time_s == r.predicted.iteration_time_s
    off = replace(r.plan, stages=tuple(replace(s, sequence_parallel=False) for s in r.plan.stages))
    sim_off = simulate_plan(off, prof)
    for on_st, off_st in zip(sim.stages, sim_off.stages):
        assert on_st.saved_activation_peak_bytes < off_st.saved_activation_peak_bytes


def test_context_parallelism_is_searched_for_long_sequences_and_resimulates():
    """At 128k tokens the full space splits every sequence over cp ranks (the best plan without
    it recomputes or offloads activations); `mist simulate` reproduces the tuner's prediction."""
    spec, prof = get_preset("llama3-8b"), load_profile("h200")
    r = tune(spec, ClusterSpec("h200", 1, 8), TrainingSpec(seq_len=131072, global_batch=16), prof, "full")
    assert r.plan is not None and all(s.cp > 1 for s in r.plan.stages)
    assert simulate_plan(r.plan, prof).iteration_time_s == r.predicted.iteration_time_s


def test_context_parallel_refinement_adds_no_tensor_parallelism():
    """The cp refinement keeps the TP degrees up to the best plan's largest: its stage choices
    at tp 2 are tp 1 and 2 (with cp 2 in an 8-GPU node), and an explicit list is only cut."""
    spec, prof = get_preset("llama3-8b"), load_profile("h200")
    cluster, training = ClusterSpec("h200", 1, 8), TrainingSpec(seq_len=32768, global_batch=64)
    plan = build_plan(spec, cluster, training, 8, [StageStrategy(32, 1, 8, 2, 4, 2, sequence_parallel=True)])
    narrowed = _no_more_tp(get_space("full"), plan)
    assert narrowed.tp_values == (1, 2) and narrowed.cp_values == get_space("full").cp_values
    tables = StageTables(spec, prof, 32768, True, narrowed, 1, 8, 1, 8, 8, 64, False, cp=2)
    assert {tdb[0] for tdb, _ in tables.stage_choices()} == {1, 2}
    assert _no_more_tp(replace(get_space("full"), tp_values=(2, 8)), plan).tp_values == (2,)
