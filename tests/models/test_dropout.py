"""Dropout: the ModelSpec fields (checked, loaded, written as before at 0), the blocks in training
and evaluation mode, the embedding output's hidden dropout and its streams, the refusal of flash attention with attention dropout, and recomputation
replaying the masks (in one process, TP shards built without a process group; the runtime's
gloo runs are in tests/runtime/test_runtime_dropout.py)."""

import json
import re
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from mist.cli import main
from mist.errors import MistInputError
from mist.models import CausalLM, DecoderBlock, Embedding, TPGroup, init_weights
from mist.models.checkpointing import run_block_as
from mist.models.dropout import dropout, seed_dropout, tp_stream
from mist.plan import Plan, StageStrategy, load_plan
from mist.runtime.hf_layout import hf_config
from mist.specs.loading import load_model, load_model_dict
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
TINY = dict(family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)
DROP = dict(attention_dropout=0.1, hidden_dropout=0.2)


def spec(family="llama", **kw) -> ModelSpec:
    base = {**TINY, "family": family, "vocab_size": 128, "max_position_embeddings": 64}
    return ModelSpec(**{**base, **kw})


# ------------------------------------------------------------------------------ the spec
@pytest.mark.parametrize("field", ["attention_dropout", "hidden_dropout"])
@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), True, "0.1"])
def test_dropout_must_be_a_probability_below_one(field, bad):
    with pytest.raises(MistInputError, match=rf"^{field} must be a probability in \[0, 1\), got .*\.$"):
        spec(**{field: bad})


def test_written_as_before_without_dropout_and_read_back_with_it(tmp_path):
    plain = spec()
    assert "attention_dropout" not in plain.to_dict() and "hidden_dropout" not in plain.to_dict()
    d = spec(**DROP).to_dict()
    assert (d["attention_dropout"], d["hidden_dropout"]) == (0.1, 0.2)
    assert load_model_dict(d) == spec(**DROP)
    assert load_model_dict(plain.to_dict()) == plain and hash(load_model_dict(plain.to_dict())) == hash(plain)
    # a plan file keeps them
    m = spec(**DROP)
    st = StageStrategy(layers=2, nodes=1, gpus_per_node=1, micro_batch=1, dp=1, tp=1)
    plan = Plan(
        model=m,
        cluster=ClusterSpec(gpu="cpu"),
        training=TrainingSpec(seq_len=16, flash_attention=False),
        micro_batches=1,
        stages=(st,),
    )
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert load_plan(str(path)).model == m


def test_hugging_face_dropout_names():
    gpt2 = load_model(str(HF / "gpt2.json"))  # attn_pdrop, resid_pdrop
    assert (gpt2.attention_dropout, gpt2.hidden_dropout) == (0.1, 0.1)
    cfg = json.loads((HF / "gpt2.json").read_text())
    del cfg["attn_pdrop"], cfg["resid_pdrop"]
    assert load_model_dict(cfg).has_dropout  # GPT2Config's defaults, 0.1
    falcon = json.loads((HF / "falcon-7b.json").read_text())
    assert not load_model_dict(falcon).has_dropout
    f = load_model_dict({**falcon, "attention_dropout": 0.05, "hidden_dropout": 0.15})
    assert (f.attention_dropout, f.hidden_dropout) == (0.05, 0.15)
    llama = json.loads((HF / "llama2-7b.json").read_text())
    assert load_model_dict({**llama, "attention_dropout": 0.1}).attention_dropout == 0.1
    with pytest.raises(MistInputError, match="attention_dropout must be a probability"):
        load_model_dict({**llama, "attention_dropout": 1.5})
    # GPT-2's embd_pdrop is the hidden dropout (Mist drops the embedding output with it): written so
    written = hf_config(spec("gpt", **DROP))
    assert (written["attn_pdrop"], written["embd_pdrop"], written["resid_pdrop"]) == (0.1, 0.2, 0.2)
    assert load_model_dict(written).hidden_dropout == 0.2
    with pytest.raises(MistInputError, match="embd_pdrop 0.0 differs from resid_pdrop 0.2"):
        load_model_dict({**written, "embd_pdrop": 0.0})


# ------------------------------------------------------------------------------ flash is refused
def test_flash_attention_with_attention_dropout_is_refused(tmp_path, capsys):
    m = spec(**DROP)
    with pytest.raises(MistInputError) as e:
        m.check_attention(True)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".") and not re.search(r"[.?!]\s+[A-Z]", msg)
    m.check_attention(False)
    spec(hidden_dropout=0.3).check_attention(True)  # hidden dropout alone runs with flash
    with pytest.raises(MistInputError, match="--no-flash"):
        Plan(
            model=m,
            cluster=ClusterSpec(gpu="cpu"),
            training=TrainingSpec(seq_len=16),
            micro_batches=1,
            stages=(StageStrategy(layers=2, nodes=1, gpus_per_node=1, micro_batch=1, dp=1, tp=1),),
        )
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**m.to_dict(), "tie_embeddings": False}))
    with pytest.raises(SystemExit) as ex:
        main(["estimate", "--model", str(path), "--gpu", "l4"])
    assert ex.value.code == 2 and "attention_dropout" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:
        main(["tune", "--model", str(path), "--gpu", "l4", "--global-batch", "4", "-o", str(tmp_path / "p.json")])
    assert ex.value.code == 2 and "--no-flash" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the blocks
def test_training_mode_drops_and_evaluation_does_not():
    torch.manual_seed(0)
    plain, drop = spec(family="gpt"), spec(family="gpt", **DROP)
    models = [CausalLM(s, flash=False, dtype=torch.float32) for s in (plain, drop)]
    for m in models:
        init_weights(m, 1)
    tok = torch.randint(0, 128, (2, 17))
    want = models[0](tok[:, :-1], tok[:, 1:])
    models[1].eval()
    # equal up to rounding: the two models' tensors lie at different addresses, and the CPU's
    # matmul kernels may sum in another order for another alignment (one CI run differed in the
    # last bit); the dropouts, active, move the loss far more (below)
    torch.testing.assert_close(models[1](tok[:, :-1], tok[:, 1:]), want, rtol=1e-6, atol=0)
    models[1].train()
    assert not torch.allclose(models[1](tok[:, :-1], tok[:, 1:]), want)


def test_dropout_op_keeps_a_bool_mask_and_scales():
    x = torch.ones(1000, 100, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = dropout(x, 0.25, True)
    assert [t.dtype for t in kept] == [torch.bool]
    assert y.unique().tolist() == [0.0, pytest.approx(4 / 3)]
    assert abs((y == 0).float().mean().item() - 0.25) < 0.01
    assert dropout(x, 0.25, False) is x and dropout(x, 0.0, True) is x


def test_tp_stream_is_per_rank_and_leaves_the_shared_stream():
    x = torch.empty(64)
    draws = []
    for rank in (0, 1):
        seed_dropout(7, 3, 0, 0, rank)
        with tp_stream(TPGroup(2, rank), x):
            own = torch.rand(64)
        draws.append((own, torch.rand(64)))
    assert not torch.equal(draws[0][0], draws[1][0])  # own heads / own shard: independent
    assert torch.equal(draws[0][1], draws[1][1])  # the shared stream: identical on both ranks
    seed_dropout(7, 3, 0, 0, 1)
    with tp_stream(TPGroup(1), x):  # one rank: the shared stream itself
        assert torch.equal(torch.rand(64), draws[0][1])


def _grads(m, x, recompute):
    seed_dropout(11, 0, 0, 0, m.tp.rank)
    x = x.detach().requires_grad_()
    run_block_as(m, x, recompute).square().sum().backward()
    out = [x.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", ["gpt", "llama", "falcon"])
def test_recomputation_replays_the_masks_of_the_forward(family):
    """tp 2 (a shard without a process group: attention dropout from the tensor-parallel stream,
    hidden dropout from the shared one): every recomputation gives the gradients of none."""
    torch.manual_seed(0)
    m = DecoderBlock(spec(family, bias=True, **DROP), TPGroup(2, 1), False, torch.float32)
    init_weights(m, 0)
    x = torch.randn(2, 16, 64)
    want = _grads(m, x, False)
    for rc in (True, "attention", "activation", "attention+activation"):
        for a, b in zip(want, _grads(m, x, rc)):
            assert torch.equal(a, b), rc
    # what the test guards against: torch's checkpoint without the states draws other masks
    seed_dropout(11, 0, 0, 0, 1)
    xr = x.detach().requires_grad_()
    torch_checkpoint(m, xr, use_reentrant=True, preserve_rng_state=False).square().sum().backward()
    assert not torch.equal(xr.grad, want[0])
    m.zero_grad(set_to_none=True)


def test_masks_are_a_function_of_the_seed_and_the_step():
    """Re-seeded per step: the same step draws the same masks (a resumed run), another step others."""
    s = spec("llama", hidden_dropout=0.3)
    full = DecoderBlock(s, TPGroup(), False, torch.float32)
    init_weights(full, 0)
    x = torch.randn(2, 16, 64)
    seed_dropout(5, 1, 0, 0, 0)
    a = full(x)
    seed_dropout(5, 1, 0, 0, 0)
    b = full(x)
    assert torch.equal(a, b)
    seed_dropout(5, 2, 0, 0, 0)  # another step: other masks
    assert not torch.equal(full(x), a)


def _embedding_mask(s: ModelSpec, tp: TPGroup, tok: torch.Tensor):
    """(training output, evaluation output, the saved bool mask) of an Embedding shard, step 0."""
    m = Embedding(s, tp, torch.float32)
    init_weights(m, 0)
    seed_dropout(3, 0, 0, 0, tp.rank)
    kept: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = m(tok)
    after = torch.rand(8)  # the shared stream's next draw (the first block's)
    masks = [t for t in kept if t.dtype == torch.bool and t.shape[-1] == s.hidden_size]  # (not the vocab shard's)
    assert len(masks) == 1
    return out, m.eval()(tok), masks[0], after


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_embedding_output_dropout_and_its_streams(family):
    """The embedding output is dropped (GPT: after its learned positions are added) with the
    blocks' rule: held whole by the TP ranks, the masks of the shared stream, identical on the ranks
    and a single rank's; under sequence parallelism each rank's own shard, from the tensor-parallel
    stream (independent masks), the shared stream left as it was."""
    s = spec(family, hidden_dropout=0.3)
    tok = torch.randint(0, 128, (2, 16))
    out, plain, mask, after = _embedding_mask(s, TPGroup(), tok)
    assert mask.shape == (2, 16, 64)
    torch.testing.assert_close(out, plain * mask / 0.7)  # positions included in what is dropped
    for rank in (0, 1):
        _, _, m2, a2 = _embedding_mask(s, TPGroup(2, rank), tok)
        assert torch.equal(m2, mask) and torch.equal(a2, after)
    shards = [_embedding_mask(s, TPGroup(2, r, sequence_parallel=True), tok) for r in (0, 1)]
    assert [tuple(sh[2].shape) for sh in shards] == [(2, 8, 64)] * 2
    assert not torch.equal(shards[0][2], shards[1][2])
    seed_dropout(3, 0, 0, 0, 0)
    untouched = torch.rand(8)
    assert all(torch.equal(sh[3], untouched) for sh in shards) and not torch.equal(after, untouched)
