"""Per-operator records of a traced layer, with sizes as sympy expressions in b and s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

B, S = sympy.symbols("b s", positive=True, integer=True)

# Operator kinds a hardware profile knows how to time.
GEMM, ATTENTION, MEMORY, COLLECTIVE, VIEW = "gemm", "attention", "memory", "collective", "view"
# Copies of a gradient into a leaf's .grad: accumulation, costed by the schedule, not the layer.
GRAD_ACCUM = "grad_accum"
UNCOSTED = (VIEW, GRAD_ACCUM)


@dataclass(frozen=True)
class GemmParams:
    """A matrix multiply's cost parameters: `batch` products of (m × k) · (k × n)."""

    m: Any
    n: Any
    k: Any
    batch: Any


@dataclass(frozen=True)
class AttentionParams:
    """An attention kernel's cost parameters (causal: the mask; FLOPs are counted dense)."""

    b: Any
    heads: Any
    kv_heads: Any
    s: Any
    d: Any
    causal: bool
    s_kv: Any = None  # keys per query row when not s (context parallelism's partial attentions)

    @property
    def keys(self):
        return self.s if self.s_kv is None else self.s_kv


@dataclass(frozen=True)
class CollectiveParams:
    """A TP collective's payload bytes and group size."""

    bytes: Any
    group: int


@dataclass(frozen=True)
class FusedParams:
    """A fused pointwise kernel's work (a compiled block's run of pointwise and reduction
    operators): element-operations of each kind of `mist.hardware.memory_ops.POINTWISE_KINDS`
    (the fields, in that order), sympy expressions in b and s."""

    arith: Any
    reduction: Any
    welford: Any
    tanh: Any
    exp: Any
    sigmoid: Any
    erf: Any
    sin: Any
    cos: Any
    log: Any
    random: Any


# the cost parameters of a gemm, attention, collective or fused kernel (other memory ops have
# none beyond bytes)
OpParams = GemmParams | AttentionParams | CollectiveParams | FusedParams | None


@dataclass(frozen=True)
class OpRecord:
    """One dispatched operator of a layer's forward, backward or recomputation.

    phase: "fwd", "bwd" or "recompute" (the forward re-run inside a checkpointed backward).
    op:    aten overload-packet name ("mm", "native_layer_norm", ...) or the collective's name.
    kind:  gemm | attention | memory | collective | view (views move no data and cost nothing)
           | grad_accum.
    shapes_in / shapes_out: tensor shapes; bytes_read / bytes_written: their sizes in bytes.
    flops: floating-point operations (dense count; causal attention counted in full).
    saved_bytes: bytes of new storages this op produced that are kept for backward.
    params: the kind's cost parameters (`GemmParams`, `AttentionParams`, `CollectiveParams`,
           `FusedParams` for a compiled block's fused kernel), sympy expressions in b and s; None
           for the other memory ops and views.
    weight_grad: whether a backward operator is part of the weight-gradient pass W, where the
           runtime says (a compiled block's W graph, `mist.models.weight_split`); None where
           the operator's shapes say (`mist.simulate.weight_grad`).
    """

    index: int
    phase: str
    op: str
    kind: str
    shapes_in: tuple = ()
    shapes_out: tuple = ()
    bytes_read: sympy.Expr = sympy.Integer(0)
    bytes_written: sympy.Expr = sympy.Integer(0)
    flops: sympy.Expr = sympy.Integer(0)
    saved_bytes: sympy.Expr = sympy.Integer(0)
    params: OpParams = None
    weight_grad: bool | None = None

    @property
    def bytes_moved(self) -> sympy.Expr:
        return self.bytes_read + self.bytes_written

    def describe(self) -> str:
        shp = ", ".join("×".join(str(d) for d in s) for s in self.shapes_out)
        return f"{self.phase:9s} {self.kind:10s} {self.op:40s} -> {shp}"


@dataclass(frozen=True)
class OpValues:
    """A costed op evaluated at (b, s) arrays: its name, kind, bytes moved and the kind's
    parameters (the sympy fields of `OpRecord.params` replaced by numpy arrays)."""

    op: str
    kind: str
    bytes_moved: Any
    params: OpParams = None
