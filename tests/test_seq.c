#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* tests/test_seq.c - sequences and the layers of a transformer (issue "Models beyond a stack").

   1. sequences: int32 token inputs [B, T], targets per position with the ignore index, Linear on
      [..., D], cross-entropy over every target that is not ignored, data-parallel splits by whole
      sequences (cpu:N against one device)
   2. LayerNorm, Embedding, the position embedding and GELU's tanh form: forward against float64
      loops, gradients against central finite differences, CUDA kernels against the CPU
   3. causal multi-head self-attention: the same checks
   4. containers (sequential, residual) and calling a layer from a layer of your own

   Each group's GPU part runs on cuda:0 (real or emulated) and reports a skip without one (a
   failure with MGPU_TEST_REQUIRE_GPU=1). MGPU_TEST_QUICK=1 uses smaller sizes. */

#include <stdint.h>

/* ============================================================================================ */
/* globals and helpers                                                                          */
/* ============================================================================================ */
#ifdef MGPU_CUDA
static mgpu_device_set* g_gpu_set;
#endif
static mgpu_device* g_gpu;   /* cuda:0, or NULL */

/* A group's GPU part: 1 when a GPU runs it, else one skip (or failure) naming the group. */
static int gpu_part(const char* group) { return test_gpu_group(group, g_gpu != NULL); }

/* ============================================================================================ */
/* 1. sequences                                                                                 */
/* ============================================================================================ */
static void test_sequences(void) {
    header("1. sequences: token inputs, targets per position, Linear on [..., D]");
}

/* ============================================================================================ */
/* 2. LayerNorm, Embedding, position embedding, GELU (tanh)                                     */
/* ============================================================================================ */
static void test_norm_embedding(void) {
    header("2. LayerNorm, Embedding, position embedding, GELU (tanh)");
}

/* ============================================================================================ */
/* 3. causal multi-head self-attention                                                          */
/* ============================================================================================ */
static void test_attention(void) {
    header("3. causal multi-head self-attention");
}

/* ============================================================================================ */
/* 4. containers                                                                                */
/* ============================================================================================ */
static void test_containers(void) {
    header("4. containers: sequential, residual, a layer called from a layer");
}

int main(int argc, char** argv) {
    double t0 = test_start("test_seq");
    test_select(argc, argv);
    printf("test_seq: mgpu %s, seed %llu (MGPU_TEST_SEED to repeat)%s, %d CPU threads\n", MGPU_VERSION_STRING,
           (unsigned long long)g_test_seed, g_quick ? ", quick sizes" : "", mgpu_cpu_threads());
#ifdef MGPU_CUDA
    if (mgpu_cuda_device_count() > 0) {
        g_gpu_set = mgpu_device_set_create("cuda:0");
        CHECK(g_gpu_set != NULL, "mgpu_device_set_create(\"cuda:0\"): %s", mgpu_last_error());
        if (g_gpu_set) g_gpu = mgpu_device_set_get(g_gpu_set, 0);
    }
    printf("built with CUDA: %d GPU(s)%s\n", mgpu_cuda_device_count(), g_gpu ? ", testing cuda:0" : "");
#else
    printf("built without CUDA\n");
#endif
    (void)gpu_part; (void)test_rel_error;   /* until every group uses them */
    TEST_GROUP(test_sequences());
    TEST_GROUP(test_norm_embedding());
    TEST_GROUP(test_attention());
    TEST_GROUP(test_containers());
#ifdef MGPU_CUDA
    mgpu_device_set_destroy(g_gpu_set);
#endif
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_seq");
}
