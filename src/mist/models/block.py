"""The decoder block of each family, on a tensor-parallel shard.

gpt, llama: x + attn(norm1(x)), then + mlp(norm2(·))      (sequential residuals)
falcon:     x + attn(norm(x)) + mlp(norm(x))               (parallel; one all-reduce for both)

Falcon's norm output enters the tensor-parallel region once for both (`linear.column_parallel`).

With `ModelSpec.hidden_dropout` (training only) the attention and MLP outputs are dropped before
their residual add (falcon: their sum, once): from the shared stream when every TP rank holds the
output whole, from the tensor-parallel stream under sequence parallelism (`mist.models.dropout`'s
`hidden_dropout`, which the embedding output's dropout shares).
"""

from __future__ import annotations

import torch
from torch import nn

from mist.models.attention import Attention
from mist.models.collectives import TPGroup, sp_shared
from mist.models.dropout import hidden_dropout
from mist.models.linear import column_parallel, reduce_scatter_or_all_reduce
from mist.models.mlp import MLP
from mist.models.norms import make_norm
from mist.specs.model import ModelSpec


class DecoderBlock(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        tp: TPGroup | None = None,
        flash: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        tp = tp or TPGroup()
        self.spec, self.tp = spec, tp
        self.parallel = spec.parallel_block
        h, eps = spec.hidden_size, spec.norm_eps
        self.norm1 = make_norm(spec.family, h, eps, dtype, device, tp)
        self.attn = Attention(spec, tp, flash, dtype, device, reduce=not self.parallel)
        self.mlp = MLP(spec, tp, dtype, device, reduce=not self.parallel)
        if not self.parallel:
            self.norm2 = make_norm(spec.family, h, eps, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:  # one norm output enters the tensor-parallel region once for both
            qkv, h = column_parallel(self.norm1(x), [self.attn.qkv, self.mlp.fc1], self.tp)
            out = reduce_scatter_or_all_reduce(self.attn.after_qkv(qkv) + self.mlp.after_fc1(h), self.tp)
            for lin in (self.attn.dense, self.mlp.fc2):
                if lin.bias is not None:
                    out = out + sp_shared(lin.bias, self.tp)
            return x + self._drop(out)
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        """Hidden dropout of a reduced output (the stream as `hidden_dropout` picks it)."""
        return hidden_dropout(y, self.spec.hidden_dropout, self.tp, self.training)
