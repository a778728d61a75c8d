"""`act_linear`: fc2 re-running the MLP activation in backward gives the plain MLP's output and
gradients bit for bit (the same kernels in the same order), in bf16 and under autocast."""

import pytest
import torch

from mist.models.checkpointing import act_linear
from mist.models.mlp import Activation


def grads(x, w, act, recompute, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = act_linear(x, w, act) if recompute else torch.nn.functional.linear(act(x), w)
    return (out, *torch.autograd.grad(out.float().square().sum(), (x, w)))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True), (torch.float32, False)])
def test_same_output_and_gradients_bit_for_bit(gated, dtype, autocast):
    torch.manual_seed(0)
    f = 48
    x = torch.randn(2, 16, 2 * f if gated else f, dtype=dtype, requires_grad=True)
    w = torch.randn(24, f, dtype=dtype, requires_grad=True)
    act = Activation(gated)
    plain, ours = grads(x, w, act, False, autocast), grads(x, w, act, True, autocast)
    for a, b in zip(plain, ours):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_keeps_the_input_not_the_activation():
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        act_linear(x, w, Activation(False))
    assert len(kept) == 2 and kept[0] is x and kept[1] is w


def test_gradcheck_in_double():
    for gated in (False, True):
        x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, 4 if gated else 8, dtype=torch.float64, requires_grad=True)
        act = Activation(gated)
        assert torch.autograd.gradcheck(lambda x, w, act=act: act_linear(x, w, act), (x, w))
