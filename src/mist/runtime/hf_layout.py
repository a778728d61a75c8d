"""Where each parameter of Mist's model lives in a Hugging Face checkpoint, per family.

This module is the one home of the name and layout rules that `mist train --init-from` (reading)
and `--save-hf` (writing) both apply. It is plain Python (no torch): a Mist parameter of the full
(unsharded) model is a stack of row blocks, each a `Piece` of one Hugging Face tensor:

    Mist rows [m_lo, m_lo + n)  <-  rows [hf_lo, hf_lo + n) of the HF tensor `hf_name`
                                    (its columns when `transposed`: GPT-2's Conv1D stores W^T)

Reading takes the pieces in order; writing puts each piece back where it came from. Fused
layouts differ per family and are all expressed as such row blocks:

- Llama / Mistral: ``q_proj | k_proj | v_proj`` stacked into Mist's ``qkv``; ``gate_proj | up_proj``
  into ``fc1``. Both Mist and Hugging Face's Llama rotate the two halves of each head
  ("rotate_half"; HF's checkpoints already carry the permutation from Meta's interleaved pairs),
  so q and k rows are copied unchanged.
- GPT-2: ``c_attn`` is Conv1D (stored [in, out]): its columns [0, h), [h, 2h), [2h, 3h) are q, k, v.
- Falcon, fused ``query_key_value``: multi-query (one KV head) is [q heads | k | v] as in Mist;
  classic multi-head interleaves per head [q_i, k_i, v_i]; the new decoder architecture groups
  per KV head [q heads of the group…, k_j, v_j]. Each head (head_dim rows) is one piece.

`refusal` names what a checkpoint config has that Mist's model does not compute exactly (one
sentence), and `hf_config` writes the config.json of a ModelSpec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mist.specs.loading import HF_GELUS, hf_rope
from mist.specs.model import ModelSpec


@dataclass(frozen=True)
class Piece:
    """Mist rows [m_lo, m_lo + n) are rows [hf_lo, hf_lo + n) of `hf_name` (columns if transposed)."""

    hf_name: str
    m_lo: int
    hf_lo: int
    n: int
    transposed: bool = False


@dataclass(frozen=True)
class HFArch:
    """How a checkpoint stores the model: its model_type and, for Falcon, the fused qkv layout
    ("mqa", "per_head" or "grouped")."""

    model_type: str
    qkv_layout: str = ""

    @property
    def architecture(self) -> str:
        return {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "gpt2": "GPT2LMHeadModel",
            "falcon": "FalconForCausalLM",
        }[self.model_type]


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the checkpoint: its name and full shape."""

    name: str
    shape: tuple[int, ...]


# ----------------------------------------------------------------------------- arch choice
def arch_of_config(cfg: dict[str, Any]) -> HFArch:
    """The layout of a checkpoint, from its config.json (already accepted by `refusal`)."""
    mt = _model_type(cfg)
    if mt != "falcon":
        return HFArch(mt)
    if cfg.get("new_decoder_architecture"):
        return HFArch(mt, "grouped")
    return HFArch(mt, "mqa" if cfg.get("multi_query", True) else "per_head")


def arch_of_spec(spec: ModelSpec) -> HFArch:
    """The layout `--save-hf` writes a ModelSpec in."""
    if spec.family == "llama":
        return HFArch("llama")
    if spec.family == "gpt":
        return HFArch("gpt2")
    return HFArch("falcon", "mqa" if spec.num_kv_heads == 1 else "grouped")


def _model_type(cfg: dict[str, Any]) -> str:
    mt = str(cfg.get("model_type", "")).lower()
    aliases = {"refinedwebmodel": "falcon", "refinedweb": "falcon", "gpt-neox": "gpt_neox"}
    if mt:
        return aliases.get(mt, mt)
    archs = cfg.get("architectures") or []
    names = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "GPT2LMHeadModel": "gpt2",
        "FalconForCausalLM": "falcon",
        "RWForCausalLM": "falcon",
        "GPTNeoXForCausalLM": "gpt_neox",
    }
    for a in archs if isinstance(archs, list) else [archs]:
        if a in names:
            return names[a]
    return ""


# ----------------------------------------------------------------------------- exactness


def refusal(cfg: dict[str, Any], spec: ModelSpec, seq_len: int, source: str) -> str | None:
    """Why Mist's model would not compute what this checkpoint computes (one sentence), or None.

    `spec` is the ModelSpec that `mist.specs.loading` reads from the same config."""
    mt = _model_type(cfg)
    pre = f"Checkpoint {source}"
    if mt == "gpt_neox":
        return (
            f"{pre} is a GPT-NeoX model, which Mist cannot load exactly: its blocks have two LayerNorms "
            "(parallel residual) or rotary positions without learned ones (sequential), and no Mist family has either."
        )
    if mt in ("llama", "mistral"):
        if cfg.get("hidden_act", "silu") != "silu":
            return f"{pre} uses activation {cfg.get('hidden_act')!r}; Mist's Llama MLP computes SwiGLU with silu."
        if bool(cfg.get("attention_bias", False)) != bool(cfg.get("mlp_bias", False)):
            return f"{pre} has biases in only one of attention and MLP; Mist's model has them in both or in neither."
        if spec.rotary_fraction != 1.0:
            return f"{pre} sets partial_rotary_factor {spec.rotary_fraction}, which Hugging Face's Llama ignores."
        window = cfg.get("sliding_window")
        if mt == "mistral" and isinstance(window, int) and window < seq_len:
            return (
                f"{pre} attends within a sliding window of {window} tokens, shorter than the plan's sequence {seq_len}."
            )
    if mt == "falcon":
        if cfg.get("alibi"):
            return f"{pre} uses ALiBi positions; Mist's Falcon uses rotary positions."
        new = bool(cfg.get("new_decoder_architecture", str(cfg.get("model_type")) == "RefinedWeb"))
        if not new and not cfg.get("parallel_attn", True):
            return f"{pre} is a sequential Falcon (parallel_attn false), which no Mist family computes."
        if new and cfg.get("num_ln_in_parallel_attn") in (None, 2):
            return (
                f"{pre} has two LayerNorms per block (new decoder architecture); Mist's Falcon block has one "
                "(num_ln_in_parallel_attn 1)."
            )
        if cfg.get("activation", "gelu") not in HF_GELUS:
            return f"{pre} uses activation {cfg.get('activation')!r}; Mist's MLP computes GELU ({', '.join(HF_GELUS)})."
    if mt == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in HF_GELUS:
            return f"{pre} uses activation {act!r}; Mist's MLP computes GELU ({', '.join(HF_GELUS)})."
        if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False):
            return f"{pre} scales attention differently from Mist's 1/sqrt(head_dim)."
    if spec.uses_rotary:
        _, kind = hf_rope(cfg)  # the base itself is the spec's rope_theta (compared with the plan's)
        if kind != "default":
            return f"{pre} scales its rotary frequencies ({kind}); Mist's rotary has no scaling."
    return None


def save_refusal(spec: ModelSpec) -> str | None:
    """Why `--save-hf` cannot write this model as a Hugging Face checkpoint, or None."""
    if spec.family == "gpt" and (not spec.bias or spec.num_kv_heads != spec.num_heads):
        return "--save-hf writes gpt models as GPT-2, which has biases and one KV head per query head; this plan's model does not."
    if spec.rotary_fraction != 1.0:
        return f"--save-hf cannot write rotary_fraction {spec.rotary_fraction}: Hugging Face's {spec.family.capitalize()} rotates whole heads."
    return None


# ----------------------------------------------------------------------------- the tables
def _hf_prefixes(arch: HFArch) -> tuple[str, str]:
    """(prefix of the model's top-level tensors, of block i's tensors with {i})."""
    if arch.model_type in ("llama", "mistral"):
        return "model.", "model.layers.{i}."
    return "transformer.", "transformer.h.{i}."


def _stack(*parts: tuple[str, int], transposed: bool = False, hf_lo: int = 0) -> tuple[Piece, ...]:
    """Whole HF tensors (name, rows) stacked in order."""
    out, m = [], 0
    for name, n in parts:
        out.append(Piece(name, m, hf_lo, n, transposed))
        m += n
    return tuple(out)


def _falcon_qkv(name: str, spec: ModelSpec, layout: str, rows_per_head: int) -> tuple[Piece, ...]:
    """Mist's [q heads | k heads | v heads] from Falcon's fused query_key_value (rows_per_head:
    head_dim for weights and biases alike)."""
    H, KV, d = spec.num_heads, spec.num_kv_heads, rows_per_head
    if layout == "mqa":
        return (Piece(name, 0, 0, (H + 2 * KV) * d),)
    src: list[int] = []  # the HF head index of each Mist head, in Mist order (q…, k…, v…)
    if layout == "per_head":  # [q_i, k_i, v_i] per head
        src = [3 * i for i in range(H)] + [3 * i + 1 for i in range(KV)] + [3 * i + 2 for i in range(KV)]
    else:  # grouped: [q heads of group j…, k_j, v_j] per KV head
        r = H // KV
        src = [(i // r) * (r + 2) + i % r for i in range(H)]
        src += [j * (r + 2) + r for j in range(KV)] + [j * (r + 2) + r + 1 for j in range(KV)]
    return tuple(Piece(name, m * d, s * d, d) for m, s in enumerate(src))


def mist_pieces(spec: ModelSpec, arch: HFArch) -> dict[str, tuple[Piece, ...]]:
    """Every parameter name of Mist's full model → its row blocks in the checkpoint."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    H, KV = spec.num_heads, spec.num_kv_heads
    top, blk = _hf_prefixes(arch)
    out: dict[str, tuple[Piece, ...]] = {}
    mt = arch.model_type
    llama = mt in ("llama", "mistral")
    gpt2 = mt == "gpt2"
    biases = ("weight", "bias") if spec.bias else ("weight",)
    norm_parts = ("weight",) if spec.family == "llama" else ("weight", "bias")

    def one(mist: str, hf: str, rows: int, transposed: bool = False) -> None:
        out[mist] = (Piece(hf, 0, 0, rows, transposed),)

    word = {"gpt2": "wte", "falcon": "word_embeddings"}.get(mt, "embed_tokens")
    one("embedding.word", f"{top}{word}.weight", spec.vocab_size)
    if gpt2:
        one("embedding.position", f"{top}wpe.weight", spec.max_position_embeddings)
    for i in range(spec.num_layers):
        b, m = blk.format(i=i), f"blocks.{i}."
        if llama:
            n1, n2 = "input_layernorm", "post_attention_layernorm"
            att, mlp = f"{b}self_attn.", f"{b}mlp."
            for p in biases:
                out[m + f"attn.qkv.{p}"] = _stack(
                    (f"{att}q_proj.{p}", H * d), (f"{att}k_proj.{p}", KV * d), (f"{att}v_proj.{p}", KV * d)
                )
                one(m + f"attn.dense.{p}", f"{att}o_proj.{p}", h)
                out[m + f"mlp.fc1.{p}"] = _stack((f"{mlp}gate_proj.{p}", f), (f"{mlp}up_proj.{p}", f))
                one(m + f"mlp.fc2.{p}", f"{mlp}down_proj.{p}", h)
        elif gpt2:
            n1, n2 = "ln_1", "ln_2"
            for p in biases:
                t = p == "weight"  # Conv1D weights are stored [in, out]
                one(m + f"attn.qkv.{p}", f"{b}attn.c_attn.{p}", 3 * h, t)
                one(m + f"attn.dense.{p}", f"{b}attn.c_proj.{p}", h, t)
                one(m + f"mlp.fc1.{p}", f"{b}mlp.c_fc.{p}", f, t)
                one(m + f"mlp.fc2.{p}", f"{b}mlp.c_proj.{p}", h, t)
        else:  # falcon
            n1, n2 = "input_layernorm", ""
            att, mlp = f"{b}self_attention.", f"{b}mlp."
            for p in biases:
                out[m + f"attn.qkv.{p}"] = _falcon_qkv(f"{att}query_key_value.{p}", spec, arch.qkv_layout, d)
                one(m + f"attn.dense.{p}", f"{att}dense.{p}", h)
                one(m + f"mlp.fc1.{p}", f"{mlp}dense_h_to_4h.{p}", f)
                one(m + f"mlp.fc2.{p}", f"{mlp}dense_4h_to_h.{p}", h)
        for p in norm_parts:
            one(m + f"norm1.{p}", f"{b}{n1}.{p}", h)
            if n2:
                one(m + f"norm2.{p}", f"{b}{n2}.{p}", h)
    final = "norm" if llama else "ln_f"
    for p in norm_parts:
        one(f"head.norm.{p}", f"{top}{final}.{p}", h)
    if not spec.tie_embeddings:
        one("head.weight", "lm_head.weight", spec.vocab_size)
    return out


def hf_tensors(spec: ModelSpec, arch: HFArch) -> dict[str, HFTensor]:
    """Every tensor the checkpoint must hold (name → full shape), from the pieces."""
    h = spec.hidden_size
    rows: dict[str, int] = {}
    vector: set[str] = set()
    transposed: set[str] = set()
    cols: dict[str, int] = {}
    for mist, pieces in mist_pieces(spec, arch).items():
        for pc in pieces:
            rows[pc.hf_name] = max(rows.get(pc.hf_name, 0), pc.hf_lo + pc.n)
            if pc.transposed:
                transposed.add(pc.hf_name)
            if mist.endswith((".bias", "norm1.weight", "norm2.weight", "norm.weight")):
                vector.add(pc.hf_name)
            # the input width of a Mist matrix: the FFN width for fc2, the hidden size otherwise
            cols[pc.hf_name] = spec.ffn_hidden_size if ".mlp.fc2." in mist else h
    out = {}
    for name, n in rows.items():
        if name in vector:
            shape: tuple[int, ...] = (n,)
        elif name in transposed:
            shape = (cols[name], n)
        else:
            shape = (n, cols[name])
        out[name] = HFTensor(name, shape)
    return out


# ----------------------------------------------------------------------------- config.json
# the Hugging Face activation name written for each GELU form (both in transformers' ACT2FN)
_HF_GELU_NAME = {"tanh": "gelu_pytorch_tanh", "none": "gelu"}


def hf_config(spec: ModelSpec, dtype: str = "float32") -> dict[str, Any]:
    """The Hugging Face config.json of a ModelSpec (call `save_refusal` first)."""
    arch = arch_of_spec(spec)
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    common: dict[str, Any] = {"architectures": [arch.architecture], "model_type": arch.model_type, "dtype": dtype}
    common["tie_word_embeddings"] = spec.tie_embeddings
    common["vocab_size"] = spec.vocab_size
    if arch.model_type == "llama":
        return {
            **common,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": spec.norm_eps,
            "max_position_embeddings": spec.max_position_embeddings,
            "attention_bias": spec.bias,
            "mlp_bias": spec.bias,
            "rope_parameters": rope,
            "rope_theta": spec.rope_theta,
            "attention_dropout": spec.attention_dropout,  # Llama has no hidden dropout
        }
    if arch.model_type == "gpt2":
        return {
            **common,
            "n_embd": spec.hidden_size,
            "n_head": spec.num_heads,
            "n_layer": spec.num_layers,
            "n_inner": spec.ffn_hidden_size,
            "n_positions": spec.max_position_embeddings,
            "layer_norm_epsilon": spec.norm_eps,
            "activation_function": _HF_GELU_NAME[spec.gelu_approximate],
            # the plan's dropout (Mist drops the embedding output with the hidden dropout)
            "attn_pdrop": spec.attention_dropout,
            "embd_pdrop": spec.hidden_dropout,
            "resid_pdrop": spec.hidden_dropout,
        }
    grouped = arch.qkv_layout == "grouped"
    return {
        **common,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "multi_query": not grouped,
        "new_decoder_architecture": grouped,
        "num_ln_in_parallel_attn": 1 if grouped else None,
        "parallel_attn": True,
        "alibi": False,
        "bias": spec.bias,
        "layer_norm_epsilon": spec.norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "activation": _HF_GELU_NAME[spec.gelu_approximate],
        "rope_parameters": rope,
        "rope_theta": spec.rope_theta,
        "attention_dropout": spec.attention_dropout,
        "hidden_dropout": spec.hidden_dropout,  # (Falcon has no embedding dropout, Mist does)
    }


__all__ = [
    "Piece",
    "HFArch",
    "HFTensor",
    "arch_of_config",
    "arch_of_spec",
    "refusal",
    "save_refusal",
    "mist_pieces",
    "hf_tensors",
    "hf_config",
]
