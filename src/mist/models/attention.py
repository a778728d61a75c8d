"""Causal self-attention with grouped-query heads, partial rotary, and two kernels.

flash=True : `scaled_dot_product_attention` (fused kernel: keeps q, k, v, output and log-sum-exp).
flash=False: the scores b·heads·s² are materialised (QKᵀ, mask, softmax, ·V), as in the
             non-flash runs of the paper.

The core (q, k, v → context) is its own module, `AttentionCore`. With `recompute_core` set, it runs
under reentrant checkpointing: only q, k and v are kept for backward and the core is re-run at the
start of its backward (attention recomputation, Korthikanti et al. 2022's "selective"
recomputation: without flash it drops the b·heads·s² softmax output for one more QKᵀ and softmax).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mist.models.collectives import TPGroup
from mist.models.linear import ColumnParallelLinear, RowParallelLinear
from mist.specs.model import ModelSpec


def rotary_cos_sin(seq_len: int, rot_dim: int, device, dtype: torch.dtype, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first cos.shape[-1] dims of x[b, heads, s, d]."""
    r = cos.shape[-1]
    xr, xp = (x[..., :r], x[..., r:]) if r < x.shape[-1] else (x, None)
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    rot = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if xp is None else torch.cat((rot, xp), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, flash: bool, dtype: torch.dtype, device=None, reduce: bool = True):
        super().__init__()
        spec.check_tp(tp.size)
        self.spec, self.tp, self.flash = spec, tp, flash
        d = spec.head_dim
        self.heads = spec.num_heads // tp.size
        # KV heads split across ranks; with fewer KV heads than ranks each rank keeps one copy.
        self.kv_heads = max(spec.num_kv_heads // tp.size, 1)
        kv_total = self.kv_heads * tp.size
        self.qkv = ColumnParallelLinear(
            spec.hidden_size, (spec.num_heads + 2 * kv_total) * d, tp, spec.bias, dtype, device
        )
        self.dense = RowParallelLinear(spec.hidden_size, spec.hidden_size, tp, spec.bias, dtype, device, reduce=reduce)
        self.core = AttentionCore(flash)
        self.recompute_core = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d, hq, hk = self.spec.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(x)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k = k.view(b, s, hk, d).transpose(1, 2)
        v = v.view(b, s, hk, d).transpose(1, 2)
        if self.spec.rotary_dim:
            cos, sin = rotary_cos_sin(s, self.spec.rotary_dim, x.device, x.dtype, self.spec.rope_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(self.core, q, k, v, use_reentrant=True, preserve_rng_state=False)
        else:
            o = self.core(q, k, v)
        o = o.transpose(1, 2).reshape(b, s, hq * d)
        return self.dense(o)


class AttentionCore(nn.Module):
    """softmax(q·kᵀ/√d, causal)·v over [b, heads, s, d] (k, v may have fewer heads: GQA)."""

    def __init__(self, flash: bool):
        super().__init__()
        self.flash = flash

    def forward(self, q, k, v):
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self._materialised(q, k, v)

    def _materialised(self, q, k, v):
        hq, hk = q.shape[1], k.shape[1]
        if hk != hq:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
        s = q.shape[2]
        # scale q (b·heads·s·d) rather than the b·heads·s² scores; mask the scores in place
        scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1)
        return torch.matmul(probs, v)
