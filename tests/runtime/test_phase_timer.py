"""`PhaseTimer` sums each micro-batch's spans: a zero-bubble backward is timed as its input-gradient
(B) and weight-gradient (W) passes, an interleaved stage's as one span per chunk, and the stage's
T and D (what `mist validate` puts next to the simulator's) must count the whole backward."""

import time

import pytest
import torch

from mist.rules.interleaved_order import interleaved_one_f_one_b
from mist.rules.zero_bubble_order import FORWARD, INPUT_GRAD, zb_h1
from mist.runtime.phase_timer import PhaseTimer, stage_times

F_S, B_S, W_S = 0.01, 0.02, 0.03  # seconds of work per pass


def _work(timer: PhaseTimer, kind: str, g: int, seconds: float) -> None:
    with timer.span(kind, g):
        time.sleep(seconds)


def test_zero_bubble_stage_counts_both_backward_passes():
    G = 4
    timer = PhaseTimer(torch.device("cpu"))
    for kind, g in zb_h1(1, 2, G):  # the last of two stages: W's deferred behind later B's
        if kind == FORWARD:
            _work(timer, "fwd", g, F_S)
        else:
            _work(timer, "bwd", g, B_S if kind == INPUT_GRAD else W_S)
    spans = timer.seconds()
    assert len(spans["fwd"]) == len(spans["bwd"]) == G
    T, _ = stage_times(spans["fwd"], spans["bwd"], 0.0)
    # sleeps only overrun, never fall short: T holds F + B + W (F + one of the passes is at most
    # F + W = 0.04 s plus overruns, a bound a busy machine could pass; this lower bound it cannot)
    assert T >= F_S + B_S + W_S
    # each micro-batch's backward holds both of its passes
    assert all(b >= B_S + W_S for b in spans["bwd"])


def test_interleaved_stage_sums_its_chunks():
    G, v = 4, 2
    timer = PhaseTimer(torch.device("cpu"))
    for kind, g, _chunk in interleaved_one_f_one_b(0, 2, v, G):
        _work(timer, "fwd" if kind == FORWARD else "bwd", g, F_S if kind == FORWARD else B_S)
    spans = timer.seconds()
    assert len(spans["fwd"]) == len(spans["bwd"]) == G
    T, _ = stage_times(spans["fwd"], spans["bwd"], 0.0)
    assert T >= v * (F_S + B_S)  # every chunk of the micro-batch (sleeps only overrun)


def test_spans_of_no_micro_batch_stay_apart():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.span("opt"):
            pass
    assert len(timer.seconds()["opt"]) == 2
    timer.reset()
    assert timer.seconds() == {"fwd": [], "bwd": [], "wgrad": [], "opt": []}


@pytest.mark.parametrize("G", [1, 3])
def test_stage_times_split(G):
    fwd = [0.5] + [0.2] * (G - 1)
    bwd = [0.3] * (G - 1) + [0.6]
    T, D = stage_times(fwd, bwd, 0.1)
    if G == 1:
        assert (T, D) == pytest.approx((1.2, 0.0))
    else:
        assert (T, D) == pytest.approx((0.5, 0.3 + 0.3 + 0.1))
