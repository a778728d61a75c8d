"""Files the user names: read them, or check before any work that an output can be written.

A command that searches, trains or measures for minutes must not fail at the end because its
output path was a directory or lay in a folder that does not exist; these checks run first and
end with one sentence (MistInputError) instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from mist.errors import MistInputError


def read_user_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file the user gave as `what` ("Plan file", "GPU profile file", ...)."""
    if path is None or not str(path).strip():
        raise MistInputError(f"{what} needs a file path, got an empty one.")
    path = Path(path)
    if path.is_dir():
        raise MistInputError(f"{what} {path} is a directory, not a file.")
    if not path.is_file():
        raise MistInputError(f"{what} {path} does not exist.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MistInputError(f"{what} {path} is not UTF-8 text.") from None
    except OSError as e:
        raise MistInputError(f"Cannot read {what.lower()} {path}: {e.strerror or type(e).__name__}.") from None


def check_output_file(path: str | Path, what: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Check that `path` can be written as a file (`what`: "--output", "--metrics", ...), creating
    nothing that was not there: its folder exists, it is not a folder, and opening it for writing
    works. `suffixes` (lower case, with the dot), when given, are the allowed extensions."""
    if path is None or not str(path).strip():
        raise MistInputError(f"{what} needs a file path, got an empty one.")
    p = Path(path)
    if suffixes and p.suffix.lower() not in suffixes:
        raise MistInputError(f"{what} must end with {', '.join(suffixes)}, got {str(path)!r}.")
    if p.is_dir():
        raise MistInputError(f"{what} {path} is a directory, not a file.")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise MistInputError(f"{what} {path}: the folder {parent} does not exist.")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise MistInputError(f"{what} {path} cannot be written: {e.strerror or type(e).__name__}.") from None
    if not existed:
        os.unlink(p)
    return p


def check_output_dir(path: str | Path, what: str) -> Path:
    """Check that `path` is, or can be made, a writable folder (made here if missing)."""
    if path is None or not str(path).strip():
        raise MistInputError(f"{what} needs a folder path, got an empty one.")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise MistInputError(f"{what} {path} is a file, not a folder.")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MistInputError(f"{what} {path} cannot be created: {e.strerror or type(e).__name__}.") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise MistInputError(f"{what} {path} is not writable.")
    return p
