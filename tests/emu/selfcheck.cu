// tests/emu/selfcheck.cu - kernels that check the GPU emulator itself (tests/emu/test_emu.c runs
// each in a child process): the shuffles and a barrier give hardware's results, and a divergent
// barrier, a shuffle with missing lanes, a deadlock, an out-of-bounds copy and a pointer of
// another device without peer access each stop the program with a report. Plain CUDA: nvcc
// compiles it too.
#include <cuda_runtime.h>
#include <stdio.h>
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
