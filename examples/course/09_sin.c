/* 09_sin.c - lesson 09: a kernel of your own. mgpu has no sin (torch.sin has no mgpu op), so we
   write one: a loop for the CPU here, a CUDA kernel in 09_sin_kernel.cu, and one function,
   my_sin, that checks its tensors and runs whichever fits the device, as mgpu's own ops do.

   On every device of the set it computes y = sin(2x) for 100000 values of x: mgpu_scale (mgpu's
   op) makes 2x, my_sin takes its sine, with no wait between them: on a GPU both are queued on
   the device's stream, which runs them in order. It checks y against the C library's sin, and
   that a wrong dtype is refused with a clear message.

   Run:  09_sin [DEVICES]      auto (every GPU, or the CPU), cpu, cpu:2, cuda:0,1 ...  [auto]
   CPU only:       cc -std=c99 -O2 -I. examples/course/09_sin.c -lm -lpthread
   On a GPU:       nvcc -O3 -arch=sm_90 -c mgpu_kernels.cu
                   nvcc -O3 -arch=sm_90 -c examples/course/09_sin_kernel.cu
                   cc -std=c99 -O2 -DMGPU_CUDA -I. examples/course/09_sin.c mgpu_kernels.o 09_sin_kernel.o \
                      -L/usr/local/cuda/lib64 -lcudart -lcublas -lcublasLt -lstdc++ -lm -lpthread -ldl
   Emulated GPUs:  make emu-program SRC=examples/course/09_sin.c KERNELS=examples/course/09_sin_kernel.cu
                   MGPU_EMU_DEVICES=2 build/emu/09_sin cuda:0,1 */
// course-run: cpu
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-kernels: examples/course/09_sin_kernel.cu
// course-expect: largest error against the C library
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>

#define N 100000
#define TOLERANCE 1e-6   /* sinf is within 2 units in the last place of the true sine: < 2.4e-7 here */

#ifdef MGPU_CUDA
/* in 09_sin_kernel.cu: queues sin_kernel on stream */
void sin_launch(void* stream, const float* x, float* y, size_t n);
#endif

/* The CPU half: one slice [begin, end) of the elements. mgpu_cpu_parallel gives each thread of
   its pool a slice of its own, so no two threads write the same y[i]. */
typedef struct sin_job { const float* x; float* y; } sin_job;
static void sin_slice(void* user, int64_t begin, int64_t end) {
    const sin_job* job = (const sin_job*)user;
    int64_t i;
    for (i = begin; i < end; ++i) job->y[i] = sinf(job->x[i]);
}

/* y = sin(x), elementwise: what torch.sin(x, out=y) does. */
static mgpu_result my_sin(mgpu_tensor* y, const mgpu_tensor* x) {
    mgpu_device* dev = mgpu_tensor_device(x);
    int64_t n = mgpu_tensor_numel(x);
    mgpu_result r;
    /* the checks mgpu's ops make: f32, y on x's device and of x's shape */
    if ((r = mgpu_tensor_check("my_sin", "x", x, MGPU_F32, NULL, NULL)) != MGPU_OK) return r;
    if ((r = mgpu_tensor_check("my_sin", "y", y, MGPU_F32, "x", x)) != MGPU_OK) return r;
    if (n == 0) return MGPU_OK;
    if (mgpu_device_kind_of(dev) == MGPU_DEVICE_CPU) {
        sin_job job;
        job.x = (const float*)mgpu_tensor_data(x);
        job.y = (float*)mgpu_tensor_data(y);
        return mgpu_cpu_parallel(dev, n, 0, sin_slice, &job);   /* 0: mgpu's usual slice size */
    }
#ifdef MGPU_CUDA
    {
        void* stream;
        /* the GPU made current, and the stream all of this device's work goes to */
        if ((r = mgpu_cuda_begin(dev, &stream)) != MGPU_OK) return r;
        sin_launch(stream, (const float*)mgpu_tensor_data(x), (float*)mgpu_tensor_data(y), (size_t)n);
        return mgpu_cuda_end(dev, "sin_kernel");   /* did the launch start? */
    }
#else
    return MGPU_ERROR_UNSUPPORTED;   /* not reached: without MGPU_CUDA every device is a CPU device */
#endif
}

/* sin(2x) on one device, checked against the C library; 0 when right */
static int run_on(mgpu_device* dev, const float* hx, float* hy) {
    mgpu_tensor *x = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    mgpu_tensor *x2 = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    mgpu_tensor *y = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    mgpu_tensor *labels = mgpu_tensor_create(dev, MGPU_I32, mgpu_shape1(N));
    double worst = 0.0;
    int i, bad = 1;
    if (!x || !x2 || !y || !labels) { fprintf(stderr, "%s\n", mgpu_last_error()); goto done; }
    if (mgpu_tensor_upload(x, hx, N * sizeof(float)) != MGPU_OK ||
        mgpu_scale(x2, x, 2.0f) != MGPU_OK ||                          /* mgpu's op, queued... */
        my_sin(y, x2) != MGPU_OK ||                                     /* ...ours, after it... */
        mgpu_tensor_download(y, hy, N * sizeof(float)) != MGPU_OK) {   /* ...and a wait for both */
        fprintf(stderr, "%s: %s\n", mgpu_device_label(dev), mgpu_last_error());
        goto done;
    }
    for (i = 0; i < N; ++i) {
        double err = fabs((double)hy[i] - sin(2.0 * (double)hx[i]));   /* 2x is exact in float */
        if (!(err <= worst)) worst = err;                                /* a NaN sticks */
    }
    printf("%-8s sin of %d values, largest error against the C library %.2e (tolerance %.0e)\n",
           mgpu_device_label(dev), N, worst, TOLERANCE);
    /* a wrong dtype: refused, with the op, the tensor and the dtypes named */
    if (my_sin(labels, x2) != MGPU_ERROR_DTYPE_MISMATCH) {
        fprintf(stderr, "%s: my_sin into an i32 tensor was not refused\n", mgpu_device_label(dev));
        goto done;
    }
    printf("%-8s refused, as it should be: %s\n", mgpu_device_label(dev), mgpu_last_error());
    bad = !(worst <= TOLERANCE);
done:
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(x2);
    mgpu_tensor_destroy(y);
    mgpu_tensor_destroy(labels);
    return bad;
}

int main(int argc, char** argv) {
    static float hx[N], hy[N];
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "auto");
    int d, i, failures = 0;
    if (!set) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    for (i = 0; i < N; ++i) hx[i] = -25.0f + 50.0f * (float)i / N;   /* x in [-25, 25): 2x spans 16 turns */
    printf("devices: %s\n", mgpu_device_set_spec(set));
    for (d = 0; d < mgpu_device_set_count(set); ++d) failures += run_on(mgpu_device_set_get(set, d), hx, hy);
    mgpu_device_set_destroy(set);
    if (failures) { printf("%d device(s) failed\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
