#!/usr/bin/env bash
# Install DeepSpeed 0.19.8 into the active venv, for the checks in tests/export/test_deepspeed.py.
# DS_BUILD_OPS=0: no op is compiled by pip (the CPU ops the checks need are JIT-built at the end,
# g++ needed); --no-build-isolation: its setup.py imports the torch already installed;
# --no-deps: pip must never replace that torch, so the pure-Python dependencies are listed here.
# numpy, packaging and pydantic are left to the project's and the other targets' pins.
# Idempotent: pip skips what is already installed at these versions, the op builds are cached.
set -euo pipefail
torch_before="$(python -c 'import torch; print(torch.__version__)')"
python -m pip install --quiet \
    numpy packaging 'pydantic>=2' \
    hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0 tqdm==4.70.1 einops==0.8.2 \
    nvidia-ml-py==13.615.71
if ! DS_ACCELERATOR=cpu python -c 'import deepspeed, sys; sys.exit(deepspeed.__version__ != "0.19.8")' 2>/dev/null; then
    DS_BUILD_OPS=0 python -m pip install --quiet --no-deps --no-build-isolation deepspeed==0.19.8
fi
torch_after="$(python -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
    echo "error: installing DeepSpeed changed torch from $torch_before to $torch_after" >&2
    exit 1
fi
DS_ACCELERATOR=cpu python -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
# Build the CPU ops the training checks use now (cached in ~/.cache/torch_extensions), so that
# the tests do not spend minutes compiling: CPU Adam (partial optimizer offload), the CPU
# FusedAdam (the default AdamW on the CPU accelerator) and the shared-memory collectives.
DS_ACCELERATOR=cpu python - <<'PY'
from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
    print("built", name)
PY
