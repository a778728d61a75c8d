"""The causal mask's backward pass, removed: what it costs on this CPU and what the analysis prices.

Autograd's backward of the materialised attention's in-place causal mask, `grad.masked_fill(mask,
0)`, is one read and write of the b·heads·s² gradient that changes no value: the softmax's
backward already gives exactly 0 where the probability is 0. `mist.models.attention._CausalMask`
passes the gradient through. This script measures both on this CPU (the attention core's
backward, the old mask written out here as autograd's `masked_fill_`, the new one as the block
runs it; gradients compared bit for bit) and prices the paper's blocks without flash (TP 1, seq
2048) on the shipped L4 (fp16) and H200 (bf16) profiles with the block as it is traced now and
with the old mask put back, and writes a table:

    PYTHONPATH=src python benchmarks/mask_backward.py [--out benchmarks/results/mask_backward.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mist.analysis import layer as layer_mod  # noqa: E402
from mist.analysis.layer import analyze_layer  # noqa: E402
from mist.hardware.registry import load_profile  # noqa: E402
from mist.models import attention  # noqa: E402
from mist.simulate.layer_cost import phase_time  # noqa: E402
from mist.specs.presets import get_preset  # noqa: E402


class _AutogradMask(torch.autograd.Function):
    """The old mask: `masked_fill_` with autograd's own backward (one more pass over the gradient)."""

    @staticmethod
    def forward(ctx, scores, mask):
        ctx.mark_dirty(scores)
        ctx.save_for_backward(mask)
        return scores.masked_fill_(mask, float("-inf"))

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(mask, 0.0), None


@contextmanager
def old_mask():
    """The block with autograd's backward of the mask (what ran before), in this process only."""
    new = attention._CausalMask
    attention._CausalMask = _AutogradMask
    try:
        yield
    finally:
        attention._CausalMask = new


def core_backward_s(b=4, heads=8, s=1024, d=64, reps=15) -> tuple[float, list]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    core = attention.AttentionCore(False)

    def once():
        o = core(q, k, v)
        t = time.perf_counter()
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        return time.perf_counter() - t, grads

    for _ in range(3):
        once()
    times = [once()[0] for _ in range(reps)]
    return statistics.median(times), once()[1]


def priced(gpu: str, dtype: str, model: str, b: int) -> tuple[float, float, int]:
    """(fwd + bwd seconds, saved bytes, backward operators) of one block as traced now."""
    la = analyze_layer(get_preset(model), "block", 1, False, dtype, "cuda", False)
    prof = load_profile(gpu)
    t = sum(
        float(np.ravel(phase_time(prof, None, la, ph, np.array([float(b)]), np.array([2048.0])).total)[0])
        for ph in ("fwd", "bwd")
    )
    return t, float(la.saved(b, 2048)), len(la.ops("bwd"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mask_backward.md"))
    a = ap.parse_args(argv)
    import os

    os.environ["MIST_CACHE_DIR"] = "off"  # both variants traced afresh
    torch.set_num_threads(min(2, torch.get_num_threads()))
    new_t, new_g = core_backward_s()
    with old_mask():
        old_t, old_g = core_backward_s()
    same = all(torch.equal(x, y) for x, y in zip(new_g, old_g))
    rows = []
    for gpu, dtype in (("l4", "fp16"), ("h200", "bf16")):
        for model in ("gpt3-1.3b", "gpt3-7b", "llama-7b"):
            for b in (1, 4):
                layer_mod._analyze.cache_clear()  # (analyses are cached per process)
                after = priced(gpu, dtype, model, b)
                layer_mod._analyze.cache_clear()
                with old_mask():
                    before = priced(gpu, dtype, model, b)
                rows.append((gpu, model, b, before, after))
    lines = [
        "# The causal mask's backward pass (`benchmarks/mask_backward.py`)",
        "",
        f"Measured on {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}: the "
        "materialised attention core's backward (b 4, 8 heads, s 1024, d 64, fp32), median of 15.",
        "",
        "| mask backward | core backward (ms) |",
        "|---|---:|",
        f"| autograd's `masked_fill` of the gradient (before) | {old_t * 1e3:.1f} |",
        f"| passed through (`_CausalMask`, now) | {new_t * 1e3:.1f} |",
        "",
        f"Change {100 * (new_t / old_t - 1):+.1f} %; q, k and v gradients bit-identical: {same}.",
        "",
        "Priced by the shipped profiles, one block without flash, TP 1, seq 2048 (fwd + bwd, the "
        "simulator's `phase_time`; saved bytes of the trace):",
        "",
        "| profile | model | b | bwd operators | fwd+bwd ms before → now | change | saved MiB before → now |",
        "|---|---|---:|---|---|---:|---|",
    ]
    for gpu, model, b, (t0, s0, n0), (t1, s1, n1) in rows:
        lines.append(
            f"| {gpu} | {model} | {b} | {n0} → {n1} | {t0 * 1e3:.2f} → {t1 * 1e3:.2f} | "
            f"{100 * (t1 / t0 - 1):+.1f} % | {s0 / 2**20:.1f} → {s1 / 2**20:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
