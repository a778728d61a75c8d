"""The records of the stage cost model (`mist.simulate.stage`): a stage's input (`StageInput`),
the terms `StageModel.components` computes once per strategy batch (`StageComponents` and its
parts: per-block times, edges, accounts, the ends' terms, device and host memory) and what
`mist.simulate.stage_compose.compose` builds from them (`StageResult`, with its breakdowns in a
`StageDetail` built when first read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from mist.rules.engine_held import EngineHeld
from mist.rules.interleaved_sends import HeldSends


@dataclass
class StageInput:
    """One stage (or a batch of candidate stages: every array field broadcasts)."""

    first: bool  # holds the embedding
    last: bool  # holds the head and loss
    index: int  # position in the pipeline
    num_stages: int
    layers: np.ndarray
    recompute: np.ndarray  # checkpointed blocks (the last ones of the stage)
    b: np.ndarray
    dp: np.ndarray
    tp: int
    zero: np.ndarray
    offload_weights: np.ndarray  # fractions kept in host memory (`plan.Offload`)
    offload_grads: np.ndarray
    offload_optimizer: np.ndarray
    offload_activations: np.ndarray
    G: int  # micro-batches per iteration
    nodes: int = 1  # nodes spanned by the stage mesh
    gpus_per_node: int = 1  # GPUs per node of the stage mesh
    cluster_gpus_per_node: int = 1
    in_flight: float | None = None  # earlier micro-batches held (default: 1F1B's min(num_stages−1−i, G−1))
    # ZB-H1 (`simulate.zero_bubble`): how many of those wait for their weight-gradient pass W, and
    # the output gradients each keeps for it; they also keep the head's saved activations
    waiting: ZeroBubbleHeld | None = None
    chunks: int = 1  # model chunks of an interleaved rank evaluated whole (its memory)
    # whether the stage keeps its in-flight micro-batches' sent outputs (`rules.pipeline_outputs`)
    keeps_outputs: bool = False
    # whether it holds what it sent as an interleaved rank of Mist's runtime does
    # (`rules.pipeline_outputs.holds_sends`), and how much at its peaks (`interleaved_rank_input`);
    # else the outputs by `keeps_outputs` and the input gradient sent last
    holds_sends: bool = False
    held_sends: HeldSends | None = None
    # an interleaved rank 0: what it holds beside the embedding at each of its first chunk's
    # forwards and backwards (`simulate.interleaved.beside_embedding`); None: the peaks' counts
    beside_embedding: HeldStates | None = None
    # an interleaved rank: what it holds as each of its forwards and backwards starts, the
    # operation's own chunk included (`simulate.interleaved.held_at_blocks`), where its blocks and
    # its head peak; None: the peaks' counts (`in_flight`, `held_sends`), each its most
    at_blocks: HeldStates | None = None
    # the last rank: the same at its last chunk's operations, where the head runs (None: `at_blocks`)
    at_head: HeldStates | None = None
    # what the engine holds beyond Mist's runtime's states (`rules.deepspeed_buffers`; None: nothing)
    engine_buffers: EngineHeld | None = None
    # whether the engine reduces a ZeRO-1 stage's gradients with an all-reduce rather than a
    # reduce-scatter (DeepSpeed's `BF16_Optimizer` on a plan's ZeRO-0 stage, `rules.deepspeed_buffers`)
    all_reduces_grads: bool = False


@dataclass(frozen=True)
class HeldStates:
    """What an interleaved rank holds at some of its operations, one entry per distinct state:
    (micro-batch chunks' saved activations, in the whole-rank micro-batches `StageInput.in_flight`
    counts; sent outputs; sent input gradients) as its forwards and as its backwards run. Beside
    the embedding (rank 0: the other chunks as each forward of its first chunk starts and each
    backward of it ends, `rules.interleaved_sends.held_beside`) or at its blocks (every chunk
    in flight, the operation's own included, as each forward and backward starts,
    `rules.interleaved_sends.held_at_ops`)."""

    forward: tuple[tuple[np.ndarray, int, int], ...]
    backward: tuple[tuple[np.ndarray, int, int], ...]


@dataclass(frozen=True)
class ZeroBubbleHeld:
    """Of a stage's earlier micro-batches held, those waiting for their weight-gradient pass
    under ZB-H1 (`simulate.zero_bubble.zb_held`), and the bytes each keeps beyond its saved
    activations (the output gradients W reads, less the saved tensors it does not); and
    when a W starts (stages after the first), the micro-batches held, of them past their B (the
    one in W included), and the largest weight gradient W makes on top of them."""

    micro_batches: float | np.ndarray
    grad_bytes: float | np.ndarray
    w_held: float | np.ndarray = 0.0
    w_waiting: float | np.ndarray = 0.0
    w_transient: float | np.ndarray = 0.0
    # the current micro-batch's B going down the stage: what each block above the one in its B
    # keeps beyond its saved activations (below 0 where it lets go of those W does not read; None:
    # nothing beyond a plain backward's), what the block in its B holds over its plain backward's
    # peak (None: priced as the plain backward, which it then replaces in no candidate), what the
    # head keeps from its B, and the head's B peak (last stage; None: its plain backward's)
    b_above: float | np.ndarray | None = None
    b_over: float | np.ndarray | None = None
    b_head: float | np.ndarray = 0.0
    b_head_peak: np.ndarray | None = None
    # each micro-batch past its B keeps the stage's input it received (`StageWeightGrad`)
    keeps_input: bool = False


@dataclass(frozen=True)
class StageDetail:
    """What a stage's time and memory are made of (arrays over candidates, like `StageResult`)."""

    time_breakdown: dict  # sums to T
    memory_breakdown: dict  # sums to peak
    flops_per_microbatch: np.ndarray
    channels: dict  # standalone channel volumes of a stable micro-batch (seconds)


@dataclass
class StageResult:
    """Time and memory of one stage (or of a batch of candidate stages: arrays over them)."""

    T: np.ndarray  # steady time of one micro-batch (forward + backward)
    D: np.ndarray  # one-off extra per iteration = first_extra + last_extra
    delta_breakdown: dict  # sums to D
    fwd_peak: np.ndarray
    bwd_peak: np.ndarray
    step_peak: np.ndarray  # the optimizer step's: the states and its largest fp32 gradient piece
    peak: np.ndarray
    fwd: np.ndarray  # stable forward part of T (the rest is backward)
    first_extra: np.ndarray  # the first micro-batch's extra forward time
    last_extra: np.ndarray  # the last micro-batch's extra backward time
    saved_per_microbatch: np.ndarray  # activations one in-flight micro-batch keeps
    # the per-micro-batch gradient handling in T (the flat units' adds or copies of the
    # parameters' gradients): under ZB-H1 part of W, where the parameters' gradients appear
    grads_per_microbatch: np.ndarray
    saved_peak: np.ndarray  # saved activations on the device at most: every in-flight
    #                                 micro-batch's and the current one's, with the head's (last stage)
    host: dict  # host-memory bytes per GPU: state_bytes (offloaded tails),
    #                                 optimizer_grad_bytes (the CPU AdamW's fp32 gradient copies),
    #                                 activation_peak_bytes (offloaded saved activations of every
    #                                 micro-batch in flight), peak_bytes (their sum: an upper bound)
    # the breakdowns, computed when first read: a search reads only the totals above, and
    # building the breakdowns of every candidate took an eighth of its time
    detail_of: Callable[[], StageDetail] = field(repr=False, compare=False)

    @cached_property
    def detail(self) -> StageDetail:
        return self.detail_of()

    @property
    def time_breakdown(self) -> dict:
        return self.detail.time_breakdown

    @property
    def memory_breakdown(self) -> dict:
        return self.detail.memory_breakdown

    @property
    def flops_per_microbatch(self) -> np.ndarray:
        return self.detail.flops_per_microbatch

    @property
    def channels(self) -> dict:
        return self.detail.channels


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one block in each kind of micro-batch, interference applied."""

    fwd: np.ndarray  # forward of a stable micro-batch
    bwd: np.ndarray  # backward of a stable micro-batch
    first_fwd: np.ndarray  # forward of the first micro-batch (with the lazy optimizer step)
    last_bwd: np.ndarray  # backward of the last micro-batch (with the final gradient reduction)


@dataclass(frozen=True)
class Edges:
    """Seconds a stage pays once per micro-batch and phase on top of its blocks' times: the first
    prefetch and the last reduction / swap-out, which have no neighbour to hide behind, and the
    lead of a stream of blocks (`layer_cost.stream_of`)."""

    fwd: np.ndarray
    bwd: np.ndarray
    first: np.ndarray  # forward of the first micro-batch
    last: np.ndarray  # backward of the last micro-batch
    lead: np.ndarray  # the streams' leads alone (forward + backward), for the breakdown


@dataclass(frozen=True)
class LayerChannels:
    """Standalone seconds of one block's channels in a stable micro-batch; the activation
    swap-out / swap-in (each way) of a plain and of a checkpointed block apart."""

    g2g: np.ndarray
    c2g: np.ndarray
    g2c: np.ndarray
    activations: np.ndarray
    activations_ckpt: np.ndarray


@dataclass(frozen=True)
class LayerAccounts:
    """Per block: the terms of the time breakdown, FLOPs and channel volumes."""

    compute: np.ndarray  # forward + backward compute without any re-run
    recompute: np.ndarray  # forward re-run of a block recomputed whole
    recompute_selective: np.ndarray  # the selective re-runs of a plain block
    tp: np.ndarray  # TP collectives (forward + backward)
    flops: np.ndarray
    channels: LayerChannels
    grads: np.ndarray  # the per-micro-batch gradient handling its backward includes


@dataclass(frozen=True)
class EndTerms:
    """Seconds and FLOPs of the embedding (first stage) and the head (last stage) together."""

    stable: np.ndarray  # forward + backward of a stable micro-batch
    first: np.ndarray  # the first micro-batch's optimizer step (and re-gather)
    last: np.ndarray  # the last micro-batch's gradient handling and reduction
    compute: np.ndarray
    tp: np.ndarray
    fwd: np.ndarray  # the forward share of `stable`
    flops: np.ndarray
    grads: np.ndarray  # the per-micro-batch gradient handling `stable` includes


@dataclass(frozen=True)
class StateTerms:
    """Device bytes of the training states in the runtime's flat-buffer layout."""

    layer_weights: np.ndarray  # per block
    layer_grads: np.ndarray
    layer_optimizer: np.ndarray
    end_weights: np.ndarray  # the embedding and the head together
    end_grads: np.ndarray
    end_optimizer: np.ndarray
    # whole unit weights gathered (ZeRO-3) or fetched (offloaded weights) around their use:
    # a block's, the embedding's and the head's (0 where the unit keeps its weights; None where the
    # stage has no such unit), and whether the embedding stays gathered from its forward to its
    # backward (a word table shared with the head on the stage): `states.gathered_weights`
    gathered_block: np.ndarray
    gathered_pre: np.ndarray | None
    gathered_post: np.ndarray | None
    keep_pre: bool
    step_piece: np.ndarray  # the optimizer step's largest fp32 gradient piece over the units


@dataclass(frozen=True)
class GradPathTerms:
    """Device bytes the data-parallel gradient path holds beyond the gradient buffers, by phase
    (`mist.rules.grad_accumulation`): none in a forward, nor in the head's backward."""

    block_held: np.ndarray  # a block's .grad at the end of its backward (not in place)
    block_in_flight: np.ndarray  # a block's reduction, while the unit below runs its backward
    block_flattened: np.ndarray  # a block's .grad and flat gradient when it flattens them
    post_in_flight: np.ndarray  # the head's reduction, while the last block runs its backward
    post_flattened: np.ndarray
    pre_flattened: np.ndarray  # the embedding's, after its backward


@dataclass(frozen=True)
class ActivationTerms:
    """Device bytes of saved activations and transient peaks."""

    saved: np.ndarray  # kept by a plain block (its offloaded part gone)
    saved_ckpt: np.ndarray  # kept by a block recomputed whole
    pre_saved: np.ndarray  # kept by the embedding
    x_in: np.ndarray  # a block's input (= output) bytes
    fwd_peak: np.ndarray  # the transient peaks of a plain block
    fwd_peak_ckpt: np.ndarray  # ... and of a block recomputed whole
    bwd_peak: np.ndarray  # (where the gradients are not accumulated in place: with them held)
    bwd_peak_ckpt: np.ndarray
    fetched: np.ndarray  # a plain block's offloaded activations, back for its backward
    post_fwd: np.ndarray | None  # the head's peaks (last stage)
    post_bwd: np.ndarray | None
    pre_peaks: tuple | None  # the embedding's (forward, backward) peaks (first stage)
    # a stage with a next stage: a micro-batch's output, which an interleaved rank keeps from its
    # forward to the end of its backward (1F1B and ZB-H1 free it once sent); a stage with a
    # previous stage: the input gradient it sent last, kept until it sends the next one
    # (`runtime.p2p.Sends`)
    p2p_output: np.ndarray
    p2p_sent: np.ndarray
    post_saved: np.ndarray  # kept by the head
    grads: GradPathTerms
    # a stage with the embedding and a head that shares its word table: the head's weight
    # gradient, which autograd keeps from the head's backward until the embedding's adds to it
    tied_grad: np.ndarray | float = 0.0


@dataclass(frozen=True)
class HostTerms:
    """Host bytes per block (the embedding and the head keep everything on the device)."""

    states: np.ndarray  # offloaded state tails
    optimizer_grads: np.ndarray  # the CPU AdamW's fp32 gradient copy
    saved: np.ndarray  # offloaded saved activations of a plain block
    saved_ckpt: np.ndarray  # ... and of a block recomputed whole
    optimizer_offloadable: np.ndarray  # optimizer bytes that offloading all of them would move


@dataclass(frozen=True)
class StageComponents:
    """Everything about a batch of strategies that does not depend on the stage's layer count,
    recomputed blocks or in-flight micro-batches (arrays over the candidate axis)."""

    shape: tuple
    G: int
    plain: LayerTimes  # a block that keeps its activations (selective re-runs included)
    ckpt: LayerTimes  # a block recomputed whole
    edges: Edges
    layer: LayerAccounts
    ends: EndTerms
    p2p: np.ndarray  # activations / gradients at the stage boundaries (critical path)
    states: StateTerms
    activations: ActivationTerms
    host: HostTerms
