"""Device-resident bytes of one unit's states (weights, gradients, optimizer) as the runtime lays
them out, vectorized over strategies.

A unit (a decoder block, the embedding, the head) is one flat buffer of P parameters (this TP
rank's shard), padded to dp equal shards. Each state's buffer is the whole padded buffer or this
rank's shard by ZeRO level (`mist.rules.flat_units`), and is split so that round(n·r) of its n
elements live on the host when a fraction r of it is offloaded (`mist.rules.offload_split`): the
same rules the runtime's `FlatUnit` and `SplitBuffer` lay the buffers out with.
"""

from __future__ import annotations

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
