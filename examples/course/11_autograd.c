/* 11_autograd.c - lesson 11: autograd. PyTorch records every op of a forward in a graph and
   loss.backward() walks it back; mgpu's tape does the same, in C, on any device.

   Part 1, on every device of the set: L = mean(tanh(x w)) for x [4, 3] and w [3, 2]. Its gradient
   dL/dw three ways: derived by a tape (mgpu_tape_*), written by hand with mgpu's ops (the chain
   rule: dz = dL/dy * (1 - y^2), dw = x^T dz), and by central finite differences in double
   precision on the host. They must agree.
   Part 2, on the whole set: SiLU (x * sigmoid(x)) as a layer twice, once with its backward
   written by hand (examples/custom_layer.c's) and once made of tape ops with no backward at all,
   each between two Linear layers; one training step's gradients of both models must be equal.

   Run:  11_autograd [DEVICES]      cpu, cpu:2, cuda:0,1 ...  [cpu:2]
   CPU only:       cc -std=c99 -O2 -I. examples/course/11_autograd.c -lm -lpthread
   Emulated GPUs:  make emu-program SRC=examples/course/11_autograd.c
                   MGPU_EMU_DEVICES=2 build/emu/11_autograd cuda:0,1 */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-expect: the tape's gradient = the hand-written one
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

static const float X[12] = { 0.5f, -1.0f, 0.25f, 1.5f, 0.75f, -0.5f, -0.25f, 2.0f, 1.0f, 0.125f, -1.5f, 0.5f };
static const float W[6] = { 0.3f, -0.2f, 0.1f, 0.4f, -0.5f, 0.25f };

/* L(w) = mean(tanh(x w)) in double, for finite differences */
static double loss64(const double* w) {
    double s = 0.0;
    int i, j, k;
    for (i = 0; i < 4; ++i)
        for (j = 0; j < 2; ++j) {
            double z = 0.0;
            for (k = 0; k < 3; ++k) z += (double)X[i * 3 + k] * w[k * 2 + j];
            s += tanh(z);
        }
    return s / 8.0;
}

/* part 1 on one device; 0 when the three gradients agree */
static int part1(mgpu_device* dev) {
    mgpu_tensor *x = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(4, 3)), *w = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(3, 2));
    mgpu_tensor *z = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(4, 2)), *y = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(4, 2));
    mgpu_tensor *dz = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(4, 2)), *dw = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(3, 2));
    mgpu_tape* tape = mgpu_tape_create(dev);
    float by_tape[6], by_hand[6];
    double w64[6], fd[6], hand_diff = 0.0, fd_diff = 0.0;
    int i, bad = 1;
    if (!x || !w || !z || !y || !dz || !dw || !tape || mgpu_tensor_upload(x, X, sizeof X) || mgpu_tensor_upload(w, W, sizeof W)) goto done;

    /* 1. the tape: run the forward through it, then backward */
    if (mgpu_tape_watch(tape, w) != MGPU_OK) goto done;   /* w.requires_grad_() */
    const mgpu_tensor* loss = mgpu_tape_mean(tape, mgpu_tape_tanh(tape, mgpu_tape_matmul(tape, x, w, MGPU_NO_TRANS, MGPU_NO_TRANS)),
                                             MGPU_ALL_AXES, 0);
    if (mgpu_tape_backward(tape, loss, NULL) != MGPU_OK) goto done;   /* loss.backward() */
    if (mgpu_tensor_download(mgpu_tape_grad(tape, w), by_tape, sizeof by_tape) != MGPU_OK) goto done;   /* w.grad */

    /* 2. by hand: the forward, then the chain rule backwards */
    if (mgpu_matmul(z, x, w, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f) || mgpu_tanh(y, z)) goto done;
    if (mgpu_tensor_fill(dz, 1.0 / 8.0)) goto done;                     /* dL/dy: the mean's 1/8 each */
    if (mgpu_tanh_backward(dz, dz, y)) goto done;                       /* dz = dL/dy * (1 - y^2) */
    if (mgpu_matmul(dw, x, dz, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f)) goto done;   /* dw = x^T dz */
    if (mgpu_tensor_download(dw, by_hand, sizeof by_hand) != MGPU_OK) goto done;

    /* 3. finite differences: (L(w + h) - L(w - h)) / 2h, in double */
    for (i = 0; i < 6; ++i) w64[i] = W[i];
    for (i = 0; i < 6; ++i) {
        const double h = 1e-6, keep = w64[i];
        double up, down;
        w64[i] = keep + h; up = loss64(w64);
        w64[i] = keep - h; down = loss64(w64);
        w64[i] = keep;
        fd[i] = (up - down) / (2.0 * h);
    }
    for (i = 0; i < 6; ++i) {
        hand_diff = fmax(hand_diff, fabs((double)by_tape[i] - (double)by_hand[i]));
        fd_diff = fmax(fd_diff, fabs((double)by_tape[i] - fd[i]));
    }
    printf("%-8s dL/dw[0] = %.6f; the tape against the hand-written backward: %.1e, against finite differences: %.1e\n",
           mgpu_device_label(dev), (double)by_tape[0], hand_diff, fd_diff);
    bad = !(hand_diff <= 1e-6 && fd_diff <= 1e-6);
done:
    if (bad && mgpu_last_result() != MGPU_OK) printf("%s: %s\n", mgpu_device_label(dev), mgpu_last_error());
    mgpu_tape_destroy(tape);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(w); mgpu_tensor_destroy(z); mgpu_tensor_destroy(y);
    mgpu_tensor_destroy(dz); mgpu_tensor_destroy(dw);
    return bad;
}

/* ---- part 2: SiLU twice ---- */
/* by hand, as examples/custom_layer.c: s = sigmoid(x) kept from forward (aux), then
   dx = dy * s + (dy * x) * s * (1 - s) */
static int silu_aux_count(const mgpu_layer* l) { (void)l; return 2; }
static mgpu_result silu_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    (void)l; (void)i;
    *dt = MGPU_F32;
    *shape = x;
    return MGPU_OK;
}
static mgpu_result silu_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_result r = mgpu_sigmoid(ctx->aux[0], x);
    (void)l;
    return r != MGPU_OK ? r : mgpu_mul(y, x, ctx->aux[0]);
}
static mgpu_result silu_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                 const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu_tensor *s = ctx->aux[0], *tmp = ctx->aux[1];
    mgpu_result r;
    (void)l; (void)y;
    if ((r = mgpu_mul(tmp, dy, x)) != MGPU_OK) return r;
    if ((r = mgpu_sigmoid_backward(dx, tmp, s)) != MGPU_OK) return r;
    if ((r = mgpu_mul(tmp, dy, s)) != MGPU_OK) return r;
    return mgpu_add(dx, dx, tmp);
}
static const mgpu_layer_vtable silu_vtable = { "SiLU", NULL, NULL, NULL, NULL, silu_aux_count, silu_aux_shape,
                                               silu_forward, silu_backward, NULL, NULL, NULL, NULL };

/* made of ops: the forward alone, and the tape derives the rest */
static const mgpu_tensor* silu_ops(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* params) {
    (void)user; (void)params;
    return mgpu_tape_mul(t, x, mgpu_tape_sigmoid(t, x));
}

/* Linear(4, 8) -> silu -> Linear(8, 3) on set, one step's gradients (replica 0's, summed over the
   replicas) into g: the flat gradient buffer, n floats (padding between parameters included) */
static int gradients(mgpu_device_set* set, mgpu_layer* silu, float* g, int64_t n, float* loss) {
    mgpu_layer* layers[3] = { mgpu_layer_linear(4, 8), silu, mgpu_layer_linear(8, 3) };
    mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = layers, .layer_count = 3,
                                                          .devices = set, .seed = 11 });
    mgpu_tensor *x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(6, 4));
    mgpu_tensor *labels = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(6));
    const int32_t lab[6] = { 0, 2, 1, 1, 0, 2 };
    int bad = !m || !x || !labels || mgpu_tensor_numel(mgpu_model_grads(m, 0)) > n ||
              mgpu_rand_normal(x, 5, 0, 0.0f, 1.0f) || mgpu_tensor_upload(labels, lab, sizeof lab) ||
              mgpu_model_accumulate(m, x, labels, 0, loss) || mgpu_model_reduce_grads(m) ||
              mgpu_tensor_download(mgpu_model_grads(m, 0), g, mgpu_tensor_bytes(mgpu_model_grads(m, 0)));
    if (bad) printf("%s\n", mgpu_last_error());
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(labels);
    mgpu_model_destroy(m);
    return bad;
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "cpu:2";
    mgpu_device_set* set = mgpu_device_set_create(spec);
    enum { N = 256 };   /* room for the two Linears' 67 parameters in the flat buffer */
    static float by_hand[N], by_tape[N];
    float loss_hand = 0.0f, loss_tape = 0.0f;
    int i, bad = 0, equal;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    printf("devices: %s\n", mgpu_device_set_spec(set));
    printf("part 1: dL/dw of L = mean(tanh(x w)), three ways\n");
    for (i = 0; i < mgpu_device_set_count(set); ++i) bad |= part1(mgpu_device_set_get(set, i));
    if (!bad) printf("the tape's gradient = the hand-written one (within 1e-6), and = finite differences (within 1e-6)\n");

    printf("part 2: SiLU with its backward by hand, and made of ops with none\n");
    const mgpu_op_layer_desc ops = { .type = "SiLU", .forward = silu_ops };
    bad |= gradients(set, mgpu_layer_create(&silu_vtable, NULL), by_hand, N, &loss_hand);
    bad |= gradients(set, mgpu_layer_from_ops(&ops), by_tape, N, &loss_tape);
    equal = !bad && loss_hand == loss_tape && !memcmp(by_hand, by_tape, sizeof by_hand);
    printf("loss %.6f and %.6f; the gradients %s\n", (double)loss_hand, (double)loss_tape,
           equal ? "equal bit for bit" : "DIFFER");
    bad |= !equal;
    mgpu_device_set_destroy(set);
    printf("%s\n", bad ? "FAILED" : "all checks passed");
    return bad;
}
