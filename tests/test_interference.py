"""Interference estimator (the Mist paper's progressive overlap), shipped overlap fits, and the
DP / cross-node link model."""

import numpy as np
import pytest

from mist.hardware.dp_links import collective_time, load_dp_links
from mist.hardware.interference import (
    N_FACTORS,
    SUBSETS,
    InterferenceModel,
    load_interference,
    load_overlap_doc,
    overlap_time,
    pairwise_additive,
    subset_key,
)
from raw_data import RAW_DATA, TOOLS, needs_raw_data

FITTED = ("l4", "a100-sxm4-40gb", "v100-sxm2-16gb")


# ---- estimator --------------------------------------------------------------------------------


def test_formulas_vector_1():
    m = InterferenceModel({"C+G2G": [1.2, 1.0]}, "test vector")
    assert float(overlap_time([6, 8, 0, 0], m)) == pytest.approx(8.0, abs=1e-12)


def test_formulas_vector_2():
    m = InterferenceModel(
        {"C+G2G+C2G+G2C": [1.3, 1.0, 2.1, 2.1], "G2G+C2G+G2C": [1.0, 1.3, 1.3], "C2G+G2C": [1.25, 1.26]}, "test vector"
    )
    t = float(overlap_time([5, 8, 6, 7], m))
    assert round(t, 4) == 11.2025


def _random_x(rng, shape):
    x = rng.uniform(0.1, 20.0, size=shape + (4,))
    return x * (rng.random(shape + (4,)) > 0.3)  # some idle channels


def test_perfect_is_max_and_serial_is_sum():
    rng = np.random.default_rng(0)
    x = _random_x(rng, (500,))
    np.testing.assert_allclose(overlap_time(x, InterferenceModel.perfect()), x.max(-1), rtol=1e-12)
    np.testing.assert_allclose(overlap_time(x, InterferenceModel.serial()), x.sum(-1), rtol=1e-12)
    for v in ([3, 3, 3, 3], [1, 2, 3, 4], [0, 5, 0, 2], [7, 0, 0, 0], [0, 0, 0, 0]):
        assert float(overlap_time(v, InterferenceModel.serial())) == pytest.approx(sum(v))
        assert float(overlap_time(v, InterferenceModel.perfect())) == pytest.approx(max(v))


def test_bounds_for_factors_at_least_one():
    rng = np.random.default_rng(1)
    x = _random_x(rng, (300,))
    m = InterferenceModel.from_vector(rng.uniform(1.0, 1.9, N_FACTORS), "random ≤ 2")
    t = overlap_time(x, m)
    assert np.all(t >= x.max(-1) - 1e-12)


def test_vectorized_shapes_and_rowwise_agreement():
    rng = np.random.default_rng(2)
    m = load_interference("l4")
    x = _random_x(rng, (2, 3, 5))
    t = overlap_time(x, m)
    assert t.shape == (2, 3, 5)
    flat = np.array([float(overlap_time(v, m)) for v in x.reshape(-1, 4)])
    np.testing.assert_allclose(t.ravel(), flat, rtol=1e-12)
    assert np.shape(overlap_time([1.0, 2.0, 0.0, 0.0], m)) == ()
    with pytest.raises(ValueError):
        overlap_time(np.ones((3, 5)), m)
    with pytest.raises(ValueError):
        overlap_time([-1.0, 1.0, 0.0, 0.0], m)


def test_model_json_roundtrip_and_layout():
    assert len(SUBSETS) == 11 and N_FACTORS == 28
    m = load_interference("v100-sxm2-16gb")
    m2 = InterferenceModel.from_json(m.to_json())
    np.testing.assert_allclose(m.vector(), m2.vector())
    assert m2.provenance == m.provenance
    np.testing.assert_allclose(InterferenceModel.from_vector(m.vector(), "x").vector(), m.vector())
    with pytest.raises(ValueError):
        InterferenceModel({"C+G2G": [1.0]}, "wrong length")


def test_pairwise_additive_composition():
    serial_pairs = {subset_key(s): [2.0, 2.0] for s in SUBSETS[:6]}
    np.testing.assert_allclose(pairwise_additive(serial_pairs, "").vector(), InterferenceModel.serial().vector())
    perfect_pairs = {subset_key(s): [1.0, 1.0] for s in SUBSETS[:6]}
    np.testing.assert_allclose(pairwise_additive(perfect_pairs, "").vector(), 1.0)


# ---- shipped fits and fallbacks -----------------------------------------------------------------


@pytest.mark.parametrize("gpu", FITTED)
def test_fitted_factors_beat_baselines(gpu):
    m = load_interference(gpu)
    assert m.provenance.startswith("measured")
    assert m.vector().shape == (28,) and np.all((m.vector() >= 1.0) & (m.vector() <= 50.0))
    e = load_overlap_doc(gpu)["fit_errors"]
    for stat in ("median", "mean"):
        assert e["fitted"][stat] < e["serial_sum"][stat]
        assert e["fitted"][stat] < e["max"][stat]
        assert e["leave_one_layout_out"][stat] < e["serial_sum"][stat]
    assert e["fitted"]["median"] < 0.08


def test_fallbacks_are_labelled():
    h = load_interference("H200")
    assert "fallback" in h.provenance and "system.json" in h.provenance
    assert h.factors["C+C2G"][0] == 1.0  # measured 0.98 clamped to 1
    assert h.factors["C2G+G2C"] == pytest.approx([23.8899 / 19.5639, 23.8899 / 19.4266])
    other = load_interference("a10g")
    assert "fallback" in other.provenance
    np.testing.assert_allclose(other.vector(), InterferenceModel.serial().vector())


def test_h200_fallback_reads_its_data_file(monkeypatch):
    import json
    from importlib import resources

    import mist.hardware.interference as interference

    doc = json.loads((resources.files("mist.hardware") / "overlap" / "_h200-pairs.json").read_text())
    assert "measured" in doc["provenance"] and "H200" in doc["provenance"]
    assert doc["defaults"]["provenance"].startswith("assumed")
    pairs = doc["pairs"]
    assert [pairs["gemm_vs_h2d"][k] for k in ("gemm_slowdown", "copy_slowdown")] == [0.9766, 1.0063]
    assert [pairs["gemm_vs_d2h"][k] for k in ("gemm_slowdown", "copy_slowdown")] == [1.0063, 0.9975]
    assert [pairs["bidir"][k] for k in ("h2d_alone_ms", "d2h_alone_ms", "both_ms")] == [19.5639, 19.4266, 23.8899]
    h = load_interference("h200")
    assert h.factors["C2G+G2C"] == [23.8899 / 19.5639, 23.8899 / 19.4266]
    assert h.factors["C+G2C"] == [1.0063, 1.0]
    assert h.extra == {"dropped_upper_bound_gemm_vs_d2d": {"gemm_slowdown": 1.6189, "copy_slowdown": 1.9497}}
    a100 = load_overlap_doc("a100-sxm4-40gb")["interference"]["factors"]
    assert h.factors["C+G2G"] == pytest.approx(a100["C+G2G"], abs=1e-12)
    monkeypatch.setattr(interference, "load_overlap_doc", lambda gpu: None)  # the A100 fit missing
    h = interference.h200_fallback()
    assert "mild defaults" in h.provenance
    assert h.factors["C+G2G"] == pytest.approx([1.3, 1.05], abs=1e-12)
    assert h.factors["G2G+G2C"] == pytest.approx([1.05, 1.05], abs=1e-12)


@needs_raw_data
def test_recorded_errors_reproduce_on_data(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    from profile_build.fit_overlap import load_layouts, mixed_rows, rel_errors

    doc = load_overlap_doc("l4")
    layouts = load_layouts(RAW_DATA, "l4")
    g2g, host = doc["g2g_allgather"], doc["host_links"]
    parts = [mixed_rows(L, g2g[L.name], host["c2g"], host["g2c"]) for L in layouts]
    X, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    got = rel_errors(overlap_time(X, load_interference("l4")), y)
    assert got["rows"] == doc["fit_errors"]["fitted"]["rows"]
    assert got["median"] == pytest.approx(doc["fit_errors"]["fitted"]["median"], abs=2e-3)
    assert rel_errors(X.sum(1), y)["median"] == pytest.approx(doc["fit_errors"]["serial_sum"]["median"], abs=2e-3)


# ---- DP / cross-node links ----------------------------------------------------------------------

GPUS = ("a100-sxm4-40gb", "v100-sxm2-16gb", "l4", "h200", "h100", "a10g", "v100-sxm2-32gb")
SIZES = np.logspace(5, 10, 12)


@pytest.mark.parametrize("gpu", GPUS)
def test_dp_links_monotone_and_vectorized(gpu):
    for op in ("all_gather", "reduce_scatter", "all_reduce", "p2p"):
        for n, m in ((8, 1), (16, 2), (32, 4), (2, 2)):
            t = collective_time(gpu, op, SIZES, n, m, 8)
            assert t.shape == SIZES.shape
            assert np.all(t > 0) and np.all(np.diff(t) > 0), (gpu, op, n, m)


@pytest.mark.parametrize("gpu", GPUS)
def test_cross_node_slower_than_intra_node(gpu):
    for op in ("all_gather", "all_reduce", "p2p"):
        intra = collective_time(gpu, op, SIZES, 8, 1, 8)
        for m in (2, 4, 8):
            cross = collective_time(gpu, op, SIZES, 8, m, 8)
            assert np.all(cross > intra), (gpu, op, m)


@pytest.mark.parametrize("gpu", GPUS)
def test_all_reduce_is_two_phases(gpu):
    ag = collective_time(gpu, "all_gather", SIZES, 16, 2, 8)
    rs = collective_time(gpu, "reduce_scatter", SIZES, 16, 2, 8)
    ar = collective_time(gpu, "all_reduce", SIZES, 16, 2, 8)
    np.testing.assert_allclose(ar, ag + rs, rtol=1e-12)
    np.testing.assert_allclose(ar, 2 * ag, rtol=1e-12)
    # inside a node the measured all-reduce fit applies; ≈ 2× the all-gather volume at large sizes
    big = np.array([4e9])
    ratio = collective_time(gpu, "all_reduce", big, 8, 1, 8) / collective_time(gpu, "all_gather", big, 8, 1, 8)
    assert 1.0 < float(ratio[0]) <= 2.2


def test_dp_links_details():
    a = load_dp_links("a100")  # registry alias
    assert a.gpu == "a100-sxm4-40gb" and a.provenance["internode"].startswith("measured")
    assert load_dp_links("h200").provenance["internode"].startswith("datasheet")
    # the shared NIC: fewer concurrent groups → faster
    one = collective_time("a100-sxm4-40gb", "all_gather", 1e9, 2, 2, 8, concurrent_groups=1)
    eight = collective_time("a100-sxm4-40gb", "all_gather", 1e9, 2, 2, 8)
    assert float(one) < float(eight)
    assert float(collective_time("l4", "all_reduce", 1e9, 1, 1, 8)) == 0.0
    with pytest.raises(ValueError):
        collective_time("l4", "all_gather", 1e9, 6, 4, 8)  # not a multiple
    with pytest.raises(ValueError):
        collective_time("l4", "broadcast", 1e9, 8, 1, 8)
    with pytest.raises(ValueError):
        collective_time("tpu-v5", "all_gather", 1e9, 8, 1, 8)
