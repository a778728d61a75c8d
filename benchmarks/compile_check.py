"""Compiled blocks against eager ones on this machine's CPU (`training.compile_blocks`,
`mist.models.compiled`): what the analysis of the captured graphs predicts against what Inductor
runs.

For the CPU loop's small GPT and Llama (benchmarks/models/loop-*.yaml) at micro-batch 4, sequence
256, fp32, one thread, one decoder block each way:

* kernels: the eager block's memory-bound kernels (Mist's trace) forward / backward; the compiled
  block's fused kernels as Mist prices them (each run of pointwise and reduction operators between
  two GEMM or attention calls, `mist.analysis.compiled`) forward / backward, next to the kernels
  Inductor generated for both graphs (`torch._inductor.metrics`);
* saved for backward, predicted and measured (every saved storage once, parameters' storages
  excluded), eager and compiled;
* the median forward + backward time of each, and the first compiled call (a cold compile).

    PYTHONPATH=src python benchmarks/compile_check.py [--out benchmarks/results]

Writes OUT/compile_check.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
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
from mist.analysis.records import ATTENTION, GEMM, MEMORY  # noqa: E402
from mist.models import init_weights  # noqa: E402
from mist.models.block import DecoderBlock  # noqa: E402
from mist.models.collectives import TPGroup  # noqa: E402
from mist.models.compiled import compile_block  # noqa: E402
from mist.specs.loading import load_model  # noqa: E402

B, S, REPS = 4, 256, 7
# a launch of a kernel Inductor generated, in its output code (C++ on the CPU, Triton on a GPU)
LAUNCH = re.compile(r"^\s+(?:cpp_fused_\w+\(|triton_\w+\.run\()", re.M)
FAMILIES = ("gpt", "llama")


def saved_bytes(fn, params: set[int]) -> tuple[torch.Tensor, int]:
    """(fn's output, the bytes of the storages autograd saved while running it, the storages of
    `params` (data pointers) excluded: a weight may reach autograd as an alias, not as itself)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
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
    from torch._inductor.utils import run_and_get_code  # lazy: Inductor only where a block is compiled

    spec = load_model(str(ROOT / "benchmarks" / "models" / f"loop-{family}.yaml"))
    eager_la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", False)
    compiled_la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", False, compiled=True)
    count = lambda la, kinds: [sum(r.kind in kinds for r in la.ops(ph)) for ph in ("fwd", "bwd")]  # noqa: E731
    block = DecoderBlock(spec, TPGroup(), True, torch.float32)
    init_weights(block, seed=0)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    out, eager_saved = saved_bytes(lambda: block(x), params)
    out.backward(torch.ones_like(out))
    compiled = compile_block(block)
    got: dict = {}

    def first_call():
        out, got["saved"] = saved_bytes(lambda: compiled(x), params)
        out.backward(torch.ones_like(out))

    t0 = time.perf_counter()
    _, codes = run_and_get_code(first_call)  # the forward's code, then the backward's
    compile_s = time.perf_counter() - t0
    compiled_saved = got["saved"]
    return {
        "family": family,
        "eager_memory_kernels": count(eager_la, (MEMORY,)),
        "compiled_fused_kernels": count(compiled_la, (MEMORY,)),
        "compiled_library_kernels": count(compiled_la, (GEMM, ATTENTION)),
        "inductor_launches": [len(LAUNCH.findall(code)) for code in codes],
        "eager_saved": eager_saved,
        "eager_saved_predicted": float(eager_la.saved(B, S)),
        "compiled_saved": compiled_saved,
        "compiled_saved_predicted": float(compiled_la.saved(B, S)),
        "compile_s": compile_s,
        "eager_ms": fwd_bwd_ms(block, x),
        "compiled_ms": fwd_bwd_ms(compiled, x),
    }


def markdown(rows: list[dict]) -> str:
    mib = lambda v: f"{v / 2**20:.2f}"  # noqa: E731
    out = [
        f"One decoder block of the CPU loop's models, micro-batch {B}, sequence {S}, fp32, one thread, on "
        f"{platform.processor() or platform.machine()} ({torch.__version__}); time: median of {REPS} forward + "
        "backward after 2 warm-ups.",
        "",
        "| block | eager memory-bound kernels fwd / bwd | compiled: Mist's fused kernels fwd / bwd "
        "| Inductor's generated-kernel launches fwd / bwd | GEMM + attention calls fwd / bwd "
        "| saved eager pred / meas (MiB) | saved compiled pred / meas (MiB) | saved change "
        "| first compiled call (s) | fwd + bwd eager / compiled (ms) | compiled vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ef, eb = r["eager_memory_kernels"]
        cf, cb = r["compiled_fused_kernels"]
        nf, nb = r["inductor_launches"]
        lf, lb = r["compiled_library_kernels"]
        out.append(
            f"| {r['family']} | {ef} / {eb} | {cf} / {cb} | {nf} / {nb} | {lf} / {lb} | "
            f"{mib(r['eager_saved_predicted'])} / {mib(r['eager_saved'])} | "
            f"{mib(r['compiled_saved_predicted'])} / {mib(r['compiled_saved'])} | "
            f"{r['compiled_saved'] / r['eager_saved'] - 1:+.1%} | {r['compile_s']:.1f} | "
            f"{r['eager_ms']:.1f} / {r['compiled_ms']:.1f} | {r['compiled_ms'] / r['eager_ms'] - 1:+.1%} |"
        )
    out += [
        "",
        "GEMMs and attention run as library calls in both. Inductor's partitioner saves fewer bytes: it "
        "recomputes cheap elementwise work in the backward instead of keeping its results. Mist prices each "
        "run of pointwise and reduction operators between two library calls as one fused kernel; Inductor's "
        "scheduler may split a run where iteration spaces differ, lowers a concatenation as one copy per "
        "input, and copies an operand a library call needs contiguous, so it launches more kernels than "
        "Mist counts; the bytes of a split run are the run's, those of an added copy are not priced.",
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
