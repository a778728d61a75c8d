"""Memory of a traced layer from the lifetimes of its storages.

A storage lives from the operator that creates it to its last use, unless autograd keeps it for
backward (then until its last use in backward) or it is the layer's output. In the backward a
storage that existed before an autograd node began and is last used inside it lives until that
node is done: the engine releases a node's saved tensors, and the gradients handed to it, when its
function returns (a linear's saved input, read by its weight-gradient GEMM, is still there while
its input-gradient GEMM runs); a temporary the node makes itself goes at its last use. A
reentrant checkpoint's node re-runs a forward and then a backward of its own: the rule holds for
the nodes of that inner backward, and the re-run's outputs stay until it returns
(`Trace.held_until`).

Left out: parameters (model state, not activations) and a process-wide cache's tensors (the
rotary tables); and the parameters' gradients where the runtime adds each into its gradient
buffer as it is made. Where it does not (a unit that flattens its gradients after its backward:
`mist.rules.grad_accumulation`), a parameter's gradient stays from the operator that makes it to
the end of the layer's backward: `live_bytes(..., hold_grads=True)`. A compiled block's backward
graph returns its gradients together, so they stay to its end either way (`Trace.grads_at_end`).

On a CPU target the live total at an operator also has the temporaries its CPU kernel allocates
(`Trace.cpu_scratch`: an out= argument of another dtype than the operator computes in).

The live total at each operator is a sympy polynomial in (b, s); the peak is the maximum of those
polynomials.
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


def live_bytes(trace: Trace, hold_grads: bool = False, cpu: bool = False) -> tuple[list, list]:
    """Live activation bytes at each forward op, and at each backward/recompute op (with the
    parameters' gradients held from where they are made to the end: `hold_grads`; with the
    temporaries a CPU kernel allocates for the op: `cpu`, `Trace.cpu_scratch`)."""
    fwd = [(i, ins, outs) for i, ins, outs in trace.uses if trace.records[i].phase == "fwd"]
    bwd = [(i, ins, outs) for i, ins, outs in trace.uses if trace.records[i].phase != "fwd"]
    hold = trace.param_grad_sids if (hold_grads or trace.grads_at_end) else set()
    skip = trace.param_sids | trace.cache_sids | (trace.grad_sids - hold)
    keep_fwd = set(trace.saved) | trace.output_sids
    scratch = trace.cpu_scratch if cpu else {}

    # the last record of the autograd node each backward record runs in; not for a node that
    # re-runs a forward inside (a checkpoint's backward: it runs a whole backward of its own, of
    # nodes made then, which the trace does not see begin and end)
    node_of: dict[int, tuple[int, int]] = {}  # record -> (the node's first record, its last)
    for first, end in trace.node_spans:
        if all(trace.records[i].phase == "bwd" for i in range(first, end)):
            for i in range(first, end):
                node_of[i] = (first, end - 1)

    def last_use(sid: int, i: int) -> int:
        # held to the node's end: what the node got (its saved tensors, the gradients handed to
        # it), not a temporary it makes and drops itself
        node = node_of.get(i) if trace.records[i].phase == "bwd" else None
        return node[1] if node is not None and trace.producer.get(sid, -1) < node[0] else i

    def run(ops, live: dict, keep: set) -> list:
        last = {}
        for i, ins, _ in ops:
            for sid in ins:
                last[sid] = last_use(sid, i)
        indices = {i for i, _, _ in ops}
        for sid, end in trace.held_until:
            if end - 1 in indices:
                last[sid] = max(last.get(sid, end - 1), end - 1)
        ends: dict[int, list] = {}
        for sid, i in last.items():
            ends.setdefault(i, []).append(sid)
        totals = []
        for i, ins, outs in ops:
            for sid in outs:
                if sid not in skip and sid not in live and sid in trace.storage_bytes:
                    live[sid] = trace.storage_bytes[sid]
            totals.append(sum(live.values(), scratch.get(i, sympy.Integer(0))))
            for sid in set(ins) | set(outs) | set(ends.get(i, ())):
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
    bwd_totals = run(bwd, bwd_live, bwd_keep | hold)
    return _dedupe(fwd_totals), _dedupe(bwd_totals)
