/* 07_pipelines.c - lesson 07: model parallelism and pipelines.

     ./07_pipelines cpu:4 cpu               4 stages on 4 CPU devices, against 1 CPU device
     MGPU_EMU_DEVICES=4 build/emu/07_pipelines cuda:0,1,2,3 cuda:0     on 4 emulated GPUs
     ./07_pipelines cpu:4 cpu docs/course/img   also draws the traces: 07-gpipe.svg, 07-1f1b.svg

   Part 1, by hand: a model cut in two, each half on its own device; the activations are copied
   from the first device to the second (PyTorch's x.to('cuda:1')). The output must be the one
   device's output.
   Part 2, the library's pipeline: the same model cut into S stages (S = the devices of the first
   argument), each batch cut into M micro-batches, scheduled GPipe's way and 1F1B's way. Both must
   train to the parameters of one device: bit for bit on CPU devices, to rounding on GPUs. GPipe
   keeps the activations of all M micro-batches, 1F1B at most S: the program checks that too. */
// course-run: cpu:4 cpu
// course-run-emu 4: cuda:0,1,2,3 cuda:0
// course-expect: part 1: two devices by hand = one device
// course-expect: part 2: GPipe = 1F1B = one device
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>
#include <math.h>

#define IN 16          /* features of a sample */
#define HID 64
#define CLASSES 4
#define BATCH 64
#define M 8            /* micro-batches per batch */
#define STEPS 40

#define TRY(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; } } while (0)

/* Linear ReLU Linear ReLU | Linear ReLU Linear: 7 layers (the bar: part 1's cut) */
static mgpu_model* make_model(mgpu_device_set* set, int stages, mgpu_pipeline_schedule schedule) {
    mgpu_layer* layers[7] = { mgpu_layer_linear(IN, HID), mgpu_layer_relu(), mgpu_layer_linear(HID, HID), mgpu_layer_relu(),
                              mgpu_layer_linear(HID, HID), mgpu_layer_relu(), mgpu_layer_linear(HID, CLASSES) };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(IN), .layers = layers, .layer_count = 7, .devices = set,
                                                  .stages = stages, .micro_batches = stages > 1 ? M : 1, .schedule = schedule });
}

static const char* names[8] = { "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias" };

/* Copy every parameter of `from` into `to` (by PyTorch's names, whatever devices hold them). */
static mgpu_result copy_params(mgpu_model* to, const mgpu_model* from) {
    int i;
    for (i = 0; i < 8; ++i) {
        mgpu_result r = mgpu_tensor_copy(mgpu_model_param(to, 0, names[i]), mgpu_model_param(from, 0, names[i]));
        if (r != MGPU_OK) return r;
    }
    return MGPU_OK;
}

/* The largest difference between two models' parameters (0: the same bits, or both 0 and -0). */
static float max_diff(const mgpu_model* a, const mgpu_model* b) {
    static float ha[HID * HID], hb[HID * HID];
    float worst = 0.0f;
    int i;
    int64_t j;
    for (i = 0; i < 8; ++i) {
        const mgpu_tensor *ta = mgpu_model_param(a, 0, names[i]), *tb = mgpu_model_param(b, 0, names[i]);
        mgpu_tensor_download(ta, ha, mgpu_tensor_bytes(ta));
        mgpu_tensor_download(tb, hb, mgpu_tensor_bytes(tb));
        for (j = 0; j < mgpu_tensor_numel(ta); ++j) {
            const float d = fabsf(ha[j] - hb[j]);
            if (d != d) return INFINITY;   /* a NaN */
            if (d > worst) worst = d;
        }
    }
    return worst;
}

/* A toy task: the class is which quarter of the features sums highest. */
static void make_batch(float* x, int32_t* y, int step) {
    uint32_t s = 12345u + 7919u * (uint32_t)step;
    int i, f, c;
    for (i = 0; i < BATCH; ++i) {
        float best = -1e30f;
        for (f = 0; f < IN; ++f) {
            s = s * 1664525u + 1013904223u;
            x[i * IN + f] = (float)(s >> 8) / 4194304.0f - 2.0f;   /* in [-2, 2) */
        }
        for (c = 0; c < CLASSES; ++c) {
            float sum = 0.0f;
            for (f = c * IN / CLASSES; f < (c + 1) * IN / CLASSES; ++f) sum += x[i * IN + f];
            if (sum > best) { best = sum; y[i] = c; }
        }
    }
}

/* The pictures: one traced step of a pipeline whose S stages do equal work (a Linear(512, 512)
   and a ReLU each), 8 micro-batches of 64 rows, written as an SVG (mgpu_model_trace_stop). */
static mgpu_result draw(mgpu_device_set* set, int S, mgpu_pipeline_schedule schedule, const char* path) {
    mgpu_layer* layers[16];
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y;
    mgpu_result r = MGPU_ERROR_OUT_OF_MEMORY;
    int i;
    for (i = 0; i < 2 * S; ++i) layers[i] = i % 2 ? mgpu_layer_relu() : mgpu_layer_linear(512, 512);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(512), .layers = layers, .layer_count = 2 * S, .devices = set,
                                               .stages = S, .micro_batches = 8, .schedule = schedule });
    if (!m) return mgpu_last_result();
    opt = mgpu_optimizer_create(m, NULL);
    x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(512, 512));
    y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(512));
    if (opt && x && y) {
        memset(mgpu_tensor_data(x), 0, 512 * 512 * sizeof(float));
        memset(mgpu_tensor_data(y), 0, 512 * sizeof(int32_t));
        r = mgpu_model_train_step(m, opt, x, y, NULL);   /* the first step makes the buffers */
        if (r == MGPU_OK) r = mgpu_model_trace_start(m);
        if (r == MGPU_OK) r = mgpu_model_train_step(m, opt, x, y, NULL);
        if (r == MGPU_OK) r = mgpu_model_trace_stop(m, path);
    }
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    return r;
}

/* Bytes held by live tensors on a device (the activations a pipeline keeps between steps among them). */
static size_t in_use(mgpu_device* dev) {
    mgpu_memory_stats st;
    memset(&st, 0, sizeof st);
    mgpu_memory_get_stats(dev, &st);
    return st.bytes_in_use;
}

int main(int argc, char** argv) {
    const char* svg_dir = argc > 3 ? argv[3] : NULL;
    mgpu_device_set* stages_set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:4");
    mgpu_device_set* one_set = mgpu_device_set_create(argc > 2 ? argv[2] : "cpu");
    mgpu_model *one, *gpipe, *f1b1;
    mgpu_optimizer *opt_one, *opt_gpipe, *opt_1f1b;
    static float x[BATCH * IN];
    static int32_t y[BATCH];
    mgpu_tensor *tx, *ty;
    int S, step, on_gpu, failed = 0;
    double seconds[3] = { 0, 0, 0 };
    NEED(stages_set && one_set);
    S = mgpu_device_set_count(stages_set);
    on_gpu = mgpu_device_kind_of(mgpu_device_set_get(stages_set, 0)) == MGPU_DEVICE_CUDA;
    if (S < 2) { fprintf(stderr, "want 2 devices or more for the stages, e.g. cpu:4\n"); return 1; }
    one = make_model(one_set, 1, MGPU_PIPELINE_1F1B);
    NEED(one);
    tx = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, IN));
    ty = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH));
    NEED(tx && ty);
    make_batch(x, y, 0);
    TRY(mgpu_tensor_upload(tx, x, sizeof x));
    TRY(mgpu_tensor_upload(ty, y, sizeof y));

    /* ---- Part 1: model parallelism by hand, on two devices of their own ---- */
    {
        /* "cuda:0,1,2,3" -> "cuda:0" and "cuda:1"; on the CPU "cpu" twice is two CPU devices */
        mgpu_device_set* set0 = mgpu_device_set_create(on_gpu ? "cuda:0" : "cpu");
        mgpu_device_set* set1 = mgpu_device_set_create(on_gpu ? "cuda:1" : "cpu");
        mgpu_layer *first[4], *second[3];
        mgpu_model *half0, *half1;
        mgpu_tensor *x0, *act1, *x_one;
        const mgpu_tensor *h, *out, *want;
        static float got[BATCH * CLASSES], ref[BATCH * CLASSES];
        float worst = 0.0f;
        int i;
        NEED(set0 && set1);
        first[0] = mgpu_layer_linear(IN, HID); first[1] = mgpu_layer_relu(); first[2] = mgpu_layer_linear(HID, HID); first[3] = mgpu_layer_relu();
        second[0] = mgpu_layer_linear(HID, HID); second[1] = mgpu_layer_relu(); second[2] = mgpu_layer_linear(HID, CLASSES);
        half0 = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(IN), .layers = first, .layer_count = 4, .devices = set0 });
        half1 = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(HID), .layers = second, .layer_count = 3, .devices = set1 });
        NEED(half0 && half1);
        /* the halves take the whole model's parameters: its "4.weight" is half 1's "0.weight" */
        for (i = 0; i < 8; ++i) {
            char name[16];
            snprintf(name, sizeof name, "%d.%s", (names[i][0] - '0') % 4, names[i] + 2);
            TRY(mgpu_tensor_copy(mgpu_model_param(i < 4 ? half0 : half1, 0, name), mgpu_model_param(one, 0, names[i])));
        }
        x0 = mgpu_tensor_create(mgpu_model_device(half0, 0), MGPU_F32, mgpu_shape2(BATCH, IN));          /* x.to('cuda:0') */
        act1 = mgpu_tensor_create(mgpu_model_device(half1, 0), MGPU_F32, mgpu_shape2(BATCH, HID));       /* room on device 1 */
        x_one = mgpu_tensor_create(mgpu_model_device(one, 0), MGPU_F32, mgpu_shape2(BATCH, IN));         /* for the whole model */
        NEED(x0 && act1 && x_one);
        TRY(mgpu_tensor_copy(x0, tx));
        TRY(mgpu_tensor_copy(x_one, tx));
        NEED(h = mgpu_model_forward(half0, 0, x0, 0));     /* layers 0-3 on device 0 */
        TRY(mgpu_tensor_copy(act1, h));                     /* the activations: h.to('cuda:1') */
        NEED(out = mgpu_model_forward(half1, 0, act1, 0)); /* layers 4-6 on device 1 */
        NEED(want = mgpu_model_forward(one, 0, x_one, 0));    /* the whole model on one device */
        TRY(mgpu_tensor_download(out, got, sizeof got));
        TRY(mgpu_tensor_download(want, ref, sizeof ref));
        for (i = 0; i < BATCH * CLASSES; ++i) worst = fmaxf(worst, fabsf(got[i] - ref[i]));
        printf("part 1: layers 0-3 on %s, layers 4-6 on %s, %d x %d activations copied between them\n",
               mgpu_device_label(mgpu_model_device(half0, 0)), mgpu_device_label(mgpu_model_device(half1, 0)), BATCH, HID);
        if (on_gpu ? worst <= 1e-5f : memcmp(got, ref, sizeof got) == 0)
            printf("part 1: two devices by hand = one device (%s)\n", worst == 0.0f ? "bit for bit" : "to rounding");
        else { printf("part 1: the outputs DIFFER by %g\n", (double)worst); failed = 1; }
        mgpu_tensor_destroy(x0); mgpu_tensor_destroy(act1); mgpu_tensor_destroy(x_one);
        mgpu_model_destroy(half0); mgpu_model_destroy(half1);
        mgpu_device_set_destroy(set0); mgpu_device_set_destroy(set1);
    }

    /* ---- Part 2: pipelines of S stages, M micro-batches, two schedules ---- */
    gpipe = make_model(stages_set, S, MGPU_PIPELINE_GPIPE);
    f1b1 = make_model(stages_set, S, MGPU_PIPELINE_1F1B);
    NEED(gpipe && f1b1);
    TRY(copy_params(gpipe, one));
    TRY(copy_params(f1b1, one));
    opt_one = mgpu_optimizer_create(one, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });
    opt_gpipe = mgpu_optimizer_create(gpipe, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });
    opt_1f1b = mgpu_optimizer_create(f1b1, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f });
    NEED(opt_one && opt_gpipe && opt_1f1b);
    printf("part 2: %d stages on %s, %d micro-batches of %d rows; stage s starts at layer:", S, argv[1] ? argv[1] : "cpu:4", M, BATCH / M);
    for (step = 0; step < S; ++step) printf(" %d", mgpu_model_stage_first_layer(f1b1, step));
    printf("\n");
    for (step = 0; step < STEPS; ++step) {
        float l[3];
        double t;
        size_t before_g = 0, before_f = 0;
        const int last = step == STEPS - 1;
        make_batch(x, y, step);
        TRY(mgpu_tensor_upload(tx, x, sizeof x));
        TRY(mgpu_tensor_upload(ty, y, sizeof y));
        if (step == 0) before_g = in_use(mgpu_model_stage_device(gpipe, 0, 0));
        t = mgpu_seconds();
        TRY(mgpu_model_train_step(gpipe, opt_gpipe, tx, ty, &l[1]));
        seconds[1] += mgpu_seconds() - t;
        if (step == 0) {   /* what GPipe kept on stage 0: M micro-batches' activations */
            const size_t g = in_use(mgpu_model_stage_device(gpipe, 0, 0)) - before_g;
            before_f = in_use(mgpu_model_stage_device(f1b1, 0, 0));
            TRY(mgpu_model_train_step(f1b1, opt_1f1b, tx, ty, &l[2]));
            {
                const size_t f = in_use(mgpu_model_stage_device(f1b1, 0, 0)) - before_f;
                printf("part 2: stage 0 keeps %zu bytes of activations with GPipe, %zu with 1F1B\n", g, f);
                if (f >= g) { printf("part 2: 1F1B should keep less than GPipe\n"); failed = 1; }
            }
        } else {
            t = mgpu_seconds();
            TRY(mgpu_model_train_step(f1b1, opt_1f1b, tx, ty, &l[2]));
            seconds[2] += mgpu_seconds() - t;
        }
        t = mgpu_seconds();
        TRY(mgpu_model_train_step(one, opt_one, tx, ty, &l[0]));
        seconds[0] += mgpu_seconds() - t;
        if (step % 10 == 0 || last)
            printf("step %2d  loss: one device %.5f  GPipe %.5f  1F1B %.5f\n", step, (double)l[0], (double)l[1], (double)l[2]);
    }
    {
        const float dg = max_diff(gpipe, one), df = max_diff(f1b1, one);
        if (on_gpu ? dg <= 1e-4f && df <= 1e-4f : dg == 0.0f && df == 0.0f)
            printf("part 2: GPipe = 1F1B = one device after %d steps (%s)\n", STEPS,
                   dg == 0.0f && df == 0.0f ? "bit for bit" : "to rounding");
        else { printf("part 2: the parameters DIFFER: GPipe by %g, 1F1B by %g\n", (double)dg, (double)df); failed = 1; }
    }
    /* the bubble: of the (M + S - 1) time slots of a step, each stage idles S - 1 */
    printf("bubble (S-1)/(M+S-1) with S = %d: M = 1: %.0f%%, M = 4: %.0f%%, M = %d: %.0f%%, M = 32: %.0f%%\n", S,
           100.0 * (S - 1) / (1 + S - 1), 100.0 * (S - 1) / (4 + S - 1), M, 100.0 * (S - 1) / (M + S - 1), 100.0 * (S - 1) / (32 + S - 1));
    if (!on_gpu)   /* CPU times: the CPU devices share this machine's cores */
        printf("ms per step (CPU): one device %.3f, GPipe %.3f, 1F1B %.3f\n", 1e3 * seconds[0] / STEPS,
               1e3 * seconds[1] / STEPS, 1e3 * seconds[2] / (STEPS - 1));
    if (svg_dir && S <= 8) {
        char path[512];
        snprintf(path, sizeof path, "%s/07-gpipe.svg", svg_dir);
        TRY(draw(stages_set, S, MGPU_PIPELINE_GPIPE, path));
        snprintf(path, sizeof path, "%s/07-1f1b.svg", svg_dir);
        TRY(draw(stages_set, S, MGPU_PIPELINE_1F1B, path));
        printf("wrote %s/07-gpipe.svg and %s/07-1f1b.svg\n", svg_dir, svg_dir);
    }
    mgpu_tensor_destroy(tx); mgpu_tensor_destroy(ty);
    mgpu_optimizer_destroy(opt_one); mgpu_optimizer_destroy(opt_gpipe); mgpu_optimizer_destroy(opt_1f1b);
    mgpu_model_destroy(one); mgpu_model_destroy(gpipe); mgpu_model_destroy(f1b1);
    mgpu_device_set_destroy(stages_set); mgpu_device_set_destroy(one_set);
    return failed;
}
