#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_core.c - the core test suite of mgpu: results and errors, devices, the caching
   allocator, tensors and copies, the Philox RNG, every op against float64 loops written here,
   the error paths of the ops, and CPU thread-count determinism.

   The same code serves the CPU-only build and the CUDA build: every device-generic group runs
   on each device of g_devs (the CPU always; "cuda:0" when built with MGPU_CUDA and a GPU is
   present). Without a GPU each GPU group records one skip (a failure when
   MGPU_TEST_REQUIRE_GPU=1). MGPU_TEST_QUICK=1 uses small sizes (for compute-sanitizer);
   MGPU_TEST_SEED=N repeats a run's random inputs. */

#include <stdint.h>
#include <float.h>
#include <time.h>
#include <fcntl.h>
#include <errno.h>
#ifndef _WIN32
#include <sys/wait.h>
#include <unistd.h>
#endif


#define TEST_PI 3.14159265358979323846

/* ============================================================================================ */
/* globals and helpers                                                                          */
/* ============================================================================================ */
static mgpu_device* g_devs[2];
static int g_ndev;
static mgpu_device_set* g_gpu_set;
static mgpu_device* g_gpu;




static int is_gpu(const mgpu_device* d) { return mgpu_device_kind_of(d) == MGPU_DEVICE_CUDA; }

/* A group's GPU part that no GPU runs: a skip (test_gpu_group). */
static void gpu_group_note(const char* group) { (void)test_gpu_group(group, g_gpu != NULL); }

/* host random numbers for test inputs (splitmix64) */

static void rnd_uniform(float* x, int64_t n, double lo, double hi) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)(lo + (hi - lo) * rng_unit());
}
static void rnd_normal(float* x, int64_t n, double std) {
    int64_t i;
    for (i = 0; i < n; ++i) x[i] = (float)(std * rng_gauss());
}

/* A tensor the test cannot go on without: a failure here ends the run (with its summary). */


/* The normalised error of test.h; for fewer than 100 values its denominator is at least the norm
   of n unit values, so that one result that happens to be near 0 (a cancelling dot product, gelu
   of -4) is not judged by its own tiny magnitude. */
static double rel_error(const float* got, const double* ref, int64_t n) {
    double num = 0.0, den = 0.0;
    int64_t i;
    if (n >= 100) return test_rel_error(got, ref, (size_t)n);
    for (i = 0; i < n; ++i) {
        double d = (double)got[i] - ref[i];
        if (got[i] != got[i]) return INFINITY;
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / sqrt(den > (double)n ? den : (n ? (double)n : 1.0));
}

/* Compare against the float64 reference; print the error of every GPU op. */
static void check_err(const mgpu_device* d, const char* what, const float* got, const double* ref, int64_t n,
                      double tol) {
    double e = rel_error(got, ref, n);
    CHECK(e <= tol, "%s on %s: relative error %.3g (limit %.0e)", what, mgpu_device_label(d), e, tol);
    if (is_gpu(d)) printf("  %-8s %-52s rel err %.3g\n", mgpu_device_label(d), what, e);
}

/* The same for a creating call that must return NULL. */
static void expect_null(const void* p, mgpu_result want, const char* what, const char* s1, const char* s2) {
    CHECK(p == NULL, "%s: expected NULL", what);
    expect_fail(p ? MGPU_OK : mgpu_last_result(), want, what, s1, s2, NULL);
}

static int all_equal_f(const float* a, const float* b, int64_t n) {
    return n == 0 || memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

/* ============================================================================================ */
/* 1. results and errors                                                                        */
/* ============================================================================================ */
typedef struct log_capture { int calls; mgpu_log_level level; char last[1024]; } log_capture;
static void capture_log(mgpu_log_level level, const char* message, void* user) {
    log_capture* c = (log_capture*)user;
    c->calls++;
    c->level = level;
    snprintf(c->last, sizeof c->last, "%s", message);
}

/* mgpu_last_error is per thread: a failure on another thread leaves this thread's alone */
typedef struct thread_probe { mgpu_result r, last; char text[1024]; } thread_probe;
TEST_THREAD_MAIN(error_thread, arg) {
    thread_probe* p = (thread_probe*)arg;
    p->r = mgpu_tensor_upload(NULL, NULL, 0);
    p->last = mgpu_last_result();
    snprintf(p->text, sizeof p->text, "%s", mgpu_last_error());
    TEST_THREAD_END;
}

static void test_results(void) {
    int r, s;
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tensor *a, *b, *o;
    mgpu_result rc;
    log_capture cap;
    header("results and errors");

    for (r = 0; r < (int)MGPU_RESULT_COUNT_; ++r) {
        const char* text = mgpu_result_string((mgpu_result)r);
        CHECK(text && text[0], "mgpu_result_string(%d) is empty", r);
        for (s = 0; s < r; ++s)
            CHECK(strcmp(text, mgpu_result_string((mgpu_result)s)) != 0, "result strings %d and %d are both \"%s\"", s, r, text);
    }
    CHECK(strcmp(mgpu_result_string(MGPU_OK), "ok") == 0, "MGPU_OK's string is \"%s\"", mgpu_result_string(MGPU_OK));
    CHECK(MGPU_OK == 0, "MGPU_OK is not 0");
    CHECK(strlen(mgpu_result_string(MGPU_RESULT_COUNT_)) > 0, "no text for an unknown code");

    mgpu_clear_error();
    CHECK(mgpu_last_error()[0] == 0 && mgpu_last_result() == MGPU_OK, "clear_error leaves \"%s\"", mgpu_last_error());

    a = tmake(cpu, MGPU_F32, mgpu_shape2(5, 7));
    b = tmake(cpu, MGPU_F32, mgpu_shape2(6, 3));
    o = tmake(cpu, MGPU_F32, mgpu_shape2(5, 3));
    rc = mgpu_matmul(o, a, b, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f);
    expect_fail(rc, MGPU_ERROR_SHAPE_MISMATCH, "matmul [5,7]@[6,3]", "mgpu_matmul", "[5,7]", "[6,3]");
    CHECK(strstr(mgpu_last_error(), "cpu") != NULL, "message \"%s\" does not name the device", mgpu_last_error());
    CHECK(strstr(mgpu_last_error(), "f32[5,7]@cpu") != NULL, "message \"%s\" lacks the description f32[5,7]@cpu",
          mgpu_last_error());
    mgpu_clear_error();
    CHECK(mgpu_last_error()[0] == 0, "mgpu_clear_error left \"%s\"", mgpu_last_error());
    CHECK(mgpu_last_result() == MGPU_OK, "mgpu_clear_error left result %d", (int)mgpu_last_result());

    /* per thread */
    {
        test_thread th;
        thread_probe probe;
        memset(&probe, 0, sizeof probe);
        rc = mgpu_matmul(o, a, b, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f);
        if (test_thread_start(&th, error_thread, &probe) == 0) {
            test_thread_join(th);
            CHECK(probe.r == MGPU_ERROR_INVALID_ARGUMENT && probe.last == MGPU_ERROR_INVALID_ARGUMENT &&
                      strstr(probe.text, "mgpu_tensor_upload") != NULL,
                  "error on another thread: %s \"%s\"", mgpu_result_string(probe.r), probe.text);
            CHECK(strstr(mgpu_last_error(), "mgpu_matmul") != NULL && mgpu_last_result() == MGPU_ERROR_SHAPE_MISMATCH,
                  "another thread's failure replaced this thread's error: \"%s\"", mgpu_last_error());
        } else {
            CHECK(0, "starting a thread failed");
        }
        mgpu_clear_error();
    }

    /* logger */
    memset(&cap, 0, sizeof cap);
    mgpu_log_set_callback(capture_log, &cap);
    rc = mgpu_matmul(o, a, b, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f);
    CHECK(rc == MGPU_ERROR_SHAPE_MISMATCH, "matmul with a logger: %s", mgpu_result_string(rc));
    CHECK(cap.calls == 1, "logger called %d times for one failure", cap.calls);
    CHECK(cap.level == MGPU_LOG_ERROR, "logger level %d for a failure", (int)cap.level);
    CHECK(strstr(cap.last, "mgpu_matmul") && strstr(cap.last, "[5,7]"), "logger got \"%s\"", cap.last);
    CHECK(strcmp(cap.last, mgpu_last_error()) == 0, "logger message \"%s\" differs from last_error \"%s\"", cap.last,
          mgpu_last_error());
    mgpu_log_set_callback(NULL, NULL);
    rc = mgpu_add(o, a, b);
    CHECK(rc == MGPU_ERROR_SHAPE_MISMATCH, "add [5,7]+[6,3]: %s", mgpu_result_string(rc));
    CHECK(cap.calls == 1, "logger still called after mgpu_log_set_callback(NULL) (%d calls)", cap.calls);
    mgpu_clear_error();

    mgpu_tensor_destroy(a);
    mgpu_tensor_destroy(b);
    mgpu_tensor_destroy(o);
}

/* ============================================================================================ */
/* 2. devices                                                                                   */
/* ============================================================================================ */
static void test_devices(void) {
    static const char* bad[] = { "cpu:0", "cpu:x", "gpu", "cuda:", "cuda:0,,1", "cpu:100000", "cpu:", "cpu:3x",
                                 "cpu:-1", "CPU", "cpu,cpu" };
    mgpu_device_set* set;
    mgpu_device_info info;
    mgpu_device* cpu = mgpu_device_cpu();
    const char* env_saved = getenv("MGPU_DEVICES");
    char* saved = env_saved ? strcpy((char*)xmalloc(strlen(env_saved) + 1), env_saved) : NULL;
    int i;
    header("devices");

    test_unsetenv("MGPU_DEVICES");
    CHECK(cpu != NULL && mgpu_device_kind_of(cpu) == MGPU_DEVICE_CPU, "mgpu_device_cpu");
    CHECK(strcmp(mgpu_device_label(cpu), "cpu") == 0, "CPU label \"%s\"", mgpu_device_label(cpu));
    CHECK(mgpu_device_cpu() == cpu, "mgpu_device_cpu is not one device");

    /* "auto" and NULL */
    for (i = 0; i < 2; ++i) {
        set = mgpu_device_set_create(i ? NULL : "auto");
        CHECK(set != NULL, "create(%s): %s", i ? "NULL" : "\"auto\"", mgpu_last_error());
        if (!set) continue;
        if (mgpu_cuda_device_count() > 0) {
            CHECK(strncmp(mgpu_device_set_spec(set), "cuda:", 5) == 0, "auto with a GPU resolved to \"%s\"",
                  mgpu_device_set_spec(set));
            CHECK(mgpu_device_set_count(set) == mgpu_cuda_device_count(), "auto: %d devices for %d GPUs",
                  mgpu_device_set_count(set), mgpu_cuda_device_count());
            CHECK(is_gpu(mgpu_device_set_get(set, 0)), "auto with a GPU gave a CPU device");
        } else {
            CHECK(strcmp(mgpu_device_set_spec(set), "cpu") == 0, "auto without a GPU resolved to \"%s\"",
                  mgpu_device_set_spec(set));
            CHECK(mgpu_device_set_count(set) == 1, "auto: %d devices", mgpu_device_set_count(set));
            CHECK(mgpu_device_set_get(set, 0) == cpu, "auto's CPU is not mgpu_device_cpu()");
        }
        mgpu_device_set_destroy(set);
    }

    /* "cpu" and "cpu:3" */
    set = mgpu_device_set_create("cpu");
    CHECK(set && mgpu_device_set_count(set) == 1 && mgpu_device_set_get(set, 0) == cpu, "create(\"cpu\"): %s",
          mgpu_last_error());
    CHECK(set && strcmp(mgpu_device_set_spec(set), "cpu") == 0, "spec of \"cpu\": \"%s\"", mgpu_device_set_spec(set));
    mgpu_device_set_destroy(set);

    set = mgpu_device_set_create("cpu:3");
    CHECK(set != NULL, "create(\"cpu:3\"): %s", mgpu_last_error());
    if (set) {
        static const char* labels[3] = { "cpu", "cpu#1", "cpu#2" };
        CHECK(mgpu_device_set_count(set) == 3, "cpu:3 has %d devices", mgpu_device_set_count(set));
        CHECK(strcmp(mgpu_device_set_spec(set), "cpu:3") == 0, "spec of cpu:3: \"%s\"", mgpu_device_set_spec(set));
        for (i = 0; i < 3 && i < mgpu_device_set_count(set); ++i) {
            mgpu_device* d = mgpu_device_set_get(set, i);
            CHECK(d && strcmp(mgpu_device_label(d), labels[i]) == 0, "cpu:3 device %d label \"%s\", want \"%s\"", i,
                  mgpu_device_label(d), labels[i]);
            CHECK(mgpu_device_kind_of(d) == MGPU_DEVICE_CPU, "cpu:3 device %d is not a CPU", i);
            CHECK(mgpu_device_get_info(d, &info) == MGPU_OK && info.replica == i && strcmp(info.label, labels[i]) == 0 &&
                      strcmp(info.name, "cpu") == 0,
                  "info of cpu:3 device %d: replica %d label \"%s\" name \"%s\"", i, info.replica, info.label, info.name);
        }
        CHECK(mgpu_device_can_access_peer(mgpu_device_set_get(set, 1), mgpu_device_set_get(set, 2)) == 1,
              "two CPU devices cannot access each other");
        mgpu_clear_error();
        CHECK(mgpu_device_set_get(set, 3) == NULL && mgpu_last_result() == MGPU_ERROR_INVALID_ARGUMENT,
              "set_get(3) of 3: %s", mgpu_last_error());
        CHECK(strstr(mgpu_last_error(), "mgpu_device_set_get") != NULL, "set_get message \"%s\"", mgpu_last_error());
        CHECK(mgpu_device_set_get(set, -1) == NULL, "set_get(-1) is not NULL");
        mgpu_device_set_destroy(set);
    }
    CHECK(mgpu_device_set_get(NULL, 0) == NULL, "set_get(NULL, 0) is not NULL");
    CHECK(mgpu_device_set_count(NULL) == 0, "set_count(NULL) is not 0");

    /* the largest CPU set, and one past it */
    set = mgpu_device_set_create("cpu:256");
    CHECK(set && mgpu_device_set_count(set) == 256 &&
              strcmp(mgpu_device_label(mgpu_device_set_get(set, 255)), "cpu#255") == 0 &&
              strcmp(mgpu_device_set_spec(set), "cpu:256") == 0,
          "cpu:256: %s", set ? mgpu_device_set_spec(set) : mgpu_last_error());
    mgpu_device_set_destroy(set);
    mgpu_clear_error();
    set = mgpu_device_set_create("cpu:257");
    expect_null(set, MGPU_ERROR_INVALID_ARGUMENT, "cpu:257", "cpu:257", NULL);
    mgpu_device_set_destroy(set);

    /* bad specs */
    for (i = 0; i < (int)(sizeof bad / sizeof bad[0]); ++i) {
        mgpu_result r;
        mgpu_clear_error();
        set = mgpu_device_set_create(bad[i]);
        r = mgpu_last_result();
        CHECK(set == NULL, "bad spec \"%s\" gave a set (\"%s\")", bad[i], mgpu_device_set_spec(set));
        /* malformed is malformed with or without a GPU: not "no such device" */
        CHECK(r == MGPU_ERROR_INVALID_ARGUMENT, "bad spec \"%s\": result %s", bad[i], mgpu_result_string(r));
        CHECK(strstr(mgpu_last_error(), bad[i]) != NULL, "bad spec \"%s\": message \"%s\" does not quote it", bad[i],
              mgpu_last_error());
        CHECK(strstr(mgpu_last_error(), "mgpu_device_set_create") != NULL, "bad spec \"%s\": message \"%s\"", bad[i],
              mgpu_last_error());
        mgpu_device_set_destroy(set);
    }

    /* cuda:0 */
    mgpu_clear_error();
    set = mgpu_device_set_create("cuda:0");
#ifndef MGPU_CUDA
    CHECK(mgpu_cuda_device_count() == 0, "mgpu_cuda_device_count() %d without CUDA", mgpu_cuda_device_count());
    expect_null(set, MGPU_ERROR_NO_DEVICE, "cuda:0 without CUDA", "MGPU_CUDA", "cuda:0");
    mgpu_device_set_destroy(set);
    set = mgpu_device_set_create("cuda");
    expect_null(set, MGPU_ERROR_NO_DEVICE, "cuda without CUDA", "MGPU_CUDA", NULL);
    mgpu_device_set_destroy(set);
#else
    if (mgpu_cuda_device_count() == 0) {
        expect_null(set, MGPU_ERROR_NO_DEVICE, "cuda:0 with no GPU", "cuda:0", NULL);
        mgpu_device_set_destroy(set);
    } else {
        CHECK(set != NULL, "create(\"cuda:0\"): %s", mgpu_last_error());
        if (set) {
            mgpu_device* d = mgpu_device_set_get(set, 0);
            CHECK(mgpu_device_set_count(set) == 1 && is_gpu(d), "cuda:0 set");
            CHECK(strcmp(mgpu_device_label(d), "cuda:0") == 0, "cuda:0 label \"%s\"", mgpu_device_label(d));
            CHECK(strcmp(mgpu_device_set_spec(set), "cuda:0") == 0, "cuda:0 spec \"%s\"", mgpu_device_set_spec(set));
            CHECK(mgpu_device_get_info(d, &info) == MGPU_OK, "info of cuda:0: %s", mgpu_last_error());
            CHECK(info.kind == MGPU_DEVICE_CUDA && info.ordinal == 0 && info.total_memory > 0 && info.compute_major > 0 &&
                      info.multiprocessors > 0 && info.name[0],
                  "info of cuda:0: kind %d ordinal %d total %zu cc %d.%d SMs %d name \"%s\"", (int)info.kind,
                  info.ordinal, info.total_memory, info.compute_major, info.compute_minor, info.multiprocessors,
                  info.name);
            printf("  cuda:0 is %s (compute %d.%d, %d SMs, %.1f GiB)\n", info.name, info.compute_major,
                   info.compute_minor, info.multiprocessors, (double)info.total_memory / 1073741824.0);
            CHECK(mgpu_device_synchronize(d) == MGPU_OK, "synchronize cuda:0: %s", mgpu_last_error());
            CHECK(mgpu_device_can_access_peer(d, cpu) == 0, "cuda:0 claims peer access to the CPU");
            mgpu_device_set_destroy(set);
        }
        set = mgpu_device_set_create("cuda:0,0");
        CHECK(set && mgpu_device_set_count(set) == 2, "cuda:0,0: %s", mgpu_last_error());
        if (set) {
            CHECK(strcmp(mgpu_device_label(mgpu_device_set_get(set, 1)), "cuda:0#1") == 0, "second replica label \"%s\"",
                  mgpu_device_label(mgpu_device_set_get(set, 1)));
            CHECK(strcmp(mgpu_device_set_spec(set), "cuda:0,0") == 0, "cuda:0,0 spec \"%s\"", mgpu_device_set_spec(set));
            CHECK(mgpu_device_can_access_peer(mgpu_device_set_get(set, 0), mgpu_device_set_get(set, 1)) == 1,
                  "two replicas of one GPU cannot access each other");
            mgpu_device_set_destroy(set);
        }
        set = mgpu_device_set_create("cuda");
        CHECK(set && mgpu_device_set_count(set) == mgpu_cuda_device_count(), "\"cuda\": %s", mgpu_last_error());
        mgpu_device_set_destroy(set);
        mgpu_clear_error();
        set = mgpu_device_set_create("cuda:99");
        expect_null(set, MGPU_ERROR_NO_DEVICE, "cuda:99", "cuda:99", NULL);
        mgpu_device_set_destroy(set);
    }
#endif

    /* MGPU_DEVICES overrides "auto" (and only "auto") */
    test_setenv("MGPU_DEVICES", "cpu:2");
    set = mgpu_device_set_create("auto");
    CHECK(set && mgpu_device_set_count(set) == 2 && strcmp(mgpu_device_set_spec(set), "cpu:2") == 0,
          "auto with MGPU_DEVICES=cpu:2 gave \"%s\" (%s)", mgpu_device_set_spec(set), mgpu_last_error());
    mgpu_device_set_destroy(set);
    set = mgpu_device_set_create("cpu");
    CHECK(set && mgpu_device_set_count(set) == 1, "\"cpu\" with MGPU_DEVICES=cpu:2 has %d devices",
          mgpu_device_set_count(set));
    mgpu_device_set_destroy(set);
    test_setenv("MGPU_DEVICES", "bogus");
    mgpu_clear_error();
    set = mgpu_device_set_create(NULL);
    expect_null(set, MGPU_ERROR_INVALID_ARGUMENT, "MGPU_DEVICES=bogus", "bogus", NULL);
    mgpu_device_set_destroy(set);
    test_unsetenv("MGPU_DEVICES");

    /* the CPU's info */
    CHECK(mgpu_device_get_info(cpu, &info) == MGPU_OK, "get_info(cpu): %s", mgpu_last_error());
    CHECK(info.kind == MGPU_DEVICE_CPU && info.ordinal == 0 && info.replica == 0, "cpu info kind %d ordinal %d replica %d",
          (int)info.kind, info.ordinal, info.replica);
    CHECK(strcmp(info.name, "cpu") == 0 && strcmp(info.label, "cpu") == 0, "cpu info name \"%s\" label \"%s\"", info.name,
          info.label);
    CHECK(info.multiprocessors == mgpu_cpu_threads() && info.multiprocessors >= 1, "cpu info threads %d vs %d",
          info.multiprocessors, mgpu_cpu_threads());
    CHECK(info.total_memory > 0 && info.free_memory <= info.total_memory, "cpu memory %zu free of %zu",
          info.free_memory, info.total_memory);
    CHECK(info.compute_major == 0 && info.compute_minor == 0, "cpu compute capability %d.%d", info.compute_major,
          info.compute_minor);
    expect_fail(mgpu_device_get_info(NULL, &info), MGPU_ERROR_INVALID_ARGUMENT, "get_info(NULL)", "mgpu_device_get_info",
                NULL, NULL);
    expect_fail(mgpu_device_get_info(cpu, NULL), MGPU_ERROR_INVALID_ARGUMENT, "get_info(cpu, NULL)", NULL, NULL, NULL);
    CHECK(mgpu_device_synchronize(cpu) == MGPU_OK, "synchronize(cpu)");
    expect_fail(mgpu_device_synchronize(NULL), MGPU_ERROR_INVALID_ARGUMENT, "synchronize(NULL)", NULL, NULL, NULL);
    CHECK(mgpu_device_allow_tf32(cpu, 1) == MGPU_OK, "set_tf32(cpu)");

    /* destroy(NULL) does nothing */
    mgpu_device_set_destroy(NULL);
    mgpu_tensor_destroy(NULL);
    CHECK(1, "destroy(NULL)");

    if (saved) { test_setenv("MGPU_DEVICES", saved); free(saved); }
    gpu_group_note("devices");
}

/* ============================================================================================ */
/* 3. memory                                                                                    */
/* ============================================================================================ */
static mgpu_memory_stats stats_of(const mgpu_device* d) {
    mgpu_memory_stats s;
    memset(&s, 0, sizeof s);
    MUST(mgpu_memory_get_stats(d, &s));
    return s;
}

static void memory_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    mgpu_shape shapes[4];
    mgpu_tensor* t[4];
    mgpu_memory_stats s0, s1, s;
    uint64_t allocs_after_first = 0, hits_before = 0;
    int it, i;
    size_t want = 0;
    mgpu_shape five;
    shapes[0] = mgpu_shape1(1000);
    shapes[1] = mgpu_shape2(300, 301);
    shapes[2] = mgpu_shape1((1 << 20) + 5);
    shapes[3] = mgpu_shape3(3, 5, 7);

    s0 = stats_of(dev);
    for (i = 0; i < 4; ++i) {
        t[i] = tmake(dev, MGPU_F32, shapes[i]);
        want += mgpu_tensor_bytes(t[i]);
    }
    s1 = stats_of(dev);
    CHECK(s1.bytes_in_use >= s0.bytes_in_use + want, "%s: in use %zu after allocating %zu more than %zu", L,
          s1.bytes_in_use, want, s0.bytes_in_use);
    CHECK(s1.bytes_reserved >= s1.bytes_in_use, "%s: reserved %zu < in use %zu", L, s1.bytes_reserved, s1.bytes_in_use);
    CHECK(s1.peak_bytes_in_use >= s1.bytes_in_use, "%s: peak %zu < in use %zu", L, s1.peak_bytes_in_use, s1.bytes_in_use);
    for (i = 0; i < 4; ++i) mgpu_tensor_destroy(t[i]);
    s = stats_of(dev);
    CHECK(s.bytes_in_use == s0.bytes_in_use, "%s: in use %zu after freeing everything, was %zu", L, s.bytes_in_use,
          s0.bytes_in_use);
    CHECK(s.bytes_reserved == s1.bytes_reserved, "%s: reserved changed from %zu to %zu on free (should be cached)", L,
          s1.bytes_reserved, s.bytes_reserved);

    /* the steady state of a training loop: the same sizes again and again, no new allocations */
    for (it = 0; it < 10; ++it) {
        for (i = 0; i < 4; ++i) t[i] = tmake(dev, MGPU_F32, shapes[i]);
        for (i = 3; i >= 0; --i) mgpu_tensor_destroy(t[i]);
        s = stats_of(dev);
        if (it == 0) { allocs_after_first = s.backend_allocs; hits_before = s.cache_hits; }
    }
    CHECK(s.backend_allocs == allocs_after_first, "%s: backend allocations grew from %llu to %llu in steady state", L,
          (unsigned long long)allocs_after_first, (unsigned long long)s.backend_allocs);
    CHECK(s.cache_hits >= hits_before + 36, "%s: cache hits %llu -> %llu over 9 loops of 4", L,
          (unsigned long long)hits_before, (unsigned long long)s.cache_hits);
    CHECK(s.bytes_in_use == s0.bytes_in_use, "%s: in use %zu after the loop, was %zu", L, s.bytes_in_use, s0.bytes_in_use);

    /* size classes: a near-equal request reuses a cached block; a small one does not take a big one */
    t[0] = tmake(dev, MGPU_F32, mgpu_shape1(1000));   /* 4000 bytes */
    mgpu_tensor_destroy(t[0]);
    s1 = stats_of(dev);
    t[0] = tmake(dev, MGPU_F32, mgpu_shape1(1010));   /* 4040 bytes: the same 4 KiB class */
    s = stats_of(dev);
    CHECK(s.cache_hits == s1.cache_hits + 1 && s.backend_allocs == s1.backend_allocs,
          "%s: 4040 bytes after freeing 4000 did not reuse the block (hits %llu -> %llu)", L,
          (unsigned long long)s1.cache_hits, (unsigned long long)s.cache_hits);
    mgpu_tensor_destroy(t[0]);
    t[0] = tmake(dev, MGPU_F32, mgpu_shape1(1 << 20));   /* 4 MiB, cached on destroy */
    mgpu_tensor_destroy(t[0]);
    s1 = stats_of(dev);
    t[0] = tmake(dev, MGPU_U8, mgpu_shape1(1000));
    s = stats_of(dev);
    CHECK(s.bytes_in_use - s1.bytes_in_use < 8192, "%s: a 1000-byte tensor took a %zu-byte block", L,
          s.bytes_in_use - s1.bytes_in_use);
    mgpu_tensor_destroy(t[0]);
    s = stats_of(dev);
    CHECK(s.bytes_in_use == s0.bytes_in_use, "%s: in use %zu after the size-class checks, was %zu", L,
          s.bytes_in_use, s0.bytes_in_use);

    /* peak */
    mgpu_memory_reset_peak(dev);
    s = stats_of(dev);
    CHECK(s.peak_bytes_in_use == s.bytes_in_use, "%s: peak %zu after reset, in use %zu", L, s.peak_bytes_in_use,
          s.bytes_in_use);
    t[0] = tmake(dev, MGPU_F32, mgpu_shape1(1 << 21));   /* 8 MiB */
    s1 = stats_of(dev);
    CHECK(s1.peak_bytes_in_use >= s.bytes_in_use + ((size_t)4 << 21), "%s: peak %zu with 8 MiB more than %zu", L,
          s1.peak_bytes_in_use, s.bytes_in_use);
    mgpu_tensor_destroy(t[0]);
    s = stats_of(dev);
    CHECK(s.peak_bytes_in_use == s1.peak_bytes_in_use, "%s: peak fell from %zu to %zu on free", L, s1.peak_bytes_in_use,
          s.peak_bytes_in_use);
    mgpu_memory_reset_peak(dev);
    s = stats_of(dev);
    CHECK(s.peak_bytes_in_use == s.bytes_in_use, "%s: peak %zu after second reset, in use %zu", L, s.peak_bytes_in_use,
          s.bytes_in_use);

    /* empty_cache gives every cached block back */
    s1 = stats_of(dev);
    MUST(mgpu_memory_empty_cache(dev));
    s = stats_of(dev);
    CHECK(s.bytes_reserved == s.bytes_in_use, "%s: reserved %zu after empty_cache, in use %zu", L, s.bytes_reserved,
          s.bytes_in_use);
    CHECK(s.backend_frees > s1.backend_frees, "%s: empty_cache freed nothing (%llu frees)", L,
          (unsigned long long)s.backend_frees);
    CHECK(s.backend_allocs == s1.backend_allocs && s.bytes_in_use == s1.bytes_in_use,
          "%s: empty_cache allocated, or changed the bytes in use", L);

    /* impossible sizes fail cleanly, and change nothing */
    s1 = stats_of(dev);
    mgpu_clear_error();
    expect_null(mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2((int64_t)1 << 40, (int64_t)1 << 40)),
                MGPU_ERROR_INVALID_ARGUMENT, "create [2^40,2^40]", "mgpu_tensor_create", "1099511627776");
    expect_null(mgpu_tensor_create(dev, MGPU_F32, mgpu_shape2(-1, 3)), MGPU_ERROR_INVALID_ARGUMENT, "create [-1,3]",
                "mgpu_tensor_create", "[-1,3]");
    expect_null(mgpu_tensor_create(dev, MGPU_F32, mgpu_shape4(2, 3, -4, 5)), MGPU_ERROR_INVALID_ARGUMENT,
                "create [2,3,-4,5]", "mgpu_tensor_create", NULL);
    five = mgpu_shape4(2, 2, 2, 2);
    five.ndim = 5;
    expect_null(mgpu_tensor_create(dev, MGPU_F32, five), MGPU_ERROR_INVALID_ARGUMENT, "create with 5 dims",
                "mgpu_tensor_create", "5");
    five.ndim = -1;
    expect_null(mgpu_tensor_create(dev, MGPU_F32, five), MGPU_ERROR_INVALID_ARGUMENT, "create with -1 dims",
                "mgpu_tensor_create", NULL);
    expect_null(mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1((int64_t)1 << 62)), MGPU_ERROR_INVALID_ARGUMENT,
                "create [2^62] f32", "mgpu_tensor_create", NULL);
    expect_null(mgpu_tensor_create(dev, (mgpu_dtype)7, mgpu_shape1(4)), MGPU_ERROR_INVALID_ARGUMENT, "create dtype 7",
                "mgpu_tensor_create", NULL);
    expect_null(mgpu_tensor_create(NULL, MGPU_F32, mgpu_shape1(4)), MGPU_ERROR_INVALID_ARGUMENT, "create on NULL",
                "mgpu_tensor_create", NULL);

    /* a huge but representable size: out of memory, with the byte count, and nothing broken */
    expect_null(mgpu_tensor_create(dev, MGPU_F32, mgpu_shape1((int64_t)1 << 46)), MGPU_ERROR_OUT_OF_MEMORY,
                "create 2^46 floats", "281474976710656", L);
    s = stats_of(dev);
    CHECK(s.bytes_in_use == s1.bytes_in_use, "%s: in use %zu after failed creates, was %zu", L, s.bytes_in_use,
          s1.bytes_in_use);
    {
        float h[100], back[100];
        mgpu_tensor* x;
        rnd_normal(h, 100, 1.0);
        x = tmake(dev, MGPU_F32, mgpu_shape1(100));
        tput(x, h);
        memset(back, 0, sizeof back);
        tget(x, back);
        CHECK(all_equal_f(h, back, 100), "%s: the allocator does not work after an out-of-memory failure", L);
        mgpu_tensor_destroy(x);
        s = stats_of(dev);
        CHECK(s.bytes_in_use == s1.bytes_in_use, "%s: in use %zu after the OOM round trip, was %zu", L, s.bytes_in_use,
              s1.bytes_in_use);
    }
}

static void test_memory(void) {
    mgpu_device_set* set;
    mgpu_memory_stats s0, s;
    unsigned char* p;
    size_t i;
    int ok;
    header("memory");

    /* a fresh CPU device (replica 1 of "cpu:2") has its own, empty allocator */
    set = mgpu_device_set_create("cpu:2");
    CHECK(set != NULL, "cpu:2: %s", mgpu_last_error());
    if (set) {
        mgpu_device* d = mgpu_device_set_get(set, 1);
        s = stats_of(d);
        CHECK(s.bytes_in_use == 0 && s.bytes_reserved == 0 && s.backend_allocs == 0 && s.cache_hits == 0,
              "fresh cpu#1 allocator: in use %zu reserved %zu allocs %llu", s.bytes_in_use, s.bytes_reserved,
              (unsigned long long)s.backend_allocs);
        memory_on(d);
        s = stats_of(d);
        CHECK(s.bytes_in_use == 0, "cpu#1 in use %zu at the end", s.bytes_in_use);
        mgpu_device_set_destroy(set);
    }
#ifdef MGPU_CUDA
    if (g_gpu) {   /* a fresh GPU's allocator holds cuBLAS's workspace alone, and counts it */
        mgpu_device_set* gs = mgpu_device_set_create("cuda:0");
        CHECK(gs != NULL, "cuda:0: %s", mgpu_last_error());
        if (gs) {
            s = stats_of(mgpu_device_set_get(gs, 0));
            CHECK(s.bytes_in_use == (size_t)32 << 20 && s.bytes_reserved == s.bytes_in_use && s.backend_allocs == 1,
                  "fresh cuda:0 allocator: in use %zu (want cuBLAS's 32 MiB workspace) reserved %zu allocs %llu",
                  s.bytes_in_use, s.bytes_reserved, (unsigned long long)s.backend_allocs);
            mgpu_device_set_destroy(gs);
        }
    }
#endif
    /* and the library's CPU device */
    s0 = stats_of(mgpu_device_cpu());
    memory_on(mgpu_device_cpu());
    s = stats_of(mgpu_device_cpu());
    CHECK(s.bytes_in_use == s0.bytes_in_use, "cpu: in use %zu, was %zu", s.bytes_in_use, s0.bytes_in_use);
    expect_fail(mgpu_memory_get_stats(NULL, &s), MGPU_ERROR_INVALID_ARGUMENT, "get_stats(NULL)", NULL, NULL, NULL);
    expect_fail(mgpu_memory_get_stats(mgpu_device_cpu(), NULL), MGPU_ERROR_INVALID_ARGUMENT, "get_stats(cpu, NULL)",
                NULL, NULL, NULL);
    expect_fail(mgpu_memory_empty_cache(NULL), MGPU_ERROR_INVALID_ARGUMENT, "empty_cache(NULL)", NULL, NULL, NULL);
    mgpu_memory_reset_peak(NULL);

    if (g_gpu) memory_on(g_gpu);

    /* pinned host memory */
    p = (unsigned char*)mgpu_pinned_alloc(100000);
    CHECK(p != NULL, "pinned_alloc(100000): %s", mgpu_last_error());
    if (p) {
        CHECK(((uintptr_t)p & 63) == 0, "pinned memory %p is not 64-byte aligned", (void*)p);
        for (i = 0; i < 100000; ++i) p[i] = (unsigned char)(i * 7);
        for (ok = 1, i = 0; i < 100000; ++i) ok &= p[i] == (unsigned char)(i * 7);
        CHECK(ok, "pinned memory does not keep what was written");
        mgpu_pinned_free(p);
    }
    p = (unsigned char*)mgpu_pinned_alloc(1);
    CHECK(p != NULL, "pinned_alloc(1)");
    if (p) { p[0] = 1; mgpu_pinned_free(p); }
    mgpu_pinned_free(NULL);
    mgpu_clear_error();
    p = (unsigned char*)mgpu_pinned_alloc(SIZE_MAX - 8);
    expect_null(p, MGPU_ERROR_OUT_OF_MEMORY, "pinned_alloc(SIZE_MAX - 8)", "mgpu_pinned_alloc", NULL);
    if (p) mgpu_pinned_free(p);

    gpu_group_note("memory");
}

/* ============================================================================================ */
/* 4. tensors                                                                                   */
/* ============================================================================================ */
static void tensors_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    char buf[128], want[128];
    mgpu_tensor *t, *v, *v2, *r;
    mgpu_shape s;
    int64_t i;
    float h[60], back[60];
    int32_t hi[17], bi[17];
    uint8_t hu[33], bu[33];

    /* shapes, dims, describe */
    t = tmake(dev, MGPU_F32, mgpu_shape2(2, 3));
    s = mgpu_tensor_shape(t);
    CHECK(s.ndim == 2 && s.dim[0] == 2 && s.dim[1] == 3, "%s: shape of [2,3]", L);
    CHECK(mgpu_tensor_dim(t, 0) == 2 && mgpu_tensor_dim(t, 1) == 3 && mgpu_tensor_dim(t, -1) == 3 &&
              mgpu_tensor_dim(t, -2) == 2,
          "%s: dims of [2,3]", L);
    CHECK(mgpu_tensor_numel(t) == 6 && mgpu_tensor_bytes(t) == 24, "%s: numel %lld bytes %zu", L,
          (long long)mgpu_tensor_numel(t), mgpu_tensor_bytes(t));
    CHECK(mgpu_tensor_dtype(t) == MGPU_F32 && mgpu_tensor_device(t) == dev, "%s: dtype/device", L);
    snprintf(want, sizeof want, "f32[2,3]@%s", L);
    CHECK(strcmp(mgpu_tensor_describe(t, buf, sizeof buf), want) == 0, "describe \"%s\", want \"%s\"", buf, want);
    CHECK(mgpu_tensor_data(t) != NULL, "%s: data is NULL", L);
    memset(buf, 'x', sizeof buf);
    mgpu_tensor_describe(t, buf, 5);   /* truncated, terminated, nothing written past 5 bytes */
    CHECK(strcmp(buf, "f32[") == 0 && buf[5] == 'x', "%s: describe into 5 bytes gave \"%.5s\"", L, buf);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_U8, mgpu_shape4(2, 3, 4, 5));
    snprintf(want, sizeof want, "u8[2,3,4,5]@%s", L);
    CHECK(strcmp(mgpu_tensor_describe(t, buf, sizeof buf), want) == 0, "describe \"%s\", want \"%s\"", buf, want);
    CHECK(mgpu_tensor_numel(t) == 120 && mgpu_tensor_bytes(t) == 120 && mgpu_tensor_dim(t, 3) == 5, "%s: u8 [2,3,4,5]",
          L);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_I32, mgpu_shape1(7));
    snprintf(want, sizeof want, "i32[7]@%s", L);
    CHECK(strcmp(mgpu_tensor_describe(t, buf, sizeof buf), want) == 0 && mgpu_tensor_bytes(t) == 28,
          "describe \"%s\", bytes %zu", buf, mgpu_tensor_bytes(t));
    mgpu_tensor_destroy(t);
    memset(&s, 0, sizeof s);   /* a scalar */
    t = tmake(dev, MGPU_F32, s);
    snprintf(want, sizeof want, "f32[]@%s", L);
    CHECK(mgpu_tensor_numel(t) == 1 && mgpu_tensor_bytes(t) == 4, "%s: scalar numel %lld", L,
          (long long)mgpu_tensor_numel(t));
    CHECK(strcmp(mgpu_tensor_describe(t, buf, sizeof buf), want) == 0, "describe \"%s\", want \"%s\"", buf, want);
    h[0] = 2.5f;
    tput(t, h);
    back[0] = 0;
    tget(t, back);
    CHECK(back[0] == 2.5f, "%s: scalar round trip %g", L, back[0]);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_F32, mgpu_shape2(0, 5));   /* empty */
    CHECK(mgpu_tensor_numel(t) == 0 && mgpu_tensor_bytes(t) == 0, "%s: [0,5] numel %lld", L,
          (long long)mgpu_tensor_numel(t));
    MUST(mgpu_tensor_upload(t, h, 0));
    MUST(mgpu_tensor_download(t, back, 0));
    MUST(mgpu_tensor_fill(t, 3.0));
    mgpu_tensor_destroy(t);

    /* upload/download round trips of the three dtypes, and wrong byte counts */
    rnd_normal(h, 60, 10.0);
    for (i = 0; i < 17; ++i) hi[i] = (int32_t)(rng_u64() & 0xffffffffu);
    for (i = 0; i < 33; ++i) hu[i] = (uint8_t)rng_u64();
    t = tfrom(dev, mgpu_shape3(3, 4, 5), h);
    memset(back, 0, sizeof back);
    tget(t, back);
    CHECK(all_equal_f(h, back, 60), "%s: f32 round trip", L);
    expect_fail(mgpu_tensor_upload(t, h, 236), MGPU_ERROR_SHAPE_MISMATCH, "upload 236 bytes into 240",
                "mgpu_tensor_upload", "236", "f32[3,4,5]");
    expect_fail(mgpu_tensor_download(t, back, 244), MGPU_ERROR_SHAPE_MISMATCH, "download 244 bytes from 240",
                "mgpu_tensor_download", "244", NULL);
    expect_fail(mgpu_tensor_upload(t, NULL, 240), MGPU_ERROR_INVALID_ARGUMENT, "upload from NULL", NULL, NULL, NULL);
    expect_fail(mgpu_tensor_upload(NULL, h, 240), MGPU_ERROR_INVALID_ARGUMENT, "upload into NULL", NULL, NULL, NULL);
    expect_fail(mgpu_tensor_download(NULL, h, 240), MGPU_ERROR_INVALID_ARGUMENT, "download from NULL", NULL, NULL, NULL);
    memset(back, 0, sizeof back);
    tget(t, back);
    CHECK(all_equal_f(h, back, 60), "%s: a failed upload changed the tensor", L);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_I32, mgpu_shape1(17));
    tput(t, hi);
    memset(bi, 0, sizeof bi);
    tget(t, bi);
    CHECK(memcmp(hi, bi, sizeof hi) == 0, "%s: i32 round trip", L);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_U8, mgpu_shape2(3, 11));
    tput(t, hu);
    memset(bu, 0, sizeof bu);
    tget(t, bu);
    CHECK(memcmp(hu, bu, sizeof hu) == 0, "%s: u8 round trip", L);
    expect_fail(mgpu_tensor_upload(t, hu, 132), MGPU_ERROR_SHAPE_MISMATCH, "u8 upload 132 bytes into 33", NULL, NULL,
                NULL);
    mgpu_tensor_destroy(t);

    /* views of rows */
    for (i = 0; i < 60; ++i) h[i] = (float)i;
    t = tfrom(dev, mgpu_shape2(10, 6), h);
    v = mgpu_tensor_view_rows(t, 3, 4);
    CHECK(v != NULL, "%s: view_rows(3, 4): %s", L, mgpu_last_error());
    if (!v) exit(test_summary("test_core"));
    CHECK((char*)mgpu_tensor_data(v) == (char*)mgpu_tensor_data(t) + 3 * 6 * sizeof(float),
          "%s: view data pointer is not 72 bytes into the parent", L);
    s = mgpu_tensor_shape(v);
    CHECK(s.ndim == 2 && s.dim[0] == 4 && s.dim[1] == 6 && mgpu_tensor_device(v) == dev, "%s: view shape", L);
    tget(v, back);
    CHECK(all_equal_f(back, h + 18, 24), "%s: view contents are not rows 3..6", L);
    for (i = 0; i < 24; ++i) back[i] = -1.0f - (float)i;
    tput(v, back);
    tget(t, h);
    for (i = 0; i < 60; ++i) {
        float want_v = (i >= 18 && i < 42) ? -1.0f - (float)(i - 18) : (float)i;
        if (h[i] != want_v) break;
    }
    CHECK(i == 60, "%s: a write through the view is not in the parent (element %lld)", L, (long long)i);
    v2 = mgpu_tensor_view_rows(v, 1, 2);   /* a view of a view */
    CHECK(v2 && (char*)mgpu_tensor_data(v2) == (char*)mgpu_tensor_data(t) + 4 * 6 * sizeof(float),
          "%s: view of a view", L);
    r = mgpu_tensor_view_reshape(v, mgpu_shape3(2, 3, 4));
    CHECK(r && mgpu_tensor_data(r) == mgpu_tensor_data(v) && mgpu_tensor_numel(r) == 24 && mgpu_tensor_dim(r, 2) == 4,
          "%s: reshape of a view: %s", L, mgpu_last_error());
    expect_null(mgpu_tensor_view_rows(t, 8, 3), MGPU_ERROR_SHAPE_MISMATCH, "view_rows(8, 3) of 10", "[8, 11)",
                "mgpu_tensor_view_rows");
    expect_null(mgpu_tensor_view_rows(t, -1, 2), MGPU_ERROR_SHAPE_MISMATCH, "view_rows(-1, 2)", NULL, NULL);
    expect_null(mgpu_tensor_view_rows(t, 2, -1), MGPU_ERROR_SHAPE_MISMATCH, "view_rows(2, -1)", NULL, NULL);
    expect_null(mgpu_tensor_view_rows(NULL, 0, 1), MGPU_ERROR_INVALID_ARGUMENT, "view_rows(NULL)", NULL, NULL);
    expect_null(mgpu_tensor_view_reshape(t, mgpu_shape2(7, 9)), MGPU_ERROR_SHAPE_MISMATCH, "reshape [10,6] to [7,9]",
                "[7,9]", "mgpu_tensor_view_reshape");
    {
        mgpu_tensor* e = mgpu_tensor_view_rows(t, 10, 0);   /* empty view at the end */
        CHECK(e && mgpu_tensor_numel(e) == 0, "%s: empty view_rows(10, 0): %s", L, mgpu_last_error());
        mgpu_tensor_destroy(e);
    }
    {   /* views share storage: they allocate nothing */
        mgpu_memory_stats st0 = stats_of(dev), st1;
        mgpu_tensor *w1 = mgpu_tensor_view_rows(t, 0, 5), *w2 = mgpu_tensor_view_reshape(t, mgpu_shape1(60));
        st1 = stats_of(dev);
        CHECK(w1 && w2 && st1.bytes_in_use == st0.bytes_in_use && st1.backend_allocs == st0.backend_allocs,
              "%s: views changed bytes in use from %zu to %zu", L, st0.bytes_in_use, st1.bytes_in_use);
        mgpu_tensor_destroy(w1);
        mgpu_tensor_destroy(w2);
        st1 = stats_of(dev);
        CHECK(st1.bytes_in_use == st0.bytes_in_use, "%s: destroying views changed bytes in use from %zu to %zu", L,
              st0.bytes_in_use, st1.bytes_in_use);
    }
    /* the parent goes first; the views keep the storage alive (ASan checks the reads) */
    mgpu_tensor_destroy(t);
    tget(v, back);
    CHECK(back[0] == -1.0f && back[23] == -24.0f, "%s: view after its parent died: %g %g", L, back[0], back[23]);
    tget(r, back);
    CHECK(back[5] == -6.0f, "%s: reshape view after its parent died", L);
    mgpu_tensor_destroy(v);
    if (v2) {
        tget(v2, back);
        CHECK(back[0] == -7.0f && back[11] == -18.0f, "%s: view of a view after the first view died", L);
    }
    mgpu_tensor_destroy(v2);
    mgpu_tensor_destroy(r);

    /* copies on one device; dtype and element count mismatches */
    rnd_normal(h, 60, 1.0);
    t = tfrom(dev, mgpu_shape2(6, 10), h);
    v = tmake(dev, MGPU_F32, mgpu_shape1(60));
    MUST(mgpu_tensor_copy(v, t));
    memset(back, 0, sizeof back);
    tget(v, back);
    CHECK(all_equal_f(h, back, 60), "%s: copy [6,10] -> [60]", L);
    r = tmake(dev, MGPU_I32, mgpu_shape1(60));
    expect_fail(mgpu_tensor_copy(r, t), MGPU_ERROR_DTYPE_MISMATCH, "copy f32 -> i32", "mgpu_tensor_copy", "i32[60]",
                "f32[6,10]");
    mgpu_tensor_destroy(r);
    r = tmake(dev, MGPU_F32, mgpu_shape1(59));
    expect_fail(mgpu_tensor_copy(r, t), MGPU_ERROR_SHAPE_MISMATCH, "copy 60 -> 59 elements", "mgpu_tensor_copy",
                "f32[59]", "f32[6,10]");
    expect_fail(mgpu_tensor_copy(NULL, t), MGPU_ERROR_INVALID_ARGUMENT, "copy into NULL", NULL, NULL, NULL);
    mgpu_tensor_destroy(r);
    /* copy rows 1..2 over rows 4..5 through views */
    {
        mgpu_tensor* src = mgpu_tensor_view_rows(t, 1, 2);
        mgpu_tensor* dst = mgpu_tensor_view_rows(t, 4, 2);
        MUST(mgpu_tensor_copy(dst, src));
        tget(t, back);
        CHECK(all_equal_f(back + 40, h + 10, 20) && all_equal_f(back, h, 40), "%s: copy between row views", L);
        mgpu_tensor_destroy(src);
        mgpu_tensor_destroy(dst);
    }
    mgpu_tensor_destroy(v);
    v = mgpu_tensor_to(t, dev);
    CHECK(v && mgpu_tensor_device(v) == dev && mgpu_tensor_data(v) != mgpu_tensor_data(t), "%s: tensor_to itself", L);
    if (v) {
        float b2[60];
        tget(t, back);
        tget(v, b2);
        CHECK(all_equal_f(back, b2, 60), "%s: tensor_to contents", L);
    }
    mgpu_tensor_destroy(v);
    expect_null(mgpu_tensor_to(NULL, dev), MGPU_ERROR_INVALID_ARGUMENT, "tensor_to(NULL)", NULL, NULL);
    mgpu_tensor_destroy(t);

    /* fill for each dtype */
    t = tmake(dev, MGPU_F32, mgpu_shape2(7, 5));
    MUST(mgpu_tensor_fill(t, 1.5));
    tget(t, back);
    for (i = 0; i < 35 && back[i] == 1.5f; ++i) {}
    CHECK(i == 35, "%s: f32 fill 1.5 (element %lld)", L, (long long)i);
    MUST(mgpu_tensor_fill(t, -0.1));
    tget(t, back);
    for (i = 0; i < 35 && back[i] == -0.1f; ++i) {}
    CHECK(i == 35, "%s: f32 fill -0.1", L);
    MUST(mgpu_tensor_zero(t));
    tget(t, back);
    for (i = 0; i < 35 && back[i] == 0.0f; ++i) {}
    CHECK(i == 35, "%s: f32 zero", L);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_I32, mgpu_shape1(17));
    MUST(mgpu_tensor_fill(t, -7.0));
    tget(t, bi);
    for (i = 0; i < 17 && bi[i] == -7; ++i) {}
    CHECK(i == 17, "%s: i32 fill -7", L);
    /* an int32 that a float cannot hold exactly */
    MUST(mgpu_tensor_fill(t, 16777217.0));
    tget(t, bi);
    CHECK(bi[0] == 16777217 && bi[16] == 16777217, "%s: i32 fill 16777217 gave %d (precision lost)", L, (int)bi[0]);
    MUST(mgpu_tensor_fill(t, 123456789.0));
    tget(t, bi);
    CHECK(bi[0] == 123456789 && bi[16] == 123456789, "%s: i32 fill 123456789 gave %d (precision lost)", L, (int)bi[0]);
    MUST(mgpu_tensor_zero(t));
    tget(t, bi);
    for (i = 0; i < 17 && bi[i] == 0; ++i) {}
    CHECK(i == 17, "%s: i32 zero", L);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_U8, mgpu_shape1(33));
    MUST(mgpu_tensor_fill(t, 200.0));
    tget(t, bu);
    for (i = 0; i < 33 && bu[i] == 200; ++i) {}
    CHECK(i == 33, "%s: u8 fill 200", L);
    MUST(mgpu_tensor_fill(t, 255.0));
    tget(t, bu);
    CHECK(bu[0] == 255 && bu[32] == 255, "%s: u8 fill 255", L);
    mgpu_tensor_destroy(t);
    expect_fail(mgpu_tensor_fill(NULL, 1.0), MGPU_ERROR_INVALID_ARGUMENT, "fill(NULL)", NULL, NULL, NULL);

    /* convert: u8 pixels to f32 in [0,1]; f32 to i32 (C rules: toward zero); i32 to f32 */
    {
        uint8_t px[259];
        float f[259];
        double worst = 0.0;
        static const float fv[9] = { -2.7f, -0.5f, 0.0f, 0.5f, 2.7f, 100.2f, 1e6f, -1e6f, 7.0f };
        static const int32_t iv_want[9] = { -2, 0, 0, 0, 2, 100, 1000000, -1000000, 7 };
        static const int32_t iv_want2[9] = { -4, 0, 0, 1, 5, 200, 2000000, -1999999, 14 };   /* 2x + 0.5 */
        static const int32_t iv[6] = { -5, 0, 7, 123456, -1, 2 };
        int32_t io[9];
        float fo[6];
        mgpu_tensor *tu, *tf, *ti;
        for (i = 0; i < 259; ++i) px[i] = (uint8_t)(i < 256 ? i : 255 - i);
        tu = tmake(dev, MGPU_U8, mgpu_shape2(7, 37));
        tf = tmake(dev, MGPU_F32, mgpu_shape1(259));
        tput(tu, px);
        MUST(mgpu_tensor_convert(tf, tu, 1.0f / 255.0f, 0.0f));
        tget(tf, f);
        for (i = 0; i < 259; ++i) {
            double e = fabs((double)f[i] - (double)px[i] / 255.0);
            if (e > worst) worst = e;
        }
        CHECK(worst <= 1e-6, "%s: convert u8 -> f32 / 255: worst error %.3g", L, worst);
        CHECK(f[0] == 0.0f && fabs(f[255] - 1.0) <= 1e-6, "%s: convert u8 0 and 255 -> %g %g", L, f[0], f[255]);
        mgpu_tensor_destroy(tu);
        mgpu_tensor_destroy(tf);
        tf = tmake(dev, MGPU_F32, mgpu_shape1(9));
        ti = tmake(dev, MGPU_I32, mgpu_shape1(9));
        tput(tf, fv);
        MUST(mgpu_tensor_convert(ti, tf, 1.0f, 0.0f));
        tget(ti, io);
        CHECK(memcmp(io, iv_want, sizeof io) == 0, "%s: convert f32 -> i32: %d %d %d %d %d %d %d %d %d", L, io[0], io[1],
              io[2], io[3], io[4], io[5], io[6], io[7], io[8]);
        MUST(mgpu_tensor_convert(ti, tf, 2.0f, 0.5f));
        tget(ti, io);
        CHECK(memcmp(io, iv_want2, sizeof io) == 0, "%s: convert f32 -> i32 (2x + 0.5): %d %d %d %d %d %d %d %d %d", L,
              io[0], io[1], io[2], io[3], io[4], io[5], io[6], io[7], io[8]);
        mgpu_tensor_destroy(tf);
        mgpu_tensor_destroy(ti);
        ti = tfrom_i32(dev, mgpu_shape2(2, 3), iv);
        tf = tmake(dev, MGPU_F32, mgpu_shape1(6));
        MUST(mgpu_tensor_convert(tf, ti, 0.5f, 1.0f));
        tget(tf, fo);
        CHECK(fo[0] == -1.5f && fo[1] == 1.0f && fo[2] == 4.5f && fo[3] == 61729.0f && fo[4] == 0.5f && fo[5] == 2.0f,
              "%s: convert i32 -> f32 (x/2 + 1): %g %g %g %g %g %g", L, fo[0], fo[1], fo[2], fo[3], fo[4], fo[5]);
        r = tmake(dev, MGPU_F32, mgpu_shape1(5));
        expect_fail(mgpu_tensor_convert(r, ti, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "convert 6 -> 5 elements",
                    "mgpu_tensor_convert", "i32[2,3]", "f32[5]");
        expect_fail(mgpu_tensor_convert(NULL, ti, 1.0f, 0.0f), MGPU_ERROR_INVALID_ARGUMENT, "convert into NULL", NULL,
                    NULL, NULL);
        mgpu_tensor_destroy(r);
        mgpu_tensor_destroy(tf);
        mgpu_tensor_destroy(ti);
    }
}

static void test_tensors(void) {
    int d;
    mgpu_device_set* set;
    header("tensors");
    CHECK(mgpu_shape_numel(mgpu_shape4(2, 3, 4, 5)) == 120 && mgpu_shape_numel(mgpu_shape1(0)) == 0,
          "mgpu_shape_numel");
    CHECK(mgpu_shape_equal(mgpu_shape2(2, 3), mgpu_shape2(2, 3)) && !mgpu_shape_equal(mgpu_shape2(2, 3), mgpu_shape2(3, 2)) &&
              !mgpu_shape_equal(mgpu_shape1(6), mgpu_shape2(6, 1)),
          "mgpu_shape_equal");
    CHECK(mgpu_dtype_size(MGPU_F32) == 4 && mgpu_dtype_size(MGPU_I32) == 4 && mgpu_dtype_size(MGPU_U8) == 1,
          "mgpu_dtype_size");
    CHECK(strcmp(mgpu_dtype_name(MGPU_F32), "f32") == 0 && strcmp(mgpu_dtype_name(MGPU_I32), "i32") == 0 &&
              strcmp(mgpu_dtype_name(MGPU_U8), "u8") == 0,
          "mgpu_dtype_name");
    CHECK(mgpu_tensor_numel(NULL) == 0 && mgpu_tensor_bytes(NULL) == 0 && mgpu_tensor_data(NULL) == NULL &&
              mgpu_tensor_device(NULL) == NULL,
          "accessors of NULL");
    {
        char buf[64];
        CHECK(strcmp(mgpu_tensor_describe(NULL, buf, sizeof buf), "(null)") == 0, "describe(NULL) \"%s\"", buf);
    }
    for (d = 0; d < g_ndev; ++d) tensors_on(g_devs[d]);

    /* between CPU devices: "cpu" and "cpu#1" share host memory */
    set = mgpu_device_set_create("cpu:2");
    if (set) {
        mgpu_device* c1 = mgpu_device_set_get(set, 1);
        float h[21], back[21];
        mgpu_tensor *a, *b;
        rnd_normal(h, 21, 1.0);
        a = tfrom(mgpu_device_cpu(), mgpu_shape2(3, 7), h);
        b = mgpu_tensor_to(a, c1);
        CHECK(b && mgpu_tensor_device(b) == c1, "tensor_to(cpu#1): %s", mgpu_last_error());
        if (b) {
            tget(b, back);
            CHECK(all_equal_f(h, back, 21), "tensor_to(cpu#1) contents");
            MUST(mgpu_tensor_fill(a, 0.0));
            MUST(mgpu_tensor_copy(a, b));
            tget(a, back);
            CHECK(all_equal_f(h, back, 21), "copy cpu#1 -> cpu");
        }
        mgpu_tensor_destroy(a);
        mgpu_tensor_destroy(b);
        mgpu_device_set_destroy(set);
    }

#ifdef MGPU_CUDA
    if (g_gpu) {
        /* CPU <-> GPU, GPU <-> GPU on one stream, and between two replicas of one GPU */
        int64_t n = 1000003, i;
        float* h = fbuf(n);
        float* back = fbuf(n);
        mgpu_tensor *c, *g1, *g2, *c2, *gi;
        mgpu_device_set* reps;
        rnd_normal(h, n, 3.0);
        c = tfrom(mgpu_device_cpu(), mgpu_shape1(n), h);
        g1 = tmake(g_gpu, MGPU_F32, mgpu_shape1(n));
        g2 = tmake(g_gpu, MGPU_F32, mgpu_shape2(1, n));
        c2 = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(n));
        MUST(mgpu_tensor_copy(g1, c));
        MUST(mgpu_tensor_copy(g2, g1));
        MUST(mgpu_tensor_copy(c2, g2));
        tget(c2, back);
        CHECK(all_equal_f(h, back, n), "cpu -> cuda:0 -> cuda:0 -> cpu copies");
        gi = tmake(g_gpu, MGPU_I32, mgpu_shape1(n));
        expect_fail(mgpu_tensor_copy(gi, c), MGPU_ERROR_DTYPE_MISMATCH, "copy cpu f32 -> cuda i32", "mgpu_tensor_copy",
                    "cuda:0", "cpu");
        mgpu_tensor_destroy(gi);
        gi = tmake(g_gpu, MGPU_F32, mgpu_shape1(n - 1));
        expect_fail(mgpu_tensor_copy(gi, c), MGPU_ERROR_SHAPE_MISMATCH, "copy cpu -> cuda, n - 1 elements",
                    "mgpu_tensor_copy", NULL, NULL);
        mgpu_tensor_destroy(gi);
        {   /* a row view on the GPU to the CPU */
            mgpu_tensor* gv = mgpu_tensor_view_rows(g1, 100, 900);
            mgpu_tensor* cv = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(900));
            MUST(mgpu_tensor_copy(cv, gv));
            tget(cv, back);
            CHECK(all_equal_f(h + 100, back, 900), "copy of a cuda:0 row view to the cpu");
            mgpu_tensor_destroy(gv);
            mgpu_tensor_destroy(cv);
        }
        gi = mgpu_tensor_to(g1, mgpu_device_cpu());
        CHECK(gi && mgpu_tensor_device(gi) == mgpu_device_cpu(), "tensor_to(cpu) from cuda:0");
        if (gi) { tget(gi, back); CHECK(all_equal_f(h, back, n), "tensor_to(cpu) from cuda:0 contents"); }
        mgpu_tensor_destroy(gi);

        reps = mgpu_device_set_create("cuda:0,0");
        CHECK(reps != NULL, "cuda:0,0: %s", mgpu_last_error());
        if (reps) {
            mgpu_device *r0 = mgpu_device_set_get(reps, 0), *r1 = mgpu_device_set_get(reps, 1);
            mgpu_tensor *a = tfrom(r0, mgpu_shape1(n), h), *b = tmake(r1, MGPU_F32, mgpu_shape1(n)), *b2;
            for (i = 0; i < n; ++i) back[i] = 0.0f;
            MUST(mgpu_tensor_copy(b, a));
            tget(b, back);
            CHECK(all_equal_f(h, back, n), "copy cuda:0 -> cuda:0#1 (two replicas)");
            b2 = mgpu_tensor_to(b, r0);
            CHECK(b2 != NULL, "tensor_to(cuda:0#1 -> cuda:0): %s", mgpu_last_error());
            if (b2) { tget(b2, back); CHECK(all_equal_f(h, back, n), "tensor_to between replicas"); }
            MUST(mgpu_tensor_copy(g1, b));   /* replica 1 -> g_gpu (another set, same GPU) */
            tget(g1, back);
            CHECK(all_equal_f(h, back, n), "copy cuda:0#1 -> cuda:0 of another set");
            mgpu_tensor_destroy(a);
            mgpu_tensor_destroy(b);
            mgpu_tensor_destroy(b2);
            mgpu_device_set_destroy(reps);
        }
        mgpu_tensor_destroy(c);
        mgpu_tensor_destroy(c2);
        mgpu_tensor_destroy(g1);
        mgpu_tensor_destroy(g2);
        free(h);
        free(back);
    }
#endif
    gpu_group_note("tensors");
}

/* ============================================================================================ */
/* 5. random                                                                                    */
/* ============================================================================================ */
static void random_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    const int64_t n = g_quick ? (1 << 16) : (1 << 20);
    const double dn = (double)n;
    float *x = fbuf(n), *y = fbuf(n);
    double* ref = dbuf(n);
    mgpu_tensor* t = tmake(dev, MGPU_F32, mgpu_shape1(n));
    int64_t i, bad, in1;
    double mean, var, w, se;
    const uint64_t k = 5;
    char what[128];

    /* uniform in [low, high): range, mean, variance */
    MUST(mgpu_rand_uniform(t, 1234, 0, -2.0f, 3.0f));
    tget(t, x);
    for (bad = 0, mean = 0.0, i = 0; i < n; ++i) {
        bad += !(x[i] >= -2.0f && x[i] < 3.0f);
        mean += x[i];
    }
    mean /= dn;
    for (var = 0.0, i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= dn - 1.0;
    w = 5.0;
    CHECK(bad == 0, "%s: %lld uniform numbers outside [-2, 3)", L, (long long)bad);
    se = sqrt(w * w / 12.0 / dn);
    CHECK(fabs(mean - 0.5) < 5.0 * se, "%s: uniform mean %.5f, want 0.5 +- %.5f", L, mean, 5.0 * se);
    se = sqrt(w * w * w * w * (1.0 / 80.0 - 1.0 / 144.0) / dn);
    CHECK(fabs(var - w * w / 12.0) < 5.0 * se, "%s: uniform variance %.5f, want %.5f +- %.5f", L, var, w * w / 12.0,
          5.0 * se);
    /* element-wise equal to the shared Philox function: bitwise, on every device */
    for (bad = 0, i = 0; i < n; ++i) bad += x[i] != mgpu__rand_element(1234, 0, (uint64_t)i, 0, -2.0f, 3.0f);
    CHECK(bad == 0, "%s: %lld uniform numbers differ from mgpu__rand_element", L, (long long)bad);
    if (is_gpu(dev)) printf("  %-8s rand_uniform n=%lld: %lld of %lld differ bitwise from the CPU\n", L, (long long)n,
                            (long long)bad, (long long)n);
    MUST(mgpu_rand_uniform(t, 1234, 0, 0.0f, 1.0f));
    tget(t, y);
    for (bad = 0, i = 0; i < n; ++i) bad += !(y[i] >= 0.0f && y[i] < 1.0f);
    CHECK(bad == 0, "%s: %lld numbers outside [0, 1)", L, (long long)bad);
    /* a range far from 0: low + (high - low) * u must still stay below high */
    MUST(mgpu_rand_uniform(t, 1234, 0, 1000.0f, 1001.0f));
    tget(t, y);
    for (bad = 0, i = 0; i < n; ++i) bad += !(y[i] >= 1000.0f && y[i] < 1001.0f);
    CHECK(bad == 0, "%s: rand_uniform [1000, 1001): %lld of %lld numbers outside (== 1001, the excluded bound)", L,
          (long long)bad, (long long)n);

    /* the same (seed, offset) twice: identical; another offset or seed: different */
    MUST(mgpu_rand_uniform(t, 1234, 0, -2.0f, 3.0f));
    tget(t, y);
    CHECK(all_equal_f(x, y, n), "%s: the same seed and offset gave different numbers", L);
    MUST(mgpu_rand_uniform(t, 1234, 1, -2.0f, 3.0f));
    tget(t, y);
    for (bad = 0, i = 0; i < n; ++i) bad += x[i] == y[i];
    CHECK(bad < n / 100, "%s: offsets 0 and 1 agree on %lld of %lld numbers", L, (long long)bad, (long long)n);
    MUST(mgpu_rand_uniform(t, 1235, 0, -2.0f, 3.0f));
    tget(t, y);
    for (bad = 0, i = 0; i < n; ++i) bad += x[i] == y[i];
    CHECK(bad < n / 100, "%s: seeds 1234 and 1235 agree on %lld of %lld numbers", L, (long long)bad, (long long)n);
    /* the counter contract: element i at offset 0 is element i - 4k at offset k */
    MUST(mgpu_rand_uniform(t, 77, k, -2.0f, 3.0f));
    tget(t, y);
    MUST(mgpu_rand_uniform(t, 77, 0, -2.0f, 3.0f));
    tget(t, x);
    for (bad = 0, i = (int64_t)(4 * k); i < n; ++i) bad += x[i] != y[i - 4 * (int64_t)k];
    CHECK(bad == 0, "%s: uniform counter contract broken at %lld elements", L, (long long)bad);

    /* normal: mean 0, std 1, 68.27% within one sigma; element-wise equal to mgpu__rand_element */
    MUST(mgpu_rand_normal(t, 99, 7, 0.0f, 1.0f));
    tget(t, x);
    for (mean = 0.0, in1 = 0, i = 0; i < n; ++i) {
        mean += x[i];
        in1 += fabs(x[i]) < 1.0f;
    }
    mean /= dn;
    for (var = 0.0, i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= dn - 1.0;
    CHECK(fabs(mean) < 5.0 / sqrt(dn), "%s: normal mean %.5f, want 0 +- %.5f", L, mean, 5.0 / sqrt(dn));
    CHECK(fabs(var - 1.0) < 5.0 * sqrt(2.0 / dn), "%s: normal variance %.5f, want 1 +- %.5f", L, var,
          5.0 * sqrt(2.0 / dn));
    se = sqrt(0.6827 * 0.3173 / dn);
    CHECK(fabs((double)in1 / dn - 0.682689) < 5.0 * se, "%s: fraction within one sigma %.5f, want 0.6827 +- %.5f", L,
          (double)in1 / dn, 5.0 * se);
    for (i = 0; i < n; ++i) ref[i] = mgpu__rand_element(99, 7, (uint64_t)i, 1, 0.0f, 1.0f);
    if (!is_gpu(dev)) {
        for (bad = 0, i = 0; i < n; ++i) bad += x[i] != (float)ref[i];
        CHECK(bad == 0, "%s: %lld normal numbers differ from mgpu__rand_element", L, (long long)bad);
    }
    snprintf(what, sizeof what, "rand_normal n=%lld vs mgpu__rand_element", (long long)n);
    check_err(dev, what, x, ref, n, 1e-6);
    MUST(mgpu_rand_normal(t, 99, 7, 0.0f, 1.0f));
    tget(t, y);
    CHECK(all_equal_f(x, y, n), "%s: the same normal draw twice differs", L);
    MUST(mgpu_rand_normal(t, 99, 7 + k, 0.0f, 1.0f));
    tget(t, y);
    for (bad = 0, i = (int64_t)(4 * k); i < n; ++i) bad += x[i] != y[i - 4 * (int64_t)k];
    CHECK(bad == 0, "%s: normal counter contract broken at %lld elements", L, (long long)bad);
    /* mean 3, std 0.5 */
    MUST(mgpu_rand_normal(t, 5, 0, 3.0f, 0.5f));
    tget(t, x);
    for (mean = 0.0, i = 0; i < n; ++i) mean += x[i];
    mean /= dn;
    for (var = 0.0, i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= dn - 1.0;
    CHECK(fabs(mean - 3.0) < 5.0 * 0.5 / sqrt(dn) && fabs(sqrt(var) - 0.5) < 0.005, "%s: normal(3, 0.5): mean %.5f std %.5f",
          L, mean, sqrt(var));
    MUST(mgpu_rand_normal(t, 5, 0, 3.0f, 0.0f));
    tget(t, x);
    for (bad = 0, i = 0; i < n; ++i) bad += x[i] != 3.0f;
    CHECK(bad == 0, "%s: normal with std 0 is not constant", L);
    mgpu_tensor_destroy(t);

    /* odd sizes, and consecutive draws using mgpu_rand_offsets */
    {
        static const int64_t sizes[4] = { 1, 3, 1001, 4099 };
        int s;
        for (s = 0; s < 4; ++s) {
            int64_t m = sizes[s];
            t = tmake(dev, MGPU_F32, mgpu_shape1(m));
            MUST(mgpu_rand_normal(t, 31337, 12345678901ull, 1.0f, 2.0f));
            tget(t, x);
            for (bad = 0, i = 0; i < m; ++i) {
                float e = mgpu__rand_element(31337, 12345678901ull, (uint64_t)i, 1, 1.0f, 2.0f);
                bad += is_gpu(dev) ? fabs(x[i] - e) > 1e-6 * (fabs(e) + 1.0) : x[i] != e;
            }
            CHECK(bad == 0, "%s: normal draw of %lld differs from mgpu__rand_element at %lld", L, (long long)m,
                  (long long)bad);
            MUST(mgpu_rand_uniform(t, (uint64_t)-1, (uint64_t)-3, -1.0f, 1.0f));   /* counter wraps past 2^64 */
            tget(t, x);
            for (bad = 0, i = 0; i < m; ++i) bad += x[i] != mgpu__rand_element((uint64_t)-1, (uint64_t)-3, (uint64_t)i, 0, -1.0f, 1.0f);
            CHECK(bad == 0, "%s: uniform draw of %lld with seed/offset near 2^64 differs at %lld", L, (long long)m,
                  (long long)bad);
            mgpu_tensor_destroy(t);
        }
        t = tmake(dev, MGPU_F32, mgpu_shape1(4096));
        MUST(mgpu_rand_uniform(t, 8, 100, 0.0f, 1.0f));
        tget(t, x);
        mgpu_tensor_destroy(t);
        t = tmake(dev, MGPU_F32, mgpu_shape1(2048));
        MUST(mgpu_rand_uniform(t, 8, 100, 0.0f, 1.0f));
        tget(t, y);
        MUST(mgpu_rand_uniform(t, 8, 100 + mgpu_rand_offsets(2048), 0.0f, 1.0f));
        tget(t, y + 2048);
        CHECK(all_equal_f(x, y, 4096), "%s: two draws of 2048 at offsets o, o + rand_offsets(2048) != one draw of 4096", L);
        mgpu_tensor_destroy(t);
    }
    /* errors */
    t = tmake(dev, MGPU_I32, mgpu_shape1(4));
    expect_fail(mgpu_rand_uniform(t, 1, 0, 0.0f, 1.0f), MGPU_ERROR_DTYPE_MISMATCH, "rand_uniform on i32",
                "mgpu_rand_uniform", "i32[4]", NULL);
    mgpu_tensor_destroy(t);
    t = tmake(dev, MGPU_F32, mgpu_shape1(4));
    expect_fail(mgpu_rand_normal(t, 1, 0, 0.0f, -1.0f), MGPU_ERROR_INVALID_ARGUMENT, "rand_normal std -1",
                "mgpu_rand_normal", NULL, NULL);
    expect_fail(mgpu_rand_normal(t, 1, 0, 0.0f, (float)NAN), MGPU_ERROR_INVALID_ARGUMENT, "rand_normal std NaN",
                "mgpu_rand_normal", NULL, NULL);
    expect_fail(mgpu_rand_uniform(NULL, 1, 0, 0.0f, 1.0f), MGPU_ERROR_INVALID_ARGUMENT, "rand_uniform(NULL)", NULL, NULL,
                NULL);
    mgpu_tensor_destroy(t);
    free(x);
    free(y);
    free(ref);
}

/* ============================================================================================ */
/* bfloat16                                                                                     */
/* ============================================================================================ */
static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static int is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

/* The bfloat16 nearest a float that is not a NaN, ties to even, from first principles: the two
   candidates around |x| (its upper half, and one unit more: 2^128 past the largest, which is
   infinity) compared in double (exact: floats of neighbouring binades). */
static uint16_t bf16_reference(float x) {
    const uint32_t u = bits_of(x), sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
    const uint32_t lo = mag & 0xFFFF0000u, hi = lo + 0x10000u;
    const double d = fabs((double)x), dlo = (double)float_of(lo), dhi = hi == 0x7F800000u ? ldexp(1.0, 128) : (double)float_of(hi);
    uint32_t pick;
    if (mag == lo) return (uint16_t)(u >> 16);   /* exact, infinities too */
    pick = d - dlo < dhi - d || (d - dlo == dhi - d && ((lo >> 16) & 1u) == 0) ? lo : hi;
    return (uint16_t)((sign | pick) >> 16);
}

/* One float's conversion against the reference: 1 when right (a NaN: a NaN of its sign). */
static int bf16_right(uint32_t u) {
    const uint16_t got = mgpu_bf16_from_float(float_of(u));
    if (is_nan_bits(u)) return is_nan_bits((uint32_t)got << 16) && (got & 0x8000u) == ((u >> 16) & 0x8000u);
    return got == bf16_reference(float_of(u));
}

/* The conversions on the host: every upper half with the lower halves that decide a rounding
   (0, just below, at and just above the tie, the largest), a stride through all 2^32 floats,
   random ones; every bfloat16 back to float and again to itself. */
static void bf16_conversions(void) {
    static const uint32_t lows[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu};
    uint64_t checked = 0, wrong = 0, first_wrong = 0;
    uint32_t hi16, k, b;
    int i, round_trip = 1;
    for (hi16 = 0; hi16 < 0x10000u; ++hi16)
        for (k = 0; k < sizeof lows / sizeof lows[0]; ++k) {
            const uint32_t u = (hi16 << 16) | lows[k];
            ++checked;
            if (!bf16_right(u) && !wrong++) first_wrong = u;
        }
    for (b = 0; b < 0xFFFFF000u; b += 0x1003u) { ++checked; if (!bf16_right(b) && !wrong++) first_wrong = b; }
    for (i = 0; i < 200000; ++i) {
        const uint32_t u = (uint32_t)rng_u64();
        ++checked;
        if (!bf16_right(u) && !wrong++) first_wrong = u;
    }
    CHECK(wrong == 0, "mgpu_bf16_from_float: %llu of %llu floats not rounded to the nearest even bfloat16, the first 0x%08x "
          "(gave 0x%04x, want 0x%04x)", (unsigned long long)wrong, (unsigned long long)checked, (unsigned)first_wrong,
          (unsigned)mgpu_bf16_from_float(float_of((uint32_t)first_wrong)), (unsigned)bf16_reference(float_of((uint32_t)first_wrong)));
    /* the cases by name, as PyTorch's .to(torch.bfloat16) gives them */
    CHECK(mgpu_bf16_from_float(1.0f) == 0x3F80 && mgpu_bf16_from_float(float_of(0x3F808000u)) == 0x3F80 &&
          mgpu_bf16_from_float(float_of(0x3F818000u)) == 0x3F82 && mgpu_bf16_from_float(float_of(0x3F808001u)) == 0x3F81 &&
          mgpu_bf16_from_float(-0.0f) == 0x8000 && mgpu_bf16_from_float(FLT_MAX) == 0x7F80 &&
          mgpu_bf16_from_float(-FLT_MAX) == 0xFF80 && mgpu_bf16_from_float(float_of(0x7F7F7FFFu)) == 0x7F7F &&
          mgpu_bf16_from_float(1e-40f) == 0x0001 && mgpu_bf16_from_float(float_of(0x00008000u)) == 0x0000,
          "bfloat16 of 1, the two ties above 1, just above a tie, -0, FLT_MAX (infinity), -FLT_MAX, the largest below "
          "the overflow, a subnormal, the tie at 0");
    for (b = 0; b < 0x10000u; ++b) {
        const float f = mgpu_bf16_to_float((uint16_t)b);
        const int nan = is_nan_bits(b << 16);
        if (bits_of(f) != b << 16 || (nan ? !is_nan_bits((uint32_t)mgpu_bf16_from_float(f) << 16) : mgpu_bf16_from_float(f) != b)) {
            round_trip = 0;
            break;
        }
    }
    CHECK(round_trip, "bfloat16 0x%04x to float (0x%08x) and back gave 0x%04x", (unsigned)b, (unsigned)bits_of(mgpu_bf16_to_float((uint16_t)b)),
          (unsigned)mgpu_bf16_from_float(mgpu_bf16_to_float((uint16_t)b)));
}

/* MGPU_BF16 tensors on one device: size and name, fill, convert both ways (against the host's
   conversion, every bfloat16 and floats that test the rounding), to integers, copies to and from
   the CPU and of a row view, and the ops' refusal. */
static void bf16_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    enum { N = 65536 };
    uint16_t* bits = (uint16_t*)xmalloc(N * sizeof(uint16_t));
    uint16_t* back = (uint16_t*)xmalloc(N * sizeof(uint16_t));
    float* f = fbuf(N);
    mgpu_tensor *tb = tmake(dev, MGPU_BF16, mgpu_shape2(256, 256)), *tf = tmake(dev, MGPU_F32, mgpu_shape2(256, 256)), *ti, *v, *c;
    char desc[64];
    int64_t i, bad = -1;
    CHECK(mgpu_tensor_bytes(tb) == 2 * N && !strncmp(mgpu_tensor_describe(tb, desc, sizeof desc), "bf16[256,256]@", 14),
          "%s: a bf16 tensor of %d elements: %zu bytes, \"%s\"", L, N, mgpu_tensor_bytes(tb), desc);
    /* fill: through the float, as PyTorch's fill_ */
    MUST(mgpu_tensor_fill(tb, 1.1));
    tget(tb, back);
    for (i = 0; i < N && bad < 0; ++i) if (back[i] != mgpu_bf16_from_float(1.1f)) bad = i;
    MUST(mgpu_tensor_fill(tb, 0.0));
    tget(tb, back);
    for (i = 0; i < N && bad < 0; ++i) if (back[i] != 0) bad = i;
    CHECK(bad < 0, "%s: bf16 fill 1.1 then 0: element %lld is 0x%04x", L, (long long)bad, bad >= 0 ? (unsigned)back[bad] : 0u);
    /* bf16 -> f32: every bfloat16, exactly (NaNs too: the same bits shifted) */
    for (i = 0; i < N; ++i) bits[i] = (uint16_t)i;
    tput(tb, bits);
    MUST(mgpu_tensor_convert(tf, tb, 1.0f, 0.0f));
    tget(tf, f);
    for (bad = -1, i = 0; i < N && bad < 0; ++i) if (bits_of(f[i]) != (uint32_t)i << 16) bad = i;
    CHECK(bad < 0, "%s: convert bf16 -> f32: 0x%04llx gave 0x%08x", L, (long long)bad, bad >= 0 ? (unsigned)bits_of(f[bad]) : 0u);
    /* f32 -> bf16: the cases that decide a rounding, and random floats of every magnitude */
    for (i = 0; i < N; ++i) {
        static const uint32_t lows[] = {0x0000u, 0x7FFFu, 0x8000u, 0x8001u};
        const uint32_t hi16 = (uint32_t)rng_u64() & 0xFFFFu;
        f[i] = float_of(i < N / 2 ? (hi16 << 16) | lows[i % 4] : (uint32_t)rng_u64());
    }
    f[0] = -0.0f; f[1] = FLT_MAX; f[2] = -FLT_MAX; f[3] = float_of(0x7FC00001u); f[4] = float_of(0xFF812345u); f[5] = 1e-40f;
    tput(tf, f);
    MUST(mgpu_tensor_convert(tb, tf, 1.0f, 0.0f));
    tget(tb, back);
    for (bad = -1, i = 0; i < N && bad < 0; ++i) if (back[i] != mgpu_bf16_from_float(f[i])) bad = i;
    CHECK(bad < 0, "%s: convert f32 -> bf16: 0x%08x gave 0x%04x, want 0x%04x", L, bad >= 0 ? (unsigned)bits_of(f[bad]) : 0u,
          bad >= 0 ? (unsigned)back[bad] : 0u, bad >= 0 ? (unsigned)mgpu_bf16_from_float(f[bad]) : 0u);
    /* scale and shift, and bf16 -> i32 (toward zero) */
    {
        static const float fv[6] = {-2.75f, -0.5f, 0.0f, 1.5f, 300.0f, 1e6f};
        static const int32_t want[6] = {-4, 0, 1, 4, 601, 1998849};   /* 2 * bf16(x) + 1, toward zero; bf16(1e6) = 999424 */
        int32_t io[6];
        mgpu_tensor *b6 = tmake(dev, MGPU_BF16, mgpu_shape1(6)), *f6 = tfrom(dev, mgpu_shape1(6), fv);
        ti = tmake(dev, MGPU_I32, mgpu_shape1(6));
        MUST(mgpu_tensor_convert(b6, f6, 1.0f, 0.0f));
        MUST(mgpu_tensor_convert(ti, b6, 2.0f, 1.0f));
        tget(ti, io);
        CHECK(!memcmp(io, want, sizeof io), "%s: convert f32 -> bf16 -> i32 (2x + 1): %d %d %d %d %d %d", L, io[0], io[1], io[2],
              io[3], io[4], io[5]);
        mgpu_tensor_destroy(b6);
        mgpu_tensor_destroy(f6);
        mgpu_tensor_destroy(ti);
    }
    /* copies: to the CPU and back, a row view */
    c = mgpu_tensor_to(tb, mgpu_device_cpu());
    CHECK(c && mgpu_tensor_dtype(c) == MGPU_BF16, "%s: bf16 tensor_to(cpu): %s", L, mgpu_last_error());
    if (c) {
        CHECK(!memcmp(mgpu_tensor_data(c), back, N * sizeof(uint16_t)), "%s: bf16 tensor_to(cpu): other bits", L);
        MUST(mgpu_tensor_zero(tb));
        MUST(mgpu_tensor_copy(tb, c));
        tget(tb, bits);
        CHECK(!memcmp(bits, back, N * sizeof(uint16_t)), "%s: bf16 to the CPU and back: other bits", L);
    }
    v = mgpu_tensor_view_rows(tb, 3, 2);
    CHECK(v && mgpu_tensor_bytes(v) == 1024, "%s: a bf16 row view: %s", L, mgpu_last_error());
    if (v) {
        uint16_t row[512];
        tget(v, row);
        CHECK(!memcmp(row, back + 3 * 256, sizeof row), "%s: bf16 rows 3 and 4 through a view: other bits", L);
        /* an op that computes in f32 only says so */
        expect_fail(mgpu_softmax(v, v), MGPU_ERROR_DTYPE_MISMATCH, "softmax of a bf16 tensor", "mgpu_softmax", "bf16", NULL);
        mgpu_tensor_destroy(v);
    }
    mgpu_tensor_destroy(c);
    mgpu_tensor_destroy(tb);
    mgpu_tensor_destroy(tf);
    free(bits);
    free(back);
    free(f);
}

static void test_bf16(void) {
    int d;
    header("bfloat16: conversions, tensors");
    CHECK(mgpu_dtype_size(MGPU_BF16) == 2 && !strcmp(mgpu_dtype_name(MGPU_BF16), "bf16"), "bf16: size %zu, name %s",
          mgpu_dtype_size(MGPU_BF16), mgpu_dtype_name(MGPU_BF16));
    bf16_conversions();
    for (d = 0; d < g_ndev; ++d) bf16_on(g_devs[d]);
    gpu_group_note("bfloat16 tensors");
}

static void test_random(void) {
    int d;
    header("random");
    CHECK(mgpu_rand_offsets(0) == 0 && mgpu_rand_offsets(1) == 1 && mgpu_rand_offsets(4) == 1 &&
              mgpu_rand_offsets(5) == 2 && mgpu_rand_offsets(1000) == 250 && mgpu_rand_offsets(-3) == 0,
          "mgpu_rand_offsets");
    for (d = 0; d < g_ndev; ++d) random_on(g_devs[d]);
#ifdef MGPU_CUDA
    if (g_gpu) {   /* the CPU and the GPU draw the same numbers */
        int64_t n = g_quick ? 100003 : 1000003, i, bad;
        float *c = fbuf(n), *g = fbuf(n);
        double* ref = dbuf(n);
        mgpu_tensor *tc = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(n)), *tg = tmake(g_gpu, MGPU_F32, mgpu_shape1(n));
        MUST(mgpu_rand_uniform(tc, 2024, 3, -0.5f, 0.5f));
        MUST(mgpu_rand_uniform(tg, 2024, 3, -0.5f, 0.5f));
        tget(tc, c);
        tget(tg, g);
        CHECK(all_equal_f(c, g, n), "cpu and cuda:0 uniform draws differ");
        MUST(mgpu_rand_normal(tc, 2024, 3, 0.0f, 1.0f));
        MUST(mgpu_rand_normal(tg, 2024, 3, 0.0f, 1.0f));
        tget(tc, c);
        tget(tg, g);
        for (bad = 0, i = 0; i < n; ++i) { ref[i] = c[i]; bad += c[i] != g[i]; }
        check_err(g_gpu, "rand_normal, cuda:0 vs cpu", g, ref, n, 1e-6);
        printf("  cuda:0   rand_normal n=%lld: %lld of %lld differ bitwise from the CPU\n", (long long)n, (long long)bad,
               (long long)n);
        mgpu_tensor_destroy(tc);
        mgpu_tensor_destroy(tg);
        free(c);
        free(g);
        free(ref);
    }
#endif
    gpu_group_note("random");
}

/* ============================================================================================ */
/* 6a. elementwise ops                                                                          */
/* ============================================================================================ */
enum { EW_ADD, EW_SUB, EW_MUL, EW_SCALE, EW_AXPY, EW_RELU, EW_GELU, EW_TANH, EW_SIGMOID,
       EW_RELU_BWD, EW_GELU_BWD, EW_TANH_BWD, EW_SIGMOID_BWD, EW_COUNT };
static const char* ew_name[EW_COUNT] = { "add", "sub", "mul", "scale", "axpy", "relu", "gelu", "tanh", "sigmoid",
                                         "relu_backward", "gelu_backward", "tanh_backward", "sigmoid_backward" };
#define EW_SCALE_ALPHA (-1.75f)
#define EW_AXPY_ALPHA 0.625f

static int ew_is_binary(int op) { return op == EW_ADD || op == EW_SUB || op == EW_MUL || op == EW_AXPY || op >= EW_RELU_BWD; }

/* out = op(a, b); for axpy out = alpha * a + b, through mgpu_axpy on a copy of b. */
static mgpu_result ew_run(int op, mgpu_tensor* out, const mgpu_tensor* a, const mgpu_tensor* b) {
    switch (op) {
    case EW_ADD: return mgpu_add(out, a, b);
    case EW_SUB: return mgpu_sub(out, a, b);
    case EW_MUL: return mgpu_mul(out, a, b);
    case EW_SCALE: return mgpu_scale(out, a, EW_SCALE_ALPHA);
    case EW_AXPY:
        if (out != b) MGPU__TRY(mgpu_tensor_copy(out, b));
        return mgpu_axpy(out, EW_AXPY_ALPHA, a);
    case EW_RELU: return mgpu_relu(out, a);
    case EW_GELU: return mgpu_gelu(out, a);
    case EW_TANH: return mgpu_tanh(out, a);
    case EW_SIGMOID: return mgpu_sigmoid(out, a);
    case EW_RELU_BWD: return mgpu_relu_backward(out, a, b);
    case EW_GELU_BWD: return mgpu_gelu_backward(out, a, b);
    case EW_TANH_BWD: return mgpu_tanh_backward(out, a, b);
    default: return mgpu_sigmoid_backward(out, a, b);
    }
}

static double ref_gelu(double x) { return 0.5 * x * (1.0 + erf(x / sqrt(2.0))); }
static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double ref_relu(double x) { return x > 0.0 ? x : 0.0; }
static double ew_ref(int op, double a, double b) {
    switch (op) {
    case EW_ADD: return a + b;
    case EW_SUB: return a - b;
    case EW_MUL: return a * b;
    case EW_SCALE: return (double)EW_SCALE_ALPHA * a;
    case EW_AXPY: return (double)EW_AXPY_ALPHA * a + b;
    case EW_RELU: return ref_relu(a);
    case EW_GELU: return ref_gelu(a);
    case EW_TANH: return tanh(a);
    case EW_SIGMOID: return ref_sigmoid(a);
    case EW_RELU_BWD: return b > 0.0 ? a : 0.0;
    case EW_GELU_BWD: return a * (0.5 * (1.0 + erf(b / sqrt(2.0))) + b * exp(-0.5 * b * b) / sqrt(2.0 * TEST_PI));
    case EW_TANH_BWD: return a * (1.0 - b * b);
    default: return a * b * (1.0 - b);
    }
}

static void elementwise_on(mgpu_device* dev, int64_t n) {
    float *xa = fbuf(n), *xb = fbuf(n), *dy = fbuf(n), *ty = fbuf(n), *sy = fbuf(n), *got = fbuf(n);
    double* ref = dbuf(n);
    mgpu_tensor *t_xa, *t_xb, *t_dy, *t_ty, *t_sy, *out;
    int64_t i;
    int op, alias;
    char what[160];
    mgpu_shape s = (n % 3 == 0 && n > 0) ? mgpu_shape2(3, n / 3) : mgpu_shape1(n);
    rnd_uniform(xa, n, -4.0, 4.0);
    rnd_uniform(xb, n, -3.0, 3.0);
    rnd_normal(dy, n, 1.0);
    for (i = 0; i < n; ++i) { ty[i] = (float)tanh(xb[i]); sy[i] = (float)ref_sigmoid(xb[i]); }
    t_xa = tfrom(dev, s, xa);
    t_xb = tfrom(dev, s, xb);
    t_dy = tfrom(dev, s, dy);
    t_ty = tfrom(dev, s, ty);
    t_sy = tfrom(dev, s, sy);
    out = tmake(dev, MGPU_F32, s);
    for (op = 0; op < EW_COUNT; ++op) {
        const float *ha = xa, *hb = xb;
        mgpu_tensor *ta = t_xa, *tb = t_xb;
        if (op >= EW_RELU_BWD) { ha = dy; ta = t_dy; hb = xa; tb = t_xa; }
        if (op == EW_TANH_BWD) { hb = ty; tb = t_ty; }
        if (op == EW_SIGMOID_BWD) { hb = sy; tb = t_sy; }
        for (i = 0; i < n; ++i) ref[i] = ew_ref(op, ha[i], hb[i]);
        /* alias 0: a fresh out; 1: out is the first input; 2: out is the second input */
        for (alias = 0; alias < 3; ++alias) {
            mgpu_tensor* o = out;
            mgpu_result r;
            if (alias == 1 && (op == EW_AXPY)) continue;
            if (alias == 2 && !ew_is_binary(op)) continue;
            if (alias == 0) MUST(mgpu_tensor_fill(out, NAN));
            else o = mgpu_tensor_to(alias == 1 ? ta : tb, dev);
            if (!o) { CHECK(0, "tensor_to: %s", mgpu_last_error()); continue; }
            r = alias == 1 ? ew_run(op, o, o, tb) : alias == 2 ? ew_run(op, o, ta, o) : ew_run(op, o, ta, tb);
            CHECK(r == MGPU_OK, "%s n=%lld on %s: %s", ew_name[op], (long long)n, mgpu_device_label(dev), mgpu_last_error());
            tget(o, got);
            snprintf(what, sizeof what, "%s n=%lld%s", ew_name[op], (long long)n,
                     alias == 1 ? " (out = first input)" : alias == 2 ? " (out = second input)" : "");
            check_err(dev, what, got, ref, n, op >= EW_RELU_BWD ? 1e-5 : 1e-6);
            if (o != out) mgpu_tensor_destroy(o);
        }
    }
    /* axpy with y and x the same tensor: y = (1 + alpha) y */
    {
        mgpu_tensor* y = mgpu_tensor_to(t_xa, dev);
        MUST(mgpu_axpy(y, EW_AXPY_ALPHA, y));
        tget(y, got);
        for (i = 0; i < n; ++i) ref[i] = (1.0 + EW_AXPY_ALPHA) * xa[i];
        snprintf(what, sizeof what, "axpy n=%lld (x = y)", (long long)n);
        check_err(dev, what, got, ref, n, 1e-6);
        mgpu_tensor_destroy(y);
    }
    mgpu_tensor_destroy(t_xa);
    mgpu_tensor_destroy(t_xb);
    mgpu_tensor_destroy(t_dy);
    mgpu_tensor_destroy(t_ty);
    mgpu_tensor_destroy(t_sy);
    mgpu_tensor_destroy(out);
    free(xa); free(xb); free(dy); free(ty); free(sy); free(got); free(ref);
}

/* Each backward op against a central difference of its forward, in double. */
static double fd_forward(int op, double x) {
    switch (op) {
    case EW_RELU: return ref_relu(x);
    case EW_GELU: return ref_gelu(x);
    case EW_TANH: return tanh(x);
    default: return ref_sigmoid(x);
    }
}
static void backward_fd_on(mgpu_device* dev) {
    static const int fwd[4] = { EW_RELU, EW_GELU, EW_TANH, EW_SIGMOID };
    const int64_t n = 1001;
    const double h = 1e-4;
    float *x = fbuf(n), *dy = fbuf(n), *got = fbuf(n);
    double* ref = dbuf(n);
    mgpu_tensor *tx, *tdy, *ty, *tdx;
    int f;
    int64_t i;
    char what[128];
    rnd_uniform(x, n, -5.0, 5.0);
    for (i = 0; i < n; ++i) if (fabs(x[i]) < 1e-3) x[i] = 0.5f;   /* keep relu away from its kink */
    rnd_normal(dy, n, 1.0);
    tx = tfrom(dev, mgpu_shape1(n), x);
    tdy = tfrom(dev, mgpu_shape1(n), dy);
    ty = tmake(dev, MGPU_F32, mgpu_shape1(n));
    tdx = tmake(dev, MGPU_F32, mgpu_shape1(n));
    for (f = 0; f < 4; ++f) {
        int op = fwd[f];
        mgpu_result r;
        for (i = 0; i < n; ++i)
            ref[i] = dy[i] * (fd_forward(op, (double)x[i] + h) - fd_forward(op, (double)x[i] - h)) / (2.0 * h);
        switch (op) {
        case EW_RELU: r = mgpu_relu_backward(tdx, tdy, tx); break;
        case EW_GELU: r = mgpu_gelu_backward(tdx, tdy, tx); break;
        case EW_TANH: MUST(mgpu_tanh(ty, tx)); r = mgpu_tanh_backward(tdx, tdy, ty); break;
        default: MUST(mgpu_sigmoid(ty, tx)); r = mgpu_sigmoid_backward(tdx, tdy, ty); break;
        }
        CHECK(r == MGPU_OK, "%s_backward: %s", ew_name[op], mgpu_last_error());
        tget(tdx, got);
        snprintf(what, sizeof what, "%s_backward vs finite difference", ew_name[op]);
        check_err(dev, what, got, ref, n, 1e-5);
    }
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tdy);
    mgpu_tensor_destroy(ty);
    mgpu_tensor_destroy(tdx);
    free(x); free(dy); free(got); free(ref);
}

/* mgpu__tanhf and mgpu__expf, the branch-free forms every elementwise op and the attention's
   softmax use, against the exact values (double): within 1.5 ulp wherever the result is a normal
   float, odd, and right at NaN, the infinities, -0 and the ends of exp's range. */
static double ulps_off(float got, double want) {
    const float w = (float)want;
    const double ulp = w == 0.0f ? 1.4e-45 : (double)nextafterf(fabsf(w), INFINITY) - fabsf(w);
    return fabs((double)got - want) / ulp;
}
static void test_fast_math(void) {
    double worst = 0.0, worst_x = 0.0;
    uint32_t b, stride = g_quick ? 97u : 3u;
    int odd = 1, s;
    for (b = 0x30000000u; b < 0x41300000u; b += stride) {   /* 2^-31 .. 11: beyond, tanh is x or 1 */
        const float x = mgpu__f32_from_bits(b), t = mgpu__tanhf(x);
        const double e = ulps_off(t, tanh((double)x));
        if (mgpu__tanhf(-x) != -t) odd = 0;
        if (e > worst) { worst = e; worst_x = x; }
    }
    CHECK(worst <= 1.5, "mgpu__tanhf: %.2f ulp off at %.9g", worst, worst_x);
    CHECK(odd, "mgpu__tanhf(-x) != -mgpu__tanhf(x) somewhere");
    CHECK(mgpu__tanhf(1e-30f) == 1e-30f && mgpu__tanhf(30.0f) == 1.0f && mgpu__tanhf(INFINITY) == 1.0f &&
          mgpu__tanhf(-INFINITY) == -1.0f && isnan(mgpu__tanhf(NAN)) && signbit(mgpu__tanhf(-0.0f)) && mgpu__tanhf(-0.0f) == 0.0f,
          "mgpu__tanhf at the specials: %g %g %g %g %g %g", mgpu__tanhf(1e-30f), mgpu__tanhf(30.0f), mgpu__tanhf(INFINITY),
          mgpu__tanhf(-INFINITY), mgpu__tanhf(NAN), mgpu__tanhf(-0.0f));
    worst = 0.0;
    for (s = 0; s < 2; ++s)
        for (b = 0; b < 0x7F800000u; b += stride * 10u + 1u) {
            const float x = mgpu__f32_from_bits(b | (s ? 0x80000000u : 0u));
            const double want = exp((double)x);
            double e;
            if (want > FLT_MAX || want < FLT_MIN) continue;
            e = ulps_off(mgpu__expf(x), want);
            if (e > worst) { worst = e; worst_x = x; }
        }
    CHECK(worst <= 1.5, "mgpu__expf: %.2f ulp off at %.9g", worst, worst_x);
    CHECK(mgpu__expf(0.0f) == 1.0f && mgpu__expf(-INFINITY) == 0.0f && mgpu__expf(-200.0f) == 0.0f &&
          isinf(mgpu__expf(89.0f)) && isinf(mgpu__expf(INFINITY)) && isnan(mgpu__expf(NAN)) &&
          mgpu__expf(88.7f) < FLT_MAX && mgpu__expf(-100.0f) > 0.0f,
          "mgpu__expf at the specials: %g %g %g %g %g %g %g %g", mgpu__expf(0.0f), mgpu__expf(-INFINITY), mgpu__expf(-200.0f),
          mgpu__expf(89.0f), mgpu__expf(INFINITY), mgpu__expf(NAN), mgpu__expf(88.7f), mgpu__expf(-100.0f));
}

/* The elementwise ops on bf16 tensors: each result the f32 op's on the widened inputs, rounded
   once to nearest even (bit for bit: the same formula, then the rounding of mgpu_bf16_from_float),
   in place too; a mix of dtypes refused by name. */
typedef mgpu_result (*unary_fn)(mgpu_tensor*, const mgpu_tensor*);
typedef mgpu_result (*binary_fn)(mgpu_tensor*, const mgpu_tensor*, const mgpu_tensor*);
static void elementwise_bf16_on(mgpu_device* dev, int64_t n) {
    static const struct { const char* name; unary_fn f; } un[] = {
        {"relu", mgpu_relu}, {"gelu", mgpu_gelu}, {"gelu_tanh", mgpu_gelu_tanh}, {"tanh", mgpu_tanh}, {"sigmoid", mgpu_sigmoid}};
    static const struct { const char* name; binary_fn f; } bin[] = {
        {"add", mgpu_add}, {"sub", mgpu_sub}, {"mul", mgpu_mul}, {"relu_backward", mgpu_relu_backward},
        {"gelu_backward", mgpu_gelu_backward}, {"gelu_tanh_backward", mgpu_gelu_tanh_backward},
        {"tanh_backward", mgpu_tanh_backward}, {"sigmoid_backward", mgpu_sigmoid_backward}};
    const int nun = (int)(sizeof un / sizeof un[0]), nbin = (int)(sizeof bin / sizeof bin[0]);
    uint16_t *ha = (uint16_t*)xmalloc((size_t)(n + 1) * 2), *hb = (uint16_t*)xmalloc((size_t)(n + 1) * 2);
    uint16_t* got = (uint16_t*)xmalloc((size_t)(n + 1) * 2);
    float *fa = fbuf(n + 1), *fb = fbuf(n + 1), *want = fbuf(n + 1);
    mgpu_tensor *a16 = tmake(dev, MGPU_BF16, mgpu_shape1(n)), *b16 = tmake(dev, MGPU_BF16, mgpu_shape1(n));
    mgpu_tensor *y16 = tmake(dev, MGPU_BF16, mgpu_shape1(n)), *a32, *b32, *y32 = tmake(dev, MGPU_F32, mgpu_shape1(n));
    int64_t i, bad;
    int o, in_place;
    for (i = 0; i < n; ++i) {
        ha[i] = mgpu_bf16_from_float((float)(3.0 * rng_gauss())); fa[i] = mgpu_bf16_to_float(ha[i]);
        hb[i] = mgpu_bf16_from_float((float)(3.0 * rng_gauss())); fb[i] = mgpu_bf16_to_float(hb[i]);
    }
    a32 = tfrom(dev, mgpu_shape1(n), fa);
    b32 = tfrom(dev, mgpu_shape1(n), fb);
    tput(b16, hb);
    for (o = 0; o < nun + nbin + 2; ++o)
        for (in_place = 0; in_place < 2; ++in_place) {
            const char* name = o < nun ? un[o].name : o < nun + nbin ? bin[o - nun].name : o == nun + nbin ? "scale" : "axpy";
            mgpu_tensor* out16 = in_place ? a16 : y16;
            tput(a16, ha);
            if (o == nun + nbin + 1) {   /* axpy: y += alpha x, y the first operand's copy */
                MUST(mgpu_tensor_copy(y32, a32));
                MUST(mgpu_axpy(y32, -0.75f, b32));
                if (!in_place) MUST(mgpu_tensor_copy(y16, a16));
                MUST(mgpu_axpy(out16, -0.75f, b16));
            } else if (o == nun + nbin) {
                MUST(mgpu_scale(y32, a32, 1.3f));
                MUST(mgpu_scale(out16, a16, 1.3f));
            } else if (o < nun) {
                MUST(un[o].f(y32, a32));
                MUST(un[o].f(out16, a16));
            } else {
                MUST(bin[o - nun].f(y32, a32, b32));
                MUST(bin[o - nun].f(out16, a16, b16));
            }
            tget(y32, want);
            tget(out16, got);
            for (bad = -1, i = 0; i < n && bad < 0; ++i) if (got[i] != mgpu_bf16_from_float(want[i])) bad = i;
            CHECK(bad < 0, "%s: bf16 %s%s of %lld: element %lld is 0x%04x, want 0x%04x (the f32 op's %.9g rounded)",
                  mgpu_device_label(dev), name, in_place ? " in place" : "", (long long)n, (long long)bad,
                  bad >= 0 ? (unsigned)got[bad] : 0u, bad >= 0 ? (unsigned)mgpu_bf16_from_float(want[bad]) : 0u,
                  bad >= 0 ? (double)want[bad] : 0.0);
        }
    {   /* views one element in (2 bytes: the GPU's one-element path, not its 8-byte packs), out over b */
        mgpu_tensor *va = mgpu_tensor_view_rows(a16, 1, n - 1), *vb = mgpu_tensor_view_rows(b16, 1, n - 1);
        mgpu_tensor *wa = mgpu_tensor_view_rows(a32, 1, n - 1), *wb = mgpu_tensor_view_rows(b32, 1, n - 1);
        mgpu_tensor* wy = mgpu_tensor_view_rows(y32, 1, n - 1);
        CHECK(va && vb && wa && wb && wy, "%s: views: %s", mgpu_device_label(dev), mgpu_last_error());
        if (va && vb && wa && wb && wy) {
            tput(a16, ha);
            tput(b16, hb);
            MUST(mgpu_mul(wy, wa, wb));
            MUST(mgpu_mul(vb, va, vb));
            tget(y32, want);
            tget(b16, got);
            for (bad = got[0] != hb[0] ? 0 : -1, i = 1; i < n && bad < 0; ++i) if (got[i] != mgpu_bf16_from_float(want[i])) bad = i;
            CHECK(bad < 0, "%s: bf16 mul of views one element in, into b: element %lld is 0x%04x", mgpu_device_label(dev),
                  (long long)bad, bad >= 0 ? (unsigned)got[bad] : 0u);
        }
        mgpu_tensor_destroy(va); mgpu_tensor_destroy(vb); mgpu_tensor_destroy(wa); mgpu_tensor_destroy(wb); mgpu_tensor_destroy(wy);
    }
    expect_fail(mgpu_add(y32, a16, b16), MGPU_ERROR_DTYPE_MISMATCH, "add of bf16 into f32", "mgpu_add", "'out' is f32", "expected dtype bf16");
    expect_fail(mgpu_mul(y16, a16, b32), MGPU_ERROR_DTYPE_MISMATCH, "mul of bf16 by f32", "mgpu_mul", "'b' is f32", "expected dtype bf16");
    expect_fail(mgpu_relu(y16, a32), MGPU_ERROR_DTYPE_MISMATCH, "relu of f32 into bf16", "mgpu_relu", "'out' is bf16", "expected dtype f32");
    mgpu_tensor_destroy(a16); mgpu_tensor_destroy(b16); mgpu_tensor_destroy(y16);
    mgpu_tensor_destroy(a32); mgpu_tensor_destroy(b32); mgpu_tensor_destroy(y32);
    free(ha); free(hb); free(got); free(fa); free(fb); free(want);
}

static void test_elementwise(void) {
    const int64_t sizes[5] = { 0, 1, 7, 1001, g_quick ? (1 << 16) + 3 : (1 << 20) + 3 };
    int d, s;
    header("elementwise ops");
    for (d = 0; d < g_ndev; ++d) {
        for (s = 0; s < 5; ++s) elementwise_on(g_devs[d], sizes[s]);
        elementwise_bf16_on(g_devs[d], 7);
        elementwise_bf16_on(g_devs[d], g_quick ? 5003 : 100003);   /* the CPU's threads, the GPU's grid-stride loops */
        backward_fd_on(g_devs[d]);
    }
    gpu_group_note("elementwise");
}

/* ============================================================================================ */
/* 6b. matmul                                                                                   */
/* ============================================================================================ */
/* ref = alpha * op(a) @ op(b) + beta * c0, in double (beta 0 ignores c0, NaNs included) */
static void ref_matmul(int64_t m, int64_t n, int64_t k, int ta, int tb, const float* a, const float* b, double alpha,
                       double beta, const float* c0, double* ref) {
    double* bd = dbuf(k * n);
    double* row = dbuf(n);
    int64_t i, j, p;
    for (p = 0; p < k; ++p)
        for (j = 0; j < n; ++j) bd[p * n + j] = tb ? b[j * k + p] : b[p * n + j];
    for (i = 0; i < m; ++i) {
        for (j = 0; j < n; ++j) row[j] = 0.0;
        for (p = 0; p < k; ++p) {
            const double aip = ta ? a[p * m + i] : a[i * k + p];
            const double* bp = bd + p * n;
            for (j = 0; j < n; ++j) row[j] += aip * bp[j];
        }
        for (j = 0; j < n; ++j) ref[i * n + j] = alpha * row[j] + (beta == 0.0 ? 0.0 : beta * c0[i * n + j]);
    }
    free(bd);
    free(row);
}

static void matmul_case(mgpu_device* dev, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha, float beta,
                        int nan_out) {
    float *a = fbuf(m * k), *b = fbuf(k * n), *c = fbuf(m * n), *got = fbuf(m * n);
    double* ref = dbuf(m * n);
    mgpu_tensor *t_a, *t_b, *t_c;
    mgpu_result r;
    int64_t i;
    char what[160];
    rnd_normal(a, m * k, 1.0);
    rnd_normal(b, k * n, 1.0);
    if (nan_out) for (i = 0; i < m * n; ++i) c[i] = NAN;
    else rnd_normal(c, m * n, 1.0);
    ref_matmul(m, n, k, ta, tb, a, b, alpha, beta, c, ref);
    t_a = tfrom(dev, ta ? mgpu_shape2(k, m) : mgpu_shape2(m, k), a);
    t_b = tfrom(dev, tb ? mgpu_shape2(n, k) : mgpu_shape2(k, n), b);
    t_c = tfrom(dev, mgpu_shape2(m, n), c);
    r = mgpu_matmul(t_c, t_a, t_b, ta, tb, alpha, beta);
    snprintf(what, sizeof what, "matmul %lldx%lldx%lld %c%c alpha %g beta %g%s", (long long)m, (long long)n,
             (long long)k, ta ? 'T' : 'N', tb ? 'T' : 'N', alpha, beta, nan_out ? " (out NaN)" : "");
    CHECK(r == MGPU_OK, "%s on %s: %s", what, mgpu_device_label(dev), mgpu_last_error());
    tget(t_c, got);
    if (m * n < 100) {
        /* Few results, and one may be a sum that cancels to near 0 (a dot product of 300 terms
           about 1 can end near 1 with rounding of its partial sums near 30): judge them by the
           GEMM error bound's scale, |alpha| |A| |B| + |beta| |C|, not by their own size. */
        float *aa = fbuf(m * k), *ab = fbuf(k * n), *ac = fbuf(m * n);
        double* scale = dbuf(m * n);
        double num = 0.0, den = 0.0;
        for (i = 0; i < m * k; ++i) aa[i] = fabsf(a[i]);
        for (i = 0; i < k * n; ++i) ab[i] = fabsf(b[i]);
        for (i = 0; i < m * n; ++i) ac[i] = nan_out ? 0.0f : fabsf(c[i]);
        ref_matmul(m, n, k, ta, tb, aa, ab, fabsf(alpha), fabsf(beta), ac, scale);
        for (i = 0; i < m * n; ++i) {
            num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
            den += scale[i] * scale[i];
            if (got[i] != got[i]) num = INFINITY;
        }
        CHECK(sqrt(num) <= 1e-5 * sqrt(den), "%s on %s: error %.3g against the bound's scale %.3g", what, mgpu_device_label(dev),
              sqrt(num), sqrt(den));
        free(aa); free(ab); free(ac); free(scale);
    } else {
        check_err(dev, what, got, ref, m * n, 1e-5);
    }
    mgpu_tensor_destroy(t_a);
    mgpu_tensor_destroy(t_b);
    mgpu_tensor_destroy(t_c);
    free(a); free(b); free(c); free(got); free(ref);
}

/* The CPU GEMM's bits do not depend on the thread count: whole tiles of C are shared out (a few
   rows of C: slivers of its rows or columns; more: row blocks and column groups), and a long sum
   is cut into chunks fixed by the shape alone. */
static void matmul_same_bits_any_threads(void) {
    const int64_t shapes[5][3] = {{16, 9, 40000}, {70, 90, 300}, {130, 5, 9000}, {20, 300, 260}, {400, 70, 300}};
    const int threads = mgpu_cpu_threads();
    int s, same = 1;
    for (s = 0; s < 5; ++s) {
        const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        float *a = fbuf(k * m), *b = fbuf(k * n), *one = fbuf(m * n), *many = fbuf(m * n);
        mgpu_tensor *ta, *tb, *tc;
        rnd_normal(a, k * m, 1.0);
        rnd_normal(b, k * n, 1.0);
        ta = tfrom(g_devs[0], mgpu_shape2(k, m), a);
        tb = tfrom(g_devs[0], mgpu_shape2(k, n), b);
        tc = tmake(g_devs[0], MGPU_F32, mgpu_shape2(m, n));
        mgpu_cpu_set_threads(1);
        CHECK(mgpu_matmul(tc, ta, tb, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f) == MGPU_OK, "matmul on 1 thread: %s", mgpu_last_error());
        tget(tc, one);
        mgpu_cpu_set_threads(3);
        CHECK(mgpu_matmul(tc, ta, tb, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f) == MGPU_OK, "matmul on 3 threads: %s", mgpu_last_error());
        tget(tc, many);
        same &= memcmp(one, many, sizeof(float) * (size_t)(m * n)) == 0;
        mgpu_tensor_destroy(ta);
        mgpu_tensor_destroy(tb);
        mgpu_tensor_destroy(tc);
        free(a); free(b); free(one); free(many);
    }
    mgpu_cpu_set_threads(threads);
    CHECK(same, "CPU matmul: 1 thread and 3 threads give different bits");
}

/* With alpha and beta 1 the CPU GEMM adds onto C one chain of FMAs per element, k in order, and
   the bias gradient adds onto its sums row by row: a sum cut along k (the rows of a batch) into
   pieces added one after the other gives the bits of the whole, as gradients summed over
   micro-batches must. Shapes through the small and the large paths (on 3 threads), across KC
   blocks, and with edge tiles. With MGPU_CBLAS the BLAS sums, and promises no such thing: only
   the bias half is checked there. */
static void matmul_pieces_same_bits(void) {
    const int64_t shapes[6][5] = {   /* m, n, k, and where the pieces start */
        {128, 784, 64, 16, 32}, {10, 128, 64, 8, 40}, {70, 90, 300, 100, 257}, {400, 70, 300, 1, 256}, {20, 300, 260, 130, 200}, {13, 7, 9, 4, 5}};
    mgpu_device* cpu = mgpu_device_cpu();
    const int threads = mgpu_cpu_threads();
    int s, same = 1, same_bias = 1;
    mgpu_cpu_set_threads(3);
    for (s = 0; s < 6; ++s) {
        const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], cut[4] = {0, shapes[s][3], shapes[s][4], k};
        float *a = fbuf(k * m), *b = fbuf(k * n), *whole = fbuf(m * n), *pieces = fbuf(m * n), *bw = fbuf(n), *bp = fbuf(n);
        mgpu_tensor *ta, *tb, *tc, *tbias;
        int p;
        rnd_normal(a, k * m, 1.0);
        rnd_normal(b, k * n, 1.0);
        ta = tfrom(cpu, mgpu_shape2(k, m), a);
        tb = tfrom(cpu, mgpu_shape2(k, n), b);
        tc = tmake(cpu, MGPU_F32, mgpu_shape2(m, n));
        tbias = tmake(cpu, MGPU_F32, mgpu_shape1(n));
        for (p = 0; p < 2; ++p) {   /* 0: the whole sum in one call; 1: three pieces */
            int piece;
            CHECK(mgpu_tensor_fill(tc, 0.0) == MGPU_OK && mgpu_tensor_fill(tbias, 0.0) == MGPU_OK, "fill");
            for (piece = 0; piece < (p ? 3 : 1); ++piece) {
                const int64_t k0 = p ? cut[piece] : 0, k1 = p ? cut[piece + 1] : k;
                mgpu_tensor *va = mgpu_tensor_view_rows(ta, k0, k1 - k0), *vb = mgpu_tensor_view_rows(tb, k0, k1 - k0);
                CHECK(va && vb && mgpu_matmul(tc, va, vb, MGPU_TRANS, MGPU_NO_TRANS, 1.0f, 1.0f) == MGPU_OK &&
                      mgpu__bias_grad_add(tbias, vb) == MGPU_OK, "rows [%lld, %lld): %s", (long long)k0, (long long)k1, mgpu_last_error());
                mgpu_tensor_destroy(va);
                mgpu_tensor_destroy(vb);
            }
            tget(tc, p ? pieces : whole);
            tget(tbias, p ? bp : bw);
        }
        same &= memcmp(whole, pieces, sizeof(float) * (size_t)(m * n)) == 0;
        same_bias &= memcmp(bw, bp, sizeof(float) * (size_t)n) == 0;
        mgpu_tensor_destroy(ta);
        mgpu_tensor_destroy(tb);
        mgpu_tensor_destroy(tc);
        mgpu_tensor_destroy(tbias);
        free(a); free(b); free(whole); free(pieces); free(bw); free(bp);
    }
    mgpu_cpu_set_threads(threads);
#ifdef MGPU_CBLAS
    (void)same;
#else
    CHECK(same, "CPU matmul: C += A^T B in pieces of k gives other bits than in one call");
#endif
    CHECK(same_bias, "CPU bias gradient: added in pieces of rows gives other bits than in one call");
}

/* A bf16 product against float64 over the same bf16 values. Tolerance, derived: fp32 sums of k
   exact products are within (k + 2) 2^-24 of the sum of |terms| (the terms: alpha A B and beta C,
   whose products fp32 rounds once more), doubled for the GPU's other order; a bf16 out rounds
   that once more, within 2^-8 of its magnitude (8 significant bits, to nearest). On the CPU the
   product also equals the f32 product of the widened operands bit for bit (the same rounding
   points). */
static void matmul_bf16_case(mgpu_device* dev, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha, float beta,
                             int out_bf16) {
    const int64_t na = m * k, nb = k * n, nc = m * n;
    uint16_t *ha = (uint16_t*)xmalloc((size_t)(na + 1) * 2), *hb = (uint16_t*)xmalloc((size_t)(nb + 1) * 2);
    uint16_t* hc16 = (uint16_t*)xmalloc((size_t)(nc + 1) * 2);
    float *fa = fbuf(na + 1), *fb = fbuf(nb + 1), *c0 = fbuf(nc + 1), *got = fbuf(nc + 1), *wide = fbuf(nc + 1);
    mgpu_tensor *a = tmake(dev, MGPU_BF16, ta ? mgpu_shape2(k, m) : mgpu_shape2(m, k));
    mgpu_tensor *b = tmake(dev, MGPU_BF16, tb ? mgpu_shape2(n, k) : mgpu_shape2(k, n));
    mgpu_tensor* c = tmake(dev, out_bf16 ? MGPU_BF16 : MGPU_F32, mgpu_shape2(m, n));
    int64_t i, j, l, bad = 0, first = -1;
    double worst = 0.0;
    for (i = 0; i < na; ++i) { ha[i] = mgpu_bf16_from_float((float)rng_gauss()); fa[i] = mgpu_bf16_to_float(ha[i]); }
    for (i = 0; i < nb; ++i) { hb[i] = mgpu_bf16_from_float((float)rng_gauss()); fb[i] = mgpu_bf16_to_float(hb[i]); }
    for (i = 0; i < nc; ++i) {
        c0[i] = (float)rng_gauss();
        if (out_bf16) { hc16[i] = mgpu_bf16_from_float(c0[i]); c0[i] = mgpu_bf16_to_float(hc16[i]); }
    }
    tput(a, ha);
    tput(b, hb);
    tput(c, out_bf16 ? (const void*)hc16 : (const void*)c0);
    MUST(mgpu_matmul(c, a, b, ta ? MGPU_TRANS : MGPU_NO_TRANS, tb ? MGPU_TRANS : MGPU_NO_TRANS, alpha, beta));
    if (out_bf16) { tget(c, hc16); for (i = 0; i < nc; ++i) got[i] = mgpu_bf16_to_float(hc16[i]); }
    else tget(c, got);
    for (i = 0; i < m; ++i)
        for (j = 0; j < n; ++j) {
            double ref = 0.0, mag = 0.0, tol, e;
            for (l = 0; l < k; ++l) {
                const double t = (double)fa[ta ? l * m + i : i * k + l] * fb[tb ? j * k + l : l * n + j];
                ref += t;
                mag += fabs(t);
            }
            ref = alpha * ref + (beta != 0.0f ? (double)beta * c0[i * n + j] : 0.0);
            mag = fabs(alpha) * mag + fabs((double)beta * c0[i * n + j]);
            tol = 2.0 * (double)(k + 2) * ldexp(1.0, -24) * mag;
            if (out_bf16) tol = tol * (1.0 + ldexp(1.0, -8)) + ldexp(1.0, -8) * fabs(ref);
            e = fabs((double)got[i * n + j] - ref);
            if (!(e <= tol)) { if (!bad++) first = i * n + j; }
            if (tol > 0.0 && e / tol > worst) worst = e / tol;
        }
    CHECK(bad == 0, "%s: bf16 matmul m=%lld n=%lld k=%lld ta=%d tb=%d alpha=%g beta=%g -> %s: %lld of %lld outside the "
          "derived bound (the first at %lld; worst %.2f of it)", mgpu_device_label(dev), (long long)m, (long long)n,
          (long long)k, ta, tb, alpha, beta, out_bf16 ? "bf16" : "f32", (long long)bad, (long long)nc, (long long)first, worst);
    if (!is_gpu(dev) && !out_bf16) {   /* the CPU: the f32 product of the widened values, bit for bit */
        mgpu_tensor *wa = tfrom(dev, ta ? mgpu_shape2(k, m) : mgpu_shape2(m, k), fa), *wb = tfrom(dev, tb ? mgpu_shape2(n, k) : mgpu_shape2(k, n), fb);
        mgpu_tensor* wc = tfrom(dev, mgpu_shape2(m, n), c0);
        MUST(mgpu_matmul(wc, wa, wb, ta ? MGPU_TRANS : MGPU_NO_TRANS, tb ? MGPU_TRANS : MGPU_NO_TRANS, alpha, beta));
        tget(wc, wide);
        CHECK(!memcmp(wide, got, (size_t)nc * sizeof(float)), "%s: bf16 matmul m=%lld n=%lld k=%lld: not the bits of the f32 "
              "product of the widened operands", mgpu_device_label(dev), (long long)m, (long long)n, (long long)k);
        mgpu_tensor_destroy(wa);
        mgpu_tensor_destroy(wb);
        mgpu_tensor_destroy(wc);
    }
    mgpu_tensor_destroy(a);
    mgpu_tensor_destroy(b);
    mgpu_tensor_destroy(c);
    free(ha); free(hb); free(hc16); free(fa); free(fb); free(c0); free(got); free(wide);
}

/* The dtypes a product takes: bf16 with bf16 (out f32 or bf16), f32 with f32; others by name */
static void matmul_bf16_errors(mgpu_device* dev) {
    mgpu_tensor *f = tmake(dev, MGPU_F32, mgpu_shape2(4, 4)), *h = tmake(dev, MGPU_BF16, mgpu_shape2(4, 4));
    mgpu_tensor *o = tmake(dev, MGPU_F32, mgpu_shape2(4, 4)), *oh = tmake(dev, MGPU_BF16, mgpu_shape2(4, 4));
    expect_fail(mgpu_matmul(o, f, h, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_DTYPE_MISMATCH, "matmul f32 @ bf16",
                "mgpu_matmul", "'b' is bf16[4,4]", "expected dtype f32");
    expect_fail(mgpu_matmul(o, h, f, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_DTYPE_MISMATCH, "matmul bf16 @ f32",
                "mgpu_matmul", "'b' is f32[4,4]", "expected dtype bf16");
    expect_fail(mgpu_matmul(oh, f, f, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_DTYPE_MISMATCH,
                "matmul f32 @ f32 into bf16", "mgpu_matmul", "'out' is bf16[4,4]", "expected dtype f32");
    mgpu_tensor_destroy(f);
    mgpu_tensor_destroy(h);
    mgpu_tensor_destroy(o);
    mgpu_tensor_destroy(oh);
}

static void test_matmul(void) {
    int d, t;
    header("matmul");
    for (d = 0; d < g_ndev; ++d) {
        mgpu_device* dev = g_devs[d];
        for (t = 0; t < 4; ++t) {
            if (g_quick) matmul_case(dev, 67, 130, 33, t & 1, t >> 1, 1.0f, 0.0f, 0);
            else matmul_case(dev, 257, 513, 129, t & 1, t >> 1, 1.0f, 0.0f, 0);
            matmul_case(dev, 33, 520, 300, t & 1, t >> 1, 0.75f, -0.5f, 0);   /* across the k and n blocks */
            matmul_case(dev, 13, 11, 9, t & 1, t >> 1, -1.25f, 2.0f, 0);
            matmul_case(dev, 5, 7, 3, t & 1, t >> 1, 1.0f, 0.0f, 1);            /* beta 0 ignores NaN */
            matmul_case(dev, 1, 37, 19, t & 1, t >> 1, 1.0f, 0.0f, 0);          /* m = 1 */
            matmul_case(dev, 23, 1, 31, t & 1, t >> 1, 1.0f, 1.0f, 0);          /* n = 1, beta 1 accumulates */
        }
        matmul_case(dev, 1, 1, 1, 0, 0, 1.0f, 0.0f, 0);
        matmul_case(dev, 1, 1, 1, 1, 1, 2.0f, 3.0f, 0);
        matmul_case(dev, 1, 1, 300, 0, 1, 1.0f, 0.0f, 0);    /* a dot product */
        matmul_case(dev, 6, 5, 0, 0, 0, 1.0f, 0.5f, 0);      /* k = 0: out = beta * out */
        matmul_case(dev, 6, 5, 0, 1, 1, 1.0f, 0.0f, 1);      /* k = 0, beta 0: zeros even over NaN */
        matmul_case(dev, 0, 5, 4, 0, 0, 1.0f, 0.0f, 0);      /* m = 0 */
        matmul_case(dev, 4, 0, 4, 0, 0, 1.0f, 0.0f, 0);      /* n = 0 */
        matmul_case(dev, 3, 200, 70, 0, 1, 1.0f, 1.0f, 0);
        matmul_case(dev, 200, 3, 70, 1, 0, 0.5f, 0.0f, 0);
        matmul_case(dev, 17, 19, 23, 0, 0, 0.0f, 1.5f, 0);   /* alpha 0 */
        matmul_case(dev, 17, 19, 23, 0, 0, 1.0f, 0.0f, 1);
        if (!g_quick) matmul_case(dev, 1000, 1000, 500, 0, 0, 1.0f, 0.0f, 0);
        /* few outputs over a long sum: the CPU cuts k into chunks (a convolution's weight gradient) */
        matmul_case(dev, 5, 9, 30001, 0, 0, 0.75f, -0.5f, 0);
        matmul_case(dev, 16, 9, 20000, 1, 0, 1.0f, 0.0f, 1);
        matmul_case(dev, 3, 520, 8199, 1, 0, -1.0f, 1.0f, 0);   /* across the n blocks */
        matmul_case(dev, 4, 6, 600000, 1, 0, 1.0f, 0.0f, 0);    /* more than 64 chunks of the least size */
        for (t = 0; t < 8; ++t) {   /* bf16 operands, out f32 and bf16, every layout */
            matmul_bf16_case(dev, 37, 70, 300, t & 1, (t >> 1) & 1, 1.0f, 0.0f, t >> 2);
            matmul_bf16_case(dev, 13, 11, 9, t & 1, (t >> 1) & 1, -1.25f, 0.5f, t >> 2);
        }
        matmul_bf16_case(dev, 5, 9, 30001, 0, 0, 0.75f, -0.5f, 0);   /* split along k on the CPU */
        matmul_bf16_case(dev, 6, 5, 0, 0, 0, 1.0f, 0.5f, 1);         /* k = 0: out = beta * out, rounded */
        matmul_bf16_errors(dev);
    }
    matmul_same_bits_any_threads();
    matmul_pieces_same_bits();
    gpu_group_note("matmul");
}

/* ============================================================================================ */
/* 6c. bias, reductions                                                                         */
/* ============================================================================================ */
static void bias_case(mgpu_device* dev, mgpu_shape s, int in_place) {
    const int64_t n = mgpu_shape_numel(s), ch = s.dim[1];
    int64_t inner = 1, outer = s.dim[0], o, c, i;
    float *x = fbuf(n), *bias = fbuf(ch), *got = fbuf(n > ch ? n : ch);
    double *ref = dbuf(n), *dref = dbuf(ch);
    mgpu_tensor *tx, *tb, *to, *tdb;
    char what[128], shp[64];
    int d;
    for (d = 2; d < s.ndim; ++d) inner *= s.dim[d];
    rnd_normal(x, n, 1.0);
    rnd_normal(bias, ch, 1.0);
    for (c = 0; c < ch; ++c) dref[c] = 0.0;
    for (o = 0; o < outer; ++o)
        for (c = 0; c < ch; ++c)
            for (i = 0; i < inner; ++i) {
                int64_t at = (o * ch + c) * inner + i;
                ref[at] = (double)x[at] + bias[c];
                dref[c] += x[at];
            }
    {
        size_t len = 0;
        len += (size_t)snprintf(shp + len, sizeof shp - len, "[");
        for (d = 0; d < s.ndim; ++d) len += (size_t)snprintf(shp + len, sizeof shp - len, d ? ",%lld" : "%lld", (long long)s.dim[d]);
        snprintf(shp + len, sizeof shp - len, "]");
    }
    tx = tfrom(dev, s, x);
    tb = tfrom(dev, mgpu_shape1(ch), bias);
    to = in_place ? tx : tmake(dev, MGPU_F32, s);
    MUST(mgpu_bias_add(to, tx, tb));
    tget(to, got);
    snprintf(what, sizeof what, "bias_add %s%s", shp, in_place ? " (in place)" : "");
    check_err(dev, what, got, ref, n, 1e-6);
    if (!in_place) {   /* bias_backward of x as dy */
        tdb = tmake(dev, MGPU_F32, mgpu_shape1(ch));
        MUST(mgpu_tensor_fill(tdb, NAN));
        MUST(mgpu_bias_backward(tdb, tx));
        tget(tdb, got);
        snprintf(what, sizeof what, "bias_backward %s", shp);
        check_err(dev, what, got, dref, ch, 1e-5);
        mgpu_tensor_destroy(tdb);
        mgpu_tensor_destroy(to);
    }
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tb);
    free(x); free(bias); free(got); free(ref); free(dref);
}

/* bias_add and bias_backward with bf16: x and out each f32 or bf16, the bias f32: the f32 op's
   results on the widened values (rounded once into a bf16 out), bit for bit; the bias gradient of
   a bf16 dy is that of the widened dy, bit for bit. */
static void bias_bf16_case(mgpu_device* dev, mgpu_shape s) {
    const int64_t n = mgpu_shape_numel(s), ch = s.dim[1];
    uint16_t *hx = (uint16_t*)xmalloc((size_t)n * 2), *got16 = (uint16_t*)xmalloc((size_t)n * 2);
    float *fx = fbuf(n), *bias = fbuf(ch), *want = fbuf(n), *got = fbuf(n), *db = fbuf(ch), *db_want = fbuf(ch);
    mgpu_tensor *x16 = tmake(dev, MGPU_BF16, s), *x32, *y16 = tmake(dev, MGPU_BF16, s), *y32 = tmake(dev, MGPU_F32, s);
    mgpu_tensor *tb, *tdb = tmake(dev, MGPU_F32, mgpu_shape1(ch));
    int64_t i, bad16 = -1, bad32 = -1;
    for (i = 0; i < n; ++i) { hx[i] = mgpu_bf16_from_float((float)(2.0 * rng_gauss())); fx[i] = mgpu_bf16_to_float(hx[i]); }
    rnd_normal(bias, ch, 1.0);
    tput(x16, hx);
    x32 = tfrom(dev, s, fx);
    tb = tfrom(dev, mgpu_shape1(ch), bias);
    MUST(mgpu_bias_add(y32, x32, tb));   /* the f32 op */
    tget(y32, want);
    MUST(mgpu_bias_add(y16, x16, tb));   /* bf16 -> bf16 */
    tget(y16, got16);
    for (i = 0; i < n && bad16 < 0; ++i) if (got16[i] != mgpu_bf16_from_float(want[i])) bad16 = i;
    MUST(mgpu_bias_add(y32, x16, tb));   /* bf16 -> f32 */
    tget(y32, got);
    for (i = 0; i < n && bad32 < 0; ++i) if (got[i] != want[i]) bad32 = i;
    MUST(mgpu_bias_add(y16, x32, tb));   /* f32 -> bf16: as an f32 GEMM's output into bf16 */
    tget(y16, got16);
    for (i = 0; i < n && bad16 < 0; ++i) if (got16[i] != mgpu_bf16_from_float(want[i])) bad16 = i;
    MUST(mgpu_bias_add(x16, x16, tb));   /* in place */
    tget(x16, got16);
    for (i = 0; i < n && bad16 < 0; ++i) if (got16[i] != mgpu_bf16_from_float(want[i])) bad16 = i;
    CHECK(bad16 < 0 && bad32 < 0, "%s: bias_add with bf16 over [%lld,%lld,...]: element %lld (bf16 out) / %lld (f32 out) "
          "is not the f32 op's result", mgpu_device_label(dev), (long long)s.dim[0], (long long)ch, (long long)bad16,
          (long long)bad32);
    {   /* the bias stays f32 */
        mgpu_tensor* b16 = tmake(dev, MGPU_BF16, mgpu_shape1(ch));
        expect_fail(mgpu_bias_add(y16, x16, b16), MGPU_ERROR_DTYPE_MISMATCH, "bias_add with a bf16 bias", "mgpu_bias_add",
                    "'bias' is bf16", "expected dtype f32");
        mgpu_tensor_destroy(b16);
    }
    /* the bias gradient of a bf16 dy (x16 now holds x + bias, rounded) */
    tget(x16, hx);
    for (i = 0; i < n; ++i) fx[i] = mgpu_bf16_to_float(hx[i]);
    tput(x32, fx);
    MUST(mgpu_bias_backward(tdb, x32));
    tget(tdb, db_want);
    MUST(mgpu_tensor_fill(tdb, NAN));
    MUST(mgpu_bias_backward(tdb, x16));
    tget(tdb, db);
    CHECK(!memcmp(db, db_want, (size_t)ch * sizeof(float)), "%s: bias_backward of a bf16 dy [%lld,%lld,...]: not the f32 "
          "op's bits on the widened dy", mgpu_device_label(dev), (long long)s.dim[0], (long long)ch);
    mgpu_tensor_destroy(x16); mgpu_tensor_destroy(x32); mgpu_tensor_destroy(y16); mgpu_tensor_destroy(y32);
    mgpu_tensor_destroy(tb); mgpu_tensor_destroy(tdb);
    free(hx); free(got16); free(fx); free(bias); free(want); free(got); free(db); free(db_want);
}

static void sum_case(mgpu_device* dev, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    float *x = fbuf(n), *got = fbuf(rows + cols);
    double* ref = dbuf(rows + cols);
    mgpu_tensor *tx, *to;
    int axis, mean;
    int64_t r, c;
    char what[128];
    rnd_normal(x, n, 1.0);
    for (r = 0; r < n; ++r) x[r] += 0.25f;   /* a non-zero mean, so the sums do not cancel */
    tx = tfrom(dev, mgpu_shape2(rows, cols), x);
    for (axis = 0; axis < 2; ++axis)
        for (mean = 0; mean < 2; ++mean) {
            const int64_t len = axis == 0 ? cols : rows;
            if (mean && (axis == 0 ? rows : cols) == 0) continue;
            for (r = 0; r < len; ++r) ref[r] = 0.0;
            for (r = 0; r < rows; ++r)
                for (c = 0; c < cols; ++c) ref[axis == 0 ? c : r] += x[r * cols + c];
            if (mean) for (r = 0; r < len; ++r) ref[r] /= (double)(axis == 0 ? rows : cols);
            to = tmake(dev, MGPU_F32, mgpu_shape1(len));
            MUST(mgpu_tensor_fill(to, NAN));
            MUST(mean ? mgpu_mean(to, tx, axis) : mgpu_sum(to, tx, axis));
            tget(to, got);
            snprintf(what, sizeof what, "%s axis %d of [%lld,%lld]", mean ? "mean" : "sum", axis, (long long)rows,
                     (long long)cols);
            check_err(dev, what, got, ref, len, 1e-5);
            mgpu_tensor_destroy(to);
        }
    mgpu_tensor_destroy(tx);
    free(x); free(got); free(ref);
}

static void test_bias_reduce(void) {
    int d;
    header("bias and reductions");
    for (d = 0; d < g_ndev; ++d) {
        mgpu_device* dev = g_devs[d];
        bias_case(dev, mgpu_shape2(37, 19), 0);
        bias_case(dev, mgpu_shape2(37, 19), 1);
        bias_bf16_case(dev, mgpu_shape2(37, 19));
        bias_bf16_case(dev, mgpu_shape2(1000, 45));   /* column sums in several row groups */
        bias_bf16_case(dev, mgpu_shape4(4, 3, 5, 7));
        bias_case(dev, mgpu_shape2(300, 19), 0);
        bias_case(dev, mgpu_shape2(1, 1), 0);
        bias_case(dev, mgpu_shape2(0, 4), 0);
        bias_case(dev, mgpu_shape4(3, 5, 7, 9), 0);
        bias_case(dev, mgpu_shape4(3, 5, 7, 9), 1);
        bias_case(dev, mgpu_shape4(2, 16, 1, 1), 0);
        bias_case(dev, mgpu_shape3(4, 6, 11), 0);
        if (!g_quick) bias_case(dev, mgpu_shape4(64, 32, 14, 14), 0);
        sum_case(dev, 123, 77);
        sum_case(dev, 1, 1);
        sum_case(dev, 1, 1001);
        sum_case(dev, 1001, 1);
        sum_case(dev, 4, 0);
        sum_case(dev, g_quick ? 300 : 2000, 129);
        /* more rows than a grid has blocks (65535; the emulator's build caps grids far lower, so
           its quick sizes loop already): a block reduces a second row after its first, reusing
           its block reduction's shared memory */
        if (!g_quick) sum_case(dev, 65535 + 9, 3);
    }
    gpu_group_note("bias and reductions");
}

/* ============================================================================================ */
/* 6d. softmax, losses, argmax                                                                  */
/* ============================================================================================ */
static void ref_softmax_row(const float* x, int64_t cols, double* y) {
    double mx = x[0], s = 0.0;
    int64_t c;
    for (c = 1; c < cols; ++c) if (x[c] > mx) mx = x[c];
    for (c = 0; c < cols; ++c) s += exp((double)x[c] - mx);
    for (c = 0; c < cols; ++c) y[c] = exp((double)x[c] - mx) / s;
}
/* -log softmax(x)[label] in double */
static double ref_xent_row(const double* x, int64_t cols, int label) {
    double mx = x[0], s = 0.0;
    int64_t c;
    for (c = 1; c < cols; ++c) if (x[c] > mx) mx = x[c];
    for (c = 0; c < cols; ++c) s += exp(x[c] - mx);
    return mx + log(s) - x[label];
}

static void softmax_case(mgpu_device* dev, int64_t rows, int64_t cols, double scale) {
    const int64_t n = rows * cols;
    float *x = fbuf(n), *got = fbuf(n);
    double* ref = dbuf(n);
    mgpu_tensor *tx, *ty;
    int64_t r, c, bad = 0;
    char what[128];
    rnd_normal(x, n, scale);
    for (r = 0; r < rows; ++r) ref_softmax_row(x + r * cols, cols, ref + r * cols);
    tx = tfrom(dev, mgpu_shape2(rows, cols), x);
    ty = tmake(dev, MGPU_F32, mgpu_shape2(rows, cols));
    MUST(mgpu_softmax(ty, tx));
    tget(ty, got);
    snprintf(what, sizeof what, "softmax [%lld,%lld] (logits x%g)", (long long)rows, (long long)cols, scale);
    check_err(dev, what, got, ref, n, 1e-6);
    for (r = 0; r < rows; ++r) {
        double s = 0.0;
        for (c = 0; c < cols; ++c) s += got[r * cols + c];
        bad += fabs(s - 1.0) > 1e-5;
    }
    CHECK(bad == 0, "%s on %s: %lld rows do not sum to 1", what, mgpu_device_label(dev), (long long)bad);
    MUST(mgpu_softmax(tx, tx));   /* in place */
    tget(tx, got);
    snprintf(what, sizeof what, "softmax [%lld,%lld] in place", (long long)rows, (long long)cols);
    check_err(dev, what, got, ref, n, 1e-6);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(ty);
    free(x); free(got); free(ref);
}

static void softmax_large_logits(mgpu_device* dev) {
    static const float x[12] = { 1000.0f, 999.0f, -1000.0f, 998.0f,
                                 -1000.0f, -1001.0f, -999.0f, -3000.0f,
                                 88.0f, 89.0f, 90.0f, 3.0e38f };
    float got[12];
    double ref[12];
    mgpu_tensor *tx = tfrom(dev, mgpu_shape2(3, 4), x), *ty = tmake(dev, MGPU_F32, mgpu_shape2(3, 4));
    int i, finite = 1;
    ref_softmax_row(x, 4, ref);
    ref_softmax_row(x + 4, 4, ref + 4);
    ref_softmax_row(x + 8, 4, ref + 8);
    MUST(mgpu_softmax(ty, tx));
    tget(ty, got);
    for (i = 0; i < 12; ++i) finite &= isfinite(got[i]) != 0;
    CHECK(finite, "%s: softmax of logits near +-1000 and 3e38 is not finite", mgpu_device_label(dev));
    check_err(dev, "softmax of large logits", got, ref, 12, 1e-6);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(ty);
}

/* ignore_every k > 0: every k-th row (from row 1) is labelled MGPU_IGNORE_INDEX, no target;
   -1: every row. The loss is the mean over the other rows, an ignored row's gradient 0. */
static void xent_case_ignoring(mgpu_device* dev, int64_t rows, int64_t cols, double scale, float grad_scale, int ignore_every) {
    const int64_t n = rows * cols;
    float *x = fbuf(n), *got = fbuf(n), loss = NAN;
    int32_t* lab = (int32_t*)xmalloc((size_t)rows * sizeof(int32_t));
    double *ref = dbuf(n), *xd = dbuf(cols), total = 0.0, gs, lref;
    mgpu_tensor *tx, *tl, *tloss, *td;
    int64_t r, c, targets = 0;
    char what[160];
    rnd_normal(x, n, scale);
    for (r = 0; r < rows; ++r) {
        lab[r] = rng_int((int)cols);
        if (ignore_every < 0 || (ignore_every > 0 && r % ignore_every == 1)) lab[r] = MGPU_IGNORE_INDEX;
        targets += lab[r] != MGPU_IGNORE_INDEX;
    }
    gs = grad_scale == 0.0f ? (targets ? 1.0 / (double)targets : 0.0) : (double)grad_scale;
    for (r = 0; r < rows; ++r) {
        if (lab[r] == MGPU_IGNORE_INDEX) {
            for (c = 0; c < cols; ++c) ref[r * cols + c] = 0.0;
            continue;
        }
        ref_softmax_row(x + r * cols, cols, ref + r * cols);
        for (c = 0; c < cols; ++c) xd[c] = x[r * cols + c];
        total += ref_xent_row(xd, cols, lab[r]);
        for (c = 0; c < cols; ++c) ref[r * cols + c] = (ref[r * cols + c] - (c == lab[r])) * gs;
    }
    lref = targets ? total / (double)targets : 0.0;
    tx = tfrom(dev, mgpu_shape2(rows, cols), x);
    tl = tfrom_i32(dev, mgpu_shape1(rows), lab);
    tloss = tmake(dev, MGPU_F32, mgpu_shape1(1));
    td = tmake(dev, MGPU_F32, mgpu_shape2(rows, cols));
    MUST(mgpu_tensor_fill(td, NAN));
    MUST(mgpu_softmax_cross_entropy(tloss, td, tx, tl, grad_scale));
    tget(tloss, &loss);
    tget(td, got);
    snprintf(what, sizeof what, "cross_entropy loss [%lld,%lld] grad_scale %g, ignoring %d", (long long)rows, (long long)cols,
             grad_scale, ignore_every);
    if (targets == 0) CHECK(loss == 0.0f, "%s: every label ignored gives loss %g, want 0", what, loss);
    else check_err(dev, what, &loss, &lref, 1, 1e-5);
    snprintf(what, sizeof what, "cross_entropy dlogits [%lld,%lld] grad_scale %g, ignoring %d", (long long)rows, (long long)cols,
             grad_scale, ignore_every);
    check_err(dev, what, got, ref, n, 1e-5);
    /* without dlogits */
    loss = NAN;
    MUST(mgpu_softmax_cross_entropy(tloss, NULL, tx, tl, grad_scale));
    tget(tloss, &loss);
    snprintf(what, sizeof what, "cross_entropy loss [%lld,%lld], dlogits NULL", (long long)rows, (long long)cols);
    if (targets) check_err(dev, what, &loss, &lref, 1, 1e-5);
    /* in place, dlogits == logits (which the API allows): a lane must not overwrite x[label]
       before every lane of its row has read it (on a GPU a __syncwarp orders them; compute-
       sanitizer's racecheck and synccheck in make gpu-check look at it) */
    loss = NAN;
    MUST(mgpu_softmax_cross_entropy(tloss, tx, tx, tl, grad_scale));
    tget(tloss, &loss);
    tget(tx, got);
    snprintf(what, sizeof what, "cross_entropy [%lld,%lld] in place: loss", (long long)rows, (long long)cols);
    if (targets) check_err(dev, what, &loss, &lref, 1, 1e-5);
    snprintf(what, sizeof what, "cross_entropy [%lld,%lld] in place: dlogits", (long long)rows, (long long)cols);
    check_err(dev, what, got, ref, n, 1e-5);
    /* the gradient of the mean loss against a central difference of the loss, in double */
    if (grad_scale == 0.0f && n <= 20000 && ignore_every == 0) {
        const double h = 1e-5;
        for (r = 0; r < rows; ++r)
            for (c = 0; c < cols; ++c) {
                double lp, lm;
                int64_t j;
                for (j = 0; j < cols; ++j) xd[j] = x[r * cols + j];
                xd[c] += h;
                lp = ref_xent_row(xd, cols, lab[r]);
                xd[c] -= 2.0 * h;
                lm = ref_xent_row(xd, cols, lab[r]);
                ref[r * cols + c] = (lp - lm) / (2.0 * h) / (double)rows;
            }
        snprintf(what, sizeof what, "cross_entropy dlogits [%lld,%lld] vs finite difference", (long long)rows,
                 (long long)cols);
        check_err(dev, what, got, ref, n, 1e-5);
    }
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tl);
    mgpu_tensor_destroy(tloss);
    mgpu_tensor_destroy(td);
    free(x); free(got); free(lab); free(ref); free(xd);
}
static void xent_case(mgpu_device* dev, int64_t rows, int64_t cols, double scale, float grad_scale) {
    xent_case_ignoring(dev, rows, cols, scale, grad_scale, 0);
}

static void mse_case(mgpu_device* dev, mgpu_shape s, float grad_scale) {
    const int64_t n = mgpu_shape_numel(s);
    float *p = fbuf(n), *t = fbuf(n), *got = fbuf(n), loss = NAN;
    double *ref = dbuf(n), total = 0.0, gs = grad_scale == 0.0f ? 1.0 / (double)n : (double)grad_scale, lref;
    mgpu_tensor *tp, *tt, *tloss, *td;
    int64_t i;
    char what[128];
    rnd_normal(p, n, 1.0);
    rnd_normal(t, n, 1.0);
    for (i = 0; i < n; ++i) {
        double d = (double)p[i] - t[i];
        total += d * d;
        ref[i] = 2.0 * d * gs;
    }
    lref = total / (double)n;
    tp = tfrom(dev, s, p);
    tt = tfrom(dev, s, t);
    tloss = tmake(dev, MGPU_F32, mgpu_shape2(1, 1));
    td = tmake(dev, MGPU_F32, s);
    MUST(mgpu_mse(tloss, td, tp, tt, grad_scale));
    tget(tloss, &loss);
    tget(td, got);
    snprintf(what, sizeof what, "mse loss n=%lld grad_scale %g", (long long)n, grad_scale);
    check_err(dev, what, &loss, &lref, 1, 1e-5);
    snprintf(what, sizeof what, "mse dpred n=%lld grad_scale %g", (long long)n, grad_scale);
    check_err(dev, what, got, ref, n, 1e-6);
    loss = NAN;
    MUST(mgpu_mse(tloss, NULL, tp, tt, grad_scale));
    tget(tloss, &loss);
    snprintf(what, sizeof what, "mse loss n=%lld, dpred NULL", (long long)n);
    check_err(dev, what, &loss, &lref, 1, 1e-5);
    mgpu_tensor_destroy(tp);
    mgpu_tensor_destroy(tt);
    mgpu_tensor_destroy(tloss);
    mgpu_tensor_destroy(td);
    free(p); free(t); free(got); free(ref);
}

static void argmax_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    const int64_t rows = 203, cols = 13;
    float* x = fbuf(rows * cols);
    int32_t *lab = (int32_t*)xmalloc(rows * sizeof(int32_t)), *got = (int32_t*)xmalloc(rows * sizeof(int32_t));
    int32_t want[203];
    int64_t r, c, correct = 0, count = -1, bad = 0;
    mgpu_tensor *tx, *tl, *to;
    rnd_normal(x, rows * cols, 1.0);
    /* ties: the first index wins */
    for (c = 0; c < cols; ++c) x[0 * cols + c] = 0.5f;                        /* all equal: 0 */
    for (c = 0; c < cols; ++c) x[1 * cols + c] = -1.0f;
    x[1 * cols + 3] = 2.0f; x[1 * cols + 7] = 2.0f; x[1 * cols + 12] = 2.0f;   /* 3 */
    for (c = 0; c < cols; ++c) x[2 * cols + c] = -5.0f;
    x[2 * cols + 12] = -4.0f;                                                  /* the last column */
    x[3 * cols + 5] = 100.0f; x[3 * cols + 6] = 100.0f;                        /* 5 */
    for (r = 0; r < rows; ++r) {
        int64_t best = 0;
        for (c = 1; c < cols; ++c) if (x[r * cols + c] > x[r * cols + best]) best = c;
        want[r] = (int32_t)best;
        lab[r] = (r % 3 == 0) ? want[r] : rng_int((int)cols);
        correct += lab[r] == want[r];
    }
    CHECK(want[0] == 0 && want[1] == 3 && want[2] == 12 && want[3] == 5, "the test's own argmax");
    tx = tfrom(dev, mgpu_shape2(rows, cols), x);
    tl = tfrom_i32(dev, mgpu_shape1(rows), lab);
    to = tmake(dev, MGPU_I32, mgpu_shape1(rows));
    MUST(mgpu_tensor_fill(to, -1.0));
    MUST(mgpu_argmax(to, tx));
    tget(to, got);
    for (r = 0; r < rows; ++r) bad += got[r] != want[r];
    CHECK(bad == 0, "%s: argmax differs in %lld rows (ties: row 1 gave %d, want 3; row 0 gave %d, want 0)", L,
          (long long)bad, (int)got[1], (int)got[0]);
    MUST(mgpu_count_correct(tx, tl, &count));
    CHECK(count == correct, "%s: count_correct %lld, want %lld", L, (long long)count, (long long)correct);
    if (is_gpu(dev)) printf("  %-8s argmax [203,13]: %lld rows differ; count_correct %lld of %lld\n", L, (long long)bad,
                            (long long)count, (long long)correct);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tl);
    mgpu_tensor_destroy(to);
    /* one column */
    tx = tfrom(dev, mgpu_shape2(5, 1), x);
    to = tmake(dev, MGPU_I32, mgpu_shape1(5));
    MUST(mgpu_tensor_fill(to, 9.0));
    MUST(mgpu_argmax(to, tx));
    tget(to, got);
    CHECK(got[0] == 0 && got[4] == 0, "%s: argmax of one column", L);
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(to);
    free(x); free(lab); free(got);
}

static void bad_label_on(mgpu_device* dev) {
    float x[40], d0[40], d1[40], loss = 42.0f;
    int32_t lab[4] = { 1, 2, 3, 10 };   /* the last row's label is outside [0, 10) */
    mgpu_tensor *tx, *tl, *tloss, *td;
    int i;
    rnd_normal(x, 40, 1.0);
    for (i = 0; i < 40; ++i) d0[i] = 1000.0f + (float)i;
    tx = tfrom(dev, mgpu_shape2(4, 10), x);
    tl = tfrom_i32(dev, mgpu_shape1(4), lab);
    tloss = tfrom(dev, mgpu_shape1(1), &loss);
    td = tfrom(dev, mgpu_shape2(4, 10), d0);
    if (!is_gpu(dev)) {
        mgpu_result r = mgpu_softmax_cross_entropy(tloss, td, tx, tl, 0.0f);
        expect_fail(r, MGPU_ERROR_INVALID_ARGUMENT, "cross_entropy with label 10 of 10 classes in row 3",
                    "mgpu_softmax_cross_entropy", "row 3", "10");
        tget(tloss, &loss);
        tget(td, d1);
        CHECK(loss == 42.0f, "cross_entropy with a bad label changed the loss tensor to %g", loss);
        CHECK(all_equal_f(d0, d1, 40),
              "cross_entropy with a bad label (row 3) changed dlogits before failing: row 0 now %g %g ..., was %g %g",
              d1[0], d1[1], d0[0], d0[1]);
        lab[3] = 0;
        lab[0] = -2;   /* (-1 is MGPU_IGNORE_INDEX) */
        tput(tl, lab);
        r = mgpu_softmax_cross_entropy(tloss, NULL, tx, tl, 0.0f);
        expect_fail(r, MGPU_ERROR_INVALID_ARGUMENT, "cross_entropy with label -2 in row 0", "row 0", "-2", NULL);
    } else {   /* the seam's contract on the GPU: the row's loss (so the mean) is NaN */
        MUST(mgpu_softmax_cross_entropy(tloss, td, tx, tl, 0.0f));
        tget(tloss, &loss);
        CHECK(loss != loss, "%s: cross_entropy with a bad label gave loss %g, want NaN", mgpu_device_label(dev), loss);
    }
    mgpu_tensor_destroy(tx);
    mgpu_tensor_destroy(tl);
    mgpu_tensor_destroy(tloss);
    mgpu_tensor_destroy(td);
}

static void test_softmax_losses(void) {
    int d;
    header("softmax, losses, argmax");
    for (d = 0; d < g_ndev; ++d) {
        mgpu_device* dev = g_devs[d];
        softmax_case(dev, 37, 101, 3.0);
        softmax_case(dev, 1, 1, 1.0);
        softmax_case(dev, 5, 1, 1.0);
        softmax_case(dev, 3, 2000, 5.0);
        softmax_case(dev, g_quick ? 256 : 4096, 10, 2.0);
        softmax_case(dev, 0, 7, 1.0);
        softmax_large_logits(dev);
        xent_case(dev, 61, 10, 2.0, 0.0f);
        xent_case(dev, 61, 10, 2.0, 0.25f);
        xent_case(dev, 1, 1, 1.0, 0.0f);
        xent_case(dev, 7, 1000, 4.0, 0.0f);
        xent_case(dev, g_quick ? 256 : 4096, 10, 3.0, 0.0f);
        xent_case(dev, 3, 5, 300.0, 0.0f);   /* large logits */
        xent_case_ignoring(dev, 61, 10, 2.0, 0.0f, 3);   /* MGPU_IGNORE_INDEX rows: the mean of the others */
        xent_case_ignoring(dev, 37, 1500, 2.0, 0.0f, 2);   /* (rows of a whole block on a GPU) */
        xent_case_ignoring(dev, 9, 10, 2.0, 0.125f, 4);
        xent_case_ignoring(dev, 5, 10, 2.0, 0.0f, -1);   /* every row ignored: loss 0, gradient 0 */
        mse_case(dev, mgpu_shape2(33, 7), 0.0f);
        mse_case(dev, mgpu_shape2(33, 7), 0.5f);
        mse_case(dev, mgpu_shape1(1), 0.0f);
        mse_case(dev, mgpu_shape1(g_quick ? 10007 : 1000003), 0.0f);
        argmax_on(dev);
        bad_label_on(dev);
    }
    gpu_group_note("softmax, losses, argmax");
}

/* ============================================================================================ */
/* 6e. ops on views: row views start mid-storage (28 bytes in: not 16-byte aligned), and an op  */
/*     must read and write exactly the view's rows                                              */
/* ============================================================================================ */
/* rows 0 and R-1 of a [R, C] parent around the view rows [1, R-1) still hold the sentinel */
static int edges_intact(const float* parent, const float* sentinel, int64_t R, int64_t C) {
    return all_equal_f(parent, sentinel, C) && all_equal_f(parent + (R - 1) * C, sentinel + (R - 1) * C, C);
}

static void views_in_ops_on(mgpu_device* dev) {
    static const int ops[7] = { EW_ADD, EW_MUL, EW_SCALE, EW_AXPY, EW_GELU, EW_SIGMOID, EW_GELU_BWD };
    const char* L = mgpu_device_label(dev);
    const int64_t R = 101, C = 7, V = R - 2, n = R * C;
    float *pa = fbuf(n), *pb = fbuf(n), *sent = fbuf(n), *got = fbuf(n);
    double* ref = dbuf(n);
    mgpu_tensor *ta, *tb, *to, *va, *vb, *vo;
    int64_t i, r, c;
    int k;
    char what[128];
    rnd_uniform(pa, n, -3.0, 3.0);
    rnd_uniform(pb, n, -3.0, 3.0);
    for (i = 0; i < n; ++i) sent[i] = 777.0f + (float)i;
    ta = tfrom(dev, mgpu_shape2(R, C), pa);
    tb = tfrom(dev, mgpu_shape2(R, C), pb);
    to = tfrom(dev, mgpu_shape2(R, C), sent);
    va = mgpu_tensor_view_rows(ta, 1, V);
    vb = mgpu_tensor_view_rows(tb, 1, V);
    vo = mgpu_tensor_view_rows(to, 1, V);
    if (!va || !vb || !vo) { CHECK(0, "%s: view_rows: %s", L, mgpu_last_error()); exit(test_summary("test_core")); }

    for (k = 0; k < 7; ++k) {
        tput(to, sent);
        MUST(ew_run(ops[k], vo, va, vb));
        tget(to, got);
        for (i = 0; i < V * C; ++i) ref[i] = ew_ref(ops[k], pa[C + i], pb[C + i]);
        snprintf(what, sizeof what, "%s on row views [1,100) of [101,7]", ew_name[ops[k]]);
        check_err(dev, what, got + C, ref, V * C, ops[k] >= EW_RELU_BWD ? 1e-5 : 1e-6);
        CHECK(edges_intact(got, sent, R, C), "%s on %s wrote outside its row view", ew_name[ops[k]], L);
    }
    /* bias_add, softmax, sum into a view */
    {
        float bias[7];
        mgpu_tensor *tbias, *tsum, *vsum;
        rnd_normal(bias, C, 1.0);
        tbias = tfrom(dev, mgpu_shape1(C), bias);
        tput(to, sent);
        MUST(mgpu_bias_add(vo, va, tbias));
        tget(to, got);
        for (r = 0; r < V; ++r) for (c = 0; c < C; ++c) ref[r * C + c] = (double)pa[(r + 1) * C + c] + bias[c];
        check_err(dev, "bias_add on row views", got + C, ref, V * C, 1e-6);
        CHECK(edges_intact(got, sent, R, C), "bias_add on %s wrote outside its row view", L);
        tput(to, sent);
        MUST(mgpu_softmax(vo, va));
        tget(to, got);
        for (r = 0; r < V; ++r) ref_softmax_row(pa + (r + 1) * C, C, ref + r * C);
        check_err(dev, "softmax on row views", got + C, ref, V * C, 1e-6);
        CHECK(edges_intact(got, sent, R, C), "softmax on %s wrote outside its row view", L);
        tsum = tfrom(dev, mgpu_shape2(3, C), sent);
        vsum = mgpu_tensor_view_rows(tsum, 1, 1);
        MUST(mgpu_sum(vsum, va, 0));
        tget(tsum, got);
        for (c = 0; c < C; ++c) ref[c] = 0.0;
        for (r = 0; r < V; ++r) for (c = 0; c < C; ++c) ref[c] += pa[(r + 1) * C + c];
        check_err(dev, "sum axis 0 of a row view into a row view", got + C, ref, C, 1e-5);
        CHECK(edges_intact(got, sent, 3, C), "sum on %s wrote outside its row view", L);
        mgpu_tensor_destroy(vsum);
        mgpu_tensor_destroy(tsum);
        mgpu_tensor_destroy(tbias);
    }
    /* matmul: a and out are row views; b is a row view used transposed */
    {
        const int64_t m = 13, kk = 5, nn = 7;
        mgpu_tensor *pa2 = tfrom(dev, mgpu_shape2(m + 2, kk), pa), *pb2 = tfrom(dev, mgpu_shape2(nn + 1, kk), pb);
        mgpu_tensor *po2 = tfrom(dev, mgpu_shape2(m + 2, nn), sent);
        mgpu_tensor *a2 = mgpu_tensor_view_rows(pa2, 1, m), *b2 = mgpu_tensor_view_rows(pb2, 1, nn);
        mgpu_tensor* o2 = mgpu_tensor_view_rows(po2, 1, m);
        ref_matmul(m, nn, kk, 0, 1, pa + kk, pb + kk, 1.0, 0.0, NULL, ref);
        MUST(mgpu_matmul(o2, a2, b2, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f));
        tget(po2, got);
        check_err(dev, "matmul 13x7x5 NT on row views", got + nn, ref, m * nn, 1e-5);
        CHECK(edges_intact(got, sent, m + 2, nn), "matmul on %s wrote outside its row view", L);
        mgpu_tensor_destroy(a2); mgpu_tensor_destroy(b2); mgpu_tensor_destroy(o2);
        mgpu_tensor_destroy(pa2); mgpu_tensor_destroy(pb2); mgpu_tensor_destroy(po2);
    }
    /* rand into a view: the same numbers as a fresh tensor, and nothing outside */
    tput(to, sent);
    MUST(mgpu_rand_uniform(vo, 42, 9, -1.0f, 1.0f));
    tget(to, got);
    for (i = 0; i < V * C && got[C + i] == mgpu__rand_element(42, 9, (uint64_t)i, 0, -1.0f, 1.0f); ++i) {}
    CHECK(i == V * C, "%s: rand_uniform into a row view differs at element %lld", L, (long long)i);
    CHECK(edges_intact(got, sent, R, C), "rand_uniform on %s wrote outside its row view", L);
    /* fill and convert on u8 views 3 bytes into their storage */
    {
        uint8_t u[15], ub[15];
        float f[15], fs[15];
        mgpu_tensor *tu = tmake(dev, MGPU_U8, mgpu_shape2(5, 3)), *tf, *vu, *vf;
        for (i = 0; i < 15; ++i) { u[i] = (uint8_t)(10 * i); fs[i] = -1.0f; }
        tput(tu, u);
        vu = mgpu_tensor_view_rows(tu, 1, 3);
        MUST(mgpu_tensor_fill(vu, 9.0));
        tget(tu, ub);
        for (i = 0; i < 15 && ub[i] == ((i >= 3 && i < 12) ? 9 : u[i]); ++i) {}
        CHECK(i == 15, "%s: u8 fill of a row view wrote the wrong bytes (byte %lld)", L, (long long)i);
        tput(tu, u);
        tf = tfrom(dev, mgpu_shape2(5, 3), fs);
        vf = mgpu_tensor_view_rows(tf, 1, 3);
        MUST(mgpu_tensor_convert(vf, vu, 0.5f, 0.0f));
        tget(tf, f);
        for (i = 0; i < 15 && f[i] == ((i >= 3 && i < 12) ? 0.5f * (float)u[i] : -1.0f); ++i) {}
        CHECK(i == 15, "%s: convert between row views wrong at %lld", L, (long long)i);
        mgpu_tensor_destroy(vu); mgpu_tensor_destroy(vf); mgpu_tensor_destroy(tu); mgpu_tensor_destroy(tf);
    }
    mgpu_tensor_destroy(va); mgpu_tensor_destroy(vb); mgpu_tensor_destroy(vo);
    mgpu_tensor_destroy(ta); mgpu_tensor_destroy(tb); mgpu_tensor_destroy(to);
    free(pa); free(pb); free(sent); free(got); free(ref);
}

static void test_views_in_ops(void) {
    int d;
    header("ops on views");
    for (d = 0; d < g_ndev; ++d) views_in_ops_on(g_devs[d]);
    gpu_group_note("ops on views");
}

/* ============================================================================================ */
/* 7. error paths of the ops                                                                    */
/* ============================================================================================ */
static void errors_on(mgpu_device* dev) {
    const char* L = mgpu_device_label(dev);
    mgpu_tensor *a34 = tmake(dev, MGPU_F32, mgpu_shape2(3, 4)), *b43 = tmake(dev, MGPU_F32, mgpu_shape2(4, 3));
    mgpu_tensor *o34 = tmake(dev, MGPU_F32, mgpu_shape2(3, 4)), *i34 = tmake(dev, MGPU_I32, mgpu_shape2(3, 4));
    mgpu_tensor *v12 = tmake(dev, MGPU_F32, mgpu_shape1(12)), *b5 = tmake(dev, MGPU_F32, mgpu_shape1(5));
    mgpu_tensor *c3 = tmake(dev, MGPU_F32, mgpu_shape3(2, 3, 4)), *loss2 = tmake(dev, MGPU_F32, mgpu_shape1(2));
    mgpu_tensor *loss1 = tmake(dev, MGPU_F32, mgpu_shape1(1)), *lab3 = tmake(dev, MGPU_I32, mgpu_shape1(3));
    mgpu_tensor *lab4 = tmake(dev, MGPU_I32, mgpu_shape1(4)), *o4 = tmake(dev, MGPU_F32, mgpu_shape1(4));
    mgpu_tensor *flab3 = tmake(dev, MGPU_F32, mgpu_shape1(3)), *e010 = tmake(dev, MGPU_F32, mgpu_shape2(0, 10));
    mgpu_tensor* lab0 = tmake(dev, MGPU_I32, mgpu_shape1(0));
    float sentinel[12], back[12];
    int32_t zeros[4] = { 0, 0, 0, 0 };
    int64_t count = 7;
    int i;
    for (i = 0; i < 12; ++i) sentinel[i] = 100.0f + (float)i;
    MUST(mgpu_tensor_zero(a34));
    MUST(mgpu_tensor_zero(b43));
    MUST(mgpu_tensor_zero(i34));
    MUST(mgpu_tensor_zero(c3));
    MUST(mgpu_tensor_zero(b5));
    tput(lab3, zeros);
    tput(lab4, zeros);
    tput(o34, sentinel);

    /* NULL tensors */
    expect_fail(mgpu_add(NULL, a34, a34), MGPU_ERROR_INVALID_ARGUMENT, "add(NULL out)", "mgpu_add", "out", NULL);
    expect_fail(mgpu_add(o34, NULL, a34), MGPU_ERROR_INVALID_ARGUMENT, "add(NULL a)", "mgpu_add", NULL, NULL);
    expect_fail(mgpu_sub(o34, a34, NULL), MGPU_ERROR_INVALID_ARGUMENT, "sub(NULL b)", "mgpu_sub", NULL, NULL);
    expect_fail(mgpu_axpy(NULL, 1.0f, a34), MGPU_ERROR_INVALID_ARGUMENT, "axpy(NULL y)", "mgpu_axpy", NULL, NULL);
    expect_fail(mgpu_relu(NULL, a34), MGPU_ERROR_INVALID_ARGUMENT, "relu(NULL out)", "mgpu_relu", NULL, NULL);
    expect_fail(mgpu_gelu(o34, NULL), MGPU_ERROR_INVALID_ARGUMENT, "gelu(NULL x)", "mgpu_gelu", NULL, NULL);
    expect_fail(mgpu_tanh_backward(o34, a34, NULL), MGPU_ERROR_INVALID_ARGUMENT, "tanh_backward(NULL y)",
                "mgpu_tanh_backward", NULL, NULL);
    expect_fail(mgpu_matmul(o34, NULL, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_INVALID_ARGUMENT, "matmul(NULL a)",
                "mgpu_matmul", NULL, NULL);
    expect_fail(mgpu_matmul(NULL, a34, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_INVALID_ARGUMENT, "matmul(NULL out)",
                "mgpu_matmul", NULL, NULL);
    expect_fail(mgpu_bias_add(o34, a34, NULL), MGPU_ERROR_INVALID_ARGUMENT, "bias_add(NULL bias)", "mgpu_bias_add",
                NULL, NULL);
    expect_fail(mgpu_bias_add(NULL, a34, o4), MGPU_ERROR_INVALID_ARGUMENT, "bias_add(NULL out)", "mgpu_bias_add",
                NULL, NULL);
    expect_fail(mgpu_bias_backward(NULL, a34), MGPU_ERROR_INVALID_ARGUMENT, "bias_backward(NULL)", NULL, NULL, NULL);
    expect_fail(mgpu_sum(NULL, a34, 0), MGPU_ERROR_INVALID_ARGUMENT, "sum(NULL out)", "mgpu_sum", NULL, NULL);
    expect_fail(mgpu_mean(o4, NULL, 0), MGPU_ERROR_INVALID_ARGUMENT, "mean(NULL x)", "mgpu_mean", NULL, NULL);
    expect_fail(mgpu_softmax(o34, NULL), MGPU_ERROR_INVALID_ARGUMENT, "softmax(NULL x)", "mgpu_softmax", NULL, NULL);
    expect_fail(mgpu_softmax(NULL, a34), MGPU_ERROR_INVALID_ARGUMENT, "softmax(NULL out)", "mgpu_softmax", NULL, NULL);
    expect_fail(mgpu_softmax_cross_entropy(NULL, NULL, a34, lab3, 0.0f), MGPU_ERROR_INVALID_ARGUMENT,
                "cross_entropy(NULL loss)", "mgpu_softmax_cross_entropy", NULL, NULL);
    expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, a34, NULL, 0.0f), MGPU_ERROR_INVALID_ARGUMENT,
                "cross_entropy(NULL labels)", NULL, NULL, NULL);
    expect_fail(mgpu_mse(loss1, NULL, NULL, a34, 0.0f), MGPU_ERROR_INVALID_ARGUMENT, "mse(NULL pred)", "mgpu_mse",
                NULL, NULL);
    expect_fail(mgpu_argmax(NULL, a34), MGPU_ERROR_INVALID_ARGUMENT, "argmax(NULL out)", "mgpu_argmax", NULL, NULL);
    expect_fail(mgpu_count_correct(a34, lab3, NULL), MGPU_ERROR_INVALID_ARGUMENT, "count_correct(NULL count)",
                "mgpu_count_correct", NULL, NULL);
    expect_fail(mgpu_count_correct(NULL, lab3, &count), MGPU_ERROR_INVALID_ARGUMENT, "count_correct(NULL logits)",
                NULL, NULL, NULL);

    /* wrong dtypes */
    expect_fail(mgpu_add(o34, i34, a34), MGPU_ERROR_DTYPE_MISMATCH, "add(i32 a)", "mgpu_add", "i32[3,4]", "f32");
    expect_fail(mgpu_add(o34, a34, i34), MGPU_ERROR_DTYPE_MISMATCH, "add(i32 b)", "mgpu_add", "i32[3,4]", NULL);
    expect_fail(mgpu_add(i34, a34, a34), MGPU_ERROR_DTYPE_MISMATCH, "add(i32 out)", "mgpu_add", "i32[3,4]", NULL);
    expect_fail(mgpu_relu(i34, a34), MGPU_ERROR_DTYPE_MISMATCH, "relu(i32 out)", "mgpu_relu", NULL, NULL);
    expect_fail(mgpu_scale(o34, i34, 2.0f), MGPU_ERROR_DTYPE_MISMATCH, "scale(i32 x)", "mgpu_scale", NULL, NULL);
    expect_fail(mgpu_matmul(o34, i34, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_DTYPE_MISMATCH, "matmul(i32 a)",
                "mgpu_matmul", "i32[3,4]", NULL);
    expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, a34, flab3, 0.0f), MGPU_ERROR_DTYPE_MISMATCH,
                "cross_entropy(f32 labels)", "mgpu_softmax_cross_entropy", "f32[3]", "i32");
    expect_fail(mgpu_softmax_cross_entropy(lab4, NULL, a34, lab3, 0.0f), MGPU_ERROR_DTYPE_MISMATCH,
                "cross_entropy(i32 loss)", NULL, NULL, NULL);
    expect_fail(mgpu_argmax(flab3, a34), MGPU_ERROR_DTYPE_MISMATCH, "argmax(f32 out)", "mgpu_argmax", NULL, NULL);
    expect_fail(mgpu_count_correct(a34, flab3, &count), MGPU_ERROR_DTYPE_MISMATCH, "count_correct(f32 labels)", NULL,
                NULL, NULL);
    expect_fail(mgpu_sum(lab4, a34, 1), MGPU_ERROR_DTYPE_MISMATCH, "sum(i32 out)", NULL, NULL, NULL);

    /* shape mismatches, with both shapes in the message */
    expect_fail(mgpu_add(o34, a34, b43), MGPU_ERROR_SHAPE_MISMATCH, "add [3,4] + [4,3]", "mgpu_add", "[3,4]", "[4,3]");
    expect_fail(mgpu_mul(o34, a34, v12), MGPU_ERROR_SHAPE_MISMATCH, "mul [3,4] * [12]", "mgpu_mul", "[3,4]", "[12]");
    expect_fail(mgpu_relu(v12, a34), MGPU_ERROR_SHAPE_MISMATCH, "relu [3,4] -> [12]", "mgpu_relu", "[3,4]", "[12]");
    expect_fail(mgpu_axpy(v12, 1.0f, a34), MGPU_ERROR_SHAPE_MISMATCH, "axpy [12] += [3,4]", "mgpu_axpy", "[3,4]",
                "[12]");
    expect_fail(mgpu_gelu_backward(o34, a34, b43), MGPU_ERROR_SHAPE_MISMATCH, "gelu_backward [3,4] [4,3]",
                "mgpu_gelu_backward", "[3,4]", "[4,3]");
    expect_fail(mgpu_matmul(o34, a34, a34, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "matmul [3,4]@[3,4]",
                "mgpu_matmul", "[3,4]", NULL);
    expect_fail(mgpu_matmul(o34, a34, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "matmul [3,4]@[4,3] -> [3,4]",
                "mgpu_matmul", "[4,3]", "[3,4]");
    expect_fail(mgpu_matmul(o34, a34, b43, MGPU_TRANS, MGPU_TRANS, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "matmul [3,4]^T@[4,3]^T -> [3,4]", "mgpu_matmul", "transposed", NULL);
    expect_fail(mgpu_bias_add(o34, a34, b5), MGPU_ERROR_SHAPE_MISMATCH, "bias_add [3,4] + [5]", "mgpu_bias_add", "[3,4]",
                "[5]");
    expect_fail(mgpu_bias_add(b43, a34, o4), MGPU_ERROR_SHAPE_MISMATCH, "bias_add [3,4] -> [4,3]", "mgpu_bias_add",
                "[3,4]", "[4,3]");
    expect_fail(mgpu_bias_backward(b5, a34), MGPU_ERROR_SHAPE_MISMATCH, "bias_backward [5] of [3,4]",
                "mgpu_bias_backward", "[5]", "[3,4]");
    expect_fail(mgpu_sum(b5, a34, 0), MGPU_ERROR_SHAPE_MISMATCH, "sum axis 0 of [3,4] into [5]", "mgpu_sum", "[5]",
                "[3,4]");
    expect_fail(mgpu_mean(o4, a34, 1), MGPU_ERROR_SHAPE_MISMATCH, "mean axis 1 of [3,4] into [4]", "mgpu_mean", "[4]",
                "[3,4]");
    expect_fail(mgpu_softmax(b43, a34), MGPU_ERROR_SHAPE_MISMATCH, "softmax [3,4] -> [4,3]", "mgpu_softmax", "[3,4]",
                "[4,3]");
    expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, a34, lab4, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "cross_entropy [3,4] with labels [4]", "mgpu_softmax_cross_entropy", "[4]", "[3,4]");
    expect_fail(mgpu_softmax_cross_entropy(loss1, b43, a34, lab3, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "cross_entropy dlogits [4,3] for [3,4]", "mgpu_softmax_cross_entropy", "[4,3]", "[3,4]");
    expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, e010, lab0, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "cross_entropy of empty logits", "mgpu_softmax_cross_entropy", "[0,10]", NULL);
    expect_fail(mgpu_mse(loss1, NULL, a34, b43, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "mse [3,4] vs [4,3]", "mgpu_mse",
                "[3,4]", "[4,3]");
    expect_fail(mgpu_mse(loss1, b43, a34, o34, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "mse dpred [4,3]", "mgpu_mse", "[4,3]",
                NULL);
    expect_fail(mgpu_mse(loss1, NULL, e010, e010, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "mse of empty pred", "mgpu_mse",
                NULL, NULL);
    expect_fail(mgpu_argmax(lab4, a34), MGPU_ERROR_SHAPE_MISMATCH, "argmax of [3,4] into [4]", "mgpu_argmax", "[4]",
                "[3,4]");
    expect_fail(mgpu_count_correct(a34, lab4, &count), MGPU_ERROR_SHAPE_MISMATCH, "count_correct [3,4] labels [4]",
                "mgpu_count_correct", "[4]", "[3,4]");

    /* wrong ranks */
    expect_fail(mgpu_matmul(o34, c3, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "matmul with a 3-D a",
                "mgpu_matmul", "[2,3,4]", NULL);
    expect_fail(mgpu_matmul(v12, a34, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "matmul with a 1-D out",
                "mgpu_matmul", "[12]", NULL);
    expect_fail(mgpu_softmax(v12, v12), MGPU_ERROR_SHAPE_MISMATCH, "softmax of 1-D", "mgpu_softmax", "[12]", NULL);
    expect_fail(mgpu_sum(o4, c3, 0), MGPU_ERROR_SHAPE_MISMATCH, "sum of 3-D", "mgpu_sum", "[2,3,4]", NULL);
    expect_fail(mgpu_bias_add(v12, v12, v12), MGPU_ERROR_SHAPE_MISMATCH, "bias_add of 1-D x", "mgpu_bias_add", "[12]",
                NULL);
    expect_fail(mgpu_bias_add(a34, a34, o34), MGPU_ERROR_SHAPE_MISMATCH, "bias_add with a 2-D bias", "mgpu_bias_add",
                NULL, NULL);
    expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, v12, lab3, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "cross_entropy of 1-D logits", "mgpu_softmax_cross_entropy", "[12]", NULL);
    expect_fail(mgpu_argmax(lab3, c3), MGPU_ERROR_SHAPE_MISMATCH, "argmax of 3-D", "mgpu_argmax", "[2,3,4]", NULL);

    /* a loss tensor of two elements */
    expect_fail(mgpu_softmax_cross_entropy(loss2, NULL, a34, lab3, 0.0f), MGPU_ERROR_SHAPE_MISMATCH,
                "cross_entropy with loss [2]", "mgpu_softmax_cross_entropy", "[2]", "loss");
    expect_fail(mgpu_mse(loss2, NULL, a34, o34, 0.0f), MGPU_ERROR_SHAPE_MISMATCH, "mse with loss [2]", "mgpu_mse",
                "[2]", NULL);

    /* bad axes */
    expect_fail(mgpu_sum(o4, a34, 2), MGPU_ERROR_INVALID_ARGUMENT, "sum axis 2", "mgpu_sum", "axis", NULL);
    expect_fail(mgpu_mean(o4, a34, -1), MGPU_ERROR_INVALID_ARGUMENT, "mean axis -1", "mgpu_mean", "-1", NULL);

    /* after a failure the output is unchanged */
    tget(o34, back);
    CHECK(all_equal_f(back, sentinel, 12), "%s: a failed op changed its output tensor", L);
    {
        float s4[4] = { 5, 6, 7, 8 }, g4[4];
        tput(o4, s4);
        CHECK(mgpu_sum(o4, a34, 7) != MGPU_OK, "sum axis 7 succeeded");
        CHECK(mgpu_softmax(o4, a34) != MGPU_OK, "softmax into [4] succeeded");
        CHECK(mgpu_matmul(o4, a34, b43, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f) != MGPU_OK, "matmul into [4] succeeded");
        tget(o4, g4);
        CHECK(all_equal_f(s4, g4, 4), "%s: failed sum/softmax/matmul changed their output", L);
    }
    count = 7;
    CHECK(mgpu_count_correct(a34, lab4, &count) != MGPU_OK && count == 0,
          "%s: count_correct failure left count %lld (documented to set 0 first)", L, (long long)count);
    if (is_gpu(dev)) {
        /* more rows than the row kernels count in int: refused before any kernel sees them. The
           headers claim 2^31 rows of one column (no memory that size exists here): each op must
           stop at its argument check, or the kernel would read far past the 12 floats. */
        mgpu_tensor huge = *a34, huge_labels = *lab3, huge_out = *lab3;
        huge.shape = mgpu_shape2((int64_t)1 << 31, 1);
        huge_labels.shape = huge_out.shape = mgpu_shape1((int64_t)1 << 31);
        expect_fail(mgpu_argmax(&huge_out, &huge), MGPU_ERROR_UNSUPPORTED, "argmax of 2^31 rows", "mgpu_argmax", "2^31", NULL);
        expect_fail(mgpu_count_correct(&huge, &huge_labels, &count), MGPU_ERROR_UNSUPPORTED, "count_correct of 2^31 rows",
                    "mgpu_count_correct", "2^31", NULL);
        expect_fail(mgpu_softmax(&huge, &huge), MGPU_ERROR_UNSUPPORTED, "softmax of 2^31 rows", "mgpu_softmax", "2^31", NULL);
        expect_fail(mgpu_softmax_cross_entropy(loss1, NULL, &huge, &huge_labels, 0.0f), MGPU_ERROR_UNSUPPORTED,
                    "cross_entropy of 2^31 rows", "mgpu_softmax_cross_entropy", "2^31", NULL);
    }

    mgpu_tensor_destroy(a34); mgpu_tensor_destroy(b43); mgpu_tensor_destroy(o34); mgpu_tensor_destroy(i34);
    mgpu_tensor_destroy(v12); mgpu_tensor_destroy(b5); mgpu_tensor_destroy(c3); mgpu_tensor_destroy(loss2);
    mgpu_tensor_destroy(loss1); mgpu_tensor_destroy(lab3); mgpu_tensor_destroy(lab4); mgpu_tensor_destroy(o4);
    mgpu_tensor_destroy(flab3); mgpu_tensor_destroy(e010); mgpu_tensor_destroy(lab0);
}

/* Sizes and values at the edge of what the types hold: never undefined behaviour (the asan
   build runs UBSan), always a clear answer. */
static void test_hostile_sizes(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tensor *t = tmake(cpu, MGPU_F32, mgpu_shape2(4, 3)), *v;
    mgpu_tensor *logits = tmake(cpu, MGPU_F32, mgpu_shape2(2, 3)), *labels;
    const int32_t bad[2] = {1, 99};
    const float zeros[6] = {0};
    int64_t count = -7;
    header("hostile sizes");
    CHECK(mgpu_shape_numel(mgpu_shape2(INT64_MAX / 2, 3)) == -1, "numel of [2^62, 3]: %lld, want -1 (overflow)",
          (long long)mgpu_shape_numel(mgpu_shape2(INT64_MAX / 2, 3)));
    CHECK(mgpu_shape_numel(mgpu_shape2(-2, 3)) == -1, "numel of [-2, 3]: %lld, want -1", (long long)mgpu_shape_numel(mgpu_shape2(-2, 3)));
    CHECK(mgpu_shape_numel(mgpu_shape3(1 << 20, 1 << 20, 1 << 20)) == (int64_t)1 << 60, "numel of [2^20]^3 is 2^60");
    v = mgpu_tensor_view_rows(t, INT64_MAX - 1, 5);
    expect_null(v, MGPU_ERROR_SHAPE_MISMATCH, "view of 5 rows from row 2^63-2", "from row 9223372036854775806", NULL);
    mgpu_tensor_destroy(v);
    tput(logits, zeros);
    labels = tfrom_i32(cpu, mgpu_shape1(2), bad);
    expect_fail(mgpu_count_correct(logits, labels, &count), MGPU_ERROR_INVALID_ARGUMENT, "count_correct with label 99",
                "label 99", "row 1", "[0, 3)");
    mgpu_tensor_destroy(labels);
    mgpu_tensor_destroy(logits);
    mgpu_tensor_destroy(t);
}

static void test_op_errors(void) {
    int d;
    header("op error paths");
    for (d = 0; d < g_ndev; ++d) errors_on(g_devs[d]);
    /* two CPU devices of a set share host memory, yet ops refuse to mix them, as they refuse two
       GPUs (a program tried on cpu:N fails where it would on cuda:0,1); copies move between them */
    {
        mgpu_device_set* set = mgpu_device_set_create("cpu:2");
        if (set) {
            float h[9] = { 1, 2, 3, 4, 5, 6, 7, 8, 9 }, g[6];
            mgpu_device *d0 = mgpu_device_set_get(set, 0), *d1 = mgpu_device_set_get(set, 1);
            mgpu_tensor *a = tfrom(d0, mgpu_shape2(2, 3), h), *b = tfrom(d1, mgpu_shape2(2, 3), h);
            mgpu_tensor *w = tfrom(d1, mgpu_shape2(3, 3), h), *o = tmake(d0, MGPU_F32, mgpu_shape2(2, 3));
            mgpu_tensor *lab = tmake(d1, MGPU_I32, mgpu_shape1(2)), *loss = tmake(d0, MGPU_F32, mgpu_shape1(1));
            mgpu_tensor *u8 = tmake(d1, MGPU_U8, mgpu_shape2(2, 3)), *c = NULL;
            MUST(mgpu_tensor_zero(lab));
            MUST(mgpu_tensor_zero(u8));
            CHECK(d0 != d1 && strcmp(mgpu_device_label(d1), "cpu#1") == 0, "cpu:2 has two devices, the second cpu#1 (%s)",
                  mgpu_device_label(d1));
            expect_fail(mgpu_add(a, a, b), MGPU_ERROR_DEVICE_MISMATCH, "add of cpu and cpu#1 tensors", "mgpu_add",
                        "'b' f32[2,3]@cpu#1", "'a' f32[2,3]@cpu ");
            CHECK(strcmp(mgpu_last_error(), "mgpu_add: 'b' f32[2,3]@cpu#1 and 'a' f32[2,3]@cpu are on different devices") == 0,
                  "add of cpu and cpu#1: the message names the op, both tensors and both devices: %s", mgpu_last_error());
            tget(a, g);
            CHECK(g[0] == 1.0f && g[5] == 6.0f, "the refused add left its output alone");
            expect_fail(mgpu_relu(b, a), MGPU_ERROR_DEVICE_MISMATCH, "relu cpu -> cpu#1", "mgpu_relu", "@cpu#1", "are on different devices");
            expect_fail(mgpu_matmul(o, a, w, MGPU_NO_TRANS, MGPU_NO_TRANS, 1.0f, 0.0f), MGPU_ERROR_DEVICE_MISMATCH,
                        "matmul cpu @ cpu#1", "mgpu_matmul", "'b' f32[3,3]@cpu#1", "'a' f32[2,3]@cpu ");
            expect_fail(mgpu_softmax_cross_entropy(loss, NULL, a, lab, 1.0f), MGPU_ERROR_DEVICE_MISMATCH,
                        "cross_entropy with labels on cpu#1", "mgpu_softmax_cross_entropy", "'labels' i32[2]@cpu#1", "'logits' f32[2,3]@cpu ");
            expect_fail(mgpu_tensor_convert(a, u8, 1.0f, 0.0f), MGPU_ERROR_DEVICE_MISMATCH, "convert cpu#1 -> cpu",
                        "mgpu_tensor_convert", "@cpu#1", "@cpu ");
            /* copies are how a tensor moves: then the op runs */
            MUST(mgpu_tensor_copy(o, b));
            MUST(mgpu_add(a, a, o));
            tget(a, g);
            CHECK(g[0] == 2.0f && g[5] == 12.0f, "add after copying cpu#1's tensor to cpu");
            c = mgpu_tensor_to(a, d1);
            CHECK(c && mgpu_tensor_device(c) == d1, "tensor_to(cpu#1): %s", mgpu_last_error());
            if (c) {
                MUST(mgpu_add(c, c, b));
                tget(c, g);
                CHECK(g[0] == 3.0f && g[5] == 18.0f, "add on cpu#1 after tensor_to");
            }
            mgpu_tensor_destroy(c); mgpu_tensor_destroy(u8); mgpu_tensor_destroy(loss); mgpu_tensor_destroy(lab);
            mgpu_tensor_destroy(o); mgpu_tensor_destroy(w); mgpu_tensor_destroy(b); mgpu_tensor_destroy(a);
            MUST(mgpu_device_set_destroy(set));
        }
    }
#ifdef MGPU_CUDA
    if (g_gpu) {   /* device mismatch: a CPU tensor and a CUDA tensor */
        float h[12] = { 0 };
        mgpu_tensor *c = tfrom(mgpu_device_cpu(), mgpu_shape2(3, 4), h), *g = tfrom(g_gpu, mgpu_shape2(3, 4), h);
        mgpu_tensor *gb = tfrom(g_gpu, mgpu_shape2(4, 3), h), *gl = tmake(g_gpu, MGPU_F32, mgpu_shape1(1));
        mgpu_tensor* cl = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(3));
        MUST(mgpu_tensor_zero(cl));
        expect_fail(mgpu_add(c, c, g), MGPU_ERROR_DEVICE_MISMATCH, "add cpu + cuda", "mgpu_add", "cpu", "cuda:0");
        expect_fail(mgpu_add(g, g, c), MGPU_ERROR_DEVICE_MISMATCH, "add cuda + cpu", "mgpu_add", "@cpu", "@cuda:0");
        expect_fail(mgpu_relu(c, g), MGPU_ERROR_DEVICE_MISMATCH, "relu cuda -> cpu", "mgpu_relu", "cpu", "cuda:0");
        expect_fail(mgpu_matmul(g, c, gb, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f), MGPU_ERROR_DEVICE_MISMATCH, "matmul cpu @ cuda",
                    "mgpu_matmul", "cpu", "cuda:0");
        expect_fail(mgpu_softmax_cross_entropy(gl, NULL, g, cl, 0.0f), MGPU_ERROR_DEVICE_MISMATCH,
                    "cross_entropy with cpu labels", "mgpu_softmax_cross_entropy", "cpu", "cuda:0");
        expect_fail(mgpu_tensor_convert(g, c, 1.0f, 0.0f), MGPU_ERROR_DEVICE_MISMATCH, "convert cpu -> cuda",
                    "mgpu_tensor_convert", "cpu", "cuda:0");
        mgpu_tensor_destroy(c); mgpu_tensor_destroy(g); mgpu_tensor_destroy(gb); mgpu_tensor_destroy(gl);
        mgpu_tensor_destroy(cl);
    }
#endif
    gpu_group_note("op error paths");
}

/* ============================================================================================ */
/* 7c. kernels of your own: mgpu_tensor_check, mgpu_cpu_parallel, mgpu_cuda_begin and _end      */
/* ============================================================================================ */
#ifdef MGPU_CUDA
/* tests/test_core_kernels.cu: y = sin(x) * scale, launched with this grid on stream */
void test_sin_launch(void* stream, const float* x, float* y, size_t n, float scale, unsigned blocks, unsigned threads);
#endif

/* the CPU half of the op: one slice of y = sin(x) * scale, and a mark on every element it wrote */
typedef struct own_job { const float* x; float* y; float scale; int* marks; int64_t* slice_of; } own_job;
static void own_sin_slice(void* user, int64_t begin, int64_t end) {
    const own_job* j = (const own_job*)user;
    int64_t i;
    for (i = begin; i < end; ++i) {
        j->y[i] = sinf(j->x[i]) * j->scale;
        if (j->marks) { j->marks[i]++; j->slice_of[i] = begin; }
    }
}

#ifdef MGPU_CUDA
/* The last error names CUDA's error for a launch of too many threads a block: CUDA 13 on an H200
   says cudaErrorInvalidValue, the emulated GPUs cudaErrorInvalidConfiguration (no other name). */
static void expect_launch_error(const char* what) {
    const char* msg = mgpu_last_error();
    CHECK(strstr(msg, "cudaErrorInvalidValue") || strstr(msg, "cudaErrorInvalidConfiguration"),
          "%s: message \"%s\" names neither cudaErrorInvalidValue nor cudaErrorInvalidConfiguration", what, msg);
}
#endif

/* An op of the program's own, as a user writes it (mgpu.h, >>ops): checks, then the CPU loop or
   the CUDA launch. threads: the launch's block size (above 1024 it fails to launch); at most 8
   blocks, so that the kernel's grid-stride loop covers the rest. */
static mgpu_result own_sin(mgpu_tensor* y, const mgpu_tensor* x, float scale, unsigned threads, int* marks,
                           int64_t* slice_of) {
    mgpu_device* dev = mgpu_tensor_device(x);
    int64_t n = mgpu_tensor_numel(x);
    mgpu_result r;
    if ((r = mgpu_tensor_check("own_sin", "x", x, MGPU_F32, NULL, NULL)) != MGPU_OK ||
        (r = mgpu_tensor_check("own_sin", "y", y, MGPU_F32, "x", x)) != MGPU_OK)
        return r;
    if (mgpu_device_kind_of(dev) == MGPU_DEVICE_CPU) {
        own_job job;
        job.x = (const float*)mgpu_tensor_data(x); job.y = (float*)mgpu_tensor_data(y); job.scale = scale;
        job.marks = marks; job.slice_of = slice_of;
        return mgpu_cpu_parallel(dev, n, 1000, own_sin_slice, &job);
    }
#ifdef MGPU_CUDA
    if (n > 0) {
        void* stream;
        int64_t blocks = (n + threads - 1) / threads;
        if ((r = mgpu_cuda_begin(dev, &stream)) != MGPU_OK) return r;
        test_sin_launch(stream, (const float*)mgpu_tensor_data(x), (float*)mgpu_tensor_data(y), (size_t)n, scale,
                        (unsigned)(blocks < 8 ? blocks : 8), threads);
        return mgpu_cuda_end(dev, "test_sin_kernel");
    }
#else
    (void)threads;
#endif
    return MGPU_OK;
}

/* z = 2 sin(x / 2) + x, by mgpu_scale, own_sin and mgpu_add queued one after the other with no
   wait between them: on a GPU only the stream orders them. */
static void own_chain_on(mgpu_device* dev, int64_t n) {
    float *x = fbuf(n), *got = fbuf(n);
    double* ref = dbuf(n);
    int* marks = (int*)xmalloc((size_t)(n ? n : 1) * sizeof(int));
    int64_t* slice_of = (int64_t*)xmalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    mgpu_tensor *tx, *th, *ty, *tz;
    int64_t i, slices = 0, once = 0;
    char what[96];
    int cpu = !is_gpu(dev);
    rnd_uniform(x, n, -10.0, 10.0);
    for (i = 0; i < n; ++i) ref[i] = 2.0 * sin(0.5 * (double)x[i]) + (double)x[i];
    tx = tfrom(dev, mgpu_shape1(n), x);
    th = tmake(dev, MGPU_F32, mgpu_shape1(n));
    ty = tmake(dev, MGPU_F32, mgpu_shape1(n));
    tz = tmake(dev, MGPU_F32, mgpu_shape1(n));
    MUST(mgpu_tensor_fill(ty, NAN));   /* an element the op misses stays NaN */
    MUST(mgpu_scale(th, tx, 0.5f));
    MUST(own_sin(ty, th, 2.0f, 128, cpu ? marks : NULL, cpu ? slice_of : NULL));
    MUST(mgpu_add(tz, ty, tx));
    tget(tz, got);
    snprintf(what, sizeof what, "own sin between mgpu_scale and mgpu_add, n %lld", (long long)n);
    check_err(dev, what, got, ref, n, 1e-6);
    if (cpu) {
        for (i = 0; i < n; ++i) {
            once += marks[i] == 1;
            slices += slice_of[i] == (i ? slice_of[i - 1] : -1) ? 0 : 1;
        }
        CHECK(once == n, "mgpu_cpu_parallel, n %lld: %lld elements visited once", (long long)n, (long long)once);
        CHECK(slices <= mgpu_cpu_threads() && (n < 2000 || mgpu_cpu_threads() == 1 || slices > 1),
              "mgpu_cpu_parallel, n %lld, grain 1000, %d threads: %lld slices", (long long)n, mgpu_cpu_threads(),
              (long long)slices);
    }
    mgpu_tensor_destroy(tx); mgpu_tensor_destroy(th); mgpu_tensor_destroy(ty); mgpu_tensor_destroy(tz);
    free(x); free(got); free(ref); free(marks); free(slice_of);
}

static void test_own_kernels(void) {
    const int64_t sizes[4] = { 0, 1, 1001, g_quick ? 20011 : 300007 };
    int d, s;
    void* stream = &stream;
    header("kernels of your own");
    for (d = 0; d < g_ndev; ++d)
        for (s = 0; s < 4; ++s) own_chain_on(g_devs[d], sizes[s]);
    /* wrong devices, dtypes and shapes, in every build */
    {
        mgpu_tensor *c = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 3)), *ci = tmake(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(2, 3));
        mgpu_tensor* c3 = tmake(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(3, 2));
        expect_fail(mgpu_tensor_check("own_sin", "x", NULL, MGPU_F32, NULL, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                    "mgpu_tensor_check of NULL", "own_sin", "'x' is NULL", NULL);
        expect_fail(own_sin(ci, c, 1.0f, 128, NULL, NULL), MGPU_ERROR_DTYPE_MISMATCH, "own op, an i32 output",
                    "own_sin", "'y'", "i32");
        expect_fail(own_sin(c3, c, 1.0f, 128, NULL, NULL), MGPU_ERROR_SHAPE_MISMATCH, "own op, shapes differ",
                    "own_sin", "[3,2]", "[2,3]");
        MUST(mgpu_tensor_check("own_sin", "x", c, MGPU_F32, "y", c));
        expect_fail(mgpu_cpu_parallel(NULL, 10, 0, own_sin_slice, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                    "mgpu_cpu_parallel on NULL", "mgpu_cpu_parallel", "NULL device", NULL);
        expect_fail(mgpu_cpu_parallel(mgpu_device_cpu(), 10, 0, NULL, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                    "mgpu_cpu_parallel without a function", "mgpu_cpu_parallel", "NULL function", NULL);
        expect_fail(mgpu_cpu_parallel(mgpu_device_cpu(), -1, 0, own_sin_slice, NULL), MGPU_ERROR_INVALID_ARGUMENT,
                    "mgpu_cpu_parallel of -1 elements", "mgpu_cpu_parallel", "-1", NULL);
        MUST(mgpu_cpu_parallel(mgpu_device_cpu(), 0, 0, own_sin_slice, NULL));   /* nothing to do: fn is not called */
        expect_fail(mgpu_cuda_begin(mgpu_device_cpu(), &stream), MGPU_ERROR_DEVICE_MISMATCH, "mgpu_cuda_begin on the CPU",
                    "mgpu_cuda_begin", "cpu is a CPU device", "mgpu_cpu_parallel");
        CHECK(stream == NULL, "mgpu_cuda_begin on the CPU leaves the stream NULL");
        expect_fail(mgpu_cuda_end(mgpu_device_cpu(), "k"), MGPU_ERROR_DEVICE_MISMATCH, "mgpu_cuda_end on the CPU",
                    "mgpu_cuda_end", "cpu", NULL);
        mgpu_tensor_destroy(c); mgpu_tensor_destroy(ci); mgpu_tensor_destroy(c3);
    }
#ifdef MGPU_CUDA
    if (g_gpu) {
        float h[6] = { 0.5f, 1, 2, 3, 4, 5 }, got[6];
        mgpu_tensor *c = tfrom(mgpu_device_cpu(), mgpu_shape2(2, 3), h), *g = tfrom(g_gpu, mgpu_shape2(2, 3), h);
        mgpu_tensor* gy = tmake(g_gpu, MGPU_F32, mgpu_shape2(2, 3));
        int i, ok = 1;
        expect_fail(own_sin(c, g, 1.0f, 128, NULL, NULL), MGPU_ERROR_DEVICE_MISMATCH, "own op, cuda -> cpu", "own_sin",
                    "@cpu", "@cuda:0");
        expect_fail(mgpu_cpu_parallel(g_gpu, 6, 0, own_sin_slice, NULL), MGPU_ERROR_DEVICE_MISMATCH,
                    "mgpu_cpu_parallel on a GPU", "mgpu_cpu_parallel", "cuda:0 is a GPU", "mgpu_cuda_begin");
        expect_fail(mgpu_cuda_begin(g_gpu, NULL), MGPU_ERROR_INVALID_ARGUMENT, "mgpu_cuda_begin without a stream pointer",
                    "mgpu_cuda_begin", "NULL stream", NULL);
        /* a launch that cannot start (2048 threads a block): the user's error, named */
        expect_fail(own_sin(gy, g, 1.0f, 2048, NULL, NULL), MGPU_ERROR_CUDA, "own kernel of 2048 threads a block",
                    "mgpu_cuda_end on cuda:0", "test_sin_kernel", NULL);
        expect_launch_error("own kernel of 2048 threads a block");
        /* and the next launch works: the failure was cleared */
        MUST(own_sin(gy, g, 1.0f, 32, NULL, NULL));
        tget(gy, got);
        for (i = 0; i < 6; ++i) ok &= fabs((double)got[i] - sin((double)h[i])) <= 1e-6;
        CHECK(ok, "own kernel after a failed launch: sin(0.5) %g", (double)got[0]);
        mgpu_tensor_destroy(c); mgpu_tensor_destroy(g); mgpu_tensor_destroy(gy);
    }
    /* several GPUs: the kernel on the last, after mgpu made the first current */
    if (g_gpu && mgpu_cuda_device_count() > 1) {
        mgpu_device_set* all = mgpu_device_set_create("cuda");
        CHECK(all != NULL, "mgpu_device_set_create(\"cuda\"): %s", mgpu_last_error());
        if (all) {
            mgpu_device* last = mgpu_device_set_get(all, mgpu_device_set_count(all) - 1);
            float h[5] = { -3, -1, 0, 1, 3 }, got[5];
            mgpu_tensor *first = tmake(mgpu_device_set_get(all, 0), MGPU_F32, mgpu_shape1(5));
            mgpu_tensor *x = tfrom(last, mgpu_shape1(5), h), *y = tmake(last, MGPU_F32, mgpu_shape1(5));
            int i, ok = 1;
            MUST(mgpu_tensor_fill(first, 1.0));   /* a kernel on the first GPU: it is current now */
            MUST(own_sin(y, x, 1.0f, 64, NULL, NULL));
            tget(y, got);
            for (i = 0; i < 5; ++i) ok &= fabs((double)got[i] - sin((double)h[i])) <= 1e-6;
            CHECK(ok, "own kernel on %s after a kernel on %s", mgpu_device_label(last),
                  mgpu_device_label(mgpu_device_set_get(all, 0)));
            mgpu_tensor_destroy(first); mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
            MUST(mgpu_device_set_destroy(all));
        }
    }
#endif
    gpu_group_note("kernels of your own");
}

/* ============================================================================================ */
/* 8. CPU threads                                                                               */
/* ============================================================================================ */
static void test_threads(void) {
    static const int64_t dims[3][3] = { { 203, 301, 157 }, { 9, 700, 300 }, { 64, 64, 600 } };
    const int saved = mgpu_cpu_threads();
    const int64_t ne = g_quick ? (1 << 17) + 1 : (1 << 20) + 1;
    mgpu_device* cpu = mgpu_device_cpu();
    int c, t, tr;
    header("cpu threads");
    for (c = 0; c < 3; ++c)
        for (tr = 0; tr < 4; ++tr) {
            const int64_t m = dims[c][0], n = dims[c][1], k = dims[c][2];
            const int ta = tr & 1, tb = tr >> 1;
            float *a = fbuf(m * k), *b = fbuf(k * n), *r1 = fbuf(m * n), *r4 = fbuf(m * n);
            mgpu_tensor *t_a, *t_b, *t_c;
            rnd_normal(a, m * k, 1.0);
            rnd_normal(b, k * n, 1.0);
            t_a = tfrom(cpu, ta ? mgpu_shape2(k, m) : mgpu_shape2(m, k), a);
            t_b = tfrom(cpu, tb ? mgpu_shape2(n, k) : mgpu_shape2(k, n), b);
            t_c = tmake(cpu, MGPU_F32, mgpu_shape2(m, n));
            for (t = 0; t < 2; ++t) {
                mgpu_cpu_set_threads(t ? 4 : 1);
                CHECK(mgpu_cpu_threads() == (t ? 4 : 1), "mgpu_cpu_threads() %d after set", mgpu_cpu_threads());
                MUST(mgpu_matmul(t_c, t_a, t_b, ta, tb, 1.0f, 0.0f));
                tget(t_c, t ? r4 : r1);
            }
            CHECK(all_equal_f(r1, r4, m * n), "matmul %lldx%lldx%lld %c%c: 1 and 4 threads differ", (long long)m,
                  (long long)n, (long long)k, ta ? 'T' : 'N', tb ? 'T' : 'N');
            mgpu_tensor_destroy(t_a);
            mgpu_tensor_destroy(t_b);
            mgpu_tensor_destroy(t_c);
            free(a); free(b); free(r1); free(r4);
        }
    {   /* elementwise, rand and reductions too */
        float *x = fbuf(ne), *r1 = fbuf(ne), *r4 = fbuf(ne);
        mgpu_tensor *tx, *ty, *ts;
        rnd_uniform(x, ne, -3.0, 3.0);
        tx = tfrom(cpu, mgpu_shape1(ne), x);
        ty = tmake(cpu, MGPU_F32, mgpu_shape1(ne));
        ts = tmake(cpu, MGPU_F32, mgpu_shape1(ne));
        for (t = 0; t < 2; ++t) {
            mgpu_cpu_set_threads(t ? 4 : 1);
            MUST(mgpu_gelu(ty, tx));
            tget(ty, t ? r4 : r1);
        }
        CHECK(all_equal_f(r1, r4, ne), "gelu: 1 and 4 threads differ");
        for (t = 0; t < 2; ++t) {
            mgpu_cpu_set_threads(t ? 4 : 1);
            MUST(mgpu_rand_normal(ts, 3, 9, 0.0f, 1.0f));
            tget(ts, t ? r4 : r1);
        }
        CHECK(all_equal_f(r1, r4, ne), "rand_normal: 1 and 4 threads differ");
        mgpu_tensor_destroy(tx);
        mgpu_tensor_destroy(ty);
        mgpu_tensor_destroy(ts);
        free(x); free(r1); free(r4);
    }
    mgpu_cpu_set_threads(0);
    CHECK(mgpu_cpu_threads() == 1, "set_cpu_threads(0) gives %d threads, want 1", mgpu_cpu_threads());
    mgpu_cpu_set_threads(-5);
    CHECK(mgpu_cpu_threads() == 1, "set_cpu_threads(-5) gives %d threads, want 1", mgpu_cpu_threads());
    mgpu_cpu_set_threads(saved);
    CHECK(mgpu_cpu_threads() == saved, "threads not restored: %d, want %d", mgpu_cpu_threads(), saved);
}

/* Two threads at once: CPU replicas each doing matmuls (the data-parallel CPU mode), and both
   threads allocating on one device (the allocator's lock). */
typedef struct conc_job { mgpu_device* dev; mgpu_tensor *a, *b, *c; int reps; int failures; } conc_job;
TEST_THREAD_MAIN(conc_thread, arg) {
    conc_job* j = (conc_job*)arg;
    int r, i;
    for (r = 0; r < j->reps; ++r) {
        mgpu_tensor* t[3];
        if (mgpu_matmul(j->c, j->a, j->b, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f) != MGPU_OK) j->failures++;
        for (i = 0; i < 3; ++i) t[i] = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(1000 + 300 * i + r));
        for (i = 0; i < 3; ++i) { if (!t[i]) j->failures++; mgpu_tensor_destroy(t[i]); }
    }
    TEST_THREAD_END;
}

static void test_concurrency(void) {
    const int64_t m = 97, n = 301, k = 203;
    mgpu_device_set* set = mgpu_device_set_create("cpu:2");
    conc_job job[2];
    float* want[2];
    float* got = fbuf(m * n);
    test_thread th[2];
    int i, started[2];
    mgpu_memory_stats s0, s;
    header("two threads on CPU replicas");
    if (!set) { CHECK(0, "cpu:2: %s", mgpu_last_error()); free(got); return; }
    s0 = stats_of(mgpu_device_cpu());
    for (i = 0; i < 2; ++i) {
        float *a = fbuf(m * k), *b = fbuf(n * k);
        rnd_normal(a, m * k, 1.0);
        rnd_normal(b, n * k, 1.0);
        job[i].dev = mgpu_device_set_get(set, i);
        job[i].a = tfrom(job[i].dev, mgpu_shape2(m, k), a);
        job[i].b = tfrom(job[i].dev, mgpu_shape2(n, k), b);
        job[i].c = tmake(job[i].dev, MGPU_F32, mgpu_shape2(m, n));
        job[i].reps = 20;
        job[i].failures = 0;
        want[i] = fbuf(m * n);
        MUST(mgpu_matmul(job[i].c, job[i].a, job[i].b, MGPU_NO_TRANS, MGPU_TRANS, 1.0f, 0.0f));   /* alone first */
        tget(job[i].c, want[i]);
        MUST(mgpu_tensor_fill(job[i].c, NAN));
        free(a);
        free(b);
    }
    for (i = 0; i < 2; ++i) started[i] = test_thread_start(&th[i], conc_thread, &job[i]) == 0;
    for (i = 0; i < 2; ++i) {
        if (started[i]) test_thread_join(th[i]);
        CHECK(started[i], "starting thread %d failed", i);
        CHECK(job[i].failures == 0, "%d failures on thread %d: %s", job[i].failures, i, mgpu_last_error());
        tget(job[i].c, got);
        CHECK(all_equal_f(got, want[i], m * n), "matmul on %s alongside another thread differs from alone",
              mgpu_device_label(job[i].dev));
    }
    for (i = 0; i < 2; ++i) {
        mgpu_tensor_destroy(job[i].a);
        mgpu_tensor_destroy(job[i].b);
        mgpu_tensor_destroy(job[i].c);
        free(want[i]);
    }
    s = stats_of(mgpu_device_cpu());
    CHECK(s.bytes_in_use == s0.bytes_in_use, "cpu in use %zu after two threads allocated, was %zu", s.bytes_in_use,
          s0.bytes_in_use);
    mgpu_device_set_destroy(set);
    free(got);
}

#ifndef MGPU_NO_THREADS
/* MGPU_TEST_UNDER_QEMU=1 (tests/aarch64.sh sets it): the suite runs under qemu-user, whose own
   limits a few checks meet; each such check says so, narrowly, and reports a skip instead */
static int under_qemu(void) {
    const char* v = getenv("MGPU_TEST_UNDER_QEMU");
    return v && *v && strcmp(v, "0") != 0;
}
#endif

#if !defined(MGPU_NO_THREADS) && !defined(_WIN32)
/* fork(): the child's pool starts afresh and uses threads again, even when the parent forked in
   the middle of a job on another thread (whose workers, lock and half-done job the child does
   not have). Each task sleeps, so that the workers take some of them; the child has an alarm in
   case it hangs. */
typedef struct fork_job { pthread_t ran_on[8]; int started; } fork_job;
static void fork_task(void* ctx, int64_t task) {
    fork_job* j = (fork_job*)ctx;
    struct timespec ts = { 0, 20 * 1000 * 1000 };
    __atomic_store_n(&j->started, 1, __ATOMIC_RELEASE);
    nanosleep(&ts, NULL);
    j->ran_on[task] = pthread_self();
}
static int fork_job_threads(const fork_job* j) {   /* the threads that ran the job's 8 tasks */
    int i, k, n = 0;
    for (i = 0; i < 8; ++i) {
        for (k = 0; k < i && !pthread_equal(j->ran_on[k], j->ran_on[i]); ++k) {}
        n += k == i;
    }
    return n;
}
static void* fork_busy_thread(void* arg) {
    mgpu__parallel_for(8, fork_task, arg);
    return NULL;
}
/* Runs child() (which must not return) in a child process; returns its exit status, 128 + its
   signal, or -1 when it could not be forked or waited for. */
static int run_in_child(void (*child)(void)) {
    int status = 0;
    pid_t pid;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        child();
        _exit(127);
    }
    if (waitpid(pid, &status, 0) != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
/* a forked child's job: exit 0 if more than one thread ran it */
static void child_runs_a_job(void) {
    fork_job j;
    memset(&j, 0, sizeof j);
    alarm(30);
    mgpu__parallel_for(8, fork_task, &j);
    _exit(fork_job_threads(&j) > 1 ? 0 : 3);
}
static void test_fork(void) {
    const int saved = mgpu_cpu_threads();
    fork_job j, busy;
    pthread_t th;
    int rc;
    header("fork");
    memset(&j, 0, sizeof j);
    memset(&busy, 0, sizeof busy);
    mgpu_cpu_set_threads(2);
    mgpu__parallel_for(8, fork_task, &j);   /* the parent's pool at work first */
    CHECK(fork_job_threads(&j) > 1, "the parent's job ran on %d thread(s), want 2", fork_job_threads(&j));
    rc = run_in_child(child_runs_a_job);
    /* Under qemu-user 7.2 (Debian 12's qemu-aarch64) a child forked from a process with live
       threads cannot start one of its own: qemu asserts in qemu_plugin_vcpu_init_hook and the
       child ends with 127, before mgpu's pool does anything. Exit 0 (passed) and 3 (the job ran
       alone: mgpu's failure) keep their meaning there; any other end is qemu's, and a skip. */
    if (under_qemu() && rc != 0 && rc != 3)
        SKIP("a child forked while the pool was idle: exit %d under qemu-user (a forked child of a threaded process cannot start threads there)", rc);
    else
        CHECK(rc == 0, "a child forked while the pool was idle: exit %d (3: its job ran on its own thread alone)", rc);
    if (pthread_create(&th, NULL, fork_busy_thread, &busy) != 0) {
        CHECK(0, "pthread_create failed");
    } else {
        struct timespec ms = { 0, 1000 * 1000 };
        int waited;
        /* inside the other thread's job: its first task has begun (8 tasks of 20 ms on 2 threads) */
        for (waited = 0; waited < 10000 && !__atomic_load_n(&busy.started, __ATOMIC_ACQUIRE); ++waited) nanosleep(&ms, NULL);
        rc = run_in_child(child_runs_a_job);
        pthread_join(th, NULL);
        CHECK(waited < 10000, "the other thread's job did not start in 10 s");
        if (under_qemu() && rc != 0 && rc != 3)   /* as above */
            SKIP("a child forked during another thread's job: exit %d under qemu-user (a forked child of a threaded process cannot start threads there)", rc);
        else
            CHECK(rc == 0, "a child forked during another thread's job: exit %d (3: ran alone; 142: hung)", rc);
        CHECK(fork_job_threads(&busy) > 1, "the other thread's job ran on %d thread(s)", fork_job_threads(&busy));
    }
    mgpu_cpu_set_threads(saved);
}
#elif !defined(MGPU_NO_THREADS)
static void test_fork(void) {
    header("fork");
    SKIP("fork: Windows has no fork(), so no process starts with a copy of another's thread pool");
}
#endif

#ifndef MGPU_NO_THREADS

/* MGPU_CPU_SPIN_US: how long an idle worker watches for the next job before it sleeps. 20 jobs
   back to back, each of two 5 ms tasks (so that the worker takes one): with 0, the worker sleeps
   after each job; with 0.2 s, it never sleeps between them. */
static void spin_task(void* ctx, int64_t task) {
    (void)ctx;
    (void)task;
    test_sleep_ms(5);
}
static uint64_t worker_sleeps_in_20_jobs(double spin_seconds) {
    uint64_t before, after;
    int i;
    mgpu__mutex_lock(&mgpu__the_pool.lock);
    mgpu__pool_spin = spin_seconds;
    before = mgpu__the_pool.sleeps;
    mgpu__mutex_unlock(&mgpu__the_pool.lock);
    for (i = 0; i < 20; ++i) mgpu__parallel_for(2, spin_task, NULL);
    mgpu__mutex_lock(&mgpu__the_pool.lock);
    after = mgpu__the_pool.sleeps;
    mgpu__mutex_unlock(&mgpu__the_pool.lock);
    return after - before;
}
/* "test_core pool_spin" again in a fresh process with MGPU_CPU_SPIN_US=250, its output thrown
   away: its exit status, 128 + its signal, or -1 when it could not be started. */
#ifndef _WIN32
static void child_runs_pool_spin_with_250(void) {
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) { dup2(null, 1); dup2(null, 2); }
    setenv("MGPU_CPU_SPIN_US", "250", 1);
    execl("/proc/self/exe", "test_core", "pool_spin", (char*)NULL);
    _exit(errno == ENOEXEC ? 126 : 127);   /* 126: this binary is not one the kernel runs (under qemu-user) */
}
static int run_pool_spin_with_250(void) { return run_in_child(child_runs_pool_spin_with_250); }
#else
static int run_pool_spin_with_250(void) {   /* CreateProcess of this program, which inherits the variable */
    char exe[MAX_PATH], cmd[MAX_PATH + 32];
    STARTUPINFOA si;
    PROCESS_INFORMATION pi;
    SECURITY_ATTRIBUTES sa;
    HANDLE null;
    DWORD code = (DWORD)-1;
    if (!GetModuleFileNameA(NULL, exe, sizeof exe)) return -1;
    snprintf(cmd, sizeof cmd, "\"%s\" pool_spin", exe);
    memset(&sa, 0, sizeof sa);
    sa.nLength = sizeof sa;
    sa.bInheritHandle = TRUE;
    null = CreateFileA("NUL", GENERIC_WRITE, FILE_SHARE_READ | FILE_SHARE_WRITE, &sa, OPEN_EXISTING, 0, NULL);
    memset(&si, 0, sizeof si);
    si.cb = sizeof si;
    if (null != INVALID_HANDLE_VALUE) {
        si.dwFlags = STARTF_USESTDHANDLES;
        si.hStdInput = GetStdHandle(STD_INPUT_HANDLE);
        si.hStdOutput = si.hStdError = null;
    }
    fflush(stdout);
    test_setenv("MGPU_CPU_SPIN_US", "250");
    if (CreateProcessA(exe, cmd, NULL, NULL, TRUE, 0, NULL, NULL, &si, &pi)) {
        if (WaitForSingleObject(pi.hProcess, 60000) != WAIT_OBJECT_0) {   /* hung: as the alarm on POSIX */
            TerminateProcess(pi.hProcess, 142);
            WaitForSingleObject(pi.hProcess, INFINITE);
        }
        if (!GetExitCodeProcess(pi.hProcess, &code)) code = (DWORD)-1;
        CloseHandle(pi.hThread);
        CloseHandle(pi.hProcess);
    }
    test_unsetenv("MGPU_CPU_SPIN_US");
    if (null != INVALID_HANDLE_VALUE) CloseHandle(null);
    return (int)code;
}
#endif
static void test_pool_spin(void) {
    const int saved = mgpu_cpu_threads();
    const char* env = getenv("MGPU_CPU_SPIN_US");
    double saved_spin;
    uint64_t passive, active;
    header("pool spin");
    mgpu_cpu_set_threads(2);
    mgpu__parallel_for(2, spin_task, NULL);   /* the pool started, MGPU_CPU_SPIN_US read */
    mgpu__mutex_lock(&mgpu__the_pool.lock);
    saved_spin = mgpu__pool_spin;
    mgpu__mutex_unlock(&mgpu__the_pool.lock);
    if (env) {   /* the run below: the variable reached the pool */
        CHECK(fabs(saved_spin - mgpu__pool_spin_from_env()) <= 1e-15, "MGPU_CPU_SPIN_US=%s: the pool spins %g s", env,
              saved_spin);
    } else {
        int rc;
        CHECK(fabs(saved_spin - 1e-3) <= 1e-15, "default spin %g s, want 1e-3", saved_spin);
        /* this group again in a fresh process, with the variable set: it must reach the pool */
        rc = run_pool_spin_with_250();
        /* qemu-user without binfmt_misc: the kernel cannot run the guest binary that
           /proc/self/exe names (ENOEXEC); tests/aarch64.sh runs that line under qemu itself */
        if (under_qemu() && rc == 126)
            SKIP("MGPU_CPU_SPIN_US=250 test_core pool_spin: qemu-user cannot exec this aarch64 binary again (no binfmt_misc); tests/aarch64.sh runs it");
        else
            CHECK(rc == 0, "MGPU_CPU_SPIN_US=250 test_core pool_spin: exit %d (run it to see why)", rc);
    }
    passive = worker_sleeps_in_20_jobs(0.0);
    active = worker_sleeps_in_20_jobs(0.2);
    CHECK(passive >= 5, "spin 0: the worker slept %llu times in 20 jobs, want about 20", (unsigned long long)passive);
    CHECK(active <= 1, "spin 0.2 s: the worker slept %llu times in 20 back-to-back jobs, want 0", (unsigned long long)active);
    mgpu__mutex_lock(&mgpu__the_pool.lock);
    mgpu__pool_spin = saved_spin;
    mgpu__mutex_unlock(&mgpu__the_pool.lock);
    {   /* the variable read: whole microseconds, 0 to a second (beyond: the nearest end, with a
           warning); what is no such number warns and gives 1 ms (tests/test_settings.c has all forms) */
        static const struct { const char* text; double seconds; int warns; } cases[] = {
            { "0", 0.0, 0 }, { "250", 250e-6, 0 }, { "5000000", 1.0, 1 }, { "", 1e-3, 0 }, { "fast", 1e-3, 1 },
            { "-3", 0.0, 1 }, { "12us", 1e-3, 1 }, { "0.5", 1e-3, 1 }, { "99999999999999999999999", 1.0, 1 } };
        char* kept = env ? strdup(env) : NULL;
        log_capture cap;
        size_t i;
        mgpu_log_set_callback(capture_log, &cap);
        for (i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
            double got;
            memset(&cap, 0, sizeof cap);
            test_setenv("MGPU_CPU_SPIN_US", cases[i].text);
            got = mgpu__pool_spin_from_env();
            CHECK(fabs(got - cases[i].seconds) <= 1e-15, "MGPU_CPU_SPIN_US='%s': %g s, want %g", cases[i].text, got,
                  cases[i].seconds);
            CHECK(cap.calls == cases[i].warns && (!cap.calls || (cap.level == MGPU_LOG_WARN && strstr(cap.last, cases[i].text) &&
                                                                 strstr(cap.last, "MGPU_CPU_SPIN_US"))),
                  "MGPU_CPU_SPIN_US='%s': %d warning(s) \"%s\", want %d", cases[i].text, cap.calls, cap.last, cases[i].warns);
        }
        mgpu_log_set_callback(NULL, NULL);
        if (kept) test_setenv("MGPU_CPU_SPIN_US", kept);
        else test_unsetenv("MGPU_CPU_SPIN_US");
        free(kept);
    }
    mgpu_cpu_set_threads(saved);
}
#endif

/* ============================================================================================ */
/* ============================================================================================ */
/* errors named at their source (issue 37)                                                      */
/* ============================================================================================ */
#ifdef MGPU_CUDA
/* A custom layer whose forward launches a kernel that cannot start (2048 threads a block) and
   forgets mgpu_cuda_end's check: y = x, then the bad launch. */
static mgpu_result badlaunch_forward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, mgpu_tensor* y) {
    void* stream;
    mgpu_result r;
    (void)l;
    if ((r = mgpu_tensor_copy(y, x)) != MGPU_OK || (r = mgpu_cuda_begin(ctx->device, &stream)) != MGPU_OK) return r;
    test_sin_launch(stream, (const float*)mgpu_tensor_data(x), (float*)mgpu_tensor_data(y), (size_t)mgpu_tensor_numel(x), 1.0f, 1, 2048);
    return MGPU_OK;
}
static mgpu_result badlaunch_backward(const mgpu_layer* l, const mgpu_layer_ctx* ctx, const mgpu_tensor* x, const mgpu_tensor* y,
                                      const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)ctx; (void)x; (void)y;
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static const mgpu_layer_vtable badlaunch_vt = {
    "BadLaunch", NULL, NULL, NULL, NULL, NULL, NULL, badlaunch_forward, badlaunch_backward, NULL, NULL, NULL, NULL
};
#endif

/* A kernel of the program's own that failed to launch and was not checked with mgpu_cuda_end is
   reported as such by the next mgpu call (not as a failure of that call's own launch), which
   clears it; inside a step, as the custom layer's error, naming it. */
static void test_error_sources(void) {
    header("errors named at their source");
    if (!test_gpu_group("errors named at their source", g_gpu != NULL)) return;
#ifdef MGPU_CUDA
    {
        mgpu_tensor* t = tmake(g_gpu, MGPU_F32, mgpu_shape1(8));
        void* stream = NULL;
        mgpu_layer* layers[2];
        mgpu_model_desc md;
        mgpu_model* m;
        MUST(mgpu_cuda_begin(g_gpu, &stream));
        test_sin_launch(stream, (const float*)mgpu_tensor_data(t), (float*)mgpu_tensor_data(t), 8, 1.0f, 1, 2048);
        expect_fail(mgpu_tensor_fill(t, 1.0), MGPU_ERROR_CUDA, "mgpu_tensor_fill after an unchecked bad launch", "left pending by earlier work",
                    "mgpu_cuda_end", NULL);
        expect_launch_error("mgpu_tensor_fill after an unchecked bad launch");
        CHECK(!strstr(mgpu_last_error(), "launch of fill"), "blamed on mgpu's fill: %s", mgpu_last_error());
        MUST(mgpu_tensor_fill(t, 1.0));   /* cleared */
        MUST(mgpu_cuda_begin(g_gpu, &stream));
        test_sin_launch(stream, (const float*)mgpu_tensor_data(t), (float*)mgpu_tensor_data(t), 8, 1.0f, 1, 2048);
        expect_fail(mgpu_cuda_begin(g_gpu, &stream), MGPU_ERROR_CUDA, "mgpu_cuda_begin after an unchecked bad launch", "mgpu_cuda_begin",
                    "left pending by earlier work", NULL);
        expect_launch_error("mgpu_cuda_begin after an unchecked bad launch");
        MUST(mgpu_cuda_begin(g_gpu, &stream));
        MUST(mgpu_cuda_end(g_gpu, "nothing"));
        /* in a step: the custom layer's error */
        memset(&md, 0, sizeof md);
        layers[0] = mgpu_layer_linear(4, 4);
        layers[1] = mgpu_layer_create(&badlaunch_vt, NULL);
        md.input = mgpu_shape1(4);
        md.layers = layers;
        md.layer_count = 2;
        md.devices = g_gpu_set;
        md.loss = MGPU_LOSS_MSE;
        md.seed = 1;
        m = mgpu_model_create(&md);
        CHECK(m != NULL, "a model with BadLaunch: %s", mgpu_last_error());
        if (m) {
            mgpu_optimizer* opt = mgpu_optimizer_create(m, NULL);
            mgpu_tensor* x = tmake(g_gpu, MGPU_F32, mgpu_shape2(2, 4));
            mgpu_tensor* y = tmake(g_gpu, MGPU_F32, mgpu_shape2(2, 4));
            MUST(mgpu_tensor_fill(x, 0.5));
            MUST(mgpu_tensor_fill(y, 0.25));
            expect_fail(opt ? mgpu_model_train_step(m, opt, x, y, NULL) : MGPU_OK, MGPU_ERROR_CUDA, "a step whose custom layer launched badly",
                        "layer 1 (BadLaunch)", "left pending by earlier work", NULL);
            expect_launch_error("a step whose custom layer launched badly");
            MUST(mgpu_tensor_fill(x, 0.5));   /* nothing left pending */
            mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
            mgpu_optimizer_destroy(opt);
            mgpu_model_destroy(m);
        }
        mgpu_tensor_destroy(t);
    }
#endif
}

int main(int argc, char** argv) {
    double t0 = test_start("test_core");
    test_select(argc, argv);
    printf("test_core: mgpu %s, seed %llu (MGPU_TEST_SEED to repeat)%s, %d CPU threads\n", MGPU_VERSION_STRING,
           (unsigned long long)g_test_seed, g_quick ? ", quick sizes" : "", mgpu_cpu_threads());

    g_devs[g_ndev++] = mgpu_device_cpu();
#ifdef MGPU_CUDA
    if (mgpu_cuda_device_count() > 0) {
        g_gpu_set = mgpu_device_set_create("cuda:0");
        CHECK(g_gpu_set != NULL, "mgpu_device_set_create(\"cuda:0\") with %d GPUs: %s", mgpu_cuda_device_count(),
              mgpu_last_error());
        if (g_gpu_set) g_gpu = g_devs[g_ndev++] = mgpu_device_set_get(g_gpu_set, 0);
    }
    printf("built with CUDA: %d GPU(s)%s\n", mgpu_cuda_device_count(), g_gpu ? ", testing cuda:0" : "");
#else
    printf("built without CUDA\n");
#endif

    TEST_GROUP(test_results());
    TEST_GROUP(test_devices());
    TEST_GROUP(test_memory());
    TEST_GROUP(test_tensors());
    TEST_GROUP(test_bf16());
    TEST_GROUP(test_random());
    TEST_GROUP(test_fast_math());
    TEST_GROUP(test_elementwise());
    TEST_GROUP(test_matmul());
    TEST_GROUP(test_bias_reduce());
    TEST_GROUP(test_softmax_losses());
    TEST_GROUP(test_views_in_ops());
    TEST_GROUP(test_op_errors());
    TEST_GROUP(test_own_kernels());
    TEST_GROUP(test_hostile_sizes());
    TEST_GROUP(test_threads());
    TEST_GROUP(test_concurrency());
#ifndef MGPU_NO_THREADS
    TEST_GROUP(test_fork());
    TEST_GROUP(test_pool_spin());
#endif
    TEST_GROUP(test_error_sources());

    mgpu_device_set_destroy(g_gpu_set);
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_core");
}
