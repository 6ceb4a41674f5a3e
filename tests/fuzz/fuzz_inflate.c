/* fuzz_inflate.c - libFuzzer harness: mgpu__zinflate (one raw DEFLATE stream, RFC 1951)
   against zlib's raw inflate on every input: both accept or both refuse, the same bytes out,
   and the same input consumed (aborts otherwise). Built and run by tests/fuzz/run.sh (-lz). */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"
#include "zref.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static mgpu__zbuf* z;
    uint8_t* want = NULL;
    const uint8_t* zp = data;
    size_t want_len = 0, want_cap = 0;
    int ok, zok;
    if (!z) {
        mgpu_log_set_callback(fuzz_quiet, NULL);
        z = (mgpu__zbuf*)malloc(sizeof *z);   /* reused: the Huffman tables are large */
        if (!z) abort();
    }
    memset(z, 0, sizeof *z);
    z->name = "fuzz";
    z->in.p = data;
    z->in.end = data + size;
    ok = mgpu__zinflate(z) == MGPU_OK;
    zok = zref_inflate(&zp, data + size, -15, &want, &want_len, &want_cap);
    if (ok != zok || (ok && (z->len != want_len || (want_len && memcmp(z->out, want, want_len) != 0) || z->in.p != zp))) {
        fprintf(stderr, "mgpu__zinflate %s (%zu bytes out, %zu in), zlib %s (%zu bytes out, %zu in)%s%s\n",
                ok ? "accepts" : "refuses", z->len, (size_t)(z->in.p - data), zok ? "accepts" : "refuses", want_len,
                (size_t)(zp - data), ok ? "" : ": ", ok ? "" : mgpu_last_error());
        abort();
    }
    free(want);
    MGPU_FREE(z->out);
    return 0;
}
