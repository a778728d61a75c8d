"""The split of a traced layer's backward into B (input gradient) and W (weight gradients), for
the zero-bubble schedule (`simulate.zero_bubble`).

From the symbolic trace's records (`mist.analysis.layer.LayerAnalysis.records`), W's records
by `mist.analysis.weight_pass.is_weight_grad` (the weight-gradient GEMMs and the bias
reductions). (The copies of a gradient into a leaf's .grad are `GRAD_ACCUM` records, priced by the
schedule, not the layer.) A compiled block's backward runs as two graphs, B and W
(`mist.models.weight_split`): its records say which they belong to, and its trace what B hands
to W.

W's time is its share of the layer's backward kernel time applied to the backward's stream time
(without the TP collectives, which B waits for); B is the rest. What W needs beyond what B needs
stays allocated from B to W: the saved activations W reads (the runtime keeps the autograd graph,
but B's other nodes let go of theirs: `analysis.weight_pass.saved_unread_by_w`) and the gradient
of every linear's output — the dYᵀ operand of each weight-gradient GEMM, which
`held_gradient_bytes` sums from the records (for a compiled block: every value B hands to W that
the forward did not save, `LayerAnalysis.weight_grad_held`).
"""

from __future__ import annotations

import numpy as np
import sympy

from mist.analysis.records import COLLECTIVE, GEMM
from mist.analysis.weight_pass import is_weight_grad, weight_grad_records
from mist.simulate.layer_cost import kernel_time


def held_gradient_bytes(la) -> sympy.Expr:
    """Bytes that stay allocated from B to W beyond a layer's saved activations: the output
    gradients the W GEMMs read (their dYᵀ operand, the first input), or what the trace of a
    compiled block says. A sympy expression in b and s."""
    if la.weight_grad_held is not None:
        return la.weight_grad_held
    total = sympy.Integer(0)
    for r in weight_grad_records(la.records):
        if r.kind != GEMM:
            continue
        out = r.shapes_out[0]
        elt = r.bytes_written / sympy.Mul(*out)
        total += sympy.Mul(*r.shapes_in[0]) * elt
    return sympy.expand(total)


def weight_grad_output_bytes(la) -> sympy.Expr:
    """The largest weight gradient a layer's W makes: the output of its biggest weight-gradient
    GEMM (parameter-shaped, so free of b and s), alive until autograd adds it into the
    parameter's gradient — a W's transient on top of what the micro-batches hold."""
    sizes = [r.bytes_written for r in weight_grad_records(la.records) if r.kind == GEMM]
    return sympy.Max(*sizes) if sizes else sympy.Integer(0)


def weight_grad_fraction(profile, la, b, s) -> np.ndarray:
    """W's share of the layer's backward kernel time at (b, s) arrays (0 when it has none)."""
    b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
    ops = la.op_values("bwd", b, s)
    recs = la.ops("bwd")
    total = np.zeros(b.shape)
    weight = np.zeros(b.shape)
    for rec, op in zip(recs, ops):
        if op.kind == COLLECTIVE:
            continue
        t = np.broadcast_to(kernel_time(profile, op, True), b.shape)
        total = total + t
        if is_weight_grad(rec):
            weight = weight + t
    return np.divide(weight, total, out=np.zeros(b.shape), where=total > 0)
