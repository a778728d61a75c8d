"""Single-process micro-benchmarks: GEMM grid, flash attention, memory-bound ops, host overheads,
copies, AdamW, memory capacity and the environment fingerprint.

Every function takes a `Device` and a perf_counter `deadline`; grids are measured in order of
increasing work and the points left when the deadline passes are filled from their measured
lower neighbours (at the same efficiency), the filled points listed in the result.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import socket
import threading
import time

import numpy as np

from mist.cpu_workers import threads_per_worker
from mist.hardware.fitting import fit_floor_plus_rate
from mist.profiling.neighbours import Neighbours
from mist.profiling.timing import Device, time_op, wall_of
from mist.rules.init_seeds import INIT_STD

# ---------------------------------------------------------------------------- grid filling


def sweep(order, point, store, deadline: float, min_done: int, tick=None) -> None:
    """Measure grid points in `order` into `store[idx] = point(idx)` until the deadline (after at
    least `min_done` points), reporting progress through `tick(fraction)`."""
    for done, idx in enumerate(order):
        if time.perf_counter() > deadline and done >= min_done:
            break
        store[idx] = point(idx)
        if tick:
            tick((done + 1) / len(order))


def fill_missing(t: np.ndarray, work: np.ndarray) -> list[tuple]:
    """Fill NaN entries of `t` in place at the mean log-efficiency (work / time) of their finite
    lower neighbours along each axis, in order of work; returns the filled indices."""
    missing = sorted((tuple(int(v) for v in i) for i in np.argwhere(np.isnan(t))), key=lambda i: work[i])
    finite = np.isfinite(t)
    best = float(np.nanmax(work[finite] / t[finite])) if finite.any() else 1e9
    for idx in missing:
        rates = []
        for ax in range(t.ndim):
            nb = list(idx)
            nb[ax] -= 1
            if nb[ax] >= 0 and np.isfinite(t[tuple(nb)]):
                rates.append(work[tuple(nb)] / t[tuple(nb)])
        rate = float(np.exp(np.mean(np.log(rates)))) if rates else best
        t[idx] = work[idx] / rate
    return missing


def suspicious(t: np.ndarray, work: np.ndarray, factor: float = 2.0) -> list[tuple]:
    """Measured points that look hit by noise (another process taking the cores): slower than
    `factor` × a lower neighbour scaled up by the work ratio, or slower than `factor` × an upper
    neighbour (more work in less time). Efficiency grows with size, so neither happens in clean data."""
    out = []
    for idx in np.ndindex(*t.shape):
        if not np.isfinite(t[idx]):
            continue
        for ax in range(t.ndim):
            lo, hi = list(idx), list(idx)
            lo[ax] -= 1
            hi[ax] += 1
            lo, hi = tuple(lo), tuple(hi)
            if lo[ax] >= 0 and np.isfinite(t[lo]) and t[idx] > factor * t[lo] * work[idx] / work[lo]:
                out.append(idx)
                break
            if hi[ax] < t.shape[ax] and np.isfinite(t[hi]) and t[idx] > factor * t[hi]:
                out.append(idx)
                break
    return out


def recheck(t: np.ndarray, work: np.ndarray, measure, deadline: float, rounds: int = 2) -> int:
    """Re-measure `suspicious` points (keeping the faster value) while time is left; returns how
    many re-measurements were made."""
    count = 0
    for _ in range(rounds):
        bad = suspicious(t, work)
        if not bad:
            break
        for idx in bad:
            if time.perf_counter() > deadline:
                return count
            t[idx] = min(t[idx], measure(idx))
            count += 1
    return count


# ---------------------------------------------------------------------------- GEMM
# A weight is read once per forward (and once per backward) of a model, so it comes from main
# memory, not from a cache that a loop over the same operands keeps warm: the timed GEMMs cycle
# through enough copies of w to span this many bytes (more than a last-level cache), at most
# COLD_COPIES of them. On a GPU the activation operand stays the same (it was just written by the
# op before, and a GPU's L2 keeps it); on a CPU each call also starts with emptied caches
# (`time_op(cold=True)`), which leaves the activation and the output in memory too.
COLD_BYTES = 128 * 2**20
COLD_COPIES = 256
# The weights' values are a model's: normal(0, INIT_STD) as the runtime initialises them
# (`mist.rules.init_seeds`), not standard normal. A GPU's GEMM time depends on the values, not only
# the shape (presumably the power the arithmetic draws, which sets a power-limited chip's clock):
# on an H200 (700 W) the GPT-3 7B block's forward took 8.0 % longer with N(0, 1) weight matrices
# than with N(0, 0.02) (5.16 ms; `benchmarks/results/gpu_loop.md`). The activation operand stays
# standard normal, as after a norm; the backward's GEMMs are lookups in the same table. The
# shipped H200 table (`data/`: "random bf16 data") predates this and is not re-measured.
WEIGHT_STD = INIT_STD


def cold_weights(n: int, k: int, dev: Device, rand, cache: dict) -> list:
    """Distinct [n, k] weights spanning COLD_BYTES, to cycle through: slices of one shared random
    buffer kept in `cache` (a weight that big on its own is one tensor, cached by shape), drawn
    from normal(0, WEIGHT_STD)."""
    size = n * k
    if size * dev.element_bytes >= COLD_BYTES:
        if (n, k) not in cache:
            cache[(n, k)] = rand(n, k).mul_(WEIGHT_STD)
        return [cache[(n, k)]]
    if "pool" not in cache:
        cache["pool"] = rand(1, COLD_BYTES // dev.element_bytes).view(-1).mul_(WEIGHT_STD)
    pool = cache["pool"]
    copies = min(COLD_COPIES, pool.numel() // size)
    return [pool[c * size : (c + 1) * size].view(n, k) for c in range(copies)]


def measure_gemm(dev: Device, axes, deadline: float, tick=None) -> dict:
    """Times of y[m, n] = x[m, k] @ w[n, k]^T (F.linear) over the grid axes^3 (seconds), with
    cold weights (see COLD_BYTES)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    ms = ns = ks = [int(a) for a in axes]
    shape = (len(ms), len(ns), len(ks))
    t = np.full(shape, np.nan)
    work = (
        2.0
        * np.array(ms, float)[:, None, None]
        * np.array(ns, float)[None, :, None]
        * np.array(ks, float)[None, None, :]
    )
    order = sorted(np.ndindex(*shape), key=lambda i: work[i])
    xs, ws = {}, {}
    g = torch.Generator(device=dev.torch_device).manual_seed(0)

    def rand(r, c):
        return torch.randn(r, c, generator=g, device=dev.torch_device, dtype=torch.float32).to(dev.dtype)

    def point(idx):
        i, j, l = idx
        m, n, k = ms[i], ns[j], ks[l]
        x = xs.get((m, k))
        if x is None:
            x = xs[(m, k)] = rand(m, k)
        cycle = itertools.cycle(cold_weights(n, k, dev, rand, ws))
        return time_op(lambda: F.linear(x, next(cycle)), dev, target_s=0.015 if dev.kind == "cpu" else 0.01, cold=True)

    with torch.no_grad():
        sweep(order, point, t, deadline, 8, tick)
        rechecked = recheck(t, work, point, deadline)
    measured = int(np.isfinite(t).sum())
    filled = fill_missing(t, work)
    rates = work / t
    return {
        "axes": [ms, ns, ks],
        "times_s": t,
        "measured": measured,
        "rechecked": rechecked,
        "filled": [[ms[a], ns[b], ks[c]] for a, b, c in filled],
        "best_flops": float(np.max(rates[np.isfinite(rates)])),
        "floor_s": float(t[0, 0, 0]),
    }


# ---------------------------------------------------------------------------- attention
def measure_attention(dev: Device, grid: dict, backward_call_s: float, deadline: float, tick=None) -> dict:
    """Causal SDPA forward and backward kernel times over grid b × heads × s × d (seconds).

    The kernel is PyTorch's default choice for these shapes, as the models call it (a fused
    flash / memory-efficient / cuDNN kernel on CUDA, the CPU flash kernel on a CPU). Backward =
    the autograd.grad time of the saved forward; on a CPU minus the backward()-call cost (not below
    half the raw value) — on CUDA the back-to-back event timing of large shapes is device time,
    while small shapes stay host-bound there (the table's floor region)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    keys = ("b", "heads", "s", "d")
    axes = [list(grid[k]) for k in keys]
    shape = tuple(len(a) for a in axes)
    fwd, bwd = np.full(shape, np.nan), np.full(shape, np.nan)
    mesh = np.meshgrid(*[np.array(a, float) for a in axes], indexing="ij")
    work = 2.0 * mesh[0] * mesh[1] * mesh[2] ** 2 * mesh[3]
    order = sorted(np.ndindex(*shape), key=lambda i: work[i])
    g = torch.Generator(device=dev.torch_device).manual_seed(1)

    def point(idx):
        """Times fwd and bwd at idx (bwd kept as the faster of old and new); returns fwd."""
        b, h, s, d = (axes[a][idx[a]] for a in range(4))
        q, k, v = (
            torch.randn(b, h, s, d, generator=g, device=dev.torch_device).to(dev.dtype).requires_grad_()
            for _ in range(3)
        )
        tf = time_op(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, target_s=0.01, cold=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dy = torch.randn_like(out)
        raw = time_op(lambda: torch.autograd.grad(out, (q, k, v), dy, retain_graph=True), dev, target_s=0.01, cold=True)
        if dev.kind == "cpu":
            raw = max(raw - backward_call_s, 0.5 * raw)
        bwd[idx] = np.fmin(bwd[idx], raw)
        return tf

    sweep(order, point, fwd, deadline, 4, tick)
    rechecked = recheck(fwd, work, point, deadline)
    rechecked += recheck(bwd, work, lambda i: (point(i), bwd[i])[1], deadline)
    measured = int(np.isfinite(fwd).sum())
    filled = fill_missing(fwd, work)
    fill_missing(bwd, work)
    return {
        "axes": dict(zip(keys, axes)),
        "fwd_s": fwd,
        "bwd_s": bwd,
        "measured": measured,
        "rechecked": rechecked,
        "filled": [[axes[a][i[a]] for a in range(4)] for i in filled],
        "fwd_floor_s": float(fwd[(0,) * 4]),
        "bwd_floor_s": float(bwd[(0,) * 4]),
    }


# ---------------------------------------------------------------------------- host overheads
def measure_host(dev: Device) -> dict:
    """Per-op host costs of eager PyTorch with autograd recording, on tiny tensors.

    fwd_op_s: median per-op wall time of loops of tiny forward ops (add, mul, gelu, layer_norm).
    bwd_op_s, backward_call_s: autograd.grad over chains of n tiny ops, t = E + n·h_bwd fitted by
    least squares over n (E = the once-per-backward() engine cost)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    from mist.models.mlp import gelu

    x = torch.randn(8, 8, device=dev.torch_device, dtype=torch.float32).to(dev.dtype).requires_grad_()
    w = torch.ones(8, device=dev.torch_device, dtype=dev.dtype, requires_grad=True)
    N = 200
    ops = {
        "add": lambda: x + x,
        "mul": lambda: x * 1.0001,
        "gelu": lambda: gelu(x),
        "layer_norm": lambda: F.layer_norm(x, (8,), w),
    }
    per_op = {}
    for name, op in ops.items():

        def loop(op=op):
            for _ in range(N):
                op()

        loop()
        per_op[name] = float(np.median([wall_of(loop, dev) for _ in range(5)])) / N
    h_fwd = float(np.median(list(per_op.values())))
    ns, ts = [1, 4, 16, 64], []
    for n in ns:
        y = x
        for _ in range(n):
            y = y * 1.0001
        g = torch.ones_like(y)

        def back(y=y, g=g):
            torch.autograd.grad(y, x, g, retain_graph=True)

        back()
        ts.append(float(np.median([wall_of(back, dev) for _ in range(15)])))
    a = np.stack([np.ones(len(ns)), np.array(ns, float)], axis=1)
    (e_call, h_bwd), *_ = np.linalg.lstsq(a, np.array(ts), rcond=None)
    h_bwd = max(float(h_bwd), 1e-7)
    e_call = max(float(e_call), 0.0)
    return {
        "fwd_op_s": h_fwd,
        "bwd_op_s": h_bwd,
        "backward_call_s": e_call,
        "per_op_fwd_s": per_op,
        "backward_chain": {"ops": ns, "seconds": ts},
    }


def measure_op_floor(dev: Device) -> float:
    """Launch floor of a tiny memory-bound kernel: on CUDA the device time of a trivial kernel
    (replayed from a CUDA graph, so no host issue cost), on CPU the time of a tiny op (dispatch
    included: on a CPU the host runs the kernel itself)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    x = torch.ones(64, device=dev.torch_device, dtype=dev.dtype)
    if dev.kind == "cuda":
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    x.add_(0)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            n = 100
            with torch.cuda.graph(graph):
                for _ in range(n):
                    x.add_(0)
            return time_op(graph.replay, dev, target_s=0.01) / n
        except Exception:  # pragma: no cover - graphs unavailable
            return 3e-6
    with torch.no_grad():
        return time_op(lambda: torch.add(x, x), dev, target_s=0.01, max_reps=2000)


# ---------------------------------------------------------------------------- memory-bound ops
def _io_bytes(element_bytes: int) -> dict:
    """Bytes read + written at the aten-op boundary per module, in units of T = one [m, h] tensor,
    (forward, backward) — the accounting of `tools/profile_build/h200.py`'s `IO_BYTES`, generalized to the
    element size (masks are 1 byte per element)."""
    e = float(element_bytes)
    return {
        "layernorm": (2.0, 3.0),
        "rmsnorm": (2.0, 3.0),
        "gelu": (2.0, 3.0),
        "swiglu": (2.5, 10.5),  # x [m, h] -> silu(x1) * x2 [m, h/2]
        "dropout": (2.0 + 1.0 / e, 2.0 + 1.0 / e),
        "binary": (3.0, 6.0),  # mul: fwd x, y -> z; bwd dz·y and dz·x (two binary kernels)
        "softmax": (2.0, 3.0),
        "copy": (2.0, 2.0),
    }


def _ce_bytes(element_bytes: int) -> tuple[float, float]:
    """Cross-entropy bytes per logit: fp32 upcast (unless fp32), log_softmax 4+4, nll reads 4;
    backward nll 4+4, log_softmax_backward 4+4+4, cast back 4+e (unless fp32)."""
    up = 0.0 if element_bytes == 4 else element_bytes + 4.0
    return up + 12.0, 20.0 + up


def measure_memory_ops(
    dev: Device, sizes_bytes, backward_call_s: float, floor_s: float, cap_Bps: float, deadline: float, tick=None
) -> dict:
    """Effective bandwidth per class (fwd, bwd) over the sizes T (bytes of one [m, h] tensor,
    h = 1024 on a CPU, 4096 on CUDA).

    CPU: fitted in the form the profile uses, t = floor + io·T / bw (least relative error), the
    backward times less the backward()-call cost (the host runs everything, so wall time is the
    cost). CUDA: back-to-back event timing is device time once a kernel outlasts its host issue
    cost, so the rate is fitted as t = c + io·T / bw on the two largest sizes (bandwidth-bound),
    nothing subtracted. Either way a rate above max(cap_Bps, the largest size's effective rate)
    is capped there.
    `copy` has no backward kernel (clone's gradient is passed through): its backward = forward."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    e = dev.element_bytes
    h = 4096 if dev.kind == "cuda" else 1024
    io = _io_bytes(e)
    g = torch.Generator(device=dev.torch_device).manual_seed(2)

    def rnd(*shape, grad=True):
        t = torch.randn(*shape, generator=g, device=dev.torch_device).to(dev.dtype)
        return t.requires_grad_(grad)

    classes = list(io) + ["cross_entropy"]
    rows = {c: {"T": [], "fwd_s": [], "bwd_s": []} for c in classes}
    steps = len(classes) * len(sizes_bytes)
    done = 0
    for T in sorted(sizes_bytes):
        for cls in classes:
            if time.perf_counter() > deadline and len(rows[cls]["T"]) >= 2:
                done += 1
                continue
            units, tf, tb = _time_memory_class(dev, rnd, cls, T, h, backward_call_s)
            rows[cls]["T"].append(units)
            rows[cls]["fwd_s"].append(tf)
            rows[cls]["bwd_s"].append(tb)
            done += 1
            if tick:
                tick(done / steps)
    ce_f, ce_b = _ce_bytes(e)
    bandwidth, fits = _fit_memory_ops(dev, rows, {**io, "cross_entropy": (ce_f, ce_b)}, floor_s, cap_Bps)
    return {
        "bandwidth": bandwidth,
        "fits": fits,
        "io_units": {**{k: list(v) for k, v in io.items()}, "cross_entropy_per_logit": [ce_f, ce_b]},
    }


def _memory_op(cls: str, m: int, h: int, rnd):
    """(the forward of one memory-bound class on [m, h] inputs, its differentiable inputs)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    from mist.models.dropout import dropout
    from mist.models.mlp import gelu
    from mist.models.norms import rms_norm

    x = rnd(m, h)
    if cls == "layernorm":
        wt, bs = rnd(h), rnd(h)
        return (lambda: F.layer_norm(x, (h,), wt, bs)), (x, wt, bs)
    if cls == "rmsnorm":  # the model's own RMSNorm operator (fused aten kernels on CUDA)
        wt = rnd(h)
        return (lambda: rms_norm(x, wt, 1e-5)), (x, wt)
    if cls == "gelu":  # the model's own activation call
        return (lambda: gelu(x)), (x,)
    if cls == "swiglu":

        def f():
            a, b = x.chunk(2, dim=-1)
            return F.silu(a) * b

        return f, (x,)
    if cls == "dropout":  # the model's own operator: `native_dropout`, whose mask is bool on every device
        return (lambda: dropout(x, 0.1, True)), (x,)
    if cls == "binary":
        y = rnd(m, h)
        return (lambda: x * y), (x, y)
    if cls == "softmax":
        return (lambda: torch.softmax(x, dim=-1)), (x,)
    if cls == "copy":
        return (lambda: x.clone()), (x,)
    raise KeyError(cls)


def _time_memory_class(dev: Device, rnd, cls: str, T: float, h: int, backward_call_s: float):
    """(units of T, forward seconds, backward seconds) of one class at size T."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    e = dev.element_bytes
    if cls == "cross_entropy":
        V = 8192
        m = max(1, int(T // (V * e)))
        logits = rnd(m, V)
        tgt = torch.randint(0, V, (m,), device=dev.torch_device)

        def f():
            return F.cross_entropy(logits.float(), tgt)

        inputs, units = (logits,), float(m * V)
    else:
        m = max(1, int(T // (h * e)))
        f, inputs = _memory_op(cls, m, h, rnd)
        units = float(m * h * e)
    tf = time_op(f, dev, target_s=0.01, cold=True)
    if cls == "copy":
        return units, tf, tf
    out = f()
    dy = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
    tb = time_op(
        lambda o=out, x=inputs, d=dy: torch.autograd.grad(o, x, d, retain_graph=True), dev, target_s=0.01, cold=True
    )
    if dev.kind == "cpu":
        tb = max(tb - backward_call_s, 0.5 * tb)
    return units, tf, tb


def _fit_memory_ops(dev: Device, rows: dict, io: dict, floor_s: float, cap_Bps: float) -> tuple[dict, dict]:
    """(bandwidth {class: {fwd, bwd}}, fits {"class/fwd": ...}) from the timed rows; `io`: bytes
    moved per unit of T (forward, backward) of each class."""
    bandwidth, fits = {}, {}
    for cls, r in rows.items():
        bw = {}
        for key, factor in zip(("fwd", "bwd"), io[cls]):
            x = factor * np.array(r["T"])
            t = np.array(r[key + "_s"])
            if dev.kind == "cuda" and len(x) >= 2:
                rate, _ = fit_floor_plus_rate(x[-2:], t[-2:])
            else:
                rate, _ = fit_floor_plus_rate(x, np.maximum(t - floor_s, 0.1 * t), intercept=False)
            cap = max(cap_Bps, float(x[-1] / t[-1]))
            capped = not np.isfinite(rate) or rate > cap
            rate = min(rate, cap)
            bw[key] = float(rate)
            pred = floor_s + x / rate
            fits[f"{cls}/{key}"] = {
                "bytes": x.tolist(),
                "seconds": t.tolist(),
                "capped": bool(capped),
                "median_rel_error": round(float(np.median(np.abs(pred / t - 1))), 4),
            }
        bandwidth[cls] = bw
    return bandwidth, fits


# ---------------------------------------------------------------------------- fused pointwise work
def _welford_step(y):
    """A LayerNorm-like step: mean and variance of each row in one pass, then a use of both."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    v, m = torch.var_mean(y, dim=-1, keepdim=True, correction=0)
    return (y - m) * 0.5 + v


def _random_step(y):
    """A dropout's step in a training graph: a uniform draw per element (Inductor's generated
    random numbers), compared with p and kept as a bool mask, an output of the kernel as a
    dropout's mask is (saved for the backward). The kept mask is part of the cost: on a CPU core
    Inductor's bool store doubled a draw's time (15 against 7–8 ns an element)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    keep = torch.rand_like(y) > 0.5
    return torch.where(keep, y, 1.0 - y), keep


# Each kind's kernel: a chain of `steps` applications to every element (a step's extra arithmetic,
# counted with the arithmetic's measured cost). Bounded maps, so that no value overflows.
_POINTWISE_CHAINS = {
    # kind: (one step, element-operations of the kind per step, arithmetic operations per step)
    "arith": (lambda y: y * 0.999 + 0.001, 2, 0),
    "reduction": (lambda y: y - y.mean(dim=-1, keepdim=True) + 0.5, 1, 2),  # rows of 1024
    "welford": (_welford_step, 1, 3),
    "tanh": (lambda y: y.tanh(), 1, 0),
    "exp": (lambda y: (-y).exp(), 1, 1),
    "sigmoid": (lambda y: y.sigmoid(), 1, 0),
    "erf": (lambda y: y.erf(), 1, 0),
    "sin": (lambda y: y.sin(), 1, 0),
    "cos": (lambda y: y.cos(), 1, 0),
    "log": (lambda y: (y * y + 1.0).log(), 1, 2),
    "random": (_random_step, 1, 3),  # (the compare, the select, 1 − y)
}


def measure_pointwise(dev: Device) -> dict:
    """Seconds per element-operation of each `POINTWISE_KINDS` kind in the kernels Inductor
    generates on this device (`mist.hardware.memory_ops.MemoryOpModel.fused_time`): a compiled
    chain of steps over one large tensor (16 steps of arithmetic, 4 of a function), its time over
    the element-operations it computes. The kernel also streams its input and output once: where
    that outlasts the computing (a GPU's transcendentals) the figure is an upper bound, under which
    a block's fused kernels, which move more bytes per operation, stay priced by their bytes."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    from mist.hardware.memory_ops import POINTWISE_KINDS  # lazy: as the module's other imports

    n = (1 << 24) if dev.kind == "cuda" else (1 << 20)
    x = (torch.rand(n // 1024, 1024, device=dev.torch_device) * 0.5 + 0.25).to(dev.dtype)
    out: dict = {}
    for kind in POINTWISE_KINDS:
        step, ops, arith = _POINTWISE_CHAINS[kind]
        steps = 16 if kind == "arith" else 4

        def chain(y, step=step, steps=steps):
            kept = []  # what a step also writes (a dropout's masks)
            for _ in range(steps):
                y = step(y)
                if isinstance(y, tuple):
                    y, k = y
                    kept.append(k)
            return y, *kept

        fn = torch.compile(chain, dynamic=False, fullgraph=True)
        # (one code object, a graph per kind and dtype: more than dynamo's default limit of 8)
        # (compiled in this process: no pool of compile workers started for ten small kernels)
        with torch._dynamo.config.patch(recompile_limit=64), torch._inductor.config.patch(compile_threads=1):
            t = time_op(lambda fn=fn: fn(x), dev, target_s=0.02, warmup=2, stat="min")
        per_step = t / (steps * n) - arith * out.get("arith", 0.0)
        out[kind] = max(per_step, 0.0) / ops
    return out


# ---------------------------------------------------------------------------- copies, AdamW
def measure_copies(dev: Device, nbytes: int) -> dict:
    """Host↔device copy rates (B/s, bytes moved one way) and the device copy rate (read + write),
    best of the repetitions (STREAM-style: a bandwidth is what the link can do).

    CUDA: pinned H2D and D2H, both at once on two streams (total B/s), device-to-device.
    CPU: there is no device link; a host memcpy stands in for H2D and D2H, two memcpy threads at
    once for the bidirectional rate, and the same memcpy (read + write) is the copy rate."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    n = nbytes // 4
    if dev.kind == "cuda":
        host_a = torch.empty(n, dtype=torch.float32, pin_memory=True)
        host_b = torch.empty(n, dtype=torch.float32, pin_memory=True)
        d_a = torch.zeros(n, dtype=torch.float32, device=dev.torch_device)
        d_b = torch.zeros(n, dtype=torch.float32, device=dev.torch_device)
        h2d = time_op(lambda: d_a.copy_(host_a, non_blocking=True), dev, target_s=0.05, stat="min")
        d2h = time_op(lambda: host_b.copy_(d_b, non_blocking=True), dev, target_s=0.05, stat="min")
        d2d = time_op(lambda: d_b.copy_(d_a), dev, target_s=0.05, stat="min")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            with torch.cuda.stream(s1):
                d_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(s2):
                host_b.copy_(d_b, non_blocking=True)

        both()
        bidir = float(np.min([wall_of(both, dev) for _ in range(5)]))
        return {
            "h2d_Bps": nbytes / h2d,
            "d2h_Bps": nbytes / d2h,
            "bidir_Bps": 2 * nbytes / bidir,
            "copy_Bps": 2 * nbytes / d2d,
            "bytes": nbytes,
            "kind": "pinned host <-> device",
        }
    src, dst = torch.ones(n), torch.empty(n)
    src2, dst2 = torch.ones(n), torch.empty(n)
    t = time_op(lambda: dst.copy_(src), dev, target_s=0.1, stat="min")

    def both():
        th = threading.Thread(target=lambda: dst2.copy_(src2))
        th.start()
        dst.copy_(src)
        th.join()

    both()
    bidir = float(np.min([wall_of(both, dev) for _ in range(5)]))
    return {
        "h2d_Bps": nbytes / t,
        "d2h_Bps": nbytes / t,
        "bidir_Bps": 2 * nbytes / bidir,
        "copy_Bps": 2 * nbytes / t,
        "bytes": nbytes,
        "kind": "host memcpy (CPU: no device link)",
    }


def _adam_rate(dev: Device, device, n: int) -> float:
    """Seconds per parameter of `mist.runtime.optimizer.adamw_` over n fp32 parameters on `device`."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    from mist.runtime.optimizer import adamw_

    p, m, v = (torch.zeros(n, dtype=torch.float32, device=device) for _ in range(3))
    g = torch.full_like(p, 1e-3)

    def step():
        return adamw_(
            p,
            m,
            v,
            g,
            step=1,
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            decay_ranges=[(0, n)],
        )

    d = Device("cuda" if device.type == "cuda" else "cpu", "fp32", dev.index)
    return time_op(step, d, target_s=0.1, min_reps=3, max_reps=20) / n


def measure_host_adam(params: int, ranks: int) -> dict:
    """The host AdamW rate one of `ranks` GPU ranks of a node gets under `mist train`: with its
    share of the cores (`threads_per_worker`) while the other ranks step their own host AdamW at
    the same time (busy neighbours), as they all do during their first micro-batch, sharing the
    cores and the memory channels."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    ranks = max(1, int(ranks))
    threads, before = threads_per_worker(ranks), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Neighbours(ranks - 1, threads, work="adam", size=params):
            s = _adam_rate(Device("cpu", "fp32"), torch.device("cpu"), params)
    finally:
        torch.set_num_threads(before)
    return {"host_s_per_param": s, "host_threads": threads, "host_ranks": ranks}


def measure_adam(dev: Device, params: int, host_params: int, host_ranks: int = 1) -> dict:
    """Seconds per parameter of one fp32 AdamW step of the runtime's own optimizer
    (`mist.runtime.optimizer.adamw_`, as `mist train` steps a flat shard): on the device and on
    the host CPU (the offloaded fraction; on a GPU machine as one of its `host_ranks` ranks,
    `measure_host_adam`)."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    if dev.kind == "cuda":
        return {
            "device_s_per_param": _adam_rate(dev, dev.torch_device, params),
            **measure_host_adam(host_params, host_ranks),
        }
    s = _adam_rate(dev, torch.device("cpu"), host_params)
    return {"device_s_per_param": s, "host_s_per_param": s, "host_threads": torch.get_num_threads(), "host_ranks": 1}


# ---------------------------------------------------------------------------- capacity, fingerprint
def memory_capacity(dev: Device) -> tuple[int, str]:
    """(bytes, source): CUDA total device memory; CPU available RAM (MemAvailable)."""
    if dev.kind == "cuda":
        import torch  # lazy: keeps torch out of `import mist.profiling`

        total = int(torch.cuda.get_device_properties(dev.index).total_memory)
        return total, "measured: torch total_memory of the device"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(
                        line.split()[1]
                    ) * 1024, "measured: available host RAM (/proc/meminfo MemAvailable), CPU run"
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages), "measured: available host RAM (sysconf), CPU run"


def memory_outside_allocator(dev: Device) -> tuple[int, str] | None:
    """(bytes, source) of device memory in use that PyTorch's caching allocator does not hold —
    the CUDA context with the kernels loaded so far (the GEMM, attention and memory-bound ones of
    the phases before) and the libraries' own buffers — as total − free − reserved; None on a CPU,
    where the allocator's capacity is the available RAM already."""
    if dev.kind != "cuda":
        return None
    import torch  # lazy: keeps torch out of `import mist.profiling`

    torch.cuda.synchronize(dev.index)
    free, total = torch.cuda.mem_get_info(dev.index)
    outside = max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(dev.index)))
    return outside, (
        "measured: device memory in use outside PyTorch's allocator after the compute phases "
        "(total - free - reserved): one process's CUDA context and libraries; no NCCL communicator, "
        "and anything else running on the GPU counted in"
    )


def device_name(dev: Device) -> str:
    if dev.kind == "cuda":
        import torch  # lazy: keeps torch out of `import mist.profiling`

        return torch.cuda.get_device_name(dev.index)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(dev: Device, processes: int) -> dict:
    import torch  # lazy: keeps torch out of `import mist.profiling`

    fp = {
        "device": device_name(dev),
        "device_kind": dev.kind,
        "dtype": dev.dtype_name,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "processes": processes,
    }
    if dev.kind == "cuda":
        props = torch.cuda.get_device_properties(dev.index)
        fp.update(
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            device_count=torch.cuda.device_count(),
        )
    return fp
