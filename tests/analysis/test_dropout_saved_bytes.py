"""With dropout the symbolic prediction of the bytes kept for backward still equals a real CPU
forward's to the byte (its bool masks and the dropped probabilities included), and the increments
are Korthikanti et al. 2022's: 2·sbh/t for the two hidden-dropout masks, and without flash
3·a·s²·b/t for the attention-probability mask (1 byte) and the dropout's output (2 bytes). The
embedding output's hidden dropout adds its mask to the pre layer: sbh, sbh/t under sequence
parallelism, sbh/cp under context parallelism."""

from dataclasses import replace

import pytest
from test_saved_bytes import SPECS, run_part

from mist.analysis import analyze_layer
from mist.specs.model import ModelSpec

CASES = [  # tp, sequence parallel, flash, recompute: attention dropout only without flash
    (1, False, False, False),
    (2, False, True, "activation"),
    (2, True, False, "attention"),
]


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("tp,sp,flash,recompute", CASES)
def test_block_saved_bytes_with_dropout_match_cpu(family, tp, sp, flash, recompute):
    spec = replace(SPECS[family], hidden_dropout=0.1, attention_dropout=0.0 if flash else 0.1)
    la = analyze_layer(
        spec, "block", tp=tp, flash=flash, dtype="fp32", target="cpu", recompute=recompute, sequence_parallel=sp
    )
    plain = analyze_layer(
        SPECS[family],
        "block",
        tp=tp,
        flash=flash,
        dtype="fp32",
        target="cpu",
        recompute=recompute,
        sequence_parallel=sp,
    )
    h, a = spec.hidden_size, spec.num_heads // tp
    for b, s in ((1, 16), (3, 64)):
        assert float(la.saved(b, s)) == run_part(spec, "block", tp, flash, recompute, b, s, sp=sp), (b, s)
        # the hidden masks (1 byte each; falcon's parallel block: one), on this rank's share
        masks = (1 if spec.parallel_block else 2) * b * s * h // (tp if sp else 1)
        # the probabilities' mask and the dropout's fp32 output, unless the core is recomputed
        attn = 0 if flash or recompute == "attention" else 5 * a * s * s * b
        assert float(la.saved(b, s)) - float(plain.saved(b, s)) == masks + attn, (b, s)


PRE_CASES = [  # tp, sequence parallel, cp
    (1, False, 1),
    (2, False, 1),
    (2, True, 1),
    (2, False, 2),
    (2, True, 2),
]


@pytest.mark.parametrize("family", ["gpt", "llama"])  # learned positions (dropped after), none
@pytest.mark.parametrize("tp,sp,cp", PRE_CASES)
def test_pre_layer_saved_bytes_grow_by_the_embedding_dropout_mask(family, tp, sp, cp):
    spec = replace(SPECS[family], hidden_dropout=0.1)
    la = analyze_layer(spec, "pre", tp=tp, dtype="fp32", target="cpu", sequence_parallel=sp, cp=cp)
    plain = analyze_layer(SPECS[family], "pre", tp=tp, dtype="fp32", target="cpu", sequence_parallel=sp, cp=cp)
    h = spec.hidden_size
    for b, s in ((1, 16), (3, 64)):
        if cp == 1:  # (a CPU run of one context-parallel rank needs its group: the increment only)
            assert float(la.saved(b, s)) == run_part(spec, "pre", tp, True, False, b, s, sp=sp), (b, s)
        # the 1-byte mask of the rank's output: its sequence shard under sp, its positions under cp
        mask = b * s * h // (tp if sp else 1) // cp
        assert float(la.saved(b, s)) - float(plain.saved(b, s)) == mask, (b, s)


GPT_1_3B = ModelSpec(
    family="gpt", num_layers=24, hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192, vocab_size=50304
)


def test_gpu_block_matches_korthikanti_with_dropout():
    """bf16: 34·sbh + 5·a·s²·b without flash (plus, as without dropout, the norm statistics and at
    b = 1 the scaled q's copy; the causal mask is not kept: `_CausalMask` saves nothing), 34·sbh
    with flash and hidden dropout."""
    drop = replace(GPT_1_3B, attention_dropout=0.1, hidden_dropout=0.1)
    h, a, s = 2048, 16, 2048
    nf = analyze_layer(drop, "block", tp=1, flash=False, dtype="bf16", target="cuda")
    nf_plain = analyze_layer(GPT_1_3B, "block", tp=1, flash=False, dtype="bf16", target="cuda")
    for b in (1, 2):
        sbh = s * b * h
        expect = 34 * sbh + 5 * a * s * s * b + (2 * sbh if b == 1 else 0)
        assert float(nf.saved(b, s)) == pytest.approx(expect, rel=0.002), b
        assert float(nf.saved(b, s)) - float(nf_plain.saved(b, s)) == 2 * sbh + 3 * a * s * s * b
    fl = analyze_layer(replace(GPT_1_3B, hidden_dropout=0.1), "block", tp=1, flash=True, dtype="bf16", target="cuda")
    assert float(fl.saved(1, s)) == pytest.approx(34 * s * h + 4 * a * s, rel=0.002)
