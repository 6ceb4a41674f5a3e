#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_seq.c - sequences and the layers of a transformer (issue "Models beyond a stack").

   1. sequences: int32 token inputs [B, T], targets per position with the ignore index, Linear on
      [..., D], cross-entropy over every target that is not ignored, data-parallel splits by whole
      sequences (cpu:N against one device)
   2. LayerNorm, Embedding, the position embedding and GELU's tanh form: forward against float64
      loops, gradients against central finite differences, CUDA kernels against the CPU
   3. causal multi-head self-attention: the same checks
   4. containers (sequential, residual) and calling a layer from a layer of your own
   5. layer names (Hugging Face's), tied parameters, Linear without a bias, Conv1D
   6. a GPT (examples/gpt.c's layers) in 4 pipeline stages and as a CUDA graph, bit for bit
   7. BatchNorm2d (training and evaluation against float64, gradients, running statistics by
      PyTorch's rule), buffers (cpu:2 replicas verified every step, save and load), global
      average pooling
   8. NaN and Inf never hidden: ReLU forward and backward, MaxPool2d, argmax, accuracy and
      cross-entropy against PyTorch's values; a NaN weight makes the loss NaN; desc.check_finite
      refuses a step with a NaN or Inf loss or gradient and updates nothing

   Each group's GPU part runs on cuda:0 (real or emulated) and reports a skip without one (a
   failure with MGPU_TEST_REQUIRE_GPU=1). MGPU_TEST_QUICK=1 uses smaller sizes. */

#include <stdint.h>

/* ============================================================================================ */
/* globals and helpers                                                                          */
/* ============================================================================================ */
#ifdef MGPU_CUDA
static mgpu_device_set* g_gpu_set;
#endif
static mgpu_device* g_gpu;   /* cuda:0, or NULL */

/* A group's GPU part: 1 when a GPU runs it, else one skip (or failure) naming the group. */
static int gpu_part(const char* group) { return test_gpu_group(group, g_gpu != NULL); }

/* ============================================================================================ */
/* 1. sequences                                                                                 */
/* ============================================================================================ */
/* A token model made here: x int32 ids [B, T] (vocabulary V) -> OneHot [B, T, V] (a layer of the
   test's own, so that the plumbing is tested apart from the Embedding) -> Linear(V, H) -> ReLU ->
   Linear(H, V), cross-entropy per position. */
enum { SEQ_T = 5, SEQ_V = 7, SEQ_H = 6 };
static mgpu_result onehot_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) {
    (void)l;
    if (x.ndim != 2) return mgpu_fail(MGPU_ERROR_SHAPE_MISMATCH, "OneHot: want [B, T] ids");
    *y = mgpu_shape3(x.dim[0], x.dim[1], SEQ_V);
    return MGPU_OK;
}
static mgpu_result onehot_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const int64_t n = mgpu_tensor_numel(x);
    int32_t* ids = (int32_t*)xmalloc((size_t)n * sizeof(int32_t));
    float* h = fbuf(n * SEQ_V);
    int64_t i;
    mgpu_result r;
    (void)l; (void)ctx;
    if ((r = mgpu_tensor_download(x, ids, (size_t)n * sizeof(int32_t))) == MGPU_OK) {
        for (i = 0; i < n; ++i) h[i * SEQ_V + ids[i]] = 1.0f;
        r = mgpu_tensor_upload(y, h, (size_t)n * SEQ_V * sizeof(float));
    }
    free(ids); free(h);
    return r;
}
static mgpu_result onehot_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                   const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y; (void)dy;
    return dx ? mgpu_fail(MGPU_ERROR_INVALID_ARGUMENT, "OneHot: asked for a gradient of token ids") : MGPU_OK;
}
static const mgpu_layer_vtable g_onehot_vt = { "OneHot", onehot_shape, NULL, NULL, NULL, NULL, NULL,
                                               onehot_forward, onehot_backward, NULL, NULL, NULL, NULL };

static mgpu_model* token_model(const mgpu_device_set* set, int micro_batches) {
    mgpu_layer* layers[4];
    mgpu_model* m;
    layers[0] = mgpu_layer_create(&g_onehot_vt, NULL);
    layers[1] = mgpu_layer_linear(SEQ_V, SEQ_H);
    layers[2] = mgpu_layer_relu();
    layers[3] = mgpu_layer_linear(SEQ_H, SEQ_V);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(SEQ_T), .input_dtype = MGPU_I32, .layers = layers,
                                              .layer_count = 4, .devices = set, .seed = 7, .micro_batches = micro_batches });
    CHECK(m != NULL, "token model on %s: %s", set ? mgpu_device_set_spec(set) : "cpu", mgpu_last_error());
    return m;
}

/* float64 loss and gradient of the token model for ids and labels [B, T]: the mean over the
   labels that are not ignored; grads in the flat buffer's order (W1, b1, W2, b2 at their views) */
static double token_reference(mgpu_model* m, const int32_t* ids, const int32_t* lab, int B, double* grad, int64_t nflat) {
    float* flat = fbuf(nflat);
    const mgpu_tensor* w1v = mgpu_model_param(m, 0, "1.weight");
    int64_t o1 = (int64_t)((const char*)mgpu_tensor_data(w1v) - (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
    int64_t ob1 = o1 + SEQ_H * SEQ_V, ow2, ob2;
    double loss = 0.0;
    int count = 0, r, i, j;
    ow2 = (int64_t)((const char*)mgpu_tensor_data(mgpu_model_param(m, 0, "3.weight")) -
                    (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
    ob2 = ow2 + SEQ_V * SEQ_H;
    ob1 = (int64_t)((const char*)mgpu_tensor_data(mgpu_model_param(m, 0, "1.bias")) -
                    (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
    ob2 = (int64_t)((const char*)mgpu_tensor_data(mgpu_model_param(m, 0, "3.bias")) -
                    (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
    tget(mgpu_model_params(m, 0), flat);
    for (i = 0; i < nflat; ++i) grad[i] = 0.0;
    for (r = 0; r < B * SEQ_T; ++r) count += lab[r] != MGPU_IGNORE_INDEX;
    for (r = 0; r < B * SEQ_T; ++r) {
        double pre[SEQ_H], h[SEQ_H], z[SEQ_V], mx = -1e300, s = 0.0, dz[SEQ_V], dh[SEQ_H];
        if (lab[r] == MGPU_IGNORE_INDEX) continue;
        for (j = 0; j < SEQ_H; ++j) {
            pre[j] = (double)flat[o1 + j * SEQ_V + ids[r]] + flat[ob1 + j];
            h[j] = pre[j] > 0 ? pre[j] : 0.0;
        }
        for (i = 0; i < SEQ_V; ++i) {
            z[i] = flat[ob2 + i];
            for (j = 0; j < SEQ_H; ++j) z[i] += (double)flat[ow2 + i * SEQ_H + j] * h[j];
            if (z[i] > mx) mx = z[i];
        }
        for (i = 0; i < SEQ_V; ++i) s += exp(z[i] - mx);
        loss += mx + log(s) - z[lab[r]];
        for (i = 0; i < SEQ_V; ++i) dz[i] = (exp(z[i] - mx) / s - (i == lab[r])) / count;
        for (j = 0; j < SEQ_H; ++j) dh[j] = 0.0;
        for (i = 0; i < SEQ_V; ++i) {
            grad[ob2 + i] += dz[i];
            for (j = 0; j < SEQ_H; ++j) {
                grad[ow2 + i * SEQ_H + j] += dz[i] * h[j];
                dh[j] += dz[i] * flat[ow2 + i * SEQ_H + j];
            }
        }
        for (j = 0; j < SEQ_H; ++j) {
            if (pre[j] <= 0) continue;
            grad[ob1 + j] += dh[j];
            grad[o1 + j * SEQ_V + ids[r]] += dh[j];
        }
    }
    free(flat);
    return count ? loss / count : 0.0;
}

/* One batch accumulated on `spec` (its loss and gradient of replica 0) against the float64
   reference; returns the gradient (caller frees) for comparisons between layouts. */
static int64_t g_token_flat;   /* the token model's flat parameters */
/* (labels_on_gpu: x and the labels on the model's first device, which the step does not read on
   the host; with one replica and one micro-batch the device's mean is the batch's) */
static float* token_batch_on(const char* spec, int micro, const int32_t* ids, const int32_t* lab, int B, float* loss_out,
                             int labels_on_gpu);
static float* token_batch(const char* spec, int micro, const int32_t* ids, const int32_t* lab, int B, float* loss_out) {
    return token_batch_on(spec, micro, ids, lab, B, loss_out, 0);
}
static float* token_batch_on(const char* spec, int micro, const int32_t* ids, const int32_t* lab, int B, float* loss_out,
                             int labels_on_gpu) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model* m;
    mgpu_tensor *x, *y;
    float loss = NAN, *g = NULL;
    double *ref, lref, e;
    int64_t n;
    if (!set) { CHECK(0, "device set %s: %s", spec, mgpu_last_error()); return NULL; }
    m = token_model(set, micro);
    if (!m) { mgpu_device_set_destroy(set); return NULL; }
    n = g_token_flat = mgpu_tensor_numel(mgpu_model_params(m, 0));
    x = tfrom_i32(labels_on_gpu ? mgpu_model_device(m, 0) : mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), ids);
    y = tfrom_i32(labels_on_gpu ? mgpu_model_device(m, 0) : mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), lab);
    ref = dbuf(n);
    lref = token_reference(m, ids, lab, B, ref, n);
    MUST(mgpu_model_accumulate(m, x, y, 0, &loss));
    MUST(mgpu_model_reduce_grads(m));
    g = fbuf(n);
    tget(mgpu_model_grads(m, 0), g);
    CHECK(fabs(loss - lref) <= 1e-5 * fabs(lref) + 1e-7, "%s (M=%d): loss %.9g, float64 %.9g (mean over the labels not ignored)",
          spec, micro, loss, lref);
    e = test_rel_error(g, ref, (size_t)n);
    CHECK(e <= 1e-5, "%s (M=%d): gradient against float64: normalised error %.3g", spec, micro, e);
    {
        float again = NAN;
        MUST(mgpu_model_last_loss(m, &again));
        CHECK(again == loss, "%s: mgpu_model_last_loss %.9g, the step gave %.9g", spec, again, loss);
    }
    *loss_out = loss;
    free(ref);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return g;
}

/* A layer of the test's own that fails, with or without a message of its own. */
static mgpu_result failing_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)ctx; (void)x; (void)y;
    if (mgpu_layer_user_data(l)) return mgpu_fail(MGPU_ERROR_UNSUPPORTED, "Failing: %s", (const char*)mgpu_layer_user_data(l));
    return MGPU_ERROR_UNSUPPORTED;
}
static mgpu_result failing_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                    const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y; (void)dy; (void)dx;
    return MGPU_OK;
}
static const mgpu_layer_vtable g_failing_vt = { "Failing", NULL, NULL, NULL, NULL, NULL, NULL,
                                                failing_forward, failing_backward, NULL, NULL, NULL, NULL };

static void layer_errors(void) {
    mgpu_layer* layers[2];
    mgpu_model* m;
    mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 3));
    int with_message;
    MUST(mgpu_tensor_zero(x));
    for (with_message = 0; with_message < 2; ++with_message) {
        const mgpu_tensor* out;
        layers[0] = mgpu_layer_relu();
        layers[1] = mgpu_layer_create(&g_failing_vt, with_message ? (void*)"no such op here" : NULL);
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 2 });
        CHECK(m != NULL, "model with a failing layer: %s", mgpu_last_error());
        if (!m) continue;
        (void)mgpu_fail(MGPU_ERROR_IO, "an earlier, unrelated failure");
        out = mgpu_model_forward(m, 0, x, 1);
        CHECK(out == NULL && mgpu_last_result() == MGPU_ERROR_UNSUPPORTED, "a layer's MGPU_ERROR_UNSUPPORTED reaches the caller "
              "as %s (%s)", mgpu_result_string(mgpu_last_result()), mgpu_last_error());
        CHECK(strstr(mgpu_last_error(), "layer 1 (Failing)") && !strstr(mgpu_last_error(), "unrelated") &&
              strstr(mgpu_last_error(), with_message ? "no such op here" : "no message"),
              "the layer's own message, or that it gave none, never a stale one: %s", mgpu_last_error());
        mgpu_model_destroy(m);
    }
    /* a creation error names the call once */
    layers[0] = mgpu_layer_linear(4, 2);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 1 });
    CHECK(m == NULL && strstr(mgpu_last_error(), "mgpu_model_create: layer 0") &&
          !strstr(mgpu_last_error(), "mgpu_model_create: mgpu_model_create"), "one prefix: %s", mgpu_last_error());
    mgpu_tensor_destroy(x);
}

static void test_sequences(void) {
    enum { B = 6 };
    int32_t ids[B * SEQ_T], lab[B * SEQ_T];
    float loss1 = 0, loss, *g1, *g;
    const char* specs[] = { "cpu:2", "cpu:3", "cpu:4" };
    int i, s;
    header("1. sequences: token inputs, targets per position, Linear on [..., D]");
    for (i = 0; i < B * SEQ_T; ++i) {
        ids[i] = rng_int(SEQ_V);
        lab[i] = rng_int(SEQ_V);
    }
    /* ignored labels unevenly: all of sample 1's (a replica of cpu:3 and cpu:4 has none of
       its own in some micro-batch), and a few more */
    for (i = 0; i < SEQ_T; ++i) lab[SEQ_T + i] = MGPU_IGNORE_INDEX;
    lab[3] = lab[17] = lab[22] = MGPU_IGNORE_INDEX;
    g1 = token_batch("cpu", 1, ids, lab, B, &loss1);
    for (s = 0; s < 3 && g1; ++s) {
        int micro;
        for (micro = 1; micro <= 2; ++micro) {
            /* N replicas x M micro-batches on B/(NM) sequences each: the one-device gradient (the
               mean over the whole batch's labels, weighted by each part's own count) */
            if (B < (s + 2) * micro) continue;
            g = token_batch(specs[s], micro, ids, lab, B, &loss);
            if (!g) continue;
            CHECK(fabs(loss - loss1) <= 1e-6 * fabs(loss1), "%s M=%d: loss %.9g, one device %.9g", specs[s], micro, loss, loss1);
            {
                double* d1 = dbuf(g_token_flat), e;
                int64_t j;
                for (j = 0; j < g_token_flat; ++j) d1[j] = g1[j];
                e = test_rel_error(g, d1, (size_t)g_token_flat);
                CHECK(e <= 1e-6, "%s M=%d: gradient against one device: normalised error %.3g", specs[s], micro, e);
                free(d1);
            }
            free(g);
        }
    }
    free(g1);
    /* every label ignored: loss 0, no gradient */
    {
        int32_t none[B * SEQ_T];
        for (i = 0; i < B * SEQ_T; ++i) none[i] = MGPU_IGNORE_INDEX;
        g = token_batch("cpu:2", 1, ids, none, B, &loss);
        if (g) {
            int nonzero = 0;
            for (i = 0; i < 16; ++i) nonzero += g[i] != 0.0f;
            CHECK(loss == 0.0f && nonzero == 0, "every label ignored: loss %g, %d nonzero gradients", loss, nonzero);
            free(g);
        }
    }
    /* what the model refuses: float x for token ids, labels of another shape, a label past the vocabulary */
    {
        mgpu_model* m = token_model(NULL, 1);
        mgpu_tensor *xf = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(B, SEQ_T)), *x = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), ids);
        mgpu_tensor *y1 = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(B), lab), *y = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), lab);
        float l;
        if (m) {
            MUST(mgpu_tensor_zero(xf));
            expect_fail(mgpu_model_accumulate(m, xf, y, 0, &l), MGPU_ERROR_DTYPE_MISMATCH, "f32 x for a model of token ids", "x", "i32", NULL);
            expect_fail(mgpu_model_accumulate(m, x, y1, 0, &l), MGPU_ERROR_SHAPE_MISMATCH, "labels [B] for an output [B,T,V]",
                        "target", "[6,5]", NULL);
            lab[4] = SEQ_V;
            tput(y, lab);
            expect_fail(mgpu_model_accumulate(m, x, y, 0, &l), MGPU_ERROR_INVALID_ARGUMENT, "a label past the vocabulary",
                        "label 7", "outside [0, 7)", NULL);
            lab[4] = 0;
            CHECK(mgpu_model_input_grad(m, 0) == NULL, "token ids have no input gradient");
            mgpu_model_destroy(m);
        }
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .input_dtype = MGPU_U8,
                                                  .layers = (mgpu_layer*[]){ mgpu_layer_relu() }, .layer_count = 1 });
        CHECK(m == NULL, "input_dtype u8 refused");
        expect_fail(m ? MGPU_OK : mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "input_dtype u8", "input_dtype", "MGPU_I32", NULL);
        mgpu_model_destroy(m);
        mgpu_tensor_destroy(xf); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y1); mgpu_tensor_destroy(y);
    }
    layer_errors();
    /* the same on a GPU: one batch, loss and gradient within 1e-5 of float64 */
    if (gpu_part("sequences")) {
        g = token_batch("cuda:0", 1, ids, lab, B, &loss);
        free(g);
        g = token_batch_on("cuda:0", 1, ids, lab, B, &loss, 1);   /* the labels on the GPU */
        free(g);
    }
}

/* ============================================================================================ */
/* 2. LayerNorm, Embedding, position embedding, GELU (tanh)                                     */
/* ============================================================================================ */
/* ---- helpers of group 2: a layer run through its vtable by hand, without a model (the struct of
   a layer is visible here: this file holds the implementation) ---- */
#define NE_MUST(expr)                                                                              \
    do {                                                                                          \
        mgpu_result ne_r_ = (expr);                                                               \
        if (ne_r_ != MGPU_OK) CHECK(0, "%s: %s: %s", #expr, mgpu_result_string(ne_r_), mgpu_last_error()); \
    } while (0)

#define NE_AUX_MAX 4   /* BatchNorm2d has 3 */
typedef struct ne_run {
    mgpu_layer* l;
    int np, na;
    mgpu_tensor *p[2], *g[2], *aux[NE_AUX_MAX], *y;
    mgpu_layer_ctx ctx;
} ne_run;

/* parameters (initialised as a model would), zero gradients, aux buffers and y for input xs on dev */
static int ne_open(ne_run* r, mgpu_layer* l, mgpu_device* dev, mgpu_shape xs, uint64_t seed) {
    const mgpu_layer_vtable* vt = l->vt;
    mgpu_shape ys = xs, s;
    mgpu_dtype dt;
    const char* name;
    int i;
    memset(r, 0, sizeof *r);
    r->l = l;
    if (vt->output_shape && vt->output_shape(l, xs, &ys) != MGPU_OK) {
        CHECK(0, "%s output_shape: %s", mgpu_layer_type(l), mgpu_last_error());
        return 0;
    }
    r->np = vt->param_count ? vt->param_count(l) : 0;
    r->na = vt->aux_count ? vt->aux_count(l) : 0;
    if (r->np > 2 || r->na > NE_AUX_MAX) {
        CHECK(0, "%s: %d parameters and %d aux buffers, more than this harness holds", mgpu_layer_type(l), r->np, r->na);
        return 0;
    }
    for (i = 0; i < r->np; ++i) {
        NE_MUST(vt->param_shape(l, i, &name, &s));
        r->p[i] = tmake(dev, MGPU_F32, s);
        r->g[i] = tmake(dev, MGPU_F32, s);
        NE_MUST(mgpu_tensor_zero(r->p[i]));
        NE_MUST(mgpu_tensor_zero(r->g[i]));
    }
    for (i = 0; i < r->na; ++i) {
        NE_MUST(vt->aux_shape(l, i, xs, &dt, &s));
        r->aux[i] = tmake(dev, dt, s);
    }
    r->y = tmake(dev, MGPU_F32, ys);
    r->ctx.device = dev;
    r->ctx.params = r->p;
    r->ctx.grads = r->g;
    r->ctx.aux = r->aux;
    r->ctx.training = 1;
    r->ctx.seed = seed;
    if (vt->init) NE_MUST(vt->init(l, &r->ctx, seed));
    return 1;
}
static void ne_close(ne_run* r) {
    int i;
    for (i = 0; i < 2; ++i) {
        mgpu_tensor_destroy(r->p[i]);
        mgpu_tensor_destroy(r->g[i]);
    }
    for (i = 0; i < NE_AUX_MAX; ++i) mgpu_tensor_destroy(r->aux[i]);
    mgpu_tensor_destroy(r->y);
    memset(r, 0, sizeof *r);
}
static mgpu_result ne_forward(ne_run* r, const mgpu_tensor* x) { return r->l->vt->forward(r->l, &r->ctx, x, r->y); }
static mgpu_result ne_backward(ne_run* r, const mgpu_tensor* x, const mgpu_tensor* dy, mgpu_tensor* dx) {
    return r->l->vt->backward(r->l, &r->ctx, x, r->y, dy, dx);
}
static void ne_zero_grads(ne_run* r) {
    int i;
    for (i = 0; i < r->np; ++i) NE_MUST(mgpu_tensor_zero(r->g[i]));
}
/* a tensor's floats in fresh host memory */
static float* ne_get(const mgpu_tensor* t) {
    float* h = fbuf(mgpu_tensor_numel(t));
    tget(t, h);
    return h;
}
static double* ne_widen(const float* x, int64_t n) {
    double* d = dbuf(n);
    int64_t i;
    for (i = 0; i < n; ++i) d[i] = x[i];
    return d;
}
/* normalised error of got against the float results ref */
static double ne_err(const float* got, const float* ref, int64_t n) {
    double* d = ne_widen(ref, n);
    double e = test_rel_error(got, d, (size_t)n);
    free(d);
    return e;
}
static void ne_normal(float* x, int64_t n, double sd) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)(rng_gauss() * sd);
}
/* L = sum(y .* R) of the layer's forward, in float64 */
static double ne_loss(ne_run* r, const mgpu_tensor* x, const float* R, float* ybuf) {
    double L = 0.0;
    int64_t i, n = mgpu_tensor_numel(r->y);
    NE_MUST(ne_forward(r, x));
    tget(r->y, ybuf);
    for (i = 0; i < n; ++i) L += (double)ybuf[i] * R[i];
    return L;
}

/* The checks every layer of the group gets, on the CPU and then on the GPU:
     - forward against yref, a float64 loop over the same x and parameters;
     - every parameter gradient and dx (for f32 x) against central differences of L = sum(y .* R);
     - two backward passes after one forward add the parameter gradients twice, and write dx
       (not add to it);
     - the GPU twin: the same x and parameters on g_gpu, y, the gradients and dx within 1e-5
       (normalised) of the CPU's, and a second backward from zero gives the same bits.
   x is host memory of dtype xdt; params (NULL: keep the layer's initial values) host copies. */
static void ne_check_layer(const char* label, mgpu_layer* l, mgpu_shape xs, mgpu_dtype xdt, const void* x,
                           float* const* params, const double* yref) {
    mgpu_device* cpu = mgpu_device_cpu();
    const int has_dx = xdt == MGPU_F32;
    const float eps = 1e-2f;
    ne_run r;
    mgpu_tensor *tx, *tr, *tdx = NULL;
    float *y, *R, *g[2] = {NULL, NULL}, *p[2] = {NULL, NULL}, *dx = NULL, *xh = NULL;
    int64_t nx = mgpu_shape_numel(xs), ny, i, j;
    int k;
    if (!ne_open(&r, l, cpu, xs, 7)) return;
    for (k = 0; k < r.np; ++k) {
        if (params) tput(r.p[k], params[k]);
        p[k] = ne_get(r.p[k]);
    }
    tx = tmake(cpu, xdt, xs);
    tput(tx, x);
    ny = mgpu_tensor_numel(r.y);
    y = fbuf(ny);
    NE_MUST(ne_forward(&r, tx));
    tget(r.y, y);
    {
        double e = test_rel_error(y, yref, (size_t)ny);
        CHECK(e <= 1e-5, "%s: forward against the float64 loop: normalised error %.3g", label, e);
    }
    /* gradients of L = sum(y .* R) */
    R = fbuf(ny);
    ne_normal(R, ny, 1.0);
    tr = tfrom(cpu, mgpu_tensor_shape(r.y), R);
    if (has_dx) tdx = tmake(cpu, MGPU_F32, xs);
    NE_MUST(ne_backward(&r, tx, tr, tdx));
    for (k = 0; k < r.np; ++k) g[k] = ne_get(r.g[k]);
    if (has_dx) dx = ne_get(tdx);
    /* central differences, through the layer's own forward */
    {
        float* yb = fbuf(ny);
        for (k = 0; k < r.np + has_dx; ++k) {
            const int is_x = k == r.np;
            const int64_t n = is_x ? nx : mgpu_tensor_numel(r.p[k]);
            float* v = is_x ? NULL : p[k];
            double* num;
            double e;
            if (is_x) {
                v = xh = fbuf(nx);
                memcpy(xh, x, (size_t)nx * sizeof(float));
            }
            num = dbuf(n);
            for (j = 0; j < n; ++j) {
                const float save = v[j];
                double lp, lm;
                v[j] = save + eps;
                tput(is_x ? tx : r.p[k], v);
                lp = ne_loss(&r, tx, R, yb);
                v[j] = save - eps;
                tput(is_x ? tx : r.p[k], v);
                lm = ne_loss(&r, tx, R, yb);
                v[j] = save;
                num[j] = (lp - lm) / ((double)(save + eps) - (double)(save - eps));
            }
            tput(is_x ? tx : r.p[k], v);
            e = test_rel_error(is_x ? dx : g[k], num, (size_t)n);
            {
                const char* name = "x";
                mgpu_shape s;
                if (!is_x) NE_MUST(l->vt->param_shape(l, k, &name, &s));
                CHECK(e <= 2e-3, "%s: d L / d %s against central differences: normalised error %.3g", label, name, e);
            }
            free(num);
        }
        free(yb);
    }
    /* backward adds into the parameter gradients and writes dx */
    ne_zero_grads(&r);
    NE_MUST(ne_forward(&r, tx));
    NE_MUST(ne_backward(&r, tx, tr, tdx));
    NE_MUST(ne_backward(&r, tx, tr, tdx));
    for (k = 0; k < r.np; ++k) {
        float* g2 = ne_get(r.g[k]);
        double* twice = dbuf(mgpu_tensor_numel(r.g[k]));
        double e;
        for (i = 0; i < mgpu_tensor_numel(r.g[k]); ++i) twice[i] = 2.0 * g[k][i];
        e = test_rel_error(g2, twice, (size_t)mgpu_tensor_numel(r.g[k]));
        CHECK(e <= 1e-6, "%s: two backward passes: parameter %d's gradient not doubled (error %.3g)", label, k, e);
        free(g2); free(twice);
    }
    if (has_dx) {
        float* dx2 = ne_get(tdx);
        CHECK(!memcmp(dx, dx2, (size_t)nx * sizeof(float)), "%s: a second backward pass changed dx (added to it?)", label);
        free(dx2);
    }
    /* the GPU twin */
    if (gpu_part(label)) {
        ne_run gr;
        mgpu_tensor *gx = tmake(g_gpu, xdt, xs), *gdy, *gdx = NULL;
        float *gy, *gg[2] = {NULL, NULL}, *gdxh = NULL;
        if (ne_open(&gr, l, g_gpu, xs, 7)) {
            for (k = 0; k < gr.np; ++k) {
                float* init = ne_get(gr.p[k]);
                if (!params) CHECK(!memcmp(init, p[k], (size_t)mgpu_tensor_numel(gr.p[k]) * sizeof(float)),
                                   "%s: cuda: parameter %d initialised differently from the CPU's", label, k);
                free(init);
                tput(gr.p[k], p[k]);
            }
            tput(gx, x);
            gdy = tfrom(g_gpu, mgpu_tensor_shape(gr.y), R);
            if (has_dx) gdx = tmake(g_gpu, MGPU_F32, xs);
            NE_MUST(ne_forward(&gr, gx));
            gy = ne_get(gr.y);
            {
                double e = ne_err(gy, y, ny);
                CHECK(e <= 1e-5, "%s: cuda forward against the CPU: normalised error %.3g", label, e);
            }
            NE_MUST(ne_backward(&gr, gx, gdy, gdx));
            for (k = 0; k < gr.np; ++k) {
                double e;
                gg[k] = ne_get(gr.g[k]);
                e = ne_err(gg[k], g[k], mgpu_tensor_numel(gr.g[k]));
                CHECK(e <= 1e-5, "%s: cuda gradient of parameter %d against the CPU: normalised error %.3g", label, k, e);
            }
            if (has_dx) {
                double e;
                gdxh = ne_get(gdx);
                e = ne_err(gdxh, dx, nx);
                CHECK(e <= 1e-5, "%s: cuda dx against the CPU: normalised error %.3g", label, e);
            }
            /* deterministic: the same bits again from zero */
            ne_zero_grads(&gr);
            NE_MUST(ne_backward(&gr, gx, gdy, gdx));
            for (k = 0; k < gr.np; ++k) {
                float* again = ne_get(gr.g[k]);
                CHECK(!memcmp(again, gg[k], (size_t)mgpu_tensor_numel(gr.g[k]) * sizeof(float)),
                      "%s: cuda: a second backward gives other bits for parameter %d", label, k);
                free(again);
            }
            if (has_dx) {
                float* again = ne_get(gdx);
                CHECK(!memcmp(again, gdxh, (size_t)nx * sizeof(float)), "%s: cuda: a second backward gives other bits for dx", label);
                free(again);
            }
            /* and a third adds onto the gradients: twice the first's */
            NE_MUST(ne_backward(&gr, gx, gdy, gdx));
            for (k = 0; k < gr.np; ++k) {
                float* again = ne_get(gr.g[k]);
                double* twice = dbuf(mgpu_tensor_numel(gr.g[k]));
                double e;
                for (i = 0; i < mgpu_tensor_numel(gr.g[k]); ++i) twice[i] = 2.0 * gg[k][i];
                e = test_rel_error(again, twice, (size_t)mgpu_tensor_numel(gr.g[k]));
                CHECK(e <= 1e-6, "%s: cuda: two backward passes: parameter %d's gradient not doubled (error %.3g)", label, k, e);
                free(again); free(twice);
            }
            for (k = 0; k < 2; ++k) free(gg[k]);
            free(gy); free(gdxh);
            mgpu_tensor_destroy(gdy);
            mgpu_tensor_destroy(gdx);
            ne_close(&gr);
        }
        mgpu_tensor_destroy(gx);
    }
    for (k = 0; k < 2; ++k) { free(g[k]); free(p[k]); }
    free(y); free(R); free(dx); free(xh);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tr);
    mgpu_tensor_destroy(tdx);
    ne_close(&r);
}

/* a creator that must fail: NULL, MGPU_ERROR_INVALID_ARGUMENT, a message naming the function */
static void ne_expect_null(mgpu_layer* l, const char* what, const char* fn) {
    CHECK(l == NULL, "%s: made a layer", what);
    if (l) { mgpu_layer_destroy(l); return; }
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, what, fn, NULL, NULL);
}

/* -- LayerNorm over the last dimension of xs -- */
static void ne_layer_norm(mgpu_shape xs) {
    const int dim = (int)xs.dim[xs.ndim - 1];
    const int64_t nx = mgpu_shape_numel(xs), rows = nx / dim;
    mgpu_layer* l = mgpu_layer_layer_norm(dim);
    float *x = fbuf(nx), *w = fbuf(dim), *b = fbuf(dim);
    float* params[2];
    double* yref = dbuf(nx);
    char label[96], shape[64];
    int64_t r, c;
    CHECK(l && !strcmp(mgpu_layer_type(l), "LayerNorm"), "mgpu_layer_layer_norm(%d): %s", dim, l ? mgpu_layer_type(l) : mgpu_last_error());
    if (!l) { free(x); free(w); free(b); free(yref); return; }
    snprintf(label, sizeof label, "LayerNorm(%d) on %s", dim, mgpu__shape_text(xs, shape, sizeof shape));
    {   /* initial values: weight ones, bias zeros; names as PyTorch's */
        ne_run run;
        const char* name;
        mgpu_shape s;
        if (ne_open(&run, l, mgpu_device_cpu(), xs, 3)) {
            float *w0 = ne_get(run.p[0]), *b0 = ne_get(run.p[1]);
            int ok = 1;
            for (c = 0; c < dim; ++c) ok &= w0[c] == 1.0f && b0[c] == 0.0f;
            CHECK(run.np == 2 && ok, "%s: initial weight ones and bias zeros", label);
            NE_MUST(l->vt->param_shape(l, 0, &name, &s));
            CHECK(!strcmp(name, "weight") && s.ndim == 1 && s.dim[0] == dim, "%s: parameter 0 is '%s'", label, name);
            NE_MUST(l->vt->param_shape(l, 1, &name, &s));
            CHECK(!strcmp(name, "bias") && s.ndim == 1 && s.dim[0] == dim, "%s: parameter 1 is '%s'", label, name);
            free(w0); free(b0);
            ne_close(&run);
        }
    }
    ne_normal(x, nx, 1.5);
    for (r = 0; r < rows; ++r) x[r * dim] += (float)r;   /* rows of different means */
    ne_normal(w, dim, 1.0);
    ne_normal(b, dim, 1.0);
    for (r = 0; r < rows; ++r) {
        double m = 0.0, v = 0.0;
        for (c = 0; c < dim; ++c) m += x[r * dim + c];
        m /= dim;
        for (c = 0; c < dim; ++c) v += (x[r * dim + c] - m) * (x[r * dim + c] - m);
        v /= dim;
        for (c = 0; c < dim; ++c) yref[r * dim + c] = (x[r * dim + c] - m) / sqrt(v + 1e-5) * w[c] + b[c];
    }
    params[0] = w; params[1] = b;
    ne_check_layer(label, l, xs, MGPU_F32, x, params, yref);
    {   /* the kept mean and rstd, against float64 */
        ne_run run;
        mgpu_tensor* tx = tfrom(mgpu_device_cpu(), xs, x);
        if (ne_open(&run, l, mgpu_device_cpu(), xs, 3)) {
            float *m, *rs;
            double *mref = dbuf(rows), *rsref = dbuf(rows);
            NE_MUST(ne_forward(&run, tx));
            m = ne_get(run.aux[0]);
            rs = ne_get(run.aux[1]);
            {
                int64_t q;
                for (q = 0; q < rows; ++q) {
                    double mm = 0.0, v = 0.0;
                    for (c = 0; c < dim; ++c) mm += x[q * dim + c];
                    mm /= dim;
                    for (c = 0; c < dim; ++c) v += (x[q * dim + c] - mm) * (x[q * dim + c] - mm);
                    mref[q] = mm;
                    rsref[q] = 1.0 / sqrt(v / dim + 1e-5);
                }
            }
            CHECK(mgpu_tensor_numel(run.aux[0]) == rows && test_rel_error(m, mref, (size_t)rows) <= 1e-6 &&
                  test_rel_error(rs, rsref, (size_t)rows) <= 1e-6, "%s: the kept mean and 1/sqrt(var + eps)", label);
            free(m); free(rs); free(mref); free(rsref);
            ne_close(&run);
        }
        mgpu_tensor_destroy(tx);
    }
    mgpu_layer_destroy(l);
    free(x); free(w); free(b); free(yref);
}

/* -- Embedding(num, dim) on ids of shape is -- */
static void ne_embedding(int num, int dim, mgpu_shape is) {
    const int64_t n = mgpu_shape_numel(is);
    mgpu_layer* l = mgpu_layer_embedding(num, dim);
    mgpu_device* cpu = mgpu_device_cpu();
    int32_t* ids = (int32_t*)xmalloc((size_t)n * sizeof(int32_t));
    double* yref;
    float* w;
    char label[96], shape[64];
    int64_t p, c;
    ne_run r;
    CHECK(l && !strcmp(mgpu_layer_type(l), "Embedding"), "mgpu_layer_embedding(%d, %d): %s", num, dim,
          l ? mgpu_layer_type(l) : mgpu_last_error());
    if (!l) { free(ids); return; }
    snprintf(label, sizeof label, "Embedding(%d, %d) on ids %s", num, dim, mgpu__shape_text(is, shape, sizeof shape));
    for (p = 0; p < n; ++p) ids[p] = rng_int(num);
    if (n > 3) { ids[n - 1] = ids[0]; ids[n / 2] = ids[0]; }   /* an id three times: its rows add */
    if (!ne_open(&r, l, cpu, is, 7)) { mgpu_layer_destroy(l); free(ids); return; }   /* ne_check_layer's seed */
    w = ne_get(r.p[0]);
    {   /* N(0, 0.02), GPT-2's */
        double s = 0.0, s2 = 0.0, sd;
        const int64_t nw = (int64_t)num * dim;
        for (p = 0; p < nw; ++p) { s += w[p]; s2 += (double)w[p] * w[p]; }
        sd = sqrt(s2 / nw - (s / nw) * (s / nw));
        CHECK(fabs(s / nw) < 0.01 && sd > 0.015 && sd < 0.025, "%s: initial weight mean %.4g, std %.4g (want N(0, 0.02))",
              label, s / nw, sd);
    }
    yref = dbuf(n * dim);
    for (p = 0; p < n; ++p)
        for (c = 0; c < dim; ++c) yref[p * dim + c] = w[(int64_t)ids[p] * dim + c];
    ne_check_layer(label, l, is, MGPU_I32, ids, NULL, yref);
    {   /* dx: ids have no gradient, and backward leaves dx alone */
        mgpu_tensor *tx = tfrom_i32(cpu, is, ids), *dx = tmake(cpu, MGPU_I32, is), *dy = tmake(cpu, MGPU_F32, mgpu_tensor_shape(r.y));
        int32_t* back = (int32_t*)xmalloc((size_t)n * sizeof(int32_t));
        int ok = 1;
        NE_MUST(mgpu_tensor_fill(dx, 7777));
        NE_MUST(mgpu_tensor_fill(dy, 1.0));
        NE_MUST(ne_forward(&r, tx));
        NE_MUST(ne_backward(&r, tx, dy, dx));
        tget(dx, back);
        for (p = 0; p < n; ++p) ok &= back[p] == 7777;
        CHECK(ok, "%s: backward changed dx", label);
        free(back);
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(dx); mgpu_tensor_destroy(dy);
    }
    free(w); free(yref); free(ids);
    ne_close(&r);
    mgpu_layer_destroy(l);
}

/* ids outside [0, num): refused on the CPU (naming the id and its position, writing nothing), a
   NaN row on the GPU, which backward skips */
static void ne_embedding_bad_ids(void) {
    const int num = 9, dim = 35, B = 2, T = 5;
    mgpu_layer* l = mgpu_layer_embedding(num, dim);
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_shape is = mgpu_shape2(B, T);
    int32_t ids[2 * 5];
    int p, c, bad;
    ne_run r;
    if (!l) { CHECK(0, "mgpu_layer_embedding: %s", mgpu_last_error()); return; }
    for (p = 0; p < B * T; ++p) ids[p] = (p * 4) % num;
    if (ne_open(&r, l, cpu, is, 1)) {
        static const int32_t wrong[2] = {9, -1};
        static const int at[2] = {1 * 5 + 2, 0};
        static const char* where[2] = {"[1,2]", "[0,0]"};
        for (bad = 0; bad < 2; ++bad) {
            mgpu_tensor* tx;
            float* y;
            char what[64], idtext[32];
            int same = 1;
            int32_t keep = ids[at[bad]];
            ids[at[bad]] = wrong[bad];
            tx = tfrom_i32(cpu, is, ids);
            NE_MUST(mgpu_tensor_fill(r.y, 3.0));
            snprintf(what, sizeof what, "Embedding forward, id %d at %s", (int)wrong[bad], where[bad]);
            snprintf(idtext, sizeof idtext, "id %d ", (int)wrong[bad]);
            expect_fail(ne_forward(&r, tx), MGPU_ERROR_INVALID_ARGUMENT, what, idtext, where[bad], "Embedding");
            y = ne_get(r.y);
            for (p = 0; p < B * T * dim; ++p) same &= y[p] == 3.0f;
            CHECK(same, "%s: the output was written", what);
            snprintf(what, sizeof what, "Embedding backward, id %d at %s", (int)wrong[bad], where[bad]);
            expect_fail(ne_backward(&r, tx, r.y, NULL), MGPU_ERROR_INVALID_ARGUMENT, what, idtext, where[bad], NULL);
            free(y);
            mgpu_tensor_destroy(tx);
            ids[at[bad]] = keep;
        }
        {   /* f32 ids are refused too */
            mgpu_tensor* fx = tmake(cpu, MGPU_F32, is);
            NE_MUST(mgpu_tensor_zero(fx));
            expect_fail(ne_forward(&r, fx), MGPU_ERROR_DTYPE_MISMATCH, "Embedding forward with f32 ids", "Embedding", "i32", NULL);
            mgpu_tensor_destroy(fx);
        }
        ne_close(&r);
    }
    if (gpu_part("Embedding with bad ids")) {
        ne_run gr;
        if (ne_open(&gr, l, g_gpu, is, 1)) {
            float *w = ne_get(gr.p[0]), *y, *dy = fbuf(B * T * dim), *dw;
            double* ref = dbuf(num * dim);
            mgpu_tensor *tx, *tdy;
            int rows_ok = 1, nan_ok = 1;
            ids[3] = num + 4;
            ids[6] = -2;
            tx = tfrom_i32(g_gpu, is, ids);
            NE_MUST(ne_forward(&gr, tx));
            y = ne_get(gr.y);
            for (p = 0; p < B * T; ++p)
                for (c = 0; c < dim; ++c) {
                    if (p == 3 || p == 6) nan_ok &= y[p * dim + c] != y[p * dim + c];
                    else rows_ok &= y[p * dim + c] == w[ids[p] * dim + c];
                }
            CHECK(nan_ok, "cuda Embedding: the rows of ids outside [0, %d) are not NaN", num);
            CHECK(rows_ok, "cuda Embedding: the rows of good ids beside bad ones are wrong");
            ne_normal(dy, B * T * dim, 1.0);
            tdy = tfrom(g_gpu, mgpu_tensor_shape(gr.y), dy);
            NE_MUST(ne_backward(&gr, tx, tdy, NULL));
            dw = ne_get(gr.g[0]);
            for (p = 0; p < B * T; ++p)
                if (p != 3 && p != 6)
                    for (c = 0; c < dim; ++c) ref[ids[p] * dim + c] += dy[p * dim + c];
            {
                double e = test_rel_error(dw, ref, (size_t)num * dim);
                CHECK(e <= 1e-6, "cuda Embedding backward skips bad ids: normalised error %.3g", e);
            }
            free(w); free(y); free(dy); free(dw); free(ref);
            mgpu_tensor_destroy(tx); mgpu_tensor_destroy(tdy);
            ne_close(&gr);
        }
    }
    mgpu_layer_destroy(l);
}

/* -- PositionEmbedding(max, dim) on x [B, T, dim] -- */
static void ne_position(int max, int dim, int B, int T) {
    mgpu_shape xs = mgpu_shape3(B, T, dim);
    const int64_t nx = mgpu_shape_numel(xs);
    mgpu_layer* l = mgpu_layer_position_embedding(max, dim);
    mgpu_device* cpu = mgpu_device_cpu();
    float *x = fbuf(nx), *w;
    double* yref = dbuf(nx);
    char label[96];
    int64_t b, t, c;
    ne_run r;
    CHECK(l && !strcmp(mgpu_layer_type(l), "PositionEmbedding"), "mgpu_layer_position_embedding(%d, %d): %s", max, dim,
          l ? mgpu_layer_type(l) : mgpu_last_error());
    if (!l) { free(x); free(yref); return; }
    snprintf(label, sizeof label, "PositionEmbedding(%d, %d) on [%d,%d,%d]", max, dim, B, T, dim);
    if (!ne_open(&r, l, cpu, xs, 7)) { mgpu_layer_destroy(l); free(x); free(yref); return; }   /* ne_check_layer's seed */
    w = ne_get(r.p[0]);
    ne_normal(x, nx, 1.0);
    for (b = 0; b < B; ++b)
        for (t = 0; t < T; ++t)
            for (c = 0; c < dim; ++c) yref[(b * T + t) * dim + c] = (double)x[(b * T + t) * dim + c] + w[t * dim + c];
    ne_check_layer(label, l, xs, MGPU_F32, x, NULL, yref);
    {   /* positions from T on get no gradient; those below get the sum over the batch */
        mgpu_tensor *tx = tfrom(cpu, xs, x), *dy = tfrom(cpu, xs, x);
        float* g;
        double* ref = dbuf((int64_t)max * dim);
        NE_MUST(ne_forward(&r, tx));
        NE_MUST(ne_backward(&r, tx, dy, NULL));
        g = ne_get(r.g[0]);
        for (b = 0; b < B; ++b)
            for (t = 0; t < T * dim; ++t) ref[t] += x[b * T * dim + t];
        CHECK(test_rel_error(g, ref, (size_t)max * dim) <= 1e-6, "%s: dweight is not the sum of dy over the batch, or rows "
              "from T on are not zero", label);
        free(g); free(ref);
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(dy);
    }
    free(w); free(x); free(yref);
    ne_close(&r);
    mgpu_layer_destroy(l);
}

/* -- GELU's tanh form: the op and its backward against float64, the layer -- */
static double ne_gelu_tanh_ref(double x, int derivative) {
    const double k = sqrt(2.0 / 3.14159265358979323846), c = 0.044715, t = tanh(k * (x + c * x * x * x));
    return derivative ? 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x) : 0.5 * x * (1.0 + t);
}
static void ne_gelu_tanh(void) {
    const int n = 1003;
    mgpu_device* cpu = mgpu_device_cpu();
    float *x = fbuf(n), *dy = fbuf(n), *y = fbuf(n), *dx = fbuf(n);
    double *yref = dbuf(n), *dxref = dbuf(n);
    mgpu_tensor *tx, *tdy, *ty, *tdx;
    mgpu_layer* l = mgpu_layer_gelu_tanh();
    int i;
    for (i = 0; i < n; ++i) {
        x[i] = -8.0f + 16.0f * (float)i / (float)(n - 1);
        dy[i] = (float)rng_gauss();
        yref[i] = ne_gelu_tanh_ref(x[i], 0);
        dxref[i] = dy[i] * ne_gelu_tanh_ref(x[i], 1);
    }
    tx = tfrom(cpu, mgpu_shape1(n), x);
    tdy = tfrom(cpu, mgpu_shape1(n), dy);
    ty = tmake(cpu, MGPU_F32, mgpu_shape1(n));
    tdx = tmake(cpu, MGPU_F32, mgpu_shape1(n));
    NE_MUST(mgpu_gelu_tanh(ty, tx));
    NE_MUST(mgpu_gelu_tanh_backward(tdx, tdy, tx));
    tget(ty, y);
    tget(tdx, dx);
    {
        double e1 = test_rel_error(y, yref, (size_t)n), e2 = test_rel_error(dx, dxref, (size_t)n);
        CHECK(e1 <= 1e-6, "mgpu_gelu_tanh on [-8, 8] against float64: normalised error %.3g", e1);
        CHECK(e2 <= 1e-6, "mgpu_gelu_tanh_backward on [-8, 8] against float64: normalised error %.3g", e2);
    }
    {   /* not the exact GELU: the two differ by up to about 5e-4 */
        float* exact = fbuf(n);
        double most = 0.0;
        NE_MUST(mgpu_gelu(tdx, tx));
        tget(tdx, exact);
        for (i = 0; i < n; ++i) most = fabs((double)exact[i] - y[i]) > most ? fabs((double)exact[i] - y[i]) : most;
        CHECK(most > 1e-4, "mgpu_gelu_tanh differs from mgpu_gelu by at most %.3g", most);
        free(exact);
    }
    expect_fail(mgpu_gelu_tanh(ty, NULL), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_gelu_tanh(out, NULL)", "mgpu_gelu_tanh", NULL, NULL);
    if (gpu_part("mgpu_gelu_tanh")) {
        mgpu_tensor *gx = tfrom(g_gpu, mgpu_shape1(n), x), *gdy = tfrom(g_gpu, mgpu_shape1(n), dy);
        mgpu_tensor *gy = tmake(g_gpu, MGPU_F32, mgpu_shape1(n)), *gdx = tmake(g_gpu, MGPU_F32, mgpu_shape1(n));
        float *hy = fbuf(n), *hdx = fbuf(n);
        NE_MUST(mgpu_gelu_tanh(gy, gx));
        NE_MUST(mgpu_gelu_tanh_backward(gdx, gdy, gx));
        tget(gy, hy);
        tget(gdx, hdx);
        CHECK(ne_err(hy, y, n) <= 1e-5 && ne_err(hdx, dx, n) <= 1e-5, "cuda mgpu_gelu_tanh and its backward against the "
              "CPU: normalised errors %.3g, %.3g", ne_err(hy, y, n), ne_err(hdx, dx, n));
        free(hy); free(hdx);
        mgpu_tensor_destroy(gx); mgpu_tensor_destroy(gdy); mgpu_tensor_destroy(gy); mgpu_tensor_destroy(gdx);
    }
    /* the layer: type GELU, described as PyTorch's approximate='tanh' */
    CHECK(l && !strcmp(mgpu_layer_type(l), "GELU"), "mgpu_layer_gelu_tanh: %s", l ? mgpu_layer_type(l) : mgpu_last_error());
    if (l) {
        char desc[64] = "";
        mgpu_shape xs = mgpu_shape3(2, 3, 37);
        const int64_t nx = mgpu_shape_numel(xs);
        float* lx = fbuf(nx);
        double* lref = dbuf(nx);
        int64_t j;
        if (l->vt->describe) l->vt->describe(l, desc, sizeof desc);
        CHECK(!strcmp(desc, "approximate='tanh'"), "mgpu_layer_gelu_tanh describes itself as \"%s\"", desc);
        ne_normal(lx, nx, 2.0);
        for (j = 0; j < nx; ++j) lref[j] = ne_gelu_tanh_ref(lx[j], 0);
        ne_check_layer("GELU(approximate='tanh') on [2,3,37]", l, xs, MGPU_F32, lx, NULL, lref);
        free(lx); free(lref);
        mgpu_layer_destroy(l);
    }
    free(x); free(dy); free(y); free(dx); free(yref); free(dxref);
    mgpu_tensor_destroy(tx); mgpu_tensor_destroy(tdy); mgpu_tensor_destroy(ty); mgpu_tensor_destroy(tdx);
}

/* The f32 layers in a model (mgpu_model_create): LayerNorm -> GELU (tanh) -> PositionEmbedding on
   samples [T, D] give what the layers give run by hand, forward and backward, bit for bit; a T
   above max_positions is refused when the model is made, naming both. */
static void ne_in_a_model(void) {
    const int B = 3, T = 5, D = 19;
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_layer* layers[3];
    mgpu_model_desc d;
    mgpu_model* m;
    mgpu_shape xs = mgpu_shape3(B, T, D);
    const int64_t nx = mgpu_shape_numel(xs);
    float *x = fbuf(nx), *R = fbuf(nx);
    int i;
    memset(&d, 0, sizeof d);
    layers[0] = mgpu_layer_layer_norm(D);
    layers[1] = mgpu_layer_gelu_tanh();
    layers[2] = mgpu_layer_position_embedding(T + 2, D);
    d.input = mgpu_shape2(T, D);
    d.layers = layers;
    d.layer_count = 3;
    d.seed = 21;
    m = mgpu_model_create(&d);
    CHECK(m != NULL, "LayerNorm -> GELU (tanh) -> PositionEmbedding model: %s", mgpu_last_error());
    if (m) {
        ne_run run[3];
        mgpu_tensor *tx = tfrom(cpu, xs, x), *tr, *dmid[2];
        const mgpu_tensor* out;
        int ok = 1;
        CHECK(mgpu_model_tensor_count(m) == 3 && !strcmp(mgpu_model_tensor_name(m, 0), "0.weight") &&
              !strcmp(mgpu_model_tensor_name(m, 1), "0.bias") && !strcmp(mgpu_model_tensor_name(m, 2), "2.weight"),
              "model tensors: %d, '%s' ...", mgpu_model_tensor_count(m), mgpu_model_tensor_name(m, 0));
        ne_normal(x, nx, 1.0);
        ne_normal(R, nx, 1.0);
        tput(tx, x);
        tr = tfrom(cpu, xs, R);
        /* LayerNorm's parameters other than ones and zeros, so that they matter */
        {
            float* p = fbuf(D);
            ne_normal(p, D, 1.0);
            tput(mgpu_model_tensor(m, 0, 0), p);
            ne_normal(p, D, 1.0);
            tput(mgpu_model_tensor(m, 0, 1), p);
            free(p);
        }
        out = mgpu_model_forward(m, 0, tx, 1);
        CHECK(out != NULL, "model forward: %s", mgpu_last_error());
        NE_MUST(mgpu_model_zero_grad(m));
        if (out) NE_MUST(mgpu_model_backward(m, 0, tr));
        for (i = 0; i < 3; ++i) ok &= ne_open(&run[i], layers[i], cpu, xs, 0);
        if (out && ok) {
            float *a, *b2;
            for (i = 0; i < 3; ++i)
                if (run[i].np) NE_MUST(mgpu_tensor_copy(run[i].p[0], mgpu_model_tensor(m, 0, i == 0 ? 0 : 2)));
            NE_MUST(mgpu_tensor_copy(run[0].p[1], mgpu_model_tensor(m, 0, 1)));
            NE_MUST(ne_forward(&run[0], tx));
            NE_MUST(ne_forward(&run[1], run[0].y));
            NE_MUST(ne_forward(&run[2], run[1].y));
            a = ne_get(out);
            b2 = ne_get(run[2].y);
            CHECK(!memcmp(a, b2, (size_t)nx * sizeof(float)), "model forward differs from the layers run by hand");
            free(a); free(b2);
            dmid[0] = tmake(cpu, MGPU_F32, xs);
            dmid[1] = tmake(cpu, MGPU_F32, xs);
            NE_MUST(ne_backward(&run[2], run[1].y, tr, dmid[1]));
            NE_MUST(ne_backward(&run[1], run[0].y, dmid[1], dmid[0]));
            NE_MUST(ne_backward(&run[0], tx, dmid[0], NULL));
            {
                const mgpu_tensor* mg = mgpu_model_grads(m, 0);
                float* all = ne_get(mg);
                float *g0 = ne_get(run[0].g[0]), *g1 = ne_get(run[0].g[1]), *g2 = ne_get(run[2].g[0]);
                const int64_t o0 = ((const char*)mgpu_tensor_data(mgpu_model_tensor(m, 0, 0)) - (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
                const int64_t o1 = ((const char*)mgpu_tensor_data(mgpu_model_tensor(m, 0, 1)) - (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
                const int64_t o2 = ((const char*)mgpu_tensor_data(mgpu_model_tensor(m, 0, 2)) - (const char*)mgpu_tensor_data(mgpu_model_params(m, 0))) / 4;
                CHECK(!memcmp(all + o0, g0, D * sizeof(float)) && !memcmp(all + o1, g1, D * sizeof(float)) &&
                      !memcmp(all + o2, g2, (size_t)(T + 2) * D * sizeof(float)),
                      "model gradients differ from the layers run by hand");
                free(all); free(g0); free(g1); free(g2);
            }
            mgpu_tensor_destroy(dmid[0]);
            mgpu_tensor_destroy(dmid[1]);
        }
        for (i = 0; i < 3; ++i) ne_close(&run[i]);
        mgpu_tensor_destroy(tx);
        mgpu_tensor_destroy(tr);
        mgpu_model_destroy(m);
    }
    /* T above max_positions */
    layers[0] = mgpu_layer_position_embedding(T, D);
    d.input = mgpu_shape2(T + 1, D);
    d.layers = layers;
    d.layer_count = 1;
    m = mgpu_model_create(&d);
    CHECK(m == NULL, "a model with T %d above max_positions %d was made", T + 1, T);
    if (m) mgpu_model_destroy(m);
    else expect_fail(mgpu_last_result(), MGPU_ERROR_SHAPE_MISMATCH, "PositionEmbedding(5, 19) on T 6", ",6,19]",
                     "max_positions 5", "PositionEmbedding");
    free(x); free(R);
}

/* sizes refused at creation, shapes refused at forward */
static void ne_errors(void) {
    mgpu_layer* l;
    ne_expect_null(mgpu_layer_layer_norm(0), "mgpu_layer_layer_norm(0)", "mgpu_layer_layer_norm");
    ne_expect_null(mgpu_layer_layer_norm(-3), "mgpu_layer_layer_norm(-3)", "mgpu_layer_layer_norm");
    ne_expect_null(mgpu_layer_embedding(0, 4), "mgpu_layer_embedding(0, 4)", "mgpu_layer_embedding");
    ne_expect_null(mgpu_layer_embedding(4, 0), "mgpu_layer_embedding(4, 0)", "mgpu_layer_embedding");
    ne_expect_null(mgpu_layer_embedding(-1, -1), "mgpu_layer_embedding(-1, -1)", "mgpu_layer_embedding");
    ne_expect_null(mgpu_layer_position_embedding(0, 4), "mgpu_layer_position_embedding(0, 4)", "mgpu_layer_position_embedding");
    ne_expect_null(mgpu_layer_position_embedding(4, -2), "mgpu_layer_position_embedding(4, -2)", "mgpu_layer_position_embedding");
    l = mgpu_layer_layer_norm(37);
    if (l) {
        mgpu_shape y;
        ne_run run;
        expect_fail(l->vt->output_shape(l, mgpu_shape2(3, 36), &y), MGPU_ERROR_SHAPE_MISMATCH, "LayerNorm(37) on [3,36]",
                    "LayerNorm", "[3,36]", "37");
        expect_fail(l->vt->output_shape(l, mgpu_shape1(37), &y), MGPU_ERROR_SHAPE_MISMATCH, "LayerNorm(37) on [37]",
                    "LayerNorm", "[37]", NULL);
        if (ne_open(&run, l, mgpu_device_cpu(), mgpu_shape2(3, 37), 0)) {
            mgpu_tensor* bad = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(3, 36));
            NE_MUST(mgpu_tensor_zero(bad));
            expect_fail(ne_forward(&run, bad), MGPU_ERROR_SHAPE_MISMATCH, "LayerNorm(37) forward on [3,36]", "[3,36]", NULL, NULL);
            mgpu_tensor_destroy(bad);
            ne_close(&run);
        }
        mgpu_layer_destroy(l);
    }
    l = mgpu_layer_embedding(5, 3);
    if (l) {
        mgpu_shape y;
        expect_fail(l->vt->output_shape(l, mgpu_shape4(2, 2, 2, 2), &y), MGPU_ERROR_SHAPE_MISMATCH, "Embedding on 4-D ids",
                    "Embedding", "[2,2,2,2]", NULL);
        mgpu_layer_destroy(l);
    }
    l = mgpu_layer_position_embedding(4, 3);
    if (l) {
        mgpu_shape y;
        expect_fail(l->vt->output_shape(l, mgpu_shape3(2, 5, 3), &y), MGPU_ERROR_SHAPE_MISMATCH,
                    "PositionEmbedding(4, 3) on T 5", "[2,5,3]", "max_positions 4", NULL);
        expect_fail(l->vt->output_shape(l, mgpu_shape3(2, 4, 2), &y), MGPU_ERROR_SHAPE_MISMATCH,
                    "PositionEmbedding(4, 3) on dim 2", "[2,4,2]", NULL, NULL);
        mgpu_layer_destroy(l);
    }
}

static void test_norm_embedding(void) {
    header("2. LayerNorm, Embedding, position embedding, GELU (tanh)");
    ne_layer_norm(mgpu_shape3(3, 5, 37));      /* T not a power of two, dim not a multiple of 32 */
    ne_layer_norm(mgpu_shape4(2, 3, 2, 7));    /* several leading dimensions */
    ne_layer_norm(mgpu_shape2(2, 1030));       /* rows wider than 1024: a block per row on a GPU */
    ne_embedding(13, 37, mgpu_shape2(3, 5));
    ne_embedding(7, 6, mgpu_shape3(2, 3, 4));
    ne_embedding(300, 33, mgpu_shape1(7));     /* more vocabulary rows than the grid has blocks */
    ne_embedding_bad_ids();
    ne_position(11, 37, 3, 5);
    ne_position(6, 8, 2, 6);                   /* T = max_positions */
    ne_gelu_tanh();
    ne_in_a_model();
    ne_errors();
}

/* ============================================================================================ */
/* 3. causal multi-head self-attention                                                          */
/* ============================================================================================ */
/* The layer is run by hand: its vtable called with an mgpu_layer_ctx of tensors made here (its
   parameters, gradients and aux buffers), on the CPU or on g_gpu. */
#define ATTN_PARAMS 4
#define ATTN_MUST(expr)                                                                          \
    do {                                                                                         \
        mgpu_result attn_r_ = (expr);                                                            \
        if (attn_r_ != MGPU_OK) CHECK(0, "%s: %s", #expr, mgpu_last_error());                    \
    } while (0)
#define ATTN_AUX_MAX 16
#define ATTN_OUT_MASK 3   /* the residual dropout's mask: aux[3] with dropout */
typedef struct attn_rig {
    mgpu_layer* l;
    mgpu_device* dev;
    int B, T, D, H, naux;
    int64_t pn[ATTN_PARAMS];          /* parameter element counts */
    mgpu_tensor *param[ATTN_PARAMS], *grad[ATTN_PARAMS], *aux[ATTN_AUX_MAX];
    mgpu_tensor *x, *y, *dy, *dx;
    mgpu_layer_ctx ctx;
} attn_rig;

/* host values of a rig's inputs: the four parameters and x */
typedef struct attn_vals {
    float* p[ATTN_PARAMS];
    float* x;
} attn_vals;

/* A rig for layer l (not owned) on dev with input [B, T, D]: 1, or 0 after a failed check. */
static int attn_rig_make(attn_rig* r, mgpu_layer* l, mgpu_device* dev, int B, int T, int D, int H) {
    mgpu_shape xs = mgpu_shape3(B, T, D);
    int i;
    memset(r, 0, sizeof *r);
    r->l = l; r->dev = dev; r->B = B; r->T = T; r->D = D; r->H = H;
    CHECK(l->vt->param_count(l) == ATTN_PARAMS, "attention: %d parameters, expected 4", l->vt->param_count(l));
    for (i = 0; i < ATTN_PARAMS; ++i) {
        const char* name;
        mgpu_shape s;
        ATTN_MUST(l->vt->param_shape(l, i, &name, &s));
        r->pn[i] = mgpu_shape_numel(s);
        r->param[i] = tmake(dev, MGPU_F32, s);
        r->grad[i] = tmake(dev, MGPU_F32, s);
        ATTN_MUST(mgpu_tensor_zero(r->grad[i]));
    }
    r->naux = l->vt->aux_count(l);
    CHECK(r->naux <= ATTN_AUX_MAX, "attention: %d aux buffers", r->naux);
    if (r->naux > ATTN_AUX_MAX) return 0;
    for (i = 0; i < r->naux; ++i) {
        mgpu_dtype dt;
        mgpu_shape s;
        ATTN_MUST(l->vt->aux_shape(l, i, xs, &dt, &s));
        r->aux[i] = tmake(dev, dt, s);
    }
    r->x = tmake(dev, MGPU_F32, xs);
    r->y = tmake(dev, MGPU_F32, xs);
    r->dy = tmake(dev, MGPU_F32, xs);
    r->dx = tmake(dev, MGPU_F32, xs);
    r->ctx.device = dev;
    r->ctx.params = r->param;
    r->ctx.grads = r->grad;
    r->ctx.aux = r->aux;
    r->ctx.training = 1;
    r->ctx.seed = 0x5eed0123456789ull;
    r->ctx.offset = (uint64_t)3 << 40;   /* as the model gives layer 3 */
    r->ctx.first_row = 0;
    return 1;
}
static void attn_rig_free(attn_rig* r) {
    int i;
    for (i = 0; i < ATTN_PARAMS; ++i) { mgpu_tensor_destroy(r->param[i]); mgpu_tensor_destroy(r->grad[i]); }
    for (i = 0; i < r->naux; ++i) mgpu_tensor_destroy(r->aux[i]);
    mgpu_tensor_destroy(r->x); mgpu_tensor_destroy(r->y); mgpu_tensor_destroy(r->dy); mgpu_tensor_destroy(r->dx);
    memset(r, 0, sizeof *r);
}
static void attn_rig_put(attn_rig* r, const attn_vals* v) {
    int i;
    for (i = 0; i < ATTN_PARAMS; ++i) tput(r->param[i], v->p[i]);
    tput(r->x, v->x);
}
/* forward into r->y, and its result on the host (y may be NULL) */
static int attn_rig_forward(attn_rig* r, float* y) {
    mgpu_result res = r->l->vt->forward(r->l, &r->ctx, r->x, r->y);
    if (res != MGPU_OK) CHECK(0, "attention forward on %s: %s", mgpu_device_label(r->dev), mgpu_last_error());
    if (res != MGPU_OK) return 0;
    if (y) tget(r->y, y);
    return 1;
}
/* backward of dy = R into the gradients (added) and dx */
static int attn_rig_backward(attn_rig* r, const float* R, int with_dx) {
    mgpu_result res;
    tput(r->dy, R);
    res = r->l->vt->backward(r->l, &r->ctx, r->x, r->y, r->dy, with_dx ? r->dx : NULL);
    if (res != MGPU_OK) CHECK(0, "attention backward on %s: %s", mgpu_device_label(r->dev), mgpu_last_error());
    return res == MGPU_OK;
}

/* random inputs: weights N(0, 0.3) (so that softmax is far from uniform), biases N(0, 0.1), x N(0, 1) */
/* Weights of std 0.3, biases 0.1, x of 1. Past a width of 128 the weights shrink as 1 / sqrt(D)
   (0.3 sqrt(128 / D)): a score's fp32 rounding error grows with its size, and with weights of 0.3
   at width 256 the scores reach tens, and the softmax's rounding grows with them (measured on
   emulated GPUs, heads of 128: gradients 9e-6 to 1e-5 from the CPU's with weights of 0.3, 5e-6
   with these, 2e-6 at width 128; the fused core alone, on scores of about one unit, is within
   3e-7 of the CPU's). */
static void attn_vals_make(attn_vals* v, int B, int T, int D) {
    const int64_t n[ATTN_PARAMS] = { 3 * (int64_t)D * D, 3 * (int64_t)D, (int64_t)D * D, D };
    const double w = D > 128 ? 0.3 * sqrt(128.0 / D) : 0.3;
    int64_t i;
    int k;
    for (k = 0; k < ATTN_PARAMS; ++k) {
        v->p[k] = fbuf(n[k]);
        for (i = 0; i < n[k]; ++i) v->p[k][i] = (float)(rng_gauss() * (k % 2 == 0 ? w : 0.1));
    }
    v->x = fbuf((int64_t)B * T * D);
    for (i = 0; i < (int64_t)B * T * D; ++i) v->x[i] = (float)rng_gauss();
}
static void attn_vals_free(attn_vals* v) {
    int k;
    for (k = 0; k < ATTN_PARAMS; ++k) free(v->p[k]);
    free(v->x);
}

/* The formula in float64: qkv = x Wa + ba (Wa [D, 3D], Conv1D's [in, out]); per head softmax(q k^T / sqrt(hs)) with the causal
   mask, times amask ([B, H, T, T], NULL: none); y = att v merged; out = y Wp + bp, times omask
   ([B, T, D], NULL: none). Wp [D, D] is [in, out] too. */
static void attn_ref(int B, int T, int D, int H, const attn_vals* v, const float* amask, const float* omask, double* out) {
    const int hs = D / H;
    const float *wa = v->p[0], *ba = v->p[1], *wp = v->p[2], *bp = v->p[3];
    double* qkv = dbuf((int64_t)B * T * 3 * D);
    double* y = dbuf((int64_t)B * T * D);
    double* sc = dbuf(T);
    int b, h, t, s, d, o;
    for (b = 0; b < B; ++b)
        for (t = 0; t < T; ++t)
            for (o = 0; o < 3 * D; ++o) {
                double acc = ba[o];
                for (d = 0; d < D; ++d) acc += (double)v->x[((int64_t)b * T + t) * D + d] * wa[(int64_t)d * 3 * D + o];
                qkv[((int64_t)b * T + t) * 3 * D + o] = acc;
            }
    for (b = 0; b < B; ++b)
        for (h = 0; h < H; ++h)
            for (t = 0; t < T; ++t) {
                const double* q = qkv + ((int64_t)b * T + t) * 3 * D + h * hs;
                double m = -INFINITY, sum = 0.0;
                for (s = 0; s <= t; ++s) {
                    const double* k = qkv + ((int64_t)b * T + s) * 3 * D + D + h * hs;
                    double dot = 0.0;
                    for (d = 0; d < hs; ++d) dot += q[d] * k[d];
                    sc[s] = dot / sqrt((double)hs);
                    if (sc[s] > m) m = sc[s];
                }
                for (s = 0; s <= t; ++s) { sc[s] = exp(sc[s] - m); sum += sc[s]; }
                for (d = 0; d < hs; ++d) {
                    double acc = 0.0;
                    for (s = 0; s <= t; ++s) {
                        double a = sc[s] / sum;
                        if (amask) a *= amask[(((int64_t)b * H + h) * T + t) * T + s];
                        acc += a * qkv[((int64_t)b * T + s) * 3 * D + 2 * D + h * hs + d];
                    }
                    y[((int64_t)b * T + t) * D + h * hs + d] = acc;
                }
            }
    for (b = 0; b < B * T; ++b)
        for (o = 0; o < D; ++o) {
            double acc = bp[o];
            for (d = 0; d < D; ++d) acc += y[(int64_t)b * D + d] * wp[(int64_t)d * D + o];
            out[(int64_t)b * D + o] = omask ? acc * omask[(int64_t)b * D + o] : acc;
        }
    free(qkv); free(y); free(sc);
}

/* The attention dropout's mask [B, H, T, T] of rig r, which the layer draws again in backward and
   does not keep: mgpu__dropout_scale at the layer's counters below the diagonal, 0 above */
static void attn_mask(const attn_rig* r, float* mask) {
    const uint64_t first = (uint64_t)r->ctx.first_row * (uint64_t)r->H * (uint64_t)r->T * (uint64_t)r->T;
    int64_t i, row, s;
    for (row = 0; row < (int64_t)r->B * r->H * r->T; ++row)
        for (s = 0; s < r->T; ++s) {
            i = row * r->T + s;
            mask[i] = s <= row % r->T ? mgpu__dropout_scale(r->ctx.seed, r->ctx.offset, first + (uint64_t)i, r->l->cfg.p) : 0.0f;
        }
}

static double attn_rel(const float* got, const float* ref, int64_t n) {
    double* r = dbuf(n), e;
    int64_t i;
    for (i = 0; i < n; ++i) r[i] = ref[i];
    e = test_rel_error(got, r, (size_t)n);
    free(r);
    return e;
}

/* L = sum(out .* R) in float64 through a CPU rig's forward (its inputs from v) */
static double attn_loss(attn_rig* r, const attn_vals* v, const float* R, float* ybuf) {
    double L = 0.0;
    int64_t i, n = (int64_t)r->B * r->T * r->D;
    attn_rig_put(r, v);
    if (!attn_rig_forward(r, ybuf)) return 0.0;
    for (i = 0; i < n; ++i) L += (double)ybuf[i] * R[i];
    return L;
}

static const char* const attn_names[ATTN_PARAMS + 1] = { "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias", "x" };

/* One configuration on the CPU: forward against float64 (masks from the layer's own aux when
   p > 0), every gradient against central differences, a second backward doubles, causality. */
static void attn_cpu_case(int B, int T, int D, int H, float p) {
    mgpu_layer* l = mgpu_layer_causal_self_attention(D, H, p);
    attn_rig r;
    attn_vals v;
    const int64_t n = (int64_t)B * T * D;
    float *y, *y2, *R, *g[ATTN_PARAMS + 1], *amask = NULL, *omask = NULL;
    double* ref;
    char what[96];
    int k;
    snprintf(what, sizeof what, "attention B%d T%d dim %d heads %d p %g (cpu)", B, T, D, H, (double)p);
    CHECK(l != NULL, "%s: create: %s", what, mgpu_last_error());
    if (!l) return;
    if (!attn_rig_make(&r, l, mgpu_device_cpu(), B, T, D, H)) { mgpu_layer_destroy(l); return; }
    attn_vals_make(&v, B, T, D);
    y = fbuf(n); y2 = fbuf(n); R = fbuf(n); ref = dbuf(n);
    attn_rig_put(&r, &v);
    if (attn_rig_forward(&r, y)) {
        if (p > 0.0f) {   /* the residual mask the layer keeps; the attention mask (not kept) shows in y */
            int64_t i, bad = 0, drawn = 0, dropped = 0;
            amask = fbuf((int64_t)B * H * T * T); omask = fbuf(n);
            attn_mask(&r, amask);
            tget(r.aux[ATTN_OUT_MASK], omask);
            for (i = 0; i < n; ++i) {
                drawn++;
                dropped += omask[i] == 0.0f;
                bad += omask[i] != 0.0f && omask[i] != 1.0f / (1.0f - p);
            }
            CHECK(bad == 0, "%s: %lld residual mask entries are neither 0 nor 1/(1-p)", what, (long long)bad);
            CHECK(fabs((double)dropped / (double)drawn - p) < 0.15, "%s: dropped %lld of %lld", what, (long long)dropped,
                  (long long)drawn);
        }
        attn_ref(B, T, D, H, &v, amask, omask, ref);
        {
            double e = test_rel_error(y, ref, (size_t)n);
            CHECK(e <= 1e-5, "%s: forward against float64: normalised error %.3g", what, e);
        }
    }
    /* gradients: analytic, then central differences of L = sum(out .* R) over every element */
    for (k = 0; k < n; ++k) R[k] = (float)rng_gauss();
    for (k = 0; k <= ATTN_PARAMS; ++k) g[k] = fbuf(k < ATTN_PARAMS ? r.pn[k] : n);
    attn_rig_put(&r, &v);
    if (attn_rig_forward(&r, NULL) && attn_rig_backward(&r, R, 1)) {
        const double eps = 1e-2;
        for (k = 0; k < ATTN_PARAMS; ++k) tget(r.grad[k], g[k]);
        tget(r.dx, g[ATTN_PARAMS]);
        for (k = 0; k <= ATTN_PARAMS; ++k) {
            float* t = k < ATTN_PARAMS ? v.p[k] : v.x;
            const int64_t m = k < ATTN_PARAMS ? r.pn[k] : n;
            double* num = dbuf(m), e;
            int64_t j;
            for (j = 0; j < m; ++j) {
                const float save = t[j];
                double lp, lm;
                t[j] = save + (float)eps;
                lp = attn_loss(&r, &v, R, y2);
                t[j] = save - (float)eps;
                lm = attn_loss(&r, &v, R, y2);
                t[j] = save;
                num[j] = (lp - lm) / ((double)(save + (float)eps) - (double)(save - (float)eps));
            }
            e = test_rel_error(g[k], num, (size_t)m);
            CHECK(e <= 2e-3, "%s: d L / d %s against central differences: normalised error %.3g", what, attn_names[k], e);
            free(num);
        }
        /* backward ADDS and keeps forward's buffers: two after one forward give twice */
        attn_rig_put(&r, &v);
        for (k = 0; k < ATTN_PARAMS; ++k) ATTN_MUST(mgpu_tensor_zero(r.grad[k]));
        if (attn_rig_forward(&r, NULL) && attn_rig_backward(&r, R, 1) && attn_rig_backward(&r, R, 0)) {
            for (k = 0; k < ATTN_PARAMS; ++k) {
                float* g2 = fbuf(r.pn[k]);
                double* twice = dbuf(r.pn[k]), e;
                int64_t j;
                tget(r.grad[k], g2);
                for (j = 0; j < r.pn[k]; ++j) twice[j] = 2.0 * g[k][j];
                e = test_rel_error(g2, twice, (size_t)r.pn[k]);
                CHECK(e <= 1e-6, "%s: two backward passes after one forward: d %s is not doubled (error %.3g)", what,
                      attn_names[k], e);
                free(g2); free(twice);
            }
        }
    }
    /* causality: changing x at position t0 of sample 0 changes no output before t0 */
    if (T > 1) {
        const int t0 = T / 2;
        int64_t i, before = 0, at = 0, others = 0;
        attn_rig_put(&r, &v);
        if (attn_rig_forward(&r, y)) {
            for (k = 0; k < D; ++k) v.x[(int64_t)t0 * D + k] += 0.5f;
            attn_rig_put(&r, &v);
            if (attn_rig_forward(&r, y2)) {
                for (i = 0; i < n; ++i) {
                    const int64_t b = i / ((int64_t)T * D), t = i / D % T;
                    if (b != 0 || t < t0) before += y[i] != y2[i];
                    else if (t == t0) at += y[i] != y2[i];
                    else others += y[i] != y2[i];
                }
                CHECK(before == 0, "%s: changing x at t = %d changed %lld outputs before it (or of other samples)", what,
                      t0, (long long)before);
                CHECK(at > 0, "%s: changing x at t = %d changed nothing at t = %d", what, t0, t0);
                if (t0 < T - 1) CHECK(others > 0, "%s: changing x at t = %d changed nothing after it", what, t0);
            }
            for (k = 0; k < D; ++k) v.x[(int64_t)t0 * D + k] -= 0.5f;
        }
    }
    for (k = 0; k <= ATTN_PARAMS; ++k) free(g[k]);
    free(y); free(y2); free(R); free(ref); free(amask); free(omask);
    attn_vals_free(&v);
    attn_rig_free(&r);
    mgpu_layer_destroy(l);
}

/* Dropout: evaluation ignores it (a p > 0 layer in evaluation gives the p = 0 layer's bits), and
   masks drawn by sample: two replicas of one sample each (first_row 0 and 1) draw what one
   device with both draws. */
static void attn_cpu_dropout(void) {
    const int B = 2, T = 6, D = 8, H = 2;
    const float p = 0.4f;
    const int64_t n = (int64_t)B * T * D, per = (int64_t)H * T * T;
    mgpu_layer* l = mgpu_layer_causal_self_attention(D, H, p);
    mgpu_layer* l0 = mgpu_layer_causal_self_attention(D, H, 0.0f);
    attn_rig r, r0, half;
    attn_vals v, vh;
    float *y = fbuf(n), *y0 = fbuf(n), *m = fbuf(B * per), *mo = fbuf(n), *hmo = fbuf(n / B), *hy = fbuf(n / B);
    int b, k, same_mask = 1, same_y = 1;
    if (!l || !l0) { CHECK(0, "attention dropout: create: %s", mgpu_last_error()); goto done; }
    CHECK(l->vt->aux_count(l) > l0->vt->aux_count(l0), "attention: dropout 0 declares %d aux buffers, dropout %g %d: "
          "no mask buffers without dropout", l0->vt->aux_count(l0), (double)p, l->vt->aux_count(l));
    attn_rig_make(&r, l, mgpu_device_cpu(), B, T, D, H);
    attn_rig_make(&r0, l0, mgpu_device_cpu(), B, T, D, H);
    attn_vals_make(&v, B, T, D);
    attn_rig_put(&r, &v);
    attn_rig_put(&r0, &v);
    r.ctx.training = 0;
    r0.ctx.training = 1;   /* dropout 0 in training: no dropout either */
    if (attn_rig_forward(&r, y) && attn_rig_forward(&r0, y0))
        CHECK(!memcmp(y, y0, (size_t)n * sizeof(float)), "attention: dropout %g in evaluation differs from dropout 0", (double)p);
    r.ctx.training = 1;
    if (attn_rig_forward(&r, y)) {
        CHECK(memcmp(y, y0, (size_t)n * sizeof(float)) != 0, "attention: dropout %g in training changed nothing", (double)p);
        attn_mask(&r, m);
        tget(r.aux[ATTN_OUT_MASK], mo);
    }
    /* by sample: sample b alone, with first_row b */
    vh = v;
    for (b = 0; b < B; ++b) {
        attn_rig_make(&half, l, mgpu_device_cpu(), 1, T, D, H);
        vh.x = v.x + (int64_t)b * T * D;
        attn_rig_put(&half, &vh);
        half.ctx.first_row = b;
        if (attn_rig_forward(&half, hy)) {
            tget(half.aux[ATTN_OUT_MASK], hmo);   /* the attention mask is not kept: it shows in y */
            same_mask &= !memcmp(hmo, mo + b * T * D, (size_t)T * D * sizeof(float));
            for (k = 0; k < T * D; ++k) same_y &= fabsf(hy[k] - y[b * T * D + k]) <= 1e-6f * (1.0f + fabsf(y[b * T * D + k]));
        }
        attn_rig_free(&half);
    }
    CHECK(same_mask, "attention: the residual mask of sample b alone (first_row b) differs from the whole batch's");
    CHECK(same_y, "attention: the output of sample b alone (first_row b) differs from the whole batch's");
    /* the two dropouts draw from distinct counters: the residual mask is not the attention mask's start */
    CHECK(memcmp(m, mo, (size_t)T * sizeof(float)) != 0 || memcmp(m + T, mo + T, (size_t)T * sizeof(float)) != 0,
          "attention: the two dropout masks look alike");
    attn_vals_free(&v);
    attn_rig_free(&r);
    attn_rig_free(&r0);
done:
    mgpu_layer_destroy(l);
    mgpu_layer_destroy(l0);
    free(y); free(y0); free(m); free(mo); free(hmo); free(hy);
}

/* The layer in a model: names, shapes, GPT-2's initialisation, forward through the model's own
   aux buffers against float64; a wrong input shape fails at create. */
static void attn_model(void) {
    const int B = 3, T = 7, D = 16, H = 4;
    mgpu_layer* layers[1];
    mgpu_model_desc desc;
    mgpu_model* m;
    static const char* names[4] = { "0.c_attn.weight", "0.c_attn.bias", "0.c_proj.weight", "0.c_proj.bias" };
    int i;
    memset(&desc, 0, sizeof desc);
    layers[0] = mgpu_layer_causal_self_attention(D, H, 0.1f);
    desc.input = mgpu_shape2(T, D);
    desc.layers = layers;
    desc.layer_count = 1;
    desc.seed = 7;
    m = mgpu_model_create(&desc);
    CHECK(m != NULL, "attention model: %s", mgpu_last_error());
    if (!m) return;
    CHECK(!strcmp(mgpu_layer_type(layers[0]), "CausalSelfAttention"), "attention: type '%s'", mgpu_layer_type(layers[0]));
    CHECK(mgpu_model_tensor_count(m) == 4, "attention model: %d tensors", mgpu_model_tensor_count(m));
    CHECK(mgpu_model_param_count(m) == 4 * D * D + 4 * D, "attention model: %lld parameters, expected %d",
          (long long)mgpu_model_param_count(m), 4 * D * D + 4 * D);
    for (i = 0; i < 4 && i < mgpu_model_tensor_count(m); ++i) {
        const mgpu_tensor* t = mgpu_model_tensor(m, 0, i);
        const int64_t want0 = i == 1 ? 3 * D : D;   /* [in, out]: c_attn.weight [D, 3D] */
        const int64_t n = mgpu_tensor_numel(t);
        int64_t j;
        float* h = fbuf(n);
        double mean = 0.0, sq = 0.0;
        CHECK(!strcmp(mgpu_model_tensor_name(m, i), names[i]), "attention model: tensor %d is '%s', expected '%s'", i,
              mgpu_model_tensor_name(m, i), names[i]);
        CHECK(mgpu_tensor_dim(t, 0) == want0 && mgpu_tensor_shape(t).ndim == (i % 2 == 0 ? 2 : 1) &&
              (i % 2 == 1 || mgpu_tensor_dim(t, 1) == (i == 0 ? 3 * D : D)), "attention model: %s has the wrong shape", names[i]);
        tget(t, h);
        for (j = 0; j < n; ++j) { mean += h[j]; sq += (double)h[j] * h[j]; }
        mean /= (double)n;
        if (i % 2 == 1) CHECK(sq == 0.0, "attention model: %s is not zero at init", names[i]);
        else CHECK(fabs(mean) < 0.005 && fabs(sqrt(sq / (double)n - mean * mean) - 0.02) < 0.003,
                   "attention model: %s has mean %.4g, std %.4g at init, expected N(0, 0.02)", names[i], mean,
                   sqrt(sq / (double)n - mean * mean));
        free(h);
    }
    {   /* the model's forward (evaluation: no dropout) against float64 */
        attn_vals v;
        const int64_t n = (int64_t)B * T * D;
        mgpu_tensor* x;
        const mgpu_tensor* out;
        float* y = fbuf(n);
        double* ref = dbuf(n);
        attn_vals_make(&v, B, T, D);
        for (i = 0; i < 4; ++i) tput(mgpu_model_tensor(m, 0, i), v.p[i]);
        x = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), v.x);
        out = mgpu_model_forward(m, 0, x, 0);
        CHECK(out != NULL, "attention model: forward: %s", mgpu_last_error());
        if (out) {
            double e;
            CHECK(mgpu_shape_equal(mgpu_tensor_shape(out), mgpu_shape3(B, T, D)), "attention model: output shape");
            tget(out, y);
            attn_ref(B, T, D, H, &v, NULL, NULL, ref);
            e = test_rel_error(y, ref, (size_t)n);
            CHECK(e <= 1e-5, "attention model: forward against float64: normalised error %.3g", e);
        }
        mgpu_tensor_destroy(x);
        attn_vals_free(&v);
        free(y); free(ref);
    }
    ATTN_MUST(mgpu_model_destroy(m));
    /* the input must be [batch, T, dim] */
    layers[0] = mgpu_layer_causal_self_attention(D, H, 0.0f);
    desc.input = mgpu_shape2(T, D + 1);
    m = mgpu_model_create(&desc);
    CHECK(m == NULL, "attention model: input [%d, %d] accepted for dim %d", T, D + 1, D);
    if (m) mgpu_model_destroy(m);
    else expect_fail(mgpu_last_result(), MGPU_ERROR_SHAPE_MISMATCH, "attention on [T, dim + 1]", "CausalSelfAttention", "[batch,T,16]", NULL);
}

/* A model of one attention layer on set, input [T, dim], MSE (a desc.graph of `graph`) */
static mgpu_model* attn_one_layer(mgpu_device_set* set, int T, int D, int H, float p, uint64_t seed, int graph) {
    mgpu_layer* layer = mgpu_layer_causal_self_attention(D, H, p);
    mgpu_model_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.input = mgpu_shape2(T, D);
    desc.layers = &layer;
    desc.layer_count = 1;
    desc.devices = set;
    desc.loss = MGPU_LOSS_MSE;
    desc.seed = seed;
    desc.graph = graph;
    return mgpu_model_create(&desc);
}

/* A training step (MSE on [batch, T, dim], SGD) with both dropouts on "cpu" and on "cpu:2": the
   replicas' masks are drawn by sample, so two replicas of two samples each take the step one
   device takes (to rounding: the replicas' gradients are summed in another order). */
static double attn_step(const char* spec, float p, const float* xs, const float* ts, int B, int T, int D, int H, float* change,
                        size_t* bytes) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_optimizer_desc od;
    mgpu_model* m = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_tensor *x = NULL, *t = NULL;
    float loss = NAN;
    mgpu_result r;
    if (!set) { CHECK(0, "attention step: %s: %s", spec, mgpu_last_error()); return NAN; }
    m = attn_one_layer(set, T, D, H, p, 5, 0);
    memset(&od, 0, sizeof od);
    od.kind = MGPU_SGD;
    od.lr = 0.5f;
    if (m) opt = mgpu_optimizer_create(m, &od);
    CHECK(m && opt, "attention step on %s: %s", spec, mgpu_last_error());
    if (m && opt) {
        float* before;
        size_t i;
        x = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), xs);
        t = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), ts);
        *bytes = mgpu_tensor_bytes(mgpu_model_params(m, 0));
        before = fbuf((int64_t)(*bytes / sizeof(float)));
        tget(mgpu_model_params(m, 0), before);
        r = mgpu_model_train_step(m, opt, x, t, &loss);
        CHECK(r == MGPU_OK, "attention step on %s: %s", spec, mgpu_last_error());
        tget(mgpu_model_params(m, 0), change);
        for (i = 0; i < *bytes / sizeof(float); ++i) change[i] -= before[i];   /* the step's change */
        free(before);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(opt);
    if (m) mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return loss;
}
static void attn_replicas(void) {
    const int B = 4, T = 6, D = 8, H = 2;
    const int64_t n = (int64_t)B * T * D;
    float *xs = fbuf(n), *ts = fbuf(n), *p1 = fbuf(4 * D * D + 4 * D + 64), *p2 = fbuf(4 * D * D + 4 * D + 64),
          *p0 = fbuf(4 * D * D + 4 * D + 64);
    size_t b1 = 0, b2 = 0, b0 = 0;
    double l1, l2, l0;
    int64_t i;
    for (i = 0; i < n; ++i) { xs[i] = (float)rng_gauss(); ts[i] = (float)(0.1 * rng_gauss()); }
    l1 = attn_step("cpu", 0.3f, xs, ts, B, T, D, H, p1, &b1);
    l2 = attn_step("cpu:2", 0.3f, xs, ts, B, T, D, H, p2, &b2);
    l0 = attn_step("cpu", 0.0f, xs, ts, B, T, D, H, p0, &b0);
    CHECK(b1 == b2 && b1 > 0 && b1 <= (size_t)(4 * D * D + 4 * D + 64) * sizeof(float), "attention step: flat buffers of %zu and %zu bytes", b1, b2);
    if (b1 == b2 && b1 > 0 && b1 <= (size_t)(4 * D * D + 4 * D + 64) * sizeof(float)) {
        double e = attn_rel(p2, p1, (int64_t)(b1 / sizeof(float)));
        CHECK(fabs(l1 - l2) <= 1e-6 * fabs(l1), "attention step with dropout: loss %.9g on cpu, %.9g on cpu:2", l1, l2);
        CHECK(e <= 1e-5, "attention step with dropout: the parameters' change on cpu:2 differs from cpu's: normalised error %.3g", e);
        CHECK(l0 != l1 && attn_rel(p0, p1, (int64_t)(b1 / sizeof(float))) > 1e-2,
              "attention step: dropout 0.3 gave the step of dropout 0 (loss %.9g)", l0);
    }
    free(xs); free(ts); free(p1); free(p2); free(p0);
}

static void attn_create_errors(void) {
    mgpu_layer* l;
    l = mgpu_layer_causal_self_attention(10, 3, 0.0f);
    CHECK(l == NULL, "attention: dim 10, heads 3 accepted");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "attention dim 10 heads 3", "mgpu_layer_causal_self_attention",
                "dim 10", "heads 3");
    mgpu_layer_destroy(l);
    l = mgpu_layer_causal_self_attention(0, 1, 0.0f);
    CHECK(l == NULL, "attention: dim 0 accepted");
    mgpu_layer_destroy(l);
    l = mgpu_layer_causal_self_attention(8, 0, 0.0f);
    CHECK(l == NULL, "attention: heads 0 accepted");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "attention heads 0", "heads 0", NULL, NULL);
    mgpu_layer_destroy(l);
    l = mgpu_layer_causal_self_attention(8, 2, 1.0f);
    CHECK(l == NULL, "attention: dropout 1 accepted");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "attention dropout 1", "dropout 1", NULL, NULL);
    mgpu_layer_destroy(l);
    l = mgpu_layer_causal_self_attention(8, 2, -0.1f);
    CHECK(l == NULL, "attention: dropout -0.1 accepted");
    mgpu_layer_destroy(l);
    l = mgpu_layer_causal_self_attention(8, 8, 0.0f);   /* head size 1 */
    CHECK(l != NULL, "attention: dim 8, heads 8: %s", mgpu_last_error());
    mgpu_layer_destroy(l);
}

/* A hand-made ctx with wrong tensors gets a clear error, never a read past a tensor. */
static void attn_misuse(void) {
    mgpu_layer* l = mgpu_layer_causal_self_attention(8, 2, 0.0f);
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tensor *bad_x, *bad_aux, *bad_dy, *keep;
    attn_rig r;
    if (!l) { CHECK(0, "attention misuse: create: %s", mgpu_last_error()); return; }
    attn_rig_make(&r, l, cpu, 2, 5, 8, 2);
    bad_x = tmake(cpu, MGPU_F32, mgpu_shape3(2, 5, 9));
    bad_aux = tmake(cpu, MGPU_F32, mgpu_shape3(2, 2, 4));
    bad_dy = tmake(cpu, MGPU_F32, mgpu_shape3(2, 4, 8));
    expect_fail(l->vt->forward(l, &r.ctx, bad_x, r.y), MGPU_ERROR_SHAPE_MISMATCH, "attention forward on [2,5,9]",
                "CausalSelfAttention", "[batch,T,8]", NULL);
    expect_fail(l->vt->forward(l, &r.ctx, r.x, bad_x), MGPU_ERROR_SHAPE_MISMATCH, "attention forward into y [2,5,9]",
                "CausalSelfAttention(dim 8, heads 2) forward", "'y'", NULL);
    keep = r.aux[1];
    r.aux[1] = bad_aux;
    expect_fail(l->vt->forward(l, &r.ctx, r.x, r.y), MGPU_ERROR_SHAPE_MISMATCH, "attention forward with aux[1] [2,2,4]",
                "aux[1]", "[2,2,5]", NULL);
    r.aux[1] = keep;
    ATTN_MUST(mgpu_tensor_zero(r.x));
    ATTN_MUST(l->vt->forward(l, &r.ctx, r.x, r.y));
    expect_fail(l->vt->backward(l, &r.ctx, r.x, r.y, bad_dy, r.dx), MGPU_ERROR_SHAPE_MISMATCH, "attention backward with dy [2,4,8]",
                "backward", "'dy'", NULL);
    r.ctx.aux = NULL;
    expect_fail(l->vt->forward(l, &r.ctx, r.x, r.y), MGPU_ERROR_INVALID_ARGUMENT, "attention forward without aux", "aux", NULL, NULL);
    r.ctx.aux = r.aux;
    mgpu_tensor_destroy(bad_x);
    mgpu_tensor_destroy(bad_aux);
    mgpu_tensor_destroy(bad_dy);
    attn_rig_free(&r);
    mgpu_layer_destroy(l);
}

/* The GPU twin of one configuration: same inputs on the CPU and on g_gpu; forward, the masks
   (bit for bit), every gradient and dx within 1e-5; a second GPU run gives the same bits. */
static void attn_gpu_case(int B, int T, int D, int H, float p, int training) {
    mgpu_layer* l = mgpu_layer_causal_self_attention(D, H, p);
    attn_rig c, g;
    attn_vals v;
    const int64_t n = (int64_t)B * T * D;
    float *yc = fbuf(n), *yg = fbuf(n), *R = fbuf(n), *a = NULL, *b = NULL;
    char what[112];
    int k, ok;
    snprintf(what, sizeof what, "cuda attention B%d T%d dim %d heads %d p %g%s", B, T, D, H, (double)p,
             training ? "" : " (evaluation)");
    if (!l) { CHECK(0, "%s: create: %s", what, mgpu_last_error()); free(yc); free(yg); free(R); return; }
    attn_rig_make(&c, l, mgpu_device_cpu(), B, T, D, H);
    attn_rig_make(&g, l, g_gpu, B, T, D, H);
    c.ctx.training = g.ctx.training = training;
    attn_vals_make(&v, B, T, D);
    for (k = 0; k < n; ++k) R[k] = (float)rng_gauss();
    attn_rig_put(&c, &v);
    attn_rig_put(&g, &v);
    ok = attn_rig_forward(&c, yc) && attn_rig_forward(&g, yg);
    if (ok) {
        double e = attn_rel(yg, yc, n);
        CHECK(e <= 1e-5, "%s: forward against the CPU: normalised error %.3g", what, e);
        if (p > 0.0f && training) {   /* the attention mask shows in y */
            const int64_t na = mgpu_tensor_numel(c.aux[ATTN_OUT_MASK]);
            a = fbuf(na); b = fbuf(na);
            tget(c.aux[ATTN_OUT_MASK], a);
            tget(g.aux[ATTN_OUT_MASK], b);
            CHECK(!memcmp(a, b, (size_t)na * sizeof(float)), "%s: the residual dropout mask differs from the CPU's", what);
            free(a); free(b);
            a = b = NULL;
        }
    }
    if (ok && attn_rig_backward(&c, R, 1) && attn_rig_backward(&g, R, 1)) {
        float* first[ATTN_PARAMS + 1];
        for (k = 0; k <= ATTN_PARAMS; ++k) {
            const int64_t m = k < ATTN_PARAMS ? c.pn[k] : n;
            double e;
            a = fbuf(m); b = fbuf(m);
            tget(k < ATTN_PARAMS ? c.grad[k] : c.dx, a);
            tget(k < ATTN_PARAMS ? g.grad[k] : g.dx, b);
            e = attn_rel(b, a, m);
            CHECK(e <= 1e-5, "%s: d %s against the CPU: normalised error %.3g", what, attn_names[k], e);
            first[k] = b;
            free(a);
        }
        /* deterministic: the same forward and backward again give the same bits */
        for (k = 0; k < ATTN_PARAMS; ++k) ATTN_MUST(mgpu_tensor_zero(g.grad[k]));
        if (attn_rig_forward(&g, NULL) && attn_rig_backward(&g, R, 1)) {
            int same = 1;
            for (k = 0; k <= ATTN_PARAMS; ++k) {
                const int64_t m = k < ATTN_PARAMS ? c.pn[k] : n;
                b = fbuf(m);
                tget(k < ATTN_PARAMS ? g.grad[k] : g.dx, b);
                same &= !memcmp(b, first[k], (size_t)m * sizeof(float));
                free(b);
            }
            CHECK(same, "%s: a second forward and backward gave other bits", what);
            /* and a second backward after that forward doubles */
            if (attn_rig_backward(&g, R, 0)) {
                for (k = 0; k < ATTN_PARAMS; ++k) {
                    double* twice = dbuf(c.pn[k]), e;
                    int64_t j;
                    b = fbuf(c.pn[k]);
                    tget(g.grad[k], b);
                    for (j = 0; j < c.pn[k]; ++j) twice[j] = 2.0 * first[k][j];
                    e = test_rel_error(b, twice, (size_t)c.pn[k]);
                    CHECK(e <= 1e-6, "%s: two backward passes after one forward: d %s is not doubled (error %.3g)", what,
                          attn_names[k], e);
                    free(b); free(twice);
                }
            }
        }
        for (k = 0; k <= ATTN_PARAMS; ++k) free(first[k]);
    }
    /* causality on the GPU */
    if (T > 1 && training) {
        const int t0 = T - 2;
        int64_t i, before = 0;
        attn_rig_put(&g, &v);
        if (attn_rig_forward(&g, yc)) {
            for (k = 0; k < D; ++k) v.x[(int64_t)t0 * D + k] += 0.5f;
            attn_rig_put(&g, &v);
            if (attn_rig_forward(&g, yg))
                for (i = 0; i < n; ++i)
                    before += (i / ((int64_t)T * D) != 0 || i / D % T < t0) && yc[i] != yg[i];
            CHECK(before == 0, "%s: changing x at t = %d changed %lld outputs before it", what, t0, (long long)before);
        }
    }
    attn_vals_free(&v);
    attn_rig_free(&c);
    attn_rig_free(&g);
    mgpu_layer_destroy(l);
    free(yc); free(yg); free(R);
}

/* The layer in a model on the GPU: the same initialisation (Philox) and forward as on the CPU. */
static void attn_gpu_model(void) {
#ifdef MGPU_CUDA
    const int B = 2, T = 5, D = 8, H = 2;
    mgpu_layer* lc[1];
    mgpu_layer* lg[1];
    mgpu_model_desc desc;
    mgpu_model *mc, *mg;
    attn_vals v;
    mgpu_tensor *xc, *xg;
    const mgpu_tensor *oc, *og;
    const int64_t n = (int64_t)B * T * D;
    float *yc = fbuf(n), *yg = fbuf(n), *pc = NULL, *pg = NULL;
    lc[0] = mgpu_layer_causal_self_attention(D, H, 0.0f);
    lg[0] = mgpu_layer_causal_self_attention(D, H, 0.0f);
    memset(&desc, 0, sizeof desc);
    desc.input = mgpu_shape2(T, D);
    desc.layer_count = 1;
    desc.seed = 3;
    desc.layers = lc;
    mc = mgpu_model_create(&desc);
    desc.layers = lg;
    desc.devices = g_gpu_set;
    mg = mgpu_model_create(&desc);
    CHECK(mc && mg, "cuda attention model: %s", mgpu_last_error());
    if (mc && mg) {
        const size_t bytes = mgpu_tensor_bytes(mgpu_model_params(mc, 0));   /* the flat buffer, padding and all */
        pc = fbuf((int64_t)(bytes / sizeof(float)));
        pg = fbuf((int64_t)(bytes / sizeof(float)));
        CHECK(mgpu_tensor_bytes(mgpu_model_params(mg, 0)) == bytes, "cuda attention model: flat buffers of %zu and %zu bytes",
              mgpu_tensor_bytes(mgpu_model_params(mg, 0)), bytes);
        tget(mgpu_model_params(mc, 0), pc);
        if (mgpu_tensor_bytes(mgpu_model_params(mg, 0)) == bytes) tget(mgpu_model_params(mg, 0), pg);
        CHECK(!memcmp(pc, pg, bytes), "cuda attention model: initial parameters differ from the CPU's");
        attn_vals_make(&v, B, T, D);
        xc = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), v.x);
        xg = tfrom(g_gpu, mgpu_shape3(B, T, D), v.x);
        oc = mgpu_model_forward(mc, 0, xc, 0);
        og = mgpu_model_forward(mg, 0, xg, 0);
        CHECK(oc && og, "cuda attention model: forward: %s", mgpu_last_error());
        if (oc && og) {
            double e;
            tget(oc, yc);
            tget(og, yg);
            e = attn_rel(yg, yc, n);
            CHECK(e <= 1e-5, "cuda attention model: forward against the CPU's: normalised error %.3g", e);
        }
        mgpu_tensor_destroy(xc);
        mgpu_tensor_destroy(xg);
        attn_vals_free(&v);
    }
    if (mc) mgpu_model_destroy(mc);
    if (mg) mgpu_model_destroy(mg);
    free(yc); free(yg); free(pc); free(pg);
#endif
}

/* Steps of a GPU model with both dropouts, eager and as a CUDA graph's replays (whose kernels read
   each step's key on the device): the same bits after every step. */
static void attn_gpu_graph(int D, int H) {
#ifdef MGPU_CUDA
    const int B = 3, T = 7, steps = 4;
    const int64_t n = (int64_t)B * T * D;
    mgpu_model* m[2] = { NULL, NULL };
    mgpu_optimizer* opt[2] = { NULL, NULL };
    float *xs = fbuf(n), *ts = fbuf(n), *p[2] = { NULL, NULL };
    mgpu_tensor *x, *t;
    size_t bytes = 0;
    int k, step, same = 1;
    for (k = 0; k < n; ++k) { xs[k] = (float)rng_gauss(); ts[k] = (float)(0.1 * rng_gauss()); }
    x = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), xs);
    t = tfrom(mgpu_device_cpu(), mgpu_shape3(B, T, D), ts);
    for (k = 0; k < 2; ++k) {
        mgpu_optimizer_desc od;
        m[k] = attn_one_layer(g_gpu_set, T, D, H, 0.3f, 9, k);
        memset(&od, 0, sizeof od);
        od.kind = MGPU_SGD;
        od.lr = 0.5f;
        if (m[k]) opt[k] = mgpu_optimizer_create(m[k], &od);
        CHECK(m[k] && opt[k], "cuda attention graph %d: %s", k, mgpu_last_error());
    }
    if (opt[0] && opt[1]) {
        bytes = mgpu_tensor_bytes(mgpu_model_params(m[0], 0));
        p[0] = fbuf((int64_t)(bytes / sizeof(float)));
        p[1] = fbuf((int64_t)(bytes / sizeof(float)));
        for (step = 0; step < steps && same; ++step) {
            for (k = 0; k < 2; ++k) {
                mgpu_result r = mgpu_model_train_step(m[k], opt[k], x, t, NULL);
                if (r != MGPU_OK) CHECK(0, "cuda attention graph %d: step %d: %s", k, step, mgpu_last_error());
                tget(mgpu_model_params(m[k], 0), p[k]);
            }
            same = !memcmp(p[0], p[1], bytes);
            CHECK(same, "cuda attention: step %d replayed from a CUDA graph differs from the eager step", step);
        }
        CHECK(mgpu_model_graph_steps(m[1]) > 0, "cuda attention: no step was a CUDA graph's replay");
    }
    for (k = 0; k < 2; ++k) {
        mgpu_optimizer_destroy(opt[k]);
        if (m[k]) mgpu_model_destroy(m[k]);
        free(p[k]);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    free(xs); free(ts);
#else
    (void)D; (void)H;
#endif
}

/* The activation memory of a training step grows with T, not T^2: a layer that kept [B, heads,
   T, T] (dropout's mask too) would keep 64 times as much at 8 T; this one keeps 8 times as much,
   and the summary's figure is the step's growth of the bytes in use. On the CPU and g_gpu. */
static size_t attn_step_memory(const char* spec, int T) {
    const int B = 4, D = 64, H = 4;
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model* m = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_tensor *x = NULL, *t = NULL;
    size_t bytes = 0;
    if (!set) { CHECK(0, "attention memory: %s: %s", spec, mgpu_last_error()); return 0; }
    ATTN_MUST(mgpu_memory_empty_cache(mgpu_device_set_get(set, 0)));   /* blocks of the sizes asked for */
    m = attn_one_layer(set, T, D, H, 0.1f, 5, 0);
    if (m) opt = mgpu_optimizer_create(m, NULL);
    CHECK(m && opt, "attention memory on %s: %s", spec, mgpu_last_error());
    if (m && opt) {
        mgpu_device* dev = mgpu_device_set_get(set, 0);
        x = tmake(dev, MGPU_F32, mgpu_shape3(B, T, D));
        t = tmake(dev, MGPU_F32, mgpu_shape3(B, T, D));
        ATTN_MUST(mgpu_rand_normal(x, 1, 0, 0.0f, 1.0f));
        ATTN_MUST(mgpu_rand_normal(t, 2, 0, 0.0f, 1.0f));
        ATTN_MUST(mgpu_model_train_step(m, opt, x, t, NULL));
        bytes = mgpu_model_activation_bytes(m, 0, NULL);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(opt);
    if (m) mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return bytes;
}
/* T and 8 T: 8 times the activations when nothing [B, heads, T, T] is kept, 16 times or more with
   the probabilities (4 T floats a token against the rest's 452, 7 D, at 8 T = 128). Emulated GPUs
   run the kernels' O(T^2) work slowly, under ASan above all: there T is 16. */
static void attn_memory(const char* spec, int T) {
    const size_t small = attn_step_memory(spec, T), large = attn_step_memory(spec, 8 * T);
    CHECK(small > 0 && large >= 7 * small && large <= 9 * small,
          "attention memory on %s: a step's activations take %zu bytes at T %d and %zu at T %d: want 8 times as many "
          "(linear in T; the [B, heads, T, T] probabilities alone would be %zu bytes at T %d)", spec, small, T, large,
          8 * T, (size_t)4 * 4 * 8 * T * 8 * T * sizeof(float), 8 * T);
}

/* The core alone on g_gpu, fused kernels against the unfused ones (the path above the fused head
   size) on the same qkv and dy: y, dqkv within 1e-5; lse and drow against the CPU's. Random q and
   k of N(0, 1): scores of several units, so the running max changes from tile to tile. */
static void attn_gpu_fused_core(int B, int T, int H, int hs, float p) {
    const mgpu__attn g = { B, T, H, hs, 1.0f / sqrtf((float)hs) };
    const int64_t D = (int64_t)H * hs, nq = (int64_t)B * T * 3 * D, ny = (int64_t)B * T * D, nr = (int64_t)B * H * T;
    const uint64_t seed = 0x5eedull, offset = (uint64_t)2 << 40, first = 12345;
    mgpu_tensor *qkv[2], *dy[2], *y[3], *lse[2], *drow[2], *dqkv[3];
    float *hq = fbuf(nq), *hd = fbuf(ny), *a = fbuf(nq), *b = fbuf(nq);
    char what[96];
    int64_t i;
    int k, fused;
    snprintf(what, sizeof what, "cuda attention core B%d T%d heads %d head size %d p %g", B, T, H, hs, (double)p);
    for (i = 0; i < nq; ++i) hq[i] = (float)rng_gauss();
    for (i = 0; i < ny; ++i) hd[i] = (float)rng_gauss();
    for (k = 0; k < 3; ++k) {   /* 0: the CPU, 1: fused, 2: unfused (its y and dqkv only) */
        mgpu_device* dev = k == 0 ? mgpu_device_cpu() : g_gpu;
        y[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, T, D));
        dqkv[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, T, 3 * D));
        if (k == 2) continue;
        qkv[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, T, 3 * D));
        dy[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, T, D));
        lse[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, H, T));
        drow[k] = tmake(dev, MGPU_F32, mgpu_shape3(B, H, T));
        tput(qkv[k], hq);
        tput(dy[k], hd);
    }
    for (k = 0; k < 2; ++k) {
        ATTN_MUST(mgpu__attention_forward(&g, qkv[k], y[k], lse[k], seed, NULL, offset, first, p));
        ATTN_MUST(mgpu__attention_backward(&g, qkv[k], y[k], lse[k], dy[k], drow[k], dqkv[k], seed, NULL, offset, first, p));
    }
    /* a GPU with too little shared memory for these heads (MGPU_EMU_MAX_SHARED_OPTIN=65536, a
       Turing's) runs the unfused kernels instead, which write no lse or drow: y and dqkv are checked */
    fused = MGPU__CUDA(mgpu__cu_attention_fused_forward(MGPU__CUDA_ARGS(MGPU__DEV(qkv[1])), &g, MGPU__F32(qkv[1]), MGPU__F32(y[1]),
                                                       MGPU__F32(lse[1]), seed, NULL, offset, first, p)) != MGPU__CU_NO_ALGORITHM;
    if (!fused) printf("  %s: the fused kernels do not fit this GPU's shared memory: the unfused ones ran\n", what);
    ATTN_MUST(mgpu__attention_unfused(&g, qkv[1], y[2], NULL, NULL, seed, NULL, offset, first, p, "test"));
    ATTN_MUST(mgpu__attention_unfused(&g, qkv[1], NULL, dy[1], dqkv[2], seed, NULL, offset, first, p, "test"));
    tget(y[1], a); tget(y[2], b);
    CHECK(attn_rel(a, b, ny) <= 1e-5, "%s: fused y against unfused: normalised error %.3g", what, attn_rel(a, b, ny));
    tget(y[0], b);
    CHECK(attn_rel(a, b, ny) <= 1e-5, "%s: fused y against the CPU: normalised error %.3g", what, attn_rel(a, b, ny));
    tget(dqkv[1], a); tget(dqkv[2], b);
    CHECK(attn_rel(a, b, nq) <= 1e-5, "%s: fused dqkv against unfused: normalised error %.3g", what, attn_rel(a, b, nq));
    tget(dqkv[0], b);
    CHECK(attn_rel(a, b, nq) <= 1e-5, "%s: fused dqkv against the CPU: normalised error %.3g", what, attn_rel(a, b, nq));
    if (fused) {
        tget(lse[1], a); tget(lse[0], b);
        CHECK(attn_rel(a, b, nr) <= 1e-6, "%s: lse against the CPU's: normalised error %.3g", what, attn_rel(a, b, nr));
        tget(drow[1], a); tget(drow[0], b);
        CHECK(attn_rel(a, b, nr) <= 1e-5, "%s: drow against the CPU's: normalised error %.3g", what, attn_rel(a, b, nr));
    }
    for (k = 0; k < 3; ++k) {
        mgpu_tensor_destroy(y[k]);
        mgpu_tensor_destroy(dqkv[k]);
        if (k == 2) continue;
        mgpu_tensor_destroy(qkv[k]); mgpu_tensor_destroy(dy[k]); mgpu_tensor_destroy(lse[k]); mgpu_tensor_destroy(drow[k]);
    }
    free(hq); free(hd); free(a); free(b);
}

static void test_attention(void) {
    header("3. causal multi-head self-attention");
    attn_create_errors();
    attn_misuse();
    attn_cpu_case(2, 5, 8, 2, 0.0f);    /* several heads */
    attn_cpu_case(3, 5, 6, 1, 0.0f);    /* one head */
    attn_cpu_case(2, 1, 4, 1, 0.0f);    /* T = 1 */
    attn_cpu_case(1, 37, 8, 4, 0.0f);   /* T past 32 */
    attn_cpu_case(2, 5, 8, 2, 0.3f);    /* both dropouts, training: the same masks in every forward */
    attn_cpu_dropout();
    attn_memory("cpu", 64);
    attn_model();
    attn_replicas();
    if (gpu_part("attention")) {
        attn_gpu_case(2, 5, 8, 2, 0.0f, 1);
        attn_gpu_case(3, 5, 6, 1, 0.0f, 1);
        attn_gpu_case(2, 1, 4, 1, 0.0f, 1);
        attn_gpu_case(4, 37, 16, 4, 0.0f, 1);   /* 592 rows: more than the emulator's 61 blocks of 8 warps cover in one pass */
        attn_gpu_case(1, 37, 70, 1, 0.0f, 1);   /* head size 70: the 128-column kernels (lanes loop over it) */
        attn_gpu_case(4, 37, 16, 4, 0.4f, 1);   /* dropout: the CPU's masks */
        attn_gpu_case(2, 5, 8, 2, 0.4f, 0);     /* evaluation ignores it */
        attn_gpu_case(2, 70, 128, 2, 0.3f, 1);  /* the 64-column kernels' largest head size, three tiles of T, the last partial */
        attn_gpu_case(2, 70, 256, 2, 0.3f, 1);  /* the largest fused head size, 128 */
        attn_gpu_case(1, 37, 136, 1, 0.4f, 1);  /* dropout above the fused head size */
        attn_gpu_fused_core(2, 64, 3, 64, 0.0f);   /* T a whole number of tiles */
        attn_gpu_fused_core(1, 75, 2, 40, 0.25f);  /* a partial last tile, dropout */
        attn_gpu_fused_core(3, 33, 1, 1, 0.0f);    /* head size 1 */
        attn_gpu_fused_core(2, 33, 1, 65, 0.0f);   /* the 128-column kernels' smallest head size */
        attn_gpu_fused_core(1, 75, 2, 128, 0.25f); /* their largest, dropout, a partial last tile */
        attn_gpu_fused_core(1, 64, 3, 100, 0.0f);  /* a head of 3 whole lanes' columns and a part */
        attn_memory("cuda:0", 16);
        attn_gpu_model();
        attn_gpu_graph(8, 2);
        attn_gpu_graph(100, 1);   /* the 128-column kernels in the graph */
        attn_gpu_graph(136, 1);   /* above the fused head size: the unfused kernels' scratch in the graph */
    }
}

/* ============================================================================================ */
/* 4. containers                                                                                */
/* ============================================================================================ */
/* L = sum(out .* R) in float64 for input x (host) on model m's replica 0 */
static double box_loss(mgpu_model* m, mgpu_tensor* tx, const float* x, const float* R, int64_t ny) {
    const mgpu_tensor* out;
    float* y = fbuf(ny);
    double L = 0.0;
    int64_t i;
    tput(tx, x);
    out = mgpu_model_forward(m, 0, tx, 1);
    if (out) tget(out, y);
    else CHECK(0, "forward: %s", mgpu_last_error());
    for (i = 0; i < ny; ++i) L += (double)y[i] * R[i];
    free(y);
    return L;
}

/* Every parameter gradient and dx of a one-layer model against central differences; returns the
   model's output for the GPU twin. */
static void model_gradcheck(const char* what, mgpu_model* m, int B, int in, int out_features);
static void box_gradcheck(const char* what, mgpu_layer* box, int B, int in, int out_features, mgpu_device_set* set) {
    mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(in), .layers = &box, .layer_count = 1,
                                                          .devices = set, .seed = 3 });
    CHECK(m != NULL, "%s: model: %s", what, mgpu_last_error());
    if (m) model_gradcheck(what, m, B, in, out_features);
    mgpu_model_destroy(m);
}
/* (x [B, in] -> y [B, out]; the model is the caller's) */
static void model_gradcheck(const char* what, mgpu_model* m, int B, int in, int out_features) {
    mgpu_device* dev;
    mgpu_tensor *tx, *tr;
    float *x, *R, *flat, *g, *dx;
    double *num, e;
    int64_t nf, ny = (int64_t)B * out_features, i;
    const double h = 1e-2;
    dev = mgpu_model_device(m, 0);
    nf = mgpu_tensor_numel(mgpu_model_params(m, 0));
    x = fbuf((int64_t)B * in); R = fbuf(ny); flat = fbuf(nf); g = fbuf(nf); dx = fbuf((int64_t)B * in);
    for (i = 0; i < (int64_t)B * in; ++i) x[i] = (float)rng_gauss();
    for (i = 0; i < ny; ++i) R[i] = (float)rng_gauss();
    tx = tmake(dev, MGPU_F32, mgpu_shape2(B, in));
    tr = tmake(dev, MGPU_F32, mgpu_shape2(B, out_features));
    tput(tr, R);
    (void)box_loss(m, tx, x, R, ny);
    MUST(mgpu_model_zero_grad(m));
    MUST(mgpu_model_backward(m, 0, tr));
    tget(mgpu_model_grads(m, 0), g);
    {
        const mgpu_tensor* tdx = mgpu_model_input_grad(m, 0);
        if (tdx) tget(tdx, dx);
        else CHECK(0, "%s: input gradient: %s", what, mgpu_last_error());
    }
    tget(mgpu_model_params(m, 0), flat);
    num = dbuf(nf);
    for (i = 0; i < nf; ++i) {   /* (the padding between tensors has a zero gradient on both sides) */
        float save = flat[i];
        double lp, lm;
        flat[i] = save + (float)h; tput(mgpu_model_params(m, 0), flat);
        lp = box_loss(m, tx, x, R, ny);
        flat[i] = save - (float)h; tput(mgpu_model_params(m, 0), flat);
        lm = box_loss(m, tx, x, R, ny);
        flat[i] = save;
        num[i] = (lp - lm) / (2.0 * h);
    }
    tput(mgpu_model_params(m, 0), flat);
    e = test_rel_error(g, num, (size_t)nf);
    CHECK(e <= 2e-3, "%s on %s: parameter gradients against central differences: normalised error %.3g", what,
          mgpu_device_label(dev), e);
    free(num);
    num = dbuf((int64_t)B * in);
    for (i = 0; i < (int64_t)B * in; ++i) {
        float save = x[i];
        double lp, lm;
        x[i] = save + (float)h; lp = box_loss(m, tx, x, R, ny);
        x[i] = save - (float)h; lm = box_loss(m, tx, x, R, ny);
        x[i] = save;
        num[i] = (lp - lm) / (2.0 * h);
    }
    e = test_rel_error(dx, num, (size_t)B * (size_t)in);
    CHECK(e <= 2e-3, "%s on %s: dx against central differences: normalised error %.3g", what, mgpu_device_label(dev), e);
    free(num); free(x); free(R); free(flat); free(g); free(dx);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tr);
}

/* names (mgpu_layer_name), tied parameters, Linear without a bias and Hugging Face's Conv1D */
static void test_names_ties(void) {
    char path[512];
    mgpu_layer* layers[4];
    mgpu_model* m;
    int i, k;
    header("5. names, tied parameters, Linear without a bias, Conv1D");
    box_gradcheck("Linear 5->3 without a bias", mgpu_layer_linear_no_bias(5, 3), 3, 5, 3, NULL);
    box_gradcheck("Conv1D 5->3 (weight [in, out])", mgpu_layer_conv1d(5, 3), 3, 5, 3, NULL);
    {   /* GPT-2's block names */
        mgpu_layer* kids[3];
        const char* want[] = { "enc.weight", "enc.bias", "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight",
                               "h.0.mlp.c_proj.bias", "2.weight" };
        kids[0] = mgpu_layer_name(mgpu_layer_conv1d(4, 8), "c_fc");
        kids[1] = mgpu_layer_tanh();
        kids[2] = mgpu_layer_name(mgpu_layer_conv1d(8, 4), "c_proj");
        layers[0] = mgpu_layer_name(mgpu_layer_linear(3, 4), "enc");
        layers[1] = mgpu_layer_name(mgpu_layer_residual(mgpu_layer_name(mgpu_layer_sequential(kids, 3), "mlp"), NULL), "h.0");
        layers[2] = mgpu_layer_linear_no_bias(4, 3);
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 3 });
        CHECK(m && mgpu_model_tensor_count(m) == 7, "named model: %s", m ? "7 tensors" : mgpu_last_error());
        for (i = 0; m && i < 7 && i < mgpu_model_tensor_count(m); ++i)
            CHECK(!strcmp(mgpu_model_tensor_name(m, i), want[i]), "tensor %d is '%s', want '%s'", i, mgpu_model_tensor_name(m, i), want[i]);
        if (m) {
            const float* w;
            mgpu_tensor* cpu = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(4, 8));
            float v[32];
            double mean = 0, sq = 0;
            MUST(mgpu_tensor_copy(cpu, mgpu_model_param(m, 0, "h.0.mlp.c_fc.weight")));
            tget(cpu, v);
            w = v;
            for (i = 0; i < 32; ++i) { mean += w[i] / 32.0; sq += (double)w[i] * w[i] / 32.0; }
            CHECK(fabs(mean) < 0.02 && sqrt(sq) > 0.01 && sqrt(sq) < 0.04, "Conv1D's init N(0, 0.02): mean %.4f, rms %.4f", mean, sqrt(sq));
            mgpu_tensor_destroy(cpu);
        }
        mgpu_model_destroy(m);
        CHECK(mgpu_layer_name(mgpu_layer_relu(), "a name of more than forty-seven bytes, which is too long") == NULL &&
              strstr(mgpu_last_error(), "47"), "a long name refused: %s", mgpu_last_error());
    }
    /* a tie: the head's weight is the first layer's (an autoencoder's, [4, 3] both) */
    for (i = 0; i < 2; ++i) {
        const mgpu_tie tie = { "head.weight", "enc.weight" };
        mgpu_model* m2;
        float *a, *b;
        int64_t n;
        layers[0] = mgpu_layer_name(mgpu_layer_linear(3, 4), "enc");
        layers[1] = mgpu_layer_tanh();
        layers[2] = mgpu_layer_name(mgpu_layer_linear_no_bias(4, 3), "head");   /* weight [3, 4]: not the same shape */
        if (i == 1) {
            mgpu_layer_destroy(layers[2]);
            layers[2] = mgpu_layer_name(mgpu_layer_conv1d(4, 3), "head");   /* weight [in, out] = [4, 3]: enc's shape */
        }
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 3, .ties = &tie,
                                                  .tie_count = 1, .seed = 9 });
        if (i == 0) {
            CHECK(m == NULL && mgpu_last_result() == MGPU_ERROR_SHAPE_MISMATCH && strstr(mgpu_last_error(), "[3,4]"),
                  "a tie of two shapes refused: %s", mgpu_last_error());
            mgpu_model_destroy(m);
            continue;
        }
        CHECK(m != NULL, "tied model: %s", mgpu_last_error());
        if (!m) continue;
        CHECK(mgpu_model_param_count(m) == 4 * 3 + 4 + 3, "a tied parameter counts once: %lld", (long long)mgpu_model_param_count(m));
        {   /* the tied tensor starts as its twin; each use's gradient apart, then one update of their sum moves both */
            float e0[12], h0[12], ge[12], gh[12], e1[12], h1[12], x[6] = { 0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.5f };
            const int32_t y[2] = { 2, 0 };
            mgpu_tensor *tx = tfrom(mgpu_device_cpu(), mgpu_shape2(2, 3), x), *ty = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(2), y);
            mgpu_optimizer* sgd = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.5f });
            double worst = 0.0;
            tget(mgpu_model_param(m, 0, "enc.weight"), e0);
            tget(mgpu_model_param(m, 0, "head.weight"), h0);
            CHECK(!memcmp(e0, h0, sizeof e0), "the tied tensor starts as its twin");
            MUST(mgpu_model_accumulate(m, tx, ty, 0, NULL));
            tget(mgpu_model_grad(m, 0, "enc.weight"), ge);
            tget(mgpu_model_grad(m, 0, "head.weight"), gh);
            MUST(mgpu_optimizer_step(sgd));
            tget(mgpu_model_param(m, 0, "enc.weight"), e1);
            tget(mgpu_model_param(m, 0, "head.weight"), h1);
            for (k = 0; k < 12; ++k) worst = fmax(worst, fabs((double)e1[k] - ((double)e0[k] - 0.5 * ((double)ge[k] + (double)gh[k]))));
            CHECK(worst < 1e-6 && !memcmp(e1, h1, sizeof e1), "one SGD step moves the tie by the sum of both gradients (error %.3g) "
                  "and the tied tensor follows its twin (%s)", worst, memcmp(e1, h1, sizeof e1) ? "it does not" : "bit for bit");
            mgpu_optimizer_destroy(sgd);
            {   /* one tensor, one optimizer state: a tied one's is its twin's (the copy at the model's end,
                   which the update skips, has none of its own) */
                mgpu_optimizer* adam = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = 0.01f });
                mgpu_tensor* se = adam ? mgpu_optimizer_state(adam, 0, "enc.weight", "exp_avg") : NULL;
                mgpu_tensor* sh = adam ? mgpu_optimizer_state(adam, 0, "head.weight", "exp_avg") : NULL;
                float a[12], b[12];
                int nonzero = 0;
                CHECK(se && sh, "AdamW's states of a tie: %s", mgpu_last_error());
                if (se && sh) {
                    MUST(mgpu_model_zero_grad(m));
                    MUST(mgpu_model_accumulate(m, tx, ty, 0, NULL));
                    MUST(mgpu_optimizer_step(adam));
                    tget(se, a);
                    tget(sh, b);
                    for (k = 0; k < 12; ++k) nonzero += a[k] != 0.0f;
                    CHECK(nonzero > 0 && !memcmp(a, b, sizeof a), "a tied tensor's exp_avg is its twin's (%d of 12 moved, %s)",
                          nonzero, memcmp(a, b, sizeof a) ? "they differ" : "the same");
                    tget(mgpu_model_param(m, 0, "enc.weight"), e1);
                    tget(mgpu_model_param(m, 0, "head.weight"), h1);
                    CHECK(!memcmp(e1, h1, sizeof e1) && memcmp(e1, e0, sizeof e1), "after AdamW the tied tensor is its twin, moved");
                }
                mgpu_optimizer_destroy(adam);
            }
            mgpu_tensor_destroy(tx);
            mgpu_tensor_destroy(ty);
        }
        model_gradcheck("tied Linear 3->4, Tanh, Conv1D 4->3 (each use's gradient)", m, 3, 3, 3);
        snprintf(path, sizeof path, "%s/mgpu_test_seq_tie_%ld.safetensors", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", test_getpid());
        MUST(mgpu_model_save(m, NULL, path));
        {
            mgpu_safetensors* st = mgpu_safetensors_open(path);
            CHECK(st && mgpu_safetensors_count(st) == 3 && mgpu_safetensors_find(st, "head.weight") < 0,
                  "the file stores the tied tensor once (under enc.weight): %d tensors", st ? mgpu_safetensors_count(st) : -1);
            mgpu_safetensors_close(st);
        }
        layers[0] = mgpu_layer_name(mgpu_layer_linear(3, 4), "enc");
        layers[1] = mgpu_layer_tanh();
        layers[2] = mgpu_layer_name(mgpu_layer_conv1d(4, 3), "head");
        m2 = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 3, .ties = &tie,
                                                   .tie_count = 1, .seed = 10 });
        if (m2) {
            MUST(mgpu_model_load(m2, NULL, path));
            n = mgpu_tensor_numel(mgpu_model_params(m, 0));
            a = fbuf(n); b = fbuf(n);
            tget(mgpu_model_params(m, 0), a);
            tget(mgpu_model_params(m2, 0), b);
            CHECK(mgpu_tensor_numel(mgpu_model_params(m2, 0)) == n && !memcmp(a, b, (size_t)n * sizeof(float)),
                  "a tied model loads what it saved");
            free(a); free(b);
        }
        mgpu_model_destroy(m2);
        remove(path);
        mgpu_model_destroy(m);
        {   /* across pipeline stages: the two ends on two devices, the same bits as one device's */
            mgpu_device_set* two = mgpu_device_set_create("cpu:2");
            layers[0] = mgpu_layer_name(mgpu_layer_linear(3, 4), "enc");
            layers[1] = mgpu_layer_tanh();
            layers[2] = mgpu_layer_name(mgpu_layer_conv1d(4, 3), "head");
            m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 3, .ties = &tie,
                                                      .tie_count = 1, .devices = two, .stages = 2, .split = (const int[]){ 2 }, .seed = 9 });
            CHECK(m != NULL && mgpu_model_stage_count(m) == 2, "a tie across 2 stages: %s", mgpu_last_error());
            mgpu_model_destroy(m);
            mgpu_device_set_destroy(two);
        }
    }
    {
        const mgpu_tie bad = { "head.weight", "nothing.weight" };
        layers[0] = mgpu_layer_linear(3, 4);
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 1, .ties = &bad, .tie_count = 1 });
        CHECK(m == NULL && strstr(mgpu_last_error(), "no parameter of that name"), "a tie of unknown names refused: %s", mgpu_last_error());
    }
}

static mgpu_layer* mlp_block(int d, int hidden) {
    mgpu_layer* kids[3];
    kids[0] = mgpu_layer_linear(d, hidden);
    kids[1] = mgpu_layer_tanh();
    kids[2] = mgpu_layer_linear(hidden, d);
    return mgpu_layer_sequential(kids, 3);
}

#ifdef MGPU_CUDA
/* GPT's MLP as a residual block, x + Conv1D(GELU(Linear(x))), the GELU's tanh form */
static mgpu_layer* gpt_mlp_block(int C, int hidden) {
    mgpu_layer* kids[3];
    kids[0] = mgpu_layer_linear(C, hidden);
    kids[1] = mgpu_layer_gelu_tanh();
    kids[2] = mgpu_layer_conv1d(hidden, C);
    return mgpu_layer_residual(mgpu_layer_sequential(kids, 3), NULL);
}
#endif
/* GPT's MLP, x + Conv1D(GELU(Linear(x))) (the GELU's tanh form), on a GPU: the Conv1D's dx GEMM
   does the GELU's backward too (cuBLASLt's DGELU with the GELU's input, mgpu__box_dgelu), a kernel
   fewer in the backward than with MGPU_EPILOGUES off (the emulator's count), the same gradients
   within 1e-5, and central differences agree. A hidden width that is not a multiple of 8 (the
   epilogue's leading dimension) has no such algorithm: the GELU's kernel runs, the same gradients.
   With MGPU_FUSE_GELU the Linear's GEMM does the GELU's forward too (GELU_AUX_BIAS, mgpu__box_gelu):
   a kernel fewer in the forward (the two bias adds are gone with the epilogues alone), the same
   output and gradients within 1e-5; but not with recompute, which makes the GELU's output again
   in backward with its kernel: there the forward runs the kernel too, and every bit is as with the
   epilogues alone. */
#ifdef MGPU_CUDA
enum { DGELU_OFF, DGELU_ON, DGELU_FUSE_GELU, DGELU_RECOMPUTE, DGELU_SETTINGS };
static void dgelu_case(mgpu_device_set* set, int hidden) {
    static const char* names[DGELU_SETTINGS] = { "without epilogues", "with epilogues", "MGPU_FUSE_GELU",
                                                 "MGPU_FUSE_GELU and recompute" };
    const int B = 6, C = 8, fused = hidden % 8 == 0;
    const int64_t ny = (int64_t)B * C;
    emu_counters_fn counters = emu_counters();
    float *x = fbuf(ny), *R = fbuf(ny), *grads[DGELU_SETTINGS] = { NULL }, *dx[DGELU_SETTINGS];
    long long kernels[DGELU_SETTINGS] = { 0 }, forward[DGELU_SETTINGS] = { 0 };
    double loss[DGELU_SETTINGS] = { 0 };
    int64_t nf = 0, i;
    int setting;
    for (i = 0; i < ny; ++i) { x[i] = (float)rng_gauss(); R[i] = (float)rng_gauss(); }
    for (setting = 0; setting < DGELU_SETTINGS; ++setting) dx[setting] = fbuf(ny);
    for (setting = 0; setting < DGELU_SETTINGS; ++setting) {
        mgpu_layer* box = gpt_mlp_block(C, hidden);
        mgpu_model* m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(C), .layers = &box, .layer_count = 1,
                                                              .devices = set, .seed = 9,
                                                              .recompute = setting == DGELU_RECOMPUTE });
        mgpu_device* dev = m ? mgpu_model_device(m, 0) : NULL;
        mgpu_tensor *tx, *tr;
        mgpu_emu_counters_t before, after;
        CHECK(m != NULL, "DGELU: model: %s", mgpu_last_error());
        if (!m) break;
        tx = tmake(dev, MGPU_F32, mgpu_shape2(B, C));
        tr = tmake(dev, MGPU_F32, mgpu_shape2(B, C));
        mgpu__epilogue_setting = setting != DGELU_OFF;
        mgpu__fuse_gelu_setting = setting >= DGELU_FUSE_GELU;
        tput(tr, R);
        MUST(mgpu_device_synchronize(dev));
        if (counters) counters(&before);
        loss[setting] = box_loss(m, tx, x, R, ny);
        if (counters) {
            counters(&after);
            forward[setting] = (long long)(after.launches - before.launches) - (long long)(after.gemms - before.gemms);
        }
        MUST(mgpu_model_zero_grad(m));
        MUST(mgpu_device_synchronize(dev));
        if (counters) counters(&before);
        MUST(mgpu_model_backward(m, 0, tr));
        MUST(mgpu_device_synchronize(dev));
        if (counters) {
            counters(&after);
            kernels[setting] = (long long)(after.launches - before.launches) - (long long)(after.gemms - before.gemms);
        }
        nf = mgpu_tensor_numel(mgpu_model_grads(m, 0));
        grads[setting] = fbuf(nf);
        tget(mgpu_model_grads(m, 0), grads[setting]);
        tget(mgpu_model_input_grad(m, 0), dx[setting]);
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(tr);
        mgpu_model_destroy(m);
    }
    mgpu__epilogue_setting = mgpu__fuse_gelu_setting = -1;
    for (setting = DGELU_ON; setting < DGELU_SETTINGS; ++setting) {
        const double el = fabs(loss[setting] - loss[0]) / fmax(fabs(loss[0]), 1e-30);
        if (!grads[0] || !grads[setting]) break;
        {
            const double eg = attn_rel(grads[setting], grads[0], nf), ex = attn_rel(dx[setting], dx[0], ny);
            CHECK(el <= 1e-5 && eg <= 1e-5 && ex <= 1e-5, "GELU epilogues (hidden %d), %s against the GELU's kernel: the losses "
                  "%.3g, parameter gradients %.3g, dx %.3g apart", hidden, names[setting], el, eg, ex);
        }
        if (counters && !getenv("MGPU_EMU_NO_LT"))   /* (recompute: and one more, the GELU's forward again) */
            CHECK(kernels[0] - kernels[setting] + (setting == DGELU_RECOMPUTE) == fused, "DGELU epilogue (hidden %d), %s: the "
                  "backward launched %lld kernels besides GEMMs, %lld without epilogues (want %s%s)", hidden, names[setting],
                  kernels[setting], kernels[0], fused ? "one fewer: the GELU's backward" : "as many",
                  setting == DGELU_RECOMPUTE ? ", and one more: the GELU's forward again" : "");
    }
    if (counters && !getenv("MGPU_EMU_NO_LT") && grads[DGELU_RECOMPUTE]) {
        CHECK(forward[DGELU_OFF] - forward[DGELU_ON] == 2 && forward[DGELU_ON] - forward[DGELU_FUSE_GELU] == fused &&
              forward[DGELU_RECOMPUTE] == forward[DGELU_ON],
              "GELU epilogue (hidden %d): the forward launched %lld, %lld, %lld and %lld kernels besides GEMMs %s, %s, %s and %s "
              "(want 2 fewer with epilogues: the bias adds; %s with MGPU_FUSE_GELU; as many with recompute)", hidden,
              forward[0], forward[1], forward[2], forward[3], names[0], names[1], names[2], names[3],
              fused ? "one fewer still: the GELU" : "as many (GELU_AUX_BIAS has DGELU's rule)");
        CHECK(loss[DGELU_RECOMPUTE] == loss[DGELU_ON] && !memcmp(grads[DGELU_RECOMPUTE], grads[DGELU_ON], (size_t)nf * sizeof(float)) &&
              !memcmp(dx[DGELU_RECOMPUTE], dx[DGELU_ON], (size_t)ny * sizeof(float)),
              "GELU epilogue (hidden %d): with MGPU_FUSE_GELU and recompute, not the bits of the epilogues alone (the GELU "
              "recomputed must not be fused)", hidden);
    }
    {   /* whether this GPU's cuBLASLt has DGELU for that GEMM (dx [B, hidden] = dy [B, C] W^T), said for gpu-check */
        mgpu_device* dev = mgpu_device_set_get(set, 0);
        mgpu_tensor *tdy = tmake(dev, MGPU_F32, mgpu_shape2(B, C)), *w = tmake(dev, MGPU_F32, mgpu_shape2(hidden, C));
        mgpu_tensor *tdx = tmake(dev, MGPU_F32, mgpu_shape2(B, hidden)), *aux = tmake(dev, MGPU_F32, mgpu_shape2(B, hidden));
        int done = 0;
        MUST(mgpu_tensor_fill(tdy, 0.5)); MUST(mgpu_tensor_fill(w, 0.25)); MUST(mgpu_tensor_fill(aux, 1.0));
        MUST(mgpu__matmul_epilogue(tdx, tdy, MGPU_NO_TRANS, w, MGPU_TRANS, 0.0f, MGPU__EPI_DGELU, NULL, aux, &done));
        printf("  the GELU's backward in the next Linear's GEMM (hidden %d): %s\n", hidden,
               done ? "yes (cuBLASLt's DGELU)" : "no (no algorithm: the kernel runs)");
        if (!fused) CHECK(!done, "DGELU epilogue: refused for a leading dimension of %d (not a multiple of 8)", hidden);
        else if (counters && !getenv("MGPU_EMU_NO_LT")) CHECK(done, "DGELU epilogue: the emulated cuBLASLt found no algorithm");
        {   /* and GELU_AUX_BIAS for the Linear's (y [B, hidden] = x [B, C] W^T + b, its input into aux) */
            mgpu_tensor* bias = tmake(dev, MGPU_F32, mgpu_shape1(hidden));
            MUST(mgpu_tensor_fill(bias, 0.125));
            MUST(mgpu__matmul_epilogue(tdx, tdy, MGPU_NO_TRANS, w, MGPU_TRANS, 0.0f, MGPU__EPI_GELU_BIAS, bias, aux, &done));
            printf("  the GELU's forward in the Linear's GEMM (hidden %d, with MGPU_FUSE_GELU): %s\n", hidden,
                   done ? "yes (cuBLASLt's GELU_AUX_BIAS)" : "no (no algorithm: the kernel runs)");
            if (!fused) CHECK(!done, "GELU_AUX_BIAS epilogue: refused for a leading dimension of %d (not a multiple of 8)", hidden);
            else if (counters && !getenv("MGPU_EMU_NO_LT")) CHECK(done, "GELU_AUX_BIAS epilogue: the emulated cuBLASLt found no algorithm");
            mgpu_tensor_destroy(bias);
        }
        mgpu_tensor_destroy(tdy); mgpu_tensor_destroy(w); mgpu_tensor_destroy(tdx); mgpu_tensor_destroy(aux);
    }
    free(x); free(R);
    for (setting = 0; setting < DGELU_SETTINGS; ++setting) { free(grads[setting]); free(dx[setting]); }
}
#endif
static void box_dgelu(void) {
#ifdef MGPU_CUDA
    mgpu_device_set* set = mgpu_device_set_create("cuda:0");
    dgelu_case(set, 32);
    dgelu_case(set, 30);
    box_gradcheck("Residual(Sequential(Linear, GELU, Conv1D)) + x, DGELU in the GEMM", gpt_mlp_block(8, 32), 6, 8, 8, set);
    mgpu__fuse_gelu_setting = 1;
    box_gradcheck("Residual(Sequential(Linear, GELU, Conv1D)) + x, the GELU in the GEMMs (MGPU_FUSE_GELU)", gpt_mlp_block(8, 32),
                  6, 8, 8, set);
    mgpu__fuse_gelu_setting = -1;
    mgpu_device_set_destroy(set);
#endif
}

#ifdef MGPU_CUDA
/* "Twice", a layer of the user's around a child: y = 2 f(x), its backward the child's twice
   (each adding its gradients), as a layer that calls a child more than once does */
static mgpu_layer* twice_kid(const mgpu_layer* l) { return (mgpu_layer*)mgpu_layer_user_data(l); }
static mgpu_result twice_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) { return twice_kid(l)->vt->output_shape(twice_kid(l), x, y); }
static int twice_params(const mgpu_layer* l) { return twice_kid(l)->vt->param_count(twice_kid(l)); }
static mgpu_result twice_param_shape(const mgpu_layer* l, int i, const char** name, mgpu_shape* shape) {
    return twice_kid(l)->vt->param_shape(twice_kid(l), i, name, shape);
}
static int twice_aux(const mgpu_layer* l) { return twice_kid(l)->vt->aux_count(twice_kid(l)); }
static mgpu_result twice_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* shape) {
    return twice_kid(l)->vt->aux_shape(twice_kid(l), i, x, dt, shape);
}
static mgpu_result twice_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    return twice_kid(l)->vt->init(twice_kid(l), ctx, seed);
}
static mgpu_result twice_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    mgpu_result r = mgpu_layer_forward(twice_kid(l), ctx, x, y);
    return r == MGPU_OK ? mgpu_add(y, y, y) : r;
}
static mgpu_result twice_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                  const mgpu_tensor* dy, mgpu_tensor* dx) {
    mgpu_tensor* first = dx ? mgpu_tensor_create(mgpu_tensor_device(dx), dx->dtype, dx->shape) : NULL;
    mgpu_result r = dx && !first ? mgpu_last_result() : mgpu_layer_backward(twice_kid(l), ctx, x, y, dy, first);
    if (r == MGPU_OK) r = mgpu_layer_backward(twice_kid(l), ctx, x, y, dy, dx);
    if (r == MGPU_OK && dx) r = mgpu_add(dx, dx, first);
    mgpu_tensor_destroy(first);
    return r;
}
static void twice_destroy(mgpu_layer* l) { mgpu_layer_destroy(twice_kid(l)); }
static const mgpu_layer_vtable g_twice_vt = { "Twice", twice_shape, twice_params, twice_param_shape, twice_init, twice_aux,
                                              twice_aux_shape, twice_forward, twice_backward, NULL, twice_destroy, NULL, NULL };
/* A training step on a GPU writes the first gradients of a container's Linear children (at any
   depth through containers; MGPU__FUSE_FRESH, mgpu__box_fresh) instead of zeroing them and adding.
   Two models, the gradients NaN before the first step: LayerNorm, x + Conv1D(GELU(Linear(x))),
   Linear head; and Sequential(Linear, Twice(Sequential(Linear, Tanh, Linear)), Linear), whose
   layer of the user's calls its child twice (a write there would lose the first call's
   gradients). Three SGD steps give the parameters of MGPU_EPILOGUES=0 within 1e-5 (a gradient
   neither written nor zeroed would keep its NaN: the LayerNorm's lie before the fresh ones), and
   in the first model a step launches three kernels fewer besides its GEMMs than zero_grad +
   accumulate + apply: the bias gradients of the inner Linear, the Conv1D and the head, from their
   weights' GEMMs (cuBLASLt's BGRADB, and BGRADA for the Conv1D, stored [in, out]). */
static void box_fresh(void) {
    const int B = 6, C = 8, hidden = 16, K = 3;
    const int64_t nx = (int64_t)B * C;
    emu_counters_fn counters = emu_counters();
    mgpu_device_set* set = mgpu_device_set_create("cuda:0");
    float *x = fbuf(nx), *params[2] = { NULL, NULL };
    int32_t labels[6];
    long long step_kernels = 0, split_kernels = 0;
    int64_t n = 0, i;
    int variant, setting, s;
    for (i = 0; i < nx; ++i) x[i] = (float)rng_gauss();
    for (i = 0; i < B; ++i) labels[i] = (int32_t)(i % K);
    for (variant = 0; variant < 2; ++variant) {
        for (setting = 0; setting < 2 && set; ++setting) {
            mgpu_layer* layers[3];
            mgpu_model* m;
            mgpu_optimizer* opt;
            mgpu_device* dev;
            mgpu_tensor *tx = NULL, *ty = NULL;
            if (variant == 0) {
                layers[0] = mgpu_layer_layer_norm(C); layers[1] = gpt_mlp_block(C, hidden); layers[2] = mgpu_layer_linear(C, K);
            } else {
                mgpu_layer *inner[3], *outer[3];
                inner[0] = mgpu_layer_linear(C, C); inner[1] = mgpu_layer_tanh(); inner[2] = mgpu_layer_linear(C, C);
                outer[0] = mgpu_layer_linear(C, C); outer[1] = mgpu_layer_create(&g_twice_vt, mgpu_layer_sequential(inner, 3));
                outer[2] = mgpu_layer_linear(C, K);
                layers[0] = mgpu_layer_sequential(outer, 3);
            }
            m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(C), .layers = layers, .layer_count = variant ? 1 : 3,
                                                      .devices = set, .seed = 5 });
            opt = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f }) : NULL;
            dev = m ? mgpu_model_device(m, 0) : NULL;
            CHECK(m && opt, "fresh gradients in containers: model %d: %s", variant, mgpu_last_error());
            if (!m || !opt) { mgpu_optimizer_destroy(opt); mgpu_model_destroy(m); break; }
            mgpu__epilogue_setting = setting;
            tx = tmake(dev, MGPU_F32, mgpu_shape2(B, C));
            ty = tmake(dev, MGPU_I32, mgpu_shape1(B));
            tput(tx, x);
            tput(ty, labels);
            for (i = 0; i < mgpu_model_tensor_count(m); ++i)   /* (the padding between them stays 0, as it must) */
                MUST(mgpu_tensor_fill(mgpu_model_grad(m, 0, mgpu_model_tensor_name(m, (int)i)), NAN));
            for (s = 0; s < 3; ++s) MUST(mgpu_model_train_step(m, opt, tx, ty, NULL));
            n = mgpu_tensor_numel(mgpu_model_params(m, 0));
            params[setting] = fbuf(n);
            tget(mgpu_model_params(m, 0), params[setting]);
            if (variant == 0 && setting == 1 && counters) {   /* a step, and the same as zero_grad + accumulate + apply */
                mgpu_emu_counters_t c0, c1, c2;
                MUST(mgpu_device_synchronize(dev));
                counters(&c0);
                MUST(mgpu_model_train_step(m, opt, tx, ty, NULL));
                MUST(mgpu_device_synchronize(dev));
                counters(&c1);
                MUST(mgpu_model_zero_grad(m));
                MUST(mgpu_model_accumulate(m, tx, ty, 0, NULL));
                MUST(mgpu_model_apply(m, opt));
                MUST(mgpu_device_synchronize(dev));
                counters(&c2);
                step_kernels = (long long)(c1.launches - c0.launches) - (long long)(c1.gemms - c0.gemms);
                split_kernels = (long long)(c2.launches - c1.launches) - (long long)(c2.gemms - c1.gemms);
            }
            mgpu_tensor_destroy(tx); mgpu_tensor_destroy(ty);
            mgpu_optimizer_destroy(opt);
            mgpu_model_destroy(m);
        }
        mgpu__epilogue_setting = -1;
        if (params[0] && params[1]) {
            const double e = attn_rel(params[1], params[0], n);
            CHECK(e <= 1e-5, "fresh gradients in containers, model %d: three steps %.3g from the separate kernels' (NaN: a "
                  "gradient left unzeroed; a layer of the user's losing its first call's gradients)", variant, e);
        }
        free(params[0]); free(params[1]);
        params[0] = params[1] = NULL;
    }
    if (counters && !getenv("MGPU_EMU_NO_LT"))
        CHECK(split_kernels - step_kernels == 3, "fresh gradients in containers: a step launched %lld kernels besides GEMMs, "
              "zero_grad + accumulate + apply %lld (want 3 fewer: the Linears' and the Conv1D's bias gradients in their GEMMs)",
              step_kernels, split_kernels);
    free(x);
    mgpu_device_set_destroy(set);
}
#endif

/* A container keeps its children's outputs from step to step, not the gradients between them
   (temporaries of its backward, from the cache): a GPT MLP block, x + proj(gelu(fc(ln(x)))),
   keeps 10 C floats a token of its own (ln, fc and gelu's outputs, f's) where its gradients
   would add 10 C more; no step after the first allocates, and the activation memory is the first
   step's growth of the bytes in use. */
static void box_memory(const char* spec) {
    const int B = 4, T = 16, C = 32;
    const size_t own = (size_t)10 * C * B * T * sizeof(float);
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_device* dev = set ? mgpu_device_set_get(set, 0) : NULL;
    mgpu_layer *mlp[4], *block;
    mgpu_model* m = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_tensor *x = NULL, *t = NULL;
    mgpu_memory_stats s0, s1, s2;
    int i;
    if (!set) { CHECK(0, "container memory: %s: %s", spec, mgpu_last_error()); return; }
    MUST(mgpu_memory_empty_cache(dev));   /* blocks of the sizes asked for, not larger ones that earlier groups freed */
    mlp[0] = mgpu_layer_layer_norm(C); mlp[1] = mgpu_layer_linear(C, 4 * C); mlp[2] = mgpu_layer_gelu_tanh();
    mlp[3] = mgpu_layer_linear(4 * C, C);
    block = mgpu_layer_residual(mgpu_layer_sequential(mlp, 4), NULL);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape2(T, C), .layers = &block, .layer_count = 1,
                                              .devices = set, .loss = MGPU_LOSS_MSE, .seed = 3 });
    if (m) opt = mgpu_optimizer_create(m, NULL);
    CHECK(m && opt, "container memory on %s: %s", spec, mgpu_last_error());
    if (m && opt) {
        x = tmake(dev, MGPU_F32, mgpu_shape3(B, T, C));
        t = tmake(dev, MGPU_F32, mgpu_shape3(B, T, C));
        MUST(mgpu_rand_normal(x, 1, 0, 0.0f, 1.0f));
        MUST(mgpu_rand_normal(t, 2, 0, 0.0f, 1.0f));
        MUST(mgpu_memory_get_stats(dev, &s0));
        MUST(mgpu_model_train_step(m, opt, x, t, NULL));
        MUST(mgpu_memory_get_stats(dev, &s1));
        {
            const size_t act = mgpu_model_activation_bytes(m, 0, NULL);
            /* (the model's own: its output, the loss gradient, LayerNorm's statistics: less than 4 C a token) */
            CHECK(act == s1.bytes_in_use - s0.bytes_in_use && act >= own && act < own + own * 4 / 10,
                  "container memory on %s: activation memory %zu, the first step added %zu: want %zu of the block's own and "
                  "less than 4 C floats a token more", spec, act, s1.bytes_in_use - s0.bytes_in_use, own);
        }
        for (i = 0; i < 3; ++i) MUST(mgpu_model_train_step(m, opt, x, t, NULL));
        MUST(mgpu_memory_get_stats(dev, &s2));
        CHECK(s2.backend_allocs == s1.backend_allocs && s2.bytes_in_use == s1.bytes_in_use,
              "container memory on %s: steps after the first allocated %llu times, bytes in use %zu -> %zu", spec,
              (unsigned long long)(s2.backend_allocs - s1.backend_allocs), s1.bytes_in_use, s2.bytes_in_use);
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(opt);
    if (m) mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

/* A residual block with a shortcut as a model's first layer (no input gradient asked for: dx NULL)
   gives the gradients it gives after a Flatten (which asks for one), bit for bit: the shortcut's
   backward runs either way. */
static void box_first_layer(void) {
    mgpu_layer *a = mgpu_layer_residual(mgpu_layer_linear(4, 4), mgpu_layer_linear(4, 4));
    mgpu_layer *b[2] = { mgpu_layer_flatten(), mgpu_layer_residual(mgpu_layer_linear(4, 4), mgpu_layer_linear(4, 4)) };
    mgpu_model* ma = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = &a, .layer_count = 1,
                                                           .loss = MGPU_LOSS_MSE, .seed = 4 });
    mgpu_model* mb = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = b, .layer_count = 2,
                                                           .loss = MGPU_LOSS_MSE, .seed = 5 });
    CHECK(ma && mb, "residual as the first layer: %s", mgpu_last_error());
    if (ma && mb) {
        mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(3, 4)), *t = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(3, 4));
        const int64_t n = mgpu_tensor_numel(mgpu_model_grads(ma, 0));
        float *ga = fbuf(n), *gb = fbuf(n);
        int64_t i, zero = 0;
        MUST(mgpu_rand_normal(x, 6, 0, 0.0f, 1.0f));
        MUST(mgpu_rand_normal(t, 7, 0, 0.0f, 1.0f));
        MUST(mgpu_tensor_copy(mgpu_model_params(mb, 0), mgpu_model_params(ma, 0)));
        MUST(mgpu_model_accumulate(ma, x, t, 0, NULL));
        MUST(mgpu_model_accumulate(mb, x, t, 0, NULL));
        tget(mgpu_model_grads(ma, 0), ga);
        tget(mgpu_model_grads(mb, 0), gb);
        {   /* the shortcut's weight gradient: a view into the flat buffer */
            const mgpu_tensor* w = mgpu_model_grad(ma, 0, "0.shortcut.weight");
            float gw[16];
            CHECK(w != NULL, "no gradient named 0.shortcut.weight: %s", mgpu_last_error());
            if (w) tget(w, gw);
            for (i = 0; w && i < 16; ++i) zero += gw[i] == 0.0f;
            CHECK(zero < 16, "a residual block with a shortcut as the first layer: all 16 of its shortcut's weight "
                  "gradients are 0");
        }
        CHECK(!memcmp(ga, gb, (size_t)n * sizeof(float)),
              "a residual block with a shortcut as the first layer: its gradients differ from those after a Flatten");
        free(ga); free(gb);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(t);
    }
    if (ma) mgpu_model_destroy(ma);
    if (mb) mgpu_model_destroy(mb);
}

static void test_containers(void) {
    mgpu_model *a, *b;
    mgpu_layer* flat_layers[3];
    mgpu_layer* box;
    int i;
    header("4. containers: sequential, residual, a layer called from a layer");
    /* a Sequential as one layer gives the bits of its layers in the model's own list */
    box = mlp_block(5, 4);
    a = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(5), .layers = &box, .layer_count = 1, .seed = 1 });
    flat_layers[0] = mgpu_layer_linear(5, 4); flat_layers[1] = mgpu_layer_tanh(); flat_layers[2] = mgpu_layer_linear(4, 5);
    b = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(5), .layers = flat_layers, .layer_count = 3, .seed = 1 });
    CHECK(a && b, "models: %s", mgpu_last_error());
    if (a && b) {
        const char* want[4] = { "0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias" };
        mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(3, 5)), *y;
        const int32_t labels[3] = { 0, 4, 2 };
        float la = 0, lb = 0, *ga, *gb;
        int64_t n = mgpu_tensor_numel(mgpu_model_params(a, 0));
        CHECK(mgpu_model_tensor_count(a) == 4, "Sequential: %d named tensors", mgpu_model_tensor_count(a));
        for (i = 0; i < 4 && i < mgpu_model_tensor_count(a); ++i)
            CHECK(!strcmp(mgpu_model_tensor_name(a, i), want[i]), "Sequential: tensor %d is '%s', want '%s'", i,
                  mgpu_model_tensor_name(a, i), want[i]);
        CHECK(n == mgpu_tensor_numel(mgpu_model_params(b, 0)), "the same flat layout");
        MUST(mgpu_tensor_copy(mgpu_model_params(b, 0), mgpu_model_params(a, 0)));
        MUST(mgpu_rand_normal(x, 5, 0, 0.0f, 1.0f));
        y = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(3), labels);
        MUST(mgpu_model_accumulate(a, x, y, 0, &la));
        MUST(mgpu_model_accumulate(b, x, y, 0, &lb));
        ga = fbuf(n); gb = fbuf(n);
        tget(mgpu_model_grads(a, 0), ga);
        tget(mgpu_model_grads(b, 0), gb);
        CHECK(la == lb && !memcmp(ga, gb, (size_t)n * sizeof(float)), "Sequential vs the same layers in the model: loss %.9g vs "
              "%.9g, gradients %s", la, lb, memcmp(ga, gb, (size_t)n * sizeof(float)) ? "differ" : "equal");
        free(ga); free(gb);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
    /* residual blocks against central differences, on the CPU and the GPU */
    for (i = 0; i < 2; ++i) {
        mgpu_device_set* set = NULL;
        if (i == 1) {
            if (!gpu_part("containers")) break;
            set = mgpu_device_set_create("cuda:0");
        }
        box_gradcheck("Residual(Sequential(Linear, Tanh, Linear)) + x", mgpu_layer_residual(mlp_block(4, 6), NULL), 3, 4, 4, set);
        box_gradcheck("Residual(Linear 4->6) + shortcut Linear 4->6",
                      mgpu_layer_residual(mgpu_layer_linear(4, 6), mgpu_layer_linear(4, 6)), 2, 4, 6, set);
        {
            mgpu_layer* two[2];
            two[0] = mgpu_layer_residual(mlp_block(4, 5), NULL);
            two[1] = mgpu_layer_residual(mlp_block(4, 3), NULL);
            box_gradcheck("Sequential(Residual, Residual)", mgpu_layer_sequential(two, 2), 2, 4, 4, set);
        }
        mgpu_device_set_destroy(set);
    }
    /* names of a residual block with a shortcut, and what containers refuse */
    box = mgpu_layer_residual(mgpu_layer_linear(4, 6), mgpu_layer_linear(4, 6));
    a = box ? mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = &box, .layer_count = 1 }) : NULL;
    CHECK(a && !strcmp(mgpu_model_tensor_name(a, 2), "0.shortcut.weight"), "shortcut's names: '%s'",
          a ? mgpu_model_tensor_name(a, 2) : mgpu_last_error());
    mgpu_model_destroy(a);
    box = mgpu_layer_residual(mgpu_layer_linear(4, 6), NULL);
    a = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = &box, .layer_count = 1 });
    CHECK(a == NULL && strstr(mgpu_last_error(), "shortcut"), "f(x) of another shape than x without a shortcut refused: %s",
          mgpu_last_error());
    {
        mgpu_layer* kids[2];
        kids[0] = mgpu_layer_relu();
        kids[1] = NULL;
        CHECK(mgpu_layer_sequential(kids, 2) == NULL && mgpu_last_result() == MGPU_ERROR_INVALID_ARGUMENT,
              "a NULL layer in a Sequential refused (and the other freed: ASan's leak check)");
        kids[0] = kids[1] = mgpu_layer_relu();
        CHECK(mgpu_layer_sequential(kids, 2) == NULL && strstr(mgpu_last_error(), "twice"), "the same layer twice refused");
    }
    box_first_layer();
    box_memory("cpu");
    if (gpu_part("container memory")) box_memory("cuda:0");
    if (gpu_part("a GELU's backward in the next Linear's GEMM")) box_dgelu();
#ifdef MGPU_CUDA
    if (gpu_part("fresh gradients in containers")) box_fresh();
#endif
}

/* ============================================================================================ */
/* 6. a GPT in every layout: pipelines, CUDA graphs                                             */
/* ============================================================================================ */
enum { GPT_V = 11, GPT_T = 6, GPT_C = 8, GPT_H = 2, GPT_L = 2, GPT_B = 4 };
static mgpu_layer* tiny_block(float p) {
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(GPT_C), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(GPT_C, GPT_H, p), "attn") };
    mgpu_layer* mlp[4] = { mgpu_layer_name(mgpu_layer_conv1d(GPT_C, 4 * GPT_C), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * GPT_C, GPT_C), "c_proj"), mgpu_layer_dropout(p) };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(GPT_C), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 4), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), ""),
                            mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL), "") };
    return mgpu_layer_sequential(both, 2);
}
/* GPT-2's layers (examples/gpt.c's), the head tied to the embedding or not; recompute and the
   precision as mgpu_model_desc's */
static mgpu_model* tiny_gpt_ex(const mgpu_device_set* set, int stages, int micro, int graph, int tied, float p, int recompute,
                               mgpu_dtype precision, int zero1) {
    static const mgpu_tie tie = { "6.weight", "0.weight" };   /* the head is the embedding */
    const char* spec = set ? mgpu_device_set_spec(set) : NULL;
    mgpu_layer* layers[3 + GPT_L + 2];
    mgpu_model* m;
    int n = 0, i;
    layers[n++] = mgpu_layer_embedding(GPT_V, GPT_C);
    layers[n++] = mgpu_layer_position_embedding(GPT_T, GPT_C);
    layers[n++] = mgpu_layer_dropout(p);
    for (i = 0; i < GPT_L; ++i) layers[n++] = tiny_block(p);
    layers[n++] = mgpu_layer_layer_norm(GPT_C);
    layers[n++] = mgpu_layer_linear_no_bias(GPT_C, GPT_V);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(GPT_T), .input_dtype = MGPU_I32, .layers = layers, .layer_count = n,
                                              .devices = set, .seed = 5, .stages = stages, .micro_batches = micro, .graph = graph,
                                              .ties = tied ? &tie : NULL, .tie_count = tied, .recompute = recompute,
                                              .precision = precision, .zero1 = zero1 });
    CHECK(m != NULL, "a GPT on %s (%d stages, %d micro-batches%s%s%s): %s", spec ? spec : "cpu", stages, micro, graph ? ", graph" : "",
          recompute ? ", recompute" : "", precision == MGPU_BF16 ? ", bf16" : "", mgpu_last_error());
    return m;
}
static mgpu_model* tiny_gpt(const mgpu_device_set* set, int stages, int micro, int graph, int tied, float p) {
    return tiny_gpt_ex(set, stages, micro, graph, tied, p, 0, MGPU_F32, 0);
}
/* every stage's floats of replica 0, in the flat layout's order */
static float* all_floats(const mgpu_model* m, int grads, int64_t* n) {
    int s;
    float* out;
    *n = 0;
    for (s = 0; s < mgpu_model_stage_count(m); ++s)
        *n += mgpu_tensor_numel(grads ? mgpu_model_stage_grads(m, 0, s) : mgpu_model_stage_params(m, 0, s));
    out = fbuf(*n + 1);
    *n = 0;
    for (s = 0; s < mgpu_model_stage_count(m); ++s) {
        const mgpu_tensor* t = grads ? mgpu_model_stage_grads(m, 0, s) : mgpu_model_stage_params(m, 0, s);
        tget(t, out + *n);
        *n += mgpu_tensor_numel(t);
    }
    return out;
}
static void gpt_batch(int32_t* ids, int32_t* lab, int step) {
    int i;
    for (i = 0; i < GPT_B * GPT_T; ++i) {
        ids[i] = (i * 7 + step * 3 + i / 5) % GPT_V;
        lab[i] = (i * 5 + step + 1) % GPT_V;
    }
}
/* K steps of an optimizer (NULL: plain SGD); the parameters after them, and the last loss */
static float* gpt_steps_with(mgpu_model* m, int K, float* last, const mgpu_optimizer_desc* od) {
    mgpu_optimizer* opt = mgpu_optimizer_create(m, od ? od : &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f });
    int32_t ids[GPT_B * GPT_T], lab[GPT_B * GPT_T];
    mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(GPT_B, GPT_T)), *y = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(GPT_B, GPT_T));
    float* p;
    int64_t n;
    int k;
    for (k = 0; k < K && opt; ++k) {
        gpt_batch(ids, lab, k);
        tput(x, ids);
        tput(y, lab);
        MUST(mgpu_model_train_step(m, opt, x, y, last));
    }
    p = all_floats(m, 0, &n);
    mgpu_optimizer_destroy(opt);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    return p;
}
static float* gpt_steps(mgpu_model* m, int K, float* last) { return gpt_steps_with(m, K, last, NULL); }

/* GPT-2 as it is, the head tied to the embedding, one device against `spec` in `stages` stages of 2
   micro-batches (the embedding in the first stage, the head in the last): 4 steps of AdamW with
   clipping. On CPUs the same bits. On GPUs a weight gradient summed over two micro-batches is
   rounded unlike one GEMM over the batch (so untied too): within 1e-5 of the largest value, and
   the pipeline's CUDA graph steps equal its eager ones bit for bit. */
static void gpt_tied_stages(mgpu_device_set* one_dev, const char* spec, int stages, int gpu) {
    static const mgpu_optimizer_desc od = { .kind = MGPU_ADAMW, .lr = 0.01f, .weight_decay = 0.1f, .decay_matrices_only = 1,
                                            .clip_norm = 0.5f };
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model *one = tiny_gpt(one_dev, 1, 1, 0, 1, 0.1f), *piped = set ? tiny_gpt(set, stages, 2, 0, 1, 0.1f) : NULL;
    mgpu_model* graph = set && gpu ? tiny_gpt(set, stages, 2, 1, 1, 0.1f) : NULL;
    if (one && piped && (graph || !gpu)) {
        float l1 = 0, l2 = 1, l3 = 2, *p1 = gpt_steps_with(one, 4, &l1, &od), *p2 = gpt_steps_with(piped, 4, &l2, &od), *p3 = NULL;
        int64_t n = 0, s, i;
        double worst = 0.0, largest = 0.0;
        for (s = 0; s < mgpu_model_stage_count(piped); ++s) n += mgpu_tensor_numel(mgpu_model_stage_params(piped, 0, s));
        CHECK(n == mgpu_tensor_numel(mgpu_model_params(one, 0)), "a tied GPT: %lld floats in %d stages, %lld on one device", (long long)n,
              stages, (long long)mgpu_tensor_numel(mgpu_model_params(one, 0)));
        for (i = 0; i < n && n == mgpu_tensor_numel(mgpu_model_params(one, 0)); ++i) {
            worst = fmax(worst, fabs((double)p1[i] - (double)p2[i]));
            largest = fmax(largest, fabs((double)p1[i]));
        }
        /* (the loss reported, a mean of the micro-batches' means, agrees to rounding) */
        CHECK(fabs(l1 - l2) <= 1e-6 * fabs(l1) && (gpu ? worst <= 1e-5 * largest : worst == 0.0),
              "a tied GPT in %d stages x 2 micro-batches on %s: 4 AdamW steps with clipping against one device's: loss %.9g vs %.9g, "
              "parameters differ by %.3g (largest %.3g; want %s)", stages, spec, l1, l2, worst, largest, gpu ? "1e-5 of it" : "0");
        if (graph) {
            p3 = gpt_steps_with(graph, 4, &l3, &od);
            CHECK(l2 == l3 && !memcmp(p2, p3, (size_t)n * sizeof(float)) && mgpu_model_graph_steps(graph) >= 2,
                  "the tied pipeline on %s as a CUDA graph (%lld steps replayed) equals its eager steps bit for bit: loss %.9g vs %.9g, "
                  "parameters %s", spec, (long long)mgpu_model_graph_steps(graph), l2, l3,
                  memcmp(p2, p3, (size_t)n * sizeof(float)) ? "differ" : "equal");
        }
        free(p1); free(p2); free(p3);
    }
    mgpu_model_destroy(one);
    mgpu_model_destroy(piped);
    mgpu_model_destroy(graph);
    mgpu_device_set_destroy(set);
}

/* Recompute (mgpu_model_desc.recompute): a GPT whose LayerNorm and GELU outputs are made again in
   backward trains to the same bits as one that keeps them (AdamW with clipping, dropout), on
   `spec` in `stages` stages of 2 micro-batches, eager and as a CUDA graph (GPUs), in fp32 and bf16,
   and keeps 6 C activations a position and block fewer (ln_1, ln_2: C each; GELU: 4 C), less the
   empty placeholder each of those buffers keeps (a smallest block of the allocator, at most 512 B). */
static float* gpt_steps_fresh(const mgpu_device_set* set, mgpu_model* m, float* last, const mgpu_optimizer_desc* od) {
    int d;
    /* (blocks of the sizes asked for, not larger ones the model before freed: activation bytes compared) */
    for (d = 0; d < mgpu_device_set_count(set); ++d) MUST(mgpu_memory_empty_cache(mgpu_device_set_get(set, d)));
    return gpt_steps_with(m, 4, last, od);
}
static void gpt_recompute(const char* spec, int stages, int graph, mgpu_dtype precision) {
    static const mgpu_optimizer_desc od = { .kind = MGPU_ADAMW, .lr = 0.01f, .clip_norm = 0.5f };
    const int micro = stages > 1 ? 2 : 1;
    const size_t fewer = (size_t)GPT_L * 6 * GPT_C * (GPT_B / micro) * GPT_T * (precision == MGPU_BF16 ? 2 : 4);
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model *kept = set ? tiny_gpt_ex(set, stages, micro, 0, stages == 1, 0.1f, 0, precision, 0) : NULL;
    mgpu_model *redo = set ? tiny_gpt_ex(set, stages, micro, graph, stages == 1, 0.1f, 1, precision, 0) : NULL;
    CHECK(set != NULL, "recompute: %s: %s", spec, mgpu_last_error());
    if (kept && redo) {
        float lk = 0, lr = 1, *pk = gpt_steps_fresh(set, kept, &lk, &od), *pr = gpt_steps_fresh(set, redo, &lr, &od);
        int64_t n = 0;
        int s;
        size_t bytes_kept = 0, bytes_redo = 0;
        for (s = 0; s < stages; ++s) n += mgpu_tensor_numel(mgpu_model_stage_params(kept, 0, s));
        CHECK(lk == lr && !memcmp(pk, pr, (size_t)n * sizeof(float)) && (!graph || mgpu_model_graph_steps(redo) >= 2),
              "a GPT recomputing its LayerNorm and GELU outputs (%s, %d stage%s%s%s) trains to the bits of one keeping them: "
              "loss %.9g vs %.9g, parameters %s", spec, stages, stages > 1 ? "s x 2 micro-batches" : "", graph ? ", CUDA graph" : "",
              precision == MGPU_BF16 ? ", bf16" : "", lk, lr, memcmp(pk, pr, (size_t)n * sizeof(float)) ? "differ" : "equal");
        bytes_kept = mgpu_model_activation_bytes(kept, 0, NULL);
        bytes_redo = mgpu_model_activation_bytes(redo, 0, NULL);
        printf("  recompute on %s (%d stage%s%s): activation memory %zu bytes, %zu keeping every output\n", spec, stages,
               stages > 1 ? "s" : "", precision == MGPU_BF16 ? ", bf16" : "", bytes_redo, bytes_kept);
        CHECK(bytes_kept - bytes_redo <= fewer && bytes_kept - bytes_redo >= fewer - (size_t)GPT_L * 3 * 512, "recompute on %s (%d stage%s%s): activation memory %zu, %zu keeping every output: want "
              "%zu fewer (6 C a position and block), less 512 B a buffer at most", spec, stages, stages > 1 ? "s" : "", precision == MGPU_BF16 ? ", bf16" : "",
              bytes_redo, bytes_kept, fewer);
        free(pk); free(pr);
    }
    mgpu_model_destroy(kept);
    mgpu_model_destroy(redo);
    mgpu_device_set_destroy(set);
}

/* ZeRO-1 (mgpu_model_desc.zero1) with the head tied to the embedding (the twin's floats past those
   an update moves, copied after the shards are gathered), AdamW with clipping, on 3 replicas: the
   bits of the unsharded run */
static void gpt_zero1_tied(const char* spec) {
    static const mgpu_optimizer_desc od = { .kind = MGPU_ADAMW, .lr = 0.01f, .weight_decay = 0.1f, .decay_matrices_only = 1,
                                            .clip_norm = 0.5f };
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model *plain = set ? tiny_gpt_ex(set, 1, 1, 0, 1, 0.1f, 0, MGPU_F32, 0) : NULL;
    mgpu_model *sharded = set ? tiny_gpt_ex(set, 1, 1, 0, 1, 0.1f, 0, MGPU_F32, 1) : NULL;
    if (plain && sharded) {
        float lp = 0, ls = 1, *pp = gpt_steps_with(plain, 4, &lp, &od), *ps = gpt_steps_with(sharded, 4, &ls, &od);
        const int64_t n = mgpu_tensor_numel(mgpu_model_params(plain, 0));
        CHECK(lp == ls && !memcmp(pp, ps, (size_t)n * sizeof(float)) && mgpu_model_verify_replicas(sharded) == MGPU_OK,
              "a tied GPT with zero1 on %s trains to the unsharded bits, its replicas identical: loss %.9g vs %.9g, parameters %s (%s)",
              spec, lp, ls, memcmp(pp, ps, (size_t)n * sizeof(float)) ? "differ" : "equal", mgpu_last_error());
        free(pp); free(ps);
    }
    mgpu_model_destroy(plain);
    mgpu_model_destroy(sharded);
    mgpu_device_set_destroy(set);
}

static void test_gpt_layouts(void) {
    int32_t ids[GPT_B * GPT_T], lab[GPT_B * GPT_T];
    mgpu_model *one, *piped;
    mgpu_device_set* four;
    header("6. a GPT in every layout: 4 pipeline stages, CUDA graphs");
    gpt_batch(ids, lab, 0);
    /* one device against 4 stages of 2 micro-batches each on the CPU: the same bits (untied: a
       tie across stages is refused, test 5) */
    four = mgpu_device_set_create("cpu:4");
    one = tiny_gpt(NULL, 1, 1, 0, 0, 0.1f);
    piped = tiny_gpt(four, 4, 2, 0, 0, 0.1f);
    if (one && piped) {
        mgpu_tensor *x = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(GPT_B, GPT_T), ids), *y = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(GPT_B, GPT_T), lab);
        float l1 = 0, l4 = 1, *g1, *g4;
        int64_t n1, n4;
        MUST(mgpu_model_accumulate(one, x, y, 0, &l1));
        MUST(mgpu_model_accumulate(piped, x, y, 0, &l4));
        g1 = all_floats(one, 1, &n1);
        g4 = all_floats(piped, 1, &n4);
        CHECK(n1 == n4 && l1 == l4 && !memcmp(g1, g4, (size_t)n1 * sizeof(float)),
              "a GPT with dropout in 4 pipeline stages x 2 micro-batches equals one device bit for bit: loss %.9g vs %.9g, "
              "gradients %s", l1, l4, n1 == n4 && !memcmp(g1, g4, (size_t)n1 * sizeof(float)) ? "equal" : "differ");
        free(g1); free(g4);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    mgpu_model_destroy(one);
    mgpu_model_destroy(piped);
    mgpu_device_set_destroy(four);
    gpt_tied_stages(NULL, "cpu:4", 4, 0);
    gpt_tied_stages(NULL, "cpu:2", 2, 0);
    gpt_recompute("cpu", 1, 0, MGPU_F32);
    gpt_recompute("cpu:2", 2, 0, MGPU_F32);
    gpt_recompute("cpu", 1, 0, MGPU_BF16);
    gpt_zero1_tied("cpu:3");
    if (gpu_part("a GPT recomputing LayerNorm and GELU outputs, eager and as a CUDA graph, fp32 and bf16")) {
        gpt_recompute("cuda:0", 1, 1, MGPU_F32);
        gpt_recompute("cuda:0", 1, 1, MGPU_BF16);
        gpt_recompute(mgpu_cuda_device_count() > 1 ? "cuda:0,1" : "cuda:0,0", 2, 1, MGPU_F32);
        gpt_zero1_tied("cuda:0,0,0");
    }
    if (gpu_part("a tied GPT in 2 stages on two GPUs, eager and as a CUDA graph")) {
        mgpu_device_set* gpu = mgpu_device_set_create("cuda:0");
        const char* spec = mgpu_cuda_device_count() > 1 ? "cuda:0,1" : "cuda:0,0";
        gpt_tied_stages(gpu, spec, 2, 1);
        mgpu_device_set_destroy(gpu);
    }
    /* a CUDA graph of the whole step (dropout included) against eager steps: the same bits */
    if (gpu_part("a GPT as a CUDA graph")) {
        mgpu_device_set* gpu = mgpu_device_set_create("cuda:0");
        mgpu_model* eager = tiny_gpt(gpu, 1, 1, 0, 1, 0.1f);
        mgpu_model* graph = tiny_gpt(gpu, 1, 1, 1, 1, 0.1f);
        if (eager && graph) {
            float le = 0, lg = 1, *pe = gpt_steps(eager, 5, &le), *pg = gpt_steps(graph, 5, &lg);
            int64_t n = mgpu_tensor_numel(mgpu_model_params(eager, 0));
            CHECK(mgpu_model_graph_steps(graph) >= 3, "the GPT's steps replayed from a graph: %lld", (long long)mgpu_model_graph_steps(graph));
            CHECK(le == lg && !memcmp(pe, pg, (size_t)n * sizeof(float)), "a GPT's graph steps equal eager ones bit for bit: loss "
                  "%.9g vs %.9g, parameters %s", le, lg, memcmp(pe, pg, (size_t)n * sizeof(float)) ? "differ" : "equal");
            free(pe); free(pg);
        }
        mgpu_model_destroy(eager);
        mgpu_model_destroy(graph);
        mgpu_device_set_destroy(gpu);
    }
}

/* ============================================================================================ */
/* 7. BatchNorm2d, buffers, global average pooling                                              */
/* ============================================================================================ */
/* A harness for ne_check_layer: BatchNorm2d inside a layer of the test's own that hands it
   buffers of the test's own (one set per device), as a model would. */
typedef struct bn_harness { mgpu_layer* bn; mgpu_tensor* buf[2][3]; } bn_harness;
static mgpu_tensor* const* bnh_buffers(const mgpu_layer* l, mgpu_device* dev) {
    bn_harness* h = (bn_harness*)mgpu_layer_user_data(l);
    const int k = dev == mgpu_device_cpu() ? 0 : 1;
    int i;
    for (i = 0; i < 3 && !h->buf[k][i]; ++i) {
        const char* name;
        mgpu_shape s;
        NE_MUST(h->bn->vt->buffer_shape(h->bn, i, &name, &s));
        h->buf[k][i] = tmake(dev, MGPU_F32, s);
    }
    return h->buf[k];
}
static mgpu_layer_ctx bnh_ctx(const mgpu_layer* l, const mgpu_layer_ctx* ctx) {
    mgpu_layer_ctx sub = *ctx;
    sub.buffers = bnh_buffers(l, ctx->device);
    return sub;
}
static mgpu_layer* bnh_bn(const mgpu_layer* l) { return ((bn_harness*)mgpu_layer_user_data(l))->bn; }
static mgpu_result bnh_shape(const mgpu_layer* l, mgpu_shape x, mgpu_shape* y) { return bnh_bn(l)->vt->output_shape(bnh_bn(l), x, y); }
static int bnh_params(const mgpu_layer* l) { return bnh_bn(l)->vt->param_count(bnh_bn(l)); }
static mgpu_result bnh_param_shape(const mgpu_layer* l, int i, const char** n, mgpu_shape* s) { return bnh_bn(l)->vt->param_shape(bnh_bn(l), i, n, s); }
static int bnh_aux(const mgpu_layer* l) { return bnh_bn(l)->vt->aux_count(bnh_bn(l)); }
static mgpu_result bnh_aux_shape(const mgpu_layer* l, int i, mgpu_shape x, mgpu_dtype* dt, mgpu_shape* s) {
    return bnh_bn(l)->vt->aux_shape(bnh_bn(l), i, x, dt, s);
}
static mgpu_result bnh_init(const mgpu_layer* l, const mgpu_layer_ctx* ctx, uint64_t seed) {
    const mgpu_layer_ctx sub = bnh_ctx(l, ctx);
    return bnh_bn(l)->vt->init(bnh_bn(l), &sub, seed);
}
static mgpu_result bnh_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    const mgpu_layer_ctx sub = bnh_ctx(l, ctx);
    return mgpu_layer_forward(bnh_bn(l), &sub, x, y);
}
static mgpu_result bnh_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                const mgpu_tensor* dy, mgpu_tensor* dx) {
    const mgpu_layer_ctx sub = bnh_ctx(l, ctx);
    return mgpu_layer_backward(bnh_bn(l), &sub, x, y, dy, dx);
}
static void bnh_destroy(mgpu_layer* l) {
    bn_harness* h = (bn_harness*)mgpu_layer_user_data(l);
    int i;
    mgpu_layer_destroy(h->bn);
    for (i = 0; i < 6; ++i) mgpu_tensor_destroy(h->buf[i / 3][i % 3]);
    free(h);
}
static const mgpu_layer_vtable g_bnh_vt = { "BatchNorm2d", bnh_shape, bnh_params, bnh_param_shape, bnh_init, bnh_aux, bnh_aux_shape,
                                            bnh_forward, bnh_backward, NULL, bnh_destroy, NULL, NULL };

/* float64 BatchNorm2d on x [n, c, hw] with the batch's statistics (training) or given ones;
   mean and var (biased) out when training */
static void bn_ref(const float* x, int n, int c, int hw, const float* w, const float* b, int training, const double* mean_in,
                   const double* var_in, double* y, double* mean_out, double* var_out) {
    int o, ch, i;
    for (ch = 0; ch < c; ++ch) {
        double mean = 0.0, var = 0.0;
        if (training) {
            for (o = 0; o < n; ++o) for (i = 0; i < hw; ++i) mean += x[(o * c + ch) * hw + i];
            mean /= (double)n * hw;
            for (o = 0; o < n; ++o) for (i = 0; i < hw; ++i) var += (x[(o * c + ch) * hw + i] - mean) * (x[(o * c + ch) * hw + i] - mean);
            var /= (double)n * hw;
            if (mean_out) { mean_out[ch] = mean; var_out[ch] = var; }
        } else {
            mean = mean_in[ch];
            var = var_in[ch];
        }
        for (o = 0; o < n; ++o)
            for (i = 0; i < hw; ++i)
                y[(o * c + ch) * hw + i] = (x[(o * c + ch) * hw + i] - mean) / sqrt(var + 1e-5) * w[ch] + b[ch];
    }
}
static void bn_input(float* x, int n, int c, int hw) {
    int o, ch, i;
    for (o = 0; o < n; ++o)
        for (ch = 0; ch < c; ++ch)
            for (i = 0; i < hw; ++i) x[(o * c + ch) * hw + i] = (float)(rng_gauss() * (1.0 + ch) + 0.5 * ch - 1.0);
}

/* Evaluation with given running statistics, and the running statistics after `batches` training
   forwards against PyTorch's rule in float64, on dev. */
static void bn_eval_and_running(const char* label, mgpu_device* dev, int n, int c, int hw) {
    mgpu_layer* bn = mgpu_layer_batch_norm2d(c);
    const int batches = 3;
    CHECK(bn != NULL, "mgpu_layer_batch_norm2d(%d): %s", c, mgpu_last_error());
    if (!bn) return;
    {
    mgpu_shape xs = mgpu_shape4(n, c, 1, hw);
    mgpu_tensor *p[2], *g[2], *aux[2], *buf[3], *tx, *ty;
    float *x = fbuf((int64_t)n * c * hw), *y = fbuf((int64_t)n * c * hw), *w = fbuf(c), *b = fbuf(c), *rm = fbuf(c), *rv = fbuf(c), cnt;
    double *yref = dbuf((int64_t)n * c * hw), *m64 = dbuf(c), *v64 = dbuf(c), *bm = dbuf(c), *bv = dbuf(c);
    mgpu_layer_ctx ctx;
    const char* name;
    mgpu_shape s;
    int i, k;
    for (i = 0; i < 2; ++i) { p[i] = tmake(dev, MGPU_F32, mgpu_shape1(c)); g[i] = tmake(dev, MGPU_F32, mgpu_shape1(c)); aux[i] = tmake(dev, MGPU_F32, mgpu_shape1(c)); }
    for (i = 0; i < 3; ++i) { NE_MUST(bn->vt->buffer_shape(bn, i, &name, &s)); buf[i] = tmake(dev, MGPU_F32, s); }
    tx = tmake(dev, MGPU_F32, xs);
    ty = tmake(dev, MGPU_F32, xs);
    memset(&ctx, 0, sizeof ctx);
    ctx.device = dev; ctx.params = p; ctx.grads = g; ctx.aux = aux; ctx.buffers = buf;
    NE_MUST(bn->vt->init(bn, &ctx, 1));
    tget(buf[1], rv);
    tget(buf[2], &cnt);
    CHECK(rv[0] == 1.0f && rv[c - 1] == 1.0f && cnt == 0.0f, "%s: init: running_var %g, num_batches_tracked %g (want 1, 0)", label,
          (double)rv[0], (double)cnt);
    for (i = 0; i < c; ++i) { w[i] = (float)(1.0 + 0.5 * rng_gauss()); b[i] = (float)rng_gauss(); m64[i] = 0.0; v64[i] = 1.0; }
    tput(p[0], w); tput(p[1], b);
    /* training batches: PyTorch's rule, in float64 */
    for (k = 0; k < batches; ++k) {
        bn_input(x, n, c, hw);
        tput(tx, x);
        ctx.training = 1;
        NE_MUST(mgpu_layer_forward(bn, &ctx, tx, ty));
        bn_ref(x, n, c, hw, w, b, 1, NULL, NULL, yref, bm, bv);
        for (i = 0; i < c; ++i) {
            m64[i] = 0.9 * m64[i] + 0.1 * bm[i];
            v64[i] = 0.9 * v64[i] + 0.1 * bv[i] * (double)(n * hw) / (double)(n * hw - 1);
        }
        tget(ty, y);
        {
            double e = test_rel_error(y, yref, (size_t)n * c * hw);
            CHECK(e <= 1e-5, "%s: training forward %d against float64: normalised error %.3g", label, k, e);
        }
    }
    tget(buf[0], rm); tget(buf[1], rv); tget(buf[2], &cnt);
    {
        double em = test_rel_error(rm, m64, (size_t)c), ev = test_rel_error(rv, v64, (size_t)c);
        CHECK(em <= 1e-6 && ev <= 1e-6 && cnt == (float)batches, "%s: running statistics after %d batches against PyTorch's rule in "
              "float64: mean error %.3g, var error %.3g, num_batches_tracked %g", label, batches, em, ev, (double)cnt);
    }
    /* evaluation: the running statistics, and no change to them */
    bn_input(x, n, c, hw);
    tput(tx, x);
    ctx.training = 0;
    NE_MUST(mgpu_layer_forward(bn, &ctx, tx, ty));
    for (i = 0; i < c; ++i) { bm[i] = rm[i]; bv[i] = rv[i]; }
    bn_ref(x, n, c, hw, w, b, 0, bm, bv, yref, NULL, NULL);
    tget(ty, y);
    {
        float rm2[64], cnt2;
        double e = test_rel_error(y, yref, (size_t)n * c * hw);
        CHECK(e <= 1e-5, "%s: evaluation forward against float64 with the running statistics: normalised error %.3g", label, e);
        tget(buf[0], rm2); tget(buf[2], &cnt2);
        CHECK(!memcmp(rm, rm2, (size_t)c * sizeof(float)) && cnt2 == cnt, "%s: evaluation changed the buffers", label);
    }
    /* a batch of one value per channel cannot train (PyTorch refuses it too) */
    {
        mgpu_tensor* one = tmake(dev, MGPU_F32, mgpu_shape4(1, c, 1, 1));
        ctx.training = 1;
        expect_fail(mgpu_layer_forward(bn, &ctx, one, one), MGPU_ERROR_SHAPE_MISMATCH, "BatchNorm2d on one value per channel",
                    "one value", "BatchNorm2d", NULL);
        mgpu_tensor_destroy(one);
    }
    for (i = 0; i < 2; ++i) { mgpu_tensor_destroy(p[i]); mgpu_tensor_destroy(g[i]); mgpu_tensor_destroy(aux[i]); }
    for (i = 0; i < 3; ++i) mgpu_tensor_destroy(buf[i]);
    mgpu_tensor_destroy(tx); mgpu_tensor_destroy(ty);
    mgpu_layer_destroy(bn);
    free(x); free(y); free(w); free(b); free(rm); free(rv); free(yref); free(m64); free(v64); free(bm); free(bv);
    }
}

/* a small ResNet: conv -> BN -> ReLU -> residual(conv, BN, ReLU, conv, BN) -> ReLU -> GAP -> Linear */
static mgpu_model* bn_resnet_ex(const mgpu_device_set* set, int verify_every, uint64_t seed, int stages, int micro_batches,
                                int graph) {
    static const int split[1] = { 3 };   /* (stage 1 from the residual block on) */
    mgpu_layer* f[5];
    mgpu_layer* layers[6];
    f[0] = mgpu_layer_conv2d(4, 4, 3, 1, 1); f[1] = mgpu_layer_batch_norm2d(4); f[2] = mgpu_layer_relu();
    f[3] = mgpu_layer_conv2d(4, 4, 3, 1, 1); f[4] = mgpu_layer_batch_norm2d(4);
    layers[0] = mgpu_layer_conv2d(1, 4, 3, 1, 1);
    layers[1] = mgpu_layer_batch_norm2d(4);
    layers[2] = mgpu_layer_relu();
    layers[3] = mgpu_layer_residual(mgpu_layer_sequential(f, 5), NULL);
    layers[4] = mgpu_layer_global_avg_pool2d();
    layers[5] = mgpu_layer_linear(4, 3);
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(1, 6, 6), .layers = layers, .layer_count = 6,
                                                 .devices = set, .seed = seed, .verify_every = verify_every,
                                                 .stages = stages, .split = stages > 1 ? split : NULL, .micro_batches = micro_batches,
                                                 .graph = graph });
}
static mgpu_model* bn_resnet(const mgpu_device_set* set, int verify_every, uint64_t seed) {
    return bn_resnet_ex(set, verify_every, seed, 1, 1, 0);
}

static void test_batchnorm(void) {
    const int n = g_quick ? 4 : 6, c = 3, h = 3, w = 4;
    header("7. BatchNorm2d, buffers, global average pooling");
    /* forward (training) and gradients through ne_check_layer, with the GPU twin */
    {
        bn_harness* hb = (bn_harness*)xmalloc(sizeof *hb);
        mgpu_layer* l;
        float *x = fbuf((int64_t)n * c * h * w), *pw = fbuf(c), *pb = fbuf(c);
        float* params[2];
        double* yref = dbuf((int64_t)n * c * h * w);
        int i;
        memset(hb, 0, sizeof *hb);
        hb->bn = mgpu_layer_batch_norm2d(c);
        l = mgpu_layer_create(&g_bnh_vt, hb);
        CHECK(hb->bn && l, "BatchNorm2d harness: %s", mgpu_last_error());
        bn_input(x, n, c, h * w);
        for (i = 0; i < c; ++i) { pw[i] = (float)(1.0 + 0.5 * rng_gauss()); pb[i] = (float)rng_gauss(); }
        params[0] = pw; params[1] = pb;
        bn_ref(x, n, c, h * w, pw, pb, 1, NULL, NULL, yref, NULL, NULL);
        if (l) ne_check_layer("BatchNorm2d (training)", l, mgpu_shape4(n, c, h, w), MGPU_F32, x, params, yref);
        mgpu_layer_destroy(l);
        free(x); free(pw); free(pb); free(yref);
    }
    bn_eval_and_running("BatchNorm2d", mgpu_device_cpu(), n, c, h * w);
    if (gpu_part("BatchNorm2d running statistics")) bn_eval_and_running("BatchNorm2d cuda", g_gpu, n, c, h * w);
    /* global average pooling */
    {
        mgpu_layer* l = mgpu_layer_global_avg_pool2d();
        float* x = fbuf((int64_t)n * c * h * w);
        double* yref = dbuf((int64_t)n * c);
        int i, j;
        ne_normal(x, (int64_t)n * c * h * w, 1.0);
        for (i = 0; i < n * c; ++i) {
            yref[i] = 0.0;
            for (j = 0; j < h * w; ++j) yref[i] += x[i * h * w + j];
            yref[i] /= h * w;
        }
        ne_check_layer("AdaptiveAvgPool2d", l, mgpu_shape4(n, c, h, w), MGPU_F32, x, NULL, yref);
        mgpu_layer_destroy(l);
        free(x); free(yref);
    }
    /* a residual block with BatchNorm on cpu:2, replicas verified after every step; its buffers
       listed, equal on both replicas, saved and loaded */
    {
        mgpu_device_set* set = mgpu_device_set_create("cpu:2");
        mgpu_model* m = set ? bn_resnet(set, 1, 3) : NULL;
        mgpu_model* fresh = bn_resnet(NULL, 0, 4);
        mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f }) : NULL;
        const int batch = 8, steps = g_quick ? 3 : 5;
        CHECK(set && m && fresh && opt, "cpu:2 ResNet: %s", mgpu_last_error());
        if (set && m && fresh && opt) {
            mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(batch, 1, 6, 6));
            int32_t labels[8];
            mgpu_tensor* t;
            char path[512];
            int i, k, bufs = 0, r_ok = 1;
            float loss = 0.0f;
            const char* want[3] = { "1.running_mean", "3.1.num_batches_tracked", "3.4.running_var" };
            for (i = 0; i < batch; ++i) labels[i] = i % 3;
            t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(batch), labels);
            CHECK(mgpu_model_buffer_count(m) == 9, "3 BatchNorm2d: %d buffers, want 9", mgpu_model_buffer_count(m));
            for (i = 0; i < mgpu_model_tensor_count(m); ++i) {
                const char* name = mgpu_model_tensor_name(m, i);
                bufs += mgpu_model_tensor_is_buffer(m, i);
                for (k = 0; k < 3; ++k)
                    if (!strcmp(name, want[k]))
                        CHECK(mgpu_model_tensor_is_buffer(m, i), "'%s' is listed as a parameter", name);
            }
            CHECK(bufs == 9 && mgpu_model_buffer(m, 1, "3.4.running_var") != NULL && mgpu_model_param(m, 0, "1.running_mean") == NULL,
                  "buffers listed: %d; by name: %s", bufs, mgpu_last_error());
            for (k = 0; k < steps && r_ok; ++k) {
                mgpu_result r;
                MUST(mgpu_rand_normal(x, 100 + (uint64_t)k, 0, 0.3f, 1.0f));
                r = mgpu_model_train_step(m, opt, x, t, &loss);
                r_ok = r == MGPU_OK;
                CHECK(r_ok, "cpu:2 step %d with verify_every = 1: %s", k, mgpu_last_error());
            }
            {
                float c0[4], c1[4], nbt;
                tget(mgpu_model_buffer(m, 0, "3.1.running_mean"), c0);
                tget(mgpu_model_buffer(m, 1, "3.1.running_mean"), c1);
                tget(mgpu_model_buffer(m, 1, "3.1.num_batches_tracked"), &nbt);
                CHECK(!memcmp(c0, c1, sizeof c0) && c0[0] != 0.0f && nbt == (float)steps && isfinite(loss),
                      "buffers: replica 1's running_mean %s replica 0's (%g), num_batches_tracked %g after %d steps, loss %g",
                      memcmp(c0, c1, sizeof c0) ? "differs from" : "equals", (double)c0[0], (double)nbt, steps, (double)loss);
                MUST(mgpu_model_verify_replicas(m));
                /* a replica that drifts is caught */
                c1[2] += 1.0f;
                tput(mgpu_model_buffer(m, 1, "3.1.running_mean"), c1);
                expect_fail(mgpu_model_verify_replicas(m), MGPU_ERROR_DIVERGED, "a changed buffer on replica 1", "3.1.running_mean",
                            "replica 1", NULL);
                tput(mgpu_model_buffer(m, 1, "3.1.running_mean"), c0);
            }
            test_tmp_path(path, sizeof path, "bn_buffers.safetensors");
            MUST(mgpu_model_save(m, NULL, path));
            MUST(mgpu_model_load(fresh, NULL, path));
            {
                mgpu_safetensors* st = mgpu_safetensors_open(path);
                mgpu_safetensors_info info;
                int at = st ? mgpu_safetensors_find(st, "1.num_batches_tracked") : -1;
                memset(&info, 0, sizeof info);
                if (at >= 0) MUST(mgpu_safetensors_get_info(st, at, &info));
                CHECK(at >= 0 && !strcmp(info.dtype, "I64") && info.ndim == 0, "the file's num_batches_tracked: %s, ndim %d (want I64, "
                      "a scalar as PyTorch's)", at >= 0 ? info.dtype : "missing", info.ndim);
                mgpu_safetensors_close(st);
            }
            for (i = 0; i < mgpu_model_buffer_count(m); ++i) {
                const int at = mgpu_model_tensor_count(m) - mgpu_model_buffer_count(m) + i;
                mgpu_tensor *a = mgpu_model_tensor(m, 0, at), *b = mgpu_model_tensor(fresh, 0, at);
                float va[4], vb[4];
                tget(a, va);
                tget(b, vb);
                CHECK(!memcmp(va, vb, (size_t)mgpu_tensor_numel(a) * sizeof(float)), "save and load: buffer '%s' differs",
                      mgpu_model_tensor_name(m, at));
            }
            remove(path);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(t);
        }
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
        mgpu_model_destroy(fresh);
        mgpu_device_set_destroy(set);
    }
    /* the GPU twin of the replicas: two on one GPU (cuda:0,0), verified after every step, and
       every buffer against cpu:2's after the same steps (each replica the same rows) */
    if (gpu_part("BatchNorm2d replicas")) {
        mgpu_device_set* set = mgpu_device_set_create("cuda:0,0");
        mgpu_device_set* cpus = mgpu_device_set_create("cpu:2");
        mgpu_model *m = set ? bn_resnet(set, 1, 3) : NULL, *ref = cpus ? bn_resnet(cpus, 0, 3) : NULL;
        mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f }) : NULL;
        mgpu_optimizer* ropt = ref ? mgpu_optimizer_create(ref, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f }) : NULL;
        CHECK(set && m && ref && opt && ropt, "cuda:0,0 ResNet: %s", mgpu_last_error());
        if (set && m && ref && opt && ropt) {
            mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(8, 1, 6, 6));
            const int32_t labels[8] = { 2, 1, 0, 0, 1, 2, 2, 1 };
            mgpu_tensor* t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
            float a[4], b[4];
            double ref64[4];
            int k, i;
            for (k = 0; k < 3; ++k) {
                MUST(mgpu_rand_normal(x, 300 + (uint64_t)k, 0, 0.0f, 1.0f));
                MUST(mgpu_model_train_step(m, opt, x, t, NULL));
                MUST(mgpu_model_train_step(ref, ropt, x, t, NULL));
            }
            for (i = 0; i < mgpu_model_buffer_count(m); ++i) {
                const int at = mgpu_model_tensor_count(m) - mgpu_model_buffer_count(m) + i;
                const int64_t n = mgpu_tensor_numel(mgpu_model_tensor(m, 0, at));
                double e;
                tget(mgpu_model_tensor(m, 0, at), a);
                tget(mgpu_model_tensor(m, 1, at), b);
                CHECK(!memcmp(a, b, (size_t)n * sizeof(float)), "cuda:0,0: replica 1's '%s' differs from replica 0's",
                      mgpu_model_tensor_name(m, at));
                tget(mgpu_model_tensor(ref, 0, at), b);
                for (k = 0; k < n; ++k) ref64[k] = b[k];
                e = test_rel_error(a, ref64, (size_t)n);
                CHECK(e <= 1e-4, "cuda:0,0: '%s' against cpu:2's after 3 steps: normalised error %.3g", mgpu_model_tensor_name(m, at), e);
            }
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(t);
        }
        mgpu_optimizer_destroy(opt); mgpu_optimizer_destroy(ropt);
        mgpu_model_destroy(m); mgpu_model_destroy(ref);
        mgpu_device_set_destroy(set); mgpu_device_set_destroy(cpus);
    }
    /* the same steps as a CUDA graph's replays on two GPUs (cuda:0,1 where there are two): every
       parameter and buffer of both replicas equal to eager steps' bit for bit */
    if (gpu_part("BatchNorm2d in a CUDA graph")) {
        const char* spec = mgpu_cuda_device_count() > 1 ? "cuda:0,1" : "cuda:0,0";
        mgpu_device_set* set = mgpu_device_set_create(spec);
        mgpu_model* m[2];
        mgpu_optimizer* opt[2];
        mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(8, 1, 6, 6));
        const int32_t labels[8] = { 2, 1, 0, 0, 1, 2, 2, 1 };
        mgpu_tensor* t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
        int k, step, r, i;
        for (k = 0; k < 2; ++k) {
            m[k] = set ? bn_resnet_ex(set, 0, 3, 1, 1, k) : NULL;
            opt[k] = m[k] ? mgpu_optimizer_create(m[k], &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f }) : NULL;
        }
        CHECK(set && m[0] && m[1] && opt[0] && opt[1], "%s ResNet, eager and graph: %s", spec, mgpu_last_error());
        for (step = 0; set && m[0] && m[1] && opt[0] && opt[1] && step < 5; ++step) {
            float loss[2] = { 0.0f, 1.0f };
            MUST(mgpu_rand_normal(x, 400 + (uint64_t)step, 0, 0.0f, 1.0f));
            for (k = 0; k < 2; ++k) MUST(mgpu_model_train_step(m[k], opt[k], x, t, &loss[k]));
            CHECK(loss[0] == loss[1], "%s ResNet step %d: loss %.9g eager, %.9g replayed from a graph", spec, step, (double)loss[0],
                  (double)loss[1]);
        }
        for (r = 0; set && m[0] && m[1] && r < 2; ++r)
            for (i = 0; i < mgpu_model_tensor_count(m[0]); ++i) {
                const mgpu_tensor *a = mgpu_model_tensor(m[0], r, i), *b = mgpu_model_tensor(m[1], r, i);
                float va[256], vb[256];
                const int64_t n = mgpu_tensor_numel(a);
                if (n > 256) { CHECK(0, "'%s' has %lld floats: the test's arrays hold 256", mgpu_model_tensor_name(m[0], i), (long long)n); continue; }
                tget(a, va);
                tget(b, vb);
                CHECK(!memcmp(va, vb, (size_t)n * sizeof(float)), "%s ResNet after 5 steps: replica %d's '%s' differs between "
                      "graph and eager steps", spec, r, mgpu_model_tensor_name(m[0], i));
            }
        if (m[1]) CHECK(mgpu_model_graph_steps(m[1]) >= 3, "a ResNet with BatchNorm2d: %lld of 5 steps replayed from a CUDA graph",
                        (long long)mgpu_model_graph_steps(m[1]));
        for (k = 0; k < 2; ++k) { mgpu_optimizer_destroy(opt[k]); mgpu_model_destroy(m[k]); }
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(t);
        mgpu_device_set_destroy(set);
    }
    /* a pipeline of 2 stages on cpu:2, 2 micro-batches: each buffer on its layer's stage, and each
       micro-batch's forward moves the running statistics (as a GPipe of PyTorch's does) */
    {
        mgpu_device_set* set = mgpu_device_set_create("cpu:2");
        mgpu_model* m = set ? bn_resnet_ex(set, 0, 5, 2, 2, 0) : NULL;
        mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f }) : NULL;
        CHECK(set && m && opt, "cpu:2 ResNet in 2 stages: %s", mgpu_last_error());
        if (set && m && opt) {
            mgpu_tensor* x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(8, 1, 6, 6));
            const int32_t labels[8] = { 0, 1, 2, 0, 1, 2, 0, 1 };
            mgpu_tensor* t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
            mgpu_tensor *b0 = mgpu_model_buffer(m, 0, "1.num_batches_tracked"), *b1 = mgpu_model_buffer(m, 0, "3.4.num_batches_tracked");
            float n0 = -1.0f, n1 = -1.0f;
            int k;
            CHECK(b0 && b1 && mgpu_tensor_device(b0) == mgpu_model_stage_device(m, 0, 0) &&
                  mgpu_tensor_device(b1) == mgpu_model_stage_device(m, 0, 1) && mgpu_model_stage_buffers(m, 0, 1) != NULL,
                  "2 stages: buffers on their layers' stages (%s)", mgpu_last_error());
            for (k = 0; k < 2; ++k) {
                MUST(mgpu_rand_normal(x, 200 + (uint64_t)k, 0, 0.0f, 1.0f));
                MUST(mgpu_model_train_step(m, opt, x, t, NULL));
            }
            if (b0 && b1) { tget(b0, &n0); tget(b1, &n1); }
            CHECK(n0 == 4.0f && n1 == 4.0f, "2 steps of 2 micro-batches: num_batches_tracked %g and %g on the stages, want 4", (double)n0,
                  (double)n1);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(t);
        }
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
        mgpu_device_set_destroy(set);
    }
}

/* ============================================================================================ */
/* 8. NaN and Inf are never hidden (issue 37)                                                   */
/* ============================================================================================ */
/* The references are PyTorch 1.13's (/usr/bin/python3, run once; the values are in comments). */
static int nf_same(float a, float b) { return (a != a && b != b) || a == b; }   /* NaN equals NaN here */
static int nf_isnan(float v) { return v != v; }

/* The ops on one device: relu and its gradient, the other activations, MaxPool2d, argmax and
   accuracy, cross-entropy, each with NaN and Inf inputs. */
static void nf_ops(const char* where, mgpu_device* dev) {
    const float N = NAN, I = INFINITY;
    /* torch.relu([nan, -1, 2, inf, -inf, 0]) = [nan, 0, 2, inf, 0, 0]; backward with dy = 1:
       [1, 0, 1, 1, 0, 0] (threshold_backward on the output: a NaN x lets dy through) */
    {
        const float x[6] = { N, -1.0f, 2.0f, I, -I, 0.0f }, want[6] = { N, 0.0f, 2.0f, I, 0.0f, 0.0f };
        const float one[6] = { 1, 1, 1, 1, 1, 1 }, wantd[6] = { 1, 0, 1, 1, 0, 0 };
        mgpu_tensor *tx = tfrom(dev, mgpu_shape1(6), x), *ty = tmake(dev, MGPU_F32, mgpu_shape1(6));
        mgpu_tensor *tdy = tfrom(dev, mgpu_shape1(6), one), *tdx = tmake(dev, MGPU_F32, mgpu_shape1(6));
        float y[6], dx[6];
        int i, ok = 1, okd = 1;
        MUST(mgpu_relu(ty, tx));
        MUST(mgpu_relu_backward(tdx, tdy, tx));
        tget(ty, y);
        tget(tdx, dx);
        for (i = 0; i < 6; ++i) { ok &= nf_same(y[i], want[i]); okd &= nf_same(dx[i], wantd[i]); }
        CHECK(ok, "%s: relu([nan, -1, 2, inf, -inf, 0]) = [%g, %g, %g, %g, %g, %g], PyTorch: [nan, 0, 2, inf, 0, 0]", where,
              (double)y[0], (double)y[1], (double)y[2], (double)y[3], (double)y[4], (double)y[5]);
        CHECK(okd, "%s: relu backward (dy = 1) = [%g, %g, %g, %g, %g, %g], PyTorch: [1, 0, 1, 1, 0, 0]", where, (double)dx[0],
              (double)dx[1], (double)dx[2], (double)dx[3], (double)dx[4], (double)dx[5]);
        /* a NaN dy on x = [nan, -1, 2, 0]: PyTorch [nan, 0, nan, 0] */
        {
            const float x2[4] = { N, -1.0f, 2.0f, 0.0f }, dy2[4] = { N, N, N, N };
            mgpu_tensor *a = tfrom(dev, mgpu_shape1(4), x2), *b = tfrom(dev, mgpu_shape1(4), dy2), *c = tmake(dev, MGPU_F32, mgpu_shape1(4));
            float d[4];
            MUST(mgpu_relu_backward(c, b, a));
            tget(c, d);
            CHECK(nf_isnan(d[0]) && d[1] == 0.0f && nf_isnan(d[2]) && d[3] == 0.0f,
                  "%s: relu backward of dy = NaN on x = [nan, -1, 2, 0]: [%g, %g, %g, %g], PyTorch: [nan, 0, nan, 0]", where,
                  (double)d[0], (double)d[1], (double)d[2], (double)d[3]);
            mgpu_tensor_destroy(a); mgpu_tensor_destroy(b); mgpu_tensor_destroy(c);
        }
        /* tanh, sigmoid, both GELUs of NaN: NaN (PyTorch too); gelu(-inf): NaN, tanh(inf) 1 */
        {
            mgpu_result (*fs[4])(mgpu_tensor*, const mgpu_tensor*) = { mgpu_tanh, mgpu_sigmoid, mgpu_gelu, mgpu_gelu_tanh };
            static const char* names[4] = { "tanh", "sigmoid", "gelu", "gelu_tanh" };
            for (i = 0; i < 4; ++i) {
                MUST(fs[i](ty, tx));
                tget(ty, y);
                CHECK(nf_isnan(y[0]), "%s: %s(NaN) = %g, PyTorch: nan", where, names[i], (double)y[0]);
            }
            MUST(mgpu_gelu(ty, tx));
            tget(ty, y);
            CHECK(y[3] == I && nf_isnan(y[4]), "%s: gelu(inf), gelu(-inf) = %g, %g, PyTorch: inf, nan", where, (double)y[3], (double)y[4]);
        }
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(ty); mgpu_tensor_destroy(tdy); mgpu_tensor_destroy(tdx);
    }
    /* argmax: torch.argmax([[1, nan, 3, nan], [inf, 2, 3, 4], [-inf x 4], [nan, 1, 2, 3]], 1) = [1, 0, 0, 0]
       (the first NaN wins); a row of 40 (wider than a warp) with 9 at 3 and NaNs at 37 and 35: 35 */
    {
        enum { C = 40 };
        float x[5 * C];
        const int32_t want[5] = { 1, 0, 0, 0, 35 }, labels[5] = { 1, 0, 0, 3, 35 };
        int32_t got[5];
        int64_t correct = -1;
        mgpu_tensor *tx, *to, *tl;
        int i;
        for (i = 0; i < 5 * C; ++i) x[i] = -I;
        x[0] = 1; x[1] = N; x[2] = 3; x[3] = N;
        x[C] = I; x[C + 1] = 2; x[C + 2] = 3; x[C + 3] = 4;
        x[3 * C] = N; x[3 * C + 1] = 1; x[3 * C + 2] = 2; x[3 * C + 3] = 3;
        for (i = 0; i < C; ++i) x[4 * C + i] = (float)(i % 7);
        x[4 * C + 3] = 9; x[4 * C + 37] = N; x[4 * C + 35] = N;
        /* rows 0..2 have 4 values then -inf: argmax is unchanged by the padding */
        tx = tfrom(dev, mgpu_shape2(5, C), x);
        to = tmake(dev, MGPU_I32, mgpu_shape1(5));
        tl = tfrom_i32(dev, mgpu_shape1(5), labels);
        MUST(mgpu_argmax(to, tx));
        tget(to, got);
        CHECK(!memcmp(got, want, sizeof want), "%s: argmax with NaN and Inf = [%d, %d, %d, %d, %d], PyTorch: [1, 0, 0, 0, 35]", where,
              got[0], got[1], got[2], got[3], got[4]);
        MUST(mgpu_count_correct(tx, tl, &correct));
        /* rows 0, 1, 2 and 4 (labels 3 of row 3 and 35 of row 4: what skipping NaNs would give instead) */
        CHECK(correct == 4, "%s: accuracy with NaN rows: %lld correct, want 4 (a row with a NaN is its first NaN's class)",
              where, (long long)correct);
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(to); mgpu_tensor_destroy(tl);
    }
    /* cross-entropy: F.cross_entropy([[1, nan, 3]], [0]) = nan; [[1, inf, 3]]: nan */
    {
        const float a[3] = { 1, N, 3 }, b[3] = { 1, I, 3 };
        const int32_t label = 0;
        mgpu_tensor *tl = tfrom_i32(dev, mgpu_shape1(1), &label), *loss = tmake(dev, MGPU_F32, mgpu_shape1(1));
        mgpu_tensor *ta = tfrom(dev, mgpu_shape2(1, 3), a), *tb = tfrom(dev, mgpu_shape2(1, 3), b);
        float la = 0.0f, lb = 0.0f;
        MUST(mgpu_softmax_cross_entropy(loss, NULL, ta, tl, 0.0f));
        tget(loss, &la);
        MUST(mgpu_softmax_cross_entropy(loss, NULL, tb, tl, 0.0f));
        tget(loss, &lb);
        CHECK(nf_isnan(la) && nf_isnan(lb), "%s: cross-entropy of [1, nan, 3] and [1, inf, 3]: %g and %g, PyTorch: nan and nan", where,
              (double)la, (double)lb);
        /* torch.softmax([[1, nan, 3]], 1) = [nan, nan, nan]; [[1, inf, 3]] too */
        {
            mgpu_tensor* y = tmake(dev, MGPU_F32, mgpu_shape2(1, 3));
            float ya[3], yb[3];
            MUST(mgpu_softmax(y, ta));
            tget(y, ya);
            MUST(mgpu_softmax(y, tb));
            tget(y, yb);
            CHECK(nf_isnan(ya[0]) && nf_isnan(ya[1]) && nf_isnan(ya[2]) && nf_isnan(yb[0]) && nf_isnan(yb[1]) && nf_isnan(yb[2]),
                  "%s: softmax of [1, nan, 3]: [%g, %g, %g], of [1, inf, 3]: [%g, %g, %g]; PyTorch: NaN everywhere", where,
                  (double)ya[0], (double)ya[1], (double)ya[2], (double)yb[0], (double)yb[1], (double)yb[2]);
            mgpu_tensor_destroy(y);
        }
        mgpu_tensor_destroy(tl); mgpu_tensor_destroy(loss); mgpu_tensor_destroy(ta); mgpu_tensor_destroy(tb);
    }
}

/* MaxPool2d through a model (forward, and backward to the input's gradient): a NaN in a window
   wins, and of several the last in scan order takes the gradient. PyTorch: max_pool2d(2) of
   [[1, nan, 3, 4], [5, 6, 7, 8]] = [nan, 8], indices [1, 7]; of [[nan, nan, 3, nan], [5, 6, nan, 8]]
   = [nan, nan], indices [1, 6]. A 3 x 3 window (the general loop) with NaNs at 2 and 6: index 6. */
static void nf_maxpool(const char* where, const mgpu_device_set* set, int k, int w, const float* x, const int* want_at) {
    mgpu_layer* layers[2];
    mgpu_model* m;
    const int h = k, ow = w / k;
    layers[0] = mgpu_layer_maxpool2d(k, k);
    layers[1] = mgpu_layer_flatten();
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(1, h, w), .layers = layers, .layer_count = 2, .devices = set });
    CHECK(m != NULL, "%s: MaxPool2d(%d) model: %s", where, k, mgpu_last_error());
    if (m) {
        mgpu_device* dev = mgpu_model_device(m, 0);
        float ones[4] = { 1, 1, 1, 1 }, y[4], dx[12];
        mgpu_tensor *tx = tfrom(dev, mgpu_shape4(1, 1, h, w), x), *dy = tfrom(dev, mgpu_shape2(1, ow), ones);
        const mgpu_tensor* out = mgpu_model_forward(m, 0, tx, 1);
        const mgpu_tensor* g;
        int i, j, ok = 1;
        CHECK(out != NULL, "%s: MaxPool2d forward: %s", where, mgpu_last_error());
        if (out) {
            tget(out, y);
            for (i = 0; i < ow; ++i) ok &= nf_isnan(y[i]) == nf_isnan(x[want_at[i]]) && nf_same(y[i], x[want_at[i]]);
            CHECK(ok, "%s: MaxPool2d(%d) forward with NaN: [%g, %g], want [%g, %g]", where, k, (double)y[0], (double)y[ow - 1],
                  (double)x[want_at[0]], (double)x[want_at[ow - 1]]);
            MUST(mgpu_model_backward(m, 0, dy));
            g = mgpu_model_input_grad(m, 0);
            CHECK(g != NULL, "%s: MaxPool2d input gradient: %s", where, mgpu_last_error());
            if (g) {
                tget(g, dx);
                ok = 1;
                for (j = 0; j < h * w; ++j) {
                    float want = 0.0f;
                    for (i = 0; i < ow; ++i) want += want_at[i] == j ? 1.0f : 0.0f;
                    ok &= dx[j] == want;
                }
                CHECK(ok, "%s: MaxPool2d(%d) backward: the gradient is not at the indices PyTorch takes (%d, %d)", where, k,
                      want_at[0], want_at[ow - 1]);
            }
        }
        mgpu_tensor_destroy(tx); mgpu_tensor_destroy(dy);
        mgpu_model_destroy(m);
    }
}
static void nf_maxpools(const char* where, const char* spec) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    const float N = NAN;
    const float a[8] = { 1, N, 3, 4, 5, 6, 7, 8 }, b[8] = { N, N, 3, N, 5, 6, N, 8 };
    const float c[9] = { 1, 2, N, 4, 5, 6, N, 8, 9 };
    const int wa[2] = { 1, 7 }, wb[2] = { 1, 6 }, wc[1] = { 6 };
    CHECK(set != NULL, "%s: %s", spec, mgpu_last_error());
    if (set) {
        nf_maxpool(where, set, 2, 4, a, wa);
        nf_maxpool(where, set, 2, 4, b, wb);
        nf_maxpool(where, set, 3, 3, c, wc);
    }
    mgpu_device_set_destroy(set);
}

/* Linear(4, 8) -> ReLU -> Linear(8, 3), cross-entropy */
static mgpu_model* nf_mlp(const mgpu_device_set* set, int stages, int check_finite, int graph) {
    static const int split[1] = { 2 };
    mgpu_layer* layers[3];
    layers[0] = mgpu_layer_linear(4, 8);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(8, 3);
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = layers, .layer_count = 3, .devices = set,
                                                 .seed = 5, .stages = stages, .split = stages > 1 ? split : NULL,
                                                 .check_finite = check_finite, .graph = graph });
}
/* One element of parameter `name` of every replica set to v (as a load of a bad file would). */
static void nf_poke(mgpu_model* m, const char* name, int64_t at, float v) {
    int r;
    for (r = 0; r < mgpu_model_replica_count(m); ++r) {
        mgpu_tensor* p = mgpu_model_param(m, r, name);
        float* host = p ? fbuf(mgpu_tensor_numel(p)) : NULL;
        if (!p) { CHECK(0, "mgpu_model_param(%s): %s", name, mgpu_last_error()); return; }
        tget(p, host);
        host[at] = v;
        tput(p, host);
        free(host);
    }
}
/* Every replica's parameters, concatenated (stage by stage), into a new buffer of *n floats. */
static float* nf_params(mgpu_model* m, int64_t* n) {
    const int R = mgpu_model_replica_count(m), S = mgpu_model_stage_count(m);
    int64_t total = 0, at = 0;
    float* all;
    int r, s;
    for (r = 0; r < R; ++r)
        for (s = 0; s < S; ++s) total += mgpu_tensor_numel(mgpu_model_stage_params(m, r, s));
    all = fbuf(total);
    for (r = 0; r < R; ++r)
        for (s = 0; s < S; ++s) {
            tget(mgpu_model_stage_params(m, r, s), all + at);
            at += mgpu_tensor_numel(mgpu_model_stage_params(m, r, s));
        }
    *n = total;
    return all;
}

/* A NaN weight makes the loss NaN, not a finite falling one; with check_finite the step that
   meets it fails naming the step, and changes no parameter (nor, the next clean step shows, the
   optimizer's state); off by default. */
static void nf_model(const char* where, const char* spec, int stages, int graph) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model *plain = set ? nf_mlp(set, stages, 0, graph) : NULL, *checked = set ? nf_mlp(set, stages, 1, graph) : NULL;
    mgpu_optimizer_desc od = { .kind = MGPU_ADAMW, .lr = 0.01f };
    mgpu_optimizer *po = plain ? mgpu_optimizer_create(plain, &od) : NULL, *co = checked ? mgpu_optimizer_create(checked, &od) : NULL;
    CHECK(set && plain && checked && po && co, "%s (%s): %s", where, spec, mgpu_last_error());
    if (set && plain && checked && po && co) {
        float xs[8 * 4], loss = 0.0f;
        const int32_t labels[8] = { 0, 1, 2, 0, 1, 2, 0, 1 };
        mgpu_tensor *x, *t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
        float *before, *after;
        int64_t n = 0, n2 = 0;
        mgpu_result r;
        char what[128];
        int i, k;
        for (i = 0; i < 8 * 4; ++i) xs[i] = (float)rng_gauss();
        x = tfrom(mgpu_device_cpu(), mgpu_shape2(8, 4), xs);
        /* off: a NaN weight steps on, and the loss is NaN at every step (PyTorch's too) */
        MUST(mgpu_model_train_step(plain, po, x, t, &loss));
        CHECK(loss == loss, "%s: a clean step's loss is %g", where, (double)loss);
        nf_poke(plain, "0.weight", 5, NAN);
        for (k = 0; k < 3; ++k) {
            r = mgpu_model_train_step(plain, po, x, t, &loss);
            CHECK(r == MGPU_OK && nf_isnan(loss), "%s: check_finite off, a NaN weight: step %d gives %s and loss %g, want OK and NaN",
                  where, k + 2, mgpu_result_string(r), (double)loss);
        }
        /* on: a clean step, then the NaN weight: the step fails and nothing moves */
        MUST(mgpu_model_train_step(checked, co, x, t, &loss));
        nf_poke(checked, "0.weight", 5, NAN);
        before = nf_params(checked, &n);
        r = mgpu_model_train_step(checked, co, x, t, &loss);
        snprintf(what, sizeof what, "%s: check_finite, a NaN weight", where);
        expect_fail(r, MGPU_ERROR_INVALID_ARGUMENT, what, "step 2", "loss is NaN", "no parameter was updated");
        after = nf_params(checked, &n2);
        CHECK(n == n2 && !memcmp(before, after, (size_t)n * sizeof(float)), "%s: check_finite: the refused step changed the parameters",
              where);
        free(after);
        /* a NaN gradient (a finite loss): accumulate, poke the gradient, apply: refused, naming it */
        nf_poke(checked, "0.weight", 5, before[5] == before[5] ? before[5] : 0.5f);
        {
            mgpu_tensor* g = mgpu_model_grad(checked, 0, "2.bias");
            float gb[3];
            free(before);
            before = nf_params(checked, &n);
            MUST(mgpu_model_zero_grad(checked));
            MUST(mgpu_model_accumulate(checked, x, t, 0, &loss));
            CHECK(loss == loss, "%s: the repaired weight gives a finite loss (%g)", where, (double)loss);
            if (g) { tget(g, gb); gb[1] = INFINITY; tput(g, gb); }
            r = mgpu_model_apply(checked, co);
            snprintf(what, sizeof what, "%s: check_finite, an Inf gradient", where);
            expect_fail(r, MGPU_ERROR_INVALID_ARGUMENT, what, "step 2", "gradient of 2.bias holds +Inf", "no parameter");
            after = nf_params(checked, &n2);
            CHECK(n == n2 && !memcmp(before, after, (size_t)n * sizeof(float)), "%s: check_finite: the refused apply changed the "
                  "parameters", where);
            free(after);
            MUST(mgpu_model_zero_grad(checked));
            /* and the next clean step goes on as step 2 */
            MUST(mgpu_model_train_step(checked, co, x, t, &loss));
            CHECK(loss == loss, "%s: after the refused steps, a clean step's loss is %g", where, (double)loss);
        }
        free(before);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(t);
    }
    mgpu_optimizer_destroy(po); mgpu_optimizer_destroy(co);
    mgpu_model_destroy(plain); mgpu_model_destroy(checked);
    mgpu_device_set_destroy(set);
}

/* Clipping by the global norm does not hide a NaN: torch.nn.utils.clip_grad_norm_ with one NaN
   gradient returns norm nan and makes every gradient NaN (coefficient nan); with one Inf, norm inf,
   coefficient 0: gradients [0, nan, 0]. So after SGD every parameter is NaN, or only the Inf's. */
static void nf_clip(const char* where, const char* spec) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_model* m = set ? nf_mlp(set, 1, 0, 0) : NULL;
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f, .clip_norm = 1.0f }) : NULL;
    CHECK(set && m && o, "%s: clipping model: %s", where, mgpu_last_error());
    if (set && m && o) {
        float xs[8 * 4], loss, *before, *after, norm = 0.0f;
        const int32_t labels[8] = { 0, 1, 2, 0, 1, 2, 0, 1 };
        mgpu_tensor *x, *t = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
        int64_t n = 0, i, nans = 0, moved = 0;
        int k;
        for (i = 0; i < 8 * 4; ++i) xs[i] = (float)rng_gauss();
        x = tfrom(mgpu_device_cpu(), mgpu_shape2(8, 4), xs);
        for (k = 0; k < 2; ++k) {   /* 0: a NaN gradient, 1: an Inf one (on a fresh model's state: one NaN left over) */
            mgpu_tensor* g = mgpu_model_grad(m, 0, "2.bias");
            float gb[3];
            before = nf_params(m, &n);
            MUST(mgpu_model_zero_grad(m));
            MUST(mgpu_model_accumulate(m, x, t, 0, &loss));
            if (g) { tget(g, gb); gb[1] = k == 0 ? NAN : INFINITY; tput(g, gb); }
            MUST(mgpu_model_apply(m, o));
            MUST(mgpu_optimizer_last_grad_norm(o, &norm));
            after = nf_params(m, &n);
            nans = moved = 0;
            for (i = 0; i < n; ++i) {
                nans += nf_isnan(after[i]);
                moved += !nf_same(before[i], after[i]);
            }
            if (k == 0)
                CHECK(nf_isnan(norm) && nans == n, "%s: clip_norm with a NaN gradient: norm %g, %lld of %lld parameters NaN; PyTorch: "
                      "nan, every one", where, (double)norm, (long long)nans, (long long)n);
            else   /* (every parameter is NaN already; the norm says Inf) */
                CHECK(norm == INFINITY, "%s: clip_norm with an Inf gradient: norm %g; PyTorch: inf", where, (double)norm);
            free(before); free(after);
            if (k == 0) {   /* a fresh model for the Inf case */
                mgpu_optimizer_destroy(o);
                mgpu_model_destroy(m);
                m = nf_mlp(set, 1, 0, 0);
                o = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f, .clip_norm = 1.0f }) : NULL;
                if (!m || !o) { CHECK(0, "%s: clipping model: %s", where, mgpu_last_error()); break; }
            }
        }
        if (m && o) {   /* the Inf case: only the Inf's parameter (2.bias[1]) turned NaN, the others moved by 0 */
            after = nf_params(m, &n);
            nans = 0;
            for (i = 0; i < n; ++i) nans += nf_isnan(after[i]);
            CHECK(nans == mgpu_model_replica_count(m), "%s: clip_norm with an Inf gradient: %lld parameters NaN, want 1 a replica "
                  "(PyTorch's gradients [0, nan, 0])", where, (long long)nans);
            free(after);
        }
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(t);
    }
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

static void test_nonfinite(void) {
    header("8. NaN and Inf never hidden: ReLU, MaxPool2d, argmax, cross-entropy, check_finite");
    nf_ops("cpu", mgpu_device_cpu());
    nf_maxpools("cpu", "cpu");
    nf_model("cpu", "cpu", 1, 0);
    nf_model("cpu:2", "cpu:2", 1, 0);
    nf_model("cpu:2 in 2 stages", "cpu:2", 2, 0);
    nf_clip("cpu:2", "cpu:2");
    if (gpu_part("NaN and Inf")) {
        nf_ops("cuda:0", g_gpu);
        nf_maxpools("cuda:0", "cuda:0");
        nf_model("cuda:0,0", "cuda:0,0", 1, 0);
        nf_model("cuda:0,0 with a graph", "cuda:0,0", 1, 1);
        nf_model("cuda:0,0 in 2 stages", "cuda:0,0", 2, 0);
        nf_clip("cuda:0,0", "cuda:0,0");
    }
}

int main(int argc, char** argv) {
    double t0 = test_start("test_seq");
    test_select(argc, argv);
    printf("test_seq: mgpu %s, seed %llu (MGPU_TEST_SEED to repeat)%s, %d CPU threads\n", MGPU_VERSION_STRING,
           (unsigned long long)g_test_seed, g_quick ? ", quick sizes" : "", mgpu_cpu_threads());
#ifdef MGPU_CUDA
    if (mgpu_cuda_device_count() > 0) {
        g_gpu_set = mgpu_device_set_create("cuda:0");
        CHECK(g_gpu_set != NULL, "mgpu_device_set_create(\"cuda:0\"): %s", mgpu_last_error());
        if (g_gpu_set) g_gpu = mgpu_device_set_get(g_gpu_set, 0);
    }
    printf("built with CUDA: %d GPU(s)%s\n", mgpu_cuda_device_count(), g_gpu ? ", testing cuda:0" : "");
#else
    printf("built without CUDA\n");
#endif
    (void)gpu_part; (void)test_rel_error;   /* until every group uses them */
    TEST_GROUP(test_sequences());
    TEST_GROUP(test_norm_embedding());
    TEST_GROUP(test_attention());
    TEST_GROUP(test_containers());
    TEST_GROUP(test_names_ties());
    TEST_GROUP(test_gpt_layouts());
    TEST_GROUP(test_batchnorm());
    TEST_GROUP(test_nonfinite());
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_seq");
}
