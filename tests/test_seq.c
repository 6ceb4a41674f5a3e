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
                                               onehot_forward, onehot_backward, NULL, NULL };

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
static float* token_batch(const char* spec, int micro, const int32_t* ids, const int32_t* lab, int B, float* loss_out) {
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
    x = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), ids);
    y = tfrom_i32(mgpu_device_cpu(), mgpu_shape2(B, SEQ_T), lab);
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
                                                failing_forward, failing_backward, NULL, NULL };

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
    }
}

/* ============================================================================================ */
/* 2. LayerNorm, Embedding, position embedding, GELU (tanh)                                     */
/* ============================================================================================ */
static void test_norm_embedding(void) {
    header("2. LayerNorm, Embedding, position embedding, GELU (tanh)");
}

/* ============================================================================================ */
/* 3. causal multi-head self-attention                                                          */
/* ============================================================================================ */
static void test_attention(void) {
    header("3. causal multi-head self-attention");
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
    int i;
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
        CHECK(mgpu_tensor_data(mgpu_model_param(m, 0, "head.weight")) == mgpu_tensor_data(mgpu_model_param(m, 0, "enc.weight")),
              "the tied tensors share their floats");
        model_gradcheck("tied Linear 3->4, Tanh, Conv1D 4->3 (gradients of both uses added)", m, 3, 3, 3);
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
        {   /* across pipeline stages: refused */
            mgpu_device_set* two = mgpu_device_set_create("cpu:2");
            layers[0] = mgpu_layer_name(mgpu_layer_linear(3, 4), "enc");
            layers[1] = mgpu_layer_tanh();
            layers[2] = mgpu_layer_name(mgpu_layer_conv1d(4, 3), "head");
            m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(3), .layers = layers, .layer_count = 3, .ties = &tie,
                                                      .tie_count = 1, .devices = two, .stages = 2, .split = (const int[]){ 2 } });
            CHECK(m == NULL && strstr(mgpu_last_error(), "another pipeline stage"), "a tie across stages refused: %s", mgpu_last_error());
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
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_seq");
}
