/* 07_ex1.c - lesson 07, exercise 1: more micro-batches, a smaller bubble, the same training.

   A pipeline of S = 4 stages trains with M = 1, 2, 4, 8, 16 micro-batches; each must end with
   the parameters of one device, bit for bit (the library adds the micro-batches' gradients in
   the order of the whole batch). The bubble (S-1)/(M+S-1) falls as M grows; the program finds
   the smallest M whose bubble is at most 10%.
     ./07_ex1 cpu:4 cpu */
// course-run: cpu:4 cpu
// course-expect: every M trains exactly like one device
// course-expect: S = 4, M = 16: bubble 15.8%, parameters = one device's
// course-expect: smallest M with a bubble of at most 10%: 27
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define IN 16
#define BATCH 64
#define STEPS 5

static mgpu_model* make_model(mgpu_device_set* set, int stages, int micro_batches) {
    mgpu_layer* layers[5] = { mgpu_layer_linear(IN, 32), mgpu_layer_relu(), mgpu_layer_linear(32, 32), mgpu_layer_relu(),
                              mgpu_layer_linear(32, 4) };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(IN), .layers = layers, .layer_count = 5, .devices = set,
                                                  .stages = stages, .micro_batches = micro_batches, .seed = 3 });
}

/* Train a model STEPS steps on fixed toy batches; its first weight matrix, downloaded, in w. */
static int train(mgpu_model* m, float* w) {
    mgpu_optimizer* opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .lr = 0.1f });
    mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, IN));
    mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH));
    int step, i, ok = opt && x && y;
    for (step = 0; ok && step < STEPS; ++step) {
        float* px = (float*)mgpu_tensor_data(x);
        int32_t* py = (int32_t*)mgpu_tensor_data(y);
        for (i = 0; i < BATCH * IN; ++i) px[i] = (float)((i * 7 + step * 13) % 17) / 8.0f - 1.0f;
        for (i = 0; i < BATCH; ++i) py[i] = (i + step) % 4;
        ok = mgpu_model_train_step(m, opt, x, y, NULL) == MGPU_OK;
    }
    ok = ok && mgpu_tensor_download(mgpu_model_param(m, 0, "0.weight"), w, 32 * IN * sizeof(float)) == MGPU_OK;
    if (!ok) fprintf(stderr, "%s\n", mgpu_last_error());
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    return ok;
}

int main(int argc, char** argv) {
    mgpu_device_set* stages = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:4");
    mgpu_device_set* one = mgpu_device_set_create(argc > 2 ? argv[2] : "cpu");
    static float ref[32 * IN], got[32 * IN];
    const int Ms[5] = { 1, 2, 4, 8, 16 };
    int S, i, M, same = 1;
    mgpu_model* m;
    if (!stages || !one) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    S = mgpu_device_set_count(stages);
    m = make_model(one, 1, 1);   /* the same seed: the same initial parameters in every model */
    if (!m || !train(m, ref)) return 1;
    mgpu_model_destroy(m);
    for (i = 0; i < 5; ++i) {
        m = make_model(stages, S, Ms[i]);
        if (!m || !train(m, got)) return 1;
        mgpu_model_destroy(m);
        printf("S = %d, M = %2d: bubble %4.1f%%, parameters %s one device's\n", S, Ms[i], 100.0 * (S - 1) / (Ms[i] + S - 1),
               memcmp(got, ref, sizeof ref) == 0 ? "=" : "DIFFER from");
        same &= memcmp(got, ref, sizeof ref) == 0;
    }
    if (same) printf("every M trains exactly like one device\n");
    /* (S-1)/(M+S-1) <= 0.1  <=>  M >= 9 (S-1); counted, not solved */
    for (M = 1; 10 * (S - 1) > M + S - 1; ++M) {}
    printf("smallest M with a bubble of at most 10%%: %d\n", M);
    mgpu_device_set_destroy(stages);
    mgpu_device_set_destroy(one);
    return same ? 0 : 1;
}
