"""The CPU loop: profile this machine's CPU, tune small models on that profile, run the plans and
put every prediction next to its measurement — all through the `mist` command line, as a user
would (`mist profile`, `mist tune`, `mist validate`).

A CPU "cluster" here is 2 worker processes (gloo), each a device of ⌊cores / 2⌋ threads. Cases: a
small GPT and a small Llama (benchmarks/models/) under data parallelism, a 2-stage pipeline, tensor
parallelism, a memory limit that makes the tuner recompute or offload, and the GPT with dropout. Memory is compared
byte for byte where the runtime accounts tensors (device-resident states; saved activations).

    PYTHONPATH=src python benchmarks/cpu_loop.py [--profile PATH | --profile-budget 60]
        [--steps 5] [--cases all|quick|dropout] [--out benchmarks/results]

Writes OUT/cpu_loop.md (table) and OUT/cpu_loop.json; the profile goes to OUT/profiles/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"
SEQ, BATCH, WORKERS = 256, 8, 2

# the step-time target: |error| of the median plan, and of the worst (a busy machine moves them;
# reported here, not asserted by the tests)
TIME_TARGET_MEDIAN, TIME_TARGET_MAX = 0.25, 0.35

# host memory of the offloaded parts, accounted by the runtime tensor by tensor like the device states
HOST_KEYS = ("host_state_bytes", "host_activation_peak_bytes", "host_optimizer_grad_bytes")

# (case, model file, extra `mist tune` arguments); "limit" cases get a --memory-limit below the
# peak of the same case's unlimited plan (see `memory_limit`)
CASES = [
    ("gpt dp2", "loop-gpt", ["--pp", "1", "--tp", "1"]),
    ("llama dp2", "loop-llama", ["--pp", "1", "--tp", "1"]),
    ("gpt pp2", "loop-gpt", ["--pp", "2"]),
    ("llama pp2", "loop-llama", ["--pp", "2"]),
    ("gpt tp2", "loop-gpt", ["--pp", "1", "--tp", "2"]),
    ("llama tp2", "loop-llama", ["--pp", "1", "--tp", "2"]),
    ("gpt dp2 memory limit", "loop-gpt", ["--pp", "1", "--tp", "1", "limit"]),
    ("llama pp2 memory limit", "loop-llama", ["--pp", "2", "limit"]),
    # the blocks compiled with Inductor's CPU backend (`mist tune --compile-blocks`)
    ("gpt dp2 compiled", "loop-gpt", ["--pp", "1", "--tp", "1", "--compile-blocks"]),
    ("llama pp2 compiled", "loop-llama", ["--pp", "2", "--compile-blocks"]),
    # compiled under tensor parallelism: the collectives inside the compiled graphs
    ("gpt tp2 compiled", "loop-gpt", ["--pp", "1", "--tp", "2", "--compile-blocks"]),
    # compiled under a memory limit: activation offload splits the saved storages whole
    ("llama dp2 compiled memory limit", "loop-llama", ["--pp", "1", "--tp", "1", "--compile-blocks", "limit"]),
    # dropout (attention probabilities and hidden outputs; materialised attention), eager and with
    # Inductor's generated masks, next to the same model without dropout
    ("gpt dp2 bmm", "loop-gpt", ["--pp", "1", "--tp", "1", "--no-flash"]),
    ("gpt dp2 dropout", "loop-gpt-drop", ["--pp", "1", "--tp", "1", "--no-flash"]),
    ("gpt dp2 dropout compiled", "loop-gpt-drop", ["--pp", "1", "--tp", "1", "--no-flash", "--compile-blocks"]),
]
SETS = {
    "quick": ("llama dp2", "gpt pp2", "llama tp2", "gpt dp2 memory limit"),
    "dropout": ("gpt dp2 bmm", "gpt dp2 dropout", "gpt dp2 dropout compiled"),
}
# fractions of the unconstrained plan's predicted peak, tried in turn until a plan fits: the
# first that fits forces recompute / offload
LIMIT_FRACTIONS = (0.6, 0.7, 0.8, 0.9)


def _shown(profile: str) -> str:
    """The profile as the results name it: its path in the repository, or that it was measured
    for the run and kept outside it."""
    p = Path(profile).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else "measured for this run, not committed"


def mist(*args: str, timeout: float = 900) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-m", "mist", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )
    if r.returncode != 0:
        raise RuntimeError(f"mist {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def _json(text: str) -> dict:
    return json.loads(text[text.index("{") :])


def plan_summary(plan: dict) -> str:
    parts = []
    for s in plan["stages"]:
        off = s["offload"]
        o = "/".join(f"{off[k]:g}" for k in ("weights", "grads", "optimizer", "activations"))
        parts.append(
            f"[{s['layers']}L b{s['micro_batch']} dp{s['dp']} tp{s['tp']} z{s['zero']} "
            f"rc{s['recompute_layers']}" + (f" off {o}" if any(off.values()) else "") + "]"
        )
    schedule = f" {plan['schedule']}" if plan.get("schedule", "1f1b") != "1f1b" else ""
    compiled = " compiled" if plan["training"].get("compile_blocks") else ""
    return f"G {plan['micro_batches']}{schedule}{compiled} " + " ".join(parts)


def tune(model: str, profile: str, extra: list[str], plan_path: Path) -> dict:
    args = [
        "tune",
        "--model",
        str(MODELS / f"{model}.yaml"),
        "--gpu",
        profile,
        "--nodes",
        "1",
        "--gpus-per-node",
        str(WORKERS),
        "--seq",
        str(SEQ),
        "--global-batch",
        str(BATCH),
        "-o",
        str(plan_path),
        "--json",
        *extra,
    ]
    return _json(mist(*args))


def tune_limited(model: str, profile: str, extra: list[str], plan_path: Path) -> tuple[dict, list[str]]:
    """Tune under the tightest --memory-limit of LIMIT_FRACTIONS × the unlimited plan's peak that
    still fits; (result, the arguments used)."""
    free = tune(model, profile, extra, plan_path)
    peak = max(s["peak_memory_bytes"] for s in free["predicted"]["stages"])
    for f in LIMIT_FRACTIONS:
        args = extra + ["--memory-limit", f"{f * peak / 2**30:.4f}"]
        try:
            return tune(model, profile, args, plan_path), args
        except RuntimeError as e:
            if "No configuration fits" not in str(e):
                raise
    raise RuntimeError(f"no plan of {model} fits under {LIMIT_FRACTIONS[-1]:.0%} of its unlimited peak")


def run_case(name: str, model: str, extra: list[str], profile: str, steps: int, tmp: Path) -> dict:
    plan_path = tmp / (name.replace(" ", "-") + ".json")
    if "limit" in extra:
        res, extra = tune_limited(model, profile, [a for a in extra if a != "limit"], plan_path)
    else:
        res = tune(model, profile, extra, plan_path)
    t0 = time.perf_counter()
    val = _json(
        mist("validate", str(plan_path), "--gpu", profile, "--local", "--steps", str(steps), "--no-drift", "--json")
    )
    pred, meas, err = val["predicted"], val["measured"], val["errors"]
    stages = []
    for ps, ms in zip(pred["stages"], meas["stages"]):
        stages.append(
            {
                k: {"predicted": ps.get(k), "measured": ms.get(k)}  # (W: ZB-H1 stages only)
                for k in (
                    "peak_memory_bytes",
                    "state_bytes",
                    "saved_activation_peak_bytes",
                    "stable_time_s",
                    "delta_time_s",
                    "weight_grad_time_s",
                )
                + HOST_KEYS
            }
        )
    return {
        "case": name,
        "model": model,
        "tune_args": extra,
        "plan": res["plan"],
        "plan_summary": plan_summary(res["plan"]),
        "tuning_time_s": res["tuning_time_s"],
        "predicted_step_s": pred["iteration_time_s"],
        "measured_step_s": meas["step_time_s"],
        "measured_step_times_s": meas["step_times_s"],
        "step_time_error": err["step_time"],
        "stages": stages,
        "validate_wall_s": time.perf_counter() - t0,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def markdown(rows: list[dict], profile: dict, steps: int) -> str:
    fp = profile.get("fingerprint", {})
    out = [
        f"CPU loop on {fp.get('device', '?')} ({fp.get('cpu_count', '?')} cores, {WORKERS} worker processes of "
        f"{fp.get('torch_threads', '?')} thread(s), torch {fp.get('torch', '?')}); profile `{profile['name']}` "
        f"written by `mist profile --device cpu --processes {WORKERS}` in {fp.get('profile_seconds', '?')} s. "
        f"Models: benchmarks/models/, seq {SEQ}, global batch {BATCH}, fp32. Step time: mean of steps 2–{steps} "
        "of `mist validate`; errors are (predicted − measured) / measured.",
        "",
        "| case | plan (tuned) | predicted step (s) | measured step (s) | error | T per stage pred/meas (ms) "
        "| D per stage pred/meas (ms) | W per stage pred/meas (ms) | states pred/meas (MiB) "
        "| saved activations pred/meas (MiB) "
        "| host: states + activations + CPU Adam gradients pred/meas (MiB) | peak pred/meas (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        st = " · ".join(
            f"{_mib(s['state_bytes']['predicted'])}/{_mib(s['state_bytes']['measured'])}" for s in r["stages"]
        )
        sa = " · ".join(
            f"{_mib(s['saved_activation_peak_bytes']['predicted'])}/"
            f"{_mib(s['saved_activation_peak_bytes']['measured'])}"
            for s in r["stages"]
        )
        hb = lambda s, w: sum(s[k][w] for k in HOST_KEYS)  # noqa: E731
        ho = " · ".join(f"{_mib(hb(s, 'predicted'))}/{_mib(hb(s, 'measured'))}" for s in r["stages"])
        pk = " · ".join(
            f"{_mib(s['peak_memory_bytes']['predicted'])}/{_mib(s['peak_memory_bytes']['measured'])}"
            for s in r["stages"]
        )

        def ms(k):
            show = lambda v: "–" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
            return " · ".join(f"{show(s[k]['predicted'])}/{show(s[k]['measured'])}" for s in r["stages"])

        out.append(
            f"| {r['case']} | {r['plan_summary']} | {r['predicted_step_s']:.3f} | "
            f"{r['measured_step_s']:.3f} | {r['step_time_error']:+.1%} | {ms('stable_time_s')} | "
            f"{ms('delta_time_s')} | {ms('weight_grad_time_s')} | {st} | {sa} | {ho} | {pk} |"
        )
    s = summary(rows)
    out += [
        "",
        f"Step time: median |error| {s['median_abs_time_error']:.1%}, max {s['max_abs_time_error']:.1%} "
        f"over {len(rows)} plans (target: median ≤ {TIME_TARGET_MEDIAN:.0%}, max ≤ {TIME_TARGET_MAX:.0%}: "
        f"{'met' if s['time_target_met'] else 'NOT met'})"
        + "".join(
            f"; {k} blocks: median |error| {s[f'median_abs_time_error_{k}']:.1%}"
            for k in ("eager", "compiled")
            if f"median_abs_time_error_{k}" in s
        )
        + ". "
        f"States exact to the byte on {s['states_exact']}/{s['stage_count']} stages, "
        f"saved activations on {s['activations_exact']}/{s['stage_count']}, host memory (each of its three "
        f"terms) on {s['host_exact']}/{s['stage_count']}. The peak column compares the "
        "simulator's peak (with operator temporaries) with the runtime's accounted peak (without them), "
        "so it is an upper bound, not a byte match. T and D per stage: see `mist.runtime.phase_timer` "
        "(with G = 1, D is 0 by definition). W: the weight-gradient pass of one micro-batch of a ZB-H1 "
        "stage (– where the stage has none of its own: 1F1B, or the first stage, whose W is its whole "
        "backward).",
    ]
    return "\n".join(out) + "\n"


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["step_time_error"]) for r in rows]
    stages = [s for r in rows for s in r["stages"]]
    exact = lambda k: sum(s[k]["predicted"] == s[k]["measured"] for s in stages)  # noqa: E731
    by_kind = {
        kind: [abs(r["step_time_error"]) for r in rows if bool(r["plan"]["training"].get("compile_blocks")) == c]
        for kind, c in (("eager", False), ("compiled", True))
    }
    return {
        **{f"median_abs_time_error_{k}": statistics.median(v) for k, v in by_kind.items() if v},
        "median_abs_time_error": statistics.median(errs),
        "max_abs_time_error": max(errs),
        "time_target_met": statistics.median(errs) <= TIME_TARGET_MEDIAN and max(errs) <= TIME_TARGET_MAX,
        "stage_count": len(stages),
        "states_exact": exact("state_bytes"),
        "activations_exact": exact("saved_activation_peak_bytes"),
        "host_exact": sum(all(s[k]["predicted"] == s[k]["measured"] for k in HOST_KEYS) for s in stages),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="Use this CPU profile instead of measuring one.")
    ap.add_argument("--profile-budget", type=float, default=60.0, help="Seconds for `mist profile`.")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", choices=("all", *SETS), default="all")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    (out / "profiles").mkdir(parents=True, exist_ok=True)
    profile = a.profile
    if profile is None:
        profile = str(out / "profiles" / "cpu-loop.json")
        mist(
            "profile",
            "--device",
            "cpu",
            "--processes",
            str(WORKERS),
            "--time-budget",
            str(a.profile_budget),
            "-o",
            profile,
        )
    cases = [c for c in CASES if a.cases == "all" or c[0] in SETS[a.cases]]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, model, extra in cases:
            rows.append(run_case(name, model, extra, profile, a.steps, Path(d)))
            r = rows[-1]
            print(
                f"{name:24s} predicted {r['predicted_step_s']:.3f} s measured {r['measured_step_s']:.3f} s "
                f"({r['step_time_error']:+.1%})",
                file=sys.stderr,
            )
    prof = json.loads(Path(profile).read_text())
    (out / "cpu_loop.md").write_text(markdown(rows, prof, a.steps))
    (out / "cpu_loop.json").write_text(
        json.dumps({"profile": _shown(profile), "summary": summary(rows), "cases": rows}, indent=1)
    )
    print(markdown(rows, prof, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
