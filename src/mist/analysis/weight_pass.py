"""Which records of a traced layer's backward are its weight-gradient pass W, and what W does to
the memory it starts with.

A backward operator is a weight-gradient operator when it reduces over the tokens to a
parameter-shaped result — every output's shape is free of b and s (and not a scalar) while an
input's is not: the weight-gradient GEMM of every linear (dW = dYᵀ·X, (out × b·s)·(b·s × in)) and
a bias gradient's reduction over the tokens (an embedding's dense backward too). Everything else
in "bwd" — input-gradient GEMMs, attention, norms (whose backward yields the input and the
weight gradient at once; the ZB-H1 runtime computes both in B), elementwise and the TP
collectives — is B. A compiled block's records say which graph they belong to
(`OpRecord.weight_grad`).

Under ZB-H1 the runtime (`runtime.zero_bubble`) runs a micro-batch's W node by node, in the
order of the stage's parameters (its layers in order, each in the order it registers them: a
block's linears in forward order), and autograd releases each node's saved tensors once it has
run. A linear's saved input that nothing in B reads (a norm's output, the MLP's activation) is
then gone before the later linears' weight gradients are made: on the CPU loop's Llama, the
head's weight gradient, made last, came after the block had released 4.9 MB of its inputs.
`weight_pass_bytes` gives a layer's W, from the trace's storages: the most it adds at once to
what it started with (its largest weight gradient less what W released before making it), and
what it releases in all.
"""

from __future__ import annotations

import sympy

from mist.analysis.liveness import pass_bytes
from mist.analysis.records import GEMM, MEMORY, VIEW, B, OpRecord, S


def _symbolic(shape) -> bool:
    return any(sympy.sympify(d).free_symbols & {B, S} for d in shape)


def is_weight_grad(rec: OpRecord) -> bool:
    """Whether a traced record is part of W (see the module docstring)."""
    if rec.weight_grad is not None:
        return rec.weight_grad
    if rec.phase != "bwd" or rec.kind not in (GEMM, MEMORY) or not rec.shapes_out:
        return False
    outs_fixed = all(len(s) > 0 and not _symbolic(s) for s in rec.shapes_out)
    return outs_fixed and any(_symbolic(s) for s in rec.shapes_in)


def weight_grad_records(records) -> list[OpRecord]:
    """The W records of a layer, in trace order."""
    return [r for r in records if is_weight_grad(r)]


def weight_pass_bytes(trace, records) -> tuple[list[sympy.Expr], sympy.Expr]:
    """A layer's W as the runtime runs it (module docstring), from its eager trace: (the candidates
    for the most W adds at once over what it starts with — one per weight-gradient GEMM, its
    output less the saved activations released before it —, the saved bytes W releases). A
    saved storage is released by W when W's operators are its only readers in the backward, at
    the last of them in W's order. Sympy expressions in b and s."""
    wgrad = {r.index for r in weight_grad_records(records)}
    bwd_uses: dict[int, set[int]] = {}
    for i, ins, _ in trace.uses:
        # (a view reads nothing: the transposed input of a weight-gradient GEMM is made by one)
        if records[i].phase != "fwd" and records[i].kind != VIEW:
            for sid in ins:
                bwd_uses.setdefault(sid, set()).add(i)
    saved = {sid for sid in trace.saved if sid not in trace.param_sids | trace.cache_sids}
    ins_of = {i: ins for i, ins, _ in trace.uses}

    def order(i: int) -> int:
        # the forward position of the linear: where its saved input was made (a bias reduction,
        # which reads no saved input, goes with the trace order)
        made = [trace.producer.get(sid, i) for sid in ins_of.get(i, ()) if sid in saved]
        return min(made) if made else i

    w_order = sorted(wgrad, key=order)
    rank = {i: k for k, i in enumerate(w_order)}
    released: dict[int, sympy.Expr] = {}
    for sid in saved:
        uses = bwd_uses.get(sid, set())
        if uses and uses <= wgrad:
            at = max(uses, key=rank.__getitem__)
            released[at] = released.get(at, sympy.Integer(0)) + trace.saved[sid]
    candidates, before = [], sympy.Integer(0)
    for i in w_order:
        if records[i].kind == GEMM:
            candidates.append(sympy.expand(records[i].bytes_written - before))
        before += released.get(i, sympy.Integer(0))
    return candidates or [sympy.Integer(0)], sympy.expand(before)


def _read_by_w(trace, wgrad: set) -> set:
    """The storages W's operators (`wgrad`, their indices) read."""
    return {sid for i, ins, _ in trace.uses if i in wgrad for sid in ins}


def saved_unread_by_w(trace, records) -> sympy.Expr:
    """The saved bytes that no W operator reads (storages; parameters and caches left out): what
    a micro-batch no longer holds once its B is done, where the runtime lets each node that W does
    not run again release its saved tensors in B (`runtime.activations`). A sympy expression in b
    and s."""
    read = _read_by_w(trace, {r.index for r in weight_grad_records(records)})
    skip = trace.param_sids | trace.cache_sids | read
    return sympy.expand(sum((v for sid, v in trace.saved.items() if sid not in skip), sympy.Integer(0)))


def b_pass_bytes(trace, records, cpu: bool = False) -> list:
    """An eager layer's backward as B runs it on a ZB-H1 stage after the first
    (`runtime.zero_bubble`): without W's operators and the views of what they make. The storages
    W reads (the linears' saved inputs, the output gradients B records for them) stay to B's end,
    held for W; every other one goes as in a plain backward, B letting go of the saved tensors W
    does not read (`runtime.activations`). The live totals at B's operators
    (`liveness.pass_bytes`)."""
    wgrad = {r.index for r in weight_grad_records(records)}
    made_by_w = {sid for sid, i in trace.producer.items() if i in wgrad}
    views = {i for i, _, outs in trace.uses if outs and set(outs) <= made_by_w}
    return pass_bytes(trace, wgrad | views, _read_by_w(trace, wgrad), cpu)
