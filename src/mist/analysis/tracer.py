"""Trace a layer once with symbolic micro-batch `b` and sequence length `s`.

The layer is built and run (forward and backward) under PyTorch's FakeTensorMode with a
ShapeEnv, so every tensor size is a sympy expression in b and s. A TorchDispatchMode records each
aten operator; `saved_tensors_hooks` record what autograd keeps for backward (by storage, so
views of one buffer count once, and parameters do not count); the model's collective hook
records the TP collectives where they are issued. Nothing here knows about GPUs.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import replace

import sympy
import torch

from mist.analysis.records import (
    ATTENTION,
    COLLECTIVE,
    GEMM,
    GRAD_ACCUM,
    MEMORY,
    VIEW,
    AttentionParams,
    B,
    CollectiveParams,
    GemmParams,
    OpRecord,
    S,
)
from mist.models.collectives import observe_collectives
from mist.torch_compat import (
    DimDynamic,
    FakeTensorMode,
    FloorDiv,
    StatelessSymbolicContext,
    TorchDispatchMode,
    pytree,
    storage_id,
    symbolic_fake_mode,
    unset_fake_temporarily,
)

# Distinct example sizes: the ShapeEnv merges dimensions whose example sizes are equal.
HINT_B, HINT_S = 3, 37

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_CPU_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
ATTENTION_OPS = {
    FLASH_CPU,
    FLASH_CPU_BWD,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
}
# Pure metadata / aliasing operators that launch no kernel (`rotary_tables`: a lookup in
# `mist.models.attention`'s per-process cache of the rotary tables).
_FREE_OPS = {
    "rotary_tables",
    "cp_positions",
    "detach",
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "alias",
    "as_strided",
    "reshape",
    "_reshape_alias",
    "chunk",
    "lift_fresh",
    "empty",
    "empty_like",
    "zeros_like",
    "ones_like",
    "new_empty",
    "new_empty_strided",
    "empty_strided",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "dim",
    "is_same_size",
    "_local_scalar_dense",
    "expand_as",
}


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class _Expr:
    """Converts SymInts / ints into sympy expressions over the canonical symbols B and S."""

    def __init__(self, subs: dict):
        self.subs = subs

    def __call__(self, v) -> sympy.Expr:
        if isinstance(v, torch.SymInt):
            e = sympy.sympify(v.node.expr).xreplace(self.subs)
            # the only integer divisions of sizes are exact ones (the sequence split over the TP
            # ranks, which a sequence-parallel plan requires to divide): plain quotients
            return sympy.expand(e.replace(FloorDiv, lambda a, b: a / b))
        return sympy.Integer(int(v))

    def shape(self, t: torch.Tensor) -> tuple:
        return tuple(self(d) for d in t.shape)

    def numel(self, t: torch.Tensor) -> sympy.Expr:
        n = sympy.Integer(1)
        for d in t.shape:
            n *= self(d)
        return sympy.expand(n)

    def nbytes(self, t: torch.Tensor) -> sympy.Expr:
        return sympy.expand(self.numel(t) * t.element_size())

    def storage_bytes(self, t: torch.Tensor) -> sympy.Expr:
        return self(t.untyped_storage().nbytes())


class Trace:
    """Raw result of one trace: records plus storage bookkeeping for the memory analysis."""

    def __init__(self):
        self.records: list[OpRecord] = []
        self.phase = "fwd"
        self.uses: list[tuple[int, list[int], list[int]]] = []  # (record index, input sids, output sids)
        self.storage_bytes: dict[int, sympy.Expr] = {}
        self.producer: dict[int, int] = {}
        self.saved: dict[int, sympy.Expr] = {}  # sid -> bytes, kept for backward by the forward
        # every tensor handed to autograd's pack hook by the forward (not parameters), one entry per
        # call: (numel, element size, sid) — what a per-tensor activation offload splits
        self.saved_calls: list[tuple[sympy.Expr, int, int]] = []
        self.param_sids: set[int] = set()
        self.cache_sids: set[int] = set()  # a per-process cache's tensors (`_CACHED_OPS`)
        self.grad_sids: set[int] = set()  # the gradients of the parameters and the inputs
        self.param_grad_sids: set[int] = set()  # ... of the parameters
        # (storage, record index): held until that record, whatever its last use (a reentrant
        # checkpoint's re-run outputs, until its inner backward returns)
        self.held_until: list[tuple[int, int]] = []
        # the parameters' gradients are returned together at the end of the backward (a compiled
        # graph's outputs), not each handed to its accumulation as it is made
        self.grads_at_end = False
        self.input_sids: set[int] = set()
        self.output_sids: set[int] = set()
        # the input gradients handed to the previous layer (empty: the last backward op's outputs)
        self.keep_bwd: set[int] = set()
        # the output gradients a compiled backward graph takes (its tangents; an eager trace's
        # backward starts from one it makes)
        self.tangent_sids: set[int] = set()
        # bytes held from the input-gradient pass B to the weight-gradient pass W beyond the saved
        # activations, where the trace knows them (a compiled block's split backward); None: the
        # weight-gradient operators' records say (`mist.simulate.weight_grad`)
        self.weight_grad_held: sympy.Expr | None = None
        # ... and the saved activations W does not read (a compiled block's split backward)
        self.saved_unread_by_w: sympy.Expr | None = None
        # the backward's autograd nodes as [first, end) ranges of record indices (an eager trace):
        # a node releases what it saved, and its gradient inputs, when it is done
        self.node_spans: list[tuple[int, int]] = []
        # record index -> bytes a CPU kernel allocates for the operator's duration: an out=
        # argument of another dtype than the operator computes in is written through a temporary
        # of the computing dtype on a CPU (PyTorch's TensorIterator; a GPU kernel converts as it
        # writes): `cpu_out_scratch`
        self.cpu_scratch: dict[int, sympy.Expr] = {}
        # Every tensor seen is kept alive for the whole trace: storage addresses identify
        # buffers, and a freed address would otherwise be reused by a later, different buffer.
        self.keep: list = []


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace, ex: _Expr):
        super().__init__()
        self.trace, self.ex = trace, ex

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        tr, ex = self.trace, self.ex
        name = func.overloadpacket.__name__
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if _is_tensor(a)]
        outs = [o for o in pytree.tree_leaves(out) if _is_tensor(o)]
        tr.keep.append((ins, outs))
        in_sids = [storage_id(t) for t in ins]
        out_sids = [storage_id(t) for t in outs]
        new = [(t, sid) for t, sid in zip(outs, out_sids) if sid not in set(in_sids) and sid not in tr.storage_bytes]
        # an operator that writes into an argument (in place, or an out= variant) launches a kernel
        # even though its output is no new storage
        writes = func._schema.is_mutable
        if name in _FREE_OPS or (outs and not new and name not in ATTENTION_OPS and not writes):
            kind = VIEW
        elif name in ATTENTION_OPS:
            kind = ATTENTION
        elif name in GEMM_OPS:
            kind = GEMM
        else:
            kind = MEMORY
        idx = len(tr.records)
        for t, sid in new:
            tr.storage_bytes[sid] = ex.storage_bytes(t)
            tr.producer[sid] = idx
        if name in _CACHED_OPS:
            tr.cache_sids.update(out_sids)
        read = written = flops = sympy.Integer(0)
        params = None
        if kind != VIEW:
            # the out= arguments of an out variant are written, not read
            out_args = [kwargs[a.name] for a in func._schema.arguments if a.is_out and _is_tensor(kwargs.get(a.name))]
            read_args = [t for t in ins if not any(t is o for o in out_args)]
            read, written = _traffic(name, args, read_args, outs, ex)
            scratch = cpu_out_scratch(read_args, out_args, ex)
            if scratch != 0:
                tr.cpu_scratch[idx] = scratch
        if kind in (GEMM, ATTENTION):
            params, flops = library_call(kind, func, name, ins, args, kwargs, ex)
        tr.records.append(
            OpRecord(
                index=idx,
                phase=tr.phase,
                op=name,
                kind=kind,
                shapes_in=tuple(ex.shape(t) for t in ins),
                shapes_out=tuple(ex.shape(t) for t in outs),
                bytes_read=read,
                bytes_written=written,
                flops=flops,
                params=params,
            )
        )
        tr.uses.append((idx, in_sids, out_sids))
        return out


def cpu_out_scratch(ins: list, out_args: list, ex: _Expr) -> sympy.Expr:
    """Bytes of the temporaries a CPU kernel writes an operator's out= arguments through: one of
    the computing dtype (the inputs' promoted type; a 0-dimensional tensor promotes only where no
    other input has dimensions) per out= argument of another dtype."""
    if not ins or not out_args:
        return sympy.Integer(0)
    dims = [t for t in ins if t.dim() > 0] or ins
    common = dims[0].dtype
    for t in dims[1:]:
        common = torch.promote_types(common, t.dtype)
    elt = torch.empty((), dtype=common).element_size()
    return sum((ex.numel(o) * elt for o in out_args if o.dtype != common), sympy.Integer(0))


# Operators that return a per-process cache's tensors (the rotary tables, made once per key and
# kept: not a layer's activations, whichever run of the layer first asked for them).
_CACHED_OPS = {"rotary_tables"}

# Indexing operators touch only the selected elements of their large operand.
_GATHERS = {"gather", "embedding", "index_select", "index"}
_SCATTERS = {"scatter_add_", "scatter_", "index_put_", "index_add_"}


def _traffic(name: str, args, ins: list, outs: list, ex: _Expr):
    """Bytes read and written by one kernel."""
    total = lambda ts: sympy.expand(sum((ex.nbytes(t) for t in ts), sympy.Integer(0)))  # noqa: E731
    if name in _GATHERS:
        big = args[0]  # gather(self, ...), embedding(weight, indices), index_select(self, ...)
        small = [t for t in ins if t is not big]
        return total(small) + total(outs), total(outs)
    if name in _SCATTERS:
        small = [t for t in ins if t is not args[0]]
        return total(small), total(small[-1:])
    return total(ins), total(outs)


def library_call(kind: str, func, name: str, ins: list, args, kwargs, ex: _Expr) -> tuple:
    """(parameters, FLOPs) of a GEMM (`ins`: its tensor inputs) or an attention kernel (`args`,
    `kwargs`: its call) — the eager trace's and the compiled analysis's one rule."""
    if kind == GEMM:
        p = _gemm_params(name, ins, ex)
        return p, sympy.expand(2 * p.m * p.n * p.k * p.batch)
    a = _attention_params(func, name, args, kwargs, ex)
    dense = 4 * a.b * a.heads * a.s * a.keys * a.d
    return a, sympy.expand(dense * (2 if "backward" in name else 1))


def _gemm_params(name: str, ins: list, ex: _Expr) -> GemmParams:
    if name in ("mm", "addmm"):
        a, b = ins[-2], ins[-1]
        m, k = ex.shape(a)
        n = ex.shape(b)[1]
        return GemmParams(m=m, n=n, k=k, batch=sympy.Integer(1))
    a, b = ins[-2], ins[-1]
    bat, m, k = ex.shape(a)
    n = ex.shape(b)[2]
    return GemmParams(m=m, n=n, k=k, batch=bat)


def _attention_params(func, name: str, args, kwargs, ex: _Expr) -> AttentionParams:
    # forward: (q, k, v, ...); backward: (grad_out, q, k, v, out, lse, ...)
    tensors = [a for a in args if _is_tensor(a)]
    q, k = (tensors[1], tensors[2]) if "backward" in name else (tensors[0], tensors[1])
    b, hq, s, d = ex.shape(q)
    hk, keys = ex.shape(k)[1], ex.shape(k)[2]
    return AttentionParams(b=b, heads=hq, kv_heads=hk, s=s, d=d, causal=_is_causal(func, args, kwargs), s_kv=keys)


def _is_causal(func, args, kwargs) -> bool:
    """The kernel's `is_causal` argument, wherever the call put it (its default if absent)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "is_causal":
            if i < len(args):
                return bool(args[i])
            return bool(kwargs.get("is_causal", a.default_value))
    return True


def _symbolic(
    mode: FakeTensorMode, shape: tuple, dtype: torch.dtype, dynamic_dims: int, unit_batch: bool = False
) -> torch.Tensor:
    """A fake tensor whose first `dynamic_dims` sizes are symbols (example values from `shape`);
    with `unit_batch` the batch dimension is the constant 1 instead."""
    if unit_batch:
        shape = (1, *shape[1:])
    with unset_fake_temporarily():
        real = torch.zeros(shape, dtype=dtype)
    dyn = [DimDynamic.DYNAMIC] * dynamic_dims + [DimDynamic.STATIC] * (real.dim() - dynamic_dims)
    if unit_batch:
        dyn[0] = DimDynamic.STATIC
    return mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dyn))


def run_trace(
    build, make_inputs, forward, backward, unit_batch: bool = False, seq_shards: int = 1
) -> tuple[Trace, _Expr]:
    """Build a module and trace forward + backward with symbolic (b, s).

    build(trace):                the module (constructed under fake mode: no real memory).
    make_inputs(sym):            the example inputs; `sym(shape, dtype, n)` makes a tensor whose
                                 first n dims are symbolic; the first input's dims 0, 1 are (b, s).
    forward(module, inputs):     the output (tensor) of the traced part.
    backward(output, inputs):    runs autograd from that output.
    unit_batch:                  trace b = 1 exactly. PyTorch makes some reshapes views only
                                 when a dimension is 1, so b = 1 can keep fewer copies than the
                                 general symbolic b (e.g. the key in materialised attention).
    seq_shards:                  the first input holds 1/seq_shards of the sequence (sequence
                                 parallelism): its dim 1 is S/seq_shards. Later inputs may have
                                 sizes derived from it (e.g. a target of the whole sequence).
    """
    trace = Trace()
    mode = symbolic_fake_mode()
    with mode:
        module = build(trace)
        for p in module.parameters():
            trace.param_sids.add(storage_id(p))
        inputs = make_inputs(lambda shape, dtype, n: _symbolic(mode, shape, dtype, n, unit_batch))
        subs: dict = {}
        for t in inputs:  # every input is laid out [b, s, ...]
            lead = [t.shape[1]] if unit_batch else [t.shape[0], t.shape[1]]
            if not all(isinstance(d, torch.SymInt) for d in lead):
                # a PyTorch that silently specializes the example sizes would give constants
                # for every b and s: refuse rather than predict from the example shapes
                raise RuntimeError(
                    f"PyTorch {torch.__version__} did not keep the traced batch/sequence "
                    "sizes symbolic; Mist's analysis needs symbolic shapes"
                )
            for d, sym in ((t.shape[1], S / seq_shards), (None if unit_batch else t.shape[0], B)):
                if d is not None and isinstance(d.node.expr, sympy.Symbol):
                    subs.setdefault(d.node.expr, sym)
        ex = _Expr(subs)
        for t in inputs:
            trace.input_sids.add(storage_id(t))
            trace.storage_bytes[storage_id(t)] = ex.storage_bytes(t)

        def pack(t):
            trace.keep.append(t)
            sid = storage_id(t)
            if trace.phase == "fwd" and sid not in trace.param_sids:
                trace.saved.setdefault(sid, ex.storage_bytes(t))
                trace.saved_calls.append((ex.numel(t), t.element_size(), sid))
            return t

        def on_collective(op, t, group):
            trace.keep.append(t)
            idx = len(trace.records)
            nbytes = ex.nbytes(t)
            trace.records.append(
                OpRecord(
                    index=idx,
                    phase=trace.phase,
                    op=op,
                    kind=COLLECTIVE,
                    shapes_in=(ex.shape(t),),
                    shapes_out=(ex.shape(t),),
                    bytes_read=nbytes,
                    bytes_written=nbytes,
                    params=CollectiveParams(bytes=nbytes, group=group),
                )
            )
            trace.uses.append((idx, [], []))

        with ExitStack() as stack:
            stack.enter_context(observe_collectives(on_collective))
            stack.enter_context(_Recorder(trace, ex))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(module, inputs)
            trace.output_sids.add(storage_id(out))
            trace.phase = "bwd"
            handles = _mark_nodes(out, trace)
            try:
                with _marking_inner_backwards(trace):
                    backward(out, inputs)
            finally:
                for h in handles:
                    h.remove()
        trace.param_grad_sids = {storage_id(p.grad) for p in module.parameters() if p.grad is not None}
        trace.grad_sids |= trace.param_grad_sids | {storage_id(t.grad) for t in inputs if t.grad is not None}
    # Writing a gradient into a leaf's .grad is gradient accumulation, which the schedule
    # accounts for once per micro-batch and parameter, not a cost of the layer.
    for idx, _, outs in trace.uses:
        rec = trace.records[idx]
        if rec.phase != "fwd" and outs and set(outs) <= trace.grad_sids:
            trace.records[idx] = replace(rec, kind=GRAD_ACCUM)
    return trace, ex


def _mark_nodes(out: torch.Tensor, trace: Trace) -> list:
    """Hooks on every autograd node behind `out` that append the records each one runs to
    `trace.node_spans` when it is done; their handles."""
    handles: list = []
    if out.grad_fn is None:
        return handles
    starts: dict = {}
    seen, todo = {out.grad_fn}, [out.grad_fn]
    while todo:
        node = todo.pop()

        def pre(grad_outputs, node=node):
            starts[node] = len(trace.records)

        def post(grad_inputs, grad_outputs, node=node):
            trace.node_spans.append((starts.pop(node, len(trace.records)), len(trace.records)))

        handles += [node.register_prehook(pre), node.register_hook(post)]
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return handles


@contextmanager
def _marking_inner_backwards(trace: Trace):
    """A reentrant checkpoint's backward re-runs its forward and then runs a backward of its own
    (`torch.autograd.backward`) over the nodes that re-run made, which `_mark_nodes` could not hook
    beforehand: inside the traced backward, hook those as each such backward starts."""
    outer, depth = torch.autograd.backward, [0]

    def backward(tensors, *args, **kwargs):
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        # (the traced backward's own call: its nodes are hooked already)
        handles = [h for t in roots for h in _mark_nodes(t, trace)] if depth[0] else []
        depth[0] += 1
        try:
            return outer(tensors, *args, **kwargs)
        finally:
            depth[0] -= 1
            for h in handles:
                h.remove()
            if handles:  # the checkpoint holds the re-run's outputs until its backward returns
                trace.held_until += [(storage_id(t), len(trace.records)) for t in roots]

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = outer


def label_recompute(trace: Trace, module: torch.nn.Module) -> None:
    """Label the ops of `module`'s second run (grad-enabled, inside backward) as recomputation."""

    def pre(mod, args):
        if trace.phase == "bwd" and torch.is_grad_enabled():
            trace.phase = "recompute"

    def post(mod, args, out):
        if trace.phase == "recompute":
            trace.phase = "bwd"

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
