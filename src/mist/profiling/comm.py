"""Collectives over K worker processes (gloo on CPU, NCCL on CUDA, one GPU per process).

`run_workers` spawns K processes that run `comm_worker.run` (every rank the same calls, so the
decisions that depend on time — repetitions, stopping at the deadline — are made on rank 0 and
broadcast). The workers measure, in order:

1. all_reduce, all_gather, reduce_scatter of the full group at a few sizes;
2. p2p ping-pong between ranks 0 and 1 (one way = round trip / 2);
3. the synchronization cost of a collective issued right after compute;
4. the {C, G2G} interference pair: a GEMM loop while another thread of the same process runs an
   all-gather loop (on CUDA on its own stream), finish-time method (`profiling.overlap`);
5. the collectives of smaller power-of-two groups, while time is left.

Rank 0 sends progress and the results to the parent through a queue. `fit_links` turns the
times into the LinkModel alpha–busbw fits (t = alpha + ring_factor · bytes / busbw).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import numpy as np

from mist.hardware.collectives import ring_factor
from mist.hardware.fitting import fit_floor_plus_rate
from mist.worker_processes import WorkerDied, WorkerTimeout, poll_messages, start_workers


# ---------------------------------------------------------------------------- worker side
def _worker(rank: int, world: int, init_file: str, cfg: dict, q) -> None:  # pragma: no cover - subprocess
    try:
        from mist.profiling.comm_worker import run  # lazy: keeps torch out of `import mist.profiling`

        result = run(rank, world, init_file, cfg, q)
        q.put(("result", result) if rank == 0 else ("done", rank))
    except Exception as exc:  # report, never hang the parent
        import traceback

        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


# ---------------------------------------------------------------------------- parent side
def run_workers(processes: int, cfg: dict, progress=None, timeout_s: float = 600.0) -> dict:
    """Spawn `processes` workers running `comm_worker.run`; returns rank 0's results.
    RuntimeError when a worker fails or the run exceeds `timeout_s`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="mist-profile-pg-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    procs = start_workers(ctx, _worker, [(r, processes, init_file, cfg, q) for r in range(processes)], daemon=True)
    result, error = None, None
    try:
        for msg in poll_messages(q, procs, timeout_s=timeout_s):
            if msg[0] == "progress" and progress:
                progress(msg[1], msg[2])
            elif msg[0] == "result":
                result = msg[1]
                break
            elif msg[0] == "error":
                error = msg[1]
                break
    except WorkerTimeout:
        error = f"collective measurements exceeded {timeout_s:.0f} s"
    except WorkerDied as e:
        error = f"worker process exited with code {e.exitcode}"
    finally:
        for p in procs:
            p.join(timeout=10 if result is not None else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        try:
            os.unlink(init_file)
        except OSError:
            pass
    if error is not None:
        raise RuntimeError(error)
    return result


# ---------------------------------------------------------------------------- fits
def fit_links(collectives: dict) -> tuple[dict, dict]:
    """LinkModel fits {op: {n: [alpha_s, busbw_Bps]}} and median relative errors per op/n."""
    fits, errors = {}, {}
    for op, by_n in collectives.items():
        for n, rows in by_n.items():
            if len(rows) < 2:
                continue
            b = np.array([r[0] for r in rows], float)
            t = np.array([r[1] for r in rows], float)
            x = float(ring_factor(op, int(n))) * b
            busbw, alpha = fit_floor_plus_rate(x, t)
            if not np.isfinite(busbw):
                busbw = float(x[-1] / t[-1])
            fits.setdefault(op, {})[str(n)] = [float(alpha), float(busbw)]
            pred = alpha + x / busbw
            errors[f"{op}/{n}"] = round(float(np.median(np.abs(pred / t - 1))), 4)
    return fits, errors


def fit_p2p(rows) -> dict:
    b = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    bw, alpha = fit_floor_plus_rate(b, t)
    if not np.isfinite(bw):
        bw = float(b[-1] / t[-1])
    pred = alpha + b / bw
    return {
        "alpha_s": float(alpha),
        "bw_Bps": float(bw),
        "median_rel_error": round(float(np.median(np.abs(pred / t - 1))), 4),
    }
