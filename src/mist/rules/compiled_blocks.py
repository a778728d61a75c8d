"""Which plans can run their decoder blocks compiled (`TrainingSpec.compile_blocks`,
`mist.models.compiled`): one rule for the plan check, the search space, the analysis and the
runtime.

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
the masks follow `mist.models.dropout`'s shared stream (the default generator, seeded alike on
the ranks of a tensor-parallel group) and are replayed wherever a forward is re-run: whole-block
recomputation restores the default generator before the re-run (the inference graph and the
training graph draw the same seeds), and the partitioner saves the seeds of a recomputed region.
What Inductor cannot draw is `mist.models.dropout`'s tensor-parallel stream, a per-rank generator
state swapped in around a dropout: the attention probabilities of a rank's own heads (tp > 1),
and the hidden dropouts of a rank's own sequence shard (sequence parallelism). Those plans run
eager.

ZB-H1 splits each block's backward into input and weight gradients; a compiled block's backward is
one function. (Activation offload works: the runtime splits a compiled block's saved storages whole
and gives each saved view back its strides, `mist.runtime.activations`.)
"""

from __future__ import annotations


def compiled_block_problem(attention_dropout: float, hidden_dropout: float, tp: int, sp: bool) -> str | None:
    """Why a block of a model with these dropout probabilities cannot run compiled on a stage of
    `tp` tensor-parallel ranks (`sp`: with sequence parallelism), None if it can. Every
    recomputation (none, whole, selective) compiles."""
    if attention_dropout > 0 and tp > 1:
        return (
            f"compiled blocks drop attention probabilities only with tp = 1, not {tp}: each rank draws "
            "its own heads' masks from a random stream of its own, which Inductor's dropout cannot draw from"
        )
    if hidden_dropout > 0 and sp and tp > 1:
        return (
            "compiled blocks cannot drop hidden activations under sequence parallelism: each rank draws "
            "its sequence shard's masks from a random stream of its own, which Inductor's dropout cannot draw from"
        )
    return None


def compiled_schedule_problem(schedule: str) -> str | None:
    """Why a pipeline schedule cannot run compiled blocks (None: it can)."""
    if schedule == "zb-h1":
        return "the zb-h1 schedule splits each block's backward, and a compiled block's backward is one function"
    return None
