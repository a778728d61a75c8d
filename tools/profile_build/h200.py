"""Build the measured H200 profile from DATA/gpus/h200/*.json (DATA/README.md §2).

GEMM: the 7×9×9 grid as measured, the 10 missing large points filled at the efficiency of their
existing lower neighbours. Attention: the flash table, backward minus the per-backward()-call
engine cost. Memory-bound ops: effective bandwidth per class and direction, fitted on the
bandwidth-bound (≥128 MiB) rows against the aten-level bytes each module moves (table `IO_BYTES`).
Host overheads: calibrated on the host-bound small-shape rows (see `calibrate_host`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mist.hardware.attention import AttentionTable
from mist.hardware.gemm import GemmTable
from mist.hardware.host import HostOverhead
from mist.hardware.memory_ops import CLASSES, MemoryOpModel
from mist.hardware.profile import GpuProfile
from profile_build.common import (
    DATASHEET,
    MEMORY_OP_FLOOR_S,
    fit_floor_plus_rate,
    fmt_rate,
    read_json,
)

MS = 1e-3

#: Bytes read + written at the aten-op boundary by each measured module, in units of
#: T = one bf16 [m, h] tensor (the file's `bytes_io`), (forward, backward):
#:   layernorm/rmsnorm  fwd: x → y (+ fp32 mean/rstd)         bwd: dy, x → dx (+ dγ, dβ)
#:   gelu               fwd: x → y                             bwd: gelu_backward(dy, x) → dx
#:   swiglu (x: width h → h/2): fwd silu(x1) [T] + mul [1.5T]
#:                      bwd 2×mul [3T] + silu_backward [1.5T] + 2×slice_backward [3T] + add [3T]
#:   dropout            fwd: x → y, bool mask [0.5T]          bwd: dy, mask → dx
#:   residual_add       fwd: x, r → y (3T; the measured time only supports 2 passes, so the
#:                      fitted bandwidth exceeds a copy and is capped, see `build_memory_ops`)
#:                      bwd: no compute op; the measured pass is one copy-like read + write (2T)
IO_BYTES = {
    "layernorm": (2.0, 3.0),
    "rmsnorm": (2.0, 3.0),
    "gelu": (2.0, 3.0),
    "swiglu_act": (2.5, 10.5),
    "dropout": (2.5, 2.5),
    "residual_add": (3.0, 2.0),
}
#: cross-entropy over bf16 logits [m, V] (bytes per m·V element):
#:   fwd: .float() 2+4, _log_softmax 4+4, nll_loss_forward reads the 4-byte input  → 18
#:   bwd: nll_loss_backward 4+4, _log_softmax_backward_data 4+4+4, cast back 4+2   → 26
CE_BYTES = (18.0, 26.0)

#: Number of aten ops each measured module issues forward / backward (host calibration).
HOST_OPS = {
    "layernorm": (1, 1),
    "rmsnorm": (1, 1),
    "gelu": (1, 1),
    "swiglu_act": (2, 6),
    "dropout": (1, 1),
    "residual_add": (1, 1),
}

LARGE_BYTES = 128 * 2**20  # rows with T >= this are bandwidth-bound (checked: time ∝ bytes)
SMALL_BYTES = 16 * 2**20  # rows with T <= this are host-bound


def _rows(data: Path, name: str) -> list[dict]:
    return read_json(data / "gpus" / "h200" / f"{name}.json")["rows"]


# ---------------------------------------------------------------------------- GEMM
def build_gemm(data: Path, copy_bw: float) -> GemmTable:
    rows = _rows(data, "gemm")
    ms = sorted({r["m"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    ks = sorted({r["k"] for r in rows})
    t = np.full((len(ms), len(ns), len(ks)), np.nan)
    for r in rows:
        t[ms.index(r["m"]), ns.index(r["n"]), ks.index(r["k"])] = r["ms"] * MS
    flops = 2.0 * np.array(ms)[:, None, None] * np.array(ns)[None, :, None] * np.array(ks)[None, None, :]
    missing = [tuple(i) for i in np.argwhere(np.isnan(t))]
    # fill in order of work so that filled points can serve as neighbours of larger ones
    for idx in sorted(missing, key=lambda i: flops[i]):
        rates = []
        for ax in range(3):
            nb = list(idx)
            nb[ax] -= 1
            if nb[ax] >= 0 and np.isfinite(t[tuple(nb)]):
                rates.append(flops[tuple(nb)] / t[tuple(nb)])
        t[idx] = flops[idx] / np.exp(np.mean(np.log(rates)))
    floor = float(np.median(t[flops < 2**31]))
    large = flops >= 2**40
    plateau = float(np.median(flops[large] / t[large]))
    return GemmTable(
        m_axis=ms,
        n_axis=ns,
        k_axis=ks,
        times_s=t,
        floor_s=floor,
        roofline_bandwidth=copy_bw,
        source=(
            f"measured: H200 F.linear bf16 grid, {len(rows)} points; {len(missing)} missing large points "
            f"filled at their lower neighbours' efficiency; floor {floor * 1e6:.1f} us = median of GEMMs "
            f"< 2^31 FLOP; plateau {plateau / 1e12:.0f} TFLOP/s (median of >= 2^40 FLOP)"
        ),
        extra={"filled": [[ms[i], ns[j], ks[k]] for i, j, k in missing], "plateau_flops": plateau},
    )


# ---------------------------------------------------------------------------- attention
def build_attention(data: Path, backward_call_s: float) -> AttentionTable:
    rows = _rows(data, "attention")
    axes = {k: sorted({r[k] for r in rows}) for k in ("b", "heads", "s", "d")}
    shape = tuple(len(v) for v in axes.values())
    fwd = np.full(shape, np.nan)
    bwd_raw = np.full(shape, np.nan)
    for r in rows:
        idx = tuple(axes[k].index(r[k]) for k in axes)
        fwd[idx] = r["fwd_ms"] * MS
        bwd_raw[idx] = r["bwd_ms"] * MS
    bwd = np.maximum(bwd_raw - backward_call_s, fwd)
    b, h, s, d = np.meshgrid(*[np.array(v, float) for v in axes.values()], indexing="ij")
    flops = AttentionTable.causal_flops(b, h, s, d)
    small = flops < 2**32
    fwd_floor = float(np.median(fwd[small]))
    bwd_floor = float(np.median(bwd[small]))
    return AttentionTable(
        b_axis=axes["b"],
        heads_axis=axes["heads"],
        s_axis=axes["s"],
        d_axis=axes["d"],
        fwd_s=fwd,
        bwd_s=bwd,
        fwd_floor_s=fwd_floor,
        bwd_floor_s=bwd_floor,
        source=(
            "measured: H200 F.scaled_dot_product_attention(is_causal=True) bf16, 200 points; backward = "
            f"bwd_ms - {backward_call_s * 1e6:.0f} us backward()-call cost (not below forward); floors = "
            "median of rows < 2^32 FLOP"
        ),
        extra={"backward_call_subtracted_s": backward_call_s},
    )


# ---------------------------------------------------------------------------- memory-bound ops
def build_memory_ops(data: Path, copy_bw: float) -> tuple[MemoryOpModel, list[str]]:
    rows = _rows(data, "elementwise")
    notes: list[str] = []
    bw: dict = {}
    src: dict = {}
    fitted: dict = {}
    for op, (io_f, io_b) in IO_BYTES.items():
        sel = [r for r in rows if r["op"] == op and r["bytes_io"] >= LARGE_BYTES]
        T = np.array([r["bytes_io"] for r in sel], float)
        out = {}
        for direction, io, key in (("fwd", io_f, "fwd_ms"), ("bwd", io_b, "bwd_ms")):
            t = np.array([r[key] for r in sel]) * MS
            rate, _ = fit_floor_plus_rate(io * T, t)
            if rate > copy_bw:
                notes.append(
                    f"h200 {op} {direction}: fitted {fmt_rate(rate)} under {io:g}T accounting exceeds the "
                    f"measured copy bandwidth; capped at {fmt_rate(copy_bw)}"
                )
                rate = copy_bw
            out[direction] = rate
        fitted[op] = out
    # cross-entropy
    ce = [r for r in rows if r["op"] == "cross_entropy"]
    mv = np.array([r["m"] * r["vocab"] for r in ce], float)
    fitted["cross_entropy"] = {
        d: min(fit_floor_plus_rate(f * mv, np.array([r[k] for r in ce]) * MS)[0], copy_bw)
        for d, f, k in (("fwd", CE_BYTES[0], "fwd_ms"), ("bwd", CE_BYTES[1], "bwd_ms"))
    }
    fitted["swiglu"] = fitted.pop("swiglu_act")
    for c in ("layernorm", "rmsnorm", "gelu", "swiglu", "dropout", "cross_entropy"):
        bw[c] = fitted[c]
        src[c] = f"measured: H200 elementwise.json {c} rows >= 128 MiB, aten-level I/O accounting"
    src["cross_entropy"] = "measured: H200 cross_entropy rows (log_softmax + nll + fp32 upcast), 18/26 B per logit"
    bw["binary"] = fitted["residual_add"]
    src["binary"] = "measured: H200 residual_add rows (fwd capped at copy bandwidth; bwd = one copy-like pass)"
    bw["softmax"] = fitted["cross_entropy"]
    src["softmax"] = "proxy: H200 cross_entropy class (log-softmax dominated); no softmax rows measured"
    bw["copy"] = {"fwd": copy_bw, "bwd": copy_bw}
    src["copy"] = "measured: H200 system.json d2d_copy (read + write)"
    measured = ("layernorm", "rmsnorm", "gelu", "swiglu", "dropout", "binary")
    bw["elementwise"] = {d: float(np.median([bw[c][d] for c in measured])) for d in ("fwd", "bwd")}
    src["elementwise"] = "generic fallback: median of the measured H200 elementwise classes"
    assert set(bw) == set(CLASSES)
    model = MemoryOpModel(bandwidth=bw, floor_s=MEMORY_OP_FLOOR_S, sources=src)
    return model, notes


# ---------------------------------------------------------------------------- host overhead
def calibrate_host(data: Path, gemm_floor_s: float) -> HostOverhead:
    """Per-op host costs from the host-bound small-shape rows.

    Forward: at the smallest shape (4 MiB) the measured per-call time is host time (the GPU part
    is ~2–5 µs); h_fwd = median over the modules of time / aten ops, together with the GEMM
    launch floor (one F.linear). Backward: `bwd_ms` of each module at T <= 16 MiB (median over
    shapes) = E + n_ops · h_bwd, E being the once-per-backward() engine cost; least squares over
    modules (the multi-op SwiGLU backward separates h_bwd from E).
    """
    rows = [r for r in _rows(data, "elementwise") if r["op"] in HOST_OPS]
    fwd_per_op = [gemm_floor_s]
    xs, ys = [], []
    for op, (n_f, n_b) in HOST_OPS.items():
        sel = [r for r in rows if r["op"] == op]
        smallest = min(sel, key=lambda r: r["bytes_io"])
        fwd_per_op.append(smallest["fwd_ms"] * MS / n_f)
        small = [r["bwd_ms"] * MS for r in sel if r["bytes_io"] <= SMALL_BYTES]
        xs.append(n_b)
        ys.append(float(np.median(small)))
    h_fwd = float(np.median(fwd_per_op))
    a = np.stack([np.ones(len(xs)), np.array(xs, float)], axis=1)
    (e_call, h_bwd), *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    return HostOverhead(
        fwd_op_s=h_fwd,
        bwd_op_s=float(h_bwd),
        backward_call_s=float(e_call),
        source=(
            "calibrated on H200 host-bound rows: h_fwd = median per-op time of the smallest elementwise "
            "modules and the F.linear floor; bwd_ms(T <= 16 MiB) = E + n_ops*h_bwd fitted over "
            "layernorm/rmsnorm/gelu/swiglu/dropout/residual_add"
        ),
    )


# ---------------------------------------------------------------------------- profile
def build(data: Path) -> GpuProfile:
    data = Path(data)
    system = read_json(data / "gpus" / "h200" / "system.json")
    sysrows = {r["what"]: r for r in system["rows"]}
    # the host AdamW the runtime runs (fused), not system.json's foreach one (5.5x slower there)
    host_adam = read_json(data / "gpus" / "h200" / "host_adam.json")["rows"][0]
    info = system["info"]
    copy_bw = 2 * sysrows["d2d_copy"]["bytes"] / (sysrows["d2d_copy"]["ms"] * MS)
    gemm = build_gemm(data, copy_bw)
    host = calibrate_host(data, gemm.floor_s)
    attention = build_attention(data, host.backward_call_s)
    memory_ops, notes = build_memory_ops(data, copy_bw)
    sheet = DATASHEET["h200"]
    h2d = sysrows["h2d_pinned"]
    d2h = sysrows["d2h_pinned"]
    bidir = sysrows["bidir_pinned"]
    version = f"torch {info['torch'].split('+')[0]}, CUDA {info['cuda']}"
    return GpuProfile(
        name="h200",
        provenance=f"measured: H200, {version}, bf16 (data/gpus/h200)",
        measured=True,
        memory_bytes=int(info["total_mem"]),
        peak_flops=sheet["peak_flops"],
        hbm_bandwidth=sheet["hbm"],
        h2d_bandwidth=h2d["bytes"] / (h2d["ms"] * MS),
        d2h_bandwidth=d2h["bytes"] / (d2h["ms"] * MS),
        bidir_bandwidth=2 * bidir["bytes_each_way"] / (bidir["ms"] * MS),
        adam_gpu_s_per_param=sysrows["adamw_step_gpu"]["ns_per_param"] * 1e-9,
        adam_cpu_s_per_param=host_adam["ns_per_param"] * 1e-9,
        gemm=gemm,
        attention=attention,
        memory_ops=memory_ops,
        host=host,
        sources={
            "memory_bytes": "measured: torch total_mem (system.json info)",
            "peak_flops": "datasheet: H200 SXM dense bf16 989 TFLOP/s",
            "hbm_bandwidth": f"datasheet: 4.8 TB/s (measured d2d copy reaches {copy_bw / 1e12:.2f} TB/s read+write)",
            "host_link": "measured: pinned 1 GiB h2d/d2h and bidirectional copies (system.json)",
            "adam": (
                "measured: fused AdamW on GPU (268M fp32 params); the runtime's fused host AdamW "
                f"(mist.runtime.optimizer.adamw_, {host_adam['params'] // 2**20} Mi fp32 params) on 16 "
                "host threads, one process on a one-GPU machine (not shared with other ranks)"
            ),
            "gemm": gemm.source,
            "attention": attention.source,
            "memory_ops": "measured: H200 elementwise.json (see memory_ops.sources)",
            "host": host.source,
        },
        fingerprint={
            "device": info["name"],
            "torch": info["torch"],
            "cuda": info["cuda"],
            "capability": info["capability"],
            "sm_count": info["sm_count"],
            "cpu_threads": info["cpu_threads"],
            "nvidia_smi": info["nvidia_smi"].strip().splitlines()[-1],
            "copy_bandwidth": copy_bw,
            "interference": {
                k: {"gemm_slowdown": sysrows[k]["gemm_slowdown"], "copy_slowdown": sysrows[k]["copy_slowdown"]}
                for k in sysrows
                if k.startswith("interference")
            },
        },
        notes=notes,
    )
