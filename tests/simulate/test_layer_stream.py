"""Blocks run back to back: n of them cost (n − 1)·max(H, K) + S, which is exactly the host/GPU
stream model (`stream_time`) over their kernels concatenated n times — the host runs ahead across
block boundaries instead of meeting the GPU at every block."""

import numpy as np
import pytest

from mist.analysis import analyze_layer
from mist.analysis.records import COLLECTIVE
from mist.hardware import load_profile
from mist.simulate.estimate import estimate
from mist.simulate.layer_cost import kernel_time, phase_time, stream_of
from mist.specs.presets import get_preset


def _kernels(prof, la, ph, b, s):
    ops = la.op_values(ph, np.array([float(b)]), np.array([float(s)]))
    return np.array([float(np.ravel(kernel_time(prof, op, ph == "bwd"))[0]) for op in ops if op.kind != COLLECTIVE])


@pytest.mark.parametrize("model,b", [("llama-1.3b", 1), ("gpt3-1.3b", 1), ("llama3-8b", 4)])
@pytest.mark.parametrize("ph", ["fwd", "bwd"])
def test_closed_form_is_the_stream_over_repeated_blocks(model, b, ph):
    prof = load_profile("h200")
    la = analyze_layer(get_preset(model), "block", tp=1, flash=True, dtype="bf16", target="cuda")
    pt = phase_time(prof, None, la, ph, b, 2048)
    k = _kernels(prof, la, ph, b, 2048)
    assert float(pt.compute) == pytest.approx(float(prof.stream_time(k[None, :], ph == "bwd")[0]), rel=1e-12)
    for n in (1, 2, 7, 24):
        brute = float(prof.stream_time(np.tile(k, n)[None, :], ph == "bwd")[0])
        assert float(stream_of(n, pt)) == pytest.approx(brute, rel=1e-9)
    assert -prof.host.per_op(ph == "bwd") <= float(pt.lead) < float(pt.compute)


def test_blocks_that_leave_the_gpu_waiting_alone_are_cheaper_together():
    prof = load_profile("h200")
    # at b = 1, s = 1024 its forward alternates host- and GPU-bound stretches
    spec = get_preset("llama-1.3b")
    la = analyze_layer(spec, "block", tp=1, flash=True, dtype="bf16", target="cuda")
    pt = phase_time(prof, None, la, "fwd", 1, 1024)
    assert float(pt.lead) > 0.05 * float(pt.compute)
    est = estimate(spec, prof, 1024, 1)
    L, tb = spec.num_layers, est.model.time_breakdown
    assert tb["blocks_fwd_ms"] < 0.9 * L * est.layer.fwd_compute_ms
    assert tb["blocks_fwd_ms"] == pytest.approx(float(stream_of(L, pt)) * 1e3)
