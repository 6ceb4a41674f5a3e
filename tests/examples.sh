#!/bin/sh
# The examples run and succeed: hello multiplies, custom_layer learns with its SiLU (exit 0 when
# the loss falls below 0.3), data_parallel keeps 2, 3 and 4 CPU replicas bit-identical,
# model_parallel's two stages by hand match the library's pipeline bit for bit, the
# tour trains an epoch of Fashion-MNIST (and docs/guide.md's copy of it is the file), resnet
# runs 40 steps of its BatchNorm ResNet on cpu:2 (test accuracy above 0.3), and 10 with
# --sync-bn as one CPU does; gru (a GRU made of tape ops) agrees on one CPU, cpu:2 and two
# emulated GPUs.
# With a CUDA build of data_parallel and a GPU, also four replicas on one GPU.
b=${1:-build}
passed=0; failed=0; skipped=0
run() {
    if out=$("$@" 2>&1); then passed=$((passed + 1)); echo "  ok   $*"
    else failed=$((failed + 1)); echo "  FAIL $*"; echo "$out" | tail -n 5; fi
}
# build/gru: the GRU written from tape ops (no backward of its own) trains; 20 steps (hidden 32)
# on one CPU, on cpu:2 and on two emulated GPUs (build/emu/gru) end at test losses within 1e-3
# of each other (data parallelism adds in another order), and one CPU's accuracy on 1000 test
# images is above 0.3
gru_check() {
    flags="--data $data --max-steps 20 --hidden 32 --eval-rows 1000"
    out=$("$b/gru" $flags --devices cpu) || return 1
    one=$(echo "$out" | sed -n 's/.*test_loss=\([0-9.]*\).*/\1/p')
    echo "$out" | grep -q 'test_acc=0\.[3-9]' || { echo "one CPU: $out"; return 1; }
    two=$("$b/gru" $flags --devices cpu:2 | sed -n 's/.*test_loss=\([0-9.]*\).*/\1/p')
    emu=$one
    if [ -x "$b/emu/gru" ]; then
        emu=$(MGPU_EMU_DEVICES=2 "$b/emu/gru" $flags --devices cuda:0,1 | sed -n 's/.*test_loss=\([0-9.]*\).*/\1/p')
    fi
    echo "test_loss: cpu $one, cpu:2 $two, 2 emulated GPUs $emu"
    [ -n "$one" ] && [ -n "$two" ] && [ -n "$emu" ] &&
        awk -v a="$one" -v b="$two" -v c="$emu" 'BEGIN { d = a - b; e = a - c; exit !(d < 1e-3 && d > -1e-3 && e < 1e-3 && e > -1e-3) }'
}
# --sync-bn: two replicas normalising by the whole batch train as one CPU does; 10 steps, test
# losses within 2e-3 (about 2e-4 apart here, where early training amplifies rounding to 5e-3 by
# step 20; without --sync-bn 1e-2 apart)
sync_bn_check() {
    one=$("$b/resnet" --data "$data" --devices cpu --max-steps 10 | sed -n 's/.*test_loss=\([0-9.]*\).*/\1/p')
    two=$("$b/resnet" --data "$data" --devices cpu:2 --sync-bn --max-steps 10 | sed -n 's/.*test_loss=\([0-9.]*\).*/\1/p')
    echo "test_loss: cpu $one, cpu:2 --sync-bn $two"
    [ -n "$one" ] && [ -n "$two" ] && awk -v a="$one" -v b="$two" 'BEGIN { d = a - b; exit !(d < 2e-3 && d > -2e-3) }'
}
run "$b/hello"
run "$b/custom_layer"
for spec in cpu:2 cpu:3 cpu:4; do run "$b/data_parallel" $spec; done
run "$b/model_parallel" cpu:2
run sh tests/readme_tour.sh
data=/usr/share/datasets/fashion-mnist
if [ -e "$data/train-images-idx3-ubyte.gz" ]; then
    run "$b/tour" "$data" "$b/tour.safetensors"
    # build/resnet: 40 steps of its BatchNorm ResNet on two CPU replicas, saved with its buffers
    if [ -x "$b/resnet" ]; then
        run sh -c "'$b/resnet' --data '$data' --devices cpu:2 --max-steps 40 --save '$b/resnet.safetensors' | grep -q 'test_acc=0\.[3-9]'"
        run sync_bn_check
    else
        skipped=$((skipped + 1)); echo "  skip resnet: $b/resnet is not built (make $b/resnet)"
    fi
    if [ -x "$b/gru" ]; then run gru_check
    else skipped=$((skipped + 1)); echo "  skip gru: $b/gru is not built (make $b/gru)"; fi
else
    skipped=$((skipped + 1)); echo "  skip tour: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
fi
if [ -x "$b/data_parallel_cuda" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    run "$b/data_parallel_cuda" cuda:0,0,0,0
else
    skipped=$((skipped + 1)); echo "  skip data_parallel on cuda:0,0,0,0: no GPU"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
