"""ModelSpec presets, parameter counts and model loading (presets, model files, HF configs)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from mist.errors import MistInputError
from mist.specs.loading import load_model, load_model_dict
from mist.specs.model import ModelSpec
from mist.specs.presets import PRESETS, get_preset

DATA = Path(__file__).parent / "data"
HF = DATA / "hf"


def one_sentence(msg: str) -> bool:
    """One line, ends like a sentence, and no second sentence starts inside it.

    (A message may start with a lower-case field name such as ``hidden_size``.)
    """
    return "\n" not in msg and msg == msg.strip() and msg[-1] in ".?" and not re.search(r"[.?!]\s+[A-Z]", msg)


def raises_one_sentence(fn, *args, match: str | None = None, **kw) -> str:
    with pytest.raises(MistInputError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert one_sentence(msg), msg
    if match is not None:
        assert re.search(match, msg), msg
    return msg


# ------------------------------------------------------------------------------- presets
def test_every_preset_validates_and_is_named():
    assert len(PRESETS) >= 25
    for name, spec in PRESETS.items():
        assert isinstance(spec, ModelSpec)
        spec.check()
        assert spec.name == name
        assert get_preset(name) is spec
        assert get_preset(name.upper()) is spec


def test_paper_presets_follow_the_reference():
    for name, spec in PRESETS.items():
        if name.startswith(("gpt3-", "llama-")) or (
            name.startswith("falcon-") and name not in ("falcon-7b", "falcon-40b")
        ):
            assert spec.vocab_size == 50304, name
            assert spec.num_kv_heads == spec.num_heads, name
            assert not spec.bias and not spec.tie_embeddings, name
    for size in ("1.3b", "2.7b", "7b", "13b", "22b", "40b"):
        g = get_preset(f"gpt3-{size}")
        assert g.family == "gpt" and g.ffn_hidden_size == 4 * g.hidden_size
        ll = get_preset(f"llama-{size}")
        assert ll.family == "llama" and ll.rotary_fraction == 0.25
        assert (ll.num_layers, ll.hidden_size, ll.num_heads) == (g.num_layers, g.hidden_size, g.num_heads)
    dims = {n: (s.num_layers, s.hidden_size, s.num_heads) for n, s in PRESETS.items()}
    assert dims["gpt3-1.3b"] == (24, 2048, 16)
    assert dims["gpt3-2.7b"] == (32, 2560, 32)
    assert dims["gpt3-7b"] == (32, 4096, 32)
    assert dims["gpt3-13b"] == (40, 5120, 40)
    assert dims["gpt3-22b"] == (48, 6144, 64)
    assert dims["gpt3-40b"] == (48, 8192, 64)
    assert dims["llama-70b"] == (80, 8192, 64)
    llama_ffn = [get_preset(f"llama-{s}").ffn_hidden_size for s in ("1.3b", "2.7b", "7b", "13b", "22b", "40b", "70b")]
    assert llama_ffn == [5632, 6912, 11008, 13824, 16384, 22016, 28672]
    # Paper Falcon: GPT dims, parallel block, rotary 0.25; its 7B is renamed falcon-paper-7b.
    for name, gpt in (
        ("falcon-1.3b", "gpt3-1.3b"),
        ("falcon-2.7b", "gpt3-2.7b"),
        ("falcon-paper-7b", "gpt3-7b"),
        ("falcon-13b", "gpt3-13b"),
        ("falcon-22b", "gpt3-22b"),
    ):
        f, g = get_preset(name), get_preset(gpt)
        assert f.family == "falcon" and f.parallel_block and f.rotary_fraction == 0.25
        assert replace(f, family="gpt", rotary_fraction=1.0, name=g.name) == g


def test_real_falcon_7b_is_not_the_paper_one():
    f = get_preset("falcon-7b")
    assert (f.hidden_size, f.num_heads, f.num_kv_heads, f.vocab_size) == (4544, 71, 1, 65024)
    assert f.tie_embeddings and f.rotary_fraction == 1.0
    assert get_preset("falcon-paper-7b").hidden_size == 4096


@pytest.mark.parametrize(
    "name, params",
    [
        ("llama2-7b", 6.74e9),
        ("llama2-13b", 13.02e9),
        ("llama2-70b", 68.98e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.55e9),
        ("falcon-7b", 6.92e9),
    ],
)
def test_real_model_param_counts(name, params):
    assert get_preset(name).total_params() == pytest.approx(params, rel=2e-3)


def test_llama2_7b_exact_count():
    assert get_preset("llama2-7b").total_params() == 6_738_415_616


def test_gpt_1_3b_reference_vector():
    """Reference formula: biased GPT-1.3B, learned positions 2048, tied head, no final norm."""
    h, L, V = 2048, 24, 50304
    spec = replace(get_preset("gpt3-1.3b"), bias=True, max_position_embeddings=2048, tie_embeddings=True)
    assert spec.num_layers == L
    assert spec.block_params() == 12 * h * h + 13 * h
    assert spec.embedding_params() == (V + 2048) * h
    assert spec.head_params() == 2 * h  # final LayerNorm only, head tied
    assert spec.total_params() - 2 * h == 1_315_815_424


def test_unknown_preset_suggests_close_names():
    msg = raises_one_sentence(get_preset, "gpt3-1.3", match="gpt3-1.3b")
    assert "gpt3-1.3" in msg
    raises_one_sentence(get_preset, "completely-different")


# ----------------------------------------------------------------------------- loading
def test_load_model_preset_name():
    assert load_model("llama2-7b") is get_preset("llama2-7b")
    assert load_model(" GPT3-1.3B ") is get_preset("gpt3-1.3b")


def test_load_model_unknown_name():
    msg = raises_one_sentence(load_model, "no-such-model-xyz")
    assert msg.startswith("Unknown model 'no-such-model-xyz': not a preset name or an existing file")
    raises_one_sentence(load_model, "llama2-7", match="llama2-7b")
    raises_one_sentence(load_model, "")


def test_load_yaml_model_file():
    spec = load_model(str(DATA / "tiny-llama.yaml"))
    assert spec.family == "llama" and spec.num_kv_heads == 2
    assert spec.norm_eps == 1e-6  # YAML `1e-6` (no dot) is still read as a number
    assert spec.rotary_fraction == 0.5
    assert spec.name == "tiny-llama"


def _write(tmp_path: Path, name: str, data) -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


BASE = dict(
    family="gpt",
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=1024,
    vocab_size=1000,
    tie_embeddings=True,
)


def test_load_json_model_file(tmp_path):
    spec = load_model(_write(tmp_path, "m.json", {**BASE, "bias": True, "name": "mine"}))
    assert spec == ModelSpec(**{**BASE, "bias": True, "name": "mine"})
    assert load_model(_write(tmp_path, "anon.json", BASE)).name == "anon"
    assert load_model_dict(dict(BASE), "x").hidden_size == 256


def test_model_file_missing_fields(tmp_path):
    d = {k: v for k, v in BASE.items() if k not in ("num_heads", "vocab_size")}
    path = _write(tmp_path, "m.json", d)
    msg = raises_one_sentence(load_model, path)
    assert msg == f"Model file {path} is missing field(s) num_heads, vocab_size."


def test_model_file_unknown_field(tmp_path):
    msg = raises_one_sentence(load_model, _write(tmp_path, "m.json", {**BASE, "hiden_size": 3}), match="unknown field")
    assert "hiden_size" in msg and "hidden_size" in msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", "24"),
        ("hidden_size", 256.0),
        ("tie_embeddings", "yes"),
        ("bias", 1),
        ("rotary_fraction", "half"),
        ("norm_eps", True),
        ("family", 3),
    ],
)
def test_model_file_wrong_type(tmp_path, field, value):
    path = _write(tmp_path, "m.json", {**BASE, field: value})
    raises_one_sentence(load_model, path, match=field)


@pytest.mark.parametrize(
    "text, suffix",
    [
        ('{"family": "gpt",', ".json"),
        ("family: [gpt\n", ".yaml"),
        ("{{{ not: [valid", ".cfg"),
    ],
)
def test_broken_files_name_the_file(tmp_path, text, suffix):
    path = _write(tmp_path, "broken" + suffix, text)
    raises_one_sentence(load_model, path, match=re.escape(path))


def test_file_must_hold_a_mapping(tmp_path):
    raises_one_sentence(load_model, _write(tmp_path, "list.json", [1, 2]), match="mapping")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_heads=4, num_kv_heads=3), "not divisible by num_kv_heads"),
        (dict(hidden_size=250), "not divisible by num_heads"),
        (dict(num_layers=-2), "num_layers must be positive"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size must be positive"),
        (dict(family="llama", rotary_fraction=1.5), "rotary_fraction"),
        (dict(family="llama", rotary_fraction=0.3), "odd number of rotary"),
        (dict(family="bert"), "(?i)unknown model family"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(norm_eps=float("inf")), "norm_eps must be a positive finite number"),
        (dict(hidden_size=2**33, num_heads=2**13), "hidden_size must be at most 1,048,576"),
        (dict(vocab_size=2**63), "vocab_size must be at most 16,777,216"),
        (dict(num_layers=10**9), "num_layers must be at most 4,096"),
    ],
)
def test_invalid_models_one_sentence(tmp_path, change, match):
    raises_one_sentence(ModelSpec, **{**BASE, **change}, match=match)
    path = _write(tmp_path, "m.json", {**BASE, **change})
    msg = raises_one_sentence(load_model, path, match=match)
    assert path in msg


def test_check_tp():
    spec = get_preset("gpt3-1.3b")
    spec.check_tp(1)
    spec.check_tp(8)
    raises_one_sentence(spec.check_tp, 3, match="num_heads 16")
    raises_one_sentence(spec.check_tp, 32, match="num_heads")
    raises_one_sentence(spec.check_tp, 0)
    raises_one_sentence(get_preset("llama2-70b").check_tp, 3, match="num_heads")
    get_preset("llama2-70b").check_tp(16)  # 16 tp ranks share 8 KV heads
    raises_one_sentence(get_preset("falcon-7b").check_tp, 2, match="num_heads 71")


# ----------------------------------------------------------------- Hugging Face configs
def dims(s: ModelSpec):
    return (
        s.family,
        s.num_layers,
        s.hidden_size,
        s.num_heads,
        s.num_kv_heads,
        s.ffn_hidden_size,
        s.vocab_size,
        s.tie_embeddings,
        s.bias,
    )


def test_hf_llama2():
    s = load_model(str(HF / "llama2-7b.json"))
    assert dims(s) == ("llama", 32, 4096, 32, 32, 11008, 32000, False, False)
    assert s.max_position_embeddings == 4096 and s.norm_eps == 1e-5
    assert s.rotary_fraction == 1.0
    assert s.total_params() == get_preset("llama2-7b").total_params()


def test_hf_mistral():
    s = load_model(str(HF / "mistral-7b.json"))
    assert dims(s) == ("llama", 32, 4096, 32, 8, 14336, 32000, False, False)
    assert s.max_position_embeddings == 32768
    assert s.total_params() == pytest.approx(7.24e9, rel=2e-3)


def test_hf_falcon_7b_refinedweb_keys():
    s = load_model(str(HF / "falcon-7b.json"))
    assert dims(s) == ("falcon", 32, 4544, 71, 1, 18176, 65024, True, False)
    assert s.total_params() == get_preset("falcon-7b").total_params()


def test_hf_falcon_40b_new_architecture():
    s = load_model(str(HF / "falcon-40b.json"))
    assert dims(s) == ("falcon", 60, 8192, 128, 8, 32768, 65024, True, False)
    assert s.total_params() == get_preset("falcon-40b").total_params()


def test_hf_falcon_variants():
    base = json.loads((HF / "falcon-7b.json").read_text())
    mha = load_model_dict({**base, "multi_query": False}, "x")
    assert mha.num_kv_heads == 71
    old40 = {**base, "model_type": "RefinedWeb", "n_head": 128, "n_head_kv": 8, "n_layer": 60, "hidden_size": 8192}
    old40.pop("multi_query")
    assert dims(load_model_dict(old40, "x"))[:6] == ("falcon", 60, 8192, 128, 8, 32768)
    rw = load_model_dict({**base, "parallel_attn": False, "alibi": True}, "x")
    assert rw.family == "gpt"


def test_hf_gpt2_small():
    s = load_model(str(HF / "gpt2.json"))
    assert dims(s) == ("gpt", 12, 768, 12, 12, 3072, 50257, True, True)
    assert s.max_position_embeddings == 1024
    assert s.total_params() == 124_439_808  # the published 124.4M


def test_hf_gpt_neox_pythia():
    s = load_model(str(HF / "pythia-160m.json"))
    assert dims(s) == ("falcon", 12, 768, 12, 12, 3072, 50304, False, True)
    assert s.rotary_fraction == 0.25 and s.max_position_embeddings == 2048
    # Real Pythia-160M: 162,322,944; our single-norm parallel block is 2h per layer short.
    assert s.total_params() == 162_322_944 - 12 * 2 * 768
    seq = load_model_dict({**json.loads((HF / "pythia-160m.json").read_text()), "use_parallel_residual": False}, "x")
    assert seq.family == "gpt"


def test_hf_config_folder(tmp_path):
    (tmp_path / "Llama-2-7b-hf").mkdir()
    cfg = json.loads((HF / "llama2-7b.json").read_text())
    cfg.pop("_name_or_path")
    (tmp_path / "Llama-2-7b-hf" / "config.json").write_text(json.dumps(cfg))
    s = load_model(str(tmp_path / "Llama-2-7b-hf"))
    assert s.name == "Llama-2-7b-hf" and s.num_layers == 32
    raises_one_sentence(load_model, str(tmp_path), match="config.json")


def test_hf_detection_by_architectures_only():
    cfg = json.loads((HF / "gpt2.json").read_text())
    cfg.pop("model_type")
    assert load_model_dict(cfg, "x").family == "gpt"


def test_hf_errors():
    cfg = json.loads((HF / "llama2-7b.json").read_text())
    raises_one_sentence(
        load_model_dict, {"model_type": "bert", "hidden_size": 768}, "cfg.json", match="model_type 'bert'"
    )
    missing = {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "vocab_size")}
    raises_one_sentence(load_model_dict, missing, "cfg.json", match="missing field.*num_hidden_layers, vocab_size")
    raises_one_sentence(
        load_model_dict, {**cfg, "num_key_value_heads": 5}, "cfg.json", match="cfg.json.*not divisible by num_kv_heads"
    )
    raises_one_sentence(load_model_dict, {**cfg, "head_dim": 64}, "cfg.json", match="head_dim")
    no_type = {k: v for k, v in cfg.items() if k != "model_type"}
    for archs in ([{"a": 1}], [["LlamaForCausalLM"]], 3):
        raises_one_sentence(
            load_model_dict,
            {**no_type, "architectures": archs},
            "cfg.json",
            match="no supported model_type or architectures",
        )
    raises_one_sentence(
        load_model_dict, {**cfg, "head_dim": "128"}, "cfg.json", match="field head_dim must be an integer, got '128'"
    )
    raises_one_sentence(load_model_dict, {**cfg, "tie_word_embeddings": "no"}, "cfg.json", match="tie_word_embeddings")
    raises_one_sentence(load_model_dict, {**cfg, "hidden_size": "4096"}, "cfg.json", match="integer")


def test_loading_does_not_need_transformers():
    import mist.specs.loading

    src = Path(mist.specs.loading.__file__).read_text()
    assert "import transformers" not in src and "from transformers" not in src
