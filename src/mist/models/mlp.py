"""Feed-forward networks: GELU MLP (gpt, falcon) and SwiGLU (llama).

With `recompute_activation` set (activation recomputation, `run_block(activation=True)`), the MLP keeps
only fc1's output for backward: fc2 takes the activation as a function and re-runs it in its own
backward (`mist.models.checkpointing.act_linear`), so the activation's output (f wide; SwiGLU's
silu and product too) is not kept — about a quarter of a block's saved bytes, for one elementwise
pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import TPGroup
from mist.models.dropout import checkpoint
from mist.models.linear import ColumnParallelLinear, RowParallelLinear
from mist.specs.model import ModelSpec

GELU_APPROXIMATE = "tanh"  # the default of ModelSpec.gelu_approximate, what `mist profile` times


def gelu(x: torch.Tensor, approximate: str = GELU_APPROXIMATE) -> torch.Tensor:
    """The GELU MLP's activation (`mist profile` times this same call with the tanh form; the exact
    erf form is one elementwise kernel of the same bytes)."""
    return F.gelu(x, approximate=approximate)


def _swiglu_grad(y: torch.Tensor, a: torch.Tensor, ga: torch.Tensor) -> torch.Tensor:
    """The gradient at y = [gate | up] of silu(gate)·up given ga, with a = silu(gate): both halves
    written into one buffer (silu_backward and the product, out= variants) instead of the cat that
    chunk's backward adds — three kernels, bit for bit autograd's values."""
    gate, up = y.chunk(2, dim=-1)
    gy = torch.empty_like(y)
    g_gate, g_up = gy.chunk(2, dim=-1)
    torch.mul(ga, a, out=g_up)
    torch.ops.aten.silu_backward.grad_input(ga * up, gate, grad_input=g_gate)
    return gy


class _SwiGLU(torch.autograd.Function):
    """silu(gate)·up of y = [gate | up]: the forward autograd would run (silu, product; keeping y,
    whose views gate and up are, and silu(gate)), the backward of `_swiglu_grad`."""

    @staticmethod
    def forward(ctx, y):
        gate, up = y.chunk(2, dim=-1)
        a = F.silu(gate)
        ctx.save_for_backward(y, a)
        return a * up

    @staticmethod
    def backward(ctx, ga):
        y, a = ctx.saved_tensors
        return _swiglu_grad(y, a, ga)


class Activation(nn.Module):
    """The MLP's activation as a module (so that its re-run in backward can be labelled)."""

    def __init__(self, gated: bool, gelu_approximate: str = GELU_APPROXIMATE):
        super().__init__()
        self.gated = gated
        self.gelu_approximate = gelu_approximate

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.gated and torch.compiler.is_compiling():
            # a compiled block (`mist.models.compiled`): plain autograd, which Inductor fuses
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.gated:
            return _SwiGLU.apply(y)
        return gelu(y, self.gelu_approximate)

    def grad(self, y: torch.Tensor, ga: torch.Tensor) -> torch.Tensor:
        """The gradient at y of forward(y) given ga, by the backward kernels autograd runs for
        forward (gelu_backward; silu_backward and two products), without forward(y) itself."""
        if self.gated:
            return _swiglu_grad(y, F.silu(y.chunk(2, dim=-1)[0]), ga)
        return torch.ops.aten.gelu_backward(ga, y, approximate=self.gelu_approximate)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device=None, reduce: bool = True):
        super().__init__()
        self.gated = spec.gated_mlp
        f = spec.ffn_hidden_size
        # SwiGLU: gate and up projections fused into one column-parallel GEMM ([gate | up] per rank).
        self.fc1 = ColumnParallelLinear(spec.hidden_size, 2 * f if self.gated else f, tp, spec.bias, dtype, device)
        self.fc2 = RowParallelLinear(f, spec.hidden_size, tp, spec.bias, dtype, device, reduce=reduce)
        self.act = Activation(self.gated, spec.gelu_approximate)
        self.recompute_activation = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after_fc1(self.fc1(x))

    def after_fc1(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP's output from its first projection's output y."""
        if self.recompute_activation and torch.is_grad_enabled():
            if torch.compiler.is_compiling():  # the partitioner keeps y and re-runs the activation
                return self.fc2(checkpoint(self.act, y, dropout=False))
            return self.fc2(y, act=self.act)
        return self.fc2(self.act(y))
