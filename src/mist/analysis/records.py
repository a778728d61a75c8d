"""Per-operator records of a traced layer, with sizes as sympy expressions in b and s."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

B, S = sympy.symbols("b s", positive=True, integer=True)

# Operator kinds a hardware profile knows how to time.
GEMM, ATTENTION, MEMORY, COLLECTIVE, VIEW = "gemm", "attention", "memory", "collective", "view"
# Copies of a gradient into a leaf's .grad: accumulation, costed by the schedule, not the layer.
GRAD_ACCUM = "grad_accum"
UNCOSTED = (VIEW, GRAD_ACCUM)


@dataclass
class OpRecord:
    """One dispatched operator of a layer's forward, backward or recomputation.

    phase: "fwd", "bwd" or "recompute" (the forward re-run inside a checkpointed backward).
    op:    aten overload-packet name ("mm", "native_layer_norm", ...) or the collective's name.
    kind:  gemm | attention | memory | collective | view (views move no data and cost nothing)
           | grad_accum.
    shapes_in / shapes_out: tensor shapes; bytes_read / bytes_written: their sizes in bytes.
    flops: floating-point operations (dense count; causal attention counted in full).
    saved_bytes: bytes of new storages this op produced that are kept for backward.
    params: the kind's cost parameters —
        gemm: m, n, k, batch;  attention: b, heads, kv_heads, s, d, causal;
        collective: bytes, group;  memory: (none beyond bytes).
    """

    index: int
    phase: str
    op: str
    kind: str
    shapes_in: list[tuple] = field(default_factory=list)
    shapes_out: list[tuple] = field(default_factory=list)
    bytes_read: sympy.Expr = sympy.Integer(0)
    bytes_written: sympy.Expr = sympy.Integer(0)
    flops: sympy.Expr = sympy.Integer(0)
    saved_bytes: sympy.Expr = sympy.Integer(0)
    params: dict = field(default_factory=dict)

    @property
    def bytes_moved(self) -> sympy.Expr:
        return self.bytes_read + self.bytes_written

    def describe(self) -> str:
        shp = ", ".join("×".join(str(d) for d in s) for s in self.shapes_out)
        return f"{self.phase:9s} {self.kind:10s} {self.op:40s} -> {shp}"
