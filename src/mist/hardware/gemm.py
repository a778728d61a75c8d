"""GEMM time model: a measured (or synthesized) time table over (m, n, k).

Convention (same as the H200 measurements): ``y[m, n] = x[m, k] @ w[n, k]^T``, one kernel.
A batched GEMM (``bmm``) of ``batch`` independent problems is looked up as one GEMM with
``m * batch`` rows: both launch the same number of output tiles over the same reduction depth,
so they fill the GPU alike. Backward GEMMs of a linear layer are ordinary lookups with
permuted shapes (dX: ``(m, k, n)``, dW: ``(n, k, m)``); the table did not time transposed
operand layouts, which costs a few percent.

Lookup: log-time interpolated linearly in (log m, log n, log k) (see `_loggrid`). Outside the
grid the efficiency is clamped (time scales with m·n·k from the nearest grid point) with the
launch floor as a lower bound, and the result can never beat the memory roofline: reading both
operands and writing the output once at ``roofline_bandwidth``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mist.hardware._loggrid import LogGrid, round_sig


@dataclass(eq=False)
class GemmTable:
    m_axis: list[float]
    n_axis: list[float]
    k_axis: list[float]
    times_s: np.ndarray  # shape (len(m), len(n), len(k)), seconds
    floor_s: float  # launch floor applied to extrapolated (outside-grid) lookups
    roofline_bandwidth: float  # B/s; lower bound t >= bytes / bandwidth
    element_bytes: int = 2  # bf16 / fp16 operands
    source: str = ""
    extra: dict = field(default_factory=dict)  # fit parameters etc., kept for provenance

    def __post_init__(self) -> None:
        self.times_s = np.array(self.times_s, dtype=float)
        self.times_s.flags.writeable = False
        self._grid = LogGrid([self.m_axis, self.n_axis, self.k_axis], self.times_s, (1.0, 1.0, 1.0), self.floor_s)

    def time(self, m, n, k, batch=1) -> np.ndarray:
        """Seconds for `batch` GEMMs of shape (m, n, k); numpy-broadcast over all arguments."""
        m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
        t = self._grid(m * batch, n, k)
        bytes_moved = self.element_bytes * batch * (m * k + n * k + m * n)
        return np.where(t > 0, np.maximum(t, bytes_moved / self.roofline_bandwidth), 0.0)

    def flops_rate(self, m, n, k, batch=1) -> np.ndarray:
        """Achieved FLOP/s (2·m·n·k·batch / time)."""
        m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
        return 2.0 * m * n * k * batch / self.time(m, n, k, batch)

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict:
        return {
            "m_axis": [float(v) for v in self.m_axis],
            "n_axis": [float(v) for v in self.n_axis],
            "k_axis": [float(v) for v in self.k_axis],
            "times_s": round_sig(self.times_s, 5).tolist(),
            "floor_s": float(self.floor_s),
            "roofline_bandwidth": float(self.roofline_bandwidth),
            "element_bytes": int(self.element_bytes),
            "source": self.source,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> GemmTable:
        return cls(
            m_axis=list(d["m_axis"]),
            n_axis=list(d["n_axis"]),
            k_axis=list(d["k_axis"]),
            times_s=np.asarray(d["times_s"], dtype=float),
            floor_s=float(d["floor_s"]),
            roofline_bandwidth=float(d["roofline_bandwidth"]),
            element_bytes=int(d.get("element_bytes", 2)),
            source=d.get("source", ""),
            extra=dict(d.get("extra", {})),
        )
