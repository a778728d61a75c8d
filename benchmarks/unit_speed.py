"""How fast the planner's inner parts run: one plan simulated, a batch of stage candidates
priced, the inter-stage dynamic program solved. Wall-clock time depends on the machine and on
what else runs on it, so the unit tests check only what these parts compute, and this script
reports how long they take, next to the time each is meant to stay under. Prints a Markdown table.

    PYTHONPATH=src python benchmarks/unit_speed.py [--repeats 3] [--out benchmarks/results/unit_speed.md]

The candidate batch and the random dynamic-program instance are the ones of the unit tests
(tests/simulate/test_stage.py `many_candidates`, tests/tune/test_inter.py `random_options`), loaded from
there so that the two stay the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import numpy as np

from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.plan_sim import simulate_plan
from mist.simulate.stage import StageModel
from mist.specs.presets import get_preset
from mist.tune.inter import best_split

ROOT = Path(__file__).resolve().parents[1]


def _test_module(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cases():
    """(name, what is timed, target in s, setup returning the timed call)."""

    def simulate():
        plan, prof = load_plan(ROOT / "examples" / "llama-7b-8xl4-mixed.json"), load_profile("l4")
        simulate_plan(plan, prof)  # trace (or read the cache) once
        return lambda: simulate_plan(plan, prof)

    def candidates():
        st = _test_module("tests/simulate/test_stage.py").many_candidates(20000)
        model = StageModel(get_preset("gpt3-1.3b"), load_profile("l4"), tp=1, flash=True, seq=2048)
        model.evaluate(st)  # warm the traces
        return lambda: model.evaluate(st)

    def dynamic_program():
        random_options = _test_module("tests/tune/test_inter.py").random_options
        opts = random_options(np.random.default_rng(1), 8, 48, 8)
        return lambda: best_split(opts, 48, 32)

    return [
        ("simulate one plan", "simulate_plan, llama-7b on 8 L4 (mixed stages), traces cached", 0.5, simulate),
        ("price 20,000 stage candidates", "StageModel.evaluate, gpt3-1.3b on L4, one batch", 5.0, candidates),
        ("inter-stage dynamic program", "best_split, 8 stages × 48 layers × ≤ 8 options, G 32", 20.0, dynamic_program),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="Time each call this often; report the fastest.")
    ap.add_argument("--out", help="Also write the table to this Markdown file.")
    a = ap.parse_args(argv)
    rows = [f"| part | what is timed | seconds (best of {a.repeats}) | target (s) | within |", "|---|---|---|---|---|"]
    for name, what, target, setup in cases():
        dt = _best_of(setup(), a.repeats)
        rows.append(f"| {name} | {what} | {dt:.3f} | {target:g} | {'yes' if dt < target else 'NO'} |")
        print(rows[-1], flush=True)
    text = (
        f"# Speed of the planner's inner parts ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores)\n\n" + "\n".join(rows) + "\n"
    )
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
