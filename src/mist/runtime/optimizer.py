"""AdamW over the flat units' fp32 master shards: device part on the device, host part on the CPU.

Each unit's optimizer range (its 1/dp shard for ZeRO ≥ 1, everything for ZeRO 0) is split like its
master weights: the first (1 − optimizer-offload) elements step on the device, the rest — master,
m and v kept in host memory — step on the CPU (a CPU Adam, not a round trip through the GPU).
The arithmetic is `torch.optim.AdamW`'s (its fused kernel where PyTorch has one), with decoupled
weight decay on matrices only (not on norms and biases).

The host part runs on a worker thread and is waited for lazily: every unit gets its new working
weights (`FlatUnit.update_weights`) only when the next forward first needs them
(`FlatUnit.finish_update`), so the CPU Adam of later units overlaps the device work of earlier
ones, and a ZeRO-1/2 re-gather the forward of the unit before, as the simulator's first
micro-batch assumes. `flush` finishes all.

Gradient clipping uses the global norm over every rank's gradient shard: each element is counted
once (parameters replicated across TP ranks only on TP rank 0, KV-head copies only on the first
rank of their KV group, ZeRO-0 full gradients only over this dp rank's 1/dp slice), summed over
the whole world. fp16 uses dynamic loss scaling; a non-finite norm skips the step. The gradient
buffers are in the gradient dtype (16-bit, or fp32); the update reads them as fp32, piece by piece
(`mist.rules.optimizer_step`: an fp32 buffer on the device without a copy, else one fp32 piece at
a time, so that a step adds at most one piece to the states).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mist.rules.optimizer_step import chunks
from mist.runtime.buffers import host_empty
from mist.runtime.flat import FlatUnit, complement, intersect
from mist.torch_compat import HAS_FUSED_ADAM, fused_adamw_


def adamw_(
    p, m, v, g, *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decay_ranges
) -> None:
    """One AdamW step in place on flat fp32 tensors (the rate `mist profile` measures), with the
    decoupled weight decay on `decay_ranges` only."""
    if p.numel() == 0:
        return
    hp = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    if HAS_FUSED_ADAM and p.device.type in ("cpu", "cuda"):
        # PyTorch's fused kernel: one pass over p, m, v and g, the decay included, instead of
        # about eight (a separate decay pass costs a third more on a host's memory bandwidth)
        for wd, ranges in ((weight_decay, decay_ranges), (0.0, complement(decay_ranges, 0, p.numel()))):
            if ranges:
                fused_adamw_(*([t[a:b] for a, b in ranges] for t in (p, g, m, v)), weight_decay=wd, **hp)
        return
    if weight_decay:
        for a, b in decay_ranges:
            p[a:b].mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def _host_step(first, mult: float, p, m, v, g, decay_ranges, kw: dict) -> None:
    """The host part of a unit's step (on the optimizer's worker thread): once the gradient's
    copy from the device is in and its offloaded part converted and scaled (`first`, from
    `ShardedAdamW._host_grad`), the AdamW step."""
    ready, fills = first
    if ready is not None:
        ready.synchronize()
    for dst, src in fills:
        dst.copy_(src).mul_(mult)
    adamw_(p, m, v, g, decay_ranges=decay_ranges, **kw)


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_ratio · base_lr at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    t = min(max(step - warmup, 0) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _aliases(t: torch.Tensor, buf) -> bool:
    """Whether `t` shares storage with a part of the SplitBuffer `buf`."""
    ptr = t.untyped_storage().data_ptr()
    return any(x.numel() and x.untyped_storage().data_ptr() == ptr for x in (buf.dev, buf.host))


class LossScaler:
    """Dynamic loss scaling for fp16 (halve on overflow, double after `interval` good steps)."""

    def __init__(self, enabled: bool, init: float = 2.0**16, interval: int = 1000):
        self.enabled, self.scale, self.interval, self._good = enabled, init if enabled else 1.0, interval, 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self._good = 0
        else:
            self._good += 1
            if self._good % self.interval == 0:
                self.scale *= 2


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool


class ShardedAdamW:
    def __init__(
        self,
        units: list[FlatUnit],
        *,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        max_grad_norm: float = 1.0,
        scaler: LossScaler | None = None,
        norm_group=None,
    ):
        self.units = units
        self._host = None  # one worker thread for the host parts, in unit order (made on first use)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.max_grad_norm = eps, weight_decay, max_grad_norm
        self.scaler = scaler or LossScaler(False)
        self.norm_group = norm_group
        self.step_count = 0
        self.host_grad_peak = 0  # bytes of the fp32 gradient copies the CPU AdamW steps with
        self._grad_bufs: dict[int, torch.Tensor] = {}  # on a GPU: each unit's pinned gradient copy

    def _sq_norm(self, device: torch.device) -> torch.Tensor:
        dev = torch.zeros((), dtype=torch.float64, device=device)
        host = torch.zeros((), dtype=torch.float64)
        for u in self.units:
            g = u.opt_grad
            for lo, hi in u.norm_ranges:
                for part, a, b, _ in g.pieces(lo, hi):
                    # the square of the fp32 norm: one reading pass on a GPU, whose reductions
                    # upcast 16-bit inputs on the fly (a CPU converts them to fp32 first)
                    s = torch.linalg.vector_norm(getattr(g, part)[a:b], dtype=torch.float32).double().square()
                    if part == "dev":
                        dev += s
                    else:
                        host += s
        return dev + host.to(device)

    @torch.no_grad()
    def step(self, lr: float, device: torch.device, timer=None) -> StepResult:
        """One step over every unit; `timer` (a PhaseTimer) times the update itself as "opt" —
        not the gradient-norm all-reduce, which also waits for the other stages to finish."""
        for u in self.units:  # (every gradient reduction done with: the backwards settle theirs)
            u.comms.settle()
        sq = self._sq_norm(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq, group=self.norm_group)
        norm = math.sqrt(sq.item()) / self.scaler.scale if math.isfinite(sq.item()) else float("inf")
        if not math.isfinite(norm):
            self.scaler.update(True)
            for u in self.units:
                u.opt_grad = None
            return StepResult(norm, True)
        self.scaler.update(False)
        coef = 1.0
        if self.max_grad_norm and self.max_grad_norm > 0:
            coef = min(self.max_grad_norm / (norm + 1e-6), 1.0)
        mult = coef / self.scaler.scale
        self.step_count += 1
        kw = dict(
            step=self.step_count,
            lr=lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )
        with timer.span("opt") if timer is not None else nullcontext():
            self._update(mult, kw)
        return StepResult(norm, False)

    def _update(self, mult: float, kw: dict) -> None:
        host_grads = 0
        for i, u in enumerate(self.units):
            m, ea, es, g = u.master, u.exp_avg, u.exp_avg_sq, u.opt_grad
            d = m.dev_len
            dec_host = intersect(u.decay_ranges, d, u.L)
            # piece by piece, each piece's fp32 gradient dropped before the next is read
            # (`mist.rules.optimizer_step`; an fp32 gradient buffer is read and scaled in place:
            # nothing reads it again before the next step overwrites it)
            for a, b in chunks(0, d):
                g_dev = g.read(a, b, m.device, torch.float32).mul_(mult)
                adamw_(m.dev[a:b], ea.dev[a:b], es.dev[a:b], g_dev, decay_ranges=intersect(u.decay_ranges, a, b), **kw)
                del g_dev
            if m.host.numel():
                # the offloaded fraction of the optimizer states steps on the CPU, in the background;
                # its gradient is copied out now (the buffer is reused by the next step)
                u.finish_update()  # (the last step's host part has read its gradient copy)
                g_host, first = self._host_grad(i, g, d, u.L, mult)
                host_grads += g_host.numel() * g_host.element_size()
                u.opt_grad = None
                u.defer_update(
                    self._host_pool().submit(_host_step, first, mult, m.host, ea.host, es.host, g_host, dec_host, kw)
                )
            else:
                # the new working weights when the unit is next used (its ZeRO-1/2 re-gather then
                # overlaps the forward of the unit before it: `FlatUnit.update_weights`)
                u.defer_update()
        # the copies live until each unit's deferred step ran: all of them at once, at most
        self.host_grad_peak = max(self.host_grad_peak, host_grads)

    def _host_grad(self, key: int, g, lo: int, hi: int, mult: float):
        """(the fp32 gradient of elements [lo, hi) of `g` on the host for the CPU AdamW, scaled by
        `mult`; what `_host_step` must do first: (event to wait for or None, [(destination,
        source)] to convert and scale there)). On a GPU the device part is converted and scaled
        there and copied out asynchronously into a pinned buffer kept per unit, and an offloaded
        gradient tail (already on the host) is converted on the optimizer's worker thread: the
        main thread makes no pass over host memory (converting on the host and copying through
        pageable memory took most of an offloaded step on an H200 machine,
        benchmarks/results/gpu_loop.md)."""
        if g.device.type != "cuda":
            out = g.read(lo, hi, "cpu", torch.float32)
            if _aliases(out, g):
                out = out.clone()
            return out.mul_(mult), (None, [])
        buf = self._grad_bufs.get(key)
        if buf is None:
            buf = self._grad_bufs[key] = host_empty(hi - lo, torch.float32)
        fills = []
        for part, a, b, o in g.pieces(lo, hi):
            src = getattr(g, part)[a:b]
            if part == "dev":  # (converted piece by piece: `mist.rules.optimizer_step`)
                for c, e in chunks(0, b - a):
                    buf[o + c : o + e].copy_(src[c:e].to(torch.float32, copy=True).mul_(mult), non_blocking=True)
            else:
                fills.append((buf[o : o + b - a], src))
        ready = torch.cuda.Event()
        ready.record()
        return buf, (ready, fills)

    def _host_pool(self):
        if self._host is None:
            from concurrent.futures import ThreadPoolExecutor

            self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mist-host-adam")
        return self._host

    def flush(self) -> None:
        """Finish every deferred host step and weight update (before reading or saving states)."""
        for u in self.units:
            u.finish_update()
        for u in self.units:
            u.comms.settle()

    def close(self) -> None:
        self.flush()
        if self._host is not None:
            self._host.shutdown()
            self._host = None
