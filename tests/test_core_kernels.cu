/* tests/test_core_kernels.cu - a kernel of the program's own, as a user writes one beside mgpu
   (mgpu_cuda_begin and mgpu_cuda_end, >>ops), for test_core's group "kernels of your own".
   Built by nvcc into the CUDA build, and by tests/emu/cu2cpp.py and the host compiler into the
   emulated ones (Makefile: $(B)/cu/, $(B)/emu/cu/). */
#include <cuda_runtime.h>
#include <math.h>
#include <stddef.h>

// y[i] = sin(x[i]) * scale, over a grid-stride loop: any grid covers any n
__global__ void test_sin_kernel(const float* x, float* y, size_t n, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = sinf(x[i]) * scale;
}

// The launch alone: the test checks it with mgpu_cuda_end. threads above 1024 fail to launch.
extern "C" void test_sin_launch(void* stream, const float* x, float* y, size_t n, float scale, unsigned blocks,
                                unsigned threads) {
    test_sin_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(x, y, n, scale);
}
