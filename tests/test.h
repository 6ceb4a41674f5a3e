/* tests/test.h - the smallest test harness that does the job.
   CHECK(cond, fmt, ...) records a pass or a failure (with file:line and a message);
   SKIP(fmt, ...) records a skip with its reason; test_summary() prints the last line
   "N passed, N failed, N skipped" and returns the exit status.
   Its first part, the little the suites need from the system on POSIX and on Windows (MinGW,
   run under wine by tests/windows.sh), also serves test_io.c, which has a harness of its own:
   it defines TEST_PORTABILITY_ONLY before including this file. */
#ifndef MGPU_TEST_PORT_H
#define MGPU_TEST_PORT_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#include <dirent.h>
#include <sys/types.h>
#include <sys/stat.h>
#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#include <process.h>   /* _beginthreadex */
#include <direct.h>    /* _mkdir, _rmdir */
#else
#include <pthread.h>
#include <unistd.h>
#include <time.h>
/* declared again for a suite whose <stdlib.h> came before mgpu.h asked for POSIX */
int setenv(const char* name, const char* value, int overwrite);
int unsetenv(const char* name);
char* mkdtemp(char* tmpl);
int nanosleep(const struct timespec* req, struct timespec* rem);
#endif

/* setenv(name, value, 1) and unsetenv(name); on Windows _putenv_s, which also changes the
   environment a child process gets (there an empty value removes the variable). */
static inline int test_setenv(const char* name, const char* value) {
#ifdef _WIN32
    return _putenv_s(name, value) == 0 ? 0 : -1;
#else
    return setenv(name, value, 1);
#endif
}
static inline int test_unsetenv(const char* name) {
#ifdef _WIN32
    return _putenv_s(name, "") == 0 ? 0 : -1;
#else
    return unsetenv(name);
#endif
}

/* mkdir(path, mode); Windows has no modes */
static inline int test_mkdir(const char* path, int mode) {
#ifdef _WIN32
    (void)mode;
    return _mkdir(path);
#else
    return mkdir(path, (mode_t)mode);
#endif
}

static inline long test_getpid(void) {
#ifdef _WIN32
    return (long)GetCurrentProcessId();
#else
    return (long)getpid();
#endif
}

static inline void test_sleep_ms(int ms) {
#ifdef _WIN32
    Sleep((DWORD)ms);
#else
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
#endif
}

/* The folder for temporary files, ending in a separator: "/tmp/" on POSIX (as the suites always
   used), GetTempPath's on Windows. */
static inline const char* test_tmp_base(void) {
#ifdef _WIN32
    static char base[MAX_PATH + 2];
    if (!base[0]) {
        DWORD n = GetTempPathA(MAX_PATH, base);
        if (n == 0 || n >= MAX_PATH) strcpy(base, ".\\");
    }
    return base;
#else
    return "/tmp/";
#endif
}
/* buf = the temporary folder + name */
static inline const char* test_tmp_path(char* buf, size_t size, const char* name) {
    snprintf(buf, size, "%s%s", test_tmp_base(), name);
    return buf;
}

/* mkdtemp(tmpl) on POSIX. On Windows a new folder in the temporary folder named after tmpl's
   last part, its XXXXXX replaced by the process id and a count; its path replaces tmpl (size
   bytes). NULL when no folder could be made. */
static inline char* test_mkdtemp(char* tmpl, size_t size) {
#ifdef _WIN32
    static unsigned count;
    char name[128];
    const char* slash = strrchr(tmpl, '/');
    const char* back = strrchr(tmpl, '\\');   /* (test_tmp_path's folder ends in one) */
    size_t len;
    int tries;
    if (back && (!slash || back > slash)) slash = back;
    snprintf(name, sizeof name, "%s", slash ? slash + 1 : tmpl);
    len = strlen(name);
    if (len >= 6 && strcmp(name + len - 6, "XXXXXX") == 0) name[len - 6] = 0;
    for (tries = 0; tries < 1000; ++tries) {
        snprintf(tmpl, size, "%s%s%lu-%u", test_tmp_base(), name, (unsigned long)GetCurrentProcessId(), count++);
        if (CreateDirectoryA(tmpl, NULL)) return tmpl;
        if (GetLastError() != ERROR_ALREADY_EXISTS) return NULL;
    }
    return NULL;
#else
    (void)size;
    return mkdtemp(tmpl);
#endif
}

/* rm -rf path. On Windows through UTF-16 names with the \\?\ prefix, so that names past
   MAX_PATH go too (test_io saves one). */
#ifdef _WIN32
static inline void test_remove_tree_w(const wchar_t* path) {
    size_t n = wcslen(path);
    DWORD attr = GetFileAttributesW(path);
    wchar_t* sub;
    WIN32_FIND_DATAW e;
    HANDLE d;
    if (attr == INVALID_FILE_ATTRIBUTES) return;
    if (!(attr & FILE_ATTRIBUTE_DIRECTORY) || (attr & FILE_ATTRIBUTE_REPARSE_POINT)) {
        if (attr & FILE_ATTRIBUTE_DIRECTORY) RemoveDirectoryW(path);
        else { SetFileAttributesW(path, FILE_ATTRIBUTE_NORMAL); DeleteFileW(path); }
        return;
    }
    sub = (wchar_t*)malloc((n + MAX_PATH + 3) * sizeof(wchar_t));
    if (!sub) return;
    wcscpy(sub, path);
    wcscpy(sub + n, L"\\*");
    d = FindFirstFileW(sub, &e);
    if (d != INVALID_HANDLE_VALUE) {
        do {
            if (!wcscmp(e.cFileName, L".") || !wcscmp(e.cFileName, L"..")) continue;
            wcscpy(sub + n + 1, e.cFileName);
            test_remove_tree_w(sub);
        } while (FindNextFileW(d, &e));
        FindClose(d);
    }
    free(sub);
    RemoveDirectoryW(path);
}
#endif
static inline void test_remove_tree(const char* path) {
#ifdef _WIN32
    static wchar_t w[4100];
    size_t i;
    wcscpy(w, L"\\\\?\\");
    if (MultiByteToWideChar(CP_UTF8, 0, path, -1, w + 4, 4096) <= 0) return;
    for (i = 4; w[i]; ++i)
        if (w[i] == L'/') w[i] = L'\\';
    test_remove_tree_w(w[5] == L':' && w[6] == L'\\' ? w : w + 4);   /* the prefix only before X:\ */
#else
    DIR* d = opendir(path);
    struct dirent* e;
    char sub[1024];
    if (!d) { remove(path); return; }
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if ((size_t)snprintf(sub, sizeof sub, "%s/%s", path, e->d_name) >= sizeof sub) continue;
        test_remove_tree(sub);
    }
    closedir(d);
    rmdir(path);
#endif
}

/* A thread: TEST_THREAD_MAIN(name, arg) { ...; TEST_THREAD_END; }, started by
   test_thread_start (0 on success, as pthread_create) and joined by test_thread_join. POSIX
   threads, or _beginthreadex on Windows. */
#ifdef _WIN32
typedef HANDLE test_thread;
#define TEST_THREAD_MAIN(name, arg) static unsigned __stdcall name(void* arg)
#define TEST_THREAD_END return 0
static inline int test_thread_start(test_thread* t, unsigned(__stdcall* fn)(void*), void* arg) {
    *t = (HANDLE)_beginthreadex(NULL, 0, fn, arg, 0, NULL);
    return *t ? 0 : -1;
}
static inline void test_thread_join(test_thread t) {
    WaitForSingleObject(t, INFINITE);
    CloseHandle(t);
}
#else
typedef pthread_t test_thread;
#define TEST_THREAD_MAIN(name, arg) static void* name(void* arg)
#define TEST_THREAD_END return NULL
static inline int test_thread_start(test_thread* t, void* (*fn)(void*), void* arg) { return pthread_create(t, NULL, fn, arg); }
static inline void test_thread_join(test_thread t) { pthread_join(t, NULL); }
#endif
#endif /* MGPU_TEST_PORT_H */

#if !defined(MGPU_TEST_H) && !defined(TEST_PORTABILITY_ONLY)
#define MGPU_TEST_H

static int test_passed, test_failed, test_skipped;
static int test_verbose = -1;

static int test_is_verbose(void) {
    if (test_verbose < 0) test_verbose = getenv("TEST_VERBOSE") != NULL;
    return test_verbose;
}

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (cond) {                                                               \
            test_passed++;                                                        \
            if (test_is_verbose()) { printf("  ok   %s:%d ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
        } else {                                                                  \
            test_failed++;                                                        \
            printf("  FAIL %s:%d: ", __FILE__, __LINE__);                         \
            printf(__VA_ARGS__);                                                  \
            printf("\n");                                                         \
        }                                                                         \
    } while (0)

#define SKIP(...)                                                                 \
    do {                                                                          \
        test_skipped++;                                                           \
        printf("  skip ");                                                        \
        printf(__VA_ARGS__);                                                      \
        printf("\n");                                                             \
    } while (0)

/* Running one group: "build/test_core matmul" (or TEST_ONLY=matmul) runs only the groups whose
   function name contains "matmul"; TEST_GROUP(test_matmul()) is how main calls a group. A filter
   that matches no group is a failure, so a typo never passes as an empty run. */
static const char* test_only;
static int test_groups_run;
static inline void test_select(int argc, char** argv) {
    test_only = argc > 1 ? argv[1] : getenv("TEST_ONLY");
    if (test_only && !*test_only) test_only = NULL;
    if (test_only) printf("only the groups matching '%s'\n", test_only);
}
#define TEST_GROUP(call)                                                          \
    do {                                                                          \
        if (!test_only || strstr(#call, test_only)) { test_groups_run++; call; } \
    } while (0)

static int test_summary(const char* name) {
    if (test_only && test_groups_run == 0) {
        test_failed++;
        printf("  FAIL no group of %s matches '%s'\n", name, test_only);
    }
    printf("%s: %d passed, %d failed, %d skipped\n", name, test_passed, test_failed, test_skipped);
    printf("%d passed, %d failed, %d skipped\n", test_passed, test_failed, test_skipped);
    return test_failed ? 1 : 0;
}

/* Normalised error ||x - ref|| / max(||ref||, tiny), the ggml/llm.c way of comparing a backend
   against a float64 reference. */
static double test_rel_error(const float* x, const double* ref, size_t n) {
    double num = 0.0, den = 0.0;
    size_t i;
    for (i = 0; i < n; ++i) {
        double d = (double)x[i] - ref[i];
        if (x[i] != x[i]) return INFINITY;   /* NaN */
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1.0);
}
/* ---- helpers for the suites that test mgpu.h (included after it) ---- */
#ifdef MGPU_H
#include <stdint.h>
#include <time.h>
/* What mgpu_model_summary prints, into text (cut to size; "" when no temporary file opens) */
static inline void summary_of(const mgpu_model* m, char* text, size_t size) {
    FILE* f = tmpfile();
    size_t n = 0;
    CHECK(f != NULL, "tmpfile()");
    if (f) {
        mgpu_model_summary(m, f);
        rewind(f);
        n = fread(text, 1, size - 1, f);
        fclose(f);
    }
    text[n] = 0;
}
#ifdef MGPU_CUDA
#include "tests/emu/emu.h"
typedef mgpu_emu_counters mgpu_emu_counters_t;
/* The emulator's counters (tests/emu/emu.h: launches, GEMMs, ...), where the emulator runs the
   suite; NULL on a real GPU (and on Windows, where no emulator runs) */
typedef void (*emu_counters_fn)(mgpu_emu_counters_t* out);
#ifndef _WIN32
#include <dlfcn.h>
static inline emu_counters_fn emu_counters(void) {
    void* self = dlopen(NULL, RTLD_NOW);
    emu_counters_fn f = self ? (emu_counters_fn)dlsym(self, "mgpu_emu_get_counters") : NULL;
    if (self) dlclose(self);
    return f;
}
#else
static inline emu_counters_fn emu_counters(void) { return NULL; }
#endif
#endif

static const char* test_name = "test";   /* the suite, for test_summary on an early exit */
static uint64_t g_rng_state;             /* host random numbers for test inputs (splitmix64) */
static uint64_t g_test_seed;             /* where g_rng_state started: MGPU_TEST_SEED repeats a run */
static int g_quick;                      /* MGPU_TEST_QUICK=1: smaller sizes (compute-sanitizer) */
static int g_require_gpu;                /* MGPU_TEST_REQUIRE_GPU=1: a GPU test that cannot run fails */

/* Out-of-memory tests ask malloc for absurd sizes; under AddressSanitizer that must return NULL
   (as glibc's malloc does) instead of aborting the program. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif
#ifdef TEST_ASAN
const char* __asan_default_options(void);
const char* __asan_default_options(void) { return "allocator_may_return_null=1"; }
#endif

static inline void header(const char* name) {
    printf("== %s\n", name);
    fflush(stdout);
}
static inline int env_is_1(const char* name) {
    const char* v = getenv(name);
    return v && strcmp(v, "1") == 0;
}
static inline double now_seconds(void) { return mgpu_seconds(); }

/* The start of every suite's main: its name, the seed (MGPU_TEST_SEED, else the clock), the
   flags. Returns the start time. */
static inline double test_start(const char* name) {
    const char* seed_env = getenv("MGPU_TEST_SEED");
    test_name = name;
    g_test_seed = seed_env ? (uint64_t)strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
    g_rng_state = g_test_seed;
    g_quick = env_is_1("MGPU_TEST_QUICK");
    g_require_gpu = env_is_1("MGPU_TEST_REQUIRE_GPU");
    return now_seconds();
}

/* A group's GPU part: 1 when a GPU runs it; otherwise one skip naming the group and why (a
   failure with MGPU_TEST_REQUIRE_GPU=1). */
static inline int test_gpu_group(const char* group, int have_gpu) {
#ifdef MGPU_CUDA
    const char* why = "no GPU";
#else
    const char* why = "built without CUDA";
    have_gpu = 0;
#endif
    if (have_gpu) return 1;
    if (g_require_gpu) CHECK(0, "cuda %s: %s, and MGPU_TEST_REQUIRE_GPU=1", group, why);
    else SKIP("cuda %s: %s", group, why);
    return 0;
}

static inline uint64_t rng_u64(void) {
    uint64_t z = (g_rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double rng_unit(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
static inline double rng_gauss(void) {
    double u1 = rng_unit(), u2 = rng_unit();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}
static inline int rng_int(int n) { return (int)(rng_u64() % (uint64_t)n); }

/* zeroed host memory, or the test stops */
static inline void* xmalloc(size_t bytes) {
    void* p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        printf("  FAIL out of host memory for %zu bytes\n", bytes);
        exit(2);
    }
    return p;
}
static inline float* fbuf(int64_t n) { return (float*)xmalloc((size_t)n * sizeof(float)); }
static inline double* dbuf(int64_t n) { return (double*)xmalloc((size_t)n * sizeof(double)); }

/* tensors that must be made, filled and read back, or the suite stops with its summary */
static inline mgpu_tensor* tmake(mgpu_device* d, mgpu_dtype dt, mgpu_shape s) {
    mgpu_tensor* t = mgpu_tensor_create(d, dt, s);
    if (!t) {
        CHECK(0, "mgpu_tensor_create on %s failed: %s", mgpu_device_label(d), mgpu_last_error());
        exit(test_summary(test_name));
    }
    return t;
}
/* (failures are recorded; a working copy is plumbing, not a passed check) */
static inline void tput(mgpu_tensor* t, const void* host) {
    mgpu_result r = mgpu_tensor_upload(t, host, mgpu_tensor_bytes(t));
    if (r != MGPU_OK) CHECK(0, "upload: %s: %s", mgpu_result_string(r), mgpu_last_error());
}
static inline void tget(const mgpu_tensor* t, void* host) {
    mgpu_result r = mgpu_tensor_download(t, host, mgpu_tensor_bytes(t));
    if (r != MGPU_OK) CHECK(0, "download: %s: %s", mgpu_result_string(r), mgpu_last_error());
}
static inline mgpu_tensor* tfrom(mgpu_device* d, mgpu_shape s, const float* host) {
    mgpu_tensor* t = tmake(d, MGPU_F32, s);
    tput(t, host);
    return t;
}
/* An op that must succeed: a failure is recorded with the message; a success is not counted. */
#define MUST(expr)                                                                          \
    do {                                                                                    \
        mgpu_result must_r_ = (expr);                                                       \
        if (must_r_ != MGPU_OK)                                                             \
            CHECK(0, "%s -> %s: %s", #expr, mgpu_result_string(must_r_), mgpu_last_error()); \
    } while (0)
/* A call that must fail with `want`, leaving a message that contains each of s1..s3 (NULL: skip). */
static inline void expect_fail(mgpu_result got, mgpu_result want, const char* what, const char* s1, const char* s2,
                        const char* s3) {
    const char* msg = mgpu_last_error();
    const char* need[3];
    int i;
    need[0] = s1; need[1] = s2; need[2] = s3;
    CHECK(got == want, "%s: got %s, expected %s (message: %s)", what, mgpu_result_string(got),
          mgpu_result_string(want), msg);
    CHECK(mgpu_last_result() == want, "%s: mgpu_last_result() %s, expected %s", what,
          mgpu_result_string(mgpu_last_result()), mgpu_result_string(want));
    for (i = 0; i < 3; ++i)
        if (need[i]) CHECK(strstr(msg, need[i]) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, need[i]);
}
static inline mgpu_tensor* tfrom_i32(mgpu_device* d, mgpu_shape s, const int32_t* host) {
    mgpu_tensor* t = tmake(d, MGPU_I32, s);
    tput(t, host);
    return t;
}
#endif
#endif
