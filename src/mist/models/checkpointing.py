"""Activation checkpointing, exactly as the runtime applies it.

Whole blocks: reentrant checkpointing keeps only the block input (saved through
`save_for_backward`, so the saved-tensor hooks of `mist.analysis` and of the memory checks see it)
and re-runs the forward at the start of the block's backward.
Attention only (`attention=True`, for blocks that are not checkpointed whole): the block keeps its
activations except those of the attention core, which keeps q, k and v and is re-run at the start
of its own backward (`mist.models.attention`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def run_block(block: torch.nn.Module, x: torch.Tensor, recompute: bool, attention: bool = False) -> torch.Tensor:
    block.attn.recompute_core = attention and not recompute
    if not recompute:
        return block(x)
    return checkpoint(block, x, use_reentrant=True, preserve_rng_state=False)
