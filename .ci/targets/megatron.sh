#!/usr/bin/env bash
# Megatron-LM / megatron-core 0.19.2 for the export checks (tests/export/test_megatron.py).
#
# megatron-core 0.19.2 declares Python >= 3.12 and ships a cp312 wheel (one compiled dataset helper),
# while Mist's CI runs Python 3.11 with the CPU torch wheel. The checks use only pure-Python parts
# (megatron/training/arguments.py and megatron/core's config classes), so this script downloads the
# wheel without installing it and unzips it into .ci/vendor/ (git-ignored); the tests put that folder
# on sys.path and supply the one 3.12-only name it imports (typing.override). Torch is never touched.
# Idempotent: an existing unpacked copy of the pinned version is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.19.2
DEST=.ci/vendor/megatron-core-$VERSION
TORCH_BEFORE=$(python -c "import torch; print(torch.__version__)")
# what the argument code imports besides torch; triton (imported by megatron.core even on CPU) comes
# with CUDA builds of torch, so it is installed only where torch did not bring one
python -m pip install -q 'typing_extensions>=4.12' 'numpy' 'packaging' 'pyyaml'
python -c "import triton" 2>/dev/null || python -m pip install -q --no-deps 'triton==3.9.0'
if [ ! -f "$DEST/megatron/training/arguments.py" ]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    python -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
        -d "$TMP" "megatron-core==$VERSION"
    rm -rf "$DEST" && mkdir -p "$DEST"
    python -m zipfile -e "$TMP"/megatron_core-"$VERSION"-*.whl "$DEST"
fi
TORCH_AFTER=$(python -c "import torch; print(torch.__version__)")
[ "$TORCH_BEFORE" = "$TORCH_AFTER" ] || { echo "torch changed from $TORCH_BEFORE to $TORCH_AFTER" >&2; exit 1; }
echo "megatron-core $VERSION unpacked in $DEST"
