"""The lengths of a flat unit's buffers at each ZeRO level.

A unit (a decoder block, the embedding, the head) is one flat buffer of a rank's parameters (its
TP shards), n elements padded to a multiple of the data-parallel degree dp so that it splits into
dp equal shards:

    shard_len = ⌈n / dp⌉,   padded_len = shard_len · dp.

Each of the unit's three states is a buffer of either the whole padded length or this rank's shard:

- weights: the shard under ZeRO 3 (gathered over dp before use), else the whole buffer;
- gradients: a shard accumulator under ZeRO 2/3 (reduce-scattered every micro-batch), and under
  ZeRO 1 with one micro-batch (the reduce-scattered shard waits there for the optimizer); else the
  whole buffer (the micro-batches accumulate into it; ZeRO 0 all-reduces it, ZeRO 1 with several
  micro-batches reduce-scatters it once, after the last);
- optimizer (fp32 master weights and Adam moments): the shard under ZeRO ≥ 1, starting at element
  dp_rank · shard_len of the flat buffer; else the whole buffer.

The working weights are materialised from a separate store (and freed after use) when they are
sharded (ZeRO 3) or partly offloaded; otherwise the working buffer itself is persistent.
Which part of each buffer lives on the host is `mist.rules.offload_split`'s business.
"""

from __future__ import annotations

from mist.rules.values import ceil, where


def shard_len(n, dp):
    """Elements of one data-parallel shard of a unit of `n` parameters."""
    return ceil(n / dp)


def padded_len(n, dp):
    """Elements of a unit of `n` parameters padded to `dp` equal shards."""
    return shard_len(n, dp) * dp


def shards_weights(zero):
    """Whether a rank keeps only its shard of the weights (ZeRO 3)."""
    return zero >= 3


def shards_grads(zero, micro_batches):
    """Whether a rank's gradient buffer is its shard (ZeRO 2/3, or ZeRO 1 with one micro-batch)."""
    return (zero >= 2) | ((zero == 1) & (micro_batches == 1))


def shards_optimizer(zero):
    """Whether a rank keeps only its shard of the optimizer states (ZeRO ≥ 1)."""
    return zero >= 1


def regathers_weights(zero):
    """Whether a step's new weights are gathered over dp: the optimizer states are sharded and the
    weights are not (ZeRO 1/2)."""
    return shards_optimizer(zero) & (zero < 3)


def materializes_weights(zero, weights_offload):
    """Whether the working weights are materialised before use and freed after (no persistent
    working buffer): they are sharded or partly offloaded."""
    return shards_weights(zero) | (weights_offload > 0)


def weight_len(shard, padded, zero):
    """Elements of the persistent weight buffer, from the unit's shard and padded lengths."""
    return where(shards_weights(zero), shard, padded)


def grad_len(shard, padded, zero, micro_batches):
    """Elements of the gradient buffer."""
    return where(shards_grads(zero, micro_batches), shard, padded)


def optimizer_len(shard, padded, zero):
    """Elements of each optimizer buffer (master weights, Adam moments)."""
    return where(shards_optimizer(zero), shard, padded)


def optimizer_start(shard, dp_rank, zero):
    """First element of the flat buffer that the rank's optimizer buffers cover."""
    return where(shards_optimizer(zero), dp_rank * shard, 0)


def unit_lengths(n, dp, zero, micro_batches) -> tuple:
    """(weight, gradient, optimizer) buffer elements of a unit of `n` parameters on one rank."""
    shard = shard_len(n, dp)
    padded = shard * dp
    return (
        weight_len(shard, padded, zero),
        grad_len(shard, padded, zero, micro_batches),
        optimizer_len(shard, padded, zero),
    )
