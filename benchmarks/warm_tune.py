"""How long a second `mist tune` takes: the layer traces already in the disk cache, in a fresh
process (as a user reruns the command), for two versions of the code side by side.

    python benchmarks/warm_tune.py --src OLD/src NEW/src [--repeats 3] [--label TEXT]

Each case's cache is filled once by a first run of each version (untimed; the versions key
their caches by their own code, so each has its own), then the versions run in turn, `--repeats`
times each. Prints a Markdown table: the median wall time of the process and the median
`tuning_time_s` it reports, per version, and whether every run's plan and predicted iteration
are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from cold_tune import tune_process  # (this folder is on the path of a script run from it)

# (name, `mist tune` arguments): the README's quick start (compiled and eager blocks searched,
# the faster kept), its long-sequence example, and the eager blocks of the first
CASES = {
    "llama-7b, 8 × L4": ["--model", "llama-7b", "--gpu", "l4", "--gpus-per-node", "8", "--global-batch", "128"],
    "llama3-8b, 8 × H200, seq 4096": [
        *("--model", "llama3-8b", "--gpu", "h200", "--gpus-per-node", "8", "--global-batch", "64"),
        *("--seq", "4096"),
    ],
    "gpt3-2.7b, 4 × L4, eager": [
        *("--model", "gpt3-2.7b", "--gpu", "l4", "--gpus-per-node", "4", "--global-batch", "64"),
        "--no-compile",
    ],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="+", required=True, help="the src/ folder of each version")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    names = [str(Path(s).resolve().parent.name) for s in a.src]
    head = " | ".join(f"{n}: wall (s) | {n}: tuning (s)" for n in names)
    rows = [
        f"| case | {head} | same plans | predicted iteration (s) |",
        "|---|" + "---:|" * (2 * len(names)) + "---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for case, args in CASES.items():
            caches = Path(tmp) / case.replace(" ", "_")
            for src in a.src:
                tune_process(src, args, caches)  # fills the disk cache
            walls: dict = {s: [] for s in a.src}
            tuning: dict = {s: [] for s in a.src}
            results = set()
            for _ in range(a.repeats):
                for src in a.src:
                    wall, res = tune_process(src, args, caches)
                    walls[src].append(wall)
                    tuning[src].append(res["tuning_time_s"])
                    results.add((json.dumps(res["plan"], sort_keys=True), res["predicted"]["iteration_time_s"]))
            cells = " | ".join(f"{statistics.median(walls[s]):.1f} | {statistics.median(tuning[s]):.1f}" for s in a.src)
            iteration = next(iter(results))[1]
            rows.append(f"| {case} | {cells} | {'yes' if len(results) == 1 else 'NO'} | {iteration:.3f} |")
            print(rows[-1], file=sys.stderr)
    title = f"### {a.label}\n\n" if a.label else ""
    print(
        f"{title}A second `mist tune` (traces cached), medians of {a.repeats} fresh processes per "
        f"version, run in turn.\n\n" + "\n".join(rows)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
