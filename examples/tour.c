/* tour.c - the guide's tour: train the 784-128-10 MLP on Fashion-MNIST for one epoch on every
   GPU present (or the CPU), test it, save it. Run: build/tour [DIR [OUT]]   (DIR holds the IDX
   files, by default Debian's dataset-fashion-mnist; OUT is the checkpoint, tour.safetensors) */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

static mgpu_dataset* load(const char* dir, const char* split) {
    char images[512], labels[512];
    snprintf(images, sizeof images, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(labels, sizeof labels, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    return mgpu_dataset_load_idx(images, labels);
}

int main(int argc, char** argv) {
    const char* dir = argc > 1 ? argv[1] : "/usr/share/datasets/fashion-mnist";
    const char* out = argc > 2 ? argv[2] : "tour.safetensors";
    const float mean = 0.2860f, std = 0.3530f;   /* the training set's pixel statistics */
    mgpu_device_set* set = NULL;
    mgpu_dataset *train = NULL, *test = NULL;
    mgpu_model* model = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_loader *loader = NULL, *tester = NULL;
    const mgpu_tensor *x, *y;
    int64_t correct = 0, hits;
    float loss = 0.0f;
    int status = 1;

    /* each create returns NULL on failure, and mgpu_last_error() says why */
    if (!(set = mgpu_device_set_create("auto"))) goto fail;        /* every GPU, or the CPU */
    if (!(train = load(dir, "train")) || !(test = load(dir, "t10k"))) goto fail;
    {
        mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(784, 128), mgpu_layer_relu(),
                                 mgpu_layer_linear(128, 10) };
        /* one replica on each device of the set; fields left out take their defaults */
        model = mgpu_model_create(&(mgpu_model_desc){
            .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set });
        if (!model) goto fail;
    }
    opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.05f, .momentum = 0.9f });
    loader = mgpu_loader_create(train, &(mgpu_loader_desc){ .batch = 64, .shuffle = 1, .mean = mean, .std = std });
    tester = mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = 1000, .mean = mean, .std = std });
    if (!opt || !loader || !tester) goto fail;

    mgpu_loader_start(loader, 0);                                 /* one epoch */
    while (mgpu_loader_next(loader, &x, &y))                      /* x, y on the CPU */
        if (mgpu_model_train_step(model, opt, x, y, &loss) != MGPU_OK) goto fail;   /* split, compute, reduce, update */
    mgpu_loader_start(tester, 0);
    while (mgpu_loader_next(tester, &x, &y)) {
        if (mgpu_model_evaluate(model, x, y, NULL, &hits) != MGPU_OK) goto fail;
        correct += hits;
    }
    printf("%d device(s) (%s), last loss %.4f, test accuracy %.4f\n", mgpu_device_set_count(set),
           mgpu_device_set_spec(set), loss, (double)correct / (double)test->count);
    if (mgpu_model_save(model, opt, out) != MGPU_OK) goto fail;   /* with PyTorch's state_dict names */
    status = 0;
fail:
    if (status) fprintf(stderr, "tour: %s\n", mgpu_last_error());
    mgpu_loader_destroy(tester);
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);   /* and its layers */
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(train);
    mgpu_device_set_destroy(set);
    return status;
}
