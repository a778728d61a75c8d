"""The L4 profile against the original runtime's own operator timings (the L4 op-db), the
measurements its GEMM table, binary pointwise class and flash table are calibrated on
(`tools/profile_build/op_db.py`). The rows used are kept in `tests/data/l4-op-db-rows.json`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mist.hardware import load_profile

ROWS = json.loads((Path(__file__).resolve().parent / "data" / "l4-op-db-rows.json").read_text())
ELEM = 2  # fp16
L4_L2_BYTES = 48 * 2**20  # rows of fewer than twice these bytes are partly served from L2


def test_l4_gemm_reproduces_the_op_db_linear_layers():
    l4 = load_profile("l4")
    errs = []
    for r in ROWS["dense_gemms"]:
        (m, n, k), fwd, bwd = r["mnk"], r["fwd_s"], r["bwd_s"]
        errs.append(float(l4.gemm_time(m, n, k)) / fwd - 1)
        errs.append((float(l4.gemm_time(m, k, n)) + float(l4.gemm_time(n, k, m))) / bwd - 1)
    assert len(errs) == 40
    assert abs(np.median(errs)) < 0.02  # calibrated: no bias left
    assert np.median(np.abs(errs)) < 0.05
    assert "op-db" in l4.gemm.source


def test_l4_binary_class_reproduces_the_op_db_adds():
    l4 = load_profile("l4")
    checked = 0
    for r in ROWS["adds"]:
        nbytes = 3 * int(np.prod(r["shape"])) * ELEM  # two inputs + one output
        if nbytes > 2 * L4_L2_BYTES:
            assert float(l4.memory_op_time("add", nbytes)) == pytest.approx(r["fwd_s"], rel=0.1)
            checked += 1
    assert checked == 3


def test_l4_flash_reproduces_the_op_db_flash_attention():
    l4 = load_profile("l4")
    for r in ROWS["flash"]:
        b, s, _, heads, d = r["qkv"]
        assert float(l4.attention_time(b, heads, heads, s, d, True, False)) == pytest.approx(r["fwd_s"], rel=0.1)
        # calibrated on the median point; the smallest (b 1) backward is the farthest, +11 %
        assert float(l4.attention_time(b, heads, heads, s, d, True, True)) == pytest.approx(r["bwd_s"], rel=0.15)
