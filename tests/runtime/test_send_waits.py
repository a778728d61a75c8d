"""The pipeline schedules wait for their sends where no order of the stages' operations can make
those waits a cycle (on gloo a wait returns only when the receiver has posted the receive). Played
as rendezvous by `rules.interleaved_sends.plays_through`:

- a 1F1B or ZB-H1 stage waits for an output's sends at once (`runtime.p2p.SentOutput`: its data
  is freed once its receivers have it) and for a gradient's when it sends the next
  (`p2p.Sends`): safe for every pipeline of 2-8 stages and 1-19 micro-batches;
- the interleaved order is not safe so (its last rank sends on to its first): its ranks wait for
  an output a few operations after sending it and for a gradient before a receive that its
  receiver sends after taking it (`send_waits`), which cannot block in any shape played here."""

import pytest

from mist.rules.interleaved_order import interleaved_one_f_one_b
from mist.rules.interleaved_sends import (
    ACTIVATION,
    GRADIENT,
    OUTPUT_LAG,
    RECEIVE,
    SEND,
    SendWaits,
    _game,
    gradient_waits,
    output_waits,
    plays_through,
    send_waits,
)
from mist.rules.pipeline_order import BACKWARD, FORWARD, one_f_one_b
from mist.rules.zero_bubble_order import WEIGHT_GRAD, zb_h1


def _one_stage_waits(ops: list, last: int) -> dict:
    """A 1F1B / ZB-H1 stage's waits: each output's at once (before the next operation), each
    gradient's before the next gradient is sent."""
    waits: dict = {}
    grad = None
    for i, (kind, g, k) in enumerate(ops):
        if kind == FORWARD and k < last and i + 1 < len(ops):
            waits[(i + 1, RECEIVE)] = ((ACTIVATION, g, k),)
        if kind == BACKWARD and k > 0:
            if grad is not None:
                waits[(i, SEND)] = ((GRADIENT, grad, k),)
            grad = g
    return waits


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_waiting_for_an_outputs_send_at_once_cannot_block_a_pipeline(schedule):
    for stages in range(2, 9):
        for G in range(1, 20):
            orders = []
            for i in range(stages):
                order = one_f_one_b(i, stages, G) if schedule == "1f1b" else zb_h1(i, stages, G)
                # (a W exchanges nothing; ZB-H1's B is 1F1B's backward for the exchanges)
                orders.append([(k, g, i) for k, g in order if k != WEIGHT_GRAD])
            waits = [_one_stage_waits(ops, stages - 1) for ops in orders]
            assert plays_through(orders, waits), (schedule, stages, G)


def _interleaved(ranks: int, chunks: int, G: int, rules) -> bool:
    return plays_through(*_game(tuple(rules), ranks, chunks, G))


@pytest.mark.parametrize("stages,v,G", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_the_interleaved_order_blocks_so_and_not_when_sends_are_waited_late(stages, v, G):
    orders = [
        [(kind, g, c * stages + r) for kind, g, c in interleaved_one_f_one_b(r, stages, v, G)] for r in range(stages)
    ]
    P = stages * v
    assert not plays_through(orders, [_one_stage_waits(ops, P - 1) for ops in orders])
    # outputs when their gradients are back, gradients at the end of the step (the fallback)
    assert _interleaved(stages, v, G, [SendWaits({}, {})] * stages)


def test_the_interleaved_send_waits_cannot_block():
    """`send_waits` returns its rules' waits only where every rank's order plays through with
    them: in every shape of 2-12 ranks, 2-6 chunks and G up to 6p it does (no fallback); waiting
    for an output one or two operations sooner blocks most shapes, and so does waiting for a
    gradient when the next is sent."""
    for ranks in range(2, 13):
        for chunks in range(2, 7):
            for G in range(ranks, 6 * ranks + 1, ranks):
                waits = send_waits(ranks, chunks, G)
                for r, w in enumerate(waits):
                    assert w.outputs and w.outputs == output_waits(r, ranks, chunks, G), (ranks, chunks, G)
                    assert w.gradients == gradient_waits(r, ranks, chunks, G), (ranks, chunks, G)
    assert _interleaved(4, 2, 8, send_waits(4, 2, 8))
    sooner = 0
    for ranks, chunks, G in [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 12), (6, 2, 12)]:
        gw = [gradient_waits(r, ranks, chunks, G) for r in range(ranks)]
        for lag in range(1, OUTPUT_LAG):
            early = [SendWaits(gw[r], _lagged(r, ranks, chunks, G, lag)) for r in range(ranks)]
            sooner += not _interleaved(ranks, chunks, G, early)
        orders = _game(send_waits(ranks, chunks, G), ranks, chunks, G)[0]
        at_next = [_one_stage_waits(ops, ranks * chunks - 1) for ops in orders]
        grads_at_next = [{k: w for k, w in waits.items() if k[1] == SEND} for waits in at_next]
        assert not plays_through(orders, grads_at_next), (ranks, chunks, G)
    assert sooner >= 8


def _lagged(rank: int, ranks: int, chunks: int, G: int, lag: int) -> dict:
    """`output_waits` with each output waited for `lag` operations after its forward."""
    order = interleaved_one_f_one_b(rank, ranks, chunks, G)
    at = {op: i for i, op in enumerate(order)}
    out: dict = {}
    for keys in output_waits(rank, ranks, chunks, G).values():
        for g, c in keys:
            j = at[(FORWARD, g, c)] + lag
            out.setdefault(order[j], []).append((g, c))
    return {op: tuple(w) for op, w in out.items()}


# ------------------------------------------------------------------ NCCL's streams
def _messages(orders: list[list[tuple[str, int, int]]], rank_of) -> list[list[tuple[str, tuple, int]]]:
    """Per rank, its sends and receives in program order: ("send" or "recv", message, peer rank); a
    message is (kind, micro-batch, sending position), an activation with its header one message."""
    last = max(k for ops in orders for _, _, k in ops)
    out = []
    for ops in orders:
        mine = []
        for kind, g, k in ops:
            if kind == FORWARD:
                mine += [("recv", (ACTIVATION, g, k - 1), rank_of(k - 1))] if k > 0 else []
                mine += [("send", (ACTIVATION, g, k), rank_of(k + 1))] if k < last else []
            elif kind == BACKWARD:
                mine += [("recv", (GRADIENT, g, k + 1), rank_of(k + 1))] if k < last else []
                mine += [("send", (GRADIENT, g, k), rank_of(k - 1))] if k > 0 else []
        out.append(mine)
    return out


def _one_stream_plays_through(msgs) -> bool:
    """NCCL with every message of a rank on one stream (one communicator bound to the device): a
    rank's sends and receives run one at a time in posting order, and a send or receive finishes
    only while its partner is the one its peer is running."""
    at = [0] * len(msgs)
    while True:
        heads = {(r, m[at[r]]) for r, m in enumerate(msgs) if at[r] < len(m)}
        done = [r for r, (d, msg, peer) in heads if (peer, ("recv" if d == "send" else "send", msg, r)) in heads]
        if not done:
            return all(a == len(m) for a, m in zip(at, msgs))
        for r in done:
            at[r] += 1


def _orders(schedule: str, ranks: int, chunks: int, G: int):
    if schedule == "interleaved":
        return [
            [(k, g, c * ranks + r) for k, g, c in interleaved_one_f_one_b(r, ranks, chunks, G)] for r in range(ranks)
        ]
    order = one_f_one_b if schedule == "1f1b" else zb_h1
    return [[(k, g, i) for k, g in order(i, ranks, G) if k != WEIGHT_GRAD] for i in range(ranks)]


def _shapes(schedule: str):
    if schedule == "interleaved":
        return [(p, v, G) for p in range(2, 9) for v in range(2, 5) for G in range(p, 4 * p + 1, p)]
    return [(s, 1, G) for s in range(2, 9) for G in range(1, 20)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_each_channel_carries_its_messages_in_the_order_its_receiver_takes_them(schedule):
    """`p2p.Channels`: a message's kind and direction pick its group, so NCCL runs each pair's
    messages of one kind, one way, on a stream of their own, in posting order, matched by that
    order (it has no tags). Every such stream's sends come in the order its receiver posts the
    receives, so a send waits only for its own receive, as the rendezvous games above assume."""
    for ranks, chunks, G in _shapes(schedule):
        orders = _orders(schedule, ranks, chunks, G)
        msgs = _messages(orders, lambda k, p=ranks: k % p)
        streams: dict = {}
        for r, mine in enumerate(msgs):
            for d, msg, peer in mine:
                src, dst = (r, peer) if d == "send" else (peer, r)
                streams.setdefault((msg[0], src, dst, d), []).append(msg)
        for (kind, src, dst, d), seq in streams.items():
            if d == "send":
                assert seq == streams[(kind, src, dst, "recv")], (schedule, ranks, chunks, G, kind, src, dst)


def test_one_stream_for_every_message_would_block_nccl():
    """Why the channels: with all of a rank's messages on one NCCL stream, a 1F1B stage's output
    send and its next gradient receive meet its neighbour's gradient send and next activation
    receive in the opposite order, and both wait: every 1F1B pipeline with 2 or more micro-batches
    per stage pair blocks, and every interleaved one."""
    for schedule in ("1f1b", "zb-h1", "interleaved"):
        for ranks, chunks, G in _shapes(schedule):
            msgs = _messages(_orders(schedule, ranks, chunks, G), lambda k, p=ranks: k % p)
            blocks = not _one_stream_plays_through(msgs)
            assert blocks == (schedule == "interleaved" or G >= 2), (schedule, ranks, chunks, G)
