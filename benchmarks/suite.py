"""The paper's benchmark suite (plus H200 clusters) under Mist's cost model.

For every case: Mist's full space, the original Mist space, and the Megatron-LM, DeepSpeed and
Aceso-style spaces, each searched with the same simulator. Writes a Markdown table, a JSON file
and a plot of speedups; rows are appended as cases finish, so a partial run keeps its results.

    PYTHONPATH=src python benchmarks/suite.py [--only l4|a100|h200] [--budget SEC] [--out DIR]
                                              [--grad-dtype fp32] [--dtype bf16|fp16] [--ablate]

The full space's schedule and sequence knobs (interleaved 1F1B, ZB-H1, sequence and context
parallelism) are
counted over the cases; with `--ablate`, every case whose full plan uses one is tuned again
without it, and the table says what the knob buys there (time without / time with).

Every case trains in bf16 (parameters and compute; the L4 and A100 profiles were measured in fp16,
whose tensor-core rates equal bf16's on those GPUs). Each space keeps gradients as its system does:
Mist, DeepSpeed and Aceso in the parameter dtype, Megatron-LM in fp32 (it forces fp32 gradient
accumulation and reduction with bf16). `--grad-dtype fp32` gives every space fp32 gradients, the
like-for-like comparison with Megatron-LM's numerics (written to suite-fp32grads.*). `--dtype fp16`
trains in fp16 instead, as the paper's runs did (constant loss scale): Megatron-LM then keeps fp16
gradients like every other space (written to suite-…-fp16.*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from mist.analysis.layer import warm
from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.compare import compare_spaces, short_summary  # noqa: F401
from mist.tune.search import tune
from mist.tune.space import get_space

SIZES = [("1.3b", 2), ("2.7b", 4), ("7b", 8), ("13b", 16), ("22b", 32)]
PRESET = {"gpt": "gpt3-{}", "llama": "llama-{}", "falcon": "falcon-{}"}
SPACES = ("full", "mist-paper", "megatron", "deepspeed", "aceso", "megatron-paper")


def paper_cases(gpu: str, seq: int):
    for size, n in SIZES:
        for fam, flash in (("gpt", True), ("gpt", False), ("llama", True), ("falcon", True)):
            name = PRESET[fam].format(size)
            if fam == "falcon" and size == "7b":
                name = "falcon-paper-7b"
            yield dict(model=name, gpu=gpu, n=n, seq=seq, flash=flash)


def h200_cases():
    for name, n in (("llama3-8b", 8), ("llama2-13b", 16), ("gpt3-22b", 32), ("llama2-70b", 32), ("llama3-70b", 64)):
        yield dict(model=name, gpu="h200", n=n, seq=4096, flash=True)


def all_cases(only=None):
    groups = {
        "l4": lambda: paper_cases("l4", 2048),
        "a100": lambda: paper_cases("a100-sxm4-40gb", 4096),
        "h200": h200_cases,
    }
    for key, gen in groups.items():
        if only and key not in only:
            continue
        yield from gen()


# the full space's knobs a plan may use beyond 1F1B without sequence parallelism, and the space
# fields that switch each off
KNOBS = {
    "interleaved 1F1B": dict(virtual_stages=(1,)),
    "ZB-H1": dict(schedules=("1f1b",)),
    "sequence parallelism": dict(sequence_parallel=(False,)),
    "context parallelism": dict(cp_values=(1,)),
}


def knobs_used(plan: dict | None) -> list[str]:
    """The `KNOBS` a plan (as written to a file) uses."""
    if not plan:
        return []
    used = {
        "interleaved 1F1B": plan.get("virtual_stages", 1) > 1,
        "ZB-H1": plan.get("schedule", "1f1b") != "1f1b",
        "sequence parallelism": any(s.get("sequence_parallel") for s in plan["stages"]),
        "context parallelism": any(s.get("cp", 1) > 1 for s in plan["stages"]),
    }
    return [k for k, on in used.items() if on]


def ablate(c, r, budget, grad_dtype=None, dtype="bf16") -> dict:
    """Iteration time of the full space without each knob its plan uses (None: nothing fits)."""
    full = next(s for s in r["spaces"] if s["space"] == "full")
    cluster, training = _setup(c, grad_dtype, dtype)
    out = {}
    for knob in knobs_used(full.get("plan")):
        space = replace(get_space("full"), name=f"full-without-{knob}", **KNOBS[knob])
        res = tune(get_preset(c["model"]), cluster, training, load_profile(c["gpu"]), space, time_budget=budget)
        out[knob] = res.iteration_time_s
    return out


def _setup(c, grad_dtype=None, dtype="bf16"):
    n = c["n"]
    cluster = ClusterSpec(c["gpu"], max(1, n // 8), min(n, 8))
    training = TrainingSpec(
        seq_len=c["seq"],
        global_batch=16 * n,
        flash_attention=c["flash"],
        param_dtype=dtype,
        compute_dtype=dtype,
        grad_dtype=grad_dtype,
    )
    return cluster, training


def run_case(c, budget, grad_dtype=None, dtype="bf16", spaces=SPACES):
    """Traces are made (or loaded) first, untimed: tuning times are of the search itself."""
    warm(get_preset(c["model"]), (1, 2, 4, 8), c["flash"], dtype)
    cluster, training = _setup(c, grad_dtype, dtype)
    return compare_spaces(get_preset(c["model"]), cluster, training, load_profile(c["gpu"]), budget, spaces).to_json()


def markdown(rows) -> str:
    head = (
        "| model | GPUs | seq | flash | full (ms) | vs Megatron | vs DeepSpeed | vs Aceso | vs Mist-paper "
        "| vs Megatron (paper's tuning) | full tuning (s) | full plan |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        sp = {s["space"]: s for s in r["spaces"]}
        full = sp["full"]

        def sx(name):
            v = sp[name].get("speedup_of_full")
            return f"{v:.3f}×" if v else ("no fit" if sp[name]["iteration_time_s"] is None else "-")

        case = (
            f"| {r['model']} | {r['nodes'] * r['gpus_per_node']}× {r['gpu']} | {r['seq_len']} | "
            f"{'on' if r['flash_attention'] else 'off'} | "
        )
        if full["iteration_time_s"]:
            lines.append(
                case + f"{full['iteration_time_s'] * 1e3:.0f} | {sx('megatron')} | {sx('deepspeed')} | "
                f"{sx('aceso')} | {sx('mist-paper')} | {sx('megatron-paper')} | {full['tuning_time_s']:.1f}{_cut(full)} | "
                f"{full.get('plan_summary', '')} |"
            )
        else:
            lines.append(case + "no fit | - | - | - | - | - | - | |")
    summary = []
    for name in ("megatron", "deepspeed", "aceso", "mist-paper", "megatron-paper"):
        vals = [
            s["speedup_of_full"] for r in rows for s in r["spaces"] if s["space"] == name and s.get("speedup_of_full")
        ]
        if vals:
            summary.append(
                f"| {name} | {statistics.mean(vals):.3f}× | {max(vals):.3f}× | {min(vals):.3f}× | {len(vals)} |"
            )
    summary.append("")
    summary.append(
        "| knob of the full plan | cases | gain where ablated (time without / with): mean | min | max | ablated |"
    )
    summary.append("|---|---|---|---|---|---|")
    for knob in KNOBS:
        users = [r for r in rows if knob in knobs_used(_full(r).get("plan"))]
        gains = [
            r["without"][knob] / _full(r)["iteration_time_s"]
            for r in users
            if r.get("without", {}).get(knob) and _full(r)["iteration_time_s"]
        ]
        g = f"{statistics.mean(gains):.3f}× | {min(gains):.3f}× | {max(gains):.3f}×" if gains else "- | - | -"
        summary.append(f"| {knob} | {len(users)} of {len(rows)} | {g} | {len(gains)} |")
    tt = [s["tuning_time_s"] for r in rows for s in r["spaces"] if s["space"] == "full"]
    txt = (
        head
        + "\n".join(lines)
        + "\n\n| baseline space | mean speedup of full | max | min | cases |\n|---|---|---|---|---|\n"
    )
    txt += "\n".join(summary) + "\n"
    if tt:
        txt += f"\nFull-space tuning time: median {statistics.median(tt):.1f} s, max {max(tt):.1f} s over {len(tt)} cases.\n"
    cut = Counter(s["space"] for r in rows for s in r["spaces"] if s.get("budget_ran_out"))
    if cut:
        txt += (
            "\n\\* the time budget (`--budget`) ran out before the space was searched through, so its plan is the "
            "best of the part searched; searches cut short: "
            + ", ".join(f"{name} {n} of {len(rows)}" for name, n in sorted(cut.items()))
            + ".\n"
        )
    return txt


def _cut(space_row: dict) -> str:
    """The mark of a search its time budget cut short (rows of older runs do not record it)."""
    return "\\*" if space_row.get("budget_ran_out") else ""


def _full(r) -> dict:
    return next(s for s in r["spaces"] if s["space"] == "full")


def preamble(grad_dtype, dtype="bf16", args="") -> str:
    if grad_dtype:
        grads = "fp32 gradients in every space"
    elif dtype == "bf16":
        grads = "gradients in bf16 for Mist, DeepSpeed and Aceso, in fp32 for Megatron-LM (as it runs bf16)"
    else:
        grads = f"gradients in {dtype} in every space"
    return (
        f"# Benchmark suite (`benchmarks/suite.py{args}`)\n\n"
        f"{dtype} parameters and compute; {grads}. Speedup = the baseline's best predicted iteration "
        "time / Mist's full space's, under the same cost model.\n\n"
    )


def speedup_plot(rows, path, spaces, title=None):
    """Bars of the full space's predicted speedup over each of `spaces`, per case (0: no plan)."""
    import matplotlib  # lazy: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['model']}\n{r['nodes'] * r['gpus_per_node']}×{r['gpu'].split('-')[0]}"
        + ("" if r["flash_attention"] else "\nno-flash")
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.55), 4.5))
    w = 0.8 / len(spaces)
    for j, name in enumerate(spaces):
        ys = [next((s.get("speedup_of_full") or 0) for s in r["spaces"] if s["space"] == name) for r in rows]
        ax.bar([i + (j - (len(spaces) - 1) / 2) * w for i in range(len(rows))], ys, w, label=f"vs {name}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6, rotation=90)
    ax.set_ylabel("predicted speedup of Mist (full space)")
    if title:
        ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows, path):
    speedup_plot(rows, path, ("megatron", "deepspeed", "aceso", "mist-paper"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=["l4", "a100", "h200"])
    ap.add_argument("--budget", type=float, default=60.0, help="time budget per space and case (s)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--grad-dtype", choices=["fp32"], help="fp32 gradients in every space (default: each system's own)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="parameter and compute dtype")
    ap.add_argument("--ablate", action="store_true", help="tune each case again without each new knob its plan uses")
    a = ap.parse_args(argv)
    args = "".join(
        f" {k} {v}"
        for k, v in (
            ("--only", " ".join(a.only or [])),
            ("--grad-dtype", a.grad_dtype),
            ("--dtype", "" if a.dtype == "bf16" else a.dtype),
        )
        if v
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "suite" if not a.only else "suite-" + "-".join(a.only)
    if a.grad_dtype:
        tag += "-fp32grads"
    if a.dtype != "bf16":
        tag += "-" + a.dtype
    jpath = out / f"{tag}.json"
    rows = json.loads(jpath.read_text()) if jpath.exists() else []
    done = {(r["model"], r["gpu"], r["nodes"] * r["gpus_per_node"], r["flash_attention"]) for r in rows}
    for c in all_cases(a.only):
        if (c["model"], c["gpu"], c["n"], c["flash"]) in done:
            continue
        t = time.perf_counter()
        r = run_case(c, a.budget, a.grad_dtype, a.dtype)
        r["wall_s"] = time.perf_counter() - t
        if a.ablate:
            r["without"] = ablate(c, r, a.budget, a.grad_dtype, a.dtype)
        rows.append(r)
        jpath.write_text(json.dumps(rows, indent=1))
        (out / f"{tag}.md").write_text(preamble(a.grad_dtype, a.dtype, args) + markdown(rows))
        plot(rows, out / f"{tag}.png")
        full = next(s for s in r["spaces"] if s["space"] == "full")
        print(
            f"{c['model']:16s} {c['n']:3d}×{c['gpu']:15s} flash={c['flash']!s:5s} "
            f"full={full['iteration_time_s']} wall {r['wall_s']:.0f}s",
            flush=True,
        )
    print(markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
