"""Time of one traced layer on a GPU profile: each operator timed by the profile, issued in
trace order through the host (`stream_time`), TP collectives added on the critical path.

Layers run back to back: nothing synchronizes the host with the GPU between them, so where one
layer keeps the GPU busy the host already issues the next, and where the host lags the GPU drains
the earlier layers' queue. A layer alone takes S = `stream_time` of its kernels; n identical layers
in one stream take (n − 1)·max(H, K) + S, with H its kernels' summed host overhead and K their
summed times (the latest kernel issue that starts the critical chain falls in the first layer when
K ≥ H, in the last when H > K; see `mist.hardware.host`). `lead` = S − max(H, K) is the part of a
layer alone that a stream of layers pays once (down to minus one op's host overhead when host-bound:
a kernel starts as soon as it is issued, before the host's own time for it has passed).

Vectorized over (b, s) arrays: the analysis evaluates every operator's parameters at all
candidate shapes at once; there is no Python loop per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from mist.analysis.layer import LayerAnalysis
from mist.analysis.records import COLLECTIVE, AttentionParams, CollectiveParams, FusedParams, GemmParams, OpValues
from mist.hardware.collectives import LinkModel


@dataclass
class PhaseTime:
    compute: np.ndarray  # seconds of kernels incl. host issue limits, the layer alone (S)
    comm: np.ndarray  # seconds of TP collectives (serial, not overlapped)
    lead: np.ndarray | float = 0.0  # S − max(H, K): paid once by a stream of such layers, not per layer

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.comm


def kernel_time(profile, op: OpValues, backward: bool) -> np.ndarray:
    p = op.params  # a GEMM's are `GemmParams`, an attention's `AttentionParams`, a fused kernel's
    # `FusedParams`, another memory op's None
    if isinstance(p, GemmParams):
        return profile.gemm_time(p.m, p.n, p.k, p.batch)
    if isinstance(p, AttentionParams):
        return profile.attention_time(p.b, p.heads, p.kv_heads, p.s, p.d, p.causal, backward, p.s_kv)
    if isinstance(p, FusedParams):
        return profile.fused_time(op.bytes_moved, {f.name: getattr(p, f.name) for f in fields(p)}, backward)
    return profile.memory_op_time(op.op, op.bytes_moved, backward)


def phase_time(profile, links: LinkModel | None, la: LayerAnalysis, phase: str, b, s) -> PhaseTime:
    """Compute and TP-communication time of one phase ("fwd", "bwd", "recompute")."""
    b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
    ops = la.op_values(phase, b, s)
    backward = phase == "bwd"
    kernels = [np.broadcast_to(kernel_time(profile, op, backward), b.shape) for op in ops if op.kind != COLLECTIVE]
    comm = np.zeros(b.shape)
    for op in ops:
        if isinstance(op.params, CollectiveParams):
            if links is None:
                raise ValueError(f"no collective model for GPU {profile.name}")
            comm = comm + links.time(op.op, op.params.bytes, op.params.group)
    lead = np.zeros(b.shape)
    if kernels:
        k = np.stack(kernels, axis=-1)
        compute = np.asarray(profile.stream_time(k, backward))
        host = profile.host.per_op(backward) * k.shape[-1]
        lead = compute - np.maximum(host, k.sum(axis=-1))
    else:
        compute = np.zeros(b.shape)
    return PhaseTime(np.broadcast_to(compute, b.shape), comm, np.broadcast_to(lead, b.shape))


def stream_of(n, phase: PhaseTime):
    """Seconds of `n` ≥ 1 identical layers' phase run back to back (TP collectives included)."""
    return n * (phase.total - phase.lead) + phase.lead
