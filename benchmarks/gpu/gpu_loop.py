"""The one-shot GPU loop: one run on a machine with one CUDA GPU (an H200), everything under $OUT.

    OUT=/some/folder python benchmarks/gpu/gpu_loop.py [--budget 550] [--profile-budget 240]
        [--skip plans,bare,kernels,split,profile,dropout] [--steps 5] [--plans NAME,...]

Phases, in this order (the plans first: they are what the loop is for); each saves
$OUT/gpu_loop.json as it goes (a plan in flight is marked "running"), so a run cut short still
leaves what it measured; a failing part is recorded with its error string and the loop goes on:

1. plans    llama-1.3b, seq 2048, global batch 8 = micro-batch 4 × G 2, bf16, flash attention,
            eager blocks and (the second plan) Inductor-compiled ones, through
            `mist.runtime.spawn_local` for 5 steps each; the runtime's metrics dict per
            plan. About 30–40 s a plan (worker start, 1.3B-parameter init, 5 steps); optimizer
            offload takes about twice as long, so it runs last.
2. bare     the same model in a bare PyTorch loop (bf16 model, fp32 master weights, fused AdamW):
            mean/median step time and peak memory, for the runtime-overhead comparison. ~15 s.
3. kernels  single decoder blocks where `mist estimate` misses most on the H200 (GPT-3 7B at
            micro-batch 4: forward +15 %; GPT-3 1.3B at 1: −21 %; Llama 3 8B at 4; a Llama 3 8B
            tensor-parallel shard, 1 of 4, at 1), each pass under torch.profiler: every kernel's
            count and device time; the forward once more with standard-normal weight matrices
            (the GEMM table's data) instead of N(0, 0.02). And each of the block's linear layers
            timed alone at its own shape: as the block calls it, without its bias, and with
            standard-normal weights — the GEMM table (`F.linear`, no bias, random data) prices
            the first. And the ATen calls each pass dispatches (views apart): the host-bound
            passes of 2026-12-04 took 19 µs (the Llama shard's forward, 44 calls) and 24–25 µs
            (its backward, 66; GPT-3 1.3B's at b 1, 57; the backward call's start included) per
            call, counted afterwards on a CPU at that run's code. ~30 s.
4. split    a llama-1.3b block at the plans' shape compiled by Inductor with its backward split
            into B and W (what ZB-H1 runs with compiled blocks) and whole: B then W and the
            whole compiled backward against eager (max |diff| / max |eager| per gradient),
            whether B left every weight gradient to W, and the times of the eager and the whole
            backward, of B and of W. ~40 s, most of it compiling.
5. profile  `python -m mist profile --device cuda --processes 1 --time-budget B
            -o $OUT/h200-profile.json` (log: $OUT/profile.log), B = what is left less the dropout
            phase's reserve and a grace to stop it, at most 240 (--profile-budget). With one
            process the collectives' share (27 %) of the budget goes unused: at 240, about 175 s
            of measuring + ~15 s start.
6. dropout  a rank's own attention dropout (tensor-parallel rank 0 of 2, materialised attention, a
            tiny GPT) run eager and compiled by Inductor on the device, its attention core as
            computed and recomputed in a checkpointed region (which the compiled backward re-runs
            with the seed its forward took), in fp32: the largest difference of the output and
            of every gradient, compiled vs eager under one step seed (rounding where the masks
            agree; a mask that differs zeroes other elements: the custom operators
            `mist::rank_seed`, a host scalar, and `mist::seeded_dropout` under Inductor's device
            backend). ~30 s, most of it compiling.

The whole run is held to --budget seconds (550, about 9 minutes): a plan gets what is left after
the reserves for the later phases (the profile's least budget among them) and is stopped (its
worker terminated) when that runs out; plans that cannot get MIN_PLAN_S are skipped. No simulator
runs here: `report_gpu_loop.py` predicts the plans afterwards on the fetched files (the tracer's
symbolic shapes are not reliable under torch 2.11).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

MODEL, SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS = "llama-1.3b", 2048, 8, 4, 5
TOTAL_BUDGET_S = 550.0  # the whole run
PROFILE_BUDGET_S = 240.0  # `mist profile --time-budget`
PROFILE_GRACE_S = 30.0  # the profile subprocess is stopped at its budget + this
PROFILE_MIN_S = 100.0  # kept for the profile while the phases before it run
BARE_RESERVE_S = 40.0  # kept for the bare loop while plans run
KERNELS_RESERVE_S = 30.0  # kept for the kernel phase while plans and the bare loop run
SPLIT_RESERVE_S = 60.0  # kept for the split-backward phase while the phases before it run
DROPOUT_RESERVE_S = 40.0  # kept for the dropout phase while the phases before it run
MIN_PLAN_S = 25.0  # a plan is skipped when less than this is left for it
PLAN_CAP_S = 150.0  # no plan runs longer than this
RESULT = "gpu_loop.json"
PROFILE = "h200-profile.json"

# (name, stage fields given the model's layer count); cheapest first, the slowest last
PLANS = [
    ("plain", lambda n: {}),
    # the plain plan with its blocks compiled by Inductor (`training.compile_blocks`; not a stage field)
    ("compiled blocks", lambda n: {"compile_blocks": True}),
    ("full recompute", lambda n: {"recompute_layers": n}),
    ("activation offload 0.5", lambda n: {"offload": {"activations": 0.5}}),
    ("ZeRO-0 weights offload 0.5", lambda n: {"zero": 0, "offload": {"weights": 0.5}}),
    ("optimizer offload 1.0", lambda n: {"offload": {"optimizer": 1.0}}),
]
PLAIN = PLANS[0][0]
# (preset, micro-batch[, tensor-parallel size]) of the kernel phase: the H200 blocks `mist estimate`
# misses most; a TP entry runs rank 0's shard alone (its collectives skipped: no process group)
KERNEL_BLOCKS = (("gpt3-7b", 4), ("gpt3-1.3b", 1), ("llama3-8b", 4), ("llama3-8b", 1, 4))


# ---------------------------------------------------------------------------- bookkeeping
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save(out: Path, res: dict) -> None:
    """Write $OUT/gpu_loop.json atomically (a reader never sees half a file)."""
    tmp = out / (RESULT + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    os.replace(tmp, out / RESULT)


def log(out: Path | None, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if out is not None:
        with open(out / "gpu_loop.log", "a") as f:
            f.write(line + "\n")


def error_text(e: BaseException, limit: int = 2000) -> str:
    """The error's type and message; for long ones (worker tracebacks) the end, where the cause is."""
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else "…" + s[-limit:]


class TimeLimit(Exception):
    pass


def with_time_limit(seconds: float, fn):
    """fn() in the main thread, stopped after `seconds`: on SIGALRM the worker processes this
    process started (multiprocessing children: spawn_local's ranks) are terminated and TimeLimit
    is raised."""

    def on_alarm(signum, frame):
        for p in multiprocessing.active_children():
            p.terminate()
        raise TimeLimit(f"stopped after {seconds:.1f} s (the loop's time limit for this part)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for p in multiprocessing.active_children():  # reap what was terminated
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def part(limit_s: float, fn) -> dict:
    """fn()'s result (a dict) run under `with_time_limit`, with "status" ("ok", "timeout" or
    "error", then with "error") and "wall_s": a part that fails is recorded and the loop goes on."""
    t0 = time.perf_counter()
    try:
        row = {**with_time_limit(limit_s, fn), "status": "ok"}
    except TimeLimit as e:
        row = {"status": "timeout", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - recorded, the loop goes on
        row = {"status": "error", "error": error_text(e)}
    row["wall_s"] = time.perf_counter() - t0
    return row


def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "modules": {
            m: importlib.util.find_spec(m) is not None for m in ("numpy", "scipy", "sympy", "yaml", "typer", "rich")
        },
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    for key, cmd in (
        ("commit", ["git", "rev-parse", "HEAD"]),
        (
            "nvidia_smi",
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ],
        ),
    ):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=15, cwd=ROOT)
            env[key] = r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            env[key] = None
    return env


# ---------------------------------------------------------------------------- phase 5: profile
def profile_command(
    path: Path, budget_s: float, device: str = "cuda", cli: bool | None = None
) -> tuple[list[str], str]:
    """`python -m mist profile …`; without typer/rich (the CLI's), the same measurement through
    `mist.profiling` directly."""
    if cli is None:
        cli = all(importlib.util.find_spec(m) is not None for m in ("typer", "rich"))
    if cli:
        return (
            [
                sys.executable,
                "-m",
                "mist",
                "profile",
                "--device",
                device,
                "--processes",
                "1",
                "--time-budget",
                f"{budget_s:g}",
                "-o",
                str(path),
            ],
            "mist profile",
        )
    code = (
        "import sys; from mist.profiling import run_profile, write_profile; "
        "p = run_profile(device=sys.argv[3], processes=1, time_budget=float(sys.argv[1])); "
        "print('wrote', write_profile(p, sys.argv[2])); print(p.summary())"
    )
    return (
        [sys.executable, "-c", code, f"{budget_s:g}", str(path), device],
        "mist.profiling.run_profile (no typer/rich)",
    )


def fresh(path: Path, since: float) -> bool:
    """The file exists and was written by this run (not left by an earlier one)."""
    return path.exists() and path.stat().st_mtime >= since - 1


def run_profile_phase(
    out: Path, budget_s: float, limit_s: float, device: str = "cuda", cli: bool | None = None
) -> dict:
    path = out / PROFILE
    cmd, via = profile_command(path, budget_s, device, cli)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    row = {"status": "running", "via": via, "command": " ".join(cmd), "budget_s": budget_s, "limit_s": limit_s}
    t0, started = time.perf_counter(), time.time()
    try:
        with open(out / "profile.log", "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit_s, cwd=ROOT)
        row["returncode"] = r.returncode
        row["status"] = "ok" if r.returncode == 0 and fresh(path, started) else "error"
        if row["status"] == "error":
            row["error"] = f"exit code {r.returncode}: " + (out / "profile.log").read_text()[-1500:]
    except subprocess.TimeoutExpired:
        row["status"], row["error"] = "timeout", f"stopped after {limit_s:.0f} s"
    except Exception as e:  # noqa: BLE001 - recorded, the loop goes on
        row["status"], row["error"] = "error", error_text(e)
    row["wall_s"] = time.perf_counter() - t0
    if fresh(path, started):
        row["path"] = PROFILE
        try:
            fp = json.loads(path.read_text()).get("fingerprint", {})
            row["profile_seconds"] = fp.get("profile_seconds")
        except ValueError as e:
            row["error"] = error_text(e)
    return row


# ---------------------------------------------------------------------------- phase 1: plans
def make_plan(
    model=MODEL,
    seq: int = SEQ,
    global_batch: int = GLOBAL_BATCH,
    micro_batch: int = MICRO_BATCH,
    gpu: str = "h200",
    dtype: str = "bf16",
    flash: bool = True,
    **stage,
):
    """A one-GPU, one-stage plan of `model` (a preset name or a model mapping); `compile_blocks`
    among the stage fields goes to the training section."""
    from mist.plan import plan_from_dict
    from mist.specs.loading import load_model, load_model_dict

    spec = load_model(model) if isinstance(model, str) else load_model_dict(model, source="model")
    st = {
        "layers": spec.num_layers,
        "nodes": 1,
        "gpus_per_node": 1,
        "micro_batch": micro_batch,
        "dp": 1,
        "tp": 1,
        "zero": 0,
        "recompute_layers": 0,
    }
    compiled = bool(stage.pop("compile_blocks", False))
    st.update(stage)
    return plan_from_dict(
        {
            "model": model,
            "cluster": {"gpu": gpu, "nodes": 1, "gpus_per_node": 1},
            "training": {
                "seq_len": seq,
                "global_batch": global_batch,
                "param_dtype": dtype,
                "compute_dtype": dtype,
                "flash_attention": flash,
                "compile_blocks": compiled,
            },
            "micro_batches": global_batch // micro_batch,
            "stages": [st],
        }
    )


def run_plan(name: str, plan, steps: int, limit_s: float, device_type: str = "cuda", **spawn_kw) -> dict:
    """One plan through the runtime: {name, plan, status ok|error|timeout, metrics | error, wall_s}."""
    from mist.runtime import TrainConfig, spawn_local

    row = {"name": name, "plan": plan.to_dict(), "steps": steps, "limit_s": round(limit_s, 1)}
    t0 = time.perf_counter()
    try:
        res = with_time_limit(
            limit_s, lambda: spawn_local(plan, TrainConfig(steps=steps, log=False), device_type=device_type, **spawn_kw)
        )
        row["status"], row["metrics"] = "ok", res["metrics"]
    except TimeLimit as e:
        row["status"], row["error"] = "timeout", str(e)
    except Exception as e:  # noqa: BLE001 - recorded, the loop goes on
        row["status"], row["error"] = "error", error_text(e)
    row["wall_s"] = time.perf_counter() - t0
    return row


# ---------------------------------------------------------------------------- phase 2: bare loop
def init_weights(module) -> None:
    """Matrices N(0, 0.02), norm weights 1, biases 0 (the bare loop's model, the kernel phase's
    blocks)."""
    import torch

    with torch.no_grad():
        for n, q in module.named_parameters():
            if q.dim() >= 2:
                q.normal_(0, 0.02)
            elif "norm" in n:
                q.fill_(1.0)
            else:
                q.zero_()


def bare_loop(
    model=MODEL,
    seq: int = SEQ,
    global_batch: int = GLOBAL_BATCH,
    micro_batch: int = MICRO_BATCH,
    steps: int = STEPS,
    device: str = "cuda",
    dtype: str = "bf16",
    flash: bool = True,
) -> dict:
    """The model in plain PyTorch: `dtype` working weights, fp32 master weights, fused AdamW,
    G = global_batch / micro_batch accumulated micro-batches per step."""
    import torch

    from mist.models import CausalLM
    from mist.models.dtypes import torch_dtype
    from mist.specs.loading import load_model, load_model_dict

    spec = load_model(model) if isinstance(model, str) else load_model_dict(model, source="model")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    wdt = torch_dtype(dtype)
    G = global_batch // micro_batch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    m = CausalLM(spec, None, flash, wdt, dev)
    init_weights(m)
    params = list(m.parameters())
    master = [q.detach().float().clone() for q in params]
    opt = torch.optim.AdamW(master, lr=1e-4, weight_decay=0.1, fused=True)
    tok = torch.randint(0, spec.vocab_size, (G, micro_batch, seq + 1), device=dev)
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for g in range(G):
            loss = m(tok[g, :, :-1], tok[g, :, 1:]) / G
            loss.backward()
            total += loss.detach().float()
        for mq, q in zip(master, params):
            mq.grad = q.grad.float()
        opt.step()
        with torch.no_grad():
            for mq, q in zip(master, params):
                q.copy_(mq)
                q.grad = None
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(total))
    steady = times[1:] or times
    return {
        "status": "ok",
        "step_time_s": sum(steady) / len(steady),
        "median_step_s": statistics.median(steady),
        "step_times_s": times,
        "losses": losses,
        "params": sum(q.numel() for q in params),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,
        "how": (
            f"{dtype} model, fp32 master weights, fused AdamW, {G} micro-batches of {micro_batch} "
            f"× seq {seq}; step time = mean of steps 2–{steps} (as the runtime's step_time_s)"
        ),
    }


# ---------------------------------------------------------------------------- phase 3: kernels
def _timed(fn, cuda: bool, reps: int = 10, warm: int = 3) -> float:
    """Median seconds of fn() run alone (synchronised before and after each call)."""
    import torch

    ts = []
    for i in range(warm + reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= warm:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def aten_calls(step) -> dict:
    """{"calls", "views"}: the ATen operators one call of step() dispatches, views and other
    aliasing operators counted apart (they launch no kernel, but each costs the host a dispatch
    and, under autograd, a recorded node): what a host-bound block issues, beside the kernels the
    profiler lists."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            self.views += any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
            return func(*args, **(kwargs or {}))

    with Count() as c:
        step()
    return {"calls": c.calls, "views": c.views}


def _kernel_table(prof, cuda: bool, reps: int) -> dict:
    """{kernel (CUDA) or operator (CPU) name: [calls, µs] per pass}, self times, largest first."""
    rows = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows[e.key] = [e.count / reps, us / reps]
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


def block_kernels(model, b: int, seq: int, device: str, dtype: str, reps: int = 5, tp: int = 1) -> dict:
    """One decoder block of `model` (rank 0's shard of `tp`, its collectives skipped): each pass's
    kernels under torch.profiler, and each linear
    layer alone at its own shape: as the block calls it (its weights N(0, 0.02), the input
    standard normal, like a normalised activation), without its bias where the GEMM takes one,
    and with standard-normal weights (as the GEMM table was measured)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from mist.models import DecoderBlock
    from mist.models.collectives import TPGroup
    from mist.models.dtypes import torch_dtype
    from mist.models.linear import ColumnParallelLinear, RowParallelLinear
    from mist.specs.loading import load_model, load_model_dict

    spec = load_model(model) if isinstance(model, str) else load_model_dict(model, source="model")
    dev, dt = torch.device(device), torch_dtype(dtype)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    blk = DecoderBlock(spec, TPGroup(tp, 0), True, dt, dev)
    init_weights(blk)
    x = torch.randn(b, seq, spec.hidden_size, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn_like(x)
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def kernels(step) -> dict:
        """_kernel_table of `reps` calls of step() under the profiler."""
        with profile(activities=acts) as prof:
            for _ in range(reps):
                step()
            if cuda:
                torch.cuda.synchronize()
        return _kernel_table(prof, cuda, reps)

    row: dict = {"model": spec.name, "b": b, "tp": tp, "seq": seq}
    row["fwd_ms"] = 1e3 * _timed(lambda: blk(x), cuda)
    row["fwd"] = kernels(lambda: blk(x))
    timed = [blk(x) for _ in range(reps + 3)]  # one forward graph per timed backward
    row["bwd_ms"] = 1e3 * _timed(lambda: timed.pop().backward(g), cuda, reps=reps, warm=3)
    profiled = [blk(x) for _ in range(reps)]
    row["bwd"] = kernels(lambda: profiled.pop().backward(g))
    # the same forward with standard-normal weight matrices (the GEMM table's data): whether the
    # weights' values change how fast the block's GEMMs run
    with torch.no_grad():
        for q in blk.parameters():
            if q.dim() >= 2:
                q.normal_(0, 1.0)
    row["fwd_unit_weights_ms"] = 1e3 * _timed(lambda: blk(x), cuda)
    row["fwd_unit_weights"] = kernels(lambda: blk(x))
    counted = blk(x)
    row["aten_calls"] = {"fwd": aten_calls(lambda: blk(x)), "bwd": aten_calls(lambda: counted.backward(g))}
    init_weights(blk)
    row["linears"] = []
    for name, lin in blk.named_modules():
        if not isinstance(lin, (ColumnParallelLinear, RowParallelLinear)):
            continue
        n_out, k = lin.weight.shape
        a = torch.randn(b * seq, k, device=dev, dtype=dt)
        w, bias, rand = lin.weight.detach(), lin.bias, torch.randn_like(lin.weight)
        fused_bias = isinstance(lin, ColumnParallelLinear) and bias is not None
        with torch.no_grad():
            row["linears"].append(
                {
                    "name": name,
                    "m": b * seq,
                    "n": n_out,
                    "k": k,
                    "bias_in_gemm": fused_bias,
                    "as_called_ms": 1e3 * _timed(lambda: F.linear(a, w, bias if fused_bias else None), cuda),
                    "no_bias_ms": 1e3 * _timed(lambda: F.linear(a, w), cuda) if fused_bias else None,
                    "random_weights_ms": 1e3 * _timed(lambda: F.linear(a, rand), cuda),
                }
            )
    return row


def kernels_phase(out: Path, res: dict, su: Setup, clock: Clock) -> None:
    res["kernels"] = []
    for model, b, *rest in su.kernel_blocks:
        tp = rest[0] if rest else 1
        name = model if isinstance(model, str) else model.get("name", "?")
        if clock.left() < 5:
            res["kernels"].append({"model": name, "b": b, "tp": tp, "status": "skipped", "error": "no time left"})
            continue
        row = {"model": name, "b": b, "tp": tp}
        row.update(part(clock.left(), lambda: block_kernels(model, b, su.seq, su.device, su.dtype, tp=tp)))
        res["kernels"].append(row)
        save(out, res)
        log(
            out,
            f"kernels {row['model']} b {b} tp {tp}: {row['status']}"
            + (f", fwd {row['fwd_ms']:.3f} ms, bwd {row['bwd_ms']:.3f} ms" if row["status"] == "ok" else ""),
        )
        if su.device == "cuda":
            import torch

            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- phase 4: split backward
def _close(a, b) -> float:
    """max |a − b| / max |b|: a tensor's difference relative to its scale."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def split_backward_check(model, b: int, seq: int, device: str, dtype: str, reps: int = 5) -> dict:
    """One decoder block of `model` compiled by Inductor with its backward split into B and W
    (`compile_block(split=True)`, what ZB-H1 runs) and whole (`compile_block`): the gradients of
    B then W and of the whole compiled backward against eager (max |diff| / max |eager|, the
    input's and each parameter's), whether B left every parameter's gradient to W, and the median
    times of the eager and the whole compiled backward, of B and of W (each after a fresh forward)."""
    import torch

    from mist.models import DecoderBlock
    from mist.models.collectives import TPGroup
    from mist.models.compiled import compile_block
    from mist.models.dtypes import torch_dtype
    from mist.runtime.zero_bubble import _WeightPass
    from mist.specs.loading import load_model, load_model_dict

    spec = load_model(model) if isinstance(model, str) else load_model_dict(model, source="model")
    dev, dt = torch.device(device), torch_dtype(dtype)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    blk = DecoderBlock(spec, TPGroup(), True, dt, dev)
    init_weights(blk)
    params = list(blk.parameters())
    x0 = torch.randn(b, seq, spec.hidden_size, device=dev, dtype=dt)
    g = torch.randn_like(x0)

    def collect(x) -> list:
        out = [x.grad.detach().clone()] + [q.grad.detach().clone() for q in params]
        blk.zero_grad(set_to_none=True)
        return out

    def plain(fn) -> list:
        x = x0.clone().requires_grad_(True)
        fn(x).backward(g)
        return collect(x)

    whole, split = compile_block(blk), compile_block(blk, split=True)
    row: dict = {"model": spec.name, "b": b, "seq": seq, "params": len(params)}
    t0 = time.perf_counter()
    eager = plain(blk)
    compiled = plain(whole)
    row["compile_whole_s"] = time.perf_counter() - t0
    b_left_all, deferred = True, 0

    def b_then_w(timed: dict | None = None) -> list:
        nonlocal b_left_all, deferred
        x = x0.clone().requires_grad_(True)
        y = split(x)
        wp = _WeightPass(y, x, params)
        sync()
        t = time.perf_counter()
        x.grad = wp.input_grad(g, x)
        sync()
        t_b = time.perf_counter() - t
        deferred = len(wp.deferred)
        b_left_all = b_left_all and all(q.grad is None for q in params)
        t = time.perf_counter()
        wp.weight_grads()
        sync()
        if timed is not None:
            timed["B"].append(t_b)
            timed["W"].append(time.perf_counter() - t)
        return collect(x)

    t0 = time.perf_counter()
    split_grads = b_then_w()
    row["compile_split_s"] = time.perf_counter() - t0
    names = ["input"] + [n for n, _ in blk.named_parameters()]
    row["whole_vs_eager"] = {n: _close(c, e) for n, c, e in zip(names, compiled, eager)}
    row["split_vs_eager"] = {n: _close(c, e) for n, c, e in zip(names, split_grads, eager)}
    row["split_vs_whole"] = {n: _close(c, e) for n, c, e in zip(names, split_grads, compiled)}
    row["b_left_every_weight_gradient_to_w"] = b_left_all
    row["deferred_w_graphs"] = deferred

    def backward_time(fn) -> float:
        ys = [fn(x0.clone().requires_grad_(True)) for _ in range(reps + 2)]
        t = _timed(lambda: ys.pop().backward(g), cuda, reps=reps, warm=2)
        blk.zero_grad(set_to_none=True)
        return t

    row["eager_bwd_ms"] = 1e3 * backward_time(blk)
    row["whole_bwd_ms"] = 1e3 * backward_time(whole)
    timed: dict = {"B": [], "W": []}
    for _ in range(reps + 2):
        b_then_w(timed)
    row["B_ms"] = 1e3 * statistics.median(timed["B"][2:])
    row["W_ms"] = 1e3 * statistics.median(timed["W"][2:])
    return row


def split_phase(out: Path, res: dict, su: Setup, clock: Clock) -> None:
    row = part(clock.left(), lambda: split_backward_check(su.model, su.micro_batch, su.seq, su.device, su.dtype))
    res["split_backward"] = row
    save(out, res)
    log(
        out,
        f"split backward: {row['status']} in {row['wall_s']:.0f} s"
        + (
            f", whole {row['whole_bwd_ms']:.2f} ms, B {row['B_ms']:.2f} ms + W {row['W_ms']:.2f} ms"
            if row["status"] == "ok"
            else f": {str(row.get('error', ''))[-300:]}"
        ),
    )
    if su.device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- phase 6: rank dropout
DROPOUT_MODEL = {
    "name": "tiny-gpt-dropout",
    "family": "gpt",
    "num_layers": 1,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 4,
    "ffn_hidden_size": 256,
    "vocab_size": 128,
    "tie_embeddings": True,
    "attention_dropout": 0.1,
}


def rank_dropout_check(device: str, dtype: str, b: int = 2, seq: int = 64) -> dict:
    """{case: {tensor: largest |compiled − eager|}} for the attention of a rank's own heads with
    attention dropout (tp rank 0 of 2, no process group: `Attention.after_qkv` runs no collective
    with an unreduced output), from its QKV output, eager and compiled, the core as computed
    ("core kept") and recomputed ("core recomputed"); plus whether another step seed draws other
    masks (it must: the masks are drawn)."""
    import torch

    from mist.models.attention import Attention
    from mist.models.collectives import TPGroup
    from mist.models.dropout import seed_dropout
    from mist.models.dtypes import torch_dtype
    from mist.specs.loading import load_model_dict

    spec = load_model_dict(DROPOUT_MODEL, source="model")
    dt = torch_dtype(dtype)
    attn = Attention(spec, TPGroup(2, 0), False, dt, device=device, reduce=False)
    init_weights(attn)
    compiled = torch.compile(attn.after_qkv)
    width = attn.qkv.weight.shape[0]
    gen = torch.Generator(device).manual_seed(0)
    qkv = torch.randn(b, seq, width, device=device, dtype=dt, generator=gen)
    g = torch.randn(b, seq, spec.hidden_size, device=device, dtype=dt, generator=gen)

    def step(fn, step_seed: int) -> list:
        x = qkv.clone().requires_grad_(True)
        seed_dropout(step_seed, 0, 0, 0, 0)
        out = fn(x)
        out.backward(g)
        grads = [x.grad] + [p.grad for p in attn.dense.parameters()]
        attn.zero_grad(set_to_none=True)
        return [out.detach()] + [t.detach().clone() for t in grads]

    names = ["output", "qkv grad"] + [f"dense {n} grad" for n, _ in attn.dense.named_parameters()]
    res: dict = {}
    for case, recompute in (("core kept", False), ("core recomputed", True)):
        attn.recompute_core = recompute
        eager, comp = step(attn.after_qkv, 1), step(compiled, 1)
        res[case] = {n: float((a.float() - c.float()).abs().max()) for n, a, c in zip(names, eager, comp)}
        res[case]["another seed differs"] = bool(not torch.equal(step(compiled, 2)[0], comp[0]))
    return res


def dropout_phase(out: Path, res: dict, su: Setup, clock: Clock) -> None:
    # (fp32: compiled and eager round alike, so a mask that differs stands out)
    row = part(clock.left(), lambda: {"cases": rank_dropout_check(su.device, "fp32")})
    res["dropout"] = row
    save(out, res)
    log(out, f"dropout: {row['status']} in {row['wall_s']:.0f} s")


# ---------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class Setup:
    """What the loop trains: the H200 defaults; the test runs the same loop with a tiny CPU setup."""

    model: object = MODEL  # a preset name or a model mapping
    seq: int = SEQ
    global_batch: int = GLOBAL_BATCH
    micro_batch: int = MICRO_BATCH
    steps: int = STEPS
    dtype: str = "bf16"
    gpu: str = "h200"  # the plan's cluster.gpu
    device: str = "cuda"
    kernel_blocks: tuple = KERNEL_BLOCKS  # (model, micro-batch) of the kernel phase
    plans: tuple | None = None  # the names of the PLANS to run (None: all)


class Clock:
    def __init__(self, total_s: float):
        self.total_s, self.start = total_s, time.perf_counter()

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.start)


def plans_phase(out: Path, res: dict, su: Setup, clock: Clock, reserve_s: float) -> None:
    from mist.specs.loading import load_model, load_model_dict

    spec = load_model(su.model) if isinstance(su.model, str) else load_model_dict(su.model, source="model")
    spawn_kw = {} if su.device == "cuda" else {"start_method": "fork", "threads": 1}
    shape = dict(
        model=su.model, seq=su.seq, global_batch=su.global_batch, micro_batch=su.micro_batch, gpu=su.gpu, dtype=su.dtype
    )
    for name, stage in PLANS:
        if su.plans is not None and name not in su.plans:
            continue
        limit = min(PLAN_CAP_S, clock.left() - reserve_s)
        try:
            plan = make_plan(**shape, **stage(spec.num_layers))
        except Exception as e:  # noqa: BLE001 - recorded, the loop goes on
            res["plans"].append({"name": name, "status": "error", "error": error_text(e)})
            continue
        if limit < MIN_PLAN_S:
            res["plans"].append(
                {
                    "name": name,
                    "plan": plan.to_dict(),
                    "status": "skipped",
                    "error": f"only {max(0.0, limit):.0f} s left in the loop's budget",
                }
            )
            save(out, res)
            log(out, f"plan {name}: skipped")
            continue
        res["plans"].append({"name": name, "status": "running", "started": now()})
        save(out, res)
        row = run_plan(name, plan, su.steps, limit, su.device, **spawn_kw)
        res["plans"][-1] = row
        save(out, res)
        m = row.get("metrics") or {}
        log(
            out,
            f"plan {name}: {row['status']} in {row['wall_s']:.0f} s"
            + (
                f", step {m['step_time_s']:.3f} s, peak {m['stages'][0]['peak_memory_bytes'] / 2**30:.2f} GiB"
                if m
                else f": {str(row.get('error', ''))[-300:]}"
            ),
        )


def bare_phase(out: Path, res: dict, su: Setup, clock: Clock, reserve_s: float = 0.0) -> None:
    limit = clock.left() - reserve_s
    t0 = time.perf_counter()
    if limit < 10:
        res["bare_loop"] = {"status": "skipped", "error": f"only {max(0.0, limit):.0f} s left"}
    else:
        res["bare_loop"] = {"status": "running", "started": now()}
        save(out, res)
        try:
            res["bare_loop"] = with_time_limit(
                limit,
                lambda: bare_loop(su.model, su.seq, su.global_batch, su.micro_batch, su.steps, su.device, su.dtype),
            )
        except TimeLimit as e:
            res["bare_loop"] = {"status": "timeout", "error": str(e)}
        except Exception as e:  # noqa: BLE001 - recorded
            res["bare_loop"] = {"status": "error", "error": error_text(e)}
    b = res["bare_loop"]
    b["wall_s"] = time.perf_counter() - t0
    save(out, res)
    peak = b.get("peak_memory_bytes")
    log(
        out,
        f"bare loop: {b['status']}"
        + (f", step {b['step_time_s']:.3f} s" if b["status"] == "ok" else f": {str(b.get('error', ''))[-300:]}")
        + (f", peak {peak / 2**30:.2f} GiB" if peak else ""),
    )


def run_loop(
    out: Path,
    su: Setup = Setup(),
    budget_s: float = TOTAL_BUDGET_S,
    profile_budget_s: float = PROFILE_BUDGET_S,
    skip: frozenset = frozenset(),
) -> dict:
    """The six phases into out/gpu_loop.json (saved after every step); returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(budget_s)
    res = {
        "format": "mist-gpu-loop",
        "version": 1,
        "started": now(),
        "budget_s": budget_s,
        "setup": asdict(su),
        "env": environment(),
        "profile": None,
        "plans": [],
        "bare_loop": None,
        "kernels": None,
        "split_backward": None,
        "dropout": None,
    }
    save(out, res)
    log(out, f"{res['env'].get('device', su.device)} torch {res['env']['torch']}; budget {budget_s:.0f} s")
    # each phase runs on what is left less the reserves of the phases after it
    order = ("plans", "bare", "kernels", "split", "profile", "dropout")
    reserves = {
        "plans": 0.0,
        "bare": BARE_RESERVE_S,
        "kernels": KERNELS_RESERVE_S,
        "split": SPLIT_RESERVE_S,
        "profile": PROFILE_MIN_S + PROFILE_GRACE_S,
        "dropout": DROPOUT_RESERVE_S,
    }

    def after(phase: str) -> float:
        return sum(reserves[q] for q in order[order.index(phase) + 1 :] if q not in skip)

    if "plans" not in skip:
        plans_phase(out, res, su, clock, after("plans"))
    if "bare" not in skip:
        bare_phase(out, res, su, clock, after("bare"))
    if "kernels" not in skip:
        kernels_phase(out, res, su, Clock(clock.left() - after("kernels")))
    if "split" not in skip:
        split_phase(out, res, su, Clock(clock.left() - after("split")))
    if "profile" not in skip:
        # what is left, less the dropout phase's reserve: the profile's budget and a grace to stop it
        limit = clock.left() - after("profile")
        budget = min(profile_budget_s, limit - PROFILE_GRACE_S)
        if budget < min(profile_budget_s, PROFILE_MIN_S / 2):
            res["profile"] = {"status": "skipped", "error": f"only {max(0.0, limit):.0f} s left"}
        else:
            res["profile"] = {"status": "running", "started": now()}
            save(out, res)
            log(out, f"profile: --time-budget {budget:.0f} (stopped after {limit:.0f} s)")
            res["profile"] = run_profile_phase(out, round(budget), limit, su.device)
        save(out, res)
        log(out, f"profile: {res['profile']['status']} in {res['profile'].get('wall_s', 0):.0f} s")
    if "dropout" not in skip:
        dropout_phase(out, res, su, clock)
    res["finished"] = now()
    res["total_wall_s"] = budget_s - clock.left()
    save(out, res)
    log(out, f"done in {res['total_wall_s']:.0f} s; results in {out / RESULT}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="Seconds for the whole run.")
    ap.add_argument("--profile-budget", type=float, default=PROFILE_BUDGET_S)
    ap.add_argument(
        "--skip", default="", help="Comma-separated phases to skip: plans, bare, kernels, split, profile, dropout."
    )
    ap.add_argument("--steps", type=int, default=STEPS, help="Training steps per plan (the first one warms up).")
    ap.add_argument("--plans", default="", help="Comma-separated names of the plans to run (default: all).")
    a = ap.parse_args(argv)
    names = tuple(n.strip() for n in a.plans.split(",") if n.strip()) or None
    unknown = sorted(set(names or ()) - {n for n, _ in PLANS})
    if unknown or a.steps < 2:
        what = f"unknown plan(s) {', '.join(unknown)}" if unknown else f"--steps {a.steps} (at least 2)"
        print(f"gpu_loop.py: {what}; the plans are: {', '.join(n for n, _ in PLANS)}.", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print("gpu_loop.py needs a CUDA GPU, and PyTorch sees none on this machine: nothing was run.", file=sys.stderr)
        return 2
    if not os.environ.get("OUT"):
        print("gpu_loop.py writes its results under $OUT: set OUT to a folder.", file=sys.stderr)
        return 2
    run_loop(
        Path(os.environ["OUT"]).resolve(),
        Setup(steps=a.steps, plans=names),
        a.budget,
        a.profile_budget,
        frozenset(s.strip() for s in a.skip.split(",") if s.strip()),
    )
    return 0


if __name__ == "__main__":  # the runtime spawns its workers: keep the module import-safe
    sys.exit(main())
