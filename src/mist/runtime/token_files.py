"""Token files: a 1-D stream of token ids on disk, memory-mapped, never read whole.

Two formats hold a token stream:

- ``.npy``: a NumPy array of integer ids (its header says the dtype);
- raw binary (any other name, e.g. ``tokens.bin``): little-endian uint16 or uint32 ids, the dtype
  given by ``--token-dtype`` or by the sidecar ``tokens.bin.json`` that `TokenWriter` writes next
  to it (``{"dtype": "uint16", "tokens": N, "max_id": M, "eos_id": E, "source": {...}}``).

`open_tokens` maps either as a read-only `np.memmap`; checking that every id lies in the model's
vocabulary reads the file in chunks (or trusts the sidecar's ``max_id``), so a corpus larger than
the host's memory trains without being loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mist.errors import MistInputError
from mist.userfiles import check_input_file

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_CHUNK = 1 << 24  # ids per chunk when scanning a file's range (64 MiB of uint32)


@dataclass(frozen=True)
class TokenStream:
    """A memory-mapped token stream: `tokens` (read-only, 1-D) and where it came from."""

    path: Path
    tokens: np.ndarray
    max_id: int  # the largest id (-1 when empty)


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of a raw token file: ``tokens.bin`` → ``tokens.bin.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def read_sidecar(path: str | Path) -> dict | None:
    """The sidecar of a raw token file, or None when it has none (or an unreadable one)."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        d = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def smallest_dtype(vocab: int) -> str:
    """uint16 when every id of a vocabulary of `vocab` fits in it, else uint32."""
    return "uint16" if vocab <= 1 << 16 else "uint32"


def _scan_range(tokens: np.ndarray) -> tuple[int, int]:
    """(min, max) of the ids, read chunk by chunk (a memmap's pages are only mapped, not kept)."""
    lo: int | None = None
    hi = -1
    for start in range(0, tokens.size, _CHUNK):
        part = np.asarray(tokens[start : start + _CHUNK])
        a, b = int(part.min()), int(part.max())
        lo = a if lo is None else min(lo, a)
        hi = max(hi, b)
    return (0, -1) if lo is None else (lo, hi)


def _open_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        why = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise MistInputError(f"Data file {path} is not a readable .npy array ({why}).") from None
    if not isinstance(tokens, np.ndarray):  # an .npz archive under a .npy name
        getattr(tokens, "close", lambda: None)()
        raise MistInputError(f"Data file {path} is an .npz archive, not a .npy array of token ids.")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise MistInputError(
            f"Data file {path} must hold a 1-D array of integer token ids, not an array "
            f"of shape {tuple(tokens.shape)} and dtype {tokens.dtype}."
        )
    return tokens


def _open_raw(path: Path, token_dtype: str | None) -> tuple[np.ndarray, int | None]:
    side = read_sidecar(path)
    if side and token_dtype and side.get("dtype") != token_dtype:
        raise MistInputError(
            f"Token file {path} holds {side.get('dtype')} ids (its sidecar {sidecar_path(path).name} "
            f"says so), not --token-dtype {token_dtype}."
        )
    name = token_dtype or (side or {}).get("dtype")
    if name is None:
        raise MistInputError(
            f"Token file {path} has no sidecar {sidecar_path(path).name} naming its dtype; "
            "give --token-dtype uint16 or uint32."
        )
    if name not in TOKEN_DTYPES:
        raise MistInputError(f"Token file {path}: dtype {name!r} is not one of uint16, uint32.")
    dtype = TOKEN_DTYPES[name]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise MistInputError(
            f"Token file {path} holds {size} bytes, not a whole number of {name} ids; is --token-dtype right?"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    # a sidecar written with this very file (same length) already knows the largest id
    known = side.get("max_id") if side and side.get("tokens") == tokens.size and side.get("dtype") == name else None
    return tokens, known if isinstance(known, int) else None


def open_tokens(path: str | Path, vocab: int, token_dtype: str | None = None, check: bool = True) -> TokenStream:
    """Map the token file at `path`; with `check`, every id must lie in [0, vocab)."""
    path = check_input_file(path, "Data file")
    if path.suffix.lower() == ".npy":
        tokens, known = _open_npy(path), None
    else:
        tokens, known = _open_raw(path, token_dtype)
    max_id = known if known is not None else -1
    if check:
        lo, hi = (0, known) if known is not None else _scan_range(tokens)
        if tokens.size and (lo < 0 or hi >= vocab):
            raise MistInputError(
                f"Data file {path} holds token ids outside the model's vocabulary [0, {vocab}) "
                f"(they range over [{lo}, {hi}])."
            )
        max_id = hi
    return TokenStream(path, tokens, max_id)


class TokenWriter:
    """Append token ids to a raw token file, then publish it with its sidecar atomically.

    The ids go to ``PATH.tmp-<pid>`` and are renamed to PATH on `close`, so processes racing to
    write the same cache never expose a half-written file (each writes the same content).
    """

    def __init__(self, path: str | Path, dtype: str, meta: dict):
        self.path, self.dtype, self.meta = Path(path), dtype, meta
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self.count, self.max_id = 0, -1

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
            self.file.write(np.ascontiguousarray(ids, dtype=TOKEN_DTYPES[self.dtype]).tobytes())
            self.count += int(ids.size)

    def close(self) -> None:
        self.file.close()
        side = {**self.meta, "dtype": self.dtype, "tokens": self.count, "max_id": self.max_id}
        tmp_side = self.tmp.with_name(self.tmp.name + ".json")
        tmp_side.write_text(json.dumps(side, indent=1), encoding="utf-8")
        os.replace(self.tmp, self.path)
        os.replace(tmp_side, sidecar_path(self.path))

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
