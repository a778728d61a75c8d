"""Point-to-point exchange of a micro-batch's activation and its gradient between neighbouring
pipeline stages, piece by piece (`handoff.Piece`: rows and, under sequence parallelism, sequence
positions of this rank's tensor). Used by the plain and the interleaved 1F1B schedules.

An activation piece goes with a header (its shape and dtype) so that the receiver can allocate
the tensor before the data arrives; a gradient has the shape of the activation it belongs to.
Sends are non-blocking (appended to a list of (work, tensor)); receives block, piece by piece in
row order. A send's tensor is held until its work is waited for: `Sends` says when.

A stage's output is needed only as the root of its backward once its receivers have it: the
non-interleaved schedules wait for its pieces right after sending them (an interleaved rank a few
operations later: `rules.interleaved_sends`) and keep its autograd edge instead (`SentOutput`), so
that its data is freed then, not at its gradient's return, as Megatron-LM deallocates its
pipeline outputs. On a GPU the wait orders the compute stream after the send and
blocks nothing; on gloo it returns when the next stage has posted the receive, which a 1F1B or
ZB-H1 stage's next blocking receive would wait for anyway (the order's waits stay acyclic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, get_gradient_edge

from mist.runtime.handoff import Piece

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEADER = 8  # ndim, dims…, dtype code (int64)
HEAD, ACTIVATION, GRADIENT = 0, 1, 2  # the message kinds a schedule's tags tell apart

Tag = Callable[[int], int]  # message kind -> tag


def _part(x: torch.Tensor, p: Piece) -> torch.Tensor:
    return x[p.region()].contiguous()


def send_activation(x: torch.Tensor, pieces, tag: Tag, device, pending: list) -> None:
    x = x.detach()
    for p in pieces:
        part = _part(x, p)
        head = torch.zeros(HEADER, dtype=torch.int64, device=device)
        head[0] = part.dim()
        head[1 : 1 + part.dim()] = torch.tensor(part.shape, dtype=torch.int64)
        head[HEADER - 1] = DTYPES.index(part.dtype)
        pending.append((dist.isend(head, p.rank, tag=tag(HEAD)), head))
        pending.append((dist.isend(part, p.rank, tag=tag(ACTIVATION)), part))


def _recv_region(x: torch.Tensor, p: Piece, tag: int) -> None:
    """Receive piece `p` into its region of x (through a buffer where the region is strided)."""
    dest = x[p.region()]
    if dest.is_contiguous():
        dist.recv(dest, p.rank, tag=tag)
        return
    buf = torch.empty(dest.shape, dtype=x.dtype, device=x.device)
    dist.recv(buf, p.rank, tag=tag)
    dest.copy_(buf)


def recv_activation(pieces, rows: int, tag: Tag, device) -> torch.Tensor:
    """The activation of this rank's `rows` rows (and its sequence positions), requiring grad."""
    x = None
    seq = max((p.s_hi for p in pieces if p.s_hi is not None), default=None)
    for p in pieces:
        head = torch.empty(HEADER, dtype=torch.int64, device=device)
        dist.recv(head, p.rank, tag=tag(HEAD))
        h = head.tolist()
        shape = h[1 : 1 + h[0]]
        if x is None:
            dims = [rows, shape[1] if seq is None else seq] + shape[2:]
            x = torch.empty(dims, dtype=DTYPES[h[HEADER - 1]], device=device)
        _recv_region(x, p, tag(ACTIVATION))
    assert x is not None, "a stage with a previous stage receives at least one piece"
    return x.requires_grad_(x.is_floating_point())


@dataclass(frozen=True)
class SentOutput:
    """A sent output without its data: the edge its backward runs from, its shape and dtype (what
    its gradient is received as). Its storage is freed with the tensor unless autograd saved it."""

    edge: GradientEdge
    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, out: torch.Tensor) -> SentOutput:
        return cls(get_gradient_edge(out), out.shape, out.dtype)


def recv_gradient(out: torch.Tensor | SentOutput, pieces, tag: Tag, device, scale: float = 1.0) -> torch.Tensor:
    """The gradient of this rank's output `out`, from the next stage's ranks, times `scale`."""
    grad = torch.empty(out.shape, dtype=out.dtype, device=device)
    for p in pieces:
        _recv_region(grad, p, tag(GRADIENT))
    if scale != 1.0:
        grad.mul_(scale)
    return grad


def send_gradient(gx: torch.Tensor, pieces, tag: Tag, pending: list) -> None:
    for p in pieces:
        part = _part(gx, p)
        pending.append((dist.isend(part, p.rank, tag=tag(GRADIENT)), part))


class Sends:
    """The sends of one step that are still held, by micro-batch (and chunk).

    A micro-batch's activation pieces are released (waited for: at once, its receivers have used
    them) when its gradient has come back (`release_activation`). A gradient's pieces are released
    when the stage sends its next gradient (`gradient_list`): a stage then holds at most one sent
    gradient besides the one it sends, instead of every micro-batch's until the end of the step.
    The previous stage takes that gradient in its next backward, which waits for nothing more from
    this stage (a chain of stages: no cycle), so the wait can delay but not block. An interleaved
    rank (`hold_gradients`) keeps its gradients by key instead and releases them where its order
    says (`release_gradients`, `rules.interleaved_sends.send_waits`): its neighbours can wait on
    each other across the wrap-around. The rest is waited for at the end of the step (`finish`)."""

    def __init__(self, hold_gradients: bool = False):
        self.hold_gradients = hold_gradients
        self._activations: dict = {}
        self._gradient: list = []
        self._held: dict = {}

    def activation_list(self, key) -> list:
        """The list that micro-batch `key`'s activation pieces go in."""
        return self._activations.setdefault(key, [])

    def release_activation(self, key) -> None:
        for work, _ in self._activations.pop(key, ()):
            work.wait()

    def delivered(self, key, out: torch.Tensor) -> SentOutput:
        """Micro-batch `key`'s output, sent: its pieces waited for now and released, the output
        kept as its edge (the caller drops the tensor, and with it the data)."""
        self.release_activation(key)
        return SentOutput.of(out)

    def gradient_list(self, key=None) -> list:
        """The list that the next gradient's pieces go in (with `hold_gradients`, kept under `key`
        until `release_gradients`); otherwise the last one's are released first."""
        if self.hold_gradients:
            return self._held.setdefault(key, [])
        for work, _ in self._gradient:
            work.wait()
        self._gradient = []
        return self._gradient

    def release_gradients(self, keys) -> None:
        """Wait for the held gradients of `keys` and drop them."""
        for key in keys:
            for work, _ in self._held.pop(key, ()):
                work.wait()

    def finish(self) -> None:
        for works in [*self._activations.values(), self._gradient, *self._held.values()]:
            for work, _ in works:
                work.wait()
        self._activations, self._gradient, self._held = {}, [], {}
