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
    data: str = "synthetic"  # "synthetic", a token file, JSONL/text (with tokenizer) or byte-level text
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
    # Hugging Face weights (runtime/hf_weights.py): start from a checkpoint, write one back
    init_from: str | None = None  # a Hugging Face checkpoint folder (config.json + safetensors)
    save_hf: str | None = None  # write a Hugging Face checkpoint here at the end (and every checkpoint_every)
    save_hf_shard_bytes: int = 5 * 1000**3  # the largest safetensors file --save-hf writes
    # data (runtime/datasets.py): tokenizer, text/JSONL fields, token files, held-out evaluation
    tokenizer: str | None = None  # a tokenizer.json or a folder holding one
    text_field: str = "text"  # the JSONL field holding each document's text
    token_dtype: str | None = None  # uint16 / uint32 of a raw token file without a sidecar
    eos_id: int | None = None  # the separator between packed documents (default: the tokenizer's)
    token_cache: str | None = None  # folder for tokenized text (reused); None: a temporary folder
    eval_data: str | None = None
    eval_fraction: float | None = None  # hold out this fraction of the data's sequences
    eval_every: int | None = None
    eval_batches: int = 4
    # logs (runtime/step_log.py)
    log_jsonl: str | None = None  # one JSON line of metrics per step
    tensorboard: str | None = None  # a folder for TensorBoard event files
    # CPU runs: each rank's allocator peak over its first steps, which are then not timed
    # (runtime/allocator_trace.py); a GPU reports its allocator's peak anyway
    trace_memory: bool = False

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
        if not is_int(self.save_hf_shard_bytes) or self.save_hf_shard_bytes < 1:
            raise MistInputError(
                f"The largest --save-hf file must be a positive size, got {self.save_hf_shard_bytes!r} bytes."
            )
        self._check_data()

    def _check_data(self) -> None:
        for name, v in (("--eval-every", self.eval_every), ("--eval-batches", self.eval_batches)):
            if v is not None and (not is_int(v) or v < 1):
                raise MistInputError(f"{name} must be a positive integer, got {v!r}.")
        if self.eval_fraction is not None and (not is_number(self.eval_fraction) or not 0 < self.eval_fraction < 1):
            raise MistInputError(f"--eval-fraction must lie strictly between 0 and 1, got {self.eval_fraction!r}.")
        if self.eval_fraction is not None and self.eval_data:
            raise MistInputError("Give --eval-fraction or --eval-data, not both.")
        if self.eval_every is not None and self.eval_fraction is None and not self.eval_data:
            raise MistInputError("--eval-every needs held-out data: --eval-fraction or --eval-data.")
        if self.token_dtype is not None and self.token_dtype not in ("uint16", "uint32"):
            raise MistInputError(f"--token-dtype must be uint16 or uint32, got {self.token_dtype!r}.")
        if self.eos_id is not None and (not is_int(self.eos_id) or self.eos_id < 0):
            raise MistInputError(f"--eos-id must be a non-negative integer, got {self.eos_id!r}.")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise MistInputError("--text-field needs a field name, got an empty one.")

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict:
        return asdict(self)
