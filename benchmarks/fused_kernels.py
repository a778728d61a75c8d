"""A compiled block's fused kernels on this CPU: measured by Inductor's kernel profiler against the
two ways a profile can price them (`mist.hardware.memory_ops.MemoryOpModel.fused_time`).

For each CPU-loop model (benchmarks/models/), one decoder block compiled as the runtime compiles it
(`mist.models.compiled.compile_block`), fp32, one thread, b 4, s 256: the forward and the backward
each run under `torch.profiler` with Inductor's per-kernel records on, and the generated kernels'
times are summed per pass. The predictions price the fused kernels the analysis finds in the
same graphs (`mist.analysis.compiled`) with the given profile, once by their bytes alone (the
profile without `pointwise_s`) and once as the longer of their bytes and their element-operations.

    PYTHONPATH=src python benchmarks/fused_kernels.py --profile PROFILE.json [--out benchmarks/results]

PROFILE must be a CPU profile of this machine with `pointwise_s` (`mist profile --device cpu`, or
the one `benchmarks/cpu_loop.py` writes under its --out).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from mist.analysis import analyze_layer
from mist.hardware import load_profile
from mist.models import DecoderBlock, TPGroup, init_weights
from mist.models.compiled import compile_block
from mist.simulate.layer_cost import kernel_time
from mist.specs.model import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
B, S, REPS = 4, 256, 5


def _spec(family: str) -> ModelSpec:
    d = yaml.safe_load((ROOT / "benchmarks" / "models" / f"loop-{family}.yaml").read_text())
    d.pop("name", None)
    return ModelSpec(**d)


def measured(spec: ModelSpec) -> dict:
    """Seconds of the generated (fused) kernels per pass, mean of REPS passes, by kernel."""
    import torch._inductor.config as inductor_config  # lazy: only where kernels are profiled

    inductor_config.cpp.enable_kernel_profile = True
    torch._dynamo.reset()
    block = DecoderBlock(spec, TPGroup(), True, torch.float32)
    init_weights(block, 0)
    run = compile_block(block)
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    g = torch.randn(B, S, spec.hidden_size)
    for _ in range(3):
        run(x).backward(g)
    out: dict = {}
    for phase in ("fwd", "bwd"):
        kernels: dict = {}
        for _ in range(REPS):
            y = run(x) if phase == "bwd" else None
            with torch.profiler.profile() as prof:
                if phase == "fwd":
                    y = run(x)
                else:
                    y.backward(g)
            if phase == "fwd":
                y.backward(g)
            for e in prof.key_averages():
                if "cpp_fused" in e.key:
                    kernels[e.key] = kernels.get(e.key, 0.0) + e.self_cpu_time_total * 1e-6 / REPS
        out[phase] = kernels
    return out


def predicted(spec: ModelSpec, profile) -> tuple[dict, dict]:
    """({phase: (bytes-only seconds, roofline seconds, number of fused kernels)}, {phase: the
    fused kernels' element-operations of each kind, in millions})."""
    la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", False, compiled=True)
    bytes_only = replace(profile, memory_ops=replace(profile.memory_ops, pointwise_s=None))
    times, work = {}, {}
    for phase in ("fwd", "bwd"):
        ops = [op for op in la.op_values(phase, np.array([B]), np.array([S])) if op.op == "fused"]
        t = [sum(float(np.ravel(kernel_time(p, op, phase == "bwd"))[0]) for op in ops) for p in (bytes_only, profile)]
        times[phase] = (t[0], t[1], len(ops))
        tot: dict = {}
        for op in ops:
            for f in fields(op.params):
                tot[f.name] = tot.get(f.name, 0.0) + float(np.ravel(getattr(op.params, f.name))[0]) / 1e6
        work[phase] = {k: round(v, 2) for k, v in tot.items() if v}
    return times, work


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    profile = load_profile(a.profile)
    if profile.memory_ops.pointwise_s is None:
        print(f"error: {a.profile} has no pointwise_s; measure it with `mist profile --device cpu`.", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows, data = [], {"profile": profile.provenance, "b": B, "s": S, "models": {}}
    for family in ("gpt", "llama"):
        spec = _spec(family)
        meas, (pred, w) = measured(spec), predicted(spec, profile)
        data["models"][family] = {"measured_s": meas, "predicted_s": pred, "work_millions": w}
        for phase in ("fwd", "bwd"):
            m = sum(meas[phase].values())
            by_bytes, roof, n = pred[phase]
            top = max(meas[phase].items(), key=lambda kv: kv[1])
            rows.append(
                f"| loop-{family} | {phase} | {len(meas[phase])} / {n} | {m * 1e3:.2f} | {by_bytes * 1e3:.2f} "
                f"({by_bytes / m - 1:+.0%}) | {roof * 1e3:.2f} ({roof / m - 1:+.0%}) | "
                f"{top[0].split('cpp_fused_')[-1][:48]} {top[1] * 1e3:.2f} | "
                + ", ".join(f"{k} {v}" for k, v in w[phase].items())
                + " |"
            )
    pw = profile.memory_ops.pointwise_s
    md = [
        "# Fused kernels of a compiled block on this CPU (`benchmarks/fused_kernels.py`)",
        "",
        f"Profile: {profile.provenance}. One thread, fp32, b {B}, s {S}; measured: Inductor's "
        f"per-kernel profiler records (cpp.enable_kernel_profile), mean of {REPS} passes.",
        "",
        "Seconds per element-operation (pointwise_s): "
        + ", ".join(f"{k} {v * 1e9:.3f} ns" for k, v in pw.items())
        + f"; copy rate {profile.memory_ops.effective_bandwidth('copy') / 1e9:.1f} GB/s.",
        "",
        "| block | pass | kernels measured / priced | measured (ms) | by bytes (ms) | roofline (ms) "
        "| longest kernel (ms) | element-operations (millions) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_kernels.md").write_text("\n".join(md))
    (out / "fused_kernels.json").write_text(json.dumps(data, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
