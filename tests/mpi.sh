#!/bin/sh
# A job of several processes (MGPU_MPI), run by mpirun --oversubscribe on this one machine:
# 1. build/test_mpi on 3 and on 2 ranks (rank 0 with two CPU replicas, the others one), and its
#    emulated-GPU build on 3 ranks (rank 0 on two emulated GPUs, the others on one) with NCCL
#    across processes (ncclCommInitRank in the emulator; NCCL groups of at most 4 calls, as the
#    build asks, MGPU_NCCL_GROUP_OPS) and through MPI (MGPU_ALLREDUCE=host):
#    each rank's summary is counted. With desc.sync_batch_norm, a rank failing inside a step ends
#    the job at once with its message (rank 0 waits inside its backward for rank 1's numbers).
#    build/gpt_mpi (a GPT with AdamW, clipping, Dropout and a tied head) on 2 processes with
#    --zero1 against build/gpt_cpu on cpu:2: the same losses and parameters, bit for bit.
# 2. build/train_mpi on Fashion-MNIST, 300 steps from seed 7, against build/train_cpu with all
#    the replicas in one process; final checkpoints (parameters and optimizer state) compared:
#      -np 2 --devices cpu      against cpu:2   the same bits
#      -np 4 --devices cpu      against cpu:4   the same bits
#      -np 2 --devices cpu:2    against cpu:4   the same bits (the job sums in its replica order)
#      -np 3 --devices cpu      against cpu:3   the same bits, and within 1e-4 of cpu (64 rows
#                                                split 22 + 21 + 21; 5.7e-5 at one hidden unit,
#                                                whose ReLU input lies within rounding of zero at
#                                                some step, the unit of tests/emu/train.sh)
#    A run saved on 4 ranks after 150 steps resumes on 1 process (cpu:4) and on 2 (cpu:2 each)
#    to the same bits as the 300 steps straight. -np 2 with 2 replicas x 2 stages each (Dropout
#    on) against cpu:8 with 2 stages: the same bits. On emulated GPUs (build/train_mpi_emu): -np 2
#    with "auto" (one emulated GPU each) against cuda:0,1 in one process, -np 2 with cuda:0,1
#    each against cuda:0,1,2,3, both summed by NCCL across the processes; and through MPI when
#    NCCL is not asked for (MGPU_ALLREDUCE=host) or fails to initialise: the same bits.
#    ZeRO-1 (--zero1) across the processes: -np 2 --devices cpu:2 against cpu:4, the pipeline's
#    2 x 2 x 2 against cpu:8 with 2 stages, and cuda:0,1
#    each on emulated GPUs against cuda:0,1,2,3: the same bits; saved on 4 sharded ranks after
#    150 steps, resumed by one unsharded process (cpu:4): the same bits.
# 3. failures: a rank given a bad data path, a rank killed mid-training, a rank out of (emulated)
#    GPU memory, a launch failing on a rank mid-step, and a rank whose NCCL communicator breaks (MGPU_EMU_NCCL_FAIL=async:1) end the
#    whole job within seconds, with the failing rank's message; a rank stopped (SIGSTOP) and a
#    rank whose NCCL all-reduce hangs (MGPU_EMU_NCCL_FAIL=hang:1) end it after MGPU_DIST_TIMEOUT.
# Usage: mpi.sh [BUILD_DIR] [DATA_DIR]. Skips without mpirun or the MPI builds (make mpi), and
# part 2 and 3 without Fashion-MNIST.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
passed=0; failed=0; skipped=0
if ! command -v mpirun >/dev/null 2>&1 || [ ! -x "$b/test_mpi" ] || [ ! -x "$b/train_mpi" ]; then
    echo "  skip processes (MPI): no mpirun or no $b/test_mpi (apt-get install openmpi-bin libopenmpi-dev; make mpi)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Open MPI refuses root unless asked; the CI machines and containers run as root
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
mpi="mpirun --oversubscribe --bind-to none"

# ---- 1. the suite, each rank's summary ----
lib=$(cd "$b/emu" 2>/dev/null && pwd)
emu_env="-x MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so -x MGPU_EMU_DEVICES=4 -x MGPU_TEST_MPI_CUDA=1 -x MGPU_TEST_REQUIRE_GPU=1 -x MGPU_EMU_NCCL_GROUP_OPS=4"
for run in "3 $b/test_mpi" "2 $b/test_mpi" "3 $emu_env $b/emu/test_mpi" "3 -x MGPU_ALLREDUCE=host $emu_env $b/emu/test_mpi"; do
    np=${run%% *}
    case "$run" in *emu/test_mpi) [ -x "$b/emu/test_mpi" ] || { skipped=$((skipped + 1)); echo "  skip emulated test_mpi: not built"; continue; };; esac
    echo "  test_mpi -np $run"
    out=$(TMPDIR=$tmp timeout 300 $mpi -np $run 2>&1); rc=$?
    printf '%s\n' "$out" | grep -E 'FAIL|^rank [0-9]+ test_mpi:'
    ranks=0
    for line in $(printf '%s\n' "$out" | sed -n 's/^rank [0-9]* test_mpi: \([0-9]*\) passed, \([0-9]*\) failed, \([0-9]*\) skipped$/\1:\2:\3/p'); do
        passed=$((passed + ${line%%:*})); rest=${line#*:}
        failed=$((failed + ${rest%%:*})); skipped=$((skipped + ${rest#*:}))
        ranks=$((ranks + 1))
    done
    if [ $ranks -ne $np ] || [ $rc -ne 0 ]; then
        failed=$((failed + 1)); echo "  FAIL test_mpi on $np ranks: $ranks summaries, exit $rc"; printf '%s\n' "$out" | tail -n 15
    fi
done
# SyncBatchNorm: rank 1's backward fails while rank 0 waits inside its own for rank 1's numbers;
# rank 1 ends the job at once with its message (the 60 s bound is far below MGPU_DIST_TIMEOUT's 300)
out=$(timeout 60 $mpi -np 2 -x MGPU_TEST_MPI_SYNC_FAIL=1 "$b/test_mpi" 2>&1); rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && printf '%s\n' "$out" | grep -q "mgpu: rank 1 of 2: mgpu_model_train_step failed with desc.sync_batch_norm.*rank 1's backward fails on purpose; ending the job"; then
    passed=$((passed + 1)); echo "  ok   SyncBatchNorm: a rank failing inside a step ends the job at once, with its message"
else
    failed=$((failed + 1)); echo "  FAIL SyncBatchNorm: a rank failing inside a step (exit $rc):"; printf '%s\n' "$out" | tail -n 8
fi

# a GPT (examples/gpt.c: AdamW, clipping, Dropout, the head tied to the embedding) on 2 processes
# with ZeRO-1 against one process on cpu:2: the same losses and the same bits
if [ -x "$b/gpt_mpi" ] && [ -x "$b/gpt_cpu" ] && [ -x "$b/emu/ckpt_diff" ]; then
    gargs="--text $(dirname "$0")/../README.md --layers 2 --width 32 --heads 4 --seq 16 --batch 8 --steps 30 --every 10 --lr 0.003 --clip 1.0 --sample 0 --dropout 0.1"
    g1=$(timeout 300 "$b/gpt_cpu" $gargs --devices cpu:2 --save "$tmp/gpt1.st" 2>&1 | tail -n 1)
    g2=$(timeout 300 $mpi -np 2 "$b/gpt_mpi" $gargs --devices cpu --zero1 --save "$tmp/gpt2.st" 2>&1 | tail -n 1)
    d=$("$b/emu/ckpt_diff" "$tmp/gpt1.st" "$tmp/gpt2.st" 0 2>&1)
    if [ $? -eq 0 ] && [ -n "$g1" ] && [ "${g1%seconds=*}" = "${g2%seconds=*}" ]; then
        passed=$((passed + 1)); echo "  ok   GPT on 2 processes with zero1 against cpu:2: $d; ${g1%seconds=*}"
    else
        failed=$((failed + 1)); echo "  FAIL GPT on 2 processes with zero1 against cpu:2: $d; '$g1' and '$g2'"
    fi
else
    skipped=$((skipped + 1)); echo "  skip the GPT across processes: no $b/gpt_mpi, $b/gpt_cpu or $b/emu/ckpt_diff"
fi

if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
    echo "  skip training across processes: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
    echo "$passed passed, $failed failed, $((skipped + 1)) skipped"
    [ $failed -eq 0 ]; exit $?
fi

# ---- 2. training: the same bits as one process ----
common="--data $data --quiet --seed 7"
# run NAME COMMAND...: train, keeping the checkpoint as NAME
run() {
    name=$1; shift
    if ! timeout 600 "$@" $common --save "$tmp/$name.st" > "$tmp/$name.txt" 2>&1; then
        failed=$((failed + 1)); echo "  FAIL $name: $*: $(tail -n 3 "$tmp/$name.txt")"; return 1
    fi
}
# check NAME REF TOL
check() {
    d=$("$b/emu/ckpt_diff" "$tmp/$1.st" "$tmp/$2.st" "$3" 2>&1); rc=$?
    if [ $rc -eq 0 ]; then passed=$((passed + 1)); echo "  ok   $1 against $2 (tolerance $3): $d"
    else failed=$((failed + 1)); echo "  FAIL $1 against $2 (tolerance $3): $d"; fi
}
steps="--max-steps 300"
run cpu1 "$b/train_cpu" --devices cpu $steps
run cpu2 "$b/train_cpu" --devices cpu:2 $steps
run cpu3 "$b/train_cpu" --devices cpu:3 $steps
run cpu4 "$b/train_cpu" --devices cpu:4 $steps
run np2 $mpi -np 2 "$b/train_mpi" --devices cpu $steps && check np2 cpu2 0
run np4 $mpi -np 4 "$b/train_mpi" --devices cpu $steps && check np4 cpu4 0
run np2x2 $mpi -np 2 "$b/train_mpi" --devices cpu:2 $steps && check np2x2 cpu4 0
run np3 $mpi -np 3 "$b/train_mpi" --devices cpu $steps && check np3 cpu3 0 && check np3 cpu1 1e-4
grep -q "processes=3 devices=cpu replicas=3 " "$tmp/np3.txt" &&
    { passed=$((passed + 1)); echo "  ok   the result line names the 3 processes"; } ||
    { failed=$((failed + 1)); echo "  FAIL the result line of -np 3: $(tail -n 1 "$tmp/np3.txt")"; }
# a pipeline in each process: 2 processes x 2 replicas x 2 stages, with Dropout, against cpu:8
run pipe-np2 $mpi -np 2 "$b/train_mpi" --devices cpu:4 --stages 2 --micro-batches 4 --dropout 0.2 $steps &&
    run pipe-cpu8 "$b/train_cpu" --devices cpu:8 --stages 2 --micro-batches 4 --dropout 0.2 $steps && check pipe-np2 pipe-cpu8 0 &&
    run zpipe-np2 $mpi -np 2 "$b/train_mpi" --devices cpu:4 --stages 2 --micro-batches 4 --dropout 0.2 --zero1 $steps &&
    check zpipe-np2 pipe-cpu8 0
# ZeRO-1 across the processes: the same bits; saved half way by 4 sharded ranks, resumed by one
# unsharded process
run znp2x2 $mpi -np 2 "$b/train_mpi" --devices cpu:2 --zero1 $steps && check znp2x2 cpu4 0
run zhalf4 $mpi -np 4 "$b/train_mpi" --devices cpu --zero1 --max-steps 150 &&
    run zresume1 "$b/train_cpu" --devices cpu:4 --load "$tmp/zhalf4.st" $steps && check zresume1 cpu4 0
# saved by 4 ranks half way, resumed by one process and by two
run half4 $mpi -np 4 "$b/train_mpi" --devices cpu --max-steps 150 &&
    cp "$tmp/half4.st" "$tmp/half4b.st" &&
    run resume1 "$b/train_cpu" --devices cpu:4 --load "$tmp/half4.st" $steps && check resume1 cpu4 0 &&
    run resume2 $mpi -np 2 "$b/train_mpi" --devices cpu:2 --load "$tmp/half4b.st" $steps && check resume2 cpu4 0
if [ -x "$b/train_mpi_emu" ] && [ -x "$b/train_emu" ]; then
    lib=$(cd "$b/emu" && pwd)
    emu="env MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so MGPU_TEST_REQUIRE_GPU=1 MGPU_VERIFY_EVERY=50"
    run emu2 $emu MGPU_EMU_DEVICES=2 "$b/train_emu" --devices cuda:0,1 $steps
    run emu-np2 $emu MGPU_EMU_DEVICES=2 $mpi -np 2 -x MGPU_EMU_DEVICES -x MGPU_NCCL_LIBRARY -x MGPU_TEST_REQUIRE_GPU -x MGPU_VERIFY_EVERY \
        "$b/train_mpi_emu" --devices auto $steps && check emu-np2 emu2 0
    grep -q "devices=cuda:0 replicas=2 .*allreduce=nccl" "$tmp/emu-np2.txt" &&
        { passed=$((passed + 1)); echo "  ok   auto gave rank 0 the first emulated GPU, and NCCL sums across the processes"; } ||
        { failed=$((failed + 1)); echo "  FAIL auto on rank 0, NCCL: $(tail -n 1 "$tmp/emu-np2.txt")"; }
    run emu-np2-mpi $emu MGPU_EMU_DEVICES=2 MGPU_ALLREDUCE=host $mpi -np 2 -x MGPU_EMU_DEVICES -x MGPU_NCCL_LIBRARY -x MGPU_TEST_REQUIRE_GPU \
        -x MGPU_VERIFY_EVERY -x MGPU_ALLREDUCE "$b/train_mpi_emu" --devices auto $steps && check emu-np2-mpi emu2 0
    run emu-np2-noinit $emu MGPU_EMU_DEVICES=2 MGPU_EMU_NCCL_FAIL=init $mpi -np 2 -x MGPU_EMU_DEVICES -x MGPU_NCCL_LIBRARY \
        -x MGPU_TEST_REQUIRE_GPU -x MGPU_VERIFY_EVERY -x MGPU_EMU_NCCL_FAIL "$b/train_mpi_emu" --devices auto $steps &&
        check emu-np2-noinit emu2 0 && grep -q "allreduce=mpi" "$tmp/emu-np2-noinit.txt" && grep -q "initialisation failed" "$tmp/emu-np2-noinit.txt" &&
        { passed=$((passed + 1)); echo "  ok   NCCL failing to initialise: the job sums through MPI, with a notice"; } ||
        { failed=$((failed + 1)); echo "  FAIL NCCL failing to initialise: $(tail -n 2 "$tmp/emu-np2-noinit.txt")"; }
    run emu4 $emu MGPU_EMU_DEVICES=4 "$b/train_emu" --devices cuda:0,1,2,3 $steps
    run emu-np2x2 $emu MGPU_EMU_DEVICES=2 $mpi -np 2 -x MGPU_EMU_DEVICES -x MGPU_NCCL_LIBRARY -x MGPU_TEST_REQUIRE_GPU -x MGPU_VERIFY_EVERY \
        "$b/train_mpi_emu" --devices cuda:0,1 $steps && check emu-np2x2 emu4 0
    # ZeRO-1 over the 4 emulated GPUs of 2 processes: NCCL's broadcasts gather the shards
    run emu-z-np2x2 $emu MGPU_EMU_DEVICES=2 $mpi -np 2 -x MGPU_EMU_DEVICES -x MGPU_NCCL_LIBRARY -x MGPU_TEST_REQUIRE_GPU -x MGPU_VERIFY_EVERY \
        "$b/train_mpi_emu" --devices cuda:0,1 --zero1 $steps && check emu-z-np2x2 emu4 0
else
    skipped=$((skipped + 1)); echo "  skip emulated GPUs across processes: no $b/train_mpi_emu"
fi

# the course's pair: examples/ddp.c on 4 processes prints data_parallel.c's losses on cpu:4
if [ -x "$b/ddp_mpi" ] && [ -x "$b/data_parallel" ]; then
    timeout 300 $mpi -np 4 "$b/ddp_mpi" > "$tmp/ddp.txt" 2>&1; rc=$?
    "$b/data_parallel" cpu:4 > "$tmp/dp.txt" 2>&1
    if [ $rc -eq 0 ] && [ "$(grep -c '^step' "$tmp/ddp.txt")" -gt 0 ] && [ "$(grep '^step' "$tmp/ddp.txt")" = "$(grep '^step' "$tmp/dp.txt")" ] &&
       grep -q "all-reduce across processes: mpi" "$tmp/ddp.txt"; then
        passed=$((passed + 1)); echo "  ok   ddp_mpi -np 4 prints data_parallel cpu:4's losses: $(grep '^step 199' "$tmp/ddp.txt")"
    else
        failed=$((failed + 1)); echo "  FAIL ddp_mpi -np 4 (exit $rc) against data_parallel cpu:4:"; diff "$tmp/ddp.txt" "$tmp/dp.txt" | head -n 10
    fi
fi

# ---- 3. failures end the job ----
# a bad data path on rank 1 only
start=$(date +%s)
timeout 60 $mpi -np 2 sh -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" = 1 ]; then d=/nonexistent; else d="$0"; fi;
    exec "$1" --data "$d" --quiet --seed 7 --devices cpu --epochs 50' "$data" "$b/train_mpi" > "$tmp/bad.txt" 2>&1; rc=$?
took=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -le 30 ] && grep -q "Fashion-MNIST not found" "$tmp/bad.txt"; then
    passed=$((passed + 1)); echo "  ok   a bad data path on rank 1 ends the job in ${took} s (exit $rc) with its message"
else
    failed=$((failed + 1)); echo "  FAIL a bad data path on rank 1: exit $rc after ${took} s: $(tail -n 5 "$tmp/bad.txt")"
fi
# a rank killed, and a rank stopped, mid-training: pgrep finds the ranks among mpirun's children
if ! command -v pgrep >/dev/null 2>&1 || ! command -v pkill >/dev/null 2>&1; then
    skipped=$((skipped + 2)); echo "  skip a rank killed and a rank stopped mid-training: no pgrep or pkill to find the ranks (apt-get install procps)"
else
    # rank 1 killed while the job trains
    $mpi -np 2 "$b/train_mpi" --data "$data" --quiet --seed 7 --devices cpu --epochs 50 > "$tmp/kill.txt" 2>&1 &
    job=$!
    victim=
    for i in $(seq 1 100); do   # until both ranks train (rank 1's process: the younger child of mpirun)
        sleep 0.1
        victim=$(pgrep -P $job -n -f train_mpi)
        [ -n "$victim" ] && [ "$(pgrep -P $job -f train_mpi | wc -l)" -ge 2 ] && break
    done
    sleep 1
    start=$(date +%s)
    [ -n "$victim" ] && kill -9 "$victim"
    ( sleep 60; kill -9 $job ) >/dev/null 2>&1 & watchdog=$!   # (its sleep holds no pipe of ours)
    wait $job; rc=$?
    kill $watchdog $(pgrep -P $watchdog) 2>/dev/null
    took=$(( $(date +%s) - start ))
    if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $took -le 30 ] && grep -q -i "signal 9\|killed" "$tmp/kill.txt"; then
        passed=$((passed + 1)); echo "  ok   rank 1 killed mid-training: the job ends in ${took} s (exit $rc), mpirun names the signal"
    else
        failed=$((failed + 1)); echo "  FAIL rank 1 killed (pid ${victim:-none}): exit $rc after ${took} s: $(tail -n 5 "$tmp/kill.txt")"
    fi
    pkill -9 -f "$b/train_mpi --data" 2>/dev/null
    # rank 1 stopped (SIGSTOP) mid-training, as by a frozen host: it breaks no connection, so only
    # the other ranks' timeout (MGPU_DIST_TIMEOUT=5 here) ends the job, naming the rank and the step
    MGPU_DIST_TIMEOUT=5 $mpi -np 3 -x MGPU_DIST_TIMEOUT "$b/train_mpi" --data "$data" --quiet --seed 7 --devices cpu --epochs 50 \
        > "$tmp/stop.txt" 2>&1 &
    job=$!
    victim=
    for i in $(seq 1 100); do   # rank 1: the second child of mpirun
        sleep 0.1
        [ "$(pgrep -P $job -f train_mpi | wc -l)" -ge 3 ] && victim=$(pgrep -P $job -f train_mpi | sort -n | sed -n 2p) && break
    done
    sleep 1
    start=$(date +%s)
    [ -n "$victim" ] && kill -STOP "$victim"
    ( sleep 90; kill -9 $job ) >/dev/null 2>&1 & watchdog=$!   # (its sleep holds no pipe of ours)
    wait $job; rc=$?
    kill $watchdog $(pgrep -P $watchdog) 2>/dev/null
    took=$(( $(date +%s) - start ))
    # (on a loaded machine rank 1 may be stopped before its first step, while the model is made:
    # then the vote of mgpu_model_create is the collective named, which is as right)
    n=$(grep -c "mgpu: rank [02] of 3 (.*): .*: no answer from rank 1 (.*) after [0-9]* s (MGPU_DIST_TIMEOUT=5)" "$tmp/stop.txt")
    if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $took -le 35 ] && [ "$n" -ge 1 ] && ! pgrep -f "$b/train_mpi --data" >/dev/null; then
        passed=$((passed + 1)); echo "  ok   rank 1 stopped (SIGSTOP): the job ends in ${took} s (exit $rc): $(grep -m 1 'no answer' "$tmp/stop.txt")"
    else
        failed=$((failed + 1)); echo "  FAIL rank 1 stopped (pid ${victim:-none}): exit $rc after ${took} s, $n ranks named it: $(tail -n 5 "$tmp/stop.txt")"
    fi
    pkill -9 -f "$b/train_mpi --data" 2>/dev/null
fi
# rank 1's emulated GPU out of memory from its 10th cudaMalloc on (in its first step): both ranks stop, with its message
if [ -x "$b/train_mpi_emu" ]; then
    timeout 120 $mpi -np 2 -x MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so -x MGPU_EMU_DEVICES=2 sh -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" = 1 ]; then
        export MGPU_EMU_FAIL_MALLOC=10 MGPU_EMU_FAIL_MALLOC_COUNT=100000; fi; exec "$1" --data "$0" --quiet --seed 7 --max-steps 50' \
        "$data" "$b/train_mpi_emu" > "$tmp/oom.txt" 2>&1; rc=$?
    n=$(grep -c "train: rank 1 of 2: .*out of memory on cuda:1" "$tmp/oom.txt")
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -eq 2 ]; then
        passed=$((passed + 1)); echo "  ok   rank 1 out of GPU memory: both ranks stop with its message"
    else
        failed=$((failed + 1)); echo "  FAIL rank 1 out of GPU memory: exit $rc, $n ranks said so: $(tail -n 4 "$tmp/oom.txt")"
    fi
fi
# a launch failing on rank 1 in a step whose bucket sums overlap backward through NCCL: rank 1
# still issues its all-reduces, so rank 0 does not wait for them (the emulator would report a
# stream that never finishes, after MGPU_EMU_TIMEOUT seconds)
if [ -x "$b/train_mpi_emu" ]; then
    start=$(date +%s)
    timeout 120 $mpi -np 2 -x MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so -x MGPU_EMU_DEVICES=2 -x MGPU_EMU_TIMEOUT=30 sh -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" = 1 ]; then
        export MGPU_EMU_FAIL_LAUNCH=100; fi; exec "$1" --data "$0" --quiet --seed 7 --max-steps 50' "$data" "$b/train_mpi_emu" > "$tmp/launch.txt" 2>&1; rc=$?
    took=$(( $(date +%s) - start ))
    n=$(grep -c "train: rank 1 of 2: .*cudaErrorLaunchOutOfResources" "$tmp/launch.txt")
    if [ $rc -ne 124 ] && [ "$n" -eq 2 ] && [ $took -lt 25 ] && ! grep -q "still busy" "$tmp/launch.txt"; then
        passed=$((passed + 1)); echo "  ok   a launch failing on rank 1 mid-step (NCCL overlapping backward): both ranks stop in ${took} s"
    else
        failed=$((failed + 1)); echo "  FAIL a launch failing on rank 1 mid-step: exit $rc after ${took} s, $n ranks said so: $(grep -v '^ *$' "$tmp/launch.txt" | head -n 4)"
    fi
fi
# rank 1's NCCL communicator broken (as by a peer gone): every rank stops at the next step
if [ -x "$b/train_mpi_emu" ]; then
    start=$(date +%s)
    timeout 120 $mpi -np 2 -x MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so -x MGPU_EMU_DEVICES=2 -x MGPU_EMU_NCCL_FAIL=async:1 \
        "$b/train_mpi_emu" --data "$data" --quiet --seed 7 --max-steps 300 > "$tmp/async.txt" 2>&1; rc=$?
    took=$(( $(date +%s) - start ))
    n=$(grep -c "train: rank 1 of 2: .*ncclCommGetAsyncError.*ncclRemoteError" "$tmp/async.txt")
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -eq 2 ]; then
        passed=$((passed + 1)); echo "  ok   a broken NCCL communicator on rank 1 ends both ranks with its message in ${took} s"
    else
        failed=$((failed + 1)); echo "  FAIL a broken NCCL communicator on rank 1: exit $rc, $n ranks said so: $(tail -n 4 "$tmp/async.txt")"
    fi
fi
# rank 1's NCCL all-reduce hangs (its GPU stuck in NCCL's kernel, as when a peer is gone): the
# host's timed wait for the GPUs ends both ranks after MGPU_DIST_TIMEOUT=5, their communicators
# aborted (the emulator's all-reduces end only by ncclCommAbort; its own timeout is put at 120 s)
if [ -x "$b/train_mpi_emu" ]; then
    start=$(date +%s)
    timeout 120 $mpi -np 2 -x MGPU_NCCL_LIBRARY=$lib/libnccl_emu.so -x MGPU_EMU_DEVICES=2 -x MGPU_EMU_NCCL_FAIL=hang:1 \
        -x MGPU_EMU_TIMEOUT=120 -x MGPU_DIST_TIMEOUT=5 "$b/train_mpi_emu" --data "$data" --quiet --seed 7 --max-steps 300 > "$tmp/hang.txt" 2>&1; rc=$?
    took=$(( $(date +%s) - start ))
    n=$(grep -c "mgpu: rank [01] of 2 (.*): the NCCL all-reduce across processes of step 1 (mgpu_model_train_step): no answer .*ncclCommAbort.* after [0-9]* s (MGPU_DIST_TIMEOUT=5)" "$tmp/hang.txt")
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -ge 1 ] && [ $took -le 35 ]; then
        passed=$((passed + 1)); echo "  ok   a hung NCCL all-reduce on rank 1 ends the job in ${took} s, $n ranks saying so"
    else
        failed=$((failed + 1)); echo "  FAIL a hung NCCL all-reduce on rank 1: exit $rc after ${took} s, $n ranks said so: $(grep -v '^ *$' "$tmp/hang.txt" | head -n 4)"
    fi
fi

echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
