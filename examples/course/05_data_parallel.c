/* 05_data_parallel.c - data parallelism step by step (lesson 05).

   One step of data parallelism on N devices is five moves: replicate, split, compute, reduce,
   update. This program trains the same small classifier three ways and compares them:

     A. one device: the reference.
     B. "DataParallel": like PyTorch's nn.DataParallel, the model lives on device 0 and is copied
        to the other devices at EVERY step; their gradients are gathered back on device 0, which
        alone really updates.
     C. persistent replicas: like DistributedDataParallel (DDP), every device keeps its replica
        for the whole training; each step only the gradients travel, in one all-reduce, and every
        replica takes the same optimizer step (mgpu_model_train_step).

   It checks its own results: B and C within 1e-4 of A, and C's replicas bit-identical. Then it
   prints what each device did (mgpu_device_get_counters): the rows it ran, the bytes it received
   from other devices and the bytes it all-reduced. B moves the whole model every step; C never.

   Run:  build/course/05_data_parallel cpu:2                   (two CPU replicas)
         MGPU_EMU_DEVICES=2 build/emu/05_data_parallel cuda:0,1   (two emulated GPUs)      */
// course-run: cpu:2
// course-run: cpu:3
// course-run-emu 2: cuda:0,1
// course-expect: replicas bit-identical: yes
// course-expect: DataParallel and DDP both equal one device within 1e-4
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>
#include <math.h>

#define BATCH 48
#define FEATURES 16
#define HIDDEN 32
#define CLASSES 4
#define STEPS 20
#define MAX_DEVICES 8

/* Stop at the first failure, saying what failed. */
#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); exit(1); } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); exit(1); } } while (0)

/* The same toy data for every run: random inputs, the class is the quarter of the features
   that sums highest. Step s always gets the same batch. */
static void make_batch(mgpu_tensor* x, mgpu_tensor* y, int step) {
    float* px = (float*)mgpu_tensor_data(x);
    int32_t* py = (int32_t*)mgpu_tensor_data(y);
    int i, c, f;
    CHECK(mgpu_rand_normal(x, 11, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f));
    for (i = 0; i < BATCH; ++i) {
        float best = -1e30f;
        for (c = 0; c < CLASSES; ++c) {
            float s = 0.0f;
            for (f = c * FEATURES / CLASSES; f < (c + 1) * FEATURES / CLASSES; ++f) s += px[i * FEATURES + f];
            if (s > best) { best = s; py[i] = c; }
        }
    }
}

/* Linear(16, 32) -> ReLU -> Linear(32, 4): one replica on each device of the set. The same seed
   gives the same first weights, whatever the devices. */
static mgpu_model* make_model(mgpu_device_set* set) {
    mgpu_layer* layers[3];
    layers[0] = mgpu_layer_linear(FEATURES, HIDDEN);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(HIDDEN, CLASSES);
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                  .devices = set, .seed = 5 });
}
static mgpu_optimizer* make_sgd(mgpu_model* m) {
    return mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f, .momentum = 0.9f });
}

/* Replica r's parameters, downloaded into host memory (every float of the flat buffer). */
static void get_params(mgpu_model* m, int r, float* out) {
    const mgpu_tensor* p = mgpu_model_params(m, r);
    CHECK(mgpu_tensor_download(p, out, mgpu_tensor_bytes(p)));
}
static double max_diff(const float* a, const float* b, int64_t n) {
    double d = 0.0;
    int64_t i;
    for (i = 0; i < n; ++i) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d;
}

/* What each device did since its counters were reset. */
static void print_counters(mgpu_device_set* set, const char* title) {
    int d;
    printf("%s\n", title);
    printf("  device   rows fwd rows bwd  from host  from devices  all-reduced   ops  waits\n");
    for (d = 0; d < mgpu_device_set_count(set); ++d) {
        mgpu_device_counters k;
        CHECK(mgpu_device_get_counters(mgpu_device_set_get(set, d), &k));
        printf("  %-7s %8llu %8llu %8llu B %10llu B %9llu B %5llu %6llu\n", mgpu_device_label(mgpu_device_set_get(set, d)),
               (unsigned long long)k.rows_forward, (unsigned long long)k.rows_backward,
               (unsigned long long)k.bytes_host_to_device, (unsigned long long)k.bytes_device_to_device,
               (unsigned long long)k.bytes_allreduced, (unsigned long long)k.ops, (unsigned long long)k.host_waits);
    }
}
static void reset_counters(mgpu_device_set* set) {
    int d;
    for (d = 0; d < mgpu_device_set_count(set); ++d) mgpu_device_reset_counters(mgpu_device_set_get(set, d));
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "cpu:2";
    mgpu_device_set *one, *set;
    mgpu_model *ref, *dp, *ddp;
    mgpu_optimizer *ref_opt, *dp_opt, *ddp_opt;
    mgpu_tensor *x, *y, *xs[MAX_DEVICES], *ys[MAX_DEVICES], *loss[MAX_DEVICES], *dout[MAX_DEVICES], *gathered;
    float *a, *b, *c;
    int64_t floats;
    int n, r, step, identical = 1;
    double dp_diff, ddp_diff;

    NEED(set = mgpu_device_set_create(spec));
    n = mgpu_device_set_count(set);
    if (n < 2 || n > MAX_DEVICES) { fprintf(stderr, "give 2 to %d devices, e.g. cpu:2 (got %s)\n", MAX_DEVICES, spec); return 1; }
    /* the reference's one device: the first device's kind ("cpu", or "cuda:0") */
    NEED(one = mgpu_device_set_create(mgpu_device_kind_of(mgpu_device_set_get(set, 0)) == MGPU_DEVICE_CUDA ? "cuda:0" : "cpu"));
    printf("%d devices: %s\n", n, mgpu_device_set_spec(set));

    /* the host batch (on the CPU), remade for every step */
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH)));

    /* ---- A. one device ---- */
    NEED(ref = make_model(one));
    NEED(ref_opt = make_sgd(ref));
    for (step = 0; step < STEPS; ++step) {
        make_batch(x, y, step);
        CHECK(mgpu_model_train_step(ref, ref_opt, x, y, NULL));
    }

    /* ---- B. DataParallel: replicate every step, gather the gradients on device 0 ---- */
    NEED(dp = make_model(set));
    NEED(dp_opt = make_sgd(dp));
    for (r = 0; r < n; ++r) {   /* each device's slice of the batch: B/N rows (the first B%N one more) */
        mgpu_device* dev = mgpu_device_set_get(set, r);
        const int rows = BATCH / n + (r < BATCH % n);
        NEED(xs[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(rows, FEATURES)));
        NEED(ys[r] = mgpu_tensor_create(dev, MGPU_I32, mgpu_shape1(rows)));
        NEED(loss[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(1)));
        NEED(dout[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(rows, CLASSES)));
    }
    NEED(gathered = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_tensor_shape(mgpu_model_grads(dp, 0))));
    reset_counters(set);
    for (step = 0; step < STEPS; ++step) {
        int start = 0;
        make_batch(x, y, step);
        CHECK(mgpu_model_zero_grad(dp));
        for (r = 0; r < n; ++r) {
            const int rows = (int)mgpu_tensor_dim(xs[r], 0);
            mgpu_tensor *xv, *yv;
            const mgpu_tensor* logits;
            /* 1. replicate: device 0's weights copied to device r, as DataParallel does each step */
            if (r > 0) CHECK(mgpu_tensor_copy(mgpu_model_params(dp, r), mgpu_model_params(dp, 0)));
            /* 2. split: device r's rows of the batch */
            NEED(xv = mgpu_tensor_view_rows(x, start, rows));
            NEED(yv = mgpu_tensor_view_rows(y, start, rows));
            CHECK(mgpu_tensor_copy(xs[r], xv));
            CHECK(mgpu_tensor_copy(ys[r], yv));
            mgpu_tensor_destroy(xv);
            mgpu_tensor_destroy(yv);
            start += rows;
            /* 3. compute: the loss gradient scaled by 1/BATCH (the whole batch), so that the
                  replicas' gradients add up to the whole batch's */
            NEED(logits = mgpu_model_forward(dp, r, xs[r], 1));
            CHECK(mgpu_softmax_cross_entropy(loss[r], dout[r], logits, ys[r], 1.0f / BATCH));
            CHECK(mgpu_model_backward(dp, r, dout[r]));
        }
        /* 4. reduce: DataParallel gathers every gradient onto device 0 and sums it there */
        for (r = 1; r < n; ++r) {
            CHECK(mgpu_tensor_copy(gathered, mgpu_model_grads(dp, r)));
            CHECK(mgpu_add(mgpu_model_grads(dp, 0), mgpu_model_grads(dp, 0), gathered));
        }
        /* 5. update: mgpu's optimizer steps every replica; only replica 0's step counts (the
              others are overwritten by the next replicate, as DataParallel drops its copies) */
        CHECK(mgpu_optimizer_step(dp_opt));
    }
    print_counters(set, "B. DataParallel (model copied to every device at every step):");

    /* ---- C. persistent replicas (DDP): one call does the five moves ---- */
    NEED(ddp = make_model(set));   /* 1. replicate, once: replica 0's weights copied to the others */
    NEED(ddp_opt = make_sgd(ddp));
    reset_counters(set);
    for (step = 0; step < STEPS; ++step) {
        make_batch(x, y, step);
        CHECK(mgpu_model_train_step(ddp, ddp_opt, x, y, NULL));   /* 2. split 3. compute 4. all-reduce 5. update */
    }
    print_counters(set, "C. persistent replicas, DDP (only gradients travel, all-reduced):");

    /* ---- the checks ---- */
    floats = mgpu_tensor_numel(mgpu_model_params(ref, 0));
    NEED(a = (float*)malloc((size_t)floats * 3 * sizeof(float)));
    b = a + floats;
    c = b + floats;
    get_params(ref, 0, a);
    get_params(dp, 0, b);
    get_params(ddp, 0, c);
    dp_diff = max_diff(b, a, floats);
    ddp_diff = max_diff(c, a, floats);
    for (r = 1; r < n; ++r) {   /* DDP's replicas: every bit the same as replica 0's */
        get_params(ddp, r, b);
        if (memcmp(b, c, (size_t)floats * sizeof(float)) != 0) identical = 0;
    }
    printf("largest difference from one device: DataParallel %.2g, DDP %.2g\n", dp_diff, ddp_diff);
    printf("replicas bit-identical: %s\n", identical ? "yes" : "NO");
    if (!identical || !(dp_diff <= 1e-4) || !(ddp_diff <= 1e-4)) { fprintf(stderr, "FAILED\n"); return 1; }
    printf("DataParallel and DDP both equal one device within 1e-4\n");

    free(a);
    for (r = 0; r < n; ++r) {
        mgpu_tensor_destroy(xs[r]);
        mgpu_tensor_destroy(ys[r]);
        mgpu_tensor_destroy(loss[r]);
        mgpu_tensor_destroy(dout[r]);
    }
    mgpu_tensor_destroy(gathered);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(ddp_opt);
    mgpu_model_destroy(ddp);
    mgpu_optimizer_destroy(dp_opt);
    mgpu_model_destroy(dp);
    mgpu_optimizer_destroy(ref_opt);
    mgpu_model_destroy(ref);
    mgpu_device_set_destroy(one);
    mgpu_device_set_destroy(set);
    return 0;
}
