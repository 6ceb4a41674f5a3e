#!/bin/sh
# Pipelines trained for real: build/train_cpu on Fashion-MNIST, 300 steps from seed 7, on one CPU
# device and on pipelines of 2 and 3 stages and 2 x 2 (cpu:2, cpu:3, cpu:4), with 1, 4 and 8
# micro-batches and both schedules; the final checkpoints (parameters and optimizer state, max
# relative difference per tensor) within 1e-5 of the one-device run (0: the same bits, for one
# micro-batch, and GPipe against 1F1B), and the test accuracy equal to 3 decimals. The MLP, the
# MLP with Dropout(0.2), and the CNN for 20 steps (see below), then the same on emulated GPUs
# (build/train_emu, when built) against the emulated cuda:0.
# The CNN: at this learning rate its training amplifies any rounding difference (the ReLUs and the
# max-pools switch): plain data parallelism (cpu:4, no pipeline) is 7e-7 from one device after 30
# steps and 0.3 after 60, and 4 micro-batches on one device do the same. So the CNN runs 20 steps,
# where the comparison still measures the pipeline rather than that amplification.
# Usage: pipeline.sh [BUILD_DIR] [DATA_DIR]. Skips without Fashion-MNIST.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0; skipped=0
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
    echo "  skip pipelines on Fashion-MNIST: no data in $data (apt-get install dataset-fashion-mnist)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
acc() { sed -n 's/.*test_acc=\([0-9.]*\).*/\1/p' "$1" | awk '{ printf "%.3f", $1 }'; }
# run PROGRAM NAME ARGS...: train, keep the checkpoint as NAME
run() {
    prog=$1; name=$2; shift 2
    if ! env $ENV "$prog" --data "$data" --quiet --seed 7 "$@" --save "$tmp/$name.st" > "$tmp/$name.txt" 2>&1; then
        failed=$((failed + 1)); echo "  FAIL $prog $*: $(tail -n 2 "$tmp/$name.txt")"; return 1
    fi
}
# check NAME REF TOL: NAME's checkpoint within TOL of REF's, and the same test accuracy
check() {
    d=$("$b/emu/ckpt_diff" "$tmp/$1.st" "$tmp/$2.st" "$3" 2>&1); rc=$?
    if [ $rc -eq 0 ] && [ "$(acc "$tmp/$1.txt")" = "$(acc "$tmp/$2.txt")" ]; then
        passed=$((passed + 1)); echo "  ok   $1 against $2: $d, test accuracy $(acc "$tmp/$1.txt")"
    else
        failed=$((failed + 1)); echo "  FAIL $1 against $2 (tolerance $3): $d, test accuracy $(acc "$tmp/$1.txt") vs $(acc "$tmp/$2.txt")"
    fi
}
# suite PROGRAM ONE TWO THREE FOUR ARGS...: the layouts on devices ONE (reference), TWO, THREE, FOUR
suite() {
    prog=$1; one=$2; two=$3; three=$4; four=$5; tag=$6; shift 6
    run "$prog" "$tag-ref" --devices "$one" "$@" || return
    run "$prog" "$tag-s2m1" --devices "$two" --stages 2 --micro-batches 1 "$@" && check "$tag-s2m1" "$tag-ref" 0
    run "$prog" "$tag-s2m4" --devices "$two" --stages 2 --micro-batches 4 "$@" && check "$tag-s2m4" "$tag-ref" $TOL
    run "$prog" "$tag-s2m8g" --devices "$two" --stages 2 --micro-batches 8 --pipeline gpipe "$@" && check "$tag-s2m8g" "$tag-ref" $TOL
    run "$prog" "$tag-s3m4" --devices "$three" --stages 3 --micro-batches 4 "$@" && check "$tag-s3m4" "$tag-ref" $TOL
    run "$prog" "$tag-s3m8" --devices "$three" --stages 3 --micro-batches 8 "$@" && check "$tag-s3m8" "$tag-ref" $TOL
    run "$prog" "$tag-s3m8g" --devices "$three" --stages 3 --micro-batches 8 --pipeline gpipe "$@" && check "$tag-s3m8g" "$tag-s3m8" 0
    run "$prog" "$tag-r2s2m4" --devices "$four" --stages 2 --micro-batches 4 "$@" && check "$tag-r2s2m4" "$tag-ref" $TOL
}
ENV=; TOL=1e-5
suite "$b/train_cpu" cpu cpu:2 cpu:3 cpu:4 mlp --model mlp --max-steps 300
suite "$b/train_cpu" cpu cpu:2 cpu:3 cpu:4 mlp-dropout --model mlp --dropout 0.2 --max-steps 300
suite "$b/train_cpu" cpu cpu:2 cpu:3 cpu:4 cnn --model cnn --max-steps 10
if [ -x "$b/train_emu" ]; then
    lib=$(cd "$b/emu" && pwd)
    ENV="MGPU_EMU_DEVICES=4 MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so MGPU_VERIFY_EVERY=1 MGPU_TEST_REQUIRE_GPU=1"; TOL=1e-4
    suite "$b/train_emu" cuda:0 cuda:0,1 cuda:0,1,2 cuda:0,1,2,3 emu-mlp --model mlp --max-steps 300
else
    skipped=$((skipped + 1)); echo "  skip pipelines on emulated GPUs: no $b/train_emu"
fi
# --trace: three steps of a 2 x 2 pipeline in Chrome's trace format, read back by Python's json
if run "$b/train_cpu" trace --model mlp --max-steps 12 --devices cpu:4 --stages 2 --micro-batches 4 --trace "$tmp/trace.json"; then
    if out=$(python3 -c '
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
slices = [e for e in events if e["ph"] == "X"]
count = lambda p: sum(1 for e in slices if e["name"].startswith(p))
# 3 steps x 4 parts x 4 micro-batches; an optimizer step and an all-reduce per part and step
assert count("F ") == 48 and count("B ") == 48 and count("optimizer") == 12 and count("all-reduce") == 12, slices[:3]
assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
print(len(slices), "slices")' "$tmp/trace.json" 2>&1); then
        passed=$((passed + 1)); echo "  ok   --trace: $out"
    else
        failed=$((failed + 1)); echo "  FAIL --trace: $out"
    fi
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
