"""Export to DeepSpeed 0.19: `ds_config.json`, a launch script, and the Python the JSON cannot carry.

What maps where:
- the batch: `train_batch_size` = global batch, `train_micro_batch_size_per_gpu` = the stages'
  micro-batch, `gradient_accumulation_steps` = G (the pipeline engine runs G micro-batches);
  the data-parallel world DeepSpeed derives is the plan's dp.
- precision: `bf16` / `fp16` sections from the parameter dtype (fp32 parameters with a 16-bit
  compute dtype use `torch_autocast`), `data_types.grad_accum_dtype` for fp32 gradients.
- ZeRO: one `zero_optimization.stage` for the whole run; the pipeline engine allows ZeRO 0 or 1.
  ZeRO 1–3 carry `reduce_bucket_size` (DeepSpeed's default, written out): the size of the
  gradient staging buffer DeepSpeed holds (through every backward under ZeRO 1/2, for the whole
  run under ZeRO-3), which a plan with `engine: deepspeed` is priced with
  (`mist.rules.deepspeed_buffers`). ZeRO-3 also carries the `stage3_*` knobs with which
  DeepSpeed gathers parameters as Mist's runtime does and the plan is priced (at most a block
  and the next one gathered, released after use, each into its own buffer; its defaults keep up
  to 10^9 parameters gathered).
- offload: `offload_optimizer` (it takes the fp32 gradients with the optimizer states, so
  Mist's gradient and optimizer fractions must be equal); a fraction below 1 needs ZeRO-3 and is
  applied to whole optimizer sub-groups, so the export sizes `sub_group_size` to cut each
  rank's partition into eighths (Mist's grid). `offload_param` (weights) is ZeRO-3 only and all
  or nothing. Activation offload is refused (DeepSpeed's `cpu_checkpointing` moves checkpointed
  inputs only, not a fraction of the activations).
- layers per stage and recomputed blocks: no ds_config key; `mist_deepspeed.py` carries them
  (a `PipelineModule` subclass with the plan's boundaries, and a wrapper that recomputes the
  last N blocks of each stage with `deepspeed.checkpointing`).
- tensor parallelism: AutoTP (`tensor_parallel.autotp_size`) on one-stage plans only; the
  pipeline engine has no tensor parallelism without model code of its own.
- selective recomputation (attention core, MLP activation) is model code: refused.
- interleaved 1F1B: the pipeline engine has no interleaved schedule: refused (`--approximate`
  exports the plan as plain 1F1B).
- fp32 gradients with 16-bit parameters need ZeRO ≥ 1 (DeepSpeed's engine rejects them with
  ZeRO-0): refused (`--approximate` exports ZeRO-1).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from mist.export.common import (
    PLACEHOLDER,
    compile_problems,
    eager_blocks,
    plain_pipeline,
    refuse,
    schedule_problems,
    uniform_mesh_problems,
)
from mist.export.deepspeed_files import helper_module, launch_script
from mist.export.records import Export, NotExpressible
from mist.plan import Offload, Plan, StageStrategy
from mist.rules.deepspeed_buffers import REDUCE_BUCKET_ELEMENTS, zero3_gathering

NAME = "DeepSpeed"
OFFLOAD_STEPS = 8  # optimizer sub-groups per rank: partial optimizer offload in eighths
CONFIG_FILE, LAUNCH_FILE, HELPER_FILE = "ds_config.json", "launch.sh", "mist_deepspeed.py"
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


# ------------------------------------------------------------------ what DeepSpeed cannot run
def problems(plan: Plan) -> list[str]:
    """One sentence per knob DeepSpeed cannot express, naming the stage; [] if exportable."""
    out = _interleaving_problems(plan) + uniform_mesh_problems(plan, NAME) + schedule_problems(plan, NAME)
    out += _precision_problems(plan)
    out += compile_problems(plan, NAME)
    for i, s in enumerate(plan.stages):
        out += _pipeline_problems(plan, i, s) + _recompute_problems(i, s) + _offload_problems(i, s)
        out += _sequence_parallel_problems(i, s)
        out += _global_knob_problems(plan, i, s)
    return out


def _interleaving_problems(plan: Plan) -> list[str]:
    """DeepSpeed's pipeline engine runs one contiguous block of layers per rank (`TrainSchedule`,
    plain 1F1B): it has no interleaved schedule."""
    v = plan.virtual_stages
    if v == 1:
        return []
    return [
        f"its interleaved 1F1B (virtual_stages {v}) has no DeepSpeed equivalent (its pipeline engine runs one "
        "contiguous block of layers per stage with plain 1F1B)"
    ]


def _pipeline_problems(plan: Plan, i: int, s: StageStrategy) -> list[str]:
    if plan.num_stages == 1:
        return _autotp_problems(plan, s)
    out = []
    if s.zero >= 2:
        out.append(f"stage {i} uses ZeRO-{s.zero} (zero {s.zero}), but DeepSpeed's pipeline engine allows ZeRO 0 or 1")
    if s.tp > 1:
        out.append(
            f"stage {i} has tp {s.tp}, but DeepSpeed's pipeline engine has no tensor parallelism without model "
            "code of its own (AutoTP shards one-stage models only)"
        )
    return out


def _sequence_parallel_problems(i: int, s: StageStrategy) -> list[str]:
    out = []
    if s.sequence_parallel:
        out.append(f"stage {i} uses sequence parallelism, which DeepSpeed's AutoTP does not have")
    if s.cp > 1:
        out.append(
            f"stage {i} has cp {s.cp}: DeepSpeed's sequence parallelism (Ulysses) splits attention heads "
            "with all-to-all, not Mist's context parallelism"
        )
    return out


def _autotp_problems(plan: Plan, s: StageStrategy) -> list[str]:
    """AutoTP shards attention by key-value heads: ranks past their count hold no attention
    shard (DeepSpeed only warns), which is not the plan Mist costed."""
    kv = plan.model.num_kv_heads
    if s.tp > kv:
        return [
            f"stage 0 has tp {s.tp} but the model has {kv} key-value heads, and DeepSpeed's AutoTP leaves the "
            "ranks past the head count without attention work"
        ]
    return []


def _recompute_problems(i: int, s: StageStrategy) -> list[str]:
    out = []
    for knob, what in (("recompute_attention", "attention core"), ("recompute_activation", "MLP activation")):
        if getattr(s, knob):
            out.append(
                f"stage {i} recomputes the {what} of its other blocks ({knob}), which DeepSpeed leaves to model code"
            )
    return out


def _offload_problems(i: int, s: StageStrategy) -> list[str]:
    o, g, w, a = s.offload.optimizer, s.offload.grads, s.offload.weights, s.offload.activations
    out = []
    if a > 0:
        out.append(f"stage {i} offloads {a:.0%} of its activations (offload.activations {a:g}), which DeepSpeed cannot")
    if w > 0 and s.zero < 3:
        out.append(
            f"stage {i} offloads weights (offload.weights {w:g}) with ZeRO-{s.zero}; DeepSpeed needs ZeRO-3 for it"
        )
    elif 0 < w < 1:
        out.append(f"stage {i} offloads {w:.0%} of its weights (offload.weights {w:g}); DeepSpeed offloads all or none")
    if g != o:
        out.append(
            f"stage {i} offloads {g:g} of its gradients but {o:g} of its optimizer states (offload.grads, "
            "offload.optimizer); DeepSpeed offloads gradients together with the optimizer states"
        )
    if o > 0 and s.zero == 0:
        out.append(
            f"stage {i} offloads optimizer states (offload.optimizer {o:g}) with ZeRO-0; DeepSpeed needs ZeRO ≥ 1"
        )
    elif 0 < o < 1 and s.zero < 3:
        out.append(
            f"stage {i} offloads {o:.0%} of its optimizer states (offload.optimizer {o:g}) with ZeRO-{s.zero}; "
            "DeepSpeed offloads part of them with ZeRO-3 only"
        )
    elif not _on_grid(o):
        out.append(
            f"stage {i} offloads {o:g} of its optimizer states (offload.optimizer); DeepSpeed offloads whole "
            f"sub-groups, which this export sizes to 1/{OFFLOAD_STEPS} of a rank's share"
        )
    return out


def _precision_problems(plan: Plan) -> list[str]:
    """Without ZeRO, DeepSpeed accumulates gradients in the parameters' dtype only: its engine
    rejects 16-bit parameters with `data_types.grad_accum_dtype` fp32 ("unsupported mix")."""
    t, s0 = plan.training, plan.stages[0]
    if s0.zero == 0 and t.grad_dtype == "fp32" and t.param_dtype != "fp32":
        return [
            f"stage 0 uses ZeRO-0 with fp32 gradients for {t.param_dtype} parameters (training.grad_dtype), "
            f"which {NAME} accumulates only with ZeRO 1 or more"
        ]
    return []


def _global_knob_problems(plan: Plan, i: int, s: StageStrategy) -> list[str]:
    """ZeRO and offload are one setting for the whole run in DeepSpeed."""
    if i == 0:
        return []
    s0, out = plan.stages[0], []
    if s.zero != s0.zero:
        out.append(f"stage {i} uses ZeRO-{s.zero} but stage 0 ZeRO-{s0.zero}, and {NAME} runs one ZeRO stage (zero)")
    for kind in ("weights", "optimizer"):
        v, v0 = getattr(s.offload, kind), getattr(s0.offload, kind)
        if v != v0:
            out.append(
                f"stage {i} offloads {v:g} of its {kind} but stage 0 {v0:g} (offload.{kind}), and {NAME} "
                "offloads the same share on every stage"
            )
    return out


def _on_grid(x: float) -> bool:
    return math.isclose(x * OFFLOAD_STEPS, round(x * OFFLOAD_STEPS), abs_tol=1e-9)


# ------------------------------------------------------------------ the nearest runnable plan
def nearest(plan: Plan) -> Plan:
    """The closest plan DeepSpeed runs: one mesh and micro-batch (same GPUs and global batch),
    then the most memory-saving of the stages' ZeRO and offload settings, rounded up to what
    DeepSpeed can express; selective recomputation, activation offload and compiled blocks are
    dropped."""
    plan = eager_blocks(plain_pipeline(plan))
    pp = plan.num_stages
    tp, dp, mb, G = _uniform_mesh(plan)
    zero = min(max(s.zero for s in plan.stages), 1 if pp > 1 else 3)
    w = max(s.offload.weights for s in plan.stages)
    o = max(max(s.offload.optimizer, s.offload.grads) for s in plan.stages)
    if w > 0 and zero < 3 and pp == 1:
        zero = 3
    w = 1.0 if w > 0 and zero == 3 else 0.0
    o = math.ceil(o * OFFLOAD_STEPS - 1e-9) / OFFLOAD_STEPS
    if 0 < o < 1 and zero < 3:
        o = 1.0
    if o > 0 and zero == 0:
        zero = 1
    if zero == 0 and _precision_problems(plan):  # fp32 gradients need ZeRO (see there)
        zero = 1
    offload = Offload(weights=w, grads=o, optimizer=o, activations=0.0)
    stages = [
        replace(
            s,
            dp=dp,
            tp=tp,
            micro_batch=mb,
            zero=zero,
            offload=offload,
            recompute_attention=False,
            recompute_activation=False,
            sequence_parallel=False,
            cp=1,
        )
        for s in plan.stages
    ]
    out = replace(plan, micro_batches=G, stages=tuple(stages))
    left = problems(out)
    if left:
        raise NotExpressible(f"{NAME} cannot run any plan close to this one: {left[0]}.")
    return out


def _uniform_mesh(plan: Plan) -> tuple[int, int, int, int]:
    """(tp, dp, micro-batch, G) for every stage: stage 0's where DeepSpeed can run them, keeping
    each stage's GPUs and the global batch."""
    s0, B = plan.stages[0], plan.training.global_batch
    if any(s.gpus != s0.gpus for s in plan.stages):
        raise NotExpressible(
            f"{NAME} cannot run this plan: its stages use different numbers of GPUs "
            f"({', '.join(str(s.gpus) for s in plan.stages)}), and {NAME} runs one data-parallel size for the "
            "whole pipeline."
        )
    kv = plan.model.num_kv_heads
    tp = 1 if plan.num_stages > 1 else max(d for d in range(1, s0.tp + 1) if s0.tp % d == 0 and d <= kv)
    dp = s0.gpus // tp
    if B % dp:
        raise NotExpressible(f"{NAME} cannot run this plan: its global batch {B} does not split over dp {dp}.")
    per_rank = B // dp
    if tp == s0.tp and s0.micro_batch * plan.micro_batches == per_rank:
        return tp, dp, s0.micro_batch, plan.micro_batches
    G = plan.micro_batches if per_rank % plan.micro_batches == 0 else per_rank
    return tp, dp, per_rank // G, G


# ------------------------------------------------------------------ ds_config.json
def ds_config(plan: Plan) -> dict:
    """The ds_config document of an exportable plan (only keys DeepSpeed's config class reads)."""
    s = plan.stages[0]
    t = plan.training
    cfg: dict = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": plan.micro_batches,
        "steps_per_print": 10,
        "gradient_clipping": 1.0,
        # AdamW: Mist prices Adam's two fp32 moments; with offload DeepSpeed runs its CPU Adam
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    }
    cfg.update(_precision(plan))
    cfg["zero_optimization"] = _zero_section(plan)
    if any(st.recompute_layers for st in plan.stages):
        cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False}
    if s.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": s.tp}
    return cfg


def _precision(plan: Plan) -> dict:
    t = plan.training
    out: dict[str, dict] = {}
    if t.param_dtype in TORCH_DTYPES:
        out[t.param_dtype] = {"enabled": True}
    elif t.compute_dtype in TORCH_DTYPES:
        out["torch_autocast"] = {"enabled": True, "dtype": TORCH_DTYPES[t.compute_dtype]}
    if t.grad_dtype == "fp32" and t.param_dtype != "fp32":
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def _zero_section(plan: Plan) -> dict:
    s = plan.stages[0]
    z: dict = {"stage": s.zero}
    if s.zero >= 1:  # the staging buffer's size, as priced (`rules.deepspeed_buffers`)
        z["reduce_bucket_size"] = REDUCE_BUCKET_ELEMENTS
    if s.zero == 3:  # gather as Mist's runtime does, as priced: a block and the next one
        z.update(zero3_gathering(math.ceil(plan.model.block_params() / s.tp)))
    o, w = s.offload.optimizer, s.offload.weights
    if o > 0:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if o < 1:
            z["offload_optimizer"]["ratio"] = o
            z["sub_group_size"] = sub_group_size(plan)
    if w > 0:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return z


def sub_group_size(plan: Plan) -> int:
    """Elements per optimizer sub-group: a rank's ZeRO-3 share of the parameters in
    OFFLOAD_STEPS groups, so that the offload ratio moves whole eighths (params are not split,
    so the groups are as even as the parameter sizes allow)."""
    s = plan.stages[0]
    share = math.ceil(plan.model.total_params() / (s.tp * s.dp))
    return max(1, math.ceil(share / OFFLOAD_STEPS))


# ------------------------------------------------------------------ the files
def pipeline_parts(plan: Plan) -> list[int]:
    """PipelineModule boundaries over [embedding, L blocks, final norm + head]: stage i builds
    specs parts[i]..parts[i+1]-1."""
    parts, n = [0], 1
    for s in plan.stages:
        n += s.layers
        parts.append(n)
    parts[-1] += 1
    return parts


def recomputed_blocks(plan: Plan) -> list[int]:
    """Global indices of the blocks recomputed whole: the last recompute_layers of each stage."""
    out: list[int] = []
    first = 0
    for s in plan.stages:
        last = first + s.layers
        out += range(last - s.recompute_layers, last)
        first = last
    return out


def train_args(config_file: str = CONFIG_FILE) -> tuple[str, ...]:
    """The training script's arguments as the launch script passes them."""
    return ("--deepspeed", "--deepspeed_config", config_file, "--data-path", PLACEHOLDER, "--tokenizer", PLACEHOLDER)


def write(plan: Plan, out_dir: Path) -> Export:
    """Write ds_config.json, launch.sh and mist_deepspeed.py into out_dir."""
    refuse(problems(plan), NAME)
    cfg = ds_config(plan)
    args = train_args()
    out_dir = Path(out_dir)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
    launch = out_dir / LAUNCH_FILE
    launch.write_text(launch_script(plan, args, HELPER_FILE))
    launch.chmod(0o755)
    (out_dir / HELPER_FILE).write_text(
        helper_module(plan.model.to_dict(), pipeline_parts(plan), recomputed_blocks(plan), plan.summary())
    )
    return Export(target="deepspeed", files=(CONFIG_FILE, LAUNCH_FILE, HELPER_FILE), env={}, args=args, config=cfg)
