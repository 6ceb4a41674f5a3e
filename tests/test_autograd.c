#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_autograd.c - the tape (issue "Autograd"): reverse mode over mgpu_tape_* ops.

   1. every op's forward against float64 loops and its gradient against central finite
      differences of those loops (float64), broadcasting, keepdim and transposed cases included,
      on the CPU and on cuda:0 (real or emulated)
   2. layers made of ops (mgpu_layer_from_ops) against the built-ins they rebuild: Linear+GELU,
      LayerNorm and GPT-2's causal self-attention, their gradients in a model within 1e-5, on the
      CPU, on cpu:2 replicas and on cuda:0; a step after the first allocates no device memory;
      2b. dropout (masks, gradient, by sample across replicas, the GPU's masks the CPU's);
      2c. a CUDA graph of their steps equals the eager steps bit for bit; 2d. in a pipeline
      (2 CPU stages, micro-batches) they give one device's bits
   3. misuse: shapes that do not broadcast, two devices, another tape's tensor, a watched op
      output, backward of what depends on nothing watched, an input changed before backward,
      the first failure kept by the tape

   MGPU_TEST_QUICK=1 changes nothing here: the sizes are small already. */

#include <stdint.h>

#ifdef MGPU_CUDA
static mgpu_device_set* g_gpu_set;
#endif
static mgpu_device* g_gpu;   /* cuda:0, or NULL */
static int gpu_part(const char* group) { return test_gpu_group(group, g_gpu != NULL); }

/* ============================================================================================ */
/* 1. every op against float64                                                                  */
/* ============================================================================================ */
enum {
    OP_EXP, OP_LOG, OP_SQRT, OP_RSQRT, OP_TANH, OP_SIGMOID, OP_RELU, OP_GELU, OP_GELU_TANH, OP_NEG, OP_ABS, OP_POW,
    OP_SCALE, OP_ADD_SCALAR, OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_MAXIMUM, OP_MINIMUM, OP_SUM, OP_MEAN, OP_MAX,
    OP_SOFTMAX, OP_LOG_SOFTMAX, OP_MATMUL, OP_RESHAPE, OP_PERMUTE, OP_SLICE, OP_CONCAT, OP_GATHER, OP_XENT, OP_MSE,
    OP_CAUSAL, OP_WHERE, OP_SCATTER
};
typedef struct ad_case {
    const char* name;
    int op;
    mgpu_shape sa, sb;   /* sb.ndim 0: one input (gather: ids; cross-entropy: labels) */
    int axis, keepdim, ta, tb;
    int perm[4];
    int64_t start, length;
    float alpha;
    double lo, hi;       /* inputs uniform in [lo, hi], kept 0.05 away from 0 */
    mgpu_shape sc;       /* where's condition (0s and 1s, from the ids) */
} ad_case;

/* index helpers over up to 4 dimensions, shapes padded with leading 1s */
static void pad4(mgpu_shape s, int64_t d[4]) { int i; for (i = 0; i < 4; ++i) d[i] = i < 4 - s.ndim ? 1 : s.dim[i - (4 - s.ndim)]; }
static int64_t at4(const int64_t d[4], const int64_t c[4]) {   /* c broadcast: a dimension of 1 reads index 0 */
    int64_t o = 0;
    int i;
    for (i = 0; i < 4; ++i) o = o * d[i] + (d[i] == 1 ? 0 : c[i]);
    return o;
}
static void coords4(const int64_t d[4], int64_t i, int64_t c[4]) { int k; for (k = 3; k >= 0; --k) { c[k] = i % d[k]; i /= d[k]; } }
static int64_t numel(mgpu_shape s) { return mgpu_shape_numel(s); }

static double ref_unary(int op, double x, double alpha) {
    switch (op) {
    case OP_EXP: return exp(x);
    case OP_LOG: return log(x);
    case OP_SQRT: return sqrt(x);
    case OP_RSQRT: return 1.0 / sqrt(x);
    case OP_TANH: return tanh(x);
    case OP_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case OP_RELU: return x > 0 ? x : 0;
    case OP_GELU: return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case OP_GELU_TANH: return 0.5 * x * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
    case OP_NEG: return -x;
    case OP_ABS: return fabs(x);
    case OP_POW: return pow(x, alpha);
    case OP_SCALE: return alpha * x;
    default: return x + alpha;   /* OP_ADD_SCALAR */
    }
}
static double ref_binary(int op, double a, double b) {
    switch (op) {
    case OP_ADD: return a + b;
    case OP_SUB: return a - b;
    case OP_MUL: return a * b;
    case OP_DIV: return a / b;
    case OP_MAXIMUM: return a > b ? a : b;
    default: return a < b ? a : b;
    }
}
/* The case's output shape, as the tape should give it */
static mgpu_shape out_shape(const ad_case* c) {
    mgpu_shape s = c->sa;
    int d, j = 0;
    switch (c->op) {
    case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_MAXIMUM: case OP_MINIMUM: case OP_WHERE: {
        const int nd = MGPU__MAX(MGPU__MAX(c->sa.ndim, c->sb.ndim), c->op == OP_WHERE ? c->sc.ndim : 0);
        s.ndim = nd;
        for (d = 0; d < nd; ++d) {
            const int ia = d - (nd - c->sa.ndim), ib = d - (nd - c->sb.ndim), ic = d - (nd - c->sc.ndim);
            const int64_t da = ia >= 0 ? c->sa.dim[ia] : 1, db = ib >= 0 ? c->sb.dim[ib] : 1;
            const int64_t dc = c->op == OP_WHERE && ic >= 0 ? c->sc.dim[ic] : 1;
            s.dim[d] = MGPU__MAX(MGPU__MAX(da, db), dc);
        }
        return s;
    }
    case OP_SUM: case OP_MEAN: case OP_MAX:
        for (d = 0; d < c->sa.ndim; ++d) {
            const int gone = c->axis == MGPU_ALL_AXES || d == (c->axis + c->sa.ndim) % c->sa.ndim;
            if (!gone || c->keepdim) s.dim[j++] = gone ? 1 : c->sa.dim[d];
        }
        s.ndim = j;
        return s;
    case OP_MATMUL: {
        const mgpu_shape lead = c->sa.ndim > 2 ? c->sa : c->sb;
        s = lead;
        s.dim[s.ndim - 2] = c->sa.dim[c->sa.ndim - 2 + (c->ta ? 1 : 0)];
        s.dim[s.ndim - 1] = c->sb.dim[c->sb.ndim - 1 - (c->tb ? 1 : 0)];
        return s;
    }
    case OP_RESHAPE: return c->sb;
    case OP_PERMUTE: for (d = 0; d < c->sa.ndim; ++d) s.dim[d] = c->sa.dim[c->perm[d]]; return s;
    case OP_SLICE: s.dim[c->axis] = c->length; return s;
    case OP_CONCAT: s.dim[c->axis] += c->sb.dim[c->axis]; return s;
    case OP_GATHER: s = c->sb; s.dim[s.ndim++] = c->sa.dim[1]; return s;
    case OP_SCATTER: return mgpu_shape2(c->length, c->sa.dim[c->sa.ndim - 1]);
    case OP_XENT: case OP_MSE: memset(&s, 0, sizeof s); return s;
    default: return s;
    }
}
/* The case in float64: y from a, b (or ids) */
static void ref_case(const ad_case* c, const double* a, const double* b, const int32_t* ids, double* y) {
    const mgpu_shape so = out_shape(c);
    const int64_t n = numel(so), na = numel(c->sa);
    int64_t da[4], db[4], dout[4], co[4], i, j;
    pad4(c->sa, da); pad4(c->sb, db); pad4(so, dout);
    switch (c->op) {
    case OP_ADD: case OP_SUB: case OP_MUL: case OP_DIV: case OP_MAXIMUM: case OP_MINIMUM:
        for (i = 0; i < n; ++i) { coords4(dout, i, co); y[i] = ref_binary(c->op, a[at4(da, co)], b[at4(db, co)]); }
        return;
    case OP_SUM: case OP_MEAN: case OP_MAX: case OP_SOFTMAX: case OP_LOG_SOFTMAX: {
        /* over the kept shape k: each output the reduction of the inputs that map to it */
        int64_t dk[4], cnt[1024] = { 0 };
        double acc[1024];
        const int ax = c->axis == MGPU_ALL_AXES ? -1 : 4 - c->sa.ndim + (c->axis + c->sa.ndim) % c->sa.ndim;
        int k;
        for (k = 0; k < 4; ++k) dk[k] = (ax < 0 ? (k >= 4 - c->sa.ndim) : k == ax) ? 1 : da[k];
        for (i = 0; i < 1024; ++i) acc[i] = c->op == OP_MAX || c->op == OP_SOFTMAX || c->op == OP_LOG_SOFTMAX ? -INFINITY : 0;
        for (i = 0; i < na; ++i) {   /* the max first (softmax's shift), or the sum */
            coords4(da, i, co);
            j = at4(dk, co);
            if (c->op == OP_SUM || c->op == OP_MEAN) acc[j] += a[i];
            else if (a[i] > acc[j]) acc[j] = a[i];
            cnt[j]++;
        }
        if (c->op == OP_SUM || c->op == OP_MAX || c->op == OP_MEAN) {
            for (i = 0; i < n; ++i) y[i] = c->op == OP_MEAN ? acc[i] / (double)cnt[i] : acc[i];
            return;
        }
        {
            double sum[1024] = { 0 };
            for (i = 0; i < na; ++i) { coords4(da, i, co); j = at4(dk, co); sum[j] += exp(a[i] - acc[j]); }
            for (i = 0; i < na; ++i) {
                coords4(da, i, co);
                j = at4(dk, co);
                y[i] = c->op == OP_SOFTMAX ? exp(a[i] - acc[j]) / sum[j] : a[i] - acc[j] - log(sum[j]);
            }
        }
        return;
    }
    case OP_MATMUL: {
        const int64_t m = dout[2], nn = dout[3], kk = c->ta ? da[2] : da[3];
        const int64_t batch = dout[0] * dout[1];
        const int a3 = c->sa.ndim > 2, b3 = c->sb.ndim > 2;
        int64_t bt, r, q, k;
        for (bt = 0; bt < batch; ++bt)
            for (r = 0; r < m; ++r)
                for (q = 0; q < nn; ++q) {
                    double s = 0;
                    const double* pa = a + (a3 ? bt * da[2] * da[3] : 0);
                    const double* pb = b + (b3 ? bt * db[2] * db[3] : 0);
                    for (k = 0; k < kk; ++k)
                        s += (c->ta ? pa[k * da[3] + r] : pa[r * da[3] + k]) * (c->tb ? pb[q * db[3] + k] : pb[k * db[3] + q]);
                    y[(bt * m + r) * nn + q] = s;
                }
        return;
    }
    case OP_PERMUTE: {
        int64_t cx[4];
        const int pad = 4 - c->sa.ndim;
        int k;
        for (i = 0; i < n; ++i) {
            coords4(dout, i, co);
            for (k = 0; k < 4; ++k) cx[k] = 0;
            for (k = 0; k < c->sa.ndim; ++k) cx[pad + c->perm[k]] = co[pad + k];
            y[i] = a[at4(da, cx)];
        }
        return;
    }
    case OP_SLICE:
        for (i = 0; i < n; ++i) { coords4(dout, i, co); co[4 - c->sa.ndim + c->axis] += c->start; y[i] = a[at4(da, co)]; }
        return;
    case OP_CONCAT: {
        const int ax = 4 - c->sa.ndim + c->axis;
        for (i = 0; i < n; ++i) {
            coords4(dout, i, co);
            if (co[ax] < da[ax]) y[i] = a[at4(da, co)];
            else { co[ax] -= da[ax]; y[i] = b[at4(db, co)]; }
        }
        return;
    }
    case OP_GATHER: {
        const int64_t dim = c->sa.dim[1];
        for (i = 0; i < n; ++i) y[i] = a[ids[i / dim] * dim + i % dim];
        return;
    }
    case OP_SCATTER: {   /* row p of a added into row ids[p] */
        const int64_t dim = c->sa.dim[c->sa.ndim - 1];
        for (i = 0; i < n; ++i) y[i] = 0;
        for (i = 0; i < na; ++i) y[ids[i / dim] * dim + i % dim] += a[i];
        return;
    }
    case OP_XENT: {
        const int64_t rows = c->sa.dim[0], cls = c->sa.dim[1];
        double loss = 0;
        for (i = 0; i < rows; ++i) {
            double mx = -INFINITY, s = 0;
            for (j = 0; j < cls; ++j) mx = a[i * cls + j] > mx ? a[i * cls + j] : mx;
            for (j = 0; j < cls; ++j) s += exp(a[i * cls + j] - mx);
            loss += mx + log(s) - a[i * cls + ids[i]];
        }
        y[0] = loss / (double)rows;
        return;
    }
    case OP_MSE: {
        double s = 0;
        for (i = 0; i < na; ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
        y[0] = s / (double)na;
        return;
    }
    case OP_RESHAPE: for (i = 0; i < n; ++i) y[i] = a[i]; return;
    case OP_WHERE: {   /* the condition's values are the ids' (0 or 1) */
        int64_t dc[4];
        pad4(c->sc, dc);
        for (i = 0; i < n; ++i) { coords4(dout, i, co); y[i] = ids[at4(dc, co)] ? a[at4(da, co)] : b[at4(db, co)]; }
        return;
    }
    case OP_CAUSAL:   /* key s after query t (s > t + keys - queries): alpha */
        for (i = 0; i < n; ++i) {
            coords4(dout, i, co);
            y[i] = co[3] > co[2] + (dout[3] - dout[2]) ? c->alpha : a[i];
        }
        return;
    default: for (i = 0; i < n; ++i) y[i] = ref_unary(c->op, a[i], c->alpha); return;
    }
}
static const mgpu_tensor* run_case(mgpu_tape* t, const ad_case* c, const mgpu_tensor* a, const mgpu_tensor* b) {
    switch (c->op) {
    case OP_EXP: return mgpu_tape_exp(t, a);
    case OP_LOG: return mgpu_tape_log(t, a);
    case OP_SQRT: return mgpu_tape_sqrt(t, a);
    case OP_RSQRT: return mgpu_tape_rsqrt(t, a);
    case OP_TANH: return mgpu_tape_tanh(t, a);
    case OP_SIGMOID: return mgpu_tape_sigmoid(t, a);
    case OP_RELU: return mgpu_tape_relu(t, a);
    case OP_GELU: return mgpu_tape_gelu(t, a);
    case OP_GELU_TANH: return mgpu_tape_gelu_tanh(t, a);
    case OP_NEG: return mgpu_tape_neg(t, a);
    case OP_ABS: return mgpu_tape_abs(t, a);
    case OP_POW: return mgpu_tape_pow(t, a, c->alpha);
    case OP_SCALE: return mgpu_tape_scale(t, a, c->alpha);
    case OP_ADD_SCALAR: return mgpu_tape_add_scalar(t, a, c->alpha);
    case OP_ADD: return mgpu_tape_add(t, a, b);
    case OP_SUB: return mgpu_tape_sub(t, a, b);
    case OP_MUL: return mgpu_tape_mul(t, a, b);
    case OP_DIV: return mgpu_tape_div(t, a, b);
    case OP_MAXIMUM: return mgpu_tape_maximum(t, a, b);
    case OP_MINIMUM: return mgpu_tape_minimum(t, a, b);
    case OP_SUM: return mgpu_tape_sum(t, a, c->axis, c->keepdim);
    case OP_MEAN: return mgpu_tape_mean(t, a, c->axis, c->keepdim);
    case OP_MAX: return mgpu_tape_max(t, a, c->axis, c->keepdim);
    case OP_SOFTMAX: return mgpu_tape_softmax(t, a, c->axis);
    case OP_LOG_SOFTMAX: return mgpu_tape_log_softmax(t, a, c->axis);
    case OP_MATMUL: return mgpu_tape_matmul(t, a, b, (mgpu_transpose)c->ta, (mgpu_transpose)c->tb);
    case OP_RESHAPE: return mgpu_tape_reshape(t, a, c->sb);
    case OP_PERMUTE: return mgpu_tape_permute(t, a, c->perm);
    case OP_SLICE: return mgpu_tape_slice(t, a, c->axis, c->start, c->length);
    case OP_CONCAT: return mgpu_tape_concat(t, a, b, c->axis);
    case OP_GATHER: return mgpu_tape_gather_rows(t, a, b);
    case OP_SCATTER: return mgpu_tape_scatter_add_rows(t, a, b, c->length);
    case OP_XENT: return mgpu_tape_cross_entropy(t, a, b);
    case OP_CAUSAL: return mgpu_tape_causal_mask(t, a, c->alpha);
    case OP_WHERE: return NULL;   /* run_where, with its condition */
    default: return mgpu_tape_mse(t, a, b);
    }
}
static int two_float_inputs(const ad_case* c) {
    return c->sb.ndim > 0 && c->op != OP_GATHER && c->op != OP_SCATTER && c->op != OP_XENT && c->op != OP_RESHAPE;
}
/* One case on dev: y and the gradients of sum(y * w) with respect to a (and b), into host buffers */
static int tape_case(mgpu_device* dev, const ad_case* c, const float* a, const float* b, const int32_t* ids, const float* w,
                     float* y, float* ga, float* gb) {
    const mgpu_shape so = out_shape(c);
    const int two = two_float_inputs(c);
    mgpu_tensor *ta = tfrom(dev, c->sa, a), *tb = NULL, *tw = tfrom(dev, so, w);
    mgpu_tape* tape = mgpu_tape_create(dev);
    const mgpu_tensor* out;
    int ok = 1;
    mgpu_tensor* cond = NULL;
    if (two) tb = tfrom(dev, c->sb, b);
    else if (c->sb.ndim > 0 && c->op != OP_RESHAPE) tb = tfrom_i32(dev, c->sb, ids);
    if (c->op == OP_WHERE) {
        const int64_t nc = numel(c->sc);
        float* cv = fbuf(nc > 0 ? nc : 1);
        int64_t i;
        for (i = 0; i < nc; ++i) cv[i] = (float)ids[i];
        cond = tfrom(dev, c->sc, cv);
        free(cv);
    }
    MUST(mgpu_tape_watch(tape, ta));
    if (two) MUST(mgpu_tape_watch(tape, tb));
    out = c->op == OP_WHERE ? mgpu_tape_where(tape, cond, ta, tb) : run_case(tape, c, ta, tb);
    if (!out || !mgpu_shape_equal(mgpu_tensor_shape(out), so)) {
        CHECK(0, "%s on %s: %s", c->name, mgpu_device_label(dev), out ? "wrong output shape" : mgpu_last_error());
        ok = 0;
    } else {
        const mgpu_tensor* g;
        tget(out, y);
        MUST(mgpu_tape_backward(tape, out, tw));
        if ((g = mgpu_tape_grad(tape, ta)) != NULL) tget(g, ga);
        else memset(ga, 0, (size_t)numel(c->sa) * sizeof(float));
        if (two && (g = mgpu_tape_grad(tape, tb)) != NULL) tget(g, gb);
        else if (two) memset(gb, 0, (size_t)numel(c->sb) * sizeof(float));
    }
    mgpu_tape_destroy(tape);
    mgpu_tensor_destroy(ta); mgpu_tensor_destroy(tb); mgpu_tensor_destroy(tw); mgpu_tensor_destroy(cond);
    return ok;
}
/* d sum(f(a, b) * w) / d a_i by central differences of the float64 loops */
static void fd_grad(const ad_case* c, double* a, double* b, const int32_t* ids, const double* w, double* x, int64_t nx,
                    double* grad) {
    const int64_t n = numel(out_shape(c));
    double* y = dbuf(n > 0 ? n : 1);
    int64_t i, j;
    for (i = 0; i < nx; ++i) {
        const double keep = x[i], h = 1e-6 * (fabs(keep) > 1 ? fabs(keep) : 1);
        double fp = 0, fm = 0;
        x[i] = keep + h;
        ref_case(c, a, b, ids, y);
        for (j = 0; j < (n > 0 ? n : 1); ++j) fp += y[j] * w[j];
        x[i] = keep - h;
        ref_case(c, a, b, ids, y);
        for (j = 0; j < (n > 0 ? n : 1); ++j) fm += y[j] * w[j];
        x[i] = keep;
        grad[i] = (fp - fm) / (2 * h);
    }
    free(y);
}
static void fill_inputs(const ad_case* c, float* v, int64_t n) {
    int64_t i;
    for (i = 0; i < n; ++i) {
        double x = c->lo + (c->hi - c->lo) * rng_unit();
        if (fabs(x) < 0.05) x = x < 0 ? x - 0.1 : x + 0.1;
        v[i] = (float)x;
    }
}

static void test_ops(void) {
#define S1(a) mgpu_shape1(a)
#define S2(a, b) mgpu_shape2(a, b)
#define S3(a, b, c) mgpu_shape3(a, b, c)
#define S4(a, b, c, d) mgpu_shape4(a, b, c, d)
    static const mgpu_shape none = { 0, { 0, 0, 0, 0 } };
    const ad_case cases[] = {
        { "exp", OP_EXP, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "log", OP_LOG, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, 0.2, 3, none },
        { "sqrt", OP_SQRT, S1(7), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, 0.2, 3, none },
        { "rsqrt", OP_RSQRT, S1(7), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, 0.2, 3, none },
        { "tanh", OP_TANH, S3(2, 3, 2), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "sigmoid", OP_SIGMOID, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -4, 4, none },
        { "relu", OP_RELU, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "gelu", OP_GELU, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "gelu_tanh", OP_GELU_TANH, S2(3, 4), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "neg", OP_NEG, S1(5), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "abs", OP_ABS, S1(9), none, 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "pow 3", OP_POW, S1(6), none, 0, 0, 0, 0, { 0 }, 0, 0, 3.0f, -2, 2, none },
        { "pow -0.5", OP_POW, S1(6), none, 0, 0, 0, 0, { 0 }, 0, 0, -0.5f, 0.3, 2, none },
        { "scale", OP_SCALE, S2(2, 3), none, 0, 0, 0, 0, { 0 }, 0, 0, -1.5f, -2, 2, none },
        { "add_scalar", OP_ADD_SCALAR, S2(2, 3), none, 0, 0, 0, 0, { 0 }, 0, 0, 0.75f, -2, 2, none },
        { "add, same shapes", OP_ADD, S2(3, 4), S2(3, 4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "add [3,4] + [4] (a bias)", OP_ADD, S2(3, 4), S1(4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "sub [3,1] - [1,4] (both stretched)", OP_SUB, S2(3, 1), S2(1, 4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "mul [2,3,4] * [3,1]", OP_MUL, S3(2, 3, 4), S2(3, 1), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "mul [1] * [2,2,2,3] (a scalar)", OP_MUL, S1(1), S4(2, 2, 2, 3), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "div [2,3] / [2,1]", OP_DIV, S2(2, 3), S2(2, 1), 0, 0, 0, 0, { 0 }, 0, 0, 0, 0.5, 2, none },
        { "maximum [3,4] [4]", OP_MAXIMUM, S2(3, 4), S1(4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "minimum [3,4] [3,4]", OP_MINIMUM, S2(3, 4), S2(3, 4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "sum axis 1", OP_SUM, S3(2, 3, 4), none, 1, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "sum axis -1 keepdim", OP_SUM, S3(2, 3, 4), none, -1, 1, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "sum of all", OP_SUM, S2(3, 5), none, MGPU_ALL_AXES, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "mean axis 0 keepdim", OP_MEAN, S4(3, 2, 2, 2), none, 0, 1, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "mean of all keepdim", OP_MEAN, S2(4, 3), none, MGPU_ALL_AXES, 1, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "max axis 1", OP_MAX, S2(4, 5), none, 1, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "max axis 0 keepdim", OP_MAX, S3(3, 2, 4), none, 0, 1, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "softmax axis -1", OP_SOFTMAX, S2(3, 5), none, -1, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "softmax axis 1 of 3", OP_SOFTMAX, S3(2, 4, 3), none, 1, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "log_softmax axis -1", OP_LOG_SOFTMAX, S2(4, 6), none, -1, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "matmul [3,4] @ [4,5]", OP_MATMUL, S2(3, 4), S2(4, 5), 0, 0, 0, 0, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [4,3]^T @ [4,5]", OP_MATMUL, S2(4, 3), S2(4, 5), 0, 0, 1, 0, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [3,4] @ [5,4]^T", OP_MATMUL, S2(3, 4), S2(5, 4), 0, 0, 0, 1, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [4,3]^T @ [5,4]^T", OP_MATMUL, S2(4, 3), S2(5, 4), 0, 0, 1, 1, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul batched [2,3,4] @ [2,4,2]", OP_MATMUL, S3(2, 3, 4), S3(2, 4, 2), 0, 0, 0, 0, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul batched [2,2,4,3]^T @ [2,2,5,4]^T", OP_MATMUL, S4(2, 2, 4, 3), S4(2, 2, 5, 4), 0, 0, 1, 1, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [2,3,4] @ [5,4]^T (a Linear)", OP_MATMUL, S3(2, 3, 4), S2(5, 4), 0, 0, 0, 1, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [2,4,3]^T @ [4,5] (shared b)", OP_MATMUL, S3(2, 4, 3), S2(4, 5), 0, 0, 1, 0, { 0 }, 0, 0, 0, -1, 1, none },
        { "matmul [3,4] @ [2,4,5] (shared a)", OP_MATMUL, S2(3, 4), S3(2, 4, 5), 0, 0, 0, 0, { 0 }, 0, 0, 0, -1, 1, none },
        { "reshape [2,6] -> [3,2,2]", OP_RESHAPE, S2(2, 6), S3(3, 2, 2), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "permute [2,3,4] (2,0,1)", OP_PERMUTE, S3(2, 3, 4), none, 0, 0, 0, 0, { 2, 0, 1 }, 0, 0, 0, -2, 2, none },
        { "permute [2,3,2,3] (0,2,1,3)", OP_PERMUTE, S4(2, 3, 2, 3), none, 0, 0, 0, 0, { 0, 2, 1, 3 }, 0, 0, 0, -2, 2, none },
        { "slice axis 1 [1, 3) of [3,5]", OP_SLICE, S2(3, 5), none, 1, 0, 0, 0, { 0 }, 1, 2, 0, -2, 2, none },
        { "slice axis 0 [2, 3) of [4,2,3]", OP_SLICE, S3(4, 2, 3), none, 0, 0, 0, 0, { 0 }, 2, 1, 0, -2, 2, none },
        { "concat axis 1 [2,3] [2,2]", OP_CONCAT, S2(2, 3), S2(2, 2), 1, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "concat axis 0 [1,2,3] [2,2,3]", OP_CONCAT, S3(1, 2, 3), S3(2, 2, 3), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "gather_rows [5,3] by [2,3] ids", OP_GATHER, S2(5, 3), S2(2, 3), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "scatter_add_rows [2,3,4] by [2,3] ids into 4 rows", OP_SCATTER, S3(2, 3, 4), S2(2, 3), 0, 0, 0, 0, { 0 }, 0, 4, 0, -2, 2, none },
        { "cross_entropy [4,5]", OP_XENT, S2(4, 5), S1(4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -3, 3, none },
        { "mse [3,4]", OP_MSE, S2(3, 4), S2(3, 4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, none },
        { "where [3,4] [4] by [3,1]", OP_WHERE, S2(3, 4), S1(4), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, S2(3, 1) },
        { "where [2,1,3] [2,4,1] by [4,3]", OP_WHERE, S3(2, 1, 3), S3(2, 4, 1), 0, 0, 0, 0, { 0 }, 0, 0, 0, -2, 2, S2(4, 3) },
        { "causal_mask [2,3,3]", OP_CAUSAL, S3(2, 3, 3), none, 0, 0, 0, 0, { 0 }, 0, 0, -3.0f, -2, 2, none },
        { "causal_mask [2,2,3,5] (2 keys before)", OP_CAUSAL, S4(2, 2, 3, 5), none, 0, 0, 0, 0, { 0 }, 0, 0, -3.0f, -2, 2, none },
    };
    const int count = (int)(sizeof cases / sizeof cases[0]);
    int i, k, worst = -1, gpu = 0;
    double worst_err = 0;
    header("1. every tape op: forward against float64, gradients against finite differences");
    for (i = 0; i < count; ++i) {
        const ad_case* c = &cases[i];
        const int64_t na = numel(c->sa), nb = c->sb.ndim ? numel(c->sb) : 0, ny = numel(out_shape(c));
        const int two = two_float_inputs(c);
        float *a = fbuf(na), *b = fbuf(nb + 1), *w = fbuf(ny), *y = fbuf(ny), *ga = fbuf(na), *gb = fbuf(nb + 1);
        double *da = dbuf(na), *db = dbuf(nb + 1), *dw = dbuf(ny), *ry = dbuf(ny), *rga = dbuf(na), *rgb = dbuf(nb + 1);
        const int64_t nids = c->op == OP_WHERE && numel(c->sc) > 0 ? numel(c->sc) : nb;
        int32_t* ids = (int32_t*)xmalloc((size_t)(nids + 1) * sizeof(int32_t));
        int64_t j;
        double ey, ea, eb = 0;
        fill_inputs(c, a, na);
        if (two) fill_inputs(c, b, nb);
        for (j = 0; j < nids; ++j)
            ids[j] = rng_int(c->op == OP_WHERE ? 2 : c->op == OP_SCATTER ? (int)c->length : c->op == OP_XENT ? (int)c->sa.dim[1] : (int)c->sa.dim[0]);
        for (j = 0; j < ny; ++j) w[j] = (float)(rng_unit() * 2 - 1);
        for (j = 0; j < na; ++j) da[j] = a[j];
        for (j = 0; j < nb; ++j) db[j] = b[j];
        for (j = 0; j < ny; ++j) dw[j] = w[j];
        ref_case(c, da, db, ids, ry);
        fd_grad(c, da, db, ids, dw, da, na, rga);
        if (two) fd_grad(c, da, db, ids, dw, db, nb, rgb);
        for (k = 0; k < 2; ++k) {   /* the CPU, then cuda:0 */
            mgpu_device* dev = k == 0 ? mgpu_device_cpu() : g_gpu;
            if (k == 1 && !gpu) {
                if (i > 0 || !gpu_part("tape ops")) break;
                gpu = 1;
            }
            if (!tape_case(dev, c, a, b, ids, w, y, ga, gb)) continue;
            ey = test_rel_error(y, ry, (size_t)ny);
            ea = test_rel_error(ga, rga, (size_t)na);
            if (two) eb = test_rel_error(gb, rgb, (size_t)nb);
            CHECK(ey < 1e-5 && ea < 1e-4 && eb < 1e-4, "%s on %s: relative error of y %.2e, of da %.2e, of db %.2e "
                  "(float64 loops and their finite differences; bounds 1e-5, 1e-4)", c->name, mgpu_device_label(dev), ey, ea, eb);
            if (ea > worst_err) { worst_err = ea; worst = i; }
            if (eb > worst_err) { worst_err = eb; worst = i; }
        }
        free(a); free(b); free(w); free(y); free(ga); free(gb);
        free(da); free(db); free(dw); free(ry); free(rga); free(rgb); free(ids);
    }
    printf("   %d cases; the largest gradient error %.2e (%s)\n", count, worst_err, worst >= 0 ? cases[worst].name : "-");
    {   /* edges: a sum past float's 2^24 (added in double), x^0's gradient at 0 (torch's 0), a matmul over k = 0 */
        const int64_t n = ((int64_t)1 << 24) + 8;
        mgpu_tape* t = mgpu_tape_create(mgpu_device_cpu());
        mgpu_tensor *ones = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(n)), *zero = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(1));
        mgpu_tensor *a0 = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape3(2, 3, 0)), *b0 = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(0, 4));
        const mgpu_tensor *sum, *p0, *mm;
        float got = 0, g0 = -1, mmv[24];
        MUST(mgpu_tensor_fill(ones, 1.0));
        MUST(mgpu_tensor_zero(zero));
        MUST(mgpu_tape_watch(t, zero));
        sum = mgpu_tape_sum(t, ones, MGPU_ALL_AXES, 0);
        p0 = mgpu_tape_sum(t, mgpu_tape_pow(t, zero, 0.0f), MGPU_ALL_AXES, 0);
        mm = mgpu_tape_matmul(t, a0, b0, MGPU_NO_TRANS, MGPU_NO_TRANS);
        CHECK(sum && p0 && mm, "edge cases: %s", mgpu_last_error());
        if (sum && p0 && mm) {
            int i, zeros = 1;
            tget(sum, &got);
            MUST(mgpu_tape_backward(t, p0, NULL));
            if (mgpu_tape_grad(t, zero)) tget(mgpu_tape_grad(t, zero), &g0);
            tget(mm, mmv);
            for (i = 0; i < 24; ++i) zeros &= mmv[i] == 0.0f;
            CHECK(got == (float)n && g0 == 0.0f && zeros && mgpu_tensor_numel(mm) == 24, "sum of 2^24 + 8 ones %.1f, "
                  "d(0^0)/dx %g (torch: 0), [2,3,0] @ [0,4] all zeros: %s", (double)got, (double)g0, zeros ? "yes" : "no");
        }
        mgpu_tape_destroy(t);
        mgpu_tensor_destroy(ones); mgpu_tensor_destroy(zero); mgpu_tensor_destroy(a0); mgpu_tensor_destroy(b0);
    }
#undef S1
#undef S2
#undef S3
#undef S4
}

/* ============================================================================================ */
/* 2. layers made of ops against the built-ins                                                  */
/* ============================================================================================ */
/* Linear(IN -> OUT) + GELU: y = gelu(x W^T + b), weight [OUT, IN] and bias [OUT] as nn.Linear's */
enum { LIN_IN = 6, LIN_OUT = 5, LN_DIM = 5 };
static const mgpu_tensor* linear_gelu_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    (void)user;
    return mgpu_tape_gelu(t, mgpu_tape_add(t, mgpu_tape_matmul(t, x, p[0], MGPU_NO_TRANS, MGPU_TRANS), p[1]));
}
static mgpu_result linear_gelu_shape(void* user, mgpu_shape x, mgpu_shape* y) {
    (void)user;
    *y = x;
    y->dim[y->ndim - 1] = LIN_OUT;
    return MGPU_OK;
}
static mgpu_layer* op_linear_gelu(void) {
    static const mgpu_op_param_desc params[2] = {
        { "weight", { 2, { LIN_OUT, LIN_IN, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, 0 },
        { "bias", { 1, { LIN_OUT, 0, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, LIN_IN },
    };
    mgpu_op_layer_desc d;
    memset(&d, 0, sizeof d);
    d.type = "LinearGELU"; d.params = params; d.param_count = 2;
    d.forward = linear_gelu_forward; d.output_shape = linear_gelu_shape;
    return mgpu_layer_from_ops(&d);
}
/* LayerNorm over the last dimension: (x - mean) / sqrt(var + 1e-5) * weight + bias */
static const mgpu_tensor* layer_norm_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    const mgpu_tensor* xc = mgpu_tape_sub(t, x, mgpu_tape_mean(t, x, -1, 1));
    const mgpu_tensor* var = mgpu_tape_mean(t, mgpu_tape_mul(t, xc, xc), -1, 1);
    (void)user;
    return mgpu_tape_add(t, mgpu_tape_mul(t, mgpu_tape_mul(t, xc, mgpu_tape_rsqrt(t, mgpu_tape_add_scalar(t, var, 1e-5f))), p[0]), p[1]);
}
static mgpu_layer* op_layer_norm_of(int dim) {
    const mgpu_op_param_desc params[2] = {
        { "weight", mgpu_shape1(dim), MGPU_INIT_ONES, 0.0f, 0 },
        { "bias", mgpu_shape1(dim), MGPU_INIT_ZEROS, 0.0f, 0 },
    };
    mgpu_op_layer_desc d;
    memset(&d, 0, sizeof d);
    d.type = "LayerNormOps"; d.params = params; d.param_count = 2; d.forward = layer_norm_forward;
    return mgpu_layer_from_ops(&d);
}
static mgpu_layer* op_layer_norm(void) { return op_layer_norm_of(LN_DIM); }

/* GPT-2's attention (Hugging Face's GPT2Attention, dropout 0): c_attn and c_proj stored [in, out] */
enum { ATT_DIM = 8, ATT_HEADS = 2, ATT_T = 5 };
static const mgpu_tensor* attention_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    const int64_t b = mgpu_tensor_dim(x, 0), T = mgpu_tensor_dim(x, 1), C = ATT_DIM, H = ATT_HEADS, hs = C / H;
    const int heads_first[4] = { 0, 2, 1, 3 };   /* [b, T, H, hs] <-> [b, H, T, hs] */
    const mgpu_tensor* qkv = mgpu_tape_add(t, mgpu_tape_matmul(t, x, p[0], MGPU_NO_TRANS, MGPU_NO_TRANS), p[1]);
    const mgpu_tensor* q = mgpu_tape_permute(t, mgpu_tape_reshape(t, mgpu_tape_slice(t, qkv, 2, 0, C), mgpu_shape4(b, T, H, hs)), heads_first);
    const mgpu_tensor* k = mgpu_tape_permute(t, mgpu_tape_reshape(t, mgpu_tape_slice(t, qkv, 2, C, C), mgpu_shape4(b, T, H, hs)), heads_first);
    const mgpu_tensor* v = mgpu_tape_permute(t, mgpu_tape_reshape(t, mgpu_tape_slice(t, qkv, 2, 2 * C, C), mgpu_shape4(b, T, H, hs)), heads_first);
    const mgpu_tensor* att = mgpu_tape_scale(t, mgpu_tape_matmul(t, q, k, MGPU_NO_TRANS, MGPU_TRANS), 1.0f / sqrtf((float)hs));
    const mgpu_tensor* y = mgpu_tape_matmul(t, mgpu_tape_softmax(t, mgpu_tape_causal_mask(t, att, -INFINITY), -1), v, MGPU_NO_TRANS, MGPU_NO_TRANS);
    (void)user;
    y = mgpu_tape_reshape(t, mgpu_tape_permute(t, y, heads_first), mgpu_shape3(b, T, C));
    return mgpu_tape_add(t, mgpu_tape_matmul(t, y, p[2], MGPU_NO_TRANS, MGPU_NO_TRANS), p[3]);
}
static mgpu_layer* op_attention(void) {
    static const mgpu_op_param_desc params[4] = {
        { "c_attn.weight", { 2, { ATT_DIM, 3 * ATT_DIM, 0, 0 } }, MGPU_INIT_NORMAL, 0.0f, 0 },
        { "c_attn.bias", { 1, { 3 * ATT_DIM, 0, 0, 0 } }, MGPU_INIT_ZEROS, 0.0f, 0 },
        { "c_proj.weight", { 2, { ATT_DIM, ATT_DIM, 0, 0 } }, MGPU_INIT_NORMAL, 0.0f, 0 },
        { "c_proj.bias", { 1, { ATT_DIM, 0, 0, 0 } }, MGPU_INIT_ZEROS, 0.0f, 0 },
    };
    mgpu_op_layer_desc d;
    memset(&d, 0, sizeof d);
    d.type = "AttentionOps"; d.params = params; d.param_count = 4; d.forward = attention_forward;
    return mgpu_layer_from_ops(&d);
}

/* Two models, [Linear(4 -> in_width), block, Linear(out -> 3)] with block built-in or made of ops: the
   same parameters (copied), one accumulate each on spec's devices, then losses and gradients
   compared (relative error of the whole gradient buffer) */
static void compare_models(const char* what, const char* spec, mgpu_layer* ops_block, mgpu_layer* const* builtin, int nbuiltin,
                           int in_width, int width, int T) {
    const mgpu_shape in = T ? mgpu_shape2(T, 4) : mgpu_shape1(4);
    mgpu_device_set* set = mgpu_device_set_create(spec);
    mgpu_layer *la[3], *lb[4];
    mgpu_model *a = NULL, *b = NULL;
    int i;
    la[0] = mgpu_layer_linear(4, in_width); la[1] = ops_block; la[2] = mgpu_layer_linear(width, 3);
    lb[0] = mgpu_layer_linear(4, in_width);
    for (i = 0; i < nbuiltin; ++i) lb[1 + i] = builtin[i];
    lb[1 + nbuiltin] = mgpu_layer_linear(width, 3);
    CHECK(set != NULL, "%s: device set %s: %s", what, spec, mgpu_last_error());
    if (set) {
        a = mgpu_model_create(&(mgpu_model_desc){ .input = in, .layers = la, .layer_count = 3, .devices = set, .seed = 3 });
        b = mgpu_model_create(&(mgpu_model_desc){ .input = in, .layers = lb, .layer_count = 2 + nbuiltin, .devices = set, .seed = 3 });
    } else {
        for (i = 0; i < 3; ++i) mgpu_layer_destroy(la[i]);
        for (i = 0; i < 2 + nbuiltin; ++i) mgpu_layer_destroy(lb[i]);
    }
    CHECK(!set || (a && b), "%s: models on %s: %s", what, spec, mgpu_last_error());
    if (a && b) {
        const int64_t n = mgpu_tensor_numel(mgpu_model_params(a, 0)), rows = 8;
        mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, T ? mgpu_shape3(rows, T, 4) : mgpu_shape2(rows, 4)), *y;
        int32_t labels[8 * 8];
        float lossa = 0, lossb = 0, *ga = fbuf(n), *gb = fbuf(n);
        double* ref = dbuf(n);
        int64_t j;
        mgpu_memory_stats s0, s1;
        memset(&s0, 0, sizeof s0);
        memset(&s1, 0, sizeof s1);
        CHECK(n == mgpu_tensor_numel(mgpu_model_params(b, 0)), "%s: the same number of parameters", what);
        MUST(mgpu_tensor_copy(mgpu_model_params(a, 0), mgpu_model_params(b, 0)));
        MUST(mgpu_model_resync(a, NULL));   /* replica 0's to the others */
        MUST(mgpu_rand_normal(x, 7, 0, 0.0f, 1.0f));
        for (j = 0; j < rows * (T ? T : 1); ++j) labels[j] = rng_int(3);
        y = tfrom_i32(mgpu_device_cpu(), T ? mgpu_shape2(rows, T) : mgpu_shape1(rows), labels);
        MUST(mgpu_model_accumulate(a, x, y, 0, &lossa));
        MUST(mgpu_model_accumulate(b, x, y, 0, &lossb));
        MUST(mgpu_model_reduce_grads(a));
        MUST(mgpu_model_reduce_grads(b));
        tget(mgpu_model_grads(a, 0), ga);
        tget(mgpu_model_grads(b, 0), gb);
        for (j = 0; j < n; ++j) ref[j] = gb[j];
        CHECK(fabs(lossa - lossb) <= 1e-6 * fabs(lossb) + 1e-7 && test_rel_error(ga, ref, (size_t)n) < 1e-5,
              "%s on %s: loss %.9g (built-in %.9g), gradients' relative error %.2e (bound 1e-5)", what, spec, lossa, lossb,
              test_rel_error(ga, ref, (size_t)n));
        /* more steps allocate nothing from the device: the caching allocator serves the tape */
        MUST(mgpu_model_zero_grad(a));
        MUST(mgpu_model_accumulate(a, x, y, 0, &lossa));
        MUST(mgpu_memory_get_stats(mgpu_device_set_get(set, 0), &s0));
        MUST(mgpu_model_zero_grad(a));
        MUST(mgpu_model_accumulate(a, x, y, 0, &lossa));
        MUST(mgpu_model_zero_grad(a));
        MUST(mgpu_model_accumulate(a, x, y, 0, &lossa));
        MUST(mgpu_memory_get_stats(mgpu_device_set_get(set, 0), &s1));
        CHECK(s1.backend_allocs == s0.backend_allocs, "%s on %s: %llu allocations from the device after the first steps",
              what, spec, (unsigned long long)(s1.backend_allocs - s0.backend_allocs));
        free(ga); free(gb); free(ref);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    }
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
    mgpu_device_set_destroy(set);
}

static void test_op_layers(void) {
    static const char* specs[3] = { "cpu", "cpu:2", "cuda:0" };
    int k;
    header("2. layers made of ops against the built-ins: Linear+GELU, LayerNorm");
    for (k = 0; k < 3; ++k) {
        mgpu_layer* lin[2];
        mgpu_layer* ln[1];
        mgpu_layer* attn[1];
        if (k == 2 && !gpu_part("layers made of ops")) break;
        lin[0] = mgpu_layer_linear(LIN_IN, LIN_OUT);
        lin[1] = mgpu_layer_gelu();
        compare_models("Linear+GELU of ops", specs[k], op_linear_gelu(), lin, 2, LIN_IN, LIN_OUT, 0);
        ln[0] = mgpu_layer_layer_norm(LN_DIM);
        compare_models("LayerNorm of ops", specs[k], op_layer_norm(), ln, 1, LN_DIM, LN_DIM, 0);
        attn[0] = mgpu_layer_causal_self_attention(ATT_DIM, ATT_HEADS, 0.0f);
        compare_models("causal self-attention of ops", specs[k], op_attention(), attn, 1, ATT_DIM, ATT_DIM, ATT_T);
    }
}

/* ============================================================================================ */
/* 2b. dropout: the masks, their gradient, replicas and devices                                 */
/* ============================================================================================ */
/* y = dropout(x, 0.25) on dev, and dx for dy = 1 */
static void tape_dropout(mgpu_device* dev, int training, const float* hx, int64_t n, float* y, float* dx) {
    mgpu_tensor* x = tfrom(dev, mgpu_shape2(8, n / 8), hx);
    mgpu_tape* t = mgpu_tape_create(dev);
    const mgpu_tensor* out;
    MUST(mgpu_tape_set_training(t, training, 77));
    MUST(mgpu_tape_watch(t, x));
    out = mgpu_tape_dropout(t, x, 0.25f);
    if (out) {
        tget(out, y);
        MUST(mgpu_tape_backward(t, mgpu_tape_sum(t, out, MGPU_ALL_AXES, 0), NULL));
        if (mgpu_tape_grad(t, x)) tget(mgpu_tape_grad(t, x), dx);
    } else CHECK(0, "dropout on %s: %s", mgpu_device_label(dev), mgpu_last_error());
    mgpu_tape_destroy(t);
    mgpu_tensor_destroy(x);
}
/* dropout(0.5) on x seen as [2b, 2] (each sample two rows: by sample all the same), then
   Linear(4, 6) and dropout(0.5) again, as one layer of ops */
static const mgpu_tensor* linear_dropout_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    const int64_t b = mgpu_tensor_dim(x, 0);
    const mgpu_tensor* xd = mgpu_tape_reshape(t, mgpu_tape_dropout(t, mgpu_tape_reshape(t, x, mgpu_shape2(2 * b, 2)), 0.5f),
                                              mgpu_shape2(b, 4));
    (void)user;
    return mgpu_tape_dropout(t, mgpu_tape_add(t, mgpu_tape_matmul(t, xd, p[0], MGPU_NO_TRANS, MGPU_TRANS), p[1]), 0.5f);
}
static mgpu_result linear_dropout_shape(void* user, mgpu_shape x, mgpu_shape* y) {
    (void)user;
    *y = mgpu_shape2(x.dim[0], 6);
    return MGPU_OK;
}

static void test_dropout(void) {
    enum { N = 4096 };
    float *x = fbuf(N), *y = fbuf(N), *dx = fbuf(N), *y2 = fbuf(N), *dx2 = fbuf(N);
    int64_t i, dropped = 0, wrong = 0;
    header("2b. dropout: masks, gradient, identity when not training, replicas, CPU and GPU alike");
    for (i = 0; i < N; ++i) x[i] = (float)(rng_unit() + 0.5);
    tape_dropout(mgpu_device_cpu(), 1, x, N, y, dx);
    for (i = 0; i < N; ++i) {
        dropped += y[i] == 0.0f;
        wrong += !((y[i] == 0.0f && dx[i] == 0.0f) || (y[i] == x[i] * (1.0f / 0.75f) && dx[i] == 1.0f / 0.75f));
    }
    CHECK(wrong == 0 && dropped > N / 4 - 160 && dropped < N / 4 + 160, "dropout(0.25): %lld of %d dropped (about 1024), "
          "%lld elements neither 0 nor x / 0.75 with the gradient to match", (long long)dropped, N, (long long)wrong);
    tape_dropout(mgpu_device_cpu(), 0, x, N, y2, dx2);
    for (i = 0, wrong = 0; i < N; ++i) wrong += y2[i] != x[i] || dx2[i] != 1.0f;
    CHECK(wrong == 0, "dropout when not training: the identity (%lld elements differ)", (long long)wrong);
    if (gpu_part("tape dropout")) {
        tape_dropout(g_gpu, 1, x, N, y2, dx2);
        CHECK(!memcmp(y, y2, N * sizeof(float)) && !memcmp(dx, dx2, N * sizeof(float)), "dropout on cuda:0: the CPU's masks, bit for bit");
    }
    {   /* in a layer of ops: two CPU replicas draw what one device draws (by sample) */
        static const mgpu_op_param_desc params[2] = { { "weight", { 2, { 6, 4, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, 0 },
                                                      { "bias", { 1, { 6, 0, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, 4 } };
        static const char* specs[2] = { "cpu", "cpu:2" };
        float g[2][256], loss[2] = { 0, 0 };
        double ref[256];
        int k;
        memset(g, 0, sizeof g);
        for (k = 0; k < 2; ++k) {
            mgpu_device_set* set = mgpu_device_set_create(specs[k]);
            mgpu_op_layer_desc d;
            mgpu_layer* layers[2];
            mgpu_model* m;
            mgpu_tensor *xt = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(8, 4)), *lab;
            int32_t labels[8] = { 0, 1, 2, 1, 0, 2, 2, 1 };
            memset(&d, 0, sizeof d);
            d.type = "LinearDropout"; d.params = params; d.param_count = 2;
            d.forward = linear_dropout_forward; d.output_shape = linear_dropout_shape;
            layers[0] = mgpu_layer_from_ops(&d);
            layers[1] = mgpu_layer_linear(6, 3);
            m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = layers, .layer_count = 2, .devices = set, .seed = 9 });
            CHECK(m != NULL, "a model with dropout of ops on %s: %s", specs[k], mgpu_last_error());
            lab = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
            MUST(mgpu_rand_normal(xt, 4, 0, 0.0f, 1.0f));
            if (m) {
                MUST(mgpu_model_accumulate(m, xt, lab, 0, &loss[k]));
                MUST(mgpu_model_reduce_grads(m));
                CHECK(mgpu_tensor_numel(mgpu_model_grads(m, 0)) <= 256, "the gradient buffer fits the test's");
                if (mgpu_tensor_numel(mgpu_model_grads(m, 0)) <= 256) tget(mgpu_model_grads(m, 0), g[k]);
            }
            mgpu_model_destroy(m);
            mgpu_tensor_destroy(xt); mgpu_tensor_destroy(lab);
            mgpu_device_set_destroy(set);
        }
        for (i = 0; i < 256; ++i) ref[i] = g[0][i];
        CHECK(fabs(loss[0] - loss[1]) < 1e-6 && test_rel_error(g[1], ref, 256) < 1e-5 && g[0][0] != 0.0f,
              "dropout in a layer of ops: cpu:2 as cpu (loss %.7f and %.7f, gradients' relative error %.2e)", loss[0], loss[1],
              test_rel_error(g[1], ref, 256));
    }
    free(x); free(y); free(dx); free(y2); free(dx2);
}

/* ============================================================================================ */
/* 2d. layers of ops in a pipeline: two CPU stages and micro-batches give one device's bits     */
/* ============================================================================================ */
static void test_op_pipeline(void) {
    mgpu_device_set* two = mgpu_device_set_create("cpu:2");
    mgpu_model* m[2] = { NULL, NULL };
    mgpu_tensor *x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(8, LIN_IN)), *lab;
    int32_t labels[8] = { 0, 1, 2, 1, 0, 2, 2, 1 };
    float loss[2] = { 0, 0 };
    int k, i, same = 1;
    header("2d. layers of ops in a pipeline (2 stages, 4 micro-batches) against one device with those micro-batches, bit for bit");
    MUST(mgpu_rand_normal(x, 8, 0, 0.0f, 1.0f));
    lab = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
    for (k = 0; k < 2; ++k) {
        mgpu_layer* layers[3] = { op_linear_gelu(), op_layer_norm_of(LIN_OUT), mgpu_layer_linear(LIN_OUT, 3) };
        m[k] = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(LIN_IN), .layers = layers, .layer_count = 3, .seed = 21,
                                                     .devices = k ? two : NULL, .stages = k ? 2 : 0, .micro_batches = 4 });
        CHECK(m[k] != NULL, "model %d: %s", k, mgpu_last_error());
        if (m[k]) MUST(mgpu_model_accumulate(m[k], x, lab, 0, &loss[k]));
    }
    if (m[0] && m[1]) {
        for (i = 0; i < mgpu_model_tensor_count(m[0]); ++i) {
            const char* name = mgpu_model_tensor_name(m[0], i);
            const mgpu_tensor *g0 = mgpu_model_grad(m[0], 0, name), *g1 = mgpu_model_grad(m[1], 0, name);
            float a[64], b[64];
            if (!g0 || !g1 || mgpu_tensor_numel(g0) > 64 || mgpu_tensor_numel(g0) != mgpu_tensor_numel(g1)) { same = 0; break; }
            tget(g0, a);
            tget(g1, b);
            same &= !memcmp(a, b, mgpu_tensor_bytes(g0));
        }
        CHECK(same && loss[0] == loss[1] && mgpu_model_tensor_count(m[0]) == 6, "layers of ops, 2 stages x 4 micro-batches: "
              "loss %.9g (one device %.9g), gradients %s", loss[1], loss[0], same ? "the same bits" : "differ");
    }
    for (k = 0; k < 2; ++k) mgpu_model_destroy(m[k]);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(lab);
    mgpu_device_set_destroy(two);
}

/* ============================================================================================ */
/* 2c. a CUDA graph of a step with layers of ops: the eager step's bits                         */
/* ============================================================================================ */
static void test_op_graph(void) {
#ifdef MGPU_CUDA
    static const mgpu_op_param_desc params[2] = { { "weight", { 2, { 6, 4, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, 0 },
                                                  { "bias", { 1, { 6, 0, 0, 0 } }, MGPU_INIT_UNIFORM, 0.0f, 4 } };
    mgpu_model* m[2] = { NULL, NULL };
    mgpu_optimizer* opt[2] = { NULL, NULL };
    mgpu_tensor *x, *lab;
    int32_t labels[8] = { 0, 1, 2, 1, 0, 2, 2, 1 };
    float *p[2] = { NULL, NULL }, loss[2];
    size_t bytes;
    int k, step, same = 1;
#endif
    header("2c. a CUDA graph of steps with layers of ops (dropout too): the eager steps' bits");
    if (!gpu_part("graph of layers of ops")) return;
#ifdef MGPU_CUDA
    x = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(8, 4));
    MUST(mgpu_rand_normal(x, 4, 0, 0.0f, 1.0f));
    lab = tfrom_i32(mgpu_device_cpu(), mgpu_shape1(8), labels);
    for (k = 0; k < 2; ++k) {
        mgpu_op_layer_desc d;
        mgpu_layer* layers[3];
        memset(&d, 0, sizeof d);
        d.type = "LinearDropout"; d.params = params; d.param_count = 2;
        d.forward = linear_dropout_forward; d.output_shape = linear_dropout_shape;
        layers[0] = mgpu_layer_from_ops(&d);
        layers[1] = op_layer_norm_of(6);
        layers[2] = mgpu_layer_linear(6, 3);
        m[k] = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(4), .layers = layers, .layer_count = 3,
                                                     .devices = g_gpu_set, .seed = 5, .graph = k });
        if (m[k]) opt[k] = mgpu_optimizer_create(m[k], &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f, .momentum = 0.9f });
        CHECK(m[k] && opt[k], "graph %d: %s", k, mgpu_last_error());
    }
    if (opt[0] && opt[1]) {
        bytes = mgpu_tensor_bytes(mgpu_model_params(m[0], 0));
        p[0] = fbuf((int64_t)(bytes / sizeof(float)));
        p[1] = fbuf((int64_t)(bytes / sizeof(float)));
        for (step = 0; step < 5 && same; ++step) {
            for (k = 0; k < 2; ++k) {
                MUST(mgpu_model_train_step(m[k], opt[k], x, lab, &loss[k]));
                tget(mgpu_model_params(m[k], 0), p[k]);
            }
            same = !memcmp(p[0], p[1], bytes) && loss[0] == loss[1];
            CHECK(same, "layers of ops: step %d replayed from a CUDA graph differs from the eager step (loss %.9g and %.9g)", step,
                  loss[1], loss[0]);
        }
        CHECK(mgpu_model_graph_steps(m[1]) >= 3, "layers of ops: %lld of 5 steps replayed from a CUDA graph",
              (long long)mgpu_model_graph_steps(m[1]));
    }
    for (k = 0; k < 2; ++k) {
        mgpu_optimizer_destroy(opt[k]);
        mgpu_model_destroy(m[k]);
        free(p[k]);
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(lab);
#endif
}

/* ============================================================================================ */
/* 3. misuse: clear errors, and the first failure kept                                          */
/* ============================================================================================ */
static void test_misuse(void) {
    mgpu_device_set* two = mgpu_device_set_create("cpu:2");
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tape *t = mgpu_tape_create(cpu), *u = mgpu_tape_create(cpu);
    mgpu_tensor *a = tmake(cpu, MGPU_F32, mgpu_shape2(3, 4)), *b = tmake(cpu, MGPU_F32, mgpu_shape2(2, 4));
    mgpu_tensor *other = two ? tmake(mgpu_device_set_get(two, 1), MGPU_F32, mgpu_shape2(3, 4)) : NULL;
    const mgpu_tensor *y, *z;
    header("3. misuse: shapes, devices, tapes, backward, the first failure kept");
    MUST(mgpu_tensor_fill(a, 1.0)); MUST(mgpu_tensor_fill(b, 2.0));
    /* shapes that do not broadcast; every later op returns NULL; backward reports the first failure */
    MUST(mgpu_tape_watch(t, a));
    y = mgpu_tape_add(t, a, b);
    expect_fail(mgpu_last_result(), MGPU_ERROR_SHAPE_MISMATCH, "add [3,4] + [2,4]", "mgpu_tape_add", "[3,4]", "do not broadcast");
    CHECK(y == NULL, "a failed op returns NULL");
    z = mgpu_tape_exp(t, a);
    CHECK(z == NULL && mgpu_tape_status(t) == MGPU_ERROR_SHAPE_MISMATCH, "after a failure every op returns NULL, the tape keeps "
          "the first error (%s)", mgpu_result_string(mgpu_tape_status(t)));
    expect_fail(mgpu_tape_backward(t, z, NULL), MGPU_ERROR_SHAPE_MISMATCH, "backward after a failed op", NULL, NULL, NULL);
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    /* two devices */
    if (other) {
        CHECK(mgpu_tape_mul(t, a, other) == NULL, "an op on a tensor of another device fails");
        expect_fail(mgpu_last_result(), MGPU_ERROR_DEVICE_MISMATCH, "mul of cpu and cpu#1", "mgpu_tape_mul", "cpu#1", "tape's device");
        expect_fail(mgpu_tape_watch(u, other), MGPU_ERROR_DEVICE_MISMATCH, "watch on another device", "mgpu_tape_watch", "cpu#1", NULL);
    }
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    /* another tape's tensor; watching an op's output; backward of what depends on nothing watched */
    y = mgpu_tape_exp(u, a);
    CHECK(y != NULL, "exp on tape u: %s", mgpu_last_error());
    CHECK(mgpu_tape_tanh(t, y) == NULL, "an op on another tape's tensor fails");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "tanh of u's tensor on t", "mgpu_tape_tanh", "another tape", NULL);
    expect_fail(mgpu_tape_watch(u, y), MGPU_ERROR_INVALID_ARGUMENT, "watch an op's output", "mgpu_tape_watch", "made by a tape", NULL);
    z = mgpu_tape_sum(u, y, MGPU_ALL_AXES, 0);
    expect_fail(mgpu_tape_backward(u, z, NULL), MGPU_ERROR_INVALID_ARGUMENT, "backward of what needs no gradient",
                "mgpu_tape_backward", "does not depend on any watched", NULL);
    MUST(mgpu_tape_watch(u, a));
    z = mgpu_tape_exp(u, a);
    expect_fail(mgpu_tape_backward(u, z, NULL), MGPU_ERROR_SHAPE_MISMATCH, "backward of [3,4] without dy", "not one element", NULL, NULL);
    CHECK(mgpu_tape_grad(u, b) == NULL, "the gradient of a tensor not watched: NULL");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "grad of a tensor not watched", "not watched", NULL, NULL);
    /* bad axes, permutations, slices, matmul shapes, each naming its op (a fresh tape each: t failed above) */
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    CHECK(mgpu_tape_sum(t, a, 2, 0) == NULL, "sum over axis 2 of a 2-D tensor fails");
    expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "sum axis 2", "mgpu_tape_sum", "axis 2", NULL);
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    CHECK(mgpu_tape_matmul(t, a, b, MGPU_NO_TRANS, MGPU_NO_TRANS) == NULL, "matmul [3,4] @ [2,4] fails");
    expect_fail(mgpu_last_result(), MGPU_ERROR_SHAPE_MISMATCH, "matmul [3,4] @ [2,4]", "mgpu_tape_matmul", "inner dimensions", NULL);
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    CHECK(mgpu_tape_slice(t, a, 1, 3, 2) == NULL, "a slice past the end fails");
    expect_fail(mgpu_last_result(), MGPU_ERROR_SHAPE_MISMATCH, "slice [3, 5) of 4", "mgpu_tape_slice", "outside", NULL);
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    {
        const int perm[2] = { 0, 0 };
        CHECK(mgpu_tape_permute(t, a, perm) == NULL, "permute (0, 0) fails");
        expect_fail(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "permute (0,0)", "mgpu_tape_permute", "not a permutation", NULL);
    }
    /* a tensor the tape still needs, changed before backward: refused, naming the op */
    mgpu_tape_destroy(t);
    t = mgpu_tape_create(cpu);
    {
        mgpu_tensor* c = tmake(cpu, MGPU_F32, mgpu_shape2(3, 4));
        MUST(mgpu_tensor_fill(c, 2.0));
        MUST(mgpu_tape_watch(t, a));
        y = mgpu_tape_sum(t, mgpu_tape_mul(t, a, c), MGPU_ALL_AXES, 0);
        MUST(mgpu_tensor_fill(c, 3.0));   /* mul's backward needs the old c */
        expect_fail(mgpu_tape_backward(t, y, NULL), MGPU_ERROR_INVALID_ARGUMENT, "backward after an input changed",
                    "mgpu_tape_mul", "written after the op read it", "f32[3,4]@cpu");
        mgpu_tape_destroy(t);
        t = mgpu_tape_create(cpu);   /* add's backward reads neither input: a change is no error (as in PyTorch) */
        MUST(mgpu_tape_watch(t, a));
        y = mgpu_tape_sum(t, mgpu_tape_add(t, a, c), MGPU_ALL_AXES, 0);
        MUST(mgpu_tensor_fill(c, 4.0));
        MUST(mgpu_tape_backward(t, y, NULL));
        mgpu_tensor_destroy(c);
    }
    /* a layer's forward that fails: the model's step names the layer and the op */
    {
        mgpu_layer* layers[1];
        mgpu_model* m;
        mgpu_tensor *x = tmake(cpu, MGPU_F32, mgpu_shape2(2, LIN_IN + 1)), *lab;
        const int32_t labels[2] = { 0, 1 };
        float loss;
        layers[0] = op_linear_gelu();
        m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(LIN_IN + 1), .layers = layers, .layer_count = 1 });
        CHECK(m != NULL, "a model of one layer of ops: %s", mgpu_last_error());
        lab = tfrom_i32(cpu, mgpu_shape1(2), labels);
        MUST(mgpu_tensor_fill(x, 0.5));
        if (m) expect_fail(mgpu_model_accumulate(m, x, lab, 0, &loss), MGPU_ERROR_SHAPE_MISMATCH, "a layer of ops given 7 features",
                           "LinearGELU", "mgpu_tape_matmul", "inner dimensions");
        mgpu_model_destroy(m);
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(lab);
    }
    mgpu_tape_destroy(t);
    mgpu_tape_destroy(u);
    mgpu_tensor_destroy(a); mgpu_tensor_destroy(b); mgpu_tensor_destroy(other);
    mgpu_device_set_destroy(two);
}

int main(int argc, char** argv) {
    double t0 = test_start("test_autograd");
    test_select(argc, argv);
    printf("test_autograd: mgpu %s, seed %llu (MGPU_TEST_SEED to repeat), %d CPU threads\n", MGPU_VERSION_STRING,
           (unsigned long long)g_test_seed, mgpu_cpu_threads());
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
    TEST_GROUP(test_ops());
    TEST_GROUP(test_op_layers());
    TEST_GROUP(test_dropout());
    TEST_GROUP(test_op_graph());
    TEST_GROUP(test_op_pipeline());
    TEST_GROUP(test_misuse());
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_autograd");
}
