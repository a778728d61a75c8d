"""Whether a stage's predicted peak fits one GPU: the single rule that `simulate_plan`, `mist
estimate`, every tuner (1F1B, interleaved, ZB-H1) and the framework baselines apply, and the words
their refusals use for it.

A stage needs its predicted peak of allocated bytes plus an allocator margin: PyTorch's caching
allocator rounds blocks up and fragments, so the device must keep that fraction free on top of
the peak (a named, calibratable assumption; Mist's original used a fixed 0.88 of capacity plus
hand-tuned per-knob factors). It fits when that need is at most what the allocator can have: the
profile's `memory_bytes` (lowered by `--memory-limit`) less the device memory in use outside the
allocator — the CUDA context and the libraries' own buffers — where `mist profile` measured it on
the GPU (`outside_allocator_bytes`; profiles without it count none).
"""

from __future__ import annotations

import numpy as np

ALLOCATOR_MARGIN = 0.05

# how a refusal names the need, after the number
NEED_WORDS = f"peak + {ALLOCATOR_MARGIN:.0%} allocator margin"


def need_bytes(peak):
    """GPU bytes a stage with this predicted peak needs (a number or an array of them)."""
    return np.multiply(peak, 1 + ALLOCATOR_MARGIN)


def usable_bytes(profile) -> int:
    """Device bytes PyTorch's allocator can have on a GPU of `profile`."""
    return int(profile.memory_bytes) - int(profile.outside_allocator_bytes or 0)


def fits_gpu(peak, profile) -> np.ndarray:
    """Whether each predicted peak fits a GPU of `profile` (elementwise over arrays)."""
    return np.asarray(need_bytes(peak) <= usable_bytes(profile))


def outside_words(profile) -> str:
    """What a refusal adds after "the N GiB of a <gpu>" when part of the device is not the
    allocator's ("" when the profile measured none)."""
    outside = profile.outside_allocator_bytes or 0
    if outside <= 0:
        return ""
    return f" left to PyTorch's allocator ({outside / 2**30:.2f} GiB are in use outside it)"
