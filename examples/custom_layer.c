/* custom_layer.c - write your own layer: SiLU (x * sigmoid(x), nn.SiLU in PyTorch).
   A layer is a vtable of plain functions. It holds no tensors: the model hands each call its
   parameters, gradients and the buffers the layer asked for (aux), per replica and device, so
   the same layer works on the CPU, a GPU or several at once. Built from mgpu's ops, it runs
   wherever they run.
     cc -std=c99 -I.. custom_layer.c -lm -lpthread && ./a.out */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

/* two saved buffers, both shaped like the input: s = sigmoid(x), and scratch for backward */
static int silu_aux_count(const mgpu_layer* l) { (void)l; return 2; }
static mgpu_result silu_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)l; (void)i;
    *dt = MGPU_F32;
    *shape = x;
    return MGPU_OK;
}

/* y = x * s */
static mgpu_result silu_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_result r = mgpu_sigmoid(ctx->aux[0], x);
    (void)l;
    return r != MGPU_OK ? r : mgpu_mul(y, x, ctx->aux[0]);
}

/* dy/dx = s + x * s * (1 - s), so dx = dy * s + (dy * x) * s * (1 - s) */
static mgpu_result silu_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                 const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu_tensor *s = ctx->aux[0], *tmp = ctx->aux[1];
    mgpu_result r;
    (void)l; (void)y;
    if (!dx) return MGPU_OK;                                       /* first layer: nothing to pass back */
    if ((r = mgpu_mul(tmp, dy, x)) != MGPU_OK) return r;           /* dy * x */
    if ((r = mgpu_sigmoid_backward(dx, tmp, s)) != MGPU_OK) return r; /* (dy * x) * s * (1 - s) */
    if ((r = mgpu_mul(tmp, dy, s)) != MGPU_OK) return r;           /* dy * s */
    return mgpu_add(dx, dx, tmp);
}

static const mgpu_layer_vtable silu_vtable = {
    "SiLU",          /* type, as PyTorch names it */
    NULL,            /* output_shape: same as the input */
    NULL, NULL,      /* no parameters */
    NULL,            /* nothing to initialise */
    silu_aux_count, silu_aux_shape,
    silu_forward, silu_backward,
    NULL, NULL,      /* describe, destroy */
    NULL, NULL       /* no buffers (running statistics) */
};

int main(void) {
    mgpu_layer* layers[3];
    mgpu_model* model;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y;
    float loss = 0.0f, *px;
    int32_t* py;
    int step, i, j;
    layers[0] = mgpu_layer_linear(16, 32);
    layers[1] = mgpu_layer_create(&silu_vtable, NULL);   /* ours, beside the built-ins */
    layers[2] = mgpu_layer_linear(32, 4);
    /* fields left out are zero, and zero means default (sokol-style) */
    model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(16), .layers = layers, .layer_count = 3, .seed = 3 });
    opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });
    x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(64, 16));
    y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(64));
    if (!model || !opt || !x || !y) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    mgpu_model_summary(model, NULL);
    px = (float*)mgpu_tensor_data(x);
    py = (int32_t*)mgpu_tensor_data(y);
    for (step = 0; step < 300; ++step) {
        mgpu_rand_normal(x, 11, (uint64_t)step * mgpu_rand_offsets(64 * 16), 0.0f, 1.0f);
        for (i = 0; i < 64; ++i) {   /* the label: which of four groups of inputs sums highest */
            float best = -1e30f;
            for (j = 0; j < 4; ++j) {
                float s = px[i * 16 + 4 * j] + px[i * 16 + 4 * j + 1] + px[i * 16 + 4 * j + 2] + px[i * 16 + 4 * j + 3];
                if (s > best) { best = s; py[i] = j; }
            }
        }
        if (mgpu_model_train_step(model, opt, x, y, &loss) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        if (step % 50 == 0 || step == 299) printf("step %3d  loss %.4f\n", step, (double)loss);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);   /* destroys its layers, ours too */
    return loss < 0.3f ? 0 : 1;
}
