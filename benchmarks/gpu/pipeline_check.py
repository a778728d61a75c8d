"""Pipelines on NCCL: one run on a machine with two or more CUDA GPUs, everything under $OUT.

    OUT=/some/folder python benchmarks/gpu/pipeline_check.py [--steps 4] [--timeout 240]

Not run yet: this project has only been lent machines with one GPU. The runtime's pipelines
send their messages over `mist.runtime.p2p.Channels` (one process group per kind and direction)
because NCCL matches a communicator's messages in posting order on one stream, where a send waits
for its receive: on one communicator a 1F1B stage and its neighbour each send before they receive
and wait for ever (`tests/runtime/test_send_waits.py` plays it). gloo matches by tag, so no CPU
test can see such a hang; this script is the check on GPUs.

Each plan trains a small Llama (4 blocks, hidden 1024, 16 heads, FFN 2816, vocabulary 32000, seq
2048, bf16, flash attention), global batch 8, with `mist train PLAN --local --steps N --seed 0`
in its own process group of workers and a time limit (a hang is what is checked):

- `1 stage`: one GPU, G 4 (the reference);
- `1f1b pp2`, `zb-h1 pp2`: two stages of 2 blocks, G 4;
- `interleaved pp2 v2`: two ranks of 2 chunks of 1 block, G 4;
- `1f1b pp4`, `interleaved pp2 v2 dp2`: with four or more GPUs.

An activation message is 2 × 2048 × 1024 × 2 bytes = 8 MiB, more than NCCL's default 4 MiB
buffers, so a send cannot finish before its receive runs. Every plan starts from the same seeded
weights and draws the same synthetic batches, so its per-step losses should equal the
reference's to bf16 rounding. Writes $OUT/pipeline_check.json (each plan: finished or timed out,
exit code, seconds, per-step losses, largest |loss − reference| per step) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = {
    "name": "llama-pipeline-check",
    "family": "llama",
    "num_layers": 4,
    "hidden_size": 1024,
    "num_heads": 16,
    "num_kv_heads": 16,
    "ffn_hidden_size": 2816,
    "vocab_size": 32000,
    "tie_embeddings": False,
}


def _stage(layers: int, b: int, gpus: int = 1, chunks: tuple[int, ...] | None = None) -> dict:
    s = {"layers": layers, "nodes": 1, "gpus_per_node": gpus, "micro_batch": b, "dp": gpus, "tp": 1}
    if chunks:
        s["chunk_layers"] = list(chunks)
    return s


def plans(gpus: int) -> dict[str, dict]:
    """The plans this machine can run, by name."""
    out = {
        "1 stage": ([_stage(4, 2)], 1, {}),
        "1f1b pp2": ([_stage(2, 2), _stage(2, 2)], 2, {}),
        "zb-h1 pp2": ([_stage(2, 2), _stage(2, 2)], 2, {"schedule": "zb-h1"}),
        "interleaved pp2 v2": ([_stage(2, 2, chunks=(1, 1)), _stage(2, 2, chunks=(1, 1))], 2, {"virtual_stages": 2}),
    }
    if gpus >= 4:
        out["1f1b pp4"] = ([_stage(1, 2)] * 4, 4, {})
        out["interleaved pp2 v2 dp2"] = (
            [_stage(2, 1, 2, chunks=(1, 1)), _stage(2, 1, 2, chunks=(1, 1))],
            4,
            {"virtual_stages": 2},
        )
    return {
        name: {
            "model": MODEL,
            "cluster": {"gpu": "h100", "nodes": 1, "gpus_per_node": world},
            "training": {"seq_len": 2048, "global_batch": 8, "param_dtype": "bf16", "compute_dtype": "bf16"},
            "micro_batches": 4,
            "stages": stages,
            **extra,
        }
        for name, (stages, world, extra) in out.items()
    }


def run(name: str, plan: dict, steps: int, timeout: float, out: Path) -> dict:
    path = out / (name.replace(" ", "-") + ".json")
    log = out / (name.replace(" ", "-") + ".jsonl")
    path.write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "mist", "train", str(path), "--local", "--steps", str(steps), "--seed", "0"]
    cmd += ["--log-jsonl", str(log)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.time()
    try:
        # a new session: a timed-out run's workers are killed with it
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
        rec = {"finished": p.returncode == 0, "exit_code": p.returncode, "stderr_tail": p.stderr[-2000:]}
    except subprocess.TimeoutExpired as e:
        rec = {"finished": False, "timed_out": True, "stderr_tail": (e.stderr or b"")[-2000:].decode(errors="replace")}
    rec["seconds"] = round(time.time() - start, 1)
    rec["losses"] = [json.loads(line).get("loss") for line in log.read_text().splitlines()] if log.exists() else []
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a plan may take before it counts as hung")
    a = ap.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    out = Path(os.environ.get("OUT", "pipeline-check-out"))
    out.mkdir(parents=True, exist_ok=True)
    if gpus < 2:
        print(f"this check needs two or more CUDA GPUs; this machine has {gpus}.", file=sys.stderr)
        return 2
    results: dict = {"gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "plans": {}}
    for name, plan in plans(gpus).items():
        results["plans"][name] = run(name, plan, a.steps, a.timeout, out)
        (out / "pipeline_check.json").write_text(json.dumps(results, indent=1))
    ref = results["plans"]["1 stage"]["losses"]
    print(f"{'plan':<24} {'finished':>8} {'s':>7}  max |loss - 1 stage|")
    for name, rec in results["plans"].items():
        diff = [abs(x - y) for x, y in zip(rec["losses"], ref) if x is not None and y is not None]
        rec["max_loss_diff"] = max(diff) if diff else None
        shown = "—" if rec["max_loss_diff"] is None else f"{rec['max_loss_diff']:.4f}"
        print(f"{name:<24} {rec['finished']!s:>8} {rec['seconds']:>7.1f}  {shown}")
    (out / "pipeline_check.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["finished"] for r in results["plans"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
