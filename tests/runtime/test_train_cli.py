"""`mist train`: a local run end to end, and plans that cannot run → one sentence, exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rt_helpers import make_plan

from mist.cli import main
from mist.errors import MistInputError
from mist.runtime import TrainConfig, spawn_local
from mist.runtime.launch import device_type_for

ROOT = Path(__file__).resolve().parents[2]


def _plan_file(tmp_path, gpu="cpu", dp=2, tp=1, name="plan.json", **kw):
    plan = make_plan("llama", dp=dp, tp=tp, gpu=gpu, **kw)
    path = tmp_path / name
    plan.save(path)
    return path


def _fail(args, capsys, monkeypatch=None, env=None):
    if env is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    return err


def test_local_run_writes_metrics(tmp_path):
    """A GPU plan with --local on a machine without CUDA runs on CPU workers and says so."""
    plan = _plan_file(tmp_path, gpu="l4", zero=1, G=2, recompute=1, offload={"optimizer": 0.5})
    metrics = tmp_path / "m.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mist",
            "train",
            str(plan),
            "--local",
            "--steps",
            "3",
            "--metrics",
            str(metrics),
            "--lr",
            "1e-2",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout and "step 3/3" in r.stdout
    m = json.loads(metrics.read_text())
    for k in ("step_time_s", "tokens_per_s", "mfu", "losses", "stages"):
        assert k in m
    assert len(m["losses"]) == 3 and m["losses"][-1] < m["losses"][0]
    assert m["mfu"] is None  # measured on CPU: no GPU peak applies
    assert m["step_time_s"] > 0 and m["tokens_per_s"] > 0
    assert len(m["stages"]) == 1 and m["stages"][0]["peak_memory_bytes"] > 0


def test_world_size_mismatch(tmp_path, capsys, monkeypatch):
    plan = _plan_file(tmp_path)
    err = _fail(["train", str(plan)], capsys, monkeypatch, {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    assert "needs 2 processes" in err and "started 3" in err


def test_gpu_plan_without_cuda_under_torchrun(tmp_path, capsys, monkeypatch):
    plan = _plan_file(tmp_path, gpu="h200")
    err = _fail(["train", str(plan)], capsys, monkeypatch, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert "no CUDA device" in err and "--local" in err


def test_no_launcher(tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    err = _fail(["train", str(_plan_file(tmp_path))], capsys)
    assert "torchrun" in err


def _pp_plan_file(tmp_path, dp1=1):
    """A tiny 2-stage llama plan (2 + 1 layers): stage 0 dp 1 × b 2, stage 1 dp `dp1` × b 2/dp1."""
    d = json.loads(_plan_file(tmp_path, dp=1, G=2).read_text())
    s0 = dict(d["stages"][0], layers=2)
    s1 = dict(d["stages"][0], layers=1, dp=dp1, gpus_per_node=dp1, micro_batch=2 // dp1)
    d["stages"] = [s0, s1]
    d["cluster"]["gpus_per_node"] = 1 + dp1
    path = tmp_path / f"pp{dp1}.json"
    path.write_text(json.dumps(d))
    return path


def test_pipeline_plan_runs_from_the_cli(tmp_path):
    """A pipeline whose stages differ in dp (1 and 2) and micro-batch runs end to end."""
    metrics = tmp_path / "m.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mist",
            "train",
            str(_pp_plan_file(tmp_path, dp1=2)),
            "--local",
            "--steps",
            "3",
            "--metrics",
            str(metrics),
            "--lr",
            "1e-2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "step 3/3" in r.stdout
    m = json.loads(metrics.read_text())
    assert len(m["losses"]) == 3 and m["losses"][-1] < m["losses"][0]
    assert len(m["stages"]) == 2 and all(s["peak_memory_bytes"] > 0 for s in m["stages"])


def test_bad_plan_and_bad_data(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    d = json.loads(_plan_file(tmp_path).read_text())
    d["stages"][0]["dp"] = 3
    bad.write_text(json.dumps(d))
    _fail(["train", str(bad), "--local"], capsys)
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--data", str(tmp_path / "none.txt")], capsys)
    assert "does not exist" in err
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "0"], capsys)
    assert "--steps" in err


def test_worker_input_errors_reach_the_caller():
    """An error found inside the workers comes back as the same one sentence."""
    plan = make_plan("gpt", dp=2)
    with pytest.raises(MistInputError) as e:  # the data file is only opened inside the workers
        spawn_local(plan, TrainConfig(steps=1, log=False, data="/nonexistent/tokens.npy"), start_method="fork")
    assert "/nonexistent/tokens.npy" in str(e.value) and "\n" not in str(e.value)


def test_which_device_a_plan_runs_on():
    """A plan tuned on a CPU profile runs on CPU workers, also under torchrun (no --local); a GPU
    plan runs on the GPUs, or — on a machine without CUDA — only with --local, on CPU workers."""
    cpu_profile = str(ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json")
    assert device_type_for(make_plan("gpt", gpu="cpu"), local=False) == ("cpu", None)
    assert device_type_for(make_plan("gpt", gpu=cpu_profile), local=False) == ("cpu", None)
    if torch.cuda.is_available():
        return  # the GPU plan's device: test_a_gpu_plan_runs_on_the_gpus
    with pytest.raises(MistInputError, match="no CUDA device"):
        device_type_for(make_plan("gpt", gpu="l4"), local=False)
    dev, note = device_type_for(make_plan("gpt", gpu="l4"), local=True)
    assert dev == "cpu" and "gloo" in note


@pytest.mark.gpu
def test_a_gpu_plan_runs_on_the_gpus():
    assert device_type_for(make_plan("gpt", gpu="l4"), local=False) == ("cuda", None)


def test_bad_host_threads(tmp_path, capsys, monkeypatch):
    err = _fail(["train", str(_plan_file(tmp_path)), "--local"], capsys, monkeypatch, {"MIST_HOST_THREADS": "many"})
    assert "MIST_HOST_THREADS must be a positive integer" in err


# ---------------------------------------------------------------- bad input found by fuzzing


@pytest.fixture
def no_workers(monkeypatch):
    """Each of these errors must be found before any worker process starts."""

    def refuse(*a, **kw):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr("mist.runtime.launch.spawn_local", refuse)


@pytest.mark.parametrize(
    "path,msg",
    [
        ("/proc/m.json", "cannot be written"),
        ("{tmp}/no/such/folder/m.json", "does not exist"),
        ("{tmp}", "is a directory, not a file"),
        ("", "needs a file path"),
    ],
)
def test_unwritable_metrics_fail_before_training(tmp_path, capsys, no_workers, path, msg):
    err = _fail(
        ["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", "--metrics", path.format(tmp=tmp_path)], capsys
    )
    assert "--metrics" in err and msg in err


def test_unusable_checkpoint_dir_fails_before_training(tmp_path, capsys, no_workers):
    plan = str(_plan_file(tmp_path))
    err = _fail(["train", plan, "--local", "--steps", "1", "--checkpoint-dir", "/proc/ck"], capsys)
    assert "--checkpoint-dir /proc/ck cannot be created" in err
    err = _fail(["train", plan, "--local", "--steps", "1", "--checkpoint-dir", plan], capsys)
    assert "is a file, not a folder" in err
    # --resume from a folder that does not exist: no checkpoint, and no folder made for it
    err = _fail(
        ["train", plan, "--local", "--steps", "2", "--checkpoint-dir", str(tmp_path / "new"), "--resume"], capsys
    )
    assert "no checkpoint" in err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", str(2**63)])
def test_seed_out_of_range(tmp_path, capsys, no_workers, seed):
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", "--seed", seed], capsys)
    assert "--seed must be an integer in [0, 2**63 - 1]" in err


def test_largest_seed_is_accepted():
    cfg = TrainConfig(steps=1, seed=2**63 - 1, log=False)
    res = spawn_local(make_plan("gpt"), cfg, start_method="fork")
    assert len(res["metrics"]["losses"]) == 1


@pytest.mark.parametrize(
    "option", ["--lr", "--eps", "--weight-decay", "--clip", "--beta1", "--beta2", "--min-lr-ratio"]
)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_hyperparameters_must_be_finite(tmp_path, capsys, no_workers, option, value):
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", option, value], capsys)
    assert f"{option} must be a finite number" in err


def test_hyperparameter_ranges_name_the_option():
    for kw, msg in (
        (dict(weight_decay=-0.1), "--weight-decay must not be negative"),
        (dict(max_grad_norm=-1.0), "--clip must not be negative"),
        (dict(eps=0.0), "--eps must be positive"),
        (dict(lr=0.0), "--lr must be positive"),
        (dict(beta2=1.0), "--beta2 must lie in [0, 1)"),
    ):
        with pytest.raises(MistInputError) as e:
            TrainConfig(steps=1, **kw)
        assert msg in str(e.value)


def test_stop_after_beyond_steps(tmp_path, capsys, no_workers):
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", "--stop-after", "5"], capsys)
    assert "--stop-after 5 exceeds --steps 1" in err
    TrainConfig(steps=5, stop_after=5, checkpoint_dir="ck")  # equal is fine
    TrainConfig(steps=5, warmup_steps=10)  # a warm-up past the steps too


@pytest.mark.parametrize(
    "env,msg",
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'abc'"),
        ({"RANK": "0", "WORLD_SIZE": "x"}, "WORLD_SIZE must be an integer, got 'x'"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK must be at least 0, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE must be at least 1, got 0"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be below WORLD_SIZE 2, got 2"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK must be below LOCAL_WORLD_SIZE 2, got 2",
        ),
    ],
)
def test_bad_torchrun_variables(tmp_path, capsys, monkeypatch, env, msg):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    err = _fail(["train", str(_plan_file(tmp_path)), "--steps", "1"], capsys, monkeypatch, env)
    assert f"The environment variable {msg}" in err


def test_too_many_host_threads(tmp_path, capsys, monkeypatch, no_workers):
    from mist.cpu_workers import host_cores

    err = _fail(
        ["train", str(_plan_file(tmp_path)), "--local", "--steps", "1"],
        capsys,
        monkeypatch,
        {"MIST_HOST_THREADS": "100000"},
    )
    assert f"MIST_HOST_THREADS must be between 1 and {host_cores()}" in err and "got 100000" in err


def _data_files(tmp_path):
    import numpy as np

    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "garbage.npy").write_bytes(b"garbage")
    np.save(tmp_path / "float.npy", np.zeros(100, np.float32))
    np.save(tmp_path / "matrix.npy", np.zeros((4, 100), np.int64))
    np.save(tmp_path / "big.npy", np.arange(1000))
    np.save(tmp_path / "neg.npy", np.full(100, -1))
    np.save(tmp_path / "objects.npy", np.array([1, "a"] * 50, dtype=object), allow_pickle=True)
    np.savez(tmp_path / "archive.npz", a=np.arange(100))
    (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")


@pytest.mark.parametrize(
    "name,msg",
    [
        ("", "is a directory, not a file"),
        ("empty.txt", "holds 0 tokens, fewer than one sequence"),
        ("empty.npy", "is not a readable .npy array"),
        ("garbage.npy", "is not a readable .npy array"),
        ("float.npy", "must hold a 1-D array of integer token ids, not an array of shape (100,) and dtype float32"),
        ("matrix.npy", "not an array of shape (4, 100)"),
        ("big.npy", "outside the model's vocabulary [0, 128)"),
        ("neg.npy", "outside the model's vocabulary"),
        ("objects.npy", "is not a readable .npy array"),
        ("archive.npy", "is an .npz archive"),
    ],
)
def test_bad_data_files(tmp_path, capsys, no_workers, name, msg):
    _data_files(tmp_path)
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", "--data", str(tmp_path / name)], capsys)
    assert msg in err


def test_empty_data_option(tmp_path, capsys, no_workers):
    err = _fail(["train", str(_plan_file(tmp_path)), "--local", "--steps", "1", "--data", ""], capsys)
    assert "--data needs 'synthetic' or a file path" in err
