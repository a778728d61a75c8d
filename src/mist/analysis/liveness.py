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
    walk = _Walk(trace, hold_grads, cpu)
    fwd_totals = walk.run(fwd, {}, set(trace.saved) | trace.output_sids | trace.input_sids)
    bwd_totals = walk.run(walk.bwd, walk.saved_live(), walk.bwd_keep)
    return _dedupe([t for t, _ in fwd_totals]), _dedupe([t for t, _ in bwd_totals])


def split_pass_bytes(trace: Trace, cpu: bool = False) -> tuple[list, list]:
    """A compiled block's backward as B and W where the ZB-H1 runtime keeps the graph from B to W
    (a stage after the first, `runtime.zero_bubble`). B's values go at their last use, in B or,
    for those B hands to W, in W (W's graph frees each input after its last use:
    `models.weight_split`); so do the saved tensors, which the graph would keep to W's end but
    which are handed to B once (`runtime.activations`). The output gradient B takes is live from
    its start (W may read it too: a block's is its last linear's dY). Returned: the live totals at
    B's operators, and what W adds at each of its operators over what it starts with."""
    walk = _Walk(trace, True, cpu)
    live = walk.saved_live() | {sid: trace.storage_bytes[sid] for sid in trace.tangent_sids}
    totals = walk.run(walk.bwd, live, walk.bwd_keep, after=True)
    is_w = [bool(trace.records[i].weight_grad) for i, _, _ in walk.bwd]
    b_totals = [t for (t, _), w in zip(totals, is_w) if not w]
    # W starts with what the last of B's operators left
    start = [after for (_, after), w in zip(totals, is_w) if not w][-1]
    w_rise = [t - start for (t, _), w in zip(totals, is_w) if w]
    return _dedupe(b_totals), _dedupe(w_rise)


def pass_bytes(trace: Trace, left_out: set, held: set, cpu: bool = False) -> list:
    """The backward without the operators `left_out` (their indices), the storages `held` kept
    to its end and every other one going by the module docstring's rule: the live totals at its
    operators (an eager layer's B on a ZB-H1 stage after the first: `weight_pass.b_pass_bytes`)."""
    walk = _Walk(trace, False, cpu)
    ops = [op for op in walk.bwd if op[0] not in left_out]
    return _dedupe([t for t, _ in walk.run(ops, walk.saved_live(), walk.bwd_keep | held)])


class _Walk:
    """The storages' lifetimes over a trace's operators (the module docstring's rule)."""

    def __init__(self, trace: Trace, hold_grads: bool, cpu: bool):
        self.trace = trace
        self.bwd = [(i, ins, outs) for i, ins, outs in trace.uses if trace.records[i].phase != "fwd"]
        self.hold = trace.param_grad_sids if (hold_grads or trace.grads_at_end) else set()
        self.skip = trace.param_sids | trace.cache_sids | (trace.grad_sids - self.hold)
        self.scratch = trace.cpu_scratch if cpu else {}
        # the gradient handed to the previous layer outlives this layer's backward
        keep = set(trace.keep_bwd)
        if self.bwd and not keep:
            keep = {sid for sid in self.bwd[-1][2]}
        self.bwd_keep = keep | self.hold
        # the last record of the autograd node each backward record runs in; not for a node that
        # re-runs a forward inside (a checkpoint's backward: it runs a whole backward of its own,
        # of nodes made then, which the trace does not see begin and end)
        self.node_of: dict[int, tuple[int, int]] = {}  # record -> (the node's first record, its last)
        for first, end in trace.node_spans:
            if all(trace.records[i].phase == "bwd" for i in range(first, end)):
                for i in range(first, end):
                    self.node_of[i] = (first, end - 1)

    def saved_live(self) -> dict:
        """Backward starts with what forward saved (the layer output has been consumed downstream)."""
        return {sid: b for sid, b in self.trace.saved.items() if sid not in self.skip}

    def _last_use(self, sid: int, i: int) -> int:
        # held to the node's end: what the node got (its saved tensors, the gradients handed to
        # it), not a temporary it makes and drops itself
        trace = self.trace
        node = self.node_of.get(i) if trace.records[i].phase == "bwd" else None
        return node[1] if node is not None and trace.producer.get(sid, -1) < node[0] else i

    def run(self, ops, live: dict, keep: set, after: bool = False) -> list[tuple]:
        """(live total at each of `ops`, the total once it is done where `after`, else None), from
        `live`; `keep`: never freed."""
        trace = self.trace
        last = {}
        for i, ins, _ in ops:
            for sid in ins:
                last[sid] = self._last_use(sid, i)
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
                if sid not in self.skip and sid not in live and sid in trace.storage_bytes:
                    live[sid] = trace.storage_bytes[sid]
            at = sum(live.values(), self.scratch.get(i, sympy.Integer(0)))
            for sid in set(ins) | set(outs) | set(ends.get(i, ())):
                if sid in live and sid not in keep and last.get(sid, i) <= i and trace.producer.get(sid, -1) <= i:
                    del live[sid]
            totals.append((at, sum(live.values(), sympy.Integer(0)) if after else None))
        return totals
