"""Drift check for `mist validate`: re-measure a handful of a profile's own micro-benchmarks on
this machine and compare them with what the profile predicts.

    from mist.profiling.drift import check
    report = check(load_profile("profile.json"), "cpu", quick=True)
    report["drifted"], report["checks"]   # ratios measured / predicted

The checks use the profiling timers (`profiling.timing.time_op`) and the profile's own dtype:
a few GEMMs at measured grid nodes spread over the work range, one memory-bound op (GELU forward
at the largest size the profile measured) and, when `processes` > 1, one all-reduce over that
many worker processes (predicted by the profile's link model). `drifted` is True when any ratio
is more than `threshold` (default 10 %) away from 1. Drift is a lasting change, not a burst of
another process taking the cores: a check that is off is re-measured (up to `attempts` times in
all) and keeps its closest ratio; every attempt is listed. On a CPU the checks run with the
profile's thread count (fingerprint torch_threads), as the profile was measured.
"""

from __future__ import annotations

import itertools

import numpy as np

from mist.cpu_workers import keep_heap_pages, threads_per_worker
from mist.profiling.comm import run_workers
from mist.profiling.compute import cold_weights
from mist.profiling.neighbours import Neighbours
from mist.profiling.runner import measured_gemm_points
from mist.profiling.timing import Device, time_op, warm_up
from mist.units import MiB


def check(
    profile,
    device: str | None = None,
    quick: bool = True,
    processes: int = 1,
    threshold: float = 0.10,
    attempts: int = 3,
) -> dict:
    """Re-measure a few of the profile's micro-benchmarks here; see the module docstring."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    fp = profile.fingerprint or {}
    kind = device or fp.get("device_kind", "cpu")
    dtype = fp.get("dtype") or ("bf16" if kind == "cuda" else "fp32")
    dev = Device(kind, dtype)
    threads = torch.get_num_threads()
    if kind == "cpu" and fp.get("torch_threads"):
        torch.set_num_threads(int(fp["torch_threads"]))
    if kind == "cpu":
        keep_heap_pages()  # the heap settings the profile was measured with
    try:
        return _check(profile, dev, quick, processes, threshold, attempts)
    finally:
        torch.set_num_threads(threads)


def _check(profile, dev: Device, quick, processes, threshold, attempts) -> dict:
    checks = []

    def add(what, measure, predicted):
        checks.append(_closest(what, measure, float(predicted), threshold, attempts))

    _compute_checks(profile, dev, quick, add)
    skipped = _all_reduce_check(profile, dev, processes, add)
    ratios = np.array([c["ratio"] for c in checks])
    worst = checks[int(np.argmax(np.abs(np.log(ratios))))]
    return {
        "profile": profile.name,
        "device": dev.kind,
        "checks": checks,
        "skipped": skipped,
        "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
        "worst": worst,
        "threshold": threshold,
        "drifted": bool(np.any(np.abs(ratios - 1.0) > threshold)),
    }


def _closest(what: str, measure, predicted: float, threshold: float, attempts: int) -> dict:
    """Measure (re-measuring while off, up to `attempts`), keep the closest ratio."""
    tries = []
    for _ in range(max(1, attempts)):
        tries.append(float(measure()))
        if predicted > 0 and abs(tries[-1] / predicted - 1) <= threshold:
            break
    best = min(tries, key=lambda t: abs(np.log(t / predicted))) if predicted > 0 else tries[0]
    return {
        "what": what,
        "measured_s": best,
        "predicted_s": predicted,
        "ratio": best / predicted if predicted > 0 else float("inf"),
        "attempts_s": tries,
    }


def _compute_checks(profile, dev: Device, quick, add) -> None:
    """GEMMs at measured grid nodes and one GELU forward at the largest size the profile measured."""
    import torch  # lazy: keeps torch out of `import mist.profiling`
    import torch.nn.functional as F

    from mist.models.mlp import gelu

    fp = profile.fingerprint or {}
    kind = dev.kind
    # a CPU profile's compute tables were measured under busy neighbours: re-measure under the
    # same load (its collectives were not, and are not)
    busy = Neighbours(int(fp.get("busy_neighbours", 0)) if kind == "cpu" else 0, torch.get_num_threads())
    with busy:
        warm_up(dev, 0.3 if quick else 1.0)
        g = torch.Generator(device=dev.torch_device).manual_seed(0)
        with torch.no_grad():

            def rand(r, c):
                return torch.randn(r, c, generator=g, device=dev.torch_device).to(dev.dtype)

            cache: dict = {}  # cold weights, as the profile timed them
            for m, n, k in measured_gemm_points(profile, 3 if quick else 6):
                x = rand(m, k)
                ws = itertools.cycle(cold_weights(n, k, dev, rand, cache))
                add(
                    f"gemm {m}x{n}x{k}",
                    lambda x=x, ws=ws: time_op(
                        lambda: F.linear(x, next(ws)), dev, target_s=0.05 if quick else 0.15, cold=True
                    ),
                    profile.gemm_time(m, n, k),
                )

        fits = fp.get("memory_op_fits", {}).get("gelu/fwd")
        nbytes = int(max(fits["bytes"])) if fits else (256 if kind == "cuda" else 4) * MiB * 2
        T = nbytes // 2  # GELU forward moves 2T (x in, y out)
        h = 1024
        rows = max(1, T // (h * dev.element_bytes))
        x = torch.randn(rows, h, generator=g, device=dev.torch_device).to(dev.dtype).requires_grad_()
        add(
            f"gelu fwd {2 * rows * h * dev.element_bytes / MiB:.1f} MiB",
            lambda: time_op(lambda: gelu(x), dev, target_s=0.05 if quick else 0.15, cold=True),
            profile.memory_op_time("gelu", 2 * rows * h * dev.element_bytes),
        )


def _all_reduce_check(profile, dev: Device, processes: int, add) -> list[str]:
    """One all-reduce over `processes` workers against the profile's link model; returns the
    checks skipped, each with why."""
    if processes <= 1:
        return ["all_reduce: one process"]
    links = profile.link_model()
    if links is None:
        return ["all_reduce: the profile has no link model"]
    kind = dev.kind
    size = (64 if kind == "cuda" else 4) * MiB
    cfg = {
        "device": kind,
        "dtype": dev.dtype_name,
        "group_sizes": [],
        "sizes": [size],
        "target_s": 0.05,
        "ops": ["all_reduce"],
        "p2p": False,
        "interference": None,
        "deadline": 0.0,
        "threads": threads_per_worker(processes) if kind == "cpu" else 4,
    }
    try:
        res = run_workers(processes, cfg, timeout_s=120)
        nb, sec = res["collectives"]["all_reduce"][str(processes)][0]
        again = iter([sec])

        def measure_ar():
            first = next(again, None)
            if first is not None:
                return first
            r = run_workers(processes, cfg, timeout_s=120)
            return r["collectives"]["all_reduce"][str(processes)][0][1]

        add(
            f"all_reduce {nb / MiB:.1f} MiB over {processes}",
            measure_ar,
            float(links.time("all_reduce", nb, processes)),
        )
    except RuntimeError as exc:
        return [f"all_reduce: {str(exc).splitlines()[0]}"]
    return []
