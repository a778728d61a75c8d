"""How long a first `mist tune` takes: every case run as a user runs it, in a fresh process with
empty Mist and Inductor caches, with eager blocks only (`--no-compile`), compiled blocks only
(`--compile-blocks`) and the default on a GPU profile (both searches, the faster plan kept),
then the default again with the caches it filled (warm). Prints a Markdown table and writes it
with `--out`.

    PYTHONPATH=src python benchmarks/cold_tune.py [--src OTHER/src] [--modes eager,compiled]

`--src` times another version's `src/` (a `git worktree` of an earlier commit) with the same
cases, so that two versions' rows can be set side by side. The trace workers use the cores this
process may run on (at most 8, `MIST_TRACE_WORKERS`): the times depend on that count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(model: str, gpu: str, global_batch: int, *extra: str) -> list[str]:
    return ["--model", model, "--gpu", gpu, "--gpus-per-node", "8", "--global-batch", str(global_batch), *extra]


# (name, `mist tune` arguments): the README's quick start and the cases of its other examples
CASES = {
    "llama-7b, 8 × L4": _args("llama-7b", "l4", 128),
    "llama3-8b, 8 × H200, seq 4096": _args("llama3-8b", "h200", 64, "--seq", "4096"),
    "llama3-8b, 8 × H200, torchtitan": _args("llama3-8b", "h200", 64, "--target", "torchtitan"),
}
MODES = {"eager": ["--no-compile"], "compiled": ["--compile-blocks"], "default": []}


def tune_process(src, args: list[str], caches: Path) -> tuple[float, dict]:
    """(wall seconds, the --json result) of one `mist tune` in a fresh process with the code in
    `src` and the caches in `caches`."""
    env = dict(
        os.environ,
        PYTHONPATH=str(src),
        MIST_CACHE_DIR=str(caches / "mist"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mist", "tune", *args, "--json"],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return time.perf_counter() - t0, json.loads(done.stdout)


def run_tune(src: Path, args: list[str], caches: Path) -> dict:
    """One `mist tune` in a fresh process with the caches in `caches`: its wall time, the
    predicted iteration of its plan and whether the plan compiles its blocks."""
    wall, res = tune_process(src, args, caches)
    return {
        "wall_s": round(wall, 1),
        "iteration_s": res["predicted"]["iteration_time_s"],
        "compiled_plan": bool(res["plan"]["training"].get("compile_blocks")),
    }


def time_case(src: Path, args: list[str], modes: list[str]) -> dict:
    """Each mode cold (fresh caches), then the default again warm (the caches its run filled)."""
    row = {}
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            row[mode] = run_tune(src, args + MODES[mode], Path(tmp))
            if mode == "default":
                row["default warm"] = run_tune(src, args, Path(tmp))
    return row


def table(rows: list[dict], header: str) -> str:
    modes = [m for m in (*MODES, "default warm") if any(m in r for r in rows)]
    lines = [
        header,
        "",
        "| case | " + " | ".join(f"{m} (s)" for m in modes) + " | predicted iteration, " + " / ".join(modes) + " (s) |",
        "|---|" + "---:|" * len(modes) + "---|",
    ]
    for r in rows:
        walls = " | ".join(f"{r[m]['wall_s']:.1f}" if m in r else "–" for m in modes)
        its = " / ".join(
            f"{r[m]['iteration_s']:.3f}" + (" c" if r[m]["compiled_plan"] else "") if m in r else "–" for m in modes
        )
        lines.append(f"| {r['case']} | {walls} | {its} |")
    lines += ["", "c: the plan compiles its blocks."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the src/ folder of the version to time")
    ap.add_argument("--modes", default="eager,compiled,default", help="of " + ", ".join(MODES) + ", comma-separated")
    ap.add_argument("--cases", help="case numbers to run (1-based, comma-separated; default: all)")
    ap.add_argument("--label", default="this tree", help="what the version is, for the table's heading")
    ap.add_argument("--out", type=Path, help="write the table here as well")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes takes {', '.join(MODES)}, got {a.modes}")
    names = list(CASES) if not a.cases else [list(CASES)[int(i) - 1] for i in a.cases.split(",")]
    rows = []
    for name in names:
        rows.append({"case": name, **time_case(a.src, CASES[name], modes)})
        print(
            f"{name}: " + ", ".join(f"{m} {v['wall_s']} s" for m, v in rows[-1].items() if m != "case"), file=sys.stderr
        )
    import torch

    cores = len(os.sched_getaffinity(0))
    header = (
        f"### {a.label}\n\nA first `mist tune` per case, wall time in a fresh process with empty caches "
        f"({platform.machine()}, {cores} cores, torch {torch.__version__}, trace workers "
        f"{os.environ.get('MIST_TRACE_WORKERS', min(cores, 8))})."
    )
    text = table(rows, header)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
