"""A fingerprint of the cost model's behaviour, for refactorings that must not change it.

Re-simulates every plan stored in the suite's result files (all spaces, all cases) and tunes a
few small cases to completion (no time budget, so the search is deterministic), and writes
what `mist simulate` and `mist tune` return as one JSON file. Two snapshots taken before and
after a refactoring must be identical:

    PYTHONPATH=src python benchmarks/behaviour_snapshot.py -o before.json
    PYTHONPATH=src python benchmarks/behaviour_snapshot.py -o after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mist.hardware import load_profile
from mist.plan import plan_from_dict
from mist.simulate.plan_sim import simulate_plan
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import run_space

RESULTS = Path(__file__).parent / "results"
SUITES = ("suite.json", "suite-fp32grads.json", "suite-l4-a100-fp16.json")
TUNE_CASES = (  # small enough to search to completion in seconds
    ("gpt3-1.3b", "l4", 2, 2048, True, "full"),
    ("llama-2.7b", "l4", 4, 2048, True, "full"),
    ("gpt3-1.3b", "a100-sxm4-40gb", 4, 4096, False, "megatron"),
    ("falcon-1.3b", "l4", 4, 2048, True, "deepspeed"),
)


def plain(x):
    """JSON-safe copy with floats kept to the bit (repr round-trips)."""
    return json.loads(json.dumps(x, default=float))


def stored_plans(suites=SUITES):
    """(result file, case, space entry, Plan) of every plan stored in the suite's result files."""
    for name in suites:
        for case in json.loads((RESULTS / name).read_text()):
            for sp in case["spaces"]:
                if sp.get("plan") is not None:
                    yield name, case, sp, plan_from_dict(sp["plan"])


def simulated_plans() -> dict:
    out = {}
    for name, case, sp, plan in stored_plans():
        key = f"{name}|{case['model']}|{case['gpu']}|{case['flash_attention']}|{sp['space']}"
        out[key] = plain(simulate_plan(plan, load_profile(plan.cluster.gpu)).to_json())
    return out


def tuned() -> dict:
    out = {}
    for model, gpu, n, seq, flash, space in TUNE_CASES:
        cluster = ClusterSpec(gpu, 1, n)
        training = TrainingSpec(seq_len=seq, global_batch=16 * n, flash_attention=flash)
        r = run_space(space, get_preset(model), cluster, training, load_profile(gpu))
        out[f"{model}|{gpu}|{n}|{space}"] = plain(
            {"iteration_time_s": r.iteration_time_s, "plan": r.plan.to_dict() if r.plan else None}
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--compare")
    a = ap.parse_args()
    snap = {"simulate": simulated_plans(), "tune": tuned()}
    Path(a.out).write_text(json.dumps(snap, indent=1, sort_keys=True))
    print(f"{len(snap['simulate'])} plans simulated, {len(snap['tune'])} cases tuned -> {a.out}")
    if a.compare:
        old = json.loads(Path(a.compare).read_text())
        diff = [
            f"{part}: {k}"
            for part in snap
            for k in sorted(set(snap[part]) | set(old[part]))
            if snap[part].get(k) != old[part].get(k)
        ]
        for d in diff:
            print("differs", d)
        print(
            f"| snapshot | entries | differing |\n|---|---|---|\n"
            f"| {a.compare} vs {a.out} | {sum(map(len, snap.values()))} | {len(diff)} |"
        )
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
