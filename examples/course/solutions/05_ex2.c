/* 05_ex2.c - lesson 05, exercise 2: how many bytes does each way move per step?

   P is the size of the model's flat parameter buffer (and of its gradient buffer: the same). On
   N devices, one step of
     nn.DataParallel  copies the model to devices 1..N-1 (P each: replicate) and their gradients
                      back to device 0 (P each: gather), so device 0 receives (N-1) x P;
     DDP              copies no model: every device takes part in one all-reduce of P.
   The program predicts these numbers, runs one step of each way's copies for N = 2, 3, 4, and
   checks the counters against the prediction.

   Run:  build/course/05_ex2                                                   */
// course-run:
// course-expect: the counters match the prediction: yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

int main(void) {
    const char* specs[3] = { "cpu:2", "cpu:3", "cpu:4" };
    int s, r, ok = 1;
    printf("   N  P (bytes)  DataParallel: device 0 in, each other in  DDP: all-reduced by each\n");
    for (s = 0; s < 3; ++s) {
        mgpu_device_set* set;
        mgpu_model* m;
        mgpu_optimizer* opt;
        mgpu_tensor *x, *y, *tmp;
        mgpu_device_counters k0, k1;
        uint64_t P;
        int n;
        mgpu_layer* layers[3] = { mgpu_layer_linear(8, 16), mgpu_layer_relu(), mgpu_layer_linear(16, 3) };
        NEED(set = mgpu_device_set_create(specs[s]));
        n = mgpu_device_set_count(set);
        NEED(m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(8), .layers = layers, .layer_count = 3, .devices = set }));
        NEED(opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .lr = 0.1f }));
        P = mgpu_tensor_bytes(mgpu_model_params(m, 0));
        NEED(tmp = mgpu_tensor_create(mgpu_model_device(m, 0), MGPU_F32, mgpu_tensor_shape(mgpu_model_grads(m, 0))));
        /* DataParallel's copies of one step: replicate, then gather */
        for (r = 0; r < n; ++r) mgpu_device_reset_counters(mgpu_model_device(m, r));
        for (r = 1; r < n; ++r) CHECK(mgpu_tensor_copy(mgpu_model_params(m, r), mgpu_model_params(m, 0)));
        for (r = 1; r < n; ++r) CHECK(mgpu_tensor_copy(tmp, mgpu_model_grads(m, r)));
        CHECK(mgpu_device_get_counters(mgpu_model_device(m, 0), &k0));
        CHECK(mgpu_device_get_counters(mgpu_model_device(m, 1), &k1));
        if (k0.bytes_device_to_device != (uint64_t)(n - 1) * P || k1.bytes_device_to_device != P) ok = 0;
        printf("%4d %10llu  %12llu B %12llu B", n, (unsigned long long)P, (unsigned long long)k0.bytes_device_to_device,
               (unsigned long long)k1.bytes_device_to_device);
        /* DDP: one real training step; the batch (on the CPU device, device 0) read in place */
        NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(12, 8)));
        NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(12)));
        CHECK(mgpu_tensor_fill(x, 0.5));
        CHECK(mgpu_tensor_zero(y));
        for (r = 0; r < n; ++r) mgpu_device_reset_counters(mgpu_model_device(m, r));
        CHECK(mgpu_model_train_step(m, opt, x, y, NULL));
        for (r = 0; r < n; ++r) {
            CHECK(mgpu_device_get_counters(mgpu_model_device(m, r), &k1));
            if (k1.bytes_allreduced != P) ok = 0;
        }
        printf(" %16llu B\n", (unsigned long long)k1.bytes_allreduced);
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
        mgpu_tensor_destroy(tmp);
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
        mgpu_device_set_destroy(set);
    }
    printf("the counters match the prediction: %s\n", ok ? "yes" : "NO");
    return ok ? 0 : 1;
}
