#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_model.c - layers, models, optimizers, training, checkpoints and the data loader.

   1. gradient checks of every built-in layer (and of a custom one) against central finite
      differences, forward passes against float64 loops (Linear, Conv2d in PyTorch's
      [out, in, kh, kw] layout, MaxPool2d, the activations)
   2. initialisation (bounds, spread, seeds, replicas)
   3. model errors (shapes, NULL layers, bad inputs and targets, summary)
   4. a custom layer through mgpu_layer_vtable
   5. SGD and AdamW against PyTorch's rules in float64, learning-rate schedules, invalid descs;
      5b. parameter groups without weight decay and clipping by global norm (float64, cpu:2 data
      parallel and pipelined, the GPU twin)
   6. training: loss goes down, analytic first-step gradients, evaluate, determinism,
      data-parallel equivalence on cpu:2, cpu:3, cpu:4
   7. checkpoints: round trips, exact resume, every kind of bad file, atomic save
   8. IDX data sets (plain and gzipped) and the shuffling loader; Fashion-MNIST when installed
   9. CUDA twins of the above (a skip each without a GPU; a failure with MGPU_TEST_REQUIRE_GPU=1)
   11-13. the API a harness needs: part of a file (prefix, extra tensors), user metadata,
      parameters and gradients by name, optimizer state by name and a reset (and their CUDA twin)

   The input gradient of a layer is checked by putting a custom "AddInput" layer in front of it:
   y = x + P with a learnable P of the whole batch's shape, so dL/dP is exactly the layer's dx and
   the finite differences of P are those of x; every gradient is then a parameter gradient.
   MGPU_TEST_QUICK=1 uses fewer steps; MGPU_TEST_SEED=N repeats a run's random inputs. */

#include <stdint.h>
#include <time.h>
#include <errno.h>
#include <dirent.h>
#include <sys/stat.h>


#define TEST_PI 3.14159265358979323846

/* ============================================================================================ */
/* globals and helpers                                                                          */
/* ============================================================================================ */
#ifdef MGPU_CUDA
static mgpu_device_set* g_gpu_set;
static mgpu_device* g_gpu;
#endif
static char g_tmpdir[256];


/* A group's GPU part that no GPU runs: a skip (test_gpu_group). */
static void gpu_group_note(const char* group) {
#ifdef MGPU_CUDA
    (void)test_gpu_group(group, g_gpu != NULL);
#else
    (void)test_gpu_group(group, 0);
#endif
}

/* host random numbers for test inputs (splitmix64) */

static void rnd_normal(float* x, int64_t n, double std) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)(std * rng_gauss());
}
/* away from 0 (the ReLU kink): magnitude in [0.1, 2], random sign */
static void rnd_kinkfree(float* x, int64_t n) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)((0.1 + 1.9 * rng_unit()) * (rng_u64() & 1 ? 1.0 : -1.0));
}
/* distinct values 0.05 apart in a random order (no ties anywhere: MaxPool has no kinks nearby) */
static void rnd_distinct(float* x, int64_t n) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)(0.05 * (double)i - 0.025 * (double)n);
    for (i = n - 1; i > 0; --i) {
        int64_t j = (int64_t)(rng_u64() % (uint64_t)(i + 1));
        float t = x[i]; x[i] = x[j]; x[j] = t;
    }
}

/* A tensor the test cannot go on without: a failure here ends the run (with its summary). */


static void expect_null(const void* p, mgpu_result want, const char* what, const char* s1, const char* s2,
                        const char* s3) {
    CHECK(p == NULL, "%s: expected NULL", what);
    expect_fail(p ? MGPU_OK : mgpu_last_result(), want, what, s1, s2, s3);
}

static double rel_diff(double a, double b) { return fabs(a - b) / fmax(fabs(b), 1e-30); }
static double rel_error_ff(const float* x, const float* ref, int64_t n) {
    double* r = dbuf(n), e;
    int64_t i;
    for (i = 0; i < n; ++i) r[i] = ref[i];
    e = test_rel_error(x, r, (size_t)n);
    free(r);
    return e;
}
static int same_bits(const void* a, const void* b, size_t bytes) { return bytes == 0 || memcmp(a, b, bytes) == 0; }

/* log capture (for the warnings a test provokes on purpose) */
typedef struct log_capture { int calls, warnings; char last[1024]; } log_capture;
static void capture_log(mgpu_log_level level, const char* message, void* user) {
    log_capture* c = (log_capture*)user;
    c->calls++;
    if (level == MGPU_LOG_WARN) c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", message);
}

/* ---- temporary files ---- */
static const char* tpath(char* buf, size_t size, const char* name) {
    snprintf(buf, size, "%s/%s", g_tmpdir, name);
    return buf;
}
static int write_file(const char* path, const void* data, size_t len) {
    FILE* f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok;
}
static uint8_t* read_file(const char* path, size_t* len) {
    FILE* f = fopen(path, "rb");
    uint8_t* p;
    long n;
    *len = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = (uint8_t*)xmalloc((size_t)n + 1);
    *len = fread(p, 1, (size_t)n, f);
    fclose(f);
    return p;
}
static int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}
/* files in the temporary directory whose name contains `part` (leftover temporary files) */
static int count_files_with(const char* dir, const char* part) {
    DIR* d = opendir(dir);
    struct dirent* e;
    int n = 0;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) n += strstr(e->d_name, part) != NULL;
    closedir(d);
    return n;
}
static void remove_tree(const char* path) { test_remove_tree(path); }

/* ---- models ---- */
static mgpu_model* try_model(mgpu_shape input, mgpu_layer** layers, int n, const mgpu_device_set* devs,
                             mgpu_loss_kind loss, uint64_t seed) {
    mgpu_model_desc d;
    memset(&d, 0, sizeof d);
    d.input = input;
    d.layers = layers;
    d.layer_count = n;
    d.devices = devs;
    d.loss = loss;
    d.seed = seed;
    return mgpu_model_create(&d);
}
static mgpu_model* make_model(mgpu_shape input, mgpu_layer** layers, int n, const mgpu_device_set* devs,
                              mgpu_loss_kind loss, uint64_t seed) {
    mgpu_model* m = try_model(input, layers, n, devs, loss, seed);
    if (!m) CHECK(0, "mgpu_model_create: %s", mgpu_last_error());
    return m;
}
#define NLAYERS(...) ((int)(sizeof((mgpu_layer*[]){__VA_ARGS__}) / sizeof(mgpu_layer*)))
#define MODEL(input, devs, loss, seed, ...) \
    make_model(input, (mgpu_layer*[]){__VA_ARGS__}, NLAYERS(__VA_ARGS__), devs, loss, seed)
/* the same for a model that is expected to fail */
#define TRY_MODEL(input, devs, loss, seed, ...) \
    try_model(input, (mgpu_layer*[]){__VA_ARGS__}, NLAYERS(__VA_ARGS__), devs, loss, seed)

static int64_t flat_n(const mgpu_model* m) { return mgpu_tensor_numel(mgpu_model_params(m, 0)); }
static float* get_flat(const mgpu_model* m, int rep) {
    float* p = fbuf(flat_n(m));
    tget(mgpu_model_params(m, rep), p);
    return p;
}
static float* get_grads(const mgpu_model* m, int rep) {
    float* p = fbuf(flat_n(m));
    tget(mgpu_model_grads(m, rep), p);
    return p;
}
static void put_flat(mgpu_model* m, int rep, const float* p) { tput(mgpu_model_params(m, rep), p); }
static void put_grads(mgpu_model* m, int rep, const float* g) { tput(mgpu_model_grads(m, rep), g); }
/* offset (in floats) of named tensor i in the flat buffers: the view's address minus the buffer's */
static int64_t toff(const mgpu_model* m, int i) {
    return (int64_t)(((const char*)mgpu_tensor_data(mgpu_model_tensor(m, 0, i)) -
                      (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / (ptrdiff_t)sizeof(float));
}
static int64_t tnumel(const mgpu_model* m, int i) { return mgpu_tensor_numel(mgpu_model_tensor(m, 0, i)); }
static int tindex(const mgpu_model* m, const char* name) {
    int i;
    for (i = 0; i < mgpu_model_tensor_count(m); ++i)
        if (!strcmp(mgpu_model_tensor_name(m, i), name)) return i;
    return -1;
}
/* every replica's flat parameters bit-identical to replica 0's */
static int replicas_identical(const mgpu_model* m) {
    float* p0 = get_flat(m, 0);
    int i, same = 1;
    for (i = 1; i < mgpu_model_replica_count(m); ++i) {
        float* p = get_flat(m, i);
        same &= same_bits(p0, p, (size_t)flat_n(m) * sizeof(float));
        free(p);
    }
    free(p0);
    return same;
}
static mgpu_optimizer* make_opt(mgpu_model* m, mgpu_optimizer_kind kind, float lr, float momentum, float wd) {
    mgpu_optimizer_desc d;
    mgpu_optimizer* o;
    memset(&d, 0, sizeof d);
    d.kind = kind;
    d.lr = lr;
    d.momentum = momentum;
    d.weight_decay = wd;
    o = mgpu_optimizer_create(m, &d);
    if (!o) CHECK(0, "mgpu_optimizer_create: %s", mgpu_last_error());
    return o;
}

/* ============================================================================================ */
/* custom layers: AddInput (y = x + P, P learnable of the whole input's shape) and Scale        */
/* ============================================================================================ */
typedef struct custom_info {
    mgpu_shape shape;     /* AddInput: P's shape */
    int* destroyed;       /* incremented by destroy */
    float init;           /* Scale: initial value */
} custom_info;

static custom_info* new_info(mgpu_shape shape, int* destroyed, float init) {
    custom_info* u = (custom_info*)xmalloc(sizeof *u);
    u->shape = shape;
    u->destroyed = destroyed;
    u->init = init;
    return u;
}
static void custom_destroy(mgpu_layer* l) {
    custom_info* u = (custom_info*)mgpu_layer_user_data(l);
    if (u->destroyed) ++*u->destroyed;
    free(u);
}
static int one_param(const mgpu_layer* l) { (void)l; return 1; }

static mgpu_result addin_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    const custom_info* u = (const custom_info*)mgpu_layer_user_data(l);
    (void)i;
    *name = "input";
    *shape = u->shape;
    return MGPU_OK;
}
static mgpu_result addin_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l;
    return mgpu_add(y, x, ctx->params[0]);
}
static mgpu_result addin_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                  const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu_result r;
    (void)l; (void)x; (void)y;
    r = mgpu_add(ctx->grads[0], ctx->grads[0], dy);
    if (r == MGPU_OK && dx) r = mgpu_tensor_copy(dx, dy);
    return r;
}
static const mgpu_layer_vtable addin_vt = {
    "AddInput", NULL, one_param, addin_param_shape, NULL, NULL, NULL, addin_forward, addin_backward, NULL, custom_destroy, NULL, NULL
};
static mgpu_layer* addin_layer(mgpu_shape shape, int* destroyed) {
    custom_info* u = new_info(shape, destroyed, 0.0f);
    mgpu_layer* l = mgpu_layer_create(&addin_vt, u);
    if (!l) { CHECK(0, "mgpu_layer_create(AddInput): %s", mgpu_last_error()); free(u); }
    return l;
}

/* Scale: y = s * x with one learnable scalar s */
static mgpu_result scale_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    (void)l; (void)i;
    *name = "scale";
    *shape = mgpu_shape1(1);
    return MGPU_OK;
}
static mgpu_result scale_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    const custom_info* u = (const custom_info*)mgpu_layer_user_data(l);
    (void)seed;
    return mgpu_tensor_fill(ctx->params[0], u->init);
}
static float scalar_of(const mgpu_tensor* t) {
    float v = 0.0f;
    mgpu_tensor_download(t, &v, sizeof v);
    return v;
}
static mgpu_result scale_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l;
    return mgpu_scale(y, x, scalar_of(ctx->params[0]));
}
static mgpu_result scale_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                  const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    int64_t n = mgpu_tensor_numel(x), i;
    float* hx = fbuf(n);
    float* hdy = fbuf(n);
    double s = 0.0;
    float g = 0.0f;   /* stays unused when a download fails; set for clang's -Wsometimes-uninitialized */
    mgpu_result r;
    (void)l; (void)y;
    r = mgpu_tensor_download(x, hx, mgpu_tensor_bytes(x));
    if (r == MGPU_OK) r = mgpu_tensor_download(dy, hdy, mgpu_tensor_bytes(dy));
    for (i = 0; i < n; ++i) s += (double)hx[i] * hdy[i];
    free(hx);
    free(hdy);
    if (r == MGPU_OK) r = mgpu_tensor_download(ctx->grads[0], &g, sizeof g);
    g += (float)s;   /* backward ADDS into the gradient */
    if (r == MGPU_OK) r = mgpu_tensor_upload(ctx->grads[0], &g, sizeof g);
    if (r == MGPU_OK && dx) r = mgpu_scale(dx, dy, scalar_of(ctx->params[0]));
    return r;
}
static void scale_describe(const mgpu_layer* l, char* buf, size_t size) {
    const custom_info* u = (const custom_info*)mgpu_layer_user_data(l);
    snprintf(buf, size, "init %g", (double)u->init);
}
static const mgpu_layer_vtable scale_vt = {
    "Scale", NULL, one_param, scale_param_shape, scale_init, NULL, NULL, scale_forward, scale_backward,
    scale_describe, custom_destroy, NULL, NULL
};
static mgpu_layer* scale_layer(float init, int* destroyed) {
    custom_info* u = new_info(mgpu_shape1(1), destroyed, init);
    mgpu_layer* l = mgpu_layer_create(&scale_vt, u);
    if (!l) { CHECK(0, "mgpu_layer_create(Scale): %s", mgpu_last_error()); free(u); }
    return l;
}

/* ============================================================================================ */
/* 1. gradient checks and forward references, every layer                                      */
/* ============================================================================================ */
typedef enum layer_kind {
    LK_LINEAR, LK_RELU, LK_GELU, LK_TANH, LK_SIGMOID, LK_DROPOUT, LK_FLATTEN, LK_CONV, LK_POOL, LK_SCALE
} layer_kind;

typedef struct layer_spec {
    const char* label;
    layer_kind kind;
    int batch;
    mgpu_shape sample;                 /* one sample's input shape */
    int in, out, k, stride, pad;       /* Linear: in/out; Conv2d: channels, kernel, stride, padding */
    float p;                           /* Dropout */
} layer_spec;

static mgpu_layer* spec_layer(const layer_spec* s) {
    switch (s->kind) {
    case LK_LINEAR: return mgpu_layer_linear(s->in, s->out);
    case LK_RELU: return mgpu_layer_relu();
    case LK_GELU: return mgpu_layer_gelu();
    case LK_TANH: return mgpu_layer_tanh();
    case LK_SIGMOID: return mgpu_layer_sigmoid();
    case LK_DROPOUT: return mgpu_layer_dropout(s->p);
    case LK_FLATTEN: return mgpu_layer_flatten();
    case LK_CONV: return mgpu_layer_conv2d(s->in, s->out, s->k, s->stride, s->pad);
    case LK_POOL: return mgpu_layer_maxpool2d(s->k, s->stride);
    case LK_SCALE: return scale_layer(1.5f, NULL);
    }
    return NULL;
}

/* [batch, sample...] */
static mgpu_shape batch_shape(int batch, mgpu_shape sample) {
    mgpu_shape s;
    int i;
    memset(&s, 0, sizeof s);
    s.ndim = sample.ndim + 1;
    s.dim[0] = batch;
    for (i = 0; i < sample.ndim; ++i) s.dim[i + 1] = sample.dim[i];
    return s;
}

/* the expected output shape of the layer for x [batch, sample...] */
static mgpu_shape spec_out_shape(const layer_spec* s) {
    mgpu_shape x = batch_shape(s->batch, s->sample), y = x;
    int64_t rest = 1;
    int i, stride = s->stride ? s->stride : s->k;
    switch (s->kind) {
    case LK_LINEAR: y = mgpu_shape2(s->batch, s->out); break;
    case LK_FLATTEN:
        for (i = 1; i < x.ndim; ++i) rest *= x.dim[i];
        y = mgpu_shape2(s->batch, rest);
        break;
    case LK_CONV:
        y = mgpu_shape4(s->batch, s->out, (x.dim[2] + 2 * s->pad - s->k) / s->stride + 1,
                        (x.dim[3] + 2 * s->pad - s->k) / s->stride + 1);
        break;
    case LK_POOL:
        y = mgpu_shape4(s->batch, x.dim[1], (x.dim[2] - s->k) / stride + 1, (x.dim[3] - s->k) / stride + 1);
        break;
    default: break;
    }
    return y;
}

/* float64 forward of the layer: x is the input [batch, sample...], w and b its parameters.
   Returns 0 when there is no deterministic reference (Dropout). */
static int spec_ref(const layer_spec* s, const float* x, const float* w, const float* b, double* y) {
    mgpu_shape xs = batch_shape(s->batch, s->sample), ys = spec_out_shape(s);
    int64_t n = mgpu_shape_numel(xs), i;
    switch (s->kind) {
    case LK_LINEAR: {
        int bi, o, k;
        for (bi = 0; bi < s->batch; ++bi)
            for (o = 0; o < s->out; ++o) {
                double acc = b[o];
                for (k = 0; k < s->in; ++k) acc += (double)x[bi * s->in + k] * w[o * s->in + k];
                y[bi * s->out + o] = acc;
            }
        return 1;
    }
    case LK_RELU: for (i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] : 0.0; return 1;
    case LK_GELU: for (i = 0; i < n; ++i) y[i] = 0.5 * x[i] * (1.0 + erf(x[i] / sqrt(2.0))); return 1;
    case LK_TANH: for (i = 0; i < n; ++i) y[i] = tanh((double)x[i]); return 1;
    case LK_SIGMOID: for (i = 0; i < n; ++i) y[i] = 1.0 / (1.0 + exp(-(double)x[i])); return 1;
    case LK_FLATTEN: for (i = 0; i < n; ++i) y[i] = x[i]; return 1;
    case LK_SCALE: for (i = 0; i < n; ++i) y[i] = (double)w[0] * x[i]; return 1;
    case LK_DROPOUT: return 0;
    case LK_CONV: {
        /* PyTorch's Conv2d: weight [out, in, kh, kw], zero padding, cross-correlation */
        int64_t C = xs.dim[1], H = xs.dim[2], W = xs.dim[3], OH = ys.dim[2], OW = ys.dim[3];
        int64_t nb, o, oy, ox, c, ky, kx;
        for (nb = 0; nb < s->batch; ++nb)
            for (o = 0; o < s->out; ++o)
                for (oy = 0; oy < OH; ++oy)
                    for (ox = 0; ox < OW; ++ox) {
                        double acc = b[o];
                        for (c = 0; c < C; ++c)
                            for (ky = 0; ky < s->k; ++ky)
                                for (kx = 0; kx < s->k; ++kx) {
                                    int64_t iy = oy * s->stride - s->pad + ky, ix = ox * s->stride - s->pad + kx;
                                    if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                                    acc += (double)w[((o * C + c) * s->k + ky) * s->k + kx] *
                                           x[((nb * C + c) * H + iy) * W + ix];
                                }
                        y[((nb * s->out + o) * OH + oy) * OW + ox] = acc;
                    }
        return 1;
    }
    case LK_POOL: {
        int64_t C = xs.dim[1], H = xs.dim[2], W = xs.dim[3], OH = ys.dim[2], OW = ys.dim[3];
        int64_t st = s->stride ? s->stride : s->k, pl, oy, ox, ky, kx;
        for (pl = 0; pl < s->batch * C; ++pl)
            for (oy = 0; oy < OH; ++oy)
                for (ox = 0; ox < OW; ++ox) {
                    double best = -INFINITY;
                    for (ky = 0; ky < s->k; ++ky)
                        for (kx = 0; kx < s->k; ++kx) {
                            double v = x[(pl * H + oy * st + ky) * W + ox * st + kx];
                            if (v > best) best = v;
                        }
                    y[(pl * OH + oy) * OW + ox] = best;
                }
        return 1;
    }
    }
    return 0;
}

/* L = sum(out .* R) in float64, for the flat parameters `flat` */
static double fd_loss(mgpu_model* m, const float* flat, const mgpu_tensor* x, const float* R, float* ybuf) {
    const mgpu_tensor* out;
    double L = 0.0;
    int64_t i, n;
    put_flat(m, 0, flat);
    out = mgpu_model_forward(m, 0, x, 1);
    if (!out) { CHECK(0, "forward in the finite differences: %s", mgpu_last_error()); return 0.0; }
    n = mgpu_tensor_numel(out);
    tget(out, ybuf);
    for (i = 0; i < n; ++i) L += (double)ybuf[i] * R[i];
    return L;
}

static void gradcheck(const layer_spec* s) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_shape xs = batch_shape(s->batch, s->sample), ys = spec_out_shape(s), got;
    mgpu_model* m = MODEL(s->sample, NULL, MGPU_LOSS_CROSS_ENTROPY, 11, addin_layer(xs, NULL), spec_layer(s));
    const mgpu_tensor* out;
    mgpu_tensor *x, *tr;
    float *flat, *y, *R, *g, *g2, *xin, *w = NULL, *b = NULL;
    double *yref, *num;
    const double eps = 1e-2;
    int64_t nf, nx = mgpu_shape_numel(xs), ny, i;
    int t, nt, has_params = s->kind == LK_LINEAR || s->kind == LK_CONV || s->kind == LK_SCALE;
    char what[160];
    if (!m) return;
    nt = mgpu_model_tensor_count(m);
    CHECK(nt == (s->kind == LK_SCALE ? 2 : has_params ? 3 : 1), "%s: %d named tensors", s->label, nt);
    CHECK(!strcmp(mgpu_model_tensor_name(m, 0), "0.input"), "%s: tensor 0 is '%s'", s->label, mgpu_model_tensor_name(m, 0));
    if (has_params && s->kind != LK_SCALE && nt == 3)
        CHECK(!strcmp(mgpu_model_tensor_name(m, 1), "1.weight") && !strcmp(mgpu_model_tensor_name(m, 2), "1.bias"),
              "%s: parameter names '%s', '%s' (want 1.weight, 1.bias)", s->label, mgpu_model_tensor_name(m, 1),
              mgpu_model_tensor_name(m, 2));
    nf = flat_n(m);
    flat = get_flat(m, 0);
    xin = flat + toff(m, 0);
    if (s->kind == LK_POOL) rnd_distinct(xin, nx);
    else rnd_kinkfree(xin, nx);
    if (nt > 1) w = flat + toff(m, 1);
    if (nt > 2) b = flat + toff(m, 2);
    put_flat(m, 0, flat);
    x = tmake(cpu, MGPU_F32, xs);
    MUST(mgpu_tensor_zero(x));
    out = mgpu_model_forward(m, 0, x, 1);
    CHECK(out != NULL, "%s: forward: %s", s->label, mgpu_last_error());
    if (!out) { mgpu_tensor_destroy(x); mgpu_model_destroy(m); free(flat); return; }
    got = mgpu_tensor_shape(out);
    CHECK(mgpu_shape_equal(got, ys), "%s: output shape [%lld,%lld,%lld,%lld] ndim %d, expected ndim %d [%lld,%lld,%lld,%lld]",
          s->label, (long long)got.dim[0], (long long)got.dim[1], (long long)got.dim[2], (long long)got.dim[3], got.ndim,
          ys.ndim, (long long)ys.dim[0], (long long)ys.dim[1], (long long)ys.dim[2], (long long)ys.dim[3]);
    ny = mgpu_tensor_numel(out);
    y = fbuf(ny);
    yref = dbuf(ny);
    tget(out, y);
    if (mgpu_shape_equal(got, ys) && spec_ref(s, xin, w, b, yref)) {
        double e = test_rel_error(y, yref, (size_t)ny);
        CHECK(e <= 1e-5, "%s: forward vs float64 reference: normalised error %.3g", s->label, e);
    }
    if (s->kind == LK_DROPOUT) {
        /* every element dropped (0) or scaled by 1/(1-p); about p of them dropped; eval: identity */
        int64_t zeros = 0, bad = 0;
        float* ye = fbuf(ny);
        for (i = 0; i < ny; ++i) {
            if (y[i] == 0.0f) zeros++;
            else if (rel_diff(y[i], (double)xin[i] / (1.0 - s->p)) > 1e-6) bad++;
        }
        CHECK(bad == 0, "%s: %lld kept elements are not x/(1-p)", s->label, (long long)bad);
        CHECK(fabs((double)zeros / (double)ny - s->p) < 0.15, "%s: dropped %lld of %lld, p = %g", s->label,
              (long long)zeros, (long long)ny, (double)s->p);
        out = mgpu_model_forward(m, 0, x, 0);
        if (out) {
            tget(out, ye);
            CHECK(same_bits(ye, xin, (size_t)ny * sizeof(float)), "%s: evaluation forward is not the identity", s->label);
        } else CHECK(0, "%s: eval forward: %s", s->label, mgpu_last_error());
        free(ye);
    }
    /* analytic gradient of L = sum(out .* R) */
    R = fbuf(ny);
    rnd_normal(R, ny, 1.0);
    tr = tfrom(cpu, ys, R);
    out = mgpu_model_forward(m, 0, x, 1);
    MUST(mgpu_model_zero_grad(m));
    MUST(mgpu_model_backward(m, 0, tr));
    g = get_grads(m, 0);
    /* central differences of every element of every tensor (the input P, weight, bias) */
    num = dbuf(nf);
    for (t = 0; t < nt; ++t) {
        int64_t off = toff(m, t), n = tnumel(m, t), j;
        for (j = 0; j < n; ++j) {
            float save = flat[off + j];
            double lp, lm;
            flat[off + j] = save + (float)eps;
            lp = fd_loss(m, flat, x, R, y);
            flat[off + j] = save - (float)eps;
            lm = fd_loss(m, flat, x, R, y);
            flat[off + j] = save;
            num[off + j] = (lp - lm) / ((double)(save + (float)eps) - (double)(save - (float)eps));
        }
        {
            double e = test_rel_error(g + off, num + off, (size_t)n);
            snprintf(what, sizeof what, "%s: d L / d %s", s->label, t == 0 ? "x (via 0.input)" : mgpu_model_tensor_name(m, t));
            CHECK(e <= 2e-3, "%s: normalised error %.3g against central differences", what, e);
        }
    }
    /* backward ADDS: two backward passes after one forward give twice the gradient */
    put_flat(m, 0, flat);
    out = mgpu_model_forward(m, 0, x, 1);
    MUST(mgpu_model_zero_grad(m));
    MUST(mgpu_model_backward(m, 0, tr));
    MUST(mgpu_model_backward(m, 0, tr));
    g2 = get_grads(m, 0);
    for (t = 0; t < nt; ++t) {
        int64_t off = toff(m, t), n = tnumel(m, t), j;
        double* twice = dbuf(n), e;
        for (j = 0; j < n; ++j) twice[j] = 2.0 * g[off + j];
        e = test_rel_error(g2 + off, twice, (size_t)n);
        CHECK(e <= 1e-6, "%s: two backward passes after one forward: gradient of %s is not doubled (error %.3g)",
              s->label, mgpu_model_tensor_name(m, t), e);
        free(twice);
    }
    (void)out;
    free(g2); free(g); free(num); free(R); free(y); free(yref); free(flat);
    mgpu_tensor_destroy(tr);
    mgpu_tensor_destroy(x);
    mgpu_model_destroy(m);
}

static layer_spec g_specs[32];
static int g_nspecs;
static void add_spec(const char* label, layer_kind kind, int batch, mgpu_shape sample, int in, int out, int k,
                     int stride, int pad, float p) {
    layer_spec* s = &g_specs[g_nspecs++];
    memset(s, 0, sizeof *s);
    s->label = label; s->kind = kind; s->batch = batch; s->sample = sample;
    s->in = in; s->out = out; s->k = k; s->stride = stride; s->pad = pad; s->p = p;
}
static void init_specs(void) {
    g_nspecs = 0;
    add_spec("Linear(5 -> 4)", LK_LINEAR, 3, mgpu_shape1(5), 5, 4, 0, 0, 0, 0);
    add_spec("Linear(1 -> 6)", LK_LINEAR, 2, mgpu_shape1(1), 1, 6, 0, 0, 0, 0);
    add_spec("ReLU", LK_RELU, 3, mgpu_shape1(7), 0, 0, 0, 0, 0, 0);
    add_spec("GELU [2,3,2]", LK_GELU, 2, mgpu_shape3(2, 3, 2), 0, 0, 0, 0, 0, 0);
    add_spec("Tanh", LK_TANH, 3, mgpu_shape1(7), 0, 0, 0, 0, 0, 0);
    add_spec("Sigmoid", LK_SIGMOID, 3, mgpu_shape2(2, 4), 0, 0, 0, 0, 0, 0);
    add_spec("Dropout(0.5) training", LK_DROPOUT, 3, mgpu_shape1(40), 0, 0, 0, 0, 0, 0.5f);
    add_spec("Flatten [2,3,4]", LK_FLATTEN, 2, mgpu_shape3(2, 3, 4), 0, 0, 0, 0, 0, 0);
    add_spec("Conv2d(2->3, k3, s1, p0) on 6x7", LK_CONV, 2, mgpu_shape3(2, 6, 7), 2, 3, 3, 1, 0, 0);
    add_spec("Conv2d(2->3, k3, s2, p1) on 7x6", LK_CONV, 2, mgpu_shape3(2, 7, 6), 2, 3, 3, 2, 1, 0);
    add_spec("Conv2d(1->2, k2, s2, p0) on 5x8", LK_CONV, 2, mgpu_shape3(1, 5, 8), 1, 2, 2, 2, 0, 0);
    add_spec("Conv2d(3->2, k1, s1, p1) on 3x4", LK_CONV, 1, mgpu_shape3(3, 3, 4), 3, 2, 1, 1, 1, 0);
    add_spec("Conv2d(1->2, k5, s1, p2) on 6x5", LK_CONV, 1, mgpu_shape3(1, 6, 5), 1, 2, 5, 1, 2, 0);
    add_spec("MaxPool2d(k2) on 6x8", LK_POOL, 2, mgpu_shape3(2, 6, 8), 0, 0, 2, 0, 0, 0);
    add_spec("MaxPool2d(k3, s2) on 7x9", LK_POOL, 1, mgpu_shape3(2, 7, 9), 0, 0, 3, 2, 0, 0);
    add_spec("MaxPool2d(k2, s1) on 4x5", LK_POOL, 2, mgpu_shape3(1, 4, 5), 0, 0, 2, 1, 0, 0);
    add_spec("MaxPool2d(k2, s2) on 5x7 (floor)", LK_POOL, 1, mgpu_shape3(2, 5, 7), 0, 0, 2, 2, 0, 0);
    add_spec("Scale (custom)", LK_SCALE, 2, mgpu_shape1(6), 0, 0, 0, 0, 0, 0);
}

/* Conv2d's first-layer backward (dx NULL) and a Conv2d -> ReLU -> MaxPool2d -> Flatten ->
   Linear stack: parameter gradients against finite differences through the whole chain. */
static void gradcheck_stack(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_model* m = MODEL(mgpu_shape3(1, 6, 6), NULL, MGPU_LOSS_CROSS_ENTROPY, 5, mgpu_layer_conv2d(1, 2, 3, 1, 1),
                          mgpu_layer_tanh(), mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(18, 3));
    float *x, *flat, *R, *g, *y;
    double* num;
    mgpu_tensor *tx, *tr;
    const mgpu_tensor* out;
    int t;
    if (!m) return;
    x = fbuf(2 * 36);
    tx = tmake(cpu, MGPU_F32, mgpu_shape4(2, 1, 6, 6));
    flat = get_flat(m, 0);
    {
        /* no MaxPool window may have its two largest inputs within reach of one finite-difference
           step (a kink): redraw x until every window's winner leads by 2.5e-3 (white box: the
           Tanh output is the model's activation 1) */
        float act[2 * 2 * 36];
        int attempt, w, ok = 0;
        for (attempt = 0; attempt < 100 && !ok; ++attempt) {
            rnd_distinct(x, 72);
            tput(tx, x);
            if (!mgpu_model_forward(m, 0, tx, 1)) break;
            tget(m->part[0].slot[0].act[1], act);
            ok = 1;
            for (w = 0; w < 2 * 2 * 9; ++w) {
                int plane = w / 9, wy = (w % 9) / 3, wx = w % 3, a, b2;
                float v[4], best = -2.0f, second = -2.0f;
                v[0] = act[plane * 36 + (2 * wy) * 6 + 2 * wx];
                v[1] = act[plane * 36 + (2 * wy) * 6 + 2 * wx + 1];
                v[2] = act[plane * 36 + (2 * wy + 1) * 6 + 2 * wx];
                v[3] = act[plane * 36 + (2 * wy + 1) * 6 + 2 * wx + 1];
                for (a = 0; a < 4; ++a) if (v[a] > best) best = v[a];
                for (a = 0, b2 = 0; a < 4; ++a) {
                    if (v[a] == best && !b2) { b2 = 1; continue; }
                    if (v[a] > second) second = v[a];
                }
                ok &= best - second > 2.5e-3f;
            }
        }
        CHECK(ok, "stack: no kink-free input in 100 draws");
    }
    out = mgpu_model_forward(m, 0, tx, 1);
    CHECK(out && mgpu_tensor_dim(out, 1) == 3, "stack: forward: %s", mgpu_last_error());
    if (!out) { mgpu_model_destroy(m); free(x); free(flat); mgpu_tensor_destroy(tx); return; }
    R = fbuf(6);
    y = fbuf(6);
    rnd_normal(R, 6, 1.0);
    tr = tfrom(cpu, mgpu_shape2(2, 3), R);
    MUST(mgpu_model_zero_grad(m));
    MUST(mgpu_model_backward(m, 0, tr));
    g = get_grads(m, 0);
    num = dbuf(flat_n(m));
    for (t = 0; t < mgpu_model_tensor_count(m); ++t) {
        int64_t off = toff(m, t), n = tnumel(m, t), j;
        double e;
        for (j = 0; j < n; ++j) {
            const float h = 5e-4f;
            float save = flat[off + j];
            double lp, lm;
            flat[off + j] = save + h;
            lp = fd_loss(m, flat, tx, R, y);
            flat[off + j] = save - h;
            lm = fd_loss(m, flat, tx, R, y);
            flat[off + j] = save;
            num[off + j] = (lp - lm) / ((double)(save + h) - (double)(save - h));
        }
        e = test_rel_error(g + off, num + off, (size_t)n);
        CHECK(e <= 1e-2, "Conv2d-Tanh-MaxPool2d-Flatten-Linear: d L / d %s: normalised error %.3g",
              mgpu_model_tensor_name(m, t), e);
    }
    free(x); free(flat); free(R); free(g); free(y); free(num);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tr);
    mgpu_model_destroy(m);
}

static void test_gradients(void) {
    int i;
    header("1. gradient checks and forward references, every layer");
    init_specs();
    for (i = 0; i < g_nspecs; ++i) gradcheck(&g_specs[i]);
    gradcheck_stack();
}

/* ============================================================================================ */
/* 2. initialisation                                                                            */
/* ============================================================================================ */
static void check_uniform_init(const char* what, const float* p, int64_t n, double bound, int check_std) {
    int64_t i, outside = 0;
    double mean = 0.0, var = 0.0, sd;
    for (i = 0; i < n; ++i) {
        if (!(fabs((double)p[i]) <= bound)) outside++;
        mean += p[i];
    }
    mean /= (double)n;
    for (i = 0; i < n; ++i) var += ((double)p[i] - mean) * ((double)p[i] - mean);
    sd = sqrt(var / (double)(n - 1));
    CHECK(outside == 0, "%s: %lld of %lld values outside +-1/sqrt(fan_in) = %.4g", what, (long long)outside, (long long)n, bound);
    if (check_std) {
        CHECK(fabs(sd - bound / sqrt(3.0)) < 0.06 * bound / sqrt(3.0), "%s: std %.4g, want about bound/sqrt(3) = %.4g", what,
              sd, bound / sqrt(3.0));
        CHECK(fabs(mean) < 4.0 * bound / sqrt(3.0) / sqrt((double)n), "%s: mean %.4g is far from 0", what, mean);
    } else {
        CHECK(sd > 0.2 * bound, "%s: std %.4g: the values barely vary", what, sd);
    }
}

static void test_init(void) {
    mgpu_model *m, *m2, *m3;
    float *p, *p2, *p3;
    mgpu_device_set* set3;
    int64_t nf;
    header("2. initialisation");
    /* Linear(200 -> 64): fan_in 200; a second Linear(64 -> 64) gets its own stream */
    m = MODEL(mgpu_shape1(200), NULL, MGPU_LOSS_CROSS_ENTROPY, 42, mgpu_layer_linear(200, 64), mgpu_layer_relu(),
              mgpu_layer_linear(64, 64), mgpu_layer_linear(64, 64));
    m2 = MODEL(mgpu_shape1(200), NULL, MGPU_LOSS_CROSS_ENTROPY, 42, mgpu_layer_linear(200, 64), mgpu_layer_relu(),
               mgpu_layer_linear(64, 64), mgpu_layer_linear(64, 64));
    m3 = MODEL(mgpu_shape1(200), NULL, MGPU_LOSS_CROSS_ENTROPY, 43, mgpu_layer_linear(200, 64), mgpu_layer_relu(),
               mgpu_layer_linear(64, 64), mgpu_layer_linear(64, 64));
    if (m && m2 && m3) {
        int w2 = tindex(m, "2.weight"), w3 = tindex(m, "3.weight");
        nf = flat_n(m);
        p = get_flat(m, 0);
        p2 = get_flat(m2, 0);
        p3 = get_flat(m3, 0);
        CHECK(mgpu_model_param_count(m) == 200 * 64 + 64 + 2 * (64 * 64 + 64), "param_count %lld",
              (long long)mgpu_model_param_count(m));
        CHECK(mgpu_model_tensor_count(m) == 6 && w2 >= 0 && w3 >= 0 && tindex(m, "0.weight") == 0 &&
              tindex(m, "0.bias") == 1 && tindex(m, "3.bias") == 5, "tensor names (state_dict order, layer indices)");
        check_uniform_init("Linear(200->64).weight", p + toff(m, 0), tnumel(m, 0), 1.0 / sqrt(200.0), 1);
        check_uniform_init("Linear(200->64).bias", p + toff(m, 1), tnumel(m, 1), 1.0 / sqrt(200.0), 0);
        check_uniform_init("Linear(64->64).weight", p + toff(m, w2), tnumel(m, w2), 1.0 / sqrt(64.0), 1);
        CHECK(same_bits(p, p2, (size_t)nf * sizeof(float)), "same seed: parameters differ");
        CHECK(!same_bits(p, p3, (size_t)nf * sizeof(float)), "different seeds: identical parameters");
        if (w2 >= 0 && w3 >= 0)
            CHECK(!same_bits(p + toff(m, w2), p + toff(m, w3), (size_t)tnumel(m, w2) * sizeof(float)),
                  "two identical Linear layers of one model got identical weights (layers must draw different streams)");
        CHECK(!same_bits(p + toff(m, 0), p + toff(m, 1), 64 * sizeof(float)), "weight and bias draw the same numbers");
        free(p); free(p2); free(p3);
    }
    mgpu_model_destroy(m); mgpu_model_destroy(m2); mgpu_model_destroy(m3);

    /* Conv2d(3 -> 16, k3): fan_in 27 */
    m = MODEL(mgpu_shape3(3, 8, 8), NULL, MGPU_LOSS_CROSS_ENTROPY, 9, mgpu_layer_conv2d(3, 16, 3, 1, 1));
    if (m) {
        p = get_flat(m, 0);
        CHECK(tnumel(m, 0) == 16 * 3 * 3 * 3 && mgpu_tensor_shape(mgpu_model_tensor(m, 0, 0)).ndim == 4 &&
              mgpu_tensor_dim(mgpu_model_tensor(m, 0, 0), 0) == 16 && mgpu_tensor_dim(mgpu_model_tensor(m, 0, 0), 1) == 3,
              "Conv2d weight is [out, in, kh, kw]");
        check_uniform_init("Conv2d(3->16,k3).weight", p + toff(m, 0), tnumel(m, 0), 1.0 / sqrt(27.0), 1);
        check_uniform_init("Conv2d(3->16,k3).bias", p + toff(m, 1), tnumel(m, 1), 1.0 / sqrt(27.0), 0);
        free(p);
    }
    mgpu_model_destroy(m);

    /* replicas of a cpu:3 model start bit-identical, and equal the one-device model */
    set3 = mgpu_device_set_create("cpu:3");
    CHECK(set3 && mgpu_device_set_count(set3) == 3, "cpu:3: %s", mgpu_last_error());
    if (set3) {
        m = MODEL(mgpu_shape1(20), set3, MGPU_LOSS_CROSS_ENTROPY, 77, mgpu_layer_linear(20, 10), mgpu_layer_gelu(), mgpu_layer_linear(10, 4));
        m2 = MODEL(mgpu_shape1(20), NULL, MGPU_LOSS_CROSS_ENTROPY, 77, mgpu_layer_linear(20, 10), mgpu_layer_gelu(), mgpu_layer_linear(10, 4));
        if (m && m2) {
            CHECK(mgpu_model_replica_count(m) == 3, "replica count %d", mgpu_model_replica_count(m));
            CHECK(replicas_identical(m), "cpu:3 replicas do not start bit-identical");
            p = get_flat(m, 2);
            p2 = get_flat(m2, 0);
            CHECK(same_bits(p, p2, (size_t)flat_n(m) * sizeof(float)), "cpu:3 model differs from the cpu model of the same seed");
            free(p); free(p2);
        }
        mgpu_model_destroy(m);
        mgpu_model_destroy(m2);
    }
    mgpu_device_set_destroy(set3);
}

/* ============================================================================================ */
/* 3. model errors                                                                              */
/* ============================================================================================ */
static void test_model_errors(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_model_desc d;
    mgpu_model *m, *m4;
    mgpu_optimizer *opt, *opt4;
    mgpu_device_set* set4;
    mgpu_tensor *x, *xi, *xbad, *lab, *labf, *lab_short, *dy_bad;
    int destroyed = 0;
    float xs[8 * 6];
    int32_t labels[8] = {0, 1, 2, 0, 1, 2, 0, 1};
    header("3. model errors");

    /* a layer that rejects its input: Linear(10, 5) right after a [1, 28, 28] input */
    m = TRY_MODEL(mgpu_shape3(1, 28, 28), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_linear(10, 5));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_SHAPE_MISMATCH, "Linear(10,5) on [1,28,28]", "layer 0 (Linear)", "[1,1,28,28]", "[...,10]");
    CHECK(strstr(mgpu_last_error(), "mgpu_model_create") != NULL, "message names the call: %s", mgpu_last_error());
    /* a sample shape no tensor can have: [-5], [3, 0] */
    m = TRY_MODEL(mgpu_shape1(-5), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_relu());
    expect_null(m, MGPU_ERROR_INVALID_ARGUMENT, "a sample shape [-5]", "[-5]", "below 1", NULL);
    mgpu_model_destroy(m);
    m = TRY_MODEL(mgpu_shape2(3, 0), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_relu());
    expect_null(m, MGPU_ERROR_INVALID_ARGUMENT, "a sample shape [3,0]", "[3,0]", NULL, NULL);
    mgpu_model_destroy(m);
    m = TRY_MODEL(mgpu_shape3(1, 28, 28), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_flatten(), mgpu_layer_linear(10, 5));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_SHAPE_MISMATCH, "Flatten, Linear(10,5) on [1,28,28]", "layer 1 (Linear)", "[1,784]", "10");
    m = TRY_MODEL(mgpu_shape3(1, 8, 8), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_relu(), mgpu_layer_conv2d(3, 4, 3, 1, 0));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_SHAPE_MISMATCH, "Conv2d(3 channels) on [1,8,8]", "layer 1 (Conv2d)", "[1,1,8,8]", "3");
    m = TRY_MODEL(mgpu_shape3(1, 2, 2), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_maxpool2d(3, 0));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_SHAPE_MISMATCH, "MaxPool2d(3) on 2x2", "layer 0 (MaxPool2d)", "[1,1,2,2]", NULL);

    /* constructors that fail return NULL with a message */
    expect_null(mgpu_layer_linear(0, 5), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_linear(0, 5)", "mgpu_layer_linear", NULL, NULL);
    expect_null(mgpu_layer_conv2d(1, 2, 3, 0, 0), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_conv2d stride 0", "mgpu_layer_conv2d", NULL, NULL);
    expect_null(mgpu_layer_conv2d(1, 2, 3, 1, -1), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_conv2d padding -1", "mgpu_layer_conv2d", NULL, NULL);
    expect_null(mgpu_layer_maxpool2d(0, 0), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_maxpool2d(0)", "mgpu_layer_maxpool2d", NULL, NULL);
    expect_null(mgpu_layer_dropout(1.0f), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_dropout(1)", "p = 1", NULL, NULL);
    expect_null(mgpu_layer_dropout(-0.1f), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_layer_dropout(-0.1)", "mgpu_layer_dropout", NULL, NULL);

    /* a NULL layer in the list: a clear error, the model still owns (and frees) the others */
    {
        mgpu_layer* layers[4];
        layers[0] = scale_layer(1.0f, &destroyed);
        layers[1] = mgpu_layer_linear(0, 5);
        layers[2] = mgpu_layer_relu();
        layers[3] = scale_layer(2.0f, &destroyed);
        memset(&d, 0, sizeof d);
        d.input = mgpu_shape1(4);
        d.layers = layers;
        d.layer_count = 4;
        m = mgpu_model_create(&d);
        expect_null(m, MGPU_ERROR_INVALID_ARGUMENT, "a NULL layer (mgpu_layer_linear(0, 5)) in the list", "layer 1 is NULL",
                    "mgpu_layer_linear: features 0 -> 5", NULL);
        mgpu_model_destroy(m);
        CHECK(destroyed == 2, "after a failed create the other layers are destroyed exactly once: %d of 2", destroyed);
    }
    /* every other failure of create destroys the layers too */
    destroyed = 0;
    m = TRY_MODEL(mgpu_shape4(1, 2, 3, 4), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, scale_layer(1.0f, &destroyed));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_INVALID_ARGUMENT, "a 4-D sample shape", "dimensions", NULL, NULL);
    CHECK(destroyed == 1, "layers destroyed after a bad sample shape: %d of 1", destroyed);
    destroyed = 0;
    m = TRY_MODEL(mgpu_shape1(3), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, scale_layer(1.0f, &destroyed), mgpu_layer_linear(4, 2));
    mgpu_model_destroy(m);
    expect_null(m, MGPU_ERROR_SHAPE_MISMATCH, "Linear(4, 2) after a [3] sample", "layer 1 (Linear)", NULL, NULL);
    CHECK(destroyed == 1, "layers destroyed after a shape error: %d of 1", destroyed);
    memset(&d, 0, sizeof d);
    d.input = mgpu_shape1(3);
    expect_null(mgpu_model_create(&d), MGPU_ERROR_INVALID_ARGUMENT, "no layers", "at least one layer", NULL, NULL);
    expect_null(mgpu_model_create(NULL), MGPU_ERROR_INVALID_ARGUMENT, "NULL desc", NULL, NULL, NULL);

    /* forward, backward and train_step with bad arguments */
    m = MODEL(mgpu_shape1(6), NULL, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(6, 5), mgpu_layer_relu(), mgpu_layer_linear(5, 3));
    if (!m) return;
    opt = make_opt(m, MGPU_SGD, 0.1f, 0.0f, 0.0f);
    rnd_normal(xs, 48, 1.0);
    x = tfrom(cpu, mgpu_shape2(8, 6), xs);
    xbad = tmake(cpu, MGPU_F32, mgpu_shape2(8, 5));
    xi = tmake(cpu, MGPU_I32, mgpu_shape2(8, 6));
    MUST(mgpu_tensor_zero(xbad));
    MUST(mgpu_tensor_zero(xi));
    lab = tfrom_i32(cpu, mgpu_shape1(8), labels);
    labf = tmake(cpu, MGPU_F32, mgpu_shape1(8));
    lab_short = tfrom_i32(cpu, mgpu_shape1(7), labels);
    dy_bad = tmake(cpu, MGPU_F32, mgpu_shape2(8, 4));
    MUST(mgpu_tensor_zero(labf));
    MUST(mgpu_tensor_zero(dy_bad));

    expect_fail(mgpu_model_backward(m, 0, dy_bad), MGPU_ERROR_INVALID_ARGUMENT, "backward without a forward",
                "mgpu_model_backward", "no forward", NULL);
    expect_null(mgpu_model_forward(m, 0, xbad, 1), MGPU_ERROR_SHAPE_MISMATCH, "forward with x [8,5] for a [6] model",
                "mgpu_model_forward", "[8,5]", "[6]");
    expect_null(mgpu_model_forward(m, 0, xi, 1), MGPU_ERROR_DTYPE_MISMATCH, "forward with an i32 x", "mgpu_model_forward",
                "i32", NULL);
    expect_null(mgpu_model_forward(m, 0, NULL, 1), MGPU_ERROR_INVALID_ARGUMENT, "forward with a NULL x", "mgpu_model_forward",
                NULL, NULL);
    expect_null(mgpu_model_forward(m, 1, x, 1), MGPU_ERROR_INVALID_ARGUMENT, "forward on replica 1 of 1", "replica 1", NULL, NULL);
    expect_null(mgpu_model_forward(NULL, 0, x, 1), MGPU_ERROR_INVALID_ARGUMENT, "forward on a NULL model", NULL, NULL, NULL);
    CHECK(mgpu_model_forward(m, 0, x, 1) != NULL, "forward: %s", mgpu_last_error());
    expect_fail(mgpu_model_backward(m, 0, dy_bad), MGPU_ERROR_SHAPE_MISMATCH, "backward with doutput [8,4] for output [8,3]",
                "mgpu_model_backward", "[8,4]", "[8,3]");
    expect_fail(mgpu_model_backward(m, 0, NULL), MGPU_ERROR_INVALID_ARGUMENT, "backward with a NULL doutput",
                "mgpu_model_backward", NULL, NULL);
    expect_fail(mgpu_model_backward(m, 3, dy_bad), MGPU_ERROR_INVALID_ARGUMENT, "backward on replica 3 of 1", "replica 3",
                NULL, NULL);
    {
        float* before = get_flat(m, 0);
        float* after;
        expect_fail(mgpu_model_train_step(m, opt, x, labf, NULL), MGPU_ERROR_DTYPE_MISMATCH, "train_step with f32 labels",
                    "mgpu_model_train_step", "target", "i32");
        expect_fail(mgpu_model_train_step(m, opt, x, lab_short, NULL), MGPU_ERROR_SHAPE_MISMATCH,
                    "train_step with 7 labels for 8 rows", "mgpu_model_train_step", "[7]", "[8,6]");
        expect_fail(mgpu_model_train_step(m, opt, xbad, lab, NULL), MGPU_ERROR_SHAPE_MISMATCH, "train_step with x [8,5]",
                    "mgpu_model_train_step", "[8,5]", NULL);
        expect_fail(mgpu_model_train_step(m, NULL, x, lab, NULL), MGPU_ERROR_INVALID_ARGUMENT, "train_step without optimizer",
                    "mgpu_model_train_step", NULL, NULL);
        expect_fail(mgpu_model_evaluate(m, x, labf, NULL, NULL), MGPU_ERROR_DTYPE_MISMATCH, "evaluate with f32 labels",
                    "mgpu_model_evaluate", NULL, NULL);
        after = get_flat(m, 0);
        CHECK(same_bits(before, after, (size_t)flat_n(m) * sizeof(float)) && mgpu_optimizer_step_count(opt) == 0,
              "failed train steps changed the parameters or the step count");
        free(before);
        free(after);
    }

    /* a batch smaller than the replica count on cpu:4; an optimizer of another model */
    set4 = mgpu_device_set_create("cpu:4");
    CHECK(set4 != NULL, "cpu:4: %s", mgpu_last_error());
    if (set4) {
        m4 = MODEL(mgpu_shape1(6), set4, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(6, 3));
        opt4 = m4 ? make_opt(m4, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
        if (m4 && opt4) {
            mgpu_tensor* x3 = mgpu_tensor_view_rows(x, 0, 3);
            mgpu_tensor* l3 = mgpu_tensor_view_rows(lab, 0, 3);
            float* before = get_flat(m4, 0);
            float* after;
            expect_fail(mgpu_model_train_step(m4, opt4, x3, l3, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                        "a batch of 3 on cpu:4", "batch of 3", "4 replicas", NULL);
            after = get_flat(m4, 0);
            CHECK(same_bits(before, after, (size_t)flat_n(m4) * sizeof(float)) && mgpu_optimizer_step_count(opt4) == 0,
                  "the failed step on cpu:4 changed something");
            expect_fail(mgpu_model_train_step(m4, opt, x, lab, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                        "train_step with another model's optimizer", "another model", NULL, NULL);
            /* a batch of exactly 4 works, and evaluate takes batches smaller than the replica count */
            {
                mgpu_tensor* x4 = mgpu_tensor_view_rows(x, 0, 4);
                mgpu_tensor* l4 = mgpu_tensor_view_rows(lab, 0, 4);
                float loss = -1.0f, el = -1.0f;
                int64_t correct = -1;
                MUST(mgpu_model_train_step(m4, opt4, x4, l4, &loss));
                CHECK(loss > 0.0f && loss == loss, "a batch of 4 on cpu:4: loss %g", (double)loss);
                MUST(mgpu_model_evaluate(m4, x3, l3, &el, &correct));
                CHECK(el > 0.0f && correct >= 0 && correct <= 3, "evaluate 3 rows on cpu:4: loss %g, correct %lld",
                      (double)el, (long long)correct);
                mgpu_tensor_destroy(x4);
                mgpu_tensor_destroy(l4);
            }
            free(before);
            free(after);
            mgpu_tensor_destroy(x3);
            mgpu_tensor_destroy(l3);
        }
        mgpu_optimizer_destroy(opt4);
        mgpu_model_destroy(m4);
    }
    mgpu_device_set_destroy(set4);

    /* MSE targets: f32 shaped like the output */
    {
        mgpu_model* mm = MODEL(mgpu_shape1(6), NULL, MGPU_LOSS_MSE, 3, mgpu_layer_linear(6, 2));
        mgpu_optimizer* mo = mm ? make_opt(mm, MGPU_SGD, 0.1f, 0.0f, 0.0f) : NULL;
        if (mm && mo) {
            mgpu_tensor* t3 = tmake(cpu, MGPU_F32, mgpu_shape2(8, 3));
            MUST(mgpu_tensor_zero(t3));
            expect_fail(mgpu_model_train_step(mm, mo, x, lab, NULL), MGPU_ERROR_DTYPE_MISMATCH, "MSE with i32 targets",
                        "mgpu_model_train_step", "f32", NULL);
            expect_fail(mgpu_model_train_step(mm, mo, x, t3, NULL), MGPU_ERROR_SHAPE_MISMATCH,
                        "MSE with [8,3] targets for output [8,2]", "target", "[8,3]", NULL);
            mgpu_tensor_destroy(t3);
        }
        mgpu_optimizer_destroy(mo);
        mgpu_model_destroy(mm);
    }

    /* summary: layer names, output shapes, the total parameter count */
    {
        char text[4096];
        mgpu_model* cm = MODEL(mgpu_shape3(1, 8, 8), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_conv2d(1, 4, 3, 1, 1),
                               mgpu_layer_relu(), mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_dropout(0.25f),
                               mgpu_layer_linear(64, 10), scale_layer(1.0f, NULL));
        if (cm) {
            summary_of(cm, text, sizeof text);
            CHECK(strstr(text, "Conv2d") && strstr(text, "ReLU") && strstr(text, "MaxPool2d") && strstr(text, "Flatten") &&
                  strstr(text, "Dropout") && strstr(text, "Linear(64 -> 10)") && strstr(text, "Scale(init 1)"),
                  "summary lacks a layer name:\n%s", text);
            CHECK(strstr(text, "[1,4,8,8]") && strstr(text, "[1,4,4,4]") && strstr(text, "[1,64]") && strstr(text, "[1,10]"),
                  "summary lacks an output shape:\n%s", text);
            CHECK(mgpu_model_param_count(cm) == 4 * 9 + 4 + 64 * 10 + 10 + 1, "param count %lld",
                  (long long)mgpu_model_param_count(cm));
            CHECK(strstr(text, "Total parameters: 691") != NULL, "summary lacks the total 691:\n%s", text);
            CHECK(strstr(text, "650") && strstr(text, "40"), "summary lacks the per-layer counts:\n%s", text);
        }
        mgpu_model_destroy(cm);
    }

    mgpu_tensor_destroy(x); mgpu_tensor_destroy(xbad); mgpu_tensor_destroy(xi); mgpu_tensor_destroy(lab);
    mgpu_tensor_destroy(labf); mgpu_tensor_destroy(lab_short); mgpu_tensor_destroy(dy_bad);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
}

/* ============================================================================================ */
/* 4. a custom layer                                                                            */
/* ============================================================================================ */
static void test_custom_layer(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    int destroyed = 0, i, steps = 150;   /* a few milliseconds; 60 fell short of 1e-3 where the x drawn had mean(x^2) near 0.6 */
    custom_info* u = new_info(mgpu_shape1(1), &destroyed, 0.5f);
    mgpu_layer* l = mgpu_layer_create(&scale_vt, u);
    mgpu_layer_vtable bad;
    mgpu_model* m;
    mgpu_optimizer* opt;
    header("4. a custom layer");
    CHECK(l != NULL, "mgpu_layer_create: %s", mgpu_last_error());
    if (!l) { free(u); return; }
    CHECK(mgpu_layer_user_data(l) == u, "mgpu_layer_user_data gives back the pointer");
    CHECK(!strcmp(mgpu_layer_type(l), "Scale"), "mgpu_layer_type: %s", mgpu_layer_type(l));
    mgpu_layer_destroy(l);
    CHECK(destroyed == 1, "mgpu_layer_destroy calls destroy once: %d", destroyed);
    mgpu_layer_destroy(NULL);

    bad = scale_vt;
    bad.forward = NULL;
    expect_null(mgpu_layer_create(&bad, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a vtable without forward", "forward", NULL, NULL);
    bad = scale_vt;
    bad.param_shape = NULL;
    expect_null(mgpu_layer_create(&bad, NULL), MGPU_ERROR_INVALID_ARGUMENT, "param_count without param_shape", "param_shape",
                NULL, NULL);
    expect_null(mgpu_layer_create(NULL, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL vtable", NULL, NULL, NULL);

    /* train y = s * x towards y = 3 x (MSE); s starts at 0.5 (the layer's own init) */
    destroyed = 0;
    m = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_MSE, 1, scale_layer(0.5f, &destroyed));
    opt = m ? make_opt(m, MGPU_SGD, 0.05f, 0.5f, 0.0f) : NULL;
    if (m && opt) {
        float xs[16 * 4], ts[16 * 4], loss = 0.0f, first = 0.0f, s;
        mgpu_tensor *x, *t;
        CHECK(!strcmp(mgpu_model_tensor_name(m, 0), "0.scale") && mgpu_model_param_count(m) == 1, "custom parameter '%s'",
              mgpu_model_tensor_name(m, 0));
        CHECK(scalar_of(mgpu_model_tensor(m, 0, 0)) == 0.5f, "custom init: %g", (double)scalar_of(mgpu_model_tensor(m, 0, 0)));
        rnd_normal(xs, 64, 1.0);
        for (i = 0; i < 64; ++i) ts[i] = 3.0f * xs[i];
        x = tfrom(cpu, mgpu_shape2(16, 4), xs);
        t = tfrom(cpu, mgpu_shape2(16, 4), ts);
        for (i = 0; i < steps; ++i) {
            MUST(mgpu_model_train_step(m, opt, x, t, &loss));
            if (i == 0) first = loss;
        }
        s = scalar_of(mgpu_model_tensor(m, 0, 0));
        CHECK(fabs(s - 3.0) < 1e-3, "the custom layer trains: s = %.6f, want 3 (loss %g -> %g)", (double)s, (double)first,
              (double)loss);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(t);
    }
    mgpu_optimizer_destroy(opt);
    CHECK(destroyed == 0, "destroy called while the model lives");
    mgpu_model_destroy(m);
    CHECK(destroyed == 1, "the model destroys its custom layer exactly once: %d", destroyed);
}

/* ============================================================================================ */
/* 5. optimizers against PyTorch's rules in float64                                             */
/* ============================================================================================ */
/* the learning rate a step uses after `t` steps (StepLR / CosineAnnealingLR, constant after T) */
static double sched_lr(const mgpu_optimizer_desc* d, double lr, int64_t t) {
    if (d->schedule == MGPU_SCHEDULE_STEP) return lr * pow(d->gamma ? d->gamma : 0.1, (double)(t / d->step_size));
    if (d->schedule == MGPU_SCHEDULE_COSINE) {
        double tt = (double)(t < d->total_steps ? t : d->total_steps);
        return d->min_lr + (lr - d->min_lr) * 0.5 * (1.0 + cos(TEST_PI * tt / d->total_steps));
    }
    return lr;
}

static void opt_case(const char* label, mgpu_optimizer_desc d, int steps) {
    mgpu_model* m = MODEL(mgpu_shape1(5), NULL, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(5, 3), mgpu_layer_linear(3, 2));
    mgpu_optimizer* opt;
    int adamw = d.kind == MGPU_ADAMW, t;
    double lr = d.lr ? d.lr : (adamw ? 1e-3f : 1e-2f), b1 = d.beta1 ? d.beta1 : 0.9f, b2 = d.beta2 ? d.beta2 : 0.999f;
    double eps = d.eps ? d.eps : 1e-8f, wd = d.weight_decay, mom = d.momentum, damp = d.dampening;
    double *p, *buf, *ma, *va;
    float *p0, *g, *got;
    int64_t n, i;
    if (!m) return;
    opt = mgpu_optimizer_create(m, &d);
    CHECK(opt != NULL, "%s: mgpu_optimizer_create: %s", label, mgpu_last_error());
    if (!opt) { mgpu_model_destroy(m); return; }
    n = flat_n(m);
    p0 = fbuf(n); g = fbuf(n);
    p = dbuf(n); buf = dbuf(n); ma = dbuf(n); va = dbuf(n);
    rnd_normal(p0, n, 0.3);
    put_flat(m, 0, p0);
    for (i = 0; i < n; ++i) p[i] = p0[i];
    for (t = 0; t < steps; ++t) {
        double lr_t = sched_lr(&d, lr, t);
        float got_lr = mgpu_optimizer_lr(opt);
        rnd_normal(g, n, 1.0);
        if (t == 2) for (i = 0; i < n; i += 3) g[i] = 0.0f;   /* zero gradients still decay and move with momentum */
        put_grads(m, 0, g);
        CHECK(rel_diff(got_lr, lr_t) < 1e-6, "%s: step %d: mgpu_optimizer_lr %.9g, want %.9g", label, t, (double)got_lr, lr_t);
        MUST(mgpu_optimizer_step(opt));
        for (i = 0; i < n; ++i) {
            double gi = g[i];
            if (!adamw) {
                if (wd != 0.0) gi += wd * p[i];
                if (mom != 0.0) {
                    buf[i] = t == 0 ? gi : mom * buf[i] + (1.0 - damp) * gi;
                    gi = d.nesterov ? gi + mom * buf[i] : buf[i];
                }
                p[i] -= lr_t * gi;
            } else {
                double bc1 = 1.0 - pow(b1, t + 1), bc2 = 1.0 - pow(b2, t + 1);
                p[i] *= 1.0 - lr_t * wd;
                ma[i] = b1 * ma[i] + (1.0 - b1) * gi;
                va[i] = b2 * va[i] + (1.0 - b2) * gi * gi;
                p[i] -= lr_t / bc1 * ma[i] / (sqrt(va[i]) / sqrt(bc2) + eps);
            }
        }
        got = get_flat(m, 0);
        {
            /* the parameters, and (more sharply) their displacement from the start */
            double* dref = dbuf(n);
            float* dgot = fbuf(n);
            double e1, e2;
            for (i = 0; i < n; ++i) { dref[i] = p[i] - p0[i]; dgot[i] = (float)((double)got[i] - p0[i]); }
            e1 = test_rel_error(got, p, (size_t)n);
            e2 = test_rel_error(dgot, dref, (size_t)n);
            CHECK(e1 < 2e-6 && e2 < 2e-4, "%s: step %d: parameters off the float64 reference: error %.3g, displacement error %.3g",
                  label, t + 1, e1, e2);
            free(dref);
            free(dgot);
        }
        free(got);
        CHECK(mgpu_optimizer_step_count(opt) == t + 1, "%s: steps %lld after %d", label, (long long)mgpu_optimizer_step_count(opt), t + 1);
    }
    /* the state buffers themselves (white box: the optimizer's flat state tensors) */
    if (!adamw && mom != 0.0 && opt->state1 && opt->state1[0]) {
        float* sb = fbuf(n);
        tget(opt->state1[0], sb);
        CHECK(test_rel_error(sb, buf, (size_t)n) < 1e-5, "%s: momentum buffer off the reference: %.3g", label,
              test_rel_error(sb, buf, (size_t)n));
        free(sb);
    }
    if (adamw && opt->state1 && opt->state2 && opt->state1[0] && opt->state2[0]) {
        float* sb = fbuf(n);
        tget(opt->state1[0], sb);
        CHECK(test_rel_error(sb, ma, (size_t)n) < 1e-5, "%s: exp_avg off the reference", label);
        tget(opt->state2[0], sb);
        CHECK(test_rel_error(sb, va, (size_t)n) < 1e-5, "%s: exp_avg_sq off the reference", label);
        free(sb);
    }
    free(p0); free(g); free(p); free(buf); free(ma); free(va);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
}

static mgpu_optimizer_desc odesc(mgpu_optimizer_kind kind, float lr) {
    mgpu_optimizer_desc d;
    memset(&d, 0, sizeof d);
    d.kind = kind;
    d.lr = lr;
    return d;
}

static void test_optimizers(void) {
    mgpu_optimizer_desc d;
    mgpu_model* m;
    int t;
    header("5. optimizers against PyTorch's rules in float64");
    d = odesc(MGPU_SGD, 0.1f);
    opt_case("SGD", d, 5);
    d = odesc(MGPU_SGD, 0.0f);
    opt_case("SGD (default lr 0.01)", d, 3);
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f;
    opt_case("SGD momentum 0.9", d, 6);
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.8f; d.dampening = 0.3f;
    opt_case("SGD momentum 0.8, dampening 0.3", d, 6);
    d = odesc(MGPU_SGD, 0.05f); d.momentum = 0.9f; d.nesterov = 1;
    opt_case("SGD Nesterov 0.9", d, 6);
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f; d.weight_decay = 0.05f;
    opt_case("SGD momentum 0.9, weight decay 0.05", d, 6);
    d = odesc(MGPU_SGD, 0.1f); d.weight_decay = 0.1f;
    opt_case("SGD weight decay 0.1", d, 4);
    d = odesc(MGPU_SGD, 0.2f); d.momentum = 0.9f; d.schedule = MGPU_SCHEDULE_STEP; d.step_size = 2; d.gamma = 0.5f;
    opt_case("SGD momentum, StepLR(2, 0.5)", d, 7);
    d = odesc(MGPU_ADAMW, 0.0f);
    opt_case("AdamW defaults", d, 6);
    d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.1f; d.beta1 = 0.8f; d.beta2 = 0.99f; d.eps = 1e-6f;
    opt_case("AdamW lr 0.01, wd 0.1, betas (0.8, 0.99)", d, 8);
    d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.01f; d.schedule = MGPU_SCHEDULE_COSINE; d.total_steps = 4;
    d.min_lr = 0.001f;
    opt_case("AdamW, cosine T=4 (6 steps)", d, 6);

    /* schedules alone */
    m = MODEL(mgpu_shape1(2), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_linear(2, 2));
    if (m) {
        mgpu_optimizer* o;
        d = odesc(MGPU_SGD, 0.1f); d.schedule = MGPU_SCHEDULE_STEP; d.step_size = 3;   /* gamma defaults to 0.1 */
        o = mgpu_optimizer_create(m, &d);
        CHECK(o != NULL, "StepLR optimizer: %s", mgpu_last_error());
        for (t = 0; o && t <= 10; ++t) {
            double want = 0.1 * pow(0.1, t / 3);
            CHECK(rel_diff(mgpu_optimizer_lr(o), want) < 1e-6, "StepLR(3): lr %.9g after %d steps, want %.9g",
                  (double)mgpu_optimizer_lr(o), t, want);
            MUST(mgpu_optimizer_step(o));
        }
        mgpu_optimizer_destroy(o);
        d = odesc(MGPU_ADAMW, 0.1f); d.schedule = MGPU_SCHEDULE_COSINE; d.total_steps = 8; d.min_lr = 0.001f;
        o = mgpu_optimizer_create(m, &d);
        CHECK(o != NULL, "cosine optimizer: %s", mgpu_last_error());
        for (t = 0; o && t <= 12; ++t) {
            double tt = t < 8 ? t : 8, want = 0.001 + (0.1 - 0.001) * 0.5 * (1.0 + cos(TEST_PI * tt / 8.0));
            CHECK(fabs(mgpu_optimizer_lr(o) - want) < 1e-6 * 0.1, "cosine(T=8): lr %.9g after %d steps, want %.9g",
                  (double)mgpu_optimizer_lr(o), t, want);
            MUST(mgpu_optimizer_step(o));
        }
        mgpu_optimizer_destroy(o);
        d = odesc(MGPU_SGD, 0.0f);
        o = mgpu_optimizer_create(m, &d);
        CHECK(o && mgpu_optimizer_lr(o) == 0.01f, "SGD default lr %g", o ? (double)mgpu_optimizer_lr(o) : -1.0);
        mgpu_optimizer_destroy(o);
        d = odesc(MGPU_ADAMW, 0.0f);
        o = mgpu_optimizer_create(m, &d);
        CHECK(o && mgpu_optimizer_lr(o) == 0.001f, "AdamW default lr %g", o ? (double)mgpu_optimizer_lr(o) : -1.0);
        mgpu_optimizer_destroy(o);
        o = mgpu_optimizer_create(m, NULL);
        CHECK(o && mgpu_optimizer_lr(o) == 0.01f, "NULL desc: SGD with lr 0.01");
        mgpu_optimizer_destroy(o);

        /* invalid descs */
        d = odesc(MGPU_SGD, -0.1f);
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "lr -0.1", "mgpu_optimizer_create", "lr", NULL);
        d = odesc(MGPU_SGD, 0.1f); d.momentum = 1.0f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "momentum 1", "mgpu_optimizer_create", "momentum", NULL);
        d = odesc(MGPU_SGD, 0.1f); d.momentum = -0.5f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "momentum -0.5", "momentum", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.weight_decay = -1e-4f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "weight decay < 0", "weight_decay", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.nesterov = 1;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "Nesterov without momentum", "Nesterov", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.nesterov = 1; d.momentum = 0.9f; d.dampening = 0.1f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "Nesterov with dampening", "dampening", NULL, NULL);
        d = odesc(MGPU_ADAMW, 0.1f); d.schedule = MGPU_SCHEDULE_COSINE;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "cosine without total_steps", "total_steps", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.schedule = MGPU_SCHEDULE_STEP;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "StepLR without step_size", "step_size", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.schedule = (mgpu_schedule_kind)7;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "schedule 7", "schedule", NULL, NULL);
        d = odesc(MGPU_ADAMW, 0.1f); d.beta1 = 1.0f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "beta1 1", "betas", NULL, NULL);
        d = odesc(MGPU_ADAMW, 0.1f); d.beta2 = 1.5f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "beta2 1.5", "betas", NULL, NULL);
        d = odesc(MGPU_ADAMW, 0.1f); d.eps = -1e-8f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "eps < 0", "eps", NULL, NULL);
        d = odesc((mgpu_optimizer_kind)5, 0.1f);
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "optimizer kind 5", "kind", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f);
        expect_null(mgpu_optimizer_create(NULL, &d), MGPU_ERROR_INVALID_ARGUMENT, "NULL model", "mgpu_optimizer_create", NULL, NULL);
        expect_fail(mgpu_optimizer_step(NULL), MGPU_ERROR_INVALID_ARGUMENT, "step of a NULL optimizer", NULL, NULL, NULL);
    }
    mgpu_model_destroy(m);
}

/* ============================================================================================ */
/* 5b. parameter groups (no weight decay) and clipping by global norm                           */
/* ============================================================================================ */
static void make_clusters(int n, int dim, int classes, float* x, int32_t* y, double spread);

/* One update of flat float64 parameters by PyTorch's rules, each element with its group's decay
   (wd[i]) and the gradients first scaled by clip_grad_norm_'s coefficient (scale). */
typedef struct ref_opt {
    int adamw, nesterov;
    double lr, mom, damp, b1, b2, eps;
    double *p, *buf, *ma, *va;
} ref_opt;
static void ref_opt_step(ref_opt* r, const float* g, const double* wd, double scale, int64_t n, int t) {
    int64_t i;
    for (i = 0; i < n; ++i) {
        double gi = (double)(float)(g[i] * (float)scale);   /* g.mul_(clip_coef) in float32 */
        if (!r->adamw) {
            if (wd[i] != 0.0) gi += wd[i] * r->p[i];
            if (r->mom != 0.0) {
                r->buf[i] = t == 0 ? gi : r->mom * r->buf[i] + (1.0 - r->damp) * gi;
                gi = r->nesterov ? gi + r->mom * r->buf[i] : r->buf[i];
            }
            r->p[i] -= r->lr * gi;
        } else {
            double bc1 = 1.0 - pow(r->b1, t + 1), bc2 = 1.0 - pow(r->b2, t + 1);
            r->p[i] *= 1.0 - r->lr * wd[i];
            r->ma[i] = r->b1 * r->ma[i] + (1.0 - r->b1) * gi;
            r->va[i] = r->b2 * r->va[i] + (1.0 - r->b2) * gi * gi;
            r->p[i] -= r->lr / bc1 * r->ma[i] / (sqrt(r->va[i]) / sqrt(bc2) + r->eps);
        }
    }
}

/* The no-decay tensors by name (matrices_only: also every tensor of fewer than 2 dimensions), as
   a per-element weight decay over the flat buffer. */
static double* decay_of(const mgpu_model* m, double wd, int matrices_only, const char* const* names, int count) {
    double* out = dbuf(flat_n(m));
    int64_t i;
    int t, k;
    for (i = 0; i < flat_n(m); ++i) out[i] = wd;   /* (the gaps between tensors decay, as in mgpu) */
    for (t = 0; t < mgpu_model_tensor_count(m); ++t) {
        int decays = !(matrices_only && mgpu_tensor_shape(mgpu_model_tensor(m, 0, t)).ndim < 2);
        for (k = 0; k < count; ++k) decays &= strcmp(names[k], mgpu_model_tensor_name(m, t)) != 0;
        if (!decays)
            for (i = 0; i < tnumel(m, t); ++i) out[toff(m, t) + i] = 0.0;
    }
    return out;
}

/* `steps` updates of a Linear(5, 4) -> Linear(4, 3) model on `set` from random gradients, against
   float64: groups by d.decay_matrices_only / d.no_decay, clipping by d.clip_norm (the gradients
   scaled by `gscale` first, to land above or below it). Returns the parameters (caller frees). */
static float* groups_clip_case(const char* label, mgpu_optimizer_desc d, int steps, double gscale, const mgpu_device_set* set,
                               uint64_t gseed, float* norms, int64_t* count) {
    mgpu_model* m = MODEL(mgpu_shape1(5), set, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(5, 4), mgpu_layer_linear(4, 3));
    mgpu_optimizer* opt;
    ref_opt r;
    double *wd, worst_norm = 0.0;
    float *p0, *g, *got = NULL;
    int64_t n, i;
    int t, scaled = 0;
    uint64_t saved = g_rng_state;
    if (!m) return NULL;
    opt = mgpu_optimizer_create(m, &d);
    CHECK(opt != NULL, "%s: mgpu_optimizer_create: %s", label, mgpu_last_error());
    if (!opt) { mgpu_model_destroy(m); return NULL; }
    n = *count = flat_n(m);
    memset(&r, 0, sizeof r);
    r.adamw = d.kind == MGPU_ADAMW;
    r.nesterov = d.nesterov;
    r.lr = d.lr; r.mom = d.momentum; r.damp = d.dampening;
    r.b1 = d.beta1 ? d.beta1 : 0.9f; r.b2 = d.beta2 ? d.beta2 : 0.999f; r.eps = d.eps ? d.eps : 1e-8f;
    r.p = dbuf(n); r.buf = dbuf(n); r.ma = dbuf(n); r.va = dbuf(n);
    memset(r.buf, 0, (size_t)n * sizeof(double)); memset(r.ma, 0, (size_t)n * sizeof(double)); memset(r.va, 0, (size_t)n * sizeof(double));
    wd = decay_of(m, d.weight_decay, d.decay_matrices_only, d.no_decay, d.no_decay_count);
    p0 = fbuf(n); g = fbuf(n);
    g_rng_state = gseed;   /* the same numbers for every device the case runs on */
    rnd_normal(p0, n, 0.3);
    put_flat(m, 0, p0);
    for (i = 0; i < n; ++i) r.p[i] = p0[i];
    for (t = 0; t < steps; ++t) {
        double norm = 0.0, scale = 1.0;
        float got_norm = -1.0f;
        rnd_normal(g, n, gscale);
        for (i = 0; i < n; ++i) norm += (double)g[i] * g[i];
        norm = sqrt(norm);
        if (d.clip_norm > 0.0f) {
            float coef = d.clip_norm / ((float)norm + 1e-6f);
            scale = coef > 1.0f ? 1.0 : coef;
            scaled += scale < 1.0;
        }
        put_grads(m, 0, g);
        MUST(mgpu_optimizer_step(opt));
        ref_opt_step(&r, g, wd, scale, n, t);
        if (d.clip_norm > 0.0f) {
            MUST(mgpu_optimizer_last_grad_norm(opt, &got_norm));
            worst_norm = fmax(worst_norm, rel_diff(got_norm, norm));
            if (norms) norms[t] = got_norm;
        }
        free(got);
        got = get_flat(m, 0);
        {
            double e1 = test_rel_error(got, r.p, (size_t)n), e2;
            double* dref = dbuf(n);
            float* dgot = fbuf(n);
            for (i = 0; i < n; ++i) { dref[i] = r.p[i] - p0[i]; dgot[i] = (float)((double)got[i] - p0[i]); }
            e2 = test_rel_error(dgot, dref, (size_t)n);
            CHECK(e1 < 2e-6 && e2 < 2e-4, "%s: step %d: parameters off the float64 reference: error %.3g, displacement error %.3g",
                  label, t + 1, e1, e2);
            free(dref);
            free(dgot);
        }
    }
    if (d.clip_norm > 0.0f) {
        CHECK(worst_norm < 1e-6, "%s: mgpu_optimizer_last_grad_norm off the float64 norm by %.3g", label, worst_norm);
        if (gscale > 1.0 && d.clip_norm < 1.0f) CHECK(scaled == steps, "%s: %d of %d steps clipped, want all", label, scaled, steps);
    }
    g_rng_state = saved ^ gseed;
    free(wd); free(p0); free(g); free(r.p); free(r.buf); free(r.ma); free(r.va);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    return got;
}

/* Training steps of a Linear(6, 8) -> Tanh -> Linear(8, 8) -> Tanh -> Linear(8, 3) model on `spec`
   (NULL: the CPU) in `stages`: the parameters (every stage's, in the layout's order) and the
   norm of each step. */
static float* clip_train(const char* spec, int stages, int graph, const mgpu_optimizer_desc* od, int steps, int batch,
                         const float* xs, const int32_t* ys, float* norms, int64_t* count) {
    mgpu_device_set* set = spec ? mgpu_device_set_create(spec) : NULL;
    mgpu_model_desc md;
    mgpu_model* m;
    mgpu_optimizer* o = NULL;
    float* out = NULL;
    int s;
    mgpu_layer* layers[5];
    if (spec && !set) { CHECK(0, "%s: %s", spec, mgpu_last_error()); return NULL; }
    layers[0] = mgpu_layer_linear(6, 8); layers[1] = mgpu_layer_tanh(); layers[2] = mgpu_layer_linear(8, 8);
    layers[3] = mgpu_layer_tanh(); layers[4] = mgpu_layer_linear(8, 3);
    memset(&md, 0, sizeof md);
    md.input = mgpu_shape1(6); md.layers = layers; md.layer_count = 5; md.devices = set; md.seed = 12;
    md.stages = stages; md.micro_batches = stages > 1 ? 2 : 1; md.graph = graph;
    m = mgpu_model_create(&md);
    CHECK(m != NULL, "%s, %d stage(s): mgpu_model_create: %s", spec ? spec : "cpu", stages, mgpu_last_error());
    if (m) o = mgpu_optimizer_create(m, od);
    CHECK(!m || o, "%s: mgpu_optimizer_create: %s", spec ? spec : "cpu", mgpu_last_error());
    if (m && o) {
        int64_t at = 0;
        for (s = 0; s < steps; ++s) {
            mgpu_tensor* x = tfrom(mgpu_device_cpu(), mgpu_shape2(batch, 6), xs + (size_t)s * batch * 6);
            mgpu_tensor* y = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(batch), ys + (size_t)s * batch);
            MUST(mgpu_model_train_step(m, o, x, y, NULL));
            MUST(mgpu_optimizer_last_grad_norm(o, &norms[s]));
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
        }
        for (s = 0, *count = 0; s < mgpu_model_stage_count(m); ++s) *count += mgpu_tensor_numel(mgpu_model_stage_params(m, 0, s));
        out = fbuf(*count);   /* (the layout's gaps between tensors too) */
        for (s = 0; s < mgpu_model_stage_count(m); ++s) {
            const mgpu_tensor* sp = mgpu_model_stage_params(m, 0, s);
            tget(sp, out + at);
            at += mgpu_tensor_numel(sp);
        }
        for (s = 1; s < mgpu_model_replica_count(m); ++s) {   /* every stage of every replica as replica 0's */
            int st, same = 1;
            for (st = 0; st < mgpu_model_stage_count(m); ++st) {
                const mgpu_tensor *t0 = mgpu_model_stage_params(m, 0, st), *ts = mgpu_model_stage_params(m, s, st);
                float *h0 = fbuf(mgpu_tensor_numel(t0)), *hs = fbuf(mgpu_tensor_numel(ts));
                tget(t0, h0);
                tget(ts, hs);
                same &= same_bits(h0, hs, (size_t)mgpu_tensor_numel(t0) * sizeof(float));
                free(h0);
                free(hs);
            }
            CHECK(same, "%s: replica %d not bit-identical to replica 0 after clipped steps", spec, s);
        }
        if (graph) CHECK(mgpu_model_graph_steps(m) > 0, "%s: no step replayed from a CUDA graph", spec);
    }
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return out;
}

/* The clipped training of `spec` against one CPU: parameters and norms within tol. */
static void clip_train_compare(const char* label, const char* spec, int stages, int graph, const mgpu_optimizer_desc* od,
                               const float* xs, const int32_t* ys, double tol) {
    enum { STEPS = 4, BATCH = 8 };
    float n1[STEPS], n2[STEPS];
    int64_t c1 = 0, c2 = 0;
    float* p1 = clip_train(NULL, 1, 0, od, STEPS, BATCH, xs, ys, n1, &c1);
    float* p2 = clip_train(spec, stages, graph, od, STEPS, BATCH, xs, ys, n2, &c2);
    if (p1 && p2 && c1 == c2) {
        double worst = 0.0;
        int s;
        for (s = 0; s < STEPS; ++s) worst = fmax(worst, rel_diff(n2[s], n1[s]));
        CHECK(worst < tol, "%s: norms differ from one CPU's by %.3g", label, worst);
        CHECK(rel_error_ff(p2, p1, c1) < tol, "%s: parameters differ from one CPU's by %.3g", label, rel_error_ff(p2, p1, c1));
        CHECK(n1[0] > od->clip_norm, "%s: the first norm %g is not above clip_norm %g (nothing clipped)", label, (double)n1[0],
              (double)od->clip_norm);
    }
    free(p1);
    free(p2);
}

static void test_optim_groups_clip(void) {
    static const char* const no_dec[] = { "1.weight", "0.bias" };
    static const char* const bad[] = { "0.bias", "2.weight" };
    mgpu_optimizer_desc d;
    uint64_t seed = rng_u64();
    float *a, *b;
    int64_t i, cnt = 0;
    header("5b. parameter groups (no weight decay) and clipping by global norm");
    /* groups against float64, SGD and AdamW */
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f; d.weight_decay = 0.2f; d.decay_matrices_only = 1;
    free(groups_clip_case("SGD momentum, wd 0.2, decay_matrices_only", d, 5, 1.0, NULL, seed, NULL, &cnt));
    d = odesc(MGPU_SGD, 0.1f); d.weight_decay = 0.2f; d.no_decay = no_dec; d.no_decay_count = 2;
    free(groups_clip_case("SGD wd 0.2, no_decay {1.weight, 0.bias}", d, 4, 1.0, NULL, seed, NULL, &cnt));
    d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.1f; d.decay_matrices_only = 1;
    free(groups_clip_case("AdamW wd 0.1, decay_matrices_only", d, 5, 1.0, NULL, seed, NULL, &cnt));
    d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.1f; d.decay_matrices_only = 1; d.no_decay = no_dec; d.no_decay_count = 1;
    free(groups_clip_case("AdamW wd 0.1, decay_matrices_only + no_decay {1.weight}", d, 4, 1.0, NULL, seed, NULL, &cnt));
    /* biases untouched by decay: zero gradients move only the matrices (SGD without momentum) */
    {
        mgpu_model* m = MODEL(mgpu_shape1(5), NULL, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(5, 4), mgpu_layer_linear(4, 3));
        mgpu_optimizer* o;
        d = odesc(MGPU_SGD, 0.1f); d.weight_decay = 0.5f; d.decay_matrices_only = 1;
        o = m ? mgpu_optimizer_create(m, &d) : NULL;
        if (o) {
            int t, moved = 1, kept = 1;
            float *before = get_flat(m, 0), *after;
            MUST(mgpu_model_zero_grad(m));
            MUST(mgpu_optimizer_step(o));
            after = get_flat(m, 0);
            for (t = 0; t < mgpu_model_tensor_count(m); ++t)
                for (i = toff(m, t); i < toff(m, t) + tnumel(m, t); ++i) {
                    if (mgpu_tensor_shape(mgpu_model_tensor(m, 0, t)).ndim < 2) kept &= after[i] == before[i];
                    else moved &= after[i] == before[i] - 0.1f * (0.5f * before[i]) || before[i] == 0.0f;
                }
            CHECK(kept, "decay_matrices_only: a bias moved under weight decay with zero gradients");
            CHECK(moved, "decay_matrices_only: a weight did not decay as p - lr * wd * p");
            free(before);
            free(after);
        }
        mgpu_optimizer_destroy(o);
        mgpu_model_destroy(m);
    }
    /* clipping against float64: above the threshold (every step scaled), below it */
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f; d.clip_norm = 0.5f;
    free(groups_clip_case("SGD momentum, clip_norm 0.5 (clipped)", d, 4, 2.0, NULL, seed, NULL, &cnt));
    d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.1f; d.decay_matrices_only = 1; d.clip_norm = 0.25f;
    free(groups_clip_case("AdamW, decay_matrices_only, clip_norm 0.25 (clipped)", d, 5, 2.0, NULL, seed, NULL, &cnt));
    d = odesc(MGPU_ADAMW, 0.01f); d.clip_norm = 1e4f;
    a = groups_clip_case("AdamW, clip_norm 1e4 (never reached)", d, 3, 1.0, NULL, seed, NULL, &cnt);
    d.clip_norm = 0.0f;
    b = groups_clip_case("AdamW, no clipping", d, 3, 1.0, NULL, seed, NULL, &cnt);
    CHECK(a && b && !memcmp(a, b, (size_t)cnt * sizeof(float)), "below clip_norm the update has the bits of no clipping");
    free(a);
    d = odesc(MGPU_SGD, 0.1f); d.clip_norm = INFINITY;
    a = groups_clip_case("SGD, clip_norm INFINITY (the norm alone)", d, 3, 1.0, NULL, seed, NULL, &cnt);
    d.clip_norm = 0.0f;
    free(b);
    b = groups_clip_case("SGD, no clipping", d, 3, 1.0, NULL, seed, NULL, &cnt);
    CHECK(a && b && !memcmp(a, b, (size_t)cnt * sizeof(float)), "clip_norm INFINITY: the update has the bits of no clipping");
    free(a);
    free(b);
    /* refusals */
    {
        mgpu_model* m = MODEL(mgpu_shape1(5), NULL, MGPU_LOSS_CROSS_ENTROPY, 3, mgpu_layer_linear(5, 4), mgpu_layer_linear(4, 3));
        mgpu_optimizer* o;
        float norm;
        d = odesc(MGPU_SGD, 0.1f); d.clip_norm = -1.0f;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "clip_norm -1", "mgpu_optimizer_create", "clip_norm", NULL);
        d = odesc(MGPU_SGD, 0.1f); d.clip_norm = NAN;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "clip_norm NaN", "clip_norm", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.weight_decay = 0.1f; d.no_decay = bad; d.no_decay_count = 2;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "no_decay with an unknown name", "mgpu_optimizer_create",
                    "'2.weight'", NULL);
        d = odesc(MGPU_SGD, 0.1f); d.no_decay_count = 1;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "no_decay NULL with a count", "no_decay_count", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f); d.no_decay = bad; d.no_decay_count = -1;
        expect_null(mgpu_optimizer_create(m, &d), MGPU_ERROR_INVALID_ARGUMENT, "no_decay_count -1", "no_decay_count", NULL, NULL);
        d = odesc(MGPU_SGD, 0.1f);
        o = m ? mgpu_optimizer_create(m, &d) : NULL;
        expect_fail(mgpu_optimizer_last_grad_norm(o, &norm), MGPU_ERROR_INVALID_ARGUMENT, "the norm without clipping",
                    "mgpu_optimizer_last_grad_norm", "clip_norm", NULL);
        mgpu_optimizer_destroy(o);
        d.clip_norm = 1.0f;
        o = m ? mgpu_optimizer_create(m, &d) : NULL;
        expect_fail(mgpu_optimizer_last_grad_norm(o, &norm), MGPU_ERROR_INVALID_ARGUMENT, "the norm before a step", "no step", NULL, NULL);
        expect_fail(mgpu_optimizer_last_grad_norm(o, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL norm", "NULL", NULL, NULL);
        expect_fail(mgpu_optimizer_last_grad_norm(NULL, &norm), MGPU_ERROR_INVALID_ARGUMENT, "a NULL optimizer", "NULL", NULL, NULL);
        mgpu_optimizer_destroy(o);
        mgpu_model_destroy(m);
    }
    /* training: data-parallel cpu:2 and a pipeline of 2 stages on cpu:2 clip as one CPU does */
    {
        enum { STEPS = 4, BATCH = 8 };
        float xs[STEPS * BATCH * 6];
        int32_t ys[STEPS * BATCH];
        make_clusters(STEPS * BATCH, 6, 3, xs, ys, 0.5);
        d = odesc(MGPU_ADAMW, 0.02f); d.weight_decay = 0.1f; d.decay_matrices_only = 1; d.clip_norm = 0.05f;
        clip_train_compare("AdamW clipped, cpu:2 (data parallel)", "cpu:2", 1, 0, &d, xs, ys, 1e-6);
        clip_train_compare("AdamW clipped, cpu:2 (2 pipeline stages)", "cpu:2", 2, 0, &d, xs, ys, 1e-6);
        d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f; d.weight_decay = 0.05f; d.decay_matrices_only = 1; d.clip_norm = 0.05f;
        clip_train_compare("SGD clipped, cpu:4 (2 replicas x 2 stages)", "cpu:4", 2, 0, &d, xs, ys, 1e-6);
        /* the GPU twin: the kernels' groups and norm against the CPU's */
#ifdef MGPU_CUDA
        if (test_gpu_group("parameter groups and clipping", g_gpu != NULL)) {
            float nc[5], ng[5];
            int t;
            double worst = 0.0;
            d = odesc(MGPU_ADAMW, 0.01f); d.weight_decay = 0.1f; d.decay_matrices_only = 1; d.no_decay = no_dec; d.no_decay_count = 1;
            d.clip_norm = 0.25f;
            a = groups_clip_case("AdamW groups + clipping, cpu", d, 5, 2.0, NULL, seed, nc, &cnt);
            b = groups_clip_case("AdamW groups + clipping, cuda:0", d, 5, 2.0, g_gpu_set, seed, ng, &cnt);
            for (t = 0; t < 5; ++t) worst = fmax(worst, rel_diff(ng[t], nc[t]));
            CHECK(worst < 1e-6, "cuda:0 vs cpu: norms differ by %.3g", worst);
            CHECK(a && b && rel_error_ff(b, a, cnt) < 1e-6, "cuda:0 vs cpu: parameters differ by %.3g", a && b ? rel_error_ff(b, a, cnt) : -1.0);
            free(a); free(b);
            d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f; d.weight_decay = 0.2f; d.decay_matrices_only = 1; d.clip_norm = 0.5f;
            a = groups_clip_case("SGD groups + clipping, cpu", d, 4, 2.0, NULL, seed, nc, &cnt);
            b = groups_clip_case("SGD groups + clipping, cuda:0", d, 4, 2.0, g_gpu_set, seed, ng, &cnt);
            CHECK(a && b && rel_error_ff(b, a, cnt) < 1e-6, "SGD cuda:0 vs cpu: parameters differ by %.3g", a && b ? rel_error_ff(b, a, cnt) : -1.0);
            free(a); free(b);
            d = odesc(MGPU_ADAMW, 0.02f); d.weight_decay = 0.1f; d.decay_matrices_only = 1; d.clip_norm = 0.05f;
            clip_train_compare("AdamW clipped, cuda:0", "cuda:0", 1, 0, &d, xs, ys, 1e-5);
            clip_train_compare("AdamW clipped, cuda:0,0 (data parallel)", "cuda:0,0", 1, 0, &d, xs, ys, 1e-5);
            clip_train_compare("AdamW clipped, cuda:0,0 (2 pipeline stages)", "cuda:0,0", 2, 0, &d, xs, ys, 1e-5);
            clip_train_compare("AdamW clipped, cuda:0 as a CUDA graph", "cuda:0", 1, 1, &d, xs, ys, 1e-5);
            clip_train_compare("AdamW clipped, cuda:0,0 (2 stages) as a CUDA graph", "cuda:0,0", 2, 1, &d, xs, ys, 1e-5);
            if (mgpu_cuda_device_count() >= 2)   /* the stages' sums between two GPUs (peer copies) */
                clip_train_compare("AdamW clipped, cuda:0,1 (2 pipeline stages)", "cuda:0,1", 2, 0, &d, xs, ys, 1e-5);
            else
                SKIP("clipping across the stages of two GPUs: %d GPU(s)", mgpu_cuda_device_count());
        }
#else
        gpu_group_note("parameter groups and clipping");
#endif
    }
}

/* ============================================================================================ */
/* 6. training                                                                                  */
/* ============================================================================================ */
/* n samples of `dim` features around `classes` random centres */
static void make_clusters(int n, int dim, int classes, float* x, int32_t* y, double spread) {
    double* centres = dbuf((int64_t)classes * dim);
    int i, k;
    for (i = 0; i < classes * dim; ++i) centres[i] = 1.5 * rng_gauss();
    for (i = 0; i < n; ++i) {
        int c = rng_int(classes);
        y[i] = c;
        for (k = 0; k < dim; ++k) x[i * dim + k] = (float)(centres[c * dim + k] + spread * rng_gauss());
    }
    free(centres);
}

/* float64 logits of a single Linear layer (W [out, in], b [out]) */
static void linear_ref(const float* x, int rows, int in, int out, const float* W, const float* b, double* z) {
    int r, o, k;
    for (r = 0; r < rows; ++r)
        for (o = 0; o < out; ++o) {
            double acc = b[o];
            for (k = 0; k < in; ++k) acc += (double)x[r * in + k] * W[o * in + k];
            z[r * out + o] = acc;
        }
}
/* mean cross-entropy and, if dz, its gradient (softmax - onehot) / rows */
static double xent_ref(const double* z, const int32_t* y, int rows, int cols, double* dz, int64_t* correct) {
    double total = 0.0;
    int r, c;
    if (correct) *correct = 0;
    for (r = 0; r < rows; ++r) {
        const double* zr = z + r * cols;
        double mx = zr[0], s = 0.0;
        int arg = 0;
        for (c = 1; c < cols; ++c) if (zr[c] > mx) { mx = zr[c]; arg = c; }
        for (c = 0; c < cols; ++c) s += exp(zr[c] - mx);
        total += log(s) + mx - zr[y[r]];
        if (correct) *correct += arg == y[r];
        if (dz) for (c = 0; c < cols; ++c) dz[r * cols + c] = (exp(zr[c] - mx) / s - (c == y[r])) / rows;
    }
    return total / rows;
}

/* One SGD step of a single Linear layer: the reported loss and the update against float64. */
static void first_step_case(const char* spec, mgpu_loss_kind loss) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set = spec ? mgpu_device_set_create(spec) : NULL;
    const int B = 10, in = 5, out = loss == MGPU_LOSS_MSE ? 3 : 4;
    const float lr = 0.5f;
    mgpu_model* m;
    mgpu_optimizer* opt;
    float *p0, *p1, xs[10 * 5], ts[10 * 4], got_loss = -1.0f;
    int32_t ys[10];
    double z[10 * 4], dz[10 * 4], ref_loss = 0.0, *gref;
    float* ggot;
    mgpu_tensor *x, *t;
    int i, o, k, r, np;
    const char* label = loss == MGPU_LOSS_MSE ? "MSE" : "cross-entropy";
    if (spec && !set) { CHECK(0, "%s: %s", spec, mgpu_last_error()); return; }
    m = MODEL(mgpu_shape1(in), set, loss, 21, mgpu_layer_linear(in, out));
    opt = m ? make_opt(m, MGPU_SGD, lr, 0.0f, 0.0f) : NULL;
    if (!m || !opt) { mgpu_model_destroy(m); mgpu_device_set_destroy(set); return; }
    p0 = get_flat(m, 0);
    rnd_normal(xs, B * in, 1.0);
    rnd_normal(ts, B * out, 1.0);
    for (i = 0; i < B; ++i) ys[i] = rng_int(out);
    x = tfrom(cpu, mgpu_shape2(B, in), xs);
    t = loss == MGPU_LOSS_MSE ? tfrom(cpu, mgpu_shape2(B, out), ts) : tfrom_i32(cpu, mgpu_shape1(B), ys);
    linear_ref(xs, B, in, out, p0 + toff(m, 0), p0 + toff(m, 1), z);
    if (loss == MGPU_LOSS_MSE) {
        for (i = 0; i < B * out; ++i) {
            ref_loss += (z[i] - ts[i]) * (z[i] - ts[i]);
            dz[i] = 2.0 * (z[i] - ts[i]) / (B * out);
        }
        ref_loss /= B * out;
    } else {
        ref_loss = xent_ref(z, ys, B, out, dz, NULL);
    }
    np = out * in + out;
    gref = dbuf(np);
    for (o = 0; o < out; ++o) {
        for (k = 0; k < in; ++k)
            for (r = 0; r < B; ++r) gref[o * in + k] += dz[r * out + o] * xs[r * in + k];
        for (r = 0; r < B; ++r) gref[out * in + o] += dz[r * out + o];
    }
    MUST(mgpu_model_train_step(m, opt, x, t, &got_loss));
    p1 = get_flat(m, 0);
    ggot = fbuf(np);
    for (i = 0; i < out * in; ++i) ggot[i] = (float)(((double)p0[toff(m, 0) + i] - p1[toff(m, 0) + i]) / lr);
    for (i = 0; i < out; ++i) ggot[out * in + i] = (float)(((double)p0[toff(m, 1) + i] - p1[toff(m, 1) + i]) / lr);
    CHECK(rel_diff(got_loss, ref_loss) < 1e-5, "%s on %s: train_step loss %.8g, float64 %.8g", label, spec ? spec : "cpu",
          (double)got_loss, ref_loss);
    CHECK(test_rel_error(ggot, gref, (size_t)np) < 1e-4, "%s on %s: first SGD step off the analytic gradient: %.3g", label,
          spec ? spec : "cpu", test_rel_error(ggot, gref, (size_t)np));
    if (set) CHECK(replicas_identical(m), "%s on %s: replicas differ after a step", label, spec);
    free(p0); free(p1); free(ggot); free(gref);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

static void evaluate_case(const char* spec) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set = spec ? mgpu_device_set_create(spec) : NULL;
    const int n = g_quick ? 700 : 1300, in = 5, out = 4;
    float *xs = fbuf((int64_t)n * in), *p, loss = -1.0f;
    int32_t* ys = (int32_t*)xmalloc((size_t)n * sizeof(int32_t));
    double* z = dbuf((int64_t)n * out), ref;
    int64_t correct = -1, ref_correct = 0;
    mgpu_model* m;
    mgpu_tensor *x, *y;
    int i;
    m = MODEL(mgpu_shape1(in), set, MGPU_LOSS_CROSS_ENTROPY, 5, mgpu_layer_linear(in, out), mgpu_layer_dropout(0.5f));
    if (m) {
        rnd_normal(xs, (int64_t)n * in, 1.0);
        for (i = 0; i < n; ++i) ys[i] = rng_int(out);
        x = tfrom(cpu, mgpu_shape2(n, in), xs);
        y = tfrom_i32(cpu, mgpu_shape1(n), ys);
        p = get_flat(m, 0);
        linear_ref(xs, n, in, out, p + toff(m, 0), p + toff(m, 1), z);
        ref = xent_ref(z, ys, n, out, NULL, &ref_correct);
        MUST(mgpu_model_evaluate(m, x, y, &loss, &correct));
        CHECK(rel_diff(loss, ref) < 1e-5, "evaluate on %s (%d rows, dropout off): loss %.8g, float64 %.8g", spec ? spec : "cpu",
              n, (double)loss, ref);
        CHECK(correct == ref_correct, "evaluate on %s: %lld correct, float64 says %lld", spec ? spec : "cpu", (long long)correct,
              (long long)ref_correct);
        MUST(mgpu_model_evaluate(m, x, y, NULL, NULL));
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
        free(p);
    }
    mgpu_model_destroy(m);
    /* MSE */
    m = MODEL(mgpu_shape1(in), set, MGPU_LOSS_MSE, 6, mgpu_layer_linear(in, 2));
    if (m) {
        float* ts = fbuf((int64_t)n * 2);
        double r = 0.0;
        rnd_normal(ts, (int64_t)n * 2, 1.0);
        x = tfrom(cpu, mgpu_shape2(n, in), xs);
        y = tfrom(cpu, mgpu_shape2(n, 2), ts);
        p = get_flat(m, 0);
        linear_ref(xs, n, in, 2, p + toff(m, 0), p + toff(m, 1), z);
        for (i = 0; i < n * 2; ++i) r += (z[i] - ts[i]) * (z[i] - ts[i]);
        r /= n * 2;
        correct = -1;
        MUST(mgpu_model_evaluate(m, x, y, &loss, &correct));
        CHECK(rel_diff(loss, r) < 1e-5, "MSE evaluate on %s: loss %.8g, float64 %.8g", spec ? spec : "cpu", (double)loss, r);
        CHECK(correct == 0, "MSE evaluate counts no correct predictions: %lld", (long long)correct);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
        free(p);
        free(ts);
    }
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    free(xs); free(ys); free(z);
}

/* A small CNN with Dropout, trained `steps` steps: the losses and the final parameters. */
static mgpu_model* cnn_model(const mgpu_device_set* set, uint64_t seed, float dropout) {
    if (dropout > 0.0f)
        return MODEL(mgpu_shape3(1, 8, 8), set, MGPU_LOSS_CROSS_ENTROPY, seed, mgpu_layer_conv2d(1, 3, 3, 1, 1), mgpu_layer_relu(),
                     mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_dropout(dropout), mgpu_layer_linear(48, 4));
    return MODEL(mgpu_shape3(1, 8, 8), set, MGPU_LOSS_CROSS_ENTROPY, seed, mgpu_layer_conv2d(1, 3, 3, 1, 1), mgpu_layer_relu(),
                 mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(48, 4));
}
static float* cnn_run(uint64_t seed, int steps, const float* xs, const int32_t* ys, int batch, float* losses, int64_t* nflat) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_model* m = cnn_model(NULL, seed, 0.3f);
    mgpu_optimizer* opt = m ? make_opt(m, MGPU_ADAMW, 1e-2f, 0.0f, 0.01f) : NULL;
    float* p = NULL;
    int s;
    if (m && opt) {
        for (s = 0; s < steps; ++s) {
            mgpu_tensor* x = tfrom(cpu, mgpu_shape4(batch, 1, 8, 8), xs + (size_t)s * batch * 64);
            mgpu_tensor* y = tfrom_i32(cpu, mgpu_shape1(batch), ys + (size_t)s * batch);
            MUST(mgpu_model_train_step(m, opt, x, y, &losses[s]));
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
        }
        p = get_flat(m, 0);
        *nflat = flat_n(m);
    }
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    return p;
}

/* The same training on `spec` and on one CPU: losses, parameters, replicas identical. */
static void dp_case(const char* spec, int conv, const mgpu_optimizer_desc* od, const char* oname, int batch, int steps,
                    const float* xs, const int32_t* ys) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model *m1, *mp;
    mgpu_optimizer *o1, *op;
    int s, sample = conv == 1 ? 36 : conv == 2 ? 32 : 10, identical = 1;
    const char* kind = conv == 1 ? "CNN" : conv == 2 ? "MLP 32-96-10" : "MLP";
    double worst_loss = 0.0, e = 0.0;
    if (!set) { CHECK(0, "%s: %s", spec, mgpu_last_error()); return; }
    if (conv == 2) {
        m1 = MODEL(mgpu_shape1(32), NULL, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_linear(32, 96), mgpu_layer_tanh(), mgpu_layer_linear(96, 10));
        mp = MODEL(mgpu_shape1(32), set, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_linear(32, 96), mgpu_layer_tanh(), mgpu_layer_linear(96, 10));
    } else if (conv) {
        m1 = MODEL(mgpu_shape3(1, 6, 6), NULL, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_conv2d(1, 2, 3, 1, 1), mgpu_layer_relu(),
                   mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(18, 3));
        mp = MODEL(mgpu_shape3(1, 6, 6), set, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_conv2d(1, 2, 3, 1, 1), mgpu_layer_relu(),
                   mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(18, 3));
    } else {
        m1 = MODEL(mgpu_shape1(10), NULL, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_linear(10, 16), mgpu_layer_tanh(), mgpu_layer_linear(16, 3));
        mp = MODEL(mgpu_shape1(10), set, MGPU_LOSS_CROSS_ENTROPY, 8, mgpu_layer_linear(10, 16), mgpu_layer_tanh(), mgpu_layer_linear(16, 3));
    }
    o1 = m1 ? mgpu_optimizer_create(m1, od) : NULL;
    op = mp ? mgpu_optimizer_create(mp, od) : NULL;
    if (m1 && mp && o1 && op) {
        float *p1, *pp;
        for (s = 0; s < steps; ++s) {
            mgpu_shape xsh = conv == 1 ? mgpu_shape4(batch, 1, 6, 6) : mgpu_shape2(batch, sample);
            mgpu_tensor* x = tfrom(cpu, xsh, xs + (size_t)s * batch * sample);
            mgpu_tensor* y = tfrom_i32(cpu, mgpu_shape1(batch), ys + (size_t)s * batch);
            float l1 = -1.0f, lp = -2.0f;
            MUST(mgpu_model_train_step(m1, o1, x, y, &l1));
            MUST(mgpu_model_train_step(mp, op, x, y, &lp));
            worst_loss = fmax(worst_loss, rel_diff(lp, l1));
            identical &= replicas_identical(mp);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
        }
        p1 = get_flat(m1, 0);
        pp = get_flat(mp, 0);
        e = rel_error_ff(pp, p1, flat_n(m1));
        CHECK(worst_loss < 1e-5, "%s %s %s batch %d: losses differ from one CPU by %.3g", spec, kind, oname,
              batch, worst_loss);
        CHECK(e < 1e-5, "%s %s %s batch %d: parameters after %d steps differ from one CPU: %.3g", spec, kind,
              oname, batch, steps, e);
        CHECK(identical, "%s %s %s batch %d: replicas not bit-identical after every step", spec, kind, oname,
              batch);
        if (test_is_verbose()) printf("  %s %s %s batch %d: loss diff %.3g, param error %.3g\n", spec, kind,
                                      oname, batch, worst_loss, e);
        free(p1);
        free(pp);
    }
    mgpu_optimizer_destroy(o1);
    mgpu_optimizer_destroy(op);
    mgpu_model_destroy(m1);
    mgpu_model_destroy(mp);
    mgpu_device_set_destroy(set);
}

/* gradient accumulation over micro-batches against one step; replica verification */
static void accumulate_case(const char* spec) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set = spec ? mgpu_device_set_create(spec) : NULL;
    float xs[16 * 6], l1 = 0.0f, la = 0.0f, lb = 0.0f, *p1, *p2;
    int32_t ys[16];
    mgpu_model *m1, *m2;
    mgpu_optimizer *o1, *o2;
    const char* name = spec ? spec : "cpu";
    int i;
    if (spec && !set) { CHECK(0, "%s: %s", spec, mgpu_last_error()); return; }
    make_clusters(16, 6, 3, xs, ys, 1.0);
    m1 = MODEL(mgpu_shape1(6), set, MGPU_LOSS_CROSS_ENTROPY, 4, mgpu_layer_linear(6, 8), mgpu_layer_tanh(), mgpu_layer_linear(8, 3));
    m2 = MODEL(mgpu_shape1(6), set, MGPU_LOSS_CROSS_ENTROPY, 4, mgpu_layer_linear(6, 8), mgpu_layer_tanh(), mgpu_layer_linear(8, 3));
    o1 = m1 ? make_opt(m1, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
    o2 = m2 ? make_opt(m2, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
    if (m1 && m2 && o1 && o2) {
        mgpu_tensor *x = tfrom(cpu, mgpu_shape2(16, 6), xs), *y = tfrom_i32(cpu, mgpu_shape1(16), ys);
        mgpu_tensor *xa = mgpu_tensor_view_rows(x, 0, 8), *ya = mgpu_tensor_view_rows(y, 0, 8);
        mgpu_tensor *xb = mgpu_tensor_view_rows(x, 8, 8), *yb = mgpu_tensor_view_rows(y, 8, 8);
        MUST(mgpu_model_zero_grad(m2));
        for (i = 0; i < 2; ++i) {
            MUST(mgpu_model_train_step(m1, o1, x, y, &l1));
            MUST(mgpu_model_accumulate(m2, xa, ya, 16, &la));
            MUST(mgpu_model_accumulate(m2, xb, yb, 16, &lb));
            MUST(mgpu_model_apply(m2, o2));
            CHECK(rel_diff(0.5 * ((double)la + lb), l1) < 1e-6, "%s: accumulate: micro-batch losses %g, %g against %g", name,
                  (double)la, (double)lb, (double)l1);
        }
        p1 = get_flat(m1, 0);
        p2 = get_flat(m2, 0);
        CHECK(rel_error_ff(p2, p1, flat_n(m1)) < 1e-6, "%s: two accumulated halves + apply differ from train_step: %.3g", name,
              rel_error_ff(p2, p1, flat_n(m1)));
        CHECK(mgpu_optimizer_step_count(o2) == 2, "%s: apply took %lld steps", name, (long long)mgpu_optimizer_step_count(o2));
        free(p2);
        /* a whole batch through accumulate (batch_total 0) and apply: the same bits as train_step */
        MUST(mgpu_model_train_step(m1, o1, x, y, &l1));
        put_flat(m2, 0, p1);
        for (i = 1; i < mgpu_model_replica_count(m2); ++i) put_flat(m2, i, p1);
        free(p1);
        {
            /* make m2's optimizer state equal m1's before its third step (white box) */
            mgpu_model* m3 = MODEL(mgpu_shape1(6), set, MGPU_LOSS_CROSS_ENTROPY, 4, mgpu_layer_linear(6, 8), mgpu_layer_tanh(),
                                   mgpu_layer_linear(8, 3));
            mgpu_optimizer* o3 = m3 ? make_opt(m3, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
            if (m3 && o3) {
                float *pa, *pb;
                MUST(mgpu_model_train_step(m3, o3, x, y, NULL));
                MUST(mgpu_model_train_step(m3, o3, x, y, NULL));
                MUST(mgpu_model_zero_grad(m3));   /* train_step leaves the last step's gradients behind */
                MUST(mgpu_model_accumulate(m3, x, y, 0, &la));
                MUST(mgpu_model_apply(m3, o3));
                pa = get_flat(m1, 0);
                pb = get_flat(m3, 0);
                CHECK(same_bits(pa, pb, (size_t)flat_n(m1) * sizeof(float)) && la == l1,
                      "%s: accumulate(whole batch) + apply is not bit-identical to train_step", name);
                free(pa);
                free(pb);
            }
            mgpu_optimizer_destroy(o3);
            mgpu_model_destroy(m3);
        }
        if (mgpu_model_replica_count(m1) > 1) {
            float* p = get_flat(m1, 1);
            MUST(mgpu_model_verify_replicas(m1));
            p[toff(m1, 3) + 1] += 1.0f;   /* replica 1's 2.bias[1] */
            put_flat(m1, 1, p);
            expect_fail(mgpu_model_verify_replicas(m1), MGPU_ERROR_DIVERGED, "verify after corrupting replica 1",
                        "replica 1", "'2.bias' element 1", NULL);
            free(p);
        }
        mgpu_tensor_destroy(xa); mgpu_tensor_destroy(ya); mgpu_tensor_destroy(xb); mgpu_tensor_destroy(yb);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    mgpu_optimizer_destroy(o1); mgpu_optimizer_destroy(o2);
    mgpu_model_destroy(m1); mgpu_model_destroy(m2);
    mgpu_device_set_destroy(set);
}

static void test_training(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    int steps = g_quick ? 25 : 50, s, i;
    header("6. training");
    /* an MLP learns separable clusters */
    {
        const int n = 128, B = 32;
        float *xs = fbuf(n * 8), first = 0.0f, last = 0.0f, loss;
        int32_t* ys = (int32_t*)xmalloc(n * sizeof(int32_t));
        mgpu_model* m = MODEL(mgpu_shape1(8), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_linear(8, 16), mgpu_layer_relu(),
                              mgpu_layer_linear(16, 3));
        mgpu_optimizer* opt = m ? make_opt(m, MGPU_SGD, 0.05f, 0.9f, 0.0f) : NULL;
        make_clusters(n, 8, 3, xs, ys, 0.5);
        if (m && opt) {
            mgpu_tensor *xall = tfrom(cpu, mgpu_shape2(n, 8), xs), *yall = tfrom_i32(cpu, mgpu_shape1(n), ys);
            int64_t correct = 0;
            for (s = 0; s < steps; ++s) {
                mgpu_tensor* x = mgpu_tensor_view_rows(xall, (s % 4) * B, B);
                mgpu_tensor* y = mgpu_tensor_view_rows(yall, (s % 4) * B, B);
                MUST(mgpu_model_train_step(m, opt, x, y, &loss));
                if (s < 4) first += loss / 4;
                if (s >= steps - 4) last += loss / 4;
                mgpu_tensor_destroy(x);
                mgpu_tensor_destroy(y);
            }
            CHECK(last < 0.3f * first, "MLP: mean loss of the first 4 steps %.4g, of the last 4 %.4g", (double)first, (double)last);
            MUST(mgpu_model_evaluate(m, xall, yall, &loss, &correct));
            CHECK(correct >= n * 9 / 10, "MLP: %lld of %d correct after training (loss %.4g)", (long long)correct, n, (double)loss);
            mgpu_tensor_destroy(xall);
            mgpu_tensor_destroy(yall);
        }
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
        free(xs);
        free(ys);
    }
    /* regression with MSE: y = A x + c */
    {
        const int n = 64;
        float xs[64 * 3], ts[64 * 2], first = 0.0f, loss = 0.0f;
        const float A[6] = {0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -0.75f}, c[2] = {0.3f, -0.2f};
        mgpu_model* m = MODEL(mgpu_shape1(3), NULL, MGPU_LOSS_MSE, 2, mgpu_layer_linear(3, 2));
        mgpu_optimizer* opt = m ? make_opt(m, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
        rnd_normal(xs, n * 3, 1.0);
        for (i = 0; i < n; ++i) {
            ts[i * 2] = A[0] * xs[i * 3] + A[1] * xs[i * 3 + 1] + A[2] * xs[i * 3 + 2] + c[0];
            ts[i * 2 + 1] = A[3] * xs[i * 3] + A[4] * xs[i * 3 + 1] + A[5] * xs[i * 3 + 2] + c[1];
        }
        if (m && opt) {
            mgpu_tensor *x = tfrom(cpu, mgpu_shape2(n, 3), xs), *t = tfrom(cpu, mgpu_shape2(n, 2), ts);
            float* p;
            for (s = 0; s < 200; ++s) {
                MUST(mgpu_model_train_step(m, opt, x, t, &loss));
                if (s == 0) first = loss;
            }
            p = get_flat(m, 0);
            CHECK(loss < 1e-6f * first, "MSE regression: loss %.4g -> %.4g after 200 steps", (double)first, (double)loss);
            CHECK(fabs(p[toff(m, 0) + 2] - 2.0) < 1e-3 && fabs(p[toff(m, 1) + 1] + 0.2) < 1e-3,
                  "MSE regression: W[0][2] = %.5f (want 2), b[1] = %.5f (want -0.2)", (double)p[toff(m, 0) + 2],
                  (double)p[toff(m, 1) + 1]);
            free(p);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(t);
        }
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
    }
    /* the first step against float64: loss and gradient, one device and an uneven split */
    first_step_case(NULL, MGPU_LOSS_CROSS_ENTROPY);
    first_step_case("cpu:3", MGPU_LOSS_CROSS_ENTROPY);
    first_step_case(NULL, MGPU_LOSS_MSE);
    first_step_case("cpu:3", MGPU_LOSS_MSE);
    first_step_case("cpu:4", MGPU_LOSS_MSE);
    /* gradient accumulation, replica verification */
    accumulate_case(NULL);
    accumulate_case("cpu:2");
    /* evaluate against float64 */
    evaluate_case(NULL);
    evaluate_case("cpu:3");
    if (mgpu_cuda_device_count() >= 1) evaluate_case("cuda:0");     /* several chunks, read back at the end */
    if (mgpu_cuda_device_count() >= 2) evaluate_case("cuda:0,1");
    /* the same seed twice: bit-identical losses (with Dropout); another seed: different */
    {
        const int B = 16, S = 5;
        float *xs = fbuf(S * B * 64), la[5], lb[5], lc[5], *pa, *pb, *pc;
        int32_t ys[5 * 16];
        int64_t nflat = 0;
        rnd_normal(xs, S * B * 64, 1.0);
        for (i = 0; i < S * B; ++i) ys[i] = rng_int(4);
        pa = cnn_run(3, S, xs, ys, B, la, &nflat);
        pb = cnn_run(3, S, xs, ys, B, lb, &nflat);
        pc = cnn_run(4, S, xs, ys, B, lc, &nflat);
        if (pa && pb && pc) {
            CHECK(same_bits(la, lb, sizeof la), "same seed: losses differ (%.9g vs %.9g ...)", (double)la[0], (double)lb[0]);
            CHECK(same_bits(pa, pb, sizeof(float) * (size_t)nflat), "same seed: parameters differ");
            CHECK(!same_bits(la, lc, sizeof la), "different seeds: identical losses");
            CHECK(la[S - 1] == la[S - 1] && la[S - 1] < 10.0f, "CNN with Dropout: finite losses (%g)", (double)la[S - 1]);
        }
        free(pa); free(pb); free(pc); free(xs);
    }
    /* data parallel: cpu:2, cpu:3 (uneven), cpu:4 against one CPU */
    {
        const int S = 5, B = 64;
        float* xs = fbuf(S * B * 36);
        int32_t* ys = (int32_t*)xmalloc(S * B * sizeof(int32_t));
        mgpu_optimizer_desc sgd = odesc(MGPU_SGD, 0.05f), adamw = odesc(MGPU_ADAMW, 1e-2f);
        const char* specs[3] = {"cpu:2", "cpu:3", "cpu:4"};
        sgd.momentum = 0.9f;
        sgd.weight_decay = 1e-3f;
        adamw.weight_decay = 0.01f;
        make_clusters(S * B, 10, 3, xs, ys, 0.8);
        for (i = 0; i < 3; ++i) {
            dp_case(specs[i], 0, &sgd, "SGD+momentum", B, S, xs, ys);
            dp_case(specs[i], 0, &adamw, "AdamW", B, S, xs, ys);
            dp_case(specs[i], 0, &sgd, "SGD+momentum", 62, S, xs, ys);
        }
        rnd_normal(xs, S * B * 36, 1.0);
        for (i = 0; i < 3; ++i) {
            dp_case(specs[i], 1, &sgd, "SGD+momentum", B, S, xs, ys);
            dp_case(specs[i], 1, &adamw, "AdamW", 61, S, xs, ys);
        }
        /* wider layers keep the replicas' threads busy longer: races between them show up */
        for (i = 0; i < (g_quick ? 2 : 6); ++i) dp_case(i % 2 ? "cpu:3" : "cpu:2", 2, &sgd, "SGD+momentum", B, S, xs, ys);
        free(xs);
        free(ys);
    }
}


/* Every getter that takes an index: NULL for one out of range, with an error naming the getter,
   the index and how many there are. */
static void test_getter_errors(void) {
    mgpu_model* m;
    mgpu_optimizer* o;
    mgpu_optimizer_desc d = odesc(MGPU_SGD, 0.1f);
    header("getters: bad indices");
    d.momentum = 0.9f;
    m = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 9, mgpu_layer_linear(4, 3));
    o = m ? mgpu_optimizer_create(m, &d) : NULL;
    if (!m || !o) { CHECK(0, "model: %s", mgpu_last_error()); mgpu_model_destroy(m); return; }
#define GETTER_FAILS(call, name, idx, count)                                                                          \
    do {                                                                                                              \
        const void* got_;                                                                                             \
        mgpu_clear_error();                                                                                           \
        got_ = (const void*)(call);                                                                                   \
        CHECK(got_ == NULL && mgpu_last_result() == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), name) &&  \
                  strstr(mgpu_last_error(), idx) && strstr(mgpu_last_error(), count),                                   \
              "%s: NULL and an error naming it, %s and %s (got %p, '%s')", #call, idx, count, got_, mgpu_last_error()); \
    } while (0)
    GETTER_FAILS(mgpu_model_params(m, 1), "mgpu_model_params", "replica 1", "with 1 replica");
    GETTER_FAILS(mgpu_model_params(m, -1), "mgpu_model_params", "replica -1", "with 1 replica");
    GETTER_FAILS(mgpu_model_grads(m, 7), "mgpu_model_grads", "replica 7", "with 1 replica");
    GETTER_FAILS(mgpu_model_device(m, 1), "mgpu_model_device", "replica 1", "with 1 replica");
    GETTER_FAILS(mgpu_model_tensor_name(m, 2), "mgpu_model_tensor_name", "tensor 2", "with 2 tensors");
    GETTER_FAILS(mgpu_model_tensor_name(m, -1), "mgpu_model_tensor_name", "tensor -1", "with 2 tensors");
    GETTER_FAILS(mgpu_model_tensor(m, 0, 2), "mgpu_model_tensor", "tensor 2", "with 2 tensors");
    GETTER_FAILS(mgpu_model_tensor(m, 3, 0), "mgpu_model_tensor", "replica 3", "with 1 replica");
    GETTER_FAILS(mgpu_model_param(m, 1, "0.weight"), "mgpu_model_param", "replica 1", "with 1 replica");
    GETTER_FAILS(mgpu_model_grad(m, 0, "9.weight"), "mgpu_model_grad", "9.weight", "its 2");
    GETTER_FAILS(mgpu_optimizer_state(o, 2, "0.weight", "momentum_buffer"), "mgpu_optimizer_state", "replica 2", "with 1 replica");
    GETTER_FAILS(mgpu_model_params(NULL, 0), "mgpu_model_params", "NULL", "model");
#undef GETTER_FAILS
    mgpu_clear_error();
    CHECK(mgpu_model_device(m, 0) != NULL && mgpu_model_tensor(m, 0, 1) != NULL && mgpu_model_tensor_name(m, 1) != NULL &&
              mgpu_last_result() == MGPU_OK, "good indices still work: %s", mgpu_last_error());
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

/* ============================================================================================ */
/* 7. checkpoints                                                                               */
/* ============================================================================================ */
/* A safetensors file written here, independently of mgpu: each tensor's bytes follow in order. */
typedef struct st_item {
    const char* name;
    const char* dtype;
    int ndim;
    int64_t shape[4];
    size_t bytes;        /* of zeros-and-ones data written for it */
} st_item;
static int write_st(const char* path, const st_item* items, int n, const char* meta_json) {
    char hdr[8192];
    size_t len = 0, off = 0, total = 0, i;
    uint8_t* data;
    FILE* f;
    int k, ok;
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "{");
    if (meta_json) len += (size_t)snprintf(hdr + len, sizeof hdr - len, "\"__metadata__\":{%s}%s", meta_json, n ? "," : "");
    for (k = 0; k < n; ++k) {
        int d;
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", k ? "," : "",
                                items[k].name, items[k].dtype);
        for (d = 0; d < items[k].ndim; ++d)
            len += (size_t)snprintf(hdr + len, sizeof hdr - len, d ? ",%lld" : "%lld", (long long)items[k].shape[d]);
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, "],\"data_offsets\":[%zu,%zu]}", off, off + items[k].bytes);
        off += items[k].bytes;
    }
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "}");
    while (len % 8) hdr[len++] = ' ';
    total = off;
    data = (uint8_t*)xmalloc(total + 1);
    for (i = 0; i < total / 4; ++i) ((float*)data)[i] = 0.25f * (float)(i % 7);   /* harmless finite values */
    f = fopen(path, "wb");
    if (!f) { free(data); return 0; }
    {
        uint8_t l8[8];
        for (k = 0; k < 8; ++k) l8[k] = (uint8_t)((uint64_t)len >> (8 * k));
        ok = fwrite(l8, 1, 8, f) == 8 && fwrite(hdr, 1, len, f) == len && fwrite(data, 1, total, f) == total;
    }
    ok &= fclose(f) == 0;
    free(data);
    return ok;
}
/* the JSON header of a safetensors file, without whitespace */
static char* st_header(const char* path, uint64_t* data_start) {
    size_t len, i, j = 0;
    uint8_t* f = read_file(path, &len);
    uint64_t h = 0;
    char* out;
    int k;
    if (!f || len < 8) { free(f); return NULL; }
    for (k = 0; k < 8; ++k) h |= (uint64_t)f[k] << (8 * k);
    if (h > len - 8) { free(f); return NULL; }
    out = (char*)xmalloc((size_t)h + 1);
    for (i = 0; i < h; ++i) if (f[8 + i] != ' ' && f[8 + i] != '\n' && f[8 + i] != '\t') out[j++] = (char)f[8 + i];
    out[j] = 0;
    if (data_start) *data_start = 8 + h;
    free(f);
    return out;
}
/* the bytes of tensor `name` in the file: F32, the given shape text, and equal to `want` */
static void check_st_tensor(const char* path, const char* name, const char* shape, const float* want, int64_t n) {
    uint64_t start = 0;
    char* h = st_header(path, &start);
    char key[160];
    const char* at;
    unsigned long long b = 0, e = 0;
    size_t len;
    uint8_t* f;
    if (!h) { CHECK(0, "%s: no safetensors header", path); return; }
    snprintf(key, sizeof key, "\"%s\":{", name);
    at = strstr(h, key);
    CHECK(at != NULL, "checkpoint lacks tensor '%s'", name);
    if (at) {
        const char* end = strchr(at, '}');
        char shp[96];
        const char* off = strstr(at, "\"data_offsets\":[");
        snprintf(shp, sizeof shp, "\"shape\":%s", shape);
        CHECK(strstr(at, "\"dtype\":\"F32\"") && strstr(at, "\"dtype\":\"F32\"") < end, "'%s' is not F32", name);
        CHECK(strstr(at, shp) && strstr(at, shp) < end, "'%s' does not have shape %s: %.120s", name, shape, at);
        if (off && off < end && sscanf(off, "\"data_offsets\":[%llu,%llu]", &b, &e) == 2) {
            f = read_file(path, &len);
            CHECK(e - b == (unsigned long long)n * 4 && start + e <= len && same_bits(f + start + b, want, (size_t)n * 4),
                  "'%s': the stored bytes are not the model's", name);
            free(f);
        } else CHECK(0, "'%s': no data_offsets", name);
    }
    free(h);
}

static mgpu_model* ck_model(uint64_t seed, int dropout) {
    if (dropout)
        return MODEL(mgpu_shape1(6), NULL, MGPU_LOSS_CROSS_ENTROPY, seed, mgpu_layer_linear(6, 12), mgpu_layer_relu(),
                     mgpu_layer_dropout(0.3f), mgpu_layer_linear(12, 3));
    return MODEL(mgpu_shape1(6), NULL, MGPU_LOSS_CROSS_ENTROPY, seed, mgpu_layer_linear(6, 12), mgpu_layer_relu(), mgpu_layer_linear(12, 3));
}
static void train_batches(mgpu_model* m, mgpu_optimizer* o, const float* xs, const int32_t* ys, int B, int from, int count,
                          float* losses) {
    mgpu_device* cpu = mgpu_device_cpu();
    int s;
    for (s = from; s < from + count; ++s) {
        mgpu_tensor* x = tfrom(cpu, mgpu_shape2(B, 6), xs + (size_t)s * B * 6);
        mgpu_tensor* y = tfrom_i32(cpu, mgpu_shape1(B), ys + (size_t)s * B);
        float l = 0.0f;
        MUST(mgpu_model_train_step(m, o, x, y, &l));
        if (losses) losses[s - from] = l;
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
    }
}

/* train N steps, save, train M more; a fresh model and optimizer loaded from the file must
   repeat those M steps bit for bit */
static void resume_case(const char* label, mgpu_optimizer_desc od, int dropout) {
    enum { N = 3, M = 4, B = 16 };
    float xs[(N + M) * B * 6], la[M], lb[M], *pa_save, *pa, *pb, *pb_loaded, *junk;
    int32_t ys[(N + M) * B];
    char path[512];
    mgpu_model *a = ck_model(7, dropout), *b = ck_model(7, dropout);
    mgpu_optimizer *oa = a ? mgpu_optimizer_create(a, &od) : NULL, *ob = b ? mgpu_optimizer_create(b, &od) : NULL;
    float lr_at_save;
    int64_t n;
    make_clusters((N + M) * B, 6, 3, xs, ys, 1.0);
    tpath(path, sizeof path, "resume.safetensors");
    if (!a || !b || !oa || !ob) {
        CHECK(0, "%s: setup: %s", label, mgpu_last_error());
        goto done;
    }
    n = flat_n(a);
    train_batches(a, oa, xs, ys, B, 0, N, NULL);
    MUST(mgpu_model_save(a, oa, path));
    lr_at_save = mgpu_optimizer_lr(oa);
    pa_save = get_flat(a, 0);
    train_batches(a, oa, xs, ys, B, N, M, la);
    pa = get_flat(a, 0);
    /* b: scrambled parameters, then the checkpoint */
    junk = fbuf(n);
    rnd_normal(junk, n, 1.0);
    put_flat(b, 0, junk);
    MUST(mgpu_model_load(b, ob, path));
    pb_loaded = get_flat(b, 0);
    CHECK(same_bits(pa_save, pb_loaded, (size_t)n * sizeof(float)), "%s: loaded parameters differ from the saved ones", label);
    CHECK(mgpu_optimizer_step_count(ob) == N, "%s: the loaded optimizer has taken %lld steps, the saved one %d", label,
          (long long)mgpu_optimizer_step_count(ob), N);
    CHECK(mgpu_optimizer_lr(ob) == lr_at_save, "%s: loaded learning rate %.9g, saved %.9g", label,
          (double)mgpu_optimizer_lr(ob), (double)lr_at_save);
    train_batches(b, ob, xs, ys, B, N, M, lb);
    pb = get_flat(b, 0);
    CHECK(same_bits(la, lb, sizeof la), "%s: resumed losses differ: %.9g %.9g %.9g %.9g vs %.9g %.9g %.9g %.9g", label,
          (double)la[0], (double)la[1], (double)la[2], (double)la[3], (double)lb[0], (double)lb[1], (double)lb[2], (double)lb[3]);
    CHECK(same_bits(pa, pb, (size_t)n * sizeof(float)), "%s: resumed parameters differ (error %.3g)", label,
          rel_error_ff(pb, pa, n));
    free(pa_save); free(pa); free(pb); free(pb_loaded); free(junk);
done:
    mgpu_optimizer_destroy(oa);
    mgpu_optimizer_destroy(ob);
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
    remove(path);
}

/* a failed load leaves the model and the optimizer as they were */
typedef struct snapshot { float *p, *s; int64_t steps; } snapshot;
static snapshot take_snapshot(const mgpu_model* m, const mgpu_optimizer* o) {
    snapshot s;
    s.p = get_flat(m, 0);
    s.s = fbuf(flat_n(m));
    if (o->state1 && o->state1[0]) tget(o->state1[0], s.s);
    s.steps = mgpu_optimizer_step_count(o);
    return s;
}
static void check_unchanged(const char* what, const mgpu_model* m, const mgpu_optimizer* o, const snapshot* s) {
    float* p = get_flat(m, 0);
    float* st = fbuf(flat_n(m));
    if (o->state1 && o->state1[0]) tget(o->state1[0], st);
    CHECK(same_bits(p, s->p, (size_t)flat_n(m) * sizeof(float)), "%s: a failed load changed the parameters", what);
    CHECK(same_bits(st, s->s, (size_t)flat_n(m) * sizeof(float)) && mgpu_optimizer_step_count(o) == s->steps,
          "%s: a failed load changed the optimizer", what);
    /* put everything back (white box for the step count), so that one failure does not cascade */
    put_flat((mgpu_model*)m, 0, s->p);
    if (o->state1 && o->state1[0]) tput(o->state1[0], s->s);
    ((mgpu_optimizer*)o)->steps = s->steps;
    free(p);
    free(st);
}

static void test_checkpoints(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    char path[512], path2[512], dir[400];
    mgpu_model *m, *m2;
    mgpu_optimizer *o, *o2;
    mgpu_optimizer_desc d;
    float *p, *p2;
    header("7. checkpoints");

    /* round trip, PyTorch names and layouts in the file */
    m = MODEL(mgpu_shape3(1, 8, 8), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_conv2d(1, 2, 3, 1, 1), mgpu_layer_relu(),
              mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(32, 3));
    m2 = MODEL(mgpu_shape3(1, 8, 8), NULL, MGPU_LOSS_CROSS_ENTROPY, 2, mgpu_layer_conv2d(1, 2, 3, 1, 1), mgpu_layer_relu(),
               mgpu_layer_maxpool2d(2, 0), mgpu_layer_flatten(), mgpu_layer_linear(32, 3));
    tpath(path, sizeof path, "cnn.safetensors");
    if (m && m2) {
        char* h;
        p = get_flat(m, 0);
        MUST(mgpu_model_save(m, NULL, path));
        h = st_header(path, NULL);
        CHECK(h && strstr(h, "\"format\":\"pt\""), "the metadata lacks format pt: %s", h ? h : "(none)");
        CHECK(h && !strstr(h, "optimizer"), "a checkpoint saved without an optimizer mentions one");
        free(h);
        check_st_tensor(path, "0.weight", "[2,1,3,3]", p + toff(m, 0), 18);
        check_st_tensor(path, "0.bias", "[2]", p + toff(m, 1), 2);
        check_st_tensor(path, "4.weight", "[3,32]", p + toff(m, 2), 96);
        check_st_tensor(path, "4.bias", "[3]", p + toff(m, 3), 3);
        MUST(mgpu_model_load(m2, NULL, path));
        p2 = get_flat(m2, 0);
        CHECK(same_bits(p, p2, (size_t)flat_n(m) * sizeof(float)), "save/load round trip changed the parameters");
        free(p);
        free(p2);
    }
    mgpu_model_destroy(m);
    mgpu_model_destroy(m2);

    /* with an optimizer: its state in the file; load with or without one; into cpu:2 */
    {
        float xs[2 * 16 * 6];
        int32_t ys[2 * 16];
        mgpu_device_set* set2 = mgpu_device_set_create("cpu:2");
        log_capture cap;
        make_clusters(32, 6, 3, xs, ys, 1.0);
        m = ck_model(3, 0);
        d = odesc(MGPU_ADAMW, 1e-2f);
        o = m ? mgpu_optimizer_create(m, &d) : NULL;
        if (m && o) {
            char* h;
            train_batches(m, o, xs, ys, 16, 0, 2, NULL);
            MUST(mgpu_model_save(m, o, path));
            p = get_flat(m, 0);
            h = st_header(path, NULL);
            CHECK(h && strstr(h, "\"optimizer.0.weight.exp_avg\"") && strstr(h, "\"optimizer.2.bias.exp_avg_sq\"") &&
                  strstr(h, "\"mgpu.optimizer\":\"adamw\"") && strstr(h, "\"mgpu.step\":\"2\""),
                  "the AdamW state or the step is missing from the header: %s", h ? h : "(none)");
            free(h);
            {
                float* s1 = fbuf(flat_n(m));
                tget(o->state1[0], s1);
                check_st_tensor(path, "optimizer.2.weight.exp_avg", "[3,12]", s1 + toff(m, 2), 36);
                tget(o->state2[0], s1);
                check_st_tensor(path, "optimizer.0.bias.exp_avg_sq", "[12]", s1 + toff(m, 1), 12);
                free(s1);
            }
            m2 = ck_model(4, 0);
            if (m2) {
                MUST(mgpu_model_load(m2, NULL, path));   /* the optimizer state is ignored */
                p2 = get_flat(m2, 0);
                CHECK(same_bits(p, p2, (size_t)flat_n(m) * sizeof(float)), "load without an optimizer: parameters differ");
                free(p2);
            }
            mgpu_model_destroy(m2);
            if (set2) {
                m2 = MODEL(mgpu_shape1(6), set2, MGPU_LOSS_CROSS_ENTROPY, 5, mgpu_layer_linear(6, 12), mgpu_layer_relu(),
                           mgpu_layer_linear(12, 3));
                o2 = m2 ? mgpu_optimizer_create(m2, &d) : NULL;
                if (m2 && o2) {
                    MUST(mgpu_model_load(m2, o2, path));
                    p2 = get_flat(m2, 1);
                    CHECK(same_bits(p, p2, (size_t)flat_n(m) * sizeof(float)) && replicas_identical(m2),
                          "load into cpu:2: replica 1 does not hold the checkpoint");
                    CHECK(mgpu_optimizer_step_count(o2) == 2, "load into cpu:2: steps %lld", (long long)mgpu_optimizer_step_count(o2));
                    free(p2);
                }
                mgpu_optimizer_destroy(o2);
                mgpu_model_destroy(m2);
            }
            /* a checkpoint without optimizer state: the optimizer starts fresh, with a warning */
            MUST(mgpu_model_save(m, NULL, path));
            memset(&cap, 0, sizeof cap);
            mgpu_log_set_callback(capture_log, &cap);
            MUST(mgpu_model_load(m, o, path));
            mgpu_log_set_callback(NULL, NULL);
            CHECK(cap.warnings == 1 && strstr(cap.last, "optimizer"), "loading without optimizer state warns once: %d, '%s'",
                  cap.warnings, cap.last);
            CHECK(mgpu_optimizer_step_count(o) == 0, "the optimizer restarts at step 0, not %lld", (long long)mgpu_optimizer_step_count(o));
            {
                float* s1 = fbuf(flat_n(m));
                int64_t i, nz = 0;
                tget(o->state1[0], s1);
                for (i = 0; i < flat_n(m); ++i) nz += s1[i] != 0.0f;
                CHECK(nz == 0, "the optimizer state is zeroed after loading a file without it (%lld nonzero)", (long long)nz);
                free(s1);
            }
            free(p);
        }
        mgpu_optimizer_destroy(o);
        mgpu_model_destroy(m);
        mgpu_device_set_destroy(set2);
    }

    /* resume is exact */
    d = odesc(MGPU_SGD, 0.05f); d.momentum = 0.9f; d.weight_decay = 1e-4f;
    resume_case("resume SGD momentum", d, 0);
    d = odesc(MGPU_ADAMW, 3e-3f); d.weight_decay = 0.01f;
    resume_case("resume AdamW", d, 0);
    d = odesc(MGPU_ADAMW, 1e-2f); d.schedule = MGPU_SCHEDULE_COSINE; d.total_steps = 5;
    resume_case("resume AdamW with a cosine schedule", d, 0);
    d = odesc(MGPU_SGD, 0.1f); d.schedule = MGPU_SCHEDULE_STEP; d.step_size = 2; d.gamma = 0.5f;
    resume_case("resume plain SGD (no momentum) with StepLR", d, 0);
    d = odesc(MGPU_SGD, 0.05f); d.momentum = 0.9f;
    resume_case("resume SGD momentum, model with Dropout", d, 1);

    /* every kind of bad file: a clear error, and nothing changes */
    m = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 9, mgpu_layer_linear(4, 3));
    d = odesc(MGPU_SGD, 0.1f); d.momentum = 0.9f;
    o = m ? mgpu_optimizer_create(m, &d) : NULL;
    if (m && o) {
        float xs[8 * 4] = {0};
        int32_t ys[8] = {0, 1, 2, 0, 1, 2, 0, 1};
        mgpu_tensor *x, *y;
        snapshot snap;
        st_item it[4];
        size_t len;
        uint8_t* good;
        rnd_normal(xs, 32, 1.0);
        x = tfrom(cpu, mgpu_shape2(8, 4), xs);
        y = tfrom_i32(cpu, mgpu_shape1(8), ys);
        MUST(mgpu_model_train_step(m, o, x, y, NULL));   /* nonzero momentum state, step 1 */
        snap = take_snapshot(m, o);
        memset(it, 0, sizeof it);
        it[0].name = "0.weight"; it[0].dtype = "F32"; it[0].ndim = 2; it[0].shape[0] = 3; it[0].shape[1] = 4; it[0].bytes = 48;
        it[1].name = "0.bias"; it[1].dtype = "F32"; it[1].ndim = 1; it[1].shape[0] = 3; it[1].bytes = 12;
        tpath(path, sizeof path, "bad.safetensors");

        CHECK(write_st(path, it, 1, NULL), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "missing tensor", "mgpu_model_load", "no tensor '0.bias'", NULL);
        check_unchanged("missing tensor", m, o, &snap);

        it[2] = it[1];
        it[2].shape[0] = 4; it[2].bytes = 16;
        {
            st_item w[2];
            w[0] = it[0]; w[1] = it[2];
            CHECK(write_st(path, w, 2, NULL), "write %s", path);
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_SHAPE_MISMATCH, "bias of shape [4]", "0.bias", "[4]", "[3]");
            check_unchanged("wrong bias shape", m, o, &snap);
            w[0] = it[0]; w[0].shape[0] = 4; w[0].shape[1] = 3; w[1] = it[1];   /* same size, transposed */
            CHECK(write_st(path, w, 2, NULL), "write %s", path);
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_SHAPE_MISMATCH, "weight [4,3] for [3,4]", "0.weight", "[4,3]",
                        "[3,4]");
            check_unchanged("transposed weight", m, o, &snap);
            w[0] = it[0]; w[0].dtype = "F8_E4M3"; w[0].bytes = 12; w[1] = it[1];   /* F64, F16, BF16 convert; this does not */
            CHECK(write_st(path, w, 2, NULL), "write %s", path);
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "an F8_E4M3 weight", "0.weight", "F8_E4M3", "F32");
            check_unchanged("wrong dtype", m, o, &snap);
            w[0] = it[0]; w[1] = it[1]; w[1].dtype = "I32";
            CHECK(write_st(path, w, 2, NULL), "write %s", path);
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "an I32 bias", "0.bias", "I32", NULL);
            check_unchanged("wrong dtype (I32)", m, o, &snap);
        }
        it[2].name = "1.weight"; it[2].dtype = "F32"; it[2].ndim = 2; it[2].shape[0] = 2; it[2].shape[1] = 3; it[2].bytes = 24;
        CHECK(write_st(path, it, 3, NULL), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "an unexpected extra tensor", "unexpected tensor '1.weight'",
                    NULL, NULL);
        check_unchanged("extra tensor", m, o, &snap);

        it[2] = it[0]; it[2].name = "optimizer.0.weight.momentum_buffer";
        it[3] = it[1]; it[3].name = "optimizer.0.bias.momentum_buffer";
        CHECK(write_st(path, it, 3, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"4\""), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "partial optimizer state", "1 of the 2", NULL, NULL);
        check_unchanged("partial optimizer state", m, o, &snap);
        CHECK(write_st(path, it, 4, "\"mgpu.optimizer\":\"adamw\",\"mgpu.step\":\"4\""), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "momentum buffers labelled adamw", "adamw", "sgd", NULL);
        check_unchanged("optimizer kind in the metadata", m, o, &snap);
        CHECK(write_st(path, it, 4, "\"mgpu.optimizer\":\"sgd\""), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "optimizer state without mgpu.step", "mgpu.step", NULL, NULL);
        check_unchanged("no step", m, o, &snap);
        CHECK(write_st(path, it, 4, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"-3\""), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "mgpu.step -3", "mgpu.step", NULL, NULL);
        check_unchanged("negative step", m, o, &snap);
        CHECK(write_st(path, it, 4, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"12x\""), "write %s", path);
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "mgpu.step 12x", "mgpu.step", NULL, NULL);
        check_unchanged("bad step", m, o, &snap);
        /* a step count whose next step would overflow, or past what a double counts exactly */
        {
            static const char* const huge[] = {"9223372036854775807", "99999999999999999999", "9007199254740993", "+5", " 5"};
            char meta[128];
            int k;
            for (k = 0; k < (int)(sizeof huge / sizeof huge[0]); ++k) {
                snprintf(meta, sizeof meta, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"%s\"", huge[k]);
                CHECK(write_st(path, it, 4, meta), "write %s", path);
                expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, huge[k], "mgpu.step", NULL, NULL);
                check_unchanged("step out of range", m, o, &snap);
            }
            /* 2^53 itself loads, and then the optimizer refuses to count further */
            {
                mgpu_model* m2 = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 9, mgpu_layer_linear(4, 3));
                mgpu_optimizer* o2 = m2 ? mgpu_optimizer_create(m2, &d) : NULL;
                CHECK(write_st(path, it, 4, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"9007199254740992\""), "write %s", path);
                CHECK(o2 && mgpu_model_load(m2, o2, path) == MGPU_OK && mgpu_optimizer_step_count(o2) == ((int64_t)1 << 53),
                      "a step count of 2^53 loads: %s", mgpu_last_error());
                if (o2)
                    expect_fail(mgpu_optimizer_step(o2), MGPU_ERROR_INVALID_ARGUMENT, "a step past 2^53", "mgpu_optimizer_step", "2^53",
                                NULL);
                CHECK(mgpu_optimizer_step_count(o2) == ((int64_t)1 << 53), "the refused step is not counted");
                mgpu_optimizer_destroy(o2);
                mgpu_model_destroy(m2);
            }
        }
        {
            /* a file written by the same model with an AdamW optimizer, loaded into an SGD one (and back) */
            mgpu_optimizer_desc da = odesc(MGPU_ADAMW, 1e-3f);
            mgpu_model* ma = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 9, mgpu_layer_linear(4, 3));
            mgpu_optimizer* oa = ma ? mgpu_optimizer_create(ma, &da) : NULL;
            if (ma && oa) {
                MUST(mgpu_model_train_step(ma, oa, x, y, NULL));
                log_capture cap;
                MUST(mgpu_model_save(ma, oa, path));
                memset(&cap, 0, sizeof cap);
                mgpu_log_set_callback(capture_log, &cap);
                mgpu_clear_error();
                expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE,
                            "an AdamW checkpoint loaded with an SGD optimizer (kind mismatch)", "adamw", "sgd", NULL);
                mgpu_log_set_callback(NULL, NULL);
                CHECK(cap.warnings == 0, "AdamW checkpoint into SGD: a warning instead of an error: '%s'", cap.last);
                check_unchanged("AdamW checkpoint into SGD", m, o, &snap);
                tpath(path2, sizeof path2, "sgd.safetensors");
                MUST(mgpu_model_save(m, o, path2));
                {
                    snapshot sa = take_snapshot(ma, oa);
                    memset(&cap, 0, sizeof cap);
                    mgpu_log_set_callback(capture_log, &cap);
                    mgpu_clear_error();
                    expect_fail(mgpu_model_load(ma, oa, path2), MGPU_ERROR_BAD_FILE,
                                "an SGD checkpoint loaded with an AdamW optimizer (kind mismatch)", "sgd", "adamw", NULL);
                    mgpu_log_set_callback(NULL, NULL);
                    CHECK(cap.warnings == 0, "SGD checkpoint into AdamW: a warning instead of an error: '%s'", cap.last);
                    check_unchanged("SGD checkpoint into AdamW", ma, oa, &sa);
                    free(sa.p);
                    free(sa.s);
                }
                remove(path2);
            }
            mgpu_optimizer_destroy(oa);
            mgpu_model_destroy(ma);
        }
        /* damaged files */
        tpath(path2, sizeof path2, "good.safetensors");
        MUST(mgpu_model_save(m, o, path2));
        good = read_file(path2, &len);
        if (good) {
            CHECK(write_file(path, good, len - 5), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "a truncated file", "mgpu_model_load", "truncated", NULL);
            check_unchanged("truncated file", m, o, &snap);
            CHECK(write_file(path, good, 30), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "a file cut inside its header", "header", NULL, NULL);
            check_unchanged("file cut in the header", m, o, &snap);
            good[8] = '[';
            CHECK(write_file(path, good, len), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "a header that is not a JSON object", "JSON", NULL, NULL);
            check_unchanged("not JSON", m, o, &snap);
            free(good);
        }
        {
            static const char garbage[] = "This is not a checkpoint at all, just some text that goes on for a while.\n";
            CHECK(write_file(path, garbage, sizeof garbage - 1), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "a text file", "mgpu_model_load", "safetensors", NULL);
            check_unchanged("garbage", m, o, &snap);
            CHECK(write_file(path, garbage, 0), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "an empty file", "too short", NULL, NULL);
            check_unchanged("empty file", m, o, &snap);
        }
        {
            /* a tensor whose data_offsets span the wrong number of bytes */
            static const char hdr[] = "{\"0.weight\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,48]},"
                                      "\"0.bias\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[48,56]}}";
            uint8_t buf[8 + sizeof hdr + 64];
            size_t hl = sizeof hdr - 1, k;
            memset(buf, 0, sizeof buf);
            for (k = 0; k < 8; ++k) buf[k] = (uint8_t)((uint64_t)hl >> (8 * k));
            memcpy(buf + 8, hdr, hl);
            CHECK(write_file(path, buf, 8 + hl + 56), "write");
            expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_BAD_FILE, "data_offsets of the wrong size", "0.bias", "invalid tensor info", NULL);
            check_unchanged("wrong data_offsets", m, o, &snap);
        }
        tpath(path, sizeof path, "does-not-exist.safetensors");
        expect_fail(mgpu_model_load(m, o, path), MGPU_ERROR_IO, "a file that does not exist", "does-not-exist", "cannot open", NULL);
        check_unchanged("missing file", m, o, &snap);
        expect_fail(mgpu_model_load(m, o, g_tmpdir), MGPU_ERROR_IO, "a directory as the path", "mgpu_model_load", NULL, NULL);
        check_unchanged("directory", m, o, &snap);
        expect_fail(mgpu_model_load(m, o, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL path", NULL, NULL, NULL);
        expect_fail(mgpu_model_save(NULL, NULL, path), MGPU_ERROR_INVALID_ARGUMENT, "save a NULL model", NULL, NULL, NULL);
        expect_fail(mgpu_model_save(m, NULL, NULL), MGPU_ERROR_INVALID_ARGUMENT, "save to a NULL path", NULL, NULL, NULL);

        /* atomic save */
        snprintf(path, sizeof path, "%s/no-such-dir/ck.safetensors", g_tmpdir);
        expect_fail(mgpu_model_save(m, o, path), MGPU_ERROR_IO, "save into a missing directory", "mgpu_model_save", "no-such-dir",
                    NULL);
        CHECK(!file_exists(path), "a failed save left %s", path);
        tpath(dir, sizeof dir, "adir");
        CHECK(test_mkdir(dir, 0700) == 0, "mkdir %s", dir);
        expect_fail(mgpu_model_save(m, o, dir), MGPU_ERROR_IO, "save over a directory", "mgpu_model_save", NULL, NULL);
        {
            struct stat st;
            CHECK(stat(dir, &st) == 0 && S_ISDIR(st.st_mode), "the directory survived a failed save");
        }
        CHECK(count_files_with(g_tmpdir, ".tmp") == 0, "a failed save left a temporary file in %s", g_tmpdir);
        snprintf(path, sizeof path, "%s/ck.safetensors", g_tmpdir);
        MUST(mgpu_model_save(m, o, path));
        snprintf(path2, sizeof path2, "%s/ck.safetensors/inside", g_tmpdir);
        expect_fail(mgpu_model_save(m, o, path2), MGPU_ERROR_IO, "save below a file", "mgpu_model_save", NULL, NULL);
        MUST(mgpu_model_load(m, o, path));   /* the old checkpoint is intact */
        check_unchanged("after loading the intact old checkpoint", m, o, &snap);
#ifdef _WIN32
        SKIP("save into a read-only directory: Windows has no directory permission bits (a folder's read-only attribute "
             "does not stop new files in it)");
#else
        if (geteuid() != 0) {
            snprintf(path, sizeof path, "%s/ck.safetensors", dir);
            MUST(mgpu_model_save(m, o, path));
            chmod(dir, 0500);
            expect_fail(mgpu_model_save(m, NULL, path), MGPU_ERROR_IO, "save into a read-only directory", "mgpu_model_save", NULL,
                        NULL);
            chmod(dir, 0700);
            MUST(mgpu_model_load(m, o, path));
            check_unchanged("old checkpoint after a failed save into a read-only directory", m, o, &snap);
            CHECK(count_files_with(dir, ".tmp") == 0, "a failed save left a temporary file in %s", dir);
        } else {
            SKIP("save into a read-only directory: running as root (permissions do not apply)");
        }
#endif
        /* a later save replaces an earlier one */
        {
            mgpu_model* other = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 99, mgpu_layer_linear(4, 3));
            snprintf(path, sizeof path, "%s/ck.safetensors", g_tmpdir);
            if (other) {
                float *po, *pm;
                MUST(mgpu_model_save(other, NULL, path));
                MUST(mgpu_model_load(m, NULL, path));
                po = get_flat(other, 0);
                pm = get_flat(m, 0);
                CHECK(same_bits(po, pm, (size_t)flat_n(m) * sizeof(float)), "a second save did not replace the first");
                free(po);
                free(pm);
            }
            mgpu_model_destroy(other);
            CHECK(count_files_with(g_tmpdir, ".tmp") == 0, "saves left temporary files in %s", g_tmpdir);
        }
        free(snap.p);
        free(snap.s);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
    }
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

/* ============================================================================================ */
/* 8. IDX data sets and the loader                                                              */
/* ============================================================================================ */
static int write_idx(const char* path, int type, int ndim, const int* dims, const uint8_t* data, size_t bytes) {
    uint8_t hdr[4 + 16];
    FILE* f = fopen(path, "wb");
    int i, ok;
    if (!f) return 0;
    hdr[0] = 0; hdr[1] = 0; hdr[2] = (uint8_t)type; hdr[3] = (uint8_t)ndim;
    for (i = 0; i < ndim; ++i) {
        hdr[4 + 4 * i] = (uint8_t)(dims[i] >> 24);
        hdr[5 + 4 * i] = (uint8_t)(dims[i] >> 16);
        hdr[6 + 4 * i] = (uint8_t)(dims[i] >> 8);
        hdr[7 + 4 * i] = (uint8_t)dims[i];
    }
    ok = fwrite(hdr, 1, 4 + 4 * (size_t)ndim, f) == 4 + 4 * (size_t)ndim && fwrite(data, 1, bytes, f) == bytes;
    return (fclose(f) == 0) && ok;
}
#ifndef _WIN32
static int gzip_file(const char* src, const char* dst) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "gzip -c -n '%s' > '%s' 2>/dev/null", src, dst);
    return system(cmd) == 0;
}
#else
/* Windows has no gzip command: the file as a gzip member of stored (uncompressed) DEFLATE blocks,
   with its CRC-32 and length, which is what the reader checks. */
static int gzip_file(const char* src, const char* dst) {
    static const uint8_t head[10] = {0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255};
    size_t len, off = 0;
    uint8_t* data = read_file(src, &len);
    uint32_t crc = 0xFFFFFFFFu;
    uint8_t tail[8];
    FILE* f = data ? fopen(dst, "wb") : NULL;
    int ok = f != NULL, k;
    size_t i;
    for (i = 0; i < len; ++i) {
        crc ^= data[i];
        for (k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    crc ^= 0xFFFFFFFFu;
    if (ok) ok = fwrite(head, 1, 10, f) == 10;
    do {   /* blocks of at most 65535 bytes; the last has BFINAL set (an empty file: one empty block) */
        size_t n = len - off < 65535 ? len - off : 65535;
        uint8_t b[5];
        b[0] = off + n == len ? 1 : 0;
        b[1] = (uint8_t)n; b[2] = (uint8_t)(n >> 8);
        b[3] = (uint8_t)~n; b[4] = (uint8_t)(~n >> 8);
        if (ok) ok = fwrite(b, 1, 5, f) == 5 && fwrite(data + off, 1, n, f) == n;
        off += n;
    } while (off < len);
    for (k = 0; k < 4; ++k) { tail[k] = (uint8_t)(crc >> (8 * k)); tail[4 + k] = (uint8_t)((uint32_t)len >> (8 * k)); }
    if (ok) ok = fwrite(tail, 1, 8, f) == 8;
    if (f && fclose(f) != 0) ok = 0;
    free(data);
    return ok;
}
#endif

static void check_dataset(const char* what, const mgpu_dataset* ds, int n, int rows, int cols, const uint8_t* img,
                          const uint8_t* lab) {
    CHECK(ds != NULL, "%s: %s", what, mgpu_last_error());
    if (!ds) return;
    CHECK(ds->count == n && ds->rows == rows && ds->cols == cols, "%s: %lld x %d x %d, want %d x %d x %d", what,
          (long long)ds->count, ds->rows, ds->cols, n, rows, cols);
    CHECK(ds->count == n && same_bits(ds->images, img, (size_t)n * rows * cols) && same_bits(ds->labels, lab, (size_t)n),
          "%s: the contents differ from what was written", what);
}

static void test_data(void) {
    enum { N = 23, R = 5, C = 4 };
    uint8_t img[N * R * C], lab[N];
    char pi[512], pl[512], pig[512], plg[512], bad[512];
    int dims3[3] = {N, R, C}, dims1[1] = {N}, i, have_gzip;
    mgpu_dataset* ds;
    size_t len;
    uint8_t* raw;
    header("8. IDX data sets and the loader");
    for (i = 0; i < N * R * C; ++i) img[i] = (uint8_t)rng_int(256);
    for (i = 0; i < N; ++i) {
        img[i * R * C] = (uint8_t)i;   /* the first pixel names the sample */
        lab[i] = (uint8_t)((i * 7) % 10);
    }
    tpath(pi, sizeof pi, "img-idx3-ubyte");
    tpath(pl, sizeof pl, "lab-idx1-ubyte");
    tpath(pig, sizeof pig, "img-idx3-ubyte.gz");
    tpath(plg, sizeof plg, "lab-idx1-ubyte.gz");
    tpath(bad, sizeof bad, "bad-idx");
    CHECK(write_idx(pi, 0x08, 3, dims3, img, sizeof img) && write_idx(pl, 0x08, 1, dims1, lab, sizeof lab), "write IDX files");
    ds = mgpu_dataset_load_idx(pi, pl);
    check_dataset("plain IDX", ds, N, R, C, img, lab);
    mgpu_dataset_destroy(ds);
    have_gzip = gzip_file(pi, pig) && gzip_file(pl, plg);
    if (have_gzip) {
        ds = mgpu_dataset_load_idx(pig, plg);
        check_dataset("gzipped IDX", ds, N, R, C, img, lab);
        mgpu_dataset_destroy(ds);
        ds = mgpu_dataset_load_idx(pig, pl);
        check_dataset("gzipped images, plain labels", ds, N, R, C, img, lab);
        mgpu_dataset_destroy(ds);
        raw = read_file(pig, &len);
        if (raw && len > 40) {
            raw[len / 2] ^= 0x5A;
            CHECK(write_file(bad, raw, len), "write");
            expect_null(mgpu_dataset_load_idx(bad, plg), MGPU_ERROR_BAD_FILE, "a corrupted gzip file", "mgpu_dataset_load_idx",
                        "gzip", "bad-idx");
            raw[len / 2] ^= 0x5A;
            CHECK(write_file(bad, raw, len / 2), "write");
            expect_null(mgpu_dataset_load_idx(bad, plg), MGPU_ERROR_BAD_FILE, "a truncated gzip file", "gzip", "truncated", NULL);
        }
        free(raw);
    } else {
        SKIP("gzipped IDX: no gzip command");
    }
    /* bad files */
    {
        int d22[1] = {N - 1}, dbig[3] = {N + 1, R, C};
        uint8_t more[N * R * C + 8];
        memcpy(more, img, sizeof img);
        memset(more + sizeof img, 7, 8);
        CHECK(write_idx(bad, 0x08, 1, d22, lab, N - 1), "write");
        expect_null(mgpu_dataset_load_idx(pi, bad), MGPU_ERROR_BAD_FILE, "23 images, 22 labels", "23 images", "22 labels", NULL);
        CHECK(write_idx(bad, 0x08, 3, dbig, img, sizeof img), "write");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_BAD_FILE, "an image file shorter than its header says", "truncated",
                    NULL, NULL);
        CHECK(write_idx(bad, 0x08, 3, dims3, more, sizeof more), "write");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_BAD_FILE, "trailing bytes after the images", "trailing", NULL, NULL);
        CHECK(write_idx(bad, 0x0C, 3, dims3, img, sizeof img), "write");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_UNSUPPORTED, "int32 IDX elements", "0x0C", NULL, NULL);
        expect_null(mgpu_dataset_load_idx(pl, pl), MGPU_ERROR_BAD_FILE, "labels given as images", "expected 3", NULL, NULL);
        expect_null(mgpu_dataset_load_idx(pi, pi), MGPU_ERROR_BAD_FILE, "images given as labels", "expected 1", NULL, NULL);
        more[0] = 0x12;
        CHECK(write_file(bad, more, 64), "write");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_BAD_FILE, "no IDX magic", "not an IDX", NULL, NULL);
        CHECK(write_file(bad, more, 2), "write");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_BAD_FILE, "a 2-byte file", "too short", NULL, NULL);
        tpath(bad, sizeof bad, "missing-idx");
        expect_null(mgpu_dataset_load_idx(bad, pl), MGPU_ERROR_IO, "a missing file", "missing-idx", NULL, NULL);
        expect_null(mgpu_dataset_load_idx(pi, bad), MGPU_ERROR_IO, "a missing label file", "missing-idx", NULL, NULL);
    }

    /* the loader */
    ds = mgpu_dataset_load_idx(pi, pl);
    if (ds) {
        mgpu_loader_desc ld;
        mgpu_loader* l;
        const mgpu_tensor *x, *y;
        float xb[4 * R * C];
        int32_t yb[4];
        int order[3][N], seen[N], count, b, k, bad_norm, bad_label;
        memset(&ld, 0, sizeof ld);
        ld.batch = 4;
        ld.mean = 0.5f;
        ld.std = 0.25f;
        l = mgpu_loader_create(ds, &ld);
        CHECK(l != NULL, "mgpu_loader_create: %s", mgpu_last_error());
        if (l) {
            CHECK(mgpu_loader_batches(l) == 6, "23 samples in batches of 4: %lld batches, want 6", (long long)mgpu_loader_batches(l));
            count = 0; bad_norm = 0; bad_label = 0;
            for (b = 0; mgpu_loader_next(l, &x, &y); ++b) {
                int rows = (int)mgpu_tensor_dim(x, 0);
                mgpu_shape xs = mgpu_tensor_shape(x);
                CHECK(xs.ndim == 4 && xs.dim[1] == 1 && xs.dim[2] == R && xs.dim[3] == C && mgpu_tensor_dtype(x) == MGPU_F32 &&
                      mgpu_tensor_dtype(y) == MGPU_I32 && mgpu_tensor_dim(y, 0) == rows,
                      "batch %d: x is not f32 [B,1,%d,%d] with i32 [B] labels", b, R, C);
                CHECK(rows == (b < 5 ? 4 : 3), "batch %d has %d rows", b, rows);
                if (rows > 4) break;
                tget(x, xb);
                tget(y, yb);
                for (k = 0; k < rows; ++k) {
                    int s = count + k, p;
                    for (p = 0; p < R * C; ++p)
                        bad_norm += fabs(xb[k * R * C + p] - ((img[s * R * C + p] / 255.0) - 0.5) / 0.25) > 1e-5;
                    bad_label += yb[k] != lab[s];
                }
                count += rows;
            }
            CHECK(b == 6 && count == N, "without shuffling: %d batches, %d samples", b, count);
            CHECK(bad_norm == 0, "%d pixels are not (pixel/255 - mean)/std", bad_norm);
            CHECK(bad_label == 0, "%d labels out of order", bad_label);
            CHECK(!mgpu_loader_next(l, &x, &y), "next after the end of the epoch returns 0");
            mgpu_loader_start(l, 1);
            CHECK(mgpu_loader_next(l, &x, &y) && mgpu_tensor_dim(x, 0) == 4, "a new epoch starts over");
            mgpu_loader_destroy(l);
        }
        /* drop_last */
        ld.drop_last = 1;
        l = mgpu_loader_create(ds, &ld);
        if (l) {
            CHECK(mgpu_loader_batches(l) == 5, "drop_last: %lld batches, want 5", (long long)mgpu_loader_batches(l));
            count = 0;
            for (b = 0; mgpu_loader_next(l, &x, &y); ++b) count += (int)mgpu_tensor_dim(x, 0);
            CHECK(b == 5 && count == 20, "drop_last: %d batches, %d samples", b, count);
            mgpu_loader_destroy(l);
        }
        /* shuffling: a permutation per epoch, a function of (seed, epoch) */
        ld.drop_last = 0;
        ld.shuffle = 1;
        ld.seed = 5;
        ld.mean = 0.0f;
        ld.std = 0.0f;   /* defaults: 0 and 1, x = pixel / 255 */
        l = mgpu_loader_create(ds, &ld);
        if (l) {
            int e, ok_perm = 1, ok_label = 1;
            for (e = 0; e < 3; ++e) {
                mgpu_loader_start(l, e == 2 ? 0 : e);
                memset(seen, 0, sizeof seen);
                count = 0;
                while (mgpu_loader_next(l, &x, &y)) {
                    int rows = (int)mgpu_tensor_dim(x, 0);
                    tget(x, xb);
                    tget(y, yb);
                    for (k = 0; k < rows; ++k) {
                        int s = (int)lrintf(xb[k * R * C] * 255.0f);
                        if (s < 0 || s >= N) { ok_perm = 0; continue; }
                        seen[s]++;
                        order[e][count + k] = s;
                        ok_label &= yb[k] == lab[s];
                    }
                    count += rows;
                }
                for (k = 0; k < N; ++k) ok_perm &= seen[k] == 1;
                CHECK(count == N, "epoch %d: %d samples", e, count);
            }
            CHECK(ok_perm, "every sample appears exactly once per epoch");
            CHECK(ok_label, "shuffled labels travel with their images");
            CHECK(memcmp(order[0], order[1], sizeof order[0]) != 0, "epochs 0 and 1 have the same order");
            CHECK(memcmp(order[0], order[2], sizeof order[0]) == 0, "epoch 0 twice: different orders");
            {
                int ident = 1;
                for (k = 0; k < N; ++k) ident &= order[0][k] == k;
                CHECK(!ident, "shuffle left the order unchanged");
            }
            mgpu_loader_destroy(l);
            /* a new loader with the same seed repeats epoch 1; another seed does not */
            l = mgpu_loader_create(ds, &ld);
            if (l) {
                int same = 1;
                mgpu_loader_start(l, 1);
                count = 0;
                while (mgpu_loader_next(l, &x, &y)) {
                    int rows = (int)mgpu_tensor_dim(x, 0);
                    tget(x, xb);
                    for (k = 0; k < rows; ++k) same &= (int)lrintf(xb[k * R * C] * 255.0f) == order[1][count + k];
                    count += rows;
                }
                CHECK(same && count == N, "same seed and epoch, another loader: a different order");
                mgpu_loader_destroy(l);
            }
            ld.seed = 6;
            l = mgpu_loader_create(ds, &ld);
            if (l) {
                int same = 1;
                count = 0;
                while (mgpu_loader_next(l, &x, &y)) {
                    int rows = (int)mgpu_tensor_dim(x, 0);
                    tget(x, xb);
                    for (k = 0; k < rows; ++k) same &= (int)lrintf(xb[k * R * C] * 255.0f) == order[0][count + k];
                    count += rows;
                }
                CHECK(!same, "seeds 5 and 6 give the same order");
                mgpu_loader_destroy(l);
            }
        }
        /* defaults: batch 64 (one batch of 23) */
        l = mgpu_loader_create(ds, NULL);
        if (l) {
            CHECK(mgpu_loader_batches(l) == 1 && mgpu_loader_next(l, &x, &y) && mgpu_tensor_dim(x, 0) == N,
                  "default loader: one batch of %d", N);
            mgpu_loader_destroy(l);
        }
        ld.batch = -2;
        expect_null(mgpu_loader_create(ds, &ld), MGPU_ERROR_INVALID_ARGUMENT, "batch -2", "batch", NULL, NULL);
        expect_null(mgpu_loader_create(NULL, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL data set", NULL, NULL, NULL);
        /* train a model straight from loader batches */
        {
            mgpu_model* m = MODEL(mgpu_shape3(1, R, C), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_flatten(), mgpu_layer_linear(R * C, 10));
            mgpu_optimizer* o = m ? make_opt(m, MGPU_SGD, 0.1f, 0.0f, 0.0f) : NULL;
            ld.batch = 8;
            l = mgpu_loader_create(ds, &ld);
            if (m && o && l) {
                float loss = -1.0f;
                int steps = 0;
                while (mgpu_loader_next(l, &x, &y)) {
                    MUST(mgpu_model_train_step(m, o, x, y, &loss));
                    steps++;
                }
                CHECK(steps == 3 && loss > 0.0f, "training from loader batches: %d steps, loss %g", steps, (double)loss);
            }
            mgpu_loader_destroy(l);
            mgpu_optimizer_destroy(o);
            mgpu_model_destroy(m);
        }
        mgpu_dataset_destroy(ds);
    }

    /* Fashion-MNIST, when installed */
    {
        const char* dir = "/usr/share/datasets/fashion-mnist";
        char a[512], bpath[512];
        int which;
        snprintf(a, sizeof a, "%s/train-images-idx3-ubyte.gz", dir);
        if (!file_exists(a)) {
            SKIP("Fashion-MNIST: %s not found", dir);
            return;
        }
        for (which = g_quick ? 1 : 0; which < 2; ++which) {
            const char* set = which ? "t10k" : "train";
            const int want = which ? 10000 : 60000;
            snprintf(a, sizeof a, "%s/%s-images-idx3-ubyte.gz", dir, set);
            snprintf(bpath, sizeof bpath, "%s/%s-labels-idx1-ubyte.gz", dir, set);
            ds = mgpu_dataset_load_idx(a, bpath);
            CHECK(ds != NULL, "Fashion-MNIST %s: %s", set, mgpu_last_error());
            if (ds) {
                int64_t k, hist[10] = {0}, big = 0, balanced = 1;
                CHECK(ds->count == want && ds->rows == 28 && ds->cols == 28, "Fashion-MNIST %s: %lld images of %dx%d", set,
                      (long long)ds->count, ds->rows, ds->cols);
                for (k = 0; k < ds->count; ++k) {
                    if (ds->labels[k] < 10) hist[ds->labels[k]]++;
                    else big++;
                }
                for (k = 0; k < 10; ++k) balanced &= hist[k] == want / 10;
                CHECK(big == 0, "Fashion-MNIST %s: %lld labels >= 10", set, (long long)big);
                CHECK(balanced, "Fashion-MNIST %s: classes not %d each", set, want / 10);
                mgpu_dataset_destroy(ds);
            }
        }
    }
}

/* ============================================================================================ */
/* 9. CUDA twins: the same work on the GPU matches the CPU                                      */
/* ============================================================================================ */
#ifdef MGPU_CUDA
static void twin_layer(const layer_spec* s) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_shape xs = batch_shape(s->batch, s->sample), ys = spec_out_shape(s);
    mgpu_model* mc = MODEL(s->sample, NULL, MGPU_LOSS_CROSS_ENTROPY, 11, addin_layer(xs, NULL), spec_layer(s));
    mgpu_model* mg = MODEL(s->sample, g_gpu_set, MGPU_LOSS_CROSS_ENTROPY, 11, addin_layer(xs, NULL), spec_layer(s));
    float *fc, *fg, *yc, *yg, *R, *gc, *gg;
    mgpu_tensor *xc, *xg, *rc, *rg;
    const mgpu_tensor *oc, *og;
    int64_t nf, ny;
    double e;
    if (!mc || !mg) { mgpu_model_destroy(mc); mgpu_model_destroy(mg); return; }
    nf = flat_n(mc);
    fc = get_flat(mc, 0);
    fg = get_flat(mg, 0);
    CHECK(same_bits(fc, fg, (size_t)nf * sizeof(float)), "%s: initial parameters differ between CPU and GPU", s->label);
    if (s->kind == LK_POOL) rnd_distinct(fc + toff(mc, 0), mgpu_shape_numel(xs));
    else rnd_kinkfree(fc + toff(mc, 0), mgpu_shape_numel(xs));
    put_flat(mc, 0, fc);
    put_flat(mg, 0, fc);
    xc = tmake(cpu, MGPU_F32, xs);
    xg = tmake(g_gpu, MGPU_F32, xs);
    MUST(mgpu_tensor_zero(xc));
    MUST(mgpu_tensor_zero(xg));
    oc = mgpu_model_forward(mc, 0, xc, 1);
    og = mgpu_model_forward(mg, 0, xg, 1);
    CHECK(oc && og, "%s: forward: %s", s->label, mgpu_last_error());
    if (oc && og) {
        ny = mgpu_shape_numel(ys);
        yc = fbuf(ny); yg = fbuf(ny); R = fbuf(ny);
        tget(oc, yc);
        tget(og, yg);
        e = rel_error_ff(yg, yc, ny);
        CHECK(e <= 1e-5, "%s: GPU forward differs from the CPU: %.3g", s->label, e);
        printf("  %-8s %-44s forward  rel err %.3g\n", mgpu_device_label(g_gpu), s->label, e);
        rnd_normal(R, ny, 1.0);
        rc = tfrom(cpu, ys, R);
        rg = tfrom(g_gpu, ys, R);
        MUST(mgpu_model_zero_grad(mc));
        MUST(mgpu_model_zero_grad(mg));
        MUST(mgpu_model_backward(mc, 0, rc));
        MUST(mgpu_model_backward(mg, 0, rg));
        gc = get_grads(mc, 0);
        gg = get_grads(mg, 0);
        e = rel_error_ff(gg, gc, nf);
        CHECK(e <= 1e-5, "%s: GPU backward differs from the CPU: %.3g", s->label, e);
        printf("  %-8s %-44s backward rel err %.3g\n", mgpu_device_label(g_gpu), s->label, e);
        free(yc); free(yg); free(R); free(gc); free(gg);
        mgpu_tensor_destroy(rc);
        mgpu_tensor_destroy(rg);
    }
    free(fc); free(fg);
    mgpu_tensor_destroy(xc);
    mgpu_tensor_destroy(xg);
    mgpu_model_destroy(mc);
    mgpu_model_destroy(mg);
}

/* the same CNN trained on two device sets from the same seed */
static void twin_train(const mgpu_device_set* a, const mgpu_device_set* b, const char* what, double tol_loss, double tol_param) {
    mgpu_device* cpu = mgpu_device_cpu();
    const int S = 5, B = 32;
    float* xs = fbuf(S * B * 64);
    int32_t* ys = (int32_t*)xmalloc(S * B * sizeof(int32_t));
    mgpu_model *ma = cnn_model(a, 3, 0.0f), *mb = cnn_model(b, 3, 0.0f);
    mgpu_optimizer *oa = ma ? make_opt(ma, MGPU_SGD, 0.05f, 0.9f, 0.0f) : NULL;
    mgpu_optimizer *ob = mb ? make_opt(mb, MGPU_SGD, 0.05f, 0.9f, 0.0f) : NULL;
    int s, i, identical = 1;
    double worst = 0.0, e;
    rnd_normal(xs, S * B * 64, 1.0);
    for (i = 0; i < S * B; ++i) ys[i] = rng_int(4);
    if (ma && mb && oa && ob) {
        float *pa, *pb;
        for (s = 0; s < S; ++s) {
            mgpu_tensor* x = tfrom(cpu, mgpu_shape4(B, 1, 8, 8), xs + (size_t)s * B * 64);
            mgpu_tensor* y = tfrom_i32(cpu, mgpu_shape1(B), ys + (size_t)s * B);
            float la = -1.0f, lb = -2.0f;
            MUST(mgpu_model_train_step(ma, oa, x, y, &la));
            MUST(mgpu_model_train_step(mb, ob, x, y, &lb));
            worst = fmax(worst, rel_diff(lb, la));
            identical &= replicas_identical(mb);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
        }
        pa = get_flat(ma, 0);
        pb = get_flat(mb, 0);
        e = rel_error_ff(pb, pa, flat_n(ma));
        CHECK(worst <= tol_loss, "%s: losses differ by %.3g (limit %.0e)", what, worst, tol_loss);
        CHECK(e <= tol_param, "%s: parameters after %d steps differ by %.3g (limit %.0e)", what, S, e, tol_param);
        CHECK(identical, "%s: replicas not bit-identical after every step", what);
        printf("  %-52s loss rel diff %.3g, param rel err %.3g\n", what, worst, e);
        free(pa);
        free(pb);
    }
    mgpu_optimizer_destroy(oa);
    mgpu_optimizer_destroy(ob);
    mgpu_model_destroy(ma);
    mgpu_model_destroy(mb);
    free(xs);
    free(ys);
}
#endif

/* A training step's activation gradients take turns in two buffers, and a ReLU after a Linear
   writes over the Linear's output: the memory a first step adds (activations, gradients, the
   loss's) is the four Linear outputs plus two layers' gradients, where a buffer per output would
   add four more here, and a gradient buffer per layer six more. */
static void activation_memory(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 512, W = 256;
    const size_t act = (size_t)B * W * sizeof(float), acts = 4 * act + (size_t)B * 10 * sizeof(float);
    mgpu_model* m = MODEL(mgpu_shape1(W), devs, MGPU_LOSS_MSE, 7, mgpu_layer_linear(W, W), mgpu_layer_relu(),
                          mgpu_layer_linear(W, W), mgpu_layer_relu(), mgpu_layer_linear(W, W), mgpu_layer_relu(),
                          mgpu_layer_linear(W, W), mgpu_layer_relu(), mgpu_layer_linear(W, 10));
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, NULL) : NULL;
    mgpu_tensor *x = tmake(dev, MGPU_F32, mgpu_shape2(B, W)), *y = tmake(dev, MGPU_F32, mgpu_shape2(B, 10));
    mgpu_memory_stats s0, s1;
    CHECK(m && opt, "activation memory: the model: %s", mgpu_last_error());
    if (m && opt && x && y) {
        size_t grads = 1;
        char text[4096];
        MUST(mgpu_rand_uniform(x, 3, 0, -1.0f, 1.0f));
        MUST(mgpu_rand_uniform(y, 4, 0, -1.0f, 1.0f));
        CHECK(mgpu_model_activation_bytes(m, 0, &grads) == 0 && grads == 0, "activation memory on %s before a step: %zu bytes",
              mgpu_device_label(dev), mgpu_model_activation_bytes(m, 0, NULL));
        summary_of(m, text, sizeof text);
        CHECK(strstr(text, "Total parameters") && !strstr(text, "Activation memory"),
              "the summary before a step (no activation memory yet):\n%s", text);
        MUST(mgpu_memory_get_stats(dev, &s0));
        MUST(mgpu_model_train_step(m, opt, x, y, NULL));
        MUST(mgpu_memory_get_stats(dev, &s1));
        {   /* what the first step added is the activation memory, and the summary says it */
            const size_t all = mgpu_model_activation_bytes(m, 0, &grads);
            const size_t loss_grad = (size_t)B * 10 * sizeof(float);
            CHECK(all == s1.bytes_in_use - s0.bytes_in_use && grads >= 2 * act + loss_grad && grads <= 2 * act + loss_grad + 4096,
                  "activation memory on %s: mgpu_model_activation_bytes %zu (gradients %zu), the first step added %zu "
                  "(gradients: two buffers of %zu and the loss's %zu, in blocks)", mgpu_device_label(dev), all, grads,
                  s1.bytes_in_use - s0.bytes_in_use, act, loss_grad);
            /* (on a GPU with MGPU_FUSE_RELU, the four ReLUs' bit masks too: 64 KiB) */
            const int gpu = dev->kind == MGPU_DEVICE_CUDA && mgpu__fuse_relu_on();
            summary_of(m, text, sizeof text);
            CHECK(strstr(text, gpu ? "Activation memory of a step (replica 0, the last step's 512 rows): 3.1 MiB, kept for backward 2.1 MiB, gradients 1.0 MiB"
                                   : "Activation memory of a step (replica 0, the last step's 512 rows): 3.0 MiB, kept for backward 2.0 MiB, gradients 1.0 MiB"),
                  "the summary after a step lacks its activation memory:\n%s", text);
        }
        /* + 1 layer's worth for the loss gradient and the rounding of blocks */
        CHECK(s1.bytes_in_use - s0.bytes_in_use <= acts + 3 * act,
              "activation memory on %s: a first step added %zu bytes: the Linears' outputs %zu and two gradient buffers of %zu "
              "(at most %zu)", mgpu_device_label(dev), s1.bytes_in_use - s0.bytes_in_use, acts, act, acts + 3 * act);
        MUST(mgpu_model_train_step(m, opt, x, y, NULL));
        MUST(mgpu_memory_get_stats(dev, &s0));
        CHECK(s0.bytes_in_use == s1.bytes_in_use, "activation memory on %s: a second step moved the bytes in use from "
              "%zu to %zu", mgpu_device_label(dev), s1.bytes_in_use, s0.bytes_in_use);
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
}
/* The activations in place change no bit: the same model with each activation inside a
   Sequential of one (a container's child never runs over its input) trains to the same
   parameters. a and b: the two models; 4 SGD steps on a random batch of x's and y's shapes (y:
   labels below `classes`, or with 0 random MSE targets). */
static mgpu_layer* boxed(mgpu_layer* l) { return mgpu_layer_sequential(&l, 1); }
static void same_bits_in_place(mgpu_model* a, mgpu_model* b, mgpu_device* dev, mgpu_shape xs, mgpu_shape ys, int classes,
                               const char* what) {
    const mgpu_optimizer_desc od = { .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f };
    mgpu_optimizer* oa = a ? mgpu_optimizer_create(a, &od) : NULL;
    mgpu_optimizer* ob = b ? mgpu_optimizer_create(b, &od) : NULL;
    mgpu_tensor *x = tmake(dev, MGPU_F32, xs), *y = classes ? tmake(mgpu_device_cpu(), MGPU_I32, ys) : tmake(dev, MGPU_F32, ys);
    int step;
    if (oa && ob && x && y) {
        float *pa, *pb;
        int64_t i;
        MUST(mgpu_rand_normal(x, 5, 0, 0.0f, 2.0f));
        if (classes)   /* labels */
            for (i = 0; i < mgpu_tensor_numel(y); ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (int32_t)((i * 7) % classes);
        else MUST(mgpu_rand_uniform(y, 6, 0, -1.0f, 1.0f));
        /* the same start (a container's child draws its initial values from a stream of its own) */
        MUST(mgpu_tensor_copy(mgpu_model_params(b, 0), mgpu_model_params(a, 0)));
        mgpu__epilogue_setting = 0;   /* the same kernels on both sides (epilogues: group 'epilogues') */
        for (step = 0; step < 4; ++step) {
            MUST(mgpu_model_train_step(a, oa, x, y, NULL));
            MUST(mgpu_model_train_step(b, ob, x, y, NULL));
        }
        mgpu__epilogue_setting = -1;
        pa = get_flat(a, 0);
        pb = get_flat(b, 0);
        CHECK(flat_n(a) == flat_n(b) && !memcmp(pa, pb, sizeof(float) * (size_t)flat_n(a)),
              "%s in place on %s: 4 steps give other parameters than the same layers in containers", what,
              mgpu_device_label(dev));
        free(pa);
        free(pb);
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(oa); mgpu_optimizer_destroy(ob);
    mgpu_model_destroy(a); mgpu_model_destroy(b);
}
/* ReLU, Tanh and Sigmoid after a Linear, a Sigmoid after a Tanh (whose backward reads its
   output: never overwritten); ReLU after a Conv2d and after a BatchNorm2d */
static void activation_in_place_bits(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 32, W = 24;
    same_bits_in_place(MODEL(mgpu_shape1(W), devs, MGPU_LOSS_MSE, 11, mgpu_layer_linear(W, W), mgpu_layer_relu(),
                             mgpu_layer_linear(W, W), mgpu_layer_tanh(), mgpu_layer_sigmoid(), mgpu_layer_linear(W, W),
                             mgpu_layer_sigmoid(), mgpu_layer_linear(W, 5)),
                       MODEL(mgpu_shape1(W), devs, MGPU_LOSS_MSE, 11, mgpu_layer_linear(W, W), boxed(mgpu_layer_relu()),
                             mgpu_layer_linear(W, W), boxed(mgpu_layer_tanh()), boxed(mgpu_layer_sigmoid()),
                             mgpu_layer_linear(W, W), boxed(mgpu_layer_sigmoid()), mgpu_layer_linear(W, 5)),
                       dev, mgpu_shape2(B, W), mgpu_shape2(B, 5), 0, "ReLU, Tanh, Sigmoid after Linear");
    same_bits_in_place(MODEL(mgpu_shape3(2, 6, 6), devs, MGPU_LOSS_MSE, 12, mgpu_layer_conv2d(2, 4, 3, 1, 1), mgpu_layer_relu(),
                             mgpu_layer_batch_norm2d(4), mgpu_layer_relu(), mgpu_layer_flatten(), mgpu_layer_linear(144, 3)),
                       MODEL(mgpu_shape3(2, 6, 6), devs, MGPU_LOSS_MSE, 12, mgpu_layer_conv2d(2, 4, 3, 1, 1),
                             boxed(mgpu_layer_relu()), mgpu_layer_batch_norm2d(4), boxed(mgpu_layer_relu()),
                             mgpu_layer_flatten(), mgpu_layer_linear(144, 3)),
                       dev, mgpu_shape4(6, 2, 6, 6), mgpu_shape2(6, 3), 0, "ReLU after Conv2d and BatchNorm2d");
}
/* Cross-entropy's gradient over the logits (llm.c's fused classifier's way): a first step of
   Linear -> ReLU -> Linear(W, V) adds the logits and no second buffer of their size, where a
   gradient buffer of its own would; and 4 steps give the same bits as the last Linear inside a
   container (whose output keeps its gradient apart). */
static void loss_in_place(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 64, W = 16, V = 2000;
    const size_t logits = (size_t)B * V * sizeof(float), slack = 64 * 1024;
    mgpu_model* m = MODEL(mgpu_shape1(W), devs, MGPU_LOSS_CROSS_ENTROPY, 21, mgpu_layer_linear(W, W), mgpu_layer_relu(),
                          mgpu_layer_linear(W, V));
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, NULL) : NULL;
    mgpu_tensor *x = tmake(dev, MGPU_F32, mgpu_shape2(B, W)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(B));
    mgpu_memory_stats s0, s1;
    int64_t i;
    CHECK(m && opt, "loss gradient in place: the model: %s", mgpu_last_error());
    if (m && opt && x && y) {
        MUST(mgpu_rand_uniform(x, 3, 0, -1.0f, 1.0f));
        for (i = 0; i < B; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (int32_t)((i * 7919) % V);
        MUST(mgpu_memory_get_stats(dev, &s0));
        MUST(mgpu_model_train_step(m, opt, x, y, NULL));
        MUST(mgpu_memory_get_stats(dev, &s1));
        CHECK(s1.bytes_in_use - s0.bytes_in_use <= logits + slack,
              "loss gradient in place on %s: a first step added %zu bytes, the logits %zu (and at most %zu more): a buffer for "
              "their gradient?", mgpu_device_label(dev), s1.bytes_in_use - s0.bytes_in_use, logits, slack);
        {   /* the first step added the activations and, on a GPU, the copy of the CPU's labels (one block) */
            const size_t labels = mgpu_device_kind_of(dev) == MGPU_DEVICE_CUDA ? ((size_t)B * sizeof(int32_t) + 255) / 256 * 256 : 0;
            CHECK(mgpu_model_activation_bytes(m, 0, NULL) + labels == s1.bytes_in_use - s0.bytes_in_use,
                  "loss gradient in place on %s: mgpu_model_activation_bytes %zu (and labels %zu), the first step added %zu (the "
                  "logits counted once?)", mgpu_device_label(dev), mgpu_model_activation_bytes(m, 0, NULL), labels,
                  s1.bytes_in_use - s0.bytes_in_use);
        }
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    same_bits_in_place(MODEL(mgpu_shape1(W), devs, MGPU_LOSS_CROSS_ENTROPY, 22, mgpu_layer_linear(W, W), mgpu_layer_relu(),
                             mgpu_layer_linear(W, 40)),
                       MODEL(mgpu_shape1(W), devs, MGPU_LOSS_CROSS_ENTROPY, 22, mgpu_layer_linear(W, W), mgpu_layer_relu(),
                             boxed(mgpu_layer_linear(W, 40))),
                       dev, mgpu_shape2(B, W), mgpu_shape1(B), 40, "cross-entropy's gradient");
}
static void test_activation_memory(void) {
    header("activation memory");
    activation_memory(NULL, mgpu_device_cpu());
    activation_in_place_bits(NULL, mgpu_device_cpu());
    loss_in_place(NULL, mgpu_device_cpu());
#ifdef MGPU_CUDA
    if (g_gpu) {
        activation_memory(g_gpu_set, g_gpu);
        activation_in_place_bits(g_gpu_set, g_gpu);
        loss_in_place(g_gpu_set, g_gpu);
    }
#endif
}

/* ---- bf16 mixed precision (mgpu_model_desc.precision) ---- */
/* a model of these layers from the rest of desc d */
static mgpu_model* model_from(mgpu_model_desc d, mgpu_layer** layers, int n) {
    mgpu_model* m;
    d.layers = layers;
    d.layer_count = n;
    if (!(m = mgpu_model_create(&d))) CHECK(0, "a %s model: mgpu_model_create: %s", mgpu_dtype_name(d.precision), mgpu_last_error());
    return m;
}
static mgpu_model* bf16_mlp(const mgpu_device_set* devs, mgpu_dtype precision, int stages, int micro_batches,
                            mgpu_loss_kind loss, uint64_t seed) {
    return model_from((mgpu_model_desc){ .input = mgpu_shape1(20), .devices = devs, .loss = loss, .seed = seed, .stages = stages,
                                         .micro_batches = micro_batches, .precision = precision },
                      (mgpu_layer*[]){ mgpu_layer_linear(20, 16), mgpu_layer_relu(), mgpu_layer_linear(16, 16), mgpu_layer_gelu(),
                                       mgpu_layer_linear(16, 7) }, 5);
}
static mgpu_model* bf16_model_of(const mgpu_device_set* devs, mgpu_shape input, mgpu_layer** layers, int n) {   /* MSE */
    return model_from((mgpu_model_desc){ .input = input, .devices = devs, .loss = MGPU_LOSS_MSE, .seed = 57, .precision = MGPU_BF16 },
                      layers, n);
}
static mgpu_tensor* bf16_of(mgpu_device* dev, const mgpu_tensor* t) {
    mgpu_tensor* b = tmake(dev, MGPU_BF16, mgpu_tensor_shape(t));
    MUST(mgpu_tensor_convert(b, t, 1.0f, 0.0f));
    return b;
}
static int same_tensor_bits(const mgpu_tensor* a, const mgpu_tensor* b) {
    const size_t n = mgpu_tensor_bytes(a);
    char *ha = (char*)xmalloc(n), *hb = (char*)xmalloc(n);
    int same = n == mgpu_tensor_bytes(b);
    if (same) {
        tget(a, ha);
        tget(b, hb);
        same = !memcmp(ha, hb, n);
    }
    free(ha);
    free(hb);
    return same;
}
/* The model's forward and backward in bf16 are the chain of ops a reader would write, with mgpu's
   roundings: x, the weights and the loss gradient rounded to bf16; each Linear's fp32 sums plus
   its f32 bias rounded once; the activations and their gradients bf16; the output widened to f32;
   the parameters' gradients summed in fp32 into f32. Bit for bit, on one device, with weights
   written by the user after a first forward (the next forward takes their new bf16 copies). */
static void bf16_wiring(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 12;
    mgpu_model* m = bf16_mlp(devs, MGPU_BF16, 1, 1, MGPU_LOSS_MSE, 31);
    mgpu_model* f = bf16_mlp(devs, MGPU_F32, 1, 1, MGPU_LOSS_MSE, 31);
    mgpu_tensor *x = tmake(dev, MGPU_F32, mgpu_shape2(B, 20)), *dout = tmake(dev, MGPU_F32, mgpu_shape2(B, 7));
    if (!m || !f) goto done;
    MUST(mgpu_rand_normal(x, 41, 0, 0.0f, 1.5f));
    MUST(mgpu_rand_normal(dout, 42, 0, 0.0f, 0.1f));
    CHECK(mgpu_model_forward(m, 0, x, 1) != NULL, "bf16 on %s: a first forward: %s", mgpu_device_label(dev), mgpu_last_error());
    MUST(mgpu_rand_normal(mgpu_model_param(m, 0, "2.weight"), 45, 0, 0.0f, 0.3f));   /* a write of the user's */
    MUST(mgpu_tensor_copy(mgpu_model_params(f, 0), mgpu_model_params(m, 0)));
    MUST(mgpu_model_zero_grad(m));
    {
        const mgpu_tensor* out = mgpu_model_forward(m, 0, x, 1);
        const mgpu_tensor* out32 = mgpu_model_forward(f, 0, x, 1);
        mgpu_tensor *w[3], *bias[3], *dw[3], *db[3], *wb[3], *sums[3], *h[3], *a[2], *xb, *wide, *d3, *da[2], *dh[2], *dx, *dxw;
        mgpu_tensor *rdw[3], *rdb[3];
        const int out_f[3] = { 16, 16, 7 };
        char name[32];
        int i;
        CHECK(out && out32, "bf16 on %s: forward: %s", mgpu_device_label(dev), mgpu_last_error());
        if (!out || !out32) goto done;
        MUST(mgpu_model_backward(m, 0, dout));
        for (i = 0; i < 3; ++i) {
            snprintf(name, sizeof name, "%d.weight", 2 * i); w[i] = mgpu_model_param(m, 0, name); dw[i] = mgpu_model_grad(m, 0, name);
            snprintf(name, sizeof name, "%d.bias", 2 * i); bias[i] = mgpu_model_param(m, 0, name); db[i] = mgpu_model_grad(m, 0, name);
            wb[i] = bf16_of(dev, w[i]);
            sums[i] = tmake(dev, MGPU_F32, mgpu_shape2(B, out_f[i]));
            h[i] = tmake(dev, MGPU_BF16, mgpu_shape2(B, out_f[i]));
            rdw[i] = tmake(dev, MGPU_F32, mgpu_tensor_shape(w[i]));
            rdb[i] = tmake(dev, MGPU_F32, mgpu_tensor_shape(bias[i]));
        }
        xb = bf16_of(dev, x);
        for (i = 0; i < 3; ++i) {   /* h = round(x W^T + b); relu after the first, gelu after the second */
            MUST(mgpu_matmul(sums[i], i == 0 ? xb : a[i - 1], wb[i], MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f));
            MUST(mgpu_bias_add(h[i], sums[i], bias[i]));
            if (i < 2) {
                a[i] = tmake(dev, MGPU_BF16, mgpu_shape2(B, 16));
                MUST(i == 0 ? mgpu_relu(a[i], h[i]) : mgpu_gelu(a[i], h[i]));
            }
        }
        wide = tmake(dev, MGPU_F32, mgpu_shape2(B, 7));
        MUST(mgpu_tensor_convert(wide, h[2], 1.0f, 0.0f));
        CHECK(same_tensor_bits(out, wide), "bf16 on %s: the model's output is not the chain of bf16 ops' (x, W rounded; "
              "sums + bias rounded once; widened)", mgpu_device_label(dev));
        CHECK(!same_tensor_bits(out, out32), "bf16 on %s: the output has the f32 model's bits: no rounding happened", mgpu_device_label(dev));
        /* backward: the loss gradient rounded; dW = dH^T A in f32, db = sum dH, dA = dH W (bf16) */
        d3 = bf16_of(dev, dout);
        for (i = 0; i < 2; ++i) {
            da[i] = tmake(dev, MGPU_BF16, mgpu_shape2(B, 16));
            dh[i] = tmake(dev, MGPU_BF16, mgpu_shape2(B, 16));
        }
        dx = tmake(dev, MGPU_BF16, mgpu_shape2(B, 20));
        dxw = tmake(dev, MGPU_F32, mgpu_shape2(B, 20));
        for (i = 2; i >= 0; --i) {
            const mgpu_tensor* dy = i == 2 ? d3 : dh[i];
            MUST(mgpu_tensor_zero(rdw[i]));
            MUST(mgpu_matmul(rdw[i], dy, i == 0 ? xb : a[i - 1], MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f));
            MUST(mgpu_bias_backward(rdb[i], dy));
            MUST(mgpu_matmul(i == 0 ? dx : da[i - 1], dy, wb[i], MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f));
            if (i == 2) MUST(mgpu_gelu_backward(dh[1], da[1], h[1]));
            if (i == 1) MUST(mgpu_relu_backward(dh[0], da[0], a[0]));
        }
        MUST(mgpu_tensor_convert(dxw, dx, 1.0f, 0.0f));
        for (i = 0; i < 3; ++i)
            CHECK(same_tensor_bits(dw[i], rdw[i]) && same_tensor_bits(db[i], rdb[i]),
                  "bf16 on %s: layer %d's weight and bias gradients are not the chain of bf16 ops'", mgpu_device_label(dev), 2 * i);
        CHECK(mgpu_model_input_grad(m, 0) && mgpu_tensor_dtype(mgpu_model_input_grad(m, 0)) == MGPU_F32 &&
              same_tensor_bits(mgpu_model_input_grad(m, 0), dxw),
              "bf16 on %s: d input is not the bf16 chain's, widened to f32: %s", mgpu_device_label(dev), mgpu_last_error());
        for (i = 0; i < 3; ++i) {
            mgpu_tensor_destroy(wb[i]); mgpu_tensor_destroy(sums[i]); mgpu_tensor_destroy(h[i]);
            mgpu_tensor_destroy(rdw[i]); mgpu_tensor_destroy(rdb[i]);
        }
        for (i = 0; i < 2; ++i) { mgpu_tensor_destroy(a[i]); mgpu_tensor_destroy(da[i]); mgpu_tensor_destroy(dh[i]); }
        mgpu_tensor_destroy(xb); mgpu_tensor_destroy(wide); mgpu_tensor_destroy(d3); mgpu_tensor_destroy(dx); mgpu_tensor_destroy(dxw);
    }
done:
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(dout);
    mgpu_model_destroy(m); mgpu_model_destroy(f);
}
/* Training steps: the parameters and gradients stay f32, the memory of a step
   is what mgpu_model_activation_bytes says and no step after the first allocates; a pipeline of 2
   stages x 2 micro-batches on CPU devices gives the one device's bits (bf16 activations pass
   between stages as they are). */
static void bf16_steps(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 16;
    const mgpu_optimizer_desc od = { .kind = MGPU_ADAMW, .lr = 0.01f };
    mgpu_model* m = bf16_mlp(devs, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 32);
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, &od) : NULL;
    mgpu_tensor *x = tmake(dev, MGPU_F32, mgpu_shape2(B, 20)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(B));
    mgpu_memory_stats s0, s1, s2;
    float loss = 0.0f;
    int64_t i;
    if (!m || !opt) goto done;
    MUST(mgpu_rand_normal(x, 43, 0, 0.0f, 1.0f));
    for (i = 0; i < B; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (int32_t)((i * 5) % 7);
    CHECK(mgpu_tensor_dtype(mgpu_model_params(m, 0)) == MGPU_F32 && mgpu_tensor_dtype(mgpu_model_grads(m, 0)) == MGPU_F32,
          "bf16: the parameters and gradients are f32");
    MUST(mgpu_memory_get_stats(dev, &s0));
    MUST(mgpu_model_train_step(m, opt, x, y, &loss));
    MUST(mgpu_memory_get_stats(dev, &s1));
    {
        const size_t labels = mgpu_device_kind_of(dev) == MGPU_DEVICE_CUDA ? ((size_t)B * sizeof(int32_t) + 255) / 256 * 256 : 0;
        CHECK(mgpu_model_activation_bytes(m, 0, NULL) + labels == s1.bytes_in_use - s0.bytes_in_use,
              "bf16 on %s: mgpu_model_activation_bytes %zu (and labels %zu), the first step added %zu", mgpu_device_label(dev),
              mgpu_model_activation_bytes(m, 0, NULL), labels, s1.bytes_in_use - s0.bytes_in_use);
    }
    MUST(mgpu_model_train_step(m, opt, x, y, NULL));
    MUST(mgpu_memory_get_stats(dev, &s1));
    for (i = 0; i < 3; ++i) MUST(mgpu_model_train_step(m, opt, x, y, &loss));
    MUST(mgpu_memory_get_stats(dev, &s2));
    CHECK(s2.backend_allocs == s1.backend_allocs && s2.bytes_in_use == s1.bytes_in_use,
          "bf16 on %s: steps after the second allocated %llu times, bytes in use %zu -> %zu", mgpu_device_label(dev),
          (unsigned long long)(s2.backend_allocs - s1.backend_allocs), s1.bytes_in_use, s2.bytes_in_use);
    {
        char text[4096];
        summary_of(m, text, sizeof text);
        CHECK(strstr(text, "Precision: bf16 activations and products (the weights' bf16 copies: 1.4 KiB a replica)"),
              "bf16: the summary does not say the precision:\n%s", text);
    }
    CHECK(loss > 0.0f && loss < 1.9f, "bf16 on %s: 5 AdamW steps on one batch of 7 classes: loss %g (log 7 = 1.95 at the start)",
          mgpu_device_label(dev), (double)loss);
    if (!devs) {   /* the pipeline, against this model's steps from the same start */
        mgpu_device_set* two = mgpu_device_set_create("cpu:2");
        mgpu_model *a = bf16_mlp(NULL, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 33), *p = two ? bf16_mlp(two, MGPU_BF16, 2, 2, MGPU_LOSS_CROSS_ENTROPY, 33) : NULL;
        mgpu_optimizer *oa = a ? mgpu_optimizer_create(a, &od) : NULL, *op = p ? mgpu_optimizer_create(p, &od) : NULL;
        if (oa && op) {
            int same = 1, t;
            for (i = 0; i < 3; ++i) {
                MUST(mgpu_model_train_step(a, oa, x, y, NULL));
                MUST(mgpu_model_train_step(p, op, x, y, NULL));
            }
            for (t = 0; t < mgpu_model_tensor_count(a); ++t) same &= same_tensor_bits(mgpu_model_tensor(a, 0, t), mgpu_model_tensor(p, 0, t));
            CHECK(same, "bf16: 2 stages x 2 micro-batches on cpu:2 do not give the one device's bits after 3 steps");
        }
        mgpu_optimizer_destroy(oa); mgpu_optimizer_destroy(op);
        mgpu_model_destroy(a); mgpu_model_destroy(p);
        {   /* data parallel: cpu:2's gradients of a batch (each replica sums its rows, then the two are added)
               within 1e-5 of one device's; and mgpu_model_evaluate's loss is the step's, same parameters */
            mgpu_model *one = bf16_mlp(NULL, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 35);
            mgpu_model *dp = two ? bf16_mlp(two, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 35) : NULL;
            float l1 = 0.0f, l2 = 0.0f, le = 0.0f;
            if (one && dp) {
                float *g1, *g2;
                double dd = 0.0, nn = 0.0;
                MUST(mgpu_tensor_copy(mgpu_model_params(dp, 0), mgpu_model_params(one, 0)));
                MUST(mgpu_tensor_copy(mgpu_model_params(dp, 1), mgpu_model_params(one, 0)));
                MUST(mgpu_model_accumulate(one, x, y, 0, &l1));
                MUST(mgpu_model_accumulate(dp, x, y, 0, &l2));
                MUST(mgpu_model_reduce_grads(dp));
                g1 = get_grads(one, 0);
                g2 = get_grads(dp, 1);
                for (i = 0; i < flat_n(one); ++i) {
                    dd += ((double)g2[i] - g1[i]) * ((double)g2[i] - g1[i]);
                    nn += (double)g1[i] * g1[i];
                }
                CHECK(sqrt(dd) <= 1e-5 * sqrt(nn) && fabs((double)l2 - l1) <= 1e-6 * fabs((double)l1),
                      "bf16 on cpu:2 against cpu: loss %.9g vs %.9g, gradients differ by %.3g of their norm (limit 1e-5)",
                      (double)l2, (double)l1, nn > 0 ? sqrt(dd / nn) : sqrt(dd));
                MUST(mgpu_model_evaluate(one, x, y, &le, NULL));
                CHECK(fabs((double)le - l1) <= 1e-6 * fabs((double)l1), "bf16: mgpu_model_evaluate's loss %.9g, the step's %.9g",
                      (double)le, (double)l1);
                free(g1);
                free(g2);
            }
            mgpu_model_destroy(one); mgpu_model_destroy(dp);
        }
        {   /* MSE: 5 SGD steps towards fixed targets lower the loss */
            mgpu_model* mse = bf16_model_of(NULL, mgpu_shape1(20), (mgpu_layer*[]){ mgpu_layer_linear(20, 16), mgpu_layer_tanh(),
                                                                                    mgpu_layer_linear(16, 7) }, 3);
            mgpu_optimizer* om = mse ? mgpu_optimizer_create(mse, NULL) : NULL;
            mgpu_tensor* target = tmake(dev, MGPU_F32, mgpu_shape2(B, 7));
            float first = 0.0f, last = 0.0f;
            if (om) {
                MUST(mgpu_rand_uniform(target, 46, 0, -0.5f, 0.5f));
                MUST(mgpu_model_train_step(mse, om, x, target, &first));
                for (i = 0; i < 4; ++i) MUST(mgpu_model_train_step(mse, om, x, target, &last));
                CHECK(last < first, "bf16 MSE: 5 SGD steps, loss %g then %g", (double)first, (double)last);
            }
            mgpu_tensor_destroy(target);
            mgpu_optimizer_destroy(om);
            mgpu_model_destroy(mse);
        }
        mgpu_device_set_destroy(two);
    }
done:
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
}
/* A layer without a bf16 kernel of its own, in a bf16 model, is its f32 code on the widened bf16
   values, each output rounded once: against the same layer in an f32 model fed the bf16-rounded
   input, loss gradient and (Conv2d, attention) weights, whose outputs are then rounded, bit for bit:
   output, input gradient, parameter gradients. One layer per model, on each device. */
static mgpu_layer* widened_layer(int kind) {
    switch (kind) {
    case 0: return mgpu_layer_conv2d(2, 3, 3, 1, 1);
    case 1: return mgpu_layer_maxpool2d(2, 2);
    case 2: return mgpu_layer_batch_norm2d(2);
    case 3: return mgpu_layer_global_avg_pool2d();
    case 4: return mgpu_layer_dropout(0.3f);
    case 5: return mgpu_layer_layer_norm(6);
    case 6: return mgpu_layer_position_embedding(8, 6);
    case 7: return mgpu_layer_embedding(11, 6);
    default: return mgpu_layer_causal_self_attention(6, 2, 0.1f);
    }
}
static void round_bf16(mgpu_tensor* t) {   /* t's values rounded to bf16, kept as f32 */
    mgpu_tensor* b = bf16_of(mgpu_tensor_device(t), t);
    MUST(mgpu_tensor_convert(t, b, 1.0f, 0.0f));
    mgpu_tensor_destroy(b);
}
static void bf16_widened_layers(const mgpu_device_set* devs, mgpu_device* dev) {
    int kind;
    for (kind = 0; kind < 9; ++kind) {
        const mgpu_shape sample = kind <= 4 ? mgpu_shape3(2, 6, 6) : kind == 7 ? mgpu_shape1(5) : mgpu_shape2(5, 6);
        mgpu_model *mb = NULL, *mf = NULL;
        mgpu_tensor *x = NULL, *dout = NULL;
        const char* type;
        int pass, t, same = 1;
        for (pass = 0; pass < 2; ++pass)   /* the same layer in bf16, then in f32 */
            *(pass ? &mf : &mb) = model_from((mgpu_model_desc){ .input = sample, .input_dtype = kind == 7 ? MGPU_I32 : MGPU_F32,
                                                                .devices = devs, .loss = MGPU_LOSS_MSE, .seed = 50,
                                                                .precision = pass ? MGPU_F32 : MGPU_BF16 },
                                             (mgpu_layer*[]){ widened_layer(kind) }, 1);
        if (!mb || !mf) goto next;
        {
            static const char* types[9] = { "Conv2d", "MaxPool2d", "BatchNorm2d", "AdaptiveAvgPool2d", "Dropout", "LayerNorm",
                                            "PositionEmbedding", "Embedding", "CausalSelfAttention" };
            type = types[kind];
        }
        {
            mgpu_shape xs = sample, ys;
            int i;
            xs.ndim = sample.ndim + 1;
            xs.dim[0] = 3;
            for (i = 0; i < sample.ndim; ++i) xs.dim[i + 1] = sample.dim[i];
            x = tmake(dev, kind == 7 ? MGPU_I32 : MGPU_F32, xs);
            if (kind == 7) {
                int32_t ids[15];
                for (i = 0; i < 15; ++i) ids[i] = (i * 7) % 11;
                tput(x, ids);
            } else {
                MUST(mgpu_rand_normal(x, 51, 0, 0.0f, 1.0f));
                round_bf16(x);   /* the f32 model's input: the bf16 model rounds it so itself */
            }
            ys = mgpu_tensor_shape(mgpu_model_forward(mf, 0, x, 1));
            dout = tmake(dev, MGPU_F32, ys);
            MUST(mgpu_rand_normal(dout, 52, 0, 0.0f, 0.5f));
            round_bf16(dout);
        }
        MUST(mgpu_tensor_copy(mgpu_model_params(mf, 0), mgpu_model_params(mb, 0)));
        if (kind == 0) round_bf16(mgpu_model_param(mf, 0, "0.weight"));   /* a product's weight: its bf16 copy */
        if (kind == 8) {
            round_bf16(mgpu_model_param(mf, 0, "0.c_attn.weight"));
            round_bf16(mgpu_model_param(mf, 0, "0.c_proj.weight"));
        }
        MUST(mgpu_model_zero_grad(mb));
        MUST(mgpu_model_zero_grad(mf));
        {
            const mgpu_tensor *yb = mgpu_model_forward(mb, 0, x, 1), *yf = mgpu_model_forward(mf, 0, x, 1);
            mgpu_tensor* yr;
            if (!yb || !yf) { CHECK(0, "bf16 widened %s: forward: %s", type, mgpu_last_error()); goto next; }
            yr = tmake(dev, MGPU_F32, mgpu_tensor_shape(yf));
            MUST(mgpu_tensor_copy(yr, yf));
            round_bf16(yr);
            CHECK(same_tensor_bits(yb, yr), "bf16 on %s: widened %s: the output is not the f32 layer's on the rounded input, rounded",
                  mgpu_device_label(dev), type);
            mgpu_tensor_destroy(yr);
        }
        MUST(mgpu_model_backward(mb, 0, dout));
        MUST(mgpu_model_backward(mf, 0, dout));
        for (t = 0; t < mgpu_model_tensor_count(mb); ++t)
            if (!mgpu_model_tensor_is_buffer(mb, t)) same &= same_tensor_bits(mgpu_model_grad(mb, 0, mgpu_model_tensor_name(mb, t)),
                                                                            mgpu_model_grad(mf, 0, mgpu_model_tensor_name(mf, t)));
        CHECK(same, "bf16 on %s: widened %s: the parameters' gradients are not the f32 layer's", mgpu_device_label(dev), type);
        if (kind != 7) {
            const mgpu_tensor *gb = mgpu_model_input_grad(mb, 0), *gf = mgpu_model_input_grad(mf, 0);
            mgpu_tensor* gr = gf ? tmake(dev, MGPU_F32, mgpu_tensor_shape(gf)) : NULL;
            if (gr) {
                MUST(mgpu_tensor_copy(gr, gf));
                round_bf16(gr);
            }
            CHECK(gb && gr && same_tensor_bits(gb, gr), "bf16 on %s: widened %s: d input is not the f32 layer's, rounded: %s",
                  mgpu_device_label(dev), type, mgpu_last_error());
            mgpu_tensor_destroy(gr);
        }
    next:
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(dout);
        mgpu_model_destroy(mb); mgpu_model_destroy(mf);
    }
}
/* Containers in bf16 pass bf16 activations between their children: a Sequential holding
   LayerNorm, Linear, GELU, Linear gives the bits of the same layers laid flat in the model, and a
   Residual adds f(x) to x rounding once (mgpu_add on bf16); forward and backward, bit for bit. */
static void bf16_containers(const mgpu_device_set* devs, mgpu_device* dev) {
    const int64_t B = 6;
    mgpu_layer* kids[4];
    mgpu_model *boxed_m, *flat, *res, *pre, *post;
    mgpu_tensor *x = tmake(dev, MGPU_F32, mgpu_shape3(B, 3, 6)), *dout = tmake(dev, MGPU_F32, mgpu_shape3(B, 3, 5));
    MUST(mgpu_rand_normal(x, 55, 0, 0.0f, 1.0f));
    MUST(mgpu_rand_normal(dout, 56, 0, 0.0f, 0.3f));
    kids[0] = mgpu_layer_layer_norm(6); kids[1] = mgpu_layer_linear(6, 12); kids[2] = mgpu_layer_gelu_tanh(); kids[3] = mgpu_layer_linear(12, 6);
    boxed_m = bf16_model_of(devs, mgpu_shape2(3, 6), (mgpu_layer*[]){ mgpu_layer_linear(6, 6), mgpu_layer_sequential(kids, 4), mgpu_layer_linear(6, 5) }, 3);
    flat = bf16_model_of(devs, mgpu_shape2(3, 6), (mgpu_layer*[]){ mgpu_layer_linear(6, 6), mgpu_layer_layer_norm(6), mgpu_layer_linear(6, 12),
                                                                  mgpu_layer_gelu_tanh(), mgpu_layer_linear(12, 6), mgpu_layer_linear(6, 5) }, 6);
    if (boxed_m && flat) {
        const mgpu_tensor *ya, *yb;
        MUST(mgpu_tensor_copy(mgpu_model_params(flat, 0), mgpu_model_params(boxed_m, 0)));
        MUST(mgpu_model_zero_grad(boxed_m));
        MUST(mgpu_model_zero_grad(flat));
        ya = mgpu_model_forward(boxed_m, 0, x, 1);
        yb = mgpu_model_forward(flat, 0, x, 1);
        CHECK(ya && yb && same_tensor_bits(ya, yb), "bf16 on %s: a Sequential's output is not its layers' laid flat: %s",
              mgpu_device_label(dev), mgpu_last_error());
        MUST(mgpu_model_backward(boxed_m, 0, dout));
        MUST(mgpu_model_backward(flat, 0, dout));
        CHECK(same_tensor_bits(mgpu_model_grads(boxed_m, 0), mgpu_model_grads(flat, 0)) &&
              same_tensor_bits(mgpu_model_input_grad(boxed_m, 0), mgpu_model_input_grad(flat, 0)),
              "bf16 on %s: a Sequential's gradients are not its layers' laid flat", mgpu_device_label(dev));
    }
    mgpu_model_destroy(boxed_m); mgpu_model_destroy(flat);
    /* Residual: [Linear, Residual(Linear)] against [Linear] then [Linear] on its output, added by hand */
    res = bf16_model_of(devs, mgpu_shape2(3, 6), (mgpu_layer*[]){ mgpu_layer_linear(6, 6), mgpu_layer_residual(mgpu_layer_linear(6, 6), NULL) }, 2);
    pre = bf16_model_of(devs, mgpu_shape2(3, 6), (mgpu_layer*[]){ mgpu_layer_linear(6, 6) }, 1);
    post = bf16_model_of(devs, mgpu_shape2(3, 6), (mgpu_layer*[]){ mgpu_layer_linear(6, 6) }, 1);
    if (res && pre && post) {
        const mgpu_tensor *y, *h, *f;
        mgpu_tensor *hb = tmake(dev, MGPU_BF16, mgpu_shape3(B, 3, 6)), *fb = tmake(dev, MGPU_BF16, mgpu_shape3(B, 3, 6));
        mgpu_tensor *sum = tmake(dev, MGPU_BF16, mgpu_shape3(B, 3, 6)), *want = tmake(dev, MGPU_F32, mgpu_shape3(B, 3, 6));
        MUST(mgpu_tensor_copy(mgpu_model_param(pre, 0, "0.weight"), mgpu_model_param(res, 0, "0.weight")));
        MUST(mgpu_tensor_copy(mgpu_model_param(pre, 0, "0.bias"), mgpu_model_param(res, 0, "0.bias")));
        MUST(mgpu_tensor_copy(mgpu_model_param(post, 0, "0.weight"), mgpu_model_param(res, 0, "1.weight")));
        MUST(mgpu_tensor_copy(mgpu_model_param(post, 0, "0.bias"), mgpu_model_param(res, 0, "1.bias")));
        y = mgpu_model_forward(res, 0, x, 1);
        h = mgpu_model_forward(pre, 0, x, 1);
        f = h ? mgpu_model_forward(post, 0, h, 1) : NULL;   /* (h holds bf16 values: post's rounding keeps them) */
        if (y && h && f) {
            MUST(mgpu_tensor_convert(hb, h, 1.0f, 0.0f));
            MUST(mgpu_tensor_convert(fb, f, 1.0f, 0.0f));
            MUST(mgpu_add(sum, fb, hb));
            MUST(mgpu_tensor_convert(want, sum, 1.0f, 0.0f));
            CHECK(same_tensor_bits(y, want), "bf16 on %s: Residual(Linear)'s output is not f(x) + x rounded once", mgpu_device_label(dev));
        } else CHECK(0, "bf16 residual on %s: forward: %s", mgpu_device_label(dev), mgpu_last_error());
        mgpu_tensor_destroy(hb); mgpu_tensor_destroy(fb); mgpu_tensor_destroy(sum); mgpu_tensor_destroy(want);
    }
    mgpu_model_destroy(res); mgpu_model_destroy(pre); mgpu_model_destroy(post);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(dout);
}
#ifdef MGPU_CUDA
/* A GPU's bf16 step against the CPU's from the same parameters: the same roundings, the sums in
   another order. An f32 sum that differs in its last bit moves a bf16 rounding by one step (2^-8
   relative) where it lies near a tie, rarely; the gradients then differ by a few such steps in
   a few elements: within 2^-7 of each gradient tensor's norm. */
static void bf16_gpu_vs_cpu(void) {
    const int64_t B = 24;
    mgpu_model *c = bf16_mlp(NULL, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 34), *g = bf16_mlp(g_gpu_set, MGPU_BF16, 1, 1, MGPU_LOSS_CROSS_ENTROPY, 34);
    mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(B, 20)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(B));
    mgpu_tensor* xg = tmake(g_gpu, MGPU_F32, mgpu_shape2(B, 20));
    int64_t i;
    if (c && g) {
        float lc = 0.0f, lg = 0.0f, *gc, *gg;
        double worst = 0.0;
        int t;
        MUST(mgpu_rand_normal(x, 44, 0, 0.0f, 1.0f));
        MUST(mgpu_tensor_copy(xg, x));
        for (i = 0; i < B; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (int32_t)((i * 3) % 7);
        MUST(mgpu_tensor_copy(mgpu_model_params(g, 0), mgpu_model_params(c, 0)));
        MUST(mgpu_model_accumulate(c, x, y, 0, &lc));
        MUST(mgpu_model_accumulate(g, xg, y, 0, &lg));
        gc = get_grads(c, 0);
        gg = get_grads(g, 0);
        for (t = 0; t < mgpu_model_tensor_count(c); ++t) {
            const mgpu_tensor* v = mgpu_model_tensor(c, 0, t);
            const int64_t off = (int64_t)((const char*)mgpu_tensor_data(v) - (const char*)mgpu_tensor_data(mgpu_model_params(c, 0))) / 4;
            double dd = 0.0, nn = 0.0;
            for (i = off; i < off + mgpu_tensor_numel(v); ++i) {
                dd += ((double)gg[i] - gc[i]) * ((double)gg[i] - gc[i]);
                nn += (double)gc[i] * gc[i];
            }
            if (sqrt(dd) > worst * sqrt(nn)) worst = nn > 0 ? sqrt(dd / nn) : sqrt(dd);
        }
        CHECK(fabs((double)lg - lc) <= 1e-3 * fabs((double)lc) && worst <= 1.0 / 128,
              "bf16 step on %s against the CPU's: loss %.9g vs %.9g, gradients differ by %.3g of their norm (limit 2^-7)",
              mgpu_device_label(g_gpu), (double)lg, (double)lc, worst);
        printf("  bf16 step on %s against the CPU: loss %.9g vs %.9g, gradients within %.3g of their norms\n",
               mgpu_device_label(g_gpu), (double)lg, (double)lc, worst);
        free(gc);
        free(gg);
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y); mgpu_tensor_destroy(xg);
    mgpu_model_destroy(c); mgpu_model_destroy(g);
}
/* A small CNN in bf16 (every widened kind of layer but the transformer's, and Dropout) as a CUDA
   graph: its steps have the eager steps' bits. */
static mgpu_model* bf16_cnn(int graph) {
    return model_from((mgpu_model_desc){ .input = mgpu_shape3(2, 6, 6), .devices = g_gpu_set, .seed = 53, .graph = graph,
                                         .precision = MGPU_BF16 },
                      (mgpu_layer*[]){ mgpu_layer_conv2d(2, 4, 3, 1, 1), mgpu_layer_relu(), mgpu_layer_batch_norm2d(4),
                                       mgpu_layer_maxpool2d(2, 2), mgpu_layer_dropout(0.2f), mgpu_layer_flatten(),
                                       mgpu_layer_linear(4 * 3 * 3, 12), mgpu_layer_linear(12, 5) }, 8);
}
static void bf16_graph(void) {
    mgpu_model *e = bf16_cnn(0), *g = bf16_cnn(1);
    mgpu_optimizer *oe = e ? mgpu_optimizer_create(e, NULL) : NULL, *og = g ? mgpu_optimizer_create(g, NULL) : NULL;
    mgpu_tensor *x = tmake(g_gpu, MGPU_F32, mgpu_shape4(10, 2, 6, 6)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(10));
    int i, t, same = 1;
    if (oe && og) {
        MUST(mgpu_rand_normal(x, 54, 0, 0.0f, 1.0f));
        for (i = 0; i < 10; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = i % 5;
        for (i = 0; i < 5; ++i) {
            MUST(mgpu_model_train_step(e, oe, x, y, NULL));
            MUST(mgpu_model_train_step(g, og, x, y, NULL));
        }
        for (t = 0; t < mgpu_model_tensor_count(e); ++t) same &= same_tensor_bits(mgpu_model_tensor(e, 0, t), mgpu_model_tensor(g, 0, t));
        CHECK(same && mgpu_model_graph_steps(g) >= 3, "bf16 CNN on %s: %lld of 5 steps from a CUDA graph; its parameters and buffers "
              "%s the eager steps' bits", mgpu_device_label(g_gpu), (long long)mgpu_model_graph_steps(g), same ? "have" : "do not have");
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(oe); mgpu_optimizer_destroy(og);
    mgpu_model_destroy(e); mgpu_model_destroy(g);
}
#endif
static void test_bf16_models(void) {
    header("bf16 mixed precision");
    {   /* what has no bf16 path yet is refused by name */
        mgpu_model_desc d;
        mgpu_layer* layers[3];
        mgpu_layer* kids[2];
        int destroyed = 0;
        kids[0] = mgpu_layer_relu();
        kids[1] = scale_layer(2.0f, &destroyed);
        layers[0] = mgpu_layer_linear(8, 8);
        layers[1] = mgpu_layer_residual(mgpu_layer_sequential(kids, 2), NULL);
        layers[2] = mgpu_layer_linear(8, 3);
        memset(&d, 0, sizeof d);
        d.input = mgpu_shape2(4, 8);
        d.layers = layers;
        d.layer_count = 3;
        d.precision = MGPU_BF16;
        CHECK(!mgpu_model_create(&d), "a bf16 model with a layer of one's own inside a container was made");
        expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "bf16 with a layer of one's own", "precision bf16",
                    "layer 1 (Residual, inside it a Scale)", "no bf16 path");
        CHECK(destroyed == 1, "the refused model's layers are destroyed");
        layers[0] = mgpu_layer_linear(4, 3);
        d.input = mgpu_shape1(4);
        d.layer_count = 1;
        d.precision = MGPU_I32;
        CHECK(!mgpu_model_create(&d), "a model of precision i32 was made");
        expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "precision i32", "precision i32", "MGPU_BF16", NULL);
    }
    bf16_wiring(NULL, mgpu_device_cpu());
    bf16_widened_layers(NULL, mgpu_device_cpu());
    bf16_containers(NULL, mgpu_device_cpu());
    bf16_steps(NULL, mgpu_device_cpu());
#ifdef MGPU_CUDA
    if (g_gpu) {
        bf16_wiring(g_gpu_set, g_gpu);
        bf16_widened_layers(g_gpu_set, g_gpu);
        bf16_containers(g_gpu_set, g_gpu);
        bf16_steps(g_gpu_set, g_gpu);
        bf16_gpu_vs_cpu();
        bf16_graph();
    }
#endif
}

static void test_cuda_twins(void) {
    header("9. CUDA twins");
#ifdef MGPU_CUDA
    if (g_gpu) {
        mgpu_device_set* dp = mgpu_device_set_create("cuda:0,0");
        int i;
        init_specs();
        for (i = 0; i < g_nspecs; ++i) twin_layer(&g_specs[i]);
        twin_train(NULL, g_gpu_set, "CNN, 5 SGD steps: cpu vs cuda:0", 1e-4, 1e-4);
        CHECK(dp != NULL, "cuda:0,0: %s", mgpu_last_error());
        if (dp) twin_train(g_gpu_set, dp, "CNN, 5 SGD steps: cuda:0 vs cuda:0,0", 1e-5, 1e-5);
        /* device mismatch, and a checkpoint from the GPU loads on the CPU */
        {
            mgpu_model* mg = MODEL(mgpu_shape1(6), g_gpu_set, MGPU_LOSS_CROSS_ENTROPY, 4, mgpu_layer_linear(6, 3));
            mgpu_model* mc = MODEL(mgpu_shape1(6), NULL, MGPU_LOSS_CROSS_ENTROPY, 5, mgpu_layer_linear(6, 3));
            if (mg && mc) {
                mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 6));
                char path[512];
                float *pg, *pc;
                MUST(mgpu_tensor_zero(x));
                expect_null(mgpu_model_forward(mg, 0, x, 1), MGPU_ERROR_DEVICE_MISMATCH, "a CPU x for a GPU replica",
                            "mgpu_model_forward", "cuda", NULL);
                tpath(path, sizeof path, "gpu.safetensors");
                MUST(mgpu_model_save(mg, NULL, path));
                MUST(mgpu_model_load(mc, NULL, path));
                pg = get_flat(mg, 0);
                pc = get_flat(mc, 0);
                CHECK(same_bits(pg, pc, (size_t)flat_n(mc) * sizeof(float)), "a GPU checkpoint loads unchanged on the CPU");
                free(pg);
                free(pc);
                remove(path);
                mgpu_tensor_destroy(x);
            }
            mgpu_model_destroy(mg);
            mgpu_model_destroy(mc);
        }
        mgpu_device_set_destroy(dp);
        return;
    }
#endif
    gpu_group_note("layers forward/backward vs CPU");
    gpu_group_note("training cpu vs cuda:0");
    gpu_group_note("data parallel cuda:0,0 vs cuda:0");
}

/* ============================================================================================ */
/* 10. regressions from the code review: each check failed before its fix                        */
/* ============================================================================================ */
static void dropout_batch(mgpu_tensor* x, mgpu_tensor* y, int64_t rows, uint64_t salt) {
    float* px = (float*)mgpu_tensor_data(x);
    int32_t* py = (int32_t*)mgpu_tensor_data(y);
    int64_t i;
    for (i = 0; i < rows * 12; ++i) px[i] = (float)sin(0.37 * (double)(i + 1) + (double)salt);
    for (i = 0; i < rows; ++i) py[i] = (int32_t)((i * 7 + (int64_t)salt) % 5);
}

/* a Linear-Dropout-Linear model on spec, trained `steps` SGD steps on fixed batches of `rows` */
static float* dropout_run(const char* spec, int64_t rows, int steps, int micro, int64_t* count) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model* m = MODEL(mgpu_shape1(12), set, MGPU_LOSS_CROSS_ENTROPY, 21, mgpu_layer_linear(12, 16), mgpu_layer_dropout(0.5f),
                          mgpu_layer_linear(16, 5));
    mgpu_optimizer* o = m ? make_opt(m, MGPU_SGD, 0.1f, 0.9f, 0.0f) : NULL;
    mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(rows, 12)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(rows));
    float* params = NULL;
    int step;
    for (step = 0; o && step < steps; ++step) {
        dropout_batch(x, y, rows, (uint64_t)step);
        if (micro <= 1) MUST(mgpu_model_train_step(m, o, x, y, NULL));
        else {   /* the same batch as `micro` micro-batches, accumulated */
            int64_t per = rows / micro, k;
            for (k = 0; k < micro; ++k) {
                mgpu_tensor* xv = mgpu_tensor_view_rows(x, k * per, per);
                mgpu_tensor* yv = mgpu_tensor_view_rows(y, k * per, per);
                MUST(mgpu_model_accumulate(m, xv, yv, rows, NULL));
                mgpu_tensor_destroy(xv);
                mgpu_tensor_destroy(yv);
            }
            MUST(mgpu_model_apply(m, o));
        }
    }
    if (o) {
        params = get_flat(m, 0);
        *count = flat_n(m);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return params;
}

/* Picky: the identity, but its forward fails when the first input is negative */
static mgpu_result picky_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)ctx;
    if (((const float*)mgpu_tensor_data(x))[0] < 0.0f) return mgpu__fail(MGPU_ERROR_INVALID_ARGUMENT, "Picky: negative input");
    return mgpu_tensor_copy(y, x);
}
static mgpu_result picky_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x,
                                  const mgpu_tensor* y, const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y;
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static const mgpu_layer_vtable picky_vt = { "Picky", NULL, NULL, NULL, NULL, NULL, NULL, picky_forward, picky_backward, NULL, NULL, NULL, NULL };

typedef struct gemm_thread_arg { mgpu_tensor *a, *b, *c; int ok; } gemm_thread_arg;
TEST_THREAD_MAIN(gemm_thread, p) {
    gemm_thread_arg* g = (gemm_thread_arg*)p;
    int i;
    g->ok = 1;
    for (i = 0; i < 40; ++i) g->ok &= mgpu_matmul(g->c, g->a, g->b, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f) == MGPU_OK;
    TEST_THREAD_END;
}

static void test_review_regressions(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    header("10. regressions from the code review");
    {   /* dropout by sample: 3 replicas and 2 accumulated micro-batches draw the masks of one device */
        int64_t n = 0, i;
        float *one = dropout_run("cpu", 24, 4, 1, &n), *three = dropout_run("cpu:3", 24, 4, 1, &n);
        float *acc = dropout_run("cpu", 24, 4, 2, &n), *again = dropout_run("cpu", 24, 4, 1, &n);
        double* ref = dbuf(n);
        if (!one || !three || !acc || !again) { CHECK(0, "dropout runs failed"); return; }
        for (i = 0; i < n; ++i) ref[i] = one[i];
        CHECK(test_rel_error(three, ref, (size_t)n) < 1e-5, "dropout: cpu:3 differs from cpu (normalised %.3g)",
              test_rel_error(three, ref, (size_t)n));
        CHECK(test_rel_error(acc, ref, (size_t)n) < 1e-5, "dropout: 2 accumulated micro-batches differ from one batch (%.3g)",
              test_rel_error(acc, ref, (size_t)n));
        CHECK(same_bits(one, again, (size_t)n * sizeof(float)), "dropout: the same run twice is not bit-identical");
        free(one); free(three); free(acc); free(again); free(ref);
    }
    {   /* a loop of your own: forwards within a step share masks, the next step draws new ones */
        mgpu_model* m = MODEL(mgpu_shape1(12), NULL, MGPU_LOSS_CROSS_ENTROPY, 5, mgpu_layer_dropout(0.5f));
        mgpu_optimizer* o = m ? make_opt(m, MGPU_SGD, 0.1f, 0.0f, 0.0f) : NULL;
        mgpu_tensor* x = tmake(cpu, MGPU_F32, mgpu_shape2(8, 12));
        float a[96], b[96], c[96];
        const mgpu_tensor* out;
        MUST(mgpu_tensor_fill(x, 1.0));
        if (o) {
            out = mgpu_model_forward(m, 0, x, 1); if (out) tget(out, a);
            out = mgpu_model_forward(m, 0, x, 1); if (out) tget(out, b);
            MUST(mgpu_optimizer_step(o));
            out = mgpu_model_forward(m, 0, x, 1); if (out) tget(out, c);
            CHECK(same_bits(a, b, sizeof a), "dropout: two forwards in one step drew different masks");
            CHECK(!same_bits(a, c, sizeof a), "dropout: the step after an optimizer step drew the same masks");
        }
        mgpu_tensor_destroy(x);
        mgpu_optimizer_destroy(o);
        mgpu_model_destroy(m);
    }
    {   /* the optimizer may be destroyed after its model */
        mgpu_model* m = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_linear(4, 2));
        mgpu_optimizer* o = m ? make_opt(m, MGPU_ADAMW, 0.01f, 0.0f, 0.0f) : NULL;
        mgpu_model_destroy(m);
        mgpu_optimizer_destroy(o);   /* ASan reports a use after free if it reads the model */
        CHECK(1, "optimizer destroyed after its model");
    }
    {   /* a forward that fails inside a layer leaves nothing for backward to go through */
        mgpu_model* m = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_CROSS_ENTROPY, 1, mgpu_layer_linear(4, 3),
                              mgpu_layer_create(&picky_vt, NULL));
        mgpu_tensor *x = tmake(cpu, MGPU_F32, mgpu_shape2(2, 4)), *d = tmake(cpu, MGPU_F32, mgpu_shape2(2, 3));
        MUST(mgpu_tensor_fill(d, 1.0));
        if (m) {
            MUST(mgpu_tensor_fill(x, 0.0));   /* Linear's output is its bias: fine for Picky when positive */
            MUST(mgpu_tensor_fill(mgpu_model_tensor(m, 0, 1), 1.0));
            CHECK(mgpu_model_forward(m, 0, x, 1) != NULL, "forward: %s", mgpu_last_error());
            MUST(mgpu_tensor_fill(mgpu_model_tensor(m, 0, 1), -1.0));   /* now Picky refuses */
            CHECK(mgpu_model_forward(m, 0, x, 1) == NULL, "a forward whose layer failed succeeded");
            CHECK(mgpu_model_backward(m, 0, d) == MGPU_ERROR_INVALID_ARGUMENT, "backward after a failed forward: %s",
                  mgpu_last_error());
        }
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(d);
        mgpu_model_destroy(m);
    }
    {   /* converting out of range saturates (and NaN gives 0), as on the GPU */
        float src[5] = { -1.0f, 300.0f, 1e10f, NAN, 7.9f };
        mgpu_tensor* f = tfrom(cpu, mgpu_shape1(5), src);
        mgpu_tensor *u = tmake(cpu, MGPU_U8, mgpu_shape1(5)), *i32 = tmake(cpu, MGPU_I32, mgpu_shape1(5));
        uint8_t ub[5];
        int32_t ib[5];
        MUST(mgpu_tensor_convert(u, f, 1.0f, 0.0f));
        MUST(mgpu_tensor_convert(i32, f, 1.0f, 0.0f));
        tget(u, ub);
        tget(i32, ib);
        CHECK(ub[0] == 0 && ub[1] == 255 && ub[2] == 255 && ub[3] == 0 && ub[4] == 7, "u8 convert: %d %d %d %d %d",
              ub[0], ub[1], ub[2], ub[3], ub[4]);
        CHECK(ib[0] == -1 && ib[1] == 300 && ib[2] == INT32_MAX && ib[3] == 0 && ib[4] == 7, "i32 convert: %d %d %d %d %d",
              ib[0], ib[1], ib[2], ib[3], ib[4]);
        mgpu_tensor_destroy(f); mgpu_tensor_destroy(u); mgpu_tensor_destroy(i32);
    }
    {   /* matmul refuses an output that is also an input */
        mgpu_tensor* a = tmake(cpu, MGPU_F32, mgpu_shape2(4, 4));
        MUST(mgpu_tensor_fill(a, 1.0));
        expect_fail(mgpu_matmul(a, a, a, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_INVALID_ARGUMENT, "matmul out == a",
                    "mgpu_matmul", "shares memory", NULL);
        mgpu_tensor_destroy(a);
    }
    {   /* a bad MGPU_DEVICES says where the spec came from */
        test_setenv("MGPU_DEVICES", "gpu:9");
        CHECK(mgpu_device_set_create("auto") == NULL && strstr(mgpu_last_error(), "MGPU_DEVICES") != NULL,
              "bad MGPU_DEVICES: %s", mgpu_last_error());
        test_unsetenv("MGPU_DEVICES");
    }
    {   /* two threads multiplying on the library's CPU device at once get right answers */
        gemm_thread_arg g[2];
        test_thread t[2];
        float hc[2][64 * 32];
        double ref = 0.0;
        int i, k, ok = 1, started[2];
        for (i = 0; i < 2; ++i) {
            g[i].a = tmake(cpu, MGPU_F32, mgpu_shape2(64, 300));
            g[i].b = tmake(cpu, MGPU_F32, mgpu_shape2(32, 300));
            g[i].c = tmake(cpu, MGPU_F32, mgpu_shape2(64, 32));
            MUST(mgpu_tensor_fill(g[i].a, i ? 0.5 : 0.25));
            MUST(mgpu_tensor_fill(g[i].b, 1.0));
        }
        for (i = 0; i < 2; ++i) {
            g[i].ok = 0;   /* stays 0 for a thread that did not start */
            started[i] = test_thread_start(&t[i], gemm_thread, &g[i]) == 0;
        }
        for (i = 0; i < 2; ++i) if (started[i]) test_thread_join(t[i]);
        for (i = 0; i < 2; ++i) {
            tget(g[i].c, hc[i]);
            ref = (i ? 0.5 : 0.25) * 300.0;
            for (k = 0; k < 64 * 32; ++k) ok &= hc[i][k] == (float)ref;
            ok &= g[i].ok;
            mgpu_tensor_destroy(g[i].a); mgpu_tensor_destroy(g[i].b); mgpu_tensor_destroy(g[i].c);
        }
        CHECK(ok, "two threads multiplying on the CPU device got wrong results");
    }
}

/* ============================================================================================ */
/* 11. the API a harness needs: checkpoints with more than the model, user metadata             */
/* ============================================================================================ */
/* A PyTorch-style file: the model's tensors under "model.", an encoder's beside them. */
static int write_prefixed(const char* path, const char* prefix, int extra, int drop_last, const char* meta_json) {
    st_item it[8];
    char names[8][96];
    int n = 0, k;
    static const char* const base[4] = {"0.weight", "0.bias", "2.weight", "2.bias"};
    static const int64_t rows[4] = {12, 12, 3, 3}, cols[4] = {6, 0, 12, 0};
    memset(it, 0, sizeof it);
    if (extra) {
        it[n].name = "encoder.0.weight"; it[n].dtype = "F16"; it[n].ndim = 2; it[n].shape[0] = 2; it[n].shape[1] = 2; it[n].bytes = 8;
        n++;
    }
    for (k = 0; k < 4 - drop_last; ++k, ++n) {
        snprintf(names[n], sizeof names[n], "%s%s", prefix, base[k]);
        it[n].name = names[n];
        it[n].dtype = "F32";
        it[n].ndim = cols[k] ? 2 : 1;
        it[n].shape[0] = rows[k];
        it[n].shape[1] = cols[k];
        it[n].bytes = (size_t)(rows[k] * (cols[k] ? cols[k] : 1)) * 4;
    }
    if (extra) {
        it[n].name = "lm_head.bias"; it[n].dtype = "F32"; it[n].ndim = 1; it[n].shape[0] = 5; it[n].bytes = 20;
        n++;
    }
    return write_st(path, it, n, meta_json);
}

/* parameter `name` of replica r equals the file's tensor `file_name`, bit for bit */
static int param_equals_file(const mgpu_model* m, int r, const char* name, const char* path, const char* file_name) {
    mgpu_safetensors* st = mgpu_safetensors_open(path);
    mgpu_tensor* want = st ? mgpu_safetensors_read(st, file_name, NULL) : NULL;
    mgpu_tensor* have = mgpu_model_param(m, r, name);
    int ok = 0;
    if (want && have && mgpu_tensor_numel(want) == mgpu_tensor_numel(have)) {
        float* h = fbuf(mgpu_tensor_numel(have));
        tget(have, h);
        ok = same_bits(h, mgpu_tensor_data(want), mgpu_tensor_bytes(want));
        free(h);
    }
    if (!ok) printf("   %s vs %s:%s: %s\n", name, path, file_name, want && have ? "values differ" : mgpu_last_error());
    mgpu_tensor_destroy(want);
    mgpu_safetensors_close(st);
    return ok;
}

/* Checkpoints in BF16, F16 (mgpu_save_desc.dtype) and F64 (as PyTorch may write them) load into
   the model's F32 as load_state_dict converts them: BF16 and F16 exactly, F64 rounded to nearest. */
static void test_load_save_dtypes(void) {
    static const mgpu_save_dtype kinds[2] = {MGPU_SAVE_BF16, MGPU_SAVE_F16};
    static const char* const names[2] = {"BF16", "F16"};
    char path[512];
    mgpu_model *m = ck_model(31, 0), *m2 = ck_model(32, 0);
    mgpu_save_desc sd;
    int k, i;
    header("11b. checkpoints in BF16, F16 and F64");
    if (!m || !m2) goto done;
    memset(&sd, 0, sizeof sd);
    for (k = 0; k < 2; ++k) {
        mgpu_safetensors* st;
        mgpu_safetensors_info info;
        int ok = 1;
        tpath(path, sizeof path, k ? "half.safetensors" : "bf16.safetensors");
        sd.dtype = kinds[k];
        CHECK(mgpu_model_save_ex(m, NULL, path, &sd) == MGPU_OK, "save in %s: %s", names[k], mgpu_last_error());
        st = mgpu_safetensors_open(path);
        CHECK(st && mgpu_safetensors_get_info(st, 0, &info) == MGPU_OK && !strcmp(info.dtype, names[k]) && info.bytes == 12 * 6 * 2,
              "the file holds %s tensors", names[k]);
        mgpu_safetensors_close(st);
        CHECK(mgpu_model_load(m2, NULL, path) == MGPU_OK, "load the %s file: %s", names[k], mgpu_last_error());
        for (i = 0; i < m->tensor_count; ++i) {
            mgpu_tensor* a = mgpu_model_param(m, 0, m->tensors[i].name);
            mgpu_tensor* b = mgpu_model_param(m2, 0, m->tensors[i].name);
            int64_t n = mgpu_tensor_numel(a), j;
            float *x = fbuf(n), *y = fbuf(n);
            tget(a, x);
            tget(b, y);
            for (j = 0; j < n; ++j) {
                float want;
                if (k == 0) {
                    uint32_t bits = (uint32_t)mgpu__float_to_bf16(x[j]) << 16;
                    memcpy(&want, &bits, sizeof want);
                } else want = mgpu__half_to_float(mgpu__float_to_half(x[j]));
                ok &= memcmp(&want, &y[j], sizeof want) == 0 && fabsf(want - x[j]) <= fabsf(x[j]) * (k ? 1e-3f : 4e-3f) + 1e-7f;
            }
            free(x);
            free(y);
        }
        CHECK(ok, "%s: every parameter is the saved value rounded to nearest even, read back exactly", names[k]);
    }
    sd.dtype = (mgpu_save_dtype)7;
    tpath(path, sizeof path, "bf16.safetensors");
    CHECK(mgpu_model_save_ex(m, NULL, path, &sd) == MGPU_ERROR_INVALID_ARGUMENT && strstr(mgpu_last_error(), "dtype 7"),
          "an unknown save dtype is refused");
    {   /* F64, as torch.save of a .double() model writes it: rounded to nearest float */
        mgpu__st_write_item it[8];
        double* d[8];
        int ok = 1;
        memset(it, 0, sizeof it);
        for (i = 0; i < m->tensor_count && i < 8; ++i) {
            size_t n = (size_t)mgpu_shape_numel(m->tensors[i].shape), j;
            d[i] = (double*)xmalloc(n * sizeof(double));
            for (j = 0; j < n; ++j) d[i][j] = 0.1 * (double)(j % 9) - 0.3 + 1e-12 * (double)j;   /* not floats */
            it[i].name = m->tensors[i].name;
            it[i].dtype = "F64";
            it[i].ndim = m->tensors[i].shape.ndim;
            it[i].shape = m->tensors[i].shape.dim;
            it[i].data = d[i];
            it[i].bytes = n * sizeof(double);
        }
        tpath(path, sizeof path, "f64.safetensors");
        CHECK(mgpu__st_write(path, it, m->tensor_count, NULL, NULL, 0) == MGPU_OK, "write an F64 checkpoint: %s", mgpu_last_error());
        CHECK(mgpu_model_load(m2, NULL, path) == MGPU_OK, "load the F64 file: %s", mgpu_last_error());
        for (i = 0; i < m->tensor_count && i < 8; ++i) {
            mgpu_tensor* b = mgpu_model_param(m2, 0, m->tensors[i].name);
            int64_t n = mgpu_tensor_numel(b), j;
            float* y = fbuf(n);
            tget(b, y);
            for (j = 0; j < n; ++j) ok &= y[j] == (float)d[i][j];
            free(y);
            free(d[i]);
        }
        CHECK(ok, "F64: every parameter is the file's value rounded to the nearest float");
    }
done:
    mgpu_model_destroy(m);
    mgpu_model_destroy(m2);
}

static void test_load_ex(void) {
    char path[512], path2[512];
    mgpu_load_desc ld;
    mgpu_model *m, *m2;
    mgpu_device_set* set2 = mgpu_device_set_create("cpu:2");
    float* before;
    header("11. loading part of a file (prefix, extra tensors), user metadata");
    memset(&ld, 0, sizeof ld);
    m = ck_model(21, 0);
    m2 = set2 ? MODEL(mgpu_shape1(6), set2, MGPU_LOSS_CROSS_ENTROPY, 22, mgpu_layer_linear(6, 12), mgpu_layer_relu(), mgpu_layer_linear(12, 3)) : NULL;
    if (!m || !m2) goto done;
    tpath(path, sizeof path, "prefixed.safetensors");
    CHECK(write_prefixed(path, "model.", 1, 0, "\"format\":\"pt\""), "write %s", path);
    before = get_flat(m, 0);
    /* today's strict load: no tensor "0.weight", and a hint at the prefix */
    expect_fail(mgpu_model_load(m, NULL, path), MGPU_ERROR_BAD_FILE, "prefixed file, plain load", "no tensor '0.weight'",
                "it has 'model.0.weight'", "prefix to 'model.'");
    /* the prefix alone: the extra tensors are still refused */
    ld.prefix = "model.";
    expect_fail(mgpu_model_load_ex(m, NULL, path, &ld), MGPU_ERROR_BAD_FILE, "prefix, strict", "mgpu_model_load",
                "unexpected tensor 'encoder.0.weight'", "allow_extra");
    {
        float* p = get_flat(m, 0);
        CHECK(same_bits(p, before, (size_t)flat_n(m) * 4), "a refused load changed the model");
        free(p);
    }
    /* prefix and extra tensors allowed: the model's four load, on both replicas */
    ld.allow_extra = 1;
    MUST(mgpu_model_load_ex(m, NULL, path, &ld));
    MUST(mgpu_model_load_ex(m2, NULL, path, &ld));
    CHECK(param_equals_file(m, 0, "0.weight", path, "model.0.weight") && param_equals_file(m, 0, "2.bias", path, "model.2.bias"),
          "prefix + allow_extra: the parameters are the file's");
    CHECK(param_equals_file(m2, 1, "2.weight", path, "model.2.weight") && replicas_identical(m2),
          "prefix + allow_extra into cpu:2: replica 1 holds the file's parameters");
    /* a missing model tensor is an error, extra tensors allowed or not */
    CHECK(write_prefixed(path, "model.", 1, 1, NULL), "write %s", path);
    expect_fail(mgpu_model_load_ex(m, NULL, path, &ld), MGPU_ERROR_BAD_FILE, "missing tensor with allow_extra", "mgpu_model_load",
                "no tensor 'model.2.bias'", NULL);
    /* no prefix, extra tensors allowed: an mgpu checkpoint with more in it */
    CHECK(write_prefixed(path, "", 1, 0, NULL), "write %s", path);
    ld.prefix = NULL;
    MUST(mgpu_model_load_ex(m, NULL, path, &ld));
    CHECK(param_equals_file(m, 0, "0.bias", path, "0.bias"), "allow_extra without a prefix");
    /* a zeroed desc, and NULL, are today's strict load */
    memset(&ld, 0, sizeof ld);
    expect_fail(mgpu_model_load_ex(m, NULL, path, &ld), MGPU_ERROR_BAD_FILE, "a zeroed desc is strict", "unexpected tensor", NULL, NULL);
    expect_fail(mgpu_model_load_ex(m, NULL, path, NULL), MGPU_ERROR_BAD_FILE, "a NULL desc is strict", "unexpected tensor", NULL, NULL);
    CHECK(write_prefixed(path, "", 0, 0, NULL), "write %s", path);
    MUST(mgpu_model_load_ex(m, NULL, path, &ld));
    /* a prefix too long for any name */
    {
        char longp[300];
        memset(longp, 'p', sizeof longp - 1);
        longp[sizeof longp - 1] = 0;
        ld.prefix = longp;
        expect_fail(mgpu_model_load_ex(m, NULL, path, &ld), MGPU_ERROR_INVALID_ARGUMENT, "a 299-byte prefix", "prefix", "at most 256", NULL);
        ld.prefix = NULL;
    }
    /* the optimizer's state under the prefix: "optimizer." + prefix + name + "." + state */
    {
        mgpu_optimizer_desc d = odesc(MGPU_SGD, 0.1f);
        mgpu_optimizer* o;
        st_item it[8];
        d.momentum = 0.9f;
        o = mgpu_optimizer_create(m, &d);
        tpath(path2, sizeof path2, "prefixed_opt.safetensors");
        memset(it, 0, sizeof it);
        it[0].name = "net.0.weight"; it[0].dtype = "F32"; it[0].ndim = 2; it[0].shape[0] = 12; it[0].shape[1] = 6; it[0].bytes = 288;
        it[1].name = "net.0.bias"; it[1].dtype = "F32"; it[1].ndim = 1; it[1].shape[0] = 12; it[1].bytes = 48;
        it[2].name = "net.2.weight"; it[2].dtype = "F32"; it[2].ndim = 2; it[2].shape[0] = 3; it[2].shape[1] = 12; it[2].bytes = 144;
        it[3].name = "net.2.bias"; it[3].dtype = "F32"; it[3].ndim = 1; it[3].shape[0] = 3; it[3].bytes = 12;
        it[4] = it[0]; it[4].name = "optimizer.net.0.weight.momentum_buffer";
        it[5] = it[1]; it[5].name = "optimizer.net.0.bias.momentum_buffer";
        it[6] = it[2]; it[6].name = "optimizer.net.2.weight.momentum_buffer";
        it[7] = it[3]; it[7].name = "optimizer.net.2.bias.momentum_buffer";
        CHECK(write_st(path2, it, 8, "\"mgpu.optimizer\":\"sgd\",\"mgpu.step\":\"3\""), "write %s", path2);
        ld.prefix = "net.";
        if (o) {
            mgpu_tensor* buf;
            MUST(mgpu_model_load_ex(m, o, path2, &ld));
            CHECK(mgpu_optimizer_step_count(o) == 3, "the step count of a prefixed file: %lld", (long long)mgpu_optimizer_step_count(o));
            buf = mgpu_optimizer_state(o, 0, "2.weight", "momentum_buffer");
            {
                mgpu_safetensors* st = mgpu_safetensors_open(path2);
                mgpu_tensor* want = st ? mgpu_safetensors_read(st, "optimizer.net.2.weight.momentum_buffer", NULL) : NULL;
                float h[36];
                if (buf && want) tget(buf, h);
                CHECK(buf && want && same_bits(h, mgpu_tensor_data(want), sizeof h), "the prefixed momentum buffer is loaded");
                mgpu_tensor_destroy(want);
                mgpu_safetensors_close(st);
            }
        }
        mgpu_optimizer_destroy(o);
        ld.prefix = NULL;
    }
    free(before);
done:
    mgpu_model_destroy(m);
    mgpu_model_destroy(m2);
    mgpu_device_set_destroy(set2);
}

static void test_user_metadata(void) {
    char path[512], path2[512];
    mgpu_model* m = ck_model(31, 0);
    mgpu_optimizer_desc d = odesc(MGPU_ADAMW, 1e-3f);
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, &d) : NULL;
    mgpu_save_desc sd;
    mgpu_metadata meta[3];
    mgpu_safetensors* st;
    uint8_t *a, *b;
    size_t na = 0, nb = 0;
    if (!m || !o) goto done;
    memset(&sd, 0, sizeof sd);
    meta[0].key = "input.mean"; meta[0].value = "0.2860";
    meta[1].key = "input.std"; meta[1].value = "0.3530";
    meta[2].key = "note \xc3\xa9"; meta[2].value = "quotes \" and \\ and\nnewline";
    sd.metadata = meta;
    sd.metadata_count = 3;
    tpath(path, sizeof path, "meta.safetensors");
    MUST(mgpu_model_save_ex(m, o, path, &sd));
    st = mgpu_safetensors_open(path);
    CHECK(st != NULL, "open the checkpoint: %s", mgpu_last_error());
    if (st) {
        const char* mean = mgpu_safetensors_metadata(st, "input.mean");
        const char* sdv = mgpu_safetensors_metadata(st, "input.std");
        const char* note = mgpu_safetensors_metadata(st, "note \xc3\xa9");
        const char* fmt = mgpu_safetensors_metadata(st, "format");
        const char* step = mgpu_safetensors_metadata(st, "mgpu.step");
        CHECK(mean && !strcmp(mean, "0.2860") && sdv && !strcmp(sdv, "0.3530"), "the user's metadata reads back");
        CHECK(note && !strcmp(note, "quotes \" and \\ and\nnewline"), "escaped characters round trip");
        CHECK(fmt && !strcmp(fmt, "pt") && step && !strcmp(step, "0"), "mgpu's own metadata is still there");
        CHECK(mgpu_safetensors_metadata_count(st) == 6 + 3, "6 entries of mgpu's and 3 of the user's, not %d",
              mgpu_safetensors_metadata_count(st));
        CHECK(mgpu_safetensors_find(st, "optimizer.0.weight.exp_avg") >= 0, "the optimizer state is in the file");
        mgpu_safetensors_close(st);
    }
    MUST(mgpu_model_load(m, o, path));   /* the user's entries do not disturb a load */
    /* a zeroed desc, or NULL, writes exactly what mgpu_model_save writes */
    tpath(path2, sizeof path2, "meta_plain.safetensors");
    MUST(mgpu_model_save(m, o, path2));
    a = read_file(path2, &na);
    memset(&sd, 0, sizeof sd);
    MUST(mgpu_model_save_ex(m, o, path2, &sd));
    b = read_file(path2, &nb);
    CHECK(a && b && na == nb && same_bits(a, b, na), "save_ex with a zeroed desc writes the bytes save writes");
    free(b);
    MUST(mgpu_model_save_ex(m, o, path2, NULL));
    b = read_file(path2, &nb);
    CHECK(a && b && na == nb && same_bits(a, b, na), "save_ex with NULL writes the bytes save writes");
    free(b);
    /* bad entries: an error naming the entry, and the file on disk untouched */
    {
        static const struct { const char* key; const char* value; const char* says; } bad[] = {
            {"format", "np", "reserved"},
            {"mgpu.step", "7", "reserved"},
            {"mgpu.mine", "x", "reserved"},
            {"", "x", "empty"},
            {NULL, "x", "NULL"},
            {"k", NULL, "value is NULL"},
            {"\xff", "x", "UTF-8"},
            {"k", "\xc3", "UTF-8"},
        };
        char longkey[200], longval[1100];
        size_t i;
        memset(longkey, 'k', 128); longkey[128] = 0;
        memset(longval, 'v', 1024); longval[1024] = 0;
        sd.metadata = meta;
        sd.metadata_count = 2;
        for (i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
            char what[96];
            meta[1].key = bad[i].key;
            meta[1].value = bad[i].value;
            snprintf(what, sizeof what, "metadata entry %d ('%s')", (int)i, bad[i].key ? bad[i].key : "NULL");
            expect_fail(mgpu_model_save_ex(m, o, path2, &sd), MGPU_ERROR_INVALID_ARGUMENT, what, "mgpu_model_save", "metadata entry 1",
                        bad[i].says);
        }
        {   /* no limits the format does not have: a 128-byte key and a 1024-byte value save and read back */
            char path3[600];
            mgpu_safetensors* st = NULL;
            snprintf(path3, sizeof path3, "%s.long", path2);
            meta[1].key = longkey; meta[1].value = longval;
            CHECK(mgpu_model_save_ex(m, o, path3, &sd) == MGPU_OK && (st = mgpu_safetensors_open(path3)) != NULL &&
                      mgpu_safetensors_metadata(st, longkey) && !strcmp(mgpu_safetensors_metadata(st, longkey), longval),
                  "a 128-byte key and a 1024-byte value: %s", mgpu_last_error());
            if (st) mgpu_safetensors_close(st);
            remove(path3);
        }
        meta[1].key = "input.mean"; meta[1].value = "1";
        expect_fail(mgpu_model_save_ex(m, o, path2, &sd), MGPU_ERROR_INVALID_ARGUMENT, "a key twice", "'input.mean'", "twice", NULL);
        sd.metadata_count = -1;
        expect_fail(mgpu_model_save_ex(m, o, path2, &sd), MGPU_ERROR_INVALID_ARGUMENT, "a negative count", "-1 metadata entries", NULL,
                    NULL);
        sd.metadata = NULL;
        sd.metadata_count = 1;
        expect_fail(mgpu_model_save_ex(m, o, path2, &sd), MGPU_ERROR_INVALID_ARGUMENT, "entries without an array", "metadata", NULL,
                    NULL);
        b = read_file(path2, &nb);
        CHECK(a && b && na == nb && same_bits(a, b, na), "refused saves left the file as it was");
        free(b);
    }
    free(a);
done:
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

/* ============================================================================================ */
/* 12. the API a harness needs: parameters and gradients by name, bad indices                   */
/* ============================================================================================ */
static void test_named_views(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set2 = mgpu_device_set_create("cpu:2");
    mgpu_model* m = set2 ? MODEL(mgpu_shape1(6), set2, MGPU_LOSS_CROSS_ENTROPY, 41, mgpu_layer_linear(6, 12), mgpu_layer_relu(),
                                 mgpu_layer_linear(12, 3)) : NULL;
    mgpu_optimizer_desc d = odesc(MGPU_SGD, 0.1f);
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, &d) : NULL;
    float xs[8 * 6];
    int32_t ys[8] = {0, 1, 2, 0, 1, 2, 0, 1};
    header("12. parameters and gradients by name; bad indices");
    if (!m || !o) goto done;
    rnd_normal(xs, 48, 1.0);
    {
        mgpu_tensor* x = tfrom(cpu, mgpu_shape2(8, 6), xs);
        mgpu_tensor* y = tfrom_i32(cpu, mgpu_shape1(8), ys);
        MUST(mgpu_model_train_step(m, o, x, y, NULL));   /* leaves its reduced gradients in place */
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
    }
    {
        int r, i, ok = 1;
        for (r = 0; r < 2; ++r) {
            float* flat = get_flat(m, r);
            float* grads = get_grads(m, r);
            for (i = 0; i < mgpu_model_tensor_count(m); ++i) {
                const char* name = mgpu_model_tensor_name(m, i);
                mgpu_tensor* p = mgpu_model_param(m, r, name);
                mgpu_tensor* g = mgpu_model_grad(m, r, name);
                float* h = fbuf(tnumel(m, i));
                ok &= p == mgpu_model_tensor(m, r, i) && g && mgpu_shape_equal(mgpu_tensor_shape(g), mgpu_tensor_shape(p));
                if (!p || !g) { free(h); ok = 0; continue; }
                tget(g, h);
                ok &= same_bits(h, grads + toff(m, i), (size_t)tnumel(m, i) * 4);
                tget(p, h);
                ok &= same_bits(h, flat + toff(m, i), (size_t)tnumel(m, i) * 4);
                free(h);
            }
            free(flat);
            free(grads);
        }
        CHECK(ok, "every parameter and gradient by name is its slice of the flat buffers, on both replicas");
    }
    {   /* a view is the model's storage: writing it writes the parameter */
        float b[3] = {1.5f, -2.5f, 3.5f};
        float* flat;
        MUST(mgpu_tensor_upload(mgpu_model_param(m, 1, "2.bias"), b, sizeof b));
        flat = get_flat(m, 1);
        CHECK(same_bits(flat + toff(m, 3), b, sizeof b), "writing mgpu_model_param writes the model");
        free(flat);
    }
    expect_null(mgpu_model_grad(m, 0, "1.weight"), MGPU_ERROR_INVALID_ARGUMENT, "an unknown name", "mgpu_model_grad",
                "no parameter '1.weight'", "'0.weight', '0.bias', '2.weight', '2.bias'");
    expect_null(mgpu_model_param(m, 0, "weight"), MGPU_ERROR_INVALID_ARGUMENT, "a bare name", "mgpu_model_param", "'weight'", NULL);
    expect_null(mgpu_model_param(m, 0, NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL name", "mgpu_model_param", "NULL name", NULL);
    expect_null(mgpu_model_grad(m, 2, "0.weight"), MGPU_ERROR_INVALID_ARGUMENT, "replica 2 of 2", "mgpu_model_grad", "replica 2",
                "with 2");
    expect_null(mgpu_model_grad(NULL, 0, "0.weight"), MGPU_ERROR_INVALID_ARGUMENT, "a NULL model", "mgpu_model_grad", "NULL model", NULL);
    /* the index getters say what is wrong too */
    expect_null(mgpu_model_params(m, 2), MGPU_ERROR_INVALID_ARGUMENT, "params of replica 2", "mgpu_model_params", "replica 2", NULL);
    expect_null(mgpu_model_params(m, -1), MGPU_ERROR_INVALID_ARGUMENT, "params of replica -1", "mgpu_model_params", "replica -1", NULL);
    expect_null(mgpu_model_grads(m, 5), MGPU_ERROR_INVALID_ARGUMENT, "grads of replica 5", "mgpu_model_grads", "replica 5", NULL);
    expect_null(mgpu_model_tensor(m, 0, 4), MGPU_ERROR_INVALID_ARGUMENT, "tensor 4 of 4", "mgpu_model_tensor", "tensor 4", "with 4");
    expect_null(mgpu_model_tensor(m, 3, 0), MGPU_ERROR_INVALID_ARGUMENT, "tensor of replica 3", "mgpu_model_tensor", "replica 3", NULL);
    expect_null(mgpu_model_tensor_name(m, -1), MGPU_ERROR_INVALID_ARGUMENT, "name of tensor -1", "mgpu_model_tensor_name", "tensor -1",
                NULL);
    expect_null(mgpu_model_tensor_name(NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "name from a NULL model", "mgpu_model_tensor_name",
                "NULL model", NULL);
    expect_null(mgpu_model_params(NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "params of a NULL model", "mgpu_model_params", "NULL model",
                NULL);
done:
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set2);
}

/* ============================================================================================ */
/* 13. the API a harness needs: optimizer state by name, and a reset                            */
/* ============================================================================================ */
/* state `state` of parameter `param` on replica r, downloaded (NULL when there is none) */
static float* get_state(mgpu_optimizer* o, int r, const char* param, const char* state, int64_t* n) {
    mgpu_tensor* t = mgpu_optimizer_state(o, r, param, state);
    float* h;
    if (!t) { CHECK(0, "mgpu_optimizer_state(%d, %s, %s): %s", r, param, state, mgpu_last_error()); return NULL; }
    *n = mgpu_tensor_numel(t);
    h = fbuf(*n);
    tget(t, h);
    return h;
}

static void test_optimizer_state(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_device_set* set2 = mgpu_device_set_create("cpu:2");
    mgpu_optimizer_desc d;
    mgpu_model *m = NULL, *m2 = NULL;
    mgpu_optimizer *o = NULL, *o2 = NULL;
    mgpu_tensor *x = NULL, *y = NULL;
    float xs[8 * 6];
    int32_t ys[8] = {0, 1, 2, 0, 1, 2, 0, 1};
    int64_t n = 0, i;
    float *s, *g, *s1, *p1, *p2;
    char path[512];
    header("13. optimizer state by name, reset");
    rnd_normal(xs, 48, 1.0);
    x = tfrom(cpu, mgpu_shape2(8, 6), xs);
    y = tfrom_i32(cpu, mgpu_shape1(8), ys);
    if (!set2) goto done;

    /* SGD with momentum on two replicas: the buffer is zero, then the first gradient (PyTorch's
       first step), then momentum * buffer + gradient */
    d = odesc(MGPU_SGD, 0.1f);
    d.momentum = 0.9f;
    m = MODEL(mgpu_shape1(6), set2, MGPU_LOSS_CROSS_ENTROPY, 51, mgpu_layer_linear(6, 12), mgpu_layer_relu(), mgpu_layer_linear(12, 3));
    o = m ? mgpu_optimizer_create(m, &d) : NULL;
    if (!m || !o) goto done;
    s = get_state(o, 1, "0.weight", "momentum_buffer", &n);
    if (s) {
        int64_t nz = 0;
        for (i = 0; i < n; ++i) nz += s[i] != 0.0f;
        CHECK(n == 72 && nz == 0, "before the first step the momentum buffer is 72 zeros (%lld nonzero)", (long long)nz);
    }
    free(s);
    CHECK(mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer") == mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer"),
          "the same view on every call (owned by the optimizer)");
    MUST(mgpu_model_train_step(m, o, x, y, NULL));
    s = get_state(o, 1, "2.weight", "momentum_buffer", &n);
    g = fbuf(36);
    tget(mgpu_model_grad(m, 1, "2.weight"), g);
    CHECK(s && same_bits(s, g, 36 * 4), "after the first step the momentum buffer is the gradient");
    s1 = s;
    MUST(mgpu_model_train_step(m, o, x, y, NULL));
    s = get_state(o, 0, "2.weight", "momentum_buffer", &n);
    tget(mgpu_model_grad(m, 0, "2.weight"), g);
    if (s && s1) {
        double err = 0.0;
        /* a comparison, not err = fmax(err, ...): Debian 12's aarch64-linux-gnu-gcc 12.2 -O2 stops with an
           internal compiler error (vect_transform_reduction) on an fmax reduction of a widened float
           over a constant count that 4 divides (make test-aarch64); for a NaN both keep err */
        for (i = 0; i < 36; ++i) {
            /* (relative to the terms: 0.9 * s1 and its sum with g each round once in float, and a sum
               that cancels is small beside its rounding) */
            const double e = fabs((double)s[i] - (0.9 * s1[i] + g[i])) / fmax(fabs(0.9 * s1[i]) + fabs(g[i]), 1e-6);
            if (e > err) err = e;
        }
        CHECK(err < 1e-6, "after the second step: 0.9 * buffer + gradient (rel err %.3g)", err);
    }
    free(s); free(s1); free(g);
    expect_null(mgpu_optimizer_state(o, 0, "0.weight", "exp_avg"), MGPU_ERROR_INVALID_ARGUMENT, "exp_avg of SGD",
                "mgpu_optimizer_state", "SGD keeps momentum_buffer", "not 'exp_avg'");
    expect_null(mgpu_optimizer_state(o, 0, "0.weights", "momentum_buffer"), MGPU_ERROR_INVALID_ARGUMENT, "an unknown parameter",
                "mgpu_optimizer_state", "no parameter '0.weights'", NULL);
    expect_null(mgpu_optimizer_state(o, 2, "0.weight", "momentum_buffer"), MGPU_ERROR_INVALID_ARGUMENT, "replica 2 of 2",
                "mgpu_optimizer_state", "replica 2", NULL);
    expect_null(mgpu_optimizer_state(o, 0, "0.weight", NULL), MGPU_ERROR_INVALID_ARGUMENT, "a NULL state name",
                "mgpu_optimizer_state", "NULL state", NULL);
    expect_null(mgpu_optimizer_state(NULL, 0, "0.weight", "exp_avg"), MGPU_ERROR_INVALID_ARGUMENT, "a NULL optimizer",
                "mgpu_optimizer_state", "NULL optimizer", NULL);
    /* writing the view sets the state, and the checkpoint saves it */
    {
        float b[3] = {0.25f, -0.5f, 4.0f};
        MUST(mgpu_tensor_upload(mgpu_optimizer_state(o, 0, "2.bias", "momentum_buffer"), b, sizeof b));
        tpath(path, sizeof path, "state.safetensors");
        MUST(mgpu_model_save(m, o, path));
        check_st_tensor(path, "optimizer.2.bias.momentum_buffer", "[3]", b, 3);
    }
    /* reset: zero state, step 0; the next step is a fresh optimizer's, bit for bit */
    MUST(mgpu_optimizer_reset(o));
    CHECK(mgpu_optimizer_step_count(o) == 0, "reset: step count %lld", (long long)mgpu_optimizer_step_count(o));
    s = get_state(o, 1, "0.bias", "momentum_buffer", &n);
    if (s) {
        int64_t nz = 0;
        for (i = 0; i < n; ++i) nz += s[i] != 0.0f;
        CHECK(nz == 0, "reset zeroes the state on every replica (%lld nonzero)", (long long)nz);
    }
    free(s);
    m2 = MODEL(mgpu_shape1(6), set2, MGPU_LOSS_CROSS_ENTROPY, 52, mgpu_layer_linear(6, 12), mgpu_layer_relu(), mgpu_layer_linear(12, 3));
    o2 = m2 ? mgpu_optimizer_create(m2, &d) : NULL;
    if (m2 && o2) {
        p1 = get_flat(m, 0);
        put_flat(m2, 0, p1);
        put_flat(m2, 1, p1);
        free(p1);
        MUST(mgpu_model_train_step(m, o, x, y, NULL));
        MUST(mgpu_model_train_step(m2, o2, x, y, NULL));
        MUST(mgpu_model_train_step(m, o, x, y, NULL));
        MUST(mgpu_model_train_step(m2, o2, x, y, NULL));
        p1 = get_flat(m, 1);
        p2 = get_flat(m2, 1);
        CHECK(same_bits(p1, p2, (size_t)flat_n(m) * 4), "after a reset the optimizer steps as a fresh one");
        free(p1); free(p2);
    }
    expect_fail(mgpu_optimizer_reset(NULL), MGPU_ERROR_INVALID_ARGUMENT, "reset NULL", "mgpu_optimizer_reset", "NULL", NULL);
    mgpu_optimizer_destroy(o); o = NULL;
    mgpu_optimizer_destroy(o2); o2 = NULL;
    mgpu_model_destroy(m2); m2 = NULL;

    /* SGD without momentum keeps nothing */
    d = odesc(MGPU_SGD, 0.1f);
    o = mgpu_optimizer_create(m, &d);
    if (o) {
        expect_null(mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer"), MGPU_ERROR_INVALID_ARGUMENT, "plain SGD",
                    "mgpu_optimizer_state", "SGD without momentum keeps no state", NULL);
        MUST(mgpu_optimizer_reset(o));
    }
    mgpu_optimizer_destroy(o); o = NULL;

    /* AdamW: exp_avg and exp_avg_sq after one step are (1 - beta1) g and (1 - beta2) g^2 */
    d = odesc(MGPU_ADAMW, 1e-3f);
    o = mgpu_optimizer_create(m, &d);
    if (o) {
        float* v;
        MUST(mgpu_model_train_step(m, o, x, y, NULL));
        s = get_state(o, 0, "0.bias", "exp_avg", &n);
        v = get_state(o, 1, "0.bias", "exp_avg_sq", &n);
        g = fbuf(12);
        tget(mgpu_model_grad(m, 0, "0.bias"), g);
        if (s && v) {
            double err = 0.0;
            const float one_minus_b1 = 1.0f - 0.9f, one_minus_b2 = 1.0f - 0.999f;   /* as the optimizer rounds them */
            for (i = 0; i < 12; ++i) {
                err = fmax(err, fabs(s[i] - (double)one_minus_b1 * g[i]) / fmax(fabs((double)one_minus_b1 * g[i]), 1e-12));
                err = fmax(err, fabs(v[i] - (double)one_minus_b2 * g[i] * g[i]) / fmax((double)one_minus_b2 * g[i] * g[i], 1e-20));
            }
            CHECK(err < 1e-6, "AdamW's exp_avg and exp_avg_sq after one step (rel err %.3g)", err);
        }
        free(s); free(v); free(g);
        expect_null(mgpu_optimizer_state(o, 0, "0.bias", "momentum_buffer"), MGPU_ERROR_INVALID_ARGUMENT, "momentum_buffer of AdamW",
                    "mgpu_optimizer_state", "AdamW keeps exp_avg and exp_avg_sq", NULL);
        MUST(mgpu_optimizer_reset(o));
        s = get_state(o, 0, "2.weight", "exp_avg_sq", &n);
        if (s) {
            int64_t nz = 0;
            for (i = 0; i < n; ++i) nz += s[i] != 0.0f;
            CHECK(nz == 0 && mgpu_optimizer_step_count(o) == 0, "AdamW reset (%lld nonzero)", (long long)nz);
        }
        free(s);
    }
done:
    mgpu_optimizer_destroy(o);
    mgpu_optimizer_destroy(o2);
    mgpu_model_destroy(m);
    mgpu_model_destroy(m2);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_device_set_destroy(set2);
}

/* the same on a GPU: a file's tensor read onto it, gradients and optimizer state by name there */
static void test_harness_api_cuda(void) {
#ifdef MGPU_CUDA
    if (g_gpu) {
        mgpu_device* cpu = mgpu_device_cpu();
        mgpu_model* m = MODEL(mgpu_shape1(6), g_gpu_set, MGPU_LOSS_CROSS_ENTROPY, 61, mgpu_layer_linear(6, 12), mgpu_layer_relu(),
                              mgpu_layer_linear(12, 3));
        mgpu_optimizer_desc d = odesc(MGPU_SGD, 0.1f);
        mgpu_optimizer* o;
        float xs[8 * 6];
        int32_t ys[8] = {0, 1, 2, 0, 1, 2, 0, 1};
        char path[512];
        d.momentum = 0.9f;
        o = m ? mgpu_optimizer_create(m, &d) : NULL;
        if (m && o) {
            mgpu_tensor *x, *y, *g, *b, *p, *r;
            mgpu_safetensors* st;
            float hg[72], hb[72], hp[72], hr[72];
            rnd_normal(xs, 48, 1.0);
            x = tfrom(cpu, mgpu_shape2(8, 6), xs);
            y = tfrom_i32(cpu, mgpu_shape1(8), ys);
            MUST(mgpu_model_train_step(m, o, x, y, NULL));
            g = mgpu_model_grad(m, 0, "0.weight");
            b = mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer");
            CHECK(g && b && mgpu_tensor_device(g) == g_gpu && mgpu_tensor_device(b) == g_gpu, "views by name live on the GPU");
            if (g && b) {
                tget(g, hg);
                tget(b, hb);
                CHECK(same_bits(hg, hb, sizeof hg), "cuda: after the first step the momentum buffer is the gradient");
            }
            tpath(path, sizeof path, "gpu_read.safetensors");
            MUST(mgpu_model_save(m, o, path));
            st = mgpu_safetensors_open(path);
            r = st ? mgpu_safetensors_read(st, "0.weight", g_gpu) : NULL;
            p = mgpu_model_param(m, 0, "0.weight");
            CHECK(r && mgpu_tensor_device(r) == g_gpu, "mgpu_safetensors_read onto the GPU: %s", mgpu_last_error());
            if (r && p) {
                tget(r, hr);
                tget(p, hp);
                CHECK(same_bits(hr, hp, sizeof hr), "cuda: the tensor read onto the GPU is the saved parameter");
            }
            MUST(mgpu_optimizer_reset(o));
            if (b) {
                int i, nz = 0;
                tget(b, hb);
                for (i = 0; i < 72; ++i) nz += hb[i] != 0.0f;
                CHECK(nz == 0, "cuda: reset zeroes the state (%d nonzero)", nz);
            }
            mgpu_tensor_destroy(r);
            mgpu_safetensors_close(st);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
            remove(path);
        }
        mgpu_optimizer_destroy(o);
        mgpu_model_destroy(m);
        return;
    }
#endif
    gpu_group_note("reader, gradients and optimizer state by name");
}

/* ============================================================================================ */
/* 14. errors that name their true source (issue 37)                                            */
/* ============================================================================================ */
/* A custom layer whose output_shape gives a shape no tensor has: its user data picks the fault. */
static mgpu_result badshape_output_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    const int fault = *(const int*)mgpu_layer_user_data(l);
    *y = x;
    if (fault == 0) y->dim[1] = -5;           /* negative */
    else if (fault == 1) y->ndim = 7;         /* more than MGPU_MAX_DIMS */
    else if (fault == 2) y->dim[1] = 0;       /* no features */
    return MGPU_OK;
}
static mgpu_result badshape_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)ctx;
    return mgpu_tensor_copy(y, x);
}
static mgpu_result badshape_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                     const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y;
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static const mgpu_layer_vtable badshape_vt = {
    "BadShape", badshape_output_shape, NULL, NULL, NULL, NULL, NULL, badshape_forward, badshape_backward, NULL, NULL, NULL, NULL
};

/* A layer's output_shape giving a negative dimension, 7 dimensions or no features is refused by
   mgpu_model_create, naming the layer's index, its type and output_shape (not a tensor's creation
   in every step); a checkpoint of Linear,ReLU,Linear does not load into Linear,Tanh,Linear (both
   lists named, and the first layer that differs) unless mgpu_load_desc.weights_only says so, and a
   file without mgpu.layers (PyTorch's) loads. */
static void test_true_sources(void) {
    static int faults[3] = { 0, 1, 2 };
    static const char* says[3] = { "[1,-5]", "7 dimensions", "[1,0]" };
    char path[512], bare[512];
    int f;
    mgpu_model *a, *b;
    header("14. errors that name their true source");
    for (f = 0; f < 3; ++f) {
        mgpu_model* m;
        mgpu_clear_error();
        m = TRY_MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_MSE, 1, mgpu_layer_linear(4, 4), mgpu_layer_relu(),
                      mgpu_layer_create(&badshape_vt, &faults[f]));
        expect_null(m, MGPU_ERROR_INVALID_ARGUMENT, says[f], "mgpu_model_create: layer 2 (BadShape)", "output_shape", says[f]);
        mgpu_model_destroy(m);
    }
    a = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_MSE, 1, mgpu_layer_linear(4, 8), mgpu_layer_relu(), mgpu_layer_linear(8, 2));
    b = MODEL(mgpu_shape1(4), NULL, MGPU_LOSS_MSE, 2, mgpu_layer_linear(4, 8), mgpu_layer_tanh(), mgpu_layer_linear(8, 2));
    tpath(path, sizeof path, "arch.safetensors");
    tpath(bare, sizeof bare, "arch_bare.safetensors");
    if (a && b && mgpu_model_save(a, NULL, path) == MGPU_OK) {
        mgpu_load_desc ld;
        float* before = get_flat(b, 0);
        float* after;
        float* want = get_flat(a, 0);
        const int64_t n = flat_n(b);
        mgpu_safetensors* st;
        expect_fail(mgpu_model_load(b, NULL, path), MGPU_ERROR_BAD_FILE, "Linear,ReLU,Linear into Linear,Tanh,Linear",
                    "mgpu_model_load", "Linear,ReLU,Linear", "Linear,Tanh,Linear");
        CHECK(strstr(mgpu_last_error(), "layer 1: ReLU there, Tanh here") && strstr(mgpu_last_error(), "weights_only"),
              "the message names the first difference and the way out: %s", mgpu_last_error());
        after = get_flat(b, 0);
        CHECK(same_bits(before, after, (size_t)n * sizeof(float)), "a refused load changed the model");
        free(after);
        memset(&ld, 0, sizeof ld);
        ld.weights_only = 1;
        CHECK(mgpu_model_load_ex(b, NULL, path, &ld) == MGPU_OK, "weights_only: %s", mgpu_last_error());
        after = get_flat(b, 0);
        CHECK(same_bits(want, after, (size_t)n * sizeof(float)), "weights_only: the file's parameters");
        free(after);
        CHECK(mgpu_model_load(a, NULL, path) == MGPU_OK, "the same architecture: %s", mgpu_last_error());
        st = mgpu_safetensors_open(path);
        CHECK(st && mgpu_safetensors_metadata(st, "mgpu.layers") && !strcmp(mgpu_safetensors_metadata(st, "mgpu.layers"),
              "Linear,ReLU,Linear"), "the saver records mgpu.layers");
        mgpu_safetensors_close(st);
        {   /* a file without mgpu.layers, as PyTorch writes them */
            const st_item items[4] = { { "0.weight", "F32", 2, { 8, 4 }, 8 * 4 * 4 }, { "0.bias", "F32", 1, { 8 }, 8 * 4 },
                                       { "2.weight", "F32", 2, { 2, 8 }, 2 * 8 * 4 }, { "2.bias", "F32", 1, { 2 }, 2 * 4 } };
            CHECK(write_st(bare, items, 4, "\"format\":\"pt\""), "writing %s", bare);
            CHECK(mgpu_model_load(b, NULL, bare) == MGPU_OK, "a file without mgpu.layers loads: %s", mgpu_last_error());
        }
        free(before);
        free(want);
    } else CHECK(0, "models and a checkpoint: %s", mgpu_last_error());
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
}

/* ---- cuBLASLt's epilogues on a GPU (mgpu__fuse_plan) ---- */
#ifdef MGPU_CUDA
/* An MLP of three Linear + ReLU pairs and a Linear, trained `steps` SGD steps on one batch with
   MGPU_EPILOGUES `setting`; its parameters, and the emulator's counts of the last step. */
static float* epilogue_run(const char* spec, mgpu_dtype precision, int stages, int micro_batches, int in, int batch, int setting,
                           int steps, mgpu_emu_counters_t* last_step, int64_t* n) {
    const mgpu_optimizer_desc od = { .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f };
    mgpu_device_set* devs = mgpu_device_set_create(spec);
    mgpu_model* m = devs ? model_from((mgpu_model_desc){ .input = mgpu_shape1(in), .devices = devs, .loss = MGPU_LOSS_CROSS_ENTROPY,
                                                         .seed = 77, .stages = stages, .micro_batches = micro_batches,
                                                         .precision = precision },
                                      (mgpu_layer*[]){ mgpu_layer_linear(in, 24), mgpu_layer_relu(), mgpu_layer_linear(24, 16),
                                                       mgpu_layer_relu(), mgpu_layer_linear(16, 16), mgpu_layer_relu(),
                                                       mgpu_layer_linear(16, 7) }, 7)
                             : NULL;
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, &od) : NULL;
    mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(batch, in)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(batch));
    emu_counters_fn counters = emu_counters();
    mgpu_emu_counters_t before;
    float* params = NULL;
    int i;
    CHECK(devs && o, "epilogues on %s: %s", spec, mgpu_last_error());
    mgpu__epilogue_setting = setting;
    mgpu__fuse_relu_setting = 1;
    if (o && x && y) {
        MUST(mgpu_rand_normal(x, 5, 0, 0.0f, 1.5f));
        for (i = 0; i < batch; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (i * 5) % 7;
        for (i = 0; i < steps; ++i) {
            if (i == steps - 1 && counters) counters(&before);
            MUST(mgpu_model_train_step(m, o, x, y, NULL));
            MUST(mgpu_device_synchronize(mgpu_device_set_get(devs, 0)));
        }
        if (counters && last_step) {
            counters(last_step);
            last_step->launches -= before.launches;
            last_step->gemms -= before.gemms;
            last_step->lt_heuristics -= before.lt_heuristics;
        }
        if (setting && stages == 1 && micro_batches == 1) {   /* what ran in the GEMMs (on a GPU: whether cuBLASLt had algorithms) */
            const mgpu__slot* sl = &m->part[0].slot[0];
            int relu = 0, drelu = 0;
            for (i = 0; i < m->layer_count; ++i) {
                relu += (sl->fused[i] & MGPU__FUSED_RELU) != 0;
                drelu += (sl->fused[i] & MGPU__FUSED_DRELU) != 0;
            }
            printf("  %s %s: ReLUs in the Linears' GEMMs %d of 3, ReLU backwards in the next Linear's %d of 3\n", spec,
                   mgpu_dtype_name(precision), relu, drelu);
            /* (bf16: cuBLASLt's bias is of D's type, and mgpu's biases stay f32, so no bf16 Linear adds
               its bias in the GEMM: it runs the separate kernels) */
            if (emu_counters() && !getenv("MGPU_EMU_NO_LT"))
                CHECK(precision == MGPU_BF16 ? relu == 0 && drelu == 0 : relu == 3 && drelu == 3,
                      "epilogues on %s %s: %d ReLUs and %d ReLU backwards in GEMMs, want %d and %d", spec, mgpu_dtype_name(precision),
                      relu, drelu, precision == MGPU_BF16 ? 0 : 3, precision == MGPU_BF16 ? 0 : 3);
        }
        /* the 8 tensors in turn (a pipelined model's flat buffer is per stage) */
        *n = 0;
        params = fbuf(mgpu_model_param_count(m));
        for (i = 0; i < 8; ++i) {
            const mgpu_tensor* t = mgpu_model_tensor(m, 0, i);
            CHECK(t != NULL, "epilogues: tensor %d: %s", i, mgpu_last_error());
            if (!t) break;
            tget(t, params + *n);
            *n += mgpu_tensor_numel(t);
        }
    }
    mgpu__epilogue_setting = mgpu__fuse_relu_setting = -1;
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(devs);
    return params;
}
static double max_rel_diff(const float* a, const float* b, int64_t n) {
    double worst = 0.0, scale = 1e-30;
    int64_t i;
    for (i = 0; i < n; ++i) scale = fmax(scale, fabs((double)b[i]));
    for (i = 0; i < n; ++i) worst = fmax(worst, fabs((double)a[i] - (double)b[i]) / scale);
    return worst;
}
#endif
/* With MGPU_FUSE_RELU on (the ReLUs in the GEMMs too), the same training with the epilogues as
   with the separate kernels, within rounding: f32 1e-5
   of the largest parameter (the bias gradients are sums in another order); bf16 5e-3 (such a
   difference can move a weight's bf16 copy by one unit in its last place, 2^-8 relative, in a
   later step's product). One GPU, two replicas, two stages with two micro-batches (the second
   adds to the gradients the first wrote); with no algorithm from cuBLASLt (MGPU_EMU_NO_LT) the
   separate kernels run with the gradients still written fresh. On emulated GPUs, a step of the
   MLP issues no kernel besides its GEMMs but the loss's and the optimizer's (no bias, ReLU, ReLU
   backward or bias gradient kernel, no zeroing of the gradients) and asks cuBLASLt's heuristic
   nothing after the first step. */
static void test_epilogues(void) {
    header("cuBLASLt epilogues");
#ifdef MGPU_CUDA
    if (!test_gpu_group("epilogues", g_gpu != NULL)) return;
    {
        /* the last: 3 features and micro-batches of 3 and 2 rows, so the second's x starts 36 bytes
           into the batch (cuBLASLt told of its alignment, or a GPU refuses it) */
        static const struct { const char* spec; mgpu_dtype precision; int stages, micro, in, batch; double tol; } runs[] = {
            { "cuda:0", MGPU_F32, 1, 1, 20, 12, 1e-5 }, { "cuda:0,0", MGPU_F32, 1, 1, 20, 12, 1e-5 },
            { "cuda:0,0", MGPU_F32, 2, 2, 20, 12, 1e-5 }, { "cuda:0", MGPU_BF16, 1, 1, 20, 12, 5e-3 },
            { "cuda:0", MGPU_F32, 1, 2, 3, 5, 1e-5 },
        };
        size_t r;
        for (r = 0; r < sizeof runs / sizeof runs[0]; ++r) {
            int64_t n = 0, n2 = 0;
            mgpu_emu_counters_t c;
            float* on = epilogue_run(runs[r].spec, runs[r].precision, runs[r].stages, runs[r].micro, runs[r].in, runs[r].batch, 1, 6,
                                     &c, &n);
            float* off = epilogue_run(runs[r].spec, runs[r].precision, runs[r].stages, runs[r].micro, runs[r].in, runs[r].batch, 0, 6,
                                      NULL, &n2);
            if (on && off && n == n2) {
                const double e = max_rel_diff(on, off, n);
                CHECK(e <= runs[r].tol, "epilogues on %s (%s, %d stages, %d micro-batches): parameters differ from the separate "
                      "kernels' by %.3g (limit %.0e)", runs[r].spec, mgpu_dtype_name(runs[r].precision), runs[r].stages,
                      runs[r].micro, e, runs[r].tol);
                printf("  %-10s %-5s %d stage(s), %d micro-batch(es), %d features: epilogues against separate kernels, rel diff %.3g\n",
                       runs[r].spec, mgpu_dtype_name(runs[r].precision), runs[r].stages, runs[r].micro, runs[r].in, e);
            } else CHECK(0, "epilogues on %s: no parameters", runs[r].spec);
            if (on && emu_counters()) {   /* one GPU: 4 GEMMs forward, 7 backward; the loss's kernels and the optimizer's */
                CHECK(r > 0 || getenv("MGPU_EMU_NO_LT") || (c.gemms == 11 && c.launches - c.gemms <= 3), "epilogues on %s: a step issued %llu GEMMs and %llu "
                      "other kernels (want 11, and the loss's and the optimizer's alone: at most 3)", runs[r].spec,
                      (unsigned long long)c.gemms, (unsigned long long)(c.launches - c.gemms));
                CHECK(c.lt_heuristics == 0,
                      "epilogues on %s: the sixth step asked cuBLASLt's heuristic %llu times (want 0: cached)", runs[r].spec,
                      (unsigned long long)c.lt_heuristics);
                printf("  %s step: %llu GEMMs, %llu other kernels, %llu heuristic queries\n", runs[r].spec, (unsigned long long)c.gemms,
                       (unsigned long long)(c.launches - c.gemms), (unsigned long long)c.lt_heuristics);
            }
            if (r == 0 && on && emu_counters()) {   /* cuBLASLt without an algorithm */
                float* none;
                test_setenv("MGPU_EMU_NO_LT", "1");
                none = epilogue_run(runs[r].spec, MGPU_F32, 1, 1, 20, 12, 1, 6, &c, &n2);
                test_unsetenv("MGPU_EMU_NO_LT");
                if (none && off && n == n2) {
                    const double e = max_rel_diff(none, off, n);
                    CHECK(e <= 1e-5 && c.launches - c.gemms > 3, "epilogues without an algorithm: parameters differ from the "
                          "separate kernels' by %.3g, %llu kernels besides the GEMMs", e, (unsigned long long)(c.launches - c.gemms));
                }
                free(none);
            }
            free(on);
            free(off);
        }
    }
#else
    gpu_group_note("epilogues");
#endif
}

int main(int argc, char** argv) {
    double t0 = test_start("test_model");
    test_select(argc, argv);
    printf("test_model: mgpu %s, seed %llu (MGPU_TEST_SEED to repeat)%s, %d CPU threads\n", MGPU_VERSION_STRING,
           (unsigned long long)g_test_seed, g_quick ? ", quick sizes" : "", mgpu_cpu_threads());
#ifdef MGPU_CUDA
    if (mgpu_cuda_device_count() > 0) {
        g_gpu_set = mgpu_device_set_create("cuda:0");
        CHECK(g_gpu_set != NULL, "mgpu_device_set_create(\"cuda:0\") with %d GPUs: %s", mgpu_cuda_device_count(),
              mgpu_last_error());
        if (g_gpu_set) g_gpu = mgpu_device_set_get(g_gpu_set, 0);
    }
    printf("built with CUDA: %d GPU(s)%s\n", mgpu_cuda_device_count(), g_gpu ? ", testing cuda:0" : "");
#else
    printf("built without CUDA\n");
#endif
    snprintf(g_tmpdir, sizeof g_tmpdir, "%s/mgpu_test_model.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!test_mkdtemp(g_tmpdir, sizeof g_tmpdir)) {
        CHECK(0, "mkdtemp(%s): %s", g_tmpdir, strerror(errno));
        return test_summary("test_model");
    }

    TEST_GROUP(test_gradients());
    TEST_GROUP(test_init());
    TEST_GROUP(test_model_errors());
    TEST_GROUP(test_getter_errors());
    TEST_GROUP(test_custom_layer());
    TEST_GROUP(test_optimizers());
    TEST_GROUP(test_optim_groups_clip());
    TEST_GROUP(test_training());
    TEST_GROUP(test_checkpoints());
    TEST_GROUP(test_data());
    TEST_GROUP(test_cuda_twins());
    TEST_GROUP(test_review_regressions());
    TEST_GROUP(test_load_ex());
    TEST_GROUP(test_load_save_dtypes());
    TEST_GROUP(test_user_metadata());
    TEST_GROUP(test_named_views());
    TEST_GROUP(test_optimizer_state());
    TEST_GROUP(test_harness_api_cuda());
    TEST_GROUP(test_true_sources());
    TEST_GROUP(test_activation_memory());
    TEST_GROUP(test_bf16_models());
    TEST_GROUP(test_epilogues());

    remove_tree(g_tmpdir);
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_model");
}
