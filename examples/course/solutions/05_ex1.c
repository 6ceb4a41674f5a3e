/* 05_ex1.c - lesson 05, exercise 1: a batch that does not split evenly.

   25 rows on 3 replicas: who gets what? mgpu gives each replica B/N rows and the first B%N one
   more (9, 8, 8), and scales every replica's loss gradient by 1/B of the WHOLE batch, so the
   uneven shares still add up to the one-device gradient. The counters show each replica's rows;
   the program checks them, and checks the result against one device.

   Run:  build/course/05_ex1 cpu:3                                            */
// course-run: cpu:3
// course-run: cpu:4
// course-expect: rows add up to the batch: yes
// course-expect: equal to one device within 1e-4: yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <math.h>

#define BATCH 25
#define FEATURES 8
#define CLASSES 3
#define STEPS 10

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

static mgpu_model* make_model(mgpu_device_set* set) {
    mgpu_layer* layers[3] = { mgpu_layer_linear(FEATURES, 16), mgpu_layer_relu(), mgpu_layer_linear(16, CLASSES) };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                  .devices = set, .seed = 3 });
}

int main(int argc, char** argv) {
    mgpu_device_set *set, *one;
    mgpu_model *m, *ref;
    mgpu_optimizer *opt, *ref_opt;
    mgpu_tensor *x, *y;
    float p[1024], q[1024];
    uint64_t rows = 0;
    double diff = 0.0;
    int n, r, step, i, ok = 1;
    NEED(set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:3"));
    NEED(one = mgpu_device_set_create("cpu"));
    n = mgpu_device_set_count(set);
    NEED(m = make_model(set));
    NEED(ref = make_model(one));
    NEED(opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .lr = 0.1f }));
    NEED(ref_opt = mgpu_optimizer_create(ref, &(mgpu_optimizer_desc){ .lr = 0.1f }));
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH)));
    for (r = 0; r < n; ++r) mgpu_device_reset_counters(mgpu_device_set_get(set, r));
    for (step = 0; step < STEPS; ++step) {
        CHECK(mgpu_rand_normal(x, 1, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f));
        for (i = 0; i < BATCH; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (i * 7 + step) % CLASSES;
        CHECK(mgpu_model_train_step(m, opt, x, y, NULL));
    }
    for (r = 0; r < n; ++r) {   /* each replica's share, B/N or B/N + 1 rows a step */
        mgpu_device_counters k;
        const uint64_t want = (uint64_t)(BATCH / n + (r < BATCH % n)) * STEPS;
        CHECK(mgpu_device_get_counters(mgpu_model_device(m, r), &k));
        printf("replica %d on %-6s %3llu rows in %d steps (%llu a step)\n", r, mgpu_device_label(mgpu_model_device(m, r)),
               (unsigned long long)k.rows_backward, STEPS, (unsigned long long)k.rows_backward / STEPS);
        if (k.rows_backward != want) ok = 0;
        rows += k.rows_backward;
    }
    printf("rows add up to the batch: %s (%llu = %d x %d)\n", ok && rows == (uint64_t)BATCH * STEPS ? "yes" : "NO",
           (unsigned long long)rows, STEPS, BATCH);
    /* the reference only now: "cpu" is the library's CPU device, the same device as replica 0 of
       cpu:3, and counters count everything a device does, whichever model asked */
    for (step = 0; step < STEPS; ++step) {
        CHECK(mgpu_rand_normal(x, 1, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f));
        for (i = 0; i < BATCH; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (i * 7 + step) % CLASSES;
        CHECK(mgpu_model_train_step(ref, ref_opt, x, y, NULL));
    }
    CHECK(mgpu_tensor_download(mgpu_model_params(m, 0), p, mgpu_tensor_bytes(mgpu_model_params(m, 0))));
    CHECK(mgpu_tensor_download(mgpu_model_params(ref, 0), q, mgpu_tensor_bytes(mgpu_model_params(ref, 0))));
    for (i = 0; i < (int)mgpu_tensor_numel(mgpu_model_params(m, 0)); ++i) diff = fmax(diff, fabs((double)p[i] - (double)q[i]));
    printf("equal to one device within 1e-4: %s (largest difference %.2g)\n", diff <= 1e-4 ? "yes" : "NO", diff);
    if (!ok || rows != (uint64_t)BATCH * STEPS || !(diff <= 1e-4)) return 1;
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(ref_opt);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(ref);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(one);
    mgpu_device_set_destroy(set);
    return 0;
}
