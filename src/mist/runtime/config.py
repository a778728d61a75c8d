"""Hyper-parameters of `mist train` (the plan says how to parallelise; this says how to train)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mist.errors import MistInputError


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10
    data: str = "synthetic"            # "synthetic", a text file (byte-level) or a .npy of token ids
    seed: int = 0
    lr: float = 3e-4
    min_lr_ratio: float = 0.1          # cosine decay ends at min_lr_ratio · lr
    warmup_steps: int | None = None    # None: 10 % of the steps (at most 100)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0         # 0 disables clipping
    metrics_path: str | None = None
    log: bool = True                   # rank 0 prints one line per step
    checkpoint_dir: str | None = None  # save a checkpoint here at the end (and every checkpoint_every)
    checkpoint_every: int | None = None
    resume: bool = False               # continue from the latest checkpoint in checkpoint_dir
    stop_after: int | None = None      # end this run after this many steps (the schedule still spans `steps`)

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise MistInputError(f"--steps must be a positive integer, got {self.steps!r}.")
        if not self.lr > 0:
            raise MistInputError(f"--lr must be positive, got {self.lr}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MistInputError(f"--min-lr-ratio must lie in [0, 1], got {self.min_lr_ratio}.")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise MistInputError(f"--warmup must not be negative, got {self.warmup_steps}.")
        if self.weight_decay < 0 or self.max_grad_norm < 0 or not self.eps > 0:
            raise MistInputError("--weight-decay and --clip must not be negative and --eps must be positive.")
        for name, b in (("--beta1", self.beta1), ("--beta2", self.beta2)):
            if not 0 <= b < 1:
                raise MistInputError(f"{name} must lie in [0, 1), got {b}.")

        for name, v in (("--checkpoint-every", self.checkpoint_every), ("--stop-after", self.stop_after)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MistInputError(f"{name} must be a positive integer, got {v!r}.")
        if (self.resume or self.checkpoint_every is not None) and not self.checkpoint_dir:
            raise MistInputError("--resume and --checkpoint-every need --checkpoint-dir.")

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict:
        return asdict(self)
