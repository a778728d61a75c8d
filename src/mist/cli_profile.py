"""`mist profile`: measure the device this runs on and write a profile JSON that every `--gpu`
option (and a plan's `cluster.gpu`) accepts as a path. A thin adapter over `mist.profiling`;
registered in `mist.cli` with `app.command("profile")(profile_command)`."""

from __future__ import annotations

import math

import typer
from rich.console import Console

from mist import cpu_workers, profiling
from mist.errors import MistInputError
from mist.userfiles import check_output_file


def check_arguments(
    device: str, processes: int, time_budget: float, output: str | None = None, name: str | None = None
) -> None:
    """MistInputError (one sentence) for arguments `mist profile` cannot run with; checked before any
    measuring, so that a run of minutes cannot fail at its end (e.g. on an unwritable --output)."""
    if device not in ("cpu", "cuda"):
        raise MistInputError(f"--device must be 'cpu' or 'cuda', got {device!r}.")
    if processes < 1:
        raise MistInputError(f"--processes must be at least 1, got {processes}.")
    if not (math.isfinite(time_budget) and time_budget > 0):
        raise MistInputError(f"--time-budget must be a positive finite number of seconds, got {time_budget}.")
    if name is not None and not name.strip():
        raise MistInputError("--name must not be empty (leave it out for the default name).")
    if name is not None and any(not ch.isprintable() for ch in name):
        raise MistInputError(f"--name must be printable text without control characters, got {name!r}.")
    if device == "cpu":
        cores = cpu_workers.host_cores()
        if processes > cores:
            raise MistInputError(
                f"--processes {processes} is more than the {cores} CPU core(s) this process may "
                "use on --device cpu (each process needs at least one core)."
            )
    if device == "cuda":
        import torch  # lazy: keeps torch out of the CLI start-up

        if not torch.cuda.is_available():
            raise MistInputError("--device cuda was asked for, but PyTorch sees no CUDA device on this machine.")
    if output is not None:
        check_output_file(output, "--output", suffixes=(".json",))


def profile_command(
    device: str = typer.Option("cpu", "--device", help="Device to measure: cpu or cuda."),
    processes: int = typer.Option(
        2, "--processes", help="Worker processes for the collectives (gloo on CPU, NCCL on CUDA: one GPU each)."
    ),
    output: str = typer.Option("profile.json", "-o", "--output", help="Profile JSON to write."),
    time_budget: float = typer.Option(180, "--time-budget", help="Seconds to spend measuring (about)."),
    name: str | None = typer.Option(None, "--name", help="Profile name (default cpu-<host> / cuda-<device>)."),
) -> None:
    """Measure this machine's device (GEMMs, attention, memory-bound ops, host overheads, copies,
    AdamW, collectives, overlap) and write a profile usable as --gpu PROFILE.json."""
    check_arguments(device, processes, time_budget, output, name)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as prog:
        task = prog.add_task(f"profiling {device}", total=1.0)

        def progress(frac: float, message: str) -> None:
            prog.update(task, completed=frac, description=f"profiling {device}: {message}")

        profile = profiling.run_profile(
            device=device, processes=processes, time_budget=time_budget, name=name, progress=progress
        )
    path = profiling.write_profile(profile, output)
    out = Console()
    out.print(f"wrote {path}")
    out.print(profile.summary())
    for note in profile.notes:
        out.print(f"  note: {note}")
    out.print(f"use it with --gpu {path}")
