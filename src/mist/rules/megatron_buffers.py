"""What Megatron-LM's optimizer allocates on the device beyond Mist's runtime's states.

Megatron-LM 0.19 keeps a stage's gradients in its DDP buffer, in fp32 where it accumulates and
reduces them in fp32 (bf16 by default, fp16 with `--accumulate-allreduce-grads-in-fp32`), else in
the parameters' 16-bit dtype (fp16 by default, bf16 with `--grad-reduce-in-bf16`). Its optimizers
step fp32 master weights from fp32 gradients, which they take from that buffer with `.float()`:
the non-distributed one (`Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads`,
`megatron/core/optimizer/optimizer.py`) for every parameter of the rank, the distributed one
(ZeRO-1, `DistributedOptimizer._copy_model_grads_to_main_grads`,
`megatron/core/optimizer/distrib_optimizer.py`) for the rank's shard. With an fp32 buffer `.float()`
returns the buffer itself; with a 16-bit one it allocates an fp32 copy, all of them before the
update and held through it (until the next step's `zero_grad`): 4 bytes per element of what the
rank steps, at once, where Mist's runtime converts 128 MiB pieces (`rules.optimizer_step`). With
the optimizer offloaded Megatron steps from the buffer itself (`--use-precision-aware-optimizer`
hands the optimizer the 16-bit shard as `decoupled_grad`); Megatron-FSDP (ZeRO-2/3) keeps its own
buffers. Both are priced as Mist's runtime's. Read in megatron-core 0.19.2's code, not measured.
"""

from __future__ import annotations

import math

from mist.rules.engine_held import EngineHeld

FP32_BYTES = 4


def sixteen_bit_gradients(param_dtype: str, grad_dtype: str | None) -> bool:
    """Whether a plan keeps 16-bit gradients of 16-bit parameters (`grad_dtype` None: the
    parameters' dtype)."""
    return param_dtype in ("bf16", "fp16") and grad_dtype in (None, param_dtype)


def megatron_held(
    engine: str, zero: int, dp: int, param_dtype: str, grad_dtype: str | None, optimizer_offload: float, params: float
) -> EngineHeld:
    """What a Megatron-LM stage of `params` parameters on its rank (before the data-parallel split)
    holds beyond Mist's runtime's states (module docstring): the step's fp32 gradient copies where
    it keeps 16-bit gradients and steps on the device without Megatron-FSDP."""
    if engine != "megatron" or zero > 1 or optimizer_offload > 0 or not sixteen_bit_gradients(param_dtype, grad_dtype):
        return EngineHeld(0.0, None)
    stepped = math.ceil(params / dp) if zero == 1 else params
    return EngineHeld(0.0, FP32_BYTES * stepped)
