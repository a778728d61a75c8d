"""`mist estimate` end to end: JSON keys, breakdown sums, and bad input → one sentence, exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mist.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def run_ok(args, capsys):
    main(args)
    return capsys.readouterr().out


def test_estimate_json_has_required_keys_and_breakdown_sums(capsys):
    out = run_ok(
        ["estimate", "--model", "gpt3-1.3b", "--gpu", "h200", "--seq", "2048", "--micro-batch", "2", "--json"], capsys
    )
    r = json.loads(out)
    for k in ("fwd_compute_ms", "bwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms", "saved_activation_bytes", "params"):
        assert k in r["layer"]
    m = r["model"]
    for k in (
        "fwd_bwd_ms",
        "params",
        "weights_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activation_peak_bytes",
        "peak_bytes",
    ):
        assert k in m
    parts = m["weights_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["activation_peak_bytes"]
    assert parts == m["peak_bytes"]
    assert m["optimizer_bytes"] == 6 * m["weights_bytes"] == 12 * m["params"]
    assert sum(m["time_breakdown"].values()) == pytest.approx(m["fwd_bwd_ms"], rel=1e-9)
    assert r["layer"]["fwd_comm_ms"] == 0 and r["layer"]["bwd_comm_ms"] == 0
    assert 0 < r["layer"]["fwd_compute_ms"] < r["layer"]["bwd_compute_ms"]
    # a GPU profile prices compiled blocks unless told not to: the backward's pointwise work fused
    assert r["compiled_blocks"] is True
    eager = json.loads(
        run_ok(
            ["estimate", "--model", "gpt3-1.3b", "--gpu", "h200", "--micro-batch", "2", "--no-compile", "--json"],
            capsys,
        )
    )
    assert eager["compiled_blocks"] is False
    assert eager["layer"]["bwd_compute_ms"] > r["layer"]["bwd_compute_ms"]


def test_tp_adds_comm_and_recompute_adds_a_forward(capsys):
    base = json.loads(run_ok(["estimate", "--model", "llama-7b", "--tp", "2", "--no-compile", "--json"], capsys))
    assert base["layer"]["fwd_comm_ms"] > 0 and base["layer"]["bwd_comm_ms"] > 0
    full = json.loads(
        run_ok(
            ["estimate", "--model", "llama-7b", "--tp", "2", "--recompute", "full", "--no-compile", "--json"], capsys
        )
    )
    assert full["model"]["fwd_bwd_ms"] > base["model"]["fwd_bwd_ms"]
    assert full["layer"]["recompute_ms"] > 0
    assert full["model"]["activation_peak_bytes"] < base["model"]["activation_peak_bytes"]
    assert full["layer"]["saved_activation_bytes"] == 2 * 2048 * 4096


def test_human_table(capsys):
    out = run_ok(["estimate", "--model", "falcon-1.3b", "--no-flash", "--no-compile"], capsys)
    assert "decoder block" in out and "peak memory" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "no-such-model"], "Unknown model"),
        (["--gpu", "z9000"], "Unknown GPU"),
        (["--seq", "-5"], "positive"),
        (["--micro-batch", "0"], "--micro-batch must be between 1 and"),
        (["--micro-batch", "99999999999"], "--micro-batch must be between 1 and"),
        (["--recompute", "half"], "--recompute"),
        (["--model", "gpt3-1.3b", "--tp", "3"], "does not divide"),
    ],
)
def test_bad_input_is_one_sentence_exit_2(args, needle, capsys):
    code, out, err = run(["estimate", *args], capsys)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_model_files_exit_2(tmp_path, capsys):
    bad_heads = tmp_path / "m.json"
    bad_heads.write_text(
        json.dumps(
            {
                "family": "llama",
                "num_layers": 2,
                "hidden_size": 64,
                "num_heads": 6,
                "num_kv_heads": 4,
                "ffn_hidden_size": 128,
                "vocab_size": 100,
                "tie_embeddings": False,
            }
        )
    )
    code, _, err = run(["estimate", "--model", str(bad_heads)], capsys)
    assert code == 2 and "divisible" in err
    missing = tmp_path / "n.yaml"
    missing.write_text("family: gpt\nnum_layers: 2\nhidden_size: 64\n")
    code, _, err = run(["estimate", "--model", str(missing)], capsys)
    assert code == 2 and "missing" in err
    negative = tmp_path / "neg.json"
    negative.write_text(
        json.dumps(
            {
                "family": "gpt",
                "num_layers": -1,
                "hidden_size": 64,
                "num_heads": 4,
                "num_kv_heads": 4,
                "ffn_hidden_size": 256,
                "vocab_size": 100,
                "tie_embeddings": True,
            }
        )
    )
    code, _, err = run(["estimate", "--model", str(negative)], capsys)
    assert code == 2 and "positive" in err


def test_console_entry_point_exit_code():
    p = subprocess.run([sys.executable, "-m", "mist", "estimate", "--model", "nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "Unknown model" in p.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["tune", "--nodes", "abc"], "Invalid value for '--nodes'"),
        (["estimate", "--bogus"], "No such option: --bogus"),
        (["nocmd"], "No such command 'nocmd'"),
        (["simulate"], "Missing argument"),
    ],
)
def test_usage_errors_are_one_sentence_exit_2(args, needle, capsys):
    code, _, err = run(args, capsys)
    assert code == 2 and needle in err and "--help" in err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["tune", "-o", "/proc/mist-plan.json"], "--output /proc/mist-plan.json cannot be written"),
        (["tune", "-o", "{tmp}"], "--output must end with .json, .yaml, .yml"),
        (["tune", "-o", "{tmp}/no/such/plan.json"], "does not exist"),
        (["tune", "--time-budget", "nan"], "--time-budget must be a positive number"),
        (["compare", "--time-budget", "-1"], "--time-budget must be a positive number"),
        (["tune", "--dtype", ""], "param_dtype must be one of"),
        (["tune", "--grad-dtype", "bf16"], "--grad-dtype must be fp32 or the parameter dtype (fp16)"),
        (
            ["compare", "--dtype", "bf16", "--grad-dtype", "fp8"],
            "--grad-dtype must be fp32 or the parameter dtype (bf16)",
        ),
        (["tune", "--global-batch", "99999999999999999999"], "global_batch must be at most"),
    ],
)
def test_output_and_budget_checked_before_the_search(args, needle, tmp_path, capsys):
    code, _, err = run([a.format(tmp=tmp_path) for a in args], capsys)
    assert code == 2 and needle in err, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written or left behind


def test_timeline_path_checked_before_simulating(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    main(
        [
            "tune",
            "--model",
            "gpt3-1.3b",
            "--gpu",
            "l4",
            "--global-batch",
            "8",
            "--no-compile",
            "-o",
            str(plan),
            "--json",
        ]
    )
    capsys.readouterr()
    for path, needle in (
        (tmp_path / "t.jpgx", "must end with .png, .svg, .pdf"),
        (tmp_path / "no" / "t.png", "does not exist"),
        ("", "needs a file path"),
    ):
        code, _, err = run(["simulate", str(plan), "--timeline", str(path)], capsys)
        assert code == 2 and needle in err, err
    svg = tmp_path / "t.svg"
    main(["simulate", str(plan), "--timeline", str(svg)])
    assert svg.read_text().lstrip().startswith("<?xml")


def test_tiny_memory_limit_is_not_shown_as_zero(capsys):
    tiny = str(Path(__file__).parent / "data" / "tiny-llama.yaml")
    code, _, err = run(["tune", "--model", tiny, "--gpu", "l4", "--memory-limit", "1e-6", "--no-compile"], capsys)
    assert code == 2 and "against the 9.99e-07 GiB of a l4" in err and "0.0 GiB" not in err


def test_estimate_peaks_at_the_optimizer_steps_gradient_piece_when_activations_are_small(capsys):
    # the CPU loop's Llama at 8 tokens: its largest unit, the head (final RMSNorm and an untied
    # 8192 x 512 output layer), is under a piece (2^25 elements), so with bf16 gradients the step
    # reads all of it as one fp32 copy, more than the activations of 8 tokens
    model = str(ROOT / "benchmarks" / "models" / "loop-llama.yaml")
    args = ["estimate", "--model", model, "--gpu", "h200", "--seq", "8", "--micro-batch", "1", "--json"]
    m = json.loads(run_ok(args, capsys))["model"]
    assert m["activation_peak_at"].startswith("optimizer step")
    assert m["activation_peak_bytes"] == 4 * (8192 * 512 + 512)
    # fp32 gradients (a CPU profile trains in fp32) are read in place: the activations' peak again
    cpu = str(ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json")
    m32 = json.loads(run_ok([*args, "--gpu", cpu], capsys))["model"]
    assert not m32["activation_peak_at"].startswith("optimizer step")
    assert m32["activation_peak_at"] == "head backward"
