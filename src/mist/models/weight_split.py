"""A compiled block's backward in two graphs: B, the input gradient, and W, the weight gradients
(`mist.models.compiled` compiles each with Inductor; `mist.analysis.compiled` prices the same two).

The rule: W is every operator of the backward graph that only the parameters' gradients need;
B is every other one. B's graph returns the backward's outputs with the parameters' gradients
left out (None) and, after them, the values W reads from B or from the backward's inputs (the
"crossing" values: the gradients of the linears' outputs that their weight-gradient GEMMs read,
the saved activations those GEMMs read, a norm's normalised input, ...). W's graph takes the
crossing values and returns the backward's outputs with only the parameters' gradients filled.

Run back to back (`SplitBackward.__call__`), B then W give the whole backward. The ZB-H1 schedule
(`mist.runtime.zero_bubble`) runs B alone inside `deferring_weights()`: each compiled block's
backward then leaves its W pending (`take_pending`), the crossing values held, and the schedule
runs it later, with the micro-batch's weight-gradient pass — what the eager blocks' autograd
nodes do by computing only the outputs a backward asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx


@dataclass(frozen=True)
class BackwardSplit:
    """The two graphs of one backward and how their values line up (see the module docstring)."""

    b_gm: torch.fx.GraphModule
    w_gm: torch.fx.GraphModule
    n_outputs: int  # the backward's outputs (one per input of the forward)
    weight_outputs: tuple[int, ...]  # which of them are the parameters' gradients
    crossing: tuple[torch.fx.Node, ...]  # the values B hands to W (nodes of the backward graph)


def _ancestors(roots) -> set:
    seen: set = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def split_backward(gm: torch.fx.GraphModule, weight_outputs: Sequence[int]) -> BackwardSplit:
    """B and W of backward graph `gm`, whose outputs `weight_outputs` are the parameters'
    gradients."""
    nodes = list(gm.graph.nodes)
    out_node = nodes[-1]
    outs = list(out_node.args[0])
    w_idx = tuple(sorted(set(weight_outputs)))
    b_need = _ancestors(outs[i] for i in range(len(outs)) if i not in w_idx)
    w_need = _ancestors(outs[i] for i in w_idx)
    w_ops = [n for n in nodes if n in w_need and n not in b_need and n.op == "call_function"]
    w_set = set(w_ops)
    w_results = {outs[i] for i in w_idx if isinstance(outs[i], torch.fx.Node)}
    # (and every size the backward takes: Inductor expects a graph to take, as inputs, the sizes
    # its tensors' shapes are made of)
    crossing = tuple(
        n
        for n in nodes
        if (n in w_need and n not in w_set and (n in w_results or any(u in w_set for u in n.users)))
        or (n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor))
    )

    def blank(i: int, keep: bool):  # an output of B or W: its value, or None where it is the other's
        return outs[i] if keep else None

    b_graph = torch.fx.Graph()
    env: dict = {}
    for n in nodes:
        if n.op == "placeholder" or (n.op == "call_function" and n in b_need):
            env[n] = b_graph.node_copy(n, lambda a: env[a])
    b_vals = [blank(i, i not in w_idx) for i in range(len(outs))] + list(crossing)
    _output(b_graph, torch.fx.node.map_arg(b_vals, lambda a: env[a]), out_node)

    w_graph = torch.fx.Graph()
    wenv: dict = {}
    for c in crossing:
        p = w_graph.placeholder(c.name)
        p.meta = dict(c.meta)
        wenv[c] = p
    for n in w_ops:
        wenv[n] = w_graph.node_copy(n, lambda a: wenv[a])
    w_vals = [blank(i, i in w_idx) for i in range(len(outs))]
    _output(w_graph, torch.fx.node.map_arg(w_vals, lambda a: wenv[a]), out_node)
    return BackwardSplit(
        torch.fx.GraphModule(gm, b_graph),
        torch.fx.GraphModule(gm, w_graph),
        len(outs),
        w_idx,
        crossing,
    )


def _output(graph: torch.fx.Graph, values: list, like: torch.fx.Node) -> None:
    """The output node of a split graph: every value user-visible (Inductor keeps its strides),
    as the backward's outputs are."""
    node = graph.output(tuple(values))
    node.meta = dict(like.meta)
    node.meta["user_visible_output_idxs"] = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]


# Deferred weight-gradient passes: set while the ZB-H1 schedule runs a micro-batch's B. A
# process-wide flag, not a thread-local: on a GPU autograd runs the backward on its device thread.
_deferring = False
_pending: list[Callable[[], list[tuple[int, torch.Tensor]]]] = []


@contextmanager
def deferring_weights():
    """Inside: each split backward runs B alone and leaves its W in `pending`. (B keeps the graph
    for W: AOTAutograd then checks that no backward was compiled to reuse saved buffers, which a
    compiled block's is not, `mist.models.compiled`, with its config saying so.)"""
    import torch._functorch.config as functorch_config  # lazy: as `mist.models.compiled`

    global _deferring
    _deferring = True
    try:
        with functorch_config.patch(donated_buffer=False):
            yield
    finally:
        _deferring = False


def pending_count() -> int:
    return len(_pending)


def take_pending() -> Callable[[], list[tuple[int, torch.Tensor]]]:
    """The W left by the split backward that ran last: called, it returns (edge, gradient) pairs,
    the edge an index into that backward's autograd node's `next_functions`."""
    return _pending.pop()


def drop_pending() -> None:
    _pending.clear()


class SplitBackward:
    """A compiled backward as B and W (boxed, as AOTAutograd calls Inductor's code): `b_fn` and
    `w_fn` are the compiled graphs of `split`; `edges[i]`, the index among the autograd node's
    `next_functions` of the forward input whose gradient is output i (None: not a tensor)."""

    def __init__(self, split: BackwardSplit, b_fn, w_fn, edges: Sequence[int | None]):
        # (an attribute of the object: wrappers copy the callable's own attributes, not its class's)
        self._boxed_call = True
        self.n, self.w_idx = split.n_outputs, split.weight_outputs
        self.b_fn, self.w_fn, self.edges = b_fn, w_fn, list(edges)

    def __call__(self, args: list) -> list:
        res = list(self.b_fn(args))
        grads, crossing = res[: self.n], res[self.n :]
        # (no other reference to the crossing values: W's graph, called boxed, takes its list and
        # frees each value after its last use, as the trace prices it)
        del res

        def weights() -> list[tuple[int, torch.Tensor]]:
            w_args = list(crossing)
            crossing.clear()
            w = self.w_fn(w_args)
            return [(e, w[i]) for i in self.w_idx if w[i] is not None and (e := self.edges[i]) is not None]

        if _deferring:
            _pending.append(weights)
        else:
            w = self.w_fn(crossing)
            for i in self.w_idx:
                grads[i] = w[i]
        return grads


def tensor_edges(example_inputs: Sequence) -> list[int | None]:
    """For each input of a compiled forward, its index among the tensor inputs (the autograd
    node's `next_functions`), or None for a size."""
    edges: list[int | None] = []
    k = 0
    for v in example_inputs:
        if isinstance(v, torch.Tensor):
            edges.append(k)
            k += 1
        else:
            edges.append(None)
    return edges
