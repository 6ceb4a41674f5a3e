#!/bin/sh
# build/train_emu (build/train on the GPU emulator) ends where the CPU run ends: 300 steps of the
# MLP from the same seed on cuda:0, cuda:0,0, cuda:0,1 and cuda:0,1,2,3 with every all-reduce
# backend and P2P algorithm; the final checkpoints (parameters and optimizer state) within 2e-5
# (max relative, per tensor) of build/train_cpu's, and the replicas bit-identical at every step
# (MGPU_VERIFY_EVERY=1). The P2P ring over 4 replicas adds each chunk in its own rotation of the
# replicas (not in replica order as the other backends do): a different rounding, which after 300
# steps of this chaotic map reaches about 6e-5 (1.6e-7 after one step), so it gets 1e-4. Usage: train.sh [BUILD_DIR] [DATA_DIR]; EMU_TRAIN_STEPS, EMU_TRAIN_TOL,
# EMU_TRAIN_MODEL change the steps, the tolerance and the model. Skips without Fashion-MNIST.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
steps=${EMU_TRAIN_STEPS:-300}
tol=${EMU_TRAIN_TOL:-2e-5}
model=${EMU_TRAIN_MODEL:-mlp}
lib=$(cd "$b/emu" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0; skipped=0
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
    echo "  skip build/train_emu against the CPU: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
args="--data $data --quiet --model $model --max-steps $steps --seed 7"
if ! "$b/train_cpu" $args --devices cpu --save "$tmp/cpu.safetensors" > "$tmp/cpu.txt" 2>&1; then
    echo "  FAIL build/train_cpu: $(tail -n 3 "$tmp/cpu.txt")"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi
echo "   cpu: $(tail -n 1 "$tmp/cpu.txt")"
# spec, backend asked for (MGPU_ALLREDUCE), P2P algorithm (MGPU_P2P), backend expected
for run in "cuda:0 - - none" \
           "cuda:0,0 p2p oneshot p2p" "cuda:0,0 p2p ring p2p" "cuda:0,0 host - host" \
           "cuda:0,1 nccl - nccl" "cuda:0,1 p2p oneshot p2p" "cuda:0,1 p2p ring p2p" "cuda:0,1 host - host" \
           "cuda:0,1,2,3 nccl - nccl" "cuda:0,1,2,3 p2p oneshot p2p" "cuda:0,1,2,3 p2p ring p2p" \
           "cuda:0,1,2,3 host - host"; do
    set -- $run
    spec=$1; want=$4
    env="MGPU_EMU_DEVICES=4 MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so MGPU_VERIFY_EVERY=1"
    [ "$2" != - ] && env="$env MGPU_ALLREDUCE=$2"
    [ "$3" != - ] && env="$env MGPU_P2P=$3"
    what="train_emu --devices $spec ($env)"
    t=$tol
    [ "$3" = ring ] && [ "$spec" = cuda:0,1,2,3 ] && t=${EMU_TRAIN_RING_TOL:-1e-4}
    if env $env "$b/train_emu" $args --devices "$spec" --save "$tmp/gpu.safetensors" > "$tmp/gpu.txt" 2>&1; then
        last=$(tail -n 1 "$tmp/gpu.txt")
        diff=$("$b/emu/ckpt_diff" "$tmp/gpu.safetensors" "$tmp/cpu.safetensors" "$t" 2>&1); rc=$?
        if [ $rc -eq 0 ] && echo "$last" | grep -q "allreduce=$want "; then
            passed=$((passed + 1)); echo "  ok   $what: $diff"
        else
            failed=$((failed + 1)); echo "  FAIL $what: $diff (tolerance $t); want allreduce=$want: $last"
        fi
    else
        failed=$((failed + 1)); echo "  FAIL $what: exit status $?"; tail -n 5 "$tmp/gpu.txt" | sed 's/^/       /'
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
