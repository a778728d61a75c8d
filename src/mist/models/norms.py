"""LayerNorm and RMSNorm.

RMSNorm keeps only its input and the fp32 reciprocal RMS for backward, the way fused GPU kernels
do, so that what it saves is the same on every device and every PyTorch version. Its forward and
backward are one operator each: on CUDA PyTorch's fused kernels `aten::_fused_rms_norm` and
`aten::_fused_rms_norm_backward` (one pass over the rows each), elsewhere `mist::_fused_rms_norm`
and `mist::_fused_rms_norm_backward`, `torch.library` custom ops of the same arithmetic as plain
tensor code. A custom op is opaque to dispatch modes, so `mist.analysis` (which traces on the CPU)
records the one operator a GPU runs, under the fused kernel's name, instead of the CPU's
decomposition (F.rms_norm decomposes into eight operators on a CPU, and differently per device
and release).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import TPGroup, sp_shared


@functools.lru_cache(maxsize=1)
def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", "CUDA")


def _cuda_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether PyTorch's fused CUDA kernels apply: a CUDA input of the weight's dtype, on a build
    that has them."""
    return x.is_cuda and x.dtype == weight.dtype and _has_cuda_kernels()


@torch.library.custom_op("mist::_fused_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x / rms(x) · weight, rstd = 1 / rms(x) in fp32 of shape [..., 1]."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("mist::_fused_rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    gy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `_rms_norm_op` given the output gradient gy."""
    xf = x.float()
    xhat = xf * rstd
    gw = (gy.float() * xhat).sum(dim=tuple(range(gy.dim() - 1))).to(weight.dtype)
    gxhat = gy.float() * weight.float()
    gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw


@_rms_norm_backward_op.register_fake
def _(gy, x, rstd, weight):
    return torch.empty_like(x), torch.empty_like(weight)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if _cuda_fused(x, weight):
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
            rstd = rstd.view(*x.shape[:-1], 1)
        else:
            y, rstd = _rms_norm_op(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        if _cuda_fused(x, weight) and gy.dtype == x.dtype:
            gx, gw = torch.ops.aten._fused_rms_norm_backward(gy, x, [x.shape[-1]], rstd, weight, [True, True])
        else:
            gx, gw = _rms_norm_backward_op(gy, x, rstd, weight)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight over the last dimension, as the blocks run it (`mist profile` times
    this same call). In a block compiled by `mist.models.compiled` it is the same arithmetic as
    plain tensor code, which Inductor fuses with its neighbours and whose saved tensors
    AOTAutograd's partitioner chooses."""
    if torch.compiler.is_compiling():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return _RMSNormFn.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """`tp`: under sequence parallelism the norm sees its rank's sequence shard, and its weight's
    gradient is summed over the TP group (`sp_shared`)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device=None, tp: TPGroup | None = None):
        super().__init__()
        self.eps, self.tp = eps, tp or TPGroup()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, sp_shared(self.weight, self.tp), self.eps)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device=None, tp: TPGroup | None = None):
        super().__init__()
        self.eps, self.tp = eps, tp or TPGroup()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = sp_shared(self.weight, self.tp), sp_shared(self.bias, self.tp)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


# the norm modules: under ZB-H1 their parameters' gradients are computed in B (`runtime.zero_bubble`)
NORMS = (RMSNorm, LayerNorm)


def make_norm(
    family: str, hidden: int, eps: float, dtype: torch.dtype, device=None, tp: TPGroup | None = None
) -> nn.Module:
    cls = RMSNorm if family == "llama" else LayerNorm
    return cls(hidden, eps, dtype, device, tp)
