"""How far `mist simulate` and `mist estimate` have moved since an earlier commit, plan by plan.

Measured errors quoted against an earlier version of the cost model (for example real runs that
are not part of this repository) stay tied to that version. A prediction p_then with error
e_then = p_then / measured − 1 has, for the same plan today, the error
(1 + e_then) · p_now / p_then − 1. This script gives the ratio p_now / p_then for:

* every plan stored in the fp16 suite results (`suite-l4-a100-fp16.json`: the paper's cases on
  L4 and A100, in the original Mist space and the two Megatron-LM spaces) that the earlier
  version can read (1F1B, one chunk per stage, no sequence or context parallelism, no
  selective recomputation of the MLP activation);
* the two plans of the original Mist artifact's smoke test (its README: GPT-1.3B on 2 L4, seq
  2048, global batch 32, no flash; Mist's plan of 2 stages × 12 layers, G 16, b 2, ZeRO-1, 5 and
  0 recomputed layers, and Megatron-LM's best plan, dp 2, b 8, G 2, every layer recomputed:
  `examples/gpt3-1.3b-2xl4-pp2.json` and `examples/gpt3-1.3b-2xl4-dp2-recompute.json`);
* any plan files given with `--plans` (for example `results/prediction_drift_plans/`: GPT without
  flash on 2, 4 and 8 A10G, tuned in the Megatron-LM and original Mist spaces at 0be2886);
* the GPT blocks and whole GPT models measured on an H200 in this repository
  (`results/h200_blocks_measured.json`), with the error of each version against them.

Both versions run through their own command line (`python -m mist … --json`), so nothing of one
leaks into the other; the earlier one from a temporary `git worktree` of `--base`.

    python benchmarks/prediction_drift.py --base 81dd0dd [--out benchmarks/results/prediction_drift.md]
        [--json benchmarks/results/prediction_drift.json] [--render] [--plans DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SUITE = "suite-l4-a100-fp16.json"
SPACES = ("mist-paper", "megatron", "megatron-paper")

# The original artifact's smoke test (its README), as this repository's example plans.
SMOKE = {
    "smoke: Mist plan": ROOT / "examples" / "gpt3-1.3b-2xl4-pp2.json",
    "smoke: Megatron-LM plan": ROOT / "examples" / "gpt3-1.3b-2xl4-dp2-recompute.json",
}


def readable_then(plan: dict) -> bool:
    """Whether a version before interleaving, ZB-H1, SP/CP and MLP-activation recomputation reads it."""
    if plan.get("schedule", "1f1b") != "1f1b" or plan.get("virtual_stages", 1) != 1:
        return False
    if plan["training"].get("grad_dtype", plan["training"].get("param_dtype")) == "fp32":
        return False
    return not any(
        s.get("recompute_activation") or s.get("sequence_parallel") or s.get("cp", 1) != 1 for s in plan["stages"]
    )


def then_form(plan: dict) -> dict:
    """The plan without the fields added since (each at its default value here)."""
    p = json.loads(json.dumps(plan))
    p.pop("schedule", None)
    p.pop("virtual_stages", None)
    for s in p["stages"]:
        for k in ("recompute_activation", "sequence_parallel", "cp"):
            s.pop(k, None)
    return p


def stored_plans() -> dict[str, dict]:
    out = {}
    for case in json.loads((RESULTS / SUITE).read_text()):
        n = case["nodes"] * case["gpus_per_node"]
        for sp in case["spaces"]:
            plan = sp.get("plan")
            if sp["space"] not in SPACES or plan is None or not readable_then(plan):
                continue
            flash = "flash" if case["flash_attention"] else "no flash"
            out[f"{case['model']} {n}×{case['gpu']} {flash} · {sp['space']}"] = then_form(plan)
    return out


def mist(src: Path, cache: Path, *args: str) -> dict | None:
    """One command's JSON, or None (its error line printed) where that version refuses it."""
    env = dict(os.environ, PYTHONPATH=str(src), MIST_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-m", "mist", *args, "--json"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{src}: mist {' '.join(args)}: {(r.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout)


def eager(src: Path) -> list[str]:
    """The flag that makes this version's `mist estimate` price eager blocks, as the H200 blocks
    and models were measured (since 81dd0dd's successors default to compiled blocks on a GPU)."""
    return ["--no-compile"] if "--no-compile" in (src / "mist" / "cli.py").read_text() else []


def gpt_rows(rows: list[dict]) -> list[dict]:
    """The measured GPT rows (the other families' blocks were measured before the lean kernels)."""
    return [r for r in rows if r["model"].startswith("gpt") and "error" not in r]


def block_key(r: dict) -> str:
    return f"{r['model']} b{r['b']}"


def model_key(r: dict) -> str:
    return f"{r['model']} b{r['b']} {'recompute' if r['recompute'] else 'no recompute'}"


def predictions(src: Path, cache: Path, plans: dict, h200: dict, tmp: Path) -> dict:
    out: dict = {"plans": {}, "blocks": {}, "models": {}}
    for name, plan in plans.items():
        f = tmp / "plan.json"
        f.write_text(json.dumps(plan))
        r = mist(src, cache, "simulate", str(f))
        out["plans"][name] = (
            None
            if r is None
            else {"time": r["iteration_time_s"], "peaks": [s["peak_memory_bytes"] for s in r["stages"]]}
        )
    for r in gpt_rows(h200["blocks"]):
        e = mist(
            src, cache, "estimate", "--model", r["model"], "--gpu", "h200", "--micro-batch", str(r["b"]), *eager(src)
        )
        out["blocks"][block_key(r)] = (
            None
            if e is None
            else (
                e["layer"]["fwd_compute_ms"],
                e["layer"]["bwd_compute_ms"],
            )
        )
    for r in gpt_rows(h200["models"]):
        rc = (["--recompute", "full"] if r["recompute"] else []) + eager(src)
        e = mist(src, cache, "estimate", "--model", r["model"], "--gpu", "h200", "--micro-batch", str(r["b"]), *rc)
        out["models"][model_key(r)] = None if e is None else e["model"]["fwd_bwd_ms"]
    return out


def group(name: str) -> str:
    """ "gpt3-7b 8×l4 no flash · megatron" → "l4 gpt3 no flash"."""
    model, cluster, *rest = name.split(" · ")[0].split(" ")
    return f"{cluster.split('×')[1]} {model.split('-')[0]} {' '.join(rest)}"


def markdown(base: str, head: str, then: dict, now: dict, h200: dict) -> str:
    lines = [
        "# Predictions now against an earlier version of the cost model",
        "",
        f"Generated by `python benchmarks/prediction_drift.py --base {base}` at {head}. "
        f"Ratio = prediction now / prediction at {base}; an error e quoted against {base} is "
        "(1 + e) · ratio − 1 today for the same plan.",
        "",
        "## Plans: `mist simulate` iteration time (s)",
        "",
        f"| plan | at {base} | now | ratio | stage peaks: ratio now / at {base} |",
        "|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for name in then["plans"]:
        a, b = then["plans"][name], now["plans"][name]
        if a is None or b is None:
            shown = ["–" if x is None else f"{x['time']:.2f}" for x in (a, b)]
            lines.append(f"| {name} | {shown[0]} | {shown[1]} | – | – |")
            continue
        pr = [q / p for p, q in zip(a["peaks"], b["peaks"])]
        lines.append(
            f"| {name} | {a['time']:.2f} | {b['time']:.2f} | {b['time'] / a['time']:.3f} | "
            + " · ".join(f"{x:.3f}" for x in pr)
            + " |"
        )
        if name not in SMOKE:
            ratios.setdefault(group(name), []).append(b["time"] / a["time"])
            peaks.setdefault(group(name), []).extend(pr)
    lines += [
        "",
        "Per GPU, model family and attention (stored plans): ratios of the iteration time and of each stage's peak.",
        "",
    ]
    lines += ["| group | plans | time: median | min | max | stage peaks | median | min | max |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for g, rs in sorted(ratios.items()):
        ps = peaks[g]
        lines.append(
            f"| {g} | {len(rs)} | {statistics.median(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} | {len(ps)} | "
            f"{statistics.median(ps):.3f} | {min(ps):.3f} | {max(ps):.3f} |"
        )
    lines += [
        "",
        "## H200 GPT blocks and models: `mist estimate` against this repository's measurements",
        "",
        f"| what | measured (ms) | at {base} (ms) | error | now (ms) | error |",
        "|---|---|---|---|---|---|",
    ]
    errs: dict[str, list[float]] = {"then": [], "now": []}

    def row(what, m, a, b):
        ea, eb = a / m - 1, b / m - 1
        errs["then"].append(abs(ea))
        errs["now"].append(abs(eb))
        lines.append(f"| {what} | {m:.3f} | {a:.3f} | {ea:+.1%} | {b:.3f} | {eb:+.1%} |")

    for r in h200["blocks"]:
        key = block_key(r)
        if key in then["blocks"] and then["blocks"][key] and now["blocks"][key]:
            row(f"{key} block fwd", r["fwd_ms"], then["blocks"][key][0], now["blocks"][key][0])
            row(f"{key} block bwd", r["bwd_ms"], then["blocks"][key][1], now["blocks"][key][1])
    for r in h200["models"]:
        key = model_key(r)
        if key in then["models"] and then["models"][key] and now["models"][key]:
            row(f"{key} fwd+bwd", r["fwd_bwd_ms"], then["models"][key], now["models"][key])
    if errs["now"]:
        lines += [
            "",
            f"Median |error| at {base}: {statistics.median(errs['then']):.1%}; now: "
            f"{statistics.median(errs['now']):.1%} ({len(errs['now'])} values).",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="The earlier commit (needed unless --render).")
    ap.add_argument("--out", default=str(RESULTS / "prediction_drift.md"))
    ap.add_argument("--json", default=str(RESULTS / "prediction_drift.json"), help="Both versions' predictions.")
    ap.add_argument("--render", action="store_true", help="Rewrite the table from --json without predicting.")
    ap.add_argument("--plans", nargs="*", default=[], help="Folders of further plan files (JSON) to compare.")
    a = ap.parse_args(argv)
    h200 = json.loads((RESULTS / "h200_blocks_measured.json").read_text())
    if a.render:
        d = json.loads(Path(a.json).read_text())
        text = markdown(d["base"], d["head"], d["then"], d["now"], h200)
        Path(a.out).write_text(text)
        print(text)
        return 0
    if not a.base:
        ap.error("--base is needed to predict (or --render to redraw a stored run)")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    plans = {name: json.loads(f.read_text()) for name, f in SMOKE.items()} | stored_plans()
    for folder in a.plans:
        for f in sorted(Path(folder).glob("*.json")):
            plan = json.loads(f.read_text())
            if readable_then(plan):
                c = plan["cluster"]
                flash = "flash" if plan["training"].get("flash_attention", True) else "no flash"
                name = f"{plan['model']} {c['nodes'] * c['gpus_per_node']}×{c['gpu']} {flash} · {f.stem}"
                plans[name] = then_form(plan)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        tree = t / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), a.base], cwd=ROOT, check=True)
        try:
            then = predictions(tree / "src", t / "cache-base", plans, h200, t)
            now = predictions(ROOT / "src", t / "cache-now", plans, h200, t)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    Path(a.json).write_text(
        json.dumps({"base": a.base, "head": head.stdout.strip(), "then": then, "now": now}, indent=1)
    )
    text = markdown(a.base, head.stdout.strip(), then, now, h200)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
