"""LayerNorm and RMSNorm.

RMSNorm is a small autograd function that keeps only its input and the fp32 reciprocal RMS for
backward, the way fused GPU kernels do, so that what it saves is the same on every device and
every PyTorch version (F.rms_norm decomposes differently per device and release).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = (xf * rstd).to(x.dtype) * weight
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        xhat = xf * rstd
        gw = (gy.float() * xhat).sum(dim=tuple(range(gy.dim() - 1))).to(weight.dtype)
        gxhat = gy.float() * weight.float()
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(family: str, hidden: int, eps: float, dtype: torch.dtype, device=None) -> nn.Module:
    cls = RMSNorm if family == "llama" else LayerNorm
    return cls(hidden, eps, dtype, device)
