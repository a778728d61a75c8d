"""Worker of test_deepspeed.py, run under torchrun on CPU gloo ranks (the data-parallel ranks of
the run): for each case given
(JSON list in argv[1] of {"config": an exported ds_config.json, "matrices": [[in, out], ...],
optionally "G": micro-batches per step, "pipeline": one stage per rank (see `pipeline`)}),
DeepSpeed's own engine trains a stand-in of those
weight matrices (no bias) for two steps, and rank 0 writes to argv[2], per case: the optimizer's
class name, the bytes of the gradient staging buffers its ZeRO optimizer holds once built, while
a backward runs (read from a gradient hook) and as each forward of the second step starts, and
the most bytes the second step allocated at once beyond what was live when it began (PyTorch's
CPU allocator, through `torch.profiler`).

usage: torchrun --nproc_per_node DP deepspeed_staging.py CASES_JSON OUT_JSON
"""

import json
import sys

import deepspeed
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from mist.torch_compat import allocation_events

CASES, OUT = json.loads(open(sys.argv[1]).read()), sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")


def staging_of(engine) -> int:
    """Bytes of the staging buffers the engine's ZeRO optimizer holds now."""
    out = 0
    for b in getattr(engine.optimizer, "ipg_buckets", {}).values():
        for t in b.buffer if isinstance(b.buffer, list) else [b.buffer]:  # ZeRO-3: one tensor
            out += 0 if t is None else t.numel() * t.element_size()
    return out


def most_live(prof) -> int:
    """The most bytes the profiled code allocated at once beyond what was live when it began."""
    live = most = 0
    for _, _, nbytes in allocation_events(prof):
        live += nbytes
        most = max(most, live)
    return most


def pipeline(case: dict, cfg: dict) -> dict:
    """A pipeline of one stage per rank (dp 1) trained by DeepSpeed's pipeline engine for two
    batches of G micro-batches: this rank's staging buffers during its backwards and as its
    forwards start (second batch), and the most its second batch allocated at once."""
    from deepspeed.pipe import PipelineModule

    G = case["G"]
    cfg.update(train_batch_size=G, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=G)
    layers = [nn.Linear(i, o, bias=False) for i, o in case["matrices"]]
    net = PipelineModule(
        layers=layers,
        num_stages=torch.distributed.get_world_size(),
        loss_fn=lambda out, y: out.float().pow(2).mean(),
        partition_method="uniform",
    )
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
    seen: list[int] = []
    at_forward: list[int] = []
    for p in engine.module.parameters():
        p.register_hook(lambda g: seen.append(staging_of(engine)) or g)
    engine.module.register_forward_pre_hook(lambda *_: at_forward.append(staging_of(engine)))
    dtype = next(engine.module.parameters()).dtype

    def batches():
        while True:
            yield torch.randn(1, case["matrices"][0][0], dtype=dtype), torch.zeros(1)

    data = batches()
    engine.train_batch(data)
    seen.clear()
    at_forward.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.train_batch(data)
    return {
        "optimizer": type(engine.optimizer).__name__,
        "staging_bytes": max(seen),
        "forward_bytes": max(at_forward),
        "batch_bytes": most_live(prof),
    }


def plain(case: dict, cfg: dict) -> dict:
    """The plain engine (one stage, the ranks data-parallel) trained for two steps of G
    micro-batches (one sample each per rank: no buffer depends on the batch): its staging buffers
    once built, during its backwards and as the second step's forwards start, and the most the
    second step's update allocated at once."""
    world, G = torch.distributed.get_world_size(), case.get("G", 1)
    cfg.update(train_batch_size=world * G, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=G)
    cfg.pop("tensor_parallel", None)
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in case["matrices"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    built = staging_of(engine)
    seen: list[int] = []
    for p in engine.module.parameters():
        p.register_hook(lambda g: seen.append(staging_of(engine)) or g)
    dtype = next(engine.module.parameters()).dtype
    at_forward: list[int] = []
    for _ in range(2):  # the first step creates the optimizer's states
        for g in range(G):
            at_forward.append(staging_of(engine))
            engine.backward(engine(torch.randn(1, case["matrices"][0][0], dtype=dtype)).float().pow(2).mean())
            if g < G - 1:
                engine.step()  # (only counts the micro-batch)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.step()
    return {
        "optimizer": type(engine.optimizer).__name__,
        "built_bytes": built,
        "staging_bytes": max(seen),
        "forward_bytes": max(at_forward[G:]),
        "step_bytes": most_live(prof),
    }


results = [
    (pipeline if case.get("pipeline") else plain)(case, json.loads(open(case["config"]).read())) for case in CASES
]
if torch.distributed.get_rank() == 0:
    open(OUT, "w").write(json.dumps(results))
