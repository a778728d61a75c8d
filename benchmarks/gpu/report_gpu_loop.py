"""Predictions next to a fetched `gpu_loop.py` run, computed here (CPU torch), not on the device.

    PYTHONPATH=src python benchmarks/gpu/report_gpu_loop.py FETCHED_OUT
        [--md FETCHED_OUT/report.md] [--json FETCHED_OUT/predicted.json]
        [--profile-md FETCHED_OUT/profile_vs_shipped.md] [--shipped h200] [--profile PATH]

Reads FETCHED_OUT/gpu_loop.json and FETCHED_OUT/h200-profile.json (when the profile phase wrote
it). Every measured plan is simulated with `simulate_plan` twice: with the shipped profile and
with the fetched (measured) one. Writes the markdown report (step time, peak memory, the
runtime's accounted state / saved-activation bytes against the simulator's to the byte, bare
PyTorch loop vs the plain plan, and the kernel phase's single blocks: their largest kernels and
their linear layers alone next to the shipped profile's GEMM table; a rank's own attention
dropout compiled against eager), the raw run with the
predictions added (--json), and the GEMM grid of the fetched profile against the shipped one
(benchmarks/compare_profiles.py).
Errors are (predicted − measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "src", ROOT / "benchmarks", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gpu_loop import PLAIN, PROFILE, RESULT, error_text  # noqa: E402

import compare_profiles  # noqa: E402

KEYS = ("peak_memory_bytes", "state_bytes", "saved_activation_peak_bytes")


def predict(plan_dict: dict, profile) -> dict:
    """The simulator's step time and per-stage bytes for a plan, or {"error": …}."""
    from mist.plan import plan_from_dict
    from mist.simulate.plan_sim import simulate_plan

    try:
        sim = simulate_plan(plan_from_dict(plan_dict), profile)
    except Exception as e:  # noqa: BLE001 - one plan's failure is reported, not fatal
        return {"error": error_text(e, 500)}
    return {
        "step_time_s": sim.iteration_time_s,
        "fits": sim.fits,
        "stages": [{k: getattr(s, k) for k in KEYS} for s in sim.stages],
    }


def add_predictions(data: dict, profiles: dict) -> dict:
    """data with `predicted[label]` on every plan that has metrics."""
    for row in data.get("plans", []):
        if row.get("status") == "ok" and row.get("plan"):
            row["predicted"] = {label: predict(row["plan"], prof) for label, prof in profiles.items()}
    return data


def _err(pred, meas) -> str:
    return f"{pred / meas - 1:+.1%}" if pred is not None and meas else "–"


def micro_batches(setup: dict):
    try:
        return setup["global_batch"] // setup["micro_batch"]
    except (KeyError, TypeError, ZeroDivisionError):
        return "?"


def last_line(text) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[-1] if lines else ""


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "–"


def _pred(row: dict, label: str, stage: int | None, key: str):
    p = row["predicted"].get(label) or {}
    if "error" in p:
        return None
    return p["step_time_s"] if stage is None else p["stages"][stage][key]


def _stage_rows(ok: list[dict]):
    for r in ok:
        for i, s in enumerate(r["metrics"]["stages"]):
            yield r, i, s, f"{r['name']}{f' (stage {i})' if i else ''}"


def time_table(ok: list[dict], labels: list[str]) -> list[str]:
    out = [
        f"| plan | measured | {' | '.join(f'predicted, {lb} | error' for lb in labels)} |",
        "|---|---|" + "---|---|" * len(labels),
    ]
    for r in ok:
        m = r["metrics"]["step_time_s"]
        preds = [_pred(r, lb, None, "") for lb in labels]
        out.append(f"| {r['name']} | {m:.3f} | " + " | ".join(f"{_num(p, '.3f')} | {_err(p, m)}" for p in preds) + " |")
    return out


def peak_table(ok: list[dict], labels: list[str]) -> list[str]:
    out = [
        f"| plan | measured | {' | '.join(f'predicted, {lb} | error' for lb in labels)} |",
        "|---|---|" + "---|---|" * len(labels),
    ]
    for r, i, s, name in _stage_rows(ok):
        m = s["peak_memory_bytes"]
        preds = [_pred(r, lb, i, KEYS[0]) for lb in labels]
        out.append(
            f"| {name} | {m / 2**30:.2f} | "
            + " | ".join(f"{'–' if p is None else f'{p / 2**30:.2f}'} | {_err(p, m)}" for p in preds)
            + " |"
        )
    return out


def outside_lines(ok: list[dict], profiles_outside: dict) -> list[str]:
    """The allocator's peak reserved bytes and the device bytes outside it (CUDA context, libraries)
    per plan, next to what the profiles say is outside it (the fit rule takes it off the capacity)."""
    rows = [
        f"- {name}: reserved peak {_gib(s.get('peak_reserved_bytes'))}, outside the allocator "
        f"{_gib(s.get('outside_allocator_bytes'))} after the last step"
        for _, _, s, name in _stage_rows(ok)
    ]
    if not rows:
        return []
    prof = "; ".join(f"`{lb}` {_gib(v)}" for lb, v in profiles_outside.items())
    return ["", *rows, f"- outside the allocator in the profiles: {prof}", ""]


def _gib(v) -> str:
    return f"{v / 2**30:.2f} GiB" if isinstance(v, (int, float)) else "not measured"


def bytes_table(ok: list[dict], labels: list[str]) -> list[str]:
    head = " | ".join(f"predicted, {lb}" for lb in labels)
    out = [
        f"| plan | state_bytes measured | {head} | saved_activation_peak_bytes measured | {head} |",
        "|---|---|" + "---|" * len(labels) + "---|" + "---|" * len(labels),
    ]
    for r, i, s, name in _stage_rows(ok):
        cells = []
        for key in KEYS[1:]:
            cells.append(f"{s[key]:,}")
            for lb in labels:
                p = _pred(r, lb, i, key)
                cells.append("–" if p is None else f"{p:,} ({p - s[key]:+,})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def markdown(
    data: dict, labels: list[str], profile_summary: str | None, gemm_profile=None, profiles_outside=None
) -> str:
    profiles_outside = profiles_outside or {}
    env, setup = data.get("env", {}), data.get("setup", {})
    ok = [r for r in data.get("plans", []) if r.get("status") == "ok"]
    model = setup.get("model", "?")
    model = model.get("name", "?") if isinstance(model, dict) else model
    out = [
        f"# gpu_loop.py on {env.get('device', '?')} (torch {env.get('torch', '?')}, {data.get('started', '?')})",
        "",
        f"{model}, seq {setup.get('seq', '?')}, global batch {setup.get('global_batch', '?')} "
        f"= micro-batch {setup.get('micro_batch', '?')} × G {micro_batches(setup)}, {setup.get('dtype', '?')}, "
        "flash attention; "
        f"{setup.get('steps', '?')} steps per plan, step time = the runtime's mean of steps 2–N. Predictions "
        "computed afterwards with `simulate_plan` (here, not on the device) with "
        + " and ".join(f"`{lb}`" for lb in labels)
        + ". Errors: (predicted − measured) / measured.",
        "",
        "## Step time (s)",
        "",
        *time_table(ok, labels),
        "",
        "## Peak memory (GiB): the runtime's peak vs the simulator's",
        "",
        *peak_table(ok, labels),
        "",
        *outside_lines(ok, profiles_outside),
        "## Accounted bytes (the runtime's tensor accounting vs the simulator, to the byte)",
        "",
        "Predicted (predicted − measured) in bytes; `+0` is an exact match.",
        "",
        *bytes_table(ok, labels),
        "",
        "## Runtime overhead: bare PyTorch loop vs the plain plan",
        "",
        overhead_line(data),
    ]
    bad = [r for r in data.get("plans", []) if r.get("status") != "ok"]
    failed = [
        (r["name"], lb, r["predicted"][lb]["error"])
        for r in ok
        for lb in labels
        if "error" in (r["predicted"].get(lb) or {})
    ]
    if bad or failed:
        out += ["", "## Not measured / not predicted", ""]
        out += [f"- {r.get('name')}: {r.get('status')}: {last_line(r.get('error'))}" for r in bad]
        out += [f"- {name}: prediction with `{lb}` failed: {e}" for name, lb, e in failed]
    prof = data.get("profile") or {}
    out += [
        "",
        "## Profile",
        "",
        f"`mist profile` on the device: {prof.get('status', 'not run')}"
        + (f", {prof['wall_s']:.0f} s wall" if isinstance(prof.get("wall_s"), (int, float)) else "")
        + (f", {prof['profile_seconds']} s measuring" if prof.get("profile_seconds") is not None else "")
        + (f"; error: {last_line(prof['error'])[-300:]}" if prof.get("error") else "")
        + ".",
    ]
    if profile_summary:
        out += ["", profile_summary]
    if data.get("kernels") and gemm_profile is not None:
        blocks = [b[0] for b in setup.get("kernel_blocks", ())]
        out += ["", *kernels_section(data["kernels"], gemm_profile, blocks)]
    if data.get("split_backward"):
        out += ["", *split_section(data["split_backward"])]
    if data.get("dropout"):
        out += ["", *dropout_section(data["dropout"])]
    return "\n".join(out) + "\n"


def dropout_section(row: dict) -> list[str]:
    """Phase 5: a rank's own attention dropout, compiled vs eager on the device (the largest
    difference of each tensor; masks that disagree would differ by the values themselves)."""
    out = ["## A rank's own attention dropout: compiled vs eager", ""]
    if row.get("status") != "ok":
        return out + [f"{row.get('status')}: {last_line(row.get('error'))}"]
    cases = row["cases"]
    names = [k for k in next(iter(cases.values())) if k != "another seed differs"]
    out += ["| case | " + " | ".join(f"max abs diff: {n}" for n in names) + " | another seed differs |"]
    out += ["|---" * (len(names) + 2) + "|"]
    for case, d in cases.items():
        out += [f"| {case} | " + " | ".join(f"{d[n]:.2e}" for n in names) + f" | {d['another seed differs']} |"]
    return out


def block_estimate(model, b: int, seq: int, tp: int, profile) -> tuple[float, float] | None:
    """`mist estimate`'s (forward, backward) compute time in ms of one block of `model` (a preset
    name or a model mapping) at micro-batch b, as rank 0's shard of `tp`; None where it fails."""
    from mist.simulate.estimate import estimate
    from mist.specs.loading import load_model, load_model_dict

    try:
        spec = load_model(model) if isinstance(model, str) else load_model_dict(model, source="model")
        lay = estimate(spec, profile, seq, b, tp=tp).layer
    except Exception:  # noqa: BLE001 - the table says "–"
        return None
    return lay.fwd_compute_ms, lay.bwd_compute_ms


def kernels_section(rows: list[dict], profile, models=(), top: int = 8) -> list[str]:
    """Phase 3: each block's passes (time, `mist estimate`'s with `profile` where the block's model
    is in `models`, the kernels' device time, the largest kernels) and its linear layers alone: as
    the block calls them, without bias, with random weights, and what `profile`'s GEMM table prices
    that shape at."""
    out = ["## Kernels of single blocks", ""]
    for i, r in enumerate(rows):
        tp = r.get("tp", 1)
        head = f"### {r.get('model')} b {r.get('b')}" + (f", tensor-parallel shard 1 of {tp}" if tp > 1 else "")
        if r.get("status") != "ok":
            out += [head, "", f"{r.get('status')}: {last_line(r.get('error'))}", ""]
            continue
        out += [head, ""]
        est = block_estimate(models[i], r["b"], r["seq"], tp, profile) if i < len(models) else None
        if est is not None:
            out.append(
                f"- `mist estimate` with `{profile.name}`: fwd {est[0]:.3f} ms ({_err(est[0], r['fwd_ms'])}), "
                f"bwd {est[1]:.3f} ms ({_err(est[1], r['bwd_ms'])})"
            )
        passes = (("fwd", "fwd"), ("bwd", "bwd"), ("fwd_unit_weights", "fwd with N(0, 1) weight matrices"))
        for ph, label in passes:
            ks = r[ph]
            total = sum(us for _, us in ks.values()) / 1e3
            calls = sum(c for c, _ in ks.values())
            out.append(f"- {label}: {r[ph + '_ms']:.3f} ms; kernels {total:.3f} ms in {calls:.0f} calls")
            out += [f"  - {us / 1e3:.3f} ms ×{c:g} `{name[:90]}`" for name, (c, us) in list(ks.items())[:top]]
        for ph, n in r.get("aten_calls", {}).items():  # (runs before 2026-12-07 did not count them)
            out.append(
                f"- {ph}: {n['calls']} ATen calls dispatched ({n['views']} of them views), "
                f"{1e3 * r[ph + '_ms'] / n['calls']:.1f} µs of the measured pass per call"
            )
        out += [
            "",
            f"| linear | m × n × k | as called (ms) | without bias | random weights | `{profile.name}` table |",
            "|---|---|---|---|---|---|",
        ]
        for lin in r["linears"]:
            table = float(profile.gemm_time(lin["m"], lin["n"], lin["k"], 1)) * 1e3
            bias = " (bias in the GEMM)" if lin["bias_in_gemm"] else ""
            out.append(
                f"| {lin['name']}{bias} | {lin['m']} × {lin['n']} × {lin['k']} | {lin['as_called_ms']:.4f} | "
                f"{_num(lin['no_bias_ms'], '.4f')} | {lin['random_weights_ms']:.4f} | {table:.4f} |"
            )
        out.append("")
    return out


def split_section(row: dict) -> list[str]:
    """Phase 4: a block compiled with its backward split into B and W (ZB-H1's compiled path)."""
    out = ["## A compiled block's backward split into B and W", ""]
    if row.get("status") != "ok":
        return out + [f"{row.get('status')}: {last_line(row.get('error'))}"]
    worst = {k: max(row[k].values()) for k in ("whole_vs_eager", "split_vs_eager", "split_vs_whole")}
    out += [
        f"{row['model']}, b {row['b']}, seq {row['seq']}: backward times (median, each after a fresh forward)",
        "",
        "| eager | compiled whole | B | W | B + W | B + W vs whole |",
        "|---|---|---|---|---|---|",
        f"| {row['eager_bwd_ms']:.3f} ms | {row['whole_bwd_ms']:.3f} ms | {row['B_ms']:.3f} ms | "
        f"{row['W_ms']:.3f} ms | {row['B_ms'] + row['W_ms']:.3f} ms | "
        f"{_err(row['B_ms'] + row['W_ms'], row['whole_bwd_ms'])} |",
        "",
        f"Gradients, max |diff| / max |reference| over the input's and every parameter's: whole compiled vs "
        f"eager {worst['whole_vs_eager']:.2e}, B then W vs eager {worst['split_vs_eager']:.2e}, B then W vs "
        f"whole {worst['split_vs_whole']:.2e}. B left every weight gradient to W: "
        f"{row['b_left_every_weight_gradient_to_w']}; pending W graphs: {row['deferred_w_graphs']}. "
        f"First backward (compiling): whole {row['compile_whole_s']:.1f} s with the eager reference, "
        f"split {row['compile_split_s']:.1f} s.",
    ]
    return out


def overhead_line(data: dict) -> str:
    bare = data.get("bare_loop") or {}
    plain = next((r for r in data.get("plans", []) if r.get("name") == PLAIN and r.get("status") == "ok"), None)
    if bare.get("status") != "ok" or plain is None:
        return (
            f"Not available: bare loop {bare.get('status', 'not run')}, plain plan "
            f"{'measured' if plain else 'not measured'}."
        )
    m = plain["metrics"]
    ts, tb = m["step_time_s"], bare["step_time_s"]
    line = (
        f"Plain plan {ts:.3f} s per step vs bare loop {tb:.3f} s (median {bare['median_step_s']:.3f} s): "
        f"runtime overhead {ts / tb - 1:+.1%}."
    )
    pb, ps = bare.get("peak_memory_bytes"), m["stages"][0]["peak_memory_bytes"]
    if pb:
        line += f" Peak memory {ps / 2**30:.2f} GiB vs {pb / 2**30:.2f} GiB ({ps / pb - 1:+.1%})."
    return line + f" Bare loop: {bare.get('how', '')}."


def compare_with_shipped(fetched: Path, shipped: str, out_md: Path, min_us: float = 25.0) -> str:
    """benchmarks/compare_profiles.py of the fetched profile (A) vs the shipped one (B); its summary."""
    from mist.hardware import load_profile

    a, b = load_profile(str(fetched)), load_profile(shipped)
    rows, summary = compare_profiles.compare(a, b, min_us)
    text = compare_profiles.markdown(a, b, rows, summary, min_us)
    out_md.write_text(text)
    return f"GEMM grid of the fetched profile vs `{shipped}` ({out_md.name}): " + text.strip().splitlines()[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fetched", help="The folder gpu_loop.py wrote ($OUT, fetched).")
    ap.add_argument("--md", default=None, help="The report (default: FETCHED/report.md).")
    ap.add_argument("--json", default=None, help="The run with the predictions (default: FETCHED/predicted.json).")
    ap.add_argument(
        "--profile-md", default=None, help="The GEMM grid comparison (default: FETCHED/profile_vs_shipped.md)."
    )
    ap.add_argument("--shipped", default="h200")
    ap.add_argument(
        "--profile", default=None, help=f"The measured profile (default: FETCHED/{PROFILE}, where the run wrote one)."
    )
    a = ap.parse_args(argv)
    from mist.hardware import load_profile

    fetched = Path(a.fetched)
    md = Path(a.md or fetched / "report.md")
    out_json = Path(a.json or fetched / "predicted.json")
    profile_md = Path(a.profile_md or fetched / "profile_vs_shipped.md")
    data = json.loads((fetched / RESULT).read_text())
    profiles = {f"shipped {a.shipped}": load_profile(a.shipped)}
    summary = None
    measured = Path(a.profile) if a.profile else fetched / PROFILE
    if measured.exists():
        try:
            profiles[f"measured {measured.name}"] = load_profile(str(measured))
            summary = compare_with_shipped(measured, a.shipped, profile_md)
        except Exception as e:  # noqa: BLE001 - the report still covers the shipped profile
            summary = f"The fetched profile could not be used: {error_text(e, 500)}"
    add_predictions(data, profiles)
    outside = {lb: p.outside_allocator_bytes for lb, p in profiles.items()}
    text = markdown(data, list(profiles), summary, profiles[f"shipped {a.shipped}"], outside)
    md.write_text(text)
    out_json.write_text(json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
