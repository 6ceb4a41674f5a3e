/* 04_simplenet.c - lesson 04: the tutorials' SimpleNet, trained the tutorials' way, in mgpu.

   The network: 784 -> 128 -> ReLU -> 10 (nn.Linear(28 * 28, 128), nn.Linear(128, 10)).
   The training: SGD, learning rate 0.01, no momentum, batch 64, 5 epochs, cross-entropy loss,
   inputs pixel / 255 (what transforms.ToTensor() gives: no normalisation), on Fashion-MNIST.
   It prints the mean training loss of each epoch and the test accuracy, then checks them.

   Run:  04_simplenet [DEVICES] [DATA] [--steps N] [--save-init FILE]
     DEVICES          auto (every GPU, or the CPU), cpu, cpu:2, cuda:0,1 ...  [auto]
     DATA             the folder of the Fashion-MNIST IDX files  [/usr/share/datasets/fashion-mnist]
     --steps N        train N batches per epoch only, test on N x 64 images (emulated GPUs are slow);
                      the checks expect 20 or more (with 3, the loss has not started to fall)
     --save-init FILE save the weights before the first step (safetensors), for the PyTorch
                      program to start from (tests/course_simplenet.sh compares the two)

   The batch order is mgpu's loader's shuffle with seed 1, which 04_simplenet.py can repeat:
   build/train --mean 0 --std 1 --momentum 0 --schedule constant --lr 0.01 trains the same. */
// course-run: cpu:2 $DATA
// course-run-emu 2: cuda:0,1 $DATA --steps 40
// course-expect: epoch 1: mean training loss
// course-expect: all checks passed
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

int main(int argc, char** argv) {
    const char* devices = "auto";
    const char* dir = "/usr/share/datasets/fashion-mnist";
    const char* save_init = NULL;
    long steps = 0;                       /* 0: every batch of the epoch */
    int positional = 0, i, epoch, status = 1, failures = 0;
    double epoch_loss[EPOCHS];
    mgpu_device_set* set = NULL;
    mgpu_dataset *train = NULL, *test = NULL;
    mgpu_model* model = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_loader *loader = NULL, *tester = NULL;
    const mgpu_tensor *x, *y;
    int64_t correct = 0, seen = 0, hits;
    double accuracy, bound;

    for (i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            char* end;
            steps = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end || steps < 0) { fprintf(stderr, "04_simplenet: --steps '%s': want a count of batches (0: whole epochs)\n", argv[i]); return 2; }
        }
        else if (!strcmp(argv[i], "--save-init") && i + 1 < argc) save_init = argv[++i];
        else if (argv[i][0] != '-' && positional == 0) { devices = argv[i]; positional++; }
        else if (argv[i][0] != '-' && positional == 1) { dir = argv[i]; positional++; }
        else { fprintf(stderr, "usage: 04_simplenet [DEVICES] [DATA] [--steps N] [--save-init FILE]\n"); return 2; }
    }

    /* device = torch.device("cuda" if ...): here a device list; a model on R devices is R replicas */
    if (!(set = mgpu_device_set_create(devices))) goto fail;
    if (!(train = load(dir, "train")) || !(test = load(dir, "t10k"))) goto fail;
    {
        /* class SimpleNet: x.view(-1, 28 * 28), fc1, relu, fc2. Its parameters are named as
           nn.Sequential names them: "1.weight", "1.bias" (fc1), "3.weight", "3.bias" (fc2) */
        mgpu_layer* layers[] = { mgpu_layer_flatten(), mgpu_layer_linear(28 * 28, 128), mgpu_layer_relu(),
                                 mgpu_layer_linear(128, 10) };
        /* model = SimpleNet().to(device): the weights are made on every device of the set, with
           PyTorch's default initialisation, from seed 1 */
        model = mgpu_model_create(&(mgpu_model_desc){
            .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 4, .devices = set,
            .loss = MGPU_LOSS_CROSS_ENTROPY, .seed = 1 });   /* criterion = nn.CrossEntropyLoss() */
        if (!model) goto fail;
    }
    /* optimizer = optim.SGD(model.parameters(), lr=0.01): no momentum, a constant rate */
    opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.01f, .momentum = 0.0f });
    /* DataLoader(..., transforms.ToTensor(), batch_size=64, shuffle=True): mean 0 and std 1 make
       x = pixel / 255, as ToTensor() does; the shuffle is seeded (seed 1), new every epoch */
    loader = mgpu_loader_create(train, &(mgpu_loader_desc){ .batch = 64, .shuffle = 1, .seed = 1, .mean = 0.0f, .std = 1.0f });
    tester = mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = 64 });
    if (!opt || !loader || !tester) goto fail;
    if (save_init && mgpu_model_save(model, NULL, save_init) != MGPU_OK) goto fail;

    printf("SimpleNet 784-128-10 on %s (%d device%s): SGD lr 0.01, batch 64, %d epochs%s\n",
           mgpu_device_set_spec(set), mgpu_device_set_count(set), mgpu_device_set_count(set) > 1 ? "s" : "",
           EPOCHS, steps ? " (a few steps each)" : "");
    for (epoch = 0; epoch < EPOCHS; ++epoch) {                     /* for epoch in range(5): */
        double sum = 0.0;
        long batches = 0;
        float loss;
        mgpu_loader_start(loader, epoch);
        while ((steps == 0 || batches < steps) && mgpu_loader_next(loader, &x, &y)) {   /* for data, target in train_loader: */
            /* zero_grad, forward, loss, backward, (all-reduce), step: one call. x and y are on
               the CPU; the call copies each replica's rows to its device (the .to(device)) */
            if (mgpu_model_train_step(model, opt, x, y, &loss) != MGPU_OK) goto fail;
            sum += loss;                                           /* running_loss += loss.item() */
            batches++;
        }
        epoch_loss[epoch] = sum / (double)batches;
        printf("epoch %d: mean training loss %.6f\n", epoch + 1, epoch_loss[epoch]);
    }
    mgpu_loader_start(tester, 0);
    while ((steps == 0 || seen < steps * 64) && mgpu_loader_next(tester, &x, &y)) {
        if (mgpu_model_evaluate(model, x, y, NULL, &hits) != MGPU_OK) goto fail;   /* no_grad, argmax */
        correct += hits;
        seen += x->shape.dim[0];
    }
    accuracy = (double)correct / (double)seen;
    printf("test accuracy %.4f (%lld images)\n", accuracy, (long long)seen);

    /* The checks. A loss that does not fall epoch after epoch, or an accuracy near chance (0.10),
       means the training is broken. The whole run reaches about 0.82; a few steps, about 0.6. */
    bound = steps ? 0.45 : 0.80;
    if (!(epoch_loss[0] < logf(10.0f))) { printf("FAIL: epoch 1's loss %.4f is not below ln 10 = 2.3026 (a guess)\n", epoch_loss[0]); failures++; }
    for (epoch = 1; epoch < EPOCHS; ++epoch)
        if (!(epoch_loss[epoch] < epoch_loss[epoch - 1])) {
            printf("FAIL: epoch %d's loss %.4f is not below epoch %d's %.4f\n", epoch + 1, epoch_loss[epoch], epoch, epoch_loss[epoch - 1]);
            failures++;
        }
    if (!(accuracy >= bound)) { printf("FAIL: test accuracy %.4f is below %.2f\n", accuracy, bound); failures++; }
    if (failures == 0) printf("all checks passed\n");
    status = failures ? 1 : 0;
    goto done;
fail:
    fprintf(stderr, "04_simplenet: %s\n", mgpu_last_error());
done:
    /* destroy in reverse order of creation */
    mgpu_loader_destroy(tester);
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);   /* and its layers */
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(train);
    mgpu_device_set_destroy(set);
    return status;
}
