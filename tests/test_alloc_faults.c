/* tests/test_alloc_faults.c - every host allocation failing in turn (issue 12).

   MGPU_MALLOC/REALLOC/FREE are a counting allocator here. A short scenario (a CPU device set, a
   small MLP, SGD with momentum, a few training steps, a checkpoint saved to a scratch folder and
   loaded into a second model, everything destroyed) runs once to count its K allocations, then
   K times with allocation N = 1..K failing. Every run must either fail with an error that says
   so (MGPU_ERROR_OUT_OF_MEMORY, and a last error that mentions memory) or succeed with the very
   parameters of the clean run (a fallback, e.g. the caching allocator giving a block straight
   back when it has no memory for its list node, or retrying after emptying its cache), and
   must leave no block behind: the live count is 0 after the scenario destroyed what it made.
   A second scenario does the same on two CPU replicas with AdamW, a loader, evaluation, the
   safetensors reader, and a token file saved, loaded and read as windows by a loader. The CPU backend runs on one thread, so the Nth allocation is the same one
   in every run. Then the same sweeps with memory staying short: every allocation
   from the Nth on fails, the destroys included.
   MGPU_ALLOC_FAULTS_STRIDE=S tries only every S-th allocation (for a quicker look).
   Usage: build/test_alloc_faults */
#include <stdlib.h>
static long g_alloc_count;   /* allocations so far in this run */
static long g_fail_at;       /* the allocation that fails (1-based); 0: none */
static long g_live;          /* blocks not yet freed */
static long g_failed;        /* allocations refused in this run */
static int g_persist;        /* 1: every allocation from g_fail_at on fails (memory stays short) */
static int test_fails(void) {
    ++g_alloc_count;
    return g_fail_at && (g_alloc_count == g_fail_at || (g_persist && g_alloc_count > g_fail_at));
}
static void* test_malloc(size_t n) {
    void* p;
    if (test_fails()) { g_failed++; return NULL; }
    p = malloc(n ? n : 1);
    if (p) g_live++;
    return p;
}
static void* test_realloc(void* p, size_t n) {
    void* q;
    if (!p) return test_malloc(n);
    if (test_fails()) { g_failed++; return NULL; }
    q = realloc(p, n ? n : 1);
    return q;
}
static void test_free(void* p) {
    if (p) { g_live--; free(p); }
}
#define MGPU_MALLOC(sz) test_malloc(sz)
#define MGPU_REALLOC(p, sz) test_realloc(p, sz)
#define MGPU_FREE(p) test_free(p)
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"
#include <ctype.h>
#include <dirent.h>
#include <sys/stat.h>

#undef IN    /* <windows.h>'s, empty */
#undef OUT
#define IN 8
#define HIDDEN 16
#define OUT 4
#define BATCH 8
#define STEPS 3

static char g_dir[256], g_path[300], g_tok_path[300];

static void quiet(mgpu_log_level level, const char* message, void* user) { (void)level; (void)message; (void)user; }

static mgpu_model* make_model(const mgpu_device_set* set) {
    mgpu_layer* layers[3];
    mgpu_model_desc d;
    memset(&d, 0, sizeof d);
    layers[0] = mgpu_layer_linear(IN, HIDDEN);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(HIDDEN, OUT);
    d.input = mgpu_shape1(IN);
    d.layers = layers;
    d.layer_count = 3;
    d.devices = set;
    d.seed = 7;
    return mgpu_model_create(&d);
}

typedef struct outcome {
    mgpu_result rc;                 /* of the first failing call, or MGPU_OK */
    char error[1100];   /* the last error, whole */
    float params[IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT + 64];
    size_t floats;
    int leftovers;                  /* destroy calls that refused */
} outcome;

#define STEP(call)                                                         \
    do {                                                                   \
        if (o->rc == MGPU_OK) {                                            \
            mgpu_result r_ = (call);                                       \
            if (r_ != MGPU_OK) {                                           \
                o->rc = r_;                                                \
                snprintf(o->error, sizeof o->error, "%s", mgpu_last_error()); \
            }                                                              \
        }                                                                  \
    } while (0)
#define MADE(ptr, expr)                                                    \
    do {                                                                   \
        if (o->rc == MGPU_OK && !((ptr) = (expr))) {                       \
            o->rc = mgpu_last_result() != MGPU_OK ? mgpu_last_result() : MGPU_ERROR_INVALID_ARGUMENT; \
            snprintf(o->error, sizeof o->error, "%s", mgpu_last_error()); \
        }                                                                  \
    } while (0)
#define DESTROY(call) do { if ((call) != MGPU_OK) o->leftovers++; } while (0)

/* The second scenario's extras: two CPU replicas (data parallel, host all-reduce), AdamW, a
   loader over a data set made here, evaluation, a checkpoint with metadata read back with the
   safetensors reader and loaded under load_ex. */
static int g_wide;

/* The scenario; everything it makes it destroys, whatever failed. */
static void scenario(outcome* o) {
    mgpu_device_set* set = NULL;
    mgpu_model *m = NULL, *m2 = NULL;
    mgpu_optimizer *opt = NULL, *opt2 = NULL;
    mgpu_tensor *x = NULL, *y = NULL;
    mgpu_optimizer_desc od;
    mgpu_dataset* ds = NULL;
    mgpu_loader* loader = NULL;
    mgpu_safetensors* st = NULL;
    mgpu_tensor* read = NULL;
    mgpu_tokens *tokens = NULL, *tokens2 = NULL;
    mgpu_dataset* tds = NULL;
    mgpu_loader* tloader = NULL;
    float xs[BATCH * IN];
    int32_t ys[BATCH];
    int i;
    memset(o, 0, sizeof *o);
    memset(&od, 0, sizeof od);
    od.kind = g_wide ? MGPU_ADAMW : MGPU_SGD;
    od.lr = 0.1f;
    od.momentum = 0.9f;
    for (i = 0; i < BATCH * IN; ++i) xs[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    for (i = 0; i < BATCH; ++i) ys[i] = i % OUT;
    mgpu_clear_error();
    MADE(set, mgpu_device_set_create(g_wide ? "cpu:2" : "cpu"));
    MADE(m, make_model(set));
    MADE(opt, mgpu_optimizer_create(m, &od));
    MADE(x, mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_F32, mgpu_shape2(BATCH, IN)));
    MADE(y, mgpu_tensor_create(mgpu_device_set_get(set, 0), MGPU_I32, mgpu_shape1(BATCH)));
    STEP(mgpu_tensor_upload(x, xs, sizeof xs));
    STEP(mgpu_tensor_upload(y, ys, sizeof ys));
    for (i = 0; i < STEPS; ++i) STEP(mgpu_model_train_step(m, opt, x, y, NULL));
    if (g_wide && o->rc == MGPU_OK) {   /* a loader over a 2x4 data set of 8 samples, and evaluation */
        const mgpu_tensor *bx, *by;
        mgpu_loader_desc ld;
        float loss;
        int64_t correct;
        memset(&ld, 0, sizeof ld);
        ld.batch = 4;
        ld.shuffle = 1;
        ds = (mgpu_dataset*)MGPU_MALLOC(sizeof *ds);   /* the library's allocator: it frees it */
        if (ds) {
            memset(ds, 0, sizeof *ds);
            ds->count = 8;
            ds->rows = 2;
            ds->cols = 4;
            ds->images = (uint8_t*)MGPU_MALLOC(8 * IN);
            ds->labels = (uint8_t*)MGPU_MALLOC(8);
        }
        if (!ds || !ds->images || !ds->labels) {
            o->rc = MGPU_ERROR_OUT_OF_MEMORY;
            snprintf(o->error, sizeof o->error, "the test's data set: out of memory");
        } else {
            for (i = 0; i < 8 * IN; ++i) ds->images[i] = (uint8_t)(i * 29);
            for (i = 0; i < 8; ++i) ds->labels[i] = (uint8_t)(i % OUT);
        }
        MADE(loader, mgpu_loader_create(ds, &ld));
        mgpu_loader_start(loader, 1);
        while (o->rc == MGPU_OK && mgpu_loader_next(loader, &bx, &by)) {
            mgpu_tensor* flat = mgpu_tensor_view_reshape((mgpu_tensor*)bx, mgpu_shape2(4, IN));
            MADE(flat, flat);
            STEP(mgpu_model_train_step(m, opt, flat, by, NULL));
            mgpu_tensor_destroy(flat);
        }
        STEP(mgpu_model_evaluate(m, x, y, &loss, &correct));
    }
    if (g_wide && o->rc == MGPU_OK) {   /* token windows: a token file saved, loaded, read by a loader with wrap */
        uint16_t toks[14];
        const mgpu_tensor *bx, *by;
        mgpu_loader_desc tl;
        for (i = 0; i < 14; ++i) toks[i] = (uint16_t)(100 + i);
        MADE(tokens, mgpu_tokens_from_memory(toks, 14));
        STEP(mgpu_tokens_save(tokens, g_tok_path));
        MADE(tokens2, mgpu_tokens_load(g_tok_path));
        MADE(tds, mgpu_dataset_tokens(tokens2, 4));   /* 3 windows */
        memset(&tl, 0, sizeof tl);
        tl.batch = 2;
        tl.shuffle = 1;
        tl.wrap = 1;
        MADE(tloader, mgpu_loader_create(tds, &tl));
        mgpu_loader_start(tloader, 1);
        while (o->rc == MGPU_OK && mgpu_loader_next(tloader, &bx, &by)) {
            const int32_t *xv = (const int32_t*)mgpu_tensor_data(bx), *yv = (const int32_t*)mgpu_tensor_data(by);
            for (i = 0; i < 8; ++i)
                if (yv[i] != xv[i] + 1 || (xv[i - i % 4] - 100) % 4 != 0) {
                    o->rc = MGPU_ERROR_BAD_FILE;
                    snprintf(o->error, sizeof o->error, "token windows read back wrong");
                }
        }
    }
    if (g_wide) {
        mgpu_metadata meta[1];
        mgpu_save_desc sd;
        meta[0].key = "note";
        meta[0].value = "alloc faults";
        memset(&sd, 0, sizeof sd);
        sd.metadata = meta;
        sd.metadata_count = 1;
        STEP(mgpu_model_save_ex(m, opt, g_path, &sd));
        MADE(st, mgpu_safetensors_open(g_path));
        if (o->rc == MGPU_OK && (!mgpu_safetensors_metadata(st, "note") || mgpu_safetensors_count(st) < 4)) {
            o->rc = MGPU_ERROR_BAD_FILE;
            snprintf(o->error, sizeof o->error, "the checkpoint read back wrong: %s", mgpu_last_error());
        }
        MADE(read, mgpu_safetensors_read(st, "0.weight", NULL));
    } else
        STEP(mgpu_model_save(m, opt, g_path));
    MADE(m2, make_model(set));
    MADE(opt2, mgpu_optimizer_create(m2, &od));
    if (g_wide) {
        mgpu_load_desc ld;
        memset(&ld, 0, sizeof ld);
        STEP(mgpu_model_load_ex(m2, opt2, g_path, &ld));
    } else
        STEP(mgpu_model_load(m2, opt2, g_path));
    STEP(mgpu_model_train_step(m2, opt2, x, y, NULL));   /* the loaded momentum is used */
    if (o->rc == MGPU_OK) {
        const mgpu_tensor* p = mgpu_model_params(m2, 0);
        o->floats = (size_t)mgpu_tensor_numel(p);
        if (o->floats > sizeof o->params / sizeof(float)) o->floats = 0;
        STEP(mgpu_tensor_download(p, o->params, o->floats * sizeof(float)));
    }
    DESTROY(mgpu_tensor_destroy(read));
    mgpu_safetensors_close(st);
    mgpu_loader_destroy(loader);
    DESTROY(mgpu_dataset_destroy(ds));
    mgpu_loader_destroy(tloader);
    DESTROY(mgpu_dataset_destroy(tds));
    DESTROY(mgpu_tokens_destroy(tokens2));
    DESTROY(mgpu_tokens_destroy(tokens));
    mgpu_optimizer_destroy(opt2);
    DESTROY(mgpu_model_destroy(m2));
    mgpu_optimizer_destroy(opt);
    DESTROY(mgpu_model_destroy(m));
    DESTROY(mgpu_tensor_destroy(x));
    DESTROY(mgpu_tensor_destroy(y));
    for (i = 0; i < mgpu_device_set_count(set); ++i) mgpu_memory_empty_cache(mgpu_device_set_get(set, i));
    DESTROY(mgpu_device_set_destroy(set));
    mgpu_memory_empty_cache(mgpu_device_cpu());
}

static int mentions_memory(const char* s) {
    char low[1100];
    size_t i;
    for (i = 0; s[i] && i + 1 < sizeof low; ++i) low[i] = (char)tolower((unsigned char)s[i]);
    low[i] = 0;
    return strstr(low, "memory") != NULL;
}

/* Files left in the scratch folder other than the checkpoint (a failed save's temporary). */
static int stray_files(void) {
    DIR* d = opendir(g_dir);
    struct dirent* e;
    int n = 0;
    if (!d) return 0;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "ckpt.safetensors") && strcmp(e->d_name, "tokens.bin")) n++;
    closedir(d);
    return n;
}

static void sweep(const char* name, int persist) {
    static outcome clean, run;
    long k, n, stride = 1, failures = 0, fallbacks = 0, bad = 0;
    const char* s = getenv("MGPU_ALLOC_FAULTS_STRIDE");
    double t0 = now_seconds();
    header(name);
    g_persist = 0;
    if (s && atol(s) > 1) stride = atol(s);
    g_fail_at = 0;
    g_alloc_count = 0;
    g_live = 0;
    scenario(&clean);
    k = g_alloc_count;
    CHECK(clean.rc == MGPU_OK && clean.floats > 0, "the clean run: %s", clean.error);
    CHECK(g_live == 0, "the clean run leaves %ld blocks", g_live);
    if (clean.rc != MGPU_OK) return;
    printf("  %ld allocations in the scenario%s\n", k, persist ? "; each run fails every one from the Nth on" : "");
    g_persist = persist;
    for (n = 1; n <= k; n += stride) {
        g_fail_at = n;
        g_alloc_count = 0;
        g_live = 0;
        g_failed = 0;
        remove(g_path);
        remove(g_tok_path);
        scenario(&run);
        if (test_is_verbose())
            printf("  allocation %ld: %s%s%s\n", n, run.rc ? mgpu_result_string(run.rc) : "ok", run.rc ? ": " : "", run.error);
        if (!g_persist) CHECK(g_failed == 1, "allocation %ld was refused %ld times (the count drifted)", n, g_failed);
        if (g_live != 0 || run.leftovers) {
            CHECK(0, "allocation %ld failing: %ld blocks left, %d destroys refused (%s)", n, g_live, run.leftovers,
                  run.rc ? run.error : "the run succeeded");
            bad++;
        } else if (run.rc != MGPU_OK) {
            failures++;
            if (run.rc != MGPU_ERROR_OUT_OF_MEMORY || !mentions_memory(run.error)) {
                CHECK(0, "allocation %ld failing: %s with the message '%s' (want out of memory, and a message saying so)", n,
                      mgpu_result_string(run.rc), run.error);
                bad++;
            }
        } else {
            fallbacks++;
            if (run.floats != clean.floats || memcmp(run.params, clean.params, clean.floats * sizeof(float)) != 0) {
                CHECK(0, "allocation %ld failing: the run succeeded with other parameters", n);
                bad++;
            }
        }
        if (stray_files()) {
            CHECK(0, "allocation %ld failing: %d stray files in %s", n, stray_files(), g_dir);
            bad++;
            break;
        }
    }
    CHECK(bad == 0, "%ld of %ld runs misbehaved", bad, (k + stride - 1) / stride);
    printf("  %ld runs: %ld failed cleanly, %ld succeeded through a fallback with exact results (%.1f s)\n",
           (k + stride - 1) / stride, failures, fallbacks, now_seconds() - t0);
    g_fail_at = 0;
    g_persist = 0;
}

/* one CPU device, SGD with momentum, save and load */
static void test_sweep_mlp(void) { sweep("sweep_mlp", 0); }
static void test_sweep_mlp_short(void) { sweep("sweep_mlp_short", 1); }
/* two CPU replicas, AdamW, a loader, evaluation, metadata, the safetensors reader, load_ex */
static void test_sweep_data_parallel(void) { sweep("sweep_data_parallel", 0); }
static void test_sweep_data_parallel_short(void) { sweep("sweep_data_parallel_short", 1); }

int main(int argc, char** argv) {
    (void)test_rel_error;   /* test.h's, unused here */
    test_start("test_alloc_faults");
    test_select(argc, argv);
    mgpu_cpu_set_threads(1);    /* one thread: the Nth allocation is the same one every run */
    mgpu_log_set_callback(quiet, NULL);
    {
        char name[64];
        snprintf(name, sizeof name, "mgpu_alloc_faults_%d", (int)test_getpid());
        test_tmp_path(g_dir, sizeof g_dir, name);
    }
    snprintf(g_path, sizeof g_path, "%s/ckpt.safetensors", g_dir);
    snprintf(g_tok_path, sizeof g_tok_path, "%s/tokens.bin", g_dir);
    if (test_mkdir(g_dir, 0700) != 0) { CHECK(0, "mkdir %s", g_dir); return test_summary("test_alloc_faults"); }
    g_wide = 0;
    TEST_GROUP(test_sweep_mlp());
    TEST_GROUP(test_sweep_mlp_short());
    g_wide = 1;
    TEST_GROUP(test_sweep_data_parallel());
    TEST_GROUP(test_sweep_data_parallel_short());
    remove(g_path);
    remove(g_tok_path);
    test_remove_tree(g_dir);
    return test_summary("test_alloc_faults");
}
