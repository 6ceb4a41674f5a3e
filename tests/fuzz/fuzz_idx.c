/* fuzz_idx.c - libFuzzer harness: any bytes as a pair of IDX files (images, labels), raw or
   gzipped, through mgpu_dataset_load_idx, then one epoch of the batch loader over what loaded.
   Input: a 2-byte little-endian length n, n bytes of the images file, the rest the labels file.
   Built and run by tests/fuzz/run.sh. */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static fuzz_file fi, fl;
    size_t n;
    mgpu_dataset* ds;
    if (!fi.path[0]) { fuzz_file_open(&fi); fuzz_file_open(&fl); mgpu_log_set_callback(fuzz_quiet, NULL); }
    if (size < 2) return 0;
    n = (size_t)data[0] | ((size_t)data[1] << 8);
    data += 2;
    size -= 2;
    if (n > size) n = size;
    fuzz_file_write(&fi, data, n);
    fuzz_file_write(&fl, data + n, size - n);
    ds = mgpu_dataset_load_idx(fi.path, fl.path);
    if (ds) {
        mgpu_loader_desc d;
        mgpu_loader* l;
        const mgpu_tensor *x, *y;
        memset(&d, 0, sizeof d);
        d.batch = 3;
        d.shuffle = 1;
        d.seed = 7;
        d.mean = 0.5f;
        d.std = 0.25f;
        if (ds->count < 1 || ds->rows < 1 || ds->cols < 1) abort();
        /* one epoch when it is small; the loader's cost is not what is being fuzzed */
        if (ds->count * ds->rows * ds->cols <= (int64_t)1 << 16 && (l = mgpu_loader_create(ds, &d)) != NULL) {
            int64_t batches = 0;
            mgpu_loader_start(l, 0);
            while (mgpu_loader_next(l, &x, &y)) ++batches;
            if (batches != mgpu_loader_batches(l)) abort();
            mgpu_loader_destroy(l);
        }
        mgpu_dataset_destroy(ds);
    }
    return 0;
}
