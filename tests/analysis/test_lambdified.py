"""A layer analysis read from the disk cache evaluates its expressions with the functions printed
when it was traced (`mist.analysis.lambdified`): rebuilt from the kept source, they are sympy's
functions and give the same values, bit for bit."""

import pickle
from dataclasses import fields

import numpy as np
import sympy

from mist.analysis import analyze_layer, lambdified
from mist.analysis.layer import _analyze
from mist.analysis.records import B, S
from mist.specs.presets import get_preset


def test_a_rebuilt_evaluator_is_sympy_s_function():
    exprs = [4 * B * S * 2048 + sympy.Rational(3, 7) * B**2 * S, sympy.Max(B * S, 3 * S), sympy.ceiling(B * S / 3)]
    fn, source = lambdified.make(exprs)
    assert source is not None and "def " in source
    again = lambdified.load(source)
    b, s = np.array([1.0, 2.0, 3.0, 64.0]), np.array([5.0, 2048.0, 7.0, 4096.0])
    for x, y in zip(fn(b, s), again(b, s)):
        np.testing.assert_array_equal(x, y)


def test_an_evaluator_that_reads_other_names_keeps_no_source():
    """A name outside the namespace `load` gives (here gamma, which NumPy lacks) is not kept: the
    analysis prints that list again in a later process."""
    _, source = lambdified.make([sympy.gamma(B) + S])
    assert source is None


def test_a_cached_analysis_evaluates_from_its_kept_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    _analyze.cache_clear()
    spec = get_preset("gpt3-1.3b")
    traced = analyze_layer(spec, "block", 2, True, "bf16", "cuda", "attention")
    assert {"saved", "saved_split", "fwd_live", "bwd_live", "ops_fwd", "ops_bwd", "flops_fwd"} <= traced._sources.keys()
    read = pickle.loads(pickle.dumps(traced))  # as the disk cache stores and loads it
    assert read._fns == {} and read._sources == traced._sources
    read.unit_batch = traced.unit_batch
    b, s = np.array([1.0, 2.0, 8.0]), np.full(3, 2048.0)
    for phase in ("fwd", "bwd", "recompute"):
        for x, y in zip(traced.op_values(phase, b, s), read.op_values(phase, b, s), strict=True):
            assert (x.op, x.kind) == (y.op, y.kind)
            np.testing.assert_array_equal(x.bytes_moved, y.bytes_moved)
            for f in fields(x.params) if x.params is not None else ():
                np.testing.assert_array_equal(getattr(x.params, f.name), getattr(y.params, f.name))
    for name in ("saved", "fwd_peak", "bwd_peak", "output"):
        np.testing.assert_array_equal(getattr(traced, name)(b, s), getattr(read, name)(b, s))
    np.testing.assert_array_equal(traced.flops_of("bwd", b, s), read.flops_of("bwd", b, s))
    _analyze.cache_clear()
