"""`mist estimate`: one micro-batch of a whole model on one GPU (a TP shard when tp > 1).

Time: embedding + all blocks + head and loss, forward and backward (and the recomputed forward
of checkpointed blocks, or of the parts named by `recompute="attention"`, `"activation"` or
`"attention+activation"`). Memory: weights and gradients in `dtype` (default: the dtype the profile
was measured in, bf16 for GPUs), fp32 master weights and Adam moments (12 bytes per parameter) plus the activation peak of the micro-batch, found by
walking the layers forward and back with the traced live bytes of each, or, where it is larger,
the optimizer step's fp32 gradient piece (`mist.rules.optimizer_step`; none for fp32 gradients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from mist.analysis import analyze_layer
from mist.rules.optimizer_step import GRAD_COPY_BYTES, update_read_elements
from mist.simulate.gpu_fit import fits_gpu, usable_bytes
from mist.simulate.layer_cost import phase_time, stream_of
from mist.simulate.precision import default_precision
from mist.specs.model import ModelSpec

MS = 1e3


@dataclass(frozen=True)
class LayerEstimate:
    """One decoder block (one TP shard): its phase times (ms) and traced memory (bytes)."""

    fwd_compute_ms: float
    bwd_compute_ms: float
    recompute_ms: float
    fwd_comm_ms: float
    bwd_comm_ms: float
    saved_activation_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    params: int


@dataclass(frozen=True)
class ModelEstimate:
    """The whole model, one micro-batch forward and backward, on one GPU."""

    fwd_bwd_ms: float
    time_breakdown: Mapping[str, float]  # embedding, blocks (fwd, bwd, recompute), head and loss
    params: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    peak_bytes: int  # the sum of the four above
    activation_peak_at: str  # where in the pass the activations peak
    model_flops: float
    achieved_tflops: float
    capacity_bytes: int  # what PyTorch's allocator can have on the GPU
    fits: bool


@dataclass(frozen=True)
class Estimate:
    """What `mist estimate` reports; `to_json()` is what its --json prints."""

    model_name: str
    gpu: str
    profile: str
    measured_profile: bool
    seq_len: int
    micro_batch: int
    tp: int
    dtype: str
    recompute: str
    flash: bool
    compiled_blocks: bool
    layer: LayerEstimate
    model: ModelEstimate

    def to_json(self) -> dict:
        return asdict(self)


def _f(x) -> float:
    return float(np.asarray(x))


def activation_peak(pre, blk, post, layers: int, b, s) -> tuple[float, str]:
    """Peak activation bytes of one micro-batch and where it occurs."""
    a_pre, a_blk = _f(pre.saved(b, s)), _f(blk.saved(b, s))
    x_in = _f(pre.output(b, s))  # a block's input: the previous layer's output
    cands = {
        "embedding forward": _f(pre.fwd_peak(b, s)),
        "last block forward": a_pre + (layers - 1) * a_blk + x_in + _f(blk.fwd_peak(b, s)),
        "head forward": a_pre + layers * a_blk + x_in + _f(post.fwd_peak(b, s)),
        "head backward": a_pre + layers * a_blk + _f(post.bwd_peak(b, s)),
        "last block backward": a_pre + (layers - 1) * a_blk + _f(blk.bwd_peak(b, s)),
        "embedding backward": _f(pre.bwd_peak(b, s)),
    }
    where = max(cands, key=lambda k: cands[k])
    return cands[where], where


def estimate(
    spec: ModelSpec,
    profile,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    recompute: str = "none",
    flash: bool = True,
    dtype: str | None = None,
    compiled: bool = False,
) -> Estimate:
    """One micro-batch of `spec` on one GPU of `profile` (a TP shard when tp > 1): see the module."""
    spec.check_tp(tp)
    links = profile.link_model() if tp > 1 else None  # own section or shipped file
    mode = {"none": False, "full": True}.get(recompute, recompute)  # else selective parts
    ckpt = bool(mode)  # the block's trace has a recompute phase
    pr = default_precision(profile, dtype)

    def trace(part: str, recompute: bool | str = False):
        return analyze_layer(
            spec,
            part,
            tp=tp,
            flash=flash,
            recompute=recompute,
            dtype=pr.trace_dtype,
            target=pr.target,
            compiled=compiled and part == "block",
        )

    blk, pre, post = trace("block", mode), trace("pre"), trace("post")
    b, s, L = micro_batch, seq, spec.num_layers

    t, fwd_bwd, time_breakdown = _times(profile, links, (pre, blk, post), L, b, s, ckpt)
    params = pre.params + L * blk.params + post.params
    peak_act, where = activation_peak(pre, blk, post, L, b, s)
    # the step holds no activation, only the fp32 piece of a 16-bit gradient it reads (each of the
    # embedding, the blocks and the head is one unit, read in pieces)
    unit = max(pre.params, blk.params, post.params)
    piece = GRAD_COPY_BYTES * int(update_read_elements(unit, unit, pr.grad_bytes == GRAD_COPY_BYTES))
    if piece > peak_act:
        peak_act, where = piece, "optimizer step (an fp32 gradient piece)"
    mem = {
        "weights_bytes": params * pr.weight_bytes,
        "grads_bytes": params * pr.grad_bytes,
        "optimizer_bytes": params * pr.opt_bytes,
        "activation_peak_bytes": int(round(peak_act)),
    }
    flops = sum(_f(la.flops_of(ph, b, s)) * n for la, n in ((pre, 1), (blk, L), (post, 1)) for ph in ("fwd", "bwd"))
    peak = sum(mem.values())
    return Estimate(
        model_name=spec.name,
        gpu=profile.name,
        profile=profile.provenance,
        measured_profile=bool(getattr(profile, "measured", True)),
        seq_len=s,
        micro_batch=b,
        tp=tp,
        dtype=pr.trace_dtype,
        recompute=recompute,
        flash=flash,
        compiled_blocks=compiled,
        layer=_layer(t["block"], blk, b, s, ckpt),
        model=ModelEstimate(
            fwd_bwd_ms=fwd_bwd * MS,
            time_breakdown=time_breakdown,
            params=params,
            **mem,
            peak_bytes=peak,
            activation_peak_at=where,
            model_flops=flops,
            achieved_tflops=flops / fwd_bwd / 1e12 if fwd_bwd > 0 else 0.0,
            capacity_bytes=usable_bytes(profile),
            fits=bool(fits_gpu(peak, profile)),
        ),
    )


def _layer(times: dict, blk, b: int, s: int, ckpt: bool) -> LayerEstimate:
    """One block's row of the report: its phase times (ms) and traced memory (bytes)."""
    return LayerEstimate(
        fwd_compute_ms=_f(times["fwd"].compute) * MS,
        bwd_compute_ms=_f(times["bwd"].compute) * MS,
        recompute_ms=_f(times["recompute"].total) * MS if ckpt else 0.0,
        fwd_comm_ms=_f(times["fwd"].comm) * MS,
        bwd_comm_ms=_f(times["bwd"].comm) * MS,
        saved_activation_bytes=int(round(_f(blk.saved(b, s)))),
        fwd_peak_bytes=int(round(_f(blk.fwd_peak(b, s)))),
        bwd_peak_bytes=int(round(_f(blk.bwd_peak(b, s)))),
        params=blk.params,
    )


def _times(profile, links, layers, L: int, b: int, s: int, ckpt: bool) -> tuple[dict, float, dict]:
    """(phase times per part, one micro-batch's forward + backward seconds, its breakdown in ms)
    of the embedding, `L` blocks back to back and the head."""
    pre, blk, post = layers
    t = {
        name: {ph: phase_time(profile, links, la, ph, b, s) for ph in phases}
        for name, la, phases in (
            ("block", blk, ["fwd", "bwd"] + (["recompute"] if ckpt else [])),
            ("pre", pre, ["fwd", "bwd"]),
            ("post", post, ["fwd", "bwd"]),
        )
    }

    def tot(name, ph):
        return _f(t[name][ph].total) if ph in t[name] else 0.0

    def blocks(ph):  # L blocks back to back (see `stream_of`)
        return _f(stream_of(L, t["block"][ph])) if ph in t["block"] else 0.0

    fwd_bwd = (
        tot("pre", "fwd")
        + tot("pre", "bwd")
        + blocks("fwd")
        + blocks("bwd")
        + blocks("recompute")
        + tot("post", "fwd")
        + tot("post", "bwd")
    )
    time_breakdown = {
        "embedding_ms": (tot("pre", "fwd") + tot("pre", "bwd")) * MS,
        "blocks_fwd_ms": blocks("fwd") * MS,
        "blocks_bwd_ms": blocks("bwd") * MS,
        "blocks_recompute_ms": blocks("recompute") * MS,
        "head_loss_ms": (tot("post", "fwd") + tot("post", "bwd")) * MS,
    }
    return t, fwd_bwd, time_breakdown
