"""Rank layout of a plan and its process groups.

Stages take consecutive global ranks in plan order. Inside a stage of dp × tp ranks, consecutive
ranks form a tensor-parallel group and the data-parallel groups stride across them:
local rank = dp_rank · tp + tp_rank. With fewer KV heads than TP ranks, the tp / num_kv_heads
consecutive ranks that hold copies of one KV head form a "KV group" (their copies' gradients are
summed). `dist.new_group` is collective over the whole world, so every rank creates every group in
the same order; groups of one rank are not created (None: nothing to communicate).
Pipeline stages (for now all with the same dp and tp) exchange activations and gradients between
the ranks at the same local position of neighbouring stages (`RankGroups.peer`); with tied
embeddings the first and last stage's ranks at the same local position form a "tied group".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from mist.plan import Plan


@dataclass
class StageLayout:
    index: int
    first_rank: int
    dp: int
    tp: int
    first_layer: int
    layers: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.dp * self.tp)

    def tp_ranks(self, dp_rank: int) -> list[int]:
        base = self.first_rank + dp_rank * self.tp
        return list(range(base, base + self.tp))

    def dp_ranks(self, tp_rank: int) -> list[int]:
        return [self.first_rank + d * self.tp + tp_rank for d in range(self.dp)]


def stage_layouts(plan: Plan) -> list[StageLayout]:
    out, rank, layer = [], 0, 0
    for i, s in enumerate(plan.stages):
        out.append(StageLayout(i, rank, s.dp, s.tp, layer, s.layers))
        rank += s.gpus
        layer += s.layers
    return out


@dataclass
class RankGroups:
    """This rank's place in the plan and its process groups (None where the group has one rank)."""

    rank: int
    world: int
    stage: StageLayout
    dp_rank: int
    tp_rank: int
    tp_group: object = None
    dp_group: object = None
    kv_group: object = None      # ranks sharing copies of one KV head (tp > num_kv_heads)
    kv_size: int = 1
    tied_group: object = None    # pipeline: the first and last stage's copies of tied embeddings
    stages: list[StageLayout] = field(default_factory=list)
    created: list = field(default_factory=list)

    def destroy(self) -> None:
        for g in self.created:
            dist.destroy_process_group(g)
        self.created.clear()

    def peer(self, offset: int) -> int | None:
        """The rank with this rank's (dp, tp) position in the stage `offset` away (None: none)."""
        j = self.stage.index + offset
        if not 0 <= j < len(self.stages):
            return None
        return self.stages[j].first_rank + self.dp_rank * self.stages[j].tp + self.tp_rank


def build_groups(plan: Plan, rank: int, world: int) -> RankGroups:
    layouts = stage_layouts(plan)
    mine = next(s for s in layouts if rank in s.ranks)
    local = rank - mine.first_rank
    rg = RankGroups(rank, world, mine, dp_rank=local // mine.tp, tp_rank=local % mine.tp,
                    stages=layouts)
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
        for d in range(s.dp):
            g = make(s.tp_ranks(d))
            if g is not None:
                rg.tp_group = g
        for t in range(s.tp):
            g = make(s.dp_ranks(t))
            if g is not None:
                rg.dp_group = g
        if s.tp > kv_heads:
            rep = s.tp // kv_heads
            for d in range(s.dp):
                tps = s.tp_ranks(d)
                for k in range(kv_heads):
                    g = make(tps[k * rep:(k + 1) * rep])
                    if g is not None:
                        rg.kv_group, rg.kv_size = g, rep
    if plan.model.tie_embeddings and len(layouts) > 1:
        # adjacent stages have the same dp and tp (launch.check_runnable), so the first and the
        # last stage hold the same embedding shards at the same local positions
        a, z = layouts[0], layouts[-1]
        for local in range(a.dp * a.tp):
            g = make([a.first_rank + local, z.first_rank + local])
            if g is not None:
                rg.tied_group = g
    return rg
