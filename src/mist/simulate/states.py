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


def _device_part(n, ratio):
    return n - np.round(n * ratio)


def unit_states(params: float, dp, zero, wo, go, oo, G: int, prec) -> tuple:
    """(weight, gradient, optimizer) device bytes of a unit of `params` parameters."""
    dp = np.asarray(dp, dtype=np.float64)
    zero = np.asarray(zero, dtype=np.float64)
    S = np.ceil(params / dp)
    Np = S * dp
    n_w = np.where(zero >= 3, S, Np)
    n_g = np.where((zero >= 2) | ((zero == 1) & (G == 1)), S, Np)
    n_o = np.where(zero >= 1, S, Np)
    return (prec.weight_bytes * _device_part(n_w, wo),
            prec.grad_bytes * _device_part(n_g, go),
            prec.opt_bytes * _device_part(n_o, oo))
