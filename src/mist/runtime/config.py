"""Hyper-parameters of `mist train` (the plan says how to parallelise; this says how to train)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mist.checks import is_int, is_number
from mist.errors import MistInputError

MAX_SEED = 2**63 - 1  # seeds are stored as int64 (checkpoints) and fed to torch.Generator


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10
    data: str = "synthetic"  # "synthetic", a text file (byte-level) or a .npy of token ids
    seed: int = 0
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at min_lr_ratio · lr
    warmup_steps: int | None = None  # None: 10 % of the steps (at most 100)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    metrics_path: str | None = None
    log: bool = True  # rank 0 prints one line per step
    checkpoint_dir: str | None = None  # save a checkpoint here at the end (and every checkpoint_every)
    checkpoint_every: int | None = None
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir
    stop_after: int | None = None  # end this run after this many steps (the schedule still spans `steps`)

    def __post_init__(self) -> None:
        if not is_int(self.steps) or self.steps < 1:
            raise MistInputError(f"--steps must be a positive integer, got {self.steps!r}.")
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise MistInputError(f"--seed must be an integer in [0, 2**63 - 1], got {self.seed!r}.")
        # NaN fails every comparison and inf passes the one-sided ones: require finite numbers first
        for name, v in (
            ("--lr", self.lr),
            ("--min-lr-ratio", self.min_lr_ratio),
            ("--weight-decay", self.weight_decay),
            ("--beta1", self.beta1),
            ("--beta2", self.beta2),
            ("--eps", self.eps),
            ("--clip", self.max_grad_norm),
        ):
            if not is_number(v) or not math.isfinite(v):
                raise MistInputError(f"{name} must be a finite number, got {v!r}.")
        if not self.lr > 0:
            raise MistInputError(f"--lr must be positive, got {self.lr}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MistInputError(f"--min-lr-ratio must lie in [0, 1], got {self.min_lr_ratio}.")
        if self.warmup_steps is not None and (not is_int(self.warmup_steps) or self.warmup_steps < 0):
            raise MistInputError(f"--warmup must be a non-negative integer, got {self.warmup_steps!r}.")
        if self.weight_decay < 0:
            raise MistInputError(f"--weight-decay must not be negative, got {self.weight_decay}.")
        if self.max_grad_norm < 0:
            raise MistInputError(f"--clip must not be negative (0 disables clipping), got {self.max_grad_norm}.")
        if not self.eps > 0:
            raise MistInputError(f"--eps must be positive, got {self.eps}.")
        for name, b in (("--beta1", self.beta1), ("--beta2", self.beta2)):
            if not 0 <= b < 1:
                raise MistInputError(f"{name} must lie in [0, 1), got {b}.")

        for name, v in (("--checkpoint-every", self.checkpoint_every), ("--stop-after", self.stop_after)):
            if v is not None and (not is_int(v) or v < 1):
                raise MistInputError(f"{name} must be a positive integer, got {v!r}.")
        if self.stop_after is not None and self.stop_after > self.steps:
            raise MistInputError(
                f"--stop-after {self.stop_after} exceeds --steps {self.steps}; a run "
                "cannot stop after more steps than the whole schedule has."
            )
        if (self.resume or self.checkpoint_every is not None) and not self.checkpoint_dir:
            raise MistInputError("--resume and --checkpoint-every need --checkpoint-dir.")

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict:
        return asdict(self)
