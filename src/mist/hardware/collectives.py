"""Intra-node collective time: ring alpha-beta per (collective, group size), in bus-bandwidth form.

    t = alpha_n + sync + f(op, n) · bytes / busbw_n
    f = 2(n−1)/n for all-reduce, (n−1)/n for all-gather and reduce-scatter (bytes = full buffer),
        1 for point-to-point.

Fitted per GPU from the measured collectives (`tools/profile_build/fit_links.py`), or from
datasheet link figures (labelled) for GPUs without measurements. Tensor-parallel groups live
inside a node, so this covers the TP collectives; cross-node models belong to the simulator.
`sync` (0 unless measured, `mist profile`): what a blocking collective issued right after compute
costs beyond back-to-back calls — the ranks arrive at different moments and a blocked process
must wake up (with gloo on a busy CPU, milliseconds a call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def ring_factor(op: str, n):
    n = np.asarray(n, dtype=np.float64)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return np.ones_like(n)


@dataclass
class LinkModel:
    gpu: str
    provenance: str
    # per op: {group size: [alpha_s, busbw_Bps]}
    fits: dict
    sync_s: float = 0.0

    def time(self, op: str, nbytes, n):
        """Seconds for collective `op` of `nbytes` (full buffer) over `n` GPUs of one node."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        n_arr = np.asarray(n)
        table = self.fits.get(op) or self.fits["all_reduce"]
        sizes = sorted(int(k) for k in table)
        out = np.zeros(np.broadcast(nbytes, n_arr).shape)
        nb = np.broadcast_to(nbytes, out.shape)
        nn = np.broadcast_to(n_arr, out.shape)
        for size in np.unique(nn):
            if size <= 1:
                continue
            key = min(sizes, key=lambda k: (abs(np.log2(k) - np.log2(size)), k))
            alpha, busbw = table[str(key)]
            sel = nn == size
            out[sel] = alpha + self.sync_s + ring_factor(op, size) * nb[sel] / busbw
        return out

    def to_json(self) -> dict:
        out = {"gpu": self.gpu, "provenance": self.provenance, "fits": self.fits}
        if self.sync_s:
            out["sync_s"] = self.sync_s
        return out


def load_links(gpu: str) -> LinkModel | None:
    """The shipped link model of a GPU, or None when there is none."""
    path = resources.files("mist.hardware") / "links" / f"{gpu}.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return LinkModel(d["gpu"], d["provenance"], d["fits"])


def assumed_links() -> dict:
    """`links/_assumed.json`: the link constants `mist profile` assumes where it cannot measure
    (per-message latency and bus bandwidth for CPU and CUDA runs, a node's NIC bandwidth), with
    the provenance of each."""
    return json.loads((resources.files("mist.hardware") / "links" / "_assumed.json").read_text(encoding="utf-8"))


def datasheet_links(gpu: str, busbw: float, alpha: float, provenance: str) -> LinkModel:
    fits = {op: {str(n): [alpha, busbw] for n in (2, 4, 8)} for op in OPS}
    return LinkModel(gpu, provenance, fits)
