/* resnet.c - a small ResNet with BatchNorm on Fashion-MNIST, on every GPU present or on the CPU.

   build/resnet --data /usr/share/datasets/fashion-mnist --epochs 2
   build/resnet --devices cpu:2 --save resnet.safetensors   (PyTorch names: "1.running_mean", ...)

   Flags as build/train's: --data DIR, --epochs N [2], --batch N [64], --lr F [0.05, SGD with
   momentum 0.9 and a cosine schedule], --devices SPEC [auto], --seed N [1], --save FILE, --max-steps N
   [0: no limit; a smoke test's short run, evaluated all the same], and --sync-bn. The last
   line is key=value pairs ending in test_acc=X, as build/train's. The layers:
     conv 3x3 (1 -> 32), BN, ReLU, max-pool 2            28x28 -> 14x14
     residual block: conv, BN, ReLU, conv, BN (+ x), ReLU at 32 channels
     conv 3x3 (32 -> 64), BN, ReLU, max-pool 2           14x14 -> 7x7
     residual block at 64 channels
     global average pooling (AdaptiveAvgPool2d((1, 1)) and flatten), Linear(64 -> 10)
   With several replicas, each normalises by the statistics of its own rows (as DDP without
   SyncBatchNorm) and replica 0's running statistics are copied to the others after each step;
   with --sync-bn, by the whole batch's (desc.sync_batch_norm, as nn.SyncBatchNorm), so that N
   replicas train as one device would. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEAN 0.2860f   /* the training set's pixel mean and deviation, as build/train's */
#define STD 0.3530f
#define FAIL(...) do { fprintf(stderr, "resnet: " __VA_ARGS__); fprintf(stderr, "\n"); return 1; } while (0)

/* conv 3x3 -> BN -> ReLU -> conv 3x3 -> BN, plus x; the ReLU after the sum is a layer of its own */
static mgpu_layer* block(int c) {
    mgpu_layer* f[5] = { mgpu_layer_conv2d(c, c, 3, 1, 1), mgpu_layer_batch_norm2d(c), mgpu_layer_relu(),
                         mgpu_layer_conv2d(c, c, 3, 1, 1), mgpu_layer_batch_norm2d(c) };
    return mgpu_layer_residual(mgpu_layer_sequential(f, 5), NULL);
}

/* the IDX files, plain or gzipped, as build/train finds them */
static mgpu_dataset* load(const char* dir, const char* split) {
    char ip[1024], lp[1024];
    mgpu_dataset* ds;
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    if ((ds = mgpu_dataset_load_idx(ip, lp)) != NULL) return ds;
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte", dir, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte", dir, split);
    return mgpu_dataset_load_idx(ip, lp);
}

int main(int argc, char** argv) {
    const char *data = "/usr/share/datasets/fashion-mnist", *devices = "auto", *save = NULL;
    int epochs = 2, batch = 64, sync_bn = 0, i;
    unsigned long long seed = 1;
    float lr = 0.05f, loss = 0.0f, test_loss = 0.0f;
    int64_t correct = 0, steps = 0, max_steps = 0;
    for (i = 1; i < argc; ++i) {
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--help")) { printf("usage: resnet [--data DIR] [--epochs N] [--batch N] [--lr F] [--devices SPEC] [--seed N] [--save FILE] [--max-steps N] [--sync-bn]\n"); return 0; }
        if (!strcmp(argv[i], "--sync-bn")) { sync_bn = 1; continue; }
        if (!v) FAIL("unknown option or missing value: '%s' (see --help)", argv[i]);
        if (!strcmp(argv[i], "--data")) data = v;
        else if (!strcmp(argv[i], "--devices")) devices = v;
        else if (!strcmp(argv[i], "--save")) save = v;
        else if (!strcmp(argv[i], "--epochs")) epochs = atoi(v);
        else if (!strcmp(argv[i], "--batch")) batch = atoi(v);
        else if (!strcmp(argv[i], "--lr")) lr = (float)atof(v);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(argv[i], "--max-steps")) max_steps = atoll(v);
        else FAIL("unknown option '%s' (see --help)", argv[i]);
        ++i;
    }
    if (epochs < 1 || batch < 1 || !(lr > 0.0f)) FAIL("--epochs and --batch must be at least 1, --lr positive");
    mgpu_device_set* set = mgpu_device_set_create(devices);
    mgpu_dataset *train = set ? load(data, "train") : NULL, *test = train ? load(data, "t10k") : NULL;
    if (!set || !train || !test) FAIL("%s", mgpu_last_error());
    double t0 = mgpu_seconds();

    /* ---- the model and the training loop ---- */
    mgpu_layer* layers[] = { mgpu_layer_conv2d(1, 32, 3, 1, 1), mgpu_layer_batch_norm2d(32), mgpu_layer_relu(), mgpu_layer_maxpool2d(2, 2),
                             block(32), mgpu_layer_relu(),
                             mgpu_layer_conv2d(32, 64, 3, 1, 1), mgpu_layer_batch_norm2d(64), mgpu_layer_relu(), mgpu_layer_maxpool2d(2, 2),
                             block(64), mgpu_layer_relu(),
                             mgpu_layer_global_avg_pool2d(), mgpu_layer_linear(64, 10) };
    mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(1, 28, 28), .layers = layers,
                                                              .layer_count = (int)(sizeof layers / sizeof layers[0]),
                                                              .devices = set, .seed = seed, .sync_batch_norm = sync_bn });
    mgpu_loader* loader = model ? mgpu_loader_create(train, &(mgpu_loader_desc){ .batch = batch, .shuffle = 1, .seed = seed,
                                                                                  .mean = MEAN, .std = STD }) : NULL;
    mgpu_loader* all = loader ? mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = (int)test->count, .mean = MEAN, .std = STD }) : NULL;
    mgpu_optimizer* opt = all ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = lr, .momentum = 0.9f,
                                                  .schedule = MGPU_SCHEDULE_COSINE, .total_steps = (int)(epochs * mgpu_loader_batches(loader)) }) : NULL;
    const mgpu_tensor *x, *y, *test_x, *test_y;
    if (!opt || !mgpu_loader_next(all, &test_x, &test_y)) FAIL("%s", mgpu_last_error());
    for (int epoch = 0; epoch < epochs; ++epoch) {
        mgpu_loader_start(loader, epoch);
        while ((!max_steps || steps < max_steps) && mgpu_loader_next(loader, &x, &y)) {
            if (mgpu_model_train_step(model, opt, x, y, ++steps % 100 == 0 ? &loss : NULL) != MGPU_OK) FAIL("%s", mgpu_last_error());
            if (steps % 100 == 0) { printf("\repoch %d step %lld loss %.4f", epoch + 1, (long long)steps, (double)loss); fflush(stdout); }
        }
        /* evaluation: BatchNorm with its running statistics */
        if (mgpu_model_evaluate(model, test_x, test_y, &test_loss, &correct) != MGPU_OK) FAIL("%s", mgpu_last_error());
        printf("\nepoch %d: test accuracy %.4f, test loss %.4f\n", epoch + 1, (double)correct / (double)test->count, (double)test_loss);
        if (save && mgpu_model_save(model, opt, save) != MGPU_OK) FAIL("%s", mgpu_last_error());
    }
    /* ---- */

    printf("model=resnet devices=%s replicas=%d batch=%d epochs=%d steps=%lld train_loss=%.4f test_loss=%.4f test_acc=%.4f "
           "seconds=%.1f\n", mgpu_device_set_spec(set), mgpu_model_replica_count(model), batch, epochs, (long long)steps,
           (double)loss, (double)test_loss, (double)correct / (double)test->count, mgpu_seconds() - t0);
    mgpu_optimizer_destroy(opt);
    mgpu_loader_destroy(all);
    mgpu_loader_destroy(loader);
    mgpu_model_destroy(model);
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(train);
    mgpu_device_set_destroy(set);
    return 0;
}
