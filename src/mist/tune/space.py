"""Search spaces: which values of each knob a tuner may use. A space is a value; the tuner
reads it, and the baseline spaces (megatron, deepspeed, aceso) are searched by `baselines`.

full        per stage: tensor parallel degree (a power of two within a node, dividing the
            heads), data parallel = the rest of the stage's GPUs, micro-batch = B / (G·dp),
            ZeRO 0–3, any number of recomputed blocks, selective recomputation of the others
            (their MLP activation; their attention core, searched without flash attention,
            where it drops the s² scores), offload ratios of weights, gradients,
            optimizer states and activations in eighths, sequence parallelism on or off
            where tp > 1; globally: context parallelism cp ∈ {1, 2, 4, 8} with flash
            attention (the same on every stage, cp × tp within a node), pipeline depth (any
            divisor of the GPU count that gives whole-node or in-node stage meshes), any
            layer split, G any divisor of the global batch; interleaved 1F1B with v = 2 or 4
            chunks per rank where G is a multiple of pp and the blocks divide into pp·v equal
            chunks.
mist-paper  the limits of the paper's published implementation: G a power of two, micro-batch
            1, 2 or 4, one TP degree for all stages, ZeRO ≥ 1 (optimizer states always
            sharded), layers within round(L/pp) ± 2, its ratio grids, weight offload only with
            gradient offload, no selective recomputation.
(L the model's blocks, pp the pipeline depth, G micro-batches per iteration.)

`tp_degrees` is the one enumeration of TP degrees: the tuner's per-stage choices, its uniform-TP
loop and the baselines all draw from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mist.errors import MistInputError
from mist.specs.model import ModelSpec

EIGHTHS = tuple(i / 8 for i in range(9))
PAPER_WG = (0.0, 0.25, 0.375, 0.5, 0.75, 1.0)
PAPER_OA = (0.0, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


@dataclass(frozen=True)
class SearchSpace:
    name: str
    tp_values: tuple | None = None  # None: every power of two that fits
    pp_values: tuple | None = None  # pipeline depths allowed (None: every one that fits)
    uniform_tp: bool = False  # one TP degree for every stage
    zero_levels: tuple = (0, 1, 2, 3)
    recompute: str = "any"  # "any" | "none" | "all_or_nothing"
    recompute_attention: tuple = (False, True)  # searched only without flash attention
    recompute_activation: tuple = (False, True)  # the MLP activation re-run in backward
    offload_weights: tuple = EIGHTHS  # fractions kept in host memory (`plan.Offload`)
    offload_grads: tuple = EIGHTHS
    offload_optimizer: tuple = EIGHTHS
    offload_activations: tuple = EIGHTHS
    g_policy: str = "divisors"  # "divisors" | "pow2"
    b_values: tuple | None = None  # None: any micro-batch B/(G·dp) up to b_max
    b_max: int = 64
    layer_slack: int | None = None  # None: any split; k: round(L/pp) ± k
    frontier_points: int = 24  # Pareto samples kept per (stage, layers)
    # weight/gradient offload move their bytes over PCIe every micro-batch: "if_needed" opens
    # them only when no plan fits without them; "always" searches them from the start
    wg_policy: str = "if_needed"
    seed_space: str | None = None  # search this (smaller) space first for an incumbent
    # model chunks per pipeline rank (interleaved 1F1B, `tune.interleaved`); 1: plain 1F1B only
    virtual_stages: tuple = (1,)
    # pipeline schedules searched besides plain/interleaved 1F1B ("zb-h1": `tune.zero_bubble`)
    schedules: tuple = ("1f1b",)
    # sequence parallelism of a stage's TP group (tried only where tp > 1)
    sequence_parallel: tuple = (False,)
    # context-parallel degrees, one for the whole plan (tried with flash attention only)
    cp_values: tuple = (1,)


SPACES = {
    "full": SearchSpace(
        "full",
        seed_space="mist-paper",
        virtual_stages=(1, 2, 4),
        schedules=("1f1b", "zb-h1"),
        sequence_parallel=(False, True),
        cp_values=(1, 2, 4, 8),
    ),
    "mist-paper": SearchSpace(
        "mist-paper",
        uniform_tp=True,
        zero_levels=(1, 2, 3),
        offload_weights=PAPER_WG,
        offload_grads=PAPER_WG,
        offload_optimizer=PAPER_OA,
        offload_activations=PAPER_OA,
        g_policy="pow2",
        b_values=(1, 2, 4),
        layer_slack=2,
        recompute_attention=(False,),
        recompute_activation=(False,),
    ),
}
BASELINE_SPACES = ("megatron", "deepspeed", "aceso", "megatron-paper")
# `mist tune --target X`: the plans framework X runs today (`mist.tune.targets`)
TARGET_SPACES = {"megatron": "megatron-0.19", "deepspeed": "deepspeed-0.19", "torchtitan": "torchtitan-0.3"}
# what each space stands for, as `mist compare` shows it: the paper-era baselines reproduce the
# systems the Mist paper compared with; the target spaces are what the frameworks run today
SPACE_LABELS = {
    "full": "Mist: every knob, per stage",
    "mist-paper": "Mist as published (EuroSys'25)",
    "megatron": "paper-era Megatron-LM (core_r0.4.0)",
    "deepspeed": "paper-era DeepSpeed",
    "aceso": "paper-era Aceso-style",
    "megatron-paper": "paper-era Megatron-LM, the paper's tuning",
    "megatron-0.19": "Megatron-LM 0.19 today (--target megatron)",
    "deepspeed-0.19": "DeepSpeed 0.19.8 today (--target deepspeed)",
    "torchtitan-0.3": "torchtitan 0.3.0 today (--target torchtitan)",
}


# TP degrees are powers of two within a node; the tuner caps them at 128 and its one-degree-for-
# every-stage loop (the mist-paper space) at 16, the baselines do not cap them
MAX_TP = 128
MAX_UNIFORM_TP = 16


def tp_degrees(model: ModelSpec, gpus_per_node: int, max_tp: int | None = None) -> list[int]:
    """The tensor-parallel degrees of a stage whose mesh has `gpus_per_node` GPUs per node, in
    increasing order: the powers of two up to `gpus_per_node` (and `max_tp`) that divide it and
    that split the model (`ModelSpec.check_tp`: heads, KV heads, FFN, vocabulary)."""
    out, tp = [], 1
    while tp <= gpus_per_node and (max_tp is None or tp <= max_tp):
        if gpus_per_node % tp == 0 and _splits(model, tp):
            out.append(tp)
        tp *= 2
    return out


def _splits(model: ModelSpec, tp: int) -> bool:
    try:
        model.check_tp(tp)
    except MistInputError:
        return False
    return True


def get_space(name: str) -> SearchSpace:
    if name in SPACES:
        return SPACES[name]
    raise MistInputError(
        f"Unknown search space {name!r}; choose one of {', '.join(list(SPACES) + list(BASELINE_SPACES))}."
    )
