"""Pipeline math: the closed form against the Mist paper's objective (worked examples) and an
event-driven 1F1B run."""

import numpy as np
import pytest

from mist.simulate.pipeline import event_schedule, iteration_time, one_f_one_b_order


def test_reduces_to_mist_formula_vectors():
    """With the whole extra charged to the first micro-batch and F = T it is the Mist paper's
    (G − 1)·max T + Σ T + max(0, max_i (D_i − Σ_{j<i} T_j))."""
    assert iteration_time([1, 1], 4, first=[0.5, 2]) == pytest.approx(6.0)
    assert iteration_time([2, 3, 2.5], 8, first=[4, 1, 6]) == pytest.approx(32.5)
    assert iteration_time([3.0], 5, first=[1.5]) == pytest.approx(5 * 3.0 + 1.5)


def test_vectorized_over_candidates():
    T = np.array([[1, 1], [2, 1]])
    assert iteration_time(T, 4).tolist() == pytest.approx([5.0, 9.0])


def test_1f1b_order_is_complete():
    for S in (1, 2, 4):
        for G in (1, 3, 8):
            for i in range(S):
                ops = one_f_one_b_order(i, S, G)
                assert sorted(ops) == sorted([("F", m) for m in range(G)] + [("B", m) for m in range(G)])


@pytest.mark.parametrize("S,G", [(1, 4), (2, 4), (4, 8), (4, 16), (3, 2)])
def test_uniform_stages_match_event_simulation(S, G):
    f, b = [1.0] * S, [2.0] * S
    ev, _ = event_schedule(f, b, [0.0] * S, [0.0] * S, G)
    assert ev == pytest.approx(float(iteration_time([3.0] * S, G)))
    assert ev == pytest.approx((G + S - 1) * 3.0)


def test_closed_form_tracks_event_simulation_with_imbalance():
    """Random stage times and one-off extras: the closed form stays within a few percent of
    the explicit schedule."""
    rng = np.random.default_rng(0)
    errs = []
    for _ in range(200):
        S = int(rng.integers(1, 6))
        G = int(rng.integers(S, 4 * S + 1))
        f = rng.uniform(0.5, 1.5, S)
        b = 2 * f * rng.uniform(0.9, 1.1, S)
        first = rng.uniform(0, 2, S)
        last = rng.uniform(0, 2, S)
        ev, _ = event_schedule(list(f), list(b), list(first), list(last), G)
        cf = float(iteration_time(f + b, G, first=first, last=last, fwd=f))
        errs.append((cf - ev) / ev)
    errs = np.abs(errs)
    assert np.median(errs) < 0.05
    assert np.max(errs) < 0.25


def test_downstream_extra_hides_in_bubble():
    # a one-off extra on the last stage shorter than the upstream fill time costs nothing
    T, F = [3.0, 3.0, 3.0], [1.0, 1.0, 1.0]
    base = iteration_time(T, 6, fwd=F)
    # the last stage's optimizer step hides behind the two upstream forwards
    assert iteration_time(T, 6, first=[0, 0, 1.9], last=[0, 0, 0], fwd=F) == pytest.approx(base)
    assert iteration_time(T, 6, first=[1.9, 0, 0], last=[0, 0, 0], fwd=F) == pytest.approx(base + 1.9)
    # stage 0's final reduction is exposed; the last stage's hides behind the drain
    assert iteration_time(T, 6, first=[0, 0, 0], last=[0, 0, 3.9], fwd=F) == pytest.approx(base)
    assert iteration_time(T, 6, first=[0, 0, 0], last=[1.0, 0, 0], fwd=F) == pytest.approx(base + 1.0)
