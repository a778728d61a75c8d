"""One entry point for every search space (Mist's own and the baselines')."""

from __future__ import annotations

from dataclasses import replace

from mist.errors import MistInputError
from mist.tune.result import TuneResult
from mist.tune.space import BASELINE_SPACES, TARGET_SPACES, get_space

ALL_SPACES = ("full", "mist-paper") + BASELINE_SPACES + tuple(TARGET_SPACES.values())
COMPILED_SPACES = ("full", "mist-paper", TARGET_SPACES["torchtitan"])


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
