"""The gradient staging buffer DeepSpeed's ZeRO-1/2 optimizer holds through every backward.

DeepSpeed 0.19's ZeRO optimizer for stages 1 and 2 (`DeepSpeedZeroOptimizer`) copies the
gradients into a contiguous staging buffer before it reduces them (`contiguous_gradients`, on by
default). The buffer is `zero_optimization.reduce_bucket_size` elements long whatever the model's
size (5·10^8 by default), allocated as each backward starts and released when it ends; with
`overlap_comm` (off by default below ZeRO-3, and never written by the export) there are two.
Its elements are 4 bytes for fp32 parameters and for ZeRO-1 accumulating fp32 gradients (an fp32
accumulator), else 2 (ZeRO-2 stages 16-bit gradients even when it accumulates them in fp32). With
bf16 parameters, ZeRO-1 and fp32 gradients DeepSpeed runs another optimizer (`BF16_Optimizer`),
which has no such buffer.

Measured with DeepSpeed's own engine on two CPU ranks, a model of 8,320 parameters
(`tests/export/deepspeed_staging.py`): 1,000,000,000 bytes during the backward for bf16 ZeRO-1
and ZeRO-2 (also with fp32 gradients) and fp16 ZeRO-2; 2,000,000,000 for fp16 ZeRO-1 with fp32
gradients and for fp32 ZeRO-1.

Priced (`staging_bytes`) for the plans DeepSpeed runs with that optimizer and its plain engine:
one stage, ZeRO 1 or 2, more than one data-parallel rank. Not priced: a pipeline's ZeRO-1 stages
(the pipeline engine allocates the buffer when it reduces the gradients after the last backward),
and the fp32 copy of a rank's whole gradient partition that DeepSpeed's step makes (4 bytes per
element of the partition, where Mist's runtime converts 128 MiB pieces).
"""

from __future__ import annotations

# DeepSpeed's default `zero_optimization.reduce_bucket_size` (elements), which the export writes
REDUCE_BUCKET_ELEMENTS = 500_000_000


def staging_bytes(engine: str, num_stages: int, zero: int, dp: int, param_dtype: str, grad_dtype: str | None) -> float:
    """Bytes of the staging buffer DeepSpeed holds through a backward of a plan it runs (see the
    module docstring), 0 where it holds none or where the engine is not DeepSpeed."""
    if engine != "deepspeed" or num_stages != 1 or zero not in (1, 2) or dp <= 1:
        return 0.0
    fp32_grads = grad_dtype == "fp32" and param_dtype != "fp32"
    if zero == 1 and fp32_grads and param_dtype == "bf16":
        return 0.0  # BF16_Optimizer
    wide = param_dtype == "fp32" or (zero == 1 and fp32_grads)
    return float(REDUCE_BUCKET_ELEMENTS * (4 if wide else 2))
