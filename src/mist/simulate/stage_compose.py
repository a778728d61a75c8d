"""A stage's time and memory from its components: `compose` turns the layer-count-free terms of
`StageModel.components` (`mist.simulate.stage_records`) into a `StageResult` for any number of
blocks, of them recomputed whole, and micro-batches in flight (all broadcast as arrays over
candidates). Its rules are those of `mist.simulate.stage`'s module docstring: T the steady
micro-batch, the first micro-batch's extra X and the last one's Y (in T when G = 1), the device
memory peaks of forward and backward over the held activations, and host memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mist.rules.engine_held import EngineHeld
from mist.rules.interleaved_sends import HeldSends
from mist.simulate.stage_records import (
    ActivationTerms,
    HeldStates,
    HostTerms,
    StageComponents,
    StageDetail,
    StageResult,
    ZeroBubbleHeld,
)
from mist.simulate.states import Gathered, gathered_weights


def as_floats(x):
    """x as a float64 array (the candidate axis broadcasts)."""
    return np.asarray(x, dtype=np.float64)


def compose(
    comp: StageComponents,
    layers,
    recompute,
    in_flight,
    G: int,
    waiting: ZeroBubbleHeld | None = None,
    chunks: int = 1,
    keeps_outputs: bool = False,
    held: HeldSends | None = None,
    engine_buffers: EngineHeld | None = None,
    beside_embedding: HeldStates | None = None,
    at_blocks: HeldStates | None = None,
    at_head: HeldStates | None = None,
) -> StageResult:
    """Stage time and memory of `layers` blocks with the last `recompute` recomputed whole and
    `in_flight` earlier micro-batches held (`waiting` of them for their W under ZB-H1), from
    `components` (all arrays broadcast against each other); `chunks`: the model chunks an
    interleaved rank runs (for its memory: each keeps its last unit through the warm-up);
    `keeps_outputs`: whether the stage keeps the outputs it sent, `held`: what it holds of its
    sends where it waits for them as an interleaved rank of Mist's runtime does, else None
    (`rules.pipeline_outputs`); `engine_buffers`: what the engine holds beyond Mist's runtime's
    states (`rules.deepspeed_buffers`; None: nothing); `beside_embedding`: what an interleaved
    rank 0 holds where the embedding runs (None: the embedding's peaks are priced over what the
    stage holds at its own); `at_blocks`: what an interleaved rank holds as each operation starts
    (None: its blocks' peaks are priced over `in_flight` and `held`, each the rank's most), and
    `at_head` as each operation of its head's chunk starts (None: `at_blocks`)."""
    layers, n_ck = as_floats(layers), as_floats(recompute)
    n_no = layers - n_ck
    T, X, Y, fwd_part = _times(comp, n_ck, n_no, G)
    mem = _memory(
        comp,
        layers,
        n_ck,
        in_flight,
        waiting,
        chunks,
        keeps_outputs,
        held,
        engine_buffers,
        beside_embedding,
        at_blocks,
        at_head,
    )

    def detail() -> StageDetail:
        lay, ends = comp.layer, comp.ends
        compute = layers * lay.compute + ends.compute + comp.edges.lead
        recompute_s = n_ck * lay.recompute + n_no * lay.recompute_selective
        tp = layers * lay.tp + ends.tp
        p2pb = np.broadcast_to(comp.p2p, T.shape)
        ch = lay.channels
        return StageDetail(
            time_breakdown={
                "compute_s": compute + 0 * T,
                "recompute_s": recompute_s + 0 * T,
                "tp_comm_s": tp + 0 * T,
                "exposed_transfers_s": T - compute - recompute_s - tp - p2pb,
                "p2p_s": p2pb + 0 * T,
            },
            memory_breakdown=mem.breakdown(),
            flops_per_microbatch=layers * lay.flops + ends.flops + 0 * T,
            channels={
                "G2G": layers * ch.g2g,
                "C2G": layers * ch.c2g + n_ck * ch.activations_ckpt + n_no * ch.activations,
                "G2C": layers * ch.g2c + n_ck * ch.activations_ckpt + n_no * ch.activations,
            },
        )

    return StageResult(
        T=T,
        D=X + Y,
        delta_breakdown={"first_microbatch_optimizer_s": X, "last_microbatch_reduction_s": Y},
        fwd_peak=mem.fwd_peak,
        bwd_peak=mem.bwd_peak,
        step_peak=mem.step_peak,
        peak=mem.peak,
        fwd=np.minimum(fwd_part, T),
        first_extra=X,
        last_extra=Y,
        saved_per_microbatch=mem.saved_per_microbatch,
        grads_per_microbatch=layers * comp.layer.grads + comp.ends.grads + 0 * T,
        saved_peak=mem.saved_peak,
        host=mem.host,
        detail_of=detail,
    )


def _times(comp: StageComponents, n_ck, n_no, G: int):
    """(T, X, Y, forward part of T): the steady time of a micro-batch, the first micro-batch's and
    the last one's extras (in T when G = 1: the one micro-batch is both first and last)."""
    ends, edges, p2p = comp.ends, comp.edges, comp.p2p
    stable_f = n_ck * comp.ckpt.fwd + n_no * comp.plain.fwd
    stable_b = n_ck * comp.ckpt.bwd + n_no * comp.plain.bwd
    first_f = n_ck * comp.ckpt.first_fwd + n_no * comp.plain.first_fwd
    last_b = n_ck * comp.ckpt.last_bwd + n_no * comp.plain.last_bwd
    T_stable = stable_f + stable_b + edges.fwd + edges.bwd + ends.stable + p2p
    X = np.maximum(first_f + edges.first + ends.first - (stable_f + edges.fwd), 0.0)
    Y = np.maximum(last_b + edges.last + ends.last - (stable_b + edges.bwd), 0.0)
    fwd_part = stable_f + edges.fwd + ends.fwd + p2p / 2
    if G == 1:
        T = T_stable + X + Y
        X, Y = np.zeros_like(T), np.zeros_like(T)
    else:
        T = T_stable + 0.0 * X
    return T, X, Y, fwd_part


@dataclass(frozen=True)
class _Memory:
    fwd_peak: np.ndarray
    bwd_peak: np.ndarray
    step_peak: np.ndarray
    peak: np.ndarray
    breakdown: Callable[[], dict]  # sums to peak (built when read)
    host: dict
    saved_per_microbatch: np.ndarray
    saved_peak: np.ndarray


def _memory(
    comp: StageComponents,
    layers,
    n_ck,
    in_flight,
    waiting: ZeroBubbleHeld | None = None,
    chunks: int = 1,
    keeps_outputs: bool = False,
    held: HeldSends | None = None,
    engine_buffers: EngineHeld | None = None,
    beside_embedding: HeldStates | None = None,
    at_blocks: HeldStates | None = None,
    at_head: HeldStates | None = None,
) -> _Memory:
    s, a = comp.states, comp.activations
    weights = layers * s.layer_weights + s.end_weights
    grads = layers * s.layer_grads + s.end_grads
    opt = layers * s.layer_optimizer + s.end_optimizer
    ck = n_ck >= 1  # the last block is checkpointed whenever any is
    blocks_saved = (layers - n_ck) * a.saved + n_ck * a.saved_ckpt
    A_last = np.where(ck, a.saved_ckpt, a.saved)
    saved_mb = blocks_saved + a.pre_saved
    # whole unit weights gathered or fetched around their use, where each peak can lie; the
    # stage's last unit is also kept from a forward to its backward while the next micro-batch's
    # forward runs (earlier ones held): an interleaved rank's every chunk's, counted as that many
    # (a bound: one of them may be in the pair already)
    kept_last = chunks * (np.asarray(in_flight) >= 1)
    buf = gathered_weights(layers, s.gathered_block, s.gathered_pre, s.gathered_post, s.keep_pre, kept_last)
    states = weights + grads + opt
    # under ZB-H1 a micro-batch waiting for its W keeps the head's saved activations too (1F1B
    # runs the last stage's backward right after its forward) and its output gradients
    held_post = 0.0 if waiting is None else waiting.micro_batches * a.post_saved
    # (and the input it received, where the graph kept to W holds it: `StageWeightGrad.keeps_input`)
    kept_input = a.x_in if waiting is not None and waiting.keeps_input else 0.0
    held_grads = 0.0 if waiting is None else waiting.micro_batches * (waiting.grad_bytes + kept_input)
    # the input gradient sent last; where the engine keeps sent outputs (`rules.pipeline_outputs`:
    # DeepSpeed, torchtitan) also the earlier micro-batches' outputs, and in a backward the
    # current one's (Mist's 1F1B and ZB-H1 keep a sent output as its autograd edge, its data
    # freed: `runtime.p2p.SentOutput`, as Megatron-LM frees it; the gradient received for it is in
    # the block's backward peak); an interleaved rank of Mist's runtime holds those it has not
    # waited for yet (`held`: `rules.interleaved_sends.HeldSends`)
    if held is None:
        out_fwd, out_bwd, sent_grads = (in_flight, in_flight + 1, 1) if keeps_outputs else (0, 0, 1)
    else:
        out_fwd, out_bwd, sent_grads = held.outputs_forward, held.outputs_backward, max(held.gradients, 1)
    p2p = out_fwd * a.p2p_output + sent_grads * a.p2p_sent
    base_act = in_flight * saved_mb + held_post + held_grads + p2p
    b_pass = None
    if waiting is not None and waiting.b_above is not None:
        b_pass = (waiting.b_above, waiting.b_head, waiting.b_over, waiting.b_head_peak)
    # an interleaved rank 0 runs the embedding beside other chunks and sends than its peaks hold
    bwd_base = base_act + (out_bwd - out_fwd) * a.p2p_output
    pre_shift = (0.0, 0.0)
    if beside_embedding is not None:
        pre_shift = (
            _held_beside(beside_embedding.forward, saved_mb, a) - base_act,
            _held_beside(beside_embedding.backward, saved_mb, a) - bwd_base,
        )

    # and an interleaved rank's blocks and head run beside what it holds as each operation starts:
    # its most chunks in flight and its most sends need not be held at one operation (the running
    # micro-batch's chunk is in each state, as `in_flight` + 1 counts it at the peak)
    def shift(states: HeldStates | None):
        if states is None:
            return (0.0, 0.0)
        return (
            _held_beside(states.forward, saved_mb, a) - (base_act + saved_mb),
            _held_beside(states.backward, saved_mb, a) - (bwd_base + saved_mb),
        )

    block_shift = shift(at_blocks)
    head_shift = shift(at_head) if at_head is not None else block_shift
    fwd_act, bwd_act, buffers_fwd, buffers_bwd = _transient_peaks(
        a, saved_mb, A_last, ck, layers, buf, b_pass, pre_shift, block_shift, head_shift
    )
    # an engine's own buffers (DeepSpeed's gradient staging buffer): at the forward peak, through
    # every backward, or through the whole run
    eb = engine_buffers or EngineHeld(0.0, None)
    bwd_act, buffers_bwd = bwd_act + eb.backward + eb.always, buffers_bwd + eb.backward + eb.always
    fwd_act, buffers_fwd = fwd_act + eb.forward + eb.always, buffers_fwd + eb.forward + eb.always
    if waiting is not None:  # a W starting: no forward or B transient, but more held (ZB-H1)
        gp = a.grads  # (W makes the weight gradients: a unit's are held, flattened, reduced there)
        w_grads = np.maximum(np.maximum(gp.block_in_flight, gp.post_in_flight) + gp.block_held, gp.block_flattened)
        w_act = (
            waiting.w_held * saved_mb
            + waiting.w_waiting * (a.post_saved + waiting.grad_bytes + kept_input)
            + p2p
            + np.where(waiting.w_held > 0, waiting.w_transient + w_grads, 0.0)
        )
        bwd_act = np.maximum(bwd_act, w_act - base_act)
    fwd_peak = states + base_act + fwd_act
    bwd_peak = states + base_act + (out_bwd - out_fwd) * a.p2p_output + bwd_act
    # the optimizer step (`mist.rules.optimizer_step`): no activation is left, nor a gathered or
    # fetched weight (a unit frees those after its backward), only the step's fp32 gradient piece
    # (or what the engine holds then instead: DeepSpeed's or Megatron-LM's gradient copies)
    step_peak = weights + grads + opt + (s.step_piece if eb.step is None else eb.step) + eb.always
    peak = np.maximum(np.maximum(fwd_peak, bwd_peak), step_peak)

    def breakdown() -> dict:
        at_step = step_peak > np.maximum(fwd_peak, bwd_peak)
        buffers = np.where(at_step, eb.always, np.where(fwd_peak >= bwd_peak, buffers_fwd, buffers_bwd)) + 0 * peak
        act = np.maximum(fwd_act - buffers_fwd, bwd_act - buffers_bwd)
        act_held = np.where(at_step, 0.0, base_act + np.minimum(saved_mb, act))
        return {
            "weights_bytes": weights + 0 * peak,
            "grads_bytes": grads + 0 * peak,
            "optimizer_bytes": opt + 0 * peak,
            "buffers_bytes": buffers,
            "activations_bytes": act_held,
            "transient_bytes": peak - states - buffers - act_held,
        }

    return _Memory(
        fwd_peak=fwd_peak,
        bwd_peak=bwd_peak,
        step_peak=step_peak,
        peak=peak,
        breakdown=breakdown,
        host=_host_memory(comp.host, layers, n_ck, in_flight),
        saved_per_microbatch=saved_mb + 0 * peak,
        saved_peak=(in_flight + 1) * saved_mb + a.post_saved + held_post + 0 * peak,
    )


def _held_beside(states, saved_mb, a: ActivationTerms):
    """The most bytes held beside a unit over `states` ((micro-batches, outputs, gradients) of
    `HeldStates`): saved activations and sends. The states count the sends as the engine holds
    them (`rules.interleaved_sends`: Mist's runtime none before its first backward sends one, the
    others the gradient sent last), so no gradient is added to a state that holds none."""
    return np.max(
        np.stack(
            np.broadcast_arrays(*(n * saved_mb + outs * a.p2p_output + grads * a.p2p_sent for n, outs, grads in states))
        ),
        axis=0,
    )


def _transient_peaks(
    a: ActivationTerms,
    saved_mb,
    A_last,
    ck,
    layers,
    buf: Gathered,
    b_pass=None,
    pre_shift=(0.0, 0.0),
    block_shift=(0.0, 0.0),
    head_shift=(0.0, 0.0),
):
    """Activations live at the forward and at the backward peak on top of the held ones: the
    stage's last block's (with the other blocks' saved, its offloaded ones back, and the block
    below's on their way back: `runtime.activations` fetches one block ahead), the head's, the
    embedding's, and the gradient path's at each (`A_last`: the last block's saved bytes).
    Under ZB-H1 on a stage after the first (`b_pass`: what each block above keeps beyond its saved
    activations once its B is done, what the head keeps, and what a block's B holds over its
    plain backward's peak, the graph kept) a block's B runs with the B of those above it done:
    the last block's with the head's, the lowest with every other block's. Each candidate has the whole
    unit weights held where it lies (`buf`: `states.gathered_weights`) on top; returned: the
    forward's and the backward's peak, and the weights held at each. `pre_shift`: what the
    embedding's forward and backward run beside beyond the stage's held activations
    (`HeldStates`); `block_shift` and `head_shift`: what the blocks' and the head's run beside
    beyond them."""
    cur_before_last = saved_mb - A_last
    fwd_cands = [(cur_before_last + a.x_in + np.where(ck, a.fwd_peak_ckpt, a.fwd_peak), buf.block_fwd)]
    fetched = a.fetched * np.where(layers >= 2, 2, 1)
    gp = a.grads
    # with a shared word table the head's weight gradient waits through the blocks' backward for
    # the embedding's, and autograd sums the two into a third tensor before accumulating them
    last_bwd = cur_before_last + np.where(ck, a.bwd_peak_ckpt, a.bwd_peak) + fetched + a.tied_grad
    # the gradient path (`GradPathTerms`): the last block's backward runs while the head's
    # reduction is in flight, a block below it while the block above's is; a block flattens its
    # gradients once its backward is done (its saved activations gone, its input gradient made)
    # (a term that is 0 for every candidate adds no candidate: in place, none of them exists)
    on = lambda x: bool(np.any(x))  # noqa: E731
    blk = buf.block_bwd
    bwd_cands = [(last_bwd + gp.post_in_flight if on(gp.post_in_flight) else last_bwd, blk)]
    head_bwd = a.post_bwd
    if b_pass is not None:
        above, head, over, head_peak = b_pass
        # (a checkpointed block runs its backward whole inside B: nothing of it is split)
        b_last = last_bwd + (0.0 if over is None else np.where(ck, 0.0, over))
        b_cand = (b_last + head + np.maximum((layers - 1) * above, 0.0), blk)
        # where B's own peak is traced (`over`), B runs no plain backward, whose candidate it
        # replaces: the weight gradients it would make are W's
        bwd_cands = [b_cand] if over is not None else [*bwd_cands, b_cand]
        if head_peak is not None:
            head_bwd = head_peak
    if on(gp.block_in_flight):
        bwd_cands.append((np.where(layers >= 2, last_bwd - A_last + gp.block_in_flight, 0.0), blk))
    if on(gp.block_flattened):
        bwd_cands.append((cur_before_last + a.x_in + gp.block_flattened + a.tied_grad, blk))
    sf, sb = block_shift
    fwd_cands = [(act + sf, w) for act, w in fwd_cands]
    bwd_cands = [(act + sb, w) for act, w in bwd_cands]
    if a.post_fwd is not None:
        hf, hb = head_shift
        fwd_cands.append((saved_mb + a.x_in + a.post_fwd + hf, buf.head_fwd))
        bwd_cands.append((saved_mb + head_bwd + hb, buf.head_bwd))
        if on(gp.post_flattened):
            bwd_cands.append((saved_mb + a.x_in + gp.post_flattened + hb, buf.head_bwd))
    if a.pre_peaks is not None:
        pf, pb = pre_shift
        fwd_cands.append((a.pre_peaks[0] + pf + 0 * saved_mb, buf.pre_fwd))
        # (the output gradient a stage receives stays referenced through its whole backward, as
        # `torch.autograd.backward` holds its arguments until it returns: the embedding's too)
        pb = pb + a.p2p_output
        # with a shared word table the head's weight gradient waits through the embedding's
        # backward; once that returns, autograd has freed its input gradient and sums the two
        # table gradients into a third
        pre_bwd = np.maximum(a.pre_peaks[1] + a.tied_grad, 3 * a.tied_grad)
        bwd_cands.append((pre_bwd + gp.block_in_flight + pb + 0 * saved_mb, buf.pre_bwd))
        if on(gp.pre_flattened):
            bwd_cands.append((gp.pre_flattened + pb + 0 * saved_mb, buf.pre_bwd))
    fwd, fwd_w = _with_weights(fwd_cands)
    bwd, bwd_w = _with_weights(bwd_cands)
    return fwd, bwd, fwd_w, bwd_w


def _with_weights(cands) -> tuple[np.ndarray, np.ndarray]:
    """The largest of (activations, whole weights held) candidates counted together, and the
    weights held at it (pairwise maxima broadcast as they go: no stacked copy of every candidate)."""
    best, held = cands[0][0] + cands[0][1], cands[0][1] + 0 * cands[0][0]
    for act, w in cands[1:]:
        total = act + w
        held = np.where(total > best, w, held)
        best = np.maximum(best, total)
    return best, held


def _host_memory(h: HostTerms, layers, n_ck, in_flight) -> dict:
    # (broadcast only as far as their own terms: the tuner reads peak_bytes where the GPU fits)
    host = {
        "state_bytes": layers * h.states,
        "optimizer_grad_bytes": layers * h.optimizer_grads,
        "activation_peak_bytes": (in_flight + 1) * ((layers - n_ck) * h.saved + n_ck * h.saved_ckpt),
    }
    host["peak_bytes"] = host["state_bytes"] + host["optimizer_grad_bytes"] + host["activation_peak_bytes"]
    return host
