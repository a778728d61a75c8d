"""The `mist` command line (a thin adapter: parsing, printing, exit codes)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from mist.errors import MistInputError
from mist.hardware import load_profile
from mist.plan import load_plan
from mist.simulate.precision import profile_dtype
from mist.specs.loading import load_model
from mist.specs.training import MAX_GLOBAL_BATCH, ClusterSpec, TrainingSpec
from mist.tune.compare import compare_spaces
from mist.tune.result import budget_words
from mist.tune.run import ALL_SPACES, TARGET_SPACES, compiles_by_default, run_space, run_space_either_blocks
from mist.tune.space import SPACE_LABELS
from mist.units import GiB, MiB
from mist.userfiles import check_output_file

if TYPE_CHECKING:
    from mist.simulate.estimate import Estimate
    from mist.simulate.prediction import Prediction

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Mist: find and run the fastest distributed-training configuration that fits.",
)
err = Console(stderr=True)
out = Console()

# whole blocks, or the parts of each block `mist.models.checkpointing.SELECTIVE` re-runs
RECOMPUTE_CHOICES = ("none", "full", "attention", "activation", "attention+activation")

# options shared by the commands that describe a training job
ModelOpt = Annotated[str, typer.Option(help="Preset name, model file (JSON/YAML) or HF config.json.")]
GpuOpt = Annotated[str, typer.Option(help="GPU name or profile JSON path.")]
NodesOpt = Annotated[int, typer.Option(help="Nodes.")]
GpnOpt = Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")]
SeqOpt = Annotated[int, typer.Option(help="Sequence length.")]
BatchOpt = Annotated[int, typer.Option("--global-batch", help="Global batch (sequences).")]
NoFlashOpt = Annotated[
    bool, typer.Option("--no-flash", help="Materialise attention scores instead of flash attention.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
HostMemOpt = Annotated[
    float | None,
    typer.Option(
        "--host-memory", help="Host RAM per node in GiB, for offloading (default: the GPU kind's typical node)."
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Parameter and compute dtype: bf16, fp16 or fp32 (default: the dtype the profile was measured in).",
    ),
]
GradDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--grad-dtype",
        help="Accumulate and reduce gradients in fp32 (as Megatron-LM does with bf16), or in the "
        "parameter dtype (default; `--target megatron` searches fp32 unless this names the parameter dtype, "
        "torchtitan always runs fp32).",
    ),
]

CompileOpt = Annotated[
    bool | None,
    typer.Option(
        "--compile-blocks/--no-compile",
        help="Decoder blocks compiled with torch.compile (Inductor), as `mist train` then runs them, "
        "or eager (default on a GPU profile, in the full, mist-paper and torchtitan spaces: tune searches "
        "both and keeps the faster plan, estimate prices compiled blocks; eager on a CPU profile and in "
        "the other spaces).",
        show_default=False,
    ),
]


@app.callback()
def _root() -> None:
    """Mist: find and run the fastest distributed-training configuration that fits."""


@app.command()
def estimate(
    model: str = typer.Option("gpt3-1.3b", help="Preset name, model file (JSON/YAML) or HF config.json."),
    gpu: str = typer.Option("h200", help="GPU name or profile JSON path."),
    seq: int = typer.Option(2048, help="Sequence length."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Micro-batch size."),
    tp: int = typer.Option(1, help="Tensor-parallel degree (one shard is estimated)."),
    recompute: str = typer.Option(
        "none",
        help="Activation recomputation: none, full (whole blocks), "
        "attention (the attention core only), activation (the MLP activation "
        "only) or attention+activation.",
    ),
    no_flash: bool = typer.Option(False, "--no-flash", help="Materialise attention scores instead of flash attention."),
    compile_blocks: CompileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Cost of one micro-batch of a model on one GPU: layer and model time, memory."""
    from mist.simulate.estimate import estimate as run_estimate  # lazy: keeps torch out of start-up

    if recompute not in RECOMPUTE_CHOICES:
        raise MistInputError(f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {recompute!r}.")
    if not 0 < micro_batch <= MAX_GLOBAL_BATCH:
        raise MistInputError(f"--micro-batch must be between 1 and {MAX_GLOBAL_BATCH:,}, got {micro_batch:,}.")
    TrainingSpec(seq_len=seq, global_batch=micro_batch)
    spec = load_model(model)
    spec.check_seq_len(seq)
    profile = load_profile(gpu)
    if compile_blocks is None:
        compile_blocks = compiles_by_default("full", profile)
    res = run_estimate(
        spec, profile, seq, micro_batch, tp=tp, recompute=recompute, flash=not no_flash, compiled=compile_blocks
    )
    if as_json:
        print(json.dumps(res.to_json(), indent=1))
        return
    _print_estimate(res)


@app.command()
def simulate(
    plan: str = typer.Argument(..., help="Plan file (JSON or YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    timeline: str = typer.Option(None, "--timeline", help="Draw one iteration's lanes to this PNG."),
    host_memory: HostMemOpt = None,
):
    """Predict a whole plan: iteration time, throughput, MFU, per-stage T/D and memory."""
    # lazy: keeps torch out of the CLI start-up
    from mist.simulate.plan_sim import simulate_plan, simulate_with_timeline

    p = load_plan(plan)
    if host_memory is not None:
        p = replace(p, cluster=replace(p.cluster, host_memory_gib=host_memory))
    profile = load_profile(p.cluster.gpu)
    if timeline is not None:
        from mist.viz.timeline import IMAGE_SUFFIXES  # lazy: keeps matplotlib out of start-up

        check_output_file(timeline, "--timeline", IMAGE_SUFFIXES)
    if timeline is None:
        res, event_time = simulate_plan(p, profile), None
    else:
        from mist.viz.timeline import draw_timeline  # lazy: keeps matplotlib out of start-up

        res, lanes = simulate_with_timeline(p, profile)
        draw_timeline(lanes, timeline)
        event_time = lanes.event_iteration_time_s
    if as_json:
        d = res.to_json()
        if event_time is not None:  # printed with --timeline only
            d["event_iteration_time_s"] = event_time
        print(json.dumps(d, indent=1))
        return
    _print_simulation(p, res)


def _setup(
    model,
    gpu,
    nodes,
    gpus_per_node,
    seq,
    global_batch,
    no_flash,
    dtype=None,
    host_memory=None,
    grad_dtype=None,
):
    spec = load_model(model)
    cluster = ClusterSpec(gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, host_memory_gib=host_memory)
    profile = load_profile(gpu)
    dt = profile_dtype(profile) if dtype is None else dtype
    training = TrainingSpec(
        seq_len=seq,
        global_batch=global_batch,
        flash_attention=not no_flash,
        param_dtype=dt,
        compute_dtype=dt,
    )
    if grad_dtype is not None:
        if grad_dtype not in (dt, "fp32"):
            raise MistInputError(f"--grad-dtype must be fp32 or the parameter dtype ({dt}), got {grad_dtype!r}.")
        training = replace(training, grad_dtype=grad_dtype)
    spec.check_seq_len(seq)
    spec.check_attention(training.flash_attention)
    return spec, cluster, training, profile


def _check_budget(time_budget: float | None) -> None:
    if time_budget is not None and not 0 < time_budget < math.inf:
        raise MistInputError(f"--time-budget must be a positive number of seconds, got {time_budget}.")


def _int_list(option: str, text: str | None) -> tuple | None:
    """'1,2' → (1, 2); None stays None; anything else is a one-sentence input error."""
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise MistInputError(f"{option} takes positive integers separated by commas, got {text!r}.") from None
    if not vals or min(vals) < 1:
        raise MistInputError(f"{option} takes positive integers separated by commas, got {text!r}.")
    return vals


def _progress_printer(enabled: bool):
    if not enabled or not err.is_terminal:
        return None, None
    from rich.progress import Progress

    prog = Progress(console=err, transient=True)
    task = prog.add_task("tuning", total=None)

    # label: which search runs (`run_space_either_blocks`) and whether its layers are being traced
    def update(done, total, best, label=None):
        what = "tuning" + (f", {label}" if label else "")
        prog.update(
            task,
            completed=done,
            total=total,
            description=f"{what} (best {best * 1e3:.0f} ms)" if best < float("inf") else what,
        )

    return prog, update


def _tune_space(space: str | None, target: str | None) -> str:
    """The space `mist tune` searches: --space, or the one --target names (not both)."""
    if target is None:
        return space or "full"
    if space is not None:
        raise MistInputError("Give either --space or --target, not both.")
    if target not in TARGET_SPACES:
        raise MistInputError(f"Unknown --target {target!r}; choose one of {', '.join(TARGET_SPACES)}.")
    return TARGET_SPACES[target]


@app.command()
def tune(
    model: ModelOpt = "gpt3-1.3b",
    gpu: GpuOpt = "l4",
    nodes: NodesOpt = 1,
    gpus_per_node: GpnOpt = 2,
    seq: SeqOpt = 2048,
    global_batch: BatchOpt = 32,
    space: str = typer.Option(
        None,
        help="Search space: full (default), mist-paper, megatron, deepspeed, aceso, megatron-paper, "
        "megatron-0.19, deepspeed-0.19, torchtitan-0.3.",
    ),
    target: str = typer.Option(
        None,
        "--target",
        help="Search only the plans this framework runs today: megatron, deepspeed or torchtitan "
        "(the megatron-0.19, deepspeed-0.19 and torchtitan-0.3 spaces).",
    ),
    time_budget: float = typer.Option(None, "--time-budget", help="Stop searching after this many seconds."),
    output: str = typer.Option(None, "-o", "--output", help="Write the plan (JSON or YAML) here."),
    no_flash: NoFlashOpt = False,
    dtype: DtypeOpt = None,
    grad_dtype: GradDtypeOpt = None,
    pp: str | None = typer.Option(None, "--pp", help="Allowed pipeline depths, e.g. 2 or 1,2 (default: any)."),
    tp: str | None = typer.Option(None, "--tp", help="Allowed tensor-parallel degrees, e.g. 2 or 1,2 (default: any)."),
    memory_limit: float | None = typer.Option(
        None, "--memory-limit", help="Plan for at most this many GiB per GPU (less than the profile's capacity)."
    ),
    host_memory: HostMemOpt = None,
    compile_blocks: CompileOpt = None,
    as_json: JsonOpt = False,
):
    """Find the fastest plan that fits, write it, and print its prediction."""
    space = _tune_space(space, target)
    if space not in ALL_SPACES:
        raise MistInputError(f"Unknown search space {space!r}; choose one of {', '.join(ALL_SPACES)}.")
    _check_budget(time_budget)
    if output is not None:
        check_output_file(output, "--output", (".json", ".yaml", ".yml"))
    limits = {"pp_values": _int_list("--pp", pp), "tp_values": _int_list("--tp", tp)}
    if any(v is not None for v in limits.values()) and space not in ("full", "mist-paper"):
        raise MistInputError(f"--pp and --tp restrict the full and mist-paper spaces, not {space}.")
    spec, cluster, training, profile = _setup(
        model, gpu, nodes, gpus_per_node, seq, global_batch, no_flash, dtype, host_memory, grad_dtype
    )
    search = run_space
    if compile_blocks is None and compiles_by_default(space, profile):
        search = run_space_either_blocks  # the faster of compiled and eager blocks
    else:
        training = replace(training, compile_blocks=bool(compile_blocks))
    if memory_limit is not None:
        outside = profile.outside_allocator_bytes or 0  # the limit caps the device: this is in it
        if not outside < memory_limit * GiB <= profile.memory_bytes:
            raise MistInputError(
                f"--memory-limit must lie in ({outside / GiB:.2f}, {profile.memory_bytes / GiB:.2f}] GiB "
                f"(the capacity of {profile.name}"
                + (", above what is in use outside PyTorch's allocator" if outside else "")
                + f"), got {memory_limit}."
            )
        profile = replace(profile, memory_bytes=int(memory_limit * GiB))
    prog, update = _progress_printer(not as_json)
    if prog is not None:
        with prog:
            res = search(space, spec, cluster, training, profile, time_budget, update, limits)
    else:
        res = search(space, spec, cluster, training, profile, time_budget, None, limits)
    if res.plan is None:
        raise MistInputError(res.infeasible_reason or "No plan fits.")
    if output:
        res.plan.save_beside(output)
    if as_json:
        d = res.to_json()
        d.pop("infeasible_reason", None)
        print(json.dumps(d, indent=1))
        return
    traced = (
        f"; {res.tracing_time_s:.1f} s of it tracing layer variants, now cached" if res.tracing_time_s >= 0.05 else ""
    )
    out.print(
        f"searched the {res.space} space in {res.tuning_time_s:.1f} s "
        f"({res.candidates_evaluated:,} candidates evaluated{traced})"
        + (f"; plan written to {output}" if output else "")
    )
    if res.budget_ran_out:
        out.print(budget_words(time_budget, res.tracing_time_s))
    assert res.predicted is not None  # a plan comes with its prediction
    _print_simulation(res.plan, res.predicted)


@app.command()
def compare(
    model: ModelOpt = "gpt3-1.3b",
    gpu: GpuOpt = "l4",
    nodes: NodesOpt = 1,
    gpus_per_node: GpnOpt = 2,
    seq: SeqOpt = 2048,
    global_batch: BatchOpt = 32,
    time_budget: float = typer.Option(None, "--time-budget", help="Budget per search space (seconds)."),
    no_flash: NoFlashOpt = False,
    dtype: DtypeOpt = None,
    grad_dtype: GradDtypeOpt = None,
    host_memory: HostMemOpt = None,
    as_json: JsonOpt = False,
):
    """Mist's plan against the best plan of each baseline's space, under the same cost model."""
    _check_budget(time_budget)
    spec, cluster, training, profile = _setup(
        model, gpu, nodes, gpus_per_node, seq, global_batch, no_flash, dtype, host_memory, grad_dtype
    )
    res = compare_spaces(spec, cluster, training, profile, time_budget)
    if as_json:
        print(json.dumps(res.to_json(), indent=1))
        return
    t = Table(title=f"{spec.name} on {nodes}×{gpus_per_node} {profile.name}, seq {seq}, batch {global_batch}")
    for col in ("space", "iteration (ms)", "samples/s", "Mist full speedup", "tuning (tracing) s", "plan"):
        t.add_column(col, justify="right" if col != "plan" else "left")
    for r in res.spaces:
        it = r.iteration_time_s
        t.add_row(
            r.space,
            f"{it * 1e3:.1f}" if it else "no fit",
            f"{r.throughput_samples_per_s:.2f}" if it else "-",
            f"{r.speedup_of_full:.3f}×" if r.speedup_of_full else "-",
            f"{r.tuning_time_s:.1f} ({r.tracing_time_s:.1f})" + ("*" if r.budget_ran_out else ""),
            r.plan_summary or r.infeasible_reason or "",
        )
    out.print(t)
    if any(r.budget_ran_out for r in res.spaces):
        out.print("* " + budget_words(time_budget))
    if any(r.tracing_time_s >= 0.05 for r in res.spaces):
        out.print("(tracing): of a space's tuning time, what tracing layer variants took; they are cached on disk now.")
    out.print("Spaces: " + "; ".join(f"{r.space}: {SPACE_LABELS[r.space]}" for r in res.spaces) + ".")
    needs = [(r.space, r.full_plan_needs) for r in res.spaces if r.full_plan_needs]
    if needs:
        out.print("What Mist's plan uses that each framework cannot run (what Mist's runtime buys here):")
        for space, knobs in needs:
            out.print(f"  {space}: {', '.join(knobs)}")


def _print_simulation(p, r: Prediction) -> None:
    out.print(p.summary())
    out.print(f"profile: {r.profile}")
    out.print(
        f"iteration {r.iteration_time_s * 1e3:.1f} ms · {r.throughput_samples_per_s:.2f} samples/s · "
        f"{r.tokens_per_s:,.0f} tokens/s · MFU {r.mfu:.1%}"
    )
    t = Table(title="stages (times in ms per micro-batch; D once per iteration)")
    for col in ("stage", "T", "D", "compute", "recomp", "TP", "exposed", "p2p", "peak GiB", "host GiB", "fits"):
        t.add_column(col, justify="right")

    def ms(x):
        return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.2f}"

    for i, s in enumerate(r.stages):
        tb = s.time_breakdown
        t.add_row(
            str(i),
            ms(s.stable_time_s),
            ms(s.delta_time_s),
            ms(tb["compute_s"]),
            ms(tb["recompute_s"]),
            ms(tb["tp_comm_s"]),
            ms(max(tb["exposed_transfers_s"], 0.0)),
            ms(tb["p2p_s"]),
            f"{s.peak_memory_bytes / GiB:.2f}",
            f"{s.host_peak_bytes / GiB:.2f}",
            "yes" if s.fits else "[red]no[/]",
        )
    out.print(t)
    h = r.host_memory
    if any(h.per_node_bytes):
        cap = h.capacity_per_node_bytes
        out.print(
            f"host memory per node: {max(h.per_node_bytes) / GiB:.1f} GiB at most"
            + (f" of {cap / GiB:.1f} GiB" if cap else "")
            + f" ({h.source})"
        )
    for msg in r.memory_problems:
        out.print(f"[red]does not fit:[/] {msg}")


def _print_estimate(r: Estimate) -> None:
    lay, mod = r.layer, r.model
    out.print(
        f"[bold]{r.model_name}[/] on [bold]{r.gpu}[/] — seq {r.seq_len}, micro-batch "
        f"{r.micro_batch}, TP {r.tp}, recompute {r.recompute}, "
        f"{'flash' if r.flash else 'non-flash'} attention, {'compiled' if r.compiled_blocks else 'eager'} blocks"
    )
    out.print(f"profile: {r.profile}")
    t = Table(title="one decoder block (one TP shard)")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k in ("fwd_compute_ms", "bwd_compute_ms", "recompute_ms", "fwd_comm_ms", "bwd_comm_ms"):
        t.add_row(k.replace("_ms", " (ms)"), f"{getattr(lay, k):.3f}")
    t.add_row("saved activations (MiB)", f"{lay.saved_activation_bytes / MiB:.1f}")
    t.add_row("parameters", f"{lay.params:,}")
    out.print(t)
    m = Table(title="whole model, one micro-batch, forward + backward")
    m.add_column("quantity")
    m.add_column("value", justify="right")
    m.add_row("time (ms)", f"{mod.fwd_bwd_ms:.2f}")
    for k, v in mod.time_breakdown.items():
        m.add_row("  " + k.replace("_ms", " (ms)"), f"{v:.2f}")
    m.add_row("achieved TFLOP/s", f"{mod.achieved_tflops:.0f}")
    m.add_row("parameters", f"{mod.params:,}")
    for k in ("weights_bytes", "grads_bytes", "optimizer_bytes", "activation_peak_bytes"):
        m.add_row("  " + k.replace("_bytes", " (GiB)"), f"{getattr(mod, k) / GiB:.2f}")
    m.add_row(
        "peak memory (GiB)",
        f"{mod.peak_bytes / GiB:.2f} of {mod.capacity_bytes / GiB:.1f}"
        + ("" if mod.fits else "  [red]does not fit[/]"),
    )
    out.print(m)


@app.command()
def train(
    plan: str = typer.Argument(..., help="Plan file (JSON or YAML)."),
    steps: int = typer.Option(10, help="Training steps (optimizer updates)."),
    data: str = typer.Option(
        "synthetic",
        help="'synthetic', a token file (.npy, .bin), JSONL or text with --tokenizer, or a text file (byte-level).",
    ),
    metrics: str = typer.Option(
        None, "--metrics", help="Write step time, tokens/s, MFU, losses and per-stage peak memory to this JSON file."
    ),
    local: bool = typer.Option(
        False, "--local", help="Start the worker processes here (CPU/gloo without CUDA) instead of under torchrun."
    ),
    seed: int = typer.Option(0, help="Seed of the initialization and the synthetic data."),
    lr: float = typer.Option(3e-4, "--lr", help="Peak learning rate (AdamW)."),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="Cosine decay ends at this fraction of --lr."),
    warmup: int = typer.Option(None, "--warmup", help="Linear warm-up steps (default: 10% of the steps, at most 100)."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", help="AdamW decoupled weight decay (matrices only)."),
    beta1: float = typer.Option(0.9, "--beta1", help="AdamW beta1."),
    beta2: float = typer.Option(0.95, "--beta2", help="AdamW beta2."),
    eps: float = typer.Option(1e-8, "--eps", help="AdamW epsilon."),
    clip: float = typer.Option(1.0, "--clip", help="Clip the global gradient norm to this (0: no clipping)."),
    checkpoint_dir: str = typer.Option(
        None, "--checkpoint-dir", help="Save a checkpoint (torch.distributed.checkpoint) here at the end of training."
    ),
    checkpoint_every: int = typer.Option(None, "--checkpoint-every", help="Also save a checkpoint every N steps."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest checkpoint in --checkpoint-dir (same plan)."
    ),
    stop_after: int = typer.Option(
        None, "--stop-after", help="End this run after N steps (checkpointed; the LR schedule still spans --steps)."
    ),
    init_from: str = typer.Option(
        None, "--init-from", help="Start from this Hugging Face checkpoint folder (config.json + safetensors)."
    ),
    save_hf: str = typer.Option(
        None, "--save-hf", help="Write a Hugging Face checkpoint here at the end (and at every --checkpoint-every)."
    ),
    save_hf_shard_mb: int = typer.Option(
        5000, "--save-hf-shard-mb", help="Largest safetensors file --save-hf writes (MB)."
    ),
    tokenizer: str = typer.Option(
        None, "--tokenizer", help="A tokenizer.json (or a folder holding one) to tokenize text and JSONL --data."
    ),
    text_field: str = typer.Option("text", "--text-field", help="The JSONL field holding each document's text."),
    token_dtype: str = typer.Option(
        None, "--token-dtype", help="uint16 or uint32: the ids of a raw token file without a .json sidecar."
    ),
    eos_id: int = typer.Option(
        None, "--eos-id", help="Token id separating packed documents (default: the tokenizer's end-of-text token)."
    ),
    token_cache: str = typer.Option(
        None, "--token-cache", help="Keep tokenized text in this folder and reuse it (default: a temporary folder)."
    ),
    eval_data: str = typer.Option(None, "--eval-data", help="Held-out data for --eval-every (same kinds as --data)."),
    eval_fraction: float = typer.Option(
        None, "--eval-fraction", help="Hold out this fraction of --data's sequences for evaluation."
    ),
    eval_every: int = typer.Option(None, "--eval-every", help="Evaluate the held-out loss every N steps."),
    eval_batches: int = typer.Option(4, "--eval-batches", help="Global batches per evaluation (the same each time)."),
    log_jsonl: str = typer.Option(None, "--log-jsonl", help="Append one JSON line of metrics per step to this file."),
    tensorboard: str = typer.Option(None, "--tensorboard", help="Write TensorBoard event files to this folder."),
):
    """Run a plan on torch.distributed (under torchrun, or --local worker processes)."""
    # lazy: keeps torch out of the CLI start-up
    from mist.runtime import TrainConfig, train_command

    cfg = TrainConfig(
        steps=steps,
        data=data,
        seed=seed,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup_steps=warmup,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        max_grad_norm=clip,
        metrics_path=metrics,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        stop_after=stop_after,
        init_from=init_from,
        save_hf=save_hf,
        save_hf_shard_bytes=save_hf_shard_mb * 1000**2,
        tokenizer=tokenizer,
        text_field=text_field,
        token_dtype=token_dtype,
        eos_id=eos_id,
        token_cache=token_cache,
        eval_data=eval_data,
        eval_fraction=eval_fraction,
        eval_every=eval_every,
        eval_batches=eval_batches,
        log_jsonl=log_jsonl,
        tensorboard=tensorboard,
    )
    res = train_command(plan, cfg, local)
    if res is not None:
        mfu = f"{res['mfu']:.1%}" if res["mfu"] is not None else "n/a (CPU run)"
        peaks = ", ".join(f"{s['peak_memory_bytes'] / GiB:.3f}" for s in res["stages"])
        out.print(
            f"step time {res['step_time_s'] * 1e3:.1f} ms · {res['tokens_per_s']:,.0f} tokens/s · "
            f"MFU {mfu} · peak memory per stage (GiB) {peaks} · final loss {res['losses'][-1]:.4f}"
            + (f"; metrics written to {metrics}" if metrics else "")
        )


@app.command()
def validate(
    plan: str = typer.Argument(..., help="Plan file (JSON or YAML)."),
    steps: int = typer.Option(
        3, "--steps", help="Training steps to run, at least 2 (the first is warm-up, not measured)."
    ),
    gpu: str = typer.Option(None, "--gpu", help="Profile to predict with (default: the plan's GPU)."),
    local: bool = typer.Option(False, "--local", help="Start the worker processes here instead of under torchrun."),
    drift: bool = typer.Option(
        True, "--drift/--no-drift", help="Re-measure a few of the profile's own micro-benchmarks."
    ),
    trace_memory: bool = typer.Option(
        False,
        "--trace-memory",
        help="On CPU worker processes, also measure each stage's peak from the allocator's events "
        "(operator temporaries included) over the first 2 steps, which are then not timed "
        "(needs --steps 3 or more). A GPU reports its allocator's peak anyway.",
    ),
    as_json: JsonOpt = False,
):
    """Run a plan and print predicted vs measured time and memory with signed relative errors."""
    from mist.validate import STAGE_ERRORS, allocator_prediction, run_and_validate  # lazy: torch

    p = load_plan(plan)
    profile = load_profile(gpu or p.cluster.gpu)
    r = run_and_validate(plan, profile, steps, local, drift, trace_memory)
    if r is None:
        return
    if as_json:
        print(json.dumps(r.to_json(), indent=1, default=str))
        return
    pred, meas, err = r.predicted, r.measured, r.errors
    t = Table(title=f"{p.model.name}: predicted ({profile.name}) vs measured")
    for col in ("quantity", "predicted", "measured", "error"):
        t.add_column(col, justify="right")
    fmt = lambda e: "-" if e is None else f"{e:+.1%}"  # noqa: E731
    t.add_row("step time (s)", f"{pred.iteration_time_s:.4f}", f"{meas['step_time_s']:.4f}", fmt(err["step_time"]))
    labels = {
        "stable_time": ("T, steady micro-batch (ms)", 1e-3),
        "delta_time": ("D, one-off per iteration (ms)", 1e-3),
        "weight_grad_time": ("W, weight gradients of a micro-batch (ms)", 1e-3),
        "peak_memory": ("peak memory (MiB)", MiB),
        "state_memory": ("states (MiB)", MiB),
        "saved_activations": ("saved activations (MiB)", MiB),
        "host_states": ("host: offloaded states (MiB)", MiB),
        "host_activations": ("host: offloaded activations (MiB)", MiB),
        "host_optimizer_grads": ("host: CPU Adam gradients (MiB)", MiB),
    }
    for i, (ps, ms) in enumerate(zip(pred.stages, meas.get("stages", []))):
        for name, key in STAGE_ERRORS:
            label, unit = labels[name]
            pv, mv = getattr(ps, key), ms.get(key)
            if (name.startswith("host") and not pv and not mv) or (pv is None and mv is None):
                continue  # nothing offloaded of this kind; no W of its own (not a ZB-H1 stage)
            t.add_row(
                f"stage {i} {label}",
                "-" if pv is None else f"{pv / unit:.3f}",
                "-" if mv is None else f"{mv / unit:.3f}",
                fmt(err[name][i]),
            )
        if ms.get("allocator_peak_bytes") is not None:
            t.add_row(
                f"stage {i} CPU allocator peak (MiB)",
                f"{allocator_prediction(ps) / MiB:.3f}",
                f"{ms['allocator_peak_bytes'] / MiB:.3f}",
                fmt(err["allocator_peak"][i]),
            )
    out.print(t)
    for w in r.warnings:
        out.print(f"[yellow]warning:[/] {w}")
    d = r.drift
    if d and d.get("drifted"):
        out.print(
            f"[yellow]warning:[/] this machine no longer matches the profile: its micro-benchmarks "
            f"run at {d.get('geomean_ratio', float('nan')):.2f}× the profiled times."
        )


from mist.cli_profile import profile_command  # noqa: E402  (registered as `mist profile`)


@app.command()
def export(
    plan: str = typer.Argument(..., help="Plan file (JSON or YAML)."),
    to: str = typer.Option(..., "--to", help="Framework: megatron, deepspeed or torchtitan."),
    out_dir: str = typer.Option(..., "-o", "--out", help="Folder to write the launch files into."),
    approximate: bool = typer.Option(
        False, "--approximate", help="Export the nearest plan the framework can run, and compare predictions."
    ),
    as_json: JsonOpt = False,
):
    """Write the launch files of a plan for Megatron-LM, DeepSpeed or torchtitan."""
    # lazy: keeps torch out of the CLI start-up
    from mist.export import export_plan
    from mist.simulate.plan_sim import simulate_plan

    p = load_plan(plan)
    done, ran = export_plan(p, to, out_dir, approximate)
    if as_json:
        print(json.dumps(done.to_json(), indent=1))
    else:
        out.print(f"wrote {', '.join(done.files)} to {out_dir} for {to}")
    if approximate and ran != p:
        profile = load_profile(p.cluster.gpu)
        # the nearest plan as the framework runs it (`Plan.engine`)
        a, b = simulate_plan(p, profile), simulate_plan(replace(ran, engine=to), profile)
        err.print(
            f"approximated: the plan predicts {a.iteration_time_s:.3f} s per iteration "
            f"(fits: {a.fits}); the exported nearest plan {b.iteration_time_s:.3f} s (fits: {b.fits})"
        )
        err.print(f"  exported plan: {ran.summary()}")


app.command("profile", help="Measure this machine's CPU or GPU and write a profile that --gpu accepts.")(
    profile_command
)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one sentence on stderr and exit code 2."""
    try:
        app(args=argv, standalone_mode=False)
    except MistInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as e:  # usage errors (click-style): one sentence too, and exit code 2
        if not (hasattr(e, "exit_code") and hasattr(e, "format_message")):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `mist` / `mist CMD`: the help is the answer
            e.show()
            sys.exit(e.exit_code)
        print(f"error: {usage_sentence(e)}", file=sys.stderr)
        sys.exit(2)


def usage_sentence(e) -> str:
    """A click-style usage error as one line that ends with where the help is."""
    msg = " ".join(e.format_message().split()).rstrip(".")
    ctx = getattr(e, "ctx", None)
    cmd = "mist" + (f" {ctx.info_name}" if ctx is not None and ctx.parent is not None else "")
    return f"{msg} (see '{cmd} --help')."


if __name__ == "__main__":
    main()
