/* examples/course/solutions/01_ex2.c - lesson 01, exercise 2: two devices on one GPU.

   "cuda:0,0" makes two devices on GPU 0 (and "cpu:2" two on the CPU): the same hardware, but
   each device has its own stream and its own caching allocator, so multi-GPU code runs, and can
   be tested, with one GPU. This program checks that the two devices are distinct, share the
   hardware (same GPU number, can read each other's memory), and count memory apart: a tensor on
   device 1 shows in device 1's statistics only. */
// course-run: cpu:2
// course-run-emu 1: cuda:0,0
// course-expect: one GPU, two devices: ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_device *d0, *d1;
    mgpu_device_info i0, i1;
    mgpu_memory_stats before0, before1, after0, after1;
    mgpu_tensor* t;
    int failures = 0;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    if (mgpu_device_set_count(set) != 2) { printf("give a spec of two devices on one GPU: cuda:0,0 (or cpu:2)\n"); return 1; }
    d0 = mgpu_device_set_get(set, 0);
    d1 = mgpu_device_set_get(set, 1);
    mgpu_device_get_info(d0, &i0);
    mgpu_device_get_info(d1, &i1);
    printf("%s and %s: hardware %d and %d, peer access %d\n", i0.label, i1.label, i0.ordinal, i1.ordinal,
           mgpu_device_can_access_peer(d0, d1));
    if (d0 == d1 || strcmp(i0.label, i1.label) == 0) { printf("WRONG: one device twice\n"); failures++; }
    if (i0.ordinal != i1.ordinal || i0.kind != i1.kind) { printf("WRONG: not on the same hardware\n"); failures++; }
    if (!mgpu_device_can_access_peer(d0, d1)) { printf("WRONG: one GPU cannot read its own memory\n"); failures++; }

    mgpu_memory_get_stats(d0, &before0);
    mgpu_memory_get_stats(d1, &before1);
    t = mgpu_tensor_create(d1, MGPU_F32, mgpu_shape1(1 << 16));   /* 256 KiB on device 1 */
    if (!t) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_memory_get_stats(d0, &after0);
    mgpu_memory_get_stats(d1, &after1);
    printf("a 256 KiB tensor on %s: %s in use +%zu, %s in use +%zu\n", i1.label, i0.label,
           after0.bytes_in_use - before0.bytes_in_use, i1.label, after1.bytes_in_use - before1.bytes_in_use);
    if (after1.bytes_in_use - before1.bytes_in_use != (size_t)1 << 18) { printf("WRONG: device 1 did not count it\n"); failures++; }
    if (after0.bytes_in_use != before0.bytes_in_use) { printf("WRONG: device 0 counted it\n"); failures++; }
    mgpu_tensor_destroy(t);
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("one GPU, two devices: ok\n");
    return 0;
}
