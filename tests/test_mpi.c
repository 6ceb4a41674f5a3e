#include <stdlib.h>
/* The library's allocations through this file's malloc, which notes the largest one made by the
   main thread (what a rank holds for a zero1 checkpoint: zero1_checkpoint) */
static __thread size_t t_largest_alloc;
static void* test_malloc_noting(size_t n) {
    if (n > t_largest_alloc) t_largest_alloc = n;
    return malloc(n);
}
#define MGPU_MALLOC(sz) test_malloc_noting(sz)
#define MGPU_REALLOC(p, sz) realloc(p, sz)
#define MGPU_FREE(p) free(p)
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_mpi.c - a job of several processes (MGPU_MPI), run by tests/mpi.sh under
   mpirun -np 3 (any count from 2 works). Rank 0 holds two CPU replicas, every other rank one, so
   the replicas are spread unevenly; every rank checks, and each prints its own summary.

   1. the job: ranks, local ranks, mgpu_dist_size agree with the environment's count
   2. mgpu_allreduce_create_distributed: sizes 1 to 4099 (fewer elements than ranks too), the sum
      in the job's device order ((d0 + d1) + d2) + ... on every device of every rank, bit for bit
   3. equivalence: a distributed model (MLP with Dropout, SGD with momentum and weight decay, then
      AdamW), each rank given its rows of the global batch (even and uneven), against one process
      with all the replicas (cpu:G): the same parameters bit for bit, the same loss, and
      verify_replicas across ranks; accumulate + apply likewise
   4. failures: one rank's bad input fails every rank with that rank's message and leaves every
      model as it was (and the next step works); a rank with other layers fails every rank's
      mgpu_model_create; a corrupted rank is named by verify_replicas on every rank
   5. checkpoints: rank 0 writes, every rank finds the file when the call returns, a one-process
      model loads it with the same bits; a save that fails on rank 0 fails every rank; with zero1
      the other ranks hold only their own ranges of the states while saving
   6. loaders with shard_for: each rank's rows are its replicas' rows of the global batch, and
      the ranks together see every row once; the same for windows of tokens, with and without wrap
   7. a GPT (Dropout, the head tied to the embedding), each rank's rows from a token loader with
      shard_for: one replica on every rank against one process with them all (cpu:G), SGD and
      AdamW, then with MGPU_IGNORE_INDEX labels spread unevenly across the ranks (a step where the
      second half of the batch has none, one where the job has none), also with rank 0 holding
      two replicas and with accumulate + apply: the parameters bit for bit after every step, the
      job's loss and each replica's bit for bit
   8. SyncBatchNorm (desc.sync_batch_norm, BatchNorms at the top and inside a residual block):
      the job against one process with every replica, parameters, running statistics and losses
      bit for bit

   With MGPU_TEST_MPI_CUDA=1 (tests/mpi.sh runs the emulated build so, with MGPU_EMU_DEVICES=4):
   the same on GPUs, rank 0 on cuda:0,1 and the others on cuda:0, against one process on
   cuda:0,1,..., the sums across processes by NCCL (ncclCommInitRank), or through MPI with
   MGPU_ALLREDUCE=host. */

#include <stdint.h>
#include <unistd.h>
#if defined(MGPU_CUDA) && !defined(_WIN32)
#include <dlfcn.h>
#endif
#include <sys/stat.h>

#define IN 12
#define HIDDEN 16
#define OUT 5

static int g_rank, g_size, g_total;   /* g_total: the job's replicas */
static int g_cuda;                    /* MGPU_TEST_MPI_CUDA=1: GPUs, not CPU replicas */

/* The same host numbers on every rank (a test's inputs must not depend on the rank). */
static uint64_t g_state;
static float frand(void) {
    uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
}

/* This rank's devices: two replicas on rank 0, one elsewhere; and the job's G in one process. */
static const char* my_spec(void) { return g_cuda ? (g_rank == 0 ? "cuda:0,1" : "cuda:0") : (g_rank == 0 ? "cpu:2" : "cpu"); }
static void all_spec(char* spec, size_t size, int G) {
    int i, at;
    if (!g_cuda) { snprintf(spec, size, "cpu:%d", G); return; }
    at = snprintf(spec, size, "cuda:0");
    for (i = 1; i < G && at < (int)size; ++i) at += snprintf(spec + at, size - (size_t)at, ",%d", i);
}

/* A tensor's floats on the host (GPU tensors downloaded), in a buffer of the caller's. */
static float* host_floats(const mgpu_tensor* t, float* buf) {
    CHECK(mgpu_tensor_download(t, buf, (size_t)mgpu_tensor_numel(t) * sizeof(float)) == MGPU_OK, "download: %s", mgpu_last_error());
    return buf;
}

static int g_verify_every;   /* the next make_mlp's desc.verify_every */
static int g_zero1;          /* and its desc.zero1 */
static mgpu_model* make_mlp(const mgpu_device_set* set, int distributed, int hidden) {
    mgpu_layer* layers[4];
    mgpu_model_desc d;
    memset(&d, 0, sizeof d);
    layers[0] = mgpu_layer_linear(IN, hidden);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_dropout(0.25f);
    layers[3] = mgpu_layer_linear(hidden, OUT);
    d.input = mgpu_shape1(IN);
    d.layers = layers;
    d.layer_count = 4;
    d.devices = set;
    d.seed = distributed ? 99 + (uint64_t)g_rank : 99;   /* a job takes rank 0's */
    d.distributed = distributed;
    d.verify_every = g_verify_every;
    d.zero1 = g_zero1;
    return mgpu_model_create(&d);
}

/* A global batch of B rows (the same on every rank), and rows [from, from + count) of it. */
static void make_batch(int64_t B, mgpu_tensor** x, mgpu_tensor** y) {
    int64_t i;
    float* xs;
    int32_t* ys;
    *x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(B, IN));
    *y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(B));
    xs = (float*)mgpu_tensor_data(*x);
    ys = (int32_t*)mgpu_tensor_data(*y);
    for (i = 0; i < B * IN; ++i) xs[i] = frand();
    for (i = 0; i < B; ++i) ys[i] = (int32_t)((frand() + 1.0f) * 0.5f * OUT) % OUT;
}
/* This rank's rows of a batch of B: the rows of its replicas (the first B % G replicas of the
   job take one row more). */
static void my_rows(const mgpu_model* m, int64_t B, int64_t* from, int64_t* count) {
    const int G = mgpu_model_total_replica_count(m), first = mgpu_model_first_replica(m), R = mgpu_model_replica_count(m);
    int64_t base = B / G, extra = B % G, end;
    *from = first * base + (first < extra ? first : extra);
    end = (first + R) * base + (first + R < extra ? first + R : extra);
    *count = end - *from;
}

static int same_params(const mgpu_model* a, const mgpu_model* b) {
    const size_t n = (size_t)mgpu_tensor_numel(mgpu_model_params(a, 0));   /* the flat buffer, padding and all */
    float *ha = (float*)malloc(n * sizeof(float)), *hb = (float*)malloc(n * sizeof(float));
    int same = mgpu_tensor_numel(mgpu_model_params(b, 0)) == (int64_t)n &&
               memcmp(host_floats(mgpu_model_params(a, 0), ha), host_floats(mgpu_model_params(b, 0), hb), n * sizeof(float)) == 0;
    free(ha);
    free(hb);
    return same;
}

/* ---- 1. the job ---- */
static void test_job(void) {
    const char* env = getenv("OMPI_COMM_WORLD_SIZE") ? getenv("OMPI_COMM_WORLD_SIZE") : getenv("PMI_SIZE");
    header("the job");
    CHECK(g_size >= 2, "a job of %d processes (run me with mpirun -np 3)", g_size);
    CHECK(!env || atoi(env) == g_size, "mgpu_dist_size %d, the launcher says %s", g_size, env);
    CHECK(g_rank >= 0 && g_rank < g_size, "rank %d of %d", g_rank, g_size);
    CHECK(mgpu_dist_local_rank() >= 0 && mgpu_dist_local_rank() < mgpu_dist_local_size() && mgpu_dist_local_size() <= g_size,
          "local rank %d of %d", mgpu_dist_local_rank(), mgpu_dist_local_size());
    CHECK(mgpu_dist_init(NULL, NULL) == MGPU_OK && mgpu_dist_size() == g_size, "a second mgpu_dist_init changes nothing");
    CHECK(mgpu_cpu_threads() >= 1, "CPU threads %d, shared among the local ranks", mgpu_cpu_threads());
}

/* ---- 2. the communicator across processes ---- */
static void test_allreduce(void) {
    static const int sizes[] = { 1, 2, 7, 1000, 4099 };
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_allreduce* ar = mgpu_allreduce_create_distributed(set, MGPU_ALLREDUCE_AUTO);
    const int mine = mgpu_device_set_count(set), first = g_rank == 0 ? 0 : g_rank + 1, devices = g_size + 1;
    size_t k;
    header("mgpu_allreduce_create_distributed");
    CHECK(ar != NULL, "a communicator over every rank's devices: %s", mgpu_last_error());
    if (!ar) { mgpu_device_set_destroy(set); return; }
    for (k = 0; k < sizeof sizes / sizeof sizes[0]; ++k) {
        const int n = sizes[k];
        mgpu_tensor* t[2];
        float* expect = (float*)calloc((size_t)n, sizeof(float));
        float *mine_values = (float*)calloc((size_t)n * 2, sizeof(float)), *got = (float*)calloc((size_t)n, sizeof(float));
        int d, i, same = 1;
        /* device d's element i: a value whose sums depend on the order */
        for (d = 0; d < devices; ++d)
            for (i = 0; i < n; ++i) {
                const float v = (float)((d + 1) * 1e-3 + 1.0 / (double)(i + 3)) * (d % 2 ? 1e4f : 1.0f);
                if (d >= first && d < first + mine) mine_values[(size_t)(d - first) * (size_t)n + (size_t)i] = v;
                expect[i] = d == 0 ? v : expect[i] + v;
            }
        for (d = 0; d < mine; ++d) {
            t[d] = mgpu_tensor_create(mgpu_device_set_get(set, d), MGPU_F32, mgpu_shape1(n));
            mgpu_tensor_upload(t[d], mine_values + (size_t)d * (size_t)n, (size_t)n * sizeof(float));
        }
        CHECK(mgpu_allreduce_sum(ar, t, mine) == MGPU_OK, "sum of %d floats: %s", n, mgpu_last_error());
        for (d = 0; d < mine; ++d) same &= memcmp(host_floats(t[d], got), expect, (size_t)n * sizeof(float)) == 0;
        CHECK(same, "%d floats: every device of rank %d holds the sum in the job's order (%s), bit for bit", n, g_rank,
              mgpu_allreduce_name(mgpu_allreduce_backend(ar)));
        for (d = 0; d < mine; ++d) mgpu_tensor_destroy(t[d]);
        free(expect);
        free(mine_values);
        free(got);
    }
    mgpu_allreduce_destroy(ar);
    mgpu_device_set_destroy(set);
}

/* ---- 3. equivalence with one process holding every replica ---- */
static void train_both(const char* what, mgpu_optimizer_desc od, int64_t B, int steps, int accumulate) {
    char spec[64];
    mgpu_device_set *set = mgpu_device_set_create(my_spec()), *all;
    mgpu_model *dm = make_mlp(set, 1, HIDDEN), *ref;
    mgpu_optimizer *dopt, *ropt;
    int s, ok = 1, losses = 1;
    int64_t shard_floats = 0;
    if (!dm) { CHECK(0, "%s: distributed mgpu_model_create: %s", what, mgpu_last_error()); mgpu_device_set_destroy(set); return; }
    all_spec(spec, sizeof spec, mgpu_model_total_replica_count(dm));
    all = mgpu_device_set_create(spec);
    ref = make_mlp(all, 0, HIDDEN);
    dopt = mgpu_optimizer_create(dm, &od);
    ropt = mgpu_optimizer_create(ref, &od);
    CHECK(mgpu_model_total_replica_count(dm) == g_total && mgpu_model_replica_count(dm) == (g_rank == 0 ? 2 : 1),
          "%s: %d replicas in the job, %d here", what, mgpu_model_total_replica_count(dm), mgpu_model_replica_count(dm));
    CHECK(same_params(dm, ref), "%s: rank 0's initial parameters everywhere (each rank seeded its own)", what);
    if (g_zero1) {   /* each replica of the job holds its 1/G of the states: the same shard as in one process */
        const int G = mgpu_model_total_replica_count(dm);
        const int64_t n = mgpu_tensor_numel(mgpu_model_params(dm, 0)), most = ((n + G - 1) / G + 15) / 16 * 16;
        int i, sharded = 1;
        shard_floats = most;
        for (i = 0; i < mgpu_model_replica_count(dm); ++i) {
            int64_t first = -1, count = -1, rfirst = -2, rcount = -2;
            sharded &= mgpu_optimizer_shard(dopt, i, 0, &first, &count) == MGPU_OK &&
                       mgpu_optimizer_shard(ropt, mgpu_model_first_replica(dm) + i, 0, &rfirst, &rcount) == MGPU_OK &&
                       first == rfirst && count == rcount && count <= most && count < n;
        }
        CHECK(sharded, "%s: each of this rank's replicas holds the states of at most %lld of %lld floats, the shard of its "
              "number in the job", what, (long long)most, (long long)n);
    }
    for (s = 0; s < mgpu_device_set_count(set); ++s) mgpu_device_reset_counters(mgpu_device_set_get(set, s));
    for (s = 0; s < steps && ok; ++s) {
        mgpu_tensor *x, *y, *xs, *ys;
        int64_t from, count;
        float dl = 0.0f, rl = 0.0f;
        make_batch(B, &x, &y);
        my_rows(dm, B, &from, &count);
        xs = mgpu_tensor_view_rows(x, from, count);
        ys = mgpu_tensor_view_rows(y, from, count);
        if (!accumulate) {
            ok &= mgpu_model_train_step(dm, dopt, xs, ys, &dl) == MGPU_OK;
            ok &= mgpu_model_train_step(ref, ropt, x, y, &rl) == MGPU_OK;
            {   /* each replica's own loss: this rank's, as the one process's replica of the same rows */
                int i;
                for (i = 0; ok && i < mgpu_model_replica_count(dm); ++i) {
                    float mine = -1.0f, theirs = -2.0f;
                    ok &= mgpu_model_replica_loss(dm, i, &mine) == MGPU_OK &&
                          mgpu_model_replica_loss(ref, mgpu_model_first_replica(dm) + i, &theirs) == MGPU_OK;
                    losses &= fabsf(mine - theirs) <= 1e-6f * fabsf(theirs);
                }
            }
        } else {   /* the batch in two halves, each rank with its rows of each half */
            const int64_t half = B / 2;
            mgpu_tensor *a = mgpu_tensor_view_rows(x, 0, half), *b = mgpu_tensor_view_rows(x, half, B - half);
            mgpu_tensor *ya = mgpu_tensor_view_rows(y, 0, half), *yb = mgpu_tensor_view_rows(y, half, B - half);
            mgpu_tensor *as, *bs, *yas, *ybs;
            int64_t f2, c2;
            my_rows(dm, half, &from, &count);
            my_rows(dm, B - half, &f2, &c2);
            as = mgpu_tensor_view_rows(a, from, count);
            yas = mgpu_tensor_view_rows(ya, from, count);
            bs = mgpu_tensor_view_rows(b, f2, c2);
            ybs = mgpu_tensor_view_rows(yb, f2, c2);
            ok &= mgpu_model_accumulate(dm, as, yas, B, NULL) == MGPU_OK && mgpu_model_accumulate(dm, bs, ybs, B, NULL) == MGPU_OK &&
                  mgpu_model_apply(dm, dopt) == MGPU_OK;
            ok &= mgpu_model_accumulate(ref, a, ya, B, NULL) == MGPU_OK && mgpu_model_accumulate(ref, b, yb, B, NULL) == MGPU_OK &&
                  mgpu_model_apply(ref, ropt) == MGPU_OK;
            mgpu_tensor_destroy(as); mgpu_tensor_destroy(bs); mgpu_tensor_destroy(yas); mgpu_tensor_destroy(ybs);
            mgpu_tensor_destroy(a); mgpu_tensor_destroy(b); mgpu_tensor_destroy(ya); mgpu_tensor_destroy(yb);
        }
        losses &= fabsf(dl - rl) <= 1e-6f * fabsf(rl);
        mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    if (g_zero1 && mgpu_model_allreduce_backend(dm) == MGPU_ALLREDUCE_NCCL) {   /* the all-gather through NCCL, not the host */
        uint64_t down = 0;
        mgpu_device_counters c;
        for (s = 0; s < mgpu_device_set_count(set); ++s)
            if (mgpu_device_get_counters(mgpu_device_set_get(set, s), &c) == MGPU_OK) down += c.bytes_device_to_host;
        CHECK(down < (uint64_t)steps * (uint64_t)shard_floats * sizeof(float),
              "%s: with NCCL, the parameters' all-gather stays on the GPUs: %llu bytes to the host in %d steps (a shard: %lld)",
              what, (unsigned long long)down, steps, (long long)shard_floats);
    }
    CHECK(ok, "%s: %d steps: %s", what, steps, ok ? "" : mgpu_last_error());
    CHECK(losses, "%s: the job's loss, and each replica's (mgpu_model_replica_loss), are the one process's", what);
    CHECK(same_params(dm, ref), "%s, batch %lld: the same parameters as one process on %s, bit for bit", what, (long long)B, spec);
    CHECK(mgpu_model_verify_replicas(dm) == MGPU_OK, "%s: every replica of every rank the same: %s", what, mgpu_last_error());
    mgpu_optimizer_destroy(dopt); mgpu_optimizer_destroy(ropt);
    mgpu_model_destroy(dm); mgpu_model_destroy(ref);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(all);
}

static mgpu_optimizer_desc sgd(void) {
    mgpu_optimizer_desc d;
    memset(&d, 0, sizeof d);
    d.kind = MGPU_SGD;
    d.lr = 0.1f;
    d.momentum = 0.9f;
    d.weight_decay = 1e-3f;
    return d;
}
static mgpu_optimizer_desc adamw(void) {
    mgpu_optimizer_desc d;
    memset(&d, 0, sizeof d);
    d.kind = MGPU_ADAMW;
    d.lr = 1e-2f;
    d.weight_decay = 1e-2f;
    return d;
}

static void test_equivalence(void) {
    header("a distributed model against one process with all the replicas");
    train_both("SGD", sgd(), 24, 6, 0);
    train_both("SGD, uneven rows", sgd(), 23, 6, 0);
    train_both("AdamW", adamw(), 29, 6, 0);
    train_both("accumulate + apply", sgd(), 26, 4, 1);
    g_verify_every = g_rank == 1;   /* rank 1 alone asks to check: the job takes rank 0's setting, and nobody waits */
    train_both("verify_every on rank 1 only", sgd(), 24, 3, 0);
    g_verify_every = 0;
}

/* ---- 4. failures ---- */
static void test_failures(void) {
    char want[32];
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_model *m = make_mlp(set, 1, HIDDEN), *bad;
    mgpu_optimizer* opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .lr = 0.1f });
    mgpu_tensor *x, *y, *xs, *ys, *before;
    int64_t from, count;
    mgpu_result r;
    header("failures on one rank");
    if (!m || !opt) { CHECK(0, "model: %s", mgpu_last_error()); return; }
    before = mgpu_tensor_to(mgpu_model_params(m, 0), mgpu_device_cpu());
    /* the last rank passes rows of the wrong width */
    make_batch(12, &x, &y);
    my_rows(m, 12, &from, &count);
    if (g_rank == g_size - 1) xs = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(count, IN + 1));
    else xs = mgpu_tensor_view_rows(x, from, count);
    ys = mgpu_tensor_view_rows(y, from, count);
    if (g_rank == g_size - 1) mgpu_tensor_fill(xs, 0.5);
    r = mgpu_model_train_step(m, opt, xs, ys, NULL);
    snprintf(want, sizeof want, "rank %d of %d", g_size - 1, g_size);
    CHECK(r == MGPU_ERROR_SHAPE_MISMATCH && strstr(mgpu_last_error(), want) && strstr(mgpu_last_error(), "mgpu_model_train_step"),
          "rank %d: the last rank's bad input fails this rank too, with its message: %s", g_rank, mgpu_last_error());
    {
        float* now = (float*)malloc((size_t)mgpu_tensor_numel(before) * sizeof(float));
        CHECK(memcmp(mgpu_tensor_data(before), host_floats(mgpu_model_params(m, 0), now), (size_t)mgpu_tensor_numel(before) * 4) == 0,
              "rank %d: the parameters as they were", g_rank);
        free(now);
    }
    mgpu_tensor_destroy(xs);
    xs = mgpu_tensor_view_rows(x, from, count);
    CHECK(mgpu_model_train_step(m, opt, xs, ys, NULL) == MGPU_OK, "then a good step works on every rank: %s", mgpu_last_error());
    mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys);
    /* rank 1 corrupts one parameter of its first replica: verify names it everywhere */
    if (g_rank == 1) {
        float* p = (float*)malloc((size_t)mgpu_tensor_numel(before) * sizeof(float));
        host_floats(mgpu_model_params(m, 0), p)[3] += 1.0f;
        mgpu_tensor_upload(mgpu_model_params(m, 0), p, (size_t)mgpu_tensor_numel(before) * sizeof(float));
        free(p);
    }
    r = mgpu_model_verify_replicas(m);
    CHECK(r == MGPU_ERROR_DIVERGED && strstr(mgpu_last_error(), "rank 1") && strstr(mgpu_last_error(), "0.weight"),
          "rank %d: a corrupted rank 1 is named: %s", g_rank, mgpu_last_error());
    /* rank 1 forgets its optimizer: every rank fails (none waits for it in the step's vote) */
    xs = mgpu_tensor_view_rows(x, from, count);
    ys = mgpu_tensor_view_rows(y, from, count);
    r = mgpu_model_train_step(m, g_rank == 1 ? NULL : opt, xs, ys, NULL);
    CHECK(r == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), "rank 1 of") && strstr(mgpu_last_error(), "optimizer"),
          "rank %d: rank 1's NULL optimizer fails every rank's step: %s", g_rank, mgpu_last_error());
    r = mgpu_model_apply(m, g_rank == 1 ? NULL : opt);
    CHECK(r == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), "rank 1 of"), "rank %d: and its apply: %s", g_rank,
          mgpu_last_error());
    mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys);
    /* a communicator given other sizes on the last rank: every rank refuses to sum */
    {
        mgpu_device_set* one = mgpu_device_set_create("cpu");
        mgpu_allreduce* ar = mgpu_allreduce_create_distributed(one, MGPU_ALLREDUCE_AUTO);
        mgpu_tensor* t = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(g_rank == g_size - 1 ? 12 : 10));
        mgpu_tensor_fill(t, 1.0);
        r = mgpu_allreduce_sum(ar, &t, 1);
        CHECK(r == MGPU_ERROR_SHAPE_MISMATCH && strstr(mgpu_last_error(), "12 floats"), "rank %d: sizes that differ are refused everywhere: %s",
              g_rank, mgpu_last_error());
        r = mgpu_allreduce_sum(ar, g_rank == 0 ? NULL : &t, 1);
        CHECK(r == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), "rank 0 of"), "rank %d: rank 0's NULL fails every rank: %s",
              g_rank, mgpu_last_error());
        mgpu_tensor_destroy(t);
        mgpu_allreduce_destroy(ar);
        mgpu_device_set_destroy(one);
    }
    /* a rank with other layers: mgpu_model_create fails on every rank */
    bad = make_mlp(set, 1, g_rank == 1 ? HIDDEN + 1 : HIDDEN);
    CHECK(!bad && strstr(mgpu_last_error(), "rank 1 of") && strstr(mgpu_last_error(), "rank 0's"),
          "rank %d: a model whose layers differ on rank 1 is refused everywhere: %s", g_rank, mgpu_last_error());
    mgpu_model_destroy(bad);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y); mgpu_tensor_destroy(before);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

/* ---- 5. checkpoints ---- */
static void test_checkpoints(const char* dir) {
    char path[512], bad[512];
    struct stat st;
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_model *m = make_mlp(set, 1, HIDDEN), *one = make_mlp(NULL, 0, HIDDEN);
    mgpu_optimizer* opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });
    mgpu_tensor *x, *y, *xs, *ys;
    int64_t from, count;
    mgpu_result r;
    header("checkpoints");
    make_batch(20, &x, &y);
    my_rows(m, 20, &from, &count);
    xs = mgpu_tensor_view_rows(x, from, count);
    ys = mgpu_tensor_view_rows(y, from, count);
    CHECK(mgpu_model_train_step(m, opt, xs, ys, NULL) == MGPU_OK, "a step: %s", mgpu_last_error());
    snprintf(path, sizeof path, "%s/job.safetensors", dir);
    r = mgpu_model_save(m, opt, path);
    CHECK(r == MGPU_OK && stat(path, &st) == 0 && st.st_size > 0, "rank %d: the checkpoint is there when the save returns: %s", g_rank,
          mgpu_last_error());
    CHECK(mgpu_model_load(one, NULL, path) == MGPU_OK && same_params(one, m), "one process loads the job's parameters, bit for bit: %s",
          mgpu_last_error());
    snprintf(bad, sizeof bad, "%s", dir);   /* a folder: rank 0's save fails, and so does every rank's */
    r = mgpu_model_save(m, opt, bad);
    CHECK(r != MGPU_OK && strstr(mgpu_last_error(), "rank 0 of"), "rank %d: rank 0's failed save fails here too: %s", g_rank,
          mgpu_last_error());
    r = mgpu_model_load(m, opt, g_rank == 1 ? bad : path);
    CHECK(r != MGPU_OK && strstr(mgpu_last_error(), "rank 1 of"), "rank %d: rank 1's failed load fails here too: %s", g_rank,
          mgpu_last_error());
    /* the ranks may differ now: steps refuse until a load works everywhere */
    r = mgpu_model_train_step(m, opt, xs, ys, NULL);
    CHECK(r == MGPU_ERROR_DIVERGED && strstr(mgpu_last_error(), "load a checkpoint"), "rank %d: then steps refuse: %s", g_rank,
          mgpu_last_error());
    CHECK(mgpu_model_load(m, opt, path) == MGPU_OK && mgpu_model_train_step(m, opt, xs, ys, NULL) == MGPU_OK &&
          mgpu_model_verify_replicas(m) == MGPU_OK, "rank %d: a load on every rank, and the job goes on: %s", g_rank, mgpu_last_error());
    mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m); mgpu_model_destroy(one);
    mgpu_device_set_destroy(set);
}

/* ---- 5b. ZeRO-1 across processes ---- */

/* One step of a global batch of B rows: the job's model on this rank's rows, and each of the
   one-process models on all of them. */
static int step_all(mgpu_model* dm, mgpu_optimizer* dopt, mgpu_model** ones, mgpu_optimizer** oopts, int n, int64_t B) {
    mgpu_tensor *x, *y, *xs, *ys;
    int64_t from, count;
    int i, ok;
    make_batch(B, &x, &y);
    my_rows(dm, B, &from, &count);
    xs = mgpu_tensor_view_rows(x, from, count);
    ys = mgpu_tensor_view_rows(y, from, count);
    ok = mgpu_model_train_step(dm, dopt, xs, ys, NULL) == MGPU_OK;
    for (i = 0; ok && i < n; ++i) ok = mgpu_model_train_step(ones[i], oopts[i], x, y, NULL) == MGPU_OK;
    mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    return ok;
}

/* A sharded job's checkpoint holds the whole states (rank 0 gathers them): loaded into one
   unsharded process, and back into the job, both go on as the job in one process does, to the
   bit (AdamW: a state of zeros, or another shard's, would change the steps). The other ranks
   hold only their own ranges of the states while saving: no allocation as large as the states. */
static void zero1_checkpoint(const char* dir) {
    char path[512], spec[64];
    mgpu_device_set *set = mgpu_device_set_create(my_spec()), *all;
    mgpu_model *m, *ones[2];
    mgpu_optimizer *opt, *oopts[2];
    const mgpu_optimizer_desc od = adamw();
    int s, ok = 1;
    g_zero1 = 1;
    m = make_mlp(set, 1, HIDDEN);
    all_spec(spec, sizeof spec, mgpu_model_total_replica_count(m));
    all = mgpu_device_set_create(spec);
    ones[0] = make_mlp(all, 0, HIDDEN);   /* the job in one process, sharded too */
    g_zero1 = 0;
    ones[1] = make_mlp(all, 0, HIDDEN);   /* unsharded: it takes the job's checkpoint */
    opt = mgpu_optimizer_create(m, &od);
    oopts[0] = mgpu_optimizer_create(ones[0], &od);
    oopts[1] = mgpu_optimizer_create(ones[1], &od);
    CHECK(m && ones[0] && ones[1] && opt && oopts[0] && oopts[1], "zero1 checkpoint: models: %s", mgpu_last_error());
    if (!m || !ones[0] || !ones[1] || !opt || !oopts[0] || !oopts[1]) ok = 0;
    if (ok) {   /* mgpu_model_summary says how the job shards */
        char text[4096], want[96];
        summary_of(m, text, sizeof text);
        snprintf(want, sizeof want, "1/%d of the optimizer's states (mgpu_optimizer_shard), across the job's processes", g_total);
        CHECK(strstr(text, want) != NULL, "zero1: mgpu_model_summary says '%s':\n%s", want, text);
    }
    for (s = 0; s < 3 && ok; ++s) ok = step_all(m, opt, ones, oopts, 1, 22);
    snprintf(path, sizeof path, "%s/job_zero1.safetensors", dir);
    t_largest_alloc = 0;
    ok = ok && mgpu_model_save(m, opt, path) == MGPU_OK;
    CHECK(ok, "zero1: three steps and a save of the job's sharded states: %s", mgpu_last_error());
    if (ok && g_rank > 0) {   /* (AdamW: two states, each as many floats as the parameters) */
        const size_t states = 2 * (size_t)mgpu_tensor_numel(mgpu_model_params(m, 0)) * sizeof(float);
        CHECK(t_largest_alloc < states, "rank %d: zero1, a save allocated %zu bytes at once, as much as the whole states (%zu): "
              "want only this rank's ranges", g_rank, t_largest_alloc, states);
    }
    ok = ok && mgpu_model_load(ones[1], oopts[1], path) == MGPU_OK && mgpu_model_load(m, opt, path) == MGPU_OK;
    CHECK(ok, "zero1: the job's checkpoint loads into one unsharded process, and back into the job: %s", mgpu_last_error());
    for (s = 0; s < 3 && ok; ++s) ok = step_all(m, opt, ones, oopts, 2, 22);
    CHECK(ok, "zero1: three steps more: %s", mgpu_last_error());
    CHECK(ok && same_params(m, ones[0]) && same_params(ones[1], ones[0]),
          "zero1: after the checkpoint, the job and the unsharded process that loaded it step as the job in one process, bit for "
          "bit");
    mgpu_optimizer_destroy(opt); mgpu_optimizer_destroy(oopts[0]); mgpu_optimizer_destroy(oopts[1]);
    mgpu_model_destroy(m); mgpu_model_destroy(ones[0]); mgpu_model_destroy(ones[1]);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(all);
}

/* zero1 across processes, an optimizer step failing on some ranks (the emulator fails their
   nth launch from now, nth[rank]; 0: none): every rank's step fails with the failing rank's
   message, none waits for it. When some rank had updated some of its parameters the job is
   marked (steps refuse until a load on every rank, and then go on); when none had, it is not.
   A save where some ranks pass the optimizer and others do not fails on every rank, naming it. */
typedef void (*emu_fail_at_fn)(const char* what, long nth, long count);
static void zero1_failure(const char* dir, emu_fail_at_fn fail_at, const char* what, int clip, const long* nth, int marked) {
    char path[512];
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_optimizer_desc od = adamw();
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y, *xs, *ys;
    int64_t from, count;
    mgpu_result r;
    int ok;
    od.clip_norm = clip ? 1.0f : 0.0f;
    g_zero1 = 1;
    m = make_mlp(set, 1, HIDDEN);
    g_zero1 = 0;
    opt = mgpu_optimizer_create(m, &od);
    snprintf(path, sizeof path, "%s/job_zero1_fail.safetensors", dir);
    ok = m && opt && step_all(m, opt, NULL, NULL, 0, 20) && mgpu_model_save(m, opt, path) == MGPU_OK;
    CHECK(ok, "zero1 failure (%s): a step and a save first: %s", what, mgpu_last_error());
    if (!ok) { mgpu_optimizer_destroy(opt); mgpu_model_destroy(m); mgpu_device_set_destroy(set); return; }
    r = mgpu_model_save(m, g_rank == 1 ? NULL : opt, path);
    CHECK(r != MGPU_OK && strstr(mgpu_last_error(), "pass the optimizer on every rank or on none"),
          "rank %d: zero1, a save with the optimizer on some ranks only fails on every rank: %s", g_rank, mgpu_last_error());
    if (fail_at) {
        make_batch(20, &x, &y);
        my_rows(m, 20, &from, &count);
        xs = mgpu_tensor_view_rows(x, from, count);
        ys = mgpu_tensor_view_rows(y, from, count);
        ok = mgpu_model_zero_grad(m) == MGPU_OK && mgpu_model_accumulate(m, xs, ys, 20, NULL) == MGPU_OK &&
             mgpu_model_reduce_grads(m) == MGPU_OK;
        CHECK(ok, "zero1 failure (%s): accumulate and reduce: %s", what, mgpu_last_error());
        if (nth[g_rank] > 0) fail_at("launch", nth[g_rank], 1);
        r = mgpu_optimizer_step(opt);
        fail_at("launch", 0, 0);
        CHECK(r != MGPU_OK && strstr(mgpu_last_error(), "rank ") && strstr(mgpu_last_error(), "cudaErrorLaunchOutOfResources"),
              "rank %d: zero1, %s: the optimizer step fails on every rank with the failing rank's message: %s", g_rank, what,
              mgpu_last_error());
        r = mgpu_model_train_step(m, opt, xs, ys, NULL);
        if (marked) {
            CHECK(r == MGPU_ERROR_DIVERGED && strstr(mgpu_last_error(), "load a checkpoint"),
                  "rank %d: zero1, %s: some rank had updated, so steps refuse: %s", g_rank, what, mgpu_last_error());
            r = mgpu_model_load(m, opt, path);
            if (r == MGPU_OK) r = mgpu_model_train_step(m, opt, xs, ys, NULL);
        }
        CHECK(r == MGPU_OK && mgpu_model_verify_replicas(m) == MGPU_OK, "rank %d: zero1, %s: %s the job goes on, every replica "
              "the same: %s", g_rank, what, marked ? "after a load," : "no rank had updated:", mgpu_last_error());
        mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

static void test_zero1(const char* dir) {
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_model* m;
    header("zero1: the optimizer's states sharded across the job's processes");
    g_zero1 = 1;
    train_both("zero1, AdamW", adamw(), 29, 6, 0);
    train_both("zero1, SGD, accumulate + apply", sgd(), 26, 4, 1);
    g_zero1 = 0;
    zero1_checkpoint(dir);
    {   /* which launch fails on ranks 0, 1, 2 (counted from the optimizer step's first) */
        const long rank1_clips[3] = { 0, 1, 0 }, rank0_second[3] = { 2, 0, 0 }, all_clip[3] = { 1, 1, 1 };
        emu_fail_at_fn fail_at = NULL;
#if defined(MGPU_CUDA) && !defined(_WIN32)
        void* self = dlopen(NULL, RTLD_NOW);
        if (self) fail_at = (emu_fail_at_fn)dlsym(self, "mgpu_emu_fail_at");
#endif
        if (!fail_at) SKIP("zero1: an optimizer step failing on some ranks needs the emulator to fail a launch (MGPU_TEST_MPI_CUDA=1 "
                           "on the emulated build); here only the save's check runs");
        zero1_failure(dir, fail_at, "rank 1's clipping fails, the others update", 1, rank1_clips, 1);
        zero1_failure(dir, fail_at, "rank 0's second replica's update fails, the others update", 0, rank0_second, 1);
        zero1_failure(dir, fail_at, "every rank's clipping fails, before any update", 1, all_clip, 0);
    }
    g_zero1 = g_rank == 1;   /* rank 1 alone shards: every rank refuses the model */
    m = make_mlp(set, 1, HIDDEN);
    CHECK(!m && strstr(mgpu_last_error(), "desc.zero1"), "rank %d: zero1 on rank 1 alone refused on every rank: %s", g_rank,
          mgpu_last_error());
    g_zero1 = 0;
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

/* ---- 6. loaders ---- */
static void write_be32(FILE* f, uint32_t v) {
    unsigned char b[4] = { (unsigned char)(v >> 24), (unsigned char)(v >> 16), (unsigned char)(v >> 8), (unsigned char)v };
    fwrite(b, 1, 4, f);
}
static void test_loader(const char* dir) {
    enum { N = 50, BATCH = 11 };
    char ip[512], lp[512];
    FILE* f;
    int i, rows = 0, ok = 1;
    mgpu_device_set *set = mgpu_device_set_create(my_spec()), *one;
    mgpu_model* m;
    mgpu_dataset* ds;
    mgpu_loader *mine, *whole;
    mgpu_allreduce* ar;
    mgpu_tensor* seen;
    const mgpu_tensor *x, *y, *wx, *wy;
    header("loaders with shard_for");
    /* 50 images of 1 x 1 pixel, image i with label i % 256 and pixel i: rows say which sample they are */
    snprintf(ip, sizeof ip, "%s/img-%d", dir, g_rank);
    snprintf(lp, sizeof lp, "%s/lab-%d", dir, g_rank);
    f = fopen(ip, "wb");
    write_be32(f, 0x803); write_be32(f, N); write_be32(f, 1); write_be32(f, 1);
    for (i = 0; i < N; ++i) fputc(i, f);
    fclose(f);
    f = fopen(lp, "wb");
    write_be32(f, 0x801); write_be32(f, N);
    for (i = 0; i < N; ++i) fputc(i, f);
    fclose(f);
    ds = mgpu_dataset_load_idx(ip, lp);
    m = make_mlp(set, 1, HIDDEN);
    CHECK(ds && m, "data set and model: %s", mgpu_last_error());
    if (!ds || !m) return;
    mine = mgpu_loader_create(ds, &(mgpu_loader_desc){ .batch = BATCH, .shuffle = 1, .seed = 5, .shard_for = m });
    whole = mgpu_loader_create(ds, &(mgpu_loader_desc){ .batch = BATCH, .shuffle = 1, .seed = 5 });
    seen = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(N));
    mgpu_tensor_zero(seen);
    mgpu_loader_start(mine, 1);
    mgpu_loader_start(whole, 1);
    while (mgpu_loader_next(whole, &wx, &wy)) {
        int64_t from, count, k;
        ok &= mgpu_loader_next(mine, &x, &y);
        if (!ok) break;
        my_rows(m, mgpu_tensor_dim(wy, 0), &from, &count);
        ok &= mgpu_tensor_dim(y, 0) == count && mgpu_tensor_dim(x, 0) == count;
        for (k = 0; ok && k < count; ++k) {
            const int32_t label = ((const int32_t*)mgpu_tensor_data(y))[k];
            ok &= label == ((const int32_t*)mgpu_tensor_data(wy))[from + k] &&
                  ((const float*)mgpu_tensor_data(x))[k] == ((const float*)mgpu_tensor_data(wx))[from + k];
            ((float*)mgpu_tensor_data(seen))[label] += 1.0f;
            rows++;
        }
    }
    CHECK(ok && !mgpu_loader_next(mine, &x, &y), "rank %d: its rows of every batch, %d in all, the replicas' rows of the batch", g_rank, rows);
    one = mgpu_device_set_create("cpu");
    ar = mgpu_allreduce_create_distributed(one, MGPU_ALLREDUCE_AUTO);
    CHECK(ar && mgpu_allreduce_sum(ar, &seen, 1) == MGPU_OK, "the ranks' counts summed: %s", mgpu_last_error());
    for (i = 0, ok = 1; i < N; ++i) ok &= ((float*)mgpu_tensor_data(seen))[i] == 1.0f;
    CHECK(ok, "the ranks together see every sample of the epoch once");
    mgpu_allreduce_destroy(ar);
    mgpu_device_set_destroy(one);
    mgpu_tensor_destroy(seen);
    mgpu_loader_destroy(mine); mgpu_loader_destroy(whole);
    mgpu_dataset_destroy(ds);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    remove(ip);
    remove(lp);
}

/* The same with token windows (mgpu_dataset_tokens): token i is i, so a row's first x says its
   window; with wrap every batch has BATCH rows, the last one completed from the epoch's first. */
static void test_loader_tokens(void) {
    enum { T = 3, W = 40, N = W * T + 2, BATCH = 7 };
    uint16_t tok[N];
    int i, w, rows = 0, ok = 1;
    mgpu_device_set *set = mgpu_device_set_create(my_spec()), *one;
    mgpu_model* m;
    mgpu_tokens* t;
    mgpu_dataset* ds;
    mgpu_allreduce* ar;
    mgpu_tensor* seen;
    const mgpu_tensor *x, *y, *wx, *wy;
    header("token loaders with shard_for");
    for (i = 0; i < N; ++i) tok[i] = (uint16_t)i;
    t = mgpu_tokens_from_memory(tok, N);
    ds = t ? mgpu_dataset_tokens(t, T) : NULL;
    m = make_mlp(set, 1, HIDDEN);
    CHECK(ds && ds->count == W && m, "tokens, windows and model: %s", mgpu_last_error());
    if (!ds || !m) return;
    seen = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(W));
    for (w = 0; w < 2; ++w) {   /* without wrap, then with */
        mgpu_loader_desc d;
        mgpu_loader *mine, *whole;
        int64_t batches = 0;
        memset(&d, 0, sizeof d);
        d.batch = BATCH;
        d.shuffle = 1;
        d.seed = 9;
        d.wrap = w;
        whole = mgpu_loader_create(ds, &d);
        d.shard_for = m;
        mine = mgpu_loader_create(ds, &d);
        CHECK(mine && whole, "loaders: %s", mgpu_last_error());
        if (!mine || !whole) break;
        mgpu_tensor_zero(seen);
        mgpu_loader_start(mine, 2);
        mgpu_loader_start(whole, 2);
        while (mgpu_loader_next(whole, &wx, &wy)) {
            int64_t from, count, k, j;
            ok &= mgpu_loader_next(mine, &x, &y);
            if (!ok) break;
            ok &= !w || mgpu_tensor_dim(wx, 0) == BATCH;
            my_rows(m, mgpu_tensor_dim(wy, 0), &from, &count);
            ok &= mgpu_tensor_dim(y, 0) == count && mgpu_tensor_dim(x, 0) == count && mgpu_tensor_dim(x, 1) == T;
            for (k = 0; ok && k < count; ++k) {
                const int32_t* xr = (const int32_t*)mgpu_tensor_data(x) + k * T;
                const int32_t* yr = (const int32_t*)mgpu_tensor_data(y) + k * T;
                ok &= !memcmp(xr, (const int32_t*)mgpu_tensor_data(wx) + (from + k) * T, T * sizeof(int32_t)) &&
                      !memcmp(yr, (const int32_t*)mgpu_tensor_data(wy) + (from + k) * T, T * sizeof(int32_t));
                for (j = 0; j < T; ++j) ok &= xr[j] == xr[0] + j && yr[j] == xr[0] + j + 1;   /* a window, y shifted by one */
                ok &= xr[0] % T == 0 && xr[0] / T < W;
                if (ok && (!w || batches < W / BATCH || from + k < W % BATCH))   /* not the wrap's repeats */
                    ((float*)mgpu_tensor_data(seen))[xr[0] / T] += 1.0f;
                rows++;
            }
            batches++;
        }
        CHECK(ok && !mgpu_loader_next(mine, &x, &y) && batches == (W + BATCH - 1) / BATCH,
              "rank %d%s: its rows of every batch of windows, %d in all, the replicas' rows of the batch", g_rank, w ? " (wrap)" : "", rows);
        one = mgpu_device_set_create("cpu");
        ar = mgpu_allreduce_create_distributed(one, MGPU_ALLREDUCE_AUTO);
        CHECK(ar && mgpu_allreduce_sum(ar, &seen, 1) == MGPU_OK, "the ranks' counts summed: %s", mgpu_last_error());
        for (i = 0, ok = 1; i < W; ++i) ok &= ((float*)mgpu_tensor_data(seen))[i] == 1.0f;
        CHECK(ok, "the ranks together see every window of the epoch once%s", w ? " (besides the wrap's repeats)" : "");
        mgpu_allreduce_destroy(ar);
        mgpu_device_set_destroy(one);
        mgpu_loader_destroy(mine);
        mgpu_loader_destroy(whole);
        rows = 0;
        ok = 1;
    }
    mgpu_tensor_destroy(seen);
    mgpu_dataset_destroy(ds);
    mgpu_tokens_destroy(t);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

/* ---- 7. a GPT ---- */
/* GPT-2's layers as examples/gpt.c makes them (tests/test_seq.c's tiny_gpt), small: Embedding,
   PositionEmbedding, Dropout, blocks of LayerNorm + CausalSelfAttention and LayerNorm + MLP in
   residual containers, a final LayerNorm and a head tied to the embedding. */
enum { GPT_V = 13, GPT_T = 6, GPT_C = 8, GPT_H = 2, GPT_L = 2 };
static mgpu_layer* gpt_block(float p) {
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(GPT_C), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(GPT_C, GPT_H, p), "attn") };
    mgpu_layer* mlp[4] = { mgpu_layer_name(mgpu_layer_conv1d(GPT_C, 4 * GPT_C), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * GPT_C, GPT_C), "c_proj"), mgpu_layer_dropout(p) };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(GPT_C), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 4), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL) };
    return mgpu_layer_sequential(both, 2);
}
static mgpu_model* make_gpt(const mgpu_device_set* set, int distributed) {
    static const mgpu_tie tie = { "6.weight", "0.weight" };   /* the head (layer 3 + GPT_L + 1) is the embedding */
    mgpu_layer* layers[3 + GPT_L + 2];
    mgpu_model_desc d;
    int n = 0, i;
    layers[n++] = mgpu_layer_embedding(GPT_V, GPT_C);
    layers[n++] = mgpu_layer_position_embedding(GPT_T, GPT_C);
    layers[n++] = mgpu_layer_dropout(0.2f);
    for (i = 0; i < GPT_L; ++i) layers[n++] = gpt_block(0.2f);
    layers[n++] = mgpu_layer_layer_norm(GPT_C);
    layers[n++] = mgpu_layer_linear_no_bias(GPT_C, GPT_V);
    memset(&d, 0, sizeof d);
    d.input = mgpu_shape1(GPT_T);
    d.input_dtype = MGPU_I32;
    d.layers = layers;
    d.layer_count = n;
    d.devices = set;
    d.seed = distributed ? 7 + (uint64_t)g_rank : 7;   /* a job takes rank 0's */
    d.distributed = distributed;
    d.ties = &tie;
    d.tie_count = 1;
    return mgpu_model_create(&d);
}

/* Whether label t of the batch's row `row` (of `rows`) is MGPU_IGNORE_INDEX at step s: a rule of
   the global batch, the same in both processes, that leaves the ranks unevenly many labels: the
   later rows lose more, and every third step the second half of the batch loses all of them
   (so that the last rank has none: no term, and no gradient but zeros); at step 3 every label of
   the job (a loss of 0, gradients of 0: the optimizer's step all the same). */
static int gpt_ignored(int s, int64_t row, int64_t rows, int t) {
    if (s == 3) return 1;
    if (s % 3 == 1) return row >= rows / 2;
    return (row * 7 + t * 3 + s) % 5 < (row < rows / 2 ? 1 : 3);
}
/* A copy of labels y (rows [from, from + count) of the global batch of `rows`) with the rule's ignored. */
static mgpu_tensor* gpt_ignore(const mgpu_tensor* y, int s, int64_t from, int64_t rows) {
    mgpu_tensor* out = mgpu_tensor_to(y, mgpu_device_cpu());
    int32_t* lab = out ? (int32_t*)mgpu_tensor_data(out) : NULL;
    int64_t k;
    int t;
    for (k = 0; lab && k < mgpu_tensor_dim(y, 0); ++k)
        for (t = 0; t < GPT_T; ++t)
            if (gpt_ignored(s, from + k, rows, t)) lab[k * GPT_T + t] = MGPU_IGNORE_INDEX;
    return out;
}

/* The labels of y that count (not MGPU_IGNORE_INDEX). */
static int gpt_terms(const mgpu_tensor* y) {
    int64_t k;
    int n = 0;
    for (k = 0; k < mgpu_tensor_numel(y); ++k) n += ((const int32_t*)mgpu_tensor_data(y))[k] != MGPU_IGNORE_INDEX;
    return n;
}

/* A distributed GPT (each rank's rows from a loader with shard_for) against one process with
   every replica (the whole batch from a loader over the same windows): the same parameters bit
   for bit after every step, and the same loss, the job's and each replica's. mine: the rank's
   devices ("cpu" or "cuda:0" for one replica each; NULL for my_spec's). ignore: gpt_ignored's
   labels ignored; accumulate: each batch in two halves (mgpu_model_accumulate, then apply). */
static void gpt_both(const char* what, const char* mine, mgpu_optimizer_desc od, int batch, int steps, int ignore, int accumulate) {
    enum { WINDOWS = 30, N = WINDOWS * GPT_T + 1 };
    uint16_t tok[N];
    char spec[64];
    uint32_t lcg = 12345;
    mgpu_device_set *set = mgpu_device_set_create(mine ? mine : my_spec()), *all;
    mgpu_model *dm = make_gpt(set, 1), *ref;
    mgpu_optimizer *dopt, *ropt;
    mgpu_tokens* t;
    mgpu_dataset* ds;
    mgpu_loader *lm, *lw;
    mgpu_loader_desc ld;
    int s, i, ok = 1, losses = 1, same = 1, bad_step = -1, terms_here = 0;
    float dl = 0.0f, rl = 0.0f;
    const char* why = NULL;
    if (!dm) { CHECK(0, "%s: distributed GPT: %s", what, mgpu_last_error()); mgpu_device_set_destroy(set); return; }
    all_spec(spec, sizeof spec, mgpu_model_total_replica_count(dm));
    all = mgpu_device_set_create(spec);
    ref = make_gpt(all, 0);
    for (i = 0; i < N; ++i) {   /* tokens with no short period: an LCG's high bits */
        lcg = lcg * 1664525u + 1013904223u;
        tok[i] = (uint16_t)((lcg >> 16) % GPT_V);
    }
    t = mgpu_tokens_from_memory(tok, N);
    ds = t ? mgpu_dataset_tokens(t, GPT_T) : NULL;
    memset(&ld, 0, sizeof ld);
    ld.batch = batch;
    ld.shuffle = 1;
    ld.seed = 3;
    ld.wrap = 1;
    lw = ds ? mgpu_loader_create(ds, &ld) : NULL;
    ld.shard_for = dm;
    lm = ds ? mgpu_loader_create(ds, &ld) : NULL;
    dopt = mgpu_optimizer_create(dm, &od);
    ropt = ref ? mgpu_optimizer_create(ref, &od) : NULL;
    CHECK(ref && lm && lw && dopt && ropt, "%s: the one-process GPT on %s, loaders, optimizers: %s", what, spec, mgpu_last_error());
    if (!ref || !lm || !lw || !dopt || !ropt) ok = 0;
    if (ok) CHECK(same_params(dm, ref), "%s: rank 0's initial parameters everywhere (each rank seeded its own)", what);
    if (ok) { mgpu_loader_start(lm, 1); mgpu_loader_start(lw, 1); }
    for (s = 0; s < steps && ok; ++s) {
        const mgpu_tensor *x, *y, *wx, *wy;
        mgpu_tensor *ym = NULL, *yw = NULL;
        int64_t from, count;
        if (!mgpu_loader_next(lw, &wx, &wy)) {   /* the epoch's end: the next epoch, in both */
            mgpu_loader_start(lm, s + 2);
            mgpu_loader_start(lw, s + 2);
            if (!mgpu_loader_next(lw, &wx, &wy)) { ok = 0; why = "no batch from the loader of every row"; break; }
        }
        if (!mgpu_loader_next(lm, &x, &y)) { ok = 0; why = "no batch from the loader with shard_for"; break; }
        my_rows(dm, mgpu_tensor_dim(wy, 0), &from, &count);
        if (mgpu_tensor_dim(x, 0) != count ||
            memcmp(mgpu_tensor_data(x), (const int32_t*)mgpu_tensor_data(wx) + from * GPT_T, (size_t)(count * GPT_T) * sizeof(int32_t))) {
            ok = 0;
            why = "the loader with shard_for gave other rows than this rank's of the whole batch";
            break;
        }
        if (ignore) {
            ym = gpt_ignore(y, s, from, mgpu_tensor_dim(wy, 0));
            yw = gpt_ignore(wy, s, 0, mgpu_tensor_dim(wy, 0));
            ok &= ym && yw;
        }
        if (ok && !accumulate) {
            terms_here += gpt_terms(ignore ? ym : y);
            ok &= mgpu_model_train_step(dm, dopt, x, ignore ? ym : y, &dl) == MGPU_OK;
            if (ok) ok &= mgpu_model_train_step(ref, ropt, wx, ignore ? yw : wy, &rl) == MGPU_OK;
            losses &= !ok || dl == rl;
        } else if (ok) {   /* the batch in two halves, each rank with its rows of each half (as train_both) */
            const int64_t B = mgpu_tensor_dim(wy, 0), half = B / 2;
            mgpu_tensor *xa = mgpu_tensor_to(wx, mgpu_device_cpu()), *ya = ignore ? yw : mgpu_tensor_to(wy, mgpu_device_cpu());
            int h;
            for (h = 0; ok && h < 2; ++h) {
                const int64_t at = h ? half : 0, n = h ? B - half : half;
                int64_t f, c;
                mgpu_tensor *hx = mgpu_tensor_view_rows(xa, at, n), *hy = mgpu_tensor_view_rows(ya, at, n), *mx, *my;
                my_rows(dm, n, &f, &c);
                mx = mgpu_tensor_view_rows(hx, f, c);
                my = mgpu_tensor_view_rows(hy, f, c);
                terms_here += gpt_terms(my);
                ok &= mgpu_model_accumulate(dm, mx, my, B, &dl) == MGPU_OK && mgpu_model_accumulate(ref, hx, hy, B, &rl) == MGPU_OK;
                losses &= !ok || dl == rl;
                mgpu_tensor_destroy(mx); mgpu_tensor_destroy(my); mgpu_tensor_destroy(hx); mgpu_tensor_destroy(hy);
            }
            ok = ok && mgpu_model_apply(dm, dopt) == MGPU_OK && mgpu_model_apply(ref, ropt) == MGPU_OK;
            mgpu_tensor_destroy(xa);
            if (!ignore) mgpu_tensor_destroy(ya);
        }
        for (i = 0; ok && i < mgpu_model_replica_count(dm); ++i) {   /* this rank's replicas: the one process's of the same rows */
            float a = -1.0f, b = -2.0f;
            ok &= mgpu_model_replica_loss(dm, i, &a) == MGPU_OK && mgpu_model_replica_loss(ref, mgpu_model_first_replica(dm) + i, &b) == MGPU_OK;
            losses &= a == b;
        }
        if (ok && !same_params(dm, ref) && same) { same = 0; bad_step = s; }
        mgpu_tensor_destroy(ym);
        mgpu_tensor_destroy(yw);
    }
    CHECK(ok, "%s: %d steps on %s: %s", what, steps, mine ? mine : my_spec(), ok ? "" : why ? why : mgpu_last_error());
    CHECK(losses, "%s: the job's loss (%.9g against %.9g at the last step), and each replica's, are the one process's, bit for bit",
          what, dl, rl);
    CHECK(same, "%s, batch %d: the same parameters as one process on %s after every step, bit for bit (first differing "
          "after step %d of 0 to %d; -1: none)", what, batch, spec, bad_step, steps - 1);
    if (ignore) {   /* the labels that count, rank by rank: uneven, or the test tests less than it says */
        mgpu_device_set* cpu = mgpu_device_set_create("cpu");
        mgpu_allreduce* ar = mgpu_allreduce_create_distributed(cpu, MGPU_ALLREDUCE_AUTO);
        mgpu_tensor* per = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(g_size));
        const float* v = (const float*)mgpu_tensor_data(per);
        int uneven = 0;
        mgpu_tensor_zero(per);
        ((float*)mgpu_tensor_data(per))[g_rank] = (float)terms_here;
        CHECK(ar && mgpu_allreduce_sum(ar, &per, 1) == MGPU_OK, "the ranks' counts of labels summed: %s", mgpu_last_error());
        for (i = 1; i < g_size; ++i) uneven |= v[i] != v[0];
        CHECK(uneven && v[g_rank] == (float)terms_here, "%s: the labels that count are spread unevenly: rank 0 %g, rank 1 %g, "
              "this rank (%d) %d", what, v[0], v[1], g_rank, terms_here);
        mgpu_tensor_destroy(per);
        mgpu_allreduce_destroy(ar);
        mgpu_device_set_destroy(cpu);
    }
    CHECK(mgpu_model_verify_replicas(dm) == MGPU_OK, "%s: every replica of every rank the same: %s", what, mgpu_last_error());
    mgpu_loader_destroy(lm);
    mgpu_loader_destroy(lw);
    mgpu_dataset_destroy(ds);
    mgpu_tokens_destroy(t);
    mgpu_optimizer_destroy(dopt); mgpu_optimizer_destroy(ropt);
    mgpu_model_destroy(dm); mgpu_model_destroy(ref);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(all);
}

static void test_gpt(void) {
    const char* one = g_cuda ? "cuda:0" : "cpu";   /* one replica on every rank */
    header("a distributed GPT against one process with all the replicas");
    gpt_both("GPT, SGD", one, sgd(), 2 * g_size + 1, 4, 0, 0);
    gpt_both("GPT, AdamW", one, adamw(), 2 * g_size + 1, 4, 0, 0);
    gpt_both("GPT, AdamW, labels ignored unevenly", one, adamw(), 2 * g_size + 1, 5, 1, 0);
    gpt_both("GPT, SGD, labels ignored unevenly, rank 0 with two replicas", NULL, sgd(), 2 * g_total, 5, 1, 0);
    gpt_both("GPT, AdamW, accumulate + apply, labels ignored unevenly", one, adamw(), 4 * g_size + 1, 4, 1, 1);
}

/* ---- 8. SyncBatchNorm across processes ---- */
/* MGPU_TEST_MPI_SYNC_FAIL=1 (tests/mpi.sh): make_bn's model with (with_fail) an identity layer after the
   first BatchNorm whose backward fails on rank 1. The other ranks then wait, inside their
   backward, for rank 1's SyncBatchNorm numbers: rank 1 must end the job at once with its message
   (mpi.sh checks both), never leave them waiting. Returns only if it did not. */
static mgpu_result fail_on_rank1(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                 const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y;
    if (g_rank == 1) return mgpu_fail(MGPU_ERROR_INVALID_ARGUMENT, "Fail: rank 1's backward fails on purpose");
    return mgpu_tensor_copy(dx, dy);
}
static mgpu_result identity_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)ctx;
    return mgpu_tensor_copy(y, x);
}
static const mgpu_layer_vtable fail_vt = {
    "Fail", NULL, NULL, NULL, NULL, NULL, NULL, identity_forward, fail_on_rank1, NULL, NULL, NULL, NULL
};

/* [3, 2, 2] -> Conv2d(3, 4) -> BatchNorm2d -> ReLU -> Residual(Conv2d -> BatchNorm2d) -> global
   average pooling -> Linear(4, OUT), with desc.sync_batch_norm. */
static mgpu_model* make_bn(const mgpu_device_set* set, int distributed, int with_fail) {
    mgpu_layer *layers[7], *f[2];
    mgpu_model_desc d;
    int n = 0;
    memset(&d, 0, sizeof d);
    f[0] = mgpu_layer_conv2d(4, 4, 3, 1, 1);
    f[1] = mgpu_layer_batch_norm2d(4);
    layers[n++] = mgpu_layer_conv2d(3, 4, 3, 1, 1);
    layers[n++] = mgpu_layer_batch_norm2d(4);
    if (with_fail) layers[n++] = mgpu_layer_create(&fail_vt, NULL);
    layers[n++] = mgpu_layer_relu();
    layers[n++] = mgpu_layer_residual(mgpu_layer_sequential(f, 2), NULL);
    layers[n++] = mgpu_layer_global_avg_pool2d();
    layers[n++] = mgpu_layer_linear(4, OUT);
    d.input = mgpu_shape3(3, 2, 2);
    d.layers = layers;
    d.layer_count = n;
    d.devices = set;
    d.seed = 5;
    d.distributed = distributed;
    d.sync_batch_norm = 1;
    return mgpu_model_create(&d);
}

/* Every parameter and buffer of replica 0 of a and b the same bits. */
static int same_tensors(const mgpu_model* a, const mgpu_model* b) {
    int i, same = mgpu_model_tensor_count(a) == mgpu_model_tensor_count(b);
    for (i = 0; same && i < mgpu_model_tensor_count(a); ++i) {
        const size_t n = (size_t)mgpu_tensor_numel(mgpu_model_tensor(a, 0, i));
        float *ha = (float*)malloc(n * sizeof(float)), *hb = (float*)malloc(n * sizeof(float));
        same = memcmp(host_floats(mgpu_model_tensor(a, 0, i), ha), host_floats(mgpu_model_tensor(b, 0, i), hb),
                      n * sizeof(float)) == 0;
        free(ha);
        free(hb);
    }
    return same;
}

/* The batch statistics of the job's rows on every rank (uneven: rank 0 holds two replicas, and B
   does not divide), against one process with every replica: the same parameters, running
   statistics and losses, bit for bit. */
static void test_sync_bn(void) {
    const int64_t B = 2 * g_total + 1;
    char spec[64];
    mgpu_device_set *set = mgpu_device_set_create(my_spec()), *all;
    mgpu_model *dm = make_bn(set, 1, 0), *ref;
    mgpu_optimizer_desc od = sgd();
    mgpu_optimizer *dopt, *ropt;
    int s, ok = 1, losses = 1;
    header("SyncBatchNorm across processes against one process with all the replicas");
    if (!dm) { CHECK(0, "distributed mgpu_model_create with sync_batch_norm: %s", mgpu_last_error()); mgpu_device_set_destroy(set); return; }
    all_spec(spec, sizeof spec, mgpu_model_total_replica_count(dm));
    all = mgpu_device_set_create(spec);
    ref = make_bn(all, 0, 0);
    dopt = mgpu_optimizer_create(dm, &od);
    ropt = mgpu_optimizer_create(ref, &od);
    for (s = 0; s < 3 && ok; ++s) {
        mgpu_tensor *x, *y, *images, *xs, *ys;
        int64_t from, count;
        float dl = 0.0f, rl = 0.0f;
        make_batch(B, &x, &y);
        images = mgpu_tensor_view_reshape(x, mgpu_shape4(B, 3, 2, 2));
        my_rows(dm, B, &from, &count);
        xs = mgpu_tensor_view_rows(images, from, count);
        ys = mgpu_tensor_view_rows(y, from, count);
        ok &= mgpu_model_train_step(dm, dopt, xs, ys, &dl) == MGPU_OK;
        ok &= mgpu_model_train_step(ref, ropt, images, y, &rl) == MGPU_OK;
        losses &= dl == rl;
        mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys); mgpu_tensor_destroy(images);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    CHECK(ok, "SyncBatchNorm: 3 steps: %s", ok ? "" : mgpu_last_error());
    CHECK(losses, "SyncBatchNorm: the job's loss is the one process's, bit for bit");
    CHECK(same_tensors(dm, ref), "SyncBatchNorm, batch %lld: the same parameters and running statistics as one process on "
          "%s, bit for bit", (long long)B, spec);
    CHECK(mgpu_model_verify_replicas(dm) == MGPU_OK, "SyncBatchNorm: every replica of every rank the same: %s", mgpu_last_error());
    mgpu_optimizer_destroy(dopt); mgpu_optimizer_destroy(ropt);
    mgpu_model_destroy(dm); mgpu_model_destroy(ref);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(all);
}

static int sync_bn_failure(void) {
    mgpu_device_set* set = mgpu_device_set_create(my_spec());
    mgpu_model* m = make_bn(set, 1, 1);
    mgpu_optimizer_desc od = sgd();
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, &od) : NULL;
    mgpu_tensor *x, *y, *images, *xs, *ys;
    int64_t from, count;
    mgpu_result r;
    if (!opt) { printf("FAIL rank %d: model: %s\n", g_rank, mgpu_last_error()); return 1; }
    make_batch(2 * g_total, &x, &y);
    images = mgpu_tensor_view_reshape(x, mgpu_shape4(2 * g_total, 3, 2, 2));
    my_rows(m, 2 * g_total, &from, &count);
    xs = mgpu_tensor_view_rows(images, from, count);
    ys = mgpu_tensor_view_rows(y, from, count);
    r = mgpu_model_train_step(m, opt, xs, ys, NULL);
    printf("FAIL rank %d: the step returned (%s: %s) instead of ending the job\n", g_rank, mgpu_result_string(r), mgpu_last_error());
    return 1;
}

int main(int argc, char** argv) {
    const char* dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    int status;
    if (mgpu_dist_init(&argc, &argv) != MGPU_OK) { printf("mgpu_dist_init: %s\n0 passed, 1 failed, 0 skipped\n", mgpu_last_error()); return 1; }
    g_rank = mgpu_dist_rank();
    g_size = mgpu_dist_size();
    g_total = g_size + 1;
    g_cuda = getenv("MGPU_TEST_MPI_CUDA") && !strcmp(getenv("MGPU_TEST_MPI_CUDA"), "1");
#ifndef MGPU_CUDA
    if (g_cuda) { printf("MGPU_TEST_MPI_CUDA=1 needs a CUDA (or emulated) build\n0 passed, 1 failed, 0 skipped\n"); return 1; }
#endif
    g_state = 42;
    if (getenv("MGPU_TEST_MPI_SYNC_FAIL") && !strcmp(getenv("MGPU_TEST_MPI_SYNC_FAIL"), "1")) return sync_bn_failure();
    test_start("test_mpi");
    test_select(argc, argv);
    TEST_GROUP(test_job());
    if (g_size >= 2) {
        TEST_GROUP(test_allreduce());
        TEST_GROUP(test_equivalence());
        TEST_GROUP(test_failures());
        TEST_GROUP(test_checkpoints(dir));
        TEST_GROUP(test_zero1(dir));
        TEST_GROUP(test_loader(dir));
        TEST_GROUP(test_loader_tokens());
        TEST_GROUP(test_gpt());
        TEST_GROUP(test_sync_bn());
    }
    (void)test_rel_error;   /* test.h's, unused here */
    printf("rank %d ", g_rank);
    status = test_summary("test_mpi");
    mgpu_dist_shutdown();
    return status;
}
