"""The overlap-centric schedule of one pipeline stage: steady time T, one-off extra D, memory.

Each layer of a micro-batch runs on four channels at once — compute (C), GPU↔GPU collectives of
the stage's data-parallel group (G2G), host→device (C2G) and device→host (G2C) copies — and the
interference model turns their standalone times into the layer's time. The traffic of the next
layer (prefetch) and of the previous one (swap-out, gradient reduction) overlaps the current
layer's compute; for identical layers that is the same as each layer's own traffic overlapping
its own compute, plus the first prefetch and the last reduction/swap-out of a phase, which have
no neighbour to hide behind ("edges"). TP collectives sit inside the layer's critical path.

Per micro-batch kind (Mist's traffic table, with the optimizer step made explicit):
  forward, every micro-batch: AG(W) if weights are sharded; swap-in W·wo; swap-out act·ao
  forward, FIRST micro-batch: + optimizer step of the previous iteration, lazily per layer —
      GPU Adam on the GPU-resident fraction (1 − oo) of the optimizer shard, CPU Adam on the
      offloaded fraction oo (host channel), copy-in of the CPU-updated bf16 weights, and
      re-gather AG(W) of the updated weights when only optimizer states/grads are sharded.
  backward, every micro-batch: AG(W) if weights sharded; RS(Gr) if grads sharded; swap-in
      W·wo, Gr·go and act·ao; swap-out Gr·go; gradient accumulation (G > 1).
  backward, LAST micro-batch: + RS(Gr) (ZeRO-1) or AR(Gr) (no sharding) over DP; copy-out of
      the gradients of the CPU-stepped fraction.
Everything is numpy-vectorized over a candidate axis (arrays of strategies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist.hardware.interference import overlap_time
from mist.models.checkpointing import selective_name
from mist.simulate.layer_terms import layer_terms
from mist.simulate.precision import Precision, default_precision
from mist.simulate.states import unit_host_states, unit_states


@dataclass
class StageInput:
    """One stage (or a batch of candidate stages: every array field broadcasts)."""
    first: bool            # holds the embedding
    last: bool             # holds the head and loss
    index: int             # position in the pipeline
    num_stages: int
    layers: np.ndarray
    recompute: np.ndarray  # checkpointed blocks (the last ones of the stage)
    b: np.ndarray
    dp: np.ndarray
    tp: int
    zero: np.ndarray
    wo: np.ndarray
    go: np.ndarray
    oo: np.ndarray
    ao: np.ndarray
    G: int                 # micro-batches per iteration
    nodes: int = 1         # nodes spanned by the stage mesh
    gpus_per_node: int = 1   # GPUs per node of the stage mesh
    cluster_gpus_per_node: int = 1
    in_flight: int | None = None   # earlier micro-batches held (default: 1F1B's min(S−1−i, G−1))


@dataclass
class StageResult:
    T: np.ndarray              # steady time of one micro-batch (forward + backward)
    D: np.ndarray              # one-off extra per iteration = first_extra + last_extra
    time_breakdown: dict       # sums to T
    delta_breakdown: dict      # sums to D
    fwd_peak: np.ndarray
    bwd_peak: np.ndarray
    peak: np.ndarray
    memory_breakdown: dict     # sums to peak
    flops_per_microbatch: np.ndarray
    fwd: np.ndarray = None         # stable forward part of T (the rest is backward)
    first_extra: np.ndarray = None  # the first micro-batch's extra forward time
    last_extra: np.ndarray = None   # the last micro-batch's extra backward time
    channels: dict = None           # standalone channel volumes of a stable micro-batch (seconds)
    saved_per_microbatch: np.ndarray = None  # activations one in-flight micro-batch keeps
    saved_peak: np.ndarray = None   # saved activations on the device at most: every in-flight
    #                                 micro-batch's and the current one's, with the head's (last stage)
    host: dict = None               # host-memory bytes per GPU: state_bytes (offloaded tails),
    #                                 optimizer_grad_bytes (the CPU AdamW's fp32 gradient copies),
    #                                 activation_peak_bytes (offloaded saved activations of every
    #                                 micro-batch in flight), peak_bytes (their sum: an upper bound)


def _arr(x):
    return np.asarray(x, dtype=np.float64)


class StageModel:
    """Cost model of stages for one (model, GPU, TP degree, attention kernel, sequence).

    `components` computes, for a batch of strategies, everything that does not depend on the
    stage's layer count, recomputed blocks or in-flight micro-batches: per-layer times of each
    micro-batch kind (interference applied), the stage's fixed terms (edges, embedding/head,
    p2p) and per-layer memory. `compose` combines them for any (layers, recompute, in-flight),
    which is plain arithmetic: the tuner composes one set of components over every split.
    `evaluate` = compose(components).
    """

    def __init__(self, spec, profile, tp: int, flash: bool, seq: int, precision: Precision | None = None,
                 attention_recompute: bool = False, activation_recompute: bool = False):
        self.spec, self.profile, self.tp, self.flash, self.seq = spec, profile, tp, flash, seq
        # what the blocks not checkpointed whole re-run in backward: their attention core, their
        # MLP activation (`mist.models.checkpointing`)
        self.selective = selective_name(attention_recompute, activation_recompute)
        self.prec = precision or default_precision(profile, "bf16")
        # On a CPU device the runtime has no side streams: copies, collectives and the CPU Adam
        # step run in the rank's own thread, one after another (and on the same cores)
        self.serial = self.prec.target == "cpu"
        self.interference = profile.interference_model()  # own section or shipped file

    # ------------------------------------------------------------------ helpers
    def _terms(self, part, b):
        ub, inv = np.unique(b, return_inverse=True)
        lt = layer_terms(self.spec, self.profile, part, self.tp, self.flash, self.seq, ub,
                         self.prec.trace_dtype, self.prec.target, self.selective)
        return lt, inv.reshape(np.shape(b))

    def _coll(self, op, nbytes, dp, st: StageInput):
        """DP-group collective; the group spans the stage's nodes (TP ranks are node-local)."""
        dp = _arr(dp)
        nb = np.broadcast_to(_arr(nbytes), np.broadcast(dp, _arr(nbytes)).shape)
        dpb = np.broadcast_to(dp, nb.shape)
        out = np.zeros(nb.shape)
        for n in np.unique(dpb):
            if n <= 1:
                continue
            sel = dpb == n
            nodes = int(min(st.nodes, np.ceil(n * self.tp / st.gpus_per_node)))
            out[sel] = self.profile.collective_time(op, nb[sel], int(n), max(nodes, 1),
                                                 st.cluster_gpus_per_node)
        return out

    def _h2d(self, nbytes):
        return _arr(nbytes) / self.profile.h2d_bandwidth

    def _d2h(self, nbytes):
        return _arr(nbytes) / self.profile.d2h_bandwidth

    def _device_step(self, params):
        """The optimizer step of `params` device-resident fp32 elements as the runtime runs it
        (`ShardedAdamW._update`): the gradient copied out to fp32 (an fp32 gradient is read in
        place) and scaled (clip, loss scale), the AdamW kernel (the profile's measured rate of the
        same function), the new master cast into the working weights."""
        prof, pr, n = self.profile, self.prec, _arr(params)
        to_fp32 = prof.memory_op_time("copy", (pr.grad_bytes + 4) * n, False) if pr.grad_bytes != 4 else 0.0
        return (to_fp32
                + prof.memory_op_time("mul", 8 * n, False)
                + prof.adam_gpu_s_per_param * n
                + prof.memory_op_time("copy", (4 + pr.weight_bytes) * n, False))

    def _grad_handling(self, grad_bytes, dp, gs, os_, in_place, G: int):
        """(per micro-batch, once per iteration) memory-bound work of the runtime's gradient path
        for one unit (`FlatUnit`), on the compute stream.

        In place — the gradient buffer is the whole flat gradient on the device (ZeRO 0, or ZeRO 1
        with G > 1, no gradient offload): each micro-batch's gradient is added into it (autograd
        adds into .grad views of it; an fp32 buffer for 16-bit weights gets each .grad added by a
        hook: the same passes, reading the .grad in the weights' dtype); once per iteration it is
        zeroed and divided by dp.
        Otherwise the unit's gradients are flattened each micro-batch (a fill, and a copy from the
        parameters' .grad, which are in the weights' dtype), divided by dp, and accumulated (G > 1)
        or stored once reduced (G = 1)."""
        prof, Gr = self.profile, _arr(grad_bytes)
        Gw = Gr * self.prec.weight_bytes / self.prec.grad_bytes    # the same gradients as .grad
        div = np.where(_arr(dp) > 1, prof.memory_op_time("div", 2 * Gr, True), 0.0)
        keep = (prof.memory_op_time("add", 3 * Gr / gs, True) if G > 1
                else prof.memory_op_time("copy", 2 * Gr / os_, True))
        flatten = prof.memory_op_time("copy", 2 * Gr + Gw, True) + div + keep
        per_mb = np.where(in_place, prof.memory_op_time("add", 2 * Gr + Gw, True), flatten)
        per_it = np.where(in_place, prof.memory_op_time("copy", Gr, True) + div, 0.0)
        return per_mb, per_it

    def _overlap(self, c, g2g, c2g, g2c):
        if self.serial:
            return _arr(c) + _arr(g2g) + _arr(c2g) + _arr(g2c)
        x = np.stack(np.broadcast_arrays(_arr(c), _arr(g2g), _arr(c2g), _arr(g2c)), axis=-1)
        return overlap_time(x, self.interference)

    # ------------------------------------------------------------------ stage
    def evaluate(self, st: StageInput) -> StageResult:
        in_flight = (max(0, min(st.num_stages - 1 - st.index, st.G - 1)) if st.in_flight is None
                     else st.in_flight)
        comp = self.components(st)
        return compose(comp, _arr(st.layers), _arr(st.recompute), in_flight, st.G)

    def components(self, st: StageInput) -> dict:
        """Everything independent of layers, recomputed blocks and in-flight micro-batches."""
        prof = self.profile
        shape = np.broadcast(_arr(st.b), _arr(st.dp), _arr(st.zero), _arr(st.wo), _arr(st.go),
                             _arr(st.oo), _arr(st.ao)).shape
        bb = np.broadcast_to(_arr(st.b), shape)
        dp, zero = np.broadcast_to(_arr(st.dp), shape), np.broadcast_to(_arr(st.zero), shape)
        wo, go, oo, ao = (np.broadcast_to(_arr(v), shape) for v in (st.wo, st.go, st.oo, st.ao))
        G = st.G

        blk, ix = self._terms("block", bb)
        g = lambda a: a[ix]  # noqa: E731  (gather the per-b terms onto the candidate axis)
        ws = np.where(zero >= 3, dp, 1.0)
        gs = np.where(zero >= 2, dp, 1.0)
        os_ = np.where(zero >= 1, dp, 1.0)
        P = float(blk.params)
        pr = self.prec
        WEIGHT_B, GRAD_B = pr.weight_bytes, pr.grad_bytes
        W, Gr = WEIGHT_B * P, GRAD_B * P
        A_full, A_ck = g(blk.saved), g(blk.saved_ckpt)

        ag_w = self._coll("all_gather", W, dp, st)
        rs_g = self._coll("reduce_scatter", Gr, dp, st)
        ar_g = self._coll("all_reduce", Gr, dp, st)
        sharded_w, sharded_g = zero >= 3, zero >= 2

        # ---- per-layer channel times (standalone), stable micro-batches
        tpf, tpb = g(blk.tp_comm_fwd), g(blk.tp_comm_bwd)
        cf = g(blk.fwd) - tpf
        in_place = _in_place_grads(zero, go, G)
        grad_mb, grad_it = self._grad_handling(Gr, dp, gs, os_, in_place, G)
        cb = g(blk.bwd) - tpb + grad_mb
        crc = g(blk.recompute)
        g2g_f = np.where(sharded_w, ag_w, 0.0)
        c2g_f = self._h2d(W / ws * wo)
        g2g_b = np.where(sharded_w, ag_w, 0.0) + np.where(sharded_g, rs_g, 0.0)
        c2g_b_w = W / ws * wo + Gr / gs * go
        g2c_b = self._d2h(Gr / gs * go)

        def layer_fwd(ck, extra_c=0.0, extra_g2g=0.0, extra_c2g=0.0):
            act = A_ck if ck else A_full
            return self._overlap(cf + extra_c, g2g_f + extra_g2g, c2g_f + extra_c2g, self._d2h(act * ao)) + tpf

        crc_sel = g(blk.recompute_selective)   # in `cb`: the selective re-runs (attention core, activation)
        cb_ck = g(blk.bwd_plain) - tpb + grad_mb + crc   # a block recomputed whole: plain backward + re-run

        def layer_bwd(ck, extra_g2g=0.0, extra_g2c=0.0, extra_c=0.0):
            act = A_ck if ck else A_full
            comp = (cb_ck if ck else cb) + extra_c
            return self._overlap(comp, g2g_b + extra_g2g, self._h2d(c2g_b_w + act * ao), g2c_b + extra_g2c) + tpb

        # first micro-batch: lazy optimizer step per layer
        p_os = P / os_
        opt_gpu = self._device_step(p_os * (1 - oo))
        # the host part: on a CPU device the host is the device, so the same passes at the same rates;
        # on a GPU the host AdamW at its measured rate (its host-memory passes are not profiled)
        opt_cpu = (self._device_step(p_os * oo) if self.serial
                   else prof.adam_cpu_s_per_param * p_os * oo)
        upd_in = self._h2d(WEIGHT_B * p_os * oo * (1 - wo))
        regather = np.where((zero >= 1) & (zero <= 2), ag_w, 0.0)
        # last micro-batch: final gradient reduction + grads of the CPU-stepped fraction out
        final_red = np.where(zero == 1, rs_g, 0.0) + np.where(zero == 0, ar_g, 0.0)
        grads_out = self._d2h(GRAD_B * p_os * oo * (1 - go))

        comp = {"shape": shape, "G": G}
        for ck, tag in ((True, "ck"), (False, "no")):
            comp["f_" + tag] = layer_fwd(ck)
            comp["b_" + tag] = layer_bwd(ck)
            first = layer_fwd(ck, opt_gpu, regather, upd_in)
            comp["first_" + tag] = first + opt_cpu if self.serial else np.maximum(first, opt_cpu)
            comp["last_" + tag] = layer_bwd(ck, final_red, grads_out, grad_it)
        # edges: the first prefetch and the last reduction / swap-out have nothing to hide behind
        # (none when everything is serial: the layer times already hold all the traffic)
        edge = 0.0 if self.serial else 1.0
        comp["edge_f"] = edge * np.maximum(g2g_f, c2g_f)
        comp["edge_b"] = edge * np.maximum(g2g_b, g2c_b)
        comp["edge_first"] = edge * np.maximum(np.maximum(g2g_f, regather), c2g_f + upd_in)
        comp["edge_last"] = edge * np.maximum(g2g_b + final_red, g2c_b + grads_out)
        # once per micro-batch and phase, what a stream of blocks pays on top of its per-block times
        # (`layer_cost.stream_of`); backward: the larger of the plain and the checkpointed blocks'
        lead_f = g(blk.lead_fwd)
        lead_b = np.maximum(g(blk.lead_bwd), g(blk.lead_bwd_ckpt))
        comp["edge_f"], comp["edge_first"] = comp["edge_f"] + lead_f, comp["edge_first"] + lead_f
        comp["edge_b"], comp["edge_last"] = comp["edge_b"] + lead_b, comp["edge_last"] + lead_b
        comp["lead"] = lead_f + lead_b
        comp["layer_compute"] = cf + cb - crc_sel
        comp["layer_recompute"] = crc
        comp["layer_recompute_no"] = crc_sel
        comp["layer_tp"] = tpf + tpb
        comp["layer_flops"] = g(blk.flops_fwd) + g(blk.flops_bwd)
        comp["channels_layer"] = {
            "G2G": g2g_f + g2g_b, "C2G": c2g_f + self._h2d(c2g_b_w),
            "G2C": g2c_b, "act_ck": self._d2h(A_ck * ao), "act_no": self._d2h(A_full * ao)}

        # ---- pre / post layers (not offloaded; sharded like the stage)
        z = np.zeros(shape)
        pp = {k: z.copy() for k in ("stable", "first", "last", "compute", "tp", "fwd", "flops")}
        pp_terms, pp_params = {}, {}
        # tied embeddings in a pipeline: the last stage's head holds its own copy of the word table
        # (this TP rank's rows), and both copies' gradients are summed once per iteration
        tied = self.spec.tie_embeddings and st.num_stages > 1
        table = self.spec.vocab_size // self.tp * self.spec.hidden_size
        cross = st.nodes * st.gpus_per_node >= st.cluster_gpus_per_node   # stages on other nodes
        for part in [p for p, on in (("pre", st.first), ("post", st.last)) if on]:
            lt, pix = self._terms(part, bb)
            pp_terms[part] = (lt, pix)
            Pp = pp_params[part] = lt.params + (table if tied and part == "post" and not st.first else 0)
            Wp = WEIGHT_B * Pp
            agp = self._coll("all_gather", Wp, dp, st)
            rsp = self._coll("reduce_scatter", GRAD_B * Pp, dp, st)
            arp = self._coll("all_reduce", GRAD_B * Pp, dp, st)
            if tied:
                pp["last"] += self.profile.collective_time("all_reduce", GRAD_B * table, 2, 2 if cross else 1,
                                                           st.cluster_gpus_per_node)
            # (the embedding / head are never offloaded: in place unless the stage's ZeRO level forbids)
            pp_grad_mb, pp_grad_it = self._grad_handling(GRAD_B * Pp, dp, gs, os_, _in_place_grads(zero, 0.0, G), G)
            f_c, b_c = lt.fwd[pix], lt.bwd[pix] + pp_grad_mb
            pp["last"] += pp_grad_it
            tpp = lt.tp_comm_fwd[pix] + lt.tp_comm_bwd[pix]
            g2g_s = np.where(sharded_w, 2 * agp, 0.0) + np.where(sharded_g, rsp, 0.0)
            stable = self._overlap(f_c + b_c - tpp, g2g_s, 0.0, 0.0) + tpp
            pp["stable"] += stable
            pp["compute"] += f_c + b_c - tpp
            pp["tp"] += tpp
            pp["fwd"] += stable * f_c / np.maximum(f_c + b_c, 1e-30)
            pp["first"] += (self._device_step(Pp / os_)
                            + np.where((zero >= 1) & (zero <= 2), agp, 0.0))
            pp["last"] += np.where(zero == 1, rsp, 0.0) + np.where(zero == 0, arp, 0.0)
            pp["flops"] += lt.flops_fwd[pix] + lt.flops_bwd[pix]
        comp["pp"] = pp

        # ---- p2p activations / gradients at the stage boundaries (on the critical path)
        p2p = z.copy()
        if st.num_stages > 1:
            n_recv = (0 if st.first else 1) + (0 if st.last else 1)
            p2p = n_recv * self.profile.collective_time("p2p", g(blk.output), 2, 2 if cross else 1,
                                                        st.cluster_gpus_per_node)
        comp["p2p"] = np.broadcast_to(p2p, shape)

        # ---- memory components (device-resident states in the runtime's flat-buffer layout)
        layer_w, layer_g, layer_o = unit_states(P, dp, zero, wo, go, oo, G, pr)
        host_w, host_g, host_o, host_og = unit_host_states(P, dp, zero, wo, go, oo, G, pr)
        pp_w, pp_g, pp_o = z.copy(), z.copy(), z.copy()
        w_max, g_max = W, Gr
        for part, Pp in pp_params.items():
            # the embedding / head are not offloaded (their fractions are 0)
            uw, ug, uo = unit_states(Pp, dp, zero, 0.0, 0.0, 0.0, G, pr)
            pp_w, pp_g, pp_o = pp_w + uw, pp_g + ug, pp_o + uo
            w_max, g_max = max(w_max, WEIGHT_B * Pp), max(g_max, GRAD_B * Pp)
        x_in = g(blk.output)
        pre_saved = pp_terms["pre"][0].saved[pp_terms["pre"][1]] if "pre" in pp_terms else z
        post_fwd = post_bwd = None
        post_saved = z
        if "post" in pp_terms:
            lt, pix = pp_terms["post"]
            post_fwd, post_bwd, post_saved = lt.fwd_peak[pix], lt.bwd_peak[pix], lt.saved[pix]
        pre_peaks = None
        if "pre" in pp_terms:
            lt, pix = pp_terms["pre"]
            pre_peaks = (lt.fwd_peak[pix], lt.bwd_peak[pix])
        comp["mem"] = {
            "layer_w": layer_w, "layer_g": layer_g, "layer_o": layer_o,
            "pp_w": pp_w, "pp_g": pp_g, "pp_o": pp_o,
            # double buffers of gathered / fetched weights; unless gradients accumulate in place,
            # the runtime flattens each unit's into one transient buffer (plus a second when they
            # are sharded or offloaded)
            "buffers": (2 * w_max * ((zero >= 3) | (wo > 0))
                        + g_max * ((~in_place).astype(np.float64)
                                   + ((zero >= 2) | (go > 0)).astype(np.float64))).astype(np.float64),
            "A_f": _kept_saved(A_full, blk.split_numel, blk.split_elt, blk.split_whole, ix, ao),
            "A_c": _kept_saved(A_ck, blk.split_numel_ckpt, blk.split_elt_ckpt, blk.split_whole_ckpt, ix, ao),
            "pre_saved": pre_saved, "x_in": x_in,
            "fwd_last_no": g(blk.fwd_peak), "fwd_last_ck": g(blk.fwd_peak_ckpt),
            "bwd_last_no": g(blk.bwd_peak), "bwd_last_ck": g(blk.bwd_peak_ckpt),
            "ao_fetch": A_full * ao, "post_fwd": post_fwd, "post_bwd": post_bwd, "pre_peaks": pre_peaks,
            "p2p_buf": (2 * x_in) if st.num_stages > 1 else z,
            "post_saved": post_saved,
            # host memory (the embedding / head keep everything on the device): offloaded state
            # tails per block, the CPU AdamW's fp32 gradient copy per block, offloaded activations
            "host_states": host_w + host_g + host_o, "host_opt_grads": host_og,
            "H_f": _offloaded_saved(blk.split_numel, blk.split_elt, ix, ao),
            "H_c": _offloaded_saved(blk.split_numel_ckpt, blk.split_elt_ckpt, ix, ao),
            "opt_offloadable": pr.opt_bytes * P / os_,   # optimizer bytes per layer that oo = 1 would move to the host
        }
        return comp


def _in_place_grads(zero, go, G: int):
    """Whether the runtime accumulates gradients in place (see `StageModel._grad_handling`)."""
    zero, go = _arr(zero), _arr(go)
    return (go == 0) & ((zero == 0) | ((zero == 1) & (G > 1)))


def _kept_saved(full, numel, elt, whole, ix, ao):
    """Saved-activation bytes a block keeps on the device when the fraction `ao` is offloaded.
    The runtime splits every saved tensor on its own (`SavedTensorManager.pack`): its first
    n − round(n·ao) elements stay; tensors of one element stay whole. Without offloading the
    unique storages are kept (`full`)."""
    ao = _arr(ao)
    n, e = numel[:, ix], elt[:, ix]          # [tensors, *candidates]
    kept = (e * (n - np.round(n * ao))).sum(axis=0) + whole[ix]
    return np.where(ao > 0, kept, full)


def _offloaded_saved(numel, elt, ix, ao):
    """Saved-activation bytes of a block in host memory: the last round(n·ao) elements of every
    tensor that `_kept_saved` splits."""
    ao = _arr(ao)
    n, e = numel[:, ix], elt[:, ix]
    return np.where(ao > 0, (e * np.round(n * ao)).sum(axis=0), 0.0)


def compose(comp: dict, L, c, in_flight, G: int) -> StageResult:
    """Stage time and memory of `L` layers with the last `c` recomputed and `in_flight` earlier
    micro-batches held, from `components` (all arrays broadcast against each other)."""
    L, c = _arr(L), _arr(c)
    n_ck, n_no = c, L - c
    pp = comp["pp"]
    stable_f = n_ck * comp["f_ck"] + n_no * comp["f_no"]
    stable_b = n_ck * comp["b_ck"] + n_no * comp["b_no"]
    first_f = n_ck * comp["first_ck"] + n_no * comp["first_no"]
    last_b = n_ck * comp["last_ck"] + n_no * comp["last_no"]
    p2p = comp["p2p"]
    T_stable = stable_f + stable_b + comp["edge_f"] + comp["edge_b"] + pp["stable"] + p2p
    X = np.maximum(first_f + comp["edge_first"] + pp["first"] - (stable_f + comp["edge_f"]), 0.0)
    Y = np.maximum(last_b + comp["edge_last"] + pp["last"] - (stable_b + comp["edge_b"]), 0.0)
    fwd_part = stable_f + comp["edge_f"] + pp["fwd"] + p2p / 2
    if G == 1:  # the one micro-batch is both first and last
        T = T_stable + X + Y
        X, Y = np.zeros_like(T), np.zeros_like(T)
    else:
        T = T_stable + 0.0 * X
    D = X + Y
    compute = L * comp["layer_compute"] + pp["compute"] + comp["lead"]
    recompute = c * comp["layer_recompute"] + n_no * comp["layer_recompute_no"]
    tp = L * comp["layer_tp"] + pp["tp"]
    p2pb = np.broadcast_to(p2p, T.shape)
    breakdown = {"compute_s": compute + 0 * T, "recompute_s": recompute + 0 * T, "tp_comm_s": tp + 0 * T,
                 "exposed_transfers_s": T - compute - recompute - tp - p2pb, "p2p_s": p2pb + 0 * T}
    ch = comp["channels_layer"]
    channels = {"G2G": L * ch["G2G"], "C2G": L * ch["C2G"] + n_ck * ch["act_ck"] + n_no * ch["act_no"],
                "G2C": L * ch["G2C"] + n_ck * ch["act_ck"] + n_no * ch["act_no"]}
    mem = _memory(comp["mem"], L, c, in_flight)
    flops = L * comp["layer_flops"] + pp["flops"]
    return StageResult(T=T, D=D, time_breakdown=breakdown,
                       delta_breakdown={"first_microbatch_optimizer_s": X, "last_microbatch_reduction_s": Y},
                       fwd_peak=mem["fwd_peak"], bwd_peak=mem["bwd_peak"], peak=mem["peak"],
                       memory_breakdown=mem["breakdown"], flops_per_microbatch=flops + 0 * T,
                       fwd=np.minimum(fwd_part, T), first_extra=X, last_extra=Y, channels=channels,
                       saved_per_microbatch=mem["saved_per_microbatch"], saved_peak=mem["saved_peak"],
                       host=mem["host"])


def _memory(m: dict, L, c, in_flight) -> dict:
    weights = L * m["layer_w"] + m["pp_w"]
    grads = L * m["layer_g"] + m["pp_g"]
    opt = L * m["layer_o"] + m["pp_o"]
    buffers = m["buffers"]
    ck = c >= 1  # the last block is checkpointed whenever any is
    blocks_saved = (L - c) * m["A_f"] + c * m["A_c"]
    A_last = np.where(ck, m["A_c"], m["A_f"])
    saved_mb = blocks_saved + m["pre_saved"]
    states = weights + grads + opt + buffers
    base_act = in_flight * saved_mb + m["p2p_buf"]
    cur_before_last = saved_mb - A_last
    fwd_cands = [cur_before_last + m["x_in"] + np.where(ck, m["fwd_last_ck"], m["fwd_last_no"])]
    bwd_cands = [cur_before_last + np.where(ck, m["bwd_last_ck"], m["bwd_last_no"]) + m["ao_fetch"]]
    if m["post_fwd"] is not None:
        fwd_cands.append(saved_mb + m["x_in"] + m["post_fwd"])
        bwd_cands.append(saved_mb + m["post_bwd"])
    if m["pre_peaks"] is not None:
        fwd_cands.append(m["pre_peaks"][0] + 0 * saved_mb)
        bwd_cands.append(m["pre_peaks"][1] + 0 * saved_mb)
    fwd_act = np.max(np.stack(np.broadcast_arrays(*fwd_cands)), axis=0)
    bwd_act = np.max(np.stack(np.broadcast_arrays(*bwd_cands)), axis=0)
    fwd_peak = states + base_act + fwd_act
    bwd_peak = states + base_act + bwd_act
    peak = np.maximum(fwd_peak, bwd_peak)
    act_held = base_act + np.minimum(saved_mb, np.maximum(fwd_act, bwd_act))
    breakdown = {"weights_bytes": weights + 0 * peak, "grads_bytes": grads + 0 * peak,
                 "optimizer_bytes": opt + 0 * peak, "buffers_bytes": buffers + 0 * peak,
                 "activations_bytes": act_held, "transient_bytes": peak - states - act_held}
    # (broadcast only as far as their own terms: the tuner reads peak_bytes where the GPU fits)
    host = {"state_bytes": L * m["host_states"], "optimizer_grad_bytes": L * m["host_opt_grads"],
            "activation_peak_bytes": (in_flight + 1) * ((L - c) * m["H_f"] + c * m["H_c"])}
    host["peak_bytes"] = host["state_bytes"] + host["optimizer_grad_bytes"] + host["activation_peak_bytes"]
    return {"fwd_peak": fwd_peak, "bwd_peak": bwd_peak, "peak": peak, "breakdown": breakdown, "host": host,
            "saved_per_microbatch": saved_mb + 0 * peak,
            "saved_peak": (in_flight + 1) * saved_mb + m["post_saved"] + 0 * peak}
