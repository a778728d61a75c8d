"""What DeepSpeed's optimizers allocate on the device beyond Mist's runtime's states.

DeepSpeed 0.19 runs a stage with ZeRO 1 or 2 (on any number of data-parallel ranks, one too) with
`DeepSpeedZeroOptimizer` (`runtime/zero/stage_1_and_2.py`), except with bf16 parameters, ZeRO-1
and fp32 gradients on the device, where it runs `BF16_Optimizer` (below). That optimizer holds:

- **a gradient staging buffer** (`contiguous_gradients`, on by default) of
  `zero_optimization.reduce_bucket_size` elements whatever the model's size (5·10^8 by default,
  which the export writes out), in 4-byte elements for fp32 parameters and for ZeRO-1 accumulating
  fp32 gradients, else 2-byte (ZeRO-2 stages 16-bit gradients even when it accumulates them in
  fp32). `overlap_comm` would double it; it is off below ZeRO-3 and the export never sets it. It
  is allocated in the first backward of a step. ZeRO-2 releases it at the end of every backward;
  ZeRO-1 keeps it until it reduces the gradients after the last one, so the forwards that come
  after a backward hold it too (the later micro-batches' of one stage, a pipeline's steady-state
  ones). The pipeline engine (ZeRO 0 or 1 only) allocates a second one when it reduces the
  gradients, and releases both before the step.
- **ZeRO-2, besides**: from the second micro-batch of a step on, each backward adds its reduced
  gradients into the rank's partition through a second buffer of the partition's size (in the
  gradients' accumulation dtype); with fp32 gradients each bf16 gradient is converted to fp32 as
  it is added (4 bytes per element of the largest parameter, one at a time). When the rank's
  parameters fit one bucket (at most `reduce_bucket_size` elements), the bucket is reduced as
  the backward ends, and, spanning every rank's partition, it is flattened into a copy first (in
  the bucket's dtype: 2 bytes per parameter, 4 with fp32 ones) while the staging buffer is held.
- **ZeRO-1 accumulating fp32 gradients of 16-bit parameters, besides**: it reduces after the last
  backward (its activations gone), `reduce_bucket_size` elements at a time: each parameter's fp32
  gradient is moved into the staging buffer (its own tensor, which Mist's states count, freed),
  the bucket's gradients are flattened into an fp32 copy and that is converted into the
  parameters' 16-bit dtype to be all-reduced, and the rank's reduced part is added into an fp32
  buffer of its gradient partition, made at the first bucket and held through the update. Beyond
  the states and the staging buffer: 2 bytes per element of a bucket (the fp32 flat copy, 4, less
  the moved gradients, 4, plus the 16-bit copy, 2) and 4 per element of the partition.
- **at the step**, one after the other: the gradient norm converts each parameter's piece of the
  rank's gradient partition to fp64 (8 bytes per element of the largest piece, one at a time);
  then the partition is flattened (a copy in the gradients' dtype) and converted to fp32, the
  flat copy released once converted and the fp32 one held through the update: 6 bytes per element
  of the partition at once for 16-bit gradients, 4 for fp32 ones (ZeRO-2 with fp32 gradients and
  ZeRO-1 with fp32 gradients keep their partition in fp32; a bound there: the step frees the
  reduced gradients, and with them the staging buffer, before it, and was measured to allocate no
  more than the norm's piece). Mist's runtime converts 128 MiB pieces
  instead (`rules.optimizer_step`). With the optimizer offloaded DeepSpeed steps on the host from
  host copies of the gradients; that step is priced as Mist's runtime's.

Without ZeRO, DeepSpeed runs 16-bit parameters with `FP16_Optimizer` (`runtime/fp16/
fused_optimizer.py`; bf16 pipelines excepted, which run `BF16_Optimizer`). Its step
converts each parameter's gradient to fp32 and then flattens those copies into one fp32 buffer,
all of them at once: 8 bytes per parameter of the stage on top of the states.

`BF16_Optimizer` (`runtime/bf16_optimizer.py`: bf16 parameters with ZeRO-1 and fp32 gradients and
the optimizer on the device; bf16 pipelines without ZeRO) shards the fp32 master weights and Adam's
moments over the data-parallel ranks, as ZeRO-1 does, also when the plan says ZeRO-0
(`optimizer_zero`), and accumulates the gradients in one flat buffer of every parameter in the
gradients' dtype: Mist's runtime's states. Beyond them it keeps each parameter's own bf16
gradient, 2 bytes per parameter, from the backward that makes it to the end of the step (it adds
them into the flat buffer after each backward and frees them only after the update). After the last backward, with
fp32 gradients, it converts each bf16 gradient to fp32 as it adds it (4 bytes per element of the
largest parameter, one at a time) and reduces the flat buffer in bf16, DeepSpeed's communication
dtype for bf16, from a bf16 copy of all of it (2 bytes per parameter); with bf16 gradients its
update steps from an fp32 copy of the rank's gradient partition (4 bytes per element). Its
all-gather of the updated weights writes into their flat buffer.

DeepSpeed's ZeRO-3 optimizer (`DeepSpeedZeroOptimizer_Stage3`, `runtime/zero/stage3.py`) allocates
its staging buffer of `reduce_bucket_size` elements, in the parameters' dtype, when it is built
and holds it for the whole run: through every forward, backward and step. Beyond it:

- **gathered parameters.** With its defaults DeepSpeed keeps up to `stage3_max_live_parameters`
  (10^9) parameters gathered and does not release one it will reuse within
  `stage3_max_reuse_distance` (10^9) elements, so a stage of under 10^9 parameters keeps about all
  of its weights gathered from the forward into the backward (measured: the whole stand-in), and
  its coalesced all-gathers land in a flat buffer from which each parameter is then copied (both
  live until the batch's last parameter is used). The export writes the knobs that make it
  gather as Mist's runtime does (`zero3_gathering`): at most two blocks' parameters live (a
  unit with the next on its way), one block prefetched, each parameter released after its use
  and gathered again in the backward, and each gathered into its own buffer
  (`stage3_allgather_sequential`). It then holds at most one parameter more than that pair: its
  prefetch adds a whole parameter while fewer than the limit are live (priced: the largest).
  Parameters under `stage3_param_persistence_threshold` (10^5 elements: norms, biases) stay
  gathered throughout; they are not priced (about 13·h elements a block, under 0.1 % of it).
- **a flat copy of the reduced bucket.** It reduces the gradients gathered in the staging buffer
  when the next would not fit (in the backward, on a rank of more than `reduce_bucket_size`
  parameters) and as each backward ends, reduce-scattering a flat copy of the bucket's gradients
  (`reduce_scatter_coalesced`: in the bucket's dtype, all of the bucket's elements), and with
  fp32 gradients converting the rank's part of it to fp32 (4 bytes per element over dp).
- **the step**: the same copies as `DeepSpeedZeroOptimizer`'s (the norm's fp64 piece, then the
  flat partition and its fp32 copy); on the host with the optimizer offloaded.

Measured with DeepSpeed's own engine on two CPU ranks (`tests/export/deepspeed_staging.py`): a
staging buffer of 1,000,000,000 bytes through the backward for bf16 ZeRO-1 and ZeRO-2 (also with
fp32 gradients and with the optimizer offloaded) and fp16 ZeRO-2, 2,000,000,000 for fp16 ZeRO-1
with fp32 gradients and fp32 ZeRO-1; at the step, for a bf16 model of three weight matrices of
8, 8 and 1 Mi elements (a partition of 8.5 Mi elements per rank), fp64 norm pieces of 64 and 4 MiB
(rank 0) and 60 and 8 MiB (rank 1), then a 17 MiB bf16 flat partition and a 34 MiB fp32 one;
the step of a bf16 model of 16 Mi parameters without ZeRO, 128 MiB exactly; ZeRO-3's buffer, once
built, 1,000,000,000 bytes with bf16 parameters (also with fp32 gradients, and with the weights
and the optimizer offloaded), 2,000,000,000 with fp32 ones. The lifetimes, from allocation
events over two micro-batches: ZeRO-2 allocates and releases the buffer in each backward, ZeRO-1
allocates it in the first and releases it in the second; a two-stage bf16 ZeRO-1 pipeline (four
micro-batches, one rank per stage) allocates it from a gradient hook in the backward, a second one
when it reduces the gradients, and releases both before the step. On one rank (dp 1) the same: the
ZeRO-1/2 and ZeRO-3 buffers of 1,000,000,000 bytes, and a ZeRO-1 step of 24 MiB for a bf16
partition of 4 Mi elements. `BF16_Optimizer`, with 16 weight matrices of 1 Mi elements (16 Mi
bf16 parameters, ZeRO-1, fp32 gradients, two ranks, two micro-batches): 32 MiB of bf16 gradients
kept at the second forward and at the reduction, which adds a 32 MiB bf16 copy; the update
allocated only gloo's 32 MiB copy of the gathered weights (NCCL gathers in place). A two-stage
pipeline of the same matrices (8 Mi parameters per rank, dp 1, four micro-batches): 16 MiB of
gradients kept at the last forward and the reduction; with bf16 gradients an update of 32 MiB (the
fp32 copy), with fp32 gradients a reduction of 16 MiB. bf16 ZeRO-1 with fp32 gradients and the
optimizer offloaded runs `DeepSpeedZeroOptimizer`: a 2,000,000,000-byte buffer. ZeRO-2 (16 Mi bf16
parameters, two ranks, two micro-batches), beyond Mist's states and the buffer: 16 MiB in the
second backward (32 + 4 MiB with fp32 gradients), 32 MiB as the last ends (36 MiB); with 128 Mi
parameters and buckets of 16 and 32 Mi elements, the 128 MiB second partition (and one 8 MiB
gradient, which Mist's runtime's backward makes too). fp16 ZeRO-1 with fp32 gradients (16 Mi
parameters, two ranks, two micro-batches), beyond the states and the buffer after the last
backward: 64 MiB with one bucket (a 64 MiB fp32 flat copy, its 32 MiB fp16 conversion and the
32 MiB fp32 partition, the 64 MiB of moved gradients freed), 40 MiB with buckets of 4 Mi
elements. ZeRO-3 (24 matrices of 1 Mi bf16 elements taken as 8 blocks of 3, two ranks, two
micro-batches, the export's knobs for those blocks): at
most one block's parameters gathered at once (6 MiB, under the pair's 12), reductions that
allocated 48 MiB (one bucket: its flat copy, 2 bytes × 24 Mi), 96 MiB with fp32 gradients (and
the rank's 12 Mi elements in fp32), 8 MiB with buckets of 4 Mi elements, and updates of 72 MiB
(6 bytes × 12 Mi; 48 MiB with fp32 gradients); with DeepSpeed's defaults every parameter of an
8 Mi-parameter stand-in stayed gathered from the forward into the backward (of a 16 Mi one too
with only `stage3_max_reuse_distance` set to 0). What the
measurement shows and is not priced is listed in `docs/targets/deepspeed.md`.
"""

from __future__ import annotations

import math

from mist.rules.engine_held import EngineHeld

# DeepSpeed's default `zero_optimization.reduce_bucket_size` (elements), which the export writes
REDUCE_BUCKET_ELEMENTS = 500_000_000
NORM_BYTES = 8  # the gradient norm's fp64 copy of a parameter's piece
FP32_BYTES = 4
FP16_STEP_BYTES = 8  # FP16_Optimizer's step: every gradient's fp32 copy, then their fp32 flat
BF16_BYTES = 2  # a 16-bit element: BF16_Optimizer's kept gradients and its copy to reduce; a bucket's


def zero_optimizer(engine: str, zero: int, param_dtype: str, grad_dtype: str | None, optimizer_offload: float) -> bool:
    """Whether DeepSpeed runs the stage with `DeepSpeedZeroOptimizer` (module docstring)."""
    if engine != "deepspeed" or zero not in (1, 2):
        return False
    return not bf16_optimizer(engine, 1, zero, param_dtype, grad_dtype, optimizer_offload)


def fp16_optimizer(engine: str, num_stages: int, zero: int, param_dtype: str, grad_dtype: str | None) -> bool:
    """Whether DeepSpeed runs the stage with `FP16_Optimizer` (module docstring)."""
    if engine != "deepspeed" or zero != 0 or param_dtype == "fp32" or grad_dtype not in (None, param_dtype):
        return False
    return not (param_dtype == "bf16" and num_stages > 1)


def bf16_optimizer(
    engine: str, num_stages: int, zero: int, param_dtype: str, grad_dtype: str | None, optimizer_offload: float
) -> bool:
    """Whether DeepSpeed runs the stage with `BF16_Optimizer` (module docstring)."""
    if engine != "deepspeed" or param_dtype != "bf16":
        return False
    if zero == 1:
        return grad_dtype == "fp32" and optimizer_offload == 0
    return zero == 0 and num_stages > 1 and grad_dtype in (None, "bf16")


def optimizer_zero(
    engine: str, num_stages: int, zero: int, param_dtype: str, grad_dtype: str | None, optimizer_offload: float
) -> int:
    """The ZeRO level whose states the stage's engine holds: 1 where `BF16_Optimizer` runs a ZeRO-0
    stage (it shards the optimizer's states over the data-parallel ranks), else the plan's."""
    return (
        1
        if zero == 0 and bf16_optimizer(engine, num_stages, zero, param_dtype, grad_dtype, optimizer_offload)
        else zero
    )


def bucket_element_bytes(zero: int, param_dtype: str, grad_dtype: str | None) -> int:
    """Bytes of an element of the gradient staging buffer (module docstring)."""
    wide = param_dtype == "fp32" or (zero == 1 and grad_dtype == "fp32")
    return FP32_BYTES if wide else BF16_BYTES


def staging_bytes(zero: int, param_dtype: str, grad_dtype: str | None, bucket: int = REDUCE_BUCKET_ELEMENTS) -> float:
    """Bytes of the gradient staging buffer of `DeepSpeedZeroOptimizer` (ZeRO 1/2) or
    `DeepSpeedZeroOptimizer_Stage3` (in the parameters' dtype), of `bucket` elements."""
    return float(bucket * bucket_element_bytes(zero, param_dtype, grad_dtype))


def zero3_gathering(block_elements: int) -> dict[str, int | bool]:
    """The `zero_optimization` knobs with which ZeRO-3 gathers parameters as Mist's runtime does
    (module docstring), for blocks of `block_elements` parameters on a rank."""
    return {
        "stage3_max_live_parameters": 2 * block_elements,
        "stage3_prefetch_bucket_size": block_elements,
        "stage3_max_reuse_distance": 0,
        "stage3_allgather_sequential": True,
    }


def zero1_fp32_reduction(params: float, dp: int, bucket: int = REDUCE_BUCKET_ELEMENTS) -> float:
    """Bytes fp32-accumulating ZeRO-1's reduction holds beyond the states and its staging buffer
    (module docstring): a bucket's 16-bit copy, net, and the rank's fp32 gradient partition."""
    return BF16_BYTES * min(params, bucket) + FP32_BYTES * math.ceil(params / dp)


def step_bytes(partition: float, largest_piece: float, param_dtype: str, grad_dtype: str | None) -> float:
    """The most bytes `DeepSpeedZeroOptimizer`'s step holds at once beyond the states: the
    gradient norm's fp64 piece, or the flat partition and its fp32 copy (module docstring)."""
    fp32_grads = param_dtype == "fp32" or grad_dtype == "fp32"
    copy = partition * (FP32_BYTES if fp32_grads else FP32_BYTES + 2)
    return max(NORM_BYTES * min(largest_piece, partition), copy)


def deepspeed_held(
    engine: str,
    num_stages: int,
    zero: int,
    dp: int,
    param_dtype: str,
    grad_dtype: str | None,
    optimizer_offload: float,
    params: float,
    largest_param: float,
    forward_after_backward: bool = False,
    several_backwards: bool = True,
    bucket: int = REDUCE_BUCKET_ELEMENTS,
) -> EngineHeld:
    """What a stage of `params` parameters on its rank (before the data-parallel split), the
    largest of them `largest_param`, holds beyond Mist's runtime's states (module docstring);
    `forward_after_backward`: whether the stage runs a forward after its first backward of a step
    (which, in 1F1B, holds as many micro-batches as its forward peak); `several_backwards`:
    whether it runs more than one backward in a step (G > 1); `bucket`: `reduce_bucket_size` (the
    export's by default)."""
    if fp16_optimizer(engine, num_stages, zero, param_dtype, grad_dtype):
        return EngineHeld(0.0, FP16_STEP_BYTES * params)
    if bf16_optimizer(engine, num_stages, zero, param_dtype, grad_dtype, optimizer_offload):
        return _bf16_held(params, largest_param, dp, grad_dtype, forward_after_backward, several_backwards)
    if engine == "deepspeed" and zero == 3:
        return _zero3_held(params, largest_param, dp, param_dtype, grad_dtype, optimizer_offload, bucket)
    if not zero_optimizer(engine, zero, param_dtype, grad_dtype, optimizer_offload):
        return EngineHeld(0.0, None)
    staging = staging_bytes(zero, param_dtype, grad_dtype, bucket)
    # ZeRO-1 keeps it from the first backward to the reduction, where a pipeline adds a second
    forward = staging if zero == 1 and forward_after_backward else 0.0
    reduction = 2 * staging if num_stages > 1 else 0.0
    if optimizer_offload > 0:  # the step on the host (module docstring)
        return EngineHeld(staging, reduction or None, forward=forward)
    partition = math.ceil(params / dp)
    step = step_bytes(partition, largest_param, param_dtype, grad_dtype)
    if zero == 2:
        backward, end = _zero2_reduction(
            params, partition, largest_param, dp, param_dtype, grad_dtype, several_backwards, bucket
        )
        return EngineHeld(staging + backward, max(step, staging + end))
    if grad_dtype == "fp32" and param_dtype != "fp32":  # after the last backward, with the buffer
        step = max(step, staging + zero1_fp32_reduction(params, dp, bucket))
    return EngineHeld(staging, max(reduction, step), forward=forward)


def _zero2_reduction(
    params: float,
    partition: int,
    largest: float,
    dp: int,
    param_dtype: str,
    grad_dtype: str | None,
    several: bool,
    bucket: int,
) -> tuple[float, float]:
    """What ZeRO-2 holds beside its staging buffer (module docstring): through a backward after the
    first of a step, and when the last ends."""
    fp32 = param_dtype == "fp32"
    convert = FP32_BYTES * largest if grad_dtype == "fp32" and not fp32 else 0.0
    accumulated = (FP32_BYTES if fp32 or grad_dtype == "fp32" else 2) * partition + convert if several else 0.0
    spans = dp > 1 and params <= bucket  # one bucket, reduced as the backward ends
    flat = bucket_element_bytes(2, param_dtype, grad_dtype) * params + convert if spans else 0.0
    return accumulated, flat


def _zero3_held(
    params: float,
    largest: float,
    dp: int,
    param_dtype: str,
    grad_dtype: str | None,
    optimizer_offload: float,
    bucket: int,
) -> EngineHeld:
    """`DeepSpeedZeroOptimizer_Stage3`'s (module docstring): its staging buffer throughout; one
    parameter gathered beyond Mist's runtime's pair in every forward and backward; a bucket's flat
    copy in the backward on a rank of more than one bucket, and after each backward with the step."""
    width = bucket_element_bytes(3, param_dtype, grad_dtype)
    widen = grad_dtype == "fp32" and param_dtype != "fp32"

    def flush(n: float) -> float:  # reduce n elements of the bucket
        return width * n + (FP32_BYTES * math.ceil(n / dp) if widen else 0.0)

    gathered = width * largest
    during = flush(bucket) if params > bucket else 0.0
    end = flush(min(params, bucket))
    # (a parameter's piece of the rank's partition: its own partition, every parameter being split)
    piece = math.ceil(largest / dp)
    step = end  # (the step on the host with the optimizer offloaded)
    if optimizer_offload == 0:
        step = max(end, step_bytes(math.ceil(params / dp), piece, param_dtype, grad_dtype))
    return EngineHeld(gathered + during, step, staging_bytes(3, param_dtype, grad_dtype, bucket), forward=gathered)


def _bf16_held(
    params: float, largest_param: float, dp: int, grad_dtype: str | None, forward_after_backward: bool, several: bool
) -> EngineHeld:
    """`BF16_Optimizer`'s (module docstring): the kept bf16 gradients in every backward after the
    first and every forward after a backward, and after the last backward with the reduction's
    or the update's copies."""
    kept = BF16_BYTES * params
    if grad_dtype == "fp32":
        after = max(BF16_BYTES * params, FP32_BYTES * largest_param)
    else:
        after = FP32_BYTES * math.ceil(params / dp)
    return EngineHeld(kept if several else 0.0, kept + after, forward=kept if forward_after_backward else 0.0)
