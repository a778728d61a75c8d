"""benchmarks/gpu/gpu_loop.py and its local report, without a GPU.

A fake $OUT is made by the loop itself (`run_loop`, its profile phase skipped) on this CPU with a
tiny Llama: the five plans really run through the runtime (forked gloo workers) and the bare
PyTorch loop runs in this process; one more plan is stopped by the loop's time limit. The
CPU-loop profile stands in for the fetched h200-profile.json.
report_gpu_loop.py must then write the report with one row per measured plan, predictions with
both profiles, the overhead line and the profile comparison.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed  # (imported before forking the workers: fast start)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import gpu_loop  # noqa: E402
import report_gpu_loop  # noqa: E402

TINY = {
    "name": "tiny-llama",
    "family": "llama",
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 128,
    "vocab_size": 128,
    "tie_embeddings": False,
}
TINY_SETUP = gpu_loop.Setup(
    model=TINY,
    seq=16,
    global_batch=4,
    micro_batch=2,
    steps=3,
    dtype="fp32",
    gpu="cpu",
    device="cpu",
    kernel_blocks=((TINY, 2), ({**TINY, "family": "gpt", "bias": True}, 1), (TINY, 2, 2)),
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fetched")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        res = gpu_loop.run_loop(out, TINY_SETUP, budget_s=260, skip=frozenset({"profile"}))
        slow = gpu_loop.make_plan(TINY, seq=16, global_batch=4, micro_batch=2, gpu="cpu", dtype="fp32")
        res["plans"].append(gpu_loop.run_plan("too slow", slow, 500, 0.3, "cpu", start_method="fork", threads=1))
    finally:
        torch.set_num_threads(threads)
    gpu_loop.save(out, res)
    shutil.copy(ROOT / "benchmarks" / "results" / "profiles" / "cpu-loop.json", out / gpu_loop.PROFILE)
    dest = tmp_path_factory.mktemp("results")
    paths = {k: dest / f"{k}.out" for k in ("md", "json", "profile-md")}
    assert report_gpu_loop.main([str(out), *[a for k, p in paths.items() for a in (f"--{k}", str(p))]]) == 0
    return res, paths["md"].read_text(), json.loads(paths["json"].read_text()), paths["profile-md"].read_text()


def test_the_loop_records_runs_timeouts_and_the_bare_loop(report):
    res, _, _, _ = report
    n = len(gpu_loop.PLANS)
    ok, slow = res["plans"][:n], res["plans"][n]
    assert [r["name"] for r in ok] == [name for name, _ in gpu_loop.PLANS]
    for row in ok:
        assert row["status"] == "ok", row.get("error")
        st = row["metrics"]["stages"][0]
        assert row["metrics"]["step_time_s"] > 0 and len(row["metrics"]["step_times_s"]) == 3
        assert st["state_bytes"] > 0 and st["saved_activation_peak_bytes"] > 0
    assert slow["status"] == "timeout" and "stopped after" in slow["error"]
    bare = res["bare_loop"]
    assert bare["status"] == "ok" and len(bare["losses"]) == 3 and bare["step_time_s"] > 0


def test_the_kernel_phase_times_each_pass_and_each_linear_layer(report):
    res, md, _, _ = report
    rows = res["kernels"]
    assert [(r["model"], r["b"], r["tp"], r["status"]) for r in rows] == [
        ("tiny-llama", 2, 1, "ok"),
        ("tiny-llama", 1, 1, "ok"),
        ("tiny-llama", 2, 2, "ok"),
    ]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_unit_weights_ms"] > 0
        assert any("mm" in name for name in r["fwd_unit_weights"])
        # on a CPU the profiler's rows are operators: the block's GEMMs among them, in both passes
        assert any("mm" in name for name in r["fwd"]) and any("mm" in name for name in r["bwd"])
        assert all(c > 0 and us > 0 for c, us in r["fwd"].values())
    llama, gpt = rows[0]["linears"], rows[1]["linears"]
    # Llama's four projections (fused QKV, output, gate+up, down) have no bias; GPT's column-parallel
    # ones (QKV, fc1) pass theirs to the GEMM
    assert len(llama) == len(gpt) == 4 and not any(lin["bias_in_gemm"] for lin in llama)
    assert [lin["bias_in_gemm"] for lin in gpt] == [True, False, True, False]
    for lin in llama + gpt:
        assert lin["m"] == 16 * (2 if lin in llama else 1) and lin["k"] in (64, 128, 256)
        assert min(lin["as_called_ms"], lin["random_weights_ms"]) > 0
        assert (lin["no_bias_ms"] is not None) == lin["bias_in_gemm"] and (lin["no_bias_ms"] or 1) > 0
    # rank 0's shard of 2: its column-parallel layers give half the outputs, row-parallel take half
    # the inputs
    shard = {lin["name"]: (lin["n"], lin["k"]) for lin in rows[2]["linears"]}
    whole = {lin["name"]: (lin["n"], lin["k"]) for lin in llama}
    assert shard.keys() == whole.keys()
    assert sorted(n * k for n, k in shard.values()) == sorted(n * k // 2 for n, k in whole.values())
    # the ATen calls each pass dispatches: views apart, the forward's others at least its linears
    for row in rows:
        for ph, n in row["aten_calls"].items():
            assert 0 < n["views"] < n["calls"], (ph, n)
        assert row["aten_calls"]["fwd"]["calls"] - row["aten_calls"]["fwd"]["views"] >= len(row["linears"])
    section = md.split("## Kernels of single blocks")[1]
    assert section.count("ATen calls dispatched") == 6
    assert section.count("| linear |") == 3 and section.count("(bias in the GEMM)") == 2
    assert section.count("- fwd with N(0, 1) weight matrices: ") == 3
    assert "### tiny-llama b 2, tensor-parallel shard 1 of 2" in section


def test_the_dropout_phase_compares_compiled_and_eager_masks(report):
    """A rank's own attention dropout compiled equals eager (rounding apart), with its core kept and
    recomputed, and another step seed draws other masks; the report prints both cases."""
    res, md, _, _ = report
    row = res["dropout"]
    assert row["status"] == "ok", row.get("error")
    assert list(row["cases"]) == ["core kept", "core recomputed"]
    for case in row["cases"].values():
        assert case.pop("another seed differs") is True
        assert len(case) >= 3 and max(case.values()) < 1e-4
    section = md.split("## A rank's own attention dropout: compiled vs eager")[1]
    assert "| core kept |" in section and "| core recomputed |" in section


def test_report_rows_and_predictions(report):
    _, md, data, profile_md = report
    labels = ["shipped h200", f"measured {gpu_loop.PROFILE}"]
    step = md.split("## Step time (s)")[1].split("##")[0]
    rows = [ln for ln in step.splitlines() if ln.startswith("| ") and not ln.startswith("| plan")]
    assert [ln.split(" | ")[0][2:] for ln in rows] == [name for name, _ in gpu_loop.PLANS]
    assert all(ln.count("%") == 2 for ln in rows)  # an error per profile
    for row in data["plans"][: len(gpu_loop.PLANS)]:
        assert sorted(row["predicted"]) == sorted(labels)
        for lb in labels:
            assert "error" not in row["predicted"][lb], row["predicted"][lb]
        # the fetched profile here is a CPU one, as the run: the accounted bytes match exactly
        pred, meas = row["predicted"][labels[1]]["stages"][0], row["metrics"]["stages"][0]
        assert pred["state_bytes"] == meas["state_bytes"]
        assert pred["saved_activation_peak_bytes"] == meas["saved_activation_peak_bytes"]
    assert "(+0)" in md.split("## Accounted bytes")[1]
    assert "runtime overhead" in md and "too slow: timeout" in md
    assert "GEMM grid of the fetched profile" in md and profile_md.startswith("GEMM grid:")
    # allocator statistics exist on a GPU only: a CPU run says so, for the runtime and the profiles
    assert "- plain: reserved peak not measured, outside the allocator not measured after the last step" in md
    assert "outside the allocator in the profiles: `shipped h200` not measured" in md


def test_the_loop_refuses_without_cuda(capsys):
    assert gpu_loop.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1
