"""`mist simulate` end to end on example plans."""

import json
from pathlib import Path

import pytest

from mist.cli import main
from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.plan_sim import plan_timeline, simulate_plan, simulate_with_timeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_json(args, capsys):
    main(args)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["gpt3-1.3b-2xl4-pp2.json", "llama-7b-8xl4-mixed.json"])
def test_simulate_json_keys_and_sums(name, capsys, tmp_path):
    png = tmp_path / "t.png"
    r = run_json(["simulate", str(EXAMPLES / name), "--json", "--timeline", str(png)], capsys)
    for k in ("iteration_time_s", "throughput_samples_per_s", "tokens_per_s", "mfu", "fits", "stages"):
        assert k in r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for s in r["stages"]:
        for k in ("stable_time_s", "delta_time_s", "peak_memory_bytes", "memory_breakdown", "time_breakdown"):
            assert k in s
        assert sum(s["memory_breakdown"].values()) == pytest.approx(s["peak_memory_bytes"], abs=8)
        assert sum(s["time_breakdown"].values()) == pytest.approx(s["stable_time_s"], rel=1e-9)
    assert 0 < r["mfu"] < 1
    assert r["throughput_samples_per_s"] == pytest.approx(
        load_plan(EXAMPLES / name).training.global_batch / r["iteration_time_s"]
    )


def test_one_plan_simulates_alike_from_the_trace_cache():
    """A second simulation (traces cached) predicts the same; its speed: benchmarks/unit_speed.py."""
    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")
    prof = load_profile("l4")
    first = simulate_plan(plan, prof)  # traces (or cache) once
    assert simulate_plan(plan, prof) == first


def test_plan_that_does_not_fit_names_stage_and_overshoot(tmp_path, capsys):
    d = json.loads((EXAMPLES / "gpt3-1.3b-2xl4-pp2.json").read_text())
    d["model"] = "gpt3-7b"
    d["stages"][0]["layers"] = 16
    d["stages"][1]["layers"] = 16
    d["stages"][0]["recompute_layers"] = 0
    f = tmp_path / "big.json"
    f.write_text(json.dumps(d))
    r = run_json(["simulate", str(f), "--json"], capsys)
    assert r["fits"] is False
    assert any(msg.startswith("stage 0 needs") and "over the" in msg for msg in r["memory_problems"])


def test_bad_plan_exits_2(tmp_path, capsys):
    d = json.loads((EXAMPLES / "gpt3-1.3b-2xl4-pp2.json").read_text())
    d["micro_batches"] = 7
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(SystemExit) as e:
        main(["simulate", str(f)])
    assert e.value.code == 2
    assert "global batch" in capsys.readouterr().err


def test_timeline_is_a_record_beside_the_prediction():
    """The event timeline `--timeline` draws is its own record; the prediction has no private keys."""
    plan = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json")
    prof = load_profile("l4")
    pred, tl = simulate_with_timeline(plan, prof)
    assert pred == simulate_plan(plan, prof) and tl == plan_timeline(plan, prof)
    assert not any(k.startswith("_") for k in pred.to_json()) and "event_iteration_time_s" not in pred.to_json()
    assert tl.iteration_time_s == pred.iteration_time_s
    # the 1F1B closed form bounds the event-driven schedule from above, exactly when the stages
    # take equal time; this example's last stage (the loss) is a little faster
    assert tl.event_iteration_time_s <= tl.iteration_time_s * (1 + 1e-12)
    assert tl.event_iteration_time_s == pytest.approx(tl.iteration_time_s, rel=1e-2)
    assert max(end for *_, end in tl.events) == tl.event_iteration_time_s
    S, G = plan.num_stages, plan.micro_batches
    assert len(tl.channels) == len(tl.stable) == S
    assert sum(kind in ("F", "B") for _, kind, *_ in tl.events) == 2 * S * G
    assert [f + b for f, b in tl.stable] == pytest.approx([s.stable_time_s for s in pred.stages], rel=1e-12)
