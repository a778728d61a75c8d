"""When a unit accumulates its micro-batches' gradients in place.

In place, every micro-batch's gradients are added straight into the unit's gradient buffer
(autograd adds into .grad views of it, or a hook adds each .grad into an fp32 buffer), and the
buffer is reduced over data parallelism once, after the step's last micro-batch. That needs the
buffer to be the whole flat gradient and to lie entirely on the device:

    in place  ⇔  grad_len = padded_len  and  no gradient element on the host.

Otherwise each micro-batch's gradients are flattened into a transient buffer, reduced, and added
into the (sharded or partly offloaded) accumulator.

`accumulates_in_place` is that rule on a unit's lengths, as the runtime's `FlatUnit` has them.
`accumulates_in_place_by_level` is the same rule on the knobs alone, as the simulator evaluates
it for candidates before any unit exists: the buffer is whole when `flat_units.shards_grads` is
false (ZeRO 0, or ZeRO 1 with several micro-batches) and all on the device when the gradient
offload fraction is 0. The two agree whenever dp > 1 (a shard is then shorter than the whole)
and an offloaded fraction moves at least one element; with dp = 1 a "shard" is the whole buffer,
which the runtime then also accumulates in place.

What the gradient path holds beyond the buffers, by phase: a unit that does not accumulate in
place keeps its parameters' .grad from where autograd makes them to the end of its backward
(`mist.analysis.liveness`), then flattens them (`flattening_bytes`); a unit's reduction holds its
buffers while the unit below runs its backward (`reduction_in_flight_bytes`). Neither exists in a
forward, nor in the backward of the first unit a micro-batch's backward runs (every micro-batch's
reductions are waited for at its end).
"""

from __future__ import annotations

from mist.rules.flat_units import padded_len, shard_len, shards_grads
from mist.rules.values import logical_not, where


def accumulates_in_place(grad_len, padded_len, grad_host_len):
    """Whether a unit's gradient buffer of `grad_len` elements, `grad_host_len` of them on the
    host, accumulates the micro-batches in place (`padded_len`: the whole flat gradient)."""
    return (grad_len == padded_len) & (grad_host_len == 0)


def accumulates_in_place_by_level(zero, grads_offload, micro_batches):
    """The same rule from the ZeRO level, the gradient offload fraction and the micro-batch count."""
    return (grads_offload == 0) & logical_not(shards_grads(zero, micro_batches))


def reduction_in_flight_bytes(n, dp, zero, in_place, grad_bytes):
    """Bytes a unit's data-parallel gradient reduction holds from when it is issued until the next
    unit's gradients are complete (the runtime's `Comms`, one reduction in flight per stage): the
    flat gradient it reads (none in place: the reduction reads the accumulator itself) and, when it
    is reduce-scattered (ZeRO ≥ 1), the shard it writes. Nothing is in flight without a
    data-parallel group (dp = 1). `n`: the unit's parameters."""
    padded = padded_len(n, dp)
    flat = where(in_place, 0.0, padded * grad_bytes)
    out = where(zero >= 1, shard_len(n, dp) * grad_bytes, 0.0)
    return where(dp > 1, flat + out, 0.0)


def flattening_bytes(n, dp, in_place, weight_bytes, grad_bytes):
    """Bytes of a unit's gradients when it flattens them (not in place): the parameters' .grad, in
    the weights' dtype, beside the flat buffer it copies them into (padded, in the gradient dtype).
    The reduction before it has been waited for. Nothing in place."""
    return where(in_place, 0.0, n * weight_bytes + padded_len(n, dp) * grad_bytes)
