"""A whole decoder-only language model on one TP shard: embedding, blocks, head + loss."""

from __future__ import annotations

import torch
from torch import nn

from mist.models.block import DecoderBlock
from mist.models.collectives import TPGroup
from mist.models.embedding import Embedding
from mist.models.head import Head
from mist.rules.init_seeds import INIT_STD, draws_normal, init_constant
from mist.specs.model import ModelSpec


def normal_draw(shape, gen: torch.Generator, std: float = INIT_STD) -> torch.Tensor:
    """The next normal(0, std) draws of `gen` for a parameter of `shape`, in fp32."""
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def init_weights(module: nn.Module, seed: int, std: float = INIT_STD) -> None:
    """Seeded init (`mist.rules.init_seeds`): normal(0, std) for matrices, ones for norm weights,
    zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if draws_normal(p.dim()):
                p.copy_(normal_draw(p.shape, gen, std))
            else:
                p.fill_(init_constant(name))


class CausalLM(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        tp: TPGroup | None = None,
        flash: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        num_layers: int | None = None,
    ):
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
