"""Rank layout of a plan and its process groups.

Stages take consecutive global ranks in plan order. Inside a stage of dp × tp ranks, consecutive
ranks form a tensor-parallel group and the data-parallel groups stride across them:
local rank = dp_rank · tp + tp_rank. With fewer KV heads than TP ranks, the tp / num_kv_heads
consecutive ranks that hold copies of one KV head form a "KV group" (their copies' gradients are
summed). `dist.new_group` is collective over the whole world, so every rank creates every group in
the same order; groups of one rank are not created (None: nothing to communicate).
Stages may differ in dp, tp and micro-batch; which rows of a micro-batch travel between which
ranks of neighbouring stages is `handoff.py`'s (`RankGroups.incoming` / `outgoing`).
With tied embeddings the word embedding has a copy on the first and on the last stage, each
vocabulary-sharded by its stage's tp; `tied_segments` cuts the vocabulary at both stages' shard
boundaries and every segment gets the group of all ranks (of both stages, every dp replica) that
hold it (`RankGroups.tied`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from mist.plan import Plan
from mist.runtime.handoff import Piece, StageLayout, incoming, outgoing
from mist.runtime.p2p import Channels

__all__ = ["RankGroups", "StageLayout", "build_groups", "stage_layouts", "tied_segments"]


def stage_layouts(plan: Plan) -> list[StageLayout]:
    out, rank, layer = [], 0, 0
    for i, s in enumerate(plan.stages):
        out.append(
            StageLayout(
                i,
                rank,
                s.dp,
                s.tp,
                layer,
                s.layers,
                s.micro_batch,
                plan.training.seq_len // s.cp,
                s.sequence_parallel,
                s.cp,
            )
        )
        rank += s.gpus
        layer += s.layers
    return out


@dataclass
class RankGroups:
    """This rank's place in the plan and its process groups (None where the group has one rank)."""

    rank: int
    world: int
    stage: StageLayout
    dp_rank: int  # replica index d·cp + c (`StageLayout`): the rank in the gradient-reduction group
    tp_rank: int
    tp_group: object = None
    dp_group: object = None  # the stage's replicas at this TP rank (dp × cp ranks)
    cp_group: object = None
    kv_group: object = None  # ranks sharing copies of one KV head (tp > num_kv_heads)
    kv_size: int = 1
    # pipeline with tied embeddings: (local rows lo, hi, group) of this rank's word-embedding shard
    # per vocabulary segment, in vocabulary order (see `tied_segments`)
    tied: list = field(default_factory=list)
    stages: list[StageLayout] = field(default_factory=list)
    channels: Channels | None = None  # a pipeline's point-to-point groups (`p2p.Channels`)
    created: list = field(default_factory=list)

    @property
    def data_rank(self) -> int:
        """The data replica: which rows of a micro-batch this rank trains on."""
        return self.dp_rank // self.stage.cp

    @property
    def cp_rank(self) -> int:
        """The context-parallel index: which 2 of the sequence's 2·cp chunks this rank holds."""
        return self.dp_rank % self.stage.cp

    def destroy(self) -> None:
        for g in self.created:
            dist.destroy_process_group(g)
        self.created.clear()

    def _neighbour(self, offset: int) -> StageLayout | None:
        j = self.stage.index + offset
        return self.stages[j] if 0 <= j < len(self.stages) else None

    def incoming(self, offset: int) -> list[Piece]:
        """The pieces of a micro-batch tensor this rank receives from the stage `offset` away."""
        other = self._neighbour(offset)
        return [] if other is None else incoming(self.stage, self.data_rank, self.tp_rank, other, self.cp_rank)

    def outgoing(self, offset: int) -> list[Piece]:
        """The pieces of a micro-batch tensor this rank sends to the stage `offset` away."""
        other = self._neighbour(offset)
        return [] if other is None else outgoing(self.stage, self.data_rank, self.tp_rank, other, self.cp_rank)


def tied_segments(first: StageLayout, last: StageLayout, vocab: int) -> list[tuple[int, int, list[int]]]:
    """(vocabulary rows lo, hi, ranks holding them) of the tied word embedding, cut at the shard
    boundaries of both stages; the ranks are every dp replica's TP rank whose shard holds it."""
    cuts = sorted({k * vocab // s.tp for s in (first, last) for k in range(s.tp + 1)})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        ranks = []
        for s in (first, last):
            t = lo // (vocab // s.tp)
            ranks += [s.tp_ranks(r)[t] for r in range(s.replicas)]
        out.append((lo, hi, sorted(ranks)))
    return out


def build_groups(plan: Plan, rank: int, world: int) -> RankGroups:
    layouts = stage_layouts(plan)
    mine = next(s for s in layouts if rank in s.ranks)
    local = rank - mine.first_rank
    rg = RankGroups(rank, world, mine, dp_rank=local // mine.tp, tp_rank=local % mine.tp, stages=layouts)
    kv_heads = plan.model.num_kv_heads

    def make(ranks: list[int]):
        if len(ranks) < 2:
            return None
        g = dist.new_group(ranks)
        if rank not in ranks:
            return None
        rg.created.append(g)
        return g

    for s in layouts:
        for r in range(s.replicas):
            g = make(s.tp_ranks(r))
            if g is not None:
                rg.tp_group = g
        for t in range(s.tp):
            g = make(s.dp_ranks(t))
            if g is not None:
                rg.dp_group = g
        for d in range(s.dp):
            for t in range(s.tp):
                g = make(s.cp_ranks(d, t))
                if g is not None:
                    rg.cp_group = g
        if s.tp > kv_heads:
            rep = s.tp // kv_heads
            for d in range(s.replicas):
                tps = s.tp_ranks(d)
                for k in range(kv_heads):
                    g = make(tps[k * rep : (k + 1) * rep])
                    if g is not None:
                        rg.kv_group, rg.kv_size = g, rep
    if plan.model.tie_embeddings and len(layouts) > 1:
        shard = plan.model.vocab_size // mine.tp
        for lo, hi, ranks in tied_segments(layouts[0], layouts[-1], plan.model.vocab_size):
            g = make(ranks)
            if g is not None:
                start = rg.tp_rank * shard
                rg.tied.append((lo - start, hi - start, g))
    if len(layouts) > 1:
        rg.channels = Channels.create(rank, world)
        rg.created += rg.channels.all()
    return rg
