"""Fused (flash) scaled-dot-product attention: forward and backward kernel times.

Tables over (b, heads, s, d), causal, query heads = KV heads, as measured on the H200
(`F.scaled_dot_product_attention(is_causal=True)`), or synthesized for GPUs without flash
measurements (see `tools/profile_build/flash.py`). Lookups interpolate log-time in
(log b, log heads, log s, log d); outside the grid the efficiency is clamped (time ∝ b·heads·s²·d)
with a floor.

Modelling choices (documented because callers depend on them):

* **GQA / MQA** (``kv_heads < heads``): costs the same as MHA with ``heads`` query heads. The
  flash kernel reads K/V fewer times, but its FLOPs (QKᵀ and PV per query head) are unchanged and
  it is compute-bound at training shapes. ``kv_heads`` is only validated.
* **causal=False**: about twice the causal FLOPs, so twice the part of the causal time above the
  floor: ``t_full = t_causal + max(t_causal - floor, 0)``.
* **queries and keys of different lengths** (``keys``: a context-parallel rank's partial
  attentions, its n queries over n or j·n keys): priced as the square attention of the same work,
  s = √(queries·keys), since the kernel's work (and the tables' scaling beyond the grid) goes with
  queries × keys.
* **backward**: the kernel(s) of the SDPA backward node alone. The H200 table's ``bwd_ms`` was
  derived as (fwd+bwd) − fwd of a timed ``backward()`` call, so it also contains the fixed cost of
  starting the autograd engine once per call (``backward_call_s`` of the host model, fitted on the
  elementwise data). The build subtracts it (never going below the forward time); rows above 5 ms
  change by < 2 %.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mist.hardware._loggrid import LogGrid, round_sig

_WORK_EXPONENTS = (1.0, 1.0, 2.0, 1.0)  # b, heads, s, d


@dataclass(eq=False)
class AttentionTable:
    b_axis: list[float]
    heads_axis: list[float]
    s_axis: list[float]
    d_axis: list[float]
    fwd_s: np.ndarray  # shape (b, heads, s, d), seconds, causal
    bwd_s: np.ndarray
    fwd_floor_s: float
    bwd_floor_s: float
    source: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fwd_s = np.array(self.fwd_s, dtype=float)
        self.bwd_s = np.array(self.bwd_s, dtype=float)
        self.fwd_s.flags.writeable = False
        self.bwd_s.flags.writeable = False
        axes = [self.b_axis, self.heads_axis, self.s_axis, self.d_axis]
        self._fwd = LogGrid(axes, self.fwd_s, _WORK_EXPONENTS, self.fwd_floor_s)
        self._bwd = LogGrid(axes, self.bwd_s, _WORK_EXPONENTS, self.bwd_floor_s)

    def time(self, b, heads, kv_heads, s, d, causal=True, backward=False, keys=None) -> np.ndarray:
        """Seconds of the forward (or backward) flash kernel; numpy-broadcast over shapes."""
        b, heads, kv_heads, s, d = (np.asarray(x, dtype=float) for x in (b, heads, kv_heads, s, d))
        if keys is not None:
            s = np.sqrt(s * np.asarray(keys, dtype=float))
        if np.any(kv_heads > heads) or np.any(kv_heads <= 0):
            raise ValueError("attention_time: need 0 < kv_heads <= heads")
        grid = self._bwd if backward else self._fwd
        t = grid(b, heads, s, d)
        causal = np.asarray(causal, dtype=bool)
        full = t + np.maximum(t - grid.floor_s, 0.0)
        return np.where(causal, t, full)

    @staticmethod
    def causal_flops(b, heads, s, d) -> np.ndarray:
        """Forward FLOPs of causal attention as counted in the H200 table: 2·b·heads·s²·d."""
        return 2.0 * np.asarray(b, float) * heads * np.asarray(s, float) ** 2 * d

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict:
        return {
            "b_axis": [float(v) for v in self.b_axis],
            "heads_axis": [float(v) for v in self.heads_axis],
            "s_axis": [float(v) for v in self.s_axis],
            "d_axis": [float(v) for v in self.d_axis],
            "fwd_s": round_sig(self.fwd_s, 5).tolist(),
            "bwd_s": round_sig(self.bwd_s, 5).tolist(),
            "fwd_floor_s": float(self.fwd_floor_s),
            "bwd_floor_s": float(self.bwd_floor_s),
            "source": self.source,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> AttentionTable:
        return cls(
            b_axis=list(d["b_axis"]),
            heads_axis=list(d["heads_axis"]),
            s_axis=list(d["s_axis"]),
            d_axis=list(d["d_axis"]),
            fwd_s=np.asarray(d["fwd_s"], dtype=float),
            bwd_s=np.asarray(d["bwd_s"], dtype=float),
            fwd_floor_s=float(d["fwd_floor_s"]),
            bwd_floor_s=float(d["bwd_floor_s"]),
            source=d.get("source", ""),
            extra=dict(d.get("extra", {})),
        )
