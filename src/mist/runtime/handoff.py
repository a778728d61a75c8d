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

Under sequence parallelism a stage's TP rank t holds only the sequence positions
[t·s/tp, (t+1)·s/tp) of its rows (`seq_range`). Pieces then also carry a range of sequence
positions: a receiver takes each position from the sender TP rank that holds it (an SP sender),
or from TP rank t mod (sender tp) as above (a sender whose TP ranks all hold the whole sequence).
Two SP stages of equal tp exchange shards between equal TP positions: each rank sends and
receives 1/tp of the activation, which is what the simulator prices (the boundary tensor of a
stage is its own block output).

Under context parallelism every stage has the same cp (`plan.check_plan`): the ranks of a data
replica are cp groups of tp, and each holds the same 2 of the sequence's 2·cp chunks on every
stage, so rank (d, c, t) exchanges only with ranks of cp index c, by the rules above over its
local sequence (s/cp positions).

A stage's place in the rank space is a `StageLayout`, defined here (pure, no torch) and used by
`layout.py`, which builds the process groups from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageLayout:
    """Where one pipeline stage sits: its global ranks (dp replicas × cp × tp ranks, from
    `first_rank`, tp fastest), its layers and its micro-batch (`layout.stage_layouts` builds one
    per stage of a plan). A "replica" index below is d·cp + c: data replica d, context rank c."""

    index: int
    first_rank: int
    dp: int
    tp: int
    first_layer: int
    layers: int
    micro_batch: int = 1
    seq_len: int = 0  # positions a rank's replica holds: the sequence length / cp
    sequence_parallel: bool = False
    cp: int = 1

    @property
    def replicas(self) -> int:
        """The ranks holding each parameter shard: dp × cp (their gradients are averaged)."""
        return self.dp * self.cp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.replicas * self.tp)

    def tp_ranks(self, replica: int) -> list[int]:
        base = self.first_rank + replica * self.tp
        return list(range(base, base + self.tp))

    def dp_ranks(self, tp_rank: int) -> list[int]:
        """Every replica's TP rank `tp_rank`: the group a parameter shard's gradients reduce over."""
        return [self.first_rank + r * self.tp + tp_rank for r in range(self.replicas)]

    def cp_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [self.first_rank + (dp_rank * self.cp + c) * self.tp + tp_rank for c in range(self.cp)]

    def seq_range(self, tp_rank: int) -> tuple[int, int]:
        """The sequence positions [a, b) that TP rank `tp_rank` holds between blocks."""
        if not self.sequence_parallel:
            return 0, self.seq_len
        n = self.seq_len // self.tp
        return tp_rank * n, (tp_rank + 1) * n


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of this rank's tensor, exchanged with `rank`; with `s_hi` set, only its
    sequence positions [s_lo, s_hi) (local to this rank's tensor), else all of them."""

    rank: int
    lo: int
    hi: int
    s_lo: int = 0
    s_hi: int | None = None

    def region(self) -> tuple[slice, slice]:
        """The (rows, sequence) slices of this rank's [b, s, ...] tensor the piece covers."""
        return slice(self.lo, self.hi), slice(self.s_lo, self.s_hi)


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


def _seq_pieces(mine: StageLayout, tp_rank: int, other: StageLayout, other_rank_at) -> list[tuple[int, int, int]]:
    """(other's TP position, local [a, b)) for every rank of one replica of `other` that exchanges
    sequence positions with TP rank `tp_rank` of `mine`, in sequence order."""
    a, b = mine.seq_range(tp_rank)
    if not other.sequence_parallel:
        return [(other_rank_at, 0, b - a)]
    out = []
    for u in range(other.tp):
        c, d = other.seq_range(u)
        lo, hi = max(a, c), min(b, d)
        if lo < hi:
            out.append((u, lo - a, hi - a))
    return out


def _sliced(mine: StageLayout, other: StageLayout) -> bool:
    """Whether pieces between the two stages carry sequence ranges (either is sequence-parallel)."""
    return mine.sequence_parallel or other.sequence_parallel


def incoming(mine: StageLayout, dp_rank: int, tp_rank: int, sender: StageLayout, cp_rank: int = 0) -> list[Piece]:
    """What rank (dp_rank, cp_rank, tp_rank) of stage `mine` receives from stage `sender`, in row
    order (rows and sequence positions in the receiver's tensor)."""
    base = dp_rank * mine.micro_batch
    out = []
    for e, a, b in _overlaps(mine, dp_rank, sender):
        ranks = sender.tp_ranks(e * sender.cp + cp_rank)
        for u, s_lo, s_hi in _seq_pieces(mine, tp_rank, sender, tp_rank % sender.tp):
            seq = (s_lo, s_hi) if _sliced(mine, sender) else (0, None)
            out.append(Piece(ranks[u], a - base, b - base, *seq))
    return out


def outgoing(mine: StageLayout, dp_rank: int, tp_rank: int, receiver: StageLayout, cp_rank: int = 0) -> list[Piece]:
    """What rank (dp_rank, cp_rank, tp_rank) of stage `mine` sends to stage `receiver` (rows and
    sequence positions in the sender's tensor): what each receiver takes from it (`incoming`'s rule)."""
    base = dp_rank * mine.micro_batch
    out = []
    for d, a, b in _overlaps(mine, dp_rank, receiver):
        for r, t in zip(receiver.tp_ranks(d * receiver.cp + cp_rank), range(receiver.tp)):
            for u, s_lo, s_hi in _seq_pieces(receiver, t, mine, t % mine.tp):
                if u != tp_rank:
                    continue
                seq = (0, None)
                if _sliced(mine, receiver):  # the receiver's range, in this rank's positions
                    shift = receiver.seq_range(t)[0] - mine.seq_range(tp_rank)[0]
                    seq = (s_lo + shift, s_hi + shift)
                out.append(Piece(r, a - base, b - base, *seq))
    return out
