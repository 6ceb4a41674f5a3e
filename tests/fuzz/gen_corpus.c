/* gen_corpus.c - writes the seed corpora of the fuzz harnesses into tests/fuzz/corpus/<harness>/
   (checked in; run again only to change them): checkpoints of the harnesses' MLP saved by
   mgpu itself, IDX pairs, and gzip and raw DEFLATE streams from zlib in each of its modes.
   cc -std=c99 -I. tests/fuzz/gen_corpus.c -o build/gen_corpus -lz -lm -lpthread && build/gen_corpus [PART...] */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <zlib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../st_rules.h"

#define DIR "tests/fuzz/corpus/"

static void put(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) { perror(path); exit(1); }
}

static uint8_t* slurp(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb");
    uint8_t* b = (uint8_t*)malloc(1 << 16);
    if (!f || !b) { perror(path); exit(1); }
    *n = fread(b, 1, 1 << 16, f);
    fclose(f);
    return b;
}

/* zlib's deflate: window_bits -15 (raw) or 31 (gzip, with hdr when given). */
static size_t zdeflate(const uint8_t* src, size_t n, int level, int strategy, int window_bits, gz_header* hdr, uint8_t* out, size_t cap) {
    z_stream s;
    memset(&s, 0, sizeof s);
    if (deflateInit2(&s, level, Z_DEFLATED, window_bits, 8, strategy) != Z_OK) exit(1);
    if (hdr && deflateSetHeader(&s, hdr) != Z_OK) exit(1);
    s.next_in = (Bytef*)(uintptr_t)src;
    s.avail_in = (uInt)n;
    s.next_out = out;
    s.avail_out = (uInt)cap;
    if (deflate(&s, Z_FINISH) != Z_STREAM_END) exit(1);
    deflateEnd(&s);
    return cap - s.avail_out;
}

static void checkpoints(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu");
    int k;
    for (k = 0; k < 3; ++k) {
        static const float xs[8] = { 0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f, 0.0f, -2.0f };
        static const int32_t ys[2] = { 2, 0 };
        mgpu_layer* layers[3] = { mgpu_layer_linear(4, 8), mgpu_layer_relu(), mgpu_layer_linear(8, 3) };
        mgpu_model_desc md;
        mgpu_optimizer_desc od;
        mgpu_model* m;
        mgpu_optimizer* opt;
        mgpu_device* dev = mgpu_device_set_get(set, 0);
        mgpu_tensor *x = mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(2, 4)), *y = mgpu_tensor_create(dev, MGPU_I32, mgpu_shape1(2));
        mgpu_metadata meta[1] = { { "normalise", "mean=0.5 std=0.25" } };
        mgpu_save_desc sd;
        char a[256], b[256];
        memset(&md, 0, sizeof md);
        md.input = mgpu_shape1(4);
        md.layers = layers;
        md.layer_count = 3;
        md.devices = set;
        m = mgpu_model_create(&md);
        memset(&od, 0, sizeof od);
        od.kind = k == 1 ? MGPU_ADAMW : MGPU_SGD;
        od.lr = 0.01f;
        od.momentum = k == 0 ? 0.9f : 0.0f;
        opt = mgpu_optimizer_create(m, &od);
        if (!m || !opt || !x || !y || mgpu_tensor_upload(x, xs, sizeof xs) || mgpu_tensor_upload(y, ys, sizeof ys) ||
            mgpu_model_train_step(m, opt, x, y, NULL)) { fprintf(stderr, "%s\n", mgpu_last_error()); exit(1); }
        memset(&sd, 0, sizeof sd);
        sd.metadata = meta;
        sd.metadata_count = k == 2;
        snprintf(a, sizeof a, DIR "model_load/%s.safetensors", k == 0 ? "sgd_momentum" : k == 1 ? "adamw" : "plain_meta");
        snprintf(b, sizeof b, DIR "safetensors/%s.safetensors", k == 0 ? "sgd_momentum" : k == 1 ? "adamw" : "plain_meta");
        if (mgpu_model_save_ex(m, k == 2 ? NULL : opt, a, &sd) || mgpu_model_save_ex(m, k == 2 ? NULL : opt, b, &sd)) {
            fprintf(stderr, "%s\n", mgpu_last_error());
            exit(1);
        }
        if (k == 0) {   /* the same checkpoint in BF16 and in F16, which the load converts */
            sd.dtype = MGPU_SAVE_BF16;
            if (mgpu_model_save_ex(m, opt, DIR "model_load/sgd_momentum_bf16.safetensors", &sd)) exit(1);
            sd.dtype = MGPU_SAVE_F16;
            if (mgpu_model_save_ex(m, opt, DIR "model_load/sgd_momentum_f16.safetensors", &sd)) exit(1);
        }
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
        mgpu_optimizer_destroy(opt);
        mgpu_model_destroy(m);
    }
    mgpu_device_set_destroy(set);
    {   /* PyTorch's file (tests/gen_fixtures.py): other dtypes and shapes */
        size_t n;
        uint8_t* py = slurp("tests/fixtures/py.safetensors", &n);
        put(DIR "safetensors/py.safetensors", py, n);
        free(py);
    }
    {   /* each rule of the reference broken once, and each file it accepts (tests/st_rules.h) */
        uint8_t buf[1024];
        char path[256];
        size_t i, k, h;
        for (i = 0; i < sizeof st_rules / sizeof st_rules[0] + sizeof st_accepted / sizeof st_accepted[0]; ++i) {
            const int rule = i < sizeof st_rules / sizeof st_rules[0];
            const char* json = rule ? st_rules[i].json : st_accepted[i - sizeof st_rules / sizeof st_rules[0]].json;
            size_t data = rule ? st_rules[i].buf : st_accepted[i - sizeof st_rules / sizeof st_rules[0]].buf;
            if (!json) continue;   /* the framing cases: the mutator finds those */
            h = strlen(json);
            for (k = 0; k < 8; ++k) buf[k] = (uint8_t)((uint64_t)h >> (8 * k));
            memcpy(buf + 8, json, h);
            memset(buf + 8 + h, 0x3c, data);
            snprintf(path, sizeof path, DIR "safetensors/%s-%02zu.safetensors", rule ? "rule" : "accepted", i);
            put(path, buf, 8 + h + data);
        }
    }
}

static void idx(void) {
    static const uint8_t images[4 + 12 + 3 * 2 * 2] = { 0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2,
                                                        0, 255, 17, 34, 51, 68, 85, 102, 119, 136, 153, 170 };
    static const uint8_t labels[4 + 4 + 3] = { 0, 0, 8, 1, 0, 0, 0, 3, 9, 0, 4 };
    uint8_t buf[1024], gi[256], gl[256];
    size_t ni = zdeflate(images, sizeof images, 9, Z_DEFAULT_STRATEGY, 31, NULL, gi, sizeof gi);
    size_t nl = zdeflate(labels, sizeof labels, 6, Z_DEFAULT_STRATEGY, 31, NULL, gl, sizeof gl);
    int k;
    for (k = 0; k < 3; ++k) {   /* raw + raw, gzip + gzip, gzip + raw */
        const uint8_t* im = k ? gi : images;
        const uint8_t* lb = k == 1 ? gl : labels;
        size_t a = k ? ni : sizeof images, b = k == 1 ? nl : sizeof labels;
        static const char* names[3] = { DIR "idx/raw_raw", DIR "idx/gz_gz", DIR "idx/gz_raw" };
        buf[0] = (uint8_t)a;
        buf[1] = (uint8_t)(a >> 8);
        memcpy(buf + 2, im, a);
        memcpy(buf + 2 + a, lb, b);
        put(names[k], buf, 2 + a + b);
    }
}

static void deflate_streams(void) {
    static const char* strategies[] = { "default", "filtered", "huffman", "rle", "fixed" };
    uint8_t text[3000], out[4096];
    size_t i, n;
    char path[256];
    int s;
    for (i = 0; i < sizeof text; ++i)   /* words with repeats: literals, lengths and distances */
        text[i] = (uint8_t)("the quick brown fox jumps over the lazy dog 0123456789\n"[(i * 7 + i / 53) % 55]);
    for (s = 0; s < 5; ++s) {
        n = zdeflate(text, sizeof text, 9, s, -15, NULL, out, sizeof out);
        snprintf(path, sizeof path, DIR "inflate/%s", strategies[s]);
        put(path, out, n);
    }
    n = zdeflate(text, 300, 0, Z_DEFAULT_STRATEGY, -15, NULL, out, sizeof out);
    put(DIR "inflate/stored", out, n);
    n = zdeflate(text, 0, 9, Z_DEFAULT_STRATEGY, -15, NULL, out, sizeof out);
    put(DIR "inflate/empty", out, n);
    /* gzip: plain, empty, every header flag, two members with zero padding, stored */
    n = zdeflate(text, sizeof text, 6, Z_DEFAULT_STRATEGY, 31, NULL, out, sizeof out);
    put(DIR "gunzip/text.gz", out, n);
    n = zdeflate(text, 0, 6, Z_DEFAULT_STRATEGY, 31, NULL, out, sizeof out);
    put(DIR "gunzip/empty.gz", out, n);
    {
        gz_header h;
        static uint8_t extra[4] = { 'A', 'B', 0, 0 };
        memset(&h, 0, sizeof h);
        h.text = 1;
        h.extra = extra;
        h.extra_len = sizeof extra;
        h.name = (Bytef*)"name.txt";
        h.comment = (Bytef*)"a comment";
        h.hcrc = 1;
        n = zdeflate(text, 500, 9, Z_FIXED, 31, &h, out, sizeof out);
        put(DIR "gunzip/flags.gz", out, n);
    }
    n = zdeflate(text, 200, 1, Z_DEFAULT_STRATEGY, 31, NULL, out, sizeof out);
    n += zdeflate(text + 200, 100, 0, Z_DEFAULT_STRATEGY, 31, NULL, out + n, sizeof out - n);
    memset(out + n, 0, 4);
    put(DIR "gunzip/two_members_padded.gz", out, n + 4);
    put(DIR "gunzip/not_gzip", "plain bytes", 11);
}

/* fuzz_tokens: 3 option bytes (T, batch, flags), then an llm.c token file (or text) */
static void tokens(void) {
    static const struct { const char* name; uint8_t t, batch, flags; int count, file_count, magic, version; } seeds[] = {
        { "in_order", 3, 1, 0, 40, 40, 20240520, 1 },       /* T 4, batch 2 */
        { "shuffle_wrap", 2, 2, 3 | (5 << 3), 41, 41, 20240520, 1 },
        { "drop_last", 4, 3, 4, 33, 33, 20240520, 1 },
        { "one_window", 7, 4, 2, 9, 9, 20240520, 1 },       /* exactly T + 1 tokens */
        { "no_window", 7, 0, 0, 8, 8, 20240520, 1 },
        { "truncated", 3, 1, 0, 40, 30, 20240520, 1 },
        { "llama3", 3, 1, 0, 10, 20, 20240801, 7 },
    };
    uint8_t buf[3 + 1024 + 2 * 64];
    char path[256];
    size_t s;
    int i;
    for (s = 0; s < sizeof seeds / sizeof seeds[0]; ++s) {
        const int32_t h[3] = { seeds[s].magic, seeds[s].version, seeds[s].count };
        memset(buf, 0, sizeof buf);
        buf[0] = seeds[s].t;
        buf[1] = seeds[s].batch;
        buf[2] = seeds[s].flags;
        for (i = 0; i < 12; ++i) buf[3 + i] = (uint8_t)((uint32_t)h[i / 4] >> (8 * (i % 4)));
        for (i = 0; i < seeds[s].file_count; ++i) {   /* GPT-2-sized ids, and a few small ones */
            const unsigned v = i % 5 == 0 ? (unsigned)i : (unsigned)(i * 7919u) % 50257u;
            buf[3 + 1024 + 2 * i] = (uint8_t)v;
            buf[3 + 1024 + 2 * i + 1] = (uint8_t)(v >> 8);
        }
        snprintf(path, sizeof path, DIR "tokens/%s", seeds[s].name);
        put(path, buf, 3 + 1024 + 2 * (size_t)seeds[s].file_count);
    }
    {   /* text, not a token file: the tokenizer's path */
        static const char text[] = "\003\002\000First Citizen:\nBefore we proceed\xc3\xa9 any further\x01\n";
        put(DIR "tokens/text", text, sizeof text - 1);
    }
}

/* gen_corpus [PART...]: PART one of checkpoints, idx, deflate, tokens (default: all) */
int main(int argc, char** argv) {
    int i, all = argc < 2;
    for (i = 1; i < argc; ++i)
        if (strcmp(argv[i], "checkpoints") && strcmp(argv[i], "idx") && strcmp(argv[i], "deflate") && strcmp(argv[i], "tokens")) {
            fprintf(stderr, "gen_corpus: no part '%s' (checkpoints, idx, deflate, tokens)\n", argv[i]);
            return 2;
        }
#define GEN_PART(name, call) do { int k_; for (k_ = 1; k_ < argc; ++k_) if (!strcmp(argv[k_], name)) break; if (all || k_ < argc) call; } while (0)
    GEN_PART("checkpoints", checkpoints());
    GEN_PART("idx", idx());
    GEN_PART("deflate", deflate_streams());
    GEN_PART("tokens", tokens());
    return 0;
}
