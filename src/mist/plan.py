"""The Plan: the one contract between tune, simulate, runtime and export.

A plan says how to train a model on a cluster: the gradient-accumulation count G
(`micro_batches`) and, per pipeline stage in order, its layers, its device mesh, micro-batch
size, data/tensor parallel degrees, ZeRO level, recomputed blocks (the last N of the stage),
whether its other blocks recompute their attention core and their MLP activation, and the
fraction of each state kept in CPU memory. Stage 0 also holds the embedding and the last stage
the final norm, head and loss. This module checks and (de)serializes; nothing else.

Interleaved pipelines: with `virtual_stages` v ≥ 2 every stage (pipeline rank) holds v model
chunks, and `chunk_layers` says how many blocks each holds (summing to the stage's `layers`). The
model's blocks are split into chunks in the order stage 0 chunk 0, stage 1 chunk 0, …, the last
stage's chunk 0, stage 0 chunk 1, … (Megatron-LM's and torchtitan's layout); stage 0's chunk 0
holds the embedding, the last stage's last chunk the head. The stage's other fields hold for all
its chunks; its `recompute_layers` spread over them (`rules.interleaved_order.chunk_recompute`).
A plan without the two fields is a plain 1F1B plan (v = 1), and is written without them.

`schedule` "zb-h1" (written only when set) runs the zero-bubble ZB-H1 schedule instead of 1F1B:
every backward split into its input-gradient and its weight-gradient pass, the latter deferred
into the bubble (`mist.rules.zero_bubble_order`).

`engine` (written only when not "mist") names what runs the plan: Mist's runtime, or the framework
(`megatron`, `deepspeed`, `torchtitan`) a target space tuned it for. It prices what that engine keeps
of a pipeline's sent outputs (`mist.rules.pipeline_outputs`); `mist train` runs any plan on Mist's
runtime and `mist validate` predicts it as Mist's runtime runs it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from mist.checks import is_int, is_number
from mist.errors import MistInputError
from mist.rules.pipeline_outputs import ENGINES
from mist.rules.zero_bubble_order import SCHEDULES, ZB_H1, zb_h1_problem
from mist.specs.loading import load_model, load_model_dict
from mist.specs.model import ModelSpec
from mist.specs.presets import PRESETS
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.userfiles import YAML_SUFFIXES, parse_json, parse_yaml, read_user_text

OFFLOAD_KINDS = ("weights", "grads", "optimizer", "activations")
PLAN_FIELDS = ("model", "cluster", "training", "micro_batches", "stages")
OPTIONAL_PLAN_FIELDS = ("virtual_stages", "schedule", "engine")


@dataclass(frozen=True)
class Offload:
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in OFFLOAD_KINDS)


@dataclass(frozen=True)
class StageStrategy:
    layers: int
    nodes: int
    gpus_per_node: int
    micro_batch: int
    dp: int
    tp: int
    zero: int = 0
    recompute_layers: int = 0
    offload: Offload = field(default_factory=Offload)
    recompute_attention: bool = False  # the blocks not recomputed whole recompute their attention core
    recompute_activation: bool = False  # ... and their MLP activation (fc2 re-runs it in backward)
    chunk_layers: tuple[int, ...] | None = None  # blocks per model chunk (interleaved plans only)
    # Megatron-style sequence parallelism of the tp group (tp > 1): norms, residuals and the
    # activations between the blocks hold s/tp of the sequence (`mist.models.collectives.TPGroup`)
    sequence_parallel: bool = False
    # context parallelism: cp ranks per (data replica, TP group), each holding 2 of the sequence's
    # 2·cp chunks (`mist.models.context_parallel`); the stage's GPUs are dp × cp × tp
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def chunks(self) -> tuple[int, ...]:
        """Blocks per model chunk of this stage: `chunk_layers`, or one chunk of all its layers."""
        return tuple(self.chunk_layers) if self.chunk_layers is not None else (self.layers,)

    def to_dict(self) -> dict:
        """The stage as a plan file writes it (no `chunk_layers` key in a plain 1F1B plan)."""
        d = asdict(self)
        if not self.sequence_parallel:
            del d["sequence_parallel"]
        if self.cp == 1:
            del d["cp"]
        if self.chunk_layers is None:
            del d["chunk_layers"]
        else:
            d["chunk_layers"] = list(self.chunk_layers)
        return d


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    micro_batches: int
    stages: tuple[StageStrategy, ...]
    model_ref: str | None = None  # the preset name or path the plan was written with
    virtual_stages: int = 1  # model chunks per stage (v); ≥ 2 runs interleaved 1F1B
    # the pipeline schedule: "1f1b", or "zb-h1" (`rules.zero_bubble_order`: B and W split)
    schedule: str = SCHEDULES[0]
    # what runs the plan and so sets the memory it is priced with (`rules.pipeline_outputs`):
    # "mist" (Mist's runtime), or the framework a target space tuned it for
    engine: str = ENGINES[0]

    def __post_init__(self) -> None:
        check_plan(self)

    # ------------------------------------------------------------- views
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict:
        d: dict = {
            "model": self.model_ref if self.model_ref else self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "training": self.training.to_dict(),
            "micro_batches": self.micro_batches,
        }
        if self.virtual_stages != 1:
            d["virtual_stages"] = self.virtual_stages
        if self.schedule != SCHEDULES[0]:
            d["schedule"] = self.schedule
        if self.engine != ENGINES[0]:
            d["engine"] = self.engine
        d["stages"] = [s.to_dict() for s in self.stages]
        return d

    def save(self, path: str | Path) -> None:
        path = Path(path)
        d = self.to_dict()
        text = yaml.safe_dump(d, sort_keys=False) if path.suffix.lower() in YAML_SUFFIXES else json.dumps(d, indent=1)
        path.write_text(text + ("" if text.endswith("\n") else "\n"))

    def save_beside(self, path: str | Path) -> None:
        """Save, writing a profile file named by `cluster.gpu` relative to the plan's folder (as
        `load_plan` reads it), so that the plan works from any folder and moves with its profile."""
        gpu = self.cluster.gpu
        if gpu.lower().endswith(".json") and Path(gpu).expanduser().is_file():
            rel = os.path.relpath(Path(gpu).expanduser().resolve(), Path(path).resolve().parent)
            return replace(self, cluster=replace(self.cluster, gpu=rel)).save(path)
        return self.save(path)

    def summary(self) -> str:
        m, c, t = self.model, self.cluster, self.training
        lines = [
            f"{m.name}: {m.num_layers} layers on {c.nodes}×{c.gpus_per_node} {c.gpu}, "
            f"seq {t.seq_len}, global batch {t.global_batch}, G = {self.micro_batches} micro-batches, "
            f"{'flash' if t.flash_attention else 'non-flash'} attention, {t.param_dtype}"
            + (f" with {t.grad_dtype} gradients" if t.grad_dtype not in (None, t.param_dtype) else "")
            + (f", interleaved 1F1B with {self.virtual_stages} chunks per stage" if self.virtual_stages > 1 else "")
            + (", zero-bubble ZB-H1 schedule" if self.schedule == ZB_H1 else "")
            + (", compiled blocks" if t.compile_blocks else "")
            + (f", priced as {self.engine} runs it" if self.engine != ENGINES[0] else "")
        ]
        for i, s in enumerate(self.stages):
            off = ", ".join(f"{k} {v:g}" for k, v in zip(OFFLOAD_KINDS, s.offload.as_tuple()) if v)
            chunks = f" (chunks {'+'.join(map(str, s.chunk_layers))})" if s.chunk_layers is not None else ""
            lines.append(
                f"  stage {i}: {s.layers} layers{chunks} on {s.nodes}×{s.gpus_per_node} GPUs, "
                f"b {s.micro_batch}, dp {s.dp}, tp {s.tp}, ZeRO-{s.zero}, "
                f"recompute {s.recompute_layers}"
                + _selective_text(s)
                + (f", offload {off}" if off else "")
                + (", sequence parallel" if s.sequence_parallel else "")
                + (f", cp {s.cp}" if s.cp > 1 else "")
            )
        return "\n".join(lines)


def _selective_text(s: StageStrategy) -> str:
    parts = [n for n, on in (("attention", s.recompute_attention), ("MLP activation", s.recompute_activation)) if on]
    return f" + {' and '.join(parts)} of the rest" if parts else ""


# ------------------------------------------------------------------ checks
def _int(what: str, v, minimum: int = 1) -> int:
    if not is_int(v):
        raise MistInputError(f"{what} must be an integer, got {v!r}.")
    if v < minimum:
        raise MistInputError(f"{what} must be at least {minimum}, got {v}.")
    return v


def check_plan(p: Plan) -> None:
    """Raise MistInputError unless the plan is complete and consistent: every field in range, the
    stages' batches, meshes and layers adding up to the model's and the cluster's."""
    if not p.stages:
        raise MistInputError("The plan has no stages.")
    if p.engine not in ENGINES:
        raise MistInputError(f"engine must be one of {', '.join(ENGINES)}, got {p.engine!r}.")
    _int("micro_batches", p.micro_batches)
    B = p.training.global_batch
    for i, s in enumerate(p.stages):
        where = f"Stage {i}"
        for f in ("layers", "nodes", "gpus_per_node", "micro_batch", "dp", "tp", "cp"):
            _int(f"{where} {f}", getattr(s, f))
        _int(f"{where} recompute_layers", s.recompute_layers, 0)
        for f in ("recompute_attention", "recompute_activation", "sequence_parallel"):
            if not isinstance(getattr(s, f), bool):
                raise MistInputError(f"{where} {f} must be true or false, got {getattr(s, f)!r}.")
        if not is_int(s.zero) or s.zero not in (0, 1, 2, 3):
            raise MistInputError(f"{where} zero must be 0, 1, 2 or 3, got {s.zero!r}.")
        if s.micro_batch * s.dp * p.micro_batches != B:
            raise MistInputError(
                f"{where}: micro_batch {s.micro_batch} × dp {s.dp} × micro_batches {p.micro_batches} "
                f"= {s.micro_batch * s.dp * p.micro_batches}, not the global batch {B}."
            )
        if s.dp * s.cp * s.tp != s.gpus:
            cp = f" × cp {s.cp}" if s.cp > 1 else ""
            raise MistInputError(
                f"{where}: dp {s.dp}{cp} × tp {s.tp} = {s.dp * s.cp * s.tp} does not equal its "
                f"{s.nodes}×{s.gpus_per_node} = {s.gpus} GPUs."
            )
        if s.recompute_layers > s.layers:
            raise MistInputError(f"{where}: recompute_layers {s.recompute_layers} exceeds its {s.layers} layers.")
        for k, v in zip(OFFLOAD_KINDS, s.offload.as_tuple()):
            if not is_number(v) or not 0.0 <= v <= 1.0:
                raise MistInputError(f"{where} offload.{k} must be a ratio in [0, 1], got {v!r}.")
        if p.model.num_heads % s.tp:
            raise MistInputError(f"{where}: tp {s.tp} does not divide the model's {p.model.num_heads} attention heads.")
        if s.sequence_parallel and s.tp == 1:
            raise MistInputError(f"{where}: sequence_parallel needs tp > 1 (it shards the sequence over the tp group).")
        if s.sequence_parallel and p.training.seq_len % s.tp:
            raise MistInputError(
                f"{where}: sequence_parallel needs tp {s.tp} to divide the sequence length {p.training.seq_len}."
            )
        if s.tp > s.gpus_per_node or s.gpus_per_node % s.tp:
            raise MistInputError(
                f"{where}: tp {s.tp} must divide its {s.gpus_per_node} GPUs per node "
                "(tensor parallelism does not cross a node)."
            )
        try:
            p.model.check_tp(s.tp)
        except MistInputError as e:
            raise MistInputError(f"{where}: {str(e)[0].lower()}{str(e)[1:]}") from None
        if s.gpus_per_node > p.cluster.gpus_per_node or s.nodes > p.cluster.nodes:
            raise MistInputError(
                f"{where}: its mesh {s.nodes}×{s.gpus_per_node} does not fit the cluster's "
                f"{p.cluster.nodes}×{p.cluster.gpus_per_node}."
            )
    p.model.check_seq_len(p.training.seq_len)
    p.model.check_attention(p.training.flash_attention)
    layers = sum(s.layers for s in p.stages)
    if layers != p.model.num_layers:
        raise MistInputError(f"The stages hold {layers} layers but the model has {p.model.num_layers}.")
    gpus = sum(s.gpus for s in p.stages)
    if gpus != p.cluster.world_size:
        raise MistInputError(f"The stages use {gpus} GPUs but the cluster has {p.cluster.world_size}.")
    _check_placement(p)
    _check_chunks(p)
    _check_context(p)
    _check_schedule(p)


def _check_schedule(p: Plan) -> None:
    """A known schedule; ZB-H1 only without interleaving and with strategies it can split
    (`rules.zero_bubble_order.zb_h1_problem`)."""
    if p.schedule not in SCHEDULES:
        raise MistInputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {p.schedule!r}.")
    if p.schedule != ZB_H1:
        return
    if p.virtual_stages > 1:
        raise MistInputError(f"The zb-h1 schedule does not interleave; the plan has virtual_stages {p.virtual_stages}.")
    for i, s in enumerate(p.stages):
        why = zb_h1_problem(
            s.zero,
            s.offload.weights,
            s.offload.activations,
            s.recompute_layers,
            s.recompute_attention,
            s.recompute_activation,
            s.sequence_parallel,
        )
        if why is not None:
            raise MistInputError(f"Stage {i} cannot run the zb-h1 schedule: it {why}.")


def _check_chunks(p: Plan) -> None:
    """Interleaved plans as Megatron-LM and torchtitan accept them: v ≥ 2 needs a pipeline, the
    micro-batches a multiple of its depth, and every stage v chunks of at least one block."""
    v = _int("virtual_stages", p.virtual_stages)
    S = p.num_stages
    if v > 1 and S < 2:
        raise MistInputError(f"virtual_stages {v} needs at least 2 pipeline stages; the plan has {S}.")
    if v > 1 and p.micro_batches % S:
        raise MistInputError(
            f"An interleaved plan (virtual_stages {v}) needs micro_batches a multiple of its {S} stages, "
            f"got {p.micro_batches}."
        )
    for i, s in enumerate(p.stages):
        if s.chunk_layers is None:
            if v > 1:
                raise MistInputError(f"Stage {i} needs chunk_layers: the blocks of each of its {v} chunks.")
            continue
        if not isinstance(s.chunk_layers, (list, tuple)) or len(s.chunk_layers) != v:
            raise MistInputError(
                f"Stage {i} chunk_layers must list {v} block counts (one per chunk), got {s.chunk_layers!r}."
            )
        for c, n in enumerate(s.chunk_layers):
            _int(f"Stage {i} chunk_layers[{c}]", n)
        if sum(s.chunk_layers) != s.layers:
            raise MistInputError(
                f"Stage {i}: its chunk_layers {list(s.chunk_layers)} add up to {sum(s.chunk_layers)}, "
                f"not its {s.layers} layers."
            )


def _check_context(p: Plan) -> None:
    """Context parallelism as the runtime runs it: one cp for every stage (neighbouring stages
    exchange each rank's positions with the rank of the same cp index), flash attention, the cp ×
    tp ranks of a replica inside one node, and 2·cp chunks of whole tp shards."""
    cps = {s.cp for s in p.stages}
    if len(cps) > 1:
        raise MistInputError(f"Every stage needs the same cp; the plan has {', '.join(map(str, sorted(cps)))}.")
    cp = cps.pop()
    if cp == 1:
        return
    t = p.training
    if not t.flash_attention:
        raise MistInputError(f"cp {cp} needs flash attention (context parallelism runs the fused kernel).")
    for i, s in enumerate(p.stages):
        split = 2 * cp * (s.tp if s.sequence_parallel else 1)
        if t.seq_len % split:
            raise MistInputError(
                f"Stage {i}: the sequence length {t.seq_len} does not split into {split} equal parts "
                f"(2·cp chunks{' of tp shards' if s.sequence_parallel else ''})."
            )
        if s.gpus_per_node % (s.cp * s.tp):
            raise MistInputError(
                f"Stage {i}: cp {s.cp} × tp {s.tp} must divide its {s.gpus_per_node} GPUs per node "
                "(a replica's context- and tensor-parallel ranks share a node)."
            )
        if s.recompute_attention:
            raise MistInputError(
                f"Stage {i}: recompute_attention does not apply under cp {cp} (it runs its own attention)."
            )


def _check_placement(p: Plan) -> None:
    """Stages take consecutive ranks, gpus_per_node of them per node (the runtime's layout): a
    stage on one node must not straddle two, and a stage on several nodes must own whole ones."""
    K, first = p.cluster.gpus_per_node, 0
    for i, s in enumerate(p.stages):
        last = first + s.gpus - 1
        if s.nodes == 1 and first // K != last // K:
            raise MistInputError(
                f"Stage {i}: its {s.gpus} GPUs (ranks {first}–{last}, stages take consecutive ranks) "
                f"straddle two nodes of {K} GPUs, but its mesh is 1×{s.gpus_per_node}."
            )
        if s.nodes > 1 and (s.gpus_per_node != K or first % K):
            raise MistInputError(
                f"Stage {i}: a mesh over {s.nodes} nodes must own whole nodes ({K} GPUs each, starting "
                f"at a node's first rank), but it is {s.nodes}×{s.gpus_per_node} from rank {first}."
            )
        first = last + 1


# ------------------------------------------------------------- loading
def _names(keys) -> str:
    """Keys for a message, sorted as text (a YAML file may give keys that are not strings)."""
    return ", ".join(sorted(map(str, keys)))


def _sub(d: dict, key: str, cls, where: str):
    if key not in d:
        raise MistInputError(f"{where} is missing field {key!r}.")
    v = d[key]
    if not isinstance(v, dict):
        raise MistInputError(f"{where} field {key!r} must be a mapping.")
    unknown = set(v) - set(cls.__dataclass_fields__)
    if unknown:
        raise MistInputError(f"{where} field {key!r} has unknown key(s) {_names(unknown)}.")
    try:
        return cls(**v)
    except TypeError as e:
        raise MistInputError(f"{where} field {key!r} is incomplete ({e}).") from None


def plan_from_dict(d: dict, source: str = "plan") -> Plan:
    if not isinstance(d, dict):
        raise MistInputError(f"{source} must hold a mapping at the top level.")
    unknown = set(d) - set(PLAN_FIELDS) - set(OPTIONAL_PLAN_FIELDS)
    if unknown:
        raise MistInputError(f"{source} has unknown field(s) {_names(unknown)}.")
    for k in PLAN_FIELDS:
        if k not in d:
            raise MistInputError(f"{source} is missing field {k!r}.")
    ref = None
    if isinstance(d["model"], str):
        ref = d["model"]
        model = load_model(ref)
    elif isinstance(d["model"], dict):
        model = load_model_dict(
            d["model"], source=f"{source} model", label=f"The model of {source[:1].lower() + source[1:]}"
        )
    else:
        raise MistInputError(f"{source} field 'model' must be a preset name, a path or a model mapping.")
    cluster = _sub(d, "cluster", ClusterSpec, source)
    training = _sub(d, "training", TrainingSpec, source)
    if not isinstance(d["stages"], list) or not d["stages"]:
        raise MistInputError(f"{source} field 'stages' must be a non-empty list.")
    stages = []
    for i, sd in enumerate(d["stages"]):
        where = f"{source} stage {i}"
        if not isinstance(sd, dict):
            raise MistInputError(f"{where} must be a mapping.")
        sd = dict(sd)
        off = sd.pop("offload", {})
        if not isinstance(off, dict) or set(off) - set(OFFLOAD_KINDS):
            raise MistInputError(f"{where} offload must map {', '.join(OFFLOAD_KINDS)} to ratios.")
        unknown = set(sd) - set(StageStrategy.__dataclass_fields__)
        if unknown:
            raise MistInputError(f"{where} has unknown field(s) {_names(unknown)}.")
        missing = [k for k in ("layers", "nodes", "gpus_per_node", "micro_batch", "dp", "tp") if k not in sd]
        if missing:
            raise MistInputError(f"{where} is missing field(s) {', '.join(missing)}.")
        if isinstance(sd.get("chunk_layers"), list):
            sd["chunk_layers"] = tuple(sd["chunk_layers"])
        stages.append(StageStrategy(**sd, offload=Offload(**off)))
    return Plan(
        model=model,
        cluster=cluster,
        training=training,
        micro_batches=d["micro_batches"],
        stages=tuple(stages),
        model_ref=ref,
        virtual_stages=d.get("virtual_stages", 1),
        schedule=d.get("schedule", SCHEDULES[0]),
        engine=d.get("engine", ENGINES[0]),
    )


def load_plan(path: str | Path) -> Plan:
    """A plan file (JSON, or YAML by its extension). Relative model and profile paths in it are
    taken from the plan's folder when the file is there (else from the current folder)."""
    text = read_user_text(path, "Plan file")
    path = Path(path)
    d = (
        parse_yaml(text, path, "Plan file")
        if path.suffix.lower() in YAML_SUFFIXES
        else parse_json(text, path, "Plan file")
    )
    if isinstance(d, dict):
        d = _beside(d, path.parent)
    return plan_from_dict(d, source=f"Plan file {path}")


def _beside(d: dict, folder: Path) -> dict:
    """`d` with its relative model-file and profile paths resolved against `folder` where they exist."""

    def near(ref):
        if not isinstance(ref, str) or not ref.strip() or Path(ref).expanduser().is_absolute():
            return ref
        there = folder / ref
        return str(there) if there.exists() else ref

    d = dict(d)
    if isinstance(d.get("model"), str) and d["model"].strip().lower() not in PRESETS:
        d["model"] = near(d["model"])
    if isinstance(d.get("cluster"), dict) and str(d["cluster"].get("gpu", "")).lower().endswith(".json"):
        d["cluster"] = dict(d["cluster"], gpu=near(d["cluster"]["gpu"]))
    return d
