#!/bin/sh
# The header compiles as C99, C11 -pedantic and C++ (gcc, g++, and clang when present) with
# -Wall -Wextra -Werror, with and without MGPU_CUDA, included twice with the implementation once
# (and with MGPU_MPI by mpicc and mpicxx, where they are);
# and a CPU-only program builds with nothing but "cc -std=c99 prog.c -lm -lpthread".
# Usage: compile_check.sh BUILD_DIR
set -e
out=${1:-build}
check() {
    "$@" -Wall -Wextra -Werror -I. -c tests/compile_check.c -o "$out/compile_check.o"
    "$@" -Wall -Wextra -Werror -I. -DMGPU_CUDA -c tests/compile_check.c -o "$out/compile_check.o"
    echo "compile-check: $* ok"
}
check ${CC:-cc} -std=c99
check ${CC:-cc} -std=c11 -pedantic
check ${CXX:-c++} -x c++ -std=c++11
if command -v clang >/dev/null 2>&1; then check clang -std=c99; check clang++ -x c++ -std=c++17; fi
# MGPU_MPI: with mpicc and mpicxx, when Open MPI (or MPICH) is installed
if command -v mpicc >/dev/null 2>&1; then check mpicc -DMGPU_MPI -std=c99; check mpicc -DMGPU_MPI -std=c11 -pedantic; fi
if command -v mpicxx >/dev/null 2>&1; then check mpicxx -DMGPU_MPI -x c++ -std=c++11; fi
cc -std=c99 examples/hello.c -I. -o "$out/hello_plain" -lm -lpthread
"$out/hello_plain" >/dev/null
echo "compile-check: plain 'cc -std=c99 examples/hello.c -lm -lpthread' builds and runs"
