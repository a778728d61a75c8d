"""Who sends which rows of a micro-batch to whom between neighbouring pipeline stages.

Every stage sees the same global micro-batch of B = dp · b samples (the plan keeps dp · micro_batch
equal on every stage); dp replica d of a stage holds samples [d·b, (d+1)·b) of it, and all TP ranks
of a replica hold the same activation (the full hidden state of those samples). Across a stage
boundary the receiver's rows may therefore come from several sender replicas, as slices of their
tensors. A receiver at TP position t takes each overlapping replica's slice from that replica's
TP rank t mod (sender tp), so every receiver has exactly one sender per overlapping replica and a
sender may serve several receivers. The same rule serves both directions: activations flow from
stage i to i + 1 and the gradients of those activations back from i + 1 to i.

With equal dp, tp and micro-batch on both sides this is one piece, all rows, between the ranks at
the same (dp, tp) position: the plain peer-to-peer exchange.

A stage's place in the rank space is a `StageLayout`, defined here (pure, no torch) and used by
`layout.py`, which builds the process groups from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageLayout:
    """Where one pipeline stage sits: its global ranks (dp replicas × tp ranks, from `first_rank`),
    its layers and its micro-batch (`layout.stage_layouts` builds one per stage of a plan)."""

    index: int
    first_rank: int
    dp: int
    tp: int
    first_layer: int
    layers: int
    micro_batch: int = 1

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.dp * self.tp)

    def tp_ranks(self, dp_rank: int) -> list[int]:
        base = self.first_rank + dp_rank * self.tp
        return list(range(base, base + self.tp))

    def dp_ranks(self, tp_rank: int) -> list[int]:
        return [self.first_rank + d * self.tp + tp_rank for d in range(self.dp)]


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of this rank's tensor, exchanged with `rank`."""

    rank: int
    lo: int
    hi: int


def _overlaps(mine: StageLayout, dp_rank: int, other: StageLayout):
    """(other's replica, global rows [lo, hi)) for every replica of `other` that shares rows with
    replica `dp_rank` of `mine`, in row order."""
    lo, hi = dp_rank * mine.micro_batch, (dp_rank + 1) * mine.micro_batch
    out = []
    for e in range(lo // other.micro_batch, min(other.dp, -(-hi // other.micro_batch))):
        a, b = max(lo, e * other.micro_batch), min(hi, (e + 1) * other.micro_batch)
        if a < b:
            out.append((e, a, b))
    return out


def incoming(mine: StageLayout, dp_rank: int, tp_rank: int, sender: StageLayout) -> list[Piece]:
    """What rank (dp_rank, tp_rank) of stage `mine` receives from stage `sender`, in row order
    (rows in the receiver's tensor)."""
    base = dp_rank * mine.micro_batch
    return [
        Piece(sender.tp_ranks(e)[tp_rank % sender.tp], a - base, b - base)
        for e, a, b in _overlaps(mine, dp_rank, sender)
    ]


def outgoing(mine: StageLayout, dp_rank: int, tp_rank: int, receiver: StageLayout) -> list[Piece]:
    """What rank (dp_rank, tp_rank) of stage `mine` sends to stage `receiver` (rows in the
    sender's tensor): its overlapping rows to every receiver whose TP position maps onto it."""
    base = dp_rank * mine.micro_batch
    out = []
    for d, a, b in _overlaps(mine, dp_rank, receiver):
        for r, t in zip(receiver.tp_ranks(d), range(receiver.tp)):
            if t % mine.tp == tp_rank:
                out.append(Piece(r, a - base, b - base))
    return out
