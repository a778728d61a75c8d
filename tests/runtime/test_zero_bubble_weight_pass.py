"""ZB-H1's split backward in one process (`runtime.zero_bubble._WeightPass`): B then W give the
gradients of a plain backward, and W computes weight gradients only — no node of the
input-gradient chain (the path from the output to the stage input) runs again, except the
frontier nodes themselves, whose input-side outputs W does not request; and a frontier node that
computed its weight gradient in B anyway (Llama's RMSNorm, a custom autograd.Function) does not run
in W at all. A compiled block's node runs its input-gradient graph in B and its weight-gradient
graph in W (`mist.models.weight_split`)."""

import pytest
import torch
from rt_helpers import SPECS

from mist.models import init_weights
from mist.models.block import DecoderBlock
from mist.models.collectives import TPGroup
from mist.models.compiled import compile_block
from mist.models.head import Head
from mist.models.norms import NORMS
from mist.runtime.zero_bubble import _accumulator, _parents, _upward, _WeightPass


class _Stage(torch.nn.Module):
    """A last pipeline stage: two blocks and the head with its loss."""

    def __init__(self, spec):
        super().__init__()
        self.blocks = torch.nn.ModuleList(DecoderBlock(spec, TPGroup(), True, torch.float32) for _ in range(2))
        self.head = Head(spec, TPGroup(), torch.float32)
        self.run = list(self.blocks)

    def forward(self, x, targets):
        for b in self.run:
            x = b(x)
        return self.head(x, targets)


def _plain_then_forward(stage: _Stage, spec):
    """The stage's parameters, their and its input's gradients from a plain backward, then a
    fresh forward of the same batch: (params, plain, plain_x, loss, x)."""
    params = list(stage.parameters())
    targets = torch.randint(0, spec.vocab_size, (2, 16))
    x0 = torch.randn(2, 16, spec.hidden_size)
    x = x0.clone().requires_grad_()
    stage(x, targets).backward()
    plain = [p.grad.clone() for p in params]
    plain_x = x.grad.clone()
    stage.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    return params, plain, plain_x, stage(x, targets), x


@pytest.mark.parametrize("norms_in_b", [False, True], ids=["norms-in-w", "norms-in-b"])
@pytest.mark.parametrize("family", ["gpt", "llama", "falcon"])
def test_weight_pass_reruns_no_input_gradient_node(family, norms_in_b):
    """Without `in_b`, LayerNorm's autograd node runs again in W for its weight and bias (from the
    output gradient B recorded and W held); with the norms' parameters in B, as the schedule passes
    them, every norm computes its parameters' gradients in B and none runs in W."""
    torch.manual_seed(0)
    spec = SPECS[family]
    stage = _Stage(spec)
    init_weights(stage, seed=0)
    params, plain, plain_x, loss, x = _plain_then_forward(stage, spec)
    in_b = [p for m in stage.modules() if isinstance(m, NORMS) for p in m.parameters(False)] if norms_in_b else []
    wp = _WeightPass(loss, x, params, in_b)
    path, _ = _upward(_accumulator(x), _parents(loss.grad_fn), set())
    below = path - set(wp.nodes)  # the chain's nodes that own no parameter
    norms = [n for n in wp.nodes if "Norm" in n.name()]
    # 2 per block and the final norm; Falcon's parallel block has one norm
    assert len(norms) == {"gpt": 5, "llama": 5, "falcon": 3}[family]
    # a custom autograd.Function (RMSNorm) computes its weight's gradient in B anyway
    in_w = 0 if norms_in_b or family == "llama" else len(norms)
    runs = {"B": 0, "W": 0, "norms B": 0, "norms W": 0}
    phase = ["B"]

    def count(*_):
        runs[phase[0]] += 1

    def count_norm(*_):
        runs["norms " + phase[0]] += 1

    hooks = [n.register_prehook(count) for n in below] + [n.register_prehook(count_norm) for n in norms]
    gx = wp.input_grad(None, x)
    # what W holds of the gradients B recorded: none at a norm whose parameters B computed
    assert sum("Norm" in n.name() for n in wp.grads) == in_w
    phase[0] = "W"
    wp.weight_grads()
    for h in hooks:
        h.remove()

    assert runs["B"] > 10 and runs["W"] == 0, runs
    assert runs["norms B"] == len(norms) and runs["norms W"] == in_w, runs
    torch.testing.assert_close(gx, plain_x)
    for p, g in zip(params, plain):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_compiled_blocks_defer_their_weight_gradient_graph_to_w(family):
    """B computes the input gradient with no block parameter's gradient; W computes them all,
    each compiled block's weight-gradient graph once; together the plain backward's gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    spec = SPECS[family]
    stage = _Stage(spec)
    init_weights(stage, seed=0)
    block_params = [p for b in stage.blocks for p in b.parameters()]
    stage.run = [compile_block(b, split=True) for b in stage.blocks]
    params, plain, plain_x, loss, x = _plain_then_forward(stage, spec)
    wp = _WeightPass(loss, x, params)
    gx = wp.input_grad(None, x)
    assert len(wp.deferred) == 2  # one pending weight-gradient graph per compiled block
    assert all(p.grad is None for p in block_params)
    torch.testing.assert_close(gx, plain_x, rtol=1e-4, atol=1e-6)
    wp.weight_grads()
    assert not wp.deferred
    for p, g in zip(params, plain):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_graph_is_freed_after_w_under_the_runtimes_saved_tensor_hooks(family):
    """After B and W the micro-batch's graph is gone, with the runtime's saved-tensor hooks on.
    Attention saves its own output; kept as it is, that output held its grad_fn, the attention
    node, whose saved tensors held it back — a cycle in C++ that only a backward running the node
    breaks, and under ZB-H1 only B runs it, with the graph retained. The stage input (reached
    from every node of the block) then stayed alive with the whole graph."""
    import gc
    import weakref

    from mist.runtime.activations import SavedTensorManager
    from mist.runtime.memory import MemoryAccount

    torch.manual_seed(0)
    spec = SPECS[family]
    stage = _Stage(spec)
    init_weights(stage, seed=0)
    params = list(stage.parameters())
    saved = SavedTensorManager(torch.device("cpu"), MemoryAccount(), lambda t: False)

    def micro_batch():
        x = torch.randn(2, 16, spec.hidden_size, requires_grad=True)
        with saved.hooks():
            loss = stage(x, torch.randint(0, spec.vocab_size, (2, 16)))
        wp = _WeightPass(loss, x, params)
        wp.input_grad(None, x)
        wp.weight_grads()
        return weakref.ref(x)

    x = micro_batch()
    gc.collect()
    assert x() is None
    assert all(p.grad is not None for p in params)
