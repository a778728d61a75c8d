"""Tuning time as the search space grows one family of knobs at a time (the paper's study on
GPT-22B over 4×8 GPUs): base → +ZeRO-2/3 → +checkpointing → +selective recomputation (the
MLP activation; with flash attention the attention core is not searched) → +optimizer offload →
+activation offload → +gradient offload → +weight offload. Prints a Markdown table.

    PYTHONPATH=src python benchmarks/tuning_time.py [--model gpt3-22b] [--gpu l4] [--nodes 4]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from mist.analysis.layer import warm
from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.search import tune
from mist.tune.space import EIGHTHS, SPACES

NONE = (0.0,)


def steps():
    base = replace(
        SPACES["full"],
        name="base",
        seed_space=None,
        zero_levels=(0, 1),
        recompute="all_or_nothing",
        recompute_attention=(False,),
        recompute_activation=(False,),
        offload_weights=NONE,
        offload_grads=NONE,
        offload_optimizer=NONE,
        offload_activations=NONE,
    )
    s1 = replace(base, name="+ZeRO-2/3", zero_levels=(0, 1, 2, 3))
    s2 = replace(s1, name="+checkpointing", recompute="any")
    s2b = replace(
        s2,
        name="+selective recomputation",
        recompute_attention=SPACES["full"].recompute_attention,
        recompute_activation=SPACES["full"].recompute_activation,
    )
    s3 = replace(s2b, name="+optimizer offload", offload_optimizer=EIGHTHS)
    s4 = replace(s3, name="+activation offload", offload_activations=EIGHTHS)
    s5 = replace(s4, name="+gradient offload", offload_grads=EIGHTHS, wg_policy="always")
    s6 = replace(s5, name="+weight offload", offload_weights=EIGHTHS)
    return [base, s1, s2, s2b, s3, s4, s5, s6]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-22b")
    ap.add_argument("--gpu", default="l4")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/tuning_time.md")
    a = ap.parse_args(argv)
    spec = get_preset(a.model)
    cluster = ClusterSpec(a.gpu, a.nodes, a.gpus_per_node)
    training = TrainingSpec(seq_len=a.seq, global_batch=16 * cluster.world_size)
    prof = load_profile(a.gpu)
    warm(spec, (1, 2, 4, 8), training.flash_attention)  # time the search, not the (cached) tracing
    rows = ["| space | candidates evaluated | tuning time (s) | predicted iteration (s) |", "|---|---|---|---|"]
    for sp in steps():
        t = time.perf_counter()
        r = tune(spec, cluster, training, prof, sp)
        dt = time.perf_counter() - t
        it = f"{r.iteration_time_s:.2f}" if r.plan else "no fit"
        rows.append(f"| {sp.name} | {r.candidates_evaluated:,} | {dt:.1f} | {it} |")
        print(rows[-1], flush=True)
    text = (
        f"# Tuning time vs search space ({a.model}, {cluster.nodes}×{cluster.gpus_per_node} {a.gpu}, "
        f"seq {a.seq}, batch {training.global_batch}; 2-core machine, traces cached)\n\n" + "\n".join(rows) + "\n"
    )
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
