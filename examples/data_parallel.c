/* data_parallel.c - data parallelism step by step, the way a course would draw it on the board.

     ./data_parallel cpu:4          four CPU replicas (threads), any machine
     ./data_parallel cuda:0,1       two GPUs
     ./data_parallel cuda:0,0,0,0   four replicas sharing one GPU

   One training step on N devices is five moves:
     1. REPLICATE  once, before training: every device holds the same model (replica 0 is
                   initialised and copied to the others). Never again: replicas stay equal
                   because they all take the same optimizer step.
     2. SPLIT      each step, the batch of B samples is cut into N slices, one per device.
     3. COMPUTE    every device runs forward, loss and backward on its slice. Its loss gradient
                   is scaled by 1/B (the WHOLE batch), so the N partial gradients add up to the
                   gradient of the whole batch.
     4. REDUCE     the gradients are summed across devices (an all-reduce); afterwards every
                   device holds the full-batch gradient, bit for bit the same.
     5. UPDATE     every device applies the same optimizer step to the same parameters.
   mgpu_model_train_step does all five in one call, and overlaps 4 with 3 (gradient buckets are
   reduced while backward is still running). Here they are spelled out with the public API. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define BATCH 60
#define FEATURES 20
#define CLASSES 3
#define MAX_DEVICES 16

#define TRY(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; } } while (0)

/* A toy task: the class is which third of the features sums highest. */
static void make_batch(mgpu_tensor* x, mgpu_tensor* y, int step) {
    float* px = (float*)mgpu_tensor_data(x);
    int32_t* py = (int32_t*)mgpu_tensor_data(y);
    int i, c, f;
    mgpu_rand_normal(x, 5, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f);
    for (i = 0; i < BATCH; ++i) {
        float best = -1e30f;
        for (c = 0; c < CLASSES; ++c) {
            float s = 0.0f;
            for (f = c * FEATURES / CLASSES; f < (c + 1) * FEATURES / CLASSES; ++f) s += px[i * FEATURES + f];
            if (s > best) { best = s; py[i] = c; }
        }
    }
}

int main(int argc, char** argv) {
    mgpu_device_set* devices = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:4");
    mgpu_layer* layers[3];
    mgpu_model* model;
    mgpu_optimizer* opt;
    mgpu_allreduce* allreduce;
    mgpu_tensor *x, *y, *xs[MAX_DEVICES], *ys[MAX_DEVICES], *loss[MAX_DEVICES], *dout[MAX_DEVICES], *grads[MAX_DEVICES];
    int n, r, step;
    if (!devices) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    n = mgpu_device_set_count(devices);
    if (n > MAX_DEVICES) { fprintf(stderr, "at most %d devices here\n", MAX_DEVICES); return 1; }

    /* 1. REPLICATE: a model with one replica per device of the set */
    layers[0] = mgpu_layer_linear(FEATURES, 32);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(32, CLASSES);
    /* fields left out are zero, and zero means default (sokol-style) */
    model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                   .devices = devices });
    if (!model) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });   /* it updates every replica */
    allreduce = mgpu_allreduce_create(devices, MGPU_ALLREDUCE_AUTO);
    if (!opt || !allreduce) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    printf("%d replicas on %s, all-reduce backend: %s\n", n, mgpu_device_set_spec(devices),
           mgpu_allreduce_name(mgpu_allreduce_backend(allreduce)));

    /* the host batch, and each device's slice of it (B/N rows; the first B%N devices one more) */
    x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES));
    y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH));
    for (r = 0; r < n; ++r) {
        mgpu_device* dev = mgpu_model_device(model, r);
        int rows = BATCH / n + (r < BATCH % n);
        xs[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(rows, FEATURES));
        ys[r] = mgpu_tensor_create(dev, MGPU_I32, mgpu_shape1(rows));
        loss[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(1));
        dout[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(rows, CLASSES));
        grads[r] = mgpu_model_grads(model, r);   /* the replica's flat gradient buffer */
        if (!xs[r] || !ys[r] || !loss[r] || !dout[r]) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    }

    for (step = 0; step < 200; ++step) {
        float total = 0.0f;
        int start = 0;
        make_batch(x, y, step);
        TRY(mgpu_model_zero_grad(model));
        for (r = 0; r < n; ++r) {
            /* 2. SPLIT: copy this device's rows over (a view of the host batch, then a copy) */
            int rows = (int)mgpu_tensor_dim(xs[r], 0);
            mgpu_tensor* xv = mgpu_tensor_view_rows(x, start, rows);
            mgpu_tensor* yv = mgpu_tensor_view_rows(y, start, rows);
            const mgpu_tensor* logits;
            float l;
            TRY(mgpu_tensor_copy(xs[r], xv));
            TRY(mgpu_tensor_copy(ys[r], yv));
            mgpu_tensor_destroy(xv);
            mgpu_tensor_destroy(yv);
            start += rows;
            /* 3. COMPUTE: forward, loss with the gradient scaled by 1/BATCH, backward */
            logits = mgpu_model_forward(model, r, xs[r], 1);
            if (!logits) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
            TRY(mgpu_softmax_cross_entropy(loss[r], dout[r], logits, ys[r], 1.0f / BATCH));
            TRY(mgpu_model_backward(model, r, dout[r]));
            TRY(mgpu_tensor_download(loss[r], &l, sizeof l));
            total += l * (float)rows / BATCH;   /* the batch's mean loss */
        }
        /* 4. REDUCE: every replica's gradient becomes the sum over all replicas */
        TRY(mgpu_allreduce_sum(allreduce, grads, n));
        /* 5. UPDATE: the same step on every replica */
        TRY(mgpu_optimizer_step(opt));
        if (step % 40 == 0 || step == 199) printf("step %3d  loss %.4f\n", step, (double)total);
    }
    /* the replicas never drifted apart: compare them bit for bit */
    TRY(mgpu_model_verify_replicas(model));
    printf("all %d replicas hold identical parameters\n", n);

    for (r = 0; r < n; ++r) {
        mgpu_tensor_destroy(xs[r]);
        mgpu_tensor_destroy(ys[r]);
        mgpu_tensor_destroy(loss[r]);
        mgpu_tensor_destroy(dout[r]);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_allreduce_destroy(allreduce);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    mgpu_device_set_destroy(devices);
    return 0;
}
