"""Text corpora → a token file: read the documents, tokenize them once, each followed by EOS.

Documents:

- JSONL (``.jsonl``/``.ndjson``): one JSON object per line, the text under ``--text-field``
  (default "text"); blank lines are skipped; a line that is not an object with a string there is
  an error naming its line number.
- plain text (any other name): paragraphs separated by one or more blank lines; each paragraph
  (its line breaks kept) is one document;
- a folder: its files in name order (hidden files and subfolders skipped), each read as above.

Both are read line by line as strict UTF-8, so a file larger than memory streams through. The
token stream (``doc₀ EOS doc₁ EOS …``) is written with `TokenWriter`; its sidecar records a
fingerprint of the source (each file's path, size and modification time, the tokenizer's hash, the
text field, EOS), so
a cache file (``--token-cache``) is reused only for the very same inputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mist.errors import MistInputError
from mist.runtime.token_files import TokenWriter, read_sidecar, smallest_dtype
from mist.runtime.tokenizer import Tokenizer
from mist.userfiles import check_input_file

JSONL_SUFFIXES = (".jsonl", ".ndjson")
_BATCH = 1024  # documents per encode_batch call
FORMAT = 1  # bump when the cache layout changes


def is_jsonl(path: str | Path) -> bool:
    return Path(path).suffix.lower() in JSONL_SUFFIXES


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line, decoded as strict UTF-8."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise MistInputError(f"Data file {path} is not UTF-8 text (line {n}).") from None
    except OSError as e:
        raise MistInputError(f"Data file {path} cannot be read: {e.strerror or type(e).__name__}.") from None


def jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise MistInputError(f"Data file {path}: line {n} is not valid JSON.") from None
        if not isinstance(obj, dict) or field not in obj:
            raise MistInputError(f"Data file {path}: line {n} has no {field!r} field (see --text-field).")
        text = obj[field]
        if not isinstance(text, str):
            raise MistInputError(
                f"Data file {path}: line {n} has a {type(text).__name__} under {field!r}, not a string."
            )
        yield text


def text_documents(path: Path) -> Iterator[str]:
    para: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            para.append(line)
        elif para:
            yield "".join(para).rstrip("\n")
            para = []
    if para:
        yield "".join(para).rstrip("\n")


def source_files(path: str | Path) -> list[Path]:
    """The files of a source: the file itself, or a folder's files (sorted by name, hidden ones
    and subfolders skipped)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        if not files:
            raise MistInputError(f"Data folder {p} holds no files.")
        return files
    return [check_input_file(p, "Data file")]


def documents(files: list[Path], field: str) -> Iterator[str]:
    for path in files:
        yield from jsonl_documents(path, field) if is_jsonl(path) else text_documents(path)


def fingerprint(path: Path, tok: Tokenizer, field: str) -> dict:
    """What a token cache of `path` (a file or a folder of them) depends on (compared whole)."""
    files = []
    for f in source_files(path):
        st = f.stat()
        files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return {
        "format": FORMAT,
        "data": str(Path(path).resolve()),
        "files": files,
        "tokenizer_sha256": tok.sha256,
        "text_field": field,
        "eos_id": tok.eos_id,
    }


def cached(out: Path, source: dict) -> bool:
    """Whether `out` is a complete token file written from exactly `source`."""
    side = read_sidecar(out)
    if not side or side.get("source") != source or not out.is_file():
        return False
    itemsize = {"uint16": 2, "uint32": 4}.get(str(side.get("dtype")))
    return itemsize is not None and out.stat().st_size == itemsize * side.get("tokens", -1)


def tokenize_file(path: str | Path, tok: Tokenizer, field: str, out: Path, dtype: str | None = None) -> Path:
    """Tokenize the documents of `path` (a file or a folder of them) into the token file `out`
    of `dtype` (default: the smallest that holds the vocabulary); kept when already cached."""
    path = Path(path)
    source = fingerprint(path, tok, field)
    if cached(out, source):
        return out
    writer = TokenWriter(out, dtype or smallest_dtype(tok.vocab_size), {"source": source, "eos_id": tok.eos_id})
    eos = np.array([tok.eos_id], dtype=np.int64)
    docs = 0
    try:
        batch: list[str] = []

        def flush() -> None:
            for ids in tok.encode_batch(batch):
                writer.write(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
            batch.clear()

        for text in documents(source_files(path), field):
            batch.append(text)
            docs += 1
            if len(batch) == _BATCH:
                flush()
        flush()
    except BaseException:
        writer.abort()
        raise
    if docs == 0:
        writer.abort()
        raise MistInputError(f"Data file {path} holds no documents (it is empty or only blank lines).")
    writer.close()
    return out
