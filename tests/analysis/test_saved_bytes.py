"""The symbolic prediction of activation bytes kept for backward equals what a real CPU forward
keeps (measured with saved_tensors_hooks, unique storages, parameters excluded)."""

import pytest
import torch

from mist.analysis import analyze_layer
from mist.models import DecoderBlock, Embedding, Head, TPGroup, init_weights
from mist.models.checkpointing import run_block_as
from mist.specs.model import ModelSpec

SPECS = {
    "gpt": ModelSpec(
        family="gpt",
        num_layers=2,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=512,
        vocab_size=256,
        max_position_embeddings=128,
    ),
    "llama": ModelSpec(
        family="llama",
        num_layers=2,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=352,
        vocab_size=256,
        rotary_fraction=0.25,
    ),
    "falcon": ModelSpec(
        family="falcon",
        num_layers=2,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=512,
        vocab_size=256,
        rotary_fraction=1.0,
        bias=True,
    ),
}
SHAPES = [(1, 16), (2, 40), (3, 64)]


def measure_saved(fn) -> int:
    """Bytes of distinct non-parameter storages that autograd keeps during fn()."""
    seen, keep = {}, []

    def pack(t):
        keep.append(t)
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def run_part(spec, part, tp, flash, recompute, b, s, sp=False):
    torch.manual_seed(0)
    group = TPGroup(tp, tp - 1, None, sequence_parallel=sp)  # a shard built without a process group
    if part == "block":
        m = DecoderBlock(spec, group, flash, torch.float32)
    elif part == "pre":
        m = Embedding(spec, group, torch.float32)
    else:
        m = Head(spec, group, torch.float32)
    init_weights(m, 0)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    # under sequence parallelism a block's and the head's input is this rank's 1/tp of the sequence
    x = torch.randn(b, s // tp if sp else s, spec.hidden_size, requires_grad=True)
    tok = torch.randint(0, spec.vocab_size, (b, s))
    if part == "block":
        seen = measure_saved(lambda: run_block_as(m, x, recompute))
    elif part == "pre":
        seen = measure_saved(lambda: m(tok))
    else:
        seen = measure_saved(lambda: m(x, tok))
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "flash,recompute",
    [
        (True, False),
        (False, False),
        (True, True),
        (False, "attention"),
        (True, "attention"),
        (True, "activation"),
        (False, "attention+activation"),
    ],
)
def test_block_saved_bytes_match_cpu(family, tp, flash, recompute):
    spec = SPECS[family]
    la = analyze_layer(spec, "block", tp=tp, flash=flash, dtype="fp32", target="cpu", recompute=recompute)
    for b, s in SHAPES:
        measured = run_part(spec, "block", tp, flash, recompute, b, s)
        predicted = float(la.saved(b, s))
        assert predicted == pytest.approx(measured, rel=0.01), (b, s, predicted, measured)


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("part", ["pre", "post"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pre_post_saved_bytes_match_cpu(family, part, tp):
    spec = SPECS[family]
    la = analyze_layer(spec, part, tp=tp, dtype="fp32", target="cpu")
    for b, s in SHAPES:
        measured = run_part(spec, part, tp, True, False, b, s)
        assert float(la.saved(b, s)) == pytest.approx(measured, rel=0.01), (b, s)


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("flash,recompute", [(True, False), (False, "attention"), (True, "activation"), (True, True)])
def test_sequence_parallel_block_saved_bytes_match_cpu(family, tp, flash, recompute):
    """Under sequence parallelism (the input a 1/tp shard of the sequence), exact to the byte."""
    spec = SPECS[family]
    la = analyze_layer(
        spec, "block", tp=tp, flash=flash, dtype="fp32", target="cpu", recompute=recompute, sequence_parallel=True
    )
    for b, s in SHAPES:
        measured = run_part(spec, "block", tp, flash, recompute, b, s, sp=True)
        assert float(la.saved(b, s)) == measured, (b, s)


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("part", ["pre", "post"])
def test_sequence_parallel_pre_post_saved_bytes_match_cpu(family, part):
    spec = SPECS[family]
    la = analyze_layer(spec, part, tp=2, dtype="fp32", target="cpu", sequence_parallel=True)
    for b, s in SHAPES:
        assert float(la.saved(b, s)) == run_part(spec, part, 2, True, False, b, s, sp=True), (b, s)


def test_sequence_parallel_block_matches_korthikanti():
    """GPT block, flash, no dropout, bf16, sequence parallelism over t ranks: every saved tensor is
    1/t of the tp = 1 block's (Korthikanti et al. 2022, 34·sbh/t with dropout's 2·sbh masks
    removed), plus the per-token norm statistics."""
    spec = ModelSpec(
        family="gpt",
        num_layers=24,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        ffn_hidden_size=8192,
        vocab_size=50304,
    )
    b, s, h = 2, 2048, 2048
    one = float(analyze_layer(spec, "block", tp=1, flash=True, dtype="bf16", target="cuda").saved(b, s))
    assert one == pytest.approx(32 * s * b * h + 4 * b * 16 * s, rel=0.002)
    for t in (2, 4, 8):
        la = analyze_layer(spec, "block", tp=t, flash=True, dtype="bf16", target="cuda", sequence_parallel=True)
        assert float(la.saved(b, s)) == pytest.approx(one / t, rel=1e-9), t
        plain = analyze_layer(spec, "block", tp=t, flash=True, dtype="bf16", target="cuda")
        # without it the two norms' inputs and outputs (8·sbh) are whole on every rank
        assert float(plain.saved(b, s)) - float(la.saved(b, s)) == pytest.approx(8 * s * b * h * (1 - 1 / t), rel=0.01)


def test_checkpointed_block_keeps_only_its_input():
    spec = SPECS["gpt"]
    la = analyze_layer(spec, "block", tp=2, dtype="bf16", recompute=True)
    b, s = 2, 512
    assert float(la.saved(b, s)) == 2 * b * s * spec.hidden_size


def test_gpu_flash_block_matches_korthikanti_without_dropout():
    """GPT block, flash, no dropout, bf16: 32·sbh plus the fp32 log-sum-exp and norm statistics."""
    spec = ModelSpec(
        family="gpt",
        num_layers=24,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        ffn_hidden_size=8192,
        vocab_size=50304,
    )
    la = analyze_layer(spec, "block", tp=1, flash=True, dtype="bf16", target="cuda")
    b, s, h = 1, 2048, 2048
    sbh = s * b * h
    lse = 4 * b * 16 * s
    assert float(la.saved(b, s)) == pytest.approx(32 * sbh + lse, rel=0.002)
    # non-flash keeps the b·heads·s² softmax output (2 B), no log-sum-exp, and not the causal mask
    # (`_CausalMask`'s backward needs none). For b > 1 the batched matmuls keep contiguous copies of the
    # scaled q, k and v (6sbh) instead of the fused qkv output (6sbh); for b = 1 k and v stay
    # views of the qkv output and only the scaled q (2sbh) is extra.
    la_nf = analyze_layer(spec, "block", tp=1, flash=False, dtype="bf16", target="cuda")
    for b in (1, 2):
        extra = float(la_nf.saved(b, s)) - float(la.saved(b, s))
        expect = 2 * b * 16 * s * s - 4 * b * 16 * s + (2 * s * b * h if b == 1 else 0)
        assert extra == pytest.approx(expect, rel=0.001), b


@pytest.mark.parametrize("name,dropped", [("gpt3-1.3b", "gelu"), ("llama-7b", "swiglu")])
def test_activation_recompute_drops_the_activation_outputs(name, dropped):
    """GELU: with the activation recomputed the block does not keep gelu(y) (f wide, fc2's
    input). SwiGLU: it keeps fc1's [gate | up] (2f) instead of gate, silu(gate), up and the
    product (4f): 2f fewer. Elements of 2 bytes per token; the rest of the block is unchanged."""
    from mist.specs.presets import get_preset

    spec = get_preset(name)
    plain = analyze_layer(spec, "block", tp=2, flash=True, dtype="bf16", target="cuda")
    act = analyze_layer(spec, "block", tp=2, flash=True, dtype="bf16", target="cuda", recompute="activation")
    f = spec.ffn_hidden_size // 2
    per_token = 2 * (f if dropped == "gelu" else 2 * f)
    for b, s in ((1, 2048), (4, 4096)):
        assert float(plain.saved(b, s)) - float(act.saved(b, s)) == per_token * b * s
    # the re-run is the activation's forward, in backward: one elementwise op (three for SwiGLU)
    rerun = [r.op for r in act.records if r.phase == "recompute"]
    assert rerun == (["gelu"] if dropped == "gelu" else ["split", "silu", "mul"])
