#!/bin/sh
# build/train_emu (build/train on the GPU emulator) ends where the CPU run ends: 300 steps of the
# MLP from the same seed on cuda:0, cuda:0,0, cuda:0,1 and cuda:0,1,2,3 with every all-reduce
# backend and P2P algorithm, the replicas bit-identical at every step (MGPU_VERIFY_EVERY=1), and
# the final checkpoints (parameters and optimizer state, max relative difference per tensor):
#   - cuda:0 within 1e-4 of build/train_cpu's, the 2-replica runs within 2e-5 of cuda:0's (what
#     the split and the all-reduce add), the 4-replica runs within 1e-4 (the project's bound for
#     data parallelism against one device). At seed 7 the last differ from cuda:0 by 5.6e-5 (all
#     but the ring), as cuda:0 does from the CPU, at one hidden unit: a ReLU input within rounding
#     of zero at some step goes one way or the other depending on the order of the sums (the CPU
#     GEMM's float chains against the emulated cuBLAS's sums in double, the bias gradients from
#     cuBLASLt's epilogue on one GPU, the ring's rotation of the replicas), and that one decision
#     outweighs the rest (at most 3.2e-6).
#   - with --graph (steps replayed from a CUDA graph), on cuda:0 and on 4 GPUs (P2P ring): the
#     bits of the eager run of the same layout, most steps from the graph; and on cuda:0 with
#     --precision bf16; and a small GPT in bf16 (build/emu/gpt), and in fp32 on cuda:0,0 with
#     --recompute --zero1 against the eager run without them, and in fp32 with MGPU_FUSE_GELU=1.
#   - --precision bf16 on the CPU: 2 epochs of the MLP and of the CNN within 0.005 test accuracy of
#     fp32's 2 epochs.
# Usage: train.sh [BUILD_DIR] [DATA_DIR]; EMU_TRAIN_STEPS, EMU_TRAIN_TOL, EMU_TRAIN_CPU_TOL,
# EMU_TRAIN_MODEL change the steps, the tolerances and the model. Skips without Fashion-MNIST.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
steps=${EMU_TRAIN_STEPS:-300}
tol=${EMU_TRAIN_TOL:-2e-5}
cpu_tol=${EMU_TRAIN_CPU_TOL:-1e-4}
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
    t=$tol; ref="$tmp/gpu0.safetensors"   # the multi-GPU runs against the emulated single GPU
    [ "$spec" = cuda:0,1,2,3 ] && t=${EMU_TRAIN_4_TOL:-1e-4}
    [ "$spec" = cuda:0 ] && { t=$cpu_tol; ref="$tmp/cpu.safetensors"; }   # ... and that one against the CPU
    if env $env "$b/train_emu" $args --devices "$spec" --save "$tmp/gpu.safetensors" > "$tmp/gpu.txt" 2>&1; then
        last=$(tail -n 1 "$tmp/gpu.txt")
        [ "$spec" = cuda:0 ] && cp "$tmp/gpu.safetensors" "$tmp/gpu0.safetensors"
        diff=$("$b/emu/ckpt_diff" "$tmp/gpu.safetensors" "$ref" "$t" 2>&1); rc=$?
        if [ $rc -eq 0 ] && echo "$last" | grep -q "allreduce=$want "; then
            passed=$((passed + 1)); echo "  ok   $what: $diff"
        else
            failed=$((failed + 1)); echo "  FAIL $what: $diff (tolerance $t); want allreduce=$want: $last"
        fi
    else
        failed=$((failed + 1)); echo "  FAIL $what: exit status $?"; tail -n 5 "$tmp/gpu.txt" | sed 's/^/       /'
    fi
done
# --graph: each step replayed from a CUDA graph after the first, the same bits as the eager run
# of the same layout (P2P: a graph does not hold NCCL across GPUs of one process)
# (and in bf16 mixed precision on cuda:0)
for run in "cuda:0 - fp32" "cuda:0,1,2,3 ring fp32" "cuda:0 - bf16"; do
    set -- $run
    env="MGPU_EMU_DEVICES=4 MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so MGPU_VERIFY_EVERY=1 MGPU_ALLREDUCE=p2p"
    [ "$2" != - ] && env="$env MGPU_P2P=$2"
    what="train_emu --graph --precision $3 --devices $1 ($env)"
    if env $env "$b/train_emu" $args --precision "$3" --devices "$1" --save "$tmp/eager.safetensors" > "$tmp/eager.txt" 2>&1 &&
       env $env "$b/train_emu" $args --precision "$3" --devices "$1" --graph --save "$tmp/graph.safetensors" > "$tmp/graph.txt" 2>&1; then
        diff=$("$b/emu/ckpt_diff" "$tmp/graph.safetensors" "$tmp/eager.safetensors" 0 2>&1); rc=$?
        graphed=$(sed -n 's/^graph_steps=//p' "$tmp/graph.txt")
        if [ $rc -eq 0 ] && [ "${graphed:-0}" -ge $((steps - 10)) ]; then
            passed=$((passed + 1)); echo "  ok   $what: $graphed of $steps steps from the graph, $diff"
        else
            failed=$((failed + 1)); echo "  FAIL $what: ${graphed:-no} graph steps; against the eager run: $diff"
        fi
    else
        failed=$((failed + 1)); echo "  FAIL $what: exit status $?"; tail -n 5 "$tmp/graph.txt" | sed 's/^/       /'
    fi
done
# A small GPT (2 blocks of width 64, T 32) with dropout on the README's text, on emulated GPUs:
# gpt_against_eager WHAT ARGS OPTIONS runs it eagerly with ARGS and again with ARGS OPTIONS, which
# must take most steps from a CUDA graph and give the eager run's bits.
env="MGPU_EMU_DEVICES=1 MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so"
gpt_against_eager() {
    gpt_args="--text $(dirname "$0")/../../README.md --steps 8 --every 4 --sample 0 --layers 2 --width 64 --seq 32 --batch 4 --dropout 0.1 $2"
    if env $env "$b/emu/gpt" $gpt_args --save "$tmp/eager.safetensors" > "$tmp/eager.txt" 2>&1 &&
       env $env "$b/emu/gpt" $gpt_args $3 --save "$tmp/graph.safetensors" > "$tmp/graph.txt" 2>&1; then
        diff=$("$b/emu/ckpt_diff" "$tmp/graph.safetensors" "$tmp/eager.safetensors" 0 2>&1); rc=$?
        graphed=$(sed -n 's/.* graph_steps=\([0-9]*\).*/\1/p' "$tmp/graph.txt")
        if [ $rc -eq 0 ] && [ "${graphed:-0}" -ge 6 ]; then
            passed=$((passed + 1)); echo "  ok   $1: $graphed of 8 steps from the graph, $diff"
        else
            failed=$((failed + 1)); echo "  FAIL $1: ${graphed:-no} graph steps; against the eager run: $diff"
        fi
    else
        failed=$((failed + 1)); echo "  FAIL $1: exit status $?"; tail -n 5 "$tmp/eager.txt" "$tmp/graph.txt" 2>/dev/null | sed 's/^/       /'
    fi
}
# in bf16: the graph steps have the eager steps' bits on cuda:0 (containers, attention and the
# embeddings in bf16)
gpt_against_eager "emu/gpt --precision bf16 --graph --devices cuda:0" "--precision bf16 --devices cuda:0" "--graph"
# in fp32 on two replicas, its LayerNorm and GELU outputs computed again in backward and AdamW's
# states sharded (--recompute --zero1), as a CUDA graph: the bits of the eager run without either
gpt_against_eager "emu/gpt --recompute --zero1 --graph --devices cuda:0,0 against eager without them" \
    "--weight-decay 0.1 --clip 1 --devices cuda:0,0" "--recompute --zero1 --graph"
# with MGPU_FUSE_GELU (the GELUs in the GEMMs before them, cuBLASLt's GELU_AUX_BIAS): the graph
# steps have the eager steps' bits, in fp32 on cuda:0
env_without=$env
env="$env MGPU_FUSE_GELU=1"
gpt_against_eager "emu/gpt --graph --devices cuda:0 with MGPU_FUSE_GELU=1" "--devices cuda:0" "--graph"
env=$env_without
# --precision bf16 on the CPU: 2 epochs of the MLP and of the CNN reach the test accuracy of fp32's
# 2 epochs within 0.005 (the issue's bar)
for net in mlp cnn; do
    what="train_cpu --model $net --precision bf16 --epochs 2 against fp32"
    if "$b/train_cpu" --data "$data" --quiet --model $net --epochs 2 --seed 7 --devices cpu > "$tmp/f32.txt" 2>&1 &&
       "$b/train_cpu" --data "$data" --quiet --model $net --epochs 2 --seed 7 --devices cpu --precision bf16 > "$tmp/bf16.txt" 2>&1; then
        a32=$(sed -n 's/.* test_acc=\([0-9.]*\) .*/\1/p' "$tmp/f32.txt"); a16=$(sed -n 's/.* test_acc=\([0-9.]*\) .*/\1/p' "$tmp/bf16.txt")
        if awk -v a="$a32" -v b="$a16" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0.8 && d <= 0.005) }'; then
            passed=$((passed + 1)); echo "  ok   $what: test accuracy $a16 against $a32"
        else
            failed=$((failed + 1)); echo "  FAIL $what: test accuracy ${a16:-none} against ${a32:-none} (want within 0.005)"
        fi
    else
        failed=$((failed + 1)); echo "  FAIL $what: exit status $?"; tail -n 3 "$tmp/f32.txt" "$tmp/bf16.txt" | sed 's/^/       /'
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
