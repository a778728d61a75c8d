"""Context-parallel attention equals plain causal attention over the whole sequence.

Each of cp gloo ranks holds its two load-balanced chunks of q, k and v (`chunk_ranges`); the
output and the q, k, v gradients of every rank equal the matching rows of
`scaled_dot_product_attention(is_causal=True)` on the whole sequence (fp64, grouped-query heads)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mist.models.context_parallel import CPGroup, chunk_ranges, context_attention, local_tokens


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(b=2, hq=4, hk=2, s=24, d=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hk, hk))
    go = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, go


def _reference():
    q, k, v, go = (t.clone() for t in _inputs())
    for t in (q, k, v):
        t.requires_grad_()
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(go)
    return o.detach(), q.grad, k.grad, v.grad


def _local(t: torch.Tensor, cp: int, r: int) -> torch.Tensor:
    return local_tokens(t.transpose(1, 2), cp, r).transpose(1, 2).contiguous()


def _worker(rank: int, cp: int, port: int, folder: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # a forked child must not start OpenMP threads (libgomp is not fork-safe)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        q, k, v, go = _inputs()
        q, k, v = (_local(t, cp, rank).requires_grad_() for t in (q, k, v))
        o = context_attention(q, k, v, CPGroup(cp, rank, dist.group.WORLD))
        o.backward(_local(go, cp, rank))
        torch.save([t.detach() for t in (o, q.grad, k.grad, v.grad)], os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 3])
def test_context_attention_matches_whole_sequence(cp, tmp_path):
    mp.start_processes(_worker, args=(cp, _port(), str(tmp_path)), nprocs=cp, start_method="fork")
    ref = _reference()
    for r in range(cp):
        got = torch.load(tmp_path / f"{r}.pt")
        for name, mine, want in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(mine, _local(want, cp, r), rtol=1e-10, atol=1e-10, msg=f"{name} rank {r}")


def test_chunk_ranges_balance_the_causal_work():
    """Rank r holds chunks r and 2·cp − 1 − r: its queries see (2·cp − 1)·n earlier keys plus
    two diagonal chunks, the same on every rank."""
    s, cp = 64, 4
    n = s // (2 * cp)
    for r in range(cp):
        (a, b), (c, d) = chunk_ranges(s, cp, r)
        assert b - a == d - c == n
        assert a + c == (2 * cp - 1) * n  # the keys before its two chunks
