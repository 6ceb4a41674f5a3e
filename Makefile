# mgpu: build, test, demo.
#   make            build the CPU-only variant, and the CUDA variant when nvcc is found, into build/
#   make test       run every test on both variants (CUDA tests report skips without a GPU), and
#                   every command of README.md (tests/readme_commands.sh)
#   make demo       train on Fashion-MNIST with build/train (every GPU, or the CPU); EMU=4 DEVICES=cuda:0,1,2,3
#                   MAX_STEPS=200: on 4 emulated GPUs
#   make test-emu   the CUDA build on emulated GPUs (tests/emu): no GPU needed; part of make test
#   make gpu-check  on a GPU machine: build for its GPU, run everything with CUDA, then under
#                   compute-sanitizer, and print a results table
#   make fuzz       the libFuzzer harnesses (tests/fuzz), FUZZ_SECONDS each (default 600), two at a
#                   time; make test runs each for 30 s
#   make tsan       test_parallel and a cpu:3 training under ThreadSanitizer (part of make test)
#   make test-windows  the CPU suites, the examples and the header built by MinGW-w64 and run under
#                   wine, train's checkpoints equal to Linux's byte for byte (part of make test)
#   make test-aarch64  the CPU suites and build/train cross-compiled for aarch64, run under qemu-aarch64
#                   (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; part of make test)
#   make mpi        with mpicc (Debian: openmpi-bin libopenmpi-dev): build/train_mpi, one job over many
#                   processes (mpirun -np 4 build/train_mpi --devices cpu), its CUDA and emulated
#                   variants, build/gpt_mpi, examples/ddp.c and tests/test_mpi.c (tests/mpi.sh runs them in make test;
#                   tests/cluster.sh runs them across hosts made of network namespaces, by mpirun
#                   and by Slurm: root, iproute2, slurm-wlm, munge, nftables)
# Variables: CC, CFLAGS, NVCC, CUDA_HOME, ARCH (nvcc -gencode flags), B (build folder), CLANG.

CC        ?= cc
CXX       ?= c++
CFLAGS    ?= -O3 -march=native
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
ARCH      ?= -gencode arch=compute_90,code=[sm_90,compute_90]
B         ?= build
CLANG     ?= clang
FUZZ_SECONDS ?= 600

WARN      = -std=c99 -Wall -Wextra -Werror
LDLIBS    = -lm -lpthread
SANITIZE  = -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
# clang's sanitizers beside gcc's: its UBSan checks more (e.g. -fsanitize=function, implicit
# conversions it knows), and any report stops the run
CLANG_SANITIZE = -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
TSAN      = -O1 -g -fno-omit-frame-pointer -fsanitize=thread
CUDA_LIBS = -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lstdc++ -ldl
NVFLAGS   = -std=c++17 -O3 $(ARCH) -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings

TESTS     = test_core test_io test_model test_parallel test_seq test_autograd
# per-test extras: test_io checks the gzip decoder against zlib
EXTRA_io  = -DHAVE_ZLIB
LIBS_io   = -lz
HEADERS   = mgpu.h tests/test.h

EXAMPLES  = hello custom_layer data_parallel model_parallel tour

CPU_BINS  = $(B)/train_cpu $(EXAMPLES:%=$(B)/%) $(TESTS:%=$(B)/%) $(TESTS:%=$(B)/%_asan)
ifneq ($(NVCC),)
CUDA_BINS = $(B)/mgpu_kernels.o $(B)/train_cuda $(B)/data_parallel_cuda $(TESTS:%=$(B)/%_cuda)
endif

.PHONY: all test test-build test-cpu test-cuda test-emu emu emu-program compile-check demo bench gpu-check clean fuzz tsan test-clang mpi test-windows test-aarch64
all: $(CPU_BINS) $(CUDA_BINS) $(B)/train $(B)/gpt $(B)/resnet $(B)/gru

$(B):
	@mkdir -p $(B)

# ---- library objects -------------------------------------------------------------------------
$(B)/mgpu_kernels.o: mgpu_kernels.cu mgpu.h | $(B)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# ---- programs --------------------------------------------------------------------------------
$(B)/%: examples/%.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)

$(B)/%_cuda: examples/%.c mgpu.h $(B)/mgpu_kernels.o | $(B)
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(B)/mgpu_kernels.o -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/train_cpu: examples/train.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)

$(B)/train_cuda: examples/train.c mgpu.h $(B)/mgpu_kernels.o | $(B)
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(B)/mgpu_kernels.o -o $@ $(CUDA_LIBS) $(LDLIBS)

# build/gpt (examples/gpt.c): a GPT-2 trained on tokens or text, on every device present; the CUDA
# build when there is nvcc, as build/train
$(B)/gpt_cpu: examples/gpt.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)
$(B)/gpt: $(if $(NVCC),$(B)/gpt_cuda,$(B)/gpt_cpu)
	cp $< $@

# build/resnet (examples/resnet.c): a small ResNet with BatchNorm on Fashion-MNIST, the CUDA build
# when there is nvcc, as build/gpt
$(B)/resnet_cpu: examples/resnet.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)
$(B)/resnet: $(if $(NVCC),$(B)/resnet_cuda,$(B)/resnet_cpu)
	cp $< $@

# build/gru (examples/gru.c): a GRU (or LSTM) written from tape ops, no backward of its own, on
# Fashion-MNIST row by row; the CUDA build when there is nvcc, as build/gpt
$(B)/gru_cpu: examples/gru.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)
$(B)/gru: $(if $(NVCC),$(B)/gru_cuda,$(B)/gru_cpu)
	cp $< $@

# The plain build a user who vendors mgpu.h makes (cc -O2, no -march): its CPU kernels are
# chosen at run time (tests/plain_build.sh, and make bench's *_plain_O2 rows)
$(B)/train_plain: examples/train.c mgpu.h | $(B)
	$(CC) $(WARN) -O2 -I. $< -o $@ $(LDLIBS)

# build/train is the program to run: the CUDA build when there is nvcc (it falls back to the
# CPU by itself on a machine without a GPU), else the CPU build.
$(B)/train: $(if $(NVCC),$(B)/train_cuda,$(B)/train_cpu)
	cp $< $@

# ---- tests -----------------------------------------------------------------------------------
$(B)/test_%: tests/test_%.c $(HEADERS) | $(B)
	$(CC) $(WARN) $(CFLAGS) $(EXTRA_$*) -I. $< -o $@ $(LIBS_$*) $(LDLIBS)

$(B)/test_%_asan: tests/test_%.c $(HEADERS) | $(B)
	$(CC) $(WARN) $(SANITIZE) $(EXTRA_$*) -I. $< -o $@ $(LIBS_$*) $(LDLIBS)

$(B)/test_%_cuda: tests/test_%.c $(HEADERS) $(B)/mgpu_kernels.o | $(B)
	$(CC) $(WARN) $(CFLAGS) $(EXTRA_$*) -DMGPU_CUDA -I. $< $(B)/mgpu_kernels.o $(CU_OBJ) -o $@ $(CUDA_LIBS) $(LIBS_$*) $(LDLIBS)

# the same suites built by clang with its ASan + UBSan (without clang or its sanitizer runtimes,
# Debian's libclang-rt-dev, one skip says so)
HAVE_CLANG := $(shell printf 'int main(void){return 0;}\n' | $(CLANG) -x c $(CLANG_SANITIZE) - -o /dev/null 2>/dev/null && echo 1)
HAVE_TSAN  := $(shell printf 'int main(void){return 0;}\n' | $(CLANG) -x c $(TSAN) - -o /dev/null 2>/dev/null && echo 1)
$(B)/test_%_clang: tests/test_%.c $(HEADERS) | $(B)
	$(CLANG) $(WARN) $(CLANG_SANITIZE) $(EXTRA_$*) -I. $< -o $@ $(LIBS_$*) $(LDLIBS)
CLANG_TESTS = $(if $(HAVE_CLANG),$(TESTS:%=$(B)/%_clang),"sh tests/skip.sh 4 the clang sanitizer builds: no $(CLANG) with ASan and UBSan, apt-get install clang libclang-rt-dev")
test-clang: $(if $(HAVE_CLANG),$(TESTS:%=$(B)/%_clang))
	@sh tests/run_all.sh $(CLANG_TESTS)

# MGPU_CBLAS: test_core with every CPU GEMM sent to OpenBLAS's cblas_sgemm (Debian's
# libopenblas-dev, which .ci/run installs); without it, one skip says so.
HAVE_CBLAS := $(shell printf '\043include <cblas.h>\nint main(void){return 0;}\n' | $(CC) -x c - -o /dev/null -lopenblas 2>/dev/null && echo 1)
$(B)/test_core_cblas: tests/test_core.c $(HEADERS) | $(B)
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CBLAS -I. $< -o $@ -lopenblas $(LDLIBS)
CBLAS_TEST = $(if $(HAVE_CBLAS),$(B)/test_core_cblas,"sh tests/skip.sh 1 test_core_cblas: no OpenBLAS, apt-get install libopenblas-dev")

# ---- the GPU emulator (tests/emu): mgpu_kernels.cu compiled as host C++, run on the CPU --------
# libmgpuemu.so stands for -lcudart -lcublas -lcublasLt; libnccl_emu.so is loaded through MGPU_NCCL_LIBRARY.
# $(B)/emu holds the normal build, $(B)/emu-asan the AddressSanitizer + UBSan one.
PYTHON   ?= python3
EMU_DIR   = $(B)/emu
EMU_ASAN  = $(B)/emu-asan
EMU_HDRS  = tests/emu/cuda_runtime.h tests/emu/cublas_v2.h tests/emu/cublasLt.h tests/emu/emu.h
EMU_CXX   = $(CXX) -std=c++17 -Wall -Wextra -Werror -Itests/emu
EMU_OPT   = -O2 -g
# grids of at most 61 blocks (65535 on a GPU): the grid-stride loops of the kernels run at the
# quick sizes of the tests
EMU_KERNELS = -DMGPU_CU_MAX_BLOCKS=61 -DMGPU_NCCL_DEFAULT_LIBRARY='"libnccl_emu.so"'
EMU_LINK  = -Wl,-rpath,'$$ORIGIN' -lmgpuemu -lstdc++ -ldl
EMU_TESTS = $(TESTS:%=$(EMU_DIR)/%) $(EMU_DIR)/test_emu
EMU_BINS  = $(EMU_DIR)/libmgpuemu.so $(EMU_DIR)/libnccl_emu.so $(EMU_TESTS) $(B)/train_emu $(B)/train_cpu $(EMU_DIR)/ckpt_diff $(EMU_DIR)/gpt $(EMU_DIR)/gru \
            $(EMU_ASAN)/libmgpuemu.so $(EMU_ASAN)/libnccl_emu.so $(TESTS:%=$(EMU_ASAN)/%)
emu: $(EMU_BINS)

$(EMU_DIR) $(EMU_ASAN):
	@mkdir -p $@

$(EMU_DIR)/mgpu_kernels.cpp: mgpu_kernels.cu tests/emu/cu2cpp.py | $(EMU_DIR)
	$(PYTHON) tests/emu/cu2cpp.py $< $@
$(EMU_DIR)/selfcheck.cpp: tests/emu/selfcheck.cu tests/emu/cu2cpp.py | $(EMU_DIR)
	$(PYTHON) tests/emu/cu2cpp.py $< $@

# the kernels file as nvcc sees it, but for the host: `#pragma unroll` is nvcc's, hence -Wno-unknown-pragmas
$(EMU_DIR)/libmgpuemu.so: tests/emu/runtime.cpp $(EMU_HDRS) | $(EMU_DIR)
	$(EMU_CXX) $(EMU_OPT) -fPIC -shared $< -o $@ -lpthread
$(EMU_DIR)/libnccl_emu.so: tests/emu/nccl.cpp tests/emu/emu.h $(EMU_DIR)/libmgpuemu.so | $(EMU_DIR)
	$(EMU_CXX) $(EMU_OPT) -fPIC -shared $< -o $@ -L$(EMU_DIR) $(EMU_LINK) -lpthread
$(EMU_DIR)/mgpu_kernels.o: $(EMU_DIR)/mgpu_kernels.cpp mgpu.h $(EMU_HDRS)
	$(EMU_CXX) $(EMU_OPT) $(EMU_KERNELS) -march=native -Wno-unknown-pragmas -I. -c $< -o $@
$(EMU_DIR)/test_%: tests/test_%.c $(HEADERS) $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(CC) $(WARN) $(CFLAGS) $(EXTRA_$*) -DMGPU_CUDA -I. $< $(EMU_DIR)/mgpu_kernels.o $(CU_OBJ) -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LIBS_$*) $(LDLIBS)
$(EMU_DIR)/test_emu: tests/emu/test_emu.c $(EMU_DIR)/selfcheck.cpp $(HEADERS) tests/emu/emu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(EMU_CXX) $(EMU_OPT) -Wno-unknown-pragmas -c $(EMU_DIR)/selfcheck.cpp -o $(EMU_DIR)/selfcheck.o
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. -Itests/emu $< $(EMU_DIR)/selfcheck.o $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)
$(EMU_DIR)/gpt: examples/gpt.c mgpu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so $(EMU_DIR)/libnccl_emu.so
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)
$(EMU_DIR)/gru: examples/gru.c mgpu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so $(EMU_DIR)/libnccl_emu.so
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)
$(B)/train_emu: examples/train.c mgpu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) -Wl,-rpath,'$$ORIGIN/emu' -lmgpuemu -lstdc++ -ldl $(LDLIBS)
$(EMU_DIR)/ckpt_diff: tests/emu/ckpt_diff.c | $(EMU_DIR)
	$(CC) $(WARN) -O2 $< -o $@ -lm
$(EMU_DIR)/bench: bench/bench.c mgpu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -DMGPU_BENCH_EMU -I. -Itests/emu $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)

# ---- CUDA files of a program's own: kernels it launches on mgpu's streams (mgpu_cuda_begin) ----
# FILE.cu (a path below this folder) becomes $(B)/cu/FILE.o by nvcc, and $(EMU_DIR)/cu/FILE.o
# (or $(EMU_ASAN)/cu/FILE.o) by tests/emu/cu2cpp.py and the host compiler, as mgpu_kernels.cu does.
$(B)/cu/%.o: %.cu mgpu.h
	@mkdir -p $(@D)
	$(NVCC) $(NVFLAGS) -I. -c $< -o $@
$(EMU_DIR)/cu/%.cpp: %.cu tests/emu/cu2cpp.py
	@mkdir -p $(@D)
	$(PYTHON) tests/emu/cu2cpp.py $< $@
$(EMU_DIR)/cu/%.o: $(EMU_DIR)/cu/%.cpp mgpu.h $(EMU_HDRS)
	$(EMU_CXX) $(EMU_OPT) -Wno-unknown-pragmas -I. -c $< -o $@
$(EMU_ASAN)/cu/%.o: $(EMU_DIR)/cu/%.cpp mgpu.h $(EMU_HDRS)
	@mkdir -p $(@D)
	$(EMU_CXX) $(SANITIZE) -Wno-unknown-pragmas -I. -c $< -o $@
# A suite's own kernels, linked into its CUDA and emulated builds: CU_<suite> lists them, CU_OBJ
# names their objects beside the binary being linked. test_core's group "kernels of your own".
CU_core = tests/test_core_kernels.cu
CU_OBJ  = $(CU_$*:%.cu=$(@D)/cu/%.o)
$(B)/test_core_cuda: $(CU_core:%.cu=$(B)/cu/%.o)
$(EMU_DIR)/test_core: $(CU_core:%.cu=$(EMU_DIR)/cu/%.o)
$(EMU_ASAN)/test_core: $(CU_core:%.cu=$(EMU_ASAN)/cu/%.o)

# A program of your own on emulated GPUs, with the emulated NCCL found by default:
#   make emu-program SRC=my.c      builds build/emu/my (beside the emulator's libraries)
#   MGPU_EMU_DEVICES=4 build/emu/my   runs it on 4 emulated GPUs (cuda:0 to cuda:3)
#   make emu-program SRC=my.c KERNELS=my_kernel.cu    with CUDA files of its own (mgpu_cuda_begin)
KERNEL_OBJS = $(KERNELS:%.cu=$(EMU_DIR)/cu/%.o)
emu-program: $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so $(EMU_DIR)/libnccl_emu.so $(KERNEL_OBJS)
	@test -n "$(SRC)" || { echo "emu-program: say which program, e.g. make emu-program SRC=examples/hello.c"; exit 2; }
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $(SRC) $(EMU_DIR)/mgpu_kernels.o $(KERNEL_OBJS) -o $(EMU_DIR)/$(basename $(notdir $(SRC))) \
	    -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)

# the same under AddressSanitizer + UBSan
$(EMU_ASAN)/libmgpuemu.so: tests/emu/runtime.cpp $(EMU_HDRS) | $(EMU_ASAN)
	$(EMU_CXX) $(SANITIZE) -fPIC -shared $< -o $@ -lpthread
$(EMU_ASAN)/libnccl_emu.so: tests/emu/nccl.cpp tests/emu/emu.h $(EMU_ASAN)/libmgpuemu.so | $(EMU_ASAN)
	$(EMU_CXX) $(SANITIZE) -fPIC -shared $< -o $@ -L$(EMU_ASAN) $(EMU_LINK) -lpthread
$(EMU_ASAN)/mgpu_kernels.o: $(EMU_DIR)/mgpu_kernels.cpp mgpu.h $(EMU_HDRS) | $(EMU_ASAN)
	$(EMU_CXX) $(SANITIZE) $(EMU_KERNELS) -Wno-unknown-pragmas -I. -c $< -o $@
$(EMU_ASAN)/test_%: tests/test_%.c $(HEADERS) $(EMU_ASAN)/mgpu_kernels.o $(EMU_ASAN)/libmgpuemu.so
	$(CC) $(WARN) $(SANITIZE) $(EXTRA_$*) -DMGPU_CUDA -I. $< $(EMU_ASAN)/mgpu_kernels.o $(CU_OBJ) -o $@ -L$(EMU_ASAN) $(EMU_LINK) $(LIBS_$*) $(LDLIBS)

test-emu: $(EMU_BINS)
	@sh tests/emu/run.sh $(B)

# The header alone: C99 and C++ with -Werror, included twice with the implementation once, and a
# CPU-only program built with nothing but cc -std=c99 prog.c -lm -lpthread.
compile-check: | $(B)
	@CC="$(CC)" CXX="$(CXX)" sh tests/compile_check.sh $(B)

test-cpu: $(TESTS:%=$(B)/%) $(TESTS:%=$(B)/%_asan)
test-cuda: $(CUDA_BINS)

$(B)/interop: tests/interop.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)
$(B)/bn_torch: tests/bn_torch.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS)


# ---- Windows: MinGW-w64 and wine -----------------------------------------------------------------
# tests/windows.sh cross-builds into $(B)/windows and runs under wine the header's compile checks
# (C99, C11 -pedantic, C++17), the CPU suites and the examples, and train.exe against
# $(B)/train_plain (the same checkpoints, byte for byte). Without x86_64-w64-mingw32-gcc or wine
# (Debian: gcc-mingw-w64-x86-64 g++-mingw-w64-x86-64 wine wine64), one skip.
test-windows: $(B)/train_plain
	@sh tests/windows.sh $(B) $(DATA)

# ---- ThreadSanitizer (clang): the data-parallel suite and a cpu:3 training -----------------------
$(B)/test_parallel_tsan: tests/test_parallel.c $(HEADERS) | $(B)
	$(CLANG) $(WARN) $(TSAN) -I. $< -o $@ $(LDLIBS)
$(B)/train_tsan: examples/train.c mgpu.h | $(B)
	$(CLANG) $(WARN) $(TSAN) -I. $< -o $@ $(LDLIBS)
TSAN_BINS = $(if $(HAVE_TSAN),$(B)/test_parallel_tsan $(B)/train_tsan)
tsan: $(TSAN_BINS)
	@sh tests/tsan.sh $(B) $(DATA)

# ---- aarch64 through qemu-user (tests/aarch64.sh) -------------------------------------------------
# The CPU suites and examples/train.c built by aarch64-linux-gnu-gcc -O2 -static into $(B)/aarch64
# (by the script), run under qemu-aarch64; the training compared with x86's $(B)/train_plain and
# to the bit with x86's portable kernel. Without the cross compiler or qemu, one skip says so.
test-aarch64: $(B)/train_plain
	@sh tests/aarch64.sh $(B) $(DATA)

# ---- fuzzing (tests/fuzz): libFuzzer harnesses built by clang with ASan + UBSan -----------------
# FUZZ_SECONDS per harness, two at a time; new inputs collect in $(B)/fuzz/corpus, a crash's in
# $(B)/fuzz/crash-<harness>-input. Without clang or libFuzzer the script reports skips.
# The harnesses are built here (so make -j2 builds them with the rest) and, with the same flags,
# by run.sh itself when one is missing or older than its sources.
FUZZ_HARNESSES = safetensors model_load idx gunzip inflate tokens gpt_load
FUZZ_CFLAGS = $(WARN) -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
HAVE_FUZZ := $(shell printf 'int LLVMFuzzerTestOneInput(const char* d, long n) { (void)d; (void)n; return 0; }\n' | \
               $(CLANG) -x c $(FUZZ_CFLAGS) - -o /dev/null 2>/dev/null && echo 1)
FUZZ_BINS = $(if $(HAVE_FUZZ),$(FUZZ_HARNESSES:%=$(B)/fuzz/fuzz_%))
$(B)/fuzz/fuzz_%: tests/fuzz/fuzz_%.c mgpu.h tests/fuzz/fuzz.h tests/fuzz/zref.h
	@mkdir -p $(B)/fuzz
	$(CLANG) $(FUZZ_CFLAGS) -I. $< -o $@ -lz $(LDLIBS)
fuzz: $(FUZZ_BINS) | $(B)
	@sh tests/fuzz/run.sh $(B) $(FUZZ_SECONDS)

# ---- processes (MPI): programs built with mpicc, run by mpirun (tests/mpi.sh) ------------------
# Without mpicc and mpirun nothing here is built, and tests/mpi.sh reports one skip.
MPICC    ?= mpicc
HAVE_MPI := $(shell command -v $(MPICC) >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 && echo 1)
MPI_BINS  = $(if $(HAVE_MPI),$(B)/train_mpi $(B)/ddp_mpi $(B)/test_mpi $(B)/train_mpi_emu $(EMU_DIR)/test_mpi $(B)/bench_mpi $(B)/gpt_mpi $(B)/gpt_cpu $(if $(NVCC),$(B)/train_mpi_cuda))
$(B)/train_mpi: examples/train.c mgpu.h | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -I. $< -o $@ $(LDLIBS)
$(B)/gpt_mpi: examples/gpt.c mgpu.h | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -I. $< -o $@ $(LDLIBS)
$(B)/ddp_mpi: examples/ddp.c mgpu.h | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -I. $< -o $@ $(LDLIBS)
$(B)/bench_mpi: bench/bench.c mgpu.h | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -I. $< -o $@ $(LDLIBS) -ldl
$(B)/test_mpi: tests/test_mpi.c $(HEADERS) | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -I. $< -o $@ $(LDLIBS)
$(B)/train_mpi_cuda: examples/train.c mgpu.h $(B)/mgpu_kernels.o | $(B)
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -DMGPU_CUDA -I. $< $(B)/mgpu_kernels.o -o $@ $(CUDA_LIBS) $(LDLIBS)
$(B)/train_mpi_emu: examples/train.c mgpu.h $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -DMGPU_CUDA -I. $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) -Wl,-rpath,'$$ORIGIN/emu' -lmgpuemu -lstdc++ -ldl $(LDLIBS)
# (NCCL groups of at most 4 calls, so that zero1's broadcasts take several groups: tests/mpi.sh runs
# it with the emulated NCCL refusing more, MGPU_EMU_NCCL_GROUP_OPS=4)
$(EMU_DIR)/test_mpi: tests/test_mpi.c $(HEADERS) $(EMU_DIR)/mgpu_kernels.o $(EMU_DIR)/libmgpuemu.so
	$(MPICC) $(WARN) $(CFLAGS) -DMGPU_MPI -DMGPU_CUDA -DMGPU_NCCL_GROUP_OPS=4 -I. $< $(EMU_DIR)/mgpu_kernels.o -o $@ -L$(EMU_DIR) $(EMU_LINK) $(LDLIBS)
mpi: $(MPI_BINS)

# Issue 12's CPU-only suites, outside TESTS (no CUDA or emulated builds of them): the public API
# misused (test_misuse, also under ASan+UBSan) and every host allocation failing in turn
# (test_alloc_faults, under ASan+UBSan as well); issue 37's every MGPU_* setting in every form
# (test_settings).
RELIABILITY_TESTS = $(B)/test_misuse $(B)/test_misuse_asan $(B)/test_alloc_faults $(B)/test_alloc_faults_asan \
                    $(B)/test_platform $(B)/test_platform_asan $(B)/test_settings $(B)/test_settings_asan

# After the TSan and fuzz sections: a rule's prerequisites are expanded where it is read, so
# TSAN_BINS and FUZZ_BINS must be defined above it. Order matters a little: test_io writes the
# file interop.sh reads back in Python.
test-build: compile-check test-cpu test-cuda $(B)/interop $(B)/bn_torch $(B)/resnet $(B)/gru $(B)/train $(B)/train_plain $(B)/gpt $(EMU_DIR)/gpt $(EXAMPLES:%=$(B)/%) $(if $(HAVE_CBLAS),$(B)/test_core_cblas) $(EMU_BINS) \
      $(B)/test_save_faults $(RELIABILITY_TESTS) $(if $(HAVE_CLANG),$(TESTS:%=$(B)/%_clang)) $(TSAN_BINS) $(FUZZ_BINS) $(MPI_BINS)
# The build runs as a make of its own, with a job per core (JOBS=1 for one at a time); the tests
# then run one after another, but for those that tests/together.sh runs two at a time (each keeps
# about one core busy: the GPT demo, the Windows and aarch64 builds; tests/emu/run.sh's suites).
# CI gives it all 90 minutes: tests/run_all.sh prints the seconds each took.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test:
	@$(MAKE) --no-print-directory -j$(JOBS) test-build
	@sh tests/run_all.sh $(TESTS:%=$(B)/%) $(TESTS:%=$(B)/%_asan) $(CLANG_TESTS) $(CBLAS_TEST) $(if $(NVCC),$(TESTS:%=$(B)/%_cuda)) \
	    "sh tests/examples.sh $(B)" "sh tests/readme_commands.sh $(B)" "sh tests/interop.sh $(B)" "sh tests/bn_torch.sh $(B)" "sh tests/gpt_hf.sh $(B)" "sh tests/demo.sh $(B)/train" "sh tests/emu/run.sh $(B)" \
	    "sh tests/train_flags.sh $(B)/train" "sh tests/course.sh $(B) $(DATA)" \
	    "sh tests/pipeline.sh $(B) $(DATA)" "sh tests/plain_build.sh $(B) $(DATA)" \
	    "sh tests/mpi.sh $(B) $(DATA)" "sh tests/cluster.sh $(B) $(DATA)" \
	    "sh tests/together.sh sh tests/gpt_demo.sh $(B) + sh tests/windows.sh $(B) $(DATA) + sh tests/aarch64.sh $(B) $(DATA)" \
	    $(B)/test_save_faults $(RELIABILITY_TESTS) \
	    "sh tests/tsan.sh $(B) $(DATA)" "sh tests/fuzz/run.sh $(B) 30"

# ---- the main job ----------------------------------------------------------------------------
# On Debian the data is one package away; elsewhere build/train says where to get it.
DATA ?= /usr/share/datasets/fashion-mnist
MODEL ?= mlp
# EMU=N: on N emulated GPUs (tests/emu), to watch the multi-GPU path without a GPU, slowly:
#   make demo EMU=4 DEVICES=cuda:0,1,2,3 MAX_STEPS=200
DEVICES ?=
MAX_STEPS ?=
DEMO_BIN = $(if $(EMU),$(B)/train_emu,$(B)/train)
demo: $(DEMO_BIN) $(if $(EMU),$(EMU_DIR)/libnccl_emu.so)
	@if [ ! -e $(DATA)/train-images-idx3-ubyte.gz ] && [ "$(DATA)" = /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null; then \
	  echo "Fashion-MNIST is missing: installing Debian's dataset-fashion-mnist"; \
	  $$( [ "$$(id -u)" -ne 0 ] && echo sudo ) apt-get install -y -qq dataset-fashion-mnist || \
	  { $$( [ "$$(id -u)" -ne 0 ] && echo sudo ) apt-get update -qq && $$( [ "$$(id -u)" -ne 0 ] && echo sudo ) apt-get install -y -qq dataset-fashion-mnist; }; fi
	$(if $(EMU),MGPU_EMU_DEVICES=$(EMU) MGPU_NCCL_LIBRARY=$(abspath $(EMU_DIR))/libnccl_emu.so )$(DEMO_BIN) --data $(DATA) --model $(MODEL) \
	    $(if $(DEVICES),--devices $(DEVICES)) $(if $(MAX_STEPS),--max-steps $(MAX_STEPS)) --save $(B)/fashion_$(MODEL)$(if $(EMU),_emu$(EMU)).safetensors

# ---- benchmarks, side by side with PyTorch (bench/run.sh writes bench/results/) ---------------
$(B)/bench: bench/bench.c mgpu.h | $(B)
	$(CC) $(WARN) $(CFLAGS) -I. $< -o $@ $(LDLIBS) -ldl
$(B)/bench_plain: bench/bench.c mgpu.h | $(B)
	$(CC) $(WARN) -O2 -I. $< -o $@ $(LDLIBS) -ldl

$(B)/bench_cuda: bench/bench.c mgpu.h $(B)/mgpu_kernels.o | $(B)
	$(CC) $(WARN) $(CFLAGS) -DMGPU_CUDA -I. $< $(B)/mgpu_kernels.o -o $@ $(CUDA_LIBS) $(LDLIBS)

# then what a training step asks of the GPUs (launches, syncs, allocations, bytes), on 1 and 4
# emulated GPUs: the shape of a step, which sets its speed at these sizes on a real GPU
bench: $(if $(NVCC),$(B)/bench_cuda,$(B)/bench) $(B)/bench_plain $(EMU_DIR)/bench $(EMU_DIR)/libnccl_emu.so $(if $(HAVE_MPI),$(B)/bench_mpi)
	sh bench/run.sh $<
	MGPU_EMU_DEVICES=4 MGPU_NCCL_LIBRARY=$(abspath $(EMU_DIR))/libnccl_emu.so $(EMU_DIR)/bench emu

# ---- on a machine with a GPU -----------------------------------------------------------------
GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '.')
gpu-check:
	@test -n "$(GPU_CC)" || { echo "gpu-check: no GPU found (nvidia-smi)"; exit 1; }
	$(MAKE) B=$(B)/gpu ARCH="-gencode arch=compute_$(GPU_CC),code=[sm_$(GPU_CC),compute_$(GPU_CC)]" \
	    test-cuda $(B)/gpu/train_cuda $(B)/gpu/data_parallel_cuda $(B)/gpu/bench_cuda $(B)/gpu/gpt_cuda $(B)/gpu/resnet_cuda
	sh tests/gpu_check.sh $(B)/gpu

clean:
	rm -rf $(B)
