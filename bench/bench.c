/* bench.c - mgpu's side of `make bench`. Prints one tab-separated row per measurement:
     workload  device  metric  value  unit  note
   bench/bench_torch.py prints the same workloads for PyTorch; bench/run.sh joins the two into
   the table (ratios, memory, allocations per step) and writes it to bench/results/.
   Usage: bench [cpu|cuda|all] [--quick]; bench gemm, bench steps: the CPU GEMM rows, the CPU
   training steps alone; bench memory: the large MLP (4096 wide, batch 2048) on the CPU device,
   for its memory, counted by the same allocator as on a GPU (a step takes seconds there). Times
   are medians over repeated runs after warm-up.
   Built against the GPU emulator (-DMGPU_BENCH_EMU, build/emu/bench), `bench emu` prints instead
   what one training step asks of the GPUs: launches, host-device synchronisations, allocations
   and bytes moved (the emulator's counters), a table of its own. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>

static int quick;

/* OpenBLAS, when installed, for its cblas_sgemm: the GEMM a user would otherwise pick */
static void* open_blas(void) {
    void* lib = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    return lib ? lib : dlopen("libopenblas.so", RTLD_NOW | RTLD_LOCAL);
}
static void (*blas_symbol(void* lib, const char* name))(void) {
    void (*fn)(void);
    void* p = dlsym(lib, name);
    memcpy(&fn, &p, sizeof fn);   /* object to function pointer, the POSIX way */
    return fn;
}
static double copy_gbs[2];     /* device-to-device copy bandwidth, [0] CPU, [1] GPU: the yardstick */
static double gemm_tflops;     /* cuBLAS on the large MLP's GEMM shape, measured in the same run */
static double gemm_tflops_bf16;   /* the same forward GEMM (x W^T) with bf16 operands (bench_gemm_layouts) */

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}
static double median(double* v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void row(const char* workload, const char* device, const char* metric, double value, const char* unit, const char* note) {
    if (mgpu_dist_rank() != 0) return;   /* a job of processes (bench_mpi): rank 0 speaks */
    printf("%s\t%s\t%s\t%.6g\t%s\t%s\n", workload, device, metric, value, unit, note ? note : "");
    fflush(stdout);
}

static void fail(const char* what) {
    fprintf(stderr, "bench: %s: %s\n", what, mgpu_last_error());
    exit(1);
}

/* ---- training steps: median seconds per step, peak memory, device allocations per step ---- */
/* the pipeline layout of the models make_model makes (0: one stage) */
static int pipe_stages, pipe_micro;
static int use_graph;      /* desc.graph of the models made */
static int use_bf16;       /* desc.precision MGPU_BF16 for the models made */
static int use_recompute;  /* desc.recompute: a GPT's LayerNorm and GELU outputs made again in backward */
static int batch_on_cpu;   /* the batch as a loader gives it, on the CPU, instead of on the first device */
static mgpu_pipeline_schedule pipe_schedule;

/* The GPTs: "gpt", examples/gpt.c's default (bytes as tokens, 4 blocks of width 128, 4 heads, T
   64); "gpt124m", GPT-2 124M's shape (vocabulary 50257, 12 blocks of width 768, 12 heads, T 1024) */
typedef struct gpt_size { int vocab, T, C, H, L; } gpt_size;
static int is_gpt(const char* name) { return !strncmp(name, "gpt", 3); }
static gpt_size gpt_size_of(const char* name) {
    const gpt_size small = { 256, 64, 128, 4, 4 }, gpt2 = { 50257, 1024, 768, 12, 12 };
    return strcmp(name, "gpt124m") ? small : gpt2;
}
/* one GPT-2 block, x + attn(ln_1(x)) then x + mlp(ln_2(x)), as examples/gpt.c builds it */
static mgpu_layer* gpt_block(int C, int H) {
    mgpu_layer* attn[2] = { mgpu_layer_layer_norm(C), mgpu_layer_causal_self_attention(C, H, 0.0f) };
    mgpu_layer* mlp[3] = { mgpu_layer_conv1d(C, 4 * C), mgpu_layer_gelu_tanh(), mgpu_layer_conv1d(4 * C, C) };
    mgpu_layer* ff[2] = { mgpu_layer_layer_norm(C), mgpu_layer_sequential(mlp, 3) };
    mgpu_layer* both[2] = { mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL),
                            mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL) };
    return mgpu_layer_sequential(both, 2);
}

/* Linear(in -> out) then GELU as one layer made of tape ops (>>autograd), no backward written: the
   autograd row's, set beside the built-in Linear and GELU */
typedef struct tape_dims { int in, out; } tape_dims;
static const mgpu_tensor* tape_linear_gelu_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    (void)user;
    return mgpu_tape_gelu(t, mgpu_tape_add(t, mgpu_tape_matmul(t, x, p[0], MGPU_NO_TRANS, MGPU_TRANS), p[1]));
}
static mgpu_result tape_linear_gelu_shape(void* user, mgpu_shape x, mgpu_shape* y) {
    *y = x;
    y->dim[y->ndim - 1] = ((const tape_dims*)user)->out;
    return MGPU_OK;
}
static mgpu_layer* tape_linear_gelu(tape_dims* d) {
    const mgpu_op_param_desc params[2] = { { "weight", mgpu_shape2(d->out, d->in), MGPU_INIT_UNIFORM, 0.0f, 0 },
                                           { "bias", mgpu_shape1(d->out), MGPU_INIT_UNIFORM, 0.0f, d->in } };
    return mgpu_layer_from_ops(&(mgpu_op_layer_desc){ .type = "LinearGELU", .params = params, .param_count = 2,
                                                      .forward = tape_linear_gelu_forward, .output_shape = tape_linear_gelu_shape,
                                                      .user = d });
}

static mgpu_model* make_model(const char* name, mgpu_device_set* set) {
    static tape_dims gelu_dims[2] = { { 784, 256 }, { 256, 256 } };
    mgpu_model_desc d;
    mgpu_layer* layers[20];
    int n = 0, i;
    memset(&d, 0, sizeof d);
    d.devices = set;
    d.stages = pipe_stages;
    d.micro_batches = pipe_micro;
    d.schedule = pipe_schedule;
    d.graph = use_graph;
    d.precision = use_bf16 ? MGPU_BF16 : MGPU_F32;
    d.recompute = use_recompute;
    d.seed = 1;
    d.layers = layers;
    if (!strcmp(name, "mlp784")) {
        d.input = mgpu_shape1(784);
        layers[n++] = mgpu_layer_linear(784, 128); layers[n++] = mgpu_layer_relu(); layers[n++] = mgpu_layer_linear(128, 10);
    } else if (!strcmp(name, "mlp_gelu") || !strcmp(name, "mlp_gelu_tape")) {   /* 784 -> 256 -> 256 -> 10, GELUs */
        d.input = mgpu_shape1(784);
        for (i = 0; i < 2; ++i) {
            if (!strcmp(name, "mlp_gelu_tape")) layers[n++] = tape_linear_gelu(&gelu_dims[i]);
            else { layers[n++] = mgpu_layer_linear(gelu_dims[i].in, gelu_dims[i].out); layers[n++] = mgpu_layer_gelu(); }
        }
        layers[n++] = mgpu_layer_linear(256, 10);
    } else if (!strcmp(name, "mlp4096")) {
        d.input = mgpu_shape1(4096);
        for (i = 0; i < 4; ++i) { layers[n++] = mgpu_layer_linear(4096, 4096); layers[n++] = mgpu_layer_relu(); }
        layers[n++] = mgpu_layer_linear(4096, 10);
    } else if (is_gpt(name)) {   /* the head tied to the token embedding (names as Hugging Face's, for the tie) */
        static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
        const gpt_size g = gpt_size_of(name);
        d.input = mgpu_shape1(g.T);
        d.input_dtype = MGPU_I32;
        d.ties = &head_is_wte;
        d.tie_count = 1;
        layers[n++] = mgpu_layer_name(mgpu_layer_embedding(g.vocab, g.C), "wte");
        layers[n++] = mgpu_layer_name(mgpu_layer_position_embedding(g.T, g.C), "wpe");
        for (i = 0; i < g.L; ++i) layers[n++] = gpt_block(g.C, g.H);
        layers[n++] = mgpu_layer_name(mgpu_layer_layer_norm(g.C), "ln_f");
        layers[n++] = mgpu_layer_name(mgpu_layer_linear_no_bias(g.C, g.vocab), "lm_head");
    } else {   /* the cnn of examples/train.c */
        d.input = mgpu_shape3(1, 28, 28);
        layers[n++] = mgpu_layer_conv2d(1, 16, 3, 1, 1); layers[n++] = mgpu_layer_relu(); layers[n++] = mgpu_layer_maxpool2d(2, 2);
        layers[n++] = mgpu_layer_conv2d(16, 32, 3, 1, 1); layers[n++] = mgpu_layer_relu(); layers[n++] = mgpu_layer_maxpool2d(2, 2);
        layers[n++] = mgpu_layer_flatten(); layers[n++] = mgpu_layer_linear(32 * 7 * 7, 128); layers[n++] = mgpu_layer_relu();
        layers[n++] = mgpu_layer_linear(128, 10);
    }
    d.layer_count = n;
    return mgpu_model_create(&d);
}

/* a batch of inputs for the model */
static mgpu_shape batch_shape(const char* model_name, int batch) {
    if (!strcmp(model_name, "cnn")) return mgpu_shape4(batch, 1, 28, 28);
    if (is_gpt(model_name)) return mgpu_shape2(batch, gpt_size_of(model_name).T);
    return mgpu_shape2(batch, !strncmp(model_name, "mlp784", 6) || !strncmp(model_name, "mlp_gelu", 8) ? 784 : 4096);
}

/* A model on spec with SGD (momentum 0.9), the GPT with AdamW, and one random batch on its first
   replica's device: the step itself is measured, not the copy of a host batch. */
typedef struct training {
    mgpu_device_set* set;
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y;
} training;

static training training_create(const char* model_name, const char* spec, int batch, int tf32) {
    training tr;
    mgpu_optimizer_desc od;
    int r;
    tr.set = mgpu_device_set_create(spec);
    if (!tr.set) fail(spec);
    for (r = 0; r < mgpu_device_set_count(tr.set); ++r) mgpu_memory_reset_peak(mgpu_device_set_get(tr.set, r));
    tr.m = make_model(model_name, tr.set);
    if (!tr.m) fail(model_name);
    for (r = 0; tf32 && r < mgpu_model_replica_count(tr.m); ++r) mgpu_device_allow_tf32(mgpu_model_device(tr.m, r), 1);
    memset(&od, 0, sizeof od);
    od.lr = 0.01f;
    od.momentum = 0.9f;
    if (is_gpt(model_name)) { od.kind = MGPU_ADAMW; od.lr = 1e-3f; od.momentum = 0.0f; }
    tr.opt = mgpu_optimizer_create(tr.m, &od);
    if (is_gpt(model_name)) {   /* random tokens; each target is the next token */
        const gpt_size g = gpt_size_of(model_name);
        const size_t count = (size_t)batch * (size_t)g.T;
        int32_t* ids = (int32_t*)malloc(sizeof(int32_t) * (count + 1));
        uint32_t state = 12345u;
        size_t k;
        for (k = 0; ids && k < count + 1; ++k)   /* (the high bits of an LCG, scaled to the vocabulary) */
            ids[k] = (int32_t)(((uint64_t)(state = state * 1664525u + 1013904223u) * (uint64_t)g.vocab) >> 32);
        tr.x = mgpu_tensor_create(batch_on_cpu ? mgpu_device_cpu() : mgpu_model_device(tr.m, 0), MGPU_I32, batch_shape(model_name, batch));
        tr.y = mgpu_tensor_create(batch_on_cpu ? mgpu_device_cpu() : mgpu_model_device(tr.m, 0), MGPU_I32, batch_shape(model_name, batch));
        if (!ids || !tr.opt || !tr.x || !tr.y || mgpu_tensor_upload(tr.x, ids, sizeof(int32_t) * count) ||
            mgpu_tensor_upload(tr.y, ids + 1, sizeof(int32_t) * count))
            fail(spec);
        free(ids);
        return tr;
    }
    tr.x = mgpu_tensor_create(batch_on_cpu ? mgpu_device_cpu() : mgpu_model_device(tr.m, 0), MGPU_F32, batch_shape(model_name, batch));
    tr.y = mgpu_tensor_create(batch_on_cpu ? mgpu_device_cpu() : mgpu_model_device(tr.m, 0), MGPU_I32, mgpu_shape1(batch));
    if (!tr.opt || !tr.x || !tr.y || mgpu_rand_normal(tr.x, 3, 0, 0.0f, 1.0f) || mgpu_tensor_fill(tr.y, 3.0)) fail(spec);
    return tr;
}

static void training_destroy(training* tr) {
    mgpu_tensor_destroy(tr->x);
    mgpu_tensor_destroy(tr->y);
    mgpu_optimizer_destroy(tr->opt);
    mgpu_model_destroy(tr->m);
    mgpu_device_set_destroy(tr->set);
}

static int dev_is_gpu(const mgpu_device* dev) { return mgpu_device_kind_of(dev) == MGPU_DEVICE_CUDA; }

/* the median step, in seconds */
static double bench_training(const char* workload, const char* model_name, const char* spec, int batch, int steps, int tf32) {
    training tr = training_create(model_name, spec, batch, tf32);
    const int replicas = mgpu_model_replica_count(tr.m);
    mgpu_device* first = mgpu_model_device(tr.m, 0);
    mgpu_memory_stats before, after;
    double* t = (double*)malloc(sizeof(double) * (size_t)steps);
    double step;
    int i, r;
    for (i = 0; i < 3; ++i) if (mgpu_model_train_step(tr.m, tr.opt, tr.x, tr.y, NULL)) fail(workload);   /* warm-up */
    for (r = 0; r < replicas; ++r) mgpu_device_synchronize(mgpu_model_device(tr.m, r));
    mgpu_memory_get_stats(first, &before);
    for (i = 0; i < steps; ++i) {
        double t0 = mgpu_seconds();
        if (mgpu_model_train_step(tr.m, tr.opt, tr.x, tr.y, NULL)) fail(workload);
        for (r = 0; r < replicas; ++r) mgpu_device_synchronize(mgpu_model_device(tr.m, r));
        t[i] = mgpu_seconds() - t0;
    }
    mgpu_memory_get_stats(first, &after);
    row(workload, spec, "step", median(t, steps) * 1e3, "ms", NULL);
    if (getenv("BENCH_TRACE")) {   /* where a step's time goes: three more steps traced (Chrome's format) */
        if (mgpu_model_trace_start(tr.m)) fail(workload);
        for (i = 0; i < 3; ++i) if (mgpu_model_train_step(tr.m, tr.opt, tr.x, tr.y, NULL)) fail(workload);
        if (mgpu_model_trace_stop(tr.m, getenv("BENCH_TRACE"))) fail(workload);
    }
    if (dev_is_gpu(first)) {   /* steps queued back to back, as a training loop runs them: the host works ahead */
        double t0 = mgpu_seconds();
        for (i = 0; i < steps; ++i) if (mgpu_model_train_step(tr.m, tr.opt, tr.x, tr.y, NULL)) fail(workload);
        for (r = 0; r < replicas; ++r) mgpu_device_synchronize(mgpu_model_device(tr.m, r));
        row(workload, spec, "step_queued", (mgpu_seconds() - t0) / steps * 1e3, "ms", "steps back to back, one wait at the end");
    }
    if (!strcmp(model_name, "mlp4096")) {   /* 3 GEMMs per Linear (forward, weight and input gradients),
        but none for the input gradient of the first layer, which nothing needs */
        const double flops = 2.0 * batch * (3.0 * (4.0 * 4096.0 * 4096.0 + 4096.0 * 10.0) - 4096.0 * 4096.0);
        const double bare = use_bf16 ? gemm_tflops_bf16 : gemm_tflops;
        row(workload, spec, "tflops", flops / median(t, steps) / 1e12, "TFLOP/s", NULL);
        if (bare > 0.0) row(workload, spec, "of_gemm", flops / median(t, steps) / 1e12 / bare, "x",
                            use_bf16 ? "of the bare bf16 GEMM rate (x W^T)" : "of the bare GEMM rate");
    }
    row(workload, spec, "peak_mem", (double)after.peak_bytes_in_use / 1048576.0, "MiB", NULL);
    row(workload, spec, "allocs_per_step", (double)(after.backend_allocs - before.backend_allocs) / steps, "allocs", NULL);
    step = median(t, steps);
    free(t);
    training_destroy(&tr);
    return step;
}

/* autograd: an MLP whose Linear+GELU pairs are made of tape ops (recomputed in backward) against
   the same MLP of built-in layers, in the same run */
static void bench_tape_steps(void) {
    const double builtin = bench_training("mlp_gelu_b64", "mlp_gelu", "cpu", 64, quick ? 20 : 200, 0);
    const double tape = bench_training("mlp_gelu_tape_b64", "mlp_gelu_tape", "cpu", 64, quick ? 20 : 200, 0);
    row("mlp_gelu_tape_b64", "cpu", "of_builtin", tape / builtin, "x", "step time over the built-in layers' (goal: at most 1.5)");
}

/* the MLP's, the CNN's and the GPT's steps on one CPU device, set beside PyTorch's */
static void bench_cpu_steps(void) {
    bench_training("mlp784_b64", "mlp784", "cpu", 64, quick ? 50 : 300, 0);
    bench_training("cnn_b128", "cnn", "cpu", 128, quick ? 3 : 30, 0);
    bench_training("gpt_b16_t64", "gpt", "cpu", 16, quick ? 5 : 40, 0);
    bench_tape_steps();
}


/* ---- the bare GEMM of the large MLP (out [2048, 4096] = x [2048, 4096] @ W^T), TF32 allowed:
   the rate its training step is measured against ---- */
static void bench_gemm(const char* spec, int m, int n, int k, int reps) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_device* dev;
    mgpu_tensor *a, *b, *c;
    double* t = (double*)malloc(sizeof(double) * (size_t)reps);
    char name[64];
    int i;
    if (!set) fail(spec);
    dev = mgpu_device_set_get(set, 0);
    a = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(m, k));
    b = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(n, k));
    c = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(m, n));
    if (!a || !b || !c || mgpu_device_allow_tf32(dev, 1) || mgpu_rand_normal(a, 5, 0, 0.0f, 1.0f) || mgpu_rand_normal(b, 5, 1u << 30, 0.0f, 1.0f))
        fail("gemm");
    for (i = -3; i < reps; ++i) {   /* 10 back to back per timing: one sync's cost spread thin */
        double t0;
        int j;
        mgpu_device_synchronize(dev);
        t0 = mgpu_seconds();
        for (j = 0; j < 10; ++j)
            if (mgpu_matmul(c, a, b, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f)) fail("gemm");
        mgpu_device_synchronize(dev);
        if (i >= 0) t[i] = (mgpu_seconds() - t0) / 10.0;
    }
    gemm_tflops = 2.0 * m * n * (double)k / median(t, reps) / 1e12;
    snprintf(name, sizeof name, "gemm_%dx%dx%d", m, n, k);
    row(name, spec, "tflops", gemm_tflops, "TFLOP/s", "TF32, cuBLAS");
    mgpu_device_allow_tf32(dev, 0);
    mgpu_tensor_destroy(a);
    mgpu_tensor_destroy(b);
    mgpu_tensor_destroy(c);
    mgpu_device_set_destroy(set);
    free(t);
}

/* ---- the three GEMMs of a Linear layer's step on x [m, k] and a weight [n, k], in TF32 and in
   bf16 (bf16 operands and out, fp32 sums): forward y = x W^T, the weight gradient dW = dy^T x,
   the input gradient dx = dy W; rows named as bench_torch.py's, PyTorch's matmul beside them ---- */
static void bench_gemm_layouts(const char* spec, int m, int n, int k, int reps) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_device* dev;
    double* t = (double*)malloc(sizeof(double) * (size_t)reps);
    int bf16, what, i, j;
    if (!set || !t) fail(spec);
    dev = mgpu_device_set_get(set, 0);
    for (bf16 = 0; bf16 < 2; ++bf16) {
        const mgpu_dtype dt = bf16 ? MGPU_BF16 : MGPU_F32;
        mgpu_tensor *x = mgpu_tensor_create(dev, dt, mgpu_shape2(m, k)), *w = mgpu_tensor_create(dev, dt, mgpu_shape2(n, k));
        mgpu_tensor *dy = mgpu_tensor_create(dev, dt, mgpu_shape2(m, n)), *y = mgpu_tensor_create(dev, dt, mgpu_shape2(m, n));
        mgpu_tensor *dw = mgpu_tensor_create(dev, dt, mgpu_shape2(n, k)), *dx = mgpu_tensor_create(dev, dt, mgpu_shape2(m, k));
        if (!x || !w || !dy || !y || !dw || !dx || mgpu_device_allow_tf32(dev, !bf16) || mgpu_tensor_fill(x, 0.5) ||
            mgpu_tensor_fill(w, -0.25) || mgpu_tensor_fill(dy, 0.125))
            fail("gemm layouts");
        for (what = 0; what < 3; ++what) {
            static const char* names[3] = {"x@W^T", "dy^T@x", "dy@W"};
            char name[64];
            for (i = -3; i < reps; ++i) {   /* 10 back to back per timing, as bench_gemm */
                double t0;
                mgpu_device_synchronize(dev);
                t0 = mgpu_seconds();
                for (j = 0; j < 10; ++j) {
                    mgpu_result r = what == 0 ? mgpu_matmul(y, x, w, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f)
                                  : what == 1 ? mgpu_matmul(dw, dy, x, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f)
                                              : mgpu_matmul(dx, dy, w, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f);
                    if (r) fail("gemm layouts");
                }
                mgpu_device_synchronize(dev);
                if (i >= 0) t[i] = (mgpu_seconds() - t0) / 10.0;
            }
            snprintf(name, sizeof name, "gemm_%dx%dx%d_%s", m, n, k, bf16 ? "bf16" : "tf32");
            row(name, spec, names[what], 2.0 * m * n * (double)k / median(t, reps) / 1e12, "TFLOP/s", "mgpu_matmul");
            if (bf16 && what == 0) gemm_tflops_bf16 = 2.0 * m * n * (double)k / median(t, reps) / 1e12;
        }
        mgpu_device_allow_tf32(dev, 0);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(w); mgpu_tensor_destroy(dy);
        mgpu_tensor_destroy(y); mgpu_tensor_destroy(dw); mgpu_tensor_destroy(dx);
    }
    mgpu_device_set_destroy(set);
    free(t);
}

/* ---- CPU GEMMs against OpenBLAS's cblas_sgemm (loaded at run time: no build dependency) on
   the same shapes and thread count, and the machine's FMA peak as the physical limit ---- */
typedef void (*cblas_sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                               const float* b, int ldb, float beta, float* c, int ldc);
static double time_gemm(int reps, int use_blas, cblas_sgemm_fn blas, int m, int n, int k, int ta, int tb,
                        mgpu_tensor* a, mgpu_tensor* b, mgpu_tensor* c) {
    double* t = (double*)malloc(sizeof(double) * (size_t)reps), best;
    const double warm_until = mgpu_seconds() + 0.1;   /* the clocks up again after the settle */
    int i;
    for (i = -2; i < reps; ++i) {
        double t0 = mgpu_seconds();
        if (i == -1 && t0 < warm_until) i = -2;   /* warm-up calls until then */
        if (use_blas)
            blas(101 /* row-major */, ta ? 112 : 111, tb ? 112 : 111, m, n, k, 1.0f, (const float*)mgpu_tensor_data(a),
                 ta ? m : k, (const float*)mgpu_tensor_data(b), tb ? k : n, 0.0f, (float*)mgpu_tensor_data(c), n);
        else if (mgpu_matmul(c, a, b, ta ? MGPU_TRANS : MGPU_NO_TRANS, tb ? MGPU_TRANS : MGPU_NO_TRANS, 1.0f, 0.0f))
            fail("gemm");
        if (i >= 0) t[i] = mgpu_seconds() - t0;
    }
    best = median(t, reps);
    free(t);
    return best;
}

/* OpenBLAS's threads spin for a while after each call, waiting for the next (so do mgpu's, for a
   millisecond): let one side's threads fall asleep before the other side is timed, or they take
   half of a 2-core machine from it */
static void settle(void) {
    struct timespec ts = { 0, 300000000 };
    nanosleep(&ts, NULL);
}

/* The FMA peak, measured: every thread runs independent FMA chains (twelve 8-float ones, more
   than the 2 units x 4 cycles of latency need) for 0.2 s. The nominal figure from the base clock
   would be wrong both ways: a boosting CPU beats it (OpenBLAS ran at 1.2x the 2445 MHz figure here),
   a throttled one never reaches it. */
#if defined(__AVX2__) && defined(__FMA__)
#define FMA_CHAINS 12
static void* fma_chains(void* arg) {
    double* out = (double*)arg;   /* in: seconds to run; out: FMAs per second, x 8 lanes x 2 */
    __m256 acc[FMA_CHAINS];
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    const double t0 = mgpu_seconds();
    long rounds = 0;
    int i;
    float sink = 0.0f;
    for (i = 0; i < FMA_CHAINS; ++i) acc[i] = _mm256_set1_ps((float)i);
    do {
        int r;
        for (r = 0; r < 4096; ++r)
            for (i = 0; i < FMA_CHAINS; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
        rounds += 4096;
    } while (mgpu_seconds() - t0 < *out);
    for (i = 0; i < FMA_CHAINS; ++i) sink += _mm256_cvtss_f32(acc[i]);
    *out = (double)rounds * FMA_CHAINS * 8 * 2 / (mgpu_seconds() - t0) + (sink == 12345.0f);   /* (sink: keep the sums) */
    return NULL;
}
#endif
static double cpu_fma_peak_gflops(char* note, size_t size) {
#if defined(__AVX2__) && defined(__FMA__)
    enum { MAX_THREADS = 256 };
    pthread_t t[MAX_THREADS];
    double rate[MAX_THREADS], best = 0.0;
    const int threads = mgpu_cpu_threads() < MAX_THREADS ? mgpu_cpu_threads() : MAX_THREADS;
    int trial, i;
    for (trial = 0; trial < 3; ++trial) {   /* the best of 3 (the first also warms the clocks up) */
        double sum = 0.0;
        for (i = 0; i < threads; ++i) {
            rate[i] = 0.2;
            if (i > 0 && pthread_create(&t[i], NULL, fma_chains, &rate[i]) != 0) fail("fma peak thread");
        }
        fma_chains(&rate[0]);
        for (i = 1; i < threads; ++i) pthread_join(t[i], NULL);
        for (i = 0; i < threads; ++i) sum += rate[i];
        if (sum > best) best = sum;
    }
    snprintf(note, size, "measured: %d threads of AVX2 FMA chains, %.0f MHz x 2 units x 8 lanes x 2 per thread",
             threads, best / threads / 32.0 / 1e6);
    return best / 1e9;
#else
    snprintf(note, size, "not measured: no AVX2+FMA in this build");
    return 0.0;
#endif
}

static void bench_cpu_gemms(void) {
    static const int shapes[][5] = {   /* m, n, k, transpose a, transpose b */
        {64, 128, 784, 0, 1}, {128, 784, 64, 1, 0}, {64, 784, 128, 0, 0},         /* the MLP: forward, dW, dx */
        {128, 10, 64, 1, 0},                                                       /* its last layer's dW */
        {100352, 16, 9, 0, 1}, {25088, 32, 144, 0, 1},                             /* the CNN's convolutions (im2col) */
        {16, 9, 100352, 1, 0}, {32, 144, 25088, 1, 0}, {25088, 144, 32, 0, 0},   /* their dW and dcols */
        {512, 512, 512, 0, 0}, {2048, 4096, 4096, 0, 0}};
    void* lib = open_blas();
    cblas_sgemm_fn blas = lib ? (cblas_sgemm_fn)blas_symbol(lib, "cblas_sgemm") : NULL;
    void (*set_threads)(int) = lib ? (void (*)(int))blas_symbol(lib, "openblas_set_num_threads") : NULL;
    char note[128];
    const double peak = cpu_fma_peak_gflops(note, sizeof note);
    size_t s;
    row("fma_peak", "cpu", "gflops", peak, "GFLOP/s", note);
    if (set_threads) set_threads(mgpu_cpu_threads());
    if (!blas) row("gemm_openblas", "cpu", "skipped", 0, "", "libopenblas.so.0 not found (apt-get install libopenblas0-pthread)");
    for (s = 0; s < sizeof shapes / sizeof shapes[0]; ++s) {
        const int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], ta = shapes[s][3], tb = shapes[s][4];
        const double flops = 2.0 * m * n * (double)k;
        const int reps = quick ? 3 : flops > 1e10 ? 5 : flops > 1e8 ? 20 : 200;
        mgpu_device* dev = mgpu_device_cpu();
        mgpu_tensor* a = mgpu_tensor_create(dev, MGPU_F32, ta ? mgpu_shape2(k, m) : mgpu_shape2(m, k));
        mgpu_tensor* b = mgpu_tensor_create(dev, MGPU_F32, tb ? mgpu_shape2(n, k) : mgpu_shape2(k, n));
        mgpu_tensor* c = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(m, n));
        double mine, theirs;
        char name[64];
        if (!a || !b || !c || mgpu_rand_uniform(a, 1, 0, -1.0f, 1.0f) || mgpu_rand_uniform(b, 2, 0, -1.0f, 1.0f)) fail("gemm");
        snprintf(name, sizeof name, "gemm_%dx%dx%d%s%s", m, n, k, ta ? "_ta" : "", tb ? "_tb" : "");
        settle();
        mine = time_gemm(reps, 0, blas, m, n, k, ta, tb, a, b, c);
        row(name, "cpu", "gflops", flops / mine * 1e-9, "GFLOP/s", NULL);
        if (blas) {
            settle();
            theirs = time_gemm(reps, 1, blas, m, n, k, ta, tb, a, b, c);
            row(name, "cpu", "openblas_gflops", flops / theirs * 1e-9, "GFLOP/s", "cblas_sgemm, same threads");
            row(name, "cpu", "of_openblas", theirs / mine, "x", NULL);
        }
        if (peak > 0.0) row(name, "cpu", "of_peak", flops / mine * 1e-9 / peak, "x", NULL);
        mgpu_tensor_destroy(a);
        mgpu_tensor_destroy(b);
        mgpu_tensor_destroy(c);
    }
}

/* ---- causal attention alone: the fused kernels (mgpu__attention_forward and _backward), on
   FlashAttention's benchmark shape, 16K tokens (batch 16384 / T) of width 2048 (heads 2048 / head
   size), with FLOPs as FlashAttention counts them: forward 4 B H T^2 hs, halved by the causal
   mask; backward 2.5 times that. bench_torch.py times F.scaled_dot_product_attention alike. ---- */
static void bench_attention(const char* spec, int T, int hs, int reps) {
    const int B = 16384 / T, H = 2048 / hs;
    const int64_t D = (int64_t)H * hs;
    const mgpu__attn g = { B, T, H, hs, 1.0f / sqrtf((float)hs) };
    const double fwd_flops = 2.0 * B * H * (double)T * T * hs, flops[2] = { fwd_flops, 2.5 * fwd_flops };
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_device* dev;
    mgpu_tensor *qkv, *y, *lse, *dy, *drow, *dqkv;
    double* t = (double*)malloc(sizeof(double) * (size_t)reps);
    char name[64];
    int pass, i, j;
    if (!set || !t) fail(spec);
    dev = mgpu_device_set_get(set, 0);
    qkv = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, T, 3 * D));
    y = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, T, D));
    dy = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, T, D));
    dqkv = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, T, 3 * D));
    lse = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, H, T));
    drow = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape3(B, H, T));
    if (!qkv || !y || !dy || !dqkv || !lse || !drow || mgpu_tensor_fill(qkv, 0.5) || mgpu_tensor_fill(dy, 0.125)) fail("attention");
    snprintf(name, sizeof name, "attention_causal_t%d_hs%d", T, hs);
    for (pass = 0; pass < 2; ++pass) {   /* 0: forward, 1: backward (after a forward) */
        for (i = -3; i < reps; ++i) {
            double t0;
            mgpu_device_synchronize(dev);
            t0 = mgpu_seconds();
            for (j = 0; j < 10; ++j) {
                mgpu_result r = pass == 0 ? mgpu__attention_forward(&g, qkv, y, lse, 0, NULL, 0, 0, 0.0f)
                                          : mgpu__attention_backward(&g, qkv, y, lse, dy, drow, dqkv, 0, NULL, 0, 0, 0.0f);
                if (r) fail("attention");
            }
            mgpu_device_synchronize(dev);
            if (i >= 0) t[i] = (mgpu_seconds() - t0) / 10.0;
        }
        row(name, spec, pass ? "backward" : "forward", flops[pass] / median(t, reps) / 1e12, "TFLOP/s",
            hs <= MGPU__CU_ATTN_FUSED_MAX_HEAD ? "fused kernels, fp32 on CUDA cores" : "unfused kernels, fp32");
    }
    mgpu_tensor_destroy(qkv); mgpu_tensor_destroy(y); mgpu_tensor_destroy(dy);
    mgpu_tensor_destroy(dqkv); mgpu_tensor_destroy(lse); mgpu_tensor_destroy(drow);
    mgpu_device_set_destroy(set);
    free(t);
}

/* ---- bandwidth: optimizer step and elementwise ops against a plain copy ---- */
static void bench_bandwidth(const char* spec, size_t bytes, int reps) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_device* dev;
    const int64_t n = (int64_t)(bytes / sizeof(float));
    mgpu_tensor *a, *b, *c;
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_optimizer_desc od;
    mgpu_model_desc md;
    mgpu_layer* layer;
    double *t = (double*)malloc(sizeof(double) * (size_t)reps), copy = 0.0;
    int i, k;
    if (!set) fail(spec);
    dev = mgpu_device_set_get(set, 0);
    a = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(n));
    b = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(n));
    c = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1(n));
    if (!a || !b || !c || mgpu_rand_uniform(a, 1, 0, -1, 1) || mgpu_rand_uniform(b, 1, 1u << 30, -1, 1)) fail("bandwidth");
    for (k = 0; k < 2; ++k) {   /* 0: a copy, the yardstick; 1: an elementwise add */
        for (i = -1; i < reps; ++i) {   /* i = -1 warms up */
            double t0;
            mgpu_device_synchronize(dev);
            t0 = mgpu_seconds();
            if (k == 0 && mgpu_tensor_copy(c, a)) fail("copy");
            if (k == 1 && mgpu_add(c, a, b)) fail("add");
            mgpu_device_synchronize(dev);
            if (i >= 0) t[i] = mgpu_seconds() - t0;
        }
        if (k == 0) {
            copy = 2.0 * (double)bytes / median(t, reps) / 1e9;   /* read + write */
            copy_gbs[dev_is_gpu(dev)] = copy;
            row("copy_256MiB", spec, "bandwidth", copy, "GB/s", "reads+writes per second");
        } else if (k == 1) {
            double gbs = 3.0 * (double)bytes / median(t, reps) / 1e9;
            row("add_256MiB", spec, "bandwidth", gbs, "GB/s", NULL);
            row("add_256MiB", spec, "of_copy", gbs / copy, "x", NULL);
        }
    }
    mgpu_tensor_destroy(a);
    mgpu_tensor_destroy(b);
    mgpu_tensor_destroy(c);
    /* SGD with momentum over one flat buffer of n parameters: reads p, g, buf; writes p, buf */
    memset(&md, 0, sizeof md);
    layer = mgpu_layer_linear((int)(n / 1024), 1024);   /* n weights (+1024 biases) */
    md.input = mgpu_shape1(n / 1024);
    md.layers = &layer;
    md.layer_count = 1;
    md.devices = set;
    m = mgpu_model_create(&md);
    memset(&od, 0, sizeof od);
    od.lr = 0.01f;
    od.momentum = 0.9f;
    opt = m ? mgpu_optimizer_create(m, &od) : NULL;
    if (!opt) fail("optimizer");
    for (i = -1; i < reps; ++i) {
        double t0;
        mgpu_device_synchronize(dev);
        t0 = mgpu_seconds();
        if (mgpu_optimizer_step(opt)) fail("optimizer step");
        mgpu_device_synchronize(dev);
        if (i >= 0) t[i] = mgpu_seconds() - t0;
    }
    {
        double gbs = 5.0 * (double)mgpu_tensor_bytes(mgpu_model_params(m, 0)) / median(t, reps) / 1e9;
        row("sgd_step_256MiB", spec, "bandwidth", gbs, "GB/s", NULL);
        row("sgd_step_256MiB", spec, "of_copy", gbs / copy, "x", NULL);
    }
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    free(t);
}

/* ---- all-reduce: algorithm and bus bandwidth, and the memory it moves against a copy ----
   p2p_env, where not NULL, is put in MGPU_P2P while the communicator is made (ring, oneshot):
   such rows are named "-forced", e.g. allreduce_p2p-ring-forced_4KiB. */
static void bench_allreduce(const char* spec, size_t max_bytes, mgpu_allreduce_kind kind, const char* p2p_env) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_allreduce* ar;
    mgpu_tensor* t[MGPU__MAX_REPLICAS];
    size_t bytes;
    int n, i, r, reps, all;
    char name[96], where[32];
    if (!set) fail(spec);
    n = mgpu_device_set_count(set);
    all = n * mgpu_dist_size();   /* across processes (bench_mpi): every rank has the same set */
    if (mgpu_dist_size() > 1) snprintf(where, sizeof where, "%d processes x %s", mgpu_dist_size(), spec);
    else snprintf(where, sizeof where, "%s", spec);
    if (p2p_env) setenv("MGPU_P2P", p2p_env, 1);
    ar = mgpu_dist_size() > 1 ? mgpu_allreduce_create_distributed(set, kind) : mgpu_allreduce_create(set, kind);
    if (p2p_env) unsetenv("MGPU_P2P");
    if (!ar) fail("allreduce");
    for (bytes = 4096; bytes <= max_bytes; bytes *= 4) {
        const int64_t count = (int64_t)(bytes / sizeof(float));
        const double copy = copy_gbs[dev_is_gpu(mgpu_device_set_get(set, 0))];
        double times[32], sec, traffic;
        reps = bytes <= ((size_t)1 << 20) ? 31 : bytes <= ((size_t)64 << 20) ? 11 : 5;
        for (r = 0; r < n; ++r) {
            t[r] = mgpu_tensor_create(mgpu_device_set_get(set, r), MGPU_F32, mgpu_shape1(count));
            if (!t[r] || mgpu_rand_uniform(t[r], 2, (uint64_t)r << 32, -1, 1)) fail("allreduce buffers");
        }
        for (i = -2; i < reps; ++i) {
            double t0;
            for (r = 0; r < n; ++r) mgpu_device_synchronize(mgpu_device_set_get(set, r));
            t0 = mgpu_seconds();
            if (mgpu_allreduce_sum(ar, t, n)) fail("allreduce");
            for (r = 0; r < n; ++r) mgpu_device_synchronize(mgpu_device_set_get(set, r));
            if (i >= 0) times[i] = mgpu_seconds() - t0;
        }
        sec = median(times, reps);
        {   /* allreduce_host_4KiB, allreduce_p2p-oneshot_4KiB */
            const char *backend = mgpu_allreduce_name(mgpu_allreduce_backend(ar)), *algorithm = mgpu_allreduce_algorithm(ar, bytes);
            if (!strcmp(backend, algorithm)) snprintf(name, sizeof name, "allreduce_%s_%zuKiB", backend, bytes / 1024);
            else snprintf(name, sizeof name, "allreduce_%s-%s%s_%zuKiB", backend, algorithm, p2p_env ? "-forced" : "", bytes / 1024);
        }
        row(name, where, "time", sec * 1e6, "us", NULL);
        row(name, where, "algbw", (double)bytes / sec / 1e9, "GB/s", NULL);
        row(name, where, "busbw", (double)bytes / sec / 1e9 * 2.0 * (all - 1) / all, "GB/s", NULL);
        traffic = mgpu_allreduce_memory_traffic(ar, bytes);
        if (traffic > 0.0 && bytes * (size_t)n >= ((size_t)64 << 20)) {   /* what the sum reads and writes per second in
            the memory the replicas share; from 64 MiB in all (beyond the caches) */
            row(name, spec, "mem_bw", traffic / sec / 1e9, "GB/s", "memory read+written");
            if (copy > 0.0) row(name, spec, "mem_of_copy", traffic / sec / 1e9 / copy, "x", "of the copy bandwidth");
        }
        for (r = 0; r < n; ++r) mgpu_tensor_destroy(t[r]);
    }
    mgpu_allreduce_destroy(ar);
    mgpu_device_set_destroy(set);
}

/* ---- data parallelism: a step on N replicas against one, and how much of the all-reduce time
   the step hides behind backward. Measured apart on the N replicas, interleaved step by step so
   that a slow spell of the machine touches all three alike: the training step; the step without
   any all-reduce (forward, backward and the optimizer: mgpu_model_accumulate +
   mgpu_optimizer_step); one all-reduce of the whole gradient buffer alone.
   hidden = (compute + all-reduce - step) / all-reduce, kept within [0, 1]; not given where the
   all-reduce is under 5% of the step, which is within the timing noise. ---- */
enum { TIME_STEP, TIME_COMPUTE, TIME_ALLREDUCE, TIME_KINDS };

static double time_one(mgpu_model* m, mgpu_optimizer* opt, const mgpu_tensor* x, const mgpu_tensor* y, int what, mgpu_allreduce* ar) {
    mgpu_tensor* grads[MGPU__MAX_REPLICAS];
    const int n = mgpu_model_replica_count(m);
    double t0;
    int r, bad;
    for (r = 0; r < n; ++r) grads[r] = mgpu_model_grads(m, r);
    for (r = 0; r < n; ++r) mgpu_device_synchronize(mgpu_model_device(m, r));
    t0 = mgpu_seconds();
    if (what == TIME_STEP) bad = mgpu_model_train_step(m, opt, x, y, NULL) != MGPU_OK;
    else if (what == TIME_COMPUTE) bad = mgpu_model_zero_grad(m) || mgpu_model_accumulate(m, x, y, 0, NULL) || mgpu_optimizer_step(opt);
    else bad = mgpu_allreduce_sum(ar, grads, n) != MGPU_OK;
    if (bad) fail("data-parallel step");
    for (r = 0; r < n; ++r) mgpu_device_synchronize(mgpu_model_device(m, r));
    return mgpu_seconds() - t0;
}

/* median seconds of each kind (only the step for one replica) */
static void dp_measure(const char* model_name, const char* spec, int batch, int steps, int tf32, double sec[TIME_KINDS]) {
    training tr = training_create(model_name, spec, batch, tf32);
    mgpu_allreduce* ar = NULL;
    double* t[TIME_KINDS];
    int i, k;
    const int kinds = mgpu_model_replica_count(tr.m) > 1 ? TIME_KINDS : 1;
    if (kinds > 1 && !(ar = mgpu_allreduce_create(tr.set, mgpu_model_allreduce_backend(tr.m)))) fail("data-parallel all-reduce");
    for (k = 0; k < TIME_KINDS; ++k) t[k] = (double*)calloc((size_t)steps, sizeof(double));
    for (i = -3; i < steps; ++i)   /* three warm-ups */
        for (k = 0; k < kinds; ++k) {
            const double s = time_one(tr.m, tr.opt, tr.x, tr.y, k, ar);
            if (i >= 0) t[k][i] = s;
        }
    for (k = 0; k < TIME_KINDS; ++k) {
        sec[k] = median(t[k], steps);
        free(t[k]);
    }
    mgpu_allreduce_destroy(ar);
    training_destroy(&tr);
}

static void bench_data_parallel(const char* model_name, const char* one, const char* spec, int batch, int steps, int tf32) {
    const int gpus = !strncmp(spec, "cuda", 4);
    double a[TIME_KINDS], b[TIME_KINDS], later[TIME_KINDS], hidden;
    char name[64], note[96];
    dp_measure(model_name, one, batch, steps, tf32, a);
    dp_measure(model_name, spec, batch, steps, tf32, b);
    if (gpus) {   /* each bucket's update during backward (MGPU_OVERLAP_UPDATE, the default) against all of it after */
        mgpu__overlap_update_setting = 0;
        dp_measure(model_name, spec, batch, steps, tf32, later);
        mgpu__overlap_update_setting = -1;
    }
    snprintf(name, sizeof name, "dp_%s_b%d", model_name, batch);
    snprintf(note, sizeof note, "one device (%s): %.4g ms", one, a[TIME_STEP] * 1e3);
    row(name, spec, "step", b[TIME_STEP] * 1e3, "ms", NULL);
    row(name, spec, "vs_one_device", a[TIME_STEP] / b[TIME_STEP], "x", note);
    if (gpus) {
        snprintf(note, sizeof note, "the step with MGPU_OVERLAP_UPDATE=0 (the update after backward): %.4g ms", later[TIME_STEP] * 1e3);
        row(name, spec, "vs_update_after_backward", later[TIME_STEP] / b[TIME_STEP], "x", note);
    }
    row(name, spec, "compute_only", b[TIME_COMPUTE] * 1e3, "ms", "forward, backward, optimizer; no all-reduce");
    row(name, spec, "allreduce", b[TIME_ALLREDUCE] * 1e3, "ms", "the whole gradient buffer, alone");
    if (b[TIME_ALLREDUCE] < 0.05 * b[TIME_STEP]) {
        snprintf(note, sizeof note, "hidden fraction: the all-reduce is %.1f%% of the step, within timing noise",
                 100.0 * b[TIME_ALLREDUCE] / b[TIME_STEP]);
        row(name, spec, "skipped", 0, "", note);
        return;
    }
    hidden = (b[TIME_COMPUTE] + b[TIME_ALLREDUCE] - b[TIME_STEP]) / b[TIME_ALLREDUCE];
    row(name, spec, "hidden", hidden < 0.0 ? 0.0 : hidden > 1.0 ? 1.0 : hidden, "x", "of the all-reduce time hidden behind backward");
}

/* A pipeline's step against one device's, and its bubble: from a trace of one step, the share of
   the step's span that a stage's device spends idle, averaged over the stages, beside GPipe's and
   1F1B's theoretical (S - 1) / (M + S - 1) (equal stages, no copies). */
static double step_time(training* tr, int steps) {
    double* t = (double*)malloc(sizeof(double) * (size_t)steps);
    double med;
    int i;
    for (i = 0; i < 2; ++i) if (mgpu_model_train_step(tr->m, tr->opt, tr->x, tr->y, NULL)) fail("step");
    for (i = 0; i < steps; ++i) {
        double t0 = mgpu_seconds();
        int d;
        if (mgpu_model_train_step(tr->m, tr->opt, tr->x, tr->y, NULL)) fail("step");
        for (d = 0; d < mgpu_device_set_count(tr->set); ++d) mgpu_device_synchronize(mgpu_device_set_get(tr->set, d));
        t[i] = mgpu_seconds() - t0;
    }
    med = median(t, steps);
    free(t);
    return med;
}
static void bench_pipeline(const char* model_name, const char* one, const char* spec, int stages, int micro,
                           mgpu_pipeline_schedule schedule, int batch, int steps) {
    char name[96], note[160], line[512];
    const char* path = "/tmp/mgpu_bench_trace.json";
    double busy[64], first = 1e30, last = 0.0, idle = 0.0, base, piped;
    training tr;
    FILE* f;
    int s;
    tr = training_create(model_name, one, batch, 0);
    base = step_time(&tr, steps);
    training_destroy(&tr);
    pipe_stages = stages; pipe_micro = micro; pipe_schedule = schedule;
    tr = training_create(model_name, spec, batch, 0);
    pipe_stages = pipe_micro = 0; pipe_schedule = MGPU_PIPELINE_1F1B;
    piped = step_time(&tr, steps);
    snprintf(name, sizeof name, "pipe_%s_b%d_s%dm%d_%s", model_name, batch, stages, micro, schedule == MGPU_PIPELINE_GPIPE ? "gpipe" : "1f1b");
    row(name, spec, "step", piped * 1e3, "ms", NULL);
    row(name, spec, "samples_per_s", batch / piped, "samples/s", NULL);
    row(name, spec, "vs_one_device", base / piped, "x", one);
    for (s = 0; s < stages && s < 64; ++s) busy[s] = 0.0;
    if (mgpu_model_trace_start(tr.m) || mgpu_model_train_step(tr.m, tr.opt, tr.x, tr.y, NULL) || mgpu_model_trace_stop(tr.m, path)) fail(name);
    f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {   /* the replica 0's forward and backward slices */
        char what[64];
        int tid;
        double ts, dur;
        const char* at = strstr(line, "{\"name\": \"");
        if (!at || sscanf(at, "{\"name\": \"%63[^\"]\", \"ph\": \"X\", \"pid\": 1, \"tid\": %d, \"ts\": %lf, \"dur\": %lf",
                          what, &tid, &ts, &dur) != 4) continue;
        if ((what[0] != 'F' && what[0] != 'B') || tid % 2 || tid / 2 >= stages) continue;
        busy[tid / 2] += dur;
        if (ts < first) first = ts;
        if (ts + dur > last) last = ts + dur;
    }
    if (f) fclose(f);
    remove(path);
    for (s = 0; s < stages && last > first; ++s) idle += 1.0 - busy[s] / (last - first);
    snprintf(note, sizeof note, "idle share of the forward-backward span, averaged over the stages; theory %.3f",
             (double)(stages - 1) / (micro + stages - 1));
    row(name, spec, "bubble", idle / stages, "x", note);
    training_destroy(&tr);
}

#ifdef MGPU_BENCH_EMU
#include "emu.h"
/* What one training step asks of the GPUs, counted by the emulator: batches from the CPU (as a
   loader gives them), the loss read every 10th step (as build/train reads it: that read is the
   one synchronisation left, so counted apart), op by op or as a CUDA graph. Per step, after a
   warm-up of 3 steps; the devices are synchronised before each step and that is not counted. */
static void emu_counts(const char* model_name, const char* spec, const char* allreduce, int batch, int graph) {
    training tr;
    mgpu_tensor *x, *y;
    mgpu_emu_counters a, b, s = {0};
    const int steps = 10;
    int i, r, replicas;
    float loss;
    if (allreduce) setenv("MGPU_ALLREDUCE", allreduce, 1);
    use_graph = graph;
    tr = training_create(model_name, spec, batch, 0);
    x = mgpu_tensor_to(tr.x, mgpu_device_cpu());
    y = mgpu_tensor_to(tr.y, mgpu_device_cpu());
    if (!x || !y) fail(spec);
    replicas = mgpu_model_replica_count(tr.m);
    for (i = 0; i < 3; ++i) if (mgpu_model_train_step(tr.m, tr.opt, x, y, NULL)) fail(spec);
    for (i = 0; i < steps; ++i) {
        for (r = 0; r < mgpu_device_set_count(tr.set); ++r) if (mgpu_device_synchronize(mgpu_device_set_get(tr.set, r))) fail(spec);
        mgpu_emu_get_counters(&a);
        if (mgpu_model_train_step(tr.m, tr.opt, x, y, NULL)) fail(spec);
        mgpu_emu_get_counters(&b);
#define EMU_ADD(f) s.f += b.f - a.f;
        EMU_ADD(launches) EMU_ADD(gemms) EMU_ADD(syncs) EMU_ADD(allocs) EMU_ADD(copies_h2d) EMU_ADD(copies_d2h)
        EMU_ADD(copies_peer) EMU_ADD(event_records) EMU_ADD(event_waits) EMU_ADD(set_device) EMU_ADD(get_device)
        EMU_ADD(graph_launches) EMU_ADD(collectives)
#undef EMU_ADD
    }
    mgpu_emu_get_counters(&a);
    if (mgpu_model_last_loss(tr.m, &loss)) fail(spec);
    mgpu_emu_get_counters(&b);
    char layout[48] = "";
    if (pipe_stages > 1) snprintf(layout, sizeof layout, ", %d x %d stages", replicas, pipe_stages);
    if (use_bf16) snprintf(layout + strlen(layout), sizeof layout - strlen(layout), ", bf16");
    if (!mgpu__epilogues_on()) snprintf(layout + strlen(layout), sizeof layout - strlen(layout), ", no epilogues");
    if (mgpu__fuse_relu_on()) snprintf(layout + strlen(layout), sizeof layout - strlen(layout), ", ReLU fused");
    if (mgpu__fuse_gelu_on()) snprintf(layout + strlen(layout), sizeof layout - strlen(layout), ", GELU fused");
    printf("| %s b%d%s | %s | %s | %s | %.1f | %.1f | %.1f | %.1f/%.1f | %.1f | %.1f/%.1f | %.1f | %.1f | %.1f/%.1f | %.1f | %llu |\n",
           model_name, batch, layout, spec, mgpu_allreduce_name(mgpu_model_allreduce_backend(tr.m)),
           mgpu_model_graph_steps(tr.m) ? "graph" : "eager", (double)s.graph_launches / steps,
           (double)(s.launches - s.gemms) / steps, (double)s.gemms / steps, (double)s.copies_h2d / steps,
           (double)s.copies_d2h / steps, (double)s.copies_peer / steps, (double)s.event_records / steps,
           (double)s.event_waits / steps, (double)s.syncs / steps, (double)s.allocs / steps, (double)s.set_device / steps,
           (double)s.get_device / steps, (double)s.collectives / steps, (unsigned long long)(b.syncs - a.syncs));
    fflush(stdout);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    training_destroy(&tr);
    use_graph = 0;
    if (allreduce) unsetenv("MGPU_ALLREDUCE");
}

static int bench_emu(void) {
    static const char* models[] = {"mlp784", "cnn"};
    int mi, graph;
    printf("One training step on emulated GPUs (MGPU_EMU_DEVICES=%s), batches from the CPU, per step: graph\n"
           "launches, kernel launches, cuBLAS GEMMs, copies host-to-device/device-to-host, peer copies, event\n"
           "records/waits, host synchronisations, device allocations, cudaSetDevice/cudaGetDevice calls, NCCL\n"
           "all-reduce calls; and the synchronisations of the loss read after them (build/train reads it once\n"
           "per progress line).\n\n", getenv("MGPU_EMU_DEVICES") ? getenv("MGPU_EMU_DEVICES") : "1");
    printf("| model | devices | all-reduce | step | graph launches | kernels | GEMMs | H2D/D2H copies | peer copies | "
           "event record/wait | host syncs | allocs | cudaSetDevice/GetDevice | NCCL calls | loss read syncs |\n");
    printf("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (mi = 0; mi < 2; ++mi)
        for (graph = 0; graph < 2; ++graph) {
            const int batch = mi ? 128 : 64;
            emu_counts(models[mi], "cuda:0", NULL, batch, graph);
            emu_counts(models[mi], "cuda:0,1,2,3", "nccl", batch, graph);
            emu_counts(models[mi], "cuda:0,1,2,3", "p2p", batch, graph);
            pipe_stages = 2; pipe_micro = 4;   /* 2 x 2: the copies between stages are peer copies */
            emu_counts(models[mi], "cuda:0,1,2,3", "p2p", batch, graph);
            pipe_stages = pipe_micro = 0;
        }
    use_bf16 = 1;   /* mixed precision: the conversions it adds (input, weights, output, loss gradient) */
    for (graph = 0; graph < 2; ++graph) emu_counts("mlp784", "cuda:0", NULL, 64, graph);
    use_bf16 = 0;
    /* the large MLP's layers (4 x Linear 4096 + ReLU, Linear 10) at batch 8, as it runs by default
       (cuBLASLt's epilogues), with MGPU_FUSE_RELU, and with MGPU_EPILOGUES=0 */
    emu_counts("mlp4096", "cuda:0", NULL, 8, 0);
    mgpu__fuse_relu_setting = 1;
    emu_counts("mlp4096", "cuda:0", NULL, 8, 0);
    mgpu__fuse_relu_setting = -1;
    mgpu__epilogue_setting = 0;
    emu_counts("mlp4096", "cuda:0", NULL, 8, 0);
    mgpu__epilogue_setting = -1;
    for (graph = 0; graph < 2; ++graph) {   /* the small GPT (4 blocks of width 128, T 64): a transformer's step */
        emu_counts("gpt", "cuda:0", NULL, 4, graph);
        emu_counts("gpt", "cuda:0,1,2,3", "p2p", 8, graph);
    }
    mgpu__fuse_gelu_setting = 1;   /* with MGPU_FUSE_GELU: the GELUs in the GEMMs that come before them */
    emu_counts("gpt", "cuda:0", NULL, 4, 0);
    mgpu__fuse_gelu_setting = -1;
    return 0;
}
#endif

/* ---- a checkpoint of a million small tensors: open it and read every tensor ---- */
/* bench safetensors PATH: writes PATH (count F32 [4] tensors, "layers.N.w"), then times
   mgpu_safetensors_open plus mgpu_safetensors_read of every tensor onto the CPU, by name, in the
   file's order; bench/bench_safetensors.py times the reference library on the same file. */
static void bench_safetensors(const char* path, int count) {
    mgpu__st_write_item* items = (mgpu__st_write_item*)calloc((size_t)count, sizeof *items);
    char (*names)[24] = (char(*)[24])calloc((size_t)count, sizeof *names);
    static const int64_t shape[1] = {4};
    static const float data[4] = {1, 2, 3, 4};
    char workload[64];
    double times[3];
    int i, rep;
    if (!items || !names) fail("safetensors bench: out of memory");
    for (i = 0; i < count; ++i) {
        snprintf(names[i], sizeof names[i], "layers.%d.w", i);
        items[i].name = names[i];
        items[i].dtype = "F32";
        items[i].ndim = 1;
        items[i].shape = shape;
        items[i].data = data;
        items[i].bytes = sizeof data;
    }
    if (mgpu__st_write(path, items, count, NULL, NULL, 0) != MGPU_OK) fail("safetensors bench: write");
    free(items);
    for (rep = 0; rep < 3; ++rep) {
        double t0 = mgpu_seconds();
        mgpu_safetensors* st = mgpu_safetensors_open(path);
        if (!st) fail("safetensors bench: open");
        for (i = 0; i < count; ++i) {
            mgpu_tensor* t = mgpu_safetensors_read(st, names[i], NULL);
            if (!t) fail("safetensors bench: read");
            mgpu_tensor_destroy(t);
        }
        mgpu_safetensors_close(st);
        times[rep] = mgpu_seconds() - t0;
    }
    free(names);
    snprintf(workload, sizeof workload, "safetensors_%dk_tensors", count / 1000);
    row(workload, "cpu", "open_read_all", median(times, 3) * 1e3, "ms", "open + read every F32 [4] tensor by name");
}

int main(int argc, char** argv) {
    const char* which = argc > 1 ? argv[1] : "all";
    if (!strcmp(which, "safetensors")) {   /* bench safetensors PATH [--quick] */
        quick = argc > 3 && !strcmp(argv[3], "--quick");
        if (argc < 3) { fprintf(stderr, "usage: bench safetensors PATH [--quick]\n"); return 2; }
        bench_safetensors(argv[2], quick ? 100000 : 1000000);
        return 0;
    }
    if (!strcmp(which, "mpi")) {   /* bench_mpi under mpirun -np P: the all-reduce across P processes, one CPU replica each */
        int i;
        if (mgpu_dist_init(&argc, &argv) != MGPU_OK) fail("mgpu_dist_init");
        for (i = 1; i < argc; ++i) quick |= !strcmp(argv[i], "--quick");
        bench_allreduce("cpu", quick ? (size_t)1 << 20 : (size_t)64 << 20, MGPU_ALLREDUCE_AUTO, NULL);
#ifdef MGPU_MPI
        {   /* the yardstick: MPI's own MPI_Allreduce (in place, MPI_SUM), which promises no order */
            const int P = mgpu_dist_size();
            size_t bytes;
            char name[64], where[32];
            snprintf(where, sizeof where, "%d processes x cpu", P);
            for (bytes = 4096; bytes <= (quick ? (size_t)1 << 20 : (size_t)64 << 20); bytes *= 4) {
                const int count = (int)(bytes / sizeof(float)), reps = bytes <= ((size_t)1 << 20) ? 31 : 11;
                float* buf = (float*)calloc((size_t)count, sizeof(float));
                double times[32], sec;
                if (!buf) fail("MPI_Allreduce buffer");
                for (i = -2; i < reps; ++i) {
                    double t0 = mgpu_seconds();
                    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                    if (i >= 0) times[i] = mgpu_seconds() - t0;
                }
                sec = median(times, reps);
                snprintf(name, sizeof name, "allreduce_MPI_Allreduce_%zuKiB", bytes / 1024);
                row(name, where, "time", sec * 1e6, "us", "Open MPI's own, no fixed order");
                row(name, where, "busbw", (double)bytes / sec / 1e9 * 2.0 * (P - 1) / P, "GB/s", "Open MPI's own, no fixed order");
                free(buf);
            }
        }
#endif
        mgpu_dist_shutdown();
        return 0;
    }
    if (!strcmp(which, "gemm")) {   /* the CPU GEMM rows alone */
        bench_cpu_gemms();
        return 0;
    }
    if (!strcmp(which, "steps")) {   /* the CPU training steps alone (bench_torch.py steps: PyTorch's) */
        bench_cpu_steps();
        return 0;
    }
    if (!strcmp(which, "tape")) {   /* the autograd rows alone */
        bench_tape_steps();
        return 0;
    }
    if (!strcmp(which, "gpt")) {   /* the CPU GPT step alone, for a profiler */
        bench_training("gpt_b16_t64", "gpt", "cpu", 16, quick ? 5 : 100, 0);
        return 0;
    }
    if (!strcmp(which, "memory")) {
        bench_training("mlp4096_b2048", "mlp4096", "cpu", 2048, 1, 0);
        return 0;
    }
    if (!strcmp(which, "allreduce")) {   /* the in-process host all-reduce alone, to set beside bench_mpi's */
        bench_allreduce("cpu:2", (size_t)64 << 20, MGPU_ALLREDUCE_HOST, NULL);
        bench_allreduce("cpu:4", (size_t)64 << 20, MGPU_ALLREDUCE_HOST, NULL);
        return 0;
    }
#ifdef MGPU_BENCH_EMU
    if (!strcmp(which, "emu")) return bench_emu();
#endif
    int cpu = strcmp(which, "cuda") != 0, cuda = strcmp(which, "cpu") != 0 && mgpu_cuda_device_count() > 0, i;
    for (i = 1; i < argc; ++i) quick |= !strcmp(argv[i], "--quick");
    row("threads", "cpu", "count", mgpu_cpu_threads(), "threads", NULL);
    if (cpu) {
        bench_cpu_gemms();
        bench_cpu_steps();
        bench_training("mlp784_b64", "mlp784", "cpu:2", 64, quick ? 50 : 300, 0);
        bench_bandwidth("cpu", (size_t)256 << 20, quick ? 2 : 5);
        bench_allreduce("cpu:2", quick ? (size_t)1 << 20 : (size_t)64 << 20, MGPU_ALLREDUCE_HOST, NULL);
        bench_allreduce("cpu:4", quick ? (size_t)1 << 20 : (size_t)64 << 20, MGPU_ALLREDUCE_HOST, NULL);   /* beside -np 4 */
        bench_data_parallel("cnn", "cpu", "cpu:2", 128, quick ? 3 : 20, 0);
        bench_pipeline("cnn", "cpu", "cpu:2", 2, 4, MGPU_PIPELINE_1F1B, 128, quick ? 3 : 10);
        bench_pipeline("cnn", "cpu", "cpu:2", 2, 8, MGPU_PIPELINE_GPIPE, 128, quick ? 3 : 10);
        bench_pipeline("cnn", "cpu", "cpu:4", 4, 8, MGPU_PIPELINE_1F1B, 128, quick ? 3 : 10);
    }
    if (cuda) {
        bench_gemm("cuda:0", 2048, 4096, 4096, 20);
        bench_gemm_layouts("cuda:0", 2048, 4096, 4096, 20);
        bench_training("mlp784_b64", "mlp784", "cuda:0", 64, 300, 0);
        bench_training("mlp4096_b2048", "mlp4096", "cuda:0", 2048, 20, 1);
        /* cuBLASLt's epilogues (on by default above): with the ReLUs in the GEMMs too, and off */
        mgpu__fuse_relu_setting = 1;
        bench_training("mlp4096_b2048_fuse_relu", "mlp4096", "cuda:0", 2048, 20, 0);
        mgpu__fuse_relu_setting = -1;
        mgpu__epilogue_setting = 0;
        bench_training("mlp4096_b2048_no_epilogues", "mlp4096", "cuda:0", 2048, 20, 0);
        mgpu__epilogue_setting = -1;
        bench_training("cnn_b128", "cnn", "cuda:0", 128, 100, 0);
        bench_training("gpt_b16_t64", "gpt", "cuda:0", 16, 100, 0);
        bench_attention("cuda:0", 1024, 64, 10);   /* GPT-2's head size */
        bench_attention("cuda:0", 2048, 64, 10);
        bench_attention("cuda:0", 1024, 128, 10);   /* Llama's */
        bench_attention("cuda:0", 2048, 128, 10);
        bench_training("gpt124m_b8_t1024", "gpt124m", "cuda:0", 8, 5, 0);   /* GPT-2 124M's shape, fp32 */
        mgpu__fuse_gelu_setting = 1;   /* the GELUs in the GEMMs before them too (MGPU_FUSE_GELU, off by default) */
        bench_training("gpt124m_b8_t1024_fuse_gelu", "gpt124m", "cuda:0", 8, 5, 0);
        mgpu__fuse_gelu_setting = -1;
        use_recompute = 1;   /* its LayerNorm and GELU outputs made again in backward: the memory saved, the time it costs */
        bench_training("gpt124m_b8_t1024_recompute", "gpt124m", "cuda:0", 8, 5, 0);
        use_recompute = 0;
        use_bf16 = 1;   /* mixed precision (desc.precision), beside PyTorch's bf16 autocast */
        bench_training("mlp4096_b2048_bf16", "mlp4096", "cuda:0", 2048, 20, 0);
        use_graph = 1;
        bench_training("mlp4096_b2048_bf16_graph", "mlp4096", "cuda:0", 2048, 20, 0);
        use_graph = use_bf16 = 0;
        /* eager against graph, the batch on the GPU already or coming from the CPU (pageable, staged) */
        use_graph = 1;
        bench_training("mlp784_b64_graph", "mlp784", "cuda:0", 64, 300, 0);
        bench_training("cnn_b128_graph", "cnn", "cuda:0", 128, 100, 0);
        batch_on_cpu = 1;
        bench_training("mlp784_b64_from_cpu_graph", "mlp784", "cuda:0", 64, 300, 0);
        use_graph = 0;
        bench_training("mlp784_b64_from_cpu", "mlp784", "cuda:0", 64, 300, 0);
        batch_on_cpu = 0;
        bench_training("mlp784_b64", "mlp784", "cuda:0,0", 64, 300, 0);
        bench_training("mlp4096_b2048", "mlp4096", "cuda:0,0", 2048, 20, 1);
        bench_bandwidth("cuda:0", (size_t)256 << 20, 20);
        bench_allreduce("cuda:0,0", (size_t)1 << 30, MGPU_ALLREDUCE_P2P, NULL);
        bench_allreduce("cuda:0,0,0,0", (size_t)1 << 30, MGPU_ALLREDUCE_P2P, NULL);
        bench_allreduce("cuda:0,0,0,0", (size_t)1 << 30, MGPU_ALLREDUCE_P2P, "ring");
        bench_allreduce("cuda:0,0,0,0", (size_t)1 << 30, MGPU_ALLREDUCE_HOST, NULL);
        if (mgpu_cuda_device_count() > 1) bench_allreduce("cuda", (size_t)1 << 30, MGPU_ALLREDUCE_AUTO, NULL);
        bench_data_parallel("mlp4096", "cuda:0", "cuda:0,0", 2048, 20, 1);
        bench_data_parallel("mlp4096", "cuda:0", "cuda:0,0,0,0", 2048, 20, 1);
        if (mgpu_cuda_device_count() > 1) bench_data_parallel("mlp4096", "cuda:0", "cuda", 2048, 20, 1);
    } else if (strcmp(which, "cpu") != 0) {
        row("gpu_workloads", "cuda", "skipped", 0, "", "no GPU on this machine");
    }
    return 0;
}
