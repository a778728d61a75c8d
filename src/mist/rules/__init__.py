"""Rules that the runtime applies and the simulator predicts, each written once.

Every module here is pure (no torch, no state) and works on Python numbers and on numpy arrays
alike, so that the runtime can call a rule for one flat unit or one tensor and the simulator for a
whole array of candidate strategies, with the same arithmetic in the same order:

- `offload_split`: how a flat buffer or a saved tensor splits between the device and the host
  when a fraction of it is offloaded, and which saved tensors are split at all;
- `flat_units`: the padded and shard lengths of a flat unit, and the length of its weight,
  gradient and optimizer buffers at each ZeRO level;
- `grad_accumulation`: when a unit accumulates its micro-batches' gradients in place;
- `optimizer_step`: the pieces an optimizer step reads a unit's gradient in, and the largest fp32
  piece it allocates on the device;
- `pipeline_order`: the non-interleaved 1F1B order of a pipeline stage's forwards and backwards;
- `pipeline_outputs`: whether a stage keeps the outputs it sent, by the engine that runs the plan;
- `init_seeds`: which parameters the seeded initialisation draws from the normal distribution
  and the constants the others get;
- `values`: the scalar-or-array arithmetic (rounding, ceiling, selection) the rules are written in.

This package imports nothing from the rest of `mist`: the runtime and the simulator import it.
"""
