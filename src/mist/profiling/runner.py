"""`run_profile`: measure the device this runs on and assemble a `GpuProfile` with its own
`links`, `dp_links` and `interference` sections.

Phases (each gets its share of what is left of the time budget; grids stop early and fill the
rest from measured neighbours when their share runs out):

    host overheads → GEMM grid → attention → memory-bound ops → copies → AdamW
    → in-process interference pairs → collectives over K processes (+ the {C, G2G} pair)
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import numpy as np

from mist.cpu_workers import setup_cpu_worker, threads_per_worker
from mist.hardware.attention import AttentionTable
from mist.hardware.collectives import OPS, assumed_links, load_links
from mist.hardware.datasheet import DATASHEET
from mist.hardware.dp_links import shipped_parts
from mist.hardware.gemm import GemmTable
from mist.hardware.gpu_names import profile_key
from mist.hardware.host import HostOverhead
from mist.hardware.interference import InterferenceModel, load_interference
from mist.hardware.memory_ops import MemoryOpModel
from mist.hardware.profile import GpuProfile
from mist.profiling import compute, overlap
from mist.profiling.comm import fit_links, fit_p2p, run_workers
from mist.profiling.compute import device_name
from mist.profiling.neighbours import Neighbours
from mist.profiling.timing import Budget, Device, warm_up
from mist.units import GiB, MiB

SHARES = {
    "host": 0.03,
    "gemm": 0.30,
    "attention": 0.12,
    "copies": 0.05,
    "memory_ops": 0.12,
    "adam": 0.03,
    "overlap": 0.08,
    "collectives": 0.27,
}


@dataclass
class Settings:
    """What to measure (grids and sizes); `settings_for` picks them from the device and budget."""

    gemm_axes: list
    attention: dict
    memory_sizes: list
    copy_bytes: int
    adam_params: int
    adam_host_params: int
    coll_sizes: list
    coll_target_s: float
    overlap_gemm: list
    overlap_copy_bytes: int
    overlap_ag_bytes: int
    overlap_target_s: float
    shares: dict = field(default_factory=lambda: dict(SHARES))


# The host AdamW of a GPU profile steps 128 Mi parameters: 2 GiB of fp32 state (parameter, gradient,
# two moments), well beyond any host's last-level cache, like the GiBs of offloaded optimizer state
# it prices. (At 16 Mi parameters, 256 MiB, an H200 machine's host measured 0.14 ns per parameter,
# 9× below the 1.25 ns measured there at 268 M: benchmarks/results/gpu_loop.md.) The quick grid
# steps a quarter of it.
HOST_ADAM_PARAMS = 128 * 2**20


def settings_for(kind: str, time_budget: float) -> Settings:
    """Grids for `kind` ("cpu" or "cuda"); budgets under 60 s get the quick (small) grids."""
    quick = time_budget < 60
    if kind == "cuda":
        if quick:
            return Settings(
                gemm_axes=[256, 512, 1024, 2048, 4096],
                attention={"b": [1, 2], "heads": [8, 16], "s": [512, 1024, 2048], "d": [64, 128]},
                memory_sizes=[16 * MiB, 64 * MiB, 256 * MiB],
                copy_bytes=256 * MiB,
                adam_params=16 * 2**20,
                adam_host_params=HOST_ADAM_PARAMS // 4,
                coll_sizes=[1 * MiB, 16 * MiB, 128 * MiB],
                coll_target_s=0.02,
                overlap_gemm=[4096, 4096, 4096],
                overlap_copy_bytes=64 * MiB,
                overlap_ag_bytes=64 * MiB,
                overlap_target_s=0.05,
            )
        return Settings(
            gemm_axes=[128, 256, 512, 1024, 2048, 4096, 8192, 16384],
            attention={"b": [1, 4], "heads": [8, 16, 32], "s": [512, 1024, 2048, 4096, 8192, 16384], "d": [64, 128]},
            memory_sizes=[16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB],
            copy_bytes=1 * GiB,
            adam_params=64 * 2**20,
            adam_host_params=HOST_ADAM_PARAMS,
            coll_sizes=[1 * MiB, 8 * MiB, 64 * MiB, 512 * MiB],
            coll_target_s=0.05,
            overlap_gemm=[8192, 8192, 8192],
            overlap_copy_bytes=256 * MiB,
            overlap_ag_bytes=256 * MiB,
            overlap_target_s=0.2,
        )
    if quick:
        return Settings(
            gemm_axes=[32, 64, 128, 256],
            attention={"b": [1, 2], "heads": [2, 4], "s": [64, 128], "d": [32, 64]},
            memory_sizes=[256 * 1024, 1 * MiB, 4 * MiB],
            copy_bytes=64 * MiB,
            adam_params=1 * 2**20,
            adam_host_params=1 * 2**20,
            coll_sizes=[64 * 1024, 1 * MiB, 4 * MiB],
            coll_target_s=0.02,
            overlap_gemm=[256, 256, 256],
            overlap_copy_bytes=4 * MiB,
            overlap_ag_bytes=1 * MiB,
            overlap_target_s=0.1,
        )
    return Settings(
        gemm_axes=[64, 128, 256, 512, 1024, 2048],
        attention={"b": [1, 2, 4], "heads": [2, 4, 8], "s": [128, 256, 512, 1024], "d": [32, 64]},
        memory_sizes=[1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB],
        copy_bytes=256 * MiB,
        adam_params=4 * 2**20,
        adam_host_params=4 * 2**20,
        coll_sizes=[64 * 1024, 512 * 1024, 4 * MiB, 16 * MiB],
        coll_target_s=0.05,
        overlap_gemm=[512, 512, 512],
        overlap_copy_bytes=16 * MiB,
        overlap_ag_bytes=4 * MiB,
        overlap_target_s=0.25,
    )


def default_name(kind: str) -> str:
    if kind == "cuda":
        import torch  # lazy: keeps torch out of `import mist.profiling`

        dev = device_name(Device("cuda"))
        return "cuda-" + "-".join(dev.lower().replace("_", " ").split()) if torch.cuda.is_available() else "cuda"
    return f"cpu-{socket.gethostname().split('.')[0].lower()}"


def known_gpu(device: str) -> str | None:
    """The datasheet/shipped key of a CUDA device name ("NVIDIA H200" → "h200"), or None."""
    key = profile_key(device)
    if key in DATASHEET:
        return key
    tokens = key.replace("-", " ").split()
    for k in DATASHEET:
        base = k.split("-")[0]
        if base in tokens:
            return k
    return None


def run_profile(
    device: str = "cpu",
    processes: int = 2,
    time_budget: float = 180.0,
    name: str | None = None,
    progress=None,
    dtype: str | None = None,
    settings: Settings | None = None,
):
    """Measure this machine's `device` and return a `GpuProfile` (not written; see `write_profile`).

    progress(fraction in [0, 1], message) is called as the phases advance."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    kind = device
    dev = Device(kind, dtype or ("bf16" if kind == "cuda" else "fp32"))
    st = settings or settings_for(kind, time_budget)
    budget = Budget(float(time_budget), dict(st.shares))
    phases = list(st.shares)
    report = progress or (lambda frac, msg: None)

    def ticker(phase):
        i = phases.index(phase)

        def tick(frac, msg=None):
            report(min(1.0, (i + min(max(frac, 0.0), 1.0)) / len(phases)), msg or phase)

        return tick

    threads = torch.get_num_threads()
    if kind == "cpu":  # one device of a K-process CPU run: ⌊cores / K⌋ threads, its heap settings
        setup_cpu_worker(threads_per_worker(processes))
    try:
        return _measure(kind, dev, st, budget, processes, report, ticker, name)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class ComputeMeasurements:
    """The single-process micro-benchmarks, each as its `mist.profiling.compute` function returns it."""

    host: dict  # measure_host: per-op host overheads and the backward()-call cost
    op_floor_s: float  # measure_op_floor: the smallest kernel's time
    gemm: dict  # measure_gemm: the F.linear grid
    attention: dict  # measure_attention: the attention grid
    copies: dict  # measure_copies: device, host-link and bidirectional copy rates
    memory_ops: dict  # measure_memory_ops: bandwidth per class and the fits
    # measure_pointwise: seconds per element-operation of each kind in Inductor's kernels, or why
    # Inductor could not compile them here (a str; fused kernels are then priced by their bytes)
    pointwise: dict | str
    adam: dict  # measure_adam: AdamW seconds per parameter on the device and the host


@dataclass(frozen=True)
class Measurements:
    """Everything one `run_profile` measured, which `assemble` turns into a `GpuProfile`."""

    settings: Settings
    device: Device
    processes: int
    compute: ComputeMeasurements
    overlap_local: dict  # overlap.measure_local_pairs: the in-process interference pairs
    capacity: tuple[int, str]  # memory bytes, and where that number comes from
    outside_allocator: tuple[int, str] | None  # device bytes outside PyTorch's allocator (GPU only)
    comm: dict | None  # comm.run_workers (None: collectives not measured)
    comm_error: str | None  # why the collective workers failed, if they did
    fingerprint: dict  # compute.fingerprint plus busy_neighbours and profile_seconds
    notes: tuple[str, ...]


def _measure(kind, dev, st, budget, processes, report, ticker, name):
    # on a CPU the compute tables are measured while the other K − 1 devices of the run are busy
    busy = Neighbours(processes - 1 if kind == "cpu" else 0, threads_per_worker(processes))
    ticker("host")(0.0, "host overheads" + (f" ({busy.count} busy neighbour process(es))" if busy.count else ""))
    with busy:
        tables = _measure_compute(kind, dev, st, budget, ticker)
    ticker("overlap")(0.0, "compute/copy interference")
    budget.phase_deadline("overlap")
    overlap_local = overlap.measure_local_pairs(dev, st.overlap_gemm, st.overlap_copy_bytes, st.overlap_target_s)
    capacity = compute.memory_capacity(dev)
    outside_allocator = compute.memory_outside_allocator(dev)
    comm, comm_error, notes = _measure_collectives(kind, dev, st, budget, processes, ticker("collectives"))
    fp = compute.fingerprint(dev, processes)
    fp["busy_neighbours"] = busy.count
    fp["profile_seconds"] = round(budget.elapsed() + budget.excluded_s, 1)
    fp["outside_budget_seconds"] = round(budget.excluded_s, 1)  # compiling the pointwise kernels
    report(1.0, "done")
    meas = Measurements(
        settings=st,
        device=dev,
        processes=processes,
        compute=tables,
        overlap_local=overlap_local,
        capacity=capacity,
        outside_allocator=outside_allocator,
        comm=comm,
        comm_error=comm_error,
        fingerprint=fp,
        notes=tuple(notes),
    )
    return assemble(meas, name or default_name(kind))


def _measure_compute(kind, dev, st, budget, ticker) -> ComputeMeasurements:
    """Host overheads, the GEMM and attention grids, copies, memory-bound ops and AdamW, each in
    its phase of the budget."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    budget.phase_deadline("host")
    warm_up(dev, min(2.0, 0.02 * budget.total_s))
    host = compute.measure_host(dev)
    op_floor_s = compute.measure_op_floor(dev)
    call = host["backward_call_s"]

    tick = ticker("gemm")
    tick(0.0, "GEMM grid")
    gemm = compute.measure_gemm(dev, st.gemm_axes, budget.phase_deadline("gemm"), lambda f: tick(f, "GEMM grid"))
    tick_a = ticker("attention")
    tick_a(0.0, "attention")
    attention = compute.measure_attention(
        dev, st.attention, call, budget.phase_deadline("attention"), lambda f: tick_a(f, "attention")
    )
    ticker("copies")(0.0, "copies")
    budget.phase_deadline("copies")
    copies = compute.measure_copies(dev, st.copy_bytes)
    tick_m = ticker("memory_ops")
    tick_m(0.0, "memory-bound ops")
    memory_ops = compute.measure_memory_ops(
        dev,
        st.memory_sizes,
        call,
        op_floor_s,
        copies["copy_Bps"],
        budget.phase_deadline("memory_ops"),
        lambda f: tick_m(f, "memory-bound ops"),
    )
    tick_m(1.0, "fused pointwise kernels (Inductor)")
    # (Inductor compiles each kind's kernel first: seconds, more with a cold cache, which no budget
    # could shorten; left out of the budget so that the phases after it keep their time)
    t0 = time.perf_counter()
    try:
        pointwise: dict | str = compute.measure_pointwise(dev)
    except Exception as exc:  # noqa: BLE001 - no working Inductor here: noted in the profile
        pointwise = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    budget.exclude(time.perf_counter() - t0)
    ticker("adam")(0.0, "AdamW")
    budget.phase_deadline("adam")
    # on a GPU machine: as one of its GPUs' ranks, all stepping on the host at once
    host_ranks = max(1, torch.cuda.device_count()) if kind == "cuda" else 1
    adam = compute.measure_adam(dev, st.adam_params, st.adam_host_params, host_ranks)
    return ComputeMeasurements(
        host=host,
        op_floor_s=op_floor_s,
        gemm=gemm,
        attention=attention,
        copies=copies,
        memory_ops=memory_ops,
        pointwise=pointwise,
        adam=adam,
    )


def _measure_collectives(kind, dev, st, budget, processes, tick) -> tuple[dict | None, str | None, list[str]]:
    """(measurements, error, notes) of the collectives and the {C, G2G} pair over worker processes."""
    import torch  # lazy: keeps torch out of `import mist.profiling`

    workers = processes
    notes = []
    if kind == "cuda" and processes > torch.cuda.device_count():
        workers = torch.cuda.device_count()
        notes.append(
            f"{processes} processes asked, {workers} GPU(s) visible: NCCL needs one GPU per "
            f"process, so collectives ran over {workers}"
        )
    if workers < 2:
        budget.phase_deadline("collectives")
        if kind == "cuda":
            notes.append("one GPU visible: collectives and the {C, G2G} pair were not measured")
        else:
            notes.append("one process: collectives and the {C, G2G} pair were not measured")
        return None, None, notes
    tick(0.0, f"collectives over {workers} processes (starting)")
    deadline = budget.phase_deadline("collectives")
    cfg = {
        "device": kind,
        "dtype": dev.dtype_name,
        "threads": threads_per_worker(workers) if kind == "cpu" else 4,
        "group_sizes": [n for n in (2, 4, 8, 16, 32) if n < workers],
        "sizes": st.coll_sizes,
        "target_s": st.coll_target_s,
        "deadline": time.time() + max(0.0, deadline - time.perf_counter()),
        "interference": {"gemm": st.overlap_gemm, "ag_bytes": st.overlap_ag_bytes, "target_s": st.overlap_target_s},
    }
    try:
        comm = run_workers(workers, cfg, lambda f, m: tick(f, m), timeout_s=max(120.0, 4 * budget.remaining() + 60))
    except RuntimeError as exc:
        notes.append(f"collectives not measured: {str(exc).splitlines()[0]}")
        return None, str(exc), notes
    return comm, None, notes


# ---------------------------------------------------------------------------- assembly
def assemble(meas: Measurements, name: str) -> GpuProfile:
    """A GpuProfile from the measurements of `run_profile`."""
    dev, fp, c = meas.device, meas.fingerprint, meas.compute
    kind = dev.kind
    where = f"{fp['device']} ({kind}, {dev.dtype_name}, torch {fp['torch'].split('+')[0]}, {fp['date'][:10]})"
    gemm, attention = _gemm_table(meas), _attention_table(meas)
    memory_ops, host_model = _memory_op_model(meas), _host_model(meas)
    known = known_gpu(fp["device"]) if kind == "cuda" else None
    capacity, cap_src = meas.capacity
    peak, peak_src, hbm, hbm_src = _peak_and_bandwidth(meas, known)
    links, dp_links, link_notes = _link_sections(meas, name, known, where)
    interference = _interference_section(meas, name, known, where)
    notes = list(meas.notes) + link_notes
    if isinstance(meas.compute.pointwise, str):
        notes.append(
            "fused pointwise kernels not measured (Inductor could not compile them: "
            f"{meas.compute.pointwise}); compiled blocks' fused kernels are priced by their bytes"
        )
    if kind == "cpu":
        notes.append(
            f"CPU profile: times measured in {dev.dtype_name} on the host; 'GPU' memory is available RAM; "
            "H2D/D2H are a host memcpy; plans should use the same dtype (training param_dtype and "
            "compute_dtype) for the times to apply"
        )
    cp, adam = c.copies, c.adam
    return GpuProfile(
        name=name,
        provenance=f"measured by mist profile on {where}",
        measured=True,
        memory_bytes=int(capacity),
        peak_flops=float(peak),
        hbm_bandwidth=float(hbm),
        h2d_bandwidth=float(cp["h2d_Bps"]),
        d2h_bandwidth=float(cp["d2h_Bps"]),
        bidir_bandwidth=float(cp["bidir_Bps"]),
        adam_gpu_s_per_param=float(adam["device_s_per_param"]),
        adam_cpu_s_per_param=float(adam["host_s_per_param"]),
        gemm=gemm,
        attention=attention,
        memory_ops=memory_ops,
        host=host_model,
        sources={
            "memory_bytes": cap_src,
            "peak_flops": peak_src,
            "hbm_bandwidth": hbm_src,
            "host_link": (
                f"measured: {cp['kind']}, {cp['bytes'] / MiB:.0f} MiB"
                + ("" if kind == "cuda" else " (no device link on a CPU: labelled stand-in)")
            ),
            "adam": (
                "measured: the runtime's AdamW step (mist.runtime.optimizer.adamw_) on the GPU and on "
                f"the host with {adam['host_threads']} thread(s), as one of {adam['host_ranks']} GPU ranks "
                "stepping on the host at once"
                if kind == "cuda"
                else "measured: the runtime's AdamW step (mist.runtime.optimizer.adamw_) on the CPU (device = host)"
            ),
            "gemm": gemm.source,
            "attention": attention.source,
            "memory_ops": "measured by mist profile (see memory_ops.sources)",
            "host": host_model.source,
            "links": links["provenance"],
            "dp_links": "; ".join(
                f"{k}: {v.get('provenance', '')}" for k, v in dp_links.items() if isinstance(v, dict)
            ),
            "interference": interference["provenance"],
            **({"outside_allocator_bytes": meas.outside_allocator[1]} if meas.outside_allocator else {}),
        },
        fingerprint=_profile_fingerprint(meas),
        notes=notes,
        links=links,
        dp_links=dp_links,
        interference=interference,
        host_memory_per_gpu=_host_ram_per_gpu() if kind == "cuda" else None,
        outside_allocator_bytes=meas.outside_allocator[0] if meas.outside_allocator else None,
    )


def _gemm_table(meas: Measurements) -> GemmTable:
    dev, g = meas.device, meas.compute.gemm
    plateau = g["best_flops"]
    ms, ns, ks = g["axes"]
    return GemmTable(
        ms,
        ns,
        ks,
        g["times_s"],
        g["floor_s"],
        meas.compute.copies["copy_Bps"],
        element_bytes=dev.element_bytes,
        source=(
            f"measured by mist profile: F.linear {dev.dtype_name} grid {len(ms)}x{len(ns)}x{len(ks)} "
            f"({ms[0]}..{ms[-1]}), {g['measured']} points timed, {len(g['filled'])} filled at their "
            f"lower neighbours' efficiency; best {plateau / 1e12:.3g} TFLOP/s"
        ),
        extra={"filled": g["filled"], "plateau_flops": plateau},
    )


def _attention_table(meas: Measurements) -> AttentionTable:
    dev, a = meas.device, meas.compute.attention
    ax = a["axes"]
    return AttentionTable(
        ax["b"],
        ax["heads"],
        ax["s"],
        ax["d"],
        a["fwd_s"],
        a["bwd_s"],
        a["fwd_floor_s"],
        a["bwd_floor_s"],
        source=(
            f"measured by mist profile: scaled_dot_product_attention(is_causal=True) "
            f"{dev.dtype_name} (PyTorch's default fused kernel, as the models call it), "
            f"{a['measured']} points timed, {len(a['filled'])} filled; backward = "
            "autograd.grad time"
            + (" minus the backward()-call cost" if dev.kind == "cpu" else " (back-to-back CUDA events)")
        ),
        extra={"filled": a["filled"], "backward_call_subtracted_s": meas.compute.host["backward_call_s"]},
    )


def _memory_op_model(meas: Measurements) -> MemoryOpModel:
    mo = meas.compute.memory_ops
    bw = dict(mo["bandwidth"])
    core = ("layernorm", "rmsnorm", "gelu", "swiglu", "dropout", "binary")
    bw["elementwise"] = {d: float(np.median([bw[c][d] for c in core])) for d in ("fwd", "bwd")}
    src = {
        c: f"measured by mist profile: {c} fwd/bwd at {len(meas.settings.memory_sizes)} sizes, "
        f"t = floor + io_bytes / bw (aten-level bytes, {meas.device.dtype_name}; fit errors in "
        "fingerprint.memory_op_fits)"
        for c in mo["bandwidth"]
    }
    src["binary"] = "measured by mist profile: elementwise multiply fwd (3T) and its backward (two multiplies, 6T)"
    src["copy"] = "measured by mist profile: clone (read + write); backward = forward (no backward kernel)"
    src["elementwise"] = "generic fallback: median of the measured layernorm/rmsnorm/gelu/swiglu/dropout/binary classes"
    src["pointwise_s"] = (
        "measured by mist profile: Inductor-compiled chains of each kind over one tensor, seconds per "
        "element-operation (compiled blocks' fused kernels)"
    )
    pw = meas.compute.pointwise
    if isinstance(pw, str):
        src.pop("pointwise_s")
    return MemoryOpModel(
        bandwidth=bw,
        floor_s=meas.compute.op_floor_s,
        sources=src,
        pointwise_s=None if isinstance(pw, str) else dict(pw),
    )


def _host_model(meas: Measurements) -> HostOverhead:
    host = meas.compute.host
    return HostOverhead(
        fwd_op_s=host["fwd_op_s"],
        bwd_op_s=host["bwd_op_s"],
        backward_call_s=host["backward_call_s"],
        source=(
            "measured by mist profile: median per-op time of loops of tiny add/mul/gelu/layer_norm with "
            "autograd recording; autograd.grad over chains of 1..64 tiny ops fitted as E + n*h_bwd"
            + (
                "; on a CPU the host runs the kernels itself, so kernel times include dispatch and "
                "stream_time reduces to their serial sum"
                if meas.device.kind == "cpu"
                else ""
            )
        ),
    )


def _peak_and_bandwidth(meas: Measurements, known: str | None) -> tuple:
    """(peak FLOP/s, its source, memory bandwidth, its source): a known GPU's datasheet, else measured."""
    dev = meas.device
    copy_bw = meas.compute.copies["copy_Bps"]
    if dev.kind == "cuda" and known:
        label = DATASHEET[known]["label"]
        return (
            DATASHEET[known]["peak_flops"],
            f"datasheet: {label} dense bf16/fp16",
            DATASHEET[known]["hbm"],
            f"datasheet: {label} (measured device copy {copy_bw / 1e12:.2f} TB/s read+write)",
        )
    hbm_src = (
        "measured: host memcpy read+write bandwidth (CPU run)"
        if dev.kind == "cpu"
        else "measured: device-to-device copy, read+write"
    )
    return (
        meas.compute.gemm["best_flops"],
        f"measured: best GEMM rate of the grid ({dev.dtype_name})",
        copy_bw,
        hbm_src,
    )


def _profile_fingerprint(meas: Measurements) -> dict:
    """The run's fingerprint with the measurement details a profile keeps beside its tables."""
    c = meas.compute
    fp = dict(meas.fingerprint)
    fp["copy_bandwidth"] = c.copies["copy_Bps"]
    fp["copies"] = {k: v for k, v in c.copies.items()}
    fp["host_detail"] = {"per_op_fwd_s": c.host["per_op_fwd_s"], "backward_chain": c.host["backward_chain"]}
    fp["memory_op_fits"] = c.memory_ops["fits"]
    return fp


def _host_ram_per_gpu() -> float | None:
    """This machine's RAM over its visible GPUs: the host-memory share of one GPU (on a CPU profile
    the host is the device, and its RAM is the profile's capacity already)."""
    import os

    import torch  # lazy: keeps torch out of `import mist.profiling`

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return ram / max(1, torch.cuda.device_count())


def _link_sections(meas: Measurements, name: str, known: str | None, where: str):
    """(links, dp_links, notes): fitted from the worker measurements; otherwise borrowed from the
    shipped files of a known GPU, or assumed from the copy rates — always labelled."""
    dev = meas.device
    comm = meas.comm
    notes = []
    cp = meas.compute.copies
    if comm is not None:
        fits, errors = fit_links(comm["collectives"])
        sizes = sorted(int(n) for op in fits for n in fits[op])
        links = {
            "gpu": name,
            "provenance": (
                f"measured by mist profile: {comm['backend']} all_reduce/all_gather/"
                f"reduce_scatter over {comm['world']} processes on {where}, ring "
                "alpha-busbw fit" + ("; larger groups use the largest measured group's fit" if sizes else "")
            ),
            "fits": fits,
            "median_rel_error": errors,
        }
        if comm.get("sync_s") is not None:
            links["sync_s"] = float(comm["sync_s"])
            links["provenance"] += f"; sync_s: {comm['sync_how']}"
        p2p = fit_p2p(comm["p2p"])
        p2p["provenance"] = f"measured by mist profile: {comm['backend']} send/recv ping-pong between 2 processes"
        largest = str(max(int(n) for n in fits.get("all_gather", {str(comm["world"]): 0})))
        ag_alpha, ag_bw = fits.get("all_gather", {}).get(largest, [p2p["alpha_s"], p2p["bw_Bps"]])
        if dev.kind == "cpu":
            internode = {
                "alpha_s": float(max(ag_alpha, p2p["alpha_s"])),
                "nic_Bps_per_node": float(p2p["bw_Bps"]),
                "provenance": (
                    "assumed: another machine reached at this machine's measured loopback gloo "
                    "send/recv rate (a CPU 'node' is this machine; cross-node not measured)"
                ),
            }
        else:
            internode = _cuda_internode(known)
        dp_links = {"internode": internode, "p2p_intra": p2p}
        return links, dp_links, notes
    if known and load_links(known) is not None:
        lm = load_links(known)
        links = {
            "gpu": name,
            "provenance": f"borrowed (not measured here): shipped {known} link model — {lm.provenance}",
            "fits": lm.fits,
        }
        parts = shipped_parts(known)
        dp_links = {}
        for part in ("internode", "p2p_intra", "p2p_inter", "intra_allgather"):
            if part in parts:
                v = dict(parts[part])
                v["provenance"] = f"borrowed from shipped {known}: {v.get('provenance', '')}"
                dp_links[part] = v
        notes.append(f"links/dp_links borrowed from the shipped {known} models (collectives not measured)")
        return links, dp_links, notes
    # assumed from the measured copy rates: labelled, so that TP/DP plans still simulate
    assumed = assumed_links()  # links/_assumed.json
    if dev.kind == "cpu":
        part = assumed["cpu"]
        alpha, bw = part["alpha_s"], cp["copy_Bps"] / part["copy_rate_divisor"]
    else:
        part = assumed["cuda"]
        alpha, bw = part["alpha_s"], cp["h2d_Bps"]
    why = part["provenance"]
    links = {
        "gpu": name,
        "provenance": why,
        "fits": {op: {str(n): [alpha, bw] for n in assumed["group_sizes"]} for op in OPS},
    }
    dp_links = {
        "p2p_intra": {"alpha_s": alpha, "bw_Bps": bw, "provenance": why},
        "internode": (
            _cuda_internode(known)
            if dev.kind == "cuda"
            else {"alpha_s": alpha, "nic_Bps_per_node": bw, "provenance": why}
        ),
    }
    notes.append("links/dp_links assumed from the copy rates (collectives not measured)")
    return links, dp_links, notes


def _cuda_internode(known: str | None) -> dict:
    if known:
        part = shipped_parts(known).get("internode")
        if part:
            return dict(
                part,
                provenance=f"borrowed from shipped {known} (a single machine cannot measure the "
                f"network): {part.get('provenance', '')}",
            )
    part = assumed_links()["cuda_internode"]  # links/_assumed.json
    return {k: part[k] for k in ("alpha_s", "nic_Bps_per_node", "provenance")}


def _interference_section(meas: Measurements, name: str, known: str | None, where: str) -> dict:
    local = meas.overlap_local
    factors = {k: v["factors"] for k, v in local.items() if k != "how"}
    detail = {k: {kk: vv for kk, vv in v.items() if kk != "factors"} for k, v in local.items() if k != "how"}
    measured = ["{C,C2G}", "{C,G2C}", "{C2G,G2C}"]
    extra_src = ""
    comm = meas.comm
    if comm is not None and comm.get("interference"):
        factors["C+G2G"] = comm["interference"]["factors"]
        detail["C+G2G"] = {k: v for k, v in comm["interference"].items() if k != "factors"}
        measured.append("{C,G2G}")
    elif known:
        shipped = load_interference(known).factors
        for key in ("C+G2G", "G2G+C2G", "G2G+G2C"):
            factors[key] = shipped[key]
        extra_src = f"; {{C,G2G}}, {{G2G,C2G}}, {{G2G,G2C}} borrowed from the shipped {known} model (not measured here)"
    prov = (
        f"measured by mist profile on {where}: pairs {', '.join(measured)} ({local['how']}){extra_src}; "
        "all other channel sets serial sum (f_A[c] = |A|, not measured)"
    )
    model = InterferenceModel(factors, prov, name, extra={"pairs": detail})
    return model.to_json()


def write_profile(profile, output) -> str:
    """Save with `GpuProfile.save`; returns the path written."""
    return str(profile.save(output))


def measured_gemm_points(profile, count: int) -> list[tuple[int, int, int]]:
    """Measured grid nodes of a profile's GEMM table from the top quarter of its work range (largest
    first), for re-checks: small kernels are the noisiest to re-time."""
    g = profile.gemm
    pts = [(int(m), int(n), int(k)) for m in g.m_axis for n in g.n_axis for k in g.k_axis]
    filled = {tuple(int(v) for v in p) for p in g.extra.get("filled", [])}
    pts = [p for p in pts if p not in filled]
    pts.sort(key=lambda p: p[0] * p[1] * p[2])
    if not pts:
        return []
    idx = np.unique(np.linspace(3 * len(pts) // 4, len(pts) - 1, count).round().astype(int))
    return [pts[i] for i in idx[::-1]]
