"""`mist train --init-from` / `--save-hf`: Hugging Face checkpoints in and out, checked against
`transformers` itself.

Tiny Llama (GQA 4/2), GPT-2 and Falcon (multi-query; classic multi-head; the new decoder
architecture with 2 KV heads and biases) models are built by `transformers` from random configs, every weight perturbed
(so that a swapped norm or bias shows), and saved with `save_pretrained` (once sharded). Each is
loaded into plans of one process, and of two pipeline stages whose first stage is TP 2 and whose
second is DP 2 with ZeRO-3 and weight + optimizer offloading (4 ranks: every kind of slice in one
launch); Llama also into DP 2 with ZeRO-2 from the sharded checkpoint. Checked, in fp32:

- the first step's loss equals `transformers`' loss on the same batch (relative 1e-5; measured
  below 1e-6);
- what each rank read, measured by the slice reader (`hf_weights.LoadStats`): the read blocks alive
  at once never exceed the checkpoint's largest tensor, the bytes read stay within what the rank
  owns plus one tensor, and in the sharded plans each rank reads less than 60 % of the checkpoint;
- after 3 steps, `--save-hf` writes a checkpoint that `transformers` loads, and its logits equal
  those of Mist's model with the runtime's final weights (rtol 1e-5, atol 1e-5);
- a missing shard, a config of another model, and configs Mist cannot compute exactly each end
  through the CLI in one sentence with exit code 2, before any worker starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import SEQ, SPECS

from mist.cli import main
from mist.models import CausalLM
from mist.plan import Offload, Plan, StageStrategy
from mist.runtime import TrainConfig, spawn_local
from mist.runtime.data import SyntheticData
from mist.specs.loading import load_model
from mist.specs.training import ClusterSpec, TrainingSpec

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
CFG = dict(steps=3, lr=1e-2, warmup_steps=1, seed=5, log=False, eps=1e-4)


def _hf(kind: str):
    """A tiny random `transformers` model of `kind`, every parameter perturbed."""
    t = transformers
    torch.manual_seed(0)
    if kind == "llama":
        cfg = t.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},  # Llama 3's rotary base
        )
        model = t.LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        # without dropout (GPT2Config's default is 0.1): the runs are compared with the
        # deterministic model, and flash attention refuses attention dropout
        cfg = t.GPT2Config(
            n_embd=32,
            n_head=4,
            n_layer=2,
            vocab_size=128,
            n_positions=32,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
        model = t.GPT2LMHeadModel(cfg)
    elif kind == "falcon":  # classic multi-query: one KV head
        cfg = t.FalconConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=128, activation="gelu_pytorch_tanh"
        )
        model = t.FalconForCausalLM(cfg)
    elif kind == "falcon-mha":  # classic multi-head: fused rows interleaved [q_i, k_i, v_i] per head
        cfg = t.FalconConfig(  # and Falcon's default activation, the exact (erf) GELU
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=128,
            multi_query=False,
        )
        assert cfg.activation == "gelu"
        model = t.FalconForCausalLM(cfg)
    else:  # "falcon-gqa": new decoder architecture, one LayerNorm, 2 KV heads, biases
        cfg = t.FalconConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_kv_heads=2,
            num_hidden_layers=2,
            vocab_size=128,
            new_decoder_architecture=True,
            num_ln_in_parallel_attn=1,
            bias=True,
            activation="gelu_pytorch_tanh",
        )
        model = t.FalconForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


_SAVED: dict = {}


def _checkpoint(kind: str, root: Path, shard: str | None = None) -> Path:
    out = root / f"{kind}{'-sharded' if shard else ''}"
    if not out.exists():
        kw = {"max_shard_size": shard} if shard else {}
        _hf(kind).save_pretrained(out, **kw)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def _plan(spec, stages: list[dict], G: int = 2, b: int = 2) -> Plan:
    sts = []
    for s in stages:
        dp, tp = s.get("dp", 1), s.get("tp", 1)
        sts.append(
            StageStrategy(
                layers=s["layers"],
                nodes=1,
                gpus_per_node=dp * tp,
                micro_batch=b // dp,
                dp=dp,
                tp=tp,
                zero=s.get("zero", 0),
                offload=Offload(**s.get("offload", {})),
            )
        )
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=sum(s.gpus for s in sts)),
        training=TrainingSpec(seq_len=SEQ, global_batch=b * G, param_dtype="fp32", compute_dtype="fp32"),
        micro_batches=G,
        stages=tuple(sts),
    )


SINGLE = [dict(layers=2)]
MIXED = [dict(layers=1, tp=2), dict(layers=1, dp=2, zero=3, offload=dict(weights=0.5, optimizer=0.5))]


def _hf_loss(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def _mist_logits(spec, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of Mist's own single-process model with the runtime's weights."""
    m = CausalLM(spec, dtype=torch.float32)
    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    if spec.tie_embeddings:  # one parameter, two names in the module's state dict
        sd["head.weight"] = sd["embedding.word"]
    m.load_state_dict(sd, strict=True)
    with torch.no_grad():
        x = m.embedding(tokens)
        for blk in m.blocks:
            x = blk(x)
        return F.linear(m.head.norm(x), m.head.weight)


def _check_loading(res: dict, world: int, ckpt_bytes: int) -> list[dict]:
    loads = res["metrics"]["hf_load"]
    assert len(loads) == world
    for s in loads:
        # measured by the slice reader: never more than one tensor's bytes held at once, and
        # nothing read beyond the owned ranges but the rest of their first and last rows
        assert 0 < s["peak_live_bytes"] <= s["largest_tensor_bytes"], s
        assert s["owned_elements"] * s["itemsize"] <= s["read_bytes"], s
        assert s["read_bytes"] <= s["owned_elements"] * s["itemsize"] + s["largest_tensor_bytes"], s
        if world > 1:
            assert s["read_bytes"] < 0.6 * ckpt_bytes, (s, ckpt_bytes)
    return loads


CASES = [
    ("llama", "single", SINGLE, None),
    ("llama", "pp2:tp2|dp2-zero3-offload", MIXED, None),
    ("llama", "dp2-zero2-sharded", [dict(layers=2, dp=2, zero=2)], "4KB"),
    ("gpt2", "single", SINGLE, None),
    ("gpt2", "pp2:tp2|dp2-zero3-offload", MIXED, None),
    ("falcon", "single", SINGLE, None),
    ("falcon", "pp2:tp2|dp2-zero3-offload", MIXED, None),
    ("falcon-gqa", "tp2xdp2-zero1", [dict(layers=2, tp=2, dp=2, zero=1)], None),
    ("falcon-mha", "tp2", [dict(layers=2, tp=2)], None),
]


@pytest.mark.parametrize("kind,name,stages,shard", CASES, ids=[f"{k}-{n}" for k, n, _, _ in CASES])
def test_init_from_and_save_hf(kind, name, stages, shard, ckpts, tmp_path):
    src = _checkpoint(kind, ckpts, shard)
    if shard:
        assert (src / "model.safetensors.index.json").is_file()
    spec = load_model(str(src))
    plan = _plan(spec, stages)
    out = tmp_path / "out"
    cfg = TrainConfig(**CFG, init_from=str(src), save_hf=str(out), save_hf_shard_bytes=6000)
    res = spawn_local(plan, cfg, want_state=True, start_method="fork")

    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    batch = SyntheticData(spec.vocab_size, SEQ, plan.training.global_batch, CFG["seed"]).global_batch(0)
    want = _hf_loss(ref, batch)
    got = res["metrics"]["losses"][0]
    assert math.isclose(got, want, rel_tol=LOSS_RTOL), (got, want)

    ckpt_bytes = sum(p.numel() * 4 for p in ref.state_dict().values())
    _check_loading(res, plan.cluster.world_size, ckpt_bytes)

    # the trained weights, written as a Hugging Face checkpoint (several 6 kB shards + index)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = batch[:, :-1]
    with torch.no_grad():
        hf_logits = back(input_ids=tokens).logits
    torch.testing.assert_close(hf_logits, _mist_logits(spec, res["state"], tokens), **LOGITS_TOL)
    # trained: the weights moved away from the checkpoint's
    assert not torch.allclose(hf_logits, ref(input_ids=tokens).logits.detach(), atol=1e-3)


# ----------------------------------------------------------------------------- bad inputs (CLI)
def _fail(args, capsys) -> str:
    capsys.readouterr()  # drop what building the checkpoints printed (transformers' progress bars)
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def _plan_file(tmp_path: Path, spec, stages=SINGLE) -> str:
    path = tmp_path / "plan.json"
    _plan(spec, stages).save(path)
    return str(path)


def test_missing_shard(ckpts, tmp_path, capsys):
    src = _checkpoint("llama", ckpts, "4KB")
    broken = tmp_path / "broken"
    broken.mkdir()
    files = sorted(p.name for p in src.iterdir())
    for name in files:
        (broken / name).write_bytes((src / name).read_bytes())
    shard = sorted(p for p in broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    plan = _plan_file(tmp_path, load_model(str(src)))
    err = _fail(["train", plan, "--local", "--steps", "1", "--init-from", str(broken)], capsys)
    assert shard.name in err and "missing" in err


def test_config_of_another_model(ckpts, tmp_path, capsys):
    llama = load_model(str(_checkpoint("llama", ckpts)))
    gpt2 = _checkpoint("gpt2", ckpts)
    plan = _plan_file(tmp_path, llama)
    err = _fail(["train", plan, "--local", "--init-from", str(gpt2)], capsys)
    assert "does not match the plan's model" in err and "family gpt (plan: llama)" in err
    # same family, other dimensions
    other = tmp_path / "wide"
    other.mkdir()
    cfg = json.loads((_checkpoint("llama", ckpts) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "head_dim": 16, "vocab_size": 256}))
    err = _fail(["train", plan, "--local", "--init-from", str(other)], capsys)
    assert "hidden_size 64 (plan: 32)" in err and "vocab_size 256 (plan: 128)" in err
    # the rotary base is part of the model: a plan costed with another one is refused
    plan = _plan_file(tmp_path, replace(llama, rope_theta=10000.0))
    err = _fail(["train", plan, "--local", "--init-from", str(_checkpoint("llama", ckpts))], capsys)
    assert "rope_theta 500000" in err and "10000" in err


@pytest.mark.parametrize(
    "kind,change,words",
    [
        ("falcon", {"activation": "relu"}, "uses activation 'relu'"),
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}, "two LayerNorms"),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_theta": 500000.0,
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "scales its rotary frequencies (llama3)",
        ),
        ("gpt_neox", None, "GPT-NeoX"),
    ],
)
def test_configs_mist_cannot_compute_exactly(kind, change, words, ckpts, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if kind == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=128
        ).to_dict()
    else:
        cfg = {**json.loads((_checkpoint(kind, ckpts) / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(cfg))
    plan = _plan_file(tmp_path, load_model(str(folder)))
    err = _fail(["train", plan, "--local", "--init-from", str(folder)], capsys)
    assert words in err


def test_save_hf_refuses_a_model_gpt2_cannot_hold(tmp_path, capsys):
    spec = replace(SPECS["gpt"], bias=False)
    plan = _plan_file(tmp_path, spec)
    err = _fail(["train", plan, "--local", "--save-hf", str(tmp_path / "o")], capsys)
    assert "GPT-2" in err


def test_cli_saves_at_every_checkpoint(ckpts, tmp_path):
    """`mist train --local --init-from --save-hf --checkpoint-every`: the Hugging Face checkpoint
    is written with each DCP checkpoint (steps 2 and 3 of 3) and loads in `transformers`."""
    src = _checkpoint("llama", ckpts)
    plan = _plan_file(tmp_path, load_model(str(src)))
    out = tmp_path / "hf-out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["train", plan, "--local", "--steps", "3", "--lr", "1e-2", "--init-from", str(src), "--save-hf", str(out)]
    args += ["--checkpoint-dir", str(tmp_path / "dcp"), "--checkpoint-every", "2"]
    r = subprocess.run([sys.executable, "-m", "mist", *args], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"Hugging Face checkpoint saved to {out}") == 2, r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    batch = SyntheticData(128, SEQ, 4, 0).global_batch(0)
    assert _hf_loss(back, batch) < _hf_loss(ref, batch)  # trained on this data: the loss fell


def test_resume_takes_the_weights_of_the_checkpoint(ckpts, tmp_path):
    """With --init-from and --resume the DCP checkpoint's weights win: stopping after 2 steps and
    resuming gives the uninterrupted run's third loss."""
    src = _checkpoint("llama", ckpts)
    plan = _plan(load_model(str(src)), [dict(layers=2, dp=2, zero=3)])
    kw = dict(CFG, init_from=str(src), checkpoint_dir=str(tmp_path / "dcp"))
    full = spawn_local(plan, TrainConfig(**{**kw, "checkpoint_dir": None}), start_method="fork")
    spawn_local(plan, TrainConfig(**kw, stop_after=2), start_method="fork")
    rest = spawn_local(plan, TrainConfig(**kw, resume=True), start_method="fork")
    assert "hf_load" not in rest["metrics"]  # nothing read from the Hugging Face checkpoint
    assert rest["metrics"]["losses"] == pytest.approx(full["metrics"]["losses"][2:], rel=1e-6)


def test_save_hf_carries_the_tokenizer(tmp_path):
    """The saved folder is a whole checkpoint: the tokenizer the run used goes with the weights."""
    from mist.runtime.hf_weights import copy_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(str(src), out) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 32}'
    lone = tmp_path / "elsewhere" / "my-tokenizer.json"  # a tokenizer file named by path
    lone.parent.mkdir()
    lone.write_text('{"version": "2.0"}')
    assert copy_tokenizer(str(lone), out) == ["tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"version": "2.0"}'
    assert copy_tokenizer(None, out) == []
