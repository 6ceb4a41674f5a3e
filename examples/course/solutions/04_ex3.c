/* 04_ex3.c - lesson 04, exercise 3: the tutorial's nn.DataParallel line, in mgpu. The same
   SimpleNet training on one device and on two (two replicas, each given half of every batch of
   64, their gradients summed before the step) must print the same losses: the split changes
   where the work runs, not what is computed.
   Run: 04_ex3 [ONE] [MANY] [DATA] [--steps N]   (default: cpu cpu:2; --steps N: N batches per
   epoch, for emulated GPUs). It checks that every epoch's mean loss agrees within 1e-4 (on CPU
   devices they are the same bits; GPUs add their order of summation: rounding). */
// course-run: cpu cpu:2 $DATA
// course-run-emu 2: cuda:0 cuda:0,1 $DATA --steps 20
// course-expect: the same losses
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EPOCHS 5

static mgpu_dataset* load(const char* dir, const char* split) {
    char images[512], labels[512];
    snprintf(images, sizeof images, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(labels, sizeof labels, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    return mgpu_dataset_load_idx(images, labels);
}

/* 04_simplenet.c's training on the devices of `spec`: the mean loss of each epoch. */
static int train(const char* spec, mgpu_dataset* data, long steps, double loss[EPOCHS]) {
    mgpu_device_set* set = mgpu_device_set_create(spec);   /* the one line that changes */
    if (!set) return 1;
    mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(784, 128), mgpu_layer_relu(), mgpu_layer_linear(128, 10) };
    mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){
        .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set, .seed = 1 });
    mgpu_optimizer* opt = model ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.01f }) : NULL;
    mgpu_loader* loader = mgpu_loader_create(data, &(mgpu_loader_desc){ .batch = 64, .shuffle = 1, .seed = 1 });
    const mgpu_tensor *x, *y;
    int epoch, status = 1;
    if (!model || !opt || !loader) goto done;
    printf("%s: %d replica%s\n", spec, mgpu_model_replica_count(model), mgpu_model_replica_count(model) > 1 ? "s" : "");
    for (epoch = 0; epoch < EPOCHS; ++epoch) {
        double sum = 0.0;
        long batches = 0;
        float l;
        mgpu_loader_start(loader, epoch);
        while ((steps == 0 || batches < steps) && mgpu_loader_next(loader, &x, &y)) {
            if (mgpu_model_train_step(model, opt, x, y, &l) != MGPU_OK) goto done;
            sum += l;
            batches++;
        }
        loss[epoch] = sum / (double)batches;
    }
    status = 0;
done:
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    mgpu_device_set_destroy(set);
    return status;
}

int main(int argc, char** argv) {
    const char *one = "cpu", *many = "cpu:2", *dir = "/usr/share/datasets/fashion-mnist";
    long steps = 0;
    int i, positional = 0, epoch, failures = 0, status = 1;
    double a[EPOCHS], b[EPOCHS];
    mgpu_dataset* data;
    for (i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            char* end;
            steps = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end || steps < 0) { fprintf(stderr, "04_ex3: --steps '%s': want a count of batches (0: whole epochs)\n", argv[i]); return 2; }
        }
        else if (argv[i][0] != '-' && positional < 3) { *(positional == 0 ? &one : positional == 1 ? &many : &dir) = argv[i]; positional++; }
        else { fprintf(stderr, "usage: 04_ex3 [ONE] [MANY] [DATA] [--steps N]\n"); return 2; }
    }
    if (!(data = load(dir, "train")) || train(one, data, steps, a) || train(many, data, steps, b)) {
        fprintf(stderr, "04_ex3: %s\n", mgpu_last_error());
        goto done;
    }
    printf("mean training loss   %-12s  %s\n", one, many);
    for (epoch = 0; epoch < EPOCHS; ++epoch) {
        printf("epoch %d              %.6f      %.6f\n", epoch + 1, a[epoch], b[epoch]);
        if (!(fabs(a[epoch] - b[epoch]) <= 1e-4)) { printf("FAIL: epoch %d: they differ by %.2g\n", epoch + 1, fabs(a[epoch] - b[epoch])); failures++; }
    }
    if (!failures) printf("the same losses on %s and %s\n", one, many);
    status = failures != 0;
done:
    mgpu_dataset_destroy(data);
    return status;
}
