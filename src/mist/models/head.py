"""Final norm, LM head (column-parallel over the vocabulary) and vocab-parallel cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import TPGroup, VocabShard, all_reduce_, copy_to_tp
from mist.models.linear import gather_linear
from mist.models.norms import make_norm
from mist.specs.model import ModelSpec


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy over logits split by vocabulary across the TP group.

    Keeps the fp32 exponentials of the shifted local logits (N·V/t·4 bytes) and their row sums
    (N·4 bytes) for backward: the softmax, with the division left to the backward's one pass.
    Full-size passes: forward max, shift (16-bit logits: the fp32 upcast and the subtraction in one
    kernel), exp in place, row sum; backward one product written in the logits' dtype (the
    one-hot target subtracted first from the saved exponentials, in place, a gather-sized scatter).
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, tp):
        vmax = logits.max(dim=-1, keepdim=True)[0].float()  # the max of 16-bit values is exact
        all_reduce_(vmax, tp, op="max")
        # fp32 logits are shifted in place; 16-bit ones into a new fp32 tensor, the upcast and the
        # shift in one pass. Worked on in place from here.
        lf = logits.sub_(vmax) if logits.dtype == torch.float32 else logits - vmax
        local = target - vocab_start
        outside = (local < 0) | (local >= lf.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = lf.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce_(picked, tp)
        exp = lf.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce_(sum_exp, tp)
        loss = (torch.log(sum_exp) - picked).mean()
        ctx.save_for_backward(exp, sum_exp, local, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, local, outside = ctx.saved_tensors
        scale = g / local.numel()
        # d loss / d logit = (softmax − onehot)·scale = (exp − Σexp·onehot)·scale/Σexp
        hit = (~outside).to(exp.dtype) * sum_exp
        exp.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        del hit  # (not held through the product below)
        grad = torch.empty_like(exp, dtype=ctx.logits_dtype)
        torch.mul(exp, (scale / sum_exp).unsqueeze(-1), out=grad)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_start: int, tp: TPGroup):
    loss = _VocabParallelCrossEntropy.apply(logits, target, vocab_start, tp)
    return loss


class Head(VocabShard):
    """norm → logits (local vocabulary shard) → mean cross-entropy."""

    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__(spec, tp)
        self.norm = make_norm(spec.family, spec.hidden_size, spec.norm_eps, dtype, device, self.tp)
        # With tied embeddings the runtime points `weight` at the embedding's word table.
        self.weight = nn.Parameter(torch.empty(self.vocab_local, spec.hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.tp.sp:  # x is this rank's sequence shard; the logits are of the whole sequence
            logits = gather_linear(self.norm(x), self.weight, None, self.tp)
        else:
            logits = F.linear(copy_to_tp(self.norm(x), self.tp), self.weight)
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), target.flatten(), self.vocab_start, self.tp)
