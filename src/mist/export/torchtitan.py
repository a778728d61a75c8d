"""Export to torchtitan 0.3.0: a torchrun launch script of `--section.key` overrides, plus a
generated config module when the plan needs Python.

torchtitan 0.3.0 has no TOML: `python -m torchtitan.train --module M --config F` takes the
`Trainer.Config` that function `F` of module `M` returns, then applies tyro command-line overrides.
How a plan maps:

- model: only the llama family (torchtitan's `llama3`: RMSNorm, SwiGLU, full-width RoPE, GQA, no
  biases). A model matching a registry flavour (`llama3_8b`, `llama3_70b`, `llama3_405b`) is
  launched from it; any other llama is built by the generated module. torchtitan has no GPT-style
  (LayerNorm/GELU/learned positions) or Falcon (parallel block) decoder, so those are refused.
- mesh: one pipeline stage per rank group (`pipeline_parallel_degree` = stages, schedule 1F1B),
  one dp and tp for all stages; the layer split is always explicit
  (`module_fqns_per_model_part`), so uneven splits are exact.
- interleaved 1F1B (virtual_stages v ≥ 2): schedule `Interleaved1F1B` with pp·v model parts.
  torchtitan gives rank r the parts r, r + pp, r + 2·pp, … (its "loop" style), so part c·pp + r
  is chunk c of rank r, the order Mist lays chunks out; even or uneven chunks are exact. With G a
  multiple of pp (every interleaved plan) torch.distributed.pipelining runs its rounds of pp
  micro-batches, Megatron-LM's order, which Mist simulates. FSDP2 under it stays ZeRO-1 (every
  part's backward defers resharding and reduction to the last micro-batch, as below).
- ZB-H1 (`schedule: zb-h1`): torch.distributed.pipelining runs a schedule given as a CSV of
  actions per rank (`pipeline_parallel_schedule_csv`, `_PipelineScheduleRuntime`), with F, I
  (input gradient) and W (weight gradients) actions. The export writes Mist's ZB-H1 order
  (`rules.zero_bubble_order`, B as I) to `zb_h1_schedule.csv` beside the script; torch's own
  validation and comms simulation accept it (tests). Not run on GPUs yet. Not with compiled
  blocks: torch.distributed.pipelining splits a backward at the autograd graph's nodes, and a
  block torch.compile'd whole is one node, so its input-gradient step runs the block's whole
  compiled backward and its weight step runs it again (measured in tests/export); Mist's own
  runtime compiles B and W apart (`mist.models.weight_split`). Such a plan exports as 1F1B.
- context parallelism (cp > 1): `context_parallel_degree`, torchtitan's default "headtail" load
  balancer (rank r holds chunks r and 2·cp − 1 − r, Mist's layout) and torch's all-gather of K/V
  for SDPA, which is what Mist runs and prices. torchtitan then shards parameters with FSDP2 over
  dp × cp (`fsdp_enabled`), so a cp plan must shard: ZeRO-2/3 without a pipeline, ZeRO-1 under one.
- ZeRO: without a pipeline, 0 is replicated data parallelism (`data_parallel_replicate_degree`),
  2 and 3 are FSDP2 (`data_parallel_shard_degree`) without / with resharding after forward, and 1
  does not exist. Under a pipeline, torch.distributed.pipelining runs every micro-batch's backward
  but the last without resharding and without gradient reduction (`set_reshard_after_backward`,
  `set_requires_gradient_sync`), so FSDP2 keeps whole parameters and whole gradients through the
  step and reduce-scatters once: ZeRO-1. A pipeline plan with FSDP is therefore a ZeRO-1 plan
  (exported as `data_parallel_shard_degree` with torchtitan's default resharding), and ZeRO-2/3
  under a pipeline are refused.
- gradients: FSDP2 reduces in fp32 (`mixed_precision_reduce` has no other value) and replicated
  training keeps fp32 gradients under autocast, so plans need `grad_dtype: fp32` (what
  `runs_training` gives). torchtitan keeps fp32 parameters (`training.dtype float32`) cast to
  `mixed_precision_param` for compute; Mist costs its 16-bit working copy plus 12 optimizer bytes,
  2 bytes per parameter more than torchtitan holds (conservative).
- batches: `pipeline_parallel_microbatch_size` = micro-batch, `local_batch_size` = micro-batch ×
  micro-batches under a pipeline (torchtitan splits it into pipeline micro-batches) and the
  micro-batch alone without one (torchtitan accumulates global / (local × dp) steps).
- recompute: none, all blocks (`activation-checkpoint:full`) or, per stage, the last N blocks
  (of each chunk with interleaving, as Mist spreads them) (a generated `FullAC` subclass keyed by
  layer id). Mist's attention-core / MLP-activation
  recompute has no torchtitan equivalent (its selective mode is a per-op policy).
- offload: `training.enable_cpu_offload` moves all weights, gradients and optimizer state, so only
  all-or-nothing plans without activation offload are exact, and only without a pipeline (under
  one the whole parameters and gradients stay on the GPU through the step, which Mist's offload
  does not describe).
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from mist.errors import MistInputError
from mist.export.common import (
    PLACEHOLDER,
    one_f_one_b,
    schedule_problems,
    sequence_parallel_problems,
    uniform_mesh_problems,
    with_stages,
)
from mist.export.records import Export, NotExpressible
from mist.export.torchtitan_module import CONFIG_NAME, MODULE_NAME, module_text
from mist.plan import Offload, Plan, StageStrategy
from mist.rules.interleaved_order import chunk_first_layers, chunk_recompute
from mist.rules.zero_bubble_order import INPUT_GRAD, ZB_H1, zb_h1
from mist.specs.model import ModelSpec
from mist.specs.training import TrainingSpec

NAME = "torchtitan"
SCRIPT = "run_torchtitan.sh"
SCHEDULE = "1F1B"
INTERLEAVED_SCHEDULE = "Interleaved1F1B"
ZB_CSV = "zb_h1_schedule.csv"  # the ZB-H1 order as torch.distributed.pipelining's actions
_TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Flavour:
    """A llama3 model in torchtitan's registry, and the config function that launches it."""

    config: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256


LLAMA3_ROPE_THETA = 500000.0  # the rotary base of torchtitan's llama3 flavours

# torchtitan 0.3.0's llama3 flavours that have a config_registry function (untied head, eps 1e-5)
REGISTRY = (
    Flavour("llama3_8b", 32, 4096, 32, 8, 14336),
    Flavour("llama3_70b", 80, 8192, 64, 8, 28672),
    Flavour("llama3_405b", 126, 16384, 128, 8, 53248),
)


# ------------------------------------------------------------------ problems
def problems(plan: Plan) -> list[str]:
    """One sentence per knob of `plan` that torchtitan 0.3.0 cannot express."""
    out = _model_problems(plan.model) + _unfixable_problems(plan)
    out += uniform_mesh_problems(plan, NAME) + sequence_parallel_problems(plan, NAME, always=True)
    if plan.num_stages == 1:  # (a ZB-H1 plan of one stage is 1F1B's accumulation)
        out += schedule_problems(plan, NAME)
    elif plan.schedule == ZB_H1 and plan.training.compile_blocks:
        out.append(
            "its zb-h1 schedule with compiled blocks: torch.distributed.pipelining splits a backward at the "
            "autograd graph's nodes, and a block torch.compile'd whole is one node, whose whole backward its "
            "weight step would run a second time"
        )
    out += _zero_problems(plan) + _recompute_problems(plan) + _offload_problems(plan) + _dtype_problems(plan)
    return out


def runs_training(t: TrainingSpec) -> TrainingSpec:
    """The training as torchtitan 0.3 runs it: fp32 gradients with 16-bit parameters (see above)."""
    return replace(t, grad_dtype="fp32") if t.param_dtype != "fp32" else t


def _model_problems(m: ModelSpec) -> list[str]:
    if m.family != "llama":
        return [
            f"the model is a {m.family} model, and torchtitan's only dense decoder is llama3 (it has no "
            "GPT-style LayerNorm/GELU/learned-position decoder and no Falcon parallel block)"
        ]
    out = []
    if m.bias:
        out.append("the model has linear biases (bias true), which torchtitan's llama3 does not")
    if m.rotary_fraction != 1.0:
        out.append(
            f"the model rotates {m.rotary_fraction:.0%} of each head's dimensions (rotary_fraction "
            f"{m.rotary_fraction:g}), and torchtitan's llama3 rotates all of them"
        )
    if m.has_dropout:
        out.append(
            f"the model trains with dropout (attention_dropout {m.attention_dropout:g}, hidden_dropout "
            f"{m.hidden_dropout:g}), and torchtitan's llama3 has none"
        )
    return out


def _unfixable_problems(plan: Plan) -> list[str]:
    """Problems `nearest` cannot approximate away (they are the model's or the cluster's)."""
    out, s0, m = [], plan.stages[0], plan.model
    for i, s in enumerate(plan.stages[1:], start=1):
        if s.gpus != s0.gpus:
            out.append(
                f"stage {i} has {s.gpus} GPUs but stage 0 has {s0.gpus}, and torchtitan gives every "
                "pipeline stage the same GPUs"
            )
    tps = sorted({s.tp for s in plan.stages})
    for tp in tps:
        if m.num_kv_heads % tp:
            out.append(f"tp {tp} does not divide the model's {m.num_kv_heads} KV heads, which torchtitan shards")
        if plan.training.seq_len % tp:
            out.append(
                f"tp {tp} does not divide seq_len {plan.training.seq_len}, which torchtitan's sequence parallelism splits"
            )
    if m.tie_embeddings and plan.num_stages > 1:
        out.append("the model ties its embedding and head (tie_embeddings), which torchtitan refuses under a pipeline")
    return out


def _zero_problems(plan: Plan) -> list[str]:
    out: list[str] = []
    s0 = plan.stages[0]
    if s0.dp == 1 and s0.cp == 1:
        return out  # ZeRO does nothing without data parallelism
    if s0.cp > 1 and s0.zero == 0:
        out.append(
            f"stage 0 has cp {s0.cp} without ZeRO, and torchtitan shards the parameters with FSDP2 over the "
            "context-parallel ranks (plan with zero 2 or 3, or zero 1 under a pipeline)"
        )
    for i, s in enumerate(plan.stages):
        if s.zero == 1 and plan.num_stages == 1:
            out.append(
                f"stage {i} uses ZeRO-1 (zero 1), and torchtitan has replicated (ZeRO-0) or FSDP2 (ZeRO-2/3) data "
                "parallelism only (FSDP2 is ZeRO-1 only under a pipeline)"
            )
        if s.zero >= 2 and plan.num_stages > 1:
            out.append(
                f"stage {i} uses ZeRO-{s.zero} (zero {s.zero}) under a pipeline, and torchtitan's FSDP2 under "
                "torch.distributed.pipelining keeps whole parameters and gradients until the last micro-batch's "
                "backward (ZeRO-1: plan with zero 1)"
            )
        if s.zero != plan.stages[0].zero:
            out.append(f"stage {i} has zero {s.zero} but stage 0 has {plan.stages[0].zero}, and torchtitan runs one")
    return out


def _recompute_problems(plan: Plan) -> list[str]:
    out = []
    for i, s in enumerate(plan.stages):
        if s.recompute_layers == s.layers:
            continue  # nothing left for selective recompute
        for knob, what in (("recompute_attention", "attention core"), ("recompute_activation", "MLP activation")):
            if getattr(s, knob):
                out.append(
                    f"stage {i} recomputes the {what} of its other blocks ({knob}), which torchtitan cannot "
                    "select (its selective checkpointing is a per-op policy)"
                )
    return out


def _offload_on(s: StageStrategy) -> bool | None:
    """True when the stage offloads all weights, gradients and optimizer state, False when none,
    None for anything in between."""
    wgo = (s.offload.weights, s.offload.grads, s.offload.optimizer)
    return True if wgo == (1.0, 1.0, 1.0) else False if wgo == (0.0, 0.0, 0.0) else None


def _offload_problems(plan: Plan) -> list[str]:
    out = []
    for i, s in enumerate(plan.stages):
        if s.offload.activations:
            out.append(
                f"stage {i} offloads {s.offload.activations:.0%} of its activations (offload.activations "
                f"{s.offload.activations:g}), which torchtitan cannot"
            )
        if _offload_on(s) is None:
            kinds = ", ".join(f"offload.{k} {getattr(s.offload, k):g}" for k in ("weights", "grads", "optimizer"))
            out.append(
                f"stage {i} offloads part of its state ({kinds}), and torchtitan's CPU offload moves all "
                "weights, gradients and optimizer state or none"
            )
        elif _offload_on(s) != _offload_on(plan.stages[0]):
            out.append(f"stage {i} and stage 0 differ in CPU offload, and torchtitan offloads every stage or none")
        elif _offload_on(s) and plan.num_stages > 1:
            out.append(
                f"stage {i} offloads all its state under a pipeline, and torchtitan's CPU offload then keeps whole "
                "parameters and gradients on the GPU through the step, which Mist does not cost"
            )
    return out


def _dtype_problems(plan: Plan) -> list[str]:
    t = plan.training
    out = [
        f"the plan trains with {getattr(t, f)} ({f}), and torchtitan's mixed precision is bf16 or fp32"
        for f in ("param_dtype", "compute_dtype")
        if getattr(t, f) not in _TORCH_DTYPE
    ]
    if not out and runs_training(t) != t:
        out.append(
            f"the plan keeps {t.param_dtype} gradients (training.grad_dtype), and torchtitan reduces and keeps "
            "gradients in fp32 (plan with grad_dtype fp32)"
        )
    return out


# ------------------------------------------------------------------ nearest
def nearest(plan: Plan) -> Plan:
    """The closest plan torchtitan runs: same model (rotating all head dimensions, no dropout), GPUs, global batch and layer split, with one
    dp/tp/micro-batch (the most common among stages), fp32 gradients, one ZeRO level (the highest;
    without a pipeline ZeRO-1 raised to ZeRO-2, under one ZeRO-2/3 lowered to the ZeRO-1 that FSDP2
    runs there), selective recompute turned into recompute of the stage's blocks (memory-safe),
    activation offload dropped and CPU offload rounded to all (some stage offloads at least half
    of a state) or nothing; none under a pipeline. Lowering ZeRO and dropping offload can make
    the plan not fit: the CLI prints the prediction of both plans."""
    if plan.model.family == "llama" and plan.model.rotary_fraction != 1.0:  # costs the same
        plan = replace(plan, model=replace(plan.model, rotary_fraction=1.0), model_ref=None)
    if plan.model.family == "llama" and plan.model.has_dropout:  # keeps fewer masks: costs a little less
        plan = replace(plan, model=replace(plan.model, attention_dropout=0.0, hidden_dropout=0.0), model_ref=None)
    unfixable = _model_problems(plan.model) + _unfixable_problems(plan)
    if unfixable:
        raise NotExpressible(f"torchtitan cannot run this plan or any near it: {unfixable[0]}.")
    t = plan.training
    if t.param_dtype not in _TORCH_DTYPE or t.compute_dtype not in _TORCH_DTYPE:
        t = replace(t, param_dtype="bf16", compute_dtype="bf16", grad_dtype=None)
    schedule = plan.schedule
    plan = one_f_one_b(replace(plan, training=runs_training(t)))
    dp, tp, mb = Counter((s.dp, s.tp, s.micro_batch) for s in plan.stages).most_common(1)[0][0]
    pipeline = plan.num_stages > 1
    zero = _nearest_zero(plan.stages, pipeline)
    if plan.stages[0].cp > 1 and zero == 0:  # FSDP2 over the context-parallel ranks
        zero = 1 if pipeline else 2
    offload = Offload() if pipeline else _nearest_offload(plan.stages)
    stages = [_nearest_stage(s, dp, tp, mb, zero, offload) for s in plan.stages]
    near = with_stages(plan, stages)
    # kept where the nearest stages can still split B from W (and the blocks are not compiled whole)
    if schedule == ZB_H1 and pipeline and not plan.training.compile_blocks:
        try:
            return replace(near, schedule=ZB_H1)
        except MistInputError:
            pass
    return near


def _nearest_zero(stages: tuple[StageStrategy, ...], pipeline: bool) -> int:
    top = max(s.zero for s in stages)
    if pipeline:  # FSDP2 under a pipeline is ZeRO-1
        return min(top, 1)
    return 2 if top == 1 else top


def _nearest_offload(stages: tuple[StageStrategy, ...]) -> Offload:
    most = max(max(s.offload.weights, s.offload.grads, s.offload.optimizer) for s in stages)
    return Offload(1.0, 1.0, 1.0, 0.0) if most >= 0.5 else Offload()


def _nearest_stage(s: StageStrategy, dp: int, tp: int, mb: int, zero: int, offload: Offload) -> StageStrategy:
    selective = s.recompute_layers < s.layers and (s.recompute_attention or s.recompute_activation)
    return replace(
        s,
        dp=dp,
        tp=tp,
        micro_batch=mb,
        zero=zero,
        offload=offload,
        recompute_layers=s.layers if selective else s.recompute_layers,
        recompute_attention=False,
        recompute_activation=False,
        sequence_parallel=tp > 1,
    )


# ------------------------------------------------------------------ what is written
def registry_flavour(m: ModelSpec) -> Flavour | None:
    """The registry flavour whose dimensions are the model's, if any."""
    for f in REGISTRY:
        dims = (f.layers, f.hidden, f.heads, f.kv_heads, f.ffn, f.vocab)
        mine = (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size)
        if dims == mine and not m.tie_embeddings and m.norm_eps == 1e-5 and m.rope_theta == LLAMA3_ROPE_THETA:
            return f
    return None


def recomputed_layers(plan: Plan) -> list[list[int]]:
    """Global ids of the blocks each stage recomputes whole, in increasing order: the last
    `recompute_layers` of the stage, or with interleaving the last ones of each chunk as Mist
    spreads them (`chunk_recompute`)."""
    firsts = chunk_first_layers([s.chunks() for s in plan.stages])
    out = []
    for s, first in zip(plan.stages, firsts):
        ids: list[int] = []
        for f, n, k in zip(first, s.chunks(), chunk_recompute(s.recompute_layers, s.chunks())):
            ids += range(f + n - k, f + n)
        out.append(ids)
    return out


def ac_mode(plan: Plan) -> str:
    """`none`, `full`, or `blocks` (some blocks only: the generated policy)."""
    if all(s.recompute_layers == 0 for s in plan.stages):
        return "none"
    if all(s.recompute_layers == s.layers for s in plan.stages):
        return "full"
    return "blocks"


def module_fqns(plan: Plan) -> list[list[str]]:
    """The modules of each model part, pp·v of them in model order (part c·pp + r is chunk c of
    stage r, the part torchtitan's loop style gives rank r): the first holds the embedding, the
    last the norm and head."""
    parts, first = [], 0
    for c in range(plan.virtual_stages):
        for s in plan.stages:
            parts.append([f"layers.{j}" for j in range(first, first + s.chunks()[c])])
            first += s.chunks()[c]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "lm_head"]
    return parts


def args(plan: Plan) -> list[str]:
    """The arguments of `torchtitan.train` for the plan (exactly as the launch script passes them)."""
    flavour, mode = registry_flavour(plan.model), ac_mode(plan)
    if flavour is not None and mode != "blocks":
        out = ["--module", "llama3", "--config", flavour.config]
    else:
        out = ["--module", MODULE_NAME, "--config", CONFIG_NAME]
    out += _parallel_args(plan) + _training_args(plan)
    out += ["--hf_assets_path", PLACEHOLDER, "--dataloader.dataset", PLACEHOLDER]
    if mode != "blocks":  # a tyro subcommand: last, as torchtitan's own examples pass it
        out.append(f"activation-checkpoint:{mode}")
    return out


def _parallel_args(plan: Plan) -> list[str]:
    s0, pp = plan.stages[0], plan.num_stages
    sharded = s0.dp * s0.cp > 1 and s0.zero >= 1  # ZeRO-1 only under a pipeline (problems)
    out = [
        "--parallelism.data_parallel_replicate_degree",
        str(1 if sharded else s0.dp),
        "--parallelism.data_parallel_shard_degree",
        str(s0.dp if sharded else 1),
        "--parallelism.tensor_parallel_degree",
        str(s0.tp),
        "--parallelism.context_parallel_degree",
        str(s0.cp),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
    ]
    if sharded and pp == 1:  # under a pipeline torchtitan's default (no resharding) is what runs
        out += ["--parallelism.fsdp_reshard_after_forward", "always" if s0.zero == 3 else "never"]
    if pp > 1:
        schedule = SCHEDULE if plan.virtual_stages == 1 else INTERLEAVED_SCHEDULE
        out += ["--parallelism.pipeline_parallel_schedule", schedule]
        out += ["--parallelism.pipeline_parallel_microbatch_size", str(s0.micro_batch)]
        out += ["--parallelism.module_fqns_per_model_part"] + [",".join(p) for p in module_fqns(plan)]
        if plan.schedule == ZB_H1:  # the script passes it as a path beside itself
            out += ["--parallelism.pipeline_parallel_schedule_csv", ZB_CSV]
    return out


def zb_h1_csv(plan: Plan) -> str:
    """The ZB-H1 order of every rank (one stage each) as torch.distributed.pipelining's
    compute-only CSV: a row per rank of `{stage}{F|I|W}{micro-batch}` actions."""
    S, G = plan.num_stages, plan.micro_batches
    rows = []
    for i in range(S):
        rows.append(",".join(f"{i}{'I' if k == INPUT_GRAD else k}{g}" for k, g in zb_h1(i, S, G)))
    return "\n".join(rows) + "\n"


def _training_args(plan: Plan) -> list[str]:
    s0, t = plan.stages[0], plan.training
    local = s0.micro_batch * plan.micro_batches if plan.num_stages > 1 else s0.micro_batch
    out = [
        "--training.local_batch_size",
        str(local),
        "--training.global_batch_size",
        str(t.global_batch),
        "--training.seq_len",
        str(t.seq_len),
        "--training.mixed_precision_param",
        _TORCH_DTYPE[t.compute_dtype],
        "--training.dtype",
        "float32",
    ]
    if plan.num_stages > 1:
        out.append("--training.disable_cuda_graphs")  # torchtitan refuses CUDA graphs under a pipeline
    if t.compile_blocks:  # torchtitan compiles each decoder block on its own, as Mist does (not its loss)
        out += ["--compile.enable", "--compile.components", "model"]
    if _offload_on(s0):
        out.append("--training.enable_cpu_offload")
    return out


def write(plan: Plan, out_dir: Path) -> Export:
    """Write `run_torchtitan.sh` (and `mist_torchtitan_plan.py` where needed) into `out_dir`."""
    refuse_if_needed(plan)
    a = args(plan)
    files = [SCRIPT]
    if a[1] == MODULE_NAME:
        model = None if registry_flavour(plan.model) else plan.model
        recomputed = recomputed_layers(plan) if ac_mode(plan) == "blocks" else None
        (out_dir / f"{MODULE_NAME}.py").write_text(module_text(model, plan.training.seq_len, recomputed))
        files.append(f"{MODULE_NAME}.py")
    if plan.schedule == ZB_H1 and plan.num_stages > 1:
        (out_dir / ZB_CSV).write_text(zb_h1_csv(plan))
        files.append(ZB_CSV)
    env = {"NNODES": str(plan.cluster.nodes), "NPROC_PER_NODE": str(plan.cluster.gpus_per_node)}
    script = out_dir / SCRIPT
    script.write_text(script_text(plan, a, env))
    script.chmod(0o755)
    return Export(target=NAME, files=tuple(files), env=env, args=tuple(a))


def refuse_if_needed(plan: Plan) -> None:
    found = problems(plan)
    if found:
        raise NotExpressible(f"torchtitan cannot run this plan: {found[0]}.")


def script_text(plan: Plan, a: list[str], env: dict[str, str]) -> str:
    """The launch script: torchrun on every node, `-m torchtitan.train` with the plan's overrides."""
    summary = "\n".join(f"#   {line}" for line in plan.summary().splitlines())
    lines = _arg_lines(a).replace(shlex.quote(ZB_CSV), f'"$HERE/{ZB_CSV}"')
    return f"""#!/usr/bin/env bash
# torchtitan 0.3.0 launch for a Mist plan (written by `mist export --to torchtitan`).
{summary}
# Replace every {PLACEHOLDER} below (tokenizer / HF assets folder, dataset) before launching.
# On each of the NNODES nodes run: NODE_RANK=<n> MASTER_ADDR=<node 0> ./{SCRIPT}
# Extra arguments are appended after the plan's (e.g. --training.steps 100).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
export PYTHONPATH="$HERE${{PYTHONPATH:+:$PYTHONPATH}}"  # finds {MODULE_NAME}.py when written
NNODES=${{NNODES:-{env["NNODES"]}}}
NPROC_PER_NODE=${{NPROC_PER_NODE:-{env["NPROC_PER_NODE"]}}}
NODE_RANK=${{NODE_RANK:-0}}
MASTER_ADDR=${{MASTER_ADDR:-localhost}}
MASTER_PORT=${{MASTER_PORT:-29500}}

TORCHTITAN_ARGS=(
{lines}
)

torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" \\
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \\
    --local-ranks-filter 0 --role rank --tee 3 \\
    -m torchtitan.train "${{TORCHTITAN_ARGS[@]}}" "$@"
"""


def _arg_lines(a: list[str]) -> str:
    """One flag per line with its values, each word shell-quoted."""
    groups: list[list[str]] = []
    for word in a:
        if word.startswith("--") or word.startswith("activation-checkpoint:") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return "\n".join("    " + " ".join(shlex.quote(w) for w in g) for g in groups)
