"""benchmarks/fused_kernels.py refuses a profile that cannot price fused kernels by their
arithmetic (no `pointwise_s`), in one sentence with exit code 2, before compiling anything."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fused_kernels  # noqa: E402


def test_profile_without_pointwise_rates_is_refused(capsys):
    profile = ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json"
    assert fused_kernels.main(["--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no pointwise_s" in err and err.count("\n") == 1
