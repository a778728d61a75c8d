"""Per-layer cost terms of a model on a GPU at one TP degree, vectorized over micro-batch sizes.

Everything the stage schedule needs about a layer: compute times per phase (with the TP
collectives of the layer, which sit on the critical path), state sizes of the shard, saved
activations with and without checkpointing, transient peaks and the output size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import sympy

from mist.analysis.layer import AnalysisRequest
from mist.analysis.records import B, S
from mist.rules.compiled_blocks import SPLIT
from mist.simulate.layer_cost import phase_time
from mist.simulate.weight_grad import (
    held_gradient_bytes,
    weight_grad_fraction,
    weight_grad_output_bytes,
)


@dataclass
class LayerTerms:
    """Arrays over the micro-batch axis (seconds, bytes); params are per TP shard."""

    params: int
    # times per layer in a stream of layers (`layer_cost.stream_of`): each phase's `lead_*` is
    # paid once per stream on top (a layer alone takes time + lead)
    fwd: np.ndarray  # forward compute + TP comm
    bwd: np.ndarray  # backward compute + TP comm (no recomputation)
    recompute: np.ndarray  # forward re-run of a checkpointed block (+ its TP comm)
    recompute_selective: np.ndarray  # re-run of the selectively recomputed parts inside `bwd` (else 0)
    bwd_plain: np.ndarray  # backward of a block without any recomputation (= bwd unless selective)
    tp_comm_fwd: np.ndarray
    tp_comm_bwd: np.ndarray
    saved: np.ndarray  # saved activations, not checkpointed (less what the selective parts re-run)
    saved_ckpt: np.ndarray  # saved activations, checkpointed (the input only)
    fwd_peak: np.ndarray  # transient live bytes in forward (excluding the input)
    bwd_peak: np.ndarray  # live bytes in backward (incl. its own saved activations)
    bwd_peak_ckpt: np.ndarray
    # ... where the runtime keeps the layer's parameter gradients until its backward is done
    # (a unit that does not accumulate in place: `mist.rules.grad_accumulation`)
    bwd_peak_held: np.ndarray
    bwd_peak_ckpt_held: np.ndarray
    fwd_peak_ckpt: np.ndarray  # a checkpointed block's forward runs without autograd: less is live
    output: np.ndarray  # output bytes (p2p message at a stage boundary)
    flops_fwd: np.ndarray
    flops_bwd: np.ndarray
    # per saved tensor (rows; zero-padded) and micro-batch size (columns): what the runtime's
    # activation offload splits one by one — see `LayerAnalysis.saved_split`
    split_numel: np.ndarray
    split_elt: np.ndarray
    split_whole: np.ndarray
    split_numel_ckpt: np.ndarray
    split_elt_ckpt: np.ndarray
    split_whole_ckpt: np.ndarray
    lead_fwd: np.ndarray
    lead_bwd: np.ndarray  # of `bwd` (with the selective re-runs when it has them)
    lead_bwd_ckpt: np.ndarray  # of a checkpointed block's backward stream: re-run + plain backward
    # the zero-bubble split of `bwd` (`simulate.weight_grad`): W's seconds per layer (its part of
    # the backward's kernels, no TP collectives) and the output gradients it keeps from B to W
    wgrad: np.ndarray | None = None
    wgrad_held: np.ndarray | None = None
    wgrad_out: np.ndarray | None = None  # the largest weight gradient W makes (before it is added)
    # the most W adds at once over what it starts with, and the bytes it releases in all on a
    # stage after the first (`analysis.weight_pass`; a compiled block:
    # `analysis.liveness.split_pass_bytes`): the saved tensors it reads, and a compiled block's
    # values B handed it
    wgrad_peak: np.ndarray | None = None
    wgrad_freed: np.ndarray | None = None
    # ... what it releases where B keeps every saved tensor (an engine that does not let go of
    # them: `rules.zero_bubble_order.lets_go_in_b`): the saved tensors only W reads, or a compiled
    # block's values B handed it
    wgrad_freed_kept: np.ndarray | None = None
    # B's peak with the graph kept to W over the plain backward's peak (a stage after the first
    # under ZB-H1, Mist's runtime: `LayerAnalysis.b_pass_peak`; None: not traced)
    b_pass_over: np.ndarray | None = None
    split: bool = False  # a compiled block whose backward runs as B and W graphs (`SPLIT`)
    # the saved bytes W does not read, which a stage after the first lets go of in B
    # (`LayerAnalysis.saved_unread_by_w`; 0 where the trace does not say)
    saved_unread_by_w: np.ndarray | None = None


def _at_sizes(expr, b, s) -> np.ndarray:
    """A sympy expression in (b, s) at the micro-batch sizes' (b, s) arrays."""
    v = sympy.lambdify((B, S), expr, modules="numpy", docstring_limit=0)(b, s)
    return np.broadcast_to(np.asarray(v, dtype=np.float64), b.shape)


def _split(la, b, s):
    """`saved_split` per micro-batch size (each size its own trace: b = 1 is exact), padded."""
    parts = [la.saved_split(np.array([bi]), np.array([si])) for bi, si in zip(b, s)]
    rows = max(len(p[1]) for p in parts)
    n, e = np.zeros((rows, len(b))), np.zeros((rows, len(b)))
    for j, (num, elt, _) in enumerate(parts):
        n[: len(elt), j], e[: len(elt), j] = num[:, 0], elt
    return n, e, np.array([p[2][0] for p in parts])


class _ByIdentity:
    """Hash a profile by identity (and keep it alive, so the identity stays unique)."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return self.obj is other.obj


def layer_terms(
    spec,
    profile,
    part: str,
    tp: int,
    flash: bool,
    seq: int,
    b,
    dtype: str = "bf16",
    target: str = "cuda",
    selective: str | bool = False,
    sequence_parallel: bool = False,
    cp: int = 1,
    compiled: bool | str = False,
) -> LayerTerms:
    """Terms at the distinct micro-batch sizes `b` (a 1-D array; evaluated once per size set),
    with the layer traced in `dtype` on the `target` device kind. `selective`: what the blocks
    that are not checkpointed whole re-run in backward ("attention", "activation", both joined by
    "+"; `mist.models.checkpointing.selective_name`); their backward then includes the re-runs.
    `sequence_parallel`: the layer traced with the TP group's sequence parallelism; `cp`: as a
    context-parallel rank of cp; `compiled`: the blocks compiled (`mist.models.compiled`; True, or
    `SPLIT` with the backward as B and W, `mist.rules.compiled_blocks.compile_mode`)."""
    b = np.atleast_1d(np.asarray(b, dtype=np.float64))
    return _layer_terms(
        spec,
        _ByIdentity(profile),
        part,
        tp,
        flash,
        seq,
        tuple(b.tolist()),
        dtype,
        target,
        selective if part == "block" else False,
        bool(sequence_parallel) and tp > 1,
        int(cp),
        compiled if part == "block" else False,
    )


def analyses(
    spec, part, tp, flash, dtype="bf16", target="cuda", selective=False, sp=False, cp=1, compiled=False
) -> list:
    """The `AnalysisRequest`s `layer_terms` reads, in this order: the layer as it runs (with its
    selective recomputation), then for a block without it (if selective) and checkpointed whole."""
    kw = dict(spec=spec, part=part, tp=tp, flash=flash, dtype=dtype, target=target, sequence_parallel=sp, cp=cp)
    if compiled and part == "block":
        kw["compiled"] = compiled
    rcs = [selective or False] + ([False] if selective else []) + ([True] if part == "block" else [])
    out = [AnalysisRequest(recompute=rc, **kw) for rc in rcs]
    if compiled == SPLIT and part == "block":
        # ZB-H1 runs no recomputation (`rules.zero_bubble_order.zb_h1_problem`): a split block is
        # never checkpointed, and the terms of its checkpointed variant, which no ZB-H1 plan
        # reads, are the whole compile's (traced for the other schedules anyway)
        out[-1] = replace(out[-1], compiled=True)
    return out


@lru_cache(maxsize=512)
def _layer_terms(spec, key, part, tp, flash, seq, bs, dtype, target, selective, sp, cp, compiled) -> LayerTerms:
    profile = key.obj
    b = np.asarray(bs, dtype=np.float64)
    s = np.full_like(b, float(seq))
    links = profile.link_model() if tp > 1 or cp > 1 else None  # own section or shipped file
    # the layer as it runs, [without its selective recomputation,] [checkpointed whole]
    reads = [r.run() for r in analyses(spec, part, tp, flash, dtype, target, selective, sp, cp, compiled)]
    la = reads[0]
    f = phase_time(profile, links, la, "fwd", b, s)
    bw = phase_time(profile, links, la, "bwd", b, s)
    # blocks run as a stream: each costs total − lead and the stream pays one lead per phase
    # (`layer_cost.stream_of`); the embedding and the head are one layer each: their full time
    block = part == "block"
    lead = (lambda ph: ph.lead) if block else (lambda ph: np.zeros_like(b))
    per = lambda ph: ph.total - lead(ph)  # noqa: E731
    rc_sel = np.zeros_like(b)
    bwd, lead_bwd, tp_bwd = per(bw), lead(bw), bw.comm
    plain = bw
    if selective:  # only ever for blocks
        plain = phase_time(profile, links, reads[1], "bwd", b, s)
        ra = phase_time(profile, links, la, "recompute", b, s)
        rc_sel = per(ra)
        bwd, lead_bwd, tp_bwd = bwd + rc_sel, np.maximum(bw.lead, ra.lead), bw.comm + ra.comm
    if block:
        ck = reads[-1]
        rc = phase_time(profile, links, ck, "recompute", b, s)
        recompute, saved_ck, bwd_ck, fwd_ck = per(rc), ck.saved(b, s), ck.bwd_peak(b, s), ck.fwd_peak(b, s)
        bwd_ck_held = ck.bwd_peak_held(b, s)
        lead_ck = np.maximum(rc.lead, plain.lead)
    else:
        ck = la
        recompute, saved_ck, bwd_ck, fwd_ck = np.zeros_like(b), la.saved(b, s), la.bwd_peak(b, s), la.fwd_peak(b, s)
        bwd_ck_held = la.bwd_peak_held(b, s)
        lead_ck = np.zeros_like(b)
    split, split_ck = _split(la, b, s), _split(ck, b, s)
    w_out = float(weight_grad_output_bytes(la))
    if la.weight_pass_peak is None:
        w_peak, w_freed = np.full(b.shape, w_out), np.zeros(b.shape)
    else:
        w_peak = np.max([_at_sizes(c, b, s) for c in la.weight_pass_peak], axis=0)
        w_freed = _at_sizes(la.weight_pass_freed, b, s)
    b_pass = la.b_pass_peak(b, s)
    # B lets go of the saved tensors W does not read, and W of the rest as it runs: an eager
    # node's once it has run (B's nodes hold no other reference), a split compiled block's W graph
    # each after its last use, with what B handed it (`runtime.activations`)
    unread = la.saved_unread(b, s)
    unread = np.zeros(b.shape) if unread is None else unread
    w_freed_kept = w_freed
    if la.saved_unread_by_w is not None:
        w_freed = (w_freed if la.compiled else 0.0) + la.saved(b, s) - unread
    return LayerTerms(
        params=la.params,
        fwd=per(f),
        bwd=bwd,
        recompute=recompute,
        recompute_selective=rc_sel,
        bwd_plain=per(plain),
        tp_comm_fwd=f.comm,
        tp_comm_bwd=tp_bwd,
        lead_fwd=lead(f),
        lead_bwd=lead_bwd,
        lead_bwd_ckpt=lead_ck,
        saved=la.saved(b, s),
        saved_ckpt=saved_ck,
        fwd_peak=la.fwd_peak(b, s),
        bwd_peak=la.bwd_peak(b, s),
        bwd_peak_ckpt=bwd_ck,
        bwd_peak_held=la.bwd_peak_held(b, s),
        bwd_peak_ckpt_held=bwd_ck_held,
        fwd_peak_ckpt=fwd_ck,
        output=la.output(b, s),
        flops_fwd=la.flops_of("fwd", b, s),
        flops_bwd=la.flops_of("bwd", b, s),
        split_numel=split[0],
        split_elt=split[1],
        split_whole=split[2],
        split_numel_ckpt=split_ck[0],
        split_elt_ckpt=split_ck[1],
        split_whole_ckpt=split_ck[2],
        wgrad=(bw.compute - lead(bw)) * weight_grad_fraction(profile, la, b, s),
        wgrad_held=_at_sizes(held_gradient_bytes(la), b, s),
        wgrad_out=np.full(b.shape, w_out),
        wgrad_peak=w_peak,
        wgrad_freed=w_freed,
        wgrad_freed_kept=w_freed_kept,
        b_pass_over=None if b_pass is None else b_pass - la.bwd_peak(b, s),
        split=la.compiled == SPLIT,
        saved_unread_by_w=unread,
    )
