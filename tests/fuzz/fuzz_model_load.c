/* fuzz_model_load.c - libFuzzer harness: any bytes as a checkpoint for a small MLP (4 -> 8 -> 3)
   on the CPU, once with SGD (momentum, nesterov, StepLR) and once with AdamW (cosine schedule).
   When a load succeeds, one training step runs on what was loaded: parameters, optimizer state
   and the step count from "mgpu.step" (schedules, bias corrections) all feed into it. A failed
   load must leave the model as it was. Built and run by tests/fuzz/run.sh. */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"

static mgpu_device_set* fuzz_set;

static void fuzz_free_set(void) { mgpu_device_set_destroy(fuzz_set); }

static void load_and_step(const char* path, const mgpu_optimizer_desc* od) {
    static const float xs[2 * 4] = { 0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f, 0.0f, -2.0f };
    static const int32_t ys[2] = { 2, 0 };
    mgpu_layer* layers[3];
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y, *p;
    float before[256], after[256], loss = 0.0f;   /* the flat buffer: 67 parameters, maybe padded */
    size_t bytes;
    mgpu_result r;
    mgpu_model_desc md;
    layers[0] = mgpu_layer_linear(4, 8);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(8, 3);
    memset(&md, 0, sizeof md);
    md.input = mgpu_shape1(4);
    md.layers = layers;
    md.layer_count = 3;
    md.devices = fuzz_set;
    m = mgpu_model_create(&md);
    if (!m) { fprintf(stderr, "model: %s\n", mgpu_last_error()); abort(); }
    opt = mgpu_optimizer_create(m, od);
    x = mgpu_tensor_create(mgpu_device_set_get(fuzz_set, 0), MGPU_F32, mgpu_shape2(2, 4));
    y = mgpu_tensor_create(mgpu_device_set_get(fuzz_set, 0), MGPU_I32, mgpu_shape1(2));
    p = mgpu_model_params(m, 0);
    if (!opt || !x || !y || (bytes = mgpu_tensor_bytes(p)) > sizeof before || mgpu_model_param_count(m) != 67 || mgpu_tensor_upload(x, xs, sizeof xs) ||
        mgpu_tensor_upload(y, ys, sizeof ys) || mgpu_tensor_download(p, before, bytes)) {
        fprintf(stderr, "setup: %s\n", mgpu_last_error());
        abort();
    }
    r = mgpu_model_load(m, opt, path);
    if (r == MGPU_OK) {
        (void)mgpu_model_train_step(m, opt, x, y, &loss);   /* NaNs and infinities are fine; UB is not */
        (void)mgpu_optimizer_lr(opt);
    } else {
        if (mgpu_tensor_download(p, after, bytes) || memcmp(before, after, bytes) != 0) {
            fprintf(stderr, "a failed load changed the parameters\n");
            abort();
        }
    }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static fuzz_file f;
    mgpu_optimizer_desc sgd, adamw;
    if (!f.path[0]) {
        fuzz_file_open(&f);
        mgpu_log_set_callback(fuzz_quiet, NULL);
        if (!(fuzz_set = mgpu_device_set_create("cpu"))) abort();
        atexit(fuzz_free_set);
    }
    fuzz_file_write(&f, data, size);
    memset(&sgd, 0, sizeof sgd);
    sgd.kind = MGPU_SGD;
    sgd.lr = 0.1f;
    sgd.momentum = 0.9f;
    sgd.nesterov = 1;
    sgd.weight_decay = 1e-4f;
    sgd.schedule = MGPU_SCHEDULE_STEP;
    sgd.step_size = 3;
    sgd.gamma = 0.5f;
    memset(&adamw, 0, sizeof adamw);
    adamw.kind = MGPU_ADAMW;
    adamw.lr = 1e-3f;
    adamw.weight_decay = 0.01f;
    adamw.schedule = MGPU_SCHEDULE_COSINE;
    adamw.total_steps = 10;
    load_and_step(f.path, &sgd);
    load_and_step(f.path, &adamw);
    return 0;
}
