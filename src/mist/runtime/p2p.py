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

from mist.models.collectives import settled
from mist.runtime.handoff import Piece

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEADER = 8  # ndim, dims…, dtype code (int64)
HEAD, ACTIVATION, GRADIENT = 0, 1, 2  # the message kinds a schedule's tags tell apart

Tag = Callable[[int], int]  # message kind -> tag


@dataclass(frozen=True)
class Channels:
    """The process groups a pipeline's messages travel on: one per kind (an activation with its
    header, or a gradient) and direction (to a higher or to a lower global rank).

    NCCL matches a communicator's sends and receives between two ranks in the order they are
    posted (it has no tags) and runs them on one stream per pair, where a send does not finish
    until its receive runs. On one communicator, two neighbours that each send before they
    receive (a 1F1B stage sends its output, then receives a gradient from the same neighbour,
    which sent that gradient first) would wait for each other for ever. Split so, a pair's stream
    in each group carries one kind one way, in the order its sender posts and its receiver takes
    them (`tests/runtime/test_send_waits.py` checks every order), so a send waits for its own
    receive only, as on gloo, and the waits the tests play as rendezvous are the whole story.
    `rank`: this process's global rank."""

    rank: int
    groups: tuple  # ((activations up, down), (gradients up, down))

    @classmethod
    def create(cls, rank: int, world: int) -> Channels:
        """Four groups of the whole world (`dist.new_group` is collective: every rank calls this)."""
        ranks = list(range(world))
        return cls(rank, tuple(tuple(dist.new_group(ranks) for _ in range(2)) for _ in range(2)))

    def group(self, kind: int, src: int, dst: int):
        """The group of a message of `kind` from global rank `src` to `dst`."""
        return self.groups[kind == GRADIENT][0 if src < dst else 1]

    def all(self) -> list:
        return [g for pair in self.groups for g in pair]

    def open(self, streams, device) -> None:
        """Send one element down each of this rank's `streams` ((kind, src, dst) global ranks), in
        one order every rank follows, before the first step. NCCL creates a pair's communicator
        at its first message and blocks both ranks' hosts until both have come to it: at a
        step's first sends (a stage's first gradient goes out while its neighbour still runs
        forwards) that would add waits the schedules' games do not have; in one global order it
        cannot close a cycle (each rank waits only for a stream both of its ranks take next)."""
        one = torch.zeros(1, device=device)
        for kind, src, dst in sorted(set(streams), key=lambda s: (s[0], min(s[1:]), max(s[1:]), s[1])):
            group = self.group(kind, src, dst)
            if src == self.rank:
                dist.isend(one, dst, group=group).wait()
            else:
                dist.recv(torch.empty_like(one), src, group=group)


@dataclass(frozen=True)
class Route:
    """Where a micro-batch's messages go: their tags by kind (gloo matches them) and the channels
    they travel on (None: the default group)."""

    tag: Tag
    channels: Channels | None = None

    def send_group(self, kind: int, peer: int):
        return None if self.channels is None else self.channels.group(kind, self.channels.rank, peer)

    def recv_group(self, kind: int, peer: int):
        return None if self.channels is None else self.channels.group(kind, peer, self.channels.rank)


def _part(x: torch.Tensor, p: Piece) -> torch.Tensor:
    return x[p.region()].contiguous()


def wait_all(works) -> None:
    """Wait for the sends of [(work, tensor), ...], which the caller holds until this returns:
    they settle (`models.collectives.settled`) before it drops them."""
    for work, _ in works:
        work.wait()
    if works:
        settled()


def _isend(t: torch.Tensor, peer: int, kind: int, route: Route):
    return dist.isend(t, peer, group=route.send_group(kind, peer), tag=route.tag(kind))


def _recv(t: torch.Tensor, peer: int, kind: int, route: Route) -> None:
    dist.recv(t, peer, group=route.recv_group(kind, peer), tag=route.tag(kind))


def send_activation(x: torch.Tensor, pieces, route: Route, device, pending: list) -> None:
    x = x.detach()
    for p in pieces:
        part = _part(x, p)
        head = torch.zeros(HEADER, dtype=torch.int64, device=device)
        head[0] = part.dim()
        head[1 : 1 + part.dim()] = torch.tensor(part.shape, dtype=torch.int64)
        head[HEADER - 1] = DTYPES.index(part.dtype)
        pending.append((_isend(head, p.rank, HEAD, route), head))
        pending.append((_isend(part, p.rank, ACTIVATION, route), part))


def _recv_region(x: torch.Tensor, p: Piece, kind: int, route: Route) -> None:
    """Receive piece `p` into its region of x (through a buffer where the region is strided)."""
    dest = x[p.region()]
    if dest.is_contiguous():
        _recv(dest, p.rank, kind, route)
        return
    buf = torch.empty(dest.shape, dtype=x.dtype, device=x.device)
    _recv(buf, p.rank, kind, route)
    dest.copy_(buf)


def recv_activation(pieces, rows: int, route: Route, device) -> torch.Tensor:
    """The activation of this rank's `rows` rows (and its sequence positions), requiring grad."""
    x = None
    seq = max((p.s_hi for p in pieces if p.s_hi is not None), default=None)
    for p in pieces:
        head = torch.empty(HEADER, dtype=torch.int64, device=device)
        _recv(head, p.rank, HEAD, route)
        h = head.tolist()
        shape = h[1 : 1 + h[0]]
        if x is None:
            dims = [rows, shape[1] if seq is None else seq] + shape[2:]
            x = torch.empty(dims, dtype=DTYPES[h[HEADER - 1]], device=device)
        _recv_region(x, p, ACTIVATION, route)
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


def recv_gradient(out: torch.Tensor | SentOutput, pieces, route: Route, device, scale: float = 1.0) -> torch.Tensor:
    """The gradient of this rank's output `out`, from the next stage's ranks, times `scale`."""
    grad = torch.empty(out.shape, dtype=out.dtype, device=device)
    for p in pieces:
        _recv_region(grad, p, GRADIENT, route)
    if scale != 1.0:
        grad.mul_(scale)
    return grad


def send_gradient(gx: torch.Tensor, pieces, route: Route, pending: list) -> None:
    for p in pieces:
        part = _part(gx, p)
        pending.append((_isend(part, p.rank, GRADIENT, route), part))


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
        wait_all(self._activations.pop(key, ()))

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
        wait_all(self._gradient)
        self._gradient = []
        return self._gradient

    def release_gradients(self, keys) -> None:
        """Wait for the held gradients of `keys` and drop them."""
        for key in keys:
            wait_all(self._held.pop(key, ()))

    def finish(self) -> None:
        for works in [*self._activations.values(), self._gradient, *self._held.values()]:
            wait_all(works)
        self._activations, self._gradient, self._held = {}, [], {}
