#!/bin/sh
# BatchNorm2d's running statistics against PyTorch's nn.BatchNorm2d (tests/bn_torch.py), with a
# Python that has torch, safetensors and numpy (Debian's python3-torch), or a skip.
# Usage: bn_torch.sh [BUILD_DIR]
cd "$(dirname "$0")/.." || exit 1
b=${1:-build}
if [ ! -x "$b/bn_torch" ]; then
    echo "  FAIL $b/bn_torch is not built (make $b/bn_torch)"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi
for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch, safetensors, numpy" 2>/dev/null; then
        exec "$py" tests/bn_torch.py "$b"
    fi
done
echo "  skip BatchNorm2d against PyTorch: no Python with torch, safetensors and numpy (see .ci/run)"
echo "0 passed, 0 failed, 4 skipped"
