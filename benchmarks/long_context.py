"""Long-context training under Mist's cost model: Llama 3 8B and 70B at 32k, 64k and 128k tokens
per sequence on 8–64 H200s, Mist's full space against the spaces Megatron-LM 0.19 and torchtitan
0.3 run today (`mist tune --target`). Which cases have a plan that fits, the speedup of the full
space, and the tuning time per case (the first case of each model pays its trace; later ones read
the cache).

    PYTHONPATH=src python benchmarks/long_context.py [--budget SEC] [--out DIR]

Writes long-context.{md,json}; rows are appended as cases finish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.compare import compare_spaces

SPACES = ("full", "megatron-0.19", "torchtitan-0.3")
TOKENS_PER_STEP = 2**21  # two million tokens a step: 64 sequences at 32k, 16 at 128k
CASES = [
    (model, n, seq, TOKENS_PER_STEP // seq)
    for model, sizes in (("llama3-8b", (8, 16)), ("llama3-70b", (32, 64)))
    for n in sizes
    for seq in (32768, 65536, 131072)
]


def run_case(model: str, n: int, seq: int, batch: int, budget: float) -> dict:
    cluster = ClusterSpec("h200", max(1, n // 8), min(n, 8))
    training = TrainingSpec(seq_len=seq, global_batch=batch, flash_attention=True)
    t = time.perf_counter()
    r = compare_spaces(get_preset(model), cluster, training, load_profile("h200"), budget, SPACES).to_json()
    r["wall_s"] = time.perf_counter() - t
    return r


def markdown(rows) -> str:
    out = [
        "| model | GPUs | seq | batch | full (s) | vs Megatron-LM 0.19 | vs torchtitan 0.3 | full tuning (s) | full plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = {s["space"]: s for s in r["spaces"]}
        full = sp["full"]

        def cell(name):
            s = sp[name]
            return f"{s['speedup_of_full']:.3f}×" if s.get("speedup_of_full") else "no fit"

        it = full["iteration_time_s"]
        out.append(
            f"| {r['model']} | {r['nodes'] * r['gpus_per_node']}× h200 | {r['seq_len']} | {r['global_batch']} | "
            + (f"{it:.2f}" if it else "no fit")
            + f" | {cell('megatron-0.19')} | {cell('torchtitan-0.3')} | {full['tuning_time_s']:.1f} | "
            + f"{full.get('plan_summary') or full.get('infeasible_reason') or ''} |"
        )
    fits = sum(1 for r in rows if r["spaces"][0]["iteration_time_s"])
    tt = [r["spaces"][0]["tuning_time_s"] for r in rows]
    txt = "\n".join(out) + f"\n\nCases with a plan that fits in the full space: {fits} of {len(rows)}.\n"
    if tt:
        txt += f"Full-space tuning time: median {statistics.median(tt):.1f} s, max {max(tt):.1f} s.\n"
        first = {}
        for i, r in enumerate(rows):  # the cases run in order: a model's first one traces its layers
            first.setdefault(r["model"], i)
        cold = ", ".join(f"{m} {tt[i]:.1f} s" for m, i in first.items())
        warm = [t for i, t in enumerate(tt) if i not in first.values()]
        txt += f"First case of each model (an empty trace cache): {cold}."
        txt += f" The other cases (traces cached): median {statistics.median(warm):.1f} s.\n" if warm else "\n"
    return txt


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0, help="time budget per space and case (s)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "long-context.json"
    rows = json.loads(jpath.read_text()) if jpath.exists() else []
    done = {(r["model"], r["nodes"] * r["gpus_per_node"], r["seq_len"]) for r in rows}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    pre = (
        "# Long-context training (`benchmarks/long_context.py`)\n\n"
        f"Computed at commit {commit or 'unknown'} on a machine with {os.cpu_count()} cores.\n\n"
        "bf16, flash attention, H200 profile; every step trains on 2^21 tokens (64 sequences at 32k, 16 at "
        "128k). Speedup = the target's best predicted iteration time / Mist's "
        "full space's. Sequence parallelism (tp+sp in a plan) is searched by the full space and by "
        "Megatron-LM's (on or off) and is always on in torchtitan's with tp > 1; context parallelism "
        "(cpN in a plan) is searched by all three (torchtitan's with FSDP only); 'no fit' marks what a "
        "space needs. Run with an empty trace cache (MIST_CACHE_DIR) for the first-run times.\n\n"
    )
    for model, n, seq, batch in CASES:
        if (model, n, seq) in done:
            continue
        r = run_case(model, n, seq, batch, a.budget)
        rows.append(r)
        jpath.write_text(json.dumps(rows, indent=1))
        (out / "long-context.md").write_text(pre + markdown(rows))
        print(f"{model} {n}×h200 seq {seq}: wall {r['wall_s']:.0f} s", flush=True)
    (out / "long-context.md").write_text(pre + markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
