"""Host-bound regime: the CPU issues kernels one after another, the GPU runs them in order.

Eager PyTorch spends host time on every op (Python module call, dispatcher, autograd
bookkeeping, kernel launch). With small shapes on a fast GPU the kernels finish before the host
has issued the next one, so a block takes longer than the sum of its kernels' isolated times.

Model: the host issues kernel ``i`` at ``issue_i = Σ_{j<i} h_j`` (``h`` = per-op host overhead,
one value for forward ops and one for autograd backward nodes); the GPU starts it at
``start_i = max(issue_i, end_{i-1})`` and ends it at ``end_i = start_i + k_i``. Unrolling the
recursion gives ``end_last = max_i (issue_i + Σ_{j>=i} k_j)``, which is computed here in closed
form, vectorized over any leading (candidate) axes.

``backward_call_s`` is the fixed cost of one ``loss.backward()`` call (engine start-up and grad
seeding). It is per call (per micro-batch), not per op, so `stream_time` does not add it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def stream_time(kernel_times, host_overhead) -> np.ndarray:
    """End time (s) of the last of a sequence of kernels issued by a host.

    kernel_times: array-like, op axis LAST (leading axes are independent candidates).
    host_overhead: scalar seconds per op, or an array broadcastable to kernel_times (per-op values).
    Returns an array of the leading shape (a 0-d array for a 1-D input).
    """
    k = np.asarray(kernel_times, dtype=float)
    if k.ndim == 0:
        k = k[None]
    if k.shape[-1] == 0:
        return np.zeros(k.shape[:-1])
    h = np.broadcast_to(np.asarray(host_overhead, dtype=float), k.shape)
    issue = np.cumsum(h, axis=-1) - h  # issue_i = sum_{j<i} h_j
    suffix = np.cumsum(k[..., ::-1], axis=-1)[..., ::-1]  # sum_{j>=i} k_j
    return np.max(issue + suffix, axis=-1)


@dataclass(frozen=True)
class HostOverhead:
    """Per-op host costs (seconds) of eager PyTorch on the profiled machine."""

    fwd_op_s: float  # per forward aten op (dispatch + launch, autograd recording)
    bwd_op_s: float  # per autograd backward node / backward aten op
    backward_call_s: float  # once per backward() call (not per op)
    source: str = ""

    def per_op(self, backward: bool) -> float:
        return self.bwd_op_s if backward else self.fwd_op_s

    def to_dict(self) -> dict:
        return {
            "fwd_op_s": self.fwd_op_s,
            "bwd_op_s": self.bwd_op_s,
            "backward_call_s": self.backward_call_s,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> HostOverhead:
        return cls(
            fwd_op_s=float(d["fwd_op_s"]),
            bwd_op_s=float(d["bwd_op_s"]),
            backward_call_s=float(d["backward_call_s"]),
            source=d.get("source", ""),
        )
