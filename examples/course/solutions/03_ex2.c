/* examples/course/solutions/03_ex2.c - lesson 03, exercise 2: what a model costs in memory.

   A model's parameters and gradients are two flat buffers of P floats each; SGD with momentum
   adds one more (the momentum buffer); a training step adds its activations. The counters show
   each: in use after the model (at least 2 * 4P bytes), after the optimizer and a step (at least
   3 * 4P), the peak of the step, and everything back when the objects are destroyed (then the
   cache, until empty_cache). PyTorch: torch.cuda.memory_allocated() after each line. */
// course-run: cpu
// course-run-emu 1: cuda:0
// course-expect: model memory ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

static size_t in_use(mgpu_device* d) { mgpu_memory_stats s; mgpu_memory_get_stats(d, &s); return s.bytes_in_use; }

int main(int argc, char** argv) {
    enum { B = 32, IN = 64, HIDDEN = 256, OUT = 10 };
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu");
    mgpu_layer* layers[3];
    mgpu_model* m;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y;
    mgpu_memory_stats s;
    mgpu_device* d;
    size_t start, after_model, after_step, P4;
    float loss;
    int failures = 0;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    d = mgpu_device_set_get(set, 0);
    /* the batch lives on the CPU (as a loader's does); the step copies it to d when d is a GPU */
    x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(B, IN));
    y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(B));
    if (!x || !y) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_rand_normal(x, 1, 0, 0.0f, 1.0f);
    mgpu_tensor_zero(y);
    mgpu_memory_empty_cache(d);
    mgpu_memory_reset_peak(d);
    start = in_use(d);

    layers[0] = mgpu_layer_linear(IN, HIDDEN);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(HIDDEN, OUT);
    m = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(IN), .layers = layers, .layer_count = 3, .devices = set });
    if (!m) { printf("%s\n", mgpu_last_error()); return 1; }
    P4 = (size_t)mgpu_model_param_count(m) * sizeof(float);
    after_model = in_use(d) - start;
    printf("parameters: %lld floats = %zu bytes\n", (long long)mgpu_model_param_count(m), P4);
    printf("after the model:            %8zu bytes in use (params + grads = %zu)\n", after_model, 2 * P4);

    opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_SGD, .lr = 0.01f, .momentum = 0.9f });
    if (!opt || mgpu_model_train_step(m, opt, x, y, &loss) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }
    after_step = in_use(d) - start;
    mgpu_memory_get_stats(d, &s);
    printf("after optimizer and a step: %8zu bytes in use (+ momentum = %zu, + activations)\n", after_step, 3 * P4);
    printf("peak during the step:       %8zu bytes\n", s.peak_bytes_in_use - start);
    if (after_model < 2 * P4) { printf("WRONG: the model holds less than its parameters and gradients\n"); failures++; }
    if (after_step < 3 * P4 || after_step < after_model) { printf("WRONG: no room for the momentum buffer\n"); failures++; }
    if (s.peak_bytes_in_use - start < after_step) { printf("WRONG: the peak is below what is in use\n"); failures++; }

    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_memory_get_stats(d, &s);
    printf("destroyed:                  %8zu bytes in use, %zu reserved (the cache)\n", s.bytes_in_use - start, s.bytes_reserved - start);
    if (s.bytes_in_use != start) { printf("WRONG: memory in use after the destroys\n"); failures++; }
    mgpu_memory_empty_cache(d);
    mgpu_memory_get_stats(d, &s);
    printf("empty_cache:                %8zu bytes reserved\n", s.bytes_reserved - start);
    if (s.bytes_reserved != s.bytes_in_use) { printf("WRONG: empty_cache left cached blocks\n"); failures++; }
    mgpu_tensor_destroy(y);
    mgpu_tensor_destroy(x);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("model memory ok\n");
    return 0;
}
