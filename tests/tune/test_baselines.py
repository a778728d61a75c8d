"""Baseline search spaces (Megatron-LM, DeepSpeed, Aceso) costed by the plan simulator."""

import json
import time

import pytest

import mist.tune.baselines as bl
from mist.hardware import load_profile
from mist.plan import Plan, plan_from_dict
from mist.simulate.plan_sim import simulate_plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.baselines import even_split, stage_mesh, tune_aceso, tune_deepspeed, tune_megatron
from mist.tune.compare import short_summary
from mist.tune.result import TuneResult
from mist.tune.space import tp_degrees

TUNERS = {"megatron": tune_megatron, "deepspeed": tune_deepspeed, "aceso": tune_aceso}


def case(name, gpus, flash, nodes=1):
    model = get_preset(name)
    cluster = ClusterSpec("l4", nodes, gpus)
    training = TrainingSpec(seq_len=2048, global_batch=16 * gpus * nodes, flash_attention=flash)
    return model, cluster, training


@pytest.fixture(scope="module")
def prof():
    return load_profile("l4")


@pytest.fixture(scope="module")
def small():
    return case("gpt3-1.3b", 2, False)


@pytest.fixture(scope="module")
def results(small, prof):
    return {name: tune(*small, prof) for name, tune in TUNERS.items()}


def is_pow2(n):
    return n > 0 and n & (n - 1) == 0


# ------------------------------------------------------------------ shared rules
def test_stage_mesh_and_split():
    assert stage_mesh(ClusterSpec("l4", 1, 8), 4) == (1, 2)
    assert stage_mesh(ClusterSpec("l4", 4, 8), 2) == (2, 8)
    assert stage_mesh(ClusterSpec("l4", 2, 8), 4) == (1, 4)
    assert stage_mesh(ClusterSpec("l4", 3, 8), 2) is None  # 3 nodes cannot be halved
    assert stage_mesh(ClusterSpec("l4", 1, 8), 3) is None
    assert even_split(24, 4) == [6, 6, 6, 6]
    assert even_split(26, 4) == [7, 7, 6, 6]


# ------------------------------------------------------------------ every baseline
@pytest.mark.parametrize("name", list(TUNERS))
def test_baseline_returns_a_valid_plan_that_resimulates(name, results, prof):
    r = results[name]
    assert isinstance(r, TuneResult) and r.space == name
    assert isinstance(r.plan, Plan) and r.infeasible_reason is None
    assert r.candidates_evaluated > 0 and r.tuning_time_s > 0
    again = simulate_plan(r.plan, prof)
    assert again.fits and r.predicted.fits
    assert again.iteration_time_s == pytest.approx(r.predicted.iteration_time_s, rel=1e-12)
    assert not any(k.startswith("_") for k in r.predicted.to_json())
    d = json.loads(json.dumps(r.to_json()))
    assert set(d) == {
        "space",
        "plan",
        "predicted",
        "tuning_time_s",
        "candidates_evaluated",
        "infeasible_reason",
        "budget_ran_out",
        "tracing_time_s",
    }
    assert d["budget_ran_out"] is False  # no budget: the whole space was searched
    assert 0 <= d["tracing_time_s"] <= d["tuning_time_s"]
    assert plan_from_dict(d["plan"]) == r.plan


@pytest.mark.parametrize("name", list(TUNERS))
def test_baseline_picks_the_fastest_of_what_it_evaluated(name, small, prof, monkeypatch):
    """The result is the minimum over every feasible candidate the search costed."""
    seen = []
    orig = bl._Evaluator.cost

    def spy(self, G, stages):
        c = orig(self, G, stages)
        seen.append(c)
        return c

    monkeypatch.setattr(bl._Evaluator, "cost", spy)
    r = TUNERS[name](*small, prof)
    best = min(c.time for c in seen if c.fits)
    assert r.predicted.iteration_time_s == pytest.approx(best, rel=1e-9)


def test_fast_costing_matches_simulate_plan(prof):
    """The memoized per-stage costing is simulate_plan, also on heterogeneous plans."""
    model, cluster, training = case("gpt3-2.7b", 4, True)
    ev = bl._Evaluator(model, cluster, training, prof)
    plans = []
    for G, stages in bl._deepspeed_candidates(model, cluster, training):
        if len(plans) < 40 or len(stages) > 1:
            plans.append((G, stages))
    G, start = bl._aceso_start(model, cluster, training, 2, stage_mesh(cluster, 2), 2)
    moves = [(G, moved) for moved in bl._aceso_moves(start, 0, 4, [1, 2], flash=False)]
    assert any(len({s.tp for s in st}) > 1 for _, st in moves)
    assert any(st[0].recompute_activation for _, st in moves) and any(st[0].recompute_attention for _, st in moves)
    for G, stages in plans[::3] + moves:
        c = ev.cost(G, stages)
        sim = simulate_plan(ev.plan(G, stages), prof)
        assert c.time == pytest.approx(sim.iteration_time_s, rel=1e-9)
        assert c.fits == sim.fits


def test_disagreeing_fast_path_falls_back_to_simulate_plan(small, prof, monkeypatch):
    real = bl.iteration_time
    monkeypatch.setattr(bl, "iteration_time", lambda *a, **k: real(*a, **k) * 1.5)
    r = tune_megatron(*small, prof)
    assert r.plan is not None
    assert simulate_plan(r.plan, prof).iteration_time_s == pytest.approx(r.predicted.iteration_time_s)


# ------------------------------------------------------------------ Megatron-LM
def test_megatron_space_rules(prof):
    model, cluster, training = case("gpt3-2.7b", 4, True)
    cands = list(bl._megatron_candidates(model, cluster, training))
    assert len(cands) > 10
    for G, stages in cands + [(tune_megatron(model, cluster, training, prof).plan.micro_batches, None)]:
        if stages is None:
            continue
        S = len(stages)
        s0 = stages[0]
        assert all(s == s0 for s in stages)  # uniform split, same strategy
        assert is_pow2(S) and is_pow2(s0.dp) and is_pow2(s0.tp)
        assert S * s0.dp * s0.tp == cluster.world_size
        assert s0.layers * S == model.num_layers
        assert s0.recompute_layers in (0, s0.layers)  # all or nothing
        assert s0.zero == (1 if s0.dp > 1 else 0)
        assert s0.offload.as_tuple() == (0, 0, 0, 0)
        assert s0.micro_batch in (1, 2, 4, 8)
        assert s0.micro_batch * s0.dp * G == training.global_batch


def test_megatron_result_rules(results):
    p = results["megatron"].plan
    s0 = p.stages[0]
    assert all(s == s0 for s in p.stages)
    assert is_pow2(p.num_stages) and is_pow2(s0.dp) and is_pow2(s0.tp)
    assert s0.recompute_layers in (0, s0.layers)


def test_megatron_accumulates_bf16_gradients_in_fp32(results, prof):
    """Megatron-LM with bf16 parameters keeps fp32 gradients: 2 + 4 + 12/dp bytes per parameter."""
    p = results["megatron"].plan
    assert p.training.param_dtype == "bf16" and p.training.grad_dtype == "fp32"
    assert short_summary(p).startswith(f"G {p.micro_batches}, fp32 grads, ")  # what `mist compare` shows
    st = simulate_plan(p, prof).stages[0]
    mem, s = st.memory_breakdown, p.stages[0]
    assert s.zero <= 1 and p.micro_batches > 1  # the whole gradient buffer is kept
    assert mem["grads_bytes"] == 2 * mem["weights_bytes"]
    shards = s.dp if s.zero == 1 else 1
    assert mem["optimizer_bytes"] == pytest.approx(6 * mem["weights_bytes"] / shards, rel=1e-9)
    # the same plan with gradients in the parameter dtype holds 2 bytes less per parameter
    same = plan_from_dict({**p.to_dict(), "training": {**p.to_dict()["training"], "grad_dtype": None}})
    mem16 = simulate_plan(same, prof).stages[0].memory_breakdown
    assert mem16["grads_bytes"] == mem["weights_bytes"]
    assert mem16["optimizer_bytes"] == mem["optimizer_bytes"]


def test_megatron_keeps_fp16_gradients_in_fp16(small, prof):
    model, cluster, training = small
    fp16 = TrainingSpec(
        seq_len=training.seq_len,
        global_batch=training.global_batch,
        param_dtype="fp16",
        compute_dtype="fp16",
        flash_attention=training.flash_attention,
    )
    assert tune_megatron(model, cluster, fp16, prof).plan.training.grad_dtype is None


# ------------------------------------------------------------------ DeepSpeed
def test_deepspeed_space_rules(results):
    model, cluster, training = case("gpt3-2.7b", 4, True)
    chosen = results["deepspeed"].plan
    cands = [(G, st, training.global_batch) for G, st in bl._deepspeed_candidates(model, cluster, training)]
    cands.append((chosen.micro_batches, chosen.stages, chosen.training.global_batch))
    kinds = set()
    for G, stages, B in cands:
        S = len(stages)
        for s in stages:
            off = s.offload
            if any(off.as_tuple()):
                assert S == 1  # offload only without PP
                kinds.add("infinity" if off.weights else "offload")
            if off.weights or off.grads:
                assert s.zero == 3 and off.weights == off.grads == off.optimizer == 1.0
            if s.dp == 1:
                assert s.zero == 0
            if S > 1:
                assert s.zero <= 1  # no ZeRO-2/3 with PP
            assert s.recompute_layers in (0, s.layers)
            assert s.micro_batch in (1, 2, 4, 8, 16)
            assert s.micro_batch * s.dp * G == B
        assert max(s.layers for s in stages) - min(s.layers for s in stages) <= 1
    assert kinds == {"offload", "infinity"}
    assert {s.tp for _, st, _ in cands for s in st} >= {1, 2}


# ------------------------------------------------------------------ Aceso
def test_aceso_never_worse_than_its_balanced_start(small, results, prof):
    model, cluster, training = small
    starts = []
    for S, mesh in bl._depths(model, cluster):
        for b in bl.ACESO_MICRO_BATCHES:
            st = bl._aceso_start(model, cluster, training, S, mesh, b)
            if st is None:
                continue
            G, stages = st
            plan = Plan(model, cluster, training, G, stages)
            sim = simulate_plan(plan, prof)
            assert all(s.recompute_layers == 0 and s.tp == 1 for s in stages)
            if sim.fits:
                starts.append(sim.iteration_time_s)
                ev = bl._Evaluator(model, cluster, training, prof)
                _, c = bl._aceso_walk(ev, G, stages, time.monotonic() + 30, tp_degrees(model, mesh[1]))
                assert c.fits and c.time <= sim.iteration_time_s * (1 + 1e-12)
    assert starts
    assert results["aceso"].predicted.iteration_time_s <= min(starts) * (1 + 1e-12)
    assert all(s.offload.as_tuple() == (0, 0, 0, 0) for s in results["aceso"].plan.stages)


def test_aceso_restores_fit_from_an_oversized_start(prof):
    model, cluster, training = case("gpt3-2.7b", 4, True)
    G, start = bl._aceso_start(model, cluster, training, 2, stage_mesh(cluster, 2), 2)
    ev = bl._Evaluator(model, cluster, training, prof)
    assert not ev.cost(G, start).fits
    best, c = bl._aceso_walk(ev, G, start, time.monotonic() + 30, [1, 2])
    assert c.fits
    assert sum(s.layers for s in best) == model.num_layers
    assert simulate_plan(ev.plan(G, best), prof).fits


def test_aceso_respects_a_spent_time_budget(small, prof):
    """With no time left the walk makes no move: exactly the balanced starts are costed (how long
    that takes is the benchmarks' business, not a unit test's)."""
    model, cluster, training = small
    starts = [
        st
        for pp, mesh in bl._depths(model, cluster)
        for b in bl.ACESO_MICRO_BATCHES
        if (st := bl._aceso_start(model, cluster, training, pp, mesh, b)) is not None
    ]
    r = tune_aceso(*small, prof, time_budget=0.0)
    assert r.candidates_evaluated == len(starts) > 0
    assert r.plan is not None  # every configuration's balanced start is still costed
    assert r.budget_ran_out  # and the result says the walk was stopped
    assert tune_aceso(*small, prof).candidates_evaluated > len(starts)  # unbounded, it does walk


# ------------------------------------------------------------------ nothing fits
@pytest.mark.parametrize("name", list(TUNERS))
def test_impossible_case_reports_memory(name, prof):
    model, cluster, training = case("gpt3-40b", 1, True)
    r = TUNERS[name](model, cluster, training, prof)
    assert r.plan is None and r.predicted is None
    assert "GiB" in r.infeasible_reason and "22.5" in r.infeasible_reason
    assert r.candidates_evaluated > 0
    d = json.loads(json.dumps(r.to_json()))
    assert d["plan"] is None and d["infeasible_reason"] == r.infeasible_reason


def test_no_candidate_at_all_is_explained(prof):
    """Six GPUs cannot be a product of power-of-two (dp, tp, pp): Megatron has nothing to try."""
    model, cluster, training = case("gpt3-1.3b", 6, True)
    r = tune_megatron(model, cluster, training, prof)
    assert r.plan is None and r.candidates_evaluated == 0
    assert r.infeasible_reason.startswith("No megatron candidate exists")


def test_batched_costing_equals_one_at_a_time(prof):
    """`_Evaluator.warm` evaluates the stage rows of many candidates per `StageModel.evaluate`
    (plain and interleaved, chunks first): every cost equals the one-at-a-time one exactly."""
    from mist.export import megatron as mg_export
    from mist.tune.targets import megatron_candidates

    model, cluster, _ = case("llama-2.7b", 8, True)
    training = mg_export.runs_training(TrainingSpec(seq_len=2048, global_batch=64))
    every = list(megatron_candidates(model, cluster, training))
    piped = [c for c in every if len(c[1]) > 1 and not c[1][0].chunk_layers]
    cands = every[:100] + piped[:150] + [c for c in every if c[1][0].chunk_layers][:150]
    assert any(st[0].chunk_layers for _, st in cands) and any(len(st) > 1 and not st[0].chunk_layers for _, st in cands)
    batched, single = (bl._Evaluator(model, cluster, training, prof) for _ in range(2))
    batched.warm(cands)
    for G, stages in cands:
        assert batched.cost(G, stages) == single.cost(G, stages)
