"""Trace a compiled decoder block: the forward and backward graphs AOTAutograd hands to Inductor.

The block is compiled by `mist.models.compiled.compile_block`, the call the runtime makes, with an
`inner_compile` that keeps each partitioned graph instead of generating code for it; one forward
and backward at small example sizes (batch and sequence marked dynamic) produce both graphs, with
every size a symbol that maps to the canonical (b, s). Nothing is computed: the captured graphs
answer with empty tensors of their outputs' sizes.

From the graphs, into the eager tracer's `Trace`, so that the rest of `mist.analysis` (saved
bytes, liveness, FLOPs) is shared:

* **saved for backward**: the forward graph's outputs that the backward graph takes (the
  partitioner's choice), by storage (views of one buffer count once; parameters not at all), in
  the order the compiled function hands them to autograd's saved-tensor hooks (activation
  offload splits each of those storages whole, `_save_storage`);
* **kernels**: GEMMs and attention run as library calls (extern kernels), priced like the eager
  ones. Inductor fuses the pointwise and reduction operators between them; each maximal run of
  them between two extern kernels is one fused kernel ("fused") that reads the tensors entering
  the run, writes the ones used after it or kept, and computes each operator's elements
  (`FusedParams`: element-operations by kind, `_pointwise_work`), so that a device on which the
  arithmetic outlasts the traffic (a CPU core's tanh) is priced by it
  (`mist.hardware.memory_ops.MemoryOpModel.fused_time`). Inductor's scheduler may split a run into several kernels where iteration
  spaces differ (a row reduction next to a column reduction): the bytes are those of the run, the
  launch count a lower bound;
* **collectives** (tensor and sequence parallelism): PyTorch's functional collectives, recorded
  as the eager trace records them (name, bytes of the whole buffer, group size), each a new
  buffer except an all-reduce that Inductor runs in place (`_reduces_in_place`); they end a fused
  run, as Inductor runs them between kernels;
* **liveness**: a run's intermediates are never materialised; its written tensors live from the
  run to their last use, like an eager operator's outputs;
* **dropout**: Inductor's own (`mist.rules.compiled_blocks`): the forward graph's draw of seeds
  from the default generator (`inductor_seeds`) is a kernel of its own; each uniform draw
  (`inductor_random`, from a seed and the element's index) is pointwise work of the `random`
  kind in the fused kernel that drops; the masks the partitioner keeps, and the seeds a
  recomputed region's re-run reads, are saved tensors like any other;
* **recomputed random operators** (selective recomputation: a checkpointed region inside the
  block): the partitioner wraps each operator tagged as random (the attention kernels, which take
  a dropout probability) so that its re-run in the backward draws what the forward drew; the
  forward saves the generator's state for it, a tensor of the generator's fixed size (5056 bytes
  on the CPU, where the graphs are captured; on CUDA the partitioner takes the device's graph-safe
  generator instead, whose state is not counted by this and was not checked without a GPU).
  `_unwrap_rng_ops` gives the wrapped operator back (priced as itself) and the state a buffer of
  its own, saved like any other.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import sympy
import torch
import torch.fx

from mist.analysis.inductor_rules import fuse_runs, recomputed_values
from mist.analysis.records import (
    ATTENTION,
    COLLECTIVE,
    GEMM,
    MEMORY,
    B,
    CollectiveParams,
    FusedParams,
    OpRecord,
    S,
)
from mist.analysis.tracer import ATTENTION_OPS, GEMM_OPS, Trace, _Expr, library_call
from mist.hardware.memory_ops import POINTWISE_KINDS
from mist.models.compiled import compile_block, is_parameter
from mist.models.weight_split import split_backward

FUSED = "fused"
# Operators that return a view of their first argument (no kernel, no new storage).
_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "permute",
    "transpose",
    "t",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "alias",
    "as_strided",
    "split",
    "split_with_sizes",
    "unbind",
    "detach",
    "diagonal",
    "wait_tensor",  # a functional collective's result, once it has arrived
}
# Mist's own operators that Inductor runs as they are (fallback kernels, not fused), priced as the
# eager operator they run (`mist.hardware.memory_ops` classes): `mist.models.dropout.rank_dropout`'s
# draw. `rank_seed` (its seed) runs on the host: no device traffic, no kernel time.
_OPAQUE = {"seeded_dropout"}
_HOST = {"rank_seed"}
# PyTorch's functional collectives (`mist.models.collectives` inside a compiled block), named as the
# eager block announces them.
_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


@dataclass(frozen=True)
class CompiledGraphs:
    """The partitioned graphs of one compiled block and the names dynamo gave their inputs
    (parameters are named after their module path): the training forward, its backward (whole,
    or as B and W: `mist.models.weight_split`), and, for a checkpointed block, the inference
    forward its first run (without grad) executes."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule  # the backward, or B: the input gradient, then the values W reads
    names: list[str]
    inference: torch.fx.GraphModule | None = None
    inference_names: list[str] | None = None
    wgrad: torch.fx.GraphModule | None = None  # W, the parameters' gradients (a split backward)


def _name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return getattr(t, "__name__", str(t))


def _empty_like_outputs(gm: torch.fx.GraphModule):
    """A boxed callable returning empty tensors (and the sizes) `gm`'s outputs would have."""
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint_int  # lazy: capture only

    outs = list(gm.graph.nodes)[-1].args[0]

    def concrete(v):
        if isinstance(v, torch.Tensor):
            return torch.empty([hint_int(d) for d in v.shape], dtype=v.dtype)
        if isinstance(v, torch.SymInt):
            return hint_int(v)
        return v

    def run(args):
        args.clear()
        return [None if o is None else concrete(o.meta["val"]) for o in outs]

    run._boxed_call = True
    return run


@dataclass(frozen=True)
class TrainingGraphs:
    """One capture of a block's training forward and backward, and that backward as B and W: what
    every compiled variant of the block shares (`capture`). The split is taken when the graphs
    are captured, from the backward as AOTAutograd handed it over, before any trace of it."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    names: list[str]
    b: torch.fx.GraphModule  # the backward as B and W (`mist.models.weight_split.split_backward`)
    w: torch.fx.GraphModule


def _compile_once(block: torch.nn.Module, x: torch.Tensor, grad: bool) -> tuple[list, list]:
    """The graphs AOTAutograd hands to Inductor, and dynamo's input names, for one call of the
    compiled block at x: with `grad`, its forward and backward; without, its inference forward
    (the first run of a checkpointed block)."""
    import torch._functorch.config as functorch_config  # lazy: Inductor only where blocks are compiled
    import torch._inductor.config as inductor_config  # lazy: as above

    graphs: list[torch.fx.GraphModule] = []
    names: list[list[str]] = []

    def inner(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return _empty_like_outputs(gm)

    def note_inputs(gm, example_inputs):
        names.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])

    # caches would answer with compiled code and skip `inner`, and so would dynamo with a frame it
    # compiled before (for the runtime, or for another capture): it starts afresh, and the
    # process's compiled blocks compile again when they next run
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        run = compile_block(block, inner_compile=inner, on_graph=note_inputs)
        if grad:
            out = run(x)
            out.backward(torch.empty_like(out))
        else:
            with torch.no_grad():
                run(x)
        torch._dynamo.reset()
    if len(graphs) != 1 + grad or len(names) != 1:
        raise RuntimeError(
            f"a compiled block gave {len(graphs)} graphs (a graph break?); Mist prices one forward and one backward"
        )
    return graphs, names[0]


def capture_training(block: torch.nn.Module, x: torch.Tensor) -> TrainingGraphs:
    """Compile `block` as the runtime does and keep its graphs for one forward and backward at x."""
    (fw, bw), names = _compile_once(block, x, grad=True)
    split = split_backward(bw, [i for i, name in enumerate(names) if is_parameter(name)])
    return TrainingGraphs(fw, bw, names, split.b_gm, split.w_gm)


def capture(
    block: torch.nn.Module,
    x: torch.Tensor,
    recompute: bool = False,
    split: bool = False,
    training: TrainingGraphs | None = None,
) -> CompiledGraphs:
    """The graphs of `block` compiled as the runtime compiles it, for one forward and backward at
    x; with `recompute`, also the forward without grad that checkpointing runs first; with
    `split`, the backward as B and W. `training`: the training graphs of an equal block at an
    equal x, captured before (`capture_training`), which the variants share.

    The variants are put together from their parts, as the runtime's compiles produce the same
    parts (tests/analysis/test_compiled_block.py compares them with the runtime's compiles): a
    checkpointed block's re-run in the backward compiles the training graphs of the plain block
    (dynamo compiles the grad-mode call apart from the no-grad one), and the runtime's split
    compile (`mist.models.compiled.compile_block(split=True)`) hands the plain block's backward
    to the same `split_backward`."""
    tg = capture_training(block, x) if training is None else training
    inference, inference_names = _compile_once(block, x, grad=False) if recompute else ([None], None)
    return CompiledGraphs(
        tg.fw, tg.b if split else tg.bw, tg.names, inference[0], inference_names, tg.w if split else None
    )


class _Graphs:
    """Storage identities while the `Trace` of the captured graphs is built: a node's storage is
    its base's (through views), keyed (graph, node name)."""

    def __init__(self, trace: Trace, tp: int, target: str = "cuda"):
        self.trace, self.tp, self.target = trace, tp, target
        self.sid: dict[tuple[str, str], int] = {}  # (graph, node name) -> storage id
        self.base: dict[tuple[str, str], tuple[str, str]] = {}
        self.host: set[tuple[str, str]] = set()  # host scalars (a `_HOST` operator's outputs)

    def key(self, g: str, n: torch.fx.Node) -> tuple[str, str]:
        k = (g, n.name)
        while k in self.base:
            k = self.base[k]
        return k

    def new_sid(self, k: tuple[str, str]) -> int:
        if k not in self.sid:
            self.sid[k] = len(self.sid) + 1
        return self.sid[k]


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _tensor_nodes(args) -> list[torch.fx.Node]:
    """The distinct tensor-valued nodes among `args` (nested), in order."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    out: list[torch.fx.Node] = []
    for a in found:
        if isinstance(_val(a), torch.Tensor) and a not in out:
            out.append(a)
    return out


def _placeholders(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm) -> list:
    return list(list(gm.graph.nodes)[-1].args[0])


def trace_compiled(cg: CompiledGraphs, tp: int = 1, seq_shards: int = 1, target: str = "cuda") -> tuple[Trace, _Expr]:
    """The `Trace` of a compiled block's graphs (see the module docstring). A checkpointed block
    (`cg.inference`) runs the inference forward, keeps only its input, and re-runs the training
    forward ("recompute") before the backward. `tp`: the size of the tensor-parallel group its
    collectives span; `seq_shards`: the block's input holds 1/seq_shards of the sequence (sequence
    parallelism); `target`: the device kind whose Inductor rules decide which values are stored
    (`mist.analysis.inductor_rules`)."""
    trace = Trace()
    trace.grads_at_end = True  # (the backward graph's outputs: `mist.analysis.liveness`)
    fw_in = _placeholders(cg.fw)
    if len(fw_in) != len(cg.names):
        raise RuntimeError("the compiled forward's inputs do not match dynamo's graph inputs")
    xs = [n for n, dyn in zip(fw_in, cg.names) if isinstance(_val(n), torch.Tensor) and not is_parameter(dyn)]
    if len(xs) != 1:
        raise RuntimeError(f"a compiled block takes one activation input, found {len(xs)}")
    subs: dict = {}
    for d, sym in ((_val(xs[0]).shape[1], S / seq_shards), (_val(xs[0]).shape[0], B)):
        if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
            subs.setdefault(d.node.expr, sym)
    for gm in (cg.fw, cg.bw) + ((cg.wgrad,) if cg.wgrad is not None else ()):
        _unwrap_rng_ops(gm, subs)
    ex = _Expr(subs)
    st = _Graphs(trace, tp, target)
    graphs = [("fw", cg.fw, cg.names)] + ([("inf", cg.inference, cg.inference_names)] if cg.inference else [])
    for g, gm, names in graphs:  # the block's inputs: one storage each, whichever graph reads them
        for n, dyn in zip(_placeholders(gm), names):
            if isinstance(_val(n), torch.Tensor):
                st.base[(g, n.name)] = ("in", dyn)
                sid = st.new_sid(("in", dyn))
                trace.storage_bytes[sid] = ex.nbytes(_val(n))
                (trace.param_sids if is_parameter(dyn) else trace.input_sids).add(sid)
    fw_out = _outputs(cg.fw)
    bw_in = _placeholders(cg.bw)
    n_saved = sum(not n.name.startswith("tangents") for n in bw_in)
    saved_out, user_out = fw_out[len(fw_out) - n_saved :], fw_out[: len(fw_out) - n_saved]

    def named(gm) -> set[str]:
        return {o.name for o in _outputs(gm) if isinstance(o, torch.fx.Node)}

    if cg.inference is not None:
        # checkpointing keeps the block input; the training forward is the backward's re-run
        _kernels(st, "inf", cg.inference, ex, named(cg.inference))
        x_sid = st.sid[st.key("fw", xs[0])]
        _save_storage(trace, x_sid, _val(xs[0]).element_size())
        trace.output_sids |= {st.sid[st.key("inf", o)] for o in _outputs(cg.inference)[: len(user_out)]}
        trace.phase = "recompute"
        _kernels(st, "fw", cg.fw, ex, named(cg.fw))
    else:
        _kernels(st, "fw", cg.fw, ex, named(cg.fw))
        # saved tensors: by storage, parameters excluded, in the order autograd's hooks see them
        for o in saved_out:
            if not isinstance(o, torch.fx.Node) or not isinstance(_val(o), torch.Tensor):
                continue
            sid = st.sid[st.key("fw", o)]
            if sid in trace.param_sids:
                continue
            if sid not in trace.saved:
                _save_storage(trace, sid, _val(o).element_size())
        trace.output_sids |= {st.sid[st.key("fw", o)] for o in user_out}

    # backward: its saved inputs are the forward's storages, its tangents new ones. AOTAutograd
    # passes the saved sizes first and the saved tensors after them, while the forward returns the
    # sizes last; each saved input is named after the forward's node it is (a generator state
    # after the partitioner's `rng_state_output`)
    saved_order = [o for o in saved_out if not isinstance(_val(o), torch.Tensor)]
    saved_order += [o for o in saved_out if isinstance(_val(o), torch.Tensor)]
    for n, o in zip(bw_in[:n_saved], saved_order):
        if not isinstance(o, torch.fx.Node):
            continue
        if n.name != o.name and not n.name.startswith("rng_state_output"):
            raise RuntimeError(f"the compiled backward's input {n.name} is not the forward's saved {o.name}")
        st.base[("bw", n.name)] = st.key("fw", o)
    for n in bw_in[n_saved:]:
        sid = st.new_sid(("bw", n.name))
        trace.storage_bytes[sid] = ex.nbytes(_val(n))
        trace.tangent_sids.add(sid)
    trace.phase = "bwd"
    _kernels(st, "bw", cg.bw, ex, named(cg.bw))
    if cg.wgrad is not None:
        _weight_graph(st, cg, ex)
    for o, dyn in zip(_outputs(cg.bw), cg.names):
        if isinstance(o, torch.fx.Node):
            sid = st.sid[st.key("bw", o)]
            (trace.grad_sids if is_parameter(dyn) else trace.keep_bwd).add(sid)
    trace.param_grad_sids = set(trace.grad_sids)  # (the input's gradient is in keep_bwd)
    return trace, ex


def _weight_graph(st: _Graphs, cg: CompiledGraphs, ex: _Expr) -> None:
    """Append W's kernels (`cg.wgrad`) after B's, marked as W's; its inputs are the values B
    returns after the gradients, of which what B computed (or took as a tangent) is held from B
    to W and what the forward saved is held anyway."""
    assert cg.wgrad is not None
    trace = st.trace
    b_out = _outputs(cg.bw)
    crossing = b_out[len(cg.names) :]
    w_start = len(trace.records)
    for ph, o in zip(_placeholders(cg.wgrad), crossing):
        st.base[("w", ph.name)] = st.key("bw", o)
    crossing_sids = {st.sid[st.key("bw", o)] for o in crossing if isinstance(_val(o), torch.Tensor)}
    held = crossing_sids - (set(trace.saved) | trace.param_sids)
    trace.weight_grad_held = sympy.expand(sum((trace.storage_bytes[sid] for sid in held), sympy.Integer(0)))
    # (and the saved tensors that W does not read: gone by W where B is handed them once)
    unread = set(trace.saved) - crossing_sids - trace.param_sids
    trace.saved_unread_by_w = sympy.expand(sum((trace.saved[sid] for sid in unread), sympy.Integer(0)))
    _kernels(st, "w", cg.wgrad, ex, {o.name for o in _outputs(cg.wgrad) if isinstance(o, torch.fx.Node)})
    trace.records[:] = [replace(r, weight_grad=r.index >= w_start) if r.phase == "bwd" else r for r in trace.records]
    for o in _outputs(cg.wgrad):
        if isinstance(o, torch.fx.Node):
            trace.grad_sids.add(st.sid[st.key("w", o)])


def _generator_state():
    """The target of a node that copies the random generator's state into a new buffer."""


def _unwrap_rng_ops(gm: torch.fx.GraphModule, subs: dict) -> None:
    """Give `gm`'s operators wrapped by the partitioner's random-state functionalization back
    (`run_and_save_rng_state(op, …)` in the forward, `run_with_rng_state(state, op, …)` in the
    backward), the saved state a node of its own (`_generator_state`), and its size (a symbol of
    the capture, not of b or s) its value, in `subs`. Idempotent."""
    graph = gm.graph
    for n in list(graph.nodes):
        name = _name(n)
        if name == "run_and_save_rng_state":
            op, *args = n.args
            for u in list(n.users):
                if u.args[1] == 1:  # the operator's result
                    u.target, u.args, u.kwargs = op, tuple(args), dict(n.kwargs)
                else:  # the state
                    u.target, u.args, u.kwargs = _generator_state, (), {}
            graph.erase_node(n)
        elif name == "run_with_rng_state":
            _, op, *args = n.args
            n.target, n.args = op, tuple(args)
            if "val" not in n.meta:  # (the wrapper has none: its results are its getitems')
                vals: list = [None] * (1 + max((u.args[1] for u in n.users), default=-1))
                for u in n.users:
                    vals[u.args[1]] = _val(u)
                n.meta["val"] = tuple(vals)
    hint = torch.fx.experimental.symbolic_shapes.guarding_hint_or_throw
    for n in graph.nodes:
        if n.target is _generator_state or (n.op == "placeholder" and n.name.startswith("rng_state_output")):
            for d in _val(n).shape:
                if isinstance(d, torch.SymInt):
                    subs.setdefault(d.node.expr, sympy.Integer(hint(d)))


def _save_storage(trace: Trace, sid: int, element_size: int) -> None:
    """One saved storage, whole: a compiled block's views come back with their strides, so the
    runtime's activation offload splits each saved storage once, as a whole
    (`mist.runtime.activations`), and its elements are the storage's, not a view's."""
    trace.saved[sid] = trace.storage_bytes[sid]
    trace.saved_calls.append((sympy.expand(trace.storage_bytes[sid] / element_size), element_size, sid))


def _kernels(st: _Graphs, g: str, gm: torch.fx.GraphModule, ex: _Expr, keep: set[str]) -> None:
    """Append the kernels of one graph to the trace: extern kernels one by one, the runs of
    pointwise and reduction operators between them as fused kernels. `keep`: the graph's
    outputs (materialised whoever reads them)."""
    nodes = list(gm.graph.nodes)
    # views and getitems alias their source (a multi-output kernel's getitem is its own buffer)
    value: list[torch.fx.Node] = []
    for n in nodes:
        if n.op != "call_function":
            continue
        name = _name(n)
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if name in _VIEWS and src is not None:
            st.base[(g, n.name)] = st.key(g, src)
        elif n.target is operator.getitem and src is not None:
            if _name(src) in _VIEWS:
                st.base[(g, n.name)] = st.key(g, src)
            elif isinstance(_val(n), torch.Tensor):
                value.append(n)
        elif isinstance(_val(n), torch.Tensor) or (
            isinstance(_val(n), (tuple, list)) and any(isinstance(v, torch.Tensor) for v in _val(n))
        ):
            value.append(n)
    users: dict[tuple[str, str], set[str]] = {}  # consumers of each buffer (through views)
    for n in nodes:
        if n.op != "call_function" or _name(n) in _VIEWS or n.target is operator.getitem:
            continue
        for a in _tensor_nodes(n.args) + _tensor_nodes(n.kwargs):
            users.setdefault(st.key(g, a), set()).add(n.name)
    kept = {st.key(g, n) for n in nodes if n.name in keep}
    # pointwise values Inductor recomputes in each kernel that reads them rather than storing them
    recomputed = recomputed_values(gm, _name, _VIEWS, _source, _ROW_OPS, st.target)

    # the kernels in graph order: (what, nodes), "run" for a run of pointwise operators between
    # two kernels of their own, "seeds", "opaque" or a library call's kind
    items: list[tuple[str, list[torch.fx.Node]]] = []
    group: list[torch.fx.Node] = []

    def flush():
        if group:
            items.append(("run", list(group)))
            group.clear()

    for n in value:
        kind = _library_kind(n)
        if _name(n) == "inductor_seeds":  # the seeds of the graph's random draws: a kernel of its own
            flush()
            items.append(("seeds", [n]))
        elif _name(n) in _OPAQUE or _name(n) in _HOST:
            flush()
            items.append(("opaque", [n]))
        elif n.target is operator.getitem and _name(n.args[0]) in _OPAQUE:
            continue  # (its outputs, emitted with it)
        elif kind is not None:
            flush()
            items.append((kind, [n]))
        elif n.target is not operator.getitem or _library_kind(n.args[0]) is None:
            group.append(n)  # (a library call's getitems are its outputs, emitted with it)
    flush()
    items = fuse_runs(items, _source)
    # the position each operator runs at (a use after its own kernel's needs the value stored)
    order = {n.name: i for i, (_, ns) in enumerate(items) for n in ns}
    for what, ns in items:
        if what == "run":
            _emit(st, g, ns, ex, users, kept, order, kind=MEMORY, recomputed=recomputed)
        elif what in ("seeds", "opaque"):
            _emit(st, g, ns, ex, users, kept, order, kind=MEMORY, opaque=what == "opaque")
        else:
            _emit(st, g, ns, ex, users, kept, order, kind=what)


def _source(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose buffer `n` is: through views, and from a getitem to the kernel it reads."""
    while n.args and isinstance(n.args[0], torch.fx.Node) and (_name(n) in _VIEWS or n.target is operator.getitem):
        n = n.args[0]
    return n


# transcendental operators (after Inductor's decompositions), by the kind a profile times them as
_TRANSCENDENTAL = {
    "tanh": "tanh",
    "exp": "exp",
    "exp2": "exp",
    "expm1": "exp",
    "sigmoid": "sigmoid",
    "erf": "erf",
    "erfc": "erf",
    "sin": "sin",
    "cos": "cos",
    "log": "log",
    "log1p": "log",
    "log2": "log",
}
# row reductions: one step per element of their input (mean and variance together: Welford's)
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "argmax", "argmin", "any"}
_WELFORD = {"var_mean", "var", "std", "std_mean"}
_ROW_OPS = _REDUCTIONS | _WELFORD


def _pointwise_work(group: list[torch.fx.Node], ex: _Expr, written: set[str]) -> FusedParams:
    """Element-operations of each kind (`POINTWISE_KINDS`) a fused run computes. An operator runs
    once per element it computes: a reduction once per element of its input, an operator whose
    result the run writes (`written`: node names) once per element of that result, and one whose
    result stays inside the run once per element of each loop that reads it (Inductor inlines it
    into its readers: a rotary table computed from positions is recomputed for every element of
    q and of k it multiplies; readers of one size are taken to share a loop). A power with a
    small integer exponent is that many multiplies (Inductor writes it so), any other an exp and
    a log."""
    inside = {n.name for n in group}

    def readers(n: torch.fx.Node) -> list[torch.fx.Node]:  # through views and getitems
        out = []
        for u in n.users:
            if u.name in inside and u.target is not operator.getitem:
                out.append(u)
            elif _name(u) in _VIEWS or u.target is operator.getitem:
                out.extend(readers(u))
        return out

    runs: dict[str, sympy.Expr] = {}  # elements each operator computes, readers first
    for n in reversed(group):
        if n.target is operator.getitem:
            continue
        first = _tensor_nodes(n.args)
        out = _val(n)
        if _name(n) in _ROW_OPS and first:
            runs[n.name] = ex.numel(_val(first[0]))
        elif isinstance(out, torch.Tensor):
            own = ex.numel(out)
            loops = [runs[u.name] for u in readers(n) if u.name in runs]
            # readers of one size share a loop, in whose body Inductor computes it once
            runs[n.name] = own if n.name in written or not loops else sympy.Add(*set(loops))
    work = {k: sympy.Integer(0) for k in POINTWISE_KINDS}
    for n in group:
        if n.name not in runs:
            continue
        name, count = _name(n), runs[n.name]
        if name in _ROW_OPS:
            work["welford" if name in _WELFORD else "reduction"] += count
        elif name in _TRANSCENDENTAL:
            work[_TRANSCENDENTAL[name]] += count
        elif name == "inductor_random":
            work["random"] += count
        elif name == "inductor_lookup_seed":
            continue  # a seed read once per kernel
        elif name == "pow":
            e = n.args[1] if len(n.args) > 1 else None
            if isinstance(e, (int, float)) and float(e).is_integer() and 0 < abs(e) <= 4:
                work["arith"] += int(abs(e)) * count
            else:
                work["exp"] += count
                work["log"] += count
        else:
            work["arith"] += count
    return FusedParams(**{k: sympy.expand(v) for k, v in work.items()})


def _recomputed_here(group: list[torch.fx.Node], recomputed: set[str]) -> list[torch.fx.Node]:
    """The values of earlier kernels that `group` reads and Inductor left unrealized, with the
    unrealized values they are computed from, in graph order: the run computes them again."""
    inside = {n.name for n in group}
    found: dict[str, torch.fx.Node] = {}
    stack = [a for n in group for a in n.all_input_nodes]
    while stack:
        a = _source(stack.pop())
        if a.name in recomputed and a.name not in inside and a.name not in found:
            found[a.name] = a
            stack.extend(a.all_input_nodes)
    nodes = list(found.values())
    graph_order = {n.name: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(nodes, key=lambda n: graph_order[n.name])


def _library_kind(n: torch.fx.Node) -> str | None:
    """GEMM, ATTENTION or COLLECTIVE for a library call (an extern kernel under Inductor), else
    None."""
    name = _name(n)
    if name in _COLLECTIVES:
        return COLLECTIVE
    return GEMM if name in GEMM_OPS else ATTENTION if name in ATTENTION_OPS else None


def _reduces_in_place(st: _Graphs, g: str, n: torch.fx.Node, users, kept) -> bool:
    """Whether an all-reduce writes into its input's buffer: Inductor lowers it to the in-place
    collective on a copy of the input, and the copy reuses the input's buffer (no kernel) where
    the all-reduce is the input's last reader, as a row-parallel GEMM's output is."""
    if _COLLECTIVES.get(_name(n)) != "all_reduce":
        return False
    k = st.key(g, n.args[0])
    sid = st.sid.get(k)
    own = sid is None or sid not in st.trace.input_sids | st.trace.param_sids
    return own and k not in kept and users.get(k) == {n.name}


def _emit(
    st: _Graphs,
    g: str,
    group: list[torch.fx.Node],
    ex: _Expr,
    users,
    kept,
    order,
    kind: str,
    opaque: bool = False,
    recomputed: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Append one kernel: an extern kernel (`kind` GEMM, ATTENTION or COLLECTIVE), a fused run
    (MEMORY) or, `opaque`, one of Mist's own operators (MEMORY, priced as the eager operator). A
    fused run neither stores the values in `recomputed` nor reads them: where it reads one an
    earlier kernel computed, it computes it again from what that value was computed from."""
    trace = st.trace
    fused = kind == MEMORY and not opaque  # a run of pointwise operators (else one operator's outputs)
    again = _recomputed_here(group, recomputed) if fused else []
    inside = {(g, n.name) for n in group + again}
    last = max(order[n.name] for n in group)
    # the buffers an extern kernel writes: its tensor outputs (getitems of a multi-output)
    outs: list[tuple[tuple[str, str], object]] = []
    if kind == COLLECTIVE and _reduces_in_place(st, g, group[0], users, kept):
        st.base[(g, group[0].name)] = st.key(g, group[0].args[0])
    elif not fused:
        n = group[0]
        getters = [u for u in n.users if u.target is operator.getitem]
        for u in getters or [n]:
            if isinstance(_val(u), torch.Tensor):
                outs.append(((g, u.name), _val(u)))
    else:
        for n in group:
            k = (g, n.name)
            if not isinstance(_val(n), torch.Tensor):
                continue
            later = any(order.get(u, last + 1) > last for u in users.get(k, ()))
            if (later or k in kept) and n.name not in recomputed:
                outs.append((k, _val(n)))
    ins: list[torch.fx.Node] = []
    for n in again + group:
        for a in _tensor_nodes(n.args) + _tensor_nodes(n.kwargs):
            if st.key(g, a) not in inside and a not in ins:
                ins.append(a)
    in_sids = [st.sid[st.key(g, a)] for a in ins if st.key(g, a) in st.sid]
    idx = len(trace.records)
    out_sids = []
    for k, v in outs:
        sid = st.new_sid(k)
        trace.storage_bytes[sid] = ex.nbytes(v)
        trace.producer[sid] = idx
        out_sids.append(sid)
    if _name(group[0]) in _HOST:  # (its tensor input only orders it; its scalar is the host's)
        ins = []
        st.host.update(k for k, _ in outs)
    ins = [a for a in ins if st.key(g, a) not in st.host]  # (a host scalar is read by the host)
    read = sympy.expand(sum((ex.nbytes(_val(a)) for a in ins), sympy.Integer(0)))
    written = sympy.expand(sum((ex.nbytes(v) for k, v in outs if k not in st.host), sympy.Integer(0)))
    if opaque and _name(group[0]) in _OPAQUE:  # it writes every output, also one nobody reads
        vals = _val(group[0])
        written = sympy.expand(sum((ex.nbytes(v) for v in vals if isinstance(v, torch.Tensor)), sympy.Integer(0)))
    params = None
    flops = sympy.Integer(0)
    n0 = group[0]
    op = FUSED if fused else _name(n0)
    if kind == COLLECTIVE:  # the whole buffer: all-gather's output, an all-reduce's or reduce-scatter's input
        op = _COLLECTIVES[op]
        read = written = written if op == "all_gather" else read
        # an all-gather's and a reduce-scatter's group size is an argument (tensor- or
        # context-parallel); only the tensor-parallel group all-reduces
        params = CollectiveParams(
            bytes=read, group=st.tp if op == "all_reduce" else n0.args[1 if op == "all_gather" else 2]
        )
    elif fused:
        params = _pointwise_work(again + group, ex, {k[1] for k, _ in outs})
    elif kind != MEMORY:
        args = tuple(_val(a) if isinstance(a, torch.fx.Node) else a for a in n0.args)
        kwargs = {k: _val(v) if isinstance(v, torch.fx.Node) else v for k, v in n0.kwargs.items()}
        ins_vals = [_val(a) for a in _tensor_nodes(n0.args)]
        params, flops = library_call(kind, n0.target, op, ins_vals, args, kwargs, ex)
    trace.records.append(
        OpRecord(
            index=idx,
            phase=trace.phase,
            op=op,
            kind=kind,
            shapes_in=tuple(ex.shape(_val(a)) for a in ins),
            shapes_out=tuple(ex.shape(v) for _, v in outs),
            bytes_read=read,
            bytes_written=written,
            flops=flops,
            params=params,
        )
    )
    trace.uses.append((idx, in_sids, out_sids))
