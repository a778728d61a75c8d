"""Where a block's predicted time goes, per operator class, next to the measured operator timings.

For the paper's GPT (gpt3-1.3b / 2.7b / 7b, with and without flash attention) and Llama
(llama-1.3b / 7b: SwiGLU, RMSNorm, rotary) blocks at sequence 2048 — fp16 on the shipped L4
profile, bf16 on the shipped H200 profile — at micro-batch 1, 2, 4, 8 and TP 1 and 2, the block is
traced by Mist's own analysis (`mist.analysis.layer.analyze_layer`) and every traced operator is
priced by the simulator's own function (`mist.simulate.layer_cost.kernel_time`); the block total
is `layer_cost.phase_time` (host issue model + TP collectives). Nothing here re-implements a cost.

The traced operators are grouped into classes: GEMM (the four linear layers), attention core
(flash kernel, or the score/context bmm), softmax/mask (scale, causal mask, softmax), norms,
activation (GeLU / SwiGLU), residual adds, rotary, dropout, copies (layout: clone / cat of the
fused QKV gradient) and TP collectives. Names alone do not place `mul`/`add`/`cat`, so each
memory-bound op is placed by where it sits between the block's landmarks (the four linear
GEMMs and the attention core) — see `classify`.

Measured timings of the same shapes, where the data set (not part of this repository) has them:

* L4 op-db (the original Mist runtime's own profiler, fp16, GPT-1.3B shapes: h 2048, 16 heads of
  128, FFN 8192): per class, summed per block by operator name (fused_dense_func ×4, flash-attn,
  baddbmm + bmm, scaled-upper-triang-masked-softmax, layer_norm ×2, gelu, add ×2);
* L4 Aceso op-profiles (`gpt_<size>_mbs<b>_tp<t>_algo0.csv`; sizes 1_3B / 2_6B / 6_7B; the 1_3B
  file has 32 heads of 64, the paper's 1.3B 16 of 128): per class, linear backward + the missing
  weight-gradient GEMM taken as the forward time (DATA/README §3.1 caveat 3), attention dropout
  listed apart (the paper models have none);
* H200: the repository's measured blocks (`benchmarks/results/h200_blocks_measured.json`) and the
  flash rows of `gpus/h200/attention.json` at the same (b, heads, s, d).

    python benchmarks/decomposition.py --data DATA [--out benchmarks/results/decomposition.md]
        [--l4-profile PATH] [--h200-profile PATH] [--json PATH] [--before PATH]

Section 6 puts the kernels and block times of an earlier run (`--json` of it) next to this one's:
by default `benchmarks/results/decomposition_03825f2.json`, the blocks before the lean kernels
(fused RMSNorm op, in-place rotary on the packed QKV output, SwiGLU backward without its cat).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mist.analysis.layer import analyze_layer  # noqa: E402
from mist.analysis.records import ATTENTION, COLLECTIVE, GEMM  # noqa: E402
from mist.hardware.registry import load_profile  # noqa: E402
from mist.simulate.layer_cost import kernel_time, phase_time  # noqa: E402
from mist.specs.presets import get_preset  # noqa: E402

SEQ = 2048
BATCHES = (1, 2, 4, 8)
CLASSES = (
    "gemm",
    "attn core",
    "softmax/mask",
    "norms",
    "activation",
    "residual",
    "rotary",
    "dropout",
    "copies",
    "collectives",
)
# (model, flash) per GPU; TP 2 too where the data has TP-2 measurements (Aceso) or to show comm
CASES = {
    "l4": [
        ("gpt3-1.3b", True),
        ("gpt3-1.3b", False),
        ("gpt3-2.7b", True),
        ("gpt3-2.7b", False),
        ("gpt3-7b", True),
        ("gpt3-7b", False),
        ("llama-7b", True),
    ],
    "h200": [("gpt3-1.3b", True), ("gpt3-7b", True), ("llama-1.3b", True), ("llama-7b", True)],
}
DTYPE = {"l4": "fp16", "h200": "bf16"}
ACESO_SIZE = {"gpt3-1.3b": "1_3B", "gpt3-2.7b": "2_6B", "gpt3-7b": "6_7B"}

_NORM_OPS = {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"}
_SOFTMAX_OPS = {"_softmax", "_softmax_backward_data", "masked_fill", "masked_fill_", "ones", "triu", "where"}
_ACT_OPS = {"gelu", "gelu_backward", "silu", "silu_backward"}
_DROPOUT_OPS = {"native_dropout", "native_dropout_backward", "bernoulli", "bernoulli_"}
_COPY_OPS = {"clone", "cat", "copy", "copy_", "contiguous"}


# ---------------------------------------------------------------------------- classification
def classify(records, phase: str, rotary: bool) -> list[str]:
    """Class of each costed op of one phase of a decoder block (GPT or Llama, sequential).

    Landmarks: the linear GEMMs (`mm`; forward qkv, out, fc1, fc2; backward pairs in reverse) and
    the attention core (the flash kernel or the bmm's). Memory-bound ops named for what they do
    (layer norm, softmax, gelu/silu, dropout) go to their class; the generic ones (mul, add, pow,
    _to_copy, cat, ...) to the class of the region they sit in."""
    kinds = []
    for r in records:
        if r.kind == COLLECTIVE:
            kinds.append("C")
        elif r.kind == ATTENTION or (r.kind == GEMM and r.op in ("bmm", "baddbmm")):
            kinds.append("A")
        elif r.kind == GEMM:
            kinds.append("G")
        else:
            kinds.append("M")
    gemms = [i for i, k in enumerate(kinds) if k == "G"]
    attn = [i for i, k in enumerate(kinds) if k == "A"]
    a0, a1 = (attn[0], attn[-1]) if attn else (-1, -1)
    out = []
    # region names between landmarks, in execution order
    if phase == "fwd":  # norm | qkv | pre-attn | attn | post-attn | out | res+norm | fc1 | act | fc2 | residual
        g = gemms + [len(records)] * (4 - len(gemms))
        bounds = [(g[0], "norm"), (a0, "pre"), (a1 + 1, "attn"), (g[1], "layout"), (g[2], "res+norm"), (g[3], "act")]
        tail = "residual"
    else:  # fc2 pair | act | fc1 pair | norm+res | out pair | layout | attn | pre | qkv pair | norm+res
        g = gemms + [len(records)] * (8 - len(gemms))
        bounds = [
            (g[0], "residual"),
            (g[2], "act"),
            (g[4], "norm+res"),
            (a0, "layout"),
            (a1 + 1, "attn"),
            (g[6], "pre"),
        ]
        tail = "norm+res"
    regions = []
    for i in range(len(records)):
        region = tail
        for end, name in bounds:
            if i < end:
                region = name
                break
        regions.append(region)
    for i, r in enumerate(records):
        k, region, op = kinds[i], regions[i], r.op.rstrip("_")
        if k == "C":
            out.append("collectives")
        elif k == "G":
            out.append("gemm")
        elif k == "A":
            out.append("attn core")
        elif r.op in _DROPOUT_OPS:
            out.append("dropout")
        elif r.op in _NORM_OPS:
            out.append("norms")
        elif r.op in _ACT_OPS or region == "act":
            out.append("activation")
        elif r.op in _SOFTMAX_OPS or (region == "attn" and r.op not in _COPY_OPS):
            out.append("softmax/mask")
        elif region == "pre" and rotary and (r.op != "clone" and (phase == "fwd" or r.op not in _COPY_OPS)):
            out.append("rotary")  # rotate-half products, sums and cats (backward: its slices and sums)
        elif region in ("pre", "layout", "attn"):
            # layout copies (clone, the cat of the q/k/v gradients); the 1/sqrt(d) scaling of q
            out.append("copies" if r.op in _COPY_OPS else "softmax/mask")
        elif region == "norm":
            out.append("norms")
        elif region in ("res+norm", "norm+res"):
            out.append("residual" if op == "add" and _is_residual(records, i, region) else "norms")
        else:
            out.append("residual" if op == "add" else "copies" if r.op in _COPY_OPS else "norms")
    return out


def _is_residual(records, i: int, region: str) -> bool:
    """The residual add of a norm region: the first `add` of the region in the forward (x + attn
    before norm 2), the last one in the backward (the gradient of the skip connection)."""
    same = [j for j in range(len(records)) if records[j].op in ("add", "add_")]
    if region == "res+norm":
        return i == min(j for j in same if j >= _region_start(records, i))
    return i == max(j for j in same if j <= _region_end(records, i))


def _region_start(records, i):
    j = i
    while j > 0 and records[j - 1].kind not in (GEMM, ATTENTION):
        j -= 1
    return j


def _region_end(records, i):
    j = i
    while j + 1 < len(records) and records[j + 1].kind not in (GEMM, ATTENTION):
        j += 1
    return j


# ---------------------------------------------------------------------------- prediction
def predict(profile, model: str, flash: bool, tp: int, dtype: str, b: int) -> dict:
    """{phase: {"classes": {class: seconds}, "kernels": n, "total": s, "comm": s}} for one block."""
    spec = get_preset(model)
    la = analyze_layer(spec, "block", tp, flash, dtype, "cuda", False)
    links = profile.link_model() if tp > 1 else None
    out = {}
    for phase in ("fwd", "bwd"):
        records = la.ops(phase)
        labels = classify(records, phase, bool(spec.rotary_dim))
        values = la.op_values(phase, np.array([float(b)]), np.array([float(SEQ)]))
        cls = defaultdict(float)
        for lab, op in zip(labels, values):
            if op.kind == COLLECTIVE:
                continue
            cls[lab] += float(np.ravel(kernel_time(profile, op, phase == "bwd"))[0])
        pt = phase_time(profile, links, la, phase, np.array([float(b)]), np.array([float(SEQ)]))
        cls["collectives"] = float(np.ravel(pt.comm)[0])
        out[phase] = {
            "classes": dict(cls),
            "kernels": sum(1 for v in values if v.kind != COLLECTIVE),
            "total": float(np.ravel(pt.total)[0]),
            "labels": labels,
            "ops": [r.op for r in records],
        }
    return out


# ---------------------------------------------------------------------------- measured: L4 op-db
_SHAPE = re.compile(r"'(\w+)': TensorSpec\(shape=\(([\d, ]*)\)")


def _shapes(key: str) -> dict:
    return {n: tuple(int(v) for v in s.split(",") if v.strip()) for n, s in _SHAPE.findall(key)}


def read_op_db(folder: Path) -> dict:
    """{file stem: [(shapes, fwd_s, bwd_s)]} (medians)."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        rows = []
        for key, v in json.loads(path.read_text()).items():
            rows.append((_shapes(key), v["fwd"][1], v["bwd"][1], key))
        out[path.stem] = rows
    return out


def op_db_block(db: dict, b: int, flash: bool) -> dict | None:
    """Per-class fwd/bwd seconds of the original's GPT-1.3B block at micro-batch b, TP 1."""
    h, heads, ffn = 2048, 16, 8192

    def find(stem, pred):
        hits = [r for r in db.get(stem, []) if pred(r[0], r[3])]
        return hits[0] if hits else None

    def dense(n, k):
        return find(
            "mist.modules.fused_dense.fused_dense_func",
            lambda s, key: s["x"] == (b, SEQ, k) and s["weight"] == (n, k),
        )

    rows = {
        "gemm": [dense(3 * h, h), dense(h, h), dense(ffn, h), dense(h, ffn)],
        "norms": [find("mist.modules.layer_norm.layer_norm", lambda s, key: s["x"] == (b, SEQ, h))] * 2,
        "activation": [find("torch._C._nn.gelu", lambda s, key: s["input"] == (b, SEQ, ffn))],
        "residual": [find("_operator.add", lambda s, key: s["a"] == (b, SEQ, h))] * 2,
    }
    if flash:
        rows["attn core"] = [
            find(
                "mist.modules.flash_attn.flash_attn_qkvpacked_func",
                lambda s, key: s["qkv"] == (b, SEQ, 3, heads, h // heads),
            )
        ]
    else:
        bh = b * heads
        rows["attn core"] = [
            find("torch.baddbmm", lambda s, key: s["input"] == (bh, SEQ, SEQ)),
            find("torch.bmm", lambda s, key: s["input"] == (bh, SEQ, SEQ)),
        ]
        rows["softmax/mask"] = [
            find(
                "mist.modules.fused_softmax.scaled_upper_triang_masked_softmax_fn",
                lambda s, key: s["inputs"] == (bh, SEQ, SEQ),
            )
        ]
    if any(r is None for v in rows.values() for r in v):
        return None
    return {
        "fwd": {c: sum(r[1] for r in v) for c, v in rows.items()},
        "bwd": {c: sum(r[2] for r in v) for c, v in rows.items()},
    }


# ---------------------------------------------------------------------------- measured: Aceso
_ACESO_CLASS = {
    "enc-attention-qkv": "gemm",
    "enc-attention-dense": "gemm",
    "enc-MLP-GEMM-1": "gemm",
    "enc-MLP-GEMM-2": "gemm",
    "enc-attention-score": "attn core",
    "enc-attention-context": "attn core",
    "enc-attention-softmax": "softmax/mask",
    "enc-attention-dropout": "dropout",
    "enc-1st-layernorm": "norms",
    "enc-2nd-layernorm": "norms",
    "enc-MLP-gelu": "activation",
    "enc-post-attention-dropout": "residual",
    "enc-post-MLP-dropout": "residual",
}


def aceso_block(folder: Path, model: str, b: int, tp: int) -> dict | None:
    """Per-class fwd/bwd seconds of an Aceso GPT layer (algo 0); linear backward + forward time for
    the weight-gradient GEMM the L4 rows leave out. None where the file or a row is missing."""
    size = ACESO_SIZE.get(model)
    path = folder / f"gpt_{size}_mbs{b}_tp{tp}_algo0.csv"
    if size is None or not path.exists():
        return None
    out = {"fwd": defaultdict(float), "bwd": defaultdict(float)}
    with path.open() as fh:
        for row in csv.DictReader(fh):
            cls = _ACESO_CLASS.get(row["op_name"])
            if cls is None:
                continue
            f, bw = float(row["forward-compute"]) * 1e-6, float(row["backward-compute"]) * 1e-6
            if f >= 1.0 or bw >= 1.0:  # 1e7 µs sentinel: profile failed
                return None
            out["fwd"][cls] += f
            out["bwd"][cls] += bw + (f if cls == "gemm" else 0.0)
    return {k: dict(v) for k, v in out.items()}


# ---------------------------------------------------------------------------- measured: H200
def h200_measured(data: Path, model: str, b: int) -> dict:
    """{"block_fwd", "block_bwd"} from the repository's measured blocks, and the flash rows."""
    out = {}
    blocks = json.loads((ROOT / "benchmarks/results/h200_blocks_measured.json").read_text())
    for r in blocks["blocks"]:
        if r["model"] == model and r["b"] == b:
            out["block_fwd"], out["block_bwd"] = r["fwd_ms"] * 1e-3, r["bwd_ms"] * 1e-3
    spec = get_preset(model)
    d = spec.hidden_size // spec.num_heads
    att = json.loads((data / "gpus/h200/attention.json").read_text())
    for r in att["rows"]:
        if (r["b"], r["heads"], r["s"], r["d"]) == (b, spec.num_heads, SEQ, d):
            out["attn_fwd"], out["attn_bwd"] = r["fwd_ms"] * 1e-3, r["bwd_ms"] * 1e-3
    return out


# ---------------------------------------------------------------------------- report
def ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.2f}"


def pct(p, m) -> str:
    return "–" if (p is None or m is None or m <= 0) else f"{(p / m - 1) * 100:+.0f}%"


def share_table(preds: dict, b: int = 4) -> list[str]:
    """Summary: each class's share of the predicted fwd + bwd kernel time at micro-batch b, TP 1."""
    out = [
        f"## Summary: share of the predicted block time (fwd + bwd kernels) per class, b {b}, TP 1",
        "",
        "| gpu | model | attn | fwd+bwd ms | kernels | " + " | ".join(CLASSES[:-1]) + " |",
        "|" + "---|" * (4 + len(CLASSES)),
    ]
    for (gpu, model, flash, tp, bb), p in preds.items():
        if tp != 1 or bb != b:
            continue
        tot = {c: p["fwd"]["classes"].get(c, 0.0) + p["bwd"]["classes"].get(c, 0.0) for c in CLASSES[:-1]}
        whole = sum(tot.values())
        cells = ["·" if tot[c] == 0 else f"{100 * tot[c] / whole:.1f}%" for c in CLASSES[:-1]]
        out.append(
            f"| {gpu} | {model} | {'flash' if flash else 'bmm'} | {whole * 1e3:.1f} | "
            f"{p['fwd']['kernels'] + p['bwd']['kernels']} | " + " | ".join(cells) + " |"
        )
    return out + [""]


def case_rows(preds: dict) -> list[dict]:
    """One record per predicted case: kernels and predicted block times (what `--json` writes and
    `--before` reads back)."""
    return [
        {
            "gpu": gpu,
            "model": model,
            "attn": "flash" if flash else "bmm",
            "tp": tp,
            "b": b,
            "kernels_fwd": p["fwd"]["kernels"],
            "kernels_bwd": p["bwd"]["kernels"],
            "block_fwd_s": p["fwd"]["total"],
            "block_bwd_s": p["bwd"]["total"],
        }
        for (gpu, model, flash, tp, b), p in preds.items()
    ]


def before_after(before: list[dict], after: list[dict], label: str) -> list[str]:
    """Kernels per block and predicted block time (fwd + bwd) of an earlier run next to this one."""
    old = {(r["gpu"], r["model"], r["attn"], r["tp"], r["b"]): r for r in before}
    out = [
        "",
        f"## 6. Before / after: {label}",
        "",
        "Kernels per block and the predicted block time (fwd + bwd, `phase_time`: host issue model and",
        "TP collectives included), each case of section 1 at micro-batch 1 and 4.",
        "",
        "| gpu | model | attn | tp | b | kernels f/b before | kernels f/b after | block ms before | block ms after | change |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in after:
        key = (r["gpu"], r["model"], r["attn"], r["tp"], r["b"])
        o = old.get(key)
        if o is None or r["b"] not in (1, 4):
            continue
        t0, t1 = o["block_fwd_s"] + o["block_bwd_s"], r["block_fwd_s"] + r["block_bwd_s"]
        out.append(
            f"| {r['gpu']} | {r['model']} | {r['attn']} | {r['tp']} | {r['b']} | "
            f"{o['kernels_fwd']} / {o['kernels_bwd']} | {r['kernels_fwd']} / {r['kernels_bwd']} | "
            f"{ms(t0)} | {ms(t1)} | {pct(t1, t0)} |"
        )
    return out


def run(data: Path, profiles: dict, before: tuple[list[dict], str] | None = None) -> tuple[str, list[dict]]:
    op_db = read_op_db(data / "gpus/l4/op-db")
    aceso_dir = data / "gpus/l4/op-profiles"
    lines = [
        "# Block decomposition: predicted time per operator class vs measured operator timings",
        "",
        "Generated by `python benchmarks/decomposition.py --data DATA` (DATA: the measurement data set,",
        "not part of this repository). Sequence 2048; L4 fp16, H200 bf16. Predicted = each traced",
        "operator priced by `mist.simulate.layer_cost.kernel_time` on the shipped profile; `block` =",
        "`layer_cost.phase_time` (host issue model + TP collectives). ms per block.",
        "",
        "## 1. Predicted time per class (fwd / bwd, ms)",
        "",
        "| gpu | model | attn | tp | b | kernels f/b | " + " | ".join(CLASSES) + " | block fwd | block bwd |",
        "|" + "---|" * (8 + len(CLASSES)),
    ]
    preds = {}
    for gpu, cases in CASES.items():
        prof = profiles[gpu]
        for model, flash in cases:
            for tp in (1, 2):
                for b in BATCHES:
                    p = predict(prof, model, flash, tp, DTYPE[gpu], b)
                    preds[(gpu, model, flash, tp, b)] = p
                    cells = []
                    for c in CLASSES:
                        f, bw = p["fwd"]["classes"].get(c, 0.0), p["bwd"]["classes"].get(c, 0.0)
                        cells.append("·" if f == 0 and bw == 0 else f"{f * 1e3:.2f} / {bw * 1e3:.2f}")
                    lines.append(
                        f"| {gpu} | {model} | {'flash' if flash else 'bmm'} | {tp} | {b} | "
                        f"{p['fwd']['kernels']} / {p['bwd']['kernels']} | " + " | ".join(cells) + f" | "
                        f"{ms(p['fwd']['total'])} | {ms(p['bwd']['total'])} |"
                    )
    lines[7:7] = share_table(preds)
    # ---- L4 vs op-db and Aceso, per class
    lines += [
        "",
        "## 2. L4: predicted vs the original's op-db and the Aceso op-profiles, per class (TP 1)",
        "",
        "op-db: the original runtime's fused kernels (GPT-1.3B shapes only). Aceso: Megatron-style",
        "layer, fp16; gemm bwd = linear bwd + forward time as the missing weight gradient; `residual`",
        "= fused bias-dropout-add rows; attention dropout (not in the paper models) listed apart.",
        "Kernel sums (no host issue model).",
        "",
        "| model | attn | b | class | pred fwd | op-db fwd | Aceso fwd | pred bwd | op-db bwd | Aceso bwd | pred/op-db f | pred/op-db b |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for model, flash in CASES["l4"]:
        if not model.startswith("gpt"):
            continue
        for b in BATCHES:
            p = preds[("l4", model, flash, 1, b)]
            db = op_db_block(op_db, b, flash) if model == "gpt3-1.3b" else None
            ac = aceso_block(aceso_dir, model, b, 1)
            tot = {"pred": [0.0, 0.0], "db": [0.0, 0.0], "ac": [0.0, 0.0]}
            for c in CLASSES[:-1]:
                pf, pb = p["fwd"]["classes"].get(c, 0.0), p["bwd"]["classes"].get(c, 0.0)
                df = db["fwd"].get(c) if db else None
                dbw = db["bwd"].get(c) if db else None
                af = ac["fwd"].get(c) if ac else None
                ab = ac["bwd"].get(c) if ac else None
                if pf == 0 and pb == 0 and df is None and af is None:
                    continue
                tot["pred"][0] += pf
                tot["pred"][1] += pb
                if c != "dropout":
                    tot["db"][0] += df or 0.0
                    tot["db"][1] += dbw or 0.0
                    tot["ac"][0] += af or 0.0
                    tot["ac"][1] += ab or 0.0
                lines.append(
                    f"| {model} | {'flash' if flash else 'bmm'} | {b} | {c} | {ms(pf)} | {ms(df)} | {ms(af)} | "
                    f"{ms(pb)} | {ms(dbw)} | {ms(ab)} | {pct(pf, df)} | {pct(pb, dbw)} |"
                )
            pf, pb = tot["pred"]
            df, dbw = tot["db"] if db else (None, None)
            af, ab = tot["ac"] if ac else (None, None)
            lines.append(
                f"| {model} | {'flash' if flash else 'bmm'} | {b} | **block (no dropout)** | **{ms(pf)}** | "
                f"**{ms(df)}** | **{ms(af)}** | **{ms(pb)}** | **{ms(dbw)}** | **{ms(ab)}** | "
                f"**{pct(pf, df)}** | **{pct(pb, dbw)}** |"
            )
            drop = (ac["fwd"].get("dropout", 0.0) + ac["bwd"].get("dropout", 0.0)) if ac else 0.0
            summary.append((model, flash, b, pf + pb, (df + dbw) if db else None, (af + ab) if ac else None, drop))
    lines += [
        "",
        "### Block fwd+bwd kernel sums (TP 1): predicted vs measured",
        "",
        "| model | attn | b | predicted ms | op-db ms | Aceso ms | pred / op-db | op-db / Aceso | op-db / Aceso incl. attn dropout |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, flash, b, p, d, a, drop in summary:
        ratio = "–" if (d is None or a is None) else f"{d / a:.2f}"
        ratio_drop = "–" if (d is None or a is None) else f"{d / (a + drop):.2f}"
        lines.append(
            f"| {model} | {'flash' if flash else 'bmm'} | {b} | {ms(p)} | {ms(d)} | {ms(a)} | {pct(p, d)} | {ratio} | "
            f"{ratio_drop} |"
        )
    # ---- TP 2 totals vs Aceso (comm inside the Aceso rows)
    lines += [
        "",
        "### TP 2 (L4, bmm attention): predicted block incl. TP collectives vs Aceso layer (comm inside its rows)",
        "",
        "| model | b | pred fwd | pred fwd comm | Aceso fwd | pred bwd | pred bwd comm | Aceso bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in ACESO_SIZE:
        for b in BATCHES:
            p = preds[("l4", model, False, 2, b)]
            ac = aceso_block(aceso_dir, model, b, 2)
            af = sum(v for k, v in ac["fwd"].items() if k != "dropout") if ac else None
            ab = sum(v for k, v in ac["bwd"].items() if k != "dropout") if ac else None
            lines.append(
                f"| {model} | {b} | {ms(p['fwd']['total'])} | {ms(p['fwd']['classes']['collectives'])} | {ms(af)} | "
                f"{ms(p['bwd']['total'])} | {ms(p['bwd']['classes']['collectives'])} | {ms(ab)} |"
            )
    # ---- H200
    lines += [
        "",
        "## 3. H200: predicted vs measured (blocks measured by `benchmarks/gpu/h200_block_check.py`; flash rows of",
        "`attention.json`)",
        "",
        "The measured blocks are Mist's blocks as they were when measured: the Llama rows predate the lean",
        "kernels (unfused RMSNorm and rotary, 50 / 68 kernels), so their error column compares today's",
        "prediction with yesterday's runtime until they are measured again.",
        "",
        "| model | b | pred block fwd | meas block fwd | err | pred block bwd | meas block bwd | err | pred flash f/b | meas flash f/b |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, flash in CASES["h200"]:
        for b in BATCHES:
            p = preds[("h200", model, flash, 1, b)]
            m = h200_measured(data, model, b)
            pf, pb = p["fwd"]["total"], p["bwd"]["total"]
            lines.append(
                f"| {model} | {b} | {ms(pf)} | {ms(m.get('block_fwd'))} | {pct(pf, m.get('block_fwd'))} | {ms(pb)} | "
                f"{ms(m.get('block_bwd'))} | {pct(pb, m.get('block_bwd'))} | "
                f"{ms(p['fwd']['classes'].get('attn core'))} / {ms(p['bwd']['classes'].get('attn core'))} | "
                f"{ms(m.get('attn_fwd'))} / {ms(m.get('attn_bwd'))} |"
            )
    # ---- kernel counts
    lines += [
        "",
        "## 4. Kernels per block: Mist's traced block vs the original's fused operators",
        "",
        "The original's GPT block, by the operator names of its op-db: fused LayerNorm ×2, fused_dense ×4,",
        "flash-attn (or baddbmm + scaled-upper-triang-masked-softmax + bmm), GeLU, add ×2. Its Llama block",
        "used flash-attn's fused RMSNorm, rotary and SwiGLU (not in the op-db).",
        "",
        "| model | attn | Mist kernels fwd | Mist kernels bwd | per class (fwd) | original fwd ops |",
        "|---|---|---|---|---|---|",
    ]
    for model, flash in CASES["l4"]:
        p = preds[("l4", model, flash, 1, 4)]
        counts = defaultdict(int)
        for lab in p["fwd"]["labels"]:
            counts[lab] += 1
        orig = (
            ("10" if flash else "12")
            if model.startswith("gpt")
            else "11 (RMSNorm ×2, linear ×4, rotary, flash, SwiGLU, add ×2; fused kernels)"
        )
        lines.append(
            f"| {model} | {'flash' if flash else 'bmm'} | {p['fwd']['kernels']} | {p['bwd']['kernels']} | "
            + ", ".join(f"{c} {n}" for c, n in counts.items())
            + f" | {orig} |"
        )
    lines += fused_what_if(profiles, preds)
    rows = case_rows(preds)
    if before is not None:
        lines += before_after(before[0], rows, before[1])
    lines += compiled_vs_eager(profiles)
    return "\n".join(lines) + "\n", rows


def fused_kernels(profile, model: str, tp: int, b: int) -> dict:
    """{phase: seconds} of a Llama block's norms, SwiGLU and rotary had they run as one fused kernel
    each (as the original's flash-attn ops did), priced by the same profile's memory-op classes:
    RMSNorm reads x and writes y (backward: reads x, dy, writes dx); SwiGLU reads gate and up and
    writes the product (backward: reads dy, gate, up, writes both gradients); rotary rewrites the
    rotated dims of q and k in place."""
    spec = get_preset(model)
    T = b * SEQ * spec.hidden_size * 2
    F = b * SEQ * (spec.ffn_hidden_size // tp) * 2
    R = b * SEQ * (spec.num_heads + spec.num_kv_heads) // tp * spec.rotary_dim * 2
    t = profile.memory_op_time
    return {
        "fwd": 2 * t("rmsnorm", 2 * T) + t("swiglu", 3 * F) + t("elementwise", 2 * R),
        "bwd": 2 * t("rmsnorm", 3 * T, True) + t("swiglu", 5 * F, True) + t("elementwise", 2 * R, True),
    }


def fused_what_if(profiles: dict, preds: dict) -> list[str]:
    out = [
        "",
        "## 5. Llama: the traced unfused norms / SwiGLU / rotary vs one fused kernel each (same profile)",
        "",
        "What-if, not a measurement: the fused kernels priced by the profile's own memory-op classes",
        "(`fused_kernels`); `block` = fwd + bwd kernel sums of section 1.",
        "",
        "| gpu | model | tp | b | traced norms+act+rotary f / b ms | fused f / b ms | block ms | block fused ms | change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (gpu, model, _flash, tp, b), p in preds.items():
        if not model.startswith("llama") or b not in (1, 4, 8):
            continue
        traced = {ph: sum(p[ph]["classes"].get(c, 0.0) for c in ("norms", "activation", "rotary")) for ph in p}
        fused = fused_kernels(profiles[gpu], model, tp, b)
        whole = sum(sum(v for k, v in p[ph]["classes"].items() if k != "collectives") for ph in p)
        new = whole - sum(traced.values()) + sum(fused.values())
        out.append(
            f"| {gpu} | {model} | {tp} | {b} | {ms(traced['fwd'])} / {ms(traced['bwd'])} | "
            f"{ms(fused['fwd'])} / {ms(fused['bwd'])} | {ms(whole)} | {ms(new)} | {pct(new, whole)} |"
        )
    return out


def compiled_vs_eager(profiles: dict, b: int = 4) -> list[str]:
    """Section 7: each block at TP 1 as the eager runtime runs it and compiled
    (`training.compile_blocks`), both priced by the same profile: kernels, phase times (with the
    host-issue model) and saved bytes. A prediction, not a measurement: no GPU ran the compiled
    blocks here."""
    out = [
        "",
        f"## 7. Compiled blocks (`training.compile_blocks`) against eager, predicted (b {b}, TP 1)",
        "",
        "The compiled block's graphs are the ones AOTAutograd hands to Inductor (`mist.analysis.compiled`);",
        "each run of pointwise and reduction operators between two GEMM or attention calls is priced as one",
        "fused kernel by the profile's `elementwise` class. Not measured on a GPU.",
        "",
        "| gpu | model | attn | eager kernels f / b | compiled kernels f / b | eager f / b ms | compiled f / b ms "
        "| fwd+bwd change | saved eager / compiled MiB | saved change |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    bs, ss = np.array([float(b)]), np.array([float(SEQ)])
    for gpu, cases in CASES.items():
        for model, flash in cases:
            spec = get_preset(model)
            las = [analyze_layer(spec, "block", 1, flash, DTYPE[gpu], "cuda", False, compiled=c) for c in (False, True)]
            kern = [[len(la.ops(ph)) for ph in ("fwd", "bwd")] for la in las]
            t = [
                [float(np.ravel(phase_time(profiles[gpu], None, la, ph, bs, ss).total)[0]) for ph in ("fwd", "bwd")]
                for la in las
            ]
            saved = [float(np.ravel(la.saved(bs, ss))[0]) / 2**20 for la in las]
            out.append(
                f"| {gpu} | {model} | {'flash' if flash else 'bmm'} | {kern[0][0]} / {kern[0][1]} | "
                f"{kern[1][0]} / {kern[1][1]} | "
                f"{ms(t[0][0])} / {ms(t[0][1])} | {ms(t[1][0])} / {ms(t[1][1])} | {pct(sum(t[1]), sum(t[0]))} | "
                f"{saved[0]:.1f} / {saved[1]:.1f} | {pct(saved[1], saved[0])} |"
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="the measurement folder (holds gpus/)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/decomposition.md")
    ap.add_argument("--l4-profile", default="l4", help="L4 profile name or JSON path (default: shipped)")
    ap.add_argument("--h200-profile", default="h200", help="H200 profile name or JSON path (default: shipped)")
    ap.add_argument("--json", type=Path, help="also write the kernels and block times per case as JSON")
    ap.add_argument(
        "--before",
        type=Path,
        default=ROOT / "benchmarks/results/decomposition_03825f2.json",
        help="the --json of an earlier run, shown next to this one (section 6; default: the blocks of "
        "commit 03825f2, before the lean kernels; skipped where the file is missing)",
    )
    args = ap.parse_args(argv)
    if not (args.data / "gpus/l4/op-db").is_dir():
        ap.error(f"--data {args.data} has no gpus/l4/op-db folder")
    profiles = {"l4": load_profile(args.l4_profile), "h200": load_profile(args.h200_profile)}
    before = None
    if args.before is not None and args.before.is_file():
        before = (json.loads(args.before.read_text()), f"`{args.before.name}` → this run")
    text, rows = run(args.data, profiles, before)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
