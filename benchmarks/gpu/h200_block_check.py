"""One short H200 run: the model's own blocks and whole models, measured, for `mist estimate`.

Per (model, micro-batch) at seq 2048, bf16, flash (SDPA causal): one decoder block's forward and
backward time (CUDA events, median of 10 after 3 warm-ups) and the activation bytes it keeps for
backward (saved_tensors_hooks, unique storages, parameters excluded); whole-model forward +
backward of one micro-batch with and without full recomputation. Writes $OUT/h200_blocks.json.
Needs only torch and this repository's src/ (no other packages).
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from mist.models import DecoderBlock, Embedding, Head
from mist.models.checkpointing import run_block
from mist.specs.presets import get_preset

DEV, DT = "cuda", torch.bfloat16
OUT = os.environ.get("OUT", ".")
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "blocks": [], "models": []}


def init(m):
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)


def ev_time(fn, reps=10, warm=3):
    ts = []
    for i in range(warm + reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pre = fn("pre")
        s.record()
        fn("run", pre)
        e.record()
        torch.cuda.synchronize()
        if i >= warm:
            ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def save():
    with open(os.path.join(OUT, "h200_blocks.json"), "w") as f:
        json.dump(res, f, indent=1)


t0 = time.time()
for name in ["gpt3-1.3b", "llama-1.3b", "falcon-1.3b", "gpt3-7b", "llama3-8b", "falcon-paper-7b"]:
    spec = get_preset(name)
    for b in (1, 4):
        try:
            blk = DecoderBlock(spec, None, True, DT, device=DEV)
            init(blk)
            h = spec.hidden_size
            x = torch.randn(b, 2048, h, device=DEV, dtype=DT, requires_grad=True)
            g = torch.randn(b, 2048, h, device=DEV, dtype=DT)

            def fwd(stage, pre=None, blk=blk, x=x):
                if stage == "run":
                    return blk(x)

            def bwd(stage, pre=None, blk=blk, x=x, g=g):
                if stage == "pre":
                    return blk(x)
                pre.backward(g)

            f_ms = ev_time(fwd)
            b_ms = ev_time(bwd)
            params = {p.untyped_storage().data_ptr() for p in blk.parameters()}
            seen = {}
            keep = []

            def pack(t, keep=keep, seen=seen):
                keep.append(t)
                st = t.untyped_storage()
                seen.setdefault(st.data_ptr(), st.nbytes())
                return t

            torch.cuda.synchronize()
            m0 = torch.cuda.memory_allocated()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = blk(x)
            torch.cuda.synchronize()
            m1 = torch.cuda.memory_allocated()
            saved = sum(v for k, v in seen.items() if k not in params)
            res["blocks"].append(
                {
                    "model": name,
                    "b": b,
                    "fwd_ms": f_ms,
                    "bwd_ms": b_ms,
                    "saved_bytes": saved,
                    "alloc_delta_bytes": m1 - m0,
                }
            )
            del y, keep, seen, blk, x, g, fwd, bwd, pack  # the closures hold them too
            torch.cuda.empty_cache()
        except Exception as e:  # keep going: one failure must not cost the whole run
            res["blocks"].append({"model": name, "b": b, "error": repr(e)})
        save()
        print(name, b, res["blocks"][-1], f"{time.time() - t0:.0f}s", flush=True)

for name in ["gpt3-1.3b", "llama-1.3b", "falcon-1.3b", "llama3-8b"]:
    spec = get_preset(name)
    for rc in (False, True):
        try:
            emb = Embedding(spec, None, DT, DEV)
            blocks = torch.nn.ModuleList(DecoderBlock(spec, None, True, DT, DEV) for _ in range(spec.num_layers))
            head = Head(spec, None, DT, DEV)
            for m in (emb, blocks, head):
                init(m)
            tok = torch.randint(0, spec.vocab_size, (1, 2048), device=DEV)

            def step(stage, pre=None, emb=emb, blocks=blocks, head=head, tok=tok):
                if stage == "pre":
                    return None
                xx = emb(tok)
                for blk in blocks:
                    xx = run_block(blk, xx, rc)
                head(xx, tok).backward()

            ms = ev_time(step, reps=5, warm=2)
            res["models"].append(
                {
                    "model": name,
                    "b": 1,
                    "recompute": rc,
                    "fwd_bwd_ms": ms,
                    "peak_alloc_bytes": torch.cuda.max_memory_allocated(),
                }
            )
            del emb, blocks, head, step
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        except Exception as e:
            res["models"].append({"model": name, "recompute": rc, "error": repr(e)})
        save()
        print(name, rc, res["models"][-1], f"{time.time() - t0:.0f}s", flush=True)
print("done", time.time() - t0)
