"""Finding profiles: built-in names (with aliases, `gpu_names.profile_key`) shipped in
`profiles/*.json`, or a JSON path."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from mist.errors import MistInputError
from mist.hardware.gpu_names import profile_key
from mist.hardware.profile import GpuProfile
from mist.userfiles import read_user_text


def _profiles_dir():
    return resources.files("mist.hardware") / "profiles"


def available_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.name[: -len(".json")] for p in _profiles_dir().iterdir() if p.name.endswith(".json"))


@cache
def _load_builtin(name: str) -> GpuProfile:
    text = (_profiles_dir() / f"{name}.json").read_text(encoding="utf-8")
    return GpuProfile.from_dict(json.loads(text), source=f"Built-in GPU profile {name}")


def _load_path(path: Path) -> GpuProfile:
    """A profile JSON file the user named; every problem with it is one sentence (MistInputError)."""
    what = "GPU profile file"
    text = read_user_text(path, what)
    try:
        d = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or a number too long to convert
        reason = " ".join(str(exc).split()).rstrip(".")
        raise MistInputError(f"{what} {path} is not valid JSON ({reason}).") from None
    except RecursionError:
        raise MistInputError(f"{what} {path} is not valid JSON (it is nested too deeply).") from None
    try:
        return GpuProfile.from_dict(d, source=f"{what} {path}")
    except MistInputError:
        raise
    except KeyError as exc:  # safety net: from_dict checks the fields it reads
        raise MistInputError(f"{what} {path} is missing field {exc.args[0]!r}.") from None
    except (ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        raise MistInputError(f"{what} {path} is not a valid profile ({reason}).") from None


def load_profile(name_or_path) -> GpuProfile:
    """A built-in profile by name (case-insensitive, aliases allowed) or a profile JSON file."""
    if isinstance(name_or_path, Path) or str(name_or_path).lower().endswith(".json"):
        return _load_path(Path(name_or_path))
    known = available_profiles()
    key = profile_key(str(name_or_path))
    if key in known:
        return _load_builtin(key)
    raise MistInputError(f"Unknown GPU '{name_or_path}'; known: {', '.join(known)}.")
