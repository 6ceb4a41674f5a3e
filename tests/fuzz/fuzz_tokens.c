/* fuzz_tokens.c - libFuzzer harness: any bytes as an llm.c token file through mgpu_tokens_load,
   and as text through the byte-level tokenizer (mgpu_tokens_from_text) and the printing helper
   (mgpu_tokens_to_text); then, for a file that loads, one epoch of the loader over its windows.
   Input: 3 bytes of options (T = 1 + b0 % 16; batch = 1 + b1 % 8; b2: bit 0 shuffle, bit 1 wrap,
   bit 2 drop_last, the rest the seed), then the file. Built and run by tests/fuzz/run.sh. */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"

static char fuzz_text[4 * 4096 + 1];   /* to_text writes at most 4 bytes per byte token ("\xNN") */
static int32_t fuzz_ids[4096];

/* one epoch of the loader over t's windows of T tokens, checked against the tokens */
static void fuzz_windows(const mgpu_tokens* t, int T, int batch, int flags) {
    const uint16_t* tok = mgpu_tokens_data(t);
    const int64_t N = mgpu_tokens_count(t), W = (N - 1) / T;
    mgpu_dataset* ds = mgpu_dataset_tokens(t, T);
    mgpu_loader_desc d;
    mgpu_loader* l;
    const mgpu_tensor *x, *y;
    int64_t batches = 0, rows_seen = 0;
    if ((ds == NULL) != (W == 0)) abort();   /* refused exactly when no window fits */
    if (!ds) return;
    if (ds->count != W || ds->seq != T) abort();
    memset(&d, 0, sizeof d);
    d.batch = batch;
    d.shuffle = flags & 1;
    d.wrap = (flags >> 1) & 1;
    d.drop_last = (flags >> 2) & 1;
    d.seed = (uint64_t)(flags >> 3);
    l = mgpu_loader_create(ds, &d);
    if ((l == NULL) != (d.wrap && d.drop_last)) abort();   /* refused exactly for both at once */
    while (l && mgpu_loader_next(l, &x, &y)) {
        const int64_t rows = mgpu_tensor_dim(x, 0);
        const int32_t* xs = (const int32_t*)mgpu_tensor_data(x);
        const int32_t* ys = (const int32_t*)mgpu_tensor_data(y);
        int64_t r, k;
        if (rows < 1 || rows > batch || mgpu_tensor_dim(y, 0) != rows || mgpu_tensor_dim(x, 1) != T || mgpu_tensor_dim(y, 1) != T) abort();
        if ((d.wrap || d.drop_last) && rows != batch) abort();
        for (r = 0; r < rows; ++r) {
            /* in order: row r of batch b is window (bB + r) mod W; shuffled: some window */
            const int64_t j = (batches * batch + r) % W;
            for (k = 0; k < T; ++k) {
                if (!d.shuffle && (xs[r * T + k] != tok[j * T + k] || ys[r * T + k] != tok[j * T + k + 1])) abort();
                if (k + 1 < T && xs[r * T + k + 1] != ys[r * T + k]) abort();   /* y is x shifted by one */
                if (ys[r * T + k] < 0 || ys[r * T + k] > mgpu_tokens_max_id(t)) abort();
            }
        }
        rows_seen += rows;
        ++batches;
    }
    if (l && batches != mgpu_loader_batches(l)) abort();
    if (l && rows_seen != (d.wrap ? batches * batch : d.drop_last ? W / batch * batch : W)) abort();
    mgpu_loader_destroy(l);
    if (mgpu_dataset_destroy(ds) != MGPU_OK) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static fuzz_file f;
    mgpu_tokens* t;
    int T, batch, flags;
    size_t i;
    if (!f.path[0]) { fuzz_file_open(&f); mgpu_log_set_callback(fuzz_quiet, NULL); }
    if (size < 3 || size - 3 > sizeof fuzz_ids / sizeof fuzz_ids[0]) return 0;
    T = 1 + data[0] % 16;
    batch = 1 + data[1] % 8;
    flags = data[2];
    data += 3;
    size -= 3;
    fuzz_file_write(&f, data, size);

    /* as text: token i is byte i, refused only when empty; printed safely */
    t = mgpu_tokens_from_text(f.path);
    if ((t == NULL) != (size == 0)) abort();
    if (t) {
        int top = 0;
        size_t need, cut_size = (size_t)T * 3, cut;
        if ((size_t)mgpu_tokens_count(t) != size) abort();
        for (i = 0; i < size; ++i) {
            if (mgpu_tokens_data(t)[i] != data[i]) abort();
            top = data[i] > top ? data[i] : top;
            fuzz_ids[i] = data[i];
        }
        if (mgpu_tokens_max_id(t) != top) abort();
        need = mgpu_tokens_to_text(fuzz_ids, (int64_t)size, fuzz_text, sizeof fuzz_text);
        if (need >= sizeof fuzz_text || strlen(fuzz_text) != need) abort();
        for (i = 0; i < need; ++i)   /* no control byte but newline and tab */
            if ((uint8_t)fuzz_text[i] < 0x20 && fuzz_text[i] != '\n' && fuzz_text[i] != '\t') abort();
        {   /* a smaller buffer holds a prefix, cut between pieces */
            char small[64];
            cut = mgpu_tokens_to_text(fuzz_ids, (int64_t)size, small, cut_size);
            if (cut != need || strlen(small) >= cut_size || memcmp(small, fuzz_text, strlen(small)) != 0) abort();
        }
        if (mgpu_tokens_destroy(t) != MGPU_OK) abort();
    }

    /* as a token file */
    t = mgpu_tokens_load(f.path);
    if (t) {
        const int64_t N = mgpu_tokens_count(t);
        int top = 0;
        int64_t k;
        if (N < 1 || size != 1024 + 2 * (size_t)N || mgpu__le32(data) != MGPU_TOKENS_MAGIC || mgpu__le32(data + 4) != MGPU_TOKENS_VERSION ||
            (int64_t)mgpu__le32(data + 8) != N)
            abort();
        for (k = 0; k < N; ++k) {
            const int v = data[1024 + 2 * k] | (data[1024 + 2 * k + 1] << 8);
            if (mgpu_tokens_data(t)[k] != v) abort();
            top = v > top ? v : top;
        }
        if (mgpu_tokens_max_id(t) != top) abort();
        fuzz_windows(t, T, batch, flags);
        if (mgpu_tokens_destroy(t) != MGPU_OK) abort();
    }
    return 0;
}
