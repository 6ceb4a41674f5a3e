#!/bin/sh
# Runs several tests at once, TOGETHER_JOBS at a time (default: one per core), each through
# tests/run_all.sh (its output, the seconds it took), then shows their outputs in the order given
# and sums their last lines into one, "N passed, N failed, N skipped". For tests that keep about
# one core busy each (the emulated GPUs, the cross-compilers, wine, qemu): on the 2-core CI
# machine two at a time take about half as long. Commands are separated by a lone +:
#   sh tests/together.sh sh tests/windows.sh build + sh tests/aarch64.sh build
# (each command is split into words, as run_all.sh splits it: no quoting). Exit status: non-zero
# if any failed.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/together.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
n=0; cmd=""
add() { n=$((n + 1)); printf '%s\n' "$cmd" > "$tmp/$n.cmd"; cmd=""; }
for a in "$@"; do
    if [ "$a" = + ]; then [ -n "$cmd" ] && add; else cmd="${cmd:+$cmd }$a"; fi
done
[ -n "$cmd" ] && add
run_all=$(dirname "$0")/run_all.sh
i=1
while [ $i -le $n ]; do echo $i; i=$((i + 1)); done |
    xargs -P "${TOGETHER_JOBS:-$(nproc 2>/dev/null || echo 2)}" -I{} sh -c 'sh "$0" "$(cat "$1/{}.cmd")" > "$1/{}.out" 2>&1' "$run_all" "$tmp"
passed=0; failed=0; skipped=0; i=1
while [ $i -le $n ]; do
    last=$(tail -n 1 "$tmp/$i.out")
    sed '$d' "$tmp/$i.out"
    if printf '%s\n' "$last" | grep -q -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'; then
        set -- $last
        passed=$((passed + $1)); failed=$((failed + $3)); skipped=$((skipped + $5))
    else
        printf '%s\n' "$last"; echo "   $(cat "$tmp/$i.cmd"): ended without a summary line"; failed=$((failed + 1))
    fi
    i=$((i + 1))
done
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
