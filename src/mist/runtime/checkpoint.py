"""Checkpoints of `mist train` with `torch.distributed.checkpoint` (DCP).

A checkpoint is one DCP directory ``DIR/step_00000042`` (the number of finished steps). Each rank
puts plain tensors in the state dict under keys unique to it: for every `FlatUnit` the fp32 master
shard and the two Adam moments (device head and host tail joined into one CPU tensor), named
``s{stage}.tp{tp rank}.dp{dp rank}.{unit}.{master|exp_avg|exp_avg_sq}``. The ``meta.*`` keys hold
values every rank shares (DCP stores them once): the step, the optimizer's step count, the loss
scaler, the data position (the step; for packed token data also the sampler's epoch and index,
`datasets.data_state`), the LR schedule's parameters and a hash of the plan, which must be the
same on resume.

A directory counts as a checkpoint once DCP wrote its ``.metadata`` (the last file of a save).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import warnings
from pathlib import Path

import torch

from mist.errors import MistInputError
from mist.plan import Plan
from mist.runtime.datasets import data_state, restore_data_state

_STEP_DIR = re.compile(r"^step_(\d+)$")


def plan_hash(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON (the model always spelled out, never a preset name)."""
    d = {**plan.to_dict(), "model": plan.model.to_dict()}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def _hash_tensor(h: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(h)), dtype=torch.uint8)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest_checkpoint(root: str | Path) -> tuple[Path, int]:
    """(directory, step) of the newest complete checkpoint under `root`, or MistInputError."""
    root = Path(root)
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
    if not found:
        raise MistInputError(f"--resume found no checkpoint in {root} (no complete step_* directory).")
    step, path = max(found)
    return path, step


def meta_template() -> dict[str, torch.Tensor]:
    return {
        "meta.step": torch.zeros((), dtype=torch.int64),
        "meta.optimizer_step": torch.zeros((), dtype=torch.int64),
        "meta.data_step": torch.zeros((), dtype=torch.int64),
        "meta.data_seed": torch.zeros((), dtype=torch.int64),
        "meta.data_position": torch.zeros(3, dtype=torch.int64),  # sampler epoch, index, sequences
        "meta.loss_scale": torch.zeros((), dtype=torch.float64),
        "meta.loss_scale_good": torch.zeros((), dtype=torch.int64),
        "meta.lr_schedule": torch.zeros(4, dtype=torch.float64),  # lr, warmup, total, min ratio
        "meta.plan_hash": torch.zeros(32, dtype=torch.uint8),
    }


def _failure(e: BaseException) -> str:
    """A short name of why DCP could not read a checkpoint (the first rank's own exception, not the
    multi-line report of a CheckpointException)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            e = inner[0]
    return type(e).__name__


@contextlib.contextmanager
def _quiet():
    """DCP logs the tracebacks of the fallbacks it tries on the root logger (and warns that it
    assumes a single process); a failure becomes our one sentence instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": meant
            yield
    finally:
        logging.disable(previous)


def _unreadable(path, e: BaseException) -> MistInputError:
    return MistInputError(
        f"The checkpoint in {path} cannot be read ({_failure(e)}); it is damaged or "
        "incomplete, so resume from an intact one or train without --resume."
    )


def read_meta(path: str | Path) -> dict[str, torch.Tensor]:
    """The shared values of a checkpoint, read by one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp  # lazy: ~1 s to import; only checkpointing runs pay it
    from torch.distributed.checkpoint.api import CheckpointException

    sd = meta_template()
    try:
        with _quiet():
            dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged or foreign directory
        raise _unreadable(path, e) from None
    return sd


def check_resume(plan: Plan, cfg) -> tuple[Path, int]:
    """The checkpoint to resume from; MistInputError when there is none, its plan differs or it
    already finished cfg.steps."""
    path, step = latest_checkpoint(cfg.checkpoint_dir)
    meta = read_meta(path)
    if bytes(meta["meta.plan_hash"].tolist()).hex() != plan_hash(plan):
        raise MistInputError(
            f"Checkpoint {path} was written by a different plan; resume it with "
            "the plan it was trained with (or use a new --checkpoint-dir)."
        )
    if step >= cfg.steps:
        raise MistInputError(
            f"Checkpoint {path} already finished {step} of --steps {cfg.steps}; "
            "nothing is left to train (raise --steps to continue)."
        )
    return path, step


def _unit_key(trainer, unit, what: str) -> str:
    g = trainer.groups
    return f"s{g.stage.index}.tp{g.tp_rank}.dp{g.dp_rank}.{unit.name}.{what}"


def _buffers(unit):
    return (("master", unit.master), ("exp_avg", unit.exp_avg), ("exp_avg_sq", unit.exp_avg_sq))


def save(trainer, root: str | Path, step: int) -> Path:
    """Collective: every rank writes its shards of the state after `step` finished steps."""
    import torch.distributed.checkpoint as dcp  # lazy: ~1 s to import; only checkpointing runs pay it

    cfg, opt = trainer.cfg, trainer.optimizer
    sd: dict[str, torch.Tensor] = {}
    for u in trainer.units:
        for what, buf in _buffers(u):
            sd[_unit_key(trainer, u, what)] = buf.read(0, buf.length, "cpu").clone()
    sd.update(
        {
            "meta.step": torch.tensor(step, dtype=torch.int64),
            "meta.optimizer_step": torch.tensor(opt.step_count, dtype=torch.int64),
            "meta.data_step": torch.tensor(step, dtype=torch.int64),
            "meta.data_seed": torch.tensor(cfg.seed, dtype=torch.int64),
            "meta.data_position": data_state(trainer.data),
            "meta.loss_scale": torch.tensor(trainer.scaler.scale, dtype=torch.float64),
            "meta.loss_scale_good": torch.tensor(trainer.scaler._good, dtype=torch.int64),
            "meta.lr_schedule": torch.tensor([cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio], dtype=torch.float64),
            "meta.plan_hash": _hash_tensor(plan_hash(trainer.plan)),
        }
    )
    path = step_dir(root, step)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(path))
    return path


@torch.no_grad()
def load(trainer, path: str | Path) -> int:
    """Collective: restore this rank's shards and the shared state; the step to continue from."""
    import torch.distributed.checkpoint as dcp  # lazy: ~1 s to import; only checkpointing runs pay it
    from torch.distributed.checkpoint.api import CheckpointException

    sd = meta_template()
    for u in trainer.units:
        for what, buf in _buffers(u):
            sd[_unit_key(trainer, u, what)] = torch.empty(buf.length, dtype=torch.float32)
    try:
        with _quiet():
            dcp.load(sd, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged shard (the plan matched)
        raise _unreadable(path, e) from None
    for u in trainer.units:
        for what, buf in _buffers(u):
            buf.copy_(sd[_unit_key(trainer, u, what)].to(buf.device))
        u.update_weights()  # working weights from the restored master (collective for ZeRO 1/2)
    trainer.optimizer.step_count = int(sd["meta.optimizer_step"])
    trainer.scaler.scale = float(sd["meta.loss_scale"])
    trainer.scaler._good = int(sd["meta.loss_scale_good"])
    restore_data_state(trainer.data, sd["meta.data_position"], path)
    return int(sd["meta.data_step"])
