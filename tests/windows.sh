#!/bin/sh
# make test-windows: mgpu on Windows, from Linux. MinGW-w64 builds into BUILD_DIR/windows, and
# wine runs:
#   - the header alone: C99, C11 -pedantic and C++17 with -Wall -Wextra -Werror (with and
#     without MGPU_CUDA), included twice with the implementation once (tests/compile_check.c),
#     each also linked and run; and a plain "gcc -std=c99 examples/hello.c" build, which must
#     need no DLL beyond the system's (KERNEL32, msvcrt: no libwinpthread)
#   - the CPU suites test_core, test_io, test_model, test_parallel, test_misuse,
#     test_alloc_faults, test_platform and test_settings (its table skipped: no fork), built as the
#     Makefile builds them on Linux but -O2 and -static (test_io with zlib only when a MinGW zlib
#     is installed), through tests/run_all.sh
#   - the examples as tests/examples.sh runs them (tour on Fashion-MNIST from DATA_DIR)
#   - build/train from seed 7 on Fashion-MNIST (MLP on cpu and cpu:3, 2 pipeline stages, the CNN)
#     against the Linux build/train_plain (cc -std=c99 -O2): the checkpoints equal byte for byte
# wine sees / as Z:\, so Linux paths work as they are. Its prefix lives in BUILD_DIR/windows/
# wineprefix (made by wineboot at first use, some seconds). Without the cross compiler or wine:
# one skip. Last line: "N passed, N failed, N skipped"; the exit status is non-zero on a failure.
# Usage: sh tests/windows.sh [BUILD_DIR] [DATA_DIR]
b=${1:-build}
data=${2:-${DATA:-/usr/share/datasets/fashion-mnist}}
w=$b/windows
MINGW=${MINGW:-x86_64-w64-mingw32}
wcc=$MINGW-gcc
wcxx=$MINGW-g++
passed=0; failed=0; skipped=0
ok()   { passed=$((passed + 1)); echo "  ok   $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL $*"; }
skip() { skipped=$((skipped + 1)); echo "  skip $*"; }
finish() {
    echo "$passed passed, $failed failed, $skipped skipped"
    [ $failed -eq 0 ]
    exit
}

missing=
command -v $wcc >/dev/null 2>&1 && command -v $wcxx >/dev/null 2>&1 || missing="$wcc and $wcxx"
command -v wine >/dev/null 2>&1 || missing="${missing:+$missing, }wine"
if [ -n "$missing" ]; then
    echo "  skip the Windows build: no $missing (Debian: apt-get install gcc-mingw-w64-x86-64 g++-mingw-w64-x86-64 wine wine64)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi

mkdir -p "$w" || { fail "mkdir $w"; finish; }
WINEPREFIX=$(cd "$w" && pwd)/wineprefix
WINEDEBUG=-all
export WINEPREFIX WINEDEBUG
# wine with this prefix, its output (stdout and stderr) without the carriage returns of Windows's
# text mode, and its exit status; a program that hangs fails after WINDOWS_TEST_TIMEOUT seconds
# (600) instead of stopping the run. A script, so that tests/run_all.sh can run it too.
cat > "$w/run_wine.sh" <<EOF
#!/bin/sh
WINEPREFIX='$WINEPREFIX' WINEDEBUG=-all
export WINEPREFIX WINEDEBUG
rc_file=\$(mktemp) || exit 125
{
    if command -v timeout >/dev/null 2>&1; then timeout ${WINDOWS_TEST_TIMEOUT:-600} wine "\$@"; else wine "\$@"; fi
    echo \$? > "\$rc_file"
} 2>&1 | tr -d '\r'
rc=\$(cat "\$rc_file")
rm -f "\$rc_file"
exit "\${rc:-125}"
EOF
run_wine() { sh "$w/run_wine.sh" "$@"; }
if [ ! -e "$WINEPREFIX/system.reg" ]; then
    echo "== a wine prefix in $WINEPREFIX (wineboot -i)"
    if ! out=$(wineboot -i 2>&1) || [ ! -e "$WINEPREFIX/system.reg" ]; then
        fail "wineboot -i: $(printf '%s\n' "$out" | tail -n 3)"; finish
    fi
fi

# built OUT FILES...: OUT exists and is newer than FILES, mgpu.h and tests/test.h
built() {
    out=$1; shift
    [ -e "$out" ] || return 1
    for f in mgpu.h tests/test.h "$@"; do [ "$out" -nt "$f" ] || return 1; done
    return 0
}
compile() {   # compile NAME OUT SOURCE COMPILER FLAGS...: one pass or failure
    name=$1; out=$2; src=$3; shift 3
    if built "$out" "$src"; then ok "$name (built before)"; return 0; fi
    if log=$("$@" 2>&1); then ok "$name"; return 0; fi
    rm -f "$out"
    fail "$name"; printf '%s\n' "$log" | head -n 20
    return 1
}

echo "== the header, by $wcc and $wcxx"
for std in "$wcc -std=c99" "$wcc -std=c11 -pedantic" "$wcxx -x c++ -std=c++17"; do
    tag=$(echo "$std" | tr -c 'a-z0-9\n' _)
    # shellcheck disable=SC2086
    if compile "$std -Wall -Wextra -Werror: tests/compile_check.c" "$w/cc_$tag.exe" tests/compile_check.c \
            $std -Wall -Wextra -Werror -I. tests/compile_check.c -o "$w/cc_$tag.exe" -static; then
        if run_wine "$w/cc_$tag.exe" >/dev/null 2>&1; then ok "  and it runs"; else fail "  wine $w/cc_$tag.exe"; fi
    fi
    # with MGPU_CUDA: compiled only (the kernels file, built by nvcc, is not here)
    # shellcheck disable=SC2086
    compile "$std -Wall -Wextra -Werror -DMGPU_CUDA: tests/compile_check.c" "$w/cc_${tag}_cuda.o" tests/compile_check.c \
        $std -Wall -Wextra -Werror -I. -DMGPU_CUDA -c tests/compile_check.c -o "$w/cc_${tag}_cuda.o"
done
# mgpu_kernels.cu for Windows: nvcc hands its host code to MSVC there, which is not here; what can
# be checked is the file as host C++ (tests/emu/cu2cpp.py, the emulator's CUDA headers) by MinGW's
# g++ with POSIX threads (std::mutex): no dlfcn.h, no GCC-only attribute reaches a Windows build
wposix=$(command -v "$MINGW-g++-posix" 2>/dev/null)
if [ -z "$wposix" ] || ! command -v "${PYTHON:-python3}" >/dev/null 2>&1; then
    skip "mgpu_kernels.cu for Windows: no $MINGW-g++-posix or python3"
elif ! "${PYTHON:-python3}" tests/emu/cu2cpp.py mgpu_kernels.cu "$w/mgpu_kernels.cpp" 2>"$w/cu2cpp.log"; then
    fail "tests/emu/cu2cpp.py mgpu_kernels.cu: $(head -n 3 "$w/cu2cpp.log")"
else
    compile "mgpu_kernels.cu as host C++ for Windows ($wposix -std=c++17 -Wall -Wextra -Werror)" "$w/mgpu_kernels.o" mgpu_kernels.cu \
        "$wposix" -std=c++17 -Wall -Wextra -Werror -Wno-unknown-pragmas -Itests/emu -I. -DMGPU_CU_MAX_BLOCKS=61 \
        -c "$w/mgpu_kernels.cpp" -o "$w/mgpu_kernels.o"
fi
if compile "plain '$wcc -std=c99 examples/hello.c'" "$w/hello_plain.exe" examples/hello.c \
        $wcc -std=c99 -I. examples/hello.c -o "$w/hello_plain.exe"; then
    dlls=$($MINGW-objdump -p "$w/hello_plain.exe" 2>/dev/null | sed -n 's/.*DLL Name: *//p' | tr '\n' ' ')
    extra=$(printf '%s\n' $dlls | grep -v -i -x -E 'kernel32\.dll|msvcrt\.dll|ucrtbase\.dll|api-ms-win-.*\.dll|advapi32\.dll' | tr '\n' ' ')
    if [ -z "$dlls" ]; then skip "the plain build's DLLs: no $MINGW-objdump"
    elif [ -z "$extra" ]; then ok "  it needs no DLL beyond the system's ($dlls)"
    else fail "  the plain build needs $extra(all: $dlls)"; fi
    if out=$(run_wine "$w/hello_plain.exe" 2>&1); then ok "  and runs: $out"; else fail "  wine $w/hello_plain.exe: $out"; fi
fi

echo "== the suites, by $wcc -std=c99 -Wall -Wextra -Werror -O2 -static"
zlib_flags=
if printf '#include <zlib.h>\nint main(void){return zlibVersion()[0] == 0;}\n' | $wcc -x c - -o "$w/zlib_probe.exe" -static -lz >/dev/null 2>&1; then
    zlib_flags="-DHAVE_ZLIB"
    echo "   (a MinGW zlib is installed: test_io checks the gzip reader against it)"
fi
rm -f "$w/zlib_probe.exe"
set --
for t in test_core test_io test_model test_parallel test_misuse test_alloc_faults test_platform test_settings; do
    extra=; libs=
    if [ $t = test_io ] && [ -n "$zlib_flags" ]; then extra=$zlib_flags; libs=-lz; fi
    # shellcheck disable=SC2086
    if compile "$t.exe" "$w/$t.exe" tests/$t.c $wcc -std=c99 -Wall -Wextra -Werror -O2 $extra -I. tests/$t.c -o "$w/$t.exe" -static $libs; then
        set -- "$@" "sh $w/run_wine.sh $w/$t.exe"
    fi
done
if [ $# -gt 0 ]; then
    # what earlier runs left in wine's temporary folder: wine gives the first processes the same
    # ids run after run, and a suite's folder named after its id must not be found full
    rm -rf "$WINEPREFIX"/drive_c/users/*/Temp/mgpu[-_]* "$WINEPREFIX"/drive_c/users/*/AppData/Local/Temp/mgpu[-_]*
    sh tests/run_all.sh "$@" > "$w/suites.log" 2>&1
    grep -v -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$w/suites.log" | grep -v '^  ok '
    last=$(tail -n 1 "$w/suites.log")
    if printf '%s\n' "$last" | grep -q -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'; then
        echo "   the suites: $last"
        passed=$((passed + $(echo "$last" | awk '{print $1}')))
        failed=$((failed + $(echo "$last" | awk '{print $3}')))
        skipped=$((skipped + $(echo "$last" | awk '{print $5}')))
    else
        fail "tests/run_all.sh ended without a summary line"
    fi
fi

echo "== the examples, as tests/examples.sh runs them"
exe_ok=
for e in hello custom_layer data_parallel model_parallel tour train; do
    if compile "$e.exe" "$w/$e.exe" examples/$e.c $wcc -std=c99 -Wall -Wextra -Werror -O2 -I. examples/$e.c -o "$w/$e.exe" -static; then
        exe_ok="$exe_ok $e"
    fi
    # and as C11 -pedantic (compiled only; the examples are C: their compound literals are not C++)
    compile "$e.c as C11 -pedantic" "$w/${e}_c11.o" examples/$e.c $wcc -std=c11 -pedantic -Wall -Wextra -Werror -I. -c examples/$e.c -o "$w/${e}_c11.o"
done
have() { case " $exe_ok " in *" $1 "*) return 0;; esac; return 1; }
example() {   # example NAME ARGS...: passes when wine NAME.exe ARGS exits 0
    e=$1; shift
    have "$e" || return 0
    if out=$(run_wine "$w/$e.exe" "$@" 2>&1); then ok "wine $e.exe $*"
    else fail "wine $e.exe $* (exit $?)"; printf '%s\n' "$out" | tail -n 5; fi
}
example hello
example custom_layer
for spec in cpu:2 cpu:3 cpu:4; do example data_parallel $spec; done
example model_parallel cpu:2
if [ -e "$data/train-images-idx3-ubyte.gz" ] || [ -e "$data/train-images-idx3-ubyte" ]; then
    example tour "$data" "$w/tour.safetensors"
else
    skip "tour: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
fi

echo "== train.exe against the Linux build/train_plain (cc -std=c99 -O2): the same checkpoint, byte for byte"
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
    skip "train on Windows and Linux: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"
elif ! have train; then
    :
else
    linux=$b/train_plain
    if [ ! -x "$linux" ] || ! built "$linux" examples/train.c; then   # as the Makefile's rule builds it
        linux=$w/train_linux
        if ! built "$linux" examples/train.c &&
           ! ${CC:-cc} -std=c99 -Wall -Wextra -Werror -O2 -I. examples/train.c -o "$linux" -lm -lpthread; then
            linux=
            fail "cc -std=c99 -O2 examples/train.c (the Linux side)"
        fi
    fi
    if [ -n "$linux" ]; then
        for flags in "--devices cpu --max-steps 200" "--devices cpu:3 --max-steps 200" \
                     "--devices cpu:2 --stages 2 --max-steps 100" "--model cnn --devices cpu --max-steps 30"; do
            tag=$(echo "$flags" | tr -c 'a-z0-9\n' _)
            lst=$w/ck_linux_$tag.safetensors; wst=$w/ck_windows_$tag.safetensors
            rm -f "$lst" "$wst"
            # shellcheck disable=SC2086
            if ! lout=$("$linux" --data "$data" --quiet --seed 7 $flags --save "$lst" 2>&1); then
                fail "$linux $flags: $(printf '%s\n' "$lout" | tail -n 2)"; continue
            fi
            # shellcheck disable=SC2086
            if ! wout=$(run_wine "$w/train.exe" --data "$data" --quiet --seed 7 $flags --save "$wst" 2>&1); then
                fail "wine train.exe $flags: $(printf '%s\n' "$wout" | tail -n 2)"; continue
            fi
            if cmp -s "$lst" "$wst"; then
                ok "--seed 7 $flags: the checkpoints are equal ($(wc -c < "$wst") bytes; $(printf '%s\n' "$wout" | tail -n 1 | sed -n 's/.*\(test_acc=[0-9.]*\).*/\1/p'))"
            else
                fail "--seed 7 $flags: the Windows checkpoint differs from the Linux one: $(cmp "$lst" "$wst" 2>&1)"
            fi
        done
    fi
fi
finish
