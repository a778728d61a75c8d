"""Which rows go from which rank to which between stages of different dp / tp / micro-batch, and
the vocabulary segments of a tied embedding: checked on the layouts alone (no processes)."""

import pytest

from mist.runtime.handoff import Piece, incoming, outgoing
from mist.runtime.layout import StageLayout, tied_segments

B = 12  # samples per global micro-batch


def stage(index, first_rank, dp, tp):
    return StageLayout(index, first_rank, dp, tp, first_layer=0, layers=1, micro_batch=B // dp)


def positions(s):
    return [(d, t, s.tp_ranks(d)[t]) for d in range(s.dp) for t in range(s.tp)]


def test_equal_stages_exchange_with_the_peer_at_the_same_position():
    a, b = stage(0, 0, 2, 2), stage(1, 4, 2, 2)
    for d, t, r in positions(a):
        peer = b.first_rank + d * b.tp + t
        assert incoming(a, d, t, b) == outgoing(a, d, t, b) == [Piece(peer, 0, a.micro_batch)]
        assert incoming(b, d, t, a) == [Piece(r, 0, b.micro_batch)]


MESHES = [(1, 1), (2, 1), (1, 2), (3, 1), (2, 2), (4, 1), (1, 4), (6, 2), (3, 4)]


@pytest.mark.parametrize("send_mesh", MESHES)
@pytest.mark.parametrize("recv_mesh", MESHES)
def test_every_receiver_gets_exactly_its_rows(send_mesh, recv_mesh):
    snd = stage(0, 0, *send_mesh)
    rcv = stage(1, snd.dp * snd.tp, *recv_mesh)
    got = {}  # (sender, receiver) → global rows, as the receiver expects them
    for d, t, r in positions(rcv):
        pieces = incoming(rcv, d, t, snd)
        assert pieces[0].lo == 0 and pieces[-1].hi == rcv.micro_batch  # tiles its rows
        assert all(p.hi == q.lo for p, q in zip(pieces, pieces[1:]))
        for p in pieces:
            assert p.rank in snd.ranks and (p.rank - snd.first_rank) % snd.tp == t % snd.tp
            got[(p.rank, r)] = (d * rcv.micro_batch + p.lo, d * rcv.micro_batch + p.hi)
    sent = {}
    for d, t, r in positions(snd):
        for p in outgoing(snd, d, t, rcv):
            sent[(r, p.rank)] = (d * snd.micro_batch + p.lo, d * snd.micro_batch + p.hi)
    assert sent == got


@pytest.mark.parametrize(
    "first,last", [((2, 1), (2, 1)), ((1, 2), (2, 1)), ((2, 2), (1, 4)), ((1, 2), (1, 3)), ((3, 1), (1, 2))]
)
def test_tied_segments_cover_every_shard_with_all_of_its_holders(first, last):
    V = 24
    a = stage(0, 0, *first)
    z = stage(2, 100, *last)
    segs = tied_segments(a, z, V)
    assert segs[0][0] == 0 and segs[-1][1] == V and all(s[1] == n[0] for s, n in zip(segs, segs[1:]))
    for s in (a, z):
        for _d, t, r in positions(s):
            lo, hi = t * V // s.tp, (t + 1) * V // s.tp
            mine = [(a_, b_) for a_, b_, ranks in segs if r in ranks]
            assert mine[0][0] == lo and mine[-1][1] == hi  # tiles its shard
            assert all(p[1] == q[0] for p, q in zip(mine, mine[1:]))
    for _lo, _hi, ranks in segs:
        assert len(ranks) == a.dp + z.dp
