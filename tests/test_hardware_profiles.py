"""Tests of the GPU profiles (`mist.hardware`): loading, table reproduction, broadcasting, models."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest

from mist.analysis.records import FusedParams
from mist.errors import MistInputError
from mist.hardware import available_profiles, load_profile, op_class
from mist.hardware.host import stream_time
from mist.hardware.memory_ops import POINTWISE_KINDS
from mist.hardware.profile import GpuProfile
from raw_data import RAW_DATA, REPO_DATA, TOOLS, needs_raw_data

H200_DATA = REPO_DATA / "gpus" / "h200"

EXPECTED = {"h200", "h100", "l4", "a100-sxm4-40gb", "a10g", "v100-sxm2-32gb"}


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


# ---------------------------------------------------------------------------- loading
def test_every_shipped_profile_loads_and_predicts():
    names = available_profiles()
    assert EXPECTED <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name
        assert p.provenance and "\n" not in p.provenance
        assert isinstance(p.memory_bytes, int) and p.memory_bytes > 10 * 2**30
        for field in (
            "peak_flops",
            "hbm_bandwidth",
            "h2d_bandwidth",
            "d2h_bandwidth",
            "bidir_bandwidth",
            "adam_gpu_s_per_param",
            "adam_cpu_s_per_param",
        ):
            assert getattr(p, field) > 0, (name, field)
        t = p.gemm_time(4096, 4096, 4096)
        assert 0 < t < 0.1
        # achieved rate never beats the datasheet peak
        assert p.gemm.flops_rate(8192, 8192, 8192) < p.peak_flops
        assert p.attention_time(2, 32, 32, 2048, 128, True, False) > 0
        assert p.memory_op_time("gelu", 1e8) > 0
        assert set(p.sources) >= {"memory_bytes", "gemm", "attention", "memory_ops", "host", "host_link"}


def test_profile_files_are_small():
    from importlib import resources

    for f in (resources.files("mist.hardware") / "profiles").iterdir():
        if f.name.endswith(".json"):
            assert len(f.read_bytes()) < 1_000_000, f.name


def test_h100_is_labelled_not_measured():
    p = load_profile("h100")
    assert p.measured is False
    assert "roofline" in p.provenance and "no measurements" in p.provenance
    h200 = load_profile("h200")
    assert h200.measured is True
    # same tensor peak: big GEMMs equal; lower HBM: memory-bound ops slower
    assert p.gemm_time(8192, 8192, 8192) == pytest.approx(h200.gemm_time(8192, 8192, 8192), rel=0.02)
    assert p.memory_op_time("gelu", 1e9) > 1.3 * h200.memory_op_time("gelu", 1e9)
    assert p.memory_bytes < h200.memory_bytes


def test_unknown_gpu_raises_one_sentence():
    with pytest.raises(MistInputError) as exc:
        load_profile("x")
    msg = str(exc.value)
    assert msg.startswith("Unknown GPU 'x'; known: ")
    assert "h200" in msg and msg.endswith(".") and msg.count(". ") == 0


def test_aliases_and_case():
    assert load_profile("A100").name == "a100-sxm4-40gb"
    assert load_profile("NVIDIA H200").name == "h200"
    assert load_profile("H100-SXM").name == "h100"
    assert load_profile("v100").name == "v100-sxm2-32gb"


def test_gpu_names_for_profiles_and_link_files():
    from mist.hardware.gpu_names import normalize_gpu, profile_key

    assert profile_key("NVIDIA H200_SXM") == normalize_gpu("NVIDIA H200_SXM") == "h200"
    assert profile_key(" A100 ") == normalize_gpu("a100") == "a100-sxm4-40gb"
    assert normalize_gpu("V100_16GB") == "v100-sxm2-16gb"  # overlap benchmark only: no such profile
    assert profile_key("V100_16GB") == "v100-16gb"
    assert profile_key("Some GPU") == normalize_gpu("Some GPU") == "some-gpu"


def test_assumed_link_constants_are_data_with_provenance():
    from mist.hardware.collectives import assumed_links

    d = assumed_links()
    assert d["provenance"].startswith("assumed")
    assert d["group_sizes"] == [2, 4, 8]
    assert (d["cpu"]["alpha_s"], d["cpu"]["copy_rate_divisor"], d["cuda"]["alpha_s"]) == (5e-5, 4, 2e-5)
    assert (d["cuda_internode"]["alpha_s"], d["cuda_internode"]["nic_Bps_per_node"]) == (2e-5, 8 * 400e9 / 8)
    for part in ("cpu", "cuda", "cuda_internode"):
        assert d[part]["provenance"].startswith("assumed")
    assert "_assumed" not in available_profiles()


def test_profile_json_path_round_trip(tmp_path, h200):
    path = h200.save(tmp_path / "my-gpu.json")
    again = load_profile(str(path))
    assert again.name == h200.name and again.provenance == h200.provenance
    m = np.array([700, 3000, 50000])
    np.testing.assert_allclose(again.gemm_time(m, 5000, 1000), h200.gemm_time(m, 5000, 1000), rtol=1e-4)
    np.testing.assert_allclose(
        again.attention_time(3, 24, 8, 3000, 96, True, True),
        h200.attention_time(3, 24, 8, 3000, 96, True, True),
        rtol=1e-4,
    )
    assert again.memory_op_time("silu", 1e7, True) == pytest.approx(h200.memory_op_time("silu", 1e7, True))
    assert json.loads(path.read_text())["format"] == "mist-gpu-profile"


def test_bad_profile_paths_raise_input_errors(tmp_path):
    with pytest.raises(MistInputError, match="does not exist"):
        load_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(MistInputError, match="not a valid profile"):
        load_profile(str(bad))


def _one_sentence(msg: str) -> None:
    assert "\n" not in msg and msg.endswith(".") and "Traceback" not in msg


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"[]", "must hold a JSON object at the top level, got a list"),
        (b"null", "must hold a JSON object at the top level, got null"),
        (b"3", "must hold a JSON object at the top level, got a number"),
        (b'{"format": "mist-gpu-profile", "name": "\xe9"}', "is not UTF-8 text"),
        (b"{", "is not valid JSON"),
    ],
)
def test_profile_file_that_is_not_a_json_object(tmp_path, raw, fragment):
    path = tmp_path / "p.json"
    path.write_bytes(raw)
    with pytest.raises(MistInputError, match=fragment) as exc:
        load_profile(str(path))
    _one_sentence(str(exc.value))


def _set(*keys, value=None, delete=False):
    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        if delete:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value

    return edit


BAD_PROFILES = [
    (_set("memory_bytes", value=-1), "memory_bytes must be a positive finite number, got -1"),
    (_set("memory_bytes", value=0), "memory_bytes must be a positive finite number, got 0"),
    (_set("peak_flops", value=0), "peak_flops must be a positive finite number, got 0"),
    (_set("peak_flops", value=-3e14), "peak_flops must be a positive finite number"),
    (_set("hbm_bandwidth", value=0), "hbm_bandwidth must be a positive finite number"),
    (_set("h2d_bandwidth", value=0), "h2d_bandwidth must be a positive finite number"),
    (_set("d2h_bandwidth", value=-1), "d2h_bandwidth must be a positive finite number"),
    (_set("bidir_bandwidth", value=0), "bidir_bandwidth must be a positive finite number"),
    (_set("adam_cpu_s_per_param", value=-1e-9), "adam_cpu_s_per_param must be a finite number >= 0"),
    (_set("adam_gpu_s_per_param", value=-1e-9), "adam_gpu_s_per_param must be a finite number >= 0"),
    (_set("host_memory_per_gpu", value=0), "host_memory_per_gpu must be a positive finite number"),
    (_set("host_memory_per_gpu", value=-5.0), "host_memory_per_gpu must be a positive finite number"),
    (_set("outside_allocator_bytes", value=-1), "outside_allocator_bytes must be a whole number of bytes from 0"),
    (_set("outside_allocator_bytes", value=0.5), "outside_allocator_bytes must be a whole number of bytes from 0"),
    (_set("outside_allocator_bytes", value=1e300), "to below memory_bytes"),
    (_set("outside_allocator_bytes", value="1"), "outside_allocator_bytes must be a whole number"),
    (_set("peak_flops", value=float("nan")), "peak_flops must be a positive finite number, got nan"),
    (_set("hbm_bandwidth", value=float("inf")), "hbm_bandwidth must be a positive finite number, got inf"),
    (_set("peak_flops", value="1e15"), "peak_flops must be a positive finite number"),
    (_set("measured", value="no"), "measured must be true or false"),
    (_set("name", value=None), "name must be a non-empty string, got null"),
    (_set("name", value=7), "name must be a non-empty string"),
    (_set("name", value=" "), "name must be a non-empty string"),
    (_set("memory_bytes", delete=True), "is missing field 'memory_bytes'"),
    (_set("gemm", delete=True), "is missing field 'gemm'"),
    (_set("gemm", value=None), "section 'gemm' must be a JSON object, got null"),
    (_set("attention", value="x"), "section 'attention' must be a JSON object, got a string"),
    (_set("memory_ops", value={}), "section 'memory_ops' is missing field 'floor_s'"),
    (_set("host", "bwd_op_s", delete=True), "section 'host' is missing field 'bwd_op_s'"),
    (_set("host", "fwd_op_s", value=float("inf")), "section 'host': fwd_op_s must be a finite number >= 0"),
    (_set("gemm", "m_axis", value=None), "section 'gemm': m_axis must be a list"),
    (_set("gemm", "floor_s", value=-1), "section 'gemm': floor_s must be a finite number >= 0"),
    (_set("gemm", "times_s", value=[[1.0]]), "section 'gemm' is malformed"),
    (_set("attention", "fwd_s", value="x"), "section 'attention' is malformed"),
    (_set("memory_ops", "bandwidth", value=None), "section 'memory_ops': bandwidth must be a JSON object"),
    (
        _set("memory_ops", "bandwidth", "elementwise", "fwd", value=0),
        "section 'memory_ops': bandwidth elementwise.fwd must be a positive finite number",
    ),
    (_set("memory_ops", "pointwise_s", value=[1e-9]), "section 'memory_ops': pointwise_s must be a JSON object"),
    (
        _set("memory_ops", "pointwise_s", value={"tanh": -1e-9}),
        "section 'memory_ops': pointwise_s tanh must be a finite number >= 0",
    ),
    (_set("memory_ops", "pointwise_s", value={"gelu": 1e-9}), "section 'memory_ops': pointwise_s has kind 'gelu'"),
    (_set("links", value=3), "section 'links' must be a JSON object"),
    (
        _set("dp_links", value={"internode": {"alpha_s": float("nan"), "nic_Bps_per_node": 1e9}}),
        "section 'dp_links': internode.alpha_s must be a finite number >= 0",
    ),
    (_set("interference", value={"factors": {"X+Y": [1, 2]}}), "section 'interference': factors has an unknown"),
    (_set("interference", value={"factors": 3}), "section 'interference': factors must be a JSON object"),
    (_set("version", value=99), "newer than this Mist"),
    (_set("notes", value="abc"), "notes must be a JSON list"),
]


@pytest.mark.parametrize("edit, fragment", BAD_PROFILES, ids=[f for _, f in BAD_PROFILES])
def test_malformed_profile_fields_are_one_sentence(tmp_path, edit, fragment):
    d = load_profile("l4").to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(MistInputError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(f"GPU profile file {path}") and fragment in msg, msg
    _one_sentence(msg)


def test_malformed_profile_through_the_cli(tmp_path, capsys):
    from mist.cli import main

    d = load_profile("l4").to_dict()
    d["peak_flops"] = 0
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(d))
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--model", "gpt3-1.3b", "--gpu", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "peak_flops must be a positive" in err[0]


def test_valid_optional_fields_still_load(tmp_path):
    d = load_profile("l4").to_dict()
    d["host_memory_per_gpu"] = 64.0 * 2**30
    d["adam_gpu_s_per_param"] = 0.0
    d["outside_allocator_bytes"] = 600 * 2**20
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(d))
    p = load_profile(str(path))
    assert p.host_memory_per_gpu == 64.0 * 2**30 and p.adam_time(10) == 0.0
    assert p.outside_allocator_bytes == 600 * 2**20 and p.to_dict()["outside_allocator_bytes"] == 600 * 2**20
    assert "outside_allocator_bytes" not in load_profile("l4").to_dict()  # not measured: not written


# ---------------------------------------------------------------------------- GEMM
def test_h200_gemm_reproduces_measured_points(h200):
    rows = json.loads((H200_DATA / "gemm.json").read_text())["rows"]
    m, n, k, ms = (np.array([r[key] for r in rows], float) for key in ("m", "n", "k", "ms"))
    pred = h200.gemm_time(m, n, k)
    np.testing.assert_allclose(pred, ms * 1e-3, rtol=0.02)


def test_gemm_interpolates_monotonically_between_points(h200):
    m = np.linspace(4096, 8192, 41)
    t = h200.gemm_time(m, 4096, 4096)
    assert np.all(np.diff(t) > 0)
    k = np.geomspace(2048, 4096, 17)
    assert np.all(np.diff(h200.gemm_time(8192, 8192, k)) > 0)
    n = np.geomspace(16384, 32768, 9)
    assert np.all(np.diff(h200.gemm_time(16384, n, 8192)) > 0)
    # between nodes the time stays between the nodes' times
    lo, hi = h200.gemm_time(4096, 4096, 4096), h200.gemm_time(8192, 4096, 4096)
    assert lo < h200.gemm_time(6000, 4096, 4096) < hi


def test_gemm_outside_grid_clamps_efficiency_and_keeps_floor(h200):
    floor = h200.gemm.floor_s
    assert 10e-6 < floor < 20e-6
    assert h200.gemm_time(1, 1, 1) == pytest.approx(floor)
    assert h200.gemm_time(64, 64, 64) == pytest.approx(floor)
    # above the grid: constant efficiency (time doubles with m)
    t1, t2 = h200.gemm_time(32768, 8192, 8192), h200.gemm_time(65536, 8192, 8192)
    assert t2 == pytest.approx(2 * t1, rel=1e-6)
    assert h200.gemm_time(0, 128, 128) == 0.0


def test_gemm_batch_equals_stacked_rows(h200):
    assert h200.gemm_time(2048, 2048, 128, batch=32) == pytest.approx(h200.gemm_time(65536, 2048, 128), rel=0.05)
    assert h200.gemm_time(1024, 1024, 1024, batch=8) > h200.gemm_time(1024, 1024, 1024)


def test_vectorized_calls_broadcast(h200):
    m = np.array([512, 2048, 8192])[:, None]
    n = np.array([1024, 4096, 16384, 3000])[None, :]
    t = h200.gemm_time(m, n, 4096)
    assert t.shape == (3, 4)
    assert t[1, 2] == pytest.approx(h200.gemm_time(2048, 16384, 4096))
    a = h200.attention_time(np.array([1, 2, 4])[:, None], 32, 8, np.array([1024, 4096])[None, :], 128, True, True)
    assert a.shape == (3, 2)
    assert a[2, 1] == pytest.approx(h200.attention_time(4, 32, 8, 4096, 128, True, True))
    mb = h200.memory_op_time("native_layer_norm", np.array([[1e6, 1e7], [1e8, 1e9]]), False)
    assert mb.shape == (2, 2)
    assert float(h200.gemm_time(4096, 4096, 4096)) > 0  # scalars work too


# ---------------------------------------------------------------------------- attention
def test_h200_attention_reproduces_table(h200):
    rows = json.loads((H200_DATA / "attention.json").read_text())["rows"]
    e_call = h200.host.backward_call_s
    for r in rows:
        args = (r["b"], r["heads"], r["heads"], r["s"], r["d"], True)
        assert h200.attention_time(*args, backward=False) == pytest.approx(r["fwd_ms"] * 1e-3, rel=0.02)
        bwd = h200.attention_time(*args, backward=True)
        assert bwd == pytest.approx(max(r["bwd_ms"] * 1e-3 - e_call, r["fwd_ms"] * 1e-3), rel=0.02)
        if r["bwd_ms"] > 5.0:  # long GPU-bound rows: the table itself
            assert bwd == pytest.approx(r["bwd_ms"] * 1e-3, rel=0.02)


def test_attention_gqa_causal_and_scaling(h200):
    mha = h200.attention_time(2, 32, 32, 4096, 128, True, False)
    assert h200.attention_time(2, 32, 8, 4096, 128, True, False) == pytest.approx(mha)
    assert h200.attention_time(2, 32, 1, 4096, 128, True, False) == pytest.approx(mha)
    full = h200.attention_time(2, 32, 32, 4096, 128, False, False)
    assert 1.8 * mha < full < 2.0 * mha
    assert h200.attention_time(2, 32, 32, 4096, 128, True, True) > 2 * mha
    # beyond the table: time ∝ s² at the edge's efficiency
    t8, t16 = h200.attention_time(8, 64, 64, 8192, 128), h200.attention_time(8, 64, 64, 16384, 128)
    assert t16 == pytest.approx(4 * t8, rel=1e-6)
    with pytest.raises(ValueError):
        h200.attention_time(1, 8, 16, 1024, 64)


# ---------------------------------------------------------------------------- memory-bound ops
def test_memory_op_time_increases_with_bytes_and_has_floor(h200):
    nbytes = np.geomspace(1e3, 1e10, 30)
    for op in ("native_layer_norm", "gelu_backward", "mul", "some_new_op", "_log_softmax"):
        for backward in (False, True):
            t = h200.memory_op_time(op, nbytes, backward)
            assert np.all(np.diff(t) > 0)
            assert np.all(t >= h200.memory_ops.floor_s)
    assert 1e-6 <= h200.memory_ops.floor_s <= 10e-6
    assert h200.memory_op_time("gelu", 0) == 0.0
    # big copies run near the measured copy bandwidth, never above the datasheet HBM
    t = h200.memory_op_time("copy_", 4e9)
    assert 4e9 / h200.hbm_bandwidth < t < 1.3 * 4e9 / h200.hbm_bandwidth


def test_op_names_map_to_classes():
    assert op_class("native_layer_norm") == "layernorm"
    assert op_class("native_layer_norm_backward") == "layernorm"
    assert op_class("_fused_rms_norm") == "rmsnorm"
    assert op_class("aten::add.Tensor") == "binary"
    assert op_class("add_") == "binary"
    assert op_class("silu_backward") == "swiglu"
    assert op_class("_softmax_backward_data") == "softmax"
    assert op_class("nll_loss_forward") == "cross_entropy"
    assert op_class("native_dropout") == "dropout"
    assert op_class("copy_") == "copy"
    assert op_class("rsqrt") == "elementwise"
    assert op_class("totally_unknown_op") == "elementwise"


def test_measured_classes_have_own_bandwidths(h200):
    bw = h200.memory_ops.bandwidth
    assert bw["layernorm"]["bwd"] < bw["gelu"]["bwd"]  # LN backward makes two passes
    for c in ("layernorm", "rmsnorm", "gelu", "swiglu", "dropout", "binary", "cross_entropy"):
        assert "measured" in h200.memory_ops.sources[c]
        for d in ("fwd", "bwd"):
            assert 0.2e12 < bw[c][d] <= h200.hbm_bandwidth


# ---------------------------------------------------------------------------- host-bound regime
def test_fused_kernel_is_the_longer_of_streaming_and_computing(h200):
    """A fused pointwise kernel (`MemoryOpModel.fused_time`): with measured seconds per
    element-operation, floor + max(bytes at the copy rate, Σ kind's operations × its seconds);
    without them (every shipped profile), its bytes at the generic class, as before."""
    mo = h200.memory_ops
    assert mo.pointwise_s is None
    work = {k: 0 for k in POINTWISE_KINDS}
    assert h200.fused_time(1e8, work) == pytest.approx(h200.memory_op_time("elementwise", 1e8))
    d = h200.to_dict()
    d["memory_ops"]["pointwise_s"] = {"arith": 1e-12, "tanh": 3e-9}
    p = GpuProfile.from_dict(d)
    copy_s = 1e8 / p.memory_ops.effective_bandwidth("copy")
    assert p.fused_time(1e8, work) == pytest.approx(p.memory_ops.floor_s + copy_s)  # nothing computed
    light = {**work, "arith": 1e6}  # 1 µs of arithmetic under the bytes' streaming
    assert p.fused_time(1e8, light) == pytest.approx(p.memory_ops.floor_s + copy_s)
    heavy = {**work, "arith": 1e6, "tanh": 1e7, "welford": 1e9}  # a kind it did not measure costs 0
    assert p.fused_time(1e8, heavy) == pytest.approx(p.memory_ops.floor_s + 1e-6 + 3e-2)
    assert p.fused_time(0, heavy) == 0.0
    assert GpuProfile.from_dict(json.loads(json.dumps(p.to_dict()))).memory_ops.pointwise_s == {
        "arith": 1e-12,
        "tanh": 3e-9,
    }
    assert [f.name for f in fields(FusedParams)] == list(POINTWISE_KINDS)


def test_stream_time_long_kernels_is_their_sum(h200):
    k = np.full(10, 1e-3)
    assert h200.stream_time(k) == pytest.approx(k.sum())
    assert h200.stream_time(k, backward=True) == pytest.approx(k.sum())


def test_stream_time_tiny_kernels_is_host_bound(h200):
    n = 50
    for backward in (False, True):
        h = h200.host_overhead(backward)
        t = h200.stream_time(np.full(n, 1e-7), backward=backward)
        assert (n - 1) * h < t < n * h
    assert h200.host.bwd_op_s > h200.host.fwd_op_s


def test_stream_time_vectorized_and_matches_recursion():
    rng = np.random.default_rng(0)
    k = rng.uniform(0, 40e-6, size=(4, 3, 25))
    h = 15e-6
    got = stream_time(k, h)
    assert got.shape == (4, 3)
    for idx in np.ndindex(4, 3):
        end = 0.0
        for i, ki in enumerate(k[idx]):
            end = max(i * h, end) + ki
        assert got[idx] == pytest.approx(end)
    # per-op host overheads
    per_op = np.array([1e-3, 0.0, 0.0])
    assert stream_time([1e-6, 1e-6, 1e-6], per_op) == pytest.approx(1e-3 + 2e-6)
    assert stream_time(np.zeros((2, 0)), h).shape == (2,)


def test_host_calibration_is_plausible(h200):
    assert 5e-6 <= h200.host.fwd_op_s <= 30e-6
    assert 10e-6 <= h200.host.bwd_op_s <= 60e-6
    assert h200.host.backward_call_s > 0


# ---------------------------------------------------------------------------- build
def test_profile_builders_live_outside_the_package(monkeypatch):
    import importlib.util

    from mist.hardware.datasheet import DATASHEET
    from mist.hardware.fitting import fit_floor_plus_rate

    assert importlib.util.find_spec("mist.hardware.build") is None
    assert importlib.util.find_spec("mist.hardware.fit_overlap") is None
    monkeypatch.syspath_prepend(str(TOOLS))
    from profile_build import common

    assert common.DATASHEET is DATASHEET and common.fit_floor_plus_rate is fit_floor_plus_rate


def _fresh_builds_equal_the_shipped(data, only=None):
    from profile_build import build_all

    fresh = build_all(data, only)
    assert set(fresh) == set(only or fresh)
    for name, p in fresh.items():
        # every field: a builder change that was not shipped (the four borrowed host AdamW rates
        # once were) must fail here, and small rates need a relative tolerance without an absolute one
        _assert_same(load_profile(name).to_dict(), p.to_dict(), name)


def _assert_same(shipped, fresh, where: str) -> None:
    if isinstance(shipped, dict):
        assert isinstance(fresh, dict) and set(shipped) == set(fresh), where
        for k in shipped:
            _assert_same(shipped[k], fresh[k], f"{where}.{k}")
    elif isinstance(shipped, list) and shipped and all(isinstance(v, (int, float)) for v in shipped):
        np.testing.assert_allclose(shipped, fresh, rtol=1e-6, atol=0, err_msg=where)
    elif isinstance(shipped, list):
        assert isinstance(fresh, list) and len(shipped) == len(fresh), where
        for i, (a, b) in enumerate(zip(shipped, fresh)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(shipped, float):
        assert fresh == pytest.approx(shipped, rel=1e-6, abs=0), where
    else:
        assert shipped == fresh, where


def test_shipped_h200_and_h100_profiles_match_a_fresh_build_from_the_repository_data(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    _fresh_builds_equal_the_shipped(REPO_DATA, ("h200", "h100"))


@needs_raw_data
def test_shipped_profiles_match_a_fresh_build(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    _fresh_builds_equal_the_shipped(RAW_DATA)


def test_host_passes_stream_at_the_host_adamw_bandwidth():
    """A host pass over n bytes costs what the fused host AdamW takes per byte it moves: the step
    over P parameters moves HOST_ADAM_BYTES · P bytes in `adam_time(P, on_cpu=True)`."""
    from mist.hardware.profile import HOST_ADAM_BYTES

    p = load_profile("h200")
    n = 3 * 2**20
    assert float(p.host_pass_time(HOST_ADAM_BYTES * n)) == pytest.approx(float(p.adam_time(n, on_cpu=True)))
    # the H200 host's, from the runtime's own step measured there: about 124 GB/s
    assert HOST_ADAM_BYTES / p.adam_cpu_s_per_param == pytest.approx(124e9, rel=0.01)
