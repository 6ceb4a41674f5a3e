#!/bin/sh
# Runs every test binary given, shows its output, and sums their last lines
# ("N passed, N failed, N skipped") into one, with the seconds each took (CI gives the whole run
# 90 minutes: these say where they go). What failed is said again just before that last line, so
# that a log's tail names it (CI shows only the tail). Exit status: non-zero if any binary failed.
passed=0; failed=0; skipped=0; status=0
failures=""
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
    if [ $rc -ne 0 ] || ! printf '%s\n' "$last" | grep -q -E '^[0-9]+ passed, 0 failed'; then
        # its failures, each with the group ("== ...") it came under, and the seeds that repeat
        # them (a suite's first line names its MGPU_TEST_SEED), at most 10 lines; where it ran
        # tests through this script (tests/together.sh does), their own recaps instead
        what=$(printf '%s\n' "$out" | awk '
            /^== what failed$/ { recap = 1; next }
            /MGPU_TEST_SEED to repeat|MGPU_EMU_CHAOS_SEED=/ && !recap && nf < 10 { f[++nf] = "     " $0 }
            /^== / { recap = 0; g = $0 }
            recap { r[++nr] = "  " $0; next }
            /FAIL/ && nf < 10 { f[++nf] = "     " (g ? g " :: " : "") $0 }
            END { if (nr) for (i = 1; i <= nr; i++) print r[i]; else for (i = 1; i <= nf; i++) print f[i] }')
        printf '%s\n' "$last" | grep -q -E '^[0-9]+ passed' || last="no summary line; its last: $last"
        failures="$failures   $t (exit $rc): $last
"
        [ -n "$what" ] && failures="$failures$what
"
    fi
    echo "   ($t: $took s)"
done
if [ -n "$failures" ]; then
    echo "== what failed"
    printf '%s' "$failures"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -ne 0 ] && status=1
exit $status
