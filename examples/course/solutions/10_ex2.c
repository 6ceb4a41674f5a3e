/* 10_ex2.c - lesson 10, exercise 2: why BatchNorm and data parallelism disagree, and how
   SyncBatchNorm makes them agree again.

   In training, BatchNorm normalises each feature with the mean and variance of ITS batch. One
   device sees the whole batch; a replica sees only its rows. Here a batch of 8 rows of 4 features
   (the activations before a BatchNorm) is split over 2 replicas whose rows differ, as the
   sequences of two replicas do: each replica's statistics are not the batch's, so the replicas
   normalise differently from one device (and train another model).
   SyncBatchNorm's fix, by hand with mgpu's ops: each replica sums its rows and their squares
   (mgpu_sum, mgpu_mul), one all-reduce adds those sums across the replicas (mgpu_allreduce_sum),
   and every replica divides by the batch's count: the whole batch's mean and variance, on every
   replica. (PyTorch's SyncBatchNorm gathers each replica's mean, 1/std and count instead and
   combines them; the same statistics.)
   Then mgpu's own, the model desc's sync_batch_norm: a BatchNorm2d(4) on the rows as [8, 4, 1, 1]
   images, one batch on the two replicas (mgpu_model_accumulate: no optimizer step, so no copy of
   replica 0's buffers to the other), each replica's running statistics read back: moved 0.1 of
   the way from (0, 1) towards the whole batch's mean and unbiased variance, on both.

   Run:  build/course/10_ex2 cpu:2                                            */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-expect: the replicas' own statistics differ from the batch's: yes
// course-expect: synchronised statistics = one device's on every replica: yes
// course-expect: sync_batch_norm: both replicas' running statistics from the whole batch: yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <math.h>

#define ROWS 8
#define C 4
#define R 2   /* replicas */

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_allreduce* ar;
    float x[ROWS * C];
    double mean[C], var[C];   /* one device: the whole batch, in double */
    mgpu_tensor *xs[R], *sq[R], *sum[R], *sumsq[R];
    float s[C], q[C];
    int i, c, r, local_differs = 0, synced_equal = 1;
    NEED(set);
    if (mgpu_device_set_count(set) != R) { fprintf(stderr, "want %d devices, e.g. cpu:2\n", R); return 1; }
    for (i = 0; i < ROWS; ++i)   /* rows 4-7 sit higher than rows 0-3: other sequences, other activations */
        for (c = 0; c < C; ++c) x[i * C + c] = (float)((i * 7 + c * 3) % 5) * 0.5f + (i >= ROWS / 2 ? 2.0f : 0.0f) + (float)c;
    for (c = 0; c < C; ++c) {
        mean[c] = var[c] = 0.0;
        for (i = 0; i < ROWS; ++i) mean[c] += x[i * C + c] / (double)ROWS;
        for (i = 0; i < ROWS; ++i) var[c] += (x[i * C + c] - mean[c]) * (x[i * C + c] - mean[c]) / (double)ROWS;
    }
    printf("one device, the whole batch:   mean");
    for (c = 0; c < C; ++c) printf(" %6.3f", mean[c]);
    printf("   var");
    for (c = 0; c < C; ++c) printf(" %6.3f", var[c]);
    printf("\n");
    NEED(ar = mgpu_allreduce_create(set, MGPU_ALLREDUCE_AUTO));
    for (r = 0; r < R; ++r) {   /* replica r's rows on its device; its sums of them */
        mgpu_device* dev = mgpu_device_set_get(set, r);
        NEED(xs[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(ROWS / R, C)));
        NEED(sq[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(ROWS / R, C)));
        NEED(sum[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(C)));
        NEED(sumsq[r] = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(C)));
        CHECK(mgpu_tensor_upload(xs[r], x + r * (ROWS / R) * C, sizeof(float) * (ROWS / R) * C));
        CHECK(mgpu_sum(sum[r], xs[r], 0));           /* down each column: per feature */
        CHECK(mgpu_mul(sq[r], xs[r], xs[r]));
        CHECK(mgpu_sum(sumsq[r], sq[r], 0));
        CHECK(mgpu_tensor_download(sum[r], s, sizeof s));
        CHECK(mgpu_tensor_download(sumsq[r], q, sizeof q));
        printf("replica %d, its %d rows alone:   mean", r, ROWS / R);
        for (c = 0; c < C; ++c) printf(" %6.3f", s[c] / (ROWS / R));
        printf("   var");
        for (c = 0; c < C; ++c) {
            const double m = s[c] / (ROWS / R), v = q[c] / (ROWS / R) - m * m;
            printf(" %6.3f", v);
            local_differs |= fabs(m - mean[c]) > 1e-3 || fabs(v - var[c]) > 1e-3;
        }
        printf("\n");
    }
    printf("the replicas' own statistics differ from the batch's: %s\n", local_differs ? "yes" : "no");
    /* SyncBatchNorm: one sum across the replicas, then divide by the whole batch's count */
    CHECK(mgpu_allreduce_sum(ar, sum, R));
    CHECK(mgpu_allreduce_sum(ar, sumsq, R));
    for (r = 0; r < R; ++r) {
        CHECK(mgpu_tensor_download(sum[r], s, sizeof s));
        CHECK(mgpu_tensor_download(sumsq[r], q, sizeof q));
        printf("replica %d, synchronised:       mean", r);
        for (c = 0; c < C; ++c) printf(" %6.3f", s[c] / ROWS);
        printf("   var");
        for (c = 0; c < C; ++c) {
            const double m = s[c] / ROWS, v = q[c] / ROWS - m * m;
            printf(" %6.3f", v);
            synced_equal &= fabs(m - mean[c]) < 1e-5 && fabs(v - var[c]) < 1e-4;
        }
        printf("\n");
    }
    printf("synchronised statistics = one device's on every replica: %s\n", synced_equal ? "yes" : "NO");
    for (r = 0; r < R; ++r) {
        mgpu_tensor_destroy(xs[r]); mgpu_tensor_destroy(sq[r]); mgpu_tensor_destroy(sum[r]); mgpu_tensor_destroy(sumsq[r]);
    }
    mgpu_allreduce_destroy(ar);

    /* mgpu's own SyncBatchNorm: the same rows through a BatchNorm2d(4) of a model on the two replicas */
    {
        mgpu_layer* layers[1] = { mgpu_layer_batch_norm2d(C) };
        mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(C, 1, 1), .layers = layers, .layer_count = 1,
                                                              .devices = set, .loss = MGPU_LOSS_MSE, .sync_batch_norm = 1 });
        mgpu_tensor *images = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(ROWS, C, 1, 1)),
                    *target = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(ROWS, C, 1, 1));
        float run_mean[C], run_var[C];
        int moved = 1;
        NEED(m && images && target);
        CHECK(mgpu_tensor_upload(images, x, sizeof x));
        CHECK(mgpu_tensor_zero(target));
        CHECK(mgpu_model_accumulate(m, images, target, 0, NULL));
        for (r = 0; r < R; ++r) {
            CHECK(mgpu_tensor_download(mgpu_model_buffer(m, r, "0.running_mean"), run_mean, sizeof run_mean));
            CHECK(mgpu_tensor_download(mgpu_model_buffer(m, r, "0.running_var"), run_var, sizeof run_var));
            printf("replica %d, sync_batch_norm:    running_mean", r);
            for (c = 0; c < C; ++c) printf(" %6.3f", run_mean[c]);
            printf("   running_var");
            for (c = 0; c < C; ++c) printf(" %6.3f", run_var[c]);
            printf("\n");
            for (c = 0; c < C; ++c)   /* 0.9 x (0, 1) + 0.1 x (the batch's mean, its variance x 8 / 7) */
                moved &= fabs(run_mean[c] - 0.1 * mean[c]) < 1e-5 && fabs(run_var[c] - (0.9 + 0.1 * var[c] * ROWS / (ROWS - 1))) < 1e-5;
        }
        printf("sync_batch_norm: both replicas' running statistics from the whole batch: %s\n", moved ? "yes" : "NO");
        synced_equal &= moved;
        mgpu_tensor_destroy(images);
        mgpu_tensor_destroy(target);
        mgpu_model_destroy(m);
    }
    mgpu_device_set_destroy(set);
    return local_differs && synced_equal ? 0 : 1;
}
