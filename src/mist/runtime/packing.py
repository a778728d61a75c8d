"""Packing: a token stream of documents, each followed by EOS, cut into training sequences.

Sequence i is tokens[i·s : i·s + s + 1] (s = seq_len): s inputs and their s next-token targets,
consecutive sequences sharing one boundary token so that every token of the stream is a target
once. A document may span sequences and a sequence may hold several documents; attention is not
masked at the EOS separators (the usual packed pre-training setup). The trailing tokens that do
not fill a sequence are dropped.
"""

from __future__ import annotations

import numpy as np

from mist.errors import MistInputError


class PackedSequences:
    """The sequences [lo, hi) of a packed token stream (a window of `count` of them)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, lo: int = 0, hi: int | None = None, name: str = "data"):
        self.tokens, self.seq_len = tokens, seq_len
        total = sequence_count(tokens.size, seq_len)
        hi = total if hi is None else hi
        if not 0 <= lo < hi <= total:
            raise MistInputError(f"The {name} holds {tokens.size} tokens, fewer than one sequence of {seq_len + 1}.")
        self.lo, self.hi = lo, hi

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def rows(self, indices) -> np.ndarray:
        """[len(indices), seq_len + 1] int64: the sequences of these (window-relative) indices."""
        s = self.seq_len
        out = np.empty((len(indices), s + 1), dtype=np.int64)
        for r, i in enumerate(indices):
            start = (self.lo + int(i)) * s
            out[r] = self.tokens[start : start + s + 1]
        return out


def sequence_count(tokens: int, seq_len: int) -> int:
    """How many whole sequences of seq_len + 1 tokens (stride seq_len) a stream of `tokens` holds."""
    return max(tokens - 1, 0) // seq_len
