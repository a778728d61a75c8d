"""Tokenized data: a real `tokenizers` tokenizer.json, JSONL / text / raw token files, packing with
EOS, the seeded sampler and its dp split, resuming mid-epoch with the same batches, evaluation,
the per-step logs, and bad inputs (one sentence, exit 2, before any worker starts)."""

import io
import json
import random

import numpy as np
import pytest
import torch
from rt_helpers import make_plan, run_plan

from mist.cli import main
from mist.errors import MistInputError
from mist.runtime import TrainConfig
from mist.runtime.corpus import tokenize_file
from mist.runtime.data import split_micro_batches
from mist.runtime.datasets import PackedData, build_data, prepared, tokenizer_path
from mist.runtime.packing import PackedSequences
from mist.runtime.sampler import EpochSampler, SamplerPosition
from mist.runtime.step_log import StepLog, StepRecord
from mist.runtime.token_files import open_tokens
from mist.runtime.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(60)]
EOS = 0


def _tokenizer(path, words=WORDS):
    """A WordLevel tokenizer: <|endoftext|> = 0, [UNK] = 1, word i = i + 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": EOS, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _ids(text):
    return [int(w[1:]) + 2 for w in text.split()]


def _jsonl(path, docs, seed=0):
    r = random.Random(seed)
    texts = [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 20))) for _ in range(docs)]
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return texts


def test_tokenize_pack_and_token_files(tmp_path):
    tok = load_tokenizer(_tokenizer(tmp_path / "tokenizer.json"))
    assert (tok.vocab_size, tok.eos_id) == (62, EOS)
    assert load_tokenizer(tmp_path).path == tmp_path / "tokenizer.json"  # a folder holding one

    # JSONL: one document per line (blank lines skipped), each followed by EOS
    (tmp_path / "d.jsonl").write_text('{"text": "w1 w2 w3"}\n\n{"text": "w4", "x": 1}\n{"text": "w5 w6"}\n')
    out = tokenize_file(tmp_path / "d.jsonl", tok, "text", tmp_path / "d.bin")
    want = _ids("w1 w2 w3") + [EOS] + _ids("w4") + [EOS] + _ids("w5 w6") + [EOS]
    stream = open_tokens(out, 62)
    assert isinstance(stream.tokens, np.memmap) and stream.tokens.dtype == np.uint16
    assert stream.tokens.tolist() == want and stream.max_id == max(want)
    # packing: seq_len 2 → sequences of 3 tokens, consecutive ones sharing a boundary token
    seqs = PackedSequences(stream.tokens, 2)
    assert seqs.count == 4
    assert seqs.rows([3, 0, 1]).tolist() == [want[6:9], want[0:3], want[2:5]]
    # the cache is reused while the inputs are unchanged, and rewritten when they change
    mtime = out.stat().st_mtime_ns
    tokenize_file(tmp_path / "d.jsonl", tok, "text", out)
    assert out.stat().st_mtime_ns == mtime
    other = load_tokenizer(tmp_path, eos_id=1)
    tokenize_file(tmp_path / "d.jsonl", other, "text", out)
    assert open_tokens(out, 62).tokens.tolist()[3] == 1

    # plain text: paragraphs separated by blank lines
    (tmp_path / "t.txt").write_text("w7 w8\nw9\n\n\nw10\n")
    t = open_tokens(tokenize_file(tmp_path / "t.txt", tok, "text", tmp_path / "t.bin"), 62).tokens
    assert t.tolist() == _ids("w7 w8 w9") + [EOS] + _ids("w10") + [EOS]

    # a folder: its files in name order, each by its suffix (hidden files skipped); --token-dtype
    # sets the dtype written, and a sidecar's dtype must agree with --token-dtype
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.txt").write_text("w7 w8\n\nw9\n")
    (folder / "a.jsonl").write_text('{"text": "w1"}\n')
    (folder / ".hidden").write_text("w3\n")
    out = tokenize_file(folder, tok, "text", tmp_path / "f.bin", "uint32")
    f = open_tokens(out, 62, "uint32").tokens
    assert f.dtype == np.uint32 and f.tolist() == _ids("w1") + [EOS] + _ids("w7 w8") + [EOS] + _ids("w9") + [EOS]
    with pytest.raises(
        MistInputError, match=r"holds uint32 ids \(its sidecar f.bin.json says so\), not --token-dtype uint16"
    ):
        open_tokens(out, 62, "uint16")

    # raw ids without a sidecar: --token-dtype names the dtype
    np.arange(50, dtype="<u4").tofile(tmp_path / "raw.bin")
    assert open_tokens(tmp_path / "raw.bin", 64, "uint32").tokens.tolist() == list(range(50))
    with pytest.raises(MistInputError, match="give --token-dtype"):
        open_tokens(tmp_path / "raw.bin", 64)
    with pytest.raises(MistInputError, match=r"outside the model's vocabulary \[0, 40\) \(they range over \[0, 49\]\)"):
        open_tokens(tmp_path / "raw.bin", 40, "uint32")
    with pytest.raises(MistInputError, match="not a whole number of uint32 ids"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
        open_tokens(tmp_path / "odd.bin", 64, "uint32")


def test_sampler_and_dp_split():
    s = EpochSampler(10, seed=5)
    for e in range(3):
        assert sorted(s.order(e).tolist()) == list(range(10))  # every sequence once per epoch
    assert s.order(0).tolist() != s.order(1).tolist()
    assert EpochSampler(10, seed=5).order(1).tolist() == s.order(1).tolist()
    assert EpochSampler(10, seed=6).order(0).tolist() != s.order(0).tolist()
    # 8 at a time: the second batch finishes epoch 0 and starts epoch 1
    a, pos = s.take(SamplerPosition(), 8)
    b, pos = s.take(pos, 8)
    assert pos == SamplerPosition(1, 6)
    assert b.tolist() == s.order(0)[8:].tolist() + s.order(1)[:6].tolist()

    tokens = np.arange(10 * 4 + 1) % 64
    data = PackedData(PackedSequences(tokens, 4), 8, seed=5)
    first = [data.global_batch(k) for k in range(3)]
    again = PackedData(PackedSequences(tokens, 4), 8, seed=5)
    again.restore(data.state()[:2] + [10], "x")  # the position a checkpoint keeps
    data2 = PackedData(PackedSequences(tokens, 4), 8, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(first, [data2.global_batch(k) for k in range(3)]))
    assert torch.equal(again.global_batch(3), data2.global_batch(3))
    with pytest.raises(MistInputError, match="trained on 11 training sequences"):
        again.restore([0, 0, 11], "ck")
    # each row is a packed sequence, and the dp split hands every row to exactly one rank
    batch = first[1]
    assert all(int(r[0]) % 4 == 0 and torch.equal(r, torch.arange(int(r[0]), int(r[0]) + 5)) for r in batch)
    for G, dp in ((1, 2), (2, 2), (1, 4)):
        rows = [
            torch.cat([x, y[:, -1:]], 1)
            for g in range(G)
            for d in range(dp)
            for x, y in [split_micro_batches(batch, G, dp, d)[g]]
        ]
        assert torch.equal(torch.cat(rows), batch)


def _corpus(tmp_path, docs=120):
    _tokenizer(tmp_path / "tokenizer.json")
    _jsonl(tmp_path / "d.jsonl", docs)
    return dict(data=str(tmp_path / "d.jsonl"), tokenizer=str(tmp_path))


def test_resume_tokenized_dataset(tmp_path):
    """3 steps, a checkpoint, 3 resumed steps = 6 uninterrupted steps: the same sampler positions
    (crossing an epoch), losses, evaluation losses and weights."""
    kw = dict(
        _corpus(tmp_path, docs=30),
        eval_fraction=0.2,
        eval_every=2,
        eval_batches=2,
        steps=6,
        token_cache=str(tmp_path / "cache"),
    )
    plan = make_plan("gpt", dp=2, zero=1, G=2)  # global batch 8
    full_res = run_plan(plan, **kw)
    ck = str(tmp_path / "ck")
    first = run_plan(plan, checkpoint_dir=ck, stop_after=3, **kw)["metrics"]
    resumed_res = run_plan(plan, checkpoint_dir=ck, resume=True, **kw)
    full, resumed = full_res["metrics"], resumed_res["metrics"]
    cache = next((tmp_path / "cache").glob("*.bin"))
    n = build_data(TrainConfig(data=str(cache), eval_fraction=0.2), 128, 16, 8)[0].seqs.count
    assert n * 2 < 6 * 8  # the run visits more than two epochs
    positions = first["data_positions"] + resumed["data_positions"]
    assert positions == full["data_positions"] and positions[-1][0] >= 2
    np.testing.assert_allclose(first["losses"] + resumed["losses"], full["losses"], rtol=0, atol=1e-6)
    evals = first["eval_losses"] + resumed["eval_losses"]
    assert [s for s, _ in evals] == [s for s, _ in full["eval_losses"]] == [2, 4, 6]
    np.testing.assert_allclose([v for _, v in evals], [v for _, v in full["eval_losses"]], rtol=0, atol=1e-6)
    for k, v in full_res["state"].items():
        np.testing.assert_allclose(resumed_res["state"][k], v, rtol=0, atol=1e-6, err_msg=k)


def test_layouts_see_the_same_batches_and_eval(tmp_path):
    """dp 2, ZeRO-3 with offloaded weights and activations, a 2-stage pipeline and one process
    train on the same packed batches and evaluate the same held-out loss (forward only: through
    the ZeRO-3 gathers, the weight offload and the pipeline's p2p)."""
    kw = dict(_corpus(tmp_path), eval_fraction=0.1, eval_every=2, steps=3, token_cache=str(tmp_path / "cache"))
    single = run_plan(make_plan("gpt", dp=1, G=2), **kw)["metrics"]  # global batch 4
    dp = run_plan(make_plan("gpt", dp=2, G=1), **kw)["metrics"]
    zero3 = run_plan(make_plan("gpt", dp=2, zero=3, G=1, b=2, offload={"weights": 0.5, "activations": 0.5}), **kw)
    plan = make_plan("gpt", dp=1, G=2)
    stage = type(plan.stages[0])(
        layers=1,
        nodes=1,
        gpus_per_node=1,
        micro_batch=2,
        dp=1,
        tp=1,
        zero=0,
        recompute_layers=0,
        offload=plan.stages[0].offload,
    )
    pp = type(plan)(
        model=plan.model,
        cluster=type(plan.cluster)(gpu="cpu", nodes=1, gpus_per_node=2),
        training=plan.training,
        micro_batches=2,
        stages=(stage, stage),
    )
    pipe = run_plan(pp, **kw)["metrics"]
    assert [s for s, _ in single["eval_losses"]] == [2, 3]
    for other in (dp, zero3["metrics"], pipe):
        np.testing.assert_allclose(other["losses"], single["losses"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            [v for _, v in other["eval_losses"]], [v for _, v in single["eval_losses"]], rtol=1e-5
        )
    assert single["eval_losses"][-1][1] < np.log(62) + 1  # evaluated on real tokens, not noise


def test_logs_jsonl_tensorboard_and_lines(tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = make_plan("gpt", dp=2)
    path = tmp_path / "p.json"
    plan.save(path)
    c = _corpus(tmp_path)
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    args = ["train", str(path), "--local", "--steps", "3", "--data", c["data"], "--tokenizer", c["tokenizer"]]
    args += ["--eval-fraction", "0.1", "--eval-every", "2", "--log-jsonl", str(log), "--tensorboard", str(tb)]
    main(args)
    out = capfd.readouterr().out
    assert "step 1/3  loss" in out and "step 2/3  eval loss" in out and "step 3/3  eval loss" in out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["loss"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and len(r["stage_peak_memory_bytes"]) == 1 and r["stage_peak_memory_bytes"][0] > 0
    assert [r["eval_loss"] is not None for r in rows] == [False, True, True]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "memory/stage0_peak_bytes"} <= set(
        acc.Tags()["scalars"]
    )
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert [round(e.value, 4) for e in acc.Scalars("eval/loss")] == [round(r["eval_loss"], 4) for r in rows[1:]]

    # on a terminal: a progress bar with the loss and throughput instead of lines
    buf = io.StringIO()
    bar = StepLog(3, 0, stream=buf, tty=True)
    bar.step(StepRecord(step=1, loss=2.5, lr=1e-3, grad_norm=1.0, tokens_per_s=1234.0, time_s=0.1, skipped=False))
    bar.close()
    assert "loss 2.5000" in buf.getvalue() and "1,234 tokens/s" in buf.getvalue() and "1/3" in buf.getvalue()


def test_bad_data_inputs(tmp_path, capsys):
    """Each one sentence and exit 2 from the launching process (no worker starts)."""
    plan = make_plan("gpt", dp=2)  # vocab_size 128
    path = tmp_path / "p.json"
    plan.save(path)
    _tokenizer(tmp_path / "tokenizer.json")
    big = tmp_path / "big"
    big.mkdir()
    _tokenizer(big / "tokenizer.json", [f"w{i}" for i in range(200)])
    _jsonl(tmp_path / "d.jsonl", 50)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "void").mkdir()
    (tmp_path / "tiny.jsonl").write_text('{"text": "w1 w2"}\n')
    (tmp_path / "latin1.txt").write_bytes("w1 w2\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "nofield.jsonl").write_text('{"text": "w1"}\n{"body": "w2"}\n')
    np.arange(200, dtype="<u2").tofile(tmp_path / "ids.bin")
    tok = ["--tokenizer", str(tmp_path)]
    cases = [
        (
            ["--data", str(tmp_path / "d.jsonl"), "--tokenizer", str(big)],
            "has 202 tokens but the model's vocab_size is 128",
        ),
        (["--data", str(tmp_path / "empty.jsonl"), *tok], "holds no documents"),
        (["--data", str(tmp_path / "tiny.jsonl"), *tok], "tiny.jsonl holds 3 tokens, fewer than one sequence of 17"),
        (["--data", str(tmp_path / "latin1.txt"), *tok], "latin1.txt is not UTF-8 text (line 2)"),
        (["--data", str(tmp_path / "nofield.jsonl"), *tok], "line 2 has no 'text' field"),
        (["--data", str(tmp_path / "d.jsonl"), *tok, "--text-field", "body"], "line 1 has no 'body' field"),
        (["--data", str(tmp_path / "d.jsonl")], "needs --tokenizer"),
        (["--data", str(big)], "is a directory, not a file (a folder of text needs --tokenizer)"),
        (["--data", str(tmp_path / "void"), *tok], "holds no files"),
        (["--data", str(tmp_path / "ids.bin")], "give --token-dtype"),
        (["--data", str(tmp_path / "ids.bin"), "--token-dtype", "uint16"], "outside the model's vocabulary [0, 128)"),
        (["--data", str(tmp_path / "d.jsonl"), "--tokenizer", str(tmp_path / "none")], "neither a tokenizer.json"),
        (["--data", str(tmp_path / "d.jsonl"), *tok, "--eval-fraction", "0.99"], "too few to hold out"),
        (["--eval-every", "2"], "--eval-every needs held-out data"),
        (["--eval-fraction", "1.5"], "--eval-fraction must lie strictly between 0 and 1"),
        (["--token-dtype", "int8"], "--token-dtype must be uint16 or uint32"),
        (["--eval-fraction", "0.1"], "not of synthetic data"),
    ]
    for extra, want in cases:
        with pytest.raises(SystemExit) as e:
            main(["train", str(path), "--local", "--steps", "2", *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and want in err, (extra, err)


def test_prepared_tokenizes_once_into_the_cache(tmp_path):
    c = _corpus(tmp_path)
    cfg = TrainConfig(**c, token_cache=str(tmp_path / "cache"), eval_data=c["data"], eval_every=1)
    with prepared(cfg, 128, 16, 4) as ready:
        assert ready.data == ready.eval_data and ready.data.endswith(".bin") and ready.tokenizer is None
        train, held = build_data(ready, 128, 16, 4)
        batches = list(held)
        assert len(batches) == cfg.eval_batches and all(b.shape == (4, 17) for b in batches)
        assert torch.equal(batches[0][0], torch.from_numpy(train.seqs.rows([0])[0]))  # eval: in order
        assert all(torch.equal(a, b) for a, b in zip(batches, held))  # the same batches every time
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1
    # the tokenizer of an --init-from checkpoint folder is the default one
    assert tokenizer_path(TrainConfig(init_from=str(tmp_path))) == str(tmp_path / "tokenizer.json")
    assert tokenizer_path(TrainConfig(init_from=str(tmp_path / "cache"))) is None
    # a .npy of token ids is packed and shuffled like any token file
    np.save(tmp_path / "t.npy", np.arange(100) % 64)
    data, held = build_data(TrainConfig(data=str(tmp_path / "t.npy")), 64, 8, 2)
    assert isinstance(data, PackedData) and data.seqs.count == 12 and held is None
