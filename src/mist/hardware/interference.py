"""Interference of concurrent compute and communication: Mist's progressive-overlap estimator.

Four channels run at once on separate CUDA streams of one GPU (the Mist paper's model; see
docs/profiles.md):

    C    compute (GEMMs)
    G2G  GPU↔GPU collective (NCCL)
    C2G  host→device copy (pinned H2D)
    G2C  device→host copy (pinned D2H)

Given the standalone seconds X = (x_C, x_G2G, x_C2G, x_G2C) of the work queued on each channel,
and for every set A of ≥ 2 channels a slowdown factor f_A[c] ≥ 1 per channel c ∈ A (a channel in
set A runs 1/f_A[c] as fast as alone), the estimator advances time phase by phase:

    t = 0
    repeat:
        A = {c : x_c > 0};  if |A| ≤ 1: return t + Σ x
        y_c = x_c · f_A[c]           (time to finish c if A stayed the active set)
        δ = min_c y_c;  t += δ
        x_c = (y_c − δ) / f_A[c]     (standalone work left)

Each phase finishes at least one channel exactly (y − δ = 0 for the arg-min), so three phases
suffice for four channels. `overlap_time` runs those ≤ 3 phases as array operations over any
number of leading candidate axes (no per-candidate Python loop).

Special factor sets (`InterferenceModel` constructors):

* `perfect()` — f = 1 everywhere: every channel runs at full speed, t = max(X).
* `serial()`  — f_A[c] = |A| for every channel: each of the k active channels runs at 1/k of its
  speed (equal processor sharing). Each phase removes min-x of standalone work from each of the k
  channels in k·min-x seconds, i.e. exactly one second of standalone work per second, so the
  result is t = Σ X **for every X** (not only for equal times): the serial-sum bound, reached by
  a work-conserving schedule. It is Mist's fit start value and the safe fallback.

Fitted factor sets are shipped per GPU in `overlap/<gpu>.json` (written offline by
`tools/profile_build/fit_overlap.py`); `load_interference(gpu)` returns them, or a labelled
fallback (see its docstring).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from itertools import combinations

import numpy as np

from mist.hardware.gpu_names import normalize_gpu

CHANNELS = ("C", "G2G", "C2G", "G2C")
_IDX = {c: i for i, c in enumerate(CHANNELS)}

#: The 11 channel sets with ≥ 2 members, as index tuples: 6 pairs, 4 triples, then the four-set.
SUBSETS: tuple[tuple[int, ...], ...] = tuple(s for k in (2, 3, 4) for s in combinations(range(len(CHANNELS)), k))
N_FACTORS = sum(len(s) for s in SUBSETS)  # 28


def subset_key(subset) -> str:
    """'C+G2G' style key of a channel set given as indices or names (canonical channel order)."""
    idx = sorted(_IDX[c] if isinstance(c, str) else int(c) for c in subset)
    return "+".join(CHANNELS[i] for i in idx)


def _parse_key(key: str) -> tuple[int, ...]:
    idx = tuple(sorted(_IDX[c.strip()] for c in key.split("+")))
    if len(idx) < 2 or len(set(idx)) != len(idx):
        raise ValueError(f"bad channel set '{key}': need ≥ 2 distinct channels of {CHANNELS}")
    return idx


def _mask(subset) -> int:
    return sum(1 << i for i in subset)


@dataclass
class InterferenceModel:
    """Slowdown factors f_A[c] for the 11 channel sets A with |A| ≥ 2 (28 numbers).

    `factors` maps a set key such as "C+G2G" (channels in the order C, G2G, C2G, G2C) to the
    list of its members' factors in that same order. Missing sets default to serial (|A|).
    """

    factors: dict
    provenance: str
    gpu: str = ""
    extra: dict = field(default_factory=dict)  # free-form metadata kept through (de)serialization

    def __post_init__(self):
        clean = {}
        for key, vals in self.factors.items():
            idx = _parse_key(key)
            vals = [float(v) for v in vals]
            if len(vals) != len(idx):
                raise ValueError(f"set '{key}' needs {len(idx)} factors, got {len(vals)}")
            if not all(np.isfinite(v) and v > 0 for v in vals):
                raise ValueError(f"set '{key}': factors must be finite and > 0, got {vals}")
            clean[subset_key(idx)] = vals
        for s in SUBSETS:  # fill the missing sets with the serial value
            clean.setdefault(subset_key(s), [float(len(s))] * len(s))
        self.factors = {subset_key(s): clean[subset_key(s)] for s in SUBSETS}
        self._table = None

    # ---- array views -------------------------------------------------------------------------
    def table(self) -> np.ndarray:
        """(16, 4) array: row = bitmask of the active set (bit i = channel i), column = channel.

        Entries of channels outside the set, and rows of sets with < 2 channels, are 1.
        """
        if self._table is None:
            t = np.ones((16, len(CHANNELS)))
            for s in SUBSETS:
                t[_mask(s), list(s)] = self.factors[subset_key(s)]
            self._table = t
        return self._table

    def vector(self) -> np.ndarray:
        """The 28 factors in `SUBSETS` order (pairs, triples, four-set; members in channel order)."""
        return np.array([v for s in SUBSETS for v in self.factors[subset_key(s)]])

    @classmethod
    def from_vector(cls, vec, provenance: str, gpu: str = "") -> InterferenceModel:
        vec = np.asarray(vec, dtype=float).ravel()
        if vec.size != N_FACTORS:
            raise ValueError(f"need {N_FACTORS} factors, got {vec.size}")
        out, i = {}, 0
        for s in SUBSETS:
            out[subset_key(s)] = vec[i : i + len(s)].tolist()
            i += len(s)
        return cls(out, provenance, gpu)

    def time(self, x) -> np.ndarray:
        """`overlap_time(x, self)`."""
        return overlap_time(x, self)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def serial(cls, gpu: str = "", provenance: str | None = None) -> InterferenceModel:
        """f_A[c] = |A|: equal sharing among the active channels, so overlap_time(X) = Σ X exactly."""
        return cls(
            {subset_key(s): [float(len(s))] * len(s) for s in SUBSETS},
            provenance or "fallback: serial sum (f_A[c] = |A|, equal sharing → Σ X exactly)",
            gpu,
        )

    @classmethod
    def perfect(cls, gpu: str = "", provenance: str | None = None) -> InterferenceModel:
        """f = 1 everywhere: perfect overlap, overlap_time(X) = max(X)."""
        return cls(
            {subset_key(s): [1.0] * len(s) for s in SUBSETS},
            provenance or "bound: perfect overlap (all f = 1 → max X)",
            gpu,
        )

    # ---- (de)serialization -------------------------------------------------------------------
    def to_json(self) -> dict:
        d = {
            "gpu": self.gpu,
            "provenance": self.provenance,
            "channels": list(CHANNELS),
            "factors": {k: [round(v, 5) for v in vals] for k, vals in self.factors.items()},
        }
        if self.extra:
            d["extra"] = self.extra
        return d

    @classmethod
    def from_json(cls, d) -> InterferenceModel:
        if isinstance(d, str):
            d = json.loads(d)
        chans = tuple(d.get("channels", CHANNELS))
        if chans != CHANNELS:
            raise ValueError(f"channel order {chans} is not {CHANNELS}")
        return cls(dict(d["factors"]), d.get("provenance", ""), d.get("gpu", ""), dict(d.get("extra", {})))


def _as_table(factors) -> np.ndarray:
    if isinstance(factors, InterferenceModel):
        return factors.table()
    t = np.asarray(factors, dtype=float)
    if t.shape != (16, len(CHANNELS)):
        raise ValueError("factors must be an InterferenceModel or a (16, 4) table")
    return t


def overlap_time(x, factors) -> np.ndarray:
    """Seconds until all four channels finish, by the progressive-overlap estimator.

    x: array-like (..., 4) of standalone seconds (C, G2G, C2G, G2C); zeros mean an idle channel.
    factors: an `InterferenceModel` (or its (16, 4) `table()`).
    Returns an array of shape x.shape[:-1] (0-d for a single 4-vector).
    """
    table = _as_table(factors)
    x = np.array(x, dtype=float)  # copy
    if x.ndim == 0 or x.shape[-1] != len(CHANNELS):
        raise ValueError(f"x must have a last axis of length {len(CHANNELS)}, got shape {x.shape}")
    if np.any(x < 0):
        raise ValueError("standalone times must be ≥ 0")
    shape = x.shape[:-1]
    x = x.reshape(-1, len(CHANNELS))
    bits = (1 << np.arange(len(CHANNELS))).astype(float)
    t = np.zeros(x.shape[0])
    for _ in range(len(CHANNELS) - 1):  # each phase finishes ≥ 1 channel: ≤ 3 phases
        active = x > 0
        run = active.sum(axis=-1) >= 2
        if not run.any():
            break
        f = table[(active @ bits).astype(np.intp)]  # (..., 4); rows of sets with < 2 channels are 1
        y = x * f
        delta = np.where(active, y, np.inf).min(axis=-1)
        delta[~run] = 0.0  # ≤ 1 channel left: nothing to overlap (and x·1/1 leaves x unchanged)
        x = np.where(active, (y - delta[..., None]) / f, x)
        t += delta
    return (t + x.sum(axis=-1)).reshape(shape)


# ---- shipped fits and fallbacks --------------------------------------------------------------


def _overlap_dir():
    return resources.files("mist.hardware") / "overlap"


def load_overlap_doc(gpu: str) -> dict | None:
    """The shipped `overlap/<gpu>.json` document (fits and errors), or None."""
    path = _overlap_dir() / f"{normalize_gpu(gpu)}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _h200_pairs_doc() -> dict:
    """`overlap/_h200-pairs.json`: the measured H200 pairwise interference points (GEMM vs
    pinned H2D / D2H / D2D copies, bidirectional pinned copy) and the assumed defaults used
    when the A100 fit to borrow from is missing; its provenance says where they come from."""
    return json.loads((_overlap_dir() / "_h200-pairs.json").read_text(encoding="utf-8"))


def pairwise_additive(pairs: dict, provenance: str, gpu: str = "") -> InterferenceModel:
    """Factors of the triples and the four-set composed from the 6 pairs by adding excess slowdowns:
    f_A[c] = 1 + Σ_{d ∈ A, d ≠ c} (f_{c,d}[c] − 1). `pairs` maps the 6 pair keys to factor pairs."""
    pf = {}
    for s in SUBSETS[:6]:
        a, b = s
        fa, fb = pairs[subset_key(s)]
        pf[(a, b)], pf[(b, a)] = float(fa), float(fb)
    out = {}
    for s in SUBSETS:
        out[subset_key(s)] = [1.0 + sum(pf[(c, d)] - 1.0 for d in s if d != c) for c in s]
    return InterferenceModel(out, provenance, gpu)


def h200_fallback() -> InterferenceModel:
    """H200 fallback built from the measured pairwise points of `overlap/_h200-pairs.json`, plus
    borrowed values.

    * {C, C2G}, {C, G2C}: the measured GEMM-vs-pinned-copy slowdowns, clamped at ≥ 1 (a value
      below 1 is measurement noise): about no interference.
    * {C2G, G2C}: from the bidirectional pinned copy (1 GiB each way, alone and together):
      f = together / alone for each direction — both copies finish together, as measured.
    * {C, G2G}: **not measured on H200**. The GEMM-vs-D2D point is *dropped*: a D2D
      copy streams HBM at ~4.3 TB/s, while an NVLink-4 all-gather moves ≤ 0.45 TB/s per direction
      through HBM, so D2D overstates the contention by about an order of magnitude; it is kept in
      `extra` as an upper bound only. Instead the pair fitted on A100-SXM4 (NVLink + NVSwitch, the
      nearest measured system; overlap/a100-sxm4-40gb.json) is borrowed, or the assumed default
      of `_h200-pairs.json` when that file is missing.
    * {G2G, C2G}, {G2G, G2C}: not measured; borrowed from the A100 fit likewise (NVLink traffic vs
      PCIe host copies use different links), else the assumed mild default of `_h200-pairs.json`.
    * triples and the four-set: composed from the pairs by `pairwise_additive` (adding each
      channel's excess slowdowns). This composition's error on the measured GPUs is reported in
      `overlap/<gpu>.json` → fit_errors.pairs_additive.
    """
    doc = _h200_pairs_doc()
    m = {k: {kk: v for kk, v in point.items() if kk != "what"} for k, point in doc["pairs"].items()}
    pairs = {
        "C+C2G": [max(1.0, m["gemm_vs_h2d"]["gemm_slowdown"]), max(1.0, m["gemm_vs_h2d"]["copy_slowdown"])],
        "C+G2C": [max(1.0, m["gemm_vs_d2h"]["gemm_slowdown"]), max(1.0, m["gemm_vs_d2h"]["copy_slowdown"])],
        "C2G+G2C": [
            m["bidir"]["both_ms"] / m["bidir"]["h2d_alone_ms"],
            m["bidir"]["both_ms"] / m["bidir"]["d2h_alone_ms"],
        ],
    }
    a100 = load_overlap_doc("a100-sxm4-40gb")
    if a100 is not None:
        af = a100["interference"]["factors"]
        borrowed = {k: af[k] for k in ("C+G2G", "G2G+C2G", "G2G+G2C")}
        src = "borrowed from the A100-SXM4-40GB fit (overlap/a100-sxm4-40gb.json)"
    else:
        borrowed = {k: list(v) for k, v in doc["defaults"]["factors"].items()}
        src = "mild defaults (A100 fit file missing)"
    pairs.update(borrowed)
    prov = (
        "fallback for h200: measured pairs {C,C2G}, {C,G2C} (GEMM vs pinned H2D/D2H) and "
        "{C2G,G2C} (bidirectional pinned copy) from data/gpus/h200/system.json; {C,G2G}, "
        f"{{G2G,C2G}}, {{G2G,G2C}} {src}; GEMM-vs-D2D point dropped (HBM upper bound, not a "
        "G2G proxy); triples and four-set composed pairwise-additively"
    )
    model = pairwise_additive(pairs, prov, "h200")
    model.extra = {"dropped_upper_bound_gemm_vs_d2d": m["gemm_vs_d2d"]}
    return model


def load_interference(gpu: str) -> InterferenceModel:
    """Interference factors for a GPU (read once per process and GPU: a search builds a stage
    model per candidate layout, each asking for them; the model is not modified after loading).

    1. `overlap/<gpu>.json` written by `tools/profile_build/fit_overlap.py` (l4, a100-sxm4-40gb,
       v100-sxm2-16gb): least-squares fit to the Mist artifact's overlap benchmark (provenance
       says so).
    2. h200: `h200_fallback()` (three measured pairwise points from `overlap/_h200-pairs.json`
       + labelled borrowed values).
    3. any other GPU: `InterferenceModel.serial()` (serial sum), labelled as a fallback.
    """
    return _load_interference(normalize_gpu(gpu))


@cache
def _load_interference(key: str) -> InterferenceModel:
    doc = load_overlap_doc(key)
    if doc is not None:
        return InterferenceModel.from_json(doc["interference"])
    if key == "h200":
        return h200_fallback()
    return InterferenceModel.serial(
        key, f"fallback for {key}: no overlap measurements; serial sum (f_A[c] = |A| → Σ X), a safe upper bound"
    )
