"""Interleaved 1F1B in the runtime: a rank holds v model chunks and runs Megatron-LM's order.

`ChunkedStageModule` holds the rank's v chunks, each a `StageModule` of its own blocks (the
embedding on the model's first chunk, the head on its last), and shows the trainer one stage:
its units in chunk order — named "embedding", "blocks.k" (the rank's k-th block over all chunks)
and "head" — and their full model names. `ChunkRunners` are one `StageRunner` per chunk over that
chunk's units, so a chunk's units see the start of a micro-batch's backward (and, at the chunk's
last micro-batch, do their gradient reduction) when that chunk's backward runs.
`InterleavedSchedule` runs `rules.interleaved_order` — the order the simulator times — with p2p
between consecutive chunks: chunk c of rank r sends to rank r + 1's chunk c, the last rank's
chunk c to rank 0's chunk c + 1, and gradients come back the same way. Messages are tagged by
micro-batch, the sending chunk's place in the model and kind. As in `PipelineSchedule`, sends are
non-blocking and receives block in the rank's order; a send is waited for where
`rules.interleaved_sends.send_waits` says (an output a few operations after its forward, its data
then freed as `PipelineSchedule` frees it; an input gradient before a receive its receiver sends
after taking it), waits that play through as rendezvous, and the rest at the end of the step.

PyTorch's `torch.distributed.pipelining.ScheduleInterleaved1F1B` is not used: it drives its own
`PipelineStage` modules and gradient handling, while here each chunk's forward and backward must
go through the runtime's flat units (ZeRO, offload, in-place accumulation, the reductions at a
chunk's last micro-batch), which a schedule of our own can call directly.
"""

from __future__ import annotations

import torch
from torch import nn

from mist.models import TPGroup
from mist.plan import Plan
from mist.rules.interleaved_order import chunk_first_layers, chunk_recompute, interleaved_one_f_one_b
from mist.rules.interleaved_sends import send_waits
from mist.rules.pipeline_order import FORWARD
from mist.runtime import p2p
from mist.runtime.flat import FlatUnit
from mist.runtime.handoff import Piece, incoming, outgoing
from mist.runtime.layout import RankGroups
from mist.runtime.phase_timer import PhaseTimer
from mist.runtime.schedule import Links, _spans
from mist.runtime.stage_runner import StageModule, StageRunner


class ChunkedStageModule(nn.Module):
    """A rank's v chunks, seen by the trainer as one stage (see the module docstring)."""

    def __init__(self, plan: Plan, rank: int, tp: TPGroup, flash: bool, dtype=torch.float32, device="cpu"):
        super().__init__()
        S, v, spec = plan.num_stages, plan.virtual_stages, plan.model
        firsts = chunk_first_layers([s.chunks() for s in plan.stages])[rank]
        layers = plan.stages[rank].chunks()
        self.spec, self.first, self.last = spec, rank == 0, rank == S - 1
        self.chunks = nn.ModuleList(
            StageModule(
                spec,
                tp,
                flash,
                rank == 0 and c == 0,
                rank == S - 1 and c == v - 1,
                layers[c],
                firsts[c],
                dtype=dtype,
                device=device,
            )
            for c in range(v)
        )
        # the rank's k-th block: (chunk, index in the chunk)
        self._block = [(c, j) for c in range(v) for j in range(layers[c])]

    @property
    def embedding(self):
        return self.chunks[0].embedding

    @property
    def head(self):
        return self.chunks[-1].head

    def full_name(self, local_name: str) -> str:
        """The model's name of a parameter named by this module ("chunks.c.…") or by a unit prefix
        of `unit_modules` ("embedding…", "blocks.k…", "head…")."""
        head, _, rest = local_name.partition(".")
        if head == "chunks":
            c, _, rest = rest.partition(".")
            return self.chunks[int(c)].full_name(rest)
        if head == "blocks":
            k, _, rest = rest.partition(".")
            c, j = self._block[int(k)]
            return self.chunks[c].full_name(f"blocks.{j}" + (f".{rest}" if rest else ""))
        return self.chunks[0 if head == "embedding" else -1].full_name(local_name)

    def unit_modules(self) -> list[tuple[str, nn.Module]]:
        """(prefix, module) of every unit, chunk by chunk, in forward order within a chunk."""
        out: list[tuple[str, nn.Module]] = []
        k = 0
        for m in self.chunks:
            for prefix, mod in m.unit_modules():
                if prefix.startswith("blocks."):
                    prefix, k = f"blocks.{k}", k + 1
                out.append((prefix, mod))
        return out

    def owners(self) -> dict[int, list[tuple[nn.Module, str]]]:
        own: dict[int, list] = {}
        for m in self.chunks:
            for key, val in m.owners().items():
                own.setdefault(key, []).extend(val)
        return own


class ChunkRunners(list):
    """One `StageRunner` per chunk, over the chunk's units (a list, in chunk order)."""

    @classmethod
    def build(
        cls, module: ChunkedStageModule, units: list[FlatUnit], stage, saved, autocast, compiled: bool = False
    ) -> ChunkRunners:
        rec = chunk_recompute(stage.recompute_layers, stage.chunks())
        out, at = cls(), 0
        for c, m in enumerate(module.chunks):
            n = len(m.unit_modules())
            out.append(
                StageRunner(
                    m,
                    units[at : at + n],
                    rec[c],
                    stage.recompute_attention,
                    stage.recompute_activation,
                    stage.offload.activations,
                    saved,
                    autocast,
                    compiled=compiled,
                )
            )
            at += n
        return out


def chunk_links(groups: RankGroups, v: int, rows: int) -> list[tuple[Links, int, int]]:
    """Per chunk of this rank: its `Links` and the model positions (p·c + r) of the chunks it
    receives from and sends to (−1: none)."""
    S, r = len(groups.stages), groups.stage.index
    me, dp_rank, tp_rank, cp_rank = groups.stage, groups.data_rank, groups.tp_rank, groups.cp_rank
    out = []
    for c in range(v):
        k = c * S + r
        prev = groups.stages[(r - 1) % S] if k > 0 else None
        nxt = groups.stages[(r + 1) % S] if k < S * v - 1 else None
        links = Links(
            prev_in=tuple(incoming(me, dp_rank, tp_rank, prev, cp_rank)) if prev else (),
            prev_out=tuple(outgoing(me, dp_rank, tp_rank, prev, cp_rank)) if prev else (),
            next_in=tuple(incoming(me, dp_rank, tp_rank, nxt, cp_rank)) if nxt else (),
            next_out=tuple(outgoing(me, dp_rank, tp_rank, nxt, cp_rank)) if nxt else (),
            rows=rows,
            grad_scale=me.dp / nxt.dp if nxt else 1.0,
            channels=groups.channels,
        )
        out.append((links, k - 1 if prev else -1, k + 1 if nxt else -1))
    return out


class InterleavedSchedule:
    """Interleaved 1F1B on rank `stage` of `stages` with v chunks (see the module docstring); the
    same `run` / `forward_only` contract as `PipelineSchedule`, with `ChunkRunners` as runner."""

    def __init__(self, micro_batches: int, stage: int, stages: int, links: list, device: torch.device):
        self.G, self.i, self.stages, self.v = micro_batches, stage, stages, len(links)
        self.links = links
        self.device = torch.device(device)

    def streams(self, rank: int) -> list[tuple[int, int, int]]:
        return [s for links, _, _ in self.links for s in links.streams(rank)]

    def _tag(self, g: int, boundary: int) -> p2p.Route:
        # boundary: the model position of the chunk that sends the activation (receives the gradient)
        tag = lambda kind: 3 * (g * self.stages * self.v + boundary) + kind  # noqa: E731 (p2p.HEAD, ACTIVATION, GRADIENT)
        return p2p.Route(tag, self.links[0][0].channels)

    def _send_act(self, x: torch.Tensor, pieces: tuple[Piece, ...], g: int, k: int, pending: list) -> None:
        p2p.send_activation(x, pieces, self._tag(g, k), self.device, pending)

    def _recv_act(self, links: Links, g: int, k: int) -> torch.Tensor:
        return p2p.recv_activation(links.prev_in, links.rows, self._tag(g, k), self.device)

    def _recv_grad(self, links: Links, out: torch.Tensor, g: int, k: int) -> torch.Tensor:
        return p2p.recv_gradient(out, links.next_in, self._tag(g, k), self.device, links.grad_scale)

    def _send_grad(self, gx: torch.Tensor, links: Links, g: int, k: int, pending: list) -> None:
        p2p.send_gradient(gx, links.prev_out, self._tag(g, k), pending)

    def run(
        self, runners: ChunkRunners, micro_batches, loss_scale: float = 1.0, timer: PhaseTimer | None = None
    ) -> list[torch.Tensor]:
        G = self.G
        span = _spans(timer)
        # (the last rank's activations wrap around to the first: ranks can wait on each other, so
        # sends are waited for where `rules.interleaved_sends.send_waits` says, which plays through)
        sends = p2p.Sends(hold_gradients=True)
        waits = send_waits(self.stages, self.v, G)[self.i]
        inflight: dict[tuple[int, int], tuple] = {}
        losses: list[torch.Tensor] = []

        def settle(op: tuple[str, int, int]) -> None:
            """The waits due before `op`: an output once waited for is kept as its edge only."""
            sends.release_gradients(waits.gradients.get(op, ()))
            for key in waits.outputs.get(op, ()):
                x, out, act = inflight[key]
                inflight[key] = (x, sends.delivered(key, out), act)

        def forward(g: int, c: int) -> None:
            links, src, dst = self.links[c]
            runner = runners[c]
            tokens, targets = micro_batches[g]
            x = tokens if src < 0 else self._recv_act(links, g, src)
            with span("fwd", g):
                before = runner.begin_forward()
                out = runner.forward(x, targets if dst < 0 else None)
                act = runner.saved.memory.activations - before
            if dst < 0:
                losses.append(out.detach())
            else:
                self._send_act(out, links.next_out, g, dst - 1, sends.activation_list((g, c)))
            inflight[g, c] = (x, out, act)

        def backward(g: int, c: int) -> None:
            links, src, dst = self.links[c]
            runner = runners[c]
            x, out, act = inflight.pop((g, c))
            grad = None if dst < 0 else self._recv_grad(links, out, g, dst - 1)
            sends.release_activation((g, c))  # (unless `send_waits` waited for it already)
            with span("bwd", g):
                runner.begin_backward(g, last=g == G - 1)
                if dst < 0:
                    (out * (loss_scale / G)).backward()
                else:
                    torch.autograd.backward(out.edge if isinstance(out, p2p.SentOutput) else out, grad)
                runner.end_backward(act)
            if src >= 0:
                self._send_grad(
                    x.grad if x.grad is not None else torch.zeros_like(x), links, g, src, sends.gradient_list((g, c))
                )

        for kind, g, c in interleaved_one_f_one_b(self.i, self.stages, self.v, G):
            settle((kind, g, c))
            (forward if kind == FORWARD else backward)(g, c)
        sends.finish()
        return losses

    @torch.no_grad()
    def forward_only(self, runners: ChunkRunners, micro_batches) -> list[torch.Tensor]:
        """Every micro-batch forward through every chunk, no backward (evaluation): the losses on
        the rank holding the model's last chunk, [] elsewhere. Every rank takes (micro-batch,
        chunk) in the same order, so each receive's sender is already past it."""
        pending: list = []
        losses: list[torch.Tensor] = []
        for g, (tokens, targets) in enumerate(micro_batches):
            for c, runner in enumerate(runners):
                links, src, dst = self.links[c]
                x = tokens if src < 0 else self._recv_act(links, g, src)
                out = runner.forward(x, targets if dst < 0 else None)
                if dst < 0:
                    losses.append(out.detach())
                else:
                    self._send_act(out, links.next_out, g, dst - 1, pending)
                runner.release_all()
        p2p.wait_all(pending)
        return losses
