"""Run Megatron's own argument parsing and validation on exported `pretrain_gpt.py` arguments.

Run as a script (a separate process: Megatron keeps global state and patches logging):
    python tests/export/megatron_check.py < cases.json > results.json
Each case is {"args": [...], "world_size": N, "env": {...}}. For each, Megatron's `parse_args`,
`validate_args` and `core_transformer_config_from_args` (TransformerConfig's own checks) run on the
arguments with WORLD_SIZE=N, and the result says what Megatron made of them (tp, pp, dp, micro-batch,
number of micro-batches from its micro-batch calculator, decoder layers per pipeline rank and per
model chunk of each rank from the parsed layout, its virtual pipeline size, and with one its
interleaved schedule's micro-batch group and forward order (`get_schedule_table`), recomputation,
optimizer) or the error it raised.

megatron-core 0.19.2 declares Python >= 3.12; .ci/targets/megatron.sh unzips its wheel into
.ci/vendor/ and this checker runs it under the project's Python 3.11 with one shim: `typing.override`
(new in 3.12, imported by one module the arguments import) is taken from typing_extensions. The only
CUDA query on this path (the GPU architecture, read when tp > 1) is answered with 9 (Hopper), and
Transformer Engine's fused RoPE kernel, whose presence TransformerConfig checks, gets a stand-in.
"""

from __future__ import annotations

import json
import os
import sys
import typing
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[2] / ".ci" / "vendor" / "megatron-core-0.19.2"


def load_megatron():
    """Import Megatron's argument code from the unpacked wheel (raises if it is missing)."""
    if not (VENDOR / "megatron" / "training" / "arguments.py").is_file():
        raise RuntimeError(f"megatron-core 0.19.2 is not unpacked in {VENDOR}: run `bash .ci/targets/megatron.sh`")
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    sys.path.insert(0, str(VENDOR))
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 9
    from megatron.core.models.common.embeddings import rope_utils

    # Transformer Engine (GPU only) is absent: TransformerConfig checks only that its fused RoPE
    # kernel exists (the default --apply-rope-fusion), so a stand-in object answers that.
    rope_utils.fused_apply_rotary_pos_emb = rope_utils.fused_apply_rotary_pos_emb or object()
    return arguments


def check(case: dict) -> dict:
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update({"WORLD_SIZE": str(case["world_size"]), "RANK": "0", **case.get("env", {})})
    sys.argv = ["pretrain_gpt.py", *case["args"]]
    try:
        args = parse_args()
        validate_args(args, {})
        cfg = core_transformer_config_from_args(args)
    except (AssertionError, ValueError, TypeError, RuntimeError, SystemExit) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(
        0, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron.core.transformer.enums import LayerType

    pp = args.pipeline_model_parallel_size
    lay = cfg.pipeline_model_parallel_layout
    # decoder layers of each rank's model chunks, read from the parsed layout ([rank][chunk])
    chunks = [[part.count(LayerType.decoder) for part in lay.layout[r]] for r in range(pp)] if lay is not None else None
    vp = args.virtual_pipeline_model_parallel_size
    group = cfg.microbatch_group_size_per_vp_stage
    G = nmc.get_num_microbatches()
    return {
        "vp": vp,
        "config_vp": cfg.virtual_pipeline_model_parallel_size,
        "chunk_layers": chunks,
        "microbatch_group": group if vp else None,
        # (micro-batch, chunk) of each forward of the interleaved schedule, in order
        "forward_order": [list(x) for x in get_schedule_table(G, vp, group)] if vp else None,
        "ok": True,
        "tp": args.tensor_model_parallel_size,
        "pp": pp,
        "dp": args.data_parallel_size,
        "micro_batch": args.micro_batch_size,
        "num_microbatches": G,
        "stage_layers": [sum(c) for c in chunks] if chunks is not None else None,
        "num_layers": cfg.num_layers,
        "num_query_groups": cfg.num_query_groups,
        "normalization": cfg.normalization,
        "gated_linear_unit": cfg.gated_linear_unit,
        "position_embedding_type": args.position_embedding_type,
        "untied": args.untie_embeddings_and_output_weights,
        "recompute_granularity": cfg.recompute_granularity,
        "recompute_method": cfg.recompute_method,
        "recompute_num_layers": cfg.recompute_num_layers,
        "recompute_modules": list(cfg.recompute_modules or []),
        "distributed_optimizer": args.use_distributed_optimizer,
        "fsdp": args.use_megatron_fsdp,
        "sharding": args.data_parallel_sharding_strategy,
        "offload_fraction": args.optimizer_offload_fraction if args.optimizer_cpu_offload else 0.0,
        "bf16": args.bf16,
        "fp16": args.fp16,
        "grads_fp32": args.accumulate_allreduce_grads_in_fp32,
    }


def main() -> None:
    cases = json.load(sys.stdin)
    load_megatron()
    import logging

    logging.disable(logging.CRITICAL)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # Megatron prints its arguments; keep stdout for the results
    results = [check(c) for c in cases]
    sys.stdout = real_stdout
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
