"""Finding profiles: built-in names (with aliases) shipped in `profiles/*.json`, or a JSON path."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from mist.errors import MistInputError
from mist.hardware.profile import GpuProfile

#: Alternative spellings -> built-in profile name (after lower-casing, '_'/' ' -> '-', 'nvidia-' dropped).
ALIASES = {
    "h200-sxm": "h200",
    "h200-sxm5": "h200",
    "h200-141gb": "h200",
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h100-80gb": "h100",
    "h100-sxm5-80gb": "h100",
    "a100": "a100-sxm4-40gb",
    "a100-40gb": "a100-sxm4-40gb",
    "a100-sxm4": "a100-sxm4-40gb",
    "a100-sxm-40gb": "a100-sxm4-40gb",
    "l4-24gb": "l4",
    "a10": "a10g",
    "a10g-24gb": "a10g",
    "v100": "v100-sxm2-32gb",
    "v100-32gb": "v100-sxm2-32gb",
    "v100-sxm2": "v100-sxm2-32gb",
}


def _profiles_dir():
    return resources.files("mist.hardware") / "profiles"


def available_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.name[: -len(".json")] for p in _profiles_dir().iterdir() if p.name.endswith(".json"))


def _normalize(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key.startswith("nvidia-"):
        key = key[len("nvidia-") :]
    return ALIASES.get(key, key)


@lru_cache(maxsize=None)
def _load_builtin(name: str) -> GpuProfile:
    text = (_profiles_dir() / f"{name}.json").read_text()
    return GpuProfile.from_dict(json.loads(text))


def _load_path(path: Path) -> GpuProfile:
    if not path.is_file():
        raise MistInputError(f"GPU profile file '{path}' does not exist.")
    try:
        return GpuProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise MistInputError(f"GPU profile file '{path}' is not a valid profile ({exc}).") from exc


def load_profile(name_or_path) -> GpuProfile:
    """A built-in profile by name (case-insensitive, aliases allowed) or a profile JSON file."""
    if isinstance(name_or_path, Path) or str(name_or_path).lower().endswith(".json"):
        return _load_path(Path(name_or_path))
    known = available_profiles()
    key = _normalize(str(name_or_path))
    if key in known:
        return _load_builtin(key)
    raise MistInputError(f"Unknown GPU '{name_or_path}'; known: {', '.join(known)}.")
