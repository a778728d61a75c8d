"""GpuProfile: everything the cost model needs to know about one GPU type, in SI units.

A profile is a JSON document (see `to_dict`) produced from the measurement data by the offline
builders of `tools/profile_build/` and shipped inside the package; loading it needs nothing else.
Every *_time method returns seconds, accepts python scalars or numpy arrays and broadcasts.

A profile may carry its own link and overlap models (optional sections `links`, `dp_links`,
`interference`; `mist profile` writes them). The simulator asks the profile for them
(`link_model`, `collective_time`, `interference_model`); a profile without a section falls back
to the shipped per-GPU file of its name, exactly as before sections existed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mist.hardware.attention import AttentionTable
from mist.hardware.collectives import LinkModel, load_links
from mist.hardware.dp_links import collective_time, dp_links_from_parts, load_dp_links, shipped_parts
from mist.hardware.gemm import GemmTable
from mist.hardware.host import HostOverhead, stream_time
from mist.hardware.interference import InterferenceModel, load_interference
from mist.hardware.memory_ops import MemoryOpModel
from mist.hardware.profile_checks import FORMAT, VERSION, profile_fields
from mist.hardware.profile_checks import SCALARS as _SCALARS
from mist.hardware.profile_checks import SECTIONS as _SECTIONS

# bytes of host memory one fused AdamW step moves per parameter: fp32 parameter, gradient, m and v
# read, parameter, m and v written
HOST_ADAM_BYTES = 28


@dataclass(eq=False)
class GpuProfile:
    name: str
    provenance: str  # one line, printed with every output
    measured: bool  # False for datasheet/roofline-only profiles
    memory_bytes: int  # usable device memory
    peak_flops: float  # dense bf16/fp16 tensor FLOP/s (datasheet, for MFU)
    hbm_bandwidth: float  # B/s (datasheet)
    h2d_bandwidth: float  # pinned host -> device, B/s
    d2h_bandwidth: float  # pinned device -> host, B/s
    bidir_bandwidth: float  # both directions at once, total B/s
    adam_gpu_s_per_param: float  # fp32 AdamW step on the GPU
    adam_cpu_s_per_param: float  # fp32 AdamW step on the host CPU
    gemm: GemmTable
    attention: AttentionTable
    memory_ops: MemoryOpModel
    host: HostOverhead
    sources: dict = field(default_factory=dict)  # field group -> where its numbers came from
    fingerprint: dict = field(default_factory=dict)  # environment of the measurements
    notes: list = field(default_factory=list)
    # optional own models (None: the shipped per-name files are used, see module docstring)
    links: dict | None = None  # intra-node collectives, LinkModel JSON {"gpu", "provenance", "fits"}
    dp_links: dict | None = None  # DP / cross-node / p2p parts of DpLinks (the dp_links.json entry form)
    interference: dict | None = None  # InterferenceModel JSON {"provenance", "channels", "factors"}
    host_memory_per_gpu: float | None = None  # bytes of host RAM per GPU of the profiled machine
    # device bytes in use outside PyTorch's caching allocator (the CUDA context, libraries'
    # buffers), measured by `mist profile` on a GPU; None: not measured (taken as 0)
    outside_allocator_bytes: int | None = None

    # ------------------------------------------------------------------ predictors
    # Scalars in give a numpy float64 out (a Python float subclass); arrays give arrays.
    def gemm_time(self, m, n, k, batch=1):
        """y[m,n] = x[m,k] @ w[n,k]^T; `batch` independent GEMMs of that shape (bmm)."""
        return _out(self.gemm.time(m, n, k, batch))

    def attention_time(self, b, heads, kv_heads, s, d, causal=True, backward=False, keys=None):
        """Fused flash SDPA kernel alone (forward or backward); GQA costs as MHA at `heads`; `keys`
        per query row when not s."""
        return _out(self.attention.time(b, heads, kv_heads, s, d, causal, backward, keys))

    def memory_op_time(self, op, bytes_moved, backward=False):
        """Memory-bound kernel of aten op `op` (a str) moving `bytes_moved` (read + written)."""
        return _out(self.memory_ops.time(op, bytes_moved, backward))

    def fused_time(self, bytes_moved, work: dict, backward=False):
        """A compiled block's fused pointwise kernel moving `bytes_moved` and computing `work`
        ({kind: element-operations}, `MemoryOpModel.fused_time`)."""
        return _out(self.memory_ops.fused_time(bytes_moved, work, backward))

    def stream_time(self, kernel_times, backward=False, host_overhead=None):
        """End of the last kernel when the host issues them every h seconds (see `host`).

        kernel_times: op axis last, leading candidate axes allowed. host_overhead overrides the
        profile's per-op value (scalar or per-op array).
        """
        h = self.host.per_op(backward) if host_overhead is None else host_overhead
        return _out(stream_time(kernel_times, h))

    # ------------------------------------------------------------------ links and overlap
    def link_model(self):
        """Intra-node (TP) collective model: the own `links` section, else the shipped file of
        this name (`collectives.load_links`); None when neither exists."""
        if self.links is None:
            return load_links(self.name)
        return self._cached(
            "links",
            lambda: LinkModel(
                str(self.links.get("gpu", self.name)),
                str(self.links.get("provenance", "")),
                self.links["fits"],
                float(self.links.get("sync_s", 0.0)),
            ),
        )

    def dp_link_model(self):
        """DP / cross-node / p2p model (`dp_links.DpLinks`): built from the own `links` and
        `dp_links` sections where present (a missing one taken from the shipped files of this
        name), else the shipped model (`dp_links.load_dp_links`)."""
        if self.links is None and self.dp_links is None:
            return load_dp_links(self.name)

        def build():
            parts = self.dp_links if self.dp_links is not None else shipped_parts(self.name)
            return dp_links_from_parts(self.name, self.link_model(), parts)

        return self._cached("dp_links", build)

    def collective_time(self, op, nbytes, group_size, nodes_spanned=1, gpus_per_node=8, *, concurrent_groups=None):
        """Seconds of a DP / cross-node collective or p2p message (see `dp_links.collective_time`)."""
        if self.links is None and self.dp_links is None:
            return collective_time(
                self.name, op, nbytes, group_size, nodes_spanned, gpus_per_node, concurrent_groups=concurrent_groups
            )
        return self.dp_link_model().time(
            op, nbytes, group_size, nodes_spanned, gpus_per_node, concurrent_groups=concurrent_groups
        )

    def interference_model(self):
        """Compute/communication interference factors: the own `interference` section, else the
        shipped fit or fallback of this name (`interference.load_interference`)."""
        if self.interference is None:
            return load_interference(self.name)
        return self._cached("interference", lambda: InterferenceModel.from_json(self.interference))

    def _cached(self, key, build):
        """Model built from an own section, rebuilt when the section object is replaced."""
        cache = self.__dict__.setdefault("_models", {})
        ident = (id(self.links), id(self.dp_links), id(self.interference))
        hit = cache.get(key)
        if hit is None or hit[0] != ident:
            hit = cache[key] = (ident, build())
        return hit[1]

    # ------------------------------------------------------------------ extras
    def host_overhead(self, backward=False) -> float:
        return self.host.per_op(backward)

    def adam_time(self, params, on_cpu=False):
        """Seconds of one fp32 AdamW step over `params` parameters."""
        rate = self.adam_cpu_s_per_param if on_cpu else self.adam_gpu_s_per_param
        return _out(np.asarray(params, dtype=float) * rate)

    def host_pass_time(self, nbytes):
        """Seconds of streaming passes over `nbytes` of host memory by the host threads the host
        AdamW runs on, at the bandwidth that fused step reaches: it reads the fp32 parameter,
        gradient and two moments and writes back three, HOST_ADAM_BYTES per parameter, in one
        memory-bound pass."""
        return _out(np.asarray(nbytes, dtype=float) * self.adam_cpu_s_per_param / HOST_ADAM_BYTES)

    def summary(self) -> str:
        gib = self.memory_bytes / 2**30
        return (
            f"{self.name}: {gib:.1f} GiB, peak {_tflops(self.peak_flops)} TFLOP/s, "
            f"HBM {self.hbm_bandwidth / 1e9:.0f} GB/s, H2D/D2H {self.h2d_bandwidth / 1e9:.1f}/"
            f"{self.d2h_bandwidth / 1e9:.1f} GB/s  [{self.provenance}]"
        )

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "version": VERSION, "name": self.name, "provenance": self.provenance}
        d["measured"] = bool(self.measured)
        for k in _SCALARS:
            d[k] = int(getattr(self, k)) if k == "memory_bytes" else float(getattr(self, k))
        d["host"] = self.host.to_dict()
        d["memory_ops"] = self.memory_ops.to_dict()
        d["sources"] = dict(self.sources)
        d["fingerprint"] = dict(self.fingerprint)
        d["notes"] = list(self.notes)
        d["gemm"] = self.gemm.to_dict()
        d["attention"] = self.attention.to_dict()
        for key in _SECTIONS:
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.host_memory_per_gpu is not None:
            d["host_memory_per_gpu"] = float(self.host_memory_per_gpu)
        if self.outside_allocator_bytes is not None:
            d["outside_allocator_bytes"] = int(self.outside_allocator_bytes)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "GPU profile") -> GpuProfile:
        """A profile from its JSON document, checked (`profile_checks.profile_fields`):
        MistInputError, one sentence starting with `source` (e.g. "GPU profile file X"), for
        anything missing, malformed or out of range."""
        return cls(**profile_fields(d, source))

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(self.to_dict()))
        return path


def _tflops(flops: float) -> str:
    """TFLOP/s for printing: whole numbers for GPUs, 3 significant digits below 10 (CPU profiles)."""
    t = flops / 1e12
    return f"{t:.0f}" if t >= 10 else f"{t:.3g}"


def _out(x):
    """0-d arrays -> numpy float64 scalars; other arrays unchanged."""
    return np.asarray(x)[()]


def dumps(d: dict) -> str:
    """JSON text: readable top level, the big time tables compact (one line each)."""
    lines = []
    for key, value in d.items():
        if key in ("gemm", "attention"):
            text = json.dumps(value, separators=(",", ":"))
        else:
            text = json.dumps(value, indent=2).replace("\n", "\n  ")
        lines.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
