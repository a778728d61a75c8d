"""One entry point for every search space (Mist's own and the baselines')."""

from __future__ import annotations

import time
from dataclasses import replace

from mist.errors import MistInputError
from mist.simulate.precision import profile_target
from mist.tune.result import TuneResult
from mist.tune.space import BASELINE_SPACES, TARGET_SPACES, get_space

ALL_SPACES = ("full", "mist-paper") + BASELINE_SPACES + tuple(TARGET_SPACES.values())
COMPILED_SPACES = ("full", "mist-paper", TARGET_SPACES["torchtitan"])


def compiles_by_default(space: str, profile) -> bool:
    """Whether compiled blocks are in play when neither `--compile-blocks` nor `--no-compile` is
    given: on a GPU profile, in the spaces that run them. There `mist tune` searches the space with
    compiled blocks and with eager ones and keeps the faster plan (`run_space_either_blocks`), and
    `mist estimate` prices compiled blocks.

    On a GPU Inductor fuses the pointwise and reduction work between a block's GEMMs and attention
    kernels into one kernel per run, which eager blocks launch one by one: on one H200 a llama-1.3b
    plan ran 0.303 s a step compiled against 0.319 s eager (benchmarks/results/gpu_loop.md), and
    a gpt3-1.3b block without flash attention on an L4 is priced 6 % faster at b 1 (its forward
    13 %: the s² mask and softmax passes fused). Not every plan gains: a ZB-H1 stage's compiled
    backward runs as two graphs that cannot fuse across their cut, and what the partitioner keeps
    can set a stage's peak higher (benchmarks/results/compiled_gain.md), hence both searches. On
    a CPU core the CPU loop's blocks measured +1.5 % (GPT) and −2.1 % (Llama) against eager
    (benchmarks/results/compile_check.md) after 6–13 s of compiling, so a CPU profile keeps eager
    blocks. The spaces of the other frameworks stand for their own eager blocks."""
    return space in COMPILED_SPACES and profile_target(profile) == "cuda"


def run_space_either_blocks(
    space: str, model, cluster, training, profile, time_budget=None, progress=None, limits: dict | None = None
) -> TuneResult:
    """The faster plan of `space` searched with eager blocks and then, in what is left of
    `time_budget`, with compiled ones (`compiles_by_default`); its tuning time, candidates and
    budget flag cover both searches. `progress`, when given, is also told which search is running
    (its fourth argument: "eager blocks", then "compiled blocks"; while a search's layers are
    traced, "eager blocks: " + `result.TRACING`, and so on)."""

    def told(label: str):
        if progress is None:
            return None
        return lambda done, total, best, what=None: progress(
            done, total, best, label if what is None else f"{label}: {what}"
        )

    t0 = time.perf_counter()
    eager = run_space(
        space,
        model,
        cluster,
        replace(training, compile_blocks=False),
        profile,
        time_budget,
        told("eager blocks"),
        limits,
    )
    left = None if time_budget is None else time_budget - (time.perf_counter() - t0)
    if left is not None and left <= 0:
        return replace(eager, budget_ran_out=True)
    compiled = run_space(
        space, model, cluster, replace(training, compile_blocks=True), profile, left, told("compiled blocks"), limits
    )
    found = [r for r in (eager, compiled) if r.plan is not None]
    best = min(found, key=lambda r: r.iteration_time_s or 0.0) if found else eager
    return replace(
        best,
        tuning_time_s=eager.tuning_time_s + compiled.tuning_time_s,
        candidates_evaluated=eager.candidates_evaluated + compiled.candidates_evaluated,
        budget_ran_out=eager.budget_ran_out or compiled.budget_ran_out,
        tracing_time_s=eager.tracing_time_s + compiled.tracing_time_s,
    )


def run_space(
    space: str, model, cluster, training, profile, time_budget=None, progress=None, limits: dict | None = None
) -> TuneResult:
    """Tune in `space`; `limits` (pp_values, tp_values) restrict the full / mist-paper spaces.
    Compiled blocks (`training.compile_blocks`) are searched in the full and mist-paper spaces and
    in torchtitan's, which compiles each block as Mist does (`mist.export.torchtitan`): the other
    framework and baseline spaces stand for their frameworks' own eager blocks."""
    if training.compile_blocks and space not in COMPILED_SPACES:
        raise MistInputError(f"--compile-blocks searches the {', '.join(COMPILED_SPACES)} spaces, not {space}.")
    if space in TARGET_SPACES.values():
        from mist.tune.targets import tune_target  # lazy: keeps torch out of the CLI start-up

        target = next(t for t, name in TARGET_SPACES.items() if name == space)
        return tune_target(target, model, cluster, training, profile, time_budget=time_budget)
    if space in BASELINE_SPACES:
        from mist.tune import baselines  # lazy: keeps torch out of the CLI start-up

        fn = {
            "megatron": baselines.tune_megatron,
            "deepspeed": baselines.tune_deepspeed,
            "aceso": baselines.tune_aceso,
            "megatron-paper": baselines.tune_megatron_paper,
        }[space]
        return fn(model, cluster, training, profile, time_budget=time_budget)
    from mist.tune.search import tune  # lazy: keeps torch out of the CLI start-up

    sp = replace(get_space(space), **{k: v for k, v in (limits or {}).items() if v is not None})
    return tune(model, cluster, training, profile, sp, time_budget=time_budget, progress=progress)
