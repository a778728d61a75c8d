"""On-disk cache of layer analyses, so a trace is paid once per machine, not once per command.

Entries are keyed by the analysis arguments and by a fingerprint of the code that produced them
(the model and analysis sources, and the torch version): editing a model block or the tracer
invalidates every entry. Location: $MIST_CACHE_DIR, else (unset or empty) ~/.cache/mist, and no
cache without a home folder. MIST_CACHE_DIR=off disables it. A corrupt or unreadable entry is
ignored and recomputed.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=1)
def _fingerprint() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    root = Path(__file__).resolve().parents[1]
    for sub in ("models", "analysis", "specs"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _dir() -> Path | None:
    d = os.environ.get("MIST_CACHE_DIR", "").strip()
    if not d:
        try:
            d = str(Path.home() / ".cache" / "mist")
        except RuntimeError:  # no home folder (HOME unset and no passwd entry): no cache
            return None
    if d.lower() == "off":
        return None
    return Path(d) / "analysis" / _fingerprint()


def _path(key) -> Path | None:
    d = _dir()
    if d is None:
        return None
    return d / (hashlib.sha256(repr(key).encode()).hexdigest()[:24] + ".pkl")


def enabled() -> bool:
    """Whether this process has a disk cache (a folder, not MIST_CACHE_DIR=off)."""
    return _dir() is not None


def has(key) -> bool:
    """Whether an entry is stored under `key` (not read: `load` may still find it unreadable)."""
    p = _path(key)
    return p is not None and p.is_file()


def load(key):
    p = _path(key)
    if p is None or not p.is_file():
        return None
    try:
        with open(p, "rb") as f:
            stored_key, value = pickle.load(f)
        return value if stored_key == repr(key) else None
    except Exception:
        return None


def store(key, value) -> None:
    p = _path(key)
    if p is None:
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump((repr(key), value), f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(p)
    except OSError:
        pass
