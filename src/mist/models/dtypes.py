"""The torch dtype of each dtype name a plan may use (the names and their sizes are in
`mist.dtypes`, which does not import torch)."""

from __future__ import annotations

import torch

#: dtype name -> torch dtype, for every name of `mist.dtypes.DTYPE_BYTES`
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a plan's dtype name stands for (KeyError for a name that is not one)."""
    return TORCH_DTYPES[name]
