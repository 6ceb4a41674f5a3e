#!/bin/sh
# ThreadSanitizer: build/test_parallel_tsan (the data-parallel suite: CPU replicas on threads,
# the thread pool, the host all-reduce) and a short cpu:3 training with build/train_tsan, both
# built by clang -fsanitize=thread (make tsan). Any report fails the run. Last line:
# "N passed, N failed, N skipped".   sh tests/tsan.sh B [DATA]
B=${1:-build}
DATA=${2:-/usr/share/datasets/fashion-mnist}
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
passed=0; failed=0; skipped=0

# Runs "$@" under TSan; on kernels whose address-space randomisation TSan cannot live with
# ("unexpected memory mapping", e.g. vm.mmap_rnd_bits above 28), again without it (setarch -R).
tsan_run() {
    out=$("$@" 2>&1); rc=$?
    if printf '%s\n' "$out" | grep -q 'ThreadSanitizer: unexpected memory mapping\|FATAL: ThreadSanitizer' &&
       command -v setarch >/dev/null; then
        echo "   (TSan cannot map its shadow memory with ASLR on this kernel: running under setarch -R)"
        out=$(setarch "$(uname -m)" -R "$@" 2>&1); rc=$?
    fi
}

if [ ! -x "$B/test_parallel_tsan" ] || [ ! -x "$B/train_tsan" ]; then
    echo "skip tsan: $B/test_parallel_tsan and $B/train_tsan are not built (make tsan needs clang with its TSan runtime: apt-get install clang libclang-rt-dev)"
    echo "0 passed, 0 failed, 2 skipped"
    exit 0
fi

echo "== $B/test_parallel_tsan"
tsan_run "$B/test_parallel_tsan"
printf '%s\n' "$out" | grep -v -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' | grep -v '^ok ' | tail -n 60
if [ $rc -eq 0 ] && ! printf '%s\n' "$out" | grep -q 'WARNING: ThreadSanitizer'; then
    passed=$((passed + 1)); echo "   no ThreadSanitizer reports"
else
    failed=$((failed + 1)); echo "   test_parallel under TSan FAILED (exit $rc)"
fi

echo "== $B/train_tsan --devices cpu:3 --max-steps 20"
if [ ! -e "$DATA/train-images-idx3-ubyte.gz" ] && [ ! -e "$DATA/train-images-idx3-ubyte" ]; then
    echo "skip train under TSan: no Fashion-MNIST in $DATA (apt-get install dataset-fashion-mnist)"
    skipped=$((skipped + 1))
else
    ckpt=$(mktemp /tmp/mgpu-tsan-XXXXXX)
    tsan_run "$B/train_tsan" --data "$DATA" --devices cpu:3 --max-steps 20 --quiet --save "$ckpt"
    printf '%s\n' "$out" | tail -n 60
    rm -f "$ckpt"
    if [ $rc -eq 0 ] && ! printf '%s\n' "$out" | grep -q 'WARNING: ThreadSanitizer'; then
        passed=$((passed + 1)); echo "   no ThreadSanitizer reports"
    else
        failed=$((failed + 1)); echo "   train --devices cpu:3 under TSan FAILED (exit $rc)"
    fi
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
