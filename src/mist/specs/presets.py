"""Named model presets: the paper's evaluation models and a few real open models.

Paper models (the Mist paper's evaluation): vocabulary 50304, multi-head attention (num_kv_heads equal to
num_heads), no linear biases and an untied LM head.

- ``gpt3-<size>``: GPT family (LayerNorm, GELU, learned positions), FFN 4h.
- ``llama-<size>``: Llama family (RMSNorm, SwiGLU), rotary on 25 % of the head dims, the
  paper's "Llama FFN" column.
- ``falcon-<size>``: Falcon family with the GPT dims (parallel attention + MLP, FFN 4h,
  rotary on 25 % of the head dims).

Naming clash: the paper's 7B Falcon is called ``falcon-paper-7b`` because ``falcon-7b`` is the
real TII Falcon-7B (h 4544, 71 heads, multi-query attention, vocabulary 65024, tied head).
So the paper Falcon presets are ``falcon-1.3b``, ``falcon-2.7b``, ``falcon-paper-7b``,
``falcon-13b`` and ``falcon-22b``; ``falcon-7b`` and ``falcon-40b`` are the real models.

Real models (``llama2-*``, ``llama3-*``, ``falcon-7b``, ``falcon-40b``) use their published
dimensions, vocabulary, normalisation epsilon and context length.
"""

from __future__ import annotations

import difflib

from mist.errors import MistInputError
from mist.specs.model import ModelSpec

PAPER_VOCAB = 50304

# size: (num_layers, hidden_size, num_heads, gpt_ffn, llama_ffn)
_PAPER_DIMS: dict[str, tuple[int, int, int, int, int]] = {
    "1.3b": (24, 2048, 16, 8192, 5632),
    "2.7b": (32, 2560, 32, 10240, 6912),
    "7b": (32, 4096, 32, 16384, 11008),
    "13b": (40, 5120, 40, 20480, 13824),
    "22b": (48, 6144, 64, 24576, 16384),
    "40b": (48, 8192, 64, 32768, 22016),
}
_LLAMA_70B = (80, 8192, 64, 28672)

_GPT_SIZES = ("1.3b", "2.7b", "7b", "13b", "22b", "40b")
_LLAMA_SIZES = ("1.3b", "2.7b", "7b", "13b", "22b", "40b")
_FALCON_SIZES = ("1.3b", "2.7b", "7b", "13b", "22b")


def _paper(name: str, family: str, L: int, h: int, a: int, ffn: int, rotary_fraction: float = 1.0) -> ModelSpec:
    return ModelSpec(
        family=family,
        num_layers=L,
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        ffn_hidden_size=ffn,
        vocab_size=PAPER_VOCAB,
        tie_embeddings=False,
        bias=False,
        rotary_fraction=rotary_fraction,
        norm_eps=1e-5,
        max_position_embeddings=8192,
        name=name,
    )


def _build() -> dict[str, ModelSpec]:
    p: dict[str, ModelSpec] = {}
    for size in _GPT_SIZES:
        L, h, a, gpt_ffn, _ = _PAPER_DIMS[size]
        p[f"gpt3-{size}"] = _paper(f"gpt3-{size}", "gpt", L, h, a, gpt_ffn)
    for size in _LLAMA_SIZES:
        L, h, a, _, llama_ffn = _PAPER_DIMS[size]
        p[f"llama-{size}"] = _paper(f"llama-{size}", "llama", L, h, a, llama_ffn, 0.25)
    L, h, a, ffn = _LLAMA_70B
    p["llama-70b"] = _paper("llama-70b", "llama", L, h, a, ffn, 0.25)
    for size in _FALCON_SIZES:
        L, h, a, gpt_ffn, _ = _PAPER_DIMS[size]
        name = "falcon-paper-7b" if size == "7b" else f"falcon-{size}"
        p[name] = _paper(name, "falcon", L, h, a, gpt_ffn, 0.25)

    # ---- real models ---------------------------------------------------------------
    def real(name, family, L, h, a, kv, ffn, vocab, ctx, tie=False, rope_theta=10000.0, gelu="tanh"):
        p[name] = ModelSpec(
            family=family,
            num_layers=L,
            hidden_size=h,
            num_heads=a,
            num_kv_heads=kv,
            ffn_hidden_size=ffn,
            vocab_size=vocab,
            tie_embeddings=tie,
            bias=False,
            rotary_fraction=1.0,
            norm_eps=1e-5,
            max_position_embeddings=ctx,
            name=name,
            rope_theta=rope_theta,
            gelu_approximate=gelu,
        )

    real("llama2-7b", "llama", 32, 4096, 32, 32, 11008, 32000, 4096)
    real("llama2-13b", "llama", 40, 5120, 40, 40, 13824, 32000, 4096)
    real("llama2-70b", "llama", 80, 8192, 64, 8, 28672, 32000, 4096)
    real("llama3-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0)
    real("llama3-70b", "llama", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0)
    real("falcon-7b", "falcon", 32, 4544, 71, 1, 18176, 65024, 2048, tie=True, gelu="none")  # exact GELU
    # The real Falcon-40B ("new decoder architecture") has two LayerNorms per block (one for
    # attention, one for the MLP); our falcon block has one, so this preset is 2h parameters
    # per layer (about 1M in total) short of the real count.
    real("falcon-40b", "falcon", 60, 8192, 128, 8, 32768, 65024, 2048, tie=True, gelu="none")
    return p


PRESETS: dict[str, ModelSpec] = _build()


def get_preset(name: str) -> ModelSpec:
    """Return the preset called `name` (case-insensitive); unknown names raise MistInputError."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(str(key), list(PRESETS), n=3, cutoff=0.5)
    hint = (
        f"did you mean {', '.join(close)}?"
        if close
        else (f"known presets include {', '.join(list(PRESETS)[:4])} (see mist.specs.presets).")
    )
    raise MistInputError(f"Unknown model preset {name!r}; {hint}")


def preset_ref(model: ModelSpec) -> str | None:
    """The preset name that stands for `model` in a plan file, or None when it is not a preset
    (the plan then carries the full spec)."""
    key = model.name.strip().lower() if model.name else None
    return key if key in PRESETS and PRESETS[key] == model else None
