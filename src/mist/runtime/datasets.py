"""What `mist train --data` names, made ready before the workers start, and the data they read.

``--data`` is one of:

- ``synthetic``: seeded Markov-chain sequences (`data.SyntheticData`);
- a token file: ``.npy``, or raw uint16/uint32 ids (``.bin``, a file with a ``.json`` sidecar,
  the dtype from the sidecar or ``--token-dtype``), memory-mapped (`token_files`);
- JSONL, plain text or a folder of them with ``--tokenizer``: tokenized once into a token file (`corpus`), in
  ``--token-cache DIR`` (reused while the inputs are unchanged) or a temporary folder;
- plain text without a tokenizer: byte-level tokens, read as before (`data.TokenFileData`).

Token files are packed into sequences (`packing`) and visited by the seeded per-epoch shuffle
(`sampler`); `PackedData.state` is the sampler's position, saved in checkpoints. A held-out split
comes from ``--eval-fraction`` (the last sequences of the stream, one sequence apart from the
training ones so that no token is shared) or ``--eval-data PATH``; the evaluation batches are
the first ``--eval-batches`` global batches of held-out sequences, in order, the same every time.

`prepared` runs in the launching process (and once per rank under torchrun): it loads the
tokenizer, tokenizes, and checks every file and size, so bad data ends with one sentence before
any worker allocates; the workers get a config whose data are token files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mist.errors import MistInputError
from mist.runtime.config import TrainConfig
from mist.runtime.corpus import fingerprint, is_jsonl, tokenize_file
from mist.runtime.data import SyntheticData, TokenFileData
from mist.runtime.packing import PackedSequences, sequence_count
from mist.runtime.sampler import EpochSampler, SamplerPosition
from mist.runtime.token_files import open_tokens, read_sidecar, sidecar_path
from mist.runtime.tokenizer import Tokenizer, check_fits, load_tokenizer
from mist.userfiles import check_input_file, check_output_dir


def is_token_file(path: str | Path) -> bool:
    """A .npy, a .bin or a file with a token sidecar (--token-dtype only names a raw file's dtype)."""
    if not str(path).strip():
        return False  # an empty --data: `build_data` says so
    p = Path(path)
    return not p.is_dir() and (p.suffix.lower() in (".npy", ".bin") or sidecar_path(p).is_file())


def tokenizer_path(cfg: TrainConfig) -> str | None:
    """--tokenizer, or the tokenizer.json of the --init-from checkpoint when it has one."""
    if cfg.tokenizer:
        return cfg.tokenizer
    init = cfg.init_from
    return str(Path(init) / "tokenizer.json") if init and (Path(init) / "tokenizer.json").is_file() else None


def source_of(path: Path) -> str:
    """The file the user named for a token file: the text it was tokenized from, or itself."""
    src = ((read_sidecar(path) or {}).get("source") or {}).get("data")
    return str(src) if isinstance(src, str) else str(path)


class PackedData:
    """Training batches from a packed token stream, in the sampler's order (stateful)."""

    def __init__(self, seqs: PackedSequences, global_batch: int, seed: int):
        self.seqs, self.B = seqs, global_batch
        self.sampler = EpochSampler(seqs.count, seed)
        self.position = SamplerPosition()

    def global_batch(self, step: int) -> torch.Tensor:
        """The next global batch [B, seq_len + 1] (called once per step, in order)."""
        idx, self.position = self.sampler.take(self.position, self.B)
        return torch.from_numpy(self.seqs.rows(idx))

    def state(self) -> list[int]:
        return [self.position.epoch, self.position.index, self.seqs.count]

    def restore(self, state: list[int], where: str) -> None:
        epoch, index, count = state
        if count != self.seqs.count:
            raise MistInputError(
                f"Checkpoint {where} was trained on {count} training sequences but --data now gives "
                f"{self.seqs.count}; resume with the same data, --seq-len and split."
            )
        self.position = SamplerPosition(epoch, index)


def _split(stream, cfg: TrainConfig, seq_len: int) -> tuple[PackedSequences, PackedSequences | None]:
    """The training sequences and, with --eval-fraction, the held-out ones after them."""
    name = f"data file {source_of(stream.path)}"
    total = sequence_count(stream.tokens.size, seq_len)
    if not cfg.eval_fraction:
        return PackedSequences(stream.tokens, seq_len, name=name), None
    held = max(1, round(total * cfg.eval_fraction))
    train = total - held - 1  # one sequence apart: no token is in both splits
    if train < 1:
        raise MistInputError(
            f"Data file {source_of(stream.path)} holds {total} sequences of {seq_len + 1} tokens, too few to hold out "
            f"{cfg.eval_fraction:g} of them for evaluation and train on the rest."
        )
    return (
        PackedSequences(stream.tokens, seq_len, 0, train, name=name),
        PackedSequences(stream.tokens, seq_len, train + 1, total, name=name),
    )


class EvalBatches:
    """The fixed evaluation batches, read from the token file each time they are iterated."""

    def __init__(self, batch, count: int):
        self.batch, self.count = batch, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.batch(k) for k in range(self.count))


def build_data(cfg: TrainConfig, vocab: int, seq_len: int, global_batch: int, check: bool = True):
    """(training data, evaluation batches or None) of a prepared config (its text tokenized)."""
    if cfg.data is None or not str(cfg.data).strip():
        raise MistInputError("--data needs 'synthetic' or a file path, got an empty one.")
    held = None
    train: SyntheticData | PackedData | TokenFileData
    if cfg.data == "synthetic":
        train = SyntheticData(vocab, seq_len, global_batch, cfg.seed)
    elif is_token_file(cfg.data):
        stream = open_tokens(cfg.data, vocab, cfg.token_dtype, check=check)
        seqs, held = _split(stream, cfg, seq_len)
        train = PackedData(seqs, global_batch, cfg.seed)
    else:
        train = TokenFileData(cfg.data, vocab, seq_len, global_batch)  # byte-level text
    if cfg.eval_fraction and not isinstance(train, PackedData):
        raise MistInputError(
            "--eval-fraction holds out sequences of a token file or tokenized text (--tokenizer), "
            f"not of {'synthetic data' if cfg.data == 'synthetic' else 'byte-level text'}; use --eval-data."
        )
    if cfg.eval_data:
        if is_token_file(cfg.eval_data):
            stream = open_tokens(cfg.eval_data, vocab, cfg.token_dtype, check=check)
            held = PackedSequences(stream.tokens, seq_len, name=f"evaluation data {source_of(stream.path)}")
        else:
            text = TokenFileData(cfg.eval_data, vocab, seq_len, global_batch)
            return train, EvalBatches(text.global_batch, cfg.eval_batches)
    if held is None:
        return train, None
    seqs = held

    def batch(k: int) -> torch.Tensor:
        rows = np.arange(k * global_batch, (k + 1) * global_batch) % seqs.count
        return torch.from_numpy(seqs.rows(rows))

    return train, EvalBatches(batch, cfg.eval_batches)


def _cache_name(path: Path, tok: Tokenizer, field: str) -> str:
    key = hashlib.sha256(json.dumps(fingerprint(path, tok, field), sort_keys=True).encode()).hexdigest()
    return f"{path.stem}-{key[:16]}.bin"


def _to_tokens(source: str, cfg: TrainConfig, tok: Tokenizer | None, folder: Path | None, what: str) -> str:
    """A token file holding `source` (itself when it is one; tokenized into `folder` otherwise)."""
    if not str(source or "").strip() or source == "synthetic" or is_token_file(source):
        return source
    if tok is None:
        if is_jsonl(source):
            raise MistInputError(f"{what} {source} is JSONL; reading its {cfg.text_field!r} field needs --tokenizer.")
        if Path(source).is_dir():
            raise MistInputError(f"{what} {source} is a directory, not a file (a folder of text needs --tokenizer).")
        return source  # byte-level text, read by TokenFileData
    path = Path(source) if Path(source).is_dir() else check_input_file(source, what)
    assert folder is not None
    out = folder / _cache_name(path, tok, cfg.text_field)
    return str(tokenize_file(path, tok, cfg.text_field, out, cfg.token_dtype))


@contextlib.contextmanager
def prepared(cfg: TrainConfig, vocab: int, seq_len: int, global_batch: int) -> Iterator[TrainConfig]:
    """`cfg` with its data as token files, every input checked; temporary files live as long as
    the context."""
    tok_path = tokenizer_path(cfg)
    tok = load_tokenizer(tok_path, cfg.eos_id) if tok_path else None
    if tok is not None:
        check_fits(tok, vocab)
    with contextlib.ExitStack() as stack:
        folder = None
        if tok is not None:
            if cfg.token_cache:
                folder = check_output_dir(cfg.token_cache, "--token-cache")
            else:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mist-tokens-")))
        data = _to_tokens(cfg.data, cfg, tok, folder, "Data file")
        eval_data = _to_tokens(cfg.eval_data, cfg, tok, folder, "Evaluation data file") if cfg.eval_data else None
        if tok is not None:
            # the worker processes forked next never tokenize: telling `tokenizers` so keeps its
            # fork warning (its thread pool ran here) off their stderr
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        out = replace(cfg, data=data, eval_data=eval_data, tokenizer=None)
        build_data(out, vocab, seq_len, global_batch)  # every size and id range, before any worker
        yield out


def data_state(data) -> torch.Tensor:
    """The sampler position (epoch, index, sequences) for a checkpoint; zeros for stateless data."""
    return torch.tensor(data.state() if isinstance(data, PackedData) else [0, 0, 0], dtype=torch.int64)


def restore_data_state(data, state: torch.Tensor, where) -> None:
    if isinstance(data, PackedData):
        data.restore([int(v) for v in state.tolist()], str(where))
