/* 09_ex2_kernel.cu - lesson 09, exercise 2's CUDA half: the Sin layer's two kernels,
   forward y = sin(x) and backward dx = dy * cos(x) (09_ex2.c is the rest). */
#include <cuda_runtime.h>
#include <stddef.h>

__global__ void sin_kernel(const float* x, float* y, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = sinf(x[i]);
}

// the derivative of sin is cos: dL/dx = dL/dy * cos(x)
__global__ void sin_backward_kernel(const float* dy, const float* x, float* dx, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dx[i] = dy[i] * cosf(x[i]);
}

static unsigned blocks_for(size_t n, unsigned threads) {
    size_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks < 1024 ? blocks : 1024);
}

// both queue their kernel on stream and return; n >= 1. 09_ex2.c checks each launch.
extern "C" void sin_launch(void* stream, const float* x, float* y, size_t n) {
    sin_kernel<<<blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(x, y, n);
}
extern "C" void sin_backward_launch(void* stream, const float* dy, const float* x, float* dx, size_t n) {
    sin_backward_kernel<<<blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(dy, x, dx, n);
}
