/* interop.c - the mgpu side of the PyTorch interop test (tests/interop.py drives it).
     interop save DIR   build the mlp and the cnn of build/train (seed 7), train each a few steps
                        with SGD+momentum (so optimizer state exists), save DIR/mgpu_NAME.safetensors,
                        and write the logits of DIR/inputs.f32 to DIR/mgpu_NAME.logits
     interop load DIR   load DIR/torch_NAME.safetensors (saved by PyTorch) into mgpu and write the
                        logits of DIR/inputs.f32 to DIR/torch_NAME.mgpu_logits
     interop part DIR   DIR/torch_part.safetensors holds PyTorch's mlp under "model." beside other
                        tensors: load it with mgpu_model_load_ex (prefix, allow_extra) and write
                        the logits to DIR/torch_part.mgpu_logits; read its "encoder.weight" (F16)
                        with mgpu_safetensors_read into DIR/encoder.f32, and its metadata "note"
                        into DIR/note.txt
     interop mixed DIR  load DIR/torch_mixed.safetensors (PyTorch's mlp with F32, BF16 and F16
                        tensors) and write the logits to DIR/torch_mixed.mgpu_logits
     interop bf16 DIR   DIR/bf16_in.f32's floats to MGPU_BF16 with mgpu_tensor_convert, raw to
                        DIR/bf16_out.u16 (PyTorch's .to(torch.bfloat16) checks the bits)
   The cnn goes twice: once on one CPU device, once as a pipeline of 2 stages on cpu:2 with 2
   micro-batches ("cnn_2stages", read from and compared with PyTorch's cnn): a checkpoint keeps
   PyTorch's names whatever the layout.
   inputs.f32 holds N x 1 x 28 x 28 float32 values (N from the file size). */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static mgpu_device_set* two_devices;   /* for cnn_2stages */

static mgpu_model* make_model(const char* name) {
    mgpu_model_desc d;
    mgpu_layer* layers[10];
    memset(&d, 0, sizeof d);
    if (!strcmp(name, "cnn_2stages")) {
        if (!two_devices) two_devices = mgpu_device_set_create("cpu:2");
        if (!two_devices) return NULL;
        d.devices = two_devices;
        d.stages = 2;
        d.micro_batches = 2;
    }
    d.input = mgpu_shape3(1, 28, 28);
    d.seed = 7;
    d.layers = layers;
    if (!strcmp(name, "mlp")) {   /* nn.Sequential(Flatten, Linear(784,128), ReLU, Linear(128,10)) */
        layers[0] = mgpu_layer_flatten(); layers[1] = mgpu_layer_linear(784, 128); layers[2] = mgpu_layer_relu(); layers[3] = mgpu_layer_linear(128, 10);
        d.layer_count = 4;
    } else {                      /* the cnn of examples/train.c */
        layers[0] = mgpu_layer_conv2d(1, 16, 3, 1, 1); layers[1] = mgpu_layer_relu(); layers[2] = mgpu_layer_maxpool2d(2, 2);
        layers[3] = mgpu_layer_conv2d(16, 32, 3, 1, 1); layers[4] = mgpu_layer_relu(); layers[5] = mgpu_layer_maxpool2d(2, 2);
        layers[6] = mgpu_layer_flatten(); layers[7] = mgpu_layer_linear(32 * 7 * 7, 128); layers[8] = mgpu_layer_relu(); layers[9] = mgpu_layer_linear(128, 10);
        d.layer_count = 10;
    }
    return mgpu_model_create(&d);
}

static float* read_all(const char* path, long* count) {
    FILE* f = fopen(path, "rb");
    float* p;
    long bytes;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = (float*)malloc((size_t)bytes);
    if (p && fread(p, 1, (size_t)bytes, f) != (size_t)bytes) { free(p); p = NULL; }
    fclose(f);
    *count = bytes / (long)sizeof(float);
    return p;
}

/* interop bf16 DIR */
static int bf16(const char* dir) {
    char path[1024];
    long count = 0;
    float* in;
    mgpu_tensor *f = NULL, *b = NULL;
    FILE* out = NULL;
    int ok;
    snprintf(path, sizeof path, "%s/bf16_in.f32", dir);
    in = read_all(path, &count);
    ok = in && count > 0;
    if (ok) {
        f = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(count));
        b = mgpu_tensor_create(mgpu_device_cpu(), MGPU_BF16, mgpu_shape1(count));
        ok = f && b && mgpu_tensor_upload(f, in, mgpu_tensor_bytes(f)) == MGPU_OK && mgpu_tensor_convert(b, f, 1.0f, 0.0f) == MGPU_OK;
    }
    snprintf(path, sizeof path, "%s/bf16_out.u16", dir);
    ok = ok && (out = fopen(path, "wb")) != NULL;
    ok = ok && fwrite(mgpu_tensor_data(b), 1, mgpu_tensor_bytes(b), out) == mgpu_tensor_bytes(b);
    if (out && fclose(out) != 0) ok = 0;
    if (!ok) fprintf(stderr, "interop bf16: %s\n", in ? mgpu_last_error() : "cannot read bf16_in.f32");
    mgpu_tensor_destroy(f);
    mgpu_tensor_destroy(b);
    free(in);
    return ok;
}

/* logits of the inputs, written raw to path */
static int write_logits(mgpu_model* m, const float* inputs, long n, const char* path) {
    mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(n, 1, 28, 28));
    const mgpu_tensor* out;
    float* logits = (float*)malloc((size_t)n * 10 * sizeof(float));
    FILE* f;
    int ok = x && logits && mgpu_tensor_upload(x, inputs, (size_t)n * 784 * sizeof(float)) == MGPU_OK &&
             (out = mgpu_model_forward(m, 0, x, 0)) != NULL &&
             mgpu_tensor_download(out, logits, (size_t)n * 10 * sizeof(float)) == MGPU_OK &&
             (f = fopen(path, "wb")) != NULL && fwrite(logits, sizeof(float), (size_t)n * 10, f) == (size_t)n * 10 && fclose(f) == 0;
    mgpu_tensor_destroy(x);
    free(logits);
    return ok;
}

/* interop part DIR */
static int part(const char* dir, const float* inputs, long n) {
    char path[1024], out[1024];
    mgpu_model* m = make_model("mlp");
    mgpu_load_desc ld;
    mgpu_safetensors* st;
    mgpu_tensor* enc = NULL;
    const char* note;
    FILE* f;
    int ok;
    snprintf(path, sizeof path, "%s/torch_part.safetensors", dir);
    memset(&ld, 0, sizeof ld);
    ld.prefix = "model.";
    ld.allow_extra = 1;
    if (!m || mgpu_model_load_ex(m, NULL, path, &ld) != MGPU_OK) { fprintf(stderr, "interop: %s\n", mgpu_last_error()); return 0; }
    snprintf(out, sizeof out, "%s/torch_part.mgpu_logits", dir);
    ok = write_logits(m, inputs, n, out);
    mgpu_model_destroy(m);
    st = mgpu_safetensors_open(path);
    if (ok && st) enc = mgpu_safetensors_read(st, "encoder.weight", NULL);
    note = st ? mgpu_safetensors_metadata(st, "note") : NULL;
    snprintf(out, sizeof out, "%s/encoder.f32", dir);
    ok = ok && enc && note && (f = fopen(out, "wb")) != NULL &&
         fwrite(mgpu_tensor_data(enc), 1, mgpu_tensor_bytes(enc), f) == mgpu_tensor_bytes(enc) && fclose(f) == 0;
    snprintf(out, sizeof out, "%s/note.txt", dir);
    ok = ok && (f = fopen(out, "wb")) != NULL && fputs(note, f) >= 0 && fclose(f) == 0;
    if (!ok) fprintf(stderr, "interop part: %s\n", mgpu_last_error());
    mgpu_tensor_destroy(enc);
    mgpu_safetensors_close(st);
    return ok;
}

int main(int argc, char** argv) {
    const char* names[3] = { "mlp", "cnn", "cnn_2stages" };
    char path[1024];
    long count, n;
    float* inputs;
    int i, k;
    if (argc != 3 || (strcmp(argv[1], "save") && strcmp(argv[1], "load") && strcmp(argv[1], "part") && strcmp(argv[1], "mixed") &&
                      strcmp(argv[1], "bf16"))) {
        fprintf(stderr, "usage: interop save|load|part|mixed|bf16 DIR\n");
        return 2;
    }
    if (!strcmp(argv[1], "bf16")) return bf16(argv[2]) ? 0 : 1;
    snprintf(path, sizeof path, "%s/inputs.f32", argv[2]);
    inputs = read_all(path, &count);
    if (!inputs) { fprintf(stderr, "interop: cannot read %s\n", path); return 2; }
    n = count / 784;
    if (n < 1) { fprintf(stderr, "interop: %s holds no 28 x 28 image\n", path); return 2; }
    if (!strcmp(argv[1], "mixed")) {   /* the model converts each dtype to its F32 */
        mgpu_model* m = make_model("mlp");
        snprintf(path, sizeof path, "%s/torch_mixed.safetensors", argv[2]);
        i = m && mgpu_model_load(m, NULL, path) == MGPU_OK;
        snprintf(path, sizeof path, "%s/torch_mixed.mgpu_logits", argv[2]);
        i = i && write_logits(m, inputs, n, path);
        if (!i) fprintf(stderr, "interop mixed: %s\n", mgpu_last_error());
        mgpu_model_destroy(m);
        free(inputs);
        return i ? 0 : 1;
    }
    if (!strcmp(argv[1], "part")) {
        i = part(argv[2], inputs, n);
        free(inputs);
        return i ? 0 : 1;
    }
    for (i = 0; i < 3; ++i) {
        mgpu_model* m = make_model(names[i]);
        if (!m) { fprintf(stderr, "interop: %s\n", mgpu_last_error()); return 1; }
        if (!strcmp(argv[1], "save")) {
            mgpu_optimizer_desc od;
            mgpu_optimizer* opt;
            mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(8, 1, 28, 28));
            mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(8));
            memset(&od, 0, sizeof od);
            od.lr = 0.05f;
            od.momentum = 0.9f;
            opt = mgpu_optimizer_create(m, &od);
            for (k = 0; k < 8; ++k) ((int32_t*)mgpu_tensor_data(y))[k] = k % 10;
            for (k = 0; k < 3 && opt && x && y; ++k) {   /* batch k: images 8k .. 8k+7, round the n there are */
                int j;
                for (j = 0; j < 8; ++j)
                    memcpy((float*)mgpu_tensor_data(x) + (size_t)j * 784, inputs + (size_t)((k * 8 + j) % n) * 784, 784 * sizeof(float));
                if (mgpu_model_train_step(m, opt, x, y, NULL)) break;
            }
            snprintf(path, sizeof path, "%s/mgpu_%s.safetensors", argv[2], names[i]);
            if (k < 3 || mgpu_model_save(m, opt, path) != MGPU_OK) { fprintf(stderr, "interop: %s\n", mgpu_last_error()); return 1; }
            snprintf(path, sizeof path, "%s/mgpu_%s.logits", argv[2], names[i]);
            mgpu_optimizer_destroy(opt);
            mgpu_tensor_destroy(x);
            mgpu_tensor_destroy(y);
        } else {
            snprintf(path, sizeof path, "%s/torch_%s.safetensors", argv[2], i == 2 ? "cnn" : names[i]);
            if (mgpu_model_load(m, NULL, path) != MGPU_OK) { fprintf(stderr, "interop: %s\n", mgpu_last_error()); return 1; }
            snprintf(path, sizeof path, "%s/torch_%s.mgpu_logits", argv[2], names[i]);
        }
        if (!write_logits(m, inputs, n, path)) { fprintf(stderr, "interop: writing %s: %s\n", path, mgpu_last_error()); return 1; }
        mgpu_model_destroy(m);
    }
    mgpu_device_set_destroy(two_devices);
    free(inputs);
    return 0;
}
