"""Host link (pinned H2D / D2H / both at once) from the overlap-bench comm-only rows (DATA/README.md §4).

These rows were run with all GPUs of a node copying at once, so they are per-GPU rates under a
shared host link: what a node running data-parallel offloading sees, not one GPU alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mist.units import MiB
from profile_build.common import read_json


def _num(text) -> float:
    return float(str(text).split()[0])


def fit_host_link(bench_dir: Path) -> dict | None:
    merged = sorted(Path(bench_dir).glob("bandwidth-merged-*.json"))
    if not merged:
        return None
    doc = read_json(merged[0])
    rows = next(iter(doc.values())).values()
    one_way = {"h2d": ([], []), "d2h": ([], [])}
    both = []
    for r in rows:
        if _num(r["compute_n"]) != 0 or _num(r["gpu_to_gpu_mbytes"]) != 0 or _num(r["std/mean"]) > 0.1:
            continue
        c2g, g2c, lat = _num(r["cpu_to_gpu_mbytes"]), _num(r["gpu_to_cpu_mbytes"]), _num(r["latency"]) * 1e-3
        if c2g > 0 and g2c == 0:
            one_way["h2d"][0].append(c2g * MiB)
            one_way["h2d"][1].append(lat)
        elif g2c > 0 and c2g == 0:
            one_way["d2h"][0].append(g2c * MiB)
            one_way["d2h"][1].append(lat)
        elif c2g == g2c > 0:
            both.append(2 * c2g * MiB / lat)
    out = {}
    for key, (x, t) in one_way.items():
        a = np.stack([np.ones(len(x)), np.array(x)], axis=1)
        (_, slope), *_ = np.linalg.lstsq(a, np.array(t), rcond=None)
        out[key] = 1.0 / slope
    out["bidir"] = float(np.median(both))
    n = sum(len(v[0]) for v in one_way.values())
    out["source"] = (
        f"measured: {merged[0].name} comm-only rows ({n} one-way, {len(both)} both-ways), "
        "per GPU with all GPUs of the node copying; t = c + bytes/bw"
    )
    return out
