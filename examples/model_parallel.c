/* model_parallel.c - model parallelism step by step: a model cut into two stages on two devices.

     ./model_parallel              two CPU devices (cpu:2), any machine
     ./model_parallel cuda:0,1     two GPUs

   When a model does not fit on one device, its layers are cut into stages, each on a device of
   its own. One training step on two stages:
     1. FORWARD 0   stage 0 runs its layers on the batch
     2. SEND        its output (the activations) is copied to stage 1's device
     3. FORWARD 1   stage 1 runs its layers and the loss
     4. BACKWARD 1  stage 1's backward gives its parameters' gradients AND d loss / d input
     5. SEND BACK   that input gradient is copied back to stage 0's device
     6. BACKWARD 0  stage 0's backward, with it as d loss / d output
     7. UPDATE      each stage updates its own parameters (no all-reduce: nothing is replicated)
   Only one device works at a time here. A pipeline cuts the batch into micro-batches so that
   stage 1 works on micro-batch k while stage 0 already works on k + 1 (GPipe, 1F1B).

   Part 1 spells the step out with two models, one per stage. Part 2 is the library's pipeline
   (one model, desc.stages = 2): with one micro-batch it computes exactly what part 1 does, bit
   for bit, which this program checks; with 4 micro-batches the stages overlap. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define BATCH 60
#define FEATURES 20
#define HIDDEN 32
#define CLASSES 3
#define STEPS 200

#define TRY(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; } } while (0)

/* A toy task: the class is which third of the features sums highest. */
static void make_batch(mgpu_tensor* x, mgpu_tensor* y, int step) {
    float* px = (float*)mgpu_tensor_data(x);
    int32_t* py = (int32_t*)mgpu_tensor_data(y);
    int i, c, f;
    mgpu_rand_normal(x, 5, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f);
    for (i = 0; i < BATCH; ++i) {
        float best = -1e30f;
        for (c = 0; c < CLASSES; ++c) {
            float s = 0.0f;
            for (f = c * FEATURES / CLASSES; f < (c + 1) * FEATURES / CLASSES; ++f) s += px[i * FEATURES + f];
            if (s > best) { best = s; py[i] = c; }
        }
    }
}

/* The library's pipeline: Linear, ReLU | Linear on two devices, with M micro-batches. */
static mgpu_model* make_pipeline(mgpu_device_set* devices, int micro_batches) {
    static const int split[1] = { 2 };   /* stage 1 starts at layer 2 */
    mgpu_layer* layers[3] = { mgpu_layer_linear(FEATURES, HIDDEN), mgpu_layer_relu(), mgpu_layer_linear(HIDDEN, CLASSES) };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                  .devices = devices, .stages = 2, .split = split,
                                                  .micro_batches = micro_batches, .schedule = MGPU_PIPELINE_1F1B });
}

int main(int argc, char** argv) {
    mgpu_device_set* devices = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_device *dev0, *dev1;
    mgpu_model *stage0, *stage1, *pipe, *pipe4;
    mgpu_optimizer *opt0, *opt1, *opt_pipe, *opt_pipe4;
    mgpu_tensor *x, *y, *x0, *y1, *act1, *dact0, *loss, *dout;
    const mgpu_optimizer_desc sgd = { .lr = 0.1f, .momentum = 0.9f };
    const char* names[4][2] = { {"0.weight", "0.weight"}, {"0.bias", "0.bias"}, {"2.weight", "0.weight"}, {"2.bias", "0.bias"} };
    int step, i, same = 1;
    if (!devices) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
    if (mgpu_device_set_count(devices) != 2) { fprintf(stderr, "want two devices, e.g. cpu:2 or cuda:0,1\n"); return 1; }
    dev0 = mgpu_device_set_get(devices, 0);
    dev1 = mgpu_device_set_get(devices, 1);

    /* Part 1: two models, one per stage, each on its own device (a set of one device each) */
    {
        /* "cuda:0,1" -> "cuda:0" and "cuda:1"; CPU devices: "cpu" twice (two sets, two devices) */
        char spec0[64] = "cpu", spec1[64] = "cpu";
        const char* spec = mgpu_device_set_spec(devices);
        mgpu_device_set *set0, *set1;
        if (mgpu_device_kind_of(dev0) == MGPU_DEVICE_CUDA && strchr(spec, ',')) {
            snprintf(spec0, sizeof spec0, "%.*s", (int)(strchr(spec, ',') - spec), spec);
            snprintf(spec1, sizeof spec1, "cuda:%s", strchr(spec, ',') + 1);
        }
        set0 = mgpu_device_set_create(spec0);
        set1 = mgpu_device_set_create(spec1);
        mgpu_layer* first[2] = { mgpu_layer_linear(FEATURES, HIDDEN), mgpu_layer_relu() };
        mgpu_layer* second[1] = { mgpu_layer_linear(HIDDEN, CLASSES) };
        if (!set0 || !set1) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        stage0 = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = first, .layer_count = 2, .devices = set0 });
        stage1 = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(HIDDEN), .layers = second, .layer_count = 1, .devices = set1 });
        pipe = make_pipeline(devices, 1);
        pipe4 = make_pipeline(devices, 4);
        if (!stage0 || !stage1 || !pipe || !pipe4) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        /* all start from the pipeline's initial parameters ("2.weight" is stage 1's "0.weight") */
        for (i = 0; i < 4; ++i) {
            TRY(mgpu_tensor_copy(mgpu_model_param(i < 2 ? stage0 : stage1, 0, names[i][1]), mgpu_model_param(pipe, 0, names[i][0])));
            TRY(mgpu_tensor_copy(mgpu_model_param(pipe4, 0, names[i][0]), mgpu_model_param(pipe, 0, names[i][0])));
        }
        opt0 = mgpu_optimizer_create(stage0, &sgd);
        opt1 = mgpu_optimizer_create(stage1, &sgd);
        opt_pipe = mgpu_optimizer_create(pipe, &sgd);
        opt_pipe4 = mgpu_optimizer_create(pipe4, &sgd);
        if (!opt0 || !opt1 || !opt_pipe || !opt_pipe4) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
        printf("stage 0 (Linear, ReLU) on %s, stage 1 (Linear) on %s\n", mgpu_device_label(dev0), mgpu_device_label(dev1));
        dev0 = mgpu_model_device(stage0, 0);   /* part 1's own devices (on a GPU, streams of their own) */
        dev1 = mgpu_model_device(stage1, 0);

        x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES));
        y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH));
        x0 = mgpu_tensor_create(dev0, MGPU_F32, mgpu_shape2(BATCH, FEATURES));    /* the batch on stage 0 */
        y1 = mgpu_tensor_create(dev1, MGPU_I32, mgpu_shape1(BATCH));              /* the labels on stage 1 */
        act1 = mgpu_tensor_create(dev1, MGPU_F32, mgpu_shape2(BATCH, HIDDEN));    /* activations, received */
        dact0 = mgpu_tensor_create(dev0, MGPU_F32, mgpu_shape2(BATCH, HIDDEN));   /* their gradient, sent back */
        loss = mgpu_tensor_create(dev1, MGPU_F32, mgpu_shape1(1));
        dout = mgpu_tensor_create(dev1, MGPU_F32, mgpu_shape2(BATCH, CLASSES));
        if (!x || !y || !x0 || !y1 || !act1 || !dact0 || !loss || !dout) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }

        for (step = 0; step < STEPS; ++step) {
            const mgpu_tensor *h, *logits;
            float l, l_pipe, l_pipe4;
            make_batch(x, y, step);
            TRY(mgpu_tensor_copy(x0, x));
            TRY(mgpu_tensor_copy(y1, y));
            TRY(mgpu_model_zero_grad(stage0));
            TRY(mgpu_model_zero_grad(stage1));
            h = mgpu_model_forward(stage0, 0, x0, 1);                          /* 1. FORWARD 0 */
            if (!h) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
            TRY(mgpu_tensor_copy(act1, h));                                     /* 2. SEND */
            logits = mgpu_model_forward(stage1, 0, act1, 1);                   /* 3. FORWARD 1 */
            if (!logits) { fprintf(stderr, "%s\n", mgpu_last_error()); return 1; }
            TRY(mgpu_softmax_cross_entropy(loss, dout, logits, y1, 1.0f / BATCH));
            TRY(mgpu_model_backward(stage1, 0, dout));                          /* 4. BACKWARD 1 */
            TRY(mgpu_tensor_copy(dact0, mgpu_model_input_grad(stage1, 0)));    /* 5. SEND BACK */
            TRY(mgpu_model_backward(stage0, 0, dact0));                         /* 6. BACKWARD 0 */
            TRY(mgpu_optimizer_step(opt0));                                     /* 7. UPDATE */
            TRY(mgpu_optimizer_step(opt1));
            TRY(mgpu_tensor_download(loss, &l, sizeof l));

            /* Part 2: the same step by the library, with 1 and with 4 micro-batches */
            TRY(mgpu_model_train_step(pipe, opt_pipe, x, y, &l_pipe));
            TRY(mgpu_model_train_step(pipe4, opt_pipe4, x, y, &l_pipe4));
            if (step % 40 == 0 || step == STEPS - 1)
                printf("step %3d  loss by hand %.4f  pipeline %.4f  pipeline, 4 micro-batches %.4f\n", step, (double)l,
                       (double)l_pipe, (double)l_pipe4);
        }
        /* one micro-batch: the library did exactly the seven moves above */
        for (i = 0; i < 4; ++i) {
            const mgpu_tensor *a = mgpu_model_param(i < 2 ? stage0 : stage1, 0, names[i][1]), *b = mgpu_model_param(pipe, 0, names[i][0]);
            float ha[HIDDEN * FEATURES], hb[HIDDEN * FEATURES];
            TRY(mgpu_tensor_download(a, ha, mgpu_tensor_bytes(a)));
            TRY(mgpu_tensor_download(b, hb, mgpu_tensor_bytes(b)));
            same &= memcmp(ha, hb, mgpu_tensor_bytes(a)) == 0;
        }
        printf(same ? "by hand and by the library's pipeline: the same parameters, bit for bit\n"
                    : "by hand and by the library's pipeline: the parameters DIFFER\n");
        mgpu_tensor_destroy(x); mgpu_tensor_destroy(y); mgpu_tensor_destroy(x0); mgpu_tensor_destroy(y1);
        mgpu_tensor_destroy(act1); mgpu_tensor_destroy(dact0); mgpu_tensor_destroy(loss); mgpu_tensor_destroy(dout);
        mgpu_optimizer_destroy(opt0); mgpu_optimizer_destroy(opt1); mgpu_optimizer_destroy(opt_pipe); mgpu_optimizer_destroy(opt_pipe4);
        mgpu_model_destroy(stage0); mgpu_model_destroy(stage1); mgpu_model_destroy(pipe); mgpu_model_destroy(pipe4);
        mgpu_device_set_destroy(set0);
        mgpu_device_set_destroy(set1);
    }
    mgpu_device_set_destroy(devices);
    return same ? 0 : 1;
}
