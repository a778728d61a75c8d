"""Device-resident bytes of one unit's states (weights, gradients, optimizer) as the runtime lays
them out, vectorized over strategies.

A unit (a decoder block, the embedding, the head) is one flat buffer of P parameters (this TP
rank's shard), padded to Np = ⌈P/dp⌉·dp elements so that it splits into dp equal shards of S = Np/dp.
Each state is a split buffer whose device part is n − round(n·r) of its n elements when a fraction
r of it is offloaded (`mist.runtime.buffers.split_point`):

- weights: the whole buffer (Np), or this rank's shard (S) under ZeRO 3;
- gradients: a shard accumulator (S) under ZeRO 2/3, and under ZeRO 1 with one micro-batch (the
  reduce-scattered shard waits there for the optimizer); otherwise the whole buffer (Np);
- optimizer: fp32 master + Adam m + v over this rank's shard (S) for ZeRO ≥ 1, else over Np.
"""

from __future__ import annotations

import numpy as np

MASTER_BYTES = 4   # fp32: the master weights, and the gradient copy the CPU AdamW steps with


def _device_part(n, ratio):
    return n - np.round(n * ratio)


def _unit_sizes(params: float, dp, zero, G: int) -> tuple:
    """Elements of a unit's (weight, gradient, optimizer) buffers on this rank (see above)."""
    dp = np.asarray(dp, dtype=np.float64)
    zero = np.asarray(zero, dtype=np.float64)
    S = np.ceil(params / dp)
    Np = S * dp
    n_w = np.where(zero >= 3, S, Np)
    n_g = np.where((zero >= 2) | ((zero == 1) & (G == 1)), S, Np)
    n_o = np.where(zero >= 1, S, Np)
    return n_w, n_g, n_o


def unit_states(params: float, dp, zero, wo, go, oo, G: int, prec) -> tuple:
    """(weight, gradient, optimizer) device bytes of a unit of `params` parameters."""
    n_w, n_g, n_o = _unit_sizes(params, dp, zero, G)
    return (prec.weight_bytes * _device_part(n_w, wo),
            prec.grad_bytes * _device_part(n_g, go),
            prec.opt_bytes * _device_part(n_o, oo))


def unit_host_states(params: float, dp, zero, wo, go, oo, G: int, prec) -> tuple:
    """(weight, gradient, optimizer) host bytes of the same unit: the offloaded tails, round(n·r)
    elements of each buffer (`SplitBuffer.host`), plus the fp32 copy of the gradient that the host
    part of the optimizer steps with (`ShardedAdamW._update`: one per unit, alive until that
    unit's deferred CPU step has run) as a fourth value."""
    n_w, n_g, n_o = _unit_sizes(params, dp, zero, G)
    o_host = np.round(n_o * np.asarray(oo, dtype=np.float64))
    return (prec.weight_bytes * np.round(n_w * np.asarray(wo, dtype=np.float64)),
            prec.grad_bytes * np.round(n_g * np.asarray(go, dtype=np.float64)),
            prec.opt_bytes * o_host,
            MASTER_BYTES * o_host)
