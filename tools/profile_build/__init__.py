"""Building GPU profiles from the raw measurement data set (build time only; needs DATA/gpus/).

    PYTHONPATH=tools python -m profile_build --data DATA -o src/mist/hardware/profiles

* h200: measured microbenchmarks (`h200`)
* l4, a100-sxm4-40gb, a10g, v100-sxm2-32gb: Aceso op-profiles + op-db + overlap-bench (`aceso_fit`)
* h100: roofline scaling of the h200 profile (`derived`)
"""

from __future__ import annotations

from pathlib import Path

from mist.hardware.profile import GpuProfile

ACESO_GPUS = ("l4", "a100-sxm4-40gb", "a10g", "v100-sxm2-32gb")
ALL = ("h200", "h100") + ACESO_GPUS


def build_all(data, only=None) -> dict[str, GpuProfile]:
    from profile_build import aceso_fit, derived, h200

    data = Path(data)
    wanted = set(only or ALL)
    base = h200.build(data)
    out = {}
    if "h200" in wanted:
        out["h200"] = base
    if "h100" in wanted:
        out["h100"] = derived.scale_from(base, "h100")
    for gpu in ACESO_GPUS:
        if gpu in wanted:
            out[gpu] = aceso_fit.build(data, gpu, base)
    return out
