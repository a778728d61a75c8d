"""Training data: seeded synthetic sequences or a local token stream, and the batch split.

(`mist train` reads token files and tokenized text through `datasets`: packed sequences in a
seeded shuffled order; `TokenFileData` is the byte-level reading of a plain text file.)

Every layout trains on the same samples: the global batch of B sequences of step k is the same
whatever the plan; it is split into G micro-batches of B/G consecutive sequences, and each
micro-batch across the dp ranks in rank order (dp rank d takes sequences [d·b, (d+1)·b) of it).
Targets are the next tokens (each sequence is drawn with seq_len + 1 tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mist.errors import MistInputError
from mist.runtime.token_files import open_tokens
from mist.userfiles import check_input_file

_SEED_MOD = 2**64  # torch.Generator seeds are 64-bit (the same values as before for small seeds)


class SyntheticData:
    """Seeded sequences from a random Markov chain (learnable, so the loss falls).

    Each next token is a fixed random permutation of the current one, except with probability
    `noise` a uniformly random token.
    """

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int, noise: float = 0.25):
        self.vocab, self.seq_len, self.B, self.seed, self.noise = vocab, seq_len, global_batch, seed, noise
        g = torch.Generator().manual_seed((seed * 7919 + 17) % _SEED_MOD)
        self.next_token = torch.randperm(vocab, generator=g)

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step + 1) % _SEED_MOD)
        B, s = self.B, self.seq_len
        x = torch.empty(B, s + 1, dtype=torch.long)
        x[:, 0] = torch.randint(self.vocab, (B,), generator=g)
        jump = torch.rand(B, s, generator=g) < self.noise
        rnd = torch.randint(self.vocab, (B, s), generator=g)
        for t in range(s):
            x[:, t + 1] = torch.where(jump[:, t], rnd[:, t], self.next_token[x[:, t]])
        return x


def byte_tokens(data: bytes, vocab: int) -> np.ndarray:
    """Byte-level tokenizer: each byte is a token id (modulo the vocabulary when it is < 256)."""
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    return ids % vocab if vocab < 256 else ids


class TokenFileData:
    """Windows of seq_len + 1 tokens from a text file (byte-level) or a .npy of token ids.

    Sequence j of the run (j = step·B + i) starts at token (j · seq_len) mod (n − seq_len).
    """

    def __init__(self, path: str | Path, vocab: int, seq_len: int, global_batch: int):
        path = check_input_file(path, "Data file")
        if path.suffix.lower() == ".npy":
            tokens = open_tokens(path, vocab).tokens
        else:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise MistInputError(f"Data file {path} cannot be read: {e.strerror or type(e).__name__}.") from None
            tokens = byte_tokens(data, vocab)
        if tokens.size < seq_len + 1:
            raise MistInputError(
                f"Data file {path} holds {tokens.size} tokens, fewer than one sequence of {seq_len + 1}."
            )
        self.tokens, self.vocab, self.seq_len, self.B = tokens, vocab, seq_len, global_batch

    def global_batch(self, step: int) -> torch.Tensor:
        n, s = self.tokens.size, self.seq_len
        rows = []
        for i in range(self.B):
            start = ((step * self.B + i) * s) % (n - s)
            rows.append(np.asarray(self.tokens[start : start + s + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def make_data(source: str, vocab: int, seq_len: int, global_batch: int, seed: int):
    if source is None or not str(source).strip():
        raise MistInputError("--data needs 'synthetic' or a file path, got an empty one.")
    if source == "synthetic":
        return SyntheticData(vocab, seq_len, global_batch, seed)
    return TokenFileData(source, vocab, seq_len, global_batch)


def split_micro_batches(batch: torch.Tensor, G: int, dp: int, dp_rank: int):
    """This dp rank's G micro-batches [(tokens, targets)] of a global batch [B, s + 1]."""
    B = batch.shape[0]
    per_mb = B // G
    b = per_mb // dp
    out = []
    for g in range(G):
        lo = g * per_mb + dp_rank * b
        seqs = batch[lo : lo + b]
        # compact copies: a view would keep the whole global batch's storage alive (with b = 1
        # `.contiguous()` returns the view itself) and be saved for backward as such
        out.append(
            (
                seqs[:, :-1].clone(memory_format=torch.contiguous_format),
                seqs[:, 1:].clone(memory_format=torch.contiguous_format),
            )
        )
    return out
