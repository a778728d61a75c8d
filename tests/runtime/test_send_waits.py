"""The 1F1B and ZB-H1 schedules wait for a stage's output sends right after making them
(`runtime.p2p.SentOutput`: the output's data is freed once its receivers have it). On gloo such a
wait returns only when the next stage has posted the receive, so it is safe only if no order of
the stages' operations can make those waits a cycle. Played here, for every pipeline of 2-8
stages and 1-19 micro-batches, as rendezvous: a forward's send completes when the next stage
reaches that micro-batch's forward; a gradient's send when the previous stage reaches its
backward, and a stage waits for its last one before it sends the next (`p2p.Sends`). The
interleaved order is not safe so (its last rank sends on to its first), which is why its ranks
wait for their outputs' sends only when the gradients are back, and for their gradients' sends
where `rules.interleaved_order.gradient_waits` says, which cannot block either."""

import pytest

from mist.rules.interleaved_order import gradient_waits, interleaved_one_f_one_b
from mist.rules.pipeline_order import FORWARD, one_f_one_b
from mist.rules.zero_bubble_order import WEIGHT_GRAD, zb_h1


def _completes(
    orders: list[list[tuple[str, int, int]]],
    positions: int,
    wait_outputs: bool,
    wait_gradients: bool,
    gradient_waits_of: list[dict] | None = None,
) -> bool:
    """Whether every rank gets through its (kind, micro-batch, model position) operations,
    receives blocking; with `wait_outputs` each forward's send waited for at once, with
    `wait_gradients` each gradient's send when the rank sends its next one, with
    `gradient_waits_of` (per rank, `gradient_waits`) each gradient's send just before the receive
    it puts that wait at."""
    ranks = len(orders)
    pc, step = [0] * len(orders), [0] * len(orders)
    posted_act, sent_act, posted_grad, sent_grad = set(), set(), set(), set()
    last_grad: list = [None] * len(orders)
    while True:
        moved = False
        for r, ops in enumerate(orders):
            if pc[r] == len(ops):
                continue
            kind, g, k = ops[pc[r]]
            if kind == FORWARD:
                if step[r] == 0:
                    if k > 0:
                        # a gradient (g', c') went from position c'·ranks + r to the one before it
                        due = () if gradient_waits_of is None else gradient_waits_of[r].get((g, k // ranks), ())
                        if any((c * ranks + r - 1, gg) not in posted_grad for gg, c in due):
                            continue
                        posted_act.add((k, g))
                        if (k - 1, g) not in sent_act:
                            continue
                    step[r], moved = 1, True
                if k < positions - 1:
                    sent_act.add((k, g))
                    if wait_outputs and (k + 1, g) not in posted_act:
                        continue
            else:
                if k < positions - 1:
                    posted_grad.add((k, g))
                    if (k + 1, g) not in sent_grad:
                        continue
                if k > 0:
                    if wait_gradients and last_grad[r] is not None and (k - 1, last_grad[r]) not in posted_grad:
                        continue
                    sent_grad.add((k, g))
                    last_grad[r] = g
            pc[r], step[r], moved = pc[r] + 1, 0, True
        if all(p == len(ops) for p, ops in zip(pc, orders)):
            return True
        if not moved:
            return False


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_waiting_for_an_outputs_send_at_once_cannot_block_a_pipeline(schedule):
    for stages in range(2, 9):
        for G in range(1, 20):
            orders = []
            for i in range(stages):
                order = one_f_one_b(i, stages, G) if schedule == "1f1b" else zb_h1(i, stages, G)
                # (a W exchanges nothing; ZB-H1's B is 1F1B's backward for the exchanges)
                orders.append([(k, g, i) for k, g in order if k != WEIGHT_GRAD])
            assert _completes(orders, stages, wait_outputs=True, wait_gradients=True), (schedule, stages, G)


@pytest.mark.parametrize("stages,v,G", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_the_interleaved_order_blocks_so_and_not_when_sends_are_waited_late(stages, v, G):
    orders = [
        [(kind, g, c * stages + r) for kind, g, c in interleaved_one_f_one_b(r, stages, v, G)] for r in range(stages)
    ]
    assert not _completes(orders, stages * v, wait_outputs=True, wait_gradients=False)
    assert _completes(orders, stages * v, wait_outputs=False, wait_gradients=False)


def test_the_interleaved_gradient_waits_cannot_block():
    """Outputs waited for when their gradients are back, each gradient's send where
    `gradient_waits` puts it (a wait when the next is sent blocks these orders)."""
    for ranks in range(2, 9):
        for chunks in range(2, 5):
            for G in range(ranks, 4 * ranks + 1, ranks):
                orders = [
                    [(kind, g, c * ranks + r) for kind, g, c in interleaved_one_f_one_b(r, ranks, chunks, G)]
                    for r in range(ranks)
                ]
                waits = [gradient_waits(r, ranks, chunks, G) for r in range(ranks)]
                P = ranks * chunks
                assert _completes(orders, P, False, False, waits), (ranks, chunks, G)
                assert not _completes(orders, P, False, True), (ranks, chunks, G)
