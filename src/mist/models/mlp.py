"""Feed-forward networks: GELU MLP (gpt, falcon) and SwiGLU (llama)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import TPGroup
from mist.models.linear import ColumnParallelLinear, RowParallelLinear
from mist.specs.model import ModelSpec


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The MLP's activation, the tanh approximation (`mist profile` times this same call)."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, dtype: torch.dtype, device=None,
                 reduce: bool = True):
        super().__init__()
        self.gated = spec.gated_mlp
        f = spec.ffn_hidden_size
        # SwiGLU: gate and up projections fused into one column-parallel GEMM ([gate | up] per rank).
        self.fc1 = ColumnParallelLinear(spec.hidden_size, 2 * f if self.gated else f, tp,
                                        spec.bias, dtype, device)
        self.fc2 = RowParallelLinear(f, spec.hidden_size, tp, spec.bias, dtype, device, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = gelu(y)
        return self.fc2(y)
