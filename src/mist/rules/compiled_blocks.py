"""What decoder blocks compiled (`TrainingSpec.compile_blocks`, `mist.models.compiled`) run: the
one description the plan check, the search space, the analysis and the runtime follow. Every plan
an eager run can run also runs with compiled blocks; what differs is inside a block.

The compiled region is one tensor- and context-parallel shard's block with its collectives: inside
it the model issues PyTorch's functional collectives, which dynamo traces into the graphs
(`mist.models.collectives`; context parallelism's K/V all-gather and its gradients' reduce-scatter,
`mist.models.context_parallel`, and the rotary tables of the rank's two chunks). (Materialised
attention compiles: the partitioner weighs the s² scores by the example sizes the graphs are traced
at, but its choice was found the same at example lengths from 8 to 2048,
`tests/analysis/test_compiled_block.py`.) Selective recomputation runs as a non-reentrant
checkpointed region inside the block (`mist.models.dropout.checkpoint`), which the partitioner
recomputes in the backward graph.

Dropout. Inductor generates its own dropout: one draw of seeds from the device's default
generator when the compiled forward starts, and each mask from a seed and the element's index. So
the masks of `mist.models.dropout`'s shared stream (the default generator, seeded alike on the
ranks of a tensor-parallel group: the hidden dropouts of what every rank holds whole) are
Inductor's, and are replayed wherever a forward is re-run: whole-block recomputation restores the
default generator before the re-run (the inference graph and the training graph draw the same
seeds), and the partitioner keeps the seeds of a recomputed region. A rank's own stream (the
attention probabilities of its heads, tp > 1; the hidden dropouts of its sequence shard under
sequence parallelism) gives each draw a seed of its own, which Inductor's dropout cannot take:
there the block calls two opaque operators, `mist::rank_seed` (the stream's next seed, a host
scalar) and `mist::seeded_dropout` (`native_dropout` with the generator seeded by it: the masks
eager blocks draw), with the fused kernels around them. The attention core takes its seed before
its checkpointed region, so that the partitioner's re-run of the region in the backward graph
draws with the forward's seed (kept for backward) the forward's mask.

ZB-H1 splits each block's backward into the input gradient (B) and the weight gradients (W): a
compiled block's backward is then compiled as two graphs, B and the operators only the weight
gradients need (`mist.models.weight_split`), which the schedule runs apart and the analysis
prices apart (`compile_mode`). The other schedules compile the backward whole: run back to back,
B and W would hold what B hands to W (the linears' output gradients, a norm's normalised input)
through all of B, and could not fuse across the cut. (Activation offload works: the runtime
splits a compiled block's saved storages whole and gives each saved view back its strides,
`mist.runtime.activations`.)
"""

from __future__ import annotations

from mist.rules.zero_bubble_order import ZB_H1

# how a plan's blocks run (`compile_mode`): eager (False), compiled with the backward whole (True),
# or compiled with the backward as B and W graphs (SPLIT)
SPLIT = "split"


def compile_mode(compile_blocks: bool, schedule: str) -> bool | str:
    """How the blocks of a plan with `training.compile_blocks` and `schedule` run (see above)."""
    if not compile_blocks:
        return False
    return SPLIT if schedule == ZB_H1 else True
