"""Activation checkpointing of whole blocks, exactly as the runtime applies it.

Reentrant checkpointing keeps only the block input (saved through `save_for_backward`, so the
saved-tensor hooks of `mist.analysis` and of the memory checks see it) and re-runs the forward at
the start of the block's backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def run_block(block: torch.nn.Module, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    if not recompute:
        return block(x)
    return checkpoint(block, x, use_reentrant=True, preserve_rng_state=False)
