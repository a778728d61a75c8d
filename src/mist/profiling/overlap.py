"""Pairwise interference of concurrent channels, by the finish-time method.

Two loops A and B, each about `target_s` long alone (standalone times x_A, x_B), are started
together (B in a thread; on CUDA each on its own stream) and their finish times e_A, e_B taken.
With the progressive-overlap model of `mist.hardware.interference` (both run slowed by f_A, f_B
until the first finishes, the other then runs alone), if A finishes first:

    f_A = e_A / x_A,        f_B = e_A / (e_A + x_B − e_B)

(symmetric when B finishes first). Factors are clamped to [1, CAP]: a measured speed-up is noise.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from mist.profiling.timing import Device, one_call_s

CAP = 10.0


def factors_from_finish(xa: float, xb: float, ea: float, eb: float) -> tuple[float, float]:
    """(f_A, f_B) from standalone times and concurrent finish times (see module docstring)."""
    if ea > eb:
        fb, fa = factors_from_finish(xb, xa, eb, ea)
        return fa, fb
    fa = ea / xa
    denom = ea + xb - eb
    fb = ea / denom if denom > 1e-12 else CAP
    return float(np.clip(fa, 1.0, CAP)), float(np.clip(fb, 1.0, CAP))


def concurrent(run_a, run_b, repeats: int = 2, before=None) -> tuple[float, float]:
    """Median finish times (e_A, e_B) of run_a (this thread) and run_b (another thread) started
    together; each callable must return only once its own work is complete. `before()` runs at
    the start of every repetition (e.g. a barrier across processes)."""
    ea, eb = [], []
    for _ in range(repeats):
        if before is not None:
            before()
        ends = {}
        go = threading.Barrier(2)

        def side(go=go, ends=ends):
            go.wait()
            t0 = time.perf_counter()
            run_b()
            ends["b"] = time.perf_counter() - t0

        th = threading.Thread(target=side)
        th.start()
        go.wait()
        t0 = time.perf_counter()
        run_a()
        ends["a"] = time.perf_counter() - t0
        th.join()
        ea.append(ends["a"])
        eb.append(ends["b"])
    return float(np.median(ea)), float(np.median(eb))


def alone(run, repeats: int = 2) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def pair(run_a, run_b, repeats: int = 2) -> dict:
    xa, xb = alone(run_a, repeats), alone(run_b, repeats)
    ea, eb = concurrent(run_a, run_b, repeats)
    fa, fb = factors_from_finish(xa, xb, ea, eb)
    return {"factors": [fa, fb], "alone_s": [xa, xb], "together_s": [ea, eb]}


def _loop(fn, count, dev: Device, stream=None):
    """A callable running `fn` `count` times and waiting for its own work (its stream on CUDA)."""
    if dev.kind != "cuda":

        def run():
            for _ in range(count):
                fn()

        return run
    import torch  # lazy: keeps torch out of `import mist.profiling`

    def run_cuda():
        s = stream or torch.cuda.current_stream()
        with torch.cuda.stream(s):
            for _ in range(count):
                fn()
        s.synchronize()

    return run_cuda


def _count(fn, dev: Device, target_s: float) -> int:
    return int(np.clip(target_s / one_call_s(fn, dev), 1, 100000))


def measure_local_pairs(dev: Device, gemm_shape, copy_bytes: int, target_s: float) -> dict:
    """Pairs measurable in one process: {C, C2G}, {C, G2C}, {C2G, G2C}.

    CUDA: GEMM loop vs pinned H2D / D2H copy loops on side streams, and H2D vs D2H.
    CPU: GEMM loop vs a host memcpy loop (standing in for both copy directions), and memcpy vs
    memcpy."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    m, n, k = gemm_shape
    d = dev.torch_device
    x = torch.randn(m, k, device=d).to(dev.dtype)
    w = torch.randn(n, k, device=d).to(dev.dtype)
    nel = copy_bytes // 4

    def gemm():
        with torch.no_grad():
            F.linear(x, w)

    out = {}
    if dev.kind == "cuda":
        host_a = torch.empty(nel, pin_memory=True)
        host_b = torch.empty(nel, pin_memory=True)
        dev_a, dev_b = torch.zeros(nel, device=d), torch.zeros(nel, device=d)
        s_c, s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        h2d = lambda: dev_a.copy_(host_a, non_blocking=True)  # noqa: E731
        d2h = lambda: host_b.copy_(dev_b, non_blocking=True)  # noqa: E731
        run_c = _loop(gemm, _count(gemm, dev, target_s), dev, s_c)
        run_h2d = _loop(h2d, _count(h2d, dev, target_s), dev, s_h2d)
        run_d2h = _loop(d2h, _count(d2h, dev, target_s), dev, s_d2h)
        out["C+C2G"] = pair(run_c, run_h2d)
        out["C+G2C"] = pair(run_c, run_d2h)
        out["C2G+G2C"] = pair(run_h2d, run_d2h)
        out["how"] = (
            "CUDA: GEMM loop vs pinned H2D / D2H copy loops on separate streams, and H2D vs D2H; finish-time method"
        )
        return out
    src_a, dst_a = torch.ones(nel), torch.empty(nel)
    src_b, dst_b = torch.ones(nel), torch.empty(nel)
    cp_a = lambda: dst_a.copy_(src_a)  # noqa: E731
    cp_b = lambda: dst_b.copy_(src_b)  # noqa: E731
    run_c = _loop(gemm, _count(gemm, dev, target_s), dev)
    run_a = _loop(cp_a, _count(cp_a, dev, target_s), dev)
    run_b = _loop(cp_b, _count(cp_b, dev, target_s), dev)
    out["C+C2G"] = pair(run_c, run_a)
    out["C+G2C"] = dict(out["C+C2G"], note="same measurement as C+C2G (CPU: both directions are a host memcpy)")
    out["C2G+G2C"] = pair(run_a, run_b)
    out["how"] = (
        "CPU: GEMM loop vs a host memcpy loop in another thread (standing in for H2D and D2H), "
        "and memcpy vs memcpy; finish-time method"
    )
    return out
