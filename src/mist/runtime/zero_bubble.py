"""The ZB-H1 zero-bubble pipeline schedule: each backward split into B (the input gradient, sent
upstream at once) and W (the weight gradients, deferred), in the order of
`mist.rules.zero_bubble_order` — the order the simulator times.

B runs `torch.autograd.grad` from the stage's output (or scaled loss) to its input only, keeping
the graph (`retain_graph`), while pre-hooks on the graph's "frontier" nodes record the gradients
that reach them: a frontier node lies on a path from the output to the input and has a
parameter's gradient accumulator among the nodes it reaches without crossing such a path (for a
linear, its matmul's backward; for a norm, the norm's). W later runs `torch.autograd.backward`
from those nodes, fed the recorded gradients, into the parameters each of them owns (those it
reaches off the path): a node's input-side output then leads to no requested parameter, so
autograd does not compute it again (with every parameter requested from every node, W re-ran the
input-gradient chain below each frontier node, the whole backward once more). Frontier nodes
that share a parameter run in one call. A frontier node that computed its weight-side gradients
in B anyway (a custom autograd.Function: RMSNorm's fused backward returns both) is not run again:
W starts below it, from those gradients (`_WeightPass._producer`). B makes every norm compute
its parameters' gradients so (it requests their edges): a norm's backward yields both in one
pass, and left to W it would run again from an output gradient held from B to W. Autograd's
`AccumulateGrad` writes the parameters' .grad and fires their post-accumulate hooks, so the flat
units (`runtime.flat`) accumulate and reduce exactly as they do after a plain backward — their
per-micro-batch state is opened at W's start and closed at its end, in micro-batch order. Each
frontier node's gradient is pinned to the recorded one during W (a node reached both as a root
and through another root would otherwise count twice). The graph is dropped after W. Of the
micro-batch's saved activations it keeps only what W reads: B runs inside
`activations.releasing_in_b()`, and the recorder's hooks around each frontier node say whether
W runs that node again, so every other node lets go of its saved tensors as it reads them
(`runtime.activations`); what the simulator's ZB-H1 memory model holds.

A compiled block (`mist.models.compiled`) is one autograd node whose backward is compiled as
two graphs (`mist.models.weight_split`): during B it runs the input-gradient graph alone and
leaves its weight-gradient graph pending; the node's hook takes it (`_WeightPass._producer`), and
W runs it and feeds the parameters' gradients to their accumulators, as for a node that computed
its weight side in B.

The first stage sends no input gradient, and its W follows its B at once in the order: it runs
its backward whole at W. The plans the runtime refuses are those `zb_h1_problem` names (the plan
check already has): reentrant checkpointing runs its own backward, which cannot be split.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from mist.models import weight_split
from mist.models.norms import NORMS
from mist.rules.zero_bubble_order import FORWARD, INPUT_GRAD, zb_h1
from mist.runtime import activations, p2p
from mist.runtime.phase_timer import PhaseTimer
from mist.runtime.schedule import PipelineSchedule, _spans
from mist.runtime.stage_runner import StageRunner


def _accumulator(t: torch.Tensor):
    """The autograd node that accumulates into leaf `t`'s .grad (created on first request)."""
    view = t.view_as(t).grad_fn
    assert view is not None, "a leaf that requires grad"
    return view.next_functions[0][0]


def _parents(root) -> dict:
    """node → the nodes whose backward feeds it (the reverse of `next_functions`), from `root`."""
    rev: dict = defaultdict(list)
    seen = {root}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            rev[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return rev


def _upward(start, rev, stop: set) -> tuple[set, set]:
    """Nodes reached from `start` toward the output, not crossing `stop`; and the `stop` nodes hit."""
    seen, hit = {start}, set()
    queue = deque([start])
    while queue:
        for parent in rev.get(queue.popleft(), ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, hit


def _share_groups(nodes: list, owned: dict) -> list[tuple[list, list]]:
    """The frontier nodes in groups that share no parameter with one another (a parameter reached
    from two nodes — used twice in the stage — gets its gradient from one backward call, summed by
    autograd, as after a plain backward); each group with its parameters, in node order."""
    group_of: dict = {}  # id(parameter) -> group index
    groups: list[tuple[list, list]] = []
    for node in nodes:
        hit = sorted({group_of[id(p)] for p in owned[node] if id(p) in group_of})
        if not hit:
            groups.append(([], []))
            target = len(groups) - 1
        else:
            target = hit[0]
            for j in reversed(hit[1:]):  # merge the other groups into the first
                g_nodes, g_params = groups[j]
                groups[target][0].extend(g_nodes)
                groups[target][1].extend(g_params)
                for p in g_params:
                    group_of[id(p)] = target
                groups[j] = ([], [])
        groups[target][0].append(node)
        for p in owned[node]:
            if id(p) not in group_of:
                group_of[id(p)] = target
                groups[target][1].append(p)
    return [g for g in groups if g[0]]


class _WeightPass:
    """What one micro-batch's W needs: the frontier nodes, the gradients B recorded at them, the
    graph (kept alive through `root`) and the parameters."""

    def __init__(
        self,
        root: torch.Tensor | GradientEdge,
        x: torch.Tensor,
        params: Sequence[torch.Tensor],
        in_b: Sequence[torch.Tensor] = (),
    ):
        # (a stage's output is kept as its edge once sent: `p2p.SentOutput`)
        self.root: torch.Tensor | GradientEdge | None = root
        self.params = list(params)
        rev = _parents(root.node if isinstance(root, GradientEdge) else root.grad_fn)
        path, _ = _upward(_accumulator(x), rev, set())
        owned: dict = defaultdict(list)  # frontier node -> the parameters it reaches off the path
        for p in self.params:
            for node in _upward(_accumulator(p), rev, path)[1]:
                owned[node].append(p)
        self.nodes = list(owned)
        self.groups = _share_groups(self.nodes, owned)
        # the weight-side edges of the frontier nodes that own only `in_b` parameters: B requests
        # them, so those nodes compute their parameters' gradients in B, once, from the
        # gradient they already have (a norm's backward), and W does not hold that gradient
        b_ids = {id(p) for p in in_b}
        self.b_edges = [
            GradientEdge(nxt, nr)
            for node in self.nodes
            if all(id(p) in b_ids for p in owned[node])
            for nxt, nr in node.next_functions
            if nxt is not None and nxt not in path
        ]
        # the frontier nodes W runs again (not those B makes compute their weight side): the
        # saved tensors every other node reads in B go as it reads them (`runtime.activations`)
        self.again = {node for node in self.nodes if not all(id(p) in b_ids for p in owned[node])}
        self.grads: dict = {}
        # frontier node -> [(its weight-side edge, the gradient B already computed for it)]
        self.produced: dict = {}
        # frontier node (a compiled block) -> its pending weight-gradient graph
        self.deferred: dict = {}
        self._pending_before: dict = {}
        self.handles = [n.register_prehook(self._recorder(n)) for n in self.nodes]
        self.handles += [n.register_hook(self._producer(n, path)) for n in self.nodes]

    def _recorder(self, node):
        def hook(grad_outputs):
            self.grads[node] = grad_outputs
            self._pending_before[node] = weight_split.pending_count()
            activations.read_again(node in self.again)

        return hook

    def _producer(self, node, path: set):
        """A hook that keeps the weight-side gradients a frontier node computed during B anyway,
        or the weight-gradient graph it left pending. Autograd's own nodes compute only the
        outputs a backward needs (B: none of the weight side); a custom autograd.Function
        (RMSNorm's fused kernel) returns them all, and W then starts below it from what B
        computed instead of running it a second time; a compiled block's node leaves its W
        graph pending, and W runs it."""
        sides = [(i, nxt, nr) for i, (nxt, nr) in enumerate(node.next_functions) if nxt is not None and nxt not in path]

        def hook(grad_inputs, grad_outputs):
            activations.read_again(False)
            if weight_split.pending_count() > self._pending_before.get(node, weight_split.pending_count()):
                self.deferred[node] = weight_split.take_pending()
                self.grads.pop(node, None)  # W starts below it: its output gradients can go now
                return
            got = [(GradientEdge(nxt, nr), grad_inputs[i]) for i, nxt, nr in sides]
            if got and all(g is not None for _, g in got):
                self.produced[node] = got
                self.grads.pop(node, None)

        return hook

    def input_grad(self, grad: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """B: the input's gradient, recording the frontier's gradients; the graph is kept."""
        assert self.root is not None, "B runs once, before W"
        try:
            with weight_split.deferring_weights(), activations.releasing_in_b():
                inputs = [get_gradient_edge(x), *self.b_edges]
                gx, *_ = torch.autograd.grad(self.root, inputs, grad, retain_graph=True, allow_unused=True)
        finally:
            for h in self.handles:
                h.remove()
            left = weight_split.pending_count()
            weight_split.drop_pending()
        if left:  # each is taken by its node's hook: one left would lose its weights' gradients
            raise RuntimeError(f"{left} compiled weight-gradient pass(es) left with no frontier node to run them")
        return gx if gx is not None else torch.zeros_like(x)

    def roots(self, nodes, pins: list) -> tuple[list, list]:
        """W's backward roots for frontier `nodes` and their gradients: below a node that computed
        its weight side in B, the edges it produced; otherwise the node itself with the gradients
        B recorded at it, pinned to them (a pre-hook, appended to `pins` for the caller to remove)."""
        roots, grads = [], []
        for node in nodes:
            if node in self.deferred:
                edges = node.next_functions
                for k, g in self.deferred.pop(node)():
                    if edges[k][0] is not None:
                        roots.append(GradientEdge(*edges[k]))
                        grads.append(g)
                continue
            if node in self.produced:
                for edge, g in self.produced[node]:
                    roots.append(edge)
                    grads.append(g)
                continue
            recorded = self.grads.get(node)
            if recorded is None:
                continue
            pins.append(node.register_prehook(lambda _, r=recorded: r))
            for i, g in enumerate(recorded):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    grads.append(g)
        return roots, grads

    def weight_grads(self) -> None:
        """W: from the frontier, with the recorded gradients, into the parameters' .grad (one
        backward per group of frontier nodes, into the parameters the group owns)."""
        pins: list = []
        try:
            for nodes, params in self.groups:
                roots, grads = self.roots(nodes, pins)
                if roots:
                    torch.autograd.backward(roots, grads, inputs=params)
        finally:
            for h in pins:
                h.remove()
        self.nodes, self.grads, self.produced, self.deferred, self.root = [], {}, {}, {}, None


class ZeroBubbleSchedule(PipelineSchedule):
    """ZB-H1 on stage `stage` of `stages` (see the module docstring); p2p as `PipelineSchedule`."""

    def run(
        self, runner: StageRunner, micro_batches, loss_scale: float = 1.0, timer: PhaseTimer | None = None
    ) -> list[torch.Tensor]:
        G, first, last = self.G, self.i == 0, self.i == self.stages - 1
        span = _spans(timer)
        sends = p2p.Sends()
        inflight: dict[int, tuple] = {}
        waiting: dict[int, tuple] = {}
        losses: list[torch.Tensor] = []
        params = [p for u in runner.units for p in u.params]
        norm_ids = {id(p) for m in runner.module.modules() if isinstance(m, NORMS) for p in m.parameters(False)}
        in_b = [p for p in params if id(p) in norm_ids]

        def forward(g: int) -> None:
            self._forward(runner, micro_batches, g, span, sends, inflight, losses)

        def input_grad(g: int) -> None:
            x, out, act = inflight.pop(g)
            grad = None if last else self._recv_grad(out, g)
            root = out * (loss_scale / G) if last else out.edge
            if first:  # nothing upstream: the whole backward runs at W, right after
                waiting[g] = (root, grad, None, act)
                return
            with span("bwd", g):
                wp = _WeightPass(root, x, params, in_b)
                gx = wp.input_grad(grad, x)
            self._send_grad(gx, g, sends.gradient_list())
            waiting[g] = (root, grad, wp, act)

        def weight_grads(g: int) -> None:
            root, grad, wp, act = waiting.pop(g)
            # the W time of its own ("wgrad"); the first stage's W is its whole backward
            w_span = span("wgrad", g) if wp is not None else nullcontext()
            with span("bwd", g), w_span:
                runner.begin_backward(g, last=g == G - 1)
                if wp is None:
                    torch.autograd.backward(root, grad)
                else:
                    wp.weight_grads()
                runner.end_backward(act)

        run = {FORWARD: forward, INPUT_GRAD: input_grad}
        for kind, g in zb_h1(self.i, self.stages, G):
            run.get(kind, weight_grads)(g)
        sends.finish()
        return losses
