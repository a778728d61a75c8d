"""Execute a plan on torch.distributed: TP groups, ZeRO 0–3, fractional offloading, AdamW.

    from mist.runtime import TrainConfig, spawn_local
    result = spawn_local(plan, TrainConfig(steps=3))        # local worker processes (CPU/gloo)

`mist train PLAN` (cli) launches it under torchrun or with `--local`.

Modules:
    launch     processes (torchrun env or local workers), device choice, one-sentence errors
    layout     rank layout of the stages and their TP / DP / KV / tied-embedding process groups
    sharding   which slice of each full parameter a TP rank holds; seeded streamed init
    stage      a stage's modules (embedding? blocks head?) and the forward with unit hooks
    schedule   order of forwards/backwards (GradAccumSchedule; PipelineSchedule: 1F1B with p2p)
    handoff    which rows of a micro-batch go from which rank to which between pipeline stages
    flat       FlatUnit: flat weights, ZeRO 0–3, weight/grad offload, gradient reduction
    optimizer  AdamW on the master shards (device part on the device, host part on the CPU),
               global-norm clipping, loss scaling, LR schedule
    activations saved-tensor hooks: activation offload and byte accounting
    buffers    SplitBuffer: a flat state's device head and host tail
    data       synthetic / file data and the layout-independent batch split
    datasets   --data made ready (tokenized) before the workers; packed data, eval batches
    token_files memory-mapped .npy / raw uint16/uint32 token files and their sidecars
    tokenizer  tokenizer.json via `tokenizers`; corpus: text / JSONL documents → token file
    packing    documents + EOS cut into sequences; sampler: seeded per-epoch shuffle (resumable)
    step_log   per-step logs: lines or a progress bar, JSON lines, TensorBoard
    trainer    one rank's training loop, metrics, full state dict
    checkpoint save / resume with torch.distributed.checkpoint (per-rank shards, plan hash)
"""

from mist.runtime.config import TrainConfig
from mist.runtime.launch import spawn_local, train_command

__all__ = ["TrainConfig", "spawn_local", "train_command"]
