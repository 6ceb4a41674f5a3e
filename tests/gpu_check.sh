#!/bin/sh
# make gpu-check: everything that needs a GPU, on a machine that has one. Run by the Makefile
# after it built the CUDA variant for this GPU into BUILD (build/gpu). Prints a results table.
#   1. the CUDA test suites (every CUDA op against the CPU reference; a skip counts as a failure)
#   2. the examples on the GPU: four replicas of one GPU; build/train on cuda:0 and cuda:0,0;
#      build/gpt (TEXT, a text file) and build/resnet on cuda:0 and cuda:0,0
#   3. the benchmarks beside PyTorch (bench/results/)
#   4. the suites again under compute-sanitizer (quick sizes): memcheck, racecheck (shared-memory
#      hazards: a missing __syncthreads or __syncwarp) and synccheck (barriers misused)
# STEP_TIMEOUT (seconds, default 900) bounds each step (the suites together, each example, the
# benchmarks together, each sanitizer run), so a hang shows as a failed row.
b=${1:-build/gpu}
to="timeout ${STEP_TIMEOUT:-900}"
data=${DATA:-/usr/share/datasets/fashion-mnist}
log=$b/gpu-check.log
: > "$log"
rows=""
add() { rows="$rows$(printf '| %s | %s |' "$1" "$2")
"; }
last() { tail -n 1 "$1" 2>/dev/null; }
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | tee -a "$log"
echo "== 1. CUDA test suites" | tee -a "$log"
MGPU_TEST_REQUIRE_GPU=1 $to sh tests/run_all.sh $b/test_core_cuda $b/test_io_cuda $b/test_model_cuda $b/test_parallel_cuda $b/test_seq_cuda $b/test_autograd_cuda \
    > $b/suites.txt 2>&1 || status=1
cat $b/suites.txt >> "$log"
grep -E "^(test_core|test_io|test_model|test_parallel|test_seq|test_autograd): " $b/suites.txt | while read -r line; do echo "   $line"; done
add "CUDA test suites" "$(last $b/suites.txt)"
grep -E "rel(ative)? error|relerr|max \|" $b/suites.txt | head -n 40 > $b/errors.txt

echo "== 2. examples on the GPU" | tee -a "$log"
if $to $b/data_parallel_cuda cuda:0,0,0,0 > $b/dp.txt 2>&1; then add "data_parallel cuda:0,0,0,0" "ok: $(tail -n 1 $b/dp.txt)"
else add "data_parallel cuda:0,0,0,0" "FAILED: $(tail -n 1 $b/dp.txt)"; status=1; fi
cat $b/dp.txt >> "$log"
for run in "mlp cuda:0" "cnn cuda:0" "mlp cuda:0,0" "cnn cuda:0,0,0,0"; do
    set -- $run
    out=$($to $b/train_cuda --data "$data" --quiet --model $1 --devices $2 2>>"$log" | tail -n 1)
    echo "   $out" | tee -a "$log"
    add "train --model $1 --devices $2" "${out:-FAILED}"
    [ -n "$out" ] || status=1
done

# the sequence models: build/gpt on the byte-level text, build/resnet (BatchNorm) one epoch
text=${TEXT:-/usr/share/games/fortunes/fortunes}
if [ -r "$text" ]; then
    for d in cuda:0 cuda:0,0; do
        out=$($to $b/gpt_cuda --text "$text" --steps 60 --every 60 --sample 0 --devices $d 2>>"$log" | tail -n 1)
        echo "   $out" | tee -a "$log"
        add "gpt --text --steps 60 --devices $d" "${out:-FAILED}"
        [ -n "$out" ] || status=1
    done
else add "gpt --text" "skipped: no $text (TEXT=FILE)"; fi
for d in cuda:0 cuda:0,0; do
    out=$($to $b/resnet_cuda --data "$data" --epochs 1 --devices $d 2>>"$log" | tail -n 1)
    echo "   $out" | tee -a "$log"
    add "resnet --epochs 1 --devices $d" "${out:-FAILED}"
    [ -n "$out" ] || status=1
done

echo "== 3. benchmarks" | tee -a "$log"
$to sh bench/run.sh $b/bench_cuda >> "$log" 2>&1 && add "benchmarks" "$(ls -t bench/results/*.md | head -n 1)" || add "benchmarks" "FAILED"

echo "== 4. compute-sanitizer: memcheck, racecheck, synccheck" | tee -a "$log"
if command -v compute-sanitizer >/dev/null 2>&1; then
    # racecheck on test_parallel_cuda last, under RACE_TIMEOUT (default 120 s): on the H200 it did
    # not get past the pipelines in 100 s or 290 s (2026-11-27; a hang or slowness, not established)
    for run in memcheck:test_core_cuda memcheck:test_model_cuda memcheck:test_seq_cuda memcheck:test_autograd_cuda memcheck:test_parallel_cuda \
               racecheck:test_core_cuda racecheck:test_model_cuda racecheck:test_seq_cuda \
               synccheck:test_core_cuda synccheck:test_model_cuda synccheck:test_seq_cuda synccheck:test_parallel_cuda \
               racecheck:test_parallel_cuda; do
        tool=${run%%:*} t=${run#*:}
        limit=$to
        [ "$run" = racecheck:test_parallel_cuda ] && limit="timeout ${RACE_TIMEOUT:-120}"
        # --report-api-errors no: the suites provoke failing CUDA calls on purpose (an allocation
        # larger than the GPU, to test the out-of-memory path) and check every status themselves
        MGPU_TEST_REQUIRE_GPU=1 MGPU_TEST_QUICK=1 $limit compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 99 $b/$t > $b/san_${tool}_$t.txt 2>&1
        rc=$?
        cat $b/san_${tool}_$t.txt >> "$log"
        add "$tool $t" "exit $rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $b/san_${tool}_$t.txt | tail -n 1) $(last $b/san_${tool}_$t.txt)"
        [ $rc -eq 0 ] || status=1
    done
else
    add "compute-sanitizer" "not installed"; status=1
fi

echo
echo "| gpu-check ($(date +%Y-%m-%d), ${MGPU_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}) | result |"
echo "| --- | --- |"
printf '%s' "$rows"
echo
echo "full log: $log"
exit $status
