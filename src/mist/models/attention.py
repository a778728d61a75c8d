"""Causal self-attention with grouped-query heads, partial rotary, and two kernels.

flash=True : `scaled_dot_product_attention` (fused kernel: keeps q, k, v, output and log-sum-exp).
flash=False: the scores b·heads·s² are materialised (QKᵀ, mask, softmax, ·V), as in the
             non-flash runs of the paper.

The core (q, k, v → context) is its own module, `AttentionCore`. With `recompute_core` set, it runs
under reentrant checkpointing: only q, k and v are kept for backward and the core is re-run at the
start of its backward (attention recomputation, Korthikanti et al. 2022's "selective"
recomputation: without flash it drops the b·heads·s² softmax output for one more QKᵀ and softmax).

Attention dropout (`ModelSpec.attention_dropout`, training only) drops the softmax probabilities of
the materialised attention, drawn from the tensor-parallel stream (each rank's own heads;
`mist.models.dropout`); flash attention with it is refused (`ModelSpec.check_attention`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import CPGroup, TPGroup
from mist.models.context_parallel import chunk_ranges, context_attention, positions
from mist.models.dropout import checkpoint, rank_dropout, rank_seed
from mist.models.linear import ColumnParallelLinear, RowParallelLinear
from mist.specs.model import ModelSpec


@functools.lru_cache(maxsize=16)
def _rotary_tables(seq_len: int, rot_dim: int, base: float, dtype: torch.dtype, device: torch.device):
    """(cos, signed sin) of shape [seq_len, 1, rot_dim], built once per key: cos = [cos | cos],
    signed sin = [−sin | sin], so that rotate_half(x)·sin = roll(x, rot_dim/2)·(signed sin).
    Plain tensors even when first asked for under inference mode (an evaluation)."""
    with torch.inference_mode(False):
        return _build_tables(seq_len, rot_dim, base, dtype, device)


@functools.lru_cache(maxsize=16)
def _context_tables(
    seq_len: int, rot_dim: int, base: float, dtype: torch.dtype, device: torch.device, cp: int, rank: int
):
    """The rows of `_rotary_tables(seq_len)` at the positions context-parallel rank `rank` of `cp`
    holds (`mist.models.context_parallel.positions`), built once per key."""
    cos, sin = _rotary_tables(seq_len, rot_dim, base, dtype, device)
    with torch.inference_mode(False):
        idx = positions(seq_len, cp, rank, device)
        return cos[idx], sin[idx]


def _build_tables(
    seq_len: int, rot_dim: int, base: float, dtype: torch.dtype, device: torch.device, cp: CPGroup | None = None
):
    """The rotary tables of positions 0..seq_len−1, or under context parallelism (`cp`) of the
    rank's seq_len positions (its two chunks, `mist.models.context_parallel.chunk_ranges`)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    if cp is not None and cp.size > 1:
        (a, b), (c, e) = chunk_ranges(seq_len * cp.size, cp.size, cp.rank)
        f32 = dict(device=device, dtype=torch.float32)
        pos = torch.cat((torch.arange(a, b, **f32), torch.arange(c, e, **f32)))
    else:
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), -1).view(seq_len, 1, rot_dim), torch.cat((-sin, sin), -1).view(seq_len, 1, rot_dim)


@torch.library.custom_op("mist::rotary_tables", mutates_args=())
def rotary_tables(
    seq_len: int, rot_dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of `_rotary_tables`, from its per-process cache: a block's forward
    launches no kernel for them after the first step. Runs call the cache directly; the symbolic
    trace (a SymInt sequence length) calls this one opaque operator, so that `mist.analysis`
    records a lookup (free) rather than the table's construction, which a step does not run. The tables
    are the cache's (2·seq_len·rot_dim elements per key; 256 KiB for s 2048, 32 rotary dims in
    16 bits), not activations: the rotary function keeps them off autograd's saved tensors."""
    return _rotary_tables(int(seq_len), int(rot_dim), float(base), dtype, torch.device(device))


@rotary_tables.register_fake
def _(seq_len, rot_dim, base, dtype, device):
    return (
        torch.empty(seq_len, 1, rot_dim, dtype=dtype, device=device),
        torch.empty(seq_len, 1, rot_dim, dtype=dtype, device=device),
    )


def _rotate_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, d: int, sign: float) -> None:
    """In place on t [b, s, n·d]: the first cos.shape[-1] dims of its first `heads` heads of d
    become x·cos + sign·roll(x, r/2)·(signed sin) — the rotation (sign 1) or its transpose (−1:
    roll by r/2 is its own inverse and moves the signed sin to its negative). Three kernels."""
    b, s = t.shape[0], t.shape[1]
    r = cos.shape[-1]
    x = t.view(b, s, -1, d)[:, :, :heads, :r]
    rolled = x.roll(r // 2, dims=-1)
    # (the tables expanded to x's shape: broadcasting in addcmul_ fails on symbolic sizes)
    x.mul_(cos).addcmul_(rolled, sin.expand_as(rolled), value=sign)


def _rotated(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """Out of place, the rotation `_rotate_` applies in place (sign 1): a new [b, s, n·d]."""
    b, s = qkv.shape[0], qkv.shape[1]
    r = cos.shape[-1]
    x = qkv.view(b, s, -1, d)
    head = x[:, :, :heads]
    rot = head[..., :r] * cos + head[..., :r].roll(r // 2, dims=-1) * sin
    if r < d:
        rot = torch.cat((rot, head[..., r:]), dim=-1)
    return torch.cat((rot, x[:, :, heads:]), dim=2).view(b, s, -1)


class _RotaryQK(torch.autograd.Function):
    """Rotary on the q and k heads of the fused QKV projection's output, in place (as the
    original's fused rotary kernel on packed qkv): q, k and v stay views of one buffer, nothing is
    saved for backward (the tables are the cache's), and the backward rotates the incoming
    gradient of that buffer — the fresh concatenation of the q/k/v gradients that `split`'s
    backward builds, used by nothing else — back in place."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads: int, d: int):
        ctx.mark_dirty(qkv)
        ctx.tables, ctx.heads, ctx.d = (cos, sin), heads, d
        _rotate_(qkv, cos, sin, heads, d, 1.0)
        return qkv

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.tables
        g = g.contiguous()
        _rotate_(g, cos, sin, ctx.heads, ctx.d, -1.0)
        return g, None, None, None, None


def rotary_qk_(
    qkv: torch.Tensor, seq_len: int, rot_dim: int, heads: int, d: int, base: float, cp: CPGroup | None = None
) -> torch.Tensor:
    """Rotate-half rotary on the first rot_dim dims of the first `heads` heads (q, then k) of
    qkv [b, s, n·d], in place; returns qkv. The caller splits the result into q, k and v (as
    `Attention` does): the backward rotates its incoming gradient in place, which must be that
    split's fresh concatenation (as flash-attn's in-place rotary and Megatron's fused softmax
    work on their incoming gradients). Under context parallelism (`cp`) qkv holds the rank's
    seq_len positions of a sequence cp times as long, rotated by their global positions."""
    if torch.compiler.is_compiling():
        # a compiled block (`mist.models.compiled`): the tables and the rotation as plain tensor
        # code in the graph (the tables are s·rot_dim elements), which Inductor fuses
        return _rotated(qkv, *_build_tables(seq_len, rot_dim, float(base), qkv.dtype, qkv.device, cp), heads, d)
    if isinstance(seq_len, int) and cp is not None and cp.size > 1:
        cos, sin = _context_tables(seq_len * cp.size, rot_dim, float(base), qkv.dtype, qkv.device, cp.size, cp.rank)
    elif isinstance(seq_len, int):  # a run: the cache itself, without the custom op's dispatch
        cos, sin = _rotary_tables(seq_len, rot_dim, float(base), qkv.dtype, qkv.device)
    else:  # the symbolic trace: one opaque lookup (of the rank's rows under context parallelism)
        cos, sin = rotary_tables(seq_len, rot_dim, base, qkv.dtype, qkv.device)
    return _RotaryQK.apply(qkv, cos, sin, heads, d)


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
        self.core = AttentionCore(flash, spec.attention_dropout, tp)
        self.recompute_core = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after_qkv(self.qkv(x))

    def after_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The attention from its QKV projection's output [b, s, ·] (the whole sequence, also
        under sequence parallelism)."""
        d, hq, hk = self.spec.head_dim, self.heads, self.kv_heads
        b, s = qkv.shape[0], qkv.shape[1]
        if self.spec.rotary_dim:
            qkv = rotary_qk_(qkv, s, self.spec.rotary_dim, hq + hk, d, self.spec.rope_theta, self.tp.cp)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k = k.view(b, s, hk, d).transpose(1, 2)
        v = v.view(b, s, hk, d).transpose(1, 2)
        if self.tp.cp.size > 1:  # flash only (`plan.check_plan`)
            o = context_attention(q, k, v, self.tp.cp)
        else:
            # the dropout's seed from the rank's own stream, taken outside a recomputed region
            # (`mist.models.dropout`): its re-run draws the forward's mask
            seed = rank_seed(self.tp, q) if self.core.drops() else None
            if self.recompute_core and torch.is_grad_enabled():
                o = checkpoint(self.core, q, k, v, seed, dropout=self.core.p > 0)
            else:
                o = self.core(q, k, v, seed)
        o = o.transpose(1, 2).reshape(b, s, hq * d)
        return self.dense(o)


class _CausalMask(torch.autograd.Function):
    """The scores above the diagonal set to −inf, in place, for the softmax that follows. Its
    backward passes the gradient through as it is: the softmax gives probability 0 at every masked
    position, so its input gradient y·(dy − Σ y·dy) is already exactly 0 there, and autograd's own
    backward of `masked_fill_` (`grad.masked_fill(mask, 0)`) would be one more read and write of
    the b·heads·s² gradient that changes no value (the fused scaled-masked softmax of Megatron-LM
    has no such pass either). Nothing is saved for backward, where `masked_fill_` keeps the mask.
    Eager blocks only: a compiled block runs the plain `masked_fill_`, which Inductor fuses."""

    @staticmethod
    def forward(ctx, scores, mask):
        ctx.mark_dirty(scores)
        return scores.masked_fill_(mask, float("-inf"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AttentionCore(nn.Module):
    """softmax(q·kᵀ/√d, causal)·v over [b, heads, s, d] (k, v may have fewer heads: GQA), the
    probabilities dropped with probability p in training (materialised attention only)."""

    def __init__(self, flash: bool, p: float = 0.0, tp: TPGroup | None = None):
        super().__init__()
        self.flash, self.p, self.tp = flash, p, tp or TPGroup()

    def drops(self) -> bool:
        """Whether the forward drops probabilities (training, p > 0, materialised attention)."""
        return self.training and self.p > 0 and not self.flash

    def forward(self, q, k, v, seed=None):
        """`seed`: of the probabilities' dropout on tp > 1 (`mist.models.dropout.rank_seed`)."""
        if self.flash:
            if self.training and self.p > 0:  # refused at every entry (`ModelSpec.check_attention`)
                raise RuntimeError("flash attention runs without attention dropout in Mist")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self._materialised(q, k, v, seed)

    def _materialised(self, q, k, v, seed):
        hq, hk = q.shape[1], k.shape[1]
        if hk != hq:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
        s = q.shape[2]
        # scale q (b·heads·s·d) rather than the b·heads·s² scores; mask the scores in place
        scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        if torch.compiler.is_compiling():  # a compiled block: Inductor fuses the mask into the softmax
            scores = scores.masked_fill_(mask, float("-inf"))
        else:
            scores = _CausalMask.apply(scores, mask)
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.p > 0:  # this rank's heads: its own stream
            probs = rank_dropout(probs, self.p, self.tp, seed)
        return torch.matmul(probs, v)
