"""The benchmark suite against the frameworks people run today: Mist's full space vs the
megatron-0.19, deepspeed-0.19 and torchtitan-0.3 target spaces (`mist tune --target`).

Same cases, training and cost model as `benchmarks/suite.py` (bf16 parameters and compute; each
target space trains as its framework does, e.g. fp32 gradients for Megatron-LM and torchtitan).
For every case: the speedup of the full space's best plan over each target's best plan, and the
knobs of Mist's plan that each framework cannot run (the exporters' refusals, `mist compare`'s
"what Mist's runtime buys here"). Writes suite-targets.{md,json,png}; rows are appended as cases
finish, so a partial run keeps its results.

    PYTHONPATH=src python benchmarks/suite_targets.py [--only l4|a100|h200] [--budget SEC] [--out DIR]
        [--refresh SPACE ...]

`--refresh` searches only the given target spaces again for the cases already in the JSON (after
a change to how their framework's plans are priced) and keeps every other space's result,
Mist's full space's included; the speedups are taken against the kept full-space times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from suite import all_cases, run_case, speedup_plot

TARGETS = ("megatron-0.19", "deepspeed-0.19", "torchtitan-0.3")
SPACES = ("full", *TARGETS)


def _spaces(r) -> dict:
    return {s["space"]: s for s in r["spaces"]}


def _cell(s) -> str:
    """The speedup over a target, or why it has no plan: `no fit` (memory) or `n/a` (the framework
    has no model for the architecture)."""
    if s.get("speedup_of_full"):
        return f"{s['speedup_of_full']:.3f}×"
    return "no fit" if " fits" in (s.get("infeasible_reason") or "") else "n/a"


def markdown(rows) -> str:
    head = (
        "| model | GPUs | seq | flash | full (ms) | vs Megatron-LM 0.19 | vs DeepSpeed 0.19 | vs torchtitan 0.3 "
        "| what Mist's plan uses that Megatron-LM / DeepSpeed / torchtitan cannot run |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        sp = _spaces(r)
        full = sp["full"]
        case = f"| {r['model']} | {r['nodes'] * r['gpus_per_node']}× {r['gpu']} | {r['seq_len']} | {'on' if r['flash_attention'] else 'off'} | "
        if not full["iteration_time_s"]:
            lines.append(case + "no fit | - | - | - | |")
            continue
        needs = " / ".join(", ".join(sp[t].get("full_plan_needs") or ["-"]) for t in TARGETS)
        cells = " | ".join(_cell(sp[t]) for t in TARGETS)
        lines.append(case + f"{full['iteration_time_s'] * 1e3:.0f} | {cells} | {needs} |")
    txt = head + "\n".join(lines) + "\n\n"
    txt += "| target space | mean speedup of full | max | min | cases with a plan | full slower in |\n|---|---|---|---|---|---|\n"
    for t in TARGETS:
        vals = [_spaces(r)[t]["speedup_of_full"] for r in rows if _spaces(r)[t].get("speedup_of_full")]
        if vals:
            slower = sum(v < 1 - 1e-9 for v in vals)
            txt += f"| {t} | {statistics.mean(vals):.3f}× | {max(vals):.3f}× | {min(vals):.3f}× | {len(vals)} | {slower} |\n"
    txt += "\nHow often each knob of Mist's plan is one the framework cannot run (cases):\n\n"
    txt += "| knob | " + " | ".join(TARGETS) + " |\n|---|" + "---|" * len(TARGETS) + "\n"
    counts = {t: Counter(k for r in rows for k in (_spaces(r)[t].get("full_plan_needs") or [])) for t in TARGETS}
    for knob in sorted(set().union(*counts.values()), key=lambda k: (-sum(c[k] for c in counts.values()), k)):
        txt += f"| {knob} | " + " | ".join(str(counts[t][knob]) for t in TARGETS) + " |\n"
    return txt


def plot(rows, path):
    speedup_plot(rows, path, TARGETS, "0 = no plan in that space (n/a or no fit in the table)")


def refresh(rows: list, spaces: list[str], only, budget: float) -> None:
    """Search `spaces` again for every case of `rows`, in place (module docstring)."""
    cases = {(c["model"], c["gpu"], c["n"], c["flash"]): c for c in all_cases(only)}
    for r in rows:
        c = cases.get((r["model"], r["gpu"], r["nodes"] * r["gpus_per_node"], r["flash_attention"]))
        if c is None:
            continue
        by_space = _spaces(r)
        full = by_space["full"]["iteration_time_s"]
        for new in run_case(c, budget, spaces=tuple(spaces))["spaces"]:
            it = new["iteration_time_s"]
            new["speedup_of_full"] = it / full if it and full else None
            new["full_plan_needs"] = by_space[new["space"]].get("full_plan_needs")
            r["spaces"] = [new if s["space"] == new["space"] else s for s in r["spaces"]]
        print(f"{c['model']:16s} {c['n']:3d}×{c['gpu']:15s} flash={c['flash']!s:5s} refreshed", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=["l4", "a100", "h200"])
    ap.add_argument("--budget", type=float, default=60.0, help="time budget per space and case (s)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from the JSON")
    ap.add_argument("--refresh", nargs="+", choices=TARGETS, help="search only these spaces again (docstring)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "suite-targets" + ("-" + "-".join(a.only) if a.only else "")
    jpath = out / f"{tag}.json"
    rows = json.loads(jpath.read_text()) if jpath.exists() else []
    pre = (
        "# Mist vs the frameworks' current spaces (`benchmarks/suite_targets.py`)\n\n"
        "bf16 parameters and compute; each target space trains as its framework does (fp32 gradients for "
        "Megatron-LM and torchtitan). Speedup = the target's best predicted iteration time / Mist's full "
        "space's, under the same cost model. n/a: the framework has no model for the case (Megatron-LM: "
        "no Falcon block; torchtitan: Llama 3-style models only, so not the paper's Llama, which rotates a "
        "quarter of each head).\n\n"
    )
    done = {(r["model"], r["gpu"], r["nodes"] * r["gpus_per_node"], r["flash_attention"]) for r in rows}
    if a.refresh:
        refresh(rows, a.refresh, a.only, a.budget)
        jpath.write_text(json.dumps(rows, indent=1))
    for c in [] if a.render or a.refresh else all_cases(a.only):
        if (c["model"], c["gpu"], c["n"], c["flash"]) in done:
            continue
        t = time.perf_counter()
        r = run_case(c, a.budget, spaces=SPACES)
        r["wall_s"] = time.perf_counter() - t
        rows.append(r)
        jpath.write_text(json.dumps(rows, indent=1))
        (out / f"{tag}.md").write_text(pre + markdown(rows))
        print(
            f"{c['model']:16s} {c['n']:3d}×{c['gpu']:15s} flash={c['flash']!s:5s} wall {r['wall_s']:.0f}s", flush=True
        )
    (out / f"{tag}.md").write_text(pre + markdown(rows))
    plot(rows, out / f"{tag}.png")
    print(markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
