#!/bin/sh
# Runs every test binary given, shows its output, and sums their last lines
# ("N passed, N failed, N skipped") into one, with the seconds each took (CI gives the whole run
# 90 minutes: these say where they go). Exit status: non-zero if any binary failed.
passed=0; failed=0; skipped=0; status=0
for t in "$@"; do
    echo "== $t"
    start=$(date +%s)
    out=$($t 2>&1); rc=$?
    took=$(($(date +%s) - start))
    printf '%s\n' "$out" | grep -v -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'
    last=$(printf '%s\n' "$out" | tail -n 1)
    if printf '%s\n' "$last" | grep -q -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'; then
        passed=$((passed + $(echo "$last" | awk '{print $1}')))
        failed=$((failed + $(echo "$last" | awk '{print $3}')))
        skipped=$((skipped + $(echo "$last" | awk '{print $5}')))
    else
        echo "   $t ended without a summary line (exit $rc)"
        failed=$((failed + 1))
    fi
    [ $rc -ne 0 ] && status=1
    echo "   ($t: $took s)"
done
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -ne 0 ] && status=1
exit $status
