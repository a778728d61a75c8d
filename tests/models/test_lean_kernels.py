"""The blocks' lean operators (fused RMSNorm op, in-place rotary on the packed QKV output, SwiGLU
and cross-entropy backwards without extra passes, the causal mask's gradient passed through)
compute what the plain PyTorch formulas do, and Falcon's shared norm output enters the
tensor-parallel region once."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mist.analysis import analyze_layer
from mist.analysis.records import COLLECTIVE, B
from mist.models.attention import rotary_qk_, rotary_tables
from mist.models.collectives import TPGroup
from mist.models.head import vocab_parallel_cross_entropy
from mist.models.mlp import Activation
from mist.models.norms import RMSNorm
from mist.specs.model import ModelSpec


def rms_reference(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotary_reference(x, seq_len, r, base):
    """Rotate-half on the first r dims of x [b, s, heads, d] (the textbook formula)."""
    inv = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    emb = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    return torch.cat((xr * cos + torch.cat((-x2, x1), -1) * sin, xp), -1)


def test_rms_norm_matches_autograd_of_the_formula():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    norm = RMSNorm(16, 1e-5, torch.float32)
    with torch.no_grad():
        norm.weight.normal_()
    w = norm.weight.detach().clone().requires_grad_()
    y, y_ref = norm(x), rms_reference(x, w, 1e-5)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("r", [8, 16])  # partial and whole-head rotary, d = 16
def test_rotary_in_place_matches_rotate_half_on_q_and_k_only(r):
    """Used as the attention uses it: rotate the projection's output, then split it into q, k, v
    (whose backward hands the rotation a fresh concatenated gradient, rotated back in place)."""
    torch.manual_seed(1)
    b, s, hq, hk, d = 2, 7, 4, 2, 16
    sizes = [hq * d, hk * d, hk * d]

    def ours(x):
        return rotary_qk_(x * 1.0, s, r, hq + hk, d, 500.0).split(sizes, dim=-1)

    def reference(x):
        heads = x.view(b, s, -1, d)
        out = torch.cat((rotary_reference(heads[:, :, : hq + hk], s, r, 500.0), heads[:, :, hq + hk :]), 2)
        return out.view(b, s, -1).split(sizes, dim=-1)

    x = torch.randn(b, s, sum(sizes), requires_grad=True)
    got, want = ours(x), reference(x)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    gs = [torch.randn_like(t) for t in got]
    gx = torch.autograd.grad(got, x, gs)[0]
    gx_ref = torch.autograd.grad(want, x, gs)[0]
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    xd = torch.randn(b, s, sum(sizes), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ours, (xd,))


def test_rotary_tables_are_cached_and_not_saved_for_backward():
    a = rotary_tables(9, 8, 10000.0, torch.float32, torch.device("cpu"))
    b = rotary_tables(9, 8, 10000.0, torch.float32, torch.device("cpu"))
    assert a[0].data_ptr() == b[0].data_ptr() and a[1].data_ptr() == b[1].data_ptr()
    kept = []
    x = torch.randn(1, 9, 3 * 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        rotary_qk_(x * 1.0, 9, 8, 2, 16, 10000.0)
    assert kept == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gradients_bit_for_bit(dtype):
    torch.manual_seed(2)
    y = torch.randn(3, 4, 2 * 24, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 4, 24, dtype=dtype)
    out = Activation(True)(y)
    gate, up = y.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert torch.equal(out, ref)
    (gy,) = torch.autograd.grad(out, y, g)
    (gy_ref,) = torch.autograd.grad(ref, y, g)
    assert torch.equal(gy, gy_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_pytorch(dtype):
    torch.manual_seed(3)
    logits = torch.randn(12, 50, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 50, (12,))
    loss = vocab_parallel_cross_entropy(logits * 1.0, target, 0, TPGroup())
    ref = F.cross_entropy(logits.float(), target)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert g.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g.float(), g_ref.float(), rtol=tol, atol=tol * 1e-2)


# activation-sized collectives of a Falcon block at tp 2 (the norm weights' small gradient
# all-reduces under sequence parallelism left out), by (phase, name)
FALCON_TP2 = {
    False: {("fwd", "all_reduce"): 1, ("bwd", "all_reduce"): 1},
    True: {
        ("fwd", "all_gather"): 1,
        ("fwd", "reduce_scatter"): 1,
        ("bwd", "all_gather"): 2,
        ("bwd", "reduce_scatter"): 1,
    },
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_falcon_norm_output_enters_the_tensor_parallel_region_once(sp):
    """Falcon's attention and MLP read one norm output: one all-reduce of the summed input
    gradient in backward; under sequence parallelism one gather forward, and in backward one
    re-gather of the kept shard (beside the gather of the output's gradient) and one
    reduce-scatter. Counted from the announcements the real collectives make where they are
    issued (`mist.models.collectives`); the block used to issue both per linear."""
    spec = ModelSpec(
        family="falcon",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
        vocab_size=256,
        rotary_fraction=1.0,
    )
    la = analyze_layer(spec, "block", tp=2, flash=True, dtype="fp32", sequence_parallel=sp)
    found = Counter((r.phase, r.op) for r in la.records if r.kind == COLLECTIVE and r.params.bytes.has(B))
    assert found == FALCON_TP2[sp]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_causal_mask_passes_its_gradient_through_bit_for_bit(dtype, p):
    """The materialised core's gradients equal those of autograd's own `masked_fill_` backward
    (with attention dropout too, the same masks drawn), and the traced backward has no pass over
    the b·heads·s² gradient for the mask and keeps no mask."""
    from mist.models.attention import AttentionCore

    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 19, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 4, 19, 8, dtype=dtype)
    core = AttentionCore(False, p).train()
    torch.manual_seed(4)
    out = core(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)

    def reference():
        mask = torch.ones(19, 19, dtype=torch.bool).triu(1)
        scores = torch.matmul(q * (1.0 / 8**0.5), k.transpose(-1, -2)).masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p > 0:
            probs = torch.native_dropout(probs, p, True)[0]
        return torch.matmul(probs, v)

    torch.manual_seed(4)
    ref = reference()
    assert torch.equal(out, ref)
    for a, r in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        assert torch.equal(a, r)
    spec = ModelSpec(
        family="gpt", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=4, ffn_hidden_size=64, vocab_size=64
    )
    la = analyze_layer(spec, "block", 1, False, "fp32", "cpu", False)
    assert "masked_fill_" in [r.op for r in la.ops("fwd")]
    assert not [r.op for r in la.ops("bwd") if r.op.startswith("masked_fill")]
