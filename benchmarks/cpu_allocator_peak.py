"""The CPU loop's plans, each stage's peak as the CPU allocator saw it next to the simulator's.

The CPU loop (`cpu_loop.py`) compares states and saved activations byte for byte with what the
runtime accounts tensor by tensor, but its peak column has no operator temporaries on the measured
side. Here every plan of the loop is tuned the same way (its models, its arguments, the CPU profile
stored in the repository) and run with `mist validate --trace-memory`: each rank records its
allocator's events over its first two steps, and the most bytes live at once from the first step
on is put next to the simulator's peak (device plus host: on a CPU both are one memory, so with
offloading the prediction is an upper bound). Blocks that a gloo thread released are seen only
when their address is handed out again ("unseen"), so where there are some the measurement is an
upper bound too.

    PYTHONPATH=src python benchmarks/cpu_allocator_peak.py [--cases all|quick|dropout|edited|bf16|interleaved] [--out benchmarks/results]

Writes OUT/cpu_allocator_peak.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_loop import CASES, ROOT, SETS, _json, mist, plan_summary, tune, tune_limited  # noqa: E402

PROFILE = ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json"
STEPS = 3  # two traced, one timed (`mist validate` needs one)
# what `mist tune` chooses for none of these plans: the tuned data-parallel plans with their
# stage's ZeRO level (the gradient path of each) or its whole-block recomputation (the reentrant
# checkpoint's backward) set, and the micro-batch count
_DP = ["--pp", "1", "--tp", "1"]
_INTERLEAVED = {"virtual_stages": 2, "schedule": "1f1b", "layers": 2, "chunk_layers": [1, 1], "recompute_layers": 0}
PLAN_KEYS = ("G", "virtual_stages", "schedule")  # edits of the plan; the others are of every stage
EDITED_CASES = (
    [(f"gpt dp2 zero {z}, G {G}", "loop-gpt", _DP, {"zero": z, "G": G}) for z in (1, 2, 3) for G in (1, 2)]
    + [
        (f"{m} dp2 {n} of 4 recomputed, G 2", f"loop-{m}", _DP, {"recompute_layers": n, "G": 2})
        for m in ("gpt", "llama")
        for n in (2, 4)
    ]
    + [
        # interleaved 1F1B, 2 ranks x 2 chunks of one block: what a rank holds of the outputs and
        # input gradients it sent (`rules.interleaved_sends`)
        (f"gpt interleaved v2, G {G}", "loop-gpt", ["--pp", "2"], {**_INTERLEAVED, "G": G})
        for G in (4, 8)
    ]
)
# bf16 weights, activations and gradients, as a GPU trains: the 16-bit paths (the loss's fp32
# upcast, the optimizer's fp32 reads of the gradients) that the fp32 loop never takes
_BF16 = ["--dtype", "bf16"]
BF16_CASES = [
    ("gpt dp2 bf16", "loop-gpt", [*_DP, *_BF16]),
    ("llama dp2 bf16", "loop-llama", [*_DP, *_BF16]),
    ("gpt pp2 bf16", "loop-gpt", ["--pp", "2", *_BF16]),
    ("llama tp2 bf16", "loop-llama", ["--pp", "1", "--tp", "2", *_BF16]),
    ("gpt dp2 compiled bf16", "loop-gpt", [*_DP, "--compile-blocks", *_BF16]),
]


def _with(plan_path: Path, edits: dict) -> dict:
    """The tuned plan at `plan_path` with G micro-batches (every stage's micro-batch rescaled to
    keep the global batch), its other `PLAN_KEYS` edits and every stage's other `edits` set,
    written back; the plan."""
    plan = json.loads(plan_path.read_text())
    G = edits.get("G", plan["micro_batches"])
    for stage in plan["stages"]:
        stage["micro_batch"] = stage["micro_batch"] * plan["micro_batches"] // G
        stage.update({k: v for k, v in edits.items() if k not in PLAN_KEYS})
    plan["micro_batches"] = G
    plan.update({k: v for k, v in edits.items() if k in PLAN_KEYS and k != "G"})
    plan_path.write_text(json.dumps(plan))
    return plan


def run_case(name: str, model: str, extra: list[str], tmp: Path, edits: dict | None = None) -> dict:
    plan_path = tmp / (name.replace(" ", "-").replace(",", "") + ".json")
    if "limit" in extra:
        res, extra = tune_limited(model, str(PROFILE), [a for a in extra if a != "limit"], plan_path)
    else:
        res = tune(model, str(PROFILE), extra, plan_path)
    if edits:
        res = {**res, "plan": _with(plan_path, edits)}
    val = _json(
        mist(
            "validate", str(plan_path), "--gpu", str(PROFILE), "--local", "--steps", str(STEPS), "--no-drift",
            "--trace-memory", "--json",
        )
    )  # fmt: skip
    stages = []
    for ps, ms, err in zip(val["predicted"]["stages"], val["measured"]["stages"], val["errors"]["allocator_peak"]):
        stages.append(
            {
                "device": ps["peak_memory_bytes"],
                "host": ps["host_peak_bytes"],
                "measured": ms["allocator_peak_bytes"],
                "unseen": ms["allocator_unseen_releases"],
                "error": err,
            }
        )
    return {"case": name, "plan": plan_summary(res["plan"]), "stages": stages}


def markdown(rows: list[dict]) -> str:
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    out = [
        "# Stage peaks on the CPU: the allocator's against the simulator's",
        "",
        f"Generated by `benchmarks/cpu_allocator_peak.py` on {platform.machine()}, torch "
        f"{_torch_version()}; profile `benchmarks/results/profiles/cpu-loop.json`; the plans of "
        "`cpu_loop.py` (2 worker processes, seq 256, global batch 8, fp32 unless the case says bf16), each run by `mist validate "
        "--trace-memory`. Predicted: the stage's device peak + host peak (MiB). Measured: the most bytes "
        "PyTorch's CPU allocator held at once over the first two steps (MiB), the slowest rank of the "
        "stage. Error: (predicted − measured) / measured. Unseen: blocks a gloo thread released, found "
        "by their address's reuse (each counted as live until then).",
        "",
        "| case | plan (tuned) | stage | predicted device + host | measured | error | unseen |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for i, s in enumerate(r["stages"]):
            out.append(
                f"| {r['case'] if i == 0 else ''} | {r['plan'] if i == 0 else ''} | {i} | "
                f"{mib(s['device'])} + {mib(s['host'])} | {mib(s['measured'])} | {s['error']:+.2%} | {s['unseen']} |"
            )
    errs = [abs(s["error"]) for r in rows for s in r["stages"]]
    clean = [abs(s["error"]) for r in rows for s in r["stages"] if not s["unseen"] and not s["host"]]
    out += [
        "",
        f"{len(errs)} stages: median |error| {statistics.median(errs):.2%}, max {max(errs):.2%}; the "
        f"{len(clean)} without offloading or unseen releases: median {statistics.median(clean):.2%}, "
        f"max {max(clean):.2%}.",
    ]
    return "\n".join(out) + "\n"


def _torch_version() -> str:
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return r.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", choices=("all", *SETS, "edited", "bf16", "interleaved"), default="all")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    rows = []
    cases = [(*c, None) for c in CASES if a.cases == "all" or c[0] in SETS.get(a.cases, ())]
    cases += [(*c, None) for c in BF16_CASES] if a.cases in ("all", "bf16") else []
    cases += EDITED_CASES if a.cases in ("all", "edited") else []
    cases += [c for c in EDITED_CASES if "interleaved" in c[0]] if a.cases == "interleaved" else []
    with tempfile.TemporaryDirectory() as d:
        for name, model, extra, edits in cases:
            rows.append(run_case(name, model, extra, Path(d), edits))
            print(name, [f"{s['error']:+.2%}" for s in rows[-1]["stages"]], file=sys.stderr)
    text = markdown(rows)
    (Path(a.out) / "cpu_allocator_peak.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
