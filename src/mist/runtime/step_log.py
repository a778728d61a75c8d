"""Per-step logs of `mist train` on the first rank: lines or a progress bar, JSON lines, TensorBoard.

- stdout: on a terminal a progress bar (rich) with the step, the current loss and throughput;
  otherwise (a pipe, a file, the tests) one plain line per step as before, plus one per evaluation.
- ``--log-jsonl PATH``: one JSON object per step (`StepRecord.to_json`), flushed as it is written;
  a resumed run appends to the file, a fresh run starts it anew.
- ``--tensorboard DIR``: the same scalars as TensorBoard event files (train/*, eval/loss,
  memory/stage<i>_peak_bytes), through torch.utils.tensorboard's SummaryWriter.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import TextIO

from mist.errors import MistInputError


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based: the number of finished steps
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    time_s: float
    skipped: bool
    mfu: float | None = None  # None on CPU runs / GPUs without a profile
    stage_peak_memory_bytes: tuple[int, ...] | None = None  # per stage, the most over its ranks
    eval_loss: float | None = None  # on steps that evaluated
    data_position: tuple[int, int] | None = None  # sampler (epoch, index) before this step's batch

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()})


def check_tensorboard() -> None:
    """--tensorboard needs torch.utils.tensorboard (the `tensorboard` package)."""
    try:
        import torch.utils.tensorboard  # noqa: F401  # lazy: only runs asked for TensorBoard pay it
    except ImportError:
        raise MistInputError(
            "--tensorboard needs the `tensorboard` package, which is not installed (pip install tensorboard)."
        ) from None


class StepLog:
    """The first rank's logs of one run of `total` steps that starts after `start` finished ones."""

    def __init__(
        self,
        total: int,
        start: int,
        *,
        plain: bool = True,
        jsonl: str | None = None,
        tensorboard: str | None = None,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ):
        self.total, self.stream = total, stream or sys.stdout
        self.plain = plain
        tty = self.stream.isatty() if tty is None else tty
        self.progress = None
        self.last_eval: float | None = None  # the latest evaluation loss, shown on the bar
        if plain and tty:
            # lazy: rich's progress machinery only for interactive runs
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(file=self.stream, force_terminal=True)
            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
        self.jsonl = open(jsonl, "a" if start else "w", encoding="utf-8") if jsonl else None  # noqa: SIM115
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: only runs asked for TensorBoard

            self.writer = SummaryWriter(log_dir=tensorboard)

    def step(self, r: StepRecord) -> None:
        if r.eval_loss is not None:
            self.last_eval = r.eval_loss
        if self.progress is not None:
            info = f"loss {r.loss:.4f}  {r.tokens_per_s:,.0f} tokens/s"
            if self.last_eval is not None:
                info += f"  eval loss {self.last_eval:.4f}"
            self.progress.update(self.task, completed=r.step, info=info)
        elif self.plain:
            print(
                f"step {r.step}/{self.total}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                f"grad norm {r.grad_norm:.3f}  {r.time_s * 1e3:.0f} ms  "
                f"{r.tokens_per_s:,.0f} tokens/s" + ("  (skipped)" if r.skipped else ""),
                file=self.stream,
                flush=True,
            )
            if r.eval_loss is not None:
                print(f"step {r.step}/{self.total}  eval loss {r.eval_loss:.4f}", file=self.stream, flush=True)
        if self.jsonl is not None:
            self.jsonl.write(r.to_json() + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            w, k = self.writer, r.step
            for name, v in (
                ("train/loss", r.loss),
                ("train/lr", r.lr),
                ("train/grad_norm", r.grad_norm),
                ("train/tokens_per_s", r.tokens_per_s),
                ("train/mfu", r.mfu),
                ("eval/loss", r.eval_loss),
            ):
                if v is not None:
                    w.add_scalar(name, v, k)
            for i, b in enumerate(r.stage_peak_memory_bytes or ()):
                w.add_scalar(f"memory/stage{i}_peak_bytes", b, k)
            w.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
