/* bn_torch.c - BatchNorm2d's running statistics for tests/bn_torch.py: a model of one
   BatchNorm2d(3) trained (MSE against zeros, SGD) on BATCHES fixed batches [4, 3, 5, 6], whose
   values are a formula the Python side recomputes; the checkpoint (with the buffers) goes to
   argv[1]. Usage: bn_torch OUT.safetensors [DEVICES] */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>

#define BATCHES 4
#define N 4
#define C 3
#define H 5
#define W 6

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 2 ? argv[2] : "cpu");
    mgpu_layer* layers[1];
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *t;
    float* px;
    int b, i;
    if (argc < 2) { fprintf(stderr, "usage: bn_torch OUT.safetensors [DEVICES]\n"); return 2; }
    layers[0] = mgpu_layer_batch_norm2d(C);
    m = set ? mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(C, H, W), .layers = layers, .layer_count = 1,
                                                    .devices = set, .loss = MGPU_LOSS_MSE }) : NULL;
    opt = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.1f }) : NULL;
    x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(N, C, H, W));
    t = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape4(N, C, H, W));
    if (!opt || !x || !t || mgpu_tensor_zero(t) != MGPU_OK) { fprintf(stderr, "bn_torch: %s\n", mgpu_last_error()); return 1; }
    px = (float*)mgpu_tensor_data(x);
    for (b = 0; b < BATCHES; ++b) {
        for (i = 0; i < N * C * H * W; ++i) {   /* (tests/bn_torch.py: the same formula) */
            const int c = (i / (H * W)) % C;
            px[i] = (float)(sin(0.37 * i + 1.3 * b) * (1.0 + c) + 0.1 * c + 0.05 * b);
        }
        if (mgpu_model_train_step(m, opt, x, t, NULL) != MGPU_OK) { fprintf(stderr, "bn_torch: %s\n", mgpu_last_error()); return 1; }
    }
    if (mgpu_model_save(m, NULL, argv[1]) != MGPU_OK) { fprintf(stderr, "bn_torch: %s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
    return 0;
}
