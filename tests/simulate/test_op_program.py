"""The merge of per-stage operation orders that every pipeline simulator plays through."""

import random

import pytest

from mist.rules.interleaved_order import depends_on as interleaved_depends
from mist.rules.interleaved_order import interleaved_one_f_one_b
from mist.rules.pipeline_order import depends_on, one_f_one_b
from mist.rules.zero_bubble_order import depends_on as zb_depends
from mist.rules.zero_bubble_order import zb_h1
from mist.simulate.op_program import dependency_order, stage_key


def _check_merge(orders, depends, key, what):
    merged = list(dependency_order(orders, depends, key, what))
    position = {key(i, op): n for n, (i, op, _) in enumerate(merged)}
    assert len(position) == len(merged) == sum(map(len, orders))  # every op once
    for i, order in enumerate(orders):  # each stage's own order is kept
        assert [op for j, op, _ in merged if j == i] == list(order)
    for n, (i, op, src) in enumerate(merged):  # each op after the one it waits for
        assert src == depends(i, op)
        if src is not None:
            assert position[src] < n


@pytest.mark.parametrize("S,G", [(1, 1), (2, 1), (3, 2), (4, 8), (8, 3)])
def test_one_f_one_b_and_zb_h1_merge_in_dependency_order(S, G):
    _check_merge(
        [one_f_one_b(i, S, G) for i in range(S)], lambda i, op: depends_on(op[0], i, op[1], S), stage_key, "1F1B"
    )
    _check_merge([zb_h1(i, S, G) for i in range(S)], lambda i, op: zb_depends(op[0], i, op[1], S), stage_key, "ZB-H1")


@pytest.mark.parametrize("p,v,G", [(2, 2, 2), (4, 2, 8), (2, 3, 4)])
def test_interleaved_merges_in_dependency_order(p, v, G):
    def key(r, op):
        kind, m, c = op
        return (kind, r, c, m)

    orders = [interleaved_one_f_one_b(r, p, v, G) for r in range(p)]
    _check_merge(orders, lambda r, op: interleaved_depends(op[0], op[1], r, op[2], p, v), key, "interleaved")


def test_orders_that_wait_on_each_other_are_refused():
    # stage 0 runs its backward before the forward stage 1 needs; stage 1's backward waits for that forward
    orders = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(RuntimeError, match="1F1B schedule deadlocked"):
        list(dependency_order(orders, lambda i, op: depends_on(op[0], i, op[1], 2), stage_key, "1F1B"))


def test_the_merge_does_not_depend_on_how_the_stages_are_listed():
    """Starts depend on the stage's previous end and the dependency's end only: playing the
    stages in another order of visit gives the same merge up to reordering of independent ops."""
    rng = random.Random(0)
    S, G = 4, 6
    orders = [one_f_one_b(i, S, G) for i in range(S)]
    fwd = [rng.uniform(0.5, 2.0) for _ in range(S)]
    bwd = [rng.uniform(1.0, 4.0) for _ in range(S)]

    def ends(perm):
        done, clock = {}, {}
        reordered = [orders[i] for i in perm]
        for j, (kind, m), src in dependency_order(
            reordered, lambda j, op: depends_on(op[0], perm[j], op[1], S), lambda j, op: stage_key(perm[j], op), "1F1B"
        ):
            i = perm[j]
            start = max(clock.get(i, 0.0), 0.0 if src is None else done[src])
            done[(kind, i, m)] = clock[i] = start + (fwd[i] if kind == "F" else bwd[i])
        return done

    assert ends([0, 1, 2, 3]) == pytest.approx(ends([3, 1, 0, 2]))
