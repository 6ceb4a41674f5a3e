#!/bin/sh
# A job across hosts over TCP, on this one machine: three hosts made of network namespaces (h1,
# h2, h3 at 10.77.0.1-3, each with its own veth on a bridge, its own hostname and /etc/hosts),
# launched by mpirun (through nsenter in place of ssh) and by Slurm (munged, slurmctld and
# one slurmd per host, all started here). Ranks on different hosts talk only over those addresses
# (Open MPI's tcp transport restricted to 10.77.0.0/24; shared memory only inside a host).
#   1. mpirun -np 4 over h1, h2 gives the bits of cpu:4 in one process (and the bytes crossed h2's
#      link); a pipeline in each of 2 processes on 2 hosts gives the bits of cpu:8 --stages 2; a
#      slow link that loses packets (tc netem; or tc tbf and nftables) slows the job and changes
#      no bit.
#   2. faults, with MGPU_DIST_TIMEOUT=10: h2's link taken down mid-training, and every process of
#      h2 killed: every rank ends within the timeout + 30 s, the job non-zero with a message naming
#      what happened; the checkpoint saved before holds the bits of an uninterrupted run to its
#      step, and a restart on the hosts left with another process count ends where an
#      uninterrupted cpu:4 run does.
#   3. Slurm: srun -N 2 -n 4 --mpi=pmix build/train_mpi gives the bits of cpu:4; the ranks see
#      SLURM_PROCID and SLURM_LOCALID as docs/mpi.md's table says.
# At its end nothing it made is left: processes, namespaces (with their veths), Slurm and munge
# state. It reports its own time.
# Usage: cluster.sh [BUILD_DIR] [DATA_DIR]. Needs root, iproute2 (ip, tc), unshare, mpirun and
# make mpi's build/train_mpi; Slurm's part needs slurm-wlm and munge. Skips, saying why, without.
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
passed=0; failed=0; skipped=0
began=$(date +%s)
skip_all() { echo "  skip the cluster: $*"; echo "0 passed, 0 failed, 1 skipped"; exit 0; }
[ "$(id -u)" -eq 0 ] || skip_all "network namespaces need root"
for tool in ip tc unshare nsenter mpirun; do command -v $tool >/dev/null 2>&1 || skip_all "no $tool (apt-get install iproute2 util-linux openmpi-bin)"; done
for bin in train_mpi train_cpu emu/ckpt_diff; do [ -x "$b/$bin" ] || skip_all "no $b/$bin (make mpi; make test-emu)"; done
[ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ] ||
    skip_all "no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
b=$(cd "$b" && pwd)
p=mgpuc$$   # this run's namespaces: $p-h1 .. $p-h3, and $p-sw holding the bridge
tmp=$(mktemp -d)
hosts="h1 h2 h3"

# ---- the hosts ----
teardown() {
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$p-"); do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    done
    for f in "$tmp"/*.pid; do [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
    sleep 0.5
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$p-"); do ip netns delete "$ns"; done
    rm -rf "$tmp"
}
trap 'teardown' EXIT
trap 'exit 1' INT TERM
made=$(
    set -e
    ip netns add $p-sw
    ip -n $p-sw link add br0 type bridge
    ip -n $p-sw link set br0 up
    i=0
    for h in $hosts; do
        i=$((i + 1))
        ip netns add $p-$h
        ip link add eth0 netns $p-$h type veth peer name port-$h netns $p-sw
        ip -n $p-sw link set port-$h master br0
        ip -n $p-sw link set port-$h up
        ip -n $p-$h addr add 10.77.0.$i/24 dev eth0
        ip -n $p-$h link set eth0 up
        ip -n $p-$h link set lo up
        # a lost peer noticed in seconds, not 15 minutes: Linux's retransmissions (per namespace)
        ip netns exec $p-$h sysctl -q -w net.ipv4.tcp_retries2=5
    done
    printf '127.0.0.1 localhost\n10.77.0.1 h1\n10.77.0.2 h2\n10.77.0.3 h3\n' > "$tmp/hosts"
    echo ok
) 2>&1
[ "$(printf '%s' "$made" | tail -n 1)" = ok ] || skip_all "cannot make network namespaces here: $made"

# on HOST COMMAND...: COMMAND on HOST: its network namespace, its hostname, and its /etc/hosts
# (in a mount namespace of its own); the file system is the machine's (Open MPI names its files
# in /tmp by host; Slurm's are put apart by TmpFS below); /sys too, where slurmd finds cgroups
cat > "$tmp/on" <<EOF
#!/bin/sh
h=\$1; shift
exec nsenter --net=/run/netns/$p-\$h unshare --uts --mount sh -c 'mount --bind "$tmp/hosts" /etc/hosts &&
    hostname "\$0" && exec "\$@"' "\$h" "\$@"
EOF
# Open MPI's rsh agent, in place of ssh: "agent [options] HOST COMMAND" (the command as one line)
cat > "$tmp/agent" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
h=\$1; shift
exec "$tmp/on" "\$h" sh -c "\$*"
EOF
chmod +x "$tmp/on" "$tmp/agent"
on="$tmp/on"
# Open MPI refuses root unless asked; the CI machines and containers run as root
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# mpirun on h1; its daemons on the other hosts by the agent; TCP between hosts, on the bridge
# only. The launcher's daemons notice a lost peer by TCP keepalives: 20 s + 3 x 2 s here (Open
# MPI's default is 300 s + 9 x 20 s), longer than the ranks' timeout (MGPU_DIST_TIMEOUT=10 in
# the faults), so that the ranks end by their own timeout, and the daemons after them.
# (Open MPI's session files in this run's folder: a killed job's are removed with it)
mkdir -p "$tmp/ompi"
mpirun="$on h1 mpirun --mca orte_tmpdir_base $tmp/ompi --mca plm_rsh_agent $tmp/agent --mca btl self,vader,tcp --mca btl_tcp_if_include 10.77.0.0/24
    --mca oob_tcp_if_include 10.77.0.0/24 --mca oob_tcp_keepalive_time 20 --mca oob_tcp_keepalive_intvl 2
    --mca oob_tcp_keepalive_probes 3 --bind-to none --oversubscribe"
common="--data $data --quiet --seed 7 --schedule constant"

ok() { passed=$((passed + 1)); echo "  ok   $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL $*"; }
# run NAME COMMAND...: train, keeping the checkpoint as NAME
run() {
    name=$1; shift
    if ! timeout 600 "$@" $common --save "$tmp/$name.st" > "$tmp/$name.txt" 2>&1; then
        fail "$name: $*: $(tail -n 3 "$tmp/$name.txt")"; return 1
    fi
}
# check NAME REF: the same bits
check() {
    d=$("$b/emu/ckpt_diff" "$tmp/$1.st" "$tmp/$2.st" 0 2>&1) && ok "$1 against $2: $d" || fail "$1 against $2: $d"
}
link_bytes() { ip -n $p-$1 -s link show eth0 | awk 'NR == 4 { print $1 }'; }   # received by HOST
seconds() { echo $(( $(date +%s) - $1 )); }

# ---- 1. the same bits across hosts ----
steps="--max-steps 300"
run cpu4 "$b/train_cpu" --devices cpu:4 $steps
before=$(link_bytes h2)
start=$(date +%s)
run np4 $mpirun --host h1:2,h2:2 -np 4 "$b/train_mpi" --devices cpu $steps && check np4 cpu4
took_np4=$(seconds $start)
crossed=$(( $(link_bytes h2) - before ))
# 300 steps of 101,770 gradients: h2's two ranks receive at least their slices and the others' sums
[ $crossed -gt $((300 * 101770 * 4)) ] && ok "h2's link received $crossed bytes in ${took_np4} s" ||
    fail "h2's link received only $crossed bytes: the ranks did not talk over the network"
grep -q "processes=4 devices=cpu replicas=4 " "$tmp/np4.txt" && ok "the result line names the 4 processes" ||
    fail "the result line of np4: $(tail -n 1 "$tmp/np4.txt")"
run pipe8 "$b/train_cpu" --devices cpu:8 --stages 2 --micro-batches 4 --dropout 0.2 $steps &&
    run pipe-np2 $mpirun --host h1:1,h2:1 -np 2 "$b/train_mpi" --devices cpu:4 --stages 2 --micro-batches 4 --dropout 0.2 $steps &&
    check pipe-np2 pipe8
# A slow, lossy link between h1 and h2: delay and loss by tc netem where the kernel has it; else
# (this machine's kernel has no sch_netem) a rate of 200 Mbit/s each way (tc tbf: packets wait
# in its queue, up to 20 ms) and 0.5% of the TCP packets dropped (nftables, numgen random).
shaped=""
for h in h1 h2; do
    if ip netns exec $p-$h tc qdisc add dev eth0 root netem delay 2ms 1ms loss 0.5% 2>/dev/null; then
        shaped="tc netem: 2 +- 1 ms of delay, 0.5% loss"
    elif command -v nft >/dev/null 2>&1 && ip netns exec $p-$h tc qdisc add dev eth0 root tbf rate 200mbit burst 64kb latency 20ms &&
         ip netns exec $p-$h nft add table inet $p &&
         ip netns exec $p-$h nft add chain inet $p out '{ type filter hook output priority 0; }' &&
         ip netns exec $p-$h nft add rule inet $p out meta l4proto tcp numgen random mod 1000 '<' 5 counter drop; then
        shaped="tc tbf at 200 Mbit/s and 0.5% of TCP packets dropped by nftables"
    else shaped=""; break; fi
done
if [ -n "$shaped" ]; then
    run cpu4-100 "$b/train_cpu" --devices cpu:4 --max-steps 100
    start=$(date +%s)
    run shaped $mpirun --host h1:2,h2:2 -np 4 "$b/train_mpi" --devices cpu --max-steps 100 && check shaped cpu4-100 &&
        echo "       ($shaped each way: 100 steps took $(seconds $start) s, 300 unshaped ${took_np4} s;" \
             "$(ip netns exec $p-h2 nft list ruleset 2>/dev/null | sed -n 's/.*counter packets \([0-9]*\).*/\1/p') packets dropped by h2)"
    for h in h1 h2; do ip netns exec $p-$h tc qdisc del dev eth0 root; ip netns exec $p-$h nft delete table inet $p 2>/dev/null; done
else
    skipped=$((skipped + 1)); echo "  skip a slow, lossy link: neither tc netem nor tc tbf with nftables (apt-get install nftables)"
fi

# ---- 2. faults: a step that cannot finish, ends ----
# ranks of this run still alive (in any of its hosts)
ranks_alive() {
    for h in $hosts; do for pid in $(ip netns pids $p-$h); do
        [ "$(cat /proc/$pid/comm 2>/dev/null)" = train_mpi ] && echo $pid
    done; done
}
# the step a checkpoint holds (its metadata "mgpu.step")
ckpt_step() { head -c 4096 "$1" | tr ',' '\n' | sed -n 's/.*"mgpu.step" *: *"\([0-9]*\)".*/\1/p'; }
# fault NAME WHAT HOW: a job over h1 and h2 until its first checkpoint, then HOW (a command);
# every rank ends within the timeout + 30 s, mpirun non-zero, saying WHAT
fault() {
    f_name=$1; what=$2; how=$3
    MGPU_DIST_TIMEOUT=10 $mpirun -x MGPU_DIST_TIMEOUT --host h1:2,h2:2 -np 4 "$b/train_mpi" --devices cpu --epochs 50 $common \
        --save "$tmp/$f_name.st" > "$tmp/$f_name.txt" 2>&1 &
    job=$!
    for i in $(seq 1 1200); do [ -e "$tmp/$f_name.st" ] && break; sleep 0.1; done
    sleep 1
    start=$(date +%s)
    sh -c "$how"
    for i in $(seq 1 80); do [ -z "$(ranks_alive)" ] && break; sleep 0.5; done
    ended=$(seconds $start); left=$(ranks_alive | wc -l)
    ( sleep 90; kill -9 $job ) >/dev/null 2>&1 & watchdog=$!   # (its sleep holds no pipe of ours)
    wait $job; rc=$?
    kill $watchdog $(pgrep -P $watchdog) 2>/dev/null
    returned=$(seconds $start)
    if [ "$left" -eq 0 ] && [ "$ended" -le 40 ] && [ $rc -ne 0 ] && [ $rc -ne 137 ] && grep -q "$what" "$tmp/$f_name.txt"; then
        ok "$f_name: every rank ended in ${ended} s, mpirun returned $rc in ${returned} s: $(grep -m 1 "$what" "$tmp/$f_name.txt")"
    else
        fail "$f_name: $left ranks left after ${ended} s, mpirun $rc after ${returned} s: $(grep -v '^ *$' "$tmp/$f_name.txt" | tail -n 6)"
    fi
}
# reference NAME STEPS: an uninterrupted cpu:4 run to STEPS
reference() { [ -e "$tmp/$1.st" ] || run "$1" "$b/train_cpu" --devices cpu:4 --max-steps "$2"; }
# resumed NAME CHECKPOINT COMMAND...: the checkpoint holds an uninterrupted run's bits to its step,
# and COMMAND, resuming from it to 100 steps more, ends on the uninterrupted run's bits
resumed() {
    r_name=$1; r_ckpt=$2; shift 2
    at=$(ckpt_step "$tmp/$r_ckpt.st")
    [ -n "$at" ] || { fail "$r_ckpt: no mgpu.step in its checkpoint"; return; }
    reference ref$at $at && check $r_ckpt ref$at
    reference ref$((at + 100)) $((at + 100)) &&
        cp "$tmp/$r_ckpt.st" "$tmp/$r_name-from.st" &&
        run $r_name "$@" --load "$tmp/$r_name-from.st" --max-steps $((at + 100)) && check $r_name ref$((at + 100))
}
fault link-down "no answer from rank [23] (h2)" "ip -n $p-sw link set port-h2 down"
ip -n $p-sw link set port-h2 up
resumed resume-h1h3 link-down $mpirun --host h1:1,h3:1 -np 2 "$b/train_mpi" --devices cpu:2
# (mpirun's own words for a lost host vary: "lost communication with a remote daemon ... on node
# h2", or only that a daemon could not connect back to it)
fault host-killed "h2\|rank [23]\|daemon" "kill -9 \$(ip netns pids $p-h2)"
resumed resume-h3 host-killed $on h3 "$b/train_cpu" --devices cpu:4

# ---- 3. Slurm ----
slurm() {
    for tool in munged mungekey slurmctld slurmd srun; do
        command -v $tool >/dev/null 2>&1 || { skipped=$((skipped + 1)); echo "  skip Slurm: no $tool (apt-get install slurm-wlm munge)"; return; }
    done
    s=$tmp/slurm; mkdir -p $s/state $s/munge $s/tmp-h1 $s/tmp-h2
    chmod 700 $s/munge
    mungekey -c -k $s/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=$s/munge/munge.key bs=1024 count=1 2>/dev/null
    chmod 600 $s/munge/munge.key
    munged --force -S $s/munge/socket --key-file=$s/munge/munge.key --pid-file=$tmp/munged.pid \
        --log-file=$s/munge/log --seed-file=$s/munge/seed 2>$s/munged.err ||
        { fail "munged did not start: $(cat $s/munged.err)"; return; }
    cat > $s/slurm.conf <<EOF
ClusterName=mgpu
SlurmctldHost=h1(10.77.0.1)
AuthType=auth/munge
AuthInfo=socket=$s/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool-%n
TmpFS=$s/tmp-%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd-%n.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
NodeName=h1 NodeAddr=10.77.0.1 CPUs=2 State=UNKNOWN
NodeName=h2 NodeAddr=10.77.0.2 CPUs=2 State=UNKNOWN
PartitionName=main Nodes=h1,h2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
    export SLURM_CONF=$s/slurm.conf
    $on h1 slurmctld -i >$s/slurmctld.out 2>&1 || { fail "slurmctld did not start: $(tail -n 3 $s/slurmctld.out $s/slurmctld.log)"; return; }
    for h in h1 h2; do
        $on $h slurmd -N $h >$s/slurmd-$h.out 2>&1 || { fail "slurmd on $h did not start: $(tail -n 3 $s/slurmd-$h.out $s/slurmd-$h.log)"; return; }
    done
    for i in $(seq 1 60); do
        [ "$($on h1 sinfo -h -o %T -p main 2>/dev/null | grep -c idle)" -ge 1 ] &&
            [ "$($on h1 sinfo -h -N -o %T 2>/dev/null | grep -c -v 'idle\|mix\|alloc')" -eq 0 ] && break
        sleep 0.5
    done
    if ! $on h1 srun --mpi=list 2>&1 | grep -q pmix; then
        skipped=$((skipped + 1)); echo "  skip srun --mpi=pmix: this Slurm has no PMIx plugin: $($on h1 srun --mpi=list 2>&1 | tr '\n' ' ')"; return
    fi
    # (Open MPI's settings in the environment, which srun passes on: its --export splits at commas)
    srun="$on h1 env OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=10.77.0.0/24 OMPI_MCA_orte_tmpdir_base=$tmp/ompi timeout 300 srun -N 2 -n 4 --mpi=pmix --overcommit"
    $srun sh -c 'echo "$SLURM_PROCID $SLURM_NTASKS $SLURM_LOCALID $(hostname)"' > "$tmp/env.txt" 2>&1
    want=$(printf '0 4 0 h1\n1 4 1 h1\n2 4 0 h2\n3 4 1 h2')
    [ "$(grep -E '^[0-9]+ [0-9]+ [0-9]+ h[0-9]$' "$tmp/env.txt" | sort)" = "$want" ] && ok "srun -N 2 -n 4: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID on h1, h2 as docs/mpi.md says" ||
        fail "srun's environment: $(cat "$tmp/env.txt" | tr '\n' ';') (want $(echo "$want" | tr '\n' ';'))"
    run srun-np4 $srun "$b/train_mpi" --devices cpu $steps && check srun-np4 cpu4
    grep -q "processes=4 devices=cpu replicas=4 " "$tmp/srun-np4.txt" && ok "srun's result line names the 4 processes" ||
        fail "the result line of srun: $(tail -n 1 "$tmp/srun-np4.txt")"
    # a rank on h2 stopped (SIGSTOP): the others' timeout ends the job step, and srun returns
    MGPU_DIST_TIMEOUT=5 $srun "$b/train_mpi" --devices cpu --epochs 50 $common > "$tmp/srun-stop.txt" 2>&1 &
    job=$!
    victim=
    for i in $(seq 1 300); do
        victim=$(for pid in $(ip netns pids $p-h2); do [ "$(cat /proc/$pid/comm 2>/dev/null)" = train_mpi ] && echo $pid; done | head -n 1)
        [ -n "$victim" ] && break; sleep 0.1
    done
    sleep 2
    start=$(date +%s)
    [ -n "$victim" ] && kill -STOP $victim
    ( sleep 90; kill -9 $job ) >/dev/null 2>&1 & watchdog=$!   # (its sleep holds no pipe of ours)
    wait $job; rc=$?
    kill $watchdog $(pgrep -P $watchdog) 2>/dev/null
    took=$(seconds $start)
    if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $rc -ne 137 ] && [ $took -le 35 ] && [ -z "$(ranks_alive)" ] &&
       grep -q "no answer from rank [23] (h2) .*MGPU_DIST_TIMEOUT=5" "$tmp/srun-stop.txt"; then
        ok "a rank on h2 stopped under srun: the job ends in ${took} s (srun $rc): $(grep -m 1 'no answer' "$tmp/srun-stop.txt")"
    else
        fail "a rank on h2 stopped under srun (pid ${victim:-none}): srun $rc after ${took} s: $(grep -v '^ *$' "$tmp/srun-stop.txt" | tail -n 4)"
    fi
    unset SLURM_CONF
}
slurm

# ---- nothing left behind ----
teardown
trap - EXIT
left=""
[ -n "$(ip netns list | grep "^$p-")" ] && left="$left namespaces:$(ip netns list | grep "^$p-" | tr '\n' ' ')"
[ -e "$tmp" ] && left="$left $tmp"
pgrep -f "$tmp" >/dev/null && left="$left processes:$(pgrep -f "$tmp" | tr '\n' ' ')"
[ -n "$(ip link show | grep -e "port-h" -e "$p")" ] && left="$left links"
[ -z "$left" ] && ok "nothing left: no process, namespace, veth, or Slurm and munge state" || fail "left behind:$left"
echo "  (the cluster took $(( $(date +%s) - began )) s)"
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
