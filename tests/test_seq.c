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
static void test_sequences(void) {
    header("1. sequences: token inputs, targets per position, Linear on [..., D]");
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
/* The layer is run by hand: its vtable called with an mgpu_layer_ctx of tensors made here (its
   parameters, gradients and aux buffers), on the CPU or on g_gpu. */
#define ATTN_PARAMS 4
#define ATTN_MUST(expr)                                                                          \
    do {                                                                                         \
        mgpu_result attn_r_ = (expr);                                                            \
        if (attn_r_ != MGPU_OK) CHECK(0, "%s: %s", #expr, mgpu_last_error());                    \
    } while (0)
#define ATTN_AUX_MAX 16
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
static void attn_vals_make(attn_vals* v, int B, int T, int D) {
    const int64_t n[ATTN_PARAMS] = { 3 * (int64_t)D * D, 3 * (int64_t)D, (int64_t)D * D, D };
    int64_t i;
    int k;
    for (k = 0; k < ATTN_PARAMS; ++k) {
        v->p[k] = fbuf(n[k]);
        for (i = 0; i < n[k]; ++i) v->p[k][i] = (float)(rng_gauss() * (k % 2 == 0 ? 0.3 : 0.1));
    }
    v->x = fbuf((int64_t)B * T * D);
    for (i = 0; i < (int64_t)B * T * D; ++i) v->x[i] = (float)rng_gauss();
}
static void attn_vals_free(attn_vals* v) {
    int k;
    for (k = 0; k < ATTN_PARAMS; ++k) free(v->p[k]);
    free(v->x);
}

/* The formula in float64: qkv = x Wa^T + ba; per head softmax(q k^T / sqrt(hs)) with the causal
   mask, times amask ([B, H, T, T], NULL: none); y = att v merged; out = y Wp^T + bp, times omask
   ([B, T, D], NULL: none). */
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
                for (d = 0; d < D; ++d) acc += (double)v->x[((int64_t)b * T + t) * D + d] * wa[(int64_t)o * D + d];
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
            for (d = 0; d < D; ++d) acc += y[(int64_t)b * D + d] * wp[(int64_t)o * D + d];
            out[(int64_t)b * D + o] = omask ? acc * omask[(int64_t)b * D + o] : acc;
        }
    free(qkv); free(y); free(sc);
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
        if (p > 0.0f) {
            const int64_t na = (int64_t)B * H * T * T;
            int64_t i, bad = 0, drawn = 0, dropped = 0;
            int b, h, t, s;
            amask = fbuf(na); omask = fbuf(n);
            tget(r.aux[6], amask);
            tget(r.aux[7], omask);
            for (b = 0; b < B; ++b)
                for (h = 0; h < H; ++h)
                    for (t = 0; t < T; ++t)
                        for (s = 0; s < T; ++s) {
                            float m = amask[(((int64_t)b * H + h) * T + t) * T + s];
                            if (s > t) { bad += m != 0.0f; continue; }
                            drawn++;
                            dropped += m == 0.0f;
                            bad += m != 0.0f && m != 1.0f / (1.0f - p);
                        }
            for (i = 0; i < n; ++i) {
                drawn++;
                dropped += omask[i] == 0.0f;
                bad += omask[i] != 0.0f && omask[i] != 1.0f / (1.0f - p);
            }
            CHECK(bad == 0, "%s: %lld mask entries are neither 0 nor 1/(1-p) (or not 0 above the diagonal)", what, (long long)bad);
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
    float *y = fbuf(n), *y0 = fbuf(n), *m = fbuf(B * per), *mo = fbuf(n), *hm = fbuf(per), *hmo = fbuf(n / B), *hy = fbuf(n / B);
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
        tget(r.aux[6], m);
        tget(r.aux[7], mo);
    }
    /* by sample: sample b alone, with first_row b */
    vh = v;
    for (b = 0; b < B; ++b) {
        attn_rig_make(&half, l, mgpu_device_cpu(), 1, T, D, H);
        vh.x = v.x + (int64_t)b * T * D;
        attn_rig_put(&half, &vh);
        half.ctx.first_row = b;
        if (attn_rig_forward(&half, hy)) {
            tget(half.aux[6], hm);
            tget(half.aux[7], hmo);
            same_mask &= !memcmp(hm, m + b * per, (size_t)per * sizeof(float)) && !memcmp(hmo, mo + b * T * D, (size_t)T * D * sizeof(float));
            for (k = 0; k < T * D; ++k) same_y &= fabsf(hy[k] - y[b * T * D + k]) <= 1e-6f * (1.0f + fabsf(y[b * T * D + k]));
        }
        attn_rig_free(&half);
    }
    CHECK(same_mask, "attention: the masks of sample b alone (first_row b) differ from those of the whole batch");
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
    free(y); free(y0); free(m); free(mo); free(hm); free(hmo); free(hy);
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
        const int64_t want0 = i == 0 ? 3 * D : i == 1 ? 3 * D : D;
        const int64_t n = mgpu_tensor_numel(t);
        int64_t j;
        float* h = fbuf(n);
        double mean = 0.0, sq = 0.0;
        CHECK(!strcmp(mgpu_model_tensor_name(m, i), names[i]), "attention model: tensor %d is '%s', expected '%s'", i,
              mgpu_model_tensor_name(m, i), names[i]);
        CHECK(mgpu_tensor_dim(t, 0) == want0 && mgpu_tensor_shape(t).ndim == (i % 2 == 0 ? 2 : 1) &&
              (i % 2 == 1 || mgpu_tensor_dim(t, 1) == D), "attention model: %s has the wrong shape", names[i]);
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

/* A training step (MSE on [batch, T, dim], SGD) with both dropouts on "cpu" and on "cpu:2": the
   replicas' masks are drawn by sample, so two replicas of two samples each take the step one
   device takes (to rounding: the replicas' gradients are summed in another order). */
static double attn_step(const char* spec, float p, const float* xs, const float* ts, int B, int T, int D, int H, float* change,
                        size_t* bytes) {
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_layer* layers[1];
    mgpu_model_desc desc;
    mgpu_optimizer_desc od;
    mgpu_model* m = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_tensor *x = NULL, *t = NULL;
    float loss = NAN;
    mgpu_result r;
    if (!set) { CHECK(0, "attention step: %s: %s", spec, mgpu_last_error()); return NAN; }
    layers[0] = mgpu_layer_causal_self_attention(D, H, p);
    memset(&desc, 0, sizeof desc);
    desc.input = mgpu_shape2(T, D);
    desc.layers = layers;
    desc.layer_count = 1;
    desc.devices = set;
    desc.loss = MGPU_LOSS_MSE;
    desc.seed = 5;
    m = mgpu_model_create(&desc);
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
    bad_aux = tmake(cpu, MGPU_F32, mgpu_shape4(2, 2, 5, 4));
    bad_dy = tmake(cpu, MGPU_F32, mgpu_shape3(2, 4, 8));
    expect_fail(l->vt->forward(l, &r.ctx, bad_x, r.y), MGPU_ERROR_SHAPE_MISMATCH, "attention forward on [2,5,9]",
                "CausalSelfAttention", "[batch,T,8]", NULL);
    expect_fail(l->vt->forward(l, &r.ctx, r.x, bad_x), MGPU_ERROR_SHAPE_MISMATCH, "attention forward into y [2,5,9]",
                "CausalSelfAttention(dim 8, heads 2) forward", "'y'", NULL);
    keep = r.aux[1];
    r.aux[1] = bad_aux;
    expect_fail(l->vt->forward(l, &r.ctx, r.x, r.y), MGPU_ERROR_SHAPE_MISMATCH, "attention forward with aux[1] [2,2,5,4]",
                "aux[1]", "[2,2,5,5]", NULL);
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
        if (p > 0.0f && training)
            for (k = 6; k <= 7; ++k) {
                const int64_t na = mgpu_tensor_numel(c.aux[k]);
                a = fbuf(na); b = fbuf(na);
                tget(c.aux[k], a);
                tget(g.aux[k], b);
                CHECK(!memcmp(a, b, (size_t)na * sizeof(float)), "%s: the %s dropout mask differs from the CPU's", what,
                      k == 6 ? "attention" : "residual");
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
static void attn_gpu_graph(void) {
#ifdef MGPU_CUDA
    const int B = 3, T = 7, D = 8, H = 2, steps = 4;
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
        mgpu_layer* layers[1];
        mgpu_model_desc desc;
        mgpu_optimizer_desc od;
        layers[0] = mgpu_layer_causal_self_attention(D, H, 0.3f);
        memset(&desc, 0, sizeof desc);
        desc.input = mgpu_shape2(T, D);
        desc.layers = layers;
        desc.layer_count = 1;
        desc.devices = g_gpu_set;
        desc.loss = MGPU_LOSS_MSE;
        desc.seed = 9;
        desc.graph = k;
        m[k] = mgpu_model_create(&desc);
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
#endif
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
    attn_model();
    attn_replicas();
    if (gpu_part("attention")) {
        attn_gpu_case(2, 5, 8, 2, 0.0f, 1);
        attn_gpu_case(3, 5, 6, 1, 0.0f, 1);
        attn_gpu_case(2, 1, 4, 1, 0.0f, 1);
        attn_gpu_case(4, 37, 16, 4, 0.0f, 1);   /* 592 rows: more than the emulator's 61 blocks of 8 warps cover in one pass */
        attn_gpu_case(1, 37, 70, 1, 0.0f, 1);   /* head size past 32 (lanes loop over it) */
        attn_gpu_case(4, 37, 16, 4, 0.4f, 1);   /* dropout: the CPU's masks */
        attn_gpu_case(2, 5, 8, 2, 0.4f, 0);     /* evaluation ignores it */
        attn_gpu_model();
        attn_gpu_graph();
    }
}

/* ============================================================================================ */
/* 4. containers                                                                                */
/* ============================================================================================ */
static void test_containers(void) {
    header("4. containers: sequential, residual, a layer called from a layer");
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
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_seq");
}
