"""Where the tests find raw measurements: the repository's own `data/` (the H200 run that the
shipped H200 and H100 profiles are built from) and, where the environment variable MIST_RAW_DATA
names it, the whole measurement set the other shipped profiles were built from (not part of this
repository: see data/README.md). `tools/` holds the offline builders (not installed)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPO_DATA = ROOT / "data"
TOOLS = ROOT / "tools"
RAW_DATA = Path(os.environ["MIST_RAW_DATA"]) if os.environ.get("MIST_RAW_DATA") else None

needs_raw_data = pytest.mark.skipif(
    RAW_DATA is None or not (RAW_DATA / "gpus").is_dir(),
    reason="needs the whole raw measurement set, which MIST_RAW_DATA does not name (see data/README.md)",
)
