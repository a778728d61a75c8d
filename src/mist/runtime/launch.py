"""Start the processes of a plan: under torchrun, or as local worker processes (`--local`).

Under torchrun each process reads RANK / WORLD_SIZE / LOCAL_RANK and joins NCCL (GPUs) or gloo
(CPUs). With `--local` the parent forks (CPU) or spawns (CUDA) one worker per rank on a free
localhost port, waits for them and re-raises the first error; rank 0 sends back its metrics
(and, on request, the full trained weights, which the tests compare with a single process).
Everything that can be checked from the plan alone is checked before any process starts, so a
plan that cannot run ends with one sentence and exit code 2.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mist.cpu_workers import setup_cpu_worker, setup_gpu_rank, threads_per_worker
from mist.errors import MistInputError
from mist.hardware import load_profile
from mist.plan import Plan, load_plan
from mist.runtime.allocator_trace import AllocatorTrace
from mist.runtime.checkpoint import check_resume, latest_checkpoint
from mist.runtime.config import TrainConfig
from mist.runtime.datasets import prepared
from mist.runtime.hf_weights import check_hf_options
from mist.runtime.layout import build_groups
from mist.runtime.preflight import check_node_memory
from mist.runtime.step_log import check_tensorboard
from mist.runtime.trainer import Trainer
from mist.simulate.precision import profile_target
from mist.userfiles import check_output_dir, check_output_file
from mist.worker_processes import WorkerDied, poll_messages, start_workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_profile(gpu: str) -> bool:
    """Whether the plan's `gpu` is a profile that `mist profile --device cpu` measured (a plan
    tuned for this kind of CPU device runs on CPU workers, with or without --local)."""
    if not gpu.lower().endswith(".json"):
        return False
    try:
        return profile_target(load_profile(gpu)) == "cpu"
    except MistInputError:
        return False


def device_type_for(plan: Plan, local: bool) -> tuple[str, str | None]:
    """('cuda' or 'cpu', a note to print or None)."""
    gpu = plan.cluster.gpu
    if gpu.lower() == "cpu" or _cpu_profile(gpu):
        return "cpu", None
    if torch.cuda.is_available():
        return "cuda", None
    if local:
        return "cpu", (
            f"note: this machine has no CUDA device; running the {gpu} plan on "
            f"{plan.cluster.world_size} CPU worker process(es) with gloo instead."
        )
    raise MistInputError(
        f"The plan targets {gpu} GPUs but this machine has no CUDA device (use --local to run it on CPU processes)."
    )


def run_rank(
    plan: Plan,
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    init_method: str,
    want_state: bool = False,
) -> dict | None:
    """One rank, from joining the process group to leaving it; rank 0 returns its results."""
    ckpt = check_resume(plan, cfg) if cfg.resume else None  # before joining: every rank fails alike
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # (no device_id: NCCL then makes a communicator per pair of ranks that exchange messages, each
    # on its own stream, when they first do; bound to a device it would run every point-to-point
    # message of a group on the group's one stream, in posting order: `p2p.Channels`)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    try:
        groups = build_groups(plan, rank, world)
        # (before the trainer: its states are among what the allocator holds)
        allocator = AllocatorTrace() if cfg.trace_memory and device.type == "cpu" else None
        trainer = Trainer(plan, cfg, groups, device, allocator)
        if ckpt is not None:
            trainer.resume_from(ckpt[0])
        metrics = trainer.run()
        state = trainer.full_state_dict() if want_state else None
        dist.barrier()  # every rank is done with every group before any is torn down
        groups.destroy()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    out = {"metrics": metrics}
    if want_state:
        out["state"] = {k: v.numpy() for k, v in state.items()}
    return out


def _local_worker(rank, world, plan, cfg, device_type, port, want_state, q, threads):
    try:
        (setup_cpu_worker if device_type == "cpu" else setup_gpu_rank)(threads)
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        res = run_rank(plan, cfg, rank, world, device, f"tcp://127.0.0.1:{port}", want_state)
        q.put(("ok", rank, res))
    except MistInputError as e:
        q.put(("input", rank, str(e)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        q.put(("error", rank, traceback.format_exc()))


def spawn_local(
    plan: Plan,
    cfg: TrainConfig,
    *,
    device_type: str = "cpu",
    want_state: bool = False,
    start_method: str | None = None,
    threads: int | None = None,
) -> dict:
    """Run the plan on local worker processes (one per rank); rank 0's result.

    `start_method` "spawn" (default: clean interpreters) or "fork" (about a second faster per
    run when the parent already imported torch.distributed, as the tests do). `threads`: intra-op
    threads per worker (a GPU rank's are for its host AdamW); by default one for forked workers,
    because a forked child must not start OpenMP threads when its parent already ran parallel
    torch code (GNU libgomp is not fork-safe), and the cores divided among the workers otherwise.
    Text data are tokenized here, once, before the workers start (`datasets.prepared`).
    """
    if cfg.resume:
        check_resume(plan, cfg)
    t = plan.training
    with prepared(cfg, plan.model.vocab_size, t.seq_len, t.global_batch) as ready:
        return _spawn_workers(plan, ready, device_type, want_state, start_method, threads)


def _spawn_workers(plan: Plan, cfg: TrainConfig, device_type, want_state, start_method, threads) -> dict:
    world = plan.cluster.world_size
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise MistInputError(f"The plan needs {world} GPUs but this machine has {torch.cuda.device_count()}.")
    method = start_method or "spawn"
    if threads is None:
        threads = 1 if method == "fork" else threads_per_worker(world)
    ctx = mp.get_context(method)
    q = ctx.Queue()
    port = free_port()
    procs = start_workers(
        ctx, _local_worker, [(r, world, plan, cfg, device_type, port, want_state, q, threads) for r in range(world)]
    )
    result, error, done = None, None, set()
    try:
        for kind, rank, payload in poll_messages(q, procs, finished=done):
            done.add(rank)
            if kind == "ok":
                if rank == 0:
                    result = payload
            else:
                error = (kind, payload)
            if len(done) == world or error is not None:
                break
    except WorkerDied as e:
        error = ("error", f"worker {e.index} died with exit code {e.exitcode}")
    finally:
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if error is not None:
        if error[0] == "input":
            raise MistInputError(error[1])
        raise RuntimeError(f"a training worker failed:\n{error[1]}")
    return result


def _env_int(name: str, default: int | None, minimum: int) -> int:
    """An integer that torchrun (or the user) put in the environment variable `name`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise MistInputError(f"The environment variable {name} must be an integer, got {raw!r}.")
    value = int(text)
    if value < minimum:
        raise MistInputError(f"The environment variable {name} must be at least {minimum}, got {value}.")
    return value


def torchrun_env() -> tuple[int, int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them, checked."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise MistInputError(
            "mist train runs under torchrun (RANK and WORLD_SIZE are not set); "
            "use --local to start the worker processes here."
        )
    world = _env_int("WORLD_SIZE", None, 1)
    rank = _env_int("RANK", None, 0)
    local_rank = _env_int("LOCAL_RANK", 0, 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, 1)
    if rank >= world:
        raise MistInputError(f"The environment variable RANK must be below WORLD_SIZE {world}, got {rank}.")
    if local_world > world:
        raise MistInputError(
            f"The environment variable LOCAL_WORLD_SIZE must not exceed WORLD_SIZE {world}, got {local_world}."
        )
    if "LOCAL_WORLD_SIZE" in os.environ and local_rank >= local_world:
        raise MistInputError(
            f"The environment variable LOCAL_RANK must be below LOCAL_WORLD_SIZE {local_world}, got {local_rank}."
        )
    return rank, world, local_rank, local_world


def check_outputs(cfg: TrainConfig, writes_metrics: bool) -> None:
    """Before any training: the metrics file can be written (by the process that writes it) and
    the checkpoint folder exists or can be made (every rank writes its shards there; mkdir with
    exist_ok, so ranks racing to make it is harmless)."""
    if writes_metrics and cfg.metrics_path is not None:
        check_output_file(cfg.metrics_path, "--metrics")
    if writes_metrics and cfg.log_jsonl is not None:
        check_output_file(cfg.log_jsonl, "--log-jsonl")
    if writes_metrics and cfg.tensorboard is not None:
        check_tensorboard()
        check_output_dir(cfg.tensorboard, "--tensorboard")
    if cfg.checkpoint_dir is not None:
        if cfg.resume:
            latest_checkpoint(cfg.checkpoint_dir)  # no checkpoint there: say so, and make no folder
        check_output_dir(cfg.checkpoint_dir, "--checkpoint-dir")
    if writes_metrics and cfg.save_hf is not None:  # rank 0 writes the Hugging Face checkpoint
        check_output_dir(cfg.save_hf, "--save-hf")


def train_command(plan_path: str, cfg: TrainConfig, local: bool) -> dict | None:
    """`mist train`: under torchrun (env) or with local workers; prints progress on rank 0."""
    plan = load_plan(plan_path)
    world = plan.cluster.world_size
    t = plan.training
    env = None if local else torchrun_env()
    if env is not None and env[1] != world:
        raise MistInputError(
            f"The plan needs {world} processes ({plan.cluster.nodes}×"
            f"{plan.cluster.gpus_per_node} {plan.cluster.gpu}) but torchrun started {env[1]}."
        )
    check_hf_options(plan, cfg)  # --init-from's checkpoint fits the plan; --save-hf can write its model
    check_outputs(cfg, writes_metrics=env is None or env[0] == 0)  # only rank 0 writes the metrics
    # the data checked (and text tokenized) before any worker starts; the workers read token files
    with prepared(cfg, plan.model.vocab_size, t.seq_len, t.global_batch) as ready:
        return _launch(plan, ready, local, env)


def _launch(plan: Plan, cfg: TrainConfig, local: bool, env) -> dict | None:
    world = plan.cluster.world_size
    if local:
        dev, note = device_type_for(plan, local=True)
        threads = threads_per_worker(world)
        if note:
            print(note, flush=True)
        check_node_memory(plan, range(world), dev)
        if dev == "cpu":
            # this parent has run no parallel torch code, so forked workers may use threads
            res = spawn_local(plan, cfg, device_type=dev, start_method="fork", threads=threads)
        else:
            res = spawn_local(plan, cfg, device_type=dev)
        return res["metrics"] if res else None
    rank, _, local_rank, local_world = env
    dev, _ = device_type_for(plan, local=False)
    node = rank // local_world
    check_node_memory(plan, range(node * local_world, min(world, (node + 1) * local_world)), dev)
    threads = threads_per_worker(local_world)
    if dev == "cuda" and local_rank >= torch.cuda.device_count():
        raise MistInputError(f"Local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()} GPU(s).")
    if dev == "cuda":
        device = torch.device("cuda", local_rank)
        setup_gpu_rank(threads)  # not torchrun's OMP_NUM_THREADS=1
    else:
        setup_cpu_worker(threads)
        device = torch.device("cpu")
    res = run_rank(plan, cfg, rank, world, device, "env://")
    sys.stdout.flush()
    return res["metrics"] if res else None
