"""Device-resident bytes of one unit's states (weights, gradients, optimizer) as the runtime lays
them out, vectorized over strategies.

A unit (a decoder block, the embedding, the head) is one flat buffer of P parameters (this TP
rank's shard), padded to dp equal shards. Each state's buffer is the whole padded buffer or this
rank's shard by ZeRO level (`mist.rules.flat_units`), and is split so that round(n·r) of its n
elements live on the host when a fraction r of it is offloaded (`mist.rules.offload_split`): the
same rules the runtime's `FlatUnit` and `SplitBuffer` lay the buffers out with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist.rules.flat_units import unit_lengths
from mist.rules.offload_split import device_elements, host_elements
from mist.rules.optimizer_step import GRAD_COPY_BYTES, host_bound_elements, update_read_elements
from mist.rules.values import maximum
from mist.simulate.precision import MASTER_BYTES


def _unit_sizes(params: float, dp, zero, G: int) -> tuple:
    """Elements of a unit's (weight, gradient, optimizer) buffers on this rank."""
    dp = np.asarray(dp, dtype=np.float64)
    zero = np.asarray(zero, dtype=np.float64)
    return unit_lengths(params, dp, zero, G)


def unit_states(params: float, dp, zero, offload_weights, offload_grads, offload_optimizer, G: int, prec) -> tuple:
    """(weight, gradient, optimizer) device bytes of a unit of `params` parameters."""
    n_w, n_g, n_o = _unit_sizes(params, dp, zero, G)
    return (
        prec.weight_bytes * device_elements(n_w, offload_weights),
        prec.grad_bytes * device_elements(n_g, offload_grads),
        prec.opt_bytes * device_elements(n_o, offload_optimizer),
    )


def unit_host_states(params: float, dp, zero, offload_weights, offload_grads, offload_optimizer, G: int, prec) -> tuple:
    """(weight, gradient, optimizer) host bytes of the same unit: the offloaded tails, round(n·r)
    elements of each buffer (`SplitBuffer.host`), plus the fp32 copy of the gradient that the host
    part of the optimizer steps with (`ShardedAdamW._update`: one per unit, alive until that
    unit's deferred CPU step has run) as a fourth value."""
    n_w, n_g, n_o = _unit_sizes(params, dp, zero, G)
    o_host = host_elements(n_o, np.asarray(offload_optimizer, dtype=np.float64))
    return (
        prec.weight_bytes * host_elements(n_w, np.asarray(offload_weights, dtype=np.float64)),
        prec.grad_bytes * host_elements(n_g, np.asarray(offload_grads, dtype=np.float64)),
        prec.opt_bytes * o_host,
        MASTER_BYTES * o_host,
    )


def unit_step_piece(params: float, dp, zero, offload_grads, offload_optimizer, G: int, prec) -> np.ndarray:
    """Device bytes of the largest fp32 gradient piece the optimizer step of the same unit works
    in (`mist.rules.optimizer_step`; 0 where it reads its gradient in place)."""
    _, n_g, n_o = _unit_sizes(params, dp, zero, G)
    d = device_elements(n_o, np.asarray(offload_optimizer, dtype=np.float64))
    g_dev = device_elements(n_g, np.asarray(offload_grads, dtype=np.float64))
    piece = update_read_elements(d, g_dev, prec.grad_bytes == GRAD_COPY_BYTES)
    if prec.target == "cuda":  # (a CPU converts the host AdamW's gradient in host memory)
        piece = maximum(piece, host_bound_elements(d, g_dev, n_o))
    return GRAD_COPY_BYTES * piece


@dataclass(frozen=True)
class Gathered:
    """Whole unit weights a stage holds at once, gathered (ZeRO-3) or fetched (offloaded weights),
    where each phase's activation peak can lie: a block's forward and backward, the head's, the
    embedding's (`gathered_weights`)."""

    block_fwd: np.ndarray
    block_bwd: np.ndarray
    head_fwd: np.ndarray
    head_bwd: np.ndarray
    pre_fwd: np.ndarray
    pre_bwd: np.ndarray


def gathered_weights(layers, block, pre, post, keep_pre: bool, keep_last) -> Gathered:
    """The whole unit weights held at each position, as `runtime.stage_runner` runs the units: a
    unit's from just before it runs to just after (after its backward: once its gradients are
    reduced), with the next unit's on their way (in the backward the one below), and beside them
    what is kept longer:

    - `keep_pre`: the embedding, whose word table the head on the same stage also uses, from its
      forward to its backward (`FlatUnit.keep_until_backward`);
    - `keep_last` (per candidate: how many): the stage's last unit, kept from its forward to its
      backward while later micro-batches' forwards run (a pipeline's warm-up; an interleaved
      rank's chunks each keep theirs); none in a backward.

    `block`, `pre`, `post`: a unit's whole weights in bytes where it gathers or fetches them, else
    0 (`pre`/`post` None on a stage without the embedding / the head). A block's forward takes the
    most of any block's (a pair of blocks, or the last block and the head)."""
    L = np.asarray(layers, dtype=np.float64)
    b = np.asarray(block, dtype=np.float64)
    kl = np.asarray(keep_last, dtype=np.float64)
    has_pre, has_post = pre is not None, post is not None
    p = np.asarray(pre, dtype=np.float64) if has_pre else np.zeros(1)
    q = np.asarray(post, dtype=np.float64) if has_post else np.zeros(1)
    kp = p if keep_pre else 0.0 * p
    # the stage's last unit: the head, else the last block (else the embedding)
    last = q if has_post else np.where(L >= 1, b, p)
    one = L >= 1
    # a block's forward: with the next block (a pair without the last unit exists when the head
    # follows, or with three blocks or more), or the last block with the head (or alone)
    pair = np.where(L >= 2, 2 * b + kp + np.where(has_post | (L >= 3), kl * last, 0.0), 0.0)
    block_fwd = np.maximum(pair, np.where(one, b + q + kp, 0.0))
    # a block's backward: with the block below, or the first block with the embedding
    block_bwd = np.maximum(np.where(L >= 2, 2 * b + kp, 0.0), np.where(one, b + p, 0.0))
    # the embedding's forward with the unit after it; its backward alone (the block above has
    # released its weights once its gradients were reduced)
    after = np.where(one, b, q)
    last_is_after = (L == 0) | ((L == 1) & (not has_post))
    pre_fwd = p + after + np.where(last_is_after, 0.0, kl * last) if has_pre else 0.0
    pre_bwd = p if has_pre else 0.0
    # the head's forward alone (the block before released once it ran); its backward with the
    # block below on its way
    head_fwd = q + np.where(one, kp, 0.0) if has_post else 0.0
    head_bwd = q + np.where(one, b + kp, p) if has_post else 0.0
    z = 0.0 * L * b  # (every field broadcast to the candidates)
    return Gathered(*(x + z for x in (block_fwd, block_bwd, head_fwd, head_bwd, pre_fwd, pre_bwd)))
