"""Export to Megatron-LM (megatron-core 0.19.2): a `torchrun … pretrain_gpt.py` launch script.

The script follows the layout of Megatron-LM's own example scripts: it exports the environment
Megatron asserts, fills bash arrays of flags and hands them to `pretrain_gpt.py` (which lives in a
Megatron-LM checkout, not in the megatron-core wheel). What maps, and how:

- model: GPT = learned absolute positions, LayerNorm, GELU; Llama = RoPE, RMSNorm, SwiGLU, untied
  embeddings, grouped-query attention via `--group-query-attention --num-query-groups`. Megatron
  has no block that runs attention and MLP in parallel from one norm, so Falcon is refused.
- parallelism: one global tp × dp grid with pp stages (Megatron orders ranks tp fastest and pp
  slowest, so stage i owns consecutive ranks, as in Mist); every stage's layer count is spelt out
  with `--pipeline-model-parallel-layout`; `--global-batch-size` = micro-batch × dp × G.
- interleaved 1F1B (virtual_stages v ≥ 2): the same layout string with pp·v segments, which
  Megatron reads in the order Mist lays chunks out (segment c·pp + r is chunk c of rank r), so
  every chunk, even or uneven, is exact; Megatron derives its virtual pipeline size (v) from it.
  Its interleaved schedule takes micro-batches in groups of pp (`microbatch_group_size_per_vp_stage`
  defaults to pp and G must be a multiple of it, which every interleaved plan is): the order Mist
  simulates (`mist.rules.interleaved_order`).
- recomputation: Megatron's block method recomputes the first N blocks of every stage, or with
  interleaving of every model chunk (N larger than a chunk recomputes all of it); Mist recomputes
  the last N of each chunk, which costs the same compute and memory. Counts that no single N
  produces are refused. Attention-core
  recomputation is `--recompute-granularity selective --recompute-modules core_attn`, which cannot
  be combined with whole-block recomputation. Mist's MLP-activation-only recomputation has no
  dense-model equivalent (Megatron's `mlp` module recomputes the whole MLP) and is refused.
- ZeRO: 1 = `--use-distributed-optimizer`; 2 and 3 = Megatron-FSDP with the `optim_grads` and
  `optim_grads_params` sharding strategies (which need CUDA_DEVICE_MAX_CONNECTIONS unset or > 1
  and the `fsdp_dtensor` checkpoint format). One level for the whole model.
- offload: the optimizer fraction is `--optimizer-cpu-offload --optimizer-offload-fraction f
  --use-precision-aware-optimizer` (one fraction for all stages; Megatron splits it greedily over
  parameter tensors). Weight, gradient and activation offload have no byte-fraction equivalent
  (gradients stay in the GPU buffer; activation offload counts groups and needs Transformer
  Engine) and are refused.
- precision: `--bf16` / `--fp16`. Megatron accumulates and reduces the gradients of 16-bit
  parameters in fp32 (`grad_dtype: fp32`) by default with bf16 and with
  `--accumulate-allreduce-grads-in-fp32` with fp16, and in the parameters' dtype (`grad_dtype` the
  parameters' or unset) by default with fp16 and with `--grad-reduce-in-bf16` with bf16. With
  16-bit gradients its optimizer steps from fp32 copies of them, made at once: a plan with
  `engine: megatron` is priced so (`rules.megatron_buffers`). The target space searches fp32
  gradients unless the training names 16-bit ones (`--grad-dtype` the parameters' dtype;
  `runs_training`).

Data, tokenizer and checkpoint paths are `__FILL_IN__` placeholders. `nearest` rounds a plan to
the closest one Megatron runs, always towards less memory (more recomputation, more offload).
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from mist.errors import MistInputError
from mist.export.common import (
    PLACEHOLDER,
    compile_problems,
    eager_blocks,
    one_f_one_b,
    plain_pipeline,
    schedule_problems,
    sequence_parallel_problems,
    uniform_mesh_problems,
    with_stages,
)
from mist.export.records import Export, NotExpressible
from mist.plan import Offload, Plan
from mist.rules.interleaved_order import chunk_recompute
from mist.rules.megatron_buffers import sixteen_bit_gradients
from mist.specs.training import TrainingSpec

NAME = "Megatron-LM"
SCRIPT = "pretrain_gpt_mist.sh"
ENTRY = "pretrain_gpt.py"
ZERO_FSDP = {2: "optim_grads", 3: "optim_grads_params"}
PRECISION = {"bf16": "--bf16", "fp16": "--fp16", "fp32": None}
DEFAULT_ROTARY_BASE = 10000.0  # Megatron's --rotary-base default (an integer flag)


# ---------------------------------------------------------------------------------- problems
def problems(plan: Plan) -> list[str]:
    """One sentence per knob Megatron-LM cannot express; [] if the plan exports exactly."""
    out = (
        _model_problems(plan) + uniform_mesh_problems(plan, NAME) + _zero_problems(plan) + compile_problems(plan, NAME)
    )
    out += sequence_parallel_problems(plan, NAME) + schedule_problems(plan, NAME)
    return out + _recompute_problems(plan) + _offload_problems(plan) + _precision_problems(plan)


def runs_training(t: TrainingSpec) -> TrainingSpec:
    """The training the target space costs: fp32 gradients with 16-bit parameters, as Megatron-LM
    0.19 runs bf16 by default (see above), unless `t` names the parameters' dtype for its gradients:
    a user's choice Megatron runs too (fp16's default, `--grad-reduce-in-bf16` with bf16), half the
    gradient buffer and reduction bytes for the step's fp32 copies."""
    return replace(t, grad_dtype="fp32") if t.param_dtype in ("bf16", "fp16") and t.grad_dtype is None else t


def _model_problems(plan: Plan) -> list[str]:
    if plan.model.family == "falcon":
        return [
            "the model is a falcon (attention and MLP in parallel from one norm), an architecture "
            "Megatron-LM's GPT model does not have"
        ]
    if plan.model.uses_rotary and not float(plan.model.rope_theta).is_integer():
        return [
            f"the model's rotary base {plan.model.rope_theta:g} (rope_theta) is not an integer, which --rotary-base takes"
        ]
    return []


def _zero_problems(plan: Plan) -> list[str]:
    z0 = plan.stages[0].zero
    return [
        f"stage {i} uses ZeRO-{s.zero} but stage 0 uses ZeRO-{z0}, and {NAME} shards one way for the whole model"
        for i, s in enumerate(plan.stages)
        if s.zero != z0
    ]


def chunk_recomputes(plan: Plan) -> list[tuple[int, ...]]:
    """Blocks each model chunk of each stage recomputes whole (one chunk per stage without
    interleaving), as Mist spreads a stage's `recompute_layers` over its chunks."""
    return [chunk_recompute(s.recompute_layers, s.chunks()) for s in plan.stages]


def block_recompute(plan: Plan) -> int | None:
    """The one `--recompute-num-layers` N whose block recomputation (min(N, blocks) blocks of
    every stage, or of every model chunk with interleaving) gives each its planned count; 0 for
    none, None if no N does."""
    per_chunk = chunk_recomputes(plan)
    n = max(max(rc) for rc in per_chunk)
    fits = all(rc == tuple(min(n, c) for c in s.chunks()) for rc, s in zip(per_chunk, plan.stages))
    return n if fits else None


def _selective_stages(plan: Plan, knob: str) -> list[int]:
    """Stages where `knob` (recompute_attention/recompute_activation) applies to some block,
    i.e. not every block of the stage is recomputed whole anyway."""
    return [i for i, s in enumerate(plan.stages) if getattr(s, knob) and s.recompute_layers < s.layers]


def _recompute_problems(plan: Plan) -> list[str]:
    out = []
    n = block_recompute(plan)
    if n is None and plan.virtual_stages > 1:
        out.append(_chunk_recompute_problem(plan))
    elif n is None:
        top = max(range(plan.num_stages), key=lambda i: plan.stages[i].recompute_layers)
        most = plan.stages[top].recompute_layers
        i, s = next((i, s) for i, s in enumerate(plan.stages) if s.recompute_layers != min(most, s.layers))
        out.append(
            f"stage {i} recomputes {s.recompute_layers} of its {s.layers} blocks but stage {top} recomputes {most} "
            f"(recompute_layers), and {NAME} recomputes the same first N blocks of every stage "
            "(--recompute-num-layers)"
        )
    attn = _selective_stages(plan, "recompute_attention")
    if attn and n != 0:
        out.append(
            f"stage {attn[0]} recomputes the attention core of its other blocks (recompute_attention) "
            f"while whole blocks are recomputed, and {NAME}'s --recompute-granularity is either full or selective"
        )
    elif attn and len(attn) != plan.num_stages:
        i = next(i for i in range(plan.num_stages) if i not in attn)
        out.append(
            f"stage {i} does not recompute the attention core (recompute_attention) but stage {attn[0]} does, "
            f"and {NAME} recomputes the same modules on every stage"
        )
    for i in _selective_stages(plan, "recompute_activation"):
        out.append(
            f"stage {i} recomputes only its MLP activation (recompute_activation), which {NAME} offers only "
            "for MoE experts (its dense 'mlp' module recomputes the whole MLP)"
        )
    return out


def _chunk_recompute_problem(plan: Plan) -> str:
    """The sentence for an interleaved plan whose chunks recompute counts no single N gives."""
    per_chunk = chunk_recomputes(plan)
    n = max(max(rc) for rc in per_chunk)
    i = next(i for i, (rc, s) in enumerate(zip(per_chunk, plan.stages)) if rc != tuple(min(n, c) for c in s.chunks()))
    s = plan.stages[i]
    return (
        f"stage {i} recomputes {s.recompute_layers} of its {s.layers} blocks ({'+'.join(map(str, per_chunk[i]))} "
        f"of its chunks of {'+'.join(map(str, s.chunks()))}) but some chunk recomputes {n} (recompute_layers), and "
        f"{NAME} recomputes the same first N blocks of every model chunk (--recompute-num-layers)"
    )


def _offload_problems(plan: Plan) -> list[str]:
    why = {
        "weights": f"{NAME} cannot offload weights",
        "grads": f"{NAME} keeps gradients in their GPU buffer",
        "activations": f"{NAME}'s activation offload counts offload groups rather than bytes and needs "
        "Transformer Engine",
    }
    out = []
    for i, s in enumerate(plan.stages):
        for knob, reason in why.items():
            v = getattr(s.offload, knob)
            if v:
                out.append(f"stage {i} offloads {v:.0%} of its {knob} (offload.{knob} {v:g}), and {reason}")
    f0 = plan.stages[0].offload.optimizer
    for i, s in enumerate(plan.stages[1:], start=1):
        if s.offload.optimizer != f0:
            out.append(
                f"stage {i} offloads {s.offload.optimizer:g} of its optimizer state but stage 0 offloads {f0:g} "
                f"(offload.optimizer), and {NAME} has one --optimizer-offload-fraction"
            )
    return out


def _precision_problems(plan: Plan) -> list[str]:
    t = plan.training
    if t.param_dtype != t.compute_dtype:
        return [
            f"the plan keeps {t.param_dtype} parameters but computes in {t.compute_dtype} (training.param_dtype), "
            f"and {NAME} computes in its parameter dtype"
        ]
    return []


# ----------------------------------------------------------------------------------- nearest
def nearest(plan: Plan) -> Plan:
    """The closest plan Megatron-LM runs: same GPUs and global batch, one mesh and micro-batch,
    the highest ZeRO level and optimizer offload of any stage, block recomputation raised to one
    N (per chunk with interleaving), and the offloads and recomputation Megatron lacks dropped.
    An interleaved plan keeps its chunks unless its stages' meshes differ (then it runs plain
    1F1B: one mesh may change the number of micro-batches)."""
    if _model_problems(plan):
        raise NotExpressible(f"{NAME} cannot run this plan: {_model_problems(plan)[0]}.")
    plan = eager_blocks(one_f_one_b(plan))
    if uniform_mesh_problems(plan, NAME):
        plan = _uniform_mesh(plain_pipeline(plan))
    zero = max(s.zero for s in plan.stages)
    opt = max(s.offload.optimizer for s in plan.stages)
    n = max(max(rc) for rc in chunk_recomputes(plan))
    attn = n == 0 and any(s.recompute_attention for s in plan.stages)
    sp = any(s.sequence_parallel for s in plan.stages)
    stages = [
        replace(
            s,
            sequence_parallel=sp and s.tp > 1,
            zero=zero,
            recompute_layers=sum(min(n, c) for c in s.chunks()),
            recompute_attention=attn,
            recompute_activation=False,
            offload=Offload(optimizer=opt),
        )
        for s in plan.stages
    ]
    t = plan.training
    if t.param_dtype != t.compute_dtype:  # the parameters in the compute dtype, the gradients as they were
        t = replace(t, param_dtype=t.compute_dtype, grad_dtype=t.grad_dtype or t.param_dtype)
    return replace(with_stages(plan, stages), training=t)


def _uniform_mesh(plan: Plan) -> Plan:
    """`plan` with one tp, dp and micro-batch on every stage: the GPUs split evenly over the same
    number of stages, preferring the stages' own tp and micro-batch sizes."""
    world, S, K = plan.cluster.world_size, plan.num_stages, plan.cluster.gpus_per_node
    g = world // S
    if world % S or (g <= K and K % g) or (g > K and g % K):
        raise NotExpressible(
            f"{NAME} cannot run this plan: its {world} GPUs do not split into {S} equal pipeline stages of whole "
            "nodes or node fractions, and Megatron-LM runs one mesh for the whole pipeline."
        )
    nodes, gpn = (1, g) if g <= K else (g // K, K)
    B, cp = plan.training.global_batch, plan.stages[0].cp  # (cp is the same on every stage)
    for tp in _prefer([s.tp for s in plan.stages], g):
        if gpn % (tp * cp) or not _splits(plan, tp) or B % (g // (tp * cp)):
            continue
        dp = g // (tp * cp)
        for mb in _prefer([s.micro_batch for s in plan.stages], B // dp):
            stages = [replace(s, nodes=nodes, gpus_per_node=gpn, tp=tp, dp=dp, micro_batch=mb) for s in plan.stages]
            return replace(with_stages(plan, stages), micro_batches=B // (dp * mb))
    raise NotExpressible(
        f"{NAME} cannot run this plan: no single tp and micro-batch size splits its global batch {B} evenly "
        f"over {S} stages of {g} GPUs."
    )


def _prefer(own: list[int], n: int) -> list[int]:
    """The divisors of n, the stages' own values first (in stage order), then largest first."""
    divisors = sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)
    first = [v for i, v in enumerate(own) if n % v == 0 and v not in own[:i]]
    return first + [d for d in divisors if d not in first]


def _splits(plan: Plan, tp: int) -> bool:
    try:
        plan.model.check_tp(tp)
    except MistInputError:
        return False
    return True


# ----------------------------------------------------------------------------------- args
def layout(plan: Plan) -> str | None:
    """`--pipeline-model-parallel-layout`: E (embedding) on stage 0's first chunk, L (loss) on the
    last stage's last chunk, each chunk's decoder blocks as t*n, chunk 0 of every stage first,
    then chunk 1, … (Megatron's segment c·pp + r is chunk c of rank r); None for a single stage."""
    if plan.num_stages == 1:
        return None
    segments = [f"t*{s.chunks()[c]}" for c in range(plan.virtual_stages) for s in plan.stages]
    return "E" + "|".join(segments) + "L"


def model_args(plan: Plan) -> list[str]:
    """The architecture of the plan's ModelSpec as GPT-model flags."""
    m, t = plan.model, plan.training
    args = [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_heads),
        "--seq-length", str(t.seq_len),
        "--max-position-embeddings", str(max(m.max_position_embeddings, t.seq_len)),
        "--norm-epsilon", repr(m.norm_eps),
        "--attention-dropout", repr(m.attention_dropout),
        "--hidden-dropout", repr(m.hidden_dropout),
    ]  # fmt: skip
    if m.num_kv_heads != m.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.family == "gpt":
        args += ["--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm"]
    else:
        args += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
        if m.rotary_fraction != 1.0:
            args += ["--rotary-percent", repr(m.rotary_fraction)]
        if m.rope_theta != DEFAULT_ROTARY_BASE:
            args += ["--rotary-base", str(int(m.rope_theta))]
    if not m.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        args.append("--disable-bias-linear")
    return args


def training_args(plan: Plan) -> list[str]:
    """Batch sizes from the plan, precision from its TrainingSpec, and an example schedule."""
    s, t = plan.stages[0], plan.training
    args = [
        "--micro-batch-size", str(s.micro_batch),
        "--global-batch-size", str(s.micro_batch * s.dp * plan.micro_batches),
        "--attention-backend", "flash" if t.flash_attention else "unfused",
    ]  # fmt: skip
    flag = PRECISION[t.param_dtype]
    if flag:
        args.append(flag)
    sixteen = sixteen_bit_gradients(t.param_dtype, t.grad_dtype)
    if t.param_dtype == "fp16" and not sixteen:  # (bf16 accumulates and reduces in fp32 by default)
        args.append("--accumulate-allreduce-grads-in-fp32")
    if t.param_dtype == "bf16" and sixteen:
        args.append("--grad-reduce-in-bf16")
    # the schedule is not part of a plan: example values to replace with your own
    return args + ["--train-iters", "1000", "--lr", "0.0001", "--lr-decay-style", "cosine", "--clip-grad", "1.0"]


def parallel_args(plan: Plan) -> list[str]:
    s = plan.stages[0]
    args = ["--tensor-model-parallel-size", str(s.tp), "--pipeline-model-parallel-size", str(plan.num_stages)]
    lay = layout(plan)
    if lay:
        args += ["--pipeline-model-parallel-layout", lay]
    if s.sequence_parallel:
        args.append("--sequence-parallel")
    if s.cp > 1:  # K/V all-gathered, as Mist runs and prices it (Megatron's default is a p2p ring)
        args += ["--context-parallel-size", str(s.cp), "--cp-comm-type", "allgather"]
    if s.zero == 1:
        args.append("--use-distributed-optimizer")
    elif s.zero in ZERO_FSDP:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", ZERO_FSDP[s.zero]]
    return args


def memory_args(plan: Plan) -> list[str]:
    """Recomputation and optimizer offload."""
    args = []
    n = block_recompute(plan)
    if n:
        args += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]
    elif any(s.recompute_attention for s in plan.stages):
        args += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    f = plan.stages[0].offload.optimizer
    if f:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{f:g}", "--use-precision-aware-optimizer"]
    return args


def data_args(plan: Plan) -> list[str]:
    """Data, tokenizer and checkpoints: placeholders the user fills in."""
    args = [
        "--data-path", PLACEHOLDER,
        "--split", "949,50,1",
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", PLACEHOLDER,
        "--save", PLACEHOLDER,
        "--load", PLACEHOLDER,
    ]  # fmt: skip
    if plan.stages[0].zero in ZERO_FSDP:
        args += ["--ckpt-format", "fsdp_dtensor"]
    return args


def arg_groups(plan: Plan) -> list[tuple[str, list[str]]]:
    """The script's bash arrays in order: (name, arguments)."""
    return [
        ("GPT_MODEL_ARGS", model_args(plan)),
        ("TRAINING_ARGS", training_args(plan)),
        ("MODEL_PARALLEL_ARGS", parallel_args(plan)),
        ("MEMORY_ARGS", memory_args(plan)),
        ("DATA_ARGS", data_args(plan)),
    ]


def environment(plan: Plan) -> dict[str, str]:
    """What Megatron asserts: one CUDA connection (kernel order for tp/sequence-parallel overlap),
    except under Megatron-FSDP, which requires more than one."""
    return {} if plan.stages[0].zero in ZERO_FSDP else {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


# ----------------------------------------------------------------------------------- write
def script(plan: Plan) -> str:
    """The bash launch script."""
    c = plan.cluster
    lines = ["#!/usr/bin/env bash", f"# Mist plan for Megatron-LM (megatron-core 0.19): {plan.model.name}"]
    lines += [f"#   {line.strip()}" for line in plan.summary().splitlines()]
    lines += [
        "# Run from a Megatron-LM checkout on each of the nodes, with NODE_RANK and MASTER_ADDR set.",
        f"# Replace every {PLACEHOLDER} (data, tokenizer, checkpoints) before launching.",
        "set -euo pipefail",
        "",
    ]
    lines += [f"export {k}={v}" for k, v in environment(plan).items()]
    lines += [
        f"GPUS_PER_NODE={c.gpus_per_node}",
        f"NUM_NODES={c.nodes}",
        "NODE_RANK=${NODE_RANK:-0}",
        "MASTER_ADDR=${MASTER_ADDR:-localhost}",
        "MASTER_PORT=${MASTER_PORT:-6000}",
        "",
        "DISTRIBUTED_ARGS=(",
        '    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node-rank "$NODE_RANK"',
        '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        ")",
    ]
    for name, args in arg_groups(plan):
        lines += ["", f"{name}=("] + [f"    {line}" for line in _flag_lines(args)] + [")"]
    arrays = " ".join(f'"${{{name}[@]}}"' for name, _ in arg_groups(plan))
    lines += ["", f'torchrun "${{DISTRIBUTED_ARGS[@]}}" {ENTRY} {arrays} "$@"', ""]
    return "\n".join(lines)


def _flag_lines(args: list[str]) -> list[str]:
    """One line per flag with its values, shell-quoted."""
    lines: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(a))
    return [" ".join(words) for words in lines]


def pretrain_args(plan: Plan) -> list[str]:
    """Exactly the arguments the script passes to pretrain_gpt.py (without the user's extra "$@")."""
    return [a for _, args in arg_groups(plan) for a in args]


def write(plan: Plan, out_dir: Path) -> Export:
    path = Path(out_dir) / SCRIPT
    path.write_text(script(plan))
    path.chmod(0o755)
    return Export(target="megatron", files=(SCRIPT,), env=environment(plan), args=tuple(pretrain_args(plan)))
