"""Checker of test_deepspeed.py, run in its own process (one gloo rank): hands each exported
ds_config to DeepSpeed's own config class with the plan's data-parallel size and prints what
DeepSpeed made of it, plus the top-level keys its config code read.

DeepSpeed ignores an unknown top-level key without a word (only its sub-sections reject unknown
fields), so the known top-level keys are taken from DeepSpeed itself: the config is passed as a
dict that records every key DeepSpeed's code looks up, and a key it never looked up is one it
does not know.

usage: python deepspeed_check.py CASES.json   (a list of {"name", "config", "dp"}) -> one JSON list on stdout
"""

import json
import os
import socket
import sys


class ReadKeys(dict):
    """A dict that records the keys looked up in it (shared by its copies)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, d):
        self.d = d

    def __contains__(self, key):
        return key in self.d

    def __iter__(self):
        return iter(dict.keys(self.d))

    def __len__(self):
        return len(self.d)


class FakeMPU:
    """All that DeepSpeedConfig asks of a model-parallel unit: the data-parallel size."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _name(enum_or_str):
    return str(getattr(enum_or_str, "value", enum_or_str))


def check(DeepSpeedConfig, case):
    cfg = ReadKeys(case["config"])
    try:
        ds = DeepSpeedConfig(cfg, mpu=FakeMPU(case["dp"]))
    except Exception as e:  # the message is the result
        return {"name": case["name"], "ok": False, "error": f"{type(e).__name__}: {e}", "read": sorted(cfg.read)}
    z = ds.zero_config
    oo, op = z.offload_optimizer, z.offload_param
    return {
        "name": case["name"],
        "ok": True,
        "read": sorted(cfg.read),
        "world_size": ds.world_size,
        "train_batch_size": ds.train_batch_size,
        "micro_batch": ds.train_micro_batch_size_per_gpu,
        "gas": ds.gradient_accumulation_steps,
        "zero": int(ds.zero_optimization_stage),
        "offload_optimizer": None if oo is None else {"device": _name(oo.device), "ratio": oo.ratio},
        "offload_param": None if op is None else _name(op.device),
        "sub_group_size": z.sub_group_size,
        "bf16": bool(ds.bfloat16_config.enabled),
        "fp16": bool(ds.float16_config.enabled),
        "autocast": bool(ds.torch_autocast_enabled),
        "grad_accum_dtype": ds.grad_accum_dtype,
        "optimizer": ds.optimizer_name,
    }


def main():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    # without a process group DeepSpeedConfig quietly takes the world size as 1 and ignores the mpu
    deepspeed.init_distributed(dist_backend="gloo")
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print("CHECKS " + json.dumps([check(DeepSpeedConfig, c) for c in cases]), flush=True)


if __name__ == "__main__":
    main()
