"""Saved-activation handling: fractional offloading to host memory, and byte accounting.

One `saved_tensors_hooks` pair wraps a stage's whole forward. While a decoder block runs with an
offload ratio r > 0, `pack` keeps the first (1 − r) of each saved tensor's elements on the device
(as a fresh copy, so that the original storage can be freed) and moves the last r to host memory
(pinned, copied on a side stream on CUDA); `unpack` copies it back and rebuilds the tensor at the
start of its backward. Weights (views of the flat weight buffers) are never offloaded here: they
are the weight-offload's business. Tensors saved while no ratio is set pass through unchanged and
are only counted. Which tensors are split and where is the rule of `mist.rules.offload_split`,
whose byte sums the simulator predicts a block's saved activations with.

A compiled block (`training.compile_blocks`) is split by storage instead (`by_storage`): its
backward requires the exact strides its forward saved, among them views into one storage (q, k
and v of the fused QKV output). So each saved storage is split once, as a whole, and `unpack`
rebuilds it once and returns each view with its own sizes, strides and offset
(`mist.analysis.compiled` counts the same storages).

Under ZB-H1 a stage after the first runs B with the autograd graph kept for W
(`runtime.zero_bubble`), so every saved tensor would stay to W's end; W reads few of them. A tensor
kept as it is (not offloaded) is held in a `_Held`, which lets go of it when a node that runs only
once reads it:
- a compiled block split into B and W graphs (ZB-H1's) reads its saved tensors once, all at its
  backward's start, and its compiled graph frees each after its last use (W's graph reads only
  the values B hands it: `models.weight_split`); they are handed out once;
- an eager node that W does not run again (all but the frontier nodes whose weight gradients W
  makes: `zero_bubble._WeightPass`) lets go of its saved tensors as it reads them in B
  (`releasing_in_b`): an attention's, an activation's, a norm's, the loss's.
Offloaded tensors and storages stay with the graph (`_StorageView`: restored whole at the first
of their views); a ZB-H1 stage offloads none (`rules.zero_bubble_order.zb_h1_problem`).

Backward brings the tails back one block ahead: the first `unpack` of a block's backward restores
that block's tensors (if they are not back yet) and starts restoring the block below it, of the
same micro-batch, so that its host→device copies overlap this block's backward, as the simulator
prices them (`mist.simulate.stage`: a block's backward overlaps its activations' copy back, and
holds the block below's fetched activations at its peak). Without it, every copy back ran on the
compute stream before its block's backward: an H200 spent 0.81 s on a step priced at 0.58 s with
half of a llama-1.3b's activations offloaded (benchmarks/results/gpu_loop.md).

GPU path (run by `benchmarks/gpu/`; the CPU tests run the same bookkeeping with plain copies): the
device→host copy runs on a side stream after waiting for the compute stream; the device tail is
`record_stream`-ed on that stream so the caching allocator does not reuse it early. The copy back
runs on a second side stream: it waits for the compute stream (the memory it writes was allocated
there) and for the copy out, and the compute stream waits for its event before the tensor is used.
"""

from __future__ import annotations

import contextlib

import torch

from mist.rules.offload_split import splits_saved
from mist.runtime.buffers import host_empty, split_point
from mist.runtime.memory import MemoryAccount


class _Offloaded:
    __slots__ = ("back", "device", "dtype", "event", "group", "head", "restored", "shape", "tail")

    def __init__(self, shape, dtype, device, head, tail, event, group: _Group | None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.head, self.tail, self.event = head, tail, event
        self.group = group  # the block (of one micro-batch's forward) it was saved in
        self.restored: torch.Tensor | None = None  # a whole storage's, once rebuilt
        # brought back ahead of its use: (the flat tensor on the device, the copy's CUDA event or None)
        self.back: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


class _Held:
    """A saved tensor kept on the device as it is, until a reader that runs once takes it (see
    the module docstring); `once`: a compiled block's."""

    __slots__ = ("once", "tensor")

    def __init__(self, tensor: torch.Tensor, once: bool):
        self.tensor: torch.Tensor | None = tensor
        self.once = once


class _Reads:
    """While a ZB-H1 B runs (`releasing_in_b`), whether the node reading now is run again by W.
    Process-wide, not thread-local: on a GPU autograd runs the backward on its device thread."""

    in_b = False
    again = False


@contextlib.contextmanager
def releasing_in_b():
    """Inside: a saved tensor read by a node that W does not run again is let go of."""
    _Reads.in_b, _Reads.again = True, False
    try:
        yield
    finally:
        _Reads.in_b, _Reads.again = False, False


def read_again(again: bool) -> None:
    """Whether the node about to run (or, False, none) is run again by W (`zero_bubble`'s
    hooks around each frontier node)."""
    _Reads.again = again


class _Group:
    """The tensors one block offloaded in one micro-batch's forward, and the block below it."""

    __slots__ = ("below", "fetching", "items")

    def __init__(self, below: _Group | None):
        self.items: list[_Offloaded] = []
        self.below = below
        self.fetching = False


class _StorageView:
    """A saved view of a storage that was offloaded whole (a compiled block's)."""

    __slots__ = ("offset", "shape", "storage", "stride")

    def __init__(self, storage: _Offloaded, shape, stride, offset):
        self.storage, self.shape, self.stride, self.offset = storage, shape, stride, offset


class SavedTensorManager:
    def __init__(self, device: torch.device, memory: MemoryAccount, is_weight):
        self.device = torch.device(device)
        self.memory = memory
        self.is_weight = is_weight  # callable: tensor → True for a view of a weight buffer
        self.ratio = 0.0
        self.by_storage = False  # the running block is compiled: split saved storages whole
        self.once = False  # ... and its saved tensors are read once (`_Held`)
        # the storages split so far in the running block's forward, held until it ends (so that
        # no freed address is mistaken for one of them)
        self._block_storages: dict[int, tuple[_Offloaded, torch.UntypedStorage]] = {}
        self.cuda = self.device.type == "cuda"
        self.d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._group: _Group | None = None  # the running block's, in a forward
        self._last_group: _Group | None = None  # the micro-batch's block before it
        self._seen: set[int] = set()
        self.offloaded_bytes = 0  # every tail moved to the host so far (cumulative)
        self.host_bytes = 0  # tails in host memory now (until their backward unpacks them)
        self.host_peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def new_micro_batch(self) -> None:
        self._seen.clear()
        self._last_group = None

    # ------------------------------------------------------------------ hooks
    def _count(self, nbytes: int, key: int | None) -> None:
        if key is not None:
            if key in self._seen:
                return
            self._seen.add(key)
        self.memory.add_activations(nbytes)

    def pack(self, t: torch.Tensor):
        # A tensor kept as it is, is kept detached: a node that saves its own output (attention,
        # softmax) would otherwise hold that output, whose grad_fn is the node itself — a cycle
        # through autograd's C++ graph that nothing collects. A backward that runs the node
        # releases what it saved and breaks it, but under ZB-H1 the nodes that only B runs keep
        # their saved tensors after B (the graph is retained for W), so every micro-batch's graph
        # stayed alive for good: measured with the CPU allocator trace, 5 MiB more per micro-batch
        # and step on the last stage of a 2-stage loop-gpt plan. (Autograd gives a saved output
        # its grad_fn back when it unpacks it.)
        if self.is_weight(t):
            return t
        on_device = t.device == self.device
        if on_device and self.by_storage and self.ratio > 0:
            return self._pack_storage(t)
        if not (on_device and splits_saved(t.numel(), self.ratio)):
            if on_device:
                st = t.untyped_storage()
                self._count(st.nbytes(), st.data_ptr())
            return _Held(t.detach(), self.once)
        return self._offload(t.detach().reshape(-1), t.shape)

    def _pack_storage(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._block_storages:
            n = st.nbytes() // t.element_size()
            if not splits_saved(n, self.ratio):
                self._count(st.nbytes(), key)
                return t.detach()  # (as in `pack`)
            whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(st, 0, (n,), (1,))
            self._block_storages[key] = (self._offload(whole, (n,)), st)
        return _StorageView(self._block_storages[key][0], t.shape, t.stride(), t.storage_offset())

    @contextlib.contextmanager
    def layer(self, ratio: float, by_storage: bool, once: bool = False):
        """While one layer's forward runs: the fraction of its saved activations to offload,
        whether they split storage by storage (a compiled block) and whether they are read once
        (a compiled block's). The storages split in it are no longer looked up after it."""
        self.ratio, self.by_storage, self.once = ratio, by_storage, once
        group = self._group = _Group(self._last_group) if ratio > 0 else None
        try:
            yield
        finally:
            self.ratio, self.by_storage, self.once = 0.0, False, False
            self._block_storages.clear()
            self._group = None
            if group is not None and group.items:
                self._last_group = group

    def _offload(self, flat: torch.Tensor, shape) -> _Offloaded:
        """Keep the head of `flat` on the device (a fresh copy) and move its tail to the host."""
        keep = split_point(flat.numel(), self.ratio)
        head = flat[:keep].clone()
        tail_dev = flat[keep:]
        tail = host_empty(tail_dev.numel(), flat.dtype)
        event = None
        if self.cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                tail.copy_(tail_dev, non_blocking=True)
                tail_dev.record_stream(self.d2h_stream)
                event = torch.cuda.Event()
                event.record(self.d2h_stream)
        else:
            tail.copy_(tail_dev)
        self._count(head.numel() * head.element_size(), None)
        nbytes = tail.numel() * tail.element_size()
        self.offloaded_bytes += nbytes
        self.host_bytes += nbytes
        self.host_peak = max(self.host_peak, self.host_bytes)
        packed = _Offloaded(shape, flat.dtype, flat.device, head, tail, event, self._group)
        if self._group is not None:
            self._group.items.append(packed)
        return packed

    def unpack(self, packed):
        if isinstance(packed, _Held):
            t = packed.tensor
            assert t is not None, "a saved tensor read again after a reader that runs once"
            if packed.once or (_Reads.in_b and not _Reads.again):
                packed.tensor = None
            return t
        if isinstance(packed, _StorageView):
            whole = packed.storage
            if whole.restored is None:  # the first of its views to come back rebuilds it
                whole.restored = self._restore(whole)
            return whole.restored.as_strided(packed.shape, packed.stride, packed.offset)
        if not isinstance(packed, _Offloaded):
            return packed
        return self._restore(packed).view(packed.shape)

    def _restore(self, packed: _Offloaded) -> torch.Tensor:
        """The flat tensor `packed` was split from, back on the device in one piece; starts
        bringing back the block below its block."""
        group, packed.group = packed.group, None
        if group is not None and not group.fetching:  # this block's first: it is needed now
            self._fetch(group)
        if group is not None and group.below is not None and not group.below.fetching:
            self._fetch(group.below)
        self.host_bytes -= packed.tail.numel() * packed.tail.element_size()
        if packed.back is None:  # (a tensor saved outside any block)
            self._copy_back(packed, None)
        assert packed.back is not None
        out, event = packed.back
        packed.back = None
        if event is not None:
            torch.cuda.current_stream(packed.device).wait_event(event)
        return out

    def _fetch(self, group: _Group) -> None:
        """Copy every tensor of `group` back to the device (on CUDA on the copy-back stream). The
        group lets go of them: a tensor and its group would otherwise hold each other, a cycle
        that only the garbage collector frees, keeping the device heads and the pinned host tails
        of every micro-batch alive until it runs (an H200 run with half the activations offloaded
        reached 70 GiB and 5.7 s steps instead of 31 GiB and 0.68 s)."""
        group.fetching = True
        items, group.items = group.items, []
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if compute is not None:
            self.h2d_stream.wait_stream(compute)
        for packed in items:
            self._copy_back(packed, compute)

    def _copy_back(self, packed: _Offloaded, compute) -> None:
        """packed.back: its flat tensor, allocated on the compute stream and, with `compute`,
        filled on the copy-back stream (head and tail; the tail once its copy out is done)."""
        out = torch.empty(packed.head.numel() + packed.tail.numel(), dtype=packed.dtype, device=packed.device)
        if compute is None:
            if packed.event is not None:
                torch.cuda.current_stream(packed.device).wait_event(packed.event)
            out[: packed.head.numel()].copy_(packed.head)
            out[packed.head.numel() :].copy_(packed.tail, non_blocking=packed.event is not None)
            packed.back = (out, None)
            return
        with torch.cuda.stream(self.h2d_stream):
            if packed.event is not None:
                self.h2d_stream.wait_event(packed.event)
            out[: packed.head.numel()].copy_(packed.head)
            out[packed.head.numel() :].copy_(packed.tail, non_blocking=True)
            packed.head.record_stream(self.h2d_stream)
            event = torch.cuda.Event()
            event.record(self.h2d_stream)
        packed.back = (out, event)
