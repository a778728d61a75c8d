"""The ZB-H1 zero-bubble order of one pipeline stage (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, the handcrafted schedule "ZB-H1").

Each micro-batch's backward is split in two: B, the input gradient (what the previous stage waits
for), and W, the weight gradients (nobody waits for them). Deferring W's fills the 1F1B bubble.
Stage i of S runs, over G micro-batches:

- warm-up: the forwards of the first min(S − 1 − i, G) micro-batches, as 1F1B;
- steady state: the forward of the next micro-batch (while there is one), then B of the oldest
  micro-batch; after the k-th B (k = 0, 1, …), W of micro-batch k − i once k ≥ i — stage i keeps
  i W's deferred, so the last stage runs its first S − 1 micro-batches as F B only, exactly in
  the time the upstream stages spend waiting for their first B in 1F1B;
- cool-down: the remaining B's, each followed by a W as above, then the i W's still deferred,
  oldest first (stage i runs i more W's after its last B than stage 0, which runs one).

This is the order of the paper's Figure 3 (top): the first stage runs F B W from its first B,
the last stage delays its first W until its S-th B. The dependencies are 1F1B's: F of micro-batch
g on stage i waits for its F on stage i − 1, B for its B on stage i + 1 (the last stage's for its
own F); W only follows its own B on the same stage (`depends_on`).

Memory: a micro-batch's activations are held from its F until its W (B alone no longer frees
them: W needs the inputs of the weight-gradient GEMMs), and from its B until its W the gradients
of the linears' outputs as well (and, on the last stage, the head's saved activations, which 1F1B
frees right after the forward's B). After any forward, stage i holds at most min(S, G) micro-batches
— the count stage 0 holds under 1F1B, the paper's "same peak memory as 1F1B" — of which up to i
wait for their W (`held_after_forwards`).
"""

from __future__ import annotations

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "W"

# the schedule names a plan may carry (`Plan.schedule`); the first is the default
SCHEDULES = ("1f1b", "zb-h1")
ZB_H1 = "zb-h1"


def deferred_weights(stage: int, stages: int, micro_batches: int) -> int:
    """W's stage `stage` keeps deferred in steady state (and runs at the very end): i, at most G."""
    return min(stage, micro_batches)


def zb_h1(stage: int, stages: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """(kind, micro-batch) of every operation of stage `stage` of `stages`, in order; kind is
    `FORWARD`, `INPUT_GRAD` (B) or `WEIGHT_GRAD` (W)."""
    G = micro_batches
    warm = min(stages - 1 - stage, G)
    ops = [(FORWARD, g) for g in range(warm)]
    done_w = 0
    for k in range(G):
        if warm + k < G:
            ops.append((FORWARD, warm + k))
        ops.append((INPUT_GRAD, k))
        if k >= stage:
            ops.append((WEIGHT_GRAD, done_w))
            done_w += 1
    ops += [(WEIGHT_GRAD, g) for g in range(done_w, G)]
    return tuple(ops)


def depends_on(kind: str, stage: int, m: int, stages: int) -> tuple[str, int, int] | None:
    """The operation (kind, stage, micro-batch) that (kind, m) on `stage` waits for beyond its own
    stage's order: F its F upstream, B its B downstream (the last stage's its own F); None for W
    (it follows its own B, earlier in the same stage's order) and the first stage's F."""
    if kind == FORWARD:
        return (FORWARD, stage - 1, m) if stage > 0 else None
    if kind == INPUT_GRAD:
        return (INPUT_GRAD, stage + 1, m) if stage < stages - 1 else (FORWARD, stage, m)
    return None


def _held_along(stage: int, stages: int, micro_batches: int):
    """Along the stage's order: (kind, micro-batches whose forward has run and whose W has not,
    of them past their B), counted before the operation runs."""
    fwd = bwd = wgt = 0
    for kind, _ in zb_h1(stage, stages, micro_batches):
        yield kind, fwd - wgt, bwd - wgt
        fwd += kind == FORWARD
        bwd += kind == INPUT_GRAD
        wgt += kind not in (FORWARD, INPUT_GRAD)


def held_after_forwards(stage: int, stages: int, micro_batches: int) -> tuple[tuple[int, int], ...]:
    """The distinct (earlier micro-batches held, of them waiting for their W) right after each
    forward of the stage's order (where saved activations peak): "earlier" excludes the one just
    run, as `pipeline_order.earlier_in_flight` counts. Every micro-batch whose W has not run is
    held; the ones past their B hold their output gradients too."""
    seen = {(held, past_b): None for kind, held, past_b in _held_along(stage, stages, micro_batches) if kind == FORWARD}
    return tuple(seen)


def held_at_weight_passes(stage: int, stages: int, micro_batches: int) -> tuple[tuple[int, int], ...]:
    """The distinct (micro-batches held, of them past their B) when each W of the stage's order
    starts, the one whose W it is included in both: every micro-batch whose forward has run and
    whose W has not is held. None on the first stage, whose B runs nothing (its W is its whole
    backward, the peak of a plain backward)."""
    if stage == 0:
        return ()
    held = _held_along(stage, stages, micro_batches)
    return tuple({(h, b): None for kind, h, b in held if kind not in (FORWARD, INPUT_GRAD)})


def zb_h1_problem(
    zero: int,
    offload_weights: float,
    offload_activations: float,
    recompute_layers: int,
    recompute_attention: bool = False,
    recompute_activation: bool = False,
    sequence_parallel: bool = False,
) -> str | None:
    """Why a stage strategy cannot run ZB-H1 (None: it can). The runtime splits the backward by
    keeping the autograd graph from B to W: reentrant checkpointing (whole blocks, the attention
    core) runs its own backward and cannot be split; the MLP-activation re-run is one function
    that computes its input and weight gradients together, so B and W would each run it whole;
    W re-reads the weights (norms) and the saved tensors a second time, so the weights must stay
    materialised (no ZeRO-3, no weight offload) and the saved tensors on the device (no
    activation offload)."""
    if recompute_layers:
        return "recomputes whole blocks, whose reentrant checkpointing cannot split B from W"
    if recompute_attention:
        return "recomputes its attention core, whose reentrant checkpointing cannot split B from W"
    if recompute_activation:
        return "recomputes its MLP activation in one function that computes B and W together"
    if sequence_parallel:
        return (
            "is sequence-parallel, whose linears re-gather their input in one function that computes B and W together"
        )
    if zero >= 3:
        return "uses ZeRO-3, which frees the weights that W still reads"
    if offload_weights:
        return "offloads weights, which W would have to fetch again"
    if offload_activations:
        return "offloads activations, which W would have to fetch again"
    return None


def lets_go_in_b(engine: str) -> bool:
    """Whether a ZB-H1 stage after the first, run by `engine`, lets go in B of the saved tensors
    its W does not read. Mist's runtime does (`runtime.activations`). torch.distributed.pipelining,
    which runs torchtitan's zero-bubble schedules, keeps the autograd graph from the input-gradient
    step to the weight step (`stage_backward_input`: `retain_graph=True`), every saved tensor with
    it."""
    return engine == "mist"
