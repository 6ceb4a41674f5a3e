/* 06_processes.c - data parallelism with one process per device, as DDP runs (lesson 06).

   Built with mpicc and -DMGPU_MPI, started by mpirun: every process (a "rank") runs this same
   program. Each one
     1. joins the job (mgpu_dist_init: PyTorch's init_process_group) and learns its rank and the
        world size;
     2. makes the model with .distributed = 1 (PyTorch's DistributedDataParallel(model)): rank 0's
        first weights are sent to every rank;
     3. each step, builds the same global batch (same seed everywhere) and trains on ITS rows of
        it (DistributedSampler's job); the step sums the gradients of every replica of every rank.
   Then it checks: every replica of every rank holds the same bits (mgpu_model_verify_replicas),
   and rank 0 trains the same model in ONE process on cpu:N (N = all the replicas of the job):
   the same bits again, since the job sums in the replicas' order, as one process does.

   Run:  mpicc -std=c99 -O2 -DMGPU_MPI -I. examples/course/06_processes.c -o build/course/06_mpi -lm -lpthread
         mpirun -np 2 build/course/06_mpi cpu        (2 processes, one CPU replica each)
         mpirun -np 2 build/course/06_mpi cpu:2      (2 processes, 2 CPU replicas each)
         build/course/06_processes cpu               (built without MPI: one process, rank 0 of 1) */
// course-run: cpu
// course-run: cpu:2
// course-mpirun 2: cpu
// course-mpirun 2: cpu:2
// course-mpirun 3: cpu
// course-expect: every replica of every rank: the same bits
// course-expect: the same bits as one process on cpu:
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define BATCH 48
#define FEATURES 16
#define HIDDEN 32
#define CLASSES 4
#define STEPS 20

/* A failure on this rank ends the whole job (the others would wait for it forever). */
#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "rank %d, line %d: %s\n", mgpu_dist_rank(), __LINE__, mgpu_last_error()); mgpu_dist_abort(1); } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "rank %d, line %d: %s\n", mgpu_dist_rank(), __LINE__, mgpu_last_error()); mgpu_dist_abort(1); } } while (0)

/* lesson 05's toy data: step s gets the same batch on every rank */
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

static mgpu_model* make_model(mgpu_device_set* set, int distributed) {
    mgpu_layer* layers[3];
    layers[0] = mgpu_layer_linear(FEATURES, HIDDEN);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(HIDDEN, CLASSES);
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                  .devices = set, .seed = 5, .distributed = distributed });
}
static mgpu_optimizer* make_sgd(mgpu_model* m) {
    return mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f, .momentum = 0.9f });
}

/* Where replica j's rows start in a batch of B split over T replicas: B/T each, the first B%T
   one more (how mgpu splits a batch). */
static int64_t first_row(int64_t B, int T, int j) { return (int64_t)j * (B / T) + (j < B % T ? j : B % T); }

int main(int argc, char** argv) {
    mgpu_device_set* set;
    mgpu_model* model;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y, *xs, *ys;
    mgpu_device_counters k;
    int rank, size, replicas, total, first, step, r;
    int64_t from, rows;
    uint64_t my_rows = 0, my_bytes = 0;
    float loss = 0.0f;

    /* 1. join the job: rank and world size (1 process, rank 0, without MPI) */
    CHECK(mgpu_dist_init(&argc, &argv));
    rank = mgpu_dist_rank();
    size = mgpu_dist_size();
    NEED(set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu"));   /* this rank's devices */

    /* 2. the model, one job over every rank's replicas */
    NEED(model = make_model(set, 1));
    NEED(opt = make_sgd(model));
    replicas = mgpu_model_replica_count(model);          /* this rank's */
    total = mgpu_model_total_replica_count(model);       /* the whole job's */
    first = mgpu_model_first_replica(model);             /* this rank's first, among them */
    if (rank == 0)
        printf("%d process%s x %s: %d replicas in all, all-reduce %s\n", size, size == 1 ? "" : "es",
               mgpu_device_set_spec(set), total, mgpu_allreduce_name(mgpu_model_allreduce_backend(model)));

    /* 3. this rank's rows of every batch: its replicas' shares, one after another */
    from = first_row(BATCH, total, first);
    rows = first_row(BATCH, total, first + replicas) - from;
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH)));
    for (r = 0; r < replicas; ++r) mgpu_device_reset_counters(mgpu_model_device(model, r));
    for (step = 0; step < STEPS; ++step) {
        make_batch(x, y, step);
        NEED(xs = mgpu_tensor_view_rows(x, from, rows));
        NEED(ys = mgpu_tensor_view_rows(y, from, rows));
        CHECK(mgpu_model_train_step(model, opt, xs, ys, &loss));   /* the loss: of the whole global batch */
        mgpu_tensor_destroy(xs);
        mgpu_tensor_destroy(ys);
    }
    for (r = 0; r < replicas; ++r) {
        CHECK(mgpu_device_get_counters(mgpu_model_device(model, r), &k));
        my_rows += k.rows_backward;
        my_bytes += k.bytes_allreduced;
    }
    printf("rank %d of %d: rows %lld to %lld of each batch; %llu rows and %llu bytes all-reduced in %d steps\n", rank, size,
           (long long)from, (long long)(from + rows - 1), (unsigned long long)my_rows, (unsigned long long)my_bytes, STEPS);
    if (my_rows != (uint64_t)(rows * STEPS)) { fprintf(stderr, "rank %d: the counters say %llu rows\n", rank, (unsigned long long)my_rows); mgpu_dist_abort(1); }

    /* every replica of every rank: the same bits (a collective call: every rank makes it) */
    CHECK(mgpu_model_verify_replicas(model));
    if (rank == 0) printf("loss %.4f after %d steps; every replica of every rank: the same bits\n", (double)loss, STEPS);

    /* rank 0 alone: the same training in one process, on cpu:<total> (GPUs: cuda:0,1,...) */
    if (rank == 0) {
        const int gpus = mgpu_device_kind_of(mgpu_model_device(model, 0)) == MGPU_DEVICE_CUDA;
        char spec[300];
        double diff = 0.0;
        int64_t i;
        mgpu_device_set* one;
        mgpu_model* ref;
        mgpu_optimizer* ref_opt;
        const mgpu_tensor *a = mgpu_model_params(model, 0), *b;
        float *pa, *pb;
        int same;
        snprintf(spec, sizeof spec, "cpu:%d", total);
        if (gpus && total <= mgpu_cuda_device_count() && total <= 64)   /* a GPU for each replica of the job */
            for (strcpy(spec, "cuda:0"), r = 1; r < total; ++r) snprintf(spec + strlen(spec), 8, ",%d", r);
        NEED(one = mgpu_device_set_create(spec));
        NEED(ref = make_model(one, 0));
        NEED(ref_opt = make_sgd(ref));
        for (step = 0; step < STEPS; ++step) {
            make_batch(x, y, step);
            CHECK(mgpu_model_train_step(ref, ref_opt, x, y, NULL));
        }
        b = mgpu_model_params(ref, 0);
        NEED(pa = (float*)malloc(mgpu_tensor_bytes(a)));
        NEED(pb = (float*)malloc(mgpu_tensor_bytes(b)));
        CHECK(mgpu_tensor_download(a, pa, mgpu_tensor_bytes(a)));
        CHECK(mgpu_tensor_download(b, pb, mgpu_tensor_bytes(b)));
        same = mgpu_tensor_bytes(a) == mgpu_tensor_bytes(b) && memcmp(pa, pb, mgpu_tensor_bytes(a)) == 0;
        for (i = 0; i < mgpu_tensor_numel(a); ++i) diff = fmax(diff, fabs((double)pa[i] - (double)pb[i]));
        /* CPU replicas: the job sums in the replicas' order, as one process: the same bits. GPUs
           summed by NCCL add in NCCL's own order (and other GEMMs than the CPU's): within 1e-4. */
        if ((!gpus && !same) || !(diff <= 1e-4)) {
            fprintf(stderr, "rank 0: the job's parameters differ from one process's on %s by %.3g\n", spec, diff);
            mgpu_dist_abort(1);
        }
        printf("%s as one process on %s (largest difference %.2g)\n", same ? "the same bits" : "not the same bits, but within 1e-4,",
               spec, diff);
        free(pa);
        free(pb);
        mgpu_optimizer_destroy(ref_opt);
        mgpu_model_destroy(ref);
        mgpu_device_set_destroy(one);
    }

    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    mgpu_device_set_destroy(set);
    mgpu_dist_shutdown();
    return 0;
}
