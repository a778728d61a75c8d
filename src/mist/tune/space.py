"""Search spaces: which values of each knob a tuner may use. A space is a value; the tuner
reads it, and the baseline spaces (megatron, deepspeed, aceso) are searched by `baselines`.

full        per stage: tensor parallel degree (a power of two within a node, dividing the
            heads), data parallel = the rest of the stage's GPUs, micro-batch = B / (G·dp),
            ZeRO 0–3, any number of recomputed blocks, selective recomputation of the others
            (their MLP activation; their attention core, searched without flash attention,
            where it drops the s² scores), offload ratios of weights, gradients,
            optimizer states and activations in eighths; globally: pipeline depth (any
            divisor of the GPU count that gives whole-node or in-node stage meshes), any
            layer split, G any divisor of the global batch.
mist-paper  the original's limits (reference/mist-system.md §2): G a power of two, micro-batch
            1, 2 or 4, one TP degree for all stages, ZeRO ≥ 1 (optimizer states always
            sharded), layers within round(L/S) ± 2, its ratio grids, weight offload only with
            gradient offload, no selective recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from mist.errors import MistInputError

EIGHTHS = tuple(i / 8 for i in range(9))
PAPER_WG = (0.0, 0.25, 0.375, 0.5, 0.75, 1.0)
PAPER_OA = (0.0, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


@dataclass(frozen=True)
class SearchSpace:
    name: str
    tp_values: tuple | None = None      # None: every power of two that fits
    pp_values: tuple | None = None      # pipeline depths allowed (None: every one that fits)
    uniform_tp: bool = False            # one TP degree for every stage
    zero_levels: tuple = (0, 1, 2, 3)
    recompute: str = "any"              # "any" | "none" | "all_or_nothing"
    attention_recompute: tuple = (False, True)   # searched only without flash attention
    activation_recompute: tuple = (False, True)  # the MLP activation re-run in backward
    wo: tuple = EIGHTHS
    go: tuple = EIGHTHS
    oo: tuple = EIGHTHS
    ao: tuple = EIGHTHS
    g_policy: str = "divisors"          # "divisors" | "pow2"
    b_values: tuple | None = None       # None: any micro-batch B/(G·dp) up to b_max
    b_max: int = 64
    layer_slack: int | None = None      # None: any split; k: round(L/S) ± k
    frontier_points: int = 24           # Pareto samples kept per (stage, layers)
    # weight/gradient offload move their bytes over PCIe every micro-batch: "if_needed" opens
    # them only when no plan fits without them; "always" searches them from the start
    wg_policy: str = "if_needed"
    seed_space: str | None = None       # search this (smaller) space first for an incumbent


SPACES = {
    "full": SearchSpace("full", seed_space="mist-paper"),
    "mist-paper": SearchSpace("mist-paper", uniform_tp=True, zero_levels=(1, 2, 3), wo=PAPER_WG, go=PAPER_WG,
                              oo=PAPER_OA, ao=PAPER_OA, g_policy="pow2", b_values=(1, 2, 4), layer_slack=2,
                              attention_recompute=(False,), activation_recompute=(False,)),
}
BASELINE_SPACES = ("megatron", "deepspeed", "aceso", "megatron-paper")


def get_space(name: str) -> SearchSpace:
    if name in SPACES:
        return SPACES[name]
    raise MistInputError(f"Unknown search space {name!r}; choose one of "
                         f"{', '.join(list(SPACES) + list(BASELINE_SPACES))}.")
