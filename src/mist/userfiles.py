"""Files the user names: read them (UTF-8; JSON or YAML documents, a repeated key an error), or
check before any work that an output can be written.

A command that searches, trains or measures for minutes must not fail at the end because its
output path was a directory or lay in a folder that does not exist; these checks run first and
end with one sentence (MistInputError) instead.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mist.errors import MistInputError


def check_input_file(path: str | Path, what: str) -> Path:
    """`path` as a Path, checked to name an existing regular file (`what`: "Plan file", ...)."""
    if path is None or not str(path).strip():
        raise MistInputError(f"{what} needs a file path, got an empty one.")
    path = Path(path)
    if path.is_dir():
        raise MistInputError(f"{what} {path} is a directory, not a file.")
    if not path.exists():
        raise MistInputError(f"{what} {path} does not exist.")
    if not path.is_file():
        raise MistInputError(f"{what} {path} is not a regular file.")
    return path


def read_user_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file the user gave as `what` ("Plan file", "GPU profile file", ...)."""
    path = check_input_file(path, what)
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
    if p.exists() and not p.is_file():  # a FIFO or a device: opening it could block
        raise MistInputError(f"{what} {path} is not a regular file.")
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


# ---------------------------------------------------------------------------- JSON and YAML documents
class _YamlLoader:  # built lazily so that importing this module does not import PyYAML
    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            import yaml

            class Loader(yaml.SafeLoader):
                def construct_mapping(self, node, deep=False):
                    if isinstance(node, yaml.MappingNode):
                        seen = set()
                        for key_node, _ in node.value:
                            key = self.construct_object(key_node, deep=deep)
                            try:
                                repeated = key in seen
                                seen.add(key)
                            except TypeError:  # an unhashable key: the base class says so
                                continue
                            if repeated and key != "<<":
                                raise yaml.constructor.ConstructorError(
                                    None, None, f"key {key!r} appears twice", key_node.start_mark
                                )
                    return super().construct_mapping(node, deep)

            # YAML 1.1 (PyYAML) reads `1e-5` as a string because it lacks a dot; users write
            # norm_eps and ratios that way, so also resolve exponent-only numbers as floats.
            Loader.add_implicit_resolver(
                "tag:yaml.org,2002:float",
                re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
                list("-+0123456789."),
            )
            cls.cls = Loader
        return cls.cls


class _Repeated(ValueError):
    pass


def _no_repeats(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Repeated(k)
        out[k] = v
    return out


def parse_json(text: str, path, what: str):
    """A JSON document; one sentence naming `what` and `path` when it is not valid or repeats a key."""
    try:
        return json.loads(text, object_pairs_hook=_no_repeats)
    except _Repeated as e:
        raise MistInputError(f"{what} {path} is not valid JSON (key {e.args[0]!r} appears twice).") from None
    except json.JSONDecodeError as e:
        raise MistInputError(f"{what} {path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}).") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer too long to convert, nesting too deep
        reason = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        raise MistInputError(f"{what} {path} is not valid JSON ({reason}).") from None


def parse_yaml(text: str, path, what: str):
    """A YAML document (safe loading; exponent-only numbers are floats; a repeated key is an error)."""
    import yaml

    try:
        return yaml.load(text, Loader=_YamlLoader.get())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None)
        detail = f" ({problem}{where})" if problem else (f" ({where.strip()})" if where else "")
        raise MistInputError(f"{what} {path} is not valid YAML{detail}.") from None
    except RecursionError:
        raise MistInputError(f"{what} {path} is not valid YAML (it is nested too deeply).") from None


def parse_document(text: str, path, what: str):
    """A user's JSON or YAML file: by its extension (any case), else JSON first, then YAML."""
    suffix = Path(path).suffix.lower()
    if suffix in YAML_SUFFIXES:
        return parse_yaml(text, path, what)
    if suffix == ".json":
        return parse_json(text, path, what)
    try:
        return json.loads(text, object_pairs_hook=_no_repeats)
    except (ValueError, RecursionError):
        return parse_yaml(text, path, what)


YAML_SUFFIXES = (".yaml", ".yml")
