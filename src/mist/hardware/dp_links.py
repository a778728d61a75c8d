"""Data-parallel / cross-node collective and pipeline point-to-point time.

    from mist.hardware.dp_links import collective_time
    collective_time("a100-sxm4-40gb", "all_reduce", 2 * 1.3e9, group_size=16, nodes_spanned=2,
                    gpus_per_node=8)     # seconds (numpy array, vectorized over nbytes)

`nbytes` is the full buffer: the gathered output of an all-gather, the full input of a
reduce-scatter, the buffer of an all-reduce, one rank's buffer of an all-to-all, the message of a
p2p send. n = group_size, m = nodes_spanned, k = n / m GPUs of the group on each node.

**Inside one node** (m = 1): the intra-node fit `mist.hardware.collectives.load_links(gpu)`;
for GPUs without one (V100-SXM2-16GB) the single-node all-gather fits of the overlap benchmark,
t = phases·alpha + ring_factor·bytes/busbw.

**Across nodes** (m > 1), hierarchical ring model (ring alpha-beta, docs/references.md; fitted
in `tools/profile_build/fit_overlap.py`):

    t_AG = t_RS = alpha_x + G·(n−1)/n·bytes / B_nic  +  (k−1)/k·bytes / busbw_intra(k)
    t_AR = t_RS + t_AG                       (all-reduce = reduce-scatter + all-gather volumes)
    t_A2A = alpha_x + G·k·(n−k)/n·bytes / B_nic   (derived: the off-node share of every rank's buffer)

B_nic is the NIC bandwidth of one node (bytes/s, each direction) and G the number of groups of
the same shape that run at once and share it (`concurrent_groups`; default gpus_per_node / k,
the data-parallel pattern where every GPU of the node is in one such group). alpha_x is floored
at the per-phase latency of an intra-node collective of min(n, gpus_per_node) GPUs, and the
cross-node p2p alpha at the intra-node one, since the fitted/documented sources disagree at tiny
sizes and a transfer that leaves the node cannot start faster than one that stays inside. A ring over n GPUs on
m nodes pushes (n−1)/n of the output through each node's NIC per group; the overlap benchmark's
2- and 4-node layouts confirm that volume (e.g. A100 intra 8 × inter 2 runs at the same B_nic as
intra 1 × inter 2, which a two-level (m−1)/m volume would not give). The intra term is small on
NVLink systems.

**p2p** (op="p2p", pipeline stage boundaries): alpha + bytes / bw from `p2p_intra_node.csv` when
m = 1 and `p2p_inter_node.csv` when m > 1 (the published op-profiles); across nodes the rate
is capped at B_nic / concurrent_groups (default 1 flow). Without a p2p file: inside a node the
2-GPU all-gather fit (a 2-GPU all-gather of output 2·S moves S per GPU; V100-SXM2-16GB uses its own
overlap-benchmark fit rather than another cluster's p2p file), across nodes alpha_x + S / B_nic.
H100/H200 use datasheet NVLink 4 figures (labelled).

Parameters and their provenance (measured / documented / datasheet / inferred) are in
`overlap/dp_links.json`, written by `tools/profile_build/fit_overlap.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib import resources

import numpy as np

from mist.hardware.collectives import LinkModel, load_links, ring_factor
from mist.hardware.gpu_names import normalize_gpu

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


def _nearest(table: dict, k: int):
    key = min(table, key=lambda s: (abs(np.log2(int(s)) - np.log2(max(k, 1))), int(s)))
    return table[key]


@dataclass
class DpLinks:
    """Cross-node and p2p link parameters of one GPU type (seconds, bytes, bytes/s)."""

    gpu: str
    intra: LinkModel | None = None  # intra-node collective fit (collectives.py)
    intra_allgather: dict | None = None  # {k: [alpha_s, busbw_Bps]} fallback (overlap benchmark)
    internode: dict | None = None  # {"alpha_s", "nic_Bps_per_node", "provenance"}
    p2p_intra: dict | None = None  # {"alpha_s", "bw_Bps", "provenance"}
    p2p_inter: dict | None = None
    provenance: dict = field(default_factory=dict)

    # ---- building blocks -------------------------------------------------------------------
    def _intra_busbw(self, k: int) -> float:
        """All-gather bus bandwidth of a k-GPU group inside one node (B/s)."""
        if self.intra is not None and "all_gather" in self.intra.fits:
            return float(_nearest(self.intra.fits["all_gather"], k)[1])
        if self.intra_allgather:
            return float(_nearest(self.intra_allgather, k)[1])
        if self.p2p_intra:
            return float(self.p2p_intra["bw_Bps"])
        raise ValueError(f"no intra-node link data for {self.gpu}")

    def _intra_collective(self, op, nbytes, n):
        if self.intra is not None:
            return self.intra.time(op, nbytes, n)
        if not self.intra_allgather:
            raise ValueError(f"no intra-node collective data for {self.gpu}")
        alpha, busbw = _nearest(self.intra_allgather, n)
        phases = 2.0 if op == "all_reduce" else 1.0
        return phases * alpha + ring_factor(op, n) * nbytes / busbw

    def _phase_alpha(self, n: int) -> float:
        """Latency of one collective phase inside a node (max over AG, RS and half an AR): the floor
        of a cross-node phase, which cannot start up faster than an intra-node one."""
        try:
            vals = [
                float(self._intra_collective(op, 0.0, n)) / (2.0 if op == "all_reduce" else 1.0)
                for op in ("all_gather", "reduce_scatter", "all_reduce")
            ]
        except ValueError:
            return 0.0
        return max(vals)

    def _p2p(self, nbytes, cross: bool, flows: int):
        if not cross:
            if self.p2p_intra:
                return self.p2p_intra["alpha_s"] + nbytes / self.p2p_intra["bw_Bps"]
            # a 2-GPU all-gather of output 2·S moves S per GPU
            return self._intra_collective("all_gather", 2.0 * nbytes, 2)
        if self.internode is None and self.p2p_inter is None:
            raise ValueError(f"no inter-node link data for {self.gpu}")
        cap = self.internode["nic_Bps_per_node"] / flows if self.internode else np.inf
        if self.p2p_inter:
            alpha, bw = self.p2p_inter["alpha_s"], min(self.p2p_inter["bw_Bps"], cap)
        else:
            alpha, bw = self.internode["alpha_s"], cap
        try:
            alpha = max(alpha, float(self._p2p(0.0, False, 1)))  # intra-node p2p latency
        except ValueError:
            pass
        return alpha + nbytes / bw

    # ---- public ------------------------------------------------------------------------------
    def time(
        self,
        op: str,
        nbytes,
        group_size: int,
        nodes_spanned: int = 1,
        gpus_per_node: int = 8,
        *,
        concurrent_groups: int | None = None,
    ) -> np.ndarray:
        """Seconds for `op` on `nbytes` (see module docstring); vectorized over nbytes."""
        if op not in OPS:
            raise ValueError(f"unknown op '{op}'; known: {', '.join(OPS)}")
        nb = np.asarray(nbytes, dtype=np.float64)
        if np.any(nb < 0):
            raise ValueError("nbytes must be ≥ 0")
        n, m, gpn = int(group_size), int(nodes_spanned), int(gpus_per_node)
        if n < 1 or m < 1 or gpn < 1:
            raise ValueError("group_size, nodes_spanned and gpus_per_node must be ≥ 1")
        if concurrent_groups is not None and int(concurrent_groups) < 1:
            raise ValueError("concurrent_groups must be ≥ 1")
        if op == "p2p":
            flows = int(concurrent_groups or 1)
            return np.broadcast_to(self._p2p(nb, m > 1, flows), nb.shape).astype(np.float64)
        if n % m:
            raise ValueError(f"group_size {n} is not a multiple of nodes_spanned {m}")
        k = n // m
        if k > gpn:
            raise ValueError(f"{k} GPUs of the group per node exceed gpus_per_node {gpn}")
        if n == 1:
            return np.zeros(nb.shape)
        if m == 1:
            return np.asarray(self._intra_collective(op, nb, n), dtype=np.float64)
        if self.internode is None:
            raise ValueError(f"no inter-node link data for {self.gpu}")
        G = int(concurrent_groups) if concurrent_groups is not None else max(1, gpn // k)
        alpha = max(self.internode["alpha_s"], self._phase_alpha(min(n, gpn)))
        nic = self.internode["nic_Bps_per_node"]
        if op == "all_to_all":
            return alpha + G * k * (n - k) / n * nb / nic
        one = alpha + G * (n - 1) / n * nb / nic
        if k > 1:
            one = one + (k - 1) / k * nb / self._intra_busbw(k)
        return 2.0 * one if op == "all_reduce" else one


@lru_cache(maxsize=1)
def _table() -> dict:
    path = resources.files("mist.hardware") / "overlap" / "dp_links.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@cache
def load_dp_links(gpu: str) -> DpLinks:
    """The DP / cross-node link model of a GPU (ValueError when nothing is known about it)."""
    key = normalize_gpu(gpu)
    e = _table().get(key, {})
    intra = load_links(key)
    if intra is None and not e:
        known = sorted(_table())
        raise ValueError(f"no link data for GPU '{gpu}'; known: {', '.join(known)}")
    return dp_links_from_parts(key, intra, e)


_PARTS = {
    "internode": ("alpha_s", "nic_Bps_per_node"),
    "p2p_intra": ("alpha_s", "bw_Bps"),
    "p2p_inter": ("alpha_s", "bw_Bps"),
}


def shipped_parts(gpu: str) -> dict:
    """The shipped `overlap/dp_links.json` entry of a GPU ({} when there is none)."""
    return dict(_table().get(normalize_gpu(gpu), {}))


def dp_links_from_parts(gpu: str, intra: LinkModel | None, e: dict) -> DpLinks:
    """A DpLinks from an intra-node fit and a `dp_links.json`-style entry: optional parts
    "internode" {alpha_s, nic_Bps_per_node}, "p2p_intra" / "p2p_inter" {alpha_s, bw_Bps},
    "intra_allgather" {"fits": {k: [alpha_s, busbw_Bps]}}, each with a "provenance" line.
    ValueError when a part is malformed (a GPU profile's own `dp_links` section uses this form)."""
    for part, keys in _PARTS.items():
        if part in e:
            v = e[part]
            if not isinstance(v, dict) or any(not isinstance(v.get(k), (int, float)) for k in keys):
                raise ValueError(f"dp_links part '{part}' needs numbers {', '.join(keys)}")
            if v["alpha_s"] < 0 or v[keys[1]] <= 0:
                raise ValueError(f"dp_links part '{part}': alpha_s must be >= 0 and {keys[1]} > 0")
    if "intra_allgather" in e and not isinstance(e["intra_allgather"].get("fits"), dict):
        raise ValueError("dp_links part 'intra_allgather' needs 'fits': {k: [alpha_s, busbw_Bps]}")
    ag = e.get("intra_allgather", {}).get("fits")
    prov = {
        part: e[part].get("provenance", "")
        for part in ("internode", "p2p_intra", "p2p_inter", "intra_allgather")
        if part in e
    }
    if intra is not None:
        prov["intra"] = intra.provenance
    return DpLinks(gpu, intra, ag, e.get("internode"), e.get("p2p_intra"), e.get("p2p_inter"), prov)


def collective_time(
    gpu: str,
    op: str,
    nbytes,
    group_size: int,
    nodes_spanned: int = 1,
    gpus_per_node: int = 8,
    *,
    concurrent_groups: int | None = None,
) -> np.ndarray:
    """Seconds for collective `op` ("all_gather", "reduce_scatter", "all_reduce", "all_to_all" or
    "p2p") of `nbytes` over `group_size` GPUs spread evenly over `nodes_spanned` nodes of
    `gpus_per_node` GPUs. Vectorized over nbytes. See the module docstring for the model."""
    return load_dp_links(gpu).time(
        op, nbytes, group_size, nodes_spanned, gpus_per_node, concurrent_groups=concurrent_groups
    )
