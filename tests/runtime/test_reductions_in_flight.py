"""Data-parallel gradient reductions run while the backward goes on (`Comms.issue`/`settle`).

The simulator prices a block's reduction as overlapping the backward of the block below it. On
two gloo ranks with three one-layer units in a chain: when the backward reaches a unit, the
reduction of the unit above it is still in flight and its result not yet taken, and after the
micro-batch nothing is in flight and every unit holds its reduced shard of the dp-mean gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rt_helpers import on_two_gloo_ranks
from torch import nn

from mist.runtime.flat import Comms, FlatUnit
from mist.runtime.memory import MemoryAccount
from mist.runtime.param_role import ParamRole


def _chain(rank: int) -> dict:
    torch.manual_seed(0)
    lins = [nn.Linear(4, 4, bias=False) for _ in range(3)]
    comms = Comms(2, rank, dist.group.WORLD)
    units = [
        FlatUnit(
            f"u{i}",
            [("weight", lin.weight, [(lin, "weight")])],
            [ParamRole(True)],
            dtype=torch.float32,
            device="cpu",
            comms=comms,
            zero=2,
            weights=0.0,
            grads=0.0,
            optimizer=0.0,
            micro_batches=1,
            memory=MemoryAccount(),
        )
        for i, lin in enumerate(lins)
    ]
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
