"""Schedules: the order in which a stage runs the micro-batches' forwards and backwards.

`GradAccumSchedule` is the single-stage schedule: G micro-batches, each a forward then a backward,
gradients accumulated (and reduced by the units' hooks at the last one). A pipeline schedule
(1F1B over stages, with p2p of activations and gradients) is a sibling of this class with the
same `run` contract.
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
