"""The worker side of `mist.profiling.comm`: what each of the K spawned processes runs.

Every rank makes the same calls in the same order; the decisions that depend on time
(repetitions, stopping at the deadline) are made on rank 0 and broadcast. In order: the
collectives of the full group, send/recv ping-pong between ranks 0 and 1, the synchronization
cost of a collective issued right after compute and the {C, G2G} interference pair (both whatever
the budget left: every tensor-parallel collective's price adds the one, the overlap model needs
the other), then the collectives of the smaller groups while time is left. Rank 0 returns the
measurements and sends progress to the parent through the queue. Only the worker processes import this module (it
imports torch); `comm.run_workers` starts them.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mist.cpu_workers import setup_cpu_worker
from mist.hardware.collectives import OPS
from mist.models.dtypes import torch_dtype
from mist.profiling.overlap import concurrent, factors_from_finish

SYNC_BURST_S = 0.05  # compute before each timed collective of the synchronization cost
SYNC_REPS = 20

# torch 2.13 renamed the flat collectives (the old names warn); older releases only have those
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Rank:
    """This process in the group: its device and dtype, and the timing steps all ranks take together."""

    def __init__(self, rank: int, world: int, init_file: str, cfg: dict, q):
        self.rank, self.world, self.q = rank, world, q
        self.cuda = cfg["device"] == "cuda"
        if self.cuda:
            torch.set_num_threads(int(cfg["threads"]))
            torch.cuda.set_device(rank)
            self.dev = torch.device("cuda", rank)
        else:
            setup_cpu_worker(int(cfg["threads"]))  # as `mist train` runs its CPU ranks
            self.dev = torch.device("cpu")
        self.dtype = torch_dtype(cfg["dtype"])
        self.esize = torch.tensor([], dtype=self.dtype).element_size()
        self.deadline = float(cfg["deadline"])  # time.time() based (shared by the processes)
        self.steps, self.step = 1, 0  # progress: steps done of `steps`
        kw: dict = {"device_id": self.dev} if self.cuda else {}
        dist.init_process_group(
            "nccl" if self.cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, **kw
        )

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def bcast(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64 if not self.cuda else torch.float32, device=self.dev)
        dist.broadcast(t, 0)
        return float(t.item())

    def time_left(self) -> bool:
        """Whether rank 0 is still before the deadline (every rank gets its answer)."""
        return bool(self.bcast(time.time() < self.deadline))

    def measure(self, fn, members, target: float) -> float:
        """Rank 0's seconds per call of fn (run by `members` only; every rank calls this)."""
        inside = self.rank in members
        one = 0.0
        if inside:
            fn()
            fn()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            one = time.perf_counter() - t0
        reps = int(self.bcast(np.clip(target / max(one, 1e-6), 2, 200)))
        dist.barrier()
        per = 0.0
        if inside:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            self.sync()
            per = (time.perf_counter() - t0) / reps
        dist.barrier()
        return per

    def advance(self, msg: str | None = None) -> None:
        """One step of the run done; rank 0 reports the progress when `msg` names it."""
        self.step += 1
        if msg is not None and self.rank == 0:
            self.q.put(("progress", float(self.step / self.steps), msg))


def run(rank: int, world: int, init_file: str, cfg: dict, q) -> dict:  # pragma: no cover - subprocess
    """Every measurement of one worker; rank 0's is the result (see the module docstring)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    me = Rank(rank, world, init_file, cfg, q)
    target = float(cfg["target_s"])
    sizes = [int(s) for s in cfg["sizes"]]
    groups = {world: None}
    for n in cfg["group_sizes"]:  # every rank creates every group
        if n < world:
            groups[n] = dist.new_group(list(range(n)))
    ops = tuple(cfg.get("ops", OPS))
    order = [world] + sorted((n for n in groups if n < world), reverse=True)
    me.steps = len(order) * len(ops) + 2
    result: dict = {
        "collectives": {op: {} for op in ops},
        "p2p": [],
        "interference": None,
        "world": world,
        "backend": "nccl" if me.cuda else "gloo",
        "skipped": [],
    }
    _collectives(me, world, groups[world], ops, sizes, target, result)
    result["p2p"] = _p2p(me, sizes if cfg.get("p2p", True) else [], target)
    me.advance("send/recv")
    if cfg.get("sync", True):  # (whatever the budget left: see the module docstring)
        result["sync_s"], result["sync_how"] = _sync_cost(me, target)
    inter = cfg.get("interference")
    if inter:  # always: the profile's overlap model needs this pair, whatever the budget left
        result["interference"] = _interference(me, inter)
    me.advance("compute vs all-gather")
    for n in order[1:]:
        _collectives(me, n, groups[n], ops, sizes, target, result)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _collectives(me: Rank, n: int, group, ops, sizes: list[int], target: float, result: dict) -> None:
    """Each op over the first n ranks at every size (a smaller group only while time is left)."""
    members = set(range(n))
    for op in ops:
        if n != me.world and not me.time_left():
            result["skipped"].append(f"{op}/{n}")
            me.advance()
            continue
        rows = []
        for nbytes in sizes:
            count = max(n, nbytes // me.esize // n * n)
            full = torch.zeros(count, dtype=me.dtype, device=me.dev)
            part = torch.zeros(count // n, dtype=me.dtype, device=me.dev)
            rows.append([count * me.esize, me.measure(_call(op, full, part, group), members, target)])
        result["collectives"][op][str(n)] = rows
        me.advance(f"{op} over {n} processes")


def _call(op: str, full, part, group):
    """One call of `op` on the flat buffers: all_reduce of `full`, all_gather of `part` into
    `full`, reduce_scatter of `full` into `part`."""
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: all_gather_flat(full, part, group=group)
    return lambda: reduce_scatter_flat(part, full, group=group)


def _p2p(me: Rank, sizes: list[int], target: float) -> list:
    """[bytes, one-way seconds] of send/recv ping-pong between ranks 0 and 1 at each size."""
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // me.esize), dtype=me.dtype, device=me.dev)

        def pingpong(buf=buf):
            if me.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif me.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        rtt = me.measure(pingpong, {0, 1}, target)
        rows.append([buf.numel() * me.esize, rtt / 2])
    return rows


def _sync_cost(me: Rank, target: float) -> tuple[float, str]:
    """A collective issued right after compute waits for the last rank to arrive (and for a
    blocked process to wake up): its mean extra over back-to-back calls, and how it was measured."""
    world = me.world
    xs = torch.randn(256, 512, device=me.dev).to(me.dtype)
    ws = torch.randn(512, 512, device=me.dev).to(me.dtype)
    tiny = torch.zeros(world, dtype=me.dtype, device=me.dev)

    def burst(n):
        with torch.no_grad():
            for _ in range(n):
                F.linear(xs, ws)
        me.sync()

    t0 = time.perf_counter()
    burst(2)
    n_burst = int(me.bcast(np.clip(SYNC_BURST_S / max((time.perf_counter() - t0) / 2, 1e-7), 1, 100000)))
    back_to_back = me.measure(lambda: dist.all_reduce(tiny), set(range(world)), target)
    waits = []
    for i in range(SYNC_REPS + 2):
        dist.barrier()
        burst(n_burst)
        t1 = time.perf_counter()
        dist.all_reduce(tiny)
        me.sync()
        if i >= 2:
            waits.append(time.perf_counter() - t1)
    mean = torch.tensor([float(np.mean(waits))], dtype=torch.float64 if not me.cuda else torch.float32, device=me.dev)
    dist.all_reduce(mean)
    how = (
        f"all_reduce of {world} elements after a {SYNC_BURST_S * 1e3:.0f} ms GEMM burst in every "
        f"process, mean over {SYNC_REPS} calls and the processes, less its back-to-back time"
    )
    return max(0.0, float(mean.item()) / world - back_to_back), how


def _loop(me: Rank, fn, n_calls: int, stream):
    """A function running fn n_calls times (on CUDA on `stream`, then waiting for it)."""

    def run_loop():
        if me.cuda:
            with torch.cuda.stream(stream):
                for _ in range(n_calls):
                    fn()
            stream.synchronize()
        else:
            for _ in range(n_calls):
                fn()

    return run_loop


def _interference(me: Rank, inter: dict) -> dict:
    """{C, G2G}: a GEMM loop in each process while another thread of it runs an all-gather loop."""
    world = me.world
    m, n, k = inter["gemm"]
    x = torch.randn(m, k, device=me.dev).to(me.dtype)
    w = torch.randn(n, k, device=me.dev).to(me.dtype)
    count = max(world, int(inter["ag_bytes"]) // me.esize // world * world)
    full = torch.zeros(count, dtype=me.dtype, device=me.dev)
    part = torch.zeros(count // world, dtype=me.dtype, device=me.dev)
    comp_stream = torch.cuda.Stream() if me.cuda else None
    comm_stream = torch.cuda.Stream() if me.cuda else None

    def gemm():
        with torch.no_grad():
            F.linear(x, w)

    def gather():
        all_gather_flat(full, part)

    t_g = me.measure(gemm, set(range(world)), 0.05)
    t_a = me.measure(gather, set(range(world)), 0.05)
    n_g = int(me.bcast(np.clip(inter["target_s"] / max(t_g, 1e-7), 1, 100000)))
    n_a = int(me.bcast(np.clip(inter["target_s"] / max(t_a, 1e-7), 1, 100000)))
    run_c, run_g = _loop(me, gemm, n_g, comp_stream), _loop(me, gather, n_a, comm_stream)
    alone: dict[str, list[float]] = {"C": [], "G2G": []}
    for _ in range(2):
        for key, run_loop in (("C", run_c), ("G2G", run_g)):
            dist.barrier()
            t0 = time.perf_counter()
            run_loop()
            alone[key].append(time.perf_counter() - t0)
    ec, eg = concurrent(run_c, run_g, 2, before=dist.barrier)
    xc, xg = float(np.median(alone["C"])), float(np.median(alone["G2G"]))
    fc, fg = factors_from_finish(xc, xg, ec, eg)
    return {
        "factors": [fc, fg],
        "alone_s": [xc, xg],
        "together_s": [ec, eg],
        "gemm": [m, n, k],
        "all_gather_bytes": count * me.esize,
        "how": (
            "GEMM loop in each process while another thread of it runs an "
            "all-gather loop over all processes"
            + (" on its own CUDA stream" if me.cuda else "")
            + "; finish-time method"
        ),
    }
