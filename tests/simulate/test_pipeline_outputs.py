"""What a pipeline stage keeps of the outputs it sent depends on the engine that runs the plan
(`mist.rules.pipeline_outputs`, `Plan.engine`): Mist's runtime and Megatron-LM free a 1F1B
stage's sent outputs, DeepSpeed's pipeline engine and torchtitan's schedules keep every in-flight
one until its backward; an interleaved rank of Mist's runtime holds the few it has not waited for
yet (`rules.interleaved_sends`) and Megatron-LM frees them. The simulator prices exactly that
difference: one stage input (b·s·h in the compute dtype) per kept output, on every stage but the
last."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mist.errors import MistInputError
from mist.hardware import load_profile
from mist.plan import load_plan, plan_from_dict
from mist.rules.interleaved_order import chunks_in_flight
from mist.rules.interleaved_sends import (
    FREES,
    KEEPS,
    OUTPUT_LAG,
    WAITS,
    HeldBeside,
    gradient_waits,
    held_at_ops,
    held_beside,
    held_sends,
)
from mist.rules.pipeline_outputs import ENGINES, holds_sends, keeps_sent_outputs
from mist.simulate.plan_sim import simulate_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_rule_per_engine():
    assert ENGINES == ("mist", "megatron", "deepspeed", "torchtitan")
    assert [keeps_sent_outputs(e, 1) for e in ENGINES] == [False, False, True, True]
    assert [keeps_sent_outputs(e, 2) for e in ENGINES] == [False, False, True, True]
    assert [holds_sends(e, 2) for e in ENGINES] == [True, False, False, False]
    assert not holds_sends("mist", 1)
    with pytest.raises(ValueError, match="unknown engine"):
        keeps_sent_outputs("jax", 1)


def _peaks(plan, prof):
    return [s.peak_memory_bytes for s in simulate_plan(plan, prof).stages]


def test_a_1f1b_stage_s_peak_grows_by_the_outputs_its_engine_keeps():
    """llama-7b on 8 L4, four stages, G 32: the first three stages (b 2, tp 1) hold 3, 2 and 1
    earlier micro-batches; an engine that keeps sent outputs adds one 2·2048·4096·2-byte output per
    held micro-batch to the forward's peak and one more (the current one's) to the backward's, so
    each of those stages' larger of the two grows by one of the two; the last stage sends nothing.
    (DeepSpeed is checked on the plan without ZeRO in fp16, where its pipeline engine runs
    `FP16_Optimizer`, which holds nothing of its own before its step: `rules.deepspeed_buffers`.)"""
    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")
    prof = load_profile(plan.cluster.gpu)
    assert _peaks(replace(plan, engine="megatron"), prof) == _peaks(plan, prof)
    fp16 = replace(plan.training, param_dtype="fp16", compute_dtype="fp16")
    no_zero = replace(plan, training=fp16, stages=tuple(replace(s, zero=0) for s in plan.stages))
    x = 2 * 2048 * 4096 * 2

    def activation_peaks(p):
        return [max(s.fwd_peak_bytes, s.bwd_peak_bytes) for s in simulate_plan(p, prof).stages]

    for engine, base in (("deepspeed", no_zero), ("torchtitan", plan)):
        mist, kept = activation_peaks(base), activation_peaks(replace(base, engine=engine))
        assert kept[-1] == mist[-1]
        for i, held in enumerate((3, 2, 1)):
            assert kept[i] - mist[i] in (held * x, (held + 1) * x), (engine, i)


def test_megatron_frees_an_interleaved_rank_s_outputs(tmp_path):
    """A 2-rank plan with 2 chunks per rank: every rank sends outputs (the last rank from its
    first chunk, to the first rank's second). An interleaved rank of Mist's runtime holds the
    outputs and input gradients it has not waited for yet (`held_sends`), Megatron-LM frees its
    outputs and holds one gradient, so each rank needs more under Mist's runtime, by at most those
    (the peak may lie in another phase without them, so the difference need not be whole
    outputs); a framework that keeps every output (torchtitan) needs more on the first rank."""
    d = json.loads((EXAMPLES / "gpt3-1.3b-2xl4-pp2.json").read_text())
    d["virtual_stages"] = 2
    for s in d["stages"]:
        s["chunk_layers"] = [s["layers"] // 2] * 2
    plan = plan_from_dict(d)
    prof = load_profile("l4")
    mist, megatron = _peaks(plan, prof), _peaks(replace(plan, engine="megatron"), prof)
    titan = _peaks(replace(plan, engine="torchtitan"), prof)
    x = 2 * 2048 * 2048 * 2  # b 2, seq 2048, hidden 2048, fp16
    for r, (a, b) in enumerate(zip(mist, megatron)):
        h = held_sends(r, 2, 2, plan.micro_batches)
        assert 0 < a - b <= (max(h.outputs_forward, h.outputs_backward) + h.gradients - 1) * x
    assert titan[0] > mist[0]  # rank 0 has 5 micro-batch chunks in flight at its peak


def test_the_engine_is_written_only_when_not_mist_and_checked():
    plan = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json")
    assert "engine" not in plan.to_dict()
    d = replace(plan, engine="torchtitan").to_dict()
    assert d["engine"] == "torchtitan" and plan_from_dict(d).engine == "torchtitan"
    assert "priced as torchtitan runs it" in plan_from_dict(d).summary()
    with pytest.raises(MistInputError, match="engine must be one of mist, megatron, deepspeed, torchtitan, got 'jax'"):
        plan_from_dict({**d, "engine": "jax"})


@pytest.mark.parametrize("ranks,chunks", [(2, 2), (4, 2), (3, 3), (8, 4)])
def test_an_interleaved_rank_s_held_sends_do_not_grow_with_the_micro_batches(ranks, chunks):
    """Mist's runtime waits for an interleaved rank's sends where `send_waits` says: the outputs
    it holds (fewer than `OUTPUT_LAG` before a forward, where its saved activations peak; it used
    to keep every in-flight one, (p − r − 1)·2 + (v − 1)·p + 1), the gradients it holds when a
    steady-state backward starts, and what is left for the end of the step (the cool-down's
    gradients) depend on the pipeline's shape, not on G (the runtime used to hold every gradient
    to the end of the step: G·v of them). The frameworks hold one gradient."""
    from mist.rules.interleaved_order import interleaved_one_f_one_b

    for r in range(ranks):
        held = [held_sends(r, ranks, chunks, G) for G in (2 * ranks, 4 * ranks, 8 * ranks)]
        assert held[1] == held[2] and 0 < held[2].gradients <= ranks * chunks, (r, held)
        assert 0 < held[2].outputs_forward < OUTPUT_LAG and held[2].outputs_backward <= OUTPUT_LAG, (r, held)
        left = []
        for G in (4 * ranks, 8 * ranks):
            waited = [w for ws in gradient_waits(r, ranks, chunks, G).values() for w in ws]
            sent = [
                (g, c)
                for kind, g, c in interleaved_one_f_one_b(r, ranks, chunks, G)
                if kind != "F" and (r > 0 or c > 0)
            ]
            assert len(set(waited)) == len(waited) and set(waited) <= set(sent)
            left.append(len(sent) - len(waited))
        assert left[0] == left[1] <= 2 * ranks * chunks, (r, left)


def test_what_an_interleaved_rank_0_holds_where_the_embedding_runs():
    """2 ranks × 2 chunks, G 8: rank 0's allocator peak lies in B0.0, the word table's backward,
    where a listing of its live blocks found 3 other chunk-0 and 1 chunk-1 micro-batch in flight
    (F1.0, F2.0, F3.0, F2.1), 1 sent output not waited for (F2.1's) and 2 sent input gradients
    (B0.1's, B1.1's); the rank's peaks held 1.5 whole micro-batches by `interleaved_in_flight`.
    The same shape under the engines that keep every output or free them."""
    fwd, bwd = held_beside(0, 2, 2, 8, 0, WAITS)
    assert HeldBeside((3, 1), 1, 2) in bwd and HeldBeside((2, 2), 1, 1) in bwd
    # the cool-down's input gradients are waited for at the end of the step
    assert max(h.gradients for h in bwd) == 3 and HeldBeside((0, 0), 0, 0) in fwd
    for sends in (KEEPS, FREES):
        f, b = held_beside(0, 2, 2, 8, 0, sends)
        assert {h.others for h in f} == {h.others for h in fwd} and {h.others for h in b} == {h.others for h in bwd}
        assert all(h.gradients == 1 for h in f + b)
        # (keeping them, every other chunk in flight holds its output: both of rank 0's send one)
        assert all(h.outputs == (0 if sends == FREES else sum(h.others)) for h in f + b)


def test_an_interleaved_rank_s_states_at_its_operations_reach_its_counts_one_at_a_time():
    """`held_at_ops`: over 2-6 ranks, 2-4 chunks and G up to 3p, the most micro-batch chunks in
    any state is the rank's peak (`chunks_in_flight`), and the most sent outputs and input
    gradients in its forward and backward states are `held_sends`' (the gradients' over the
    steady state's backwards; the cool-down's wait for the end of the step); yet in the rank 0
    of 2 ranks × 2 chunks, G 4, no state holds its most chunks, outputs and gradients at once
    (the bound the rank's counts priced its blocks with: +0.63 % of its allocator peak)."""
    for p in range(2, 7):
        for v in range(2, 5):
            for G in range(p, 3 * p + 1, p):
                for r in range(p):
                    fwd, bwd = held_at_ops(r, p, v, G, WAITS)
                    counts = held_sends(r, p, v, G)
                    assert max(sum(h.others) for h in fwd + bwd) == chunks_in_flight(r, p, v, G)
                    assert max(h.outputs for h in fwd) == counts.outputs_forward
                    assert max(h.outputs for h in bwd) == counts.outputs_backward
                    assert max(h.gradients for h in bwd) >= counts.gradients
    fwd, bwd = held_at_ops(0, 2, 2, 4, WAITS)
    most = (chunks_in_flight(0, 2, 2, 4), held_sends(0, 2, 2, 4))
    assert not any((sum(h.others), h.outputs, h.gradients) == (most[0], most[1].outputs_backward, 2) for h in bwd)
    for sends in (KEEPS, FREES):
        f, b = held_at_ops(0, 2, 2, 4, sends)
        assert {h.others for h in f} == {h.others for h in fwd} and all(h.gradients == 1 for h in f + b)


def test_validate_predicts_a_plan_as_mist_s_runtime_runs_it():
    """`mist validate` runs any plan on Mist's runtime, so it puts the measurement next to the
    prediction for Mist's runtime, whatever framework the plan was tuned for."""
    from mist.validate import validate

    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")
    prof = load_profile(plan.cluster.gpu)
    tt = replace(plan, engine="torchtitan")
    assert simulate_plan(tt, prof).to_json() != simulate_plan(plan, prof).to_json()
    assert validate(tt, prof, {}).predicted.to_json() == validate(plan, prof, {}).predicted.to_json()
