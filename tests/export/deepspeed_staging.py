"""Worker of test_deepspeed.py, run under torchrun on CPU gloo ranks: for each case given (JSON
list in argv[1] of {"config": an exported ds_config.json, "matrices": [[in, out], ...],
optionally "G": micro-batches per step, "pipeline": true and "stages" (see `pipeline`)}),
DeepSpeed's own engine trains a stand-in of those weight matrices (no bias, made in the run's
dtype; under ZeRO-3 made partitioned, `zero.Init`) for two steps, and rank 0 writes to argv[2],
per case: the optimizer's class name, the bytes of the gradient staging buffers its ZeRO
optimizer holds once built, while a backward runs (read from a gradient hook) and as each
forward of the second step starts, under ZeRO-3 the most bytes of parameters gathered at once in
the second step, and, from PyTorch's CPU allocator (`torch.profiler`, from before the weights
were made), the bytes live on the rank (`phases`): when the second step starts, when its last
forward starts, at most in its backwards (up to the gradient reduction), and at most from the
reduction after its last backward to the end of its update; also the most the update, and each
reduction of ZeRO-3's bucket, had allocated at once (`Live.allocates`). Not counted there: what
gloo allocates where NCCL does not, which runs on GPUs would not hold: a copy of the gathered
tensor in the all-gather of new weights (NCCL writes into the output), which gloo's worker thread
makes, also while the rank goes on after an all-gather DeepSpeed issued ahead (only what the
rank's own thread allocates counts; `gather_allocates` reports what the all-gather calls
allocated, on any thread), and of the input of ZeRO-3's reduce-scatter (NCCL reduces in place).
Python's garbage is collected as each phase starts, so that what is live does not depend on when its cyclic
collector happens to run (some of DeepSpeed's tensors are released only with reference cycles).

usage: torchrun --nproc_per_node RANKS deepspeed_staging.py CASES_JSON OUT_JSON
"""

import bisect
import contextlib
import functools
import gc
import json
import sys
import time

import deepspeed
import deepspeed.comm
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from mist.runtime.allocator_trace import GLOO_SETTLE_S, blocks_at_most, live_curve
from mist.torch_compat import allocation_events, marked_spans

CASES, OUT = json.loads(open(sys.argv[1]).read()), sys.argv[2]

# DeepSpeed's CPU accelerator admits fp16 only where oneDNN has fp16 kernels (CPUs with AVX512-FP16
# or AMX-FP16; not, e.g., the AMD EPYC of some CI machines), and its engine refuses an fp16 config
# elsewhere. PyTorch computes fp16 on every CPU, only more slowly, and what these cases read (the
# optimizers' buffers and the live bytes) does not depend on which kernels compute it: so the fp16
# cases declare fp16 supported and run on every CPU.
get_accelerator().is_fp16_supported = lambda: True

# Gloo runs each collective on a worker thread, and the work it queues holds the collective's
# tensors: where that thread drops the work last, they are released unseen and would stay live in
# the curves until their address is handed out again (`mist.runtime.allocator_trace`, where Mist's
# own traced runs settle their collectives the same way). So each collective, once done (at its
# return, or at its handle's wait), sleeps GLOO_SETTLE_S before its caller goes on and drops them.


class _Settling:
    """An async collective's handle whose wait settles as a synchronous collective does."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        time.sleep(GLOO_SETTLE_S)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def settled(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        work = f(*args, **kwargs)
        if work is None:
            time.sleep(GLOO_SETTLE_S)
            return None
        return _Settling(work)

    return wrapper


for _name in (
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "reduce_scatter",
):
    if hasattr(torch.distributed, _name):  # before DeepSpeed's backend takes them
        setattr(torch.distributed, _name, settled(getattr(torch.distributed, _name)))
deepspeed.init_distributed(dist_backend="gloo")
# Every phase and range starts with a garbage collection. The objects made so far live to the end
# (the modules of torch and DeepSpeed, the process group, and those the profiler imports when it
# first starts, which an empty profile imports here): they are moved out of the collector's
# generations, so that each collection walks only what the cases make. A full walk took 50-80 ms,
# and the ZeRO-3 cases range every gather: 90 of a run's 115 CPU-seconds went to collections.
with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
    pass
gc.collect()
gc.freeze()


def staging_of(engine) -> int:
    """Bytes of the staging buffers the engine's ZeRO optimizer holds now."""
    out = 0
    for b in getattr(engine.optimizer, "ipg_buckets", {}).values():
        for t in b.buffer if isinstance(b.buffer, list) else [b.buffer]:  # ZeRO-3: one tensor
            out += 0 if t is None else t.numel() * t.element_size()
    return out


class Live:
    """The bytes a profiled run had allocated beyond what was live when profiling began, over time."""

    def __init__(self, prof, leave_out: tuple[str, ...] = (), thread_of: str | None = "start"):
        """`leave_out`: the names of ranges whose allocations (until freed) are not counted;
        `thread_of`: only the blocks allocated on the thread that ran this range count (the
        cases' own; gloo's threads allocate their copies for the collectives there, and an
        all-gather that DeepSpeed issued ahead runs there while its caller goes on:
        `allocation_events`)."""
        self.left = sorted(s for name in leave_out for s in marked_spans(prof, name))
        self.events = allocation_events(prof, thread_of)
        curve, _ = live_curve(self.events, self.left)
        self.prof, self.times, self.live = prof, [t for t, _ in curve], [v for _, v in curve]

    def at(self, t: float) -> int:
        """Live bytes just before time t."""
        i = bisect.bisect_left(self.times, t)
        return self.live[i - 1] if i else 0

    def most(self, t0: float = float("-inf"), t1: float = float("inf")) -> int:
        """The most bytes live at once from t0 to t1."""
        i, j = bisect.bisect_left(self.times, t0), bisect.bisect_left(self.times, t1)
        return max([self.at(t0), *self.live[i:j]])

    def spans(self, name: str, since: float = float("-inf")) -> list[tuple[int, int]]:
        """The `name` ranges that began after `since`."""
        return [s for s in marked_spans(self.prof, name) if s[0] > since]

    def allocates(self, name: str, since: float = float("-inf")) -> int:
        """The most bytes any `name` range had allocated and not yet released at once (0: none
        ran): the live curve of its own events, so what it releases of blocks made before it does
        not offset them."""
        return self._most_in(name, since)[0]

    def _most_in(self, name: str, since: float) -> tuple[int, list[tuple[int, int, int]]]:
        """`allocates`, and the blocks live where that range had the most allocated."""
        best: tuple[int, list[tuple[int, int, int]]] = (0, [])
        for a, b in self.spans(name, since):
            events = self.events[bisect.bisect_left(self.times, a) : bisect.bisect_right(self.times, b)]
            best = max(best, blocks_at_most(events, self.left), key=lambda m: m[0])
        return best

    def phases(self) -> dict:
        """Live bytes in the second step (the module docstring's `phases`)."""
        start = self.spans("start")[0][0]
        reduce_at = self.spans("reduce", start)[-1][0]
        backward = [min(b, reduce_at) for a, b in self.spans("backward", start)]
        return {
            "between": self.at(start),
            "forward": self.at(self.spans("forward", start)[-1][0]),
            "backward": max(self.most(a, b) for (a, _), b in zip(self.spans("backward", start), backward)),
            "after": self.most(reduce_at, self.spans("update", start)[-1][1]),
            "update_allocates": self.allocates("update", start),
            "gather_allocates": Live(self.prof, thread_of=None).allocates("gather", start),
            "flush_allocates": self.allocates("flush", start),
            "flush_blocks": self.blocks_at_most("flush", start),
        }

    def blocks_at_most(self, name: str, since: float) -> list[tuple[int, str]]:
        """(bytes, the operator that allocated it) of each block live where the `name` range that
        allocated the most (`allocates`) had the most allocated: what a check that fails on
        `allocates` names."""
        from torch._C._profiler import _EventType

        from mist.torch_compat import _event_nodes

        made_by = {
            (n.start_time_ns, n.typed[1].ptr): n.parent.name if n.parent is not None else "?"
            for n in _event_nodes(self.prof)
            if n.typed[0] == _EventType.Allocation and n.typed[1].alloc_size > 0
        }
        return [(n, made_by.get((t0, addr), "?")) for t0, addr, n in self._most_in(name, since)[1]]


def ranged(f, name: str):
    """`f`, run inside a `record_function(name)` range, Python's garbage collected first."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        gc.collect()
        with record_function(name):
            return f(*args, **kwargs)

    return wrapper


def phase(name: str):
    """A `record_function(name)` range, Python's garbage collected first."""
    gc.collect()
    return record_function(name)


deepspeed.comm.all_gather_into_tensor = ranged(deepspeed.comm.all_gather_into_tensor, "gather")
# (gloo reduce-scatters a copy of its input, where NCCL reduces it in place: left out too)
deepspeed.comm.reduce_scatter_fn = ranged(deepspeed.comm.reduce_scatter_fn, "scatter")
GLOO_COPIES = ("gather", "scatter")


def gathered_now(engine) -> int:
    """Bytes of the ZeRO-3 parameters gathered (or being gathered) now, beside those it keeps
    gathered throughout (`ds_persist`: none in these stand-ins)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(
        p.ds_numel * p.element_size()
        for p in engine.module.parameters()
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist
    )


def run_dtype(cfg: dict) -> torch.dtype:
    if cfg.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    return torch.float16 if cfg.get("fp16", {}).get("enabled") else torch.float32


def pipeline(case: dict, cfg: dict) -> dict:
    """A pipeline of `stages` stages (by default one per rank, dp 1) trained by DeepSpeed's
    pipeline engine for two batches of G micro-batches (one sample each): its staging buffers
    during its backwards and as its forwards start (second batch), and the live bytes."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe import schedule

    G, world, dtype = case["G"], torch.distributed.get_world_size(), run_dtype(cfg)
    stages = case.get("stages", world)
    cfg.update(train_batch_size=G * world // stages, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=G)
    seen: list[int] = []
    at_forward: list[int] = []

    def batches():
        while True:
            yield torch.randn(1, case["matrices"][0][0], dtype=dtype), torch.zeros(1)

    data = batches()
    gc.collect()  # the cases before: their engines are released with reference cycles
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        net = PipelineModule(  # LayerSpec: each rank makes its own stage's weights only
            layers=[LayerSpec(nn.Linear, i, o, bias=False, dtype=dtype) for i, o in case["matrices"]],
            num_stages=stages,
            loss_fn=lambda out, y: out.float().pow(2).mean(),
            partition_method="uniform",
        )
        engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
        # the engine runs its schedule's instructions from a class-level table of functions
        table = dict(engine._INSTRUCTION_MAP)
        for kind, name in (
            (schedule.ForwardPass, "forward"),
            (schedule.BackwardPass, "backward"),
            (schedule.ReduceGrads, "reduce"),
            (schedule.OptimizerStep, "update"),
        ):
            table[kind] = ranged(table[kind], name)
        engine._INSTRUCTION_MAP = table
        for p in engine.module.parameters():
            p.register_hook(lambda g: seen.append(staging_of(engine)) or g)
        engine.module.register_forward_pre_hook(lambda *_: at_forward.append(staging_of(engine)))
        engine.train_batch(data)
        seen.clear()
        at_forward.clear()
        with phase("start"):
            pass
        engine.train_batch(data)
    return {
        "optimizer": type(engine.optimizer).__name__,
        "staging_bytes": max(seen),
        "forward_bytes": max(at_forward),
        **Live(prof, leave_out=GLOO_COPIES).phases(),
    }


def plain(case: dict, cfg: dict) -> dict:
    """The plain engine (one stage, the ranks data-parallel) trained for two steps of G
    micro-batches (one sample each per rank: no buffer depends on the batch): its staging buffers
    once built, during its backwards and as the second step's forwards start, and the live bytes."""
    world, G, dtype = torch.distributed.get_world_size(), case.get("G", 1), run_dtype(cfg)
    cfg.update(train_batch_size=world * G, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=G)
    cfg.pop("tensor_parallel", None)
    seen: list[int] = []
    at_forward: list[int] = []
    gc.collect()  # the cases before: their engines are released with reference cycles
    zero3 = cfg["zero_optimization"]["stage"] == 3
    gathered: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # ZeRO-3 models are made partitioned (`zero.Init`), as large ones must be
        with deepspeed.zero.Init(config_dict_or_path=cfg) if zero3 else contextlib.nullcontext():
            model = nn.Sequential(*(nn.Linear(i, o, bias=False, dtype=dtype) for i, o in case["matrices"]))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.allreduce_gradients = ranged(engine.allreduce_gradients, "reduce")
        built = staging_of(engine)
        for p in engine.module.parameters():
            p.register_hook(lambda g: seen.append(staging_of(engine)) or g)
        if zero3:  # each reduction of the bucket; the parameters gathered as each matrix runs
            flush = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
            setattr(engine.optimizer, flush, ranged(getattr(engine.optimizer, flush), "flush"))
            for m in engine.module:  # (DeepSpeed's own hooks, which gather, run first)
                m.register_forward_pre_hook(lambda *_: gathered.append(gathered_now(engine)))
                m.register_full_backward_pre_hook(lambda *_: gathered.append(gathered_now(engine)))
        for step in range(2):  # the first step creates the optimizer's states
            if step:
                with phase("start"):
                    pass
                gathered.clear()
            for g in range(G):
                at_forward.append(staging_of(engine))
                with phase("forward"):
                    loss = engine(torch.randn(1, case["matrices"][0][0], dtype=dtype)).float().pow(2).mean()
                with phase("backward"):
                    engine.backward(loss)
                with phase("update" if g == G - 1 else "count"):
                    engine.step()  # (but the last only counts the micro-batch)
    return {
        "optimizer": type(engine.optimizer).__name__,
        "built_bytes": built,
        "staging_bytes": max(seen),
        "forward_bytes": max(at_forward[G:]),
        "gathered_bytes": max(gathered, default=0),
        **Live(prof, leave_out=GLOO_COPIES).phases(),
    }


results = [
    (pipeline if case.get("pipeline") else plain)(case, json.loads(open(case["config"]).read())) for case in CASES
]
if torch.distributed.get_rank() == 0:
    open(OUT, "w").write(json.dumps(results))
gc.unfreeze()  # (so that the interpreter's shutdown releases them as usual)
