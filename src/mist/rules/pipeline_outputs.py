"""Whether a pipeline stage keeps the outputs it has sent until their gradients come back, and
the input gradients it has sent until the end of the step.

A stage that is not the last sends each micro-batch's output to the next stage, and its backward
starts from that output with the gradient the next stage returns. What the engine that runs the
plan does with the sent tensor in between differs, and it is memory on every stage but the last:
one b·s·h tensor per micro-batch in flight.

- Mist's runtime (`runtime.p2p.SentOutput`): under 1F1B and ZB-H1 it waits for an output's sends
  at once and keeps only its autograd edge (the data is freed); an interleaved rank waits for its
  sends a few operations later (its sends wrap around from the last rank to the first, so a wait
  at once could close a cycle on a blocking backend: `rules.interleaved_sends`), and holds the
  few it has not waited for yet (`HeldSends`).
- Megatron-LM frees the data of every sent output in both of its schedules
  (`deallocate_output_tensor`, with `deallocate_pipeline_outputs` set by its training loop).
- torchtitan's schedules (`torch.distributed.pipelining`) keep each forward's outputs in the
  stage's `fwd_cache` until its backward, and DeepSpeed's pipeline engine keeps them in its
  `pipe_buffers["outputs"]` until its backward.

Input gradients: Mist's runtime waits for each one when it sends the next (it holds one besides
the one it sends), except on an interleaved rank, which waits for them where
`rules.interleaved_sends` says (a wait at the next send could close a cycle across the
wrap-around), so it holds a few more (`HeldSends`). The frameworks are priced as holding one.

The plan names its engine (`Plan.engine`): "mist" for Mist's runtime, or the framework a target
space tuned it for, whose runtime then sets this rule.
"""

from __future__ import annotations

ENGINES = ("mist", "megatron", "deepspeed", "torchtitan")


def keeps_sent_outputs(engine: str, virtual_stages: int) -> bool:
    """Whether a stage of a plan run by `engine` with `virtual_stages` model chunks per stage keeps
    its in-flight micro-batches' sent outputs (and, in a backward, the current one's)."""
    return _known(engine) in ("deepspeed", "torchtitan")


def holds_sends(engine: str, virtual_stages: int) -> bool:
    """Whether a stage of a plan run by `engine` holds what it sent as an interleaved rank of
    Mist's runtime does (`rules.interleaved_sends.held_sends`), rather than by the rule above and
    the one input gradient it sent last."""
    return _known(engine) == "mist" and virtual_stages > 1


def _known(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    return engine
