"""A plan's dropout in the exports: Megatron-LM's --attention-dropout / --hidden-dropout, the
MODEL of DeepSpeed's helper, and torchtitan's llama3 (no dropout) naming it as a problem, its
nearest plan dropping it."""

from dataclasses import replace

from mist.export import export_plan
from mist.export import torchtitan as tt
from mist.plan import Plan, StageStrategy
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

LLAMA = ModelSpec("llama", 8, 1024, 16, 4, 2816, 32000, norm_eps=1e-6, name="small-gqa")


def _plan(model: ModelSpec, tp=1, **train) -> Plan:
    train.setdefault("grad_dtype", "fp32")
    st = StageStrategy(model.num_layers, 1, 8, 1, 8 // tp, tp, 1, 0, sequence_parallel=tp > 1)
    return Plan(
        model=model,
        cluster=ClusterSpec("h100", 1, 8),
        training=TrainingSpec(seq_len=2048, global_batch=8 // tp, **train),
        micro_batches=1,
        stages=(st,),
    )


def _flag(args, name):
    return args[list(args).index(name) + 1]


def test_megatron_passes_the_plans_dropout(tmp_path):
    plain, _ = export_plan(_plan(LLAMA), "megatron", tmp_path / "a")
    assert (_flag(plain.args, "--attention-dropout"), _flag(plain.args, "--hidden-dropout")) == ("0.0", "0.0")
    drop = replace(LLAMA, attention_dropout=0.1, hidden_dropout=0.05)
    done, _ = export_plan(_plan(drop, flash_attention=False), "megatron", tmp_path / "b")
    assert (_flag(done.args, "--attention-dropout"), _flag(done.args, "--hidden-dropout")) == ("0.1", "0.05")
    assert _flag(done.args, "--attention-backend") == "unfused"


def test_deepspeed_model_carries_the_dropout(tmp_path):
    drop = replace(LLAMA, hidden_dropout=0.1)
    export_plan(_plan(drop), "deepspeed", tmp_path / "d")
    helper = (tmp_path / "d" / "mist_deepspeed.py").read_text()
    assert "'hidden_dropout': 0.1" in helper and "replay" in helper
    export_plan(_plan(LLAMA), "deepspeed", tmp_path / "p")
    assert "dropout" not in (tmp_path / "p" / "mist_deepspeed.py").read_text()


def test_torchtitan_names_dropout_and_nearest_drops_it():
    plan = _plan(replace(LLAMA, hidden_dropout=0.1), tp=2)
    found = tt.problems(plan)
    assert any("hidden_dropout 0.1" in p and "llama3 has none" in p for p in found), found
    near = tt.nearest(plan)
    assert not near.model.has_dropout and tt.problems(near) == []
    assert not any("dropout" in p for p in tt.problems(_plan(LLAMA, tp=2)))
