/* fuzz_gunzip.c - libFuzzer harness: mgpu__gunzip against zlib on every input: both accept or
   both refuse, and what they accept decodes to the same bytes (aborts otherwise). Input that
   does not start with the gzip magic must come back unchanged. Built and run by
   tests/fuzz/run.sh (linked with -lz). */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"
#include "zref.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    uint8_t *got = NULL, *want = NULL;
    size_t got_len = 0, want_len = 0;
    int ok, zok;
    static int quiet;
    if (!quiet) { mgpu_log_set_callback(fuzz_quiet, NULL); quiet = 1; }
    ok = mgpu__gunzip(data, size, "fuzz", &got, &got_len) == MGPU_OK;
    if (size >= 2 && data[0] == 0x1F && data[1] == 0x8B) {
        zok = zref_gunzip(data, size, &want, &want_len);
    } else {   /* not gzip: a plain copy */
        zok = 1;
        want = (uint8_t*)malloc(size ? size : 1);
        if (!want) abort();
        if (size) memcpy(want, data, size);
        want_len = size;
    }
    if (ok != zok || (ok && (got_len != want_len || (got_len && memcmp(got, want, got_len) != 0)))) {
        fprintf(stderr, "mgpu__gunzip %s (%zu bytes), zlib %s (%zu bytes)%s%s\n", ok ? "accepts" : "refuses", got_len,
                zok ? "accepts" : "refuses", want_len, ok ? "" : ": ", ok ? "" : mgpu_last_error());
        abort();
    }
    if (ok && !got) abort();   /* never NULL on success */
    free(want);
    MGPU_FREE(got);
    return 0;
}
