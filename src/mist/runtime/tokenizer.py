"""A Hugging Face `tokenizer.json`, read with the `tokenizers` library, and its EOS token.

`--tokenizer PATH` names a tokenizer.json or a folder holding one (a Hugging Face checkpoint).
Its vocabulary (added tokens included) must fit the model's ``vocab_size``; the EOS id that
separates packed documents is ``--eos-id`` or the first of the usual end-of-text tokens the
tokenizer knows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mist.errors import MistInputError

# end-of-text tokens of the common families (GPT-2/NeoX, Llama/Mistral, Llama 3, Falcon, T5-style)
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")


@dataclass(frozen=True)
class Tokenizer:
    path: Path  # the tokenizer.json
    vocab_size: int  # one past the largest id, added tokens included
    eos_id: int
    sha256: str  # of the file: part of a token cache's fingerprint
    backend: Any  # tokenizers.Tokenizer

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without special tokens (EOS is added by the packing)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that `path` names (itself, or the one inside a folder)."""
    if path is None or not str(path).strip():
        raise MistInputError("--tokenizer needs a tokenizer.json or a folder holding one, got an empty path.")
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise MistInputError(f"Tokenizer {path} is neither a tokenizer.json file nor a folder holding one.")
    return p


def load_tokenizer(path: str | Path, eos_id: int | None = None) -> Tokenizer:
    """Read a tokenizer.json; MistInputError when it is not one or has no EOS token."""
    try:
        import tokenizers
    except ImportError:
        raise MistInputError(
            "--tokenizer needs the `tokenizers` package, which is not installed (pip install tokenizers)."
        ) from None
    p = tokenizer_file(path)
    try:
        raw = p.read_bytes()
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, Exception) as e:  # noqa: BLE001 - the library raises plain Exception
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MistInputError(f"Tokenizer {p} is not a readable tokenizer.json ({why.rstrip('.')}).") from None
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    if eos_id is None:
        found = [backend.token_to_id(name) for name in EOS_NAMES]
        found = [i for i in found if i is not None]
        if not found:
            raise MistInputError(
                f"Tokenizer {p} has none of the end-of-text tokens {', '.join(EOS_NAMES)}; "
                "give the separator's id with --eos-id."
            )
        eos_id = int(found[0])  # type: ignore[arg-type]  # the Nones were filtered out
    elif not 0 <= eos_id < max(size, 1):
        raise MistInputError(f"--eos-id {eos_id} lies outside the tokenizer's vocabulary [0, {size}).")
    return Tokenizer(p, size, eos_id, hashlib.sha256(raw).hexdigest(), backend)


def check_fits(tok: Tokenizer, model_vocab: int) -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    if tok.vocab_size > model_vocab:
        raise MistInputError(
            f"Tokenizer {tok.path} has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab}; use the model's own tokenizer or a plan whose vocab_size covers it."
        )
