/* 08_allreduce.c - lesson 08: all-reduce, by hand and by the library.

     ./08_allreduce cpu:4                                     4 CPU replicas
     make emu-program SRC=examples/course/08_allreduce.c
     MGPU_EMU_DEVICES=4 build/emu/08_allreduce cuda:0,1,2,3   4 emulated GPUs (NCCL emulated too)

   Part 1, plain C: the ring all-reduce (reduce-scatter, then all-gather) over R arrays, checked
   against the plain sum, counting what each rank sends.
   Part 2, the library: mgpu_allreduce_sum with every backend the devices have (CPU: host; GPUs:
   NCCL, P2P, host), for several sizes; every replica's result must equal the plain-C sum. The
   values are small whole numbers, so every order of summation gives the same bits and the check
   is exact for every backend. On CPU devices it prints times, algbw and busbw (nccl-tests'
   definitions); on emulated GPUs times mean nothing and are not printed.
   Part 3, a data-parallel step: its gradients are all-reduced in buckets; the trace shows them. */
// course-run: cpu:4
// course-run-emu 4: cuda:0,1,2,3
// course-expect: part 1: the ring gives every rank the sum
// course-expect: part 2: every sum equals the plain-C reference
// course-expect: part 3: the replicas hold the same parameters
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_R 8

/* ---- Part 1: the ring, in plain C ---- */
/* R ranks, each with n floats. The buffer is cut into R chunks. Reduce-scatter: at step s, rank r
   sends chunk (r - s) to rank r + 1, which adds it to its own; after R - 1 steps rank r holds the
   whole sum of chunk (r + 1). All-gather: at step s, rank r sends chunk (r + 1 - s) to r + 1,
   which keeps it. Returns the floats that rank 0 sent. (Real rings send at the same time on
   every link; here the ranks take turns, reading what was there before the step.) */
static long ring_allreduce(float** buf, int R, int n, float* scratch) {
    const int chunk = (n + R - 1) / R;
    long sent0 = 0;
    int phase, s, r, i;
    for (phase = 0; phase < 2; ++phase)
        for (s = 0; s < R - 1; ++s) {
            /* what every rank sends this step, copied first: all ranks send at once */
            for (r = 0; r < R; ++r) {
                const int k = phase == 0 ? ((r - s) % R + R) % R : ((r + 1 - s) % R + R) % R;
                for (i = k * chunk; i < (k + 1) * chunk && i < n; ++i) scratch[r * n + i] = buf[r][i];
            }
            for (r = 0; r < R; ++r) {
                const int k = phase == 0 ? ((r - s) % R + R) % R : ((r + 1 - s) % R + R) % R, to = (r + 1) % R;
                for (i = k * chunk; i < (k + 1) * chunk && i < n; ++i) {
                    if (phase == 0) buf[to][i] += scratch[r * n + i];   /* reduce-scatter: add */
                    else buf[to][i] = scratch[r * n + i];               /* all-gather: keep */
                    if (r == 0) sent0++;
                }
            }
        }
    return sent0;
}

/* rank r's value at i: small whole numbers, so any order of adding them is exact */
static float value(int r, int64_t i) { return (float)((r + 1) * (int)(i % 97) - 40); }

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:4");
    int R, on_gpu, failed = 0, r;
    if (!set) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    R = mgpu_device_set_count(set);
    on_gpu = mgpu_device_kind_of(mgpu_device_set_get(set, 0)) == MGPU_DEVICE_CUDA;
    if (R < 2 || R > MAX_R) { fprintf(stderr, "want 2 to %d devices, e.g. cpu:4\n", MAX_R); return 1; }

    {   /* Part 1 */
        const int n = 840;   /* divisible by 2 .. 8: chunks of one size */
        float* bufs[MAX_R];
        float* scratch = (float*)malloc(sizeof(float) * (size_t)n * R);
        long sent;
        int i, ok = scratch != NULL;
        for (r = 0; r < R; ++r) {
            bufs[r] = (float*)malloc(sizeof(float) * n);
            ok &= bufs[r] != NULL;
            for (i = 0; ok && i < n; ++i) bufs[r][i] = value(r, i);
        }
        if (!ok) { fprintf(stderr, "out of memory\n"); return 1; }
        sent = ring_allreduce(bufs, R, n, scratch);
        for (r = 0; r < R; ++r)
            for (i = 0; i < n; ++i) {
                float want = 0.0f;
                int q;
                for (q = 0; q < R; ++q) want += value(q, i);
                ok &= bufs[r][i] == want;
            }
        printf("part 1: ring over %d ranks of %d floats: rank 0 sent %ld floats = 2(R-1)/R x n = %.0f\n", R, n, sent,
               2.0 * (R - 1) / R * n);
        if (ok && sent == 2L * (R - 1) * n / R) printf("part 1: the ring gives every rank the sum\n");
        else { printf("part 1: the ring's result is WRONG\n"); failed = 1; }
        for (r = 0; r < R; ++r) free(bufs[r]);
        free(scratch);
    }

    {   /* Part 2 */
        const mgpu_allreduce_kind cpu_kinds[1] = { MGPU_ALLREDUCE_HOST };
        const mgpu_allreduce_kind gpu_kinds[3] = { MGPU_ALLREDUCE_NCCL, MGPU_ALLREDUCE_P2P, MGPU_ALLREDUCE_HOST };
        const size_t cpu_sizes[4] = { 4 << 10, 256 << 10, 4 << 20, 32 << 20 }, gpu_sizes[2] = { 4 << 10, 1 << 20 };
        const mgpu_allreduce_kind* kinds = on_gpu ? gpu_kinds : cpu_kinds;
        const size_t* sizes = on_gpu ? gpu_sizes : cpu_sizes;
        const int nk = on_gpu ? 3 : 1, ns = on_gpu ? 2 : 4;
        int k, s;
        printf("part 2: %d replicas on %s\n", R, mgpu_device_set_spec(set));
        if (!on_gpu) printf("%10s  %-8s %-8s %10s %12s %12s\n", "bytes", "backend", "algo", "time us", "algbw GB/s", "busbw GB/s");
        for (k = 0; k < nk; ++k) {
            mgpu_allreduce* ar = mgpu_allreduce_create(set, kinds[k]);
            if (!ar) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
            for (s = 0; s < ns; ++s) {
                const int64_t n = (int64_t)(sizes[s] / sizeof(float));
                mgpu_tensor* t[MAX_R];
                float* host = (float*)malloc(sizes[s]);
                float* want = (float*)malloc(sizes[s]);
                int64_t i;
                int ok = host && want, reps = 0;
                double t0, sec;
                for (r = 0; r < R; ++r) {
                    t[r] = mgpu_tensor_create(mgpu_device_set_get(set, r), MGPU_F32, mgpu_shape1(n));
                    ok &= t[r] != NULL;
                }
                if (!ok) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
                for (i = 0; i < n; ++i) {   /* the plain-C reference */
                    want[i] = 0.0f;
                    for (r = 0; r < R; ++r) want[i] += value(r, i);
                }
                for (r = 0; r < R; ++r) {
                    for (i = 0; i < n; ++i) host[i] = value(r, i);
                    ok &= mgpu_tensor_upload(t[r], host, sizes[s]) == MGPU_OK;
                }
                ok &= mgpu_allreduce_sum(ar, t, R) == MGPU_OK;
                for (r = 0; ok && r < R; ++r) {   /* every replica holds the sum */
                    ok &= mgpu_tensor_download(t[r], host, sizes[s]) == MGPU_OK;
                    ok &= memcmp(host, want, sizes[s]) == 0;
                }
                if (!ok) {
                    printf("part 2: %s, %zu bytes: a replica's sum is WRONG%s%s\n", mgpu_allreduce_name(mgpu_allreduce_backend(ar)),
                           sizes[s], *mgpu_last_error() ? ": " : "", mgpu_last_error());
                    failed = 1;
                } else if (on_gpu) {
                    printf("part 2: %-5s %-8s %8zu bytes: every replica = the reference (emulated GPUs: no times)\n",
                           mgpu_allreduce_name(mgpu_allreduce_backend(ar)), mgpu_allreduce_algorithm(ar, sizes[s]), sizes[s]);
                } else {
                    /* timed: as many sums as fit in about 50 ms (the values grow, whole numbers still) */
                    t0 = mgpu_seconds();
                    do {
                        ok &= mgpu_allreduce_sum(ar, t, R) == MGPU_OK;
                        reps++;
                    } while (ok && reps < 8 && mgpu_seconds() - t0 < 0.05);
                    for (r = 0; r < R; ++r) mgpu_device_synchronize(mgpu_device_set_get(set, r));
                    sec = (mgpu_seconds() - t0) / reps;
                    /* nccl-tests: algbw = bytes / time; busbw = algbw x 2(R-1)/R, what each link carries in a ring */
                    printf("%10zu  %-8s %-8s %10.1f %12.2f %12.2f\n", sizes[s], mgpu_allreduce_name(mgpu_allreduce_backend(ar)),
                           mgpu_allreduce_algorithm(ar, sizes[s]), sec * 1e6, (double)sizes[s] / sec / 1e9,
                           (double)sizes[s] / sec / 1e9 * 2.0 * (R - 1) / R);
                }
                for (r = 0; r < R; ++r) mgpu_tensor_destroy(t[r]);
                free(host);
                free(want);
            }
            mgpu_allreduce_destroy(ar);
        }
        if (!failed) printf("part 2: every sum equals the plain-C reference\n");
    }

    {   /* Part 3: a data-parallel step, its gradients all-reduced in buckets of 16 KiB */
        mgpu_layer* layers[5] = { mgpu_layer_linear(64, 64), mgpu_layer_relu(), mgpu_layer_linear(64, 64), mgpu_layer_relu(),
                                  mgpu_layer_linear(64, 4) };
        mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(64), .layers = layers, .layer_count = 5,
                                                               .devices = set, .bucket_bytes = 16 << 10 });
        mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, NULL) : NULL;
        mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(8 * R, 64));
        mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(8 * R));
        const char* path = "08_allreduce_trace.json";
        char line[256];
        int buckets = 0, whole = 0, i;
        FILE* f;
        if (!opt || !x || !y) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        for (i = 0; i < 8 * R * 64; ++i) ((float*)mgpu_tensor_data(x))[i] = value(i % 5, i) / 64.0f;
        for (i = 0; i < 8 * R; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = i % 4;
        if (mgpu_model_train_step(m, opt, x, y, NULL) != MGPU_OK ||   /* the first step makes the buffers */
            mgpu_model_trace_start(m) != MGPU_OK || mgpu_model_train_step(m, opt, x, y, NULL) != MGPU_OK ||
            mgpu_model_trace_stop(m, path) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f)) {
            buckets += strstr(line, "\"all-reduce bucket") != NULL;
            whole += strstr(line, "\"all-reduce stage") != NULL;
        }
        if (f) fclose(f);
        remove(path);
        printf("part 3: %lld parameters (%lld bytes of gradients) in %d bucket%s of at most 16 KiB; backend %s\n",
               (long long)mgpu_model_param_count(m), (long long)mgpu_model_param_count(m) * 4, mgpu_model_bucket_count(m),
               mgpu_model_bucket_count(m) == 1 ? "" : "s", mgpu_allreduce_name(mgpu_model_allreduce_backend(m)));
        if (buckets)   /* GPUs: each bucket summed on the communication streams as soon as backward made it */
            printf("part 3: the traced step: %d bucket all-reduces, %d per replica, each started while backward went on\n", buckets, buckets / R);
        else           /* CPU replicas: one sum of the whole gradient buffer after backward */
            printf("part 3: the traced step: %d all-reduces, one per replica, after backward\n", whole);
        if (mgpu_model_verify_replicas(m) == MGPU_OK && (buckets == R * mgpu_model_bucket_count(m) || whole == R))
            printf("part 3: the replicas hold the same parameters\n");
        else { printf("part 3: %s\n", mgpu_last_error()); failed = 1; }
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
    }
    mgpu_device_set_destroy(set);
    return failed;
}
