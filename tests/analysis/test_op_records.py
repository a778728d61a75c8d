"""Traced operators are frozen records: each kind's cost parameters are a typed record (sympy in
b and s when traced, numpy arrays once `op_values` evaluates them), and they survive the disk
cache's pickling."""

import pickle
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from mist.analysis import analyze_layer
from mist.analysis.records import (
    ATTENTION,
    COLLECTIVE,
    GEMM,
    MEMORY,
    AttentionParams,
    B,
    CollectiveParams,
    GemmParams,
    OpValues,
    S,
)
from mist.specs.presets import get_preset

PARAMS = {GEMM: GemmParams, ATTENTION: AttentionParams, COLLECTIVE: CollectiveParams}


@pytest.fixture(scope="module")
def la():
    return analyze_layer(get_preset("llama-1.3b"), "block", tp=2, flash=True, dtype="bf16", target="cuda")


def test_each_kind_has_its_parameter_record(la):
    assert {GEMM, ATTENTION, COLLECTIVE, MEMORY} <= {r.kind for r in la.records}
    for r in la.records:
        kind = PARAMS.get(r.kind)
        assert r.params is None if kind is None else isinstance(r.params, kind)
    with pytest.raises(FrozenInstanceError):
        la.records[0].kind = MEMORY


def test_op_values_evaluate_the_symbolic_parameters(la):
    b, s = np.array([1.0, 2.0]), np.array([512.0, 1024.0])
    ops = la.op_values("fwd", b, s)
    assert ops and all(isinstance(op, OpValues) for op in ops)
    symbolic = [r for r in la.ops("fwd")]
    for op, r in zip(ops, symbolic):
        assert (op.op, op.kind) == (r.op, r.kind)
        at = [float(r.bytes_moved.subs({B: bb, S: ss})) for bb, ss in zip(b, s)]
        assert np.allclose(op.bytes_moved, at, rtol=1e-12)
        if op.kind == GEMM:
            assert np.allclose(op.params.m, [float(r.params.m.subs({B: bb, S: ss})) for bb, ss in zip(b, s)])
        if op.kind == ATTENTION:
            assert op.params.causal is r.params.causal and np.allclose(op.params.s, s)
        if op.kind == COLLECTIVE:
            assert op.params.group == r.params.group == 2


def test_records_survive_pickling(la):
    again = pickle.loads(pickle.dumps(la))
    assert again.records == la.records
