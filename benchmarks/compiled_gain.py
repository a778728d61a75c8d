"""What compiled blocks change in the plans `mist tune` found with eager blocks.

`mist tune` plans compiled decoder blocks on a GPU profile unless told `--no-compile`
(`mist.tune.run.compiles_by_default`). This script takes every full-space plan stored in the
suite results (`suite-l4-a100-fp16.json`: the paper's cases on L4 and A100 in fp16;
`suite.json`: its H200 cases in bf16), all of them tuned with eager blocks, and simulates each
twice: as stored, and with `training.compile_blocks` (the same stages, the blocks compiled). The
ratio compiled / eager of the iteration time and of the highest stage peak is a floor of what the
default buys: a search with compiled blocks may pick another plan (fewer recomputed layers where
the compiled blocks keep fewer bytes, say), never a slower one. A plan whose compiled stages no
longer fit is counted.

    PYTHONPATH=src python benchmarks/compiled_gain.py [--out benchmarks/results/compiled_gain.md]
        [--json benchmarks/results/compiled_gain.json] [--render]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SUITES = {"suite-l4-a100-fp16.json": None, "suite.json": "h200"}  # file: the GPU kept (None: all)


def stored_plans() -> dict[str, dict]:
    out = {}
    for name, gpu in SUITES.items():
        for case in json.loads((RESULTS / name).read_text()):
            if gpu is not None and case["gpu"] != gpu:
                continue
            plan = next((s["plan"] for s in case["spaces"] if s["space"] == "full" and s.get("plan")), None)
            if plan is None:
                continue
            n = case["nodes"] * case["gpus_per_node"]
            flash = "flash" if case["flash_attention"] else "no flash"
            out[f"{case['model']} {n}×{case['gpu']} {flash}"] = plan
    return out


def measure(plans: dict[str, dict]) -> dict:
    # lazy: --render needs no torch
    from mist.hardware import load_profile
    from mist.plan import plan_from_dict
    from mist.simulate.plan_sim import simulate_plan

    rows = {}
    for name, d in plans.items():
        plan = plan_from_dict(d)
        assert not plan.training.compile_blocks, name
        profile = load_profile(plan.cluster.gpu)
        t0 = time.perf_counter()
        eager = simulate_plan(plan, profile)
        compiled = simulate_plan(replace(plan, training=replace(plan.training, compile_blocks=True)), profile)
        rows[name] = {
            "eager_s": eager.iteration_time_s,
            "compiled_s": compiled.iteration_time_s,
            "eager_peak": max(s.peak_memory_bytes for s in eager.stages),
            "compiled_peak": max(s.peak_memory_bytes for s in compiled.stages),
            "compiled_fits": all(s.fits for s in compiled.stages),
        }
        print(f"{name}: {compiled.iteration_time_s / eager.iteration_time_s:.3f} ({time.perf_counter() - t0:.0f} s)")
    return rows


def group(name: str) -> str:
    """ "gpt3-7b 8×l4 no flash" → "l4 gpt3 no flash"."""
    model, cluster, *rest = name.split(" ")
    return f"{cluster.split('×')[1]} {model.split('-')[0]} {' '.join(rest)}"


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"


def render(data: dict) -> str:
    rows = data["rows"]
    groups: dict[str, list[str]] = {}
    for name in rows:
        groups.setdefault(group(name), []).append(name)
    lines = [
        f"Computed at commit {data['commit']}; {len(rows)} full-space plans of the suite results, each "
        "simulated as stored (eager blocks, as tuned) and with its blocks compiled.",
        "",
        "| group (plans) | iteration time compiled / eager: median (min–max) | highest stage peak compiled / eager | "
        "plans that no longer fit |",
        "|---|---|---|---|",
    ]
    for g in sorted(groups):
        names = groups[g]
        t = [rows[n]["compiled_s"] / rows[n]["eager_s"] for n in names]
        m = [rows[n]["compiled_peak"] / rows[n]["eager_peak"] for n in names]
        lost = sum(not rows[n]["compiled_fits"] for n in names)
        lines.append(f"| {g} ({len(names)}) | {spread(t)} | {spread(m)} | {lost} |")
    t = [r["compiled_s"] / r["eager_s"] for r in rows.values()]
    lines += ["", f"All {len(rows)} plans: iteration time compiled / eager {spread(t)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "compiled_gain.md"))
    ap.add_argument("--json", default=str(RESULTS / "compiled_gain.json"))
    ap.add_argument("--render", action="store_true", help="redraw the table from --json, simulating nothing")
    a = ap.parse_args(argv)
    if a.render:
        data = json.loads(Path(a.json).read_text())
    else:
        import subprocess

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS
        ).stdout.strip()
        data = {"commit": commit, "rows": measure(stored_plans())}
        Path(a.json).write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
