"""Worker of test_deepspeed.py, run under torchrun on CPU gloo ranks: trains a tiny model for a
few steps from an exported folder (ds_config.json as written, mist_deepspeed.py for the layer
split and the recomputed blocks) and writes what DeepSpeed ran to OUT_DIR/rank-R.json (files:
the ranks' stdout lines interleave).

usage: torchrun --nproc_per_node N deepspeed_train.py EXPORT_DIR STEPS OUT_DIR
"""

import json
import os
import sys

import deepspeed
import torch
from torch import nn

EXPORT_DIR, STEPS, OUT_DIR = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.path.insert(0, EXPORT_DIR)
import mist_deepspeed as md  # noqa: E402  (the exported helper)

# a GPT-shaped stand-in with exactly the exported spec's parameter count (gpt family, no bias),
# so that the ZeRO-3 optimizer sub-groups are sized as in the real run
H, V, L = md.MODEL["hidden_size"], md.MODEL["vocab_size"], md.NUM_LAYERS
F, P = md.MODEL["ffn_hidden_size"], md.MODEL["max_position_embeddings"]
SEQ = 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, H), nn.Embedding(P, H)

    def forward(self, ids):
        return self.emb(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H, bias=False)
        self.fc1, self.fc2 = nn.Linear(H, F, bias=False), nn.Linear(F, H, bias=False)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x))[..., :H])
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def batch(mb, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (mb, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def train_pipeline(cfg):
    specs = [md.LayerSpec(Embed)] + [md.block_spec(i, Block) for i in range(L)] + [md.LayerSpec(Head)]
    model = md.MistPipelineModule(specs, loss_fn=loss_fn)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mb = cfg["train_micro_batch_size_per_gpu"]
    it = iter([batch(mb, i) for i in range(STEPS * engine.gradient_accumulation_steps())])
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(STEPS)]
    local = sum(1 for _ in model.forward_funcs)
    return engine, losses, {"stage": engine.stage_id, "local_layers": local, "parts": list(model.parts)}


def train_plain(cfg):
    model = nn.Sequential(Embed(), *[md.block(i, Block) for i in range(L)], Head())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mb, losses = cfg["train_micro_batch_size_per_gpu"], []
    for step in range(STEPS * engine.gradient_accumulation_steps()):
        ids, labels = batch(mb, step + 100 * engine.global_rank)
        loss = loss_fn(engine(ids), labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    recomputed = sum(isinstance(m, md.Recomputed) for m in model)
    return engine, losses, {"recomputed_blocks": recomputed}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    with open(os.path.join(EXPORT_DIR, "ds_config.json")) as f:
        cfg = json.load(f)
    engine, losses, extra = (train_pipeline if md.NUM_STAGES > 1 else train_plain)(cfg)
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out = {
        "rank": engine.global_rank,
        "zero": engine.zero_optimization_stage(),
        "dp": engine.dp_world_size,
        "gas": engine.gradient_accumulation_steps(),
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "global_steps": engine.global_steps,
        "optimizer": f"{type(opt).__name__}/{type(inner).__name__}",
        "partial_offload": getattr(opt, "partial_offload", None),
        "sub_groups": len(getattr(opt, "subgroup_to_device", {}) or {}),
        "losses_finite": all(x == x and abs(x) < 1e6 for x in losses),
        **extra,
    }
    with open(os.path.join(OUT_DIR, f"rank-{engine.global_rank}.json"), "w") as f:
        json.dump(out, f)
    # leave together: a rank that exits with pipeline sends in flight keeps the other waiting
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Then leave without the interpreter's teardown. One rank of the ZeRO-3 partial-offload run
    # aborted in 3 of about 9 clean CI runs with "terminate called without an active exception"
    # (C++ std::terminate, typically a worker thread still joinable when its owner is destroyed);
    # whether that was in this teardown is not known. Everything the test checks is written above,
    # so a run that gets here has trained.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
