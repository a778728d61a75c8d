"""Where the CPU loop's missing time goes: one eager decoder block on this CPU, operator by
operator, as Mist prices it against what the same operators take inside the block and alone.

The CPU loop predicts every plan a few per cent fast (`cpu_loop.md`). This splits one block's
forward + backward (the CPU loop's GPT and Llama, micro-batch 4, sequence 256, fp32) by ATen
operator:

* predicted: each traced operator priced by the simulator's own `kernel_time` on a profile this
  machine measured (`--profile`, written by `mist profile --device cpu --processes 1`, so that
  one process with the profile's threads is compared with one process; this process runs as the
  runtime's CPU ranks and the profiler do, `mist.cpu_workers.setup_cpu_worker`: their threads,
  freed memory kept in the heap);
* in the block: the wall time of each ATen call while the block runs forward and backward, timed
  around the call by a dispatch mode, median over the steps (the parameters' gradients dropped
  between steps, so nothing accumulates: the runtime's flat gradient buffers are priced
  elsewhere);
* alone: the GEMMs again, each shape timed alone in a loop, warm (the same operands every call)
  and cold (the caches emptied before each call, the way the profile measures them), so that a
  GEMM's in-block time can be told apart from the profile's price of its shape.

    PYTHONPATH=src python benchmarks/cpu_block_ops.py --profile cpu1.json [--out benchmarks/results]

Writes OUT/cpu_block_ops.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mist.analysis.layer import analyze_layer  # noqa: E402
from mist.cpu_workers import setup_cpu_worker  # noqa: E402
from mist.hardware.registry import load_profile  # noqa: E402
from mist.models.block import DecoderBlock  # noqa: E402
from mist.models.causal_lm import init_weights  # noqa: E402
from mist.profiling.timing import Device, time_op  # noqa: E402
from mist.simulate.layer_cost import kernel_time, phase_time  # noqa: E402
from mist.specs.loading import load_model  # noqa: E402

MODELS = ("loop-gpt", "loop-llama")
B, S, STEPS = 4, 256, 8


def median_ms(fn, n: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def predicted(spec, profile) -> tuple[dict, float, list]:
    """({op: ms over fwd + bwd}, the block's fwd + bwd ms as `phase_time` composes it, the GEMM
    shapes (m, n, k, batch) with their priced ms)."""
    la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", False)
    b, s = np.array([float(B)]), np.array([float(S)])
    per_op: dict = defaultdict(float)
    gemms = []
    total = 0.0
    for phase in ("fwd", "bwd"):
        for op in la.op_values(phase, b, s):
            t = float(np.ravel(kernel_time(profile, op, phase == "bwd"))[0]) * 1e3
            per_op[op.op] += t
            if op.op in ("mm", "bmm", "addmm"):
                p = op.params
                gemms.append(
                    (int(np.ravel(p.m)[0]), int(np.ravel(p.n)[0]), int(np.ravel(p.k)[0]), int(np.ravel(p.batch)[0]), t)
                )
        total += float(np.ravel(phase_time(profile, None, la, phase, b, s).total)[0]) * 1e3
    return dict(per_op), total, gemms


class _OpTimer(TorchDispatchMode):
    """Wall time of every ATen call, by operator: `perf_counter` around the call itself, so the
    mode's own bookkeeping falls outside what it measures (torch.profiler's self times, used
    before, inflated the short operators: GELU's 1.2 ms read as 1.7-1.9 ms under it)."""

    def __init__(self):
        super().__init__()
        self.ms: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ms[name] += (time.perf_counter() - t0) * 1e3
        self.calls[name] += 1
        return out


def measured(spec) -> tuple[dict, dict, float]:
    """({aten op: median over steps of its ms per fwd + bwd}, {aten op: calls}, the block's median
    fwd + bwd ms, timed without the per-operator timer)."""
    blk = DecoderBlock(spec, flash=True, dtype=torch.float32)
    init_weights(blk, 0)
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    g = torch.randn(B, S, spec.hidden_size)

    def step():
        blk(x).backward(g)
        for p in (*blk.parameters(), x):
            p.grad = None

    wall = median_ms(step)
    per_step = []
    for _ in range(STEPS):
        timer = _OpTimer()
        with timer:
            step()
        per_step.append(timer)
    names = set().union(*(t.ms for t in per_step))
    self_ms = {k: statistics.median(t.ms.get(k, 0.0) for t in per_step) for k in names}
    calls = dict(per_step[-1].calls)
    return self_ms, calls, wall


def gemm_alone(m: int, n: int, k: int, batch: int, cold: bool) -> float:
    """Median ms of the GEMM in a loop of its own (15 calls, the profile's own timer): warm (the
    same operands every call) or cold (caches emptied before each call, as `mist profile` times it)."""
    a, w = torch.randn(batch, m, k), torch.randn(batch, k, n)

    def call():
        if batch == 1:
            return a[0] @ w[0]
        return torch.bmm(a, w)

    return time_op(call, Device("cpu"), min_reps=15, max_reps=15, warmup=3, cold=cold) * 1e3


def table(name: str, profile) -> list[str]:
    spec = load_model(str(ROOT / "benchmarks" / "models" / f"{name}.yaml"))
    pred, pred_total, gemms = predicted(spec, profile)
    meas, calls, wall = measured(spec)
    rows = [
        f"### {name}: block forward + backward {wall:.2f} ms measured, {pred_total:.2f} ms predicted "
        f"({(pred_total / wall - 1) * 100:+.1f} %)",
        "",
    ]
    rows += [
        "| ATen operator | calls | predicted (ms) | in the block (ms) | predicted / in block |",
        "|---|---:|---:|---:|---:|",
    ]
    names = sorted(
        set(pred) | {k for k, v in meas.items() if v >= 0.05}, key=lambda k: -max(pred.get(k, 0), meas.get(k, 0))
    )
    for op in names:
        p, m = pred.get(op), meas.get(op, 0.0)
        ratio = f"{(p / m - 1) * 100:+.0f} %" if p and m else "–"
        rows.append(f"| {op} | {calls.get(op, 0)} | {'–' if p is None else f'{p:.2f}'} | {m:.2f} | {ratio} |")
    unpriced = sum(v for k, v in meas.items() if k not in pred)
    rows += [
        "",
        f"Time of operators Mist does not price (views, allocation, fills): {unpriced:.2f} ms. "
        f"Sum over operators: {sum(meas.values()):.2f} ms (the rest of the block's time is Python and autograd "
        "between them).",
        "",
    ]
    rows += [
        "GEMMs alone (each shape in a loop of its own): warm, the same operands every call; cold, the caches "
        "emptied before each call as `mist profile` times it (`mist.profiling.timing.CacheFlush`):",
        "",
        "| m | n | k | batch | predicted (ms) | alone, warm (ms) | alone, cold (ms) | cold / warm | predicted / cold |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    warm_sum = cold_sum = 0.0
    for m, n, k, batch, t in gemms:
        # alternate warm and cold rounds, so that a drift of the machine's speed touches both
        warm = statistics.median(gemm_alone(m, n, k, batch, False) for _ in range(3))
        cold = statistics.median(gemm_alone(m, n, k, batch, True) for _ in range(3))
        warm_sum, cold_sum = warm_sum + warm, cold_sum + cold
        rows.append(
            f"| {m} | {n} | {k} | {batch} | {t:.2f} | {warm:.2f} | {cold:.2f} | {(cold / warm - 1) * 100:+.1f} % "
            f"| {(t / cold - 1) * 100:+.1f} % |"
        )
    gemm_pred = sum(t for *_, t in gemms)
    gemm_block = sum(meas.get(op, 0.0) for op in ("mm", "bmm", "addmm"))
    rows += [
        "",
        f"GEMMs: predicted {gemm_pred:.2f} ms, alone warm {warm_sum:.2f} ms, alone cold {cold_sum:.2f} ms, "
        f"in the block {gemm_block:.2f} ms.",
        "",
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--profile", required=True, help="a `mist profile --device cpu --processes 1` profile of this machine"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    profile = load_profile(args.profile)
    fp = json.loads(Path(args.profile).read_text()).get("fingerprint", {})
    threads = int(fp.get("torch_threads", torch.get_num_threads()))
    setup_cpu_worker(threads)  # the threads and the heap settings of the runtime's CPU ranks and the profiler
    lines = [
        "# One eager block on this CPU, operator by operator: predicted, in the block, alone",
        "",
        f"Generated by `benchmarks/cpu_block_ops.py` on {fp.get('device', platform.processor())} "
        f"({fp.get('cpu_count', '?')} cores), torch {torch.__version__}, {threads} threads, one process; "
        f"profile measured by `mist profile --device cpu --processes {fp.get('processes', '?')}` on it "
        f"just before. Micro-batch {B}, sequence {S}, fp32, flash attention (the CPU kernel), {STEPS} profiled steps.",
        "",
    ]
    for name in MODELS:
        lines += table(name, profile)
    out = Path(args.out) / "cpu_block_ops.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
