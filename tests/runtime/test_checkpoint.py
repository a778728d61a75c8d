"""Checkpoints: 6 steps in one run = 3 steps, a checkpoint, and 3 resumed steps (same losses and
weights); resuming with another plan, or from an empty directory → one sentence."""

import numpy as np
import pytest
from rt_helpers import make_plan, run_plan

from mist.cli import main
from mist.errors import MistInputError

STEPS = 6


def _split_run(plan, tmp_path, **over):
    full = run_plan(plan, steps=STEPS)
    ck = str(tmp_path / "ck")
    first = run_plan(plan, steps=STEPS, checkpoint_dir=ck, stop_after=3, **over)
    resumed = run_plan(plan, steps=STEPS, checkpoint_dir=ck, resume=True, **over)
    return full, first, resumed, ck


def _assert_same(full, first, resumed):
    fl = full["metrics"]["losses"]
    assert len(first["metrics"]["losses"]) == 3 and len(resumed["metrics"]["losses"]) == 3
    got = first["metrics"]["losses"] + resumed["metrics"]["losses"]
    np.testing.assert_allclose(got, fl, rtol=0, atol=1e-6)
    np.testing.assert_allclose(first["metrics"]["lrs"] + resumed["metrics"]["lrs"], full["metrics"]["lrs"])
    assert set(full["state"]) == set(resumed["state"])
    for k, v in full["state"].items():
        np.testing.assert_allclose(resumed["state"][k], v, rtol=0, atol=1e-6, err_msg=k)


def test_resume_dp_zero1_offload(tmp_path, capsys):
    plan = make_plan("gpt", dp=2, zero=1, G=2, offload={"optimizer": 0.5})
    full, first, resumed, ck = _split_run(plan, tmp_path, checkpoint_every=2)
    _assert_same(full, first, resumed)
    # every 2 steps, and at the end of each run (3 and 6)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "step_00000002",
        "step_00000003",
        "step_00000004",
        "step_00000006",
    ]

    # a different plan refuses the checkpoint with one sentence
    other = make_plan("gpt", dp=2, zero=2, G=2, offload={"optimizer": 0.5})
    with pytest.raises(MistInputError, match="different plan") as e:
        run_plan(other, steps=8, checkpoint_dir=ck, resume=True)
    assert "\n" not in str(e.value)
    path = tmp_path / "other.json"
    other.save(path)
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--local", "--steps", "8", "--checkpoint-dir", ck, "--resume"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "different plan" in err

    # nothing left to train
    with pytest.raises(MistInputError, match="nothing is left"):
        run_plan(plan, steps=STEPS, checkpoint_dir=ck, resume=True)


def test_resume_pipeline(tmp_path):
    plan = make_plan("gpt", dp=1, G=2)
    plan = type(plan)(
        model=plan.model,
        cluster=type(plan.cluster)(gpu="cpu", nodes=1, gpus_per_node=2),
        training=plan.training,
        micro_batches=2,
        stages=tuple(
            type(plan.stages[0])(
                layers=1,
                nodes=1,
                gpus_per_node=1,
                micro_batch=2,
                dp=1,
                tp=1,
                zero=0,
                recompute_layers=0,
                offload=plan.stages[0].offload,
            )
            for _ in range(2)
        ),
    )
    full, first, resumed, _ = _split_run(plan, tmp_path)
    _assert_same(full, first, resumed)


def test_resume_empty_dir(tmp_path, capsys):
    plan = make_plan("gpt", dp=2, zero=1, G=2)
    with pytest.raises(MistInputError, match="no checkpoint") as e:
        run_plan(plan, steps=4, checkpoint_dir=str(tmp_path / "none"), resume=True)
    assert "\n" not in str(e.value)
    path = tmp_path / "p.json"
    plan.save(path)
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--local", "--steps", "4", "--checkpoint-dir", str(tmp_path), "--resume"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "no checkpoint" in err
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--local", "--steps", "4", "--resume"])
    assert e.value.code == 2


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp", "__1_0.distcp", "missing __1_0.distcp"])
def test_damaged_checkpoint(tmp_path, damaged):
    """A damaged file of the latest checkpoint: one sentence and exit 2, whether the parent finds it
    (reading the shared values) or the workers do (reading their shards), and none of DCP's logged
    tracebacks on stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = make_plan("gpt", dp=2)
    ck = tmp_path / "ck"
    run_plan(plan, steps=4, checkpoint_dir=str(ck), stop_after=2)
    step = ck / "step_00000002"
    if damaged.startswith("missing "):
        (step / damaged.split()[1]).unlink()
    else:
        (step / damaged).write_bytes(b"garbage\n")
    path = tmp_path / "p.json"
    plan.save(path)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mist",
            "train",
            str(path),
            "--local",
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ck),
            "--resume",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: The checkpoint in {step} cannot be read (") and "damaged or incomplete" in err
