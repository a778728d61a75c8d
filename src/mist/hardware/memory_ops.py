"""Memory-bound kernels: time = launch floor + bytes moved / effective bandwidth of the op's class.

``bytes_moved`` is what a trace sees at the aten-op boundary: the sizes of the op's tensor inputs
plus its tensor outputs (read + written once). Each class's effective bandwidth was fitted against
exactly that accounting (see `tools/profile_build/`), so kernels that internally make several
passes (e.g. LayerNorm backward's separate dγ/dβ reduction) show up as a lower effective
bandwidth rather than as extra bytes the caller must know about.

Op names are aten overload packets as they appear in a trace (``native_layer_norm``,
``gelu_backward``, ``aten::add.Tensor``, ``add_`` …). Unknown names fall back to the generic
``elementwise`` class; they never fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Classes every profile defines (some are proxies of others on a given GPU; see its sources).
CLASSES = (
    "layernorm",
    "rmsnorm",
    "gelu",
    "swiglu",
    "dropout",
    "binary",
    "softmax",
    "cross_entropy",
    "copy",
    "elementwise",
)

_OP_CLASS = {
    # normalization
    "native_layer_norm": "layernorm",
    "native_layer_norm_backward": "layernorm",
    "layer_norm": "layernorm",
    "_fused_rms_norm": "rmsnorm",
    "_fused_rms_norm_backward": "rmsnorm",
    "rms_norm": "rmsnorm",
    # activations
    "gelu": "gelu",
    "gelu_backward": "gelu",
    "silu": "swiglu",
    "silu_backward": "swiglu",
    # dropout
    "native_dropout": "dropout",
    "native_dropout_backward": "dropout",
    "dropout": "dropout",
    "bernoulli": "dropout",
    # binary pointwise (residual add, gating multiply, scaling)
    "add": "binary",
    "sub": "binary",
    "mul": "binary",
    "div": "binary",
    "addcmul": "binary",
    "where": "binary",
    # softmax
    "_softmax": "softmax",
    "_softmax_backward_data": "softmax",
    "softmax": "softmax",
    "_safe_softmax": "softmax",
    # loss
    "_log_softmax": "cross_entropy",
    "_log_softmax_backward_data": "cross_entropy",
    "log_softmax": "cross_entropy",
    "nll_loss_forward": "cross_entropy",
    "nll_loss_backward": "cross_entropy",
    "nll_loss": "cross_entropy",
    "nll_loss_nd": "cross_entropy",
    "cross_entropy_loss": "cross_entropy",
    # data movement
    "copy": "copy",
    "copy_": "copy",
    "clone": "copy",
    "_to_copy": "copy",
    "to": "copy",
    "contiguous": "copy",
    "cat": "copy",
    "stack": "copy",
    "index_select": "copy",
    "slice_backward": "copy",
    "roll": "copy",  # a permuting copy: reads and writes each element once (the rotary's rotate-half)
    "select_backward": "copy",
}
for _c in CLASSES:  # a class name is accepted as an op name
    _OP_CLASS.setdefault(_c, _c)


def op_class(op: str) -> str:
    """Class of an aten op name (``aten::``/overload suffix ignored, case-insensitive)."""
    name = str(op).strip().lower()
    name = name.rsplit("::", 1)[-1].split(".", 1)[0]
    if name in _OP_CLASS:
        return _OP_CLASS[name]
    if name.endswith("_") and name[:-1] in _OP_CLASS:  # in-place variant, e.g. add_ / mul_
        return _OP_CLASS[name[:-1]]
    return "elementwise"


@dataclass(eq=False)
class MemoryOpModel:
    """Per-class effective bandwidths (B/s) for forward and backward kernels, plus a launch floor."""

    bandwidth: dict  # class -> {"fwd": B/s, "bwd": B/s}
    floor_s: float
    sources: dict = field(default_factory=dict)  # class -> one line on where the numbers came from

    def __post_init__(self) -> None:
        missing = [c for c in CLASSES if c not in self.bandwidth]
        if missing:
            raise ValueError(f"memory-op model lacks classes {missing}")
        for c, bw in self.bandwidth.items():
            if not (bw["fwd"] > 0 and bw["bwd"] > 0):
                raise ValueError(f"memory-op class {c} needs positive fwd/bwd bandwidths")

    def effective_bandwidth(self, op: str, backward: bool = False) -> float:
        return float(self.bandwidth[op_class(op)]["bwd" if backward else "fwd"])

    def time(self, op: str, bytes_moved, backward: bool = False) -> np.ndarray:
        """Seconds: floor + bytes/bandwidth; 0 where bytes_moved <= 0."""
        nbytes = np.asarray(bytes_moved, dtype=float)
        t = self.floor_s + nbytes / self.effective_bandwidth(op, backward)
        return np.where(nbytes > 0, t, 0.0)

    def to_dict(self) -> dict:
        return {
            "floor_s": float(self.floor_s),
            "bandwidth": {c: {"fwd": float(v["fwd"]), "bwd": float(v["bwd"])} for c, v in self.bandwidth.items()},
            "sources": dict(self.sources),
        }

    @classmethod
    def from_dict(cls, d: dict) -> MemoryOpModel:
        return cls(
            bandwidth={c: {"fwd": float(v["fwd"]), "bwd": float(v["bwd"])} for c, v in d["bandwidth"].items()},
            floor_s=float(d["floor_s"]),
            sources=dict(d.get("sources", {})),
        )
