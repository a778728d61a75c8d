"""Schedules: the order in which a stage runs the micro-batches' forwards and backwards.

`GradAccumSchedule` is the single-stage schedule: G micro-batches, each a forward then a backward,
gradients accumulated (and reduced by the units' hooks at the last one). `PipelineSchedule` is
its multi-stage sibling with the same `run` contract: non-interleaved 1F1B, with p2p of
activations and gradients between neighbouring stages.
"""

from __future__ import annotations

import torch

from mist.runtime.stage import StageRunner


class GradAccumSchedule:
    def __init__(self, micro_batches: int):
        self.G = micro_batches

    def run(self, runner: StageRunner, micro_batches, loss_scale: float = 1.0) -> list[torch.Tensor]:
        """Run one step's micro-batches [(tokens, targets)]; return their (detached) losses.

        Each micro-batch loss is a token mean; the step's loss is their mean, so each backward
        is scaled by 1/G (and by the fp16 loss scale).
        """
        losses = []
        for g, (tokens, targets) in enumerate(micro_batches):
            runner.start_micro_batch(g, last=g == self.G - 1)
            loss = runner.forward(tokens, targets)
            (loss * (loss_scale / self.G)).backward()
            runner.finish_micro_batch()
            losses.append(loss.detach())
        return losses


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8          # ndim, dims…, dtype code (int64)


class PipelineSchedule:
    """Non-interleaved 1F1B on stage `stage` of `stages`.

    Warm-up: min(S − 1 − i, G) forwards; steady state: one forward, one backward; cool-down: the
    remaining backwards. Activations go to the rank at the same (dp, tp) position of the next stage
    (`next_rank`), gradients of the stage input back to `prev_rank`. Sends are non-blocking
    (`isend`, waited for at the end of the step) so that no two neighbours can block on each other's
    sends; receives block. The loss exists on the last stage only (its list; [] elsewhere).
    """

    def __init__(self, micro_batches: int, stage: int, stages: int, prev_rank: int | None,
                 next_rank: int | None, device: torch.device):
        self.G, self.i, self.S = micro_batches, stage, stages
        self.prev, self.next = prev_rank, next_rank
        self.device = torch.device(device)

    # ------------------------------------------------------------ p2p
    def _tag(self, g: int, kind: int) -> int:
        return 3 * g + kind          # 0: header, 1: activation, 2: gradient

    def _send_act(self, x: torch.Tensor, g: int, pending: list) -> None:
        import torch.distributed as dist

        head = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        head[0] = x.dim()
        head[1:1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        head[_HEADER - 1] = _DTYPES.index(x.dtype)
        x = x.detach().contiguous()
        pending.append((dist.isend(head, self.next, tag=self._tag(g, 0)), head))
        pending.append((dist.isend(x, self.next, tag=self._tag(g, 1)), x))

    def _recv_act(self, g: int) -> torch.Tensor:
        import torch.distributed as dist

        head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(head, self.prev, tag=self._tag(g, 0))
        h = head.tolist()
        x = torch.empty(h[1:1 + h[0]], dtype=_DTYPES[h[_HEADER - 1]], device=self.device)
        dist.recv(x, self.prev, tag=self._tag(g, 1))
        return x.requires_grad_(x.is_floating_point())

    # ------------------------------------------------------------ the step
    def run(self, runner: StageRunner, micro_batches, loss_scale: float = 1.0) -> list[torch.Tensor]:
        import torch.distributed as dist

        G, first, last = self.G, self.i == 0, self.i == self.S - 1
        pending: list = []
        inflight: dict[int, tuple] = {}
        losses: list[torch.Tensor] = []

        def forward(g: int) -> None:
            tokens, targets = micro_batches[g]
            x = tokens if first else self._recv_act(g)
            before = runner.begin_forward()
            out = runner.forward(x, targets if last else None)
            act = runner.saved.memory.activations - before
            if last:
                losses.append(out.detach())
            else:
                self._send_act(out, g, pending)
            inflight[g] = (x, out, act)

        def backward(g: int) -> None:
            x, out, act = inflight.pop(g)
            runner.begin_backward(g, last=g == G - 1)
            if last:
                (out * (loss_scale / G)).backward()
            else:
                grad = torch.empty(out.shape, dtype=out.dtype, device=self.device)
                dist.recv(grad, self.next, tag=self._tag(g, 2))
                torch.autograd.backward(out, grad)
            runner.end_backward(act)
            if not first:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                pending.append((dist.isend(gx.contiguous(), self.prev, tag=self._tag(g, 2)), gx))

        warm = min(self.S - 1 - self.i, G)
        for g in range(warm):
            forward(g)
        for k in range(G - warm):
            forward(warm + k)
            backward(k)
        for g in range(G - warm, G):
            backward(g)
        for work, _ in pending:
            work.wait()
        return losses
