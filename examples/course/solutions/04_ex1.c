/* 04_ex1.c - lesson 04, exercise 1: SimpleNet with momentum 0.9 (optim.SGD(..., lr=0.01,
   momentum=0.9)), beside the tutorial's plain SGD, from the same initial weights and batches.
   Run: 04_ex1 [DEVICES] [DATA]. It checks that momentum ends every epoch with a lower mean
   training loss and a better test accuracy than plain SGD. */
// course-run: cpu $DATA
// course-expect: momentum 0.9
// course-expect: all checks passed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

#define EPOCHS 5

static mgpu_dataset* load(const char* dir, const char* split) {
    char images[512], labels[512];
    snprintf(images, sizeof images, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(labels, sizeof labels, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    return mgpu_dataset_load_idx(images, labels);
}

/* 04_simplenet.c's training with a given momentum: the mean loss of each epoch, the test
   accuracy. 0 on success. */
static int train(mgpu_device_set* set, mgpu_dataset* data, mgpu_dataset* test, float momentum,
                 double loss[EPOCHS], double* accuracy) {
    mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(784, 128), mgpu_layer_relu(), mgpu_layer_linear(128, 10) };
    mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){
        .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set, .seed = 1 });
    mgpu_optimizer* opt = model ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){
        .kind = MGPU_SGD, .lr = 0.01f, .momentum = momentum }) : NULL;   /* the one line that changes */
    mgpu_loader* loader = mgpu_loader_create(data, &(mgpu_loader_desc){ .batch = 64, .shuffle = 1, .seed = 1 });
    mgpu_loader* tester = mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = 1000 });
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
    double plain[EPOCHS], heavy[EPOCHS], acc_plain = 0, acc_heavy = 0;
    int epoch, failures = 0, status = 1;
    if (!test || train(set, data, test, 0.0f, plain, &acc_plain) || train(set, data, test, 0.9f, heavy, &acc_heavy)) {
        fprintf(stderr, "04_ex1: %s\n", mgpu_last_error());
        goto done;
    }
    printf("mean training loss   no momentum   momentum 0.9\n");
    for (epoch = 0; epoch < EPOCHS; ++epoch) {
        printf("epoch %d              %.6f      %.6f\n", epoch + 1, plain[epoch], heavy[epoch]);
        if (!(heavy[epoch] < plain[epoch])) { printf("FAIL: epoch %d: momentum's loss is not the lower\n", epoch + 1); failures++; }
    }
    printf("test accuracy        %.4f        %.4f\n", acc_plain, acc_heavy);
    if (!(acc_heavy > acc_plain)) { printf("FAIL: momentum does not test better\n"); failures++; }
    if (!failures) printf("all checks passed\n");
    status = failures != 0;
done:
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(data);
    mgpu_device_set_destroy(set);
    return status;
}
