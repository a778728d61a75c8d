"""Per micro-batch compute time of one rank: each forward and each backward of a step (waits for
activations or gradients from neighbour stages excluded), and the optimizer step.

From them `stage_times` derives what the simulator predicts per stage: the steady time T of a
micro-batch (the median forward of micro-batches 2…G plus the median backward of 1…G−1) and the
one-off extra D of an iteration (the first forward's and the last backward's excess over those
medians, plus the optimizer step — the simulator books the step lazily into the first forward).
With G = 1 the two cannot be told apart: T is the whole micro-batch with the step, D is 0, as in
the simulator. CPU: `perf_counter` around synchronous work; CUDA: events, read at the step's end.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = {"fwd": [], "bwd": [], "opt": []}

    def reset(self) -> None:
        self.spans = {"fwd": [], "bwd": [], "opt": []}

    @contextmanager
    def span(self, kind: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self.spans[kind].append((a, b))
        else:
            t0 = time.perf_counter()
            yield
            self.spans[kind].append(time.perf_counter() - t0)

    def seconds(self) -> dict[str, list[float]]:
        """The step's spans in seconds (on CUDA after synchronizing)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {k: [a.elapsed_time(b) * 1e-3 for a, b in v] for k, v in self.spans.items()}
        return {k: list(v) for k, v in self.spans.items()}


def stage_times(fwd: list[float], bwd: list[float], opt: float) -> tuple[float, float]:
    """(T, D) of one step from its per-micro-batch forward/backward times (in micro-batch order)."""
    G = len(fwd)
    if G == 0:
        return 0.0, 0.0
    if G == 1:
        return fwd[0] + bwd[0] + opt, 0.0
    tf, tb = statistics.median(fwd[1:]), statistics.median(bwd[:-1])
    return tf + tb, (fwd[0] - tf) + (bwd[-1] - tb) + opt
