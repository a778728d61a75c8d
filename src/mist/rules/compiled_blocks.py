"""Which plans can run their decoder blocks compiled (`TrainingSpec.compile_blocks`,
`mist.models.compiled`): one rule for the plan check, the analysis and the runtime.

The compiled region is one tensor- and context-parallel shard's block with its collectives: inside
it the model issues PyTorch's functional collectives, which dynamo traces into the graphs
(`mist.models.collectives`; context parallelism's K/V all-gather and its gradients' reduce-scatter,
`mist.models.context_parallel`, and the rotary tables of the rank's two chunks). (Materialised
attention compiles: the partitioner weighs the s² scores by the example sizes the graphs are traced
at, but its choice was found the same at example lengths from 8 to 2048,
`tests/analysis/test_compiled_block.py`.) Selective recomputation runs as a non-reentrant
checkpointed region inside the block (`mist.models.dropout.checkpoint`), which the partitioner
recomputes in the backward graph. Inductor draws its own dropout masks, which checkpointing could
not replay. ZB-H1
splits each block's backward into input and weight gradients; a compiled block's backward is one
function. (Activation offload works: the runtime splits a compiled block's saved storages whole and
gives each saved view back its strides, `mist.runtime.activations`.)
"""

from __future__ import annotations


def compiled_block_problem(recompute, dropout: bool) -> str | None:
    """Why a block with these settings cannot run compiled (None: it can). `recompute`: False,
    True (checkpointed whole) or the selective parts' name (all three compile)."""
    if dropout:
        return "compiled blocks run without dropout"
    return None


def compiled_schedule_problem(schedule: str) -> str | None:
    """Why a pipeline schedule cannot run compiled blocks (None: it can)."""
    if schedule == "zb-h1":
        return "the zb-h1 schedule splits each block's backward, and a compiled block's backward is one function"
    return None
