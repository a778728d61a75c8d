"""Interleaved 1F1B: the order (`rules.interleaved_order`), its event-driven schedule, the
recurrence `mist simulate` prices it with, the closed form the inter-stage program ranks with,
and interleaved plans simulated end to end."""

import json
from pathlib import Path

import numpy as np
import pytest

from mist.hardware import load_profile
from mist.plan import load_plan
from mist.rules.interleaved_order import (
    chunk_recompute,
    chunks_in_flight,
    interleaved_one_f_one_b,
    interleaved_warmup,
)
from mist.rules.pipeline_order import one_f_one_b
from mist.simulate.interleaved import (
    interleaved_event_schedule,
    interleaved_iteration_time,
    interleaved_recurrence,
)
from mist.simulate.pipeline import event_schedule, iteration_time
from mist.simulate.plan_sim import simulate_with_timeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("p,v,G", [(2, 2, 2), (2, 2, 8), (4, 2, 8), (4, 4, 4), (3, 3, 6), (8, 2, 16)])
def test_order_is_complete_and_megatrons(p, v, G):
    for r in range(p):
        ops = interleaved_one_f_one_b(r, p, v, G)
        want = [(k, m, c) for k in "FB" for m in range(G) for c in range(v)]
        assert sorted(ops) == sorted(want)
        warm = interleaved_warmup(r, p, v, G)
        assert warm == min((p - r - 1) * 2 + (v - 1) * p, G * v)
        assert all(k == "F" for k, _, _ in ops[:warm]) and (warm == G * v or ops[warm + 1][0] == "B")
        # a micro-batch's chunks run in model order forward and in reverse backward
        for m in range(G):
            assert [c for k, mm, c in ops if k == "F" and mm == m] == list(range(v))
            assert [c for k, mm, c in ops if k == "B" and mm == m] == list(range(v))[::-1]
    # the first rank holds the most micro-batch chunks
    held = [chunks_in_flight(r, p, v, G) for r in range(p)]
    assert held[0] == max(held) and held == sorted(held, reverse=True)


def test_one_chunk_is_plain_1f1b():
    for p, G in ((1, 3), (3, 5), (4, 8)):
        for r in range(p):
            assert [(k, m) for k, m, _ in interleaved_one_f_one_b(r, p, 1, G)] == list(one_f_one_b(r, p, G))


def test_needs_micro_batches_a_multiple_of_the_ranks():
    with pytest.raises(ValueError):
        interleaved_one_f_one_b(0, 4, 2, 6)


def test_chunk_recompute_spreads_evenly():
    assert chunk_recompute(0, (3, 3)) == (0, 0)
    assert chunk_recompute(5, (3, 3)) == (3, 2)
    assert chunk_recompute(4, (1, 3, 3)) == (1, 2, 1)
    assert sum(chunk_recompute(7, (2, 2, 3))) == 7


@pytest.mark.parametrize("p,v,G", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16), (3, 2, 3)])
def test_uniform_bubble_shrinks_by_v(p, v, G):
    """Equal chunks of forward 1, backward 2 (a stage's micro-batch takes 3·v): the iteration is
    (G·v + p − 1) chunk-ops, so the bubble (p − 1)·3 of plain 1F1B's stage time shrinks by v."""
    f = [[1.0 / v] * v for _ in range(p)]
    b = [[2.0 / v] * v for _ in range(p)]
    z = [[0.0] * v for _ in range(p)]
    ev, events = interleaved_event_schedule(f, b, z, z, G)
    assert ev == pytest.approx((G * v + p - 1) * 3.0 / v)
    assert ev - 3.0 * G == pytest.approx((p - 1) * 3.0 / v)
    assert float(interleaved_recurrence(f, b, z, z, G)) == pytest.approx(ev, rel=1e-12)
    assert float(interleaved_iteration_time(f, b, z, z, G)) == pytest.approx(ev, rel=1e-12)
    assert sum(k in "FB" for _, k, *_ in events) == 2 * p * v * G


def _random_pipelines(n, seed=0):
    """Random imbalanced pipelines: ranks ±50 %, chunks ±20 %, backward ≈ 2× forward, one-off
    extras up to two thirds of a micro-batch's stage time."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        v = int(rng.choice([2, 3, 4]))
        p = int(rng.integers(2, 7))
        G = p * int(rng.integers(1, 5))
        f = rng.uniform(0.5, 1.5, (p, 1)) * rng.uniform(0.8, 1.2, (p, v)) / v
        b = 2 * f * rng.uniform(0.9, 1.1, (p, v))
        X = rng.uniform(0, 2, (p, v)) / v
        Y = rng.uniform(0, 2, (p, v)) / v
        yield f, b, X, Y, G


def test_recurrence_is_the_event_schedule_on_random_imbalanced_pipelines():
    """The price `mist simulate` and the tuner report: the event schedule's time, compiled into a
    recurrence (vectorized over candidates); relative error ≤ 1e-12 on every pipeline."""
    cases = list(_random_pipelines(300))
    errs = []
    for f, b, X, Y, G in cases:
        ev, _ = interleaved_event_schedule(f.tolist(), b.tolist(), X.tolist(), Y.tolist(), G)
        errs.append(abs(float(interleaved_recurrence(f, b, X, Y, G)) - ev) / ev)
    assert np.max(errs) < 1e-12
    # vectorized over a leading candidate axis
    f, b, X, Y, G = cases[0]
    batch = interleaved_recurrence(np.stack([f, 2 * f]), np.stack([b, 2 * b]), np.stack([X, X]), np.stack([Y, Y]), G)
    assert batch[0] == pytest.approx(float(interleaved_recurrence(f, b, X, Y, G)))
    assert batch[1] == pytest.approx(float(interleaved_recurrence(2 * f, 2 * b, X, Y, G)))


def test_closed_form_tracks_the_event_schedule():
    """The closed form the inter-stage program ranks splits with: within a few percent of the
    explicit schedule (as the plain 1F1B closed form is, `test_pipeline`)."""
    errs = []
    for f, b, X, Y, G in _random_pipelines(300, seed=1):
        ev, _ = interleaved_event_schedule(f.tolist(), b.tolist(), X.tolist(), Y.tolist(), G)
        errs.append(abs(float(interleaved_iteration_time(f, b, X, Y, G)) - ev) / ev)
    assert np.median(errs) < 0.05
    assert np.max(errs) < 0.25


def test_one_chunk_matches_plain_1f1b_schedule():
    rng = np.random.default_rng(2)
    for _ in range(50):
        p = int(rng.integers(1, 6))
        G = int(rng.integers(1, 12))
        f, b = rng.uniform(0.5, 1.5, p), rng.uniform(1, 3, p)
        X, Y = rng.uniform(0, 2, p), rng.uniform(0, 2, p)
        ev, _ = event_schedule(list(f), list(b), list(X), list(Y), G)
        col = [[x] for x in f], [[x] for x in b], [[x] for x in X], [[x] for x in Y]
        assert interleaved_event_schedule(*col, G)[0] == pytest.approx(ev, rel=1e-12)
        assert float(interleaved_recurrence(*(np.array(c) for c in col), G)) == pytest.approx(ev, rel=1e-12)
        assert float(interleaved_iteration_time(*(np.array(c) for c in col), G)) == pytest.approx(
            float(iteration_time(f + b, G, first=X, last=Y, fwd=f)), rel=1e-12
        )


def _interleaved_example(tmp_path, v):
    d = json.loads((EXAMPLES / "gpt3-1.3b-2xl4-pp2.json").read_text())
    d["virtual_stages"] = v
    for s in d["stages"]:
        s["chunk_layers"] = [s["layers"] // v] * v
    f = tmp_path / f"v{v}.json"
    f.write_text(json.dumps(d))
    return load_plan(f)


def test_interleaved_plan_simulates(tmp_path):
    """A 2-stage plan with 2 and 4 chunks per stage: the reported time is the event schedule's, it
    is faster than plain 1F1B, the p2p grows by v, and the stages hold more in-flight activations."""
    prof = load_profile("l4")
    base = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json")
    p1, _ = simulate_with_timeline(base, prof)
    times = [p1.iteration_time_s]
    for v in (2, 4):
        pred, tl = simulate_with_timeline(_interleaved_example(tmp_path, v), prof)
        assert tl.event_iteration_time_s == pytest.approx(pred.iteration_time_s, rel=1e-12)
        assert sum(k in "FB" for _, k, *_ in tl.events) == 2 * 2 * v * base.micro_batches
        for s, s1 in zip(pred.stages, p1.stages):
            assert sum(s.time_breakdown.values()) == pytest.approx(s.stable_time_s, rel=1e-9)
            # every chunk receives at both ends but the model's first and last
            assert s.time_breakdown["p2p_s"] == pytest.approx((2 * v - 1) * s1.time_breakdown["p2p_s"])
            assert s.saved_activation_peak_bytes > s1.saved_activation_peak_bytes
        times.append(pred.iteration_time_s)
    # the bubble of about one stage time out of 17 shrinks by v, the extra p2p and block-stream
    # edges of the chunks cost a little
    assert times[1] < times[0] and times[2] < times[0]


def test_deepspeed_refuses_interleaved_plans_and_megatron_keeps_their_chunks(tmp_path, capsys):
    from mist.cli import main

    _interleaved_example(tmp_path, 2)
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path / "v2.json"), "--to", "deepspeed", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "interleaved 1F1B (virtual_stages 2)" in " ".join(capsys.readouterr().err.split())
    # DeepSpeed's nearest plan is the plain pipeline of the same stages; Megatron-LM's keeps the chunks
    from mist.export import TARGETS

    plan = load_plan(tmp_path / "v2.json")
    near = TARGETS["deepspeed"].nearest(plan)
    assert near.virtual_stages == 1 and all(s.chunk_layers is None for s in near.stages)
    assert [s.layers for s in near.stages] == [s.layers for s in plan.stages]
    near = TARGETS["megatron"].nearest(plan)
    assert near.virtual_stages == 2 and [s.chunk_layers for s in near.stages] == [s.chunk_layers for s in plan.stages]
    assert TARGETS["megatron"].problems(near) == []


def test_the_documented_example_plan_loads():
    from mist.plan import plan_from_dict

    text = (EXAMPLES.parent / "docs" / "cli.md").read_text()
    block = text.split('"virtual_stages": 2,', 1)[0].rsplit("```json", 1)[1] + '"virtual_stages": 2,'
    block += text.split('"virtual_stages": 2,', 1)[1].split("```", 1)[0]
    p = plan_from_dict(json.loads(block))
    assert p.virtual_stages == 2 and p.stages[0].chunks() == (6, 6)


@pytest.mark.parametrize("p,v,G", [(2, 2, 4), (4, 2, 8), (4, 4, 4), (3, 3, 6)])
def test_saved_activations_in_flight(p, v, G):
    """Equal chunks: a rank holds `chunks_in_flight` chunks' saved activations at most, rank 0 the
    most (Megatron-LM's (p − r − 1)·2 + (v − 1)·p + 1 during warm-up, at most G·v). Unequal
    chunks: the peak of the order walked chunk-op by chunk-op."""
    from mist.simulate.interleaved import held_saved_peak

    rng = np.random.default_rng(p * 100 + v * 10 + G)
    for r in range(p):
        n = chunks_in_flight(r, p, v, G)
        assert n == min((p - r - 1) * 2 + (v - 1) * p + 1, G * v)
        assert float(held_saved_peak(r, p, G, np.full(v, 3.0))) == pytest.approx(3.0 * n)
        saved = rng.uniform(1, 2, v)
        held, peak = np.zeros(v), 0.0
        for kind, _, c in interleaved_one_f_one_b(r, p, v, G):
            held[c] += 1 if kind == "F" else -1
            peak = max(peak, float(held @ saved))
        batch = held_saved_peak(r, p, G, np.stack([saved, 2 * saved]))
        assert batch.tolist() == pytest.approx([peak, 2 * peak])
    assert [chunks_in_flight(r, p, v, G) for r in range(p)][0] == max(chunks_in_flight(r, p, v, G) for r in range(p))
