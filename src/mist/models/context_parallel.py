"""Context parallelism: a stage's cp ranks each hold 1/cp of every sequence.

The sequence is cut into 2·cp chunks of n = s/(2·cp) positions and rank r holds chunks r and
2·cp − 1 − r, in that order (Megatron-LM's and torchtitan's load balancing: under the causal mask
an early chunk attends to few keys and a late one to many, so every rank gets one of each and the
same attention work). Everything outside attention is per token and runs on the rank's 2·n
positions unchanged; the rotary and learned position tables are indexed by the positions the rank
holds (`positions`).

Attention exchanges K and V by all-gather (`_ContextAttention`), as torchtitan's "allgather"
rotation and Megatron-LM's `--cp-comm-type all_gather` do: one collective per layer whose bytes
are 2·(cp − 1)/cp of the whole sequence's K and V — small under grouped-query attention, where K/V
are heads_kv/heads of the queries — instead of a ring of cp − 1 steps that a planner would have to
overlap step by step. Each local query chunk j runs the fused flash kernel twice: causally over its
own chunk of keys, and without a mask over all earlier chunks (j·n keys); the two partial outputs
are merged by their log-sum-exps. The backward runs the flash backward of each part with the
merged output and log-sum-exp (which makes each part's gradient exact), gathers K and V again
(only the local shards are kept for backward, as sequence parallelism keeps its linears' inputs),
and reduce-scatters the K/V gradients back to their ranks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mist.models.collectives import CPGroup, _announce, _compiled_scatter, gather_stacked, issuing


def chunk_ranges(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The global positions [lo, hi) of rank `rank`'s two chunks, in the order it holds them."""
    n = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return (rank * n, (rank + 1) * n), (late * n, (late + 1) * n)


@functools.lru_cache(maxsize=16)
def positions(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The global positions of the tokens rank `rank` holds, in its order (a cached index)."""
    (a, b), (c, d) = chunk_ranges(seq_len, cp, rank)
    with torch.inference_mode(False):
        return torch.cat((torch.arange(a, b), torch.arange(c, d))).to(device)


@torch.library.custom_op("mist::cp_positions", mutates_args=())
def position_index(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """`positions` as one opaque operator, for the symbolic trace: `mist.analysis` records a lookup
    of the cached index (free), not its construction, which a step does not run."""
    return positions(int(seq_len), int(cp), int(rank), torch.device(device)).clone()


@position_index.register_fake
def _(seq_len, cp, rank, device):
    return torch.empty(seq_len // cp, dtype=torch.long, device=device)


def rank_positions(seq_len, cp: int, rank: int, device) -> torch.Tensor:
    """The cached index of a run, or the opaque lookup of a trace (a symbolic seq_len)."""
    if isinstance(seq_len, int):
        return positions(seq_len, cp, rank, torch.device(device))
    return position_index(seq_len, cp, rank, device)


def local_tokens(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's positions of a [b, s, ...] tensor every rank holds whole (tokens, targets)."""
    if cp == 1:
        return x
    (a, b), (c, d) = chunk_ranges(x.shape[1], cp, rank)
    return torch.cat((x[:, a:b], x[:, c:d]), dim=1)


# ------------------------------------------------------------------ the flash kernels
def _flash(q, k, v, causal: bool):
    """(output, fp32 log-sum-exp, what the backward needs besides them) of the fused kernel."""
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal
        )
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, ()


def _flash_backward(g, q, k, v, out, lse, causal: bool, extra: tuple):
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal)


def _merge(o1, l1, o2, l2):
    """The attention over two key sets from each one's output and log-sum-exp."""
    lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    return (o1 * w1 + o2 * w2).to(o1.dtype), lse


# ------------------------------------------------------------------ K/V exchange
def _gather(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """[b, h, 2n, d] of every rank → [b, h, 2·cp·n, d] in global order."""
    buf = gather_stacked(x, cp)
    n = x.shape[2] // 2
    # (`narrow` rather than indexing: one view op each, which keeps the symbolic trace short)
    parts = [buf[j].narrow(2, 0, n) for j in range(cp.size)]
    parts += [buf[2 * cp.size - 1 - j].narrow(2, n, n) for j in range(cp.size, 2 * cp.size)]
    return torch.cat(parts, dim=2)


def _scatter(full: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Gradients [b, h, s, d] in global order, summed over the ranks → this rank's [b, h, 2n, d]."""
    n = full.shape[2] // (2 * cp.size)
    chunk = lambda j: full.narrow(2, j * n, n)  # noqa: E731
    buf = torch.stack([torch.cat((chunk(r), chunk(2 * cp.size - 1 - r)), dim=2) for r in range(cp.size)])
    if torch.compiler.is_compiling():
        return _compiled_scatter(buf.flatten(0, 1), cp)
    _announce("reduce_scatter", buf, cp)
    out = buf.new_empty(buf.shape[1:])
    if cp.group is not None:
        with issuing():
            dist.reduce_scatter(out, list(buf.unbind(0)), group=cp.group)
    return out


class _ContextAttention(torch.autograd.Function):
    """Causal attention of this rank's query chunks over the whole sequence's keys (see above)."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        kf, vf = _gather(k, cp), _gather(v, cp)
        b, h, s, d = q.shape
        n = s // 2
        # laid out [b, s, heads, d] as the fused kernel lays out its own output, so that the
        # attention's output projection takes it as a view (no copy kept for backward)
        out = q.new_empty((b, s, h, d)).transpose(1, 2)
        lses, extras = [], []
        for i, j in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
            qi = q.narrow(2, i * n, n)
            o, lse, ex = _flash(qi, kf.narrow(2, j * n, n), vf.narrow(2, j * n, n), True)
            ex_all = [ex]
            if j > 0:
                o2, lse2, ex2 = _flash(qi, kf.narrow(2, 0, j * n), vf.narrow(2, 0, j * n), False)
                o, lse = _merge(o, lse, o2, lse2)
                ex_all.append(ex2)
            out.narrow(2, i * n, n).copy_(o)
            lses.append(lse)
            extras.append(ex_all)
        del kf, vf
        lse = torch.cat(lses, dim=2)
        ctx.cp, ctx.extras = cp, extras
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        g = g.contiguous()
        kf, vf = _gather(k, cp), _gather(v, cp)
        dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
        n = q.shape[2] // 2
        dqs = []
        for i, j in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
            qi, gi, oi, li = (t.narrow(2, i * n, n) for t in (q, g, out, lse))
            kj, vj = kf.narrow(2, j * n, n), vf.narrow(2, j * n, n)
            dq, dk, dv = _flash_backward(gi, qi, kj, vj, oi, li, True, ctx.extras[i][0])
            dkf.narrow(2, j * n, n).add_(dk)
            dvf.narrow(2, j * n, n).add_(dv)
            if j > 0:
                ke, ve = kf.narrow(2, 0, j * n), vf.narrow(2, 0, j * n)
                dq2, dk, dv = _flash_backward(gi, qi, ke, ve, oi, li, False, ctx.extras[i][1])
                dq = dq + dq2
                dkf.narrow(2, 0, j * n).add_(dk)
                dvf.narrow(2, 0, j * n).add_(dv)
            dqs.append(dq)
        del kf, vf
        return torch.cat(dqs, dim=2), _scatter(dkf, cp), _scatter(dvf, cp), None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Causal attention [b, heads, 2n, d] of this rank's query chunks (k, v: its own chunks, maybe
    fewer heads) over the whole sequence, the K/V of the other ranks gathered."""
    return _ContextAttention.apply(q, k, v, cp)
