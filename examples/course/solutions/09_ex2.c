/* 09_ex2.c - lesson 09, exercise 2: Sin as a layer, its backward written by hand.
   A custom layer (mgpu_layer_vtable, as in examples/custom_layer.c) whose forward is our sin and
   whose backward is dx = dy * cos(x): two ops of our own, each with a CPU loop and a CUDA kernel
   (09_ex2_kernel.cu). First the backward op alone is checked against the C library on each
   device; then a model Linear(1, 16) -> Sin -> Linear(16, 1) learns t -> 0.5 sin(3t) + 0.3 cos(t)
   with the MSE loss, one replica per device, so the layer runs inside mgpu's training steps.
   Run:  09_ex2 [DEVICES]    (build it as 09_sin.c, with 09_ex2_kernel.cu as its kernels file) */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-kernels: examples/course/solutions/09_ex2_kernel.cu
// course-expect: backward against dy * cos(x)
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>

#define N 10000
#define BATCH 64
#define STEPS 300

#ifdef MGPU_CUDA
void sin_launch(void* stream, const float* x, float* y, size_t n);                          /* 09_ex2_kernel.cu */
void sin_backward_launch(void* stream, const float* dy, const float* x, float* dx, size_t n);
#endif

/* ---- the two ops: the CPU slices, then one function each that checks and dispatches ---- */
typedef struct sin_job { const float *x, *dy; float* out; } sin_job;
static void sin_slice(void* user, int64_t begin, int64_t end) {
    const sin_job* j = (const sin_job*)user;
    int64_t i;
    for (i = begin; i < end; ++i) j->out[i] = sinf(j->x[i]);
}
static void sin_backward_slice(void* user, int64_t begin, int64_t end) {
    const sin_job* j = (const sin_job*)user;
    int64_t i;
    for (i = begin; i < end; ++i) j->out[i] = j->dy[i] * cosf(j->x[i]);
}

/* out = sin(x) (dy NULL), or out = dy * cos(x) */
static mgpu_result sin_op(const char* op, mgpu_tensor* out, const mgpu_tensor* dy, const mgpu_tensor* x) {
    mgpu_device* dev = mgpu_tensor_device(x);
    int64_t n = mgpu_tensor_numel(x);
    mgpu_result r;
    sin_job job;
    if ((r = mgpu_tensor_check(op, "x", x, MGPU_F32, NULL, NULL)) != MGPU_OK) return r;
    if ((r = mgpu_tensor_check(op, "out", out, MGPU_F32, "x", x)) != MGPU_OK) return r;
    if (dy && (r = mgpu_tensor_check(op, "dy", dy, MGPU_F32, "x", x)) != MGPU_OK) return r;
    if (n == 0) return MGPU_OK;
    job.x = (const float*)mgpu_tensor_data(x);
    job.dy = dy ? (const float*)mgpu_tensor_data(dy) : NULL;
    job.out = (float*)mgpu_tensor_data(out);
    if (mgpu_device_kind_of(dev) == MGPU_DEVICE_CPU)
        return mgpu_cpu_parallel(dev, n, 0, dy ? sin_backward_slice : sin_slice, &job);
#ifdef MGPU_CUDA
    {
        void* stream;
        if ((r = mgpu_cuda_begin(dev, &stream)) != MGPU_OK) return r;
        if (dy) sin_backward_launch(stream, job.dy, job.x, job.out, (size_t)n);
        else sin_launch(stream, job.x, job.out, (size_t)n);
        return mgpu_cuda_end(dev, dy ? "sin_backward_kernel" : "sin_kernel");
    }
#else
    return MGPU_ERROR_UNSUPPORTED;   /* not reached: without MGPU_CUDA every device is a CPU device */
#endif
}

/* ---- the layer: no parameters, no saved buffers (backward gets x from the model) ---- */
static mgpu_result sin_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)ctx;
    return sin_op("Sin forward", y, NULL, x);
}
static mgpu_result sin_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)y;
    return dx ? sin_op("Sin backward", dx, dy, x) : MGPU_OK;   /* dx NULL: the first layer */
}
static const mgpu_layer_vtable sin_vtable = {
    "Sin", NULL, NULL, NULL, NULL, NULL, NULL, sin_forward, sin_backward, NULL, NULL, NULL, NULL
};

static float target(float t) { return 0.5f * sinf(3.0f * t) + 0.3f * cosf(t); }

/* the backward op alone against dy * cos(x) from the C library; 0 when right */
static int check_backward(mgpu_device* dev) {
    static float hx[N], hdy[N], hdx[N];
    mgpu_tensor *x = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N)), *dy = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    mgpu_tensor* dx = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(N));
    double worst = 0.0;
    int i, bad = 1;
    for (i = 0; i < N; ++i) { hx[i] = -20.0f + 40.0f * (float)i / N; hdy[i] = (float)((i % 7) - 3); }
    if (!x || !dy || !dx || mgpu_tensor_upload(x, hx, sizeof hx) != MGPU_OK || mgpu_tensor_upload(dy, hdy, sizeof hdy) != MGPU_OK ||
        sin_op("Sin backward", dx, dy, x) != MGPU_OK || mgpu_tensor_download(dx, hdx, sizeof hdx) != MGPU_OK) {
        fprintf(stderr, "%s: %s\n", mgpu_device_label(dev), mgpu_last_error());
    } else {
        for (i = 0; i < N; ++i) {
            double err = fabs((double)hdx[i] - (double)hdy[i] * cos((double)hx[i]));
            if (!(err <= worst)) worst = err;
        }
        printf("%-8s largest error of the backward against dy * cos(x) %.2e (tolerance 1e-05)\n", mgpu_device_label(dev), worst);
        bad = !(worst <= 1e-5);   /* |dy| <= 3: three times sin's tolerance, and some */
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(dy); mgpu_tensor_destroy(dx);
    return bad;
}

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "auto");
    mgpu_layer* layers[3];
    mgpu_model* model = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_tensor *x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, 1));
    mgpu_tensor *y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, 1));
    float first = 0.0f, loss = 0.0f, *px, *py;
    uint32_t state = 12345;
    int d, step, i, failures = 0;
    if (!set || !x || !y) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    for (d = 0; d < mgpu_device_set_count(set); ++d) failures += check_backward(mgpu_device_set_get(set, d));

    layers[0] = mgpu_layer_linear(1, 16);
    layers[1] = mgpu_layer_create(&sin_vtable, NULL);
    layers[2] = mgpu_layer_linear(16, 1);
    model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(1), .layers = layers, .layer_count = 3,
                                                  .devices = set, .loss = MGPU_LOSS_MSE, .seed = 1 });
    opt = model ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = 0.02f }) : NULL;
    if (!model || !opt) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    px = (float*)mgpu_tensor_data(x);
    py = (float*)mgpu_tensor_data(y);
    for (step = 0; step < STEPS; ++step) {
        for (i = 0; i < BATCH; ++i) {   /* t uniform in [-2, 2), from a small LCG */
            state = state * 1664525u + 1013904223u;
            px[i] = -2.0f + 4.0f * (float)(state >> 8) / 16777216.0f;
            py[i] = target(px[i]);
        }
        if (mgpu_model_train_step(model, opt, x, y, &loss) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        if (step == 0) first = loss;
        if (step % 100 == 0 || step == STEPS - 1) printf("step %3d  loss %.5f\n", step, (double)loss);
    }
    printf("training on %s: loss %.5f -> %.5f\n", mgpu_device_set_spec(set), (double)first, (double)loss);
    if (!(loss < 0.01f && loss < first / 10.0f)) { printf("the loss did not fall below 0.01 and a tenth of the first\n"); failures++; }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);   /* and its layers, ours too */
    mgpu_device_set_destroy(set);
    if (failures) { printf("%d check(s) failed\n", failures); return 1; }
    printf("all checks passed\n");
    return 0;
}
