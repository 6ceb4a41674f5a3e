// tests/emu/selfcheck.cu - kernels that check the GPU emulator itself (tests/emu/test_emu.c runs
// each in a child process): the shuffles and a barrier give hardware's results, and a divergent
// barrier, a shuffle with missing lanes, a deadlock, an out-of-bounds copy and a pointer of
// another device without peer access each stop the program with a report; stream capture and
// graphs replay what eager work computes, and a capture refuses what CUDA's refuses; async copies
// read pinned memory late and pageable memory at once. Plain CUDA: nvcc compiles it too (the
// emulator's counters are checked only in its build).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Per thread: __shfl_sync from lane 5, __shfl_down_sync by 1, __shfl_xor_sync by 3,
// __shfl_up_sync by 2, __shfl_down_sync by 4 within groups of 8, and the block's sum of v
// (a warp tree, then the warps' partials through shared memory after a barrier).
__global__ void shuffles_kernel(int* out) {
    __shared__ int part[32];
    const int t = threadIdx.x, lane = t & 31;
    const int v = t * 3 + 1;
    out[t * 6 + 0] = __shfl_sync(0xffffffffu, v, 5);
    out[t * 6 + 1] = __shfl_down_sync(0xffffffffu, v, 1);
    out[t * 6 + 2] = __shfl_xor_sync(0xffffffffu, v, 3);
    out[t * 6 + 3] = __shfl_up_sync(0xffffffffu, v, 2);
    out[t * 6 + 4] = __shfl_down_sync(0xffffffffu, v, 4, 8);
    int s = v;
    for (int d = 16; d > 0; d >>= 1) s += __shfl_down_sync(0xffffffffu, s, d);
    if (lane == 0) part[t >> 5] = s;
    __syncthreads();
    int total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += part[w];
    out[t * 6 + 5] = total;
}

__global__ void divergent_barrier_kernel(int* out) {
    if (threadIdx.x >= 128) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

__global__ void missing_lanes_kernel(int* out) {
    int x = (int)threadIdx.x;
    if ((threadIdx.x & 31) < 16) x = __shfl_down_sync(0xffffffffu, x, 1);
    out[threadIdx.x] = x;
}

__global__ void deadlock_kernel(int* out) {
    int x = (int)threadIdx.x;
    if (threadIdx.x == 0) __syncthreads();
    else x = __shfl_xor_sync(0xffffffffu, x, 1);
    out[threadIdx.x] = x;
}

__global__ void write_kernel(float* p) { p[threadIdx.x] = 1.0f; }

// n ints of dynamic shared memory, written by the block and read back in another order after a
// barrier: out[block][t] = the sum of i over the indices a thread reads (n - 1 - t, then down)
__global__ void dynamic_shared_kernel(int* out, int n) {
    extern __shared__ int dyn[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = (int)blockIdx.x * 100000 + i;
    __syncthreads();
    int s = 0;
    for (int i = n - 1 - (int)threadIdx.x; i >= 0; i -= blockDim.x) s += dyn[i] - (int)blockIdx.x * 100000;
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// A functor-like argument with padding after its float: the launch's pointer check must read
// only its values, never what the padding holds.
struct padded_write { float* p; float v; };
__global__ void padded_write_kernel(padded_write w) { w.p[threadIdx.x] = w.v; }

// mgpu_kernels.cu's kernels whose shared memory is reused across iterations of a grid-stride loop:
// sizes that make blocks loop, which the test suites' sizes do not reach (a missing
// __syncthreads between the iterations shows here); and the block-wide softmax.
extern "C" int mgpu__cu_transpose(int dev, void* stream, int64_t batch, int64_t rows, int64_t cols, const float* x,
                                  float* y);
extern "C" int mgpu__cu_channel_sum(int dev, void* stream, int64_t outer, int64_t channels, int64_t inner,
                                    int x_dtype, const void* x, float* out, float scale, int accumulate);   // as in mgpu.h's seam
extern "C" int mgpu__cu_softmax(int dev, void* stream, int rows, int cols, const float* x, float* y);

static int check(cudaError_t e, const char* what);

static float value_at(size_t i) { return (float)((i * 2654435761u) % 1000) * 0.001f - 0.5f; }

static int grid_loops(const char* which) {
    const bool transpose = !strcmp(which, "transpose"), column = !strcmp(which, "column_sum");
    // transpose: 65537 2x2 matrices (65537 tiles, so blocks 0 and 1 do two); column sums of
    // [3, 2097153] (65536 blocks of 32 columns would be needed); softmax of [3, 2000] rows (the
    // block-wide path)
    const size_t batch = 65537, cols = transpose ? 2 : column ? 2097153 : 2000, rows = transpose ? 2 : 3;
    const size_t n = transpose ? batch * rows * cols : rows * cols, out_n = column ? cols : n;
    float *x = nullptr, *y = nullptr;
    float* h = new float[n];
    float* r = new float[out_n];
    for (size_t i = 0; i < n; ++i) h[i] = value_at(i);
    if (check(cudaMalloc(&x, n * sizeof(float)), "cudaMalloc") || check(cudaMalloc(&y, out_n * sizeof(float)), "cudaMalloc"))
        return 1;
    if (check(cudaMemcpyAsync(x, h, n * sizeof(float), cudaMemcpyDefault, 0), "upload")) return 1;
    int rc = transpose ? mgpu__cu_transpose(0, nullptr, (int64_t)batch, (int64_t)rows, (int64_t)cols, x, y)
             : column  ? mgpu__cu_channel_sum(0, nullptr, (int64_t)rows, (int64_t)cols, 1, 0 /* MGPU_F32 */, x, y, 1.0f, 0)
                       : mgpu__cu_softmax(0, nullptr, (int)rows, (int)cols, x, y);
    if (rc != 0 || check(cudaMemcpyAsync(r, y, out_n * sizeof(float), cudaMemcpyDefault, 0), "download") ||
        check(cudaStreamSynchronize(0), "sync"))
        return 1;
    int bad = 0;
    for (size_t i = 0; i < out_n && bad < 5; ++i) {
        double want;
        if (transpose) {
            const size_t b = i / (rows * cols), j = i % (rows * cols) / rows, k = i % rows;   // y[b][j][k] = x[b][k][j]
            want = h[b * rows * cols + k * cols + j];
        } else if (column) {
            want = 0.0;
            for (size_t q = 0; q < rows; ++q) want += h[q * cols + i];
        } else {
            const size_t row = i / cols;
            double m = -1e30, s = 0.0;
            for (size_t q = 0; q < cols; ++q) m = h[row * cols + q] > m ? h[row * cols + q] : m;
            for (size_t q = 0; q < cols; ++q) s += exp((double)h[row * cols + q] - m);
            want = exp((double)h[i] - m) / s;
        }
        if (!(fabs(r[i] - want) <= 1e-5 * (1.0 + fabs(want)))) {
            fprintf(stderr, "selfcheck: %s: element %zu is %.9g, want %.9g\n", which, i, (double)r[i], want);
            ++bad;
        }
    }
    cudaFree(x);
    cudaFree(y);
    delete[] h;
    delete[] r;
    return bad != 0;
}

// cuBLAS SGEMM in every transpose form, column-major with leading dimensions above the minimum,
// against a double loop; the argument checks; beta = 0 ignores NaNs in C; TF32 rounds the inputs.
static int cublas_case(void) {
    const int m = 5, n = 3, k = 7, ld = 9;   // every operand stored with leading dimension 9
    float ha[ld * 9], hb[ld * 9], hc[ld * 9], out[ld * 9];
    float *a = nullptr, *b = nullptr, *c = nullptr;
    cublasHandle_t h;
    int bad = 0;
    for (int i = 0; i < ld * 9; ++i) {
        ha[i] = value_at(i);
        hb[i] = value_at(i + 1000);
    }
    if (check(cudaMalloc(&a, sizeof ha), "cudaMalloc") || check(cudaMalloc(&b, sizeof hb), "cudaMalloc") ||
        check(cudaMalloc(&c, sizeof hc), "cudaMalloc") ||
        check(cudaMemcpyAsync(a, ha, sizeof ha, cudaMemcpyDefault, 0), "upload") ||
        check(cudaMemcpyAsync(b, hb, sizeof hb, cudaMemcpyDefault, 0), "upload") || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
        return 1;
    const float alpha = 1.5f, beta0 = 0.0f;
    for (int form = 0; form < 4; ++form) {
        const bool ta = form & 1, tb = form & 2;
        for (int i = 0; i < ld * 9; ++i) hc[i] = NAN;   // beta = 0: C is not read
        if (check(cudaMemcpyAsync(c, hc, sizeof hc, cudaMemcpyDefault, 0), "upload")) return 1;
        if (cublasSgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, a, ld, b, ld,
                        &beta0, c, ld) != CUBLAS_STATUS_SUCCESS)
            return 1;
        if (check(cudaMemcpyAsync(out, c, sizeof out, cudaMemcpyDefault, 0), "download") ||
            check(cudaStreamSynchronize(0), "sync"))
            return 1;
        for (int j = 0; j < n; ++j)
            for (int i = 0; i < m; ++i) {
                double want = 0.0;
                for (int l = 0; l < k; ++l)
                    want += (double)(ta ? ha[l + i * ld] : ha[i + l * ld]) * (tb ? hb[j + l * ld] : hb[l + j * ld]);
                want *= alpha;
                if (!(fabs(out[i + j * ld] - want) <= 1e-5) && bad++ < 5)
                    fprintf(stderr, "selfcheck: sgemm form %d C(%d,%d) = %g, want %g\n", form, i, j, out[i + j * ld], want);
            }
    }
    // lda < rows of op(A), ldb < rows of op(B), ldc < m: CUBLAS_STATUS_INVALID_VALUE, as cuBLAS
    if (cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, a, m - 1, b, ld, &beta0, c, ld) != CUBLAS_STATUS_INVALID_VALUE ||
        cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a, k - 1, b, ld, &beta0, c, ld) != CUBLAS_STATUS_INVALID_VALUE ||
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, m, n, k, &alpha, a, ld, b, n - 1, &beta0, c, ld) != CUBLAS_STATUS_INVALID_VALUE ||
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, a, ld, b, ld, &beta0, c, m - 1) != CUBLAS_STATUS_INVALID_VALUE ||
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, -1, n, k, &alpha, a, ld, b, ld, &beta0, c, ld) != CUBLAS_STATUS_INVALID_VALUE) {
        fprintf(stderr, "selfcheck: an SGEMM with a bad argument was accepted\n");
        ++bad;
    }
    // TF32: 1 + 2^-12 has bits below TF32's 10-bit mantissa, so 1 x 1 x (1 + 2^-12) gives 1
    const float one_plus = 1.0f + 1.0f / 4096.0f, one = 1.0f;
    float r[2];
    for (int mode = 0; mode < 2; ++mode) {
        if (cublasSetMathMode(h, mode ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS ||
            check(cudaMemcpyAsync(a, &one_plus, sizeof(float), cudaMemcpyDefault, 0), "upload") ||
            check(cudaMemcpyAsync(b, &one, sizeof(float), cudaMemcpyDefault, 0), "upload") ||
            cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, a, 1, b, 1, &beta0, c, 1) != CUBLAS_STATUS_SUCCESS ||
            check(cudaMemcpyAsync(&r[mode], c, sizeof(float), cudaMemcpyDefault, 0), "download") ||
            check(cudaStreamSynchronize(0), "sync"))
            return 1;
    }
    if (r[0] != one_plus || r[1] != 1.0f) {
        fprintf(stderr, "selfcheck: 1 x (1 + 2^-12) is %.9g in FP32 and %.9g in TF32, want %.9g and 1\n", r[0], r[1], one_plus);
        ++bad;
    }
    cublasDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return bad != 0;
}

// ---- stream capture and graphs ------------------------------------------------------------------
#ifdef MGPU_EMU_CUDA_RUNTIME_H   // the emulator's counters; nvcc's build checks the results only
#include "emu.h"
#define COUNTERS(c) mgpu_emu_get_counters(&c)
#else
typedef struct { unsigned long long launches, gemms, graph_launches, captures, set_device, get_device, event_records,
                 event_waits, copies_h2d, copies_d2h, copies_peer, copies_d2d; } mgpu_emu_counters;
#define COUNTERS(c) memset(&c, 0, sizeof c)
#endif

__global__ void affine_kernel(float* x, float a, float b, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) x[i] = x[i] * a + b;
}
__global__ void add_kernel(float* y, const float* x, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] += x[i];
}
__global__ void spin_kernel(const volatile int* flag) {
    while (*flag == 0) {
    }
}

// the call gave error e (which cudaGetLastError then no longer reports)
static int want(cudaError_t got, cudaError_t e, const char* what) {
    (void)cudaGetLastError();
    if (got == e) return 0;
    fprintf(stderr, "selfcheck: %s: %s, want %s\n", what, cudaGetErrorName(got), cudaGetErrorName(e));
    return 1;
}
#define OK(call) do { if (check((call), #call)) return 1; } while (0)
#define WANT(call, e) do { if (want((call), (e), #call)) return 1; } while (0)
#define NEED(cond, ...) do { if (!(cond)) { fprintf(stderr, "selfcheck: line %d: ", __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); return 1; } } while (0)

static const int kN = 1000;
static void affine(cudaStream_t s, float* x, float a, float b) { affine_kernel<<<(kN + 255) / 256, 256, 0, s>>>(x, a, b, kN); }
static void add(cudaStream_t s, float* y, const float* x) { add_kernel<<<(kN + 255) / 256, 256, 0, s>>>(y, x, kN); }

// device buffers of kN floats, each filled with value_at(i + k * kN) for its index k
static int device_buffers(float** out, int count, cudaStream_t s) {
    float h[kN];
    for (int k = 0; k < count; ++k) {
        for (int i = 0; i < kN; ++i) h[i] = value_at((size_t)(i + k * kN));
        OK(cudaMalloc(&out[k], sizeof h));
        OK(cudaMemcpyAsync(out[k], h, sizeof h, cudaMemcpyHostToDevice, s));
    }
    return 0;
}

// the same bits in two device buffers (their first kN floats), read through the host
static int same(const float* a, const float* b, const char* what) {
    static float ha[kN], hb[kN];
    OK(cudaMemcpyAsync(ha, a, sizeof ha, cudaMemcpyDeviceToHost, 0));
    OK(cudaMemcpyAsync(hb, b, sizeof hb, cudaMemcpyDeviceToHost, 0));
    OK(cudaStreamSynchronize(0));
    for (int i = 0; i < kN; ++i)
        NEED(!memcmp(&ha[i], &hb[i], sizeof(float)), "%s: element %d is %.9g, want %.9g", what, i, ha[i], hb[i]);
    return 0;
}

// A chain on one stream, each kernel reading what the one before wrote, captured once and replayed
// 50 times: the same bits as the work run eagerly; the replays launch no kernel of their own.
static int graph_basic(void) {
    const int reps = 50;
    float* v[5];   // x, y (the graph's), x, y (eager), and x's first values
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    mgpu_emu_counters c0, c1, c2, c3;
    int dev = -1;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (device_buffers(v, 2, s) || device_buffers(v + 2, 2, s) || device_buffers(v + 4, 1, s)) return 1;
    OK(cudaStreamSynchronize(s));
    COUNTERS(c0);
    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    affine(s, v[0], 0.5f, 1.0f);
    add(s, v[1], v[0]);
    affine(s, v[1], 0.75f, -0.5f);
    OK(cudaGetLastError());
    OK(cudaStreamEndCapture(s, &g));
    NEED(g, "no graph");
    OK(cudaGraphInstantiate(&ge, g, 0));
    if (same(v[0], v[4], "x after the capture (nothing may have run)")) return 1;
    OK(cudaSetDevice(0));
    OK(cudaGetDevice(&dev));
    COUNTERS(c1);
    for (int r = 0; r < reps; ++r) OK(cudaGraphLaunch(ge, s));
    COUNTERS(c2);
    for (int r = 0; r < reps; ++r) {
        affine(s, v[2], 0.5f, 1.0f);
        add(s, v[3], v[2]);
        affine(s, v[3], 0.75f, -0.5f);
    }
    OK(cudaStreamSynchronize(s));
    COUNTERS(c3);
    if (same(v[0], v[2], "x") || same(v[1], v[3], "y")) return 1;
#ifdef MGPU_EMU_CUDA_RUNTIME_H
    NEED(c1.launches - c0.launches == 3 && c1.captures - c0.captures == 1,
         "the capture counted %llu launches and %llu captures, want 3 and 1",
         (unsigned long long)(c1.launches - c0.launches), (unsigned long long)(c1.captures - c0.captures));
    NEED(c2.launches == c1.launches && c2.graph_launches - c1.graph_launches == (uint64_t)reps,
         "%d replays counted %llu launches and %llu graph launches", reps,
         (unsigned long long)(c2.launches - c1.launches), (unsigned long long)(c2.graph_launches - c1.graph_launches));
    NEED(c3.launches - c2.launches == 3 * (uint64_t)reps && c3.graph_launches == c2.graph_launches,
         "the eager steps counted %llu launches", (unsigned long long)(c3.launches - c2.launches));
    NEED(c1.set_device - c0.set_device == 1 && c1.get_device - c0.get_device == 1, "set_device %llu, get_device %llu",
         (unsigned long long)(c1.set_device - c0.set_device), (unsigned long long)(c1.get_device - c0.get_device));
#endif
    OK(cudaGraphExecDestroy(ge));
    OK(cudaGraphDestroy(g));
    for (float* p : v) OK(cudaFree(p));
    OK(cudaStreamDestroy(s));
    return 0;
}

// One step forked from s0 onto a second stream of device 0 (s1) and a stream of device 1 (t), by
// events, and joined back: t copies device 0's a into its c and reads a again through peer access;
// s0 copies c back into d. With join == 0, t's work is never joined into s0.
struct fork_join { cudaStream_t s0, s1, t; cudaEvent_t fork, done1, done_t; };
static void fork_join_step(const fork_join& f, float* const* v, int join) {
    float *a = v[0], *b = v[1], *c = v[2], *d = v[3];
    affine(f.s0, a, 0.5f, 1.0f);
    (void)cudaEventRecord(f.fork, f.s0);
    (void)cudaStreamWaitEvent(f.s1, f.fork, 0);
    add(f.s1, b, a);
    affine(f.s1, b, 0.5f, -0.25f);
    (void)cudaEventRecord(f.done1, f.s1);
    (void)cudaSetDevice(1);
    (void)cudaStreamWaitEvent(f.t, f.fork, 0);
    (void)cudaMemcpyPeerAsync(c, 1, a, 0, kN * sizeof(float), f.t);
    add(f.t, c, a);   // device 0's memory, through peer access
    affine(f.t, c, 2.0f, 0.5f);
    (void)cudaEventRecord(f.done_t, f.t);
    (void)cudaSetDevice(0);
    (void)cudaStreamWaitEvent(f.s0, f.done1, 0);
    if (join) (void)cudaStreamWaitEvent(f.s0, f.done_t, 0);
    add(f.s0, a, b);
    (void)cudaMemcpyPeerAsync(d, 0, c, 1, kN * sizeof(float), f.s0);
    add(f.s0, a, d);
    affine(f.s0, a, 0.125f, 0.0f);
}

static int graph_fork_join(void) {
    const int reps = 30;
    fork_join f;
    float *g[4], *e[4];   // a, b, d on device 0, c on device 1: the graph's, and the eager ones
    cudaGraph_t graph;
    cudaGraphExec_t ge;
    cudaStreamCaptureStatus st;
    mgpu_emu_counters c0, c1;
    OK(cudaSetDevice(1));
    OK(cudaDeviceEnablePeerAccess(0, 0));
    OK(cudaStreamCreateWithFlags(&f.t, cudaStreamNonBlocking));
    OK(cudaEventCreateWithFlags(&f.done_t, cudaEventDisableTiming));
    if (device_buffers(&g[2], 1, f.t) || device_buffers(&e[2], 1, f.t)) return 1;
    OK(cudaStreamSynchronize(f.t));
    OK(cudaSetDevice(0));
    OK(cudaDeviceEnablePeerAccess(1, 0));
    OK(cudaStreamCreateWithFlags(&f.s0, cudaStreamNonBlocking));
    OK(cudaStreamCreateWithFlags(&f.s1, cudaStreamNonBlocking));
    OK(cudaEventCreateWithFlags(&f.fork, cudaEventDisableTiming));
    OK(cudaEventCreateWithFlags(&f.done1, cudaEventDisableTiming));
    if (device_buffers(g, 2, f.s0) || device_buffers(&g[3], 1, f.s0) || device_buffers(e, 2, f.s0) ||
        device_buffers(&e[3], 1, f.s0))
        return 1;
    OK(cudaStreamSynchronize(f.s0));

    // without the join: the capture ends with an error, every stream back to normal
    OK(cudaStreamBeginCapture(f.s0, cudaStreamCaptureModeGlobal));
    fork_join_step(f, g, 0);
    OK(cudaGetLastError());
    OK(cudaStreamIsCapturing(f.t, &st));
    NEED(st == cudaStreamCaptureStatusActive, "t did not join the capture (status %d)", (int)st);
    WANT(cudaStreamEndCapture(f.s0, &graph), cudaErrorStreamCaptureUnjoined);
    NEED(!graph, "a graph from an unjoined capture");
    cudaStream_t all[3] = {f.s0, f.s1, f.t};
    for (cudaStream_t s : all) {
        OK(cudaStreamIsCapturing(s, &st));
        NEED(st == cudaStreamCaptureStatusNone, "a stream still capturing after the failed end");
        OK(cudaStreamSynchronize(s));
    }
    if (same(g[0], e[0], "a after the failed capture (nothing may have run)")) return 1;

    COUNTERS(c0);
    OK(cudaStreamBeginCapture(f.s0, cudaStreamCaptureModeGlobal));
    fork_join_step(f, g, 1);
    OK(cudaGetLastError());
    WANT(cudaStreamEndCapture(f.s1, &graph), cudaErrorStreamCaptureUnmatched);   // not the origin
    OK(cudaStreamEndCapture(f.s0, &graph));
    COUNTERS(c1);
    OK(cudaGraphInstantiate(&ge, graph, 0));
    OK(cudaGraphDestroy(graph));   // the exec keeps what it runs
    for (int r = 0; r < reps; ++r) OK(cudaGraphLaunch(ge, f.s0));
    for (int r = 0; r < reps; ++r) fork_join_step(f, e, 1);
    OK(cudaGetLastError());
    OK(cudaGraphExecDestroy(ge));   // while the replays may still run
    OK(cudaSetDevice(1));
    OK(cudaDeviceSynchronize());
    OK(cudaSetDevice(0));
    OK(cudaDeviceSynchronize());
    if (same(g[0], e[0], "a") || same(g[1], e[1], "b") || same(g[2], e[2], "c") || same(g[3], e[3], "d")) return 1;
#ifdef MGPU_EMU_CUDA_RUNTIME_H
    NEED(c1.event_records - c0.event_records == 3 && c1.event_waits - c0.event_waits == 4 &&
         c1.copies_peer - c0.copies_peer == 2 && c1.launches - c0.launches == 8,
         "the capture counted %llu event records, %llu waits, %llu peer copies, %llu launches; want 3, 4, 2, 8",
         (unsigned long long)(c1.event_records - c0.event_records), (unsigned long long)(c1.event_waits - c0.event_waits),
         (unsigned long long)(c1.copies_peer - c0.copies_peer), (unsigned long long)(c1.launches - c0.launches));
#endif
    return 0;
}

// After a capture that was refused: the stream runs work again.
static int normal_again(cudaStream_t s, float* x) {
    cudaStreamCaptureStatus st;
    float h[kN];
    OK(cudaStreamIsCapturing(s, &st));
    NEED(st == cudaStreamCaptureStatusNone, "still capturing (status %d)", (int)st);
    OK(cudaMemsetAsync(x, 0, sizeof h, s));
    affine(s, x, 1.0f, 7.0f);
    OK(cudaGetLastError());
    OK(cudaMemcpyAsync(h, x, sizeof h, cudaMemcpyDeviceToHost, s));
    OK(cudaStreamSynchronize(s));
    for (int i = 0; i < kN; ++i) NEED(h[i] == 7.0f, "element %d is %g after the capture, want 7", i, h[i]);
    return 0;
}

// What a capture refuses: the call fails, the capture is invalidated, its end gives no graph.
static int ends_invalidated(cudaStream_t s, float* x) {
    cudaStreamCaptureStatus st;
    cudaGraph_t g = (cudaGraph_t)&g;
    OK(cudaStreamIsCapturing(s, &st));
    NEED(st == cudaStreamCaptureStatusInvalidated, "the capture is not invalidated (status %d)", (int)st);
    affine(s, x, 1.0f, 1.0f);
    WANT(cudaGetLastError(), cudaErrorStreamCaptureInvalidated);
    WANT(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureInvalidated);
    NEED(!g, "a graph from an invalidated capture");
    return normal_again(s, x);
}

static int graph_forbidden(void) {
    cudaStream_t s, other;
    cudaEvent_t outside, inside;
    float *x, *pinned, pageable[kN], *p = nullptr;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    OK(cudaEventCreateWithFlags(&outside, cudaEventDisableTiming));
    OK(cudaEventCreateWithFlags(&inside, cudaEventDisableTiming));
    OK(cudaMalloc(&x, kN * sizeof(float)));
    OK(cudaHostAlloc(&pinned, kN * sizeof(float), cudaHostAllocDefault));
    for (int i = 0; i < kN; ++i) pageable[i] = pinned[i] = 3.0f;

    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    affine(s, x, 1.0f, 1.0f);
    WANT(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
    if (ends_invalidated(s, x)) return 1;

    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    WANT(cudaMalloc(&p, 64), cudaErrorStreamCaptureUnsupported);
    if (ends_invalidated(s, x)) return 1;

    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    WANT(cudaMemcpyAsync(x, pageable, sizeof pageable, cudaMemcpyHostToDevice, s), cudaErrorStreamCaptureUnsupported);
    if (ends_invalidated(s, x)) return 1;

    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    WANT(cudaMemcpyAsync(pageable, x, sizeof pageable, cudaMemcpyDeviceToHost, s), cudaErrorStreamCaptureUnsupported);
    if (ends_invalidated(s, x)) return 1;

    OK(cudaEventRecord(outside, other));   // work outside the capture
    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    WANT(cudaStreamWaitEvent(s, outside, 0), cudaErrorStreamCaptureIsolation);
    if (ends_invalidated(s, x)) return 1;

    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    OK(cudaEventRecord(inside, s));
    WANT(cudaEventQuery(inside), cudaErrorCapturedEvent);
    WANT(cudaEventSynchronize(inside), cudaErrorStreamCaptureUnsupported);
    if (ends_invalidated(s, x)) return 1;

    // a relaxed capture allows cudaMalloc; pinned memory is read when the graph runs
    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    OK(cudaMalloc(&p, 64));
    OK(cudaMemcpyAsync(x, pinned, kN * sizeof(float), cudaMemcpyHostToDevice, s));
    affine(s, x, 2.0f, 0.0f);
    OK(cudaMemcpyAsync(pinned, x, kN * sizeof(float), cudaMemcpyDeviceToHost, s));
    OK(cudaStreamEndCapture(s, &g));
    OK(cudaGraphInstantiate(&ge, g, 0));
    NEED(pinned[0] == 3.0f, "the capture ran its copies");
    OK(cudaGraphLaunch(ge, s));
    OK(cudaGraphLaunch(ge, s));
    OK(cudaStreamSynchronize(s));
    for (int i = 0; i < kN; ++i) NEED(pinned[i] == 12.0f, "pinned[%d] is %g after two replays, want 12", i, pinned[i]);
    OK(cudaGraphExecDestroy(ge));
    OK(cudaGraphDestroy(g));
    OK(cudaFree(p));
    OK(cudaFreeHost(pinned));
    OK(cudaFree(x));
    return 0;
}

// A GEMM and a kernel after it, captured and replayed: the same bits as eagerly.
static int graph_cublas(void) {
    const int reps = 5, m = 31, n = 17, k = 23;
    const float alpha = 0.5f, beta = 0.25f;
    float* v[6];   // A, B, C: the graph's, then the eager ones
    cudaStream_t s;
    cublasHandle_t h;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    mgpu_emu_counters c0, c1, c2;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (device_buffers(v, 3, s) || device_buffers(v + 3, 3, s)) return 1;
    NEED(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS && cublasSetStream(h, s) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    COUNTERS(c0);
    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    NEED(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, v[0], m, v[1], k, &beta, v[2], m) == CUBLAS_STATUS_SUCCESS,
         "cublasSgemm in the capture");
    affine(s, v[2], 1.0f, -0.125f);
    OK(cudaStreamEndCapture(s, &g));
    COUNTERS(c1);
    OK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < reps; ++r) OK(cudaGraphLaunch(ge, s));
    COUNTERS(c2);
    for (int r = 0; r < reps; ++r) {
        NEED(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, v[3], m, v[4], k, &beta, v[5], m) == CUBLAS_STATUS_SUCCESS,
             "cublasSgemm");
        affine(s, v[5], 1.0f, -0.125f);
    }
    OK(cudaStreamSynchronize(s));
    if (same(v[2], v[5], "C")) return 1;
#ifdef MGPU_EMU_CUDA_RUNTIME_H
    NEED(c1.gemms - c0.gemms == 1 && c1.launches - c0.launches == 2 && c2.gemms == c1.gemms && c2.launches == c1.launches,
         "gemms/launches: %llu/%llu in the capture, %llu/%llu in the replays, want 1/2 and 0/0",
         (unsigned long long)(c1.gemms - c0.gemms), (unsigned long long)(c1.launches - c0.launches),
         (unsigned long long)(c2.gemms - c1.gemms), (unsigned long long)(c2.launches - c1.launches));
#endif
    OK(cudaGraphExecDestroy(ge));
    OK(cudaGraphDestroy(g));
    cublasDestroy(h);
    return 0;
}

// The emulated NCCL (MGPU_EMU_NCCL) in a capture across two devices: x0 += 1 on device 0, x1 += 2
// on device 1, then both all-reduced; every replay is a new collective. Then a broadcast.
static int graph_nccl(void) {
    const char* lib = getenv("MGPU_EMU_NCCL");
    const int reps = 10;
    typedef int (*init_all_fn)(void** comms, int n, const int* devs);
    typedef int (*all_reduce_fn)(const void* send, void* recv, size_t count, int type, int op, void* comm, void* stream);
    if (!lib) {
        fprintf(stderr, "selfcheck: MGPU_EMU_NCCL is not set\n");
        return 77;
    }
    void* so = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    NEED(so, "%s: %s", lib, dlerror());
    init_all_fn init_all = (init_all_fn)dlsym(so, "ncclCommInitAll");
    all_reduce_fn all_reduce = (all_reduce_fn)dlsym(so, "ncclAllReduce");
    void* comms[2];
    NEED(init_all && all_reduce && init_all(comms, 2, nullptr) == 0, "ncclCommInitAll");
    const int f32 = 7, sum = 0;
    cudaStream_t s[2];
    cudaEvent_t e[2];
    float* x[2];
    for (int d = 1; d >= 0; --d) {
        OK(cudaSetDevice(d));
        OK(cudaStreamCreateWithFlags(&s[d], cudaStreamNonBlocking));
        OK(cudaEventCreateWithFlags(&e[d], cudaEventDisableTiming));
        if (device_buffers(&x[d], 1, s[d])) return 1;
        OK(cudaStreamSynchronize(s[d]));
    }
    cudaGraph_t g;
    cudaGraphExec_t ge;
    OK(cudaStreamBeginCapture(s[0], cudaStreamCaptureModeGlobal));
    affine(s[0], x[0], 1.0f, 1.0f);
    OK(cudaEventRecord(e[0], s[0]));
    OK(cudaSetDevice(1));
    OK(cudaStreamWaitEvent(s[1], e[0], 0));
    affine(s[1], x[1], 1.0f, 2.0f);
    NEED(all_reduce(x[1], x[1], kN, f32, sum, comms[1], s[1]) == 0, "ncclAllReduce on rank 1");
    OK(cudaEventRecord(e[1], s[1]));
    OK(cudaSetDevice(0));
    NEED(all_reduce(x[0], x[0], kN, f32, sum, comms[0], s[0]) == 0, "ncclAllReduce on rank 0");
    OK(cudaStreamWaitEvent(s[0], e[1], 0));
    OK(cudaStreamEndCapture(s[0], &g));
    OK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < reps; ++r) OK(cudaGraphLaunch(ge, s[0]));
    OK(cudaStreamSynchronize(s[0]));
    static float h[2][kN];
    for (int d = 0; d < 2; ++d) OK(cudaMemcpyAsync(h[d], x[d], sizeof h[d], cudaMemcpyDeviceToHost, s[0]));
    OK(cudaStreamSynchronize(s[0]));
    for (int i = 0; i < kN; ++i) {
        float v = value_at((size_t)i);
        for (int r = 0; r < reps; ++r) v = (v * 1.0f + 1.0f) + (v * 1.0f + 2.0f);   // rank 0's, then rank 1's
        NEED(h[0][i] == v && h[1][i] == v, "element %d: %.9g and %.9g, want %.9g", i, h[0][i], h[1][i], v);
    }
    OK(cudaGraphExecDestroy(ge));
    OK(cudaGraphDestroy(g));
    // then a broadcast from rank 1, in place: x1 += 5 there, and rank 0 receives it
    typedef int (*broadcast_fn)(const void* send, void* recv, size_t count, int type, int root, void* comm, void* stream);
    broadcast_fn broadcast = (broadcast_fn)dlsym(so, "ncclBroadcast");
    NEED(broadcast, "ncclBroadcast: %s", dlerror());
    OK(cudaSetDevice(1));
    affine(s[1], x[1], 1.0f, 5.0f);
    NEED(broadcast(x[1], x[1], kN, f32, 1, comms[1], s[1]) == 0, "ncclBroadcast on rank 1 (the root)");
    OK(cudaSetDevice(0));
    NEED(broadcast(x[0], x[0], kN, f32, 1, comms[0], s[0]) == 0, "ncclBroadcast on rank 0");
    for (int d = 0; d < 2; ++d) OK(cudaStreamSynchronize(s[d]));
    for (int d = 0; d < 2; ++d) OK(cudaMemcpyAsync(h[d], x[d], sizeof h[d], cudaMemcpyDeviceToHost, s[0]));
    OK(cudaStreamSynchronize(s[0]));
    for (int i = 0; i < kN; ++i) {
        float v = value_at((size_t)i);
        for (int r = 0; r < reps; ++r) v = (v * 1.0f + 1.0f) + (v * 1.0f + 2.0f);
        v = v * 1.0f + 5.0f;
        NEED(h[0][i] == v && h[1][i] == v, "broadcast, element %d: %.9g and %.9g, want %.9g", i, h[0][i], h[1][i], v);
    }
    return 0;
}

// An async copy from pinned memory reads it when the stream gets there; from pageable memory, at
// the call. The stream is held by a kernel until the host has overwritten the source.
static int pinned_async(void) {
    cudaStream_t s;
    int* flag;
    float *pinned, pageable[kN], h[kN], *x, *y;
    mgpu_emu_counters c0, c1;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    OK(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocDefault));
    OK(cudaHostAlloc(&pinned, sizeof pageable, cudaHostAllocDefault));
    OK(cudaMalloc(&x, sizeof pageable));
    OK(cudaMalloc(&y, sizeof pageable));
    for (int from_pinned = 1; from_pinned >= 0; --from_pinned) {
        float* src = from_pinned ? pinned : pageable;
        *flag = 0;
        for (int i = 0; i < kN; ++i) src[i] = 1.0f;
        COUNTERS(c0);
        spin_kernel<<<1, 1, 0, s>>>(flag);
        OK(cudaMemcpyAsync(x, src, sizeof pageable, cudaMemcpyHostToDevice, s));
        for (int i = 0; i < kN; ++i) src[i] = 2.0f;   // the copy waits behind the kernel
        __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
        OK(cudaMemcpyAsync(y, x, sizeof pageable, cudaMemcpyDeviceToDevice, s));
        OK(cudaMemcpyAsync(h, y, sizeof h, cudaMemcpyDeviceToHost, s));
        OK(cudaStreamSynchronize(s));
        COUNTERS(c1);
        const float want = from_pinned ? 2.0f : 1.0f;
        for (int i = 0; i < kN; ++i)
            NEED(h[i] == want, "from %s memory: element %d is %g, want %g", from_pinned ? "pinned" : "pageable", i, h[i], want);
#ifdef MGPU_EMU_CUDA_RUNTIME_H
        NEED(c1.copies_h2d - c0.copies_h2d == 1 && c1.copies_d2d - c0.copies_d2d == 1 && c1.copies_d2h - c0.copies_d2h == 1 &&
             c1.copies_peer == c0.copies_peer && c1.launches - c0.launches == 1,
             "copies h2d %llu, d2d %llu, d2h %llu, peer %llu, launches %llu; want 1, 1, 1, 0, 1",
             (unsigned long long)(c1.copies_h2d - c0.copies_h2d), (unsigned long long)(c1.copies_d2d - c0.copies_d2d),
             (unsigned long long)(c1.copies_d2h - c0.copies_d2h), (unsigned long long)(c1.copies_peer - c0.copies_peer),
             (unsigned long long)(c1.launches - c0.launches));
#endif
    }
    OK(cudaFreeHost(flag));
    OK(cudaFreeHost(pinned));
    return 0;
}

static int check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) fprintf(stderr, "selfcheck: %s: %s\n", what, cudaGetErrorName(e));
    return e == cudaSuccess ? 0 : 1;
}

// Runs one check; returns 0 when a good case gave the right results. A bad case must not return.
extern "C" int selfcheck_run(const char* which) {
    int* d = nullptr;
    const int threads = 256;
    if (check(cudaMalloc(&d, threads * 6 * sizeof(int)), "cudaMalloc")) return 1;
    if (!strcmp(which, "shuffles")) {
        int h[threads * 6];
        shuffles_kernel<<<3, threads>>>(d);
        if (check(cudaGetLastError(), "launch")) return 1;
        if (check(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDefault, 0), "copy")) return 1;
        if (check(cudaStreamSynchronize(0), "sync")) return 1;
        int bad = 0;
        for (int t = 0; t < threads; ++t) {
            const int lane = t & 31, w = t & ~31;
#define V(i) ((i) * 3 + 1)
            const int want[6] = {V(w + 5), lane < 31 ? V(t + 1) : V(t), V(w + (lane ^ 3)), lane >= 2 ? V(t - 2) : V(t),
                                 (lane & 7) + 4 < 8 ? V(t + 4) : V(t), 3 * 255 * 256 / 2 + 256};
#undef V
            for (int k = 0; k < 6; ++k)
                if (h[t * 6 + k] != want[k] && bad++ < 5)
                    fprintf(stderr, "selfcheck: thread %d, result %d: %d, want %d\n", t, k, h[t * 6 + k], want[k]);
        }
        return bad != 0;
    }
    if (!strcmp(which, "transpose") || !strcmp(which, "column_sum") || !strcmp(which, "softmax_wide")) return grid_loops(which);
    if (!strcmp(which, "cublas")) return cublas_case();
    if (!strcmp(which, "graph_basic")) return graph_basic();
    if (!strcmp(which, "graph_fork_join")) return graph_fork_join();
    if (!strcmp(which, "graph_forbidden")) return graph_forbidden();
    if (!strcmp(which, "graph_cublas")) return graph_cublas();
    if (!strcmp(which, "graph_nccl")) return graph_nccl();
    if (!strcmp(which, "pinned_async")) return pinned_async();
    if (!strcmp(which, "dynamic_shared")) {   // 64 KiB: refused until cudaFuncSetAttribute allows it
        const int n = 16384, blocks = 3;
        int h[blocks * threads];
        dynamic_shared_kernel<<<blocks, threads, n * sizeof(int)>>>(d, n);
        if (cudaGetLastError() != cudaErrorInvalidValue) {
            fprintf(stderr, "selfcheck: 64 KiB of dynamic shared memory launched without cudaFuncSetAttribute, or refused "
                            "with another error than invalid argument\n");
            return 1;
        }
        if (cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 1 << 20) != cudaErrorInvalidValue ||
            cudaGetLastError() != cudaErrorInvalidValue) {
            fprintf(stderr, "selfcheck: 1 MiB of shared memory allowed\n");
            return 1;
        }
        if (check(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, n * sizeof(int)),
                  "cudaFuncSetAttribute"))
            return 1;
        dynamic_shared_kernel<<<blocks, threads, n * sizeof(int)>>>(d, n);
        if (check(cudaGetLastError(), "launch") || check(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDefault, 0), "copy") ||
            check(cudaStreamSynchronize(0), "sync"))
            return 1;
        for (int t = 0; t < blocks * threads; ++t) {
            int want = 0;
            for (int i = n - 1 - t % threads; i >= 0; i -= threads) want += i;
            if (h[t] != want) {
                fprintf(stderr, "selfcheck: dynamic shared memory: block %d thread %d: %d, want %d\n", t / threads, t % threads, h[t], want);
                return 1;
            }
        }
        return 0;
    }
    if (!strcmp(which, "launch_limits")) {   // too many threads: a launch error, not a crash
        write_kernel<<<1, 2048>>>((float*)d);
        return cudaGetLastError() == cudaErrorInvalidConfiguration && cudaGetLastError() == cudaSuccess ? 0 : 1;
    }
    if (!strcmp(which, "race_readers")) {   // MGPU_EMU_RACECHECK: two streams reading one buffer in no order: fine
        cudaStream_t a, b;
        if (check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream") ||
            check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "stream") || check(cudaMemsetAsync(d, 0, 1024, 0), "memset") ||
            check(cudaStreamSynchronize(0), "sync"))
            return 1;
        if (check(cudaMemcpyAsync(d + 256, d, 128, cudaMemcpyDeviceToDevice, a), "copy") ||
            check(cudaMemcpyAsync(d + 512, d, 128, cudaMemcpyDeviceToDevice, b), "copy") || check(cudaStreamSynchronize(a), "sync") ||
            check(cudaStreamSynchronize(b), "sync"))
            return 1;
        return 0;
    }
    if (!strcmp(which, "race") || !strcmp(which, "race_ordered")) {   // MGPU_EMU_RACECHECK: two streams, one buffer
        cudaStream_t a, b;
        cudaEvent_t e;
        if (check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream") ||
            check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "stream") || check(cudaEventCreateWithFlags(&e, 2), "event"))
            return 1;
        write_kernel<<<1, 32, 0, a>>>((float*)d);
        if (!strcmp(which, "race_ordered")) {   // by an event, then by the host's wait
            if (check(cudaEventRecord(e, a), "record") || check(cudaStreamWaitEvent(b, e, 0), "wait")) return 1;
            if (check(cudaMemsetAsync(d, 0, 128, b), "memset") || check(cudaStreamSynchronize(b), "sync")) return 1;
            write_kernel<<<1, 32, 0, a>>>((float*)d);
            if (check(cudaStreamSynchronize(a), "sync")) return 1;
        }
        if (check(cudaMemsetAsync(d, 0, 128, b), "memset") || check(cudaStreamSynchronize(b), "sync") ||
            check(cudaStreamSynchronize(a), "sync"))
            return 1;
        return 0;
    }
    if (!strcmp(which, "divergent")) divergent_barrier_kernel<<<2, threads>>>(d);
    else if (!strcmp(which, "missing_lanes")) missing_lanes_kernel<<<1, threads>>>(d);
    else if (!strcmp(which, "deadlock")) deadlock_kernel<<<1, 64>>>(d);
    else if (!strcmp(which, "oob_copy")) {
        char h[64];
        (void)cudaMemcpyAsync(h, (char*)d + threads * 6 * sizeof(int) - 32, sizeof h, cudaMemcpyDefault, 0);
    } else if (!strcmp(which, "no_peer_struct")) {   // needs 2 devices: a pointer inside a struct
        padded_write w;
        memset(&w, 0, sizeof w);
        if (check(cudaSetDevice(1), "cudaSetDevice(1)") || check(cudaMalloc(&w.p, 1024), "cudaMalloc on 1")) return 1;
        if (check(cudaSetDevice(0), "cudaSetDevice(0)")) return 1;
        padded_write_kernel<<<1, 32>>>(w);
    } else if (!strcmp(which, "padding")) {   // needs 2 devices; a good case
#ifndef MGPU_EMU_CLEARS_PADDING
        fprintf(stderr, "selfcheck: this compiler has no __builtin_clear_padding\n");
        return 77;
#else
        // The float and the padding after it, read as one word, make an address inside device
        // 1's memory: a check that read the padding would report this launch on device 0.
        float *other = nullptr, h[32];
        padded_write w;
        uintptr_t inside;
        if (check(cudaSetDevice(1), "cudaSetDevice(1)") || check(cudaMalloc(&other, 1024), "cudaMalloc on 1")) return 1;
        if (check(cudaSetDevice(0), "cudaSetDevice(0)")) return 1;
        static_assert(sizeof w == 16 && offsetof(padded_write, v) == 8, "a float and 4 bytes of padding");
        inside = (uintptr_t)other + 512;
        memcpy((char*)&w + 8, &inside, sizeof inside);
        w.p = (float*)d;
        padded_write_kernel<<<1, 32>>>(w);
        if (check(cudaGetLastError(), "launch") || check(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDefault, 0), "copy") ||
            check(cudaStreamSynchronize(0), "sync"))
            return 1;
        for (int i = 0; i < 32; ++i)
            if (memcmp(&h[i], &w.v, sizeof w.v) != 0) {
                fprintf(stderr, "selfcheck: padding: element %d was not written\n", i);
                return 1;
            }
        return 0;
#endif
    } else if (!strcmp(which, "no_peer_kernel")) {   // needs 2 devices
        float* other = nullptr;
        if (check(cudaSetDevice(1), "cudaSetDevice(1)") || check(cudaMalloc(&other, 1024), "cudaMalloc on 1")) return 1;
        if (check(cudaSetDevice(0), "cudaSetDevice(0)")) return 1;
        write_kernel<<<1, 32>>>(other);
    } else {
        fprintf(stderr, "selfcheck: unknown case %s\n", which);
        return 1;
    }
    (void)cudaDeviceSynchronize();
    fprintf(stderr, "selfcheck: %s ran to the end without a report\n", which);
    return 1;
}
