"""Execute a plan on torch.distributed: TP groups, ZeRO 0–3, fractional offloading, AdamW.

    from mist.runtime import TrainConfig, spawn_local
    result = spawn_local(plan, TrainConfig(steps=3))        # local worker processes (CPU/gloo)

`mist train PLAN` (cli) launches it under torchrun or with `--local`.
"""

from mist.runtime.config import TrainConfig
from mist.runtime.launch import spawn_local, train_command

__all__ = ["TrainConfig", "spawn_local", "train_command"]
