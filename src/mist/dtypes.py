"""The floating-point formats a plan may name, and the bytes of one element of each.

This module does not import torch (the CLI and the simulator start without it); the torch dtype
of each name is in `mist.models.dtypes`."""

#: dtype name (as plans, profiles and options spell it) -> bytes per element
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
