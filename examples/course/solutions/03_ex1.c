/* examples/course/solutions/03_ex1.c - lesson 03, exercise 1: why a training loop stops allocating.

   A loop that makes and frees tensors of the same sizes at every step (activations, gradients,
   a loss) asks the backend (cudaMalloc, or malloc on the CPU) only in its first step: every
   later request is served from the cache. 100 steps of 3 tensors: 3 backend allocations, 297
   cache hits, and bytes_reserved stays what the first step needed. */
// course-run: cpu
// course-run-emu 1: cuda:0
// course-expect: cache ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu");
    mgpu_device* d;
    mgpu_memory_stats s0, s1 = { 0 }, s;
    int step, failures = 0;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    d = mgpu_device_set_get(set, 0);
    mgpu_memory_empty_cache(d);
    mgpu_memory_get_stats(d, &s0);
    for (step = 0; step < 100; ++step) {
        mgpu_tensor* act = mgpu_tensor_create(d, MGPU_F32, mgpu_shape2(64, 128));   /* 32 KiB */
        mgpu_tensor* grad = mgpu_tensor_create(d, MGPU_F32, mgpu_shape2(64, 128));
        mgpu_tensor* loss = mgpu_tensor_create(d, MGPU_F32, mgpu_shape1(1));
        if (!act || !grad || !loss) { printf("%s\n", mgpu_last_error()); return 1; }
        mgpu_tensor_fill(act, step);
        if (mgpu_scale(grad, act, 0.5f) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }
        mgpu_tensor_destroy(loss);
        mgpu_tensor_destroy(grad);
        mgpu_tensor_destroy(act);
        if (step == 0) mgpu_memory_get_stats(d, &s1);
    }
    mgpu_memory_get_stats(d, &s);
    printf("after step 1:   %llu backend allocations, %zu bytes reserved\n",
           (unsigned long long)(s1.backend_allocs - s0.backend_allocs), s1.bytes_reserved - s0.bytes_reserved);
    printf("after step 100: %llu backend allocations, %llu cache hits, %zu bytes reserved, %zu in use\n",
           (unsigned long long)(s.backend_allocs - s0.backend_allocs), (unsigned long long)(s.cache_hits - s0.cache_hits),
           s.bytes_reserved - s0.bytes_reserved, s.bytes_in_use - s0.bytes_in_use);
    if (s.backend_allocs - s0.backend_allocs != 3) { printf("WRONG: not 3 backend allocations\n"); failures++; }
    if (s.cache_hits - s0.cache_hits != 297) { printf("WRONG: not 297 cache hits\n"); failures++; }
    if (s.bytes_reserved != s1.bytes_reserved) { printf("WRONG: the reserve grew after step 1\n"); failures++; }
    if (s.bytes_in_use != s0.bytes_in_use) { printf("WRONG: memory still in use\n"); failures++; }
    mgpu_memory_empty_cache(d);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("cache ok\n");
    return 0;
}
