"""Compare `mist estimate` with the H200 measurements of h200_block_check.py (a table)."""

import json
import statistics
import sys
from pathlib import Path

from mist.hardware import load_profile
from mist.simulate.estimate import estimate
from mist.specs.presets import get_preset

src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200_blocks_measured.json")
meas = json.loads(src.read_text())
prof = load_profile(sys.argv[2] if len(sys.argv) > 2 else "h200")
rows = ["| model | b | what | measured | predicted | error |", "|---|---|---|---|---|---|"]
errs = {"time": [], "memory": []}


def add(model, b, what, m, p, kind, unit):
    e = (p - m) / m
    errs[kind].append(abs(e))
    rows.append(f"| {model} | {b} | {what} | {m:.3f} {unit} | {p:.3f} {unit} | {e:+.1%} |")


for r in meas["blocks"]:
    if "error" in r:
        continue
    est = estimate(get_preset(r["model"]), prof, 2048, r["b"])
    lay = est.layer
    add(r["model"], r["b"], "block fwd", r["fwd_ms"], lay.fwd_compute_ms, "time", "ms")
    add(r["model"], r["b"], "block bwd", r["bwd_ms"], lay.bwd_compute_ms, "time", "ms")
    add(
        r["model"],
        r["b"],
        "block saved",
        r["saved_bytes"] / 2**20,
        lay.saved_activation_bytes / 2**20,
        "memory",
        "MiB",
    )
for r in meas["models"]:
    if "error" in r:
        continue
    est = estimate(get_preset(r["model"]), prof, 2048, 1, recompute="full" if r["recompute"] else "none")
    add(
        r["model"],
        1,
        "model fwd+bwd" + (" (full recompute)" if r["recompute"] else ""),
        r["fwd_bwd_ms"],
        est.model.fwd_bwd_ms,
        "time",
        "ms",
    )
text = (
    f"# mist estimate vs one H200 ({meas['device']}, torch {meas['torch']}), profile {prof.name}\n\n"
    + "\n".join(rows)
    + "\n\n"
    + f"Median |error|: time {statistics.median(errs['time']):.1%} over {len(errs['time'])}, "
    + f"activation memory {statistics.median(errs['memory']):.1%} over {len(errs['memory'])}.\n"
)
print(text)
