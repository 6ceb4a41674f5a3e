/* tests/emu/test_emu.c - the GPU emulator checks itself, and mgpu answers its injected faults.
   Each case runs in a child process (forked before anything touches the emulator, so each has
   its own devices and environment):
   1. the emulator: shuffles and barriers give hardware's results (selfcheck.cu); launch limits
      are launch errors; a divergent barrier, a shuffle with missing lanes, a deadlock, a copy
      past an allocation's end, a kernel given another device's memory without peer access and
      (MGPU_EMU_RACECHECK) two streams writing one buffer in no order each stop the program with
      a report naming the kernel or the call; captured graphs replay
      what eager work computes, and a capture refuses what CUDA's refuses;
   2. faults: a failed cudaMalloc (mgpu empties its cache and tries again; a second failure is
      mgpu's out-of-memory error, and the next allocation works); a small device (out of
      memory with the sizes in the message); a failed launch (the op's error names it, and the
      next op works); NCCL that loads and works, that is absent, that fails to initialise (mgpu
      falls back to peer-to-peer with a notice); the P2P ring and one-shot across 4 GPUs; no peer
      access (the host-staged path).
   MGPU_EMU_NCCL names the emulated NCCL library (the Makefile passes build/emu/libnccl_emu.so). */
#define _DEFAULT_SOURCE   /* fork, pipe, setenv, strtok_r */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "tests/test.h"
#include "emu.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int selfcheck_run(const char* which);

static char g_log[4096];
static void capture_log(mgpu_log_level level, const char* message, void* user) {
    size_t used = strlen(g_log);
    (void)level;
    (void)user;
    snprintf(g_log + used, sizeof g_log - used, "%s\n", message);
    fprintf(stderr, "log: %s\n", message);
}

/* ---- the cases, each run in its own process: 0 is success ---- */
#define NEED(cond, ...) do { if (!(cond)) { fprintf(stderr, "case failed at line %d: ", __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); return 1; } } while (0)

static int tensor_value_is(mgpu_tensor* t, float want) {
    int64_t n = mgpu_tensor_bytes(t) / 4, i;
    float* h = (float*)xmalloc((size_t)n * 4);
    int ok = mgpu_tensor_download(t, h, (size_t)n * 4) == MGPU_OK;
    for (i = 0; ok && i < n; ++i) ok = h[i] == want;
    free(h);
    return ok;
}

static int case_oom(int second_failure) {
    mgpu_device_set* set = mgpu_device_set_create("cuda:0");
    mgpu_device* dev;
    mgpu_tensor *a, *b, *c;
    NEED(set, "cuda:0: %s", mgpu_last_error());
    dev = mgpu_device_set_get(set, 0);
    a = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(1000));
    NEED(a, "first tensor: %s", mgpu_last_error());
    mgpu_tensor_destroy(a);   /* its block stays in mgpu's cache */
    mgpu_emu_fail_next("malloc", second_failure ? 2 : 1);
    b = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(100000));
    if (!second_failure) {
        NEED(b, "one failed cudaMalloc: mgpu should empty its cache and succeed: %s", mgpu_last_error());
        NEED(mgpu_tensor_fill(b, 2.0) == MGPU_OK && tensor_value_is(b, 2.0f), "the tensor after the retry");
    } else {
        NEED(!b, "two failed cudaMallocs: the tensor was made");
        NEED(mgpu_last_result() == MGPU_ERROR_OUT_OF_MEMORY, "result %s", mgpu_result_string(mgpu_last_result()));
        NEED(strstr(mgpu_last_error(), "out of memory on cuda:0"), "message: %s", mgpu_last_error());
    }
    mgpu_tensor_destroy(b);
    c = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(5000));   /* nothing lost */
    NEED(c && mgpu_tensor_fill(c, 3.0) == MGPU_OK && tensor_value_is(c, 3.0f), "the next tensor: %s", mgpu_last_error());
    mgpu_tensor_destroy(c);
    mgpu_device_set_destroy(set);
    return 0;
}

static int case_small_device(void) {   /* MGPU_EMU_MEMORY=256 (MiB) */
    mgpu_device_set* set = mgpu_device_set_create("cuda:0");
    mgpu_tensor *big, *small;
    NEED(set, "cuda:0: %s", mgpu_last_error());
    big = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1((int64_t)300 << 18));
    NEED(!big && mgpu_last_result() == MGPU_ERROR_OUT_OF_MEMORY, "300 MiB on a 256 MiB device: %s", mgpu_last_error());
    NEED(strstr(mgpu_last_error(), "free on the device"), "message: %s", mgpu_last_error());
    small = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1(1 << 18));
    NEED(small && mgpu_tensor_fill(small, 1.0) == MGPU_OK && tensor_value_is(small, 1.0f), "1 MiB after: %s", mgpu_last_error());
    mgpu_tensor_destroy(small);
    mgpu_device_set_destroy(set);
    return 0;
}

static int case_launch_failure(void) {
    mgpu_device_set* set = mgpu_device_set_create("cuda:0");
    mgpu_tensor* t;
    mgpu_result r;
    NEED(set, "cuda:0: %s", mgpu_last_error());
    t = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1(1000));
    NEED(t, "tensor: %s", mgpu_last_error());
    mgpu_emu_fail_next("launch", 1);
    r = mgpu_tensor_fill(t, 5.0);
    NEED(r != MGPU_OK, "a failed launch reported success");
    NEED(strstr(mgpu_last_error(), "launch of fill") && strstr(mgpu_last_error(), "cudaErrorLaunchOutOfResources"),
         "message: %s", mgpu_last_error());
    NEED(mgpu_tensor_fill(t, 6.0) == MGPU_OK && tensor_value_is(t, 6.0f), "the next fill: %s", mgpu_last_error());
    mgpu_tensor_destroy(t);
    mgpu_device_set_destroy(set);
    return 0;
}

/* an all-reduce over spec asking for `ask`: the backend must be `want`, the sums right (replica i
   holds i + 1 everywhere) */
static int case_allreduce(const char* spec, mgpu_allreduce_kind ask, mgpu_allreduce_kind want, const char* notice) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_allreduce* ar;
    mgpu_tensor* t[8] = {0};
    int i, n;
    mgpu_log_set_callback(capture_log, NULL);
    NEED(set, "%s: %s", spec, mgpu_last_error());
    n = mgpu_device_set_count(set);
    NEED(n >= 1 && n <= 8, "%d devices", n);
    ar = mgpu_allreduce_create(set, ask);
    NEED(ar, "allreduce_create: %s", mgpu_last_error());
    NEED(mgpu_allreduce_backend(ar) == want, "backend %s, want %s", mgpu_allreduce_name(mgpu_allreduce_backend(ar)),
         mgpu_allreduce_name(want));
    NEED(!notice || strstr(g_log, notice), "no notice with \"%s\" (log: %s)", notice, g_log);
    for (i = 0; i < n; ++i) {   /* 300001 floats: above the one-shot's 256 KiB across GPUs */
        t[i] = mgpu_tensor_create(mgpu_device_set_get(set, i), MGPU_F32, mgpu_shape1(300001));
        NEED(t[i] && mgpu_tensor_fill(t[i], i + 1.0) == MGPU_OK, "tensor %d: %s", i, mgpu_last_error());
    }
    NEED(mgpu_allreduce_sum(ar, t, n) == MGPU_OK, "all-reduce: %s", mgpu_last_error());
    for (i = 0; i < n; ++i) NEED(tensor_value_is(t[i], (float)(n * (n + 1) / 2)), "replica %d holds the wrong sum", i);
    for (i = 0; i < n; ++i) mgpu_tensor_destroy(t[i]);
    mgpu_allreduce_destroy(ar);
    mgpu_device_set_destroy(set);
    return 0;
}

/* The ring where some neighbours reach each other and some do not (MGPU_EMU_NO_PEER=1 on
   cuda:0,0,1,1: replicas 1 and 3 read their predecessor on their own GPU, 0 and 2 cannot, their
   chunks go through the host): the sum, and the memory it says it moves, 5 or 7 times (R - 1)
   b/R per replica. The kernels' pointer checks catch an add that reads a GPU out of reach. */
static int case_ring_mixed_reach(void) {
    const size_t bytes = (size_t)300001 * sizeof(float);
    mgpu_device_set* set = mgpu_device_set_create("cuda:0,0,1,1");
    mgpu_allreduce* ar;
    double traffic, want = (2.0 * 5.0 + 2.0 * 7.0) * 3.0 * (double)bytes / 4.0;
    NEED(set, "cuda:0,0,1,1: %s", mgpu_last_error());
    ar = mgpu_allreduce_create(set, MGPU_ALLREDUCE_P2P);
    NEED(ar && !strcmp(mgpu_allreduce_algorithm(ar, bytes), "ring"), "the ring: %s", ar ? mgpu_allreduce_algorithm(ar, bytes) : mgpu_last_error());
    traffic = mgpu_allreduce_memory_traffic(ar, bytes);
    NEED(traffic == want, "memory traffic %.0f bytes, want %.0f", traffic, want);
    mgpu_allreduce_destroy(ar);
    mgpu_device_set_destroy(set);
    return case_allreduce("cuda:0,0,1,1", MGPU_ALLREDUCE_P2P, MGPU_ALLREDUCE_P2P, NULL);
}

/* A training step queues its work and returns: no host synchronisation inside it, in any layout
   (the batch's rows go to the other GPUs, and activations between stages, ordered by events).
   And mgpu_tensor_copy between two GPUs keeps stream order both ways: src overwritten right after
   the copy, dst still receives the old values (with MGPU_EMU_CHAOS, a missing wait shows). */
static int case_no_host_sync(void) {
    static const struct { const char* spec; int stages; } layouts[] = {{"cuda:0,1,2,3", 1}, {"cuda:0,1", 2}, {"cuda:0,1,2,3", 2}};
    size_t li;
    int i;
    for (li = 0; li < sizeof layouts / sizeof layouts[0]; ++li) {
        mgpu_device_set* set = mgpu_device_set_create(layouts[li].spec);
        mgpu_layer* layers[3];
        mgpu_model_desc md;
        mgpu_optimizer_desc od;
        mgpu_model* m;
        mgpu_optimizer* opt;
        mgpu_tensor *x, *y;
        mgpu_emu_counters before, after;
        NEED(set, "%s: %s", layouts[li].spec, mgpu_last_error());
        layers[0] = mgpu_layer_linear(20, 16);
        layers[1] = mgpu_layer_relu();
        layers[2] = mgpu_layer_linear(16, 4);
        memset(&md, 0, sizeof md);
        md.input = mgpu_shape1(20);
        md.layers = layers;
        md.layer_count = 3;
        md.devices = set;
        md.stages = layouts[li].stages;
        md.micro_batches = 4;
        m = mgpu_model_create(&md);
        NEED(m, "model on %s: %s", layouts[li].spec, mgpu_last_error());
        memset(&od, 0, sizeof od);
        od.lr = 0.1f;
        opt = mgpu_optimizer_create(m, &od);
        x = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape2(32, 20));
        y = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_I32, mgpu_shape1(32));
        NEED(opt && x && y && mgpu_rand_normal(x, 1, 0, 0.0f, 1.0f) == MGPU_OK && mgpu_tensor_fill(y, 2.0) == MGPU_OK, "%s",
             mgpu_last_error());
        NEED(mgpu_model_train_step(m, opt, x, y, NULL) == MGPU_OK, "warm-up step: %s", mgpu_last_error());
        for (i = 0; i < mgpu_device_set_count(set); ++i) NEED(mgpu_device_synchronize(mgpu_device_set_get(set, i)) == MGPU_OK, "sync");
        mgpu_emu_get_counters(&before);
        for (i = 0; i < 3; ++i) NEED(mgpu_model_train_step(m, opt, x, y, NULL) == MGPU_OK, "step: %s", mgpu_last_error());
        mgpu_emu_get_counters(&after);
        NEED(after.syncs == before.syncs, "%s, %d stages: %llu host synchronisations in 3 steps", layouts[li].spec,
             layouts[li].stages, (unsigned long long)(after.syncs - before.syncs));
        NEED(mgpu_model_verify_replicas(m) == MGPU_OK, "%s: %s", layouts[li].spec, mgpu_last_error());
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
        mgpu_device_set_destroy(set);
    }
    {   /* the copy's order, both ways, on two GPUs and on two streams of one */
        static const char* specs[] = {"cuda:0,1", "cuda:0,0"};
        for (li = 0; li < 2; ++li) {
            mgpu_device_set* set = mgpu_device_set_create(specs[li]);
            mgpu_tensor *src, *dst;
            NEED(set, "%s: %s", specs[li], mgpu_last_error());
            src = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1(300001));
            dst = mgpu_tensor_create(mgpu_device_set_get(set, 1), MGPU_F32, mgpu_shape1(300001));
            NEED(src && dst && mgpu_tensor_fill(dst, 0.0) == MGPU_OK, "%s", mgpu_last_error());
            for (i = 0; i < 4; ++i) {
                NEED(mgpu_tensor_fill(src, i + 1.0) == MGPU_OK && mgpu_tensor_copy(dst, src) == MGPU_OK &&
                     mgpu_tensor_fill(src, -1.0) == MGPU_OK, "%s", mgpu_last_error());
                NEED(tensor_value_is(dst, (float)(i + 1)), "%s, round %d: the copy saw src too early or too late", specs[li], i);
            }
            mgpu_tensor_destroy(src);
            mgpu_tensor_destroy(dst);
            mgpu_device_set_destroy(set);
        }
    }
    return 0;
}

/* Steps fed by mgpu_loader from the CPU: a small data set of 6x6 images and 4 classes, made here,
   on a layout (spec, stages), with an MLP or a small CNN, SGD with momentum or AdamW on a cosine
   schedule, op by op or as a CUDA graph. */
typedef struct fed_cfg {
    const char* spec;
    int stages, cnn, adamw, graph, dropout;
    int64_t samples;   /* 320 (10 batches of 32) by default; 330 ends each epoch with 10 rows */
} fed_cfg;

static mgpu_optimizer* fed_optimizer(mgpu_model* m, int adamw);

typedef struct fed_run {
    mgpu_device_set* set;
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_dataset ds;
    mgpu_loader* loader;
} fed_run;

static int fed_open(fed_run* f, const fed_cfg* c) {
    mgpu_layer* layers[8];
    mgpu_model_desc md;
    mgpu_loader_desc ld;
    int n = 0;
    int64_t i;
    memset(f, 0, sizeof *f);
    f->ds.count = c->samples ? c->samples : 320;
    f->ds.rows = 6;
    f->ds.cols = 6;
    f->ds.images = (uint8_t*)xmalloc((size_t)f->ds.count * 36);
    f->ds.labels = (uint8_t*)xmalloc((size_t)f->ds.count);
    for (i = 0; i < f->ds.count * 36; ++i) f->ds.images[i] = (uint8_t)((i * 2654435761u) >> 24);
    for (i = 0; i < f->ds.count; ++i) f->ds.labels[i] = (uint8_t)((i * 7 + f->ds.images[i * 36]) % 4);
    f->set = mgpu_device_set_create(c->spec);
    NEED(f->set, "%s: %s", c->spec, mgpu_last_error());
    if (c->cnn) {
        layers[n++] = mgpu_layer_conv2d(1, 3, 3, 1, 1);
        layers[n++] = mgpu_layer_relu();
        layers[n++] = mgpu_layer_maxpool2d(2, 0);
        layers[n++] = mgpu_layer_flatten();
        layers[n++] = mgpu_layer_linear(27, 4);
    } else {
        layers[n++] = mgpu_layer_flatten();
        layers[n++] = mgpu_layer_linear(36, 16);
        layers[n++] = mgpu_layer_relu();
        if (c->dropout) layers[n++] = mgpu_layer_dropout(0.25f);
        layers[n++] = mgpu_layer_linear(16, 4);
    }
    memset(&md, 0, sizeof md);
    md.input = mgpu_shape3(1, 6, 6);
    md.layers = layers;
    md.layer_count = n;
    md.devices = f->set;
    md.stages = c->stages;
    md.micro_batches = c->stages > 1 ? 2 : 1;
    md.seed = 5;
    md.allreduce = MGPU_ALLREDUCE_P2P;   /* (a graph does not hold NCCL across GPUs of one process) */
    md.graph = c->graph;
    f->m = mgpu_model_create(&md);
    NEED(f->m, "model on %s: %s", c->spec, mgpu_last_error());
    f->opt = fed_optimizer(f->m, c->adamw);
    memset(&ld, 0, sizeof ld);
    ld.batch = 32;
    ld.shuffle = 1;
    f->loader = mgpu_loader_create(&f->ds, &ld);
    NEED(f->opt && f->loader, "%s", mgpu_last_error());
    return 0;
}

static mgpu_optimizer* fed_optimizer(mgpu_model* m, int adamw) {
    mgpu_optimizer_desc od;
    memset(&od, 0, sizeof od);
    if (adamw) {
        od.kind = MGPU_ADAMW;
        od.lr = 0.01f;
        od.weight_decay = 0.01f;
        od.schedule = MGPU_SCHEDULE_COSINE;   /* a new learning rate every step */
        od.total_steps = 300;
    } else {
        od.lr = 0.05f;
        od.momentum = 0.9f;
        od.nesterov = 1;
    }
    return mgpu_optimizer_create(m, &od);
}

static void fed_close(fed_run* f) {
    mgpu_loader_destroy(f->loader);
    mgpu_optimizer_destroy(f->opt);
    mgpu_model_destroy(f->m);
    mgpu_device_set_destroy(f->set);
    free(f->ds.images);
    free(f->ds.labels);
}

static int fed_step(fed_run* f, float* loss) {
    const mgpu_tensor *x, *y;
    if (!mgpu_loader_next(f->loader, &x, &y)) {
        mgpu_loader_start(f->loader, 1);
        NEED(mgpu_loader_next(f->loader, &x, &y), "no batch");
    }
    NEED(mgpu_model_train_step(f->m, f->opt, x, y, loss) == MGPU_OK, "step: %s", mgpu_last_error());
    return 0;
}

static int sync_all(mgpu_device_set* set) {
    int i;
    for (i = 0; i < mgpu_device_set_count(set); ++i)
        NEED(mgpu_device_synchronize(mgpu_device_set_get(set, i)) == MGPU_OK, "sync: %s", mgpu_last_error());
    return 0;
}

static void stall(void* ms) { usleep((useconds_t)(uintptr_t)ms * 1000); }
/* Every device of set stops for `ms` milliseconds, at this point of its stream. */
static void stall_devices(mgpu_device_set* set, int ms) {
    int i;
    for (i = 0; i < mgpu_device_set_count(set); ++i)
        (void)mgpu_emu_enqueue(mgpu_device_set_get(set, i)->stream, stall, (void*)(uintptr_t)ms, NULL, "the test's stall");
}

/* Batches from the CPU go up without the host waiting, and the loss stays on the device until
   asked for. Per step, with the devices idle at its start (as when the host is the slower side),
   no host synchronisation or cudaGetDevice, at most two copies from the host per device (the
   batch's rows with their labels; the optimizer's numbers), and with one stage cudaSetDevice at
   most 2 x devices - 1 times (and the P2P ring's); the loss read (mgpu_model_last_loss) waits, and gives what a step
   given a loss pointer gives. Then 30 steps back to back, the host far ahead of the devices (each
   stalled for 0.1 s every 10 steps): the staging buffers are refilled only after their copies
   have read them, so the parameters are those of the same steps run one at a time. */
static int case_fed_steps(const char* spec, int stages) {
    fed_cfg c = {spec, stages, 0, 0, 0, 0, 0};
    fed_run a, b;
    float la = 0.0f, lb = 0.0f;
    int i, parts, ring_steps;
    mgpu_emu_counters before, after;
    float *pa, *pb;
    if (fed_open(&a, &c) || fed_open(&b, &c)) return 1;
    parts = mgpu_device_set_count(a.set);
    /* one host thread queues it all: each device is made current for its replica's forward and
       backward, then again for the update (the sums must be queued after every replica's
       backward); a P2P ring's reduce-scatter adds a kernel on every device at each of its steps */
    ring_steps = parts > 1 && a.m->ar[0]->kind == MGPU_ALLREDUCE_P2P && !mgpu__ar_oneshot_fits(a.m->ar[0], 4 * (size_t)a.m->part[0].grads->shape.dim[0])
                     ? parts * (parts - 1) : 0;
    NEED(mgpu_model_last_loss(a.m, &la) == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), "no batch"),
         "last_loss before any step: %s", mgpu_last_error());
    for (i = 0; i < 2; ++i) if (fed_step(&a, NULL) || fed_step(&b, NULL)) return 1;   /* warm-up: every buffer made */
    for (i = 0; i < 10; ++i) {
        if (sync_all(a.set)) return 1;
        mgpu_emu_get_counters(&before);
        if (fed_step(&a, NULL)) return 1;
        mgpu_emu_get_counters(&after);
        NEED(after.syncs == before.syncs, "%s, %d stages: step %d waited for the devices %llu times", spec, stages, i,
             (unsigned long long)(after.syncs - before.syncs));
        NEED(after.get_device == before.get_device && after.copies_h2d - before.copies_h2d <= (uint64_t)(2 * parts),
             "%s, %d stages: %llu cudaGetDevice calls and %llu copies from the host for %d devices in a step", spec, stages,
             (unsigned long long)(after.get_device - before.get_device), (unsigned long long)(after.copies_h2d - before.copies_h2d), parts);
        NEED(stages > 1 || after.set_device - before.set_device <= (uint64_t)(2 * parts - 1 + ring_steps),
             "%s: %llu cudaSetDevice calls in a step (want at most %d)", spec, (unsigned long long)(after.set_device - before.set_device),
             2 * parts - 1 + ring_steps);
        if (fed_step(&b, &lb)) return 1;
    }
    mgpu_emu_get_counters(&before);
    NEED(mgpu_model_last_loss(a.m, &la) == MGPU_OK, "last_loss: %s", mgpu_last_error());
    mgpu_emu_get_counters(&after);
    NEED(after.syncs > before.syncs, "the loss was read without waiting for the devices");
    NEED(la == lb && la > 0.0f, "%s: the last step's loss %.9g, the step's own %.9g", spec, (double)la, (double)lb);
    {   /* an evaluation of many chunks waits only when it reads the replicas' results back: one
           download each (a copy to pageable memory, which waits, and the stream's wait) */
        mgpu_tensor *x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(2100, 1, 6, 6));
        mgpu_tensor *y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(2100));
        int64_t hits_a = -1, hits_b = -1;
        NEED(x && y && mgpu_rand_normal(x, 5, 0, 0.0f, 1.0f) == MGPU_OK && mgpu_tensor_fill(y, 2.0) == MGPU_OK, "%s", mgpu_last_error());
        NEED(sync_all(a.set) == 0, "sync");
        mgpu_emu_get_counters(&before);
        NEED(mgpu_model_evaluate(a.m, x, y, &la, &hits_a) == MGPU_OK, "evaluate: %s", mgpu_last_error());
        mgpu_emu_get_counters(&after);
        NEED(after.syncs - before.syncs <= (uint64_t)(2 * parts / stages), "%s: an evaluation of %d chunks waited %llu times", spec,
             (int)((2100 + 512 * (parts / stages) - 1) / (512 * (parts / stages))), (unsigned long long)(after.syncs - before.syncs));
        NEED(mgpu_model_evaluate(b.m, x, y, &lb, &hits_b) == MGPU_OK && la == lb && hits_a == hits_b && hits_a >= 0,
             "%s: evaluations of the same parameters: loss %.9g, %lld correct; loss %.9g, %lld correct", spec, (double)la,
             (long long)hits_a, (double)lb, (long long)hits_b);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
    }
    for (i = 0; i < 30; ++i) {
        if (i % 10 == 0) stall_devices(a.set, 100);   /* the host gets well ahead */
        if (fed_step(&a, NULL)) return 1;
        if (sync_all(b.set) || fed_step(&b, NULL)) return 1;
    }
    for (i = 0; i < stages; ++i) {
        mgpu_tensor *ta = mgpu_model_stage_params(a.m, 0, i), *tb = mgpu_model_stage_params(b.m, 0, i);
        pa = (float*)xmalloc(mgpu_tensor_bytes(ta));
        pb = (float*)xmalloc(mgpu_tensor_bytes(ta));
        NEED(mgpu_tensor_download(ta, pa, mgpu_tensor_bytes(ta)) == MGPU_OK && mgpu_tensor_download(tb, pb, mgpu_tensor_bytes(tb)) == MGPU_OK,
             "%s", mgpu_last_error());
        NEED(memcmp(pa, pb, mgpu_tensor_bytes(ta)) == 0, "%s, %d stages: steps back to back differ from steps one at a time "
             "(stage %d): a staging buffer refilled before its copy read it?", spec, stages, i);
        free(pa);
        free(pb);
    }
    NEED(mgpu_model_verify_replicas(a.m) == MGPU_OK, "%s", mgpu_last_error());
    fed_close(&a);
    fed_close(&b);
    return 0;
}

/* The first stage's parameters of two runs, bit for bit. */
static int same_params(fed_run* a, fed_run* b, int stages, const char* what) {
    int s;
    for (s = 0; s < stages; ++s) {
        mgpu_tensor *ta = mgpu_model_stage_params(a->m, 0, s), *tb = mgpu_model_stage_params(b->m, 0, s);
        float* pa = (float*)xmalloc(mgpu_tensor_bytes(ta));
        float* pb = (float*)xmalloc(mgpu_tensor_bytes(ta));
        int same = mgpu_tensor_download(ta, pa, mgpu_tensor_bytes(ta)) == MGPU_OK &&
                   mgpu_tensor_download(tb, pb, mgpu_tensor_bytes(tb)) == MGPU_OK && memcmp(pa, pb, mgpu_tensor_bytes(ta)) == 0;
        free(pa);
        free(pb);
        NEED(same, "%s: stage %d's parameters differ (%s)", what, s, mgpu_last_error());
    }
    return 0;
}

/* An evaluation of 7 rows on both runs: it resizes the buffers of the steps (the old ones go back
   to the allocator's cache). Then tensors of the old buffers' sizes are made on the graph run's
   first device, taking those blocks back: a graph replayed on the buffers of its capture would
   write into them. They must keep their 7s until `stray` is checked. */
static int evaluate_between(fed_run* a, fed_run* b, mgpu_tensor** stray, int* strays) {
    mgpu_tensor *x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(7, 1, 6, 6));
    mgpu_tensor *y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(7));
    const mgpu__slot* sl = &b->m->part[0].slot[0];
    size_t sizes[32];
    float la, lb;
    int l, n = 0;
    for (l = 0; l < b->m->stage_layer[1] && n < 30; ++l) {
        sizes[n++] = mgpu_tensor_bytes(sl->act[l]);
        if (sl->dact[l]) sizes[n++] = mgpu_tensor_bytes(sl->dact[l]);
    }
    NEED(x && y && mgpu_rand_normal(x, 11, 0, 0.0f, 1.0f) == MGPU_OK && mgpu_tensor_fill(y, 1.0) == MGPU_OK, "%s", mgpu_last_error());
    NEED(mgpu_model_evaluate(a->m, x, y, &la, NULL) == MGPU_OK && mgpu_model_evaluate(b->m, x, y, &lb, NULL) == MGPU_OK, "%s",
         mgpu_last_error());
    NEED(la == lb, "evaluation: %.9g op by op, %.9g with a graph", (double)la, (double)lb);
    for (*strays = 0; *strays < n; ++*strays) {
        stray[*strays] = mgpu_tensor_create(mgpu_model_device(b->m, 0), MGPU_F32, mgpu_shape1((int64_t)(sizes[*strays] / 4)));
        NEED(stray[*strays] && mgpu_tensor_fill(stray[*strays], 7.0) == MGPU_OK, "%s", mgpu_last_error());
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    return 0;
}

/* A training step as a CUDA graph gives the bits of the eager step: 300 steps of each, the last
   batch of every epoch smaller (its step runs eagerly, the graph is made again after), an
   evaluation on another batch shape every 100 steps (the graph is made again too), the other
   optimizer from step 200 on, the loss of every 10th step equal too. The graph is really used: most steps replay it, and a replayed
   step asks the host for one graph launch, its input copy (the rows and their labels together),
   the optimizer's numbers and Dropout's key (one copy per device each), at most one cudaSetDevice
   per device, and no kernel, GEMM, synchronisation or cudaGetDevice. */
static int case_graph_steps(const char* spec, int stages, int cnn, int adamw, int dropout) {
    fed_cfg c = {spec, stages, cnn, adamw, 0, dropout, 330};
    fed_run a, b;
    char what[160];
    int i, k, parts, checked = 0, strays = 0;
    float la, lb;
    mgpu_tensor* stray[32];
    snprintf(what, sizeof what, "%s, %d stage%s, %s%s, %s", spec, stages, stages > 1 ? "s" : "", cnn ? "CNN" : "MLP",
             dropout ? " with Dropout" : "", adamw ? "AdamW, cosine" : "SGD, Nesterov");
    if (fed_open(&a, &c)) return 1;
    c.graph = 1;
    if (fed_open(&b, &c)) return 1;
    parts = mgpu_device_set_count(b.set);
    for (i = 0; i < 300; ++i) {
        const int read = i % 10 == 9;
        mgpu_emu_counters before, after;
        const int64_t replays = mgpu_model_graph_steps(b.m);
        if (fed_step(&a, read ? &la : NULL)) return 1;
        if (sync_all(b.set)) return 1;
        mgpu_emu_get_counters(&before);
        if (fed_step(&b, NULL)) return 1;
        mgpu_emu_get_counters(&after);
        if (mgpu_model_graph_steps(b.m) > replays && after.captures == before.captures) {
            /* a replay of a graph captured before */
            NEED(after.graph_launches - before.graph_launches == 1 && after.launches == before.launches &&
                 after.gemms == before.gemms && after.syncs == before.syncs, "%s, step %d: %llu graph launches, %llu kernels, "
                 "%llu GEMMs, %llu synchronisations", what, i, (unsigned long long)(after.graph_launches - before.graph_launches),
                 (unsigned long long)(after.launches - before.launches), (unsigned long long)(after.gemms - before.gemms),
                 (unsigned long long)(after.syncs - before.syncs));
            NEED(after.copies_h2d - before.copies_h2d <= (uint64_t)((dropout ? 3 : 2) * parts), "%s: %llu copies from the host for %d devices",
                 what, (unsigned long long)(after.copies_h2d - before.copies_h2d), parts);
            NEED(after.set_device - before.set_device <= (uint64_t)parts && after.get_device == before.get_device,
                 "%s: %llu cudaSetDevice and %llu cudaGetDevice calls for %d devices", what,
                 (unsigned long long)(after.set_device - before.set_device), (unsigned long long)(after.get_device - before.get_device), parts);
            NEED(after.copies_d2h == before.copies_d2h && after.copies_peer == before.copies_peer && after.copies_d2d == before.copies_d2d,
                 "%s: device copies outside the graph", what);
            checked++;
        }
        if (read) {
            NEED(mgpu_model_last_loss(b.m, &lb) == MGPU_OK, "%s", mgpu_last_error());
            NEED(la == lb, "%s, step %d: loss %.9g op by op, %.9g from the graph", what, i, (double)la, (double)lb);
        }
        if (i % 100 == 50 && evaluate_between(&a, &b, stray, &strays)) return 1;
        if (i == 200) {   /* the other optimizer from here on (malloc may give it the old one's address) */
            mgpu_optimizer_destroy(a.opt);
            mgpu_optimizer_destroy(b.opt);
            a.opt = fed_optimizer(a.m, !adamw);
            b.opt = fed_optimizer(b.m, !adamw);
            NEED(a.opt && b.opt, "%s", mgpu_last_error());
        }
        if (i % 100 == 60) {
            for (k = 0; k < strays; ++k) {
                NEED(tensor_value_is(stray[k], 7.0f), "%s, step %d: a tensor made after an evaluation was overwritten by "
                     "the graph's steps (a replay on buffers that moved)", what, i);
                mgpu_tensor_destroy(stray[k]);
            }
            strays = 0;
        }
    }
    NEED(mgpu_model_graph_steps(b.m) >= 200 && checked > 100, "%s: only %lld of 300 steps replayed a graph (%d checked)", what,
         (long long)mgpu_model_graph_steps(b.m), checked);
    NEED(mgpu_optimizer_step_count(a.opt) == mgpu_optimizer_step_count(b.opt) && mgpu_optimizer_lr(a.opt) == mgpu_optimizer_lr(b.opt),
         "%s: the optimizers' step counts differ", what);
    if (same_params(&a, &b, stages, what)) return 1;
    NEED(mgpu_model_verify_replicas(b.m) == MGPU_OK, "%s: %s", what, mgpu_last_error());
    fed_close(&a);
    fed_close(&b);
    return 0;
}

/* A CUDA graph's capture that fails (cudaStreamBeginCapture refuses, `failures` times in a row):
   the notice says why; the step and the next 10 run eagerly and the capture is tried again, until
   the third failure turns graphs off for good (a warning). The steps' bits are the eager run's. */
static int case_graph_retry(int failures) {
    fed_cfg c = {"cuda:0", 1, 0, 0, 0, 0, 320};
    fed_run a, b;
    char what[64];
    const int steps = 40;
    const int64_t want = failures >= 3 ? 0 : steps - (1 + 11 * failures);   /* warm-up, then each failure and its 10 */
    int i;
    snprintf(what, sizeof what, "graph capture failing %d times", failures);
    mgpu_log_set_callback(capture_log, NULL);
    if (fed_open(&a, &c)) return 1;
    c.graph = 1;
    if (fed_open(&b, &c)) return 1;
    mgpu_emu_fail_next("capture", failures);
    for (i = 0; i < steps; ++i)
        if (fed_step(&a, NULL) || fed_step(&b, NULL)) return 1;
    NEED(strstr(g_log, "cudaErrorStreamCaptureUnsupported"), "%s: no notice saying why (log: %s)", what, g_log);
    NEED(failures >= 3 ? strstr(g_log, "without a CUDA graph from now on") != NULL : strstr(g_log, "tried again") != NULL,
         "%s: the notice (log: %s)", what, g_log);
    NEED(mgpu_model_graph_steps(b.m) == want, "%s: %lld of %d steps replayed a graph, want %lld", what,
         (long long)mgpu_model_graph_steps(b.m), steps, (long long)want);
    if (same_params(&a, &b, 1, what)) return 1;
    fed_close(&a);
    fed_close(&b);
    return 0;
}

/* MGPU_EMU_DEVICES=0: no GPU. auto falls back to the CPU; cuda is refused with no-device. */
static int case_no_gpu(void) {
    mgpu_device_set* set;
    NEED(mgpu_cuda_device_count() == 0, "%d GPUs", mgpu_cuda_device_count());
    set = mgpu_device_set_create("auto");
    NEED(set && mgpu_device_set_count(set) == 1 && mgpu_device_kind_of(mgpu_device_set_get(set, 0)) == MGPU_DEVICE_CPU,
         "auto without a GPU: %s", set ? mgpu_device_set_spec(set) : mgpu_last_error());
    mgpu_device_set_destroy(set);
    set = mgpu_device_set_create("cuda");
    NEED(!set && mgpu_last_result() == MGPU_ERROR_NO_DEVICE, "cuda without a GPU: %s", mgpu_last_error());
    return 0;
}

/* The emulator's settings (issue 37): its copy of mgpu.h's parser agrees with the header's on
   every form (the same value used, the same warning), and two values that used to go wrong now
   work: MGPU_EMU_DEVICES=abc (0 devices, silently) is the default 1 with a warning, and
   MGPU_EMU_STACK_KIB=0 (a kernel's stack of 0 bytes: a segfault) is the least stack, 64 KiB. */
static const char* const setting_forms[] = {
    "5", " 5 ", "\t7\n", "0", "1e1", "2.5", "abc", "5x", "0x10", "-3", "1e3", "1e999", "inf", "nan", "", "   ",
    "1", "true", "FALSE", "On", " off ", "yes", "No", "2", "maybe" };
/* what one parser printed on stderr while it read the variable, without its prefix */
static double read_setting(int emu, int flag, const char* name, char* err, size_t size) {
    FILE* f = tmpfile();
    const int saved = dup(2);
    size_t got;
    double v;
    fflush(stderr);
    if (f) dup2(fileno(f), 2);
    if (flag > 0) v = emu ? mgpu_emu_setting_flag(name, 0) : mgpu__setting_flag(name, 0);
    else if (emu) v = mgpu_emu_setting_number(name, 0, 100, 42, flag < 0, "things");
    else v = mgpu__setting_read_number(name, 0, 100, 42, flag < 0, "things");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    err[0] = 0;
    if (f) {
        rewind(f);
        got = fread(err, 1, size - 1, f);
        err[got] = 0;
        fclose(f);
    }
    return v;
}
static int case_settings_agree(void) {
    size_t i;
    int kind, row = 0;
    for (kind = -1; kind <= 1; ++kind)   /* whole numbers, numbers, flags */
        for (i = 0; i < sizeof setting_forms / sizeof setting_forms[0]; ++i) {
            char name[64], a[1024], b[1024];
            const char *pa, *pb;
            double va, vb;
            snprintf(name, sizeof name, "MGPU_EMU_TEST_SETTING_%d", row++);   /* a fresh name: no warning given yet */
            setenv(name, setting_forms[i], 1);
            va = read_setting(0, kind, name, a, sizeof a);
            vb = read_setting(1, kind, name, b, sizeof b);
            pa = strncmp(a, "mgpu: ", 6) == 0 ? a + 6 : a;
            pb = strncmp(b, "mgpu-emu: ", 10) == 0 ? b + 10 : b;
            NEED(va == vb && strcmp(pa, pb) == 0 && (pa == a) == (pb == b),
                 "%s '%s' (%s): mgpu.h uses %g and says '%s', the emulator %g and '%s'", name, setting_forms[i],
                 kind < 0 ? "whole" : kind ? "flag" : "number", va, a, vb, b);
        }
    return 0;
}
static int case_settings_fixed(void) {
    mgpu_device_set* set = mgpu_device_set_create("cuda");
    mgpu_tensor* t;
    NEED(mgpu_cuda_device_count() == 1 && set && mgpu_device_set_count(set) == 1, "MGPU_EMU_DEVICES=abc: %d GPUs (%s), want 1",
         mgpu_cuda_device_count(), set ? mgpu_device_set_spec(set) : mgpu_last_error());
    t = mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape1(1000));   /* kernels on the least stack */
    NEED(t && mgpu_tensor_fill(t, 2.0) == MGPU_OK && tensor_value_is(t, 2.0f), "a kernel with MGPU_EMU_STACK_KIB=0: %s",
         mgpu_last_error());
    mgpu_tensor_destroy(t);
    mgpu_device_set_destroy(set);
    return 0;
}

/* 130 replicas on one GPU: the resolved spec is whole, 264 bytes (it was cut to 244; 256 replicas,
   the most a set has, take the emulator 30 s to make); 257 are refused with the limit. */
static int case_long_spec(void) {
    char spec[1100];
    mgpu_device_set* set;
    int i;
    strcpy(spec, "cuda:0");
    for (i = 1; i < 130; ++i) strcat(spec, ",0");
    set = mgpu_device_set_create(spec);
    NEED(set && mgpu_device_set_count(set) == 130 && !strcmp(mgpu_device_set_spec(set), spec), "130 replicas: %s",
         set ? mgpu_device_set_spec(set) : mgpu_last_error());
    mgpu_device_set_destroy(set);
    for (i = 130; i < 257; ++i) strcat(spec, ",0");
    set = mgpu_device_set_create(spec);
    NEED(!set && strstr(mgpu_last_error(), "more than 256 devices"), "257 replicas: %s", mgpu_last_error());
    return 0;
}

static int run_case(const char* name) {
    if (!strcmp(name, "long spec")) return case_long_spec();
    if (!strcmp(name, "settings agree")) return case_settings_agree();
    if (!strcmp(name, "settings fixed")) return case_settings_fixed();
    if (!strcmp(name, "no gpu")) return case_no_gpu();
    if (!strncmp(name, "selfcheck:", 10)) return selfcheck_run(name + 10);
    if (!strcmp(name, "oom retry")) return case_oom(0);
    if (!strcmp(name, "oom")) return case_oom(1);
    if (!strcmp(name, "small device")) return case_small_device();
    if (!strcmp(name, "launch failure")) return case_launch_failure();
    if (!strcmp(name, "nccl")) return case_allreduce("cuda:0,1,2,3", MGPU_ALLREDUCE_NCCL, MGPU_ALLREDUCE_NCCL, NULL);
    if (!strcmp(name, "nccl absent")) {   /* the notice names the library tried (NO_NCCL's) and dlopen's reason */
        NEED(case_allreduce("cuda:0,1", MGPU_ALLREDUCE_NCCL, MGPU_ALLREDUCE_P2P, "could not be loaded") == 0, "nccl absent");
        NEED(strstr(g_log, "\"/nonexistent/libnccl.so.2\", from MGPU_NCCL_LIBRARY") && strstr(g_log, "No such file"),
             "the notice lacks the library tried or dlopen's reason: %s", g_log);
        return 0;
    }
    if (!strcmp(name, "nccl init fails"))
        return case_allreduce("cuda:0,1", MGPU_ALLREDUCE_NCCL, MGPU_ALLREDUCE_P2P, "NCCL initialisation failed");
    if (!strcmp(name, "no host sync")) return case_no_host_sync();
    if (!strncmp(name, "graph retry: ", 13)) return case_graph_retry(atoi(name + 13));
    if (!strcmp(name, "fed steps: 1 gpu")) return case_fed_steps("cuda:0", 1);
    if (!strcmp(name, "fed steps: 4 gpus")) return case_fed_steps("cuda:0,1,2,3", 1);
    if (!strcmp(name, "fed steps: 2 x 2 pipeline")) return case_fed_steps("cuda:0,1,2,3", 2);
    if (!strncmp(name, "graph: ", 7)) {   /* "graph: SPEC STAGES CNN ADAMW DROPOUT" */
        char spec[64];
        int stages, cnn, adamw, dropout;
        if (sscanf(name + 7, "%63s %d %d %d %d", spec, &stages, &cnn, &adamw, &dropout) == 5)
            return case_graph_steps(spec, stages, cnn, adamw, dropout);
    }
    if (!strcmp(name, "p2p")) return case_allreduce("cuda:0,1,2,3", MGPU_ALLREDUCE_P2P, MGPU_ALLREDUCE_P2P, NULL);
    if (!strcmp(name, "no peer access")) return case_allreduce("cuda:0,1,2,3", MGPU_ALLREDUCE_P2P, MGPU_ALLREDUCE_P2P, NULL);
    if (!strcmp(name, "ring mixed reach")) return case_ring_mixed_reach();
    fprintf(stderr, "unknown case %s\n", name);
    return 1;
}

/* Runs a case in a child with the given environment ("NAME=value ..."), collecting its output.
   Returns the exit status, or 128 + the signal. */
static int in_child(const char* name, const char* env, char* out, size_t size) {
    int fds[2], status = 0;
    size_t used = 0;
    ssize_t got;
    pid_t pid;
    fflush(stdout);
    fflush(stderr);
    if (pipe(fds) != 0) return -1;
    pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        char buf[512], *save = NULL, *kv;
        close(fds[0]);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        snprintf(buf, sizeof buf, "%s", env);
        for (kv = strtok_r(buf, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
            char* eq = strchr(kv, '=');
            if (eq) { *eq = 0; setenv(kv, eq + 1, 1); }
        }
        _exit(run_case(name));
    }
    close(fds[1]);
    while (used + 1 < size && (got = read(fds[0], out + used, size - 1 - used)) > 0) used += (size_t)got;
    out[used] = 0;
    { char sink[256]; while (read(fds[0], sink, sizeof sink) > 0) {} }
    close(fds[0]);
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* the case must end well; exit 77 means it cannot be checked here, and is counted skipped */
static void expect_ok(const char* name, const char* env) {
    char out[8192];
    int rc = in_child(name, env, out, sizeof out);
    if (rc == 77) {
        SKIP("%s [%s]: %s", name, env, out);
        return;
    }
    CHECK(rc == 0, "%s [%s]: exit %d, output:\n%s", name, env, rc, out);
}

/* the case must stop the program (abort) with a report containing `a` and `b` */
static void expect_report(const char* name, const char* env, const char* a, const char* b) {
    char out[8192];
    int rc = in_child(name, env, out, sizeof out);
    CHECK(rc == 128 + SIGABRT, "%s: exit %d, want an abort; output:\n%s", name, rc, out);
    CHECK(strstr(out, "mgpu-emu") && strstr(out, a) && (!b || strstr(out, b)), "%s: report lacks \"%s\"/\"%s\":\n%s", name,
          a, b ? b : "", out);
}

/* the case must end well, and its output contain a and b */
static void expect_ok_saying(const char* name, const char* env, const char* a, const char* b) {
    char out[8192];
    int rc = in_child(name, env, out, sizeof out);
    CHECK(rc == 0 && strstr(out, a) && strstr(out, b), "%s [%s]: exit %d, want \"%s\" and \"%s\" in the output:\n%s", name, env,
          rc, a, b, out);
}

/* no NCCL: a machine's own libnccl.so.2 would otherwise be tried first */
#define NO_NCCL "MGPU_NCCL_LIBRARY=/nonexistent/libnccl.so.2"

int main(int argc, char** argv) {
    char nccl[600], nccl_fail[700], env[760];
    const char* lib = getenv("MGPU_EMU_NCCL");
    (void)test_rel_error;
    if (argc > 1) return run_case(argv[1]);   /* one case, in this process, in the caller's environment */
    header("the emulator checks itself");
    expect_ok("selfcheck:shuffles", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:launch_limits", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:dynamic_shared", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:cublas", "MGPU_EMU_DEVICES=1");
    /* kernels that reuse shared memory across loop iterations, at sizes where blocks loop: in
       the plain order and in two chaos orders */
    expect_ok("selfcheck:transpose", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:column_sum", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:softmax_wide", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:softmax_wide", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=1");
    expect_ok("selfcheck:softmax_wide", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=2");
    expect_ok("selfcheck:column_sum", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=1");
    expect_report("selfcheck:divergent", "MGPU_EMU_DEVICES=1", "divergent_barrier_kernel", "divergent __syncthreads");
    expect_report("selfcheck:missing_lanes", "MGPU_EMU_DEVICES=1", "missing_lanes_kernel", "has exited");
    expect_report("selfcheck:deadlock", "MGPU_EMU_DEVICES=1", "deadlock_kernel", "deadlock");
    expect_report("selfcheck:oob_copy", "MGPU_EMU_DEVICES=1", "cudaMemcpyAsync source", "past the end");
    expect_report("selfcheck:no_peer_kernel", "MGPU_EMU_DEVICES=2", "write_kernel", "without peer access");
    expect_report("selfcheck:no_peer_struct", "MGPU_EMU_DEVICES=2", "padded_write_kernel", "without peer access");
    expect_ok("selfcheck:padding", "MGPU_EMU_DEVICES=2");
    /* MGPU_EMU_RACECHECK: two streams writing one buffer in no order are reported; ordered by an
       event or by the host, they are not, nor are two readers */
    expect_report("selfcheck:race", "MGPU_EMU_DEVICES=1 MGPU_EMU_RACECHECK=1", "write_kernel", "in no order");
    expect_ok("selfcheck:race_ordered", "MGPU_EMU_DEVICES=1 MGPU_EMU_RACECHECK=1");
    expect_ok("selfcheck:race_readers", "MGPU_EMU_DEVICES=1 MGPU_EMU_RACECHECK=1");
    expect_ok("selfcheck:race", "MGPU_EMU_DEVICES=1");   /* (without the check: nothing to report) */
    /* stream capture and graphs: replays match eager work (across two devices, in two chaos
       orders too), and what a capture refuses; async copies from pinned and pageable memory */
    expect_ok("selfcheck:graph_basic", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:graph_fork_join", "MGPU_EMU_DEVICES=2");
    expect_ok("selfcheck:graph_fork_join", "MGPU_EMU_DEVICES=2 MGPU_EMU_RACECHECK=1");
    expect_ok("selfcheck:graph_fork_join", "MGPU_EMU_DEVICES=2 MGPU_EMU_CHAOS=1");
    expect_ok("selfcheck:graph_fork_join", "MGPU_EMU_DEVICES=2 MGPU_EMU_CHAOS=2");
    expect_ok("selfcheck:graph_forbidden", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:graph_cublas", "MGPU_EMU_DEVICES=1");
    expect_ok("selfcheck:graph_nccl", "MGPU_EMU_DEVICES=2");   /* skipped without MGPU_EMU_NCCL */
    expect_ok("selfcheck:graph_nccl", "MGPU_EMU_DEVICES=2 MGPU_EMU_CHAOS=1");
    expect_ok("selfcheck:pinned_async", "MGPU_EMU_DEVICES=1");

    header("settings: the emulator's parser is mgpu.h's");
    expect_ok("settings agree", "MGPU_EMU_DEVICES=1");
    expect_ok("long spec", "MGPU_EMU_DEVICES=1");
    expect_ok_saying("settings fixed", "MGPU_EMU_DEVICES=abc MGPU_EMU_STACK_KIB=0",
                     "mgpu-emu: MGPU_EMU_DEVICES='abc' is not a whole number of devices; using 1",
                     "mgpu-emu: MGPU_EMU_STACK_KIB='0' is outside");

    header("faults: mgpu's error or its documented fallback");
    expect_ok("no gpu", "MGPU_EMU_DEVICES=0");
    expect_ok("oom retry", "MGPU_EMU_DEVICES=1");
    expect_ok("oom", "MGPU_EMU_DEVICES=1");
    expect_ok("small device", "MGPU_EMU_DEVICES=1 MGPU_EMU_MEMORY=256");
    expect_ok("launch failure", "MGPU_EMU_DEVICES=1");
    if (lib) {
        snprintf(nccl, sizeof nccl, "MGPU_EMU_DEVICES=4 MGPU_NCCL_LIBRARY=%s", lib);
        expect_ok("nccl", nccl);
        snprintf(nccl_fail, sizeof nccl_fail, "%s MGPU_EMU_NCCL_FAIL=init", nccl);
        expect_ok("nccl init fails", nccl_fail);
    } else {
        SKIP("the emulated NCCL: MGPU_EMU_NCCL is not set");
    }
    expect_ok("nccl absent", "MGPU_EMU_DEVICES=2 " NO_NCCL);
    /* the P2P ring across 4 GPUs (above the one-shot's size), and the one-shot at every size */
    expect_ok("p2p", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring");
    expect_ok("p2p", "MGPU_EMU_DEVICES=4 MGPU_P2P=oneshot");
    expect_ok("no peer access", "MGPU_EMU_DEVICES=4 MGPU_EMU_NO_PEER=1 " NO_NCCL);
    expect_ok("ring mixed reach", "MGPU_EMU_DEVICES=2 MGPU_EMU_NO_PEER=1 MGPU_EMU_CHAOS=2 " NO_NCCL);
    header("a training step on several GPUs never waits for them; copies between GPUs keep stream order");
    expect_ok("no host sync", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring " NO_NCCL);
    expect_ok("no host sync", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring MGPU_EMU_CHAOS=1 " NO_NCCL);
    expect_ok("no host sync", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring MGPU_EMU_NO_PEER=1 " NO_NCCL);
    if (lib) {
        expect_ok("no host sync", nccl);
        /* the fallback from a failed NCCL, without peer access: as CI met it with a real NCCL */
        snprintf(env, sizeof env, "%s MGPU_EMU_NO_PEER=1 MGPU_P2P=ring", nccl_fail);
        expect_ok("no host sync", env);
    } else {
        SKIP("no host sync through the emulated NCCL: MGPU_EMU_NCCL is not set");
    }
    header("batches from the CPU and the loss: a step never waits for the devices");
    expect_ok("fed steps: 1 gpu", "MGPU_EMU_DEVICES=1");
    expect_ok("fed steps: 1 gpu", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=3");
    expect_ok("fed steps: 4 gpus", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring MGPU_EMU_CHAOS=3 " NO_NCCL);
    expect_ok("fed steps: 4 gpus", "MGPU_EMU_DEVICES=4 MGPU_EMU_NO_PEER=1 " NO_NCCL);
    expect_ok("fed steps: 2 x 2 pipeline", "MGPU_EMU_DEVICES=4 MGPU_EMU_CHAOS=4 " NO_NCCL);
    if (lib) expect_ok("fed steps: 4 gpus", nccl);
    else SKIP("fed steps through the emulated NCCL: MGPU_EMU_NCCL is not set");
    header("a training step as a CUDA graph: the eager step's bits, one launch");
    /* "graph: SPEC STAGES CNN ADAMW DROPOUT" */
    expect_ok("graph: cuda:0 1 0 0 0", "MGPU_EMU_DEVICES=1");
    expect_ok("graph: cuda:0 1 0 1 1", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=5");
    expect_ok("graph: cuda:0 1 1 1 0", "MGPU_EMU_DEVICES=1");
    expect_ok("graph: cuda:0,1,2,3 1 0 1 0", "MGPU_EMU_DEVICES=4 MGPU_EMU_CHAOS=6 " NO_NCCL);
    expect_ok("graph: cuda:0,1,2,3 1 0 0 1", "MGPU_EMU_DEVICES=4 " NO_NCCL);
    expect_ok("graph: cuda:0,1,2,3 1 1 0 0", "MGPU_EMU_DEVICES=4 " NO_NCCL);
    expect_ok("graph: cuda:0,1,2,3 1 0 0 0", "MGPU_EMU_DEVICES=4 MGPU_EMU_NO_PEER=1 " NO_NCCL);
    expect_ok("graph: cuda:0,1,2,3 1 0 0 0", "MGPU_EMU_DEVICES=4 MGPU_P2P=ring MGPU_EMU_CHAOS=8 " NO_NCCL);   /* the ring in the graph */
    expect_ok("graph: cuda:0,1,2,3 2 0 0 1", "MGPU_EMU_DEVICES=4 MGPU_EMU_CHAOS=7 " NO_NCCL);
    expect_ok("graph: cuda:0,1,2,3 2 1 1 0", "MGPU_EMU_DEVICES=4 " NO_NCCL);
    header("a CUDA graph's capture that fails: why, and tried again later");
    expect_ok("graph retry: 1", "MGPU_EMU_DEVICES=1");
    expect_ok("graph retry: 2", "MGPU_EMU_DEVICES=1 MGPU_EMU_CHAOS=8");
    expect_ok("graph retry: 3", "MGPU_EMU_DEVICES=1");
    return test_summary("test_emu");
}
