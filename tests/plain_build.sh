#!/bin/sh
# A plain `cc -std=c99 -O2` build (no -march: what a user who vendors mgpu.h compiles) on a CPU with
# AVX2 and FMA picks the same micro-kernel at run time as the Makefile's -march=native build:
# build/train_plain and build/train_cpu train 100 steps on Fashion-MNIST from seed 7 to the same
# bits (the old plain build's portable kernel summed otherwise, and ran 4 to 5 times slower).
# Usage: plain_build.sh [BUILD_DIR] [DATA_DIR]. Skips without the data, ckpt_diff, or AVX2 and FMA.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
skip() { echo "  skip $1"; echo "0 passed, 0 failed, 1 skipped"; exit 0; }
[ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ] || skip "plain build: no Fashion-MNIST in $data"
[ -x "$b/emu/ckpt_diff" ] || skip "plain build: no $b/emu/ckpt_diff"
grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo 2>/dev/null || skip "plain build: this CPU has no AVX2 and FMA"
for p in train_cpu train_plain; do
    if ! "$b/$p" --data "$data" --quiet --seed 7 --max-steps 100 --save "$tmp/$p.st" > "$tmp/$p.txt" 2>&1; then
        echo "  FAIL $b/$p: $(tail -n 2 "$tmp/$p.txt")"; echo "0 passed, 1 failed, 0 skipped"; exit 1
    fi
done
if diff=$("$b/emu/ckpt_diff" "$tmp/train_plain.st" "$tmp/train_cpu.st" 0 2>&1); then
    echo "  ok   cc -O2 and cc -O2 -march=native train to the same bits: $diff"; echo "1 passed, 0 failed, 0 skipped"
else
    echo "  FAIL cc -O2 against cc -O2 -march=native (tolerance 0): $diff"; echo "0 passed, 1 failed, 0 skipped"; exit 1
fi
