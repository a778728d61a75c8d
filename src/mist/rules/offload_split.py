"""Fractional offloading: which elements of a flat buffer or a saved tensor live on the host.

A buffer of n elements with a fraction r offloaded keeps its first n − round(n·r) elements on the
device (the head) and its last round(n·r) in host memory (the tail); the rounding is to the
nearest integer, halves to even (Python's and numpy's `round`). There is no per-tensor selection:
the runtime's `SplitBuffer` splits every flat state buffer (weights, gradients, optimizer states)
this way, and its saved-tensor hooks split every saved activation on its own this way.

A saved activation is split only while the running block has a ratio r > 0, and only when it has
at least `MIN_SPLIT_NUMEL` elements: a one-element tensor (a scalar such as a dropout seed or a
norm's count) stays whole on the device. The simulator sums those per-tensor splits over a
block's saved tensors (`kept_saved_bytes`, `offloaded_saved_bytes`).
"""

from __future__ import annotations

import numpy as np

from mist.rules.values import round_half_even

MIN_SPLIT_NUMEL = 2  # saved tensors with fewer elements are never split


def host_elements(n, ratio):
    """Elements of a buffer of `n` that live on the host when the fraction `ratio` is offloaded."""
    return round_half_even(n * ratio)


def device_elements(n, ratio):
    """Elements of a buffer of `n` that stay on the device (its head) when `ratio` is offloaded."""
    return n - host_elements(n, ratio)


def splits_saved(numel, ratio):
    """Whether a saved tensor of `numel` elements is split between device and host at `ratio`."""
    return (ratio > 0) & (numel >= MIN_SPLIT_NUMEL)


def kept_saved_bytes(numel, elt, whole, full, ratio):
    """Saved-activation bytes a block keeps on the device at offload ratio `ratio`.

    `numel`, `elt`: elements and element bytes of the saved tensors that can be split, one row per
    tensor (axis 0; further axes are candidates); `whole`: bytes of the one-element tensors, kept
    whole; `full`: bytes of the unique storages, all kept when nothing is offloaded (ratio 0)."""
    kept = np.sum(elt * device_elements(numel, ratio), axis=0) + whole
    return np.where(ratio > 0, kept, full)


def offloaded_saved_bytes(numel, elt, ratio):
    """Saved-activation bytes of a block in host memory at `ratio`: the tails of the tensors that
    `kept_saved_bytes` splits (same rows)."""
    return np.where(ratio > 0, np.sum(elt * host_elements(numel, ratio), axis=0), 0.0)


def update_crossing(n, weights_ratio, optimizer_ratio):
    """(out, in): elements that a step writing new weights from a master of `n` elements split at
    `optimizer_ratio` into a weight store of the same `n` elements split at `weights_ratio` moves
    across the host link. Both keep their tails on the host, so the device-stepped elements the
    store keeps on the host go out (device→host), and the host-stepped ones it keeps on the device
    come in (host→device); the rest stay on their side."""
    dw, do = device_elements(n, weights_ratio), device_elements(n, optimizer_ratio)
    return np.maximum(do - dw, 0), np.maximum(dw - do, 0)
