#!/bin/sh
# Runs tests/interop.py with a Python that has torch and safetensors (Debian's python3-torch lives
# in the system Python), or reports the test skipped.
cd "$(dirname "$0")/.." || exit 1
for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch, safetensors, numpy" 2>/dev/null; then
        exec "$py" tests/interop.py "${1:-build}"
    fi
done
echo "  skip PyTorch interop: no Python with torch, safetensors and numpy (see .ci/run)"
echo "0 passed, 0 failed, 3 skipped"
