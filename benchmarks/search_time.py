"""Time of the full-space search itself (traces already cached) on a few cases of the fp32-gradient
suite (`benchmarks/suite.py --grad-dtype fp32`): the best of `--repeats` searches after one that
warms the traces. Prints a Markdown table with each case's plan time, so that two versions of the
code can be put side by side (run it with PYTHONPATH pointing at each one's src/).

    PYTHONPATH=src python benchmarks/search_time.py [--repeats 2] [--label NAME]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.search import tune

# (model, L4 GPUs, flash attention): the suite's slower full-space searches at each size
CASES = (
    ("gpt3-1.3b", 2, False),
    ("gpt3-2.7b", 4, False),
    ("gpt3-7b", 8, False),
    ("llama-13b", 16, True),
)


def search_seconds(model: str, n: int, flash: bool, repeats: int) -> tuple[float, float]:
    """(best search time in s, the plan's predicted iteration time in s)."""
    cluster = ClusterSpec("l4", max(1, n // 8), min(n, 8))
    training = TrainingSpec(
        seq_len=2048,
        global_batch=16 * n,
        flash_attention=flash,
        param_dtype="bf16",
        compute_dtype="bf16",
        grad_dtype="fp32",
    )
    spec, profile = get_preset(model), load_profile("l4")
    tune(spec, cluster, training, profile, time_budget=None)  # traces made or loaded, untimed
    best, iteration = float("inf"), float("nan")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = tune(spec, cluster, training, profile, time_budget=None)
        best = min(best, time.perf_counter() - t0)
        iteration = res.iteration_time_s
    return best, iteration


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--label", help="What is measured (default: the commit of this script's tree).")
    a = ap.parse_args(argv)
    label = (
        a.label
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    )
    print(f"Full-space search time, fp32 gradients, bf16, seq 2048, batch 16 per GPU ({label}):\n")
    print("| model | GPUs | flash | search (s) | predicted iteration (s) |")
    print("|---|---|---|---|---|")
    for model, n, flash in CASES:
        s, it = search_seconds(model, n, flash, a.repeats)
        print(f"| {model} | {n}× l4 | {'on' if flash else 'off'} | {s:.2f} | {it:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
