"""The interleaved (virtual-stage) 1F1B order of one pipeline rank (Megatron-LM's schedule).

Each of the p pipeline ranks holds v model chunks; the model's blocks are split into p·v chunks
taken in the order rank 0 chunk 0, rank 1 chunk 0, …, rank p−1 chunk 0, rank 0 chunk 1, …, so
a micro-batch's forward visits every rank v times. Micro-batches go through the chunks in groups
of p (G must be a multiple of p, as Megatron-LM requires with interleaving): the k-th forward
"chunk-op" of a rank is micro-batch (k // (p·v))·p + k % p on chunk (k // p) % v; the k-th
backward is the same micro-batch on chunk v − 1 − (k // p) % v.

Rank r of p runs G·v forward and G·v backward chunk-ops:

- warm-up: the first min((p − r − 1)·2 + (v − 1)·p, G·v) forwards;
- steady state: the next forward, then the oldest backward, until every forward has run;
- cool-down: the remaining backwards.

With v = 1 it is the non-interleaved 1F1B order of `pipeline_order` (Megatron-LM runs that one
when there is no virtual stage). A chunk-op's dependencies: the forward of micro-batch m on
(r, c) waits for its forward on the chunk before in model order — (r − 1, c), or (p − 1, c − 1)
on rank 0 — and its backward for the backward on the chunk after — (r + 1, c), or (0, c + 1) on
the last rank, or its own forward on the model's last chunk. The simulator's
`interleaved_event_schedule` times this order and the memory model reads `chunks_in_flight`.
"""

from __future__ import annotations

from mist.rules.pipeline_order import BACKWARD, FORWARD, one_f_one_b


def interleaved_warmup(rank: int, ranks: int, chunks: int, micro_batches: int) -> int:
    """Forward chunk-ops rank `rank` of `ranks` runs before its first backward."""
    if chunks == 1:
        return min(ranks - 1 - rank, micro_batches)
    return min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, micro_batches * chunks)


def depends_on(kind: str, m: int, rank: int, chunk: int, ranks: int, chunks: int) -> tuple[str, int, int, int] | None:
    """The chunk-op (kind, rank, chunk, micro-batch) that the chunk-op (kind, m) on (rank, chunk)
    waits for (see above), or None for the model's first chunk's forward."""
    if kind == FORWARD:
        if rank > 0:
            return (FORWARD, rank - 1, chunk, m)
        return (FORWARD, ranks - 1, chunk - 1, m) if chunk > 0 else None
    if rank < ranks - 1:
        return (BACKWARD, rank + 1, chunk, m)
    if chunk < chunks - 1:
        return (BACKWARD, 0, chunk + 1, m)
    return (FORWARD, rank, chunk, m)


def chunks_in_flight(rank: int, ranks: int, chunks: int, micro_batches: int) -> int:
    """Micro-batch chunks whose saved activations rank `rank` holds at its peak, the one it runs
    included: one more than its warm-up (the forward that follows it), at most G·v. Rank 0 holds
    the most."""
    return min(interleaved_warmup(rank, ranks, chunks, micro_batches) + 1, micro_batches * chunks)


def chunk_of(k: int, ranks: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward (or backward) chunk-op."""
    group, pos = divmod(k, ranks * chunks)
    c = pos // ranks
    return group * ranks + k % ranks, c if forward else chunks - 1 - c


def interleaved_one_f_one_b(rank: int, ranks: int, chunks: int, micro_batches: int) -> tuple[tuple[str, int, int], ...]:
    """(kind, micro-batch, chunk) of every chunk-op of rank `rank` of `ranks`, in order; kind is
    `FORWARD` or `BACKWARD`. Needs G a multiple of `ranks` when `chunks` > 1."""
    if chunks == 1:
        return tuple((k, m, 0) for k, m in one_f_one_b(rank, ranks, micro_batches))
    if micro_batches % ranks:
        raise ValueError("interleaved 1F1B needs the micro-batches to be a multiple of the pipeline ranks")
    total = micro_batches * chunks
    warm = interleaved_warmup(rank, ranks, chunks, micro_batches)
    ops = [(FORWARD, *chunk_of(k, ranks, chunks, True)) for k in range(warm)]
    for i in range(total - warm):
        ops.append((FORWARD, *chunk_of(warm + i, ranks, chunks, True)))
        ops.append((BACKWARD, *chunk_of(i, ranks, chunks, False)))
    ops += [(BACKWARD, *chunk_of(k, ranks, chunks, False)) for k in range(total - warm, total)]
    return tuple(ops)


def chunk_recompute(recompute_layers: int, chunk_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks recomputed whole in each chunk of a rank that recomputes `recompute_layers` of its
    blocks: spread as evenly as the chunks allow (the last blocks of each chunk), the remainder
    to the earliest chunks, whose activations live longest."""
    n = len(chunk_layers)
    out = [0] * n
    left = recompute_layers
    while left > 0:
        open_ = [c for c in range(n) if out[c] < chunk_layers[c]]
        if not open_:
            break
        for c in open_:
            if left == 0:
                break
            out[c] += 1
            left -= 1
    return tuple(out)


def chunk_first_layers(chunk_layers: list[tuple[int, ...]]) -> list[list[int]]:
    """The model index of the first block of every chunk, [rank][chunk], from every rank's blocks
    per chunk: chunks are laid out rank 0 chunk 0, rank 1 chunk 0, …, rank 0 chunk 1, …"""
    v = len(chunk_layers[0])
    out = [[0] * v for _ in chunk_layers]
    at = 0
    for c in range(v):
        for r, chunks in enumerate(chunk_layers):
            out[r][c] = at
            at += chunks[c]
    return out


def held_after_forwards(rank: int, ranks: int, chunks: int, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    """The distinct numbers of micro-batches in flight per chunk — forwards run less backwards
    run — right after each forward of the rank's order (where saved activations peak), the one
    just run included. With equal chunks their largest sum is `chunks_in_flight`."""
    held = [0] * chunks
    seen: dict[tuple[int, ...], None] = {}
    for kind, _, c in interleaved_one_f_one_b(rank, ranks, chunks, micro_batches):
        held[c] += 1 if kind == FORWARD else -1
        if kind == FORWARD:
            seen[tuple(held)] = None
    return tuple(seen)
