/* 09_sin_kernel.cu - lesson 09's CUDA half: y = sin(x) on a GPU (09_sin.c is the rest).

   A kernel is a function that many GPU threads run at once, each on its own elements. This file
   is plain CUDA: it knows nothing of mgpu. 09_sin.c hands it the GPU's pointers and the stream
   mgpu queues that GPU's work on.

   On a machine with a GPU (nvcc, the CUDA toolkit):
       nvcc -O3 -arch=sm_90 -c examples/course/09_sin_kernel.cu -o 09_sin_kernel.o
   On emulated GPUs (no GPU needed): make emu-program SRC=examples/course/09_sin.c
       KERNELS=examples/course/09_sin_kernel.cu   (lesson 09 says how to run it) */
#include <cuda_runtime.h>
#include <stddef.h>

// Every thread starts at its own index in the whole grid and steps by the grid's size (a
// grid-stride loop): any number of blocks covers any n, and a thread past the end does nothing.
__global__ void sin_kernel(const float* x, float* y, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = sinf(x[i]);
}

// Called from C: extern "C" keeps its name as C spells it. It only queues the kernel on
// `stream` and returns; 09_sin.c checks the launch (mgpu_cuda_end). n must be at least 1 (a grid
// of 0 blocks does not launch).
extern "C" void sin_launch(void* stream, const float* x, float* y, size_t n) {
    const unsigned threads = 256;                        // threads per block
    size_t blocks = (n + threads - 1) / threads;         // one thread per element...
    if (blocks > 1024) blocks = 1024;                    // ...up to 262144 threads; the loop does the rest
    sin_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(x, y, n);
}
