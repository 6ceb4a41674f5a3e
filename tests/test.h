/* tests/test.h - the smallest test harness that does the job.
   CHECK(cond, fmt, ...) records a pass or a failure (with file:line and a message);
   SKIP(fmt, ...) records a skip with its reason; test_summary() prints the last line
   "N passed, N failed, N skipped" and returns the exit status. */
#ifndef MGPU_TEST_H
#define MGPU_TEST_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

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

static int test_summary(const char* name) {
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
#endif
