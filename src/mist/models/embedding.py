"""Input embedding: vocab-parallel word embedding (+ learned positions for gpt), then in training
the hidden dropout (`ModelSpec.hidden_dropout`, Megatron-LM's embedding dropout, GPT-2's
`embd_pdrop`) on the output, after the positions are added: from the shared stream when every TP
rank holds the output whole, from the tensor-parallel stream when sequence parallelism leaves each
rank its own shard (`mist.models.dropout.hidden_dropout`, the blocks' rule). Under context
parallelism the output, and so the mask, covers this rank's positions only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mist.models.collectives import TPGroup, VocabShard, reduce_from_tp, split_to_sp
from mist.models.context_parallel import rank_positions
from mist.models.dropout import hidden_dropout
from mist.models.linear import reduce_scatter_or_all_reduce
from mist.specs.model import ModelSpec


class Embedding(VocabShard):
    """Each TP rank holds vocab_size/tp rows; out-of-shard tokens give zeros, then all-reduce."""

    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__(spec, tp)
        self.word = nn.Parameter(torch.empty(self.vocab_local, spec.hidden_size, dtype=dtype, device=device))
        self.position = (
            nn.Parameter(torch.empty(spec.max_position_embeddings, spec.hidden_size, dtype=dtype, device=device))
            if spec.family == "gpt"
            else None
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] tokens → [b, s, h]; under sequence parallelism this rank's [b, s/t, h] shard:
        the partial sums reduce-scattered, or (learned positions, added to the whole sequence
        as Megatron-LM does) all-reduced, the positions added, and this rank's chunk taken; then
        the hidden dropout in training (the module docstring)."""
        positions = self.position is not None
        if self.tp.size > 1:
            local = tokens - self.vocab_start
            outside = (local < 0) | (local >= self.vocab_local)
            x = F.embedding(local.masked_fill(outside, 0), self.word)
            x = x.masked_fill(outside.unsqueeze(-1), 0.0)
            x = reduce_from_tp(x, self.tp) if positions else reduce_scatter_or_all_reduce(x, self.tp)
        else:
            x = F.embedding(tokens, self.word)
        if positions:
            x = x + self._positions(tokens.shape[1], x.device)
            if self.tp.sp:
                x = split_to_sp(x, self.tp)
        return hidden_dropout(x, self.spec.hidden_dropout, self.tp, self.training)

    def _positions(self, s: int, device) -> torch.Tensor:
        """The learned position rows of the rank's s tokens: the first s, or under context
        parallelism those at the positions it holds of a sequence cp times as long."""
        cp = self.tp.cp
        if cp.size == 1:
            return self.position[:s]
        return self.position[rank_positions(s * cp.size, cp.size, cp.rank, device)]
