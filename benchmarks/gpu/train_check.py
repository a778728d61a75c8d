"""One short single-GPU run of `mist train` plans next to `mist simulate`, plus a bare PyTorch loop.

Plans (llama-1.3b, seq 2048, global batch 8 = micro-batch 4 × G 2, bf16, flash): plain; full
recompute; optimizer offload 1.0; activation offload 0.5. The bare loop is the same model in bf16
with fp32 master weights and fused AdamW, no Mist runtime. Writes $OUT/train_check.json.
Needs torch and this repository's src/ plus numpy/sympy/scipy (for the simulator).
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from mist.hardware import load_profile  # noqa: E402
from mist.models import CausalLM  # noqa: E402
from mist.plan import plan_from_dict  # noqa: E402
from mist.runtime import TrainConfig, spawn_local  # noqa: E402
from mist.simulate.plan_sim import simulate_plan  # noqa: E402

OUT = os.environ.get("OUT", ".")
MODEL, SEQ, B, MB = "llama-1.3b", 2048, 8, 4
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "plans": []}


def plan(**stage):
    st = {"layers": 24, "nodes": 1, "gpus_per_node": 1, "micro_batch": MB, "dp": 1, "tp": 1, "zero": 0,
          "recompute_layers": 0}
    st.update(stage)
    return plan_from_dict({"model": MODEL, "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": 1},
                           "training": {"seq_len": SEQ, "global_batch": B, "flash_attention": True},
                           "micro_batches": B // MB, "stages": [st]})


def save():
    with open(os.path.join(OUT, "train_check.json"), "w") as f:
        json.dump(res, f, indent=1)



def main():
    prof = load_profile("h200")
    for name, kw in [("plain", {}), ("full recompute", {"recompute_layers": 24}),
                     ("optimizer offload 1.0", {"offload": {"optimizer": 1.0}}),
                     ("activation offload 0.5", {"offload": {"activations": 0.5}})]:
        p = plan(**kw)
        sim = simulate_plan(p, prof)
        row = {"plan": name, "predicted_step_s": sim["iteration_time_s"],
               "predicted_peak_bytes": sim["stages"][0]["peak_memory_bytes"]}
        try:
            t0 = time.time()
            r = spawn_local(p, TrainConfig(steps=5, log=False), device_type="cuda")
            m = r["metrics"]
            row.update(measured_step_s=m["step_time_s"], measured_peak_bytes=m["stages"][0]["peak_memory_bytes"],
                       losses=m["losses"], wall_s=time.time() - t0)
        except Exception as e:
            row["error"] = repr(e)[:500]
        res["plans"].append(row)
        save()
        print(row, flush=True)

    # bare PyTorch loop: bf16 model, fp32 master weights, fused AdamW
    try:
        torch.manual_seed(0)
        from mist.specs.presets import get_preset
        spec = get_preset(MODEL)
        model = CausalLM(spec, None, True, torch.bfloat16, "cuda")
        with torch.no_grad():
            for q in model.parameters():
                if q.dim() >= 2:
                    q.normal_(0, 0.02)
        params = [q for q in model.parameters()]
        master = [q.detach().float().clone().requires_grad_(False) for q in params]
        opt = torch.optim.AdamW(master, lr=1e-4, fused=True)
        tok = torch.randint(0, spec.vocab_size, (B // MB, MB, SEQ + 1), device="cuda")
        times = []
        torch.cuda.reset_peak_memory_stats()
        for step in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for g in range(B // MB):
                loss = model(tok[g, :, :-1], tok[g, :, 1:]) / (B // MB)
                loss.backward()
            for m_, q in zip(master, params):
                m_.grad = q.grad.float()
            opt.step()
            with torch.no_grad():
                for m_, q in zip(master, params):
                    q.copy_(m_)
                    q.grad = None
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res["bare_loop"] = {"step_s": sorted(times[1:])[len(times[1:]) // 2],
                            "peak_bytes": torch.cuda.max_memory_allocated()}
    except Exception as e:
        res["bare_loop"] = {"error": repr(e)[:500]}
    save()
    print(res["bare_loop"], flush=True)


if __name__ == "__main__":  # workers are spawned: keep the module import-safe
    main()
