/* 07_ex2.c - lesson 07, exercise 2: what each schedule keeps in memory.

   After a step, a pipeline stage still holds the activations of the micro-batches it ran
   forward (they wait for their backward; the buffers stay for the next step). GPipe runs every
   forward before any backward: stage 0 holds all M micro-batches, the whole batch of B rows,
   whatever M is. 1F1B starts backward after S forwards: stage 0 holds S micro-batches of B/M
   rows, S/M of the batch. The program measures stage 0's bytes for M = 4, 8, 16 (batch 256,
   S = 4) and checks both predictions: GPipe's bytes do not shrink with M, 1F1B's halve when M
   doubles (beyond M = S).
     ./07_ex2 cpu:4 */
// course-run: cpu:4
// course-expect: GPipe keeps the whole batch, 1F1B S/M of it
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define BATCH 256

/* Bytes that stage 0's device holds after one step, beyond what it held before. */
static long long kept(mgpu_device_set* set, int M, mgpu_pipeline_schedule schedule) {
    mgpu_layer* all[7] = { mgpu_layer_linear(128, 512), mgpu_layer_relu(), mgpu_layer_linear(512, 512), mgpu_layer_relu(),
                           mgpu_layer_linear(512, 512), mgpu_layer_relu(), mgpu_layer_linear(512, 10) };
    const int S = mgpu_device_set_count(set);
    mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(128), .layers = all, .layer_count = 7, .devices = set,
                                                           .stages = S, .micro_batches = M, .schedule = schedule });
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, NULL) : NULL;
    mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, 128));
    mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH));
    mgpu_memory_stats before, after;
    memset(&before, 0, sizeof before);
    memset(&after, 0, sizeof after);
    long long bytes = -1;
    if (opt && x && y) {
        memset(mgpu_tensor_data(x), 0, BATCH * 128 * sizeof(float));
        memset(mgpu_tensor_data(y), 0, BATCH * sizeof(int32_t));
        mgpu_memory_get_stats(mgpu_model_stage_device(m, 0, 0), &before);
        if (mgpu_model_train_step(m, opt, x, y, NULL) == MGPU_OK) {
            mgpu_memory_get_stats(mgpu_model_stage_device(m, 0, 0), &after);
            bytes = (long long)after.bytes_in_use - (long long)before.bytes_in_use;
        }
    }
    if (bytes < 0) fprintf(stderr, "%s\n", mgpu_last_error());
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    return bytes;
}

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:4");
    long long g[3], f[3];
    const int Ms[3] = { 4, 8, 16 };
    int i, ok = 1;
    if (!set) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    for (i = 0; i < 3; ++i) {
        g[i] = kept(set, Ms[i], MGPU_PIPELINE_GPIPE);
        f[i] = kept(set, Ms[i], MGPU_PIPELINE_1F1B);
        if (g[i] < 0 || f[i] < 0) return 1;
        printf("M = %2d: stage 0 keeps %7lld bytes with GPipe, %7lld with 1F1B\n", Ms[i], g[i], f[i]);
    }
    for (i = 1; i < 3; ++i) {
        ok &= g[i] >= g[i - 1];                                      /* the whole batch, every M */
        ok &= f[i] * 10 >= f[i - 1] * 4 && f[i] * 10 <= f[i - 1] * 6;   /* about half: within 40% .. 60% */
    }
    printf(ok ? "GPipe keeps the whole batch, 1F1B S/M of it\n" : "the bytes do NOT follow the predictions\n");
    mgpu_device_set_destroy(set);
    return ok ? 0 : 1;
}
