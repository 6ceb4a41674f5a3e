/* examples/course/solutions/01_ex1.c - lesson 01, exercise 1: what each device is.

   PyTorch: torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory,
   torch.cuda.mem_get_info(i). mgpu: mgpu_device_get_info fills one struct per device: its label,
   name, memory (total and free), compute capability and SM count (CPU threads for the CPU). */
// course-run: cpu:2
// course-run-emu 2: cuda:0,1
// course-expect: info ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "auto");
    int i, failures = 0;
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    for (i = 0; i < mgpu_device_set_count(set); ++i) {
        mgpu_device_info info;
        if (mgpu_device_get_info(mgpu_device_set_get(set, i), &info) != MGPU_OK) { printf("%s\n", mgpu_last_error()); return 1; }
        printf("%-8s %-28s %6.1f GiB total, %6.1f GiB free, ", info.label, info.name,
               info.total_memory / 1073741824.0, info.free_memory / 1073741824.0);
        if (info.kind == MGPU_DEVICE_CUDA) printf("compute %d.%d, %d SMs\n", info.compute_major, info.compute_minor, info.multiprocessors);
        else printf("%d CPU threads\n", info.multiprocessors);
        /* what must hold whatever the machine */
        if (info.replica != i) { printf("WRONG: device %d says it is device %d of its set\n", i, info.replica); failures++; }
        if (info.total_memory > 0 && info.free_memory > info.total_memory) { printf("WRONG: more free than total\n"); failures++; }
        if (info.multiprocessors < 1) { printf("WRONG: no SMs or threads\n"); failures++; }
        if (info.kind == MGPU_DEVICE_CUDA && (info.total_memory == 0 || info.compute_major < 1)) {
            printf("WRONG: a GPU without memory or compute capability\n");
            failures++;
        }
    }
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("info ok\n");
    return 0;
}
