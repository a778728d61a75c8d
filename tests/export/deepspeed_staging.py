"""Worker of test_deepspeed.py, run under torchrun on CPU gloo ranks (the data-parallel ranks of
the run): for each case given
(JSON list in argv[1] of {"config": an exported ds_config.json, "matrices": [[in, out], ...]}),
DeepSpeed's own engine trains a stand-in of those weight matrices (no bias) for two steps, and
rank 0 writes to argv[2], per case: the optimizer's class name, the bytes of the gradient staging
buffers its ZeRO optimizer holds once built and while the second backward runs (read from a
gradient hook), and
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
results = []
for case in CASES:
    cfg = json.loads(open(case["config"]).read())
    # one micro-batch of one sample per rank: neither buffer depends on the batch
    world = torch.distributed.get_world_size()
    cfg.update(train_batch_size=world, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    cfg.pop("tensor_parallel", None)
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in case["matrices"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    seen: list[int] = []

    def staging(engine=engine) -> int:
        out = 0
        for b in getattr(engine.optimizer, "ipg_buckets", {}).values():
            for t in b.buffer if isinstance(b.buffer, list) else [b.buffer]:  # ZeRO-3: one tensor
                out += 0 if t is None else t.numel() * t.element_size()
        return out

    built = staging()

    def hook(g, seen=seen, staging=staging):
        seen.append(staging())
        return g

    for p in engine.module.parameters():
        p.register_hook(hook)
    dtype = next(engine.module.parameters()).dtype
    for _ in range(2):  # the first step creates the optimizer's states
        engine.backward(engine(torch.randn(1, case["matrices"][0][0], dtype=dtype)).float().pow(2).mean())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.step()
    live = most = 0
    for _, _, nbytes in allocation_events(prof):
        live += nbytes
        most = max(most, live)
    name = type(engine.optimizer).__name__
    results.append({"optimizer": name, "built_bytes": built, "staging_bytes": max(seen), "step_bytes": most})
if torch.distributed.get_rank() == 0:
    open(OUT, "w").write(json.dumps(results))
