"""Time of one traced layer on a GPU profile: each operator timed by the profile, issued in
trace order through the host (`stream_time`), TP collectives added on the critical path.

Vectorized over (b, s) arrays: the analysis evaluates every operator's parameters at all
candidate shapes at once; there is no Python loop per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist.analysis.layer import LayerAnalysis
from mist.analysis.records import ATTENTION, COLLECTIVE, GEMM
from mist.hardware.collectives import LinkModel


@dataclass
class PhaseTime:
    compute: np.ndarray   # seconds of kernels incl. host issue limits
    comm: np.ndarray      # seconds of TP collectives (serial, not overlapped)

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.comm


def kernel_time(profile, op: dict, backward: bool) -> np.ndarray:
    kind = op["kind"]
    if kind == GEMM:
        return profile.gemm_time(op["m"], op["n"], op["k"], op["batch"])
    if kind == ATTENTION:
        return profile.attention_time(op["b"], op["heads"], op["kv_heads"], op["s"], op["d"],
                                      op["causal"], backward)
    return profile.memory_op_time(op["op"], op["bytes_moved"], backward)


def phase_time(profile, links: LinkModel | None, la: LayerAnalysis, phase: str, b, s) -> PhaseTime:
    """Compute and TP-communication time of one phase ("fwd", "bwd", "recompute")."""
    b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
    ops = la.op_values(phase, b, s)
    backward = phase == "bwd"
    kernels = [np.broadcast_to(kernel_time(profile, op, backward), b.shape)
               for op in ops if op["kind"] != COLLECTIVE]
    comm = np.zeros(b.shape)
    for op in ops:
        if op["kind"] == COLLECTIVE:
            if links is None:
                raise ValueError(f"no collective model for GPU {profile.name}")
            comm = comm + links.time(op["op"], op["bytes"], op["group"])
    if kernels:
        compute = np.asarray(profile.stream_time(np.stack(kernels, axis=-1), backward))
    else:
        compute = np.zeros(b.shape)
    return PhaseTime(np.broadcast_to(compute, b.shape), comm)
