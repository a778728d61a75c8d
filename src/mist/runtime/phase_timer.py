"""Per micro-batch compute time of one rank: each forward and each backward of a step (waits for
activations or gradients from neighbour stages excluded), and the optimizer step.

A micro-batch's forward or backward may run in several spans: one per model chunk of an
interleaved stage, and the input-gradient (B) and weight-gradient (W) passes of a zero-bubble
backward. Spans carry their micro-batch, and `seconds` sums each micro-batch's spans, so that a
stage's forward and backward are whole in every schedule (as the simulator's stage times are).

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
        self.reset()

    def reset(self) -> None:
        # kind -> [(micro-batch or None, the span: seconds on CPU, a pair of events on CUDA)]
        # ("wgrad": a ZB-H1 stage's W passes, also inside its "bwd")
        self.spans: dict[str, list] = {"fwd": [], "bwd": [], "wgrad": [], "opt": []}

    @contextmanager
    def span(self, kind: str, micro_batch: int | None = None):
        """Time the block as part of `micro_batch`'s `kind` (None: a span of its own)."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self.spans[kind].append((micro_batch, (a, b)))
        else:
            t0 = time.perf_counter()
            yield
            self.spans[kind].append((micro_batch, time.perf_counter() - t0))

    def seconds(self) -> dict[str, list[float]]:
        """The step's times in seconds (on CUDA after synchronizing): per kind, one per micro-batch
        in micro-batch order (the sum of its spans), then the spans of no micro-batch in turn."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for kind, spans in self.spans.items():
            per: dict[int, float] = {}
            alone = []
            for g, v in spans:
                t = v[0].elapsed_time(v[1]) * 1e-3 if self.cuda else v
                if g is None:
                    alone.append(t)
                else:
                    per[g] = per.get(g, 0.0) + t
            out[kind] = [per[g] for g in sorted(per)] + alone
        return out


def stage_times(fwd: list[float], bwd: list[float], opt: float) -> tuple[float, float]:
    """(T, D) of one step from its per-micro-batch forward/backward times (in micro-batch order)."""
    G = len(fwd)
    if G == 0:
        return 0.0, 0.0
    if G == 1:
        return fwd[0] + bwd[0] + opt, 0.0
    tf, tb = statistics.median(fwd[1:]), statistics.median(bwd[:-1])
    return tf + tb, (fwd[0] - tf) + (bwd[-1] - tb) + opt


def weight_grad_time(wgrad: list[float]) -> float | None:
    """A ZB-H1 stage's steady W time of one micro-batch (None without W spans): the median over
    micro-batches 1…G−1, as T's backward (the last W also closes the step's gradients)."""
    if not wgrad:
        return None
    return statistics.median(wgrad[:-1]) if len(wgrad) > 1 else wgrad[0]
