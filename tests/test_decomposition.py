"""benchmarks/decomposition.py: the operator classes it assigns to a traced block's operators."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decomposition  # noqa: E402
from mist.analysis.layer import analyze_layer  # noqa: E402
from mist.specs.presets import get_preset  # noqa: E402


def _labels(model: str, phase: str, flash: bool = True) -> list[str]:
    spec = get_preset(model)
    la = analyze_layer(spec, "block", 1, flash, "fp16", "cuda", False)
    return decomposition.classify(la.ops(phase), phase, bool(spec.rotary_dim))


def test_gpt_block_forward_is_the_original_sequence():
    assert _labels("gpt3-1.3b", "fwd") == [
        "norms",
        "gemm",
        "attn core",
        "gemm",
        "residual",
        "norms",
        "gemm",
        "activation",
        "gemm",
        "residual",
    ]


def test_gpt_block_backward_and_unfused_attention_classes():
    bwd = Counter(_labels("gpt3-1.3b", "bwd"))
    assert bwd["gemm"] == 8 and bwd["attn core"] == 1 and bwd["norms"] == 2 and bwd["residual"] == 2
    assert bwd["copies"] == 1  # the cat of the q/k/v gradients into the fused QKV gradient
    fwd = Counter(_labels("gpt3-1.3b", "fwd", flash=False))
    assert fwd["attn core"] == 2 and fwd["softmax/mask"] == 5 and fwd["copies"] == 4


def test_llama_block_forward_classes():
    fwd = Counter(_labels("llama-7b", "fwd"))
    assert fwd["gemm"] == 4 and fwd["attn core"] == 1 and fwd["residual"] == 2
    assert fwd["activation"] == 2  # silu and the gating product
    assert fwd["norms"] == 2  # one fused RMSNorm kernel each
    assert fwd["rotary"] == 3  # roll, and the in-place product and multiply-add on q and k together
    bwd = Counter(_labels("llama-7b", "bwd"))
    assert bwd["norms"] == 2 and bwd["rotary"] == 3 and bwd["copies"] == 1 and bwd["activation"] == 3
