"""The L4 profile against the original runtime's own operator timings (`gpus/l4/op-db`), the
measurements its GEMM table, binary pointwise class and flash table are calibrated on
(`tools/profile_build/op_db.py`). Needs the measurement data set; skipped without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mist.hardware import load_profile

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # raw data, if present
OP_DB = DATA / "gpus" / "l4" / "op-db"
TOOLS = Path(__file__).resolve().parents[1] / "tools"
pytestmark = pytest.mark.skipif(not OP_DB.is_dir(), reason="shared measurement data not available")


@pytest.fixture(scope="module")
def op_db():
    import sys

    sys.path.insert(0, str(TOOLS))
    from profile_build import op_db

    return op_db


def test_l4_gemm_reproduces_the_op_db_linear_layers(op_db):
    l4 = load_profile("l4")
    errs = []
    for (m, n, k), fwd, bwd in op_db.dense_gemms(OP_DB):
        errs.append(float(l4.gemm_time(m, n, k)) / fwd - 1)
        errs.append((float(l4.gemm_time(m, k, n)) + float(l4.gemm_time(n, k, m))) / bwd - 1)
    assert len(errs) == 40
    assert abs(np.median(errs)) < 0.02  # calibrated: no bias left
    assert np.median(np.abs(errs)) < 0.05
    assert "op-db" in l4.gemm.source


def test_l4_binary_class_reproduces_the_op_db_adds(op_db):
    l4 = load_profile("l4")
    checked = 0
    for stem in op_db.ADDS:
        for shapes, fwd, _ in op_db.rows(OP_DB, stem):
            nbytes = 3 * int(np.prod(next(iter(shapes.values())))) * op_db.ELEM
            if nbytes > 2 * op_db.L4_L2_BYTES:
                assert float(l4.memory_op_time("add", nbytes)) == pytest.approx(fwd, rel=0.1)
                checked += 1
    assert checked == 3


def test_l4_flash_reproduces_the_op_db_flash_attention(op_db):
    l4 = load_profile("l4")
    for shapes, fwd, bwd in op_db.rows(OP_DB, "mist.modules.flash_attn.flash_attn_qkvpacked_func"):
        b, s, _, heads, d = shapes["qkv"]
        assert float(l4.attention_time(b, heads, heads, s, d, True, False)) == pytest.approx(fwd, rel=0.1)
        # calibrated on the median point; the smallest (b 1) backward is the farthest, +11 %
        assert float(l4.attention_time(b, heads, heads, s, d, True, True)) == pytest.approx(bwd, rel=0.15)
