"""Schedules: the order in which a stage runs the micro-batches' forwards and backwards.

`GradAccumSchedule` is the single-stage schedule: G micro-batches, each a forward then a backward,
gradients accumulated (and reduced by the units' hooks at the last one). `PipelineSchedule` is
its multi-stage sibling with the same `run` contract: non-interleaved 1F1B (interleaved 1F1B is
`interleaved.InterleavedSchedule`), with p2p of
activations and gradients between neighbouring stages (which may differ in dp, tp and
micro-batch: `Links`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mist.rules.pipeline_order import FORWARD, one_f_one_b
from mist.runtime import p2p
from mist.runtime.handoff import Piece
from mist.runtime.phase_timer import PhaseTimer
from mist.runtime.stage_runner import StageRunner


class GradAccumSchedule:
    def __init__(self, micro_batches: int):
        self.G = micro_batches

    def run(
        self, runner: StageRunner, micro_batches, loss_scale: float = 1.0, timer: PhaseTimer | None = None
    ) -> list[torch.Tensor]:
        """Run one step's micro-batches [(tokens, targets)]; return their (detached) losses.

        Each micro-batch loss is a token mean; the step's loss is their mean, so each backward
        is scaled by 1/G (and by the fp16 loss scale). `timer` times each forward and backward.
        """
        span = _spans(timer)
        losses = []
        for g, (tokens, targets) in enumerate(micro_batches):
            runner.start_micro_batch(g, last=g == self.G - 1)
            with span("fwd", g):
                loss = runner.forward(tokens, targets)
            with span("bwd", g):
                (loss * (loss_scale / self.G)).backward()
                runner.finish_micro_batch()
            losses.append(loss.detach())
        return losses

    @torch.no_grad()
    def forward_only(self, runner: StageRunner, micro_batches) -> list[torch.Tensor]:
        """The micro-batches' losses without backward (evaluation; no gradient state is touched)."""
        losses = []
        for tokens, targets in micro_batches:
            losses.append(runner.forward(tokens, targets).detach())
            runner.release_all()
        return losses


def _spans(timer):
    """timer.span, or a do-nothing context when there is no timer."""
    return timer.span if timer is not None else (lambda kind, micro_batch=None: nullcontext())


@dataclass(frozen=True)
class Links:
    """This rank's pieces of the micro-batch tensors it exchanges with its neighbour stages
    (`handoff.py`): activations in from the previous stage (`prev_in`) and out to the next
    (`next_out`); their gradients in from the next stage (`next_in`) and out to the previous
    (`prev_out`). `rows`: this rank's micro-batch; `grad_scale`: dp of this stage / dp of the next.

    Each stage's parameter gradients are the gradients of its dp rank's own loss (the token mean
    over its `rows` samples), averaged over its dp group. The gradient arriving from the next stage
    is of the next stage's per-rank loss, dp_next / dp_this times this stage's; `grad_scale`
    converts it (1 with equal dp).
    """

    prev_in: tuple[Piece, ...] = ()
    prev_out: tuple[Piece, ...] = ()
    next_in: tuple[Piece, ...] = ()
    next_out: tuple[Piece, ...] = ()
    rows: int = 1
    grad_scale: float = 1.0
    channels: p2p.Channels | None = None  # the groups the messages travel on (None: the default)

    def streams(self, rank: int) -> list[tuple[int, int, int]]:
        """(kind, source, destination) global ranks of every message stream of this rank's."""
        acts = [(p2p.ACTIVATION, p.rank, rank) for p in self.prev_in] + [
            (p2p.ACTIVATION, rank, p.rank) for p in self.next_out
        ]
        grads = [(p2p.GRADIENT, p.rank, rank) for p in self.next_in] + [
            (p2p.GRADIENT, rank, p.rank) for p in self.prev_out
        ]
        return acts + grads


class PipelineSchedule:
    """Non-interleaved 1F1B on stage `stage` of `stages`.

    Warm-up: min(S − 1 − i, G) forwards; steady state: one forward, one backward; cool-down: the
    remaining backwards (`mist.rules.pipeline_order`, the order the simulator times). Each
    activation piece goes to its rank of the next stage and each piece of the input's gradient
    back to its rank of the previous stage (`links`), tagged by
    micro-batch and kind (a pair of ranks exchanges at most one piece per micro-batch and
    direction). Sends are non-blocking (`isend`), so that no two neighbours can block on each
    other's sends, and held as `p2p.Sends` says; receives block, piece by piece in row order. Every
    rank of a stage runs the same order of forwards and backwards, so the waits form the same
    acyclic pattern as between single-rank stages. The loss exists on the last stage only (its
    list; [] elsewhere).
    """

    def __init__(self, micro_batches: int, stage: int, stages: int, links: Links, device: torch.device):
        self.G, self.i, self.stages = micro_batches, stage, stages
        self.links = links
        self.device = torch.device(device)

    # ------------------------------------------------------------ p2p
    def streams(self, rank: int) -> list[tuple[int, int, int]]:
        return self.links.streams(rank)

    def _tag(self, g: int) -> p2p.Route:
        return p2p.Route(lambda kind: 3 * g + kind, self.links.channels)  # kind: p2p.HEAD, ACTIVATION, GRADIENT

    def _send_act(self, x: torch.Tensor, g: int, pending: list) -> None:
        p2p.send_activation(x, self.links.next_out, self._tag(g), self.device, pending)

    def _recv_act(self, g: int) -> torch.Tensor:
        return p2p.recv_activation(self.links.prev_in, self.links.rows, self._tag(g), self.device)

    def _recv_grad(self, out: torch.Tensor, g: int) -> torch.Tensor:
        return p2p.recv_gradient(out, self.links.next_in, self._tag(g), self.device, self.links.grad_scale)

    def _send_grad(self, gx: torch.Tensor, g: int, pending: list) -> None:
        p2p.send_gradient(gx, self.links.prev_out, self._tag(g), pending)

    # ------------------------------------------------------------ the step
    def run(
        self, runner: StageRunner, micro_batches, loss_scale: float = 1.0, timer: PhaseTimer | None = None
    ) -> list[torch.Tensor]:
        G, first, last = self.G, self.i == 0, self.i == self.stages - 1
        span = _spans(timer)
        sends = p2p.Sends()
        inflight: dict[int, tuple] = {}
        losses: list[torch.Tensor] = []

        def forward(g: int) -> None:
            self._forward(runner, micro_batches, g, span, sends, inflight, losses)

        def backward(g: int) -> None:
            x, out, act = inflight.pop(g)
            grad = None if last else self._recv_grad(out, g)
            with span("bwd", g):
                runner.begin_backward(g, last=g == G - 1)
                if last:
                    (out * (loss_scale / G)).backward()
                else:
                    torch.autograd.backward(out.edge, grad)
                runner.end_backward(act)
            if not first:
                self._send_grad(x.grad if x.grad is not None else torch.zeros_like(x), g, sends.gradient_list())

        for kind, g in one_f_one_b(self.i, self.stages, G):
            (forward if kind == FORWARD else backward)(g)
        sends.finish()
        return losses

    def _forward(
        self, runner: StageRunner, micro_batches, g: int, span, sends: p2p.Sends, inflight: dict, losses: list
    ):
        """Micro-batch g's forward: its input received (or its tokens), its output sent on (or its
        loss kept); `inflight[g]` = (input, output — once sent, a `p2p.SentOutput` — the activation
        bytes it saved)."""
        first, last = self.i == 0, self.i == self.stages - 1
        tokens, targets = micro_batches[g]
        x = tokens if first else self._recv_act(g)
        with span("fwd", g):
            before = runner.begin_forward()
            out = runner.forward(x, targets if last else None)
            act = runner.saved.memory.activations - before
        if last:
            losses.append(out.detach())
            inflight[g] = (x, out, act)
        else:
            self._send_act(out, g, sends.activation_list(g))
            inflight[g] = (x, sends.delivered(g, out), act)

    @torch.no_grad()
    def forward_only(self, runner: StageRunner, micro_batches) -> list[torch.Tensor]:
        """Every micro-batch forward through the pipeline, no backward (evaluation): the losses on
        the last stage, [] elsewhere."""
        first, last = self.i == 0, self.i == self.stages - 1
        pending: list = []
        losses: list[torch.Tensor] = []
        for g, (tokens, targets) in enumerate(micro_batches):
            x = tokens if first else self._recv_act(g)
            out = runner.forward(x, targets if last else None)
            if last:
                losses.append(out.detach())
            else:
                self._send_act(out, g, pending)
            runner.release_all()
        p2p.wait_all(pending)
        return losses
