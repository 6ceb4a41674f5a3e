/* mgpu.h - train neural networks on one or many GPUs (or the CPU) from plain C.
   An stb-style single-header library. MIT license (or public domain), see the end of the file.

   ---------------------------------------------------------------------------------------------
   BUILDING
   ---------------------------------------------------------------------------------------------
   In exactly ONE C or C++ file:

       #define MGPU_IMPLEMENTATION
       #include "mgpu.h"

   Every other file includes "mgpu.h" without the macro and sees only the declarations.

   CPU only (no CUDA needed anywhere on the machine):

       cc -std=c99 -O2 prog.c -lm -lpthread

   With CUDA: compile the companion file mgpu_kernels.cu once with nvcc, define MGPU_CUDA in the
   file that holds the implementation, and link cudart and cuBLAS:

       nvcc -O3 -arch=sm_90 -c mgpu_kernels.cu -o mgpu_kernels.o
       cc -std=c99 -O2 -DMGPU_CUDA prog.c mgpu_kernels.o -lcudart -lcublas -lstdc++ -lm -lpthread -ldl

   Such a binary runs on any machine: with no GPU (or no driver) the device spec "auto" falls back
   to the CPU with a one-line notice. NCCL, when used, is loaded at run time with dlopen.

   Windows: MinGW-w64 (x86_64-w64-mingw32-gcc -std=c99 -O2 prog.c) or MSVC (cl /O2 prog.c); the
   implementation calls Win32 there (threads, clock, files), so no pthreads library is needed.
   With CUDA on Windows, nvcc compiles mgpu_kernels.cu with MSVC; NCCL does not exist there (the
   P2P and host all-reduce serve). macOS and aarch64 Linux build as on x86-64 Linux. The table of
   docs/platforms.md says what has been compiled and run on each.

   A job of several processes (mpirun, srun): build with mpicc and MGPU_MPI, with or without CUDA:

       mpicc -std=c99 -O2 -DMGPU_MPI prog.c -lm -lpthread       then: mpirun -np 4 ./a.out

   ---------------------------------------------------------------------------------------------
   CONFIGURATION MACROS (define before including the implementation)
   ---------------------------------------------------------------------------------------------
   MGPU_IMPLEMENTATION   emit the implementation in this translation unit
   MGPU_STATIC           make every public function static (private to that translation unit)
   MGPU_CUDA             call the CUDA backend in mgpu_kernels.cu (link it)
   MGPU_MALLOC(sz), MGPU_REALLOC(p,sz), MGPU_FREE(p)
                         host allocator; define all three or none
   MGPU_NO_THREADS       single-threaded CPU backend (no pthreads)
   MGPU_CBLAS            CPU GEMMs by cblas_sgemm (OpenBLAS, BLIS, MKL: include path and -l of
                         yours); the bits may then depend on the BLAS's own thread count
   MGPU_MPI              jobs of several processes over MPI (mgpu_dist_init, >>parallel): build
                         with mpicc; without it nothing needs MPI
   MGPU_NO_CPU_DISPATCH  keep the portable GEMM kernel and pooling loop: on x86 built without
                         -mavx2 -mfma (a plain cc -O2), instead of choosing the AVX2+FMA ones at
                         run time where the CPU has them (GCC, Clang, MSVC; the same bits as a
                         -march=native build then); on aarch64, instead of the NEON kernel (which
                         gives the bits of x86's AVX2 one)

   ---------------------------------------------------------------------------------------------
   QUICK START (the gist of examples/tour.c, the complete program, which CI builds and runs)
   ---------------------------------------------------------------------------------------------
       mgpu_device_set* set = mgpu_device_set_create("auto");   // every GPU, or the CPU
       mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(784, 128), mgpu_layer_relu(),
                                mgpu_layer_linear(128, 10) };
       mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){
           .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set });
       mgpu_optimizer* opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){
           .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f });
       mgpu_dataset* data = mgpu_dataset_load_idx("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz");
       mgpu_loader* loader = mgpu_loader_create(data, &(mgpu_loader_desc){
           .batch = 64, .shuffle = 1, .mean = 0.2860f, .std = 0.3530f });
       const mgpu_tensor *x, *y;
       float loss;
       mgpu_loader_start(loader, 0);                                  // epoch 0
       while (mgpu_loader_next(loader, &x, &y))                       // x, y on the CPU
           if (mgpu_model_train_step(model, opt, x, y, &loss) != MGPU_OK)   // split, compute,
               return fprintf(stderr, "%s\n", mgpu_last_error()), 1;        // reduce, update
       mgpu_model_save(model, opt, "model.safetensors");   // PyTorch's state_dict names
       // then destroy in reverse: loader, data, opt, model (it owns the layers), set

   Functions that create something return it, or NULL with mgpu_last_error() saying why.
   Functions that do something return an mgpu_result (MGPU_OK is 0); mgpu_result_string names it.
   Every *_desc struct is zero-initialised and zero means default: the table above each one says
   what the defaults are. One destroy per create; destroying NULL does nothing; destroying what
   something still uses is refused (LIFETIMES).

   ---------------------------------------------------------------------------------------------
   CONCEPTS
   ---------------------------------------------------------------------------------------------
   device        The CPU, or a share of one CUDA GPU with its own compute stream, cuBLAS handle
                 and caching allocator ("cuda:0,0" makes two devices on GPU 0).
   device spec   A string naming a set of devices: "auto" (every GPU, or the CPU when there is
                 none), "cpu", "cpu:4" (four CPU devices), "cuda" (every GPU), "cuda:0,1",
                 "cuda:0,0" (two on GPU 0, to try multi-GPU code on one GPU).
   replica       One whole copy of a model on one device of its set (or on S devices: stages).
                 Data parallelism trains R replicas on R slices of every batch and keeps them
                 bit-identical.
   stage         A run of consecutive layers on a device of its own: a pipeline of S stages
                 passes each micro-batch's activations forward and their gradients back
                 (model parallelism, for a model too big for one device).
   flat buffers  A replica's parameters are views into ONE buffer, and so are its gradients:
                 one all-reduce (or a few buckets), one fused optimizer kernel, one write to save.
   streams       On a GPU, every op of a device is queued on its compute stream and returns at
                 once; a communication stream per replica carries the all-reduce, ordered after
                 backward by events, never by the host waiting. Downloads, losses read back and
                 mgpu_device_synchronize wait for the device.
   all-reduce    Summing a buffer across replicas so that each ends with the sum. The backend
                 is who sums (NCCL, P2P or HOST, chosen once per model); the algorithm is how
                 (P2P's one-shot kernel or ring, chosen per call by size and peer access).
   bucket        A range of the flat gradient buffer, all-reduced as soon as backward has
                 produced it while backward goes on with earlier layers (DDP's gradient buckets).
   rank          One process of a job of several (MGPU_MPI: mpirun, srun), with devices of its
                 own; a distributed model is one data-parallel job over every rank's replicas.
   five moves    replicate, split, compute, reduce, update: one training step (>>train).
   NaN, Inf      never hidden: every op propagates them as PyTorch's does (relu(NaN) = NaN;
                 MaxPool2d, argmax and accuracy take a NaN; a NaN norm is not clipped to a
                 finite one). desc.check_finite (>>model) refuses a step whose loss or
                 gradients hold one, naming the step, and leaves the model as it was.
   suspect       A model whose step failed after it began to change state (replicas, stages or
                 optimizer states may differ): steps and saves refuse with MGPU_ERROR_DIVERGED
                 until mgpu_model_resync (replica 0 to the others) or a load; a step that fails
                 before it changed anything leaves the model as it was (mgpu_model_suspect).

   ---------------------------------------------------------------------------------------------
   LIFETIMES
   ---------------------------------------------------------------------------------------------
   One rule: destroying an object that something still uses fails with MGPU_ERROR_IN_USE, a
   last error naming what uses it ("mgpu_device_set_destroy: 1 model and 3 tensors still use
   this device set"), and changes nothing; destroy the users first, then try again. What counts:
     device set    tensors on its devices (a model's and an optimizer's own among them; not
                   those on mgpu_device_cpu(), a set's CPU device too, which outlives every
                   set), models, communicators (mgpu_allreduce_create)
     model         optimizers made for it
     dataset       loaders reading it
     tokens        data sets made from them (mgpu_dataset_tokens)
     layer         the model that owns it: a layer passed to mgpu_model_create belongs to that
                   model, which destroys it; the same layer twice in one model, or a layer of
                   another model, makes mgpu_model_create fail (the layers it could own are
                   destroyed, the other model's are left alone)
     tensor        a tensor the library owns (a model's views, an optimizer's state, a loader's
                   batch) is destroyed by its owner, never by mgpu_tensor_destroy
   These destroy functions return mgpu_result so that a refusal is seen; ignoring it leaks the
   object, it never frees memory still in use. Objects without users (optimizer, loader,
   communicator, safetensors file) keep destroy functions that return nothing; they report a
   refusal through mgpu_last_error() and the log callback.
   Destroyed twice: device sets, models, optimizers, communicators, loaders and safetensors
   files are listed while they live (by address, never read after their destroy), so a second
   destroy, a model or optimizer made on a destroyed set or model, or a destroyed model or
   optimizer given to a training step (train_step, accumulate, apply, evaluate,
   mgpu_optimizer_step) or to mgpu_optimizer_last_grad_norm, fails with
   MGPU_ERROR_INVALID_ARGUMENT ("... is not a live model (destroyed already?)"), unless a new
   object of the same kind took the old address meanwhile.
   Other calls do not look a handle up: using a destroyed one there is undefined. Tensors,
   layers, data sets and tokens are too many or too plain to list: destroying one twice is
   undefined, as free() twice is.

   ---------------------------------------------------------------------------------------------
   ENVIRONMENT
   ---------------------------------------------------------------------------------------------
   Read one way (docs/guide.md's table has each one's range): surrounding spaces ignored, empty
   is the default; a number is decimal, in its range (beyond: the nearest end), not inf or nan; a
   flag is 0/1, true/false, on/off, yes/no in any case; anything else warns on stderr (or the log
   callback), naming the variable, the value and what is used instead, and the job goes on.
   MGPU_DEVICES=spec          what "auto" means (e.g. cpu:4 to try data parallelism on a laptop)
   MGPU_ALLREDUCE=nccl|p2p|host|auto   the all-reduce backend, where the model asks for AUTO
   MGPU_P2P=ring|oneshot|auto     force one P2P algorithm
   MGPU_CPU_THREADS=N         threads of the CPU backend, 1..256 (default, or 0: every core)
   MGPU_CPU_SPIN_US=N         how long the CPU backend's idle threads watch for the next job
                              before they sleep, 0..1000000 (default 1000; 0 sleeps at once, for
                              a machine shared with other busy programs: OpenMP's
                              OMP_WAIT_POLICY=passive)
   MGPU_NCCL_LIBRARY=path     the NCCL library to load (default libnccl.so.2, then libnccl.so)
   MGPU_DIST_TIMEOUT=S        seconds a collective of a job of several processes waits for the
                              other ranks before it names those that did not answer and ends the
                              job (MPI_Abort) (default 300; 0 waits forever, as MPI does; at least
                              1, at most 1e9)
   MGPU_DETERMINISTIC=1       NCCL pinned to a fixed summation order: mgpu sets NCCL_ALGO=Ring and
                              NCCL_PROTO=Simple (unless already set) before its NCCL communicators;
                              also done for a model with verify_every (see >>parallel); a flag
                              (1, true, on, yes; 0, false, off, no)

   ---------------------------------------------------------------------------------------------
   THREADS
   ---------------------------------------------------------------------------------------------
   - The last error is per thread.
   - A tensor (with its views), a model, an optimizer, a loader or a communicator is used by one
     thread at a time; different models may train on different threads.
   - Tensors on one device may be created and destroyed from several threads (its allocator
     locks).
   - Pinning NCCL (MGPU_DETERMINISTIC=1 or verify_every) calls setenv when the communicator is
     made: make such models before starting threads of your own that read the environment.
   - Call mgpu_cpu_set_threads and mgpu_log_set_callback before the work starts. The callback
     may run on the library's worker threads (a CPU replica's failure is reported there).
   - MPI: the library calls it from the thread that calls it (mgpu_dist_init asks for
     MPI_THREAD_SERIALIZED), on a communicator of its own, except SyncBatchNorm's exchange
     (desc.sync_batch_norm), made by one of the step's own threads while the caller waits: one
     thread at a time, which MPI_THREAD_SERIALIZED allows (such a model is refused below it). A
     distributed model's calls are collective: every rank makes them, in the same order.
   - The CPU backend has one pool of threads; a call that finds it busy runs on its caller's
     thread alone (so CPU replicas, one thread each, never deadlock). A child of fork() starts
     a fresh pool for its CPU work; fork while no other thread is inside an mgpu call. (CUDA
     cannot be used in a child forked after it started.)
   - CUDA: a call that runs kernels makes their device current (cudaSetDevice) and does not
     restore the caller's; set your own device again before your own CUDA calls (for a kernel
     of your own, mgpu_cuda_begin does: >>ops). Inside a training step (train_step,
     accumulate, apply) the library remembers the device it made current last, and forgets it
     after a custom layer's code or the log callback ran (either may change it).

   ---------------------------------------------------------------------------------------------
   DOES NOT (yet)
   ---------------------------------------------------------------------------------------------
   - autograd everywhere: a model is a sequence of layers (nn.Sequential); a layer of your own
     either writes its backward (examples/custom_layer.c) or is made of tape ops and has it
     derived (>>autograd, examples/gru.c: its forward recomputed in backward). Built-ins: Linear
     (also without a bias, and Hugging Face's Conv1D), ReLU, GELU (exact, and GPT-2's tanh form), Tanh, Sigmoid, Dropout, Flatten,
     Conv2d, MaxPool2d, BatchNorm2d, global average pooling, and for GPT-2 LayerNorm, Embedding,
     PositionEmbedding and CausalSelfAttention (its GPU kernels fused up to a head size of 64,
     FlashAttention-2's way but on CUDA cores: no tensor-core or cuDNN attention yet);
     containers (Sequential, Residual) make blocks of them. Buffers (BatchNorm's running
     statistics) are per replica, copied from replica 0 after each step (also a CUDA graph's); desc.sync_batch_norm takes the statistics across
     replicas instead (no pipeline across processes with it).
   - other precisions: training is float32 (u8 and i32 for data and labels; TF32 GEMMs on ask),
     or bf16 mixed precision (desc.precision), where Conv2d, attention, pooling, normalisation,
     Dropout and the embeddings compute in f32 on widened bf16 inputs (no bf16 kernels of their
     own yet: bf16's numbers, not its speed), and layers of your own have no bf16 path; no fp16.
   - tensor parallelism: a layer is never split across devices (pipelines split the model
     between layers: >>model).
   - overlap of the sums across processes with backward through MPI (CPU replicas), or for a
     pipeline: those sum after backward, after the ranks' vote. (GPUs with NCCL across the job
     and one stage overlap their buckets' sums with backward, as in one process.)
   - strided tensors, more than 4 dimensions, GPUs other than NVIDIA's.
   - a CUDA graph of a step with a custom layer of the vtable (one made of tape ops is held),
     with NCCL across the GPUs of one process, with desc.check_finite or desc.sync_batch_norm, or
     for mgpu_model_accumulate and mgpu_model_apply: those steps run eagerly.
   - files bigger than memory: the safetensors reader and loader read the whole file at once.

   ---------------------------------------------------------------------------------------------
   Messages: a message longer than mgpu_last_error()'s 1,024 bytes (a 100 kB device spec, a path
   of 5,000 bytes) loses its middle ("..."), never its end: the op and the reason survive.

   ---------------------------------------------------------------------------------------------
   CONTENTS (grep for the tag; declarations and implementation follow the same order)
   ---------------------------------------------------------------------------------------------
   >>config      version, MGPUDEF, allocator and assert overrides
   >>result      result codes, last error, logger
   >>threads     (implementation only) the CPU backend's thread pool: parallel_for, parallel_range;
                 the one parser of the MGPU_* settings
   >>device      CPU and CUDA devices, device sets from spec strings, streams, synchronisation,
                 each device's counters of its work (rows, copies, all-reduces, waits)
   >>memory      caching allocator statistics, empty_cache, pinned host memory
   >>tensor      shapes, dtypes, tensors, views, copies between any two devices
   >>random      counter-based Philox RNG, identical on CPU and GPU
   >>ops         elementwise, matmul, bias, reductions, softmax, cross-entropy, argmax; kernels
                 of your own (a CPU loop on the pool, a CUDA kernel on a device's stream)
   >>layer       layers (a small vtable) and the built-ins: Linear, activations, Dropout, Conv2d, ...;
                 >>layer transformer: LayerNorm, Embedding, PositionEmbedding, CausalSelfAttention;
                 containers (Sequential, Residual), names, calling a layer from a layer
   >>autograd    a tape of ops (exp ... matmul, softmax, gather, where, dropout, losses)
                 differentiated in reverse mode; layers made of ops with no backward written
   >>parallel    all-reduce across devices: NCCL, peer-to-peer ring, host
   >>model       models with flat parameter/gradient buffers, replicas, forward/backward
   >>optim       SGD and AdamW over the flat buffer, learning-rate schedules, weight-decay groups,
                 clipping by global norm
   >>train       the data-parallel step in five moves: split, compute, reduce, update; evaluate
   >>io          safetensors checkpoints (whole or part, with metadata), a safetensors reader,
                 IDX data sets, token files (llm.c's) and a byte tokenizer, a shuffling batch
                 loader of images or token windows
   >>seam        the interface between mgpu.h and mgpu_kernels.cu, and the math both share
   >>impl        the implementation (same order as above)
   >>license
*/
#ifndef MGPU_H
#define MGPU_H

/* The implementation uses POSIX threads, sysconf and clock_gettime; ask for them before any
   system header is read (a user who includes system headers first can pass -D_POSIX_C_SOURCE).
   On macOS, _POSIX_C_SOURCE alone hides the core count and memory size of sysconf: ask for
   Darwin's own names too. Windows has none of these: the implementation calls Win32 there. */
#if defined(MGPU_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_WIN32)
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(MGPU_IMPLEMENTATION) && defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE 1
#endif
/* MSVC: the standard C calls (fopen, getenv, strerror, strcpy) without its "deprecated" warnings */
#if defined(MGPU_IMPLEMENTATION) && defined(_MSC_VER) && !defined(_CRT_SECURE_NO_WARNINGS)
#define _CRT_SECURE_NO_WARNINGS 1
#endif
/* MinGW: its own C99 printf family (%zu, %lld), not the old msvcrt.dll's */
#if defined(MGPU_IMPLEMENTATION) && defined(__MINGW32__) && !defined(__USE_MINGW_ANSI_STDIO)
#define __USE_MINGW_ANSI_STDIO 1
#endif

/* ============================================================================================ */
/* >>config                                                                                     */
/* ============================================================================================ */
#define MGPU_VERSION_MAJOR 0
#define MGPU_VERSION_MINOR 1
#define MGPU_VERSION_PATCH 0
#define MGPU_VERSION_STRING "0.1.0"

#include <stddef.h>
#include <stdint.h>

#ifndef MGPUDEF
#ifdef MGPU_STATIC
#define MGPUDEF static
#else
#define MGPUDEF extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================ */
/* >>result                                                                                     */
/* ============================================================================================ */
/* One list makes the enum and its strings. Codes are never renumbered; new ones go at the end. */
#define MGPU_RESULT_LIST(X)                                                    \
    X(MGPU_OK,                     0, "ok")                                    \
    X(MGPU_ERROR_INVALID_ARGUMENT, 1, "invalid argument")                      \
    X(MGPU_ERROR_SHAPE_MISMATCH,   2, "shape mismatch")                        \
    X(MGPU_ERROR_DTYPE_MISMATCH,   3, "dtype mismatch")                        \
    X(MGPU_ERROR_DEVICE_MISMATCH,  4, "device mismatch")                       \
    X(MGPU_ERROR_OUT_OF_MEMORY,    5, "out of memory")                         \
    X(MGPU_ERROR_NO_DEVICE,        6, "no such device")                        \
    X(MGPU_ERROR_CUDA,             7, "CUDA error")                            \
    X(MGPU_ERROR_CUBLAS,           8, "cuBLAS error")                          \
    X(MGPU_ERROR_NCCL,             9, "NCCL error")                            \
    X(MGPU_ERROR_IO,              10, "I/O error")                             \
    X(MGPU_ERROR_BAD_FILE,        11, "malformed file")                        \
    X(MGPU_ERROR_UNSUPPORTED,     12, "not supported")                         \
    X(MGPU_ERROR_DIVERGED,        13, "replicas diverged")                     \
    X(MGPU_ERROR_IN_USE,          14, "still in use")                         \
    X(MGPU_ERROR_MPI,             15, "MPI error")

typedef enum mgpu_result {
#define MGPU__ENUM_ITEM(name, value, text) name = value,
    MGPU_RESULT_LIST(MGPU__ENUM_ITEM)
#undef MGPU__ENUM_ITEM
    MGPU_RESULT_COUNT_
} mgpu_result;

MGPUDEF const char* mgpu_result_string(mgpu_result r);
/* The detailed message of the last failure on this thread: the operation, the shapes, dtypes and
   devices involved and, for backend failures, the CUDA/cuBLAS/NCCL error name. "" when none. */
MGPUDEF const char* mgpu_last_error(void);
MGPUDEF mgpu_result mgpu_last_result(void);
MGPUDEF void mgpu_clear_error(void);
/* Record a failure of your own code (a custom layer's forward, say) as mgpu's own failures are
   recorded: sets this thread's last error to the formatted message and result r, tells the log
   callback, and returns r, so a layer can `return mgpu_fail(MGPU_ERROR_UNSUPPORTED, "...")`. The
   model then reports that code and message behind where it happened ("mgpu_model_forward: layer 3
   (MyLayer): ..."); a layer that fails without a message is named as having given none. */
MGPUDEF mgpu_result mgpu_fail(mgpu_result r, const char* fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

typedef enum mgpu_log_level { MGPU_LOG_ERROR = 0, MGPU_LOG_WARN = 1, MGPU_LOG_INFO = 2 } mgpu_log_level;
typedef void (*mgpu_log_fn)(mgpu_log_level level, const char* message, void* user);
/* Default: warnings and notices go to stderr as "mgpu: ..."; failures are returned, not printed.
   A callback set here receives failures too. NULL restores the default. */
MGPUDEF void mgpu_log_set_callback(mgpu_log_fn fn, void* user);

/* Seconds on a monotonic clock (for timing steps and throughput). */
MGPUDEF double mgpu_seconds(void);

/* ============================================================================================ */
/* >>device                                                                                     */
/* ============================================================================================ */
typedef enum mgpu_device_kind { MGPU_DEVICE_CPU = 0, MGPU_DEVICE_CUDA = 1 } mgpu_device_kind;

/* A device: the CPU, or one replica on a CUDA GPU ("cuda:0,0" makes two replicas on GPU 0, each
   with its own stream and allocator). Owned by the device set that made it (or by the library,
   for mgpu_device_cpu()). */
typedef struct mgpu_device mgpu_device;
typedef struct mgpu_device_set mgpu_device_set;

typedef struct mgpu_device_info {
    mgpu_device_kind kind;
    int ordinal;            /* CUDA device number; 0 for the CPU */
    int replica;            /* index of this device within its set */
    char name[128];         /* "NVIDIA H100 80GB HBM3" or "cpu" */
    char label[32];         /* "cuda:0", "cuda:0#1" (second replica on GPU 0), "cpu", "cpu#2" */
    size_t total_memory;    /* bytes; the host's physical memory for the CPU (0 if unknown) */
    size_t free_memory;
    int compute_major, compute_minor; /* 0 for the CPU */
    int multiprocessors;    /* SMs, or CPU threads used by the CPU backend */
} mgpu_device_info;

/* Spec strings: "auto" (every GPU, or the CPU when there is none; MGPU_DEVICES overrides it),
   "cpu", "cpu:N" (N CPU replicas), "cuda" (every GPU), "cuda:0,1", "cuda:0,0,0,0" (four
   replicas on one GPU). NULL means "auto". */
MGPUDEF mgpu_device_set* mgpu_device_set_create(const char* spec);
/* MGPU_ERROR_IN_USE, changing nothing, while tensors, models or communicators use its devices. */
MGPUDEF mgpu_result mgpu_device_set_destroy(mgpu_device_set* set);
MGPUDEF int mgpu_device_set_count(const mgpu_device_set* set);
MGPUDEF mgpu_device* mgpu_device_set_get(const mgpu_device_set* set, int index);
MGPUDEF const char* mgpu_device_set_spec(const mgpu_device_set* set); /* as resolved: "cuda:0,1" */

MGPUDEF mgpu_device* mgpu_device_cpu(void);          /* the library's CPU device; never NULL */
MGPUDEF int mgpu_cuda_device_count(void);            /* 0 when built without CUDA or no GPU */
MGPUDEF mgpu_result mgpu_device_get_info(const mgpu_device* dev, mgpu_device_info* info);
MGPUDEF mgpu_device_kind mgpu_device_kind_of(const mgpu_device* dev);
MGPUDEF const char* mgpu_device_label(const mgpu_device* dev);
/* 1 when a can read and write b's memory directly (same GPU, or peer access possible). */
MGPUDEF int mgpu_device_can_access_peer(const mgpu_device* a, const mgpu_device* b);
MGPUDEF mgpu_result mgpu_device_synchronize(mgpu_device* dev);
/* Threads the CPU backend uses for GEMM and large elementwise ops (default: all cores). */
MGPUDEF void mgpu_cpu_set_threads(int n);
MGPUDEF int mgpu_cpu_threads(void);
/* Allow TF32 tensor-core math in float32 GEMMs on this device (default off, as in PyTorch). */
MGPUDEF mgpu_result mgpu_device_allow_tf32(mgpu_device* dev, int allow);

/* What a device has done since it was made (or since mgpu_device_reset_counters), to see each
   replica's share of the work. Counted by the thread that queues the work, never by waiting for
   the device: cheap enough to be always on. A counter belongs to a device, not to a model: all
   that runs there counts (on cpu:N, device 0 is mgpu_device_cpu(), where a program's own CPU
   tensors live too). A CUDA graph's launch (a model's `graph` steps) counts what its capture
   queued: the ops, rows, copies and all-reduces of the eager step. */
typedef struct mgpu_device_counters {
    uint64_t rows_forward;      /* batch rows run forward here: train steps, accumulate, evaluate
                                   (each stage of a pipeline counts the rows it ran) */
    uint64_t rows_backward;     /* batch rows run backward here */
    uint64_t ops;               /* ops queued: kernels on a GPU, parallel loops on the CPU */
    uint64_t bytes_host_to_device;   /* copied in from host memory: uploads, a GPU replica's rows
                                        of the batch (CPU replicas read them in place) */
    uint64_t bytes_device_to_host;   /* copied out to host memory: downloads, losses read back */
    uint64_t bytes_device_to_device; /* copied in from another device: a pipeline's activations,
                                        mgpu_tensor_copy between devices (a loader made with
                                        shard_for gives cpu#1, cpu#2, ... their rows so) */
    uint64_t bytes_allreduced;  /* this device's share of every all-reduce it took part in: a
                                   step of R > 1 replicas adds the gradient buffer's bytes */
    uint64_t host_waits;        /* times the host waited for this device (0 on the CPU, whose
                                   ops are done when they return) */
    uint64_t allocs;            /* tensor memory handed out by its allocator (cached or new) */
} mgpu_device_counters;
MGPUDEF mgpu_result mgpu_device_get_counters(const mgpu_device* dev, mgpu_device_counters* counters);
MGPUDEF void mgpu_device_reset_counters(mgpu_device* dev);

/* ============================================================================================ */
/* >>memory                                                                                     */
/* ============================================================================================ */
typedef struct mgpu_memory_stats {
    size_t bytes_in_use;        /* held by live tensors (rounded block sizes), and on a GPU by
                                   cuBLAS's workspace (32 MiB) */
    size_t bytes_reserved;      /* in use plus cached, obtained from the backend */
    size_t peak_bytes_in_use;
    uint64_t backend_allocs;    /* cudaMalloc / malloc calls made by the allocator */
    uint64_t backend_frees;
    uint64_t cache_hits;        /* allocations served from the cache */
} mgpu_memory_stats;

MGPUDEF mgpu_result mgpu_memory_get_stats(const mgpu_device* dev, mgpu_memory_stats* stats);
MGPUDEF void mgpu_memory_reset_peak(mgpu_device* dev);
/* Give every cached, unused block back to the backend (torch.cuda.empty_cache). */
MGPUDEF mgpu_result mgpu_memory_empty_cache(mgpu_device* dev);
/* Page-locked host memory for fast, asynchronous transfers (plain memory without CUDA). */
MGPUDEF void* mgpu_pinned_alloc(size_t bytes);
MGPUDEF void mgpu_pinned_free(void* ptr);

/* ============================================================================================ */
/* >>tensor                                                                                     */
/* ============================================================================================ */
/* MGPU_BF16 is bfloat16 (PyTorch's torch.bfloat16): a float's upper 16 bits, its range with 8
   bits of precision. mgpu stores, copies, fills, converts (mgpu_tensor_convert, rounding to
   nearest even) and reads it; mgpu_matmul, the elementwise ops (add ... sigmoid_backward),
   mgpu_bias_add and mgpu_bias_backward take it, computing in float; the other ops compute in F32
   and refuse other dtypes by name. */
typedef enum mgpu_dtype { MGPU_F32 = 0, MGPU_I32 = 1, MGPU_U8 = 2, MGPU_BF16 = 3 } mgpu_dtype;
#define MGPU_MAX_DIMS 4

typedef struct mgpu_shape {
    int ndim;                       /* 0..4; 0 is a scalar of one element */
    int64_t dim[MGPU_MAX_DIMS];
} mgpu_shape;

MGPUDEF mgpu_shape mgpu_shape1(int64_t d0);
MGPUDEF mgpu_shape mgpu_shape2(int64_t d0, int64_t d1);
MGPUDEF mgpu_shape mgpu_shape3(int64_t d0, int64_t d1, int64_t d2);
MGPUDEF mgpu_shape mgpu_shape4(int64_t d0, int64_t d1, int64_t d2, int64_t d3);
MGPUDEF int64_t mgpu_shape_numel(mgpu_shape s);   /* -1 for a shape no tensor can have (a
                                                      negative dimension, a count past int64) */
MGPUDEF int mgpu_shape_equal(mgpu_shape a, mgpu_shape b);
MGPUDEF size_t mgpu_dtype_size(mgpu_dtype dt);
MGPUDEF const char* mgpu_dtype_name(mgpu_dtype dt);   /* "f32", "i32", "u8", "bf16" */
/* A bfloat16's bits from a float, rounded to nearest even (as .to(torch.bfloat16); a NaN stays a
   NaN), and back (exact): for reading and writing MGPU_BF16 tensors' host copies. */
MGPUDEF uint16_t mgpu_bf16_from_float(float x);
MGPUDEF float mgpu_bf16_to_float(uint16_t bits);

/* A contiguous, row-major array on one device. Views share their parent's storage (which lives
   until the last tensor on it is destroyed), so they may be destroyed in any order. */
typedef struct mgpu_tensor mgpu_tensor;

MGPUDEF mgpu_tensor* mgpu_tensor_create(mgpu_device* dev, mgpu_dtype dt, mgpu_shape shape);
/* MGPU_ERROR_IN_USE, changing nothing, for a tensor the library owns (a model's parameter views,
   an optimizer's state, a loader's batch). */
MGPUDEF mgpu_result mgpu_tensor_destroy(mgpu_tensor* t);
/* Rows [start, start+count) of dimension 0: a batch slice, without a copy. */
MGPUDEF mgpu_tensor* mgpu_tensor_view_rows(mgpu_tensor* t, int64_t start, int64_t count);
/* The same storage seen with another shape of the same element count (like torch.view). */
MGPUDEF mgpu_tensor* mgpu_tensor_view_reshape(mgpu_tensor* t, mgpu_shape shape);

MGPUDEF mgpu_shape mgpu_tensor_shape(const mgpu_tensor* t);
/* Negative i counts from the end; -1 (with mgpu_last_error() saying why) for a NULL tensor or a
   dimension it does not have. */
MGPUDEF int64_t mgpu_tensor_dim(const mgpu_tensor* t, int i);
MGPUDEF int64_t mgpu_tensor_numel(const mgpu_tensor* t);
MGPUDEF size_t mgpu_tensor_bytes(const mgpu_tensor* t);
MGPUDEF mgpu_dtype mgpu_tensor_dtype(const mgpu_tensor* t);
MGPUDEF mgpu_device* mgpu_tensor_device(const mgpu_tensor* t);
/* The raw pointer: host memory for the CPU, device memory for CUDA. */
MGPUDEF void* mgpu_tensor_data(const mgpu_tensor* t);
/* "f32[64,784]@cuda:0", written into buf (at least 64 bytes is plenty). */
MGPUDEF const char* mgpu_tensor_describe(const mgpu_tensor* t, char* buf, size_t size);

/* Host <-> tensor. bytes must equal mgpu_tensor_bytes(t). Both wait for the copy to finish. */
MGPUDEF mgpu_result mgpu_tensor_upload(mgpu_tensor* t, const void* host, size_t bytes);
MGPUDEF mgpu_result mgpu_tensor_download(const mgpu_tensor* t, void* host, size_t bytes);
/* Any device to any device (peer copy between GPUs, staged through the host without peer
   access). Shapes' element counts and dtypes must match. Between two GPUs, and from the CPU to
   a GPU, it does not wait for the copy: the devices' streams are ordered instead, so every later
   op on either device sees it done (download syncs; a raw pointer read by your own CUDA code
   wants mgpu_device_synchronize first). From the CPU, src's bytes are first put in one of the
   GPU's pinned staging buffers, so src may change as soon as the call returns (PyTorch's
   pin_memory and non_blocking=True in one); the call waits only when the GPU is so far behind
   that every staging buffer is still being read. */
MGPUDEF mgpu_result mgpu_tensor_copy(mgpu_tensor* dst, const mgpu_tensor* src);
/* A new tensor on dev with src's contents (like .to(device) in PyTorch). */
MGPUDEF mgpu_tensor* mgpu_tensor_to(const mgpu_tensor* src, mgpu_device* dev);
MGPUDEF mgpu_result mgpu_tensor_fill(mgpu_tensor* t, double value);
MGPUDEF mgpu_result mgpu_tensor_zero(mgpu_tensor* t);
/* Convert between dtypes: dst = src * scale + shift (e.g. u8 pixels to f32 in [0,1]), each value
   through a float: with scale 1 and shift 0 exact where the float and dst hold the value (-0
   stays -0; every u8 and bf16, i32 up to 2^24), and f32 to bf16 rounds to nearest even, as
   .to(torch.bfloat16). */
MGPUDEF mgpu_result mgpu_tensor_convert(mgpu_tensor* dst, const mgpu_tensor* src, float scale, float shift);

/* ============================================================================================ */
/* >>random                                                                                     */
/* ============================================================================================ */
/* Philox4x32-10. Element i of a call draws from counter (offset + i/4) under key seed, so the
   same (seed, offset) gives the same numbers on the CPU and on any GPU, whatever the launch
   shape. A tensor of n elements uses offsets [offset, offset + ceil(n/4)); mgpu_rand_offsets(n)
   says how many to advance so the next call draws fresh numbers. */
MGPUDEF mgpu_result mgpu_rand_uniform(mgpu_tensor* t, uint64_t seed, uint64_t offset, float low, float high);
MGPUDEF mgpu_result mgpu_rand_normal(mgpu_tensor* t, uint64_t seed, uint64_t offset, float mean, float std);
MGPUDEF uint64_t mgpu_rand_offsets(int64_t n);

/* ============================================================================================ */
/* >>ops                                                                                        */
/* ============================================================================================ */
/* Every op checks that its tensors are float32 (unless said otherwise), share one device, and
   have matching shapes; out may alias an input in the elementwise ops. One device means one:
   two CPU devices of a set ("cpu:2") are refused as two GPUs are (MGPU_ERROR_DEVICE_MISMATCH,
   "mgpu_add: 'b' f32[4]@cpu#1 and 'a' f32[4]@cpu are on different devices"), although both are
   host memory, so that a program tried on "cpu:N" fails where it would on "cuda:0,1"; move a
   tensor first (mgpu_tensor_copy, mgpu_tensor_to). Deliberate exceptions, inside the library
   only: the all-reduce of CPU replicas sums their buffers in place across devices (as NCCL and
   P2P read other GPUs'), and a step lends a CPU replica its rows of a batch that is on another
   CPU device without a copy (a GPU gets a copy). */
/* Elementwise: every tensor of a call f32, or every one bf16 (computed in float from the
   widened values, each result rounded once to nearest even; bf16 out is the f32 op's result
   rounded, bit for bit). out may be an input (in place). */
MGPUDEF mgpu_result mgpu_add(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF mgpu_result mgpu_sub(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF mgpu_result mgpu_mul(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF mgpu_result mgpu_scale(mgpu_tensor* out, const mgpu_tensor* x, float alpha);
MGPUDEF mgpu_result mgpu_axpy(mgpu_tensor* y, float alpha, const mgpu_tensor* x); /* y += alpha*x */
MGPUDEF mgpu_result mgpu_relu(mgpu_tensor* out, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_gelu(mgpu_tensor* out, const mgpu_tensor* x);     /* exact (erf) GELU */
/* GELU's tanh form (nn.GELU(approximate='tanh'), GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
MGPUDEF mgpu_result mgpu_gelu_tanh(mgpu_tensor* out, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_tanh(mgpu_tensor* out, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_sigmoid(mgpu_tensor* out, const mgpu_tensor* x);
/* Gradients: relu and both gelus take the forward input x; tanh and sigmoid take the forward output y.
   NaN and Inf propagate as in PyTorch: relu(NaN) = NaN; relu's gradient is 0 where x <= 0, else dy
   (so dy where x is NaN, torch's threshold_backward); MaxPool2d takes a NaN in its window. */
MGPUDEF mgpu_result mgpu_relu_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_gelu_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_gelu_tanh_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x);
MGPUDEF mgpu_result mgpu_tanh_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* y);
MGPUDEF mgpu_result mgpu_sigmoid_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* y);

/* out = alpha * op(a) @ op(b) + beta * out, op(x) = x (MGPU_NO_TRANS) or x^T (MGPU_TRANS), as
   BLAS's CblasNoTrans/CblasTrans and cuBLAS's CUBLAS_OP_N/T; a, b, out are 2-D, and out must not
   share memory with a or b. (With beta == 0, out's old contents are ignored, NaNs included.)
   A Linear layer's forward is mgpu_matmul(y, x, w, MGPU_NO_TRANS, MGPU_TRANS, 1, 0): y = x w^T.
   a and b are both F32 or both BF16; with BF16 the products are exact and summed in fp32
   (cuBLAS's GemmEx with CUBLAS_COMPUTE_32F; on the CPU the operands are widened to f32 first:
   the reference, not a speed-up), and out is F32 or BF16 (the fp32 result rounded once). */
typedef enum mgpu_transpose { MGPU_NO_TRANS = 0, MGPU_TRANS = 1 } mgpu_transpose;
MGPUDEF mgpu_result mgpu_matmul(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b,
                                mgpu_transpose transpose_a, mgpu_transpose transpose_b, float alpha, float beta);
/* out[r, c] = x[r, c] + bias[c] for x [rows, cols]; also x [N, C, H, W] with bias [C]. x and out
   each f32 or bf16 (in float, rounded once into a bf16 out: an f32 GEMM result plus its bias
   into bf16, as cuBLASLt's bias epilogue), bias f32. */
MGPUDEF mgpu_result mgpu_bias_add(mgpu_tensor* out, const mgpu_tensor* x, const mgpu_tensor* bias);
/* The bias gradient: dbias[c] = sum of dy over every dimension but the channel one (1); dy f32
   or bf16, summed in float into f32 dbias. */
MGPUDEF mgpu_result mgpu_bias_backward(mgpu_tensor* dbias, const mgpu_tensor* dy);
/* x 2-D [rows, cols]. axis 0: out [cols] (sum down each column); axis 1: out [rows]. */
MGPUDEF mgpu_result mgpu_sum(mgpu_tensor* out, const mgpu_tensor* x, int axis);
MGPUDEF mgpu_result mgpu_mean(mgpu_tensor* out, const mgpu_tensor* x, int axis);
/* Softmax over the last dimension of a 2-D tensor. */
MGPUDEF mgpu_result mgpu_softmax(mgpu_tensor* out, const mgpu_tensor* x);
/* Mean softmax cross-entropy of logits [rows, classes] against int32 labels [rows]; loss is an
   f32 tensor of one element (on the same device, so no sync). dlogits, when not NULL, receives
   (softmax - onehot) * grad_scale; grad_scale 0 means 1/rows, the gradient of the mean.
   A label of MGPU_IGNORE_INDEX (-1, nanoGPT's ignore_index) is no target: its row adds nothing to
   the loss, its gradient row is 0, and the mean is over the other rows (grad_scale 0 means 1 over
   their count; 0 when every row is ignored, where PyTorch gives NaN). Any other label outside
   [0, classes): on the CPU an error naming the row; on a GPU (which cannot check without a sync)
   the loss and that row's gradient become NaN. */
#define MGPU_IGNORE_INDEX (-1)
MGPUDEF mgpu_result mgpu_softmax_cross_entropy(mgpu_tensor* loss, mgpu_tensor* dlogits,
                                               const mgpu_tensor* logits, const mgpu_tensor* labels,
                                               float grad_scale);
/* Mean squared error (mean over every element), like nn.MSELoss. */
MGPUDEF mgpu_result mgpu_mse(mgpu_tensor* loss, mgpu_tensor* dpred, const mgpu_tensor* pred,
                             const mgpu_tensor* target, float grad_scale);
/* int32 out [rows] = index of the largest value in each row of x [rows, cols] (first on ties; a
   NaN counts as the largest, the first NaN wins, as torch.argmax). */
MGPUDEF mgpu_result mgpu_argmax(mgpu_tensor* out, const mgpu_tensor* x);
/* How many rows of logits have their argmax equal to the int32 label (waits for the result).
   A row labelled MGPU_IGNORE_INDEX never counts; any other label outside [0, classes) is an
   error on the CPU, and on a GPU its row counts as wrong. */
MGPUDEF mgpu_result mgpu_count_correct(const mgpu_tensor* logits, const mgpu_tensor* labels, int64_t* count);

/* Dropout as an op: mask[i] is 0 (dropped, probability p) or 1/(1-p); out = x * mask. The mask
   comes from Philox (seed, offset), so CPU and GPU drop the same elements. */
MGPUDEF mgpu_result mgpu_dropout(mgpu_tensor* out, mgpu_tensor* mask, const mgpu_tensor* x, float p,
                                 uint64_t seed, uint64_t offset);

/* ---- kernels of your own: an op mgpu lacks, written for the CPU and for CUDA ----
   (examples/course/09_sin.c and its 09_sin_kernel.cu, lesson 09 of docs/course.) Four pieces,
   not a vtable of ops: your CUDA kernel stays a plain .cu file, compiled by nvcc beside
   mgpu_kernels.cu and launched with <<< >>> as in any CUDA tutorial, and all it needs from mgpu is
   the device pointers (mgpu_tensor_data), its GPU made current and the one stream every op of
   that device runs on. Launched there, it runs after the ops queued before it and before those
   queued after (and a download waits for it), with no wait on the host, as mgpu's own kernels
   do. On the CPU, your loop runs over slices of the tensor on the thread pool of mgpu's CPU ops.
   Such an op works in a custom layer's forward and backward too (>>layer).

       if ((r = mgpu_tensor_check("my_sin", "x", x, MGPU_F32, NULL, NULL)) != MGPU_OK ||
           (r = mgpu_tensor_check("my_sin", "y", y, MGPU_F32, "x", x)) != MGPU_OK) return r;
       if (mgpu_device_kind_of(mgpu_tensor_device(x)) == MGPU_DEVICE_CPU)
           return mgpu_cpu_parallel(mgpu_tensor_device(x), n, 0, sin_slice, &job);
       if ((r = mgpu_cuda_begin(mgpu_tensor_device(x), &stream)) != MGPU_OK) return r;
       sin_launch(stream, mgpu_tensor_data(x), mgpu_tensor_data(y), n);   // yours, in the .cu
       return mgpu_cuda_end(mgpu_tensor_device(x), "sin_kernel");

   The checks of mgpu's own ops, for yours: t is not NULL and has dtype dt; with like (named
   like_name), t is also on like's device (exactly: two CPU devices of a set are refused, as
   two GPUs are) and has like's shape. On failure the last error names op, the tensor and what is wrong with it
   (MGPU_ERROR_INVALID_ARGUMENT, _DTYPE_MISMATCH, _DEVICE_MISMATCH or _SHAPE_MISMATCH). */
MGPUDEF mgpu_result mgpu_tensor_check(const char* op, const char* name, const mgpu_tensor* t, mgpu_dtype dt,
                                      const char* like_name, const mgpu_tensor* like);
/* fn(user, begin, end) for slices [begin, end) that cover [0, n) once, on the CPU backend's
   threads (MGPU_CPU_THREADS, mgpu_cpu_set_threads), several at once: each slice is yours alone,
   so write only its own elements. Returns when every slice is done. grain: the fewest elements
   worth a thread of their own (0: 32768, what mgpu's elementwise ops use); below 2 x grain, one
   slice on the caller's thread. dev must be a CPU device: a GPU tensor's data is GPU memory, which
   the host cannot touch (MGPU_ERROR_DEVICE_MISMATCH). */
typedef void (*mgpu_cpu_range_fn)(void* user, int64_t begin, int64_t end);
MGPUDEF mgpu_result mgpu_cpu_parallel(mgpu_device* dev, int64_t n, int64_t grain, mgpu_cpu_range_fn fn, void* user);
/* Before your launch: makes dev's GPU current on this thread (cudaSetDevice, which CUDA wants
   for a launch on that GPU's stream) and gives its compute stream, a cudaStream_t:
   kernel<<<grid, block, 0, (cudaStream_t)stream>>>(...). After it: mgpu_cuda_end checks the launch
   (cudaGetLastError, the same check as PyTorch's C10_CUDA_KERNEL_LAUNCH_CHECK) and fails with
   MGPU_ERROR_CUDA and the error's name ("mgpu_cuda_end on cuda:0: launch of sin_kernel ...
   cudaErrorInvalidValue ...", CUDA 13's for a block of 2048 threads) when it did not start;
   `kernel` names it there (NULL: "your kernel"). A fault while the kernel runs (a bad address)
   shows later, at the next call that waits for the GPU, as with any CUDA kernel. Both fail with
   MGPU_ERROR_DEVICE_MISMATCH on a CPU device (use mgpu_cpu_parallel there); a program built
   without MGPU_CUDA has only CPU devices. A launch of yours left unchecked (no mgpu_cuda_end) is
   not blamed on mgpu: the next mgpu call that finds its error pending fails saying so ("a CUDA
   error left pending by earlier work ..."), and clears it; in a training step, a custom layer's is
   that layer's error. */
MGPUDEF mgpu_result mgpu_cuda_begin(mgpu_device* dev, void** stream);
MGPUDEF mgpu_result mgpu_cuda_end(mgpu_device* dev, const char* kernel);

/* ============================================================================================ */
/* >>layer                                                                                      */
/* ============================================================================================ */
/* A layer is a description (sizes, hyper-parameters) plus a small vtable. It holds no tensors:
   a model keeps each replica's parameters, gradients and saved buffers and passes them in.
   Write your own by filling an mgpu_layer_vtable (see examples/custom_layer.c). */
typedef struct mgpu_layer mgpu_layer;

typedef struct mgpu_layer_ctx {
    mgpu_device* device;
    mgpu_tensor* const* params;  /* this layer's parameters (views into the model's flat buffer) */
    mgpu_tensor* const* grads;   /* their gradients: backward ADDS into them */
    mgpu_tensor* const* aux;     /* the buffers declared by aux_shape, kept from forward to backward */
    mgpu_tensor* const* buffers; /* this layer's buffers (buffer_shape: running statistics), views into
                                    the model's flat buffer of buffers; NULL for a layer without */
    int training;                /* 1 in a training forward pass */
    uint64_t seed, offset;       /* a fresh random stream for this layer and step */
    int64_t first_row;           /* this replica's first sample in the whole batch: draw random
                                    numbers by sample, and N replicas match one device */
    const uint64_t* seed_on_device;   /* NULL, or (while a step is captured as a CUDA graph) where
                                    the device holds `seed` at each replay of it: a GPU kernel
                                    that draws from seed reads it there (the built-in Dropout,
                                    CausalSelfAttention) */
    mgpu_tensor* const* params_bf16;  /* a model of precision MGPU_BF16: the parameters rounded to
                                    bf16 (each forward's copy, refreshed from params), what a
                                    layer computes with on bf16 activations; NULL otherwise */
} mgpu_layer_ctx;

typedef struct mgpu_layer_vtable {
    const char* type;   /* "Linear": the PyTorch class name, shown in summaries */
    /* y's shape for x's shape (dimension 0 is the batch). NULL: same as x. A shape of no tensor
       (a negative or zero dimension, more than MGPU_MAX_DIMS) fails mgpu_model_create, naming
       the layer. */
    mgpu_result (*output_shape)(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y);
    /* Parameters in PyTorch state_dict order ("weight", then "bias"). NULL: none. */
    int (*param_count)(const mgpu_layer* l);
    mgpu_result (*param_shape)(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape);
    /* Initial values; called once, on the first replica. NULL: zeros. */
    mgpu_result (*init)(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed);
    /* Buffers kept from forward to backward, for input shape x. NULL: none. */
    int (*aux_count)(const mgpu_layer* l);
    mgpu_result (*aux_shape)(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dtype, mgpu_shape* shape);
    mgpu_result (*forward)(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y);
    /* dx is NULL for the first layer (no input gradient needed). */
    mgpu_result (*backward)(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                            const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx);
    /* A short description of the configuration, e.g. "784 -> 128". NULL: none. */
    void (*describe)(const mgpu_layer* l, char* buf, size_t size);
    /* Frees the user data. NULL: nothing to free. */
    void (*destroy)(mgpu_layer* l);
    /* Buffers: state that is not trained (nn.Module's register_buffer: BatchNorm's running
       statistics), in state_dict order. A forward pass may change them (ctx->buffers); init
       sets their first values (or they stay 0). Never optimised, never all-reduced, no gradient;
       saved in checkpoints. NULL: none. */
    int (*buffer_count)(const mgpu_layer* l);
    mgpu_result (*buffer_shape)(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape);
} mgpu_layer_vtable;

/* A custom layer: vt must outlive it; user is handed back by mgpu_layer_user_data. */
MGPUDEF mgpu_layer* mgpu_layer_create(const mgpu_layer_vtable* vt, void* user);
MGPUDEF void* mgpu_layer_user_data(const mgpu_layer* l);
/* Names a layer's parameters, as a PyTorch module's attribute does: "transformer.wte" makes the
   Embedding's "transformer.wte.weight" instead of "0.weight" (its place in the model's or a
   container's list); "" gives its parameters' names as they are (a residual block whose f holds
   "ln_1" and "attn"). At most 47 bytes. Returns l; NULL (with l destroyed) for a bad name. */
MGPUDEF mgpu_layer* mgpu_layer_name(mgpu_layer* l, const char* name);
MGPUDEF const char* mgpu_layer_type(const mgpu_layer* l);
/* Only for a layer no model owns: MGPU_ERROR_IN_USE, changing nothing, for one a model owns. */
MGPUDEF mgpu_result mgpu_layer_destroy(mgpu_layer* l);

/* Built-in layers, named and initialised as in torch.nn. */
MGPUDEF mgpu_layer* mgpu_layer_linear(int in_features, int out_features);
/* nn.Linear(in, out, bias=False): "weight" alone (GPT-2's output head, lm_head). */
MGPUDEF mgpu_layer* mgpu_layer_linear_no_bias(int in_features, int out_features);
/* Hugging Face's Conv1D (GPT-2's c_attn, c_proj, c_fc): a Linear whose "weight" is stored
   [in, out] (y = x W + b), initialised as GPT-2 does (weight N(0, 0.02), bias 0), so that
   GPT2LMHeadModel's files load as they are. */
MGPUDEF mgpu_layer* mgpu_layer_conv1d(int in_features, int out_features);
/* ReLU, Tanh and Sigmoid take their gradient from their output; in a model, right after a Linear,
   Conv2d or BatchNorm2d (of the same pipeline stage) they write over its output, as
   nn.ReLU(inplace=True) would: that layer's backward does not read it. A model's activation
   gradients take turns in two buffers per stage, and with cross-entropy the loss's gradient
   is written over the model's output when the last layer's backward does not read it (a
   Linear's: the logits, as llm.c's fused classifier does). None of it changes a bit of the
   results; after a training step the output of its forward holds that gradient. */
MGPUDEF mgpu_layer* mgpu_layer_relu(void);
MGPUDEF mgpu_layer* mgpu_layer_gelu(void);
MGPUDEF mgpu_layer* mgpu_layer_tanh(void);
MGPUDEF mgpu_layer* mgpu_layer_sigmoid(void);
MGPUDEF mgpu_layer* mgpu_layer_dropout(float p);
MGPUDEF mgpu_layer* mgpu_layer_flatten(void);
MGPUDEF mgpu_layer* mgpu_layer_conv2d(int in_channels, int out_channels, int kernel_size, int stride, int padding);
MGPUDEF mgpu_layer* mgpu_layer_maxpool2d(int kernel_size, int stride);   /* stride 0: kernel_size */
/* nn.BatchNorm2d(channels) (eps 1e-5, momentum 0.1, affine) on x [N, channels, H, W]. Training:
   each channel normalised by its mean and biased variance over (N, H, W) of the batch (of this
   replica's, or micro-batch's, rows; of every replica's with the model desc's sync_batch_norm,
   as nn.SyncBatchNorm), y = (x - mean) / sqrt(var + eps) * weight + bias, and running_mean,
   running_var move 0.1 of the way to the batch's mean and UNBIASED variance,
   num_batches_tracked += 1, as PyTorch does. Evaluation: the running statistics. Parameters
   "weight" (ones), "bias" (zeros); buffers "running_mean" (zeros), "running_var" (ones),
   "num_batches_tracked" (0; kept as a float, exact to 2^24, written to a checkpoint as PyTorch's
   I64). Backward is training mode's. A CUDA graph holds its step (desc.graph), but not with
   sync_batch_norm, whose replicas meet on the host: those steps run eagerly. */
MGPUDEF mgpu_layer* mgpu_layer_batch_norm2d(int channels);
/* [N, C, H, W] -> [N, C], each the mean of its H x W plane: ResNet's AdaptiveAvgPool2d((1, 1))
   followed by flatten(1), in one layer (type "AdaptiveAvgPool2d"). */
MGPUDEF mgpu_layer* mgpu_layer_global_avg_pool2d(void);

/* >>layer transformer: the layers of a GPT, with GPT-2's names, shapes and initialisation. A
   GPT-2's input is Embedding (the tokens, wte) -> PositionEmbedding (wpe). */
/* nn.LayerNorm(dim) over the last dimension of x [batch, ..., dim]: each row is normalised by its
   mean and biased variance, y = (x - mean) / sqrt(var + 1e-5) * weight + bias (eps 1e-5, GPT-2's).
   "weight" [dim] starts at ones, "bias" [dim] at zeros. */
MGPUDEF mgpu_layer* mgpu_layer_layer_norm(int dim);
/* nn.Embedding(num_embeddings, dim): int32 ids [batch, ...] (1 to 3 dimensions) -> f32
   [batch, ..., dim], y[..., :] = weight[id, :]. "weight" [num_embeddings, dim] starts N(0, 0.02):
   GPT-2's initialisation, as Hugging Face's GPT2 does it (nn.Embedding's own default is N(0, 1)).
   An id outside [0, num_embeddings): on the CPU an error naming its position and value; on a GPU
   (which cannot check without a sync) that position's output row becomes NaN, as a bad label
   does in mgpu_softmax_cross_entropy, and backward skips it. Ids have no gradient: backward
   leaves dx untouched (a model passes NULL to its first layer). */
MGPUDEF mgpu_layer* mgpu_layer_embedding(int num_embeddings, int dim);
/* GPT-2's learned position embedding (wpe): x f32 [batch, T, dim] -> y = x + weight[t] at each
   position t < T; T may be at most max_positions (a shape error otherwise). "weight"
   [max_positions, dim] starts N(0, 0.02), as GPT-2's. Backward: dx = dy. */
MGPUDEF mgpu_layer* mgpu_layer_position_embedding(int max_positions, int dim);
/* nn.GELU(approximate='tanh'), GPT-2's GELU: mgpu_gelu_tanh (>>ops) as a layer, type "GELU". */
MGPUDEF mgpu_layer* mgpu_layer_gelu_tanh(void);
/* GPT-2's attention block (Hugging Face's GPT2Attention, nanoGPT's CausalSelfAttention) as one
   layer, type "CausalSelfAttention": x [batch, T, dim] (any T >= 1) -> [batch, T, dim].
       qkv = x c_attn.weight + c_attn.bias            q, k, v: columns [0,dim), [dim,2dim), [2dim,3dim);
                                                       head h: columns h*hs .. (h+1)*hs of each, hs = dim/heads
       att = softmax(q k^T / sqrt(hs)), key s > query t masked (-inf); attention dropout on att
       out = (att v, heads merged back to [batch, T, dim]) c_proj.weight + c_proj.bias; residual dropout
   Parameters "c_attn.weight" [dim, 3*dim], "c_attn.bias" [3*dim], "c_proj.weight" [dim, dim],
   "c_proj.bias" [dim], stored [in, out] as Hugging Face's Conv1D stores them (GPT2LMHeadModel's
   files load as they are; nanoGPT's nn.Linear holds the transpose), initialised as GPT-2: weights
   N(0, 0.02), biases 0. Both dropouts (probability
   `dropout`, only in training) draw from Philox as the Dropout layer does, by sample. dim % heads
   must be 0. No [batch, heads, T, T] matrix is kept: backward computes the probabilities again
   from q, k and each row's softmax denominator (FlashAttention's way; on a GPU fused kernels up to
   a head size of 64). */
MGPUDEF mgpu_layer* mgpu_layer_causal_self_attention(int dim, int heads, float dropout);
/* Containers, layers made of layers (a GPT block or a ResNet block is one entry of a model's
   list, so pipelines still cut between entries). Each takes its layers over, as a model does
   (even on failure: NULL, with the layers destroyed); destroying it destroys them.
     sequential  nn.Sequential: the layers in turn; parameters named "0.weight", "1.bias", ...
     residual    y = f(x) + x, or y = f(x) + shortcut(x) with a shortcut layer (a 1x1 Conv2d to
                 change the channels, ResNet's downsample); f's parameters keep their names
                 ("0.weight" for a sequential f), the shortcut's are "shortcut.weight", ...
   Their random streams (Dropout inside) are their own per child, and CUDA graphs hold them when
   every child is a built-in. */
MGPUDEF mgpu_layer* mgpu_layer_sequential(mgpu_layer* const* layers, int count);
MGPUDEF mgpu_layer* mgpu_layer_residual(mgpu_layer* f, mgpu_layer* shortcut /* NULL: the identity */);
/* Calling a layer from the code of a layer of your own (or a container): ctx is the child's, its
   params, grads and aux pointing at the child's share of yours (declare them in your
   param_count/param_shape and aux_count/aux_shape). Checks y's shape against the layer's
   output_shape; a failure names the layer ("Linear(4 -> 2): ..."). Backward wants the x and y of
   the forward: ReLU, Tanh and Sigmoid take their gradient from y. */
MGPUDEF mgpu_result mgpu_layer_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y);
MGPUDEF mgpu_result mgpu_layer_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                        const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx);

/* ============================================================================================ */
/* >>autograd                                                                                   */
/* ============================================================================================ */
/* Reverse-mode automatic differentiation, PyTorch's dynamic graph in C: a tape records the ops run
   through it, and mgpu_tape_backward walks them back, each op's backward rule in turn, into the
   gradients of the tensors you watch (torch.autograd.grad). A layer of your own can be written
   this way with no backward at all (mgpu_layer_from_ops, examples/gru.c).

       mgpu_tape* tape = mgpu_tape_create(dev);
       mgpu_tape_watch(tape, w);                               // w.requires_grad_()
       const mgpu_tensor* y = mgpu_tape_tanh(tape, mgpu_tape_matmul(tape, x, w, MGPU_NO_TRANS, MGPU_NO_TRANS));
       const mgpu_tensor* loss = mgpu_tape_mean(tape, mgpu_tape_mul(tape, y, y), MGPU_ALL_AXES, 0);
       if (mgpu_tape_backward(tape, loss, NULL) != MGPU_OK) ...   // an op's failure shows here
       const mgpu_tensor* dw = mgpu_tape_grad(tape, w);           // f32, w's shape
       mgpu_tape_destroy(tape);                                // and every tensor it made

   A tape lives on one device, and every op runs there at once (the ops' kernels, queued on its
   stream on a GPU). Each op returns an f32 tensor that the tape owns and frees when it is
   destroyed (a new one; reshape's is a view of its input): read it, pass it to more ops, copy it
   out, but do not write to it (the backward reads what the ops saw). An op that fails returns
   NULL and the tape keeps its error: every later op returns NULL too, and mgpu_tape_backward (or
   mgpu_tape_status) reports the first failure, naming its op, the shapes and the devices, so a
   forward of twenty lines checks once.
   Tensors that are not the tape's and not watched are constants (data, labels, masks). Watched
   tensors and constants must not change until backward: a change by mgpu's ops (>>ops), copies,
   uploads and fills to a tensor whose old values a backward rule reads (mul's operands, matmul's,
   log's input, ...) makes backward refuse, naming that op (PyTorch's check of in-place changes);
   writes of your own kernels, the optimizer's and through mgpu_tensor_data are not seen. The
   tensors an op read must outlive the backward that reads them.
   Broadcasting follows NumPy's and PyTorch's rule: shapes aligned at their last dimension, a
   dimension of 1 (or a missing one) stretched to the other's size. At most MGPU_MAX_DIMS (4)
   dimensions, f32 (ids and labels i32). */
typedef struct mgpu_tape mgpu_tape;
MGPUDEF mgpu_tape* mgpu_tape_create(mgpu_device* dev);
MGPUDEF void mgpu_tape_destroy(mgpu_tape* tape);
/* Ask for t's gradient (requires_grad): an f32 tensor on the tape's device, not one of its ops'. */
MGPUDEF mgpu_result mgpu_tape_watch(mgpu_tape* tape, const mgpu_tensor* t);
/* The first failure of an op on this tape (MGPU_OK when none), its message in mgpu_last_error(). */
MGPUDEF mgpu_result mgpu_tape_status(const mgpu_tape* tape);
/* Gradients of y (a tensor of the tape's ops) with respect to every watched tensor it depends on,
   given dy, y's gradient (y's shape; NULL: y has one element, and dy is 1, loss.backward()).
   Gradients add up over several calls, as .grad does in PyTorch; the tape's other gradients
   are freed as the walk leaves them. */
MGPUDEF mgpu_result mgpu_tape_backward(mgpu_tape* tape, const mgpu_tensor* y, const mgpu_tensor* dy);
/* The gradient of a watched tensor (the tape's, t's shape), or NULL: t is not watched (an error),
   or nothing backward reached depends on it (no error: its gradient is zero). */
MGPUDEF const mgpu_tensor* mgpu_tape_grad(mgpu_tape* tape, const mgpu_tensor* t);
/* A constant of the tape's own, every element `value`. */
MGPUDEF const mgpu_tensor* mgpu_tape_full(mgpu_tape* tape, mgpu_shape shape, float value);

/* ---- elementwise; derivatives as torch's (relu's is 0 at 0, abs's 0 at 0) ---- */
MGPUDEF const mgpu_tensor* mgpu_tape_exp(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_log(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_sqrt(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_rsqrt(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_tanh(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_sigmoid(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_relu(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_gelu(mgpu_tape* tape, const mgpu_tensor* x);        /* exact (erf) */
MGPUDEF const mgpu_tensor* mgpu_tape_gelu_tanh(mgpu_tape* tape, const mgpu_tensor* x);   /* GPT-2's */
MGPUDEF const mgpu_tensor* mgpu_tape_neg(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_abs(mgpu_tape* tape, const mgpu_tensor* x);
MGPUDEF const mgpu_tensor* mgpu_tape_pow(mgpu_tape* tape, const mgpu_tensor* x, float exponent);
MGPUDEF const mgpu_tensor* mgpu_tape_scale(mgpu_tape* tape, const mgpu_tensor* x, float alpha);       /* alpha x */
MGPUDEF const mgpu_tensor* mgpu_tape_add_scalar(mgpu_tape* tape, const mgpu_tensor* x, float alpha);  /* x + alpha */
/* Broadcasting binary ops. maximum and minimum give a tie's gradient to a (torch splits it). */
MGPUDEF const mgpu_tensor* mgpu_tape_add(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF const mgpu_tensor* mgpu_tape_sub(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF const mgpu_tensor* mgpu_tape_mul(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF const mgpu_tensor* mgpu_tape_div(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF const mgpu_tensor* mgpu_tape_maximum(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);
MGPUDEF const mgpu_tensor* mgpu_tape_minimum(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b);

/* ---- reductions along one axis (negative counts from the end) or every axis ---- */
#define MGPU_ALL_AXES 99
/* keepdim 1 keeps the axis with size 1; 0 drops it (every axis dropped: a tensor of 0 dimensions,
   one element). max's gradient is shared equally by tied maxima (torch.amax). */
MGPUDEF const mgpu_tensor* mgpu_tape_sum(mgpu_tape* tape, const mgpu_tensor* x, int axis, int keepdim);
MGPUDEF const mgpu_tensor* mgpu_tape_mean(mgpu_tape* tape, const mgpu_tensor* x, int axis, int keepdim);
MGPUDEF const mgpu_tensor* mgpu_tape_max(mgpu_tape* tape, const mgpu_tensor* x, int axis, int keepdim);
/* softmax and log-softmax along axis, made of the ops above (the max taken out first as a
   constant, as every stable softmax does); their backward is derived. */
MGPUDEF const mgpu_tensor* mgpu_tape_softmax(mgpu_tape* tape, const mgpu_tensor* x, int axis);
MGPUDEF const mgpu_tensor* mgpu_tape_log_softmax(mgpu_tape* tape, const mgpu_tensor* x, int axis);

/* ---- products and shapes ---- */
/* op(a) @ op(b) over the last two dimensions, with mgpu_matmul's transposes: 2-D [m, k] @ [k, n];
   batched, a [..., m, k] and b of the same leading dimensions (torch.bmm, each batch a GEMM);
   a [..., m, k] and b 2-D (a Linear's x @ W^T on [batch, T, in]: one GEMM); or a 2-D and b
   batched (each batch a GEMM with the same a). */
MGPUDEF const mgpu_tensor* mgpu_tape_matmul(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b,
                                            mgpu_transpose transpose_a, mgpu_transpose transpose_b);
MGPUDEF const mgpu_tensor* mgpu_tape_reshape(mgpu_tape* tape, const mgpu_tensor* x, mgpu_shape shape);
/* x.permute(perm): output dimension i is x's dimension perm[i] (x's ndim entries). */
MGPUDEF const mgpu_tensor* mgpu_tape_permute(mgpu_tape* tape, const mgpu_tensor* x, const int* perm);
MGPUDEF const mgpu_tensor* mgpu_tape_transpose(mgpu_tape* tape, const mgpu_tensor* x, int dim0, int dim1);
/* x.narrow(axis, start, length) as a new tensor, and torch.cat((a, b), axis). */
MGPUDEF const mgpu_tensor* mgpu_tape_slice(mgpu_tape* tape, const mgpu_tensor* x, int axis, int64_t start, int64_t length);
MGPUDEF const mgpu_tensor* mgpu_tape_concat(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b, int axis);
/* Rows of a table [n, dim] picked by int32 ids of any shape: [ids..., dim] (index_select,
   F.embedding); the gradient adds each id's rows back into the table's (scatter-add). An id
   outside [0, n) is handled as mgpu_layer_embedding's. */
MGPUDEF const mgpu_tensor* mgpu_tape_gather_rows(mgpu_tape* tape, const mgpu_tensor* table, const mgpu_tensor* ids);
/* Its opposite (index_add_, scatter-add): a table [rows, dim] of zeros with each row src[p, :] of
   src [ids..., dim] added into row ids[p] (in order of p, the same bits on the CPU and a GPU);
   the gradient of src is the gathered rows of dy. Ids outside [0, rows) as gather_rows's. */
MGPUDEF const mgpu_tensor* mgpu_tape_scatter_add_rows(mgpu_tape* tape, const mgpu_tensor* src, const mgpu_tensor* ids, int64_t rows);

/* masked_fill of the causal mask: x [..., queries, keys] with `value` (-INFINITY before a
   softmax) where key s comes after query t (s > t + keys - queries: the keys before the first
   query are all seen); its gradient passes dy where x went through, 0 elsewhere. */
MGPUDEF const mgpu_tensor* mgpu_tape_causal_mask(mgpu_tape* tape, const mgpu_tensor* x, float value);
/* torch.where(cond, a, b): a where cond is not 0, else b, the three shapes broadcast together
   (cond an f32 constant of 0s and 1s, such as a comparison's); the gradient goes to a where cond
   holds and to b elsewhere. */
MGPUDEF const mgpu_tensor* mgpu_tape_where(mgpu_tape* tape, const mgpu_tensor* cond, const mgpu_tensor* a, const mgpu_tensor* b);
/* nn.Dropout: each element kept with probability 1 - p and scaled by 1/(1-p), else 0 (Philox, as
   mgpu_dropout; by sample, so that replicas draw what one device would); the identity unless the
   tape is training. In a layer of ops the tape trains when the model does and draws from the
   layer's stream of the step (the recompute in backward draws the same masks); elsewhere: */
MGPUDEF const mgpu_tensor* mgpu_tape_dropout(mgpu_tape* tape, const mgpu_tensor* x, float p);
MGPUDEF mgpu_result mgpu_tape_set_training(mgpu_tape* tape, int training, uint64_t seed);

/* ---- losses: a tensor of 0 dimensions (one element) ---- */
/* mgpu_softmax_cross_entropy's mean over logits [rows, classes] and int32 labels [rows] */
MGPUDEF const mgpu_tensor* mgpu_tape_cross_entropy(mgpu_tape* tape, const mgpu_tensor* logits, const mgpu_tensor* labels);
MGPUDEF const mgpu_tensor* mgpu_tape_mse(mgpu_tape* tape, const mgpu_tensor* pred, const mgpu_tensor* target);

/* ---- a layer made of tape ops, with no backward written ----
   forward(user, tape, x, params) computes the layer's output from x and the parameters with the
   tape's ops and returns it (NULL: the tape's error is the layer's). The layer runs it in the
   model's forward and again in its backward, recording this time, and differentiates it: the
   recompute costs a forward more, and keeps nothing from forward to backward, so the layer
   works as any other under data parallelism, pipelines, micro-batches and checkpoints. A CUDA
   graph (desc.graph) holds its work, as it holds a built-in's: forward must run the same ops on
   every step of a batch shape (as torch.cuda.graphs asks), which a forward of tape ops does unless
   it reads the host's state. No bf16 path yet (it computes in f32). Parameters are initialised as
   their desc says: */
typedef enum mgpu_param_init {
    MGPU_INIT_ZEROS = 0,
    MGPU_INIT_ONES = 1,
    MGPU_INIT_UNIFORM = 2,   /* U(-s, s), s = init_scale or 1/sqrt(the last dimension): nn.Linear's
                                weight [out, in] and bias */
    MGPU_INIT_NORMAL = 3     /* N(0, s), s = init_scale or 0.02 (GPT-2's) */
} mgpu_param_init;
typedef struct mgpu_op_param_desc {
    const char* name;       /* state_dict name, "weight" (copied; at most 47 bytes) */
    mgpu_shape shape;
    mgpu_param_init init;
    float init_scale;       /* 0: the default above */
    int uniform_fan_in;     /* MGPU_INIT_UNIFORM's default scale from this fan-in instead (a bias [out]
                               of a weight [out, in] takes in, as nn.Linear's) */
} mgpu_op_param_desc;
typedef struct mgpu_op_layer_desc {
    const char* type;                         /* as summaries show it (copied); default "OpLayer" */
    const mgpu_op_param_desc* params;
    int param_count;                          /* at most 64 */
    const mgpu_tensor* (*forward)(void* user, mgpu_tape* tape, const mgpu_tensor* x, const mgpu_tensor* const* params);
    /* y's shape for x's (dimension 0 the batch); NULL: x's */
    mgpu_result (*output_shape)(void* user, mgpu_shape x, mgpu_shape* y);
    void* user;                               /* handed to forward and output_shape; yours to free */
} mgpu_op_layer_desc;
MGPUDEF mgpu_layer* mgpu_layer_from_ops(const mgpu_op_layer_desc* desc);


/* ============================================================================================ */
/* >>parallel                                                                                   */
/* ============================================================================================ */
/* Summing a tensor across the devices of a set (an all-reduce), the heart of data parallelism.
   Backends, chosen at run time:
     NCCL  libnccl.so.2 loaded with dlopen; distinct GPUs only (ncclCommInitAll).
     P2P   peer-to-peer, two algorithms. One-shot: a single kernel on replica 0's GPU reads every
           buffer and writes the sum into each; it serves every size when the replicas share one
           GPU (it moves the fewest bytes) and buffers up to 256 KiB across GPUs with peer access
           (one launch instead of 2R(R-1) copies and adds). Otherwise a ring: reduce-scatter with
           one add kernel per step reading the predecessor's chunk in place, all-gather with peer
           copies; where two GPUs cannot reach each other, the copies go through the host and a
           chunk lands in a buffer before its add. MGPU_P2P=ring|oneshot overrides the choice
           (oneshot only where replica 0's GPU reaches every replica's memory).
     HOST  CPU replicas: summed in shared memory by the thread pool. (For GPU replicas: staged
           through pinned host memory, the slow but simple reference.)
   AUTO picks HOST for CPU sets, NCCL for distinct GPUs when it loads, P2P otherwise; the
   environment variable MGPU_ALLREDUCE=nccl|p2p|host overrides AUTO. P2P and HOST sum in a fixed
   order, so all replicas get bit-identical results, run after run. NCCL gives every replica the
   same sum, but its order depends on the algorithm and protocol NCCL picks (tree, NVLS on H100,
   LL protocols), which may change with the size, the topology and the NCCL version: results may
   differ in the last bits from run to run. With MGPU_DETERMINISTIC=1, or a model whose
   verify_every is set, mgpu pins NCCL to its ring algorithm and Simple protocol (NCCL_ALGO=Ring,
   NCCL_PROTO=Simple in the environment, unless the user set them), which sum in a fixed order;
   NCCL reads them once per process, at its first communicator. */
typedef enum mgpu_allreduce_kind {
    MGPU_ALLREDUCE_AUTO = 0, MGPU_ALLREDUCE_NCCL = 1, MGPU_ALLREDUCE_P2P = 2, MGPU_ALLREDUCE_HOST = 3,
    MGPU_ALLREDUCE_NONE = 4,  /* one replica: nothing to reduce */
    MGPU_ALLREDUCE_MPI = 5    /* reported, not asked for: a job's sums across processes through MPI */
} mgpu_allreduce_kind;
MGPUDEF const char* mgpu_allreduce_name(mgpu_allreduce_kind kind);   /* "nccl", "p2p", "host", ... */

typedef struct mgpu_allreduce mgpu_allreduce;
/* A communicator over the devices of set (which must outlive it). */
MGPUDEF mgpu_allreduce* mgpu_allreduce_create(const mgpu_device_set* set, mgpu_allreduce_kind kind);
MGPUDEF void mgpu_allreduce_destroy(mgpu_allreduce* ar);
MGPUDEF mgpu_allreduce_kind mgpu_allreduce_backend(const mgpu_allreduce* ar);
/* The algorithm a sum of `bytes` per replica takes ("nccl", "oneshot", "ring", "host", "none";
   "reduce-scatter+all-gather" across processes through MPI, point to point),
   and the bytes it reads plus writes in the memory where it sums (device memory for P2P, host
   memory for HOST on CPU replicas), copies and sum kernels together; 0 where that is not one
   memory's figure (NCCL's internals, HOST staging GPU buffers through the host). For bandwidth
   figures. */
MGPUDEF const char* mgpu_allreduce_algorithm(const mgpu_allreduce* ar, size_t bytes);
MGPUDEF double mgpu_allreduce_memory_traffic(const mgpu_allreduce* ar, size_t bytes);
/* tensors[i] lives on device i of the set; all f32 with the same element count. Afterwards each
   holds the element-wise sum (in NCCL's terms, one ncclAllReduce per GPU inside a group). Ordered after earlier work on each device's stream, and before
   later work (it does not wait on the host). */
MGPUDEF mgpu_result mgpu_allreduce_sum(mgpu_allreduce* ar, mgpu_tensor* const* tensors, int count);

/* ---- processes: one job over many processes and machines (MPI) ---- */
/* A job of P processes (ranks), launched by mpirun or Slurm's srun, each driving its own devices:
   one process per GPU as PyTorch's DistributedDataParallel does, or several devices (or CPU
   replicas) per process. MPI launches the processes, finds them each other and sums the CPU
   buffers; NCCL sums GPU buffers. Built only with MGPU_MPI (compile with mpicc); without it these
   functions still exist and describe a job of one process, so one program serves both.

   mgpu_dist_init joins the job (MPI_Init, unless the program called it already) and learns the
   rank among all processes and among those on this machine (MPI's shared-memory split). From then
   on, "auto" and "cuda" mean this local rank's GPUs (one each when the machine has as many GPUs
   as ranks; a share of them otherwise) and the CPU backend takes cores / local ranks threads, unless
   MGPU_CPU_THREADS says otherwise. A model made with desc.distributed is one data-parallel job
   over every process's replicas (>>model). mgpu_dist_shutdown leaves it (MPI_Finalize, if
   mgpu_dist_init called MPI_Init); mgpu_dist_abort ends every process of the job at once
   (MPI_Abort): what a rank calls when it fails on its own, so that no other rank waits for it.
   A rank that stops answering (its host frozen, its link down) is no error to MPI; the library's
   collectives wait for it MGPU_DIST_TIMEOUT seconds (default 300), then name the collective, the
   step and the ranks that did not answer, and end the job (MPI_Abort). */
MGPUDEF mgpu_result mgpu_dist_init(int* argc, char*** argv);
MGPUDEF void mgpu_dist_shutdown(void);
MGPUDEF void mgpu_dist_abort(int exit_code);
MGPUDEF int mgpu_dist_rank(void);          /* 0 .. size-1; 0 without MPI */
MGPUDEF int mgpu_dist_size(void);          /* processes in the job; 1 without MPI */
MGPUDEF int mgpu_dist_local_rank(void);    /* among the processes on this machine */
MGPUDEF int mgpu_dist_local_size(void);
/* A communicator over the devices of set in EVERY process of the job: each process makes one
   over its own set (all of them, collectively) and mgpu_allreduce_sum then sums across all their
   devices (every rank calls it, with the same size): NCCL across GPUs where every rank can, else
   MPI, which adds in the order (rank 0's devices, rank 1's, ...), the order of one process. Every
   device of every process gets the same bits. Without a job of several processes it is
   mgpu_allreduce_create. */
MGPUDEF mgpu_allreduce* mgpu_allreduce_create_distributed(const mgpu_device_set* set, mgpu_allreduce_kind kind);

/* ============================================================================================ */
/* >>model                                                                                      */
/* ============================================================================================ */
/* A sequence of layers (nn.Sequential) on a device set. The set's devices hold R replicas of
   the model (data parallelism); each replica is cut into S consecutive stages, each stage on its
   own device (model parallelism: a pipeline), so the set has R x S devices, replica r's stage s
   on device r * S + s. S = 1 is the plain data-parallel model, R = 1 the plain pipeline. On each
   device the parameters of its stage are views into ONE flat buffer, and so are the gradients:
   the all-reduce is one call (or a few buckets), the optimizer one fused kernel per device.
   Buffers (state that is not trained: BatchNorm2d's running statistics) lie in a third flat
   buffer per device, of its stage's layers: never optimised, never all-reduced; each replica's
   forward passes update its own, and after every optimizer step replica 0's are copied to the
   other replicas (mgpu_model_buffer).

   A pipeline runs each batch as M micro-batches: stage s passes micro-batch k's activations to
   stage s+1 (a peer copy between GPUs, a copy between CPU devices) and gets their gradient back,
   so that the stages work at once on different micro-batches. Two schedules: GPipe (every
   forward, then every backward: M micro-batches' activations alive per stage) and 1F1B (after
   S - s warm-up forwards, one forward then one backward: at most S - s alive on stage s). Both
   add the micro-batches' gradients in the same order (0, 1, ...), so they give the same bits.
   On CPU devices those are the bits of the unsplit batch too: a gradient summed over micro-
   batches is one chain of additions per element, in the order of the whole batch (Conv2d: for
   micro-batches of a multiple of 8 images; Linear: for fewer than 8192 rows a replica, and not
   with MGPU_CBLAS). So R x S devices with any M give exactly what R devices give; on GPUs,
   cuBLAS promises no order, and results agree to rounding. */
typedef struct mgpu_model mgpu_model;

typedef enum mgpu_loss_kind { MGPU_LOSS_CROSS_ENTROPY = 0, MGPU_LOSS_MSE = 1 } mgpu_loss_kind;
/* Tied parameters (GPT-2's token embedding and output head): `param` is `to`, one parameter under
   two names, by their state_dict names ("5.weight" is "0.weight"), of one shape. `param` holds a
   copy of `to`'s values and gets its own gradient; each update adds it into `to`'s (and sets it to
   zero), moves `to` once and copies the result into `param`, so they may lie in different
   pipeline stages (GPT-2's embedding in the first, its head in the last). It starts as `to`
   (`param`'s layer's initialisation is overwritten), a load sets both, a checkpoint stores `to`
   alone (as Hugging Face's save_pretrained leaves lm_head.weight out), and the parameter counts
   once. Write its values through `to`: a write into `param` lasts until the next update. */
typedef struct mgpu_tie { const char* param; const char* to; } mgpu_tie;
typedef enum mgpu_pipeline_schedule { MGPU_PIPELINE_1F1B = 0, MGPU_PIPELINE_GPIPE = 1 } mgpu_pipeline_schedule;

/* mgpu_model_desc, zero-initialised; zero means default:
     field          default                       meaning
     input          (required)                    one sample's shape: shape1(784), shape3(1, 28, 28),
                                                  shape1(T) for a sequence of T token ids
     input_dtype    MGPU_F32                      or MGPU_I32: token ids, for a first layer that
                                                  takes them (Embedding); no input gradient then
     ties, tie_count NULL, 0                      tied parameters (mgpu_tie, above)
     layers         (required)                    owned by the model from here on, even on failure;
                                                  each distinct, and owned by no other model
     layer_count    (required)
     devices        NULL: the CPU                 one replica per device; must outlive the model
     loss           MGPU_LOSS_CROSS_ENTROPY       int32 labels, one per output row: [B] for an
                                                  output [B, classes], [B, T] for [B, T, vocab]
                                                  (a label per position); MGPU_IGNORE_INDEX labels
                                                  are no targets, and the loss is the mean over the
                                                  batch's other labels, however the batch is split
                                                  (replicas, micro-batches, processes), when the
                                                  labels are on the CPU (as loaders give them);
                                                  labels already on a GPU are not read by the host
                                                  (a step never waits): each part's mean is then
                                                  weighted by its positions, as DDP averages its
                                                  replicas' means (the same without ignored labels);
                                                  MGPU_LOSS_MSE takes f32 targets
     seed           0                             parameter initialisation and dropout
     allreduce      MGPU_ALLREDUCE_AUTO           the backend (MGPU_ALLREDUCE overrides AUTO)
     bucket_bytes   25 MiB (the first 1 MiB)      gradient bucket size (DDP's bucket_cap_mb)
     verify_every   0: never                      check replicas are identical every N steps
     stages         1                             S, pipeline stages per replica; the set holds R x S
     split          NULL: balanced by parameters  the first layer of stages 1 .. S-1, ascending
     micro_batches  1                             M, micro-batches per batch and replica (a batch
                                                  needs at least R x M rows; uneven splits give the
                                                  first micro-batches one row more)
     schedule       MGPU_PIPELINE_1F1B            or MGPU_PIPELINE_GPIPE
     distributed    0: this process only          1: one job over every process of mgpu_dist_init
                                                  (every rank creates it, collectively)
     graph          0: every step queued op by op 1: a training step on GPUs captured once as a
                                                  CUDA graph and replayed with one launch (>>train);
                                                  its AUTO all-reduce is P2P, which a graph holds
     check_finite   0: off (costs nothing)        1: before each update, the loss and every
                                                  gradient are checked for NaN and Inf; a step
                                                  with one fails (MGPU_ERROR_INVALID_ARGUMENT,
                                                  naming the step, counted from 1, and the loss
                                                  or the first such parameter's gradient) and
                                                  updates nothing: parameters and optimizer state
                                                  stay as before it (the gradients are kept for a
                                                  look). Costs a pass over the gradients and one
                                                  wait for the devices per step (the loss read
                                                  with the check); steps then run without a graph
     sync_batch_norm 0: each replica's own rows   1: SyncBatchNorm: in a training step, every
                                                  BatchNorm2d normalises by the statistics of the
                                                  whole batch, every replica's and process's rows
                                                  (and its backward takes the whole batch's two
                                                  sums), as nn.SyncBatchNorm; each micro-batch
                                                  still alone. The replicas meet twice per layer
                                                  and micro-batch (>>parallel meet): each part then
                                                  runs on a host thread of its own, and on GPUs
                                                  each meeting waits for the devices; across
                                                  processes a rank whose step fails ends the job
     precision      MGPU_F32                      MGPU_BF16: mixed precision, much as PyTorch's
                                                  bf16 autocast: the activations and their
                                                  gradients are bf16, GEMMs take bf16 operands and
                                                  sum in fp32, the weights used are bf16 copies of
                                                  the f32 parameters (made at each forward), while
                                                  the parameters, gradients (summed in fp32 into
                                                  them, where autocast rounds a layer's to bf16
                                                  first), biases (autocast rounds them), optimizer
                                                  states and checkpoints stay f32; the input is rounded
                                                  to bf16 at the first layer, the output widened
                                                  to f32 for the loss (and mgpu_model_forward),
                                                  the loss's gradient rounded back. Linear, Conv1D,
                                                  the activations, Flatten and the containers run
                                                  in bf16; Conv2d and CausalSelfAttention (with
                                                  their weights' bf16 copies), MaxPool2d,
                                                  BatchNorm2d, global pooling, Dropout, LayerNorm
                                                  and the embeddings run their f32 code on their
                                                  bf16 inputs widened, each output rounded once
                                                  (bf16's numbers, not yet its speed); layers of
                                                  your own fail mgpu_model_create, named

   A distributed model is R replicas in each process, all of them one data-parallel job, and it is
   made by every rank at once. Rank 0's parameters are broadcast to all; the layers must agree. In
   a step, each rank passes ITS rows of the global batch (a loader with shard_for gives them,
   DistributedSampler's way; the global batch is the sum of the ranks' rows): the gradients of all
   the job's replicas are summed in the order of the replicas (rank 0's, then rank 1's, ...), the
   order a single process with all of them sums in (through MPI: CPU replicas, or GPUs without
   NCCL; NCCL across GPUs sums in its own order), so the results do not depend on how replicas
   are spread over processes; every replica of every rank holds the same bits. A failure on
   one rank, in a step, at create, in a save, fails the call on every rank with that rank's
   message ("rank 1 of 4: ..."), never a hang. Saving: rank 0 writes, the others wait for it;
   every rank loads. Evaluation, forward and backward stay in their process. */
typedef struct mgpu_model_desc {
    mgpu_shape input;
    mgpu_layer** layers;
    int layer_count;
    const mgpu_device_set* devices;
    mgpu_loss_kind loss;
    uint64_t seed;
    mgpu_allreduce_kind allreduce;
    size_t bucket_bytes;
    int verify_every;
    int stages;
    const int* split;
    int micro_batches;
    mgpu_pipeline_schedule schedule;
    int distributed;
    int graph;
    mgpu_dtype input_dtype;
    const mgpu_tie* ties;
    int tie_count;
    int check_finite;
    int sync_batch_norm;
    mgpu_dtype precision;
} mgpu_model_desc;

MGPUDEF mgpu_model* mgpu_model_create(const mgpu_model_desc* desc);
/* Destroys its layers too; MGPU_ERROR_IN_USE, changing nothing, while optimizers use it. */
MGPUDEF mgpu_result mgpu_model_destroy(mgpu_model* m);
MGPUDEF int mgpu_model_replica_count(const mgpu_model* m);      /* R */
/* A distributed model's replicas in every process of the job, and the first one of this process
   among them (R and 0 otherwise). */
MGPUDEF int mgpu_model_total_replica_count(const mgpu_model* m);
MGPUDEF int mgpu_model_first_replica(const mgpu_model* m);
MGPUDEF int mgpu_model_stage_count(const mgpu_model* m);        /* S */
MGPUDEF int mgpu_model_micro_batches(const mgpu_model* m);      /* M */
MGPUDEF int mgpu_model_stage_first_layer(const mgpu_model* m, int stage);   /* stage S: the layer count */
/* The device of a replica's first stage (where its input goes), and of any stage. */
MGPUDEF mgpu_device* mgpu_model_device(const mgpu_model* m, int replica);
MGPUDEF mgpu_device* mgpu_model_stage_device(const mgpu_model* m, int replica, int stage);
MGPUDEF int64_t mgpu_model_param_count(const mgpu_model* m);     /* scalar parameters */
/* The backend in use; a distributed model's is the one that sums across the job: NCCL over every
   process's GPUs, or MPI (CPU replicas, or GPUs without NCCL). */
MGPUDEF mgpu_allreduce_kind mgpu_model_allreduce_backend(const mgpu_model* m);
MGPUDEF int mgpu_model_bucket_count(const mgpu_model* m);
/* The device memory one replica keeps for its training steps' activations (summed over its
   stages' devices, as blocks of the caching allocator): what its forward keeps for backward
   (the layers' outputs and saved buffers, a stage's input) and the gradient buffers backward
   writes, each buffer once (an in-place ReLU shares its Linear's, the loss gradient the logits'
   where it is written over them). Sized by the last step's batch; 0 before the first step. The
   gradients arrive in *gradient_bytes when not NULL. (torch.cuda.memory_allocated's growth over a
   first step, less the parameters' gradients, which mgpu holds from mgpu_model_create.) */
MGPUDEF size_t mgpu_model_activation_bytes(const mgpu_model* m, int replica, size_t* gradient_bytes);
/* The flat parameter and gradient buffers of one replica's stage (all of the model with one
   stage); mgpu_model_params and _grads are stage 0's, for models of one stage only. */
MGPUDEF mgpu_tensor* mgpu_model_stage_params(const mgpu_model* m, int replica, int stage);
MGPUDEF mgpu_tensor* mgpu_model_stage_grads(const mgpu_model* m, int replica, int stage);
MGPUDEF mgpu_tensor* mgpu_model_params(const mgpu_model* m, int replica);
MGPUDEF mgpu_tensor* mgpu_model_grads(const mgpu_model* m, int replica);
/* Named parameter views ("0.weight", "0.bias", "2.weight", ...) in state_dict order, then the
   buffers' ("1.running_mean", ...): tensors count - buffer_count and on are buffers, so a program
   tells them apart by index (mgpu_model_tensor_is_buffer). */
MGPUDEF int mgpu_model_tensor_count(const mgpu_model* m);
MGPUDEF int mgpu_model_buffer_count(const mgpu_model* m);
MGPUDEF int mgpu_model_tensor_is_buffer(const mgpu_model* m, int i);
MGPUDEF const char* mgpu_model_tensor_name(const mgpu_model* m, int i);
MGPUDEF mgpu_tensor* mgpu_model_tensor(const mgpu_model* m, int replica, int i);
/* Prints layers, output shapes and parameter counts (like torchsummary), and after a step the
   activation memory (mgpu_model_activation_bytes); to stdout if f is NULL. */
MGPUDEF void mgpu_model_summary(const mgpu_model* m, void* file /* FILE* */);

/* One parameter, or its gradient, by its state_dict name ("0.weight", "2.bias", ...) on one
   replica: a view into the flat buffer, owned by the model (do not destroy it). For a harness
   that compares a layer's gradients with PyTorch's without arithmetic on the flat buffer. NULL,
   with mgpu_last_error() naming the unknown name, when the model has no such parameter. */
MGPUDEF mgpu_tensor* mgpu_model_param(const mgpu_model* m, int replica, const char* name);
MGPUDEF mgpu_tensor* mgpu_model_grad(const mgpu_model* m, int replica, const char* name);
/* One buffer by its state_dict name ("1.running_mean") on one replica, likewise; and the flat
   buffer of buffers of a replica's stage (NULL with no error when the stage has none). Buffers
   are the same on every replica: after each optimizer step (mgpu_model_train_step,
   mgpu_model_apply) replica 0's are copied to the others (DDP's broadcast_buffers does it at the
   start of the next forward instead), and mgpu_model_verify_replicas compares them too. */
MGPUDEF mgpu_tensor* mgpu_model_buffer(const mgpu_model* m, int replica, const char* name);
MGPUDEF mgpu_tensor* mgpu_model_stage_buffers(const mgpu_model* m, int replica, int stage);

/* ============================================================================================ */
/* >>optim                                                                                      */
/* ============================================================================================ */
typedef enum mgpu_optimizer_kind { MGPU_SGD = 0, MGPU_ADAMW = 1 } mgpu_optimizer_kind;
typedef enum mgpu_schedule_kind { MGPU_SCHEDULE_CONSTANT = 0, MGPU_SCHEDULE_STEP = 1, MGPU_SCHEDULE_COSINE = 2 } mgpu_schedule_kind;

/* mgpu_optimizer_desc, zero-initialised; zero means default (PyTorch's defaults):
     field          default                       meaning
     kind           MGPU_SGD                      or MGPU_ADAMW
     lr             0.01 (SGD), 0.001 (AdamW)     the learning rate (before the schedule)
     weight_decay   0                             as given (PyTorch's AdamW default is 0.01: pass it)
     momentum       0                             SGD
     dampening      0                             SGD
     nesterov       0                             SGD; needs a momentum and no dampening
     beta1, beta2   0.9, 0.999                    AdamW (0 means default: ask 1e-9 for "zero")
     eps            1e-8                          AdamW
     schedule       MGPU_SCHEDULE_CONSTANT        or STEP (StepLR) or COSINE (CosineAnnealingLR)
     step_size      (required by STEP)            multiply lr by gamma every step_size steps
     gamma          0.1                           STEP
     total_steps    (required by COSINE)          steps from lr down to min_lr (T_max)
     min_lr         0                             COSINE (eta_min)
     decay_matrices_only  0                       1: weight_decay only on parameters of 2 or more
                                                  dimensions (nanoGPT's and llm.c's groups): none
                                                  on biases and LayerNorm weights (1-D); weight
                                                  matrices, convolution kernels and embeddings
                                                  (2-D, decayed as nanoGPT decays them) keep it
     no_decay       NULL                          state_dict names ("0.bias", "3.weight") of
     no_decay_count 0                             parameters without weight decay (with the rule
                                                  above or alone); an unknown name is refused
     clip_norm      0: off                        clip gradients by their global L2 norm before
                                                  each update (torch.nn.utils.clip_grad_norm_):
                                                  the norm over every gradient of the model (all
                                                  stages of a replica, every tensor; replicas hold
                                                  the same reduced gradients, so one replica's is
                                                  the norm), and above clip_norm each gradient is
                                                  scaled by clip_norm / (norm + 1e-6) inside the
                                                  update (the gradient buffers keep the unclipped
                                                  values); INFINITY: measure the norm, never clip;
                                                  mgpu_optimizer_last_grad_norm reads it
   A parameter without weight decay gets exactly the update of PyTorch's parameter group with
   weight_decay 0; with neither field set every parameter decays, as before. The fused update
   stays one pass per device: on a GPU the kernel looks each element's group up in a small
   table of the flat buffer's no-decay ranges; on the CPU the ranges run as separate loops.
   On GPUs the norm is summed on the device in a fixed order (float64 partial sums, no atomics)
   and the update reads the scale from device memory: no wait for the host, so a step captured
   as a CUDA graph clips too. A pipeline's stages each add their squares on their own device,
   then copy one float64 to every other stage of their replica (S - 1 copies of 8 bytes per
   stage), so every stage scales by the same norm. On the CPU the sum is float64 as well. */
typedef struct mgpu_optimizer_desc {
    mgpu_optimizer_kind kind;
    float lr;
    float weight_decay;
    float momentum, dampening;
    int nesterov;
    float beta1, beta2, eps;
    mgpu_schedule_kind schedule;
    int step_size;
    float gamma;
    int total_steps;
    float min_lr;
    int decay_matrices_only;
    const char* const* no_decay;
    int no_decay_count;
    float clip_norm;
} mgpu_optimizer_desc;

typedef struct mgpu_optimizer mgpu_optimizer;
MGPUDEF mgpu_optimizer* mgpu_optimizer_create(mgpu_model* m, const mgpu_optimizer_desc* desc);
MGPUDEF void mgpu_optimizer_destroy(mgpu_optimizer* opt);
/* One update of every replica's parameters from its gradients (already reduced). */
MGPUDEF mgpu_result mgpu_optimizer_step(mgpu_optimizer* opt);
MGPUDEF float mgpu_optimizer_lr(const mgpu_optimizer* opt);     /* the rate the next step uses */
MGPUDEF int64_t mgpu_optimizer_step_count(const mgpu_optimizer* opt); /* steps taken */
/* The optimizer's state of one parameter on one replica, by PyTorch's optimizer state keys (the
   names the checkpoint uses, "optimizer.0.weight.momentum_buffer"): "momentum_buffer" (SGD with
   a momentum), "exp_avg" and "exp_avg_sq" (AdamW). A view owned by the optimizer (do not destroy
   it); read it, or write it to set the state. The state exists from mgpu_optimizer_create on,
   zero until the first step (whose SGD momentum buffer starts as the gradient, as PyTorch's
   does). A tied parameter (desc.ties) has its twin's state, as the one tensor it is in PyTorch.
   NULL, with mgpu_last_error() saying why, for a state this optimizer does not keep. */
MGPUDEF mgpu_tensor* mgpu_optimizer_state(mgpu_optimizer* opt, int replica, const char* param, const char* state);
/* Back to a fresh optimizer: every replica's state zeroed and the step count (so the schedule
   and AdamW's bias corrections) at 0. The parameters are left as they are. */
MGPUDEF mgpu_result mgpu_optimizer_reset(mgpu_optimizer* opt);
/* The global L2 norm of the gradients that the last step clipped by (desc.clip_norm), before
   clipping: what torch.nn.utils.clip_grad_norm_ returns. Waits for a GPU to finish the step.
   MGPU_ERROR_INVALID_ARGUMENT without clip_norm, or before the first step. */
MGPUDEF mgpu_result mgpu_optimizer_last_grad_norm(mgpu_optimizer* opt, float* norm);

/* ============================================================================================ */
/* >>train                                                                                      */
/* ============================================================================================ */
/* Data-parallel training in five moves (the implementation's >>train opens with them):
   1 replicate (once, at mgpu_model_create), 2 split the batch across replicas, 3 compute
   forward, loss and backward on each, 4 reduce the gradients across replicas (all-reduce,
   overlapped with backward), 5 update every replica with the same optimizer step.

   A whole step: x [B, sample...] and target (int32 [B] for cross-entropy; f32 like the output
   for MSE) on any device, usually the CPU. Zeroes the gradients, then moves 2 to 5. *loss, if
   not NULL, receives the batch's mean loss (which waits for the GPU). It leaves the reduced
   gradients in place (mgpu_model_grads), for a look at them.

   On GPUs a step only queues work and returns: rows from the CPU go up through pinned staging
   buffers (see mgpu_tensor_copy), and with loss NULL nothing waits for a GPU, so the host
   prepares the next batch while the GPUs run this one. Read the loss when it is wanted, for
   the last step only (mgpu_model_last_loss), e.g. once per progress line.

   With desc.graph, a step on GPUs is one CUDA graph launch (torch.cuda.graph's idea, without
   the code around it): the first step of a batch shape runs op by op and makes every buffer,
   the second is captured (zeroing, forward, loss, backward, the bucketed all-reduce, the update)
   and each later one replays it; the batch's rows, the optimizer's numbers of the step (the
   schedule's learning rate, AdamW's bias corrections) and Dropout's key are copied in before the
   launch. A replay gives the bits of the eager step. Steps that a graph cannot hold run eagerly,
   saying why once: another batch shape than the last (the graph is made again for it), tracing,
   a custom layer, NCCL across the GPUs of this process (NCCL warns that capturing it may
   deadlock; with desc.graph an AUTO all-reduce is P2P), the host-staged all-reduce, CPU devices,
   a distributed model, desc.check_finite, or a capture that failed. Gradient accumulation
   (accumulate, apply) runs eagerly. */
MGPUDEF mgpu_result mgpu_model_train_step(mgpu_model* m, mgpu_optimizer* opt, const mgpu_tensor* x,
                                          const mgpu_tensor* target, float* loss);
/* The mean loss of the last batch given to mgpu_model_train_step or mgpu_model_accumulate, read
   now: it waits for that batch's work on the GPUs (and what was queued after it), and for
   nothing when the model is on the CPU. MGPU_ERROR_INVALID_ARGUMENT before the first batch, and
   for a distributed model (whose loss is a sum over the ranks: pass a pointer to the step). */
MGPUDEF mgpu_result mgpu_model_last_loss(mgpu_model* m, float* loss);
/* The mean loss of one replica's rows of that batch (a replica of this process, distributed
   models too), read as mgpu_model_last_loss reads it: the batch's loss is the replicas' losses
   weighted by their rows (mgpu_device_counters.rows_backward counts them). */
MGPUDEF mgpu_result mgpu_model_replica_loss(mgpu_model* m, int replica, float* loss);
/* Training steps replayed from a CUDA graph so far (desc.graph): 0 while they run op by op. */
MGPUDEF int64_t mgpu_model_graph_steps(const mgpu_model* m);
/* The same step in parts, for gradient accumulation over micro-batches (DDP's no_sync()):
   accumulate ADDS the gradients of one micro-batch (scaled as part of a batch of batch_total
   samples; 0 means this micro-batch alone) to the gradient buffers, without reducing them
   (moves 2 and 3); apply reduces them across replicas, takes the optimizer step and zeroes the
   gradients for the next batch (moves 4 and 5). Start from zeroed gradients (a new model,
   mgpu_model_apply or mgpu_model_zero_grad). After a failed accumulate the gradients are
   partial: zero them before going on. */
MGPUDEF mgpu_result mgpu_model_accumulate(mgpu_model* m, const mgpu_tensor* x, const mgpu_tensor* target,
                                          int64_t batch_total, float* loss);
/* Move 4 alone: sum the gradients across replicas without an optimizer step (to read or clip
   them first). Once per batch: a second call, or mgpu_model_apply after it, does not sum again;
   accumulating onto reduced gradients is an error until they are zeroed or applied. */
MGPUDEF mgpu_result mgpu_model_reduce_grads(mgpu_model* m);
MGPUDEF mgpu_result mgpu_model_apply(mgpu_model* m, mgpu_optimizer* opt);
/* Compare every replica's parameters with replica 0's, bit for bit (MGPU_ERROR_DIVERGED names
   the first difference). */
MGPUDEF mgpu_result mgpu_model_verify_replicas(mgpu_model* m);
/* Why the model is suspect, or NULL. A step that fails after it began to change state (an
   optimizer step that updated some parts and not others, a failed CUDA graph replay, a copy or
   broadcast of buffers, a batch that failed after forward moved some replicas' buffers, a failed
   step or load on a rank of a job) marks the model: until a load or mgpu_model_resync clears it,
   mgpu_model_train_step, _accumulate, _apply, mgpu_optimizer_step and mgpu_model_save refuse
   with MGPU_ERROR_DIVERGED, saying why and how to go on. A step that fails before it changed
   anything (bad input, a forward or backward that fails: gradients are zeroed by the next
   step) does not mark it: the model is as it was and the next good step just works. */
MGPUDEF const char* mgpu_model_suspect(const mgpu_model* m);
/* Copy replica 0's parameters, buffers and (opt not NULL) the optimizer's states to every other
   replica, stage by stage, zero the gradients (a failed step may have left them half-summed),
   and clear the mark. An optimizer step that failed on another replica after replica 0 had taken
   it leaves replica 0 one whole step ahead: resync brings the others to it (pass opt: their
   states differ too). What it cannot fix, and refuses (load a checkpoint instead): a replica 0
   whose stages did not all take the update (a pipeline; also a failed CUDA graph replay of one),
   and a model of several processes (mgpu_model_load on every rank). */
MGPUDEF mgpu_result mgpu_model_resync(mgpu_model* m, mgpu_optimizer* opt);
/* Evaluation (dropout off) of x against target: mean loss and, for cross-entropy, the number of
   correct predictions. Either output may be NULL. With a label per position ([B, T] targets) the
   loss is the mean over every label that is not MGPU_IGNORE_INDEX (each token weighs the same) and
   `correct` counts positions. */
MGPUDEF mgpu_result mgpu_model_evaluate(mgpu_model* m, const mgpu_tensor* x, const mgpu_tensor* target,
                                        float* loss, int64_t* correct);

/* A trace of the steps between start and stop, written by stop in Chrome's trace format (JSON:
   Perfetto and chrome://tracing open it): a track per device's compute stream and one for its
   all-reduces, a slice per micro-batch's forward ("F 3") and backward ("B 3"), per all-reduce
   (a bucket's, on GPUs as it overlaps backward) and per optimizer step. Times come from the CPU
   clock on CPU devices and from CUDA events on GPUs, each GPU's set against the CPU clock at the
   start to within microseconds; start waits for the devices.
   A path ending in ".svg" gets a picture of the same slices instead, drawn by mgpu for any
   browser (no Python, no Perfetto): a row per device's compute stream and a thinner one for its
   all-reduces (where there are any), a box per slice at its times in the JSON's order, labelled
   with its micro-batch ("F 3") where it is wide enough, its whole name and times in its tooltip
   (an SVG <title>), colours for forward, backward, all-reduce and optimizer step, a time axis in
   microseconds or milliseconds from the trace's start. stop writes the file and ends the trace;
   write writes the slices so far (waiting for them) and goes on tracing, e.g. one run in both
   formats: write "t.json", then stop "t.svg". Both write as checkpoints are saved (>>io): a
   temporary file beside the path, renamed over it; a folder, FIFO or device is refused at once,
   and so is a symlink (never followed: a trace cannot replace the checkpoint a link leads to).
   When the write fails (MGPU_ERROR_IO, naming the path and why), stop keeps the trace, so a
   call to another path writes it. */
MGPUDEF mgpu_result mgpu_model_trace_start(mgpu_model* m);
MGPUDEF mgpu_result mgpu_model_trace_write(mgpu_model* m, const char* path);
MGPUDEF mgpu_result mgpu_model_trace_stop(mgpu_model* m, const char* path);

/* The building blocks of a step, for a loop of your own (one replica):
   forward on x (on the replica's first device, exactly: a tensor of another CPU device is refused
   as one of another GPU is) returns the output tensor (on its last stage's
   device), owned by the model; x must stay alive and unchanged until backward (the model keeps
   only its header). Backward takes d(loss)/d(output) and ADDS the parameter gradients into the
   gradient buffers. With stages, both go through every stage of the replica in turn. */
MGPUDEF const mgpu_tensor* mgpu_model_forward(mgpu_model* m, int replica, const mgpu_tensor* x, int training);
MGPUDEF mgpu_result mgpu_model_backward(mgpu_model* m, int replica, const mgpu_tensor* doutput);
/* After mgpu_model_backward: d(loss)/d(x), on the replica's first device, owned by the model (what
   a stage before this model needs: examples/model_parallel.c). The library's steps skip it. */
MGPUDEF const mgpu_tensor* mgpu_model_input_grad(const mgpu_model* m, int replica);
MGPUDEF mgpu_result mgpu_model_zero_grad(mgpu_model* m);

/* ============================================================================================ */
/* >>io                                                                                         */
/* ============================================================================================ */
/* Checkpoints in the safetensors format with PyTorch's nn.Sequential state_dict names and layouts
   ("0.weight" [out, in], "0.bias", Conv2d weight [out, in, kh, kw]): safetensors.torch.load_file
   plus load_state_dict reads them unchanged, and a file saved by PyTorch loads here (F32, or
   F64, F16 and BF16 converted to F32 as load_state_dict does: exactly, F64 rounded to nearest). With an
   optimizer, its state goes in the same file ("optimizer.0.weight.momentum_buffer", ...) and the
   step count in the metadata, so training resumes exactly. Saving is atomic: a temporary file
   ".<name>.<hash>.<pid>.<n>.tmp" beside the target (cut to fit 255 bytes), fsync'ed, renamed over
   the target, and the folder fsync'ed; a kill at any moment leaves the old file or the new one.
   A successful save removes the temporary files that earlier saves to the same path left behind
   when their process died (never a live process's). A symlink is followed (its target replaced,
   the link kept); a directory, FIFO or device is refused. Loading reads regular files only and
   validates the whole file before it changes anything, including the model's layer types that the
   file records ("mgpu.layers": a checkpoint of Linear,ReLU,Linear is refused by a Linear,Tanh,Linear
   model unless mgpu_load_desc.weights_only; files of PyTorch, without it, are not checked). Paths are UTF-8 on every platform. On
   Windows: FlushFileBuffers, then MoveFileExW (replace, write-through) in one step; files are read
   sharing delete access, so a save replaces a checkpoint that another mgpu program is reading
   (a program that opens it without FILE_SHARE_DELETE makes the save fail, the old file intact);
   a symlink there is replaced, not followed. */
MGPUDEF mgpu_result mgpu_model_save(const mgpu_model* m, const mgpu_optimizer* opt, const char* path);
MGPUDEF mgpu_result mgpu_model_load(mgpu_model* m, mgpu_optimizer* opt, const char* path);

/* ---- token files (llm.c's format) and a byte-level tokenizer ---- */
/* llm.c's token file (the .bin files of its dev/data, GPT-2 tokens): a header of 256
   little-endian int32, [0] = 20240520 (MGPU_TOKENS_MAGIC), [1] = 1 (MGPU_TOKENS_VERSION), [2] = N
   (the token count; the rest are 0 and not read), then N little-endian uint16 tokens and
   nothing else.
   mgpu_tokens holds such a file in memory (opaque; its tokens are read only).
     mgpu_tokens_load       reads a file whole; refuses (MGPU_ERROR_IO) a file it cannot open or a
                            directory, and (MGPU_ERROR_BAD_FILE) a header shorter than 1024 bytes,
                            another magic or version (named beside the expected ones), a count
                            that disagrees with the file's size (truncated or with bytes past the
                            last token: both numbers said), and N = 0; the path is in every message
     mgpu_tokens_from_text  the byte-level tokenizer: any file's bytes as tokens 0..255, in order
                            (vocabulary MGPU_TOKENS_BYTE_VOCAB = 256; decoding is token = byte);
                            an empty file is refused
     mgpu_tokens_from_memory  count tokens copied from memory (a tokenizer of your own)
     mgpu_tokens_save       writes the file, atomically as checkpoints are (a temporary file beside
                            it, fsync'ed and renamed over it: see the checkpoints above); at most
                            INT32_MAX tokens (the header's count is an int32)
     mgpu_tokens_max_id     the largest token of the file: a program refuses a file whose
                            max_id >= its vocabulary before it trains (-1 for NULL)
   A text file becomes a token file by mgpu_tokens_save(mgpu_tokens_from_text("input.txt"),
   "input.bin") (docs/guide.md). */
#define MGPU_TOKENS_MAGIC 20240520
#define MGPU_TOKENS_VERSION 1
#define MGPU_TOKENS_HEADER_BYTES 1024
#define MGPU_TOKENS_BYTE_VOCAB 256
typedef struct mgpu_tokens mgpu_tokens;
MGPUDEF mgpu_tokens* mgpu_tokens_load(const char* path);
MGPUDEF mgpu_tokens* mgpu_tokens_from_text(const char* path);
MGPUDEF mgpu_tokens* mgpu_tokens_from_memory(const uint16_t* tokens, int64_t count);
MGPUDEF mgpu_result mgpu_tokens_save(const mgpu_tokens* t, const char* path);
MGPUDEF int64_t mgpu_tokens_count(const mgpu_tokens* t);          /* N (0 for NULL) */
MGPUDEF const uint16_t* mgpu_tokens_data(const mgpu_tokens* t);   /* N tokens, host byte order */
MGPUDEF int mgpu_tokens_max_id(const mgpu_tokens* t);
/* MGPU_ERROR_IN_USE, changing nothing, while data sets made from it (mgpu_dataset_tokens) live. */
MGPUDEF mgpu_result mgpu_tokens_destroy(mgpu_tokens* t);
/* Byte-level tokens (a model's samples) as text that is safe to print, into out (size bytes,
   always NUL-terminated when size > 0; like snprintf, the return value is the length the whole
   text needs, so out of that size + 1 holds it all). Printable ASCII, newline, tab and whole
   valid UTF-8 characters are copied; a backslash becomes "\\", other bytes "\xNN", ids
   outside 0..255 "<id>". A character or escape that does not fit is left out whole. */
MGPUDEF size_t mgpu_tokens_to_text(const int32_t* ids, int64_t n, char* out, size_t size);

/* ---- data sets and the batch loader ---- */
/* A data set is images with labels, or windows of tokens:
   - images (mgpu_dataset_load_idx: the MNIST family's IDX files, gzipped or plain): count images
     [rows, cols] u8 with a label each;
   - token windows (mgpu_dataset_tokens(t, seq), T = seq): window j is x = t[jT .. jT+T) and
     y = t[jT+1 .. jT+T+1), the next token at every position (int32 [T] each); count =
     W = (N - 1) / T windows (the tokens after the last window are not used; W = 0 is an error
     naming N and T). The data set reads t's tokens in place: t outlives it (LIFETIMES). */
typedef struct mgpu_dataset {
    int64_t count;     /* images, or windows */
    int rows, cols;
    uint8_t* images;   /* count * rows * cols */
    uint8_t* labels;   /* count */
    int loaders;       /* the library's: loaders reading it (mgpu_dataset_destroy refuses while
                          any); 0 in a data set you fill yourself */
    const mgpu_tokens* tokens;   /* a token data set's tokens (images, labels NULL, rows, cols
                                    0); NULL in an image data set */
    int seq;                     /* a token data set's window length T */
} mgpu_dataset;
MGPUDEF mgpu_dataset* mgpu_dataset_load_idx(const char* images_path, const char* labels_path);
MGPUDEF mgpu_dataset* mgpu_dataset_tokens(const mgpu_tokens* t, int seq);
/* MGPU_ERROR_IN_USE, changing nothing, while loaders read it. */
MGPUDEF mgpu_result mgpu_dataset_destroy(mgpu_dataset* ds);

/* Batches in a seeded shuffled order, assembled in pinned host memory (a step copies its rows
   into the GPUs' own pinned staging buffers at once, see mgpu_tensor_copy, so the next batch may
   overwrite it):
     images          x f32 [B, 1, rows, cols] scaled to (pixel/255 - mean)/std, y i32 [B]
     token windows   x i32 [B, T], y i32 [B, T] (the tokens as they are: mean and std must be
                     left 0, a token data set refuses them rather than ignoring a mistake)
   An epoch walks the samples (images or windows) once in its order: in order without shuffle,
   so batch k holds samples kB .. kB+B-1; the last batch is smaller when B does not divide the
   count, unless drop_last skips it or wrap completes it with the epoch's first samples (0, 1, ...
   without shuffle; again as often as needed when the count is below B), so that every batch has
   B rows (one shape: one CUDA graph, llm.c's fixed [B, T]). Training on tokens: .shuffle = 1 (or
   0) and .wrap = 1; evaluating every window once in order, the last batch smaller: the defaults. */
/* mgpu_loader_desc, zero-initialised; zero means default:
     field          default                       meaning
     batch          64                            samples per batch
     shuffle        0: in file order              reshuffle every epoch (seeded)
     drop_last      0: keep it                    skip a last, smaller batch
     seed           0                             the shuffle's seed
     mean, std      0, 1                          images: x = (pixel / 255 - mean) / std; tokens:
                                                  must be 0
     shard_for      NULL: the whole batch         a distributed model: only this process's rows of
                                                  each batch of `batch` rows (each rank's loader,
                                                  with the same seed, walks the same batches)
     wrap           0: keep it smaller            complete a last, smaller batch with the epoch's
                                                  first samples (not with drop_last) */
typedef struct mgpu_loader_desc {
    int batch;
    int shuffle;
    int drop_last;
    uint64_t seed;
    float mean, std;
    const mgpu_model* shard_for;
    int wrap;
} mgpu_loader_desc;
typedef struct mgpu_loader mgpu_loader;
MGPUDEF mgpu_loader* mgpu_loader_create(const mgpu_dataset* ds, const mgpu_loader_desc* desc);
MGPUDEF void mgpu_loader_destroy(mgpu_loader* l);
/* Start epoch `epoch` (its shuffle is a function of seed and epoch alone). */
MGPUDEF void mgpu_loader_start(mgpu_loader* l, int epoch);
/* The next batch (tensors on the CPU, owned by the loader, valid until the next call); 0 at the
   end of the epoch. */
MGPUDEF int mgpu_loader_next(mgpu_loader* l, const mgpu_tensor** x, const mgpu_tensor** y);
MGPUDEF int64_t mgpu_loader_batches(const mgpu_loader* l);   /* per epoch (those next gives) */

/* ---- any safetensors file, and checkpoints with more than the model ---- */
/* A safetensors file read as named tensors (safetensors.safe_open): open validates the whole
   file by the reference implementation's rules, as mgpu_model_load does (and keeps the file in
   memory, its names indexed by a hash); list the tensors, read one onto a device, read the
   "__metadata__" strings; close. Names and strings returned live until close. Every dtype of the
   format opens; tensors of one mgpu does not compute in (F8_*, F6_*, F4, C64, U16, U32, U64) are
   listed with readable 0, and reading one fails with MGPU_ERROR_UNSUPPORTED. */
typedef struct mgpu_safetensors mgpu_safetensors;
typedef struct mgpu_safetensors_info {
    const char* name;       /* "model.0.weight" */
    const char* dtype;      /* as in the file: "F32", "F16", "BF16", "F64", "I64", "F8_E4M3", ... */
    int ndim;               /* any (mgpu tensors take at most 4) */
    int64_t shape[8];       /* the first 8 dimensions */
    uint64_t bytes;         /* in the file */
    int readable;           /* 1: mgpu_safetensors_read reads it; 0: a dtype mgpu does not compute in */
    mgpu_dtype read_dtype;  /* what mgpu_safetensors_read makes of it: F32 from F64, F32, F16 and
                               BF16, I32 from I64, I32, I16 and I8, U8 from U8 and BOOL */
} mgpu_safetensors_info;
MGPUDEF mgpu_safetensors* mgpu_safetensors_open(const char* path);
MGPUDEF void mgpu_safetensors_close(mgpu_safetensors* st);
MGPUDEF int mgpu_safetensors_count(const mgpu_safetensors* st);   /* tensors, in the file's order */
MGPUDEF mgpu_result mgpu_safetensors_get_info(const mgpu_safetensors* st, int i, mgpu_safetensors_info* info);
/* Index of the tensor called name, or -1 (with mgpu_last_error() naming it). */
MGPUDEF int mgpu_safetensors_find(const mgpu_safetensors* st, const char* name);
/* A new tensor on dev (NULL: the CPU) with the named tensor's shape and values, converted to
   info.read_dtype (F16, BF16 and F64 to F32; I64, I16 and I8 to I32, refusing a value outside
   int32's range). The caller destroys it. */
MGPUDEF mgpu_tensor* mgpu_safetensors_read(const mgpu_safetensors* st, const char* name, mgpu_device* dev);
/* The "__metadata__" strings: how many, the i-th key in the file's order, and the value of a key
   (NULL, with mgpu_last_error() naming the key, when the file has none). */
MGPUDEF int mgpu_safetensors_metadata_count(const mgpu_safetensors* st);
MGPUDEF const char* mgpu_safetensors_metadata_key(const mgpu_safetensors* st, int i);
MGPUDEF const char* mgpu_safetensors_metadata(const mgpu_safetensors* st, const char* key);

/* Loading the model's part of a larger file: a zeroed desc is mgpu_model_load. */
typedef struct mgpu_load_desc {
    const char* prefix;   /* the file names parameter "0.weight" prefix + "0.weight" (e.g. "model."),
                             and its optimizer state "optimizer." prefix "0.weight.momentum_buffer";
                             NULL: no prefix */
    int allow_extra;      /* 1: ignore the file's other tensors (load_state_dict(strict=False));
                             0: refuse them. Missing model tensors are an error either way. */
    int weights_only;     /* 1: load the tensors whatever model the file was saved from; 0: a file
                             that records its model's layers (mgpu.layers: "Linear,ReLU,Linear",
                             every mgpu checkpoint) and lists others than this model's is refused
                             (MGPU_ERROR_BAD_FILE naming both). Files without it (PyTorch's) load. */
} mgpu_load_desc;
MGPUDEF mgpu_result mgpu_model_load_ex(mgpu_model* m, mgpu_optimizer* opt, const char* path, const mgpu_load_desc* desc);

/* Your own strings in a checkpoint's "__metadata__" (e.g. the input normalisation), beside
   mgpu's ("format", "mgpu.step", ...); mgpu_safetensors_metadata or PyTorch's
   safe_open(path, "pt").metadata() reads them back. Keys: non-empty UTF-8, not "format" nor
   starting with "mgpu.", no two alike; values: UTF-8. A zeroed desc is mgpu_model_save.
   dtype: the tensors' dtype in the file, MGPU_SAVE_F32 (0, the default: the exact bits),
   MGPU_SAVE_BF16 or MGPU_SAVE_F16 (half the size, rounded to nearest even, as PyTorch's
   .to(torch.bfloat16) does); mgpu_model_load reads all three back into F32. */
typedef struct mgpu_metadata { const char* key; const char* value; } mgpu_metadata;
typedef enum mgpu_save_dtype { MGPU_SAVE_F32 = 0, MGPU_SAVE_BF16 = 1, MGPU_SAVE_F16 = 2 } mgpu_save_dtype;
typedef struct mgpu_save_desc {
    const mgpu_metadata* metadata;
    int metadata_count;
    mgpu_save_dtype dtype;
    const char* prefix;   /* before every tensor's name, as mgpu_load_desc.prefix reads it back:
                             "transformer." writes a GPT of Hugging Face's names (wte.weight, h.0.
                             ...) in GPT2LMHeadModel's layout. NULL: none */
} mgpu_save_desc;
MGPUDEF mgpu_result mgpu_model_save_ex(const mgpu_model* m, const mgpu_optimizer* opt, const char* path, const mgpu_save_desc* desc);

#ifdef __cplusplus
}
#endif
#endif /* MGPU_H */

/* ============================================================================================ */
/* >>seam  the interface between mgpu.h and mgpu_kernels.cu, and the math both share            */
/* ============================================================================================ */
/* Visible to the implementation and to mgpu_kernels.cu (which defines MGPU_KERNELS before it
   includes this header); nothing here is public API. */
#if (defined(MGPU_IMPLEMENTATION) || defined(MGPU_KERNELS)) && !defined(MGPU__SEAM_DONE)
#define MGPU__SEAM_DONE
#include <math.h>
#include <string.h>   /* memcpy: a float's bits */

#ifdef __CUDACC__
#define MGPU__HD __host__ __device__
#else
#define MGPU__HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- shared math: the CPU reference loops and the CUDA kernels call the same functions ---- */

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"). */
static inline MGPU__HD void mgpu__philox4x32(uint32_t ctr[4], uint32_t k0, uint32_t k1) {
    int round;
    for (round = 0; round < 10; ++round) {
        uint64_t p0 = (uint64_t)0xD2511F53u * ctr[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * ctr[2];
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        uint32_t c1 = ctr[1], c3 = ctr[3];
        ctr[0] = hi1 ^ c1 ^ k0;
        ctr[1] = lo1;
        ctr[2] = hi0 ^ c3 ^ k1;
        ctr[3] = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* A multiply that is never fused with a following add into an FMA (nvcc fuses by default, and
   so does gcc in GNU mode): the RNG must round the same way on the CPU and the GPU. */
#ifdef __CUDA_ARCH__
static inline MGPU__HD float mgpu__mul_rounded(float a, float b) { return __fmul_rn(a, b); }
static inline MGPU__HD double mgpu__dmul_rounded(double a, double b) { return __dmul_rn(a, b); }
#else
static inline MGPU__HD float mgpu__mul_rounded(float a, float b) { volatile float r = a * b; return r; }
static inline MGPU__HD double mgpu__dmul_rounded(double a, double b) { volatile double r = a * b; return r; }
#endif

/* Element i of a draw: counter (offset + i/4), word i%4. Uniform in [low, high) from 24 bits;
   normal by Box-Muller over word pairs, computed in double so CPU and GPU round alike. */
static inline MGPU__HD float mgpu__rand_element(uint64_t seed, uint64_t offset, uint64_t i,
                                                int normal, float a, float b) {
    uint64_t c = offset + (i >> 2);
    uint32_t ctr[4];
    ctr[0] = (uint32_t)c; ctr[1] = (uint32_t)(c >> 32); ctr[2] = 0; ctr[3] = 0;
    mgpu__philox4x32(ctr, (uint32_t)seed, (uint32_t)(seed >> 32));
    if (!normal) {
        float u = (float)(ctr[i & 3] >> 8) * (1.0f / 16777216.0f);
        float v = a + mgpu__mul_rounded(b - a, u);
        return v < b ? v : nextafterf(b, a);   /* rounding can reach b when |a| >> b - a */
    } else {
        int pair = (int)((i & 3) >> 1) * 2;
        double u1 = ((double)ctr[pair] + 1.0) * (1.0 / 4294967296.0);   /* (0, 1] */
        double u2 = (double)ctr[pair + 1] * (1.0 / 4294967296.0);       /* [0, 1) */
        double r = sqrt(-2.0 * log(u1));
        double t = 6.283185307179586476925286766559 * u2;
        double z = (i & 1) ? r * sin(t) : r * cos(t);
        return (float)(a + mgpu__dmul_rounded((double)b, z));
    }
}

/* The keep-or-drop decision of dropout element i: the scale (0 or 1/(1-p)) it multiplies by. */
static inline MGPU__HD float mgpu__dropout_scale(uint64_t seed, uint64_t offset, uint64_t i, float p) {
    float u = mgpu__rand_element(seed, offset, i, 0, 0.0f, 1.0f);
    return u < p ? 0.0f : 1.0f / (1.0f - p);
}

typedef enum mgpu__unary_op {
    MGPU__UNARY_SCALE = 0,   /* alpha * x */
    MGPU__UNARY_RELU = 1,
    MGPU__UNARY_GELU = 2,    /* x * Phi(x), exact erf form (nn.GELU default) */
    MGPU__UNARY_TANH = 3,
    MGPU__UNARY_SIGMOID = 4,
    MGPU__UNARY_GELU_TANH = 5,  /* GPT-2's tanh form (nn.GELU(approximate='tanh')) */
    /* the tape's (>>autograd), through mgpu__map_element only */
    MGPU__UNARY_EXP = 6, MGPU__UNARY_LOG = 7, MGPU__UNARY_SQRT = 8, MGPU__UNARY_RSQRT = 9,
    MGPU__UNARY_NEG = 10, MGPU__UNARY_ABS = 11,
    MGPU__UNARY_POW = 12,        /* x^alpha */
    MGPU__UNARY_ADD_SCALAR = 13, /* x + alpha */
    MGPU__UNARY_COPY = 14        /* x (a strided copy: permute, slice, broadcast) */
} mgpu__unary_op;

/* exp and tanh in plain float arithmetic, with no call and no branch, so that a loop of them
   vectorises (glibc's tanhf, a call per element, was a third of a CPU GPT step). Both are
   within 1.4 ulp of the exact values where the result is a normal float (test_core's
   test_fast_math sweeps every third float of [2^-31, 11] for tanh, every 31st for exp; every
   float measured 1.34 and 1.22 ulp at worst); NaN stays NaN, infinities give the limits, and exp
   flushes to 0 below -104. The bits of a float as an integer and back: memcpy is the cast C and CUDA allow. */
static inline MGPU__HD uint32_t mgpu__f32_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline MGPU__HD float mgpu__f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
/* cond ? a : b through a mask of bits: GCC's -O2 vectorises a loop of these but not of ?: on floats */
static inline MGPU__HD float mgpu__f32_select(int cond, float a, float b) {
    const uint32_t m = 0u - (uint32_t)(cond != 0);
    return mgpu__f32_from_bits((mgpu__f32_bits(a) & m) | (mgpu__f32_bits(b) & ~m));
}
/* bfloat16, a float's upper half: rounded to nearest even by adding 0x7FFF plus the lowest kept
   bit (a carry into the exponent is right: the next binade, or infinity past the largest); a
   NaN keeps its sign and top payload bits, with the quiet bit set so that it stays a NaN. */
static inline MGPU__HD uint16_t mgpu__float_to_bf16(float f) {
    uint32_t x = mgpu__f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7FFFu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}
static inline MGPU__HD float mgpu__bf16_to_float(uint16_t b) { return mgpu__f32_from_bits((uint32_t)b << 16); }
/* mgpu_tensor_convert's value, the same bits on the CPU and a GPU: the product rounded on its
   own (never fused into an FMA with the add), no add of a zero shift (-0 + 0 would be +0). A
   plain conversion (scale 1, shift 0) does not come here: it takes no arithmetic at all, which
   keeps signalling NaNs as they are (compilers may turn "scale != 1 ? x * scale : x" into the
   product, which quiets them). */
static inline MGPU__HD float mgpu__convert_value(float x, float scale, float shift) {
    const float y = mgpu__mul_rounded(x, scale);
    return shift != 0.0f ? y + shift : y;
}

/* e^x = 2^n e^r: n = x log2(e) rounded by adding 1.5 * 2^23 (no float-to-int conversion, which
   NaN would make undefined), r = x - n ln 2 in two parts (Cody and Waite: n times the high part
   is exact), e^r (|r| <= 0.35) by its Taylor series to r^7 (error below 6e-9), and 2^n in two
   halves so that neither leaves float's exponents (n from -150 to 128). The clamps keep NaN. */
static inline MGPU__HD float mgpu__expf(float x) {
    const float round_magic = 12582912.0f;
    float z, n, r, p;
    uint32_t e, e1;
    x = mgpu__f32_select(x > 89.0f, 89.0f, x);       /* e^89 overflows to inf all the same */
    x = mgpu__f32_select(x < -104.0f, -104.0f, x);   /* e^-104 rounds to 0 all the same */
    z = x * 1.44269504088896341f + round_magic;
    n = z - round_magic;
    r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    e = mgpu__f32_bits(z) - 0x4B400000u + 152u;   /* n + 152, from z's low bits: 2 to 280 */
    e1 = e >> 1;                                  /* 2^n = 2^(e1 - 76) 2^(e - e1 - 76) */
    return p * mgpu__f32_from_bits((e1 + 51u) << 23) * mgpu__f32_from_bits((e - e1 + 51u) << 23);
}

/* tanh: below 0.625, x + x^3 P(x^2), P fitted for the least largest relative error (Lawson's
   iteration, error 1.6e-10); above, 1 - 2 / (e^2|x| + 1), |x| clamped at 10 where tanh is 1 in
   float; the sign put back last, so tanh(-0) = -0 */
static inline MGPU__HD float mgpu__tanhf(float x) {
    float ax = fabsf(x), y = x * x, p, big;
    p = 2.142962276e-03f;
    p = p * y - 8.177398777e-03f;
    p = p * y + 2.170070347e-02f;
    p = p * y - 5.394676312e-02f;
    p = p * y + 1.333320601e-01f;
    p = p * y - 3.333333080e-01f;
    big = 1.0f - 2.0f / (mgpu__expf(2.0f * mgpu__f32_select(ax > 10.0f, 10.0f, ax)) + 1.0f);
    return copysignf(mgpu__f32_select(ax < 0.625f, ax + ax * y * p, big), x);
}

/* GELU's tanh form: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); with `derivative`, its
   derivative 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u). */
static inline MGPU__HD float mgpu__gelu_tanh(float x, int derivative) {
    const float k = 0.79788456080286536f, c = 0.044715f;   /* sqrt(2/pi) */
    const float t = mgpu__tanhf(k * (x + c * x * x * x));
    if (!derivative) return 0.5f * x * (1.0f + t);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
}

static inline MGPU__HD float mgpu__unary_apply(int op, float x, float alpha) {
    switch (op) {
    case MGPU__UNARY_SCALE: return alpha * x;
    case MGPU__UNARY_RELU: return x <= 0.0f ? 0.0f : x;   /* NaN fails the test and passes, as torch.relu */
    case MGPU__UNARY_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case MGPU__UNARY_TANH: return mgpu__tanhf(x);
    case MGPU__UNARY_SIGMOID: return 1.0f / (1.0f + mgpu__expf(-x));
    case MGPU__UNARY_GELU_TANH: return mgpu__gelu_tanh(x, 0);
    case MGPU__UNARY_EXP: return mgpu__expf(x);
    case MGPU__UNARY_LOG: return logf(x);
    case MGPU__UNARY_SQRT: return sqrtf(x);
    case MGPU__UNARY_RSQRT: return 1.0f / sqrtf(x);
    case MGPU__UNARY_NEG: return -x;
    case MGPU__UNARY_ABS: return fabsf(x);
    case MGPU__UNARY_POW: return powf(x, alpha);
    case MGPU__UNARY_ADD_SCALAR: return x + alpha;
    case MGPU__UNARY_COPY: return x;
    default: return 0.0f;
    }
}

typedef enum mgpu__binary_op {
    MGPU__BINARY_ADD = 0,          /* a + b */
    MGPU__BINARY_SUB = 1,          /* a - b */
    MGPU__BINARY_MUL = 2,          /* a * b */
    MGPU__BINARY_AXPY = 3,         /* alpha * a + b */
    MGPU__BINARY_RELU_BWD = 4,     /* a = dy, b = x or relu(x) (the same test) */
    MGPU__BINARY_GELU_BWD = 5,     /* a = dy, b = x */
    MGPU__BINARY_TANH_BWD = 6,     /* a = dy, b = y = tanh(x) */
    MGPU__BINARY_SIGMOID_BWD = 7,  /* a = dy, b = y = sigmoid(x) */
    MGPU__BINARY_GELU_TANH_BWD = 8,/* a = dy, b = x */
    /* the tape's (>>autograd), through mgpu__map_element only */
    MGPU__BINARY_DIV = 9,          /* a / b */
    MGPU__BINARY_MAX = 10,         /* the larger, a NaN of either (torch.maximum) */
    MGPU__BINARY_MIN = 11,
    MGPU__BINARY_GE = 12,          /* 1 where a >= b, else 0 */
    MGPU__BINARY_EQ = 13,          /* 1 where a == b, else 0 */
    MGPU__BINARY_NEG_DIV = 14,     /* -a / b */
    MGPU__BINARY_SQRT_BWD = 15,    /* a = dy, b = y = sqrt(x) */
    MGPU__BINARY_RSQRT_BWD = 16,   /* a = dy, b = y = 1/sqrt(x) */
    MGPU__BINARY_POW_BWD = 17,     /* a = dy, b = x, alpha the exponent */
    MGPU__BINARY_ABS_BWD = 18,     /* a = dy, b = x */
    MGPU__BINARY_KEEP_IF = 19,     /* b != 0 ? a : 0 (where's gradient of its first choice) */
    MGPU__BINARY_DROP_IF = 20      /* b != 0 ? 0 : a (and of its second) */
} mgpu__binary_op;

static inline MGPU__HD float mgpu__binary_apply(int op, float a, float b, float alpha) {
    switch (op) {
    case MGPU__BINARY_ADD: return a + b;
    case MGPU__BINARY_SUB: return a - b;
    case MGPU__BINARY_MUL: return a * b;
    case MGPU__BINARY_AXPY: return alpha * a + b;
    /* PyTorch's threshold_backward(dy, relu(x), 0): 0 where relu(x) <= 0, else dy; so a NaN x passes
       dy through (torch 1.13: grad 1 for x = NaN, dy = 1) and a NaN dy stays NaN where x > 0 or NaN */
    case MGPU__BINARY_RELU_BWD: return b <= 0.0f ? 0.0f : a;
    case MGPU__BINARY_GELU_BWD: {
        float cdf = 0.5f * (1.0f + erff(b * 0.70710678118654752f));
        float pdf = 0.39894228040143268f * expf(-0.5f * b * b);
        return a * (cdf + b * pdf);
    }
    case MGPU__BINARY_TANH_BWD: return a * (1.0f - b * b);
    case MGPU__BINARY_SIGMOID_BWD: return a * b * (1.0f - b);
    case MGPU__BINARY_GELU_TANH_BWD: return a * mgpu__gelu_tanh(b, 1);
    case MGPU__BINARY_DIV: return a / b;
    case MGPU__BINARY_MAX: return a > b || a != a ? a : b;
    case MGPU__BINARY_MIN: return a < b || a != a ? a : b;
    case MGPU__BINARY_GE: return a >= b ? 1.0f : 0.0f;
    case MGPU__BINARY_EQ: return a == b ? 1.0f : 0.0f;
    case MGPU__BINARY_NEG_DIV: return -a / b;
    case MGPU__BINARY_SQRT_BWD: return 0.5f * a / b;
    case MGPU__BINARY_RSQRT_BWD: return -0.5f * a * b * b * b;
    case MGPU__BINARY_POW_BWD: return alpha == 0.0f ? 0.0f : a * alpha * powf(b, alpha - 1.0f);   /* x^0: 0, as torch */
    /* torch's abs backward: dy * sign(x), 0 at 0; a NaN x gives NaN */
    case MGPU__BINARY_ABS_BWD: return b > 0.0f ? a : b < 0.0f ? -a : b == 0.0f ? 0.0f : b;
    case MGPU__BINARY_KEEP_IF: return b != 0.0f ? a : 0.0f;
    case MGPU__BINARY_DROP_IF: return b != 0.0f ? 0.0f : a;
    default: return 0.0f;
    }
}

/* Optimizer updates of one parameter element, exactly PyTorch's rules (torch.optim.SGD with
   foreach=False; torch.optim.AdamW). grad_scale is clipping's coefficient, the gradient
   multiplied by it first as clip_grad_norm_'s g.mul_(clip_coef) does; at 1 (no clipping, or
   below the threshold) the multiply is skipped, so that no compiler can fuse it into an FMA with
   what follows: the bits of the update without clipping. A parameter of a no-decay group gets
   the same arguments with weight_decay 0. */
typedef struct mgpu__sgd_args {
    float lr, momentum, dampening, weight_decay;
    int nesterov;
    int first_step;   /* the momentum buffer starts as the first gradient, as in PyTorch */
    float grad_scale;
} mgpu__sgd_args;

static inline MGPU__HD void mgpu__sgd_update(float* p, float g, float* buf, const mgpu__sgd_args* a) {
    if (a->grad_scale != 1.0f) g *= a->grad_scale;
    if (a->weight_decay != 0.0f) g += a->weight_decay * *p;
    if (a->momentum != 0.0f) {
        float bv = a->first_step ? g : a->momentum * *buf + (1.0f - a->dampening) * g;
        *buf = bv;
        g = a->nesterov ? g + a->momentum * bv : bv;
    }
    *p -= a->lr * g;
}

typedef struct mgpu__adamw_args {
    float lr, beta1, beta2, eps, weight_decay;
    float bias_correction1;        /* 1 - beta1^step */
    float bias_correction2_sqrt;   /* sqrt(1 - beta2^step) */
    float grad_scale;
} mgpu__adamw_args;

static inline MGPU__HD void mgpu__adamw_update(float* p, float g, float* m, float* v, const mgpu__adamw_args* a) {
    float mv, vv, denom;
    if (a->grad_scale != 1.0f) g *= a->grad_scale;
    *p *= 1.0f - a->lr * a->weight_decay;
    mv = a->beta1 * *m + (1.0f - a->beta1) * g;
    vv = a->beta2 * *v + (1.0f - a->beta2) * g * g;
    *m = mv;
    *v = vv;
    denom = sqrtf(vv) / a->bias_correction2_sqrt + a->eps;
    *p -= (a->lr / a->bias_correction1) * (mv / denom);
}

/* Comparisons that keep NaN, as PyTorch's kernels do (a NaN is never skipped as "not greater"):
   max pooling takes v over the window's best so far when v > best or v is NaN, so a NaN wins and,
   of several, the last in scan order (torch.nn.functional.max_pool2d's index, CPU and CUDA);
   argmax takes the first NaN of a row, else the first maximum (torch.argmax). */
static inline MGPU__HD int mgpu__pool_takes(float v, float best) { return v > best || v != v; }
static inline MGPU__HD int mgpu__argmax_takes(float v, float best) { return v != v ? best == best : v > best; }

/* The tape's two generic kernels (>>autograd): every op of a tape that is not a GEMM, a gather or
   a loss is one of these. A map walks an index space of 4 dimensions (shapes padded with leading
   1s); element i's coordinates, times each tensor's element strides (0 along a dimension it is
   broadcast over), place it in out, a and b: out = f(a) or f(a, b), or with a condition tensor
   out = cond != 0 ? a : b (torch.where). Broadcasts, permutes, slices and concatenations are maps
   of MGPU__UNARY_COPY. */
typedef struct mgpu__map_geom {
    int64_t dim[4];
    int64_t out[4], a[4], b[4];   /* element strides */
    int op, binary;               /* an mgpu__binary_op when binary, else an mgpu__unary_op */
    float alpha;
    int causal;                   /* 1: element (.., t, s) with s > t + causal_shift is `fill` instead
                                     (a causal mask over the last two dimensions) */
    int64_t causal_shift;
    float fill;
    const float* cond;            /* not NULL: out = cond != 0 ? a : b (op unused), cond's strides: */
    int64_t c[4];
} mgpu__map_geom;
static inline MGPU__HD void mgpu__map_offsets(const mgpu__map_geom* g, int64_t i, int64_t* oo, int64_t* oa, int64_t* ob,
                                              int64_t* oc) {
    int64_t rest = i;
    int d;
    *oo = *oa = *ob = *oc = 0;
    for (d = 3; d >= 0; --d) {
        const int64_t c = rest % g->dim[d];
        rest /= g->dim[d];
        *oo += c * g->out[d]; *oa += c * g->a[d]; *ob += c * g->b[d]; *oc += c * g->c[d];
    }
}
static inline MGPU__HD int mgpu__map_masked(const mgpu__map_geom* g, int64_t i) {
    return g->causal && i % g->dim[3] > i / g->dim[3] % g->dim[2] + g->causal_shift;
}
static inline MGPU__HD void mgpu__map_element(const mgpu__map_geom* g, const float* a, const float* b, float* out, int64_t i) {
    int64_t oo, oa, ob, oc;
    mgpu__map_offsets(g, i, &oo, &oa, &ob, &oc);
    out[oo] = g->cond ? (g->cond[oc] != 0.0f ? a[oa] : b[ob])
              : mgpu__map_masked(g, i) ? g->fill
              : g->binary ? mgpu__binary_apply(g->op, a[oa], b[ob], g->alpha) : mgpu__unary_apply(g->op, a[oa], g->alpha);
}
/* A reduction: out (contiguous, shape out_dim) = the sum (times scale) or the max of x (contiguous,
   shape dim) over the dimensions where out_dim is 1 and dim is not. Output element i takes its
   inputs in one fixed order, one after the other, a sum in double rounded to float once: the same
   bits on the CPU and on a GPU. The max takes a NaN (torch.amax). */
typedef struct mgpu__reduce_geom {
    int64_t dim[4], out_dim[4];
    int max;
    float scale;
} mgpu__reduce_geom;
static inline MGPU__HD void mgpu__reduce_element(const mgpu__reduce_geom* g, const float* x, float* out, int64_t i) {
    int64_t stride[4], base = 0, count = 1, rest = i, s = 1, j;
    float best = -INFINITY;
    double acc = 0.0;
    int d;
    for (d = 3; d >= 0; --d) { stride[d] = s; s *= g->dim[d]; }
    for (d = 3; d >= 0; --d) {
        base += rest % g->out_dim[d] * stride[d];
        rest /= g->out_dim[d];
        if (g->out_dim[d] != g->dim[d]) count *= g->dim[d];
    }
    for (j = 0; j < count; ++j) {
        int64_t r = j, at = base;
        float v;
        for (d = 3; d >= 0; --d)
            if (g->out_dim[d] != g->dim[d]) { at += r % g->dim[d] * stride[d]; r /= g->dim[d]; }
        v = x[at];
        if (g->max) best = mgpu__pool_takes(v, best) ? v : best;
        else acc += (double)v;
    }
    out[i] = g->max ? best : (float)(acc * (double)g->scale);
}

/* Clipping by global norm, torch.nn.utils.clip_grad_norm_'s rule in float32: the coefficient
   max_norm / (norm + 1e-6), clamped to at most 1 (a NaN norm gives NaN, as torch.clamp does). */
static inline MGPU__HD float mgpu__clip_scale(float norm, float max_norm) {
    const float coef = max_norm / (norm + 1e-6f);
    return coef > 1.0f ? 1.0f : coef;
}
/* Element i of a flat buffer is in a no-decay group when an odd number of edges are <= i:
   edges[0..count) ascending, the no-decay ranges [edges[0], edges[1]), [edges[2], edges[3]), ... */
static inline MGPU__HD int mgpu__edges_upto(const int64_t* edges, int count, int64_t i) {
    int lo = 0, hi = count;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (edges[mid] <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The geometry of a sliding window over NCHW images (Conv2d, MaxPool2d). */
typedef struct mgpu__window {
    int n, c, h, w;          /* input batch, channels, height, width */
    int kh, kw;              /* window size */
    int stride, pad;
    int oh, ow;              /* output height and width */
} mgpu__window;

/* The geometry of causal self-attention: qkv [batch, t, 3 * heads * head_size] (q, k, v side by
   side, head h at columns h * head_size of each), attention rows [batch, heads, t, t]. */
typedef struct mgpu__attn {
    int batch, t, heads, head_size;
    float scale;             /* 1 / sqrt(head_size) */
} mgpu__attn;

/* ---- backend interface, implemented in mgpu_kernels.cu ----
   Every function returns 0 on success or one of the codes below, and then leaves a message
   naming the failed call, the CUDA/cuBLAS/NCCL error name and mgpu_kernels.cu:line, which
   mgpu__cu_error_message() returns (thread-local). `dev` is the CUDA device number; a function
   that launches work on it makes it current (a copy, an event or a wait on one of its streams
   needs not). `stream` is a cudaStream_t (NULL: the legacy default stream). Kernels are
   asynchronous on `stream`; every launch's error is checked. */
enum {
    MGPU__CU_OK = 0,
    MGPU__CU_ERR_CUDA = 1,
    MGPU__CU_ERR_CUBLAS = 2,
    MGPU__CU_ERR_NCCL = 3,
    MGPU__CU_ERR_OOM = 4,
    MGPU__CU_ERR_NO_DEVICE = 5,   /* no driver, or no GPU */
    MGPU__CU_ERR_ARGUMENT = 6     /* sizes the kernels cannot take (e.g. above INT_MAX for cuBLAS) */
};
const char* mgpu__cu_error_message(void);

/* devices */
int mgpu__cu_device_count(int* count);   /* *count = 0 and MGPU__CU_ERR_NO_DEVICE when none */
int mgpu__cu_device_info(int dev, char* name, size_t name_size, size_t* total_mem, size_t* free_mem,
                         int* major, int* minor, int* multiprocessors);
int mgpu__cu_can_access_peer(int dev, int peer, int* can);
int mgpu__cu_enable_peer_access(int dev, int peer);   /* "already enabled" is success */

/* streams and events */
int mgpu__cu_stream_create(int dev, void** stream);    /* non-blocking stream */
int mgpu__cu_stream_destroy(int dev, void* stream);
int mgpu__cu_stream_synchronize(int dev, void* stream);
int mgpu__cu_event_create(int dev, void** event);   /* for ordering streams (no timing) */
int mgpu__cu_event_create_timed(int dev, void** event);   /* for traces */
int mgpu__cu_event_elapsed(int dev, void* start, void* end, float* ms);   /* waits for end */
int mgpu__cu_event_destroy(int dev, void* event);
int mgpu__cu_event_record(int dev, void* event, void* stream);
int mgpu__cu_stream_wait_event(int dev, void* stream, void* event);
int mgpu__cu_event_done(int dev, void* event, int* done);   /* *done: its last record ran; never waits */
int mgpu__cu_event_synchronize(int dev, void* event);
/* Around a training step (enter 1, then 0): inside it, this thread's calls trust the device they
   made current last (no cudaGetDevice; cudaSetDevice only when the device changes). Copies,
   events, waits and NCCL calls on a stream of a device never make it current: CUDA runs them on
   the stream's device whichever is current. */
int mgpu__cu_step_scope(int enter);
int mgpu__cu_device_unknown(void);   /* the program's own code ran on this thread: trust nothing */
/* A CUDA error pending on this thread (cleared): mgpu checks its own calls at once, so one found
   before mgpu's work is the program's own (a launch not checked by mgpu_cuda_end). Every call
   that makes a device current checks it outside a step, and the first after a custom layer's
   code inside one; a step checks it after such code too, naming the layer. */
int mgpu__cu_pending_error(void);
/* The program's own kernels (mgpu_cuda_begin, mgpu_cuda_end): make dev current, trusting
   nothing this thread did before (the program's code runs around these); then its launch's
   status (cudaGetLastError), named as `kernel` in the message. */
int mgpu__cu_use_device(int dev);
int mgpu__cu_check_launch(int dev, const char* kernel);
/* CUDA graphs: capture on stream (global mode), end it into an executable graph, launch, destroy */
int mgpu__cu_capture_begin(int dev, void* stream);
int mgpu__cu_capture_end(int dev, void* stream, void** exec);
int mgpu__cu_graph_launch(int dev, void* exec, void* stream);
int mgpu__cu_graph_destroy(int dev, void* exec);

/* memory */
int mgpu__cu_malloc(int dev, size_t bytes, void** ptr);   /* MGPU__CU_ERR_OOM when out of memory */
int mgpu__cu_free(int dev, void* ptr);
int mgpu__cu_host_alloc(size_t bytes, void** ptr);        /* page-locked */
int mgpu__cu_host_free(void* ptr);
/* Any direction (unified addressing), asynchronous on stream of dev. */
int mgpu__cu_memcpy(int dev, void* dst, const void* src, size_t bytes, void* stream);
int mgpu__cu_memcpy_peer(int dst_dev, void* dst, int src_dev, const void* src, size_t bytes, void* stream);

/* cuBLAS; the handle is bound to one stream and works in `workspace` (device memory the caller
   allocated and frees after the destroy) */
int mgpu__cu_blas_create(int dev, void* stream, void* workspace, size_t workspace_bytes, void** handle);
int mgpu__cu_blas_destroy(int dev, void* handle);
int mgpu__cu_blas_set_tf32(int dev, void* handle, int allow);
/* Row-major: C[m,n] = alpha * op(A) @ op(B) + beta * C, op(A) [m,k], op(B) [k,n]; lda, ldb, ldc
   are the row strides of A, B, C as stored (A is [k,m] when trans_a); ab_dtype and c_dtype are
   mgpu_dtype's: F32 (cublasSgemm), or BF16 operands with an F32 or BF16 C (cublasGemmEx, fp32
   sums). */
int mgpu__cu_gemm(int dev, void* handle, int trans_a, int trans_b, int m, int n, int k,
                  float alpha, int ab_dtype, const void* a, int lda, const void* b, int ldb,
                  float beta, int c_dtype, void* c, int ldc);

/* kernels; dtype values are mgpu_dtype's */
int mgpu__cu_fill(int dev, void* stream, void* ptr, int dtype, size_t n, double value);
int mgpu__cu_convert(int dev, void* stream, size_t n, int src_dtype, const void* src,
                     int dst_dtype, void* dst, float scale, float shift);  /* dst = src*scale+shift */
int mgpu__cu_rand(int dev, void* stream, int normal, size_t n, uint64_t seed, uint64_t offset,
                  float a, float b, float* out);   /* out[i] = mgpu__rand_element(seed, offset, i, normal, a, b) */
int mgpu__cu_unary(int dev, void* stream, int op, int dtype, size_t n, const void* x, void* y, float alpha);
int mgpu__cu_binary(int dev, void* stream, int op, int dtype, size_t n, const void* a, const void* b,
                    void* y, float alpha);   /* dtype F32 or BF16 (computed in float, rounded once) */
/* the tape's kernels (>>autograd): mgpu__map_element for every element of g->dim (b NULL for a
   unary op), mgpu__reduce_element for every element of g->out_dim */
int mgpu__cu_map(int dev, void* stream, const mgpu__map_geom* g, const float* a, const float* b, float* out);
int mgpu__cu_reduce(int dev, void* stream, const mgpu__reduce_geom* g, const float* x, float* out);
/* y[o,c,i] = x[o,c,i] + bias[c] over [outer, channels, inner] */
int mgpu__cu_bias_add(int dev, void* stream, int64_t outer, int64_t channels, int64_t inner,
                      int x_dtype, const void* x, const float* bias, int y_dtype, void* y);   /* F32 or BF16 */
/* out[c] = scale * sum over o, i of x[o,c,i] (+ out[c] when accumulate); a fixed summation
   order (deterministic); x F32 or BF16 */
int mgpu__cu_channel_sum(int dev, void* stream, int64_t outer, int64_t channels, int64_t inner,
                         int x_dtype, const void* x, float* out, float scale, int accumulate);
int mgpu__cu_softmax(int dev, void* stream, int rows, int cols, const float* x, float* y);
/* loss[0] = mean over the rows whose label is not MGPU_IGNORE_INDEX of -log softmax(logits)[label]
   (0 when there are none); dlogits (may be NULL) = (softmax - onehot) * grad_scale, 0 in an
   ignored row; grad_scale 0: mean_factor over the rows not ignored, counted on the device. Any
   other label outside [0, cols) makes its row's loss NaN and its gradient row NaN. scratch:
   rows + 1 floats. Deterministic. */
int mgpu__cu_softmax_xent(int dev, void* stream, int rows, int cols, const float* logits,
                          const int32_t* labels, float* loss, float* dlogits, float grad_scale,
                          float mean_factor, float* scratch);
/* loss[0] = mean of (pred - target)^2; dpred (may be NULL) = 2 (pred - target) * grad_scale.
   scratch: MGPU__CU_REDUCE_SCRATCH floats. Deterministic. */
#define MGPU__CU_REDUCE_SCRATCH 1024
int mgpu__cu_mse(int dev, void* stream, size_t n, const float* pred, const float* target,
                 float* loss, float* dpred, float grad_scale, float* scratch);
int mgpu__cu_argmax(int dev, void* stream, int rows, int cols, const float* x, int32_t* out);
/* *count (device int32) = number of i with argmax(logits row i) == labels[i]; scratch: as mse */
int mgpu__cu_count_correct(int dev, void* stream, int rows, int cols, const float* logits,
                           const int32_t* labels, int32_t* count, float* scratch);

/* layers */
/* y = x * mask, mask[i] = mgpu__dropout_scale(seed, offset, first + i, p) */
int mgpu__cu_dropout(int dev, void* stream, size_t n, uint64_t seed, const uint64_t* seed_on_device, uint64_t offset,
                     uint64_t first, float p, const float* x, float* y, float* mask);
/* cols [n*oh*ow, c*kh*kw]: row (img, oy, ox), column (ch, ky, kx); zero where the window is in
   the padding. col2im is its adjoint: dx (overwritten) gathers every column entry that reads it. */
int mgpu__cu_im2col(int dev, void* stream, const mgpu__window* g, const float* x, float* cols);
int mgpu__cu_col2im(int dev, void* stream, const mgpu__window* g, const float* cols, float* dx);
/* y[b][j][i] = x[b][i][j] for x [batch, rows, cols] */
int mgpu__cu_transpose(int dev, void* stream, int64_t batch, int64_t rows, int64_t cols,
                       const float* x, float* y);
/* Max over each window (padding counts as -inf); argmax is the index h*w-plane offset of the
   chosen input element, or -1 if the window is all padding (y is then -inf). */
int mgpu__cu_maxpool(int dev, void* stream, const mgpu__window* g, const float* x, float* y, int32_t* argmax);
/* dx (overwritten) = sum of dy over the windows whose argmax is this element; deterministic */
int mgpu__cu_maxpool_backward(int dev, void* stream, const mgpu__window* g, const float* dy,
                              const int32_t* argmax, float* dx);
/* BatchNorm2d over x [n, c, hw], per channel. Training (MGPU__BN_TRAIN): mean and biased variance
   var over (n, hw), save_mean = mean, save_rstd = 1 / sqrt(var + eps), running_mean and
   running_var moved by momentum towards mean and var * m / (m - 1) (m = n * hw > 1), count[0] +=
   1. Evaluation (MGPU__BN_EVAL): mean and var from the running statistics (save_* untouched). y =
   (x - mean) * rstd * weight + bias. Backward (training's): dweight += sum(dy * xhat), dbias +=
   sum(dy), and dx (NULL: none) = weight * rstd * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat =
   (x - mean) * rstd. SyncBatchNorm's halves, around the replicas' exchange: MGPU__BN_STATS writes
   this replica's mean and sum of squared deviations (forward), or its sum(dy) and sum(dy * xhat)
   (backward, which also adds them to dweight and dbias), to sync [0, c) and [c, 2c);
   MGPU__BN_GIVEN reads the whole batch's mean, rstd and unbiased variance (forward: save_*,
   running statistics and y as training's), or mean(dy) and mean(dy * xhat) (backward: dx alone),
   from sync. A block per channel, sums in a fixed order, no atomics. */
enum { MGPU__BN_EVAL = 0, MGPU__BN_TRAIN = 1, MGPU__BN_STATS = 2, MGPU__BN_GIVEN = 3 };
int mgpu__cu_batch_norm(int dev, void* stream, int64_t n, int64_t c, int64_t hw, const float* x, const float* weight,
                        const float* bias, float* running_mean, float* running_var, float* count, int mode,
                        float momentum, float eps, float* save_mean, float* save_rstd, float* sync, float* y);
int mgpu__cu_batch_norm_backward(int dev, void* stream, int64_t n, int64_t c, int64_t hw, const float* x,
                                 const float* dy, const float* weight, const float* save_mean, const float* save_rstd,
                                 int mode, float* sync, float* dweight, float* dbias, float* dx);
/* dx[p, i] = dy[p] * scale for dx [planes, hw] (global average pooling's backward) */
int mgpu__cu_spread(int dev, void* stream, int64_t planes, int64_t hw, const float* dy, float scale, float* dx);
/* Causal attention's core. Forward, a row per (b, h, t): att (probabilities, 0 above the
   diagonal) = softmax of the masked scores; with mask (not NULL), mask[i] =
   mgpu__dropout_scale(seed, offset, first + i, p) on and below the diagonal, 0 above; y [batch,
   t, heads*head_size] = (att .* mask) v. seed_on_device as in mgpu__cu_dropout.
   Backward: dscores (overwritten, [batch, heads, t, t]) = att .* (dP - rowsum(dP .* att)) * scale
   with dP = (dy v^T) .* mask; dqkv (overwritten) = [dS k, dS^T q, (att .* mask)^T dy] per head.
   Every sum in a fixed order; no atomics. The layer runs these only for a head size above
   MGPU__CU_ATTN_FUSED_MAX_HEAD, with att, mask and dscores as scratch (forward again in backward).
   The fused pair below (FlashAttention-2's way) stores none of the T x T matrices: forward writes y
   and lse[b, h, t] (m + log of the row's sum of e^(score - m)); backward recomputes the
   probabilities from q, k and lse, and the dropout mask from its counters (the same as above),
   writes drow[b, h, t] = rowsum(dy .* y) = rowsum(dP .* att) and overwrites dqkv. p = 0: no
   dropout. */
#define MGPU__CU_ATTN_FUSED_MAX_HEAD 64
int mgpu__cu_attention_fused_forward(int dev, void* stream, const mgpu__attn* g, const float* qkv, float* y, float* lse,
                                     uint64_t seed, const uint64_t* seed_on_device, uint64_t offset, uint64_t first, float p);
int mgpu__cu_attention_fused_backward(int dev, void* stream, const mgpu__attn* g, const float* qkv, const float* y,
                                      const float* lse, const float* dy, float* drow, float* dqkv, uint64_t seed,
                                      const uint64_t* seed_on_device, uint64_t offset, uint64_t first, float p);
int mgpu__cu_attention_forward(int dev, void* stream, const mgpu__attn* g, const float* qkv, float* att, float* y,
                               float* mask, uint64_t seed, const uint64_t* seed_on_device, uint64_t offset,
                               uint64_t first, float p);
int mgpu__cu_attention_backward(int dev, void* stream, const mgpu__attn* g, const float* qkv, const float* att,
                                const float* mask, const float* dy, float* dscores, float* dqkv);

/* >>layer transformer. LayerNorm over the rows of x [rows, cols]: mean[r], rstd[r] =
   1 / sqrt(biased variance + eps), y = (x - mean) * rstd * weight + bias. */
int mgpu__cu_layer_norm(int dev, void* stream, int64_t rows, int cols, float eps, const float* x,
                        const float* weight, const float* bias, float* y, float* mean, float* rstd);
/* Its backward, xhat = (x - mean) * rstd: dweight += sum over rows of dy * xhat and dbias += sum
   over rows of dy (a fixed order: deterministic); dx (NULL: none) = rstd * (g - mean(g) -
   xhat * mean(g * xhat)) with g = dy * weight, the means over the row. */
int mgpu__cu_layer_norm_backward(int dev, void* stream, int64_t rows, int cols, const float* x, const float* weight,
                                 const float* mean, const float* rstd, const float* dy, float* dx,
                                 float* dweight, float* dbias);
/* y[p, :] = weight[ids[p], :] for the n ids; a row of NaN for an id outside [0, num) */
int mgpu__cu_embedding(int dev, void* stream, int64_t n, int num, int dim, const int32_t* ids,
                       const float* weight, float* y);
/* dweight[v, :] += dy[p, :] for each p with ids[p] == v, in increasing p, onto dweight itself
   (the CPU's order and bits); no atomics. Ids outside [0, num) add nowhere. */
int mgpu__cu_embedding_backward(int dev, void* stream, int64_t n, int num, int dim, const int32_t* ids,
                                const float* dy, float* dweight);

/* optimizers over a flat buffer, one fused kernel each; args in device memory (uploaded ahead of
   the step, so that a step replayed from a CUDA graph reads its own); momentum_buf NULL without
   momentum; no_decay: edge_count edges in device memory (mgpu__edges_upto), the elements in
   their ranges updated with weight_decay 0 (edge_count 0: every element decays) */
int mgpu__cu_sgd(int dev, void* stream, size_t n, float* param, const float* grad, float* momentum_buf,
                 const mgpu__sgd_args* args, const int64_t* no_decay, int edge_count);
int mgpu__cu_adamw(int dev, void* stream, size_t n, float* param, const float* grad, float* m, float* v,
                   const mgpu__adamw_args* args, const int64_t* no_decay, int edge_count);
/* sum[0] = the sum of x[i]^2 over n floats, added in float64 in an order that depends on n
   alone (deterministic). scratch: MGPU__CU_REDUCE_SCRATCH doubles. */
int mgpu__cu_sum_squares(int dev, void* stream, size_t n, const float* x, double* sum, double* scratch);
/* Clipping's coefficient on the device, for the update to read: norm[0] = sqrt(sums[0] + ... +
   sums[count - 1]) (added in that order, float64) as a float, scale[0] = mgpu__clip_scale(norm,
   max_norm). */
int mgpu__cu_clip_scale(int dev, void* stream, const double* sums, int count, float max_norm, float* norm, float* scale);

/* NCCL, loaded at run time with dlopen("libnccl.so.2"); nothing links against it */
int mgpu__cu_nccl_available(void);   /* 1 when the library loaded and has every symbol needed; else 0,
                                        mgpu__cu_error_message naming each library tried and why */
int mgpu__cu_nccl_comm_init_all(int count, const int* devs, void** comms);   /* comms[count] */
int mgpu__cu_nccl_comm_destroy(void* comm);
int mgpu__cu_nccl_group_start(void);
int mgpu__cu_nccl_group_end(void);
/* In-place float32 sum all-reduce of buf[n] on one rank; call for every rank inside a group. */
int mgpu__cu_nccl_allreduce_sum(int dev, void* comm, float* buf, size_t n, void* stream);
/* NCCL across processes: rank 0's unique id goes to every process (MPI_Bcast), then each process
   makes one communicator per local device, ranks first .. first + count - 1 of nranks, in one
   NCCL group. check: 0 while a communicator is healthy, else the NCCL error that broke it.
   abort: ncclCommAbort, for a communicator whose collective will never finish (a peer gone). */
#define MGPU__CU_NCCL_ID_BYTES 128
int mgpu__cu_nccl_across_processes(void);   /* 1 when the library has ncclGetUniqueId and friends */
int mgpu__cu_nccl_unique_id(void* id);
int mgpu__cu_nccl_comm_init_ranks(const void* id, int nranks, int first, int count, const int* devs, void** comms);
int mgpu__cu_nccl_comm_check(void* comm);
int mgpu__cu_nccl_comm_abort(void* comm);

/* The one-shot all-reduce of the P2P backend: one kernel on dev reads bufs[0..count)[0..n) (each
   reachable from dev: the same GPU, or peer access on), sums them in replica order
   ((b0 + b1) + b2) + ..., as the host backend does, and writes the sum into every buffer. */
#define MGPU__CU_ONESHOT_MAX 16
int mgpu__cu_allreduce_oneshot(int dev, void* stream, float* const* bufs, int count, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* seam */

/* ============================================================================================ */
/* >>impl                                                                                       */
/* ============================================================================================ */
#if defined(MGPU_IMPLEMENTATION) && !defined(MGPU__IMPLEMENTATION_DONE)
#define MGPU__IMPLEMENTATION_DONE

/* ---- >>impl config ---------------------------------------------------------------------- */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <errno.h>
#include <time.h>
#ifdef _WIN32
/* One Win32 path for MSVC and MinGW: threads, locks, the clock, the core count, memory, and
   files by UTF-16 names (mgpu's paths are UTF-8 everywhere). */
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#include <io.h>          /* _get_osfhandle, _fileno */
#include <process.h>     /* _beginthreadex */
#elif !defined(MGPU_NO_THREADS)
#include <pthread.h>
#include <sched.h>
#endif
/* The CPU's AVX2 and FMA code (the GEMM's micro-kernel): where the compiler targets them
   (-march=native, -mavx2 -mfma) always; else, on x86 with GCC or Clang, compiled for them anyway
   and chosen at run time when the CPU has them, so that a plain `cc -O2` build is as fast on such
   a CPU and still runs on any x86-64; with MSVC, whose intrinsics need no flag, the same through
   cpuid. MGPU_NO_CPU_DISPATCH leaves the portable code alone. */
#if defined(__AVX2__) && defined(__FMA__)
#define MGPU__AVX2_ALWAYS 1
#define MGPU__AVX2 1
#define MGPU__AVX2_FN
#define MGPU__HAVE_AVX2() 1
#elif (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && !defined(MGPU_NO_CPU_DISPATCH)
#define MGPU__AVX2 1
#define MGPU__AVX2_FN __attribute__((target("avx2,fma")))
#define MGPU__HAVE_AVX2() (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
#elif defined(_MSC_VER) && !defined(__clang__) && (defined(_M_X64) || defined(_M_IX86)) && !defined(MGPU_NO_CPU_DISPATCH)
/* MSVC compiles AVX2 intrinsics without /arch:AVX2 (which never says FMA): asked through cpuid */
#define MGPU__AVX2 1
#define MGPU__AVX2_FN
#define MGPU__HAVE_AVX2() mgpu__msvc_avx2_fma()
#define MGPU__MSVC_CPUID 1
#endif
#ifdef MGPU__AVX2
#include <immintrin.h>
#endif
/* aarch64 always has NEON: its GEMM micro-kernel makes the same fused multiply-adds in the same
   order as the AVX2 one, so an aarch64 build multiplies to the bits of an x86 one with AVX2 */
#if defined(__aarch64__) && !defined(MGPU_NO_CPU_DISPATCH)
#define MGPU__NEON 1
#include <arm_neon.h>
#endif
#ifdef MGPU__MSVC_CPUID
#include <intrin.h>
/* AVX2 and FMA present, and their registers saved by the OS (XGETBV); the same answer in every
   thread, so a race only asks twice */
static int mgpu__msvc_avx2_fma(void) {
    static int known = -1;
    if (known < 0) {
        int r[4], ok = 0;
        __cpuid(r, 0);
        if (r[0] >= 7) {
            __cpuid(r, 1);
            if (((r[2] >> 12) & 1) && ((r[2] >> 27) & 1) && ((r[2] >> 28) & 1) && (_xgetbv(0) & 6) == 6) {
                __cpuidex(r, 7, 0);
                ok = (r[1] >> 5) & 1;
            }
        }
        known = ok;
    }
    return known;
}
#endif
#ifdef MGPU_CBLAS
#ifdef __APPLE__
#include <Accelerate/Accelerate.h>   /* macOS's own BLAS: its CBLAS is in here */
#else
#include <cblas.h>       /* CPU GEMMs by the BLAS of your choice */
#endif
#endif
#ifdef MGPU_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1   /* MPI's C API only, also in C++ (the C++ bindings are deprecated) */
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>         /* a job of many processes (mpicc) */
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#include <fcntl.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
/* When a system header was read before _POSIX_C_SOURCE took effect, strict C hides fileno, and
   the calls and macros of the checkpoint writer (the same declarations again are harmless). */
#if !defined(__cplusplus) && !defined(fileno)
int fileno(FILE* stream);
#endif
#if !defined(__cplusplus)
int lstat(const char* path, struct stat* st);
ssize_t readlink(const char* path, char* buf, size_t size);
int kill(pid_t pid, int sig);
int setenv(const char* name, const char* value, int overwrite);
#endif
#ifndef S_ISLNK
#define S_ISLNK(m) (((m) & 0170000) == 0120000)
#endif
#ifndef S_ISSOCK
#define S_ISSOCK(m) (((m) & 0170000) == 0140000)
#endif
#endif

#if defined(MGPU_MALLOC) && defined(MGPU_REALLOC) && defined(MGPU_FREE)
/* all three supplied by the user */
#elif !defined(MGPU_MALLOC) && !defined(MGPU_REALLOC) && !defined(MGPU_FREE)
#define MGPU_MALLOC(sz) malloc(sz)
#define MGPU_REALLOC(p, sz) realloc(p, sz)
#define MGPU_FREE(p) free(p)
#else
#error "mgpu: define all of MGPU_MALLOC, MGPU_REALLOC and MGPU_FREE, or none of them"
#endif

#if defined(__cplusplus)
#define MGPU__TLS thread_local
#elif defined(_MSC_VER)
#define MGPU__TLS __declspec(thread)
#else
#define MGPU__TLS __thread
#endif

/* sokol-style default for zero-initialised description fields */
#define MGPU__DEF(v, d) ((v) ? (v) : (d))
#define MGPU__MIN(a, b) ((a) < (b) ? (a) : (b))
#define MGPU__MAX(a, b) ((a) > (b) ? (a) : (b))

#ifdef __cplusplus
extern "C" {
#endif

static void* mgpu__calloc(size_t count, size_t size) {
    void* p;
    if (size && count > SIZE_MAX / size) return NULL;
    p = MGPU_MALLOC(count * size);
    if (p) memset(p, 0, count * size);
    return p;
}

/* Files by name: mgpu's paths are UTF-8 on every platform. Windows' narrow-character calls read
   a name in the local code page, so there a name goes through UTF-16 (_wfopen, CreateFileW). */
#ifdef _WIN32
/* path in UTF-16, in a new buffer; NULL with errno EINVAL (not UTF-8) or ENOMEM. A path too long
   for the calls' MAX_PATH (260) is made absolute with the \\?\ prefix, which lifts that limit. */
static wchar_t* mgpu__wide_path(const char* path) {
    int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, NULL, 0);
    wchar_t *w, *full;
    DWORD len;
    if (n <= 0) { errno = EINVAL; return NULL; }
    w = (wchar_t*)MGPU_MALLOC((size_t)n * sizeof(wchar_t));
    if (!w) { errno = ENOMEM; return NULL; }
    MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, w, n);
    if (n < MAX_PATH - 12 || wcsncmp(w, L"\\\\?\\", 4) == 0) return w;   /* (12: room for a temporary suffix) */
    len = GetFullPathNameW(w, 0, NULL, NULL);
    full = len ? (wchar_t*)MGPU_MALLOC(((size_t)len + 8) * sizeof(wchar_t)) : NULL;
    if (!full) { MGPU_FREE(w); errno = len ? ENOMEM : EINVAL; return NULL; }
    if (wcsncmp(w, L"\\\\", 2) == 0 && GetFullPathNameW(w, len, full + 6, NULL)) {   /* \\server\share: \\?\UNC\server\share */
        memcpy(full, L"\\\\?\\UN", 6 * sizeof(wchar_t));
        full[6] = L'C';
    } else if (GetFullPathNameW(w, len, full + 4, NULL)) {
        memcpy(full, L"\\\\?\\", 4 * sizeof(wchar_t));
    } else {
        MGPU_FREE(full);
        MGPU_FREE(w);
        errno = EINVAL;
        return NULL;
    }
    MGPU_FREE(w);
    return full;
}
/* What a Win32 error code means, in this thread's buffer. */
static const char* mgpu__win_error(DWORD code) {
    static MGPU__TLS char text[256];
    DWORD n = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, NULL, code, 0, text, sizeof text, NULL);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' ' || text[n - 1] == '.')) text[--n] = 0;
    if (!n) snprintf(text, sizeof text, "Windows error %lu", (unsigned long)code);
    return text;
}
#endif

MGPUDEF double mgpu_seconds(void) {
#if defined(_WIN32)
    static LARGE_INTEGER hz;   /* fixed at boot; a race here writes the same value */
    LARGE_INTEGER now;
    if (!hz.QuadPart) QueryPerformanceFrequency(&hz);
    QueryPerformanceCounter(&now);
    return (double)now.QuadPart / (double)hz.QuadPart;
#elif defined(CLOCK_MONOTONIC)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

/* ---- >>impl result ---------------------------------------------------------------------- */
static MGPU__TLS char mgpu__error_text[1024];
static MGPU__TLS mgpu_result mgpu__error_code;
static mgpu_log_fn mgpu__log_fn;
static void* mgpu__log_user;

MGPUDEF const char* mgpu_result_string(mgpu_result r) {
    switch (r) {
#define MGPU__STRING_ITEM(name, value, text) case name: return text;
        MGPU_RESULT_LIST(MGPU__STRING_ITEM)
#undef MGPU__STRING_ITEM
    default: return "unknown result";
    }
}
MGPUDEF const char* mgpu_last_error(void) { return mgpu__error_text; }
MGPUDEF mgpu_result mgpu_last_result(void) { return mgpu__error_code; }
MGPUDEF void mgpu_clear_error(void) { mgpu__error_text[0] = 0; mgpu__error_code = MGPU_OK; }
MGPUDEF void mgpu_log_set_callback(mgpu_log_fn fn, void* user) { mgpu__log_fn = fn; mgpu__log_user = user; }

/* s in buf, its middle replaced by "..." when it is longer than size - 1 bytes (both ends say
   the most: a list's first and last items, a path's folder and file). */
static const char* mgpu__text_middle(const char* s, char* buf, size_t size) {
    const size_t n = strlen(s);
    size_t head, tail;
    if (n < size) { memcpy(buf, s, n + 1); return buf; }
    head = (size - 4) / 2;
    tail = size - 4 - head;
    while (head > 0 && ((uint8_t)s[head] & 0xC0) == 0x80) --head;             /* not inside a UTF-8 character */
    while (tail > 0 && ((uint8_t)s[n - tail] & 0xC0) == 0x80) --tail;
    snprintf(buf, size, "%.*s...%s", (int)head, s, s + n - tail);
    return buf;
}

/* fmt with ap into out (size bytes). A message that does not fit loses its middle, never its
   end: "mgpu_model_save: cannot write '/a/b...y/z.safetensors': No such file or directory" keeps
   the op at its start and the reason at its end, whatever a 100 kB device spec or a 5,000-byte
   path in between. One place for every message (errors, mgpu_fail, warnings), so no call site
   has to cap its inputs. The cut moves off a UTF-8 sequence's middle. */
static void mgpu__vformat(char* out, size_t size, const char* fmt, va_list ap) {
    char first[1024];   /* not out: an argument may point into it (the last error again) */
    va_list again;
    int n;
    va_copy(again, ap);
    n = vsnprintf(first, sizeof first, fmt, ap);
    if (n >= 0 && (size_t)n < size && (size_t)n < sizeof first) memcpy(out, first, (size_t)n + 1);
    else if (n >= 0) {
        char* all = (char*)MGPU_MALLOC((size_t)n + 1);
        if (all && vsnprintf(all, (size_t)n + 1, fmt, again) == n && (size_t)n < size) memcpy(out, all, (size_t)n + 1);
        else if (all) {
            (void)mgpu__text_middle(all, out, size);
        } else {   /* no memory for the whole: its start, as vsnprintf cuts */
            snprintf(out, size, "%s", first);
        }
        MGPU_FREE(all);
    } else {
        snprintf(out, size, "%s", first);
    }
    va_end(again);
}

static void mgpu__log(mgpu_log_level level, const char* fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    mgpu__vformat(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (mgpu__log_fn) {
        mgpu__log_fn(level, msg, mgpu__log_user);
#ifdef MGPU_CUDA
        (void)mgpu__cu_device_unknown();   /* the callback may have changed the current device */
#endif
    } else if (level != MGPU_LOG_ERROR) {
        fprintf(stderr, "mgpu: %s\n", msg);
    }
}

/* Record why an operation failed ("mgpu_matmul: ...") and return the code. */
static mgpu_result mgpu__vfail(mgpu_result r, const char* fmt, va_list ap) {
    mgpu__vformat(mgpu__error_text, sizeof mgpu__error_text, fmt, ap);
    mgpu__error_code = r;
    if (mgpu__log_fn) mgpu__log_fn(MGPU_LOG_ERROR, mgpu__error_text, mgpu__log_user);
    return r;
}
static mgpu_result mgpu__fail(mgpu_result r, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    r = mgpu__vfail(r, fmt, ap);
    va_end(ap);
    return r;
}

MGPUDEF mgpu_result mgpu_fail(mgpu_result r, const char* fmt, ...) {
    va_list ap;
    if (!fmt) return mgpu__fail(r, "(no message)");
    va_start(ap, fmt);
    r = mgpu__vfail(r, fmt, ap);
    va_end(ap);
    return r;
}

/* Re-prefix the last error with where it happened (once: a message that already starts with
   `where` keeps its prefix). */
static mgpu_result mgpu__refail(const char* where) {
    char msg[sizeof mgpu__error_text];
    const size_t n = strlen(where);
    const mgpu_result r = mgpu__error_code ? mgpu__error_code : MGPU_ERROR_INVALID_ARGUMENT;
    if (strncmp(mgpu__error_text, where, n) == 0 && mgpu__error_text[n] == ':') {
        mgpu__error_code = r;
        if (mgpu__log_fn) mgpu__log_fn(MGPU_LOG_ERROR, mgpu__error_text, mgpu__log_user);
        return r;
    }
    memcpy(msg, mgpu__error_text, sizeof msg);
    return mgpu__fail(r, "%s: %s", where, msg);
}

/* A layer's own failure r, behind where it happened: with the layer's message (its code, not the
   one of an earlier, unrelated failure: the caller cleared the error before calling it), or
   saying that it gave none. */
static mgpu_result mgpu__layer_refail(mgpu_result r, const char* where) {
    if (r == MGPU_OK) r = MGPU_ERROR_INVALID_ARGUMENT;
    if (!mgpu__error_text[0])
        return mgpu__fail(r, "%s: failed with '%s' and no message (a layer of your own can give one: mgpu_fail)", where,
                          mgpu_result_string(r));
    mgpu__error_code = r;
    return mgpu__refail(where);
}

/* ---- >>impl threads: a small pool for the CPU backend ----------------------------------- */
/* parallel_for(n, fn, ctx) runs fn(ctx, 0..n-1) on up to mgpu_cpu_threads() threads. Tasks are
   coarse (a block of GEMM rows, a slice of a vector). A call made while the pool is busy (from
   another thread, e.g. a CPU replica) runs inline, so the pool never deadlocks.
   Waking a sleeping thread takes tens of microseconds, and in a virtual machine, whose idle CPU
   the hypervisor must wake, up to a hundred or more: as long as a whole GEMM of the MLP (13
   MFLOP, 90 us on 2 cores). So the workers, and a caller waiting for their tasks, first watch
   for a while (MGPU_CPU_SPIN_US, 1 ms by default, after the last job), yielding the core on
   each look in case another thread wants it, and only then sleep, as OpenMP runtimes and
   OpenBLAS do. (MGPU_CPU_SPIN_US=0 sleeps at once: for a machine whose cores other programs
   need, like OMP_WAIT_POLICY=passive.) The fields watched without the lock are written with
   atomic stores (under the lock, as ever). */

/* The few thread primitives the library uses, on POSIX threads or on Win32 (SRW locks, condition
   variables, one-time initialisation, _beginthreadex): the rest of the file calls only these.
   Static initialisers: MGPU__MUTEX_INIT, MGPU__COND_INIT, MGPU__ONCE_INIT. A thread's main is
   declared with MGPU__THREAD_MAIN(name, arg) and ends with MGPU__THREAD_END. */
#ifndef MGPU_NO_THREADS
#ifdef _WIN32
typedef SRWLOCK mgpu__mutex;
typedef CONDITION_VARIABLE mgpu__cond;
typedef INIT_ONCE mgpu__once;
typedef HANDLE mgpu__thread;
typedef DWORD mgpu__thread_id;
#define MGPU__MUTEX_INIT SRWLOCK_INIT
#define MGPU__COND_INIT CONDITION_VARIABLE_INIT
#define MGPU__ONCE_INIT INIT_ONCE_STATIC_INIT
#define MGPU__THREAD_MAIN(name, arg) static unsigned __stdcall name(void* arg)
#define MGPU__THREAD_END return 0
typedef unsigned(__stdcall* mgpu__thread_main)(void*);
static int mgpu__mutex_init(mgpu__mutex* m) { InitializeSRWLock(m); return 0; }
static void mgpu__mutex_destroy(mgpu__mutex* m) { (void)m; }   /* an SRW lock owns nothing */
static void mgpu__mutex_lock(mgpu__mutex* m) { AcquireSRWLockExclusive(m); }
static void mgpu__mutex_unlock(mgpu__mutex* m) { ReleaseSRWLockExclusive(m); }
static int mgpu__cond_init(mgpu__cond* c) { InitializeConditionVariable(c); return 0; }
static void mgpu__cond_destroy(mgpu__cond* c) { (void)c; }
static void mgpu__cond_wait(mgpu__cond* c, mgpu__mutex* m) { SleepConditionVariableSRW(c, m, INFINITE, 0); }
static void mgpu__cond_broadcast(mgpu__cond* c) { WakeAllConditionVariable(c); }
/* InitOnceExecuteOnce passes data pointers only: the function travels in a struct */
typedef struct mgpu__once_fn { void (*fn)(void); } mgpu__once_fn;
static BOOL CALLBACK mgpu__once_call(PINIT_ONCE once, PVOID param, PVOID* ctx) {
    (void)once; (void)ctx;
    ((const mgpu__once_fn*)param)->fn();
    return TRUE;
}
static void mgpu__once_run(mgpu__once* once, void (*fn)(void)) {
    mgpu__once_fn call;
    call.fn = fn;
    InitOnceExecuteOnce(once, mgpu__once_call, &call, NULL);
}
static int mgpu__thread_start(mgpu__thread* t, mgpu__thread_main fn, void* arg) {
    *t = (HANDLE)_beginthreadex(NULL, 0, fn, arg, 0, NULL);
    return *t ? 0 : -1;
}
static void mgpu__thread_join(mgpu__thread t) { WaitForSingleObject(t, INFINITE); CloseHandle(t); }
static void mgpu__thread_detach(mgpu__thread t) { CloseHandle(t); }
static mgpu__thread_id mgpu__thread_self(void) { return GetCurrentThreadId(); }
static int mgpu__thread_same(mgpu__thread_id a, mgpu__thread_id b) { return a == b; }
static void mgpu__thread_yield(void) { SwitchToThread(); }
#else
typedef pthread_mutex_t mgpu__mutex;
typedef pthread_cond_t mgpu__cond;
typedef pthread_once_t mgpu__once;
typedef pthread_t mgpu__thread;
typedef pthread_t mgpu__thread_id;
#define MGPU__MUTEX_INIT PTHREAD_MUTEX_INITIALIZER
#define MGPU__COND_INIT PTHREAD_COND_INITIALIZER
#define MGPU__ONCE_INIT PTHREAD_ONCE_INIT
#define MGPU__THREAD_MAIN(name, arg) static void* name(void* arg)
#define MGPU__THREAD_END return NULL
typedef void* (*mgpu__thread_main)(void*);
static int mgpu__mutex_init(mgpu__mutex* m) { return pthread_mutex_init(m, NULL); }
static void mgpu__mutex_destroy(mgpu__mutex* m) { pthread_mutex_destroy(m); }
static void mgpu__mutex_lock(mgpu__mutex* m) { pthread_mutex_lock(m); }
static void mgpu__mutex_unlock(mgpu__mutex* m) { pthread_mutex_unlock(m); }
static int mgpu__cond_init(mgpu__cond* c) { return pthread_cond_init(c, NULL); }
static void mgpu__cond_destroy(mgpu__cond* c) { pthread_cond_destroy(c); }
static void mgpu__cond_wait(mgpu__cond* c, mgpu__mutex* m) { pthread_cond_wait(c, m); }
static void mgpu__cond_broadcast(mgpu__cond* c) { pthread_cond_broadcast(c); }
static void mgpu__once_run(mgpu__once* once, void (*fn)(void)) { pthread_once(once, fn); }
static int mgpu__thread_start(mgpu__thread* t, mgpu__thread_main fn, void* arg) { return pthread_create(t, NULL, fn, arg); }
static void mgpu__thread_join(mgpu__thread t) { pthread_join(t, NULL); }
static void mgpu__thread_detach(mgpu__thread t) { pthread_detach(t); }
static mgpu__thread_id mgpu__thread_self(void) { return pthread_self(); }
static int mgpu__thread_same(mgpu__thread_id a, mgpu__thread_id b) { return pthread_equal(a, b); }
static void mgpu__thread_yield(void) { sched_yield(); }
#endif
#endif

/* ---- >>impl threads, settings: every MGPU_* environment variable read one way ---- */
/* A setting is a number (with its range and unit), a flag or one of a few words, read by the
   functions below and by nothing else:
   - surrounding spaces are ignored; an empty value (or only spaces) is no value: the default;
   - a number is decimal ("250", "0.5", "1e3"): not "inf", "nan", "0x10" or "12us"; a whole
     number where the setting counts something ("2.5" threads is refused); one outside the range
     is the nearest end of it;
   - a flag is 0/1, true/false, on/off or yes/no, in any case; a word, one of the setting's own;
   - anything else is never guessed at: a warning names the variable, the value and what is used
     instead (once per variable and value in a process: a setting read at every model warns
     once), and the job goes on.
   tests/emu/runtime.cpp carries a copy of these rules for the emulator's MGPU_EMU_* variables
   (tests/emu/test_emu.c checks that the two agree); docs/guide.md lists every variable. */
#ifndef MGPU_NO_THREADS
static mgpu__mutex mgpu__setting_lock = MGPU__MUTEX_INIT;
#endif
static struct { uint64_t name, value; } mgpu__setting_warned[64];   /* FNV-1a hashes */
static int mgpu__setting_warned_count;

static int mgpu__setting_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* The value of `name` without its surrounding spaces: [*at, *at + *len), and 1; 0 when the
   variable is unset or empty. */
static int mgpu__setting_text(const char* name, const char** at, size_t* len) {
    const char* v = getenv(name);
    size_t n;
    if (!v) return 0;
    while (mgpu__setting_space(*v)) ++v;
    n = strlen(v);
    while (n > 0 && mgpu__setting_space(v[n - 1])) --n;
    *at = v;
    *len = n;
    return n > 0;
}

static uint64_t mgpu__setting_hash(const char* s) {   /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (; s && *s; ++s) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Warns "NAME='value' <why>; using <instead>", unless this variable had this value warned about
   already (the table's 64 entries outlast any program's settings). */
static void mgpu__setting_warn(const char* name, const char* why, const char* instead) {
    const char* v = getenv(name);
    const uint64_t n = mgpu__setting_hash(name), h = mgpu__setting_hash(v);
    int i, seen = 0;
#ifndef MGPU_NO_THREADS
    mgpu__mutex_lock(&mgpu__setting_lock);
#endif
    for (i = 0; i < mgpu__setting_warned_count && !seen; ++i)
        seen = mgpu__setting_warned[i].name == n && mgpu__setting_warned[i].value == h;
    if (!seen && mgpu__setting_warned_count < (int)(sizeof mgpu__setting_warned / sizeof mgpu__setting_warned[0])) {
        mgpu__setting_warned[mgpu__setting_warned_count].name = n;
        mgpu__setting_warned[mgpu__setting_warned_count++].value = h;
    }
#ifndef MGPU_NO_THREADS
    mgpu__mutex_unlock(&mgpu__setting_lock);
#endif
    if (!seen) mgpu__log(MGPU_LOG_WARN, "%s='%s' %s; using %s", name, v ? v : "", why, instead);
}

/* The number `name` gives, in [min, max] (whole when `whole`), or def when it gives none or
   something that is not one. unit names what it counts, for the warning ("seconds"). */
static double mgpu__setting_read_number(const char* name, double min, double max, double def, int whole, const char* unit) {
    const char* at;
    size_t len, i;
    char text[64], *end = NULL, why[160], instead[64];
    double v;
    if (!mgpu__setting_text(name, &at, &len)) return def;
    for (i = 0; i < len && i < sizeof text - 1; ++i) {   /* decimal only: no inf, nan, hex; 63 characters at most */
        const char c = at[i];
        if (!((c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.' || c == 'e' || c == 'E')) break;
        text[i] = c;
    }
    text[i] = 0;
    v = i == len ? strtod(text, &end) : 0.0;
    if (i != len || end != text + len || v != v) {
        snprintf(why, sizeof why, "is not %s number of %s", whole ? "a whole" : "a", unit);
        snprintf(instead, sizeof instead, "%.15g", def);
        mgpu__setting_warn(name, why, instead);
        return def;
    }
    if (whole && v >= min && v <= max && v != floor(v)) {
        snprintf(why, sizeof why, "is not a whole number of %s", unit);
        snprintf(instead, sizeof instead, "%.15g", def);
        mgpu__setting_warn(name, why, instead);
        return def;
    }
    if (v < min || v > max) {   /* 1e999 too: strtod's HUGE_VAL */
        const double nearest = v < min ? min : max;
        snprintf(why, sizeof why, "is outside %.15g..%.15g %s", min, max, unit);
        snprintf(instead, sizeof instead, "%.15g", nearest);
        mgpu__setting_warn(name, why, instead);
        return nearest;
    }
    return v;
}
static double mgpu__setting_number(const char* name, double min, double max, double def, const char* unit) {
    return mgpu__setting_read_number(name, min, max, def, 0, unit);
}
static long mgpu__setting_whole(const char* name, long min, long max, long def, const char* unit) {
    return (long)mgpu__setting_read_number(name, (double)min, (double)max, (double)def, 1, unit);
}

/* Whether `s` (n bytes) is `word`, in any case. */
static int mgpu__setting_is(const char* s, size_t n, const char* word) {
    size_t i;
    for (i = 0; i < n; ++i) {
        const char a = s[i] >= 'A' && s[i] <= 'Z' ? (char)(s[i] - 'A' + 'a') : s[i];
        if (!word[i] || a != word[i]) return 0;
    }
    return word[n] == 0;
}

/* The index of the word `name` gives among words[0..count-1], or def (no value, or another
   word). */
static int mgpu__setting_choice(const char* name, const char* const* words, int count, int def) {
    const char* at;
    size_t len, used = 0;
    char why[160];
    int i;
    if (!mgpu__setting_text(name, &at, &len)) return def;
    for (i = 0; i < count; ++i)
        if (mgpu__setting_is(at, len, words[i])) return i;
    used = (size_t)snprintf(why, sizeof why, "is not");
    for (i = 0; i < count && used < sizeof why; ++i)
        used += (size_t)snprintf(why + used, sizeof why - used, "%s %s", i == 0 ? "" : i == count - 1 ? " or" : ",", words[i]);
    mgpu__setting_warn(name, why, words[def]);
    return def;
}

/* A flag: 1 for 1/true/on/yes, 0 for 0/false/off/no (any case), def otherwise. */
static int mgpu__setting_flag(const char* name, int def) {
    static const char* const words[8] = { "0", "1", "false", "true", "off", "on", "no", "yes" };
    const char* at;
    size_t len;
    int i;
    if (!mgpu__setting_text(name, &at, &len)) return def;
    for (i = 0; i < 8; ++i)
        if (mgpu__setting_is(at, len, words[i])) return i % 2;
    mgpu__setting_warn(name, "is not 0/1, true/false, on/off or yes/no", def ? "1 (on)" : "0 (off)");
    return def;
}

/* Cores this process may run on: every logical processor of every group on Windows, the online
   ones on POSIX; 0 when the system does not say. */
static long mgpu__core_count(void) {
#if defined(_WIN32)
    return (long)GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
#elif defined(_SC_NPROCESSORS_ONLN)
    return sysconf(_SC_NPROCESSORS_ONLN);
#else
    return 0;
#endif
}

typedef void (*mgpu__task_fn)(void* ctx, int64_t task);
static int mgpu__cpu_thread_count;   /* 0 until first asked */

MGPUDEF void mgpu_cpu_set_threads(int n) { mgpu__cpu_thread_count = n > 0 ? n : 1; }
MGPUDEF int mgpu_cpu_threads(void) {
    if (mgpu__cpu_thread_count <= 0) {   /* MGPU_CPU_THREADS: 1..256, 0 (or none) for every core */
        const long cores = MGPU__MIN(mgpu__core_count(), 256);
        long n = mgpu__setting_whole("MGPU_CPU_THREADS", 0, 256, cores, "threads (0: every core)");
        if (n <= 0) n = cores;
        mgpu__cpu_thread_count = n > 0 ? (int)n : 1;
    }
    return mgpu__cpu_thread_count;
}

#ifndef MGPU_NO_THREADS
#define MGPU__POOL_SPIN_US_DEFAULT 1000
#if defined(__GNUC__) || defined(__clang__)
#define MGPU__WATCH(field) __atomic_load_n(&(field), __ATOMIC_ACQUIRE)
#define MGPU__PUBLISH(field, value) __atomic_store_n(&(field), (value), __ATOMIC_RELEASE)
#else   /* no atomics to watch with: sleep at once */
#define MGPU__PUBLISH(field, value) ((field) = (value))
#endif
typedef struct mgpu__pool {
    mgpu__mutex lock;
    mgpu__cond work_ready, work_done;
    int workers;               /* threads started (the caller is one more) */
    int busy;                  /* a parallel_for is running */
    uint64_t generation;       /* bumped for every job */
    mgpu__task_fn fn;
    void* ctx;
    int64_t next, count, finished;
    int active;                /* workers still inside the current job */
    uint64_t sleeps;           /* times a worker went to sleep (tests read it) */
} mgpu__pool;
static mgpu__pool mgpu__the_pool = { MGPU__MUTEX_INIT, MGPU__COND_INIT,
                                     MGPU__COND_INIT, 0, 0, 0, NULL, NULL, 0, 0, 0, 0, 0 };

/* Seconds of watching before a sleep: MGPU_CPU_SPIN_US (whole microseconds, at most a second),
   read once, on the first job (mgpu__pool_setup). */
static double mgpu__pool_spin_from_env(void) {
    return (double)mgpu__setting_whole("MGPU_CPU_SPIN_US", 0, 1000000L, MGPU__POOL_SPIN_US_DEFAULT, "microseconds") * 1e-6;
}
/* set once, before any worker starts (tests change it under the pool's lock) */
static double mgpu__pool_spin = MGPU__POOL_SPIN_US_DEFAULT * 1e-6;

static void mgpu__pool_drain(mgpu__pool* p) {   /* called with p->lock held */
    while (p->next < p->count) {
        int64_t task = p->next++;
        mgpu__mutex_unlock(&p->lock);
        p->fn(p->ctx, task);
        mgpu__mutex_lock(&p->lock);
        MGPU__PUBLISH(p->finished, p->finished + 1);
    }
}

/* Called with p->lock held; returns with it held, once a job newer than seen has come (worker)
   or the current job is done (caller), or the watch has lasted mgpu__pool_spin seconds. */
static void mgpu__pool_watch(mgpu__pool* p, int worker, uint64_t seen) {
#ifdef MGPU__WATCH
    double until;
    if (mgpu__pool_spin <= 0.0) return;
    until = mgpu_seconds() + mgpu__pool_spin;
    mgpu__mutex_unlock(&p->lock);
    while (worker ? MGPU__WATCH(p->generation) == seen
                  : MGPU__WATCH(p->finished) < MGPU__WATCH(p->count) || MGPU__WATCH(p->active) > 0) {
        if (mgpu_seconds() > until) break;
        mgpu__thread_yield();
    }
    mgpu__mutex_lock(&p->lock);
#else
    (void)p; (void)worker; (void)seen;
#endif
}

MGPU__THREAD_MAIN(mgpu__pool_worker, arg) {
    mgpu__pool* p = (mgpu__pool*)arg;
    uint64_t seen = 0;
    mgpu__mutex_lock(&p->lock);
    for (;;) {
        if (p->generation == seen) mgpu__pool_watch(p, 1, seen);
        if (p->generation == seen) p->sleeps++;
        while (p->generation == seen) mgpu__cond_wait(&p->work_ready, &p->lock);
        seen = p->generation;
        MGPU__PUBLISH(p->active, p->active + 1);
        mgpu__pool_drain(p);
        MGPU__PUBLISH(p->active, p->active - 1);
        if (p->finished == p->count && p->active == 0) mgpu__cond_broadcast(&p->work_done);
    }
    MGPU__THREAD_END;
}

/* fork(): the child has only the thread that forked, so its copy of the pool has no workers, and
   perhaps a job half done or the lock taken by a thread that is not there. The lock is taken
   around the fork, so that no thread is inside a change of the pool when the process is copied;
   the child starts again from an empty pool, which grows on its first job (as OpenBLAS and
   PyTorch's pools do). Only the pool: the library's other locks (devices' allocators, the list of
   live objects) are not taken, so fork while no other thread is inside an mgpu call. Windows has
   no fork. */
#ifndef _WIN32
static void mgpu__pool_before_fork(void) { mgpu__mutex_lock(&mgpu__the_pool.lock); }
static void mgpu__pool_after_fork_parent(void) { mgpu__mutex_unlock(&mgpu__the_pool.lock); }
static void mgpu__pool_after_fork_child(void) {
    mgpu__pool* p = &mgpu__the_pool;
    mgpu__mutex_unlock(&p->lock);   /* taken by this thread before the fork */
    mgpu__cond_init(&p->work_ready);
    mgpu__cond_init(&p->work_done);
    p->workers = p->busy = p->active = 0;
    p->next = p->count = p->finished = 0;
}
#endif

/* What the pool needs once, before its first worker starts: the spin, and the fork handlers. */
static mgpu__once mgpu__pool_setup_once = MGPU__ONCE_INIT;
static void mgpu__pool_setup(void) {
    mgpu__pool_spin = mgpu__pool_spin_from_env();
#ifndef _WIN32
    (void)pthread_atfork(mgpu__pool_before_fork, mgpu__pool_after_fork_parent, mgpu__pool_after_fork_child);
#endif
}
#endif

static void mgpu__parallel_for(int64_t count, mgpu__task_fn fn, void* ctx) {
    int64_t i;
#ifndef MGPU_NO_THREADS
    mgpu__pool* p = &mgpu__the_pool;
    int want = mgpu_cpu_threads() - 1;
    if (count > 1 && want > 0) {
        mgpu__once_run(&mgpu__pool_setup_once, mgpu__pool_setup);
        mgpu__mutex_lock(&p->lock);
        if (!p->busy) {
            while (p->workers < want) {   /* grow lazily; a failed start just means fewer */
                mgpu__thread t;
                if (mgpu__thread_start(&t, mgpu__pool_worker, p) != 0) break;
                mgpu__thread_detach(t);
                p->workers++;
            }
            if (p->workers > 0) {
                p->busy = 1;
                p->fn = fn; p->ctx = ctx;
                p->next = 0;
                MGPU__PUBLISH(p->count, count);
                MGPU__PUBLISH(p->finished, 0);
                MGPU__PUBLISH(p->generation, p->generation + 1);
                mgpu__cond_broadcast(&p->work_ready);
                mgpu__pool_drain(p);
                if (p->finished < p->count || p->active > 0) mgpu__pool_watch(p, 0, 0);
                while (p->finished < p->count || p->active > 0) mgpu__cond_wait(&p->work_done, &p->lock);
                p->busy = 0;
                mgpu__mutex_unlock(&p->lock);
                return;
            }
        }
        mgpu__mutex_unlock(&p->lock);
    }
#endif
    for (i = 0; i < count; ++i) fn(ctx, i);
}

/* Elementwise work over n items, cut into about one slice per thread (none when small). */
typedef void (*mgpu__range_fn)(void* ctx, int64_t begin, int64_t end);
typedef struct mgpu__range_job { mgpu__range_fn fn; void* ctx; int64_t n, chunk; } mgpu__range_job;
static void mgpu__range_task(void* ctx, int64_t task) {
    mgpu__range_job* j = (mgpu__range_job*)ctx;
    int64_t b = task * j->chunk, e = MGPU__MIN(b + j->chunk, j->n);
    if (b < e) j->fn(j->ctx, b, e);
}
static void mgpu__parallel_range(int64_t n, int64_t min_per_task, mgpu__range_fn fn, void* ctx) {
    mgpu__range_job job;
    int64_t tasks = MGPU__MIN((int64_t)mgpu_cpu_threads(), n / MGPU__MAX(min_per_task, 1));
    if (tasks <= 1) { if (n > 0) fn(ctx, 0, n); return; }
    job.fn = fn; job.ctx = ctx; job.n = n; job.chunk = (n + tasks - 1) / tasks;
    mgpu__parallel_for(tasks, mgpu__range_task, &job);
}

/* ---- >>impl device ---------------------------------------------------------------------- */
/* This process's place in a job of several (mgpu_dist_init, >>impl parallel): "auto" and "cuda"
   mean the local rank's share of the GPUs. One process alone until then. */
static struct mgpu__dist_state {
    int joined, called_init, rank, size, local_rank, local_size;
    /* what a collective that times out reports (mgpu__dist_wait): the operation and step of the
       distributed model that called it, and every rank's host */
    const char* doing;
    int64_t step;
    char (*hosts)[64];
} mgpu__dist = { 0, 0, 0, 1, 0, 1, NULL, 0, NULL };
#ifdef MGPU_MPI
static MPI_Comm mgpu__dist_comm;   /* the library's own copy of MPI_COMM_WORLD: its messages never meet the program's */
#endif

/* A cached block of device (or host) memory, kept in a list sorted by size. */
typedef struct mgpu__block {
    void* ptr;
    size_t size;
    struct mgpu__block* next;
} mgpu__block;

typedef struct mgpu__allocator {
#ifndef MGPU_NO_THREADS
    mgpu__mutex lock;
#endif
    mgpu__block* cached;          /* free blocks, ascending size */
    mgpu_memory_stats stats;
    /* While a CUDA graph is captured on this device, the capturing thread's freed blocks go to
       the graph's own list (its part's `held`) and its requests are served from there first: the
       graph keeps working in them at every replay, so nothing else may get them until the graph
       is dropped. Other threads' requests never see them. */
    mgpu__block** held;
#ifndef MGPU_NO_THREADS
    mgpu__thread_id holder;
#endif
} mgpu__allocator;

/* A pinned host buffer that copies from pageable host memory to a GPU go through (>>impl memory):
   `read` is recorded on the device's stream after the copy out of it, and the buffer is filled
   again only once that event has run. */
typedef struct mgpu__staging {
    void* host;
    size_t capacity;
    void* read;
} mgpu__staging;
#define MGPU__STAGING_SLOTS 8   /* a step uploads its batch (rows and labels in one copy) and the
                                   optimizer's numbers to each device, with a CUDA graph and
                                   Dropout its key too */
#define MGPU__STAGING_MAX ((size_t)16 << 20)   /* larger copies wait instead (pinned memory is scarce) */

struct mgpu_device {
    mgpu_device_kind kind;
    int ordinal;                  /* CUDA device number */
    int replica;                  /* index in its set */
    char label[32];
    void* stream;                 /* CUDA: the compute stream every op of this device runs on */
    void* order;                  /* CUDA: an event, for another stream to wait for this one
                                     (mgpu_tensor_copy between two devices) */
    void* blas;                   /* CUDA: cuBLAS handle bound to stream */
    void* blas_workspace;         /* CUDA: its workspace, a block of this device's allocator */
    size_t blas_workspace_bytes;
    mgpu__allocator alloc;
    int64_t tensors;              /* live tensor storages on it (under alloc's lock): its set's
                                     destroy refuses while any (LIFETIMES) */
    mgpu__staging staging[MGPU__STAGING_SLOTS];   /* CUDA: used in turn, under alloc's lock */
    int staging_next;
    uint64_t staging_waits;       /* uploads that found their buffer still being read */
    mgpu_device_counters counters;   /* public (mgpu_device_get_counters), added to by MGPU__COUNT */
};

/* Counters are added to by the thread that queues the work; several threads may share a device
   (the CPU device, a loader's thread), so the add is atomic, relaxed: no order, no lock. */
#if defined(__GNUC__) || defined(__clang__)
#define MGPU__COUNT(dev, field, n) ((void)__atomic_fetch_add(&(dev)->counters.field, (uint64_t)(n), __ATOMIC_RELAXED))
#define MGPU__COUNT_READ(dev, field) __atomic_load_n(&(dev)->counters.field, __ATOMIC_RELAXED)
#define MGPU__COUNT_ZERO(dev, field) __atomic_store_n(&(dev)->counters.field, (uint64_t)0, __ATOMIC_RELAXED)
#else
#define MGPU__COUNT(dev, field, n) ((void)((dev)->counters.field += (uint64_t)(n)))
#define MGPU__COUNT_READ(dev, field) ((dev)->counters.field)
#define MGPU__COUNT_ZERO(dev, field) ((void)((dev)->counters.field = 0))
#endif
#define MGPU__COUNTER_LIST(X) X(rows_forward) X(rows_backward) X(ops) X(bytes_host_to_device) \
    X(bytes_device_to_host) X(bytes_device_to_device) X(bytes_allreduced) X(host_waits) X(allocs)

struct mgpu_device_set {
    int count;
    mgpu_device** devices;
    char spec[8 + 256 * 8];       /* "cuda:" and 256 ordinals (MGPU__MAX_REPLICAS) below 1000000, with commas */
    int models, allreduces;       /* users, under devices[0]'s allocator lock (LIFETIMES) */
};

/* The one dispatch mechanism between the two backends. Op bodies check their arguments, run
   the CPU loop for CPU tensors, and otherwise call the CUDA backend through these macros, the
   same code in both builds:
     MGPU__CUDA(call)         the call into mgpu_kernels.cu, and in a build without MGPU_CUDA
                              simply "no device": the call is only type-checked (sizeof does not
                              evaluate it), nothing links the .cu, and since no CUDA device can
                              exist there the line is never reached;
     MGPU__CU(op, dev, call)  the same call, returning its failure from the enclosing function
                              as an mgpu_result that names the operation and the device. */
#ifdef MGPU_CUDA
#define MGPU__CUDA(call) (call)
#define MGPU__CUDA_BUILT 1
#else
#define MGPU__CUDA(call) ((void)sizeof(call), MGPU__CU_ERR_NO_DEVICE)
#define MGPU__CUDA_BUILT 0
#endif
#define MGPU__CU(op, dev, call)                                            \
    do {                                                                   \
        int mgpu__rc_ = MGPU__CUDA(call);                                  \
        if (mgpu__rc_ != 0) return mgpu__cu_result(mgpu__rc_, op, dev);   \
    } while (0)

/* What the CUDA backend said about its last failure (this thread). */
static const char* mgpu__cuda_message(void) {
#ifdef MGPU_CUDA
    return mgpu__cu_error_message();
#else
    return "this program was built without CUDA (define MGPU_CUDA and link mgpu_kernels.cu)";
#endif
}

/* Turn a backend failure into an mgpu_result with the operation and the device named. */
static mgpu_result mgpu__cu_result(int code, const char* op, const mgpu_device* dev) {
    mgpu_result r;
    switch (code) {
    case MGPU__CU_ERR_CUBLAS: r = MGPU_ERROR_CUBLAS; break;
    case MGPU__CU_ERR_NCCL: r = MGPU_ERROR_NCCL; break;
    case MGPU__CU_ERR_OOM: r = MGPU_ERROR_OUT_OF_MEMORY; break;
    case MGPU__CU_ERR_NO_DEVICE: r = MGPU_ERROR_NO_DEVICE; break;
    case MGPU__CU_ERR_ARGUMENT: r = MGPU_ERROR_INVALID_ARGUMENT; break;
    default: r = MGPU_ERROR_CUDA; break;
    }
    return mgpu__fail(r, "%s on %s: %s", op, dev ? dev->label : "cuda", mgpu__cuda_message());
}

static void mgpu__allocator_init(mgpu__allocator* a) {
    memset(a, 0, sizeof *a);
#ifndef MGPU_NO_THREADS
    mgpu__mutex_init(&a->lock);
#endif
}

static void mgpu__device_init(mgpu_device* d, mgpu_device_kind kind, int ordinal, int replica) {
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->ordinal = ordinal;
    d->replica = replica;
    mgpu__allocator_init(&d->alloc);
}

static mgpu_device mgpu__cpu_device;
#ifndef MGPU_NO_THREADS
static mgpu__once mgpu__cpu_once = MGPU__ONCE_INIT;
#endif
static void mgpu__cpu_device_setup(void) {
    mgpu__device_init(&mgpu__cpu_device, MGPU_DEVICE_CPU, 0, 0);
    strcpy(mgpu__cpu_device.label, "cpu");
}
MGPUDEF mgpu_device* mgpu_device_cpu(void) {
#ifndef MGPU_NO_THREADS
    mgpu__once_run(&mgpu__cpu_once, mgpu__cpu_device_setup);
#else
    if (!mgpu__cpu_device.label[0]) mgpu__cpu_device_setup();
#endif
    return &mgpu__cpu_device;
}

MGPUDEF int mgpu_cuda_device_count(void) {
    int n = 0;
    if (MGPU__CUDA(mgpu__cu_device_count(&n)) != 0) return 0;
    return n;
}

static mgpu_result mgpu__memory_release_cached(mgpu_device* dev);
static void* mgpu__device_alloc(mgpu_device* dev, size_t bytes, size_t* block_size, const char* op);
static void mgpu__device_release(mgpu_device* dev, void* ptr, size_t size);
#define MGPU__BLAS_WORKSPACE ((size_t)32 << 20)

static void mgpu__device_free(mgpu_device* d) {
    if (!d || d == &mgpu__cpu_device) return;
    if (d->kind == MGPU_DEVICE_CUDA) {
        int i;
        if (d->stream) (void)MGPU__CUDA(mgpu__cu_stream_synchronize(d->ordinal, d->stream));
        for (i = 0; i < MGPU__STAGING_SLOTS; ++i) {
            mgpu_pinned_free(d->staging[i].host);
            if (d->staging[i].read) (void)MGPU__CUDA(mgpu__cu_event_destroy(d->ordinal, d->staging[i].read));
        }
        if (d->blas) (void)MGPU__CUDA(mgpu__cu_blas_destroy(d->ordinal, d->blas));
        /* cuBLAS's workspace after its handle, back to the cache that is emptied below */
        if (d->blas_workspace) mgpu__device_release(d, d->blas_workspace, d->blas_workspace_bytes);
        if (d->order) (void)MGPU__CUDA(mgpu__cu_event_destroy(d->ordinal, d->order));
        if (d->stream) (void)MGPU__CUDA(mgpu__cu_stream_destroy(d->ordinal, d->stream));
    }
    mgpu__memory_release_cached(d);
    if (d->alloc.stats.bytes_in_use)
        mgpu__log(MGPU_LOG_WARN, "%s destroyed while tensors still hold %zu bytes on it", d->label,
                  d->alloc.stats.bytes_in_use);
#ifndef MGPU_NO_THREADS
    mgpu__mutex_destroy(&d->alloc.lock);
#endif
    MGPU_FREE(d);
}

/* Live handles (LIFETIMES): device sets, models, optimizers, communicators, loaders and
   safetensors files are listed from their create to their destroy, so that destroying one a
   second time (or making a model on a destroyed set) is refused instead of freeing twice. Only
   pointer values are compared, nothing freed is read; a freed handle whose address a new object
   of the same kind took is not told apart. A few dozen entries at most: a linear scan. */
enum { MGPU__LIVE_SET = 1, MGPU__LIVE_MODEL, MGPU__LIVE_OPTIMIZER, MGPU__LIVE_ALLREDUCE, MGPU__LIVE_LOADER,
       MGPU__LIVE_SAFETENSORS };
typedef struct mgpu__live_entry { const void* p; int kind; } mgpu__live_entry;
static mgpu__live_entry* mgpu__live;
static int mgpu__live_count, mgpu__live_cap;
#ifndef MGPU_NO_THREADS
static mgpu__mutex mgpu__live_lock = MGPU__MUTEX_INIT;
#define MGPU__LIVE_LOCK() mgpu__mutex_lock(&mgpu__live_lock)
#define MGPU__LIVE_UNLOCK() mgpu__mutex_unlock(&mgpu__live_lock)
#else
#define MGPU__LIVE_LOCK() ((void)0)
#define MGPU__LIVE_UNLOCK() ((void)0)
#endif
/* MGPU_OK, or out of memory (named after op) with nothing listed. */
static mgpu_result mgpu__live_add(const void* p, int kind, const char* op) {
    mgpu_result r = MGPU_OK;
    MGPU__LIVE_LOCK();
    if (mgpu__live_count == mgpu__live_cap) {
        int cap = mgpu__live_cap ? 2 * mgpu__live_cap : 16;
        mgpu__live_entry* grown = (mgpu__live_entry*)MGPU_REALLOC(mgpu__live, (size_t)cap * sizeof *grown);
        if (grown) { mgpu__live = grown; mgpu__live_cap = cap; }
    }
    if (mgpu__live_count < mgpu__live_cap) {
        mgpu__live[mgpu__live_count].p = p;
        mgpu__live[mgpu__live_count++].kind = kind;
    } else r = MGPU_ERROR_OUT_OF_MEMORY;
    MGPU__LIVE_UNLOCK();
    return r ? mgpu__fail(r, "%s: out of host memory", op) : MGPU_OK;
}
static int mgpu__live_find(const void* p, int kind) {   /* under the lock */
    int i;
    for (i = 0; i < mgpu__live_count; ++i)
        if (mgpu__live[i].p == p && mgpu__live[i].kind == kind) return i;
    return -1;
}
/* 1 when p is a live handle of this kind; else 0 and an error naming op. */
static int mgpu__live_check(const void* p, int kind, const char* op, const char* what) {
    int found;
    MGPU__LIVE_LOCK();
    found = mgpu__live_find(p, kind) >= 0;
    MGPU__LIVE_UNLOCK();
    if (!found) mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %p is not a live %s (destroyed already?)", op, p, what);
    return found;
}
/* Unlist p (nothing if it is not listed: a create that failed); the list is freed once empty,
   so that a program which destroyed everything holds no memory of mgpu's. */
static void mgpu__live_remove(const void* p, int kind) {
    int i;
    MGPU__LIVE_LOCK();
    if ((i = mgpu__live_find(p, kind)) >= 0) mgpu__live[i] = mgpu__live[--mgpu__live_count];
    if (mgpu__live_count == 0) {
        MGPU_FREE(mgpu__live);
        mgpu__live = NULL;
        mgpu__live_cap = 0;
    }
    MGPU__LIVE_UNLOCK();
}

static void mgpu__lock(mgpu__allocator* a);
static void mgpu__unlock(mgpu__allocator* a);

/* A set's users come and go under its first device's allocator lock (models may be made on
   several threads). */
static void mgpu__set_users(const mgpu_device_set* set, int models, int allreduces) {
    mgpu_device_set* s = (mgpu_device_set*)set;   /* the count is the library's, not the caller's */
    if (!s || s->count < 1) return;
    mgpu__lock(&s->devices[0]->alloc);
    s->models += models;
    s->allreduces += allreduces;
    mgpu__unlock(&s->devices[0]->alloc);
}

static void mgpu__device_set_free(mgpu_device_set* set) {
    int i;
    if (!set) return;
    mgpu__live_remove(set, MGPU__LIVE_SET);
    for (i = 0; set->devices && i < set->count; ++i) mgpu__device_free(set->devices[i]);
    MGPU_FREE(set->devices);
    MGPU_FREE(set);
}

MGPUDEF mgpu_result mgpu_device_set_destroy(mgpu_device_set* set) {
    int64_t tensors = 0;
    int i, models = 0, allreduces = 0;
    char what[160];
    size_t len = 0;
    if (!set) return MGPU_OK;
    if (!mgpu__live_check(set, MGPU__LIVE_SET, "mgpu_device_set_destroy", "device set")) return MGPU_ERROR_INVALID_ARGUMENT;
    for (i = 0; set->devices && i < set->count; ++i) {
        if (set->devices[i] == &mgpu__cpu_device) continue;   /* the library's, which outlives every set */
        mgpu__lock(&set->devices[i]->alloc);
        tensors += set->devices[i]->tensors;
        mgpu__unlock(&set->devices[i]->alloc);
    }
    if (set->count >= 1) mgpu__lock(&set->devices[0]->alloc);
    models = set->models;
    allreduces = set->allreduces;
    if (set->count >= 1) mgpu__unlock(&set->devices[0]->alloc);
    if (!models && !allreduces && !tensors) { mgpu__device_set_free(set); return MGPU_OK; }
    what[0] = 0;
    if (models) len += (size_t)snprintf(what + len, sizeof what - len, "%d model%s", models, models == 1 ? "" : "s");
    if (allreduces && len < sizeof what)
        len += (size_t)snprintf(what + len, sizeof what - len, "%s%d communicator%s", len ? (tensors ? ", " : " and ") : "",
                                allreduces, allreduces == 1 ? "" : "s");
    if (tensors && len < sizeof what)
        snprintf(what + len, sizeof what - len, "%s%lld tensor%s", len ? " and " : "", (long long)tensors, tensors == 1 ? "" : "s");
    return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_device_set_destroy: %s still use%s this device set (%s); destroy them first",
                      what, (models + allreduces + tensors) == 1 ? "s" : "", set->spec);
}

/* Parse "N" or "N,M,..." into ordinals; returns how many, or -1 if malformed. */
static int mgpu__parse_list(const char* s, int* out, int max) {
    int n = 0;
    while (*s) {
        char* end;
        long v;
        if (*s < '0' || *s > '9') return -1;
        v = strtol(s, &end, 10);
        if (v > 1000000) return -1;
        if (n == max) return -2;   /* more than max: said apart, with the limit */
        out[n++] = (int)v;
        s = end;
        if (*s == ',') { ++s; if (!*s) return -1; }
        else if (*s) return -1;
    }
    return n;
}

#define MGPU__MAX_REPLICAS 256

static mgpu_device_set* mgpu__device_set_fail_free(mgpu_device_set* set) {
    mgpu__device_set_free(set);
    return NULL;
}

/* Step 1 of a device set: read the spec ("auto" resolved through MGPU_DEVICES and the GPUs
   present) into a device kind, a replica count and, for CUDA, the GPU of each replica. */
typedef struct mgpu__device_plan {
    int cuda;                             /* 1: CUDA replicas, 0: CPU replicas */
    int count;
    int ordinals[MGPU__MAX_REPLICAS];     /* CUDA: the GPU of each replica */
} mgpu__device_plan;

static mgpu_result mgpu__device_plan_from_spec(const char* spec, mgpu__device_plan* plan) {
    static const char* op = "mgpu_device_set_create";
    const char* s = spec ? spec : "auto";
    const char* from = "";   /* where the spec came from, for the messages */
    char trimmed[16 + MGPU__MAX_REPLICAS * 8];   /* MGPU_DEVICES without its surrounding spaces */
    int cuda_count = 0, i, rc;
    memset(plan, 0, sizeof *plan);
    if (strcmp(s, "auto") == 0 || !*s) {
        const char* env;
        size_t len;
        if (mgpu__setting_text("MGPU_DEVICES", &env, &len)) {   /* a longer one is no spec: said as given */
            if (len < sizeof trimmed) { memcpy(trimmed, env, len); trimmed[len] = 0; env = trimmed; }
            else env = getenv("MGPU_DEVICES");
            if (strcmp(env, "auto") != 0) { s = env; from = " (from MGPU_DEVICES)"; }
        }
    }
    rc = MGPU__CUDA(mgpu__cu_device_count(&cuda_count));
    if (rc != 0) cuda_count = 0;
    if (strcmp(s, "auto") == 0 || !*s) {   /* every GPU, or the CPU with a one-line notice */
        static int noticed = 0;
        if (cuda_count > 0) s = "cuda";
        else {
            if (!noticed && MGPU__CUDA_BUILT)
                mgpu__log(MGPU_LOG_INFO, "no GPU or no NVIDIA driver found, so \"auto\" runs on the CPU (CUDA says: %s)",
                          rc ? mgpu__cuda_message() : "0 devices");
            noticed = 1;
            s = "cpu";
        }
    }
    if (strcmp(s, "cpu") == 0) {
        plan->count = 1;
        return MGPU_OK;
    }
    if (strncmp(s, "cpu:", 4) == 0) {
        char* end;
        long n = strtol(s + 4, &end, 10);
        if (s[4] < '0' || s[4] > '9' || *end || n < 1 || n > MGPU__MAX_REPLICAS)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: bad device spec '%s'%s (cpu:N wants 1 <= N <= %d)",
                              op, s, from, MGPU__MAX_REPLICAS);
        plan->count = (int)n;
        return MGPU_OK;
    }
    if (strcmp(s, "cuda") != 0 && strncmp(s, "cuda:", 5) != 0)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT,
                          "%s: unknown device spec '%s'%s (want auto, cpu, cpu:N, cuda, cuda:0,1,...)", op, s, from);
    plan->cuda = 1;
    /* the syntax first: a malformed spec is reported as such on a machine without a GPU too */
    plan->count = s[4] == 0 ? 0 : mgpu__parse_list(s + 5, plan->ordinals, MGPU__MAX_REPLICAS);
    if (plan->count == -2)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: device spec '%s'%s names more than %d devices, the most a set has",
                          op, s, from, MGPU__MAX_REPLICAS);
    if (s[4] != 0 && plan->count <= 0)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: bad device spec '%s'%s (want cuda, cuda:0 or cuda:0,1,...)",
                          op, s, from);
    if (cuda_count == 0)
        return mgpu__fail(MGPU_ERROR_NO_DEVICE, "%s: device spec '%s'%s: no CUDA device (%s)", op, s, from,
                          mgpu__cuda_message());
    if (s[4] == 0) {   /* "cuda": every GPU, or in a job, this local rank's share of them */
        const int L = mgpu__dist.local_size, me = mgpu__dist.local_rank;
        const int first = L <= 1 ? 0 : cuda_count >= L ? me * cuda_count / L : me % cuda_count;
        const int count = L <= 1 ? cuda_count : cuda_count >= L ? (me + 1) * cuda_count / L - first : 1;
        plan->count = MGPU__MIN(count, MGPU__MAX_REPLICAS);
        for (i = 0; i < plan->count; ++i) plan->ordinals[i] = first + i;
        return MGPU_OK;
    }
    for (i = 0; i < plan->count; ++i)
        if (plan->ordinals[i] >= cuda_count)
            return mgpu__fail(MGPU_ERROR_NO_DEVICE,
                              "%s: device spec '%s'%s names cuda:%d, but this machine has %d CUDA device%s (cuda:0..cuda:%d)",
                              op, s, from, plan->ordinals[i], cuda_count, cuda_count == 1 ? "" : "s", cuda_count - 1);
    return MGPU_OK;
}

/* Step 2: replica i of the plan, labelled "cpu#2", "cuda:1" or "cuda:0#1" (second replica on
   GPU 0); a CUDA replica gets its own compute stream and a cuBLAS handle bound to it. Replica 0
   of a CPU set is the library's CPU device. */
static mgpu_result mgpu__device_create(const mgpu__device_plan* plan, int i, mgpu_device** out) {
    mgpu_device* d;
    int same = 0, j, rc;
    *out = NULL;
    if (!plan->cuda && i == 0) { *out = mgpu_device_cpu(); return MGPU_OK; }
    d = (mgpu_device*)MGPU_MALLOC(sizeof *d);
    if (!d) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_device_set_create: out of host memory");
    mgpu__device_init(d, plan->cuda ? MGPU_DEVICE_CUDA : MGPU_DEVICE_CPU, plan->cuda ? plan->ordinals[i] : 0, i);
    *out = d;   /* owned by the set from here on, also when the rest fails */
    if (!plan->cuda) {
        snprintf(d->label, sizeof d->label, "cpu#%d", i);
        return MGPU_OK;
    }
    for (j = 0; j < i; ++j) same += plan->ordinals[j] == plan->ordinals[i];
    if (same) snprintf(d->label, sizeof d->label, "cuda:%d#%d", d->ordinal, same);
    else snprintf(d->label, sizeof d->label, "cuda:%d", d->ordinal);
    rc = MGPU__CUDA(mgpu__cu_stream_create(d->ordinal, &d->stream));
    if (rc == 0) rc = MGPU__CUDA(mgpu__cu_event_create(d->ordinal, &d->order));
    if (rc) return mgpu__cu_result(rc, "mgpu_device_set_create", d);
    /* cuBLAS's workspace (NVIDIA recommends 32 MiB on sm_90 for its faster kernels), from the
       allocator: the memory statistics count it, as PyTorch's count its own */
    if (!(d->blas_workspace = mgpu__device_alloc(d, MGPU__BLAS_WORKSPACE, &d->blas_workspace_bytes, "mgpu_device_set_create")))
        return mgpu_last_result();
    rc = MGPU__CUDA(mgpu__cu_blas_create(d->ordinal, d->stream, d->blas_workspace, d->blas_workspace_bytes, &d->blas));
    return rc ? mgpu__cu_result(rc, "mgpu_device_set_create", d) : MGPU_OK;
}

/* Step 3: peer access between distinct GPUs where the hardware allows; not having it is fine
   (copies then go through the host). */
static void mgpu__enable_peer_access(const mgpu__device_plan* plan) {
    int i, j;
    for (i = 0; plan->cuda && i < plan->count; ++i)
        for (j = 0; j < plan->count; ++j) {
            int can = 0;
            const int a = plan->ordinals[i], b = plan->ordinals[j];
            if (a == b) continue;
            if (MGPU__CUDA(mgpu__cu_can_access_peer(a, b, &can)) == 0 && can &&
                MGPU__CUDA(mgpu__cu_enable_peer_access(a, b)) != 0)
                mgpu__log(MGPU_LOG_WARN, "peer access cuda:%d -> cuda:%d: %s", a, b, mgpu__cuda_message());
        }
}

MGPUDEF mgpu_device_set* mgpu_device_set_create(const char* spec) {
    mgpu__device_plan plan;
    mgpu_device_set* set;
    int i;
    if (mgpu__device_plan_from_spec(spec, &plan) != MGPU_OK) return NULL;
    set = (mgpu_device_set*)mgpu__calloc(1, sizeof *set);
    if (set) set->devices = (mgpu_device**)mgpu__calloc((size_t)plan.count, sizeof(mgpu_device*));
    if (!set || !set->devices) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_device_set_create: out of host memory");
        return mgpu__device_set_fail_free(set);
    }
    for (i = 0; i < plan.count; ++i) {
        mgpu_result r = mgpu__device_create(&plan, i, &set->devices[i]);
        set->count = set->devices[i] ? i + 1 : i;   /* what the set owns, for the destroy */
        if (r != MGPU_OK) return mgpu__device_set_fail_free(set);
    }
    mgpu__enable_peer_access(&plan);
    /* Step 4: the resolved spec, e.g. "cuda:0,0" or "cpu:2" */
    if (!plan.cuda) snprintf(set->spec, sizeof set->spec, plan.count == 1 ? "cpu" : "cpu:%d", plan.count);
    else {
        size_t len = (size_t)snprintf(set->spec, sizeof set->spec, "cuda:");
        for (i = 0; i < plan.count && len + 9 < sizeof set->spec; ++i)
            len += (size_t)snprintf(set->spec + len, sizeof set->spec - len, i ? ",%d" : "%d", plan.ordinals[i]);
    }
    if (mgpu__live_add(set, MGPU__LIVE_SET, "mgpu_device_set_create") != MGPU_OK) return mgpu__device_set_fail_free(set);
    return set;
}

MGPUDEF int mgpu_device_set_count(const mgpu_device_set* set) { return set ? set->count : 0; }
MGPUDEF mgpu_device* mgpu_device_set_get(const mgpu_device_set* set, int index) {
    if (!set || index < 0 || index >= set->count) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_device_set_get: index %d outside a set of %d devices",
                   index, set ? set->count : 0);
        return NULL;
    }
    return set->devices[index];
}
MGPUDEF const char* mgpu_device_set_spec(const mgpu_device_set* set) { return set ? set->spec : ""; }
MGPUDEF mgpu_device_kind mgpu_device_kind_of(const mgpu_device* dev) { return dev ? dev->kind : MGPU_DEVICE_CPU; }
MGPUDEF const char* mgpu_device_label(const mgpu_device* dev) { return dev ? dev->label : "(null)"; }

MGPUDEF mgpu_result mgpu_device_get_info(const mgpu_device* dev, mgpu_device_info* info) {
    if (!dev || !info) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_device_get_info: NULL argument");
    memset(info, 0, sizeof *info);
    info->kind = dev->kind;
    info->ordinal = dev->ordinal;
    info->replica = dev->replica;
    snprintf(info->label, sizeof info->label, "%s", dev->label);
    if (dev->kind == MGPU_DEVICE_CPU) {
        snprintf(info->name, sizeof info->name, "cpu");
        info->multiprocessors = mgpu_cpu_threads();
#if defined(_WIN32)
        {
            MEMORYSTATUSEX ms;
            ms.dwLength = sizeof ms;
            if (GlobalMemoryStatusEx(&ms)) {
                info->total_memory = (size_t)ms.ullTotalPhys;
                info->free_memory = (size_t)ms.ullAvailPhys;
            }
        }
#endif
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
        info->total_memory = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
#endif
#if defined(_SC_AVPHYS_PAGES) && defined(_SC_PAGESIZE)
        info->free_memory = (size_t)sysconf(_SC_AVPHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
#endif
        return MGPU_OK;
    }
    MGPU__CU("mgpu_device_get_info", dev,
             mgpu__cu_device_info(dev->ordinal, info->name, sizeof info->name, &info->total_memory,
                                  &info->free_memory, &info->compute_major, &info->compute_minor,
                                  &info->multiprocessors));
    return MGPU_OK;
}

MGPUDEF int mgpu_device_can_access_peer(const mgpu_device* a, const mgpu_device* b) {
    if (!a || !b) return 0;
    if (a->kind == MGPU_DEVICE_CPU && b->kind == MGPU_DEVICE_CPU) return 1;
    if (a->kind != b->kind) return 0;
    if (a->ordinal == b->ordinal) return 1;
    {
        int can = 0;
        if (MGPU__CUDA(mgpu__cu_can_access_peer(a->ordinal, b->ordinal, &can)) != 0) return 0;
        return can;
    }
}

MGPUDEF mgpu_result mgpu_device_synchronize(mgpu_device* dev) {
    if (!dev) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_device_synchronize: NULL device");
    if (dev->kind == MGPU_DEVICE_CUDA) {
        MGPU__COUNT(dev, host_waits, 1);
        MGPU__CU("mgpu_device_synchronize", dev, mgpu__cu_stream_synchronize(dev->ordinal, dev->stream));
    }
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_device_get_counters(const mgpu_device* dev, mgpu_device_counters* counters) {
    if (!dev || !counters)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_device_get_counters: NULL %s", dev ? "counters" : "device");
#define MGPU__COUNTER_GET(field) counters->field = MGPU__COUNT_READ(dev, field);
    MGPU__COUNTER_LIST(MGPU__COUNTER_GET)
#undef MGPU__COUNTER_GET
    return MGPU_OK;
}
MGPUDEF void mgpu_device_reset_counters(mgpu_device* dev) {
    if (!dev) return;
#define MGPU__COUNTER_RESET(field) MGPU__COUNT_ZERO(dev, field);
    MGPU__COUNTER_LIST(MGPU__COUNTER_RESET)
#undef MGPU__COUNTER_RESET
}

MGPUDEF mgpu_result mgpu_device_allow_tf32(mgpu_device* dev, int allow) {
    if (!dev) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_device_allow_tf32: NULL device");
    if (dev->kind == MGPU_DEVICE_CUDA)
        MGPU__CU("mgpu_device_allow_tf32", dev, mgpu__cu_blas_set_tf32(dev->ordinal, dev->blas, allow));
    return MGPU_OK;
}

/* ---- >>impl memory ---------------------------------------------------------------------- */
/* A caching allocator per device, after PyTorch's: freed blocks are kept and handed out again
   for a request of about the same size, so a training loop stops calling cudaMalloc (or
   malloc) after its first step. Sizes are rounded so that near-equal requests share blocks. */
#define MGPU__CPU_ALIGN 64

static size_t mgpu__round_size(size_t bytes) {
    size_t g = bytes < ((size_t)1 << 20) ? 256 : ((size_t)1 << 17);
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - g) return 0;
    return (bytes + g - 1) / g * g;
}

static void* mgpu__cpu_raw_alloc(size_t bytes) {   /* 64-byte aligned, original pointer before it */
    unsigned char* raw = bytes > SIZE_MAX - MGPU__CPU_ALIGN - sizeof(void*) ? NULL
                       : (unsigned char*)MGPU_MALLOC(bytes + MGPU__CPU_ALIGN + sizeof(void*));
    uintptr_t aligned;
    if (!raw) return NULL;
    aligned = ((uintptr_t)(raw + sizeof(void*)) + MGPU__CPU_ALIGN - 1) & ~(uintptr_t)(MGPU__CPU_ALIGN - 1);
    ((void**)aligned)[-1] = raw;
    return (void*)aligned;
}
static void mgpu__cpu_raw_free(void* p) { if (p) MGPU_FREE(((void**)p)[-1]); }

static int mgpu__backend_alloc(mgpu_device* dev, size_t bytes, void** ptr) {   /* 0 ok, else MGPU__CU_ERR_* */
    if (dev->kind == MGPU_DEVICE_CPU) {
        *ptr = mgpu__cpu_raw_alloc(bytes);
        return *ptr ? 0 : MGPU__CU_ERR_OOM;
    }
    return MGPU__CUDA(mgpu__cu_malloc(dev->ordinal, bytes, ptr));
}
static void mgpu__backend_free(mgpu_device* dev, void* ptr) {
    if (dev->kind == MGPU_DEVICE_CPU) { mgpu__cpu_raw_free(ptr); return; }
    /* The stream may still use it: wait first, as cudaFree would for the legacy stream. */
    (void)MGPU__CUDA(mgpu__cu_stream_synchronize(dev->ordinal, dev->stream));
    if (MGPU__CUDA(mgpu__cu_free(dev->ordinal, ptr)) != 0)
        mgpu__log(MGPU_LOG_WARN, "%s: freeing device memory failed: %s", dev->label, mgpu__cuda_message());
}

static void mgpu__lock(mgpu__allocator* a) {
#ifndef MGPU_NO_THREADS
    mgpu__mutex_lock(&a->lock);
#else
    (void)a;
#endif
}
static void mgpu__unlock(mgpu__allocator* a) {
#ifndef MGPU_NO_THREADS
    mgpu__mutex_unlock(&a->lock);
#else
    (void)a;
#endif
}

static mgpu_result mgpu__memory_release_cached(mgpu_device* dev) {
    mgpu__block* b;
    mgpu__lock(&dev->alloc);
    b = dev->alloc.cached;
    dev->alloc.cached = NULL;
    while (b) {
        mgpu__block* next = b->next;
        mgpu__backend_free(dev, b->ptr);
        dev->alloc.stats.bytes_reserved -= b->size;
        dev->alloc.stats.backend_frees++;
        MGPU_FREE(b);
        b = next;
    }
    mgpu__unlock(&dev->alloc);
    return MGPU_OK;
}

static void mgpu__human_bytes(double bytes, char* buf, size_t size) {
    const char* unit[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    int u = 0;
    while (bytes >= 1024.0 && u < 4) { bytes /= 1024.0; ++u; }
    snprintf(buf, size, u ? "%.1f %s" : "%.0f %s", bytes, unit[u]);
}

/* The capture's list of blocks when this thread is capturing a graph on the device, else NULL
   (under the allocator's lock). */
static mgpu__block** mgpu__held_list(const mgpu__allocator* a) {
#ifndef MGPU_NO_THREADS
    if (a->held && !mgpu__thread_same(a->holder, mgpu__thread_self())) return NULL;
#endif
    return a->held;
}

/* The free block for a request of `size` from a list in ascending size: the first big enough,
   unless it is too big to spend on it. */
static mgpu__block* mgpu__take_block(mgpu__block** list, size_t size) {
    mgpu__block **link, *b;
    for (link = list; (b = *link) != NULL; link = &b->next) {
        if (b->size < size) continue;
        if (b->size - size > size / 4 && b->size - size > 4096) return NULL;   /* too big: don't waste it */
        *link = b->next;
        return b;
    }
    return NULL;
}
static void mgpu__put_block(mgpu__block** list, mgpu__block* b) {
    mgpu__block** link;
    for (link = list; *link && (*link)->size < b->size; link = &(*link)->next) {}
    b->next = *link;
    *link = b;
}

/* Get a block of at least `bytes` (its rounded size in *block_size). Serves from the cache when
   a block of the right size class is free; on out-of-memory empties the cache and tries again. */
static void* mgpu__device_alloc(mgpu_device* dev, size_t bytes, size_t* block_size, const char* op) {
    size_t size = mgpu__round_size(bytes);
    mgpu__block* b;
    void* ptr = NULL;
    int rc;
    if (size == 0) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes on %s", op, bytes, dev->label);
        return NULL;
    }
    mgpu__lock(&dev->alloc);
    /* a capture first reuses what it freed itself: within it, in stream order, as eager steps do */
    b = mgpu__held_list(&dev->alloc) ? mgpu__take_block(mgpu__held_list(&dev->alloc), size) : NULL;
    if (!b) b = mgpu__take_block(&dev->alloc.cached, size);
    if (b) {
        ptr = b->ptr;
        size = b->size;
        MGPU_FREE(b);
        dev->alloc.stats.cache_hits++;
        MGPU__COUNT(dev, allocs, 1);
    }
    mgpu__unlock(&dev->alloc);
    if (!ptr) {
        rc = mgpu__backend_alloc(dev, size, &ptr);
        if (rc == MGPU__CU_ERR_OOM) {   /* out of memory: give back the cache and try once more */
            mgpu__memory_release_cached(dev);
            rc = mgpu__backend_alloc(dev, size, &ptr);
        }
        if (rc != 0 && rc != MGPU__CU_ERR_OOM) {   /* not memory: a CUDA failure, named as such */
            mgpu__cu_result(rc, op, dev);
            return NULL;
        }
        if (rc != 0) {
            char want[32], freeb[32], used[32];
            mgpu_device_info info;
            memset(&info, 0, sizeof info);
            mgpu_device_get_info(dev, &info);
            mgpu__human_bytes((double)size, want, sizeof want);
            mgpu__human_bytes((double)info.free_memory, freeb, sizeof freeb);
            mgpu__human_bytes((double)dev->alloc.stats.bytes_in_use, used, sizeof used);
            mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY,
                       "%s: out of memory on %s allocating %s (%zu bytes); %s free on the device, %s held by "
                       "live mgpu tensors%s", op, dev->label, want, size, freeb, used,
                       dev->kind == MGPU_DEVICE_CUDA ? " and cuBLAS's workspace" : "");
            return NULL;
        }
        mgpu__lock(&dev->alloc);
        dev->alloc.stats.backend_allocs++;
        MGPU__COUNT(dev, allocs, 1);
        dev->alloc.stats.bytes_reserved += size;
        mgpu__unlock(&dev->alloc);
    }
    mgpu__lock(&dev->alloc);
    dev->alloc.stats.bytes_in_use += size;
    if (dev->alloc.stats.bytes_in_use > dev->alloc.stats.peak_bytes_in_use)
        dev->alloc.stats.peak_bytes_in_use = dev->alloc.stats.bytes_in_use;
    mgpu__unlock(&dev->alloc);
    *block_size = size;
    return ptr;
}

/* Return a block to the cache (kept sorted by size for best fit). */
static void mgpu__device_release(mgpu_device* dev, void* ptr, size_t size) {
    mgpu__block* b = (mgpu__block*)MGPU_MALLOC(sizeof *b);
    mgpu__lock(&dev->alloc);
    dev->alloc.stats.bytes_in_use -= size;
    if (!b) {   /* no host memory for the list node: give the block straight back */
        mgpu__backend_free(dev, ptr);
        dev->alloc.stats.bytes_reserved -= size;
        dev->alloc.stats.backend_frees++;
        mgpu__unlock(&dev->alloc);
        return;
    }
    b->ptr = ptr;
    b->size = size;
    mgpu__put_block(mgpu__held_list(&dev->alloc) ? mgpu__held_list(&dev->alloc) : &dev->alloc.cached, b);
    mgpu__unlock(&dev->alloc);
}

MGPUDEF mgpu_result mgpu_memory_get_stats(const mgpu_device* dev, mgpu_memory_stats* stats) {
    if (!dev || !stats) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_memory_get_stats: NULL argument");
    mgpu__lock((mgpu__allocator*)&dev->alloc);
    *stats = dev->alloc.stats;
    mgpu__unlock((mgpu__allocator*)&dev->alloc);
    return MGPU_OK;
}
MGPUDEF void mgpu_memory_reset_peak(mgpu_device* dev) {
    if (!dev) return;
    mgpu__lock(&dev->alloc);
    dev->alloc.stats.peak_bytes_in_use = dev->alloc.stats.bytes_in_use;
    mgpu__unlock(&dev->alloc);
}
MGPUDEF mgpu_result mgpu_memory_empty_cache(mgpu_device* dev) {
    if (!dev) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_memory_empty_cache: NULL device");
    return mgpu__memory_release_cached(dev);
}

/* Pinned blocks carry a 64-byte header: [-1] the base pointer, [-2] 1 if page-locked by CUDA. */
MGPUDEF void* mgpu_pinned_alloc(size_t bytes) {
    unsigned char* base = NULL;
    uintptr_t* user;
    int pinned = 0;
    if (bytes > SIZE_MAX - 2 * MGPU__CPU_ALIGN) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_pinned_alloc: cannot allocate %zu bytes", bytes);
        return NULL;
    }
    if (mgpu_cuda_device_count() > 0 && MGPU__CUDA(mgpu__cu_host_alloc(bytes + MGPU__CPU_ALIGN, (void**)&base)) == 0) pinned = 1;
    else base = NULL;
    if (!base) base = (unsigned char*)MGPU_MALLOC(bytes + 2 * MGPU__CPU_ALIGN);
    if (!base) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_pinned_alloc: cannot allocate %zu bytes of host memory", bytes);
        return NULL;
    }
    user = (uintptr_t*)(((uintptr_t)base + MGPU__CPU_ALIGN + MGPU__CPU_ALIGN - 1) & ~(uintptr_t)(MGPU__CPU_ALIGN - 1));
    if (pinned) user = (uintptr_t*)(base + MGPU__CPU_ALIGN);   /* cudaHostAlloc is page-aligned */
    user[-1] = (uintptr_t)base;
    user[-2] = (uintptr_t)pinned;
    return user;
}
MGPUDEF void mgpu_pinned_free(void* ptr) {
    uintptr_t* user = (uintptr_t*)ptr;
    if (!ptr) return;
    if (user[-2]) {
        if (MGPU__CUDA(mgpu__cu_host_free((void*)user[-1])) != 0)
            mgpu__log(MGPU_LOG_WARN, "mgpu_pinned_free: %s", mgpu__cuda_message());
        return;
    }
    MGPU_FREE((void*)user[-1]);
}

/* Host memory to a GPU without waiting for the copy: the bytes are put in one of the device's
   pinned staging buffers at once (so the caller may change them right after), and the device
   copies from there when its stream gets to it (a copy from pageable memory would make the
   driver stage it itself, and cudaMemcpyAsync returns only after). The buffers are used in turn,
   and each is filled again only after its last copy has read it: then an upload waits for the
   GPU only when it is MGPU__STAGING_SLOTS uploads behind, as a launch queue that fills up would.
   Copies above MGPU__STAGING_MAX go directly and wait, so the buffers stay small.
   Several pieces of host memory bound for one device block go up as one copy: each is put at its
   place in the staging buffer (a batch's rows and their labels, say), in increasing order. */
typedef struct mgpu__host_piece { const void* host; size_t bytes, at; } mgpu__host_piece;   /* at: bytes from dst */
static mgpu_result mgpu__upload_pieces(mgpu_device* d, void* dst, const mgpu__host_piece* piece, int count, const char* op) {
    mgpu__staging* st;
    int rc = 0, done = 1, i;
    size_t bytes = 0;
    for (i = 0; i < count; ++i) bytes = MGPU__MAX(bytes, piece[i].at + piece[i].bytes);
    MGPU__COUNT(d, bytes_host_to_device, bytes);
    if (bytes > MGPU__STAGING_MAX) {   /* a whole data set, say: copied directly, waited for */
        MGPU__COUNT(d, host_waits, 1);
        for (i = 0; i < count; ++i)
            MGPU__CU(op, d, mgpu__cu_memcpy(d->ordinal, (char*)dst + piece[i].at, piece[i].host, piece[i].bytes, d->stream));
        MGPU__CU(op, d, mgpu__cu_stream_synchronize(d->ordinal, d->stream));
        return MGPU_OK;
    }
    mgpu__lock(&d->alloc);
    st = &d->staging[d->staging_next];
    d->staging_next = (d->staging_next + 1) % MGPU__STAGING_SLOTS;
    if (!st->read)   /* the first upload makes every slot's event: later steps ask nothing of the device */
        for (i = 0; i < MGPU__STAGING_SLOTS && !rc; ++i)
            if (!d->staging[i].read) rc = MGPU__CUDA(mgpu__cu_event_create(d->ordinal, &d->staging[i].read));
    if (!rc) rc = MGPU__CUDA(mgpu__cu_event_done(d->ordinal, st->read, &done));
    if (rc == 0 && !done) {
        d->staging_waits++;
        MGPU__COUNT(d, host_waits, 1);
        rc = MGPU__CUDA(mgpu__cu_event_synchronize(d->ordinal, st->read));
    }
    if (rc == 0 && st->capacity < bytes) {
        size_t want = MGPU__MAX(bytes, st->capacity * 2);
        mgpu_pinned_free(st->host);   /* its copies are done (the event above) */
        st->capacity = 0;
        st->host = mgpu_pinned_alloc(want);
        if (!st->host) {
            mgpu__unlock(&d->alloc);
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: no pinned host memory for a %zu-byte copy to %s", op, bytes, d->label);
        }
        st->capacity = want;
    }
    if (rc == 0) {
        size_t end = 0;
        for (i = 0; i < count; ++i) {   /* zeroed gaps: the copy never carries stale bytes */
            if (piece[i].at > end) memset((char*)st->host + end, 0, piece[i].at - end);
            memcpy((char*)st->host + piece[i].at, piece[i].host, piece[i].bytes);
            end = piece[i].at + piece[i].bytes;
        }
        rc = MGPU__CUDA(mgpu__cu_memcpy(d->ordinal, dst, st->host, bytes, d->stream));
    }
    if (rc == 0) rc = MGPU__CUDA(mgpu__cu_event_record(d->ordinal, st->read, d->stream));
    mgpu__unlock(&d->alloc);
    return rc ? mgpu__cu_result(rc, op, d) : MGPU_OK;
}
static mgpu_result mgpu__upload_async(mgpu_device* d, void* dst, const void* host, size_t bytes, const char* op) {
    mgpu__host_piece one;
    one.host = host;
    one.bytes = bytes;
    one.at = 0;
    return mgpu__upload_pieces(d, dst, &one, 1, op);
}

/* ---- >>impl tensor ---------------------------------------------------------------------- */
/* Storage is shared by a tensor and its views and freed with the last of them. A tensor and
   its views belong to one thread at a time (the count is not atomic). */
typedef struct mgpu__storage {
    mgpu_device* dev;
    void* ptr;
    size_t size;        /* block size from the allocator */
    int refs;
    uint64_t version;   /* writes so far by mgpu's ops (>>ops), copies, uploads and fills: a tape
                           refuses a backward that would read a tensor changed since its op read
                           it (>>autograd) */
} mgpu__storage;
#define MGPU__WROTE(t) ((t)->storage->version++)

struct mgpu_tensor {
    mgpu__storage* storage;
    size_t offset;      /* bytes from storage->ptr */
    mgpu_dtype dtype;
    mgpu_shape shape;
    int owned;          /* 1: the library's (a model's view, a loader's batch): mgpu_tensor_destroy refuses */
    const mgpu_tape* tape;   /* the tape whose op made it (>>autograd), or NULL */
    int tape_node;           /* that op's place on the tape */
};

#define MGPU__TRY(expr) do { mgpu_result mgpu__r_ = (expr); if (mgpu__r_ != MGPU_OK) return mgpu__r_; } while (0)

MGPUDEF mgpu_shape mgpu_shape1(int64_t d0) { mgpu_shape s; memset(&s, 0, sizeof s); s.ndim = 1; s.dim[0] = d0; return s; }
MGPUDEF mgpu_shape mgpu_shape2(int64_t d0, int64_t d1) { mgpu_shape s = mgpu_shape1(d0); s.ndim = 2; s.dim[1] = d1; return s; }
MGPUDEF mgpu_shape mgpu_shape3(int64_t d0, int64_t d1, int64_t d2) { mgpu_shape s = mgpu_shape2(d0, d1); s.ndim = 3; s.dim[2] = d2; return s; }
MGPUDEF mgpu_shape mgpu_shape4(int64_t d0, int64_t d1, int64_t d2, int64_t d3) { mgpu_shape s = mgpu_shape3(d0, d1, d2); s.ndim = 4; s.dim[3] = d3; return s; }
MGPUDEF int64_t mgpu_shape_numel(mgpu_shape s) {
    int64_t n = 1;
    int i;
    if (s.ndim < 0 || s.ndim > MGPU_MAX_DIMS) return -1;
    for (i = 0; i < s.ndim; ++i) {
        if (s.dim[i] < 0 || (s.dim[i] > 0 && n > INT64_MAX / s.dim[i])) return -1;   /* no overflow: -1 */
        n *= s.dim[i];
    }
    return n;
}
MGPUDEF int mgpu_shape_equal(mgpu_shape a, mgpu_shape b) {
    int i;
    if (a.ndim != b.ndim) return 0;
    for (i = 0; i < a.ndim; ++i) if (a.dim[i] != b.dim[i]) return 0;
    return 1;
}
MGPUDEF size_t mgpu_dtype_size(mgpu_dtype dt) { return dt == MGPU_U8 ? 1 : dt == MGPU_BF16 ? 2 : 4; }
MGPUDEF const char* mgpu_dtype_name(mgpu_dtype dt) {
    switch (dt) { case MGPU_F32: return "f32"; case MGPU_I32: return "i32"; case MGPU_U8: return "u8"; case MGPU_BF16: return "bf16"; }
    return "?";
}
MGPUDEF uint16_t mgpu_bf16_from_float(float x) { return mgpu__float_to_bf16(x); }
MGPUDEF float mgpu_bf16_to_float(uint16_t bits) { return mgpu__bf16_to_float(bits); }

static const char* mgpu__shape_text(mgpu_shape s, char* buf, size_t size) {
    size_t len = 0;
    int i;
    len += (size_t)snprintf(buf, size, "[");
    for (i = 0; i < s.ndim && i < MGPU_MAX_DIMS && len < size; ++i)
        len += (size_t)snprintf(buf + len, size - len, i ? ",%lld" : "%lld", (long long)s.dim[i]);
    if (len < size) snprintf(buf + len, size - len, "]");
    return buf;
}

MGPUDEF const char* mgpu_tensor_describe(const mgpu_tensor* t, char* buf, size_t size) {
    char shape[96];
    if (!buf || !size) return "";
    if (!t) { snprintf(buf, size, "(null)"); return buf; }
    {   /* "f32[2,3]" then "@label", cut to fit */
        size_t len = (size_t)snprintf(buf, size, "%s%s", mgpu_dtype_name(t->dtype), mgpu__shape_text(t->shape, shape, sizeof shape));
        const char* label = t->storage->dev->label;
        if (len + 1 < size) buf[len++] = '@';
        while (len + 1 < size && *label) buf[len++] = *label++;
        if (len < size) buf[len] = 0;
    }
    return buf;
}

/* Valid ndim and dims, and a byte count that fits; else an error naming op. */
static mgpu_result mgpu__check_shape(const char* op, mgpu_dtype dt, mgpu_shape s, size_t* bytes) {
    char text[96];
    int64_t n = 1;
    int i;
    *bytes = 0;
    if (s.ndim < 0 || s.ndim > MGPU_MAX_DIMS)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d dimensions (mgpu tensors have 0 to %d)", op, s.ndim,
                          MGPU_MAX_DIMS);
    if (dt != MGPU_F32 && dt != MGPU_I32 && dt != MGPU_U8 && dt != MGPU_BF16)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: unknown dtype %d", op, (int)dt);
    for (i = 0; i < s.ndim; ++i) {
        if (s.dim[i] < 0 || (s.dim[i] > 0 && n > INT64_MAX / s.dim[i]))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: impossible shape %s", op,
                              mgpu__shape_text(s, text, sizeof text));
        n *= s.dim[i];
    }
    if ((uint64_t)n > (uint64_t)(SIZE_MAX / 2) / mgpu_dtype_size(dt))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: shape %s is too large to allocate", op,
                          mgpu__shape_text(s, text, sizeof text));
    *bytes = (size_t)n * mgpu_dtype_size(dt);
    return MGPU_OK;
}

static mgpu_tensor* mgpu__tensor_wrap(mgpu__storage* st, size_t offset, mgpu_dtype dt, mgpu_shape shape, const char* op) {
    mgpu_tensor* t = (mgpu_tensor*)MGPU_MALLOC(sizeof *t);
    if (!t) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    t->storage = st;
    t->offset = offset;
    t->dtype = dt;
    t->shape = shape;
    t->owned = 0;
    t->tape = NULL;
    t->tape_node = -1;
    st->refs++;
    return t;
}

MGPUDEF mgpu_tensor* mgpu_tensor_create(mgpu_device* dev, mgpu_dtype dt, mgpu_shape shape) {
    size_t bytes = 0;
    mgpu__storage* st;
    mgpu_tensor* t;
    if (!dev) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_create: NULL device"); return NULL; }
    if (mgpu__check_shape("mgpu_tensor_create", dt, shape, &bytes) != MGPU_OK) return NULL;
    st = (mgpu__storage*)mgpu__calloc(1, sizeof *st);
    if (!st) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_tensor_create: out of host memory"); return NULL; }
    st->dev = dev;
    st->ptr = mgpu__device_alloc(dev, bytes, &st->size, "mgpu_tensor_create");
    if (!st->ptr) { MGPU_FREE(st); return NULL; }
    t = mgpu__tensor_wrap(st, 0, dt, shape, "mgpu_tensor_create");
    if (!t) { mgpu__device_release(dev, st->ptr, st->size); MGPU_FREE(st); return NULL; }
    mgpu__lock(&dev->alloc);
    dev->tensors++;   /* its device set's destroy waits for it (LIFETIMES) */
    mgpu__unlock(&dev->alloc);
    return t;
}

/* The library's own destroy, for owned tensors too. */
static void mgpu__tensor_free(mgpu_tensor* t) {
    mgpu__storage* st;
    if (!t) return;
    st = t->storage;
    MGPU_FREE(t);
    if (--st->refs == 0) {
        mgpu_device* dev = st->dev;
        mgpu__device_release(dev, st->ptr, st->size);
        mgpu__lock(&dev->alloc);
        dev->tensors--;
        mgpu__unlock(&dev->alloc);
        MGPU_FREE(st);
    }
}

MGPUDEF mgpu_result mgpu_tensor_destroy(mgpu_tensor* t) {
    char text[96];
    if (!t) return MGPU_OK;
    if (t->owned)
        return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_tensor_destroy: %s belongs to a model, optimizer or loader, which "
                          "destroys it", mgpu_tensor_describe(t, text, sizeof text));
    mgpu__tensor_free(t);
    return MGPU_OK;
}

MGPUDEF mgpu_tensor* mgpu_tensor_view_rows(mgpu_tensor* t, int64_t start, int64_t count) {
    char text[96];
    mgpu_shape s;
    if (!t) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_view_rows: NULL tensor"); return NULL; }
    if (t->shape.ndim < 1 || start < 0 || count < 0 || start > t->shape.dim[0] - count) {
        if (start >= 0 && count >= 0 && count <= INT64_MAX - start)
            mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_view_rows: rows [%lld, %lld) outside %s", (long long)start,
                       (long long)(start + count), mgpu_tensor_describe(t, text, sizeof text));
        else   /* no end to print without overflowing */
            mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_view_rows: %lld rows from row %lld, outside %s",
                       (long long)count, (long long)start, mgpu_tensor_describe(t, text, sizeof text));
        return NULL;
    }
    s = t->shape;
    s.dim[0] = count;
    return mgpu__tensor_wrap(t->storage, t->offset + (size_t)start * (mgpu_tensor_bytes(t) / (size_t)MGPU__MAX(t->shape.dim[0], 1)),
                             t->dtype, s, "mgpu_tensor_view_rows");
}

MGPUDEF mgpu_tensor* mgpu_tensor_view_reshape(mgpu_tensor* t, mgpu_shape shape) {
    char a[96], b[96];
    size_t bytes;
    if (!t) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_view_reshape: NULL tensor"); return NULL; }
    if (mgpu__check_shape("mgpu_tensor_view_reshape", t->dtype, shape, &bytes) != MGPU_OK) return NULL;
    if (mgpu_shape_numel(shape) != mgpu_tensor_numel(t)) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_view_reshape: %s has %lld elements, shape %s has %lld",
                   mgpu_tensor_describe(t, a, sizeof a), (long long)mgpu_tensor_numel(t),
                   mgpu__shape_text(shape, b, sizeof b), (long long)mgpu_shape_numel(shape));
        return NULL;
    }
    return mgpu__tensor_wrap(t->storage, t->offset, t->dtype, shape, "mgpu_tensor_view_reshape");
}

MGPUDEF mgpu_shape mgpu_tensor_shape(const mgpu_tensor* t) { mgpu_shape s; memset(&s, 0, sizeof s); return t ? t->shape : s; }
MGPUDEF int64_t mgpu_tensor_dim(const mgpu_tensor* t, int i) {
    int j;
    if (!t) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_dim: NULL tensor"), -1;
    j = i < 0 ? i + t->shape.ndim : i;
    if (j < 0 || j >= t->shape.ndim)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_dim: dimension %d of a tensor with %d", i, t->shape.ndim), -1;
    return t->shape.dim[j];
}
MGPUDEF int64_t mgpu_tensor_numel(const mgpu_tensor* t) {   /* a tensor's shape was checked when it was made */
    int64_t n = 1;
    int i;
    if (!t) return 0;
    for (i = 0; i < t->shape.ndim; ++i) n *= t->shape.dim[i];
    return n;
}
MGPUDEF size_t mgpu_tensor_bytes(const mgpu_tensor* t) { return t ? (size_t)mgpu_tensor_numel(t) * mgpu_dtype_size(t->dtype) : 0; }
MGPUDEF mgpu_dtype mgpu_tensor_dtype(const mgpu_tensor* t) { return t ? t->dtype : MGPU_F32; }
MGPUDEF mgpu_device* mgpu_tensor_device(const mgpu_tensor* t) { return t ? t->storage->dev : NULL; }
MGPUDEF void* mgpu_tensor_data(const mgpu_tensor* t) { return t ? (void*)((char*)t->storage->ptr + t->offset) : NULL; }

#define MGPU__DEV(t) ((t)->storage->dev)
#define MGPU__F32(t) ((float*)mgpu_tensor_data(t))
#define MGPU__I32(t) ((int32_t*)mgpu_tensor_data(t))
#define MGPU__IS_CPU(t) (MGPU__DEV(t)->kind == MGPU_DEVICE_CPU)

/* ---- argument checks shared by every op ---- */
static mgpu_result mgpu__check_tensor(const char* op, const char* name, const mgpu_tensor* t, mgpu_dtype dt) {
    char text[128];
    if (!t) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%s' is NULL", op, name);
    if (t->dtype != dt)
        return mgpu__fail(MGPU_ERROR_DTYPE_MISMATCH, "%s: '%s' is %s, expected dtype %s", op, name,
                          mgpu_tensor_describe(t, text, sizeof text), mgpu_dtype_name(dt));
    return MGPU_OK;
}
/* An op needs all its tensors on one device: on the CPU devices of a set too (all host memory,
   but refused as on GPUs, so that a program tried on "cpu:N" fails where it would on "cuda:..."). */
static mgpu_result mgpu__check_same_device(const char* op, const char* an, const mgpu_tensor* a,
                                           const char* bn, const mgpu_tensor* b) {
    char ta[128], tb[128];
    if (MGPU__DEV(a) == MGPU__DEV(b)) return MGPU_OK;
    return mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: '%s' %s and '%s' %s are on different devices", op, an,
                      mgpu_tensor_describe(a, ta, sizeof ta), bn, mgpu_tensor_describe(b, tb, sizeof tb));
}
static mgpu_result mgpu__check_same_shape(const char* op, const char* an, const mgpu_tensor* a,
                                          const char* bn, const mgpu_tensor* b) {
    char ta[128], tb[128];
    if (mgpu_shape_equal(a->shape, b->shape)) return MGPU_OK;
    return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s and '%s' %s differ in shape", op, an,
                      mgpu_tensor_describe(a, ta, sizeof ta), bn, mgpu_tensor_describe(b, tb, sizeof tb));
}
/* dt (f32 for mgpu__check_like, the reference's own for mgpu__check_match), on the reference
   tensor's device, of its shape */
static mgpu_result mgpu__check_as(const char* op, const char* name, const mgpu_tensor* t, mgpu_dtype dt,
                                  const char* ref_name, const mgpu_tensor* ref) {
    MGPU__TRY(mgpu__check_tensor(op, name, t, dt));
    MGPU__TRY(mgpu__check_same_device(op, name, t, ref_name, ref));
    return mgpu__check_same_shape(op, name, t, ref_name, ref);
}
static mgpu_result mgpu__check_like(const char* op, const char* name, const mgpu_tensor* t,
                                    const char* ref_name, const mgpu_tensor* ref) {
    return mgpu__check_as(op, name, t, MGPU_F32, ref_name, ref);
}
static mgpu_result mgpu__check_match(const char* op, const char* name, const mgpu_tensor* t,
                                     const char* ref_name, const mgpu_tensor* ref) {
    return mgpu__check_as(op, name, t, ref->dtype, ref_name, ref);
}
static mgpu_result mgpu__check_rank(const char* op, const char* name, const mgpu_tensor* t, int ndim) {
    char text[128];
    if (t->shape.ndim == ndim) return MGPU_OK;
    return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should have %d dimensions", op, name,
                      mgpu_tensor_describe(t, text, sizeof text), ndim);
}

/* ---- copies ---- */
MGPUDEF mgpu_result mgpu_tensor_upload(mgpu_tensor* t, const void* host, size_t bytes) {
    char text[128];
    if (!t || (!host && bytes)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_upload: NULL argument");
    if (bytes != mgpu_tensor_bytes(t))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_upload: %zu bytes given for %s (%zu bytes)", bytes,
                          mgpu_tensor_describe(t, text, sizeof text), mgpu_tensor_bytes(t));
    if (!bytes) return MGPU_OK;
    MGPU__WROTE(t);
    MGPU__COUNT(MGPU__DEV(t), bytes_host_to_device, bytes);
    if (MGPU__IS_CPU(t)) { memcpy(mgpu_tensor_data(t), host, bytes); return MGPU_OK; }
    MGPU__COUNT(MGPU__DEV(t), host_waits, 1);
    MGPU__CU("mgpu_tensor_upload", MGPU__DEV(t),
             mgpu__cu_memcpy(MGPU__DEV(t)->ordinal, mgpu_tensor_data(t), host, bytes, MGPU__DEV(t)->stream));
    MGPU__CU("mgpu_tensor_upload", MGPU__DEV(t), mgpu__cu_stream_synchronize(MGPU__DEV(t)->ordinal, MGPU__DEV(t)->stream));
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_tensor_download(const mgpu_tensor* t, void* host, size_t bytes) {
    char text[128];
    if (!t || (!host && bytes)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_download: NULL argument");
    if (bytes != mgpu_tensor_bytes(t))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_download: %zu bytes of room for %s (%zu bytes)", bytes,
                          mgpu_tensor_describe(t, text, sizeof text), mgpu_tensor_bytes(t));
    if (!bytes) return MGPU_OK;
    MGPU__COUNT(MGPU__DEV(t), bytes_device_to_host, bytes);
    if (MGPU__IS_CPU(t)) { memcpy(host, mgpu_tensor_data(t), bytes); return MGPU_OK; }
    MGPU__COUNT(MGPU__DEV(t), host_waits, 1);
    MGPU__CU("mgpu_tensor_download", MGPU__DEV(t),
             mgpu__cu_memcpy(MGPU__DEV(t)->ordinal, host, mgpu_tensor_data(t), bytes, MGPU__DEV(t)->stream));
    MGPU__CU("mgpu_tensor_download", MGPU__DEV(t), mgpu__cu_stream_synchronize(MGPU__DEV(t)->ordinal, MGPU__DEV(t)->stream));
    return MGPU_OK;
}

typedef struct mgpu__copy_job { char* dst; const char* src; } mgpu__copy_job;
static void mgpu__copy_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__copy_job* j = (const mgpu__copy_job*)ctx;
    memcpy(j->dst + begin, j->src + begin, (size_t)(end - begin));
}

MGPUDEF mgpu_result mgpu_tensor_copy(mgpu_tensor* dst, const mgpu_tensor* src) {
    char a[128], b[128];
    size_t bytes;
    mgpu_device *dd, *sd;
    if (!dst || !src) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_copy: NULL tensor");
    if (dst->dtype != src->dtype)
        return mgpu__fail(MGPU_ERROR_DTYPE_MISMATCH, "mgpu_tensor_copy: dst %s and src %s differ in dtype",
                          mgpu_tensor_describe(dst, a, sizeof a), mgpu_tensor_describe(src, b, sizeof b));
    if (mgpu_tensor_numel(dst) != mgpu_tensor_numel(src))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_tensor_copy: dst %s and src %s differ in element count",
                          mgpu_tensor_describe(dst, a, sizeof a), mgpu_tensor_describe(src, b, sizeof b));
    bytes = mgpu_tensor_bytes(src);
    dd = MGPU__DEV(dst);
    sd = MGPU__DEV(src);
    if (!bytes || mgpu_tensor_data(dst) == mgpu_tensor_data(src)) return MGPU_OK;
    MGPU__WROTE(dst);
    if (sd->kind == MGPU_DEVICE_CPU && dd->kind == MGPU_DEVICE_CPU) {
        char *d = (char*)mgpu_tensor_data(dst), *s = (char*)mgpu_tensor_data(src);
        if (sd != dd) MGPU__COUNT(dd, bytes_device_to_device, bytes);
        else MGPU__COUNT(dd, ops, 1);
        if (d + bytes <= s || s + bytes <= d) {   /* disjoint: copy slices on every thread */
            mgpu__copy_job job;
            job.dst = d;
            job.src = s;
            mgpu__parallel_range((int64_t)bytes, (int64_t)1 << 20, mgpu__copy_range, &job);
        } else {
            memmove(d, s, bytes);
        }
        return MGPU_OK;
    }
    if (sd->kind == MGPU_DEVICE_CPU) return mgpu__upload_async(dd, mgpu_tensor_data(dst), mgpu_tensor_data(src), bytes, "mgpu_tensor_copy");
    if (dd->kind == MGPU_DEVICE_CPU) return mgpu_tensor_download(src, mgpu_tensor_data(dst), bytes);
    if (sd == dd) {   /* same stream: ordered with everything else on it */
        MGPU__COUNT(dd, ops, 1);
        MGPU__CU("mgpu_tensor_copy", dd, mgpu__cu_memcpy(dd->ordinal, mgpu_tensor_data(dst), mgpu_tensor_data(src), bytes, dd->stream));
        return MGPU_OK;
    }
    /* Another stream or GPU: ordered by events, never by the host. The copy, on dst's stream,
       waits for src's stream to get here (src's producers are done), and src's stream waits
       for the copy before it goes on (whatever next overwrites src, or reuses its memory, comes
       after), as if both devices ran one stream. A peer copy goes directly over NVLink/PCIe
       where peer access is on, or through the host otherwise. */
    MGPU__COUNT(dd, bytes_device_to_device, bytes);
    MGPU__CU("mgpu_tensor_copy", sd, mgpu__cu_event_record(sd->ordinal, sd->order, sd->stream));
    MGPU__CU("mgpu_tensor_copy", dd, mgpu__cu_stream_wait_event(dd->ordinal, dd->stream, sd->order));
    if (sd->ordinal == dd->ordinal)
        MGPU__CU("mgpu_tensor_copy", dd, mgpu__cu_memcpy(dd->ordinal, mgpu_tensor_data(dst), mgpu_tensor_data(src), bytes, dd->stream));
    else
        MGPU__CU("mgpu_tensor_copy", dd, mgpu__cu_memcpy_peer(dd->ordinal, mgpu_tensor_data(dst), sd->ordinal,
                                                              mgpu_tensor_data(src), bytes, dd->stream));
    MGPU__CU("mgpu_tensor_copy", dd, mgpu__cu_event_record(dd->ordinal, dd->order, dd->stream));
    MGPU__CU("mgpu_tensor_copy", sd, mgpu__cu_stream_wait_event(sd->ordinal, sd->stream, dd->order));
    return MGPU_OK;
}

MGPUDEF mgpu_tensor* mgpu_tensor_to(const mgpu_tensor* src, mgpu_device* dev) {
    mgpu_tensor* t;
    if (!src || !dev) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_to: NULL %s", src ? "device" : "tensor"); return NULL; }
    t = mgpu_tensor_create(dev, src->dtype, src->shape);
    if (t && mgpu_tensor_copy(t, src) != MGPU_OK) { mgpu_tensor_destroy(t); return NULL; }
    return t;
}

/* Integers from floating point as the GPU converts: toward zero, saturating, NaN to 0 (a plain C
   cast out of range is undefined). */
static int32_t mgpu__to_i32(double v) { return v != v ? 0 : v <= INT32_MIN ? INT32_MIN : v >= INT32_MAX ? INT32_MAX : (int32_t)v; }
static uint8_t mgpu__to_u8(double v) { return (uint8_t)(v != v || v <= 0 ? 0 : v >= 255 ? 255 : (int)v); }

/* Read element i of any dtype as float, and write a float as any dtype (integers saturating,
   bfloat16 rounded to nearest even). */
static float mgpu__load_as_float(mgpu_dtype dt, const void* p, int64_t i) {
    switch (dt) {
    case MGPU_F32: return ((const float*)p)[i];
    case MGPU_I32: return (float)((const int32_t*)p)[i];
    case MGPU_BF16: return mgpu__bf16_to_float(((const uint16_t*)p)[i]);
    default: return (float)((const uint8_t*)p)[i];
    }
}
static void mgpu__store_float(mgpu_dtype dt, void* p, int64_t i, float v) {
    switch (dt) {
    case MGPU_F32: ((float*)p)[i] = v; break;
    case MGPU_I32: ((int32_t*)p)[i] = mgpu__to_i32(v); break;
    case MGPU_BF16: ((uint16_t*)p)[i] = mgpu__float_to_bf16(v); break;
    default: ((uint8_t*)p)[i] = mgpu__to_u8(v); break;
    }
}
/* n bfloat16 values widened to float (exactly): the CPU's bf16 ops compute on these */
static void mgpu__bf16_widen(const void* src, float* dst, int64_t n) {
    int64_t i;
    for (i = 0; i < n; ++i) dst[i] = mgpu__bf16_to_float(((const uint16_t*)src)[i]);
}

MGPUDEF mgpu_result mgpu_tensor_fill(mgpu_tensor* t, double value) {
    int64_t i, n;
    if (!t) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tensor_fill: NULL tensor");
    n = mgpu_tensor_numel(t);
    MGPU__WROTE(t);
    MGPU__COUNT(MGPU__DEV(t), ops, 1);
    if (!MGPU__IS_CPU(t)) {
        MGPU__CU("mgpu_tensor_fill", MGPU__DEV(t),
                 mgpu__cu_fill(MGPU__DEV(t)->ordinal, MGPU__DEV(t)->stream, mgpu_tensor_data(t), (int)t->dtype, (size_t)n, value));
        return MGPU_OK;
    }
    if (value == 0.0 && !signbit(value)) { memset(mgpu_tensor_data(t), 0, mgpu_tensor_bytes(t)); return MGPU_OK; }   /* +0 (a GPU's test) */
    if (t->dtype == MGPU_F32) { float v = (float)value, *p = MGPU__F32(t); for (i = 0; i < n; ++i) p[i] = v; }
    else if (t->dtype == MGPU_BF16) {   /* through the float, as PyTorch's fill_ */
        uint16_t v = mgpu__float_to_bf16((float)value), *p = (uint16_t*)mgpu_tensor_data(t);
        for (i = 0; i < n; ++i) p[i] = v;
    } else if (t->dtype == MGPU_I32) {   /* exact from the double (a float would round 16777217) */
        int32_t v = mgpu__to_i32(value), *p = MGPU__I32(t);
        for (i = 0; i < n; ++i) p[i] = v;
    } else memset(mgpu_tensor_data(t), mgpu__to_u8(value), (size_t)n);
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_tensor_zero(mgpu_tensor* t) { return mgpu_tensor_fill(t, 0.0); }

MGPUDEF mgpu_result mgpu_tensor_convert(mgpu_tensor* dst, const mgpu_tensor* src, float scale, float shift) {
    static const char* op = "mgpu_tensor_convert";
    char a[128], b[128];
    int64_t i, n;
    if (!dst || !src) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL tensor", op);
    MGPU__TRY(mgpu__check_same_device(op, "dst", dst, "src", src));
    if (mgpu_tensor_numel(dst) != mgpu_tensor_numel(src))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: dst %s and src %s differ in element count", op,
                          mgpu_tensor_describe(dst, a, sizeof a), mgpu_tensor_describe(src, b, sizeof b));
    n = mgpu_tensor_numel(src);
    MGPU__WROTE(dst);
    MGPU__COUNT(MGPU__DEV(dst), ops, 1);
    if (!MGPU__IS_CPU(src)) {
        MGPU__CU(op, MGPU__DEV(src), mgpu__cu_convert(MGPU__DEV(src)->ordinal, MGPU__DEV(src)->stream, (size_t)n,
                                                      (int)src->dtype, mgpu_tensor_data(src), (int)dst->dtype,
                                                      mgpu_tensor_data(dst), scale, shift));
        return MGPU_OK;
    }
    if (scale == 1.0f && shift == 0.0f)   /* plain: each value as it is (mgpu__convert_value) */
        for (i = 0; i < n; ++i) mgpu__store_float(dst->dtype, mgpu_tensor_data(dst), i, mgpu__load_as_float(src->dtype, mgpu_tensor_data(src), i));
    else
        for (i = 0; i < n; ++i)
            mgpu__store_float(dst->dtype, mgpu_tensor_data(dst), i,
                              mgpu__convert_value(mgpu__load_as_float(src->dtype, mgpu_tensor_data(src), i), scale, shift));
    return MGPU_OK;
}

/* Rows [start, start+count) of t as a header on the stack (no allocation). */
static mgpu_tensor mgpu__rows(const mgpu_tensor* t, int64_t start, int64_t count) {
    mgpu_tensor r = *t;
    r.offset += (size_t)start * (mgpu_tensor_bytes(t) / (size_t)MGPU__MAX(t->shape.dim[0], 1));
    r.shape.dim[0] = count;
    return r;
}

/* A tensor the library keeps for itself (a model's buffer or view, an optimizer's state):
   mgpu_tensor_destroy refuses it, its owner frees it with mgpu__tensor_free. */
static mgpu_tensor* mgpu__own(mgpu_tensor* t) {
    if (t) t->owned = 1;
    return t;
}

/* Make *t a tensor of this dtype and shape on dev, reusing it when it already is one (an owned
   buffer of a model). */
static mgpu_result mgpu__ensure(mgpu_tensor** t, mgpu_device* dev, mgpu_dtype dt, mgpu_shape shape) {
    if (*t && MGPU__DEV(*t) == dev && (*t)->dtype == dt && mgpu_shape_equal((*t)->shape, shape)) return MGPU_OK;
    mgpu__tensor_free(*t);
    *t = mgpu__own(mgpu_tensor_create(dev, dt, shape));
    return *t ? MGPU_OK : mgpu_last_result();
}

/* ---- >>impl random ---------------------------------------------------------------------- */
MGPUDEF uint64_t mgpu_rand_offsets(int64_t n) { return n > 0 ? ((uint64_t)n + 3) / 4 : 0; }

typedef struct mgpu__rand_job { float* out; uint64_t seed, offset; int normal; float a, b; } mgpu__rand_job;
static void mgpu__rand_range(void* ctx, int64_t begin, int64_t end) {
    mgpu__rand_job* j = (mgpu__rand_job*)ctx;
    int64_t i;
    for (i = begin; i < end; ++i) j->out[i] = mgpu__rand_element(j->seed, j->offset, (uint64_t)i, j->normal, j->a, j->b);
}
static mgpu_result mgpu__rand(const char* op, mgpu_tensor* t, uint64_t seed, uint64_t offset, int normal, float a, float b) {
    mgpu__rand_job job;
    MGPU__TRY(mgpu__check_tensor(op, "t", t, MGPU_F32));
    MGPU__WROTE(t);
    MGPU__COUNT(MGPU__DEV(t), ops, 1);
    if (!MGPU__IS_CPU(t)) {
        MGPU__CU(op, MGPU__DEV(t), mgpu__cu_rand(MGPU__DEV(t)->ordinal, MGPU__DEV(t)->stream, normal,
                                                 (size_t)mgpu_tensor_numel(t), seed, offset, a, b, MGPU__F32(t)));
        return MGPU_OK;
    }
    job.out = MGPU__F32(t); job.seed = seed; job.offset = offset; job.normal = normal; job.a = a; job.b = b;
    mgpu__parallel_range(mgpu_tensor_numel(t), 1 << 14, mgpu__rand_range, &job);
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_rand_uniform(mgpu_tensor* t, uint64_t seed, uint64_t offset, float low, float high) {
    return mgpu__rand("mgpu_rand_uniform", t, seed, offset, 0, low, high);
}
MGPUDEF mgpu_result mgpu_rand_normal(mgpu_tensor* t, uint64_t seed, uint64_t offset, float mean, float std) {
    if (!(std >= 0.0f)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_rand_normal: std %g is negative", (double)std);
    return mgpu__rand("mgpu_rand_normal", t, seed, offset, 1, mean, std);
}

/* ---- >>impl ops ------------------------------------------------------------------------- */
/* Each op: check the arguments, then run the CPU reference loop here or the CUDA kernel in
   mgpu_kernels.cu; this is the one dispatch point. */
#define MGPU__CUDA_ARGS(dev) (dev)->ordinal, (dev)->stream

/* Scratch device memory for one op, from (and back to) the caching allocator. */
typedef struct mgpu__scratch { mgpu_device* dev; void* ptr; size_t size; } mgpu__scratch;
static mgpu_result mgpu__scratch_get(mgpu__scratch* s, mgpu_device* dev, size_t bytes, const char* op) {
    s->dev = dev;
    s->ptr = mgpu__device_alloc(dev, bytes, &s->size, op);
    return s->ptr ? MGPU_OK : mgpu_last_result();
}
static void mgpu__scratch_put(mgpu__scratch* s) { if (s->ptr) mgpu__device_release(s->dev, s->ptr, s->size); s->ptr = NULL; }

/* -- elementwise -- */
typedef struct mgpu__ew_job {
    int op;
    const float *a, *b;   /* f32 tensors */
    float* y;
    const uint16_t *a16, *b16;   /* bf16 tensors (a, b, y NULL) */
    uint16_t* y16;
    float alpha;
} mgpu__ew_job;
/* One loop per op code, each calling the shared formula with a constant op: the compiler folds
   the switch inside mgpu__*_apply away and vectorises the loop. In blocks of 16 read into locals
   first: GCC's -O2 vectorises only a loop whose count it knows and whose stores cannot change its
   loads, so a plain cc -O2 build vectorises these as well as -O3 does (ReLU's forward was a
   quarter of a CNN step's time without). Each element gets the same formula: the same bits. */
#define MGPU__EW_BLOCK 16
#define MGPU__UNARY_LOOP(code)                                                                   \
    for (i = begin; i + MGPU__EW_BLOCK <= end; i += MGPU__EW_BLOCK) {                            \
        float ta[MGPU__EW_BLOCK];                                                                \
        int k;                                                                                   \
        for (k = 0; k < MGPU__EW_BLOCK; ++k) ta[k] = a[i + k];                                   \
        for (k = 0; k < MGPU__EW_BLOCK; ++k) y[i + k] = mgpu__unary_apply(code, ta[k], alpha);   \
    }                                                                                            \
    for (; i < end; ++i) y[i] = mgpu__unary_apply(code, a[i], alpha)
#define MGPU__BINARY_LOOP(code)                                                                          \
    for (i = begin; i + MGPU__EW_BLOCK <= end; i += MGPU__EW_BLOCK) {                                    \
        float ta[MGPU__EW_BLOCK], tb[MGPU__EW_BLOCK];                                                    \
        int k;                                                                                           \
        for (k = 0; k < MGPU__EW_BLOCK; ++k) { ta[k] = a[i + k]; tb[k] = b[i + k]; }                     \
        for (k = 0; k < MGPU__EW_BLOCK; ++k) y[i + k] = mgpu__binary_apply(code, ta[k], tb[k], alpha);   \
    }                                                                                                    \
    for (; i < end; ++i) y[i] = mgpu__binary_apply(code, a[i], b[i], alpha)
static void mgpu__unary_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__ew_job* j = (const mgpu__ew_job*)ctx;
    const float *a = j->a, alpha = j->alpha;
    float* y = j->y;
    int64_t i;
    switch (j->op) {
    case MGPU__UNARY_SCALE: MGPU__UNARY_LOOP(MGPU__UNARY_SCALE); break;
    case MGPU__UNARY_RELU: MGPU__UNARY_LOOP(MGPU__UNARY_RELU); break;
    case MGPU__UNARY_GELU: MGPU__UNARY_LOOP(MGPU__UNARY_GELU); break;
    case MGPU__UNARY_TANH: MGPU__UNARY_LOOP(MGPU__UNARY_TANH); break;
    case MGPU__UNARY_GELU_TANH: MGPU__UNARY_LOOP(MGPU__UNARY_GELU_TANH); break;
    default: MGPU__UNARY_LOOP(MGPU__UNARY_SIGMOID); break;
    }
}
static void mgpu__binary_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__ew_job* j = (const mgpu__ew_job*)ctx;
    const float *a = j->a, *b = j->b, alpha = j->alpha;
    float* y = j->y;
    int64_t i;
    switch (j->op) {
    case MGPU__BINARY_ADD: MGPU__BINARY_LOOP(MGPU__BINARY_ADD); break;
    case MGPU__BINARY_SUB: MGPU__BINARY_LOOP(MGPU__BINARY_SUB); break;
    case MGPU__BINARY_MUL: MGPU__BINARY_LOOP(MGPU__BINARY_MUL); break;
    case MGPU__BINARY_AXPY: MGPU__BINARY_LOOP(MGPU__BINARY_AXPY); break;
    case MGPU__BINARY_RELU_BWD: MGPU__BINARY_LOOP(MGPU__BINARY_RELU_BWD); break;
    case MGPU__BINARY_GELU_BWD: MGPU__BINARY_LOOP(MGPU__BINARY_GELU_BWD); break;
    case MGPU__BINARY_TANH_BWD: MGPU__BINARY_LOOP(MGPU__BINARY_TANH_BWD); break;
    case MGPU__BINARY_GELU_TANH_BWD: MGPU__BINARY_LOOP(MGPU__BINARY_GELU_TANH_BWD); break;
    default: MGPU__BINARY_LOOP(MGPU__BINARY_SIGMOID_BWD); break;
    }
}
#undef MGPU__UNARY_LOOP
#undef MGPU__BINARY_LOOP
/* bf16 tensors: blocks widened to float on the stack, the f32 loops above, each result rounded
   once (to nearest even), as the GPU's kernels do */
static void mgpu__ew_bf16_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__ew_job* j = (const mgpu__ew_job*)ctx;
    float a[256], b[256], y[256];
    mgpu__ew_job f = *j;
    int64_t i0, i, n;
    f.a = a;
    f.b = j->b16 ? b : NULL;
    f.y = y;
    for (i0 = begin; i0 < end; i0 += n) {
        n = MGPU__MIN(end - i0, (int64_t)256);
        mgpu__bf16_widen(j->a16 + i0, a, n);
        if (j->b16) {
            mgpu__bf16_widen(j->b16 + i0, b, n);
            mgpu__binary_range(&f, 0, n);
        } else mgpu__unary_range(&f, 0, n);
        for (i = 0; i < n; ++i) j->y16[i0 + i] = mgpu__float_to_bf16(y[i]);
    }
}
#define MGPU__EW_MIN_PER_THREAD (1 << 15)

/* The elementwise ops take F32 tensors, or BF16 ones (every tensor of the call BF16). */
static mgpu_result mgpu__unary(const char* op, int code, mgpu_tensor* out, const mgpu_tensor* x, float alpha) {
    mgpu__ew_job job;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, x && x->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32));
    MGPU__TRY(mgpu__check_match(op, "out", out, "x", x));
    MGPU__WROTE(out);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_unary(MGPU__CUDA_ARGS(MGPU__DEV(x)), code, (int)x->dtype, (size_t)mgpu_tensor_numel(x),
                                                  mgpu_tensor_data(x), mgpu_tensor_data(out), alpha));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.op = code; job.alpha = alpha;
    if (x->dtype == MGPU_BF16) {
        job.a16 = (const uint16_t*)mgpu_tensor_data(x); job.y16 = (uint16_t*)mgpu_tensor_data(out);
        mgpu__parallel_range(mgpu_tensor_numel(x), MGPU__EW_MIN_PER_THREAD, mgpu__ew_bf16_range, &job);
        return MGPU_OK;
    }
    job.a = MGPU__F32(x); job.y = MGPU__F32(out);
    mgpu__parallel_range(mgpu_tensor_numel(x), MGPU__EW_MIN_PER_THREAD, mgpu__unary_range, &job);
    return MGPU_OK;
}

static mgpu_result mgpu__binary(const char* op, int code, mgpu_tensor* out, const char* an, const mgpu_tensor* a,
                                const char* bn, const mgpu_tensor* b, float alpha) {
    mgpu__ew_job job;
    MGPU__TRY(mgpu__check_tensor(op, an, a, a && a->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32));
    MGPU__TRY(mgpu__check_match(op, bn, b, an, a));
    MGPU__TRY(mgpu__check_match(op, "out", out, an, a));
    MGPU__WROTE(out);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(a)) {
        MGPU__CU(op, MGPU__DEV(a), mgpu__cu_binary(MGPU__CUDA_ARGS(MGPU__DEV(a)), code, (int)a->dtype, (size_t)mgpu_tensor_numel(a),
                                                   mgpu_tensor_data(a), mgpu_tensor_data(b), mgpu_tensor_data(out), alpha));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.op = code; job.alpha = alpha;
    if (a->dtype == MGPU_BF16) {
        job.a16 = (const uint16_t*)mgpu_tensor_data(a); job.b16 = (const uint16_t*)mgpu_tensor_data(b);
        job.y16 = (uint16_t*)mgpu_tensor_data(out);
        mgpu__parallel_range(mgpu_tensor_numel(a), MGPU__EW_MIN_PER_THREAD, mgpu__ew_bf16_range, &job);
        return MGPU_OK;
    }
    job.a = MGPU__F32(a); job.b = MGPU__F32(b); job.y = MGPU__F32(out);
    mgpu__parallel_range(mgpu_tensor_numel(a), MGPU__EW_MIN_PER_THREAD, mgpu__binary_range, &job);
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_add(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__binary("mgpu_add", MGPU__BINARY_ADD, out, "a", a, "b", b, 0.0f); }
MGPUDEF mgpu_result mgpu_sub(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__binary("mgpu_sub", MGPU__BINARY_SUB, out, "a", a, "b", b, 0.0f); }
MGPUDEF mgpu_result mgpu_mul(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__binary("mgpu_mul", MGPU__BINARY_MUL, out, "a", a, "b", b, 0.0f); }
MGPUDEF mgpu_result mgpu_axpy(mgpu_tensor* y, float alpha, const mgpu_tensor* x) { return mgpu__binary("mgpu_axpy", MGPU__BINARY_AXPY, y, "x", x, "y", y, alpha); }
MGPUDEF mgpu_result mgpu_scale(mgpu_tensor* out, const mgpu_tensor* x, float alpha) { return mgpu__unary("mgpu_scale", MGPU__UNARY_SCALE, out, x, alpha); }
MGPUDEF mgpu_result mgpu_relu(mgpu_tensor* out, const mgpu_tensor* x) { return mgpu__unary("mgpu_relu", MGPU__UNARY_RELU, out, x, 0.0f); }
MGPUDEF mgpu_result mgpu_gelu(mgpu_tensor* out, const mgpu_tensor* x) { return mgpu__unary("mgpu_gelu", MGPU__UNARY_GELU, out, x, 0.0f); }
MGPUDEF mgpu_result mgpu_gelu_tanh(mgpu_tensor* out, const mgpu_tensor* x) { return mgpu__unary("mgpu_gelu_tanh", MGPU__UNARY_GELU_TANH, out, x, 0.0f); }
MGPUDEF mgpu_result mgpu_tanh(mgpu_tensor* out, const mgpu_tensor* x) { return mgpu__unary("mgpu_tanh", MGPU__UNARY_TANH, out, x, 0.0f); }
MGPUDEF mgpu_result mgpu_sigmoid(mgpu_tensor* out, const mgpu_tensor* x) { return mgpu__unary("mgpu_sigmoid", MGPU__UNARY_SIGMOID, out, x, 0.0f); }
MGPUDEF mgpu_result mgpu_relu_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x) { return mgpu__binary("mgpu_relu_backward", MGPU__BINARY_RELU_BWD, dx, "dy", dy, "x", x, 0.0f); }
MGPUDEF mgpu_result mgpu_gelu_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x) { return mgpu__binary("mgpu_gelu_backward", MGPU__BINARY_GELU_BWD, dx, "dy", dy, "x", x, 0.0f); }
MGPUDEF mgpu_result mgpu_gelu_tanh_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* x) { return mgpu__binary("mgpu_gelu_tanh_backward", MGPU__BINARY_GELU_TANH_BWD, dx, "dy", dy, "x", x, 0.0f); }
MGPUDEF mgpu_result mgpu_tanh_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* y) { return mgpu__binary("mgpu_tanh_backward", MGPU__BINARY_TANH_BWD, dx, "dy", dy, "y", y, 0.0f); }
MGPUDEF mgpu_result mgpu_sigmoid_backward(mgpu_tensor* dx, const mgpu_tensor* dy, const mgpu_tensor* y) { return mgpu__binary("mgpu_sigmoid_backward", MGPU__BINARY_SIGMOID_BWD, dx, "dy", dy, "y", y, 0.0f); }

/* -- matmul: cuBLAS on the GPU; on the CPU a blocked GEMM built like BLIS's -- */
static int mgpu__overlap(const mgpu_tensor* a, const mgpu_tensor* b) {
    return a->storage == b->storage && a->offset < b->offset + mgpu_tensor_bytes(b) && b->offset < a->offset + mgpu_tensor_bytes(a);
}

/* C[m,n] = beta C + alpha op(A)[m,k] op(B)[k,n], all row-major, in the BLIS way:
     - op(B) is cut into panels of KC rows by NC columns, each packed into slivers of NR columns
       (kc x NR floats, contiguous); op(A) into slivers of MR rows (kc x MR floats);
     - the micro-kernel multiplies one A sliver by one B sliver into an MR x NR tile of C kept in
       registers the whole time (AVX2+FMA: 6 x 16 = twelve 8-float registers), the sliver of B
       staying in the L1 cache while the slivers of A go by;
     - threads share out the tiles of C, never the sum: every element of C is summed in the same
       order (KC blocks in turn, k in order within one) whatever the thread count, so the bits
       do not depend on it; partial tiles at the edges go through a scratch tile and the same
       micro-kernel, so they round alike too;
     - with alpha 1, C += op(A) op(B) is one chain of FMAs per element, from C's value on, k in
       order: the micro-kernel starts from the tile of C rather than from zero. So a product cut
       along k into several calls that add onto C gives the bits of one call: the weight
       gradient summed over micro-batches (or accumulated batches) is that of the whole batch.
       Not so for a long sum into a small C, which is cut into chunks summed apart (split-k,
       below: k of 8192 and more), nor with MGPU_CBLAS, whose BLAS promises no order.
   With MGPU_CBLAS, cblas_sgemm does it instead (see the doc block). */
#define MGPU__GEMM_MR 6
#define MGPU__GEMM_NR 16
#define MGPU__GEMM_KC 256
#define MGPU__GEMM_MC 96      /* rows of C per task: an MC x KC block of A stays in the L2 cache */
#define MGPU__GEMM_NC 3072    /* columns of B per panel: KC x NC in the L3 cache */

/* C[0..MR)[0..NR) += alpha * sum over kk of a[r*rs + kk*ks] * b[kk*bs + j] (add 0: C = that, C
   unread; alpha 1: the FMAs go onto C itself): A packed (rs 1, ks MR) or read where it lies
   (row-major: rs lda, ks 1; transposed: rs 1, ks lda); B packed (bs NR) or read where it lies
   (bs ldb) */
#ifdef MGPU__AVX2
static MGPU__AVX2_FN void mgpu__gemm_kernel_avx2(int64_t kc, const float* a, int64_t rs, int64_t ks, const float* b, int64_t bs, float* c,
                              int64_t ldc, float alpha, int add) {
    const int chain = add && alpha == 1.0f;   /* the tile starts from C */
#define MGPU__GEMM_START(r, j) (chain ? _mm256_loadu_ps(c + (r) * ldc + (j)) : _mm256_setzero_ps())
    __m256 c00 = MGPU__GEMM_START(0, 0), c01 = MGPU__GEMM_START(0, 8), c10 = MGPU__GEMM_START(1, 0), c11 = MGPU__GEMM_START(1, 8);
    __m256 c20 = MGPU__GEMM_START(2, 0), c21 = MGPU__GEMM_START(2, 8), c30 = MGPU__GEMM_START(3, 0), c31 = MGPU__GEMM_START(3, 8);
    __m256 c40 = MGPU__GEMM_START(4, 0), c41 = MGPU__GEMM_START(4, 8), c50 = MGPU__GEMM_START(5, 0), c51 = MGPU__GEMM_START(5, 8);
#undef MGPU__GEMM_START
    const __m256 va = _mm256_set1_ps(alpha);
    int64_t kk;
    for (kk = 0; kk < kc; ++kk, a += ks, b += bs) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        __m256 ar = _mm256_broadcast_ss(a);
        c00 = _mm256_fmadd_ps(ar, b0, c00); c01 = _mm256_fmadd_ps(ar, b1, c01);
        ar = _mm256_broadcast_ss(a + rs);
        c10 = _mm256_fmadd_ps(ar, b0, c10); c11 = _mm256_fmadd_ps(ar, b1, c11);
        ar = _mm256_broadcast_ss(a + 2 * rs);
        c20 = _mm256_fmadd_ps(ar, b0, c20); c21 = _mm256_fmadd_ps(ar, b1, c21);
        ar = _mm256_broadcast_ss(a + 3 * rs);
        c30 = _mm256_fmadd_ps(ar, b0, c30); c31 = _mm256_fmadd_ps(ar, b1, c31);
        ar = _mm256_broadcast_ss(a + 4 * rs);
        c40 = _mm256_fmadd_ps(ar, b0, c40); c41 = _mm256_fmadd_ps(ar, b1, c41);
        ar = _mm256_broadcast_ss(a + 5 * rs);
        c50 = _mm256_fmadd_ps(ar, b0, c50); c51 = _mm256_fmadd_ps(ar, b1, c51);
    }
#define MGPU__GEMM_ROW(r, lo, hi)                                                                                           \
    _mm256_storeu_ps(c + (r) * ldc, chain ? lo : _mm256_fmadd_ps(va, lo, add ? _mm256_loadu_ps(c + (r) * ldc) : _mm256_setzero_ps()));   \
    _mm256_storeu_ps(c + (r) * ldc + 8, chain ? hi : _mm256_fmadd_ps(va, hi, add ? _mm256_loadu_ps(c + (r) * ldc + 8) : _mm256_setzero_ps()))
    MGPU__GEMM_ROW(0, c00, c01); MGPU__GEMM_ROW(1, c10, c11); MGPU__GEMM_ROW(2, c20, c21);
    MGPU__GEMM_ROW(3, c30, c31); MGPU__GEMM_ROW(4, c40, c41); MGPU__GEMM_ROW(5, c50, c51);
#undef MGPU__GEMM_ROW
}
#endif
#ifdef MGPU__NEON
static void mgpu__gemm_kernel_neon(int64_t kc, const float* a, int64_t rs, int64_t ks, const float* b, int64_t bs, float* c,
                                   int64_t ldc, float alpha, int add) {
    const int chain = add && alpha == 1.0f;   /* the tile starts from C */
    const float32x4_t zero = vdupq_n_f32(0.0f), va = vdupq_n_f32(alpha);
#define MGPU__GEMM_START(r, j) (chain ? vld1q_f32(c + (r) * ldc + (j)) : zero)
#define MGPU__GEMM_ROW_START(r)                                                                                   \
    float32x4_t c##r##0 = MGPU__GEMM_START(r, 0), c##r##1 = MGPU__GEMM_START(r, 4), c##r##2 = MGPU__GEMM_START(r, 8), \
                c##r##3 = MGPU__GEMM_START(r, 12)
    MGPU__GEMM_ROW_START(0); MGPU__GEMM_ROW_START(1); MGPU__GEMM_ROW_START(2);
    MGPU__GEMM_ROW_START(3); MGPU__GEMM_ROW_START(4); MGPU__GEMM_ROW_START(5);
#undef MGPU__GEMM_ROW_START
#undef MGPU__GEMM_START
    int64_t kk;
    for (kk = 0; kk < kc; ++kk, a += ks, b += bs) {
        const float32x4_t b0 = vld1q_f32(b), b1 = vld1q_f32(b + 4), b2 = vld1q_f32(b + 8), b3 = vld1q_f32(b + 12);
        float32x4_t ar;
#define MGPU__GEMM_FMA(r)                                                                                         \
    ar = vdupq_n_f32(a[(r) * rs]);                                                                                \
    c##r##0 = vfmaq_f32(c##r##0, ar, b0); c##r##1 = vfmaq_f32(c##r##1, ar, b1);                                   \
    c##r##2 = vfmaq_f32(c##r##2, ar, b2); c##r##3 = vfmaq_f32(c##r##3, ar, b3)
        MGPU__GEMM_FMA(0); MGPU__GEMM_FMA(1); MGPU__GEMM_FMA(2); MGPU__GEMM_FMA(3); MGPU__GEMM_FMA(4); MGPU__GEMM_FMA(5);
#undef MGPU__GEMM_FMA
    }
    /* as the AVX2 kernel: C = tile (chained), or alpha * tile + (C or 0) in one fused step */
#define MGPU__GEMM_OUT(r, q, v) \
    vst1q_f32(c + (r) * ldc + 4 * (q), chain ? v : vfmaq_f32(add ? vld1q_f32(c + (r) * ldc + 4 * (q)) : zero, va, v))
#define MGPU__GEMM_ROW(r) MGPU__GEMM_OUT(r, 0, c##r##0); MGPU__GEMM_OUT(r, 1, c##r##1); MGPU__GEMM_OUT(r, 2, c##r##2); MGPU__GEMM_OUT(r, 3, c##r##3)
    MGPU__GEMM_ROW(0); MGPU__GEMM_ROW(1); MGPU__GEMM_ROW(2); MGPU__GEMM_ROW(3); MGPU__GEMM_ROW(4); MGPU__GEMM_ROW(5);
#undef MGPU__GEMM_ROW
#undef MGPU__GEMM_OUT
}
#endif
#if !defined(MGPU__AVX2_ALWAYS) && !defined(MGPU__NEON)
/* The portable micro-kernel: the same tile in a local array (the compiler vectorises the j loops). */
static void mgpu__gemm_kernel_portable(int64_t kc, const float* a, int64_t rs, int64_t ks, const float* b, int64_t bs, float* c,
                              int64_t ldc, float alpha, int add) {
    float acc[MGPU__GEMM_MR][MGPU__GEMM_NR];
    const int chain = add && alpha == 1.0f;   /* the tile starts from C */
    int64_t kk;
    int r, j;
    for (r = 0; r < MGPU__GEMM_MR; ++r)
        for (j = 0; j < MGPU__GEMM_NR; ++j) acc[r][j] = chain ? c[r * ldc + j] : 0.0f;
    for (kk = 0; kk < kc; ++kk, a += ks, b += bs)
        for (r = 0; r < MGPU__GEMM_MR; ++r) {
            const float ar = a[r * rs];
            for (j = 0; j < MGPU__GEMM_NR; ++j) acc[r][j] += ar * b[j];
        }
    for (r = 0; r < MGPU__GEMM_MR; ++r)
        for (j = 0; j < MGPU__GEMM_NR; ++j) c[r * ldc + j] = chain ? acc[r][j] : (add ? c[r * ldc + j] : 0.0f) + alpha * acc[r][j];
}
#endif
static void mgpu__gemm_kernel(int64_t kc, const float* a, int64_t rs, int64_t ks, const float* b, int64_t bs, float* c,
                              int64_t ldc, float alpha, int add) {
#ifdef MGPU__AVX2
    if (MGPU__HAVE_AVX2()) {
        mgpu__gemm_kernel_avx2(kc, a, rs, ks, b, bs, c, ldc, alpha, add);
        return;
    }
#endif
#if defined(MGPU__NEON)
    mgpu__gemm_kernel_neon(kc, a, rs, ks, b, bs, c, ldc, alpha, add);
#elif !defined(MGPU__AVX2_ALWAYS)
    mgpu__gemm_kernel_portable(kc, a, rs, ks, b, bs, c, ldc, alpha, add);
#endif
}

/* One GEMM's operands, and its packed panels (from the caching allocator, 64-byte aligned). */
typedef struct mgpu__gemm {
    int ta, tb;
    int64_t m, n, lda, ldb, ldc;
    float alpha;
    const float *a, *b;
    float* c;
    float *ap, *bp;           /* packed op(A) [ceil(m/MR)][kc][MR], op(B) [ceil(nc/NR)][kc][NR] */
    int pack_a;               /* 0: the kernel reads A where it lies (a narrow C reuses it too little
                                 to pay for the copy); only the last, partial sliver is packed */
    int pack_b;               /* 0: the same for a B that is not transposed and C that is short */
    int64_t k0, kc, j0, nc;   /* the panel being multiplied */
    int overwrite;            /* C holds anything (beta 0): the first KC block stores rather than adds */
    int a_ready;              /* ap holds op(A) packed already (k <= KC: one block): pack none of it */
    int add;                  /* the current KC block adds onto C */
} mgpu__gemm;

#ifdef MGPU__AVX2
/* r[0..8) transposed in place: column c of the 8 x 8 block in r[c] */
static inline MGPU__AVX2_FN void mgpu__transpose_regs(__m256* r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]), t2 = _mm256_unpacklo_ps(r[2], r[3]);
    const __m256 t3 = _mm256_unpackhi_ps(r[2], r[3]), t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
/* p[k * 6 + r] = src[r * lds + k] for the 6 rows of a whole sliver, k in blocks of 8 through the
   register transpose (two rows of zeros); returns how far along k it went (the rest, fewer than
   8, the caller copies). Each k's 6 floats are stored as 4 and 2, never past them: another
   thread may be packing the next sliver. */
static MGPU__AVX2_FN int64_t mgpu__pack_rows_6(const float* src, int64_t lds, int64_t kc, float* p) {
    int64_t k;
    for (k = 0; k + 8 <= kc; k += 8) {
        __m256 r[8];
        int c;
        for (c = 0; c < 6; ++c) r[c] = _mm256_loadu_ps(src + c * lds + k);
        r[6] = r[7] = _mm256_setzero_ps();
        mgpu__transpose_regs(r);
        for (c = 0; c < 8; ++c) {
            float* d = p + (k + c) * MGPU__GEMM_MR;
            _mm_storeu_ps(d, _mm256_castps256_ps128(r[c]));
            _mm_storel_pi((__m64*)(void*)(d + 4), _mm256_extractf128_ps(r[c], 1));
        }
    }
    return k;
}
#endif

/* Sliver s of op(A) rows for the current panel into p [kc][MR]; zeros pad a partial one. */
static void mgpu__gemm_pack_a_sliver(const mgpu__gemm* g, int64_t s, float* p) {
    const int64_t rows = MGPU__MIN((int64_t)MGPU__GEMM_MR, g->m - s * MGPU__GEMM_MR), i0 = s * MGPU__GEMM_MR;
    int64_t kk, r;
    if (rows < MGPU__GEMM_MR) memset(p, 0, sizeof(float) * (size_t)(g->kc * MGPU__GEMM_MR));
    if (g->ta) {   /* op(A) = A^T: the sliver's rows are contiguous in each row of A */
        const float* src = g->a + g->k0 * g->lda + i0;
        for (kk = 0; kk < g->kc; ++kk, src += g->lda)
            for (r = 0; r < rows; ++r) p[kk * MGPU__GEMM_MR + r] = src[r];
    } else {       /* each of the sliver's rows, along k */
        const float* src = g->a + i0 * g->lda + g->k0;
        kk = 0;
#ifdef MGPU__AVX2
        if (rows == MGPU__GEMM_MR && MGPU__HAVE_AVX2()) kk = mgpu__pack_rows_6(src, g->lda, g->kc, p);
#endif
        for (r = 0; r < rows; ++r) {
            int64_t k;
            for (k = kk; k < g->kc; ++k) p[k * MGPU__GEMM_MR + r] = src[r * g->lda + k];
        }
    }
}
static void mgpu__gemm_pack_a(const mgpu__gemm* g, int64_t first, int64_t last) {
    int64_t s;
    if (!g->pack_a || g->a_ready) return;
    for (s = first; s < last; ++s) mgpu__gemm_pack_a_sliver(g, s, g->ap + s * g->kc * MGPU__GEMM_MR);
}
#ifdef MGPU__AVX2
/* dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block */
static MGPU__AVX2_FN void mgpu__transpose_8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r[8];
    int i;
    for (i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    mgpu__transpose_regs(r);
    for (i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ldd, r[i]);
}
#endif

/* A whole sliver of op(B) = B^T: each of its NR columns is a row of B, along k */
static void mgpu__gemm_pack_b_transposed(const mgpu__gemm* g, int64_t j0, float* p) {
    const float* src = g->b + j0 * g->ldb + g->k0;
    int64_t kk = 0, j;
#ifdef MGPU__AVX2
    if (MGPU__HAVE_AVX2())
        for (; kk + 8 <= g->kc; kk += 8)   /* 8 x 8 blocks through registers */
            for (j = 0; j < MGPU__GEMM_NR; j += 8) mgpu__transpose_8x8(src + j * g->ldb + kk, g->ldb, p + kk * MGPU__GEMM_NR + j, MGPU__GEMM_NR);
#endif
    for (j = 0; j < MGPU__GEMM_NR; ++j) {
        int64_t k;
        for (k = kk; k < g->kc; ++k) p[k * MGPU__GEMM_NR + j] = src[j * g->ldb + k];
    }
}

/* Sliver s of op(B) columns for the current panel into p [kc][NR]; zeros pad a partial one. */
static void mgpu__gemm_pack_b_sliver(const mgpu__gemm* g, int64_t s, float* p) {
    const int64_t j0 = g->j0 + s * MGPU__GEMM_NR, cols = MGPU__MIN((int64_t)MGPU__GEMM_NR, g->j0 + g->nc - j0);
    int64_t kk, j;
    if (g->tb && cols == MGPU__GEMM_NR) { mgpu__gemm_pack_b_transposed(g, j0, p); return; }
    for (kk = 0; kk < g->kc; ++kk, p += MGPU__GEMM_NR) {
        const int64_t k = g->k0 + kk;
        if (!g->tb && cols == MGPU__GEMM_NR) { memcpy(p, g->b + k * g->ldb + j0, sizeof(float) * MGPU__GEMM_NR); continue; }
        for (j = 0; j < cols; ++j) p[j] = g->tb ? g->b[(j0 + j) * g->ldb + k] : g->b[k * g->ldb + j0 + j];
        for (; j < MGPU__GEMM_NR; ++j) p[j] = 0.0f;
    }
}
static void mgpu__gemm_pack_b(const mgpu__gemm* g, int64_t first, int64_t last) {
    int64_t s;
    if (!g->pack_b) return;
    for (s = first; s < last; ++s) mgpu__gemm_pack_b_sliver(g, s, g->bp + s * g->kc * MGPU__GEMM_NR);
}

/* The tiles of C in rows [i0, i1) x panel columns [jb0, jb1) (multiples of MR and NR). */
static void mgpu__gemm_tiles(const mgpu__gemm* g, int64_t i0, int64_t i1, int64_t jb0, int64_t jb1) {
    float bedge[MGPU__GEMM_KC * MGPU__GEMM_NR];   /* the partial last sliver of an unpacked B */
    int64_t jb, i;
    for (jb = jb0; jb < jb1; jb += MGPU__GEMM_NR) {   /* one B sliver stays in L1 over the A slivers */
        const float* bs = g->bp + (jb / MGPU__GEMM_NR) * g->kc * MGPU__GEMM_NR;
        const int64_t cols = MGPU__MIN((int64_t)MGPU__GEMM_NR, g->nc - jb);
        int64_t bstride = MGPU__GEMM_NR;
        if (!g->pack_b && cols == MGPU__GEMM_NR) {
            bs = g->b + g->k0 * g->ldb + g->j0 + jb;
            bstride = g->ldb;
        } else if (!g->pack_b) {
            mgpu__gemm_pack_b_sliver(g, jb / MGPU__GEMM_NR, bedge);
            bs = bedge;
        }
        for (i = i0; i < i1; i += MGPU__GEMM_MR) {
            const int64_t rows = MGPU__MIN((int64_t)MGPU__GEMM_MR, g->m - i);
            float* c = g->c + i * g->ldc + g->j0 + jb;
            float edge[MGPU__GEMM_MR * MGPU__GEMM_KC];   /* the partial last sliver of an unpacked A */
            const float* as = g->ap + (i / MGPU__GEMM_MR) * g->kc * MGPU__GEMM_MR;
            int64_t rs = 1, ks = MGPU__GEMM_MR;
            if (!g->pack_a && rows == MGPU__GEMM_MR) {
                as = g->ta ? g->a + g->k0 * g->lda + i : g->a + i * g->lda + g->k0;
                rs = g->ta ? 1 : g->lda;
                ks = g->ta ? g->lda : 1;
            } else if (!g->pack_a) {
                mgpu__gemm_pack_a_sliver(g, i / MGPU__GEMM_MR, edge);
                as = edge;
            }
            if (rows == MGPU__GEMM_MR && cols == MGPU__GEMM_NR) {
                mgpu__gemm_kernel(g->kc, as, rs, ks, bs, bstride, c, g->ldc, g->alpha, g->add);
            } else {   /* an edge: through a scratch tile, with the same kernel */
                float tile[MGPU__GEMM_MR * MGPU__GEMM_NR];
                int64_t r, j;
                if (g->add) {   /* (a first block that overwrites reads nothing) */
                    memset(tile, 0, sizeof tile);
                    for (r = 0; r < rows; ++r) for (j = 0; j < cols; ++j) tile[r * MGPU__GEMM_NR + j] = c[r * g->ldc + j];
                }
                mgpu__gemm_kernel(g->kc, as, rs, ks, bs, bstride, tile, MGPU__GEMM_NR, g->alpha, g->add);
                for (r = 0; r < rows; ++r) for (j = 0; j < cols; ++j) c[r * g->ldc + j] = tile[r * MGPU__GEMM_NR + j];
            }
        }
    }
}

/* The whole product over k in [k_begin, k_end) into g->c, panel by panel. With tasks > 1 the
   packing and the tiles of each panel are shared out over the thread pool. */
typedef struct mgpu__gemm_job { mgpu__gemm* g; int64_t row_blocks, col_groups, group_cols; } mgpu__gemm_job;
static void mgpu__gemm_pack_task(void* ctx, int64_t task) {
    const mgpu__gemm_job* j = (const mgpu__gemm_job*)ctx;
    const int64_t sa = (j->g->m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR, sb = (j->g->nc + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR;
    const int64_t tasks = j->row_blocks * j->col_groups;   /* each packs its share of both */
    mgpu__gemm_pack_a(j->g, sa * task / tasks, sa * (task + 1) / tasks);
    mgpu__gemm_pack_b(j->g, sb * task / tasks, sb * (task + 1) / tasks);
}
static void mgpu__gemm_tile_task(void* ctx, int64_t task) {
    const mgpu__gemm_job* j = (const mgpu__gemm_job*)ctx;
    const int64_t rb = task % j->row_blocks, cg = task / j->row_blocks;
    const int64_t slivers = (j->g->m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR;   /* row blocks of equal slivers, give or take one */
    const int64_t i0 = slivers * rb / j->row_blocks * MGPU__GEMM_MR;
    const int64_t i1 = MGPU__MIN(j->g->m, slivers * (rb + 1) / j->row_blocks * MGPU__GEMM_MR);
    const int64_t jb0 = cg * j->group_cols, jb1 = MGPU__MIN(j->g->nc, jb0 + j->group_cols);
    if (i0 < i1 && jb0 < jb1) mgpu__gemm_tiles(j->g, i0, i1, jb0, jb1);
}
static void mgpu__gemm_run(mgpu__gemm* g, int64_t k_begin, int64_t k_end, int threads) {
    mgpu__gemm_job job;
    job.g = g;
    for (g->j0 = 0; g->j0 < g->n; g->j0 += MGPU__GEMM_NC) {
        g->nc = MGPU__MIN((int64_t)MGPU__GEMM_NC, g->n - g->j0);
        /* tasks: blocks of about MC rows, as many as a multiple of the threads (512 rows in 6
           blocks of 96 and 32 leave one of 2 threads 288 rows and the other 224; in 6 blocks of
           84 to 90, 256 each), and the columns cut in groups of slivers when the rows are too
           few to keep every thread busy */
        job.row_blocks = (g->m + MGPU__GEMM_MC - 1) / MGPU__GEMM_MC;
        if (threads > 1 && job.row_blocks > threads) job.row_blocks = (job.row_blocks + threads - 1) / threads * threads;
        job.col_groups = MGPU__MAX((int64_t)1, MGPU__MIN((threads + job.row_blocks - 1) / job.row_blocks,
                                                        (g->nc + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR));
        job.group_cols = ((g->nc + job.col_groups - 1) / job.col_groups + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR * MGPU__GEMM_NR;
        for (g->k0 = k_begin; g->k0 < k_end; g->k0 += MGPU__GEMM_KC) {
            g->kc = MGPU__MIN((int64_t)MGPU__GEMM_KC, k_end - g->k0);
            g->add = !g->overwrite || g->k0 > k_begin;
            if (threads > 1) {
                mgpu__parallel_for(job.row_blocks * job.col_groups, mgpu__gemm_pack_task, &job);
                mgpu__parallel_for(job.row_blocks * job.col_groups, mgpu__gemm_tile_task, &job);
            } else {
                mgpu__gemm_pack_a(g, 0, (g->m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR);
                mgpu__gemm_pack_b(g, 0, (g->nc + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR);
                mgpu__gemm_tiles(g, 0, g->m, 0, g->nc);
            }
        }
    }
}

/* Floats of packing space for op(A) and op(B) panels of a GEMM with m rows and n columns. */
static size_t mgpu__gemm_pack_floats(int64_t m, int64_t n) {
    return (size_t)(((m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR +
                     (MGPU__MIN(n, (int64_t)MGPU__GEMM_NC) + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR * MGPU__GEMM_NR) *
                    MGPU__GEMM_KC);
}

/* C += op(A) op(B) (overwrite: C = op(A) op(B), C unread) on the calling thread, packing into
   space (mgpu__gemm_pack_floats(m, n) floats, 32-byte aligned): the products inside one task of
   a larger parallel job. packed_a: op(A) as mgpu__gemm_prepack_a left it, or NULL. */
static void mgpu__gemm_serial(int ta, int tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                              const float* b, int64_t ldb, float* c, int64_t ldc, float* space, int overwrite,
                              const float* packed_a) {
    mgpu__gemm g;
    memset(&g, 0, sizeof g);
    g.overwrite = overwrite;
    g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.lda = lda; g.ldb = ldb; g.ldc = ldc;
    g.alpha = 1.0f; g.a = a; g.b = b; g.c = c;
    g.pack_a = packed_a || n > 4 * MGPU__GEMM_NR;   /* as in mgpu__cpu_gemm */
    g.a_ready = packed_a != NULL;
    g.pack_b = tb;   /* a plain B read in place: these products are small, their B slivers stay in L1 */
    g.ap = packed_a ? (float*)packed_a : space;   /* (only read when a_ready) */
    g.bp = space + (size_t)((m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR * MGPU__GEMM_KC);
    mgpu__gemm_run(&g, 0, k, 1);
}

/* op(A) [m, k] (k <= KC) packed once into ap (ceil(m/MR)*MR*k floats) for several products
   that share it, as mgpu__gemm_run would pack it for each */
static void mgpu__gemm_prepack_a(int ta, int64_t m, int64_t k, const float* a, int64_t lda, float* ap) {
    mgpu__gemm g;
    int64_t s;
    memset(&g, 0, sizeof g);
    g.ta = ta; g.m = m; g.lda = lda; g.a = a; g.kc = k;
    for (s = 0; s < (m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR; ++s) mgpu__gemm_pack_a_sliver(&g, s, ap + s * k * MGPU__GEMM_MR);
}

/* Small products (C of at most a few row blocks, as in the MLP's layers): one task per share of
   C, cut along whole slivers so the tiles and the bits stay those of one thread, each task
   packing what it needs itself through every panel. One dispatch to the pool per product,
   instead of two per panel: at these sizes the dispatches are what costs. */
#define MGPU__GEMM_SMALL_M (2 * MGPU__GEMM_MC)
typedef struct mgpu__gemm_small_job {
    const mgpu__gemm* g;
    int64_t k, tasks, slivers;
    int by_rows;           /* share the rows of C out (else its columns) */
    size_t task_floats;    /* packing space per task */
    float* space;
} mgpu__gemm_small_job;
static void mgpu__gemm_small_task(void* ctx, int64_t task) {
    const mgpu__gemm_small_job* j = (const mgpu__gemm_small_job*)ctx;
    mgpu__gemm g = *j->g;
    const int64_t s0 = j->slivers * task / j->tasks, s1 = j->slivers * (task + 1) / j->tasks;
    if (s0 == s1) return;
    if (j->by_rows) {
        const int64_t r0 = s0 * MGPU__GEMM_MR;
        g.a += g.ta ? r0 : r0 * g.lda;
        g.c += r0 * g.ldc;
        g.m = MGPU__MIN(g.m, s1 * MGPU__GEMM_MR) - r0;
    } else {
        const int64_t c0 = s0 * MGPU__GEMM_NR;
        g.b += g.tb ? c0 * g.ldb : c0;
        g.c += c0;
        g.n = MGPU__MIN(g.n, s1 * MGPU__GEMM_NR) - c0;
    }
    g.ap = j->space + (size_t)task * j->task_floats;
    g.bp = g.ap + (size_t)((g.m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR * MGPU__GEMM_KC);
    mgpu__gemm_run(&g, 0, j->k, 1);
}


/* Few outputs over a long sum (a convolution's weight gradient: 16 x 9 values, each a sum over
   100k positions): too few tiles of C to share out, so the sum is cut into chunks instead, each
   multiplied by one task into its own partial C, and the partials are added in chunk order.
   Chunks do not depend on the thread count, nor therefore do the bits. */
#define MGPU__GEMM_SPLIT_MIN_K 8192
#define MGPU__GEMM_SPLIT_MAX_C 65536   /* m * n */
#define MGPU__GEMM_SPLIT_CHUNKS 64     /* at most */
typedef struct mgpu__gemm_split_job {
    mgpu__gemm g;
    int64_t k, chunk;
    size_t pack_floats;
    float* space;       /* [chunks][m * n partial + pack_floats] */
} mgpu__gemm_split_job;

static void mgpu__gemm_split_task(void* ctx, int64_t task) {
    const mgpu__gemm_split_job* s = (const mgpu__gemm_split_job*)ctx;
    mgpu__gemm g = s->g;
    const size_t cn = (size_t)(g.m * g.n + 15) / 16 * 16;   /* keeps each chunk's space 64-byte aligned */
    g.c = s->space + (size_t)task * (cn + s->pack_floats);
    g.ldc = g.n;
    g.ap = g.c + cn;
    g.bp = g.ap + (size_t)((g.m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR * MGPU__GEMM_KC);
    /* A and a plain B read where they lie: a chunk's C is too small for copies of them to pay
       (32 x 144 over 25088: 1.45x), B only while the slivers of A that reuse it are few */
    g.pack_a = 0;
    g.pack_b = g.tb || g.m > MGPU__GEMM_MC;
    memset(g.c, 0, sizeof(float) * (size_t)(g.m * g.n));
    mgpu__gemm_run(&g, task * s->chunk, MGPU__MIN(s->k, (task + 1) * s->chunk), 1);
}

static mgpu_result mgpu__cpu_gemm_split_k(mgpu_device* dev, const mgpu__gemm* g, int64_t k) {
    mgpu__gemm_split_job s;
    int64_t chunks, t, i, j;
    size_t size, cn = (size_t)(g->m * g->n + 15) / 16 * 16;
    s.g = *g;
    s.k = k;
    /* chunks of at least 2 KC blocks: 16 or more of them, for the threads to finish together */
    s.chunk = MGPU__MAX((int64_t)MGPU__GEMM_KC * 2, (k + MGPU__GEMM_SPLIT_CHUNKS - 1) / MGPU__GEMM_SPLIT_CHUNKS);
    s.chunk = (s.chunk + MGPU__GEMM_KC - 1) / MGPU__GEMM_KC * MGPU__GEMM_KC;
    chunks = (k + s.chunk - 1) / s.chunk;
    s.pack_floats = mgpu__gemm_pack_floats(g->m, g->n);
    s.space = (float*)mgpu__device_alloc(dev, sizeof(float) * (size_t)chunks * (cn + s.pack_floats), &size, "mgpu_matmul");
    if (!s.space) return mgpu_last_result();
    mgpu__parallel_for(chunks, mgpu__gemm_split_task, &s);
    for (t = 0; t < chunks; ++t) {   /* C (already scaled by beta) += each partial (alpha applied), in order */
        const float* p = s.space + (size_t)t * (cn + s.pack_floats);
        for (i = 0; i < g->m; ++i)
            for (j = 0; j < g->n; ++j) g->c[i * g->ldc + j] += p[i * g->n + j];
    }
    mgpu__device_release(dev, s.space, size);
    return MGPU_OK;
}

static mgpu_result mgpu__cpu_gemm(mgpu_device* dev, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                                  float* c, int64_t ldc) {
    mgpu__gemm g;
    int64_t i, j;
    size_t size;
    int threads;
#ifdef MGPU_CBLAS
    const int overwrite = 0;
#else   /* with beta 0 the product's first KC block stores into C, not onto a cleared C: one pass fewer */
    const int overwrite = beta == 0.0f && k > 0 && alpha != 0.0f && !(k >= MGPU__GEMM_SPLIT_MIN_K && m * n <= MGPU__GEMM_SPLIT_MAX_C);
#endif
    for (i = 0; i < m && !overwrite; ++i) {   /* C = beta * C first (beta 0 clears, NaNs included) */
        float* row = c + i * ldc;
        if (beta == 0.0f) memset(row, 0, (size_t)n * sizeof(float));
        else if (beta != 1.0f) for (j = 0; j < n; ++j) row[j] *= beta;
    }
    if (k == 0 || alpha == 0.0f || m == 0 || n == 0) return MGPU_OK;
#ifdef MGPU_CBLAS
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k,
                alpha, a, (int)lda, b, (int)ldb, 1.0f, c, (int)ldc);
    return MGPU_OK;   /* (the code below stays compiled, and unused) */
#endif
    memset(&g, 0, sizeof g);
    g.ta = ta; g.tb = tb; g.m = m; g.n = n; g.lda = lda; g.ldb = ldb; g.ldc = ldc;
    g.alpha = alpha; g.a = a; g.b = b; g.c = c;
    g.overwrite = overwrite;
    g.pack_a = n > 4 * MGPU__GEMM_NR;   /* A's rows are used by fewer than 5 slivers of B: read them in place */
    g.pack_b = 1;
    if (k >= MGPU__GEMM_SPLIT_MIN_K && m * n <= MGPU__GEMM_SPLIT_MAX_C) return mgpu__cpu_gemm_split_k(dev, &g, k);
    /* a small product is over before the pool's threads would have woken up */
    threads = m * n * k < ((int64_t)1 << 18) ? 1 : mgpu_cpu_threads();
    if (m <= MGPU__GEMM_SMALL_M && threads > 1) {
        mgpu__gemm_small_job job;
        const int64_t row_slivers = (m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR, col_slivers = (n + MGPU__GEMM_NR - 1) / MGPU__GEMM_NR;
        job.g = &g;
        job.k = k;
        /* each task packs all of the operand along the side it does not cut: cut the longer side of
           C, so the shorter one is packed again (and both sides only when there are slivers for all) */
        job.by_rows = col_slivers < threads ? 1 : row_slivers < threads ? 0 : m >= n;
        job.slivers = job.by_rows ? row_slivers : col_slivers;
        job.tasks = MGPU__MIN((int64_t)threads, job.slivers);
        job.task_floats = job.by_rows ? mgpu__gemm_pack_floats((job.slivers + job.tasks - 1) / job.tasks * MGPU__GEMM_MR, n)
                                      : mgpu__gemm_pack_floats(m, (job.slivers + job.tasks - 1) / job.tasks * MGPU__GEMM_NR);
        job.space = (float*)mgpu__device_alloc(dev, sizeof(float) * job.task_floats * (size_t)job.tasks, &size, "mgpu_matmul");
        if (!job.space) return mgpu_last_result();
        mgpu__parallel_for(job.tasks, mgpu__gemm_small_task, &job);
        mgpu__device_release(dev, job.space, size);
        return MGPU_OK;
    }
    /* The packing space comes from the caching allocator on every call (a cache hit after the
       first): nothing shared to race on when several threads multiply on one device. */
    g.ap = (float*)mgpu__device_alloc(dev, sizeof(float) * mgpu__gemm_pack_floats(m, n), &size, "mgpu_matmul");
    if (!g.ap) return mgpu_last_result();
    g.bp = g.ap + (size_t)((m + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR * MGPU__GEMM_KC);
    mgpu__gemm_run(&g, 0, k, threads);
    mgpu__device_release(dev, g.ap, size);
    return MGPU_OK;
}

/* BF16 operands on the CPU: widened to f32 (exactly) in blocks of the device's cache, multiplied
   as f32 tensors are, a BF16 out rounded once from the f32 result: the rounding points of
   cuBLAS's bf16 GEMM (exact products, fp32 sums, one rounding of C). */
static mgpu_result mgpu__cpu_gemm_bf16(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b, int ta, int tb,
                                       int64_t m, int64_t n, int64_t k, float alpha, float beta) {
    mgpu_device* dev = MGPU__DEV(out);
    const int64_t na = mgpu_tensor_numel(a), nb = mgpu_tensor_numel(b), nc = m * n;
    const int narrow = out->dtype == MGPU_BF16;
    size_t size;
    float *wa, *wb, *wc;
    int64_t i;
    mgpu_result r;
    wa = (float*)mgpu__device_alloc(dev, sizeof(float) * (size_t)(na + nb + (narrow ? nc : 0) + 1), &size, "mgpu_matmul");
    if (!wa) return mgpu_last_result();
    wb = wa + na;
    wc = narrow ? wb + nb : MGPU__F32(out);
    mgpu__bf16_widen(mgpu_tensor_data(a), wa, na);
    mgpu__bf16_widen(mgpu_tensor_data(b), wb, nb);
    if (narrow && beta != 0.0f) mgpu__bf16_widen(mgpu_tensor_data(out), wc, nc);
    r = mgpu__cpu_gemm(dev, ta, tb, m, n, k, alpha, wa, a->shape.dim[1], wb, b->shape.dim[1], beta, wc, n);
    for (i = 0; r == MGPU_OK && narrow && i < nc; ++i) ((uint16_t*)mgpu_tensor_data(out))[i] = mgpu__float_to_bf16(wc[i]);
    mgpu__device_release(dev, wa, size);
    return r;
}

MGPUDEF mgpu_result mgpu_matmul(mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b,
                                mgpu_transpose transpose_a, mgpu_transpose transpose_b, float alpha, float beta) {
    static const char* op = "mgpu_matmul";
    char ta[128], tb[128], tc[128];
    int64_t m, n, k, kb;
    MGPU__TRY(mgpu__check_tensor(op, "a", a, a && a->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32));
    MGPU__TRY(mgpu__check_tensor(op, "b", b, a->dtype));   /* F32 with F32, BF16 with BF16 */
    MGPU__TRY(mgpu__check_tensor(op, "out", out, out && out->dtype == MGPU_BF16 && a->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, "a", a, "b", b));
    MGPU__TRY(mgpu__check_same_device(op, "out", out, "a", a));
    MGPU__TRY(mgpu__check_rank(op, "a", a, 2));
    MGPU__TRY(mgpu__check_rank(op, "b", b, 2));
    MGPU__TRY(mgpu__check_rank(op, "out", out, 2));
    m = a->shape.dim[transpose_a ? 1 : 0];
    k = a->shape.dim[transpose_a ? 0 : 1];
    kb = b->shape.dim[transpose_b ? 1 : 0];
    n = b->shape.dim[transpose_b ? 0 : 1];
    if (k != kb || out->shape.dim[0] != m || out->shape.dim[1] != n)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH,
                          "%s: a %s%s @ b %s%s cannot give out %s (want inner dimensions equal and out [%lld,%lld])",
                          op, mgpu_tensor_describe(a, ta, sizeof ta), transpose_a ? " transposed" : "",
                          mgpu_tensor_describe(b, tb, sizeof tb), transpose_b ? " transposed" : "",
                          mgpu_tensor_describe(out, tc, sizeof tc), (long long)m, (long long)n);
    if (mgpu__overlap(out, a) || mgpu__overlap(out, b))   /* out is cleared/accumulated while a and b are read */
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: out %s shares memory with an input", op,
                          mgpu_tensor_describe(out, tc, sizeof tc));
    MGPU__WROTE(out);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (MGPU__IS_CPU(a) && a->dtype == MGPU_BF16) return mgpu__cpu_gemm_bf16(out, a, b, transpose_a, transpose_b, m, n, k, alpha, beta);
    if (MGPU__IS_CPU(a))   /* the panel is taken from the output's device: a CPU replica's own allocator */
        return mgpu__cpu_gemm(MGPU__DEV(out), transpose_a, transpose_b, m, n, k, alpha, MGPU__F32(a), a->shape.dim[1],
                              MGPU__F32(b), b->shape.dim[1], beta, MGPU__F32(out), n);
    if (m > 0x7fffffff || n > 0x7fffffff || k > 0x7fffffff)
        return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: dimensions above 2^31 are not supported by cuBLAS", op);
    MGPU__CU(op, MGPU__DEV(a), mgpu__cu_gemm(MGPU__DEV(a)->ordinal, MGPU__DEV(a)->blas, transpose_a, transpose_b,
                                             (int)m, (int)n, (int)k, alpha, (int)a->dtype, mgpu_tensor_data(a), (int)a->shape.dim[1],
                                             mgpu_tensor_data(b), (int)b->shape.dim[1], beta, (int)out->dtype,
                                             mgpu_tensor_data(out), (int)n));
    return MGPU_OK;
}

/* -- bias and reductions, all as [outer, channels, inner] -- */
/* out[c] = scale * sum over (o, i) of x[o, c, i] + (accumulate ? out[c] : 0) */
static void mgpu__cpu_channel_sum(int64_t outer, int64_t channels, int64_t inner, const float* x, float* out,
                                  float scale, int accumulate) {
    int64_t o, c, i;
    if (inner == 1) {   /* sum down the rows of a matrix, 256 columns at a time on the stack, vectorised */
        float sum[256];
        const int chain = accumulate && scale == 1.0f;   /* onto out itself, row by row: a sum cut into */
        int64_t c0, w;                                    /* several calls (micro-batches) gives these bits */
        for (c0 = 0; c0 < channels; c0 += w) {
            w = MGPU__MIN(channels - c0, (int64_t)256);
            for (c = 0; c < w; ++c) sum[c] = chain ? out[c0 + c] : 0.0f;
            for (o = 0; o < outer; ++o) for (c = 0; c < w; ++c) sum[c] += x[o * channels + c0 + c];
            for (c = 0; c < w; ++c) out[c0 + c] = chain ? sum[c] : sum[c] * scale + (accumulate ? out[c0 + c] : 0.0f);
        }
        return;
    }
    for (c = 0; c < channels; ++c) {
        double s = 0.0;
        for (o = 0; o < outer; ++o) {
            const float* p = x + (o * channels + c) * inner;
            for (i = 0; i < inner; ++i) s += p[i];
        }
        out[c] = (float)(s * scale) + (accumulate ? out[c] : 0.0f);
    }
}

/* x viewed as [outer, channels, inner] around dimension 1 (a 2-D x is [rows, cols, 1]). */
static void mgpu__channel_split(const mgpu_tensor* x, int64_t* outer, int64_t* channels, int64_t* inner) {
    int i;
    *outer = x->shape.dim[0];
    *channels = x->shape.dim[1];
    *inner = 1;
    for (i = 2; i < x->shape.ndim; ++i) *inner *= x->shape.dim[i];
}

/* x f32 or bf16, v f32 with one value per channel of x */
static mgpu_result mgpu__check_channels(const char* op, const char* vn, const mgpu_tensor* v, const char* xn, const mgpu_tensor* x) {
    char tv[128], tx[128];
    MGPU__TRY(mgpu__check_tensor(op, xn, x, x && x->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32));
    MGPU__TRY(mgpu__check_tensor(op, vn, v, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, vn, v, xn, x));
    if (x->shape.ndim < 2 || v->shape.ndim != 1 || v->shape.dim[0] != x->shape.dim[1])
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s must be 1-D with one entry per channel (dimension 1) of '%s' %s",
                          op, vn, mgpu_tensor_describe(v, tv, sizeof tv), xn, mgpu_tensor_describe(x, tx, sizeof tx));
    return MGPU_OK;
}

/* y = x + bias over the outer slices [o0, o1): a row of a Linear's output (inner 1) as one
   vectorised loop over the channels */
typedef struct mgpu__bias_job {
    int64_t channels, inner;
    const float *x, *bias;
    float* y;
    mgpu_dtype xt, yt;   /* either bf16: x and y through xv and yv, element by element */
    const void* xv;
    void* yv;
} mgpu__bias_job;
static void mgpu__bias_range(void* ctx, int64_t o0, int64_t o1) {
    const mgpu__bias_job* j = (const mgpu__bias_job*)ctx;
    int64_t o, c, i;
    if (j->xt != MGPU_F32 || j->yt != MGPU_F32) {   /* in float, rounded once into y */
        int64_t at = o0 * j->channels * j->inner;
        for (o = o0; o < o1; ++o)
            for (c = 0; c < j->channels; ++c)
                for (i = 0; i < j->inner; ++i, ++at)
                    mgpu__store_float(j->yt, j->yv, at, mgpu__load_as_float(j->xt, j->xv, at) + j->bias[c]);
        return;
    }
    for (o = o0; o < o1; ++o) {
        const float* px = j->x + o * j->channels * j->inner;
        float* py = j->y + o * j->channels * j->inner;
        if (j->inner == 1)
            for (c = 0; c < j->channels; ++c) py[c] = px[c] + j->bias[c];
        else
            for (c = 0; c < j->channels; ++c)
                for (i = 0; i < j->inner; ++i) py[c * j->inner + i] = px[c * j->inner + i] + j->bias[c];
    }
}

MGPUDEF mgpu_result mgpu_bias_add(mgpu_tensor* out, const mgpu_tensor* x, const mgpu_tensor* bias) {
    static const char* op = "mgpu_bias_add";
    int64_t outer, channels, inner;
    char tc[128];
    MGPU__TRY(mgpu__check_channels(op, "bias", bias, "x", x));
    MGPU__TRY(mgpu__check_as(op, "out", out, out && out->dtype == MGPU_BF16 ? MGPU_BF16 : MGPU_F32, "x", x));
    if (out->dtype != x->dtype && mgpu__overlap(out, x))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: out %s shares memory with x of another dtype", op,
                          mgpu_tensor_describe(out, tc, sizeof tc));
    mgpu__channel_split(x, &outer, &channels, &inner);
    MGPU__WROTE(out);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_bias_add(MGPU__CUDA_ARGS(MGPU__DEV(x)), outer, channels, inner, (int)x->dtype,
                                                     mgpu_tensor_data(x), MGPU__F32(bias), (int)out->dtype, mgpu_tensor_data(out)));
        return MGPU_OK;
    }
    {
        mgpu__bias_job j;
        j.channels = channels; j.inner = inner; j.bias = MGPU__F32(bias);
        j.xt = x->dtype; j.yt = out->dtype; j.xv = mgpu_tensor_data(x); j.yv = mgpu_tensor_data(out);
        j.x = (const float*)j.xv; j.y = (float*)j.yv;   /* (read as such only when both are f32) */
        mgpu__parallel_range(outer, MGPU__MAX((int64_t)1, MGPU__EW_MIN_PER_THREAD / MGPU__MAX((int64_t)1, channels * inner)),
                             mgpu__bias_range, &j);
    }
    return MGPU_OK;
}

/* x f32, or bf16 (on the CPU widened first, exactly, into a block of the device's cache) */
static mgpu_result mgpu__channel_sum(const char* op, mgpu_tensor* out, const mgpu_tensor* x, int64_t outer,
                                     int64_t channels, int64_t inner, float scale, int accumulate) {
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_channel_sum(MGPU__CUDA_ARGS(MGPU__DEV(x)), outer, channels, inner, (int)x->dtype,
                                                        mgpu_tensor_data(x), MGPU__F32(out), scale, accumulate));
        return MGPU_OK;
    }
    if (x->dtype == MGPU_BF16) {
        const int64_t n = mgpu_tensor_numel(x);
        size_t size;
        float* wide = (float*)mgpu__device_alloc(MGPU__DEV(x), sizeof(float) * (size_t)MGPU__MAX(n, 1), &size, op);
        if (!wide) return mgpu_last_result();
        mgpu__bf16_widen(mgpu_tensor_data(x), wide, n);
        mgpu__cpu_channel_sum(outer, channels, inner, wide, MGPU__F32(out), scale, accumulate);
        mgpu__device_release(MGPU__DEV(x), wide, size);
        return MGPU_OK;
    }
    mgpu__cpu_channel_sum(outer, channels, inner, MGPU__F32(x), MGPU__F32(out), scale, accumulate);
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_bias_backward(mgpu_tensor* dbias, const mgpu_tensor* dy) {
    int64_t outer, channels, inner;
    MGPU__TRY(mgpu__check_channels("mgpu_bias_backward", "dbias", dbias, "dy", dy));
    mgpu__channel_split(dy, &outer, &channels, &inner);
    return mgpu__channel_sum("mgpu_bias_backward", dbias, dy, outer, channels, inner, 1.0f, 0);
}

static mgpu_result mgpu__sum_axis(const char* op, mgpu_tensor* out, const mgpu_tensor* x, int axis, int mean) {
    char tx[128], to[128];
    int64_t rows, cols;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__check_tensor(op, "out", out, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, "out", out, "x", x));
    MGPU__TRY(mgpu__check_rank(op, "x", x, 2));
    if (axis != 0 && axis != 1) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: axis %d (want 0 or 1)", op, axis);
    rows = x->shape.dim[0];
    cols = x->shape.dim[1];
    if (mgpu_tensor_numel(out) != (axis == 0 ? cols : rows))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: out %s cannot hold the axis-%d result of x %s", op,
                          mgpu_tensor_describe(out, to, sizeof to), axis, mgpu_tensor_describe(x, tx, sizeof tx));
    MGPU__WROTE(out);
    if (axis == 0) return mgpu__channel_sum(op, out, x, rows, cols, 1, mean && rows ? 1.0f / (float)rows : 1.0f, 0);
    return mgpu__channel_sum(op, out, x, 1, rows, cols, mean && cols ? 1.0f / (float)cols : 1.0f, 0);
}
MGPUDEF mgpu_result mgpu_sum(mgpu_tensor* out, const mgpu_tensor* x, int axis) { return mgpu__sum_axis("mgpu_sum", out, x, axis, 0); }
MGPUDEF mgpu_result mgpu_mean(mgpu_tensor* out, const mgpu_tensor* x, int axis) { return mgpu__sum_axis("mgpu_mean", out, x, axis, 1); }

/* -- softmax and losses -- */
/* The row kernels (softmax, cross-entropy, argmax) count rows and columns in int. */
static mgpu_result mgpu__check_rows_fit_int(const char* op, const char* name, const mgpu_tensor* x) {
    char tx[128];
    if (x->shape.dim[0] <= 0x7fffffff && x->shape.dim[1] <= 0x7fffffff) return MGPU_OK;
    return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: %s %s has more than 2^31 - 1 rows or columns, more than the CUDA kernel "
                      "takes", op, name, mgpu_tensor_describe(x, tx, sizeof tx));
}

MGPUDEF mgpu_result mgpu_softmax(mgpu_tensor* out, const mgpu_tensor* x) {
    static const char* op = "mgpu_softmax";
    int64_t rows, cols, r, c;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__check_rank(op, "x", x, 2));
    MGPU__TRY(mgpu__check_like(op, "out", out, "x", x));
    rows = x->shape.dim[0];
    cols = x->shape.dim[1];
    MGPU__WROTE(out);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__TRY(mgpu__check_rows_fit_int(op, "x", x));
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_softmax(MGPU__CUDA_ARGS(MGPU__DEV(x)), (int)rows, (int)cols, MGPU__F32(x), MGPU__F32(out)));
        return MGPU_OK;
    }
    for (r = 0; r < rows && cols > 0; ++r) {
        const float* px = MGPU__F32(x) + r * cols;
        float* py = MGPU__F32(out) + r * cols;
        float mx = px[0];
        double s = 0.0;
        for (c = 1; c < cols; ++c) mx = px[c] > mx ? px[c] : mx;
        for (c = 0; c < cols; ++c) s += exp((double)px[c] - mx);
        for (c = 0; c < cols; ++c) py[c] = (float)(exp((double)px[c] - mx) / s);
    }
    return MGPU_OK;
}

static mgpu_result mgpu__check_loss_tensor(const char* op, const mgpu_tensor* loss, const mgpu_tensor* ref) {
    char text[128];
    MGPU__TRY(mgpu__check_tensor(op, "loss", loss, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, "loss", loss, "logits", ref));
    if (mgpu_tensor_numel(loss) != 1)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: 'loss' %s must have exactly one element", op,
                          mgpu_tensor_describe(loss, text, sizeof text));
    return MGPU_OK;
}

/* Rows [r0, r1) of the CPU's cross-entropy: each row's loss, log-sum-exp in double, and its
   gradient row (zero for an ignored label) */
typedef struct mgpu__xent_job {
    int64_t cols;
    const float* logits;
    const int32_t* labels;
    float* dlogits;
    float grad_scale;
    double* row_loss;
} mgpu__xent_job;
static void mgpu__xent_range(void* ctx, int64_t r0, int64_t r1) {
    const mgpu__xent_job* j = (const mgpu__xent_job*)ctx;
    const int64_t cols = j->cols;
    int64_t r, c;
    for (r = r0; r < r1; ++r) {
        const float* px = j->logits + r * cols;
        const int32_t label = j->labels[r];
        float mx = px[0];
        double s = 0.0, lse;
        if (label == MGPU_IGNORE_INDEX) {
            if (j->dlogits) memset(j->dlogits + r * cols, 0, (size_t)cols * sizeof(float));
            continue;
        }
        for (c = 1; c < cols; ++c) mx = px[c] > mx ? px[c] : mx;
        for (c = 0; c < cols; ++c) s += exp((double)px[c] - mx);
        lse = mx + log(s);
        j->row_loss[r] = lse - px[label];
        if (j->dlogits) {
            float* pd = j->dlogits + r * cols;
            for (c = 0; c < cols; ++c) pd[c] = (float)((exp((double)px[c] - lse) - (c == label)) * j->grad_scale);
        }
    }
}

/* mgpu_softmax_cross_entropy, whose grad_scale 0 means mean_factor over the labels not ignored
   (the public op's 1; a model's step whose labels are on a GPU weighs its parts so, >>train) */
static mgpu_result mgpu__softmax_xent(mgpu_tensor* loss, mgpu_tensor* dlogits, const mgpu_tensor* logits,
                                      const mgpu_tensor* labels, float grad_scale, float mean_factor) {
    static const char* op = "mgpu_softmax_cross_entropy";
    char tl[128], tx[128];
    int64_t rows, cols, r;
    MGPU__TRY(mgpu__check_tensor(op, "logits", logits, MGPU_F32));
    MGPU__TRY(mgpu__check_rank(op, "logits", logits, 2));
    MGPU__TRY(mgpu__check_tensor(op, "labels", labels, MGPU_I32));
    MGPU__TRY(mgpu__check_same_device(op, "labels", labels, "logits", logits));
    MGPU__TRY(mgpu__check_loss_tensor(op, loss, logits));
    if (dlogits) MGPU__TRY(mgpu__check_like(op, "dlogits", dlogits, "logits", logits));
    rows = logits->shape.dim[0];
    cols = logits->shape.dim[1];
    if (labels->shape.ndim != 1 || labels->shape.dim[0] != rows)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: labels %s must be [%lld], one per row of logits %s", op,
                          mgpu_tensor_describe(labels, tl, sizeof tl), (long long)rows,
                          mgpu_tensor_describe(logits, tx, sizeof tx));
    if (rows == 0 || cols == 0)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: logits %s is empty", op, mgpu_tensor_describe(logits, tx, sizeof tx));
    MGPU__COUNT(MGPU__DEV(loss), ops, 1);
    if (!MGPU__IS_CPU(logits)) {   /* grad_scale 0: the kernels count the targets on the device */
        mgpu__scratch s;
        int rc;
        MGPU__TRY(mgpu__check_rows_fit_int(op, "logits", logits));
        MGPU__TRY(mgpu__scratch_get(&s, MGPU__DEV(logits), (size_t)(rows + 1) * sizeof(float), op));
        rc = MGPU__CUDA(mgpu__cu_softmax_xent(MGPU__CUDA_ARGS(MGPU__DEV(logits)), (int)rows, (int)cols, MGPU__F32(logits),
                                              MGPU__I32(labels), MGPU__F32(loss), dlogits ? MGPU__F32(dlogits) : NULL,
                                              grad_scale, mean_factor, (float*)s.ptr));
        mgpu__scratch_put(&s);
        if (rc) return mgpu__cu_result(rc, op, MGPU__DEV(logits));
        return MGPU_OK;
    }
    {
        int64_t targets = 0;
        for (r = 0; r < rows; ++r) {   /* every label first: a failed call writes nothing */
            if (MGPU__I32(labels)[r] == MGPU_IGNORE_INDEX) continue;
            if (MGPU__I32(labels)[r] < 0 || MGPU__I32(labels)[r] >= cols)
                return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: label %d of row %lld is outside [0, %lld) (and not "
                                  "MGPU_IGNORE_INDEX)", op, (int)MGPU__I32(labels)[r], (long long)r, (long long)cols);
            targets++;
        }
        if (grad_scale == 0.0f) grad_scale = targets ? mean_factor / (float)targets : 0.0f;
        if (!targets) {
            MGPU__F32(loss)[0] = 0.0f;
            return dlogits ? mgpu_tensor_zero(dlogits) : MGPU_OK;
        }
    }
    {   /* the rows shared out over the threads, each row's loss kept apart and summed in order */
        mgpu__xent_job j;
        double total = 0.0;
        int64_t targets = 0;
        mgpu__scratch scratch;
        MGPU__TRY(mgpu__scratch_get(&scratch, MGPU__DEV(logits), (size_t)rows * sizeof(double), op));
        j.cols = cols; j.logits = MGPU__F32(logits); j.labels = MGPU__I32(labels);
        j.dlogits = dlogits ? MGPU__F32(dlogits) : NULL; j.grad_scale = grad_scale;
        j.row_loss = (double*)scratch.ptr;
        mgpu__parallel_range(rows, MGPU__MAX((int64_t)1, MGPU__EW_MIN_PER_THREAD / cols), mgpu__xent_range, &j);
        for (r = 0; r < rows; ++r)
            if (MGPU__I32(labels)[r] != MGPU_IGNORE_INDEX) { total += j.row_loss[r]; targets++; }
        mgpu__scratch_put(&scratch);
        MGPU__F32(loss)[0] = (float)(total / (double)targets);
    }
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_softmax_cross_entropy(mgpu_tensor* loss, mgpu_tensor* dlogits, const mgpu_tensor* logits,
                                               const mgpu_tensor* labels, float grad_scale) {
    if (loss) MGPU__WROTE(loss);
    if (dlogits) MGPU__WROTE(dlogits);
    return mgpu__softmax_xent(loss, dlogits, logits, labels, grad_scale, 1.0f);
}

MGPUDEF mgpu_result mgpu_mse(mgpu_tensor* loss, mgpu_tensor* dpred, const mgpu_tensor* pred,
                             const mgpu_tensor* target, float grad_scale) {
    static const char* op = "mgpu_mse";
    int64_t n, i;
    if (loss) MGPU__WROTE(loss);
    if (dpred) MGPU__WROTE(dpred);
    MGPU__TRY(mgpu__check_tensor(op, "pred", pred, MGPU_F32));
    MGPU__TRY(mgpu__check_like(op, "target", target, "pred", pred));
    MGPU__TRY(mgpu__check_loss_tensor(op, loss, pred));
    if (dpred) MGPU__TRY(mgpu__check_like(op, "dpred", dpred, "pred", pred));
    n = mgpu_tensor_numel(pred);
    if (n == 0) return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: 'pred' is empty", op);
    if (grad_scale == 0.0f) grad_scale = 1.0f / (float)n;
    MGPU__COUNT(MGPU__DEV(loss), ops, 1);
    if (!MGPU__IS_CPU(pred)) {
        mgpu__scratch s;
        int rc;
        MGPU__TRY(mgpu__scratch_get(&s, MGPU__DEV(pred), MGPU__CU_REDUCE_SCRATCH * sizeof(float), op));
        rc = MGPU__CUDA(mgpu__cu_mse(MGPU__CUDA_ARGS(MGPU__DEV(pred)), (size_t)n, MGPU__F32(pred), MGPU__F32(target),
                                     MGPU__F32(loss), dpred ? MGPU__F32(dpred) : NULL, grad_scale, (float*)s.ptr));
        mgpu__scratch_put(&s);
        if (rc) return mgpu__cu_result(rc, op, MGPU__DEV(pred));
        return MGPU_OK;
    }
    {
        const float *p = MGPU__F32(pred), *t = MGPU__F32(target);
        double total = 0.0;
        for (i = 0; i < n; ++i) {
            float d = p[i] - t[i];
            total += (double)d * d;
            if (dpred) MGPU__F32(dpred)[i] = 2.0f * d * grad_scale;
        }
        MGPU__F32(loss)[0] = (float)(total / (double)n);
    }
    return MGPU_OK;
}

/* -- argmax and accuracy -- */
static int64_t mgpu__row_argmax(const float* row, int64_t cols) {
    int64_t best = 0, c;
    for (c = 1; c < cols; ++c) if (mgpu__argmax_takes(row[c], row[best])) best = c;
    return best;
}

MGPUDEF mgpu_result mgpu_argmax(mgpu_tensor* out, const mgpu_tensor* x) {
    static const char* op = "mgpu_argmax";
    char to[128], tx[128];
    int64_t rows, cols, r;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__check_rank(op, "x", x, 2));
    MGPU__TRY(mgpu__check_tensor(op, "out", out, MGPU_I32));
    MGPU__TRY(mgpu__check_same_device(op, "out", out, "x", x));
    MGPU__WROTE(out);
    rows = x->shape.dim[0];
    cols = x->shape.dim[1];
    if (out->shape.ndim != 1 || out->shape.dim[0] != rows || cols == 0)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: out %s must be [%lld] for x %s (with at least one column)", op,
                          mgpu_tensor_describe(out, to, sizeof to), (long long)rows, mgpu_tensor_describe(x, tx, sizeof tx));
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__TRY(mgpu__check_rows_fit_int(op, "x", x));
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_argmax(MGPU__CUDA_ARGS(MGPU__DEV(x)), (int)rows, (int)cols, MGPU__F32(x), MGPU__I32(out)));
        return MGPU_OK;
    }
    for (r = 0; r < rows; ++r) MGPU__I32(out)[r] = (int32_t)mgpu__row_argmax(MGPU__F32(x) + r * cols, cols);
    return MGPU_OK;
}

/* GPU: the count of rows whose largest logit is at their label, into *count (an int32 on the
   logits' device), queued on its stream: nothing waits. Shapes checked by the caller. */
static mgpu_result mgpu__count_correct_queued(const char* op, const mgpu_tensor* logits, const mgpu_tensor* labels, int32_t* count) {
    mgpu_device* dev = MGPU__DEV(logits);
    MGPU__COUNT(dev, ops, 1);
    mgpu__scratch s;
    int rc;
    MGPU__TRY(mgpu__check_rows_fit_int(op, "logits", logits));
    MGPU__TRY(mgpu__scratch_get(&s, dev, MGPU__CU_REDUCE_SCRATCH * sizeof(float), op));
    rc = MGPU__CUDA(mgpu__cu_count_correct(MGPU__CUDA_ARGS(dev), (int)logits->shape.dim[0], (int)logits->shape.dim[1],
                                           MGPU__F32(logits), MGPU__I32(labels), count, (float*)s.ptr));
    mgpu__scratch_put(&s);
    return rc ? mgpu__cu_result(rc, op, dev) : MGPU_OK;
}

MGPUDEF mgpu_result mgpu_count_correct(const mgpu_tensor* logits, const mgpu_tensor* labels, int64_t* count) {
    static const char* op = "mgpu_count_correct";
    char tl[128], tx[128];
    int64_t rows, cols, r, n = 0;
    if (!count) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: 'count' is NULL", op);
    *count = 0;
    MGPU__TRY(mgpu__check_tensor(op, "logits", logits, MGPU_F32));
    MGPU__TRY(mgpu__check_rank(op, "logits", logits, 2));
    MGPU__TRY(mgpu__check_tensor(op, "labels", labels, MGPU_I32));
    MGPU__TRY(mgpu__check_same_device(op, "labels", labels, "logits", logits));
    rows = logits->shape.dim[0];
    cols = logits->shape.dim[1];
    if (labels->shape.ndim != 1 || labels->shape.dim[0] != rows || cols == 0)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: labels %s must be [%lld] for logits %s", op,
                          mgpu_tensor_describe(labels, tl, sizeof tl), (long long)rows,
                          mgpu_tensor_describe(logits, tx, sizeof tx));
    if (!MGPU__IS_CPU(logits)) {
        mgpu__scratch s;
        int32_t host_count = 0;
        mgpu_device* dev = MGPU__DEV(logits);
        mgpu_result res;
        MGPU__TRY(mgpu__scratch_get(&s, dev, sizeof(int32_t), op));
        res = mgpu__count_correct_queued(op, logits, labels, (int32_t*)s.ptr);
        if (res == MGPU_OK) {
            int rc = MGPU__CUDA(mgpu__cu_memcpy(dev->ordinal, &host_count, s.ptr, sizeof host_count, dev->stream));
            if (!rc) rc = MGPU__CUDA(mgpu__cu_stream_synchronize(dev->ordinal, dev->stream));
            if (rc) res = mgpu__cu_result(rc, op, dev);
        }
        mgpu__scratch_put(&s);
        MGPU__TRY(res);
        *count = host_count;
        return MGPU_OK;
    }
    for (r = 0; r < rows; ++r)   /* a label no class has is an error, not a wrong guess */
        if (MGPU__I32(labels)[r] != MGPU_IGNORE_INDEX && (MGPU__I32(labels)[r] < 0 || MGPU__I32(labels)[r] >= cols))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: label %d of row %lld is outside [0, %lld)", op,
                              (int)MGPU__I32(labels)[r], (long long)r, (long long)cols);
    for (r = 0; r < rows; ++r) n += mgpu__row_argmax(MGPU__F32(logits) + r * cols, cols) == MGPU__I32(labels)[r];
    *count = n;
    return MGPU_OK;
}


/* -- dropout -- */
typedef struct mgpu__dropout_job { const float* x; float *y, *mask; uint64_t seed, offset, first; float p; } mgpu__dropout_job;
static void mgpu__dropout_range(void* ctx, int64_t begin, int64_t end) {
    mgpu__dropout_job* j = (mgpu__dropout_job*)ctx;
    int64_t i;
    for (i = begin; i < end; ++i) {
        float s = mgpu__dropout_scale(j->seed, j->offset, j->first + (uint64_t)i, j->p);
        j->mask[i] = s;
        j->y[i] = j->x[i] * s;
    }
}
/* Element i of x draws as element first + i of a larger tensor: a slice of a batch draws what the
   whole batch would have drawn for those elements. */
static mgpu_result mgpu__dropout(mgpu_tensor* out, mgpu_tensor* mask, const mgpu_tensor* x, float p, uint64_t seed,
                                 const uint64_t* seed_on_device, uint64_t offset, uint64_t first) {
    static const char* op = "mgpu_dropout";
    mgpu__dropout_job job;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__check_like(op, "out", out, "x", x));
    MGPU__TRY(mgpu__check_like(op, "mask", mask, "x", x));
    if (!(p >= 0.0f && p < 1.0f)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: p = %g, want 0 <= p < 1", op, (double)p);
    MGPU__WROTE(out);
    MGPU__WROTE(mask);
    MGPU__COUNT(MGPU__DEV(out), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_dropout(MGPU__CUDA_ARGS(MGPU__DEV(x)), (size_t)mgpu_tensor_numel(x), seed, seed_on_device, offset,
                                                    first, p, MGPU__F32(x), MGPU__F32(out), MGPU__F32(mask)));
        return MGPU_OK;
    }
    job.x = MGPU__F32(x); job.y = MGPU__F32(out); job.mask = MGPU__F32(mask);
    job.seed = seed; job.offset = offset; job.first = first; job.p = p;
    mgpu__parallel_range(mgpu_tensor_numel(x), MGPU__EW_MIN_PER_THREAD, mgpu__dropout_range, &job);
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_dropout(mgpu_tensor* out, mgpu_tensor* mask, const mgpu_tensor* x, float p,
                                 uint64_t seed, uint64_t offset) {
    return mgpu__dropout(out, mask, x, p, seed, NULL, offset, 0);
}

/* -- internal ops of the convolution and pooling layers (the layer checks the shapes) -- */
/* On the CPU each image (or channel plane) is independent work for one thread: the results do
   not depend on the thread count. */
typedef struct mgpu__window_job {
    const mgpu__window* g;
    const float* in;
    float* out;
    const int32_t* index_in;
    int32_t* index_out;
    int64_t rows, cols;   /* the transpose */
} mgpu__window_job;

/* x [n, c, h, w] -> cols [n*oh*ow, c*kh*kw] */
/* 1 when the window at (iy0, ix0) lies wholly inside the image (no padding in it) */
static int mgpu__window_inside(const mgpu__window* g, int64_t iy0, int64_t ix0) {
    return iy0 >= 0 && ix0 >= 0 && iy0 + g->kh <= g->h && ix0 + g->kw <= g->w;
}

static void mgpu__im2col_range(void* ctx, int64_t n0, int64_t n1) {
    const mgpu__window_job* j = (const mgpu__window_job*)ctx;
    const mgpu__window* g = j->g;
    const int64_t ckk = (int64_t)g->c * g->kh * g->kw;
    int64_t n, c, oy, ox, ky, kx;
    for (n = n0; n < n1; ++n) {
        float* out = j->out + n * g->oh * g->ow * ckk;
        for (oy = 0; oy < g->oh; ++oy)
            for (ox = 0; ox < g->ow; ++ox) {
                const int64_t iy0 = oy * g->stride - g->pad, ix0 = ox * g->stride - g->pad;
                if (mgpu__window_inside(g, iy0, ix0)) {   /* most windows: no padding to test for */
                    for (c = 0; c < g->c; ++c) {
                        const float* src = j->in + (n * g->c + c) * g->h * g->w + iy0 * g->w + ix0;
                        for (ky = 0; ky < g->kh; ++ky, src += g->w)
                            for (kx = 0; kx < g->kw; ++kx) *out++ = src[kx];
                    }
                    continue;
                }
                for (c = 0; c < g->c; ++c) {
                    const float* plane = j->in + (n * g->c + c) * g->h * g->w;
                    for (ky = 0; ky < g->kh; ++ky) {
                        const int64_t iy = iy0 + ky;
                        for (kx = 0; kx < g->kw; ++kx) {
                            const int64_t ix = ix0 + kx;
                            *out++ = (iy >= 0 && iy < g->h && ix >= 0 && ix < g->w) ? plane[iy * g->w + ix] : 0.0f;
                        }
                    }
                }
            }
    }
}
static mgpu_result mgpu__im2col(const mgpu__window* g, const mgpu_tensor* x, mgpu_tensor* cols) {
    mgpu__window_job job;
    MGPU__COUNT(MGPU__DEV(cols), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU("Conv2d forward (im2col)", MGPU__DEV(x), mgpu__cu_im2col(MGPU__CUDA_ARGS(MGPU__DEV(x)), g, MGPU__F32(x), MGPU__F32(cols)));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.g = g; job.in = MGPU__F32(x); job.out = MGPU__F32(cols);
    mgpu__parallel_range(g->n, 1, mgpu__im2col_range, &job);
    return MGPU_OK;
}

/* the adjoint of im2col: dx (overwritten) sums every column entry that reads it */
static void mgpu__col2im_range(void* ctx, int64_t n0, int64_t n1) {
    const mgpu__window_job* j = (const mgpu__window_job*)ctx;
    const mgpu__window* g = j->g;
    const int64_t ckk = (int64_t)g->c * g->kh * g->kw;
    int64_t n, c, oy, ox, ky, kx;
    memset(j->out + n0 * g->c * g->h * g->w, 0, (size_t)((n1 - n0) * g->c * g->h * g->w) * sizeof(float));
    for (n = n0; n < n1; ++n) {
        const float* in = j->in + n * g->oh * g->ow * ckk;
        for (oy = 0; oy < g->oh; ++oy)
            for (ox = 0; ox < g->ow; ++ox) {
                const int64_t iy0 = oy * g->stride - g->pad, ix0 = ox * g->stride - g->pad;
                if (mgpu__window_inside(g, iy0, ix0)) {   /* the same sums in the same order, unchecked */
                    for (c = 0; c < g->c; ++c) {
                        float* dst = j->out + (n * g->c + c) * g->h * g->w + iy0 * g->w + ix0;
                        for (ky = 0; ky < g->kh; ++ky, dst += g->w)
                            for (kx = 0; kx < g->kw; ++kx) dst[kx] += *in++;
                    }
                    continue;
                }
                for (c = 0; c < g->c; ++c) {
                    float* plane = j->out + (n * g->c + c) * g->h * g->w;
                    for (ky = 0; ky < g->kh; ++ky) {
                        const int64_t iy = iy0 + ky;
                        for (kx = 0; kx < g->kw; ++kx, ++in) {
                            const int64_t ix = ix0 + kx;
                            if (iy >= 0 && iy < g->h && ix >= 0 && ix < g->w) plane[iy * g->w + ix] += *in;
                        }
                    }
                }
            }
    }
}
static mgpu_result mgpu__col2im(const mgpu__window* g, const mgpu_tensor* cols, mgpu_tensor* dx) {
    mgpu__window_job job;
    MGPU__COUNT(MGPU__DEV(dx), ops, 1);
    if (!MGPU__IS_CPU(dx)) {
        MGPU__CU("Conv2d backward (col2im)", MGPU__DEV(dx), mgpu__cu_col2im(MGPU__CUDA_ARGS(MGPU__DEV(dx)), g, MGPU__F32(cols), MGPU__F32(dx)));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.g = g; job.in = MGPU__F32(cols); job.out = MGPU__F32(dx);
    mgpu__parallel_range(g->n, 1, mgpu__col2im_range, &job);
    return MGPU_OK;
}

/* -- Conv2d on the CPU: image by image, with no transposes --
   One image's columns lie as [c*kh*kw, oh*ow]: row (c, ky, kx) holds what that tap of the
   kernel sees at every output position, a shifted copy of input rows. W [out, c*kh*kw] times
   them is the image's output [out, oh*ow], NCHW already; the rows are copied contiguously into
   a task's scratch, which stays in the L2 cache for the product that follows: making them again
   in backward is cheaper than writing every image's columns to memory and reading them back.
   (The GPU keeps the [n*oh*ow, c*kh*kw] layout of the whole batch and its transposes.) */

/* the output columns [lo, hi) at which tap kx falls inside the image's width */
static void mgpu__window_span(const mgpu__window* g, int kx, int64_t* lo, int64_t* hi) {
    const int64_t first = g->pad - kx, last = (int64_t)g->w - 1 + g->pad - kx;   /* ox * stride in [first, last] */
    *hi = last < 0 ? 0 : MGPU__MIN((int64_t)g->ow, last / g->stride + 1);
    *lo = MGPU__MIN(*hi, first > 0 ? (first + g->stride - 1) / g->stride : 0);
}

/* With stride 1 and the output as wide as the input (the usual "same" padding), a tap's row of
   columns is one shifted run of the input plane, positions [first, last), in which only the
   edge columns that wrap from one image row to the next do not belong; 0 when it is not so. */
static int mgpu__tap_run(const mgpu__window* g, int ky, int64_t lo, int64_t hi, int64_t* first, int64_t* last) {
    const int64_t oy_lo = MGPU__MAX((int64_t)0, (int64_t)g->pad - ky), oy_hi = MGPU__MIN((int64_t)g->oh, (int64_t)g->h + g->pad - ky);
    if (g->stride != 1 || g->ow != g->w || oy_lo >= oy_hi || lo >= hi) return 0;
    *first = oy_lo * g->ow + lo;
    *last = (oy_hi - 1) * g->ow + hi;
    return 1;
}

/* zeros where the run wrapped over edge columns: between its row segments [lo, hi) */
static void mgpu__tap_run_gaps(const mgpu__window* g, float* row, int64_t lo, int64_t hi, int64_t first, int64_t last) {
    int64_t q, i;
    for (q = first - lo + hi; q < last; q += g->ow)
        for (i = 0; i < g->ow - hi + lo; ++i) row[q + i] = 0.0f;
}

/* x [c, h, w] -> cols [c*kh*kw, oh*ow], zeros where a tap reads the padding. zeros_kept: cols
   holds the columns of an earlier image of this geometry, whose padding zeros are these too
   (only those around a run are skipped: the wrapped ones are overwritten by the run) */
static void mgpu__im2col_image(const mgpu__window* g, const float* x, float* cols, int zeros_kept) {
    const int64_t p = (int64_t)g->oh * g->ow;
    int64_t c, ky, kx, oy, ox, lo, hi, first, last;
    for (c = 0; c < g->c; ++c)
        for (ky = 0; ky < g->kh; ++ky)
            for (kx = 0; kx < g->kw; ++kx) {
                float* row = cols + ((c * g->kh + ky) * g->kw + kx) * p;
                mgpu__window_span(g, (int)kx, &lo, &hi);
                if (mgpu__tap_run(g, (int)ky, lo, hi, &first, &last)) {   /* one run of the plane, then the zeros */
                    if (!zeros_kept) memset(row, 0, sizeof(float) * (size_t)first);
                    memcpy(row + first, x + (c * g->h * g->w + first + (ky - g->pad) * g->w + kx - g->pad),
                           sizeof(float) * (size_t)(last - first));
                    mgpu__tap_run_gaps(g, row, lo, hi, first, last);
                    if (!zeros_kept) memset(row + last, 0, sizeof(float) * (size_t)(p - last));
                    continue;
                }
                for (oy = 0; oy < g->oh; ++oy) {
                    const int64_t iy = oy * g->stride - g->pad + ky;
                    float* dst = row + oy * g->ow;
                    const float* src;
                    if (iy < 0 || iy >= g->h) { memset(dst, 0, sizeof(float) * (size_t)g->ow); continue; }
                    src = x + (c * g->h + iy) * g->w;   /* column ox * stride - pad + kx, for ox in [lo, hi) */
                    for (ox = 0; ox < lo; ++ox) dst[ox] = 0.0f;
                    if (g->stride == 1) memcpy(dst + lo, src + lo - g->pad + kx, sizeof(float) * (size_t)(hi - lo));
                    else for (ox = lo; ox < hi; ++ox) dst[ox] = src[ox * g->stride - g->pad + kx];
                    for (ox = hi; ox < g->ow; ++ox) dst[ox] = 0.0f;
                }
            }
}

/* its adjoint: dx [c, h, w] (overwritten) sums every column entry that reads it, taps in order.
   dcols is scratch: a run's wrapped edge entries are zeroed in it, and the run added whole. */
static void mgpu__col2im_image(const mgpu__window* g, float* dcols, float* dx) {
    const int64_t p = (int64_t)g->oh * g->ow;
    int64_t c, ky, kx, oy, ox, lo, hi, first, last;
    memset(dx, 0, sizeof(float) * (size_t)g->c * (size_t)g->h * (size_t)g->w);
    for (c = 0; c < g->c; ++c)
        for (ky = 0; ky < g->kh; ++ky)
            for (kx = 0; kx < g->kw; ++kx) {
                float* row = dcols + ((c * g->kh + ky) * g->kw + kx) * p;
                mgpu__window_span(g, (int)kx, &lo, &hi);
                if (mgpu__tap_run(g, (int)ky, lo, hi, &first, &last)) {
                    float* dst = dx + c * g->h * g->w;
                    const int64_t shift = (ky - g->pad) * g->w + kx - g->pad;
                    int64_t q;
                    mgpu__tap_run_gaps(g, row, lo, hi, first, last);
                    for (q = first; q < last; ++q) dst[q + shift] += row[q];
                    continue;
                }
                for (oy = 0; oy < g->oh; ++oy) {
                    const int64_t iy = oy * g->stride - g->pad + ky;
                    const float* src = row + oy * g->ow;
                    float* dst;
                    if (iy < 0 || iy >= g->h) continue;
                    dst = dx + (c * g->h + iy) * g->w;
                    if (g->stride == 1) for (ox = lo; ox < hi; ++ox) dst[ox - g->pad + kx] += src[ox];
                    else for (ox = lo; ox < hi; ++ox) dst[ox * g->stride - g->pad + kx] += src[ox];
                }
            }
}

/* The weight and bias gradients sum over images: in fixed groups of images, each summed in
   order by one task, then the groups in order onto the gradient, so the bits do not depend on
   the thread count, nor on a batch cut into micro-batches of whole groups (8 images). */
#define MGPU__CONV_GROUP 8
typedef struct mgpu__conv_job {
    const mgpu__window* g;
    int64_t out, ckk, p, tasks, groups;
    const float *x, *w, *bias, *dy;
    float *y, *dx;
    float* dw_part;           /* [groups][ckk][out]: dW^T */
    double* db_part;          /* [groups][out] */
    float* space;             /* [tasks][space_floats]: each task's GEMM packing, then its image's */
    size_t space_floats;      /* columns and their gradient (cols_floats each) */
    size_t pack_floats, cols_floats;
    float* w_packed;          /* W (forward) or W^T (backward) packed once for every image, or NULL */
} mgpu__conv_job;

static void mgpu__conv_forward_task(void* ctx, int64_t task) {
    const mgpu__conv_job* j = (const mgpu__conv_job*)ctx;
    const int64_t n0 = j->g->n * task / j->tasks, n1 = j->g->n * (task + 1) / j->tasks;
    float* space = j->space + (size_t)task * j->space_floats;
    float* cols = space + j->pack_floats;
    int64_t n, o, i;
    for (n = n0; n < n1; ++n) {
        float* y = j->y + n * j->out * j->p;
        mgpu__im2col_image(j->g, j->x + n * (int64_t)j->g->c * j->g->h * j->g->w, cols, n > n0);
        for (o = 0; o < j->out; ++o) for (i = 0; i < j->p; ++i) y[o * j->p + i] = j->bias[o];   /* the GEMM adds onto it */
        mgpu__gemm_serial(0, 0, j->out, j->p, j->ckk, j->w, j->ckk, cols, j->p, y, j->p, space, 0, j->w_packed);
    }
}

static void mgpu__conv_backward_task(void* ctx, int64_t task) {
    const mgpu__conv_job* j = (const mgpu__conv_job*)ctx;
    float* space = j->space + (size_t)task * j->space_floats;
    float *cols = space + j->pack_floats, *dcols = cols + j->cols_floats;
    const int64_t gi0 = j->groups * task / j->tasks;
    int64_t gi, n, o, i;
    for (gi = gi0; gi < j->groups * (task + 1) / j->tasks; ++gi) {
        float* dw = j->dw_part + gi * j->out * j->ckk;
        double* db = j->db_part + gi * j->out;
        memset(dw, 0, sizeof(float) * (size_t)(j->out * j->ckk));
        for (o = 0; o < j->out; ++o) db[o] = 0.0;
        for (n = gi * MGPU__CONV_GROUP; n < MGPU__MIN((int64_t)j->g->n, (gi + 1) * MGPU__CONV_GROUP); ++n) {
            const float* dy = j->dy + n * j->out * j->p;
            mgpu__im2col_image(j->g, j->x + n * (int64_t)j->g->c * j->g->h * j->g->w, cols,   /* again: cheaper than */
                               n > gi0 * MGPU__CONV_GROUP);                                      /* from memory */
            /* dW^T += cols dy^T: the columns read where they lie, only dy packed (transposed) */
            mgpu__gemm_serial(0, 1, j->ckk, j->out, j->p, cols, j->p, dy, j->p, dw, j->out, space, 0, NULL);
            for (o = 0; o < j->out; ++o) {   /* four running sums, vectorisable, in a fixed order */
                double s[4] = {0.0, 0.0, 0.0, 0.0};
                const float* row = dy + o * j->p;
                for (i = 0; i + 4 <= j->p; i += 4) { s[0] += row[i]; s[1] += row[i + 1]; s[2] += row[i + 2]; s[3] += row[i + 3]; }
                for (; i < j->p; ++i) s[0] += row[i];
                db[o] += (s[0] + s[1]) + (s[2] + s[3]);
            }
            if (j->dx) {   /* dcols = W^T dy, then back onto the image */
                mgpu__gemm_serial(1, 0, j->ckk, j->p, j->out, j->w, j->ckk, dy, j->p, dcols, j->p, space, 1, j->w_packed);
                mgpu__col2im_image(j->g, dcols, j->dx + n * (int64_t)j->g->c * j->g->h * j->g->w);
            }
        }
    }
}

/* The job's shapes, and its scratch from dev's caching allocator (released by the caller); W
   packed for the products (forward: W cols; backward: W^T dy) when their sum fits one KC block. */
static mgpu_result mgpu__conv_job_init(mgpu__conv_job* j, mgpu_device* dev, const mgpu__window* g, int64_t out,
                                       const float* w, int backward, size_t* size) {
    size_t part, wpack;
    int64_t wm, wk;
    memset(j, 0, sizeof *j);
    j->g = g;
    j->out = out;
    j->ckk = (int64_t)g->c * g->kh * g->kw;
    j->p = (int64_t)g->oh * g->ow;
    j->groups = (g->n + MGPU__CONV_GROUP - 1) / MGPU__CONV_GROUP;
    j->tasks = MGPU__MAX((int64_t)1, MGPU__MIN((int64_t)mgpu_cpu_threads(), backward ? j->groups : (int64_t)g->n));
    j->pack_floats = MGPU__MAX(mgpu__gemm_pack_floats(out, j->p), MGPU__MAX(mgpu__gemm_pack_floats(j->ckk, out),
                                                                            mgpu__gemm_pack_floats(j->ckk, j->p)));
    j->cols_floats = (size_t)(j->ckk * j->p + 15) / 16 * 16;   /* 64-byte multiples keep each part aligned */
    j->space_floats = j->pack_floats + (backward ? 2 : 1) * j->cols_floats;
    wm = backward ? j->ckk : out;
    wk = backward ? out : j->ckk;
    wpack = wk <= MGPU__GEMM_KC ? (size_t)((wm + MGPU__GEMM_MR - 1) / MGPU__GEMM_MR * MGPU__GEMM_MR * wk + 15) / 16 * 16 : 0;
    part = backward ? (size_t)j->groups * (size_t)(out * j->ckk + 2 * out) + 16 : 0;   /* +16: room to align the doubles */
    j->space = (float*)mgpu__device_alloc(dev, sizeof(float) * ((size_t)j->tasks * j->space_floats + wpack + part), size, "Conv2d");
    if (!j->space) return mgpu_last_result();
    j->w_packed = wpack ? j->space + (size_t)j->tasks * j->space_floats : NULL;
    if (wpack) mgpu__gemm_prepack_a(backward, wm, wk, w, j->ckk, j->w_packed);
    j->dw_part = j->space + (size_t)j->tasks * j->space_floats + wpack;
    j->db_part = (double*)(void*)(j->dw_part + ((size_t)j->groups * (size_t)(out * j->ckk) + 15) / 16 * 16);
    return MGPU_OK;
}

/* y [n, out, oh, ow] = W [out, c*kh*kw] (im2col x) + bias */
static mgpu_result mgpu__cpu_conv_forward(const mgpu__window* g, int64_t out, const mgpu_tensor* x, const mgpu_tensor* w,
                                          const mgpu_tensor* bias, mgpu_tensor* y) {
    mgpu__conv_job j;
    size_t size;
    MGPU__TRY(mgpu__conv_job_init(&j, MGPU__DEV(y), g, out, MGPU__F32(w), 0, &size));
    j.x = MGPU__F32(x); j.w = MGPU__F32(w); j.bias = MGPU__F32(bias); j.y = MGPU__F32(y);
    mgpu__parallel_for(j.tasks, mgpu__conv_forward_task, &j);
    mgpu__device_release(MGPU__DEV(y), j.space, size);
    return MGPU_OK;
}

/* dW += dy (im2col x)^T and dbias += the sums of dy over images and positions; dx (if wanted)
   from the columns' gradient W^T dy */
static mgpu_result mgpu__cpu_conv_backward(const mgpu__window* g, int64_t out, const mgpu_tensor* x, const mgpu_tensor* w,
                                           const mgpu_tensor* dy, mgpu_tensor* dw, mgpu_tensor* dbias, mgpu_tensor* dx) {
    mgpu__conv_job j;
    size_t size;
    int64_t gi, i, o, r;
    float* pdw = MGPU__F32(dw);
    float* pdb = MGPU__F32(dbias);
    MGPU__TRY(mgpu__conv_job_init(&j, MGPU__DEV(dy), g, out, MGPU__F32(w), 1, &size));
    j.x = MGPU__F32(x); j.w = MGPU__F32(w); j.dy = MGPU__F32(dy);
    j.dx = dx ? MGPU__F32(dx) : NULL;
    mgpu__parallel_for(j.tasks, mgpu__conv_backward_task, &j);
    for (gi = 0; gi < j.groups; ++gi) {   /* each group's sums onto the gradients, in order */
        for (o = 0; o < out; ++o)
            for (r = 0; r < j.ckk; ++r) pdw[o * j.ckk + r] += j.dw_part[(gi * j.ckk + r) * out + o];
        for (i = 0; i < out; ++i) pdb[i] += (float)j.db_part[gi * out + i];
    }
    mgpu__device_release(MGPU__DEV(dy), j.space, size);
    return MGPU_OK;
}

/* y[b][j][i] = x[b][i][j] for x [batch, rows, cols] */
static void mgpu__transpose_range(void* ctx, int64_t b0, int64_t b1) {
    const mgpu__window_job* j = (const mgpu__window_job*)ctx;
    int64_t b, r, c;
    for (b = b0; b < b1; ++b) {
        const float* px = j->in + b * j->rows * j->cols;
        float* py = j->out + b * j->rows * j->cols;
        int64_t r0, c0;
        for (r0 = 0; r0 < j->rows; r0 += 32)   /* in 32 x 32 blocks, so both sides stay in cache */
            for (c0 = 0; c0 < j->cols; c0 += 32)
                for (r = r0; r < MGPU__MIN(r0 + 32, j->rows); ++r)
                    for (c = c0; c < MGPU__MIN(c0 + 32, j->cols); ++c) py[c * j->rows + r] = px[r * j->cols + c];
    }
}
static mgpu_result mgpu__transpose(int64_t batch, int64_t rows, int64_t cols, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu__window_job job;
    MGPU__COUNT(MGPU__DEV(y), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU("transpose", MGPU__DEV(x), mgpu__cu_transpose(MGPU__CUDA_ARGS(MGPU__DEV(x)), batch, rows, cols, MGPU__F32(x), MGPU__F32(y)));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.in = MGPU__F32(x); job.out = MGPU__F32(y); job.rows = rows; job.cols = cols;
    mgpu__parallel_range(batch, 1, mgpu__transpose_range, &job);
    return MGPU_OK;
}

#ifdef MGPU__AVX2
/* 8 windows of the 2 x 2, stride 2 pool: u0 u1 and v0 v1 the 16 values of the two input rows
   from the first window's left edge, at0 that corner's index in the plane (w its width) */
static MGPU__AVX2_FN void mgpu__maxpool_2x2_8(__m256 u0, __m256 u1, __m256 v0, __m256 v1, int32_t at0, int32_t w, __m256* y, __m256i* at) {
    const __m256 k1 = _mm256_castsi256_ps(_mm256_set1_epi32(1)), kw = _mm256_castsi256_ps(_mm256_set1_epi32(w));
    const __m256 kw1 = _mm256_castsi256_ps(_mm256_set1_epi32(w + 1));
    /* even and odd columns, back in order */
    const __m256 a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(u0, u1, 0x88)), 0xD8));
    const __m256 b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(u0, u1, 0xDD)), 0xD8));
    const __m256 c = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0x88)), 0xD8));
    const __m256 d = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0xDD)), 0xD8));
    __m256 best = a, k = _mm256_setzero_ps(), gt;
    /* mgpu__pool_takes: greater, or NaN (unordered with itself); without a NaN among the 32 values
       (one test for all, almost always) greater alone, which is cheaper */
    const int nan = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    if (!nan) {
        gt = _mm256_cmp_ps(b, best, _CMP_GT_OQ); k = _mm256_blendv_ps(k, k1, gt); best = _mm256_blendv_ps(best, b, gt);
        gt = _mm256_cmp_ps(c, best, _CMP_GT_OQ); k = _mm256_blendv_ps(k, kw, gt); best = _mm256_blendv_ps(best, c, gt);
        gt = _mm256_cmp_ps(d, best, _CMP_GT_OQ); k = _mm256_blendv_ps(k, kw1, gt); best = _mm256_blendv_ps(best, d, gt);
    } else {
#define MGPU__POOL_TAKES8(v) _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q))
        gt = MGPU__POOL_TAKES8(b); k = _mm256_blendv_ps(k, k1, gt); best = _mm256_blendv_ps(best, b, gt);
        gt = MGPU__POOL_TAKES8(c); k = _mm256_blendv_ps(k, kw, gt); best = _mm256_blendv_ps(best, c, gt);
        gt = MGPU__POOL_TAKES8(d); k = _mm256_blendv_ps(k, kw1, gt); best = _mm256_blendv_ps(best, d, gt);
#undef MGPU__POOL_TAKES8
    }
    *y = best;
    *at = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(at0), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_castps_si256(k));
}
#endif

/* One output row of the common 2 x 2, stride 2 pool with no padding, without branches: the
   maxima of random activations mispredict half their comparisons, and selects vectorise. The
   same choice as the general loop: the first of equals, and a NaN wins (the last NaN, as PyTorch).
   With AVX2 (chosen at run time, as the GEMM's kernel) 8 windows at a time, the last few through
   masks so that short rows (7 wide) stay vectorised; no address past a row's end is formed. */
#ifdef MGPU__AVX2
static MGPU__AVX2_FN void mgpu__maxpool_2x2_row_avx2(const float* r0, const float* r1, int32_t at0, int32_t w, int64_t ow,
                                                     float* y, int32_t* at) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 best;
    __m256i arg;
    int64_t ox = 0;
    for (; ox + 8 <= ow; ox += 8) {
        mgpu__maxpool_2x2_8(_mm256_loadu_ps(r0 + 2 * ox), _mm256_loadu_ps(r0 + 2 * ox + 8), _mm256_loadu_ps(r1 + 2 * ox),
                            _mm256_loadu_ps(r1 + 2 * ox + 8), at0 + 2 * (int32_t)ox, w, &best, &arg);
        _mm256_storeu_ps(y + ox, best);
        _mm256_storeu_si256((__m256i*)(at + ox), arg);
    }
    if (ox < ow) {
        const int32_t n = (int32_t)(ow - ox);
        const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * n), lane);
        const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * n - 8), lane), mo = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
        const __m256 zero = _mm256_setzero_ps();
        mgpu__maxpool_2x2_8(_mm256_maskload_ps(r0 + 2 * ox, m0), n > 4 ? _mm256_maskload_ps(r0 + 2 * ox + 8, m1) : zero,
                            _mm256_maskload_ps(r1 + 2 * ox, m0), n > 4 ? _mm256_maskload_ps(r1 + 2 * ox + 8, m1) : zero,
                            at0 + 2 * (int32_t)ox, w, &best, &arg);
        _mm256_maskstore_ps(y + ox, mo, best);
        _mm256_maskstore_epi32(at + ox, mo, arg);
    }
}
#endif
static void mgpu__maxpool_2x2_row(const float* r0, const float* r1, int32_t at0, int32_t w, int64_t ow,
                                  float* y, int32_t* at) {
    int64_t ox;
#ifdef MGPU__AVX2
    if (MGPU__HAVE_AVX2()) {
        mgpu__maxpool_2x2_row_avx2(r0, r1, at0, w, ow, y, at);
        return;
    }
#endif
    for (ox = 0; ox < ow; ++ox) {
        const float a = r0[2 * ox], b = r0[2 * ox + 1], c = r1[2 * ox], d = r1[2 * ox + 1];
        float best = a;
        int32_t k = 0;
        int t;
        t = mgpu__pool_takes(b, best); k = t ? 1 : k;     best = t ? b : best;
        t = mgpu__pool_takes(c, best); k = t ? w : k;     best = t ? c : best;
        t = mgpu__pool_takes(d, best); k = t ? w + 1 : k; best = t ? d : best;
        y[ox] = best;
        at[ox] = at0 + 2 * (int32_t)ox + k;
    }
}

/* max over each window of each (image, channel) plane; padding counts as -inf */
static void mgpu__maxpool_range(void* ctx, int64_t p0, int64_t p1) {
    const mgpu__window_job* j = (const mgpu__window_job*)ctx;
    const mgpu__window* g = j->g;
    const int simple = g->kh == 2 && g->kw == 2 && g->stride == 2 && g->pad == 0;
    int64_t plane, oy, ox, ky, kx;
    for (plane = p0; plane < p1; ++plane) {
        const float* px = j->in + plane * g->h * g->w;
        float* py = j->out + plane * g->oh * g->ow;
        int32_t* pa = j->index_out + plane * g->oh * g->ow;
        for (oy = 0; simple && oy < g->oh; ++oy)
            mgpu__maxpool_2x2_row(px + 2 * oy * g->w, px + (2 * oy + 1) * g->w, (int32_t)(2 * oy * g->w), g->w, g->ow,
                                  py + oy * g->ow, pa + oy * g->ow);
        for (oy = 0; !simple && oy < g->oh; ++oy)
            for (ox = 0; ox < g->ow; ++ox) {
                const int64_t iy0 = oy * g->stride - g->pad, ix0 = ox * g->stride - g->pad;
                float best = -INFINITY;
                int32_t at = -1;
                if (mgpu__window_inside(g, iy0, ix0)) {   /* the same choice (first of equals), unchecked */
                    const float* src = px + iy0 * g->w + ix0;
                    at = (int32_t)(iy0 * g->w + ix0);
                    best = src[0];
                    if (g->kh == 2 && g->kw == 2) {   /* the common 2 x 2 pool, spelled out */
                        if (mgpu__pool_takes(src[1], best)) { best = src[1]; at = (int32_t)(iy0 * g->w + ix0 + 1); }
                        if (mgpu__pool_takes(src[g->w], best)) { best = src[g->w]; at = (int32_t)((iy0 + 1) * g->w + ix0); }
                        if (mgpu__pool_takes(src[g->w + 1], best)) { best = src[g->w + 1]; at = (int32_t)((iy0 + 1) * g->w + ix0 + 1); }
                    } else {
                        for (ky = 0; ky < g->kh; ++ky)
                            for (kx = 0; kx < g->kw; ++kx)
                                if (mgpu__pool_takes(src[ky * g->w + kx], best)) { best = src[ky * g->w + kx]; at = (int32_t)((iy0 + ky) * g->w + ix0 + kx); }
                    }
                    py[oy * g->ow + ox] = best;
                    pa[oy * g->ow + ox] = at;
                    continue;
                }
                for (ky = 0; ky < g->kh; ++ky)
                    for (kx = 0; kx < g->kw; ++kx) {
                        const int64_t iy = oy * g->stride - g->pad + ky, ix = ox * g->stride - g->pad + kx;
                        if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) continue;
                        if (at < 0 || mgpu__pool_takes(px[iy * g->w + ix], best)) { best = px[iy * g->w + ix]; at = (int32_t)(iy * g->w + ix); }
                    }
                py[oy * g->ow + ox] = best;
                pa[oy * g->ow + ox] = at;
            }
    }
}
static mgpu_result mgpu__maxpool(const mgpu__window* g, const mgpu_tensor* x, mgpu_tensor* y, mgpu_tensor* argmax) {
    mgpu__window_job job;
    MGPU__COUNT(MGPU__DEV(y), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU("MaxPool2d forward", MGPU__DEV(x), mgpu__cu_maxpool(MGPU__CUDA_ARGS(MGPU__DEV(x)), g, MGPU__F32(x), MGPU__F32(y), MGPU__I32(argmax)));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.g = g; job.in = MGPU__F32(x); job.out = MGPU__F32(y); job.index_out = MGPU__I32(argmax);
    mgpu__parallel_range((int64_t)g->n * g->c, 8, mgpu__maxpool_range, &job);
    return MGPU_OK;
}

static void mgpu__maxpool_backward_range(void* ctx, int64_t p0, int64_t p1) {
    const mgpu__window_job* j = (const mgpu__window_job*)ctx;
    const mgpu__window* g = j->g;
    int64_t plane, o;
    memset(j->out + p0 * g->h * g->w, 0, (size_t)((p1 - p0) * g->h * g->w) * sizeof(float));
    for (plane = p0; plane < p1; ++plane) {
        const float* pdy = j->in + plane * g->oh * g->ow;
        const int32_t* pa = j->index_in + plane * g->oh * g->ow;
        float* pdx = j->out + plane * g->h * g->w;
        for (o = 0; o < (int64_t)g->oh * g->ow; ++o) if (pa[o] >= 0) pdx[pa[o]] += pdy[o];
    }
}
static mgpu_result mgpu__maxpool_backward(const mgpu__window* g, const mgpu_tensor* dy, const mgpu_tensor* argmax, mgpu_tensor* dx) {
    mgpu__window_job job;
    MGPU__COUNT(MGPU__DEV(dx), ops, 1);
    if (!MGPU__IS_CPU(dy)) {
        MGPU__CU("MaxPool2d backward", MGPU__DEV(dy), mgpu__cu_maxpool_backward(MGPU__CUDA_ARGS(MGPU__DEV(dy)), g, MGPU__F32(dy), MGPU__I32(argmax), MGPU__F32(dx)));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.g = g; job.in = MGPU__F32(dy); job.out = MGPU__F32(dx); job.index_in = MGPU__I32(argmax);
    mgpu__parallel_range((int64_t)g->n * g->c, 8, mgpu__maxpool_backward_range, &job);
    return MGPU_OK;
}

/* -- BatchNorm2d and global average pooling over x [n, c, hw] (the layers check the shapes). The
   CPU: a task per channel, its sums in double (the float64 reference of the tests is a loop of
   the same formulas); each channel's work is its task's alone, so any thread count gives the same
   bits. mode is one of the seam's MGPU__BN_*: SyncBatchNorm's two halves (STATS, GIVEN) take the
   numbers the replicas exchange (>>parallel meet) in sync, host doubles [3c] (STATS writes the
   first 2c, GIVEN reads them all), staged on a GPU through sync_dev [3c] and the host floats
   stage [3c]. -- */
typedef struct mgpu__bn_job {
    int64_t n, c, hw;
    const float *x, *w, *b, *dy, *mean_in, *rstd_in;
    float *run_mean, *run_var, *count, *save_mean, *save_rstd, *y, *dw, *db, *dx;
    double* sync;
    int mode;
    float momentum, eps;
} mgpu__bn_job;
static void mgpu__bn_forward_task(void* ctx, int64_t ch) {
    const mgpu__bn_job* j = (const mgpu__bn_job*)ctx;
    const int64_t m = j->n * j->hw;
    double mean, rstd, unbiased = 0.0, s = 0.0, v = 0.0;
    int64_t o, i;
    float scale, shift;
    if (j->mode == MGPU__BN_TRAIN || j->mode == MGPU__BN_STATS) {
        for (o = 0; o < j->n; ++o)
            for (i = 0; i < j->hw; ++i) s += j->x[(o * j->c + ch) * j->hw + i];
        mean = s / (double)m;
        for (o = 0; o < j->n; ++o)
            for (i = 0; i < j->hw; ++i) {
                const double d = j->x[(o * j->c + ch) * j->hw + i] - mean;
                v += d * d;
            }
        if (j->mode == MGPU__BN_STATS) {
            j->sync[ch] = mean;
            j->sync[j->c + ch] = v;
            return;
        }
        v /= (double)m;
        rstd = 1.0 / sqrt(v + (double)j->eps);
        unbiased = v * (double)m / (double)(m - 1);
    } else if (j->mode == MGPU__BN_GIVEN) {
        mean = j->sync[ch];
        rstd = j->sync[j->c + ch];
        unbiased = j->sync[2 * j->c + ch];
    } else {
        mean = j->run_mean[ch];
        rstd = 1.0 / sqrt((double)j->run_var[ch] + (double)j->eps);
    }
    if (j->mode != MGPU__BN_EVAL) {
        j->run_mean[ch] = (1.0f - j->momentum) * j->run_mean[ch] + j->momentum * (float)mean;
        j->run_var[ch] = (1.0f - j->momentum) * j->run_var[ch] + j->momentum * (float)unbiased;
        j->save_mean[ch] = (float)mean;
        j->save_rstd[ch] = (float)rstd;
        if (ch == 0) j->count[0] += 1.0f;
    }
    scale = (float)(rstd * j->w[ch]);
    shift = (float)(j->b[ch] - mean * rstd * j->w[ch]);
    for (o = 0; o < j->n; ++o) {
        const float* px = j->x + (o * j->c + ch) * j->hw;
        float* py = j->y + (o * j->c + ch) * j->hw;
        for (i = 0; i < j->hw; ++i) py[i] = px[i] * scale + shift;
    }
}
static void mgpu__bn_backward_task(void* ctx, int64_t ch) {
    const mgpu__bn_job* j = (const mgpu__bn_job*)ctx;
    const int64_t m = j->n * j->hw;
    const double mean = j->mean_in[ch], rstd = j->rstd_in[ch];
    double s1 = 0.0, s2 = 0.0, k, a, bb;
    int64_t o, i;
    if (j->mode == MGPU__BN_GIVEN) {
        a = j->sync[ch];
        bb = j->sync[j->c + ch];
    } else {
        for (o = 0; o < j->n; ++o)
            for (i = 0; i < j->hw; ++i) {
                const int64_t at = (o * j->c + ch) * j->hw + i;
                s1 += j->dy[at];
                s2 += j->dy[at] * ((j->x[at] - mean) * rstd);
            }
        j->dw[ch] += (float)s2;
        j->db[ch] += (float)s1;
        if (j->mode == MGPU__BN_STATS) {
            j->sync[ch] = s1;
            j->sync[j->c + ch] = s2;
            return;
        }
        a = s1 / (double)m;
        bb = s2 / (double)m;
    }
    if (!j->dx) return;
    k = j->w[ch] * rstd;
    for (o = 0; o < j->n; ++o)
        for (i = 0; i < j->hw; ++i) {
            const int64_t at = (o * j->c + ch) * j->hw + i;
            j->dx[at] = (float)(k * (j->dy[at] - a - (j->x[at] - mean) * rstd * bb));
        }
}
/* SyncBatchNorm on a GPU: GIVEN's numbers up before the kernel (forward's 3c, backward's 2c),
   STATS's 2c down after it; only those, so that no float the kernels did not write is read. */
static mgpu_result mgpu__bn_sync_up(const mgpu__bn_job* j, int64_t numbers, mgpu_tensor* sync_dev, float* stage) {
    mgpu_tensor used;
    int64_t i;
    if (j->mode != MGPU__BN_GIVEN) return MGPU_OK;
    used = mgpu__rows(sync_dev, 0, numbers);
    for (i = 0; i < numbers; ++i) stage[i] = (float)j->sync[i];
    return mgpu_tensor_upload(&used, stage, (size_t)numbers * sizeof(float));
}
static mgpu_result mgpu__bn_sync_down(const mgpu__bn_job* j, const mgpu_tensor* sync_dev, float* stage) {
    mgpu_tensor used;
    int64_t i;
    if (j->mode != MGPU__BN_STATS) return MGPU_OK;
    used = mgpu__rows(sync_dev, 0, 2 * j->c);
    MGPU__TRY(mgpu_tensor_download(&used, stage, (size_t)(2 * j->c) * sizeof(float)));
    for (i = 0; i < 2 * j->c; ++i) j->sync[i] = stage[i];
    return MGPU_OK;
}
/* buf: running_mean, running_var, num_batches_tracked; aux: the batch's mean and rstd */
static mgpu_result mgpu__batch_norm(const mgpu_tensor* x, const mgpu_tensor* w, const mgpu_tensor* b, mgpu_tensor* const* buf,
                                    int mode, float momentum, float eps, mgpu_tensor* save_mean, mgpu_tensor* save_rstd,
                                    double* sync, mgpu_tensor* sync_dev, float* stage, mgpu_tensor* y) {
    mgpu__bn_job j;
    memset(&j, 0, sizeof j);
    mgpu__channel_split(x, &j.n, &j.c, &j.hw);
    j.mode = mode;
    j.sync = sync;
    MGPU__COUNT(MGPU__DEV(y), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__TRY(mgpu__bn_sync_up(&j, 3 * j.c, sync_dev, stage));
        MGPU__CU("BatchNorm2d forward", MGPU__DEV(x),
                 mgpu__cu_batch_norm(MGPU__CUDA_ARGS(MGPU__DEV(x)), j.n, j.c, j.hw, MGPU__F32(x), MGPU__F32(w), MGPU__F32(b),
                                     MGPU__F32(buf[0]), MGPU__F32(buf[1]), MGPU__F32(buf[2]), mode, momentum, eps,
                                     MGPU__F32(save_mean), MGPU__F32(save_rstd), sync_dev ? MGPU__F32(sync_dev) : NULL,
                                     MGPU__F32(y)));
        return mgpu__bn_sync_down(&j, sync_dev, stage);
    }
    j.x = MGPU__F32(x); j.w = MGPU__F32(w); j.b = MGPU__F32(b);
    j.run_mean = MGPU__F32(buf[0]); j.run_var = MGPU__F32(buf[1]); j.count = MGPU__F32(buf[2]);
    j.save_mean = MGPU__F32(save_mean); j.save_rstd = MGPU__F32(save_rstd); j.y = MGPU__F32(y);
    j.momentum = momentum; j.eps = eps;
    if (j.n * j.hw > 0) mgpu__parallel_for(j.c, mgpu__bn_forward_task, &j);
    return MGPU_OK;
}
static mgpu_result mgpu__batch_norm_backward(const mgpu_tensor* x, const mgpu_tensor* dy, const mgpu_tensor* w,
                                             const mgpu_tensor* save_mean, const mgpu_tensor* save_rstd, int mode,
                                             double* sync, mgpu_tensor* sync_dev, float* stage, mgpu_tensor* dw,
                                             mgpu_tensor* db, mgpu_tensor* dx) {
    mgpu__bn_job j;
    memset(&j, 0, sizeof j);
    mgpu__channel_split(x, &j.n, &j.c, &j.hw);
    j.mode = mode;
    j.sync = sync;
    MGPU__COUNT(MGPU__DEV(dw), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__TRY(mgpu__bn_sync_up(&j, 2 * j.c, sync_dev, stage));
        MGPU__CU("BatchNorm2d backward", MGPU__DEV(x),
                 mgpu__cu_batch_norm_backward(MGPU__CUDA_ARGS(MGPU__DEV(x)), j.n, j.c, j.hw, MGPU__F32(x), MGPU__F32(dy),
                                              MGPU__F32(w), MGPU__F32(save_mean), MGPU__F32(save_rstd), mode,
                                              sync_dev ? MGPU__F32(sync_dev) : NULL, MGPU__F32(dw), MGPU__F32(db),
                                              dx ? MGPU__F32(dx) : NULL));
        return mgpu__bn_sync_down(&j, sync_dev, stage);
    }
    j.x = MGPU__F32(x); j.dy = MGPU__F32(dy); j.w = MGPU__F32(w);
    j.mean_in = MGPU__F32(save_mean); j.rstd_in = MGPU__F32(save_rstd);
    j.dw = MGPU__F32(dw); j.db = MGPU__F32(db); j.dx = dx ? MGPU__F32(dx) : NULL;
    if (j.n * j.hw > 0) mgpu__parallel_for(j.c, mgpu__bn_backward_task, &j);
    return MGPU_OK;
}
/* dx [planes, hw] = dy [planes] * scale, each value spread over its plane */
typedef struct mgpu__spread_job { int64_t hw; const float* dy; float scale; float* dx; } mgpu__spread_job;
static void mgpu__spread_range(void* ctx, int64_t p0, int64_t p1) {
    const mgpu__spread_job* j = (const mgpu__spread_job*)ctx;
    int64_t p, i;
    for (p = p0; p < p1; ++p)
        for (i = 0; i < j->hw; ++i) j->dx[p * j->hw + i] = j->dy[p] * j->scale;
}
static mgpu_result mgpu__spread(int64_t planes, int64_t hw, const mgpu_tensor* dy, float scale, mgpu_tensor* dx) {
    mgpu__spread_job j;
    MGPU__COUNT(MGPU__DEV(dx), ops, 1);
    if (!MGPU__IS_CPU(dx)) {
        MGPU__CU("AdaptiveAvgPool2d backward", MGPU__DEV(dx),
                 mgpu__cu_spread(MGPU__CUDA_ARGS(MGPU__DEV(dx)), planes, hw, MGPU__F32(dy), scale, MGPU__F32(dx)));
        return MGPU_OK;
    }
    j.hw = hw; j.dy = MGPU__F32(dy); j.scale = scale; j.dx = MGPU__F32(dx);
    mgpu__parallel_range(planes, 64, mgpu__spread_range, &j);
    return MGPU_OK;
}

/* -- >>ops attention: causal self-attention's core (the layer checks the shapes). What forward
   keeps for backward is y and lse[b, h, t] (the log of row t's softmax denominator), never the
   [batch, heads, T, T] probabilities: backward computes them again, and the dropout mask from its
   counters (a step's key and offset are the same in both passes). On a GPU: the fused kernels
   (FlashAttention-2's way, >>seam) up to a head size of MGPU__CU_ATTN_FUSED_MAX_HEAD, and above it
   the unfused ones, their T x T matrices from the caching allocator for the call only.
   On the CPU each (batch, head) is seven small GEMMs (mgpu__gemm_serial, on one thread: two
   forward, five backward with q k^T again) and the softmax between them, the heads shared
   out over a task per thread, each task with its own T x T scratch; a head's results do not
   depend on the task that computes it, so neither do they on the thread count. Backward's
   softmax is forward's, to the bit. The products run over the whole T x T square, the masked half
   included: at GEMM speed that costs less than triangular loops whose dot products cannot
   vectorise (their sums are ordered), and cut at the diagonal in blocks they measured no faster
   at T 64. So, as in PyTorch's att @ v, an Inf or NaN in a later position's v or k reaches the
   earlier rows' y and dq (0 x Inf is NaN); the GPU kernels skip those terms. -- */
typedef struct mgpu__attn_job {
    mgpu__attn g;
    const float *qkv, *dy;
    float *y, *lse, *drow, *dqkv;
    uint64_t seed, offset, first;
    float p;              /* the dropout probability; 0: none */
    int64_t tasks;
    size_t task_floats;   /* per task: GEMM packing space, then T x T squares (one forward, two backward) and a row */
    float* space;         /* scratch's */
    mgpu__scratch scratch;
} mgpu__attn_job;

/* Scratch for the job's tasks from dev's caching allocator (the caller puts it back). */
static mgpu_result mgpu__attn_job_init(mgpu__attn_job* j, mgpu_device* dev, const mgpu__attn* g, int squares, const char* op) {
    const int64_t T = g->t;
    memset(j, 0, sizeof *j);
    j->g = *g;
    j->tasks = MGPU__MAX((int64_t)1, MGPU__MIN((int64_t)mgpu_cpu_threads(), (int64_t)g->batch * g->heads));
    j->task_floats = (mgpu__gemm_pack_floats(T, MGPU__MAX(T, (int64_t)g->head_size)) + (size_t)(squares * T * T + T) + 15) / 16 * 16;
    MGPU__TRY(mgpu__scratch_get(&j->scratch, dev, sizeof(float) * j->task_floats * (size_t)j->tasks, op));
    j->space = (float*)j->scratch.ptr;
    return MGPU_OK;
}

/* a[i] = e^(a[i] - m) for i < n, in blocks of 16 read into locals first (as the elementwise loops
   are, so that cc -O2 vectorises it too) */
static void mgpu__exp_shifted(float* a, int64_t n, float m) {
    int64_t i;
    for (i = 0; i + MGPU__EW_BLOCK <= n; i += MGPU__EW_BLOCK) {
        float t[MGPU__EW_BLOCK];
        int k;
        for (k = 0; k < MGPU__EW_BLOCK; ++k) t[k] = a[i + k];
        for (k = 0; k < MGPU__EW_BLOCK; ++k) a[i + k] = mgpu__expf(t[k] - m);
    }
    for (; i < n; ++i) a[i] = mgpu__expf(a[i] - m);
}

/* Row t of a head's probabilities, in place over its scores a[0, T): the softmax of a[s] * scale
   for s <= t, 0 after (the causal mask: exp(-inf)); lse (NULL: not wanted) = max + log(sum). */
static void mgpu__attn_softmax_row(float* a, int64_t t, int64_t T, float scale, float* lse) {
    float m = -INFINITY, sum = 0.0f;
    int64_t s;
    for (s = 0; s <= t; ++s) {
        a[s] *= scale;
        m = a[s] > m ? a[s] : m;
    }
    mgpu__exp_shifted(a, t + 1, m);   /* max subtracted: no overflow */
    for (s = 0; s <= t; ++s) sum += a[s];
    for (s = 0; s <= t; ++s) a[s] /= sum;
    for (s = t + 1; s < T; ++s) a[s] = 0.0f;
    if (lse) *lse = m + logf(sum);
}
/* The dropout scales of row `row` of [batch * heads * T, T], s = 0 .. t, into keep */
static void mgpu__attn_keep_row(const mgpu__attn_job* j, int64_t row, int64_t t, float* keep) {
    int64_t s;
    for (s = 0; s <= t; ++s) keep[s] = mgpu__dropout_scale(j->seed, j->offset, j->first + (uint64_t)(row * j->g.t + s), j->p);
}

static void mgpu__attn_forward_task(void* ctx, int64_t task) {
    const mgpu__attn_job* j = (const mgpu__attn_job*)ctx;
    const mgpu__attn* g = &j->g;
    const int64_t T = g->t, hs = g->head_size, D = (int64_t)g->heads * hs, W = 3 * D, BH = (int64_t)g->batch * g->heads;
    float* pack = j->space + (size_t)task * j->task_floats;
    float* att = pack + mgpu__gemm_pack_floats(T, MGPU__MAX(T, hs));
    float* keep = att + T * T;
    int64_t bh, t, s;
    for (bh = BH * task / j->tasks; bh < BH * (task + 1) / j->tasks; ++bh) {
        const int64_t b = bh / g->heads, h = bh % g->heads;
        const float* base = j->qkv + b * T * W + h * hs;   /* this head's q of row 0; k at + D, v at + 2 D */
        mgpu__gemm_serial(0, 1, T, T, hs, base, W, base + D, W, att, T, pack, 1, NULL);   /* q k^T */
        for (t = 0; t < T; ++t) {
            float* a = att + t * T;
            mgpu__attn_softmax_row(a, t, T, g->scale, j->lse + bh * T + t);
            if (j->p > 0.0f) {
                mgpu__attn_keep_row(j, bh * T + t, t, keep);
                for (s = 0; s <= t; ++s) a[s] *= keep[s];
            }
        }
        mgpu__gemm_serial(0, 0, T, hs, T, att, T, base + 2 * D, W, j->y + b * T * D + h * hs, D, pack, 1, NULL);   /* y = (att .* mask) v */
    }
}

static void mgpu__attn_backward_task(void* ctx, int64_t task) {
    const mgpu__attn_job* j = (const mgpu__attn_job*)ctx;
    const mgpu__attn* g = &j->g;
    const int64_t T = g->t, hs = g->head_size, D = (int64_t)g->heads * hs, W = 3 * D, BH = (int64_t)g->batch * g->heads;
    float* pack = j->space + (size_t)task * j->task_floats;
    float* att = pack + mgpu__gemm_pack_floats(T, MGPU__MAX(T, hs));
    float* ds = att + T * T;
    float* keep = ds + T * T;
    int64_t bh, t, s;
    for (bh = BH * task / j->tasks; bh < BH * (task + 1) / j->tasks; ++bh) {
        const int64_t b = bh / g->heads, h = bh % g->heads;
        const float* base = j->qkv + b * T * W + h * hs;
        const float* dy = j->dy + b * T * D + h * hs;
        float* dbase = j->dqkv + b * T * W + h * hs;
        mgpu__gemm_serial(0, 1, T, T, hs, base, W, base + D, W, att, T, pack, 1, NULL);     /* q k^T, as forward */
        mgpu__gemm_serial(0, 1, T, T, hs, dy, D, base + 2 * D, W, ds, T, pack, 1, NULL);    /* d(att .* mask) = dy v^T */
        for (t = 0; t < T; ++t) {   /* dS = att .* (dP - rowsum(dP .* att)) * scale, dP = that .* mask */
            float *a = att + t * T, *d = ds + t * T;
            float rs = 0.0f;
            mgpu__attn_softmax_row(a, t, T, g->scale, NULL);
            if (j->p > 0.0f) {
                mgpu__attn_keep_row(j, bh * T + t, t, keep);
                for (s = 0; s <= t; ++s) d[s] *= keep[s];
            }
            for (s = 0; s <= t; ++s) rs += d[s] * a[s];
            for (s = 0; s <= t; ++s) d[s] = a[s] * (d[s] - rs) * g->scale;
            for (s = t + 1; s < T; ++s) d[s] = 0.0f;
            j->drow[bh * T + t] = rs;
            if (j->p > 0.0f)
                for (s = 0; s <= t; ++s) a[s] *= keep[s];   /* att .* mask, for dv */
        }
        mgpu__gemm_serial(0, 0, T, hs, T, ds, T, base + D, W, dbase, W, pack, 1, NULL);       /* dq = dS k */
        mgpu__gemm_serial(1, 0, T, hs, T, ds, T, base, W, dbase + D, W, pack, 1, NULL);       /* dk = dS^T q */
        mgpu__gemm_serial(1, 0, T, hs, T, att, T, dy, D, dbase + 2 * D, W, pack, 1, NULL);    /* dv = (att .* mask)^T dy */
    }
}

/* A GPU above the fused kernels' head size: the unfused kernels with their T x T matrices (att,
   with dropout the mask, in backward dscores and forward's y again) as scratch. dy NULL: forward
   into y; otherwise backward into dqkv, forward run again first. */
static mgpu_result mgpu__attention_unfused(const mgpu__attn* g, const mgpu_tensor* qkv, mgpu_tensor* y, const mgpu_tensor* dy,
                                           mgpu_tensor* dqkv, uint64_t seed, const uint64_t* seed_on_device,
                                           uint64_t offset, uint64_t first, float p, const char* op) {
    mgpu_device* dev = MGPU__DEV(qkv);
    const size_t square = (size_t)g->batch * (size_t)g->heads * (size_t)g->t * (size_t)g->t;
    const size_t squares = (p > 0.0f ? 2 : 1) + (dy ? 1 : 0);
    mgpu__scratch s;
    float *att, *mask, *yy;
    int rc;
    MGPU__TRY(mgpu__scratch_get(&s, dev, sizeof(float) * (squares * square + (dy ? (size_t)mgpu_tensor_numel(dy) : 0)), op));
    att = (float*)s.ptr;
    mask = p > 0.0f ? att + square : NULL;
    yy = dy ? att + squares * square : MGPU__F32(y);
    rc = MGPU__CUDA(mgpu__cu_attention_forward(MGPU__CUDA_ARGS(dev), g, MGPU__F32(qkv), att, yy, mask, seed, seed_on_device,
                                               offset, first, p));
    if (rc == 0 && dy)
        rc = MGPU__CUDA(mgpu__cu_attention_backward(MGPU__CUDA_ARGS(dev), g, MGPU__F32(qkv), att, mask, MGPU__F32(dy),
                                                    att + (squares - 1) * square, MGPU__F32(dqkv)));
    mgpu__scratch_put(&s);
    return rc == 0 ? MGPU_OK : mgpu__cu_result(rc, op, dev);
}

/* y = attention of qkv, lse its rows' log denominators (not written on a GPU above the fused head
   size, whose backward does not read it); p: dropout on the probabilities, drawn as
   mgpu__dropout_scale(seed, offset, first + (row * T + s), p) for row (b * heads + h) * T + t */
static mgpu_result mgpu__attention_forward(const mgpu__attn* g, const mgpu_tensor* qkv, mgpu_tensor* y, mgpu_tensor* lse,
                                           uint64_t seed, const uint64_t* seed_on_device, uint64_t offset, uint64_t first,
                                           float p) {
    static const char* op = "CausalSelfAttention forward";
    mgpu__attn_job job;
    MGPU__COUNT(MGPU__DEV(y), ops, 1);
    if (!MGPU__IS_CPU(qkv)) {
        if (g->head_size > MGPU__CU_ATTN_FUSED_MAX_HEAD)
            return mgpu__attention_unfused(g, qkv, y, NULL, NULL, seed, seed_on_device, offset, first, p, op);
        MGPU__CU(op, MGPU__DEV(qkv),
                 mgpu__cu_attention_fused_forward(MGPU__CUDA_ARGS(MGPU__DEV(qkv)), g, MGPU__F32(qkv), MGPU__F32(y),
                                                  MGPU__F32(lse), seed, seed_on_device, offset, first, p));
        return MGPU_OK;
    }
    MGPU__TRY(mgpu__attn_job_init(&job, MGPU__DEV(y), g, 1, op));
    job.qkv = MGPU__F32(qkv); job.y = MGPU__F32(y); job.lse = MGPU__F32(lse);
    job.seed = seed; job.offset = offset; job.first = first; job.p = p;
    mgpu__parallel_for(job.tasks, mgpu__attn_forward_task, &job);
    mgpu__scratch_put(&job.scratch);
    return MGPU_OK;
}

/* dqkv (overwritten) from dy, with forward's y and lse and the same dropout; drow (overwritten)
   = rowsum(dy .* y) per head (not written on a GPU above the fused head size) */
static mgpu_result mgpu__attention_backward(const mgpu__attn* g, const mgpu_tensor* qkv, const mgpu_tensor* y,
                                            const mgpu_tensor* lse, const mgpu_tensor* dy, mgpu_tensor* drow,
                                            mgpu_tensor* dqkv, uint64_t seed, const uint64_t* seed_on_device,
                                            uint64_t offset, uint64_t first, float p) {
    static const char* op = "CausalSelfAttention backward";
    mgpu__attn_job job;
    MGPU__COUNT(MGPU__DEV(dqkv), ops, 1);
    if (!MGPU__IS_CPU(qkv)) {
        if (g->head_size > MGPU__CU_ATTN_FUSED_MAX_HEAD)
            return mgpu__attention_unfused(g, qkv, NULL, dy, dqkv, seed, seed_on_device, offset, first, p, op);
        MGPU__CU(op, MGPU__DEV(qkv),
                 mgpu__cu_attention_fused_backward(MGPU__CUDA_ARGS(MGPU__DEV(qkv)), g, MGPU__F32(qkv), MGPU__F32(y),
                                                   MGPU__F32(lse), MGPU__F32(dy), MGPU__F32(drow), MGPU__F32(dqkv), seed,
                                                   seed_on_device, offset, first, p));
        return MGPU_OK;
    }
    MGPU__TRY(mgpu__attn_job_init(&job, MGPU__DEV(dqkv), g, 2, op));
    job.qkv = MGPU__F32(qkv); job.dy = MGPU__F32(dy); job.drow = MGPU__F32(drow); job.dqkv = MGPU__F32(dqkv);
    job.seed = seed; job.offset = offset; job.first = first; job.p = p;
    mgpu__parallel_for(job.tasks, mgpu__attn_backward_task, &job);
    mgpu__scratch_put(&job.scratch);
    return MGPU_OK;
}

/* -- kernels of your own -- */
MGPUDEF mgpu_result mgpu_tensor_check(const char* op, const char* name, const mgpu_tensor* t, mgpu_dtype dt,
                                      const char* like_name, const mgpu_tensor* like) {
    op = op ? op : "mgpu_tensor_check";
    name = name ? name : "tensor";
    like_name = like_name ? like_name : "like";
    MGPU__TRY(mgpu__check_tensor(op, name, t, dt));
    if (!like) return MGPU_OK;
    MGPU__TRY(mgpu__check_same_device(op, name, t, like_name, like));
    return mgpu__check_same_shape(op, name, t, like_name, like);
}

/* The device a CPU loop or a CUDA launch of the program's own is for, or why not. */
static mgpu_result mgpu__check_kind(const char* op, const mgpu_device* dev, mgpu_device_kind want) {
    if (!dev) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL device", op);
    if (dev->kind == want) return MGPU_OK;
    if (want == MGPU_DEVICE_CPU)
        return mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: %s is a GPU, whose memory the host cannot touch: launch "
                          "a CUDA kernel on it between mgpu_cuda_begin and mgpu_cuda_end", op, dev->label);
    return mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: %s is a CPU device, not a GPU: run a CPU loop on it with "
                      "mgpu_cpu_parallel", op, dev->label);
}

MGPUDEF mgpu_result mgpu_cpu_parallel(mgpu_device* dev, int64_t n, int64_t grain, mgpu_cpu_range_fn fn, void* user) {
    MGPU__TRY(mgpu__check_kind("mgpu_cpu_parallel", dev, MGPU_DEVICE_CPU));
    if (!fn) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_cpu_parallel: NULL function");
    if (n < 0 || grain < 0)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_cpu_parallel: n %lld and grain %lld must be >= 0",
                          (long long)n, (long long)grain);
    mgpu__parallel_range(n, grain ? grain : MGPU__EW_MIN_PER_THREAD, fn, user);
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_cuda_begin(mgpu_device* dev, void** stream) {
    if (stream) *stream = NULL;
    MGPU__TRY(mgpu__check_kind("mgpu_cuda_begin", dev, MGPU_DEVICE_CUDA));
    if (!stream) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_cuda_begin on %s: NULL stream pointer", dev->label);
    MGPU__CU("mgpu_cuda_begin", dev, mgpu__cu_use_device(dev->ordinal));
    *stream = dev->stream;
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_cuda_end(mgpu_device* dev, const char* kernel) {
    MGPU__TRY(mgpu__check_kind("mgpu_cuda_end", dev, MGPU_DEVICE_CUDA));
    MGPU__CU("mgpu_cuda_end", dev, mgpu__cu_check_launch(dev->ordinal, kernel ? kernel : "your kernel"));
    return MGPU_OK;
}


/* ---- >>impl layer ----------------------------------------------------------------------- */
/* The built-in layers keep their sizes in cfg; a custom layer keeps whatever it likes in user. */
typedef struct mgpu__layer_cfg {
    int in, out;            /* Linear features, Conv2d channels */
    int kernel, stride, pad;
    float p;                /* Dropout */
    int forward_op, backward_op, backward_uses_output;   /* activations */
    int no_bias, in_out;    /* Linear without a bias; with its weight stored [in, out] (Conv1D) */
} mgpu__layer_cfg;

struct mgpu_layer {
    const mgpu_layer_vtable* vt;
    void* user;
    char name[48];             /* mgpu_layer_name's, when named */
    int named;
    mgpu__layer_cfg cfg;
    const mgpu_model* owner;   /* the model it belongs to (LIFETIMES), or NULL */
    int graph_safe;            /* a built-in, whose work a CUDA graph may capture (what changes
                                  from step to step, Dropout's key, it reads on the device) */
    int uses_rng;              /* draws from the step's Dropout key (Dropout, CausalSelfAttention
                                  with dropout, a container holding one): a CUDA graph's step gives
                                  it that key on the device */
    /* Activations in place (PyTorch's nn.ReLU(inplace=True), chosen by the model): a layer that
       is in_place_ok writes its output over its input when the layer before it is
       output_unused (its backward never reads its own output, as a Linear's) and in the same
       stage. At MLP 4096 the four ReLUs then keep no buffer of their own (128 MiB). */
    int in_place_ok;           /* elementwise, and its backward reads its output alone (ReLU,
                                  Tanh, Sigmoid) */
    int output_unused;         /* its backward reads x, dy, its parameters and aux, never y (Linear,
                                  Conv1D, Conv2d, BatchNorm2d) */
    mgpu_dtype precision;      /* its model's desc.precision, the dtype of the activations it is
                                  given (a container makes its children's outputs of it) */
};

MGPUDEF mgpu_layer* mgpu_layer_create(const mgpu_layer_vtable* vt, void* user) {
    mgpu_layer* l;
    if (!vt || !vt->forward || !vt->backward) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_create: a layer needs a vtable with forward and backward");
        return NULL;
    }
    if ((vt->param_count && !vt->param_shape) || (vt->aux_count && !vt->aux_shape) || (vt->buffer_count && !vt->buffer_shape)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_create: %s: param_count needs param_shape, aux_count needs aux_shape, "
                   "buffer_count needs buffer_shape",
                   vt->type ? vt->type : "layer");
        return NULL;
    }
    l = (mgpu_layer*)mgpu__calloc(1, sizeof *l);
    if (!l) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_layer_create: out of host memory"); return NULL; }
    l->vt = vt;
    l->user = user;
    return l;
}
MGPUDEF void* mgpu_layer_user_data(const mgpu_layer* l) { return l ? l->user : NULL; }
static void mgpu__layer_free(mgpu_layer* l);
MGPUDEF mgpu_layer* mgpu_layer_name(mgpu_layer* l, const char* name) {
    if (!l) return NULL;   /* (its constructor's error stays the last one) */
    if (!name || strlen(name) >= sizeof l->name || l->owner) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_name: %s", !name ? "NULL name" : l->owner ? "the layer belongs to a "
                   "model or container already" : "the name is longer than 47 bytes");
        if (!l->owner) mgpu__layer_free(l);
        return NULL;
    }
    memcpy(l->name, name, strlen(name) + 1);
    l->named = 1;
    return l;
}
/* A parameter's state_dict name inside a list: "<place>.<name>", or "<layer's name>.<name>". */
static void mgpu__param_name(char* buf, size_t size, const mgpu_layer* l, int place, const char* name) {
    if (!l->named) snprintf(buf, size, "%d.%s", place, name);
    else snprintf(buf, size, "%s%s%s", l->name, l->name[0] ? "." : "", name);
}
MGPUDEF const char* mgpu_layer_type(const mgpu_layer* l) { return l && l->vt->type ? l->vt->type : "Layer"; }
static void mgpu__layer_free(mgpu_layer* l) {
    if (!l) return;
    if (l->vt->destroy) l->vt->destroy(l);
    MGPU_FREE(l);
}
MGPUDEF mgpu_result mgpu_layer_destroy(mgpu_layer* l) {
    if (!l) return MGPU_OK;
    if (l->owner)
        return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_layer_destroy: this %s layer belongs to a model, which destroys it "
                          "(mgpu_model_destroy)", mgpu_layer_type(l));
    mgpu__layer_free(l);
    return MGPU_OK;
}

static mgpu_layer* mgpu__builtin_layer(const mgpu_layer_vtable* vt, const mgpu__layer_cfg* cfg) {
    mgpu_layer* l = mgpu_layer_create(vt, NULL);
    if (l) {
        l->cfg = *cfg;
        l->graph_safe = 1;
    }
    return l;
}

/* A tensor header seen with another shape, on the stack: no allocation, same storage. */
static mgpu_tensor mgpu__reshaped(const mgpu_tensor* t, mgpu_shape shape) {
    mgpu_tensor r = *t;
    r.shape = shape;
    return r;
}

static mgpu_result mgpu__layer_shape_error(const mgpu_layer* l, mgpu_shape x, const char* want) {
    char text[96], cfg[96] = "";
    if (l->vt->describe) l->vt->describe(l, cfg, sizeof cfg);
    return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s(%s): input %s, expected %s", mgpu_layer_type(l), cfg,
                      mgpu__shape_text(x, text, sizeof text), want);
}

/* PyTorch's default for Linear and Conv2d: kaiming_uniform_(a=sqrt(5)) for the weight, which
   is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound for the bias. */
static mgpu_result mgpu__init_fan_in(const mgpu_layer_ctx* ctx, uint64_t seed, int64_t fan_in) {
    float bound = 1.0f / sqrtf((float)fan_in);
    MGPU__TRY(mgpu_rand_uniform(ctx->params[0], seed, 0, -bound, bound));
    return mgpu_rand_uniform(ctx->params[1], seed, mgpu_rand_offsets(mgpu_tensor_numel(ctx->params[0])), -bound, bound);
}

/* dbias += sum of dy over every dimension but 1 */
static mgpu_result mgpu__bias_grad_add(mgpu_tensor* dbias, const mgpu_tensor* dy) {
    int64_t outer, channels, inner;
    mgpu__channel_split(dy, &outer, &channels, &inner);
    return mgpu__channel_sum("bias gradient", dbias, dy, outer, channels, inner, 1.0f, 1);
}

static int mgpu__two_params(const mgpu_layer* l) { (void)l; return 2; }
static int mgpu__one_aux(const mgpu_layer* l) { (void)l; return 1; }
static int mgpu__two_aux(const mgpu_layer* l) { (void)l; return 2; }

/* -- Linear: y = x W^T + b, W [out, in], on the last dimension of x [..., in] (every other
   dimension is rows: [B, T, in] is B x T rows, as nn.Linear takes it) -- */
static mgpu_result mgpu__linear_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char want[80];
    if (x.ndim < 2 || x.dim[x.ndim - 1] != l->cfg.in) {
        snprintf(want, sizeof want, "[...,%d]%s", l->cfg.in,
                 x.ndim > 2 && mgpu_shape_numel(x) / MGPU__MAX(x.dim[0], 1) == l->cfg.in ? " (add a Flatten before it)" : "");
        return mgpu__layer_shape_error(l, x, want);
    }
    *y = x;
    y->dim[x.ndim - 1] = l->cfg.out;
    return MGPU_OK;
}
/* x [..., d] seen as the 2-D [rows, d] it is in memory */
static mgpu_tensor mgpu__rows_2d(const mgpu_tensor* x) {
    const int64_t d = x->shape.dim[x->shape.ndim - 1];
    return mgpu__reshaped(x, mgpu_shape2(d ? mgpu_tensor_numel(x) / d : 0, d));
}
static int mgpu__linear_params(const mgpu_layer* l) { return l->cfg.no_bias ? 1 : 2; }
static mgpu_result mgpu__linear_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    *name = i == 0 ? "weight" : "bias";
    *shape = i == 0 ? (l->cfg.in_out ? mgpu_shape2(l->cfg.in, l->cfg.out) : mgpu_shape2(l->cfg.out, l->cfg.in)) : mgpu_shape1(l->cfg.out);
    return MGPU_OK;
}
static mgpu_result mgpu__linear_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    const float bound = 1.0f / sqrtf((float)l->cfg.in);
    if (l->cfg.in_out) return mgpu_rand_normal(ctx->params[0], seed, 0, 0.0f, 0.02f);   /* GPT-2's; the bias stays 0 */
    if (l->cfg.no_bias) return mgpu_rand_uniform(ctx->params[0], seed, 0, -bound, bound);
    return mgpu__init_fan_in(ctx, seed, l->cfg.in);
}
static void mgpu__linear_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "%d -> %d%s", l->cfg.in, l->cfg.out, l->cfg.no_bias ? ", no bias" : "");
}
/* The weight the products take: the f32 parameter, or for bf16 x its bf16 copy (ctx->params_bf16) */
static mgpu_result mgpu__linear_weight(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor** w) {
    char cfg[64];
    *w = ctx->params[0];
    if (x->dtype != MGPU_BF16) return MGPU_OK;
    if (!ctx->params_bf16) {
        mgpu__linear_describe(l, cfg, sizeof cfg);
        return mgpu__fail(MGPU_ERROR_DTYPE_MISMATCH, "%s(%s): x is bf16 and there is no bf16 copy of the weight (a model of "
                          "precision MGPU_BF16 makes one)", mgpu_layer_type(l), cfg);
    }
    *w = ctx->params_bf16[0];
    return MGPU_OK;
}
/* y = x W^T (+ b), or x W (+ b) for a weight stored [in, out]. A bf16 y with a bias: the fp32 sums
   plus the bias, rounded once (as cuBLASLt's bias epilogue), through an f32 temporary from the
   device's cache. */
static mgpu_result mgpu__linear_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const mgpu_tensor x2 = mgpu__rows_2d(x);
    const mgpu_transpose tw = l->cfg.in_out ? MGPU_NO_TRANS : MGPU_TRANS;
    mgpu_tensor y2 = mgpu__rows_2d(y);
    const mgpu_tensor* w;
    mgpu_tensor* sums;
    mgpu_result r;
    MGPU__TRY(mgpu__linear_weight(l, ctx, x, &w));
    if (l->cfg.no_bias || y->dtype != MGPU_BF16) {
        MGPU__TRY(mgpu_matmul(&y2, &x2, w, MGPU_NO_TRANS, tw, 1.0f, 0.0f));
        return l->cfg.no_bias ? MGPU_OK : mgpu_bias_add(&y2, &y2, ctx->params[1]);
    }
    if (!(sums = mgpu_tensor_create(MGPU__DEV(y), MGPU_F32, y2.shape))) return mgpu_last_result();
    r = mgpu_matmul(sums, &x2, w, MGPU_NO_TRANS, tw, 1.0f, 0.0f);
    if (r == MGPU_OK) r = mgpu_bias_add(&y2, sums, ctx->params[1]);
    mgpu_tensor_destroy(sums);
    return r;
}
static mgpu_result mgpu__linear_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                         const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    const mgpu_tensor x2 = mgpu__rows_2d(x), dy2 = mgpu__rows_2d(dy);
    const mgpu_tensor* w;
    mgpu_tensor dx2;
    (void)y;
    MGPU__TRY(mgpu__linear_weight(l, ctx, x, &w));
    /* (bf16 operands: the products summed in fp32 into the f32 gradients) */
    if (l->cfg.in_out) MGPU__TRY(mgpu_matmul(ctx->grads[0], &x2, &dy2, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));   /* dW += x^T dy */
    else MGPU__TRY(mgpu_matmul(ctx->grads[0], &dy2, &x2, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));                 /* dW += dy^T x */
    if (!l->cfg.no_bias) MGPU__TRY(mgpu__bias_grad_add(ctx->grads[1], &dy2));                  /* db += sum(dy) */
    if (!dx) return MGPU_OK;
    dx2 = mgpu__rows_2d(dx);
    return mgpu_matmul(&dx2, &dy2, w, MGPU_NO_TRANS, l->cfg.in_out ? MGPU_TRANS : MGPU_NO_TRANS, 1.0f, 0.0f);   /* dx = dy W */
}
static const mgpu_layer_vtable mgpu__linear_vt = {
    "Linear", mgpu__linear_output_shape, mgpu__linear_params, mgpu__linear_param_shape, mgpu__linear_init,
    NULL, NULL, mgpu__linear_forward, mgpu__linear_backward, mgpu__linear_describe, NULL, NULL, NULL
};
static const mgpu_layer_vtable mgpu__conv1d_vt = {
    "Conv1D", mgpu__linear_output_shape, mgpu__linear_params, mgpu__linear_param_shape, mgpu__linear_init,
    NULL, NULL, mgpu__linear_forward, mgpu__linear_backward, mgpu__linear_describe, NULL, NULL, NULL
};
static mgpu_layer* mgpu__linear_make(const char* op, int in_features, int out_features, int no_bias, int in_out) {
    mgpu__layer_cfg cfg;
    mgpu_layer* l;
    if (in_features <= 0 || out_features <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: features %d -> %d must be positive", op, in_features, out_features);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = in_features;
    cfg.out = out_features;
    cfg.no_bias = no_bias;
    cfg.in_out = in_out;
    if ((l = mgpu__builtin_layer(in_out ? &mgpu__conv1d_vt : &mgpu__linear_vt, &cfg))) l->output_unused = 1;
    return l;
}
MGPUDEF mgpu_layer* mgpu_layer_linear(int in_features, int out_features) {
    return mgpu__linear_make("mgpu_layer_linear", in_features, out_features, 0, 0);
}
MGPUDEF mgpu_layer* mgpu_layer_linear_no_bias(int in_features, int out_features) {
    return mgpu__linear_make("mgpu_layer_linear_no_bias", in_features, out_features, 1, 0);
}
MGPUDEF mgpu_layer* mgpu_layer_conv1d(int in_features, int out_features) {
    return mgpu__linear_make("mgpu_layer_conv1d", in_features, out_features, 0, 1);
}

/* -- activations: one implementation, the op codes in cfg -- */
static mgpu_result mgpu__activation_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)ctx;
    return mgpu__unary(mgpu_layer_type(l), l->cfg.forward_op, y, x, 0.0f);
}
static mgpu_result mgpu__activation_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                             const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)ctx;
    if (!dx) return MGPU_OK;
    return l->cfg.backward_uses_output ? mgpu__binary(mgpu_layer_type(l), l->cfg.backward_op, dx, "dy", dy, "y", y, 0.0f)
                                       : mgpu__binary(mgpu_layer_type(l), l->cfg.backward_op, dx, "dy", dy, "x", x, 0.0f);
}
#define MGPU__ACTIVATION_VT(name, type)                                                                \
    static const mgpu_layer_vtable name = { type, NULL, NULL, NULL, NULL, NULL, NULL,                  \
                                            mgpu__activation_forward, mgpu__activation_backward, NULL, NULL, NULL, NULL }
MGPU__ACTIVATION_VT(mgpu__relu_vt, "ReLU");
MGPU__ACTIVATION_VT(mgpu__gelu_vt, "GELU");
MGPU__ACTIVATION_VT(mgpu__tanh_vt, "Tanh");
MGPU__ACTIVATION_VT(mgpu__sigmoid_vt, "Sigmoid");
static mgpu_layer* mgpu__activation(const mgpu_layer_vtable* vt, int forward_op, int backward_op, int uses_output) {
    mgpu__layer_cfg cfg;
    mgpu_layer* l;
    memset(&cfg, 0, sizeof cfg);
    cfg.forward_op = forward_op;
    cfg.backward_op = backward_op;
    cfg.backward_uses_output = uses_output;
    if ((l = mgpu__builtin_layer(vt, &cfg))) l->in_place_ok = uses_output;
    return l;
}
/* ReLU's backward from its output, as PyTorch's threshold_backward on the result: y > 0 exactly
   where x > 0, and relu(NaN) is NaN, so the same bits as from x, and ReLU can run in place */
MGPUDEF mgpu_layer* mgpu_layer_relu(void) { return mgpu__activation(&mgpu__relu_vt, MGPU__UNARY_RELU, MGPU__BINARY_RELU_BWD, 1); }
MGPUDEF mgpu_layer* mgpu_layer_gelu(void) { return mgpu__activation(&mgpu__gelu_vt, MGPU__UNARY_GELU, MGPU__BINARY_GELU_BWD, 0); }
MGPUDEF mgpu_layer* mgpu_layer_tanh(void) { return mgpu__activation(&mgpu__tanh_vt, MGPU__UNARY_TANH, MGPU__BINARY_TANH_BWD, 1); }
MGPUDEF mgpu_layer* mgpu_layer_sigmoid(void) { return mgpu__activation(&mgpu__sigmoid_vt, MGPU__UNARY_SIGMOID, MGPU__BINARY_SIGMOID_BWD, 1); }
/* GPT-2's GELU: type "GELU" as in PyTorch, told apart from the exact one by its description */
static void mgpu__gelu_tanh_describe(const mgpu_layer* l, char* buf, size_t size) { (void)l; snprintf(buf, size, "approximate='tanh'"); }
static const mgpu_layer_vtable mgpu__gelu_tanh_vt = { "GELU", NULL, NULL, NULL, NULL, NULL, NULL, mgpu__activation_forward,
                                                      mgpu__activation_backward, mgpu__gelu_tanh_describe, NULL, NULL, NULL };
MGPUDEF mgpu_layer* mgpu_layer_gelu_tanh(void) { return mgpu__activation(&mgpu__gelu_tanh_vt, MGPU__UNARY_GELU_TANH, MGPU__BINARY_GELU_TANH_BWD, 0); }

/* -- Dropout: a Philox mask, kept for backward; the identity when not training -- */
static mgpu_result mgpu__same_shape_aux(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)l; (void)i;
    *dt = MGPU_F32;
    *shape = x;
    return MGPU_OK;
}
static mgpu_result mgpu__dropout_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    if (!ctx->training || l->cfg.p == 0.0f) return mgpu_tensor_copy(y, x);
    /* by sample: the mask of row r is the same whichever replica holds it */
    return mgpu__dropout(y, ctx->aux[0], x, l->cfg.p, ctx->seed, ctx->seed_on_device, ctx->offset,
                         (uint64_t)ctx->first_row * (uint64_t)(mgpu_tensor_numel(x) / MGPU__MAX(x->shape.dim[0], 1)));
}
static mgpu_result mgpu__dropout_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                          const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)x; (void)y;
    if (!dx) return MGPU_OK;
    if (!ctx->training || l->cfg.p == 0.0f) return mgpu_tensor_copy(dx, dy);
    return mgpu_mul(dx, dy, ctx->aux[0]);
}
static void mgpu__dropout_describe(const mgpu_layer* l, char* buf, size_t size) { snprintf(buf, size, "p=%g", (double)l->cfg.p); }
static const mgpu_layer_vtable mgpu__dropout_vt = {
    "Dropout", NULL, NULL, NULL, NULL, mgpu__one_aux, mgpu__same_shape_aux,
    mgpu__dropout_forward, mgpu__dropout_backward, mgpu__dropout_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_dropout(float p) {
    mgpu__layer_cfg cfg;
    if (!(p >= 0.0f && p < 1.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_dropout: p = %g, want 0 <= p < 1", (double)p);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.p = p;
    {
        mgpu_layer* l = mgpu__builtin_layer(&mgpu__dropout_vt, &cfg);
        if (l) l->uses_rng = p > 0.0f;
        return l;
    }
}

/* -- Flatten: [N, ...] -> [N, rest] -- */
static mgpu_result mgpu__flatten_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    int64_t rest = 1;
    int i;
    if (x.ndim < 1) return mgpu__layer_shape_error(l, x, "a batch dimension");
    for (i = 1; i < x.ndim; ++i) rest *= x.dim[i];
    *y = mgpu_shape2(x.dim[0], rest);
    return MGPU_OK;
}
static mgpu_result mgpu__flatten_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)ctx;
    return mgpu_tensor_copy(y, x);
}
static mgpu_result mgpu__flatten_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                          const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y;
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static const mgpu_layer_vtable mgpu__flatten_vt = {
    "Flatten", mgpu__flatten_output_shape, NULL, NULL, NULL, NULL, NULL,
    mgpu__flatten_forward, mgpu__flatten_backward, NULL, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_flatten(void) {
    mgpu__layer_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    return mgpu__builtin_layer(&mgpu__flatten_vt, &cfg);
}

/* -- Conv2d: im2col, one GEMM against W [out, in*k*k], and a transpose to NCHW -- */
static mgpu_result mgpu__window_for(const mgpu_layer* l, mgpu_shape x, int channels, mgpu__window* g) {
    char want[96];
    memset(g, 0, sizeof *g);
    if (x.ndim != 4 || (channels > 0 && x.dim[1] != channels) || x.dim[2] + 2 * l->cfg.pad < l->cfg.kernel ||
        x.dim[3] + 2 * l->cfg.pad < l->cfg.kernel || x.dim[0] > 0x7fffffff || x.dim[1] * x.dim[2] * x.dim[3] > 0x7fffffff) {
        if (channels > 0) snprintf(want, sizeof want, "[batch,%d,height,width] with height and width >= %d", channels, l->cfg.kernel - 2 * l->cfg.pad);
        else snprintf(want, sizeof want, "[batch,channels,height,width] with height and width >= %d", l->cfg.kernel - 2 * l->cfg.pad);
        return mgpu__layer_shape_error(l, x, want);
    }
    g->n = (int)x.dim[0]; g->c = (int)x.dim[1]; g->h = (int)x.dim[2]; g->w = (int)x.dim[3];
    g->kh = g->kw = l->cfg.kernel;
    g->stride = l->cfg.stride;
    g->pad = l->cfg.pad;
    g->oh = (g->h + 2 * g->pad - g->kh) / g->stride + 1;
    g->ow = (g->w + 2 * g->pad - g->kw) / g->stride + 1;
    return MGPU_OK;
}
static mgpu_result mgpu__conv_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    mgpu__window g;
    MGPU__TRY(mgpu__window_for(l, x, l->cfg.in, &g));
    *y = mgpu_shape4(g.n, l->cfg.out, g.oh, g.ow);
    return MGPU_OK;
}
static mgpu_result mgpu__conv_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    *name = i == 0 ? "weight" : "bias";
    *shape = i == 0 ? mgpu_shape4(l->cfg.out, l->cfg.in, l->cfg.kernel, l->cfg.kernel) : mgpu_shape1(l->cfg.out);
    return MGPU_OK;
}
static mgpu_result mgpu__conv_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    return mgpu__init_fan_in(ctx, seed, (int64_t)l->cfg.in * l->cfg.kernel * l->cfg.kernel);
}
/* aux 0: cols [n*oh*ow, in*k*k] (kept for the weight gradient); aux 1: rows [n*oh*ow, out], the
   GEMM result before the transpose; aux 2: the input gradient's columns, same shape as cols
   (backward must not overwrite what a second backward would need). The CPU uses none of them:
   it makes each image's columns in a task's scratch, in forward and again in backward. */
static int mgpu__three_aux(const mgpu_layer* l) { (void)l; return 3; }
static mgpu_result mgpu__conv_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    mgpu__window g;
    MGPU__TRY(mgpu__window_for(l, x, l->cfg.in, &g));
    *dt = MGPU_F32;
    *shape = mgpu_shape2((int64_t)g.n * g.oh * g.ow, i == 1 ? (int64_t)l->cfg.out : (int64_t)g.c * g.kh * g.kw);
    return MGPU_OK;
}
static mgpu_result mgpu__conv_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu__window g;
    mgpu_tensor w2;
    MGPU__TRY(mgpu__window_for(l, x->shape, l->cfg.in, &g));
    if (MGPU__IS_CPU(x)) return mgpu__cpu_conv_forward(&g, l->cfg.out, x, ctx->params[0], ctx->params[1], y);
    w2 = mgpu__reshaped(ctx->params[0], mgpu_shape2(l->cfg.out, (int64_t)g.c * g.kh * g.kw));
    MGPU__TRY(mgpu__im2col(&g, x, ctx->aux[0]));
    MGPU__TRY(mgpu_matmul(ctx->aux[1], ctx->aux[0], &w2, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f));             /* [n*p, out] */
    MGPU__TRY(mgpu__transpose(g.n, (int64_t)g.oh * g.ow, l->cfg.out, ctx->aux[1], y));   /* -> [n, out, p] */
    return mgpu_bias_add(y, y, ctx->params[1]);
}
static mgpu_result mgpu__conv_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                       const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu__window g;
    mgpu_tensor w2, dw2;
    int64_t ckk;
    (void)y;
    MGPU__TRY(mgpu__window_for(l, x->shape, l->cfg.in, &g));
    if (MGPU__IS_CPU(x))
        return mgpu__cpu_conv_backward(&g, l->cfg.out, x, ctx->params[0], dy, ctx->grads[0], ctx->grads[1], dx);
    ckk = (int64_t)g.c * g.kh * g.kw;
    w2 = mgpu__reshaped(ctx->params[0], mgpu_shape2(l->cfg.out, ckk));
    dw2 = mgpu__reshaped(ctx->grads[0], mgpu_shape2(l->cfg.out, ckk));
    MGPU__TRY(mgpu__transpose(g.n, l->cfg.out, (int64_t)g.oh * g.ow, dy, ctx->aux[1]));  /* drows [n*p, out] */
    MGPU__TRY(mgpu_matmul(&dw2, ctx->aux[1], ctx->aux[0], MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));           /* dW += drows^T cols */
    MGPU__TRY(mgpu__bias_grad_add(ctx->grads[1], dy));
    if (!dx) return MGPU_OK;
    MGPU__TRY(mgpu_matmul(ctx->aux[2], ctx->aux[1], &w2, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f));             /* dcols = drows W */
    return mgpu__col2im(&g, ctx->aux[2], dx);
}
static void mgpu__conv_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "%d -> %d, kernel %d, stride %d, padding %d", l->cfg.in, l->cfg.out, l->cfg.kernel, l->cfg.stride, l->cfg.pad);
}
static const mgpu_layer_vtable mgpu__conv_vt = {
    "Conv2d", mgpu__conv_output_shape, mgpu__two_params, mgpu__conv_param_shape, mgpu__conv_init,
    mgpu__three_aux, mgpu__conv_aux_shape, mgpu__conv_forward, mgpu__conv_backward, mgpu__conv_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_conv2d(int in_channels, int out_channels, int kernel_size, int stride, int padding) {
    mgpu__layer_cfg cfg;
    mgpu_layer* l;
    if (in_channels <= 0 || out_channels <= 0 || kernel_size <= 0 || stride <= 0 || padding < 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_conv2d: channels %d -> %d, kernel %d, stride %d, padding %d: "
                   "all must be positive (padding >= 0)", in_channels, out_channels, kernel_size, stride, padding);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = in_channels; cfg.out = out_channels; cfg.kernel = kernel_size; cfg.stride = stride; cfg.pad = padding;
    if ((l = mgpu__builtin_layer(&mgpu__conv_vt, &cfg))) l->output_unused = 1;
    return l;
}

/* -- MaxPool2d (no padding, floor mode, as nn.MaxPool2d's defaults) -- */
static mgpu_result mgpu__pool_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    mgpu__window g;
    MGPU__TRY(mgpu__window_for(l, x, 0, &g));
    *y = mgpu_shape4(g.n, g.c, g.oh, g.ow);
    return MGPU_OK;
}
static mgpu_result mgpu__pool_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)i;
    *dt = MGPU_I32;
    return mgpu__pool_output_shape(l, x, shape);
}
static mgpu_result mgpu__pool_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu__window g;
    MGPU__TRY(mgpu__window_for(l, x->shape, 0, &g));
    return mgpu__maxpool(&g, x, y, ctx->aux[0]);
}
static mgpu_result mgpu__pool_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                       const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu__window g;
    (void)y;
    if (!dx) return MGPU_OK;
    MGPU__TRY(mgpu__window_for(l, x->shape, 0, &g));
    return mgpu__maxpool_backward(&g, dy, ctx->aux[0], dx);
}
static void mgpu__pool_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "kernel %d, stride %d", l->cfg.kernel, l->cfg.stride);
}
static const mgpu_layer_vtable mgpu__pool_vt = {
    "MaxPool2d", mgpu__pool_output_shape, NULL, NULL, NULL, mgpu__one_aux, mgpu__pool_aux_shape,
    mgpu__pool_forward, mgpu__pool_backward, mgpu__pool_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_maxpool2d(int kernel_size, int stride) {
    mgpu__layer_cfg cfg;
    if (kernel_size <= 0 || stride < 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_maxpool2d: kernel %d, stride %d", kernel_size, stride);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.kernel = kernel_size;
    cfg.stride = stride ? stride : kernel_size;
    return mgpu__builtin_layer(&mgpu__pool_vt, &cfg);
}

/* -- BatchNorm2d: aux 0, 1 the batch's mean and rstd per channel (for backward), 2 on a GPU
   SyncBatchNorm's numbers [3c] (mgpu__batch_norm); buffers running_mean, running_var,
   num_batches_tracked -- */
#define MGPU__BN_EPS 1e-5f       /* nn.BatchNorm2d's defaults */
#define MGPU__BN_MOMENTUM 0.1f
static mgpu_result mgpu__meet_slot(size_t doubles, double** slot);   /* >>parallel meet */
static mgpu_result mgpu__meet(int kind, int64_t channels);
enum { MGPU__MEET_STATISTICS, MGPU__MEET_SUMS };
static mgpu_result mgpu__bn_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char want[64];
    if (x.ndim != 4 || x.dim[1] != l->cfg.in) {
        snprintf(want, sizeof want, "[batch,%d,height,width]", l->cfg.in);
        return mgpu__layer_shape_error(l, x, want);
    }
    *y = x;
    return MGPU_OK;
}
static mgpu_result mgpu__bn_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    *name = i == 0 ? "weight" : "bias";
    *shape = mgpu_shape1(l->cfg.in);
    return MGPU_OK;
}
static int mgpu__bn_buffer_count(const mgpu_layer* l) { (void)l; return 3; }
static mgpu_result mgpu__bn_buffer_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    static const char* names[3] = { "running_mean", "running_var", "num_batches_tracked" };
    *name = names[i];
    if (i < 2) *shape = mgpu_shape1(l->cfg.in);
    else memset(shape, 0, sizeof *shape);   /* a scalar, as PyTorch's */
    return MGPU_OK;
}
static mgpu_result mgpu__bn_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    (void)l; (void)seed;
    MGPU__TRY(mgpu_tensor_fill(ctx->params[0], 1.0));
    MGPU__TRY(mgpu_tensor_zero(ctx->params[1]));
    if (!ctx->buffers) return MGPU_OK;   /* (a harness without buffers) */
    MGPU__TRY(mgpu_tensor_zero(ctx->buffers[0]));
    MGPU__TRY(mgpu_tensor_fill(ctx->buffers[1], 1.0));
    return mgpu_tensor_zero(ctx->buffers[2]);
}
static mgpu_result mgpu__bn_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)x;
    *dt = MGPU_F32;
    *shape = mgpu_shape1(i < 2 ? l->cfg.in : 3 * l->cfg.in);
    return MGPU_OK;
}
/* SyncBatchNorm's slot (>>parallel meet): [rows, 2c numbers] exchanged, a third c for GIVEN, and
   3c floats of staging on a GPU */
static size_t mgpu__bn_slot_doubles(int64_t c) { return (size_t)(1 + 3 * c + (3 * c + 1) / 2); }
static mgpu_result mgpu__bn_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const int64_t c = l->cfg.in, per_channel = mgpu_tensor_numel(x) / c;
    double* slot = NULL;
    float* stage;
    int64_t ch;
    if (!ctx->buffers)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "BatchNorm2d(%d): no buffers in ctx (running_mean, running_var, "
                          "num_batches_tracked: a model gives them)", l->cfg.in);
    MGPU__TRY(mgpu__meet_slot(ctx->training ? mgpu__bn_slot_doubles(c) : 0, &slot));
    if (ctx->training && !slot && per_channel <= 1)   /* (PyTorch refuses too: no variance of one value) */
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "BatchNorm2d(%d): training needs more than one value per channel, x has "
                          "%lld (batch %lld)", l->cfg.in, (long long)per_channel, (long long)x->shape.dim[0]);
    if (!slot)
        return mgpu__batch_norm(x, ctx->params[0], ctx->params[1], ctx->buffers, ctx->training ? MGPU__BN_TRAIN : MGPU__BN_EVAL,
                                MGPU__BN_MOMENTUM, MGPU__BN_EPS, ctx->aux[0], ctx->aux[1], NULL, NULL, NULL, y);
    /* SyncBatchNorm: this replica's rows' mean and squared deviations, the whole batch's from the
       meeting, and the normalisation with those */
    stage = (float*)(slot + 1 + 3 * c);
    slot[0] = (double)per_channel;
    MGPU__TRY(mgpu__batch_norm(x, ctx->params[0], ctx->params[1], ctx->buffers, MGPU__BN_STATS, MGPU__BN_MOMENTUM,
                               MGPU__BN_EPS, ctx->aux[0], ctx->aux[1], slot + 1, ctx->aux[2], stage, y));
    MGPU__TRY(mgpu__meet(MGPU__MEET_STATISTICS, c));
    if (slot[0] <= 1.0)   /* the whole batch's values per channel: the same verdict on every replica */
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "BatchNorm2d(%d): training needs more than one value per channel, the "
                          "whole batch (every replica's rows, SyncBatchNorm) has %.0f", l->cfg.in, slot[0]);
    for (ch = 0; ch < c; ++ch) {   /* [mean, rstd, unbiased variance] from [mean, squared deviations] */
        const double squares = slot[1 + c + ch];
        slot[1 + 2 * c + ch] = squares / (slot[0] - 1.0);
        slot[1 + c + ch] = 1.0 / sqrt(squares / slot[0] + (double)MGPU__BN_EPS);
    }
    return mgpu__batch_norm(x, ctx->params[0], ctx->params[1], ctx->buffers, MGPU__BN_GIVEN, MGPU__BN_MOMENTUM, MGPU__BN_EPS,
                            ctx->aux[0], ctx->aux[1], slot + 1, ctx->aux[2], stage, y);
}
static mgpu_result mgpu__bn_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                     const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    const int64_t c = l->cfg.in;
    double* slot = NULL;
    float* stage;
    int64_t ch;
    (void)y;
    if (!ctx->training)
        return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "BatchNorm2d(%d): backward after an evaluation forward (only training "
                          "mode's backward is supported)", l->cfg.in);
    MGPU__TRY(mgpu__meet_slot(mgpu__bn_slot_doubles(c), &slot));
    if (!slot)
        return mgpu__batch_norm_backward(x, dy, ctx->params[0], ctx->aux[0], ctx->aux[1], MGPU__BN_TRAIN, NULL, NULL, NULL,
                                         ctx->grads[0], ctx->grads[1], dx);
    /* SyncBatchNorm: this replica's sum(dy) and sum(dy * xhat) (its weight and bias gradients, summed
       across replicas with the others), the whole batch's means of them from the meeting, then dx */
    stage = (float*)(slot + 1 + 3 * c);
    slot[0] = (double)(mgpu_tensor_numel(x) / c);
    MGPU__TRY(mgpu__batch_norm_backward(x, dy, ctx->params[0], ctx->aux[0], ctx->aux[1], MGPU__BN_STATS, slot + 1, ctx->aux[2],
                                        stage, ctx->grads[0], ctx->grads[1], dx));
    MGPU__TRY(mgpu__meet(MGPU__MEET_SUMS, c));
    for (ch = 0; ch < 2 * c; ++ch) slot[1 + ch] /= slot[0];
    return mgpu__batch_norm_backward(x, dy, ctx->params[0], ctx->aux[0], ctx->aux[1], MGPU__BN_GIVEN, slot + 1, ctx->aux[2],
                                     stage, ctx->grads[0], ctx->grads[1], dx);
}
static void mgpu__bn_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "%d, eps=1e-05, momentum=0.1", l->cfg.in);
}
static const mgpu_layer_vtable mgpu__bn_vt = {
    "BatchNorm2d", mgpu__bn_output_shape, mgpu__two_params, mgpu__bn_param_shape, mgpu__bn_init,
    mgpu__three_aux, mgpu__bn_aux_shape, mgpu__bn_forward, mgpu__bn_backward, mgpu__bn_describe, NULL,
    mgpu__bn_buffer_count, mgpu__bn_buffer_shape
};
MGPUDEF mgpu_layer* mgpu_layer_batch_norm2d(int channels) {
    mgpu__layer_cfg cfg;
    mgpu_layer* l;
    if (channels <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_batch_norm2d: %d channels, want at least 1", channels);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = channels;
    if ((l = mgpu__builtin_layer(&mgpu__bn_vt, &cfg))) l->output_unused = 1;
    return l;
}

/* -- global average pooling: [N, C, H, W] -> [N, C], a channel sum over each plane -- */
static mgpu_result mgpu__gap_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    if (x.ndim != 4) return mgpu__layer_shape_error(l, x, "[batch,channels,height,width]");
    *y = mgpu_shape2(x.dim[0], x.dim[1]);
    return MGPU_OK;
}
static mgpu_result mgpu__gap_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const int64_t planes = x->shape.dim[0] * x->shape.dim[1], hw = x->shape.dim[2] * x->shape.dim[3];
    (void)l; (void)ctx;
    return mgpu__channel_sum("AdaptiveAvgPool2d forward", y, x, 1, planes, hw, hw ? 1.0f / (float)hw : 1.0f, 0);
}
static mgpu_result mgpu__gap_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                      const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    const int64_t planes = x->shape.dim[0] * x->shape.dim[1], hw = x->shape.dim[2] * x->shape.dim[3];
    (void)l; (void)ctx; (void)y;
    return dx ? mgpu__spread(planes, hw, dy, hw ? 1.0f / (float)hw : 1.0f, dx) : MGPU_OK;
}
static void mgpu__gap_describe(const mgpu_layer* l, char* buf, size_t size) { (void)l; snprintf(buf, size, "(1, 1), flattened"); }
static const mgpu_layer_vtable mgpu__gap_vt = {
    "AdaptiveAvgPool2d", mgpu__gap_output_shape, NULL, NULL, NULL, NULL, NULL,
    mgpu__gap_forward, mgpu__gap_backward, mgpu__gap_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_global_avg_pool2d(void) {
    mgpu__layer_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    return mgpu__builtin_layer(&mgpu__gap_vt, &cfg);
}

/* ---- >>impl layer transformer: LayerNorm, Embedding, PositionEmbedding ------------------ */
#define MGPU__LAYER_NORM_EPS 1e-5f   /* nn.LayerNorm's default, and GPT-2's */

/* "[1,3]": the coordinates of flat index i in shape s */
static const char* mgpu__index_text(mgpu_shape s, int64_t i, char* buf, size_t size) {
    int64_t at[MGPU_MAX_DIMS];
    mgpu_shape c = s;
    int d;
    for (d = s.ndim - 1; d >= 0; --d) {
        at[d] = s.dim[d] > 0 ? i % s.dim[d] : 0;
        i = s.dim[d] > 0 ? i / s.dim[d] : 0;
    }
    for (d = 0; d < s.ndim; ++d) c.dim[d] = at[d];
    return mgpu__shape_text(c, buf, size);
}

/* -- LayerNorm over the last dimension: rows of x [rows, dim], each on its own -- */
static mgpu_result mgpu__ln_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char want[64];
    if (x.ndim < 2 || x.dim[x.ndim - 1] != l->cfg.in) {
        snprintf(want, sizeof want, "[batch,...,%d]", l->cfg.in);
        return mgpu__layer_shape_error(l, x, want);
    }
    *y = x;
    return MGPU_OK;
}
static mgpu_result mgpu__ln_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    *name = i == 0 ? "weight" : "bias";
    *shape = mgpu_shape1(l->cfg.in);
    return MGPU_OK;
}
static mgpu_result mgpu__ln_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    (void)l; (void)seed;
    MGPU__TRY(mgpu_tensor_fill(ctx->params[0], 1.0));
    return mgpu_tensor_zero(ctx->params[1]);
}
/* aux 0: each row's mean, aux 1: its 1/sqrt(var + eps); x's shape without the last dimension */
static mgpu_result mgpu__ln_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)i;
    MGPU__TRY(mgpu__ln_output_shape(l, x, shape));
    shape->ndim--;
    *dt = MGPU_F32;
    return MGPU_OK;
}
/* the layer's tensors, checked: x and its twins (y, or dy and dx) on one device, mean and rstd */
static mgpu_result mgpu__ln_check(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const char* op, const mgpu_tensor* x,
                                  const char* yn, const mgpu_tensor* y, const char* zn, const mgpu_tensor* z) {
    mgpu_shape ys;
    int i;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__ln_output_shape(l, x->shape, &ys));
    MGPU__TRY(mgpu__check_like(op, yn, y, "x", x));
    if (z) MGPU__TRY(mgpu__check_like(op, zn, z, "x", x));
    for (i = 0; i < 2; ++i) {
        char text[128];
        MGPU__TRY(mgpu__check_tensor(op, i ? "bias" : "weight", ctx->params[i], MGPU_F32));
        MGPU__TRY(mgpu__check_same_device(op, i ? "bias" : "weight", ctx->params[i], "x", x));
        MGPU__TRY(mgpu__check_tensor(op, i ? "rstd" : "mean", ctx->aux[i], MGPU_F32));
        MGPU__TRY(mgpu__check_same_device(op, i ? "rstd" : "mean", ctx->aux[i], "x", x));
        if (mgpu_tensor_numel(ctx->params[i]) != l->cfg.in)
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should have %d elements", op, i ? "bias" : "weight",
                              mgpu_tensor_describe(ctx->params[i], text, sizeof text), l->cfg.in);
        if (mgpu_tensor_numel(ctx->aux[i]) != mgpu_tensor_numel(x) / l->cfg.in)
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should have one element per row of x", op,
                              i ? "rstd" : "mean", mgpu_tensor_describe(ctx->aux[i], text, sizeof text));
    }
    return MGPU_OK;
}

typedef struct mgpu__ln_job {
    int64_t rows, cols;
    const float *x, *w, *b, *dy;
    float *y, *mean, *rstd, *dx, *dw, *db;
} mgpu__ln_job;
/* rows [r0, r1): the mean and variance in double (the reference), y from their float values, the
   ones backward reads again */
static void mgpu__ln_forward_rows(void* ctx, int64_t r0, int64_t r1) {
    const mgpu__ln_job* j = (const mgpu__ln_job*)ctx;
    const int64_t n = j->cols;
    int64_t r, c;
    for (r = r0; r < r1; ++r) {
        const float* x = j->x + r * n;
        float* y = j->y + r * n;
        double s = 0.0, v = 0.0;
        float m, rs;
        for (c = 0; c < n; ++c) s += x[c];
        s /= (double)n;
        for (c = 0; c < n; ++c) v += ((double)x[c] - s) * ((double)x[c] - s);
        m = (float)s;
        rs = (float)(1.0 / sqrt(v / (double)n + (double)MGPU__LAYER_NORM_EPS));
        j->mean[r] = m;
        j->rstd[r] = rs;
        for (c = 0; c < n; ++c) y[c] = (x[c] - m) * rs * j->w[c] + j->b[c];
    }
}
/* dx of rows [r0, r1) */
static void mgpu__ln_dx_rows(void* ctx, int64_t r0, int64_t r1) {
    const mgpu__ln_job* j = (const mgpu__ln_job*)ctx;
    const int64_t n = j->cols;
    int64_t r, c;
    for (r = r0; r < r1; ++r) {
        const float *x = j->x + r * n, *dy = j->dy + r * n, m = j->mean[r], rs = j->rstd[r];
        float* dx = j->dx + r * n;
        double s1 = 0.0, s2 = 0.0;
        float a, b;
        for (c = 0; c < n; ++c) {
            const float g = dy[c] * j->w[c];
            s1 += g;
            s2 += (double)g * ((x[c] - m) * rs);
        }
        a = (float)(s1 / (double)n);
        b = (float)(s2 / (double)n);
        for (c = 0; c < n; ++c) dx[c] = rs * (dy[c] * j->w[c] - a - (x[c] - m) * rs * b);
    }
}
/* dweight and dbias of columns [c0, c1): down the rows in order, 256 columns at a time, onto the
   gradients themselves (as the bias gradient's column sums: a batch cut into micro-batches sums
   to the same bits) */
static void mgpu__ln_dparams_cols(void* ctx, int64_t c0, int64_t c1) {
    const mgpu__ln_job* j = (const mgpu__ln_job*)ctx;
    const int64_t n = j->cols;
    float sw[256], sb[256];
    int64_t a, w, r, c;
    for (a = c0; a < c1; a += w) {
        w = MGPU__MIN(c1 - a, (int64_t)256);
        for (c = 0; c < w; ++c) { sw[c] = j->dw[a + c]; sb[c] = j->db[a + c]; }
        for (r = 0; r < j->rows; ++r) {
            const float *x = j->x + r * n + a, *dy = j->dy + r * n + a, m = j->mean[r], rs = j->rstd[r];
            for (c = 0; c < w; ++c) {
                sw[c] += dy[c] * ((x[c] - m) * rs);
                sb[c] += dy[c];
            }
        }
        for (c = 0; c < w; ++c) { j->dw[a + c] = sw[c]; j->db[a + c] = sb[c]; }
    }
}
static mgpu_result mgpu__ln_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    static const char* op = "LayerNorm forward";
    mgpu__ln_job job;
    const int64_t cols = l->cfg.in, rows = mgpu_tensor_numel(x) / cols;
    MGPU__TRY(mgpu__ln_check(l, ctx, op, x, "y", y, NULL, NULL));
    MGPU__COUNT(MGPU__DEV(x), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_layer_norm(MGPU__CUDA_ARGS(MGPU__DEV(x)), rows, (int)cols, MGPU__LAYER_NORM_EPS,
                                                       MGPU__F32(x), MGPU__F32(ctx->params[0]), MGPU__F32(ctx->params[1]),
                                                       MGPU__F32(y), MGPU__F32(ctx->aux[0]), MGPU__F32(ctx->aux[1])));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.rows = rows; job.cols = cols;
    job.x = MGPU__F32(x); job.w = MGPU__F32(ctx->params[0]); job.b = MGPU__F32(ctx->params[1]);
    job.y = MGPU__F32(y); job.mean = MGPU__F32(ctx->aux[0]); job.rstd = MGPU__F32(ctx->aux[1]);
    mgpu__parallel_range(rows, MGPU__EW_MIN_PER_THREAD / cols + 1, mgpu__ln_forward_rows, &job);
    return MGPU_OK;
}
static mgpu_result mgpu__ln_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                     const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    static const char* op = "LayerNorm backward";
    mgpu__ln_job job;
    const int64_t cols = l->cfg.in, rows = mgpu_tensor_numel(x) / cols;
    int i;
    (void)y;
    MGPU__TRY(mgpu__ln_check(l, ctx, op, x, "dy", dy, "dx", dx));
    for (i = 0; i < 2; ++i) MGPU__TRY(mgpu__check_like(op, i ? "dbias" : "dweight", ctx->grads[i], "weight", ctx->params[0]));
    MGPU__COUNT(MGPU__DEV(x), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_layer_norm_backward(MGPU__CUDA_ARGS(MGPU__DEV(x)), rows, (int)cols, MGPU__F32(x),
                                                                MGPU__F32(ctx->params[0]), MGPU__F32(ctx->aux[0]),
                                                                MGPU__F32(ctx->aux[1]), MGPU__F32(dy), dx ? MGPU__F32(dx) : NULL,
                                                                MGPU__F32(ctx->grads[0]), MGPU__F32(ctx->grads[1])));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.rows = rows; job.cols = cols;
    job.x = MGPU__F32(x); job.w = MGPU__F32(ctx->params[0]); job.dy = MGPU__F32(dy);
    job.mean = MGPU__F32(ctx->aux[0]); job.rstd = MGPU__F32(ctx->aux[1]);
    job.dw = MGPU__F32(ctx->grads[0]); job.db = MGPU__F32(ctx->grads[1]);
    mgpu__parallel_range(cols, 64, mgpu__ln_dparams_cols, &job);
    if (dx) {
        job.dx = MGPU__F32(dx);
        mgpu__parallel_range(rows, MGPU__EW_MIN_PER_THREAD / cols + 1, mgpu__ln_dx_rows, &job);
    }
    return MGPU_OK;
}
static void mgpu__ln_describe(const mgpu_layer* l, char* buf, size_t size) { snprintf(buf, size, "%d, eps=1e-05", l->cfg.in); }
static const mgpu_layer_vtable mgpu__ln_vt = {
    "LayerNorm", mgpu__ln_output_shape, mgpu__two_params, mgpu__ln_param_shape, mgpu__ln_init,
    mgpu__two_aux, mgpu__ln_aux_shape, mgpu__ln_forward, mgpu__ln_backward, mgpu__ln_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_layer_norm(int dim) {
    mgpu__layer_cfg cfg;
    if (dim <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_layer_norm: dim %d must be positive", dim);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = dim;
    return mgpu__builtin_layer(&mgpu__ln_vt, &cfg);
}

/* -- Embedding: rows of weight [num, dim] picked by int32 ids -- */
static mgpu_result mgpu__emb_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    if (x.ndim < 1 || x.ndim >= MGPU_MAX_DIMS) return mgpu__layer_shape_error(l, x, "int32 ids [batch, ...] of 1 to 3 dimensions");
    *y = x;
    y->dim[y->ndim++] = l->cfg.out;
    return MGPU_OK;
}
static mgpu_result mgpu__emb_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    (void)i;
    *name = "weight";
    *shape = mgpu_shape2(l->cfg.in, l->cfg.out);
    return MGPU_OK;
}
static int mgpu__one_param(const mgpu_layer* l) { (void)l; return 1; }
/* N(0, 0.02): GPT-2's (Hugging Face's GPT2PreTrainedModel._init_weights), for both embeddings */
static mgpu_result mgpu__emb_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    (void)l;
    return mgpu_rand_normal(ctx->params[0], seed, 0, 0.0f, 0.02f);
}
/* ids int32, y (or dy) f32 [ids..., dim], weight (or its gradient) on their device; on the CPU
   every id inside [0, num) */
static mgpu_result mgpu__emb_check(const mgpu_layer* l, const char* op, const mgpu_tensor* ids, const char* yn,
                                   const mgpu_tensor* y, const char* wn, const mgpu_tensor* w) {
    char ti[128], ty[128], desc[64];
    mgpu_shape ys;
    int64_t p, n;
    MGPU__TRY(mgpu__check_tensor(op, "ids", ids, MGPU_I32));
    MGPU__TRY(mgpu__emb_output_shape(l, ids->shape, &ys));
    MGPU__TRY(mgpu__check_tensor(op, yn, y, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, yn, y, "ids", ids));
    if (!mgpu_shape_equal(y->shape, ys))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should be %s for ids %s", op, yn,
                          mgpu_tensor_describe(y, ty, sizeof ty), mgpu__shape_text(ys, desc, sizeof desc),
                          mgpu_tensor_describe(ids, ti, sizeof ti));
    MGPU__TRY(mgpu__check_tensor(op, wn, w, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, wn, w, "ids", ids));
    if (mgpu_tensor_numel(w) != (int64_t)l->cfg.in * l->cfg.out)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should be [%d,%d]", op, wn,
                          mgpu_tensor_describe(w, ty, sizeof ty), l->cfg.in, l->cfg.out);
    if (!MGPU__IS_CPU(ids)) return MGPU_OK;   /* a GPU cannot look without a sync: NaN rows there */
    n = mgpu_tensor_numel(ids);
    for (p = 0; p < n; ++p) {   /* every id first: a failed call writes nothing */
        const int32_t id = MGPU__I32(ids)[p];
        if (id < 0 || id >= l->cfg.in)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: id %d at position %s of ids %s is outside [0, %d) "
                              "(num_embeddings)", op, (int)id, mgpu__index_text(ids->shape, p, desc, sizeof desc),
                              mgpu_tensor_describe(ids, ti, sizeof ti), l->cfg.in);
    }
    return MGPU_OK;
}
typedef struct mgpu__emb_job { int64_t n, dim; const int32_t* ids; const float* src; float* dst; } mgpu__emb_job;
static void mgpu__emb_forward_range(void* ctx, int64_t p0, int64_t p1) {
    const mgpu__emb_job* j = (const mgpu__emb_job*)ctx;
    int64_t p;
    for (p = p0; p < p1; ++p) memcpy(j->dst + p * j->dim, j->src + (int64_t)j->ids[p] * j->dim, (size_t)j->dim * sizeof(float));
}
/* columns [c0, c1) of dweight: the positions in order, each adding its dy row onto its id's row
   (the GPU's order, so the same bits) */
static void mgpu__emb_backward_cols(void* ctx, int64_t c0, int64_t c1) {
    const mgpu__emb_job* j = (const mgpu__emb_job*)ctx;
    int64_t p, c;
    for (p = 0; p < j->n; ++p) {
        const float* dy = j->src + p * j->dim;
        float* dw = j->dst + (int64_t)j->ids[p] * j->dim;
        for (c = c0; c < c1; ++c) dw[c] += dy[c];
    }
}
static mgpu_result mgpu__emb_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    static const char* op = "Embedding forward";
    mgpu__emb_job job;
    MGPU__TRY(mgpu__emb_check(l, op, x, "y", y, "weight", ctx->params[0]));
    MGPU__COUNT(MGPU__DEV(x), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_embedding(MGPU__CUDA_ARGS(MGPU__DEV(x)), mgpu_tensor_numel(x), l->cfg.in, l->cfg.out,
                                                      MGPU__I32(x), MGPU__F32(ctx->params[0]), MGPU__F32(y)));
        return MGPU_OK;
    }
    job.n = mgpu_tensor_numel(x); job.dim = l->cfg.out;
    job.ids = MGPU__I32(x); job.src = MGPU__F32(ctx->params[0]); job.dst = MGPU__F32(y);
    mgpu__parallel_range(job.n, MGPU__EW_MIN_PER_THREAD / job.dim + 1, mgpu__emb_forward_range, &job);
    return MGPU_OK;
}
/* dx is left untouched: ids have no gradient */
static mgpu_result mgpu__emb_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                      const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    static const char* op = "Embedding backward";
    mgpu__emb_job job;
    (void)y; (void)dx;
    MGPU__TRY(mgpu__emb_check(l, op, x, "dy", dy, "dweight", ctx->grads[0]));
    MGPU__COUNT(MGPU__DEV(x), ops, 1);
    if (!MGPU__IS_CPU(x)) {
        MGPU__CU(op, MGPU__DEV(x), mgpu__cu_embedding_backward(MGPU__CUDA_ARGS(MGPU__DEV(x)), mgpu_tensor_numel(x), l->cfg.in,
                                                               l->cfg.out, MGPU__I32(x), MGPU__F32(dy), MGPU__F32(ctx->grads[0])));
        return MGPU_OK;
    }
    job.n = mgpu_tensor_numel(x); job.dim = l->cfg.out;
    job.ids = MGPU__I32(x); job.src = MGPU__F32(dy); job.dst = MGPU__F32(ctx->grads[0]);
    mgpu__parallel_range(job.dim, 64, mgpu__emb_backward_cols, &job);
    return MGPU_OK;
}
static void mgpu__emb_describe(const mgpu_layer* l, char* buf, size_t size) { snprintf(buf, size, "%d, %d", l->cfg.in, l->cfg.out); }
static const mgpu_layer_vtable mgpu__emb_vt = {
    "Embedding", mgpu__emb_output_shape, mgpu__one_param, mgpu__emb_param_shape, mgpu__emb_init,
    NULL, NULL, mgpu__emb_forward, mgpu__emb_backward, mgpu__emb_describe, NULL, NULL, NULL
};
/* Embedding and PositionEmbedding: a weight table [rows, dim] (cfg.in, cfg.out) */
static mgpu_layer* mgpu__table_layer(const char* op, const char* rows_name, const mgpu_layer_vtable* vt, int rows, int dim) {
    mgpu__layer_cfg cfg;
    if (rows <= 0 || dim <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %s %d and dim %d must be positive", op, rows_name, rows, dim);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = rows;
    cfg.out = dim;
    return mgpu__builtin_layer(vt, &cfg);
}
MGPUDEF mgpu_layer* mgpu_layer_embedding(int num_embeddings, int dim) {
    return mgpu__table_layer("mgpu_layer_embedding", "num_embeddings", &mgpu__emb_vt, num_embeddings, dim);
}

/* -- PositionEmbedding: y = x + weight[t]. Rows 0..T-1 of the weight are its first T*dim floats,
   so this is a bias [T*dim] added to x seen as [batch, T*dim], and its gradient that bias's -- */
static mgpu_result mgpu__pos_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char want[96];
    if (x.ndim != 3 || x.dim[1] > l->cfg.in || x.dim[2] != l->cfg.out) {
        snprintf(want, sizeof want, "[batch,T,%d] with T <= max_positions %d", l->cfg.out, l->cfg.in);
        return mgpu__layer_shape_error(l, x, want);
    }
    *y = x;
    return MGPU_OK;
}
/* x [batch, T, dim], y (or dy) like it, the weight (or its gradient) wn f32 [max_positions, dim] on x's device */
static mgpu_result mgpu__pos_check(const mgpu_layer* l, const char* op, const mgpu_tensor* x, const char* yn,
                                   const mgpu_tensor* y, const char* wn, const mgpu_tensor* w) {
    char text[128];
    mgpu_shape ys;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__pos_output_shape(l, x->shape, &ys));
    MGPU__TRY(mgpu__check_like(op, yn, y, "x", x));
    MGPU__TRY(mgpu__check_tensor(op, wn, w, MGPU_F32));
    MGPU__TRY(mgpu__check_same_device(op, wn, w, "x", x));
    if (mgpu_tensor_numel(w) != (int64_t)l->cfg.in * l->cfg.out)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s should be [%d,%d]", op, wn,
                          mgpu_tensor_describe(w, text, sizeof text), l->cfg.in, l->cfg.out);
    return MGPU_OK;
}
static mgpu_result mgpu__pos_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_tensor x2, y2, w;
    MGPU__TRY(mgpu__pos_check(l, "PositionEmbedding forward", x, "y", y, "weight", ctx->params[0]));
    x2 = mgpu__reshaped(x, mgpu_shape2(x->shape.dim[0], x->shape.dim[1] * x->shape.dim[2]));
    y2 = mgpu__reshaped(y, x2.shape);
    w = mgpu__reshaped(ctx->params[0], mgpu_shape1(x2.shape.dim[1]));   /* rows 0..T-1 */
    return mgpu_bias_add(&y2, &x2, &w);
}
static mgpu_result mgpu__pos_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                      const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    static const char* op = "PositionEmbedding backward";
    mgpu_tensor dy2, dw;
    (void)y;
    MGPU__TRY(mgpu__pos_check(l, op, x, "dy", dy, "dweight", ctx->grads[0]));
    if (dx) MGPU__TRY(mgpu__check_like(op, "dx", dx, "x", x));
    dy2 = mgpu__reshaped(dy, mgpu_shape2(x->shape.dim[0], x->shape.dim[1] * x->shape.dim[2]));
    dw = mgpu__reshaped(ctx->grads[0], mgpu_shape1(dy2.shape.dim[1]));
    MGPU__TRY(mgpu__bias_grad_add(&dw, &dy2));   /* dweight[t] += sum over the batch of dy[b, t], in order */
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static const mgpu_layer_vtable mgpu__pos_vt = {
    "PositionEmbedding", mgpu__pos_output_shape, mgpu__one_param, mgpu__emb_param_shape, mgpu__emb_init,
    NULL, NULL, mgpu__pos_forward, mgpu__pos_backward, mgpu__emb_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_position_embedding(int max_positions, int dim) {
    return mgpu__table_layer("mgpu_layer_position_embedding", "max_positions", &mgpu__pos_vt, max_positions, dim);
}


/* ---- >>layer transformer ---- */
/* -- CausalSelfAttention: cfg.in = dim, cfg.out = heads, cfg.p = dropout. The projections are
   GEMMs on [batch*T, ...] views; the core is mgpu__attention_forward/backward. Aux buffers, from
   forward to backward: qkv, lse [batch, heads, T] (the softmax rows' log denominators), y (heads
   merged, c_proj's input), and with dropout the residual mask (the attention mask is drawn again
   in backward). No T x T buffer: a step's activations grow with T, not T^2. Backward's scratch is
   temporaries from the device's cache, for its call only: dy (into the heads), dqkv, drow [batch,
   heads, T] and, with dropout, d out before the residual dropout. Backward never writes forward's
   buffers, so a second backward after one forward adds the same gradients again. -- */
enum {
    MGPU__ATTN_QKV, MGPU__ATTN_LSE, MGPU__ATTN_Y,                /* kept from forward */
    MGPU__ATTN_OUT_MASK,                                         /* with dropout only */
    MGPU__ATTN_AUX_MAX
};
enum { MGPU__ATTN_DY, MGPU__ATTN_DQKV, MGPU__ATTN_DROW, MGPU__ATTN_DOUT, MGPU__ATTN_TEMPS };   /* backward's */
/* the residual dropout's counters: past any attention dropout's (B*heads*T*T/4 of them) */
#define MGPU__ATTN_OUT_OFFSET ((uint64_t)1 << 39)

static mgpu_result mgpu__attn_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char want[64];
    if (x.ndim != 3 || x.dim[1] < 1 || x.dim[2] != l->cfg.in || x.dim[0] > 0x7fffffff || x.dim[1] > 0x7fffffff) {
        snprintf(want, sizeof want, "[batch,T,%d] with T >= 1", l->cfg.in);
        return mgpu__layer_shape_error(l, x, want);
    }
    *y = x;
    return MGPU_OK;
}
static int mgpu__attn_param_count(const mgpu_layer* l) { (void)l; return 4; }
static mgpu_result mgpu__attn_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    static const char* names[4] = { "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias" };
    const int64_t d = l->cfg.in;
    *name = names[i];
    *shape = i == 0 ? mgpu_shape2(d, 3 * d) : i == 1 ? mgpu_shape1(3 * d) : i == 2 ? mgpu_shape2(d, d) : mgpu_shape1(d);   /* [in, out] */
    return MGPU_OK;
}
/* GPT-2 (Hugging Face's _init_weights): weights N(0, 0.02), biases zero; each weight from its own
   counters. (GPT-2 also scales c_proj.weight by 1/sqrt(2 n_layer): a model's choice, not the
   layer's, which does not know n_layer.) */
static mgpu_result mgpu__attn_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    (void)l;
    MGPU__TRY(mgpu_rand_normal(ctx->params[0], seed, 0, 0.0f, 0.02f));
    MGPU__TRY(mgpu_rand_normal(ctx->params[2], seed, mgpu_rand_offsets(mgpu_tensor_numel(ctx->params[0])), 0.0f, 0.02f));
    MGPU__TRY(mgpu_tensor_zero(ctx->params[1]));
    return mgpu_tensor_zero(ctx->params[3]);
}
static int mgpu__attn_aux_count(const mgpu_layer* l) { return l->cfg.p > 0.0f ? MGPU__ATTN_AUX_MAX : MGPU__ATTN_OUT_MASK; }
static mgpu_result mgpu__attn_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    mgpu_shape y;
    MGPU__TRY(mgpu__attn_output_shape(l, x, &y));
    *dt = MGPU_F32;
    switch (i) {
    case MGPU__ATTN_QKV: *shape = mgpu_shape3(x.dim[0], x.dim[1], 3 * x.dim[2]); break;
    case MGPU__ATTN_LSE: *shape = mgpu_shape3(x.dim[0], l->cfg.out, x.dim[1]); break;
    default: *shape = x; break;   /* y, the residual mask */
    }
    return MGPU_OK;
}
/* The geometry, after the checks that keep a hand-made ctx (a harness calling the vtable) from
   reading past a tensor: x [batch, T, dim], `y` (y or dy) and dx (may be NULL) of x's shape, and
   every aux buffer f32 of aux_shape's shape on x's device (the GEMMs see 2-D views of them). */
static mgpu_result mgpu__attn_geometry(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const char* pass, const mgpu_tensor* x,
                                       const char* yn, const mgpu_tensor* y, const mgpu_tensor* dx, mgpu__attn* g) {
    char op[96], name[24], ta[128], ts[64], tx[64];
    mgpu_shape ys, want;
    mgpu_dtype dt;
    int i;
    snprintf(op, sizeof op, "CausalSelfAttention(dim %d, heads %d) %s", l->cfg.in, l->cfg.out, pass);
    MGPU__TRY(mgpu__check_tensor(op, "x", x, MGPU_F32));
    MGPU__TRY(mgpu__attn_output_shape(l, x->shape, &ys));
    MGPU__TRY(mgpu__check_like(op, yn, y, "x", x));
    if (dx) MGPU__TRY(mgpu__check_like(op, "dx", dx, "x", x));
    if (!ctx || !ctx->aux || !ctx->params || !ctx->grads)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the ctx lacks its params, grads or aux buffers", op);
    for (i = 0; i < mgpu__attn_aux_count(l); ++i) {
        MGPU__TRY(mgpu__attn_aux_shape(l, i, x->shape, &dt, &want));
        snprintf(name, sizeof name, "aux[%d]", i);
        MGPU__TRY(mgpu__check_tensor(op, name, ctx->aux[i], dt));
        MGPU__TRY(mgpu__check_same_device(op, name, ctx->aux[i], "x", x));
        if (!mgpu_shape_equal(ctx->aux[i]->shape, want))
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: %s %s, expected %s for x %s", op, name,
                              mgpu_tensor_describe(ctx->aux[i], ta, sizeof ta), mgpu__shape_text(want, ts, sizeof ts),
                              mgpu__shape_text(x->shape, tx, sizeof tx));
    }
    g->batch = (int)x->shape.dim[0];
    g->t = (int)x->shape.dim[1];
    g->heads = l->cfg.out;
    g->head_size = l->cfg.in / l->cfg.out;
    g->scale = 1.0f / sqrtf((float)g->head_size);
    return MGPU_OK;
}
/* The attention dropout's first counter: numbered by sample, so that row r's mask is the same
   whichever replica holds it */
static uint64_t mgpu__attn_first(const mgpu_layer_ctx* ctx, const mgpu__attn* g) {
    return (uint64_t)ctx->first_row * (uint64_t)g->heads * (uint64_t)g->t * (uint64_t)g->t;
}
static mgpu_result mgpu__attn_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu__attn g;
    mgpu_tensor x2, qkv2, y2, yh2;
    int64_t rows;
    const int drop = ctx->training && l->cfg.p > 0.0f;
    MGPU__TRY(mgpu__attn_geometry(l, ctx, "forward", x, "y", y, NULL, &g));
    rows = (int64_t)g.batch * g.t;
    x2 = mgpu__reshaped(x, mgpu_shape2(rows, l->cfg.in));
    y2 = mgpu__reshaped(y, mgpu_shape2(rows, l->cfg.in));
    qkv2 = mgpu__reshaped(ctx->aux[MGPU__ATTN_QKV], mgpu_shape2(rows, 3 * (int64_t)l->cfg.in));
    yh2 = mgpu__reshaped(ctx->aux[MGPU__ATTN_Y], mgpu_shape2(rows, l->cfg.in));
    MGPU__TRY(mgpu_matmul(&qkv2, &x2, ctx->params[0], MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f));   /* qkv = x Wa */
    MGPU__TRY(mgpu_bias_add(&qkv2, &qkv2, ctx->params[1]));
    MGPU__TRY(mgpu__attention_forward(&g, ctx->aux[MGPU__ATTN_QKV], ctx->aux[MGPU__ATTN_Y], ctx->aux[MGPU__ATTN_LSE], ctx->seed,
                                      ctx->seed_on_device, ctx->offset, mgpu__attn_first(ctx, &g), drop ? l->cfg.p : 0.0f));
    MGPU__TRY(mgpu_matmul(&y2, &yh2, ctx->params[2], MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f));    /* out = y Wp */
    MGPU__TRY(mgpu_bias_add(&y2, &y2, ctx->params[3]));
    if (!drop) return MGPU_OK;
    return mgpu__dropout(y, ctx->aux[MGPU__ATTN_OUT_MASK], y, l->cfg.p, ctx->seed, ctx->seed_on_device,
                         ctx->offset + MGPU__ATTN_OUT_OFFSET, (uint64_t)ctx->first_row * (uint64_t)g.t * (uint64_t)l->cfg.in);
}
/* backward with its temporaries t (MGPU__ATTN_TEMPS of them; d out only with dropout) */
static mgpu_result mgpu__attn_backward_in(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu__attn* g,
                                          const mgpu_tensor* x, const mgpu_tensor* dy, mgpu_tensor* dx, mgpu_tensor* const* t) {
    mgpu_tensor x2, dout2, yh2, dyh2, dqkv2, dx2;
    const mgpu_tensor* dout = dy;
    const int64_t rows = (int64_t)g->batch * g->t;
    const int drop = ctx->training && l->cfg.p > 0.0f;
    if (drop) {   /* through the residual dropout */
        MGPU__TRY(mgpu_mul(t[MGPU__ATTN_DOUT], dy, ctx->aux[MGPU__ATTN_OUT_MASK]));
        dout = t[MGPU__ATTN_DOUT];
    }
    x2 = mgpu__reshaped(x, mgpu_shape2(rows, l->cfg.in));
    dout2 = mgpu__reshaped(dout, mgpu_shape2(rows, l->cfg.in));
    yh2 = mgpu__reshaped(ctx->aux[MGPU__ATTN_Y], mgpu_shape2(rows, l->cfg.in));
    dyh2 = mgpu__reshaped(t[MGPU__ATTN_DY], mgpu_shape2(rows, l->cfg.in));
    dqkv2 = mgpu__reshaped(t[MGPU__ATTN_DQKV], mgpu_shape2(rows, 3 * (int64_t)l->cfg.in));
    MGPU__TRY(mgpu_matmul(ctx->grads[2], &yh2, &dout2, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));   /* dWp += y^T dout */
    MGPU__TRY(mgpu__bias_grad_add(ctx->grads[3], &dout2));
    MGPU__TRY(mgpu_matmul(&dyh2, &dout2, ctx->params[2], MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f));  /* dy = dout Wp^T */
    MGPU__TRY(mgpu__attention_backward(g, ctx->aux[MGPU__ATTN_QKV], ctx->aux[MGPU__ATTN_Y], ctx->aux[MGPU__ATTN_LSE],
                                       t[MGPU__ATTN_DY], t[MGPU__ATTN_DROW], t[MGPU__ATTN_DQKV], ctx->seed,
                                       ctx->seed_on_device, ctx->offset, mgpu__attn_first(ctx, g), drop ? l->cfg.p : 0.0f));
    MGPU__TRY(mgpu_matmul(ctx->grads[0], &x2, &dqkv2, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));    /* dWa += x^T dqkv */
    MGPU__TRY(mgpu__bias_grad_add(ctx->grads[1], &dqkv2));
    if (!dx) return MGPU_OK;
    dx2 = mgpu__reshaped(dx, mgpu_shape2(rows, l->cfg.in));
    return mgpu_matmul(&dx2, &dqkv2, ctx->params[0], MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f);  /* dx = dqkv Wa^T */
}
static mgpu_result mgpu__attn_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                       const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu__attn g;
    mgpu_tensor* t[MGPU__ATTN_TEMPS] = { NULL, NULL, NULL, NULL };
    mgpu_shape shape[MGPU__ATTN_TEMPS];
    mgpu_result r = MGPU_OK;
    int i;
    (void)y;
    MGPU__TRY(mgpu__attn_geometry(l, ctx, "backward", x, "dy", dy, dx, &g));
    shape[MGPU__ATTN_DY] = shape[MGPU__ATTN_DOUT] = x->shape;
    shape[MGPU__ATTN_DQKV] = ctx->aux[MGPU__ATTN_QKV]->shape;
    shape[MGPU__ATTN_DROW] = ctx->aux[MGPU__ATTN_LSE]->shape;
    for (i = 0; i < MGPU__ATTN_TEMPS && r == MGPU_OK; ++i) {
        if (i == MGPU__ATTN_DOUT && !(ctx->training && l->cfg.p > 0.0f)) continue;   /* no residual dropout */
        if (!(t[i] = mgpu_tensor_create(MGPU__DEV(x), MGPU_F32, shape[i]))) r = mgpu_last_result();
    }
    if (r == MGPU_OK) r = mgpu__attn_backward_in(l, ctx, &g, x, dy, dx, t);
    for (i = 0; i < MGPU__ATTN_TEMPS; ++i) mgpu_tensor_destroy(t[i]);
    return r;
}
static void mgpu__attn_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "dim %d, heads %d, dropout %g", l->cfg.in, l->cfg.out, (double)l->cfg.p);
}
static const mgpu_layer_vtable mgpu__attn_vt = {
    "CausalSelfAttention", mgpu__attn_output_shape, mgpu__attn_param_count, mgpu__attn_param_shape, mgpu__attn_init,
    mgpu__attn_aux_count, mgpu__attn_aux_shape, mgpu__attn_forward, mgpu__attn_backward, mgpu__attn_describe, NULL, NULL, NULL
};
MGPUDEF mgpu_layer* mgpu_layer_causal_self_attention(int dim, int heads, float dropout) {
    mgpu__layer_cfg cfg;
    mgpu_layer* l;
    if (dim <= 0 || heads <= 0 || dim % heads != 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_causal_self_attention: dim %d, heads %d: both must be positive "
                   "and dim a multiple of heads (head size dim / heads)", dim, heads);
        return NULL;
    }
    if (!(dropout >= 0.0f && dropout < 1.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_causal_self_attention: dropout %g, want 0 <= dropout < 1", (double)dropout);
        return NULL;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.in = dim;
    cfg.out = heads;
    cfg.p = dropout;
    l = mgpu__builtin_layer(&mgpu__attn_vt, &cfg);
    if (l) l->uses_rng = dropout > 0.0f;
    return l;
}

/* -- calling a layer, and the containers (sequential, residual) -- */
/* A layer's output shape for x's; a shape no tensor can have (a custom layer's bug) is refused
   here, naming the layer's output_shape, so that mgpu_model_create says which layer is wrong
   instead of every step failing later in a tensor's creation. */
static mgpu_result mgpu__output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    char tx[96], ty[96], rank[64];
    const char* bad = NULL;
    int i;
    if (!l->vt->output_shape) { *y = x; return MGPU_OK; }
    MGPU__TRY(l->vt->output_shape(l, x, y));
    if (y->ndim < 1 || y->ndim > MGPU_MAX_DIMS) {
        snprintf(rank, sizeof rank, "mgpu's tensors have 1 to %d (the batch first)", MGPU_MAX_DIMS);
        bad = rank;
    }
    for (i = 0; !bad && i < y->ndim; ++i)
        if (y->dim[i] < 0 || (y->dim[i] == 0 && (i > 0 || x.ndim < 1 || x.dim[0] > 0))) bad = "a dimension is negative or 0";
    if (!bad && mgpu_shape_numel(*y) < 0) bad = "its element count overflows";
    if (!bad) return MGPU_OK;
    if (y->ndim < 0 || y->ndim > MGPU_MAX_DIMS) snprintf(ty, sizeof ty, "a shape of %d dimensions", y->ndim);
    else mgpu__shape_text(*y, ty, sizeof ty);
    return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s's output_shape gives %s for an input %s: %s", mgpu_layer_type(l), ty,
                      mgpu__shape_text(x, tx, sizeof tx), bad);
}
/* bf16 mixed precision (>>impl model, mgpu__bf16_path): a layer without bf16 code of its own
   runs its f32 code on widened copies when its activations are bf16 */
static mgpu_result mgpu__layer_run_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y);
static mgpu_result mgpu__layer_run_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                            const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx);
static mgpu_result mgpu__call_failed(const mgpu_layer* l, mgpu_result r) {
    char where[128], cfg[96] = "";
    if (l->vt->describe) l->vt->describe(l, cfg, sizeof cfg);
    snprintf(where, sizeof where, "%s(%s)", mgpu_layer_type(l), cfg);
    return mgpu__layer_refail(r, where);
}
MGPUDEF mgpu_result mgpu_layer_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_shape want;
    mgpu_result r;
    char tx[128], ty[128];
    if (!l || !ctx || !x || !y) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_forward: NULL %s",
                                                  !l ? "layer" : !ctx ? "ctx" : !x ? "x" : "y");
    if ((r = mgpu__output_shape(l, x->shape, &want)) != MGPU_OK) return mgpu__call_failed(l, r);
    if (!mgpu_shape_equal(want, y->shape))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "mgpu_layer_forward: %s on x %s gives y of shape %s, not %s", mgpu_layer_type(l),
                          mgpu_tensor_describe(x, tx, sizeof tx), mgpu__shape_text(want, ty, sizeof ty),
                          mgpu__shape_text(y->shape, tx, sizeof tx));
    mgpu_clear_error();
    r = mgpu__layer_run_forward(l, ctx, x, y);
    return r == MGPU_OK ? MGPU_OK : mgpu__call_failed(l, r);
}
MGPUDEF mgpu_result mgpu_layer_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                        const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu_result r;
    if (!l || !ctx || !x || !y || !dy) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_backward: NULL %s",
                                                         !l ? "layer" : !ctx ? "ctx" : !x ? "x" : !y ? "y" : "dy");
    mgpu_clear_error();
    r = mgpu__layer_run_backward(l, ctx, x, y, dy, dx);
    return r == MGPU_OK ? MGPU_OK : mgpu__call_failed(l, r);
}

/* A container's children and where each one's parameters and aux buffers start in its own. For a
   residual block kid 0 is f and kid 1 the shortcut (if any). Its own buffers come after the
   children's, in aux: sequential, the output of every child but the last (n - 1); residual, each
   child's output. The gradients between its children live only while its backward runs
   (temporaries from the device's cache, two at a time), as PyTorch's autograd frees them: they
   are no activation memory kept from step to step, and a GPT's blocks share them. */
typedef struct mgpu__container {
    int count, residual;
    mgpu_layer** kid;
    int* first_param;       /* [count + 1] */
    int* first_aux;         /* [count + 1]; first_aux[count]: the container's own */
    int* first_buffer;      /* [count + 1] */
    char (*names)[64];      /* the parameters' names */
    char (*bnames)[64];     /* the buffers', named as the parameters are */
} mgpu__container;

static uint64_t mgpu__mix(uint64_t x);
static const mgpu__container* mgpu__box(const mgpu_layer* l) { return (const mgpu__container*)l->user; }
static int mgpu__box_params(const mgpu_layer* l) { return mgpu__box(l)->first_param[mgpu__box(l)->count]; }
static int mgpu__box_own_aux(const mgpu__container* c) { return c->residual ? c->count : c->count - 1; }
static int mgpu__box_aux(const mgpu_layer* l) { return mgpu__box(l)->first_aux[mgpu__box(l)->count] + mgpu__box_own_aux(mgpu__box(l)); }
static mgpu_result mgpu__box_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    const mgpu__container* c = mgpu__box(l);
    int k = 0;
    const char* kid_name;
    while (i >= c->first_param[k + 1]) ++k;
    MGPU__TRY(c->kid[k]->vt->param_shape(c->kid[k], i - c->first_param[k], &kid_name, shape));
    *name = c->names[i];
    return MGPU_OK;
}
static int mgpu__box_buffers(const mgpu_layer* l) { return mgpu__box(l)->first_buffer[mgpu__box(l)->count]; }
static mgpu_result mgpu__box_buffer_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    const mgpu__container* c = mgpu__box(l);
    int k = 0;
    const char* kid_name;
    while (i >= c->first_buffer[k + 1]) ++k;
    MGPU__TRY(c->kid[k]->vt->buffer_shape(c->kid[k], i - c->first_buffer[k], &kid_name, shape));
    *name = c->bnames[i];
    return MGPU_OK;
}
/* Child k's context: its share of the parameters, gradients and buffers, and a random stream of its
   own (a counter range picked by the path to it; the key stays the step's, which a graph reads on
   the device). */
static mgpu_layer_ctx mgpu__kid_ctx(const mgpu__container* c, const mgpu_layer_ctx* ctx, int k) {
    mgpu_layer_ctx sub = *ctx;
    sub.params = ctx->params + c->first_param[k];
    sub.params_bf16 = ctx->params_bf16 ? ctx->params_bf16 + c->first_param[k] : NULL;
    sub.grads = ctx->grads + c->first_param[k];
    sub.aux = ctx->aux + c->first_aux[k];
    sub.buffers = ctx->buffers ? ctx->buffers + c->first_buffer[k] : NULL;
    sub.offset = mgpu__mix(ctx->offset ^ mgpu__mix((uint64_t)k + 1)) << 34;   /* 2^34 counters each */
    return sub;
}
static mgpu_result mgpu__box_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    const mgpu__container* c = mgpu__box(l);
    mgpu_shape s = x, f;
    int k;
    if (c->residual) {
        char want[128], have[64];
        MGPU__TRY(mgpu__output_shape(c->kid[0], x, &f));
        if (c->count > 1) MGPU__TRY(mgpu__output_shape(c->kid[1], x, &s));
        if (!mgpu_shape_equal(f, s)) {
            snprintf(want, sizeof want, "f(x) %s and %s of the same shape", mgpu__shape_text(f, have, sizeof have),
                     c->count > 1 ? "shortcut(x)" : "x (give a shortcut layer to change it)");
            return mgpu__layer_shape_error(l, x, want);
        }
        *y = f;
        return MGPU_OK;
    }
    for (k = 0; k < c->count; ++k) MGPU__TRY(mgpu__output_shape(c->kid[k], s, &s));
    *y = s;
    return MGPU_OK;
}
static mgpu_result mgpu__box_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    const mgpu__container* c = mgpu__box(l);
    mgpu_shape in = x;
    int k;
    for (k = 0; k < c->count; ++k) {   /* a child's own: for its input shape */
        if (i < c->first_aux[k + 1]) return c->kid[k]->vt->aux_shape(c->kid[k], i - c->first_aux[k], in, dt, shape);
        if (!c->residual) MGPU__TRY(mgpu__output_shape(c->kid[k], in, &in));
    }
    i -= c->first_aux[c->count];
    *dt = l->precision;   /* the activations' dtype in its model */
    if (c->residual) return mgpu__output_shape(c->kid[i], x, shape);   /* child i's output */
    for (k = 0, in = x; k <= i; ++k) MGPU__TRY(mgpu__output_shape(c->kid[k], in, &in));
    *shape = in;   /* child i's output */
    return MGPU_OK;
}
static mgpu_result mgpu__box_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    const mgpu__container* c = mgpu__box(l);
    int k;
    for (k = 0; k < c->count; ++k) {
        const mgpu_layer_ctx sub = mgpu__kid_ctx(c, ctx, k);
        if (c->kid[k]->vt->init && (c->first_param[k + 1] > c->first_param[k] || c->first_buffer[k + 1] > c->first_buffer[k]))
            MGPU__TRY(c->kid[k]->vt->init(c->kid[k], &sub, mgpu__mix(seed ^ mgpu__mix((uint64_t)k + 1))));
    }
    return MGPU_OK;
}
static mgpu_result mgpu__box_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const mgpu__container* c = mgpu__box(l);
    mgpu_tensor* const* own = ctx->aux + c->first_aux[c->count];
    int k;
    for (k = 0; k < c->count; ++k) {
        const mgpu_layer_ctx sub = mgpu__kid_ctx(c, ctx, k);
        if (c->residual) MGPU__TRY(mgpu_layer_forward(c->kid[k], &sub, x, own[k]));
        else MGPU__TRY(mgpu_layer_forward(c->kid[k], &sub, k ? own[k - 1] : x, k < c->count - 1 ? own[k] : y));
    }
    if (c->residual) return mgpu_add(y, own[0], c->count > 1 ? own[1] : x);   /* f(x) + shortcut(x) */
    return MGPU_OK;
}
/* A gradient between a container's children, like t, from the device's cache (NULL: failed) */
static mgpu_tensor* mgpu__box_temp(const mgpu_tensor* t) { return mgpu_tensor_create(MGPU__DEV(t), t->dtype, t->shape); }
static mgpu_result mgpu__box_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                      const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    const mgpu__container* c = mgpu__box(l);
    mgpu_tensor* const* own = ctx->aux + c->first_aux[c->count];
    const int n = c->count;
    mgpu_tensor *dnext = NULL, *dcur = NULL;   /* the gradients of child k's output and input */
    mgpu_result r = MGPU_OK;
    int k;
    if (c->residual) {   /* dx = d f(x) + (dy, or d shortcut(x)): f's into dx, the shortcut's into a temporary */
        mgpu_layer_ctx sub = mgpu__kid_ctx(c, ctx, 0);
        MGPU__TRY(mgpu_layer_backward(c->kid[0], &sub, x, own[0], dy, dx));
        if (n == 1) return dx ? mgpu_add(dx, dx, dy) : MGPU_OK;
        if (dx && !(dcur = mgpu__box_temp(dx))) return mgpu_last_result();
        sub = mgpu__kid_ctx(c, ctx, 1);
        r = mgpu_layer_backward(c->kid[1], &sub, x, own[1], dy, dcur);
        if (r == MGPU_OK && dx) r = mgpu_add(dx, dx, dcur);
        mgpu_tensor_destroy(dcur);
        return r;
    }
    for (k = n - 1; k >= 0 && r == MGPU_OK; --k) {
        const mgpu_layer_ctx sub = mgpu__kid_ctx(c, ctx, k);
        dcur = !k ? dx : mgpu__box_temp(own[k - 1]);
        if (k && !dcur) r = mgpu_last_result();
        else r = mgpu_layer_backward(c->kid[k], &sub, k ? own[k - 1] : x, k < n - 1 ? own[k] : y, dnext ? dnext : dy, dcur);
        mgpu_tensor_destroy(dnext);
        dnext = k ? dcur : NULL;
    }
    mgpu_tensor_destroy(dnext);
    return r;
}
static void mgpu__box_describe(const mgpu_layer* l, char* buf, size_t size) {
    const mgpu__container* c = mgpu__box(l);
    size_t at = 0;
    int k;
    buf[0] = 0;
    for (k = 0; k < c->count && at + 1 < size; ++k) {
        int w = snprintf(buf + at, size - at, "%s%s%s", k ? (c->residual ? " + shortcut " : ", ") : "",
                         mgpu_layer_type(c->kid[k]), c->residual && k == 0 ? (c->count > 1 ? "" : " + x") : "");
        if (w < 0) break;
        at += (size_t)w;
    }
}
static void mgpu__box_destroy(mgpu_layer* l) {
    mgpu__container* c = (mgpu__container*)l->user;
    int k;
    if (!c) return;
    for (k = 0; k < c->count; ++k) mgpu__layer_free(c->kid[k]);
    MGPU_FREE(c->kid); MGPU_FREE(c->first_param); MGPU_FREE(c->first_aux); MGPU_FREE(c->names);
    MGPU_FREE(c->first_buffer); MGPU_FREE(c->bnames);
    MGPU_FREE(c);
}
static const mgpu_layer_vtable mgpu__sequential_vt = {
    "Sequential", mgpu__box_output_shape, mgpu__box_params, mgpu__box_param_shape, mgpu__box_init,
    mgpu__box_aux, mgpu__box_aux_shape, mgpu__box_forward, mgpu__box_backward, mgpu__box_describe, mgpu__box_destroy,
    mgpu__box_buffers, mgpu__box_buffer_shape
};
static const mgpu_layer_vtable mgpu__residual_vt = {
    "Residual", mgpu__box_output_shape, mgpu__box_params, mgpu__box_param_shape, mgpu__box_init,
    mgpu__box_aux, mgpu__box_aux_shape, mgpu__box_forward, mgpu__box_backward, mgpu__box_describe, mgpu__box_destroy,
    mgpu__box_buffers, mgpu__box_buffer_shape
};

/* A failed mgpu_model_create or container still owns its layers (the promise of both): destroy
   each one that no model or container owns, once, however often it appears. */
static void mgpu__drop_layers(mgpu_layer* const* layers, int count) {
    int i, j;
    for (i = 0; i < count; ++i) {
        if (!layers[i]) continue;
        for (j = 0; j < i && layers[j] != layers[i]; ++j) {}
        if (j == i && !layers[i]->owner) mgpu__layer_free(layers[i]);   /* pointers compared first: no freed one is read */
    }
}

/* Takes kids over (all freed on any failure, as mgpu_model_create does with its layers). */
static mgpu_layer* mgpu__container_make(const char* op, const mgpu_layer_vtable* vt, mgpu_layer* const* kids, int count, int residual) {
    mgpu__container* c = NULL;
    mgpu_layer* l = NULL;
    int k, j, i, ok = 1;
    for (k = 0; k < count && ok; ++k) {
        ok = kids[k] && !kids[k]->owner;
        for (j = 0; j < k && ok; ++j) ok = kids[j] != kids[k];
    }
    if (!ok || count < 1) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %s", op, count < 1 ? "no layers" :
                   "a layer is NULL (did its constructor fail?), given twice, or already another's");
        goto fail;
    }
    c = (mgpu__container*)mgpu__calloc(1, sizeof *c);
    if (c) {
        c->kid = (mgpu_layer**)mgpu__calloc((size_t)count, sizeof(mgpu_layer*));
        c->first_param = (int*)mgpu__calloc((size_t)count + 1, sizeof(int));
        c->first_aux = (int*)mgpu__calloc((size_t)count + 1, sizeof(int));
        c->first_buffer = (int*)mgpu__calloc((size_t)count + 1, sizeof(int));
    }
    if (!c || !c->kid || !c->first_param || !c->first_aux || !c->first_buffer) goto oom;
    c->count = count;
    c->residual = residual;
    for (k = 0; k < count; ++k) {
        const int pc = kids[k]->vt->param_count ? kids[k]->vt->param_count(kids[k]) : 0;
        const int ac = kids[k]->vt->aux_count ? kids[k]->vt->aux_count(kids[k]) : 0;
        const int bc = kids[k]->vt->buffer_count ? kids[k]->vt->buffer_count(kids[k]) : 0;
        c->kid[k] = kids[k];
        c->first_buffer[k + 1] = c->first_buffer[k] + bc;
        c->first_param[k + 1] = c->first_param[k] + pc;
        c->first_aux[k + 1] = c->first_aux[k] + ac;
    }
    c->names = (char(*)[64])mgpu__calloc((size_t)MGPU__MAX(c->first_param[count], 1), 64);
    c->bnames = (char(*)[64])mgpu__calloc((size_t)MGPU__MAX(c->first_buffer[count], 1), 64);
    if (!c->names || !c->bnames) goto oom;
    for (k = 0, i = 0; k < count; ++k)
        for (j = 0; j < c->first_buffer[k + 1] - c->first_buffer[k]; ++j, ++i) {
            const char* name = "buffer";
            mgpu_shape shape;
            (void)kids[k]->vt->buffer_shape(kids[k], j, &name, &shape);
            if (residual && !kids[k]->named) snprintf(c->bnames[i], 64, "%s%s", k ? "shortcut." : "", name);
            else mgpu__param_name(c->bnames[i], 64, kids[k], k, name);
        }
    for (k = 0, i = 0; k < count; ++k)
        for (j = 0; j < c->first_param[k + 1] - c->first_param[k]; ++j, ++i) {
            const char* name = "param";
            mgpu_shape shape;
            (void)kids[k]->vt->param_shape(kids[k], j, &name, &shape);
            if (residual && !kids[k]->named) snprintf(c->names[i], 64, "%s%s", k ? "shortcut." : "", name);
            else mgpu__param_name(c->names[i], 64, kids[k], k, name);
        }
    l = mgpu_layer_create(vt, c);
    if (!l) goto fail;
    l->graph_safe = 1;
    for (k = 0; k < count; ++k) {
        kids[k]->owner = (const mgpu_model*)l;   /* (owned: no model may take it) */
        l->graph_safe &= kids[k]->graph_safe;
        l->uses_rng |= kids[k]->uses_rng;
    }
    return l;
oom:
    mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
fail:
    if (c) {
        MGPU_FREE(c->kid); MGPU_FREE(c->first_param); MGPU_FREE(c->first_aux); MGPU_FREE(c->names);
        MGPU_FREE(c->first_buffer); MGPU_FREE(c->bnames); MGPU_FREE(c);
    }
    mgpu__drop_layers(kids, count);
    return NULL;
}
MGPUDEF mgpu_layer* mgpu_layer_sequential(mgpu_layer* const* layers, int count) {
    if (!layers) count = 0;
    return mgpu__container_make("mgpu_layer_sequential", &mgpu__sequential_vt, layers, count, 0);
}
MGPUDEF mgpu_layer* mgpu_layer_residual(mgpu_layer* f, mgpu_layer* shortcut) {
    mgpu_layer* kids[2];
    kids[0] = f;
    kids[1] = shortcut;
    return mgpu__container_make("mgpu_layer_residual", &mgpu__residual_vt, kids, shortcut ? 2 : 1, 1);
}


/* ---- >>impl autograd: the tape, its ops and their backward rules, layers made of ops ---- */
/* The two generic kernels' executors: every element on the CPU's pool, or one launch */
typedef struct mgpu__ad_job {
    const mgpu__map_geom* map;
    const mgpu__reduce_geom* reduce;
    const float *a, *b;
    float* out;
} mgpu__ad_job;
/* A row of the last dimension at a time: its offsets found once, then a stride per element (the
   same values as mgpu__map_element's, in a loop the compiler can keep tight) */
static void mgpu__ad_map_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__ad_job* j = (const mgpu__ad_job*)ctx;
    const mgpu__map_geom* g = j->map;
    const int64_t so = g->out[3], sa = g->a[3], sb = g->b[3], sc = g->c[3];
    const float alpha = g->alpha;
    const int op = g->op;
    int64_t i = begin, k, n, oo, oa, ob, oc;
    while (i < end) {
        n = MGPU__MIN(end - i, g->dim[3] - i % g->dim[3]);
        mgpu__map_offsets(g, i, &oo, &oa, &ob, &oc);
        if (g->cond)
            for (k = 0; k < n; ++k) j->out[oo + k * so] = g->cond[oc + k * sc] != 0.0f ? j->a[oa + k * sa] : j->b[ob + k * sb];
        else if (g->causal)   /* the masked elements of this row: columns past row + shift */
            for (k = 0; k < n; ++k)
                j->out[oo + k * so] = mgpu__map_masked(g, i + k) ? g->fill
                                      : g->binary ? mgpu__binary_apply(op, j->a[oa + k * sa], j->b[ob + k * sb], alpha)
                                                  : mgpu__unary_apply(op, j->a[oa + k * sa], alpha);
        else if (g->binary)
            for (k = 0; k < n; ++k) j->out[oo + k * so] = mgpu__binary_apply(op, j->a[oa + k * sa], j->b[ob + k * sb], alpha);
        else
            for (k = 0; k < n; ++k) j->out[oo + k * so] = mgpu__unary_apply(op, j->a[oa + k * sa], alpha);
        i += n;
    }
}
static void mgpu__ad_reduce_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__ad_job* j = (const mgpu__ad_job*)ctx;
    int64_t i;
    for (i = begin; i < end; ++i) mgpu__reduce_element(j->reduce, j->a, j->out, i);
}
static mgpu_result mgpu__ad_run_map(const char* op, mgpu_device* dev, const mgpu__map_geom* g, const float* a,
                                    const float* b, float* out) {
    const int64_t n = g->dim[0] * g->dim[1] * g->dim[2] * g->dim[3];
    mgpu__ad_job job;
    MGPU__COUNT(dev, ops, 1);
    if (dev->kind != MGPU_DEVICE_CPU) {
        MGPU__CU(op, dev, mgpu__cu_map(MGPU__CUDA_ARGS(dev), g, a, b, out));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.map = g; job.a = a; job.b = b; job.out = out;
    mgpu__parallel_range(n, MGPU__EW_MIN_PER_THREAD / 4, mgpu__ad_map_range, &job);
    return MGPU_OK;
}
static mgpu_result mgpu__ad_run_reduce(const char* op, mgpu_device* dev, const mgpu__reduce_geom* g, const float* x, float* out) {
    const int64_t n = g->out_dim[0] * g->out_dim[1] * g->out_dim[2] * g->out_dim[3];
    mgpu__ad_job job;
    MGPU__COUNT(dev, ops, 1);
    if (dev->kind != MGPU_DEVICE_CPU) {
        MGPU__CU(op, dev, mgpu__cu_reduce(MGPU__CUDA_ARGS(dev), g, x, out));
        return MGPU_OK;
    }
    memset(&job, 0, sizeof job);
    job.reduce = g; job.a = x; job.out = out;
    mgpu__parallel_range(n, 256, mgpu__ad_reduce_range, &job);
    return MGPU_OK;
}

/* A shape padded to 4 dimensions with leading 1s, and its contiguous element strides */
static void mgpu__ad_pad(mgpu_shape s, int64_t dim[4]) {
    int d;
    for (d = 0; d < 4; ++d) dim[d] = d < 4 - s.ndim ? 1 : s.dim[d - (4 - s.ndim)];
}
static void mgpu__ad_strides(const int64_t dim[4], int64_t stride[4]) {
    int64_t s = 1;
    int d;
    for (d = 3; d >= 0; --d) { stride[d] = s; s *= dim[d]; }
}
/* NumPy's broadcast of two shapes, or a shape error naming op and both operands */
static mgpu_result mgpu__ad_broadcast(const char* op, const char* an, mgpu_shape a, const char* bn, mgpu_shape b, mgpu_shape* out) {
    char ta[64], tb[64];
    int d, nd = MGPU__MAX(a.ndim, b.ndim);
    memset(out, 0, sizeof *out);
    out->ndim = nd;
    for (d = 0; d < nd; ++d) {
        const int ia = d - (nd - a.ndim), ib = d - (nd - b.ndim);
        const int64_t da = ia >= 0 ? a.dim[ia] : 1, db = ib >= 0 ? b.dim[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: '%s' %s and '%s' %s do not broadcast (dimension %d: %lld and %lld)",
                              op, an, mgpu__shape_text(a, ta, sizeof ta), bn, mgpu__shape_text(b, tb, sizeof tb), d,
                              (long long)da, (long long)db);
        out->dim[d] = da == 1 ? db : da;
    }
    return MGPU_OK;
}
/* t's element strides when broadcast to the padded shape dim: 0 along a dimension it stretches */
static void mgpu__ad_broadcast_strides(const mgpu_tensor* t, const int64_t dim[4], int64_t stride[4]) {
    int64_t dt[4];
    int d;
    mgpu__ad_pad(t->shape, dt);
    mgpu__ad_strides(dt, stride);
    for (d = 0; d < 4; ++d)
        if (dt[d] != dim[d]) stride[d] = 0;
}
/* The walk of out = f(a) or f(a, b) elementwise, a and b broadcast to out's shape (contiguous) */
static void mgpu__ad_map_geom(mgpu__map_geom* g, int binary, int code, float alpha, const mgpu_tensor* out,
                              const mgpu_tensor* a, const mgpu_tensor* b) {
    memset(g, 0, sizeof *g);
    g->op = code; g->binary = binary; g->alpha = alpha;
    mgpu__ad_pad(out->shape, g->dim);
    mgpu__ad_strides(g->dim, g->out);
    mgpu__ad_broadcast_strides(a, g->dim, g->a);
    if (b) mgpu__ad_broadcast_strides(b, g->dim, g->b);
}
static mgpu_result mgpu__ad_map(const char* op, int binary, int code, float alpha, mgpu_tensor* out,
                                const mgpu_tensor* a, const mgpu_tensor* b) {
    mgpu__map_geom g;
    mgpu__ad_map_geom(&g, binary, code, alpha, out, a, b);
    return mgpu__ad_run_map(op, MGPU__DEV(out), &g, MGPU__F32(a), b ? MGPU__F32(b) : NULL, MGPU__F32(out));
}
/* out = x, but `fill` where the column of the last two dimensions is past row + shift */
static mgpu_result mgpu__ad_causal(const char* op, mgpu_tensor* out, const mgpu_tensor* x, int64_t shift, float fill) {
    mgpu__map_geom g;
    mgpu__ad_map_geom(&g, 0, MGPU__UNARY_COPY, 0.0f, out, x, NULL);
    g.causal = 1; g.causal_shift = shift; g.fill = fill;
    return mgpu__ad_run_map(op, MGPU__DEV(out), &g, MGPU__F32(x), NULL, MGPU__F32(out));
}
/* out = the sum (times scale) or max of x over the dimensions where out's padded shape has 1 */
static mgpu_result mgpu__ad_reduce(const char* op, int max, float scale, mgpu_tensor* out, const mgpu_tensor* x) {
    mgpu__reduce_geom g;
    memset(&g, 0, sizeof g);
    g.max = max; g.scale = scale;
    mgpu__ad_pad(x->shape, g.dim);
    mgpu__ad_pad(out->shape, g.out_dim);
    return mgpu__ad_run_reduce(op, MGPU__DEV(out), &g, MGPU__F32(x), MGPU__F32(out));
}
/* Copies between x and a window of y along one axis (slice, concat): into_y 0 takes the window
   [start, start + x's length) of y into x; 1 writes x there. Same shapes elsewhere. */
static mgpu_result mgpu__ad_window(const char* op, mgpu_tensor* x, mgpu_tensor* y, int axis, int64_t start, int into_y) {
    mgpu__map_geom g;
    int64_t dy[4], sy[4], sx[4];
    const int pa = axis + 4 - x->shape.ndim;
    float* win;
    memset(&g, 0, sizeof g);
    g.op = MGPU__UNARY_COPY;
    mgpu__ad_pad(x->shape, g.dim);
    mgpu__ad_strides(g.dim, sx);
    mgpu__ad_pad(y->shape, dy);
    mgpu__ad_strides(dy, sy);
    win = MGPU__F32(y) + start * sy[pa];
    memcpy(into_y ? g.out : g.a, sy, sizeof sy);
    memcpy(into_y ? g.a : g.out, sx, sizeof sx);
    return into_y ? mgpu__ad_run_map(op, MGPU__DEV(x), &g, MGPU__F32(x), NULL, win)
                  : mgpu__ad_run_map(op, MGPU__DEV(x), &g, win, NULL, MGPU__F32(x));
}
/* out = x.permute(perm) (out's shape already permuted) */
static mgpu_result mgpu__ad_permute(const char* op, mgpu_tensor* out, const mgpu_tensor* x, const int* perm) {
    mgpu__map_geom g;
    int64_t dx[4], sx[4];
    const int nd = x->shape.ndim, pad = 4 - nd;
    int d;
    memset(&g, 0, sizeof g);
    g.op = MGPU__UNARY_COPY;
    mgpu__ad_pad(out->shape, g.dim);
    mgpu__ad_strides(g.dim, g.out);
    mgpu__ad_pad(x->shape, dx);
    mgpu__ad_strides(dx, sx);
    for (d = 0; d < 4; ++d) g.a[d] = d < pad ? 0 : sx[pad + perm[d - pad]];
    return mgpu__ad_run_map(op, MGPU__DEV(x), &g, MGPU__F32(x), NULL, MGPU__F32(out));
}
/* The rows of t seen as a matrix [rows, last dimension]: the product of the other dimensions */
static int64_t mgpu__ad_rows(const mgpu_tensor* t) {
    int64_t r = 1;
    int d;
    for (d = 0; d < t->shape.ndim - 1; ++d) r *= t->shape.dim[d];
    return r;
}
/* out (+)= op(a) @ op(b) over the last two dimensions; batched as mgpu_tape_matmul says, and
   also an out of 2 dimensions for batched a and b: the batches' products summed (the gradient of
   a matrix shared by every batch). One GEMM where the rows fold: a [..., m, k] (not transposed)
   with b 2-D; and a 2-D out from a^T b with a and b batched alike. */
static mgpu_result mgpu__ad_gemm(const char* op, mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b,
                                 mgpu_transpose ta, mgpu_transpose tb, float beta) {
    const int na = a->shape.ndim, nb = b->shape.ndim, no = out->shape.ndim;
    mgpu_tensor *va = NULL, *vb = NULL, *vo = NULL;
    mgpu_result r = MGPU_OK;
    int64_t batch = 1, i, sa, sb, so;
    int d;
    if (na == 2 && nb == 2 && no == 2) return mgpu_matmul(out, a, b, ta, tb, 1.0f, beta);
    if ((na > 2 && nb == 2 && no > 2 && !ta) || (na > 2 && nb > 2 && no == 2 && ta && !tb)) {   /* fold the rows */
        va = mgpu__tensor_wrap(a->storage, a->offset, MGPU_F32, mgpu_shape2(mgpu__ad_rows(a), a->shape.dim[na - 1]), op);
        vb = nb == 2 ? NULL : mgpu__tensor_wrap(b->storage, b->offset, MGPU_F32, mgpu_shape2(mgpu__ad_rows(b), b->shape.dim[nb - 1]), op);
        vo = no == 2 ? NULL : mgpu__tensor_wrap(out->storage, out->offset, MGPU_F32,
                                                mgpu_shape2(mgpu__ad_rows(out), out->shape.dim[no - 1]), op);
        r = !va || (nb > 2 && !vb) || (no > 2 && !vo) ? mgpu_last_result()
            : mgpu_matmul(vo ? vo : out, va, vb ? vb : b, ta, tb, 1.0f, beta);
        mgpu__tensor_free(va); mgpu__tensor_free(vb); mgpu__tensor_free(vo);
        return r;
    }
    {   /* a GEMM per batch; a 2-D operand is shared, a 2-D out sums */
        const mgpu_tensor* lead = na > 2 ? a : nb > 2 ? b : out;
        for (d = 0; d < lead->shape.ndim - 2; ++d) batch *= lead->shape.dim[d];
    }
    sa = na > 2 ? a->shape.dim[na - 2] * a->shape.dim[na - 1] : 0;
    sb = nb > 2 ? b->shape.dim[nb - 2] * b->shape.dim[nb - 1] : 0;
    so = no > 2 ? out->shape.dim[no - 2] * out->shape.dim[no - 1] : 0;
    for (i = 0; i < batch && r == MGPU_OK; ++i) {
        va = mgpu__tensor_wrap(a->storage, a->offset + (size_t)(i * sa) * 4, MGPU_F32, mgpu_shape2(a->shape.dim[na - 2], a->shape.dim[na - 1]), op);
        vb = mgpu__tensor_wrap(b->storage, b->offset + (size_t)(i * sb) * 4, MGPU_F32, mgpu_shape2(b->shape.dim[nb - 2], b->shape.dim[nb - 1]), op);
        vo = mgpu__tensor_wrap(out->storage, out->offset + (size_t)(i * so) * 4, MGPU_F32,
                               mgpu_shape2(out->shape.dim[no - 2], out->shape.dim[no - 1]), op);
        r = !va || !vb || !vo ? mgpu_last_result() : mgpu_matmul(vo, va, vb, ta, tb, 1.0f, so == 0 && i > 0 ? 1.0f : beta);
        mgpu__tensor_free(va); mgpu__tensor_free(vb); mgpu__tensor_free(vo);
    }
    return r;
}

/* ---- the tape ---- */
typedef enum mgpu__tape_kind {
    MGPU__TAPE_CONST, MGPU__TAPE_UNARY, MGPU__TAPE_BINARY, MGPU__TAPE_REDUCE, MGPU__TAPE_MATMUL, MGPU__TAPE_RESHAPE,
    MGPU__TAPE_PERMUTE, MGPU__TAPE_SLICE, MGPU__TAPE_CONCAT, MGPU__TAPE_GATHER, MGPU__TAPE_XENT, MGPU__TAPE_MSE,
    MGPU__TAPE_CAUSAL, MGPU__TAPE_DROPOUT, MGPU__TAPE_WHERE, MGPU__TAPE_SCATTER
} mgpu__tape_kind;
typedef struct mgpu__tape_node {
    int kind, code;              /* code: the unary or binary op; the reduction's (sum 0, mean 1, max 2) */
    const char* op;              /* the public op, for messages */
    const mgpu_tensor* in[3];    /* as given: the tape's, watched, or constants (in[2]: where's condition) */
    mgpu_tensor* out;            /* the tape's */
    mgpu_tensor* saved;          /* a loss's gradient, computed with it */
    mgpu_tensor* grad;           /* while backward runs: out's gradient */
    int64_t arg[4];              /* axis, transposes, start, permutation */
    float alpha;
    int needs_grad;              /* an input is watched or needs it */
    uint64_t version[3];         /* the inputs' storage versions when the op read them */
} mgpu__tape_node;
struct mgpu_tape {
    mgpu_device* dev;
    mgpu__tape_node* nodes;
    int count, cap;
    const mgpu_tensor** watched;
    mgpu_tensor** watched_grad;
    int watched_count, watched_cap;
    mgpu_result error;           /* the first failure of an op */
    int training;                /* dropout drops (else it is the identity) */
    uint64_t seed, offset;       /* dropout's Philox stream: call k draws from counter offset + k * 2^32 */
    const uint64_t* seed_on_device;   /* a CUDA graph's capture: where the step's seed is (ctx's) */
    uint64_t first_row;          /* a replica's first sample in the batch: dropout draws by sample */
    int64_t batch_rows;          /* the layer's samples (its input's dimension 0); 0: a tape of your own */
    uint64_t draws;              /* dropout calls so far */
};

MGPUDEF mgpu_tape* mgpu_tape_create(mgpu_device* dev) {
    mgpu_tape* tape;
    if (!dev) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_create: NULL device"); return NULL; }
    tape = (mgpu_tape*)mgpu__calloc(1, sizeof *tape);
    if (!tape) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_tape_create: out of host memory"); return NULL; }
    tape->dev = dev;
    return tape;
}
MGPUDEF void mgpu_tape_destroy(mgpu_tape* tape) {
    int i;
    if (!tape) return;
    for (i = 0; i < tape->count; ++i) {
        mgpu__tensor_free(tape->nodes[i].out);
        mgpu__tensor_free(tape->nodes[i].saved);
        mgpu__tensor_free(tape->nodes[i].grad);
    }
    for (i = 0; i < tape->watched_count; ++i) mgpu__tensor_free(tape->watched_grad[i]);
    MGPU_FREE(tape->nodes);
    MGPU_FREE(tape->watched);
    MGPU_FREE(tape->watched_grad);
    MGPU_FREE(tape);
}
MGPUDEF mgpu_result mgpu_tape_set_training(mgpu_tape* tape, int training, uint64_t seed) {
    if (!tape) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_set_training: NULL tape");
    tape->training = training != 0;
    tape->seed = seed;
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_tape_status(const mgpu_tape* tape) {
    return tape ? tape->error : mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_status: NULL tape");
}
static int mgpu__tape_watch_index(const mgpu_tape* tape, const mgpu_tensor* t) {
    int i;
    for (i = 0; i < tape->watched_count; ++i)
        if (tape->watched[i] == t) return i;
    return -1;
}
static int mgpu__tape_needs_grad(const mgpu_tape* tape, const mgpu_tensor* t) {
    return t->tape == tape ? tape->nodes[t->tape_node].needs_grad : mgpu__tape_watch_index(tape, t) >= 0;
}
MGPUDEF mgpu_result mgpu_tape_watch(mgpu_tape* tape, const mgpu_tensor* t) {
    static const char* op = "mgpu_tape_watch";
    char text[128];
    if (!tape) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL tape", op);
    MGPU__TRY(mgpu__check_tensor(op, "t", t, MGPU_F32));
    if (MGPU__DEV(t) != tape->dev)
        return mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: 't' %s is not on the tape's device %s", op,
                          mgpu_tensor_describe(t, text, sizeof text), mgpu_device_label(tape->dev));
    if (t->tape)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: 't' %s was made by a tape's op: watch the tensors you make "
                          "yourself (an op's gradient comes with backward)", op, mgpu_tensor_describe(t, text, sizeof text));
    if (mgpu__tape_watch_index(tape, t) >= 0) return MGPU_OK;
    if (tape->watched_count == tape->watched_cap) {
        const int cap = tape->watched_cap ? 2 * tape->watched_cap : 16;
        const mgpu_tensor** w = (const mgpu_tensor**)MGPU_REALLOC((void*)tape->watched, (size_t)cap * sizeof *w);
        mgpu_tensor** g;
        if (w) tape->watched = w;
        g = w ? (mgpu_tensor**)MGPU_REALLOC(tape->watched_grad, (size_t)cap * sizeof *g) : NULL;
        if (!g) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        tape->watched_grad = g;
        tape->watched_cap = cap;
    }
    tape->watched[tape->watched_count] = t;
    tape->watched_grad[tape->watched_count++] = NULL;
    return MGPU_OK;
}
MGPUDEF const mgpu_tensor* mgpu_tape_grad(mgpu_tape* tape, const mgpu_tensor* t) {
    int w;
    if (!tape || !t) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_grad: NULL %s", tape ? "tensor" : "tape"); return NULL; }
    w = mgpu__tape_watch_index(tape, t);
    if (w < 0) {
        char text[128];
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_grad: %s is not watched by this tape (mgpu_tape_watch)",
                   mgpu_tensor_describe(t, text, sizeof text));
        return NULL;
    }
    return tape->watched_grad[w];
}

/* The first failure stays the tape's (the last error names it); every later op returns NULL */
static const mgpu_tensor* mgpu__tape_failed(mgpu_tape* tape) {
    if (tape->error == MGPU_OK) tape->error = mgpu_last_result() != MGPU_OK ? mgpu_last_result() : MGPU_ERROR_INVALID_ARGUMENT;
    return NULL;
}
/* An op's input: not NULL, f32 (unless dt says), on the tape's device, not another tape's */
static int mgpu__tape_input(mgpu_tape* tape, const char* op, const char* name, const mgpu_tensor* t, mgpu_dtype dt) {
    char text[128];
    if (!t) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%s' is NULL", op, name); return 0; }
    if (mgpu__check_tensor(op, name, t, dt) != MGPU_OK) return 0;
    if (MGPU__DEV(t) != tape->dev) {
        mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: '%s' %s is not on the tape's device %s", op, name,
                   mgpu_tensor_describe(t, text, sizeof text), mgpu_device_label(tape->dev));
        return 0;
    }
    if (t->tape && t->tape != tape) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%s' %s was made by another tape", op, name, mgpu_tensor_describe(t, text, sizeof text));
        return 0;
    }
    return 1;
}
/* The checks every op starts with: the tape, its error, its inputs (b may be absent) */
static int mgpu__tape_begin(mgpu_tape* tape, const char* op, const char* an, const mgpu_tensor* a, const char* bn,
                            const mgpu_tensor* b, mgpu_dtype b_dtype) {
    if (!tape) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL tape", op); return 0; }
    if (tape->error != MGPU_OK) return 0;
    if (!mgpu__tape_input(tape, op, an, a, MGPU_F32) ||
        (bn && !mgpu__tape_input(tape, op, bn, b, b_dtype))) {
        mgpu__tape_failed(tape);
        return 0;
    }
    return 1;
}
/* A new node with its output tensor of `shape` (a view of `view_of` when given): its index, or -1 */
static int mgpu__tape_node_new(mgpu_tape* tape, const char* op, int kind, mgpu_shape shape, const mgpu_tensor* a,
                               const mgpu_tensor* b, const mgpu_tensor* view_of) {
    mgpu__tape_node* n;
    mgpu_tensor* out;
    if (tape->count == tape->cap) {
        const int cap = tape->cap ? 2 * tape->cap : 64;
        mgpu__tape_node* nodes = (mgpu__tape_node*)MGPU_REALLOC(tape->nodes, (size_t)cap * sizeof *nodes);
        if (!nodes) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); mgpu__tape_failed(tape); return -1; }
        tape->nodes = nodes;
        tape->cap = cap;
    }
    out = view_of ? mgpu__tensor_wrap(view_of->storage, view_of->offset, MGPU_F32, shape, op)
                  : mgpu_tensor_create(tape->dev, MGPU_F32, shape);
    if (!out) { mgpu__tape_failed(tape); return -1; }
    out->tape = tape;
    out->tape_node = tape->count;
    n = &tape->nodes[tape->count];
    memset(n, 0, sizeof *n);
    n->kind = kind; n->op = op; n->in[0] = a; n->in[1] = b; n->out = out;
    n->needs_grad = (a && mgpu__tape_needs_grad(tape, a)) || (b && mgpu__tape_needs_grad(tape, b));
    n->version[0] = a ? a->storage->version : 0;
    n->version[1] = b ? b->storage->version : 0;
    return tape->count++;
}
/* An op's end: its output, or the tape's failure */
static const mgpu_tensor* mgpu__tape_end(mgpu_tape* tape, int k, mgpu_result r) {
    return r == MGPU_OK ? tape->nodes[k].out : mgpu__tape_failed(tape);
}

MGPUDEF const mgpu_tensor* mgpu_tape_full(mgpu_tape* tape, mgpu_shape shape, float value) {
    int k;
    if (!tape) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_full: NULL tape"); return NULL; }
    if (tape->error != MGPU_OK) return NULL;
    if ((k = mgpu__tape_node_new(tape, "mgpu_tape_full", MGPU__TAPE_CONST, shape, NULL, NULL, NULL)) < 0) return NULL;
    return mgpu__tape_end(tape, k, mgpu_tensor_fill(tape->nodes[k].out, value));
}

/* ---- elementwise ---- */
static const mgpu_tensor* mgpu__tape_unary(mgpu_tape* tape, const char* op, int code, float alpha, const mgpu_tensor* x) {
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_UNARY, x->shape, x, NULL, NULL)) < 0) return NULL;
    tape->nodes[k].code = code;
    tape->nodes[k].alpha = alpha;
    return mgpu__tape_end(tape, k, mgpu__ad_map(op, 0, code, alpha, tape->nodes[k].out, x, NULL));
}
MGPUDEF const mgpu_tensor* mgpu_tape_exp(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_exp", MGPU__UNARY_EXP, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_log(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_log", MGPU__UNARY_LOG, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_sqrt(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_sqrt", MGPU__UNARY_SQRT, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_rsqrt(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_rsqrt", MGPU__UNARY_RSQRT, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_tanh(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_tanh", MGPU__UNARY_TANH, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_sigmoid(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_sigmoid", MGPU__UNARY_SIGMOID, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_relu(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_relu", MGPU__UNARY_RELU, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_gelu(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_gelu", MGPU__UNARY_GELU, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_gelu_tanh(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_gelu_tanh", MGPU__UNARY_GELU_TANH, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_neg(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_neg", MGPU__UNARY_NEG, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_abs(mgpu_tape* t, const mgpu_tensor* x) { return mgpu__tape_unary(t, "mgpu_tape_abs", MGPU__UNARY_ABS, 0.0f, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_pow(mgpu_tape* t, const mgpu_tensor* x, float exponent) { return mgpu__tape_unary(t, "mgpu_tape_pow", MGPU__UNARY_POW, exponent, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_scale(mgpu_tape* t, const mgpu_tensor* x, float alpha) { return mgpu__tape_unary(t, "mgpu_tape_scale", MGPU__UNARY_SCALE, alpha, x); }
MGPUDEF const mgpu_tensor* mgpu_tape_add_scalar(mgpu_tape* t, const mgpu_tensor* x, float alpha) { return mgpu__tape_unary(t, "mgpu_tape_add_scalar", MGPU__UNARY_ADD_SCALAR, alpha, x); }

static const mgpu_tensor* mgpu__tape_binary(mgpu_tape* tape, const char* op, int code, const mgpu_tensor* a, const mgpu_tensor* b) {
    mgpu_shape s;
    int k;
    if (!mgpu__tape_begin(tape, op, "a", a, "b", b, MGPU_F32)) return NULL;
    if (mgpu__ad_broadcast(op, "a", a->shape, "b", b->shape, &s) != MGPU_OK) return mgpu__tape_failed(tape);
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_BINARY, s, a, b, NULL)) < 0) return NULL;
    tape->nodes[k].code = code;
    return mgpu__tape_end(tape, k, mgpu__ad_map(op, 1, code, 0.0f, tape->nodes[k].out, a, b));
}
MGPUDEF const mgpu_tensor* mgpu_tape_add(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_add", MGPU__BINARY_ADD, a, b); }
MGPUDEF const mgpu_tensor* mgpu_tape_sub(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_sub", MGPU__BINARY_SUB, a, b); }
MGPUDEF const mgpu_tensor* mgpu_tape_mul(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_mul", MGPU__BINARY_MUL, a, b); }
MGPUDEF const mgpu_tensor* mgpu_tape_div(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_div", MGPU__BINARY_DIV, a, b); }
MGPUDEF const mgpu_tensor* mgpu_tape_maximum(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_maximum", MGPU__BINARY_MAX, a, b); }
MGPUDEF const mgpu_tensor* mgpu_tape_minimum(mgpu_tape* t, const mgpu_tensor* a, const mgpu_tensor* b) { return mgpu__tape_binary(t, "mgpu_tape_minimum", MGPU__BINARY_MIN, a, b); }

/* ---- reductions ---- */
/* x's shape with `axis` (or every axis) kept as 1, and the output's (kept or dropped) */
static mgpu_result mgpu__ad_axis(const char* op, const mgpu_tensor* x, int* axis, mgpu_shape* keep, mgpu_shape* out, int keepdim) {
    char text[128];
    int d, j = 0;
    if (*axis != MGPU_ALL_AXES && (*axis < -x->shape.ndim || *axis >= x->shape.ndim))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: axis %d of %s (it has %d dimensions; MGPU_ALL_AXES for all)",
                          op, *axis, mgpu_tensor_describe(x, text, sizeof text), x->shape.ndim);
    if (*axis < 0) *axis += x->shape.ndim;
    *keep = x->shape;
    memset(out, 0, sizeof *out);
    for (d = 0; d < x->shape.ndim; ++d) {
        const int gone = *axis == MGPU_ALL_AXES || d == *axis;
        if (gone) keep->dim[d] = 1;
        if (!gone || keepdim) out->dim[j++] = gone ? 1 : x->shape.dim[d];
    }
    out->ndim = j;
    return MGPU_OK;
}
static const mgpu_tensor* mgpu__tape_reduce(mgpu_tape* tape, const char* op, int code, const mgpu_tensor* x, int axis, int keepdim) {
    mgpu_shape keep, s;
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (mgpu__ad_axis(op, x, &axis, &keep, &s, keepdim) != MGPU_OK) return mgpu__tape_failed(tape);
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_REDUCE, s, x, NULL, NULL)) < 0) return NULL;
    tape->nodes[k].code = code;
    tape->nodes[k].arg[0] = axis;
    tape->nodes[k].alpha = code == 1 ? (float)((double)mgpu_shape_numel(keep) / (double)MGPU__MAX(mgpu_tensor_numel(x), 1)) : 1.0f;
    {   /* the output seen with the kept axes (the same elements in the same order) */
        mgpu_tensor* o = mgpu__tensor_wrap(tape->nodes[k].out->storage, tape->nodes[k].out->offset, MGPU_F32, keep, op);
        mgpu_result r = o ? mgpu__ad_reduce(op, code == 2, tape->nodes[k].alpha, o, x) : mgpu_last_result();
        mgpu__tensor_free(o);
        return mgpu__tape_end(tape, k, r);
    }
}
MGPUDEF const mgpu_tensor* mgpu_tape_sum(mgpu_tape* t, const mgpu_tensor* x, int axis, int keepdim) { return mgpu__tape_reduce(t, "mgpu_tape_sum", 0, x, axis, keepdim); }
MGPUDEF const mgpu_tensor* mgpu_tape_mean(mgpu_tape* t, const mgpu_tensor* x, int axis, int keepdim) { return mgpu__tape_reduce(t, "mgpu_tape_mean", 1, x, axis, keepdim); }
MGPUDEF const mgpu_tensor* mgpu_tape_max(mgpu_tape* t, const mgpu_tensor* x, int axis, int keepdim) { return mgpu__tape_reduce(t, "mgpu_tape_max", 2, x, axis, keepdim); }

/* x - max(x, axis), the max a constant (its gradient cancels in a softmax): the stable start */
static const mgpu_tensor* mgpu__tape_shift_max(mgpu_tape* tape, const char* op, const mgpu_tensor* x, int axis) {
    mgpu_shape keep, s;
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (axis == MGPU_ALL_AXES || mgpu__ad_axis(op, x, &axis, &keep, &s, 1) != MGPU_OK) {
        if (axis == MGPU_ALL_AXES) mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: one axis, not MGPU_ALL_AXES", op);
        return mgpu__tape_failed(tape);
    }
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_CONST, keep, NULL, NULL, NULL)) < 0) return NULL;
    if (mgpu__ad_reduce(op, 1, 1.0f, tape->nodes[k].out, x) != MGPU_OK) return mgpu__tape_failed(tape);
    return mgpu_tape_sub(tape, x, tape->nodes[k].out);
}
MGPUDEF const mgpu_tensor* mgpu_tape_softmax(mgpu_tape* tape, const mgpu_tensor* x, int axis) {
    const mgpu_tensor* e = mgpu_tape_exp(tape, mgpu__tape_shift_max(tape, "mgpu_tape_softmax", x, axis));
    return mgpu_tape_div(tape, e, mgpu_tape_sum(tape, e, axis, 1));
}
MGPUDEF const mgpu_tensor* mgpu_tape_log_softmax(mgpu_tape* tape, const mgpu_tensor* x, int axis) {
    const mgpu_tensor* z = mgpu__tape_shift_max(tape, "mgpu_tape_log_softmax", x, axis);
    return mgpu_tape_sub(tape, z, mgpu_tape_log(tape, mgpu_tape_sum(tape, mgpu_tape_exp(tape, z), axis, 1)));
}

/* ---- products and shapes ---- */
MGPUDEF const mgpu_tensor* mgpu_tape_matmul(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b,
                                            mgpu_transpose ta, mgpu_transpose tb) {
    static const char* op = "mgpu_tape_matmul";
    char x[128], y[128];
    mgpu_shape s;
    int na, nb, k, d, ok;
    int64_t m, ka, kb, n;
    if (!mgpu__tape_begin(tape, op, "a", a, "b", b, MGPU_F32)) return NULL;
    na = a->shape.ndim; nb = b->shape.ndim;
    ok = na >= 2 && nb >= 2 && (nb == 2 || (na == nb) || na == 2);
    for (d = 0; ok && na == nb && d < na - 2; ++d) ok = a->shape.dim[d] == b->shape.dim[d];
    if (!ok) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: 'a' %s and 'b' %s: want matrices, batches of them with the same leading "
                   "dimensions, or a batch and a matrix", op, mgpu_tensor_describe(a, x, sizeof x), mgpu_tensor_describe(b, y, sizeof y));
        return mgpu__tape_failed(tape);
    }
    m = a->shape.dim[na - 2 + (ta ? 1 : 0)]; ka = a->shape.dim[na - 1 - (ta ? 1 : 0)];
    kb = b->shape.dim[nb - 2 + (tb ? 1 : 0)]; n = b->shape.dim[nb - 1 - (tb ? 1 : 0)];
    if (ka != kb) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: op(a) of %s is [..,%lld,%lld] and op(b) of %s is [..,%lld,%lld]: inner "
                   "dimensions differ", op, mgpu_tensor_describe(a, x, sizeof x), (long long)m, (long long)ka,
                   mgpu_tensor_describe(b, y, sizeof y), (long long)kb, (long long)n);
        return mgpu__tape_failed(tape);
    }
    s = na > 2 ? a->shape : b->shape;
    s.dim[s.ndim - 2] = m;
    s.dim[s.ndim - 1] = n;
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_MATMUL, s, a, b, NULL)) < 0) return NULL;
    tape->nodes[k].arg[0] = ta;
    tape->nodes[k].arg[1] = tb;
    return mgpu__tape_end(tape, k, mgpu__ad_gemm(op, tape->nodes[k].out, a, b, ta, tb, 0.0f));
}
MGPUDEF const mgpu_tensor* mgpu_tape_reshape(mgpu_tape* tape, const mgpu_tensor* x, mgpu_shape shape) {
    static const char* op = "mgpu_tape_reshape";
    char a[128], b[64];
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (mgpu_shape_numel(shape) != mgpu_tensor_numel(x) || shape.ndim > MGPU_MAX_DIMS) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: %s has %lld elements, shape %s has %lld", op, mgpu_tensor_describe(x, a, sizeof a),
                   (long long)mgpu_tensor_numel(x), mgpu__shape_text(shape, b, sizeof b), (long long)mgpu_shape_numel(shape));
        return mgpu__tape_failed(tape);
    }
    return mgpu__tape_node_new(tape, op, MGPU__TAPE_RESHAPE, shape, x, NULL, x) < 0 ? NULL : tape->nodes[tape->count - 1].out;
}
MGPUDEF const mgpu_tensor* mgpu_tape_permute(mgpu_tape* tape, const mgpu_tensor* x, const int* perm) {
    static const char* op = "mgpu_tape_permute";
    char text[128];
    mgpu_shape s;
    int d, k, seen = 0;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    s = x->shape;
    for (d = 0; perm && d < x->shape.ndim; ++d) {
        if (perm[d] < 0 || perm[d] >= x->shape.ndim || (seen >> perm[d] & 1)) break;
        seen |= 1 << perm[d];
        s.dim[d] = x->shape.dim[perm[d]];
    }
    if (!perm || d < x->shape.ndim) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: perm is not a permutation of the %d dimensions of %s", op,
                   x->shape.ndim, mgpu_tensor_describe(x, text, sizeof text));
        return mgpu__tape_failed(tape);
    }
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_PERMUTE, s, x, NULL, NULL)) < 0) return NULL;
    for (d = 0; d < x->shape.ndim; ++d) tape->nodes[k].arg[0] |= (int64_t)perm[d] << (4 * d);
    return mgpu__tape_end(tape, k, mgpu__ad_permute(op, tape->nodes[k].out, x, perm));
}
MGPUDEF const mgpu_tensor* mgpu_tape_transpose(mgpu_tape* tape, const mgpu_tensor* x, int dim0, int dim1) {
    int perm[MGPU_MAX_DIMS], d, nd = x ? x->shape.ndim : 0;
    for (d = 0; d < MGPU_MAX_DIMS; ++d) perm[d] = d;
    if (dim0 < 0) dim0 += nd;
    if (dim1 < 0) dim1 += nd;
    if (x && dim0 >= 0 && dim0 < nd && dim1 >= 0 && dim1 < nd) { perm[dim0] = dim1; perm[dim1] = dim0; }
    else perm[0] = -1;   /* refused by permute, naming x */
    return mgpu_tape_permute(tape, x, perm);
}
MGPUDEF const mgpu_tensor* mgpu_tape_slice(mgpu_tape* tape, const mgpu_tensor* x, int axis, int64_t start, int64_t length) {
    static const char* op = "mgpu_tape_slice";
    char text[128];
    mgpu_shape s;
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (axis < 0) axis += x->shape.ndim;
    if (axis < 0 || axis >= x->shape.ndim || start < 0 || length < 0 || start > x->shape.dim[axis] - length) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: %lld from %lld along axis %d is outside %s", op, (long long)length,
                   (long long)start, axis, mgpu_tensor_describe(x, text, sizeof text));
        return mgpu__tape_failed(tape);
    }
    s = x->shape;
    s.dim[axis] = length;
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_SLICE, s, x, NULL, NULL)) < 0) return NULL;
    tape->nodes[k].arg[0] = axis;
    tape->nodes[k].arg[1] = start;
    return mgpu__tape_end(tape, k, mgpu__ad_window(op, tape->nodes[k].out, (mgpu_tensor*)x, axis, start, 0));
}
MGPUDEF const mgpu_tensor* mgpu_tape_concat(mgpu_tape* tape, const mgpu_tensor* a, const mgpu_tensor* b, int axis) {
    static const char* op = "mgpu_tape_concat";
    char x[128], y[128];
    mgpu_shape s;
    int k, d, ok;
    if (!mgpu__tape_begin(tape, op, "a", a, "b", b, MGPU_F32)) return NULL;
    if (axis < 0) axis += a->shape.ndim;
    ok = a->shape.ndim == b->shape.ndim && axis >= 0 && axis < a->shape.ndim;
    for (d = 0; ok && d < a->shape.ndim; ++d) ok = d == axis || a->shape.dim[d] == b->shape.dim[d];
    if (!ok) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: 'a' %s and 'b' %s along axis %d: the other dimensions must agree", op,
                   mgpu_tensor_describe(a, x, sizeof x), mgpu_tensor_describe(b, y, sizeof y), axis);
        return mgpu__tape_failed(tape);
    }
    s = a->shape;
    s.dim[axis] += b->shape.dim[axis];
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_CONCAT, s, a, b, NULL)) < 0) return NULL;
    tape->nodes[k].arg[0] = axis;
    if (mgpu__ad_window(op, (mgpu_tensor*)a, tape->nodes[k].out, axis, 0, 1) != MGPU_OK) return mgpu__tape_failed(tape);
    return mgpu__tape_end(tape, k, mgpu__ad_window(op, (mgpu_tensor*)b, tape->nodes[k].out, axis, a->shape.dim[axis], 1));
}
/* Embedding's own forward and backward, for a table [n, dim] */
static mgpu_result mgpu__ad_embedding(const mgpu_tensor* table, const mgpu_tensor* ids, mgpu_tensor* y, mgpu_tensor* dtable, const mgpu_tensor* dy) {
    mgpu_layer l;
    mgpu_layer_ctx ctx;
    mgpu_tensor* t = (mgpu_tensor*)(dtable ? dtable : table);
    memset(&l, 0, sizeof l);
    memset(&ctx, 0, sizeof ctx);
    l.vt = &mgpu__emb_vt;
    l.cfg.in = (int)table->shape.dim[0];
    l.cfg.out = (int)table->shape.dim[1];
    ctx.device = MGPU__DEV(table);
    ctx.params = &t;
    ctx.grads = &t;
    return dtable ? mgpu__emb_backward(&l, &ctx, ids, dy, dy, NULL) : mgpu__emb_forward(&l, &ctx, ids, y);
}
MGPUDEF const mgpu_tensor* mgpu_tape_gather_rows(mgpu_tape* tape, const mgpu_tensor* table, const mgpu_tensor* ids) {
    static const char* op = "mgpu_tape_gather_rows";
    char text[128];
    mgpu_shape s;
    int k;
    if (!mgpu__tape_begin(tape, op, "table", table, "ids", ids, MGPU_I32)) return NULL;
    if (table->shape.ndim != 2 || ids->shape.ndim < 1 || ids->shape.ndim > 3 || table->shape.dim[0] > INT32_MAX ||
        table->shape.dim[1] > INT32_MAX) {
        char shape[64];
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: want a table [n, dim] and ids of 1 to 3 dimensions, not %s and %s", op,
                   mgpu_tensor_describe(table, text, sizeof text), mgpu__shape_text(ids->shape, shape, sizeof shape));
        return mgpu__tape_failed(tape);
    }
    s = ids->shape;
    s.dim[s.ndim++] = table->shape.dim[1];
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_GATHER, s, table, ids, NULL)) < 0) return NULL;
    return mgpu__tape_end(tape, k, mgpu__ad_embedding(table, ids, tape->nodes[k].out, NULL, NULL));
}

MGPUDEF const mgpu_tensor* mgpu_tape_causal_mask(mgpu_tape* tape, const mgpu_tensor* x, float value) {
    static const char* op = "mgpu_tape_causal_mask";
    char text[128];
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (x->shape.ndim < 2) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: x %s: want [..., queries, keys]", op, mgpu_tensor_describe(x, text, sizeof text));
        return mgpu__tape_failed(tape);
    }
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_CAUSAL, x->shape, x, NULL, NULL)) < 0) return NULL;
    tape->nodes[k].arg[0] = x->shape.dim[x->shape.ndim - 1] - x->shape.dim[x->shape.ndim - 2];   /* keys before the first query */
    tape->nodes[k].alpha = value;
    return mgpu__tape_end(tape, k, mgpu__ad_causal(op, tape->nodes[k].out, x, tape->nodes[k].arg[0], value));
}
MGPUDEF const mgpu_tensor* mgpu_tape_where(mgpu_tape* tape, const mgpu_tensor* cond, const mgpu_tensor* a, const mgpu_tensor* b) {
    static const char* op = "mgpu_tape_where";
    mgpu_shape ab, s;
    mgpu__map_geom g;
    int k;
    if (!mgpu__tape_begin(tape, op, "a", a, "b", b, MGPU_F32)) return NULL;
    if (!mgpu__tape_input(tape, op, "cond", cond, MGPU_F32)) return mgpu__tape_failed(tape);
    if (mgpu__ad_broadcast(op, "a", a->shape, "b", b->shape, &ab) != MGPU_OK ||
        mgpu__ad_broadcast(op, "cond", cond->shape, "a and b", ab, &s) != MGPU_OK)
        return mgpu__tape_failed(tape);
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_WHERE, s, a, b, NULL)) < 0) return NULL;
    tape->nodes[k].in[2] = cond;
    tape->nodes[k].version[2] = cond->storage->version;
    mgpu__ad_map_geom(&g, 1, 0, 0.0f, tape->nodes[k].out, a, b);
    g.cond = MGPU__F32(cond);
    mgpu__ad_broadcast_strides(cond, g.dim, g.c);
    return mgpu__tape_end(tape, k, mgpu__ad_run_map(op, tape->dev, &g, MGPU__F32(a), MGPU__F32(b), MGPU__F32(tape->nodes[k].out)));
}
MGPUDEF const mgpu_tensor* mgpu_tape_dropout(mgpu_tape* tape, const mgpu_tensor* x, float p) {
    static const char* op = "mgpu_tape_dropout";
    uint64_t per_sample;
    int k;
    if (!mgpu__tape_begin(tape, op, "x", x, NULL, NULL, MGPU_F32)) return NULL;
    if (!(p >= 0.0f && p < 1.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: p = %g, want 0 <= p < 1", op, (double)p);
        return mgpu__tape_failed(tape);
    }
    if (!tape->training || p == 0.0f) return mgpu__tape_unary(tape, op, MGPU__UNARY_SCALE, 1.0f, x);   /* the identity */
    /* by sample: x's elements split evenly over the layer's samples, in their order */
    if (tape->batch_rows > 0 && mgpu_tensor_numel(x) % tape->batch_rows != 0) {
        char text[128];
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: x %s does not split evenly over the layer's %lld samples, so it cannot "
                   "draw by sample", op, mgpu_tensor_describe(x, text, sizeof text), (long long)tape->batch_rows);
        return mgpu__tape_failed(tape);
    }
    if (tape->draws >= 256) {   /* a layer's counter range (2^40) holds 256 calls of 2^32 counters */
        mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: more than 256 dropouts in one forward", op);
        return mgpu__tape_failed(tape);
    }
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_DROPOUT, x->shape, x, NULL, NULL)) < 0) return NULL;
    if (!(tape->nodes[k].saved = mgpu_tensor_create(tape->dev, MGPU_F32, x->shape))) return mgpu__tape_failed(tape);
    per_sample = (uint64_t)(mgpu_tensor_numel(x) / (tape->batch_rows > 0 ? tape->batch_rows
                                                    : MGPU__MAX(x->shape.ndim ? x->shape.dim[0] : 1, 1)));
    return mgpu__tape_end(tape, k, mgpu__dropout(tape->nodes[k].out, tape->nodes[k].saved, x, p, tape->seed, tape->seed_on_device,
                                                 tape->offset + (tape->draws++ << 32), tape->first_row * per_sample));
}

MGPUDEF const mgpu_tensor* mgpu_tape_scatter_add_rows(mgpu_tape* tape, const mgpu_tensor* src, const mgpu_tensor* ids, int64_t rows) {
    static const char* op = "mgpu_tape_scatter_add_rows";
    char text[128], t2[64];
    int k, d, ok;
    if (!mgpu__tape_begin(tape, op, "src", src, "ids", ids, MGPU_I32)) return NULL;
    ok = ids->shape.ndim >= 1 && ids->shape.ndim <= 3 && src->shape.ndim == ids->shape.ndim + 1 && rows >= 1 &&
         rows <= INT32_MAX && src->shape.dim[src->shape.ndim - 1] <= INT32_MAX;
    for (d = 0; ok && d < ids->shape.ndim; ++d) ok = src->shape.dim[d] == ids->shape.dim[d];
    if (!ok) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: want src [ids..., dim] for ids of 1 to 3 dimensions and 1 to 2^31 - 1 rows, "
                   "not src %s, ids %s, rows %lld", op, mgpu_tensor_describe(src, text, sizeof text),
                   mgpu__shape_text(ids->shape, t2, sizeof t2), (long long)rows);
        return mgpu__tape_failed(tape);
    }
    if ((k = mgpu__tape_node_new(tape, op, MGPU__TAPE_SCATTER, mgpu_shape2(rows, src->shape.dim[src->shape.ndim - 1]), src, ids,
                                 NULL)) < 0)
        return NULL;
    if (mgpu_tensor_zero(tape->nodes[k].out) != MGPU_OK) return mgpu__tape_failed(tape);
    return mgpu__tape_end(tape, k, mgpu__ad_embedding(tape->nodes[k].out, ids, NULL, tape->nodes[k].out, src));
}

/* ---- losses ---- */
static const mgpu_tensor* mgpu__tape_loss(mgpu_tape* tape, const char* op, int kind, const mgpu_tensor* pred,
                                          const char* tn, const mgpu_tensor* target, mgpu_dtype tdt) {
    mgpu_shape scalar;
    int k;
    mgpu_result r;
    if (!mgpu__tape_begin(tape, op, kind == MGPU__TAPE_XENT ? "logits" : "pred", pred, tn, target, tdt)) return NULL;
    memset(&scalar, 0, sizeof scalar);
    if ((k = mgpu__tape_node_new(tape, op, kind, scalar, pred, target, NULL)) < 0) return NULL;
    if (!(tape->nodes[k].saved = mgpu_tensor_create(tape->dev, MGPU_F32, pred->shape))) return mgpu__tape_failed(tape);
    r = kind == MGPU__TAPE_XENT ? mgpu_softmax_cross_entropy(tape->nodes[k].out, tape->nodes[k].saved, pred, target, 0.0f)
                                : mgpu_mse(tape->nodes[k].out, tape->nodes[k].saved, pred, target, 0.0f);
    return mgpu__tape_end(tape, k, r);
}
MGPUDEF const mgpu_tensor* mgpu_tape_cross_entropy(mgpu_tape* tape, const mgpu_tensor* logits, const mgpu_tensor* labels) {
    return mgpu__tape_loss(tape, "mgpu_tape_cross_entropy", MGPU__TAPE_XENT, logits, "labels", labels, MGPU_I32);
}
MGPUDEF const mgpu_tensor* mgpu_tape_mse(mgpu_tape* tape, const mgpu_tensor* pred, const mgpu_tensor* target) {
    return mgpu__tape_loss(tape, "mgpu_tape_mse", MGPU__TAPE_MSE, pred, "target", target, MGPU_F32);
}

/* ---- backward ---- */
/* Adds c, a gradient contribution the caller made (and hands over), to t's gradient */
static mgpu_result mgpu__tape_accumulate(mgpu_tape* tape, const mgpu_tensor* t, mgpu_tensor* c) {
    mgpu_tensor** slot;
    mgpu_result r;
    if (!c) return mgpu_last_result();
    if (!mgpu__tape_needs_grad(tape, t)) { mgpu__tensor_free(c); return MGPU_OK; }
    slot = t->tape == tape ? &tape->nodes[t->tape_node].grad : &tape->watched_grad[mgpu__tape_watch_index(tape, t)];
    if (!*slot) { *slot = c; return MGPU_OK; }
    r = mgpu_add(*slot, *slot, c);
    mgpu__tensor_free(c);
    return r;
}
/* A new tensor of `shape` on the tape's device holding f(a) or f(a, b) (broadcast), or NULL */
static mgpu_tensor* mgpu__ad_new_map(mgpu_tape* tape, const char* op, mgpu_shape shape, int binary, int code, float alpha,
                                     const mgpu_tensor* a, const mgpu_tensor* b) {
    mgpu_tensor* t = mgpu_tensor_create(tape->dev, MGPU_F32, shape);
    if (t && mgpu__ad_map(op, binary, code, alpha, t, a, b) != MGPU_OK) { mgpu__tensor_free(t); t = NULL; }
    return t;
}
/* g (a broadcast result's gradient) summed down to shape: a tensor of the caller's, or NULL.
   With owned, g is a temporary the caller hands over: of shape's size it is the result itself
   (seen with shape), else it is freed; without, g is copied or reduced into a new tensor. */
static mgpu_tensor* mgpu__ad_sum_to(mgpu_tape* tape, const char* op, mgpu_tensor* g, int owned, mgpu_shape shape) {
    mgpu_tensor* t;
    if (!g) return NULL;
    if (mgpu_shape_numel(shape) == mgpu_tensor_numel(g)) {   /* nothing to sum: shapes differ by leading 1s at most */
        if (!owned) return mgpu__ad_new_map(tape, op, shape, 0, MGPU__UNARY_COPY, 0.0f, g, NULL);
        g->shape = shape;
        return g;
    }
    t = mgpu_tensor_create(tape->dev, MGPU_F32, shape);
    if (t && mgpu__ad_reduce(op, 0, 1.0f, t, g) != MGPU_OK) { mgpu__tensor_free(t); t = NULL; }
    if (owned) mgpu__tensor_free(g);
    return t;
}
/* The backward rule of an elementwise op: dx from dy and x or y */
static mgpu_tensor* mgpu__ad_unary_backward(mgpu_tape* tape, const mgpu__tape_node* n) {
    const mgpu_tensor *g = n->grad, *x = n->in[0], *y = n->out;
    const mgpu_shape s = x->shape;
    switch (n->code) {
    case MGPU__UNARY_EXP: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_MUL, 0.0f, g, y);
    case MGPU__UNARY_LOG: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_DIV, 0.0f, g, x);
    case MGPU__UNARY_SQRT: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_SQRT_BWD, 0.0f, g, y);
    case MGPU__UNARY_RSQRT: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_RSQRT_BWD, 0.0f, g, y);
    case MGPU__UNARY_TANH: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_TANH_BWD, 0.0f, g, y);
    case MGPU__UNARY_SIGMOID: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_SIGMOID_BWD, 0.0f, g, y);
    case MGPU__UNARY_RELU: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_RELU_BWD, 0.0f, g, x);
    case MGPU__UNARY_GELU: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_GELU_BWD, 0.0f, g, x);
    case MGPU__UNARY_GELU_TANH: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_GELU_TANH_BWD, 0.0f, g, x);
    case MGPU__UNARY_ABS: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_ABS_BWD, 0.0f, g, x);
    case MGPU__UNARY_POW: return mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_POW_BWD, n->alpha, g, x);
    case MGPU__UNARY_NEG: return mgpu__ad_new_map(tape, n->op, s, 0, MGPU__UNARY_SCALE, -1.0f, g, NULL);
    case MGPU__UNARY_SCALE: return mgpu__ad_new_map(tape, n->op, s, 0, MGPU__UNARY_SCALE, n->alpha, g, NULL);
    default: return mgpu__ad_new_map(tape, n->op, s, 0, MGPU__UNARY_COPY, 0.0f, g, NULL);   /* add_scalar */
    }
}
/* The backward rule of a broadcasting binary op: each input's part, summed down to its shape */
static mgpu_result mgpu__ad_binary_backward(mgpu_tape* tape, const mgpu__tape_node* n) {
    const mgpu_tensor *g = n->grad, *a = n->in[0], *b = n->in[1];
    const mgpu_shape s = g->shape;
    mgpu_tensor *ga = NULL, *gb = NULL, *m = NULL;
    mgpu_result r = MGPU_OK;
    const int need_a = mgpu__tape_needs_grad(tape, a), need_b = mgpu__tape_needs_grad(tape, b);
    switch (n->code) {
    case MGPU__BINARY_ADD: case MGPU__BINARY_SUB:
        if (need_a) ga = mgpu__ad_sum_to(tape, n->op, n->grad, 0, a->shape);
        if (need_b && n->code == MGPU__BINARY_ADD) gb = mgpu__ad_sum_to(tape, n->op, n->grad, 0, b->shape);
        else if (need_b) gb = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 0, MGPU__UNARY_NEG, 0.0f, g, NULL), 1, b->shape);
        break;
    case MGPU__BINARY_MUL:
        if (need_a) ga = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_MUL, 0.0f, g, b), 1, a->shape);
        if (need_b) gb = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_MUL, 0.0f, g, a), 1, b->shape);
        break;
    case MGPU__BINARY_DIV:   /* d(a/b)/db = -(a/b)/b */
        if (need_a) ga = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_DIV, 0.0f, g, b), 1, a->shape);
        if (need_b && (m = mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_MUL, 0.0f, g, n->out)) != NULL)
            gb = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_NEG_DIV, 0.0f, m, b), 1, b->shape);
        break;
    default:   /* maximum, minimum: the mask of where a won (a tie: a) */
        m = n->code == MGPU__BINARY_MAX ? mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_GE, 0.0f, a, b)
                                        : mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_GE, 0.0f, b, a);
        if (m && mgpu__ad_map(n->op, 1, MGPU__BINARY_MUL, 0.0f, m, m, g) != MGPU_OK) { mgpu__tensor_free(m); m = NULL; }   /* g where a won */
        if (m && need_b) gb = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, s, 1, MGPU__BINARY_SUB, 0.0f, g, m), 1, b->shape);
        if (m && need_a) { ga = mgpu__ad_sum_to(tape, n->op, m, 1, a->shape); m = NULL; }
        break;
    }
    mgpu__tensor_free(m);
    if (need_a) r = mgpu__tape_accumulate(tape, a, ga);
    if (need_b && r == MGPU_OK) r = mgpu__tape_accumulate(tape, b, gb);
    else if (need_b) mgpu__tensor_free(gb);
    return r;
}
/* sum, mean: dy spread back over the reduced axes; max: to the maxima, shared equally */
static mgpu_tensor* mgpu__ad_reduce_backward(mgpu_tape* tape, const mgpu__tape_node* n) {
    const mgpu_tensor* x = n->in[0];
    mgpu_shape keep, s;
    int axis = (int)n->arg[0];
    mgpu_tensor *g = NULL, *o = NULL, *mask = NULL, *count = NULL, *c = NULL;
    if (mgpu__ad_axis(n->op, x, &axis, &keep, &s, 1) != MGPU_OK) return NULL;
    g = mgpu__tensor_wrap(n->grad->storage, n->grad->offset, MGPU_F32, keep, n->op);   /* dy with the axes kept */
    if (g && n->code != 2) c = mgpu__ad_new_map(tape, n->op, x->shape, 0, MGPU__UNARY_SCALE, n->alpha, g, NULL);
    else if (g && (o = mgpu__tensor_wrap(n->out->storage, n->out->offset, MGPU_F32, keep, n->op)) &&
             (mask = mgpu__ad_new_map(tape, n->op, x->shape, 1, MGPU__BINARY_EQ, 0.0f, x, o)) &&
             (count = mgpu_tensor_create(tape->dev, MGPU_F32, keep)) && mgpu__ad_reduce(n->op, 0, 1.0f, count, mask) == MGPU_OK &&
             mgpu__ad_map(n->op, 1, MGPU__BINARY_DIV, 0.0f, count, g, count) == MGPU_OK)
        c = mgpu__ad_new_map(tape, n->op, x->shape, 1, MGPU__BINARY_MUL, 0.0f, mask, count);
    mgpu__tensor_free(g); mgpu__tensor_free(o); mgpu__tensor_free(mask); mgpu__tensor_free(count);
    return c;
}
/* C = op(A) op(B): dA = dC op(B)^T (transposed back when A was), dB = op(A)^T dC (likewise) */
static mgpu_result mgpu__ad_matmul_backward(mgpu_tape* tape, const mgpu__tape_node* n) {
    const mgpu_tensor *g = n->grad, *a = n->in[0], *b = n->in[1];
    const mgpu_transpose ta = (mgpu_transpose)n->arg[0], tb = (mgpu_transpose)n->arg[1];
    const mgpu_transpose nt = MGPU_NO_TRANS, tr = MGPU_TRANS;
    mgpu_tensor* c;
    if (mgpu__tape_needs_grad(tape, a)) {
        if (!(c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape))) return mgpu_last_result();
        if ((!ta ? mgpu__ad_gemm(n->op, c, g, b, nt, tb ? nt : tr, 0.0f) : mgpu__ad_gemm(n->op, c, b, g, tb, tr, 0.0f)) != MGPU_OK) {
            mgpu__tensor_free(c);
            return mgpu_last_result();
        }
        MGPU__TRY(mgpu__tape_accumulate(tape, a, c));
    }
    if (mgpu__tape_needs_grad(tape, b)) {
        if (!(c = mgpu_tensor_create(tape->dev, MGPU_F32, b->shape))) return mgpu_last_result();
        if ((!tb ? mgpu__ad_gemm(n->op, c, a, g, ta ? nt : tr, nt, 0.0f) : mgpu__ad_gemm(n->op, c, g, a, tr, ta, 0.0f)) != MGPU_OK) {
            mgpu__tensor_free(c);
            return mgpu_last_result();
        }
        MGPU__TRY(mgpu__tape_accumulate(tape, b, c));
    }
    return MGPU_OK;
}
static mgpu_result mgpu__tape_node_backward(mgpu_tape* tape, const mgpu__tape_node* n) {
    const mgpu_tensor *g = n->grad, *a = n->in[0], *b = n->in[1];
    mgpu_tensor* c = NULL;
    int perm[MGPU_MAX_DIMS], d;
    switch (n->kind) {
    case MGPU__TAPE_UNARY: return mgpu__tape_accumulate(tape, a, mgpu__ad_unary_backward(tape, n));
    case MGPU__TAPE_BINARY: return mgpu__ad_binary_backward(tape, n);
    case MGPU__TAPE_REDUCE: return mgpu__tape_accumulate(tape, a, mgpu__ad_reduce_backward(tape, n));
    case MGPU__TAPE_MATMUL: return mgpu__ad_matmul_backward(tape, n);
    case MGPU__TAPE_RESHAPE:
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) && mgpu_tensor_copy(c, g) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_PERMUTE:   /* the inverse permutation */
        for (d = 0; d < a->shape.ndim; ++d) perm[n->arg[0] >> (4 * d) & 15] = d;
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) && mgpu__ad_permute(n->op, c, g, perm) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_SLICE:
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) &&
            (mgpu_tensor_zero(c) != MGPU_OK || mgpu__ad_window(n->op, (mgpu_tensor*)g, c, (int)n->arg[0], n->arg[1], 1) != MGPU_OK)) {
            mgpu__tensor_free(c);
            c = NULL;
        }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_CONCAT:
        if (mgpu__tape_needs_grad(tape, a)) {
            if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) && mgpu__ad_window(n->op, c, (mgpu_tensor*)g, (int)n->arg[0], 0, 0) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
            MGPU__TRY(mgpu__tape_accumulate(tape, a, c));
        }
        if (mgpu__tape_needs_grad(tape, b)) {
            if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, b->shape)) &&
                mgpu__ad_window(n->op, c, (mgpu_tensor*)g, (int)n->arg[0], a->shape.dim[n->arg[0]], 0) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
            MGPU__TRY(mgpu__tape_accumulate(tape, b, c));
        }
        return MGPU_OK;
    case MGPU__TAPE_GATHER:
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) &&
            (mgpu_tensor_zero(c) != MGPU_OK || mgpu__ad_embedding(a, b, NULL, c, g) != MGPU_OK)) { mgpu__tensor_free(c); c = NULL; }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_CAUSAL:   /* dy where x went through, 0 where it was masked */
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) && mgpu__ad_causal(n->op, c, g, n->arg[0], 0.0f) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_WHERE:   /* dy to a where cond holds, to b elsewhere, each summed down to its shape */
        if (mgpu__tape_needs_grad(tape, a)) {
            c = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, g->shape, 1, MGPU__BINARY_KEEP_IF, 0.0f, g, n->in[2]), 1, a->shape);
            MGPU__TRY(mgpu__tape_accumulate(tape, a, c));
        }
        if (mgpu__tape_needs_grad(tape, b)) {
            c = mgpu__ad_sum_to(tape, n->op, mgpu__ad_new_map(tape, n->op, g->shape, 1, MGPU__BINARY_DROP_IF, 0.0f, g, n->in[2]), 1, b->shape);
            MGPU__TRY(mgpu__tape_accumulate(tape, b, c));
        }
        return MGPU_OK;
    case MGPU__TAPE_SCATTER:   /* src's gradient: dy's rows gathered back */
        if ((c = mgpu_tensor_create(tape->dev, MGPU_F32, a->shape)) && mgpu__ad_embedding(g, b, c, NULL, NULL) != MGPU_OK) { mgpu__tensor_free(c); c = NULL; }
        return mgpu__tape_accumulate(tape, a, c);
    case MGPU__TAPE_DROPOUT: return mgpu__tape_accumulate(tape, a, mgpu__ad_new_map(tape, n->op, a->shape, 1, MGPU__BINARY_MUL, 0.0f, g, n->saved));
    case MGPU__TAPE_XENT: case MGPU__TAPE_MSE:   /* the loss's gradient, times dy (a scalar) */
        MGPU__TRY(mgpu__tape_accumulate(tape, a, mgpu__ad_new_map(tape, n->op, a->shape, 1, MGPU__BINARY_MUL, 0.0f, n->saved, g)));
        if (n->kind == MGPU__TAPE_MSE && mgpu__tape_needs_grad(tape, b) &&
            (c = mgpu__ad_new_map(tape, n->op, b->shape, 1, MGPU__BINARY_MUL, 0.0f, n->saved, g)) &&
            mgpu__ad_map(n->op, 0, MGPU__UNARY_NEG, 0.0f, c, c, NULL) != MGPU_OK) {   /* the target's: the opposite */
            mgpu__tensor_free(c);
            c = NULL;
        }
        return n->kind == MGPU__TAPE_MSE && mgpu__tape_needs_grad(tape, b) ? mgpu__tape_accumulate(tape, b, c) : MGPU_OK;
    default: return MGPU_OK;   /* a constant */
    }
}
/* The inputs node n's backward reads (bit j: in[j]): only those must not change before it */
static int mgpu__tape_reads(const mgpu__tape_node* n) {
    switch (n->kind) {
    case MGPU__TAPE_UNARY:
        return n->code == MGPU__UNARY_LOG || n->code == MGPU__UNARY_RELU || n->code == MGPU__UNARY_GELU ||
               n->code == MGPU__UNARY_GELU_TANH || n->code == MGPU__UNARY_ABS || n->code == MGPU__UNARY_POW;
    case MGPU__TAPE_BINARY:
        return n->code == MGPU__BINARY_ADD || n->code == MGPU__BINARY_SUB ? 0 : n->code == MGPU__BINARY_DIV ? 2 : 3;
    case MGPU__TAPE_REDUCE: return n->code == 2;   /* max: where the maxima were */
    case MGPU__TAPE_MATMUL: return 3;
    case MGPU__TAPE_GATHER: case MGPU__TAPE_SCATTER: return 2;   /* the ids */
    case MGPU__TAPE_WHERE: return 4;                            /* the condition */
    default: return 0;   /* views, masks, dropout and losses keep what they need */
    }
}
/* MGPU_ERROR_INVALID_ARGUMENT when an input node n's backward reads was written since n read it
   (PyTorch: "one of the variables needed for gradient computation has been modified by an
   inplace operation") */
static mgpu_result mgpu__tape_changed(const mgpu_tape* tape, const mgpu__tape_node* n) {
    char text[128];
    const int reads = mgpu__tape_reads(n);
    int j;
    for (j = 0; j < 3; ++j)
        if ((reads >> j & 1) && n->in[j] && n->in[j]->storage->version != n->version[j])
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tape_backward: %s, an input of %s (op %d of the tape), was "
                              "written after the op read it, and its gradient needs the old values: change it after "
                              "backward, or copy it first", mgpu_tensor_describe(n->in[j], text, sizeof text), n->op,
                              (int)(n - tape->nodes));
    return MGPU_OK;
}
MGPUDEF mgpu_result mgpu_tape_backward(mgpu_tape* tape, const mgpu_tensor* y, const mgpu_tensor* dy) {
    static const char* op = "mgpu_tape_backward";
    char text[128], t2[128];
    mgpu_result r = MGPU_OK;
    mgpu_tensor* g;
    int i, k;
    if (!tape) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL tape", op);
    if (tape->error != MGPU_OK) return tape->error;
    if (!y) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: 'y' is NULL", op);
    if (y->tape != tape)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: 'y' %s was not made by this tape's ops", op, mgpu_tensor_describe(y, text, sizeof text));
    k = y->tape_node;
    if (!tape->nodes[k].needs_grad)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: 'y' %s does not depend on any watched tensor (mgpu_tape_watch)", op,
                          mgpu_tensor_describe(y, text, sizeof text));
    if (dy) {
        MGPU__TRY(mgpu__check_tensor(op, "dy", dy, MGPU_F32));
        MGPU__TRY(mgpu__check_same_device(op, "dy", dy, "y", y));
        MGPU__TRY(mgpu__check_same_shape(op, "dy", dy, "y", y));
    } else if (mgpu_tensor_numel(y) != 1)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: 'y' %s is not one element: give its gradient dy", op,
                          mgpu_tensor_describe(y, t2, sizeof t2));
    if (!(g = mgpu_tensor_create(tape->dev, MGPU_F32, y->shape))) return mgpu_last_result();
    if ((r = dy ? mgpu_tensor_copy(g, dy) : mgpu_tensor_fill(g, 1.0)) != MGPU_OK) { mgpu__tensor_free(g); return r; }
    mgpu__tensor_free(tape->nodes[k].grad);
    tape->nodes[k].grad = g;
    for (i = k; i >= 0; --i) {
        mgpu__tape_node* n = &tape->nodes[i];
        if (n->grad && n->needs_grad && r == MGPU_OK) r = mgpu__tape_changed(tape, n);
        if (n->grad && n->needs_grad && r == MGPU_OK) r = mgpu__tape_node_backward(tape, n);
        mgpu__tensor_free(n->grad);   /* done with, or after a failure, dropped */
        n->grad = NULL;
    }
    return r;
}

/* ---- layers made of tape ops ---- */
#define MGPU__OP_LAYER_MAX_PARAMS 64
typedef struct mgpu__op_layer {
    mgpu_layer_vtable vt;                    /* its own, for its type's name */
    mgpu_op_layer_desc desc;
    mgpu_op_param_desc params[MGPU__OP_LAYER_MAX_PARAMS];
    char names[MGPU__OP_LAYER_MAX_PARAMS][48];
    char type[48];
} mgpu__op_layer;
static const mgpu__op_layer* mgpu__op_layer_of(const mgpu_layer* l) { return (const mgpu__op_layer*)l->user; }
static mgpu_result mgpu__op_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    const mgpu__op_layer* o = mgpu__op_layer_of(l);
    if (o->desc.output_shape) return o->desc.output_shape(o->desc.user, x, y);
    *y = x;
    return MGPU_OK;
}
static int mgpu__op_param_count(const mgpu_layer* l) { return mgpu__op_layer_of(l)->desc.param_count; }
static mgpu_result mgpu__op_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    const mgpu__op_layer* o = mgpu__op_layer_of(l);
    *name = o->names[i];
    *shape = o->params[i].shape;
    return MGPU_OK;
}
static mgpu_result mgpu__op_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    const mgpu__op_layer* o = mgpu__op_layer_of(l);
    uint64_t offset = 0;
    int i;
    for (i = 0; i < o->desc.param_count; ++i) {
        const mgpu_op_param_desc* p = &o->params[i];
        mgpu_tensor* t = ctx->params[i];
        const int64_t last = p->shape.ndim ? p->shape.dim[p->shape.ndim - 1] : 1;
        const double fan_in = (double)(p->uniform_fan_in > 0 ? p->uniform_fan_in : MGPU__MAX(last, 1));
        switch (p->init) {
        case MGPU_INIT_ONES: MGPU__TRY(mgpu_tensor_fill(t, 1.0)); break;
        case MGPU_INIT_UNIFORM: {
            const float s = p->init_scale > 0.0f ? p->init_scale : (float)(1.0 / sqrt(fan_in));
            MGPU__TRY(mgpu_rand_uniform(t, seed, offset, -s, s));
            break;
        }
        case MGPU_INIT_NORMAL: MGPU__TRY(mgpu_rand_normal(t, seed, offset, 0.0f, p->init_scale > 0.0f ? p->init_scale : 0.02f)); break;
        default: MGPU__TRY(mgpu_tensor_zero(t)); break;
        }
        offset += mgpu_rand_offsets(mgpu_tensor_numel(t));
    }
    return MGPU_OK;
}
/* The user's forward on a fresh tape; its output checked against y's shape. *tape_out is the tape
   (the caller destroys it) */
static const mgpu_tensor* mgpu__op_run(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                       int watch_x, mgpu_tape** tape_out) {
    const mgpu__op_layer* o = mgpu__op_layer_of(l);
    mgpu_tape* tape = mgpu_tape_create(ctx->device);
    const mgpu_tensor* out;
    char a[128], b[128];
    int i;
    *tape_out = tape;
    if (!tape) return NULL;
    tape->training = ctx->training;   /* dropout: the layer's stream for this step, by sample */
    tape->seed = ctx->seed;
    tape->offset = ctx->offset;
    tape->seed_on_device = ctx->seed_on_device;
    tape->first_row = (uint64_t)ctx->first_row;
    tape->batch_rows = x->shape.ndim ? x->shape.dim[0] : 1;
    for (i = 0; watch_x >= 0 && i < o->desc.param_count; ++i)
        if (mgpu_tape_watch(tape, ctx->params[i]) != MGPU_OK) return NULL;
    if (watch_x > 0 && mgpu_tape_watch(tape, x) != MGPU_OK) return NULL;
    out = o->desc.forward(o->desc.user, tape, x, (const mgpu_tensor* const*)ctx->params);
    if (!out) {
        if (tape->error == MGPU_OK) mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: forward returned NULL, and no op failed", o->type);
        else mgpu__fail(tape->error, "%s: %s", o->type, mgpu_last_error());
        return NULL;
    }
    if (out->tape != tape) {   /* x or a parameter itself: its gradient would need a node */
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: forward returned %s, which no op of its tape made (return "
                   "mgpu_tape_scale(tape, x, 1) for x itself)", o->type, mgpu_tensor_describe(out, a, sizeof a));
        return NULL;
    }
    if (!mgpu_shape_equal(out->shape, y->shape)) {
        mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: forward returned %s where output_shape says %s", o->type,
                   mgpu_tensor_describe(out, a, sizeof a), mgpu__shape_text(y->shape, b, sizeof b));
        return NULL;
    }
    return out;
}
static mgpu_result mgpu__op_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_tape* tape;
    const mgpu_tensor* out = mgpu__op_run(l, ctx, x, y, -1, &tape);
    const mgpu_result r = out ? mgpu_tensor_copy(y, out) : mgpu_last_result();
    mgpu_tape_destroy(tape);
    return r;
}
/* The forward again, recorded, and differentiated: gradients added into the layer's, dx written */
static mgpu_result mgpu__op_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                     const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    const mgpu__op_layer* o = mgpu__op_layer_of(l);
    mgpu_tape* tape;
    const int want_dx = dx != NULL && x->dtype == MGPU_F32;
    const mgpu_tensor* out = mgpu__op_run(l, ctx, x, y, want_dx, &tape);
    mgpu_result r = out ? MGPU_OK : mgpu_last_result();
    int i;
    if (r == MGPU_OK && tape->nodes[out->tape_node].needs_grad)   /* else: every gradient is 0 */
        r = mgpu_tape_backward(tape, out, dy);
    for (i = 0; r == MGPU_OK && i < o->desc.param_count; ++i) {
        const mgpu_tensor* g = tape->watched_grad[i];
        if (g) r = mgpu_add(ctx->grads[i], ctx->grads[i], g);
    }
    if (r == MGPU_OK && dx) {
        const mgpu_tensor* g = want_dx ? tape->watched_grad[o->desc.param_count] : NULL;
        r = g ? mgpu_tensor_copy(dx, g) : mgpu_tensor_zero(dx);
    }
    mgpu_tape_destroy(tape);
    return r;
}
static void mgpu__op_describe(const mgpu_layer* l, char* buf, size_t size) {
    snprintf(buf, size, "%d parameters, from tape ops", mgpu__op_layer_of(l)->desc.param_count);
}
static void mgpu__op_destroy(mgpu_layer* l) { MGPU_FREE(l->user); }

MGPUDEF mgpu_layer* mgpu_layer_from_ops(const mgpu_op_layer_desc* desc) {
    static const char* op = "mgpu_layer_from_ops";
    mgpu__op_layer* o;
    mgpu_layer* l;
    int i;
    if (!desc || !desc->forward) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL %s", op, desc ? "forward" : "desc"); return NULL; }
    if (desc->param_count < 0 || desc->param_count > MGPU__OP_LAYER_MAX_PARAMS || (desc->param_count && !desc->params)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d parameters (0 to %d, with params)", op, desc->param_count, MGPU__OP_LAYER_MAX_PARAMS);
        return NULL;
    }
    if (desc->type && strlen(desc->type) >= sizeof o->type) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: type \"%.60s...\" is longer than %d bytes", op, desc->type, (int)sizeof o->type - 1);
        return NULL;
    }
    for (i = 0; i < desc->param_count; ++i) {
        const mgpu_op_param_desc* p = &desc->params[i];
        if (!p->name || !p->name[0] || strlen(p->name) >= sizeof o->names[0] || mgpu_shape_numel(p->shape) <= 0 ||
            p->shape.ndim < 1 || (unsigned)p->init > MGPU_INIT_NORMAL) {
            mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: parameter %d (\"%s\"): want a name of 1 to 47 bytes, a shape of 1 to 4 "
                       "positive dimensions and an mgpu_param_init", op, i, p->name ? p->name : "(null)");
            return NULL;
        }
    }
    o = (mgpu__op_layer*)mgpu__calloc(1, sizeof *o);
    if (!o) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    o->desc = *desc;
    snprintf(o->type, sizeof o->type, "%s", desc->type ? desc->type : "OpLayer");
    for (i = 0; i < desc->param_count; ++i) {
        o->params[i] = desc->params[i];
        snprintf(o->names[i], sizeof o->names[i], "%s", desc->params[i].name);
        o->params[i].name = o->names[i];
    }
    o->desc.params = o->params;
    o->vt.type = o->type;
    o->vt.output_shape = mgpu__op_output_shape;
    o->vt.param_count = mgpu__op_param_count;
    o->vt.param_shape = mgpu__op_param_shape;
    o->vt.init = mgpu__op_init;
    o->vt.forward = mgpu__op_forward;
    o->vt.backward = mgpu__op_backward;
    o->vt.describe = mgpu__op_describe;
    o->vt.destroy = mgpu__op_destroy;
    if (!(l = mgpu_layer_create(&o->vt, o))) MGPU_FREE(o);
    else {   /* the same ops every step of a batch shape: a CUDA graph can hold them (and dropout's key) */
        l->graph_safe = 1;
        l->uses_rng = 1;
    }
    return l;
}

/* ---- >>impl parallel -------------------------------------------------------------------- */
/* The P2P algorithm: chosen by size and reach (AUTO), or forced by MGPU_P2P=ring|oneshot. */
typedef enum mgpu__p2p_choice { MGPU__P2P_AUTO = 0, MGPU__P2P_RING = 1, MGPU__P2P_ONESHOT = 2 } mgpu__p2p_choice;

typedef struct mgpu__rank {
    mgpu_device* dev;
    void* stream;           /* CUDA: the communication stream of this replica */
    void* ev_compute;       /* CUDA: marks the compute stream's progress, for the comm stream */
    void* ev_comm;          /* CUDA: marks the comm stream's progress (ring steps, the final join) */
    void* nccl_comm;
    int reads_prev;         /* P2P: this GPU reads its ring predecessor's memory (the same GPU, or peer
                               access), so the ring's add kernel takes the chunk straight from there */
    float* ring_tmp;        /* P2P, where it does not: the predecessor's chunk lands here first */
    size_t ring_tmp_block;  /* the allocator block size of ring_tmp (0: none yet) */
    size_t ring_tmp_floats;
} mgpu__rank;

/* Processes (the end of this section): a vote of every rank, and sums across them. */
static void mgpu__dist_doing(const char* op, int64_t step);
static mgpu_result mgpu__dist_agree(mgpu_result mine, int64_t count, double number, int64_t* counts, double* sum);
static void mgpu__dist_meet(double* all, size_t width, const int* rank_replicas);
static mgpu_result mgpu__dist_agree_size(const char* op, mgpu_result mine, int64_t n, double number, double* number_sum);
static mgpu_result mgpu__dist_sum(const char* op, mgpu_tensor* const* ts, int L, const int* rank_replicas, mgpu_result mine,
                                  double number, double* number_sum);
static void mgpu__split(int64_t n, int pieces, int i, int64_t* start, int64_t* count);
struct mgpu_allreduce;
static mgpu_result mgpu__ar_join_processes(struct mgpu_allreduce* ar, const int* rank_devices, mgpu_allreduce_kind asked,
                                           int deterministic);
static mgpu_result mgpu__ar_check_processes(const struct mgpu_allreduce* ar);

struct mgpu_allreduce {
    mgpu_allreduce_kind kind;
    int count;
    mgpu__rank* rank;
    float* host_stage;      /* HOST with GPU replicas: pinned staging of count buffers */
    size_t host_stage_floats;
    int one_gpu;            /* every replica on the same GPU (virtual devices) */
    int oneshot_reach;      /* P2P: replica 0's GPU can read and write every replica's memory */
    mgpu__p2p_choice p2p;   /* P2P: the algorithm MGPU_P2P asks for, or automatic */
    const mgpu_device_set* set;   /* made by mgpu_allreduce_create: counted among the set's users */
    int* rank_devices;      /* distributed: each process's device count, [mgpu_dist_size()]; else NULL */
    int across_processes;   /* its NCCL communicators span every process's devices */
};

MGPUDEF const char* mgpu_allreduce_name(mgpu_allreduce_kind kind) {
    switch (kind) {
    case MGPU_ALLREDUCE_NCCL: return "nccl";
    case MGPU_ALLREDUCE_P2P: return "p2p";
    case MGPU_ALLREDUCE_HOST: return "host";
    case MGPU_ALLREDUCE_NONE: return "none";
    case MGPU_ALLREDUCE_MPI: return "mpi";
    default: return "auto";
    }
}

static void mgpu__allreduce_free(mgpu_allreduce* ar) {
    int i;
    if (!ar) return;
    mgpu__live_remove(ar, MGPU__LIVE_ALLREDUCE);
    MGPU_FREE(ar->rank_devices);
    if (ar->set) mgpu__set_users(ar->set, 0, -1);
    for (i = 0; ar->rank && i < ar->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        if (r->stream) (void)MGPU__CUDA(mgpu__cu_stream_synchronize(r->dev->ordinal, r->stream));
        if (r->nccl_comm) (void)MGPU__CUDA(mgpu__cu_nccl_comm_destroy(r->nccl_comm));
        if (r->ev_compute) (void)MGPU__CUDA(mgpu__cu_event_destroy(r->dev->ordinal, r->ev_compute));
        if (r->ev_comm) (void)MGPU__CUDA(mgpu__cu_event_destroy(r->dev->ordinal, r->ev_comm));
        if (r->stream) (void)MGPU__CUDA(mgpu__cu_stream_destroy(r->dev->ordinal, r->stream));
        if (r->ring_tmp) mgpu__device_release(r->dev, r->ring_tmp, r->ring_tmp_block);
    }
    mgpu_pinned_free(ar->host_stage);
    MGPU_FREE(ar->rank);
    MGPU_FREE(ar);
}
MGPUDEF void mgpu_allreduce_destroy(mgpu_allreduce* ar) {
    if (!ar || !mgpu__live_check(ar, MGPU__LIVE_ALLREDUCE, "mgpu_allreduce_destroy", "communicator")) return;
    mgpu__allreduce_free(ar);
}

static mgpu_allreduce_kind mgpu__allreduce_from_env(mgpu_allreduce_kind kind) {
    static const char* const words[4] = { "auto", "nccl", "p2p", "host" };
    static const mgpu_allreduce_kind kinds[4] = { MGPU_ALLREDUCE_AUTO, MGPU_ALLREDUCE_NCCL, MGPU_ALLREDUCE_P2P,
                                                  MGPU_ALLREDUCE_HOST };
    if (kind != MGPU_ALLREDUCE_AUTO) return kind;
    return kinds[mgpu__setting_choice("MGPU_ALLREDUCE", words, 4, 0)];
}

static mgpu__p2p_choice mgpu__p2p_choice_from_env(void) {
    static const char* const words[3] = { "auto", "ring", "oneshot" };
    static const mgpu__p2p_choice choices[3] = { MGPU__P2P_AUTO, MGPU__P2P_RING, MGPU__P2P_ONESHOT };
    return choices[mgpu__setting_choice("MGPU_P2P", words, 3, 0)];
}

/* NCCL picks an algorithm (ring, tree, NVLS, CollNet) and a protocol (LL, LL128, Simple) per call
   from the size, the topology and its version; only ring with Simple adds in an order fixed by
   the ranks (NVLS on H100 adds in the switch, in no promised order). When the user asks for
   determinism (MGPU_DETERMINISTIC=1) or a model checks its replicas (verify_every), mgpu pins
   NCCL_ALGO=Ring and NCCL_PROTO=Simple, before the communicators are made, unless the user set
   them. NCCL reads them at its first initialisation in a process, so this holds when mgpu makes
   the process's first NCCL communicator. */
static int mgpu__deterministic_from_env(void) { return mgpu__setting_flag("MGPU_DETERMINISTIC", 0); }
static void mgpu__nccl_pin(void) {
#if defined(__unix__) || defined(__APPLE__)
    static const char* const names[2] = {"NCCL_ALGO", "NCCL_PROTO"};
    static const char* const values[2] = {"Ring", "Simple"};
    int i;
    for (i = 0; i < 2; ++i) {
        const char* had = getenv(names[i]);
        if (!had || !*had) setenv(names[i], values[i], 1);
        else if (strcmp(had, values[i]) != 0)
            mgpu__log(MGPU_LOG_INFO, "all-reduce: %s=%s set by the user is kept; NCCL sums in a fixed order only with "
                      "NCCL_ALGO=Ring NCCL_PROTO=Simple", names[i], had);
    }
#endif
}

static mgpu_allreduce* mgpu__allreduce_create(const mgpu_device_set* set, mgpu_allreduce_kind kind, int deterministic);
MGPUDEF mgpu_allreduce* mgpu_allreduce_create(const mgpu_device_set* set, mgpu_allreduce_kind kind) {
    mgpu_allreduce* ar;
    if (set && !mgpu__live_check(set, MGPU__LIVE_SET, "mgpu_allreduce_create", "device set")) return NULL;
    ar = mgpu__allreduce_create(set, kind, mgpu__deterministic_from_env());
    if (ar && mgpu__live_add(ar, MGPU__LIVE_ALLREDUCE, "mgpu_allreduce_create") != MGPU_OK) { mgpu__allreduce_free(ar); return NULL; }
    if (ar) {   /* the set's destroy waits for this one's (LIFETIMES); a model's own is part of the model */
        ar->set = set;
        mgpu__set_users(set, 0, 1);
    }
    return ar;
}
static mgpu_allreduce* mgpu__allreduce_create(const mgpu_device_set* set, mgpu_allreduce_kind kind, int deterministic) {
    static const char* op = "mgpu_allreduce_create";
    mgpu_allreduce* ar;
    int i, cuda;
    if (!set || set->count < 1) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL or empty device set", op); return NULL; }
    if (kind < MGPU_ALLREDUCE_AUTO || kind > MGPU_ALLREDUCE_NONE) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: unknown backend %d", op, (int)kind); return NULL; }
    cuda = set->devices[0]->kind == MGPU_DEVICE_CUDA;
    kind = mgpu__allreduce_from_env(kind);
    if (kind == MGPU_ALLREDUCE_NONE && set->count > 1) {   /* nothing else would keep replicas equal */
        mgpu__log(MGPU_LOG_INFO, "all-reduce: 'none' asked for %d devices; choosing a backend", set->count);
        kind = MGPU_ALLREDUCE_AUTO;
    }
    if (set->count == 1) kind = MGPU_ALLREDUCE_NONE;
    else if (!cuda && kind != MGPU_ALLREDUCE_HOST) {
        if (kind != MGPU_ALLREDUCE_AUTO) mgpu__log(MGPU_LOG_INFO, "all-reduce: %s needs GPUs; CPU replicas use host", mgpu_allreduce_name(kind));
        kind = MGPU_ALLREDUCE_HOST;
    }
    if (cuda && (kind == MGPU_ALLREDUCE_AUTO || kind == MGPU_ALLREDUCE_NCCL)) {
        int distinct = 1, j;
        for (i = 0; i < set->count; ++i) for (j = 0; j < i; ++j) distinct &= set->devices[i]->ordinal != set->devices[j]->ordinal;
        if (distinct && MGPU__CUDA(mgpu__cu_nccl_available()) == 1) kind = MGPU_ALLREDUCE_NCCL;
        else {
            if (kind == MGPU_ALLREDUCE_NCCL)   /* the library tried and dlopen's reason, as the backend says them */
                mgpu__log(MGPU_LOG_INFO, "all-reduce: NCCL %s%s; using peer-to-peer instead",
                          distinct ? "could not be loaded: " : "cannot use one GPU twice", distinct ? mgpu__cuda_message() : "");
            kind = MGPU_ALLREDUCE_P2P;
        }
    }
    ar = (mgpu_allreduce*)mgpu__calloc(1, sizeof *ar);
    if (ar) ar->rank = (mgpu__rank*)mgpu__calloc((size_t)set->count, sizeof(mgpu__rank));
    if (!ar || !ar->rank) { MGPU_FREE(ar); mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    ar->kind = kind;
    ar->count = set->count;
    for (i = 0; i < set->count; ++i) ar->rank[i].dev = set->devices[i];
    for (i = 0; cuda && i < set->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        int rc = MGPU__CUDA(mgpu__cu_stream_create(r->dev->ordinal, &r->stream));
        if (!rc) rc = MGPU__CUDA(mgpu__cu_event_create(r->dev->ordinal, &r->ev_compute));
        if (!rc) rc = MGPU__CUDA(mgpu__cu_event_create(r->dev->ordinal, &r->ev_comm));
        if (rc) { mgpu__cu_result(rc, op, r->dev); mgpu__allreduce_free(ar); return NULL; }
    }
    if (kind == MGPU_ALLREDUCE_NCCL) {
        int ordinals[MGPU__MAX_REPLICAS];
        void* comms[MGPU__MAX_REPLICAS];
        for (i = 0; i < set->count; ++i) ordinals[i] = set->devices[i]->ordinal;
        if (deterministic) mgpu__nccl_pin();
        if (MGPU__CUDA(mgpu__cu_nccl_comm_init_all(set->count, ordinals, comms)) != 0) {   /* fall back, nothing lost */
            mgpu__log(MGPU_LOG_WARN, "all-reduce: NCCL initialisation failed (%s); using peer-to-peer", mgpu__cuda_message());
            ar->kind = MGPU_ALLREDUCE_P2P;
        } else {
            for (i = 0; i < set->count; ++i) ar->rank[i].nccl_comm = comms[i];
        }
    }
    ar->p2p = mgpu__p2p_choice_from_env();
    ar->one_gpu = 1;
    ar->oneshot_reach = set->count <= MGPU__CU_ONESHOT_MAX;
    for (i = 1; cuda && i < set->count; ++i) {   /* peer access is switched on by the device set */
        const int o0 = set->devices[0]->ordinal, oi = set->devices[i]->ordinal;
        ar->one_gpu &= oi == o0;
        ar->oneshot_reach &= oi == o0 || (mgpu_device_can_access_peer(set->devices[0], set->devices[i]) &&
                                          MGPU__CUDA(mgpu__cu_enable_peer_access(o0, oi)) == 0);
    }
    for (i = 0; ar->kind == MGPU_ALLREDUCE_P2P && i < set->count; ++i) {   /* the ring's reach: each replica to its predecessor */
        mgpu_device *me = set->devices[i], *prev = set->devices[(i + set->count - 1) % set->count];
        ar->rank[i].reads_prev = me->ordinal == prev->ordinal ||
                                 (mgpu_device_can_access_peer(me, prev) && MGPU__CUDA(mgpu__cu_enable_peer_access(me->ordinal, prev->ordinal)) == 0);
    }
    return ar;
}

MGPUDEF mgpu_allreduce_kind mgpu_allreduce_backend(const mgpu_allreduce* ar) {
    if (ar && ar->rank_devices && !ar->across_processes) return MGPU_ALLREDUCE_MPI;   /* distributed, through MPI */
    return ar ? ar->kind : MGPU_ALLREDUCE_NONE;
}

/* Across GPUs the one-shot funnels everything through replica 0's links: small buffers only. */
#define MGPU__ONESHOT_CROSS_GPU_BYTES ((size_t)256 << 10)
static int mgpu__ar_oneshot_fits(const mgpu_allreduce* ar, size_t bytes) {
    if (ar->kind != MGPU_ALLREDUCE_P2P || !ar->oneshot_reach || ar->p2p == MGPU__P2P_RING) return 0;
    return ar->p2p == MGPU__P2P_ONESHOT || ar->one_gpu || bytes <= MGPU__ONESHOT_CROSS_GPU_BYTES;
}

MGPUDEF const char* mgpu_allreduce_algorithm(const mgpu_allreduce* ar, size_t bytes) {
    if (ar && ar->rank_devices && !ar->across_processes) return "reduce-scatter+all-gather";   /* through MPI */
    if (!ar || ar->kind == MGPU_ALLREDUCE_NONE) return "none";
    if (ar->kind == MGPU_ALLREDUCE_P2P) return mgpu__ar_oneshot_fits(ar, bytes) ? "oneshot" : "ring";
    return mgpu_allreduce_name(ar->kind);
}

MGPUDEF double mgpu_allreduce_memory_traffic(const mgpu_allreduce* ar, size_t bytes) {
    const double n = ar ? (double)ar->count : 0.0, b = (double)bytes;
    if (!ar || ar->rank_devices || ar->kind == MGPU_ALLREDUCE_NONE || ar->kind == MGPU_ALLREDUCE_NCCL) return 0.0;
    if (ar->kind == MGPU_ALLREDUCE_HOST)   /* CPU replicas: n - 1 adds (2 reads + write), n - 1 copies; */
        return ar->rank[0].dev->kind == MGPU_DEVICE_CPU ? (n - 1.0) * 5.0 * b : 0.0;   /* GPUs: two memories */
    if (mgpu__ar_oneshot_fits(ar, bytes)) return 2.0 * n * b;   /* each buffer read once, written once */
    /* ring, per replica and step (chunks of b/n): a reduce-scatter add (2 reads + write), after a
       copy into ring_tmp (read + write) where the predecessor is out of reach; an all-gather copy
       (read + write): 5 or 7 times (n - 1) b/n per replica */
    {
        double per_chunk = 0.0;   /* summed over the replicas */
        int i;
        for (i = 0; i < ar->count; ++i) per_chunk += ar->rank[i].reads_prev ? 5.0 : 7.0;
        return per_chunk * (n - 1.0) * b / n;
    }
}

/* -- HOST: CPU replicas sum slices of the buffers in parallel, replicas always in order 0..n-1 -- */
typedef struct mgpu__host_sum_job { float* const* bufs; int count; } mgpu__host_sum_job;
static void mgpu__host_sum_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__host_sum_job* j = (const mgpu__host_sum_job*)ctx;
    float* sum = j->bufs[0];
    int64_t i;
    int r;
    /* ((b0 + b1) + b2) + ... into b0, a whole buffer at a time (vectorised), then copied out */
    for (r = 1; r < j->count; ++r) {
        const float* src = j->bufs[r];
        for (i = begin; i < end; ++i) sum[i] += src[i];
    }
    for (r = 1; r < j->count; ++r) memcpy(j->bufs[r] + begin, sum + begin, (size_t)(end - begin) * sizeof(float));
}

/* Each comm stream waits for an event of its replica's compute stream (a bucket's gradients done:
   mgpu__part.bucket_done), or for all its compute stream has issued so far (after_compute). */
static mgpu_result mgpu__ar_after_events(mgpu_allreduce* ar, void* const* events) {   /* events[i]: replica i's */
    int i;
    for (i = 0; i < ar->count; ++i)
        MGPU__CU("all-reduce", ar->rank[i].dev, mgpu__cu_stream_wait_event(ar->rank[i].dev->ordinal, ar->rank[i].stream, events[i]));
    return MGPU_OK;
}
static mgpu_result mgpu__ar_after_compute(mgpu_allreduce* ar) {
    void* events[MGPU__MAX_REPLICAS];
    int i;
    for (i = 0; i < ar->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        MGPU__CU("all-reduce", r->dev, mgpu__cu_event_record(r->dev->ordinal, r->ev_compute, r->dev->stream));
        events[i] = r->ev_compute;
    }
    return mgpu__ar_after_events(ar, events);
}
/* Each compute stream waits for EVERY comm stream: later work sees the reduced values, and does
   not overwrite a buffer that a neighbour's comm stream is still reading (the ring's last step
   reads the predecessor's buffer). */
static mgpu_result mgpu__ar_before_compute(mgpu_allreduce* ar) {
    int i, j;
    for (i = 0; i < ar->count; ++i)
        MGPU__CU("all-reduce", ar->rank[i].dev, mgpu__cu_event_record(ar->rank[i].dev->ordinal, ar->rank[i].ev_comm, ar->rank[i].stream));
    for (i = 0; i < ar->count; ++i)
        for (j = 0; j < ar->count; ++j)
            MGPU__CU("all-reduce", ar->rank[i].dev,
                     mgpu__cu_stream_wait_event(ar->rank[i].dev->ordinal, ar->rank[i].dev->stream, ar->rank[j].ev_comm));
    return MGPU_OK;
}

/* P2P ring over R replicas, the buffer cut into R chunks. Reduce-scatter: at step s replica r
   sends chunk (r - s) to r + 1, which adds it to its own; after R - 1 steps replica r holds the
   full sum of chunk (r + 1). All-gather: at step s replica r sends chunk (r + 1 - s) to r + 1,
   which keeps it. A chunk is always summed starting from the same replica, so the result is the
   same every run, and every replica ends with the same bits. Events order the neighbours.
   "Sends" is one add kernel that reads the predecessor's chunk in place where the GPU reaches
   it (reads_prev), else a peer copy (through the host) into ring_tmp and the add; the same
   bits either way (a + b == b + a in floating point). */
static mgpu_result mgpu__ar_ring(mgpu_allreduce* ar, float* const* bufs, size_t n) {
    const int R = ar->count;
    const size_t chunk = (((n + (size_t)R - 1) / (size_t)R) + 31) & ~(size_t)31;   /* 128-byte aligned chunks: vector loads */
    int s, i, phase;
    for (i = 0; i < R; ++i) {   /* a landing buffer of one chunk, kept between calls, where it is needed */
        mgpu__rank* r = &ar->rank[i];
        if (!r->reads_prev && r->ring_tmp_floats < chunk) {
            MGPU__CU("all-reduce", r->dev, mgpu__cu_stream_synchronize(r->dev->ordinal, r->stream));
            if (r->ring_tmp) mgpu__device_release(r->dev, r->ring_tmp, r->ring_tmp_block);
            r->ring_tmp = (float*)mgpu__device_alloc(r->dev, chunk * sizeof(float), &r->ring_tmp_block, "all-reduce");
            r->ring_tmp_floats = r->ring_tmp ? chunk : 0;
            if (!r->ring_tmp) return mgpu_last_result();
        }
        MGPU__CU("all-reduce", r->dev, mgpu__cu_event_record(r->dev->ordinal, r->ev_comm, r->stream));
    }
    for (phase = 0; phase < 2; ++phase)
        for (s = 0; s < R - 1; ++s) {
            for (i = 0; i < R; ++i) {
                const int src = i, dst = (i + 1) % R;
                const int k = phase == 0 ? ((i - s) % R + R) % R : ((i + 1 - s) % R + R) % R;
                const size_t begin = MGPU__MIN((size_t)k * chunk, n), len = MGPU__MIN(chunk, n - begin);
                mgpu__rank *a = &ar->rank[src], *b = &ar->rank[dst];
                if (!len) continue;
                MGPU__CU("all-reduce", b->dev, mgpu__cu_stream_wait_event(b->dev->ordinal, b->stream, a->ev_comm));
                if (phase == 0) {
                    const float* sent = bufs[src] + begin;
                    if (!b->reads_prev) {
                        MGPU__CU("all-reduce", b->dev, mgpu__cu_memcpy_peer(b->dev->ordinal, b->ring_tmp, a->dev->ordinal,
                                                                            sent, len * sizeof(float), b->stream));
                        sent = b->ring_tmp;
                    }
                    MGPU__CU("all-reduce", b->dev, mgpu__cu_binary(b->dev->ordinal, b->stream, MGPU__BINARY_ADD, MGPU_F32, len, sent,
                                                                   bufs[dst] + begin, bufs[dst] + begin, 0.0f));
                } else {
                    MGPU__CU("all-reduce", b->dev, mgpu__cu_memcpy_peer(b->dev->ordinal, bufs[dst] + begin, a->dev->ordinal,
                                                                        bufs[src] + begin, len * sizeof(float), b->stream));
                }
            }
            /* A replica's chunk is ready for its successor only after this step's work. The
               events are recorded after every replica has issued its step, so a successor
               waits on the step it needs and not a later one. */
            for (i = 0; i < R; ++i)
                MGPU__CU("all-reduce", ar->rank[i].dev, mgpu__cu_event_record(ar->rank[i].dev->ordinal, ar->rank[i].ev_comm, ar->rank[i].stream));
        }
    return MGPU_OK;
}

/* One-shot: replica 0's stream waits for every other replica's stream, runs the one sum kernel,
   and every other stream waits for it. On the comm streams for a bucket while backward goes on
   (after mgpu__ar_after_events); for a whole all-reduce directly on the compute streams, which
   takes a third of the calls (latency is what counts for small sums). Replicas are summed in
   order, as the host does, so every replica gets the same bits. */
static mgpu_result mgpu__ar_oneshot(mgpu_allreduce* ar, float* const* bufs, size_t n, int on_compute) {
    mgpu__rank* first = &ar->rank[0];
    void* first_stream = on_compute ? first->dev->stream : first->stream;
    int i;
    for (i = 1; i < ar->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        void* ready = on_compute ? r->ev_compute : r->ev_comm;
        MGPU__CU("all-reduce", r->dev, mgpu__cu_event_record(r->dev->ordinal, ready, on_compute ? r->dev->stream : r->stream));
        MGPU__CU("all-reduce", first->dev, mgpu__cu_stream_wait_event(first->dev->ordinal, first_stream, ready));
    }
    MGPU__CU("all-reduce", first->dev, mgpu__cu_allreduce_oneshot(first->dev->ordinal, first_stream, bufs, ar->count, n));
    MGPU__CU("all-reduce", first->dev, mgpu__cu_event_record(first->dev->ordinal, first->ev_comm, first_stream));
    for (i = 1; i < ar->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        MGPU__CU("all-reduce", r->dev, mgpu__cu_stream_wait_event(r->dev->ordinal, on_compute ? r->dev->stream : r->stream, first->ev_comm));
    }
    return MGPU_OK;
}

/* HOST for GPU replicas: download everything, sum on the host in replica order, upload. */
static mgpu_result mgpu__ar_staged(mgpu_allreduce* ar, float* const* bufs, size_t n) {
    mgpu__host_sum_job job;
    float* host[MGPU__MAX_REPLICAS];
    int i;
    if (ar->host_stage_floats < n * (size_t)ar->count) {
        mgpu_pinned_free(ar->host_stage);
        ar->host_stage = (float*)mgpu_pinned_alloc(n * (size_t)ar->count * sizeof(float));
        ar->host_stage_floats = ar->host_stage ? n * (size_t)ar->count : 0;
        if (!ar->host_stage) return mgpu_last_result();
    }
    for (i = 0; i < ar->count; ++i) {
        mgpu__rank* r = &ar->rank[i];
        host[i] = ar->host_stage + (size_t)i * n;
        MGPU__CU("all-reduce", r->dev, mgpu__cu_memcpy(r->dev->ordinal, host[i], bufs[i], n * sizeof(float), r->stream));
    }
    for (i = 0; i < ar->count; ++i) {
        MGPU__COUNT(ar->rank[i].dev, host_waits, 1);
        MGPU__CU("all-reduce", ar->rank[i].dev, mgpu__cu_stream_synchronize(ar->rank[i].dev->ordinal, ar->rank[i].stream));
    }
    job.bufs = host;
    job.count = ar->count;
    mgpu__parallel_range((int64_t)n, MGPU__EW_MIN_PER_THREAD, mgpu__host_sum_range, &job);
    for (i = 0; i < ar->count; ++i) {   /* every replica uploads the same (replica 0's) sum */
        mgpu__rank* r = &ar->rank[i];
        MGPU__CU("all-reduce", r->dev, mgpu__cu_memcpy(r->dev->ordinal, bufs[i], host[0], n * sizeof(float), r->stream));
    }
    for (i = 0; i < ar->count; ++i) {   /* the host buffer is reused by the next call */
        MGPU__COUNT(ar->rank[i].dev, host_waits, 1);
        MGPU__CU("all-reduce", ar->rank[i].dev, mgpu__cu_stream_synchronize(ar->rank[i].dev->ordinal, ar->rank[i].stream));
    }
    return MGPU_OK;
}

/* Sum bufs[i][0..n) across replicas, on the comm streams (GPU) or right away (CPU). The caller
   orders it with the compute streams (mgpu__ar_after_events or _after_compute, then
   mgpu__ar_before_compute). */
/* Every device of a sum counts its share (mgpu_device_counters.bytes_allreduced). */
static void mgpu__ar_count(mgpu_allreduce* ar, size_t n) {
    int i;
    for (i = 0; i < ar->count; ++i) MGPU__COUNT(ar->rank[i].dev, bytes_allreduced, n * sizeof(float));
}

static mgpu_result mgpu__ar_reduce(mgpu_allreduce* ar, float* const* bufs, size_t n) {
    if (ar->kind == MGPU_ALLREDUCE_NONE || n == 0) return MGPU_OK;
    mgpu__ar_count(ar, n);
    if (ar->rank[0].dev->kind == MGPU_DEVICE_CPU) {
        mgpu__host_sum_job job;
        job.bufs = bufs;
        job.count = ar->count;
        mgpu__parallel_range((int64_t)n, MGPU__EW_MIN_PER_THREAD, mgpu__host_sum_range, &job);
        return MGPU_OK;
    }
    if (ar->kind == MGPU_ALLREDUCE_NCCL) {
        int i, rc = MGPU__CUDA(mgpu__cu_nccl_group_start());
        for (i = 0; !rc && i < ar->count; ++i)
            rc = MGPU__CUDA(mgpu__cu_nccl_allreduce_sum(ar->rank[i].dev->ordinal, ar->rank[i].nccl_comm, bufs[i], n,
                                                        ar->rank[i].stream));
        if (i > 0 || !rc) {   /* a group that was started is always ended */
            int end = MGPU__CUDA(mgpu__cu_nccl_group_end());
            if (!rc) rc = end;
        }
        if (rc) return mgpu__cu_result(rc, "all-reduce (NCCL)", ar->rank[0].dev);
        return MGPU_OK;
    }
    if (ar->kind == MGPU_ALLREDUCE_HOST) return mgpu__ar_staged(ar, bufs, n);
    if (mgpu__ar_oneshot_fits(ar, n * sizeof(float))) return mgpu__ar_oneshot(ar, bufs, n, 0);
    return mgpu__ar_ring(ar, bufs, n);
}

/* A whole all-reduce ordered with the compute streams: after the work issued so far, before the
   work issued next (on the CPU, simply now). */
static mgpu_result mgpu__ar_sum(mgpu_allreduce* ar, float* const* bufs, size_t n) {
    if (ar->rank[0].dev->kind == MGPU_DEVICE_CUDA && ar->kind != MGPU_ALLREDUCE_NONE) {
        if (n > 0 && mgpu__ar_oneshot_fits(ar, n * sizeof(float))) {
            mgpu__ar_count(ar, n);
            return mgpu__ar_oneshot(ar, bufs, n, 1);
        }
        MGPU__TRY(mgpu__ar_after_compute(ar));
        MGPU__TRY(mgpu__ar_reduce(ar, bufs, n));
        return mgpu__ar_before_compute(ar);
    }
    return mgpu__ar_reduce(ar, bufs, n);
}

static mgpu_result mgpu__allreduce_check(mgpu_allreduce* ar, mgpu_tensor* const* tensors, int count, float** bufs);
/* A distributed communicator's ranks vote on their arguments (and, through NCCL, on the
   communicators' health) before they sum, so that one rank's mistake fails every rank. */
MGPUDEF mgpu_result mgpu_allreduce_sum(mgpu_allreduce* ar, mgpu_tensor* const* tensors, int count) {
    float* bufs[MGPU__MAX_REPLICAS];
    mgpu_result r = mgpu__allreduce_check(ar, tensors, count, bufs);
    if (!ar || !ar->rank_devices) return r != MGPU_OK ? r : mgpu__ar_sum(ar, bufs, (size_t)mgpu_tensor_numel(tensors[0]));
    mgpu__dist_doing("mgpu_allreduce_sum", 0);
    if (!ar->across_processes) return mgpu__dist_sum("mgpu_allreduce_sum", tensors, count, ar->rank_devices, r, 0.0, NULL);
    if (r == MGPU_OK) r = mgpu__ar_check_processes(ar);
    MGPU__TRY(mgpu__dist_agree_size("mgpu_allreduce_sum", r, r == MGPU_OK ? mgpu_tensor_numel(tensors[0]) : 0, 0.0, NULL));
    return mgpu__ar_sum(ar, bufs, (size_t)mgpu_tensor_numel(tensors[0]));
}
static mgpu_result mgpu__allreduce_check(mgpu_allreduce* ar, mgpu_tensor* const* tensors, int count, float** bufs) {
    static const char* op = "mgpu_allreduce_sum";
    char a[128], b[128];
    int i;
    if (!ar || !tensors) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL argument", op);
    if (count != ar->count)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d tensors for a communicator of %d devices", op, count, ar->count);
    for (i = 0; i < count; ++i) {
        MGPU__TRY(mgpu__check_tensor(op, "tensors[i]", tensors[i], MGPU_F32));
        if (MGPU__DEV(tensors[i]) != ar->rank[i].dev)
            return mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: tensors[%d] %s is not on device %d of the set (%s)", op, i,
                              mgpu_tensor_describe(tensors[i], a, sizeof a), i, ar->rank[i].dev->label);
        if (mgpu_tensor_numel(tensors[i]) != mgpu_tensor_numel(tensors[0]))
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: tensors[%d] %s and tensors[0] %s differ in size", op, i,
                              mgpu_tensor_describe(tensors[i], a, sizeof a), mgpu_tensor_describe(tensors[0], b, sizeof b));
        bufs[i] = MGPU__F32(tensors[i]);
    }
    return MGPU_OK;
}

/* ---- >>impl parallel, processes: MPI's launch, rendezvous and collectives ---- */

/* The host buffers of the sums across processes (what they send, receive and stage from GPUs),
   kept from call to call and grown as needed: a fresh 64 MiB buffer costs more in page faults
   than the sum. MPI is called from one thread at a time (MPI_THREAD_SERIALIZED), and so are
   these; mgpu_dist_shutdown frees them. */
#ifdef MGPU_MPI
#define MGPU__DIST_SCRATCH 3   /* what a sum sends, receives, and stages from GPUs */
static struct { float* p; size_t floats; } mgpu__dist_scratch[MGPU__DIST_SCRATCH];
static float* mgpu__dist_buffer(int which, size_t floats) {
    if (mgpu__dist_scratch[which].floats < floats) {
        MGPU_FREE(mgpu__dist_scratch[which].p);
        mgpu__dist_scratch[which].p = (float*)MGPU_MALLOC(floats * sizeof(float));
        mgpu__dist_scratch[which].floats = mgpu__dist_scratch[which].p ? floats : 0;
    }
    return mgpu__dist_scratch[which].p;
}

/* ---- a collective that cannot finish, ends ----
   A rank that stops answering (its host frozen, its link down, the process stopped) is no error
   to MPI: a blocking collective waits for it as long as the transport does, which over TCP can be
   forever. So the library's collectives are messages between pairs of ranks, posted at once
   (MPI_Isend, MPI_Irecv) and watched (MPI_Testall) for MGPU_DIST_TIMEOUT seconds (default 300;
   PyTorch's process groups have such a timeout too). Past it the rank says which collective,
   which step, and which ranks had not answered, and ends the job (MPI_Abort), so that mpirun or
   srun returns; a checkpoint saved before is whole (saves are atomic). Pairs rather than MPI's
   collectives because then the ranks that did not answer are known; the sums add the same
   numbers in the same order, so the bits are those of MPI_Alltoallv and MPI_Allgatherv. */
enum { MGPU__TAG_VOTE = 1, MGPU__TAG_BROADCAST, MGPU__TAG_SLICES, MGPU__TAG_GATHER, MGPU__TAG_MEET };
static struct {
    MPI_Request* req;   /* 2 (P - 1): a send to and a receive from every other rank */
    int* peer;          /* whom each is with (-1 - rank once named in a timeout's message) */
    int count;
    double timeout;     /* seconds; 0 waits forever */
} mgpu__dist_posts;

static void mgpu__dist_post(int send, void* buf, int count, MPI_Datatype type, int peer, int tag) {
    int* n = &mgpu__dist_posts.count;
    if (count <= 0) return;   /* both sides of a pair agree on an empty message, and skip it */
    if (send) MPI_Isend(buf, count, type, peer, tag, mgpu__dist_comm, &mgpu__dist_posts.req[*n]);
    else MPI_Irecv(buf, count, type, peer, tag, mgpu__dist_comm, &mgpu__dist_posts.req[*n]);
    mgpu__dist_posts.peer[(*n)++] = peer;
}

/* A short wait between tests once a collective has waited a while: the first millisecond spins,
   as MPI's own blocking calls do; then the core is left to others (oversubscribed ranks). */
static void mgpu__dist_pause(double waited) {
    if (waited < 1e-3) return;
#if defined(_WIN32)
    Sleep(waited < 0.1 ? 0 : 1);
#elif defined(CLOCK_MONOTONIC)   /* POSIX's time.h, as mgpu_seconds wants (else this spins) */
    {
        struct timespec ts;
        ts.tv_sec = 0;
        ts.tv_nsec = waited < 0.1 ? 20000 : 1000000;
        nanosleep(&ts, NULL);
    }
#endif
}

/* The end of a collective that timed out: what it was, in which step, who did not answer. */
static void mgpu__dist_give_up(const char* collective, const char* silent, double waited) {
    char where[160];
    if (mgpu__dist.step > 0) snprintf(where, sizeof where, "step %lld (%s)", (long long)mgpu__dist.step, mgpu__dist.doing);
    else snprintf(where, sizeof where, "%s", mgpu__dist.doing ? mgpu__dist.doing : "a collective call");
    fprintf(stderr, "mgpu: rank %d of %d (%s): %s of %s: no answer from %s after %.0f s (MGPU_DIST_TIMEOUT=%g); "
            "ending the job\n", mgpu__dist.rank, mgpu__dist.size, mgpu__dist.hosts ? mgpu__dist.hosts[mgpu__dist.rank] : "?",
            collective, where, silent, waited, mgpu__dist_posts.timeout);
    mgpu_dist_abort(1);
}

static void mgpu__dist_timed_out(const char* collective, double waited) {
    char peers[768];
    size_t len = 0;
    int i, j, done, listed = 0;
    peers[0] = 0;
    for (i = 0; i < mgpu__dist_posts.count; ++i) {
        const int q = mgpu__dist_posts.peer[i];
        MPI_Test(&mgpu__dist_posts.req[i], &done, MPI_STATUS_IGNORE);
        for (j = 0; j < i && !done; ++j) done = mgpu__dist_posts.peer[j] == -1 - q;   /* named already */
        if (done || len + 100 > sizeof peers) continue;
        len += (size_t)snprintf(peers + len, sizeof peers - len, "%srank %d (%s)", listed++ ? ", " : "", q,
                                mgpu__dist.hosts ? mgpu__dist.hosts[q] : "?");
        mgpu__dist_posts.peer[i] = -1 - q;
    }
    mgpu__dist_give_up(collective, listed ? peers : "the other ranks", waited);
}

/* Waits for every posted message, or ends the job past the timeout. */
static void mgpu__dist_wait(const char* collective) {
    const double start = MPI_Wtime();
    int done = 0;
    for (;;) {
        double waited;
        MPI_Testall(mgpu__dist_posts.count, mgpu__dist_posts.req, &done, MPI_STATUSES_IGNORE);
        if (done) break;
        waited = MPI_Wtime() - start;
        if (mgpu__dist_posts.timeout > 0 && waited > mgpu__dist_posts.timeout) mgpu__dist_timed_out(collective, waited);
        mgpu__dist_pause(waited);
    }
    mgpu__dist_posts.count = 0;
}

#endif

/* MGPU_DIST_TIMEOUT: seconds (a decimal number, 0 for no timeout), read by mgpu_dist_init (the
   MPI build; compiled in every build, so that tests/test_settings.c checks it). At least
   MGPU__DIST_TIMEOUT_MIN: 1e-6 would end a healthy job at its first collective that waits. */
#define MGPU__DIST_TIMEOUT_DEFAULT 300.0
#define MGPU__DIST_TIMEOUT_MIN 1.0
static double mgpu__dist_timeout_from_env(void) {
    double t = mgpu__setting_number("MGPU_DIST_TIMEOUT", 0.0, 1e9, MGPU__DIST_TIMEOUT_DEFAULT, "seconds");
    if (t > 0.0 && t < MGPU__DIST_TIMEOUT_MIN) {
        mgpu__setting_warn("MGPU_DIST_TIMEOUT", "is below the least timeout, 1 s (0: none)", "1");
        t = MGPU__DIST_TIMEOUT_MIN;
    }
    return t;
}

/* What the collectives of a distributed model's call report if they time out. */
static void mgpu__dist_doing(const char* op, int64_t step) {
    mgpu__dist.doing = op;
    mgpu__dist.step = step;
}


MGPUDEF int mgpu_dist_rank(void) { return mgpu__dist.rank; }
MGPUDEF int mgpu_dist_size(void) { return mgpu__dist.size; }
MGPUDEF int mgpu_dist_local_rank(void) { return mgpu__dist.local_rank; }
MGPUDEF int mgpu_dist_local_size(void) { return mgpu__dist.local_size; }

MGPUDEF mgpu_result mgpu_dist_init(int* argc, char*** argv) {
#ifdef MGPU_MPI
    static const char* op = "mgpu_dist_init";
    int running = 0, provided = 0;
    MPI_Comm local;
    if (mgpu__dist.joined) return MGPU_OK;
    MPI_Initialized(&running);
    if (!running) {
        /* the library calls MPI from one thread at a time: the thread that runs the step */
        if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
            return mgpu__fail(MGPU_ERROR_MPI, "%s: MPI_Init_thread failed", op);
        mgpu__dist.called_init = 1;
        if (provided < MPI_THREAD_SERIALIZED)
            mgpu__log(MGPU_LOG_INFO, "%s: this MPI gives thread level %d, not MPI_THREAD_SERIALIZED: call mgpu from the main "
                      "thread only", op, provided);
    }
    if (MPI_Comm_dup(MPI_COMM_WORLD, &mgpu__dist_comm) != MPI_SUCCESS ||
        MPI_Comm_rank(mgpu__dist_comm, &mgpu__dist.rank) != MPI_SUCCESS ||
        MPI_Comm_size(mgpu__dist_comm, &mgpu__dist.size) != MPI_SUCCESS ||
        MPI_Comm_split_type(mgpu__dist_comm, MPI_COMM_TYPE_SHARED, mgpu__dist.rank, MPI_INFO_NULL, &local) != MPI_SUCCESS)
        return mgpu__fail(MGPU_ERROR_MPI, "%s: MPI could not say this process's rank", op);
    MPI_Comm_rank(local, &mgpu__dist.local_rank);
    MPI_Comm_size(local, &mgpu__dist.local_size);
    MPI_Comm_free(&local);
    mgpu__dist_posts.timeout = mgpu__dist_timeout_from_env();
    mgpu__dist_posts.req = (MPI_Request*)mgpu__calloc((size_t)mgpu__dist.size * 2, sizeof(MPI_Request));
    mgpu__dist_posts.peer = (int*)mgpu__calloc((size_t)mgpu__dist.size * 2, sizeof(int));
    mgpu__dist.hosts = (char(*)[64])mgpu__calloc((size_t)mgpu__dist.size, sizeof *mgpu__dist.hosts);
    {   /* every rank's host, for the messages of a rank that does not answer */
        char me[MPI_MAX_PROCESSOR_NAME + 1] = { 0 };
        int len = 0, ok = mgpu__dist_posts.req && mgpu__dist_posts.peer && mgpu__dist.hosts;
        MPI_Get_processor_name(me, &len);
        MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, mgpu__dist_comm);
        if (!ok) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory for %d ranks", op, mgpu__dist.size);
        memcpy(mgpu__dist.hosts[mgpu__dist.rank], me, MGPU__MIN(sizeof *mgpu__dist.hosts - 1, strlen(me)));
        MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, mgpu__dist.hosts, (int)sizeof *mgpu__dist.hosts, MPI_BYTE, mgpu__dist_comm);
    }
    mgpu__dist.joined = 1;
    if (mgpu__dist.local_size > 1 && mgpu__cpu_thread_count <= 0 && !getenv("MGPU_CPU_THREADS")) {
        /* the machine's cores shared among its ranks, not every rank on every core */
        const int share = mgpu_cpu_threads() / mgpu__dist.local_size;
        mgpu_cpu_set_threads(share > 0 ? share : 1);
    }
#else
    (void)argc;
    (void)argv;
    (void)mgpu__dist_timeout_from_env;   /* MPI's */
#endif
    return MGPU_OK;
}

MGPUDEF void mgpu_dist_shutdown(void) {
#ifdef MGPU_MPI
    int i;
    if (!mgpu__dist.joined) return;
    for (i = 0; i < MGPU__DIST_SCRATCH; ++i) {
        MGPU_FREE(mgpu__dist_scratch[i].p);
        mgpu__dist_scratch[i].p = NULL;
        mgpu__dist_scratch[i].floats = 0;
    }
    MGPU_FREE(mgpu__dist_posts.req);
    MGPU_FREE(mgpu__dist_posts.peer);
    MGPU_FREE(mgpu__dist.hosts);
    mgpu__dist_posts.req = NULL;
    mgpu__dist_posts.peer = NULL;
    mgpu__dist.hosts = NULL;
    MPI_Comm_free(&mgpu__dist_comm);
    if (mgpu__dist.called_init) MPI_Finalize();
    mgpu__dist.joined = mgpu__dist.called_init = 0;
    mgpu__dist.rank = mgpu__dist.local_rank = 0;
    mgpu__dist.size = mgpu__dist.local_size = 1;
#endif
}

MGPUDEF void mgpu_dist_abort(int exit_code) {
    fflush(stdout);
    fflush(stderr);
#ifdef MGPU_MPI
    if (mgpu__dist.joined) MPI_Abort(MPI_COMM_WORLD, exit_code);
#endif
    exit(exit_code);
}

/* Every rank tells every other how it fared, in one collective: its result (with its error
   message), a count and a number. A failure anywhere fails every rank with the first failing
   rank's message, so that no rank goes on into a collective the failed one will never reach.
   counts[P] (or NULL) receives each rank's count; *sum the sum of the numbers. A vote every rank
   cannot even hold (no memory for it) ends the job: nothing else would keep the others from
   waiting. */
typedef struct mgpu__dist_vote {
    int64_t count;
    double number;
    int32_t result;
    char text[492];
} mgpu__dist_vote;

static mgpu_result mgpu__dist_agree(mgpu_result mine, int64_t count, double number, int64_t* counts, double* sum) {
#ifdef MGPU_MPI
    mgpu__dist_vote vote, *all;
    int i, failed = -1;
    if (mgpu__dist.size > 1) {
        memset(&vote, 0, sizeof vote);
        vote.count = count;
        vote.number = number;
        vote.result = (int32_t)mine;
        if (mine != MGPU_OK) {   /* the message, cut to fit */
            const char* e = mgpu_last_error();
            const size_t len = strlen(e) < sizeof vote.text - 1 ? strlen(e) : sizeof vote.text - 1;
            memcpy(vote.text, e, len);
        }
        all = (mgpu__dist_vote*)MGPU_MALLOC((size_t)mgpu__dist.size * sizeof *all);
        if (!all) {
            fprintf(stderr, "mgpu: rank %d: out of host memory for a vote of %d ranks\n", mgpu__dist.rank, mgpu__dist.size);
            mgpu_dist_abort(1);
        }
        for (i = 0; i < mgpu__dist.size; ++i) {
            if (i == mgpu__dist.rank) { all[i] = vote; continue; }
            mgpu__dist_post(0, &all[i], (int)sizeof vote, MPI_BYTE, i, MGPU__TAG_VOTE);
            mgpu__dist_post(1, &vote, (int)sizeof vote, MPI_BYTE, i, MGPU__TAG_VOTE);
        }
        mgpu__dist_wait("the vote");
        if (sum) *sum = 0.0;
        for (i = 0; i < mgpu__dist.size; ++i) {
            if (failed < 0 && all[i].result != MGPU_OK) failed = i;
            if (counts) counts[i] = all[i].count;
            if (sum) *sum += all[i].number;
        }
        if (failed >= 0) {
            mgpu__dist_vote f = all[failed];
            MGPU_FREE(all);
            f.text[sizeof f.text - 1] = 0;
            return mgpu__fail((mgpu_result)f.result, "rank %d of %d: %s", failed, mgpu__dist.size, f.text);
        }
        MGPU_FREE(all);
        return MGPU_OK;
    }
#endif
    if (counts) counts[0] = count;
    if (sum) *sum = number;
    return mine;
}

/* A vote before a sum: also every rank's element count, which must be the same everywhere. */
static mgpu_result mgpu__dist_agree_size(const char* op, mgpu_result mine, int64_t n, double number, double* number_sum) {
    int64_t* counts = (int64_t*)mgpu__calloc((size_t)mgpu__dist.size, sizeof(int64_t));
    mgpu_result r;
    int q;
    if (!counts) {   /* cannot even count: end the job rather than leave the others waiting */
        fprintf(stderr, "mgpu: rank %d: %s: out of host memory for %d counts\n", mgpu__dist.rank, op, mgpu__dist.size);
        mgpu_dist_abort(1);
    }
    r = mgpu__dist_agree(mine, n, number, counts, number_sum);
    for (q = 0; r == MGPU_OK && q < mgpu__dist.size; ++q)   /* the same verdict on every rank */
        if (counts[q] != counts[0])
            r = mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: rank %d sums %lld floats, rank 0 %lld", op, q, (long long)counts[q],
                           (long long)counts[0]);
    MGPU_FREE(counts);
    return r;
}

/* Rank 0's bytes to every rank, in pieces MPI's int counts can take. */
static void mgpu__dist_broadcast(void* p, size_t bytes) {
#ifdef MGPU_MPI
    const size_t piece = (size_t)1 << 30;
    size_t at;
    int q;
    for (at = 0; at < bytes; at += piece) {
        const int len = (int)MGPU__MIN(piece, bytes - at);
        if (mgpu__dist.rank != 0) mgpu__dist_post(0, (char*)p + at, len, MPI_BYTE, 0, MGPU__TAG_BROADCAST);
        else for (q = 1; q < mgpu__dist.size; ++q) mgpu__dist_post(1, (char*)p + at, len, MPI_BYTE, q, MGPU__TAG_BROADCAST);
        mgpu__dist_wait("a broadcast from rank 0");
    }
#else
    (void)p; (void)bytes;
#endif
}

/* Whether MPI may be called from any thread, one at a time (SyncBatchNorm's exchange is made by
   one of a step's own threads). */
static int mgpu__dist_serialized(void) {
#ifdef MGPU_MPI
    int level = MPI_THREAD_SINGLE;
    return MPI_Query_thread(&level) == MPI_SUCCESS && level >= MPI_THREAD_SERIALIZED;
#else
    return 1;
#endif
}

/* SyncBatchNorm's meeting across processes (>>parallel meet): all [replicas of the job][width]
   holds this rank's replicas' numbers at their place; every other rank's come into theirs. */
static void mgpu__dist_meet(double* all, size_t width, const int* rank_replicas) {
#ifdef MGPU_MPI
    int q, at = 0, mine = 0;
    for (q = 0; q < mgpu__dist.rank; ++q) mine += rank_replicas[q];
    for (q = 0; q < mgpu__dist.size; at += rank_replicas[q], ++q) {
        if (q == mgpu__dist.rank) continue;
        mgpu__dist_post(0, all + (size_t)at * width, rank_replicas[q] * (int)width, MPI_DOUBLE, q, MGPU__TAG_MEET);
        mgpu__dist_post(1, all + (size_t)mine * width, rank_replicas[mgpu__dist.rank] * (int)width, MPI_DOUBLE, q,
                        MGPU__TAG_MEET);
    }
    mgpu__dist_wait("SyncBatchNorm's exchange");
#else
    (void)all; (void)width; (void)rank_replicas;
#endif
}

/* The sum of ts[0..L) of this process (f32, one size, on any devices) and of every other
   process's, in the order of the job's replicas (rank 0's L_0, then rank 1's, ...), into every
   tensor: ((b0 + b1) + b2) + ..., the order of the host all-reduce of one process with all of
   them, so that the bits do not depend on how the replicas are spread over processes. Each rank
   sums one slice of the buffer from every replica's copy of that slice (a
   reduce-scatter), then every rank gathers every slice (an all-gather), both as messages between
   pairs of ranks that time out (mgpu__dist_wait): 2 (P - 1) / P of a
   buffer per replica goes over the wire, as in a ring. (The slices come unsummed from each
   process, so a process with several replicas sends each of them; its own sum first would change
   the order.) GPU tensors are staged through host memory.
   What can fail on one rank alone (memory, downloads, `mine`: the caller's own result) comes
   first and is voted on, with the element counts (which must agree) and `number` (summed into
   *number_sum); then the collectives, which cannot fail but by ending the job; a failed upload
   is voted on again. Buffers above 2^31 / replicas floats go in pieces. */
static mgpu_result mgpu__dist_sum(const char* op, mgpu_tensor* const* ts, int L, const int* rank_replicas, mgpu_result mine,
                                  double number, double* number_sum) {
#ifdef MGPU_MPI
    const int P = mgpu__dist.size, me = mgpu__dist.rank;
    const size_t n = mine == MGPU_OK ? (size_t)mgpu_tensor_numel(ts[0]) : 0;
    float* bufs[MGPU__MAX_REPLICAS] = { NULL };
    float *host = NULL, *send = NULL, *recv = NULL;
    int *ints = NULL, *send_counts, *send_at, *recv_counts, *recv_at, *slice_counts, *slice_at;
    size_t piece, at, i;
    int q, l, total = 0, staged = 0;
    mgpu_result r = mine;
    if (P <= 1) { if (number_sum) *number_sum = number; return mine; }
    for (l = 0; l < L && n > 0; ++l) MGPU__COUNT(MGPU__DEV(ts[l]), bytes_allreduced, n * sizeof(float));
    for (q = 0; q < P; ++q) total += rank_replicas[q];
    piece = MGPU__MAX((size_t)64, (size_t)(INT32_MAX / MGPU__MAX(L, total)) & ~(size_t)63);
    piece = MGPU__MIN(piece, MGPU__MAX(n, (size_t)1));
    for (l = 0; r == MGPU_OK && l < L; ++l) staged |= !MGPU__IS_CPU(ts[l]);
    if (r == MGPU_OK) {
        ints = (int*)mgpu__calloc((size_t)P * 6, sizeof(int));
        send = mgpu__dist_buffer(0, piece * (size_t)L + 1);
        recv = mgpu__dist_buffer(1, (piece / (size_t)P + 1) * (size_t)total + 1);
        if (staged) host = mgpu__dist_buffer(2, n * (size_t)L + 1);
        if (!ints || !send || !recv || (staged && !host))
            r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory for a sum of %zu floats across processes", op, n);
    }
    for (l = 0; r == MGPU_OK && l < L; ++l) {
        if (MGPU__IS_CPU(ts[l])) { bufs[l] = MGPU__F32(ts[l]); continue; }
        bufs[l] = host + (size_t)l * n;
        r = mgpu_tensor_download(ts[l], bufs[l], n * sizeof(float));
    }
    r = mgpu__dist_agree_size(op, r, (int64_t)n, number, number_sum);
    send_counts = ints;
    send_at = ints + P;
    recv_counts = ints + 2 * P;
    recv_at = ints + 3 * P;
    slice_counts = ints + 4 * P;
    slice_at = ints + 5 * P;
    for (at = 0; r == MGPU_OK && at < n; at += piece) {   /* the collectives, a piece at a time */
        const size_t len = MGPU__MIN(piece, n - at);
        int64_t start, count, my_start, my_count;
        int sent = 0;
        mgpu__split((int64_t)len, P, me, &my_start, &my_count);
        for (q = 0; q < P; ++q) {   /* to rank q: slice q of each of my replicas, one after another */
            mgpu__split((int64_t)len, P, q, &start, &count);
            send_at[q] = sent;
            send_counts[q] = (int)count * L;
            for (l = 0; l < L; ++l, sent += (int)count) memcpy(send + sent, bufs[l] + at + start, (size_t)count * sizeof(float));
            recv_counts[q] = (int)my_count * rank_replicas[q];
            recv_at[q] = q == 0 ? 0 : recv_at[q - 1] + recv_counts[q - 1];
            slice_counts[q] = (int)count;
            slice_at[q] = (int)start;
        }
        for (q = 0; q < P; ++q) {   /* reduce-scatter: my slice of every replica of the job */
            if (q == me) {
                memcpy(recv + recv_at[q], send + send_at[q], (size_t)send_counts[q] * sizeof(float));
                continue;
            }
            mgpu__dist_post(0, recv + recv_at[q], recv_counts[q], MPI_FLOAT, q, MGPU__TAG_SLICES);
            mgpu__dist_post(1, send + send_at[q], send_counts[q], MPI_FLOAT, q, MGPU__TAG_SLICES);
        }
        mgpu__dist_wait("the sum's reduce-scatter");
        for (l = 1; l < total; ++l) {   /* my slice: the job's replicas in order */
            const float* src = recv + (size_t)l * (size_t)my_count;
            for (i = 0; i < (size_t)my_count; ++i) recv[i] += src[i];
        }
        memcpy(bufs[0] + at + my_start, recv, (size_t)my_count * sizeof(float));
        for (q = 0; q < P; ++q) {   /* all-gather: every rank's summed slice */
            if (q == me) continue;
            mgpu__dist_post(0, bufs[0] + at + slice_at[q], slice_counts[q], MPI_FLOAT, q, MGPU__TAG_GATHER);
            mgpu__dist_post(1, bufs[0] + at + my_start, (int)my_count, MPI_FLOAT, q, MGPU__TAG_GATHER);
        }
        mgpu__dist_wait("the sum's all-gather");
    }
    for (l = 1; r == MGPU_OK && l < L; ++l) memcpy(bufs[l], bufs[0], n * sizeof(float));
    if (r == MGPU_OK && staged) {   /* the GPUs get the sum; every rank hears whether all did */
        for (l = 0; r == MGPU_OK && l < L; ++l) r = mgpu_tensor_upload(ts[l], bufs[l], n * sizeof(float));
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    }
    MGPU_FREE(ints);
    return r;
#else
    (void)op; (void)ts; (void)L; (void)rank_replicas;
    if (number_sum) *number_sum = number;
    return mine;
#endif
}

MGPUDEF mgpu_allreduce* mgpu_allreduce_create_distributed(const mgpu_device_set* set, mgpu_allreduce_kind kind) {
    mgpu_allreduce* ar = mgpu_allreduce_create(set, kind);
    int* counts = NULL;
    int64_t* votes = NULL;
    mgpu_result r = ar ? MGPU_OK : mgpu_last_result();
    int q;
    if (mgpu__dist.size <= 1) return ar;
    counts = (int*)mgpu__calloc((size_t)mgpu__dist.size, sizeof(int));
    votes = (int64_t*)mgpu__calloc((size_t)mgpu__dist.size, sizeof(int64_t));
    if (r == MGPU_OK && (!counts || !votes)) r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_allreduce_create_distributed: out of host memory");
    /* every rank learns every rank's device count, or every rank fails */
    if (mgpu__dist_agree(r, ar ? ar->count : 0, 0.0, r == MGPU_OK ? votes : NULL, NULL) != MGPU_OK) {
        MGPU_FREE(counts);
        MGPU_FREE(votes);
        mgpu_allreduce_destroy(ar);
        return NULL;
    }
    for (q = 0; q < mgpu__dist.size; ++q) counts[q] = (int)votes[q];
    MGPU_FREE(votes);
    ar->rank_devices = counts;
    if (mgpu__ar_join_processes(ar, counts, kind, mgpu__deterministic_from_env()) != MGPU_OK) {
        mgpu_allreduce_destroy(ar);
        return NULL;
    }
    return ar;
}

/* GPUs: a communicator of this process's devices made one over every process's devices, NCCL's
   ranks in the job's device order (rank 0's devices first), so that one ncclAllReduce per device
   sums across the whole job, inside the process and between processes at once (NCCL takes the
   machine's links and the network as it finds them). Collective. Where some rank cannot (CPU
   devices, no NCCL, one GPU twice in a process, its initialisation failing), every rank keeps its
   communicator as it was and sums across processes go through MPI and host memory. */
static mgpu_result mgpu__ar_join_processes(mgpu_allreduce* ar, const int* rank_devices, mgpu_allreduce_kind asked,
                                           int deterministic) {
#ifdef MGPU_MPI
    static const char* op = "all-reduce across processes";
    char id[MGPU__CU_NCCL_ID_BYTES];
    void* comms[MGPU__MAX_REPLICAS];
    int ordinals[MGPU__MAX_REPLICAS];
    double able_ranks = 0.0;
    int i, j, q, first = 0, total = 0, able, rc = 0;
    mgpu_result r = MGPU_OK;
    const int cuda = ar && ar->rank[0].dev->kind == MGPU_DEVICE_CUDA;   /* (a CPU model's rank may have none) */
    asked = mgpu__allreduce_from_env(asked);
    able = cuda && (asked == MGPU_ALLREDUCE_AUTO || asked == MGPU_ALLREDUCE_NCCL) && MGPU__CUDA(mgpu__cu_nccl_across_processes()) == 1;
    for (i = 0; able && i < ar->count; ++i) {
        ordinals[i] = ar->rank[i].dev->ordinal;
        for (j = 0; j < i; ++j) able &= ordinals[i] != ordinals[j];
    }
    MGPU__TRY(mgpu__dist_agree(MGPU_OK, 0, able ? 1.0 : 0.0, NULL, &able_ranks));
    if (able_ranks < mgpu__dist.size) {
        if (cuda && mgpu__dist.rank == 0)
            mgpu__log(MGPU_LOG_INFO, "%s: through MPI and host memory (NCCL with ncclCommInitRank, on distinct GPUs, on %d of %d "
                      "ranks)", op, (int)able_ranks, mgpu__dist.size);
        return MGPU_OK;
    }
    for (q = 0; q < mgpu__dist.size; ++q) {
        if (q < mgpu__dist.rank) first += rank_devices[q];
        total += rank_devices[q];
    }
    mgpu__dist_broadcast(&deterministic, sizeof deterministic);   /* NCCL's algorithm must be every rank's */
    if (deterministic) mgpu__nccl_pin();
    for (i = 0; i < ar->count; ++i) comms[i] = NULL;
    if (mgpu__dist.rank == 0 && (rc = MGPU__CUDA(mgpu__cu_nccl_unique_id(id))) != 0) r = mgpu__cu_result(rc, op, ar->rank[0].dev);
    if (mgpu__dist_agree(r, 0, 0.0, NULL, NULL) == MGPU_OK) {
        mgpu__dist_broadcast(id, sizeof id);
        /* (with real NCCL, a rank that fails inside its ncclCommInitRank can leave the others
           waiting in theirs until mpirun ends the job: NCCL's initialisation is collective) */
        if ((rc = MGPU__CUDA(mgpu__cu_nccl_comm_init_ranks(id, total, first, ar->count, ordinals, comms))) != 0)
            r = mgpu__cu_result(rc, op, ar->rank[0].dev);
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    }
    if (r != MGPU_OK) {   /* fall back, nothing lost */
        mgpu__log(MGPU_LOG_WARN, "%s: NCCL's initialisation failed (%s); through MPI and host memory", op, mgpu_last_error());
        for (i = 0; i < ar->count; ++i)
            if (comms[i]) (void)MGPU__CUDA(mgpu__cu_nccl_comm_destroy(comms[i]));
        mgpu_clear_error();
        return MGPU_OK;
    }
    for (i = 0; i < ar->count; ++i) {
        if (ar->rank[i].nccl_comm) (void)MGPU__CUDA(mgpu__cu_nccl_comm_destroy(ar->rank[i].nccl_comm));
        ar->rank[i].nccl_comm = comms[i];
    }
    ar->kind = MGPU_ALLREDUCE_NCCL;
    ar->across_processes = 1;
#else
    (void)ar; (void)rank_devices; (void)asked; (void)deterministic;
#endif
    return MGPU_OK;
}

/* NCCL across processes breaks without a word (a peer gone, a network error): asked before each
   step's vote, so that every rank hears of it. */
static mgpu_result mgpu__ar_check_processes(const mgpu_allreduce* ar) {
    int i, rc;
    for (i = 0; ar && ar->across_processes && i < ar->count; ++i)
        if ((rc = MGPU__CUDA(mgpu__cu_nccl_comm_check(ar->rank[i].nccl_comm))) != 0)
            return mgpu__cu_result(rc, "all-reduce across processes", ar->rank[i].dev);
    return MGPU_OK;
}

/* Or it hangs without a word: the kernels of the ranks left wait for a peer that is gone. So the
   host waits for the GPUs of a step that summed through NCCL across processes by asking
   (cudaEventQuery on the compute streams, which wait for the sums; and ncclCommGetAsyncError)
   instead of blocking, for MGPU_DIST_TIMEOUT seconds; past it the communicators are aborted
   (ncclCommAbort) and the job ends, as when a collective of MPI's times out. Every such step
   waits here, whether or not it asked for its loss (whose download waits for the GPUs anyway):
   a step that did not would otherwise block later, untimed, in the next upload or download. */
static mgpu_result mgpu__ar_wait_processes(mgpu_allreduce* ar) {
#ifdef MGPU_MPI
    static const char* op = "the NCCL all-reduce across processes";
    const double start = mgpu_seconds();
    int i, done, all;
    if (!ar || !ar->across_processes) return MGPU_OK;
    for (i = 0; i < ar->count; ++i)   /* (a distributed model's steps are never graphs: ev_compute is free here) */
        MGPU__CU(op, ar->rank[i].dev, mgpu__cu_event_record(ar->rank[i].dev->ordinal, ar->rank[i].ev_compute, ar->rank[i].dev->stream));
    for (;;) {
        double waited;
        for (i = 0, all = 1; i < ar->count; ++i) {
            MGPU__CU(op, ar->rank[i].dev, mgpu__cu_event_done(ar->rank[i].dev->ordinal, ar->rank[i].ev_compute, &done));
            all &= done;
        }
        if (all) return MGPU_OK;
        MGPU__TRY(mgpu__ar_check_processes(ar));
        waited = mgpu_seconds() - start;
        if (mgpu__dist_posts.timeout > 0 && waited > mgpu__dist_posts.timeout) {
            for (i = 0; i < ar->count; ++i) (void)MGPU__CUDA(mgpu__cu_nccl_comm_abort(ar->rank[i].nccl_comm));
            mgpu__dist_give_up(op, "another rank's GPUs (a rank or a link gone?); the communicators were aborted (ncclCommAbort)",
                               waited);
        }
        mgpu__dist_pause(waited);
    }
#else
    (void)ar;
    return MGPU_OK;
#endif
}

/* ---- >>impl model ----------------------------------------------------------------------- */
typedef struct mgpu__param {
    char name[64];          /* "0.weight" */
    mgpu_shape shape;
    int64_t offset;         /* floats from the start of the whole model's flat layout */
    int tied;               /* the tensor it is a copy of (desc.ties, mgpu__ties_gather), or -1 */
} mgpu__param;

/* A contiguous range of one stage's flat gradient buffer, reduced as one all-reduce as soon as
   the backward pass of its lowest layer is done (buckets go from the last layers to the first). */
typedef struct mgpu__bucket {
    int stage;
    int64_t begin, end;     /* floats, in the whole model's layout */
    int ready_layer;
} mgpu__bucket;

/* One micro-batch in flight on one part: its input, every layer's output and gradient, the
   layers' saved buffers. A part keeps as many as its schedule has micro-batches in flight. */
typedef struct mgpu__slot {
    mgpu_shape in_shape;                /* the input shape the buffers below are sized for */
    mgpu_tensor input;                  /* x of the last forward: a copy of its header (callers
                                           pass slices that live on their stack), storage not owned */
    int has_input;                      /* a complete forward pass to go back through */
    int64_t first_row;                  /* where these rows start in the whole batch */
    int training;
    mgpu_tensor** act;                  /* act[i]: output of layer i (this stage's), [layer_count] */
    mgpu_tensor** dact;                 /* dact[i]: d loss / d act[i], below the stage's last layer: a
                                           view into dflat[i % 2] */
    mgpu_tensor* dflat[2];              /* two buffers the activation gradients take turns in: layer
                                           i's backward reads dact[i] and writes dact[i - 1], and
                                           nothing reads a gradient after the layer below it ran, so
                                           two suffice (at MLP 4096, 64 MiB instead of 256) */
    mgpu_tensor** aux;                  /* the layers' saved buffers, [aux_total] */
    mgpu_tensor *xin;                   /* stages after the first: the input, from the stage before */
    mgpu_tensor *dxin;                  /* d loss / d input: sent back to the stage before */
    mgpu_tensor *dyin;                  /* stages before the last: d loss / d output, from the stage after */
    mgpu_tensor *dout;                  /* the last stage: the loss gradient */
    /* precision MGPU_BF16 (the activations bf16): xin also holds the first stage's input rounded
       to bf16, and dyin the last stage's loss gradient rounded to bf16 */
    mgpu_tensor *wide_out;              /* the last stage: the output widened to f32, what the loss
                                           reads (its gradient written over it, as over a Linear's) */
    mgpu_tensor *wide_dxin;             /* the first stage: d input widened to f32 (input_grad) */
    int has_dxin;                       /* wide_dxin holds the last backward's d input */
} mgpu__slot;

/* Everything one device holds of a model: one stage of one replica (the whole replica when
   there is one stage). Part r * S + s is replica r's stage s, on device r * S + s of the set. */
typedef struct mgpu__part {
    mgpu_device* dev;
    int replica, stage;
    mgpu_tensor *params, *grads;        /* the stage's flat buffers */
    mgpu_tensor* params_bf16;           /* precision MGPU_BF16: params rounded, at each forward */
    mgpu_tensor** pview_bf16;           /* named views into it, like pview */
    mgpu_tensor* bufs;                  /* its flat buffer of buffers, or NULL when it has none */
    mgpu_tensor** bview;                /* named views into it, [buffer_count], like pview */
    mgpu_tensor **pview, **gview;       /* named views into them, [tensor_count]; NULL for the
                                           tensors of other stages */
    mgpu_tensor** tie_in;               /* [tensor_count]: where tied tensor t's gradient comes to
                                           be added into its twin, here, from another device */
    mgpu__slot* slot;                   /* micro-batch k uses slot k % slot_count */
    int slot_count;
    mgpu_tensor *xbuf, *tbuf;           /* the replica's rows of a batch, copied here when x (first
                                           stage) or the target (last stage) lives elsewhere; both
                                           in xbuf when one GPU part takes them from the CPU */
    mgpu__storage xlent, tlent;         /* a CPU part: x's and the target's host memory, lent to this
                                           device without a copy (mgpu__part_slice) */
    mgpu_tensor* step_seed;             /* a CUDA graph's step: the step's Dropout key (mgpu__step_seed) */
    mgpu_tensor* finite;                /* desc.check_finite on a GPU: the gradients' sum of squares (a
                                           double, mgpu__check_finite) */
    struct mgpu__block* held;           /* the blocks of temporaries the graph works in (mgpu__allocator) */
    mgpu_device_counters graph_work;    /* what the graph's capture queued on dev: a launch adds it */
    mgpu_tensor* losses;                /* the last stage: each micro-batch's mean loss, [M] */
    mgpu_tensor* eval;                  /* the last stage, in an evaluation: each chunk's mean loss,
                                           then each chunk's correct count (int32 bits), [2 chunks]
                                           (apart from losses: it never overwrites a step's) */
    int stream_salt;                    /* 0 in the library's own steps; replica+1 in a loop of your own */
    void** events;                      /* CUDA, S > 1: [2M], recorded after forward k and backward k */
    void** bucket_done;                 /* CUDA, with buckets: [bucket_count], recorded in a step's last
                                           backward when the bucket's gradients are done (its stage's) */
    int forwards_done, backwards_done;  /* CPU threads: progress in this step, under pipe_lock */
    double* meet;                       /* desc.sync_batch_norm: this part's numbers for the meeting of
                                           its stage's copies, then the combination (>>parallel meet) */
    size_t meet_len;
    int meet_stopped;                   /* left a meeting because another part failed */
} mgpu__part;

/* The copies of one stage meeting in a step (desc.sync_batch_norm), under pipe_lock: how many
   arrived in this round, the round, and every replica's numbers in the job's order. */
typedef struct mgpu__meet_point {
    int arrived;
    uint64_t round;
    double* all;
    size_t all_len;
} mgpu__meet_point;

struct mgpu_model {
    mgpu_layer** layers;
    int layer_count;
    mgpu_shape input;
    mgpu_dtype input_dtype;
    mgpu_dtype precision;               /* desc.precision: the activations' dtype, F32 or BF16 */
    mgpu_shape output;                  /* the last layer's output for a batch of one */
    mgpu_loss_kind loss;
    uint64_t seed;
    /* Dropout masks are a function of (seed, step, layer, sample row): every forward within a
       step draws the same masks (a gradient check, a recomputation), every optimizer step new
       ones, and rows count on across the micro-batches of a step, so N replicas, M micro-batches
       or K accumulated batches draw exactly what one device on the whole batch would. */
    uint64_t dropout_step;              /* advanced by every optimizer step */
    int64_t rows_in_step;               /* samples already run in this step (accumulation) */
    mgpu__param* tensors;
    int tensor_count;
    int* first_tensor;                  /* [layer_count + 1]: layer i owns tensors [first[i], first[i+1]) */
    int* first_aux;                     /* likewise for aux buffers */
    int64_t flat_floats, param_count;
    /* buffers (running statistics): a second flat layout, in layer order, never optimised */
    mgpu__param* buffers;
    int buffer_count;
    int* first_buffer;                  /* [layer_count + 1]: layer i owns buffers [first[i], first[i+1]) */
    int64_t buf_floats;
    int64_t* stage_boff;                /* [S + 1]: stage s's buffer floats are [stage_boff[s], stage_boff[s+1]) */
    /* the layout: R replicas x S stages, M micro-batches */
    mgpu__part* part;                   /* [R * S] */
    int part_count, replica_count, stage_count, micro_batches;
    mgpu_pipeline_schedule schedule;
    int* stage_layer;                   /* [S + 1]: stage s runs layers [stage_layer[s], stage_layer[s+1]) */
    int64_t* stage_off;                 /* [S + 1]: stage s's floats are [stage_off[s], stage_off[s+1]) */
    int64_t* stage_moved;               /* [S]: the first floats of stage s, those an update moves: tied
                                           copies at a stage's end (GPT-2's head) follow their twins
                                           (mgpu__ties_spread), so the optimizer skips them */
    /* data parallelism */
    mgpu_allreduce** ar;                /* [S]: stage s's R copies; NULL with one replica */
    mgpu__bucket* buckets;              /* gradient buckets, last stage and last layers first */
    int bucket_count;
    int verify_every;
    int check_finite;                   /* desc.check_finite: no update from a NaN or Inf (mgpu__check_finite) */
    int64_t steps;                      /* optimizer steps applied through this model */
    int64_t last_batch;                 /* rows of the last batch run (mgpu_model_last_loss), 0: none */
    int64_t* terms;                     /* [R * M]: the loss's terms (targets not ignored, or rows for
                                           MSE) of each replica's micro-batches of the last batch */
    int64_t last_terms;                 /* their sum: the batch's loss is the terms' mean */
    /* a training step as a CUDA graph (desc.graph, >>impl train) */
    int graph;                          /* asked for, and not found impossible */
    void* graph_exec;                   /* the captured step, or NULL */
    const mgpu_optimizer* graph_opt;    /* the optimizer it updates with */
    mgpu_shape graph_x, graph_t;        /* the batch shapes of the last step */
    int graph_warm;                     /* eager steps of those shapes (the first makes every buffer) */
    void** graph_events;                /* per part, 4: capture fork, capture join, before a launch, after */
    int64_t graph_steps;                /* steps replayed from the graph */
    int capturing;                      /* a step is being captured: Dropout reads its key on the device */
    double graph_terms;                 /* the loss's terms of the captured step (its gradient's scale) */
    uint64_t graph_buffers;             /* where the buffers the graph works in were at its capture */
    int graph_failures, graph_wait;     /* captures failed in a row; eager steps before the next try */
    int grads_reduced;                  /* the gradient buffers hold the sum over replicas */
    int optimizers;                     /* optimizers made for it: its destroy refuses while any */
    const mgpu_device_set* set;         /* counted among its users once the model is made, or NULL */
    char (*task_error)[sizeof mgpu__error_text + 64];   /* CPU parts run on threads: each one's failure,
                                                           prefixed with the part */
#ifndef MGPU_NO_THREADS
    mgpu__mutex pipe_lock;          /* CPU stages on threads: the parts' progress counters */
    mgpu__cond pipe_moved;
    int pipe_sync;                      /* the two above were made */
#endif
    int pipe_failed;                    /* a part failed: the others stop waiting */
    int sync_bn;                        /* desc.sync_batch_norm, with buffers and replicas to meet */
    mgpu__meet_point* meets;            /* [S] with sync_bn */
    struct mgpu__trace* trace;          /* between mgpu_model_trace_start and _stop, else NULL */
    /* a job of several processes (desc.distributed): its replicas are dist_total, this
       process's are dist_first .. dist_first + R - 1 among them, rank q has dist_replicas[q] */
    int dist, dist_first, dist_total;
    int* dist_replicas;                 /* [P] */
    int64_t* dist_rows;                 /* [P]: each rank's rows of the last batch */
    /* Suspect (mgpu_model_suspect): a step failed after it began to change state, so the replicas
       (or stages, ranks, optimizer states) may differ or be half-updated: why, else NULL. Steps,
       mgpu_optimizer_step and saves refuse until mgpu_model_resync or a load clears it. */
    const char* suspect;
    int suspect_flags;                  /* MGPU__SUSPECT_*: what can clear it */
};

/* splitmix64: decorrelates the seeds of layers and steps */
static uint64_t mgpu__mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* A view at `offset` elements into a flat buffer, of its dtype, with a shape. */
static mgpu_tensor* mgpu__view_at(mgpu_tensor* flat, int64_t offset, mgpu_shape shape, const char* op) {
    return mgpu__own(mgpu__tensor_wrap(flat->storage, flat->offset + (size_t)offset * mgpu_dtype_size(flat->dtype), flat->dtype, shape, op));
}

/* SyncBatchNorm (>>parallel meet): the step's model and this thread's part, while a part of a
   model with sync_bn runs its work in a step */
static MGPU__TLS mgpu_model* mgpu__meet_model;
static MGPU__TLS mgpu__part* mgpu__meet_part;
static mgpu__part* mgpu__part_of(const mgpu_model* m, int replica, int stage) {
    return &m->part[replica * m->stage_count + stage];
}

/* What can clear a suspect model: LOAD_ONLY, nothing but a load (replica 0 itself half-updated,
   or ranks of a job); STATES, the optimizer's states may differ too (resync and load need opt). */
#define MGPU__SUSPECT_LOAD_ONLY 1
#define MGPU__SUSPECT_STATES 2
static void mgpu__suspect_mark(mgpu_model* m, const char* why, int flags) {
    if (!m->suspect) m->suspect = why;   /* the first cause is the one to report */
    m->suspect_flags |= flags;
}
/* The refusal of every call that would build on a suspect model (one message for all layouts). */
static mgpu_result mgpu__suspect_refuse(const mgpu_model* m, const char* op) {
    if (!m->suspect) return MGPU_OK;
    if (m->dist || (m->suspect_flags & MGPU__SUSPECT_LOAD_ONLY))
        return mgpu__fail(MGPU_ERROR_DIVERGED, "%s: refused: the model may be half-updated or its %s may differ since %s; "
                          "load a checkpoint (mgpu_model_load%s) to go on", op, m->dist ? "ranks" : "replicas", m->suspect,
                          (m->suspect_flags & MGPU__SUSPECT_STATES) ? " with the optimizer" : "");
    return mgpu__fail(MGPU_ERROR_DIVERGED, "%s: refused: the replicas may differ since %s; call mgpu_model_resync(model, %s) "
                      "to copy replica 0 to the others, or load a checkpoint (mgpu_model_load), to go on", op, m->suspect,
                      (m->suspect_flags & MGPU__SUSPECT_STATES) ? "optimizer" : "NULL or optimizer");
}
/* The stage that runs layer i, and the one that holds tensor t. */
static int mgpu__layer_stage(const mgpu_model* m, int i) {
    int s = 0;
    while (s + 1 < m->stage_count && m->stage_layer[s + 1] <= i) ++s;
    return s;
}
static int mgpu__tensor_stage(const mgpu_model* m, int t) {
    int s = 0;
    while (s + 1 < m->stage_count && m->first_tensor[m->stage_layer[s + 1]] <= t) ++s;
    return s;
}
static int64_t mgpu__stage_floats(const mgpu_model* m, int stage) { return m->stage_off[stage + 1] - m->stage_off[stage]; }
static int64_t mgpu__stage_buf_floats(const mgpu_model* m, int stage) { return m->stage_boff[stage + 1] - m->stage_boff[stage]; }

static void mgpu__slot_free_buffers(mgpu_model* m, mgpu__slot* sl) {
    int i;
    for (i = 0; i < m->layer_count; ++i) {
        if (sl->act) { mgpu__tensor_free(sl->act[i]); sl->act[i] = NULL; }
        if (sl->dact) { mgpu__tensor_free(sl->dact[i]); sl->dact[i] = NULL; }
    }
    for (i = 0; i < 2; ++i) { mgpu__tensor_free(sl->dflat[i]); sl->dflat[i] = NULL; }
    for (i = 0; sl->aux && i < m->first_aux[m->layer_count]; ++i) { mgpu__tensor_free(sl->aux[i]); sl->aux[i] = NULL; }
    sl->in_shape.ndim = -1;
}

/* The shape of a batch of `batch` samples: [batch, sample shape...]. */
static mgpu_shape mgpu__batch_shape(const mgpu_model* m, int64_t batch) {
    mgpu_shape s;
    int i;
    memset(&s, 0, sizeof s);
    s.ndim = m->input.ndim + 1;
    s.dim[0] = batch;
    for (i = 0; i < m->input.ndim; ++i) s.dim[i + 1] = m->input.dim[i];
    return s;
}

/* Output shape of layer i for input shape x. */
static mgpu_result mgpu__layer_output(const mgpu_model* m, int i, mgpu_shape x, mgpu_shape* y) {
    return mgpu__output_shape(m->layers[i], x, y);
}

static uint64_t mgpu__step_seed(const mgpu_model* m, const mgpu__part* p) {
    return mgpu__mix(m->seed ^ mgpu__mix(m->dropout_step) ^ (uint64_t)p->stream_salt);
}
static void mgpu__layer_ctx_for(const mgpu_model* m, const mgpu__part* p, const mgpu__slot* sl, int i, int training,
                                mgpu_layer_ctx* ctx) {
    ctx->device = p->dev;
    ctx->params = p->pview + m->first_tensor[i];
    ctx->params_bf16 = p->pview_bf16 ? p->pview_bf16 + m->first_tensor[i] : NULL;
    ctx->grads = p->gview + m->first_tensor[i];
    ctx->aux = sl->aux + m->first_aux[i];
    ctx->buffers = p->bview + m->first_buffer[i];
    ctx->training = training;
    /* every step a new key; within it, every layer its own counter range, rows within it by
       first_row; a loop of your own (mgpu_model_forward) salts each replica's stream: it does
       not say which rows a replica holds */
    ctx->seed = mgpu__step_seed(m, p);
    ctx->seed_on_device = m->capturing && p->step_seed ? (const uint64_t*)mgpu_tensor_data(p->step_seed) : NULL;
    ctx->offset = (uint64_t)i << 40;
    ctx->first_row = sl->first_row;
}

/* ---- bf16 mixed precision (desc.precision): how each layer takes bf16 activations ----
   NATIVE: the layer's own code runs on bf16 x, y, dy and dx (Linear and Conv1D with the weights'
   bf16 copies, the activations, Flatten, the containers). WIDENED: its f32 code runs on f32
   copies of x and dy (bf16 widens exactly), and its outputs y and dx are rounded once: the
   numbers of a bf16 layer that computes in fp32, as autocast's kernels do, though not its speed.
   (A WIDENED layer's backward reads no y: it is handed the bf16 y as it is.) The parameters of
   mgpu__bf16_weights are a product's weights, taken as their bf16 copies widened, as autocast
   casts a convolution's weight; the others (BatchNorm's, LayerNorm's, the embeddings', the
   biases) stay f32. A container is NATIVE when each child has a path: bf16 passes between its
   children. Layers of your own have no bf16 path yet. */
enum { MGPU__BF16_NONE = 0, MGPU__BF16_NATIVE, MGPU__BF16_WIDENED };
/* bit i: parameter i is a product's weight (attention: c_attn's and c_proj's) */
static unsigned mgpu__bf16_weights(const mgpu_layer* l) {
    return l->vt == &mgpu__conv_vt ? 1u : l->vt == &mgpu__attn_vt ? 5u : 0u;
}
static int mgpu__bf16_path(const mgpu_layer* l) {
    const mgpu_layer_vtable* vt = l->vt;
    int k;
    if (vt == &mgpu__linear_vt || vt == &mgpu__conv1d_vt || vt == &mgpu__relu_vt || vt == &mgpu__gelu_vt || vt == &mgpu__tanh_vt ||
        vt == &mgpu__sigmoid_vt || vt == &mgpu__gelu_tanh_vt || vt == &mgpu__flatten_vt)
        return MGPU__BF16_NATIVE;
    if (vt == &mgpu__conv_vt || vt == &mgpu__pool_vt || vt == &mgpu__bn_vt || vt == &mgpu__gap_vt || vt == &mgpu__dropout_vt ||
        vt == &mgpu__ln_vt || vt == &mgpu__emb_vt || vt == &mgpu__pos_vt || vt == &mgpu__attn_vt)
        return MGPU__BF16_WIDENED;
    if (vt == &mgpu__sequential_vt || vt == &mgpu__residual_vt) {   /* bf16 between its children, each as it can */
        for (k = 0; k < mgpu__box(l)->count; ++k)
            if (mgpu__bf16_path(mgpu__box(l)->kid[k]) == MGPU__BF16_NONE) return MGPU__BF16_NONE;
        return MGPU__BF16_NATIVE;
    }
    return MGPU__BF16_NONE;
}
/* the first layer inside l (itself, or a container's, at any depth) without a bf16 path, or NULL */
static const mgpu_layer* mgpu__bf16_missing(const mgpu_layer* l) {
    int k;
    if (mgpu__bf16_path(l) != MGPU__BF16_NONE) return NULL;
    if (l->vt == &mgpu__sequential_vt || l->vt == &mgpu__residual_vt)
        for (k = 0; k < mgpu__box(l)->count; ++k)
            if (mgpu__bf16_missing(mgpu__box(l)->kid[k])) return mgpu__bf16_missing(mgpu__box(l)->kid[k]);
    return l;
}
/* its model's precision, into l and (a container) its children */
static void mgpu__layer_set_precision(mgpu_layer* l, mgpu_dtype precision) {
    int k;
    l->precision = precision;
    if (l->vt == &mgpu__sequential_vt || l->vt == &mgpu__residual_vt)
        for (k = 0; k < mgpu__box(l)->count; ++k) mgpu__layer_set_precision(mgpu__box(l)->kid[k], precision);
}

#define MGPU__WIDENED_PARAMS 4   /* the most parameters of a layer with a WIDENED path */
/* The temporaries of a widened call: f32 copies of bf16 tensors, from the device's cache. */
typedef struct mgpu__widened {
    mgpu_tensor* temp[4 + MGPU__WIDENED_PARAMS];
    int count;
    mgpu_tensor* params[MGPU__WIDENED_PARAMS];
} mgpu__widened;
/* an f32 tensor of t's shape on its device: t's values widened (copy), or to be written */
static mgpu_tensor* mgpu__widened_temp(mgpu__widened* w, const mgpu_tensor* t, int copy) {
    mgpu_tensor* f = mgpu_tensor_create(MGPU__DEV(t), MGPU_F32, t->shape);
    if (!f) return NULL;
    w->temp[w->count++] = f;
    return copy && mgpu_tensor_convert(f, t, 1.0f, 0.0f) != MGPU_OK ? NULL : f;
}
static void mgpu__widened_free(mgpu__widened* w) {
    while (w->count > 0) mgpu_tensor_destroy(w->temp[--w->count]);
}
/* ctx with a product's weights as their bf16 copies, widened (mgpu__bf16_weights) */
static mgpu_result mgpu__widened_ctx(const mgpu_layer* l, const mgpu_layer_ctx* ctx, mgpu__widened* w, mgpu_layer_ctx* c) {
    const unsigned weights = mgpu__bf16_weights(l);
    int i, n = l->vt->param_count ? l->vt->param_count(l) : 0;
    *c = *ctx;
    if (!weights) return MGPU_OK;
    if (n > MGPU__WIDENED_PARAMS)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d parameters, more than a widened bf16 layer takes (%d)",
                          mgpu_layer_type(l), n, MGPU__WIDENED_PARAMS);
    for (i = 0; i < n; ++i)
        if (!(w->params[i] = (weights >> i) & 1u ? mgpu__widened_temp(w, ctx->params_bf16[i], 1) : ctx->params[i]))
            return mgpu_last_result();
    c->params = w->params;
    return MGPU_OK;
}
static mgpu_tensor* mgpu__widened_input(mgpu__widened* w, const mgpu_tensor* t) {
    return t->dtype == MGPU_BF16 ? mgpu__widened_temp(w, t, 1) : (mgpu_tensor*)t;   /* (token ids as they are) */
}
static mgpu_result mgpu__widened_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu__widened w;
    mgpu_layer_ctx c;
    mgpu_tensor *xf, *yf;
    mgpu_result r;
    w.count = 0;
    r = mgpu__widened_ctx(l, ctx, &w, &c);
    if (r == MGPU_OK && (!(xf = mgpu__widened_input(&w, x)) || !(yf = mgpu__widened_temp(&w, y, 0)))) r = mgpu_last_result();
    if (r == MGPU_OK) r = l->vt->forward(l, &c, xf, yf);
    if (r == MGPU_OK) r = mgpu_tensor_convert(y, yf, 1.0f, 0.0f);
    mgpu__widened_free(&w);
    return r;
}
static mgpu_result mgpu__widened_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                          const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu__widened w;
    mgpu_layer_ctx c;
    mgpu_tensor *xf = NULL, *dyf = NULL, *dxf = NULL;
    mgpu_result r;
    w.count = 0;
    r = mgpu__widened_ctx(l, ctx, &w, &c);
    if (r == MGPU_OK && (!(xf = mgpu__widened_input(&w, x)) || !(dyf = mgpu__widened_input(&w, dy)) ||
                         (dx && !(dxf = mgpu__widened_temp(&w, dx, 0)))))
        r = mgpu_last_result();
    if (r == MGPU_OK) r = l->vt->backward(l, &c, xf, y, dyf, dxf);   /* (y unread: mgpu__bf16_path) */
    if (r == MGPU_OK && dx) r = mgpu_tensor_convert(dx, dxf, 1.0f, 0.0f);
    mgpu__widened_free(&w);
    return r;
}
/* A layer's forward and backward, by a model or a container: widened where its activations are
   bf16 and it has no bf16 code of its own */
static mgpu_result mgpu__layer_run_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    if (y->dtype == MGPU_BF16 && mgpu__bf16_path(l) == MGPU__BF16_WIDENED) return mgpu__widened_forward(l, ctx, x, y);
    return l->vt->forward(l, ctx, x, y);
}
static mgpu_result mgpu__layer_run_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                            const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    if (dy->dtype == MGPU_BF16 && mgpu__bf16_path(l) == MGPU__BF16_WIDENED) return mgpu__widened_backward(l, ctx, x, y, dy, dx);
    return l->vt->backward(l, ctx, x, y, dy, dx);
}

/* ---- traces (mgpu_model_trace_start): slices of work on each part's tracks ---- */
typedef struct mgpu__slice {
    int part, comm;           /* the track: the part's compute stream (0), or its all-reduces (1) */
    char name[40];
    double t0, t1;            /* host work: seconds on mgpu_seconds' clock */
    void *e0, *e1;            /* GPU work: timed events on the track's stream (NULL for host work) */
} mgpu__slice;

typedef struct mgpu__trace {
    mgpu__slice* slices;
    int count, cap, failed;   /* failed: out of memory or events, some slices missing */
    double t_begin;           /* the host clock when the trace started */
    void** base;              /* CUDA: per part, a timed event recorded at the start */
    double* base_host;        /* the host clock when each base event was seen complete */
#ifndef MGPU_NO_THREADS
    mgpu__mutex lock;     /* CPU parts trace from their threads */
#endif
} mgpu__trace;

/* Open a slice on a part's track; on a GPU, `stream` is where its work goes (NULL: host work,
   timed by the host clock). Returns its index, or -1 when not tracing. */
static int mgpu__trace_open(mgpu_model* m, int part, int comm, void* stream, const char* fmt, int k) {
    mgpu__trace* tr = m->trace;
    const mgpu_device* dev = m->part[part].dev;
    mgpu__slice* sl;
    int i = -1;
    if (!tr) return -1;
#ifndef MGPU_NO_THREADS
    mgpu__mutex_lock(&tr->lock);
#endif
    if (tr->count == tr->cap) {
        const int cap = tr->cap ? 2 * tr->cap : 256;
        mgpu__slice* grown = (mgpu__slice*)MGPU_REALLOC(tr->slices, (size_t)cap * sizeof *grown);
        if (grown) { tr->slices = grown; tr->cap = cap; } else tr->failed = 1;
    }
    if (tr->count < tr->cap) {
        i = tr->count++;
        sl = &tr->slices[i];
        memset(sl, 0, sizeof *sl);
        sl->part = part;
        sl->comm = comm;
        snprintf(sl->name, sizeof sl->name, fmt, k);
        if (stream && dev->kind == MGPU_DEVICE_CUDA) {
            if (MGPU__CUDA(mgpu__cu_event_create_timed(dev->ordinal, &sl->e0)) != 0 ||
                MGPU__CUDA(mgpu__cu_event_create_timed(dev->ordinal, &sl->e1)) != 0 ||
                MGPU__CUDA(mgpu__cu_event_record(dev->ordinal, sl->e0, stream)) != 0) {
                tr->failed = 1;   /* the slice stays, without times */
            }
        }
        sl->t0 = mgpu_seconds();
    }
#ifndef MGPU_NO_THREADS
    mgpu__mutex_unlock(&tr->lock);
#endif
    return i;
}
static void mgpu__trace_close(mgpu_model* m, int i, void* stream) {
    mgpu__trace* tr = m->trace;
    mgpu__slice* sl;
    if (!tr || i < 0) return;
#ifndef MGPU_NO_THREADS
    mgpu__mutex_lock(&tr->lock);
#endif
    sl = &tr->slices[i];
    sl->t1 = mgpu_seconds();
    if (sl->e1 && MGPU__CUDA(mgpu__cu_event_record(m->part[sl->part].dev->ordinal, sl->e1, stream)) != 0) tr->failed = 1;
#ifndef MGPU_NO_THREADS
    mgpu__mutex_unlock(&tr->lock);
#endif
}

static void mgpu__trace_free(mgpu_model* m) {
    mgpu__trace* tr = m->trace;
    int i;
    if (!tr) return;
    for (i = 0; i < tr->count; ++i) {
        const int dev = m->part[tr->slices[i].part].dev->ordinal;
        if (tr->slices[i].e0) (void)MGPU__CUDA(mgpu__cu_event_destroy(dev, tr->slices[i].e0));
        if (tr->slices[i].e1) (void)MGPU__CUDA(mgpu__cu_event_destroy(dev, tr->slices[i].e1));
    }
    for (i = 0; tr->base && i < m->part_count; ++i)
        if (tr->base[i]) (void)MGPU__CUDA(mgpu__cu_event_destroy(m->part[i].dev->ordinal, tr->base[i]));
#ifndef MGPU_NO_THREADS
    mgpu__mutex_destroy(&tr->lock);
#endif
    MGPU_FREE(tr->slices);
    MGPU_FREE(tr->base);
    MGPU_FREE(tr->base_host);
    MGPU_FREE(tr);
    m->trace = NULL;
}

MGPUDEF mgpu_result mgpu_model_trace_start(mgpu_model* m) {
    static const char* op = "mgpu_model_trace_start";
    mgpu__trace* tr;
    int i;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op);
    if (m->trace) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: already tracing (mgpu_model_trace_stop first)", op);
    tr = (mgpu__trace*)mgpu__calloc(1, sizeof *tr);
    if (tr) tr->base = (void**)mgpu__calloc((size_t)m->part_count, sizeof(void*));
    if (tr) tr->base_host = (double*)mgpu__calloc((size_t)m->part_count, sizeof(double));
    if (!tr || !tr->base || !tr->base_host) {
        if (tr) { MGPU_FREE(tr->base); MGPU_FREE(tr->base_host); }
        MGPU_FREE(tr);
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    }
#ifndef MGPU_NO_THREADS
    if (mgpu__mutex_init(&tr->lock) != 0) {
        MGPU_FREE(tr->base);
        MGPU_FREE(tr);
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: cannot make a lock", op);
    }
#endif
    m->trace = tr;
    /* Each GPU's times count from its base event, recorded on an idle stream and waited for: the
       host clock then is that GPU's origin on the host's clock (to within the wait's return). */
    for (i = 0; i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        mgpu_result r = mgpu_device_synchronize(p->dev);
        if (r == MGPU_OK && p->dev->kind == MGPU_DEVICE_CUDA) {
            float zero;
            int rc = MGPU__CUDA(mgpu__cu_event_create_timed(p->dev->ordinal, &tr->base[i]));
            if (!rc) rc = MGPU__CUDA(mgpu__cu_event_record(p->dev->ordinal, tr->base[i], p->dev->stream));
            if (!rc) rc = MGPU__CUDA(mgpu__cu_event_elapsed(p->dev->ordinal, tr->base[i], tr->base[i], &zero));
            if (rc) r = mgpu__cu_result(rc, op, p->dev);
        }
        tr->base_host[i] = mgpu_seconds();
        if (r != MGPU_OK) { mgpu__trace_free(m); return r; }
    }
    tr->t_begin = tr->base_host[0];
    return MGPU_OK;
}

/* Each slice's times in microseconds from the start, into t[2i] and t[2i + 1]: the host clock for
   host work, for GPU work its events against its GPU's base event (which waits for them). */
static mgpu_result mgpu__trace_times(const mgpu_model* m, const char* op, double* t) {
    const mgpu__trace* tr = m->trace;
    int i;
    for (i = 0; i < tr->count; ++i) {
        const mgpu__slice* sl = &tr->slices[i];
        const mgpu__part* p = &m->part[sl->part];
        t[2 * i] = (sl->t0 - tr->t_begin) * 1e6;
        t[2 * i + 1] = (sl->t1 - tr->t_begin) * 1e6;
        if (sl->e0 && sl->e1 && tr->base[sl->part]) {   /* GPU work: its own clock, from the start */
            float a = 0.0f, b = 0.0f;
            int rc = MGPU__CUDA(mgpu__cu_event_elapsed(p->dev->ordinal, tr->base[sl->part], sl->e0, &a));
            if (!rc) rc = MGPU__CUDA(mgpu__cu_event_elapsed(p->dev->ordinal, tr->base[sl->part], sl->e1, &b));
            if (rc) return mgpu__cu_result(rc, op, p->dev);
            t[2 * i] = (tr->base_host[sl->part] - tr->t_begin) * 1e6 + (double)a * 1e3;
            t[2 * i + 1] = (tr->base_host[sl->part] - tr->t_begin) * 1e6 + (double)b * 1e3;
        }
        if (t[2 * i + 1] < t[2 * i]) t[2 * i + 1] = t[2 * i];   /* (a slice not closed yet) */
    }
    return MGPU_OK;
}

static void mgpu__trace_title(const mgpu_model* m, char* s, size_t size) {
    snprintf(s, size, "mgpu: %d replica%s x %d stage%s, %d micro-batch%s, %s", m->replica_count, m->replica_count == 1 ? "" : "s",
             m->stage_count, m->stage_count == 1 ? "" : "s", m->micro_batches, m->micro_batches == 1 ? "" : "es",
             m->schedule == MGPU_PIPELINE_GPIPE ? "GPipe" : "1F1B");
}

/* Chrome's trace format: complete events ("ph": "X") in microseconds, one thread per track. */
static void mgpu__trace_json(FILE* f, const mgpu_model* m, const double* t) {
    const mgpu__trace* tr = m->trace;
    char title[160];
    int i;
    mgpu__trace_title(m, title, sizeof title);
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"args\": {\"name\": \"%s\"}}", title);
    for (i = 0; i < 2 * m->part_count; ++i) {
        const mgpu__part* p = &m->part[i / 2];
        fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, \"args\": {\"name\": \"%s: replica %d "
                "stage %d%s\"}}", i, p->dev->label, p->replica, p->stage, i % 2 ? ", all-reduce" : "");
        fprintf(f, ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, \"args\": {\"sort_index\": %d}}", i, i);
    }
    for (i = 0; i < tr->count; ++i)
        fprintf(f, ",\n{\"name\": \"%s\", \"ph\": \"X\", \"pid\": 1, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f}", tr->slices[i].name,
                tr->slices[i].part * 2 + tr->slices[i].comm, t[2 * i], t[2 * i + 1] - t[2 * i]);
    fprintf(f, "\n]}\n");
}

static void mgpu__xml_text(FILE* f, const char* s) {   /* text and attribute values, escaped */
    for (; *s; ++s) {
        if (*s == '&') fputs("&amp;", f);
        else if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

/* The same slices as a picture, for a browser: a row per part's compute stream (and one, thinner,
   for its all-reduces where the trace has any), a box per slice at its times, labelled where it
   is wide enough (every box names itself in its <title>, a browser's tooltip), a time axis below. */
static void mgpu__trace_svg(FILE* f, const mgpu_model* m, const double* t) {
    enum { W = 1200, LEFT = 210, RIGHT = 20, TOP = 44, ROW = 26, COMM_ROW = 14, GAP = 4, PART_GAP = 10 };
    static const char* kinds[4][2] = { { "F", "#4e79a7" }, { "B", "#f28e2b" }, { "ar", "#59a14f" }, { "opt", "#9d7660" } };
    const mgpu__trace* tr = m->trace;
    const double plot = (double)(W - LEFT - RIGHT);
    double t_min = 0.0, t_max = 0.0, span, step, scale, unit, tick;
    const char* unit_name;
    char title[160];
    int i, comm_rows = 0, part_h, height, y_axis;
    for (i = 0; i < tr->count; ++i) {
        if (i == 0 || t[2 * i] < t_min) t_min = t[2 * i];
        if (i == 0 || t[2 * i + 1] > t_max) t_max = t[2 * i + 1];
        comm_rows |= tr->slices[i].comm;
    }
    span = t_max > t_min ? t_max - t_min : 1.0;
    /* ticks every 1, 2 or 5 times a power of ten, about eight of them; ms from 2 ms up */
    step = pow(10.0, floor(log10(span / 8.0)));
    if (span / step > 40.0) step *= 5.0;
    else if (span / step > 16.0) step *= 2.0;
    unit = span >= 2000.0 ? 1000.0 : 1.0;
    unit_name = span >= 2000.0 ? "ms" : "us";
    scale = plot / span;
    part_h = ROW + (comm_rows ? GAP + COMM_ROW : 0) + PART_GAP;
    y_axis = TOP + m->part_count * part_h;
    height = y_axis + 40;
    mgpu__trace_title(m, title, sizeof title);
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"sans-serif\" font-size=\"11\">\n", W, height, W, height);
    fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"14\">", W, height);
    mgpu__xml_text(f, title);
    fprintf(f, "</text>\n");
    for (i = 0; i < 4; ++i)   /* the legend, top right */
        fprintf(f, "<rect x=\"%d\" y=\"10\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%d\" y=\"20\">%s</text>\n", W - 430 + 105 * i,
                kinds[i][1], W - 430 + 105 * i + 16, i == 0 ? "forward F k" : i == 1 ? "backward B k" : i == 2 ? "all-reduce" : "optimizer step");
    for (i = 0; i < m->part_count; ++i) {   /* the rows' names */
        const mgpu__part* p = &m->part[i];
        char name[96];
        const int y = TOP + i * part_h;
        snprintf(name, sizeof name, "%s: replica %d stage %d", p->dev->label, p->replica, p->stage);
        fprintf(f, "<rect class=\"row\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#f2f2f2\"/>\n", LEFT, y, W - LEFT - RIGHT, ROW);
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">", LEFT - 8, y + ROW / 2 + 4);
        mgpu__xml_text(f, name);
        fprintf(f, "</text>\n");
        if (comm_rows)
            fprintf(f, "<rect class=\"row\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#f2f2f2\"/>\n"
                       "<text x=\"%d\" y=\"%d\" text-anchor=\"end\" font-size=\"9\">all-reduce</text>\n",
                    LEFT, y + ROW + GAP, W - LEFT - RIGHT, COMM_ROW, LEFT - 8, y + ROW + GAP + COMM_ROW - 3);
    }
    fprintf(f, "<line class=\"axis\" x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n", LEFT, y_axis, W - RIGHT, y_axis);
    for (tick = ceil(t_min / step) * step; tick <= t_max + 1e-9 * span; tick += step) {
        const double x = LEFT + (tick - t_min) * scale;
        fprintf(f, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"black\"/><text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">%g</text>\n",
                x, y_axis, x, y_axis + 5, x, y_axis + 18, tick / unit);
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s from the trace's start</text>\n", W - RIGHT, y_axis + 34, unit_name);
    for (i = 0; i < tr->count; ++i) {   /* the slices, in the order of the JSON trace */
        const mgpu__slice* sl = &tr->slices[i];
        const int kind = sl->name[0] == 'F' ? 0 : sl->name[0] == 'B' ? 1 : !strncmp(sl->name, "all-reduce", 10) ? 2 : 3;
        const double x = LEFT + (t[2 * i] - t_min) * scale, w = (t[2 * i + 1] - t[2 * i]) * scale;
        const int y = TOP + sl->part * part_h + (sl->comm ? ROW + GAP : 0), h = sl->comm ? COMM_ROW : ROW;
        const char* label = kind < 2 ? sl->name + 2 : kind == 2 ? "AR" : "opt";   /* "F 3": its micro-batch */
        fprintf(f, "<rect class=\"%s\" x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" stroke=\"white\" stroke-width=\"0.5\">"
                   "<title>", kinds[kind][0], x, y, w, h, kinds[kind][1]);
        mgpu__xml_text(f, sl->name);
        fprintf(f, ": %.3f to %.3f %s</title></rect>\n", (t[2 * i] - t_min) / unit, (t[2 * i + 1] - t_min) / unit, unit_name);
        if (w >= 6.5 * (double)strlen(sl->name) + 4.0) label = sl->name;
        if (w >= 6.5 * (double)strlen(label) + 2.0 && h >= ROW) {
            fprintf(f, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\" fill=\"white\">", x + w / 2.0, y + ROW / 2 + 4);
            mgpu__xml_text(f, label);
            fprintf(f, "</text>\n");
        }
    }
    fprintf(f, "</svg>\n");
}

/* ".svg" (any case) at the end of a path asks for the picture */
static int mgpu__path_is_svg(const char* path) {
    const size_t n = strlen(path);
    return n >= 4 && path[n - 4] == '.' && (path[n - 3] | 0x20) == 's' && (path[n - 2] | 0x20) == 'v' && (path[n - 1] | 0x20) == 'g';
}

static mgpu_result mgpu__write_atomic(const char* path, const char* what, int follow_links, int (*body)(FILE* f, const void* user),
                                      const void* user);   /* (>>impl io) */
typedef struct mgpu__trace_body {
    const mgpu_model* m;
    const double* t;
    int svg;
} mgpu__trace_body;
static int mgpu__trace_write_body(FILE* f, const void* user) {
    const mgpu__trace_body* b = (const mgpu__trace_body*)user;
    if (b->svg) mgpu__trace_svg(f, b->m, b->t);
    else mgpu__trace_json(f, b->m, b->t);
    if (!ferror(f)) return 0;
    if (!errno) errno = EIO;
    return 1;
}

/* Written as checkpoints are (mgpu__write_atomic): a temporary file beside path renamed over it,
   so a FIFO, device or folder is refused before anything is opened, and, unlike a checkpoint, a
   symlink too. *written: whether path holds the trace now (also when it misses slices). */
static mgpu_result mgpu__trace_write(mgpu_model* m, const char* path, const char* op, int* written) {
    mgpu__trace* tr = m->trace;
    mgpu_result r;
    mgpu__trace_body body;
    *written = 0;
    double* t = (double*)mgpu__calloc((size_t)tr->count * 2 + 2, sizeof(double));
    if (!t) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    if ((r = mgpu__trace_times(m, op, t)) != MGPU_OK) { MGPU_FREE(t); return r; }
    body.m = m;
    body.t = t;
    body.svg = mgpu__path_is_svg(path);
    r = mgpu__write_atomic(path, "a trace", 0, mgpu__trace_write_body, &body);
    MGPU_FREE(t);
    if (r != MGPU_OK) return mgpu__refail(op);
    *written = 1;
    if (tr->failed) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: '%s' misses slices (out of host memory or CUDA events)", op, path);
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_model_trace_write(mgpu_model* m, const char* path) {
    static const char* op = "mgpu_model_trace_write";
    int written;
    if (!m || !path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model or path", op);
    if (!m->trace) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: not tracing (mgpu_model_trace_start first)", op);
    return mgpu__trace_write(m, path, op, &written);
}

MGPUDEF mgpu_result mgpu_model_trace_stop(mgpu_model* m, const char* path) {
    static const char* op = "mgpu_model_trace_stop";
    mgpu_result r;
    int written;
    if (!m || !path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model or path", op);
    if (!m->trace) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: not tracing (mgpu_model_trace_start first)", op);
    r = mgpu__trace_write(m, path, op, &written);
    if (written) mgpu__trace_free(m);   /* else kept, for a retry to another path */
    return r;
}

/* Forget the captured step (desc.graph): the blocks its temporaries live in go back to the
   caches (whatever takes them next is queued after the graph's last launch on their stream). */
static void mgpu__graph_drop(mgpu_model* m) {
    int i;
    if (m->graph_exec && MGPU__CUDA(mgpu__cu_graph_destroy(m->part[0].dev->ordinal, m->graph_exec)) != 0)
        mgpu__log(MGPU_LOG_WARN, "destroying a model's CUDA graph: %s", mgpu__cuda_message());
    m->graph_exec = NULL;
    for (i = 0; m->part && i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        if (!p->held) continue;   /* (nor a device yet, in a model whose making failed) */
        mgpu__lock(&p->dev->alloc);
        while (p->held) {
            mgpu__block* b = p->held;
            p->held = b->next;
            mgpu__put_block(&p->dev->alloc.cached, b);
        }
        mgpu__unlock(&p->dev->alloc);
    }
}

static void mgpu__model_free(mgpu_model* m) {
    int i, j;
    if (!m) return;
    mgpu__live_remove(m, MGPU__LIVE_MODEL);
    mgpu__trace_free(m);
    for (i = 0; m->part && i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        for (j = 0; p->slot && j < p->slot_count; ++j) {
            mgpu__slot* sl = &p->slot[j];
            mgpu__slot_free_buffers(m, sl);
            mgpu__tensor_free(sl->xin); mgpu__tensor_free(sl->dxin); mgpu__tensor_free(sl->dyin); mgpu__tensor_free(sl->dout);
            mgpu__tensor_free(sl->wide_out); mgpu__tensor_free(sl->wide_dxin);
            MGPU_FREE(sl->act); MGPU_FREE(sl->dact); MGPU_FREE(sl->aux);
        }
        for (j = 0; j < m->tensor_count; ++j) {
            if (p->pview) mgpu__tensor_free(p->pview[j]);
            if (p->pview_bf16) mgpu__tensor_free(p->pview_bf16[j]);
            if (p->gview) mgpu__tensor_free(p->gview[j]);
        }
        MGPU_FREE(p->pview_bf16);
        mgpu__tensor_free(p->params_bf16);
        for (j = 0; p->bview && j < m->buffer_count; ++j) mgpu__tensor_free(p->bview[j]);
        mgpu__tensor_free(p->bufs);
        MGPU_FREE(p->bview);
        for (j = 0; p->events && j < 2 * m->micro_batches; ++j)
            if (p->events[j]) (void)MGPU__CUDA(mgpu__cu_event_destroy(p->dev->ordinal, p->events[j]));
        mgpu__tensor_free(p->params); mgpu__tensor_free(p->grads);
        mgpu__tensor_free(p->xbuf); mgpu__tensor_free(p->tbuf); mgpu__tensor_free(p->losses); mgpu__tensor_free(p->eval); mgpu__tensor_free(p->step_seed);
        mgpu__tensor_free(p->finite);
        MGPU_FREE(p->meet);
        for (j = 0; p->bucket_done && j < m->bucket_count; ++j)
            if (p->bucket_done[j]) (void)MGPU__CUDA(mgpu__cu_event_destroy(p->dev->ordinal, p->bucket_done[j]));
        for (j = 0; p->tie_in && j < m->tensor_count; ++j) mgpu__tensor_free(p->tie_in[j]);
        MGPU_FREE(p->tie_in);
        MGPU_FREE(p->pview); MGPU_FREE(p->gview); MGPU_FREE(p->slot); MGPU_FREE(p->events); MGPU_FREE(p->bucket_done);
    }
    mgpu__graph_drop(m);
    for (i = 0; m->graph_events && i < 4 * m->part_count; ++i)
        if (m->graph_events[i]) (void)MGPU__CUDA(mgpu__cu_event_destroy(m->part[i / 4].dev->ordinal, m->graph_events[i]));
    MGPU_FREE(m->graph_events);
    for (i = 0; m->ar && i < m->stage_count; ++i) mgpu__allreduce_free(m->ar[i]);
    MGPU_FREE(m->ar);
    MGPU_FREE(m->buckets);
    MGPU_FREE(m->task_error);
    for (i = 0; m->meets && i < m->stage_count; ++i) MGPU_FREE(m->meets[i].all);
    MGPU_FREE(m->meets);
#ifndef MGPU_NO_THREADS
    if (m->pipe_sync) { mgpu__mutex_destroy(&m->pipe_lock); mgpu__cond_destroy(&m->pipe_moved); }
#endif
    for (i = 0; m->layers && i < m->layer_count; ++i) mgpu__layer_free(m->layers[i]);   /* distinct: checked at create */
    if (m->set) mgpu__set_users(m->set, -1, 0);
    MGPU_FREE(m->layers); MGPU_FREE(m->part); MGPU_FREE(m->tensors); MGPU_FREE(m->first_tensor); MGPU_FREE(m->first_aux);
    MGPU_FREE(m->buffers); MGPU_FREE(m->first_buffer); MGPU_FREE(m->stage_boff);
    MGPU_FREE(m->stage_layer); MGPU_FREE(m->stage_off); MGPU_FREE(m->stage_moved); MGPU_FREE(m->dist_replicas); MGPU_FREE(m->dist_rows);
    MGPU_FREE(m->terms);
    MGPU_FREE(m);
}

MGPUDEF mgpu_result mgpu_model_destroy(mgpu_model* m) {
    if (!m) return MGPU_OK;
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, "mgpu_model_destroy", "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (m->optimizers)
        return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_model_destroy: %d optimizer%s still use%s this model; destroy %s first",
                          m->optimizers, m->optimizers == 1 ? "" : "s", m->optimizers == 1 ? "s" : "",
                          m->optimizers == 1 ? "it" : "them");
    mgpu__model_free(m);
    return MGPU_OK;
}

static mgpu_model* mgpu__model_fail(mgpu_model* m, const char* where) {
    mgpu__refail(where);
    mgpu__model_free(m);
    return NULL;
}

/* Cut each stage's flat gradient buffer into buckets, walking its tensors from the last layer
   back: a small first bucket (1 MiB, or bucket_bytes if smaller) so communication starts early,
   then buckets of about bucket_bytes. Whole tensors only; together a stage's buckets tile its
   buffer. The last stage's buckets come first: its backward ends first. */
static mgpu_result mgpu__make_buckets(mgpu_model* m, size_t bucket_bytes) {
    const size_t first_bytes = MGPU__MIN(bucket_bytes, (size_t)1 << 20);
    int s, t;
    m->buckets = (mgpu__bucket*)mgpu__calloc((size_t)m->tensor_count + 1, sizeof(mgpu__bucket));
    if (!m->buckets) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory for gradient buckets");
    m->bucket_count = 0;
    for (s = m->stage_count - 1; s >= 0; --s) {
        const int t0 = m->first_tensor[m->stage_layer[s]], t1 = m->first_tensor[m->stage_layer[s + 1]];
        int64_t end = m->stage_off[s + 1];
        int layer = m->stage_layer[s + 1] - 1, first = 1;
        for (t = t1 - 1; t >= t0; --t) {
            const size_t limit = first ? first_bytes : bucket_bytes;
            while (layer > m->stage_layer[s] && m->first_tensor[layer] > t) --layer;   /* the layer owning tensor t */
            if ((size_t)(end - m->tensors[t].offset) * sizeof(float) >= limit || t == t0) {
                mgpu__bucket* b = &m->buckets[m->bucket_count++];
                b->stage = s;
                b->begin = t == t0 ? m->stage_off[s] : m->tensors[t].offset;
                b->end = end;
                b->ready_layer = layer;
                end = b->begin;
                first = 0;
            }
        }
    }
    return MGPU_OK;
}

/* Step 1 of a model: walk the shapes with a batch of one (every layer must accept what the
   previous one gives), count each layer's parameters and saved buffers, and lay the parameters
   out in one flat layout, each at a 64-byte boundary, named as in PyTorch's state_dict. */
static mgpu_result mgpu__model_layout(mgpu_model* m, const mgpu_model_desc* desc) {
    static const char* op = "mgpu_model_create";
    mgpu_shape shape = mgpu__batch_shape(m, 1);
    char where[96];
    int i, j, t;
    m->first_tensor = (int*)mgpu__calloc((size_t)m->layer_count + 1, sizeof(int));
    m->first_aux = (int*)mgpu__calloc((size_t)m->layer_count + 1, sizeof(int));
    m->first_buffer = (int*)mgpu__calloc((size_t)m->layer_count + 1, sizeof(int));
    if (!m->first_tensor || !m->first_aux || !m->first_buffer) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (i = 0; i < m->layer_count; ++i) {
        const mgpu_layer* l = m->layers[i];
        int pc = l->vt->param_count ? l->vt->param_count(l) : 0;
        int ac = l->vt->aux_count ? l->vt->aux_count(l) : 0;
        int bc = l->vt->buffer_count ? l->vt->buffer_count(l) : 0;
        snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(l));
        if (mgpu__layer_output(m, i, shape, &shape) != MGPU_OK) return mgpu__refail(where);
        if (pc < 0 || ac < 0 || bc < 0) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: negative parameter or buffer count", where);
        m->first_tensor[i + 1] = m->first_tensor[i] + pc;
        m->first_aux[i + 1] = m->first_aux[i] + ac;
        m->first_buffer[i + 1] = m->first_buffer[i] + bc;
    }
    m->buffer_count = m->first_buffer[m->layer_count];
    m->buffers = (mgpu__param*)mgpu__calloc((size_t)MGPU__MAX(m->buffer_count, 1), sizeof(mgpu__param));
    if (!m->buffers) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (i = 0, t = 0; i < m->layer_count; ++i) {   /* buffers: named as parameters are, laid out as they are */
        const mgpu_layer* l = m->layers[i];
        for (j = 0; j < m->first_buffer[i + 1] - m->first_buffer[i]; ++j, ++t) {
            const char* name = "buffer";
            size_t bytes;
            mgpu__param* b = &m->buffers[t];
            snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(l));
            if (l->vt->buffer_shape(l, j, &name, &b->shape) != MGPU_OK ||
                mgpu__check_shape("buffer shape", MGPU_F32, b->shape, &bytes) != MGPU_OK)
                return mgpu__refail(where);
            mgpu__param_name(b->name, sizeof b->name, l, i, name);
            b->tied = -1;
            b->offset = m->buf_floats;
            m->buf_floats += (mgpu_shape_numel(b->shape) + 15) / 16 * 16;
        }
    }
    m->output = shape;
    m->tensor_count = m->first_tensor[m->layer_count];
    m->tensors = (mgpu__param*)mgpu__calloc((size_t)MGPU__MAX(m->tensor_count, 1), sizeof(mgpu__param));
    if (!m->tensors) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (i = 0, t = 0; i < m->layer_count; ++i) {
        const mgpu_layer* l = m->layers[i];
        for (j = 0; j < m->first_tensor[i + 1] - m->first_tensor[i]; ++j, ++t) {
            const char* name = "param";
            size_t bytes;
            snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(l));
            if (l->vt->param_shape(l, j, &name, &m->tensors[t].shape) != MGPU_OK ||
                mgpu__check_shape("parameter shape", MGPU_F32, m->tensors[t].shape, &bytes) != MGPU_OK)
                return mgpu__refail(where);
            mgpu__param_name(m->tensors[t].name, sizeof m->tensors[t].name, l, i, name);
            m->tensors[t].tied = -1;
        }
    }
    for (i = 0; i < desc->tie_count; ++i) {   /* ties, checked before any tensor gets a place */
        const char* p = desc->ties ? desc->ties[i].param : NULL;
        const char* to = desc->ties ? desc->ties[i].to : NULL;
        int a = -1, b = -1;
        char sa[64], sb[64];
        for (t = 0; t < m->tensor_count && p && to; ++t) {
            if (!strcmp(m->tensors[t].name, p)) a = t;
            if (!strcmp(m->tensors[t].name, to)) b = t;
        }
        if (a < 0 || b < 0 || a == b || m->tensors[a].tied >= 0 || m->tensors[b].tied >= 0)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: tie %d ('%s' to '%s'): %s", op, i, p ? p : "NULL", to ? to : "NULL",
                              a < 0 || b < 0 ? "no parameter of that name (mgpu_model_tensor_name lists them)" :
                              a == b ? "a parameter tied to itself" : "tied already (tie each to the one that stays)");
        if (!mgpu_shape_equal(m->tensors[a].shape, m->tensors[b].shape))
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: tie %d: '%s' %s and '%s' %s have different shapes", op, i, p,
                              mgpu__shape_text(m->tensors[a].shape, sa, sizeof sa), to, mgpu__shape_text(m->tensors[b].shape, sb, sizeof sb));
        m->tensors[a].tied = b;
    }
    for (t = 0; t < m->tensor_count; ++t) {   /* each at a 64-byte boundary, a tied one too (its twin's copy) */
        m->tensors[t].offset = m->flat_floats;
        if (m->tensors[t].tied < 0) m->param_count += mgpu_shape_numel(m->tensors[t].shape);
        m->flat_floats += (mgpu_shape_numel(m->tensors[t].shape) + 15) / 16 * 16;
    }
    return MGPU_OK;
}

#define MGPU__MAX_STAGES 64   /* the queueing of a GPU step keeps a few counters per stage */

/* Step 2: the cut into stages, explicit (split) or balanced: the cut whose largest stage holds
   the fewest parameters (a small dynamic programme over the layers; ties go to the earliest
   cut). Then where each stage's floats lie in the flat layout. */
static mgpu_result mgpu__model_stages(mgpu_model* m, const mgpu_model_desc* desc, int devices) {
    static const char* op = "mgpu_model_create";
    const int S = m->stage_count, L = m->layer_count;
    int s, i;
    if (S < 1 || S > L || S > MGPU__MAX_STAGES)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d stages for a model of %d layer%s (want 1 to %d: every stage "
                          "needs a layer, and %d at most)", op, S, L, L == 1 ? "" : "s", MGPU__MIN(L, MGPU__MAX_STAGES),
                          MGPU__MAX_STAGES);
    if (devices % S != 0)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d device%s cannot hold whole replicas of %d stages (want R x %d "
                          "devices: replica r's stage s on device r * %d + s)", op, devices, devices == 1 ? "" : "s", S, S, S);
    m->stage_layer = (int*)mgpu__calloc((size_t)S + 1, sizeof(int));
    m->stage_off = (int64_t*)mgpu__calloc((size_t)S + 1, sizeof(int64_t));
    m->stage_moved = (int64_t*)mgpu__calloc((size_t)S, sizeof(int64_t));
    m->stage_boff = (int64_t*)mgpu__calloc((size_t)S + 1, sizeof(int64_t));
    if (!m->stage_layer || !m->stage_off || !m->stage_moved || !m->stage_boff) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    m->stage_layer[S] = L;
    if (desc->split && S > 1) {
        for (s = 1; s < S; ++s) {
            const int first = desc->split[s - 1], before = m->stage_layer[s - 1];
            if (first <= before || first >= L)
                return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: split[%d] = %d: stage %d would %s (the first layers of "
                                  "stages 1 to %d must rise from 1 to at most %d)", op, s - 1, first, first <= before ? s - 1 : s,
                                  "be empty", S - 1, L - 1);
            m->stage_layer[s] = first;
        }
    } else if (S > 1) {
        /* cost[s][i]: the least largest stage when layers [0, i) make s + 1 stages */
        int64_t* prefix = (int64_t*)mgpu__calloc((size_t)L + 1, sizeof(int64_t));
        int64_t* cost = (int64_t*)mgpu__calloc((size_t)S * (size_t)(L + 1), sizeof(int64_t));
        int* cut = (int*)mgpu__calloc((size_t)S * (size_t)(L + 1), sizeof(int));
        if (!prefix || !cost || !cut) {
            MGPU_FREE(prefix); MGPU_FREE(cost); MGPU_FREE(cut);
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        }
        for (i = 0; i < L; ++i) {
            int t;
            prefix[i + 1] = prefix[i];
            for (t = m->first_tensor[i]; t < m->first_tensor[i + 1]; ++t) prefix[i + 1] += mgpu_shape_numel(m->tensors[t].shape);
        }
        for (i = 1; i <= L; ++i) cost[i] = prefix[i];
        for (s = 1; s < S; ++s)
            for (i = s + 1; i <= L; ++i) {
                int j;
                cost[s * (L + 1) + i] = INT64_MAX;
                for (j = s; j < i; ++j) {   /* the last stage is layers [j, i) */
                    const int64_t c = MGPU__MAX(cost[(s - 1) * (L + 1) + j], prefix[i] - prefix[j]);
                    if (c < cost[s * (L + 1) + i]) { cost[s * (L + 1) + i] = c; cut[s * (L + 1) + i] = j; }
                }
            }
        for (s = S - 1, i = L; s >= 1; --s) i = m->stage_layer[s] = cut[s * (L + 1) + i];
        MGPU_FREE(prefix); MGPU_FREE(cost); MGPU_FREE(cut);
    }
    for (s = 0; s < S; ++s) {
        const int t = m->first_tensor[m->stage_layer[s]];
        m->stage_off[s] = t < m->tensor_count ? m->tensors[t].offset : m->flat_floats;
    }
    m->stage_off[S] = m->flat_floats;
    for (s = 0; s < S; ++s) {   /* the stage's floats, less the tied copies at its end */
        int t = m->first_tensor[m->stage_layer[s + 1]] - 1;
        m->stage_moved[s] = m->stage_off[s + 1] - m->stage_off[s];
        for (; t >= m->first_tensor[m->stage_layer[s]] && m->tensors[t].tied >= 0; --t) m->stage_moved[s] = m->tensors[t].offset - m->stage_off[s];
    }
    for (s = 0; s < S; ++s) {   /* a buffer lives on its layer's stage */
        const int b = m->first_buffer[m->stage_layer[s]];
        m->stage_boff[s] = b < m->buffer_count ? m->buffers[b].offset : m->buf_floats;
    }
    m->stage_boff[S] = m->buf_floats;
    return MGPU_OK;
}

/* How many micro-batches stage s has in flight at most: its slots. */
static int mgpu__slot_count(const mgpu_model* m, int s) {
    return m->schedule == MGPU_PIPELINE_GPIPE ? m->micro_batches : MGPU__MIN(m->stage_count - s, m->micro_batches);
}

/* Step 3: one part per device, each with its stage's flat parameter and gradient buffers
   (zeroed), the named views into them, and its slots. */
static mgpu_result mgpu__model_parts(mgpu_model* m, const mgpu_device_set* devices) {
    static const char* op = "mgpu_model_create";
    const int aux_total = m->first_aux[m->layer_count];
    int i, j, t;
    m->part = (mgpu__part*)mgpu__calloc((size_t)m->part_count, sizeof(mgpu__part));
    if (!m->part) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (i = 0; i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        const int64_t floats = MGPU__MAX(mgpu__stage_floats(m, i % m->stage_count), 1);
        p->replica = i / m->stage_count;
        p->stage = i % m->stage_count;
        p->dev = devices ? devices->devices[i] : mgpu_device_cpu();
        p->slot_count = mgpu__slot_count(m, p->stage);
        p->slot = (mgpu__slot*)mgpu__calloc((size_t)p->slot_count, sizeof(mgpu__slot));
        p->pview = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(m->tensor_count, 1), sizeof(mgpu_tensor*));
        p->gview = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(m->tensor_count, 1), sizeof(mgpu_tensor*));
        p->bview = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(m->buffer_count, 1), sizeof(mgpu_tensor*));
        p->tie_in = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(m->tensor_count, 1), sizeof(mgpu_tensor*));
        if (!p->slot || !p->pview || !p->gview || !p->bview || !p->tie_in)
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        for (j = 0; j < p->slot_count; ++j) {
            mgpu__slot* sl = &p->slot[j];
            sl->in_shape.ndim = -1;
            sl->act = (mgpu_tensor**)mgpu__calloc((size_t)m->layer_count, sizeof(mgpu_tensor*));
            sl->dact = (mgpu_tensor**)mgpu__calloc((size_t)m->layer_count, sizeof(mgpu_tensor*));
            sl->aux = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(aux_total, 1), sizeof(mgpu_tensor*));
            if (!sl->act || !sl->dact || !sl->aux) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        }
        p->params = mgpu__own(mgpu_tensor_create(p->dev, MGPU_F32, mgpu_shape1(floats)));
        p->grads = mgpu__own(mgpu_tensor_create(p->dev, MGPU_F32, mgpu_shape1(floats)));
        if (!p->params || !p->grads || mgpu_tensor_zero(p->params) || mgpu_tensor_zero(p->grads)) return mgpu__refail(op);
        if (m->precision == MGPU_BF16) {   /* (its values come at each forward) */
            p->params_bf16 = mgpu__own(mgpu_tensor_create(p->dev, MGPU_BF16, mgpu_shape1(floats)));
            p->pview_bf16 = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(m->tensor_count, 1), sizeof(mgpu_tensor*));
            if (!p->params_bf16) return mgpu__refail(op);
            if (!p->pview_bf16) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        }
        if (p->stage == m->stage_count - 1) {
            p->losses = mgpu__own(mgpu_tensor_create(p->dev, MGPU_F32, mgpu_shape1(m->micro_batches)));
            if (!p->losses || mgpu_tensor_zero(p->losses)) return mgpu__refail(op);
        }
        for (t = m->first_tensor[m->stage_layer[p->stage]]; t < m->first_tensor[m->stage_layer[p->stage + 1]]; ++t) {
            const int64_t at = m->tensors[t].offset - m->stage_off[p->stage];
            p->pview[t] = mgpu__view_at(p->params, at, m->tensors[t].shape, op);
            p->gview[t] = mgpu__view_at(p->grads, at, m->tensors[t].shape, op);
            if (!p->pview[t] || !p->gview[t]) return mgpu__refail(op);
            if (p->params_bf16 && !(p->pview_bf16[t] = mgpu__view_at(p->params_bf16, at, m->tensors[t].shape, op))) return mgpu__refail(op);
        }
        for (t = 0; t < m->tensor_count; ++t)   /* a tie from another stage: its gradient comes here first */
            if (m->tensors[t].tied >= 0 && mgpu__tensor_stage(m, m->tensors[t].tied) == p->stage && mgpu__tensor_stage(m, t) != p->stage &&
                !(p->tie_in[t] = mgpu__own(mgpu_tensor_create(p->dev, MGPU_F32, m->tensors[t].shape))))
                return mgpu__refail(op);
        if (mgpu__stage_buf_floats(m, p->stage) > 0) {   /* buffers start at 0 (then the layers' init) */
            p->bufs = mgpu__own(mgpu_tensor_create(p->dev, MGPU_F32, mgpu_shape1(mgpu__stage_buf_floats(m, p->stage))));
            if (!p->bufs || mgpu_tensor_zero(p->bufs)) return mgpu__refail(op);
            for (t = m->first_buffer[m->stage_layer[p->stage]]; t < m->first_buffer[m->stage_layer[p->stage + 1]]; ++t) {
                p->bview[t] = mgpu__view_at(p->bufs, m->buffers[t].offset - m->stage_boff[p->stage], m->buffers[t].shape, op);
                if (!p->bview[t]) return mgpu__refail(op);
            }
        }
        if (p->dev->kind == MGPU_DEVICE_CUDA && m->stage_count > 1) {   /* the order between stages' streams */
            p->events = (void**)mgpu__calloc((size_t)2 * (size_t)m->micro_batches, sizeof(void*));
            if (!p->events) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
            for (j = 0; j < 2 * m->micro_batches; ++j)
                MGPU__CU(op, p->dev, mgpu__cu_event_create(p->dev->ordinal, &p->events[j]));
        }
    }
    return MGPU_OK;
}

/* Tied parameters (desc.ties). Each tensor has its own place in the flat buffers, a tied one
   too: it holds a copy of its twin's values, and its layer's backward adds into its own
   gradient, from zero, as any layer's does. Before an update each tie's gradient is added into
   its twin's (twin + tied, one addition per float, the same on every layout) and set to zero;
   the update then moves the twin alone, and the copy follows it. So one device and a pipeline
   whose stages hold the two ends (GPT-2's token embedding in the first, its output head in the
   last, as Megatron-LM's pipelines have them) give the same bits, and the clipping norm counts
   each gradient once. Across devices the gradient travels to the twin's device (part->tie_in)
   and the values back, copies ordered by events, so a CUDA graph holds them too. */
static mgpu_result mgpu__ties_gather(mgpu_model* m, const char* op) {
    int r, t;
    for (r = 0; r < m->replica_count; ++r)
        for (t = 0; t < m->tensor_count; ++t) {
            const int twin = m->tensors[t].tied;
            mgpu__part *from, *to;
            mgpu_tensor* g;
            if (twin < 0) continue;
            from = mgpu__part_of(m, r, mgpu__tensor_stage(m, t));
            to = mgpu__part_of(m, r, mgpu__tensor_stage(m, twin));
            g = to->tie_in[t] ? to->tie_in[t] : from->gview[t];
            if ((g != from->gview[t] && mgpu_tensor_copy(g, from->gview[t]) != MGPU_OK) || mgpu_axpy(to->gview[twin], 1.0f, g) != MGPU_OK ||
                mgpu_tensor_zero(from->gview[t]) != MGPU_OK) {
                char where[192];
                snprintf(where, sizeof where, "%s: adding the gradient of '%s' into '%s''s (tied)", op, m->tensors[t].name, m->tensors[twin].name);
                return mgpu__refail(where);
            }
        }
    return MGPU_OK;
}
static mgpu_result mgpu__ties_spread(mgpu_model* m, const char* op) {
    int r, t;
    for (r = 0; r < m->replica_count; ++r)
        for (t = 0; t < m->tensor_count; ++t) {
            const int twin = m->tensors[t].tied;
            if (twin >= 0 && mgpu_tensor_copy(mgpu__part_of(m, r, mgpu__tensor_stage(m, t))->pview[t],
                                              mgpu__part_of(m, r, mgpu__tensor_stage(m, twin))->pview[twin]) != MGPU_OK) {
                char where[192];
                snprintf(where, sizeof where, "%s: copying '%s' into '%s' (tied)", op, m->tensors[twin].name, m->tensors[t].name);
                return mgpu__refail(where);
            }
        }
    return MGPU_OK;
}

/* Step 4, data parallelism's first move (replicate): initialise on replica 0, then copy to every
   other replica, so all start from the same model. Never again: replicas stay in step because
   each takes the same update (>>train). */
static mgpu_result mgpu__model_init(mgpu_model* m) {
    char where[96];
    int i;
    for (i = 0; i < m->layer_count; ++i) {
        const mgpu_layer* l = m->layers[i];
        const mgpu__part* p = mgpu__part_of(m, 0, mgpu__layer_stage(m, i));
        mgpu_layer_ctx ctx;
        const int n = m->first_tensor[i + 1] - m->first_tensor[i];
        const int nb = m->first_buffer[i + 1] - m->first_buffer[i];
        if (!l->vt->init || (n == 0 && nb == 0)) continue;
        mgpu__layer_ctx_for(m, p, &p->slot[0], i, 0, &ctx);
        snprintf(where, sizeof where, "mgpu_model_create: initialising layer %d (%s)", i, mgpu_layer_type(l));
        if (l->vt->init(l, &ctx, mgpu__mix(m->seed + (uint64_t)i)) != MGPU_OK) return mgpu__refail(where);
    }
    for (i = m->stage_count; i < m->part_count; ++i)
        if (mgpu_tensor_copy(m->part[i].params, m->part[i % m->stage_count].params) != MGPU_OK ||
            (m->part[i].bufs && mgpu_tensor_copy(m->part[i].bufs, m->part[i % m->stage_count].bufs) != MGPU_OK))
            return mgpu__refail("mgpu_model_create");
    return mgpu__ties_spread(m, "mgpu_model_create");   /* a tied parameter starts as its twin */
}

/* Step 5, what the reduce of every step needs: per stage, a communicator over its R copies, and
   the gradient buckets. */
static mgpu_result mgpu__model_communicators(mgpu_model* m, const mgpu_model_desc* desc) {
    const int deterministic = desc->verify_every > 0 || mgpu__deterministic_from_env();
    int s, r;
    m->ar = (mgpu_allreduce**)mgpu__calloc((size_t)m->stage_count, sizeof(mgpu_allreduce*));
    m->task_error = (char(*)[sizeof mgpu__error_text + 64])mgpu__calloc((size_t)m->part_count, sizeof *m->task_error);
    if (!m->ar || !m->task_error) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory");
    /* a job's GPUs sum across processes through these too (mgpu__model_join), one replica or more */
    const int across = desc->distributed && mgpu__dist.size > 1 && m->part[0].dev->kind == MGPU_DEVICE_CUDA;
    /* a graph holds the P2P all-reduce, not NCCL across the GPUs of one process: what AUTO means then */
    const mgpu_allreduce_kind kind = desc->graph && desc->allreduce == MGPU_ALLREDUCE_AUTO &&
                                     mgpu__allreduce_from_env(MGPU_ALLREDUCE_AUTO) == MGPU_ALLREDUCE_AUTO && !across &&
                                     m->part[0].dev->kind == MGPU_DEVICE_CUDA ? MGPU_ALLREDUCE_P2P : desc->allreduce;
    for (s = 0; s < m->stage_count && (m->replica_count > 1 || across); ++s) {
        mgpu_device* devs[MGPU__MAX_REPLICAS];
        mgpu_device_set copies;   /* the stage's copies, a set of the library's own (counted in desc->devices) */
        memset(&copies, 0, sizeof copies);
        for (r = 0; r < m->replica_count; ++r) devs[r] = mgpu__part_of(m, r, s)->dev;
        copies.count = m->replica_count;
        copies.devices = devs;
        m->ar[s] = mgpu__allreduce_create(&copies, kind, deterministic);
        if (!m->ar[s]) return mgpu_last_result();
    }
    if (m->replica_count > 1 || across) MGPU__TRY(mgpu__make_buckets(m, MGPU__DEF(desc->bucket_bytes, (size_t)25 << 20)));
    for (r = 0; r < m->part_count && m->bucket_count > 0; ++r) {   /* GPUs: the marks of buckets done */
        mgpu__part* p = &m->part[r];
        int bk;
        if (p->dev->kind != MGPU_DEVICE_CUDA) continue;
        p->bucket_done = (void**)mgpu__calloc((size_t)m->bucket_count, sizeof(void*));
        if (!p->bucket_done) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory");
        for (bk = 0; bk < m->bucket_count; ++bk)
            if (m->buckets[bk].stage == p->stage)
                MGPU__CU("mgpu_model_create", p->dev, mgpu__cu_event_create(p->dev->ordinal, &p->bucket_done[bk]));
    }
    /* SyncBatchNorm: the copies of a stage meet in the middle of their passes (>>parallel meet) */
    m->sync_bn = desc->sync_batch_norm && m->buf_floats > 0 && (m->replica_count > 1 || (desc->distributed && mgpu__dist.size > 1));
#ifdef MGPU_NO_THREADS
    if (m->sync_bn)
        return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "mgpu_model_create: desc.sync_batch_norm needs a thread per replica (a build "
                          "without MGPU_NO_THREADS)");
#endif
    if (m->sync_bn && m->stage_count > 1 && desc->distributed && mgpu__dist.size > 1)
        return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "mgpu_model_create: desc.sync_batch_norm with %d pipeline stages across "
                          "processes (one stage, or one process)", m->stage_count);
    if (m->sync_bn && !(m->meets = (mgpu__meet_point*)mgpu__calloc((size_t)m->stage_count, sizeof *m->meets)))
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory");
#ifndef MGPU_NO_THREADS
    if ((m->stage_count > 1 && m->part[0].dev->kind == MGPU_DEVICE_CPU) || m->sync_bn) {
        if (mgpu__mutex_init(&m->pipe_lock) != 0) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_model_create: cannot make a lock for the pipeline");
        if (mgpu__cond_init(&m->pipe_moved) != 0) {
            mgpu__mutex_destroy(&m->pipe_lock);
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_model_create: cannot make a condition variable for the pipeline");
        }
        m->pipe_sync = 1;
    }
#endif
    return MGPU_OK;
}

static mgpu_model* mgpu__model_create_here(const mgpu_model_desc* desc) {
    static const char* op = "mgpu_model_create";
    mgpu_model* m;
    int i, devices;
    if (!desc || !desc->layers || desc->layer_count <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: a model needs at least one layer", op);
        if (desc && desc->layers) mgpu__drop_layers(desc->layers, desc->layer_count);
        return NULL;
    }
    for (i = 0; i < desc->layer_count; ++i) {   /* each layer one model's, once (LIFETIMES) */
        const mgpu_layer* l = desc->layers[i];
        int j;
        if (!l) {
            char why[sizeof mgpu__error_text];
            memcpy(why, mgpu__error_text, sizeof why);   /* the constructor's own message, if any */
            /* a constructor out of memory makes the model out of memory too */
            mgpu__fail(mgpu_last_result() == MGPU_ERROR_OUT_OF_MEMORY ? MGPU_ERROR_OUT_OF_MEMORY : MGPU_ERROR_INVALID_ARGUMENT,
                       "%s: layer %d is NULL (did its constructor fail? %s)", op, i, why[0] ? why : "no error recorded");
            mgpu__drop_layers(desc->layers, desc->layer_count);
            return NULL;
        }
        for (j = 0; j < i && desc->layers[j] != l; ++j) {}
        if (j < i || l->owner) {
            if (j < i)
                mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: layers %d and %d are the same %s layer (make one per position)",
                           op, j, i, mgpu_layer_type(l));
            else
                mgpu__fail(MGPU_ERROR_IN_USE, "%s: layer %d (%s) already belongs to another model", op, i, mgpu_layer_type(l));
            mgpu__drop_layers(desc->layers, desc->layer_count);
            return NULL;
        }
    }
    if (desc->devices && !mgpu__live_check(desc->devices, MGPU__LIVE_SET, op, "device set")) {
        mgpu__drop_layers(desc->layers, desc->layer_count);
        return NULL;
    }
    m = (mgpu_model*)mgpu__calloc(1, sizeof *m);
    if (m) m->layers = (mgpu_layer**)mgpu__calloc((size_t)desc->layer_count, sizeof(mgpu_layer*));
    if (!m || !m->layers) {
        MGPU_FREE(m);
        mgpu__drop_layers(desc->layers, desc->layer_count);
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        return NULL;
    }
    m->layer_count = desc->layer_count;
    for (i = 0; i < m->layer_count; ++i) {   /* owned from here on */
        m->layers[i] = desc->layers[i];
        m->layers[i]->owner = m;
    }
    m->input = desc->input;
    m->input_dtype = desc->input_dtype;
    m->precision = desc->precision;
    m->loss = desc->loss;
    m->seed = desc->seed;
    m->verify_every = desc->verify_every;
    m->check_finite = desc->check_finite != 0;
    m->graph = desc->graph != 0;
    m->stage_count = MGPU__DEF(desc->stages, 1);
    m->micro_batches = MGPU__DEF(desc->micro_batches, 1);
    m->schedule = desc->schedule;
    devices = desc->devices ? desc->devices->count : 1;
    if (m->input.ndim < 1 || m->input.ndim > MGPU_MAX_DIMS - 1) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "the sample shape has %d dimensions (want 1 to %d; the batch adds one)",
                   m->input.ndim, MGPU_MAX_DIMS - 1);
        return mgpu__model_fail(m, op);
    }
    for (i = 0; i < m->input.ndim; ++i)
        if (m->input.dim[i] < 1) {
            char text[96];
            mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "the sample shape %s has a dimension below 1",
                       mgpu__shape_text(m->input, text, sizeof text));
            return mgpu__model_fail(m, op);
        }
    if (m->input_dtype != MGPU_F32 && m->input_dtype != MGPU_I32) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "input_dtype %s (want MGPU_F32, or MGPU_I32 for token ids)",
                   mgpu_dtype_name(m->input_dtype));
        return mgpu__model_fail(m, op);
    }
    if (m->precision != MGPU_F32 && m->precision != MGPU_BF16) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "precision %s (want MGPU_F32 or MGPU_BF16)", mgpu_dtype_name(m->precision));
        return mgpu__model_fail(m, op);
    }
    for (i = 0; m->precision == MGPU_BF16 && i < m->layer_count; ++i) {
        const mgpu_layer* missing = mgpu__bf16_missing(m->layers[i]);
        if (missing) {
            mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "precision bf16: layer %d (%s%s%s) has no bf16 path yet (layers of your own "
                       "have none)", i, mgpu_layer_type(m->layers[i]), missing != m->layers[i] ? ", inside it a " : "",
                       missing != m->layers[i] ? mgpu_layer_type(missing) : "");
            return mgpu__model_fail(m, op);
        }
        mgpu__layer_set_precision(m->layers[i], m->precision);
    }
    if (m->micro_batches < 1 || m->micro_batches > 4096 || (m->schedule != MGPU_PIPELINE_1F1B && m->schedule != MGPU_PIPELINE_GPIPE)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d micro-batches, schedule %d (want 1 to 4096, and MGPU_PIPELINE_1F1B or "
                   "MGPU_PIPELINE_GPIPE)", op, m->micro_batches, (int)m->schedule);
        return mgpu__model_fail(m, op);
    }
    if (mgpu__model_layout(m, desc) != MGPU_OK || mgpu__model_stages(m, desc, devices) != MGPU_OK) return mgpu__model_fail(m, op);
    m->part_count = devices;
    m->replica_count = devices / m->stage_count;
    m->terms = (int64_t*)mgpu__calloc((size_t)m->replica_count * (size_t)m->micro_batches, sizeof(int64_t));
    if (!m->terms) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory");
        return mgpu__model_fail(m, op);
    }
    if (mgpu__model_parts(m, desc->devices) != MGPU_OK || mgpu__model_init(m) != MGPU_OK ||
        mgpu__model_communicators(m, desc) != MGPU_OK)
        return mgpu__model_fail(m, op);
    if (mgpu__live_add(m, MGPU__LIVE_MODEL, op) != MGPU_OK) return mgpu__model_fail(m, op);
    if (desc->devices) {   /* the set's destroy waits for this model's (LIFETIMES) */
        m->set = desc->devices;
        mgpu__set_users(m->set, 1, 0);
    }
    return m;
}

/* What every rank's model of one job must share: its layers, their tensors, the stages and the
   precision. */
static uint64_t mgpu__model_signature(const mgpu_model* m) {
    uint64_t h = 0xcbf29ce484222325ull;
    int i, d;
    const char* c;
#define MGPU__HASH(v) (h = (h ^ (uint64_t)(v)) * 0x100000001b3ull)
    for (i = 0; i < m->layer_count; ++i)
        for (c = mgpu_layer_type(m->layers[i]); *c; ++c) MGPU__HASH((unsigned char)*c);
    for (i = 0; i < m->tensor_count; ++i) {
        for (c = m->tensors[i].name; *c; ++c) MGPU__HASH((unsigned char)*c);
        for (d = 0; d < m->tensors[i].shape.ndim; ++d) MGPU__HASH(m->tensors[i].shape.dim[d]);
    }
    for (i = 0; i < m->buffer_count; ++i) {
        for (c = m->buffers[i].name; *c; ++c) MGPU__HASH((unsigned char)*c);
        for (d = 0; d < m->buffers[i].shape.ndim; ++d) MGPU__HASH(m->buffers[i].shape.dim[d]);
    }
    for (i = 0; i <= m->stage_count; ++i) MGPU__HASH(m->stage_layer[i]);
    MGPU__HASH(m->micro_batches);
    MGPU__HASH(m->loss);
    MGPU__HASH(m->precision);
#undef MGPU__HASH
    return h;
}

/* Rank 0's parameters into every replica of every rank (the model broadcast of DDP's start). */
static mgpu_result mgpu__dist_broadcast_params(mgpu_model* m) {
#ifdef MGPU_MPI
    float* host = (float*)MGPU_MALLOC((size_t)m->flat_floats * sizeof(float) + 1);
    mgpu_result r = MGPU_OK;
    int s, rep;
    if (!host) return mgpu__dist_agree(mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_model_create: out of host memory for the "
                                                  "parameters' broadcast"), 0, 0.0, NULL, NULL);
    for (s = 0; s < m->stage_count && r == MGPU_OK; ++s) {
        const int64_t n = mgpu__stage_floats(m, s);
        if (mgpu__dist.rank == 0) r = mgpu_tensor_download(mgpu__part_of(m, 0, s)->params, host, (size_t)n * sizeof(float));
        /* every rank on to the next stage's broadcast, or every rank out */
        if ((r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL)) != MGPU_OK) break;
        mgpu__dist_broadcast(host, (size_t)n * sizeof(float));
        for (rep = 0; rep < m->replica_count && r == MGPU_OK; ++rep)
            r = mgpu_tensor_upload(mgpu__part_of(m, rep, s)->params, host, (size_t)n * sizeof(float));
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    }
    MGPU_FREE(host);
    return r;
#else
    (void)m;
    return MGPU_OK;
#endif
}

/* Rank 0's replica 0's buffers into every replica of every rank, stage by stage (at create, and
   after every optimizer step: mgpu__sync_buffers). */
static mgpu_result mgpu__dist_broadcast_buffers(mgpu_model* m) {
#ifdef MGPU_MPI
    float* host = (float*)MGPU_MALLOC((size_t)m->buf_floats * sizeof(float) + 1);
    mgpu_result r = MGPU_OK;
    int s, rep;
    if (!host) return mgpu__dist_agree(mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "out of host memory for the buffers' broadcast"),
                                       0, 0.0, NULL, NULL);
    for (s = 0; s < m->stage_count && r == MGPU_OK; ++s) {
        const int64_t n = mgpu__stage_buf_floats(m, s);
        if (n == 0) continue;   /* (the same on every rank: the layers agree) */
        if (mgpu__dist.rank == 0) r = mgpu_tensor_download(mgpu__part_of(m, 0, s)->bufs, host, (size_t)n * sizeof(float));
        if ((r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL)) != MGPU_OK) break;
        mgpu__dist_broadcast(host, (size_t)n * sizeof(float));
        for (rep = 0; rep < m->replica_count && r == MGPU_OK; ++rep)
            r = mgpu_tensor_upload(mgpu__part_of(m, rep, s)->bufs, host, (size_t)n * sizeof(float));
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    }
    MGPU_FREE(host);
    return r;
#else
    (void)m;
    return MGPU_OK;
#endif
}

/* A distributed model: made on every rank, or failed on every rank; then the same on all. */
static mgpu_result mgpu__model_join(mgpu_model* m, mgpu_result made, const mgpu_model_desc* desc) {
    mgpu_result r = made;
    uint64_t mine = 0, first = 0;
    int q, s, sync_bn;
    if (r == MGPU_OK) {
        m->dist_replicas = (int*)mgpu__calloc((size_t)mgpu__dist.size, sizeof(int));
        m->dist_rows = (int64_t*)mgpu__calloc((size_t)mgpu__dist.size, sizeof(int64_t));
        if (!m->dist_replicas || !m->dist_rows) r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_model_create: out of host memory");
    }
    if (r == MGPU_OK) mine = first = mgpu__model_signature(m);
    MGPU__TRY(mgpu__dist_agree(r, m ? m->replica_count : 0, 0.0, r == MGPU_OK ? m->dist_rows : NULL, NULL));
    for (q = 0; q < mgpu__dist.size; ++q) m->dist_replicas[q] = (int)m->dist_rows[q];
    /* rank 0's layers, dropout seed and checking for every rank (a rank checking alone would wait
       in collectives the others skip) */
    mgpu__dist_broadcast(&first, sizeof first);
    mgpu__dist_broadcast(&m->seed, sizeof m->seed);
    mgpu__dist_broadcast(&m->verify_every, sizeof m->verify_every);
    mgpu__dist_broadcast(&m->check_finite, sizeof m->check_finite);
    sync_bn = m->sync_bn;   /* a rank meeting alone would wait for the others */
    mgpu__dist_broadcast(&sync_bn, sizeof sync_bn);
    if (first != mine)
        r = mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_create: this rank's model (%d layers, %lld parameters, %d stages) is not rank 0's: "
                       "every rank must make the same layers", m->layer_count, (long long)m->param_count, m->stage_count);
    else if (sync_bn != m->sync_bn)
        r = mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_create: desc.sync_batch_norm is %d on this rank, %d on rank 0: "
                       "every rank must set the same", m->sync_bn, sync_bn);
    else if (m->sync_bn && !mgpu__dist_serialized())
        r = mgpu__fail(MGPU_ERROR_UNSUPPORTED, "mgpu_model_create: desc.sync_batch_norm across processes calls MPI from a "
                       "step's own threads, one at a time, which needs MPI_THREAD_SERIALIZED; this MPI was started with less "
                       "(MPI_Init_thread)");
    MGPU__TRY(mgpu__dist_agree(r, 0, 0.0, NULL, NULL));
    m->dist = 1;
    for (q = 0; q < mgpu__dist.size; ++q) {
        if (q < mgpu__dist.rank) m->dist_first += m->dist_replicas[q];
        m->dist_total += m->dist_replicas[q];
    }
    for (s = 0; s < m->stage_count; ++s)   /* GPUs: one NCCL communicator per stage over the job (every rank votes) */
        MGPU__TRY(mgpu__ar_join_processes(m->ar[s], m->dist_replicas, desc->allreduce,
                                          m->verify_every > 0 || mgpu__deterministic_from_env()));
    MGPU__TRY(mgpu__dist_broadcast_params(m));
    return mgpu__dist_broadcast_buffers(m);
}

MGPUDEF mgpu_model* mgpu_model_create(const mgpu_model_desc* desc) {
    mgpu_model* m = mgpu__model_create_here(desc);
    if (!desc || !desc->distributed || mgpu__dist.size <= 1) return m;
    mgpu__dist_doing("mgpu_model_create", 0);
    if (mgpu__model_join(m, m ? MGPU_OK : mgpu_last_result(), desc) != MGPU_OK) {
        mgpu__model_free(m);   /* the message is the failed rank's: "rank 1 of 4: mgpu_model_create: ..." */
        return NULL;
    }
    return m;
}

MGPUDEF mgpu_allreduce_kind mgpu_model_allreduce_backend(const mgpu_model* m) {
    if (m && m->dist) return m->ar && m->ar[0] && m->ar[0]->across_processes ? MGPU_ALLREDUCE_NCCL : MGPU_ALLREDUCE_MPI;
    return m && m->ar && m->ar[0] ? m->ar[0]->kind : MGPU_ALLREDUCE_NONE;
}
MGPUDEF int mgpu_model_bucket_count(const mgpu_model* m) { return m ? m->bucket_count : 0; }

MGPUDEF int mgpu_model_replica_count(const mgpu_model* m) { return m ? m->replica_count : 0; }
MGPUDEF int mgpu_model_total_replica_count(const mgpu_model* m) { return m ? (m->dist ? m->dist_total : m->replica_count) : 0; }
MGPUDEF int mgpu_model_first_replica(const mgpu_model* m) { return m ? m->dist_first : 0; }
MGPUDEF int mgpu_model_stage_count(const mgpu_model* m) { return m ? m->stage_count : 0; }
MGPUDEF int mgpu_model_micro_batches(const mgpu_model* m) { return m ? m->micro_batches : 0; }
MGPUDEF int64_t mgpu_model_param_count(const mgpu_model* m) { return m ? m->param_count : 0; }
/* For the getters: 1 when m is a model, replica one of its replicas (unless replica is
   MGPU__ANY), stage one of its stages and tensor one of its tensors (likewise); else 0 and an
   error saying which. */
#define MGPU__ANY INT32_MIN
static int mgpu__model_has(const char* op, const mgpu_model* m, int replica, int stage, int tensor) {
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op), 0;
    if (replica != MGPU__ANY && (replica < 0 || replica >= m->replica_count))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: replica %d of a model with %d replica%s (0 to %d)", op, replica,
                          m->replica_count, m->replica_count == 1 ? "" : "s", m->replica_count - 1), 0;
    if (stage != MGPU__ANY && (stage < 0 || stage >= m->stage_count))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: stage %d of a model with %d stage%s (0 to %d)", op, stage,
                          m->stage_count, m->stage_count == 1 ? "" : "s", m->stage_count - 1), 0;
    if (tensor != MGPU__ANY && (tensor < 0 || tensor >= m->tensor_count))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: tensor %d of a model with %d tensor%s (0 to %d)", op, tensor,
                          m->tensor_count, m->tensor_count == 1 ? "" : "s", m->tensor_count - 1), 0;
    return 1;
}
MGPUDEF int mgpu_model_stage_first_layer(const mgpu_model* m, int stage) {
    if (m && stage == m->stage_count) return m->layer_count;
    return mgpu__model_has("mgpu_model_stage_first_layer", m, MGPU__ANY, stage, MGPU__ANY) ? m->stage_layer[stage] : -1;
}
MGPUDEF mgpu_device* mgpu_model_stage_device(const mgpu_model* m, int replica, int stage) {
    return mgpu__model_has("mgpu_model_stage_device", m, replica, stage, MGPU__ANY) ? mgpu__part_of(m, replica, stage)->dev : NULL;
}
MGPUDEF mgpu_device* mgpu_model_device(const mgpu_model* m, int replica) {
    return mgpu__model_has("mgpu_model_device", m, replica, MGPU__ANY, MGPU__ANY) ? mgpu__part_of(m, replica, 0)->dev : NULL;
}
/* A part's flat buffer (grads: 0 params, 1 gradients); with one_stage, of a model of one stage only. */
static mgpu_tensor* mgpu__part_buffer(const char* op, const mgpu_model* m, int replica, int stage, int grads, int one_stage) {
    if (one_stage && m && m->stage_count > 1) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the model has %d stages, each with buffers of its own "
                   "(mgpu_model_stage_params, mgpu_model_stage_grads)", op, m->stage_count);
        return NULL;
    }
    if (!mgpu__model_has(op, m, replica, stage, MGPU__ANY)) return NULL;
    return grads ? mgpu__part_of(m, replica, stage)->grads : mgpu__part_of(m, replica, stage)->params;
}
MGPUDEF mgpu_tensor* mgpu_model_stage_params(const mgpu_model* m, int replica, int stage) {
    return mgpu__part_buffer("mgpu_model_stage_params", m, replica, stage, 0, 0);
}
MGPUDEF mgpu_tensor* mgpu_model_stage_grads(const mgpu_model* m, int replica, int stage) {
    return mgpu__part_buffer("mgpu_model_stage_grads", m, replica, stage, 1, 0);
}
MGPUDEF mgpu_tensor* mgpu_model_params(const mgpu_model* m, int replica) {
    return mgpu__part_buffer("mgpu_model_params", m, replica, 0, 0, 1);
}
MGPUDEF mgpu_tensor* mgpu_model_grads(const mgpu_model* m, int replica) {
    return mgpu__part_buffer("mgpu_model_grads", m, replica, 0, 1, 1);
}
MGPUDEF int mgpu_model_tensor_count(const mgpu_model* m) { return m ? m->tensor_count + m->buffer_count : 0; }
MGPUDEF int mgpu_model_buffer_count(const mgpu_model* m) { return m ? m->buffer_count : 0; }
MGPUDEF int mgpu_model_tensor_is_buffer(const mgpu_model* m, int i) { return m && i >= m->tensor_count && i < m->tensor_count + m->buffer_count; }
/* The listing's index i as a buffer's index (>= 0), or -1 for a parameter; an error when neither. */
static int mgpu__listed(const char* op, const mgpu_model* m, int replica, int i, int* buffer) {
    *buffer = -1;
    if (m && i >= m->tensor_count && i < m->tensor_count + m->buffer_count) {
        *buffer = i - m->tensor_count;
        return mgpu__model_has(op, m, replica, MGPU__ANY, MGPU__ANY);
    }
    if (m && (i < 0 || i >= m->tensor_count) && m->buffer_count)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: tensor %d of a model with %d parameters and %d buffers (0 to %d)", op, i,
                          m->tensor_count, m->buffer_count, m->tensor_count + m->buffer_count - 1), 0;
    return mgpu__model_has(op, m, replica, MGPU__ANY, i);
}
/* The stage that holds buffer b */
static int mgpu__buffer_stage(const mgpu_model* m, int b) {
    int s = 0;
    while (s + 1 < m->stage_count && m->first_buffer[m->stage_layer[s + 1]] <= b) ++s;
    return s;
}
MGPUDEF const char* mgpu_model_tensor_name(const mgpu_model* m, int i) {
    int b;
    if (!mgpu__listed("mgpu_model_tensor_name", m, MGPU__ANY, i, &b)) return NULL;
    return b >= 0 ? m->buffers[b].name : m->tensors[i].name;
}
MGPUDEF mgpu_tensor* mgpu_model_tensor(const mgpu_model* m, int replica, int i) {
    int b;
    if (!mgpu__listed("mgpu_model_tensor", m, replica, i, &b)) return NULL;
    if (b >= 0) return mgpu__part_of(m, replica, mgpu__buffer_stage(m, b))->bview[b];
    return mgpu__part_of(m, replica, mgpu__tensor_stage(m, i))->pview[i];
}
MGPUDEF mgpu_tensor* mgpu_model_buffer(const mgpu_model* m, int replica, const char* name) {
    static const char* op = "mgpu_model_buffer";
    int b;
    if (!mgpu__model_has(op, m, replica, MGPU__ANY, MGPU__ANY)) return NULL;
    if (!name) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL name", op); return NULL; }
    for (b = 0; b < m->buffer_count; ++b)
        if (!strcmp(m->buffers[b].name, name)) return mgpu__part_of(m, replica, mgpu__buffer_stage(m, b))->bview[b];
    mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the model has no buffer '%.80s' (it has %d%s%s%s)", op, name, m->buffer_count,
               m->buffer_count ? ": '" : "", m->buffer_count ? m->buffers[0].name : "", m->buffer_count ? "', ..." : "");
    return NULL;
}
MGPUDEF mgpu_tensor* mgpu_model_stage_buffers(const mgpu_model* m, int replica, int stage) {
    if (!mgpu__model_has("mgpu_model_stage_buffers", m, replica, stage, MGPU__ANY)) return NULL;
    return mgpu__part_of(m, replica, stage)->bufs;
}
/* The index of the tensor called name, or -1 with an error naming it and a few of the model's. */
static int mgpu__model_find(const char* op, const mgpu_model* m, const char* name) {
    char list[256];
    size_t len = 0;
    int i;
    if (!name) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL name", op), -1;
    for (i = 0; i < m->tensor_count; ++i)
        if (!strcmp(m->tensors[i].name, name)) return i;
    list[0] = 0;
    for (i = 0; i < m->tensor_count && len < sizeof list - 80; ++i)
        len += (size_t)snprintf(list + len, sizeof list - len, "%s'%s'", i ? ", " : "", m->tensors[i].name);
    if (i < m->tensor_count) snprintf(list + len, sizeof list - len, ", ...");
    mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the model has no parameter '%.80s' (its %d: %s)", op, name, m->tensor_count,
               m->tensor_count ? list : "none");
    return -1;
}
MGPUDEF mgpu_tensor* mgpu_model_param(const mgpu_model* m, int replica, const char* name) {
    static const char* op = "mgpu_model_param";
    int i;
    if (!mgpu__model_has(op, m, replica, MGPU__ANY, MGPU__ANY) || (i = mgpu__model_find(op, m, name)) < 0) return NULL;
    return mgpu__part_of(m, replica, mgpu__tensor_stage(m, i))->pview[i];
}
MGPUDEF mgpu_tensor* mgpu_model_grad(const mgpu_model* m, int replica, const char* name) {
    static const char* op = "mgpu_model_grad";
    int i;
    if (!mgpu__model_has(op, m, replica, MGPU__ANY, MGPU__ANY) || (i = mgpu__model_find(op, m, name)) < 0) return NULL;
    return mgpu__part_of(m, replica, mgpu__tensor_stage(m, i))->gview[i];
}

MGPUDEF void mgpu_model_summary(const mgpu_model* m, void* file) {
    FILE* f = file ? (FILE*)file : stdout;
    mgpu_shape shape;
    char text[96], cfg[96], bytes[32];
    int i, j, s;
    if (!m) return;
    shape = mgpu__batch_shape(m, 1);
    fprintf(f, "%-4s %-34s %-18s %12s\n", "#", "Layer (type)", "Output shape", "Params");
    fprintf(f, "%-4s %-34s %-18s %12s\n", "", "Input", mgpu__shape_text(shape, text, sizeof text), "");
    for (i = 0; i < m->layer_count; ++i) {
        const mgpu_layer* l = m->layers[i];
        int64_t n = 0;
        char label[128];
        if (m->stage_count > 1 && m->stage_layer[mgpu__layer_stage(m, i)] == i) fprintf(f, "---- stage %d\n", mgpu__layer_stage(m, i));
        for (j = m->first_tensor[i]; j < m->first_tensor[i + 1]; ++j) n += mgpu_shape_numel(m->tensors[j].shape);
        cfg[0] = 0;
        if (l->vt->describe) l->vt->describe(l, cfg, sizeof cfg);
        snprintf(label, sizeof label, cfg[0] ? "%s(%s)" : "%s", mgpu_layer_type(l), cfg);
        if (mgpu__layer_output(m, i, shape, &shape) != MGPU_OK) break;
        fprintf(f, "%-4d %-34s %-18s %12lld\n", i, label, mgpu__shape_text(shape, text, sizeof text), (long long)n);
    }
    mgpu__human_bytes((double)m->param_count * 4.0, bytes, sizeof bytes);
    fprintf(f, "Total parameters: %lld (%s as float32), on %d replica%s", (long long)m->param_count, bytes,
            m->replica_count, m->replica_count == 1 ? "" : "s");
    if (m->stage_count > 1)
        fprintf(f, " of %d stages (%d micro-batch%s, %s)", m->stage_count, m->micro_batches, m->micro_batches == 1 ? "" : "es",
                m->schedule == MGPU_PIPELINE_GPIPE ? "GPipe" : "1F1B");
    fprintf(f, ":");
    for (i = 0; i < m->replica_count; ++i) {
        fprintf(f, " ");
        for (s = 0; s < m->stage_count; ++s) fprintf(f, "%s%s", s ? ">" : "", mgpu__part_of(m, i, s)->dev->label);
    }
    fprintf(f, "\n");
    if (m->precision == MGPU_BF16) {   /* (the copies' buffers: with tied copies and the views' alignment) */
        size_t copies = 0;
        for (s = 0; s < m->stage_count; ++s) copies += mgpu_tensor_bytes(mgpu__part_of(m, 0, s)->params_bf16);
        mgpu__human_bytes((double)copies, bytes, sizeof bytes);
        fprintf(f, "Precision: bf16 activations and products (the weights' bf16 copies: %s a replica), f32 parameters\n", bytes);
    }
    if (m->buffer_count) {   /* not trained, so not among the parameters (nor in torchsummary's count) */
        int64_t values = 0;
        int b;
        for (b = 0; b < m->buffer_count; ++b) values += mgpu_shape_numel(m->buffers[b].shape);
        fprintf(f, "Buffers (running statistics, not trained): %d, %lld values\n", m->buffer_count, (long long)values);
    }
    {
        size_t grads = 0, all = mgpu_model_activation_bytes(m, 0, &grads);
        char kept_text[32], grads_text[32];
        if (all) {   /* (none before a first step: its batch sizes them) */
            mgpu__human_bytes((double)all, bytes, sizeof bytes);
            mgpu__human_bytes((double)(all - grads), kept_text, sizeof kept_text);
            mgpu__human_bytes((double)grads, grads_text, sizeof grads_text);
            fprintf(f, "Activation memory of a step (replica 0, the last step's %lld rows%s): %s, kept for backward %s, gradients %s\n",
                    (long long)mgpu__part_of(m, 0, 0)->slot[0].in_shape.dim[0], m->micro_batches > 1 ? " per micro-batch" : "",
                    bytes, kept_text, grads_text);
        }
    }
}

static mgpu_result mgpu__check_replica(const char* op, const mgpu_model* m, int replica) {
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op);
    if (replica < 0 || replica >= m->replica_count)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: replica %d of a model with %d", op, replica, m->replica_count);
    return MGPU_OK;
}

/* Adds a tensor's storage block to *bytes unless seen[0..*count) has it (in-place layers, and the
   loss gradient over the logits, share one). */
static void mgpu__count_storage(const mgpu_tensor* t, const mgpu__storage** seen, int* count, size_t* bytes) {
    int i;
    if (!t) return;
    for (i = 0; i < *count; ++i) if (seen[i] == t->storage) return;
    seen[(*count)++] = t->storage;
    *bytes += t->storage->size;
}
MGPUDEF size_t mgpu_model_activation_bytes(const mgpu_model* m, int replica, size_t* gradient_bytes) {
    size_t kept = 0, grads = 0;
    int s, k, i, count = 0, cap = 0;
    const mgpu__storage** seen;
    if (gradient_bytes) *gradient_bytes = 0;
    if (mgpu__check_replica("mgpu_model_activation_bytes", m, replica) != MGPU_OK) return 0;
    for (s = 0; s < m->stage_count; ++s)
        cap += mgpu__part_of(m, replica, s)->slot_count * (2 * m->layer_count + m->first_aux[m->layer_count] + 8);
    seen = (const mgpu__storage**)MGPU_MALLOC(sizeof(*seen) * (size_t)MGPU__MAX(cap, 1));
    if (!seen) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_model_activation_bytes: out of host memory"); return 0; }
    for (s = 0; s < m->stage_count; ++s) {   /* what forward keeps first, so a shared block counts there */
        const mgpu__part* p = mgpu__part_of(m, replica, s);
        for (k = 0; k < p->slot_count; ++k) {
            const mgpu__slot* sl = &p->slot[k];
            for (i = 0; sl->act && i < m->layer_count; ++i) mgpu__count_storage(sl->act[i], seen, &count, &kept);
            for (i = 0; sl->aux && i < m->first_aux[m->layer_count]; ++i) mgpu__count_storage(sl->aux[i], seen, &count, &kept);
            mgpu__count_storage(sl->xin, seen, &count, &kept);
            mgpu__count_storage(sl->wide_out, seen, &count, &kept);
        }
    }
    for (s = 0; s < m->stage_count; ++s) {
        const mgpu__part* p = mgpu__part_of(m, replica, s);
        for (k = 0; k < p->slot_count; ++k) {
            const mgpu__slot* sl = &p->slot[k];
            mgpu__count_storage(sl->dflat[0], seen, &count, &grads);
            mgpu__count_storage(sl->dflat[1], seen, &count, &grads);
            mgpu__count_storage(sl->dxin, seen, &count, &grads);
            mgpu__count_storage(sl->dyin, seen, &count, &grads);
            mgpu__count_storage(sl->dout, seen, &count, &grads);
            mgpu__count_storage(sl->wide_dxin, seen, &count, &grads);
        }
    }
    MGPU_FREE(seen);
    if (gradient_bytes) *gradient_bytes = grads;
    return kept + grads;
}

/* ---- >>impl optim ----------------------------------------------------------------------- */
struct mgpu_optimizer {
    mgpu_model* model;
    int part_count;
    mgpu_optimizer_desc d;      /* with defaults filled in */
    int64_t steps;              /* at most MGPU__MAX_STEPS */
    mgpu_tensor** state1;       /* per part (like its flat buffers): SGD momentum buffer, AdamW
                                   exp_avg (NULL when unused) */
    mgpu_tensor** state2;       /* per part: AdamW exp_avg_sq */
    mgpu_tensor** views;        /* [replica][state][tensor]: views made by mgpu_optimizer_state */
    int view_count;
    mgpu__sgd_args sgd;         /* the numbers of update number `prepared` + 1 (mgpu__optimizer_prepare) */
    mgpu__adamw_args adamw;
    int64_t prepared;           /* -1: none yet */
    mgpu_tensor** args;         /* per part on a GPU: those numbers in its memory, where its kernel reads them */
    /* parameter groups: stage s's no-decay ranges of its flat buffer as edges (mgpu__edges_upto),
       edges[edge_first[s] .. edge_first[s + 1]); none without groups */
    int64_t* edges;
    int* edge_first;            /* [S + 1], or NULL without groups */
    mgpu_tensor** edges_dev;    /* per part on a GPU with edges: its stage's, in its memory (int64 bytes) */
    /* clipping (d.clip_norm > 0) */
    mgpu_tensor** clip_sums;    /* per part on a GPU: its replica's stages' sums of squares [S] (float64),
                                   then MGPU__CU_REDUCE_SCRATCH float64 of scratch (bytes) */
    mgpu_tensor** clip_norm;    /* per part on a GPU: the norm, as its stage computed it [1] */
    double* cpu_sums;           /* on the CPU: one sum of squares per chunk of MGPU__CLIP_CHUNK */
    float cpu_norm;             /* on the CPU: the last step's norm */
    int norm_known;             /* a step clipped since the optimizer was made */
};

/* On the CPU the sum of squares is cut into chunks of this many floats, each summed by one task,
   and the chunks added in order: the same bits on any number of threads. */
#define MGPU__CLIP_CHUNK ((int64_t)1 << 16)

static void mgpu__optimizer_free(mgpu_optimizer* opt) {
    int i;
    if (!opt) return;
    mgpu__live_remove(opt, MGPU__LIVE_OPTIMIZER);
    if (opt->model && opt->model->graph_opt == opt) {   /* its graph updates through this one's buffers */
        mgpu__graph_drop(opt->model);
        opt->model->graph_opt = NULL;
    }
    if (opt->model) opt->model->optimizers--;
    for (i = 0; i < opt->part_count; ++i) {
        if (opt->state1) mgpu__tensor_free(opt->state1[i]);
        if (opt->state2) mgpu__tensor_free(opt->state2[i]);
        if (opt->args) mgpu__tensor_free(opt->args[i]);
        if (opt->edges_dev) mgpu__tensor_free(opt->edges_dev[i]);
        if (opt->clip_sums) mgpu__tensor_free(opt->clip_sums[i]);
        if (opt->clip_norm) mgpu__tensor_free(opt->clip_norm[i]);
    }
    MGPU_FREE(opt->args);
    MGPU_FREE(opt->edges_dev);
    MGPU_FREE(opt->clip_sums);
    MGPU_FREE(opt->clip_norm);
    MGPU_FREE(opt->edges);
    MGPU_FREE(opt->edge_first);
    MGPU_FREE(opt->cpu_sums);
    for (i = 0; opt->views && i < opt->view_count; ++i) mgpu__tensor_free(opt->views[i]);
    MGPU_FREE(opt->views);
    MGPU_FREE(opt->state1);
    MGPU_FREE(opt->state2);
    MGPU_FREE(opt);
}
MGPUDEF void mgpu_optimizer_destroy(mgpu_optimizer* opt) {
    if (!opt || !mgpu__live_check(opt, MGPU__LIVE_OPTIMIZER, "mgpu_optimizer_destroy", "optimizer")) return;
    mgpu__optimizer_free(opt);
}

static int mgpu__optimizer_state_count(const mgpu_optimizer* opt) {
    if (opt->d.kind == MGPU_ADAMW) return 2;
    return opt->d.momentum != 0.0f ? 1 : 0;
}
static const char* mgpu__optimizer_state_name(const mgpu_optimizer* opt, int i) {
    if (opt->d.kind == MGPU_ADAMW) return i == 0 ? "exp_avg" : "exp_avg_sq";
    return "momentum_buffer";
}

/* Parameter groups (desc.decay_matrices_only, desc.no_decay): whether tensor t decays. */
static int mgpu__tensor_decays(const mgpu_model* m, const mgpu_optimizer_desc* d, int t) {
    int k;
    if (d->decay_matrices_only && m->tensors[t].shape.ndim < 2) return 0;
    for (k = 0; k < d->no_decay_count; ++k)
        if (!strcmp(d->no_decay[k], m->tensors[t].name)) return 0;
    return 1;
}

/* The no-decay ranges of each stage's flat buffer as edges (mgpu__edges_upto): the tensors of a
   stage lie in offset order, so adjacent no-decay tensors merge into one range and the edges
   come out ascending. On each GPU part a copy, which the update kernel reads. */
static mgpu_result mgpu__optimizer_groups(mgpu_optimizer* opt, const char* op) {
    const mgpu_model* m = opt->model;
    const mgpu_optimizer_desc* d = &opt->d;
    int t, k, s, count = 0;
    if (d->no_decay_count < 0 || (d->no_decay_count > 0 && !d->no_decay))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: no_decay_count %d with no_decay %s: want a list of that many names",
                          op, d->no_decay_count, d->no_decay ? "given" : "NULL");
    for (k = 0; k < d->no_decay_count; ++k)
        if (mgpu__model_find(op, m, d->no_decay[k]) < 0) return mgpu__refail(op);   /* names the unknown one */
    if ((!d->decay_matrices_only && d->no_decay_count == 0) || d->weight_decay == 0.0f)
        return MGPU_OK;   /* no groups (every element decays), or no decay to leave out */
    opt->edge_first = (int*)mgpu__calloc((size_t)m->stage_count + 1, sizeof(int));
    opt->edges = (int64_t*)mgpu__calloc((size_t)MGPU__MAX(2 * m->tensor_count, 1), sizeof(int64_t));
    opt->edges_dev = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    if (!opt->edge_first || !opt->edges || !opt->edges_dev) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (s = 0, t = 0; s < m->stage_count; ++s) {
        opt->edge_first[s] = count;
        for (; t < m->tensor_count && mgpu__tensor_stage(m, t) == s; ++t) {
            const int64_t begin = m->tensors[t].offset - m->stage_off[s], end = begin + mgpu_shape_numel(m->tensors[t].shape);
            if (mgpu__tensor_decays(m, d, t) || end == begin) continue;
            if (count > opt->edge_first[s] && opt->edges[count - 1] >= begin) {   /* joins the range before */
                opt->edges[count - 1] = MGPU__MAX(opt->edges[count - 1], end);
            } else {
                opt->edges[count++] = begin;
                opt->edges[count++] = end;
            }
        }
    }
    opt->edge_first[m->stage_count] = count;
    for (k = 0; k < m->part_count; ++k) {
        const mgpu__part* p = &m->part[k];
        const int first = opt->edge_first[p->stage], n = opt->edge_first[p->stage + 1] - first;
        if (p->dev->kind != MGPU_DEVICE_CUDA || n == 0) continue;
        opt->edges_dev[k] = mgpu__own(mgpu_tensor_create(p->dev, MGPU_U8, mgpu_shape1((int64_t)n * (int64_t)sizeof(int64_t))));
        if (!opt->edges_dev[k]) return mgpu__refail(op);
        MGPU__TRY(mgpu__upload_async(p->dev, mgpu_tensor_data(opt->edges_dev[k]), opt->edges + first, (size_t)n * sizeof(int64_t), op));
    }
    return MGPU_OK;
}

/* Clipping's buffers: on each GPU part its replica's stages' sums of squares and the norm; on
   the CPU one float64 per chunk of the largest stage. */
static mgpu_result mgpu__optimizer_clip_buffers(mgpu_optimizer* opt, const char* op) {
    const mgpu_model* m = opt->model;
    int64_t most = 1;
    int k;
    if (!(opt->d.clip_norm > 0.0f)) return MGPU_OK;
    if (m->part[0].dev->kind == MGPU_DEVICE_CPU) {
        for (k = 0; k < m->stage_count; ++k) most = MGPU__MAX(most, mgpu__stage_floats(m, k));
        opt->cpu_sums = (double*)mgpu__calloc((size_t)((most + MGPU__CLIP_CHUNK - 1) / MGPU__CLIP_CHUNK), sizeof(double));
        return opt->cpu_sums ? MGPU_OK : mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    }
    opt->clip_sums = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    opt->clip_norm = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    if (!opt->clip_sums || !opt->clip_norm) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (k = 0; k < m->part_count; ++k) {
        const int64_t bytes = (int64_t)sizeof(double) * (m->stage_count + MGPU__CU_REDUCE_SCRATCH);
        opt->clip_sums[k] = mgpu__own(mgpu_tensor_create(m->part[k].dev, MGPU_U8, mgpu_shape1(bytes)));
        opt->clip_norm[k] = mgpu__own(mgpu_tensor_create(m->part[k].dev, MGPU_F32, mgpu_shape1(1)));
        if (!opt->clip_sums[k] || !opt->clip_norm[k]) return mgpu__refail(op);
    }
    return MGPU_OK;
}

MGPUDEF mgpu_optimizer* mgpu_optimizer_create(mgpu_model* m, const mgpu_optimizer_desc* desc) {
    static const char* op = "mgpu_optimizer_create";
    mgpu_optimizer* opt;
    mgpu_optimizer_desc d;
    int i, s;
    if (!m) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op); return NULL; }
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model")) return NULL;
    if (desc) d = *desc; else memset(&d, 0, sizeof d);
    /* defaults, all in one place (PyTorch's) */
    d.lr = MGPU__DEF(d.lr, d.kind == MGPU_ADAMW ? 1e-3f : 1e-2f);
    d.beta1 = MGPU__DEF(d.beta1, 0.9f);
    d.beta2 = MGPU__DEF(d.beta2, 0.999f);
    d.eps = MGPU__DEF(d.eps, 1e-8f);
    d.gamma = MGPU__DEF(d.gamma, 0.1f);
    if (d.kind != MGPU_SGD && d.kind != MGPU_ADAMW) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: unknown optimizer kind %d", op, (int)d.kind); return NULL; }
    if (!(d.lr > 0.0f) || !(d.weight_decay >= 0.0f) || !(d.momentum >= 0.0f && d.momentum < 1.0f) ||
        !(d.beta1 >= 0.0f && d.beta1 < 1.0f) || !(d.beta2 >= 0.0f && d.beta2 < 1.0f) || !(d.eps > 0.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: lr %g, weight_decay %g, momentum %g, betas (%g, %g), eps %g: "
                   "want lr > 0, weight_decay >= 0, 0 <= momentum, betas < 1, eps > 0", op, (double)d.lr,
                   (double)d.weight_decay, (double)d.momentum, (double)d.beta1, (double)d.beta2, (double)d.eps);
        return NULL;
    }
    if (d.nesterov && (d.momentum <= 0.0f || d.dampening != 0.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: Nesterov momentum requires a momentum and zero dampening", op);
        return NULL;
    }
    if ((d.schedule == MGPU_SCHEDULE_STEP && d.step_size <= 0) || (d.schedule == MGPU_SCHEDULE_COSINE && d.total_steps <= 0) ||
        d.schedule < MGPU_SCHEDULE_CONSTANT || d.schedule > MGPU_SCHEDULE_COSINE) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: schedule %d needs step_size > 0 (step) or total_steps > 0 (cosine)", op, (int)d.schedule);
        return NULL;
    }
    if (!(d.clip_norm >= 0.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: clip_norm %g: want >= 0 (0: no clipping, INFINITY: the norm alone)", op,
                   (double)d.clip_norm);
        return NULL;
    }
    opt = (mgpu_optimizer*)mgpu__calloc(1, sizeof *opt);
    if (!opt) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    opt->model = m;
    m->optimizers++;   /* the model's destroy waits for this one's (LIFETIMES) */
    opt->part_count = m->part_count;
    opt->d = d;
    opt->prepared = -1;
    opt->state1 = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    opt->state2 = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    opt->args = (mgpu_tensor**)mgpu__calloc((size_t)m->part_count, sizeof(mgpu_tensor*));
    if (!opt->state1 || !opt->state2 || !opt->args) { mgpu__optimizer_free(opt); mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    for (i = 0; i < m->part_count; ++i)
        for (s = 0; s < mgpu__optimizer_state_count(opt); ++s) {
            mgpu_tensor** t = s == 0 ? &opt->state1[i] : &opt->state2[i];
            *t = mgpu__own(mgpu_tensor_create(m->part[i].dev, MGPU_F32, m->part[i].params->shape));
            if (!*t || mgpu_tensor_zero(*t) != MGPU_OK) { mgpu__refail(op); mgpu__optimizer_free(opt); return NULL; }
        }
    for (i = 0; i < m->part_count; ++i)
        if (m->part[i].dev->kind == MGPU_DEVICE_CUDA) {
            opt->args[i] = mgpu__own(mgpu_tensor_create(m->part[i].dev, MGPU_U8,
                                                        mgpu_shape1((int64_t)MGPU__MAX(sizeof(mgpu__sgd_args), sizeof(mgpu__adamw_args)))));
            if (!opt->args[i]) { mgpu__refail(op); mgpu__optimizer_free(opt); return NULL; }
        }
    if (mgpu__optimizer_groups(opt, op) != MGPU_OK || mgpu__optimizer_clip_buffers(opt, op) != MGPU_OK) {
        mgpu__optimizer_free(opt);
        return NULL;
    }
    if (mgpu__live_add(opt, MGPU__LIVE_OPTIMIZER, op) != MGPU_OK) { mgpu__optimizer_free(opt); return NULL; }
    return opt;
}

MGPUDEF float mgpu_optimizer_lr(const mgpu_optimizer* opt) {
    const mgpu_optimizer_desc* d;
    if (!opt) return 0.0f;
    d = &opt->d;
    switch (d->schedule) {
    case MGPU_SCHEDULE_STEP: return (float)(d->lr * pow(d->gamma, (double)(opt->steps / d->step_size)));
    case MGPU_SCHEDULE_COSINE: {
        double t = (double)MGPU__MIN(opt->steps, (int64_t)d->total_steps) / d->total_steps;
        return (float)(d->min_lr + (d->lr - d->min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * t)));
    }
    default: return d->lr;
    }
}
MGPUDEF int64_t mgpu_optimizer_step_count(const mgpu_optimizer* opt) { return opt ? opt->steps : 0; }

MGPUDEF mgpu_tensor* mgpu_optimizer_state(mgpu_optimizer* opt, int replica, const char* param, const char* state) {
    static const char* op = "mgpu_optimizer_state";
    const mgpu_model* m;
    const char* kind;
    int s, t, count, v, stage;
    if (!opt) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL optimizer", op); return NULL; }
    m = opt->model;
    if (!mgpu__model_has(op, m, replica, MGPU__ANY, MGPU__ANY) || (t = mgpu__model_find(op, m, param)) < 0) return NULL;
    count = mgpu__optimizer_state_count(opt);
    kind = opt->d.kind == MGPU_ADAMW ? "AdamW" : "SGD";
    if (!state) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL state name", op); return NULL; }
    for (s = 0; s < count && strcmp(state, mgpu__optimizer_state_name(opt, s)) != 0; ++s) {}
    if (s == count) {
        if (count == 0)
            mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%.40s' of '%s': SGD without momentum keeps no state", op, state, param);
        else
            mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%.40s' of '%s': %s keeps %s%s%s, not '%.40s'", op, state, param, kind,
                       mgpu__optimizer_state_name(opt, 0), count > 1 ? " and " : "", count > 1 ? mgpu__optimizer_state_name(opt, 1) : "",
                       state);
        return NULL;
    }
    if (!opt->views) {
        opt->view_count = m->replica_count * 2 * m->tensor_count;
        opt->views = (mgpu_tensor**)mgpu__calloc((size_t)MGPU__MAX(opt->view_count, 1), sizeof(mgpu_tensor*));
        if (!opt->views) { opt->view_count = 0; mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    }
    if (m->tensors[t].tied >= 0) t = m->tensors[t].tied;   /* one tensor, one state: its twin's */
    v = (replica * 2 + s) * m->tensor_count + t;
    stage = mgpu__tensor_stage(m, t);
    if (!opt->views[v]) {
        const int pi = replica * m->stage_count + stage;
        opt->views[v] = mgpu__view_at(s == 0 ? opt->state1[pi] : opt->state2[pi], m->tensors[t].offset - m->stage_off[stage],
                                      m->tensors[t].shape, op);
    }
    return opt->views[v];
}

MGPUDEF mgpu_result mgpu_optimizer_reset(mgpu_optimizer* opt) {
    int i;
    if (!opt) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_optimizer_reset: NULL optimizer");
    for (i = 0; i < opt->part_count; ++i) {
        if (opt->state1[i]) MGPU__TRY(mgpu_tensor_zero(opt->state1[i]));
        if (opt->state2[i]) MGPU__TRY(mgpu_tensor_zero(opt->state2[i]));
    }
    opt->steps = 0;
    return MGPU_OK;
}

/* MGPU__EW_BLOCK parameters of mgpu__sgd_update with its choices given as constants (wd: weight
   decay, mom: momentum, first: the first step, nest: Nesterov, sc: a clipping scale other than
   1): the same arithmetic in the same order, so the same bits, in a loop without branches that
   the compiler vectorises. The three buffers are distinct (parameters, gradients, momentum),
   which restrict tells it. */
#if defined(__cplusplus) || defined(_MSC_VER)
#define MGPU__RESTRICT __restrict
#else
#define MGPU__RESTRICT restrict
#endif
static inline void mgpu__sgd_block(float* MGPU__RESTRICT p, const float* MGPU__RESTRICT g, float* MGPU__RESTRICT buf,
                                   const mgpu__sgd_args* a, int wd, int mom, int first, int nest, int sc) {
    int k;
    for (k = 0; k < MGPU__EW_BLOCK; ++k) {
        float gk = sc ? g[k] * a->grad_scale : g[k];
        if (wd) gk += a->weight_decay * p[k];
        if (mom) {
            const float bv = first ? gk : a->momentum * buf[k] + (1.0f - a->dampening) * gk;
            buf[k] = bv;
            gk = nest ? gk + a->momentum * bv : bv;
        }
        p[k] -= a->lr * gk;
    }
}

typedef struct mgpu__optim_job {
    float *p, *m, *v;
    const float* g;
    const mgpu__sgd_args* sgd;
    const mgpu__adamw_args* adamw;   /* NULL for SGD */
    const int64_t* edges;            /* the part's no-decay ranges (mgpu__edges_upto) */
    int edge_count;
} mgpu__optim_job;
/* [begin, end) of the job's buffers with one group's arguments */
static void mgpu__optim_span(const mgpu__optim_job* j, const mgpu__sgd_args* sgd_args, const mgpu__adamw_args* adamw_args,
                             int64_t begin, int64_t end) {
    /* the arguments and pointers as locals: a store through p could otherwise alias the floats
       of the job, and the compiler would reload them every element instead of vectorising */
    const mgpu__sgd_args sgd = *sgd_args;
    float *p = j->p, *m = j->m, *v = j->v, unused = 0.0f;
    const float* g = j->g;
    int64_t i;
    if (adamw_args) {
        const mgpu__adamw_args adamw = *adamw_args;
        for (i = begin; i < end; ++i) mgpu__adamw_update(&p[i], g[i], &m[i], &v[i], &adamw);
        return;
    }
    /* SGD: whole blocks with the update's five choices fixed in the code of each loop (GCC's -O2
       vectorises no loop with a branch in it), then the rest one at a time. m is NULL exactly when
       there is no momentum, and then no block reads it. */
    i = begin;
#define MGPU__SGD_CASE(wd, mom, first, nest, sc)                                                           \
    case (wd) | (mom) << 1 | (first) << 2 | (nest) << 3 | (sc) << 4:                                       \
        for (; i + MGPU__EW_BLOCK <= end; i += MGPU__EW_BLOCK)                                             \
            mgpu__sgd_block(p + i, g + i, m ? m + i : NULL, &sgd, wd, mom, first, nest, sc);               \
        break
    switch ((sgd.weight_decay != 0.0f) | (sgd.momentum != 0.0f) << 1 | (sgd.first_step != 0) << 2 | (sgd.nesterov != 0) << 3 |
            (sgd.grad_scale != 1.0f) << 4) {   /* (sc: a clipped step's scale, as in mgpu__sgd_update) */
        MGPU__SGD_CASE(0, 0, 0, 0, 0); MGPU__SGD_CASE(1, 0, 0, 0, 0); MGPU__SGD_CASE(0, 1, 0, 0, 0); MGPU__SGD_CASE(1, 1, 0, 0, 0);
        MGPU__SGD_CASE(0, 1, 0, 1, 0); MGPU__SGD_CASE(1, 1, 0, 1, 0);
        MGPU__SGD_CASE(0, 0, 0, 0, 1); MGPU__SGD_CASE(1, 0, 0, 0, 1); MGPU__SGD_CASE(0, 1, 0, 0, 1); MGPU__SGD_CASE(1, 1, 0, 0, 1);
        MGPU__SGD_CASE(0, 1, 0, 1, 1); MGPU__SGD_CASE(1, 1, 0, 1, 1);
    default: break;   /* the first step, or nesterov without momentum (refused when made): the loop below */
    }
#undef MGPU__SGD_CASE
    for (; i < end; ++i) mgpu__sgd_update(&p[i], g[i], m ? &m[i] : &unused, &sgd);
}
/* A thread's range, cut where the group changes: each piece one loop with its arguments (the
   no-decay ones: weight_decay 0), so that each still vectorises. */
static void mgpu__optim_range(void* ctx, int64_t begin, int64_t end) {
    const mgpu__optim_job* j = (const mgpu__optim_job*)ctx;
    mgpu__sgd_args sgd0;
    mgpu__adamw_args adamw0;
    int c;
    if (!j->edge_count) { mgpu__optim_span(j, j->sgd, j->adamw, begin, end); return; }
    sgd0 = *j->sgd;
    sgd0.weight_decay = 0.0f;
    if (j->adamw) { adamw0 = *j->adamw; adamw0.weight_decay = 0.0f; }
    c = mgpu__edges_upto(j->edges, j->edge_count, begin);
    while (begin < end) {
        const int64_t stop = c < j->edge_count ? MGPU__MIN(end, j->edges[c]) : end;
        if (c & 1) mgpu__optim_span(j, &sgd0, j->adamw ? &adamw0 : NULL, begin, stop);
        else mgpu__optim_span(j, j->sgd, j->adamw, begin, stop);
        begin = stop;
        ++c;
    }
}

/* The most optimizer steps counted: 2^53, where a double still counts every step, so that
   steps + 1 and the bias corrections' pow(beta, steps + 1) stay exact and nothing overflows; a
   checkpoint claiming more is refused as malformed. */
#define MGPU__MAX_STEPS ((int64_t)1 << 53)

/* The numbers of the next update (the schedule's learning rate, AdamW's bias corrections), put
   in each GPU's memory before the step's work is queued: a step replayed from a CUDA graph reads
   them there, never a value frozen at its capture. Once per step count. */
static mgpu_result mgpu__optimizer_prepare(mgpu_optimizer* opt, const char* op) {
    const int adamw = opt->d.kind == MGPU_ADAMW;
    int i;
    if (opt->prepared == opt->steps) return MGPU_OK;
    if (opt->steps >= MGPU__MAX_STEPS)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer has taken %lld steps, the most it counts (2^53)", op,
                          (long long)opt->steps);
    memset(&opt->sgd, 0, sizeof opt->sgd);
    memset(&opt->adamw, 0, sizeof opt->adamw);
    opt->sgd.lr = opt->adamw.lr = mgpu_optimizer_lr(opt);
    opt->sgd.weight_decay = opt->adamw.weight_decay = opt->d.weight_decay;
    opt->sgd.momentum = opt->d.momentum;
    opt->sgd.dampening = opt->d.dampening;
    opt->sgd.nesterov = opt->d.nesterov;
    opt->sgd.first_step = opt->steps == 0;
    opt->adamw.beta1 = opt->d.beta1;
    opt->adamw.beta2 = opt->d.beta2;
    opt->adamw.eps = opt->d.eps;
    opt->adamw.bias_correction1 = (float)(1.0 - pow(opt->d.beta1, (double)(opt->steps + 1)));
    opt->adamw.bias_correction2_sqrt = (float)sqrt(1.0 - pow(opt->d.beta2, (double)(opt->steps + 1)));
    opt->sgd.grad_scale = opt->adamw.grad_scale = 1.0f;   /* clipping sets it (on a GPU, in its memory) */
    for (i = 0; i < opt->part_count; ++i)
        if (opt->args[i])
            MGPU__TRY(mgpu__upload_async(MGPU__DEV(opt->args[i]), mgpu_tensor_data(opt->args[i]),
                                         adamw ? (const void*)&opt->adamw : (const void*)&opt->sgd,
                                         adamw ? sizeof opt->adamw : sizeof opt->sgd, op));
    opt->prepared = opt->steps;
    return MGPU_OK;
}

/* The sum of squares of n floats in float64, in chunks of MGPU__CLIP_CHUNK on the thread pool,
   the chunks added in order. */
typedef struct mgpu__sumsq_job { const float* x; int64_t n; double* sums; } mgpu__sumsq_job;
static void mgpu__sumsq_task(void* ctx, int64_t task) {
    const mgpu__sumsq_job* j = (const mgpu__sumsq_job*)ctx;
    const int64_t begin = task * MGPU__CLIP_CHUNK, end = MGPU__MIN(begin + MGPU__CLIP_CHUNK, j->n);
    const float* x = j->x;
    double acc = 0.0;
    int64_t i;
    for (i = begin; i < end; ++i) acc += (double)x[i] * (double)x[i];
    j->sums[task] = acc;
}
static double mgpu__sum_squares_cpu(double* sums, const float* x, int64_t n) {
    mgpu__sumsq_job job;
    const int64_t chunks = (n + MGPU__CLIP_CHUNK - 1) / MGPU__CLIP_CHUNK;
    double total = 0.0;
    int64_t i;
    job.x = x; job.n = n; job.sums = sums;
    mgpu__parallel_for(chunks, mgpu__sumsq_task, &job);
    for (i = 0; i < chunks; ++i) total += sums[i];
    return total;
}

/* Clipping by global norm, before the update: the norm of every gradient of a replica (all its
   stages), and from it the scale every update multiplies the gradients by (mgpu__clip_scale).
   The replicas hold the same reduced gradients. On the CPU: replica 0's stages, summed here.
   On GPUs each part adds its own squares on its device; a pipeline's stages then copy their sum
   to every other stage of their replica (8 bytes each, ordered by events as mgpu_tensor_copy
   orders a copy), and each part adds the S sums in stage order into its norm and writes the
   scale into its update's arguments: the same norm on every stage, and no wait for the host. */
static mgpu_result mgpu__optimizer_clip(mgpu_optimizer* opt, const char* op) {
    mgpu_model* m = opt->model;
    const int S = m->stage_count;
    size_t at;
    int i, t;
    if (m->part[0].dev->kind == MGPU_DEVICE_CPU) {
        double total = 0.0;
        for (t = 0; t < S; ++t) total += mgpu__sum_squares_cpu(opt->cpu_sums, MGPU__F32(m->part[t].grads), mgpu_tensor_numel(m->part[t].grads));
        opt->cpu_norm = (float)sqrt(total);
        opt->sgd.grad_scale = opt->adamw.grad_scale = mgpu__clip_scale(opt->cpu_norm, opt->d.clip_norm);
        return MGPU_OK;
    }
    for (i = 0; i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        double* sums = (double*)mgpu_tensor_data(opt->clip_sums[i]);
        MGPU__COUNT(p->dev, ops, 2);
        MGPU__CU(op, p->dev, mgpu__cu_sum_squares(MGPU__CUDA_ARGS(p->dev), (size_t)mgpu_tensor_numel(p->grads), MGPU__F32(p->grads),
                                                  sums + p->stage, sums + S));
    }
    for (i = 0; i < m->part_count; ++i)
        for (t = 0; t < S; ++t) {
            mgpu__part *to = &m->part[i], *from = &m->part[i - to->stage + t];
            mgpu_device *dd = to->dev, *sd = from->dev;
            double* dst = (double*)mgpu_tensor_data(opt->clip_sums[i]) + t;
            const double* src = (const double*)mgpu_tensor_data(opt->clip_sums[i - to->stage + t]) + t;
            if (t == to->stage) continue;
            MGPU__COUNT(dd, bytes_device_to_device, sizeof(double));
            MGPU__CU(op, sd, mgpu__cu_event_record(sd->ordinal, sd->order, sd->stream));
            MGPU__CU(op, dd, mgpu__cu_stream_wait_event(dd->ordinal, dd->stream, sd->order));
            if (sd->ordinal == dd->ordinal)
                MGPU__CU(op, dd, mgpu__cu_memcpy(dd->ordinal, dst, src, sizeof(double), dd->stream));
            else
                MGPU__CU(op, dd, mgpu__cu_memcpy_peer(dd->ordinal, dst, sd->ordinal, src, sizeof(double), dd->stream));
            MGPU__CU(op, dd, mgpu__cu_event_record(dd->ordinal, dd->order, dd->stream));
            MGPU__CU(op, sd, mgpu__cu_stream_wait_event(sd->ordinal, sd->stream, dd->order));
        }
    at = opt->d.kind == MGPU_ADAMW ? offsetof(mgpu__adamw_args, grad_scale) : offsetof(mgpu__sgd_args, grad_scale);
    for (i = 0; i < m->part_count; ++i) {
        mgpu__part* p = &m->part[i];
        MGPU__COUNT(p->dev, ops, 1);
        MGPU__CU(op, p->dev, mgpu__cu_clip_scale(MGPU__CUDA_ARGS(p->dev), (const double*)mgpu_tensor_data(opt->clip_sums[i]), S,
                                                 opt->d.clip_norm, MGPU__F32(opt->clip_norm[i]),
                                                 (float*)((char*)mgpu_tensor_data(opt->args[i]) + at)));
    }
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_optimizer_last_grad_norm(mgpu_optimizer* opt, float* norm) {
    static const char* op = "mgpu_optimizer_last_grad_norm";
    if (!opt || !norm) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL %s", op, opt ? "norm" : "optimizer");
    if (!mgpu__live_check(opt, MGPU__LIVE_OPTIMIZER, op, "optimizer")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (!(opt->d.clip_norm > 0.0f))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer does not clip (desc.clip_norm 0); ask clip_norm = "
                          "INFINITY for the norm without clipping", op);
    if (!opt->norm_known) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: no step has been taken yet", op);
    if (opt->clip_norm) return mgpu_tensor_download(opt->clip_norm[0], norm, sizeof *norm) == MGPU_OK ? MGPU_OK : mgpu__refail(op);
    *norm = opt->cpu_norm;
    return MGPU_OK;
}

/* The host's side of an update: counted, and the next step draws new dropout masks from row 0. */
static void mgpu__optimizer_advance(mgpu_optimizer* opt) {
    if (opt->d.clip_norm > 0.0f) opt->norm_known = 1;
    opt->steps++;
    opt->model->dropout_step++;
    opt->model->rows_in_step = 0;
}

/* A launch failed after `done` parts (replica-major: replica 0's stages first) had taken the
   update: none, the model is as it was; only some of replica 0's stages, it is half-updated and
   only a load helps; all of replica 0's, replica 0 took the step (the host's count follows it)
   and mgpu_model_resync brings the other replicas to it. */
static void mgpu__optimizer_failed(mgpu_optimizer* opt, int done) {
    mgpu_model* m = opt->model;
    if (done == 0) return;
    if (done < m->stage_count) {
        mgpu__suspect_mark(m, "an optimizer step that failed after updating only some stages of replica 0",
                           MGPU__SUSPECT_LOAD_ONLY | MGPU__SUSPECT_STATES);
        return;
    }
    mgpu__optimizer_advance(opt);
    mgpu__suspect_mark(m, "an optimizer step that failed on some replicas after replica 0 had taken it", MGPU__SUSPECT_STATES);
}

/* The step itself, for an optimizer already known to be live (the training steps check it once
   in mgpu__check_step). */
static mgpu_result mgpu__optimizer_step(mgpu_optimizer* opt) {
    static const char* op = "mgpu_optimizer_step";
    mgpu__optim_job job;
    int i, rc = 0;
    MGPU__TRY(mgpu__optimizer_prepare(opt, op));
    MGPU__TRY(mgpu__ties_gather(opt->model, op));
    if (opt->d.clip_norm > 0.0f) MGPU__TRY(mgpu__optimizer_clip(opt, op));
    memset(&job, 0, sizeof job);
    job.sgd = &opt->sgd;
    job.adamw = opt->d.kind == MGPU_ADAMW ? &opt->adamw : NULL;
    for (i = 0; i < opt->model->part_count; ++i) {
        mgpu__part* r = &opt->model->part[i];
        size_t n = (size_t)opt->model->stage_moved[r->stage];
        const int slice = mgpu__trace_open(opt->model, i, 0, r->dev->stream, "optimizer step %d", (int)opt->steps);
        const int64_t* edges_dev = opt->edges_dev && opt->edges_dev[i] ? (const int64_t*)mgpu_tensor_data(opt->edges_dev[i]) : NULL;
        job.p = MGPU__F32(r->params);
        job.g = MGPU__F32(r->grads);
        job.m = opt->state1[i] ? MGPU__F32(opt->state1[i]) : NULL;
        job.v = opt->state2[i] ? MGPU__F32(opt->state2[i]) : NULL;
        job.edges = opt->edge_first ? opt->edges + opt->edge_first[r->stage] : NULL;
        job.edge_count = opt->edge_first ? opt->edge_first[r->stage + 1] - opt->edge_first[r->stage] : 0;
        MGPU__COUNT(r->dev, ops, 1);
        if (r->dev->kind == MGPU_DEVICE_CPU) {
            mgpu__parallel_range((int64_t)n, MGPU__EW_MIN_PER_THREAD, mgpu__optim_range, &job);
        } else if (job.adamw) {
            rc = MGPU__CUDA(mgpu__cu_adamw(MGPU__CUDA_ARGS(r->dev), n, job.p, job.g, job.m, job.v,
                                           (const mgpu__adamw_args*)mgpu_tensor_data(opt->args[i]), edges_dev,
                                           edges_dev ? job.edge_count : 0));
        } else {
            rc = MGPU__CUDA(mgpu__cu_sgd(MGPU__CUDA_ARGS(r->dev), n, job.p, job.g, job.m,
                                         (const mgpu__sgd_args*)mgpu_tensor_data(opt->args[i]), edges_dev,
                                         edges_dev ? job.edge_count : 0));
        }
        mgpu__trace_close(opt->model, slice, r->dev->stream);
        if (rc != 0) {   /* parts 0 .. i-1 took the update, the others did not */
            const mgpu_result res = mgpu__cu_result(rc, op, r->dev);
            mgpu__optimizer_failed(opt, i);
            return res;
        }
    }
    if (mgpu__ties_spread(opt->model, op) != MGPU_OK) {   /* every part took the update; some tied copies may not */
        const mgpu_result res = mgpu_last_result();
        mgpu__optimizer_failed(opt, opt->model->part_count);
        return res;
    }
    mgpu__optimizer_advance(opt);
    return MGPU_OK;
}

static mgpu_result mgpu__sync_buffers(mgpu_model* m);   /* (>>impl train) */
MGPUDEF mgpu_result mgpu_optimizer_step(mgpu_optimizer* opt) {
    if (!opt) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_optimizer_step: NULL optimizer");
    if (!mgpu__live_check(opt, MGPU__LIVE_OPTIMIZER, "mgpu_optimizer_step", "optimizer")) return MGPU_ERROR_INVALID_ARGUMENT;
    MGPU__TRY(mgpu__suspect_refuse(opt->model, "mgpu_optimizer_step"));
    MGPU__TRY(mgpu__optimizer_step(opt));
    return mgpu__sync_buffers(opt->model);   /* a loop of your own: buffers equal on every replica too */
}

/* ---- >>impl train: the data-parallel training step -------------------------------------- */
/* Data parallelism in five moves, the thing to read to see how multi-GPU training works:

     1. replicate  every device holds a full copy of the model (mgpu_model_create, once: replica
                   0 initialises, the others copy it; never again per step, unlike
                   nn.DataParallel);
     2. split      the host batch is cut into one slice of rows per replica, as even as can be
                   (the first B % R replicas take one row more), each copied to its device;
     3. compute    each replica runs forward, the loss and backward on its slice; the loss is
                   scaled by the WHOLE batch, so the replicas' gradients add up to exactly the
                   one-device gradient, however uneven the split;
     4. reduce     the gradients are summed across replicas (an all-reduce, >>parallel), bucket
                   by bucket from the last layer back, each as soon as backward has produced
                   it, while backward goes on with the earlier layers (DDP's bucketed overlap);
     5. update     every replica takes the same optimizer step on the same summed gradient, so
                   they stay identical, bit for bit (mgpu_model_verify_replicas checks it).

   Moves 2 to 4 run in one of two ways, each a function of its own: CPU replicas run one thread
   each, then reduce (mgpu__run_batch_threads); GPU replicas are all driven from this one host
   thread, which only queues work on each device's stream, so the devices compute at once
   (mgpu__run_batch_streams; a single CPU replica takes this path too, its ops simply running
   as they are called). In PyTorch's terms: mgpu_model_train_step is DDP's forward, backward
   and optimizer.step(); mgpu_model_accumulate is a backward under DDP's no_sync();
   mgpu_model_desc.bucket_bytes is bucket_cap_mb; mgpu_allreduce_sum is a group of
   ncclAllReduce calls, one per GPU. */

/* ---- the building blocks: forward and backward of one part ---- */

/* x must be [batch, sample shape...] */
static mgpu_result mgpu__check_input(const char* op, const mgpu_model* m, const mgpu_tensor* x) {
    char tx[128], ts[96];
    int i, ok;
    MGPU__TRY(mgpu__check_tensor(op, "x", x, m->input_dtype));
    ok = x->shape.ndim == m->input.ndim + 1;
    for (i = 0; ok && i < m->input.ndim; ++i) ok = x->shape.dim[i + 1] == m->input.dim[i];
    if (!ok)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: x %s is not [batch, %s] (the model's sample shape)", op,
                          mgpu_tensor_describe(x, tx, sizeof tx), mgpu__shape_text(m->input, ts, sizeof ts));
    return MGPU_OK;
}

/* The model's output in a last stage's slot, as the loss and the caller take it: the last layer's
   output, or with bf16 activations its f32 widening. */
static mgpu_tensor* mgpu__slot_output(const mgpu_model* m, const mgpu__slot* sl) {
    return m->precision == MGPU_BF16 ? sl->wide_out : sl->act[m->layer_count - 1];
}

/* Where a step's loss gradient goes: over the output itself with cross-entropy (its kernels read
   a row before they write it), when the last layer's backward never reads its output (a Linear's:
   struct mgpu_layer, output_unused), as llm.c's fused classifier writes the logits' gradient over
   the logits (a GPT's largest tensor: 1.6 GB at GPT-2's vocabulary, 8 x 1024 positions), or over
   the f32 widening of a bf16 model's output (which no backward reads); else the slot's own dout. */
static int mgpu__loss_grad_in_place(const mgpu_model* m) {
    return m->loss != MGPU_LOSS_MSE && (m->precision == MGPU_BF16 || m->layers[m->layer_count - 1]->output_unused);
}
/* Size every activation, gradient and aux buffer of a part's slot for input shape x. */
static mgpu_result mgpu__slot_resize(mgpu_model* m, const mgpu__part* p, mgpu__slot* sl, mgpu_shape x) {
    static const char* op = "mgpu_model_forward";
    const int last = m->stage_layer[p->stage + 1] - 1;
    mgpu_shape shape = x;
    int64_t need[2] = { -1, -1 };   /* -1: no layer of that parity has a gradient buffer */
    int i, j;
    if (mgpu_shape_equal(sl->in_shape, x)) return MGPU_OK;
    mgpu__slot_free_buffers(m, sl);
    for (i = m->stage_layer[p->stage]; i <= last; ++i) {
        const mgpu_layer* l = m->layers[i];
        mgpu_shape out;
        for (j = 0; j < m->first_aux[i + 1] - m->first_aux[i]; ++j) {
            mgpu_dtype dt;
            mgpu_shape as;
            MGPU__TRY(l->vt->aux_shape(l, j, shape, &dt, &as));
            MGPU__TRY(mgpu__ensure(&sl->aux[m->first_aux[i] + j], p->dev, dt, as));
        }
        MGPU__TRY(mgpu__layer_output(m, i, shape, &out));
        if (i > m->stage_layer[p->stage] && l->in_place_ok && m->layers[i - 1]->output_unused &&
            mgpu_shape_equal(out, sl->act[i - 1]->shape)) {   /* over its input (struct mgpu_layer, in_place_ok) */
            if (!(sl->act[i] = mgpu__view_at(sl->act[i - 1], 0, out, op))) return mgpu_last_result();
        } else MGPU__TRY(mgpu__ensure(&sl->act[i], p->dev, m->precision, out));
        shape = out;
    }
    /* the f32 output and the loss gradient rounded, before any step's temporaries (a CUDA graph's
       capture finds theirs in the cache) */
    if (m->precision == MGPU_BF16 && p->stage == m->stage_count - 1) {
        MGPU__TRY(mgpu__ensure(&sl->wide_out, p->dev, MGPU_F32, shape));
        MGPU__TRY(mgpu__ensure(&sl->dyin, p->dev, MGPU_BF16, shape));
    }
    if (p->stage == m->stage_count - 1 && !mgpu__loss_grad_in_place(m)) MGPU__TRY(mgpu__ensure(&sl->dout, p->dev, MGPU_F32, shape));
    sl->has_dxin = 0;
    /* the two gradient buffers, each as large as its largest gradient, and the views into them */
    for (i = m->stage_layer[p->stage]; i < last; ++i) need[i % 2] = MGPU__MAX(need[i % 2], mgpu_tensor_numel(sl->act[i]));
    for (j = 0; j < 2; ++j)
        if (need[j] >= 0) MGPU__TRY(mgpu__ensure(&sl->dflat[j], p->dev, m->precision, mgpu_shape1(need[j])));
    for (i = m->stage_layer[p->stage]; i < last; ++i)
        if (!(sl->dact[i] = mgpu__view_at(sl->dflat[i % 2], 0, sl->act[i]->shape, op))) return mgpu_last_result();
    sl->in_shape = x;
    return MGPU_OK;
}

/* The order of two parts' streams (a CUDA pipeline): before its forward k, a part's stream waits
   for the stage before to have run forward k (backward: for the stage after to have run backward
   k, and sent d input). Every caller of mgpu__part_forward and _backward waits first, once. */
static mgpu_result mgpu__part_wait(const char* op, const mgpu_model* m, const mgpu__part* p, int k, int backward) {
    const mgpu__part* from = backward ? p + 1 : p - 1;
    if (backward ? p->stage == m->stage_count - 1 : p->stage == 0) return MGPU_OK;
    if (!from->events) return MGPU_OK;
    MGPU__CU(op, p->dev, mgpu__cu_stream_wait_event(p->dev->ordinal, p->dev->stream, from->events[backward ? m->micro_batches + k : k]));
    return MGPU_OK;
}
static mgpu_result mgpu__part_mark(const char* op, const mgpu__part* p, int event) {
    if (!p->events) return MGPU_OK;
    MGPU__CU(op, p->dev, mgpu__cu_event_record(p->dev->ordinal, p->events[event], p->dev->stream));
    return MGPU_OK;
}

/* Between the stages of a pipeline: dst = src, queued on the stream of dst's or src's part
   (`on`), never waiting for the host: a copy on the same GPU, a peer copy between two (which the
   CUDA runtime stages through the host where there is no peer access), a plain copy between
   CPU devices. The caller orders it after src's producer (mgpu__part_wait). */
static mgpu_result mgpu__stage_copy(const mgpu__part* on, mgpu_tensor* dst, const mgpu_tensor* src) {
    static const char* op = "pipeline copy";
    mgpu_device *dd = MGPU__DEV(dst), *sd = MGPU__DEV(src);
    if (dd->kind == MGPU_DEVICE_CPU && sd->kind == MGPU_DEVICE_CPU) return mgpu_tensor_copy(dst, src);
    MGPU__COUNT(dd, bytes_device_to_device, mgpu_tensor_bytes(src));
    if (dd->ordinal == sd->ordinal)
        MGPU__CU(op, on->dev, mgpu__cu_memcpy(on->dev->ordinal, mgpu_tensor_data(dst), mgpu_tensor_data(src), mgpu_tensor_bytes(src),
                                             on->dev->stream));
    else
        MGPU__CU(op, on->dev, mgpu__cu_memcpy_peer(dd->ordinal, mgpu_tensor_data(dst), sd->ordinal, mgpu_tensor_data(src),
                                                  mgpu_tensor_bytes(src), on->dev->stream));
    return MGPU_OK;
}

/* After layer i's own code ran (a custom layer) on a GPU: a CUDA error it left pending (a launch
   of its own not checked by mgpu_cuda_end) is its error, named as the layer's, not the next
   launch's of mgpu. */
static mgpu_result mgpu__custom_layer_pending(const mgpu_model* m, const mgpu__part* p, int i, const char* op) {
    char where[96];
    int rc;
    if (m->layers[i]->graph_safe || p->dev->kind != MGPU_DEVICE_CUDA || (rc = MGPU__CUDA(mgpu__cu_pending_error())) == 0) return MGPU_OK;
    snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(m->layers[i]));
    return mgpu__cu_result(rc, where, p->dev);
}

/* Forward of micro-batch k on a part, whose rows start at row first_row of the whole batch. The
   first stage reads x (on its device); a later stage first pulls the output of the stage
   before (which ran forward k already: the CPU threads wait for it, GPU streams order it). */
static mgpu_result mgpu__part_forward(mgpu_model* m, mgpu__part* p, int k, const mgpu_tensor* x, int training, int64_t first_row) {
    static const char* op = "mgpu_model_forward";
    mgpu__slot* sl = &p->slot[k % p->slot_count];
    char where[96];
    int i;
    sl->has_input = 0;   /* until every layer has run: backward needs a whole forward */
    if (p->params_bf16 && k == 0)   /* the weights of this step's forwards (the parameters change between steps) */
        MGPU__TRY(mgpu_tensor_convert(p->params_bf16, p->params, 1.0f, 0.0f));
    if (p->stage > 0) {
        const mgpu__part* from = p - 1;
        const mgpu_tensor* y = from->slot[k % from->slot_count].act[m->stage_layer[p->stage] - 1];
        MGPU__TRY(mgpu__ensure(&sl->xin, p->dev, y->dtype, y->shape));
        MGPU__TRY(mgpu__stage_copy(p, sl->xin, y));   /* after mgpu__part_wait (the caller's) */
        x = sl->xin;
    } else if (m->precision == MGPU_BF16 && x->dtype == MGPU_F32) {   /* the input rounded, as autocast's first layer takes it */
        MGPU__TRY(mgpu__ensure(&sl->xin, p->dev, MGPU_BF16, x->shape));
        MGPU__TRY(mgpu_tensor_convert(sl->xin, x, 1.0f, 0.0f));
        x = sl->xin;
    }
    MGPU__COUNT(p->dev, rows_forward, x->shape.dim[0]);
    MGPU__TRY(mgpu__slot_resize(m, p, sl, x->shape));
    sl->input = *x;
    sl->training = training;
    sl->first_row = first_row;
    for (i = m->stage_layer[p->stage]; i < m->stage_layer[p->stage + 1]; ++i) {
        mgpu_layer_ctx ctx;
        mgpu_result r;
        mgpu__layer_ctx_for(m, p, sl, i, training, &ctx);
        mgpu_clear_error();   /* a failure's message is the layer's own, never an earlier one */
        r = mgpu__layer_run_forward(m->layers[i], &ctx, i > m->stage_layer[p->stage] ? sl->act[i - 1] : &sl->input, sl->act[i]);
        if (!m->layers[i]->graph_safe) (void)MGPU__CUDA(mgpu__cu_device_unknown());   /* a custom layer's code ran */
        if (r != MGPU_OK) {
            snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(m->layers[i]));
            return mgpu__layer_refail(r, where);
        }
        MGPU__TRY(mgpu__custom_layer_pending(m, p, i, op));
    }
    if (m->precision == MGPU_BF16 && p->stage == m->stage_count - 1)   /* the loss and the caller take f32 */
        MGPU__TRY(mgpu_tensor_convert(sl->wide_out, sl->act[m->layer_count - 1], 1.0f, 0.0f));
    sl->has_input = 1;
    return MGPU_OK;   /* the caller marks forward k done (mgpu__part_mark), after what else it adds */
}

/* Backward of micro-batch k through layer i of a part. d output is doutput on the last stage,
   else what the stage after sent back (it ran backward k already); the stage's first layer
   gives d input when there is a stage before, or when asked (input_grad). */
static mgpu_result mgpu__part_backward_layer(mgpu_model* m, mgpu__part* p, int k, int i, const mgpu_tensor* doutput, int input_grad) {
    static const char* op = "mgpu_model_backward";
    mgpu__slot* sl = &p->slot[k % p->slot_count];
    const int first = m->stage_layer[p->stage], last = m->stage_layer[p->stage + 1] - 1;
    const mgpu_tensor* dy = i < last ? sl->dact[i] : p->stage == m->stage_count - 1 ? doutput : sl->dyin;
    mgpu_tensor* dx = i > first ? sl->dact[i - 1] : NULL;
    mgpu_layer_ctx ctx;
    mgpu_result r;
    char where[96];
    if (i == last && p->stage == m->stage_count - 1 && m->precision == MGPU_BF16) {   /* the f32 loss gradient, rounded */
        MGPU__TRY(mgpu_tensor_convert(sl->dyin, doutput, 1.0f, 0.0f));
        dy = sl->dyin;
    }
    if (i == first && (p->stage > 0 || (input_grad && m->input_dtype == MGPU_F32))) {   /* (token ids have none) */
        MGPU__TRY(mgpu__ensure(&sl->dxin, p->dev, sl->input.dtype, sl->input.shape));
        dx = sl->dxin;
        sl->has_dxin = 0;
    }
    mgpu__layer_ctx_for(m, p, sl, i, sl->training, &ctx);
    mgpu_clear_error();
    r = mgpu__layer_run_backward(m->layers[i], &ctx, i > first ? sl->act[i - 1] : &sl->input, sl->act[i], dy, dx);
    if (!m->layers[i]->graph_safe) (void)MGPU__CUDA(mgpu__cu_device_unknown());   /* a custom layer's code ran */
    if (r != MGPU_OK) {
        snprintf(where, sizeof where, "%s: layer %d (%s)", op, i, mgpu_layer_type(m->layers[i]));
        return mgpu__layer_refail(r, where);
    }
    if (dx && dx == sl->dxin && p->stage == 0 && dx->dtype != MGPU_F32) {   /* d input as the caller's x: f32 */
        MGPU__TRY(mgpu__ensure(&sl->wide_dxin, p->dev, MGPU_F32, dx->shape));
        MGPU__TRY(mgpu_tensor_convert(sl->wide_dxin, dx, 1.0f, 0.0f));
        sl->has_dxin = 1;
    }
    return mgpu__custom_layer_pending(m, p, i, op);
}

/* After a part's backward of micro-batch k: d input goes back to the stage before, pushed on
   this part's stream into that stage's slot (free: that stage ran backward k - slots before
   its forward k, which this part's forward k came after). */
static mgpu_result mgpu__part_backward_done(mgpu__part* p, int k) {
    MGPU__COUNT(p->dev, rows_backward, p->slot[k % p->slot_count].input.shape.dim[0]);
    if (p->stage > 0) {
        mgpu__part* to = p - 1;
        mgpu__slot* dst = &to->slot[k % to->slot_count];
        const mgpu_tensor* dx = p->slot[k % p->slot_count].dxin;
        MGPU__TRY(mgpu__ensure(&dst->dyin, to->dev, dx->dtype, dx->shape));
        MGPU__TRY(mgpu__stage_copy(p, dst->dyin, dx));
    }
    return MGPU_OK;   /* the caller marks backward k done (mgpu__part_mark) */
}

static mgpu_result mgpu__part_backward(mgpu_model* m, mgpu__part* p, int k, const mgpu_tensor* doutput, int input_grad) {
    int i;
    for (i = m->stage_layer[p->stage + 1] - 1; i >= m->stage_layer[p->stage]; --i)
        MGPU__TRY(mgpu__part_backward_layer(m, p, k, i, doutput, input_grad));
    return mgpu__part_backward_done(p, k);
}

/* Forward of one replica, through its stages in turn, with micro-batch slot 0. */
static const mgpu_tensor* mgpu__forward(mgpu_model* m, int replica, const mgpu_tensor* x, int training, int64_t first_row) {
    static const char* op = "mgpu_model_forward";
    const mgpu__part* first;
    int s;
    if (mgpu__check_replica(op, m, replica) != MGPU_OK || mgpu__check_input(op, m, x) != MGPU_OK) return NULL;
    first = mgpu__part_of(m, replica, 0);
    if (MGPU__DEV(x) != first->dev) {   /* on the CPU devices of a set too, as on GPUs */
        char tx[128];
        mgpu__fail(MGPU_ERROR_DEVICE_MISMATCH, "%s: x %s is not on replica %d's device %s", op,
                   mgpu_tensor_describe(x, tx, sizeof tx), replica, first->dev->label);
        return NULL;
    }
    for (s = 0; s < m->stage_count; ++s)
        if (mgpu__part_wait(op, m, mgpu__part_of(m, replica, s), 0, 0) != MGPU_OK ||
            mgpu__part_forward(m, mgpu__part_of(m, replica, s), 0, x, training, first_row) != MGPU_OK ||
            mgpu__part_mark(op, mgpu__part_of(m, replica, s), 0) != MGPU_OK)
            return NULL;
    return mgpu__slot_output(m, &mgpu__part_of(m, replica, m->stage_count - 1)->slot[0]);
}

MGPUDEF const mgpu_tensor* mgpu_model_forward(mgpu_model* m, int replica, const mgpu_tensor* x, int training) {
    mgpu_model* meeting = mgpu__meet_model;   /* (called inside a layer of a step that meets: not this model's meeting) */
    const mgpu_tensor* y;
    int s;
    if (m && replica >= 0 && replica < m->replica_count)
        for (s = 0; s < m->stage_count; ++s) mgpu__part_of(m, replica, s)->stream_salt = replica + 1;
    mgpu__meet_model = NULL;
    y = mgpu__forward(m, replica, x, training, 0);
    mgpu__meet_model = meeting;
    return y;
}

MGPUDEF mgpu_result mgpu_model_backward(mgpu_model* m, int replica, const mgpu_tensor* doutput) {
    static const char* op = "mgpu_model_backward";
    mgpu_model* meeting;
    mgpu_result r = MGPU_OK;
    int s;
    MGPU__TRY(mgpu__check_replica(op, m, replica));
    for (s = 0; s < m->stage_count; ++s)
        if (!mgpu__part_of(m, replica, s)->slot[0].has_input)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: no forward pass to go back through", op);
    MGPU__TRY(mgpu__check_like(op, "doutput", doutput, "output", mgpu__slot_output(m, &mgpu__part_of(m, replica, m->stage_count - 1)->slot[0])));
    meeting = mgpu__meet_model;   /* as in mgpu_model_forward */
    mgpu__meet_model = NULL;
    for (s = m->stage_count - 1; s >= 0 && r == MGPU_OK; --s) {
        r = mgpu__part_wait(op, m, mgpu__part_of(m, replica, s), 0, 1);
        if (r == MGPU_OK) r = mgpu__part_backward(m, mgpu__part_of(m, replica, s), 0, doutput, 1);
        if (r == MGPU_OK) r = mgpu__part_mark(op, mgpu__part_of(m, replica, s), m->micro_batches);
    }
    mgpu__meet_model = meeting;
    return r;
}

MGPUDEF const mgpu_tensor* mgpu_model_input_grad(const mgpu_model* m, int replica) {
    const mgpu__slot* sl;
    if (mgpu__check_replica("mgpu_model_input_grad", m, replica) != MGPU_OK) return NULL;
    sl = &mgpu__part_of(m, replica, 0)->slot[0];
    if (!sl->dxin || !mgpu_shape_equal(sl->dxin->shape, sl->input.shape)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_input_grad: no mgpu_model_backward of replica %d yet", replica);
        return NULL;
    }
    if (sl->dxin->dtype == MGPU_F32) return sl->dxin;
    if (!sl->wide_dxin || !sl->has_dxin) {   /* (bf16: widened after the first layer's backward, which failed) */
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_input_grad: the last mgpu_model_backward of replica %d failed", replica);
        return NULL;
    }
    return sl->wide_dxin;
}

MGPUDEF mgpu_result mgpu_model_zero_grad(mgpu_model* m) {
    int i;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_zero_grad: NULL model");
    for (i = 0; i < m->part_count; ++i) MGPU__TRY(mgpu_tensor_zero(m->part[i].grads));
    m->grads_reduced = 0;
    return MGPU_OK;
}

/* ---- move 2, split: each replica's rows of the batch, on its devices ---- */

/* The target of a batch: for cross-entropy int32 labels, one per row of the output, so the
   output's shape without its last dimension ([B] for [B, classes], [B, T] for [B, T, vocab]); for
   MSE f32 [B, ...] (checked against the output where it is made). */
static mgpu_result mgpu__check_target(const char* op, const mgpu_model* m, const mgpu_tensor* x, const mgpu_tensor* target) {
    char tt[128], tx[128], want[96];
    int i, ok;
    MGPU__TRY(mgpu__check_tensor(op, "target", target, m->loss == MGPU_LOSS_MSE ? MGPU_F32 : MGPU_I32));
    ok = target->shape.ndim >= 1 && target->shape.dim[0] == x->shape.dim[0];
    if (m->loss != MGPU_LOSS_MSE) {
        mgpu_shape labels = m->output;   /* [1, ..., classes] -> [B, ...] */
        labels.ndim = MGPU__MAX(labels.ndim - 1, 1);
        labels.dim[0] = x->shape.dim[0];
        ok = ok && target->shape.ndim == labels.ndim;
        for (i = 1; ok && i < labels.ndim; ++i) ok = target->shape.dim[i] == labels.dim[i];
        if (!ok) {
            mgpu__shape_text(labels, want, sizeof want);
            return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: target %s does not match x %s: want int32 labels %s, one per "
                              "row of the model's output (MGPU_IGNORE_INDEX for none)", op,
                              mgpu_tensor_describe(target, tt, sizeof tt), mgpu_tensor_describe(x, tx, sizeof tx), want);
        }
    }
    if (!ok)
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "%s: target %s does not match x %s (want one row per sample)", op,
                          mgpu_tensor_describe(target, tt, sizeof tt), mgpu_tensor_describe(x, tx, sizeof tx));
    return MGPU_OK;
}

/* The loss's terms among rows [start, start + count) of a target: for cross-entropy its labels
   that are not MGPU_IGNORE_INDEX, read on the host; for labels on a GPU, which the host does not
   read (a step never waits for the devices), their positions, and each part's loss is then the
   mean over its own labels, weighted by its positions (mgpu__micro_forward); for MSE the rows. A
   batch's loss is the weighted mean over its parts, and its gradient scaled alike. */
static mgpu_result mgpu__loss_terms(const mgpu_model* m, const mgpu_tensor* target, int64_t start, int64_t count,
                                    int64_t* terms) {
    const mgpu_tensor rows = mgpu__rows(target, start, count);
    const int64_t n = mgpu_tensor_numel(&rows);
    const int32_t* labels = MGPU__I32(&rows);
    int64_t i, valid = 0;
    *terms = count;
    if (m->loss == MGPU_LOSS_MSE || n == 0) return MGPU_OK;
    if (!MGPU__IS_CPU(target)) {
        *terms = n;
        return MGPU_OK;
    }
    for (i = 0; i < n; ++i) valid += labels[i] != MGPU_IGNORE_INDEX;
    *terms = valid;
    return MGPU_OK;
}

/* Piece i of n rows cut into `pieces`: an even split, the first n % pieces one row more. Rows go
   to replicas, then a replica's rows to its micro-batches. */
static void mgpu__split(int64_t n, int pieces, int i, int64_t* start, int64_t* count) {
    int64_t base = n / pieces, extra = n % pieces;
    *count = base + (i < extra ? 1 : 0);
    *start = (int64_t)i * base + MGPU__MIN((int64_t)i, extra);
}

/* A part's slice of t, on its device: t itself where possible (unless copy), else a copy in
   *buf. (A CUDA graph's steps always copy: the graph reads the buffers of its capture.) Host
   memory on another CPU device is lent to the part's (*lent: the same memory, labelled with the
   part's device, never freed through it), so that the ops of the part, which refuse tensors of
   two devices, run on it without a copy. */
static mgpu_result mgpu__part_slice(const mgpu__part* p, const mgpu_tensor* t, int64_t start, int64_t count, int copy,
                                    mgpu_tensor** buf, mgpu__storage* lent, mgpu_tensor* view) {
    *view = mgpu__rows(t, start, count);
    if (!copy && MGPU__DEV(t) == p->dev) return MGPU_OK;
    if (!copy && MGPU__IS_CPU(t) && p->dev->kind == MGPU_DEVICE_CPU) {
        if (lent->ptr != t->storage->ptr || lent->dev != p->dev) {   /* unchanged: not rewritten while
                                                                        another stage's thread reads it */
            *lent = *t->storage;
            lent->dev = p->dev;
            lent->refs = 1;   /* the lender's; never released */
        }
        view->storage = lent;
        return MGPU_OK;
    }
    MGPU__TRY(mgpu__ensure(buf, p->dev, t->dtype, view->shape));
    MGPU__TRY(mgpu_tensor_copy(*buf, view));
    *view = **buf;
    return MGPU_OK;
}

/* Rows [start, start + count) of x for part `in` (a replica's first stage) and of the target for
   part `out` (its last), as mgpu__part_slice makes them. When one GPU part takes both from the
   CPU, they go up as one copy into its xbuf: x's rows, then the target's at the next 256 bytes. */
static mgpu_result mgpu__part_inputs(mgpu__part* in, mgpu__part* out, const mgpu_tensor* x, const mgpu_tensor* target,
                                     int64_t start, int64_t count, int copy, mgpu_tensor* xs, mgpu_tensor* ts) {
    mgpu__host_piece piece[2];
    mgpu_tensor both;
    if (in != out || in->dev->kind == MGPU_DEVICE_CPU || !MGPU__IS_CPU(x) || !MGPU__IS_CPU(target)) {
        MGPU__TRY(mgpu__part_slice(in, x, start, count, copy, &in->xbuf, &in->xlent, xs));
        return mgpu__part_slice(out, target, start, count, copy, &out->tbuf, &out->tlent, ts);
    }
    *xs = mgpu__rows(x, start, count);
    *ts = mgpu__rows(target, start, count);
    piece[0].host = mgpu_tensor_data(xs);
    piece[0].bytes = mgpu_tensor_bytes(xs);
    piece[0].at = 0;
    piece[1].host = mgpu_tensor_data(ts);
    piece[1].bytes = mgpu_tensor_bytes(ts);
    piece[1].at = (piece[0].bytes + 255) & ~(size_t)255;
    MGPU__TRY(mgpu__ensure(&in->xbuf, in->dev, MGPU_U8, mgpu_shape1((int64_t)(piece[1].at + piece[1].bytes))));
    if (piece[1].at + piece[1].bytes > 0)
        MGPU__TRY(mgpu__upload_pieces(in->dev, mgpu_tensor_data(in->xbuf), piece, 2, "mgpu_tensor_copy"));
    both = *in->xbuf;   /* the two as views of it */
    xs->storage = ts->storage = both.storage;
    xs->offset = both.offset;
    ts->offset = both.offset + piece[1].at;
    return MGPU_OK;
}

/* A batch on its way through the model: each replica's rows, x on its first stage's device and
   the target on its last's. */
typedef struct mgpu__batch {
    mgpu_model* m;
    const char* op;
    int64_t batch_total;
    mgpu_tensor xs[MGPU__MAX_REPLICAS], ts[MGPU__MAX_REPLICAS];
    int64_t first[MGPU__MAX_REPLICAS];   /* where each replica's rows start in the batch */
    int64_t row_base;                    /* a distributed model: the rows of the ranks before this one */
    double grad_terms;                   /* cross-entropy: the terms the gradient is the mean over (the
                                            batch's, across processes; batch_total's share of them) */
    int labels_on_device;                /* cross-entropy labels on a GPU: terms are positions, and each
                                            part's mean is counted on its device (mgpu__loss_terms) */
    int zero_grads;                      /* a whole step's: the gradients zeroed first (on a GPU, on each
                                            part's stream as its first op is queued) */
    mgpu_result results[MGPU__MAX_REPLICAS];   /* CPU threads: each part's */
} mgpu__batch;

/* A batch of the library's own steps: rows numbered from the step's first, no salt on any part's
   random streams (that is for a loop of your own). The caller sets row_base. */
static void mgpu__batch_begin(mgpu__batch* b, mgpu_model* m, const char* op, int64_t batch_total) {
    int i;
    for (i = 0; i < m->part_count; ++i) m->part[i].stream_salt = 0;
    b->m = m;
    b->op = op;
    b->batch_total = batch_total;
    b->zero_grads = 0;
    b->grad_terms = 0.0;
    b->labels_on_device = 0;
}

/* The loss's terms of each replica's micro-batches (m->terms) and their sum on this process. */
static mgpu_result mgpu__batch_terms(mgpu_model* m, const mgpu_tensor* target, int64_t* sum) {
    int64_t start, count, mstart, mcount, *t;
    int r, k;
    *sum = 0;
    for (r = 0; r < m->replica_count; ++r) {
        mgpu__split(target->shape.dim[0], m->replica_count, r, &start, &count);
        for (k = 0; k < m->micro_batches; ++k) {
            mgpu__split(count, m->micro_batches, k, &mstart, &mcount);
            t = &m->terms[r * m->micro_batches + k];
            MGPU__TRY(mgpu__loss_terms(m, target, start + mstart, mcount, t));
            *sum += *t;
        }
    }
    m->last_terms = *sum;
    return MGPU_OK;
}
/* The gradient's terms for a batch of `rows` rows with `terms` terms (both of the whole job),
   part of batch_total rows: the batch's share of them. */
static double mgpu__grad_terms(int64_t terms, int64_t rows, int64_t batch_total) {
    return rows > 0 && batch_total != rows ? (double)terms * (double)batch_total / (double)rows : (double)terms;
}

static mgpu_result mgpu__batch_split(mgpu__batch* b, const mgpu_tensor* x, const mgpu_tensor* target) {
    mgpu_model* m = b->m;
    int r;
    for (r = 0; r < m->replica_count; ++r) {
        mgpu__part *in = mgpu__part_of(m, r, 0), *out = mgpu__part_of(m, r, m->stage_count - 1);
        int64_t count;
        mgpu__split(x->shape.dim[0], m->replica_count, r, &b->first[r], &count);
        MGPU__TRY(mgpu__part_inputs(in, out, x, target, b->first[r], count, m->graph, &b->xs[r], &b->ts[r]));
    }
    return MGPU_OK;
}

/* ---- move 3, compute: forward, loss and backward of micro-batch k on one part ---- */

/* Loss (and, with dout, its gradient scaled by grad_scale) of an output into `loss` [1]. */
static mgpu_result mgpu__loss(mgpu_model* m, mgpu_tensor* loss, const mgpu_tensor* out, const mgpu_tensor* target,
                              mgpu_tensor* dout, float grad_scale, float mean_factor) {
    const int64_t classes = out->shape.dim[out->shape.ndim - 1], rows = classes ? mgpu_tensor_numel(out) / classes : 0;
    mgpu_tensor logits, labels, dlogits;
    if (m->loss == MGPU_LOSS_MSE) return mgpu_mse(loss, dout, out, target, grad_scale);
    /* a label per row: [B, T, vocab] is B x T rows of logits (the same memory, seen 2-D) */
    logits = mgpu__reshaped(out, mgpu_shape2(rows, classes));
    labels = mgpu__reshaped(target, mgpu_shape1(rows));
    if (dout) dlogits = mgpu__reshaped(dout, logits.shape);
    return mgpu__softmax_xent(loss, dout ? &dlogits : NULL, &logits, &labels, grad_scale, mean_factor);
}

static mgpu_tensor* mgpu__slot_dout(const mgpu_model* m, mgpu__slot* sl) {
    return mgpu__loss_grad_in_place(m) ? mgpu__slot_output(m, sl) : sl->dout;
}

/* Forward k on part p; on the last stage also the loss, and its gradient scaled for the whole
   batch (mgpu__slot_dout). */
static mgpu_result mgpu__micro_forward(mgpu__batch* b, mgpu__part* p, int k) {
    mgpu_model* m = b->m;
    const int r = p->replica;
    int64_t start, count;
    mgpu_tensor xk, tk, lk;
    mgpu__slot* sl = &p->slot[k % p->slot_count];
    const mgpu_tensor* out;
    double per_row;
    mgpu__split(b->xs[r].shape.dim[0], m->micro_batches, k, &start, &count);
    xk = mgpu__rows(&b->xs[r], start, count);
    MGPU__TRY(mgpu__part_forward(m, p, k, &xk, 1, m->rows_in_step + b->row_base + b->first[r] + start));
    if (p->stage < m->stage_count - 1) return MGPU_OK;
    out = mgpu__slot_output(m, sl);
    tk = mgpu__rows(&b->ts[r], start, count);
    lk = mgpu__rows(p->losses, k, 1);
    if (m->loss == MGPU_LOSS_MSE) MGPU__TRY(mgpu__check_like(b->op, "target", &tk, "output", out));   /* (dout: mgpu__slot_resize) */
    /* The gradient of the WHOLE batch's mean loss: summed over replicas and micro-batches it is
       exactly the one-device gradient, however unevenly the rows were split. MSE averages
       every element. */
    if (m->loss != MGPU_LOSS_MSE && b->labels_on_device)   /* its own mean, weighted by its positions' share */
        return mgpu__loss(m, &lk, out, &tk, mgpu__slot_dout(m, sl), 0.0f,
                          b->grad_terms > 0.0 ? (float)((double)m->terms[r * m->micro_batches + k] / b->grad_terms) : 0.0f);
    if (m->loss != MGPU_LOSS_MSE)   /* the mean over the batch's labels that are not ignored */
        return mgpu__loss(m, &lk, out, &tk, mgpu__slot_dout(m, sl), b->grad_terms > 0.0 ? (float)(1.0 / b->grad_terms) : 0.0f,
                          1.0f);
    per_row = (double)mgpu_tensor_numel(out) / (double)MGPU__MAX(count, 1);
    return mgpu__loss(m, &lk, out, &tk, mgpu__slot_dout(m, sl), (float)(1.0 / ((double)b->batch_total * per_row)), 1.0f);
}

/* The two as a trace sees them: a slice each, from when their input is there (on a GPU the
   stream's wait comes first, so that the slice does not include it) */
static mgpu_result mgpu__run_forward(mgpu__batch* b, mgpu__part* p, int k) {
    int t;
    mgpu_result r = mgpu__part_wait(b->op, b->m, p, k, 0);
    if (r != MGPU_OK) return r;
    t = mgpu__trace_open(b->m, (int)(p - b->m->part), 0, p->dev->stream, "F %d", k);
    r = mgpu__micro_forward(b, p, k);
    mgpu__trace_close(b->m, t, p->dev->stream);
    return r == MGPU_OK ? mgpu__part_mark(b->op, p, k) : r;   /* after the slice: it ends before what waits for it */
}
/* With mark_buckets (the step's last backward, its all-reduce overlapping it), an event on the
   part's stream marks each of its buckets done as soon as the bucket's first layer is. */
static mgpu_result mgpu__mark_buckets(const mgpu_model* m, const mgpu__part* p, int layer) {
    int bk;
    for (bk = 0; bk < m->bucket_count; ++bk)
        if (m->buckets[bk].stage == p->stage && m->buckets[bk].ready_layer == layer)
            MGPU__CU("all-reduce", p->dev, mgpu__cu_event_record(p->dev->ordinal, p->bucket_done[bk], p->dev->stream));
    return MGPU_OK;
}
static mgpu_result mgpu__run_backward(mgpu__batch* b, mgpu__part* p, int k, int mark_buckets) {
    mgpu_model* m = b->m;
    int t, l;
    mgpu_result r = MGPU_OK;
    MGPU__TRY(mgpu__part_wait(b->op, m, p, k, 1));
    t = mgpu__trace_open(m, (int)(p - m->part), 0, p->dev->stream, "B %d", k);
    for (l = m->stage_layer[p->stage + 1] - 1; l >= m->stage_layer[p->stage] && r == MGPU_OK; --l) {
        r = mgpu__part_backward_layer(m, p, k, l, mgpu__slot_dout(m, &p->slot[k % p->slot_count]), 0);
        if (r == MGPU_OK && mark_buckets) r = mgpu__mark_buckets(m, p, l);
    }
    if (r == MGPU_OK) r = mgpu__part_backward_done(p, k);
    mgpu__trace_close(m, t, p->dev->stream);
    return r == MGPU_OK ? mgpu__part_mark(b->op, p, m->micro_batches + k) : r;
}

/* Op j (0 to 2M - 1) of the order in which stage s runs its micro-batches: k for the forward of
   micro-batch k, -1 - k for its backward. GPipe: every forward, then every backward. 1F1B:
   S - s - 1 forwards to fill the pipeline, then a forward and a backward in turn, then the last
   backwards. Backwards go 0, 1, ... in both, so the gradients add up in the same order. */
static int mgpu__stage_op(const mgpu_model* m, int s, int j) {
    const int M = m->micro_batches;
    const int warm = m->schedule == MGPU_PIPELINE_GPIPE ? M : MGPU__MIN(m->stage_count - s - 1, M);
    const int pairs = M - warm;
    if (j < warm) return j;
    j -= warm;
    if (j < 2 * pairs) return j % 2 == 0 ? warm + j / 2 : -1 - j / 2;
    return -1 - (pairs + j - 2 * pairs);
}

/* Whether stage s's next op can be queued: what it needs is queued (a forward k, the forward k of
   the stage before; a backward k, the backward k of the stage after). next, fdone, bdone: per
   stage, the ops queued so far, the forwards and the backwards among them. */
static int mgpu__stage_ready(const mgpu_model* m, int s, const int* next, const int* fdone, const int* bdone) {
    int op, k;
    if (next[s] == 2 * m->micro_batches) return 0;
    op = mgpu__stage_op(m, s, next[s]);
    k = op >= 0 ? op : -1 - op;
    return op >= 0 ? s == 0 || fdone[s - 1] > k : s == m->stage_count - 1 || bdone[s + 1] > k;
}

/* The loss summed over replica r's terms of the last batch (its rows, or the labels that are not
   ignored), from each micro-batch's mean, and their count (waits for the devices). */
static mgpu_result mgpu__replica_loss_sum(mgpu_model* m, int r, double* sum, int64_t* terms) {
    float v[4096];
    int k;
    const mgpu_tensor losses = mgpu__rows(mgpu__part_of(m, r, m->stage_count - 1)->losses, 0, m->micro_batches);
    MGPU__TRY(mgpu_tensor_download(&losses, v, (size_t)m->micro_batches * sizeof(float)));
    *sum = 0.0;
    *terms = 0;
    for (k = 0; k < m->micro_batches; ++k) {
        const int64_t t = m->terms[r * m->micro_batches + k];
        if (t) *sum += (double)v[k] * (double)t;
        *terms += t;
    }
    return MGPU_OK;
}
static mgpu_result mgpu__batch_loss_sum(mgpu_model* m, double* sum) {
    double total = 0.0, one;
    int64_t terms;
    int r;
    for (r = 0; r < m->replica_count; ++r) {
        MGPU__TRY(mgpu__replica_loss_sum(m, r, &one, &terms));
        total += one;
    }
    *sum = total;
    return MGPU_OK;
}
/* The last batch's mean loss over its terms (0 when it had none: every label ignored). */
static mgpu_result mgpu__batch_loss(mgpu_model* m, float* loss) {
    double sum = 0.0;
    MGPU__TRY(mgpu__batch_loss_sum(m, &sum));
    *loss = m->last_terms ? (float)(sum / (double)m->last_terms) : 0.0f;
    return MGPU_OK;
}

/* ---- move 4, reduce: the gradients summed across replicas ---- */

/* A distributed model: every replica of the job, in order, each stage across its copies. The
   first sum's vote also carries the caller's verdict and a number (a step's own result and its
   loss, summed into *number_sum), so that a step votes once before its sums, not twice; NCCL's
   sums are only queued, and every rank hears whether all queued them. */
static mgpu_result mgpu__dist_reduce(mgpu_model* m, mgpu_result mine, double number, double* number_sum) {
    mgpu_tensor* grads[MGPU__MAX_REPLICAS];
    float* bufs[MGPU__MAX_REPLICAS];
    int r, s;
    for (s = 0; s < m->stage_count; ++s, mine = MGPU_OK, number = 0.0, number_sum = NULL) {
        for (r = 0; r < m->replica_count; ++r) {
            grads[r] = mgpu__part_of(m, r, s)->grads;
            bufs[r] = MGPU__F32(grads[r]);
        }
        if (m->ar[s] && m->ar[s]->across_processes) {
            MGPU__TRY(mgpu__dist_agree(mine, 0, number, NULL, number_sum));
            mgpu_result summed = mgpu__ar_sum(m->ar[s], bufs, (size_t)mgpu__stage_floats(m, s));
            if (summed == MGPU_OK) summed = mgpu__ar_wait_processes(m->ar[s]);
            MGPU__TRY(mgpu__dist_agree(summed, 0, 0.0, NULL, NULL));
        } else {
            MGPU__TRY(mgpu__dist_sum("all-reduce across processes", grads, m->replica_count, m->dist_replicas, mine, number,
                                     number_sum));
        }
    }
    m->grads_reduced = 1;
    return MGPU_OK;
}

/* Each stage's whole flat gradient buffer across its copies in one all-reduce (once per step at most). */
static mgpu_result mgpu__reduce_grads(mgpu_model* m) {
    float* bufs[MGPU__MAX_REPLICAS];
    int slices[MGPU__MAX_REPLICAS];
    int r, s;
    if (m->grads_reduced) return MGPU_OK;
    if (m->dist) return mgpu__dist_reduce(m, MGPU_OK, 0.0, NULL);
    for (s = 0; m->replica_count > 1 && s < m->stage_count; ++s) {
        mgpu_result res;
        for (r = 0; r < m->replica_count; ++r) {
            bufs[r] = MGPU__F32(mgpu__part_of(m, r, s)->grads);
            slices[r] = mgpu__trace_open(m, r * m->stage_count + s, 1, m->ar[s]->kind == MGPU_ALLREDUCE_HOST ? NULL : m->ar[s]->rank[r].stream,
                                         "all-reduce stage %d", s);
        }
        res = mgpu__ar_sum(m->ar[s], bufs, (size_t)mgpu__stage_floats(m, s));
        for (r = 0; r < m->replica_count; ++r) mgpu__trace_close(m, slices[r], m->ar[s]->kind == MGPU_ALLREDUCE_HOST ? NULL : m->ar[s]->rank[r].stream);
        MGPU__TRY(res);
    }
    m->grads_reduced = 1;
    return MGPU_OK;
}

/* ---- >>parallel meet: SyncBatchNorm's copies of a stage exchange numbers inside a pass ----
   With desc.sync_batch_norm, a step runs each part on a host thread of its own (GPUs too: the one
   thread that queues every replica's work would wait for itself), and a BatchNorm2d in training
   puts its rows' numbers into its part's slot (mgpu__meet_slot) and meets the other copies of its
   stage (mgpu__meet): the last to arrive gathers every replica's slot, across processes too, and
   combines them in the order of the job's replicas, so that the result depends neither on who
   came first nor on how replicas are spread over threads and processes; every copy takes the
   same numbers home. Forward brings [rows, mean per channel, squared deviations per channel],
   combined as Chan's parallel variance does; backward brings [rows, sum(dy), sum(dy * xhat)],
   summed. Every copy of a stage runs the same order of layers and micro-batches, so the meetings
   pair up by their order. A part that fails wakes the others (pipe_failed), which leave without
   their numbers; across processes a rank that fails in a step ends the job instead
   (mgpu__run_batch), since the others wait for its numbers inside their own passes. */

/* The slot of this thread's part, with room for `doubles`; NULL where no meeting is held. */
static mgpu_result mgpu__meet_slot(size_t doubles, double** slot) {
    mgpu__part* p = mgpu__meet_part;
    *slot = NULL;
    if (!mgpu__meet_model || !p || doubles == 0) return MGPU_OK;
    if (p->meet_len < doubles) {
        double* grown = (double*)MGPU_REALLOC(p->meet, doubles * sizeof(double));
        if (!grown) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "SyncBatchNorm: out of host memory for %zu numbers", doubles);
        p->meet = grown;
        p->meet_len = doubles;
    }
    *slot = p->meet;
    return MGPU_OK;
}

#ifndef MGPU_NO_THREADS
/* Every replica's [rows, a per channel, b per channel] into the first: means and squared
   deviations (MGPU__MEET_STATISTICS), or sums (MGPU__MEET_SUMS), in replica order. */
static void mgpu__meet_combine(int kind, int64_t c, double* all, int count) {
    const size_t w = (size_t)(1 + 2 * c);
    int r;
    int64_t ch;
    for (r = 1; r < count; ++r) {
        const double* in = all + (size_t)r * w;
        const double na = all[0], nb = in[0], n = na + nb;
        for (ch = 0; ch < c; ++ch) {
            if (kind == MGPU__MEET_SUMS) {
                all[1 + ch] += in[1 + ch];
                all[1 + c + ch] += in[1 + c + ch];
            } else {
                const double d = in[1 + ch] - all[1 + ch];
                all[1 + ch] += d * (nb / n);
                all[1 + c + ch] += in[1 + c + ch] + d * d * (na * nb / n);
            }
        }
        all[0] = n;
    }
}

/* The last to arrive: every copy's slot, from this process's parts and the other ranks. */
static mgpu_result mgpu__meet_all(mgpu_model* m, int stage, int kind, int64_t c) {
    mgpu__meet_point* pt = &m->meets[stage];
    const size_t w = (size_t)(1 + 2 * c);
    const int total = m->dist ? m->dist_total : m->replica_count;
    int r;
    if (pt->all_len < (size_t)total * w) {
        double* grown = (double*)MGPU_REALLOC(pt->all, (size_t)total * w * sizeof(double));
        if (!grown) {
            if (m->dist) {   /* the other ranks wait for this one's numbers */
                fprintf(stderr, "mgpu: rank %d: SyncBatchNorm: out of host memory for %d replicas' numbers; ending the job\n",
                        mgpu__dist.rank, total);
                mgpu_dist_abort(1);
            }
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "SyncBatchNorm: out of host memory for %d replicas' numbers", total);
        }
        pt->all = grown;
        pt->all_len = (size_t)total * w;
    }
    for (r = 0; r < m->replica_count; ++r)
        memcpy(pt->all + (size_t)(m->dist_first + r) * w, mgpu__part_of(m, r, stage)->meet, w * sizeof(double));
    if (m->dist) mgpu__dist_meet(pt->all, w, m->dist_replicas);
    mgpu__meet_combine(kind, c, pt->all, total);
    return MGPU_OK;
}
#endif

/* This thread's part meets the other copies of its stage: its slot's [rows, 2c numbers] in, the
   whole job's combination out. */
static mgpu_result mgpu__meet(int kind, int64_t c) {
#ifndef MGPU_NO_THREADS
    mgpu_model* m = mgpu__meet_model;
    mgpu__part* p = mgpu__meet_part;
    mgpu__meet_point* pt = &m->meets[p->stage];
    mgpu_result r = MGPU_OK;
    uint64_t round;
    mgpu__mutex_lock(&m->pipe_lock);
    round = pt->round;
    if (++pt->arrived == m->replica_count) {
        r = mgpu__meet_all(m, p->stage, kind, c);
        pt->arrived = 0;
        if (r == MGPU_OK) pt->round++;
        else m->pipe_failed = 1;
        mgpu__cond_broadcast(&m->pipe_moved);
    } else {
        while (pt->round == round && !m->pipe_failed) mgpu__cond_wait(&m->pipe_moved, &m->pipe_lock);
    }
    if (pt->round != round) memcpy(p->meet, pt->all, (size_t)(1 + 2 * c) * sizeof(double));
    else if (r == MGPU_OK) {
        p->meet_stopped = 1;
        r = mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "SyncBatchNorm: another replica failed");
    }
    mgpu__mutex_unlock(&m->pipe_lock);
    return r;
#else
    (void)kind; (void)c;
    (void)mgpu__dist_meet;   /* (mgpu_model_create refuses sync_batch_norm in this build) */
    return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "SyncBatchNorm: no threads in this build");
#endif
}

/* ---- moves 2 to 4 for a batch, on CPU parts, or parts that meet: one thread each ---- */
/* Each part runs its stage's order on a thread of its own (the pool's, when there is one stage
   and so nothing to wait for; threads of its own otherwise, since stages wait for each other, and
   SyncBatchNorm's copies too: >>parallel meet), and its ops then run single-threaded. A forward
   waits until the stage before has run the same forward, a backward until the stage after has
   run the same backward; a failure wakes every waiting part. Failures come back as text, each
   prefixed with its part. */
#ifndef MGPU_NO_THREADS
static int mgpu__pipe_wait(mgpu_model* m, const int* done, int need) {
    int ok;
    if (!m->pipe_sync) return 1;
    mgpu__mutex_lock(&m->pipe_lock);
    while (*done < need && !m->pipe_failed) mgpu__cond_wait(&m->pipe_moved, &m->pipe_lock);
    ok = !m->pipe_failed;
    mgpu__mutex_unlock(&m->pipe_lock);
    return ok;
}
static void mgpu__pipe_moved(mgpu_model* m, int* done, int failed) {
    if (!m->pipe_sync) { if (!failed) ++*done; return; }   /* the pool's parts: none waits (nor reads pipe_failed) */
    mgpu__mutex_lock(&m->pipe_lock);
    if (failed) m->pipe_failed = 1; else ++*done;
    mgpu__cond_broadcast(&m->pipe_moved);
    mgpu__mutex_unlock(&m->pipe_lock);
}

static void mgpu__part_task(void* ctx, int64_t task) {
    mgpu__batch* b = (mgpu__batch*)ctx;
    mgpu_model* m = b->m;
    mgpu__part* p = &m->part[task];
    mgpu_result res = MGPU_OK;
    int j, stopped = 0;   /* stopped: by a neighbour's failure, not one of this part's */
    mgpu__meet_model = m->sync_bn ? m : NULL;
    mgpu__meet_part = p;
    for (j = 0; j < 2 * m->micro_batches && res == MGPU_OK; ++j) {
        const int op = mgpu__stage_op(m, p->stage, j), k = op >= 0 ? op : -1 - op;
        if (op >= 0) {
            stopped = p->stage > 0 && !mgpu__pipe_wait(m, &(p - 1)->forwards_done, k + 1);
            if (!stopped) res = mgpu__run_forward(b, p, k);
            if (!stopped) mgpu__pipe_moved(m, &p->forwards_done, res != MGPU_OK);
        } else {
            stopped = p->stage < m->stage_count - 1 && !mgpu__pipe_wait(m, &(p + 1)->backwards_done, k + 1);
            if (!stopped) res = mgpu__run_backward(b, p, k, 0);
            if (!stopped) mgpu__pipe_moved(m, &p->backwards_done, res != MGPU_OK);
        }
        if (p->meet_stopped) stopped = 1;
        if (stopped) res = MGPU_ERROR_INVALID_ARGUMENT;
    }
    mgpu__meet_model = NULL;
    mgpu__meet_part = NULL;
    b->results[task] = res;
    if (res != MGPU_OK && !stopped)
        snprintf(m->task_error[task], sizeof m->task_error[task], "replica %d stage %d (%s): %s", p->replica, p->stage,
                 p->dev->label, mgpu_last_error());
}

typedef struct mgpu__part_thread { mgpu__thread thread; mgpu__batch* b; int64_t task; } mgpu__part_thread;
MGPU__THREAD_MAIN(mgpu__part_thread_main, arg) {
    mgpu__part_thread* t = (mgpu__part_thread*)arg;
    mgpu__part_task(t->b, t->task);
    MGPU__THREAD_END;
}

static mgpu_result mgpu__run_batch_threads(mgpu__batch* b, int reduce) {
    mgpu_model* m = b->m;
    int i, failed = -1;
    if (b->zero_grads) MGPU__TRY(mgpu_model_zero_grad(m));
    for (i = 0; i < m->part_count; ++i) {
        m->part[i].forwards_done = m->part[i].backwards_done = 0;
        m->part[i].meet_stopped = 0;
        m->task_error[i][0] = 0;
        b->results[i] = MGPU_OK;
    }
    for (i = 0; m->meets && i < m->stage_count; ++i) m->meets[i].arrived = 0;
    m->pipe_failed = 0;
    if (m->stage_count == 1 && !m->sync_bn) {
        mgpu__parallel_for(m->part_count, mgpu__part_task, b);
    } else {
        mgpu__part_thread threads[MGPU__MAX_REPLICAS];
        int started = 0;
        for (i = 0; i < m->part_count; ++i) {
            threads[i].b = b;
            threads[i].task = i;
            if (mgpu__thread_start(&threads[i].thread, mgpu__part_thread_main, &threads[i]) != 0) break;
            started++;
        }
        if (started < m->part_count) {   /* no thread: stop those that started, and say so */
            mgpu__pipe_moved(m, &m->part[0].forwards_done, 1);
            for (i = 0; i < started; ++i) mgpu__thread_join(threads[i].thread);
            return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: could not start a thread for each of %d %s", b->op,
                              m->part_count, m->stage_count > 1 ? "pipeline parts" : "replicas (SyncBatchNorm)");
        }
        for (i = 0; i < m->part_count; ++i) mgpu__thread_join(threads[i].thread);
    }
    for (i = 0; i < m->part_count; ++i)   /* the first part that failed by itself, not by a neighbour's failure */
        if (b->results[i] != MGPU_OK && m->task_error[i][0]) { failed = i; break; }
    for (i = 0; failed < 0 && i < m->part_count; ++i)
        if (b->results[i] != MGPU_OK) failed = i;
    if (failed >= 0)
        return mgpu__fail(b->results[failed], "%s", m->task_error[failed][0] ? m->task_error[failed] : "a pipeline part failed");
    return reduce ? mgpu__reduce_grads(m) : MGPU_OK;                                                /* 4. reduce */
}
#endif

/* ---- moves 2 to 4 for a batch, on GPU parts: one host thread queues every device's work ---- */
/* Launches do not wait, so while this thread queues one replica's work, the GPUs of the others
   already run theirs. Replicas are queued one after another, last to first: a device's kernels
   are queued while it is current (cudaSetDevice only between replicas; the one-shot sum and the
   update after it start on replica 0's device, current by then). Within a replica the stages'
   orders are merged into one: a stage's next op can be queued once what it needs is queued (a
   forward, the same forward of the stage before; a backward, the same backward of the stage
   after), and the stage being queued goes on while it can; events order the streams the same
   way. The last backward of a stage marks each bucket done with an event on its stream; once
   every replica is queued, each bucket's all-reduce goes on the communication streams, which wait
   for those marks: the GPUs sum a bucket while their compute streams go on with the earlier
   layers, whatever order the host queued them in. A single CPU part takes this path too, its ops
   simply running as they are called. */
/* A distributed model whose GPUs sum through NCCL over the whole job, with one stage: its buckets'
   sums overlap backward as in one process. (Every rank must issue every bucket's all-reduce, in
   bucket order: with one stage that is the order backward reaches them.) */
static int mgpu__dist_overlaps(const mgpu_model* m) {
    return m->dist && m->stage_count == 1 && m->ar && m->ar[0] && m->ar[0]->across_processes && m->bucket_count > 0 &&
           !m->sync_bn;
}
/* Such a rank that failed still issues the all-reduces of the buckets from `first` on, in order,
   so that the other ranks' NCCL does not wait for it forever: the step then fails on every rank
   at the vote that follows. (A failure of NCCL's own calls cannot be made up for:
   ncclCommGetAsyncError or mpirun then ends the job.) */
static void mgpu__dist_issue_rest(mgpu_model* m, int first) {
    int bk, r;
    for (bk = first; bk < m->bucket_count; ++bk) {
        float* bufs[MGPU__MAX_REPLICAS];
        const mgpu__bucket* bu = &m->buckets[bk];
        for (r = 0; r < m->replica_count; ++r) bufs[r] = MGPU__F32(mgpu__part_of(m, r, 0)->grads) + bu->begin;
        (void)mgpu__ar_after_compute(m->ar[0]);
        (void)mgpu__ar_reduce(m->ar[0], bufs, (size_t)(bu->end - bu->begin));
    }
    if (first < m->bucket_count) (void)mgpu__ar_before_compute(m->ar[0]);
}

static mgpu_result mgpu__run_batch_streams(mgpu__batch* b, int reduce) {
    mgpu_model* m = b->m;
    const int S = m->stage_count, M = m->micro_batches, R = m->replica_count;
    /* host-staged sums wait for the host: they run once, after the whole backward */
    const int overlap = reduce && (R > 1 || mgpu__dist_overlaps(m)) && m->ar[0]->kind != MGPU_ALLREDUCE_HOST;
    int next[MGPU__MAX_STAGES], fdone[MGPU__MAX_STAGES], bdone[MGPU__MAX_STAGES], issued[MGPU__MAX_STAGES];
    mgpu_result res = MGPU_OK;
    int s, r, queued, bk, buckets_issued = 0;
    for (s = 0; s < S; ++s) issued[s] = 0;
    for (r = R - 1; r >= 0 && res == MGPU_OK; --r) {                                                  /* 3. compute */
        for (s = 0; s < S; ++s) next[s] = fdone[s] = bdone[s] = 0;
        for (queued = 0, s = 0; queued < 2 * M * S && res == MGPU_OK; ++queued) {
            int op, k;
            mgpu__part* p;
            /* the stage whose device is current goes on while its next op can be queued; else the
               last stage that can (one always can: neither schedule deadlocks) */
            if (!mgpu__stage_ready(m, s, next, fdone, bdone))
                for (s = S - 1; s > 0 && !mgpu__stage_ready(m, s, next, fdone, bdone); --s) {}
            p = mgpu__part_of(m, r, s);
            if (next[s] == 0 && b->zero_grads && (res = mgpu_tensor_zero(p->grads)) != MGPU_OK) break;   /* while p's device is current */
            op = mgpu__stage_op(m, s, next[s]);
            k = op >= 0 ? op : -1 - op;
            if (op >= 0) {
                res = mgpu__run_forward(b, p, k);
                fdone[s]++;
            } else {
                res = mgpu__run_backward(b, p, k, overlap && k == M - 1);
                bdone[s]++;
            }
            next[s]++;
        }
    }
    for (bk = 0; overlap && res == MGPU_OK && bk < m->bucket_count; ++bk) {   /* 4. reduce, in the order backward marks them */
        const mgpu__bucket* bu = &m->buckets[bk];
        float* bufs[MGPU__MAX_REPLICAS];
        void* done[MGPU__MAX_REPLICAS];
        int slices[MGPU__MAX_REPLICAS];
        s = bu->stage;
        for (r = 0; r < R; ++r) {
            mgpu__part* p = mgpu__part_of(m, r, s);
            bufs[r] = MGPU__F32(p->grads) + (bu->begin - m->stage_off[s]);
            done[r] = p->bucket_done[bk];
        }
        issued[s] = 1;
        res = mgpu__ar_after_events(m->ar[s], done);
        for (r = 0; r < R; ++r) slices[r] = mgpu__trace_open(m, r * S + s, 1, m->ar[s]->rank[r].stream, "all-reduce bucket %d", bk);
        if (res == MGPU_OK) {   /* issued, whatever the call's fate (mgpu__dist_issue_rest goes on after it) */
            buckets_issued++;
            res = mgpu__ar_reduce(m->ar[s], bufs, (size_t)(bu->end - bu->begin));
        }
        for (r = 0; r < R; ++r) mgpu__trace_close(m, slices[r], m->ar[s]->rank[r].stream);
    }
    if (res != MGPU_OK && overlap && m->dist) mgpu__dist_issue_rest(m, buckets_issued);   /* the others' NCCL waits for them */
    /* The compute streams wait for the comm streams, also after a failure: nothing may touch
       the gradients while an all-reduce still reads or writes them. */
    for (s = 0; s < S; ++s)
        if (issued[s]) {
            mgpu_result joined = mgpu__ar_before_compute(m->ar[s]);
            if (res == MGPU_OK) res = joined;
        }
    MGPU__TRY(res);
    if (overlap) m->grads_reduced = 1;
    else if (reduce) MGPU__TRY(mgpu__reduce_grads(m));
    return MGPU_OK;
}

/* The batch a step was given: fit for the model, and its gradients not yet reduced. */
static mgpu_result mgpu__batch_check(mgpu_model* m, const char* op, const mgpu_tensor* x, const mgpu_tensor* target) {
    int64_t batch;
    MGPU__TRY(mgpu__check_input(op, m, x));
    MGPU__TRY(mgpu__check_target(op, m, x, target));
    batch = x->shape.dim[0];
    if (batch < (int64_t)m->replica_count * m->micro_batches)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: a batch of %lld cannot be split across %d replica%s x %d "
                          "micro-batch%s (want at least %lld rows)", op, (long long)batch, m->replica_count,
                          m->replica_count == 1 ? "" : "s", m->micro_batches, m->micro_batches == 1 ? "" : "es",
                          (long long)m->replica_count * m->micro_batches);
    if (m->grads_reduced)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the gradients were already reduced across replicas "
                          "(mgpu_model_train_step or mgpu_model_reduce_grads); zero them (mgpu_model_zero_grad) or "
                          "apply them (mgpu_model_apply) before adding more", op);
    return MGPU_OK;
}

/* Moves 2 to 4 for one batch: the gradients of every part ADDED to its gradient buffer and,
   with reduce, summed across the replicas. A distributed model's ranks vote twice: on the rows
   (each passes its own; the batch is all of them) before any work, and on how the work went
   before the sum across processes, so that a rank's failure fails every rank. */
static mgpu_result mgpu__run_batch(mgpu_model* m, const char* op, mgpu_result pre, const mgpu_tensor* x, const mgpu_tensor* target,
                                   int64_t batch_total, int reduce, float* loss) {
    mgpu__batch b;
    mgpu_result res = pre != MGPU_OK ? pre : mgpu__batch_check(m, op, x, target);
    int64_t batch = res == MGPU_OK ? x->shape.dim[0] : 0, all_rows = batch, terms = 0;
    double loss_sum = 0.0, all_terms;
    int i, ran;
    b.row_base = 0;
    if (res == MGPU_OK) res = mgpu__batch_terms(m, target, &terms);
    all_terms = (double)terms;
    if (m->dist) {
        mgpu__dist_doing(op, m->steps + 1);
        if (res == MGPU_OK) res = mgpu__suspect_refuse(m, op);   /* the same flag on every rank: they all refuse */
        for (i = 0; i < m->stage_count && res == MGPU_OK; ++i) res = mgpu__ar_check_processes(m->ar[i]);
        MGPU__TRY(mgpu__dist_agree(res, batch, (double)terms, m->dist_rows, &all_terms));
        for (i = 0, all_rows = 0; i < mgpu__dist.size; ++i) {
            if (i < mgpu__dist.rank) b.row_base += m->dist_rows[i];
            all_rows += m->dist_rows[i];
        }
    }
    MGPU__TRY(res);
    if (batch_total < all_rows) batch_total = all_rows;
    mgpu__batch_begin(&b, m, op, batch_total);
    b.grad_terms = mgpu__grad_terms((int64_t)all_terms, all_rows, batch_total);
    b.labels_on_device = m->loss != MGPU_LOSS_MSE && target && !MGPU__IS_CPU(target);
    b.zero_grads = reduce;   /* a whole step: from zeroed gradients */
    res = mgpu__batch_split(&b, x, target);                                                         /* 2. split */
    ran = res == MGPU_OK;
    if (res != MGPU_OK) {
        if (reduce && mgpu__dist_overlaps(m)) mgpu__dist_issue_rest(m, 0);   /* the other ranks' NCCL waits for these */
    }
#ifndef MGPU_NO_THREADS
    else if (m->sync_bn || (m->part_count > 1 && m->part[0].dev->kind == MGPU_DEVICE_CPU))
        res = mgpu__run_batch_threads(&b, reduce && !m->dist);
#endif
    else res = mgpu__run_batch_streams(&b, reduce && (!m->dist || mgpu__dist_overlaps(m)));          /* 3, 4 */
    if (m->dist && m->sync_bn && res != MGPU_OK) {
        /* the other ranks may wait inside their passes for this one's SyncBatchNorm numbers */
        fprintf(stderr, "mgpu: rank %d of %d: %s failed with desc.sync_batch_norm, where the other ranks may wait for this "
                "one's batch statistics: %s; ending the job\n", mgpu__dist.rank, mgpu__dist.size, op, mgpu_last_error());
        mgpu_dist_abort(1);
    }
    if (m->dist) {   /* every rank's verdict on its work (and its loss), with the sums across the job or alone */
        if (res == MGPU_OK && mgpu__dist_overlaps(m)) res = mgpu__ar_wait_processes(m->ar[0]);   /* (a hung NCCL ends) */
        if (res == MGPU_OK && loss) res = mgpu__batch_loss_sum(m, &loss_sum);
        if (reduce && !m->grads_reduced) MGPU__TRY(mgpu__dist_reduce(m, res, loss_sum, &loss_sum));  /* 4. reduce */
        else MGPU__TRY(mgpu__dist_agree(res, 0, loss_sum, NULL, &loss_sum));   /* (NCCL overlapped backward) */
        m->rows_in_step += all_rows;
        m->last_batch = batch;   /* this rank's rows (mgpu_model_replica_loss) */
        if (loss) *loss = all_terms > 0.0 ? (float)(loss_sum / all_terms) : 0.0f;
        return MGPU_OK;
    }
    if (res != MGPU_OK && ran && m->buf_floats > 0 && m->part_count > m->stage_count)
        /* forward may have moved some replicas' running statistics and not others' */
        mgpu__suspect_mark(m, "a batch that failed after forward passes may have moved some replicas' buffers", 0);
    MGPU__TRY(res);
    m->rows_in_step += batch;   /* a next batch of this step continues the row numbering */
    m->last_batch = batch;
    return loss ? mgpu__batch_loss(m, loss) : MGPU_OK;
}

/* ---- move 5, update: the same optimizer step on every replica ---- */

static mgpu_result mgpu__check_step(const char* op, const mgpu_model* m, const mgpu_optimizer* opt) {
    if (!m || !opt) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model or optimizer", op);
    /* a destroyed handle is an error, not a use after free (LIFETIMES); once per step */
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model") || !mgpu__live_check(opt, MGPU__LIVE_OPTIMIZER, op, "optimizer"))
        return MGPU_ERROR_INVALID_ARGUMENT;
    if (opt->model != m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer belongs to another model", op);
    return MGPU_OK;
}

/* The optimizer step after reduced gradients, and the optional replica check. */
static mgpu_result mgpu__verify_if_due(mgpu_model* m) {
    if (m->verify_every > 0 && mgpu_model_total_replica_count(m) > 1 && m->steps % m->verify_every == 0)
        return mgpu_model_verify_replicas(m);
    return MGPU_OK;
}
/* Buffers (running statistics) the same on every replica: each replica's forward passes moved its
   own by its own rows, so after each optimizer step replica 0's are copied to the others, stage by
   stage (and, in a job, rank 0's to every rank). DDP's broadcast_buffers copies at the start of
   the next forward instead: the same values wherever they are read, and here a checkpoint or
   mgpu_model_verify_replicas right after a step sees them equal. */
static mgpu_result mgpu__sync_buffers(mgpu_model* m) {
    int i;
    if (m->buf_floats == 0) return MGPU_OK;
    if (m->dist) {
        if (mgpu__dist_broadcast_buffers(m) == MGPU_OK) return MGPU_OK;
        mgpu__suspect_mark(m, "a broadcast of the buffers that failed", MGPU__SUSPECT_LOAD_ONLY);
        return mgpu_last_result();
    }
    for (i = m->stage_count; i < m->part_count; ++i)
        if (m->part[i].bufs && mgpu_tensor_copy(m->part[i].bufs, m->part[i % m->stage_count].bufs) != MGPU_OK) {
            mgpu__suspect_mark(m, "a copy of replica 0's buffers that failed", 0);
            return mgpu__refail("copying replica 0's buffers to the other replicas");
        }
    return MGPU_OK;
}
/* desc.check_finite, before the update: the loss and every gradient free of NaN and Inf. A float
   squared is at most ~1.2e77, so a double sum of squares is finite exactly when every term is:
   the clip norm's sum (mgpu__sum_squares_cpu in the thread pool; mgpu__cu_sum_squares on each GPU
   part, queued on its stream) is the flag. The GPUs' sums are read after the loss, which waits for
   them anyway. On the CPU the host all-reduce left every replica the same bits: replica 0's
   stages are enough. Only on a failure are the gradients read again, to name the parameter. */
static int mgpu__finite(double v) { return v - v == 0.0; }   /* NaN - NaN, Inf - Inf are NaN */
static const char* mgpu__nonfinite_name(double v) { return v != v ? "NaN" : v > 0.0 ? "+Inf" : "-Inf"; }   /* (%g may say -nan) */
static mgpu_result mgpu__check_finite_here(mgpu_model* m) {
    static const char* op = "training step";
    const long long step = (long long)m->steps + 1;
    const int cpu = m->part[0].dev->kind == MGPU_DEVICE_CPU;
    const int parts = cpu ? m->stage_count : m->part_count;
    float loss = 0.0f;
    int i, t;
    for (i = 0; !cpu && i < parts; ++i) {
        mgpu__part* p = &m->part[i];
        mgpu__scratch sc;
        int rc;
        if (!p->grads || mgpu_tensor_numel(p->grads) == 0) continue;
        MGPU__TRY(mgpu__ensure(&p->finite, p->dev, MGPU_U8, mgpu_shape1((int64_t)sizeof(double))));
        MGPU__TRY(mgpu__scratch_get(&sc, p->dev, MGPU__CU_REDUCE_SCRATCH * sizeof(double), op));
        MGPU__COUNT(p->dev, ops, 1);
        rc = MGPU__CUDA(mgpu__cu_sum_squares(MGPU__CUDA_ARGS(p->dev), (size_t)mgpu_tensor_numel(p->grads), MGPU__F32(p->grads),
                                             (double*)mgpu_tensor_data(p->finite), (double*)sc.ptr));
        mgpu__scratch_put(&sc);   /* (reused in stream order, as every op's scratch) */
        if (rc) return mgpu__cu_result(rc, op, p->dev);
    }
    /* a distributed model's loss is its rank's rows' only: its gradients, summed over the job, say it */
    if (m->last_batch && !m->dist) {
        MGPU__TRY(mgpu__batch_loss(m, &loss));
        if (!mgpu__finite(loss))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s %lld: the loss is %s (desc.check_finite): no parameter was "
                              "updated", op, step, mgpu__nonfinite_name(loss));
    }
    for (i = 0; i < parts; ++i) {
        mgpu__part* p = &m->part[i];
        const int64_t n = p->grads ? mgpu_tensor_numel(p->grads) : 0;
        double sum = 0.0;
        if (n == 0) continue;
        if (cpu) {
            double* sums = (double*)mgpu__calloc((size_t)((n + MGPU__CLIP_CHUNK - 1) / MGPU__CLIP_CHUNK), sizeof(double));
            if (!sums) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
            sum = mgpu__sum_squares_cpu(sums, MGPU__F32(p->grads), n);
            MGPU_FREE(sums);
        } else if (mgpu_tensor_download(p->finite, &sum, sizeof sum) != MGPU_OK) {
            return mgpu__refail(op);
        }
        if (mgpu__finite(sum)) continue;
        for (t = 0; t < m->tensor_count; ++t) {   /* which parameter: the first whose gradient has one */
            const mgpu_tensor* g = p->gview[t];
            const int64_t k = g && mgpu__tensor_stage(m, t) == p->stage ? mgpu_tensor_numel(g) : 0;
            float* host = k ? (float*)mgpu__calloc((size_t)k, sizeof(float)) : NULL;
            int64_t j;
            if (k && !host) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
            if (k && mgpu_tensor_download(g, host, (size_t)k * sizeof(float)) != MGPU_OK) { MGPU_FREE(host); return mgpu__refail(op); }
            for (j = 0; j < k && mgpu__finite(host[j]); ++j) {}
            if (j < k) {
                const float v = host[j];
                MGPU_FREE(host);
                return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s %lld: the gradient of %s holds %s (element %lld; replica %d, "
                                  "%s) (desc.check_finite): no parameter was updated", op, step, mgpu_model_tensor_name(m, t),
                                  mgpu__nonfinite_name(v), (long long)j, p->replica, p->dev->label);
            }
            MGPU_FREE(host);
        }
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s %lld: a gradient of stage %d holds NaN or Inf (replica %d, %s) "
                          "(desc.check_finite): no parameter was updated", op, step, p->stage, p->replica, p->dev->label);
    }
    return MGPU_OK;
}
static mgpu_result mgpu__check_finite(mgpu_model* m) {
    const mgpu_result r = mgpu__check_finite_here(m);
    return m->dist ? mgpu__dist_agree(r, 0, 0.0, NULL, NULL) : r;   /* every rank refuses the step, or none */
}

static mgpu_result mgpu__update(mgpu_model* m, mgpu_optimizer* opt) {
    mgpu_result r;
    if (m->check_finite) MGPU__TRY(mgpu__check_finite(m));
    r = mgpu__optimizer_step(opt);   /* opt checked by mgpu__check_step */
    if (m->dist && m->part[0].dev->kind == MGPU_DEVICE_CUDA) {   /* (a CPU step cannot fail) */
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
        if (r != MGPU_OK)
            mgpu__suspect_mark(m, "an optimizer step that failed on a rank", MGPU__SUSPECT_LOAD_ONLY | MGPU__SUSPECT_STATES);
    }
    MGPU__TRY(r);
    m->steps++;
    MGPU__TRY(mgpu__sync_buffers(m));
    return mgpu__verify_if_due(m);
}

/* ---- the step as a CUDA graph (desc.graph) ----
   A step on GPUs is the same launches every time, on buffers that stay where they are while the
   batch shape does: so after one eager step of a shape (which makes every buffer), the next is
   captured as a CUDA graph and every later one replays it with one launch. What changes from step
   to step stays out of the graph or is read from device memory: the batch's rows are uploaded
   into the model's input buffers before the launch, and the optimizer's numbers (the schedule's
   learning rate, AdamW's bias corrections: mgpu__optimizer_prepare), and Dropout's key of the
   step (which its kernel then reads there: mgpu_layer_ctx.seed_on_device). The graph holds the
   zeroed gradients, forward, loss, backward, the bucketed all-reduce on the communication streams
   with its events, and the update; a temporary the capture used keeps its memory for the graph
   (the allocator's `held`). Steps run eagerly, giving the same bits, where a graph cannot be
   used: another batch shape (its first step; the old graph is dropped), tracing, a model on CPU
   devices or of several processes, a custom layer of the vtable (whose work may change from step
   to step on the host; one made of tape ops is held), NCCL across several GPUs of this process (NCCL warns that capturing it may
   deadlock; the P2P all-reduce is captured instead), the host-staged all-reduce,
   desc.check_finite (the host reads the check before the update) or desc.sync_batch_norm (the
   replicas meet on the host inside their passes). A capture that
   fails (something in it waited for the host or allocated, another thread's call that capture
   forbids) may have met a passing cause: that step and the next MGPU__GRAPH_RETRY_STEPS run
   eagerly, then the capture is tried again; after MGPU__GRAPH_TRIES failures in a row the steps
   stay eager for good (a warning says why). */
#define MGPU__GRAPH_TRIES 3
#define MGPU__GRAPH_RETRY_STEPS 10
static int mgpu__graph_possible(mgpu_model* m, char* why, size_t size) {
    int i;
    why[0] = 0;
    if (m->check_finite) snprintf(why, size, "desc.check_finite (the host reads the gradients' check before each update)");
    if (!why[0] && m->dist) snprintf(why, size, "a model of several processes (its ranks vote on the host every step)");
    if (!why[0] && m->sync_bn) snprintf(why, size, "desc.sync_batch_norm (the replicas meet on the host inside each pass)");
    for (i = 0; !why[0] && i < m->part_count; ++i)
        if (m->part[i].dev->kind != MGPU_DEVICE_CUDA) snprintf(why, size, "%s is not a GPU", m->part[i].dev->label);
    for (i = 0; !why[0] && i < m->layer_count; ++i)
        if (!m->layers[i]->graph_safe) snprintf(why, size, "layer %d (%s) is not one a graph can hold", i, mgpu_layer_type(m->layers[i]));
    for (i = 0; !why[0] && m->ar && i < m->stage_count; ++i)
        if (m->ar[i] && (m->ar[i]->kind == MGPU_ALLREDUCE_HOST || m->ar[i]->kind == MGPU_ALLREDUCE_NCCL))
            snprintf(why, size, "its all-reduce is %s (ask for p2p: MGPU_ALLREDUCE=p2p)", mgpu_allreduce_name(m->ar[i]->kind));
    return !why[0];
}

/* Host state a step changes, put back after a capture (which queued nothing that ran). */
typedef struct mgpu__step_state {
    int64_t opt_steps, steps, rows_in_step, last_batch;
    uint64_t dropout_step;
    int grads_reduced;
} mgpu__step_state;
static void mgpu__step_state_save(const mgpu_model* m, const mgpu_optimizer* opt, mgpu__step_state* st) {
    st->opt_steps = opt->steps;
    st->steps = m->steps;
    st->rows_in_step = m->rows_in_step;
    st->last_batch = m->last_batch;
    st->dropout_step = m->dropout_step;
    st->grads_reduced = m->grads_reduced;
}
static void mgpu__step_state_load(mgpu_model* m, mgpu_optimizer* opt, const mgpu__step_state* st) {
    opt->steps = st->opt_steps;
    m->steps = st->steps;
    m->rows_in_step = st->rows_in_step;
    m->last_batch = st->last_batch;
    m->dropout_step = st->dropout_step;
    m->grads_reduced = st->grads_reduced;
}

/* A fingerprint of where every buffer a step works in lives, and its size: a graph replays on
   the buffers of its capture, so anything that moved one since (mgpu_model_evaluate or a loop of
   your own on another batch shape resizes them) means it must be made again. */
static void mgpu__hash_tensor(uint64_t* h, const mgpu_tensor* t) {
    *h = mgpu__mix(*h ^ (t ? (uint64_t)(uintptr_t)mgpu_tensor_data(t) : 0));
    *h = mgpu__mix(*h ^ (t ? (uint64_t)mgpu_tensor_bytes(t) : 0));
}
static uint64_t mgpu__graph_buffers(const mgpu_model* m) {
    uint64_t h = 0;
    int i, k, l;
    for (i = 0; i < m->part_count; ++i) {
        const mgpu__part* p = &m->part[i];
        mgpu__hash_tensor(&h, p->xbuf);
        mgpu__hash_tensor(&h, p->tbuf);
        mgpu__hash_tensor(&h, p->losses);
        mgpu__hash_tensor(&h, p->step_seed);
        for (k = 0; k < p->slot_count; ++k) {
            const mgpu__slot* sl = &p->slot[k];
            for (l = 0; l < m->layer_count; ++l) {
                mgpu__hash_tensor(&h, sl->act[l]);
                mgpu__hash_tensor(&h, sl->dact[l]);
            }
            for (l = 0; l < m->first_aux[m->layer_count]; ++l) mgpu__hash_tensor(&h, sl->aux[l]);
            mgpu__hash_tensor(&h, sl->xin);
            mgpu__hash_tensor(&h, sl->dxin);
            mgpu__hash_tensor(&h, sl->dyin);
            mgpu__hash_tensor(&h, sl->dout);
            mgpu__hash_tensor(&h, sl->wide_out);
            mgpu__hash_tensor(&h, sl->wide_dxin);
        }
    }
    for (i = 0; m->ar && i < m->stage_count; ++i)   /* the ring all-reduce's landing buffers */
        for (k = 0; m->ar[i] && k < m->ar[i]->count; ++k) {
            h = mgpu__mix(h ^ (uint64_t)(uintptr_t)m->ar[i]->rank[k].ring_tmp);
            h = mgpu__mix(h ^ (uint64_t)m->ar[i]->rank[k].ring_tmp_floats);
        }
    return h;
}

/* Orders part p's stream after `from`'s stream at this point: event `ev` of p's four. */
static mgpu_result mgpu__graph_order(mgpu_model* m, const char* op, mgpu__part* from, int ev, mgpu__part* to) {
    void* e = m->graph_events[4 * (int)(from - m->part) + ev];
    MGPU__CU(op, from->dev, mgpu__cu_event_record(from->dev->ordinal, e, from->dev->stream));
    MGPU__CU(op, to->dev, mgpu__cu_stream_wait_event(to->dev->ordinal, to->dev->stream, e));
    return MGPU_OK;
}

/* Every part's allocator serves this thread from (and frees into) the part's held list, or not. */
static void mgpu__hold(mgpu_model* m, int on) {
    int i;
    for (i = 0; i < m->part_count; ++i) {
        mgpu__allocator* a = &m->part[i].dev->alloc;
        mgpu__lock(a);
        a->held = on ? &m->part[i].held : NULL;
#ifndef MGPU_NO_THREADS
        if (on) a->holder = mgpu__thread_self();
#endif
        mgpu__unlock(a);
    }
}

/* Capture moves 3 to 5 of a step whose batch was split already: on the first part's stream, the
   other parts' streams joined to it by events (the communication streams join through the
   all-reduce's own events). Ends the capture whatever happens; a failure leaves no graph. */
static mgpu_result mgpu__graph_capture(mgpu_model* m, mgpu_optimizer* opt, mgpu__batch* b) {
    static const char* op = "mgpu_model_train_step (CUDA graph capture)";
    mgpu__part* first = &m->part[0];
    mgpu_result r = MGPU_OK;
    int i, rc;
    MGPU__CU(op, first->dev, mgpu__cu_capture_begin(first->dev->ordinal, first->dev->stream));
    mgpu__hold(m, 1);
    m->capturing = 1;
    for (i = 1; i < m->part_count && r == MGPU_OK; ++i) r = mgpu__graph_order(m, op, first, 0, &m->part[i]);
    b->zero_grads = 1;
    if (r == MGPU_OK) r = mgpu__run_batch_streams(b, 1);                                            /* 3, 4 */
    if (r == MGPU_OK) r = mgpu__optimizer_step(opt);                                                /* 5 */
    for (i = 1; i < m->part_count && r == MGPU_OK; ++i) r = mgpu__graph_order(m, op, &m->part[i], 1, first);
    mgpu__hold(m, 0);
    m->capturing = 0;
    rc = MGPU__CUDA(mgpu__cu_capture_end(first->dev->ordinal, first->dev->stream, &m->graph_exec));
    if (r == MGPU_OK && rc != 0) r = mgpu__cu_result(rc, op, first->dev);
    if (r != MGPU_OK) mgpu__graph_drop(m);
    return r;
}

/* The step through the graph, capturing it first when this is the second step of its shapes.
   *eager = 1 (and MGPU_OK) when this step must run eagerly instead. */
static mgpu_result mgpu__graph_step(mgpu_model* m, mgpu_optimizer* opt, const mgpu_tensor* x, const mgpu_tensor* target,
                                    float* loss, int* eager) {
    static const char* op = "mgpu_model_train_step";
    char why[160];
    mgpu__step_state before;
    mgpu__batch b;
    mgpu__part* first = &m->part[0];
    mgpu_result r;
    int64_t terms = 0;
    int i, dropout, was_reduced;
    b.row_base = 0;
    *eager = 1;
    if (!mgpu__graph_possible(m, why, sizeof why)) {
        mgpu__log(MGPU_LOG_INFO, "%s: steps run without a CUDA graph: %s", op, why);
        m->graph = 0;
        return MGPU_OK;
    }
    if (m->trace) return MGPU_OK;
    MGPU__TRY(mgpu__check_input(op, m, x));
    MGPU__TRY(mgpu__check_target(op, m, x, target));
    if (!mgpu_shape_equal(x->shape, m->graph_x) || !mgpu_shape_equal(target->shape, m->graph_t) || opt != m->graph_opt) {
        mgpu__graph_drop(m);   /* its buffers are sized for other shapes */
        m->graph_x = x->shape;
        m->graph_t = target->shape;
        m->graph_opt = opt;
        m->graph_warm = 0;
    }
    for (i = 0; i < m->layer_count && !m->layers[i]->uses_rng; ++i) {}
    dropout = i < m->layer_count;
    for (i = 0; dropout && i < m->part_count; ++i)   /* made before the warm-up step, so that its temporaries follow */
        MGPU__TRY(mgpu__ensure(&m->part[i].step_seed, m->part[i].dev, MGPU_U8, mgpu_shape1(sizeof(uint64_t))));
    if (!m->graph_exec && m->graph_warm++ < 1) return MGPU_OK;   /* this step makes every buffer */
    if (!m->graph_exec && m->graph_wait > 0) { m->graph_wait--; return MGPU_OK; }   /* after a failed capture */
    if (!m->graph_events) {
        m->graph_events = (void**)mgpu__calloc((size_t)m->part_count * 4, sizeof(void*));
        if (!m->graph_events) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        for (i = 0; i < 4 * m->part_count; ++i)
            MGPU__CU(op, m->part[i / 4].dev, mgpu__cu_event_create(m->part[i / 4].dev->ordinal, &m->graph_events[i]));
    }
    was_reduced = m->grads_reduced;
    m->grads_reduced = 0;   /* as mgpu_model_zero_grad leaves them; the graph zeroes them on the devices */
    m->rows_in_step = 0;
    /* outside the graph: this update's numbers, the step's Dropout key and the batch's rows, into
       the buffers it reads */
    r = mgpu__batch_check(m, op, x, target);
    if (r == MGPU_OK) r = mgpu__batch_terms(m, target, &terms);
    if (r == MGPU_OK && m->graph_exec && (double)terms != m->graph_terms) {
        /* the graph scales the gradient by the labels its capture counted: another count (labels
           ignored) runs this step eagerly, the graph is kept for the batches that match it */
        m->grads_reduced = was_reduced;
        return MGPU_OK;
    }
    if (r == MGPU_OK) r = mgpu__optimizer_prepare(opt, op);
    mgpu__batch_begin(&b, m, op, x->shape.dim[0]);
    b.grad_terms = (double)terms;
    b.labels_on_device = m->loss != MGPU_LOSS_MSE && target && !MGPU__IS_CPU(target);
    for (i = 0; r == MGPU_OK && dropout && i < m->part_count; ++i) {
        const uint64_t key = mgpu__step_seed(m, &m->part[i]);
        r = mgpu__upload_async(m->part[i].dev, mgpu_tensor_data(m->part[i].step_seed), &key, sizeof key, op);
    }
    if (r == MGPU_OK) r = mgpu__batch_split(&b, x, target);                                         /* 2 */
    if (r == MGPU_OK && m->graph_exec && m->graph_buffers != mgpu__graph_buffers(m)) {
        mgpu__graph_drop(m);   /* a buffer moved since the capture: this step runs eagerly, the next is captured */
        m->graph_warm = 1;
        m->grads_reduced = was_reduced;
        return MGPU_OK;
    }
    if (r == MGPU_OK && !m->graph_exec) {
        for (i = 0; i < m->part_count; ++i) mgpu_device_get_counters(m->part[i].dev, &m->part[i].graph_work);
        mgpu__step_state_save(m, opt, &before);
        r = mgpu__graph_capture(m, opt, &b);
        m->graph_terms = b.grad_terms;
        mgpu__step_state_load(m, opt, &before);   /* nothing ran: the launch below does it */
        for (i = 0; i < m->part_count; ++i) {   /* nor did the work the capture counted: each launch counts it */
            mgpu_device_counters now;
            mgpu__part* p = &m->part[i];
            mgpu_device_get_counters(p->dev, &now);
#define MGPU__GRAPH_WORK(field) p->graph_work.field = now.field - p->graph_work.field;
            MGPU__COUNTER_LIST(MGPU__GRAPH_WORK)
#undef MGPU__GRAPH_WORK
            p->graph_work.allocs = 0;   /* (those were real: the graph's buffers) */
#define MGPU__GRAPH_UNDO(field) MGPU__COUNT(p->dev, field, 0 - p->graph_work.field);
            MGPU__COUNTER_LIST(MGPU__GRAPH_UNDO)
#undef MGPU__GRAPH_UNDO
        }
        if (r != MGPU_OK) {   /* this step runs eagerly; the capture is tried again, a few times */
            if (++m->graph_failures >= MGPU__GRAPH_TRIES) {
                mgpu__log(MGPU_LOG_WARN, "%s: steps run without a CUDA graph from now on: its capture failed %d times in a row, "
                          "the last: %s", op, m->graph_failures, mgpu_last_error());
                m->graph = 0;
            } else {
                m->graph_wait = MGPU__GRAPH_RETRY_STEPS;
                mgpu__log(MGPU_LOG_INFO, "%s: this step and the next %d run without a CUDA graph, then its capture is tried "
                          "again (%d of %d tries failed): %s", op, MGPU__GRAPH_RETRY_STEPS, m->graph_failures, MGPU__GRAPH_TRIES,
                          mgpu_last_error());
            }
            m->grads_reduced = was_reduced;
            return MGPU_OK;
        }
        m->graph_failures = 0;
        m->graph_buffers = mgpu__graph_buffers(m);   /* (the capture may have sized a slot) */
    }
    /* the graph's work on each device after that device's uploads */
    for (i = 1; r == MGPU_OK && i < m->part_count; ++i) r = mgpu__graph_order(m, op, &m->part[i], 2, first);
    if (r == MGPU_OK) {
        const int rc = MGPU__CUDA(mgpu__cu_graph_launch(first->dev->ordinal, m->graph_exec, first->dev->stream));
        if (rc) {
            r = mgpu__cu_result(rc, op, first->dev);
            mgpu__graph_drop(m);   /* made again when the steps go on */
            /* what of the replay ran is not known: replica 0 whole, unless its stages may differ */
            mgpu__suspect_mark(m, "a CUDA graph replay of a step that failed",
                               MGPU__SUSPECT_STATES | (m->stage_count > 1 ? MGPU__SUSPECT_LOAD_ONLY : 0));
        }
    }
    if (r != MGPU_OK) {
        m->grads_reduced = was_reduced;
        return r;
    }
    *eager = 0;
    for (i = 0; i < m->part_count; ++i) {   /* what the launch queued on each device */
#define MGPU__GRAPH_DID(field) MGPU__COUNT(m->part[i].dev, field, m->part[i].graph_work.field);
        MGPU__COUNTER_LIST(MGPU__GRAPH_DID)
#undef MGPU__GRAPH_DID
    }
    /* the host's side of the step, as the eager one leaves it */
    mgpu__optimizer_advance(opt);
    m->grads_reduced = 1;
    m->last_batch = x->shape.dim[0];
    m->steps++;
    m->graph_steps++;
    /* what comes next on each device after the graph */
    for (i = 1; i < m->part_count; ++i) MGPU__TRY(mgpu__graph_order(m, op, first, 3, &m->part[i]));
    MGPU__TRY(mgpu__sync_buffers(m));   /* (after the graph, as after an eager update) */
    MGPU__TRY(mgpu__verify_if_due(m));
    return loss ? mgpu__batch_loss(m, loss) : MGPU_OK;
}

/* ---- the public steps ---- */

/* 1 when m is a live distributed model: its rank votes even on a failure of its own (a NULL
   optimizer), since the other ranks would otherwise wait for it. */
static int mgpu__votes(const mgpu_model* m) {
    int live;
    if (!m || mgpu__dist.size <= 1) return 0;
    MGPU__LIVE_LOCK();
    live = mgpu__live_find(m, MGPU__LIVE_MODEL) >= 0;
    MGPU__LIVE_UNLOCK();
    return live && m->dist;
}

/* Inside a step only mgpu's code runs on this thread, so the CUDA backend may trust the device
   it made current last (mgpu__cu_step_scope): no cudaGetDevice, and cudaSetDevice only when the
   device changes. After a custom layer's code or the log callback it trusts nothing again
   (mgpu__cu_device_unknown). */
static void mgpu__step_scope(int enter) {
    (void)MGPU__CUDA(mgpu__cu_step_scope(enter));
}

static mgpu_result mgpu__train_step(mgpu_model* m, mgpu_optimizer* opt, const mgpu_tensor* x,
                                    const mgpu_tensor* target, float* loss) {
    static const char* op = "mgpu_model_train_step";
    mgpu_result r = mgpu__check_step(op, m, opt);
    int eager = 1;
    if (r == MGPU_OK && !m->dist) r = mgpu__suspect_refuse(m, op);   /* (a job's ranks refuse together, in their vote) */
    if (r != MGPU_OK && !mgpu__votes(m)) return r;
    if (r == MGPU_OK && m->graph) {
        r = mgpu__graph_step(m, opt, x, target, loss, &eager);
        if (!eager || r != MGPU_OK) return r;
    }
    if (r != MGPU_OK && !m->dist) return r;
    m->rows_in_step = 0;   /* a whole step: whatever was accumulated before is discarded, */
    m->grads_reduced = 0;  /* its gradients zeroed as each part's work is queued (mgpu__batch.zero_grads) */
    /* (a distributed model reads the loss in its vote, before the sum across processes) */
    MGPU__TRY(mgpu__run_batch(m, op, r, x, target, 0, 1, m->dist ? loss : NULL));                  /* 2, 3, 4 */
    MGPU__TRY(mgpu__update(m, opt));                                                                /* 5 */
    /* read the loss only now: the optimizer step is already queued behind it */
    return loss && !m->dist ? mgpu__batch_loss(m, loss) : MGPU_OK;
}

MGPUDEF mgpu_result mgpu_model_train_step(mgpu_model* m, mgpu_optimizer* opt, const mgpu_tensor* x,
                                          const mgpu_tensor* target, float* loss) {
    mgpu_result r;
    mgpu__step_scope(1);
    r = mgpu__train_step(m, opt, x, target, loss);
    mgpu__step_scope(0);
    return r;
}

MGPUDEF int64_t mgpu_model_graph_steps(const mgpu_model* m) { return m ? m->graph_steps : 0; }

MGPUDEF mgpu_result mgpu_model_replica_loss(mgpu_model* m, int replica, float* loss) {
    static const char* op = "mgpu_model_replica_loss";
    double sum;
    int64_t rows;
    if (!m || !loss) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL %s", op, m ? "loss" : "model");
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    MGPU__TRY(mgpu__check_replica(op, m, replica));
    if (!m->last_batch) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: no batch has been run yet", op);
    MGPU__TRY(mgpu__replica_loss_sum(m, replica, &sum, &rows));
    *loss = rows > 0 ? (float)(sum / (double)rows) : 0.0f;
    return MGPU_OK;
}

MGPUDEF mgpu_result mgpu_model_last_loss(mgpu_model* m, float* loss) {
    static const char* op = "mgpu_model_last_loss";
    if (!m || !loss) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL %s", op, m ? "loss" : "model");
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (m->dist)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: a distributed model's loss is summed over the ranks in its step: "
                          "pass a loss pointer to mgpu_model_train_step", op);
    if (!m->last_batch) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: no batch has been run yet", op);
    return mgpu__batch_loss(m, loss);
}

MGPUDEF mgpu_result mgpu_model_accumulate(mgpu_model* m, const mgpu_tensor* x, const mgpu_tensor* target,
                                          int64_t batch_total, float* loss) {
    mgpu_result r;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_accumulate: NULL model");
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, "mgpu_model_accumulate", "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (!m->dist) MGPU__TRY(mgpu__suspect_refuse(m, "mgpu_model_accumulate"));
    mgpu__step_scope(1);
    r = mgpu__run_batch(m, "mgpu_model_accumulate", MGPU_OK, x, target, batch_total, 0, loss);      /* 2, 3 */
    mgpu__step_scope(0);
    return r;
}

MGPUDEF mgpu_result mgpu_model_reduce_grads(mgpu_model* m) {
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_model_reduce_grads: NULL model");
    return mgpu__reduce_grads(m);                                                                   /* 4 */
}

static mgpu_result mgpu__apply(mgpu_model* m, mgpu_optimizer* opt) {
    mgpu_result r = mgpu__check_step("mgpu_model_apply", m, opt);
    if (r == MGPU_OK) r = mgpu__suspect_refuse(m, "mgpu_model_apply");   /* (the same flag on every rank) */
    if (mgpu__votes(m)) r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    MGPU__TRY(r);
    MGPU__TRY(mgpu__reduce_grads(m));                                                               /* 4 */
    MGPU__TRY(mgpu__update(m, opt));                                                                /* 5 */
    return mgpu_model_zero_grad(m);
}
MGPUDEF mgpu_result mgpu_model_apply(mgpu_model* m, mgpu_optimizer* opt) {
    mgpu_result r;
    mgpu__step_scope(1);
    r = mgpu__apply(m, opt);
    mgpu__step_scope(0);
    return r;
}

MGPUDEF const char* mgpu_model_suspect(const mgpu_model* m) {
    const char* why;
    MGPU__LIVE_LOCK();
    why = m && mgpu__live_find(m, MGPU__LIVE_MODEL) >= 0 ? m->suspect : NULL;
    MGPU__LIVE_UNLOCK();
    return why;
}

MGPUDEF mgpu_result mgpu_model_resync(mgpu_model* m, mgpu_optimizer* opt) {
    static const char* op = "mgpu_model_resync";
    int i;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op);
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (opt && !mgpu__live_check(opt, MGPU__LIVE_OPTIMIZER, op, "optimizer")) return MGPU_ERROR_INVALID_ARGUMENT;
    if (opt && opt->model != m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer belongs to another model", op);
    if (m->dist)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: a model of several processes is not re-synced from rank 0; load a "
                          "checkpoint (mgpu_model_load) on every rank", op);
    if (m->suspect && (m->suspect_flags & MGPU__SUSPECT_LOAD_ONLY))
        return mgpu__fail(MGPU_ERROR_DIVERGED, "%s: refused: replica 0 itself may be half-updated since %s (%d stages); load a "
                          "checkpoint (mgpu_model_load with the optimizer) to go on", op, m->suspect, m->stage_count);
    if (m->suspect && (m->suspect_flags & MGPU__SUSPECT_STATES) && !opt)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer's states may differ too since %s: pass the optimizer",
                          op, m->suspect);
    for (i = m->stage_count; i < m->part_count; ++i) {   /* replica-major: part i % S is replica 0's of its stage */
        const mgpu__part *to = &m->part[i], *from = &m->part[i % m->stage_count];
        mgpu_result r = mgpu_tensor_copy(to->params, from->params);
        if (r == MGPU_OK && to->bufs) r = mgpu_tensor_copy(to->bufs, from->bufs);
        if (r == MGPU_OK && opt && opt->state1[i]) r = mgpu_tensor_copy(opt->state1[i], opt->state1[i % m->stage_count]);
        if (r == MGPU_OK && opt && opt->state2[i]) r = mgpu_tensor_copy(opt->state2[i], opt->state2[i % m->stage_count]);
        if (r != MGPU_OK) {   /* (the mark stays: some replicas may be copied, others not) */
            char where[160];
            snprintf(where, sizeof where, "%s: copying replica 0's stage %d to replica %d (%s)", op, to->stage, to->replica,
                     to->dev->label);
            return mgpu__refail(where);
        }
    }
    MGPU__TRY(mgpu__ties_spread(m, op));   /* (a tied copy that missed its update's copy) */
    MGPU__TRY(mgpu_model_zero_grad(m));
    m->suspect = NULL;
    m->suspect_flags = 0;
    return MGPU_OK;
}

/* The buffers of every replica against replica 0's of its stage, bit for bit (this process's;
   across the ranks of a job they were broadcast from rank 0 after the step). */
static mgpu_result mgpu__verify_buffers(const mgpu_model* m, const char* op) {
    float* first = (float*)mgpu__calloc((size_t)m->buf_floats * 2 + 1, sizeof(float));
    float* other;
    mgpu_result r = MGPU_OK;
    int i, b;
    if (!first) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    other = first + m->buf_floats;
    for (i = 0; i < m->part_count && r == MGPU_OK; ++i) {
        const mgpu__part* p = &m->part[i];
        const int64_t n = mgpu__stage_buf_floats(m, p->stage), o = m->stage_boff[p->stage];
        if (n == 0) continue;
        r = mgpu_tensor_download(p->bufs, (p->replica == 0 ? first : other) + o, (size_t)n * sizeof(float));
        if (r != MGPU_OK || p->replica == 0 || memcmp(first + o, other + o, (size_t)n * sizeof(float)) == 0) continue;
        for (b = m->first_buffer[m->stage_layer[p->stage]]; b < m->first_buffer[m->stage_layer[p->stage + 1]] && r == MGPU_OK; ++b) {
            const int64_t count = mgpu_shape_numel(m->buffers[b].shape), at = m->buffers[b].offset;
            int64_t k;
            for (k = 0; k < count; ++k)
                if (memcmp(&first[at + k], &other[at + k], sizeof(float)) != 0) {
                    r = mgpu__fail(MGPU_ERROR_DIVERGED, "%s: after %lld steps replica %d (%s) differs from replica 0 (%s) at "
                                   "buffer '%s' element %lld: %.9g vs %.9g", op, (long long)m->steps, p->replica, p->dev->label,
                                   m->part[p->stage].dev->label, m->buffers[b].name, (long long)k, (double)other[at + k],
                                   (double)first[at + k]);
                    break;
                }
        }
    }
    MGPU_FREE(first);
    return r;
}

MGPUDEF mgpu_result mgpu_model_verify_replicas(mgpu_model* m) {
    static const char* op = "mgpu_model_verify_replicas";
    float *first, *other;
    mgpu_result r = MGPU_OK;
    int i, t;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op);
    if (m->replica_count == 1 && !m->dist) return MGPU_OK;
    first = (float*)mgpu__calloc((size_t)m->flat_floats * 2 + 1, sizeof(float));
    if (!first) {
        r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        return m->dist ? mgpu__dist_agree(r, 0, 0.0, NULL, NULL) : r;
    }
    other = first + m->flat_floats;
    if (m->buf_floats > 0) r = mgpu__verify_buffers(m, op);
    for (i = 0; i < m->part_count && r == MGPU_OK; ++i) {   /* each part against replica 0's of its stage */
        const mgpu__part* p = &m->part[i];
        const int64_t n = mgpu__stage_floats(m, p->stage), o = m->stage_off[p->stage];
        r = mgpu_tensor_download(p->params, (p->replica == 0 ? first : other) + o, (size_t)n * sizeof(float));
        if (r != MGPU_OK || p->replica == 0 || memcmp(first + o, other + o, (size_t)n * sizeof(float)) == 0) continue;
        for (t = m->first_tensor[m->stage_layer[p->stage]]; t < m->first_tensor[m->stage_layer[p->stage + 1]] && r == MGPU_OK; ++t) {
            const int64_t count = mgpu_shape_numel(m->tensors[t].shape), at = m->tensors[t].offset;
            int64_t k;
            for (k = 0; k < count; ++k)
                if (memcmp(&first[at + k], &other[at + k], sizeof(float)) != 0) {
                    r = mgpu__fail(MGPU_ERROR_DIVERGED, "%s: after %lld steps replica %d (%s) differs from replica 0 (%s) at "
                                   "'%s' element %lld: %.9g vs %.9g", op, (long long)m->steps, p->replica, p->dev->label,
                                   m->part[p->stage].dev->label, m->tensors[t].name, (long long)k, (double)other[at + k],
                                   (double)first[at + k]);
                    break;
                }
        }
    }
#ifdef MGPU_MPI
    if (m->dist && mgpu__dist_agree(r, 0, 0.0, NULL, NULL) == MGPU_OK) {   /* then replica 0 of each rank against rank 0's */
        /* rank 0's replica 0 (in its `first`) into the others' `other`, beside their own in `first` */
        mgpu__dist_broadcast(mgpu__dist.rank == 0 ? first : other, (size_t)m->flat_floats * sizeof(float));
        if (mgpu__dist.rank != 0) {
            for (t = 0; t < m->tensor_count && r == MGPU_OK; ++t) {
                const int64_t count = mgpu_shape_numel(m->tensors[t].shape), at = m->tensors[t].offset;
                int64_t k;
                for (k = 0; k < count; ++k)
                    if (memcmp(&first[at + k], &other[at + k], sizeof(float)) != 0) {
                        r = mgpu__fail(MGPU_ERROR_DIVERGED, "%s: after %lld steps rank %d (replica %d of the job) differs from "
                                       "rank 0 at '%s' element %lld: %.9g vs %.9g", op, (long long)m->steps, mgpu__dist.rank,
                                       m->dist_first, m->tensors[t].name, (long long)k, (double)first[at + k], (double)other[at + k]);
                        break;
                    }
            }
        }
        r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    } else if (m->dist) {
        r = mgpu_last_result();   /* the vote's failure, with the failed rank's message */
    }
#endif
    MGPU_FREE(first);
    return r;
}

#define MGPU__EVAL_ROWS 512   /* rows per replica per evaluation pass */

/* Chunks of MGPU__EVAL_ROWS rows per replica, queued one after another: each chunk's mean loss
   and correct count stay on the devices until the end, when one download per replica reads them
   all (an evaluation waits for its devices once, not twice per chunk). */
MGPUDEF mgpu_result mgpu_model_evaluate(mgpu_model* m, const mgpu_tensor* x, const mgpu_tensor* target,
                                        float* loss, int64_t* correct) {
    static const char* op = "mgpu_model_evaluate";
    int64_t n, per_chunk, chunks, j, start, count, hits = 0, c, terms = 0;
    double total = 0.0;
    float* host = NULL;
    mgpu_result res = MGPU_OK;
    int i, counting;
    if (!m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model", op);
    if (!mgpu__live_check(m, MGPU__LIVE_MODEL, op, "model")) return MGPU_ERROR_INVALID_ARGUMENT;
    MGPU__TRY(mgpu__check_input(op, m, x));
    MGPU__TRY(mgpu__check_target(op, m, x, target));
    counting = correct && m->loss == MGPU_LOSS_CROSS_ENTROPY;
    n = x->shape.dim[0];
    per_chunk = (int64_t)MGPU__EVAL_ROWS * m->replica_count;
    chunks = (n + per_chunk - 1) / per_chunk;
    for (i = 0; i < m->replica_count; ++i) {
        mgpu__part* last = mgpu__part_of(m, i, m->stage_count - 1);
        MGPU__TRY(mgpu__ensure(&last->eval, last->dev, MGPU_F32, mgpu_shape1(MGPU__MAX(2 * chunks, 1))));
    }
    for (j = 0; j < chunks; ++j) {                                                    /* queue every chunk */
        const int64_t rows = MGPU__MIN(n - j * per_chunk, per_chunk);
        mgpu_tensor xc = mgpu__rows(x, j * per_chunk, rows), tc = mgpu__rows(target, j * per_chunk, rows);
        for (i = 0; i < m->replica_count; ++i) {
            mgpu__part *in = mgpu__part_of(m, i, 0), *last = mgpu__part_of(m, i, m->stage_count - 1);
            int32_t* counts = (int32_t*)MGPU__F32(last->eval) + chunks;
            mgpu_tensor xs, ts, lj;
            const mgpu_tensor* out;
            int s;
            mgpu__split(rows, m->replica_count, i, &start, &count);
            if (count == 0) continue;
            for (s = 0; j > 0 && s + 1 < m->stage_count; ++s) {   /* a stage's output is overwritten only after the next stage read it */
                const mgpu__part *p = mgpu__part_of(m, i, s), *reader = p + 1;
                if (reader->events)
                    MGPU__CU(op, p->dev, mgpu__cu_stream_wait_event(p->dev->ordinal, p->dev->stream, reader->events[0]));
            }
            MGPU__TRY(mgpu__part_inputs(in, last, &xc, &tc, start, count, 0, &xs, &ts));
            out = mgpu__forward(m, i, &xs, 0, 0);
            if (!out) return mgpu__refail(op);
            if (m->loss == MGPU_LOSS_MSE) MGPU__TRY(mgpu__check_like(op, "target", &ts, "output", out));
            lj = mgpu__rows(last->eval, j, 1);
            MGPU__TRY(mgpu__loss(m, &lj, out, &ts, NULL, 1.0f, 1.0f));
            if (counting) {   /* a label per row of the output: [B, T, vocab] is B x T rows */
                const int64_t classes = out->shape.dim[out->shape.ndim - 1], rows2 = mgpu_tensor_numel(out) / MGPU__MAX(classes, 1);
                const mgpu_tensor logits = mgpu__reshaped(out, mgpu_shape2(rows2, classes)), labels = mgpu__reshaped(&ts, mgpu_shape1(rows2));
                if (last->dev->kind == MGPU_DEVICE_CPU) {
                    MGPU__TRY(mgpu_count_correct(&logits, &labels, &c));
                    counts[j] = (int32_t)c;
                } else {
                    MGPU__TRY(mgpu__count_correct_queued(op, &logits, &labels, counts + j));
                }
            }
        }
    }
    if (chunks > 0) host = (float*)MGPU_MALLOC((size_t)(2 * chunks * m->replica_count) * sizeof(float));
    if (chunks > 0 && !host) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
    for (i = 0; i < m->replica_count && chunks > 0 && res == MGPU_OK; ++i)   /* read them back: the one wait */
        res = mgpu_tensor_download(mgpu__part_of(m, i, m->stage_count - 1)->eval, host + 2 * chunks * i,
                                   (size_t)(2 * chunks) * sizeof(float));
    for (j = 0; j < chunks && res == MGPU_OK; ++j)   /* summed in the order of the rows, as before */
        for (i = 0; i < m->replica_count && res == MGPU_OK; ++i) {
            const float* mine = host + 2 * chunks * i;
            int64_t t;
            mgpu__split(MGPU__MIN(n - j * per_chunk, per_chunk), m->replica_count, i, &start, &count);
            if (count == 0) continue;
            res = mgpu__loss_terms(m, target, j * per_chunk + start, count, &t);   /* each chunk's mean, by its terms */
            if (t) total += (double)mine[j] * (double)t;
            terms += t;
            if (counting) hits += ((const int32_t*)(mine + chunks))[j];
        }
    MGPU_FREE(host);
    MGPU__TRY(res);
    if (loss) *loss = terms ? (float)(total / (double)terms) : 0.0f;
    if (correct) *correct = hits;
    return MGPU_OK;
}

/* ---- >>impl io: gzip/DEFLATE decoder, IDX parser, safetensors reader and atomic writer -- */
/* Needs <stdint.h> <stddef.h> <stdio.h> <stdlib.h> <string.h> <stdarg.h> <errno.h> and, on
   POSIX, <unistd.h> (fsync, fileno, getpid), all of which the implementation includes before
   this point, plus MGPU_MALLOC/MGPU_REALLOC/MGPU_FREE and mgpu__fail. Every failure is reported
   through mgpu__fail with the file's name and what is wrong. No global mutable state. */

/* ============================== gzip (RFC 1952) / DEFLATE (RFC 1951) ======================== */
/* A compact table-driven inflater in the style of stb_image's zlib: codes of up to
   MGPU__ZFAST_BITS bits are decoded with one table lookup, longer ones by a canonical-code
   search. Bits are read LSB first from a 64-bit buffer; reading past the end of the input feeds
   zero bytes and counts them (overrun), so a truncated stream is detected as soon as one of
   those invented bits is consumed, and no read ever leaves the input buffer. */
#define MGPU__ZFAST_BITS 10
#define MGPU__ZFAST_MASK ((1 << MGPU__ZFAST_BITS) - 1)

typedef struct mgpu__zhuff {
    uint16_t fast[1 << MGPU__ZFAST_BITS]; /* (code length << 9) | symbol; 0: use the slow path */
    uint16_t firstcode[16];               /* first canonical code of each length */
    int maxcode[17];                      /* one past the last code of each length, 16-bit aligned */
    uint16_t firstsymbol[16];             /* index into size[]/value[] of each length's first code */
    uint8_t size[288];
    uint16_t value[288];
} mgpu__zhuff;

typedef struct mgpu__zin {
    const uint8_t* p;   /* next input byte */
    const uint8_t* end;
    uint64_t bits;      /* bit buffer, next bit in bit 0 */
    int nbits;
    int overrun;        /* zero bytes fed to the bit buffer past the end of the input */
} mgpu__zin;

typedef struct mgpu__zbuf {
    mgpu__zin in;
    uint8_t* out;
    size_t len, cap;
    const char* name;
    mgpu__zhuff lit, dist;
} mgpu__zbuf;

typedef struct mgpu__crc32_table { uint32_t t[8][256]; } mgpu__crc32_table;

static void mgpu__crc32_init(mgpu__crc32_table* c) {
    uint32_t i, r;
    int k;
    for (i = 0; i < 256; ++i) {
        r = i;
        for (k = 0; k < 8; ++k) r = (r & 1) ? 0xEDB88320u ^ (r >> 1) : r >> 1;
        c->t[0][i] = r;
    }
    for (i = 0; i < 256; ++i)
        for (k = 1; k < 8; ++k) c->t[k][i] = (c->t[k - 1][i] >> 8) ^ c->t[0][c->t[k - 1][i] & 0xFF];
}

/* CRC-32 (ISO 3309, as in gzip), slicing by 8 bytes. */
static uint32_t mgpu__crc32(const mgpu__crc32_table* c, uint32_t crc, const uint8_t* p, size_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint32_t hi = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        crc ^= (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
        crc = c->t[7][crc & 0xFF] ^ c->t[6][(crc >> 8) & 0xFF] ^ c->t[5][(crc >> 16) & 0xFF] ^ c->t[4][crc >> 24] ^
              c->t[3][hi & 0xFF] ^ c->t[2][(hi >> 8) & 0xFF] ^ c->t[1][(hi >> 16) & 0xFF] ^ c->t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = c->t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static int mgpu__zrev16(int n) {
    n = ((n & 0xAAAA) >> 1) | ((n & 0x5555) << 1);
    n = ((n & 0xCCCC) >> 2) | ((n & 0x3333) << 2);
    n = ((n & 0xF0F0) >> 4) | ((n & 0x0F0F) << 4);
    n = ((n & 0xFF00) >> 8) | ((n & 0x00FF) << 8);
    return n;
}

/* Builds the canonical Huffman code for n symbols with code lengths lens[] (0..15).
   Returns 0 for an oversubscribed or an incomplete code, as zlib does, so that a stream one
   decoder accepts the other does too: incomplete is allowed only for a code with no symbols
   and, where single_ok (literal/length and distance codes), for one symbol of 1 bit. */
static int mgpu__zbuild(mgpu__zhuff* h, const uint8_t* lens, int n, int single_ok) {
    int i, k = 0, code = 0, next[16], count[16];
    memset(count, 0, sizeof count);
    memset(h->fast, 0, sizeof h->fast);
    for (i = 0; i < n; ++i) count[lens[i]]++;
    count[0] = 0;
    for (i = 1; i < 16; ++i) {
        next[i] = code;
        h->firstcode[i] = (uint16_t)code;
        h->firstsymbol[i] = (uint16_t)k;
        code += count[i];
        if (code > (1 << i)) return 0;
        h->maxcode[i] = code << (16 - i);
        code <<= 1;
        k += count[i];
    }
    h->maxcode[16] = 0x10000; /* sentinel: the slow search always stops */
    if (code != 1 << 16 && k != 0 && !(single_ok && k == 1 && count[1] == 1)) return 0; /* incomplete */
    for (i = 0; i < n; ++i) {
        int s = lens[i];
        if (s) {
            int c = next[s] - h->firstcode[s] + h->firstsymbol[s];
            h->size[c] = (uint8_t)s;
            h->value[c] = (uint16_t)i;
            if (s <= MGPU__ZFAST_BITS) {
                int j = mgpu__zrev16(next[s]) >> (16 - s);
                while (j < (1 << MGPU__ZFAST_BITS)) {
                    h->fast[j] = (uint16_t)((s << 9) | i);
                    j += 1 << s;
                }
            }
            ++next[s];
        }
    }
    return 1;
}

/* Tops the bit buffer up to at least 57 bits. With 8 input bytes left it ORs in one 64-bit load
   and advances over the whole bytes that fit; the bits of a partly fitting byte are the same ones
   the next refill ORs in again, so they do no harm. */
static inline void mgpu__zfill(mgpu__zin* z) {
    if (z->end - z->p >= 8) {
        const uint8_t* q = z->p;
        uint64_t w = (uint64_t)q[0] | ((uint64_t)q[1] << 8) | ((uint64_t)q[2] << 16) | ((uint64_t)q[3] << 24) |
                     ((uint64_t)q[4] << 32) | ((uint64_t)q[5] << 40) | ((uint64_t)q[6] << 48) | ((uint64_t)q[7] << 56);
        z->bits |= w << z->nbits;
        z->p += (63 - z->nbits) >> 3;
        z->nbits |= 56;
        return;
    }
    while (z->nbits <= 56) {
        uint64_t byte = 0;
        if (z->p < z->end) byte = *z->p++;
        else z->overrun++;
        z->bits |= byte << z->nbits;
        z->nbits += 8;
    }
}

/* Nonzero once a bit that lies past the end of the input has been consumed. */
#define MGPU__ZPAST_END(z) ((z)->nbits < 8 * (z)->overrun)

static inline uint32_t mgpu__zbits(mgpu__zin* z, int n) { /* n <= 16 */
    uint32_t v;
    if (z->nbits < n) mgpu__zfill(z);
    v = (uint32_t)z->bits & ((1u << n) - 1);
    z->bits >>= n;
    z->nbits -= n;
    return v;
}

/* Codes longer than MGPU__ZFAST_BITS: (length << 9) | symbol for the next 16 bits, 0 if they
   start with no code. Takes the bits by value so the caller's bit buffer can stay in registers. */
static int mgpu__zslow(const mgpu__zhuff* h, uint32_t bits) {
    int b, s, k = mgpu__zrev16((int)(bits & 0xFFFF));
    for (s = MGPU__ZFAST_BITS + 1; k >= h->maxcode[s]; ++s) {}
    if (s >= 16) return 0;
    b = (k >> (16 - s)) - h->firstcode[s] + h->firstsymbol[s];
    if (b < 0 || b >= 288 || h->size[b] != s) return 0;
    return (s << 9) | h->value[b];
}

/* Next symbol of code h, or -1 for a bit pattern that is no code. */
static inline int mgpu__zdecode(mgpu__zin* z, const mgpu__zhuff* h) {
    int b;
    if (z->nbits < 16) mgpu__zfill(z);
    b = h->fast[z->bits & MGPU__ZFAST_MASK];
    if (!b && !(b = mgpu__zslow(h, (uint32_t)z->bits))) return -1;
    z->bits >>= b >> 9;
    z->nbits -= b >> 9;
    return b & 511;
}

static mgpu_result mgpu__ztruncated(const mgpu__zbuf* z) {
    return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: gzip data is truncated (the compressed stream ends early)",
                      z->name);
}

static mgpu_result mgpu__zbad(const mgpu__zbuf* z, const char* what) {
    return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: corrupt gzip data: %s", z->name, what);
}

/* Makes room for `need` more output bytes, doubling the buffer. */
static mgpu_result mgpu__zgrow(mgpu__zbuf* z, size_t need) {
    size_t cap = z->cap ? z->cap : 4096;
    uint8_t* p;
    if (need > SIZE_MAX - z->len) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: gunzip output too large", z->name);
    while (cap - z->len < need) {
        if (cap > SIZE_MAX / 2) { cap = z->len + need; break; }
        cap *= 2;
    }
    p = (uint8_t*)MGPU_REALLOC(z->out, cap);
    if (!p)
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory growing the gunzip output to %zu bytes",
                          z->name, cap);
    z->out = p;
    z->cap = cap;
    return MGPU_OK;
}

/* Drops to a byte boundary and hands the whole bytes still in the bit buffer back to the input,
   so stored blocks and the gzip trailer can be read directly. */
static mgpu_result mgpu__zalign(mgpu__zbuf* z) {
    int drop = z->in.nbits & 7;
    z->in.bits >>= drop;
    z->in.nbits -= drop;
    if (MGPU__ZPAST_END(&z->in)) return mgpu__ztruncated(z);
    while (z->in.nbits >= 8) {
        if (z->in.overrun) z->in.overrun--; /* the most recently buffered bytes are the invented ones */
        else z->in.p--;
        z->in.nbits -= 8;
    }
    z->in.bits = 0;
    return MGPU_OK;
}

static mgpu_result mgpu__zstored(mgpu__zbuf* z) {
    size_t n, avail;
    mgpu_result r = mgpu__zalign(z);
    if (r) return r;
    if (z->in.end - z->in.p < 4) return mgpu__ztruncated(z);
    n = (size_t)z->in.p[0] | ((size_t)z->in.p[1] << 8);
    if (n != (((size_t)z->in.p[2] | ((size_t)z->in.p[3] << 8)) ^ 0xFFFF))
        return mgpu__zbad(z, "stored block length does not match its one's complement");
    z->in.p += 4;
    avail = (size_t)(z->in.end - z->in.p);
    if (n > avail)
        return mgpu__fail(MGPU_ERROR_BAD_FILE,
                          "%s: gzip data is truncated (a stored block claims %zu bytes but only %zu remain)",
                          z->name, n, avail);
    if (z->cap - z->len < n && (r = mgpu__zgrow(z, n)) != MGPU_OK) return r;
    if (n) memcpy(z->out + z->len, z->in.p, n);
    z->len += n;
    z->in.p += n;
    return MGPU_OK;
}

static mgpu_result mgpu__zfixed(mgpu__zbuf* z) {
    uint8_t lens[288];
    memset(lens, 8, 144);
    memset(lens + 144, 9, 112);
    memset(lens + 256, 7, 24);
    memset(lens + 280, 8, 8);
    mgpu__zbuild(&z->lit, lens, 288, 1);
    memset(lens, 5, 32);
    mgpu__zbuild(&z->dist, lens, 32, 1);
    return MGPU_OK;
}

static mgpu_result mgpu__zdynamic(mgpu__zbuf* z) {
    static const uint8_t order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
    mgpu__zhuff cl;
    uint8_t cllens[19], lens[286 + 30];
    int hlit, hdist, hclen, total, i, n = 0;
    hlit = (int)mgpu__zbits(&z->in, 5) + 257;
    hdist = (int)mgpu__zbits(&z->in, 5) + 1;
    hclen = (int)mgpu__zbits(&z->in, 4) + 4;
    if (hlit > 286) return mgpu__zbad(z, "too many literal/length codes in a dynamic block");
    if (hdist > 30) return mgpu__zbad(z, "too many distance codes in a dynamic block");
    total = hlit + hdist;
    memset(cllens, 0, sizeof cllens);
    for (i = 0; i < hclen; ++i) cllens[order[i]] = (uint8_t)mgpu__zbits(&z->in, 3);
    if (MGPU__ZPAST_END(&z->in)) return mgpu__ztruncated(z);
    if (!mgpu__zbuild(&cl, cllens, 19, 0)) return mgpu__zbad(z, "bad Huffman table (oversubscribed code-length code, or an incomplete one)");
    while (n < total) {
        int c = mgpu__zdecode(&z->in, &cl), rep;
        uint8_t fill = 0;
        if (c < 0) return MGPU__ZPAST_END(&z->in) ? mgpu__ztruncated(z) : mgpu__zbad(z, "bad Huffman table (invalid code-length code)");
        if (c < 16) {
            lens[n++] = (uint8_t)c;
        } else {
            if (c == 16) {
                if (n == 0) return mgpu__zbad(z, "bad Huffman table (repeat code with no previous length)");
                fill = lens[n - 1];
                rep = 3 + (int)mgpu__zbits(&z->in, 2);
            } else if (c == 17) {
                rep = 3 + (int)mgpu__zbits(&z->in, 3);
            } else {
                rep = 11 + (int)mgpu__zbits(&z->in, 7);
            }
            if (rep > total - n) return mgpu__zbad(z, "bad Huffman table (code lengths overflow the table)");
            memset(lens + n, fill, (size_t)rep);
            n += rep;
        }
        if (MGPU__ZPAST_END(&z->in)) return mgpu__ztruncated(z);
    }
    if (lens[256] == 0) return mgpu__zbad(z, "bad Huffman table (no end-of-block code)");
    if (!mgpu__zbuild(&z->lit, lens, hlit, 1)) return mgpu__zbad(z, "bad Huffman table (oversubscribed literal/length code, or an incomplete one)");
    if (!mgpu__zbuild(&z->dist, lens + hlit, hdist, 1)) return mgpu__zbad(z, "bad Huffman table (oversubscribed distance code, or an incomplete one)");
    return MGPU_OK;
}

/* Decodes one Huffman-coded block with the codes in z->lit and z->dist. This is the hot loop:
   the bit reader and the output cursor live in locals and go back to *z on the way out. */
static mgpu_result mgpu__zblock(mgpu__zbuf* z, size_t member_start) {
    static const uint16_t len_base[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                          31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
    static const uint8_t len_extra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                          2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
    static const uint16_t dist_base[30] = {1,   2,   3,   4,   5,   7,    9,    13,   17,   25,
                                           33,  49,  65,  97,  129, 193,  257,  385,  513,  769,
                                           1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
    static const uint8_t dist_extra[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                           6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};
    mgpu__zin in = z->in;
    uint8_t* out = z->out;
    size_t len = z->len, cap = z->cap;
    mgpu_result r = MGPU_OK;
    for (;;) {
        int sym = mgpu__zdecode(&in, &z->lit);
        if (MGPU__ZPAST_END(&in)) { r = mgpu__ztruncated(z); break; }
        if (sym >= 0 && sym < 256) {
            if (len == cap) {
                z->len = len;
                if ((r = mgpu__zgrow(z, 1)) != MGPU_OK) break;
                out = z->out;
                cap = z->cap;
            }
            out[len++] = (uint8_t)sym;
        } else if (sym == 256) {
            break;
        } else {
            size_t length, dist;
            const uint8_t* src;
            uint8_t* dst;
            if (sym < 0 || sym >= 286) { r = mgpu__zbad(z, "invalid literal/length code"); break; }
            sym -= 257;
            length = len_base[sym] + mgpu__zbits(&in, len_extra[sym]);
            sym = mgpu__zdecode(&in, &z->dist);
            if (MGPU__ZPAST_END(&in)) { r = mgpu__ztruncated(z); break; }
            if (sym < 0 || sym >= 30) { r = mgpu__zbad(z, "invalid distance code"); break; }
            dist = dist_base[sym] + mgpu__zbits(&in, dist_extra[sym]);
            if (MGPU__ZPAST_END(&in)) { r = mgpu__ztruncated(z); break; }
            if (dist > len - member_start) {
                r = mgpu__fail(MGPU_ERROR_BAD_FILE,
                               "%s: corrupt gzip data: distance %zu reaches back before the start of the output (%zu bytes written)",
                               z->name, dist, len - member_start);
                break;
            }
            if (cap - len < length) {
                z->len = len;
                if ((r = mgpu__zgrow(z, length)) != MGPU_OK) break;
                out = z->out;
                cap = z->cap;
            }
            dst = out + len;
            src = dst - dist;
            len += length;
            if (dist == 1) memset(dst, *src, length);
            else if (dist >= length) memcpy(dst, src, length);
            else while (length--) *dst++ = *src++; /* overlapping copy repeats the pattern */
        }
    }
    z->in = in;
    z->len = len;
    return r;
}

/* Inflates one raw DEFLATE stream starting at z->in.p; leaves z->in.p just after it. */
static mgpu_result mgpu__zinflate(mgpu__zbuf* z) {
    size_t member_start = z->len;
    int final, type;
    mgpu_result r;
    z->in.bits = 0;
    z->in.nbits = 0;
    z->in.overrun = 0;
    do {
        final = (int)mgpu__zbits(&z->in, 1);
        type = (int)mgpu__zbits(&z->in, 2);
        if (MGPU__ZPAST_END(&z->in)) return mgpu__ztruncated(z);
        if (type == 0) r = mgpu__zstored(z);
        else if (type == 1) r = mgpu__zfixed(z);
        else if (type == 2) r = mgpu__zdynamic(z);
        else return mgpu__zbad(z, "reserved block type 3");
        if (r == MGPU_OK && type != 0) r = mgpu__zblock(z, member_start);
        if (r) return r;
    } while (!final);
    return mgpu__zalign(z);
}

static uint32_t mgpu__le32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Decodes a gzip file (every member, concatenated) or, when src does not start with the gzip
   magic 1f 8b, copies it through unchanged. *out is MGPU_MALLOC'd (never NULL on success, even
   for empty output); the caller frees it with MGPU_FREE. */
static mgpu_result mgpu__gunzip(const uint8_t* src, size_t len, const char* name, uint8_t** out, size_t* out_len) {
    mgpu__zbuf* z;
    mgpu__crc32_table* crc;
    const uint8_t *p, *end;
    mgpu_result r = MGPU_OK;
    if (!name) name = "(memory)";
    if (!out || !out_len || (!src && len))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__gunzip(%s): NULL argument", name);
    *out = NULL;
    *out_len = 0;
    if (len < 2 || src[0] != 0x1F || src[1] != 0x8B) { /* not gzip: plain copy */
        uint8_t* copy = (uint8_t*)MGPU_MALLOC(len ? len : 1);
        if (!copy) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory copying %zu bytes", name, len);
        if (len) memcpy(copy, src, len);
        *out = copy;
        *out_len = len;
        return MGPU_OK;
    }
    z = (mgpu__zbuf*)MGPU_MALLOC(sizeof *z);
    crc = (mgpu__crc32_table*)MGPU_MALLOC(sizeof *crc);
    if (!z || !crc) {
        MGPU_FREE(z);
        MGPU_FREE(crc);
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory starting gunzip", name);
    }
    memset(z, 0, sizeof *z);
    z->name = name;
    mgpu__crc32_init(crc);
    /* Size the output from the last member's ISIZE (the length mod 2^32) when it is plausible
       (at most 256 times the input); a wrong guess only costs reallocations. */
    if (len >= 18) {
        size_t hint = mgpu__le32(src + len - 4);
        if (hint / 256 <= len) r = mgpu__zgrow(z, hint ? hint : 1);
    }
    p = src;
    end = src + len;
    while (r == MGPU_OK) {
        size_t member_start = z->len, hdr_len;
        int flags;
        uint32_t want_crc, want_size;
        if (end - p < 10) { r = mgpu__ztruncated(z); break; }
        if (p[2] != 8) {
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: unsupported gzip compression method %d (only 8, deflate)", name, p[2]);
            break;
        }
        flags = p[3];
        if (flags & 0xE0) { r = mgpu__zbad(z, "reserved header flags are set"); break; }
        hdr_len = 10;
        if (flags & 4) { /* FEXTRA */
            size_t xlen;
            if ((size_t)(end - p) < hdr_len + 2) { r = mgpu__ztruncated(z); break; }
            xlen = (size_t)p[hdr_len] | ((size_t)p[hdr_len + 1] << 8);
            hdr_len += 2;
            if ((size_t)(end - p) - hdr_len < xlen) { r = mgpu__ztruncated(z); break; }
            hdr_len += xlen;
        }
        if (flags & 8) { /* FNAME, zero-terminated */
            const uint8_t* nul = (const uint8_t*)memchr(p + hdr_len, 0, (size_t)(end - p) - hdr_len);
            if (!nul) { r = mgpu__ztruncated(z); break; }
            hdr_len = (size_t)(nul - p) + 1;
        }
        if (flags & 16) { /* FCOMMENT, zero-terminated */
            const uint8_t* nul = (const uint8_t*)memchr(p + hdr_len, 0, (size_t)(end - p) - hdr_len);
            if (!nul) { r = mgpu__ztruncated(z); break; }
            hdr_len = (size_t)(nul - p) + 1;
        }
        if (flags & 2) { /* FHCRC: low 16 bits of the CRC-32 of the header so far */
            if ((size_t)(end - p) - hdr_len < 2) { r = mgpu__ztruncated(z); break; }
            if ((mgpu__crc32(crc, 0, p, hdr_len) & 0xFFFF) != ((uint32_t)p[hdr_len] | ((uint32_t)p[hdr_len + 1] << 8))) {
                r = mgpu__zbad(z, "header CRC mismatch");
                break;
            }
            hdr_len += 2;
        }
        z->in.p = p + hdr_len;
        z->in.end = end;
        r = mgpu__zinflate(z);
        if (r) break;
        if (z->in.end - z->in.p < 8) { r = mgpu__ztruncated(z); break; }
        want_crc = mgpu__le32(z->in.p);
        want_size = mgpu__le32(z->in.p + 4);
        p = z->in.p + 8;
        /* (an empty first member leaves z->out NULL: no pointer arithmetic on it) */
        if (mgpu__crc32(crc, 0, z->out ? z->out + member_start : NULL, z->len - member_start) != want_crc) {
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: corrupt gzip data: CRC-32 mismatch (the decoded data is damaged)", name);
            break;
        }
        if ((uint32_t)(z->len - member_start) != want_size) {
            r = mgpu__fail(MGPU_ERROR_BAD_FILE,
                           "%s: corrupt gzip data: length mismatch (trailer says %lu bytes mod 2^32, decoded %zu)",
                           name, (unsigned long)want_size, z->len - member_start);
            break;
        }
        if (p == end) break;
        if (end - p >= 2 && p[0] == 0x1F && p[1] == 0x8B) continue; /* another member */
        while (p < end && *p == 0) ++p;                             /* zero padding is tolerated */
        if (p != end)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: %zu bytes of trailing garbage after the gzip data", name,
                           (size_t)(end - p));
        break;
    }
    MGPU_FREE(crc);
    if (r == MGPU_OK) {
        if (!z->out || z->cap != z->len) { /* shrink to fit; keep the larger block if that fails */
            uint8_t* shrunk = (uint8_t*)MGPU_REALLOC(z->out, z->len ? z->len : 1);
            if (shrunk) z->out = shrunk;
            else if (!z->out) r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory", name);
        }
    }
    if (r == MGPU_OK) {
        *out = z->out;
        *out_len = z->len;
    } else {
        MGPU_FREE(z->out);
    }
    MGPU_FREE(z);
    return r;
}

/* ========================================= IDX (MNIST) ====================================== */
typedef struct mgpu__idx {
    int type;              /* 0x08: unsigned byte (the only one accepted) */
    int ndim;              /* 1..4 */
    int64_t dims[4];
    const uint8_t* data;   /* points into the parsed buffer */
    size_t data_bytes;
} mgpu__idx;

static mgpu_result mgpu__idx_parse(const uint8_t* buf, size_t len, const char* name, mgpu__idx* out) {
    const char* tname;
    size_t hdr, have;
    uint64_t want = 1;
    int i, overflow = 0;
    if (!name) name = "(memory)";
    if (!out || (!buf && len)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__idx_parse(%s): NULL argument", name);
    memset(out, 0, sizeof *out);
    if (len < 4) return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: %zu bytes is too short for an IDX header", name, len);
    if (buf[0] != 0 || buf[1] != 0)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: not an IDX file (it starts with %02x %02x, expected 00 00)", name,
                          buf[0], buf[1]);
    switch (buf[2]) {
    case 0x08: tname = NULL; break;
    case 0x09: tname = "signed byte"; break;
    case 0x0B: tname = "int16"; break;
    case 0x0C: tname = "int32"; break;
    case 0x0D: tname = "float32"; break;
    case 0x0E: tname = "float64"; break;
    default:
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: unknown IDX element type 0x%02X", name, buf[2]);
    }
    if (tname)
        return mgpu__fail(MGPU_ERROR_UNSUPPORTED,
                          "%s: IDX element type 0x%02X (%s) is not supported; only 0x08 (unsigned byte) is", name,
                          buf[2], tname);
    if (buf[3] < 1 || buf[3] > 4)
        return mgpu__fail(buf[3] ? MGPU_ERROR_UNSUPPORTED : MGPU_ERROR_BAD_FILE,
                          "%s: IDX file has %d dimensions; 1 to 4 are supported", name, buf[3]);
    out->type = buf[2];
    out->ndim = buf[3];
    hdr = 4 + 4 * (size_t)out->ndim;
    if (len < hdr)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: IDX header is truncated (%d dimensions need %zu bytes, the file holds %zu)",
                          name, out->ndim, hdr, len);
    for (i = 0; i < out->ndim; ++i) {
        const uint8_t* d = buf + 4 + 4 * i;
        uint64_t v = ((uint64_t)d[0] << 24) | ((uint64_t)d[1] << 16) | ((uint64_t)d[2] << 8) | d[3];
        if (v == 0) {
            memset(out, 0, sizeof *out);
            return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: IDX dimension %d is zero", name, i);
        }
        out->dims[i] = (int64_t)v;
        if (want > UINT64_MAX / v) overflow = 1;
        else want *= v;
    }
    have = len - hdr;
    if (overflow || want > (uint64_t)SIZE_MAX) {
        memset(out, 0, sizeof *out);
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: IDX dimensions overflow (the product of the dimensions is too large)", name);
    }
    if (want != (uint64_t)have) {
        memset(out, 0, sizeof *out);
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: IDX header promises %llu bytes of data but the file holds %llu (%s)", name,
                          (unsigned long long)want, (unsigned long long)have,
                          want > (uint64_t)have ? "truncated" : "trailing garbage");
    }
    out->data = buf + hdr;
    out->data_bytes = have;
    return MGPU_OK;
}

/* ======================================== safetensors ======================================= */
/* The rules are the reference implementation's (huggingface/safetensors, src/tensor.rs), in its
   order; tests/test_io.c lists each with where it comes from. Nothing else is limited: names,
   metadata strings, ranks and counts are bounded only by the 100 MB header. */

/* Every dtype the format defines (the reference's Dtype enum), its size in bits, and what
   mgpu_safetensors_read makes of it; readable 0: listed and skipped, reading it is UNSUPPORTED. */
typedef struct mgpu__st_dtype { const char* name; int bits; int readable; mgpu_dtype read_as; } mgpu__st_dtype;
static const mgpu__st_dtype mgpu__st_dtypes[] = {
    {"F64", 64, 1, MGPU_F32}, {"F32", 32, 1, MGPU_F32}, {"F16", 16, 1, MGPU_F32}, {"BF16", 16, 1, MGPU_F32},
    {"I64", 64, 1, MGPU_I32}, {"I32", 32, 1, MGPU_I32}, {"I16", 16, 1, MGPU_I32}, {"I8", 8, 1, MGPU_I32},
    {"U8", 8, 1, MGPU_U8}, {"BOOL", 8, 1, MGPU_U8},
    {"U16", 16, 0, MGPU_U8}, {"U32", 32, 0, MGPU_U8}, {"U64", 64, 0, MGPU_U8}, {"C64", 64, 0, MGPU_U8},
    {"F8_E4M3", 8, 0, MGPU_U8}, {"F8_E5M2", 8, 0, MGPU_U8}, {"F8_E8M0", 8, 0, MGPU_U8},
    {"F8_E4M3FNUZ", 8, 0, MGPU_U8}, {"F8_E5M2FNUZ", 8, 0, MGPU_U8},
    {"F6_E2M3", 6, 0, MGPU_U8}, {"F6_E3M2", 6, 0, MGPU_U8}, {"F4", 4, 0, MGPU_U8}};
#define MGPU__ST_DTYPES ((int)(sizeof mgpu__st_dtypes / sizeof mgpu__st_dtypes[0]))

/* Index of the dtype called name (n bytes) in mgpu__st_dtypes, or -1. */
static int mgpu__st_dtype_find(const char* name, size_t n) {
    int i;
    for (i = 0; i < MGPU__ST_DTYPES; ++i)
        if (strlen(mgpu__st_dtypes[i].name) == n && !memcmp(mgpu__st_dtypes[i].name, name, n)) return i;
    return -1;
}
/* Bytes per element of a dtype mgpu reads and writes; 0 for any other name. */
static size_t mgpu__st_dtype_size(const char* dtype) {
    int i = dtype ? mgpu__st_dtype_find(dtype, strlen(dtype)) : -1;
    return i >= 0 && mgpu__st_dtypes[i].readable ? (size_t)mgpu__st_dtypes[i].bits / 8 : 0;
}

typedef struct mgpu__st_tensor {
    const char* name;        /* decoded, in the file's string arena */
    const uint64_t* shape;   /* ndim entries, in the file's dims arena */
    const char* dtype;       /* mgpu__st_dtypes[dt].name */
    int ndim, dt;
    uint64_t begin, end;     /* relative to the start of the byte buffer */
    size_t name_at, shape_at; /* the arenas' offsets, while they still grow */
} mgpu__st_tensor;
typedef struct mgpu__st_meta { const char* key; const char* value; size_t key_at, value_at; } mgpu__st_meta;
typedef struct mgpu__sbuf { char* p; size_t len, cap; int oom; } mgpu__sbuf;
typedef struct mgpu__st_file {
    mgpu__st_tensor* tensors;
    int count, cap;
    mgpu__st_meta* meta;
    int meta_count, meta_cap;
    mgpu__sbuf strings;      /* every name, key and value, NUL-terminated */
    uint64_t* dims;          /* every shape */
    size_t dims_len, dims_cap;
    int* slots;              /* hash of the names: tensor index + 1, 0 when empty */
    size_t slot_mask;
    int* meta_slots;         /* the same for the metadata keys */
    size_t meta_mask;
    uint64_t data_start;     /* file offset of the byte buffer */
} mgpu__st_file;

#define MGPU__ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)   /* the reference's MAX_HEADER_SIZE */
#define MGPU__JSON_MAX_DEPTH 127   /* serde_json's recursion limit (128 levels, the last refused) */

static void mgpu__sb_put(mgpu__sbuf* b, const char* s, size_t n) {
    if (b->oom) return;
    if (b->cap - b->len < n + 1) {
        size_t cap = b->cap ? b->cap : 256;
        char* p;
        while (cap - b->len < n + 1) cap *= 2;
        p = (char*)MGPU_REALLOC(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), 0 if invalid (overlong forms,
   surrogates and code points above U+10FFFF are invalid). */
static int mgpu__utf8_len(const uint8_t* s, size_t n) {
    uint8_t c = s[0], lo = 0x80, hi = 0xBF;
    int len, i;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (n < (size_t)len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (i = 2; i < len; ++i)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

/* ---- a small strict JSON reader over the header ---- */
typedef struct mgpu__json {
    const uint8_t* s;
    size_t pos, len;
    const char* name; /* the file, for messages */
} mgpu__json;

static mgpu_result mgpu__json_error(const mgpu__json* j, const char* what) {
    return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: safetensors header is not valid JSON at byte %zu of %zu: %s", j->name,
                      j->pos, j->len, what);
}

static int mgpu__json_peek(mgpu__json* j) { /* skips whitespace; -1 at the end */
    while (j->pos < j->len && (j->s[j->pos] == ' ' || j->s[j->pos] == '\t' || j->s[j->pos] == '\n' || j->s[j->pos] == '\r'))
        j->pos++;
    return j->pos < j->len ? j->s[j->pos] : -1;
}

static mgpu_result mgpu__json_expect(mgpu__json* j, int c, const char* what) {
    if (mgpu__json_peek(j) != c) return mgpu__json_error(j, what);
    j->pos++;
    return MGPU_OK;
}

static int mgpu__json_hex4(const uint8_t* s, uint32_t* v) {
    int i;
    *v = 0;
    for (i = 0; i < 4; ++i) {
        int c = s[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return 0;
        *v = (*v << 4) | (uint32_t)d;
    }
    return 1;
}

/* Reads a string (the cursor is on its opening quote), decoding escapes to UTF-8 and appending
   it and a NUL to out (when not NULL); *out_len gets its decoded length, without the NUL. */
static mgpu_result mgpu__json_string(mgpu__json* j, mgpu__sbuf* out, size_t* out_len) {
    size_t n = 0;
    if (mgpu__json_peek(j) != '"') return mgpu__json_error(j, "expected a string");
    j->pos++;
    for (;;) {
        uint8_t buf[4];
        int blen;
        uint32_t c;
        size_t run = j->pos;
        while (run < j->len && j->s[run] >= 0x20 && j->s[run] < 0x80 && j->s[run] != '"' && j->s[run] != '\\') run++;
        if (run > j->pos) {   /* a run of plain ASCII, copied at once */
            if (out) mgpu__sb_put(out, (const char*)j->s + j->pos, run - j->pos);
            n += run - j->pos;
            j->pos = run;
        }
        if (j->pos >= j->len) return mgpu__json_error(j, "unterminated string");
        c = j->s[j->pos];
        if (c == '"') { j->pos++; break; }
        if (c < 0x20) return mgpu__json_error(j, "control character in a string");
        if (c == '\\') {
            if (j->len - j->pos < 2) return mgpu__json_error(j, "unterminated string");
            c = j->s[j->pos + 1];
            blen = 1;
            switch (c) {
            case '"': case '\\': case '/': buf[0] = (uint8_t)c; break;
            case 'b': buf[0] = '\b'; break;
            case 'f': buf[0] = '\f'; break;
            case 'n': buf[0] = '\n'; break;
            case 'r': buf[0] = '\r'; break;
            case 't': buf[0] = '\t'; break;
            case 'u':
                if (j->len - j->pos < 6 || !mgpu__json_hex4(j->s + j->pos + 2, &c))
                    return mgpu__json_error(j, "bad \\u escape");
                if (c >= 0xDC00 && c <= 0xDFFF) return mgpu__json_error(j, "unpaired UTF-16 surrogate in a \\u escape");
                if (c >= 0xD800 && c <= 0xDBFF) {
                    uint32_t lo;
                    if (j->len - j->pos < 12 || j->s[j->pos + 6] != '\\' || j->s[j->pos + 7] != 'u' ||
                        !mgpu__json_hex4(j->s + j->pos + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                        return mgpu__json_error(j, "unpaired UTF-16 surrogate in a \\u escape");
                    c = 0x10000 + ((c - 0xD800) << 10) + (lo - 0xDC00);
                    j->pos += 6;
                }
                if (c < 0x80) buf[0] = (uint8_t)c;
                else if (c < 0x800) {
                    buf[0] = (uint8_t)(0xC0 | (c >> 6));
                    buf[1] = (uint8_t)(0x80 | (c & 0x3F));
                    blen = 2;
                } else if (c < 0x10000) {
                    buf[0] = (uint8_t)(0xE0 | (c >> 12));
                    buf[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
                    buf[2] = (uint8_t)(0x80 | (c & 0x3F));
                    blen = 3;
                } else {
                    buf[0] = (uint8_t)(0xF0 | (c >> 18));
                    buf[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
                    buf[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
                    buf[3] = (uint8_t)(0x80 | (c & 0x3F));
                    blen = 4;
                }
                j->pos += 4;
                break;
            default: return mgpu__json_error(j, "bad escape in a string");
            }
            j->pos += 2;
        } else {
            blen = mgpu__utf8_len(j->s + j->pos, j->len - j->pos);
            if (!blen) return mgpu__json_error(j, "invalid UTF-8 in a string");
            memcpy(buf, j->s + j->pos, (size_t)blen);
            j->pos += (size_t)blen;
        }
        if (out) mgpu__sb_put(out, (const char*)buf, (size_t)blen);
        n += (size_t)blen;
    }
    if (out) mgpu__sb_put(out, "", 1);   /* its own NUL, which the next string does not overwrite */
    if (out_len) *out_len = n;
    return MGPU_OK;
}

static mgpu_result mgpu__json_number(mgpu__json* j) { /* validates and skips a JSON number */
    const uint8_t* s = j->s;
    size_t p = j->pos, n = j->len;
    if (p < n && s[p] == '-') p++;
    if (p < n && s[p] == '0') p++;
    else if (p < n && s[p] >= '1' && s[p] <= '9') while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    else return mgpu__json_error(j, "bad number");
    if (p < n && s[p] == '.') {
        if (++p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return mgpu__json_error(j, "bad number"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    if (p < n && (s[p] == 'e' || s[p] == 'E')) {
        p++;
        if (p < n && (s[p] == '+' || s[p] == '-')) p++;
        if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return mgpu__json_error(j, "bad number"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    j->pos = p;
    return MGPU_OK;
}

/* Validates and skips any JSON value, nesting at most MGPU__JSON_MAX_DEPTH deep. */
static mgpu_result mgpu__json_skip(mgpu__json* j, int depth) {
    mgpu_result r;
    int c = mgpu__json_peek(j);
    if (depth > MGPU__JSON_MAX_DEPTH) return mgpu__json_error(j, "nested too deeply");
    if (c == '{' || c == '[') {
        int close = c == '{' ? '}' : ']';
        j->pos++;
        if (mgpu__json_peek(j) == close) { j->pos++; return MGPU_OK; }
        for (;;) {
            if (close == '}') {
                if ((r = mgpu__json_string(j, NULL, NULL)) != MGPU_OK) return r;
                if ((r = mgpu__json_expect(j, ':', "expected ':'")) != MGPU_OK) return r;
            }
            if ((r = mgpu__json_skip(j, depth + 1)) != MGPU_OK) return r;
            c = mgpu__json_peek(j);
            j->pos++;
            if (c == close) return MGPU_OK;
            if (c != ',') { j->pos--; return mgpu__json_error(j, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'"); }
        }
    }
    if (c == '"') return mgpu__json_string(j, NULL, NULL);
    if (c == '-' || (c >= '0' && c <= '9')) return mgpu__json_number(j);
    if (c == 't' && j->len - j->pos >= 4 && !memcmp(j->s + j->pos, "true", 4)) { j->pos += 4; return MGPU_OK; }
    if (c == 'f' && j->len - j->pos >= 5 && !memcmp(j->s + j->pos, "false", 5)) { j->pos += 5; return MGPU_OK; }
    if (c == 'n' && j->len - j->pos >= 4 && !memcmp(j->s + j->pos, "null", 4)) { j->pos += 4; return MGPU_OK; }
    return mgpu__json_error(j, c < 0 ? "unexpected end of the header" : "expected a value");
}

/* Reads a non-negative integer. Returns 0 on success, else what is wrong with it. */
static const char* mgpu__json_uint(mgpu__json* j, uint64_t* v) {
    const uint8_t* s = j->s;
    size_t p;
    int c = mgpu__json_peek(j);
    *v = 0;
    if (c == '-') return "is negative";
    if (c < '0' || c > '9') return "is not a number";
    p = j->pos;
    if (s[p] == '0' && p + 1 < j->len && s[p + 1] >= '0' && s[p + 1] <= '9') return "has a leading zero";
    while (p < j->len && s[p] >= '0' && s[p] <= '9') {
        uint64_t d = (uint64_t)(s[p] - '0');
        if (*v > (UINT64_MAX - d) / 10) return "is too large (overflows 64 bits)";
        *v = *v * 10 + d;
        p++;
    }
    if (p < j->len && (s[p] == '.' || s[p] == 'e' || s[p] == 'E')) return "is not an integer";
    j->pos = p;
    return NULL;
}

/* Reads an array of non-negative integers for tensor tname, appending them to f->dims (at most
   max of them; 0: any number); *count gets how many. */
static mgpu_result mgpu__st_uint_array(mgpu__json* j, mgpu__st_file* f, const char* field, const char* tname, int max,
                                       int* count) {
    const char* why;
    int c;
    *count = 0;
    if (mgpu__json_peek(j) != '[')
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': %s is not an array", j->name, tname, field);
    j->pos++;
    if (mgpu__json_peek(j) == ']') { j->pos++; return MGPU_OK; }
    for (;;) {
        uint64_t v;
        if (max && *count == max)
            return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': %s has more than %d entries", j->name, tname, field, max);
        why = mgpu__json_uint(j, &v);
        if (why)
            return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': %s entry %d %s", j->name, tname, field, *count, why);
        if (f->dims_len == f->dims_cap) {
            size_t cap = f->dims_cap ? f->dims_cap * 2 : 64;
            uint64_t* grown = (uint64_t*)MGPU_REALLOC(f->dims, cap * sizeof *grown);
            if (!grown) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", j->name);
            f->dims = grown;
            f->dims_cap = cap;
        }
        f->dims[f->dims_len++] = v;
        ++*count;
        c = mgpu__json_peek(j);
        j->pos++;
        if (c == ']') return MGPU_OK;
        if (c != ',') { j->pos--; return mgpu__json_error(j, "expected ',' or ']'"); }
    }
}

static void mgpu__st_shape_str(const mgpu__st_tensor* t, char* buf, size_t cap) {
    size_t n = 0;
    int i;
    buf[0] = 0;
    n += (size_t)snprintf(buf, cap, "[");
    for (i = 0; i < t->ndim && n < cap; ++i)
        n += (size_t)snprintf(buf + n, cap - n, i ? ", %llu" : "%llu", (unsigned long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* Parses one tensor entry {"dtype":..., "shape":[...], "data_offsets":[b, e]} (other keys are
   ignored, as the reference's serde struct does); the sizes are checked later, in file order.
   Its name is at t->name_at in the string arena, which moves when it grows: tname follows it. */
static mgpu_result mgpu__st_entry(mgpu__json* j, mgpu__st_file* f, mgpu__st_tensor* t) {
    const char* tname = f->strings.p + t->name_at;
    int have_dtype = 0, have_shape = 0, have_offsets = 0, n, c;
    mgpu_result r;
    if (mgpu__json_peek(j) != '{')
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': entry is not a JSON object", j->name, tname);
    j->pos++;
    if (mgpu__json_peek(j) == '}') j->pos++;
    else for (;;) {
        const size_t at = f->strings.len;   /* the key, decoded into the arena and dropped after */
        size_t klen;
        const char* key;
        if ((r = mgpu__json_string(j, &f->strings, &klen)) != MGPU_OK) return r;
        if (f->strings.oom) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", j->name);
        key = f->strings.p + at;
        tname = f->strings.p + t->name_at;
        if ((r = mgpu__json_expect(j, ':', "expected ':'")) != MGPU_OK) return r;
        if (klen == 5 && !memcmp(key, "dtype", 5)) {
            size_t vat = f->strings.len, dlen;
            const char* dt;
            if (have_dtype++) return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': duplicate \"dtype\"", j->name, tname);
            if (mgpu__json_peek(j) != '"')
                return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': dtype is not a string", j->name, tname);
            if ((r = mgpu__json_string(j, &f->strings, &dlen)) != MGPU_OK) return r;
            if (f->strings.oom) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", j->name);
            dt = f->strings.p + vat;
            key = NULL;   /* moved with the arena, and no longer needed */
            tname = f->strings.p + t->name_at;
            t->dt = mgpu__st_dtype_find(dt, dlen);
            if (t->dt < 0)
                return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': unknown dtype '%.40s' (the format's are F64, F32, F16, "
                                  "BF16, F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F6_E2M3, F6_E3M2, F4, C64, I64, "
                                  "I32, I16, I8, U64, U32, U16, U8, BOOL)", j->name, tname, dt);
            t->dtype = mgpu__st_dtypes[t->dt].name;
        } else if (klen == 5 && !memcmp(key, "shape", 5)) {
            if (have_shape++) return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': duplicate \"shape\"", j->name, tname);
            t->shape_at = f->dims_len;
            if ((r = mgpu__st_uint_array(j, f, "shape", tname, 0, &n)) != MGPU_OK) return r;
            t->ndim = n;
        } else if (klen == 12 && !memcmp(key, "data_offsets", 12)) {
            const size_t dat = f->dims_len;   /* read through the dims arena, then dropped */
            if (have_offsets++)
                return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': duplicate \"data_offsets\"", j->name, tname);
            if ((r = mgpu__st_uint_array(j, f, "data_offsets", tname, 2, &n)) != MGPU_OK) return r;
            if (n != 2)
                return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': data_offsets must hold 2 entries [begin, end], not %d",
                                  j->name, tname, n);
            t->begin = f->dims[dat];
            t->end = f->dims[dat + 1];
            f->dims_len = dat;
        } else {
            if ((r = mgpu__json_skip(j, 3)) != MGPU_OK) return r; /* unknown keys are ignored */
        }
        f->strings.len = at;   /* tname lies before at: still valid */
        c = mgpu__json_peek(j);
        j->pos++;
        if (c == '}') break;
        if (c != ',') { j->pos--; return mgpu__json_error(j, "expected ',' or '}'"); }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%s': entry has no \"%s\"", j->name, tname,
                          !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    return MGPU_OK;
}

/* "__metadata__": null, or an object of strings (the reference's Option<HashMap<String, String>>). */
static mgpu_result mgpu__st_metadata(mgpu__json* j, mgpu__st_file* out) {
    mgpu_result r;
    int c;
    if (mgpu__json_peek(j) == 'n' && j->len - j->pos >= 4 && !memcmp(j->s + j->pos, "null", 4)) { j->pos += 4; return MGPU_OK; }
    if (mgpu__json_peek(j) != '{')
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: \"__metadata__\" is not a JSON object of strings (nor null)", j->name);
    j->pos++;
    if (mgpu__json_peek(j) == '}') { j->pos++; return MGPU_OK; }
    for (;;) {
        mgpu__st_meta* m;
        size_t klen, vlen;
        if (out->meta_count == out->meta_cap) {
            int cap = out->meta_cap ? out->meta_cap * 2 : 8;
            mgpu__st_meta* grown = (mgpu__st_meta*)MGPU_REALLOC(out->meta, (size_t)cap * sizeof *grown);
            if (!grown) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", j->name);
            out->meta = grown;
            out->meta_cap = cap;
        }
        m = &out->meta[out->meta_count];
        m->key_at = out->strings.len;
        if ((r = mgpu__json_string(j, &out->strings, &klen)) != MGPU_OK) return r;
        if ((r = mgpu__json_expect(j, ':', "expected ':'")) != MGPU_OK) return r;
        if (mgpu__json_peek(j) != '"')
            return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: \"__metadata__\" value of '%.200s' is not a string", j->name,
                              out->strings.oom ? "?" : out->strings.p + m->key_at);
        m->value_at = out->strings.len;
        if ((r = mgpu__json_string(j, &out->strings, &vlen)) != MGPU_OK) return r;
        if (out->strings.oom) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", j->name);
        /* C strings: a NUL inside one cannot be handed out (the reference's Rust strings can hold it) */
        if (strlen(out->strings.p + m->key_at) != klen || strlen(out->strings.p + m->value_at) != vlen)
            return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: \"__metadata__\" entry '%.200s' contains a NUL character", j->name,
                              out->strings.p + m->key_at);
        out->meta_count++;
        c = mgpu__json_peek(j);
        j->pos++;
        if (c == '}') return MGPU_OK;
        if (c != ',') { j->pos--; return mgpu__json_error(j, "expected ',' or '}'"); }
    }
}

static int mgpu__st_cmp_name(const void* a, const void* b) {
    return strcmp(*(const char* const*)a, *(const char* const*)b);
}
static int mgpu__st_cmp_offsets(const void* a, const void* b) {
    const mgpu__st_tensor* x = *(const mgpu__st_tensor* const*)a;
    const mgpu__st_tensor* y = *(const mgpu__st_tensor* const*)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Sorts the n string pointers names[] and returns one that occurs twice, or NULL. */
static const char* mgpu__dup_name(const char** names, int n) {
    int i;
    if (n < 2) return NULL;
    qsort((void*)names, (size_t)n, sizeof *names, mgpu__st_cmp_name);
    for (i = 1; i < n; ++i)
        if (!strcmp(names[i - 1], names[i])) return names[i];
    return NULL;
}

static size_t mgpu__st_hash(const char* s) {   /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (; *s; ++s) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return (size_t)(h ^ (h >> 32));
}

/* Entry i of an array of structs whose first field is their name (tensors, metadata entries). */
#define MGPU__ST_NAME(base, stride, i) (*(const char* const*)((const char*)(base) + (size_t)(i) * (stride)))

/* The slot of name in a hash of base's entries: where it is, or the empty slot where it goes. */
static size_t mgpu__st_slot(const int* slots, size_t mask, const void* base, size_t stride, const char* name) {
    size_t s = mgpu__st_hash(name) & mask;
    while (slots[s] && strcmp(MGPU__ST_NAME(base, stride, slots[s] - 1), name) != 0) s = (s + 1) & mask;
    return s;
}

/* Hashes the names of base's *n entries into *slots (open addressing, at most half full: entry
   index + 1, 0 when empty). A name given twice keeps its last entry, as the reference's JSON maps
   do; the earlier ones are dropped and *n shrinks. */
static mgpu_result mgpu__st_hash_names(void* base, size_t stride, int* n, int** slots, size_t* mask, const char* name) {
    size_t size = 2;
    char* dropped = NULL;
    int i, k, drops = 0, pass;
    while (size < 2 * (size_t)*n) size *= 2;
    *mask = size - 1;
    for (pass = 0; pass < 2; ++pass) {   /* a second pass only after dropping repeats */
        MGPU_FREE(*slots);
        *slots = (int*)mgpu__calloc(size, sizeof **slots);
        if (!*slots) { MGPU_FREE(dropped); return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory indexing the header", name); }
        for (i = 0; i < *n; ++i) {
            size_t s = mgpu__st_slot(*slots, *mask, base, stride, MGPU__ST_NAME(base, stride, i));
            if ((*slots)[s]) {
                if (!dropped && !(dropped = (char*)mgpu__calloc((size_t)*n, 1)))
                    return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory indexing the header", name);
                dropped[(*slots)[s] - 1] = 1;
                drops++;
            }
            (*slots)[s] = i + 1;
        }
        if (!drops) break;
        for (i = k = 0; i < *n; ++i)
            if (!dropped[i]) memmove((char*)base + (size_t)k++ * stride, (char*)base + (size_t)i * stride, stride);
        *n = k;
        drops = 0;
        memset(dropped, 0, (size_t)k);
    }
    MGPU_FREE(dropped);
    return MGPU_OK;
}

static const mgpu__st_tensor* mgpu__st_find(const mgpu__st_file* f, const char* name) {
    int i = f->slots[mgpu__st_slot(f->slots, f->slot_mask, f->tensors, sizeof *f->tensors, name)];
    return i ? &f->tensors[i - 1] : NULL;
}
static const char* mgpu__st_meta_value(const mgpu__st_file* f, const char* key) {
    int i = f->meta_slots[mgpu__st_slot(f->meta_slots, f->meta_mask, f->meta, sizeof *f->meta, key)];
    return i ? f->meta[i - 1].value : NULL;
}

/* The reference's validate(), in its order: the tensors sorted by data_offsets, each starting
   where the previous one ended (no holes, no overlaps), its element count and bit count without
   overflow (multiplied left to right, so [2^40, 2^40, 0] overflows before its 0), a whole number
   of bytes, exactly the span of its offsets; and the last one ending at the end of the file, so
   that nothing can hide after the tensors (a polyglot file). */
static mgpu_result mgpu__st_validate(const mgpu__st_file* f, uint64_t buf_len, const char* name) {
    const mgpu__st_tensor** byoff;
    mgpu_result r = MGPU_OK;
    uint64_t start = 0;
    int i, d;
    char shape[200];
    byoff = (const mgpu__st_tensor**)MGPU_MALLOC(((size_t)f->count + 1) * sizeof *byoff);
    if (!byoff) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory checking the header", name);
    for (i = 0; i < f->count; ++i) byoff[i] = &f->tensors[i];
    qsort(byoff, (size_t)f->count, sizeof *byoff, mgpu__st_cmp_offsets);
    for (i = 0; i < f->count && r == MGPU_OK; ++i) {
        const mgpu__st_tensor* t = byoff[i];
        uint64_t elems = 1, bits = (uint64_t)mgpu__st_dtypes[t->dt].bits;
        int overflow = 0;
        mgpu__st_shape_str(t, shape, sizeof shape);
        if (t->begin != start || t->end < t->begin) {
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%.200s': invalid offset: data_offsets [%llu, %llu] %s (the data must "
                           "be contiguous from byte 0)", name, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                           t->end < t->begin ? "end before they begin" : t->begin > start ? "leave a hole after the previous tensor"
                                                                                          : "overlap the previous tensor");
            break;
        }
        start = t->end;
        for (d = 0; d < t->ndim && !overflow; ++d) {
            if (t->shape[d] && elems > UINT64_MAX / t->shape[d]) overflow = 1;
            else elems *= t->shape[d];
        }
        if (overflow || elems > UINT64_MAX / bits)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%.200s': validation overflow: shape %s of %s overflows 64 bits",
                           name, t->name, shape, t->dtype);
        else if (elems * bits % 8)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%.200s': misaligned slice: shape %s of %s is %llu bits, not whole "
                           "bytes", name, t->name, shape, t->dtype, (unsigned long long)(elems * bits));
        else if (t->end - t->begin != elems * bits / 8)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: tensor '%.200s': invalid tensor info: data_offsets [%llu, %llu] span %llu "
                           "bytes but %s %s needs %llu", name, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                           (unsigned long long)(t->end - t->begin), t->dtype, shape, (unsigned long long)(elems * bits / 8));
    }
    if (r == MGPU_OK && start != buf_len)
        r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: incomplete buffer: the tensors' data ends at byte %llu but the file's byte "
                       "buffer holds %llu (%s)", name, (unsigned long long)start, (unsigned long long)buf_len,
                       start < buf_len ? "bytes after the tensors are refused: a polyglot file?" : "file truncated?");
    MGPU_FREE((void*)byoff);
    return r;
}

static void mgpu__st_free(mgpu__st_file* f) {
    if (!f) return;
    MGPU_FREE(f->tensors);
    MGPU_FREE(f->meta);
    MGPU_FREE(f->strings.p);
    MGPU_FREE(f->dims);
    MGPU_FREE(f->slots);
    MGPU_FREE(f->meta_slots);
    memset(f, 0, sizeof *f);
}

/* Parses and validates the header of a safetensors file held in memory. On success the caller
   owns out's arrays (mgpu__st_free); on failure out is zeroed. */
static mgpu_result mgpu__st_parse(const uint8_t* file, size_t file_len, const char* name, mgpu__st_file* out) {
    mgpu__json j;
    uint64_t hlen, buf_len;
    int c, have_meta = 0, i;
    mgpu_result r = MGPU_OK;
    if (!name) name = "(memory)";
    if (!out || (!file && file_len)) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_parse(%s): NULL argument", name);
    memset(out, 0, sizeof *out);
    if (file_len < 8)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: header too small: %zu bytes is too short for a safetensors file (need at "
                          "least 8)", name, file_len);
    hlen = (uint64_t)mgpu__le32(file) | ((uint64_t)mgpu__le32(file + 4) << 32);
    if (hlen > MGPU__ST_MAX_HEADER)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: header too large: safetensors header length %llu exceeds the 100 MB limit "
                          "(not a safetensors file?)", name, (unsigned long long)hlen);
    if (hlen > (uint64_t)file_len - 8)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: invalid header length: safetensors header length %llu is larger than the "
                          "rest of the file (%zu bytes)", name, (unsigned long long)hlen, file_len - 8);
    out->data_start = 8 + hlen;
    buf_len = (uint64_t)file_len - out->data_start;
    j.s = file + 8;
    j.pos = 0;
    j.len = (size_t)hlen;
    j.name = name;
    if (mgpu__json_peek(&j) != '{') {
        if (mgpu__json_peek(&j) < 0) return mgpu__json_error(&j, "the header is empty");
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: safetensors header is not a JSON object", name);
    }
    j.pos++;
    if (mgpu__json_peek(&j) == '}') j.pos++;
    else for (;;) {
        const size_t at = out->strings.len;
        size_t klen;
        const char* key;
        if ((r = mgpu__json_string(&j, &out->strings, &klen)) != MGPU_OK) break;
        if (out->strings.oom) { r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", name); break; }
        key = out->strings.p + at;
        if ((r = mgpu__json_expect(&j, ':', "expected ':'")) != MGPU_OK) break;
        if (klen == 12 && !strcmp(key, "__metadata__")) {
            out->strings.len = at;
            if (have_meta++) { r = mgpu__fail(MGPU_ERROR_BAD_FILE, "%s: duplicate \"__metadata__\"", name); break; }
            if ((r = mgpu__st_metadata(&j, out)) != MGPU_OK) break;
        } else {
            mgpu__st_tensor* t;
            if (strlen(key) != klen) {
                r = mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: tensor name '%.200s' contains a NUL character", name, key);
                break;
            }
            if (out->count == out->cap) {
                int cap = out->cap ? out->cap * 2 : 16;
                mgpu__st_tensor* grown = out->cap >= INT32_MAX / 2 ? NULL
                                         : (mgpu__st_tensor*)MGPU_REALLOC(out->tensors, (size_t)cap * sizeof *grown);
                if (!grown) { r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory reading the header", name); break; }
                out->tensors = grown;
                out->cap = cap;
            }
            t = &out->tensors[out->count];
            memset(t, 0, sizeof *t);
            t->name_at = at;
            if ((r = mgpu__st_entry(&j, out, t)) != MGPU_OK) break;
            out->count++;
        }
        c = mgpu__json_peek(&j);
        j.pos++;
        if (c == '}') break;
        if (c != ',') { j.pos--; r = mgpu__json_error(&j, "expected ',' or '}'"); break; }
    }
    if (r == MGPU_OK && mgpu__json_peek(&j) >= 0) /* only whitespace padding may follow */
        r = mgpu__json_error(&j, "trailing characters after the header object");
    if (r == MGPU_OK) {   /* the arenas are done growing: their offsets become pointers */
        for (i = 0; i < out->count; ++i) {
            out->tensors[i].name = out->strings.p + out->tensors[i].name_at;
            out->tensors[i].shape = out->dims + out->tensors[i].shape_at;
        }
        for (i = 0; i < out->meta_count; ++i) {
            out->meta[i].key = out->strings.p + out->meta[i].key_at;
            out->meta[i].value = out->strings.p + out->meta[i].value_at;
        }
        r = mgpu__st_hash_names(out->tensors, sizeof *out->tensors, &out->count, &out->slots, &out->slot_mask, name);
        if (r == MGPU_OK)
            r = mgpu__st_hash_names(out->meta, sizeof *out->meta, &out->meta_count, &out->meta_slots, &out->meta_mask, name);
    }
    if (r == MGPU_OK) r = mgpu__st_validate(out, buf_len, name);
    if (r != MGPU_OK) mgpu__st_free(out);
    return r;
}

/* ---- the writer ---- */
typedef struct mgpu__st_write_item {
    const char* name;
    const char* dtype;      /* "F32", ... (mgpu__st_dtype_size knows it) */
    int ndim;               /* 0..8 */
    const int64_t* shape;
    const void* data;
    size_t bytes;           /* must equal product(shape) * dtype size */
} mgpu__st_write_item;

static void mgpu__sb_str(mgpu__sbuf* b, const char* s) { mgpu__sb_put(b, s, strlen(s)); }
static void mgpu__sb_u64(mgpu__sbuf* b, uint64_t v) {
    char tmp[32];
    snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
    mgpu__sb_str(b, tmp);
}
static void mgpu__sb_json(mgpu__sbuf* b, const char* s) { /* a JSON string literal */
    mgpu__sb_put(b, "\"", 1);
    for (; *s; ++s) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"') mgpu__sb_put(b, "\\\"", 2);
        else if (c == '\\') mgpu__sb_put(b, "\\\\", 2);
        else if (c == '\n') mgpu__sb_put(b, "\\n", 2);
        else if (c == '\r') mgpu__sb_put(b, "\\r", 2);
        else if (c == '\t') mgpu__sb_put(b, "\\t", 2);
        else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            mgpu__sb_put(b, esc, 6);
        } else mgpu__sb_put(b, s, 1);
    }
    mgpu__sb_put(b, "\"", 1);
}

static int mgpu__utf8_valid(const char* s) {
    size_t n = strlen(s), i = 0;
    while (i < n) {
        int k = mgpu__utf8_len((const uint8_t*)s + i, n - i);
        if (!k) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* Checks the arguments of mgpu__st_write and builds the padded JSON header. */
static mgpu_result mgpu__st_header(const char* path, const mgpu__st_write_item* items, int count,
                                   const char* const* meta_keys, const char* const* meta_values, int meta_count,
                                   mgpu__sbuf* b) {
    int i, k, n = count > meta_count ? count : meta_count;
    uint64_t offset = 0;
    const char** names;
    const char* d = NULL;
    if (count < 0 || meta_count < 0 || (count > 0 && !items) || (meta_count > 0 && (!meta_keys || !meta_values)))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): bad item or metadata arrays", path);
    for (i = 0; i < meta_count; ++i) {
        const char* key = meta_keys[i];
        const char* val = meta_values[i];
        if (!key || !val || !mgpu__utf8_valid(key) || !mgpu__utf8_valid(val))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): metadata entry %d must be UTF-8 strings", path, i);
    }
    for (i = 0; i < count; ++i) {
        const mgpu__st_write_item* it = &items[i];
        uint64_t elems = 1;
        size_t dsize = mgpu__st_dtype_size(it->dtype);
        if (!it->name || !strlen(it->name) || !mgpu__utf8_valid(it->name) || !strcmp(it->name, "__metadata__"))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT,
                              "mgpu__st_write(%s): item %d: the name must be non-empty UTF-8, not \"__metadata__\"", path, i);
        if (!dsize)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): tensor '%s': unknown dtype '%s'", path, it->name,
                              it->dtype ? it->dtype : "(null)");
        if (it->ndim < 0 || it->ndim > 8 || (it->ndim > 0 && !it->shape))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): tensor '%s': ndim %d (0..8 with a shape)", path,
                              it->name, it->ndim);
        for (k = 0; k < it->ndim; ++k)
            if (it->shape[k] < 0)
                return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): tensor '%s': negative dimension", path, it->name);
        for (k = 0; k < it->ndim; ++k)
            if (it->shape[k] == 0) elems = 0;
        for (k = 0; k < it->ndim && elems; ++k) {
            if (elems > UINT64_MAX / (uint64_t)it->shape[k] / dsize)
                return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): tensor '%s': shape overflows", path, it->name);
            elems *= (uint64_t)it->shape[k];
        }
        if (elems * dsize != (uint64_t)it->bytes || (it->bytes && !it->data))
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT,
                              "mgpu__st_write(%s): tensor '%s': %zu bytes of data given, the shape and dtype need %llu", path,
                              it->name, it->bytes, (unsigned long long)(elems * dsize));
        if (offset > UINT64_MAX - it->bytes)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): total size overflows", path);
        offset += it->bytes;
    }
    if (n > 0) {
        names = (const char**)MGPU_MALLOC((size_t)n * sizeof *names);
        if (!names) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu__st_write(%s): out of memory", path);
        for (i = 0; i < count; ++i) names[i] = items[i].name;
        if ((d = mgpu__dup_name(names, count)) != NULL) {
            MGPU_FREE((void*)names);
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): duplicate tensor name '%s'", path, d);
        }
        for (i = 0; i < meta_count; ++i) names[i] = meta_keys[i];
        if ((d = mgpu__dup_name(names, meta_count)) != NULL) {
            MGPU_FREE((void*)names);
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write(%s): duplicate metadata key '%s'", path, d);
        }
        MGPU_FREE((void*)names);
    }
    mgpu__sb_put(b, "{", 1);
    if (meta_count > 0) {
        mgpu__sb_str(b, "\"__metadata__\":{");
        for (i = 0; i < meta_count; ++i) {
            if (i) mgpu__sb_put(b, ",", 1);
            mgpu__sb_json(b, meta_keys[i]);
            mgpu__sb_put(b, ":", 1);
            mgpu__sb_json(b, meta_values[i]);
        }
        mgpu__sb_put(b, "}", 1);
    }
    offset = 0;
    for (i = 0; i < count; ++i) {
        if (i || meta_count > 0) mgpu__sb_put(b, ",", 1);
        mgpu__sb_json(b, items[i].name);
        mgpu__sb_str(b, ":{\"dtype\":");
        mgpu__sb_json(b, items[i].dtype);
        mgpu__sb_str(b, ",\"shape\":[");
        for (k = 0; k < items[i].ndim; ++k) {
            if (k) mgpu__sb_put(b, ",", 1);
            mgpu__sb_u64(b, (uint64_t)items[i].shape[k]);
        }
        mgpu__sb_str(b, "],\"data_offsets\":[");
        mgpu__sb_u64(b, offset);
        mgpu__sb_put(b, ",", 1);
        offset += items[i].bytes;
        mgpu__sb_u64(b, offset);
        mgpu__sb_str(b, "]}");
    }
    mgpu__sb_put(b, "}", 1);
    while (!b->oom && b->len % 8) mgpu__sb_put(b, " ", 1); /* the byte buffer starts 8-aligned */
    if (b->oom) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu__st_write(%s): out of memory building the header", path);
    return MGPU_OK;
}

/* -- the atomic writer --
   A save writes a temporary file in the target's directory, flushes and fsyncs it, renames it
   over the target and fsyncs the directory, so that after a crash the path holds the old file or
   the new one, never a mix. The temporary name is
       .<basename, cut to 160 bytes>.<hash of the whole basename>.<pid>.<n>.tmp
   which fits NAME_MAX (255) whatever the target's name, and names its target and its writer: a
   save that succeeds removes the temporary files of earlier saves to the same target whose
   process no longer exists (kill(pid, 0) fails with ESRCH), such as one killed during a save.
   Files of live processes, this one included, are left alone (the pids are those this process
   sees: writers in other pid namespaces, such as containers sharing the folder, should not
   share a target path). On Windows the flush is FlushFileBuffers and the rename MoveFileExW
   (replace, write-through), which also replaces a file that another program reads, if it shares
   delete access as mgpu's own reads do; names go through UTF-16. A symlink is followed on POSIX
   (the file it points to is replaced, so the link keeps working); anything else that is not a
   regular file, a directory, a FIFO or a device, is refused before anything is written. */
#define MGPU__TMP_SUFFIX ".tmp"
#define MGPU__TMP_BASE_MAX 160

#if defined(__unix__) || defined(__APPLE__)
static const char* mgpu__file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISREG(mode)) return "a regular file";
    return "not a regular file";
}

/* path with its symlinks followed (also a dangling one: the file it would create), in a new
   buffer; NULL with errno set when the chain is too long or unreadable. */
static char* mgpu__follow_links(const char* path) {
    char* cur = (char*)MGPU_MALLOC(strlen(path) + 1);
    int hops;
    if (!cur) { errno = ENOMEM; return NULL; }
    strcpy(cur, path);
    for (hops = 0; hops < 40; ++hops) {
        struct stat st;
        char target[4096], *next;
        const char* slash;
        ssize_t n;
        size_t dir_len;
        if (lstat(cur, &st) != 0 || !S_ISLNK(st.st_mode)) return cur;   /* not there yet, or not a link */
        n = readlink(cur, target, sizeof target - 1);
        if (n < 0 || n >= (ssize_t)sizeof target - 1) { if (n >= 0) errno = ENAMETOOLONG; MGPU_FREE(cur); return NULL; }
        target[n] = 0;
        slash = strrchr(cur, '/');
        dir_len = target[0] == '/' || !slash ? 0 : (size_t)(slash - cur) + 1;   /* relative: to the link's folder */
        next = (char*)MGPU_MALLOC(dir_len + (size_t)n + 1);
        if (!next) { MGPU_FREE(cur); errno = ENOMEM; return NULL; }
        memcpy(next, cur, dir_len);
        memcpy(next + dir_len, target, (size_t)n + 1);
        MGPU_FREE(cur);
        cur = next;
    }
    MGPU_FREE(cur);
    errno = ELOOP;
    return NULL;
}
#endif

static uint32_t mgpu__fnv1a(const char* s) {
    uint32_t h = 2166136261u;
    for (; *s; ++s) h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* The folder part of path ("" or "dir/"), and the prefix ".<cut basename>.<hash>." that every
   temporary file for path starts with. */
static void mgpu__tmp_prefix(const char* path, size_t* dir_len, char* prefix, size_t size) {
    const char* slash = strrchr(path, '/');
    const char* base;
    size_t cut;
#ifdef _WIN32
    if (strrchr(path, '\\') > slash) slash = strrchr(path, '\\');
#endif
    base = slash ? slash + 1 : path;
    cut = strlen(base);
    if (cut > MGPU__TMP_BASE_MAX) {
        cut = MGPU__TMP_BASE_MAX;
        while (cut > 0 && ((uint8_t)base[cut] & 0xC0) == 0x80) --cut;   /* not inside a UTF-8 character */
    }
    *dir_len = (size_t)(base - path);
    snprintf(prefix, size, ".%.*s.%08lx.", (int)cut, base, (unsigned long)mgpu__fnv1a(base));
}

#if defined(__unix__) || defined(__APPLE__)
/* The folder of path, whose first dir_len bytes name it ("." when dir_len is 0), in a new
   buffer; NULL when out of memory. */
static char* mgpu__dir_of(const char* path, size_t dir_len) {
    char* dir = (char*)MGPU_MALLOC(dir_len + 2);
    if (!dir) return NULL;
    if (dir_len) { memcpy(dir, path, dir_len); dir[dir_len] = 0; }
    else strcpy(dir, ".");
    return dir;
}
#endif

#if defined(__unix__) || defined(__APPLE__) || defined(_WIN32)
/* Is name one of the temporary files of prefix's target (".<cut base>.<hash>.<pid>.<n>.tmp"),
   written by a process other than this one that no longer exists? */
static int mgpu__tmp_is_stale(const char* name, const char* prefix) {
    size_t plen = strlen(prefix), nlen = strlen(name), slen = strlen(MGPU__TMP_SUFFIX);
    const char* rest = name + plen;
    char* end = NULL;
    long long pid;
    if (strncmp(name, prefix, plen) != 0 || nlen < plen + slen || strcmp(name + nlen - slen, MGPU__TMP_SUFFIX) != 0) return 0;
    if (*rest < '0' || *rest > '9') return 0;
    errno = 0;
    pid = strtoll(rest, &end, 10);
    if (errno || !end || *end != '.' || pid <= 0 || pid > 0x7fffffff) return 0;
#ifdef _WIN32
    {
        HANDLE h;
        DWORD code = 0;
        if ((DWORD)pid == GetCurrentProcessId()) return 0;
        h = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, (DWORD)pid);
        if (!h) return GetLastError() == ERROR_INVALID_PARAMETER;   /* no such process (else: alive, not ours) */
        if (!GetExitCodeProcess(h, &code)) code = STILL_ACTIVE;
        CloseHandle(h);
        return code != STILL_ACTIVE;   /* exited, its handle still held by someone */
    }
#else
    if ((pid_t)pid == getpid()) return 0;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;   /* alive (EPERM: alive, someone else's) */
#endif
}

/* After a successful save: remove the temporary files for path whose writer is gone. */
#ifdef _WIN32
static void mgpu__remove_stale_tmp(const char* path) {
    char prefix[MGPU__TMP_BASE_MAX + 16], *pattern, name[4 * MAX_PATH];
    size_t dir_len;
    wchar_t *wpattern, *wfull;
    WIN32_FIND_DATAW e;
    HANDLE d;
    mgpu__tmp_prefix(path, &dir_len, prefix, sizeof prefix);
    pattern = (char*)MGPU_MALLOC(dir_len + strlen(prefix) + 8);
    if (!pattern) return;
    snprintf(pattern, dir_len + strlen(prefix) + 8, "%.*s%s*" MGPU__TMP_SUFFIX, (int)dir_len, path, prefix);
    wpattern = mgpu__wide_path(pattern);
    MGPU_FREE(pattern);
    if (!wpattern) return;
    d = FindFirstFileW(wpattern, &e);
    MGPU_FREE(wpattern);
    if (d == INVALID_HANDLE_VALUE) return;
    do {
        if (!WideCharToMultiByte(CP_UTF8, 0, e.cFileName, -1, name, (int)sizeof name, NULL, NULL)) continue;
        if (!mgpu__tmp_is_stale(name, prefix)) continue;
        pattern = (char*)MGPU_MALLOC(dir_len + strlen(name) + 1);
        if (!pattern) break;
        snprintf(pattern, dir_len + strlen(name) + 1, "%.*s%s", (int)dir_len, path, name);
        wfull = mgpu__wide_path(pattern);
        MGPU_FREE(pattern);
        if (wfull) DeleteFileW(wfull);
        MGPU_FREE(wfull);
    } while (FindNextFileW(d, &e));
    FindClose(d);
}
#else
static void mgpu__remove_stale_tmp(const char* path) {
    char prefix[MGPU__TMP_BASE_MAX + 16], *dir, *full;
    size_t dir_len;
    DIR* d;
    struct dirent* e;
    mgpu__tmp_prefix(path, &dir_len, prefix, sizeof prefix);
    dir = mgpu__dir_of(path, dir_len);
    full = (char*)MGPU_MALLOC(dir_len + 256 + 2);
    if (!dir || !full) { MGPU_FREE(dir); MGPU_FREE(full); return; }
    d = opendir(dir);
    while (d && (e = readdir(d)) != NULL) {
        if (!mgpu__tmp_is_stale(e->d_name, prefix)) continue;
        snprintf(full, dir_len + 256 + 2, "%.*s%s", (int)dir_len, path, e->d_name);
        remove(full);
    }
    if (d) closedir(d);
    MGPU_FREE(dir);
    MGPU_FREE(full);
}
#endif
#endif

#if defined(__unix__) || defined(__APPLE__)
/* fsync the folder holding path, so that the rename itself survives a power loss. Returns 0, or
   an errno worth reporting (file systems that cannot fsync a folder say EINVAL: not an error). */
static int mgpu__sync_dir(const char* path, size_t dir_len) {
    char* dir = mgpu__dir_of(path, dir_len);
    int fd, err = 0;
    if (!dir) return 0;
    fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS && errno != EBADF) err = errno;
        close(fd);
    }
    MGPU_FREE(dir);
    return err;
}
#endif

#ifdef _WIN32
/* Moves the temporary file wtmp over wtarget; 0 or a Win32 error.
   1. SetFileInformationByHandle's rename with POSIX semantics (Windows 10 1709 and later, NTFS):
      one step, which also replaces a file another program has open with FILE_SHARE_DELETE, as on
      POSIX; the moved file is flushed again so that its new name is on the disk too.
   2. Where the system cannot (older Windows, FAT, wine): MoveFileExW with replace and
      write-through, one step too, but refused while another program has the target open.
   3. Then, for a target held open with FILE_SHARE_DELETE: ReplaceFileW, which moves the old file
      to wbackup first (the reader keeps reading it; it is deleted once closed) and the new one in.
      Not one step: a failure between its two moves puts the old file back; a crash there leaves
      it at wbackup, beside the new one at wtmp. */
typedef struct mgpu__win_rename_info {   /* FILE_RENAME_INFO as Windows 10 declares it */
    DWORD flags;
    HANDLE root;
    DWORD length;
    WCHAR name[1];
} mgpu__win_rename_info;
static DWORD mgpu__win_replace(const wchar_t* wtmp, const wchar_t* wtarget, const wchar_t* wbackup) {
    size_t len = wcslen(wtarget), size = sizeof(mgpu__win_rename_info) + len * sizeof(WCHAR);
    HANDLE h = CreateFileW(wtmp, DELETE | GENERIC_WRITE | SYNCHRONIZE, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                           NULL, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, NULL);
    mgpu__win_rename_info* info = (mgpu__win_rename_info*)mgpu__calloc(1, size);
    DWORD e;
    if (h != INVALID_HANDLE_VALUE && info) {
        BOOL moved;
        info->flags = 0x1 | 0x2;   /* FILE_RENAME_FLAG_REPLACE_IF_EXISTS | FILE_RENAME_FLAG_POSIX_SEMANTICS */
        info->length = (DWORD)(len * sizeof(WCHAR));
        memcpy(info->name, wtarget, len * sizeof(WCHAR));
        moved = SetFileInformationByHandle(h, (FILE_INFO_BY_HANDLE_CLASS)22 /* FileRenameInfoEx */, info, (DWORD)size);
        if (moved) FlushFileBuffers(h);
        CloseHandle(h);
        MGPU_FREE(info);
        if (moved) return 0;
    } else {
        if (h != INVALID_HANDLE_VALUE) CloseHandle(h);
        MGPU_FREE(info);
    }
    if (MoveFileExW(wtmp, wtarget, MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) return 0;
    e = GetLastError();
    if (e != ERROR_ACCESS_DENIED && e != ERROR_SHARING_VIOLATION) return e;
    if (ReplaceFileW(wtarget, wtmp, wbackup, REPLACEFILE_IGNORE_MERGE_ERRORS, NULL, NULL)) {
        DeleteFileW(wbackup);   /* gone once its reader closes it */
        return 0;
    }
    e = GetLastError();
    if (e == ERROR_UNABLE_TO_MOVE_REPLACEMENT_2) MoveFileExW(wbackup, wtarget, MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH);
    return e == ERROR_UNABLE_TO_REMOVE_REPLACED ? ERROR_SHARING_VIOLATION : e;   /* (held without sharing delete access) */
}
#endif

/* Writes path atomically, as described above: body(f, user) writes the contents to the temporary
   file (0, or nonzero with errno set when a write failed); `what` names the kind of file in the
   messages ("a checkpoint"). On any failure the temporary file is removed and path is left
   untouched. Safetensors checkpoints and token files are saved through it, following symlinks;
   traces too, with follow_links 0: a symlink at path is refused (a trace's path is often typed
   or made up, and must never replace the file a link leads to, such as a checkpoint). */
static mgpu_result mgpu__write_atomic(const char* path, const char* what, int follow_links, int (*body)(FILE* f, const void* user),
                                      const void* user) {
    char* tmp = NULL;
    char* target = NULL;   /* path, its symlinks followed */
    char prefix[MGPU__TMP_BASE_MAX + 16];
    FILE* f = NULL;
    const char* step = NULL;
    int err = 0;
#ifdef _WIN32
    DWORD win_err = 0;
    wchar_t *wtmp = NULL, *wtarget = NULL, *wbackup = NULL;   /* tmp, target and a backup in UTF-16 */
#endif
    unsigned long pid = 0, n;
    size_t dir_len = 0;
    mgpu_result r = MGPU_OK;
    if (!path || !*path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "save: no path");
#if defined(__unix__) || defined(__APPLE__)
    {
        struct stat st;
        pid = (unsigned long)getpid();
        if (!follow_links && lstat(path, &st) == 0 && S_ISLNK(st.st_mode))   /* (one made later: the rename replaces it) */
            return mgpu__fail(MGPU_ERROR_IO, "%s: it is a symbolic link; %s is never written through one (remove it, or give "
                              "another path)", path, what);
        if (follow_links) target = mgpu__follow_links(path);
        else if ((target = (char*)MGPU_MALLOC(strlen(path) + 1)) != NULL) strcpy(target, path);
        else errno = ENOMEM;
        if (!target) {
            err = errno;
            if (err == ENOMEM) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory for its path", path);
            return mgpu__fail(MGPU_ERROR_IO, "%s: cannot follow the symbolic link: %s", path, strerror(err));
        }
        if (stat(target, &st) == 0 && !S_ISREG(st.st_mode)) {
            r = mgpu__fail(MGPU_ERROR_IO, "%s: '%s' is %s, not a regular file; %s replaces only a regular file", path,
                           target, mgpu__file_kind(st.st_mode), what);
            MGPU_FREE(target);
            return r;
        }
    }
#else
    (void)follow_links;   /* Windows replaces a symlink, never follows it */
    target = (char*)MGPU_MALLOC(strlen(path) + 1);
    if (target) strcpy(target, path);
#ifdef _WIN32
    pid = (unsigned long)GetCurrentProcessId();
#endif
#endif
    mgpu__tmp_prefix(target ? target : path, &dir_len, prefix, sizeof prefix);
    tmp = (char*)MGPU_MALLOC(dir_len + strlen(prefix) + 64);
    if (!tmp || !target) {
        MGPU_FREE(tmp);
        MGPU_FREE(target);
        return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory for its temporary file's name", path);
    }
    n = (unsigned long)(size_t)&f;   /* a local's address: distinct for the live threads of a process */
    snprintf(tmp, dir_len + strlen(prefix) + 64, "%.*s%s%lu.%lx" MGPU__TMP_SUFFIX, (int)dir_len, target, prefix, pid, n);
#ifdef _WIN32
    {   /* every name in UTF-16 before anything is written, so that nothing after needs memory; the
           backup is the temporary name with ".old" before ".tmp" (a stale one is tidied as the
           others). A folder is never replaced (MoveFileExW would say only "access denied"). */
        size_t wlen;
        DWORD attr;
        wtmp = mgpu__wide_path(tmp);
        wtarget = mgpu__wide_path(target);
        wlen = wtmp ? wcslen(wtmp) : 0;
        wbackup = wtmp ? (wchar_t*)MGPU_MALLOC((wlen + 5) * sizeof(wchar_t)) : NULL;
        attr = wtarget ? GetFileAttributesW(wtarget) : INVALID_FILE_ATTRIBUTES;
        if (!wtmp || !wtarget || !wbackup)
            r = errno == ENOMEM || (wtmp && wtarget) ? mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of memory for its temporary file's name", path)
                                                     : mgpu__fail(MGPU_ERROR_IO, "%s: the name is not UTF-8", path);
        else if (attr != INVALID_FILE_ATTRIBUTES && (attr & FILE_ATTRIBUTE_DIRECTORY))
            r = mgpu__fail(MGPU_ERROR_IO, "%s: it is a directory, not a regular file; %s replaces only a regular file", path, what);
        if (r) {
            MGPU_FREE(wtmp); MGPU_FREE(wtarget); MGPU_FREE(wbackup);
            MGPU_FREE(tmp); MGPU_FREE(target);
            return r;
        }
        memcpy(wbackup, wtmp, (wlen - 4) * sizeof(wchar_t));
        memcpy(wbackup + wlen - 4, L".old.tmp", 9 * sizeof(wchar_t));
    }
    f = _wfopen(wtmp, L"wb");
#else
    f = fopen(tmp, "wb");
#endif
    if (!f) { err = errno; step = "cannot create the temporary file"; }
    if (!step && body(f, user) != 0) { err = errno; step = "write failed"; }
    if (!step && fflush(f) != 0) { err = errno; step = "write failed"; }
#if defined(__APPLE__) && defined(F_FULLFSYNC)
    /* macOS's fsync leaves the data in the drive's cache; F_FULLFSYNC asks the drive to write it
       (some file systems cannot: then fsync is what there is) */
    if (!step && fcntl(fileno(f), F_FULLFSYNC) != 0 && fsync(fileno(f)) != 0) { err = errno; step = "fsync failed"; }
#elif defined(__unix__) || defined(__APPLE__)
    if (!step && fsync(fileno(f)) != 0) { err = errno; step = "fsync failed"; }
#elif defined(_WIN32)
    if (!step && !FlushFileBuffers((HANDLE)_get_osfhandle(_fileno(f)))) { win_err = GetLastError(); step = "flush to disk failed"; }
#endif
    if (f && fclose(f) != 0 && !step) { err = errno; step = "close failed"; }
#ifdef _WIN32
    if (!step && (win_err = mgpu__win_replace(wtmp, wtarget, wbackup)) != 0)
        step = win_err == ERROR_SHARING_VIOLATION || win_err == ERROR_ACCESS_DENIED
                   ? "cannot replace it (another program may hold it open without sharing delete access)"
                   : "cannot move the temporary file over it";
#else
    if (!step && rename(tmp, target) != 0) { err = errno; step = "cannot rename the temporary file over it"; }
#endif
    if (step) {
        if (f) {
#ifdef _WIN32
            DeleteFileW(wtmp);
#else
            remove(tmp);
#endif
        }
        r = mgpu__fail(MGPU_ERROR_IO, "%s: %s (%s): %s", path, step, tmp,
#ifdef _WIN32
                       win_err ? mgpu__win_error(win_err) :
#endif
                       err ? strerror(err) : "unknown error");
    }
#if defined(__unix__) || defined(__APPLE__)
    else {
        err = mgpu__sync_dir(target, dir_len);
        if (err) r = mgpu__fail(MGPU_ERROR_IO, "%s: written and renamed, but fsync of its folder failed: %s", path, strerror(err));
        mgpu__remove_stale_tmp(target);
    }
#elif defined(_WIN32)
    else mgpu__remove_stale_tmp(target);
#endif
#ifdef _WIN32
    MGPU_FREE(wtmp);
    MGPU_FREE(wtarget);
    MGPU_FREE(wbackup);
#endif
    MGPU_FREE(tmp);
    MGPU_FREE(target);
    return r;
}

/* A safetensors file: the 8-byte header length, the header, the tensors' bytes in order. */
typedef struct mgpu__st_body {
    const mgpu__sbuf* header;
    const mgpu__st_write_item* items;
    int count;
} mgpu__st_body;
static int mgpu__st_write_body(FILE* f, const void* user) {
    const mgpu__st_body* sb = (const mgpu__st_body*)user;
    uint8_t len8[8];
    int i;
    for (i = 0; i < 8; ++i) len8[i] = (uint8_t)((uint64_t)sb->header->len >> (8 * i));
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(sb->header->p, 1, sb->header->len, f) != sb->header->len) return 1;
    for (i = 0; i < sb->count; ++i)
        if (sb->items[i].bytes && fwrite(sb->items[i].data, 1, sb->items[i].bytes, f) != sb->items[i].bytes) return 1;
    return 0;
}

/* Writes a safetensors file atomically (mgpu__write_atomic). */
static mgpu_result mgpu__st_write(const char* path, const mgpu__st_write_item* items, int count,
                                  const char* const* meta_keys, const char* const* meta_values, int meta_count) {
    mgpu__sbuf b;
    mgpu__st_body body;
    mgpu_result r;
    if (!path || !*path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu__st_write: no path");
    memset(&b, 0, sizeof b);
    r = mgpu__st_header(path, items, count, meta_keys, meta_values, meta_count, &b);
    body.header = &b;
    body.items = items;
    body.count = count;
    if (r == MGPU_OK) r = mgpu__write_atomic(path, "a checkpoint", 1, mgpu__st_write_body, &body);
    MGPU_FREE(b.p);
    return r;
}


/* ---- checkpoints, data sets and the loader, on top of the readers above ---- */
/* The whole file in memory. Only a regular file is read, and only as many bytes as its size
   says: /dev/zero, a FIFO or a directory is refused up front (a FIFO is opened non-blocking, so
   that opening it does not wait for a writer) instead of being read until memory runs out. */
#if defined(__unix__) || defined(__APPLE__) || defined(_WIN32)
/* The buffer for a file of size bytes (one byte more: an empty file asks for 1, never malloc(0)). */
static mgpu_result mgpu__read_buffer(const char* path, uint64_t size, uint8_t** data) {
    if (size >= (uint64_t)(SIZE_MAX / 2))
        return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %llu bytes is more than this machine can address", path,
                          (unsigned long long)size);
    *data = (uint8_t*)MGPU_MALLOC((size_t)size + 1);
    if (!*data) return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "'%s': no memory for %llu bytes", path, (unsigned long long)size);
    return MGPU_OK;
}
#endif
static mgpu_result mgpu__read_file(const char* path, uint8_t** data, size_t* len) {
    size_t cap = (size_t)1 << 20, n = 0, got;
    *data = NULL;
    *len = 0;
    if (!path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "read: NULL path");
#if defined(__unix__) || defined(__APPLE__)
    {
        struct stat st;
        int fd = open(path, O_RDONLY | O_NONBLOCK), err;
        ssize_t r = 0;
        (void)cap;
        (void)got;
        if (fd < 0) return mgpu__fail(MGPU_ERROR_IO, "cannot open '%s': %s", path, strerror(errno));
        if (fstat(fd, &st) != 0) {
            err = errno;
            close(fd);
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %s", path, strerror(err));
        }
        if (!S_ISREG(st.st_mode)) {
            close(fd);
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': it is %s, not a regular file", path, mgpu__file_kind(st.st_mode));
        }
        if (mgpu__read_buffer(path, (uint64_t)st.st_size, data) != MGPU_OK) {
            close(fd);
            return mgpu_last_result();
        }
        while (n < (size_t)st.st_size && ((r = read(fd, *data + n, (size_t)st.st_size - n)) > 0 || (r < 0 && errno == EINTR)))
            if (r > 0) n += (size_t)r;
        err = r < 0 ? errno : 0;
        close(fd);
        if (n != (size_t)st.st_size) {
            MGPU_FREE(*data);
            *data = NULL;
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %s", path,
                              err ? strerror(err) : "it became shorter while it was read");
        }
        *len = n;
        return MGPU_OK;
    }
#elif defined(_WIN32)
    {   /* shared for reading, writing and deleting: a save over this file meanwhile succeeds */
        wchar_t* w = mgpu__wide_path(path);
        HANDLE h;
        LARGE_INTEGER size;
        DWORD got_now = 0, attr;
        (void)cap;
        (void)got;
        if (!w) return mgpu__fail(errno == ENOMEM ? MGPU_ERROR_OUT_OF_MEMORY : MGPU_ERROR_IO, "cannot open '%s': %s", path,
                                  errno == ENOMEM ? "out of memory" : "the name is not UTF-8");
        attr = GetFileAttributesW(w);
        if (attr != INVALID_FILE_ATTRIBUTES && (attr & FILE_ATTRIBUTE_DIRECTORY)) {
            MGPU_FREE(w);
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': it is a directory, not a regular file", path);
        }
        h = CreateFileW(w, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, NULL, OPEN_EXISTING,
                        FILE_ATTRIBUTE_NORMAL | FILE_FLAG_SEQUENTIAL_SCAN, NULL);
        MGPU_FREE(w);
        if (h == INVALID_HANDLE_VALUE) return mgpu__fail(MGPU_ERROR_IO, "cannot open '%s': %s", path, mgpu__win_error(GetLastError()));
        if (GetFileType(h) != FILE_TYPE_DISK) {
            CloseHandle(h);
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': it is a device or a pipe, not a regular file", path);
        }
        if (!GetFileSizeEx(h, &size)) {
            DWORD e = GetLastError();
            CloseHandle(h);
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %s", path, mgpu__win_error(e));
        }
        if (mgpu__read_buffer(path, (uint64_t)size.QuadPart, data) != MGPU_OK) {
            CloseHandle(h);
            return mgpu_last_result();
        }
        while (n < (size_t)size.QuadPart) {   /* ReadFile takes at most 4 GiB - 1 a call */
            DWORD want = (DWORD)MGPU__MIN((size_t)size.QuadPart - n, (size_t)1 << 30);
            if (!ReadFile(h, *data + n, want, &got_now, NULL) || got_now == 0) break;
            n += got_now;
        }
        attr = n == (size_t)size.QuadPart ? 0 : GetLastError();
        CloseHandle(h);
        if (n != (size_t)size.QuadPart) {
            MGPU_FREE(*data);
            *data = NULL;
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %s", path, attr ? mgpu__win_error(attr) : "it became shorter while it was read");
        }
        *len = n;
        return MGPU_OK;
    }
#else
    {
        FILE* f = fopen(path, "rb");   /* (not Windows: see above) */
        if (!f) return mgpu__fail(MGPU_ERROR_IO, "cannot open '%s': %s", path, strerror(errno));
        for (;;) {
            if (!*data || n == cap) {
                uint8_t* grown = (uint8_t*)MGPU_REALLOC(*data, *data ? cap *= 2 : cap);
                if (!grown) {
                    MGPU_FREE(*data);
                    *data = NULL;
                    fclose(f);
                    return mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "'%s': no memory for %zu bytes", path, cap);
                }
                *data = grown;
            }
            got = fread(*data + n, 1, cap - n, f);
            n += got;
            if (got == 0) break;
        }
        if (ferror(f)) {
            int err = errno;
            fclose(f);
            MGPU_FREE(*data);
            *data = NULL;
            return mgpu__fail(MGPU_ERROR_IO, "cannot read '%s': %s", path, strerror(err));
        }
        fclose(f);
        *len = n;
        return MGPU_OK;
    }
#endif
}

/* -- checkpoints -- */
#define MGPU__OPT_PREFIX "optimizer."

static void mgpu__state_tensor_name(char* buf, size_t size, const char* param, const char* state) {
    snprintf(buf, size, MGPU__OPT_PREFIX "%s.%s", param, state);
}
/* A tensor's name in a file: prefix + the parameter's name, or its optimizer state's name. */
static void mgpu__load_name(char* buf, size_t size, const char* prefix, const char* param, const char* state) {
    char joined[400];
    snprintf(joined, sizeof joined, "%s%s", prefix, param);
    if (state) mgpu__state_tensor_name(buf, size, joined, state);
    else snprintf(buf, size, "%s", joined);
}

#define MGPU__SAVE_META 6   /* the most metadata entries mgpu writes itself */

/* float to bfloat16 and to IEEE half, rounded to nearest even (NaNs stay NaNs, quiet). */
static uint16_t mgpu__float_to_half(float f) {   /* after F. Giesen's float_to_half_fast3_rtne */
    const uint32_t x = mgpu__f32_bits(f);
    uint32_t ax;
    uint16_t sign;
    sign = (uint16_t)((x >> 16) & 0x8000);
    ax = x & 0x7FFFFFFFu;
    if (ax >= 0x47800000u)   /* 2^16 and above, infinities, NaNs */
        return (uint16_t)(sign | (ax > 0x7F800000u ? 0x7E00 : 0x7C00));
    if (ax < 0x38800000u) {   /* below 2^-14: a subnormal half; adding 0.5 rounds to a multiple of 2^-24 */
        ax = mgpu__f32_bits(mgpu__f32_from_bits(ax) + 0.5f);
        return (uint16_t)(sign | (uint16_t)(ax - 0x3F000000u));
    }
    ax += ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((ax >> 13) & 1);   /* rebias, round to nearest even */
    return (uint16_t)(sign | (uint16_t)(ax >> 13));
}

/* A user's metadata entry i, checked before anything is written: NULL when fine, else why not. */
static const char* mgpu__user_meta_problem(const mgpu_metadata* meta, int i) {
    const char* k = meta[i].key;
    const char* v = meta[i].value;
    int j;
    if (!k || !*k) return "the key is NULL or empty";
    if (!v) return "the value is NULL";
    if (!mgpu__utf8_valid(k)) return "the key must be UTF-8";
    if (!mgpu__utf8_valid(v)) return "the value must be UTF-8";
    if (!strcmp(k, "format") || !strncmp(k, "mgpu.", 5)) return "the key is mgpu's own ('format' and 'mgpu.*' are reserved)";
    for (j = 0; j < i; ++j)
        if (!strcmp(meta[j].key, k)) return "the key is given twice";
    return NULL;
}

static mgpu_result mgpu__model_save_here(const mgpu_model* m, const mgpu_optimizer* opt, const char* path, const mgpu_save_desc* desc);
/* A buffer that counts (BatchNorm's num_batches_tracked) is an int64 in PyTorch's state_dict: the
   file holds it as I64, the model as a float (exact to 2^24). */
static int mgpu__buffer_is_count(const char* name) {
    const size_t n = strlen(name), k = strlen("num_batches_tracked");
    return n >= k && !strcmp(name + n - k, "num_batches_tracked");
}
/* A distributed model: rank 0 writes (every replica holds the same bits), and every rank returns
   its result, so that no rank goes on before the file is there, nor after it failed. */
MGPUDEF mgpu_result mgpu_model_save_ex(const mgpu_model* m, const mgpu_optimizer* opt, const char* path, const mgpu_save_desc* desc) {
    if (m && mgpu__live_check(m, MGPU__LIVE_MODEL, "mgpu_model_save", "model") && m->suspect)   /* (the same flag on every rank) */
        return mgpu__suspect_refuse(m, "mgpu_model_save");
    if (!m || !m->dist) return mgpu__model_save_here(m, opt, path, desc);
    mgpu__dist_doing("mgpu_model_save", 0);
    return mgpu__dist_agree(mgpu__dist.rank == 0 ? mgpu__model_save_here(m, opt, path, desc) : MGPU_OK, 0, 0.0, NULL, NULL);
}
/* The model's layer types, "Linear,ReLU,Linear", as a checkpoint records them ("mgpu.layers") and
   a load compares them: cut at size - 1 bytes, the same cut for both. */
static void mgpu__layers_text(const mgpu_model* m, char* buf, size_t size) {
    size_t len = 0;
    int i;
    for (i = 0, buf[0] = 0; i < m->layer_count && len < size; ++i)
        len += (size_t)snprintf(buf + len, size - len, "%s%s", i ? "," : "", mgpu_layer_type(m->layers[i]));
}
static mgpu_result mgpu__model_save_here(const mgpu_model* m, const mgpu_optimizer* opt, const char* path, const mgpu_save_desc* desc) {
    static const char* op = "mgpu_model_save";
    mgpu__st_write_item* items = NULL;
    float* host = NULL;
    uint16_t* half = NULL;   /* the tensors in BF16 or F16, when desc asks */
    float* bhost = NULL;     /* the buffers (always F32, a count as I64) */
    int64_t* counts = NULL;
    char (*names)[512] = NULL;   /* (as a load names them, mgpu__load_name) */
    char step[32], dropout_step[32], layers_text[512];
    const char** keys = NULL;
    const char** values = NULL;
    const mgpu_metadata* user = desc ? desc->metadata : NULL;
    const int user_count = desc ? desc->metadata_count : 0;
    const mgpu_save_dtype dtype = desc ? desc->dtype : MGPU_SAVE_F32;
    int states = 0, n = 0, i, s, meta = 0;
    mgpu_result r = MGPU_OK;
    if (!m || !path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model or path", op);
    if (opt && opt->model != m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer belongs to another model", op);
    if (desc && desc->prefix && strlen(desc->prefix) > 24)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the prefix '%.40s' is %zu bytes; at most 24", op, desc->prefix,
                          strlen(desc->prefix));
    if (dtype != MGPU_SAVE_F32 && dtype != MGPU_SAVE_BF16 && dtype != MGPU_SAVE_F16)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: dtype %d (want MGPU_SAVE_F32, MGPU_SAVE_BF16 or MGPU_SAVE_F16)", op,
                          (int)dtype);
    if (user_count < 0 || user_count > INT32_MAX - MGPU__SAVE_META || (user_count > 0 && !user))
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: %d metadata entries at %p (want 0 or more, and the array)", op,
                          user_count, (const void*)user);
    for (i = 0; i < user_count; ++i) {
        const char* why = mgpu__user_meta_problem(user, i);
        if (why)
            return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: metadata entry %d ('%.40s'): %s", op, i,
                              user[i].key && mgpu__utf8_valid(user[i].key) ? user[i].key : "?", why);
    }
    states = opt ? mgpu__optimizer_state_count(opt) : 0;
    host = (float*)mgpu__calloc((size_t)m->flat_floats * (size_t)(1 + states) + 1, sizeof(float));
    items = (mgpu__st_write_item*)mgpu__calloc((size_t)m->tensor_count * (size_t)(1 + states) + (size_t)m->buffer_count + 1, sizeof *items);
    names = (char(*)[512])mgpu__calloc((size_t)m->tensor_count * (size_t)(1 + states) + (size_t)m->buffer_count + 1, sizeof *names);
    bhost = (float*)mgpu__calloc((size_t)m->buf_floats + 1, sizeof(float));
    counts = (int64_t*)mgpu__calloc((size_t)m->buf_floats + 1, sizeof(int64_t));
    keys = (const char**)mgpu__calloc((size_t)(MGPU__SAVE_META + user_count), sizeof *keys);
    values = (const char**)mgpu__calloc((size_t)(MGPU__SAVE_META + user_count), sizeof *values);
    if (!host || !items || !names || !keys || !values || !bhost || !counts) {
        r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        goto done;
    }
    for (i = 0; r == MGPU_OK && i < m->stage_count; ++i)   /* replica 0's buffers (every replica's are the same) */
        if (mgpu__stage_buf_floats(m, i) > 0)
            r = mgpu_tensor_download(m->part[i].bufs, bhost + m->stage_boff[i], (size_t)mgpu__stage_buf_floats(m, i) * sizeof(float));
    /* replica 0 holds the model, stage by stage; every replica is identical */
    for (s = 0; r == MGPU_OK && s <= states; ++s)
        for (i = 0; r == MGPU_OK && i < m->stage_count; ++i)
            if (mgpu__stage_floats(m, i) > 0)   /* a stage of layers without parameters has none */
                r = mgpu_tensor_download(s == 0 ? m->part[i].params : s == 1 ? opt->state1[i] : opt->state2[i],
                                     host + (size_t)m->flat_floats * (size_t)s + (size_t)m->stage_off[i],
                                     (size_t)mgpu__stage_floats(m, i) * sizeof(float));
    if (r != MGPU_OK) { mgpu__refail(op); goto done; }
    if (dtype != MGPU_SAVE_F32) {
        const size_t total = (size_t)m->flat_floats * (size_t)(1 + states);
        size_t k;
        half = (uint16_t*)mgpu__calloc(total + 1, sizeof *half);
        if (!half) { r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); goto done; }
        for (k = 0; k < total; ++k) half[k] = dtype == MGPU_SAVE_BF16 ? mgpu__float_to_bf16(host[k]) : mgpu__float_to_half(host[k]);
    }
    for (s = 0; s <= states; ++s)
        for (i = 0; i < m->tensor_count; ++i) {
            const mgpu__param* p = &m->tensors[i];
            if (p->tied >= 0) continue;   /* stored under its twin's name alone */
            mgpu__load_name(names[n], sizeof names[n], desc && desc->prefix ? desc->prefix : "", p->name,
                            s == 0 ? NULL : mgpu__optimizer_state_name(opt, s - 1));
            items[n].name = names[n];
            items[n].dtype = dtype == MGPU_SAVE_BF16 ? "BF16" : dtype == MGPU_SAVE_F16 ? "F16" : "F32";
            items[n].ndim = p->shape.ndim;
            items[n].shape = p->shape.dim;
            if (half) items[n].data = half + (size_t)m->flat_floats * (size_t)s + (size_t)p->offset;
            else items[n].data = host + (size_t)m->flat_floats * (size_t)s + (size_t)p->offset;
            items[n].bytes = (size_t)mgpu_shape_numel(p->shape) * (half ? sizeof *half : sizeof(float));
            ++n;
        }
    for (i = 0; i < m->buffer_count; ++i) {   /* after the parameters, in F32 whatever desc->dtype says */
        const mgpu__param* b = &m->buffers[i];
        const int count = mgpu__buffer_is_count(b->name);
        int64_t k;
        mgpu__load_name(names[n], sizeof names[n], desc && desc->prefix ? desc->prefix : "", b->name, NULL);
        items[n].name = names[n];
        items[n].dtype = count ? "I64" : "F32";
        items[n].ndim = b->shape.ndim;
        items[n].shape = b->shape.dim;
        if (count) {
            for (k = 0; k < mgpu_shape_numel(b->shape); ++k) counts[b->offset + k] = (int64_t)bhost[b->offset + k];
            items[n].data = counts + b->offset;
            items[n].bytes = (size_t)mgpu_shape_numel(b->shape) * sizeof(int64_t);
        } else {
            items[n].data = bhost + b->offset;
            items[n].bytes = (size_t)mgpu_shape_numel(b->shape) * sizeof(float);
        }
        ++n;
    }
    mgpu__layers_text(m, layers_text, sizeof layers_text);
    keys[meta] = "format"; values[meta++] = "pt";
    keys[meta] = "mgpu.version"; values[meta++] = MGPU_VERSION_STRING;
    keys[meta] = "mgpu.layers"; values[meta++] = layers_text;
    snprintf(dropout_step, sizeof dropout_step, "%llu", (unsigned long long)m->dropout_step);
    keys[meta] = "mgpu.dropout_step"; values[meta++] = dropout_step;   /* where the dropout masks' sequence is */
    if (opt) {
        snprintf(step, sizeof step, "%lld", (long long)opt->steps);
        keys[meta] = "mgpu.optimizer"; values[meta++] = opt->d.kind == MGPU_ADAMW ? "adamw" : "sgd";
        keys[meta] = "mgpu.step"; values[meta++] = step;
    }
    for (i = 0; i < user_count; ++i) { keys[meta] = user[i].key; values[meta++] = user[i].value; }
    r = mgpu__st_write(path, items, n, keys, values, meta);
    if (r != MGPU_OK) mgpu__refail(op);
done:
    MGPU_FREE(host);
    MGPU_FREE(half);
    MGPU_FREE(bhost);
    MGPU_FREE(counts);
    MGPU_FREE(items);
    MGPU_FREE(names);
    MGPU_FREE((void*)keys);
    MGPU_FREE((void*)values);
    return r;
}

MGPUDEF mgpu_result mgpu_model_save(const mgpu_model* m, const mgpu_optimizer* opt, const char* path) {
    return mgpu_model_save_ex(m, opt, path, NULL);
}


/* -- the public reader: a safetensors file as named tensors -- */
/* A file read whole and its header validated by mgpu__st_parse: the one way into a safetensors
   file, for mgpu_safetensors_open and for mgpu_model_load_ex. */
struct mgpu_safetensors {
    char* path;             /* for messages (owned by mgpu_safetensors_open's handles only) */
    uint8_t* file;
    size_t len;
    mgpu__st_file st;
};

static mgpu_result mgpu__st_load(const char* path, mgpu_safetensors* f) {
    mgpu_result r;
    memset(f, 0, sizeof *f);
    r = mgpu__read_file(path, &f->file, &f->len);
    if (r == MGPU_OK) r = mgpu__st_parse(f->file, f->len, path, &f->st);
    if (r != MGPU_OK) {
        MGPU_FREE(f->file);
        f->file = NULL;
    }
    return r;
}
static void mgpu__st_unload(mgpu_safetensors* f) {
    mgpu__st_free(&f->st);
    MGPU_FREE(f->file);
    f->file = NULL;
}
/* The bytes of entry e. */
static const uint8_t* mgpu__st_data(const mgpu_safetensors* f, const mgpu__st_tensor* e) {
    return f->file + f->st.data_start + e->begin;
}


/* IEEE half to float, exactly (every half is a float). */
static float mgpu__half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (uint32_t)(h >> 10) & 0x1F, mant = (uint32_t)h & 0x3FF, bits;
    if (exp == 0 && mant != 0) {   /* subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 0x1F) bits = sign | 0x7F800000u | (mant << 13);      /* infinities and NaNs */
    else if (exp == 0) bits = sign;                                 /* zeros */
    else bits = sign | ((exp + 112) << 23) | (mant << 13);          /* normal: rebias 15 -> 127 */
    return mgpu__f32_from_bits(bits);
}

/* n elements of a file dtype at src (little-endian, unaligned) to out, of mgpu__st_read_dtype's
   dtype; integers outside int32's range are an error naming the element. */
static mgpu_result mgpu__st_convert(const char* op, const char* path, const mgpu__st_tensor* e, const uint8_t* src, size_t n,
                                    void* out) {
    float* f = (float*)out;
    int32_t* q = (int32_t*)out;
    const char* dt = e->dtype;
    size_t i;
    if (!strcmp(dt, "F64"))
        for (i = 0; i < n; ++i) { double v; memcpy(&v, src + 8 * i, 8); f[i] = (float)v; }
    else if (!strcmp(dt, "F16"))
        for (i = 0; i < n; ++i) f[i] = mgpu__half_to_float((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
    else if (!strcmp(dt, "BF16"))
        for (i = 0; i < n; ++i) f[i] = mgpu__bf16_to_float((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
    else if (!strcmp(dt, "I64"))
        for (i = 0; i < n; ++i) {
            int64_t v;
            memcpy(&v, src + 8 * i, 8);
            if (v < INT32_MIN || v > INT32_MAX)
                return mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: '%s': tensor '%s' (I64) element %zu is %lld, outside int32's range",
                                  op, path, e->name, i, (long long)v);
            q[i] = (int32_t)v;
        }
    else if (!strcmp(dt, "I16"))
        for (i = 0; i < n; ++i) { int16_t v; memcpy(&v, src + 2 * i, 2); q[i] = v; }
    else if (!strcmp(dt, "I8"))
        for (i = 0; i < n; ++i) q[i] = (int8_t)src[i];
    else memcpy(out, src, n * mgpu__st_dtype_size(dt));   /* F32, I32, U8, BOOL: as stored */
    return MGPU_OK;
}

static void mgpu__safetensors_free(mgpu_safetensors* st);
MGPUDEF mgpu_safetensors* mgpu_safetensors_open(const char* path) {
    static const char* op = "mgpu_safetensors_open";
    mgpu_safetensors* st;
    if (!path) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL path", op); return NULL; }
    st = (mgpu_safetensors*)mgpu__calloc(1, sizeof *st);
    if (!st) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); return NULL; }
    if (mgpu__st_load(path, st) != MGPU_OK) {
        mgpu__refail(op);
        MGPU_FREE(st);
        return NULL;
    }
    st->path = (char*)MGPU_MALLOC(strlen(path) + 1);
    if (!st->path) {
        mgpu__safetensors_free(st);
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        return NULL;
    }
    memcpy(st->path, path, strlen(path) + 1);
    if (mgpu__live_add(st, MGPU__LIVE_SAFETENSORS, op) != MGPU_OK) { mgpu__safetensors_free(st); return NULL; }
    return st;
}

static void mgpu__safetensors_free(mgpu_safetensors* st) {
    if (!st) return;
    mgpu__live_remove(st, MGPU__LIVE_SAFETENSORS);
    mgpu__st_unload(st);
    MGPU_FREE(st->path);
    MGPU_FREE(st);
}
MGPUDEF void mgpu_safetensors_close(mgpu_safetensors* st) {
    if (!st || !mgpu__live_check(st, MGPU__LIVE_SAFETENSORS, "mgpu_safetensors_close", "safetensors file")) return;
    mgpu__safetensors_free(st);
}

MGPUDEF int mgpu_safetensors_count(const mgpu_safetensors* st) { return st ? st->st.count : 0; }

MGPUDEF mgpu_result mgpu_safetensors_get_info(const mgpu_safetensors* st, int i, mgpu_safetensors_info* info) {
    static const char* op = "mgpu_safetensors_get_info";
    const mgpu__st_tensor* e;
    int d;
    if (!st || !info) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL argument", op);
    if (i < 0 || i >= st->st.count)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: tensor %d of '%s', which has %d", op, i, st->path, st->st.count);
    e = &st->st.tensors[i];
    memset(info, 0, sizeof *info);
    info->name = e->name;
    info->dtype = e->dtype;
    info->ndim = e->ndim;
    for (d = 0; d < e->ndim && d < 8; ++d) info->shape[d] = (int64_t)e->shape[d];
    info->bytes = e->end - e->begin;
    info->readable = mgpu__st_dtypes[e->dt].readable;
    info->read_dtype = mgpu__st_dtypes[e->dt].read_as;
    return MGPU_OK;
}

static int mgpu__st_index(const char* op, const mgpu_safetensors* st, const char* name) {
    const mgpu__st_tensor* e;
    if (!st || !name) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL argument", op), -1;
    e = mgpu__st_find(&st->st, name);
    if (!e) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: '%s' has no tensor '%.256s'", op, st->path, name), -1;
    return (int)(e - st->st.tensors);
}
MGPUDEF int mgpu_safetensors_find(const mgpu_safetensors* st, const char* name) {
    return mgpu__st_index("mgpu_safetensors_find", st, name);
}

MGPUDEF mgpu_tensor* mgpu_safetensors_read(const mgpu_safetensors* st, const char* name, mgpu_device* dev) {
    static const char* op = "mgpu_safetensors_read";
    const mgpu__st_tensor* e;
    mgpu_shape shape;
    mgpu_dtype dt;
    mgpu_tensor* t;
    const uint8_t* src;
    void* host = NULL;
    size_t n = 1;
    int d, i = mgpu__st_index(op, st, name);
    if (i < 0) return NULL;
    e = &st->st.tensors[i];
    if (!mgpu__st_dtypes[e->dt].readable) {
        mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: '%s': tensor '%s' is %s, a dtype mgpu does not compute in (the file's other "
                   "tensors read)", op, st->path, name, e->dtype);
        return NULL;
    }
    if (e->ndim > MGPU_MAX_DIMS) {
        mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: '%s': tensor '%s' has %d dimensions; mgpu tensors have at most %d", op, st->path,
                   name, e->ndim, MGPU_MAX_DIMS);
        return NULL;
    }
    memset(&shape, 0, sizeof shape);
    shape.ndim = e->ndim;
    for (d = 0; d < e->ndim; ++d) shape.dim[d] = (int64_t)e->shape[d];
    for (d = 0; d < e->ndim; ++d) n *= (size_t)e->shape[d];   /* the parser checked the bytes are in the file */
    for (d = 0; d < e->ndim; ++d)
        if (e->shape[d] > (uint64_t)INT64_MAX) {   /* the format allows it next to a 0, mgpu's shapes do not */
            mgpu__fail(MGPU_ERROR_UNSUPPORTED, "%s: '%s': tensor '%s' has a dimension of 2^63 or more", op, st->path, name);
            return NULL;
        }
    dt = mgpu__st_dtypes[e->dt].read_as;
    t = mgpu_tensor_create(dev ? dev : mgpu_device_cpu(), dt, shape);
    if (!t) { mgpu__refail(op); return NULL; }
    src = mgpu__st_data(st, e);
    if (mgpu__st_dtype_size(e->dtype) != mgpu_dtype_size(dt)) {
        host = mgpu__calloc(n ? n : 1, mgpu_dtype_size(dt));
        if (!host) {
            mgpu_tensor_destroy(t);
            mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory converting '%s' (%s)", op, name, e->dtype);
            return NULL;
        }
        if (mgpu__st_convert(op, st->path, e, src, n, host) != MGPU_OK) {
            MGPU_FREE(host);
            mgpu_tensor_destroy(t);
            return NULL;
        }
        src = (const uint8_t*)host;
    }
    if (mgpu_tensor_upload(t, src, mgpu_tensor_bytes(t)) != MGPU_OK) {
        mgpu__refail(op);
        mgpu_tensor_destroy(t);
        t = NULL;
    }
    MGPU_FREE(host);
    return t;
}

MGPUDEF int mgpu_safetensors_metadata_count(const mgpu_safetensors* st) { return st ? st->st.meta_count : 0; }
MGPUDEF const char* mgpu_safetensors_metadata_key(const mgpu_safetensors* st, int i) {
    if (!st) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_metadata_key: NULL file"); return NULL; }
    if (i < 0 || i >= st->st.meta_count) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_metadata_key: entry %d of '%s', which has %d", i, st->path,
                   st->st.meta_count);
        return NULL;
    }
    return st->st.meta[i].key;
}
MGPUDEF const char* mgpu_safetensors_metadata(const mgpu_safetensors* st, const char* key) {
    const char* v;
    if (!st || !key) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_metadata: NULL argument"); return NULL; }
    v = mgpu__st_meta_value(&st->st, key);
    if (!v) mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_metadata: '%s' has no metadata key '%.128s'", st->path, key);
    return v;
}

/* The entry for a model tensor must be a float dtype (F32, or F64, F16, BF16 converted to it, as
   load_state_dict does) with exactly the model's shape. */
static mgpu_result mgpu__st_expect(const char* path, const mgpu__st_tensor* e, const char* name, mgpu_shape shape) {
    char want[96], got[96];
    mgpu_shape s;
    int i;
    if (!e) return mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' has no tensor '%s'", path, name);
    memset(&s, 0, sizeof s);
    s.ndim = MGPU__MIN(e->ndim, MGPU_MAX_DIMS);
    for (i = 0; i < s.ndim; ++i) s.dim[i] = (int64_t)e->shape[i];
    if (!mgpu__st_dtypes[e->dt].readable || mgpu__st_dtypes[e->dt].read_as != MGPU_F32)
        return mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s': tensor '%s' is %s, expected F32, F64, F16 or BF16", path, name, e->dtype);
    if (e->ndim != shape.ndim || !mgpu_shape_equal(s, shape))
        return mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "'%s': tensor '%s' has shape %s, the model's is %s", path, name,
                          mgpu__shape_text(s, got, sizeof got), mgpu__shape_text(shape, want, sizeof want));
    return MGPU_OK;
}

/* The file's name for a model parameter (prefix + param) or, with state, for its optimizer
   state (the checkpoint's name for the state of prefix + param). Prefixes are at most 256 bytes
   and parameter names 63: every name fits buf's 512. */

/* The error for model tensor `want` missing from the file, with a hint when the file holds the
   whole model under a prefix (a PyTorch module's "model.0.weight" for "0.weight"). */
static mgpu_result mgpu__load_missing(const char* path, const mgpu_model* m, const mgpu__st_file* st, const char* want,
                                      const char* param) {
    char name[512];
    size_t n = strlen(param);
    int i, t, all;
    for (i = 0; i < st->count; ++i) {
        const char* cand = st->tensors[i].name;
        size_t k = strlen(cand);
        if (k <= n || cand[k - n - 1] != '.' || strcmp(cand + k - n, param) != 0 || k - n > 256) continue;
        for (t = 0, all = 1; t < m->tensor_count && all; ++t) {   /* does the prefix hold every model tensor? */
            snprintf(name, sizeof name, "%.*s%s", (int)(k - n), cand, m->tensors[t].name);
            all = mgpu__st_find(st, name) != NULL;
        }
        if (all)
            return mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' has no tensor '%s' (it has '%s': set mgpu_load_desc.prefix to '%.*s')",
                              path, want, cand, (int)(k - n), cand);
    }
    return mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' has no tensor '%s'", path, want);
}

static mgpu_result mgpu__model_load_here(mgpu_model* m, mgpu_optimizer* opt, const char* path, const mgpu_load_desc* desc);
/* A load that worked sets every replica's parameters and buffers (a file lacking a model
   tensor is refused): it clears the mark, unless the optimizer's states may differ and it was
   not given them. */
static void mgpu__suspect_loaded(mgpu_model* m, const mgpu_optimizer* opt) {
    if (!m->suspect || (!opt && (m->suspect_flags & MGPU__SUSPECT_STATES))) return;
    m->suspect = NULL;
    m->suspect_flags = 0;
}
/* A distributed model: every rank reads the file, and fails if any rank could not. */
MGPUDEF mgpu_result mgpu_model_load_ex(mgpu_model* m, mgpu_optimizer* opt, const char* path, const mgpu_load_desc* desc) {
    mgpu_result r = mgpu__model_load_here(m, opt, path, desc);
    if (!m || !m->dist) {
        if (r == MGPU_OK) mgpu__suspect_loaded(m, opt);
        return r;
    }
    mgpu__dist_doing("mgpu_model_load", 0);
    r = mgpu__dist_agree(r, 0, 0.0, NULL, NULL);
    /* some ranks may have loaded while others failed: steps refuse until a load works everywhere */
    if (r != MGPU_OK) mgpu__suspect_mark(m, "a load that failed on a rank", MGPU__SUSPECT_LOAD_ONLY | MGPU__SUSPECT_STATES);
    else mgpu__suspect_loaded(m, opt);
    return r;
}

/* The layer list a checkpoint records ("mgpu.layers", written by mgpu_model_save) against the
   model's: a different architecture whose tensors happen to have the same names and shapes
   (ReLU for Tanh) would load without a word. Files without the key (PyTorch's, Hugging Face's,
   older mgpu's) are not checked. */
static mgpu_result mgpu__load_check_layers(const char* path, const mgpu_model* m, const mgpu__st_file* st) {
    const char* file = mgpu__st_meta_value(st, "mgpu.layers");
    char mine[512], a[160], b[160];
    const char *p, *q;
    size_t np = 0, nq = 0;
    int k;
    if (!file) return MGPU_OK;
    mgpu__layers_text(m, mine, sizeof mine);
    if (!strcmp(file, mine)) return MGPU_OK;
    for (k = 0, p = file, q = mine;; ++k) {   /* the first layer that differs ("none": one list ended) */
        np = strcspn(p, ",");
        nq = strcspn(q, ",");
        if (np != nq || strncmp(p, q, np) != 0 || (!p[np] && !q[nq])) break;   /* (the last: "a," against "a") */
        p += np;
        q += nq;
        if (*p) ++p;
        if (*q) ++q;
    }
    return mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' was saved from a model of layers %s, this model's are %s (layer %d: %.*s there, %.*s here); "
                      "mgpu_load_desc.weights_only loads its tensors anyway", path, mgpu__text_middle(file, a, sizeof a),
                      mgpu__text_middle(mine, b, sizeof b), k, np ? (int)MGPU__MIN(np, 64) : 4, np ? p : "none",
                      nq ? (int)MGPU__MIN(nq, 64) : 4, nq ? q : "none");
}

static mgpu_result mgpu__model_load_here(mgpu_model* m, mgpu_optimizer* opt, const char* path, const mgpu_load_desc* desc) {
    static const char* op = "mgpu_model_load";
    mgpu_safetensors sf;
    mgpu__st_file* st = &sf.st;
    float* host = NULL;
    char name[512];
    const char* prefix;
    int states, found_states = 0, stored = 0, i, s, allow_extra;
    int64_t step = 0;
    const char* dropout_text = NULL;
    unsigned long long dropout_step = 0;
    mgpu_result r;
    memset(&sf, 0, sizeof sf);
    if (!m || !path) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: NULL model or path", op);
    if (opt && opt->model != m) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the optimizer belongs to another model", op);
    /* defaults, all in one place: no prefix, strict */
    prefix = desc && desc->prefix ? desc->prefix : "";
    allow_extra = desc ? desc->allow_extra : 0;
    if (strlen(prefix) > 256)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "%s: the prefix '%.40s...' is %zu bytes; at most 256", op, prefix, strlen(prefix));
    states = opt ? mgpu__optimizer_state_count(opt) : 0;
    r = mgpu__st_load(path, &sf);
    if (r != MGPU_OK) goto done;
    /* check everything before changing anything: a failed load leaves the model as it was */
    if (!(desc && desc->weights_only) && (r = mgpu__load_check_layers(path, m, st)) != MGPU_OK) goto done;
    for (i = 0; i < m->tensor_count && r == MGPU_OK; ++i) {
        const mgpu__st_tensor* e;
        if (m->tensors[i].tied >= 0) continue;   /* its twin's (a file may hold it too: PyTorch's state_dict does) */
        mgpu__load_name(name, sizeof name, prefix, m->tensors[i].name, NULL);
        e = mgpu__st_find(st, name);
        r = e ? mgpu__st_expect(path, e, name, m->tensors[i].shape) : mgpu__load_missing(path, m, st, name, m->tensors[i].name);
    }
    for (i = 0; i < m->buffer_count && r == MGPU_OK; ++i) {   /* buffers: a float dtype, or an integer for a count */
        const mgpu__st_tensor* e;
        mgpu__load_name(name, sizeof name, prefix, m->buffers[i].name, NULL);
        e = mgpu__st_find(st, name);
        if (!e) r = mgpu__load_missing(path, m, st, name, m->buffers[i].name);
        else if (!strcmp(e->dtype, "I64") || !strcmp(e->dtype, "I32")) {
            mgpu_shape fs;
            int d;
            char got[96], want[96];
            memset(&fs, 0, sizeof fs);
            fs.ndim = MGPU__MIN(e->ndim, MGPU_MAX_DIMS);
            for (d = 0; d < fs.ndim; ++d) fs.dim[d] = (int64_t)e->shape[d];
            if (e->ndim != m->buffers[i].shape.ndim || !mgpu_shape_equal(fs, m->buffers[i].shape))
                r = mgpu__fail(MGPU_ERROR_SHAPE_MISMATCH, "'%s': tensor '%s' has shape %s, the model's is %s", path, name,
                               mgpu__shape_text(fs, got, sizeof got), mgpu__shape_text(m->buffers[i].shape, want, sizeof want));
        } else r = mgpu__st_expect(path, e, name, m->buffers[i].shape);
    }
    mgpu__load_name(name, sizeof name, prefix, m->tensor_count ? m->tensors[0].name : "", NULL);   /* for the message */
    for (i = 0; r == MGPU_OK && !allow_extra && i < st->count; ++i) {   /* strict, like load_state_dict */
        const char* fname = st->tensors[i].name;
        const size_t plen = strlen(prefix);
        int known = 0, t;
        for (t = 0; t < m->tensor_count && !known; ++t) known = !strncmp(fname, prefix, plen) && !strcmp(fname + plen, m->tensors[t].name);
        for (t = 0; t < m->buffer_count && !known; ++t) known = !strncmp(fname, prefix, plen) && !strcmp(fname + plen, m->buffers[t].name);
        if (!known && strncmp(fname, MGPU__OPT_PREFIX, strlen(MGPU__OPT_PREFIX)) != 0)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s': unexpected tensor '%s' (the model has %d tensors, '%s' ... ; "
                           "mgpu_load_desc.allow_extra ignores the others)", path, st->tensors[i].name, m->tensor_count, name);
    }
    /* The optimizer: its kind must match the file's, and its step count and state come from the
       file when the file has them. A PyTorch state_dict has neither: the optimizer starts fresh. */
    if (r == MGPU_OK && opt) {
        const char* kind = mgpu__st_meta_value(st, "mgpu.optimizer");
        const char* steps = mgpu__st_meta_value(st, "mgpu.step");
        const char* mine = opt->d.kind == MGPU_ADAMW ? "adamw" : "sgd";
        char* end = NULL;
        for (s = 0; s < states; ++s)
            for (i = 0; i < m->tensor_count; ++i) {
                if (m->tensors[i].tied >= 0) continue;
                stored += s == 0;
                mgpu__load_name(name, sizeof name, prefix, m->tensors[i].name, mgpu__optimizer_state_name(opt, s));
                found_states += mgpu__st_find(st, name) != NULL;
            }
        if (kind && strcmp(kind, mine) != 0)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' holds %s optimizer state; the optimizer is %s", path, kind, mine);
        else if (steps && (steps[0] < '0' || steps[0] > '9' || (errno = 0, step = strtoll(steps, &end, 10)) < 0 ||
                           errno == ERANGE || !end || *end || step > MGPU__MAX_STEPS))
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s': 'mgpu.step' in the metadata is '%.40s', not a step count from 0 to 2^53", path,
                           steps);
        else if (found_states && found_states != states * stored)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' holds %d of the %d optimizer state tensors", path, found_states,
                           states * stored);
        else if (found_states && !steps)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s': optimizer state without 'mgpu.step' in the metadata", path);
        for (s = 0; r == MGPU_OK && found_states && s < states; ++s)
            for (i = 0; r == MGPU_OK && i < m->tensor_count; ++i) {
                if (m->tensors[i].tied >= 0) continue;
                mgpu__load_name(name, sizeof name, prefix, m->tensors[i].name, mgpu__optimizer_state_name(opt, s));
                r = mgpu__st_expect(path, mgpu__st_find(st, name), name, m->tensors[i].shape);
            }
        if (r == MGPU_OK && states && !found_states)
            mgpu__log(MGPU_LOG_WARN, "'%s' has no optimizer state: the optimizer's %s start from zero", path,
                      mgpu__optimizer_state_name(opt, 0));
    }
    if (r == MGPU_OK && (dropout_text = mgpu__st_meta_value(st, "mgpu.dropout_step")) != NULL) {
        char* end = NULL;
        dropout_step = strtoull(dropout_text, &end, 10);
        if (!end || *end || end == dropout_text)
            r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s': 'mgpu.dropout_step' in the metadata is '%s', not a count", path, dropout_text);
    }
    if (r != MGPU_OK) goto done;
    /* assemble the flat buffers on the host, then upload to every replica */
    host = (float*)mgpu__calloc((size_t)m->flat_floats + 1, sizeof(float));
    if (!host) { r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op); goto done; }
    for (s = 0; s <= (found_states ? states : 0) && r == MGPU_OK; ++s) {
        memset(host, 0, (size_t)m->flat_floats * sizeof(float));
        for (i = 0; i < m->tensor_count; ++i) {
            const mgpu__st_tensor* e;
            if (m->tensors[i].tied >= 0) continue;
            mgpu__load_name(name, sizeof name, prefix, m->tensors[i].name, s == 0 ? NULL : mgpu__optimizer_state_name(opt, s - 1));
            e = mgpu__st_find(st, name);
            if (strcmp(e->dtype, "F32") == 0) memcpy(host + m->tensors[i].offset, mgpu__st_data(&sf, e), (size_t)(e->end - e->begin));
            else mgpu__st_convert(op, path, e, mgpu__st_data(&sf, e), (size_t)mgpu_shape_numel(m->tensors[i].shape),
                                  host + m->tensors[i].offset);   /* float dtypes: cannot fail */
        }
        for (i = 0; s == 0 && i < m->tensor_count; ++i)   /* a tied parameter: its twin's copy */
            if (m->tensors[i].tied >= 0)
                memcpy(host + m->tensors[i].offset, host + m->tensors[m->tensors[i].tied].offset,
                       (size_t)mgpu_shape_numel(m->tensors[i].shape) * sizeof(float));
        for (i = 0; i < m->part_count && r == MGPU_OK; ++i)
            if (mgpu__stage_floats(m, m->part[i].stage) > 0)
                r = mgpu_tensor_upload(s == 0 ? m->part[i].params : s == 1 ? opt->state1[i] : opt->state2[i],
                                   host + m->stage_off[m->part[i].stage], (size_t)mgpu__stage_floats(m, m->part[i].stage) * sizeof(float));
    }
    if (r == MGPU_OK && m->buffer_count > 0) {   /* the buffers, into every replica */
        float* bhost = (float*)mgpu__calloc((size_t)m->buf_floats + 1, sizeof(float));
        if (!bhost) r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        for (i = 0; bhost && i < m->buffer_count; ++i) {
            const mgpu__st_tensor* e;
            const int64_t count = mgpu_shape_numel(m->buffers[i].shape);
            const uint8_t* src;
            int64_t k;
            mgpu__load_name(name, sizeof name, prefix, m->buffers[i].name, NULL);
            e = mgpu__st_find(st, name);
            src = mgpu__st_data(&sf, e);
            if (!strcmp(e->dtype, "I64"))
                for (k = 0; k < count; ++k) { int64_t v; memcpy(&v, src + 8 * k, 8); bhost[m->buffers[i].offset + k] = (float)v; }
            else if (!strcmp(e->dtype, "I32"))
                for (k = 0; k < count; ++k) { int32_t v; memcpy(&v, src + 4 * k, 4); bhost[m->buffers[i].offset + k] = (float)v; }
            else (void)mgpu__st_convert(op, path, e, src, (size_t)count, bhost + m->buffers[i].offset);   /* float dtypes: cannot fail */
        }
        for (i = 0; bhost && i < m->part_count && r == MGPU_OK; ++i)
            if (m->part[i].bufs)
                r = mgpu_tensor_upload(m->part[i].bufs, bhost + m->stage_boff[m->part[i].stage],
                                       (size_t)mgpu__stage_buf_floats(m, m->part[i].stage) * sizeof(float));
        MGPU_FREE(bhost);
    }
    if (r == MGPU_OK && opt) {
        opt->steps = step;   /* schedules and bias corrections resume where they were */
        m->steps = step;
        for (i = 0; !found_states && i < m->part_count && r == MGPU_OK; ++i) {   /* fresh state */
            if (opt->state1[i]) r = mgpu_tensor_zero(opt->state1[i]);
            if (r == MGPU_OK && opt->state2[i]) r = mgpu_tensor_zero(opt->state2[i]);
        }
    }
    if (r == MGPU_OK && dropout_text) {   /* dropout masks continue their sequence */
        m->dropout_step = dropout_step;
        m->rows_in_step = 0;
    }
done:
    if (r != MGPU_OK) mgpu__refail(op);
    mgpu__st_unload(&sf);
    MGPU_FREE(host);
    return r;
}

MGPUDEF mgpu_result mgpu_model_load(mgpu_model* m, mgpu_optimizer* opt, const char* path) {
    return mgpu_model_load_ex(m, opt, path, NULL);
}

/* -- token files (llm.c's format) and the byte-level tokenizer -- */
struct mgpu_tokens {
    uint8_t* mem;      /* the memory data lies in: a loaded file whole (header included), or the tokens */
    uint16_t* data;    /* count tokens, host byte order */
    int64_t count;
    int max_id;
    int datasets;      /* data sets reading it (mgpu_tokens_destroy refuses while any) */
};

static int mgpu__host_little_endian(void) {
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* Makes the tokens object around mem (taken: freed on failure too), data = count tokens in it
   already in host order, and finds the largest id. */
static mgpu_tokens* mgpu__tokens_wrap(uint8_t* mem, uint16_t* data, int64_t count, const char* op) {
    mgpu_tokens* t = (mgpu_tokens*)mgpu__calloc(1, sizeof *t);
    uint16_t top = 0;
    int64_t i;
    if (!t) {
        MGPU_FREE(mem);
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "%s: out of host memory", op);
        return NULL;
    }
    for (i = 0; i < count; ++i) top = data[i] > top ? data[i] : top;
    t->mem = mem;
    t->data = data;
    t->count = count;
    t->max_id = top;
    return t;
}

MGPUDEF mgpu_tokens* mgpu_tokens_load(const char* path) {
    uint8_t* file = NULL;
    size_t len = 0;
    int32_t magic, version, count;
    uint64_t want;
    uint16_t* data;
    if (!path) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_load: NULL path"); return NULL; }
    if (mgpu__read_file(path, &file, &len) != MGPU_OK) { mgpu__refail("mgpu_tokens_load"); return NULL; }
    if (len < MGPU_TOKENS_HEADER_BYTES) {
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_load: '%s' is %zu bytes, shorter than the %d-byte header of a token file (llm.c's format)",
                   path, len, MGPU_TOKENS_HEADER_BYTES);
        MGPU_FREE(file);
        return NULL;
    }
    magic = (int32_t)mgpu__le32(file);
    version = (int32_t)mgpu__le32(file + 4);
    count = (int32_t)mgpu__le32(file + 8);
    want = MGPU_TOKENS_HEADER_BYTES + 2 * (uint64_t)(count < 0 ? 0 : count);
    if (magic != MGPU_TOKENS_MAGIC)
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_load: '%s' has magic %ld, expected %d: %s", path, (long)magic, MGPU_TOKENS_MAGIC,
                   magic == 20240801 ? "this is llm.c's Llama 3 file (uint32 tokens), which mgpu does not read"
                                     : "not a token file of llm.c's format");
    else if (version != MGPU_TOKENS_VERSION)
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_load: '%s' has version %ld, expected %d (uint16 tokens)", path, (long)version,
                   MGPU_TOKENS_VERSION);
    else if (count < 0)
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_load: '%s': its header's token count is %ld", path, (long)count);
    else if ((uint64_t)len < want)
        mgpu__fail(MGPU_ERROR_BAD_FILE,
                   "mgpu_tokens_load: '%s' is truncated: its header says %ld tokens (%llu bytes in all), the file has %zu bytes (%llu tokens%s)",
                   path, (long)count, (unsigned long long)want, len, (unsigned long long)((len - MGPU_TOKENS_HEADER_BYTES) / 2),
                   (len - MGPU_TOKENS_HEADER_BYTES) % 2 ? " and a byte" : "");
    else if ((uint64_t)len > want)
        mgpu__fail(MGPU_ERROR_BAD_FILE,
                   "mgpu_tokens_load: '%s' has %llu bytes past its last token: its header says %ld tokens (%llu bytes in all), the file has %zu bytes",
                   path, (unsigned long long)((uint64_t)len - want), (long)count, (unsigned long long)want, len);
    else if (count == 0)
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_load: '%s' is empty: its header says 0 tokens", path);
    else {
        data = (uint16_t*)(void*)(file + MGPU_TOKENS_HEADER_BYTES);   /* 2-aligned: the allocation's start + 1024 */
        if (!mgpu__host_little_endian()) {   /* the file is little-endian whatever the host */
            int64_t i;
            for (i = 0; i < count; ++i) {
                const uint8_t* b = file + MGPU_TOKENS_HEADER_BYTES + 2 * i;
                data[i] = (uint16_t)(b[0] | (b[1] << 8));
            }
        }
        return mgpu__tokens_wrap(file, data, count, "mgpu_tokens_load");
    }
    MGPU_FREE(file);
    return NULL;
}

MGPUDEF mgpu_tokens* mgpu_tokens_from_text(const char* path) {
    uint8_t* file = NULL;
    uint16_t* data;
    size_t len = 0, i;
    if (!path) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_from_text: NULL path"); return NULL; }
    if (mgpu__read_file(path, &file, &len) != MGPU_OK) { mgpu__refail("mgpu_tokens_from_text"); return NULL; }
    if (len == 0) {
        MGPU_FREE(file);
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_tokens_from_text: '%s' is empty: no tokens", path);
        return NULL;
    }
    data = len <= SIZE_MAX / sizeof(uint16_t) ? (uint16_t*)MGPU_MALLOC(len * sizeof(uint16_t)) : NULL;
    if (!data) {
        MGPU_FREE(file);
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_tokens_from_text: '%s': no memory for %zu tokens", path, len);
        return NULL;
    }
    for (i = 0; i < len; ++i) data[i] = file[i];   /* the byte-level tokenizer: token = byte */
    MGPU_FREE(file);
    return mgpu__tokens_wrap((uint8_t*)data, data, (int64_t)len, "mgpu_tokens_from_text");
}

MGPUDEF mgpu_tokens* mgpu_tokens_from_memory(const uint16_t* tokens, int64_t count) {
    uint16_t* data;
    if (!tokens || count <= 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_from_memory: %lld tokens%s (at least 1)", (long long)count,
                   tokens ? "" : " at NULL");
        return NULL;
    }
    data = (uint64_t)count <= SIZE_MAX / sizeof(uint16_t) ? (uint16_t*)MGPU_MALLOC((size_t)count * sizeof(uint16_t)) : NULL;
    if (!data) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_tokens_from_memory: no memory for %lld tokens", (long long)count); return NULL; }
    memcpy(data, tokens, (size_t)count * sizeof(uint16_t));
    return mgpu__tokens_wrap((uint8_t*)data, data, count, "mgpu_tokens_from_memory");
}

/* The file's contents: the header, then the tokens little-endian (through a small buffer on a
   big-endian host). */
static int mgpu__tokens_write_body(FILE* f, const void* user) {
    const mgpu_tokens* t = (const mgpu_tokens*)user;
    uint8_t head[MGPU_TOKENS_HEADER_BYTES], buf[4096];
    const uint32_t fields[3] = { MGPU_TOKENS_MAGIC, MGPU_TOKENS_VERSION, (uint32_t)t->count };
    int64_t i = 0;
    int k;
    memset(head, 0, sizeof head);
    for (k = 0; k < 12; ++k) head[k] = (uint8_t)(fields[k / 4] >> (8 * (k % 4)));
    if (fwrite(head, 1, sizeof head, f) != sizeof head) return 1;
    if (mgpu__host_little_endian())
        return fwrite(t->data, sizeof(uint16_t), (size_t)t->count, f) != (size_t)t->count;
    while (i < t->count) {
        size_t n = (size_t)MGPU__MIN(t->count - i, (int64_t)sizeof buf / 2), j;
        for (j = 0; j < n; ++j) {
            buf[2 * j] = (uint8_t)t->data[i + (int64_t)j];
            buf[2 * j + 1] = (uint8_t)(t->data[i + (int64_t)j] >> 8);
        }
        if (fwrite(buf, 2, n, f) != n) return 1;
        i += (int64_t)n;
    }
    return 0;
}

MGPUDEF mgpu_result mgpu_tokens_save(const mgpu_tokens* t, const char* path) {
    if (!t || !path || !*path)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_save: %s", !t ? "NULL tokens" : "no path");
    if (t->count > INT32_MAX)
        return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT,
                          "mgpu_tokens_save(%s): %lld tokens, more than the header's int32 count holds (%d): split them into shards", path, (long long)t->count, INT32_MAX);
    if (mgpu__write_atomic(path, "a token file", 1, mgpu__tokens_write_body, t) != MGPU_OK) return mgpu__refail("mgpu_tokens_save");
    return MGPU_OK;
}

MGPUDEF int64_t mgpu_tokens_count(const mgpu_tokens* t) { return t ? t->count : 0; }
MGPUDEF const uint16_t* mgpu_tokens_data(const mgpu_tokens* t) { return t ? t->data : NULL; }
MGPUDEF int mgpu_tokens_max_id(const mgpu_tokens* t) { return t ? t->max_id : -1; }

MGPUDEF mgpu_result mgpu_tokens_destroy(mgpu_tokens* t) {
    if (!t) return MGPU_OK;
    if (t->datasets)
        return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_tokens_destroy: %d data set%s still read%s these tokens; destroy %s first",
                          t->datasets, t->datasets == 1 ? "" : "s", t->datasets == 1 ? "s" : "", t->datasets == 1 ? "it" : "them");
    MGPU_FREE(t->mem);
    MGPU_FREE(t);
    return MGPU_OK;
}

MGPUDEF size_t mgpu_tokens_to_text(const int32_t* ids, int64_t n, char* out, size_t size) {
    size_t need = 0, used = 0;   /* the whole text's length; what out holds */
    int full = 0;                /* a piece did not fit: out stays a prefix of the text */
    int64_t i = 0;
    if (!ids) n = 0;
    while (i < n) {
        char piece[16];
        uint8_t bytes[4];
        int len = 0, k, take = 1;
        for (k = 0; k < 4 && i + k < n && ids[i + k] >= 0 && ids[i + k] <= 255; ++k) bytes[k] = (uint8_t)ids[i + k];
        if (ids[i] < 0 || ids[i] > 255) len = snprintf(piece, sizeof piece, "<%ld>", (long)ids[i]);
        else if (bytes[0] >= 0x80 && (take = mgpu__utf8_len(bytes, (size_t)k)) >= 2) {   /* a whole UTF-8 character */
            memcpy(piece, bytes, (size_t)take);
            len = take;
        } else if (bytes[0] == '\\') len = snprintf(piece, sizeof piece, "\\\\");
        else if (bytes[0] == '\n' || bytes[0] == '\t' || (bytes[0] >= 0x20 && bytes[0] < 0x7F)) piece[len++] = (char)bytes[0];
        else len = snprintf(piece, sizeof piece, "\\x%02X", bytes[0]);
        if (take < 1) take = 1;
        i += take;
        need += (size_t)len;
        if (!full && used + (size_t)len < size) {
            memcpy(out + used, piece, (size_t)len);
            used += (size_t)len;
        } else full = 1;
    }
    if (size) out[used] = 0;
    return need;
}

/* -- IDX data sets -- */
static mgpu_result mgpu__load_idx(const char* path, int want_ndim, uint8_t** out, mgpu__idx* idx) {
    uint8_t *file = NULL, *raw = NULL;
    size_t len = 0, raw_len = 0;
    mgpu_result r = mgpu__read_file(path, &file, &len);
    *out = NULL;
    if (r == MGPU_OK) r = mgpu__gunzip(file, len, path, &raw, &raw_len);
    MGPU_FREE(file);
    if (r == MGPU_OK) r = mgpu__idx_parse(raw, raw_len, path, idx);
    if (r == MGPU_OK && idx->ndim != want_ndim)
        r = mgpu__fail(MGPU_ERROR_BAD_FILE, "'%s' has %d dimensions, expected %d (%s)", path, idx->ndim, want_ndim,
                       want_ndim == 3 ? "images: count, rows, cols" : "labels: count");
    if (r == MGPU_OK) {   /* keep just the data */
        *out = (uint8_t*)MGPU_MALLOC(idx->data_bytes ? idx->data_bytes : 1);
        if (!*out) r = mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "'%s': out of host memory", path);
        else memcpy(*out, idx->data, idx->data_bytes);
        idx->data = *out;
    }
    MGPU_FREE(raw);
    return r;
}

static void mgpu__dataset_free(mgpu_dataset* ds) {
    if (!ds) return;
    if (ds->tokens) ((mgpu_tokens*)ds->tokens)->datasets--;   /* the library's count in the caller's const tokens */
    MGPU_FREE(ds->images);
    MGPU_FREE(ds->labels);
    MGPU_FREE(ds);
}
MGPUDEF mgpu_result mgpu_dataset_destroy(mgpu_dataset* ds) {
    if (!ds) return MGPU_OK;
    if (ds->loaders)
        return mgpu__fail(MGPU_ERROR_IN_USE, "mgpu_dataset_destroy: %d loader%s still read%s this data set; destroy %s first",
                          ds->loaders, ds->loaders == 1 ? "" : "s", ds->loaders == 1 ? "s" : "", ds->loaders == 1 ? "it" : "them");
    mgpu__dataset_free(ds);
    return MGPU_OK;
}

MGPUDEF mgpu_dataset* mgpu_dataset_load_idx(const char* images_path, const char* labels_path) {
    mgpu__idx im, lb;
    mgpu_dataset* ds = (mgpu_dataset*)mgpu__calloc(1, sizeof *ds);
    if (!ds) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_dataset_load_idx: out of host memory"); return NULL; }
    if (mgpu__load_idx(images_path, 3, &ds->images, &im) != MGPU_OK || mgpu__load_idx(labels_path, 1, &ds->labels, &lb) != MGPU_OK) {
        mgpu__refail("mgpu_dataset_load_idx");
        mgpu__dataset_free(ds);
        return NULL;
    }
    if (im.dims[0] != lb.dims[0]) {
        mgpu__fail(MGPU_ERROR_BAD_FILE, "mgpu_dataset_load_idx: '%s' has %lld images but '%s' has %lld labels", images_path,
                   (long long)im.dims[0], labels_path, (long long)lb.dims[0]);
        mgpu__dataset_free(ds);
        return NULL;
    }
    ds->count = im.dims[0];
    ds->rows = (int)im.dims[1];
    ds->cols = (int)im.dims[2];
    return ds;
}

MGPUDEF mgpu_dataset* mgpu_dataset_tokens(const mgpu_tokens* t, int seq) {
    mgpu_dataset* ds;
    if (!t) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_dataset_tokens: NULL tokens"); return NULL; }
    if (seq < 1) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_dataset_tokens: seq %d (the window length T must be at least 1)", seq);
        return NULL;
    }
    if ((t->count - 1) / seq == 0) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_dataset_tokens: N = %lld tokens make no window of T = %d (one needs T + 1 = %lld: "
                   "x and the token after it for y)", (long long)t->count, seq, (long long)seq + 1);
        return NULL;
    }
    ds = (mgpu_dataset*)mgpu__calloc(1, sizeof *ds);
    if (!ds) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_dataset_tokens: out of host memory"); return NULL; }
    ds->count = (t->count - 1) / seq;   /* W: the window after the last whole one lacks its last target */
    ds->tokens = t;
    ds->seq = seq;
    ((mgpu_tokens*)t)->datasets++;
    return ds;
}

/* -- the batch loader -- */
struct mgpu_loader {
    const mgpu_dataset* ds;     /* counted in ds->loaders while the loader lives (LIFETIMES) */
    mgpu_loader_desc d;
    int64_t* order;
    int64_t pos;
    void* x_pinned;      /* float (images) or int32_t (tokens) */
    int32_t* y_pinned;
    mgpu__storage x_storage, y_storage;   /* the pinned buffers seen as CPU tensors */
    mgpu_tensor x, y;
};

static void mgpu__loader_free(mgpu_loader* l) {
    if (!l) return;
    mgpu__live_remove(l, MGPU__LIVE_LOADER);
    if (l->ds) ((mgpu_dataset*)l->ds)->loaders--;   /* the library's field of the caller's const data set */
    MGPU_FREE(l->order);
    mgpu_pinned_free(l->x_pinned);
    mgpu_pinned_free(l->y_pinned);
    MGPU_FREE(l);
}
MGPUDEF void mgpu_loader_destroy(mgpu_loader* l) {
    if (!l || !mgpu__live_check(l, MGPU__LIVE_LOADER, "mgpu_loader_destroy", "loader")) return;
    mgpu__loader_free(l);
}

MGPUDEF mgpu_loader* mgpu_loader_create(const mgpu_dataset* ds, const mgpu_loader_desc* desc) {
    mgpu_loader* l;
    size_t pixels, y_per;   /* x and y values per sample */
    if (!ds || ds->count <= 0) { mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_loader_create: empty or NULL data set"); return NULL; }
    if (ds->tokens && (ds->seq < 1 || ds->count > (ds->tokens->count - 1) / ds->seq)) {   /* (a data set filled by hand) */
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_loader_create: a token data set of %lld windows of seq %d, but its %lld tokens make %lld",
                   (long long)ds->count, ds->seq, (long long)ds->tokens->count, ds->seq < 1 ? 0ll : (long long)((ds->tokens->count - 1) / ds->seq));
        return NULL;
    }
    if (ds->tokens && desc && (desc->mean != 0.0f || desc->std != 0.0f)) {
        mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_loader_create: mean %g and std %g normalise pixels; a token data set has none "
                   "(leave both 0: its batches are the tokens as they are)", (double)desc->mean, (double)desc->std);
        return NULL;
    }
    l = (mgpu_loader*)mgpu__calloc(1, sizeof *l);
    if (!l) { mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_loader_create: out of host memory"); return NULL; }
    if (desc) l->d = *desc;
    l->d.batch = MGPU__DEF(l->d.batch, 64);
    l->d.std = MGPU__DEF(l->d.std, 1.0f);
    if (l->d.batch < 0 || (l->d.wrap && l->d.drop_last)) {
        if (l->d.batch < 0) mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_loader_create: batch %d", l->d.batch);
        else mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "mgpu_loader_create: wrap and drop_last both set: a last, smaller batch is "
                        "either completed (wrap) or skipped (drop_last), choose one");
        mgpu__loader_free(l);
        return NULL;
    }
    l->ds = ds;
    ((mgpu_dataset*)ds)->loaders++;
    pixels = ds->tokens ? (size_t)ds->seq : (size_t)ds->rows * (size_t)ds->cols;
    y_per = ds->tokens ? (size_t)ds->seq : 1;
    l->order = (int64_t*)MGPU_MALLOC((size_t)ds->count * sizeof(int64_t));
    l->x_pinned = mgpu_pinned_alloc((size_t)l->d.batch * pixels * (ds->tokens ? sizeof(int32_t) : sizeof(float)));
    l->y_pinned = (int32_t*)mgpu_pinned_alloc((size_t)l->d.batch * y_per * sizeof(int32_t));
    if (!l->order || !l->x_pinned || !l->y_pinned) {
        mgpu__fail(MGPU_ERROR_OUT_OF_MEMORY, "mgpu_loader_create: out of host memory for batches of %d", l->d.batch);
        mgpu__loader_free(l);
        return NULL;
    }
    l->x_storage.dev = l->y_storage.dev = mgpu_device_cpu();
    l->x_storage.ptr = l->x_pinned;
    l->y_storage.ptr = l->y_pinned;
    l->x_storage.refs = l->y_storage.refs = 1;   /* never released: the loader frees the memory */
    l->x.owned = l->y.owned = 1;   /* the loader's own headers, inside it */
    l->x.storage = &l->x_storage;
    l->x.dtype = ds->tokens ? MGPU_I32 : MGPU_F32;
    l->x.shape = ds->tokens ? mgpu_shape2(l->d.batch, ds->seq) : mgpu_shape4(l->d.batch, 1, ds->rows, ds->cols);
    l->y.storage = &l->y_storage;
    l->y.dtype = MGPU_I32;
    l->y.shape = ds->tokens ? mgpu_shape2(l->d.batch, ds->seq) : mgpu_shape1(l->d.batch);
    mgpu_loader_start(l, 0);
    if (mgpu__live_add(l, MGPU__LIVE_LOADER, "mgpu_loader_create") != MGPU_OK) { mgpu__loader_free(l); return NULL; }
    return l;
}

MGPUDEF void mgpu_loader_start(mgpu_loader* l, int epoch) {
    int64_t i;
    uint64_t state;
    if (!l) return;
    for (i = 0; i < l->ds->count; ++i) l->order[i] = i;
    state = mgpu__mix(l->d.seed ^ mgpu__mix((uint64_t)epoch));
    for (i = l->ds->count - 1; l->d.shuffle && i > 0; --i) {   /* Fisher-Yates */
        int64_t j, t;
        state = mgpu__mix(state);
        j = (int64_t)(state % (uint64_t)(i + 1));
        t = l->order[i]; l->order[i] = l->order[j]; l->order[j] = t;
    }
    l->pos = 0;
}

MGPUDEF int mgpu_loader_next(mgpu_loader* l, const mgpu_tensor** x, const mgpu_tensor** y) {
    int64_t b, i, p;
    const int64_t pixels = l ? (int64_t)l->ds->rows * l->ds->cols : 0;
    float scale, shift;
    int64_t from = 0, rows;
    if (!l || l->pos >= l->ds->count) return 0;
    b = MGPU__MIN((int64_t)l->d.batch, l->ds->count - l->pos);
    if (b < l->d.batch && l->d.drop_last) return 0;
    if (l->d.wrap) b = l->d.batch;   /* completed from the epoch's first samples: order[(pos + i) % count] below */
    rows = b;
    if (l->d.shard_for && l->d.shard_for->dist) {   /* the rows of this process's replicas, as mgpu__split gives them out */
        const mgpu_model* m = l->d.shard_for;
        int64_t last_from, last_rows;
        mgpu__split(b, m->dist_total, m->dist_first, &from, &rows);
        mgpu__split(b, m->dist_total, m->dist_first + m->replica_count - 1, &last_from, &last_rows);
        rows = last_from + last_rows - from;
    }
    scale = 1.0f / (255.0f * l->d.std);
    shift = -l->d.mean / l->d.std;
    for (i = 0; i < rows; ++i) {
        const int64_t k = l->order[(l->pos + from + i) % l->ds->count];
        if (l->ds->tokens) {   /* window k: x = t[kT .. kT+T), y = the same shifted by one */
            const int64_t T = l->ds->seq;
            const uint16_t* src = mgpu_tokens_data(l->ds->tokens) + k * T;
            int32_t* xo = (int32_t*)l->x_pinned + i * T;
            int32_t* yo = l->y_pinned + i * T;
            for (p = 0; p < T; ++p) {
                xo[p] = src[p];
                yo[p] = src[p + 1];
            }
        } else {
            const uint8_t* img = l->ds->images + k * pixels;
            float* out = (float*)l->x_pinned + i * pixels;
            for (p = 0; p < pixels; ++p) out[p] = (float)img[p] * scale + shift;
            l->y_pinned[i] = l->ds->labels[k];
        }
    }
    l->x.shape.dim[0] = rows;
    l->y.shape.dim[0] = rows;
    l->pos += b;
    if (x) *x = &l->x;
    if (y) *y = &l->y;
    return 1;
}

MGPUDEF int64_t mgpu_loader_batches(const mgpu_loader* l) {
    if (!l) return 0;
    return l->d.drop_last ? l->ds->count / l->d.batch : (l->ds->count + l->d.batch - 1) / l->d.batch;   /* (wrap: a whole last one) */
}

#ifdef __cplusplus
}
#endif
#endif /* MGPU_IMPLEMENTATION */

/* ============================================================================================ */
/* >>license                                                                                    */
/* ============================================================================================ */
/*
This software is available under two licenses; choose whichever you prefer.
------------------------------------------------------------------------------
ALTERNATIVE A - MIT License
Copyright (c) 2026 the mgpu authors
Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:
The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.
THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
------------------------------------------------------------------------------
ALTERNATIVE B - Public Domain (www.unlicense.org)
This is free and unencumbered software released into the public domain. Anyone is free to copy,
modify, publish, use, compile, sell, or distribute this software, either in source code form or as
a compiled binary, for any purpose, commercial or non-commercial, and by any means.
------------------------------------------------------------------------------
*/
