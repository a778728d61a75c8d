"""The inter-stage dynamic program against brute force over every split and option."""

import itertools

import numpy as np
import pytest

from mist.simulate.pipeline import iteration_time
from mist.tune.inter import best_split
from mist.tune.intra import Options, pareto_2d


def random_options(rng, S, L, K):
    opts = []
    for _ in range(S):
        d = {}
        for l in range(1, L + 1):
            k = int(rng.integers(1, K + 1))
            T = l * rng.uniform(0.8, 1.2, k) + rng.uniform(0, 0.3, k)
            F = T * rng.uniform(0.25, 0.4, k)
            X = rng.uniform(0, 3, k) * (rng.random(k) < 0.7)
            Y = rng.uniform(0, 2, k) * (rng.random(k) < 0.7)
            d[l] = Options(T, F, X, Y, [None] * k)
        opts.append(d)
    return opts


def brute(opts, L, G):
    S = len(opts)
    best = np.inf
    for split in itertools.product(range(1, L + 1), repeat=S):
        if sum(split) != L:
            continue
        for ks in itertools.product(*[range(len(opts[i][l].T)) for i, l in enumerate(split)]):
            pick = [opts[i][l] for i, l in enumerate(split)]
            T = np.array([p.T[k] for p, k in zip(pick, ks)])
            F = np.array([p.F[k] for p, k in zip(pick, ks)])
            X = np.array([p.X[k] for p, k in zip(pick, ks)])
            Y = np.array([p.Y[k] for p, k in zip(pick, ks)])
            best = min(best, float(iteration_time(T, G, first=X, last=Y, fwd=F)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 4))
    L = int(rng.integers(S, 7))
    G = int(rng.integers(1, 9))
    opts = random_options(rng, S, L, 3)
    res = best_split(opts, L, G)
    assert res.exact
    assert res.objective == pytest.approx(brute(opts, L, G), rel=1e-12)
    # the returned split reproduces its objective
    T = np.array([opts[i][l].T[k] for i, (l, k) in enumerate(zip(res.layers, res.choice))])
    F = np.array([opts[i][l].F[k] for i, (l, k) in enumerate(zip(res.layers, res.choice))])
    X = np.array([opts[i][l].X[k] for i, (l, k) in enumerate(zip(res.layers, res.choice))])
    Y = np.array([opts[i][l].Y[k] for i, (l, k) in enumerate(zip(res.layers, res.choice))])
    assert sum(res.layers) == L
    assert float(iteration_time(T, G, first=X, last=Y, fwd=F)) == pytest.approx(res.objective, rel=1e-12)


def test_infeasible_returns_none():
    empty = Options(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), [])
    assert best_split([{1: empty, 2: empty}], 2, 4) is None


def test_large_instance_is_solved():
    """8 stages × 48 layers × up to 8 options (its speed: benchmarks/unit_speed.py)."""
    rng = np.random.default_rng(1)
    opts = random_options(rng, 8, 48, 8)
    res = best_split(opts, 48, 32)
    assert res is not None and sum(res.layers) == 48


def test_pareto_2d():
    T = np.array([1, 2, 3, 1.5, 2.5])
    D = np.array([5, 3, 1, 6, 4])
    assert sorted(pareto_2d(T, D).tolist()) == [0, 1, 2]


def test_pareto_2d_equals_the_definition_on_large_clouds_with_ties():
    """Past 64 points pivots drop dominated points before the sort: the frontier, its order and
    which of equal points it keeps are those of the plain definition (a point is kept when its D
    is below every D of the points before it in (T, D) order, index breaking ties)."""

    def by_definition(T, D):
        order = np.lexsort((D, T))
        d = D[order]
        before = np.concatenate(([np.inf], np.minimum.accumulate(d)[:-1]))
        return order[d < before - 1e-12]

    rng = np.random.default_rng(3)
    kept = 0
    for trial in range(400):
        n = int(rng.integers(65, 2000))
        if trial % 2:  # few distinct values: many exact ties, equal T with different D and back
            k = int(rng.integers(2, 40))
            T = rng.integers(0, k, n) * 0.25
            D = rng.integers(0, k, n) * 0.5
        else:
            T, D = rng.random(n), rng.random(n)
        if trial % 5 == 0:
            T[rng.integers(0, n)] = np.inf
        got = pareto_2d(T, D)
        np.testing.assert_array_equal(got, by_definition(T, D))
        kept += len(got)
    assert kept > 400  # frontiers of more than one point were compared
