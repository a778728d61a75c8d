"""Memory-bound kernels: time = launch floor + bytes moved / effective bandwidth of the op's class.

``bytes_moved`` is what a trace sees at the aten-op boundary: the sizes of the op's tensor inputs
plus its tensor outputs (read + written once). Each class's effective bandwidth was fitted against
exactly that accounting (see `tools/profile_build/`), so kernels that internally make several
passes (e.g. LayerNorm backward's separate dγ/dβ reduction) show up as a lower effective
bandwidth rather than as extra bytes the caller must know about.

Op names are aten overload packets as they appear in a trace (``native_layer_norm``,
``gelu_backward``, ``aten::add.Tensor``, ``add_`` …). Unknown names fall back to the generic
``elementwise`` class; they never fail.

A compiled block's fused kernel (`fused_time`) is a roofline of its two costs: the bytes it moves
at the device's streaming rate (the ``copy`` class: one read and one write, nothing computed), and
the element-operations it computes (`mist.analysis.records.FusedParams`) at the seconds per
element of each kind that `mist profile` measured by running Inductor-generated kernels of that
kind (``pointwise_s``); the kernel takes the longer of the two, as the core computes while the
memory system streams. A profile without ``pointwise_s`` (the shipped GPU profiles, whose
measurements hold no compiled kernel) prices it by its bytes at the generic class, as a
memory-bound kernel, which the H200's measured elementwise rates (2.4–3.6 TB/s at large shapes,
GELU's tanh included) say the GPUs' pointwise work is.
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

# What a fused pointwise kernel computes per element, by the kind of operation: "arith" (one
# vector instruction per element: add, multiply, compare, convert, a store), "reduction" (one
# element's step of a row reduction: an RMSNorm's mean square, a softmax's max and sum, whose
# steps depend on each other), "welford" (a LayerNorm's mean and variance in one pass, Welford's
# update: a division per element) and the transcendental functions, each its own kind (their
# costs differ several-fold: on one CPU core Inductor's tanh took 3× its exp, its Welford step 7×
# a sum's), and "random" (one element of a dropout mask's uniform draw: a counter-based generator's
# rounds of integer multiplies). `mist profile` measures the seconds per element of each;
# `mist.analysis.records.FusedParams` counts them.
POINTWISE_KINDS = ("arith", "reduction", "welford", "tanh", "exp", "sigmoid", "erf", "sin", "cos", "log", "random")

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
    "seeded_dropout": "dropout",  # `mist::seeded_dropout`: native_dropout from a rank's own stream
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
    # seconds per element-operation of each kind a fused kernel computes (None: not measured)
    pointwise_s: dict | None = None

    def __post_init__(self) -> None:
        missing = [c for c in CLASSES if c not in self.bandwidth]
        if missing:
            raise ValueError(f"memory-op model lacks classes {missing}")
        for c, bw in self.bandwidth.items():
            if not (bw["fwd"] > 0 and bw["bwd"] > 0):
                raise ValueError(f"memory-op class {c} needs positive fwd/bwd bandwidths")
        if self.pointwise_s is not None and not all(v >= 0 for v in self.pointwise_s.values()):
            raise ValueError("pointwise seconds per element-operation must be >= 0")

    def effective_bandwidth(self, op: str, backward: bool = False) -> float:
        return float(self.bandwidth[op_class(op)]["bwd" if backward else "fwd"])

    def time(self, op: str, bytes_moved, backward: bool = False) -> np.ndarray:
        """Seconds: floor + bytes/bandwidth; 0 where bytes_moved <= 0."""
        nbytes = np.asarray(bytes_moved, dtype=float)
        t = self.floor_s + nbytes / self.effective_bandwidth(op, backward)
        return np.where(nbytes > 0, t, 0.0)

    def fused_time(self, bytes_moved, work: dict, backward: bool = False) -> np.ndarray:
        """Seconds of a fused pointwise kernel moving `bytes_moved` and computing `work` ({kind:
        element-operations}): floor + the longer of streaming and computing (module docstring)."""
        nbytes = np.asarray(bytes_moved, dtype=float)
        if self.pointwise_s is None:
            return self.time("elementwise", nbytes, backward)
        stream = nbytes / self.effective_bandwidth("copy", backward)
        compute = sum(np.asarray(n, dtype=float) * self.pointwise_s.get(k, 0.0) for k, n in work.items())
        t = self.floor_s + np.maximum(stream, compute)
        return np.where(nbytes > 0, t, 0.0)

    def to_dict(self) -> dict:
        d = {
            "floor_s": float(self.floor_s),
            "bandwidth": {c: {"fwd": float(v["fwd"]), "bwd": float(v["bwd"])} for c, v in self.bandwidth.items()},
            "sources": dict(self.sources),
        }
        if self.pointwise_s is not None:
            d["pointwise_s"] = {k: float(v) for k, v in self.pointwise_s.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MemoryOpModel:
        pw = d.get("pointwise_s")
        return cls(
            bandwidth={c: {"fwd": float(v["fwd"]), "bwd": float(v["bwd"])} for c, v in d["bandwidth"].items()},
            floor_s=float(d["floor_s"]),
            sources=dict(d.get("sources", {})),
            pointwise_s=None if pw is None else {k: float(v) for k, v in pw.items()},
        )
