"""The cost of ZB-H1's split backward in the runtime, on this machine's CPU: a last pipeline stage
(one decoder block and the head with its loss) of the CPU loop's models, micro-batch 2, sequence
256, fp32, one thread.

Rows, each the median of REPS micro-batches after warm-up:

* plain   — one `backward()` of the stage (what 1F1B runs);
* B, W    — the runtime's split (`mist.runtime.zero_bubble._WeightPass`): B to the stage input, W
            into the parameters each frontier node owns, starting below the nodes that computed
            their weight gradients in B already;
* W into all parameters — the same recorded gradients fed from every frontier node into all the
            stage's parameters in one call, the runtime's W before it was restricted: autograd then
            re-runs the input-gradient chain below each frontier node.

    PYTHONPATH=src python benchmarks/zero_bubble_split.py [--out benchmarks/results]

Writes OUT/zero_bubble_split.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mist.models import init_weights  # noqa: E402
from mist.models.block import DecoderBlock  # noqa: E402
from mist.models.collectives import TPGroup  # noqa: E402
from mist.models.head import Head  # noqa: E402
from mist.runtime.zero_bubble import _WeightPass  # noqa: E402
from mist.specs.loading import load_model  # noqa: E402

B, S, WARMUP, REPS = 2, 256, 3, 9
FAMILIES = ("gpt", "llama")


class LastStage(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.block = DecoderBlock(spec, TPGroup(), True, torch.float32)
        self.head = Head(spec, TPGroup(), torch.float32)

    def forward(self, x, targets):
        return self.head(self.block(x), targets)


def _all_params_w(wp: _WeightPass) -> None:
    """W from every frontier node into all parameters in one call (the earlier runtime's W; the
    roots are the runtime's own, so RMSNorm's is taken below the norm as the runtime does now)."""
    pins: list = []
    try:
        roots, grads = wp.roots(wp.nodes, pins)
        torch.autograd.backward(roots, grads, inputs=wp.params)
    finally:
        for h in pins:
            h.remove()


def measure(family: str) -> dict:
    spec = load_model(str(ROOT / "benchmarks" / "models" / f"loop-{family}.yaml"))
    stage = LastStage(spec)
    init_weights(stage, seed=0)
    params = list(stage.parameters())
    targets = torch.randint(0, spec.vocab_size, (B, S))
    times: dict[str, list[float]] = {"plain": [], "B": [], "W": [], "W into all parameters": []}

    def forward():
        x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
        return x, stage(x, targets)

    def timed(key, fn, keep: bool):
        t0 = time.perf_counter()
        fn()
        if keep:
            times[key].append(time.perf_counter() - t0)

    for rep in range(WARMUP + REPS):
        keep = rep >= WARMUP
        _, loss = forward()
        timed("plain", loss.backward, keep)
        for w_key in ("W", "W into all parameters"):
            stage.zero_grad(set_to_none=True)
            x, loss = forward()
            wp = _WeightPass(loss, x, params)
            timed("B", lambda: wp.input_grad(None, x), keep and w_key == "W")
            timed(w_key, wp.weight_grads if w_key == "W" else lambda: _all_params_w(wp), keep)
        stage.zero_grad(set_to_none=True)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"family": family, **ms}


def markdown(rows: list[dict]) -> str:
    out = [
        f"A last pipeline stage (one decoder block + the head and its loss) of the CPU loop's models, "
        f"micro-batch {B}, sequence {S}, fp32, one thread, on {platform.machine()} (torch {torch.__version__}); "
        f"median of {REPS} micro-batches after {WARMUP} warm-ups, ms.",
        "",
        "| stage | plain backward | B | W | B + W | vs plain | W into all parameters | B + that W | vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw, old = r["B"] + r["W"], r["B"] + r["W into all parameters"]
        out.append(
            f"| {r['family']} | {r['plain']:.1f} | {r['B']:.1f} | {r['W']:.1f} | {bw:.1f} | "
            f"{bw / r['plain'] - 1:+.1%} | {r['W into all parameters']:.1f} | {old:.1f} | {old / r['plain'] - 1:+.1%} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    text = markdown([measure(f) for f in FAMILIES])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "zero_bubble_split.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
