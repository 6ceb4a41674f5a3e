/* test_io.c - tests of mgpu.h's file readers and writers (gzip, IDX, safetensors, token files)
   and the loader of token windows.
   Built and run by `make test` (plain and ASan+UBSan builds). Optional inputs:
   HAVE_ZLIB (link -lz) for round trips against zlib; tests/fixtures/py.* written by the Python
   safetensors package (python3 tests/gen_fixtures.py tests/fixtures regenerates them);
   /usr/share/datasets/fashion-mnist (the .gz files). Missing ones are reported as skipped. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#define mgpu__test_error_text mgpu_last_error()

#include <time.h>
#include <signal.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/types.h>
#ifndef _WIN32
#include <sys/wait.h>
#include <sys/resource.h>
#endif
#define TEST_PORTABILITY_ONLY   /* tests/test.h's helpers for POSIX and Windows, not its harness */
#include "test.h"
#ifdef HAVE_ZLIB
#include <zlib.h>
#endif

#ifndef FIXTURES
#define FIXTURES "tests/fixtures"
#endif
#ifndef C_WRITTEN
#define C_WRITTEN "build/c_written.safetensors"
#endif
#ifndef MNIST_DIR
#define MNIST_DIR "/usr/share/datasets/fashion-mnist"
#endif

static int g_pass, g_fail, g_skip;
static char g_dir[256]; /* scratch directory */

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) g_pass++;                                               \
        else {                                                            \
            g_fail++;                                                     \
            printf("FAIL %s:%d: (%s) ", __FILE__, __LINE__, #cond);       \
            printf(__VA_ARGS__);                                          \
            printf("\n   last error: %s\n", mgpu__test_error_text);       \
        }                                                                 \
    } while (0)
#define SKIP(...)                     \
    do {                              \
        g_skip++;                     \
        printf("SKIP: ");             \
        printf(__VA_ARGS__);          \
        printf("\n");                 \
    } while (0)

/* rc must be `code` and the last error must mention every one of up to two substrings */
static int g_verbose; /* TEST_VERBOSE=1 prints every expected error message */
static int err_is(mgpu_result rc, mgpu_result code, const char* s1, const char* s2) {
    if (g_verbose) printf("   [%d] %s\n", (int)rc, mgpu__test_error_text);
    if (rc != code) return 0;
    if (s1 && !strstr(mgpu__test_error_text, s1)) return 0;
    if (s2 && !strstr(mgpu__test_error_text, s2)) return 0;
    return 1;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static double now_s(void) {
#ifdef _WIN32
    return mgpu_seconds();
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
}

static uint8_t* read_all(FILE* f, size_t* n) {
    size_t cap = 1 << 16, len = 0, got;
    uint8_t* p = (uint8_t*)malloc(cap);
    while (p && (got = fread(p + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            uint8_t* q = (uint8_t*)realloc(p, cap *= 2);
            if (!q) { free(p); return NULL; }
            p = q;
        }
    }
    *n = len;
    return p;
}
static uint8_t* read_file(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb");
    uint8_t* p;
    if (!f) return NULL;
    p = read_all(f, n);
    fclose(f);
    return p;
}
static int write_file(const char* path, const void* p, size_t n) {
    FILE* f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}
/* a command's output (gzip, zcat), or NULL; Windows has neither command */
static uint8_t* run_capture(const char* cmd, size_t* n) {
#ifdef _WIN32
    (void)cmd;
    *n = 0;
    return NULL;
#else
    FILE* f = popen(cmd, "r");
    uint8_t* p;
    if (!f) return NULL;
    p = read_all(f, n);
    if (pclose(f) != 0) { free(p); return NULL; }
    return p;
#endif
}

/* test data: kind 0 random, 1 zeros, 2 text-like, 3 long-range repeats, 4 small alphabet */
static uint8_t* make_data(int kind, size_t n) {
    static const char* words[] = {"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dog\n", "mgpu ", "tensor "};
    uint8_t* p = (uint8_t*)malloc(n ? n : 1);
    size_t i;
    for (i = 0; i < n; ++i) {
        switch (kind) {
        case 0: p[i] = (uint8_t)rnd(); break;
        case 1: p[i] = 0; break;
        case 2: {
            const char* w = words[rnd() % 10];
            size_t k;
            for (k = 0; w[k] && i < n; ++k) p[i++] = (uint8_t)w[k];
            --i;
            break;
        }
        case 3: p[i] = i < 40000 ? (uint8_t)rnd() : p[i - 32768 + (i % 7)]; break;
        default: p[i] = (uint8_t)("ACGT"[rnd() % 4]); break;
        }
    }
    return p;
}

/* ---------------------------------------------------------------------------------- gzip --- */
#ifdef HAVE_ZLIB
static uint8_t* zlib_gzip(const uint8_t* src, size_t n, int level, int strategy, gz_header* hdr, size_t* out_n) {
    z_stream s;
    uint8_t* out;
    size_t cap;
    memset(&s, 0, sizeof s);
    if (deflateInit2(&s, level, Z_DEFLATED, 31, 8, strategy) != Z_OK) return NULL;
    if (hdr) deflateSetHeader(&s, hdr);
    cap = deflateBound(&s, (uLong)n) + 4096;
    out = (uint8_t*)malloc(cap);
    s.next_in = (Bytef*)src;
    s.avail_in = (uInt)n;
    s.next_out = out;
    s.avail_out = (uInt)cap;
    if (deflate(&s, Z_FINISH) != Z_STREAM_END) { free(out); deflateEnd(&s); return NULL; }
    *out_n = s.total_out;
    deflateEnd(&s);
    return out;
}
#endif

static uint8_t* cli_gzip(const uint8_t* src, size_t n, const char* opts, size_t* out_n) {
    char path[512], cmd[1200];
    snprintf(path, sizeof path, "%s/gzip_in.bin", g_dir);
    if (!write_file(path, src, n)) return NULL;
    snprintf(cmd, sizeof cmd, "gzip -c %s '%s'", opts, path);
    return run_capture(cmd, out_n);
}

static int roundtrip(const uint8_t* gz, size_t gz_n, const uint8_t* want, size_t want_n) {
    uint8_t* out = NULL;
    size_t out_n = 0;
    int ok;
    mgpu_result rc = mgpu__gunzip(gz, gz_n, "rt.gz", &out, &out_n);
    ok = rc == MGPU_OK && out && out_n == want_n && (want_n == 0 || !memcmp(out, want, want_n));
    if (!ok) printf("   roundtrip: rc %d, %zu bytes out, %zu wanted\n", (int)rc, out_n, want_n);
    free(out);
    return ok;
}

/* A little DEFLATE bit writer for hand-made streams. */
typedef struct bw { uint8_t buf[4096]; size_t n; uint32_t acc; int nb; } bw;
static void bw_put(bw* w, uint32_t v, int n) { /* LSB first */
    int i;
    for (i = 0; i < n; ++i) {
        w->acc |= ((v >> i) & 1u) << w->nb;
        if (++w->nb == 8) { w->buf[w->n++] = (uint8_t)w->acc; w->acc = 0; w->nb = 0; }
    }
}
static void bw_huff(bw* w, uint32_t code, int len) { /* Huffman codes go MSB first */
    int i;
    for (i = len - 1; i >= 0; --i) bw_put(w, (code >> i) & 1u, 1);
}
static void bw_flush(bw* w) { if (w->nb) bw_put(w, 0, 8 - w->nb); }
static void bw_bytes(bw* w, const void* p, size_t n) { memcpy(w->buf + w->n, p, n); w->n += n; }
static void fixed_lit(bw* w, int sym) {
    if (sym < 144) bw_huff(w, (uint32_t)(0x30 + sym), 8);
    else if (sym < 256) bw_huff(w, (uint32_t)(0x190 + sym - 144), 9);
    else if (sym < 280) bw_huff(w, (uint32_t)(sym - 256), 7);
    else bw_huff(w, (uint32_t)(0xC0 + sym - 280), 8);
}
/* wraps raw deflate bytes in a gzip member whose trailer matches `want` */
static size_t wrap_gzip(const bw* w, const void* want, size_t want_n, uint8_t* out) {
    static const uint8_t hdr[10] = {0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 3};
    mgpu__crc32_table t;
    uint32_t c;
    size_t n = 0;
    int i;
    mgpu__crc32_init(&t);
    c = mgpu__crc32(&t, 0, (const uint8_t*)want, want_n);
    memcpy(out, hdr, 10);
    n = 10;
    memcpy(out + n, w->buf, w->n);
    n += w->n;
    for (i = 0; i < 4; ++i) out[n++] = (uint8_t)(c >> (8 * i));
    for (i = 0; i < 4; ++i) out[n++] = (uint8_t)((uint32_t)want_n >> (8 * i));
    return n;
}
static mgpu_result gunzip_bw(const bw* w, const char* want) {
    uint8_t file[8192], *out = NULL;
    size_t n = wrap_gzip(w, want, strlen(want), file), out_n = 0;
    mgpu_result rc = mgpu__gunzip(file, n, "hand.gz", &out, &out_n);
    if (rc == MGPU_OK && (out_n != strlen(want) || memcmp(out, want, out_n))) rc = (mgpu_result)99;
    free(out);
    return rc;
}

static void test_gzip_handmade(void) {
    bw w;
    uint8_t one[1] = {5};
    int i;
    /* valid fixed block: "abc" + <length 3, distance 3> */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 1, 2);
    fixed_lit(&w, 'a'); fixed_lit(&w, 'b'); fixed_lit(&w, 'c');
    fixed_lit(&w, 257); bw_huff(&w, 2, 5); /* length 3, distance code 2 = distance 3 */
    fixed_lit(&w, 256); bw_flush(&w);
    CHECK(gunzip_bw(&w, "abcabc") == MGPU_OK, "hand-made fixed block decodes");
    /* overlapping copy: "a" + <length 10, distance 1> */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 1, 2);
    fixed_lit(&w, 'a'); fixed_lit(&w, 264); bw_huff(&w, 0, 5); fixed_lit(&w, 256); bw_flush(&w);
    CHECK(gunzip_bw(&w, "aaaaaaaaaaa") == MGPU_OK, "run-length copy with distance 1");
    /* distance beyond the output */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 1, 2);
    fixed_lit(&w, 'a'); fixed_lit(&w, 257); bw_huff(&w, 1, 5); fixed_lit(&w, 256); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, "aaaa"), MGPU_ERROR_BAD_FILE, "hand.gz", "distance 2 reaches back"), "distance too far");
    /* a second member may not reach back into the first one's output */
    {
        uint8_t file[256], *out = NULL;
        size_t n1, n2, out_n;
        bw w2;
        memset(&w, 0, sizeof w);
        bw_put(&w, 1, 1); bw_put(&w, 1, 2);
        fixed_lit(&w, 'a'); fixed_lit(&w, 'b'); fixed_lit(&w, 'c'); fixed_lit(&w, 256); bw_flush(&w);
        n1 = wrap_gzip(&w, "abc", 3, file);
        memset(&w2, 0, sizeof w2);
        bw_put(&w2, 1, 1); bw_put(&w2, 1, 2);
        fixed_lit(&w2, 'd'); fixed_lit(&w2, 257); bw_huff(&w2, 2, 5); fixed_lit(&w2, 256); bw_flush(&w2);
        n2 = wrap_gzip(&w2, "dbcd", 4, file + n1);
        CHECK(err_is(mgpu__gunzip(file, n1 + n2, "two.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "two.gz", "distance 3 reaches back"),
              "distance into the previous member");
        free(out);
    }
    /* literal/length symbol 286 */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 1, 2);
    fixed_lit(&w, 'a'); fixed_lit(&w, 286); fixed_lit(&w, 256); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, "a"), MGPU_ERROR_BAD_FILE, "hand.gz", "invalid literal/length code"), "symbol 286");
    /* distance symbol 30 */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 1, 2);
    for (i = 0; i < 4; ++i) fixed_lit(&w, 'a');
    fixed_lit(&w, 257); bw_huff(&w, 30, 5); fixed_lit(&w, 256); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, "aaaa"), MGPU_ERROR_BAD_FILE, "hand.gz", "invalid distance code"), "distance symbol 30");
    /* reserved block type */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 3, 2); bw_flush(&w); bw_put(&w, 0, 32);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "reserved block type"), "block type 3");
    /* stored: LEN/NLEN mismatch; LEN beyond the input; a good one split in two blocks */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 0, 2); bw_flush(&w);
    bw_put(&w, 1, 16); bw_put(&w, 0, 16); bw_bytes(&w, one, 1);
    CHECK(err_is(gunzip_bw(&w, "\x05"), MGPU_ERROR_BAD_FILE, "hand.gz", "one's complement"), "stored LEN/NLEN");
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 0, 2); bw_flush(&w);
    bw_put(&w, 100, 16); bw_put(&w, 100 ^ 0xFFFF, 16); bw_bytes(&w, "abc", 3);
    CHECK(err_is(gunzip_bw(&w, "abc"), MGPU_ERROR_BAD_FILE, "hand.gz", "stored block claims 100 bytes"), "stored too long");
    memset(&w, 0, sizeof w);
    bw_put(&w, 0, 1); bw_put(&w, 0, 2); bw_flush(&w);
    bw_put(&w, 3, 16); bw_put(&w, 3 ^ 0xFFFF, 16); bw_bytes(&w, "abc", 3);
    bw_put(&w, 0, 1); bw_put(&w, 1, 2); fixed_lit(&w, 'd'); fixed_lit(&w, 256); /* fixed block in between */
    bw_put(&w, 1, 1); bw_put(&w, 0, 2); bw_flush(&w);
    bw_put(&w, 0, 16); bw_put(&w, 0xFFFF, 16); /* empty final stored block */
    CHECK(gunzip_bw(&w, "abcd") == MGPU_OK, "stored + fixed + empty stored blocks");
    /* dynamic: oversubscribed code-length code (19 codes of length 1) */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 0, 5); bw_put(&w, 15, 4);
    for (i = 0; i < 19; ++i) bw_put(&w, 1, 3);
    bw_put(&w, 0, 32); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "oversubscribed code-length"), "oversubscribed cl code");
    /* dynamic: repeat (16) first. cl codes: 16 -> len 1, 0 -> len 1; so 0 = '0', 16 = '1' */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 0, 5); bw_put(&w, 0, 4); /* HCLEN 4: 16,17,18,0 */
    bw_put(&w, 1, 3); bw_put(&w, 0, 3); bw_put(&w, 0, 3); bw_put(&w, 1, 3);
    bw_huff(&w, 1, 1); bw_put(&w, 0, 2); bw_put(&w, 0, 32); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "no previous length"), "repeat first");
    /* dynamic: all lengths zero (no end-of-block code); cl codes 8 = '0', 18 = '1' */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 0, 5); bw_put(&w, 1, 4); /* HCLEN 5: 16,17,18,0,8 */
    bw_put(&w, 0, 3); bw_put(&w, 0, 3); bw_put(&w, 1, 3); bw_put(&w, 0, 3); bw_put(&w, 1, 3);
    bw_huff(&w, 1, 1); bw_put(&w, 127, 7); bw_huff(&w, 1, 1); bw_put(&w, 109, 7); /* 138 + 120 zeros */
    bw_put(&w, 0, 32); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "no end-of-block"), "no end-of-block code");
    /* dynamic: code lengths overflow (138 + 138 > 258) */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 0, 5); bw_put(&w, 1, 4);
    bw_put(&w, 0, 3); bw_put(&w, 0, 3); bw_put(&w, 1, 3); bw_put(&w, 0, 3); bw_put(&w, 1, 3);
    bw_huff(&w, 1, 1); bw_put(&w, 127, 7); bw_huff(&w, 1, 1); bw_put(&w, 127, 7);
    bw_put(&w, 0, 32); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "overflow"), "code lengths overflow");
    /* dynamic: oversubscribed literal/length code. HLIT 259, HDIST 1; cl codes (all length 2):
       0 = 00, 1 = 01, 16 = 10, 18 = 11. Lengths: 256 zeros, then 1 and 3 repeats -> 4 ones. */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 2, 5); bw_put(&w, 0, 5); bw_put(&w, 14, 4); /* HCLEN 18 */
    {
        static const int order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
        for (i = 0; i < 18; ++i) {
            int s = order[i];
            bw_put(&w, (s == 0 || s == 1 || s == 16 || s == 18) ? 2u : 0u, 3);
        }
    }
    bw_huff(&w, 3, 2); bw_put(&w, 127, 7); bw_huff(&w, 3, 2); bw_put(&w, 107, 7); /* 138 + 118 zeros */
    bw_huff(&w, 1, 2); bw_huff(&w, 2, 2); bw_put(&w, 0, 2);                       /* 1, repeat x3 */
    bw_put(&w, 0, 32); bw_flush(&w);
    CHECK(err_is(gunzip_bw(&w, ""), MGPU_ERROR_BAD_FILE, "hand.gz", "oversubscribed literal/length"), "oversubscribed lit code");
    /* dynamic: an incomplete distance code (one code, of 2 bits) that the data never uses. zlib
       refuses it (only a single 1-bit code may be incomplete), so mgpu does too: the two agree
       on every stream (tests/fuzz/fuzz_inflate found them disagreeing). HLIT 257, HDIST 2,
       cl codes 0 = 00, 1 = 01, 2 = 10, 18 = 11; literal 'a' and 256 of 1 bit, distances 2, 0. */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 1, 5); bw_put(&w, 14, 4); /* HCLEN 18 */
    {
        static const int order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
        for (i = 0; i < 18; ++i) {
            int s = order[i];
            bw_put(&w, (s == 0 || s == 1 || s == 2 || s == 18) ? 2u : 0u, 3);
        }
    }
    bw_huff(&w, 3, 2); bw_put(&w, 86, 7);                                           /* 97 zeros */
    bw_huff(&w, 1, 2);                                                              /* 'a': 1 */
    bw_huff(&w, 3, 2); bw_put(&w, 127, 7); bw_huff(&w, 3, 2); bw_put(&w, 9, 7);     /* 158 zeros */
    bw_huff(&w, 1, 2);                                                              /* 256: 1 */
    bw_huff(&w, 2, 2); bw_huff(&w, 0, 2);                                           /* distances 2, 0 */
    bw_huff(&w, 0, 1); bw_huff(&w, 1, 1); bw_flush(&w);                             /* 'a', end */
    CHECK(err_is(gunzip_bw(&w, "a"), MGPU_ERROR_BAD_FILE, "hand.gz", "incomplete"), "incomplete distance code refused, as zlib does");
    /* the same with a single 1-bit distance code: zlib accepts that, and so does mgpu */
    memset(&w, 0, sizeof w);
    bw_put(&w, 1, 1); bw_put(&w, 2, 2);
    bw_put(&w, 0, 5); bw_put(&w, 1, 5); bw_put(&w, 14, 4);
    {
        static const int order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
        for (i = 0; i < 18; ++i) {
            int s = order[i];
            bw_put(&w, (s == 0 || s == 1 || s == 2 || s == 18) ? 2u : 0u, 3);
        }
    }
    bw_huff(&w, 3, 2); bw_put(&w, 86, 7); bw_huff(&w, 1, 2);
    bw_huff(&w, 3, 2); bw_put(&w, 127, 7); bw_huff(&w, 3, 2); bw_put(&w, 9, 7); bw_huff(&w, 1, 2);
    bw_huff(&w, 1, 2); bw_huff(&w, 0, 2);                                           /* distances 1, 0 */
    bw_huff(&w, 0, 1); bw_huff(&w, 1, 1); bw_flush(&w);
    CHECK(gunzip_bw(&w, "a") == MGPU_OK, "a single 1-bit distance code is accepted, as zlib does");
}

static void test_gzip_header_and_trailer(const uint8_t* data, size_t n, const uint8_t* gz, size_t gz_n) {
    uint8_t* buf = (uint8_t*)malloc(2 * gz_n + 64);
    uint8_t* out = NULL;
    size_t out_n;
    mgpu_result rc;
    /* CRC and ISIZE damage */
    memcpy(buf, gz, gz_n);
    buf[gz_n - 8] ^= 1;
    rc = mgpu__gunzip(buf, gz_n, "crc.gz", &out, &out_n);
    CHECK(err_is(rc, MGPU_ERROR_BAD_FILE, "crc.gz", "CRC-32 mismatch") && out == NULL, "bad CRC");
    memcpy(buf, gz, gz_n);
    buf[gz_n - 3] ^= 1;
    rc = mgpu__gunzip(buf, gz_n, "isize.gz", &out, &out_n);
    CHECK(err_is(rc, MGPU_ERROR_BAD_FILE, "isize.gz", "length mismatch"), "bad ISIZE");
    memcpy(buf, gz, gz_n);
    buf[2] = 7;
    CHECK(err_is(mgpu__gunzip(buf, gz_n, "cm.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "cm.gz", "compression method 7"), "CM");
    memcpy(buf, gz, gz_n);
    buf[3] |= 0x40;
    CHECK(err_is(mgpu__gunzip(buf, gz_n, "flg.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "flg.gz", "reserved header flags"), "FLG");
    /* trailing data */
    memcpy(buf, gz, gz_n);
    memcpy(buf + gz_n, "xyz", 3);
    CHECK(err_is(mgpu__gunzip(buf, gz_n + 3, "tail.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "tail.gz", "trailing garbage"), "garbage");
    memset(buf + gz_n, 0, 40);
    CHECK(roundtrip(buf, gz_n + 40, data, n), "zero padding after the member is tolerated");
    /* two members */
    memcpy(buf + gz_n, gz, gz_n);
    rc = mgpu__gunzip(buf, 2 * gz_n, "two.gz", &out, &out_n);
    CHECK(rc == MGPU_OK && out_n == 2 * n && !memcmp(out, data, n) && !memcmp(out + n, data, n), "two members concatenate");
    free(out);
    out = NULL;
    free(buf);
}

/* every cut point fails cleanly; random bit flips either fail or give back the original */
static void test_gzip_damage(const char* what, const uint8_t* data, size_t n, const uint8_t* gz, size_t gz_n, int flips) {
    uint8_t* buf = (uint8_t*)malloc(gz_n);
    uint8_t* out = NULL;
    size_t cut, out_n, bad_ok = 0, wrong = 0, crc_errors = 0, errors = 0;
    int i;
    for (cut = 2; cut < gz_n; ++cut) {
        mgpu_result rc = mgpu__gunzip(gz, cut, "cut.gz", &out, &out_n);
        if (!err_is(rc, MGPU_ERROR_BAD_FILE, "cut.gz", NULL) || out != NULL) {
            if (bad_ok++ < 3) printf("   %s: cut at %zu of %zu: rc %d: %s\n", what, cut, gz_n, (int)rc, mgpu__test_error_text);
        }
        free(out);
        out = NULL;
    }
    CHECK(bad_ok == 0, "%s: %zu of %zu truncations were not reported as BAD_FILE", what, bad_ok, gz_n - 2);
    for (i = 0; i < flips; ++i) {
        mgpu_result rc;
        size_t pos = 2 + rnd() % (gz_n - 2);
        memcpy(buf, gz, gz_n);
        buf[pos] ^= (uint8_t)(1u << (rnd() % 8));
        if (rnd() % 4 == 0) buf[2 + rnd() % (gz_n - 2)] ^= (uint8_t)(1u << (rnd() % 8));
        rc = mgpu__gunzip(buf, gz_n, "flip.gz", &out, &out_n);
        if (rc == MGPU_OK) {
            if (out_n != n || memcmp(out, data, n)) wrong++;
        } else if (rc != MGPU_ERROR_BAD_FILE || out != NULL) {
            wrong++;
        } else {
            errors++;
            if (strstr(mgpu__test_error_text, "CRC-32")) crc_errors++;
        }
        free(out);
        out = NULL;
    }
    CHECK(wrong == 0, "%s: %zu of %d bit flips decoded to wrong data or a wrong code", what, wrong, flips);
    printf("   %s: %zu truncations, %d bit flips: %zu errors (%zu CRC)\n", what, gz_n - 2, flips, errors, crc_errors);
    free(buf);
}

static void test_gzip(void) {
    static const size_t sizes[] = {0, 1, 2, 100, 1000, 65535, 65536, 70000, 1 << 20};
    uint8_t *gz, *out = NULL, *data;
    size_t gz_n, out_n, i;
    int kind;
    mgpu_result rc;

    /* pass-through of non-gzip data, and empty input */
    rc = mgpu__gunzip((const uint8_t*)"\x00\x00\x08\x01", 4, "plain", &out, &out_n);
    CHECK(rc == MGPU_OK && out_n == 4 && !memcmp(out, "\x00\x00\x08\x01", 4), "non-gzip input is copied");
    free(out);
    out = NULL;
    rc = mgpu__gunzip(NULL, 0, "empty", &out, &out_n);
    CHECK(rc == MGPU_OK && out != NULL && out_n == 0, "empty input");
    free(out);
    out = NULL;
    rc = mgpu__gunzip((const uint8_t*)"\x1f\x8b", 2, "magic-only.gz", &out, &out_n);
    CHECK(err_is(rc, MGPU_ERROR_BAD_FILE, "magic-only.gz", "truncated"), "magic only");

    test_gzip_handmade();

    /* gzip command line: levels 1 and 9, an empty file, stored name */
#ifdef _WIN32
    SKIP("gzip command line round trips (levels 1 and 9, an empty file, a stored name), and an empty member before "
         "1 MiB of zeros: Windows has no gzip command");
    (void)sizes; (void)i; (void)kind;   /* used by the zlib tests below, when linked */
#else
    {
        int ok = 1, cases = 0;
        for (kind = 0; kind < 5; ++kind) {
            for (i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
                static const char* levels[2] = {"-1", "-9"};
                int l;
                data = make_data(kind, sizes[i]);
                for (l = 0; l < 2; ++l) {
                    gz = cli_gzip(data, sizes[i], levels[l], &gz_n);
                    if (!gz) { ok = 0; printf("   gzip command failed\n"); continue; }
                    if (!roundtrip(gz, gz_n, data, sizes[i])) { ok = 0; printf("   gzip %s kind %d size %zu\n", levels[l], kind, sizes[i]); }
                    cases++;
                    free(gz);
                }
                free(data);
            }
        }
        CHECK(ok, "gzip command line round trips");
        printf("   gzip -1/-9 round trips: %d cases (incl. empty file, FNAME header)\n", cases);
    }
    /* two members, the first empty (cat empty.gz zeros.gz): the output buffer is sized from the
       last member's length only when that is at most 256 times the input, which 1 MiB of zeros
       is not, so it is still NULL when the empty member's CRC is checked (clang's UBSan: no
       arithmetic on a NULL pointer, not even + 0) */
    {
        const size_t zeros_n = (size_t)1 << 20;
        size_t empty_n = 0, rest_n = 0;
        uint8_t* zeros = (uint8_t*)calloc(zeros_n, 1);
        uint8_t* empty = cli_gzip((const uint8_t*)"", 0, "-9", &empty_n);
        uint8_t* rest = zeros ? cli_gzip(zeros, zeros_n, "-9", &rest_n) : NULL;
        uint8_t* both = empty && rest ? (uint8_t*)malloc(empty_n + rest_n) : NULL;
        CHECK(both != NULL, "gzip command for an empty member and 1 MiB of zeros");
        if (both) {
            CHECK(rest_n * 256 < zeros_n, "1 MiB of zeros gzips to %zu bytes, too many for this case", rest_n);
            memcpy(both, empty, empty_n);
            memcpy(both + empty_n, rest, rest_n);
            CHECK(roundtrip(both, empty_n + rest_n, zeros, zeros_n), "two gzip members, the first empty");
        }
        free(zeros); free(empty); free(rest); free(both);
    }
#endif

#ifdef HAVE_ZLIB
    {
        static const int levels[4] = {0, 1, 6, 9};
        static const int strategies[5] = {Z_DEFAULT_STRATEGY, Z_FILTERED, Z_HUFFMAN_ONLY, Z_RLE, Z_FIXED};
        int ok = 1, cases = 0, l, s;
        gz_header h;
        for (kind = 0; kind < 5; ++kind)
            for (i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
                data = make_data(kind, sizes[i]);
                for (l = 0; l < 4; ++l)
                    for (s = 0; s < 5; ++s) {
                        if (levels[l] == 0 && s > 0) continue;
                        gz = zlib_gzip(data, sizes[i], levels[l], strategies[s], NULL, &gz_n);
                        if (!gz || !roundtrip(gz, gz_n, data, sizes[i])) {
                            ok = 0;
                            printf("   zlib level %d strategy %d kind %d size %zu\n", levels[l], s, kind, sizes[i]);
                        }
                        cases++;
                        free(gz);
                    }
                free(data);
            }
        CHECK(ok, "zlib round trips (levels 0,1,6,9 x 5 strategies x 5 data kinds x 9 sizes)");
        printf("   zlib round trips: %d cases\n", cases);

        /* every optional header field: FEXTRA, FNAME, FCOMMENT, FHCRC */
        memset(&h, 0, sizeof h);
        h.extra = (Bytef*)"XYabcd";
        h.extra_len = 6;
        h.name = (Bytef*)"file.bin";
        h.comment = (Bytef*)"a comment";
        h.hcrc = 1;
        data = make_data(2, 5000);
        gz = zlib_gzip(data, 5000, 9, Z_DEFAULT_STRATEGY, &h, &gz_n);
        CHECK(gz && gz[3] == (2 | 4 | 8 | 16), "zlib wrote every header flag");
        CHECK(gz && roundtrip(gz, gz_n, data, 5000), "header with FEXTRA/FNAME/FCOMMENT/FHCRC");
        if (gz) {
            uint8_t* bad = (uint8_t*)malloc(gz_n);
            size_t hcrc_pos = 10 + 2 + 6 + 9 + 10; /* fixed, XLEN, extra, name\0, comment\0 */
            memcpy(bad, gz, gz_n);
            bad[hcrc_pos] ^= 0x10;
            CHECK(err_is(mgpu__gunzip(bad, gz_n, "hcrc.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "hcrc.gz", "header CRC"), "FHCRC mismatch");
            test_gzip_damage("all-flags header + dynamic", data, 5000, gz, gz_n, 3000);
            test_gzip_header_and_trailer(data, 5000, gz, gz_n);
            free(bad);
        }
        free(gz);
        /* stored blocks (level 0): a flipped data bit is caught by the CRC */
        gz = zlib_gzip(data, 3000, 0, Z_DEFAULT_STRATEGY, NULL, &gz_n);
        if (gz) {
            uint8_t* bad = (uint8_t*)malloc(gz_n);
            memcpy(bad, gz, gz_n);
            bad[10 + 5 + 1000] ^= 0x04;
            CHECK(err_is(mgpu__gunzip(bad, gz_n, "stored.gz", &out, &out_n), MGPU_ERROR_BAD_FILE, "stored.gz", "CRC-32 mismatch"),
                  "bit flip in a stored block is a CRC error");
            test_gzip_damage("stored blocks", data, 3000, gz, gz_n, 2000);
            free(bad);
        }
        free(gz);
        gz = zlib_gzip(data, 3000, 1, Z_FIXED, NULL, &gz_n);
        if (gz) test_gzip_damage("fixed blocks", data, 3000, gz, gz_n, 2000);
        free(gz);
        free(data);
    }
#else
    SKIP("zlib not linked: zlib round trips and header-flag tests; the damage tests use the gzip command instead "
         "(or, without one, Fashion-MNIST's t10k labels)");
    data = make_data(2, 5000);
    gz = cli_gzip(data, 5000, "-9", &gz_n);
    if (gz) {
        test_gzip_damage("gzip -9", data, 5000, gz, gz_n, 3000);
        test_gzip_header_and_trailer(data, 5000, gz, gz_n);
    } else {
        /* no gzip command either (Windows): a file gzip -9 wrote, Fashion-MNIST's test labels,
           its contents as the decoder gives them (it checks their CRC-32 and length) */
        char path[512];
        free(data);
        data = NULL;
        snprintf(path, sizeof path, "%s/t10k-labels-idx1-ubyte.gz", MNIST_DIR);
        gz = read_file(path, &gz_n);
        if (gz && mgpu__gunzip(gz, gz_n, path, &data, &out_n) == MGPU_OK) {
            test_gzip_damage("gzip -9 (t10k labels)", data, out_n, gz, gz_n, 3000);
            test_gzip_header_and_trailer(data, out_n, gz, gz_n);
        } else if (gz) {
            CHECK(0, "%s does not decode", path);
        } else {
            SKIP("gzip damage, header and trailer tests: no zlib, no gzip command and no %s", path);
        }
    }
    free(gz);
    free(data);
#endif
}

/* random DEFLATE bodies behind a valid header: must fail cleanly (or, rarely, decode) */
static void test_gzip_random_bodies(int iters) {
    uint8_t file[600], *out = NULL;
    size_t out_n;
    int i, odd = 0, ok = 0, types[4] = {0, 0, 0, 0};
    static const uint8_t hdr[10] = {0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 3};
    for (i = 0; i < iters; ++i) {
        size_t n = 10 + 1 + rnd() % 500, k;
        mgpu_result rc;
        memcpy(file, hdr, 10);
        for (k = 10; k < n; ++k) file[k] = (uint8_t)rnd();
        if (rnd() % 2) file[10] = (uint8_t)((file[10] & ~6) | 4); /* favour dynamic blocks */
        types[(file[10] >> 1) & 3]++;
        rc = mgpu__gunzip(file, n, "random.gz", &out, &out_n);
        if (rc == MGPU_OK) ok++;
        else if (rc != MGPU_ERROR_BAD_FILE || out != NULL || !strstr(mgpu__test_error_text, "random.gz")) odd++;
        free(out);
        out = NULL;
    }
    CHECK(odd == 0, "random DEFLATE bodies: %d gave a wrong error code", odd);
    printf("   %d random DEFLATE bodies (stored %d, fixed %d, dynamic %d, reserved %d): %d decoded\n", iters, types[0], types[1],
           types[2], types[3], ok);
}

static void test_mnist(void) {
    static const char* files[4] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                                   "t10k-labels-idx1-ubyte.gz"};
    static const int64_t n0[4] = {60000, 60000, 10000, 10000};
    int i;
    for (i = 0; i < 4; ++i) {
        char path[512], cmd[600];
        uint8_t *gz, *out = NULL, *ref;
        size_t gz_n, out_n = 0, ref_n;
        double t0, t1;
        mgpu_result rc;
        mgpu__idx idx;
        snprintf(path, sizeof path, "%s/%s", MNIST_DIR, files[i]);
        gz = read_file(path, &gz_n);
        if (!gz) { SKIP("%s not present", path); continue; }
        t0 = now_s();
        rc = mgpu__gunzip(gz, gz_n, files[i], &out, &out_n);
        t1 = now_s();
        if (rc == MGPU_OK && i == 0) { /* the big one: best of 3 more (the first pays for page faults) */
            int rep;
            for (rep = 0; rep < 3; ++rep) {
                uint8_t* again = NULL;
                size_t again_n;
                double a = now_s(), b;
                if (mgpu__gunzip(gz, gz_n, files[i], &again, &again_n) != MGPU_OK) break;
                b = now_s();
                free(again);
                if (b - a < t1 - t0) { t0 = a; t1 = b; }
            }
        }
        snprintf(cmd, sizeof cmd, "zcat '%s'", path);
        ref = run_capture(cmd, &ref_n);
#ifdef _WIN32
        if (!ref) {   /* no zcat on Windows: the decoder's own CRC-32 and length checks stand */
            CHECK(rc == MGPU_OK, "%s decodes: %s", files[i], mgpu__test_error_text);
            SKIP("%s against zcat: Windows has no zcat (the decoder checked the CRC-32 and length)", files[i]);
        } else
#endif
        CHECK(rc == MGPU_OK && ref && out_n == ref_n && !memcmp(out, ref, ref_n), "%s matches zcat", files[i]);
        printf("   %s: %zu -> %zu bytes in %.1f ms%s (%.0f MB/s of output)\n", files[i], gz_n, out_n, 1e3 * (t1 - t0), i == 0 ? " (best of 4)" : "",
               (double)out_n / 1e6 / (t1 - t0));
        rc = mgpu__idx_parse(out, out_n, files[i], &idx);
        CHECK(rc == MGPU_OK && idx.dims[0] == n0[i] && idx.ndim == (i % 2 ? 1 : 3) &&
                  (i % 2 || (idx.dims[1] == 28 && idx.dims[2] == 28)),
              "%s parses as IDX", files[i]);
        free(gz);
        free(out);
        free(ref);
    }
}

/* ----------------------------------------------------------------------------------- IDX --- */
static size_t make_idx(uint8_t* buf, int type, int ndim, const uint32_t* dims, size_t data_bytes) {
    size_t n = 4, i;
    int d;
    buf[0] = 0; buf[1] = 0; buf[2] = (uint8_t)type; buf[3] = (uint8_t)ndim;
    for (d = 0; d < ndim; ++d) {
        buf[n++] = (uint8_t)(dims[d] >> 24); buf[n++] = (uint8_t)(dims[d] >> 16);
        buf[n++] = (uint8_t)(dims[d] >> 8); buf[n++] = (uint8_t)dims[d];
    }
    for (i = 0; i < data_bytes; ++i) buf[n++] = (uint8_t)i;
    return n;
}

static void test_idx(void) {
    static uint8_t buf[4096];
    uint32_t dims[5] = {3, 4, 5, 1, 2};
    uint32_t big[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
    mgpu__idx idx;
    size_t n;
    mgpu_result rc;
    int i;
    n = make_idx(buf, 8, 3, dims, 60);
    rc = mgpu__idx_parse(buf, n, "good.idx", &idx);
    CHECK(rc == MGPU_OK && idx.type == 8 && idx.ndim == 3 && idx.dims[0] == 3 && idx.dims[1] == 4 && idx.dims[2] == 5 &&
              idx.data == buf + 16 && idx.data_bytes == 60 && idx.data[59] == 59,
          "good 3-d IDX");
    n = make_idx(buf, 8, 1, dims, 3);
    CHECK(mgpu__idx_parse(buf, n, "labels.idx", &idx) == MGPU_OK && idx.ndim == 1 && idx.data_bytes == 3, "good 1-d IDX");
    n = make_idx(buf, 8, 4, dims, 60);
    CHECK(mgpu__idx_parse(buf, n, "four.idx", &idx) == MGPU_OK && idx.ndim == 4, "good 4-d IDX");

    CHECK(err_is(mgpu__idx_parse(buf, 3, "short.idx", &idx), MGPU_ERROR_BAD_FILE, "short.idx", "too short"), "short");
    n = make_idx(buf, 8, 3, dims, 60);
    buf[1] = 1;
    CHECK(err_is(mgpu__idx_parse(buf, n, "magic.idx", &idx), MGPU_ERROR_BAD_FILE, "magic.idx", "not an IDX file"), "magic");
    n = make_idx(buf, 0x0D, 3, dims, 240);
    CHECK(err_is(mgpu__idx_parse(buf, n, "f32.idx", &idx), MGPU_ERROR_UNSUPPORTED, "f32.idx", "0x0D (float32) is not supported"), "f32");
    n = make_idx(buf, 0x09, 3, dims, 60);
    CHECK(err_is(mgpu__idx_parse(buf, n, "i8.idx", &idx), MGPU_ERROR_UNSUPPORTED, "i8.idx", "0x09"), "i8");
    n = make_idx(buf, 0x07, 3, dims, 60);
    CHECK(err_is(mgpu__idx_parse(buf, n, "t7.idx", &idx), MGPU_ERROR_BAD_FILE, "t7.idx", "unknown IDX element type 0x07"), "type 7");
    n = make_idx(buf, 8, 0, dims, 0);
    CHECK(err_is(mgpu__idx_parse(buf, n, "d0.idx", &idx), MGPU_ERROR_BAD_FILE, "d0.idx", "0 dimensions"), "ndim 0");
    n = make_idx(buf, 8, 5, dims, 120);
    CHECK(err_is(mgpu__idx_parse(buf, n, "d5.idx", &idx), MGPU_ERROR_UNSUPPORTED, "d5.idx", "5 dimensions"), "ndim 5");
    n = make_idx(buf, 8, 3, dims, 0);
    CHECK(err_is(mgpu__idx_parse(buf, 10, "hdr.idx", &idx), MGPU_ERROR_BAD_FILE, "hdr.idx", "header is truncated"), "header cut");
    dims[1] = 0;
    n = make_idx(buf, 8, 3, dims, 0);
    CHECK(err_is(mgpu__idx_parse(buf, n, "zero.idx", &idx), MGPU_ERROR_BAD_FILE, "zero.idx", "dimension 1 is zero"), "zero dim");
    dims[1] = 4;
    n = make_idx(buf, 8, 3, dims, 59);
    CHECK(err_is(mgpu__idx_parse(buf, n, "cut.idx", &idx), MGPU_ERROR_BAD_FILE,
                 "cut.idx: IDX header promises 60 bytes of data but the file holds 59", "truncated"),
          "truncated data");
    n = make_idx(buf, 8, 3, dims, 61);
    CHECK(err_is(mgpu__idx_parse(buf, n, "long.idx", &idx), MGPU_ERROR_BAD_FILE, "promises 60 bytes", "trailing garbage"), "extra data");
    n = make_idx(buf, 8, 4, big, 10);
    CHECK(err_is(mgpu__idx_parse(buf, n, "big.idx", &idx), MGPU_ERROR_BAD_FILE, "big.idx", "overflow"), "overflowing dims");
    /* the message from the brief */
    {
        uint32_t mn[3] = {60000, 28, 28};
        n = make_idx(buf, 8, 3, mn, 1000);
        CHECK(err_is(mgpu__idx_parse(buf, n, "train-images-idx3-ubyte.gz", &idx), MGPU_ERROR_BAD_FILE,
                     "train-images-idx3-ubyte.gz: IDX header promises 47040000 bytes of data but the file holds 1000", NULL),
              "MNIST-style message");
    }
    /* mutation fuzz */
    {
        uint8_t m[64];
        int crashes_impossible = 1;
        uint32_t d2[2] = {2, 3};
        size_t base = make_idx(buf, 8, 2, d2, 6);
        for (i = 0; i < 20000; ++i) {
            size_t len = base - (rnd() % 3 == 0 ? rnd() % base : 0);
            memcpy(m, buf, base);
            m[rnd() % base] = (uint8_t)rnd();
            if (mgpu__idx_parse(m, len, "fuzz.idx", &idx) == MGPU_OK)
                crashes_impossible &= (idx.data + idx.data_bytes == m + len);
        }
        CHECK(crashes_impossible, "IDX fuzz: accepted files always end exactly at their data");
    }
}

/* ---------------------------------------------------------------------------- safetensors --- */
/* builds a safetensors file: header json (unpadded) and buf_len bytes of byte buffer */
static uint8_t* mk_st(const char* json, size_t buf_len, size_t* n) {
    size_t h = strlen(json), i;
    uint8_t* p = (uint8_t*)malloc(8 + h + buf_len + 1);
    for (i = 0; i < 8; ++i) p[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(p + 8, json, h);
    for (i = 0; i < buf_len; ++i) p[8 + h + i] = (uint8_t)i;
    *n = 8 + h + buf_len;
    return p;
}
static mgpu_result st_try(const char* json, size_t buf_len) {
    size_t n;
    uint8_t* p = mk_st(json, buf_len, &n);
    mgpu__st_file f;
    mgpu_result rc = mgpu__st_parse(p, n, "bad.safetensors", &f);
    if (rc != MGPU_OK) {
        if (f.tensors || f.meta || f.count) rc = (mgpu_result)98; /* must be zeroed */
    }
    mgpu__st_free(&f);
    free(p);
    return rc;
}
#define ST_BAD(json, buf_len, code, s1, s2) \
    CHECK(err_is(st_try(json, buf_len), code, s1, s2), "rejects %s", json)


static void test_st_malformed(void) {
    char big[2048];
    uint8_t* p;
    size_t n;
    mgpu__st_file f;
    int i, k;
    /* framing */
    p = mk_st("{}", 0, &n);
    CHECK(err_is(mgpu__st_parse(p, 7, "tiny.safetensors", &f), MGPU_ERROR_BAD_FILE, "tiny.safetensors", "too short"), "< 8 bytes");
    p[0] = 200;
    CHECK(err_is(mgpu__st_parse(p, n, "hlen.safetensors", &f), MGPU_ERROR_BAD_FILE, "hlen.safetensors", "larger than the rest of the file"),
          "header longer than file");
    p[0] = 0; p[1] = 0; p[2] = 0; p[3] = 0x10; /* 256 MiB */
    CHECK(err_is(mgpu__st_parse(p, n, "huge.safetensors", &f), MGPU_ERROR_BAD_FILE, "huge.safetensors", "100 MB"), "header > 100 MB");
    p[0] = 2; p[3] = 0; p[7] = 0x80;
    CHECK(err_is(mgpu__st_parse(p, n, "neg.safetensors", &f), MGPU_ERROR_BAD_FILE, "neg.safetensors", "100 MB"), "header length 2^63");
    free(p);
    /* JSON syntax */
    ST_BAD("", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "not valid JSON");
    ST_BAD("   ", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "empty");
    ST_BAD("{", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected a string");
    ST_BAD("{\"a\":}", 0, MGPU_ERROR_BAD_FILE, "tensor 'a'", "not a JSON object");
    ST_BAD("{\"a\" 1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected ':'");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",}}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected a string");
    ST_BAD("{\"t\":{\"dtype\":\"F32\" \"shape\":[]}}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected ',' or '}'");
    ST_BAD("{\"t\":{\"dtype\":\"F\\x32\"}}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "bad escape");
    ST_BAD("{\"t\\u12\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "bad \\u escape");
    ST_BAD("{\"t\\ud800x\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "surrogate");
    ST_BAD("{\"t\\udc00\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "surrogate");
    ST_BAD("{\"t\x01\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "control character");
    ST_BAD("{\"t\xff\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "invalid UTF-8");
    ST_BAD("{\"t\xc0\xaf\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "invalid UTF-8");
    ST_BAD("{\"t\xed\xa0\x80\":1}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "invalid UTF-8");
    ST_BAD("{\"t\":{\"x\":01,\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected ',' or '}'");
    ST_BAD("{\"t\":{\"x\":1.,\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "bad number");
    ST_BAD("{\"t\":{\"x\":tru,\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected a value");
    ST_BAD("{\"t\":{\"x\":[1,],\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "expected a value");
    ST_BAD("{\"t\":{\"x\":\"abc", 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "unterminated string");
    ST_BAD("{} x", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "trailing characters");
    ST_BAD("{}{}", 0, MGPU_ERROR_BAD_FILE, "not valid JSON", "trailing characters");
    {   /* NUL padding is not whitespace */
        static const char hdr[16] = {'{', '}', 0, 0, 0, 0, 0, 0};
        uint8_t file[24];
        memset(file, 0, 8);
        file[0] = 8;
        memcpy(file + 8, hdr, 8);
        CHECK(err_is(mgpu__st_parse(file, 16, "nul.safetensors", &f), MGPU_ERROR_BAD_FILE, "nul.safetensors", "trailing characters"),
              "NUL padding");
    }
    /* depth bomb inside an ignored key: serde_json refuses 128 levels, and so does mgpu */
    strcpy(big, "{\"t\":{\"x\":");
    for (i = 0; i < 200; ++i) strcat(big, "[");
    for (i = 0; i < 200; ++i) strcat(big, "]");
    strcat(big, ",\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}");
    ST_BAD(big, 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "nested too deeply");
    strcpy(big, "{\"t\":{\"x\":");   /* 2 + 80 levels: the reference reads it */
    for (i = 0; i < 40; ++i) strcat(big, "[{\"k\":");
    strcat(big, "1");
    for (i = 0; i < 40; ++i) strcat(big, "}]");
    strcat(big, ",\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}");
    CHECK(st_try(big, 1) == MGPU_OK, "82 levels of nesting in an unknown field");
    for (k = 125; k <= 126; ++k) {   /* the reference's exact limit: 2 + 125 levels read, 2 + 126 refused */
        strcpy(big, "{\"t\":{\"x\":");
        for (i = 0; i < k; ++i) strcat(big, "[");
        for (i = 0; i < k; ++i) strcat(big, "]");
        strcat(big, ",\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}");
        if (k == 125) CHECK(st_try(big, 1) == MGPU_OK, "125 nested arrays in an unknown field, as serde_json reads them");
        else ST_BAD(big, 1, MGPU_ERROR_BAD_FILE, "not valid JSON", "nested too deeply");
    }
    /* structure */
    ST_BAD("[1,2]", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "not a JSON object");
    ST_BAD("\"x\"", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "not a JSON object");
    ST_BAD("{\"t\":5}", 0, MGPU_ERROR_BAD_FILE, "tensor 't'", "not a JSON object");
    ST_BAD("{\"t\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "no \"dtype\"");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "no \"shape\"");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "no \"data_offsets\"");
    ST_BAD("{\"t\":{}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "no \"dtype\"");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "duplicate \"dtype\"");
    ST_BAD("{\"t\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "dtype is not a string");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "shape is not an array");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{}}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "data_offsets is not an array");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "must hold 2 entries");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,9]}}", 9, MGPU_ERROR_BAD_FILE, "tensor 't'", "more than 2 entries");
    ST_BAD("{\"t\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "unknown dtype 'F33'");
    ST_BAD("{\"t\":{\"dtype\":\"F32\\u0000\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "unknown dtype");
    ST_BAD("{\"t\":{\"dtype\":\"FLOAT32_WITH_A_LONG_NAME\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "unknown dtype");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "shape entry 0 is negative");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[1,2.0],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "shape entry 1 is not an integer");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "not an integer");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "not a number");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "leading zero");
    ST_BAD("{\"t\":{\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,8]}}", 8, MGPU_ERROR_BAD_FILE, "tensor 't'", "overflows 64 bits");
    ST_BAD("{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, MGPU_ERROR_UNSUPPORTED, "bad.safetensors", "NUL");
    ST_BAD("{\"__metadata__\":[]}", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "\"__metadata__\" is not a JSON object");
    ST_BAD("{\"__metadata__\":{\"k\":5}}", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "value of 'k' is not a string");
    ST_BAD("{\"__metadata__\":{},\"__metadata__\":{}}", 0, MGPU_ERROR_BAD_FILE, "bad.safetensors", "duplicate \"__metadata__\"");
    /* a long key inside an entry grows the string arena under the tensor's name (which the fuzzer
       found read after the move; the sanitizer build sees it) */
    strcpy(big, "{\"t\":{\"");
    for (i = 0; i < 600; ++i) strcat(big, "x");
    strcat(big, "\":1,\"shape\":[1]}}");
    ST_BAD(big, 0, MGPU_ERROR_BAD_FILE, "tensor 't'", "no \"dtype\"");
}

#include "st_rules.h"   /* the reference's rules, each with a file breaking it, and files it accepts */

static void test_st_reference_rules(void) {
    char* big;
    size_t i, n, k;
    for (i = 0; i < sizeof st_rules / sizeof st_rules[0]; ++i) {
        const st_rule* r = &st_rules[i];
        uint8_t* p = mk_st(r->json ? r->json : "{}", r->buf, &n);
        mgpu__st_file f;
        size_t len = n;
        if (!r->json && r->buf == 0) len = 7;                                  /* too small */
        if (!r->json && r->buf == 1) { p[0] = 0x01; p[1] = 0xE1; p[2] = 0xF5; p[3] = 0x05; }   /* 100,000,001 */
        if (!r->json && r->buf == 2) p[0] = 9;                                 /* one past the end */
        CHECK(err_is(mgpu__st_parse(p, len, "rule.safetensors", &f), MGPU_ERROR_BAD_FILE, "rule.safetensors", r->why),
              "rule '%s' (%s)", r->rule, r->source);
        mgpu__st_free(&f);
        free(p);
    }
    for (i = 0; i < sizeof st_accepted / sizeof st_accepted[0]; ++i)
        CHECK(st_try(st_accepted[i].json, st_accepted[i].buf) == MGPU_OK, "the reference opens it, so does mgpu: %s (%s)",
              st_accepted[i].what, mgpu_last_error());
    {   /* the last entry of a repeated name or key is the one kept */
        uint8_t* p = mk_st(st_accepted[8].json, 2, &n);
        mgpu__st_file f;
        CHECK(mgpu__st_parse(p, n, "rep.safetensors", &f) == MGPU_OK && f.count == 1 && f.tensors[0].shape[0] == 2 &&
                  mgpu__st_find(&f, "t") == &f.tensors[0], "a repeated name keeps its last entry");
        mgpu__st_free(&f);
        free(p);
        p = mk_st(st_accepted[9].json, 0, &n);
        CHECK(mgpu__st_parse(p, n, "rep.safetensors", &f) == MGPU_OK && f.meta_count == 1 && !strcmp(mgpu__st_meta_value(&f, "k"), "b"),
              "a repeated metadata key keeps its last value");
        mgpu__st_free(&f);
        free(p);
    }
    /* no limits the format does not have: a 100 kB name, key and value, 10,000 metadata entries */
    big = (char*)malloc(1300000);
    strcpy(big, "{\"__metadata__\":{\"");
    n = strlen(big);
    for (k = 0; k < 100000; ++k) big[n++] = 'k';
    memcpy(big + n, "\":\"", 3); n += 3;
    for (k = 0; k < 100000; ++k) big[n++] = 'v';
    big[n++] = '"';
    for (k = 0; k < 10000; ++k) n += (size_t)sprintf(big + n, ",\"m%zu\":\"x\"", k);
    memcpy(big + n, "},\"", 3); n += 3;
    for (k = 0; k < 100000; ++k) big[n++] = 'n';
    strcpy(big + n, "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}");
    CHECK(st_try(big, 1) == MGPU_OK, "100 kB name, key and value and 10,001 metadata entries (%s)", mgpu_last_error());
    free(big);
}

static void test_st_good_json(void) {
    const char* json =
        " \t\r\n{ \"__metadata__\" : { \"format\" : \"pt\", \"esc\":\"q\\\"b\\\\s\\/n\\nt\\tu\\u00e9\\ud83d\\ude00\" } ,\n"
        "  \"h\\u00e9\" : { \"extra\": {\"x\":[1,-2.5e+3,true,false,null,{}]}, \"data_offsets\" : [ 0 , 8 ] , \"shape\" : [ 2 ] , "
        "\"dtype\" : \"F32\" },"
        "  \"e\" : { \"dtype\" : \"BF16\", \"shape\" : [0, 5], \"data_offsets\" : [ 8 , 8 ] },"
        "  \"s\" : { \"dtype\" : \"F64\", \"shape\" : [], \"data_offsets\" : [ 8 , 16 ] },"
        "  \"z\" : { \"dtype\" : \"U8\", \"shape\" : [0], \"data_offsets\" : [ 16 , 16 ] } }    \n";
    size_t n;
    uint8_t* p = mk_st(json, 16, &n);
    mgpu__st_file f;
    mgpu_result rc = mgpu__st_parse(p, n, "good.safetensors", &f);
    CHECK(rc == MGPU_OK, "whitespace, escapes, unknown keys and any key order");
    if (rc == MGPU_OK) {
        CHECK(f.count == 4 && f.meta_count == 2 && f.data_start == 8 + strlen(json), "counts");
        CHECK(!strcmp(f.meta[1].key, "esc") && !strcmp(f.meta[1].value, "q\"b\\s/n\nt\tu\xc3\xa9\xf0\x9f\x98\x80"), "string escapes");
        CHECK(!strcmp(f.tensors[0].name, "h\xc3\xa9") && !strcmp(f.tensors[0].dtype, "F32") && f.tensors[0].ndim == 1 &&
                  f.tensors[0].shape[0] == 2 && f.tensors[0].begin == 0 && f.tensors[0].end == 8,
              "first tensor");
        CHECK(!strcmp(f.tensors[1].name, "e") && f.tensors[1].ndim == 2 && f.tensors[1].shape[1] == 5 && f.tensors[1].begin == 8, "empty");
        CHECK(!strcmp(f.tensors[2].name, "s") && f.tensors[2].ndim == 0 && f.tensors[2].end == 16, "scalar");
        CHECK(!strcmp(f.tensors[3].name, "z") && f.tensors[3].begin == 16, "zero-size at the end of the buffer");
    }
    mgpu__st_free(&f);
    mgpu__st_free(&f); /* idempotent on a zeroed struct */
    free(p);
    CHECK(st_try("{}", 0) == MGPU_OK, "empty header");
    CHECK(mgpu__st_dtype_size("F64") == 8 && mgpu__st_dtype_size("F32") == 4 && mgpu__st_dtype_size("F16") == 2 &&
              mgpu__st_dtype_size("BF16") == 2 && mgpu__st_dtype_size("I64") == 8 && mgpu__st_dtype_size("I32") == 4 &&
              mgpu__st_dtype_size("I16") == 2 && mgpu__st_dtype_size("I8") == 1 && mgpu__st_dtype_size("U8") == 1 &&
              mgpu__st_dtype_size("BOOL") == 1 && mgpu__st_dtype_size("f32") == 0 && mgpu__st_dtype_size(NULL) == 0,
          "dtype sizes");
}

static int count_tmp_files(const char* dir) {
    DIR* d = opendir(dir);
    struct dirent* e;
    int n = 0;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp")) n++;
    closedir(d);
    return n;
}

/* the test file: the tensors check_c_written.py expects */
static mgpu_result write_known(const char* path) {
    static const float w[6] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 2.5f};
    static const int32_t idx[4] = {-1, 0, 1, 2};
    static const uint8_t mask[3] = {1, 0, 255};
    static const double dd = 3.25;
    static const float seven = 7.0f;
    static const int64_t hl[2] = {1, -2};
    static const int64_t s23[2] = {2, 3}, s4[1] = {4}, s3[1] = {3}, s04[2] = {0, 4}, s1[1] = {1}, s2[1] = {2};
    static const char* keys[2] = {"format", "note"};
    static const char* vals[2] = {"pt", "tab\there \"q\" \xc3\xa9"};
    mgpu__st_write_item it[7];
    memset(it, 0, sizeof it);
    it[0].name = "w"; it[0].dtype = "F32"; it[0].ndim = 2; it[0].shape = s23; it[0].data = w; it[0].bytes = sizeof w;
    it[1].name = "idx"; it[1].dtype = "I32"; it[1].ndim = 1; it[1].shape = s4; it[1].data = idx; it[1].bytes = sizeof idx;
    it[2].name = "mask"; it[2].dtype = "U8"; it[2].ndim = 1; it[2].shape = s3; it[2].data = mask; it[2].bytes = sizeof mask;
    it[3].name = "d"; it[3].dtype = "F64"; it[3].ndim = 0; it[3].shape = NULL; it[3].data = &dd; it[3].bytes = sizeof dd;
    it[4].name = "empty"; it[4].dtype = "F32"; it[4].ndim = 2; it[4].shape = s04; it[4].data = NULL; it[4].bytes = 0;
    it[5].name = "name with \"quotes\", \\ and \n newline"; it[5].dtype = "F32"; it[5].ndim = 1; it[5].shape = s1;
    it[5].data = &seven; it[5].bytes = 4;
    it[6].name = "h\xc3\xa9llo \xf0\x9f\x98\x80"; it[6].dtype = "I64"; it[6].ndim = 1; it[6].shape = s2; it[6].data = hl;
    it[6].bytes = sizeof hl;
    return mgpu__st_write(path, it, 7, keys, vals, 2);
}

static void test_st_roundtrip(void) {
    char path[512];
    uint8_t* p;
    size_t n;
    mgpu__st_file f;
    mgpu_result rc;
    snprintf(path, sizeof path, "%s/rt.safetensors", g_dir);
    rc = write_known(path);
    CHECK(rc == MGPU_OK, "writer succeeds");
    p = read_file(path, &n);
    CHECK(p != NULL, "written file exists");
    if (!p) return;
    rc = mgpu__st_parse(p, n, path, &f);
    CHECK(rc == MGPU_OK, "written file parses");
    if (rc == MGPU_OK) {
        uint64_t hlen = (uint64_t)p[0] | ((uint64_t)p[1] << 8);
        const uint8_t* data = p + f.data_start;
        double d;
        CHECK(f.data_start % 8 == 0 && f.data_start == 8 + hlen && p[f.data_start - 1] != 0, "byte buffer starts 8-aligned");
        CHECK(!memcmp(p + 8, "{\"__metadata__\":{\"format\":\"pt\",", 31), "metadata first");
        CHECK(f.count == 7 && f.meta_count == 2, "counts");
        CHECK(!strcmp(f.meta[1].value, "tab\there \"q\" \xc3\xa9"), "metadata value round trip");
        CHECK(!strcmp(f.tensors[0].name, "w") && !strcmp(f.tensors[6].name, "h\xc3\xa9llo \xf0\x9f\x98\x80") &&
                  !strcmp(f.tensors[5].name, "name with \"quotes\", \\ and \n newline"),
              "names in item order, escaped and back");
        CHECK(f.tensors[0].begin == 0 && f.tensors[0].end == 24 && f.tensors[1].begin == 24 && f.tensors[4].begin == f.tensors[4].end &&
                  f.tensors[6].end == n - f.data_start,
              "contiguous layout");
        memcpy(&d, data + f.tensors[3].begin, 8);
        CHECK(d == 3.25 && f.tensors[3].ndim == 0 && data[f.tensors[2].begin + 2] == 255, "data round trip");
    }
    mgpu__st_free(&f);
    free(p);
    CHECK(count_tmp_files(g_dir) == 0, "no temporary file left behind");

    /* an empty file */
    snprintf(path, sizeof path, "%s/empty.safetensors", g_dir);
    rc = mgpu__st_write(path, NULL, 0, NULL, NULL, 0);
    p = read_file(path, &n);
    CHECK(rc == MGPU_OK && p && n == 16 && !memcmp(p + 8, "{}      ", 8), "no tensors: '{}' padded to 8");
    if (p) {
        CHECK(mgpu__st_parse(p, n, path, &f) == MGPU_OK && f.count == 0, "parses");
        mgpu__st_free(&f);
    }
    free(p);

    /* keep a copy for the Python cross-check (tests/check_c_written.py, run by tests/interop.sh) */
    if (write_known(C_WRITTEN) != MGPU_OK) printf("   note: could not write %s for check_c_written.py\n", C_WRITTEN);
}

static void test_st_python(void) {
    char path[512], line[1024];
    uint8_t* p;
    size_t n;
    FILE* ex;
    mgpu__st_file f;
    int i = 0, m = 0, ok = 1;
    snprintf(path, sizeof path, "%s/py.safetensors", FIXTURES);
    p = read_file(path, &n);
    ex = fopen(FIXTURES "/py.expected", "r");
    if (!p || !ex) {
        SKIP("no Python fixtures (%s): pip install safetensors numpy, then python3 tests/gen_fixtures.py tests/fixtures", path);
        free(p);
        if (ex) fclose(ex);
        return;
    }
    CHECK(mgpu__st_parse(p, n, path, &f) == MGPU_OK, "file written by Python safetensors parses");
    while (fgets(line, sizeof line, ex)) {
        char kind, name[256], dtype[16], *q;
        int ndim, k, used;
        if (sscanf(line, "%c %255s %15s%n", &kind, name, dtype, &used) < 3) continue;
        if (kind == 'M') {
            ok &= m < f.meta_count && !strcmp(f.meta[m].key, name) && !strncmp(f.meta[m].value, dtype, 15);
            m++;
            continue;
        }
        if (i >= f.count) { ok = 0; break; }
        q = line + used;
        ndim = (int)strtol(q, &q, 10);
        ok &= !strcmp(f.tensors[i].name, name) && !strcmp(f.tensors[i].dtype, dtype) && f.tensors[i].ndim == ndim;
        for (k = 0; k < ndim; ++k) ok &= f.tensors[i].shape[k] == strtoull(q, &q, 10);
        {
            unsigned long long b = strtoull(q, &q, 10), e = strtoull(q, &q, 10), sum = strtoull(q, &q, 10), s = 0, j;
            ok &= f.tensors[i].begin == b && f.tensors[i].end == e;
            for (j = b; j < e && f.data_start + e <= n; ++j) s += p[f.data_start + j];
            ok &= (s & 0xFFFFFFFFull) == sum;
        }
        if (!ok) { printf("   mismatch at tensor %d (%s)\n", i, name); break; }
        i++;
    }
    CHECK(ok && i == f.count && m == f.meta_count && i > 0, "all %d tensors and %d metadata entries match py.expected", i, m);
    /* arange [2,3] holds 0..5 */
    for (i = 0; i < f.count; ++i)
        if (!strcmp(f.tensors[i].name, "arange")) {
            float v[6];
            memcpy(v, p + f.data_start + f.tensors[i].begin, sizeof v);
            CHECK(v[0] == 0.0f && v[5] == 5.0f, "arange values");
        }
    mgpu__st_free(&f);
    fclose(ex);
    free(p);
}

/* must never crash; whatever is accepted must be self-consistent */
static void test_st_fuzz(int iters) {
    static const char tokens[] = "{}[]\":,0123456789-.eE\\u \x00\xff";
    char path[512];
    uint8_t *base, *m;
    size_t n, hend;
    int i, accepted = 0, inconsistent = 0;
    snprintf(path, sizeof path, "%s/fuzz.safetensors", g_dir);
    if (write_known(path) != MGPU_OK || !(base = read_file(path, &n))) { CHECK(0, "fuzz base file"); return; }
    hend = 8 + ((size_t)base[0] | ((size_t)base[1] << 8));
    m = (uint8_t*)malloc(n);
    for (i = 0; i < iters; ++i) {
        mgpu__st_file f;
        size_t len = n;
        int k, muts = 1 + (int)(rnd() % 4);
        memcpy(m, base, n);
        for (k = 0; k < muts; ++k) {
            size_t pos = (rnd() % 8) ? 8 + rnd() % (hend - 8) : rnd() % n;
            switch (rnd() % 6) {
            case 0: m[pos] = (uint8_t)rnd(); break;
            case 1: m[pos] ^= (uint8_t)(1u << (rnd() % 8)); break;
            case 2: case 3: m[pos] = (uint8_t)tokens[rnd() % (sizeof tokens - 1)]; break;
            case 4: /* delete a byte from the header, keeping the declared length */
                memmove(m + pos, m + pos + 1, n - pos - 1);
                break;
            default: /* truncate or damage the length */
                if (rnd() % 2) len = rnd() % (n + 1);
                else m[rnd() % 8] = (uint8_t)rnd();
            }
        }
        if (mgpu__st_parse(m, len, "fuzz.safetensors", &f) == MGPU_OK) {
            int t;
            accepted++;
            for (t = 0; t < f.count; ++t) {
                const mgpu__st_tensor* x = &f.tensors[t];
                const char* arena_end = f.strings.p + f.strings.len;
                uint64_t want = (uint64_t)mgpu__st_dtypes[x->dt].bits;   /* any dtype, readable or not */
                int d;
                for (d = 0; d < x->ndim; ++d) want *= (uint64_t)x->shape[d];
                want = (want + 7) / 8;
                if (x->begin > x->end || f.data_start + x->end > len || x->end - x->begin != want || x->name < f.strings.p ||
                    x->name >= arena_end || memchr(x->name, 0, (size_t)(arena_end - x->name)) == NULL)
                    inconsistent++;
            }
        } else if (f.tensors || f.meta || f.count) {
            inconsistent++;
        }
        mgpu__st_free(&f);
    }
    CHECK(inconsistent == 0, "fuzz: accepted files are consistent, rejected ones leave a zeroed struct");
    printf("   safetensors fuzz: %d mutated files, %d accepted\n", iters, accepted);
    free(m);
    free(base);
}

static void test_st_writer_errors(void) {
    char path[512], sub[512], dir2[512], old[600];
    static const float v[2] = {1, 2};
    static const int64_t s2[1] = {2}, sneg[1] = {-2};
    mgpu__st_write_item it[2];
    uint8_t *p, *before;
    size_t n, before_n;
    mgpu_result rc;
    snprintf(path, sizeof path, "%s/args.safetensors", g_dir);
    memset(it, 0, sizeof it);
    it[0].name = "a"; it[0].dtype = "F32"; it[0].ndim = 1; it[0].shape = s2; it[0].data = v; it[0].bytes = 8;
    it[1] = it[0];
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "duplicate tensor name 'a'", NULL), "dup");
    it[1].name = "b";
    it[1].bytes = 4;
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "tensor 'b'", "4 bytes"), "bytes");
    it[1].bytes = 8;
    it[1].dtype = "F31";
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "unknown dtype 'F31'", NULL), "dtype");
    it[1].dtype = "F32";
    it[1].shape = sneg;
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "negative", NULL), "neg dim");
    it[1].shape = s2;
    it[1].name = "__metadata__";
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "item 1", NULL), "reserved name");
    it[1].name = "\xff";
    CHECK(err_is(mgpu__st_write(path, it, 2, NULL, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "UTF-8", NULL), "bad UTF-8 name");
    it[1].name = "b";
    {
        const char* k[2] = {"x", "x"};
        const char* val[2] = {"1", "2"};
        CHECK(err_is(mgpu__st_write(path, it, 2, k, val, 2), MGPU_ERROR_INVALID_ARGUMENT, "duplicate metadata key 'x'", NULL), "dup meta");
    }
    CHECK(read_file(path, &n) == NULL, "invalid arguments create no file");

    /* missing directory */
    snprintf(path, sizeof path, "%s/no/such/dir/x.safetensors", g_dir);
    rc = mgpu__st_write(path, it, 2, NULL, NULL, 0);
    CHECK(err_is(rc, MGPU_ERROR_IO, path, "No such file or directory"), "missing directory");

    /* target is a directory */
    snprintf(sub, sizeof sub, "%s/isdir", g_dir);
    test_mkdir(sub, 0755);
    rc = mgpu__st_write(sub, it, 2, NULL, NULL, 0);
    {
        struct stat st;
        CHECK(err_is(rc, MGPU_ERROR_IO, sub, "is a directory") && stat(sub, &st) == 0 && S_ISDIR(st.st_mode), "path is a directory");
    }
    CHECK(count_tmp_files(g_dir) == 0, "no temporary file left after the failed rename");

    /* overwrite works and replaces the content */
    snprintf(dir2, sizeof dir2, "%s/ro", g_dir);
    test_mkdir(dir2, 0755);
    snprintf(old, sizeof old, "%s/model.safetensors", dir2);
    CHECK(write_known(old) == MGPU_OK, "first version");
    rc = mgpu__st_write(old, it, 2, NULL, NULL, 0);
    p = read_file(old, &n);
    CHECK(rc == MGPU_OK && p && n == 8 + 8 * ((size_t)p[0] / 8) + 16 && count_tmp_files(dir2) == 0, "overwrite");
    free(p);
    CHECK(write_known(old) == MGPU_OK, "rewrite the known file");
    before = read_file(old, &before_n);

    /* directory not writable: as root, do it in a child that drops to `nobody` */
    fflush(stdout);
#ifdef _WIN32
    SKIP("unwritable directory: Windows has no directory permission bits (a folder's read-only attribute does not stop "
         "new files in it) and no fork or setuid");
    SKIP("a write that fails half-way: Windows has no file size limit (setrlimit RLIMIT_FSIZE) and no fork");
#else
    {
        int fds[2], status = 0;
        pid_t pid;
        char msg[1024];
        ssize_t got;
        if (pipe(fds) != 0) { CHECK(0, "pipe"); return; }
        pid = fork();
        if (pid == 0) {
            mgpu_result crc;
            close(fds[0]);
            if (geteuid() == 0) {
                if (setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
            } else {
                chmod(dir2, 0555);
            }
            {
                char probe[700];
                FILE* pf;
                snprintf(probe, sizeof probe, "%s/probe", dir2);
                pf = fopen(probe, "wb");
                if (pf) { fclose(pf); remove(probe); _exit(101); } /* the directory is writable anyway */
            }
            crc = mgpu__st_write(old, it, 2, NULL, NULL, 0);
            if (write(fds[1], mgpu__test_error_text, strlen(mgpu__test_error_text) + 1) < 0) _exit(102);
            _exit((int)crc);
        }
        close(fds[1]);
        got = read(fds[0], msg, sizeof msg - 1);
        msg[got > 0 ? got : 0] = 0;
        close(fds[0]);
        waitpid(pid, &status, 0);
        chmod(dir2, 0755);
        if (WIFEXITED(status) && (WEXITSTATUS(status) == 100 || WEXITSTATUS(status) == 101)) {
            SKIP("cannot make a directory unwritable here (exit %d)", WEXITSTATUS(status));
        } else {
            CHECK(WIFEXITED(status) && WEXITSTATUS(status) == MGPU_ERROR_IO && strstr(msg, old) && strstr(msg, "Permission denied"),
                  "unwritable directory: MGPU_ERROR_IO naming the path (child said: %s)", msg);
            p = read_file(old, &n);
            CHECK(p && before && n == before_n && !memcmp(p, before, n) && count_tmp_files(dir2) == 0,
                  "unwritable directory: old file intact, no temporary file");
            free(p);
        }
    }
    /* a write that fails half-way (file size limit): old file intact, temp removed */
    fflush(stdout);
    {
        int fds[2], status = 0;
        pid_t pid;
        char msg[1024];
        ssize_t got;
        static uint8_t bigdata[65536];
        static const int64_t sbig[1] = {65536};
        if (pipe(fds) != 0) { CHECK(0, "pipe"); return; }
        pid = fork();
        if (pid == 0) {
            mgpu__st_write_item b;
            struct rlimit rl;
            mgpu_result crc;
            close(fds[0]);
            signal(SIGXFSZ, SIG_IGN);
            getrlimit(RLIMIT_FSIZE, &rl);
            rl.rlim_cur = 4096;
            if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(100);
            memset(&b, 0, sizeof b);
            b.name = "big"; b.dtype = "U8"; b.ndim = 1; b.shape = sbig; b.data = bigdata; b.bytes = sizeof bigdata;
            crc = mgpu__st_write(old, &b, 1, NULL, NULL, 0);
            if (write(fds[1], mgpu__test_error_text, strlen(mgpu__test_error_text) + 1) < 0) _exit(102);
            _exit((int)crc);
        }
        close(fds[1]);
        got = read(fds[0], msg, sizeof msg - 1);
        msg[got > 0 ? got : 0] = 0;
        close(fds[0]);
        waitpid(pid, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == MGPU_ERROR_IO && strstr(msg, old) && strstr(msg, "File too large"),
              "failed write: MGPU_ERROR_IO naming the path and strerror (child said: %s)", msg);
        p = read_file(old, &n);
        CHECK(p && before && n == before_n && !memcmp(p, before, n) && count_tmp_files(dir2) == 0,
              "failed write: old file intact, no temporary file");
        free(p);
    }
#endif
    free(before);
}


/* The temporary file for a checkpoint of dir/base, made by process pid (an unused name with the
   writer's own prefix, so that the writer takes it for one of its own). */
static void fake_tmp_name(char* out, size_t size, const char* dir, const char* base, long pid) {
    char target[700], prefix[MGPU__TMP_BASE_MAX + 16];
    size_t dir_len;
    snprintf(target, sizeof target, "%s/%s", dir, base);
    mgpu__tmp_prefix(target, &dir_len, prefix, sizeof prefix);
    snprintf(out, size, "%s/%s%ld.1%s", dir, prefix, pid, MGPU__TMP_SUFFIX);
}
static int exists(const char* path) {
    struct stat st;
#ifdef _WIN32
    return stat(path, &st) == 0;
#else
    return lstat(path, &st) == 0;
#endif
}
static int files_equal(const char* a, const char* b) {
    size_t na = 0, nb = 0;
    uint8_t *pa = read_file(a, &na), *pb = read_file(b, &nb);
    int same = pa && pb && na == nb && !memcmp(pa, pb, na);
    free(pa);
    free(pb);
    return same;
}

/* Other processes for the stale temporary files: one that lives until child_end, and one that
   has ended (its id free again). POSIX: fork; Windows: CreateProcess of this program, suspended
   (it never runs), ended by TerminateProcess. */
#ifdef _WIN32
typedef HANDLE test_child;
static long child_start(test_child* c) {
    char exe[MAX_PATH];
    STARTUPINFOA si;
    PROCESS_INFORMATION pi;
    memset(&si, 0, sizeof si);
    si.cb = sizeof si;
    if (!GetModuleFileNameA(NULL, exe, sizeof exe) ||
        !CreateProcessA(exe, NULL, NULL, NULL, FALSE, CREATE_SUSPENDED, NULL, NULL, &si, &pi)) {
        *c = NULL;
        return -1;
    }
    CloseHandle(pi.hThread);
    *c = pi.hProcess;
    return (long)pi.dwProcessId;
}
static void child_end(test_child c) {
    if (!c) return;
    TerminateProcess(c, 9);
    WaitForSingleObject(c, INFINITE);
    CloseHandle(c);
}
#else
typedef pid_t test_child;
static long child_start(test_child* c) {
    *c = fork();
    if (*c == 0) { pause(); _exit(0); }
    return (long)*c;
}
static void child_end(test_child c) {
    int status;
    if (c <= 0) return;
    kill(c, SIGKILL);
    waitpid(c, &status, 0);
}
#endif
static long child_dead(void) {
    test_child c;
    long pid = child_start(&c);
    child_end(c);
    return pid;
}

/* Where a checkpoint goes: long names, what an interrupted save leaves behind, files that are
   not regular files, symlinks; and reading refuses what is not a regular file. */
static void test_st_save_paths(void) {
    char dir[512], path[900], other[900], tmp[1200], live_tmp[1200], other_tmp[1200], ref[900];
    static const float v[2] = {1, 2};
    static const int64_t s2[1] = {2};
    mgpu__st_write_item it;
    mgpu_result rc;
    struct stat st;
    memset(&it, 0, sizeof it);
    it.name = "a"; it.dtype = "F32"; it.ndim = 1; it.shape = s2; it.data = v; it.bytes = 8;
    snprintf(dir, sizeof dir, "%s/paths", g_dir);
    test_mkdir(dir, 0755);
    snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
    CHECK(mgpu__st_write(ref, &it, 1, NULL, NULL, 0) == MGPU_OK, "reference file");

    /* a 252-byte name (NAME_MAX is 255): the temporary name must fit too */
    {
        char base[256];
        memset(base, 'n', 240);
        strcpy(base + 240, ".safetensors");
        snprintf(path, sizeof path, "%s/%s", dir, base);
        rc = mgpu__st_write(path, &it, 1, NULL, NULL, 0);
        CHECK(rc == MGPU_OK && files_equal(path, ref) && count_tmp_files(dir) == 0, "a %zu-byte file name saves", strlen(base));
        CHECK(mgpu__st_write(path, &it, 1, NULL, NULL, 0) == MGPU_OK, "and saves again over itself");
        remove(path);
    }

    /* stale temporary files: a dead writer's goes, a live one's and another target's stay */
    fflush(stdout);
    {
        test_child live_child;
        long live = child_start(&live_child), dead = child_dead();   /* the live one first: its id is not the dead one's */
        CHECK(live > 0 && dead > 0 && live != dead, "two child processes (%ld and %ld)", live, dead);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        snprintf(other, sizeof other, "%s/model.safetensors2", dir);
        fake_tmp_name(tmp, sizeof tmp, dir, "model.safetensors", dead);
        fake_tmp_name(live_tmp, sizeof live_tmp, dir, "model.safetensors", live);
        fake_tmp_name(other_tmp, sizeof other_tmp, dir, "model.safetensors2", dead);
        CHECK(write_file(tmp, "junk", 4) && write_file(live_tmp, "junk", 4) && write_file(other_tmp, "junk", 4), "fake temporary files");
        rc = mgpu__st_write(path, &it, 1, NULL, NULL, 0);
        CHECK(rc == MGPU_OK && !exists(tmp), "a save removes the temporary file of a dead writer (%s)", tmp);
        CHECK(exists(live_tmp), "a save leaves a live process's temporary file alone");
        CHECK(exists(other_tmp), "a save leaves another target's temporary file alone");
        child_end(live_child);
        rc = mgpu__st_write(path, &it, 1, NULL, NULL, 0);
        CHECK(rc == MGPU_OK && !exists(live_tmp), "once its writer is gone, the next save removes it");
        remove(other_tmp);
        CHECK(count_tmp_files(dir) == 0, "no temporary file left");
        /* the same for a 252-byte name, whose temporary names are cut */
        {
            char base[256];
            memset(base, 'q', 240);
            strcpy(base + 240, ".safetensors");
            fake_tmp_name(tmp, sizeof tmp, dir, base, dead);
            snprintf(path, sizeof path, "%s/%s", dir, base);
            CHECK(strlen(strrchr(tmp, '/') + 1) <= 255 && write_file(tmp, "junk", 4), "a cut temporary name");
            CHECK(mgpu__st_write(path, &it, 1, NULL, NULL, 0) == MGPU_OK && !exists(tmp) && count_tmp_files(dir) == 0,
                  "a long name's stale temporary file is removed");
            remove(path);
        }
    }

    /* not a regular file: refused, left as it was, nothing written */
    snprintf(path, sizeof path, "%s/fifo.safetensors", dir);
#ifdef _WIN32
    SKIP("saving over a FIFO: Windows has no FIFOs in its file system");
    {   /* its named pipes: reading one fails at once instead of waiting for a writer */
        char pipe_name[128];
        HANDLE server;
        snprintf(pipe_name, sizeof pipe_name, "\\\\.\\pipe\\mgpu-test-io-%ld", test_getpid());
        server = CreateNamedPipeA(pipe_name, PIPE_ACCESS_OUTBOUND, PIPE_TYPE_BYTE | PIPE_WAIT, 1, 4096, 4096, 0, NULL);
        CHECK(server != INVALID_HANDLE_VALUE, "CreateNamedPipe %s", pipe_name);
        if (server != INVALID_HANDLE_VALUE) {
            CHECK(mgpu_safetensors_open(pipe_name) == NULL && err_is(MGPU_ERROR_IO, MGPU_ERROR_IO, pipe_name, "pipe"),
                  "opening a named pipe is refused");
            CloseHandle(server);
        }
    }
#else
    if (mkfifo(path, 0644) != 0) SKIP("mkfifo: %s", strerror(errno));
    else {
        rc = mgpu__st_write(path, &it, 1, NULL, NULL, 0);
        CHECK(err_is(rc, MGPU_ERROR_IO, path, "is a FIFO") && stat(path, &st) == 0 && S_ISFIFO(st.st_mode) &&
              count_tmp_files(dir) == 0, "saving over a FIFO is refused and leaves it");
        /* and reading one fails at once instead of waiting for a writer */
        CHECK(mgpu_safetensors_open(path) == NULL && err_is(MGPU_ERROR_IO, MGPU_ERROR_IO, path, "FIFO"), "opening a FIFO is refused");
    }
#endif
    snprintf(path, sizeof path, "%s/dir.safetensors", dir);
    test_mkdir(path, 0755);
    rc = mgpu__st_write(path, &it, 1, NULL, NULL, 0);
    CHECK(err_is(rc, MGPU_ERROR_IO, path, "is a directory") && stat(path, &st) == 0 && S_ISDIR(st.st_mode), "saving over a directory");
    CHECK(mgpu_safetensors_open(path) == NULL && err_is(MGPU_ERROR_IO, MGPU_ERROR_IO, path, "directory"), "opening a directory");
    /* /dev/zero would be read until memory runs out: a child with little memory and a deadline */
    fflush(stdout);
#ifdef _WIN32
    /* Windows's devices: NUL */
    CHECK(mgpu_safetensors_open("NUL") == NULL && err_is(MGPU_ERROR_IO, MGPU_ERROR_IO, "NUL", "device"), "opening NUL is refused");
#else
    {
        pid_t pid = fork();
        int status = 0;
        if (pid == 0) {
            struct rlimit rl = {(rlim_t)1 << 30, (rlim_t)1 << 30};
            setrlimit(RLIMIT_AS, &rl);
            alarm(20);
            _exit(mgpu_safetensors_open("/dev/zero") == NULL && strstr(mgpu_last_error(), "character device") ? 0 : 1);
        }
        waitpid(pid, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "opening /dev/zero is refused at once (status %d)", status);
    }
#endif

    /* a symlink: the file it points to is replaced, and the link stays a link */
#ifdef _WIN32
    SKIP("saving through symlinks: a Windows program needs a privilege (or developer mode) to make one");
#else
    {
        char sub[600], target[900], link1[900], link2[900];
        snprintf(sub, sizeof sub, "%s/real", dir);
        mkdir(sub, 0755);
        snprintf(target, sizeof target, "%s/real/model.safetensors", dir);
        snprintf(link1, sizeof link1, "%s/link.safetensors", dir);
        snprintf(link2, sizeof link2, "%s/link2.safetensors", dir);
        CHECK(write_file(target, "old", 3) && symlink("real/model.safetensors", link1) == 0 && symlink("link.safetensors", link2) == 0,
              "symlinks");
        rc = mgpu__st_write(link2, &it, 1, NULL, NULL, 0);
        CHECK(rc == MGPU_OK && lstat(link1, &st) == 0 && S_ISLNK(st.st_mode) && lstat(link2, &st) == 0 && S_ISLNK(st.st_mode),
              "saving through two symlinks keeps them links");
        CHECK(files_equal(target, ref) && files_equal(link2, ref), "the file they point to holds the new checkpoint");
        CHECK(count_tmp_files(dir) == 0 && count_tmp_files(sub) == 0, "no temporary file left");
        remove(target);   /* dangling now: a save creates the file it points to */
        rc = mgpu__st_write(link1, &it, 1, NULL, NULL, 0);
        CHECK(rc == MGPU_OK && lstat(link1, &st) == 0 && S_ISLNK(st.st_mode) && files_equal(target, ref), "a dangling symlink");
        /* a link to a FIFO is refused like the FIFO */
        snprintf(path, sizeof path, "%s/fifo.safetensors", dir);
        remove(link1);
        if (exists(path) && symlink("fifo.safetensors", link1) == 0) {
            rc = mgpu__st_write(link1, &it, 1, NULL, NULL, 0);
            CHECK(err_is(rc, MGPU_ERROR_IO, "is a FIFO", NULL) && lstat(link1, &st) == 0 && S_ISLNK(st.st_mode), "a symlink to a FIFO");
        }
    }
#endif
}

/* ------------------------------------------------------------- the public safetensors reader --- */
/* a file from a JSON header and the given byte buffer */
static int write_st_bytes(const char* path, const char* json, const void* buf, size_t buf_len) {
    size_t n;
    uint8_t* p = mk_st(json, buf_len, &n);
    int ok;
    if (buf_len) memcpy(p + n - buf_len, buf, buf_len);
    ok = write_file(path, p, n);
    free(p);
    return ok;
}

/* tensor `name` of st read onto the CPU: its dtype, shape text and the first `n` values as doubles */
static int st_read_values(const mgpu_safetensors* st, const char* name, mgpu_dtype* dt, char* shape, size_t shape_size, double* v,
                          int n) {
    mgpu_tensor* t = mgpu_safetensors_read(st, name, NULL);
    int64_t i, count;
    if (!t) return 0;
    *dt = mgpu_tensor_dtype(t);
    mgpu_tensor_describe(t, shape, shape_size);
    count = mgpu_tensor_numel(t);
    for (i = 0; i < count && i < n; ++i) {
        if (*dt == MGPU_F32) v[i] = ((const float*)mgpu_tensor_data(t))[i];
        else if (*dt == MGPU_I32) v[i] = ((const int32_t*)mgpu_tensor_data(t))[i];
        else v[i] = ((const uint8_t*)mgpu_tensor_data(t))[i];
    }
    mgpu_tensor_destroy(t);
    return 1;
}

static void test_reader_roundtrip(void) {
    char path[512], shape[96];
    mgpu_safetensors* st;
    mgpu_safetensors_info info;
    mgpu_dtype dt = MGPU_U8;
    double v[8];
    int i;
    snprintf(path, sizeof path, "%s/reader.safetensors", g_dir);
    CHECK(write_known(path) == MGPU_OK, "write the known file");
    st = mgpu_safetensors_open(path);
    CHECK(st != NULL, "mgpu_safetensors_open(%s)", path);
    if (!st) return;
    CHECK(mgpu_safetensors_count(st) == 7, "7 tensors, not %d", mgpu_safetensors_count(st));
    CHECK(mgpu_safetensors_get_info(st, 0, &info) == MGPU_OK && !strcmp(info.name, "w") && !strcmp(info.dtype, "F32") &&
              info.ndim == 2 && info.shape[0] == 2 && info.shape[1] == 3 && info.bytes == 24 && info.read_dtype == MGPU_F32,
          "info of 'w'");
    CHECK(mgpu_safetensors_get_info(st, 6, &info) == MGPU_OK && !strcmp(info.name, "h\xc3\xa9llo \xf0\x9f\x98\x80") &&
              !strcmp(info.dtype, "I64") && info.read_dtype == MGPU_I32,
          "info of the last tensor, in the file's order");
    CHECK(mgpu_safetensors_get_info(st, 3, &info) == MGPU_OK && info.ndim == 0 && info.read_dtype == MGPU_F32, "a scalar F64");
    CHECK(err_is(mgpu_safetensors_get_info(st, 7, &info), MGPU_ERROR_INVALID_ARGUMENT, "tensor 7", "has 7"), "index 7 of 7");
    CHECK(err_is(mgpu_safetensors_get_info(st, -1, &info), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_get_info", "-1"),
          "index -1");
    CHECK(mgpu_safetensors_find(st, "mask") == 2 && mgpu_safetensors_find(st, "name with \"quotes\", \\ and \n newline") == 5,
          "find by name");
    CHECK(mgpu_safetensors_find(st, "nope") == -1 && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "no tensor 'nope'", path),
          "find an unknown name");
    /* every tensor back, converted */
    CHECK(st_read_values(st, "w", &dt, shape, sizeof shape, v, 6) && dt == MGPU_F32 && !strcmp(shape, "f32[2,3]@cpu") && v[0] == 0.0 &&
              v[5] == 2.5,
          "'w' reads back as f32[2,3]: %s", shape);
    CHECK(st_read_values(st, "idx", &dt, shape, sizeof shape, v, 4) && dt == MGPU_I32 && v[0] == -1 && v[3] == 2, "'idx' as I32");
    CHECK(st_read_values(st, "mask", &dt, shape, sizeof shape, v, 3) && dt == MGPU_U8 && v[1] == 0 && v[2] == 255, "'mask' as U8");
    CHECK(st_read_values(st, "d", &dt, shape, sizeof shape, v, 1) && dt == MGPU_F32 && v[0] == 3.25 && !strcmp(shape, "f32[]@cpu"),
          "the F64 scalar as an f32 scalar: %s", shape);
    CHECK(st_read_values(st, "empty", &dt, shape, sizeof shape, v, 0) && !strcmp(shape, "f32[0,4]@cpu"), "an empty tensor: %s", shape);
    CHECK(st_read_values(st, "h\xc3\xa9llo \xf0\x9f\x98\x80", &dt, shape, sizeof shape, v, 2) && dt == MGPU_I32 && v[0] == 1 &&
              v[1] == -2,
          "I64 as I32");
    CHECK(mgpu_safetensors_read(st, "nope", NULL) == NULL &&
              err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_read", "no tensor 'nope'"),
          "reading an unknown name");
    /* metadata */
    CHECK(mgpu_safetensors_metadata_count(st) == 2, "2 metadata entries");
    CHECK(mgpu_safetensors_metadata_key(st, 1) && !strcmp(mgpu_safetensors_metadata_key(st, 1), "note"), "key 1");
    CHECK(mgpu_safetensors_metadata(st, "note") && !strcmp(mgpu_safetensors_metadata(st, "note"), "tab\there \"q\" \xc3\xa9"),
          "value of 'note'");
    CHECK(mgpu_safetensors_metadata(st, "mgpu.step") == NULL &&
              err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "no metadata key 'mgpu.step'", path),
          "an absent key");
    CHECK(mgpu_safetensors_metadata_key(st, 2) == NULL && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "entry 2", "has 2"),
          "key index 2 of 2");
    for (i = 0; i < mgpu_safetensors_count(st); ++i) {   /* everything reads (and ASan sees every byte copied) */
        mgpu_safetensors_info in;
        mgpu_tensor* t;
        if (mgpu_safetensors_get_info(st, i, &in) != MGPU_OK) continue;
        t = mgpu_safetensors_read(st, in.name, mgpu_device_cpu());
        CHECK(t && mgpu_tensor_dtype(t) == in.read_dtype, "tensor %d reads", i);
        mgpu_tensor_destroy(t);
    }
    mgpu_safetensors_close(st);
    mgpu_safetensors_close(NULL);   /* a no-op */
    CHECK(mgpu_safetensors_count(NULL) == 0 && mgpu_safetensors_metadata_count(NULL) == 0, "NULL handle counts 0");
    CHECK(mgpu_safetensors_read(NULL, "w", NULL) == NULL && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "NULL", NULL),
          "NULL handle");
}

/* the dtypes mgpu converts, and the ones it refuses */
/* A file with tensors mgpu cannot compute in still opens: they are listed with their dtype and
   readable 0, reading one is UNSUPPORTED naming it, and the others read (FP8 scales beside
   weights, as real checkpoints hold them). */
static void test_reader_unsupported(void) {
    char path[512];
    mgpu_safetensors* st;
    mgpu_safetensors_info info;
    mgpu_tensor* t;
    static const float w[2] = {1.5f, -2.0f};
    uint8_t buf[32];
    memset(buf, 0x11, sizeof buf);
    memcpy(buf + 2, w, 8);
    snprintf(path, sizeof path, "%s/fp8.safetensors", g_dir);
    CHECK(write_st_bytes(path,
                         "{\"scale\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]},"
                         "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[2,10]},"
                         "\"c\":{\"dtype\":\"C64\",\"shape\":[1],\"data_offsets\":[10,18]},"
                         "\"q\":{\"dtype\":\"F4\",\"shape\":[2,2],\"data_offsets\":[18,20]},"
                         "\"u\":{\"dtype\":\"U32\",\"shape\":[1],\"data_offsets\":[20,24]}}",
                         buf, 24),
          "write %s", path);
    st = mgpu_safetensors_open(path);
    CHECK(st != NULL, "a file with F8_E4M3, C64, F4 and U32 tensors opens: %s", st ? "" : mgpu_last_error());
    if (!st) return;
    CHECK(mgpu_safetensors_count(st) == 5, "all five listed");
    CHECK(mgpu_safetensors_get_info(st, 0, &info) == MGPU_OK && !strcmp(info.dtype, "F8_E4M3") && !info.readable && info.bytes == 2,
          "F8_E4M3 listed with its dtype, not readable");
    CHECK(mgpu_safetensors_get_info(st, 3, &info) == MGPU_OK && !strcmp(info.dtype, "F4") && info.ndim == 2 && info.bytes == 2,
          "F4 listed");
    t = mgpu_safetensors_read(st, "scale", NULL);
    CHECK(!t && err_is(mgpu_last_result(), MGPU_ERROR_UNSUPPORTED, "'scale'", "F8_E4M3"), "reading F8_E4M3 is UNSUPPORTED naming it");
    mgpu_tensor_destroy(t);
    t = mgpu_safetensors_read(st, "c", NULL);
    CHECK(!t && err_is(mgpu_last_result(), MGPU_ERROR_UNSUPPORTED, "'c'", "C64"), "reading C64 is UNSUPPORTED naming it");
    mgpu_tensor_destroy(t);
    t = mgpu_safetensors_read(st, "w", NULL);
    CHECK(t && ((const float*)mgpu_tensor_data(t))[0] == 1.5f && ((const float*)mgpu_tensor_data(t))[1] == -2.0f,
          "the F32 tensor beside them reads");
    mgpu_tensor_destroy(t);
    mgpu_safetensors_close(st);
}

static void test_reader_dtypes(void) {
    char path[512], shape[96];
    mgpu_safetensors* st;
    mgpu_dtype dt = MGPU_U8;
    double v[8];
    /* F16: 1, -2, 0.5, 65504 (max), 2^-24 (smallest subnormal), -0, inf; BF16: 1, -3.5; I16, I8, BOOL; I64 out of range; 5-D */
    static const uint16_t half[7] = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x8000, 0x7C00};
    static const uint16_t bf16[2] = {0x3F80, 0xC060};
    static const int16_t i16[2] = {-32768, 32767};
    static const int8_t i8[2] = {-128, 127};
    static const uint8_t flags[3] = {1, 0, 1};
    static const int64_t big[2] = {5, 4294967296ll};
    uint8_t buf[64];
    size_t off = 0;
    memset(buf, 0, sizeof buf);
    memcpy(buf + off, half, 14); off += 14;    /* 0..14 */
    memcpy(buf + off, bf16, 4); off += 4;      /* 14..18 */
    memcpy(buf + off, i16, 4); off += 4;       /* 18..22 */
    memcpy(buf + off, i8, 2); off += 2;        /* 22..24 */
    memcpy(buf + off, flags, 3); off += 3;     /* 24..27 */
    memcpy(buf + off, big, 16); off += 16;     /* 27..43 */
    snprintf(path, sizeof path, "%s/dtypes.safetensors", g_dir);
    CHECK(write_st_bytes(path,
                         "{\"h\":{\"dtype\":\"F16\",\"shape\":[7],\"data_offsets\":[0,14]},"
                         "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[14,18]},"
                         "\"s\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[18,22]},"
                         "\"c\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[22,24]},"
                         "\"f\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[24,27]},"
                         "\"big\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[27,43]},"
                         "\"five\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,2],\"data_offsets\":[43,45]}}",
                         buf, 45),
          "write %s", path);
    st = mgpu_safetensors_open(path);
    CHECK(st != NULL, "open %s", path);
    if (!st) return;
    CHECK(st_read_values(st, "h", &dt, shape, sizeof shape, v, 7) && dt == MGPU_F32 && v[0] == 1.0 && v[1] == -2.0 && v[2] == 0.5 &&
              v[3] == 65504.0 && v[4] == ldexp(1.0, -24) && v[5] == 0.0 && signbit(v[5]) && isinf(v[6]),
          "F16 to F32, exactly: %g %g %g %g %g %g %g", v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
    CHECK(st_read_values(st, "b", &dt, shape, sizeof shape, v, 2) && dt == MGPU_F32 && v[0] == 1.0 && v[1] == -3.5, "BF16 to F32");
    CHECK(st_read_values(st, "s", &dt, shape, sizeof shape, v, 2) && dt == MGPU_I32 && v[0] == -32768 && v[1] == 32767, "I16 to I32");
    CHECK(st_read_values(st, "c", &dt, shape, sizeof shape, v, 2) && dt == MGPU_I32 && v[0] == -128 && v[1] == 127, "I8 to I32");
    CHECK(st_read_values(st, "f", &dt, shape, sizeof shape, v, 3) && dt == MGPU_U8 && v[0] == 1 && v[1] == 0 && v[2] == 1, "BOOL to U8");
    CHECK(mgpu_safetensors_read(st, "big", NULL) == NULL &&
              err_is(mgpu_last_result(), MGPU_ERROR_UNSUPPORTED, "'big'", "element 1 is 4294967296, outside int32's range"),
          "an I64 beyond int32");
    CHECK(mgpu_safetensors_read(st, "five", NULL) == NULL &&
              err_is(mgpu_last_result(), MGPU_ERROR_UNSUPPORTED, "'five' has 5 dimensions", "at most 4"),
          "a 5-D tensor");
    mgpu_safetensors_close(st);
}

/* the file Python's safetensors wrote, through the public reader */
static void test_reader_python(void) {
    char path[512], shape[96];
    mgpu_safetensors* st;
    mgpu_dtype dt = MGPU_U8;
    double v[24];
    snprintf(path, sizeof path, "%s/py.safetensors", FIXTURES);
    st = mgpu_safetensors_open(path);
    if (!st) {
        SKIP("no Python fixture %s (%s)", path, mgpu_last_error());
        return;
    }
    CHECK(mgpu_safetensors_count(st) == 9 && mgpu_safetensors_metadata(st, "author") &&
              !strcmp(mgpu_safetensors_metadata(st, "author"), "gen_fixtures.py"),
          "9 tensors and the author");
    CHECK(st_read_values(st, "half", &dt, shape, sizeof shape, v, 3) && v[0] == 1.0 && v[1] == -2.0 && v[2] == 0.5, "numpy's float16");
    CHECK(st_read_values(st, "longs", &dt, shape, sizeof shape, v, 4) && !strcmp(shape, "i32[2,2]@cpu") && v[3] == 4, "numpy's int64");
    CHECK(st_read_values(st, "flags", &dt, shape, sizeof shape, v, 3) && v[0] == 1 && v[1] == 0 && v[2] == 1, "numpy's bool");
    CHECK(st_read_values(st, "bytes", &dt, shape, sizeof shape, v, 10) && !strcmp(shape, "u8[5,1,2]@cpu") && v[9] == 9, "numpy's uint8");
    CHECK(st_read_values(st, "layer.0.weight", &dt, shape, sizeof shape, v, 24) && v[0] == -1.0 && v[23] == 1.0, "numpy's linspace");
    mgpu_safetensors_close(st);
}

/* damaged files through the public reader: NULL, and an error naming the operation and the file */
static void test_reader_malformed(int iters) {
    char path[512], good[512];
    uint8_t *base, *m;
    size_t n, cut;
    mgpu_safetensors* st;
    int i, accepted = 0, bad = 0;
    st = mgpu_safetensors_open(NULL);
    CHECK(!st && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_safetensors_open", "NULL path"), "NULL path");
    snprintf(path, sizeof path, "%s/no/such.safetensors", g_dir);
    st = mgpu_safetensors_open(path);
#ifdef _WIN32
    {   /* in Windows's words: the system's text for ERROR_PATH_NOT_FOUND */
        char text[256];
        DWORD len = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, NULL, ERROR_PATH_NOT_FOUND, 0, text,
                                   sizeof text, NULL);
        while (len > 0 && strchr(".\r\n ", text[len - 1])) text[--len] = 0;
        CHECK(len > 0 && !st && err_is(mgpu_last_result(), MGPU_ERROR_IO, "mgpu_safetensors_open", text), "a missing file ('%s')", text);
    }
#else
    CHECK(!st && err_is(mgpu_last_result(), MGPU_ERROR_IO, "mgpu_safetensors_open", "No such file"), "a missing file");
#endif
    st = mgpu_safetensors_open(g_dir);
    CHECK(!st && err_is(mgpu_last_result(), MGPU_ERROR_IO, "mgpu_safetensors_open", g_dir), "a directory");
    snprintf(good, sizeof good, "%s/good.safetensors", g_dir);
    if (write_known(good) != MGPU_OK || !(base = read_file(good, &n))) { CHECK(0, "base file"); return; }
    snprintf(path, sizeof path, "%s/cut.safetensors", g_dir);
    for (cut = 0; cut < n; cut += (cut < 16 || n - cut < 16) ? 1 : 37) {   /* every truncation is refused */
        write_file(path, base, cut);
        st = mgpu_safetensors_open(path);
        if (st || mgpu_last_result() != MGPU_ERROR_BAD_FILE || !strstr(mgpu_last_error(), "mgpu_safetensors_open") ||
            !strstr(mgpu_last_error(), path)) {
            CHECK(0, "truncated to %zu of %zu bytes: %s", cut, n, st ? "accepted" : mgpu_last_error());
            bad++;
        }
        mgpu_safetensors_close(st);
    }
    CHECK(bad == 0, "every truncation of the file is refused with MGPU_ERROR_BAD_FILE naming the file");
    write_file(path, base, 12);
    CHECK(!mgpu_safetensors_open(path) && err_is(mgpu_last_result(), MGPU_ERROR_BAD_FILE, "mgpu_safetensors_open", "larger than the rest"),
          "a cut header");
    CHECK(write_st_bytes(path, "{\"t\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", NULL, 0) &&
              !mgpu_safetensors_open(path) && err_is(mgpu_last_result(), MGPU_ERROR_BAD_FILE, "tensor 't'", "invalid tensor info"),
          "a tensor beyond the end");
    /* mutated files: never a crash (ASan watches); whatever opens reads every tensor in bounds */
    m = (uint8_t*)malloc(n);
    for (i = 0; i < iters; ++i) {
        size_t pos = 8 + rnd() % (n - 8), len = n;
        int t;
        memcpy(m, base, n);
        m[pos] = (uint8_t)("{}[]\":,0123456789-.eE\\ \xff"[rnd() % 25]);
        if (rnd() % 4 == 0) len = rnd() % (n + 1);
        write_file(path, m, len);
        st = mgpu_safetensors_open(path);
        if (!st) {
            if (mgpu_last_result() == MGPU_OK || !strstr(mgpu_last_error(), "mgpu_safetensors_open")) bad++;
            continue;
        }
        accepted++;
        for (t = 0; t < mgpu_safetensors_count(st); ++t) {
            mgpu_safetensors_info in;
            mgpu_tensor* x;
            if (mgpu_safetensors_get_info(st, t, &in) != MGPU_OK) { bad++; continue; }
            x = mgpu_safetensors_read(st, in.name, NULL);
            if (!x && in.ndim <= 4 && strcmp(in.dtype, "I64") != 0) bad++;
            mgpu_tensor_destroy(x);
        }
        mgpu_safetensors_close(st);
    }
    CHECK(bad == 0, "mutated files: every refusal explained, every accepted tensor readable (%d bad)", bad);
    printf("   public reader: %d mutated files, %d opened\n", iters, accepted);
    free(m);
    free(base);
}

/* ---------------------------------------------------------------------- token files --- */
/* llm.c's token file written byte by byte as its Python (dev/data/data_common.py) does: a
   header of 256 little-endian int32 (magic, version, count, zeros), then count uint16, LE. */
static size_t make_token_file(uint8_t* buf, int32_t magic, int32_t version, int32_t count, const uint16_t* tok, int64_t n) {
    const int32_t h[3] = {magic, version, count};
    int64_t i;
    int k;
    memset(buf, 0, 1024);
    for (k = 0; k < 12; ++k) buf[k] = (uint8_t)((uint32_t)h[k / 4] >> (8 * (k % 4)));
    for (i = 0; i < n; ++i) {
        buf[1024 + 2 * i] = (uint8_t)tok[i];
        buf[1024 + 2 * i + 1] = (uint8_t)(tok[i] >> 8);
    }
    return 1024 + 2 * (size_t)n;
}

/* loading path fails with code, and the message names the path and says s1 and s2 */
static int tokens_refused(const char* path, mgpu_result code, const char* s1, const char* s2) {
    mgpu_tokens* t;
    mgpu_clear_error();
    t = mgpu_tokens_load(path);
    if (t) { mgpu_tokens_destroy(t); return 0; }
    return err_is(mgpu_last_result(), code, path, s1) && err_is(mgpu_last_result(), code, "mgpu_tokens_load", s2);
}

static void test_tokens_files(void) {
    enum { N = 1000 };
    static uint16_t tok[N + 8];
    static uint8_t buf[1024 + 2 * (N + 8)];
    char path[512], bad[512], dir[512];
    uint8_t* p;
    size_t n;
    int64_t i;
    int same, top;
    mgpu_tokens *t, *u;
    mgpu_dataset* ds;

    /* a round trip: from memory, saved, loaded */
    for (i = 0, top = 0; i < N; ++i) {
        tok[i] = (uint16_t)(i == 500 ? 65535 : rnd() % 50257);
        top = tok[i] > top ? tok[i] : top;
    }
    t = mgpu_tokens_from_memory(tok, N);
    CHECK(t && mgpu_tokens_count(t) == N && mgpu_tokens_max_id(t) == top && mgpu_tokens_data(t) != tok &&
              !memcmp(mgpu_tokens_data(t), tok, sizeof(uint16_t) * N),
          "from memory: a copy of %d tokens, max id %d (got %d)", N, top, mgpu_tokens_max_id(t));
    snprintf(path, sizeof path, "%s/rt.bin", g_dir);
    CHECK(mgpu_tokens_save(t, path) == MGPU_OK, "save: %s", mgpu_last_error());
    p = read_file(path, &n);
    CHECK(p && n == make_token_file(buf, 20240520, 1, N, tok, N) && !memcmp(p, buf, n),
          "the file is llm.c's: header (magic 20240520, version 1, count %d, zeros), then little-endian uint16 (%zu bytes)", N, n);
    free(p);
    CHECK(count_tmp_files(g_dir) == 0, "no temporary file left behind");
    u = mgpu_tokens_load(path);
    CHECK(u && mgpu_tokens_count(u) == N && mgpu_tokens_max_id(u) == top && !memcmp(mgpu_tokens_data(u), tok, sizeof(uint16_t) * N),
          "load gives the tokens saved: %s", mgpu_last_error());
    mgpu_tokens_destroy(u);
    /* a save replaces the file (atomically, by the checkpoints' writer) */
    tok[0] = 7;
    u = mgpu_tokens_from_memory(tok, 3);
    CHECK(u && mgpu_tokens_save(u, path) == MGPU_OK, "save over it: %s", mgpu_last_error());
    mgpu_tokens_destroy(u);
    u = mgpu_tokens_load(path);
    top = tok[0] > tok[1] ? tok[0] : tok[1];
    top = tok[2] > top ? tok[2] : top;
    CHECK(u && mgpu_tokens_count(u) == 3 && mgpu_tokens_data(u)[0] == 7 && mgpu_tokens_max_id(u) == top,
          "the new file replaced the old one: %s", mgpu_last_error());
    mgpu_tokens_destroy(u);
    /* a file written by hand, as llm.c's Python writes it */
    n = make_token_file(buf, 20240520, 1, 5, tok, 5);
    snprintf(path, sizeof path, "%s/hand.bin", g_dir);
    CHECK(write_file(path, buf, n), "write %s", path);
    u = mgpu_tokens_load(path);
    CHECK(u && mgpu_tokens_count(u) == 5 && !memcmp(mgpu_tokens_data(u), tok, 10), "a file written byte by byte loads: %s", mgpu_last_error());
    mgpu_tokens_destroy(u);

    /* every bad file, its message naming the path and the numbers */
    snprintf(bad, sizeof bad, "%s/no-such-tokens.bin", g_dir);
    CHECK(tokens_refused(bad, MGPU_ERROR_IO, "cannot open", NULL), "a missing file");
    snprintf(dir, sizeof dir, "%s/a-folder.bin", g_dir);
    test_mkdir(dir, 0755);
    CHECK(tokens_refused(dir, MGPU_ERROR_IO, "not a regular file", NULL), "a directory");
    snprintf(bad, sizeof bad, "%s/bad.bin", g_dir);
    CHECK(write_file(bad, buf, 10), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "is 10 bytes, shorter than the 1024-byte header", NULL), "a 10-byte file");
    CHECK(write_file(bad, buf, 0), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "is 0 bytes", NULL), "an empty file");
    CHECK(write_file(bad, buf, 1023), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "is 1023 bytes", NULL), "a header one byte short");
    n = make_token_file(buf, 12345, 1, 5, tok, 5);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "has magic 12345, expected 20240520", "not a token file"), "another magic");
    n = make_token_file(buf, 20240801, 7, 5, tok, 5);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "has magic 20240801, expected 20240520", "Llama 3"), "llm.c's Llama 3 file");
    n = make_token_file(buf, 20240520, 2, 5, tok, 5);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "has version 2, expected 1", NULL), "another version");
    n = make_token_file(buf, 20240520, 1, 100, tok, 50);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "is truncated: its header says 100 tokens (1224 bytes in all), the file has 1124 bytes (50 tokens)",
                         NULL), "a truncated file");
    CHECK(write_file(bad, buf, n + 1), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "header says 100 tokens (1224 bytes in all), the file has 1125 bytes (50 tokens and a byte)", NULL),
          "a truncated file with an odd byte");
    n = make_token_file(buf, 20240520, 1, 5, tok, 8);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "has 6 bytes past its last token: its header says 5 tokens (1034 bytes in all), the file has 1040 bytes",
                         NULL), "extra bytes");
    n = make_token_file(buf, 20240520, 1, -3, tok, 0);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "token count is -3", NULL), "a negative count");
    n = make_token_file(buf, 20240520, 1, 0, tok, 0);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "is empty: its header says 0 tokens", NULL), "N = 0");
    n = make_token_file(buf, 20240520, 1, 0, tok, 1);
    CHECK(write_file(bad, buf, n), "write");
    CHECK(tokens_refused(bad, MGPU_ERROR_BAD_FILE, "2 bytes past its last token", NULL), "N = 0 with a token after the header");
    mgpu_clear_error();
    CHECK(!mgpu_tokens_load(NULL) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_load", "NULL"), "a NULL path");

    /* save's refusals: nothing written, no temporary file left */
    CHECK(err_is(mgpu_tokens_save(NULL, path), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_save", "NULL tokens"), "save NULL");
    CHECK(err_is(mgpu_tokens_save(t, ""), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_save", "no path"), "save to no path");
    CHECK(err_is(mgpu_tokens_save(t, dir), MGPU_ERROR_IO, dir, "a token file replaces only a regular file"), "save over a directory");
    snprintf(bad, sizeof bad, "%s/no-such-folder/t.bin", g_dir);
    CHECK(err_is(mgpu_tokens_save(t, bad), MGPU_ERROR_IO, bad, "cannot create the temporary file"), "save into a missing folder");
    CHECK(count_tmp_files(g_dir) == 0, "no temporary file left behind by failed saves");

    /* the byte-level tokenizer: every byte value, and text */
    {
        static const char text[] = "First Citizen:\nBefore we proceed any further, hear me speak.\n";
        uint8_t bytes[256 + sizeof text];
        for (i = 0; i < 256; ++i) bytes[i] = (uint8_t)(255 - i);
        memcpy(bytes + 256, text, sizeof text - 1);
        n = 256 + sizeof text - 1;
        snprintf(path, sizeof path, "%s/input.txt", g_dir);
        CHECK(write_file(path, bytes, n), "write");
        u = mgpu_tokens_from_text(path);
        for (i = 0, same = u && mgpu_tokens_count(u) == (int64_t)n; same && i < (int64_t)n; ++i) same &= mgpu_tokens_data(u)[i] == bytes[i];
        CHECK(same && mgpu_tokens_max_id(u) == 255, "text to tokens: token i is byte i (%zu bytes): %s", n, mgpu_last_error());
        snprintf(bad, sizeof bad, "%s/input.bin", g_dir);
        CHECK(u && mgpu_tokens_save(u, bad) == MGPU_OK, "the text's tokens saved: %s", mgpu_last_error());
        mgpu_tokens_destroy(u);
        u = mgpu_tokens_load(bad);
        for (i = 0, same = u && mgpu_tokens_count(u) == (int64_t)n; same && i < (int64_t)n; ++i) same &= mgpu_tokens_data(u)[i] == bytes[i];
        CHECK(same, "text -> token file -> tokens: the bytes again");
        mgpu_tokens_destroy(u);
        /* text alone: max id is the largest byte of the text */
        CHECK(write_file(path, text, sizeof text - 1), "write");
        u = mgpu_tokens_from_text(path);
        for (i = 0, top = 0; i < (int64_t)sizeof text - 1; ++i) top = (uint8_t)text[i] > top ? (uint8_t)text[i] : top;
        CHECK(u && mgpu_tokens_count(u) == (int64_t)sizeof text - 1 && mgpu_tokens_max_id(u) == top, "ASCII text: max id %d", top);
        mgpu_tokens_destroy(u);
        CHECK(write_file(path, text, 0), "write");
        mgpu_clear_error();
        CHECK(!mgpu_tokens_from_text(path) && err_is(mgpu_last_result(), MGPU_ERROR_BAD_FILE, path, "is empty"), "an empty text file");
        snprintf(bad, sizeof bad, "%s/no-such-text.txt", g_dir);
        CHECK(!mgpu_tokens_from_text(bad) && err_is(mgpu_last_result(), MGPU_ERROR_IO, bad, "mgpu_tokens_from_text"), "a missing text file");
    }
    mgpu_clear_error();
    CHECK(!mgpu_tokens_from_memory(tok, 0) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_tokens_from_memory", "0 tokens"),
          "from memory: 0 tokens");
    CHECK(mgpu_tokens_count(NULL) == 0 && mgpu_tokens_data(NULL) == NULL && mgpu_tokens_max_id(NULL) == -1, "NULL's count, data, max id");

    /* lifetimes: tokens outlive the data sets made from them */
    ds = mgpu_dataset_tokens(t, 4);
    CHECK(ds != NULL, "data set: %s", mgpu_last_error());
    CHECK(err_is(mgpu_tokens_destroy(t), MGPU_ERROR_IN_USE, "mgpu_tokens_destroy", "1 data set still reads"), "destroy while a data set reads them");
    CHECK(mgpu_tokens_count(t) == N, "the refused destroy changed nothing");
    CHECK(mgpu_dataset_destroy(ds) == MGPU_OK && mgpu_tokens_destroy(t) == MGPU_OK, "data set, then tokens: %s", mgpu_last_error());
    CHECK(mgpu_tokens_destroy(NULL) == MGPU_OK, "destroy NULL");

    /* printing byte tokens: printable ASCII, newline, tab and UTF-8 kept; the rest escaped */
    {
        static const int32_t ids[] = {'H', 'i', '\n', '\t', 1, '\\', 0xC3, 0xA9, 0xC3, 'x', 0xE4, 0xB8, 0xAD, 0xFF, 300, -1, 0x7F};
        const int count = (int)(sizeof ids / sizeof ids[0]);
        const char* expect = "Hi\n\t\\x01\\\\\xC3\xA9\\xC3x\xE4\xB8\xAD\\xFF<300><-1>\\x7F";
        char out[64];
        size_t need = mgpu_tokens_to_text(ids, count, out, sizeof out);
        CHECK(need == strlen(expect) && !strcmp(out, expect), "to_text: '%s' (%zu), want '%s' (%zu)", out, need, expect, strlen(expect));
        need = mgpu_tokens_to_text(ids, count, out, 8);   /* "Hi\n\t" fits, "\\x01" (4) not */
        CHECK(need == strlen(expect) && !strcmp(out, "Hi\n\t"), "to_text cut: whole pieces only: '%s'", out);
        need = mgpu_tokens_to_text(ids, 8, out, 11);   /* 10 bytes to the backslash's escape, then no room for the 2 bytes of U+00E9 */
        CHECK(!strcmp(out, "Hi\n\t\\x01\\\\") && need == 12, "to_text keeps a UTF-8 character whole: '%s' %zu", out, need);
        CHECK(mgpu_tokens_to_text(ids, count, NULL, 0) == strlen(expect), "to_text measures with size 0");
        CHECK(mgpu_tokens_to_text(NULL, 5, out, sizeof out) == 0 && out[0] == 0, "to_text of NULL ids: ''");
    }
}

/* ------------------------------------------------------------- windows of tokens, batches --- */
/* Token i is i + 1000 (below 65536): a window's first x is 1000 + jT, so every row says which
   window it is. Checks a batch's shape and that row r is window want[r] exactly (x and y). */
static int tokens_batch_is(const mgpu_tensor* x, const mgpu_tensor* y, int T, const int64_t* want, int rows) {
    const int32_t *xs, *ys;
    int r, k, ok;
    mgpu_shape sx = mgpu_tensor_shape(x), sy = mgpu_tensor_shape(y);
    ok = sx.ndim == 2 && sy.ndim == 2 && sx.dim[0] == rows && sy.dim[0] == rows && sx.dim[1] == T && sy.dim[1] == T &&
         mgpu_tensor_dtype(x) == MGPU_I32 && mgpu_tensor_dtype(y) == MGPU_I32;
    if (!ok) return 0;
    xs = (const int32_t*)mgpu_tensor_data(x);
    ys = (const int32_t*)mgpu_tensor_data(y);
    for (r = 0; r < rows; ++r)
        for (k = 0; k < T; ++k)
            ok &= xs[r * T + k] == 1000 + want[r] * T + k && ys[r * T + k] == 1000 + want[r] * T + k + 1;
    return ok;
}
/* the window of each row of a batch (-1 where the row is no window's) */
static void tokens_rows(const mgpu_tensor* x, int T, int64_t* out) {
    const int32_t* xs = (const int32_t*)mgpu_tensor_data(x);
    int64_t r;
    for (r = 0; r < mgpu_tensor_dim(x, 0); ++r) out[r] = (xs[r * T] - 1000) % T == 0 ? (xs[r * T] - 1000) / T : -1;
}

static void test_tokens_windows(void) {
    enum { N = 23, T = 4, W = (N - 1) / T, NS = 203, WS = (NS - 1) / T };   /* W = 5 windows; WS = 50 */
    uint16_t tok[NS];
    char path[512];
    mgpu_tokens *t, *ts, *t1;
    mgpu_dataset *ds, *dss, *ds1;
    mgpu_loader* l;
    mgpu_loader_desc ld;
    const mgpu_tensor *x, *y;
    int64_t want[8], got[64];
    int i, b, ok;
    for (i = 0; i < NS; ++i) tok[i] = (uint16_t)(1000 + i);
    /* through a file, as a program reads one */
    t = mgpu_tokens_from_memory(tok, N);
    snprintf(path, sizeof path, "%s/windows.bin", g_dir);
    CHECK(t && mgpu_tokens_save(t, path) == MGPU_OK, "save: %s", mgpu_last_error());
    mgpu_tokens_destroy(t);
    t = mgpu_tokens_load(path);
    ts = mgpu_tokens_from_memory(tok, NS);
    CHECK(t && ts, "tokens: %s", mgpu_last_error());
    if (!t || !ts) return;
    ds = mgpu_dataset_tokens(t, T);
    CHECK(ds && ds->count == W && ds->seq == T && ds->tokens == t && !ds->images && !ds->labels,
          "%d tokens in windows of %d: W = (N - 1) / T = %d windows (%lld)", N, T, W, ds ? (long long)ds->count : -1ll);
    if (!ds) return;

    /* no shuffle, defaults (the evaluation loop): every window once in order, the last batch smaller */
    memset(&ld, 0, sizeof ld);
    ld.batch = 2;
    l = mgpu_loader_create(ds, &ld);
    CHECK(l && mgpu_loader_batches(l) == 3, "5 windows in batches of 2: 3 batches: %s", mgpu_last_error());
    for (b = 0, ok = 1; l && mgpu_loader_next(l, &x, &y); ++b) {
        int rows = b < 2 ? 2 : 1;
        for (i = 0; i < rows; ++i) want[i] = 2 * b + i;
        ok &= b < 3 && tokens_batch_is(x, y, T, want, rows);
    }
    CHECK(ok && b == 3, "in order: x = t[jT .. jT+T), y = t[jT+1 .. jT+T+1) for windows 0,1 | 2,3 | 4 (%d batches)", b);
    CHECK(l && !mgpu_loader_next(l, &x, &y), "next after the epoch's end: 0");
    mgpu_loader_destroy(l);

    /* wrap: the last batch completed with windows 0, 1, ... (the training loop's fixed [B, T]) */
    ld.wrap = 1;
    ld.batch = 2;
    l = mgpu_loader_create(ds, &ld);
    CHECK(l && mgpu_loader_batches(l) == 3, "wrap: 3 batches");
    for (b = 0, ok = 1; l && mgpu_loader_next(l, &x, &y); ++b) {
        for (i = 0; i < 2; ++i) want[i] = (2 * b + i) % W;
        ok &= b < 3 && tokens_batch_is(x, y, T, want, 2);
    }
    CHECK(ok && b == 3, "wrap: windows 0,1 | 2,3 | 4,0 (%d batches)", b);
    if (l) {
        mgpu_loader_start(l, 1);
        want[0] = 0; want[1] = 1;
        CHECK(mgpu_loader_next(l, &x, &y) && tokens_batch_is(x, y, T, want, 2), "the next epoch starts at window 0 again");
    }
    mgpu_loader_destroy(l);
    ld.batch = 3;
    l = mgpu_loader_create(ds, &ld);
    for (b = 0, ok = 1; l && mgpu_loader_next(l, &x, &y); ++b) {
        for (i = 0; i < 3; ++i) want[i] = (3 * b + i) % W;
        ok &= b < 2 && tokens_batch_is(x, y, T, want, 3);
    }
    CHECK(ok && b == 2, "wrap, batches of 3: windows 0,1,2 | 3,4,0 (%d batches)", b);
    mgpu_loader_destroy(l);
    ld.batch = 12;   /* more than the windows: they come round again */
    l = mgpu_loader_create(ds, &ld);
    CHECK(l && mgpu_loader_batches(l) == 1 && mgpu_loader_next(l, &x, &y) && mgpu_tensor_dim(x, 0) == 12, "wrap, 12 rows of 5 windows");
    if (l) {
        tokens_rows(x, T, got);
        for (i = 0, ok = 1; i < 12; ++i) ok &= got[i] == i % W;
        CHECK(ok && !mgpu_loader_next(l, &x, &y), "wrap, 12 rows: windows 0..4, 0..4, 0, 1");
    }
    mgpu_loader_destroy(l);

    /* drop_last: the partial batch skipped; with wrap: refused */
    ld.wrap = 0;
    ld.drop_last = 1;
    ld.batch = 2;
    l = mgpu_loader_create(ds, &ld);
    for (b = 0, ok = 1; l && mgpu_loader_next(l, &x, &y); ++b) {
        for (i = 0; i < 2; ++i) want[i] = 2 * b + i;
        ok &= b < 2 && tokens_batch_is(x, y, T, want, 2);
    }
    CHECK(l && ok && b == 2 && mgpu_loader_batches(l) == 2, "drop_last: windows 0,1 | 2,3 (%d batches)", b);
    mgpu_loader_destroy(l);
    ld.wrap = 1;
    mgpu_clear_error();
    CHECK(!mgpu_loader_create(ds, &ld) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "wrap and drop_last", NULL), "wrap with drop_last");
    ld.wrap = 0;
    ld.drop_last = 0;
    /* mean and std normalise pixels: refused for tokens */
    ld.mean = 0.5f;
    mgpu_clear_error();
    CHECK(!mgpu_loader_create(ds, &ld) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "mean 0.5", "token data set"), "mean for tokens");
    ld.mean = 0.0f;
    ld.std = 2.0f;
    mgpu_clear_error();
    CHECK(!mgpu_loader_create(ds, &ld) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "std 2", "leave both 0"), "std for tokens");
    ld.std = 0.0f;
    /* the data set and its tokens outlive the loader */
    l = mgpu_loader_create(ds, NULL);
    CHECK(l && mgpu_loader_batches(l) == 1 && mgpu_loader_next(l, &x, &y) && mgpu_tensor_dim(x, 0) == W, "defaults: one batch of 5 windows");
    CHECK(err_is(mgpu_dataset_destroy(ds), MGPU_ERROR_IN_USE, "1 loader", NULL) && err_is(mgpu_tokens_destroy(t), MGPU_ERROR_IN_USE, "1 data set", NULL),
          "destroying the data set or the tokens while read: refused");
    mgpu_loader_destroy(l);

    /* shuffle: each epoch a permutation of the 50 windows, a function of (seed, epoch) */
    dss = mgpu_dataset_tokens(ts, T);
    CHECK(dss && dss->count == WS, "%d tokens: %d windows", NS, WS);
    if (dss) {
        int64_t order[3][WS];
        int e, seen[WS];
        ld.batch = 8;
        ld.shuffle = 1;
        ld.seed = 11;
        l = mgpu_loader_create(dss, &ld);
        for (e = 0, ok = 1; l && e < 3; ++e) {
            int count = 0;
            mgpu_loader_start(l, e == 2 ? 0 : e);
            memset(seen, 0, sizeof seen);
            while (mgpu_loader_next(l, &x, &y)) {
                int rows = (int)mgpu_tensor_dim(x, 0);
                tokens_rows(x, T, got);
                for (i = 0; i < rows; ++i) {
                    ok &= got[i] >= 0 && got[i] < WS && count + i < WS;
                    if (got[i] < 0 || got[i] >= WS || count + i >= WS) break;
                    seen[got[i]]++;
                    order[e][count + i] = got[i];
                }
                /* every row's y is its x shifted by one: check the batch against its own windows */
                ok &= count + rows <= WS && tokens_batch_is(x, y, T, got, rows);
                count += rows;
            }
            for (i = 0; i < WS; ++i) ok &= seen[i] == 1;
            ok &= count == WS;
        }
        CHECK(l && ok, "shuffled: every epoch a permutation of the windows, each row x and y of one window");
        CHECK(memcmp(order[0], order[1], sizeof order[0]) != 0, "epochs 0 and 1: the same order");
        CHECK(memcmp(order[0], order[2], sizeof order[0]) == 0, "epoch 0 twice: different orders");
        for (i = 0, ok = 1; i < WS; ++i) ok &= order[0][i] == i;
        CHECK(!ok, "shuffle left the order as it was");
        mgpu_loader_destroy(l);
        l = mgpu_loader_create(dss, &ld);   /* another loader, the same seed: the same epoch 1 */
        if (l) {
            int count = 0;
            mgpu_loader_start(l, 1);
            for (ok = 1; mgpu_loader_next(l, &x, &y); count += (int)mgpu_tensor_dim(x, 0)) {
                tokens_rows(x, T, got);
                for (i = 0; i < mgpu_tensor_dim(x, 0); ++i) ok &= got[i] == order[1][count + i];
            }
            CHECK(ok && count == WS, "the same seed and epoch in another loader: the same order");
            mgpu_loader_destroy(l);
        }
        ld.seed = 12;
        l = mgpu_loader_create(dss, &ld);
        if (l) {
            int count = 0;
            for (ok = 1; mgpu_loader_next(l, &x, &y); count += (int)mgpu_tensor_dim(x, 0)) {
                tokens_rows(x, T, got);
                for (i = 0; i < mgpu_tensor_dim(x, 0); ++i) ok &= got[i] == order[0][count + i];
            }
            CHECK(!ok, "seeds 11 and 12 give the same order");
            mgpu_loader_destroy(l);
        }
        /* shuffled with wrap: 7 batches of 8, the last one's 6 missing rows the epoch's first 6 windows */
        ld.seed = 11;
        ld.wrap = 1;
        l = mgpu_loader_create(dss, &ld);
        if (l) {
            int count = 0;
            mgpu_loader_start(l, 1);
            for (b = 0, ok = 1; mgpu_loader_next(l, &x, &y); ++b, count += 8) {
                ok &= mgpu_tensor_dim(x, 0) == 8;
                tokens_rows(x, T, got);
                for (i = 0; ok && i < 8; ++i) ok &= got[i] == order[1][(count + i) % WS];
            }
            CHECK(ok && b == 7 && mgpu_loader_batches(l) == 7, "shuffled with wrap: epoch 1's order, then its first 6 windows (%d batches)", b);
            mgpu_loader_destroy(l);
        }
        ld.wrap = 0;
        ld.shuffle = 0;

        /* sharding across 2 processes: each one's rows of every batch as mgpu__split gives them
           out (3 and 2 of a batch of 5), the two together the whole batch. The model is made to
           look like one replica of a job of 2 processes (what mgpu_dist_init would set up). */
        {
            mgpu_layer* layers[1];
            mgpu_model_desc md;
            mgpu_model* m;
            mgpu_loader *whole, *part[2];
            int q;
            memset(&md, 0, sizeof md);
            layers[0] = mgpu_layer_linear(T, 2);
            md.input = mgpu_shape1(T);
            md.layers = layers;
            md.layer_count = 1;
            m = mgpu_model_create(&md);
            CHECK(m != NULL, "model: %s", mgpu_last_error());
            if (m) {
                ld.batch = 5;
                ld.shuffle = 1;
                ld.wrap = 1;   /* 50 windows in batches of 5: also checks that shards and wrap agree */
                ld.seed = 3;
                whole = mgpu_loader_create(dss, &ld);
                ld.shard_for = m;
                part[0] = mgpu_loader_create(dss, &ld);
                part[1] = mgpu_loader_create(dss, &ld);
                ld.shard_for = NULL;
                m->dist = 1;
                m->dist_total = 2;
                for (b = 0, ok = whole && part[0] && part[1]; ok && mgpu_loader_next(whole, &x, &y); ++b) {
                    int64_t all[5];
                    tokens_rows(x, T, all);
                    for (q = 0; q < 2; ++q) {
                        const int64_t from = q == 0 ? 0 : 3, rows = q == 0 ? 3 : 2;
                        const mgpu_tensor *px, *py;
                        m->dist_first = q;
                        ok &= mgpu_loader_next(part[q], &px, &py) && tokens_batch_is(px, py, T, all + from, (int)rows);
                    }
                }
                m->dist_first = 0;
                CHECK(ok && b == 10 && !mgpu_loader_next(part[0], &x, &y) && !mgpu_loader_next(part[1], &x, &y),
                      "2 processes: rows 0..2 and 3..4 of each of the 10 batches, then both end");
                m->dist = 0;
                m->dist_total = 0;
                mgpu_loader_destroy(whole);
                mgpu_loader_destroy(part[0]);
                mgpu_loader_destroy(part[1]);
                mgpu_model_destroy(m);
            }
            memset(&ld, 0, sizeof ld);
        }
        mgpu_dataset_destroy(dss);
    }

    /* a file of exactly T + 1 tokens: one window; of T tokens: none */
    t1 = mgpu_tokens_from_memory(tok, T + 1);
    ds1 = t1 ? mgpu_dataset_tokens(t1, T) : NULL;
    CHECK(ds1 && ds1->count == 1, "T + 1 tokens: one window: %s", mgpu_last_error());
    if (ds1) {
        memset(&ld, 0, sizeof ld);
        ld.batch = 4;
        l = mgpu_loader_create(ds1, &ld);
        want[0] = 0;
        CHECK(l && mgpu_loader_next(l, &x, &y) && tokens_batch_is(x, y, T, want, 1) && !mgpu_loader_next(l, &x, &y),
              "T + 1 tokens: one batch of one window, x = t[0..T), y = t[1..T]");
        mgpu_loader_destroy(l);
        ld.wrap = 1;
        l = mgpu_loader_create(ds1, &ld);
        want[1] = want[2] = want[3] = 0;
        CHECK(l && mgpu_loader_next(l, &x, &y) && tokens_batch_is(x, y, T, want, 4) && !mgpu_loader_next(l, &x, &y),
              "T + 1 tokens, wrap: one batch of 4 rows, window 0 each time");
        mgpu_loader_destroy(l);
        mgpu_dataset_destroy(ds1);
    }
    mgpu_tokens_destroy(t1);
    t1 = mgpu_tokens_from_memory(tok, T);
    mgpu_clear_error();
    CHECK(t1 && !mgpu_dataset_tokens(t1, T) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "N = 4 tokens", "T = 4"),
          "T tokens: no window, the message names N and T");
    mgpu_clear_error();
    CHECK(!mgpu_dataset_tokens(t1, 0) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "seq 0", NULL), "seq 0");
    CHECK(!mgpu_dataset_tokens(NULL, 4) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "NULL tokens", NULL), "NULL tokens");
    mgpu_tokens_destroy(t1);
    /* a data set filled by hand that claims more windows than its tokens hold: refused */
    {
        mgpu_dataset hand;
        memset(&hand, 0, sizeof hand);
        hand.tokens = t;
        hand.seq = T;
        hand.count = W + 1;
        mgpu_clear_error();
        CHECK(!mgpu_loader_create(&hand, NULL) && err_is(mgpu_last_result(), MGPU_ERROR_INVALID_ARGUMENT, "6 windows of seq 4", "make 5"),
              "a hand-filled token data set of too many windows");
    }
    CHECK(mgpu_dataset_destroy(ds) == MGPU_OK && mgpu_tokens_destroy(t) == MGPU_OK && mgpu_tokens_destroy(ts) == MGPU_OK, "destroy: %s",
          mgpu_last_error());
}

/* build/test_io GROUP (or TEST_ONLY=GROUP) runs only the groups whose call contains GROUP, as in
   the suites built on tests/test.h; a filter that matches nothing fails. */
static const char* g_only;
static int g_groups;
#define TEST_GROUP(call) do { if (!g_only || strstr(#call, g_only)) { g_groups++; call; } } while (0)

int main(int argc, char** argv) {
    char cmd[300];
    double t0 = now_s();
    g_only = argc > 1 ? argv[1] : getenv("TEST_ONLY");
    if (g_only && !*g_only) g_only = NULL;
    g_verbose = getenv("TEST_VERBOSE") != NULL;
    strcpy(g_dir, "/tmp/mgpu_io_test.XXXXXX");
    if (!test_mkdtemp(g_dir, sizeof g_dir)) { perror("mkdtemp"); return 2; }
    chmod(g_dir, 0755); /* the unwritable-directory test runs as `nobody` when we are root */
    test_mkdir(FIXTURES, 0755);
    printf("== gzip\n");
    TEST_GROUP(test_gzip());
    TEST_GROUP(test_gzip_random_bodies(50000));
    TEST_GROUP(test_mnist());
    printf("== IDX\n");
    TEST_GROUP(test_idx());
    printf("== safetensors\n");
    TEST_GROUP(test_st_good_json());
    TEST_GROUP(test_st_malformed());
    TEST_GROUP(test_st_reference_rules());
    TEST_GROUP(test_st_roundtrip());
    TEST_GROUP(test_st_python());
    TEST_GROUP(test_st_fuzz(20000));
    TEST_GROUP(test_st_writer_errors());
    TEST_GROUP(test_st_save_paths());
    printf("== the public safetensors reader\n");
    TEST_GROUP(test_reader_roundtrip());
    TEST_GROUP(test_reader_dtypes());
    TEST_GROUP(test_reader_unsupported());
    TEST_GROUP(test_reader_python());
    TEST_GROUP(test_reader_malformed(2000));
    printf("== token files and windows\n");
    TEST_GROUP(test_tokens_files());
    TEST_GROUP(test_tokens_windows());
#ifdef _WIN32
    (void)cmd;
    test_remove_tree(g_dir);
#else
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", g_dir);
#endif
    printf("(%.1f s)\n", now_s() - t0);
    if (g_only && g_groups == 0) { g_fail++; printf("  FAIL no group of test_io matches '%s'\n", g_only); }
    printf("%d passed, %d failed, %d skipped\n", g_pass, g_fail, g_skip);
    return g_fail ? 1 : 0;
}
