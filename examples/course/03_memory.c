/* examples/course/03_memory.c - lesson 03: the caching allocator, and what empty_cache does.

   Every device has a caching allocator, as in PyTorch: a freed tensor's memory is not given back
   to cudaMalloc's (or malloc's) owner but kept, and the next tensor of about the same size gets
   it at once. mgpu_memory_get_stats reads the counters:
     bytes_in_use       held by live tensors (on a GPU also cuBLAS's 32 MiB workspace)
                                                         torch.cuda.memory_allocated()
     bytes_reserved     in use + cached                   torch.cuda.memory_reserved()
     peak_bytes_in_use  the most in use since the reset   torch.cuda.max_memory_allocated()
     backend_allocs, backend_frees, cache_hits
   mgpu_memory_empty_cache gives the CACHED blocks back (torch.cuda.empty_cache()): it never frees
   a live tensor, never lowers bytes_in_use, and is not needed to avoid running out (an
   allocation that fails empties the cache itself and tries again).

   This program works on the last device of the set, checks each counter against what the rules
   say (sizes are rounded up to 256 bytes below 1 MiB, to 128 KiB above) and prints them.

   Run:   ./03_memory cpu
          ./03_memory cpu:2
          MGPU_EMU_DEVICES=1 build/emu/03_memory cuda:0 */
// course-run: cpu
// course-run: cpu:2
// course-run-emu 1: cuda:0
// course-expect: memory ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

static int failures = 0;
static void check(int ok, const char* what) {
    if (!ok) { printf("WRONG: %s\n", what); failures++; }
}
static mgpu_memory_stats stats_of(mgpu_device* d) {
    mgpu_memory_stats s;
    mgpu_memory_get_stats(d, &s);
    return s;
}
static void show(const char* when, mgpu_device* d) {
    mgpu_memory_stats s = stats_of(d);
    printf("%-34s in use %8zu  reserved %8zu  peak %8zu  allocs %2llu  frees %2llu  cache hits %2llu\n", when,
           s.bytes_in_use, s.bytes_reserved, s.peak_bytes_in_use, (unsigned long long)s.backend_allocs,
           (unsigned long long)s.backend_frees, (unsigned long long)s.cache_hits);
}

int main(int argc, char** argv) {
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu");
    mgpu_device* d;
    mgpu_memory_stats s0, s;
    mgpu_tensor *a, *b, *big;
    float back[1000];
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    d = mgpu_device_set_get(set, mgpu_device_set_count(set) - 1);
    printf("device %s\n", mgpu_device_label(d));
    mgpu_memory_empty_cache(d);          /* start from an empty cache: what we count is ours */
    mgpu_memory_reset_peak(d);
    s0 = stats_of(d);
    show("start", d);

    /* 1000 floats = 4000 bytes, rounded up to 4096: one new block from the backend */
    a = mgpu_tensor_create(d, MGPU_F32, mgpu_shape1(1000));
    if (!a) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_fill(a, 1.0);
    s = stats_of(d);
    show("a = 1000 floats", d);
    check(s.bytes_in_use - s0.bytes_in_use == 4096, "4000 bytes are not one block of 4096");
    check(s.backend_allocs - s0.backend_allocs == 1, "the first tensor did not come from the backend");

    /* freed: still reserved (cached), no longer in use */
    mgpu_tensor_destroy(a);
    s = stats_of(d);
    show("a destroyed", d);
    check(s.bytes_in_use == s0.bytes_in_use, "a destroyed tensor is still counted in use");
    check(s.bytes_reserved - s0.bytes_reserved == 4096, "the freed block was not kept in the cache");
    check(s.backend_frees == s0.backend_frees, "the freed block went back to the backend");

    /* the same size again: served from the cache, no call to the backend */
    b = mgpu_tensor_create(d, MGPU_F32, mgpu_shape1(1000));
    if (!b) { printf("%s\n", mgpu_last_error()); return 1; }
    mgpu_tensor_fill(b, 2.0);
    s = stats_of(d);
    show("b = 1000 floats again", d);
    check(s.cache_hits - s0.cache_hits == 1 && s.backend_allocs - s0.backend_allocs == 1, "b was not served from the cache");

    /* 3 MiB + 1 byte: above 1 MiB sizes round up to 128 KiB */
    big = mgpu_tensor_create(d, MGPU_U8, mgpu_shape1((3 << 20) + 1));
    if (!big) { printf("%s\n", mgpu_last_error()); return 1; }
    s = stats_of(d);
    show("big = 3 MiB + 1 byte", d);
    check(s.bytes_in_use - s0.bytes_in_use == 4096 + (3 << 20) + (128 << 10), "3 MiB + 1 is not rounded to 3 MiB + 128 KiB");
    mgpu_tensor_destroy(big);
    show("big destroyed", d);

    /* empty_cache: the cached block (big's) goes back; b, alive, is untouched */
    mgpu_memory_empty_cache(d);
    s = stats_of(d);
    show("empty_cache", d);
    check(s.bytes_in_use - s0.bytes_in_use == 4096, "empty_cache changed what live tensors hold");
    check(s.bytes_reserved == s.bytes_in_use, "empty_cache left cached blocks");
    check(s.backend_frees - s0.backend_frees == 1, "empty_cache did not free exactly the one cached block");
    check(s.peak_bytes_in_use - s0.bytes_in_use == 4096 + (3 << 20) + (128 << 10), "empty_cache changed the peak");
    mgpu_tensor_download(b, back, sizeof back);
    check(back[0] == 2.0f && back[999] == 2.0f, "b lost its contents");

    mgpu_tensor_destroy(b);
    mgpu_memory_empty_cache(d);
    show("b destroyed, empty_cache", d);
    s = stats_of(d);
    check(s.bytes_in_use == s0.bytes_in_use && s.bytes_reserved == s0.bytes_reserved, "memory left over at the end");
    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("memory ok\n");
    return 0;
}
