"""Checks of a GPU profile document as `GpuProfile.from_dict` reads it: every field present, of
its type and in range, every section well formed. Anything else is one sentence (MistInputError)
that names the file and the field, never a traceback from deep inside a table's constructor."""

from __future__ import annotations

import json
import math

from mist.checks import is_int
from mist.checks import is_number as _is_number
from mist.errors import MistInputError
from mist.hardware.attention import AttentionTable
from mist.hardware.collectives import LinkModel
from mist.hardware.dp_links import _PARTS, dp_links_from_parts
from mist.hardware.gemm import GemmTable
from mist.hardware.host import HostOverhead
from mist.hardware.interference import CHANNELS, InterferenceModel
from mist.hardware.memory_ops import POINTWISE_KINDS, MemoryOpModel

FORMAT = "mist-gpu-profile"
VERSION = 1
SCALARS = (
    "memory_bytes",
    "peak_flops",
    "hbm_bandwidth",
    "h2d_bandwidth",
    "d2h_bandwidth",
    "bidir_bandwidth",
    "adam_gpu_s_per_param",
    "adam_cpu_s_per_param",
)
SECTIONS = ("links", "dp_links", "interference")  # optional: the profile's own collective/overlap models


def profile_fields(d: dict, source: str = "GPU profile") -> dict:
    """The keyword arguments of `GpuProfile` from a profile document, every field checked."""
    if not isinstance(d, dict):
        raise MistInputError(f"{source} must hold a JSON object at the top level, got {_kind(d)}.")
    if d.get("format") != FORMAT:
        raise MistInputError(f"{source} is not a valid profile (its 'format' is not {FORMAT!r}).")
    if "version" in d:
        v = d["version"]
        if not _is_whole(v) or v < 1:
            raise MistInputError(f"{source}: version must be a positive integer, got {_show(v)}.")
        if v > VERSION:
            raise MistInputError(f"{source} has profile version {int(v)}, newer than this Mist ({VERSION}).")
    for k in ("name", "provenance", "measured", *SCALARS, "gemm", "attention", "memory_ops", "host"):
        if k not in d:
            raise MistInputError(f"{source} is missing field {k!r}.")
    for k in ("name", "provenance"):
        if not isinstance(d[k], str) or (k == "name" and not d[k].strip()):
            raise MistInputError(f"{source}: {k} must be a non-empty string, got {_show(d[k])}.")
    if not isinstance(d["measured"], bool):
        raise MistInputError(f"{source}: measured must be true or false, got {_show(d['measured'])}.")
    for k in SCALARS:
        _check_number(source, k, d[k], positive=not k.startswith("adam_"))
    if d["memory_bytes"] < 1:
        raise MistInputError(f"{source}: memory_bytes must be at least 1, got {_show(d['memory_bytes'])}.")
    scalars = {k: (int(d[k]) if k == "memory_bytes" else float(d[k])) for k in SCALARS}
    host_memory = d.get("host_memory_per_gpu")
    if host_memory is not None:
        _check_number(source, "host_memory_per_gpu", host_memory, positive=True)
        if host_memory > 2**50:
            raise MistInputError(
                f"{source}: host_memory_per_gpu must be at most 2**50 bytes (1 PiB), got {_show(host_memory)}."
            )
        host_memory = float(host_memory)
    outside = d.get("outside_allocator_bytes")
    if outside is not None:
        if not _is_whole(outside) or not 0 <= outside < d["memory_bytes"]:
            raise MistInputError(
                f"{source}: outside_allocator_bytes must be a whole number of bytes from 0 to below "
                f"memory_bytes ({_show(d['memory_bytes'])}), got {_show(outside)}."
            )
        outside = int(outside)
    for k, kind in (("sources", dict), ("fingerprint", dict), ("notes", list)):
        if not isinstance(d.get(k, kind()), kind):
            raise MistInputError(
                f"{source}: {k} must be a JSON {'object' if kind is dict else 'list'}, got {_kind(d[k])}."
            )
    if not all(isinstance(n, str) for n in d.get("notes", [])):
        raise MistInputError(f"{source}: notes must be a list of strings.")
    return dict(
        name=d["name"],
        provenance=d["provenance"],
        measured=d["measured"],
        gemm=_section(d, "gemm", source, _gemm),
        attention=_section(d, "attention", source, _attention),
        memory_ops=_section(d, "memory_ops", source, _memory_ops),
        host=_section(d, "host", source, _host),
        sources=dict(d.get("sources", {})),
        fingerprint=dict(d.get("fingerprint", {})),
        notes=list(d.get("notes", [])),
        host_memory_per_gpu=host_memory,
        outside_allocator_bytes=outside,
        **_sections(d, source),
        **scalars,
    )


def _sections(d: dict, source: str = "GPU profile") -> dict:
    """The optional own-model sections of a profile document, checked (MistInputError when malformed)."""
    out = {k: d.get(k) for k in SECTIONS}
    links = None
    if out["links"] is not None:
        links = _section(d, "links", source, lambda sec, where: _links(sec, where, str(d.get("name", ""))))
    if out["dp_links"] is not None:
        _section(d, "dp_links", source, lambda sec, where: _dp_links(sec, where, str(d.get("name", "")), links))
    if out["interference"] is not None:
        _section(d, "interference", source, _interference)
    return out


# ---------------------------------------------------------------------------- document checks
def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def _is_whole(v) -> bool:
    return _is_number(v) and _finite(v) and v == int(v)


def _kind(v) -> str:
    """How a JSON value is called in a message ("a list", "null", ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _show(v) -> str:
    """A short rendering of a user value for a message."""
    if isinstance(v, float) and _finite(v) and v == int(v) and abs(v) < 1e15:
        text = str(int(v))  # 0.0 -> 0
    elif is_int(v) and len(str(v)) > 20:
        text = "an integer too large"
    elif _is_number(v):
        text = repr(v)  # nan, inf, 1.5e-09
    elif isinstance(v, (list, dict)):
        text = repr(v) if len(repr(v)) <= 60 else _kind(v)
    else:
        text = json.dumps(v) if v is None or isinstance(v, bool) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_number(where: str, key: str, v, positive: bool = False) -> float:
    """`v` as a finite number (> 0 when `positive`, else >= 0); MistInputError naming `key` otherwise."""
    if not _is_number(v) or not _finite(v) or (v <= 0 if positive else v < 0):
        kind = "a positive finite number" if positive else "a finite number >= 0"
        raise MistInputError(f"{where}: {key} must be {kind}, got {_show(v)}.")
    return float(v)


def _reason(e: Exception) -> str:
    text = " ".join(str(e).split()).rstrip(".") or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _section(d: dict, key: str, source: str, build):
    """build(section, where) for the object `d[key]`; every failure becomes one sentence naming it."""
    if key not in d:
        raise MistInputError(f"{source} is missing field {key!r}.")
    sec = d[key]
    if not isinstance(sec, dict):
        raise MistInputError(f"{source}: section {key!r} must be a JSON object, got {_kind(sec)}.")
    try:
        return build(sec, f"{source}, section {key!r}")
    except MistInputError:
        raise
    except KeyError as e:
        raise MistInputError(f"{source}: section {key!r} is missing field {e.args[0]!r}.") from None
    except (ValueError, TypeError, AttributeError, IndexError, OverflowError) as e:
        raise MistInputError(f"{source}: section {key!r} is malformed ({_reason(e)}).") from None


def _axes(sec: dict, where: str, keys) -> None:
    for k in keys:
        axis = sec[k]
        if not isinstance(axis, list) or len(axis) < 2 or not all(_is_number(x) and _finite(x) and x > 0 for x in axis):
            raise MistInputError(f"{where}: {k} must be a list of at least 2 positive finite numbers.")


def _gemm(sec: dict, where: str) -> GemmTable:
    _axes(sec, where, ("m_axis", "n_axis", "k_axis"))
    _check_number(where, "floor_s", sec["floor_s"])
    _check_number(where, "roofline_bandwidth", sec["roofline_bandwidth"], positive=True)
    eb = sec.get("element_bytes", 2)
    if not _is_whole(eb) or not 1 <= eb <= 64:
        raise MistInputError(f"{where}: element_bytes must be a whole number of bytes, got {_show(eb)}.")
    return GemmTable.from_dict(sec)


def _attention(sec: dict, where: str) -> AttentionTable:
    _axes(sec, where, ("b_axis", "heads_axis", "s_axis", "d_axis"))
    for k in ("fwd_floor_s", "bwd_floor_s"):
        _check_number(where, k, sec[k])
    return AttentionTable.from_dict(sec)


def _memory_ops(sec: dict, where: str) -> MemoryOpModel:
    _check_number(where, "floor_s", sec["floor_s"])
    bw = sec["bandwidth"]
    if not isinstance(bw, dict):
        raise MistInputError(f"{where}: bandwidth must be a JSON object of op classes, got {_kind(bw)}.")
    for c, v in bw.items():
        if not isinstance(v, dict):
            raise MistInputError(f"{where}: bandwidth of class {c!r} must be an object with fwd and bwd.")
        for k in ("fwd", "bwd"):
            _check_number(where, f"bandwidth {c}.{k}", v[k], positive=True)
    pw = sec.get("pointwise_s")
    if pw is not None:
        if not isinstance(pw, dict):
            raise MistInputError(f"{where}: pointwise_s must be a JSON object of kinds, got {_kind(pw)}.")
        for k, v in pw.items():
            if k not in POINTWISE_KINDS:
                raise MistInputError(
                    f"{where}: pointwise_s has kind {k!r}; the kinds are {', '.join(POINTWISE_KINDS)}."
                )
            _check_number(where, f"pointwise_s {k}", v)
    return MemoryOpModel.from_dict(sec)


def _host(sec: dict, where: str) -> HostOverhead:
    for k in ("fwd_op_s", "bwd_op_s", "backward_call_s"):
        _check_number(where, k, sec[k])
    return HostOverhead.from_dict(sec)


def _fit_table(table, where: str, what: str) -> None:
    """{group size: [alpha_s, busbw_Bps]}: sizes >= 2, alpha >= 0, busbw > 0, all finite."""
    if not isinstance(table, dict) or not table:
        raise MistInputError(f"{where}: {what} must be a non-empty object of group size -> [alpha_s, busbw_Bps].")
    for n, ab in table.items():
        ok = isinstance(ab, list) and len(ab) == 2 and all(_is_number(x) and _finite(x) for x in ab)
        if not ok or not (str(n).isdigit() and int(n) >= 2 and ab[0] >= 0 and ab[1] > 0):
            raise MistInputError(
                f"{where}: bad fit {what}/{n}: need a group size >= 2 and "
                f"[alpha_s >= 0, busbw_Bps > 0], got {_show(ab)}."
            )


def _links(sec: dict, where: str, name: str):
    fits = sec.get("fits")
    if not isinstance(fits, dict) or not fits:
        raise MistInputError(f"{where} needs 'fits': {{op: {{group size: [alpha_s, busbw_Bps]}}}}.")
    for op, table in fits.items():
        _fit_table(table, where, str(op))
    sync = sec.get("sync_s", 0.0)
    _check_number(where, "sync_s", sync)
    return LinkModel(name, "", fits)


def _dp_links(sec: dict, where: str, name: str, links) -> None:
    for part, keys in _PARTS.items():
        if part in sec:
            v = sec[part]
            if not isinstance(v, dict):
                raise MistInputError(f"{where}: part {part!r} must be a JSON object, got {_kind(v)}.")
            for k in keys:
                if k not in v:
                    raise MistInputError(f"{where}: part {part!r} is missing field {k!r}.")
                _check_number(where, f"{part}.{k}", v[k], positive=k != "alpha_s")
    if "intra_allgather" in sec:
        part = sec["intra_allgather"]
        _fit_table(part.get("fits") if isinstance(part, dict) else None, where, "intra_allgather.fits")
    dp_links_from_parts(name, links, sec)


def _interference(sec: dict, where: str) -> None:
    factors = sec["factors"]
    if not isinstance(factors, dict):
        raise MistInputError(f"{where}: factors must be a JSON object of channel sets, got {_kind(factors)}.")
    for key in factors:
        if not all(c.strip() in CHANNELS for c in str(key).split("+")):
            raise MistInputError(
                f"{where}: factors has an unknown channel set {str(key)[:40]!r} (channels: {', '.join(CHANNELS)})."
            )
    InterferenceModel.from_json(sec)
