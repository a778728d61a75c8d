"""Plan validation and (de)serialization: every invariant violation has its own message."""

import copy
import json
import os
import re

import pytest

from mist.errors import MistInputError
from mist.plan import load_plan, plan_from_dict
from mist.specs.loading import load_model

GOOD = {
    "model": "gpt3-1.3b",
    "cluster": {"gpu": "l4", "nodes": 1, "gpus_per_node": 4},
    "training": {"seq_len": 2048, "global_batch": 32, "flash_attention": True},
    "micro_batches": 8,
    "stages": [
        {
            "layers": 13,
            "nodes": 1,
            "gpus_per_node": 2,
            "micro_batch": 2,
            "dp": 2,
            "tp": 1,
            "zero": 1,
            "recompute_layers": 5,
            "offload": {"optimizer": 0.5},
        },
        {
            "layers": 11,
            "nodes": 1,
            "gpus_per_node": 2,
            "micro_batch": 4,
            "dp": 1,
            "tp": 2,
            "zero": 0,
            "recompute_layers": 0,
        },
    ],
}


def mutate(_base=None, **changes):
    d = copy.deepcopy(GOOD if _base is None else _base)
    for path, v in changes.items():
        keys = path.split("__")
        tgt = d
        for k in keys[:-1]:
            tgt = tgt[int(k)] if k.isdigit() else tgt[k]
        last = keys[-1]
        if v is KeyError:
            del tgt[last]
        else:
            tgt[int(last) if last.isdigit() else last] = v
    return d


def test_good_plan_roundtrips(tmp_path):
    p = plan_from_dict(GOOD)
    assert p.num_stages == 2 and p.stages[0].offload.optimizer == 0.5
    for name in ("p.json", "p.yaml"):
        f = tmp_path / name
        p.save(f)
        q = load_plan(f)
        assert q.to_dict() == p.to_dict()
    assert "stage 1: 11 layers" in p.summary()


def test_gradient_dtype_roundtrips_and_is_omitted_when_default(tmp_path):
    assert "grad_dtype" not in plan_from_dict(GOOD).to_dict()["training"]  # older plans read as before
    p = plan_from_dict(mutate(training__grad_dtype="fp32"))
    assert p.training.grad_dtype == "fp32" and p.training.grad_bytes == 4
    f = tmp_path / "p.json"
    p.save(f)
    assert load_plan(f).training.grad_dtype == "fp32"
    assert "bf16 with fp32 gradients" in p.summary()
    assert "gradients" not in plan_from_dict(GOOD).summary()
    assert plan_from_dict(mutate(training__grad_dtype="bf16")).training.grad_bytes == 2


def test_selective_recomputation_roundtrips_and_reads_in_the_summary(tmp_path):
    p = plan_from_dict(mutate(stages__1__recompute_activation=True))
    assert p.stages[1].recompute_activation and not p.stages[0].recompute_activation
    f = tmp_path / "p.yaml"
    p.save(f)
    assert load_plan(f).stages[1].recompute_activation
    assert "recompute 0 + MLP activation of the rest" in p.summary()
    both = plan_from_dict(mutate(stages__1__recompute_activation=True, stages__1__recompute_attention=True))
    assert "recompute 0 + attention and MLP activation of the rest" in both.summary()


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"stages__0__recompute_activation": "yes"}, "Stage 0 recompute_activation must be true or false"),
        ({"stages__0__micro_batch": 3}, "not the global batch"),
        ({"stages__1__tp": 1}, "does not equal"),
        ({"stages__0__layers": 12}, "hold 23 layers"),
        ({"cluster__gpus_per_node": 8}, "cluster has 8"),
        ({"stages__0__recompute_layers": 14}, "exceeds"),
        ({"stages__0__offload": {"optimizer": 1.5}}, "ratio in [0, 1]"),
        ({"stages__0__offload": {"grads": -0.1}}, "ratio in [0, 1]"),
        (
            {"cluster__nodes": 2, "cluster__gpus_per_node": 2, "stages__1__nodes": 2, "stages__1__gpus_per_node": 1},
            "does not cross a node",
        ),
        (
            {
                "model": {
                    "family": "gpt",
                    "num_layers": 24,
                    "hidden_size": 2048,
                    "num_heads": 15,
                    "num_kv_heads": 15,
                    "ffn_hidden_size": 8192,
                    "vocab_size": 50304,
                    "tie_embeddings": False,
                }
            },
            "divisible",
        ),
        ({"stages__0__zero": 4}, "zero must be"),
        ({"micro_batches": 0}, "at least 1"),
        ({"stages": []}, "non-empty"),
        ({"cluster": KeyError}, "missing field 'cluster'"),
        ({"stages__0__dp": KeyError}, "missing field(s) dp"),
        ({"stages__0__pipeline": 3}, "unknown field"),
        ({"model": "nope-7b"}, "Unknown model"),
        ({"training__seq_len": 16384}, "learned positions"),
        ({"training__flash_attention": "no"}, "flash_attention must be true or false"),
        ({"training__grad_dtype": "fp16"}, "grad_dtype must be the parameter dtype (bf16) or fp32"),
        ({"training__grad_dtype": 4}, "grad_dtype must be the parameter dtype (bf16) or fp32"),
        ({"training__flash_attention": None}, "flash_attention must be true or false"),
        ({"training__global_batch": 2**40}, "global_batch must be at most"),
        ({"stages__0__zero": 1.0}, "zero must be 0, 1, 2 or 3"),
        ({"stages__0__offload": 0}, "offload must map"),
        ({"stages__0__offload": None}, "offload must map"),
        ({"extra": 1}, "unknown field(s) extra"),
        (
            {
                "model": {
                    "family": "gpt",
                    "num_layers": 24,
                    "hidden_size": 2048,
                    "num_heads": 16,
                    "num_kv_heads": 16,
                    "ffn_hidden_size": 8192,
                    "vocab_size": 50304,
                    "colour": 1,
                }
            },
            "The model of plan has unknown field(s) colour",
        ),
        (
            {
                "model": {
                    "family": "gpt",
                    "num_layers": 24,
                    "hidden_size": 2**33,
                    "num_heads": 16,
                    "num_kv_heads": 16,
                    "ffn_hidden_size": 8192,
                    "vocab_size": 50304,
                    "tie_embeddings": False,
                }
            },
            "at most 1,048,576",
        ),
    ],
)
def test_each_violation_has_its_message(changes, needle):
    with pytest.raises(MistInputError) as e:
        plan_from_dict(mutate(**changes))
    msg = str(e.value)
    assert needle in msg, msg
    assert msg.endswith(".") and "\n" not in msg


def test_tp_must_divide_heads():
    d = mutate(
        model={
            "family": "gpt",
            "num_layers": 24,
            "hidden_size": 2040,
            "num_heads": 15,
            "num_kv_heads": 15,
            "ffn_hidden_size": 8160,
            "vocab_size": 50304,
            "tie_embeddings": False,
        }
    )
    with pytest.raises(MistInputError, match="tp 2 does not divide the model's 15 attention heads"):
        plan_from_dict(d)


def test_bad_files(tmp_path):
    with pytest.raises(MistInputError, match="does not exist"):
        load_plan(tmp_path / "none.json")
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(MistInputError, match="not valid JSON"):
        load_plan(f)
    f.write_text(json.dumps([1, 2]))
    with pytest.raises(MistInputError, match="mapping"):
        load_plan(f)


def test_placement_follows_the_runtime_layout():
    """Stages take consecutive ranks; on 2 nodes of 2 GPUs a 1×2 stage at ranks 1–2 would
    straddle both nodes, and a stage over 2 nodes must own them whole."""
    base = mutate(
        cluster={"gpu": "l4", "nodes": 2, "gpus_per_node": 2},
        micro_batches=16,
        training={"seq_len": 2048, "global_batch": 32},
    )

    def stage(layers, n, g, tp=1):
        return {
            "layers": layers,
            "nodes": n,
            "gpus_per_node": g,
            "micro_batch": 2 // (g * n // tp),
            "dp": g * n // tp,
            "tp": tp,
        }

    ok = dict(base, stages=[stage(8, 1, 2), stage(8, 1, 1), stage(8, 1, 1)])
    assert plan_from_dict(ok).num_stages == 3
    straddle = dict(base, stages=[stage(8, 1, 1), stage(8, 1, 2, tp=2), stage(8, 1, 1)])
    with pytest.raises(MistInputError, match="ranks 1–2.*straddle two nodes"):
        plan_from_dict(straddle)
    split = dict(base, stages=[stage(12, 1, 2), stage(12, 2, 1)])
    with pytest.raises(MistInputError, match="must own whole nodes"):
        plan_from_dict(split)


def test_unreadable_files(tmp_path):
    f = tmp_path / "bin.json"
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(MistInputError, match="is not UTF-8 text"):
        load_plan(f)
    with pytest.raises(MistInputError, match="is a directory, not a file"):
        load_plan(tmp_path)
    with pytest.raises(MistInputError, match="needs a file path"):
        load_plan("")


def test_yaml_plans(tmp_path):
    """YAML plans: any-case extension, exponent-only numbers, keys that are not strings, repeats."""
    import yaml

    d = mutate(
        model={
            "family": "gpt",
            "num_layers": 24,
            "hidden_size": 2048,
            "num_heads": 16,
            "num_kv_heads": 16,
            "ffn_hidden_size": 8192,
            "vocab_size": 50304,
            "tie_embeddings": False,
            "norm_eps": 1e-5,
        }
    )
    text = yaml.safe_dump(d, sort_keys=False).replace("1.0e-05", "1e-5")
    assert "norm_eps: 1e-5" in text
    f = tmp_path / "PLAN.YAML"
    f.write_text(text)
    assert load_plan(f).model.norm_eps == 1e-5
    f.write_text(text.replace("  zero: 1\n", "  zero: 1\n  1: x\n  zz: y\n", 1))
    with pytest.raises(MistInputError, match="unknown field.*1, zz"):
        load_plan(f)
    f.write_text(text.replace("micro_batches: 8\n", "micro_batches: 8\nmicro_batches: 4\n"))
    with pytest.raises(MistInputError, match="key 'micro_batches' appears twice"):
        load_plan(f)
    j = tmp_path / "p.json"
    j.write_text(json.dumps(GOOD)[:-1] + ', "micro_batches": 4}')
    with pytest.raises(MistInputError, match="not valid JSON \\(key 'micro_batches' appears twice\\)"):
        load_plan(j)


def test_files_that_are_not_regular(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(MistInputError, match="is not a regular file"):
        load_plan(fifo)
    with pytest.raises(MistInputError, match="is not a regular file"):
        load_plan("/dev/zero")


def test_relative_paths_are_read_from_the_plans_folder(tmp_path, monkeypatch):
    from mist.hardware.registry import _profiles_dir

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "l4.json").write_text((_profiles_dir() / "l4.json").read_text())
    (folder / "m.json").write_text(
        json.dumps(
            {
                "family": "gpt",
                "num_layers": 24,
                "hidden_size": 2048,
                "num_heads": 16,
                "num_kv_heads": 16,
                "ffn_hidden_size": 8192,
                "vocab_size": 50304,
                "tie_embeddings": False,
            }
        )
    )
    d = mutate(model="m.json", cluster={"gpu": "l4.json", "nodes": 1, "gpus_per_node": 4})
    (folder / "plan.json").write_text(json.dumps(d))
    monkeypatch.chdir(tmp_path)  # not the plan's folder
    p = load_plan(folder / "plan.json")
    assert p.cluster.gpu == str(folder / "l4.json") and p.model.num_layers == 24
    out = tmp_path / "elsewhere" / "plan2.json"
    out.parent.mkdir()
    p.save_beside(out)
    assert json.loads(out.read_text())["cluster"]["gpu"] == os.path.join("..", "job", "l4.json")
    assert load_plan(out).cluster.gpu == str(out.parent / ".." / "job" / "l4.json")


INTERLEAVED = copy.deepcopy(GOOD)
INTERLEAVED["virtual_stages"] = 2
INTERLEAVED["stages"][0]["chunk_layers"] = [7, 6]
INTERLEAVED["stages"][1]["chunk_layers"] = [5, 6]


def _interleaved(**changes):
    return mutate(INTERLEAVED, **changes)


def test_interleaved_plan_roundtrips_and_plain_plans_write_no_chunks(tmp_path):
    p = plan_from_dict(_interleaved())
    assert p.virtual_stages == 2 and p.stages[0].chunk_layers == (7, 6) and p.stages[1].chunks() == (5, 6)
    assert "interleaved 1F1B with 2 chunks" in p.summary() and "chunks 7+6" in p.summary()
    f = tmp_path / "v.json"
    p.save(f)
    assert load_plan(f) == p
    plain = plan_from_dict(GOOD)
    assert plain.virtual_stages == 1 and plain.stages[0].chunks() == (13,)
    d = plain.to_dict()
    assert "virtual_stages" not in d and all("chunk_layers" not in s for s in d["stages"])


@pytest.mark.parametrize(
    "d,needle",
    [
        (_interleaved(micro_batches=16, stages__0__micro_batch=1, stages__1__micro_batch=2), None),
        (_interleaved(virtual_stages=0), "virtual_stages must be at least 1"),
        (_interleaved(virtual_stages=3), "must list 3 block counts"),
        (_interleaved(stages__0__chunk_layers=[8, 6]), "add up to 14, not its 13 layers"),
        (_interleaved(stages__0__chunk_layers=[13, 0]), "chunk_layers[1] must be at least 1"),
        (_interleaved(stages__1__chunk_layers=KeyError), "Stage 1 needs chunk_layers"),
        (
            _interleaved(micro_batches=1, stages__0__micro_batch=16, stages__1__micro_batch=32),
            "micro_batches a multiple of its 2 stages",
        ),
    ],
)
def test_interleaved_constraints(d, needle):
    if needle is None:
        assert plan_from_dict(d).micro_batches == 16
        return
    with pytest.raises(MistInputError, match=re.escape(needle)):
        plan_from_dict(d)


def test_interleaving_needs_a_pipeline():
    d = {
        "model": "gpt3-1.3b",
        "cluster": {"gpu": "l4", "nodes": 1, "gpus_per_node": 1},
        "training": {"seq_len": 2048, "global_batch": 8},
        "micro_batches": 8,
        "virtual_stages": 2,
        "stages": [
            {"layers": 24, "nodes": 1, "gpus_per_node": 1, "micro_batch": 1, "dp": 1, "tp": 1, "chunk_layers": [12, 12]}
        ],
    }
    with pytest.raises(MistInputError, match="needs at least 2 pipeline stages"):
        plan_from_dict(d)


def test_compiled_blocks_roundtrip_and_eager_plans_write_no_field(tmp_path):
    one_stage = mutate(stages=[{**GOOD["stages"][0], "layers": 24, "gpus_per_node": 4, "dp": 4, "micro_batch": 1}])
    p = plan_from_dict(mutate(one_stage, training__compile_blocks=True))
    assert p.training.compile_blocks and "compiled blocks" in p.summary()
    assert "compiled" not in plan_from_dict(GOOD).summary()
    p.save(tmp_path / "c.json")
    assert load_plan(str(tmp_path / "c.json")).training.compile_blocks
    plan_from_dict(GOOD).save(tmp_path / "e.json")
    assert "compile_blocks" not in (tmp_path / "e.json").read_text()


def test_compiled_blocks_run_tensor_parallel_stages():
    p = plan_from_dict(mutate(training__compile_blocks=True, stages__1__sequence_parallel=True))
    assert p.training.compile_blocks and p.stages[1].tp == 2 and p.stages[1].sequence_parallel


def test_compiled_blocks_run_context_parallel_stages():
    changes = {
        "stages__0__dp": 1,
        "stages__0__cp": 2,
        "stages__0__micro_batch": 4,
        "stages__1__tp": 1,
        "stages__1__cp": 2,
    }
    p = plan_from_dict(mutate(training__compile_blocks=True, **changes))
    assert p.training.compile_blocks and [s.cp for s in p.stages] == [2, 2]


def test_compiled_blocks_run_selective_recomputation():
    changes = {"stages__1__recompute_activation": True, "stages__1__recompute_attention": True}
    p = plan_from_dict(mutate(training__compile_blocks=True, **changes))
    assert p.training.compile_blocks and p.stages[1].recompute_attention and p.stages[1].recompute_activation


def _dropout_model(**probs) -> dict:
    return {**load_model("gpt3-1.3b").to_dict(), **probs}


def test_compiled_blocks_run_dropout_on_tensor_parallel_stages():
    """The masks every tensor-parallel rank draws alike, and each rank's own (attention dropout on
    tp > 1, also with the attention core recomputed; hidden dropout under sequence parallelism):
    `mist.rules.compiled_blocks`."""
    for model, changes in (
        (_dropout_model(hidden_dropout=0.1), {"stages__1__sequence_parallel": True}),
        (_dropout_model(attention_dropout=0.1, hidden_dropout=0.1), {"training__flash_attention": False}),
        (
            _dropout_model(attention_dropout=0.1),
            {"training__flash_attention": False, "stages__1__recompute_attention": True},
        ),
    ):
        p = plan_from_dict(mutate(model=model, training__compile_blocks=True, **changes))
        assert p.training.compile_blocks and p.stages[1].tp == 2 and p.model.has_dropout


def test_compiled_blocks_run_zero_bubble():
    changes = {
        "stages__1__tp": 1,
        "stages__1__dp": 2,
        "stages__1__micro_batch": 2,
        "schedule": "zb-h1",
        "stages__0__recompute_layers": 0,
    }
    p = plan_from_dict(mutate(training__compile_blocks=True, **changes))
    assert p.training.compile_blocks and p.schedule == "zb-h1"


def test_compile_blocks_must_be_a_boolean():
    with pytest.raises(MistInputError) as e:
        plan_from_dict(mutate(training__compile_blocks="yes"))
    msg = str(e.value)
    assert "compile_blocks must be true or false" in msg, msg
    assert msg.endswith(".") and "\n" not in msg
