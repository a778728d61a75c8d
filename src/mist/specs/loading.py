"""Turn what the user typed for "the model" into a ModelSpec.

`load_model(arg)` accepts

- a preset name (see `mist.specs.presets`), case-insensitive;
- a JSON or YAML model file whose keys are ModelSpec field names;
- a Hugging Face ``config.json`` (recognised by ``model_type`` / ``architectures``) for the
  Llama, Mistral, Falcon (including the old ``RefinedWebModel`` / ``RefinedWeb`` keys), GPT-2 and
  GPT-NeoX architectures, or a directory that holds one.

Hugging Face configs are parsed as plain JSON: `transformers` is not needed and nothing is
downloaded. Missing secondary fields take the defaults of the matching `transformers` config
class; the core dimensions (layers, hidden size, heads, vocabulary) must be present.

Every problem with the input raises `MistInputError` with one sentence for the user.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from mist.checks import is_int, is_number
from mist.errors import MistInputError
from mist.specs.model import FAMILIES, ModelSpec
from mist.specs.presets import PRESETS
from mist.userfiles import parse_document, read_user_text

REQUIRED_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "tie_embeddings",
)
OPTIONAL_FIELDS = (
    "bias",
    "rotary_fraction",
    "norm_eps",
    "max_position_embeddings",
    "name",
    "rope_theta",
    "gelu_approximate",
    "attention_dropout",
    "hidden_dropout",
)
_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "max_position_embeddings",
)
_BOOL_FIELDS = ("tie_embeddings", "bias")
_FLOAT_FIELDS = ("rotary_fraction", "norm_eps", "rope_theta", "attention_dropout", "hidden_dropout")
_STR_FIELDS = ("family", "name", "gelu_approximate")

HF_MODEL_TYPES = ("llama", "mistral", "falcon", "gpt2", "gpt_neox")
_HF_ALIASES = {"refinedwebmodel": "falcon", "refinedweb": "falcon", "gpt-neox": "gpt_neox"}
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "FalconForCausalLM": "falcon",
    "RWForCausalLM": "falcon",
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
}


# ----------------------------------------------------------------------------- entry points
def load_model(arg: str) -> ModelSpec:
    """A preset name, a model file (JSON/YAML), a Hugging Face config.json or a folder with one."""
    if not isinstance(arg, str) or not arg.strip():
        raise MistInputError("The model must be given as a preset name or a file path.")
    text = arg.strip()
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path / "config.json"
        else:
            raise MistInputError(f"Model folder {text} holds no config.json.")
    if path.exists() and not path.is_file():
        raise MistInputError(f"Model file {path} is not a regular file.")
    if not path.is_file():
        close = difflib.get_close_matches(text.lower(), list(PRESETS), n=3, cutoff=0.6)
        hint = f" (close presets: {', '.join(close)})" if close else ""
        raise MistInputError(f"Unknown model {text!r}: not a preset name or an existing file{hint}.")
    data = _read_mapping(path)
    return load_model_dict(data, str(path), default_name=_name_from_path(path))


def load_model_dict(
    d: dict, source: str = "<dict>", default_name: str | None = None, label: str | None = None
) -> ModelSpec:
    """Build a ModelSpec from a parsed model file or Hugging Face config; `source` names it in
    errors ("Model file SOURCE ..."), or `label` in full (e.g. "The model of plan file X")."""
    label = label or f"Model file {source}"
    if not isinstance(d, dict):
        raise MistInputError(f"{label} must hold a mapping of field names to values, not {type(d).__name__}.")
    if "family" not in d and ("model_type" in d or "architectures" in d):
        return _from_hf(d, source, default_name)
    return _from_fields(d, label, default_name)


# ----------------------------------------------------------------------------- file reading
def _read_mapping(path: Path) -> Any:
    return parse_document(read_user_text(path, "Model file"), path, "Model file")


def _name_from_path(path: Path) -> str:
    if path.name == "config.json" and path.parent.name not in ("", "."):
        return path.parent.name
    return path.stem


# ------------------------------------------------------------------------ ModelSpec-style file
def _from_fields(d: dict, label: str, default_name: str | None) -> ModelSpec:
    allowed = REQUIRED_FIELDS + OPTIONAL_FIELDS
    unknown = [str(k) for k in d if k not in allowed]
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(k, allowed, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise MistInputError(
            f"{label} has unknown field(s) {', '.join(unknown)}{hint}; allowed fields are {', '.join(allowed)}."
        )
    missing = [k for k in REQUIRED_FIELDS if d.get(k) is None]
    if missing:
        raise MistInputError(f"{label} is missing field(s) {', '.join(missing)}.")
    kw = {k: v for k, v in d.items() if v is not None}
    for k, v in kw.items():
        _check_type(k, v, label)
    kw["family"] = kw["family"].strip().lower()
    for k in _FLOAT_FIELDS:
        if k in kw:
            kw[k] = float(kw[k])
    if "name" not in kw and default_name:
        kw["name"] = default_name
    return _build(kw, label)


def _check_type(k: str, v: Any, label: str) -> None:
    if k in _INT_FIELDS:
        ok, want = is_int(v), "an integer"
    elif k in _BOOL_FIELDS:
        ok, want = isinstance(v, bool), "true or false"
    elif k in _FLOAT_FIELDS:
        ok, want = is_number(v), "a number"
    else:  # _STR_FIELDS
        ok, want = isinstance(v, str) and bool(v.strip()), "a non-empty string"
    if not ok:
        raise MistInputError(f"{label}: field {k} must be {want}, got {v!r}.")


def _build(kw: dict, label: str) -> ModelSpec:
    try:
        return ModelSpec(**kw)
    except MistInputError as e:
        msg = str(e)
        raise MistInputError(f"{label}: {msg[:1].lower() + msg[1:]}") from None


# ------------------------------------------------------------------------ Hugging Face configs
def _hf_type(d: dict, source: str) -> str:
    mt = d.get("model_type")
    if isinstance(mt, str) and mt:
        key = _HF_ALIASES.get(mt.lower(), mt.lower())
        if key in HF_MODEL_TYPES:
            return key
        raise MistInputError(
            f"Hugging Face config {source} has model_type {mt!r}, which is not supported "
            f"(supported: {', '.join(HF_MODEL_TYPES)})."
        )
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for a in archs if isinstance(archs, list) else []:
        if isinstance(a, str) and a in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[a]
    raise MistInputError(
        f"Hugging Face config {source} has no supported model_type or architectures entry "
        f"(supported: {', '.join(HF_MODEL_TYPES)})."
    )


class _Cfg:
    """Reads Hugging Face keys (with aliases) and collects the missing required ones."""

    def __init__(self, d: dict, source: str, mt: str) -> None:
        self.d, self.source, self.mt = d, source, mt
        self.missing: list[str] = []

    def get(self, *keys: str, default: Any = None) -> Any:
        for k in keys:
            if self.d.get(k) is not None:
                return self.d[k]
        return default

    def need(self, *keys: str) -> Any:
        v = self.get(*keys)
        if v is None:
            self.missing.append(keys[0])
        return v

    def check(self) -> None:
        if self.missing:
            raise MistInputError(
                f"Hugging Face config {self.source} ({self.mt}) is missing field(s) {', '.join(self.missing)}."
            )

    def flag(self, key: str, default: bool) -> bool:
        v = self.get(key, default=default)
        if not isinstance(v, bool):
            raise MistInputError(f"Hugging Face config {self.source}: field {key} must be true or false, got {v!r}.")
        return v

    def number(self, *keys: str, default: float) -> float:
        v = self.get(*keys, default=default)
        if not is_number(v) or math.isnan(v):
            raise MistInputError(f"Hugging Face config {self.source}: field {keys[0]} must be a number, got {v!r}.")
        return float(v)


def _from_hf(d: dict, source: str, default_name: str | None) -> ModelSpec:
    mt = _hf_type(d, source)
    c = _Cfg(d, source, mt)
    name = d.get("_name_or_path")
    name = name.rstrip("/").split("/")[-1] if isinstance(name, str) and name.strip("/") else None
    name = name or default_name or f"hf-{mt}"
    kw = {"llama": _hf_llama, "mistral": _hf_llama, "falcon": _hf_falcon, "gpt2": _hf_gpt2, "gpt_neox": _hf_gpt_neox}[
        mt
    ](c)
    kw["name"] = name
    return _build(kw, f"Model file {source}")


def _check_head_dim(c: _Cfg, h: Any, a: Any) -> None:
    hd = c.get("head_dim")
    if hd is not None and not is_int(hd):
        raise MistInputError(f"Hugging Face config {c.source}: field head_dim must be an integer, got {hd!r}.")
    if hd is not None and isinstance(h, int) and isinstance(a, int) and a and hd * a != h:
        raise MistInputError(
            f"Hugging Face config {c.source} sets head_dim {hd}, but mist needs "
            f"head_dim = hidden_size / num_attention_heads ({h} / {a})."
        )


DEFAULT_ROPE_THETA = 10000.0  # Hugging Face's default rotary base for these families
# Hugging Face activation names of a GELU MLP → ModelSpec.gelu_approximate (torch's F.gelu form);
# any other activation is costed as the tanh GELU (the same elementwise bytes), and `mist train
# --init-from` refuses it (mist.runtime.hf_layout)
HF_GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def hf_rope(d: dict) -> tuple[Any, str]:
    """(rotary base, rope type) of a Hugging Face config in either spelling: transformers ≥ 5's
    `rope_parameters`, or the older `rope_theta` (GPT-NeoX: `rotary_emb_base`) and `rope_scaling`."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        return rp.get("rope_theta", DEFAULT_ROPE_THETA), str(rp.get("rope_type", rp.get("type", "default")))
    scaling = d.get("rope_scaling")
    kind = str(scaling.get("rope_type", scaling.get("type", "default"))) if isinstance(scaling, dict) else "default"
    return d.get("rope_theta", d.get("rotary_emb_base", DEFAULT_ROPE_THETA)), kind


def _rope_theta(c: _Cfg) -> float:
    theta, _ = hf_rope(c.d)
    if not is_number(theta) or math.isnan(theta):
        raise MistInputError(f"Hugging Face config {c.source}: field rope_theta must be a number, got {theta!r}.")
    return float(theta)


def _hf_llama(c: _Cfg) -> dict:
    # Llama and Mistral share one layout: RMSNorm, SwiGLU, rotary, grouped-query attention.
    mistral = c.mt == "mistral"
    L = c.need("num_hidden_layers")
    h = c.need("hidden_size")
    a = c.need("num_attention_heads")
    V = c.need("vocab_size")
    c.check()
    _check_head_dim(c, h, a)
    # ModelSpec has one bias switch for attention and MLP; either one turns it on
    # (a slight over-count when only the attention projections carry biases).
    bias = c.flag("attention_bias", False) or c.flag("mlp_bias", False)
    return dict(
        family="llama",
        num_layers=L,
        hidden_size=h,
        num_heads=a,
        num_kv_heads=c.get("num_key_value_heads", default=8 if mistral else a),
        ffn_hidden_size=c.get("intermediate_size", default=14336 if mistral else 11008),
        vocab_size=V,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        bias=bias,
        rotary_fraction=c.number("partial_rotary_factor", default=1.0),
        norm_eps=c.number("rms_norm_eps", default=1e-6),
        max_position_embeddings=c.get("max_position_embeddings", default=131072 if mistral else 2048),
        rope_theta=_rope_theta(c),
        attention_dropout=c.number("attention_dropout", default=0.0),  # Llama has no hidden dropout
    )


def _hf_falcon(c: _Cfg) -> dict:
    # New-style "falcon" keys first, then the old RefinedWeb(Model) names.
    L = c.need("num_hidden_layers", "n_layer")
    h = c.need("hidden_size", "n_embed")
    a = c.need("num_attention_heads", "n_head")
    V = c.need("vocab_size")
    c.check()
    # "RefinedWeb" was the 40B-style code: separate KV heads (n_head_kv), always parallel.
    new_arch = c.flag("new_decoder_architecture", str(c.d.get("model_type")) == "RefinedWeb")
    if new_arch:
        kv = c.get("num_kv_heads", "n_head_kv", default=a)
    elif c.flag("multi_query", True):
        kv = 1
    else:
        kv = a
    parallel = new_arch or c.flag("parallel_attn", True)
    alibi = c.flag("alibi", False)
    kw = dict(
        num_layers=L,
        hidden_size=h,
        num_heads=a,
        num_kv_heads=kv,
        ffn_hidden_size=c.get("ffn_hidden_size", default=4 * h if isinstance(h, int) else h),
        vocab_size=V,
        tie_embeddings=c.flag("tie_word_embeddings", True),
        bias=c.flag("bias", False),
        rotary_fraction=0.0 if alibi else 1.0,
        norm_eps=c.number("layer_norm_epsilon", default=1e-5),
        max_position_embeddings=c.get("max_position_embeddings", default=2048),
        rope_theta=_rope_theta(c),
        gelu_approximate=HF_GELUS.get(str(c.get("activation", default="gelu")), "tanh"),
        attention_dropout=c.number("attention_dropout", default=0.0),
        hidden_dropout=c.number("hidden_dropout", default=0.0),
    )
    # The new decoder architecture (Falcon-40B/180B) has two LayerNorms per block; our falcon
    # block has one, so such models come out 2h parameters per layer short.
    # Falcon without parallel attention (Falcon-RW) is a sequential GPT-style block; mapping it
    # to gpt counts learned position embeddings that the real (ALiBi) model does not have.
    kw["family"] = "falcon" if parallel else "gpt"
    return kw


def _hf_gpt2(c: _Cfg) -> dict:
    L = c.need("n_layer", "num_hidden_layers")
    h = c.need("n_embd", "hidden_size")
    a = c.need("n_head", "num_attention_heads")
    V = c.need("vocab_size")
    c.check()
    inner = c.get("n_inner", default=4 * h if isinstance(h, int) else h)
    hidden = c.number("resid_pdrop", default=0.1)
    if c.number("embd_pdrop", default=hidden) != hidden:
        raise MistInputError(
            f"Hugging Face config {c.source}: embd_pdrop {c.get('embd_pdrop')} differs from resid_pdrop {hidden}; "
            "Mist drops the embedding output with the hidden dropout (Megatron-LM's rule), so set them equal."
        )
    return dict(
        family="gpt",
        num_layers=L,
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        ffn_hidden_size=inner,
        vocab_size=V,
        tie_embeddings=c.flag("tie_word_embeddings", True),
        bias=True,
        norm_eps=c.number("layer_norm_epsilon", default=1e-5),
        max_position_embeddings=c.get("n_positions", "max_position_embeddings", default=1024),
        gelu_approximate=HF_GELUS.get(str(c.get("activation_function", default="gelu_new")), "tanh"),
        # GPT2Config's defaults. Its embedding dropout (embd_pdrop) is the hidden dropout, as in
        # Megatron-LM (ModelSpec has one probability for both; GPT-2's released configs set
        # embd_pdrop = resid_pdrop, and a config where they differ is refused above)
        attention_dropout=c.number("attn_pdrop", default=0.1),
        hidden_dropout=hidden,
    )


def _hf_gpt_neox(c: _Cfg) -> dict:
    L = c.need("num_hidden_layers")
    h = c.need("hidden_size")
    a = c.need("num_attention_heads")
    V = c.need("vocab_size")
    c.check()
    parallel = c.flag("use_parallel_residual", True)
    # Approximations (ModelSpec has no exact GPT-NeoX block):
    # - parallel residual -> falcon family: attention and MLP in parallel with rotary, but GPT-NeoX
    #   has two LayerNorms per block where ours has one (2h parameters per layer short);
    # - sequential -> gpt family: right block, but gpt counts learned position embeddings that
    #   GPT-NeoX (rotary) does not have, and the rotary fraction is not modelled.
    return dict(
        family="falcon" if parallel else "gpt",
        num_layers=L,
        hidden_size=h,
        num_heads=a,
        num_kv_heads=a,
        ffn_hidden_size=c.get("intermediate_size", default=4 * h if isinstance(h, int) else h),
        vocab_size=V,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        bias=c.flag("attention_bias", True),
        rotary_fraction=c.number("rotary_pct", "partial_rotary_factor", default=0.25),
        norm_eps=c.number("layer_norm_eps", default=1e-5),
        max_position_embeddings=c.get("max_position_embeddings", default=2048),
        attention_dropout=c.number("attention_dropout", default=0.0),
        hidden_dropout=c.number("hidden_dropout", default=0.0),
    )


__all__ = ["load_model", "load_model_dict", "REQUIRED_FIELDS", "OPTIONAL_FIELDS", "FAMILIES"]
