#!/bin/sh
# Every shell command of README.md's ```sh blocks is run here, as a reader would type it, or is
# marked in the README as one that cannot run inside make test, by a trailing comment that says
# "needs a GPU", "needs CUDA", "needs MPI", "needs Slurm" or "cannot run inside make test" (make
# test itself).
# A command neither run nor marked fails, and so does a sentence of the README of the form
# "It prints `X`" whose X no command printed as its last line, and a README of more than 250 lines.
#   - `sudo apt-get install PKG...` runs as `apt-get install -s` (a simulation, no root): every
#     package must exist (or be installed already);
#   - every other command runs verbatim, in order, with a time limit, in a scratch folder that
#     looks like this repository (links to its files, build -> BUILD_DIR), so that `my.c`, `./my`
#     and `build/emu/my` are where the README says. The README's C program (the ```c block
#     under "## A first program") is written there as my.c first.
#   - a command that reads Fashion-MNIST (make demo, ./my, build/emu/my) is skipped, saying so,
#     when the data is not in /usr/share/datasets/fashion-mnist, where the README's program reads
#     it (and make demo would otherwise install it).
# Usage: sh tests/readme_commands.sh [BUILD_DIR]      Last line: "N passed, N failed, N skipped".
b=${1:-build}
readme=README.md
data=/usr/share/datasets/fashion-mnist
passed=0; failed=0; skipped=0
ok()   { passed=$((passed + 1)); echo "  ok   $*"; }
fail() { failed=$((failed + 1)); echo "  FAIL $*"; }
skip() { skipped=$((skipped + 1)); echo "  skip $*"; }
finish() { echo "$passed passed, $failed failed, $skipped skipped"; [ $failed -eq 0 ]; exit; }

[ -f "$readme" ] && [ -f mgpu.h ] || { fail "run from the repository's root (no $readme or mgpu.h here)"; finish; }
mkdir -p "$b" || { fail "mkdir $b"; finish; }
root=$(pwd)
babs=$(cd "$b" && pwd)
s=$babs/readme
rm -rf "$s" && mkdir -p "$s" || { fail "mkdir $s"; finish; }
for f in "$root"/* "$root"/.ci; do
    # (not what the commands write: a reader's own my.c or my in the repository stay untouched)
    case "${f##*/}" in build|"${b##*/}"|my|my.c|mgpu_kernels.o) ;; *) ln -s "$f" "$s/${f##*/}" ;; esac
done
ln -s "$babs" "$s/build"
# a reader's make, not a sub-make of make test: none of its flags or variables
unset MAKEFLAGS MFLAGS MAKELEVEL MAKEOVERRIDES

# a front page, not a manual (issue 22): at most 250 lines
lines=$(wc -l < "$readme")
if [ "$lines" -le 250 ]; then ok "$readme has $lines lines (at most 250)"; else fail "$readme has $lines lines, more than 250: move a section into docs/"; fi

# the README's program, as my.c
awk '/^## A first program/{t=1} t&&/^```c$/{c=1;next} c&&/^```$/{exit} c' "$readme" > "$s/my.c"
[ -s "$s/my.c" ] || fail "no \`\`\`c block under \"## A first program\" in $readme"

# the commands: one a line, continuation lines joined, comment-only and empty lines left out
awk '/^```sh$/{c=1; next} c&&/^```$/{c=0; next}
     c { if (cont != "") { $0 = cont " " $0; cont = "" }
         if ($0 ~ /\\$/) { sub(/\\$/, ""); cont = $0; next }
         if ($0 ~ /^[ \t]*(#|$)/) next
         print }' "$readme" > "$s/commands.txt"
[ -s "$s/commands.txt" ] || fail "no commands in $readme's \`\`\`sh blocks"
have_data=; [ -e "$data/train-images-idx3-ubyte.gz" ] && have_data=1
to=; command -v timeout >/dev/null 2>&1 && to="timeout 600"
: > "$s/printed.txt"

n=0
while IFS= read -r line; do
    n=$((n + 1))
    cmd=$(printf '%s\n' "$line" | sed 's/[[:space:]]#.*$//; s/[[:space:]]*$//')
    note=$(printf '%s\n' "$line" | sed -n 's/^.*[[:space:]]#[[:space:]]*//p')
    case "$note" in
        *"needs a GPU"*|*"needs CUDA"*|*"needs MPI"*|*"needs Slurm"*|*"cannot run inside make test"*)
            skip "$cmd (the README marks it: $note)"; continue ;;
    esac
    case "$cmd" in
        "sudo apt-get install "*|"apt-get install "*)
            pkgs=${cmd#sudo }; pkgs=${pkgs#apt-get install }
            if ! command -v apt-get >/dev/null 2>&1; then skip "$cmd: no apt-get here (not Debian)"; continue; fi
            # shellcheck disable=SC2086
            if out=$(apt-get install -s $pkgs 2>&1); then ok "$cmd (apt-get install -s: every package found)"
            else
                missing=
                for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
                if [ -z "$missing" ]; then ok "$cmd (every package installed)"
                else fail "$cmd: apt-get install -s: $(printf '%s\n' "$out" | grep -E '^E:' | head -n 2 | tr '\n' ' ')"; fi
            fi
            continue ;;
    esac
    case "$cmd" in
        *"make demo"*|*./my*|*build/emu/my*)
            [ -n "$have_data" ] || { skip "$cmd: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)"; continue; } ;;
    esac
    start=$(date +%s)
    out=$(cd "$s" && $to sh -c "$cmd" 2>&1); rc=$?
    secs=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        ok "$cmd (${secs} s)"
        printf '%s\n' "$out" | tail -n 1 >> "$s/printed.txt"
    else
        fail "$cmd: exit $rc after ${secs} s"; printf '%s\n' "$out" | tail -n 8 | sed 's/^/       /'
    fi
done < "$s/commands.txt"

# what the README says the commands print
sed -n 's/.*It prints `\([^`]*\)`.*/\1/p' "$readme" > "$s/claims.txt"
while IFS= read -r claim; do
    if grep -qxF "$claim" "$s/printed.txt"; then ok "the README's \"It prints \`$claim\`\""
    elif [ -z "$have_data" ]; then skip "the README's \"It prints \`$claim\`\": its command did not run (no data)"
    else fail "the README says a command prints \`$claim\`; the commands' last lines were: $(tr '\n' '|' < "$s/printed.txt")"; fi
done < "$s/claims.txt"
echo "  ($n commands in $readme's sh blocks)"
finish
