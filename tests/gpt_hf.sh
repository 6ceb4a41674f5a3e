#!/bin/sh
# build/gpt against Hugging Face transformers' GPT2LMHeadModel (tests/gpt_hf.py): with a Python
# that has torch, safetensors and transformers (Debian's python3-torch and, from PyPI, a
# transformers release that works with it, such as 4.30.x: .ci/run installs both), or a skip.
# Usage: gpt_hf.sh [BUILD_DIR]
cd "$(dirname "$0")/.." || exit 1
b=${1:-build}
if [ ! -x "$b/gpt" ]; then
    echo "  FAIL $b/gpt is not built (make $b/gpt)"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi
for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch, safetensors, transformers" 2>/dev/null; then
        exec "$py" tests/gpt_hf.py "$b"
    fi
done
echo "  skip GPT-2 against Hugging Face: no Python with torch, safetensors and transformers (see .ci/run)"
echo "0 passed, 0 failed, 4 skipped"
