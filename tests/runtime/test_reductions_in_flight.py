"""Data-parallel collectives in flight while the computation goes on (`Comms.issue`/`settle`).

The simulator prices a block's gradient reduction as overlapping the backward of the block below
it, and a ZeRO-1/2 re-gather of new weights as overlapping the first forward. On two gloo ranks
with three one-layer units in a chain: when the backward reaches a unit, the reduction of the
unit above it is still in flight and its result not yet taken, and after the micro-batch nothing
is in flight and every unit holds its reduced shard of the dp-mean gradient; after a step, a
unit's re-gather is in flight while the unit before it would run its forward, and its first use
waits for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rt_helpers import on_two_gloo_ranks
from torch import nn

from mist.runtime.flat import Comms, FlatUnit
from mist.runtime.memory import MemoryAccount
from mist.runtime.param_role import ParamRole


def _units(rank: int, zero: int):
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4, bias=False) for _ in range(3)]
    comms = Comms(2, rank, dist.group.WORLD)
    return (
        lins,
        comms,
        [
            FlatUnit(
                f"u{i}",
                [("weight", lin.weight, [(lin, "weight")])],
                [ParamRole(True)],
                dtype=torch.float32,
                device="cpu",
                comms=comms,
                zero=zero,
                weights=0.0,
                grads=0.0,
                optimizer=0.0,
                micro_batches=1,
                memory=MemoryAccount(),
            )
            for i, lin in enumerate(lins)
        ],
    )


def _chain(rank: int) -> dict:
    lins, comms, units = _units(rank, 2)
    for u in units:
        u.start_micro_batch(0, last=True)
    seen = []
    x = torch.full((2, 4), float(rank + 1))
    h = x
    for i, lin in enumerate(lins):
        h = lin(h)
        if i < 2:  # the gradient reaching unit i, before its backward runs
            h.register_hook(
                lambda g, i=i: seen.append((i, comms._in_flight is not None, [u.opt_grad is not None for u in units]))
            )
    h.sum().backward()
    for u in units:
        u.finish_micro_batch()
    # this rank's gradient of each weight, for the reference
    local = [lin.weight.detach().clone() for lin in lins]
    with torch.no_grad():
        a = [x]
        for lin in lins:
            a.append(lin(a[-1]))
        gy = torch.ones_like(a[-1])
        for i in reversed(range(3)):
            local[i] = gy.t() @ a[i]
            gy = gy @ lins[i].weight
    return {
        "seen": seen,
        "after": comms._in_flight is None,
        "shards": [u.opt_grad.read(0, u.L, "cpu").tolist() for u in units],
        "local": [g.reshape(-1).tolist() for g in local],
    }


def test_a_units_reduction_is_in_flight_during_the_backward_below_it():
    res = on_two_gloo_ranks(_chain)
    for rank in range(2):
        r = res[rank]
        # before unit 1's backward: unit 2's reduction in flight, nothing taken yet; before
        # unit 0's: unit 1's in flight, unit 2's taken
        assert r["seen"] == [(1, True, [False, False, False]), (0, True, [False, False, True])]
        assert r["after"]
        for i in range(3):
            mean = (torch.tensor(res[0]["local"][i]) + torch.tensor(res[1]["local"][i])) / 2
            torch.testing.assert_close(torch.tensor(r["shards"][i]), mean[rank * 8 : rank * 8 + 8])


def _regather(rank: int) -> dict:
    lins, comms, units = _units(rank, 1)
    for k, u in enumerate(units):  # a "step": this rank's master shard becomes 10·unit + rank
        u.master.dev.fill_(10.0 * k + rank)
        u.defer_update()
    seen = []
    for i, u in enumerate(units):  # the order `StageRunner._run` takes them in
        u.materialize()
        u.wait()
        seen.append((i, units[i].full.tolist()))
        if i + 1 < len(units):
            units[i + 1].materialize(prefetch=True)
            seen.append((i + 1, units[i + 1]._gathering, comms._in_flight is not None))
    return {"seen": seen, "after": comms._in_flight is None}


def test_a_units_regather_is_in_flight_during_the_forward_before_it():
    res = on_two_gloo_ranks(_regather)
    for rank in range(2):
        r = res[rank]
        assert r["after"]
        for i in range(3):
            # at its first use, a unit holds both ranks' new shards
            assert r["seen"][2 * i][1] == [10.0 * i] * 8 + [10.0 * i + 1] * 8
        for i in (1, 2):
            assert r["seen"][2 * i - 1] == (i, True, True)
