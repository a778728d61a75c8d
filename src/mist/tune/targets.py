"""Target spaces — the plans Megatron-LM 0.19, DeepSpeed 0.19 and torchtitan 0.3 run today.

`mist tune --target megatron|deepspeed|torchtitan` searches one of these spaces with the baseline
machinery of `mist.tune.baselines` (the same enumeration rules for meshes, the same memoized
costing by Mist's simulator, the same re-check of the winner with `simulate_plan`) and returns the
fastest plan that fits. Unlike the paper-era baselines (`megatron`, `deepspeed`, kept unchanged),
every candidate here is first passed through the target's exporter: only plans with
`mist.export.<target>.problems(plan) == []` are costed, so the tuned plan always exports exactly.

Shared rules (from the baselines): every stage has the same GPUs, one dp, tp and micro-batch on
every stage, pp a power of two with a valid equal stage mesh, tp a power of two within a node that
splits the model, micro-batch × dp × G = global batch.

Both Megatron-LM and torchtitan also run every candidate with context parallelism cp ∈ {2, 4, 8}
(flash attention; the cp ranks taken from the data-parallel ones, micro-batches scaled to keep
the global batch: `_context_parallel`).

megatron-0.19: sequence parallelism on or off with tp > 1 (`--sequence-parallel`, one setting for
  every stage); pp with the even split, or when pp does not divide the layer count the balanced
  uneven split (`--pipeline-model-parallel-layout`); fp32 gradients (16-bit where the training names
  them); block recomputation with one N for all stages
  (N ∈ {0, 1, half, all} of the largest stage) or, instead, the attention core
  (`--recompute-modules core_attn`); the distributed optimizer (ZeRO-1) on; optimizer
  offload fraction 0, 0.5 or 1 (`--optimizer-offload-fraction`, needs the distributed optimizer);
  micro-batch 1/2/4/8; virtual pipeline stages v = 2 or 4 (interleaved 1F1B, the layout with
  pp·v chunks) where G is a multiple of pp and the blocks split into pp·v equal chunks, with the
  same recompute N of every chunk (N ∈ {0, 1, half, all} of a chunk) or the attention core.
deepspeed-0.19: the `deepspeed` baseline's rules (ZeRO 0–3 without a pipeline, ZeRO 0/1 with one,
  ZeRO-Infinity with ZeRO-3) with DeepSpeed's offload as it runs: gradients go to the CPU with the
  optimizer states, and with ZeRO-3 at pp = 1 part of the optimizer states (in eighths of a
  rank's share: 1/4, 1/2, 3/4).
torchtitan-0.3: Llama-family models only; fp32 gradients; sequence parallelism whenever tp > 1 (its
  tensor-parallel plan always shards the norms' sequence); replicated (ZeRO-0) or FSDP2 data
  parallelism (ZeRO-2/3 without a pipeline, ZeRO-1 under one: see `mist.export.torchtitan`), tp,
  pp with the balanced split, full activation checkpointing or none, CPU offload of all weights,
  gradients and optimizer state (FSDP2, ZeRO-3, no pipeline) or none; micro-batch 1/2/4/8;
  Interleaved1F1B with v = 2 or 4 model parts per rank under the same conditions as Megatron-LM's
  (G a multiple of pp, equal chunks), full activation checkpointing or none.

Interleaved candidates take their chunk rule from the full space's search
(`mist.tune.interleaved.chunk_counts`) and are costed by `simulate_plan` (see `tune.baselines`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from mist.errors import MistInputError
from mist.export import deepspeed as ds_export
from mist.export import megatron as mg_export
from mist.export import torchtitan as tt_export
from mist.plan import Offload, Plan, StageStrategy
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.baselines import (
    DEEPSPEED_MICRO_BATCHES,
    MEGATRON_MICRO_BATCHES,
    _best_of,
    _deepspeed_candidates,
    _depths,
    _Evaluator,
    _run,
    even_split,
)
from mist.tune.interleaved import chunk_counts
from mist.tune.result import TuneResult
from mist.tune.space import TARGET_SPACES, tp_degrees

MEGATRON_OFFLOAD = (0.0, 0.5, 1.0)
DEEPSPEED_PARTIAL_OFFLOAD = (0.25, 0.5, 0.75)
TORCHTITAN_MICRO_BATCHES = (1, 2, 4, 8)
TARGET_VIRTUAL_STAGES = (2, 4)  # model chunks per pipeline rank the target spaces try

Candidate = tuple[int, tuple[StageStrategy, ...]]

__all__ = ["TARGET_SPACES", "tune_target", "megatron_candidates", "deepspeed_candidates", "torchtitan_candidates"]


# ------------------------------------------------------------------ shared
def _meshes(model: ModelSpec, cluster: ClusterSpec, micro_batches: Iterable[int], B: int) -> Iterator[tuple]:
    """(pp, nodes, gpus_per_node, tp, dp, micro-batch) of every uniform mesh the baselines allow."""
    for pp, (n, g) in _depths(model, cluster):
        for tp in tp_degrees(model, g):
            dp = n * g // tp
            for b in micro_batches:
                if B % (b * dp) == 0:
                    yield pp, n, g, tp, dp, b


def _stages(layers: list[int], n: int, g: int, tp: int, dp: int, b: int, **knobs) -> tuple[StageStrategy, ...]:
    """One StageStrategy per layer count; `recompute` (N blocks, capped per stage) and the rest as given."""
    rc = knobs.pop("recompute")
    return tuple(
        StageStrategy(
            layers=l, nodes=n, gpus_per_node=g, micro_batch=b, dp=dp, tp=tp, recompute_layers=min(rc, l), **knobs
        )
        for l in layers
    )


def _interleaved_stages(
    L: int, pp: int, v: int, n: int, g: int, tp: int, dp: int, b: int, **knobs
) -> tuple[StageStrategy, ...]:
    """pp ranks of v equal chunks (L/(pp·v) blocks each); `recompute` blocks of every chunk."""
    lc = L // (pp * v)
    rc = min(knobs.pop("recompute"), lc)
    return tuple(
        StageStrategy(
            layers=lc * v,
            nodes=n,
            gpus_per_node=g,
            micro_batch=b,
            dp=dp,
            tp=tp,
            recompute_layers=rc * v,
            chunk_layers=(lc,) * v,
            **knobs,
        )
        for _ in range(pp)
    )


def _exportable(
    ev: _Evaluator, candidates: Iterable[Candidate], problems: Callable[[Plan], list[str]], refused: list[str]
):
    """The candidates whose plan the target's exporter accepts as it is; the first refusal's
    first sentence goes to `refused` (the reason given when none is left)."""
    for G, stages in candidates:
        try:
            plan = ev.plan(G, stages)
        except MistInputError as e:
            refused[:1] = refused[:1] or [str(e)]
            continue
        found = problems(plan)
        if not found:
            yield G, stages
        elif not refused:
            refused.append(found[0])


# ------------------------------------------------------------------ Megatron-LM 0.19
def _sequence_parallel(stages: tuple[StageStrategy, ...]) -> tuple[StageStrategy, ...]:
    """The stages with their TP groups' sequence parallelism on (where tp > 1)."""
    return tuple(replace(s, sequence_parallel=s.tp > 1) for s in stages)


TARGET_CP = (2, 4, 8)  # context-parallel degrees the target spaces try


def _context_parallel(
    candidates: Iterable[Candidate], training: TrainingSpec, sharded: bool = False
) -> Iterator[Candidate]:
    """Every candidate, and with flash attention the same with cp of its data-parallel ranks
    running context parallelism instead (dp / cp replicas, cp times the micro-batches: the same
    GPUs and global batch), where cp divides dp, cp × tp fits a node and the sequence splits into
    2·cp chunks (of tp shards under sequence parallelism). `sharded`: only candidates with ZeRO
    (torchtitan shards over the context-parallel ranks with FSDP2). The candidates without context
    parallelism come first (a time-budgeted search sees them first)."""
    plain = list(candidates)
    yield from plain
    for G, stages in plain:
        s0 = stages[0]
        if s0.recompute_attention or (sharded and s0.zero == 0):  # (the attention-core recompute has no
            continue  # meaning under cp, `plan`)
        for cp in TARGET_CP if training.flash_attention else ():
            split = 2 * cp * (s0.tp if s0.sequence_parallel else 1)
            if s0.dp % cp or s0.gpus_per_node % (s0.tp * cp) or training.seq_len % split:
                continue
            yield G * cp, tuple(replace(s, dp=s.dp // cp, cp=cp) for s in stages)


def megatron_candidates(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Iterator[Candidate]:
    """`_megatron_plain` and, with tp > 1, the same with `--sequence-parallel`; each also with
    context parallelism."""
    for G, stages in _context_parallel(_megatron_plain(model, cluster, training), training):
        yield G, stages
        if stages[0].tp > 1:
            yield G, _sequence_parallel(stages)


def _megatron_plain(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Iterator[Candidate]:
    """Uniform meshes × even/balanced-uneven split × one block-recompute N × optimizer offload."""
    B, L = training.global_batch, model.num_layers
    for pp, n, g, tp, dp, b in _meshes(model, cluster, MEGATRON_MICRO_BATCHES, B):
        G = B // (b * dp)
        layers = even_split(L, pp)
        for rc, attn in _megatron_recompute(max(layers)):
            for off in MEGATRON_OFFLOAD:
                knobs = dict(recompute=rc, zero=1, offload=Offload(optimizer=off), recompute_attention=attn)
                yield G, _stages(layers, n, g, tp, dp, b, **knobs)
        # virtual pipeline stages: --recompute-num-layers counts blocks of every chunk
        for v in chunk_counts(L, pp, G, TARGET_VIRTUAL_STAGES):
            for rc, attn in _megatron_recompute(L // (pp * v)):
                for off in MEGATRON_OFFLOAD:
                    knobs = dict(recompute=rc, zero=1, offload=Offload(optimizer=off), recompute_attention=attn)
                    yield G, _interleaved_stages(L, pp, v, n, g, tp, dp, b, **knobs)


def _megatron_recompute(top: int) -> list[tuple[int, bool]]:
    """(blocks recomputed of a stage or chunk of `top` blocks, attention core recomputed):
    --recompute-granularity is one value, so selective core_attn recompute only without block
    recompute."""
    return [(rc, False) for rc in sorted({0, 1, top // 2, top})] + [(0, True)]


# ------------------------------------------------------------------ DeepSpeed 0.19
def _ds_offload(s: StageStrategy) -> StageStrategy:
    """DeepSpeed moves the gradients to the CPU with the optimizer states they update."""
    o = s.offload
    return s if o.grads == o.optimizer else replace(s, offload=replace(o, grads=o.optimizer))


def deepspeed_candidates(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Iterator[Candidate]:
    """The `deepspeed` baseline's candidates (offload as DeepSpeed runs it) and partial ZeRO-3 offload."""
    for G, stages in _deepspeed_candidates(model, cluster, training):
        yield G, tuple(_ds_offload(s) for s in stages)
    B = training.global_batch
    for pp, n, g, tp, dp, b in _meshes(model, cluster, DEEPSPEED_MICRO_BATCHES, B):
        if pp > 1 or dp == 1:
            continue
        for r in DEEPSPEED_PARTIAL_OFFLOAD:
            for full_rc in (True, False):
                rc = model.num_layers if full_rc else 0
                off = Offload(grads=r, optimizer=r)
                yield B // (b * dp), _stages([model.num_layers], n, g, tp, dp, b, recompute=rc, zero=3, offload=off)


# ------------------------------------------------------------------ torchtitan 0.3
def torchtitan_candidates(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Iterator[Candidate]:
    """`_torchtitan_plain`, each also with context parallelism."""
    return _context_parallel(_torchtitan_plain(model, cluster, training), training, sharded=True)


def _torchtitan_plain(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Iterator[Candidate]:
    """Uniform meshes × replicate/FSDP2 × full AC or none × all-or-nothing CPU offload (FSDP2)."""
    B = training.global_batch
    full = Offload(weights=1.0, grads=1.0, optimizer=1.0)
    for pp, n, g, tp, dp, b in _meshes(model, cluster, TORCHTITAN_MICRO_BATCHES, B):
        layers = even_split(model.num_layers, pp)
        # FSDP2 under a pipeline keeps whole parameters and gradients through the step: ZeRO-1
        levels = (0,) if dp == 1 else (0, 1) if pp > 1 else (0, 2, 3)
        variants = [(z, Offload()) for z in levels]
        if dp > 1 and pp == 1:
            variants.append((3, full))
        for z, off in variants:
            for rc in (max(layers), 0):
                stages = _stages(layers, n, g, tp, dp, b, recompute=rc, zero=z, offload=off)
                yield B // (b * dp), _sequence_parallel(stages)
        # Interleaved1F1B (no CPU offload under a pipeline): full activation checkpointing or none
        G = B // (b * dp)
        for v in chunk_counts(model.num_layers, pp, G, TARGET_VIRTUAL_STAGES):
            for z in levels:
                for rc in (model.num_layers, 0):
                    stages = _interleaved_stages(model.num_layers, pp, v, n, g, tp, dp, b, recompute=rc, zero=z)
                    yield G, _sequence_parallel(stages)


# ------------------------------------------------------------------ entry point
_TARGETS = {
    "megatron": (megatron_candidates, mg_export.problems),
    "deepspeed": (deepspeed_candidates, ds_export.problems),
    "torchtitan": (torchtitan_candidates, tt_export.problems),
}


def tune_target(
    target: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    profile,
    time_budget: float | None = None,
) -> TuneResult:
    """The fastest plan that fits among those `target` runs as exported (see the module docstring)."""
    if target == "torchtitan" and model.family != "llama":  # a result, not an error: `mist compare` lists it
        reason = (
            f"torchtitan has no model for {model.name or 'this model'} (a {model.family} model; its only "
            "dense decoder is llama3)."
        )
        return TuneResult(TARGET_SPACES[target], None, None, 0.0, 0, reason)
    if target == "megatron":
        training = mg_export.runs_training(training)
    elif target == "torchtitan":
        training = tt_export.runs_training(training)
    enumerate_, problems = _TARGETS[target]

    refused: list[str] = []

    def search(ev, t0, budget):
        found = _exportable(ev, enumerate_(model, cluster, training), problems, refused)
        return _best_of(ev, found, t0 + budget)

    # costed as the framework's own runtime keeps a pipeline's sent outputs (`Plan.engine`)
    res = _run(TARGET_SPACES[target], search, model, cluster, training, profile, time_budget, "", engine=target)
    if res.plan is None and res.candidates_evaluated == 0:
        why = refused[0] if refused else "no uniform power-of-two mesh and micro-batch divides the batch"
        res = replace(
            res,
            infeasible_reason=f"No {TARGET_SPACES[target]} plan exists for {model.name or 'the model'} on "
            f"{cluster.world_size} GPUs with global batch {training.global_batch}: {why}.",
        )
    return res
