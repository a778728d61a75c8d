"""Train one rank's part of a plan: build, initialise, step, measure.

`Trainer` owns this rank's stage (modules on its TP shard, one `FlatUnit` per embedding / block /
head), the sharded AdamW, the data, and the metrics. `launch.py` starts the processes.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from mist.errors import MistInputError
from mist.hardware import load_profile
from mist.models import TPGroup
from mist.models.collectives import CPGroup
from mist.models.context_parallel import local_tokens
from mist.models.dropout import seed_dropout
from mist.models.dtypes import torch_dtype
from mist.plan import Offload, Plan
from mist.rules.compiled_blocks import compile_mode
from mist.rules.zero_bubble_order import ZB_H1
from mist.runtime import checkpoint, hf_weights
from mist.runtime.activations import SavedTensorManager
from mist.runtime.allocator_trace import TRACED_STEPS, AllocatorTrace
from mist.runtime.config import TrainConfig
from mist.runtime.data import split_micro_batches
from mist.runtime.datasets import build_data, tokenizer_path
from mist.runtime.flat import Comms, FlatUnit, all_gather_flat
from mist.runtime.interleaved import ChunkedStageModule, ChunkRunners, InterleavedSchedule, chunk_links
from mist.runtime.layout import RankGroups
from mist.runtime.memory import MemoryAccount
from mist.runtime.optimizer import LossScaler, ShardedAdamW, lr_at
from mist.runtime.param_role import ParamRole
from mist.runtime.phase_timer import PhaseTimer, stage_times, weight_grad_time
from mist.runtime.schedule import GradAccumSchedule, Links, PipelineSchedule
from mist.runtime.sharding import full_meta_model, init_stage_params, kv_replicated_rows, tp_slice
from mist.runtime.stage_runner import StageModule, StageRunner
from mist.runtime.step_log import StepLog, StepRecord
from mist.runtime.zero_bubble import ZeroBubbleSchedule


def model_flops_per_step(plan: Plan) -> float:
    """6 · parameters · tokens plus attention (12 · layers · hidden · seq per token)."""
    m, t = plan.model, plan.training
    tokens = t.global_batch * t.seq_len
    return 6.0 * m.total_params() * tokens + 12.0 * m.num_layers * m.hidden_size * t.seq_len * tokens


def working_dtypes(plan: Plan):
    """(working weight dtype, autocast dtype or None, fp16 loss scaling?)."""
    t = plan.training
    wd, cd = torch_dtype(t.param_dtype), torch_dtype(t.compute_dtype)
    if wd == cd:
        return wd, None, wd == torch.float16
    if wd != torch.float32:
        raise MistInputError(
            f"mist train runs compute in {t.compute_dtype} only with {t.compute_dtype} or fp32 "
            f"parameters, not {t.param_dtype}."
        )
    return wd, cd, cd == torch.float16


def grad_dtype(plan: Plan) -> torch.dtype:
    """The dtype gradients are accumulated and reduced in: the parameters' unless the plan asks
    for fp32 (16-bit gradients of each micro-batch added into fp32 buffers)."""
    t = plan.training
    return torch_dtype(t.grad_dtype or t.param_dtype)


def _param_role(name: str, p: torch.Tensor, spec, tp: int, tp_rank: int) -> ParamRole:
    decay = p.dim() >= 2
    if tp == 1:
        return ParamRole(decay)
    if tp_slice(name, spec, tp, tp_rank) is None:
        # replicated on every TP rank: counted once, on rank 0
        return ParamRole(decay, norm_skip=(0, p.numel()) if tp_rank != 0 else None)
    rows = kv_replicated_rows(name, spec, tp, tp_rank)
    if rows is None:
        return ParamRole(decay)
    cols = p.numel() // p.shape[0]
    kv = (rows[0] * cols, rows[1] * cols)
    return ParamRole(decay, norm_skip=kv if tp_rank % (tp // spec.num_kv_heads) else None, kv_range=kv)


def settle_garbage_collector() -> None:
    """After the first step: move every object alive to the garbage collector's permanent
    generation (`gc.freeze`), so that no later collection walks them again. A compiled run holds
    hundreds of thousands of them after compiling (Dynamo's and Inductor's graphs and code); a
    full collection over those took ~0.2 s here on a CPU, and one step of five of a compiled
    llama-1.3b on an H200 took 0.585 s where the others took 0.297 s
    (benchmarks/results/gpu_loop.md). No collection runs first: it would cost that once per run
    (many runs in one process add up), and garbage frozen with the rest only waits until `run`
    unfreezes everything when training ends. Objects made later are collected as before."""
    gc.freeze()


class Trainer:
    def __init__(
        self,
        plan: Plan,
        cfg: TrainConfig,
        groups: RankGroups,
        device: torch.device,
        allocator: AllocatorTrace | None = None,
    ):
        self.plan, self.cfg, self.groups = plan, cfg, groups
        self.allocator = allocator  # recording since before this trainer was built (a traced CPU run)
        self.device = torch.device(device)
        spec, t = plan.model, plan.training
        lay = groups.stage
        st = plan.stages[lay.index]
        self.stage = st
        spec.check_seq_len(t.seq_len)
        self.dtype, autocast, fp16 = working_dtypes(plan)
        self.grad_dtype = grad_dtype(plan)
        self.scaler = LossScaler(fp16)
        cp = CPGroup(lay.cp, groups.cp_rank, groups.cp_group)
        self.tp = TPGroup(lay.tp, groups.tp_rank, groups.tp_group, st.sequence_parallel, cp)
        self.module = self._build_module()
        self.memory = MemoryAccount()
        self.units = self._build_units(self._unit_params())
        # the checkpoint's slices this rank owns (a resumed run takes its weights from --resume)
        self.hf_load = hf_weights.load_into(self, cfg.init_from) if cfg.init_from and not cfg.resume else None

        def is_weight(x: torch.Tensor) -> bool:
            ptr = x.untyped_storage().data_ptr()
            return any(u.materialized and u.storage_ptr() == ptr for u in self.units)

        self.saved = SavedTensorManager(self.device, self.memory, is_weight)
        self.timer = PhaseTimer(self.device)
        self.runner: StageRunner | ChunkRunners
        if isinstance(self.module, ChunkedStageModule):  # one runner per model chunk
            self.runner = ChunkRunners.build(
                self.module, self.units, st, self.saved, autocast, compiled=t.compile_blocks
            )
        else:
            self.runner = StageRunner(
                self.module,
                self.units,
                st.recompute_layers,
                st.recompute_attention,
                st.recompute_activation,
                st.offload.activations,
                self.saved,
                autocast,
                compiled=compile_mode(t.compile_blocks, plan.schedule),
            )
        self.schedule = self._build_schedule()
        if groups.channels is not None:  # a pipeline: its message streams opened before the first step
            groups.channels.open(self.schedule.streams(groups.rank), self.device)
        self.optimizer = ShardedAdamW(
            self.units,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            scaler=self.scaler,
        )
        # the launcher checked the data (`datasets.prepared`): no second scan of the token ids here
        self.data, self.eval_batches = build_data(cfg, spec.vocab_size, t.seq_len, t.global_batch, check=False)
        self.history: list[dict] = []
        self.start_step = 0

    # ------------------------------------------------------------ construction
    def _build_module(self) -> StageModule | ChunkedStageModule:
        """This stage's modules in fp32 on the CPU, seeded exactly like the single-process model
        (on the meta device with --init-from)."""
        plan, lay = self.plan, self.groups.stage
        spec, st, flash = plan.model, self.stage, plan.training.flash_attention
        first, last = lay.index == 0, lay.index == plan.num_stages - 1
        # from a checkpoint the modules are only shapes (meta): each flat unit is then built from
        # zeros and `hf_weights.load_into` fills the slices this rank owns, so that building holds
        # at most one unit's whole (TP-local) weights beyond what the rank keeps
        device = "meta" if self.cfg.init_from is not None else "cpu"
        if plan.virtual_stages > 1:  # interleaved 1F1B: the rank's v chunks (`runtime.interleaved`)
            module = ChunkedStageModule(plan, lay.index, self.tp, flash, device=device)
        else:
            module = StageModule(spec, self.tp, flash, first, last, st.layers, lay.first_layer, device=device)
        local = {}
        for n, p in module.named_parameters():
            local[module.full_name(n)] = p
        if self.cfg.init_from is None:
            init_stage_params(local, spec, lay.tp, self.groups.tp_rank, self.cfg.seed, flash)
        return module

    def _unit_params(self) -> list[tuple[str, list, list[ParamRole]]]:
        """(prefix, [(name, parameter, owner)], roles) of every flat unit, each parameter once.

        In a pipeline with tied embeddings the word embedding has a copy on the first and on the
        last stage; their gradients are summed after each step over every rank holding the same
        vocabulary rows (`self.tied`: unit index → parameter indices; `FlatUnit.reduce_deferred`),
        and only the first stage's copy counts in the gradient norm."""
        module, spec, lay = self.module, self.plan.model, self.groups.stage
        owners = module.owners()
        seen: set[int] = set()
        unit_params = []  # gathered first: a FlatUnit replaces its (possibly shared) parameters
        self.tied: dict[int, list[int]] = {}
        pp_tied = spec.tie_embeddings and self.plan.num_stages > 1
        for prefix, mod in module.unit_modules():
            plist, infos = [], []
            for n, p in mod.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = module.full_name(f"{prefix}.{n}")
                info = _param_role(name, p, spec, lay.tp, self.groups.tp_rank)
                if pp_tied and name == "embedding.word":
                    self.tied.setdefault(len(unit_params), []).append(len(plist))
                    if prefix == "head":
                        info = replace(info, norm_skip=(0, p.numel()))
                plist.append((name, p, owners[id(p)]))
                infos.append(info)
            unit_params.append((prefix, plist, infos))
        return unit_params

    def _build_units(self, unit_params) -> list[FlatUnit]:
        plan, st, groups = self.plan, self.stage, self.groups
        # gradients are averaged over the dp × cp replicas (each a token mean of its positions)
        comms = Comms(st.dp * st.cp, groups.dp_rank, groups.dp_group, groups.kv_group, groups.kv_size)
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        units: list[FlatUnit] = []
        for prefix, plist, infos in unit_params:
            # offloading applies to the decoder blocks (the embedding and head are sharded like
            # the stage but never offloaded, as the cost model assumes)
            off = st.offload if prefix.startswith("blocks.") else Offload()
            units.append(
                FlatUnit(
                    self.module.full_name(prefix),
                    plist,
                    infos,
                    dtype=self.dtype,
                    device=self.device,
                    comms=comms,
                    zero=st.zero,
                    weights=off.weights,
                    grads=off.grads,
                    optimizer=off.optimizer,
                    micro_batches=plan.micro_batches,
                    memory=self.memory,
                    copy_stream=copy_stream,
                    grad_dtype=self.grad_dtype,
                )
            )
        if plan.model.tie_embeddings and plan.num_stages == 1:
            units[0].keep_until_backward = True
        for k in self.tied:
            units[k].defer_reduce = True
        return units

    def _build_schedule(self) -> PipelineSchedule | GradAccumSchedule | InterleavedSchedule:
        plan, groups, st = self.plan, self.groups, self.stage
        lay = groups.stage
        if plan.virtual_stages > 1:
            links = chunk_links(groups, plan.virtual_stages, st.micro_batch)
            return InterleavedSchedule(plan.micro_batches, lay.index, plan.num_stages, links, self.device)
        if plan.num_stages == 1:
            return GradAccumSchedule(plan.micro_batches)
        last = lay.index == plan.num_stages - 1
        nxt = groups.stages[lay.index + 1] if not last else None
        links = Links(
            tuple(groups.incoming(-1)),
            tuple(groups.outgoing(-1)),
            tuple(groups.incoming(1)),
            tuple(groups.outgoing(1)),
            rows=st.micro_batch,
            grad_scale=st.dp / nxt.dp if nxt else 1.0,
            channels=groups.channels,
        )
        # ZB-H1 (`runtime.zero_bubble`): the same links, the backward split into B and W
        cls = ZeroBubbleSchedule if plan.schedule == ZB_H1 else PipelineSchedule
        return cls(plan.micro_batches, lay.index, plan.num_stages, links, self.device)

    # ------------------------------------------------------------ checkpoints
    def resume_from(self, path) -> None:
        """Restore the state of a checkpoint (collective); training continues at its step."""
        self.start_step = checkpoint.load(self, path)

    def save_checkpoint(self, step: int) -> None:
        self.optimizer.flush()
        path = checkpoint.save(self, self.cfg.checkpoint_dir, step)
        if self.cfg.log and self.groups.rank == 0:
            print(f"checkpoint saved to {path}", flush=True)
        if self.cfg.save_hf:
            self.save_hf()

    def save_hf(self) -> None:
        """Write the weights as a Hugging Face checkpoint to cfg.save_hf (collective)."""
        tok = tokenizer_path(self.cfg)
        path = hf_weights.save_from(self, self.cfg.save_hf, self.cfg.save_hf_shard_bytes, tok)
        if self.cfg.log and path is not None:
            print(f"Hugging Face checkpoint saved to {path}", flush=True)

    # ------------------------------------------------------------ training
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, step: int) -> dict:
        cfg, g = self.cfg, self.groups
        lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
        pos = getattr(self.data, "position", None)  # the sampler's, for packed token data
        batch = self.data.global_batch(step)
        mbs = self._micro_batches(batch)
        if self.plan.model.has_dropout:  # this step's masks (`mist.models.dropout`)
            seed_dropout(cfg.seed, step, g.stage.index, g.dp_rank, g.tp_rank)
        self._sync()
        t0 = time.perf_counter()
        self.timer.reset()
        losses = self.schedule.run(self.runner, mbs, self.scaler.scale, timer=self.timer)
        for k, idx in self.tied.items():
            self.units[k].reduce_deferred(idx, g.tied, 1.0 / (self.stage.dp * self.stage.cp))
        res = self.optimizer.step(lr, self.device, timer=self.timer)
        loss = self._global_loss(losses)
        self._sync()
        dt = time.perf_counter() - t0
        spans = self.timer.seconds()
        T, D = stage_times(spans["fwd"], spans["bwd"], sum(spans["opt"]))
        rec = {
            "step": step,
            "loss": float(loss.item()),
            "lr": lr,
            "grad_norm": res.grad_norm,
            "skipped": res.skipped,
            "time_s": dt,
            "stable_time_s": T,
            "delta_time_s": D,
            "weight_grad_time_s": weight_grad_time(spans["wgrad"]),
            "data_position": (pos.epoch, pos.index) if pos is not None else None,
        }
        self.history.append(rec)
        return rec

    def _micro_batches(self, batch: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (tokens, targets) of each micro-batch: its data replica's rows, and under
        context parallelism its 2 of the 2·cp sequence chunks."""
        g, cp = self.groups, self.stage.cp
        return [
            (local_tokens(x, cp, g.cp_rank).to(self.device), local_tokens(y, cp, g.cp_rank).to(self.device))
            for x, y in split_micro_batches(batch, self.plan.micro_batches, self.stage.dp, g.data_rank)
        ]

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the micro-batch losses over the whole global batch, on every rank."""
        g = self.groups
        last = g.stage.index == self.plan.num_stages - 1
        loss = torch.stack(losses).float().mean() if last else torch.zeros((), dtype=torch.float32, device=self.device)
        if last and g.dp_group is not None:
            dist.all_reduce(loss, group=g.dp_group)
            loss /= self.stage.dp * self.stage.cp
        if self.plan.num_stages > 1:
            # the loss exists on the last stage: every rank (rank 0 reports it) gets it from there
            dist.broadcast(loss, src=g.stages[-1].first_rank)
        return loss

    def evaluate(self) -> float:
        """The mean loss over the fixed evaluation batches, forward only (collective)."""
        total = 0.0
        self.module.eval()  # no dropout
        try:
            for batch in self.eval_batches:
                mbs = self._micro_batches(batch)
                total += float(self._global_loss(self.schedule.forward_only(self.runner, mbs)).item())
        finally:
            self.module.train()
        return total / len(self.eval_batches)

    def _peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else self.memory.peak

    def _peak_flops(self) -> float | None:
        try:
            return load_profile(self.plan.cluster.gpu).peak_flops
        except MistInputError:
            return None

    def run(self) -> dict | None:
        """Train cfg.steps steps; return the metrics on rank 0 (None elsewhere)."""
        t = self.plan.training
        tokens = t.global_batch * t.seq_len
        cfg = self.cfg
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.start_step + cfg.stop_after)
        rank0 = self.groups.rank == 0
        log = (
            StepLog(cfg.steps, self.start_step, plain=cfg.log, jsonl=cfg.log_jsonl, tensorboard=cfg.tensorboard)
            if rank0
            else None
        )
        per_step_memory = bool(cfg.log_jsonl or cfg.tensorboard)  # a collective: every rank or none
        flops, peak_flops = model_flops_per_step(self.plan), self._peak_flops()
        if self.allocator is not None:
            self.allocator.mark()
        try:
            for step in range(self.start_step, end):
                rec = self.train_step(step)
                if step == self.start_step:
                    settle_garbage_collector()
                if self.allocator is not None and step + 1 - self.start_step == TRACED_STEPS:
                    self.allocator.stop()
                # held-out loss every eval_every steps and at the end of the schedule
                if self.eval_batches and (
                    (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps
                ):
                    rec["eval_loss"] = self.evaluate()
                peaks = [p for (p,), _ in self.stage_maxima([self._peak_bytes()])] if per_step_memory else None
                if log is not None:
                    mfu = (
                        flops / rec["time_s"] / (self.plan.cluster.world_size * peak_flops)
                        if peak_flops and self.device.type == "cuda"
                        else None
                    )
                    log.step(
                        StepRecord(
                            step=step + 1,
                            loss=rec["loss"],
                            lr=rec["lr"],
                            grad_norm=rec["grad_norm"],
                            tokens_per_s=tokens / rec["time_s"],
                            time_s=rec["time_s"],
                            skipped=bool(rec["skipped"]),
                            mfu=mfu,
                            stage_peak_memory_bytes=tuple(peaks) if peaks is not None else None,
                            eval_loss=rec.get("eval_loss"),
                            data_position=rec["data_position"],
                        )
                    )
                if cfg.checkpoint_dir and (
                    step + 1 == end or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                ):
                    self.save_checkpoint(step + 1)
        finally:
            gc.unfreeze()  # (what was alive at the first step is collectable again)
            if log is not None:
                log.close()
        # the last step's deferred host optimizer work (a step's time includes the previous one's,
        # as in steady state)
        self.optimizer.close()
        if cfg.save_hf and not cfg.checkpoint_dir:  # with checkpoints, saved with the last one
            self.save_hf()
        metrics = self.metrics()
        if self.hf_load is not None and self.groups.rank == 0:  # what each rank read (hf_weights.LoadStats)
            metrics["hf_load"] = [asdict(s) for s in self.hf_load]
        if self.groups.rank == 0 and self.cfg.metrics_path:
            with open(self.cfg.metrics_path, "w") as f:
                json.dump(metrics, f, indent=1)
        return metrics if self.groups.rank == 0 else None

    # ------------------------------------------------------------ metrics
    def host_bytes(self) -> int:
        """Host (CPU) memory of this rank's offloaded states: weights, gradients, optimizer."""
        n = 0
        for u in self.units:
            n += 3 * u.master.host_bytes
            n += u.store.host_bytes if u.store is not None else 0
            n += u.acc.host_bytes
        return n

    def stage_maxima(self, values: list[float], seconds: list[float] = ()) -> list:
        """Per stage, the largest of each value over the stage's ranks (collective over the world):
        [(ints, floats)] for integer `values` (bytes) and float `seconds`."""
        n, k = self.plan.num_stages, len(values)
        t = torch.zeros(n, k + len(seconds), dtype=torch.float64, device=self.device)
        t[:, k:] = -1e300  # times may be negative (a D below noise); other stages' rows must not win
        t[self.groups.stage.index] = torch.tensor(list(values) + list(seconds), dtype=torch.float64)
        if self.groups.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [([int(v) for v in row[:k]], [float(v) for v in row[k:]]) for row in t.tolist()]

    def _allocator_bytes(self) -> tuple[int, int]:
        """(peak bytes reserved by PyTorch's caching allocator, device bytes in use outside it now:
        total − free − reserved) on a GPU; (0, 0) on a CPU."""
        if self.device.type != "cuda":
            return 0, 0
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return torch.cuda.max_memory_reserved(self.device), max(0, total - free - reserved)

    def metrics(self) -> dict:
        t = self.plan.training
        cuda = self.device.type == "cuda"
        tokens = t.global_batch * t.seq_len
        times = [r["time_s"] for r in self.history]
        # the first step warms up; a traced run's traced steps ran under the profiler
        skip = TRACED_STEPS if self.allocator is not None else 1
        steady = self.history[skip:] if len(self.history) > skip else self.history[-1:]
        step_time, T, D = (sum(r[k] for r in steady) / len(steady) for k in ("time_s", "stable_time_s", "delta_time_s"))
        ws = [r["weight_grad_time_s"] for r in steady if r.get("weight_grad_time_s") is not None]
        W = sum(ws) / len(ws) if ws else -1.0  # (-1: this rank runs no W of its own)
        try:
            peak_flops = load_profile(self.plan.cluster.gpu).peak_flops
        except MistInputError:
            peak_flops = None
        flops = model_flops_per_step(self.plan)
        mfu = (
            flops / step_time / (self.plan.cluster.world_size * peak_flops)
            if peak_flops and self.device.type == "cuda"
            else None
        )
        source = (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else "accounted: device part of weights, gradients, optimizer states, materialised "
            "weights and kept saved activations (CPU run, no allocator statistics)"
        )
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else self.memory.peak
        reserved, outside = self._allocator_bytes()
        traced = self.allocator.stop() if self.allocator is not None else None
        per_stage = self.stage_maxima(
            [
                peak,
                traced.peak_bytes if traced else -1,
                traced.unseen_releases if traced else -1,
                reserved,
                outside,
                self.host_bytes(),
                self.saved.offloaded_bytes,
                self.memory.persistent,
                self.memory.activations_peak,
                self.saved.host_peak,
                self.optimizer.host_grad_peak,
            ],
            [T, D, W],
        )
        return {
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "mfu": mfu,
            "model_flops_per_step": flops,
            "losses": [r["loss"] for r in self.history],
            "eval_losses": [[r["step"] + 1, r["eval_loss"]] for r in self.history if "eval_loss" in r],
            "data_positions": [r["data_position"] for r in self.history],
            "grad_norms": [r["grad_norm"] for r in self.history],
            "lrs": [r["lr"] for r in self.history],
            "step_times_s": times,
            "skipped_steps": sum(r["skipped"] for r in self.history),
            "device": self.device.type,
            "world_size": self.groups.world,
            # state_bytes, saved_activation_peak_bytes: tensor accounting on every device (the
            # device part of weights, gradients and optimizer states; the most saved-activation
            # bytes kept on the device at once), comparable byte for byte with `mist simulate`
            # stable_time_s, delta_time_s: the stage's T and D (see `phase_timer`), slowest rank;
            # weight_grad_time_s: a ZB-H1 stage's W of one micro-batch (None: no W of its own);
            # host_*: host memory of the offloaded state tails, the most offloaded activation
            # bytes held at once, the CPU AdamW's fp32 gradient copies (`mist simulate`'s host_memory)
            "stages": [
                {
                    "peak_memory_bytes": p,
                    "peak_memory_source": source,
                    # GPU runs: the allocator's peak reserved bytes, and the device bytes in use
                    # outside it (CUDA context, NCCL, libraries) after the last step (None on a CPU)
                    "peak_reserved_bytes": r if cuda else None,
                    # traced CPU runs (`TrainConfig.trace_memory`): the most bytes the CPU allocator
                    # held at once, operator temporaries and any host tails included (one memory),
                    # over the traced steps, and the blocks released unseen (runtime/allocator_trace.py)
                    "allocator_peak_bytes": ap if ap >= 0 else None,
                    "allocator_unseen_releases": au if au >= 0 else None,
                    "outside_allocator_bytes": o if cuda else None,
                    "host_state_bytes": h,
                    "activation_bytes_offloaded": a,
                    "state_bytes": st,
                    "saved_activation_peak_bytes": sa,
                    "host_activation_peak_bytes": hp,
                    "host_optimizer_grad_bytes": hg,
                    "stable_time_s": t,
                    "delta_time_s": d,
                    "weight_grad_time_s": w if w >= 0 else None,
                }
                for (p, ap, au, r, o, h, a, st, sa, hp, hg), (t, d, w) in per_stage
            ],
        }

    # ------------------------------------------------------------ export
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights as the single-process model's state dict (rank 0; collective)."""
        self.optimizer.flush()
        g, spec = self.groups, self.plan.model
        tp = self.tp.size
        shapes = {n: p.shape for n, p in full_meta_model(spec, self.plan.training.flash_attention).named_parameters()}
        out = {}
        for u in self.units:
            m = u.master.read(0, u.L, self.device).contiguous()
            if u.zero >= 1 and g.dp_group is not None:
                full = torch.empty(u.Np, dtype=torch.float32, device=self.device)
                all_gather_flat(full, m, group=g.dp_group)
            else:
                full = m
            for info in u.infos:
                local = full[info.offset : info.offset + info.numel].view(info.shape)
                sl = tp_slice(info.name, spec, tp, g.tp_rank)
                if sl is None:
                    value = local.clone()
                else:
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local.contiguous(), group=g.tp_group)
                    value = torch.zeros(shapes[info.name], dtype=torch.float32, device=self.device)
                    for r, part in enumerate(parts):
                        dim, idx = tp_slice(info.name, spec, tp, r)
                        value.index_copy_(dim, idx.to(self.device), part)
                out[info.name] = value.cpu()
        if self.plan.num_stages > 1:
            # each stage's first rank holds its stage's weights; rank 0 merges them (a tied
            # embedding's copy on the last stage equals the first stage's)
            mine = out if g.rank == g.stage.first_rank else None
            parts = [None] * g.world if g.rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
            if g.rank != 0:
                return None
            out = {}
            for part in parts:
                for k, v in (part or {}).items():
                    out.setdefault(k, v)
        return out if g.rank == 0 else None
