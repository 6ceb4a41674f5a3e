/* mgpu_kernels.cu - the CUDA backend of mgpu.h: devices, streams, memory, cuBLAS GEMM (cuBLASLt
   where an epilogue takes work into it), the kernels and NCCL (loaded at run time).

   Compile it once with nvcc and link it into the program whose implementation file defines
   MGPU_IMPLEMENTATION and MGPU_CUDA:

       nvcc -std=c++17 -O3 -arch=sm_90 -c mgpu_kernels.cu -o mgpu_kernels.o
       cc -std=c99 -O2 -DMGPU_CUDA prog.c mgpu_kernels.o -lcudart -lcublas -lcublasLt -lstdc++ -lm -lpthread -ldl

   Every function defined here is declared in the >>seam section of mgpu.h, inside extern "C", so
   it keeps C linkage. The per-element math (Philox, activations, optimizer rules) lives in mgpu.h as
   __host__ __device__ functions: the CPU loops and these kernels evaluate the very same formulas
   (nvcc may fuse a*b + c into one FMA by default, so float results can differ in the last bit).
   Every reduction adds in a fixed order (no float atomics), so results repeat bit for bit.

   Sections: >>errors >>launching >>devices >>memory >>blas >>elementwise >>reductions >>layers
             >>optimizers >>oneshot >>nccl
*/
#define MGPU_KERNELS
#include "mgpu.h"
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#ifndef _WIN32
#include <dlfcn.h>   // NCCL is loaded at run time; Windows has no NCCL
#endif
#include <new>

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <mutex>

// ============================================================================================
// >>errors  every failure leaves "<call and arguments>: <error name> (<description>) at
//           mgpu_kernels.cu:<line>" in a thread-local buffer and returns an MGPU__CU_ERR_* code
// ============================================================================================
static thread_local char g_message[512];

const char* mgpu__cu_error_message(void) { return g_message; }

#if (defined(__GNUC__) || defined(__clang__)) && !defined(_WIN32)   // MSVC builds the .cu on Windows
__attribute__((format(printf, 5, 6)))
#endif
static int report(int code, const char* name, const char* text, int line, const char* what, ...) {
    va_list ap;
    va_start(ap, what);
    int len = vsnprintf(g_message, sizeof g_message, what, ap);
    va_end(ap);
    size_t used = len < 0 ? 0 : (size_t)len < sizeof g_message ? (size_t)len : sizeof g_message - 1;
    if (name)
        snprintf(g_message + used, sizeof g_message - used, ": %s (%s) at mgpu_kernels.cu:%d", name, text, line);
    else
        snprintf(g_message + used, sizeof g_message - used, " at mgpu_kernels.cu:%d", line);
    return code;
}

#define CUBLAS_STATUSES(X)                                                            \
    X(CUBLAS_STATUS_NOT_INITIALIZED, "cuBLAS not initialized")                       \
    X(CUBLAS_STATUS_ALLOC_FAILED, "resource allocation failed")                      \
    X(CUBLAS_STATUS_INVALID_VALUE, "unsupported value or parameter")                 \
    X(CUBLAS_STATUS_ARCH_MISMATCH, "feature absent from the device architecture")    \
    X(CUBLAS_STATUS_MAPPING_ERROR, "access to GPU memory space failed")              \
    X(CUBLAS_STATUS_EXECUTION_FAILED, "GPU program failed to execute")               \
    X(CUBLAS_STATUS_INTERNAL_ERROR, "internal operation failed")                     \
    X(CUBLAS_STATUS_NOT_SUPPORTED, "functionality not supported")                    \
    X(CUBLAS_STATUS_LICENSE_ERROR, "license error")

static const char* cublas_status(cublasStatus_t s, bool text) {
    switch (s) {
#define CASE(code, desc) case code: return text ? desc : #code;
        CUBLAS_STATUSES(CASE)
#undef CASE
    default: return text ? "unknown status" : "CUBLAS_STATUS_UNKNOWN";
    }
}

// Each checked call is one line: CUDA_TRY(cudaFoo(...), "cudaFoo(%d) on device %d", x, dev);
// A failed CUDA call is also cleared from the runtime's last-error slot (sticky errors stay), so
// the next launch check does not report it a second time.
#define CUDA_TRY(call, ...)                                                                     \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) {                                                                \
            (void)cudaGetLastError();                                                           \
            return report(e_ == cudaErrorMemoryAllocation ? MGPU__CU_ERR_OOM : MGPU__CU_ERR_CUDA, \
                          cudaGetErrorName(e_), cudaGetErrorString(e_), __LINE__, __VA_ARGS__);  \
        }                                                                                       \
    } while (0)
#define CUBLAS_TRY(call, ...)                                                                   \
    do {                                                                                        \
        cublasStatus_t s_ = (call);                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return report(MGPU__CU_ERR_CUBLAS, cublas_status(s_, false), cublas_status(s_, true), \
                          __LINE__, __VA_ARGS__);                                               \
    } while (0)
#define TRY(call)                                 \
    do {                                          \
        int r_ = (call);                          \
        if (r_ != MGPU__CU_OK) return r_;         \
    } while (0)
#define ARGUMENT_ERROR(...) report(MGPU__CU_ERR_ARGUMENT, NULL, NULL, __LINE__, __VA_ARGS__)
#define CHECK_LAUNCH(kernel, dev) CUDA_TRY(cudaGetLastError(), "launch of %s on device %d", kernel, dev)

// Makes dev the calling thread's current device. Outside a training step it asks the runtime
// which device is current (the program's own code may have changed it) and sets dev only when it
// differs. Inside a step (mgpu__cu_step_scope) no code but mgpu's runs on this thread between
// two calls, so the device mgpu set last is still current: no cudaGetDevice, and cudaSetDevice
// only when the device changes.
static thread_local int t_step_depth = 0;
static thread_local int t_current = -1;   // inside a step: the device made current, -1 unknown

int mgpu__cu_step_scope(int enter) {
    t_step_depth += enter ? 1 : -1;
    t_current = -1;   // entering: not known yet; leaving: not trusted any more
    return MGPU__CU_OK;
}

int mgpu__cu_device_unknown(void) {   // after code of the program's own ran on this thread
    t_current = -1;
    return MGPU__CU_OK;
}

// A CUDA error pending on this thread before mgpu's work: mgpu checks each of its own launches
// and calls at once (clearing the error), so it was left by the program's own code, a kernel
// launched without mgpu_cuda_end's check most often: said so here (and cleared, as
// cudaGetLastError does), not blamed on the launch of mgpu's that would have found it next. An
// error of a kernel that faulted while running (sticky) is found here too: "earlier work".
int mgpu__cu_pending_error(void) {
    const cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return MGPU__CU_OK;
    return report(e == cudaErrorMemoryAllocation ? MGPU__CU_ERR_OOM : MGPU__CU_ERR_CUDA, cudaGetErrorName(e), cudaGetErrorString(e),
                  __LINE__, "a CUDA error left pending by earlier work on this thread, not by this call (a kernel of the "
                  "program's own launched without mgpu_cuda_end to check it?)");
}

static int use_device(int dev) {
    if (t_step_depth > 0) {
        if (t_current == -1) TRY(mgpu__cu_pending_error());   // the first call of a step, or after a custom layer's code
        if (t_current != dev) {
            CUDA_TRY(cudaSetDevice(dev), "cudaSetDevice(%d)", dev);
            t_current = dev;
        }
        return MGPU__CU_OK;
    }
    int current = -1;
    TRY(mgpu__cu_pending_error());
    CUDA_TRY(cudaGetDevice(&current), "cudaGetDevice() while selecting device %d", dev);
    if (current != dev) CUDA_TRY(cudaSetDevice(dev), "cudaSetDevice(%d)", dev);
    return MGPU__CU_OK;
}
#define USE_DEVICE(dev) TRY(use_device(dev))

// The program's own kernels (mgpu_cuda_begin and mgpu_cuda_end): its code runs around these
// calls and may have set another device, so neither trusts what this thread did before.
int mgpu__cu_use_device(int dev) {
    mgpu__cu_device_unknown();
    return use_device(dev);
}

int mgpu__cu_check_launch(int dev, const char* kernel) {
    mgpu__cu_device_unknown();
    CUDA_TRY(cudaGetLastError(), "launch of %s on device %d", kernel, dev);
    return MGPU__CU_OK;
}

// Copies, events and waits run on the stream's device whichever is current (CUDA's rules for
// streams and events: only a kernel launch, and cuBLAS, need the stream's device current). The
// legacy stream, NULL, is the current device's.
#define USE_DEVICE_OF(dev, stream) do { if (!(stream)) USE_DEVICE(dev); } while (0)

static cudaStream_t as_stream(void* stream) { return (cudaStream_t)stream; }

// ============================================================================================
// >>launching  the building blocks of every kernel below: launch shapes, vector packs, block
//              reductions, and the two loop skeletons (elementwise and indexed)
// ============================================================================================
constexpr int kThreads = 256;
// At most kMaxBlocks blocks per grid; every kernel's grid-stride loop covers the rest. The
// emulator's build (tests/emu) sets a small cap, so that those loops run at small sizes too.
#ifndef MGPU_CU_MAX_BLOCKS
#define MGPU_CU_MAX_BLOCKS 65535
#endif
constexpr unsigned kMaxBlocks = MGPU_CU_MAX_BLOCKS;

// Blocks for `items` units of work, `per_block` units per block, at most `cap` blocks (the
// grid-stride loops cover the rest).
static unsigned blocks_for(uint64_t items, uint64_t per_block, unsigned cap = kMaxBlocks) {
    const uint64_t b = items / per_block + (items % per_block != 0);
    return (unsigned)(b < cap ? b : cap);
}

// V consecutive elements moved as one aligned access (V = 4 floats: one 16-byte load or store).
template <class T, int V> struct alignas(sizeof(T) * V) pack { T v[V]; };

template <int V, class T> __device__ __forceinline__ pack<T, V> load(const T* p, size_t i) {
    return *reinterpret_cast<const pack<T, V>*>(p + i);
}
template <int V, class T> __device__ __forceinline__ void store(T* p, size_t i, const pack<T, V>& x) {
    *reinterpret_cast<pack<T, V>*>(p + i) = x;
}

// True when every pointer allows 4-wide packs (NULL does). Views of a tensor may be unaligned.
template <class... T> static bool vec4_ok(const T*... p) {
    return ((reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0) && ...);
}

// MGPU_BF16's element: its bits, a type of its own (not an integer type) whose conversions are
// the header's (the CPU's bits exactly).
struct bf16 {
    uint16_t bits;
    __device__ operator float() const { return mgpu__bf16_to_float(bits); }
};

// float -> dtype. Integers truncate toward zero like a C cast and saturate at the type's range
// (NaN gives 0): what the GPU's conversion instruction does, where a C cast is undefined.
template <class D> __device__ D from_float(float x);
template <> __device__ float from_float<float>(float x) { return x; }
template <> __device__ int32_t from_float<int32_t>(float x) { return __float2int_rz(x); }
template <> __device__ uint8_t from_float<uint8_t>(float x) { return (uint8_t)min(__float2uint_rz(x), 255u); }
template <> __device__ bf16 from_float<bf16>(float x) { return bf16{mgpu__float_to_bf16(x)}; }

template <class T> struct sum_op {
    __device__ T operator()(T a, T b) const { return a + b; }
};
// (fmaxf skips a NaN, but the row max only steadies softmax's exp: a NaN in the row still makes
// its sum, so every output and the loss, NaN, as in PyTorch)
struct max_op {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Halving tree over a warp; lane 0 ends with the result.
template <class T, class Op> __device__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, d));
    return v;
}

// Reduction over a block of kThreads threads; every thread gets the result, so every thread
// must call it.
template <class T, class Op> __device__ T block_reduce(T v, Op op) {
    __shared__ T warp_part[kThreads / 32];
    v = warp_reduce(v, op);
    __syncthreads();   // a previous call may still be reading warp_part
    if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = warp_part[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) r = op(r, warp_part[w]);
    return r;
}

// The elementwise skeleton. An op's apply<V>(i) handles elements [i, i + V) and returns what they
// add to a sum (0 for plain maps; mse's squared errors). Packs of V first, then the last n % V
// elements one by one. With part != NULL, the block's sum goes to part[blockIdx.x].
template <int V, class F> __global__ void __launch_bounds__(kThreads) map_kernel(size_t n, F f, float* part) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t packs = n / V;
    float acc = 0.0f;
    for (size_t j = t; j < packs; j += stride) acc += f.template apply<V>(j * V);
    for (size_t i = packs * V + t; i < n; i += stride) acc += f.template apply<1>(i);
    if (part) {
        acc = block_reduce(acc, sum_op<float>());
        if (threadIdx.x == 0) part[blockIdx.x] = acc;
    }
}

template <class F> static int launch_map(int dev, void* stream, const char* name, size_t n, const F& f, bool vec4) {
    if (n == 0) return MGPU__CU_OK;
    if (vec4)
        map_kernel<4><<<blocks_for(n / 4 + 1, kThreads), kThreads, 0, as_stream(stream)>>>(n, f, nullptr);
    else
        map_kernel<1><<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(n, f, nullptr);
    CHECK_LAUNCH(name, dev);
    return MGPU__CU_OK;
}

// The indexed skeleton, for ops that decode an index into coordinates: f(i) for i in [0, n).
// 32-bit indices when n allows, because 64-bit division is several times slower on GPUs
// (n < 2^31 keeps i + stride below 2^32).
template <class I, class F> __global__ void __launch_bounds__(kThreads) index_kernel(I n, F f) {
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class F> static int launch_index(int dev, void* stream, const char* name, int64_t n, const F& f) {
    if (n <= 0) return MGPU__CU_OK;
    const unsigned blocks = blocks_for((uint64_t)n, kThreads);
    if (n < INT_MAX)
        index_kernel<uint32_t><<<blocks, kThreads, 0, as_stream(stream)>>>((uint32_t)n, f);
    else
        index_kernel<uint64_t><<<blocks, kThreads, 0, as_stream(stream)>>>((uint64_t)n, f);
    CHECK_LAUNCH(name, dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>devices
// ============================================================================================
int mgpu__cu_device_count(int* count) {
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorStubLibrary) {
        (void)cudaGetLastError();
        *count = 0;
        return report(MGPU__CU_ERR_NO_DEVICE, cudaGetErrorName(e), cudaGetErrorString(e), __LINE__,
                      "cudaGetDeviceCount()");
    }
    CUDA_TRY(e, "cudaGetDeviceCount()");
    if (*count == 0)
        return report(MGPU__CU_ERR_NO_DEVICE, cudaGetErrorName(cudaErrorNoDevice),
                      cudaGetErrorString(cudaErrorNoDevice), __LINE__, "cudaGetDeviceCount() found 0 devices");
    return MGPU__CU_OK;
}

int mgpu__cu_device_info(int dev, char* name, size_t name_size, size_t* total_mem, size_t* free_mem,
                         int* major, int* minor, int* multiprocessors) {
    cudaDeviceProp prop;
    size_t free_bytes = 0, total_bytes = 0;
    USE_DEVICE(dev);
    CUDA_TRY(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties(device %d)", dev);
    CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo() on device %d", dev);
    if (name && name_size) snprintf(name, name_size, "%s", prop.name);
    if (total_mem) *total_mem = total_bytes;
    if (free_mem) *free_mem = free_bytes;
    if (major) *major = prop.major;
    if (minor) *minor = prop.minor;
    if (multiprocessors) *multiprocessors = prop.multiProcessorCount;
    return MGPU__CU_OK;
}

int mgpu__cu_can_access_peer(int dev, int peer, int* can) {
    *can = 0;
    USE_DEVICE(dev);
    if (dev == peer) { *can = 1; return MGPU__CU_OK; }   // a device always reaches its own memory
    CUDA_TRY(cudaDeviceCanAccessPeer(can, dev, peer), "cudaDeviceCanAccessPeer(%d, %d)", dev, peer);
    return MGPU__CU_OK;
}

int mgpu__cu_enable_peer_access(int dev, int peer) {
    USE_DEVICE(dev);
    if (dev == peer) return MGPU__CU_OK;
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {   // fine: another caller got there first
        (void)cudaGetLastError();
        return MGPU__CU_OK;
    }
    CUDA_TRY(e, "cudaDeviceEnablePeerAccess(peer %d) on device %d", peer, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_stream_create(int dev, void** stream) {
    cudaStream_t s = NULL;
    *stream = NULL;
    USE_DEVICE(dev);
    // Non-blocking: no implicit synchronisation with the legacy default stream.
    CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags() on device %d", dev);
    *stream = s;
    return MGPU__CU_OK;
}

int mgpu__cu_stream_destroy(int dev, void* stream) {
    USE_DEVICE(dev);
    if (stream) CUDA_TRY(cudaStreamDestroy(as_stream(stream)), "cudaStreamDestroy(%p) on device %d", stream, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_stream_synchronize(int dev, void* stream) {
    USE_DEVICE(dev);
    CUDA_TRY(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize(%p) on device %d", stream, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_event_create(int dev, void** event) {   // ordering only: no timing, so cheaper
    cudaEvent_t e = NULL;
    *event = NULL;
    USE_DEVICE(dev);
    CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags() on device %d", dev);
    *event = e;
    return MGPU__CU_OK;
}

int mgpu__cu_event_create_timed(int dev, void** event) {   // for traces: elapsed times between two
    cudaEvent_t e = NULL;
    *event = NULL;
    USE_DEVICE(dev);
    CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDefault), "cudaEventCreateWithFlags(default) on device %d", dev);
    *event = e;
    return MGPU__CU_OK;
}

int mgpu__cu_event_elapsed(int dev, void* start, void* end, float* ms) {   // waits for end
    USE_DEVICE(dev);
    CUDA_TRY(cudaEventSynchronize((cudaEvent_t)end), "cudaEventSynchronize(%p) on device %d", end, dev);
    CUDA_TRY(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)end), "cudaEventElapsedTime(%p, %p) on device %d",
             start, end, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_event_destroy(int dev, void* event) {
    USE_DEVICE(dev);
    if (event) CUDA_TRY(cudaEventDestroy((cudaEvent_t)event), "cudaEventDestroy(%p) on device %d", event, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_event_record(int dev, void* event, void* stream) {   // event and stream both of dev
    USE_DEVICE_OF(dev, stream);
    CUDA_TRY(cudaEventRecord((cudaEvent_t)event, as_stream(stream)), "cudaEventRecord(%p, stream %p) on device %d",
             event, stream, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_event_done(int dev, void* event, int* done) {   // never waits; any device may be current
    const cudaError_t e = cudaEventQuery((cudaEvent_t)event);
    *done = e == cudaSuccess;
    if (e == cudaErrorNotReady) (void)cudaGetLastError();   // not an error: off the runtime's last-error slot
    else CUDA_TRY(e, "cudaEventQuery(%p) on device %d", event, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_event_synchronize(int dev, void* event) {   // any device may be current
    CUDA_TRY(cudaEventSynchronize((cudaEvent_t)event), "cudaEventSynchronize(%p) on device %d", event, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_stream_wait_event(int dev, void* stream, void* event) {   // event of any device
    USE_DEVICE_OF(dev, stream);
    CUDA_TRY(cudaStreamWaitEvent(as_stream(stream), (cudaEvent_t)event, 0),
             "cudaStreamWaitEvent(stream %p, event %p) on device %d", stream, event, dev);
    return MGPU__CU_OK;
}

// A step as a CUDA graph: captured once on the stream of its first device (the other devices'
// streams join the capture through events, as the caller arranges), replayed by one launch.
// Thread-local capture mode: a call of this thread that capture forbids (a synchronisation, a
// cudaMalloc) fails the capture instead of running, and the caller falls back to the eager step;
// other threads' allocations go on as usual.
int mgpu__cu_capture_begin(int dev, void* stream) {
    USE_DEVICE(dev);
    CUDA_TRY(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal),
             "cudaStreamBeginCapture(%p) on device %d", stream, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_capture_end(int dev, void* stream, void** exec) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t e = nullptr;
    *exec = nullptr;
    USE_DEVICE(dev);
    CUDA_TRY(cudaStreamEndCapture(as_stream(stream), &graph), "cudaStreamEndCapture(%p) on device %d", stream, dev);
    const cudaError_t made = cudaGraphInstantiateWithFlags(&e, graph, 0ULL);   // CUDA 11.4 to 13
    const cudaError_t freed = cudaGraphDestroy(graph);   // the executable keeps what it needs
    if (made != cudaSuccess && e) (void)cudaGraphExecDestroy(e);
    CUDA_TRY(made, "cudaGraphInstantiateWithFlags() on device %d", dev);
    CUDA_TRY(freed, "cudaGraphDestroy() on device %d", dev);
    *exec = e;
    return MGPU__CU_OK;
}

int mgpu__cu_graph_launch(int dev, void* exec, void* stream) {
    USE_DEVICE(dev);
    CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)exec, as_stream(stream)), "cudaGraphLaunch(%p, stream %p) on device %d", exec,
             stream, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_graph_destroy(int dev, void* exec) {
    USE_DEVICE(dev);
    if (exec) CUDA_TRY(cudaGraphExecDestroy((cudaGraphExec_t)exec), "cudaGraphExecDestroy(%p) on device %d", exec, dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>memory
// ============================================================================================
int mgpu__cu_malloc(int dev, size_t bytes, void** ptr) {
    *ptr = NULL;
    USE_DEVICE(dev);
    CUDA_TRY(cudaMalloc(ptr, bytes), "cudaMalloc(%zu bytes) on device %d", bytes, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_free(int dev, void* ptr) {
    USE_DEVICE(dev);
    CUDA_TRY(cudaFree(ptr), "cudaFree(%p) on device %d", ptr, dev);
    return MGPU__CU_OK;
}

int mgpu__cu_host_alloc(size_t bytes, void** ptr) {
    *ptr = NULL;
    // Portable: pinned for every device's context, not only the current one.
    CUDA_TRY(cudaHostAlloc(ptr, bytes, cudaHostAllocPortable), "cudaHostAlloc(%zu bytes)", bytes);
    return MGPU__CU_OK;
}

int mgpu__cu_host_free(void* ptr) {
    CUDA_TRY(cudaFreeHost(ptr), "cudaFreeHost(%p)", ptr);
    return MGPU__CU_OK;
}

int mgpu__cu_memcpy(int dev, void* dst, const void* src, size_t bytes, void* stream) {
    USE_DEVICE_OF(dev, stream);
    if (bytes == 0) return MGPU__CU_OK;
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)),
             "cudaMemcpyAsync(%zu bytes, %p -> %p) on device %d", bytes, src, dst, dev);
    return MGPU__CU_OK;
}

// `stream` is the one of the two devices' that orders the copy (as mgpu.h passes it).
int mgpu__cu_memcpy_peer(int dst_dev, void* dst, int src_dev, const void* src, size_t bytes, void* stream) {
    USE_DEVICE_OF(dst_dev, stream);
    if (bytes == 0) return MGPU__CU_OK;
    CUDA_TRY(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, bytes, as_stream(stream)),
             "cudaMemcpyPeerAsync(%zu bytes, device %d -> device %d)", bytes, src_dev, dst_dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>blas
// ============================================================================================
// The handle mgpu.h holds: cuBLAS's, and the workspace mgpu.h gave it from the device's caching
// allocator (so its memory statistics count it, as PyTorch's do). A fixed workspace per handle
// lets cuBLAS pick its faster Hopper kernels without allocating behind the allocator's back; each
// handle is bound to one stream, so results stay deterministic.
//
// cuBLASLt's GEMMs (mgpu__cu_gemm_epilogue) keep their descriptors, layouts and the algorithm its
// heuristic chose in a small cache per handle, keyed by shape: a heuristic query costs tens of
// microseconds, about a whole graphed step of a small MLP.
struct lt_plan {
    int key[13];                // epilogue, trans_a, trans_b, m, n, k, lda, ldb, ldc, ab, c dtypes, tf32,
                                // the operands' alignment (lt_alignment)
    int found;                  // 1: algo is cuBLASLt's choice; 0: it has none (the plain path runs)
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};
enum { LT_PLANS = 64 };
struct blas_handle {
    cublasHandle_t h;
    void* workspace;   // not owned: mgpu.h frees it after mgpu__cu_blas_destroy
    size_t workspace_bytes;
    int tf32;          // mgpu__cu_blas_set_tf32's, for cuBLASLt's compute type
    cublasLtHandle_t lt;
    lt_plan plans[LT_PLANS];
    int plan_count, plan_next;   // plans in use; the one replaced next when all are
};

static int blas_configure(int dev, blas_handle* b, void* stream) {
    CUBLAS_TRY(cublasSetStream(b->h, as_stream(stream)), "cublasSetStream(%p) on device %d", stream, dev);
    // After cublasSetStream (which resets it): our workspace; no atomics (run-to-run identical
    // results); plain FP32 until mgpu__cu_blas_set_tf32 allows TF32.
    CUBLAS_TRY(cublasSetWorkspace(b->h, b->workspace, b->workspace_bytes), "cublasSetWorkspace(%zu bytes) on device %d",
               b->workspace_bytes, dev);
    CUBLAS_TRY(cublasSetAtomicsMode(b->h, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode() on device %d", dev);
    CUBLAS_TRY(cublasSetPointerMode(b->h, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode() on device %d", dev);
    CUBLAS_TRY(cublasSetMathMode(b->h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode(default) on device %d", dev);
    return MGPU__CU_OK;
}

// Frees a cached plan's descriptors: the first failure's status, or success
static cublasStatus_t lt_plan_free(lt_plan* p) {
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS, s;
    if (p->desc && (s = cublasLtMatmulDescDestroy(p->desc)) != CUBLAS_STATUS_SUCCESS) st = s;
    if (p->a && (s = cublasLtMatrixLayoutDestroy(p->a)) != CUBLAS_STATUS_SUCCESS && st == CUBLAS_STATUS_SUCCESS) st = s;
    if (p->b && (s = cublasLtMatrixLayoutDestroy(p->b)) != CUBLAS_STATUS_SUCCESS && st == CUBLAS_STATUS_SUCCESS) st = s;
    if (p->c && (s = cublasLtMatrixLayoutDestroy(p->c)) != CUBLAS_STATUS_SUCCESS && st == CUBLAS_STATUS_SUCCESS) st = s;
    memset(p, 0, sizeof *p);
    return st;
}

int mgpu__cu_blas_destroy(int dev, void* handle) {
    blas_handle* b = (blas_handle*)handle;
    if (!b) return MGPU__CU_OK;
    USE_DEVICE(dev);
    cublasStatus_t st = b->h ? cublasDestroy(b->h) : CUBLAS_STATUS_SUCCESS, s;
    for (int i = 0; i < b->plan_count; ++i)
        if ((s = lt_plan_free(&b->plans[i])) != CUBLAS_STATUS_SUCCESS && st == CUBLAS_STATUS_SUCCESS) st = s;
    if (b->lt && (s = cublasLtDestroy(b->lt)) != CUBLAS_STATUS_SUCCESS && st == CUBLAS_STATUS_SUCCESS) st = s;
    delete b;
    CUBLAS_TRY(st, "cublasDestroy() or cublasLtDestroy() on device %d", dev);
    return MGPU__CU_OK;
}

static int blas_setup(int dev, blas_handle* b, void* stream) {
    CUBLAS_TRY(cublasCreate(&b->h), "cublasCreate() on device %d", dev);
    CUBLAS_TRY(cublasLtCreate(&b->lt), "cublasLtCreate() on device %d", dev);
    return blas_configure(dev, b, stream);
}

int mgpu__cu_blas_create(int dev, void* stream, void* workspace, size_t workspace_bytes, void** handle) {
    *handle = NULL;
    USE_DEVICE(dev);
    blas_handle* b = new (std::nothrow) blas_handle();
    if (!b) return report(MGPU__CU_ERR_OOM, NULL, NULL, __LINE__, "out of host memory for a cuBLAS handle on device %d", dev);
    b->workspace = workspace;
    b->workspace_bytes = workspace_bytes;
    int r = blas_setup(dev, b, stream);
    if (r != MGPU__CU_OK) {   // undo what was made, keeping the first error's message
        char first[sizeof g_message];
        memcpy(first, g_message, sizeof first);
        (void)mgpu__cu_blas_destroy(dev, b);
        memcpy(g_message, first, sizeof first);
        return r;
    }
    *handle = b;
    return MGPU__CU_OK;
}

int mgpu__cu_blas_set_tf32(int dev, void* handle, int allow) {
    USE_DEVICE(dev);
    CUBLAS_TRY(cublasSetMathMode(((blas_handle*)handle)->h, allow ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
               "cublasSetMathMode(%s) on device %d", allow ? "TF32" : "default", dev);
    ((blas_handle*)handle)->tf32 = allow != 0;
    return MGPU__CU_OK;
}

// C = beta * C over the rows x cols matrix with row stride ldc: a GEMM with k == 0. beta == 0
// writes zeros without reading C (BLAS semantics: NaNs in C are ignored).
template <class T> struct scale_matrix_op {
    int64_t cols, ldc;
    float beta;
    T* c;
    template <class I> __device__ void operator()(I i) const {
        T* p = c + (int64_t)(i / (I)cols) * ldc + (int64_t)(i % (I)cols);
        *p = from_float<T>(beta == 0.0f ? 0.0f : beta * (float)*p);
    }
};

int mgpu__cu_gemm(int dev, void* handle, int trans_a, int trans_b, int m, int n, int k,
                  float alpha, int ab_dtype, const void* a, int lda, const void* b, int ldb,
                  float beta, int c_dtype, void* c, int ldc) {
    cublasHandle_t h = ((blas_handle*)handle)->h;
    USE_DEVICE(dev);
    if (m < 0 || n < 0 || k < 0) return ARGUMENT_ERROR("gemm with m=%d n=%d k=%d", m, n, k);
    if ((ab_dtype != MGPU_F32 && ab_dtype != MGPU_BF16) || (c_dtype != MGPU_F32 && c_dtype != MGPU_BF16) ||
        (ab_dtype == MGPU_F32 && c_dtype != MGPU_F32))
        return ARGUMENT_ERROR("gemm of dtypes %d x %d -> %d", ab_dtype, ab_dtype, c_dtype);
    if (m == 0 || n == 0) return MGPU__CU_OK;
    if (k == 0) {   // done here: cuBLAS's handling of k == 0 is not documented
        cudaStream_t s = NULL;
        CUBLAS_TRY(cublasGetStream(h, &s), "cublasGetStream() on device %d", dev);
        if (c_dtype == MGPU_BF16) return launch_index(dev, s, "gemm_scale", (int64_t)m * n, scale_matrix_op<bf16>{n, ldc, beta, (bf16*)c});
        return launch_index(dev, s, "gemm_scale", (int64_t)m * n, scale_matrix_op<float>{n, ldc, beta, (float*)c});
    }
    // cuBLAS is column-major, and a row-major matrix is its column-major transpose. So compute
    // C^T [n, m] = op(B)^T op(A)^T: B comes first, and each operand keeps its own op flag.
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (ab_dtype == MGPU_F32) {
        CUBLAS_TRY(cublasSgemm(h, op_b, op_a, n, m, k, &alpha, (const float*)b, ldb, (const float*)a, lda, &beta, (float*)c, ldc),
                   "cublasSgemm(m=%d, n=%d, k=%d, trans_a=%d, trans_b=%d, lda=%d, ldb=%d, ldc=%d) on device %d",
                   m, n, k, trans_a, trans_b, lda, ldb, ldc, dev);
        return MGPU__CU_OK;
    }
    // bf16 operands, products summed in fp32, C in fp32 or bf16 (rounded once)
    const cudaDataType_t c_type = c_dtype == MGPU_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    CUBLAS_TRY(cublasGemmEx(h, op_b, op_a, n, m, k, &alpha, b, CUDA_R_16BF, ldb, a, CUDA_R_16BF, lda, &beta, c, c_type, ldc,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx(bf16 x bf16 -> %s, m=%d, n=%d, k=%d, trans_a=%d, trans_b=%d, lda=%d, ldb=%d, ldc=%d) on device %d",
               c_dtype == MGPU_BF16 ? "bf16" : "f32", m, n, k, trans_a, trans_b, lda, ldb, ldc, dev);
    return MGPU__CU_OK;
}

// The alignment cuBLASLt may assume of the operands: the largest power of two, at most 256 (its
// default), that divides every address. A row slice of a batch (a micro-batch) or of a bf16
// copy is less aligned than a block from the allocator; told so, the heuristic picks an
// algorithm that reads it (PyTorch learned this on Hopper: pytorch/pytorch#98975).
static int lt_alignment(const void* a, const void* b, const void* c, const void* bias, const void* aux) {
    uintptr_t all = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)bias | (uintptr_t)aux | 256;
    return (int)(all & (~all + 1));
}

// Which epilogues take a bias (or write the bias gradient), and which an aux matrix
static bool lt_has_bias(int epilogue) { return epilogue != MGPU__EPI_DRELU && epilogue != MGPU__EPI_DGELU; }
static bool lt_has_aux(int epilogue) {
    return epilogue == MGPU__EPI_RELU_BIAS || epilogue == MGPU__EPI_DRELU || epilogue == MGPU__EPI_DGELU ||
           epilogue == MGPU__EPI_GELU_BIAS;
}
static bool lt_gelu(int epilogue) { return epilogue == MGPU__EPI_DGELU || epilogue == MGPU__EPI_GELU_BIAS; }

// The epilogue's vectors on a plan's descriptor: the bias (or bias gradient), the ReLU mask or
// the GELU's input (written by GELU_AUX_BIAS, read by DGELU)
static int lt_set_pointers(int dev, cublasLtMatmulDesc_t desc, int epilogue, void* bias, void* aux) {
    if (lt_has_bias(epilogue))
        CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
                   "cublasLtMatmulDescSetAttribute(BIAS_POINTER) on device %d", dev);
    if (lt_has_aux(epilogue))
        CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
                   "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER) on device %d", dev);
    return MGPU__CU_OK;
}

// Fills plan p for key: descriptors, layouts, then the heuristic's first algorithm, or none.
static int lt_plan_fill(int dev, blas_handle* bh, const int key[13], void* bias, void* aux, lt_plan* p) {
    const int epilogue = key[0], trans_a = key[1], trans_b = key[2], m = key[3], n = key[4], k = key[5];
    const int lda = key[6], ldb = key[7], ldc = key[8], ab_dtype = key[9], c_dtype = key[10], tf32 = key[11];
    const uint32_t alignment = (uint32_t)key[12];
    // column-major, as mgpu__cu_gemm: C^T [n, m] = op(B)^T op(A)^T, B first
    const cudaDataType_t ab = ab_dtype == MGPU_BF16 ? CUDA_R_16BF : CUDA_R_32F, c = c_dtype == MGPU_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = ab_dtype == MGPU_F32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const int32_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasLtEpilogue_t lt_epilogue = epilogue == MGPU__EPI_BIAS ? CUBLASLT_EPILOGUE_BIAS
                                         : epilogue == MGPU__EPI_RELU_BIAS ? CUBLASLT_EPILOGUE_RELU_AUX_BIAS
                                         : epilogue == MGPU__EPI_DRELU ? CUBLASLT_EPILOGUE_DRELU
                                         : epilogue == MGPU__EPI_DGELU ? CUBLASLT_EPILOGUE_DGELU
                                         : epilogue == MGPU__EPI_GELU_BIAS ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                         : epilogue == MGPU__EPI_BGRAD_B ? CUBLASLT_EPILOGUE_BGRADA   // mgpu's B is cuBLASLt's A
                                                                       : CUBLASLT_EPILOGUE_BGRADB;   // mgpu's A is cuBLASLt's B
    const int32_t bias_type = CUDA_R_32F;
    CUBLAS_TRY(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F), "cublasLtMatmulDescCreate() on device %d", dev);
    CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first),
               "cublasLtMatmulDescSetAttribute(TRANSA) on device %d", dev);
    CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second),
               "cublasLtMatmulDescSetAttribute(TRANSB) on device %d", dev);
    CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt_epilogue, sizeof lt_epilogue),
               "cublasLtMatmulDescSetAttribute(EPILOGUE %d) on device %d", (int)lt_epilogue, dev);
    if (lt_has_bias(epilogue))   // the bias, or the bias gradient, in f32 (D's type: f32)
        CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
                   "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE) on device %d", dev);
    if (lt_has_aux(epilogue)) {   // bits of the ReLU mask, or the GELU's inputs (of D's type, C's row stride)
        const int64_t aux_ld = lt_gelu(epilogue) ? ldc : mgpu__relu_mask_ld(n);
        CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
                   "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD) on device %d", dev);
    }
    CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->a, ab, trans_b ? k : n, trans_b ? n : k, ldb), "cublasLtMatrixLayoutCreate(B) on device %d", dev);
    CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->b, ab, trans_a ? m : k, trans_a ? k : m, lda), "cublasLtMatrixLayoutCreate(A) on device %d", dev);
    CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->c, c, n, m, ldc), "cublasLtMatrixLayoutCreate(C) on device %d", dev);
    TRY(lt_set_pointers(dev, p->desc, epilogue, bias, aux));   // (the heuristic reads their alignment)
    cublasLtMatmulPreference_t pref = NULL;
    const uint64_t workspace = bh->workspace_bytes;
    cublasLtMatmulHeuristicResult_t result;
    int returned = 0;
    CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate() on device %d", dev);
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace);
    const cublasLtMatmulPreferenceAttributes_t aligned[4] = { CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                              CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES };
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
        st = cublasLtMatmulPreferenceSetAttribute(pref, aligned[i], &alignment, sizeof alignment);
    if (st != CUBLAS_STATUS_SUCCESS) {
        (void)cublasLtMatmulPreferenceDestroy(pref);
        CUBLAS_TRY(st, "cublasLtMatmulPreferenceSetAttribute() on device %d", dev);
    }
    st = cublasLtMatmulAlgoGetHeuristic(bh->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &returned);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    // no algorithm (NOT_SUPPORTED, or none returned) is an answer, kept: the caller's plain path runs
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED)
        CUBLAS_TRY(st, "cublasLtMatmulAlgoGetHeuristic(epilogue %d, m=%d, n=%d, k=%d) on device %d", (int)lt_epilogue, m, n, k, dev);
    p->found = st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (p->found) p->algo = result.algo;
    return MGPU__CU_OK;
}

// The plan for one GEMM and epilogue: cached, or made now (a plan that failed to be made is not
// kept: the next call tries again).
static int lt_plan_get(int dev, blas_handle* bh, const int key[13], void* bias, void* aux, lt_plan** out) {
    for (int i = 0; i < bh->plan_count; ++i)
        if (memcmp(bh->plans[i].key, key, sizeof bh->plans[i].key) == 0) {
            *out = &bh->plans[i];
            return MGPU__CU_OK;
        }
    lt_plan* p;
    if (bh->plan_count < LT_PLANS) p = &bh->plans[bh->plan_count++];
    else {   // all in use: the oldest is replaced
        p = &bh->plans[bh->plan_next];
        bh->plan_next = (bh->plan_next + 1) % LT_PLANS;
    }
    CUBLAS_TRY(lt_plan_free(p), "cuBLASLt descriptors' destroy on device %d", dev);
    int rc = lt_plan_fill(dev, bh, key, bias, aux, p);
    if (rc != MGPU__CU_OK) {
        (void)lt_plan_free(p);   // (its key all zeros: no epilogue is 0, so it matches none)
        return rc;
    }
    memcpy(p->key, key, sizeof p->key);
    *out = p;
    return MGPU__CU_OK;
}

int mgpu__cu_gemm_epilogue(int dev, void* handle, int epilogue, int trans_a, int trans_b, int m, int n, int k,
                           float alpha, int ab_dtype, const void* a, int lda, const void* b, int ldb,
                           float beta, int c_dtype, void* c, int ldc, void* bias, void* aux) {
    blas_handle* bh = (blas_handle*)handle;
    USE_DEVICE(dev);
    if (m <= 0 || n <= 0 || k <= 0) return MGPU__CU_NO_ALGORITHM;   // (mgpu__cu_gemm's k == 0 path)
    if (epilogue < MGPU__EPI_BIAS || epilogue > MGPU__EPI_BGRAD_B) return ARGUMENT_ERROR("gemm with epilogue %d", epilogue);
    if ((ab_dtype != MGPU_F32 && ab_dtype != MGPU_BF16) || (c_dtype != MGPU_F32 && c_dtype != MGPU_BF16) ||
        (ab_dtype == MGPU_F32 && c_dtype != MGPU_F32))
        return ARGUMENT_ERROR("gemm of dtypes %d x %d -> %d", ab_dtype, ab_dtype, c_dtype);
    // cuBLASLt's bias is of D's type (cublasLt.h, BIAS_DATA_TYPE), and mgpu's biases are f32;
    // the GELU's input (DGELU's and GELU_AUX_BIAS's aux) is of D's type too, and mgpu's are f32
    // here; its leading dimension (C's) a multiple of 8
    if (c_dtype != MGPU_F32 && epilogue != MGPU__EPI_DRELU) return MGPU__CU_NO_ALGORITHM;
    if (lt_gelu(epilogue) && ldc % 8 != 0) return MGPU__CU_NO_ALGORITHM;
    const int key[13] = { epilogue, trans_a != 0, trans_b != 0, m, n, k, lda, ldb, ldc, ab_dtype, c_dtype, bh->tf32,
                          lt_alignment(a, b, c, bias, aux) };
    lt_plan* p = NULL;
    TRY(lt_plan_get(dev, bh, key, bias, aux, &p));
    if (!p->found) return MGPU__CU_NO_ALGORITHM;
    TRY(lt_set_pointers(dev, p->desc, epilogue, bias, aux));
    cudaStream_t s = NULL;
    CUBLAS_TRY(cublasGetStream(bh->h, &s), "cublasGetStream() on device %d", dev);
    CUBLAS_TRY(cublasLtMatmul(bh->lt, p->desc, &alpha, b, p->a, a, p->b, &beta, c, p->c, c, p->c, &p->algo, bh->workspace,
                              bh->workspace_bytes, s),
               "cublasLtMatmul(epilogue %d, %s, m=%d, n=%d, k=%d, trans_a=%d, trans_b=%d, lda=%d, ldb=%d, ldc=%d) on device %d",
               epilogue, ab_dtype == MGPU_BF16 ? "bf16" : "f32", m, n, k, trans_a, trans_b, lda, ldb, ldc, dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>elementwise  grid-stride loops of 256 threads; 4-wide vector accesses when aligned
// ============================================================================================
// Calls f(T()) with T the C type of an mgpu dtype.
template <class F> static int with_dtype(int dtype, F&& f) {
    switch (dtype) {
    case MGPU_F32: return f(float());
    case MGPU_I32: return f(int32_t());
    case MGPU_U8: return f(uint8_t());
    case MGPU_BF16: return f(bf16());
    default: return ARGUMENT_ERROR("unknown dtype %d", dtype);
    }
}

template <class T> static T fill_value(double v);
template <> float fill_value<float>(double v) { return (float)v; }
/* integers straight from the double (a float would round 16777217), as mgpu_tensor_fill does */
template <> int32_t fill_value<int32_t>(double v) { return v != v ? 0 : v <= INT32_MIN ? INT32_MIN : v >= INT32_MAX ? INT32_MAX : (int32_t)v; }
template <> uint8_t fill_value<uint8_t>(double v) { return v != v || v <= 0 ? 0 : v >= 255 ? 255 : (uint8_t)v; }
template <> bf16 fill_value<bf16>(double v) { return bf16{mgpu__float_to_bf16((float)v)}; }   /* through the float */

template <class T> struct fill_op {
    T* p;
    T value;
    template <int V> __device__ float apply(size_t i) const {
        pack<T, V> x;
#pragma unroll
        for (int k = 0; k < V; ++k) x.v[k] = value;
        store<V>(p, i, x);
        return 0.0f;
    }
};

template <class S, class D> struct convert_op {
    const S* src;
    D* dst;
    float scale, shift;
    bool plain;   // scale 1, shift 0: no arithmetic (mgpu__convert_value)
    template <int V> __device__ float apply(size_t i) const {
        const pack<S, V> x = load<V>(src, i);
        pack<D, V> y;
#pragma unroll
        for (int k = 0; k < V; ++k) y.v[k] = from_float<D>(plain ? (float)x.v[k] : mgpu__convert_value((float)x.v[k], scale, shift));
        store<V>(dst, i, y);
        return 0.0f;
    }
};

struct rand_op {
    uint64_t seed, offset;
    float a, b;
    int normal;
    float* out;
    template <int V> __device__ float apply(size_t i) const {
        pack<float, V> y;
#pragma unroll
        for (int k = 0; k < V; ++k) y.v[k] = mgpu__rand_element(seed, offset, i + k, normal, a, b);
        store<V>(out, i, y);
        return 0.0f;
    }
};

// T: float, or bf16 (computed in float, each result rounded once)
template <class T> struct unary_op {
    int op;
    float alpha;
    const T* x;
    T* y;
    template <int V> __device__ float apply(size_t i) const {
        const pack<T, V> v = load<V>(x, i);
        pack<T, V> r;
#pragma unroll
        for (int k = 0; k < V; ++k) r.v[k] = from_float<T>(mgpu__unary_apply(op, (float)v.v[k], alpha));
        store<V>(y, i, r);
        return 0.0f;
    }
};

template <class T> struct binary_op {
    int op;
    float alpha;
    const T* a;
    const T* b;
    T* y;
    template <int V> __device__ float apply(size_t i) const {
        const pack<T, V> u = load<V>(a, i);
        const pack<T, V> w = load<V>(b, i);
        pack<T, V> r;
#pragma unroll
        for (int k = 0; k < V; ++k) r.v[k] = from_float<T>(mgpu__binary_apply(op, (float)u.v[k], (float)w.v[k], alpha));
        store<V>(y, i, r);
        return 0.0f;
    }
};

// y[o, c, i] = x[o, c, i] + bias[c]
template <class X, class Y> struct bias_add_op {   // float or bf16 each: in float, rounded once into y
    int64_t channels, inner;
    const X* x;
    const float* bias;
    Y* y;
    template <class I> __device__ void operator()(I i) const { y[i] = from_float<Y>((float)x[i] + bias[i / (I)inner % (I)channels]); }
};

int mgpu__cu_fill(int dev, void* stream, void* ptr, int dtype, size_t n, double value) {
    const double zero_bits = 0.0;
    const bool zero = memcmp(&value, &zero_bits, sizeof value) == 0;   // +0 is zero bytes in every dtype: a memset
    USE_DEVICE(dev);   // (CUDA's rules name copies, events and waits on another device's stream, not memsets)
    return with_dtype(dtype, [&](auto z) -> int {
        using T = decltype(z);
        if (zero) {
            if (n) CUDA_TRY(cudaMemsetAsync(ptr, 0, n * sizeof(T), as_stream(stream)), "cudaMemsetAsync(%p, %zu bytes) on device %d",
                            ptr, n * sizeof(T), dev);
            return MGPU__CU_OK;
        }
        return launch_map(dev, stream, "fill", n, fill_op<T>{(T*)ptr, fill_value<T>(value)}, vec4_ok((T*)ptr));
    });
}

int mgpu__cu_convert(int dev, void* stream, size_t n, int src_dtype, const void* src, int dst_dtype, void* dst,
                     float scale, float shift) {
    USE_DEVICE(dev);
    return with_dtype(src_dtype, [&](auto s) {
        return with_dtype(dst_dtype, [&](auto d) {
            using S = decltype(s);
            using D = decltype(d);
            const convert_op<S, D> op{(const S*)src, (D*)dst, scale, shift, scale == 1.0f && shift == 0.0f};
            return launch_map(dev, stream, "convert", n, op, vec4_ok(op.src, op.dst));
        });
    });
}

int mgpu__cu_rand(int dev, void* stream, int normal, size_t n, uint64_t seed, uint64_t offset,
                  float a, float b, float* out) {
    USE_DEVICE(dev);
    return launch_map(dev, stream, "rand", n, rand_op{seed, offset, a, b, normal, out}, vec4_ok(out));
}

int mgpu__cu_unary(int dev, void* stream, int op, int dtype, size_t n, const void* x, void* y, float alpha) {
    USE_DEVICE(dev);
    if (dtype == MGPU_BF16) {
        const unary_op<bf16> f{op, alpha, (const bf16*)x, (bf16*)y};
        return launch_map(dev, stream, "unary", n, f, vec4_ok(f.x, f.y));
    }
    if (dtype != MGPU_F32) return ARGUMENT_ERROR("unary op on dtype %d", dtype);
    const unary_op<float> f{op, alpha, (const float*)x, (float*)y};
    return launch_map(dev, stream, "unary", n, f, vec4_ok(f.x, f.y));
}

int mgpu__cu_binary(int dev, void* stream, int op, int dtype, size_t n, const void* a, const void* b,
                    void* y, float alpha) {
    USE_DEVICE(dev);
    if (dtype == MGPU_BF16) {
        const binary_op<bf16> f{op, alpha, (const bf16*)a, (const bf16*)b, (bf16*)y};
        return launch_map(dev, stream, "binary", n, f, vec4_ok(f.a, f.b, f.y));
    }
    if (dtype != MGPU_F32) return ARGUMENT_ERROR("binary op on dtype %d", dtype);
    const binary_op<float> f{op, alpha, (const float*)a, (const float*)b, (float*)y};
    return launch_map(dev, stream, "binary", n, f, vec4_ok(f.a, f.b, f.y));
}

// The tape's two generic kernels (>>autograd): a thread per element, the element's work the
// seam's own function, as the CPU's (the same bits, except where CUDA's logf and powf round
// differently from the host's C library, by an ulp).
struct map_strided_op {
    mgpu__map_geom g;
    const float* a;
    const float* b;
    float* out;
    template <class I> __device__ void operator()(I i) const { mgpu__map_element(&g, a, b, out, (int64_t)i); }
};
struct reduce_strided_op {
    mgpu__reduce_geom g;
    const float* x;
    float* out;
    template <class I> __device__ void operator()(I i) const { mgpu__reduce_element(&g, x, out, (int64_t)i); }
};

int mgpu__cu_map(int dev, void* stream, const mgpu__map_geom* g, const float* a, const float* b, float* out) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "map", g->dim[0] * g->dim[1] * g->dim[2] * g->dim[3], map_strided_op{*g, a, b, out});
}

int mgpu__cu_reduce(int dev, void* stream, const mgpu__reduce_geom* g, const float* x, float* out) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "reduce", g->out_dim[0] * g->out_dim[1] * g->out_dim[2] * g->out_dim[3],
                        reduce_strided_op{*g, x, out});
}

int mgpu__cu_bias_add(int dev, void* stream, int64_t outer, int64_t channels, int64_t inner,
                      int x_dtype, const void* x, const float* bias, int y_dtype, void* y) {
    USE_DEVICE(dev);
    if ((x_dtype != MGPU_F32 && x_dtype != MGPU_BF16) || (y_dtype != MGPU_F32 && y_dtype != MGPU_BF16))
        return ARGUMENT_ERROR("bias_add of dtype %d into %d", x_dtype, y_dtype);
    if (outer <= 0 || channels <= 0 || inner <= 0) return MGPU__CU_OK;
    const int64_t n = outer * channels * inner;
    if (x_dtype == MGPU_F32 && y_dtype == MGPU_F32)
        return launch_index(dev, stream, "bias_add", n, bias_add_op<float, float>{channels, inner, (const float*)x, bias, (float*)y});
    if (x_dtype == MGPU_F32)
        return launch_index(dev, stream, "bias_add", n, bias_add_op<float, bf16>{channels, inner, (const float*)x, bias, (bf16*)y});
    if (y_dtype == MGPU_F32)
        return launch_index(dev, stream, "bias_add", n, bias_add_op<bf16, float>{channels, inner, (const bf16*)x, bias, (float*)y});
    return launch_index(dev, stream, "bias_add", n, bias_add_op<bf16, bf16>{channels, inner, (const bf16*)x, bias, (bf16*)y});
}

// ============================================================================================
// >>reductions  deterministic: each thread adds in a fixed order, then a fixed tree per block,
//               then (where there are several blocks) one block adds the partials in order
// ============================================================================================
// Reduction over the G threads that share a row (a warp, or the whole block); all get the result.
template <int G, class T, class Op> __device__ T group_reduce(T v, Op op) {
    if constexpr (G == 32)
        return __shfl_sync(0xffffffffu, warp_reduce(v, op), 0);
    else
        return block_reduce(v, op);
}

// The second pass of every reduction: one block adds count partials in a fixed order and writes
// out[0] = sum / divisor (Acc: double for losses, int for counts).
template <class T, class Acc>
__global__ void __launch_bounds__(kThreads) finish_kernel(const T* part, int64_t count, Acc divisor, T* out) {
    Acc acc = 0;
    for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += (Acc)part[i];
    acc = block_reduce(acc, sum_op<Acc>());
    if (threadIdx.x == 0) out[0] = (T)(acc / divisor);
}

// channel_sum with inner == 1: column sums of x [rows, cols] (e.g. a bias gradient). A block owns
// `width` adjacent columns; its threads form kThreads / width row groups striding down the rows,
// so each warp reads contiguous memory. The groups' partials meet in shared memory in order.
template <class T>
__global__ void __launch_bounds__(kThreads)
column_sum_kernel(int64_t rows, int64_t cols, int width, const T* x, float* out, float scale, int accumulate) {
    __shared__ float part[kThreads];
    const int groups = kThreads / width, lane = threadIdx.x % width, group = threadIdx.x / width;
    for (int64_t c0 = (int64_t)blockIdx.x * width; c0 < cols; c0 += (int64_t)gridDim.x * width) {
        const int64_t c = c0 + lane;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;   // four chains: more loads in flight
        if (group < groups && c < cols) {
            const int64_t step = (int64_t)groups * cols;
            const T* p = x + group * cols + c;
            int64_t r = group;
            for (; r + 3 * groups < rows; r += 4 * groups, p += 4 * step) {
                s0 += (float)p[0];
                s1 += (float)p[step];
                s2 += (float)p[2 * step];
                s3 += (float)p[3 * step];
            }
            for (; r < rows; r += groups, p += step) s0 += (float)p[0];
        }
        part[threadIdx.x] = (s0 + s1) + (s2 + s3);
        __syncthreads();
        if (group == 0 && c < cols) {
            float s = 0.0f;
            for (int g = 0; g < groups; ++g) s += part[g * width + lane];
            out[c] = scale * s + (accumulate ? out[c] : 0.0f);
        }
        __syncthreads();
    }
}

// channel_sum with inner > 1 (e.g. a conv bias gradient over [N, C, H*W]): a block per channel
// walks its outer * inner elements. Thread t visits flat offsets t, t + 256, ... as (o, i), which
// advance by constant steps, so the loop has no division.
template <class T>
__global__ void __launch_bounds__(kThreads)
channel_sum_kernel(int64_t outer, int64_t channels, int64_t inner, const T* x, float* out, float scale,
                   int accumulate) {
    const int64_t step_o = kThreads / inner, step_i = kThreads % inner;
    for (int64_t c = blockIdx.x; c < channels; c += gridDim.x) {
        int64_t o = threadIdx.x / inner, i = threadIdx.x % inner;
        float acc = 0.0f;
        while (o < outer) {
            acc += (float)x[(o * channels + c) * inner + i];
            o += step_o;
            i += step_i;
            if (i >= inner) { i -= inner; ++o; }
        }
        acc = block_reduce(acc, sum_op<float>());
        if (threadIdx.x == 0) out[c] = scale * acc + (accumulate ? out[c] : 0.0f);
    }
}

int mgpu__cu_channel_sum(int dev, void* stream, int64_t outer, int64_t channels, int64_t inner,
                         int x_dtype, const void* x, float* out, float scale, int accumulate) {
    USE_DEVICE(dev);
    if (x_dtype != MGPU_F32 && x_dtype != MGPU_BF16) return ARGUMENT_ERROR("channel sum of dtype %d", x_dtype);
    if (channels <= 0) return MGPU__CU_OK;
    cudaStream_t s = as_stream(stream);
    if (outer <= 0 || inner <= 0) {   // empty sums: nothing to add, or zeros
        if (accumulate) return MGPU__CU_OK;
        CUDA_TRY(cudaMemsetAsync(out, 0, (size_t)channels * sizeof(float), s), "cudaMemsetAsync() on device %d", dev);
        return MGPU__CU_OK;
    }
    const bool x_bf16 = x_dtype == MGPU_BF16;
    if (inner == 1) {
        const int width = channels < 32 ? (int)channels : 32;
        if (x_bf16)
            column_sum_kernel<<<blocks_for(channels, width), kThreads, 0, s>>>(outer, channels, width, (const bf16*)x, out, scale, accumulate);
        else
            column_sum_kernel<<<blocks_for(channels, width), kThreads, 0, s>>>(outer, channels, width, (const float*)x, out, scale, accumulate);
    } else if (x_bf16) {
        channel_sum_kernel<<<blocks_for(channels, 1), kThreads, 0, s>>>(outer, channels, inner, (const bf16*)x, out, scale, accumulate);
    } else {
        channel_sum_kernel<<<blocks_for(channels, 1), kThreads, 0, s>>>(outer, channels, inner, (const float*)x, out, scale, accumulate);
    }
    CHECK_LAUNCH("channel_sum", dev);
    return MGPU__CU_OK;
}

// Softmax over rows, one row per group of G threads: a warp for narrow rows, the whole block for
// wide ones. Computes the row max m and s = sum exp(x - m) (subtracting m keeps exp finite).
// Without labels, y = exp(x - m) / s. With labels (cross-entropy), row_loss[r] = m + log(s) -
// x[label] and, when y is given, y = (softmax - onehot) * grad_scale (* scale_on_device when
// given); an ignored row (MGPU_IGNORE_INDEX) gets 0 in both, another out-of-range label NaN.
template <int G>
__global__ void __launch_bounds__(kThreads) softmax_kernel(int rows, int cols, const float* x, float* y,
                                                           const int32_t* labels, float* row_loss, float grad_scale,
                                                           const float* scale_on_device) {
    if (scale_on_device) grad_scale = *scale_on_device;
    constexpr int kRowsPerBlock = kThreads / G;
    const int lane = threadIdx.x % G;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / G; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const float* xr = x + r * cols;
        float* yr = y ? y + r * cols : nullptr;
        float m = -INFINITY, s = 0.0f;
        for (int j = lane; j < cols; j += G) m = fmaxf(m, xr[j]);
        m = group_reduce<G>(m, max_op());
        for (int j = lane; j < cols; j += G) s += expf(xr[j] - m);
        // x[label] is read before the reduction's barrier, so before any lane writes y (which
        // may be x itself: an in-place gradient)
        const int label = labels ? labels[r] : 0;
        const bool valid = label >= 0 && label < cols;
        if (label == MGPU_IGNORE_INDEX) {   // the whole group takes this branch: no reduction skipped by half
            if (lane == 0) row_loss[r] = 0.0f;
            if (yr)
                for (int j = lane; j < cols; j += G) yr[j] = 0.0f;
            continue;
        }
        const float x_label = labels && valid ? xr[label] : 0.0f;
        s = group_reduce<G>(s, sum_op<float>());
        // In place (y == x), a lane's writes below may land on x[label], which every lane read
        // above. A warp's shuffles order no memory, and the compiler may move that read past
        // them: __syncwarp orders every lane's read before any lane's write. (With G = the
        // block, group_reduce's __syncthreads does.)
        if (G == 32) __syncwarp();
        if (!labels) {
            for (int j = lane; j < cols; j += G) yr[j] = expf(xr[j] - m) / s;
            continue;
        }
        if (lane == 0) row_loss[r] = valid ? m + logf(s) - x_label : NAN;
        if (yr)
            for (int j = lane; j < cols; j += G)
                yr[j] = valid ? (expf(xr[j] - m) / s - (j == label ? 1.0f : 0.0f)) * grad_scale : NAN;
    }
}

static int launch_softmax(int dev, void* stream, int rows, int cols, const float* x, float* y,
                          const int32_t* labels, float* row_loss, float grad_scale, const float* scale_on_device) {
    if (rows <= 0) return MGPU__CU_OK;
    if (cols <= 1024)
        softmax_kernel<32><<<blocks_for(rows, kThreads / 32), kThreads, 0, as_stream(stream)>>>(
            rows, cols, x, y, labels, row_loss, grad_scale, scale_on_device);
    else
        softmax_kernel<kThreads><<<blocks_for(rows, 1), kThreads, 0, as_stream(stream)>>>(
            rows, cols, x, y, labels, row_loss, grad_scale, scale_on_device);
    CHECK_LAUNCH(labels ? "softmax_xent" : "softmax", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_softmax(int dev, void* stream, int rows, int cols, const float* x, float* y) {
    USE_DEVICE(dev);
    return launch_softmax(dev, stream, rows, cols, x, y, nullptr, nullptr, 0.0f, nullptr);
}

// The cross-entropy's targets: the rows whose label is not MGPU_IGNORE_INDEX, counted by one
// block. With row_loss: out[0] = the mean of row_loss over them (summed as finish_kernel sums,
// so that a batch without ignored rows gets the bits it always had; 0 when there are none).
// Without: out[0] = factor / their count (0 when none), the gradient's scale of the mean.
__global__ void __launch_bounds__(kThreads)
xent_targets_kernel(int rows, const int32_t* labels, const float* row_loss, float* out, float factor) {
    double acc = 0.0;
    int n = 0;
    for (int i = threadIdx.x; i < rows; i += kThreads) {
        if (row_loss) acc += (double)row_loss[i];
        n += labels[i] != MGPU_IGNORE_INDEX;
    }
    if (row_loss) acc = block_reduce(acc, sum_op<double>());
    n = block_reduce(n, sum_op<int>());
    if (threadIdx.x == 0) out[0] = n == 0 ? 0.0f : row_loss ? (float)(acc / (double)n) : factor / (float)n;
}

int mgpu__cu_softmax_xent(int dev, void* stream, int rows, int cols, const float* logits,
                          const int32_t* labels, float* loss, float* dlogits, float grad_scale,
                          float mean_factor, float* scratch) {
    USE_DEVICE(dev);
    float* scale = nullptr;   // grad_scale 0: mean_factor / the targets, on the device (scratch[rows])
    if (dlogits && grad_scale == 0.0f && rows > 0) {
        scale = scratch + rows;
        xent_targets_kernel<<<1, kThreads, 0, as_stream(stream)>>>(rows, labels, nullptr, scale, mean_factor);
        CHECK_LAUNCH("softmax_xent targets", dev);
    }
    TRY(launch_softmax(dev, stream, rows, cols, logits, dlogits, labels, scratch, grad_scale, scale));
    xent_targets_kernel<<<1, kThreads, 0, as_stream(stream)>>>(rows, labels, scratch, loss, 1.0f);
    CHECK_LAUNCH("softmax_xent mean", dev);
    return MGPU__CU_OK;
}

// Squared errors (summed by map_kernel) and, when dpred is given, 2 (pred - target) * grad_scale.
struct mse_op {
    const float* pred;
    const float* target;
    float* dpred;
    float grad_scale;
    template <int V> __device__ float apply(size_t i) const {
        const pack<float, V> p = load<V>(pred, i), t = load<V>(target, i);
        pack<float, V> g;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float d = p.v[k] - t.v[k];
            s += d * d;
            g.v[k] = 2.0f * d * grad_scale;
        }
        if (dpred) store<V>(dpred, i, g);
        return s;
    }
};

int mgpu__cu_mse(int dev, void* stream, size_t n, const float* pred, const float* target,
                 float* loss, float* dpred, float grad_scale, float* scratch) {
    USE_DEVICE(dev);
    cudaStream_t s = as_stream(stream);
    // Scalar accesses, so which thread adds which element (the summation order) depends on n
    // alone, not on the pointers' alignment.
    const unsigned blocks = n ? blocks_for(n, kThreads, MGPU__CU_REDUCE_SCRATCH) : 0;
    if (blocks) {
        map_kernel<1><<<blocks, kThreads, 0, s>>>(n, mse_op{pred, target, dpred, grad_scale}, scratch);
        CHECK_LAUNCH("mse", dev);
    }
    finish_kernel<float, double><<<1, kThreads, 0, s>>>(scratch, blocks, (double)n, loss);
    CHECK_LAUNCH("mse mean", dev);
    return MGPU__CU_OK;
}

// Index of the first maximum of row[0, cols), matching the sequential loop `best = 0; for j: if
// (mgpu__argmax_takes(row[j], row[best])) best = j`: the first NaN wins (torch.argmax), else the
// first maximum. Each lane scans a strided share; the lanes then merge by (NaN, then larger value,
// then smaller index), an order-independent rule. Returns the index in every lane (0 when cols == 0,
// as on the CPU).
__device__ int warp_row_argmax(const float* row, int cols, int lane) {
    if (cols <= 0) return 0;
    float best = -INFINITY;
    int idx = INT_MAX;   // INT_MAX: this lane has seen nothing yet
    for (int j = lane; j < cols; j += 32) {
        const float v = row[j];
        if (idx == INT_MAX || mgpu__argmax_takes(v, best)) { best = v; idx = j; }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        const float other_best = __shfl_xor_sync(0xffffffffu, best, d);
        const int other_idx = __shfl_xor_sync(0xffffffffu, idx, d);
        // neither beats the other (equal, or both NaN): the smaller index
        if (other_idx != INT_MAX &&
            (idx == INT_MAX || mgpu__argmax_takes(other_best, best) ||
             (!mgpu__argmax_takes(best, other_best) && other_idx < idx))) {
            best = other_best;
            idx = other_idx;
        }
    }
    return idx;
}

// A warp per row. Writes out[row] when out is given; with labels, counts the rows whose argmax
// equals the label into part[blockIdx.x].
__global__ void __launch_bounds__(kThreads)
argmax_kernel(int rows, int cols, const float* x, int32_t* out, const int32_t* labels, int* part) {
    constexpr int kRowsPerBlock = kThreads / 32;
    const int lane = threadIdx.x & 31;
    int hits = 0;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const int a = warp_row_argmax(x + r * cols, cols, lane);
        if (lane == 0) {
            if (out) out[r] = a;
            if (labels && a == labels[r]) ++hits;
        }
    }
    if (labels) {
        hits = block_reduce(hits, sum_op<int>());
        if (threadIdx.x == 0) part[blockIdx.x] = hits;
    }
}

int mgpu__cu_argmax(int dev, void* stream, int rows, int cols, const float* x, int32_t* out) {
    USE_DEVICE(dev);
    if (rows <= 0) return MGPU__CU_OK;
    argmax_kernel<<<blocks_for(rows, kThreads / 32), kThreads, 0, as_stream(stream)>>>(rows, cols, x, out, nullptr,
                                                                                        nullptr);
    CHECK_LAUNCH("argmax", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_count_correct(int dev, void* stream, int rows, int cols, const float* logits,
                           const int32_t* labels, int32_t* count, float* scratch) {
    USE_DEVICE(dev);
    cudaStream_t s = as_stream(stream);
    int* part = reinterpret_cast<int*>(scratch);   // the scratch floats hold int partial counts
    const unsigned blocks = rows > 0 ? blocks_for(rows, kThreads / 32, MGPU__CU_REDUCE_SCRATCH) : 0;
    if (blocks) {
        argmax_kernel<<<blocks, kThreads, 0, s>>>(rows, cols, logits, nullptr, labels, part);
        CHECK_LAUNCH("count_correct", dev);
    }
    finish_kernel<int, int><<<1, kThreads, 0, s>>>(part, blocks, 1, count);
    CHECK_LAUNCH("count_correct sum", dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>layers  im2col / col2im, max pooling, dropout, attention, transpose. The backward passes are gathers:
//           each input element adds up the windows that cover it, so no atomics are needed.
// ============================================================================================

// The output positions o in [lo, hi] (empty when lo > hi) whose window [o*stride - pad,
// o*stride - pad + k) covers input position i.
__device__ __forceinline__ void covering_windows(int i, int pad, int k, int stride, int out, int& lo, int& hi) {
    const int p = i + pad;                      // o*stride <= p < o*stride + k
    lo = p >= k ? (p - k) / stride + 1 : 0;     // ceil((p - k + 1) / stride)
    hi = min(p / stride, out - 1);
}

// cols [n*oh*ow, c*kh*kw]: row (img, oy, ox), column (ch, ky, kx); one thread per entry.
struct im2col_op {
    mgpu__window g;
    const float* x;
    float* cols;
    template <class I> __device__ void operator()(I idx) const {
        I t = idx;
        const int kx = (int)(t % (I)g.kw); t /= (I)g.kw;
        const int ky = (int)(t % (I)g.kh); t /= (I)g.kh;
        const int ch = (int)(t % (I)g.c);  t /= (I)g.c;
        const int ox = (int)(t % (I)g.ow); t /= (I)g.ow;
        const int oy = (int)(t % (I)g.oh);
        const int64_t img = (int64_t)(t / (I)g.oh);
        const int iy = oy * g.stride - g.pad + ky, ix = ox * g.stride - g.pad + kx;
        const bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
        cols[idx] = inside ? x[((img * g.c + ch) * g.h + iy) * g.w + ix] : 0.0f;
    }
};

// dx[img, ch, iy, ix] = sum of the cols entries that im2col filled from it; one thread per input.
struct col2im_op {
    mgpu__window g;
    const float* cols;
    float* dx;
    template <class I> __device__ void operator()(I idx) const {
        I t = idx;
        const int ix = (int)(t % (I)g.w); t /= (I)g.w;
        const int iy = (int)(t % (I)g.h); t /= (I)g.h;
        const int ch = (int)(t % (I)g.c);
        const int64_t img = (int64_t)(t / (I)g.c), width = (int64_t)g.c * g.kh * g.kw;
        int oy0, oy1, ox0, ox1;
        covering_windows(iy, g.pad, g.kh, g.stride, g.oh, oy0, oy1);
        covering_windows(ix, g.pad, g.kw, g.stride, g.ow, ox0, ox1);
        float acc = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy) {
            const int ky = iy + g.pad - oy * g.stride;
            for (int ox = ox0; ox <= ox1; ++ox) {
                const int kx = ix + g.pad - ox * g.stride;
                acc += cols[((img * g.oh + oy) * g.ow + ox) * width + (ch * g.kh + ky) * g.kw + kx];
            }
        }
        dx[idx] = acc;
    }
};

// One thread per output. Padding is skipped (it counts as -inf); the first in-window element is
// taken unconditionally, then only a strictly greater one or a NaN replaces it (first maximum
// wins; a NaN wins over numbers, the last NaN over NaNs: PyTorch's rule, mgpu__pool_takes).
struct maxpool_op {
    mgpu__window g;
    const float* x;
    float* y;
    int32_t* argmax;
    template <class I> __device__ void operator()(I idx) const {
        I t = idx;
        const int ox = (int)(t % (I)g.ow); t /= (I)g.ow;
        const int oy = (int)(t % (I)g.oh); t /= (I)g.oh;   // t is now the plane img * c + ch
        const float* plane = x + (int64_t)t * g.h * g.w;
        float best = -INFINITY;
        int arg = -1;
        for (int ky = 0; ky < g.kh; ++ky) {
            const int iy = oy * g.stride - g.pad + ky;
            if (iy < 0 || iy >= g.h) continue;
            for (int kx = 0; kx < g.kw; ++kx) {
                const int ix = ox * g.stride - g.pad + kx;
                if (ix < 0 || ix >= g.w) continue;
                const float v = plane[iy * g.w + ix];
                if (arg < 0 || mgpu__pool_takes(v, best)) { best = v; arg = iy * g.w + ix; }
            }
        }
        y[idx] = best;
        argmax[idx] = arg;
    }
};

// dx[img, ch, iy, ix] = sum of dy over the covering windows whose argmax is this element.
struct maxpool_backward_op {
    mgpu__window g;
    const float* dy;
    const int32_t* argmax;
    float* dx;
    template <class I> __device__ void operator()(I idx) const {
        I t = idx;
        const int ix = (int)(t % (I)g.w); t /= (I)g.w;
        const int iy = (int)(t % (I)g.h); t /= (I)g.h;      // t is now the plane img * c + ch
        const int64_t base = (int64_t)t * g.oh * g.ow;
        const int self = iy * g.w + ix;
        int oy0, oy1, ox0, ox1;
        covering_windows(iy, g.pad, g.kh, g.stride, g.oh, oy0, oy1);
        covering_windows(ix, g.pad, g.kw, g.stride, g.ow, ox0, ox1);
        float acc = 0.0f;
        for (int oy = oy0; oy <= oy1; ++oy)
            for (int ox = ox0; ox <= ox1; ++ox) {
                const int64_t o = base + (int64_t)oy * g.ow + ox;
                if (argmax[o] == self) acc += dy[o];
            }
        dx[idx] = acc;
    }
};

struct dropout_op {
    uint64_t seed, offset, first;   // element i draws as element first + i (a slice of a batch)
    const uint64_t* seed_at;        // non-NULL: the seed is there (a CUDA graph's replay: each step's own)
    float p;
    const float* x;
    float* y;
    float* mask;
    template <int V> __device__ float apply(size_t i) const {
        const uint64_t key = seed_at ? *seed_at : seed;
        pack<float, V> v = load<V>(x, i), m;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            m.v[k] = mgpu__dropout_scale(key, offset, first + i + k, p);
            v.v[k] *= m.v[k];
        }
        store<V>(y, i, v);
        if (mask) store<V>(mask, i, m);
        return 0.0f;
    }
};

int mgpu__cu_dropout(int dev, void* stream, size_t n, uint64_t seed, const uint64_t* seed_on_device, uint64_t offset,
                     uint64_t first, float p, const float* x, float* y, float* mask) {
    USE_DEVICE(dev);
    return launch_map(dev, stream, "dropout", n, dropout_op{seed, offset, first, seed_on_device, p, x, y, mask},
                      vec4_ok(x, y, mask));
}

static int64_t window_inputs(const mgpu__window* g) { return (int64_t)g->n * g->c * g->h * g->w; }
static int64_t window_outputs(const mgpu__window* g) { return (int64_t)g->n * g->c * g->oh * g->ow; }

int mgpu__cu_im2col(int dev, void* stream, const mgpu__window* g, const float* x, float* cols) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "im2col", window_outputs(g) * g->kh * g->kw, im2col_op{*g, x, cols});
}

int mgpu__cu_col2im(int dev, void* stream, const mgpu__window* g, const float* cols, float* dx) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "col2im", window_inputs(g), col2im_op{*g, cols, dx});
}

int mgpu__cu_maxpool(int dev, void* stream, const mgpu__window* g, const float* x, float* y, int32_t* argmax) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "maxpool", window_outputs(g), maxpool_op{*g, x, y, argmax});
}

int mgpu__cu_maxpool_backward(int dev, void* stream, const mgpu__window* g, const float* dy,
                              const int32_t* argmax, float* dx) {
    USE_DEVICE(dev);
    return launch_index(dev, stream, "maxpool_backward", window_inputs(g), maxpool_backward_op{*g, dy, argmax, dx});
}

// ---- >>layers BatchNorm2d and global average pooling, x as [n, c, hw]. A block per channel: its
// threads stride over the channel's n * hw elements and meet in block_reduce, a fixed order, so
// every replay and replica gives the same bits (no atomics). Thread t visits flat offsets
// t, t + kThreads, ... as (o, i), stepped without a division (as channel_sum_kernel).
template <class F> __device__ __forceinline__ void channel_walk(int64_t n, int64_t c, int64_t hw, int64_t ch, F f) {
    const int64_t step_o = kThreads / hw, step_i = kThreads % hw;
    int64_t o = threadIdx.x / hw, i = threadIdx.x % hw;
    while (o < n) {
        f((o * c + ch) * hw + i);
        o += step_o;
        i += step_i;
        if (i >= hw) { i -= hw; ++o; }
    }
}

// The modes (MGPU__BN_*, the seam's): training on this replica's rows; evaluation, from the running
// statistics; and SyncBatchNorm's halves around the host's exchange (>>parallel meet): STATS
// writes the rows' mean and sum of squared deviations to sync [0, c) and [c, 2c), GIVEN
// normalises with the whole batch's mean, rstd and unbiased variance from sync [0, 3c).
// Training: the batch's mean and biased variance (two passes: no cancellation), the running
// statistics moved by momentum towards the mean and the unbiased variance, num_batches_tracked + 1.
// Then y = (x - mean) * rstd * weight + bias.
__global__ void __launch_bounds__(kThreads)
batch_norm_kernel(int64_t n, int64_t c, int64_t hw, const float* x, const float* w, const float* b, float* run_mean,
                  float* run_var, float* count, int mode, float momentum, float eps, float* save_mean,
                  float* save_rstd, float* sync, float* y) {
    const int64_t m = n * hw;
    for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        float mean, rstd, unbiased = 0.0f;
        if (mode == MGPU__BN_TRAIN || mode == MGPU__BN_STATS) {
            float s = 0.0f;
            channel_walk(n, c, hw, ch, [&](int64_t j) { s += x[j]; });
            mean = block_reduce(s, sum_op<float>()) / (float)m;
            float v = 0.0f;
            channel_walk(n, c, hw, ch, [&](int64_t j) { const float d = x[j] - mean; v += d * d; });
            const float squares = block_reduce(v, sum_op<float>());
            if (mode == MGPU__BN_STATS) {
                if (threadIdx.x == 0) {
                    sync[ch] = mean;
                    sync[c + ch] = squares;
                }
                __syncthreads();
                continue;
            }
            rstd = 1.0f / sqrtf(squares / (float)m + eps);
            unbiased = squares / (float)m * (float)m / (float)(m - 1);
        } else if (mode == MGPU__BN_GIVEN) {
            mean = sync[ch];
            rstd = sync[c + ch];
            unbiased = sync[2 * c + ch];
        } else {
            mean = run_mean[ch];
            rstd = 1.0f / sqrtf(run_var[ch] + eps);
        }
        if (mode != MGPU__BN_EVAL && threadIdx.x == 0) {
            run_mean[ch] = (1.0f - momentum) * run_mean[ch] + momentum * mean;
            run_var[ch] = (1.0f - momentum) * run_var[ch] + momentum * unbiased;
            save_mean[ch] = mean;
            save_rstd[ch] = rstd;
            if (ch == 0) count[0] += 1.0f;
        }
        const float scale = rstd * w[ch], shift = b[ch] - mean * rstd * w[ch];
        channel_walk(n, c, hw, ch, [&](int64_t j) { y[j] = x[j] * scale + shift; });
        __syncthreads();   // (the next channel's block_reduce reuses shared memory)
    }
}

// Backward in training mode: xhat = (x - mean) * rstd, dweight += sum(dy * xhat), dbias +=
// sum(dy), dx = weight * rstd * (dy - mean(dy) - xhat * mean(dy * xhat)). SyncBatchNorm's halves:
// SUMS adds to dweight and dbias and writes the two sums to sync [0, c) and [c, 2c); GIVEN takes
// the whole batch's two means from there and writes dx alone.
__global__ void __launch_bounds__(kThreads)
batch_norm_backward_kernel(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy, const float* w,
                           const float* save_mean, const float* save_rstd, int mode, float* sync, float* dw, float* db,
                           float* dx) {
    const int64_t m = n * hw;
    for (int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        const float mean = save_mean[ch], rstd = save_rstd[ch];
        float a, bb;
        if (mode == MGPU__BN_GIVEN) {
            a = sync[ch];
            bb = sync[c + ch];
        } else {
            float s1 = 0.0f, s2 = 0.0f;
            channel_walk(n, c, hw, ch, [&](int64_t j) { s1 += dy[j]; s2 += dy[j] * ((x[j] - mean) * rstd); });
            const float sum_dy = block_reduce(s1, sum_op<float>());
            const float sum_dyx = block_reduce(s2, sum_op<float>());
            if (threadIdx.x == 0) {
                dw[ch] += sum_dyx;
                db[ch] += sum_dy;
                if (mode == MGPU__BN_STATS) {
                    sync[ch] = sum_dy;
                    sync[c + ch] = sum_dyx;
                }
            }
            a = sum_dy / (float)m;
            bb = sum_dyx / (float)m;
        }
        if (dx && mode != MGPU__BN_STATS) {
            const float k = w[ch] * rstd;
            channel_walk(n, c, hw, ch, [&](int64_t j) { dx[j] = k * (dy[j] - a - (x[j] - mean) * rstd * bb); });
        }
        __syncthreads();
    }
}

int mgpu__cu_batch_norm(int dev, void* stream, int64_t n, int64_t c, int64_t hw, const float* x, const float* weight,
                        const float* bias, float* running_mean, float* running_var, float* count, int mode,
                        float momentum, float eps, float* save_mean, float* save_rstd, float* sync, float* y) {
    USE_DEVICE(dev);
    if (n <= 0 || c <= 0 || hw <= 0) return MGPU__CU_OK;
    batch_norm_kernel<<<blocks_for(c, 1), kThreads, 0, as_stream(stream)>>>(n, c, hw, x, weight, bias, running_mean,
                                                                          running_var, count, mode, momentum, eps,
                                                                          save_mean, save_rstd, sync, y);
    CHECK_LAUNCH("batch_norm", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_batch_norm_backward(int dev, void* stream, int64_t n, int64_t c, int64_t hw, const float* x,
                                 const float* dy, const float* weight, const float* save_mean, const float* save_rstd,
                                 int mode, float* sync, float* dweight, float* dbias, float* dx) {
    USE_DEVICE(dev);
    if (n <= 0 || c <= 0 || hw <= 0) return MGPU__CU_OK;
    batch_norm_backward_kernel<<<blocks_for(c, 1), kThreads, 0, as_stream(stream)>>>(n, c, hw, x, dy, weight, save_mean,
                                                                                   save_rstd, mode, sync, dweight, dbias,
                                                                                   dx);
    CHECK_LAUNCH("batch_norm_backward", dev);
    return MGPU__CU_OK;
}

// Global average pooling's backward: dx[p, i] = dy[p] * scale, a thread per element of dx.
struct spread_op {
    int64_t hw;
    const float* dy;
    float scale;
    float* dx;
    template <class I> __device__ void operator()(I idx) const { dx[idx] = dy[(int64_t)idx / hw] * scale; }
};
int mgpu__cu_spread(int dev, void* stream, int64_t planes, int64_t hw, const float* dy, float scale, float* dx) {
    USE_DEVICE(dev);
    if (hw <= 0) return MGPU__CU_OK;
    return launch_index(dev, stream, "spread", planes * hw, spread_op{hw, dy, scale, dx});
}

// ---- >>layers attention: causal self-attention's core, a warp per row (as softmax_kernel<32>).
// The row of att (or dscores) in global memory is the warp's scratch, so any T fits; a lane
// writes it, __syncwarp, then every lane reads it. Each output element is one lane's sum in
// order s = 0, 1, ... (or t = s, s + 1, ...), and the row sums are warp_reduce's fixed tree:
// deterministic, no atomics.
struct attn_index {   // row r of [batch, heads, t]: its b, b * heads + h, h and t
    int64_t b, bh;
    int h, t;
};
__device__ __forceinline__ attn_index attn_row(const mgpu__attn& g, int64_t r) {
    attn_index ix;
    ix.t = (int)(r % g.t);
    ix.bh = r / g.t;
    ix.h = (int)(ix.bh % g.heads);
    ix.b = ix.bh / g.heads;
    return ix;
}

__global__ void __launch_bounds__(kThreads)
attention_forward_kernel(mgpu__attn g, const float* qkv, float* att, float* y, float* mask, uint64_t seed,
                         const uint64_t* seed_at, uint64_t offset, uint64_t first, float p) {
    constexpr int kRowsPerBlock = kThreads / 32;
    const int lane = threadIdx.x & 31, hs = g.head_size;
    const int64_t T = g.t, D = (int64_t)g.heads * hs, W = 3 * D, rows = (int64_t)g.batch * g.heads * T;
    const uint64_t key = mask && seed_at ? *seed_at : seed;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const attn_index ix = attn_row(g, r);
        const int t = ix.t;
        const float* base = qkv + ix.b * T * W + (int64_t)ix.h * hs;   // q of row 0; k at + D, v at + 2 D
        const float* q = base + t * W;
        float* a = att + r * T;
        float* mk = mask ? mask + r * T : nullptr;
        float m = -INFINITY;
        for (int s = lane; s <= t; s += 32) {
            const float* k = base + s * W + D;
            float dot = 0.0f;
            for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
            a[s] = dot * g.scale;
            m = fmaxf(m, a[s]);
        }
        m = group_reduce<32>(m, max_op());
        float sum = 0.0f;
        for (int s = lane; s <= t; s += 32) {
            a[s] = mgpu__expf(a[s] - m);   // max subtracted: no overflow; the CPU's exp (>>seam)
            sum += a[s];
        }
        sum = group_reduce<32>(sum, sum_op<float>());
        for (int s = lane; s <= t; s += 32) a[s] /= sum;
        for (int s = t + 1 + lane; s < T; s += 32) a[s] = 0.0f;   // the causal mask: exp(-inf)
        if (mk)
            for (int s = lane; s < T; s += 32)
                mk[s] = s <= t ? mgpu__dropout_scale(key, offset, first + (uint64_t)(r * T + s), p) : 0.0f;
        __syncwarp();   // every lane's a[s] and mk[s] written before any lane reads the whole row
        float* yr = y + (ix.b * T + t) * D + (int64_t)ix.h * hs;
        for (int d = lane; d < hs; d += 32) {
            float acc = 0.0f;
            for (int s = 0; s <= t; ++s) acc += (mk ? a[s] * mk[s] : a[s]) * base[s * W + 2 * D + d];
            yr[d] = acc;
        }
        __syncwarp();   // the row's reads done before the warp's next row (none shares memory, but cheap)
    }
}

// By query rows: dS = att .* (dP - rowsum(dP .* att)) * scale, dP = (dy v^T) .* mask; dq = dS k.
__global__ void __launch_bounds__(kThreads)
attention_backward_query_kernel(mgpu__attn g, const float* qkv, const float* att, const float* mask, const float* dy,
                                float* dscores, float* dqkv) {
    constexpr int kRowsPerBlock = kThreads / 32;
    const int lane = threadIdx.x & 31, hs = g.head_size;
    const int64_t T = g.t, D = (int64_t)g.heads * hs, W = 3 * D, rows = (int64_t)g.batch * g.heads * T;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const attn_index ix = attn_row(g, r);
        const int t = ix.t;
        const float* base = qkv + ix.b * T * W + (int64_t)ix.h * hs;
        const float* a = att + r * T;
        const float* mk = mask ? mask + r * T : nullptr;
        const float* dyr = dy + (ix.b * T + t) * D + (int64_t)ix.h * hs;
        float* ds = dscores + r * T;
        float rs = 0.0f;
        for (int s = lane; s <= t; s += 32) {
            const float* v = base + s * W + 2 * D;
            float da = 0.0f;
            for (int d = 0; d < hs; ++d) da += dyr[d] * v[d];
            ds[s] = mk ? da * mk[s] : da;   // d att before the dropout
            rs += ds[s] * a[s];
        }
        rs = group_reduce<32>(rs, sum_op<float>());
        for (int s = lane; s <= t; s += 32) ds[s] = a[s] * (ds[s] - rs) * g.scale;   // this lane's own entries
        for (int s = t + 1 + lane; s < T; s += 32) ds[s] = 0.0f;
        __syncwarp();
        float* dq = dqkv + (ix.b * T + t) * W + (int64_t)ix.h * hs;
        for (int d = lane; d < hs; d += 32) {
            float acc = 0.0f;
            for (int s = 0; s <= t; ++s) acc += ds[s] * base[s * W + D + d];
            dq[d] = acc;
        }
        __syncwarp();
    }
}

// By key rows s: dk = dS^T q and dv = (att .* mask)^T dy, down column s from the diagonal (all of
// dscores is written by the kernel before, on the same stream).
__global__ void __launch_bounds__(kThreads)
attention_backward_key_kernel(mgpu__attn g, const float* qkv, const float* att, const float* mask, const float* dy,
                              const float* dscores, float* dqkv) {
    constexpr int kRowsPerBlock = kThreads / 32;
    const int lane = threadIdx.x & 31, hs = g.head_size;
    const int64_t T = g.t, D = (int64_t)g.heads * hs, W = 3 * D, rows = (int64_t)g.batch * g.heads * T;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const attn_index ix = attn_row(g, r);
        const int s = ix.t;
        const float* base = qkv + ix.b * T * W + (int64_t)ix.h * hs;
        const float* dybase = dy + ix.b * T * D + (int64_t)ix.h * hs;
        float* dk = dqkv + (ix.b * T + s) * W + D + (int64_t)ix.h * hs;
        for (int d = lane; d < hs; d += 32) {
            float acc_k = 0.0f, acc_v = 0.0f;
            for (int64_t t = s; t < T; ++t) {
                const int64_t at = (ix.bh * T + t) * T + s;
                acc_k += dscores[at] * base[t * W + d];
                acc_v += (mask ? att[at] * mask[at] : att[at]) * dybase[t * D + d];
            }
            dk[d] = acc_k;
            dk[D + d] = acc_v;
        }
    }
}

int mgpu__cu_attention_forward(int dev, void* stream, const mgpu__attn* g, const float* qkv, float* att, float* y,
                               float* mask, uint64_t seed, const uint64_t* seed_on_device, uint64_t offset,
                               uint64_t first, float p) {
    USE_DEVICE(dev);
    const int64_t rows = (int64_t)g->batch * g->heads * g->t;
    if (rows <= 0) return MGPU__CU_OK;
    attention_forward_kernel<<<blocks_for(rows, kThreads / 32), kThreads, 0, as_stream(stream)>>>(
        *g, qkv, att, y, mask, seed, seed_on_device, offset, first, p);
    CHECK_LAUNCH("attention_forward", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_attention_backward(int dev, void* stream, const mgpu__attn* g, const float* qkv, const float* att,
                                const float* mask, const float* dy, float* dscores, float* dqkv) {
    USE_DEVICE(dev);
    const int64_t rows = (int64_t)g->batch * g->heads * g->t;
    if (rows <= 0) return MGPU__CU_OK;
    const unsigned blocks = blocks_for(rows, kThreads / 32);
    attention_backward_query_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(*g, qkv, att, mask, dy, dscores, dqkv);
    CHECK_LAUNCH("attention_backward_query", dev);
    attention_backward_key_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(*g, qkv, att, mask, dy, dscores, dqkv);
    CHECK_LAUNCH("attention_backward_key", dev);
    return MGPU__CU_OK;
}

// ---- >>layers attention, fused: FlashAttention-2's way, on CUDA cores for now. A block takes one
// tile of 32 rows of one (batch, head), a warp 4 of them; the other side's rows pass through
// shared memory in tiles of 32, a lane each. Forward keeps each row's running max m, sum l and
// output (rescaled by e^(m_old - m_new) as the max grows) and writes y and lse = m + log l; the
// T x T scores exist only a tile at a time. Backward recomputes them from q, k and lse: one
// kernel by query tiles (dq, and drow = rowsum(dy .* y)), one by key tiles (dk and dv), so that
// every output is one warp's sums in a fixed order: deterministic, no atomics. The dropout mask
// is drawn again from its counters. Terms above the diagonal are skipped, as the unfused kernels
// skip them. Head sizes up to kAttnMaxHead (the layer takes the unfused kernels above it), each
// kernel compiled for H = 64 and H = 128 columns a row (the smallest that holds the head): its
// tiles in dynamic shared memory, 4 tiles of 32 x 129 floats (66 KB) at H = 128, past the 48 KB a
// block gets without asking: allowed once per device (attention_fused_ready), where the device has
// it (Volta's 96 KB, Ampere's and Hopper's more). Turing's 64 KB does not hold them: there the
// calls return MGPU__CU_NO_ALGORITHM, and the layer runs the unfused kernels.
constexpr int kAttnTile = 32;
constexpr int kAttnMaxHead = MGPU__CU_ATTN_FUSED_MAX_HEAD;
constexpr int kAttnRowsPerWarp = kAttnTile / (kThreads / 32);
static_assert(kAttnMaxHead == 128 && kAttnTile == 32 && kAttnTile % (kThreads / 32) == 0,
              "a lane per row of a tile, H = 64 or 128 columns (whole columns per lane), whole rows per warp");

// Tile i of a kernel's dynamic shared memory: 32 rows of H + 1 floats (+ 1: lanes reading rows
// hit distinct banks). The bytes a kernel of `tiles` tiles and `extra` more floats asks for.
template <int H> __device__ __forceinline__ float (*attn_tile(float* shared, int i))[H + 1] {
    return reinterpret_cast<float (*)[H + 1]>(shared + (size_t)i * kAttnTile * (H + 1));
}
template <int H> constexpr size_t attn_shared_bytes(int tiles, int extra) {
    return ((size_t)tiles * kAttnTile * (H + 1) + extra) * sizeof(float);
}

// rows first .. first + 31 of one head's q, k, v or dy (src: its row 0; stride between rows),
// zeros past T (so no lane reads past the tensor)
template <int H> __device__ void attn_load(float (*tile)[H + 1], const float* src, int64_t stride, int first, int T, int hs) {
    for (int i = threadIdx.x; i < kAttnTile * H; i += kThreads) {
        const int r = i / H, d = i % H;
        tile[r][d] = first + r < T && d < hs ? src[(int64_t)(first + r) * stride + d] : 0.0f;
    }
}
// key tile kt's k and v rows (base: the head's q of row 0), between barriers: every reader of the
// last tile done before, every row written after
template <int H>
__device__ void attn_load_keys(float (*ks)[H + 1], float (*vs)[H + 1], const float* base, int64_t D, int kt, int T, int hs) {
    __syncthreads();
    attn_load<H>(ks, base + D, 3 * D, kt * kAttnTile, T, hs);
    attn_load<H>(vs, base + 2 * D, 3 * D, kt * kAttnTile, T, hs);
    __syncthreads();
}
__device__ __forceinline__ float attn_dot(const float* a, const float* b, int hs) {
    float acc = 0.0f;
    for (int d = 0; d < hs; ++d) acc += a[d] * b[d];
    return acc;
}
// the dropout scale of probability (t, s) of head bh, as the unfused kernels number it
__device__ __forceinline__ float attn_keep(uint64_t key, uint64_t offset, uint64_t first, float p, int64_t bh, int T,
                                           int t, int s) {
    return p > 0.0f ? mgpu__dropout_scale(key, offset, first + (uint64_t)((bh * T + t) * T + s), p) : 1.0f;
}

template <int H>
__global__ void __launch_bounds__(kThreads)
attention_fused_forward_kernel(mgpu__attn g, const float* qkv, float* y, float* lse, uint64_t seed, const uint64_t* seed_at,
                               uint64_t offset, uint64_t first, float p) {
    extern __shared__ float attn_shared[];
    float (*qs)[H + 1] = attn_tile<H>(attn_shared, 0), (*ks)[H + 1] = attn_tile<H>(attn_shared, 1),
          (*vs)[H + 1] = attn_tile<H>(attn_shared, 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, hs = g.head_size, T = g.t;
    const int64_t D = (int64_t)g.heads * hs, W = 3 * D;
    const int tiles = (T + kAttnTile - 1) / kAttnTile;
    const uint64_t key = p > 0.0f && seed_at ? *seed_at : seed;
    for (int64_t blk = blockIdx.x; blk < (int64_t)g.batch * g.heads * tiles; blk += gridDim.x) {
        const int64_t bh = blk / tiles, b = bh / g.heads;
        const int qt = (int)(blk % tiles), h = (int)(bh % g.heads);
        const float* base = qkv + b * T * W + (int64_t)h * hs;   // q of row 0; k at + D, v at + 2 D
        float m[kAttnRowsPerWarp], l[kAttnRowsPerWarp], acc[kAttnRowsPerWarp][H / 32];
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i) {
            m[i] = -INFINITY;
            l[i] = 0.0f;
#pragma unroll
            for (int c = 0; c < H / 32; ++c) acc[i][c] = 0.0f;
        }
        __syncthreads();   // the last tile's readers are done
        attn_load<H>(qs, base, W, qt * kAttnTile, T, hs);
        for (int kt = 0; kt <= qt; ++kt) {
            attn_load_keys<H>(ks, vs, base, D, kt, T, hs);
            const int s = kt * kAttnTile + lane;
#pragma unroll
            for (int i = 0; i < kAttnRowsPerWarp; ++i) {
                const int r = warp * kAttnRowsPerWarp + i, t = qt * kAttnTile + r;
                if (t >= T) break;   // the same for the whole warp
                const bool on = s <= t;
                const float score = on ? attn_dot(qs[r], ks[lane], hs) * g.scale : -INFINITY;
                const float m_new = fmaxf(m[i], group_reduce<32>(score, max_op()));   // finite: key kt * 32 <= t
                const float e = on ? mgpu__expf(score - m_new) : 0.0f;
                const float rescale = mgpu__expf(m[i] - m_new);   // 0 for the first tile (m = -inf)
                const float pd = on ? e * attn_keep(key, offset, first, p, bh, T, t, s) : 0.0f;
                l[i] = l[i] * rescale + group_reduce<32>(e, sum_op<float>());
#pragma unroll
                for (int c = 0; c < H / 32; ++c) acc[i][c] *= rescale;
                for (int j = 0; j <= min(kAttnTile - 1, t - kt * kAttnTile); ++j) {
                    const float pj = __shfl_sync(0xffffffffu, pd, j);
#pragma unroll
                    for (int c = 0; c < H / 32; ++c) acc[i][c] += pj * vs[j][lane + 32 * c];
                }
                m[i] = m_new;
            }
        }
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i) {
            const int t = qt * kAttnTile + warp * kAttnRowsPerWarp + i;
            if (t >= T) break;
            float* yr = y + (b * T + t) * D + (int64_t)h * hs;
#pragma unroll
            for (int c = 0; c < H / 32; ++c)
                if (lane + 32 * c < hs) yr[lane + 32 * c] = acc[i][c] / l[i];
            if (lane == 0) lse[bh * T + t] = m[i] + logf(l[i]);
        }
    }
}

// By query tiles: drow = rowsum(dy .* y); dS = P .* (dP - drow) * scale with P = e^(score - lse)
// and dP = (dy v^T) .* mask; dq = dS k.
template <int H>
__global__ void __launch_bounds__(kThreads)
attention_fused_backward_query_kernel(mgpu__attn g, const float* qkv, const float* y, const float* lse, const float* dy,
                                      float* drow, float* dqkv, uint64_t seed, const uint64_t* seed_at, uint64_t offset,
                                      uint64_t first, float p) {
    extern __shared__ float attn_shared[];
    float (*qs)[H + 1] = attn_tile<H>(attn_shared, 0), (*dys)[H + 1] = attn_tile<H>(attn_shared, 1),
          (*ks)[H + 1] = attn_tile<H>(attn_shared, 2), (*vs)[H + 1] = attn_tile<H>(attn_shared, 3);
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, hs = g.head_size, T = g.t;
    const int64_t D = (int64_t)g.heads * hs, W = 3 * D;
    const int tiles = (T + kAttnTile - 1) / kAttnTile;
    const uint64_t key = p > 0.0f && seed_at ? *seed_at : seed;
    for (int64_t blk = blockIdx.x; blk < (int64_t)g.batch * g.heads * tiles; blk += gridDim.x) {
        const int64_t bh = blk / tiles, b = bh / g.heads;
        const int qt = (int)(blk % tiles), h = (int)(bh % g.heads);
        const float* base = qkv + b * T * W + (int64_t)h * hs;
        float rs[kAttnRowsPerWarp], ls[kAttnRowsPerWarp], acc[kAttnRowsPerWarp][H / 32];
        __syncthreads();
        attn_load<H>(qs, base, W, qt * kAttnTile, T, hs);
        attn_load<H>(dys, dy + b * T * D + (int64_t)h * hs, D, qt * kAttnTile, T, hs);
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i) {
            const int t = qt * kAttnTile + warp * kAttnRowsPerWarp + i;
            float part = 0.0f;
#pragma unroll
            for (int c = 0; c < H / 32; ++c) acc[i][c] = 0.0f;
            if (t >= T) { rs[i] = ls[i] = 0.0f; continue; }
            const float* yr = y + (b * T + t) * D + (int64_t)h * hs;
            const float* dyr = dy + (b * T + t) * D + (int64_t)h * hs;
            for (int d = lane; d < hs; d += 32) part += dyr[d] * yr[d];
            rs[i] = group_reduce<32>(part, sum_op<float>());
            ls[i] = lse[bh * T + t];
            if (lane == 0) drow[bh * T + t] = rs[i];
        }
        for (int kt = 0; kt <= qt; ++kt) {
            attn_load_keys<H>(ks, vs, base, D, kt, T, hs);
            const int s = kt * kAttnTile + lane;
#pragma unroll
            for (int i = 0; i < kAttnRowsPerWarp; ++i) {
                const int r = warp * kAttnRowsPerWarp + i, t = qt * kAttnTile + r;
                if (t >= T) break;
                const bool on = s <= t;
                const float pr = on ? mgpu__expf(attn_dot(qs[r], ks[lane], hs) * g.scale - ls[i]) : 0.0f;
                const float dp = on ? attn_dot(dys[r], vs[lane], hs) * attn_keep(key, offset, first, p, bh, T, t, s) : 0.0f;
                const float ds = pr * (dp - rs[i]) * g.scale;
                for (int j = 0; j <= min(kAttnTile - 1, t - kt * kAttnTile); ++j) {
                    const float dj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                    for (int c = 0; c < H / 32; ++c) acc[i][c] += dj * ks[j][lane + 32 * c];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i) {
            const int t = qt * kAttnTile + warp * kAttnRowsPerWarp + i;
            if (t >= T) break;
            float* dq = dqkv + (b * T + t) * W + (int64_t)h * hs;
#pragma unroll
            for (int c = 0; c < H / 32; ++c)
                if (lane + 32 * c < hs) dq[lane + 32 * c] = acc[i][c];
        }
    }
}

// By key tiles, after the query kernel's drow: dk = dS^T q and dv = (P .* mask)^T dy, over the
// query tiles from the diagonal down, a lane per query.
template <int H>
__global__ void __launch_bounds__(kThreads)
attention_fused_backward_key_kernel(mgpu__attn g, const float* qkv, const float* lse, const float* dy, const float* drow,
                                    float* dqkv, uint64_t seed, const uint64_t* seed_at, uint64_t offset, uint64_t first,
                                    float p) {
    extern __shared__ float attn_shared[];
    float (*ks)[H + 1] = attn_tile<H>(attn_shared, 0), (*vs)[H + 1] = attn_tile<H>(attn_shared, 1),
          (*qs)[H + 1] = attn_tile<H>(attn_shared, 2), (*dys)[H + 1] = attn_tile<H>(attn_shared, 3);
    float *ls = attn_shared + 4 * kAttnTile * (H + 1), *rs = ls + kAttnTile;   // after the tiles (attn_key_bytes)
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, hs = g.head_size, T = g.t;
    const int64_t D = (int64_t)g.heads * hs, W = 3 * D;
    const int tiles = (T + kAttnTile - 1) / kAttnTile;
    const uint64_t key = p > 0.0f && seed_at ? *seed_at : seed;
    for (int64_t blk = blockIdx.x; blk < (int64_t)g.batch * g.heads * tiles; blk += gridDim.x) {
        const int64_t bh = blk / tiles, b = bh / g.heads;
        const int kt = (int)(blk % tiles), h = (int)(bh % g.heads);
        const float* base = qkv + b * T * W + (int64_t)h * hs;
        float dk[kAttnRowsPerWarp][H / 32], dv[kAttnRowsPerWarp][H / 32];
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i)
#pragma unroll
            for (int c = 0; c < H / 32; ++c) dk[i][c] = dv[i][c] = 0.0f;
        attn_load_keys<H>(ks, vs, base, D, kt, T, hs);   // this block's keys, for every query tile
        for (int qt = kt; qt < tiles; ++qt) {
            __syncthreads();
            attn_load<H>(qs, base, W, qt * kAttnTile, T, hs);
            attn_load<H>(dys, dy + b * T * D + (int64_t)h * hs, D, qt * kAttnTile, T, hs);
            if (threadIdx.x < kAttnTile) {
                const int t = qt * kAttnTile + threadIdx.x;
                ls[threadIdx.x] = t < T ? lse[bh * T + t] : 0.0f;
                rs[threadIdx.x] = t < T ? drow[bh * T + t] : 0.0f;
            }
            __syncthreads();
            const int t = qt * kAttnTile + lane;
#pragma unroll
            for (int i = 0; i < kAttnRowsPerWarp; ++i) {
                const int r = warp * kAttnRowsPerWarp + i, s = kt * kAttnTile + r;
                if (s >= T) break;
                const bool on = t < T && t >= s;
                const float pr = on ? mgpu__expf(attn_dot(qs[lane], ks[r], hs) * g.scale - ls[lane]) : 0.0f;
                const float keep = on ? attn_keep(key, offset, first, p, bh, T, t, s) : 0.0f;
                const float dp = on ? attn_dot(dys[lane], vs[r], hs) * keep : 0.0f;
                const float ds = pr * (dp - rs[lane]) * g.scale, pd = pr * keep;
                for (int j = max(0, s - qt * kAttnTile); j <= min(kAttnTile - 1, T - 1 - qt * kAttnTile); ++j) {
                    const float dj = __shfl_sync(0xffffffffu, ds, j), pj = __shfl_sync(0xffffffffu, pd, j);
#pragma unroll
                    for (int c = 0; c < H / 32; ++c) {
                        dk[i][c] += dj * qs[j][lane + 32 * c];
                        dv[i][c] += pj * dys[j][lane + 32 * c];
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kAttnRowsPerWarp; ++i) {
            const int s = kt * kAttnTile + warp * kAttnRowsPerWarp + i;
            if (s >= T) break;
            float* dkr = dqkv + (b * T + s) * W + D + (int64_t)h * hs;
#pragma unroll
            for (int c = 0; c < H / 32; ++c)
                if (lane + 32 * c < hs) {
                    dkr[lane + 32 * c] = dk[i][c];
                    dkr[D + lane + 32 * c] = dv[i][c];
                }
        }
    }
}

// The shared memory the three kernels for H columns a row ask for
template <int H> constexpr size_t attn_forward_bytes() { return attn_shared_bytes<H>(3, 0); }
template <int H> constexpr size_t attn_query_bytes() { return attn_shared_bytes<H>(4, 0); }
template <int H> constexpr size_t attn_key_bytes() { return attn_shared_bytes<H>(4, 2 * kAttnTile); }
static_assert(attn_key_bytes<64>() <= 48 * 1024, "the H = 64 kernels fit in the shared memory every block gets");

// Whether device dev (the current one) runs the fused kernels for g's head size: MGPU__CU_OK,
// MGPU__CU_NO_ALGORITHM (the caller's unfused kernels run), or an error. Heads above 64 need the
// H = 128 kernels: the first call per device asks it for its largest shared memory per block and,
// where that holds them, allows it to each (cudaFuncSetAttribute is per device and costs a driver
// call, so once); later calls read the answer.
static int attention_fused_ready(int dev, const mgpu__attn* g) {
    static std::mutex mu;
    static signed char known[64];   // per device: 1 ready, -1 too little, 0 not asked yet
    const size_t want = attn_key_bytes<128>();
    if (g->head_size > kAttnMaxHead) return ARGUMENT_ERROR("fused attention with head size %d > %d", g->head_size, kAttnMaxHead);
    if (g->head_size <= 64) return MGPU__CU_OK;
    std::lock_guard<std::mutex> lock(mu);
    if (dev >= 0 && dev < 64 && known[dev]) return known[dev] > 0 ? MGPU__CU_OK : MGPU__CU_NO_ALGORITHM;
    int optin = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin) on device %d", dev);
    const bool ready = (size_t)optin >= want;
    if (ready) {
        const char* name = "attention_fused_forward";
        cudaError_t e = cudaFuncSetAttribute(attention_fused_forward_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)attn_forward_bytes<128>());
        if (e == cudaSuccess) {
            name = "attention_fused_backward_query";
            e = cudaFuncSetAttribute(attention_fused_backward_query_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)attn_query_bytes<128>());
        }
        if (e == cudaSuccess) {
            name = "attention_fused_backward_key";
            e = cudaFuncSetAttribute(attention_fused_backward_key_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)attn_key_bytes<128>());
        }
        CUDA_TRY(e, "cudaFuncSetAttribute(%s, its shared memory) on device %d", name, dev);
    }
    if (dev >= 0 && dev < 64) known[dev] = ready ? 1 : -1;
    return ready ? MGPU__CU_OK : MGPU__CU_NO_ALGORITHM;
}

// The kernels for H columns a row (after attention_fused_ready). blocks: (batch, head, query or
// key tile) triples.
template <int H>
static int attention_fused_forward_launch(int dev, cudaStream_t stream, const mgpu__attn* g, int64_t blocks, const float* qkv,
                                          float* y, float* lse, uint64_t seed, const uint64_t* seed_on_device,
                                          uint64_t offset, uint64_t first, float p) {
    const size_t bytes = attn_forward_bytes<H>();
    attention_fused_forward_kernel<H><<<blocks_for(blocks, 1), kThreads, bytes, stream>>>(*g, qkv, y, lse, seed, seed_on_device,
                                                                                         offset, first, p);
    CHECK_LAUNCH("attention_fused_forward", dev);
    return MGPU__CU_OK;
}
template <int H>
static int attention_fused_backward_launch(int dev, cudaStream_t stream, const mgpu__attn* g, int64_t blocks, const float* qkv,
                                           const float* y, const float* lse, const float* dy, float* drow, float* dqkv,
                                           uint64_t seed, const uint64_t* seed_on_device, uint64_t offset, uint64_t first,
                                           float p) {
    const size_t query_bytes = attn_query_bytes<H>(), key_bytes = attn_key_bytes<H>();
    attention_fused_backward_query_kernel<H><<<blocks_for(blocks, 1), kThreads, query_bytes, stream>>>(
        *g, qkv, y, lse, dy, drow, dqkv, seed, seed_on_device, offset, first, p);
    CHECK_LAUNCH("attention_fused_backward_query", dev);
    attention_fused_backward_key_kernel<H><<<blocks_for(blocks, 1), kThreads, key_bytes, stream>>>(
        *g, qkv, lse, dy, drow, dqkv, seed, seed_on_device, offset, first, p);
    CHECK_LAUNCH("attention_fused_backward_key", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_attention_fused_forward(int dev, void* stream, const mgpu__attn* g, const float* qkv, float* y, float* lse,
                                     uint64_t seed, const uint64_t* seed_on_device, uint64_t offset, uint64_t first, float p) {
    USE_DEVICE(dev);
    TRY(attention_fused_ready(dev, g));
    const int64_t blocks = (int64_t)g->batch * g->heads * ((g->t + kAttnTile - 1) / kAttnTile);
    if (blocks <= 0) return MGPU__CU_OK;
    return g->head_size <= 64
               ? attention_fused_forward_launch<64>(dev, as_stream(stream), g, blocks, qkv, y, lse, seed, seed_on_device, offset, first, p)
               : attention_fused_forward_launch<128>(dev, as_stream(stream), g, blocks, qkv, y, lse, seed, seed_on_device, offset, first, p);
}

int mgpu__cu_attention_fused_backward(int dev, void* stream, const mgpu__attn* g, const float* qkv, const float* y,
                                      const float* lse, const float* dy, float* drow, float* dqkv, uint64_t seed,
                                      const uint64_t* seed_on_device, uint64_t offset, uint64_t first, float p) {
    USE_DEVICE(dev);
    TRY(attention_fused_ready(dev, g));
    const int64_t blocks = (int64_t)g->batch * g->heads * ((g->t + kAttnTile - 1) / kAttnTile);
    if (blocks <= 0) return MGPU__CU_OK;
    return g->head_size <= 64 ? attention_fused_backward_launch<64>(dev, as_stream(stream), g, blocks, qkv, y, lse, dy, drow, dqkv,
                                                                    seed, seed_on_device, offset, first, p)
                              : attention_fused_backward_launch<128>(dev, as_stream(stream), g, blocks, qkv, y, lse, dy, drow,
                                                                     dqkv, seed, seed_on_device, offset, first, p);
}

// y[b][j][i] = x[b][i][j] through a 32 x 32 shared tile (33 columns wide, against bank conflicts),
// so that both the reads and the writes are coalesced. Blocks of 32 x 8 threads loop over tiles.
__global__ void __launch_bounds__(kThreads)
transpose_kernel(int64_t batch, int64_t rows, int64_t cols, const float* x, float* y) {
    __shared__ float tile[32][33];
    const int64_t tiles_r = (rows + 31) / 32, tiles_c = (cols + 31) / 32, tiles = batch * tiles_r * tiles_c;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int64_t b = t / (tiles_r * tiles_c), r0 = t / tiles_c % tiles_r * 32, c0 = t % tiles_c * 32;
        const float* xb = x + b * rows * cols;
        float* yb = y + b * rows * cols;
        for (int k = ty; k < 32; k += kThreads / 32)
            if (r0 + k < rows && c0 + tx < cols) tile[k][tx] = xb[(r0 + k) * cols + c0 + tx];
        __syncthreads();
        for (int k = ty; k < 32; k += kThreads / 32)
            if (c0 + k < cols && r0 + tx < rows) yb[(c0 + k) * rows + r0 + tx] = tile[tx][k];
        __syncthreads();
    }
}

int mgpu__cu_transpose(int dev, void* stream, int64_t batch, int64_t rows, int64_t cols,
                       const float* x, float* y) {
    USE_DEVICE(dev);
    if (batch <= 0 || rows <= 0 || cols <= 0) return MGPU__CU_OK;
    const uint64_t tiles = (uint64_t)batch * ((rows + 31) / 32) * ((cols + 31) / 32);
    transpose_kernel<<<blocks_for(tiles, 1), dim3(32, kThreads / 32), 0, as_stream(stream)>>>(batch, rows, cols, x, y);
    CHECK_LAUNCH("transpose", dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>layer transformer  LayerNorm and Embedding. Every sum has a fixed order (no atomics), so a
//                      replayed graph and the replicas of data parallelism give the same bits.
// ============================================================================================
// LayerNorm forward, one row per group of G threads (a warp for rows up to 1024 wide, else the
// block): the mean, then the variance as the mean of (x - mean)^2 (two passes: no cancellation).
template <int G>
__global__ void __launch_bounds__(kThreads) layer_norm_kernel(int64_t rows, int cols, float eps, const float* x,
                                                              const float* w, const float* b, float* y, float* mean,
                                                              float* rstd) {
    constexpr int kRowsPerBlock = kThreads / G;
    const int lane = threadIdx.x % G;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / G; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const float* xr = x + r * cols;
        float s = 0.0f;
        for (int j = lane; j < cols; j += G) s += xr[j];
        const float m = group_reduce<G>(s, sum_op<float>()) / (float)cols;
        float v = 0.0f;
        for (int j = lane; j < cols; j += G) {
            const float d = xr[j] - m;
            v += d * d;
        }
        const float rs = 1.0f / sqrtf(group_reduce<G>(v, sum_op<float>()) / (float)cols + eps);
        if (lane == 0) {
            mean[r] = m;
            rstd[r] = rs;
        }
        float* yr = y + r * cols;
        for (int j = lane; j < cols; j += G) yr[j] = (xr[j] - m) * rs * w[j] + b[j];
    }
}

// dx of LayerNorm, one row per group as above: g = dy * w, xhat = (x - mean) * rstd,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
template <int G>
__global__ void __launch_bounds__(kThreads) layer_norm_dx_kernel(int64_t rows, int cols, const float* x, const float* w,
                                                                 const float* mean, const float* rstd, const float* dy,
                                                                 float* dx) {
    constexpr int kRowsPerBlock = kThreads / G;
    const int lane = threadIdx.x % G;
    for (int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / G; r < rows;
         r += (int64_t)gridDim.x * kRowsPerBlock) {
        const float *xr = x + r * cols, *dyr = dy + r * cols, m = mean[r], rs = rstd[r];
        float s1 = 0.0f, s2 = 0.0f;
        for (int j = lane; j < cols; j += G) {
            const float g = dyr[j] * w[j];
            s1 += g;
            s2 += g * ((xr[j] - m) * rs);
        }
        const float a = group_reduce<G>(s1, sum_op<float>()) / (float)cols;
        const float c = group_reduce<G>(s2, sum_op<float>()) / (float)cols;
        float* dxr = dx + r * cols;
        for (int j = lane; j < cols; j += G) dxr[j] = rs * (dyr[j] * w[j] - a - (xr[j] - m) * rs * c);
    }
}

// dweight += sum over rows of dy * xhat, dbias += sum over rows of dy: column sums laid out as
// column_sum_kernel's (a block owns `width` adjacent columns, row groups stride down the rows and
// meet in shared memory in order), with xhat made on the fly from x, mean and rstd.
__global__ void __launch_bounds__(kThreads)
layer_norm_params_kernel(int64_t rows, int cols, int width, const float* x, const float* mean, const float* rstd,
                         const float* dy, float* dweight, float* dbias) {
    __shared__ float part_w[kThreads], part_b[kThreads];
    const int groups = kThreads / width, lane = threadIdx.x % width, group = threadIdx.x / width;
    for (int64_t c0 = (int64_t)blockIdx.x * width; c0 < cols; c0 += (int64_t)gridDim.x * width) {
        const int64_t c = c0 + lane;
        float sw = 0.0f, sb = 0.0f;
        if (group < groups && c < cols)
            for (int64_t r = group; r < rows; r += groups) {
                const float g = dy[r * cols + c];
                sb += g;
                sw += g * ((x[r * cols + c] - mean[r]) * rstd[r]);
            }
        part_w[threadIdx.x] = sw;
        part_b[threadIdx.x] = sb;
        __syncthreads();
        if (group == 0 && c < cols) {
            float tw = 0.0f, tb = 0.0f;
            for (int g = 0; g < groups; ++g) {
                tw += part_w[g * width + lane];
                tb += part_b[g * width + lane];
            }
            dweight[c] += tw;
            dbias[c] += tb;
        }
        __syncthreads();
    }
}

int mgpu__cu_layer_norm(int dev, void* stream, int64_t rows, int cols, float eps, const float* x,
                        const float* weight, const float* bias, float* y, float* mean, float* rstd) {
    USE_DEVICE(dev);
    if (rows <= 0 || cols <= 0) return MGPU__CU_OK;
    if (cols <= 1024)
        layer_norm_kernel<32><<<blocks_for(rows, kThreads / 32), kThreads, 0, as_stream(stream)>>>(
            rows, cols, eps, x, weight, bias, y, mean, rstd);
    else
        layer_norm_kernel<kThreads><<<blocks_for(rows, 1), kThreads, 0, as_stream(stream)>>>(
            rows, cols, eps, x, weight, bias, y, mean, rstd);
    CHECK_LAUNCH("layer_norm", dev);
    return MGPU__CU_OK;
}

int mgpu__cu_layer_norm_backward(int dev, void* stream, int64_t rows, int cols, const float* x, const float* weight,
                                 const float* mean, const float* rstd, const float* dy, float* dx,
                                 float* dweight, float* dbias) {
    USE_DEVICE(dev);
    if (rows <= 0 || cols <= 0) return MGPU__CU_OK;
    cudaStream_t s = as_stream(stream);
    const int width = cols < 32 ? cols : 32;
    layer_norm_params_kernel<<<blocks_for(cols, width), kThreads, 0, s>>>(rows, cols, width, x, mean, rstd, dy,
                                                                          dweight, dbias);
    CHECK_LAUNCH("layer_norm_backward (weight, bias)", dev);
    if (!dx) return MGPU__CU_OK;
    if (cols <= 1024)
        layer_norm_dx_kernel<32><<<blocks_for(rows, kThreads / 32), kThreads, 0, s>>>(rows, cols, x, weight, mean, rstd,
                                                                                    dy, dx);
    else
        layer_norm_dx_kernel<kThreads><<<blocks_for(rows, 1), kThreads, 0, s>>>(rows, cols, x, weight, mean, rstd, dy, dx);
    CHECK_LAUNCH("layer_norm_backward (dx)", dev);
    return MGPU__CU_OK;
}

// y[p, c] = weight[ids[p], c], one thread per output element; NaN for an id out of range (no
// sync can tell the host, so the loss that follows shows it)
struct embedding_op {
    int num, dim;
    const int32_t* ids;
    const float* weight;
    float* y;
    template <class I> __device__ void operator()(I i) const {
        const int32_t id = ids[i / (I)dim];
        y[i] = id >= 0 && id < num ? weight[(int64_t)id * dim + (int64_t)(i % (I)dim)] : NAN;
    }
};

int mgpu__cu_embedding(int dev, void* stream, int64_t n, int num, int dim, const int32_t* ids,
                       const float* weight, float* y) {
    USE_DEVICE(dev);
    if (dim <= 0) return MGPU__CU_OK;
    return launch_index(dev, stream, "embedding", n * dim, embedding_op{num, dim, ids, weight, y});
}

// dweight[v, :] += the dy rows of the positions whose id is v, in increasing position, without
// atomics: a block per vocabulary row v (grid-stride), a thread per column (256 at a time). The
// block reads the ids 256 at a time and marks the hits in shared memory; most chunks of a large
// vocabulary hold none and cost one read each, the others add their dy rows in order.
__global__ void __launch_bounds__(kThreads)
embedding_backward_kernel(int64_t n, int num, int dim, const int32_t* ids, const float* dy, float* dweight) {
    __shared__ int hit[kThreads];
    __shared__ int any;
    for (int v = blockIdx.x; v < num; v += gridDim.x)
        for (int c0 = 0; c0 < dim; c0 += kThreads) {
            const int c = c0 + threadIdx.x;
            float* dw = dweight + (int64_t)v * dim;
            float acc = c < dim ? dw[c] : 0.0f;   // onto the gradient itself, as the CPU adds
            for (int64_t p0 = 0; p0 < n; p0 += kThreads) {
                __syncthreads();   // every thread is done with the previous chunk's hit and any
                if (threadIdx.x == 0) any = 0;
                __syncthreads();
                const int64_t p = p0 + threadIdx.x;
                const int h = p < n && ids[p] == v;
                hit[threadIdx.x] = h;
                if (h) any = 1;   // the same value from every writer: no race on the result
                __syncthreads();
                if (!any || c >= dim) continue;
                const int count = n - p0 < kThreads ? (int)(n - p0) : kThreads;
                for (int k = 0; k < count; ++k)
                    if (hit[k]) acc += dy[(p0 + k) * dim + c];
            }
            if (c < dim) dw[c] = acc;
        }
}

int mgpu__cu_embedding_backward(int dev, void* stream, int64_t n, int num, int dim, const int32_t* ids,
                                const float* dy, float* dweight) {
    USE_DEVICE(dev);
    if (n <= 0 || num <= 0 || dim <= 0) return MGPU__CU_OK;
    embedding_backward_kernel<<<blocks_for(num, 1), kThreads, 0, as_stream(stream)>>>(n, num, dim, ids, dy, dweight);
    CHECK_LAUNCH("embedding_backward", dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>optimizers  one fused elementwise pass per step, the update rules from mgpu.h
// ============================================================================================
// The update's numbers are read from device memory (uploaded ahead of the step), so a step
// replayed from a CUDA graph uses its own learning rate and bias corrections; clipping's scale
// is written there on the device (clip_scale_kernel) before the update reads it. Parameter
// groups: an element in a no-decay range (edges, mgpu__edges_upto) takes the arguments with
// weight_decay 0; the pack's first element finds its range by a binary search over the small
// table, the next ones step on. Without edges every element takes `args` as before.
struct decay_groups {
    const int64_t* edges;
    int count;
    int64_t offset;   // element i is number offset + i among the edges (a zero1 shard's start)
    // index into the edges of element i (the number of edges <= offset + i), for a pack from i
    __device__ int first(size_t i) const { return count ? mgpu__edges_upto(edges, count, offset + (int64_t)i) : 0; }
    __device__ int next(int c, size_t i) const {
        while (c < count && edges[c] <= offset + (int64_t)i) ++c;
        return c;
    }
};

struct sgd_op {
    float* param;
    const float* grad;
    float* buf;   // NULL without momentum
    const mgpu__sgd_args* args;
    decay_groups groups;
    template <int V> __device__ float apply(size_t i) const {
        const mgpu__sgd_args a = *args;
        mgpu__sgd_args a0 = a;
        a0.weight_decay = 0.0f;
        pack<float, V> p = load<V>(param, i), b = {};
        const pack<float, V> g = load<V>(grad, i);
        if (buf) b = load<V>(buf, i);
        int c = groups.first(i);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            if (k) c = groups.next(c, i + k);
            mgpu__sgd_update(&p.v[k], g.v[k], &b.v[k], (c & 1) ? &a0 : &a);
        }
        store<V>(param, i, p);
        if (buf) store<V>(buf, i, b);
        return 0.0f;
    }
};

struct adamw_op {
    float* param;
    const float* grad;
    float* m;
    float* v;
    const mgpu__adamw_args* args;
    decay_groups groups;
    template <int V> __device__ float apply(size_t i) const {
        const mgpu__adamw_args a = *args;
        mgpu__adamw_args a0 = a;
        a0.weight_decay = 0.0f;
        pack<float, V> p = load<V>(param, i), mv = load<V>(m, i), vv = load<V>(v, i);
        const pack<float, V> g = load<V>(grad, i);
        int c = groups.first(i);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            if (k) c = groups.next(c, i + k);
            mgpu__adamw_update(&p.v[k], g.v[k], &mv.v[k], &vv.v[k], (c & 1) ? &a0 : &a);
        }
        store<V>(param, i, p);
        store<V>(m, i, mv);
        store<V>(v, i, vv);
        return 0.0f;
    }
};

int mgpu__cu_sgd(int dev, void* stream, size_t n, float* param, const float* grad, float* momentum_buf,
                 const mgpu__sgd_args* args, const int64_t* no_decay, int edge_count, int64_t first) {
    USE_DEVICE(dev);
    return launch_map(dev, stream, "sgd", n, sgd_op{param, grad, momentum_buf, args, decay_groups{no_decay, edge_count, first}},
                      vec4_ok(param, grad, momentum_buf));
}

int mgpu__cu_adamw(int dev, void* stream, size_t n, float* param, const float* grad, float* m, float* v,
                   const mgpu__adamw_args* args, const int64_t* no_decay, int edge_count, int64_t first) {
    USE_DEVICE(dev);
    return launch_map(dev, stream, "adamw", n, adamw_op{param, grad, m, v, args, decay_groups{no_decay, edge_count, first}},
                      vec4_ok(param, grad, m, v));
}

// Clipping by global norm, without the host: each thread adds the squares of its grid-stride
// elements in float64, a fixed tree per block, then one block adds the blocks' sums in order.
// The grid depends on n alone, and the accesses are scalar, so the order (and the bits) too.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(size_t n, const float* x, double* part) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) acc += (double)x[i] * (double)x[i];
    acc = block_reduce(acc, sum_op<double>());
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

int mgpu__cu_sum_squares(int dev, void* stream, size_t n, const float* x, double* sum, double* scratch) {
    USE_DEVICE(dev);
    cudaStream_t s = as_stream(stream);
    const unsigned blocks = n ? blocks_for(n, kThreads, MGPU__CU_REDUCE_SCRATCH) : 0;
    if (blocks) {
        sum_squares_kernel<<<blocks, kThreads, 0, s>>>(n, x, scratch);
        CHECK_LAUNCH("sum of squares", dev);
    }
    finish_kernel<double, double><<<1, kThreads, 0, s>>>(scratch, blocks, 1.0, sum);
    CHECK_LAUNCH("sum of squares (blocks)", dev);
    return MGPU__CU_OK;
}

// One thread: the stages' sums in stage order, so every stage of a replica gets the same norm.
__global__ void clip_scale_kernel(const double* sums, int count, float max_norm, float* norm, float* scale) {
    double total = 0.0;
    for (int i = 0; i < count; ++i) total += sums[i];
    const float nv = (float)sqrt(total);
    norm[0] = nv;
    scale[0] = mgpu__clip_scale(nv, max_norm);
}

int mgpu__cu_clip_scale(int dev, void* stream, const double* sums, int count, float max_norm, float* norm, float* scale) {
    USE_DEVICE(dev);
    clip_scale_kernel<<<1, 1, 0, as_stream(stream)>>>(sums, count, max_norm, norm, scale);
    CHECK_LAUNCH("clip scale", dev);
    return MGPU__CU_OK;
}

// ============================================================================================
// >>oneshot  the P2P backend's small-buffer (and one-GPU) all-reduce: one launch in all
// ============================================================================================
// Element i of every buffer is read and written by the same thread, so the buffers may be
// summed and overwritten in one pass without a race between replicas. The loads are unrolled
// over the largest replica count, so they are all in flight at once (across GPUs each is a
// round trip over the link), and then added in replica order.
struct oneshot_sum_op {
    float* buf[MGPU__CU_ONESHOT_MAX];
    int count;
    template <int V> __device__ float apply(size_t i) const {
        pack<float, V> x[MGPU__CU_ONESHOT_MAX];
#pragma unroll
        for (int r = 0; r < MGPU__CU_ONESHOT_MAX; ++r)
            if (r < count) x[r] = load<V>(buf[r], i);
#pragma unroll
        for (int r = 1; r < MGPU__CU_ONESHOT_MAX; ++r)
            if (r < count) {
#pragma unroll
                for (int k = 0; k < V; ++k) x[0].v[k] += x[r].v[k];
            }
#pragma unroll
        for (int r = 0; r < MGPU__CU_ONESHOT_MAX; ++r)
            if (r < count) store<V>(buf[r], i, x[0]);
        return 0.0f;
    }
};

int mgpu__cu_allreduce_oneshot(int dev, void* stream, float* const* bufs, int count, size_t n) {
    if (count < 1 || count > MGPU__CU_ONESHOT_MAX)
        return ARGUMENT_ERROR("one-shot all-reduce of %d buffers (at most %d)", count, MGPU__CU_ONESHOT_MAX);
    USE_DEVICE(dev);
    oneshot_sum_op op = {};
    bool vec4 = true;
    for (int r = 0; r < count; ++r) {
        op.buf[r] = bufs[r];
        vec4 = vec4 && vec4_ok(bufs[r]);
    }
    op.count = count;
    return launch_map(dev, stream, "allreduce_oneshot", n, op, vec4);
}

// ============================================================================================
// >>nccl  loaded with dlopen, so neither building nor running needs NCCL unless it is used.
//         The few declarations needed are copied from nccl.h (NCCL 2.x ABI).
// ============================================================================================
typedef struct ncclComm* ncclComm_t;
typedef int ncclResult_t;                          // an enum in nccl.h
typedef struct { char internal[MGPU__CU_NCCL_ID_BYTES]; } ncclUniqueId_bytes;   // ncclUniqueId, passed by value
enum { ncclSuccess = 0, ncclSum = 0, ncclFloat32 = 7 };

static struct {
    ncclResult_t (*CommInitAll)(ncclComm_t* comms, int count, const int* devs);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*AllReduce)(const void* send, void* recv, size_t count, int datatype, int op, ncclComm_t comm,
                              cudaStream_t stream);
    const char* (*GetErrorString)(ncclResult_t result);
    // across processes (optional: without them a job of processes sums through MPI)
    ncclResult_t (*GetUniqueId)(void* id);
    ncclResult_t (*CommInitRank)(ncclComm_t* comm, int nranks, ncclUniqueId_bytes id, int rank);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t* async_error);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    ncclResult_t (*Broadcast)(const void* send, void* recv, size_t count, int datatype, int root, ncclComm_t comm,
                              cudaStream_t stream);
    bool loaded, across_processes;
    char why[400];   // why it did not load
} nccl;

#ifdef _WIN32
// NCCL is built for Linux only: on Windows the P2P and host all-reduces serve.
static void nccl_load(void) {
    snprintf(nccl.why, sizeof nccl.why, "NCCL does not exist for Windows (the P2P and host all-reduce work there)");
}
#else
template <class F> static bool nccl_symbol(void* lib, const char* name, F* fn) {
    void* p = dlsym(lib, name);
    if (!p) snprintf(nccl.why, sizeof nccl.why, "the NCCL library has no symbol %s", name);
    *fn = reinterpret_cast<F>(p);
    return p != nullptr;
}

// MGPU_NCCL_LIBRARY names the library (say a pip-installed NCCL outside the loader's path);
// otherwise MGPU_NCCL_DEFAULT_LIBRARY: libnccl.so.2, then libnccl.so. The emulator's builds
// (tests/emu, make emu-program) name its own, libnccl_emu.so beside the program, so that a real
// NCCL installed on the machine is not what an emulated GPU loads.
#ifndef MGPU_NCCL_DEFAULT_LIBRARY
#define MGPU_NCCL_DEFAULT_LIBRARY "libnccl.so.2", "libnccl.so"
#endif
static void nccl_load(void) {
    const char* env = getenv("MGPU_NCCL_LIBRARY");
    const char* defaults[] = { MGPU_NCCL_DEFAULT_LIBRARY, NULL };
    const char* names[3] = { env && *env ? env : defaults[0], defaults[1], NULL };
    void* lib = NULL;
    size_t used = 0;
    for (int i = 0; !lib && names[i] && (i == 0 || !(env && *env)); ++i) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib && used < sizeof nccl.why) {   // every name tried, each with dlopen's reason
            const char* e = dlerror();
            int n = snprintf(nccl.why + used, sizeof nccl.why - used, "%sdlopen(\"%s\"%s): %s", i ? "; " : "", names[i],
                             env && *env ? ", from MGPU_NCCL_LIBRARY" : "", e ? e : "failed");
            used += n > 0 ? (size_t)n : 0;
        }
    }
    if (!lib) return;
    nccl.loaded = nccl_symbol(lib, "ncclCommInitAll", &nccl.CommInitAll) &&
                  nccl_symbol(lib, "ncclCommDestroy", &nccl.CommDestroy) &&
                  nccl_symbol(lib, "ncclGroupStart", &nccl.GroupStart) &&
                  nccl_symbol(lib, "ncclGroupEnd", &nccl.GroupEnd) &&
                  nccl_symbol(lib, "ncclAllReduce", &nccl.AllReduce) &&
                  nccl_symbol(lib, "ncclGetErrorString", &nccl.GetErrorString);
    if (!nccl.loaded) { (void)dlclose(lib); return; }
    char why[sizeof nccl.why];
    memcpy(why, nccl.why, sizeof why);   // the optional symbols' absence is no reason for the rest
    nccl.across_processes = nccl_symbol(lib, "ncclGetUniqueId", &nccl.GetUniqueId) &&
                            nccl_symbol(lib, "ncclCommInitRank", &nccl.CommInitRank) &&
                            nccl_symbol(lib, "ncclCommGetAsyncError", &nccl.CommGetAsyncError) &&
                            nccl_symbol(lib, "ncclCommAbort", &nccl.CommAbort) &&
                            nccl_symbol(lib, "ncclBroadcast", &nccl.Broadcast);
    memcpy(nccl.why, why, sizeof why);
}
#endif

// Loads NCCL on first use (once, thread-safe); fails with the reason when it is unavailable.
static int nccl_ready(void) {
    static std::once_flag once;
    std::call_once(once, nccl_load);
    if (nccl.loaded) return MGPU__CU_OK;
    return report(MGPU__CU_ERR_NCCL, NULL, NULL, __LINE__, "NCCL unavailable: %s", nccl.why);
}

static const char* nccl_name(ncclResult_t r) {
    static const char* const names[] = {"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError",
                                        "ncclInternalError", "ncclInvalidArgument", "ncclInvalidUsage",
                                        "ncclRemoteError", "ncclInProgress"};
    return r >= 0 && r < (int)(sizeof names / sizeof names[0]) ? names[r] : "ncclUnknownError";
}

#define NCCL_TRY(call, ...)                                                                       \
    do {                                                                                          \
        ncclResult_t r_ = (call);                                                                 \
        if (r_ != ncclSuccess)                                                                    \
            return report(MGPU__CU_ERR_NCCL, nccl_name(r_), nccl.GetErrorString(r_), __LINE__, __VA_ARGS__); \
    } while (0)

int mgpu__cu_nccl_available(void) { return nccl_ready() == MGPU__CU_OK; }

int mgpu__cu_nccl_comm_init_all(int count, const int* devs, void** comms) {
    TRY(nccl_ready());
    NCCL_TRY(nccl.CommInitAll(reinterpret_cast<ncclComm_t*>(comms), count, devs), "ncclCommInitAll(%d devices)", count);
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_comm_destroy(void* comm) {
    TRY(nccl_ready());
    if (comm) NCCL_TRY(nccl.CommDestroy((ncclComm_t)comm), "ncclCommDestroy(%p)", comm);
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_group_start(void) {
    TRY(nccl_ready());
    NCCL_TRY(nccl.GroupStart(), "ncclGroupStart()");
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_group_end(void) {
    TRY(nccl_ready());
    NCCL_TRY(nccl.GroupEnd(), "ncclGroupEnd()");
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_across_processes(void) { return nccl_ready() == MGPU__CU_OK && nccl.across_processes; }

int mgpu__cu_nccl_unique_id(void* id) {
    TRY(nccl_ready());
    NCCL_TRY(nccl.GetUniqueId(id), "ncclGetUniqueId()");
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_comm_init_ranks(const void* id, int nranks, int first, int count, const int* devs, void** comms) {
    TRY(nccl_ready());
    ncclUniqueId_bytes uid;
    memcpy(uid.internal, id, sizeof uid.internal);
    for (int i = 0; i < count; ++i) comms[i] = NULL;
    NCCL_TRY(nccl.GroupStart(), "ncclGroupStart()");   // one group: the ranks of one process wait for each other
    for (int i = 0; i < count; ++i) {
        const int rc = use_device(devs[i]);
        if (rc != MGPU__CU_OK) { (void)nccl.GroupEnd(); return rc; }
        ncclResult_t r = nccl.CommInitRank(reinterpret_cast<ncclComm_t*>(&comms[i]), nranks, uid, first + i);
        if (r != ncclSuccess) {
            (void)nccl.GroupEnd();
            return report(MGPU__CU_ERR_NCCL, nccl_name(r), nccl.GetErrorString(r), __LINE__,
                          "ncclCommInitRank(rank %d of %d) on device %d", first + i, nranks, devs[i]);
        }
    }
    NCCL_TRY(nccl.GroupEnd(), "ncclGroupEnd() after ncclCommInitRank of ranks %d to %d of %d", first, first + count - 1, nranks);
    return MGPU__CU_OK;
}

int mgpu__cu_nccl_comm_check(void* comm) {
    TRY(nccl_ready());
    ncclResult_t async_error = ncclSuccess;
    NCCL_TRY(nccl.CommGetAsyncError((ncclComm_t)comm, &async_error), "ncclCommGetAsyncError(%p)", comm);
    NCCL_TRY(async_error, "an earlier NCCL operation failed (ncclCommGetAsyncError)");
    return MGPU__CU_OK;
}

// A communicator whose collective will never finish (a peer gone): its kernels stopped, its
// resources freed, without waiting for the other ranks as ncclCommDestroy would.
int mgpu__cu_nccl_comm_abort(void* comm) {
    TRY(nccl_ready());
    if (comm) NCCL_TRY(nccl.CommAbort((ncclComm_t)comm), "ncclCommAbort(%p)", comm);
    return MGPU__CU_OK;
}

// Called between ncclGroupStart and ncclGroupEnd (mgpu.h does), as NCCL's examples of one thread
// with several GPUs do: NCCL makes each communicator's device current itself.
int mgpu__cu_nccl_allreduce_sum(int dev, void* comm, float* buf, size_t n, void* stream) {
    TRY(nccl_ready());
    NCCL_TRY(nccl.AllReduce(buf, buf, n, ncclFloat32, ncclSum, (ncclComm_t)comm, as_stream(stream)),
             "ncclAllReduce(%zu floats, in place) on device %d", n, dev);
    return MGPU__CU_OK;
}

// The same, for a broadcast from rank `root` (across processes: ZeRO-1's all-gather).
int mgpu__cu_nccl_broadcast(int dev, void* comm, float* buf, size_t n, int root, void* stream) {
    TRY(nccl_ready());
    if (!nccl.across_processes)
        return report(MGPU__CU_ERR_NCCL, NULL, NULL, __LINE__, "ncclBroadcast: this NCCL lacks the calls across processes");
    NCCL_TRY(nccl.Broadcast(buf, buf, n, ncclFloat32, root, (ncclComm_t)comm, as_stream(stream)),
             "ncclBroadcast(%zu floats from rank %d, in place) on device %d", n, root, dev);
    return MGPU__CU_OK;
}
