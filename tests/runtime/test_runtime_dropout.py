"""Dropout in the runtime (gloo worker processes): the random streams of `mist.models.dropout`.

- Hidden dropout without sequence parallelism acts on outputs every TP rank holds whole: the
  ranks draw identical masks from the shared stream, the same masks a single rank draws, so a
  tp = 2 run equals the tp = 1 run (same seed) — masks that differed between the ranks would make
  the replicated weights (norms, biases) and the losses differ. The embedding output's dropout
  follows the same rule (the pre layer of these runs drops too).
- Recomputation (whole blocks, the attention core, the MLP activation) re-runs forwards that draw
  the masks of the first run, also from the tensor-parallel stream (attention dropout; hidden
  dropout under sequence parallelism): the same losses and weights as without recomputation.
- The simulator's saved-activation peak equals the runtime's to the byte, masks included.
- A run resumed from a checkpoint draws the masks of an uninterrupted one (seeded per step).
"""

from dataclasses import replace

import numpy as np
import pytest
from rt_helpers import CPU_PROFILE, SPECS, compiled_plan, make_plan, run_plan

import mist.models.embedding as embedding
from mist.hardware import load_profile
from mist.models.dropout import dropout, tp_stream
from mist.simulate.plan_sim import simulate_plan

for _f in ("gpt", "llama", "falcon"):
    SPECS.setdefault(f"{_f}-hdrop", replace(SPECS[_f], hidden_dropout=0.2, name=f"tiny-{_f}-hdrop"))
    SPECS.setdefault(f"{_f}-adrop", replace(SPECS[_f], attention_dropout=0.2, name=f"tiny-{_f}-adrop"))
    SPECS.setdefault(
        f"{_f}-drop", replace(SPECS[_f], attention_dropout=0.2, hidden_dropout=0.2, name=f"tiny-{_f}-drop")
    )


def _same(a: dict, b: dict, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(a["metrics"]["losses"], b["metrics"]["losses"], rtol=1e-5, atol=atol)
    assert set(a["state"]) == set(b["state"])
    for k, v in a["state"].items():
        np.testing.assert_allclose(b["state"][k], v, rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("family", ["gpt", "falcon"])
def test_tp2_hidden_dropout_masks_are_the_single_ranks(family):
    one = run_plan(make_plan(f"{family}-hdrop", G=2))
    two = run_plan(make_plan(f"{family}-hdrop", tp=2, G=2))
    _same(one, two)
    # the masks are drawn: without dropout the losses differ
    plain = run_plan(make_plan(family, G=2))
    assert not np.allclose(one["metrics"]["losses"], plain["metrics"]["losses"], rtol=1e-3)


def test_tp2_embedding_dropout_is_the_single_ranks(monkeypatch):
    """gpt (learned positions, dropped with the word embeddings): the embedding's masks are part
    of what the tp = 2 run shares with the single rank — without them the losses change, and drawn
    from each rank's own stream (the wrong one for an output the ranks hold whole) they no longer
    match. (The workers are forked: they run the patched embedding.)"""
    one = run_plan(make_plan("gpt-hdrop", G=2))
    monkeypatch.setattr(embedding, "hidden_dropout", lambda x, p, tp, training: x)
    assert not np.allclose(one["metrics"]["losses"], run_plan(make_plan("gpt-hdrop", G=2))["metrics"]["losses"])

    def own_stream(x, p, tp, training):
        with tp_stream(tp, x):
            return dropout(x, p, training)

    monkeypatch.setattr(embedding, "hidden_dropout", own_stream)
    wrong = run_plan(make_plan("gpt-hdrop", tp=2, G=2))
    assert not np.allclose(one["metrics"]["losses"], wrong["metrics"]["losses"], rtol=1e-3)


SELECTIVE = dict(recompute_attention=True, recompute_activation=True)


@pytest.mark.parametrize(
    "sp,recompute",
    [(False, dict(recompute=3)), (True, dict(recompute=3)), (True, SELECTIVE)],
    ids=["tp2-blocks", "tp2-sp-blocks", "tp2-sp-selective"],
)
def test_recomputation_replays_the_masks(sp, recompute):
    kw = dict(tp=2, flash=False, sequence_parallel=sp, gpu=CPU_PROFILE)
    plain = run_plan(make_plan("llama-drop", **kw))
    plan = make_plan("llama-drop", **kw, **recompute)
    res = run_plan(plan)
    _same(plain, res)
    if recompute is SELECTIVE:  # masks kept, and the attention core's re-run
        _memory_matches(plan, res)


def _memory_matches(plan, res) -> None:
    pred = simulate_plan(plan, load_profile(CPU_PROFILE))
    for p, m in zip(pred.stages, res["metrics"]["stages"]):
        for k in ("state_bytes", "saved_activation_peak_bytes"):
            assert getattr(p, k) == m[k], k


def test_resumed_run_draws_the_uninterrupted_masks(tmp_path):
    plan = make_plan("falcon-drop", tp=2, flash=False)
    ck = str(tmp_path / "ck")
    full = run_plan(plan, steps=4)
    first = run_plan(plan, steps=4, checkpoint_dir=ck, stop_after=2)
    resumed = run_plan(plan, steps=4, checkpoint_dir=ck, resume=True)
    got = first["metrics"]["losses"] + resumed["metrics"]["losses"]
    np.testing.assert_allclose(got, full["metrics"]["losses"], rtol=1e-6, atol=1e-7)
    for k, v in full["state"].items():
        np.testing.assert_allclose(resumed["state"][k], v, rtol=0, atol=1e-6, err_msg=k)


def test_compiled_blocks_draw_the_shared_stream_s_masks():
    """Compiled blocks draw their masks with Inductor, from seeds of the default generator (the
    shared stream, `mist.rules.compiled_blocks`): hidden dropout on two tensor-parallel ranks, one
    layer recomputed whole (its re-run draws the first run's masks), equals one rank without
    recomputation; and the simulator's states and saved activations, priced from the compiled
    graphs, are the runtime's to the byte."""
    one = run_plan(compiled_plan(make_plan("gpt-hdrop", G=2, flash=False)))
    plan = compiled_plan(make_plan("gpt-hdrop", tp=2, G=2, recompute=1, flash=False))
    two = run_plan(plan)
    _same(one, two)
    _memory_matches(plan, two)


# (model, plan) pairs whose masks come from each rank's own stream
RANK_STREAM = [
    ("gpt-adrop", dict(tp=2, G=2, recompute=1, flash=False)),
    ("gpt-adrop", dict(tp=2, G=2, recompute_attention=True, flash=False)),
    ("llama-hdrop", dict(tp=2, G=2, sequence_parallel=True, recompute_activation=True)),
]


@pytest.mark.parametrize(
    "family,kw",
    [
        pytest.param(
            *RANK_STREAM[0],
            id="tp2-attention-recompute1",
            # (the attention's masks redrawn in a recomputation: the core-recomputed case)
            marks=pytest.mark.extended(
                "tests/runtime/test_runtime_dropout.py::test_compiled_blocks_draw_each_rank_s_own_masks_as_eager_blocks_do"
            ),
        ),
        pytest.param(*RANK_STREAM[1], id="tp2-attention-core-recomputed"),
        pytest.param(*RANK_STREAM[2], id="tp2-sp-hidden-selective"),
    ],
)
def test_compiled_blocks_draw_each_rank_s_own_masks_as_eager_blocks_do(family, kw):
    """Inside compiled blocks the dropouts of what a rank holds alone (its heads' attention
    probabilities; under sequence parallelism its sequence shard) run `mist::seeded_dropout` with a
    seed of the rank's own stream, and draw what eager blocks draw: the compiled run equals the
    eager run of the same plan, also where a recomputed block re-runs its forward and where the
    partitioner re-runs a recomputed attention core in the backward graph; the simulator's memory
    is the runtime's to the byte."""
    eager = run_plan(make_plan(family, **kw))
    plan = compiled_plan(make_plan(family, **kw))
    compiled = run_plan(plan)
    _same(eager, compiled)
    _memory_matches(plan, compiled)
