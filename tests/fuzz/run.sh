#!/bin/sh
# Builds the libFuzzer harnesses (tests/fuzz/fuzz_*.c) with clang into B/fuzz and runs each for
# SECONDS: first over its seed corpus (tests/fuzz/corpus/<harness>, read only) and what earlier
# runs found (B/fuzz/corpus/<harness>, where new inputs go), then on new inputs. Two harnesses
# run at a time (the CI machine has 2 cores). Prints each one's executions and coverage, and last
# "N passed, N failed, N skipped": a harness that finds a crash, a leak, a sanitizer report or a
# disagreement with zlib has failed; its input is kept in B/fuzz/crash-<harness>-*.
#   sh tests/fuzz/run.sh B SECONDS [HARNESS...]      (make fuzz: FUZZ_SECONDS, default 600)
B=${1:-build}
SECONDS_EACH=${2:-60}
if [ $# -ge 2 ]; then shift 2; else shift $#; fi   # (a failed shift ends dash)
HARNESSES=${*:-safetensors model_load idx gunzip inflate tokens gpt_load}
CLANG=${CLANG:-clang}
MAX_LEN=${FUZZ_MAX_LEN:-4096}   # inputs stay small, so each run covers many of them
CFLAGS="-std=c99 -Wall -Wextra -Werror -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all"
DIR=$B/fuzz
mkdir -p "$DIR" || exit 1
count=$(echo $HARNESSES | wc -w)

skip_all() {
    echo "skip fuzz ($HARNESSES): $1"
    echo "0 passed, 0 failed, $count skipped"
    exit 0
}
command -v "$CLANG" >/dev/null 2>&1 || skip_all "no $CLANG (apt-get install clang)"
printf 'int LLVMFuzzerTestOneInput(const unsigned char* d, unsigned long n) { (void)d; (void)n; return 0; }\n' >"$DIR/probe$$.c"
"$CLANG" $CFLAGS "$DIR/probe$$.c" -o "$DIR/probe$$" 2>"$DIR/probe$$.log" ||
    skip_all "$CLANG cannot build a libFuzzer program with ASan and UBSan (apt-get install libclang-rt-dev; $(head -n 1 "$DIR/probe$$.log"))"
HAVE_ZLIB=1
printf '#include <zlib.h>\nint main(void) { return zlibVersion() == 0; }\n' >"$DIR/probe$$.c"
"$CLANG" "$DIR/probe$$.c" -o "$DIR/probe$$" -lz 2>/dev/null || HAVE_ZLIB=

passed=0; failed=0; skipped=0

# build: two at a time; a harness that does not build has failed
build() {
    h=$1
    if [ ! "$DIR/fuzz_$h" -nt tests/fuzz/fuzz_$h.c ] || [ ! "$DIR/fuzz_$h" -nt mgpu.h ] || [ ! "$DIR/fuzz_$h" -nt tests/fuzz/fuzz.h ] ||
       [ ! "$DIR/fuzz_$h" -nt tests/fuzz/zref.h ]; then
        "$CLANG" $CFLAGS -I. tests/fuzz/fuzz_$h.c -o "$DIR/fuzz_$h" -lz -lm -lpthread >"$DIR/build_$h.log" 2>&1 ||
            rm -f "$DIR/fuzz_$h"
    fi
}
# run one harness; its verdict goes to DIR/<harness>.rc
fuzz() {
    h=$1
    mkdir -p "$DIR/corpus/$h"
    rm -f "$DIR"/crash-$h-* "$DIR"/leak-$h-* "$DIR"/timeout-$h-* "$DIR"/oom-$h-*
    "$DIR/fuzz_$h" -max_len=$MAX_LEN -max_total_time="$SECONDS_EACH" -timeout=25 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$DIR/" -exact_artifact_path="$DIR/crash-$h-input" \
        "$DIR/corpus/$h" "tests/fuzz/corpus/$h" >"$DIR/$h.log" 2>&1
    echo $? >"$DIR/$h.rc"
}

todo=""
for h in $HARNESSES; do
    if [ ! -f tests/fuzz/fuzz_$h.c ]; then
        echo "== fuzz_$h: no tests/fuzz/fuzz_$h.c"; failed=$((failed + 1)); continue
    fi
    if [ -z "$HAVE_ZLIB" ] && grep -q zref.h tests/fuzz/fuzz_$h.c; then
        echo "skip fuzz_$h: it compares with zlib, which is missing (apt-get install zlib1g-dev)"
        skipped=$((skipped + 1)); continue
    fi
    todo="$todo $h"
done

set -- $todo
while [ $# -gt 0 ]; do
    a=$1; shift; b=${1:-}; [ $# -gt 0 ] && shift
    build "$a" & [ -n "$b" ] && build "$b"; wait
    [ -x "$DIR/fuzz_$a" ] && fuzz "$a" & pa=$!
    [ -n "$b" ] && [ -x "$DIR/fuzz_$b" ] && fuzz "$b"
    wait $pa
    for h in $a $b; do
        echo "== fuzz_$h ($SECONDS_EACH s)"
        if [ ! -x "$DIR/fuzz_$h" ]; then
            cat "$DIR/build_$h.log"; echo "   fuzz_$h did not build"; failed=$((failed + 1)); continue
        fi
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$DIR/$h.log" | tail -n 1)
        last=$(grep -E '^#[0-9]+' "$DIR/$h.log" | tail -n 1 | sed 's/ *exec\/s.*//')
        echo "   ${execs:-?} executions; last: $last"
        if [ "$(cat "$DIR/$h.rc")" = 0 ]; then
            passed=$((passed + 1))
        else
            grep -E 'ERROR|SUMMARY|runtime error|mgpu__|zlib|^    #[0-9]+ .* in ' "$DIR/$h.log" | head -n 30 | sed 's/^/   /'
            echo "   fuzz_$h FAILED: the input is $DIR/crash-$h-input, the log $DIR/$h.log;"
            echo "   reproduce: $DIR/fuzz_$h $DIR/crash-$h-input"
            failed=$((failed + 1))
        fi
    done
done
rm -f "$DIR/probe$$.c" "$DIR/probe$$" "$DIR/probe$$.log"
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
