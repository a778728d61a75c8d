"""What regional `torch.compile` would change for a block, measured on this machine's CPU: the
evidence for running the eager blocks (issue "make the blocks run as lean as the original's",
deliverable 3: a compiled path, or lean eager blocks, chosen and justified).

For the CPU loop's small GPT and Llama (benchmarks/models/loop-*.yaml) at micro-batch 4, sequence
256, fp32, one thread, one decoder block each way:

* eager: the memory-bound kernels the block launches forward and backward (Mist's own trace,
  `mist.analysis.layer.analyze_layer`; GEMMs and attention are library calls either way);
* compiled (`torch.compile(block)`, Inductor's default mode and CPU backend): the kernels Inductor
  generated for the block's forward and backward graphs (`torch._inductor.metrics`);
* both: the bytes autograd keeps for backward (every saved tensor's storage once, parameters not
  counted; AOTAutograd's partitioner decides what the compiled block saves and recomputes) and the
  median time of a forward + backward.

    PYTHONPATH=src python benchmarks/compile_check.py [--out benchmarks/results]

Writes OUT/compile_check.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# a fresh Inductor cache: the first compiled call is a cold compile, as in a new training run
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mist-inductor-")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mist.analysis.layer import analyze_layer  # noqa: E402
from mist.analysis.records import MEMORY  # noqa: E402
from mist.models import init_weights  # noqa: E402
from mist.models.block import DecoderBlock  # noqa: E402
from mist.models.collectives import TPGroup  # noqa: E402
from mist.specs.loading import load_model  # noqa: E402

B, S, REPS = 4, 256, 7
FAMILIES = ("gpt", "llama")


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """(fn's output, the bytes of the storages autograd saved while running it, parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def fwd_bwd_ms(block, x: torch.Tensor) -> float:
    def step():
        out = block(x)
        out.backward(torch.ones_like(out))

    for _ in range(2):
        step()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def check(family: str) -> dict:
    from torch._inductor import metrics  # lazy: Inductor only where a block is compiled

    spec = load_model(str(ROOT / "benchmarks" / "models" / f"loop-{family}.yaml"))
    la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", False)
    eager_kernels = [sum(r.kind == MEMORY for r in la.ops(phase)) for phase in ("fwd", "bwd")]
    block = DecoderBlock(spec, TPGroup(), True, torch.float32)
    init_weights(block, seed=0)
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    out, eager_saved = saved_bytes(lambda: block(x))
    out.backward(torch.ones_like(out))
    compiled = torch.compile(block)
    metrics.reset()
    t0 = time.perf_counter()
    out, compiled_saved = saved_bytes(lambda: compiled(x))
    out.backward(torch.ones_like(out))
    compile_s = time.perf_counter() - t0
    generated = metrics.generated_kernel_count
    return {
        "family": family,
        "eager_memory_kernels": eager_kernels,
        "generated_kernels": generated,
        "eager_saved": eager_saved,
        "compiled_saved": compiled_saved,
        "compile_s": compile_s,
        "eager_ms": fwd_bwd_ms(block, x),
        "compiled_ms": fwd_bwd_ms(compiled, x),
    }


def markdown(rows: list[dict]) -> str:
    out = [
        f"One decoder block of the CPU loop's models, micro-batch {B}, sequence {S}, fp32, one thread, on "
        f"{platform.processor() or platform.machine()} ({torch.__version__}); time: median of {REPS} forward + "
        "backward after 2 warm-ups.",
        "",
        "| block | eager memory-bound kernels fwd / bwd | Inductor-generated kernels fwd + bwd "
        "| saved for backward eager / compiled (MiB) | saved change | first compiled call, cold cache (s) "
        "| fwd + bwd eager / compiled (ms) | compiled vs eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, b = r["eager_memory_kernels"]
        out.append(
            f"| {r['family']} | {f} / {b} | {r['generated_kernels']} | {r['eager_saved'] / 2**20:.2f} / "
            f"{r['compiled_saved'] / 2**20:.2f} | {r['compiled_saved'] / r['eager_saved'] - 1:+.1%} | "
            f"{r['compile_s']:.1f} | {r['eager_ms']:.1f} / {r['compiled_ms']:.1f} | "
            f"{r['compiled_ms'] / r['eager_ms'] - 1:+.1%} |"
        )
    out += [
        "",
        "GEMMs and attention run as library calls in both. Inductor's partitioner saves fewer bytes "
        "because it recomputes cheap elementwise work in the backward instead of keeping its "
        "results; the eager analysis prices what the eager block saves and launches, so a compiled "
        "runtime would need its own analysis of the AOT graphs before the tuner could use it.",
    ]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [check(f) for f in FAMILIES]
    text = markdown(rows)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "compile_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
