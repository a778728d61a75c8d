"""Memory of a traced layer from the lifetimes of its storages.

A storage lives from the operator that creates it to its last use, unless autograd keeps it for
backward (then until its last use in backward) or it is the layer's output. Parameters and their
gradients are model state, not activations, and are left out. The live total at each operator is
a sympy polynomial in (b, s); the peak is the maximum of those polynomials.
"""

from __future__ import annotations

import sympy

from mist.analysis.tracer import Trace


def _dedupe(exprs: list) -> list:
    seen, out = set(), []
    for e in exprs:
        e = sympy.expand(e)
        if e not in seen:
            seen.add(e)
            out.append(e)
    return out or [sympy.Integer(0)]


def live_bytes(trace: Trace) -> tuple[list, list]:
    """Live activation bytes at each forward op, and at each backward/recompute op."""
    fwd = [(i, ins, outs) for i, ins, outs in trace.uses if trace.records[i].phase == "fwd"]
    bwd = [(i, ins, outs) for i, ins, outs in trace.uses if trace.records[i].phase != "fwd"]
    skip = trace.param_sids | trace.grad_sids
    keep_fwd = set(trace.saved) | trace.output_sids

    def run(ops, live: dict, keep: set) -> list:
        last = {}
        for i, ins, _ in ops:
            for sid in ins:
                last[sid] = i
        totals = []
        for i, ins, outs in ops:
            for sid in outs:
                if sid not in skip and sid not in live and sid in trace.storage_bytes:
                    live[sid] = trace.storage_bytes[sid]
            totals.append(sum(live.values(), sympy.Integer(0)))
            for sid in set(ins) | set(outs):
                if sid in live and sid not in keep and last.get(sid, i) <= i and trace.producer.get(sid, -1) <= i:
                    del live[sid]
        return totals

    fwd_live: dict = {}
    fwd_totals = run(fwd, fwd_live, keep_fwd | trace.input_sids)
    # Backward starts with what forward saved (the layer output has been consumed downstream).
    bwd_live = {sid: b for sid, b in trace.saved.items() if sid not in skip}
    # the gradient handed to the previous layer outlives this layer's backward
    bwd_keep = set(trace.keep_bwd)
    if bwd and not bwd_keep:
        bwd_keep = {sid for sid in bwd[-1][2]}
    bwd_totals = run(bwd, bwd_live, bwd_keep)
    return _dedupe(fwd_totals), _dedupe(bwd_totals)
