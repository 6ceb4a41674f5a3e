/* 04_ex2.c - lesson 04, exercise 2: SimpleNet on normalised inputs, as with
   transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))]), beside
   ToTensor() alone, from the same initial weights and batches. The mean and std are measured on
   the training set here (they are Fashion-MNIST's 0.2860 and 0.3530, build/train's defaults).
   Run: 04_ex2 [DEVICES] [DATA]. It checks the statistics against a second, plain computation,
   and that normalised inputs end every epoch with a lower mean loss and test better. */
// course-run: cpu $DATA
// course-expect: normalised
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>

#define EPOCHS 5

static mgpu_dataset* load(const char* dir, const char* split) {
    char images[512], labels[512];
    snprintf(images, sizeof images, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(labels, sizeof labels, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    return mgpu_dataset_load_idx(images, labels);
}

/* 04_simplenet.c's training with inputs x = (pixel / 255 - mean) / std: the mean loss of each
   epoch, the test accuracy. The test images get the same normalisation as the training ones. */
static int train(mgpu_device_set* set, mgpu_dataset* data, mgpu_dataset* test, float mean, float std,
                 double loss[EPOCHS], double* accuracy) {
    mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(784, 128), mgpu_layer_relu(), mgpu_layer_linear(128, 10) };
    mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){
        .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set, .seed = 1 });
    mgpu_optimizer* opt = model ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.01f }) : NULL;
    /* the lines that change: the loaders' mean and std */
    mgpu_loader* loader = mgpu_loader_create(data, &(mgpu_loader_desc){ .batch = 64, .shuffle = 1, .seed = 1, .mean = mean, .std = std });
    mgpu_loader* tester = mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = 1000, .mean = mean, .std = std });
    const mgpu_tensor *x, *y;
    int64_t correct = 0, hits;
    int epoch, status = 1;
    if (!model || !opt || !loader || !tester) goto done;
    for (epoch = 0; epoch < EPOCHS; ++epoch) {
        double sum = 0.0;
        long batches = 0;
        float l;
        mgpu_loader_start(loader, epoch);
        while (mgpu_loader_next(loader, &x, &y)) {
            if (mgpu_model_train_step(model, opt, x, y, &l) != MGPU_OK) goto done;
            sum += l;
            batches++;
        }
        loss[epoch] = sum / (double)batches;
    }
    mgpu_loader_start(tester, 0);
    while (mgpu_loader_next(tester, &x, &y)) {
        if (mgpu_model_evaluate(model, x, y, NULL, &hits) != MGPU_OK) goto done;
        correct += hits;
    }
    *accuracy = (double)correct / (double)test->count;
    status = 0;
done:
    mgpu_loader_destroy(tester);
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    return status;
}

int main(int argc, char** argv) {
    const char* devices = argc > 1 ? argv[1] : "auto";
    const char* dir = argc > 2 ? argv[2] : "/usr/share/datasets/fashion-mnist";
    mgpu_device_set* set = mgpu_device_set_create(devices);
    mgpu_dataset* data = set ? load(dir, "train") : NULL;
    mgpu_dataset* test = data ? load(dir, "t10k") : NULL;
    double plain[EPOCHS], norm[EPOCHS], acc_plain = 0, acc_norm = 0;
    double sum = 0, sum2 = 0, mean, std, var2 = 0;
    int64_t i, n;
    int epoch, failures = 0, status = 1;
    if (!test) { fprintf(stderr, "04_ex2: %s\n", mgpu_last_error()); goto done; }

    /* the statistics of every training pixel, scaled to [0, 1] as ToTensor() scales it */
    n = data->count * data->rows * data->cols;
    for (i = 0; i < n; ++i) {
        double v = data->images[i] / 255.0;
        sum += v;
        sum2 += v * v;
    }
    mean = sum / (double)n;
    std = sqrt(sum2 / (double)n - mean * mean);
    /* the check: the two-pass formula, sum((v - mean)^2) / n, must give the same std */
    for (i = 0; i < n; ++i) { double d = data->images[i] / 255.0 - mean; var2 += d * d; }
    printf("training pixels: mean %.4f, std %.4f\n", mean, std);
    if (!(fabs(sqrt(var2 / (double)n) - std) < 1e-6 && mean > 0.0 && mean < 1.0)) {
        printf("FAIL: the std %.6f differs from the two-pass one %.6f\n", std, sqrt(var2 / (double)n));
        failures++;
    }

    if (train(set, data, test, 0.0f, 1.0f, plain, &acc_plain) || train(set, data, test, (float)mean, (float)std, norm, &acc_norm)) {
        fprintf(stderr, "04_ex2: %s\n", mgpu_last_error());
        goto done;
    }
    printf("mean training loss   ToTensor()    normalised\n");
    for (epoch = 0; epoch < EPOCHS; ++epoch) {
        printf("epoch %d              %.6f      %.6f\n", epoch + 1, plain[epoch], norm[epoch]);
        if (!(norm[epoch] < plain[epoch])) { printf("FAIL: epoch %d: the normalised loss is not the lower\n", epoch + 1); failures++; }
    }
    printf("test accuracy        %.4f        %.4f\n", acc_plain, acc_norm);
    if (!(acc_norm > acc_plain)) { printf("FAIL: normalised inputs do not test better\n"); failures++; }
    if (!failures) printf("all checks passed\n");
    status = failures != 0;
done:
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(data);
    mgpu_device_set_destroy(set);
    return status;
}
