/* fuzz_safetensors.c - libFuzzer harness: any bytes as a safetensors file, through the public
   reader: open, every tensor's info, find and read (onto the CPU), every metadata key and value.
   Built and run by tests/fuzz/run.sh. */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"

static volatile unsigned fuzz_sink;   /* so the reads of the tensor's bytes stay */

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static fuzz_file f;
    mgpu_safetensors* st;
    int i, n;
    if (!f.path[0]) { fuzz_file_open(&f); mgpu_log_set_callback(fuzz_quiet, NULL); }
    fuzz_file_write(&f, data, size);
    st = mgpu_safetensors_open(f.path);
    if (!st) return 0;
    n = mgpu_safetensors_count(st);
    for (i = -1; i <= n; ++i) {   /* one past each end: refused, not read */
        mgpu_safetensors_info info;
        mgpu_tensor* t;
        if (mgpu_safetensors_get_info(st, i, &info) != MGPU_OK) {
            if (i >= 0 && i < n) abort();   /* every listed tensor has an info */
            continue;
        }
        if (mgpu_safetensors_find(st, info.name) != i) abort();
        t = mgpu_safetensors_read(st, info.name, NULL);
        if (t) {   /* touch every byte that was read */
            size_t bytes = mgpu_tensor_bytes(t), k;
            uint8_t* host = (uint8_t*)malloc(bytes ? bytes : 1);
            unsigned sum = 0;
            if (!host || mgpu_tensor_download(t, host, bytes) != MGPU_OK) abort();
            for (k = 0; k < bytes; ++k) sum += host[k];
            free(host);
            fuzz_sink = sum;
            mgpu_tensor_destroy(t);
        }
    }
    (void)mgpu_safetensors_find(st, "no such tensor");
    n = mgpu_safetensors_metadata_count(st);
    for (i = -1; i <= n; ++i) {
        const char* key = mgpu_safetensors_metadata_key(st, i);
        if (!key) {
            if (i >= 0 && i < n) abort();
            continue;
        }
        if (!mgpu_safetensors_metadata(st, key)) abort();   /* every listed key has a value */
    }
    (void)mgpu_safetensors_metadata(st, "mgpu.step");
    mgpu_safetensors_close(st);
    return 0;
}
