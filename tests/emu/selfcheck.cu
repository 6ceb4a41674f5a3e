// tests/emu/selfcheck.cu - kernels that check the GPU emulator itself (tests/emu/test_emu.c runs
// each in a child process): the shuffles and a barrier give hardware's results, and a divergent
// barrier, a shuffle with missing lanes, a deadlock, an out-of-bounds copy and a pointer of
// another device without peer access each stop the program with a report. Plain CUDA: nvcc
// compiles it too.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
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
                                    const float* x, float* out, float scale, int accumulate);
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
             : column  ? mgpu__cu_channel_sum(0, nullptr, (int64_t)rows, (int64_t)cols, 1, x, y, 1.0f, 0)
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
    if (!strcmp(which, "launch_limits")) {   // too many threads: a launch error, not a crash
        write_kernel<<<1, 2048>>>((float*)d);
        return cudaGetLastError() == cudaErrorInvalidConfiguration && cudaGetLastError() == cudaSuccess ? 0 : 1;
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
