"""The overlap-centric schedule of one pipeline stage: steady time T, one-off extra D, memory.

Each layer of a micro-batch runs on four channels at once — compute (C), GPU↔GPU collectives of
the stage's data-parallel group (G2G), host→device (C2G) and device→host (G2C) copies — and the
interference model turns their standalone times into the layer's time. The traffic of the next
layer (prefetch) and of the previous one (swap-out, gradient reduction) overlaps the current
layer's compute; for identical layers that is the same as each layer's own traffic overlapping
its own compute, plus the first prefetch and the last reduction/swap-out of a phase, which have
no neighbour to hide behind ("edges"). TP collectives sit inside the layer's critical path.

Per micro-batch kind (Mist's traffic table, with the optimizer step made explicit; `weights`,
`grads`, `optimizer`, `activations` are the offloaded fractions of `plan.Offload`):
  forward, every micro-batch: AG(W) if weights are sharded; swap-in W·weights; swap-out
      act·activations
  forward, FIRST micro-batch: + optimizer step of the previous iteration, per layer — GPU Adam
      on the GPU-resident fraction (1 − optimizer) of the optimizer shard (at the iteration's
      end, nothing in flight) and the new working weights as the runtime makes them when the
      forward first needs them (`FlatUnit.update_weights`): the master's host tail in and an
      offloaded store's share out, waited for; the re-gather AG(W) when only optimizer
      states/grads are sharded, in flight during the forward of the block before; CPU Adam on
      the offloaded fraction on the host's worker thread, alongside.
  backward, every micro-batch: AG(W) if weights sharded; RS(Gr) if grads sharded; swap-in
      W·weights, Gr·grads and act·activations; swap-out Gr·grads; gradient accumulation (G > 1).
  backward, LAST micro-batch: + RS(Gr) (ZeRO-1) or AR(Gr) (no sharding) over DP; copy-out of
      the gradients of the CPU-stepped fraction.
Everything is numpy-vectorized over a candidate axis (arrays of strategies).

`StageModel.components` returns the terms that do not depend on the stage's layer count as small
records (`StageComponents`): per-block times of each micro-batch kind (`LayerTimes`, for a plain
block and for one recomputed whole), edges (`Edges`), per-block accounting (`LayerAccounts`), the
embedding's and head's terms (`EndTerms`), p2p, device memory (`StateTerms`, `ActivationTerms`)
and host memory (`HostTerms`), all in `mist.simulate.stage_records`; `compose`
(`mist.simulate.stage_compose`) turns them into a `StageResult`.

Names: G micro-batches per iteration; `layers` a stage's blocks, of which the last `recompute`
are recomputed whole ("ckpt"; the others are "plain"); P, W, Gr a block's parameters, weight bytes
and gradient bytes (per TP shard); ws, gs, os_ the divisors of weights, gradients and optimizer
states (dp where the ZeRO level shards them, else 1); "ends" the embedding (first stage, "pre")
and the head (last stage, "post").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from mist.hardware.interference import overlap_time
from mist.models.checkpointing import selective_name
from mist.rules.flat_units import materializes_weights, regathers_weights, unit_lengths
from mist.rules.grad_accumulation import accumulates_in_place_by_level, flattening_bytes, reduction_in_flight_bytes
from mist.rules.offload_split import (
    device_elements,
    host_elements,
    kept_saved_bytes,
    offloaded_saved_bytes,
    update_crossing,
)
from mist.rules.pipeline_order import earlier_in_flight
from mist.simulate.layer_terms import LayerTerms, analyses, layer_terms
from mist.simulate.precision import MASTER_BYTES, Precision, default_precision
from mist.simulate.stage_compose import as_floats, compose
from mist.simulate.stage_records import (
    ActivationTerms,
    Edges,
    EndTerms,
    GradPathTerms,
    HostTerms,
    LayerAccounts,
    LayerChannels,
    LayerTimes,
    StageComponents,
    StageInput,
    StageResult,
    StateTerms,
)
from mist.simulate.states import unit_host_states, unit_states, unit_step_piece


@dataclass(frozen=True)
class _Batch:
    """The strategies of one `components` call broadcast to one candidate axis, with the block's
    terms (per distinct micro-batch size) and the index that gathers them onto that axis."""

    shape: tuple
    b: np.ndarray
    dp: np.ndarray
    zero: np.ndarray
    offload_weights: np.ndarray
    offload_grads: np.ndarray
    offload_optimizer: np.ndarray
    offload_activations: np.ndarray
    G: int
    blk: LayerTerms
    ix: np.ndarray
    ws: np.ndarray
    gs: np.ndarray
    os_: np.ndarray
    P: float
    W: float
    Gr: float
    in_place: np.ndarray  # gradients accumulate in place (`_in_place_grads`)

    def g(self, a):
        """Gather a per-micro-batch-size term onto the candidate axis."""
        return a[self.ix]


@dataclass(frozen=True)
class _Traffic:
    """Standalone seconds of one block's channels in a stable micro-batch (compute without its
    TP collectives, which are kept apart), and its saved-activation bytes."""

    tp_fwd: np.ndarray
    tp_bwd: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray  # a plain block, with its selective re-runs and gradient handling
    bwd_ckpt: np.ndarray  # a block recomputed whole: plain backward + its re-run
    recompute: np.ndarray
    recompute_selective: np.ndarray
    grad_per_iteration: np.ndarray  # once-per-iteration gradient handling (last micro-batch)
    grad_per_microbatch: np.ndarray  # per-micro-batch gradient handling (in `bwd`)
    g2g_fwd: np.ndarray
    c2g_fwd: np.ndarray
    g2g_bwd: np.ndarray
    c2g_bwd_bytes: np.ndarray  # weights and gradients fetched back in backward (bytes)
    g2c_bwd: np.ndarray
    saved: np.ndarray
    saved_ckpt: np.ndarray


@dataclass(frozen=True)
class _Boundary:
    """A block's extra traffic in the first (optimizer step) and last (reduction) micro-batches."""

    opt_gpu: np.ndarray
    opt_cpu: np.ndarray
    update: np.ndarray  # the new working weights: copies, conversions (and a waited-for re-gather)
    regather: np.ndarray  # a ZeRO-1/2 re-gather in flight during the forward
    final_reduction: np.ndarray
    grads_out: np.ndarray


@dataclass(frozen=True)
class _EndPart:
    """The embedding ("pre", first stage) or the head ("post", last stage) of a stage."""

    part: str
    terms: LayerTerms
    ix: np.ndarray
    params: int  # per TP shard, with the head's copy of a tied word table


class StageModel:
    """Cost model of stages for one (model, GPU, TP degree, attention kernel, sequence).

    `components` computes, for a batch of strategies, everything that does not depend on the
    stage's layer count, recomputed blocks or in-flight micro-batches: per-layer times of each
    micro-batch kind (interference applied), the stage's fixed terms (edges, embedding/head,
    p2p) and per-layer memory. `compose` combines them for any (layers, recompute, in-flight),
    which is plain arithmetic: the tuner composes one set of components over every split.
    `evaluate` = compose(components).
    """

    def __init__(
        self,
        spec,
        profile,
        tp: int,
        flash: bool,
        seq: int,
        precision: Precision | None = None,
        recompute_attention: bool = False,
        recompute_activation: bool = False,
        sequence_parallel: bool = False,
        cp: int = 1,
        compiled: bool | str = False,
        batch_sizes: tuple[int, ...] = (),
    ):
        self.spec, self.profile, self.tp, self.flash, self.seq = spec, profile, tp, flash, seq
        # the micro-batch sizes its stages may be asked for (a tuner's), whose layer terms are
        # computed together, once, when any of them is asked for: one evaluation of each
        # layer's operators at every size, not one per size
        self.batch_sizes = np.unique(np.asarray(batch_sizes, dtype=np.float64))
        # the blocks compiled by `mist.models.compiled`, how the plan runs them
        # (`mist.rules.compiled_blocks.compile_mode`)
        self.compiled = compiled
        # the layers as traced with the TP group's sequence parallelism (tp > 1 only), and as a
        # context-parallel rank of cp (its StageInput's dp then counts the dp × cp replicas)
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        self.cp = cp
        # what the blocks not checkpointed whole re-run in backward: their attention core, their
        # MLP activation (`mist.models.checkpointing`)
        self.selective = selective_name(recompute_attention, recompute_activation)
        self.prec = precision or default_precision(profile, "bf16")
        # On a CPU device the runtime has no side streams: copies, collectives and the CPU Adam
        # step run in the rank's own thread, one after another (and on the same cores)
        self.serial = self.prec.target == "cpu"
        self.interference = profile.interference_model()  # own section or shipped file

    def analyses(self) -> list:
        """The layer analyses (`AnalysisRequest`) this stage model's terms read."""
        return [
            r
            for part in ("pre", "block", "post")
            for r in analyses(
                self.spec,
                part,
                self.tp,
                self.flash,
                self.prec.trace_dtype,
                self.prec.target,
                self.selective if part == "block" else False,
                self.sequence_parallel,
                self.cp,
                self.compiled,
            )
        ]

    # ------------------------------------------------------------------ helpers
    def _terms(self, part, b):
        """(the layer terms of `part` at sizes ub, the index into ub of each of `b`'s sizes)."""
        ub = np.unique(b)
        if self.batch_sizes.size and np.isin(ub, self.batch_sizes).all():
            ub = self.batch_sizes
        lt = layer_terms(
            self.spec,
            self.profile,
            part,
            self.tp,
            self.flash,
            self.seq,
            ub,
            self.prec.trace_dtype,
            self.prec.target,
            self.selective,
            self.sequence_parallel,
            self.cp,
            self.compiled,
        )
        return lt, np.searchsorted(ub, b)

    def _coll(self, op, nbytes, dp, st: StageInput):
        """DP-group collective; the group spans the stage's nodes (TP ranks are node-local)."""
        dp = as_floats(dp)
        nb = np.broadcast_to(as_floats(nbytes), np.broadcast(dp, as_floats(nbytes)).shape)
        dpb = np.broadcast_to(dp, nb.shape)
        out = np.zeros(nb.shape)
        for n in np.unique(dpb):
            if n <= 1:
                continue
            sel = dpb == n
            nodes = int(min(st.nodes, np.ceil(n * self.tp / st.gpus_per_node)))
            out[sel] = self.profile.collective_time(op, nb[sel], int(n), max(nodes, 1), st.cluster_gpus_per_node)
        return out

    def _h2d(self, nbytes):
        return as_floats(nbytes) / self.profile.h2d_bandwidth

    def _d2h(self, nbytes):
        return as_floats(nbytes) / self.profile.d2h_bandwidth

    def _device_step(self, params):
        """The optimizer step of `params` device-resident fp32 elements as the runtime runs it
        (`ShardedAdamW._update`): the gradient copied out to fp32 (an fp32 gradient is read in
        place) and scaled (clip, loss scale), the AdamW kernel (the profile's measured rate of the
        same function), the new master cast into the working weights."""
        prof, pr, n = self.profile, self.prec, as_floats(params)
        to_fp32 = prof.memory_op_time("copy", (pr.grad_bytes + 4) * n, False) if pr.grad_bytes != 4 else 0.0
        return (
            to_fp32
            + prof.memory_op_time("mul", 8 * n, False)
            + prof.adam_gpu_s_per_param * n
            + prof.memory_op_time("copy", (4 + pr.weight_bytes) * n, False)
        )

    def _grad_norm(self, params, offload_grads):
        """The gradient-norm pass of a step (`ShardedAdamW._sq_norm`) over `params` gradient
        elements (a rank's 1/dp share): on a GPU one reading pass over the device part (its
        reductions upcast 16-bit inputs on the fly) and, for an offloaded tail, a conversion to
        fp32 and a reading pass on the host; on a CPU the conversion and the reading pass."""
        prof, gb, n = self.profile, self.prec.grad_bytes, as_floats(params)
        read32 = (gb + 4 + 4) if gb != 4 else 4  # (an fp32 gradient is read as it is)
        if self.serial:
            return prof.memory_op_time("linalg_vector_norm", read32 * n, False)
        og = as_floats(offload_grads)
        return prof.memory_op_time("linalg_vector_norm", gb * n * (1 - og), False) + prof.host_pass_time(
            read32 * n * og
        )

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
        prof, Gr = self.profile, as_floats(grad_bytes)
        Gw = Gr * self.prec.weight_bytes / self.prec.grad_bytes  # the same gradients as .grad
        div = np.where(as_floats(dp) > 1, prof.memory_op_time("div", 2 * Gr, True), 0.0)
        keep = (
            prof.memory_op_time("add", 3 * Gr / gs, True) if G > 1 else prof.memory_op_time("copy", 2 * Gr / os_, True)
        )
        flatten = prof.memory_op_time("copy", 2 * Gr + Gw, True) + div + keep
        per_mb = np.where(in_place, prof.memory_op_time("add", 2 * Gr + Gw, True), flatten)
        per_it = np.where(in_place, prof.memory_op_time("copy", Gr, True) + div, 0.0)
        return per_mb, per_it

    def _overlap(self, c, g2g, c2g, g2c):
        if self.serial:
            return as_floats(c) + as_floats(g2g) + as_floats(c2g) + as_floats(g2c)
        x = np.stack(np.broadcast_arrays(as_floats(c), as_floats(g2g), as_floats(c2g), as_floats(g2c)), axis=-1)
        return overlap_time(x, self.interference)

    def _tied(self, st: StageInput) -> bool:
        """Tied embeddings in a pipeline: the last stage's head holds its own copy of the word
        table (this TP rank's rows), and both copies' gradients are summed once per iteration."""
        return self.spec.tie_embeddings and st.num_stages > 1

    def _table(self) -> int:
        """Elements of this TP rank's rows of the word table."""
        return self.spec.vocab_size // self.tp * self.spec.hidden_size

    @staticmethod
    def _cross(st: StageInput) -> bool:
        """Whether the neighbouring stages sit on other nodes."""
        return st.nodes * st.gpus_per_node >= st.cluster_gpus_per_node

    # ------------------------------------------------------------------ stage
    def evaluate(self, st: StageInput) -> StageResult:
        in_flight = earlier_in_flight(st.index, st.num_stages, st.G) if st.in_flight is None else st.in_flight
        comp = self.components(st)
        return compose(
            comp,
            as_floats(st.layers),
            as_floats(st.recompute),
            in_flight,
            st.G,
            st.waiting,
            st.chunks,
            st.keeps_outputs,
            st.held_sends,
            st.engine_buffers,
            st.beside_embedding,
            st.at_blocks,
            st.at_head,
        )

    def components(self, st: StageInput) -> StageComponents:
        """Everything independent of layers, recomputed blocks and in-flight micro-batches."""
        k = self._batch(st)
        tr, bd = self._block_traffic(k, st)
        parts = self._end_parts(k, st)
        return StageComponents(
            shape=k.shape,
            G=k.G,
            plain=self._layer_times(k, tr, bd, False),
            ckpt=self._layer_times(k, tr, bd, True),
            edges=self._edges(k, tr, bd, st.last),
            layer=self._layer_accounts(k, tr),
            ends=self._end_times(k, st, parts),
            p2p=self._p2p(k, st),
            states=self._state_terms(k, parts),
            activations=self._activation_terms(k, tr, parts, st),
            host=self._host_terms(k),
        )

    def _batch(self, st: StageInput) -> _Batch:
        offloads = (st.offload_weights, st.offload_grads, st.offload_optimizer, st.offload_activations)
        shape = np.broadcast(
            as_floats(st.b), as_floats(st.dp), as_floats(st.zero), *(as_floats(v) for v in offloads)
        ).shape
        bb = np.broadcast_to(as_floats(st.b), shape)
        dp, zero = np.broadcast_to(as_floats(st.dp), shape), np.broadcast_to(as_floats(st.zero), shape)
        weights, grads, optimizer, activations = (np.broadcast_to(as_floats(v), shape) for v in offloads)
        blk, ix = self._terms("block", bb)
        P = float(blk.params)
        return _Batch(
            shape=shape,
            b=bb,
            dp=dp,
            zero=zero,
            offload_weights=weights,
            offload_grads=grads,
            offload_optimizer=optimizer,
            offload_activations=activations,
            G=st.G,
            blk=blk,
            ix=ix,
            ws=np.where(zero >= 3, dp, 1.0),
            gs=np.where(zero >= 2, dp, 1.0),
            os_=np.where(zero >= 1, dp, 1.0),
            P=P,
            W=self.prec.weight_bytes * P,
            Gr=self.prec.grad_bytes * P,
            in_place=_in_place_grads(zero, grads, st.G),
        )

    def _block_traffic(self, k: _Batch, st: StageInput) -> tuple[_Traffic, _Boundary]:
        ag_w = self._coll("all_gather", k.W, k.dp, st)
        rs_g = self._coll("reduce_scatter", k.Gr, k.dp, st)
        ar_g = self._coll("all_reduce", k.Gr, k.dp, st)
        # a ZeRO-1 stage whose engine all-reduces the gradients (`StageInput.all_reduces_grads`)
        zero1_final = ar_g if st.all_reduces_grads else rs_g
        return self._stable_traffic(k, ag_w, rs_g), self._boundary_traffic(k, ag_w, zero1_final, ar_g)

    def _stable_traffic(self, k: _Batch, ag_w, rs_g) -> _Traffic:
        blk, g = k.blk, k.g
        sharded_w, sharded_g = k.zero >= 3, k.zero >= 2
        tpf, tpb = g(blk.tp_comm_fwd), g(blk.tp_comm_bwd)
        grad_mb, grad_it = self._grad_handling(k.Gr, k.dp, k.gs, k.os_, k.in_place, k.G)
        crc = g(blk.recompute)
        return _Traffic(
            tp_fwd=tpf,
            tp_bwd=tpb,
            fwd=g(blk.fwd) - tpf,
            bwd=g(blk.bwd) - tpb + grad_mb,
            bwd_ckpt=g(blk.bwd_plain) - tpb + grad_mb + crc,
            recompute=crc,
            recompute_selective=g(blk.recompute_selective),
            grad_per_iteration=grad_it,
            grad_per_microbatch=grad_mb,
            g2g_fwd=np.where(sharded_w, ag_w, 0.0),
            c2g_fwd=self._h2d(k.W / k.ws * k.offload_weights),
            g2g_bwd=np.where(sharded_w, ag_w, 0.0) + np.where(sharded_g, rs_g, 0.0),
            c2g_bwd_bytes=k.W / k.ws * k.offload_weights + k.Gr / k.gs * k.offload_grads,
            g2c_bwd=self._d2h(k.Gr / k.gs * k.offload_grads),
            saved=g(blk.saved),
            saved_ckpt=g(blk.saved_ckpt),
        )

    def _boundary_traffic(self, k: _Batch, ag_w, zero1_final, ar_g) -> _Boundary:
        pr, host_share = self.prec, k.offload_optimizer
        # the optimizer step of the previous iteration. Its host part: on a CPU device the host is
        # the device, so the same passes at the same rates; on a GPU the host AdamW at its
        # measured rate (on its worker thread, waited for by the unit's first forward), with its
        # gradient copied out as fp32 (converted on the GPU: `runtime.optimizer`)
        p_os = k.P / k.os_
        g_out = pr.grad_bytes if self.serial else MASTER_BYTES
        # (on a GPU the offloaded gradient tail's share is on the host already: the same threads
        # convert it to fp32 and scale it before the step, two passes over host memory)
        host_grads = p_os * host_share * k.offload_grads
        opt_cpu = (
            self._device_step(p_os * host_share)
            if self.serial
            else self.profile.adam_cpu_s_per_param * p_os * host_share
            + self.profile.host_pass_time(host_grads * (pr.grad_bytes + 3 * MASTER_BYTES))
        )
        # the re-gather of ZeRO 1/2's new weights: into the persistent working buffer, in flight
        # while the unit before runs its forward; into an offloaded store, waited for at once
        gathered = regathers_weights(k.zero)
        # last micro-batch: final gradient reduction + grads of the CPU-stepped fraction out
        return _Boundary(
            opt_gpu=self._device_step(p_os * (1 - host_share)) + self._grad_norm(k.P / k.dp, k.offload_grads),
            opt_cpu=opt_cpu,
            update=self._weight_update(k, p_os) + np.where(gathered & (k.offload_weights > 0), ag_w, 0.0),
            regather=np.where(gathered & (k.offload_weights == 0), ag_w, 0.0),
            final_reduction=np.where(k.zero == 1, zero1_final, 0.0) + np.where(k.zero == 0, ar_g, 0.0),
            grads_out=self._d2h(g_out * p_os * host_share * (1 - k.offload_grads)),
        )

    def _weight_update(self, k: _Batch, p_os):
        """Seconds of making a block's new working weights from its stepped master
        (`FlatUnit.update_weights`), but for the re-gather over dp. The master's host tail (the
        host-stepped fraction) comes in as fp32 and is converted on the GPU where the working
        weights are a persistent buffer or a ZeRO-1/2 shard to gather; where they are a store
        split between device and host (ZeRO 3, or weights offloaded at ZeRO 0), the master is
        converted on its own side and written into the store, so what crosses the host link is
        `update_crossing`; a ZeRO-1/2 store of offloaded weights takes the gathered unit, its
        offloaded tail out to the host."""
        pr, prof = self.prec, self.profile
        wb, o, w = pr.weight_bytes, k.offload_optimizer, k.offload_weights
        n = k.P / k.ws  # the store: the unit, or this rank's shard at ZeRO 3
        stored, gathered = materializes_weights(k.zero, w), regathers_weights(k.zero)
        split_store, gathered_store = stored & ~gathered, stored & gathered
        out_n, in_n = update_crossing(n, w, o)
        host_master = host_elements(n, o)
        in32 = wb if self.serial else MASTER_BYTES
        h2d = np.where(split_store, wb * in_n, in32 * host_elements(p_os, o))
        d2h = np.where(split_store, wb * out_n, np.where(gathered_store, wb * host_elements(n, w), 0.0))
        # on the host: the master's tail converted, then its part the store keeps on the host copied
        host = np.where(split_store, (MASTER_BYTES + wb) * host_master + 2 * wb * (host_master - in_n), 0.0)
        # on the device: the store's device part written from the converted master or the gathered unit
        dev = np.where(
            split_store,
            2 * wb * np.minimum(device_elements(n, o), device_elements(n, w)),
            np.where(gathered_store, 2 * wb * device_elements(n, w), 0.0),
        )
        return (
            self._h2d(h2d)
            + self._d2h(d2h)
            + prof.host_pass_time(host)
            + np.where(dev > 0, prof.memory_op_time("copy", dev, False), 0.0)
        )

    def _kept_copy(self, k: _Batch, act):
        """Seconds of the device copy that offloading adds per pass (`runtime.activations`): each
        split tensor's kept head is copied out of its storage in the forward (on the compute
        stream), and into the rebuilt tensor ahead of its tail in the backward (on the copy-back
        stream)."""
        oa = k.offload_activations
        return np.where(oa > 0, self.profile.memory_op_time("copy", 2 * act * (1 - oa), False), 0.0)

    def _layer_fwd(self, k: _Batch, tr: _Traffic, ck: bool, extra_g2g=0.0):
        act = tr.saved_ckpt if ck else tr.saved
        return (
            self._overlap(
                tr.fwd + self._kept_copy(k, act),
                tr.g2g_fwd + extra_g2g,
                tr.c2g_fwd,
                self._d2h(act * k.offload_activations),
            )
            + tr.tp_fwd
        )

    def _layer_bwd(self, k: _Batch, tr: _Traffic, ck: bool, extra_g2g=0.0, extra_g2c=0.0, extra_c=0.0):
        act = tr.saved_ckpt if ck else tr.saved
        comp = (tr.bwd_ckpt if ck else tr.bwd) + extra_c
        return (
            self._overlap(
                comp,
                tr.g2g_bwd + extra_g2g,
                self._h2d(tr.c2g_bwd_bytes + act * k.offload_activations) + self._kept_copy(k, act),
                tr.g2c_bwd + extra_g2c,
            )
            + tr.tp_bwd
        )

    def _layer_times(self, k: _Batch, tr: _Traffic, bd: _Boundary, ck: bool) -> LayerTimes:
        fwd = self._layer_fwd(k, tr, ck)
        # the device step runs at the iteration's end, nothing else in flight; the new working
        # weights when the unit's forward first needs them (`FlatUnit.finish_update`), their copies
        # waited for, a re-gather into the persistent buffer in flight during the unit before
        first = self._layer_fwd(k, tr, ck, bd.regather) + bd.opt_gpu + bd.update
        return LayerTimes(
            fwd=fwd,
            bwd=self._layer_bwd(k, tr, ck),
            first_fwd=first + bd.opt_cpu if self.serial else np.maximum(first, bd.opt_cpu),
            last_bwd=self._layer_bwd(k, tr, ck, bd.final_reduction, bd.grads_out, tr.grad_per_iteration),
        )

    def _edges(self, k: _Batch, tr: _Traffic, bd: _Boundary, last_stage: bool) -> Edges:
        # the first prefetch and the last reduction / swap-out have nothing to hide behind
        # (none when everything is serial: the layer times already hold all the traffic)
        edge = 0.0 if self.serial else 1.0
        # once per micro-batch and phase, what a stream of blocks pays on top of its per-block times
        # (`layer_cost.stream_of`); backward: the larger of the plain and the checkpointed blocks'
        lead_f = k.g(k.blk.lead_fwd)
        lead_b = np.maximum(k.g(k.blk.lead_bwd), k.g(k.blk.lead_bwd_ckpt))
        # offloaded activations (`runtime.activations`): a block's copies back start with its
        # backward, one block ahead, and a block's backward waits for its own, so a backward of n
        # blocks takes n·max(c, x) + min(c, x): the first copy back before the first backward (or
        # the last backward after the last copy back). A forward never waits for its copies out,
        # but on the last stage (or a stage alone) the same micro-batch's backward comes next and
        # its first block's tails are the last copied out, so there the forward's stream counts
        # whole too: the first block's forward before the first copy out (or the last copy out
        # after the last forward). The larger of a plain and a recomputed block's.
        oa = k.offload_activations
        act_f = last_stage * np.maximum(
            *(np.minimum(tr.fwd + self._kept_copy(k, a), self._d2h(a * oa)) for a in (tr.saved, tr.saved_ckpt))
        )
        act_b = np.maximum(
            *(
                np.minimum(c, self._h2d(a * oa) + self._kept_copy(k, a))
                for c, a in ((tr.bwd, tr.saved), (tr.bwd_ckpt, tr.saved_ckpt))
            )
        )
        return Edges(
            fwd=edge * (np.maximum(tr.g2g_fwd, tr.c2g_fwd) + act_f) + lead_f,
            bwd=edge * (np.maximum(tr.g2g_bwd, tr.g2c_bwd) + act_b) + lead_b,
            # (the first unit's re-gather has no forward before it)
            first=edge * (np.maximum(tr.g2g_fwd + bd.regather, tr.c2g_fwd) + act_f) + lead_f,
            last=edge * (np.maximum(tr.g2g_bwd + bd.final_reduction, tr.g2c_bwd + bd.grads_out) + act_b) + lead_b,
            lead=lead_f + lead_b,
        )

    def _layer_accounts(self, k: _Batch, tr: _Traffic) -> LayerAccounts:
        oa = k.offload_activations
        channels = LayerChannels(
            g2g=tr.g2g_fwd + tr.g2g_bwd,
            c2g=tr.c2g_fwd + self._h2d(tr.c2g_bwd_bytes),
            g2c=tr.g2c_bwd,
            activations=self._d2h(tr.saved * oa),
            activations_ckpt=self._d2h(tr.saved_ckpt * oa),
        )
        return LayerAccounts(
            compute=tr.fwd + tr.bwd - tr.recompute_selective,
            recompute=tr.recompute,
            recompute_selective=tr.recompute_selective,
            tp=tr.tp_fwd + tr.tp_bwd,
            flops=k.g(k.blk.flops_fwd) + k.g(k.blk.flops_bwd),
            channels=channels,
            grads=tr.grad_per_microbatch,
        )

    # ------------------------------------------------------------------ embedding / head
    def _end_parts(self, k: _Batch, st: StageInput) -> tuple[_EndPart, ...]:
        """The stage's embedding and head (not offloaded; sharded like the stage)."""
        out = []
        for part in [p for p, on in (("pre", st.first), ("post", st.last)) if on]:
            lt, pix = self._terms(part, k.b)
            tied_copy = self._table() if self._tied(st) and part == "post" and not st.first else 0
            out.append(_EndPart(part, lt, pix, lt.params + tied_copy))
        return tuple(out)

    def _end_times(self, k: _Batch, st: StageInput, parts: tuple[_EndPart, ...]) -> EndTerms:
        acc = {f.name: np.zeros(k.shape) for f in fields(EndTerms)}
        for e in parts:
            self._add_end_times(acc, k, st, e)
        return EndTerms(**acc)

    def _add_end_times(self, acc: dict, k: _Batch, st: StageInput, e: _EndPart) -> None:
        """Add one end's terms into the running sums `acc` (the fields of `EndTerms`)."""
        GRAD_B, Pp, zero = self.prec.grad_bytes, e.params, k.zero
        agp = self._coll("all_gather", self.prec.weight_bytes * Pp, k.dp, st)
        rsp = self._coll("reduce_scatter", GRAD_B * Pp, k.dp, st)
        arp = self._coll("all_reduce", GRAD_B * Pp, k.dp, st)
        if self._tied(st):
            acc["last"] += self.profile.collective_time(
                "all_reduce", GRAD_B * self._table(), 2, 2 if self._cross(st) else 1, st.cluster_gpus_per_node
            )
        # (the embedding / head are never offloaded: in place unless the stage's ZeRO level forbids)
        grad_mb, grad_it = self._grad_handling(GRAD_B * Pp, k.dp, k.gs, k.os_, _in_place_grads(zero, 0.0, k.G), k.G)
        lt, pix = e.terms, e.ix
        f_c, b_c = lt.fwd[pix], lt.bwd[pix] + grad_mb
        acc["last"] += grad_it
        tpp = lt.tp_comm_fwd[pix] + lt.tp_comm_bwd[pix]
        g2g_s = np.where(zero >= 3, 2 * agp, 0.0) + np.where(zero >= 2, rsp, 0.0)
        stable = self._overlap(f_c + b_c - tpp, g2g_s, 0.0, 0.0) + tpp
        acc["stable"] += stable
        acc["grads"] += grad_mb
        acc["compute"] += f_c + b_c - tpp
        acc["tp"] += tpp
        acc["fwd"] += stable * f_c / np.maximum(f_c + b_c, 1e-30)
        acc["first"] += (
            self._device_step(Pp / k.os_)
            + self._grad_norm(Pp / k.dp, 0.0)
            + np.where((zero >= 1) & (zero <= 2), agp, 0.0)
        )
        acc["last"] += np.where(zero == 1, rsp, 0.0) + np.where(zero == 0, arp, 0.0)
        acc["flops"] += lt.flops_fwd[pix] + lt.flops_bwd[pix]

    def _p2p(self, k: _Batch, st: StageInput):
        """Activations / gradients received at the stage boundaries (on the critical path)."""
        p2p = np.zeros(k.shape)
        if st.num_stages > 1:
            n_recv = (0 if st.first else 1) + (0 if st.last else 1)
            p2p = n_recv * self.profile.collective_time(
                "p2p", k.g(k.blk.output), 2, 2 if self._cross(st) else 1, st.cluster_gpus_per_node
            )
        return np.broadcast_to(p2p, k.shape)

    # ------------------------------------------------------------------ memory
    def _state_terms(self, k: _Batch, parts: tuple[_EndPart, ...]) -> StateTerms:
        """Device-resident states in the runtime's flat-buffer layout."""
        pr = self.prec
        layer_w, layer_g, layer_o = unit_states(
            k.P, k.dp, k.zero, k.offload_weights, k.offload_grads, k.offload_optimizer, k.G, pr
        )
        z = np.zeros(k.shape)
        end_w, end_g, end_o = z.copy(), z.copy(), z.copy()
        piece = unit_step_piece(k.P, k.dp, k.zero, k.offload_grads, k.offload_optimizer, k.G, pr)
        # a unit's whole weights where it gathers (ZeRO-3) or fetches (offloaded weights) them
        # around its use: the padded flat buffer (the embedding and the head are never offloaded)
        whole = lambda params: pr.weight_bytes * unit_lengths(params, np.asarray(k.dp, dtype=np.float64), z, k.G)[0]  # noqa: E731
        gathered = {"block": np.where((k.zero >= 3) | (k.offload_weights > 0), whole(k.P), 0.0) + z}
        for e in parts:
            # the embedding / head are not offloaded (their fractions are 0)
            uw, ug, uo = unit_states(e.params, k.dp, k.zero, 0.0, 0.0, 0.0, k.G, pr)
            end_w, end_g, end_o = end_w + uw, end_g + ug, end_o + uo
            piece = np.maximum(piece, unit_step_piece(e.params, k.dp, k.zero, 0.0, 0.0, k.G, pr))
            gathered[e.part] = np.where(k.zero >= 3, whole(e.params), 0.0) + z
        # the runtime keeps a word table shared with the head on the same stage gathered from the
        # embedding's forward to its backward (`Trainer`: one stage holds both)
        names = {e.part for e in parts}
        keep_pre = bool(self.spec.tie_embeddings and names == {"pre", "post"})
        return StateTerms(
            layer_weights=layer_w,
            layer_grads=layer_g,
            layer_optimizer=layer_o,
            end_weights=end_w,
            end_grads=end_g,
            end_optimizer=end_o,
            gathered_block=gathered["block"],
            gathered_pre=gathered.get("pre"),
            gathered_post=gathered.get("post"),
            keep_pre=keep_pre,
            step_piece=piece + 0 * z,
        )

    def _activation_terms(
        self, k: _Batch, tr: _Traffic, parts: tuple[_EndPart, ...], st: StageInput
    ) -> ActivationTerms:
        blk, g, oa = k.blk, k.g, k.offload_activations
        z = np.zeros(k.shape)
        ends = {e.part: e for e in parts}
        pre, post = ends.get("pre"), ends.get("post")
        x_in = g(blk.output)
        # a unit that does not accumulate its gradients in place keeps them until its backward is
        # done (the embedding and the head are never offloaded: their own rule)
        ends_in_place = _in_place_grads(k.zero, 0.0, k.G)
        return ActivationTerms(
            saved=_kept_saved(tr.saved, blk.split_numel, blk.split_elt, blk.split_whole, k.ix, oa),
            saved_ckpt=_kept_saved(
                tr.saved_ckpt, blk.split_numel_ckpt, blk.split_elt_ckpt, blk.split_whole_ckpt, k.ix, oa
            ),
            pre_saved=pre.terms.saved[pre.ix] if pre else z,
            x_in=x_in,
            fwd_peak=g(blk.fwd_peak),
            fwd_peak_ckpt=g(blk.fwd_peak_ckpt),
            bwd_peak=_held_grads_peak(k.in_place, g(blk.bwd_peak), g(blk.bwd_peak_held)),
            bwd_peak_ckpt=_held_grads_peak(k.in_place, g(blk.bwd_peak_ckpt), g(blk.bwd_peak_ckpt_held)),
            fetched=tr.saved * oa,
            post_fwd=post.terms.fwd_peak[post.ix] if post else None,
            post_bwd=_held_grads_peak(ends_in_place, post.terms.bwd_peak[post.ix], post.terms.bwd_peak_held[post.ix])
            if post
            else None,
            pre_peaks=(
                pre.terms.fwd_peak[pre.ix],
                _held_grads_peak(ends_in_place, pre.terms.bwd_peak[pre.ix], pre.terms.bwd_peak_held[pre.ix]),
            )
            if pre
            else None,
            # an interleaved rank (chunks > 1) sends outputs from every chunk but the model's last
            # and input gradients from every chunk but the model's first, so also the last and
            # the first rank
            p2p_output=z if st.last and st.chunks == 1 else x_in,
            p2p_sent=z if st.first and st.chunks == 1 else x_in,
            post_saved=post.terms.saved[post.ix] if post else z,
            tied_grad=self._shared_table_grad(pre, post, z),
            grads=self._grad_path(k, pre, post, ends_in_place),
        )

    def _grad_path(self, k: _Batch, pre, post, ends_in_place) -> GradPathTerms:
        """The gradient path's transient bytes of the stage's units (`GradPathTerms`)."""
        wb, gb, z = self.prec.weight_bytes, self.prec.grad_bytes, np.zeros(k.shape)

        def in_flight(n, in_place) -> np.ndarray:
            return reduction_in_flight_bytes(n, k.dp, k.zero, in_place, gb) + z

        def flattened(n, in_place) -> np.ndarray:
            return flattening_bytes(n, k.dp, in_place, wb, gb) + z

        return GradPathTerms(
            block_held=np.where(k.in_place, 0.0, wb * k.P),
            block_in_flight=in_flight(k.P, k.in_place),
            block_flattened=flattened(k.P, k.in_place),
            post_in_flight=in_flight(post.params, ends_in_place) if post else z,
            post_flattened=flattened(post.params, ends_in_place) if post else z,
            pre_flattened=flattened(pre.params, ends_in_place) if pre else z,
        )

    def _shared_table_grad(self, pre, post, zero):
        """The head's weight gradient when the stage holds the embedding and a head sharing its
        word table (`ActivationTerms.tied_grad`); `zero` otherwise."""
        if not (pre and post and self.spec.tie_embeddings):
            return zero
        assert post.terms.wgrad_out is not None
        return post.terms.wgrad_out[post.ix]

    def _host_terms(self, k: _Batch) -> HostTerms:
        blk, oa = k.blk, k.offload_activations
        host_w, host_g, host_o, host_og = unit_host_states(
            k.P, k.dp, k.zero, k.offload_weights, k.offload_grads, k.offload_optimizer, k.G, self.prec
        )
        return HostTerms(
            states=host_w + host_g + host_o,
            optimizer_grads=host_og,
            saved=_offloaded_saved(blk.split_numel, blk.split_elt, k.ix, oa),
            saved_ckpt=_offloaded_saved(blk.split_numel_ckpt, blk.split_elt_ckpt, k.ix, oa),
            optimizer_offloadable=self.prec.opt_bytes * k.P / k.os_,
        )


def _held_grads_peak(in_place, plain: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """A backward's peak: `plain` where the unit accumulates its gradients in place, else `kept`
    (its parameters' .grad held to the end of its backward)."""
    return np.where(in_place, plain, kept)


def _in_place_grads(zero, offload_grads, G: int):
    """Whether the runtime accumulates gradients in place (see `StageModel._grad_handling`)."""
    return accumulates_in_place_by_level(as_floats(zero), as_floats(offload_grads), G)


def _kept_saved(full, numel, elt, whole, ix, offload_activations):
    """Saved-activation bytes a block keeps on the device when the fraction r =
    `offload_activations` is offloaded (`mist.rules.offload_split`, the rule of the runtime's
    `SavedTensorManager.pack`): each tensor's first n − round(n·r) elements stay; tensors of one
    element stay whole. Without offloading the unique storages are kept (`full`)."""
    # numel, elt: [tensors, *candidates]
    return kept_saved_bytes(numel[:, ix], elt[:, ix], whole[ix], full, as_floats(offload_activations))


def _offloaded_saved(numel, elt, ix, offload_activations):
    """Saved-activation bytes of a block in host memory: the last round(n·r) elements (r =
    `offload_activations`) of every tensor that `_kept_saved` splits."""
    return offloaded_saved_bytes(numel[:, ix], elt[:, ix], as_floats(offload_activations))
