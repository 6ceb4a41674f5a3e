#!/bin/sh
# The course (docs/course/en and docs/course/zh, programs in examples/course/):
#   1. the Chinese and English lessons have the same files, the same headings at the same levels,
#      the same code blocks (count and kind) and name the same programs; each lesson has the six
#      sections in order; every program a lesson names exists, and every program is named;
#   2. every program and solution builds (C99, -Werror) and runs as its own comment lines say,
#      with its output checked. In each examples/course/*.c and examples/course/solutions/*.c:
#        // course-run: ARGS           the CPU build, run as `prog ARGS`
#        // course-run-emu N: ARGS     the emulated-GPU build (make emu-program), on N emulated GPUs
#        // course-mpirun NP: ARGS     the MPI build (mpicc -DMGPU_MPI), mpirun -np NP (skipped without MPI)
#        // course-expect: TEXT        every run's output contains TEXT
#        // course-kernels: FILE.cu     CUDA code of the program's own: linked into its emulated build
#                                      (make emu-program KERNELS=...), compiled by nvcc where there is
#                                      one (compile only); the CPU build must not need it
#      $DATA in ARGS is the Fashion-MNIST folder (a run that needs it is skipped without it). A
#      program checks its own numbers and exits non-zero when one is wrong;
#   3. every shell command of the course README and of the lessons runs as written, in a fresh copy
#      of the repository (no build/), and every output a lesson quotes is what the command printed
#      (tests/course_docs.py commands: the markers that say which block is which are described there);
#   4. the Chinese text keeps the glossary's terminology list, full-width punctuation, “” quotes,
#      "第 NN 课：" headings and no English prose outside code (tests/course_docs.py zh).
# Usage: tests/course.sh [BUILD] [DATA]
b=${1:-build}
DATA=${2:-/usr/share/datasets/fashion-mnist}
CC=${CC:-cc}
passed=0; failed=0; skipped=0
ok()   { passed=$((passed + 1)); echo "  ok   $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL $*"; }
skip() { skipped=$((skipped + 1)); echo "  skip $*"; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/course.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
en=docs/course/en; zh=docs/course/zh

echo "== the lessons, Chinese beside English"
# the shape of a markdown file: its headings' levels, its code blocks' kinds (outside code blocks)
shape() {
    awk '/^```/ { if (code) { code = 0 } else { code = 1; kind = substr($0, 4); print "code " (kind == "" ? "-" : kind) }; next }
         !code && /^#+ / { match($0, /^#+/); print "heading " RLENGTH }' "$1"
}
programs() { grep -o 'examples/course/[A-Za-z0-9_./-]*\.\(cu\|c\|py\|sh\)' "$1" | sort -u; }
sections_en="## The idea|## In PyTorch|## In mgpu|## What it prints|## Exercises|## Solutions"
sections_zh="## 思路|## PyTorch 的写法|## mgpu 的写法|## 运行结果|## 练习|## 答案"
if [ ! -d "$en" ] || [ ! -d "$zh" ]; then
    fail "docs/course/en and docs/course/zh both exist"
else
    (cd "$en" && ls *.md) > "$tmp/en.list"; (cd "$zh" && ls *.md) > "$tmp/zh.list"
    if cmp -s "$tmp/en.list" "$tmp/zh.list"; then ok "the same $(wc -l < "$tmp/en.list") files in en/ and zh/"
    else fail "en/ and zh/ hold different files:"; diff "$tmp/en.list" "$tmp/zh.list" | sed 's/^/       /'; fi
    for f in $(cat "$tmp/en.list"); do
        [ -f "$zh/$f" ] || continue
        shape "$en/$f" > "$tmp/a"; shape "$zh/$f" > "$tmp/b"
        if cmp -s "$tmp/a" "$tmp/b"; then ok "$f: the same $(grep -c heading "$tmp/a") headings and $(grep -c code "$tmp/a") code blocks"
        else fail "$f: headings or code blocks differ between en and zh (level or kind, in order):"
             diff "$tmp/a" "$tmp/b" | head -n 10 | sed 's/^/       /'; fi
        programs "$en/$f" > "$tmp/a"; programs "$zh/$f" > "$tmp/b"
        if cmp -s "$tmp/a" "$tmp/b"; then ok "$f: names the same $(wc -l < "$tmp/a" | tr -d ' ') programs"
        else fail "$f: names different programs in en and zh:"; diff "$tmp/a" "$tmp/b" | sed 's/^/       /'; fi
        for p in $(cat "$tmp/a"); do [ -f "$p" ] || fail "$f names $p, which does not exist"; done
        case "$f" in
            [0-9][0-9]-*)   # a lesson: the six sections, in order
                for lang in en zh; do
                    eval "want=\$sections_$lang"
                    got=$(grep -E "^## " "docs/course/$lang/$f" | grep -xE "$want" | tr '\n' '|' | sed 's/|$//')
                    if [ "$got" = "$want" ]; then ok "$lang/$f: the six sections in order"
                    else fail "$lang/$f: sections are '$got', want '$want'"; fi
                done;;
        esac
    done
    for p in examples/course/*.c examples/course/*.py examples/course/solutions/*.c examples/course/*.cu examples/course/solutions/*.cu; do
        [ -f "$p" ] || continue
        grep -qF "$p" "$en"/*.md && grep -qF "$p" "$zh"/*.md && ok "$p is named by an English and a Chinese lesson" || \
            fail "$p is not named by a lesson in both en/ and zh/"
    done
fi

echo "== the programs"
mkdir -p "$b/course" "$tmp/build"
have_emu=""; have_mpi=""
nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 && have_mpi=1
[ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The builds first, COURSE_JOBS at a time (default: one per core), as they are most of this part's
# time: each program's CPU build, emulated build and MPI build, as its comment lines ask for them.
# Each leaves its compiler's output in $tmp/build/NAME.KIND and its exit status in NAME.KIND.rc.
# The emulator's own libraries are built before, once (two makes would build them at once).
cat > "$tmp/build.sh" <<'EOF'
b=$1; out=$2; have_mpi=$3; src=$4   # (xargs gives the source last)
name=$(basename "$src" .c)
kernels=$(sed -n 's|^// course-kernels: *||p' "$src" | tr '\n' ' ' | sed 's/ *$//')
if grep -q '^// course-run:' "$src"; then
    $CC -std=c99 -Wall -Wextra -Werror -O2 -I. "$src" -o "$b/course/$name" -lm -lpthread > "$out/$name.cpu" 2>&1
    echo $? > "$out/$name.cpu.rc"
fi
if grep -q '^// course-run-emu [0-9]*:' "$src"; then
    env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s emu-program B="$b" SRC="$src" KERNELS="$kernels" > "$out/$name.emu" 2>&1
    echo $? > "$out/$name.emu.rc"
fi
if grep -q '^// course-mpirun [0-9]*:' "$src" && [ -n "$have_mpi" ]; then
    mpicc -std=c99 -Wall -Wextra -Werror -O2 -DMGPU_MPI -I. "$src" -o "$b/course/${name}_mpi" -lm -lpthread > "$out/$name.mpi" 2>&1
    echo $? > "$out/$name.mpi.rc"
fi
EOF
export CC
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s B="$b" "$b/emu/mgpu_kernels.o" "$b/emu/libmgpuemu.so" "$b/emu/libnccl_emu.so" > "$tmp/cc" 2>&1 ||
    { fail "the emulator's libraries build (make $b/emu/libmgpuemu.so)"; sed 's/^/       /' "$tmp/cc" | head -n 20; }
start=$(date +%s)
ls examples/course/*.c examples/course/solutions/*.c | xargs -n 1 -P "${COURSE_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
    sh "$tmp/build.sh" "$b" "$tmp/build" "$have_mpi"
echo "   (the builds, $(ls examples/course/*.c examples/course/solutions/*.c | wc -l) programs: $(($(date +%s) - start)) s)"
# built NAME KIND: its build succeeded (the compiler's output in $tmp/cc either way)
built() {
    cp "$tmp/build/$1.$2" "$tmp/cc" 2>/dev/null || : > "$tmp/cc"
    [ "$(cat "$tmp/build/$1.$2.rc" 2>/dev/null)" = 0 ]
}
# run KIND NAME CMD...: run it and check the output for each course-expect line of $src
run() {
    what=$1; shift
    case "$*" in *'$DATA'*|*"$DATA"*) [ -e "$DATA/train-images-idx3-ubyte.gz" ] || [ -e "$DATA/train-images-idx3-ubyte" ] || \
        { skip "$what: no Fashion-MNIST in $DATA (apt-get install dataset-fashion-mnist)"; return; };; esac
    if timeout 600 "$@" < /dev/null > "$tmp/out" 2>&1; then
        missing=""
        while IFS= read -r want; do
            grep -qF -- "$want" "$tmp/out" || missing="$missing '$want'"
        done < "$tmp/expect"
        if [ -z "$missing" ]; then ok "$what"
        else fail "$what: the output lacks$missing"; tail -n 8 "$tmp/out" | sed 's/^/       /'; fi
    else
        fail "$what (exit $?)"; tail -n 12 "$tmp/out" | sed 's/^/       /'
    fi
}
for src in examples/course/*.c examples/course/solutions/*.c; do
    [ -f "$src" ] || continue
    name=$(basename "$src" .c)
    sed -n 's|^// course-expect: ||p' "$src" > "$tmp/expect"
    grep -q '^// course-\(run\|run-emu [0-9]*\|mpirun [0-9]*\):' "$src" || { fail "$src has no // course-run line"; continue; }
    kernels=$(sed -n 's|^// course-kernels: *||p' "$src" | tr '\n' ' ' | sed 's/ *$//')
    for k in $kernels; do
        if [ ! -f "$k" ]; then fail "$src: its kernels file $k does not exist"
        elif [ -z "$nvcc" ]; then skip "$k by nvcc: no nvcc"
        elif env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s B="$b" NVCC="$nvcc" "$b/cu/${k%.cu}.o" > "$tmp/cc" 2>&1; then ok "$k compiles with nvcc"
        else fail "$k compiles with nvcc"; sed 's/^/       /' "$tmp/cc" | head -n 20; fi
    done
    if grep -q '^// course-run:' "$src"; then
        if built "$name" cpu; then
            sed -n 's|^// course-run: *||p' "$src" | while IFS= read -r args; do
                eval "set -- $args"
                run "$name $args" "$b/course/$name" "$@"
                echo "$passed $failed $skipped" > "$tmp/counts"
            done
            [ -f "$tmp/counts" ] && read -r passed failed skipped < "$tmp/counts" && rm -f "$tmp/counts"
        else fail "$src builds with $CC -std=c99 -Wall -Wextra -Werror"; sed 's/^/       /' "$tmp/cc" | head -n 20; fi
    fi
    if grep -q '^// course-run-emu [0-9]*:' "$src"; then
        if built "$name" emu; then
            sed -n 's|^// course-run-emu \([0-9]*\): *|\1 |p' "$src" | while read -r n args; do
                eval "set -- $args"
                run "$name $args (on $n emulated GPUs)" env MGPU_EMU_DEVICES="$n" "$b/emu/$name" "$@"
                echo "$passed $failed $skipped" > "$tmp/counts"
            done
            [ -f "$tmp/counts" ] && read -r passed failed skipped < "$tmp/counts" && rm -f "$tmp/counts"
        else fail "make emu-program SRC=$src"; sed 's/^/       /' "$tmp/cc" | head -n 20; fi
    fi
    if grep -q '^// course-mpirun [0-9]*:' "$src"; then
        if [ -z "$have_mpi" ]; then skip "$name under mpirun: no mpicc or mpirun (apt-get install openmpi-bin libopenmpi-dev)"
        elif built "$name" mpi; then
            sed -n 's|^// course-mpirun \([0-9]*\): *|\1 |p' "$src" | while read -r np args; do
                eval "set -- $args"
                run "mpirun -np $np $name $args" mpirun --oversubscribe --bind-to none -np "$np" "$b/course/${name}_mpi" "$@"
                echo "$passed $failed $skipped" > "$tmp/counts"
            done
            [ -f "$tmp/counts" ] && read -r passed failed skipped < "$tmp/counts" && rm -f "$tmp/counts"
        else fail "$src builds with mpicc -DMGPU_MPI"; sed 's/^/       /' "$tmp/cc" | head -n 20; fi
    fi
done

# the counts of a tests/course_docs.py run, added to ours
docs() {
    if ! command -v python3 >/dev/null 2>&1; then skip "tests/course_docs.py $1: no python3"; return; fi
    python3 tests/course_docs.py "$@" | tee "$tmp/docs.out" | grep -v ' passed, .* failed, .* skipped$'
    set -- $(sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed, \([0-9]*\) skipped$/\1 \2 \3/p' "$tmp/docs.out")
    if [ $# -eq 3 ]; then passed=$((passed + $1)); failed=$((failed + $2)); skipped=$((skipped + $3))
    else fail "tests/course_docs.py ended without its counts"; fi
}
echo "== the Chinese text: the glossary's terms, punctuation, headings"
docs zh
echo "== every shell command of the README and the lessons, as written, from a fresh copy; their quoted outputs"
mkdir -p "$tmp/docs"
docs commands "$tmp/docs" "$DATA"

echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
