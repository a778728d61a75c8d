"""The B/W split of a traced layer's backward (`simulate.weight_grad`): which records are W, that
they are priced, and what W keeps alive from B."""

import numpy as np
import pytest
import sympy

from mist.analysis import analyze_layer
from mist.analysis.records import GEMM, GRAD_ACCUM, B, S
from mist.hardware import load_profile
from mist.rules.compiled_blocks import SPLIT
from mist.simulate.layer_terms import layer_terms
from mist.simulate.weight_grad import held_gradient_bytes, is_weight_grad, weight_grad_records
from mist.specs.presets import get_preset

GPT = get_preset("gpt3-1.3b")


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_grad_gemms_are_the_forward_linears(tp):
    """A GPT block: one W GEMM per linear (qkv, attention output, fc1, fc2), priced as GEMMs (the
    copies into .grad are GRAD_ACCUM and not W), with exactly the forward GEMMs' FLOPs — half the
    backward's GEMM FLOPs, a third of the block's; the output gradients W keeps from B are the
    size of the linears' forward outputs."""
    la = analyze_layer(GPT, "block", tp=tp)
    w = weight_grad_records(la.records)
    gemms = [r for r in w if r.kind == GEMM]
    assert len(gemms) == 4 and len(w) == 4  # no bias in gpt3 presets: no bias reductions
    assert not any(is_weight_grad(r) for r in la.records if r.kind == GRAD_ACCUM)
    fwd = [r for r in la.records if r.phase == "fwd" and r.kind == GEMM]
    bwd = [r for r in la.records if r.phase == "bwd" and r.kind == GEMM]
    w_flops = sympy.expand(sum(r.flops for r in gemms))
    assert sympy.expand(w_flops - sum(r.flops for r in fwd)) == 0
    assert sympy.expand(2 * w_flops - sum(r.flops for r in bwd)) == 0
    assert sympy.expand(held_gradient_bytes(la) - sum(r.bytes_written for r in fwd)) == 0


def test_the_heads_weight_gradient_and_the_embeddings():
    """The head's W is its vocabulary GEMM; the embedding's whole backward is W (nothing upstream
    needs an input gradient of token ids)."""
    post = weight_grad_records(analyze_layer(GPT, "post").records)
    assert [r.kind for r in post] == [GEMM]
    pre = analyze_layer(GPT, "pre")
    assert {r.op for r in weight_grad_records(pre.records)} >= {"embedding_dense_backward"}


def test_w_share_of_a_block_backward_on_l4():
    """A gpt3-1.3b block at tp 1 on an L4: W is its share of the backward's kernel time, B the
    rest with the TP collectives; W between a quarter and 60 % of the backward (half its GEMM
    FLOPs, none of its attention)."""
    prof = load_profile("l4")
    lt = layer_terms(GPT, prof, "block", 1, True, 2048, np.array([1.0, 4.0]))
    share = lt.wgrad / lt.bwd
    assert np.all((share > 0.25) & (share < 0.6))
    assert lt.wgrad[1] > 3 * lt.wgrad[0]  # it scales with the tokens
    assert np.all(lt.wgrad_held > 0)


def test_w_releases_the_linears_inputs_that_b_does_not_read():
    """GPT block in bf16, as the ZB-H1 runtime runs its W (the linears in forward order, each
    node's saved tensors released once it has run): the inputs of qkv (the first norm's output),
    fc1 (the second norm's) and fc2 (GeLU's output) are read by their weight-gradient GEMM alone,
    and go as it is done; the attention output is also attention's saved output, read by B, and
    stays. So W's largest addition over its start is a weight gradient less what went before it."""
    from mist.analysis.records import B as b
    from mist.analysis.records import S as s

    la = analyze_layer(GPT, "block")
    h = GPT.hidden_size
    tokens = b * s
    assert sympy.expand(la.weight_pass_freed - (h + h + 4 * h) * 2 * tokens) == 0
    norm_out = h * 2 * tokens
    qkv, proj, fc1, fc2 = (n * h * h * 2 for n in (3, 1, 4, 4))
    want = [qkv, proj - norm_out, fc1 - norm_out, fc2 - 2 * norm_out]
    assert [sympy.expand(c - w) for c, w in zip(la.weight_pass_peak, want)] == [0, 0, 0, 0]
    # a compiled block not split into B and W has no W
    assert analyze_layer(GPT, "block", compiled=True).weight_pass_peak is None


def test_a_compiled_blocks_w_makes_all_its_weight_gradients_at_once():
    """A compiled block split into B and W graphs (`mist.models.weight_split`): its W graph returns
    every parameter's gradient together, and frees each value it starts with after its last use:
    the ones B computed for it and the saved tensors it reads (which B was handed once and left
    to it, `runtime.activations`). At its last operator every weight gradient is live, and all it
    started with but what that operator reads is gone."""
    la = analyze_layer(GPT, "block", compiled=SPLIT)
    last = sympy.expand(la.weight_pass_peak[-1])
    assert last.subs({B: 0, S: 0}) == la.params * 2  # bf16 gradients
    gone = -float(last.subs({B: 4, S: 2048})) + la.params * 2
    started = la.weight_grad_held + la.saved_bytes - la.saved_unread_by_w
    assert float(la.weight_grad_held.subs({B: 4, S: 2048})) < gone < float(started.subs({B: 4, S: 2048}))
    assert la.weight_pass_freed == la.weight_grad_held != 0
