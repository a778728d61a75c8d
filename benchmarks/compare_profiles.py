"""GEMM grid of one profile against another: at every measured (not filled-in) grid node of
profile A, A's time next to B's prediction for the same shape, with the ratio. Used for the
check that `mist profile --device cuda` on an H200 agrees with the shipped h200 profile.

    PYTHONPATH=src python benchmarks/compare_profiles.py A B [--min-us 25] [--out FILE.md]

The summary is given for all nodes and for those where both profiles say ≥ --min-us microseconds:
below that a GEMM is launch-bound and what differs is how each profile's timer saw the launch
(per-call synchronisation vs CUDA events), not the GEMM kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mist.hardware import load_profile


def compare(a, b, min_us: float) -> tuple[list[tuple], dict]:
    g = a.gemm
    filled = {tuple(int(v) for v in p) for p in g.extra.get("filled", [])}
    rows = []
    for m in g.m_axis:
        for n in g.n_axis:
            for k in g.k_axis:
                key = (int(m), int(n), int(k))
                if key in filled:
                    continue
                ta, tb = float(a.gemm_time(*key)), float(b.gemm_time(*key))
                rows.append((key, ta, tb, tb / ta - 1.0))
    kept = [abs(r[3]) for r in rows if min(r[1], r[2]) * 1e6 >= min_us]
    every = [abs(r[3]) for r in rows]
    summary = {
        "nodes": len(rows),
        "compared": len(kept),
        "median_abs_diff": statistics.median(kept) if kept else float("nan"),
        "within_10pct": sum(e <= 0.10 for e in kept),
        "median_abs_diff_all": statistics.median(every) if every else float("nan"),
        "within_10pct_all": sum(e <= 0.10 for e in every),
    }
    return rows, summary


def markdown(a, b, rows, summary, min_us: float) -> str:
    out = [
        f"GEMM grid: `{a.name}` ({a.provenance}) vs `{b.name}` ({b.provenance}).",
        "",
        "| m | n | k | A (µs) | B (µs) | B/A − 1 |",
        "|---|---|---|---|---|---|",
    ]
    for (m, n, k), ta, tb, d in rows:
        mark = "" if min(ta, tb) * 1e6 >= min_us else " (launch-bound)"
        out.append(f"| {m} | {n} | {k} | {ta * 1e6:.1f} | {tb * 1e6:.1f} | {d:+.1%}{mark} |")
    out += [
        "",
        f"All {summary['nodes']} measured nodes: median |difference| {summary['median_abs_diff_all']:.1%}, "
        f"{summary['within_10pct_all']} within 10 %. The {summary['compared']} nodes where both take ≥ {min_us:g} µs: "
        f"median |difference| {summary['median_abs_diff']:.1%}, {summary['within_10pct']} within 10 %.",
    ]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--min-us", type=float, default=25.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    a, b = load_profile(args.a), load_profile(args.b)
    rows, summary = compare(a, b, args.min_us)
    text = markdown(a, b, rows, summary, args.min_us)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
