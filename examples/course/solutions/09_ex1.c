/* 09_ex1.c - lesson 09, exercise 1: cos, the way 09_sin.c does sin.
   my_cos checks its tensors, then runs a CPU loop on mgpu's thread pool or launches cos_kernel
   (09_ex1_kernel.cu) on the device's stream. On each device: y = cos(x) for 100000 values of x,
   then the identity sin^2 + cos^2 = 1 by mgpu's own ops (mul, add) queued after ours, and both
   checked against the C library.
   Run:  09_ex1 [DEVICES]    (build it as 09_sin.c, with 09_ex1_kernel.cu as its kernels file) */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-kernels: examples/course/solutions/09_ex1_kernel.cu
// course-expect: largest error of cos against the C library
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>

#define N 100000
#define TOLERANCE 1e-6

#ifdef MGPU_CUDA
void cos_launch(void* stream, const float* x, float* y, size_t n);   /* 09_ex1_kernel.cu */
#endif

typedef struct cos_job { const float* x; float* y; } cos_job;
static void cos_slice(void* user, int64_t begin, int64_t end) {
    const cos_job* job = (const cos_job*)user;
    int64_t i;
    for (i = begin; i < end; ++i) job->y[i] = cosf(job->x[i]);
}

static mgpu_result my_cos(mgpu_tensor* y, const mgpu_tensor* x) {
    mgpu_device* dev = mgpu_tensor_device(x);
    int64_t n = mgpu_tensor_numel(x);
    mgpu_result r;
    if ((r = mgpu_tensor_check("my_cos", "x", x, MGPU_F32, NULL, NULL)) != MGPU_OK) return r;
    if ((r = mgpu_tensor_check("my_cos", "y", y, MGPU_F32, "x", x)) != MGPU_OK) return r;
    if (n == 0) return MGPU_OK;
    if (mgpu_device_kind_of(dev) == MGPU_DEVICE_CPU) {
        cos_job job;
        job.x = (const float*)mgpu_tensor_data(x);
        job.y = (float*)mgpu_tensor_data(y);
        return mgpu_cpu_parallel(dev, n, 0, cos_slice, &job);
    }
#ifdef MGPU_CUDA
    {
        void* stream;
        if ((r = mgpu_cuda_begin(dev, &stream)) != MGPU_OK) return r;
        cos_launch(stream, (const float*)mgpu_tensor_data(x), (float*)mgpu_tensor_data(y), (size_t)n);
        return mgpu_cuda_end(dev, "cos_kernel");
    }
#else
    return MGPU_ERROR_UNSUPPORTED;   /* not reached: without MGPU_CUDA every device is a CPU device */
#endif
}

/* cos(x), and sin(x)^2 + cos(x)^2 with sin from the C library; 0 when both are right */
static int run_on(mgpu_device* dev, const float* hx, const float* hsin, float* hy) {
    mgpu_tensor *x = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N)), *s = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    mgpu_tensor *c = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N)), *one = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    double worst = 0.0, worst_one = 0.0;
    int i, bad = 1;
    if (!x || !s || !c || !one) { fprintf(stderr, "%s\n", mgpu_last_error()); goto done; }
    if (mgpu_tensor_upload(x, hx, N * sizeof(float)) != MGPU_OK || mgpu_tensor_upload(s, hsin, N * sizeof(float)) != MGPU_OK ||
        my_cos(c, x) != MGPU_OK || mgpu_tensor_download(c, hy, N * sizeof(float)) != MGPU_OK) goto fail;
    for (i = 0; i < N; ++i) {
        double err = fabs((double)hy[i] - cos((double)hx[i]));
        if (!(err <= worst)) worst = err;
    }
    if (mgpu_mul(s, s, s) != MGPU_OK || mgpu_mul(c, c, c) != MGPU_OK || mgpu_add(one, s, c) != MGPU_OK ||
        mgpu_tensor_download(one, hy, N * sizeof(float)) != MGPU_OK) goto fail;
    for (i = 0; i < N; ++i) {
        double err = fabs((double)hy[i] - 1.0);
        if (!(err <= worst_one)) worst_one = err;
    }
    printf("%-8s largest error of cos against the C library %.2e, of sin^2 + cos^2 against 1 %.2e (tolerance %.0e)\n",
           mgpu_device_label(dev), worst, worst_one, TOLERANCE);
    bad = !(worst <= TOLERANCE && worst_one <= TOLERANCE);
    goto done;
fail:
    fprintf(stderr, "%s: %s\n", mgpu_device_label(dev), mgpu_last_error());
done:
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(s); mgpu_tensor_destroy(c); mgpu_tensor_destroy(one);
    return bad;
}

int main(int argc, char** argv) {
    static float hx[N], hsin[N], hy[N];
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "auto");
    int d, i, failures = 0;
    if (!set) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    for (i = 0; i < N; ++i) {
        hx[i] = -50.0f + 100.0f * (float)i / N;
        hsin[i] = (float)sin((double)hx[i]);
    }
    for (d = 0; d < mgpu_device_set_count(set); ++d) failures += run_on(mgpu_device_set_get(set, d), hx, hsin, hy);
    mgpu_device_set_destroy(set);
    if (failures) { printf("%d device(s) failed\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
