"""Worker of test_deepspeed.py, run under torchrun on two CPU gloo ranks: for each exported
ds_config.json given (JSON list of paths in argv[1]), DeepSpeed's own engine takes one backward of
a tiny model, and rank 0 writes to argv[2] the bytes of the gradient staging buffers the engine's
ZeRO optimizer holds while that backward runs (read from a gradient hook), with the optimizer's
class name.

usage: torchrun --nproc_per_node 2 deepspeed_staging.py CONFIGS_JSON OUT_JSON
"""

import json
import sys

import deepspeed
import torch
from torch import nn

CONFIGS, OUT = json.loads(open(sys.argv[1]).read()), sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
results = []
for path in CONFIGS:
    cfg = json.loads(open(path).read())
    # a batch of one micro-batch per rank: the staging buffer does not depend on it
    cfg.update(train_batch_size=2, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    cfg.pop("tensor_parallel", None)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    seen: list[int] = []

    def hook(g, engine=engine, seen=seen):
        buckets = getattr(engine.optimizer, "ipg_buckets", {})
        seen.append(sum(t.numel() * t.element_size() for b in buckets.values() for t in b.buffer))
        return g

    for p in engine.module.parameters():
        p.register_hook(hook)
    x = torch.randn(1, 64, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    results.append({"config": path, "optimizer": type(engine.optimizer).__name__, "staging_bytes": max(seen)})
if torch.distributed.get_rank() == 0:
    open(OUT, "w").write(json.dumps(results))
