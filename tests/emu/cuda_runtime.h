/* tests/emu/cuda_runtime.h - the CUDA runtime subset mgpu_kernels.cu uses, for the GPU emulator.
   mgpu_kernels.cu is compiled as host C++ against this header (after tests/emu/cu2cpp.py turned
   its <<<...>>> launches into mgpu_emu::launch calls). Host API: declared here, implemented in
   tests/emu/runtime.cpp (libmgpuemu.so). Device side: the built-in variables and intrinsics the
   kernels use; the threads of a block run as fibers, so __syncthreads and the warp shuffles
   behave as on hardware (warpSize 32). */
#ifndef MGPU_EMU_CUDA_RUNTIME_H
#define MGPU_EMU_CUDA_RUNTIME_H
/* the real header declares the math functions too (sinf, expf...): a user's .cu file that
   calls them includes nothing more (examples/course/09_sin_kernel.cu) */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

/* ---- host API ------------------------------------------------------------------------------ */
enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorStubLibrary = 34,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorPeerAccessUnsupported = 217,
    cudaErrorPeerAccessAlreadyEnabled = 704,
    cudaErrorPeerAccessNotEnabled = 705,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchFailure = 719,
    cudaErrorIllegalState = 401,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureMerge = 902,
    cudaErrorStreamCaptureUnmatched = 903,
    cudaErrorStreamCaptureUnjoined = 904,
    cudaErrorStreamCaptureIsolation = 905,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorCapturedEvent = 907,
    cudaErrorStreamCaptureWrongThread = 908
};
typedef enum cudaError cudaError_t;

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;

enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
};
enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int major;
    int minor;
    int multiProcessorCount;
    int unifiedAddressing;
};

extern "C" {
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* dev);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int dev);
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int dev);   /* the one attribute emulated */
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaDeviceCanAccessPeer(int* can, int dev, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t bytes, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
/* a kernel's dynamic shared memory past MGPU_EMU_MAX_SHARED, up to MGPU_EMU_MAX_SHARED_OPTIN, on
   the current device (the only attribute emulated) */
cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value);
}
template <class T> static inline cudaError_t cudaFuncSetAttribute(T* entry, enum cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}
template <class T> static inline cudaError_t cudaMalloc(T** ptr, size_t bytes) { return cudaMalloc((void**)ptr, bytes); }
template <class T> static inline cudaError_t cudaHostAlloc(T** ptr, size_t bytes, unsigned int flags) {
    return cudaHostAlloc((void**)ptr, bytes, flags);
}

/* ---- device side ----------------------------------------------------------------------------- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
/* One copy per stream worker thread, and a worker runs one block at a time: per-block storage. */
#define __shared__ static thread_local
static constexpr int warpSize = 32;

namespace mgpu_emu {
struct thread_coords { uint3 thread, block; dim3 block_dim, grid_dim; };
extern thread_local thread_coords coords;

/* the launch: the kernel's name and where, its shape, and a body that runs one thread */
typedef void (*thread_body)(const void* args);
struct launch_cfg { dim3 grid, block; size_t shared; cudaStream_t stream; };
static inline launch_cfg cfg(dim3 grid, dim3 block, size_t shared = 0, cudaStream_t stream = 0) {
    return launch_cfg{grid, block, shared, stream};
}
/* the kernel function a launch names (cudaFuncSetAttribute's key) */
template <class F> static inline const void* entry(F* f) { return reinterpret_cast<const void*>(f); }
/* queues the launch of args (owned by the launch afterwards: destroy frees it); `words` are the
   values among the arguments that may be device pointers, checked against the stream's device,
   and `reads` says of each whether the kernel only reads through it (a pointer to const) */
void launch_raw(const char* name, const char* file, int line, const launch_cfg& c, const void* entry, void* args,
                const uintptr_t* words, const unsigned char* reads, size_t word_count, thread_body body, void (*destroy)(void*));
/* the running block's dynamic shared memory (cu2cpp.py turns `extern __shared__ T name[];` into a
   call of this): the launch's bytes, fresh for each block and filled with 0xFF bytes */
void* dynamic_shared(void);

/* The words of one argument that may hold a device pointer: a pointer itself, or each aligned
   word of a struct or union (a functor and its captures). Number arguments are skipped, and a
   struct's padding is cleared first: padding holds what the stack held before, and beside a
   float it can read as an address of some device. A struct's own number fields are still read
   as words: two ints whose upper one is near 32,600 could read as an address in another
   device's memory, which no functor of mgpu_kernels.cu holds. (With a compiler that lacks
   __builtin_clear_padding, a false report from padding stays possible, if rare.) */
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
#define MGPU_EMU_CLEARS_PADDING 1
#endif
#endif
template <class T> void pointer_words(const T& a, std::vector<uintptr_t>& out, std::vector<unsigned char>& reads) {
    if constexpr (std::is_pointer<T>::value) {
        out.push_back((uintptr_t)a);
        reads.push_back(std::is_const<typename std::remove_pointer<T>::type>::value);
    } else if constexpr (std::is_class<T>::value || std::is_union<T>::value) {
        static_assert(std::is_trivially_copyable<T>::value, "kernel arguments are copied byte for byte");
        alignas(T) unsigned char bytes[(sizeof(T) + 7) / 8 * 8] = {};
        memcpy(bytes, (const void*)&a, sizeof(T));
#ifdef MGPU_EMU_CLEARS_PADDING
        __builtin_clear_padding(reinterpret_cast<T*>(bytes));
#endif
        for (size_t off = 0; off + 8 <= sizeof bytes; off += 8) {
            uintptr_t v;
            memcpy(&v, bytes + off, 8);
            out.push_back(v);
            reads.push_back(0);   // (a functor's pointers: read or written, not known)
        }
    }
}

template <class K, class Tuple> struct launch_of {
    static void body(const void* a) {
        const auto* p = static_cast<const std::pair<K, Tuple>*>(a);
        std::apply(p->first, p->second);
    }
    static void destroy(void* a) { delete static_cast<std::pair<K, Tuple>*>(a); }
};
/* The kernel's arguments are copied at launch, as CUDA does; each thread gets them by const
   reference and the kernel's by-value parameters copy them again. */
template <class K, class... A>
void launch(const char* name, const char* file, int line, const launch_cfg& c, const void* fn, K kernel, const A&... args) {
    typedef std::tuple<typename std::decay<A>::type...> Tuple;
    typedef std::pair<K, Tuple> Pack;
    std::vector<uintptr_t> words;
    std::vector<unsigned char> reads;
    (pointer_words(typename std::decay<A>::type(args), words, reads), ...);
    Pack* p = new Pack(kernel, Tuple(args...));
    launch_raw(name, file, line, c, fn, p, words.data(), reads.data(), words.size(), &launch_of<K, Tuple>::body,
               &launch_of<K, Tuple>::destroy);
}

void syncthreads(void);
uint64_t shfl(unsigned mask, uint64_t bits, int kind, int arg, int width);
enum { SHFL_IDX = 0, SHFL_DOWN = 1, SHFL_XOR = 2, SHFL_UP = 3 };
template <class T> static inline T shfl_t(unsigned mask, T v, int kind, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = shfl(mask, bits, kind, arg, width);
    T r;
    memcpy(&r, &bits, sizeof r);
    return r;
}
}  // namespace mgpu_emu

#define threadIdx (mgpu_emu::coords.thread)
#define blockIdx (mgpu_emu::coords.block)
#define blockDim (mgpu_emu::coords.block_dim)
#define gridDim (mgpu_emu::coords.grid_dim)

static inline void __syncthreads(void) { mgpu_emu::syncthreads(); }
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) {
    return mgpu_emu::shfl_t(mask, v, mgpu_emu::SHFL_IDX, src, width);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return mgpu_emu::shfl_t(mask, v, mgpu_emu::SHFL_DOWN, (int)delta, width);
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return mgpu_emu::shfl_t(mask, v, mgpu_emu::SHFL_UP, (int)delta, width);
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    return mgpu_emu::shfl_t(mask, v, mgpu_emu::SHFL_XOR, lane_mask, width);
}

/* a barrier of the warp's lanes, and a fence between them: a full-warp shuffle is that here */
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mgpu_emu::shfl(mask, 0, mgpu_emu::SHFL_IDX, 0, warpSize); }

/* conversions with the hardware's saturation (NaN gives 0), and the integer min/max */
static inline int __float2int_rz(float x) {
    return x != x ? 0 : x >= 2147483648.0f ? 2147483647 : x <= -2147483648.0f ? (-2147483647 - 1) : (int)x;
}
static inline unsigned __float2uint_rz(float x) {
    return x != x || x <= 0.0f ? 0u : x >= 4294967296.0f ? 4294967295u : (unsigned)x;
}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
#endif
