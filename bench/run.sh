#!/bin/sh
# make bench: mgpu's and PyTorch's benchmarks on this machine, joined into one table that is
# printed and written to bench/results/DATE-HOST.md. Usage: run.sh BENCH_BINARY [--quick]
# BENCH_WHICH=cuda runs the GPU rows alone, mgpu's and PyTorch's (make gpu-check on a GPU lent for
# minutes); the default, all, runs every row.
bench=${1:-build/bench}
which=${BENCH_WHICH:-all}
shift
dir=$(dirname "$0")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$bench" $which "$@" > "$out/mgpu.tsv" || exit 1
# the CPU steps of the plain build beside them (cc -O2, no -march: what a user who vendors mgpu.h
# compiles; its CPU kernels are chosen at run time)
plain=$(dirname "$bench")/bench_plain
if [ "$which" = all ] && [ -x "$plain" ]; then
    "$plain" steps | awk -F'\t' 'BEGIN { OFS = "\t" } { $1 = $1 "_plain_O2"; print }' >> "$out/mgpu.tsv" || echo "bench: bench_plain failed" >&2
fi
# the all-reduce across 2 and 4 processes (MPI, one CPU replica each), where make built bench_mpi
mpi_bench=$(dirname "$bench")/bench_mpi
if [ "$which" = all ] && [ -x "$mpi_bench" ] && command -v mpirun >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    for np in 2 4; do
        mpirun --oversubscribe --bind-to none -np $np "$mpi_bench" mpi "$@" >> "$out/mgpu.tsv" || echo "bench: bench_mpi -np $np failed" >&2
    done
fi
# a million small tensors: mgpu's safetensors reader against the reference library's (Python
# safetensors, numpy), on the same file; its row goes beside PyTorch's
[ "$which" = all ] && { "$bench" safetensors "$out/million.safetensors" "$@" >> "$out/mgpu.tsv" || echo "bench: the safetensors row failed" >&2; }
st_work=$(awk -F'\t' '$3 == "open_read_all" { print $1 }' "$out/mgpu.tsv")
st_py=""
for p in python3 /usr/bin/python3; do
    command -v $p >/dev/null 2>&1 && $p -c "import safetensors, numpy" 2>/dev/null && { st_py=$p; break; }
done
if [ -n "$st_py" ] && [ -n "$st_work" ]; then
    $st_py "$dir/bench_safetensors.py" "$out/million.safetensors" "$st_work" >> "$out/torch.tsv" || echo "bench: the safetensors reference failed" >&2
elif [ "$which" = all ]; then echo "bench: no Python with safetensors and numpy: the safetensors row has no reference" >&2; fi
rm -f "$out/million.safetensors"
threads=$(awk -F'\t' '$1 == "threads" { print $4 }' "$out/mgpu.tsv")
py=""
for p in python3 /usr/bin/python3; do
    command -v $p >/dev/null 2>&1 && $p -c "import torch" 2>/dev/null && { py=$p; break; }
done
if [ -n "$py" ]; then $py "$dir/bench_torch.py" "${threads:-1}" $which "$@" > "$out/torch.tsv" || echo "bench: the PyTorch side failed" >&2
else echo "bench: no PyTorch found: the table says so" >&2; fi
commit=${MGPU_COMMIT:-$(git -C "$dir/.." rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -n "$(git -C "$dir/.." status --porcelain -- mgpu.h mgpu_kernels.cu bench ':!bench/results' 2>/dev/null)" ] && commit="$commit+changes"
mkdir -p "$dir/results"
name="$dir/results/$(date +%Y-%m-%d)-$(hostname | cut -c1-20)$(echo " $*" | grep -q -- --quick && echo -quick)$([ "$which" = all ] || echo "-$which").md"
python3 "$dir/report.py" "$out/mgpu.tsv" "$out/torch.tsv" "$name" "$commit"
echo "written to $name"
