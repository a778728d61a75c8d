"""Bytes per parameter and the traced dtype/device of a run: what the plan's dtypes mean in memory.

The runtime keeps, per parameter: the working weights in the parameter dtype, the gradient
buffers in the gradient dtype (the parameter dtype unless the plan asks for fp32), and fp32 master weights plus the two AdamW moments (12 bytes) for the optimizer — also when
the parameters are fp32 (the master copy is then a plain second copy). Activations are traced in
the compute dtype on the device kind the profile measured ("cpu" profiles written by `mist profile
--device cpu`, every other profile a CUDA GPU), since the saved set of attention differs by device.
"""

from __future__ import annotations

from dataclasses import dataclass

from mist.dtypes import DTYPE_BYTES

OPT_BYTES = 12  # fp32 master + Adam m + v
MASTER_BYTES = 4  # fp32: a master weight, and the host AdamW's copy of its gradient


@dataclass(frozen=True)
class Precision:
    weight_bytes: int = 2
    grad_bytes: int = 2
    opt_bytes: int = OPT_BYTES
    trace_dtype: str = "bf16"
    target: str = "cuda"


def profile_target(profile) -> str:
    """'cpu' for a profile measured on a CPU, else 'cuda'."""
    fp = getattr(profile, "fingerprint", None) or {}
    return "cpu" if fp.get("device_kind") == "cpu" else "cuda"


def profile_dtype(profile) -> str:
    """The dtype the profile's tables were measured in (bf16 when it does not say)."""
    fp = getattr(profile, "fingerprint", None) or {}
    d = fp.get("dtype", "bf16")
    return d if d in DTYPE_BYTES else "bf16"


def precision_for(training, profile) -> Precision:
    """The precision of `training` (a TrainingSpec) on the device of `profile`."""
    pb = DTYPE_BYTES[training.param_dtype]
    return Precision(
        weight_bytes=pb,
        grad_bytes=training.grad_bytes,
        trace_dtype=training.compute_dtype,
        target=profile_target(profile),
    )


def default_precision(profile, dtype: str | None = None) -> Precision:
    """Parameters and compute both in `dtype` (default: the profile's own dtype)."""
    d = dtype or profile_dtype(profile)
    return Precision(
        weight_bytes=DTYPE_BYTES[d], grad_bytes=DTYPE_BYTES[d], trace_dtype=d, target=profile_target(profile)
    )
