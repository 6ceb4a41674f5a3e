/* 09_ex1_kernel.cu - lesson 09, exercise 1's CUDA half: y = cos(x) (09_ex1.c is the rest).
   09_sin_kernel.cu with sinf made cosf, and the names changed. */
#include <cuda_runtime.h>
#include <stddef.h>

// a grid-stride loop: any grid covers any n
__global__ void cos_kernel(const float* x, float* y, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = cosf(x[i]);
}

// queues cos_kernel on stream; n >= 1. 09_ex1.c checks the launch (mgpu_cuda_end).
extern "C" void cos_launch(void* stream, const float* x, float* y, size_t n) {
    const unsigned threads = 256;
    size_t blocks = (n + threads - 1) / threads;
    if (blocks > 1024) blocks = 1024;
    cos_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(x, y, n);
}
