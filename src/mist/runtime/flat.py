"""Flat parameters with ZeRO 0–3 over the data-parallel group and fractional weight/grad offload.

Written here rather than with FSDP2 `fully_shard`: FSDP2 cannot express *fractional* offloading
(a ratio of each state in host memory, the rest on the device), nor a different ZeRO level for
weights, gradients and optimizer states than its own, so each unit (the embedding, every decoder
block, the head) is one `FlatUnit`:

- its parameters (this rank's TP shards) are views of one flat working buffer ``full`` of Np
  elements (N padded to dp shards of ``shard_len``), in the working dtype (bf16/fp16/fp32);
- the fp32 master weights and Adam moments cover the optimizer range: this rank's 1/dp shard
  [dp_rank·shard_len, (dp_rank+1)·shard_len) for ZeRO ≥ 1, all Np for ZeRO 0; each is a
  `SplitBuffer` whose last ``optimizer`` fraction lives on the host (its Adam step runs on the
  CPU, see `optimizer.py`);
- weights: for ZeRO 0–2 without weight offload ``full`` is persistent. Otherwise the persistent copy
  is a `SplitBuffer` (this rank's shard for ZeRO 3, the whole buffer for ZeRO 0–2 with its last
  ``weights`` fraction on the host) and ``full`` is materialised before use (the host tail copied
  in, all-gathered over dp for ZeRO 3) and freed after (its storage is resized to 0; the parameter
  views, including those autograd saved, become valid again when it is re-materialised);
- gradients: when every parameter's gradient of a micro-batch has been accumulated (post-accumulate
  hooks), they are flattened and, for ZeRO ≥ 2, reduce-scattered over dp each micro-batch into a
  shard accumulator; for ZeRO 0/1 accumulated locally over the micro-batches and all-reduced
  (ZeRO 0) or reduce-scattered (ZeRO 1) once at the last one. Gradients are averaged over dp
  (divided by dp before the SUM). The accumulator's last ``grads`` fraction lives on the host and is
  accumulated there. The gradient buffers and collectives use the gradient dtype: the working dtype,
  or fp32 with 16-bit weights (each micro-batch's 16-bit gradients are added into the fp32 buffer,
  and the dp reduction runs on fp32, as Megatron-LM does for bf16).

The buffers' lengths at each ZeRO level, their device/host split and when gradients accumulate in
place are the rules of `mist.rules.flat_units`, `mist.rules.offload_split` and
`mist.rules.grad_accumulation`, which the simulator's memory model applies as well.

On CUDA a unit's host→device copies (and its ZeRO-3 all-gather) for the *next* unit run on a side
copy stream, ordered by an event the compute stream waits on; everything else is synchronous
(kept simple on purpose). The CPU tests do not reach the CUDA streams; `benchmarks/gpu/gpu_loop.py`
runs this path on one GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mist.models.collectives import issuing, settled
from mist.rules import flat_units
from mist.rules.grad_accumulation import accumulates_in_place
from mist.runtime.buffers import SplitBuffer
from mist.runtime.memory import MemoryAccount
from mist.runtime.param_role import ParamRole

# torch 2.13 renamed the flat collectives (the old names warn); older releases only have those
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class ParamInfo:
    name: str  # full-model name
    shape: torch.Size
    offset: int
    numel: int
    decay: bool  # AdamW weight decay applies (matrices, not norms/biases)
    norm_skip: tuple | None  # local flat range [a, b) that this rank does not count in the norm
    kv_range: tuple | None  # local flat range holding KV-head copies (grads summed over the KV group)


def _shift(rng, offset):
    return None if rng is None else (offset + rng[0], offset + rng[1])


def intersect(ranges, lo, hi):
    """Pieces of `ranges` (absolute) inside [lo, hi), shifted to start at lo."""
    out = []
    for a, b in ranges:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a - lo, b - lo))
    return out


def complement(ranges, lo, hi):
    """The parts of [lo, hi) outside `ranges` (absolute, any order, may overlap)."""
    out, cur = [], lo
    for a, b in sorted(ranges):
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out


class Comms:
    """The data-parallel and KV groups a stage's units talk to (None: a group of one rank), and
    the one data-parallel gradient reduction of theirs in flight.

    A unit's reduction is issued asynchronously when its gradients are complete (`issue`), so
    that on a GPU it runs on the collective stream while the backward goes on to the units below
    it, as the simulator prices it (a block's reduction overlaps the next block's backward; the
    last one has nothing to hide behind). What consumes its result runs when it is waited for
    (`settle`): when the next unit's gradients are complete, before that unit's are flattened, so
    that at most one flat gradient is held for a reduction at a time, and at the end of every
    micro-batch's backward."""

    def __init__(self, dp: int, dp_rank: int, dp_group, kv_group=None, kv_size: int = 1):
        self.dp, self.dp_rank, self.dp_group = dp, dp_rank, dp_group
        self.kv_group, self.kv_size = kv_group, kv_size
        self._in_flight: tuple | None = None

    def issue(self, work, then, *held: torch.Tensor) -> None:
        """A reduction in flight (`work`), what to do once it is done, and the tensors it reads
        or writes (held until then)."""
        self.settle()
        self._in_flight = (work, then, held)

    def settle(self) -> None:
        """Wait for the reduction in flight, if any, and consume its result."""
        if self._in_flight is not None:
            (work, then, _held), self._in_flight = self._in_flight, None
            work.wait()
            settled()  # (`_held` keeps the tensors meanwhile)
            then()


class FlatUnit:
    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter, list]],
        infos: list[ParamRole],
        *,
        dtype: torch.dtype,
        device: torch.device,
        comms: Comms,
        zero: int,
        weights: float,
        grads: float,
        optimizer: float,
        micro_batches: int,
        memory: MemoryAccount,
        copy_stream=None,
        grad_dtype: torch.dtype | None = None,
    ):
        """`params`: (full name, fp32 parameter with the initial values, owners [(module, attr)]);
        `infos`: per parameter its `ParamRole` (decay, norm_skip, kv_range); `grad_dtype`: the
        gradient buffers' dtype (None: the working `dtype`)."""
        self.name, self.dtype, self.device = name, dtype, torch.device(device)
        self.grad_dtype = grad_dtype or dtype
        self.comms, self.zero, self.G = comms, zero, micro_batches
        self.memory = memory
        self.copy_stream = copy_stream
        self._lay_out(params, infos)
        self._init_states(params, weights, optimizer)
        self._bind_params(params)
        self._init_grads(grads)
        self._init_ranges()
        self._init_hooks()
        mem = self.master.device_bytes * 3
        mem += self.full.numel() * self.full.element_size() if self.persistent else self.store.device_bytes
        mem += self.acc.device_bytes
        memory.add_persistent(mem)

    def _lay_out(self, params, infos) -> None:
        """Each parameter's place in the flat buffer, and the buffer's lengths (`rules.flat_units`):
        N elements, padded to Np = dp shards of `shard_len`; the optimizer covers L elements
        from `opt_lo`."""
        self.infos: list[ParamInfo] = []
        off = 0
        for (pname, p, _), extra in zip(params, infos):
            n = p.numel()
            self.infos.append(
                ParamInfo(
                    pname, p.shape, off, n, extra.decay, _shift(extra.norm_skip, off), _shift(extra.kv_range, off)
                )
            )
            off += n
        dp = self.comms.dp
        self.N = off
        self.shard_len = flat_units.shard_len(off, dp)
        self.Np = self.shard_len * dp
        self.opt_lo = flat_units.optimizer_start(self.shard_len, self.comms.dp_rank, self.zero)
        self.L = flat_units.optimizer_len(self.shard_len, self.Np, self.zero)

    def _init_states(self, params, weights: float, optimizer: float) -> None:
        """fp32 initial values → master (exact fp32 init) and Adam moments over the optimizer
        range; the working buffer `full` (cast), and the weights' store unless `full` persists."""
        init = torch.zeros(self.Np, dtype=torch.float32)
        for (_, p, _), info in zip(params, self.infos):
            if not p.is_meta:  # a meta parameter (values loaded later, `hf_weights`) starts at zero
                init[info.offset : info.offset + info.numel].copy_(p.detach().reshape(-1))
        self.master = SplitBuffer(self.L, optimizer, torch.float32, self.device, zero=False)
        self.master.copy_(init[self.opt_lo : self.opt_lo + self.L])
        self.exp_avg = SplitBuffer(self.L, optimizer, torch.float32, self.device)
        self.exp_avg_sq = SplitBuffer(self.L, optimizer, torch.float32, self.device)

        self.full = init.to(self.device, self.dtype)
        if self.full.data_ptr() == init.data_ptr():
            self.full = init.clone()
        self.persistent = not flat_units.materializes_weights(self.zero, weights)
        self.store = None
        if not self.persistent:
            n = flat_units.weight_len(self.shard_len, self.Np, self.zero)
            lo = self.comms.dp_rank * self.shard_len if flat_units.shards_weights(self.zero) else 0
            self.store = SplitBuffer(n, weights, self.dtype, self.device, zero=False)
            self.store.copy_(self.full[lo : lo + n])

    def _bind_params(self, params) -> None:
        """The parameters become views of the flat buffer (every owner of a shared parameter too)."""
        self.params: list[nn.Parameter] = []
        for (_, _, owners), info in zip(params, self.infos):
            view = self.full[info.offset : info.offset + info.numel].view(info.shape)
            newp = nn.Parameter(view, requires_grad=True)
            for mod, attr in owners:
                setattr(mod, attr, newp)
            self.params.append(newp)
        self.materialized = True
        self._counted = False
        self.keep_until_backward = False  # e.g. a tied embedding also used by the head
        self._event = None
        if not self.persistent:
            self.release()

    def _init_grads(self, grads: float) -> None:
        """The gradient buffer (`rules.flat_units.grad_len`): the shard accumulator under ZeRO ≥ 2;
        the whole buffer while micro-batches accumulate (G > 1); with one micro-batch the reduced
        gradient's L elements (allocated once here rather than every step, and the same bytes
        `mist.simulate.states` predicts)."""
        n = flat_units.grad_len(self.shard_len, self.Np, self.zero, self.G)
        self.acc = SplitBuffer(n, grads, self.grad_dtype, self.device)
        self.opt_grad: SplitBuffer | None = None
        self._update = None  # a deferred optimizer step (see `defer_update`)
        self._gathering = False  # the re-gather of the new weights is in flight (`update_weights`)
        # When that buffer is the whole flat gradient and lives on the device, every micro-batch is
        # accumulated into it in place and it is reduced once, after the step's last micro-batch
        # (`rules.grad_accumulation`): in the working dtype the parameters' .grad are views of it
        # (autograd adds into them); in fp32 with 16-bit weights (autograd needs .grad in the
        # parameters' dtype) each parameter's hook adds its .grad into the buffer and drops it,
        # as Megatron-LM's main_grad hooks do.
        self.in_place = accumulates_in_place(n, self.Np, n - self.acc.dev_len)
        self.grad_views = self.in_place and self.grad_dtype == self.dtype

    def _init_ranges(self) -> None:
        """Ranges (in optimizer coordinates) for weight decay and for the gradient norm, and the
        local ranges of KV-head copies."""
        decay = [(i.offset, i.offset + i.numel) for i in self.infos if i.decay]
        self.decay_ranges = intersect(decay, self.opt_lo, self.opt_lo + self.L)
        skip = [i.norm_skip for i in self.infos if i.norm_skip]
        nlo = self.comms.dp_rank * self.shard_len
        shard = complement(skip, nlo, nlo + self.shard_len)
        base = self.opt_lo
        self.norm_ranges = [(a - base, b - base) for a, b in shard]
        self.kv_ranges = [i.kv_range for i in self.infos if i.kv_range]

    def _init_hooks(self) -> None:
        """Per-micro-batch state, and each parameter's post-accumulate-grad hook."""
        self._pending = 0
        self.micro_batch = 0
        self.last = True
        # pipeline with tied embeddings: the parameters' gradients accumulate over the step's
        # micro-batches and are reduced once after it (`reduce_deferred`), after the tied copies
        # on the first and last stage were summed
        self.defer_reduce = False
        for p, info in zip(self.params, self.infos):
            p.register_post_accumulate_grad_hook(lambda p, info=info: self._on_grad(p, info))

    # ------------------------------------------------------------ weights
    @property
    def full_bytes(self) -> int:
        return self.Np * self.full.element_size()

    @property
    def grad_full_bytes(self) -> int:
        """Bytes of the whole flat gradient (Np elements of the gradient dtype)."""
        return self.Np * self.acc.dev.element_size()

    def storage_ptr(self) -> int:
        return self.full.untyped_storage().data_ptr()

    def defer_update(self, future=None) -> None:
        """Make the new working weights when the unit is next used: after the optimizer's host
        part, still running, is done (`future`), or at once then (None: a step on the device)."""
        self._update = (future,)

    def finish_update(self) -> None:
        """Wait for a deferred optimizer step, then make the new working weights."""
        if self._update is not None:
            (fut,), self._update = self._update, None
            if fut is not None:
                fut.result()
            self.update_weights()

    def materialize(self, prefetch: bool = False) -> None:
        """Make `full` whole. With CUDA and `prefetch`, the copies run on the copy stream."""
        self.finish_update()
        if self.materialized:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        self.memory.add_transient(self.full_bytes)
        self._counted = True
        use_stream = prefetch and self.copy_stream is not None
        if use_stream:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self.copy_stream) if use_stream else contextlib.nullcontext()
        with ctx:
            if self.zero == 3:
                c = self.comms
                shard = self.store.read(0, self.shard_len, self.device)
                if c.dp_group is None:
                    self.full.copy_(shard)
                else:
                    shard = shard.contiguous()
                    with issuing():
                        all_gather_flat(self.full, shard, group=c.dp_group)
            else:
                d = self.store.dev_len
                self.full[:d].copy_(self.store.dev)
                self.full[d:].copy_(self.store.host, non_blocking=use_stream)
            if use_stream:
                self._event = torch.cuda.Event()
                self._event.record(self.copy_stream)
        self.materialized = True

    def wait(self) -> None:
        """Before using the weights: order the compute stream after a prefetch's copies, and
        take the re-gather of new weights if it is still in flight."""
        if self._gathering:
            self.comms.settle()
        if self._event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self._event)
            self.full.record_stream(cur)
            self._event = None

    def release(self) -> None:
        if self.persistent or not self.materialized:
            return
        if self._event is not None:
            self.wait()
        self.full.untyped_storage().resize_(0)
        if self._counted:
            self.memory.add_transient(-self.full_bytes)
            self._counted = False
        self.materialized = False

    # ------------------------------------------------------------ gradients
    def start_micro_batch(self, index: int, last: bool) -> None:
        self.micro_batch, self.last = index, last
        self._pending = len(self.params)
        if self.in_place and index == 0:
            self.acc.dev.zero_()
            if self.grad_views:
                for p, info in zip(self.params, self.infos):
                    p.grad = self._acc_view(info)

    def _acc_view(self, info: ParamInfo) -> torch.Tensor:
        return self.acc.dev[info.offset : info.offset + info.numel].view(info.shape)

    def _on_grad(self, p: torch.Tensor, info: ParamInfo) -> None:
        if self.in_place and not self.grad_views:  # fp32 buffer: add this gradient, drop it
            self._acc_view(info).add_(p.grad)
            p.grad = None
        if self.defer_reduce:
            return
        self._pending -= 1
        if self._pending == 0:
            self.reduce_grads()

    def finish_micro_batch(self) -> None:
        """After the backward: a unit whose hooks did not all fire (no gradient) reduces now, and
        the stage's reduction in flight is done with."""
        if self.defer_reduce:
            self._pending = 0
        elif self._pending > 0:
            self._pending = 0
            self.reduce_grads()
        self.comms.settle()

    def reduce_deferred(self, tied: list[int], segments, scale: float) -> None:
        """After the step's last backward: sum the tied copies of the parameters with index in
        `tied`, then reduce everything as one micro-batch.

        `segments`: (local rows lo, hi, group) — every rank of the first and the last stage that
        holds those vocabulary rows, all dp replicas of both. Each rank's gradient is that of its
        dp rank's own loss, so it is multiplied by `scale` (1 / its stage's dp) before the SUM:
        every member then holds the full gradient of those rows, and the usual reduction over its
        own dp group (divide by dp, sum or reduce-scatter, ZeRO as configured) leaves it unchanged
        (exactly so for power-of-two dp; the two copies may otherwise differ in the last bit).

        With in-place accumulation the micro-batches already sum in the gradient buffer; otherwise
        the parameters' .grad summed them in their own dtype, and they are flattened into the
        gradient dtype first. The tied copies are summed there.
        """
        flat = None if self.in_place else self._flat_grad()
        for i in tied:
            info = self.infos[i]
            g = self._acc_view(info) if flat is None else flat[info.offset : info.offset + info.numel].view(info.shape)
            if scale != 1.0:
                g.mul_(scale)
            for lo, hi, group in segments:
                with issuing():
                    dist.all_reduce(g[lo:hi], group=group)
        self.micro_batch, self.last = 0, True
        self.reduce_grads(flat)

    def _flat_grad(self) -> torch.Tensor:
        """The parameters' .grad as one flat gradient in the gradient dtype (counted as transient
        memory until `reduce_grads` is done with it); the .grad are dropped."""
        flat = torch.zeros(self.Np, dtype=self.grad_dtype, device=self.device)
        for p, info in zip(self.params, self.infos):
            if p.grad is not None:
                flat[info.offset : info.offset + info.numel].copy_(p.grad.reshape(-1))
                p.grad = None
        self.memory.add_transient(self.grad_full_bytes)
        return flat

    def reduce_grads(self, flat: torch.Tensor | None = None) -> None:
        """Reduce this micro-batch's gradients (`flat`: already flattened by `_flat_grad`)."""
        self.comms.settle()  # (the previous unit's reduction, before this unit's gradient is flattened)
        if self.in_place:
            self._reduce_in_place()
            return
        if flat is None:
            flat = self._flat_grad()
        c = self.comms
        if c.kv_group is not None:
            for a, b in self.kv_ranges:
                with issuing():
                    dist.all_reduce(flat[a:b], group=c.kv_group)
        self.release()
        first, last = self.micro_batch == 0, self.last
        if c.dp > 1:
            flat.div_(c.dp)
        if self.zero >= 2:

            def keep_shard(shard: torch.Tensor) -> None:
                if first:
                    self.acc.copy_(shard)
                else:
                    self.acc.add_(shard)
                if last:
                    self.opt_grad = self.acc
                self.memory.add_transient(-self.grad_full_bytes)

            self._dp_reduce(flat, True, keep_shard)
            return
        if not last:
            if first:
                self.acc.copy_(flat)
            else:
                self.acc.add_(flat)
            self.memory.add_transient(-self.grad_full_bytes)
            return
        if not first:
            flat.add_(self.acc.read(0, self.Np, self.device))

        def keep_reduced(red: torch.Tensor) -> None:
            # the reduced gradient waits for the optimizer with its `grads` fraction on the host,
            # in the gradient buffer's first L elements
            self.acc.write(0, red)
            self.opt_grad = self.acc
            self.memory.add_transient(-self.grad_full_bytes)

        self._dp_reduce(flat, self.zero == 1, keep_reduced)

    def _reduce_in_place(self) -> None:
        """The gradients already sum every micro-batch in the buffer: reduce them after the last."""
        self.release()
        if not self.last:
            return
        c, buf = self.comms, self.acc.dev
        if c.kv_group is not None:
            for a, b in self.kv_ranges:
                with issuing():
                    dist.all_reduce(buf[a:b], group=c.kv_group)
        if c.dp > 1:
            buf.div_(c.dp)
        scatter = self.zero == 1

        def keep(red: torch.Tensor) -> None:
            if scatter:
                self.acc.write(0, red)
            self.opt_grad = self.acc

        self._dp_reduce(buf, scatter, keep)

    def _dp_reduce(self, flat: torch.Tensor, scatter: bool, then) -> None:
        """Sum `flat` over dp in place, or reduce-scatter it into this rank's shard (`scatter`),
        and hand the result to `then`: at once without a dp group, else once the collective,
        issued asynchronously, is waited for (`Comms.issue`; `flat` is held until then)."""
        c = self.comms
        if c.dp_group is None:
            then(flat)
            return
        out = torch.empty(self.shard_len, dtype=flat.dtype, device=self.device) if scatter else flat
        with issuing():
            if scatter:
                work = reduce_scatter_flat(out, flat, group=c.dp_group, async_op=True)
            else:
                work = dist.all_reduce(flat, group=c.dp_group, async_op=True)
        c.issue(work, lambda: then(out), flat, out)

    # ------------------------------------------------------------ after the optimizer step
    @torch.no_grad()
    def update_weights(self) -> None:
        """New working weights from the fp32 master (re-gathered over dp for ZeRO 1/2)."""
        m = self.master
        if self.zero == 3:
            self.store.write(0, m.dev.to(self.dtype))
            self.store.write(m.dev_len, m.host.to(self.dtype))
        elif self.zero == 0:
            target = self.full if self.persistent else None
            if target is not None:
                target[: m.dev_len].copy_(m.dev)
                # (from pinned memory, non-blocking: converted on the GPU, not in a host pass)
                target[m.dev_len :].copy_(m.host, non_blocking=True)
            else:
                self.store.write(0, m.dev.to(self.dtype))
                self.store.write(m.dev_len, m.host.to(self.dtype))
        else:
            shard = torch.empty(self.shard_len, dtype=self.dtype, device=self.device)
            shard[: m.dev_len].copy_(m.dev)
            shard[m.dev_len :].copy_(m.host, non_blocking=True)
            out = self.full if self.persistent else torch.empty(self.Np, dtype=self.dtype, device=self.device)
            if self.comms.dp_group is None:
                out.copy_(shard)
            elif self.persistent:
                # in flight while the unit before this one runs its forward (the first use of
                # these weights waits for it: `wait`)
                self._gathering = True
                with issuing():
                    work = all_gather_flat(out, shard, group=self.comms.dp_group, async_op=True)
                self.comms.issue(work, self._gathered, shard, out)
            else:
                with issuing():
                    all_gather_flat(out, shard, group=self.comms.dp_group)
            if not self.persistent:
                self.store.copy_(out)
        self.opt_grad = None

    def _gathered(self) -> None:
        self._gathering = False
