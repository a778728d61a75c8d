"""A whole decoder-only language model on one TP shard: embedding, blocks, head + loss."""

from __future__ import annotations

import torch
from torch import nn

from mist.models.block import DecoderBlock
from mist.models.collectives import TPGroup
from mist.models.embedding import Embedding
from mist.models.head import Head
from mist.specs.model import ModelSpec


def init_weights(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded init: normal(0, std) for matrices, ones/zeros for norm weights/biases and biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None, flash: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None, num_layers: int | None = None):
        super().__init__()
        tp = tp or TPGroup()
        self.spec = spec
        self.embedding = Embedding(spec, tp, dtype, device)
        n = spec.num_layers if num_layers is None else num_layers
        self.blocks = nn.ModuleList(DecoderBlock(spec, tp, flash, dtype, device) for _ in range(n))
        self.head = Head(spec, tp, dtype, device)
        if spec.tie_embeddings and tp.size >= 1:
            self.head.weight = self.embedding.word

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x, target)
