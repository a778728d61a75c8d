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

from mist.hardware.dp_links import collective_time
from mist.hardware.interference import load_interference, overlap_time
from mist.simulate.layer_terms import layer_terms

WEIGHT_B, GRAD_B, OPT_B = 2, 2, 12


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


def _arr(x):
    return np.asarray(x, dtype=np.float64)


class StageModel:
    """Cost model of stages for one (model, GPU, TP degree, attention kernel, sequence)."""

    def __init__(self, spec, profile, tp: int, flash: bool, seq: int):
        self.spec, self.profile, self.tp, self.flash, self.seq = spec, profile, tp, flash, seq
        self.interference = load_interference(profile.name)

    # ------------------------------------------------------------------ helpers
    def _terms(self, part, b):
        ub, inv = np.unique(b, return_inverse=True)
        lt = layer_terms(self.spec, self.profile, part, self.tp, self.flash, self.seq, ub)
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
            out[sel] = collective_time(self.profile.name, op, nb[sel], int(n), max(nodes, 1),
                                       st.cluster_gpus_per_node)
        return out

    def _h2d(self, nbytes):
        return _arr(nbytes) / self.profile.h2d_bandwidth

    def _d2h(self, nbytes):
        return _arr(nbytes) / self.profile.d2h_bandwidth

    def _overlap(self, c, g2g, c2g, g2c):
        x = np.stack(np.broadcast_arrays(_arr(c), _arr(g2g), _arr(c2g), _arr(g2c)), axis=-1)
        return overlap_time(x, self.interference)

    # ------------------------------------------------------------------ stage
    def evaluate(self, st: StageInput) -> StageResult:
        prof = self.profile
        b = _arr(st.b)
        shape = np.broadcast(b, _arr(st.layers), _arr(st.dp), _arr(st.zero), _arr(st.wo), _arr(st.go),
                             _arr(st.oo), _arr(st.ao), _arr(st.recompute)).shape
        bb = np.broadcast_to(b, shape)
        L, c = np.broadcast_to(_arr(st.layers), shape), np.broadcast_to(_arr(st.recompute), shape)
        dp, zero = np.broadcast_to(_arr(st.dp), shape), np.broadcast_to(_arr(st.zero), shape)
        wo, go, oo, ao = (np.broadcast_to(_arr(v), shape) for v in (st.wo, st.go, st.oo, st.ao))
        G = st.G

        blk, ix = self._terms("block", bb)
        g = lambda a: a[ix]  # noqa: E731  (gather the per-b terms onto the candidate axis)
        ws = np.where(zero >= 3, dp, 1.0)
        gs = np.where(zero >= 2, dp, 1.0)
        os_ = np.where(zero >= 1, dp, 1.0)
        P = float(blk.params)
        W, Gr, O = WEIGHT_B * P, GRAD_B * P, OPT_B * P
        A_full, A_ck = g(blk.saved), g(blk.saved_ckpt)

        ag_w = self._coll("all_gather", W, dp, st)
        rs_g = self._coll("reduce_scatter", Gr, dp, st)
        ar_g = self._coll("all_reduce", Gr, dp, st)
        sharded_w, sharded_g = zero >= 3, zero >= 2

        # ---- per-layer channel times (standalone), stable micro-batches
        tpf, tpb = g(blk.tp_comm_fwd), g(blk.tp_comm_bwd)
        cf = g(blk.fwd) - tpf
        acc = (prof.memory_op_time("add", 3 * Gr / gs, True) if G > 1 else 0.0)
        cb = g(blk.bwd) - tpb + acc
        crc = g(blk.recompute)
        g2g_f = np.where(sharded_w, ag_w, 0.0)
        c2g_f = self._h2d(W / ws * wo)
        g2g_b = np.where(sharded_w, ag_w, 0.0) + np.where(sharded_g, rs_g, 0.0)
        c2g_b_w = W / ws * wo + Gr / gs * go
        g2c_b = self._d2h(Gr / gs * go)

        def layer_fwd(ck, extra_c=0.0, extra_g2g=0.0, extra_c2g=0.0, extra_g2c=0.0):
            act = A_ck if ck else A_full
            return self._overlap(cf + extra_c, g2g_f + extra_g2g, c2g_f + extra_c2g,
                                 self._d2h(act * ao) + extra_g2c)

        def layer_bwd(ck, extra_g2g=0.0, extra_g2c=0.0):
            act = A_ck if ck else A_full
            comp = cb + (crc if ck else 0.0)
            return self._overlap(comp, g2g_b + extra_g2g, self._h2d(c2g_b_w + act * ao), g2c_b + extra_g2c)

        # first micro-batch: lazy optimizer step per layer
        p_os = P / os_
        opt_gpu = prof.adam_gpu_s_per_param * p_os * (1 - oo)
        opt_cpu = prof.adam_cpu_s_per_param * p_os * oo
        upd_in = self._h2d(WEIGHT_B * p_os * oo * (1 - wo))
        regather = np.where((zero >= 1) & (zero <= 2), ag_w, 0.0)
        # last micro-batch: final gradient reduction + grads of the CPU-stepped fraction out
        final_red = np.where(zero == 1, rs_g, 0.0) + np.where(zero == 0, ar_g, 0.0)
        grads_out = self._d2h(GRAD_B * p_os * oo * (1 - go))

        n_ck, n_no = c, L - c
        stable_f = n_ck * layer_fwd(True) + n_no * layer_fwd(False)
        stable_b = n_ck * layer_bwd(True) + n_no * layer_bwd(False)
        first_layer = lambda ck: np.maximum(layer_fwd(ck, opt_gpu, regather, upd_in), opt_cpu)  # noqa: E731
        first_f = n_ck * first_layer(True) + n_no * first_layer(False)
        last_b = n_ck * layer_bwd(True, final_red, grads_out) + n_no * layer_bwd(False, final_red, grads_out)

        # edges: the first prefetch and the last reduction / swap-out have nothing to hide behind
        edge_f = np.maximum(g2g_f, c2g_f)
        edge_b = np.maximum(g2g_b, g2c_b)
        edge_first = np.maximum(np.maximum(g2g_f, regather), c2g_f + upd_in)
        edge_last = np.maximum(g2g_b + final_red, g2c_b + grads_out)

        # ---- pre / post layers (not offloaded; sharded like the stage)
        pp_stable = np.zeros(shape)
        pp_first = np.zeros(shape)
        pp_last = np.zeros(shape)
        pp_compute = np.zeros(shape)
        pp_tp = np.zeros(shape)
        pp_fwd = np.zeros(shape)
        parts = [p for p, on in (("pre", st.first), ("post", st.last)) if on]
        pp_terms = {}
        for part in parts:
            lt, pix = self._terms(part, bb)
            pp_terms[part] = (lt, pix)
            Wp = WEIGHT_B * lt.params
            agp = self._coll("all_gather", Wp, dp, st)
            rsp = self._coll("reduce_scatter", GRAD_B * lt.params, dp, st)
            arp = self._coll("all_reduce", GRAD_B * lt.params, dp, st)
            f_c, b_c = lt.fwd[pix], lt.bwd[pix]
            tpp = lt.tp_comm_fwd[pix] + lt.tp_comm_bwd[pix]
            g2g_s = np.where(sharded_w, 2 * agp, 0.0) + np.where(sharded_g, rsp, 0.0)
            stable = self._overlap(f_c + b_c - tpp, g2g_s, 0.0, 0.0) + tpp
            pp_stable += stable
            pp_compute += f_c + b_c - tpp
            pp_fwd += stable * f_c / np.maximum(f_c + b_c, 1e-30)
            pp_tp += tpp
            p_os_pp = lt.params / os_
            pp_first += np.maximum(0.0, prof.adam_gpu_s_per_param * p_os_pp
                                   + np.where((zero >= 1) & (zero <= 2), agp, 0.0))
            pp_last += np.where(zero == 1, rsp, 0.0) + np.where(zero == 0, arp, 0.0)

        # ---- p2p activations / gradients at the stage boundaries (on the critical path)
        out_bytes = g(blk.output)
        p2p = np.zeros(shape)
        if st.num_stages > 1:
            n_recv = (0 if st.first else 1) + (0 if st.last else 1)
            # neighbouring stages sit on other nodes when a stage takes whole nodes
            cross = st.nodes * st.gpus_per_node >= st.cluster_gpus_per_node
            p2p = n_recv * collective_time(self.profile.name, "p2p", out_bytes, 2, 2 if cross else 1,
                                           st.cluster_gpus_per_node)

        T_stable = stable_f + stable_b + edge_f + edge_b + pp_stable + p2p
        first_mb_f = first_f + edge_first + pp_first
        last_mb_b = last_b + edge_last + pp_last
        # the first/last micro-batch differ from a stable one only in their fwd / bwd halves
        X = np.maximum(first_mb_f - (stable_f + edge_f), 0.0)   # first micro-batch's extra
        Y = np.maximum(last_mb_b - (stable_b + edge_b), 0.0)    # last micro-batch's extra
        if G == 1:  # the one micro-batch is both first and last
            T = T_stable + X + Y
            X, Y = np.zeros(shape), np.zeros(shape)
        else:
            T = T_stable
        D = X + Y

        compute = L * (cf + cb) + pp_compute
        recompute = c * crc
        tp = L * (tpf + tpb) + pp_tp
        exposed = T - compute - recompute - tp - p2p
        breakdown = {"compute_s": compute, "recompute_s": recompute, "tp_comm_s": tp,
                     "exposed_transfers_s": exposed, "p2p_s": p2p}
        delta_breakdown = {"first_microbatch_optimizer_s": X, "last_microbatch_reduction_s": Y}

        mem = self._memory(st, shape, L, c, dp, zero, wo, go, oo, ao, blk, g, pp_terms, P)
        flops = L * (g(blk.flops_fwd) + g(blk.flops_bwd))
        for part, (lt, pix) in pp_terms.items():
            flops = flops + lt.flops_fwd[pix] + lt.flops_bwd[pix]
        fwd_part = stable_f + edge_f + pp_fwd + p2p / 2
        channels = {
            "G2G": L * (g2g_f + g2g_b),
            "C2G": L * (c2g_f + self._h2d(c2g_b_w)) + (n_ck * self._h2d(A_ck * ao) + n_no * self._h2d(A_full * ao)),
            "G2C": L * g2c_b + (n_ck * self._d2h(A_ck * ao) + n_no * self._d2h(A_full * ao)),
        }
        return StageResult(T=T, D=D, time_breakdown=breakdown, delta_breakdown=delta_breakdown,
                           fwd_peak=mem["fwd_peak"], bwd_peak=mem["bwd_peak"], peak=mem["peak"],
                           memory_breakdown=mem["breakdown"], flops_per_microbatch=flops,
                           fwd=np.minimum(fwd_part, T), first_extra=X, last_extra=Y, channels=channels)

    # ------------------------------------------------------------------ memory
    def _memory(self, st, shape, L, c, dp, zero, wo, go, oo, ao, blk, g, pp_terms, P):
        ws = np.where(zero >= 3, dp, 1.0)
        gs = np.where(zero >= 2, dp, 1.0)
        os_ = np.where(zero >= 1, dp, 1.0)
        W, Gr, O = WEIGHT_B * P, GRAD_B * P, OPT_B * P
        weights = L * W / ws * (1 - wo)
        grads = L * Gr / gs * (1 - go)
        opt = L * O / os_ * (1 - oo)
        w_max, g_max = W, Gr
        for part, (lt, pix) in pp_terms.items():
            weights = weights + WEIGHT_B * lt.params / ws
            grads = grads + GRAD_B * lt.params / gs
            opt = opt + OPT_B * lt.params / os_
            w_max, g_max = max(w_max, WEIGHT_B * lt.params), max(g_max, GRAD_B * lt.params)
        buffers = (2 * w_max * ((zero >= 3) | (wo > 0)) + 2 * g_max * ((zero >= 2) | (go > 0))).astype(np.float64)

        A_f, A_c = g(blk.saved) * (1 - ao), g(blk.saved_ckpt) * (1 - ao)
        blocks_saved = (L - c) * A_f + c * A_c
        pre_saved = np.zeros(shape)
        x_in = g(blk.output)
        if "pre" in pp_terms:
            lt, pix = pp_terms["pre"]
            pre_saved = lt.saved[pix]
        last_ck = c >= 1
        A_last = np.where(last_ck, A_c, A_f)
        in_flight = max(0, min(st.num_stages - 1 - st.index, st.G - 1))
        saved_mb = blocks_saved + pre_saved
        p2p_buf = (2 * x_in) if st.num_stages > 1 else np.zeros(shape)
        states = weights + grads + opt + buffers
        base_act = in_flight * saved_mb + p2p_buf
        cur_before_last = pre_saved + blocks_saved - A_last
        fwd_last_peak = g(blk.fwd_peak)
        bwd_last_peak = np.where(last_ck, g(blk.bwd_peak_ckpt), g(blk.bwd_peak))
        ao_fetch = g(blk.saved) * ao  # the next layer's offloaded activations coming back
        fwd_cands = [cur_before_last + x_in + fwd_last_peak]
        bwd_cands = [cur_before_last + bwd_last_peak + ao_fetch]
        if "post" in pp_terms:
            lt, pix = pp_terms["post"]
            fwd_cands.append(pre_saved + blocks_saved + x_in + lt.fwd_peak[pix])
            bwd_cands.append(pre_saved + blocks_saved + lt.bwd_peak[pix])
        if "pre" in pp_terms:
            lt, pix = pp_terms["pre"]
            fwd_cands.append(lt.fwd_peak[pix])
            bwd_cands.append(lt.bwd_peak[pix])
        fwd_act = np.max(np.stack(np.broadcast_arrays(*fwd_cands)), axis=0)
        bwd_act = np.max(np.stack(np.broadcast_arrays(*bwd_cands)), axis=0)
        fwd_peak = states + base_act + fwd_act
        bwd_peak = states + base_act + bwd_act
        peak = np.maximum(fwd_peak, bwd_peak)
        act_held = base_act + np.minimum(saved_mb, np.maximum(fwd_act, bwd_act))
        breakdown = {"weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": opt,
                     "buffers_bytes": buffers, "activations_bytes": act_held,
                     "transient_bytes": peak - states - act_held}
        return {"fwd_peak": fwd_peak, "bwd_peak": bwd_peak, "peak": peak, "breakdown": breakdown}
