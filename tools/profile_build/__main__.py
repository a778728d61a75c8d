"""CLI: PYTHONPATH=tools python -m profile_build --data DATA -o src/mist/hardware/profiles [--only h200,l4]"""

from __future__ import annotations

import argparse
from pathlib import Path

from profile_build import ALL, build_all


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m profile_build", description=__doc__)
    ap.add_argument("--data", required=True, type=Path, help="the measurement data folder (holds gpus/)")
    ap.add_argument("-o", "--out", required=True, type=Path, help="output folder for <name>.json")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(ALL)}")
    args = ap.parse_args(argv)
    if not (args.data / "gpus").is_dir():
        ap.error(f"{args.data} has no gpus/ folder")
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    for name, profile in build_all(args.data, only).items():
        path = profile.save(args.out / f"{name}.json")
        print(f"{path}  ({path.stat().st_size / 1024:.0f} KiB)  {profile.provenance}")
        for note in profile.notes:
            print(f"    note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
