"""Stage schedule and memory: breakdowns sum, and each knob moves time/memory the right way."""

import numpy as np
import pytest

from mist.hardware import load_profile
from mist.simulate.stage import StageModel
from mist.simulate.stage_records import StageInput
from mist.specs.presets import get_preset

SPEC = get_preset("gpt3-1.3b")
OFFLOADS = ("offload_weights", "offload_grads", "offload_optimizer", "offload_activations")


@pytest.fixture(scope="module")
def l4_model():
    return StageModel(SPEC, load_profile("l4"), tp=1, flash=True, seq=2048)


def stage(**kw):
    base = dict(
        first=True,
        last=False,
        index=0,
        num_stages=2,
        layers=np.array([12]),
        recompute=np.array([0]),
        b=np.array([2]),
        dp=np.array([2]),
        tp=1,
        zero=np.array([1]),
        offload_weights=np.array([0.0]),
        offload_grads=np.array([0.0]),
        offload_optimizer=np.array([0.0]),
        offload_activations=np.array([0.0]),
        G=8,
        nodes=1,
        gpus_per_node=2,
        cluster_gpus_per_node=4,
    )
    arrays = ("layers", "recompute", "b", "dp", "zero", *OFFLOADS)
    base.update({k: (np.array([v]) if k in arrays and not isinstance(v, np.ndarray) else v) for k, v in kw.items()})
    return StageInput(**base)


def one(r, field):
    return float(np.asarray(getattr(r, field))[0])


def test_breakdowns_sum(l4_model):
    offloaded = dict(
        zero=3, offload_weights=0.5, offload_grads=0.5, offload_optimizer=0.75, offload_activations=0.25, recompute=4
    )
    for kw in ({}, offloaded, dict(last=True, first=False, index=1)):
        r = l4_model.evaluate(stage(**kw))
        assert sum(float(v[0]) for v in r.time_breakdown.values()) == pytest.approx(one(r, "T"), rel=1e-9)
        assert sum(float(v[0]) for v in r.memory_breakdown.values()) == pytest.approx(one(r, "peak"), rel=1e-9)
        assert sum(float(v[0]) for v in r.delta_breakdown.values()) == pytest.approx(one(r, "D"), rel=1e-9)
        assert min(float(v[0]) for v in r.memory_breakdown.values()) >= 0


def test_zero_levels_shrink_memory(l4_model):
    peaks = [one(l4_model.evaluate(stage(zero=z)), "peak") for z in (0, 1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]


def test_recompute_trades_time_for_memory(l4_model):
    a, b = l4_model.evaluate(stage(recompute=0)), l4_model.evaluate(stage(recompute=12))
    assert one(b, "peak") < one(a, "peak")
    assert one(b, "T") > one(a, "T")
    assert float(b.time_breakdown["recompute_s"][0]) > 0 == float(a.time_breakdown["recompute_s"][0])


def test_attention_recompute_sits_between_none_and_full():
    """Without flash the attention core keeps the b·heads·s² softmax output: recomputing only the
    core frees most of a block's activations for a fraction of a full recompute's time."""
    prof = load_profile("l4")
    plain = StageModel(SPEC, prof, tp=1, flash=False, seq=2048)
    attn = StageModel(SPEC, prof, tp=1, flash=False, seq=2048, recompute_attention=True)
    none, full = plain.evaluate(stage(recompute=0)), plain.evaluate(stage(recompute=12))
    core = attn.evaluate(stage(recompute=0))
    assert one(full, "peak") < one(core, "peak") < one(none, "peak")
    assert one(none, "T") < one(core, "T") < one(full, "T")
    rc = float(core.time_breakdown["recompute_s"][0])
    assert 0 < rc < float(full.time_breakdown["recompute_s"][0])
    assert sum(float(v[0]) for v in core.time_breakdown.values()) == pytest.approx(one(core, "T"), rel=1e-9)
    # blocks recomputed whole are unaffected by the flag: all 12 recomputed = the same stage
    both = attn.evaluate(stage(recompute=12))
    assert one(both, "T") == pytest.approx(one(full, "T"), rel=1e-12)
    assert one(both, "peak") == pytest.approx(one(full, "peak"), rel=1e-12)


def test_activation_recompute_frees_a_quarter_of_the_activations_for_little_time():
    """With flash attention a GPT block keeps about 32·sbh bytes; re-running the GELU in fc2's
    backward drops 8·sbh of them (gelu(y), 4h wide) for one elementwise pass per block."""
    prof = load_profile("l4")
    plain = StageModel(SPEC, prof, tp=1, flash=True, seq=2048)
    act = StageModel(SPEC, prof, tp=1, flash=True, seq=2048, recompute_activation=True)
    none, full, sel = plain.evaluate(stage()), plain.evaluate(stage(recompute=12)), act.evaluate(stage())
    sbh = 2 * 2048 * SPEC.hidden_size
    # the peak is the last block's backward of the second in-flight micro-batch: 12 + 11 blocks
    # keep 8·sbh less each. At fc2's backward both blocks hold gelu(y) (re-run, or saved and
    # released only when the node is done) with fc2's weight gradient while its input gradient is
    # made, so the transient is the same
    freed = (12 + 11) * 8 * sbh
    assert one(none, "peak") - one(sel, "peak") == pytest.approx(freed, rel=1e-6)
    assert one(none, "T") < one(sel, "T") < one(full, "T")
    rc, rc_full = float(sel.time_breakdown["recompute_s"][0]), float(full.time_breakdown["recompute_s"][0])
    assert 0 < rc < 0.1 * rc_full
    assert sum(float(v[0]) for v in sel.time_breakdown.values()) == pytest.approx(one(sel, "T"), rel=1e-9)


@pytest.mark.parametrize("knob", OFFLOADS)
def test_offload_frees_memory_and_never_speeds_up(l4_model, knob):
    a = l4_model.evaluate(stage())
    b = l4_model.evaluate(stage(**{knob: 1.0}))
    assert one(b, "peak") < one(a, "peak")
    assert one(b, "T") + one(b, "D") >= one(a, "T") + one(a, "D") - 1e-12


def test_fp32_gradients_cost_memory_and_time(l4_model):
    """fp32 gradients with 16-bit weights: twice the gradient bytes, reduced in fp32, flattened and
    added every micro-batch (autograd cannot accumulate into another dtype in place)."""
    from mist.simulate.precision import Precision

    wide = StageModel(
        SPEC, load_profile("l4"), tp=1, flash=True, seq=2048, precision=Precision(weight_bytes=2, grad_bytes=4)
    )
    for kw in ({}, dict(zero=0), dict(zero=2)):
        a, b = l4_model.evaluate(stage(**kw)), wide.evaluate(stage(**kw))
        ma, mb = a.memory_breakdown, b.memory_breakdown
        assert one_of(mb, "grads_bytes") == pytest.approx(2 * one_of(ma, "grads_bytes"), rel=1e-12)
        assert one_of(mb, "weights_bytes") == one_of(ma, "weights_bytes")
        assert one(b, "peak") > one(a, "peak")
        assert one(b, "T") > one(a, "T")
        if kw.get("zero", 1) <= 1:  # the one reduction after the last micro-batch moves fp32
            assert one(b, "last_extra") > one(a, "last_extra")
        # (the optimizer step reads an fp32 gradient in place: no conversion copy)
        assert one(b, "first_extra") < one(a, "first_extra")


def one_of(breakdown, key):
    return float(np.asarray(breakdown[key])[0])


def test_optimizer_offload_cost_is_one_off(l4_model):
    a = l4_model.evaluate(stage(offload_optimizer=0.0))
    b = l4_model.evaluate(stage(offload_optimizer=1.0))
    assert one(b, "T") == pytest.approx(one(a, "T"), rel=1e-9)
    assert one(b, "D") > one(a, "D")


def test_weights_stepped_on_the_device_are_written_back_to_their_offloaded_store(l4_model):
    """ZeRO 0, weights half offloaded, the whole step on the device: the new working weights'
    offloaded half goes out to the host once per iteration, on the compute stream (measured on an
    H200: the step's one-off grew by about these bytes at the host link's rate), and the store's
    device half is written from the converted master."""
    kw = dict(dp=1, zero=0, b=2)
    plain, off = (l4_model.evaluate(stage(offload_weights=w, **kw)) for w in (0.0, 0.5))
    k = l4_model._batch(stage(**kw))
    prof, wb = l4_model.profile, l4_model.prec.weight_bytes
    per_block = 0.5 * k.P * wb / prof.d2h_bandwidth + prof.memory_op_time("copy", 2 * wb * 0.5 * k.P, False)
    assert one(off, "D") - one(plain, "D") == pytest.approx(12 * float(per_block), rel=1e-6)


def test_a_stream_of_offloading_blocks_exposes_one_block_at_its_ends(l4_model):
    """Offloaded activations: a backward waits for its first block's copy back, and on the last
    stage the backward of the same micro-batch waits for the forward's last copy out (its first
    block's tails), so each phase's stream pays one block beyond its per-block times: the smaller
    of its compute and its copy. An earlier stage's forward never waits for its copies out."""
    kw = dict(b=4, dp=1, zero=0)
    st = stage(offload_activations=0.25, **kw)
    k = l4_model._batch(st)
    tr, _ = l4_model._block_traffic(k, st)
    # (a forward also copies each kept head out of its storage; a copy back, into the rebuilt tensor)
    kept = float(l4_model._kept_copy(k, tr.saved)[0])
    assert kept > 0
    c_f, c_b = float(tr.fwd[0]) + kept, float(tr.bwd[0])
    x_f, x_b = float(l4_model._d2h(0.25 * tr.saved)[0]), float(l4_model._h2d(0.25 * tr.saved)[0]) + kept
    assert x_f > c_f and x_b < c_b  # a transfer-bound forward, a compute-bound backward
    for where in (dict(), dict(last=True, index=1)):
        base = l4_model.components(stage(**kw, **where)).edges
        off = l4_model.components(stage(offload_activations=0.25, **kw, **where)).edges
        assert float(off.bwd[0] - base.bwd[0]) == pytest.approx(x_b, rel=1e-9)
        assert float(off.fwd[0] - base.fwd[0]) == pytest.approx(c_f if where else 0.0, abs=1e-12)


def test_earlier_stages_hold_more_micro_batches(l4_model):
    first = l4_model.evaluate(stage(index=0, num_stages=4, first=False))
    later = l4_model.evaluate(stage(index=3, num_stages=4, first=False, last=False))
    assert one(first, "peak") > one(later, "peak")


def test_without_data_parallelism_the_one_offs_are_the_optimizer_step_and_the_gradient_reset(l4_model):
    a = l4_model.evaluate(stage(dp=1, b=4, zero=0))
    prof = l4_model.profile
    # gradients accumulate in place in each unit's bf16 buffer, zeroed once per iteration
    reset = 12 * prof.memory_op_time("copy", 2 * SPEC.block_params(), True) + prof.memory_op_time(
        "copy", 2 * SPEC.embedding_params(), True
    )
    assert float(a.delta_breakdown["last_microbatch_reduction_s"][0]) == pytest.approx(float(reset), rel=0.02)
    # the gradient norm (one reading pass over the bf16 gradients), the AdamW kernel plus the
    # runtime's passes around it: gradient to fp32 and scaled, master cast into the bf16 weights
    # (per unit)
    units = [SPEC.block_params()] * 12 + [SPEC.embedding_params()]
    step = sum(
        prof.memory_op_time("linalg_vector_norm", 2 * n, False)
        + prof.memory_op_time("copy", 6 * n, False)
        + prof.memory_op_time("mul", 8 * n, False)
        + prof.adam_gpu_s_per_param * n
        + prof.memory_op_time("copy", 6 * n, False)
        for n in units
    )
    assert float(a.delta_breakdown["first_microbatch_optimizer_s"][0]) == pytest.approx(float(step), rel=0.02)


def test_vectorized_matches_scalar(l4_model):
    zs = np.array([0, 1, 2, 3, 1])
    oos = np.array([0, 0, 0.5, 1.0, 0.25])
    rv = l4_model.evaluate(stage(zero=zs, offload_optimizer=oos))
    for i in range(len(zs)):
        rs = l4_model.evaluate(stage(zero=int(zs[i]), offload_optimizer=float(oos[i])))
        assert float(rv.T[i]) == pytest.approx(one(rs, "T"))
        assert float(rv.peak[i]) == pytest.approx(one(rs, "peak"))


def many_candidates(n: int) -> StageInput:
    """n random candidate stages in one input (benchmarks/unit_speed.py times evaluating them)."""
    rng = np.random.default_rng(0)
    return stage(
        zero=rng.integers(0, 4, n),
        offload_weights=rng.choice([0, 0.5, 1], n),
        offload_grads=rng.choice([0, 0.5, 1], n),
        offload_optimizer=rng.random(n),
        offload_activations=rng.random(n),
        recompute=rng.integers(0, 13, n),
    )


def test_many_candidates_at_once(l4_model):
    """One evaluate call prices a whole batch of candidates."""
    n = 20000
    st = many_candidates(n)
    l4_model.evaluate(st)  # warm the traces
    r = l4_model.evaluate(st)
    assert r.T.shape == (n,)


def test_terms_computed_for_every_micro_batch_size_at_once_are_the_same():
    """A tuner's stage model computes each layer's terms at all the micro-batch sizes its stages
    may take, once (`batch_sizes`): each size's times and memory are those of a model that
    computes that size alone, bit for bit, with selective recomputation, activation offload and
    b = 1 (its own trace) among them, and a size outside the set is computed alone."""
    prof = load_profile("l4")
    kw = dict(tp=2, flash=False, seq=2048, recompute_attention=True, sequence_parallel=True)
    alone = StageModel(SPEC, prof, **kw)
    together = StageModel(SPEC, prof, **kw, batch_sizes=(1, 2, 4, 8, 16))
    rng = np.random.default_rng(1)
    for b in (1, 2, 8, 3):
        st = stage(
            b=np.full(6, b),
            tp=2,
            zero=rng.integers(0, 4, 6),
            offload_activations=rng.random(6),
            recompute=rng.integers(0, 13, 6),
        )
        one_size, all_sizes = alone.evaluate(st), together.evaluate(st)
        for name in ("T", "D", "peak", "saved_peak", "fwd"):
            np.testing.assert_array_equal(getattr(one_size, name), getattr(all_sizes, name), err_msg=f"{name}, b {b}")
        np.testing.assert_array_equal(one_size.host["peak_bytes"], all_sizes.host["peak_bytes"])


def test_whole_weights_held_where_each_peak_lies():
    """`states.gathered_weights`, as the runtime's units gather their weights (ZeRO-3) or fetch
    them (offloaded weights): a unit's around its use with the next one's on their way, the
    embedding kept through the step when the head on the stage shares its table, and a stage's
    last unit kept from its forward to its backward while a pipeline's warm-up forwards run. The
    former rule, twice the largest unit everywhere, missed the kept table (GPT-3 7B with ZeRO-3 on
    one stage, at a block's backward: its table and two blocks, 0.38 GB more in bf16) and the kept
    last block."""
    from mist.simulate.states import gathered_weights

    b, e, h = 10.0, 7.0, 1.0  # a block's, the embedding's, the (tied) head's whole weights
    one_stage = gathered_weights(np.array([4]), b, e, h, keep_pre=True, keep_last=0)
    assert float(one_stage.block_bwd[0]) == 2 * b + e  # two blocks and the kept table
    assert float(one_stage.block_fwd[0]) == 2 * b + e
    assert float(one_stage.head_bwd[0]) == h + b + e  # the head, the last block on its way, the table
    assert float(one_stage.head_fwd[0]) == h + e
    assert float(one_stage.pre_bwd[0]) == e
    # a first pipeline stage in its warm-up keeps its last block (no head, untied)
    warm = gathered_weights(np.array([3]), b, e, None, keep_pre=False, keep_last=1)
    assert float(warm.block_fwd[0]) == 3 * b and float(warm.block_bwd[0]) == 2 * b
    assert float(warm.pre_fwd[0]) == e + 2 * b
    steady = gathered_weights(np.array([3]), b, e, None, keep_pre=False, keep_last=0)
    assert float(steady.block_fwd[0]) == 2 * b
    # offloaded weights only: the embedding and the head keep theirs (0), blocks fetch
    off = gathered_weights(np.array([2]), b, 0.0, 0.0, keep_pre=False, keep_last=0)
    assert float(off.block_bwd[0]) == 2 * b and float(off.head_bwd[0]) == b and float(off.pre_fwd[0]) == b
