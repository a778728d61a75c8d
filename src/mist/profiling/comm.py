"""Collectives over K worker processes (gloo on CPU, NCCL on CUDA, one GPU per process).

`run_workers` spawns K processes that run one fixed script (every rank the same calls, so the
decisions that depend on time — repetitions, stopping at the deadline — are made on rank 0 and
broadcast). The script measures, in order:

1. all_reduce, all_gather, reduce_scatter of the full group at a few sizes;
2. p2p ping-pong between ranks 0 and 1 (one way = round trip / 2);
3. the {C, G2G} interference pair: a GEMM loop while another thread of the same process runs an
   all-gather loop (on CUDA on its own stream), finish-time method (`profiling.overlap`);
4. the collectives of smaller power-of-two groups, while time is left.

Rank 0 sends progress and the results to the parent through a queue. `fit_links` turns the
times into the LinkModel alpha–busbw fits (t = alpha + ring_factor · bytes / busbw).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time

import numpy as np

from mist.profiling.overlap import concurrent

OPS = ("all_reduce", "all_gather", "reduce_scatter")
SYNC_BURST_S = 0.05   # compute before each timed collective of the synchronization cost
SYNC_REPS = 20


# ---------------------------------------------------------------------------- worker side
def _worker(rank: int, world: int, init_file: str, cfg: dict, q) -> None:  # pragma: no cover - subprocess
    try:
        result = _script(rank, world, init_file, cfg, q)
        q.put(("result", result) if rank == 0 else ("done", rank))
    except Exception as exc:  # report, never hang the parent
        import traceback

        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))


def _script(rank, world, init_file, cfg, q):  # pragma: no cover - subprocess
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mist.profiling.overlap import factors_from_finish

    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.set_num_threads(int(cfg["threads"]))
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        from mist.cpu_workers import setup_cpu_worker

        setup_cpu_worker(int(cfg["threads"]))   # as `mist train` runs its CPU ranks
        dev = torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dtype"]]
    esize = torch.tensor([], dtype=dtype).element_size()
    kw = {"device_id": dev} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **kw)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def bcast(value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64 if not cuda else torch.float32, device=dev)
        dist.broadcast(t, 0)
        return float(t.item())

    def measure(fn, members, target):
        """Rank 0's seconds per call of fn (run by `members` only; every rank calls this)."""
        inside = rank in members
        one = 0.0
        if inside:
            fn()
            fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            one = time.perf_counter() - t0
        reps = int(bcast(np.clip(target / max(one, 1e-6), 2, 200)))
        dist.barrier()
        per = 0.0
        if inside:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            per = (time.perf_counter() - t0) / reps
        dist.barrier()
        return per

    def progress(frac, msg):
        if rank == 0:
            q.put(("progress", float(frac), msg))

    deadline = float(cfg["deadline"])  # time.time() based (shared by the processes)
    target = float(cfg["target_s"])
    sizes = [int(s) for s in cfg["sizes"]]
    groups = {world: None}
    for n in cfg["group_sizes"]:  # every rank creates every group
        if n < world:
            groups[n] = dist.new_group(list(range(n)))
    ops = tuple(cfg.get("ops", OPS))
    colls = {op: {} for op in ops}
    order = [world] + sorted((n for n in groups if n < world), reverse=True)
    steps = len(order) * len(ops) + 2
    step = 0
    result = {"collectives": colls, "p2p": [], "interference": None, "world": world,
              "backend": "nccl" if cuda else "gloo", "skipped": []}

    def collectives(n):
        nonlocal step
        group = groups[n]
        members = set(range(n))
        for op in ops:
            if n != world and not bcast(time.time() < deadline):
                result["skipped"].append(f"{op}/{n}")
                step += 1
                continue
            rows = []
            for nbytes in sizes:
                count = max(n, nbytes // esize // n * n)
                full = torch.zeros(count, dtype=dtype, device=dev)
                part = torch.zeros(count // n, dtype=dtype, device=dev)
                if op == "all_reduce":
                    fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
                elif op == "all_gather":
                    fn = lambda: ag(full, part, group=group)  # noqa: E731
                else:
                    fn = lambda: rs(part, full, group=group)  # noqa: E731
                rows.append([count * esize, measure(fn, members, target)])
            colls[op][str(n)] = rows
            step += 1
            progress(step / steps, f"{op} over {n} processes")

    collectives(world)

    # ---- p2p ping-pong between ranks 0 and 1
    for nbytes in (sizes if cfg.get("p2p", True) else []):
        buf = torch.zeros(max(1, nbytes // esize), dtype=dtype, device=dev)

        def pingpong(buf=buf):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        rtt = measure(pingpong, {0, 1}, target)
        result["p2p"].append([buf.numel() * esize, rtt / 2])
    step += 1
    progress(step / steps, "send/recv")

    # ---- synchronization: a collective issued right after compute waits for the last rank to
    # arrive (and for a blocked process to wake up); its mean extra over back-to-back calls
    if cfg.get("sync", True) and bcast(time.time() < deadline):
        xs = torch.randn(256, 512, device=dev).to(dtype)
        ws = torch.randn(512, 512, device=dev).to(dtype)
        tiny = torch.zeros(world, dtype=dtype, device=dev)

        def burst(n):
            with torch.no_grad():
                for _ in range(n):
                    F.linear(xs, ws)
            sync()

        t0 = time.perf_counter()
        burst(2)
        n_burst = int(bcast(np.clip(SYNC_BURST_S / max((time.perf_counter() - t0) / 2, 1e-7), 1, 100000)))
        back_to_back = measure(lambda: dist.all_reduce(tiny), set(range(world)), target)
        waits = []
        for i in range(SYNC_REPS + 2):
            dist.barrier()
            burst(n_burst)
            t1 = time.perf_counter()
            dist.all_reduce(tiny)
            sync()
            if i >= 2:
                waits.append(time.perf_counter() - t1)
        mean = torch.tensor([float(np.mean(waits))], dtype=torch.float64 if not cuda else torch.float32, device=dev)
        dist.all_reduce(mean)
        result["sync_s"] = max(0.0, float(mean.item()) / world - back_to_back)
        result["sync_how"] = (f"all_reduce of {world} elements after a {SYNC_BURST_S * 1e3:.0f} ms GEMM burst in every "
                              f"process, mean over {SYNC_REPS} calls and the processes, less its back-to-back time")

    # ---- {C, G2G}: GEMM loop vs all-gather loop in another thread of each process
    inter = cfg.get("interference")
    if inter and bcast(time.time() < deadline):
        m, n, k = inter["gemm"]
        x = torch.randn(m, k, device=dev).to(dtype)
        w = torch.randn(n, k, device=dev).to(dtype)
        count = max(world, int(inter["ag_bytes"]) // esize // world * world)
        full = torch.zeros(count, dtype=dtype, device=dev)
        part = torch.zeros(count // world, dtype=dtype, device=dev)
        comp_stream = torch.cuda.Stream() if cuda else None
        comm_stream = torch.cuda.Stream() if cuda else None

        def gemm():
            with torch.no_grad():
                F.linear(x, w)

        def gather():
            ag(full, part)

        def loop(fn, n_calls, stream):
            def run():
                if cuda:
                    with torch.cuda.stream(stream):
                        for _ in range(n_calls):
                            fn()
                    stream.synchronize()
                else:
                    for _ in range(n_calls):
                        fn()
            return run

        t_g = measure(gemm, set(range(world)), 0.05)
        t_a = measure(gather, set(range(world)), 0.05)
        n_g = int(bcast(np.clip(inter["target_s"] / max(t_g, 1e-7), 1, 100000)))
        n_a = int(bcast(np.clip(inter["target_s"] / max(t_a, 1e-7), 1, 100000)))
        run_c, run_g = loop(gemm, n_g, comp_stream), loop(gather, n_a, comm_stream)
        alone = {"C": [], "G2G": []}
        for _ in range(2):
            for key, run in (("C", run_c), ("G2G", run_g)):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                alone[key].append(time.perf_counter() - t0)
        ec, eg = concurrent(run_c, run_g, 2, before=dist.barrier)
        xc, xg = float(np.median(alone["C"])), float(np.median(alone["G2G"]))
        fc, fg = factors_from_finish(xc, xg, ec, eg)
        result["interference"] = {"factors": [fc, fg], "alone_s": [xc, xg], "together_s": [ec, eg],
                                  "gemm": [m, n, k], "all_gather_bytes": count * esize,
                                  "how": ("GEMM loop in each process while another thread of it runs an "
                                          "all-gather loop over all processes" + (" on its own CUDA stream" if cuda else "")
                                          + "; finish-time method")}
    step += 1
    progress(step / steps, "compute vs all-gather")

    for n in order[1:]:
        collectives(n)
    dist.barrier()
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------- parent side
def run_workers(processes: int, cfg: dict, progress=None, timeout_s: float = 600.0) -> dict:
    """Spawn `processes` workers running the script above; returns rank 0's results.
    RuntimeError when a worker fails or the run exceeds `timeout_s`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="mist-profile-pg-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    procs = [ctx.Process(target=_worker, args=(r, processes, init_file, cfg, q), daemon=True)
             for r in range(processes)]
    for p in procs:
        p.start()
    result, error = None, None
    end = time.perf_counter() + timeout_s
    try:
        while result is None and error is None:
            if time.perf_counter() > end:
                error = f"collective measurements exceeded {timeout_s:.0f} s"
                break
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = f"worker process exited with code {dead[0].exitcode}"
                continue
            if msg[0] == "progress" and progress:
                progress(msg[1], msg[2])
            elif msg[0] == "result":
                result = msg[1]
            elif msg[0] == "error":
                error = msg[1]
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
    from mist.hardware.build.common import fit_floor_plus_rate
    from mist.hardware.collectives import ring_factor

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
    from mist.hardware.build.common import fit_floor_plus_rate

    b = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    bw, alpha = fit_floor_plus_rate(b, t)
    if not np.isfinite(bw):
        bw = float(b[-1] / t[-1])
    pred = alpha + b / bw
    return {"alpha_s": float(alpha), "bw_Bps": float(bw),
            "median_rel_error": round(float(np.median(np.abs(pred / t - 1))), 4)}
