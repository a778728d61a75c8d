#!/usr/bin/env bash
# Installs torchtitan 0.3.0 into the active venv for the export checks (tests/export/test_torchtitan.py),
# without ever touching torch: every package that depends on torch goes in with --no-deps, and the
# packages torchtitan imports when its config manager, parallel dims and llama3 model load are named
# and pinned here. torchtitan imports triton even on a CPU machine. Idempotent: pip skips what is there.
set -euo pipefail

torch_before=$(python -c "import torch; print(torch.__version__)")

# depend on torch: no resolver, so pip can never swap the installed torch
pip install --no-deps \
    torchtitan==0.3.0 \
    torchdata==0.11.0 \
    torch_checkpointing==0.1.1 \
    spmd_types==0.2.3 \
    triton==3.9.0

# torch-free import-time dependencies (their own dependencies resolved by pip)
pip install \
    tyro==1.0.17 \
    einops==0.8.2 \
    safetensors==0.8.0 \
    tokenizers==0.23.3 \
    tensorboard==2.21.0 \
    'datasets==4.7.0'

torch_after=$(python -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "torchtitan.sh: torch changed from $torch_before to $torch_after; reinstall torch==$torch_before" >&2
    exit 1
fi
python -c "import torchtitan.config.manager, torchtitan.distributed.parallel_dims, torchtitan.models.llama3; print('torchtitan import ok')"
