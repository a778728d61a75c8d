"""GPU names as the shipped files spell them: "NVIDIA H200_SXM" → "h200".

Two spellings are in use. `profile_key` is the key of a built-in profile (`profiles/<key>.json`):
lower-cased, '_' and ' ' → '-', a leading 'nvidia-' dropped, then `ALIASES` applied.
`normalize_gpu` is the key of the link and overlap files (`links/`, `overlap/`): the same, plus
the 16 GB V100 spellings of the overlap benchmark (`OVERLAP_ALIASES`), which has no profile.
"""

from __future__ import annotations

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

#: Spellings of the overlap benchmark's V100-SXM2-16GB (link and overlap files only).
OVERLAP_ALIASES = {"v100-16gb": "v100-sxm2-16gb", "v100-sxm2-16": "v100-sxm2-16gb"}


def _plain(name: str) -> str:
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    if key.startswith("nvidia-"):
        key = key[len("nvidia-") :]
    return key


def profile_key(name: str) -> str:
    """The built-in profile name of a GPU name or alias (unknown names come back normalised)."""
    key = _plain(name)
    return ALIASES.get(key, key)


def normalize_gpu(gpu: str) -> str:
    """The link/overlap file name of a GPU: `profile_key`, with the overlap benchmark's V100
    spellings resolved first."""
    key = _plain(gpu)
    if key in OVERLAP_ALIASES:
        return OVERLAP_ALIASES[key]
    return ALIASES.get(key, key)
