/* tests/test_misuse.c - the public API misused (issue 12): every wrong call fails with an error
   code and a last error naming the operation, and never crashes.
     nulls      NULL for every handle of every public function
     indices    out-of-range replicas, tensors, dimensions, devices, file entries
     shapes     shapes whose element or byte count overflows: an error, no allocation attempt
     lifetimes  destroying what something still uses (LIFETIMES in mgpu.h): refused, nothing
                changed, and it works once the users are gone; layers shared or repeated
     owned      tensors the library owns refuse mgpu_tensor_destroy
     double_destroy  handles destroyed twice, or used by a create or a training step after their
                destroy, refused
     devices    tensors of two CPU devices of a set given to one op or to a replica: refused as
                two GPUs' are, with the same message
     long_inputs  a 100 kB device spec, a 5,000-byte path, a long warning: the message (1,024
                bytes) loses the middle of the input, never its reason at the end; more than 256
                devices say the limit
     trace_files  traces to a folder, a missing folder, /dev/full, a FIFO, a symlink: refused at
                once, nothing changed, the trace kept for a retry
   Usage: build/test_misuse [GROUP] */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

/* The call failed (r != MGPU_OK) and the last error is set and names `op`. */
static int failed_naming(mgpu_result r, const char* op) {
    return r != MGPU_OK && mgpu_last_result() != MGPU_OK && strstr(mgpu_last_error(), op) != NULL;
}
/* A handle-returning call gave NULL and the last error names `op`. */
static int null_naming(const void* p, const char* op) {
    return p == NULL && mgpu_last_result() != MGPU_OK && strstr(mgpu_last_error(), op) != NULL;
}
#define EXPECT_FAIL(call, op)                                                                         \
    do {                                                                                              \
        mgpu_result r_;                                                                               \
        mgpu_clear_error();                                                                           \
        r_ = (call);                                                                                  \
        CHECK(failed_naming(r_, op), "%s: got %s, last error '%s'", #call, mgpu_result_string(r_), mgpu_last_error()); \
    } while (0)
#define EXPECT_NULL(call, op)                                                                         \
    do {                                                                                              \
        const void* p_;                                                                               \
        mgpu_clear_error();                                                                           \
        p_ = (const void*)(call);                                                                     \
        CHECK(null_naming(p_, op), "%s: got %p, last error '%s'", #call, p_, mgpu_last_error());     \
    } while (0)

static mgpu_model* small_model(const mgpu_device_set* set) {
    mgpu_layer* layers[3];
    mgpu_model_desc d;
    memset(&d, 0, sizeof d);
    layers[0] = mgpu_layer_linear(4, 8);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(8, 3);
    d.input = mgpu_shape1(4);
    d.layers = layers;
    d.layer_count = 3;
    d.devices = set;
    d.seed = 1;
    return mgpu_model_create(&d);
}

static void test_nulls(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tensor* t = mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape2(2, 3));
    mgpu_tensor* lab = mgpu_tensor_create(cpu, MGPU_I32, mgpu_shape1(2));
    mgpu_device_info info;
    mgpu_memory_stats stats;
    mgpu_safetensors_info sinfo;
    float f[6] = { 0 }, loss = 0;
    int64_t count = 0;
    const mgpu_tensor *bx = NULL, *by = NULL;
    header("nulls");
    if (!t || !lab) { CHECK(0, "tensors: %s", mgpu_last_error()); return; }
    /* destroying NULL does nothing */
    CHECK(mgpu_device_set_destroy(NULL) == MGPU_OK, "set_destroy(NULL)");
    CHECK(mgpu_tensor_destroy(NULL) == MGPU_OK, "tensor_destroy(NULL)");
    CHECK(mgpu_layer_destroy(NULL) == MGPU_OK, "layer_destroy(NULL)");
    CHECK(mgpu_model_destroy(NULL) == MGPU_OK, "model_destroy(NULL)");
    CHECK(mgpu_dataset_destroy(NULL) == MGPU_OK, "dataset_destroy(NULL)");
    mgpu_optimizer_destroy(NULL);
    mgpu_loader_destroy(NULL);
    mgpu_allreduce_destroy(NULL);
    mgpu_safetensors_close(NULL);
    mgpu_pinned_free(NULL);
    /* devices */
    CHECK(mgpu_device_set_count(NULL) == 0, "set_count(NULL)");
    EXPECT_NULL(mgpu_device_set_get(NULL, 0), "mgpu_device_set_get");
    CHECK(mgpu_device_set_spec(NULL) != NULL, "set_spec(NULL) is a string");
    EXPECT_FAIL(mgpu_device_get_info(NULL, &info), "mgpu_device_get_info");
    EXPECT_FAIL(mgpu_device_get_info(cpu, NULL), "mgpu_device_get_info");
    CHECK(mgpu_device_label(NULL) != NULL, "device_label(NULL) is a string");
    CHECK(mgpu_device_can_access_peer(NULL, cpu) == 0, "can_access_peer(NULL)");
    EXPECT_FAIL(mgpu_device_synchronize(NULL), "mgpu_device_synchronize");
    EXPECT_FAIL(mgpu_device_allow_tf32(NULL, 1), "mgpu_device_allow_tf32");
    EXPECT_FAIL(mgpu_memory_get_stats(NULL, &stats), "mgpu_memory_get_stats");
    EXPECT_FAIL(mgpu_memory_get_stats(cpu, NULL), "mgpu_memory_get_stats");
    mgpu_memory_reset_peak(NULL);
    EXPECT_FAIL(mgpu_memory_empty_cache(NULL), "mgpu_memory_empty_cache");
    /* tensors */
    EXPECT_NULL(mgpu_tensor_create(NULL, MGPU_F32, mgpu_shape1(1)), "mgpu_tensor_create");
    EXPECT_NULL(mgpu_tensor_view_rows(NULL, 0, 1), "mgpu_tensor_view_rows");
    EXPECT_NULL(mgpu_tensor_view_reshape(NULL, mgpu_shape1(1)), "mgpu_tensor_view_reshape");
    CHECK(mgpu_tensor_shape(NULL).ndim == 0, "tensor_shape(NULL)");
    CHECK(mgpu_tensor_numel(NULL) == 0, "tensor_numel(NULL)");
    CHECK(mgpu_tensor_bytes(NULL) == 0, "tensor_bytes(NULL)");
    CHECK(mgpu_tensor_device(NULL) == NULL, "tensor_device(NULL)");
    CHECK(mgpu_tensor_data(NULL) == NULL, "tensor_data(NULL)");
    {
        char buf[64];
        CHECK(strcmp(mgpu_tensor_describe(NULL, buf, sizeof buf), "(null)") == 0, "describe(NULL)");
        CHECK(mgpu_tensor_describe(t, NULL, 10) != NULL, "describe into NULL");
    }
    EXPECT_FAIL(mgpu_tensor_upload(NULL, f, sizeof f), "mgpu_tensor_upload");
    EXPECT_FAIL(mgpu_tensor_upload(t, NULL, 24), "mgpu_tensor_upload");
    EXPECT_FAIL(mgpu_tensor_download(NULL, f, sizeof f), "mgpu_tensor_download");
    EXPECT_FAIL(mgpu_tensor_download(t, NULL, 24), "mgpu_tensor_download");
    EXPECT_FAIL(mgpu_tensor_copy(NULL, t), "mgpu_tensor_copy");
    EXPECT_FAIL(mgpu_tensor_copy(t, NULL), "mgpu_tensor_copy");
    EXPECT_NULL(mgpu_tensor_to(NULL, cpu), "mgpu_tensor_to");
    EXPECT_NULL(mgpu_tensor_to(t, NULL), "mgpu_tensor_to");
    EXPECT_FAIL(mgpu_tensor_fill(NULL, 1.0), "mgpu_tensor_fill");
    EXPECT_FAIL(mgpu_tensor_zero(NULL), "mgpu_tensor_fill");
    EXPECT_FAIL(mgpu_tensor_convert(NULL, t, 1, 0), "mgpu_tensor_convert");
    EXPECT_FAIL(mgpu_tensor_convert(t, NULL, 1, 0), "mgpu_tensor_convert");
    EXPECT_FAIL(mgpu_rand_uniform(NULL, 1, 0, 0, 1), "mgpu_rand_uniform");
    EXPECT_FAIL(mgpu_rand_normal(NULL, 1, 0, 0, 1), "mgpu_rand_normal");
    /* ops: NULL in each position */
    EXPECT_FAIL(mgpu_add(NULL, t, t), "mgpu_add");
    EXPECT_FAIL(mgpu_add(t, NULL, t), "mgpu_add");
    EXPECT_FAIL(mgpu_add(t, t, NULL), "mgpu_add");
    EXPECT_FAIL(mgpu_sub(t, NULL, t), "mgpu_sub");
    EXPECT_FAIL(mgpu_mul(t, t, NULL), "mgpu_mul");
    EXPECT_FAIL(mgpu_scale(NULL, t, 2), "mgpu_scale");
    EXPECT_FAIL(mgpu_scale(t, NULL, 2), "mgpu_scale");
    EXPECT_FAIL(mgpu_axpy(NULL, 2, t), "mgpu_axpy");
    EXPECT_FAIL(mgpu_axpy(t, 2, NULL), "mgpu_axpy");
    EXPECT_FAIL(mgpu_relu(NULL, t), "mgpu_relu");
    EXPECT_FAIL(mgpu_gelu(t, NULL), "mgpu_gelu");
    EXPECT_FAIL(mgpu_tanh(NULL, t), "mgpu_tanh");
    EXPECT_FAIL(mgpu_sigmoid(t, NULL), "mgpu_sigmoid");
    EXPECT_FAIL(mgpu_relu_backward(NULL, t, t), "mgpu_relu_backward");
    EXPECT_FAIL(mgpu_gelu_backward(t, NULL, t), "mgpu_gelu_backward");
    EXPECT_FAIL(mgpu_tanh_backward(t, t, NULL), "mgpu_tanh_backward");
    EXPECT_FAIL(mgpu_sigmoid_backward(NULL, t, t), "mgpu_sigmoid_backward");
    EXPECT_FAIL(mgpu_matmul(NULL, t, t, MGPU_NO_TRANS, MGPU_TRANS, 1, 0), "mgpu_matmul");
    EXPECT_FAIL(mgpu_matmul(t, NULL, t, MGPU_NO_TRANS, MGPU_TRANS, 1, 0), "mgpu_matmul");
    EXPECT_FAIL(mgpu_matmul(t, t, NULL, MGPU_NO_TRANS, MGPU_TRANS, 1, 0), "mgpu_matmul");
    EXPECT_FAIL(mgpu_bias_add(NULL, t, t), "mgpu_bias_add");
    EXPECT_FAIL(mgpu_bias_add(t, t, NULL), "mgpu_bias_add");
    EXPECT_FAIL(mgpu_bias_backward(NULL, t), "mgpu_bias_backward");
    EXPECT_FAIL(mgpu_bias_backward(t, NULL), "mgpu_bias_backward");
    EXPECT_FAIL(mgpu_sum(NULL, t, 0), "mgpu_sum");
    EXPECT_FAIL(mgpu_mean(t, NULL, 0), "mgpu_mean");
    EXPECT_FAIL(mgpu_softmax(NULL, t), "mgpu_softmax");
    EXPECT_FAIL(mgpu_softmax_cross_entropy(NULL, NULL, t, lab, 0), "mgpu_softmax_cross_entropy");
    EXPECT_FAIL(mgpu_softmax_cross_entropy(t, NULL, NULL, lab, 0), "mgpu_softmax_cross_entropy");
    EXPECT_FAIL(mgpu_softmax_cross_entropy(t, NULL, t, NULL, 0), "mgpu_softmax_cross_entropy");
    EXPECT_FAIL(mgpu_mse(NULL, NULL, t, t, 0), "mgpu_mse");
    EXPECT_FAIL(mgpu_mse(t, NULL, NULL, t, 0), "mgpu_mse");
    EXPECT_FAIL(mgpu_argmax(NULL, t), "mgpu_argmax");
    EXPECT_FAIL(mgpu_argmax(lab, NULL), "mgpu_argmax");
    EXPECT_FAIL(mgpu_count_correct(NULL, lab, &count), "mgpu_count_correct");
    EXPECT_FAIL(mgpu_count_correct(t, NULL, &count), "mgpu_count_correct");
    EXPECT_FAIL(mgpu_count_correct(t, lab, NULL), "mgpu_count_correct");
    EXPECT_FAIL(mgpu_dropout(NULL, t, t, 0.5f, 1, 0), "mgpu_dropout");
    EXPECT_FAIL(mgpu_dropout(t, t, NULL, 0.5f, 1, 0), "mgpu_dropout");
    /* kernels of your own */
    EXPECT_FAIL(mgpu_tensor_check("my_op", "x", NULL, MGPU_F32, NULL, NULL), "my_op");
    EXPECT_FAIL(mgpu_tensor_check(NULL, NULL, NULL, MGPU_F32, NULL, NULL), "mgpu_tensor_check");
    EXPECT_FAIL(mgpu_tensor_check("my_op", "y", t, MGPU_F32, "x", lab), "my_op");   /* shapes differ */
    EXPECT_FAIL(mgpu_cpu_parallel(NULL, 6, 0, NULL, NULL), "mgpu_cpu_parallel");
    EXPECT_FAIL(mgpu_cpu_parallel(cpu, 6, 0, NULL, NULL), "mgpu_cpu_parallel");
    EXPECT_FAIL(mgpu_cuda_begin(NULL, NULL), "mgpu_cuda_begin");
    EXPECT_FAIL(mgpu_cuda_begin(cpu, NULL), "mgpu_cuda_begin");
    EXPECT_FAIL(mgpu_cuda_end(NULL, NULL), "mgpu_cuda_end");
    EXPECT_FAIL(mgpu_cuda_end(cpu, NULL), "mgpu_cuda_end");
    /* layers */
    EXPECT_NULL(mgpu_layer_create(NULL, NULL), "mgpu_layer_create");
    CHECK(mgpu_layer_user_data(NULL) == NULL, "layer_user_data(NULL)");
    CHECK(mgpu_layer_type(NULL) != NULL, "layer_type(NULL) is a string");
    EXPECT_NULL(mgpu_layer_sequential(NULL, 2), "mgpu_layer_sequential");
    EXPECT_NULL(mgpu_layer_residual(NULL, NULL), "mgpu_layer_residual");
    EXPECT_NULL(mgpu_layer_name(mgpu_layer_relu(), NULL), "mgpu_layer_name");   /* (the layer is freed: ASan) */
    CHECK(mgpu_layer_name(NULL, "a") == NULL, "layer_name(NULL layer) is NULL");
    EXPECT_FAIL(mgpu_layer_forward(NULL, NULL, t, t), "mgpu_layer_forward");
    EXPECT_FAIL(mgpu_layer_backward(NULL, NULL, t, t, t, t), "mgpu_layer_backward");
    CHECK(mgpu_fail(MGPU_ERROR_IO, NULL) == MGPU_ERROR_IO && mgpu_last_result() == MGPU_ERROR_IO, "mgpu_fail(r, NULL) records r");
    /* all-reduce */
    EXPECT_NULL(mgpu_allreduce_create(NULL, MGPU_ALLREDUCE_AUTO), "mgpu_allreduce_create");
    CHECK(mgpu_allreduce_backend(NULL) == MGPU_ALLREDUCE_NONE, "allreduce_backend(NULL)");
    CHECK(mgpu_allreduce_algorithm(NULL, 16) != NULL, "allreduce_algorithm(NULL) is a string");
    CHECK(mgpu_allreduce_memory_traffic(NULL, 16) == 0.0, "allreduce_memory_traffic(NULL)");
    EXPECT_FAIL(mgpu_allreduce_sum(NULL, &t, 1), "mgpu_allreduce_sum");
    /* models */
    EXPECT_NULL(mgpu_model_create(NULL), "mgpu_model_create");
    CHECK(mgpu_model_replica_count(NULL) == 0, "replica_count(NULL)");
    EXPECT_NULL(mgpu_model_device(NULL, 0), "mgpu_model_device");
    CHECK(mgpu_model_param_count(NULL) == 0, "param_count(NULL)");
    CHECK(mgpu_model_allreduce_backend(NULL) == MGPU_ALLREDUCE_NONE, "model_allreduce_backend(NULL)");
    CHECK(mgpu_model_bucket_count(NULL) == 0, "bucket_count(NULL)");
    EXPECT_NULL(mgpu_model_params(NULL, 0), "mgpu_model_params");
    EXPECT_NULL(mgpu_model_grads(NULL, 0), "mgpu_model_grads");
    CHECK(mgpu_model_tensor_count(NULL) == 0, "tensor_count(NULL)");
    EXPECT_NULL(mgpu_model_tensor_name(NULL, 0), "mgpu_model_tensor_name");
    EXPECT_NULL(mgpu_model_tensor(NULL, 0, 0), "mgpu_model_tensor");
    mgpu_model_summary(NULL, NULL);
    EXPECT_NULL(mgpu_model_param(NULL, 0, "0.weight"), "mgpu_model_param");
    EXPECT_NULL(mgpu_model_grad(NULL, 0, "0.weight"), "mgpu_model_grad");
    EXPECT_NULL(mgpu_optimizer_create(NULL, NULL), "mgpu_optimizer_create");
    EXPECT_FAIL(mgpu_optimizer_step(NULL), "mgpu_optimizer_step");
    CHECK(mgpu_optimizer_lr(NULL) == 0.0f, "optimizer_lr(NULL)");
    CHECK(mgpu_optimizer_step_count(NULL) == 0, "optimizer_step_count(NULL)");
    EXPECT_NULL(mgpu_optimizer_state(NULL, 0, "0.weight", "momentum_buffer"), "mgpu_optimizer_state");
    EXPECT_FAIL(mgpu_optimizer_reset(NULL), "mgpu_optimizer_reset");
    EXPECT_FAIL(mgpu_optimizer_last_grad_norm(NULL, NULL), "mgpu_optimizer_last_grad_norm");
    EXPECT_FAIL(mgpu_model_train_step(NULL, NULL, t, lab, &loss), "mgpu_model_train_step");
    EXPECT_FAIL(mgpu_model_accumulate(NULL, t, lab, 0, &loss), "mgpu_model_accumulate");
    EXPECT_FAIL(mgpu_model_reduce_grads(NULL), "mgpu_model_reduce_grads");
    EXPECT_FAIL(mgpu_model_apply(NULL, NULL), "mgpu_model_apply");
    EXPECT_FAIL(mgpu_model_verify_replicas(NULL), "mgpu_model_verify_replicas");
    EXPECT_FAIL(mgpu_model_evaluate(NULL, t, lab, &loss, &count), "mgpu_model_evaluate");
    EXPECT_NULL(mgpu_model_forward(NULL, 0, t, 0), "mgpu_model_forward");
    EXPECT_FAIL(mgpu_model_backward(NULL, 0, t), "mgpu_model_backward");
    EXPECT_FAIL(mgpu_model_zero_grad(NULL), "mgpu_model_zero_grad");
    EXPECT_FAIL(mgpu_model_save(NULL, NULL, "/tmp/never.safetensors"), "mgpu_model_save");
    EXPECT_FAIL(mgpu_model_load(NULL, NULL, "/tmp/never.safetensors"), "mgpu_model_load");
    EXPECT_FAIL(mgpu_model_save_ex(NULL, NULL, "/tmp/never.safetensors", NULL), "mgpu_model_save");
    EXPECT_FAIL(mgpu_model_load_ex(NULL, NULL, "/tmp/never.safetensors", NULL), "mgpu_model_load");
    /* data */
    EXPECT_NULL(mgpu_dataset_load_idx(NULL, NULL), "mgpu_dataset_load_idx");
    EXPECT_NULL(mgpu_loader_create(NULL, NULL), "mgpu_loader_create");
    mgpu_loader_start(NULL, 0);
    CHECK(mgpu_loader_next(NULL, &bx, &by) == 0, "loader_next(NULL)");
    CHECK(mgpu_loader_batches(NULL) == 0, "loader_batches(NULL)");
    EXPECT_NULL(mgpu_tokens_load(NULL), "mgpu_tokens_load");
    EXPECT_NULL(mgpu_tokens_from_text(NULL), "mgpu_tokens_from_text");
    EXPECT_NULL(mgpu_tokens_from_memory(NULL, 4), "mgpu_tokens_from_memory");
    EXPECT_FAIL(mgpu_tokens_save(NULL, "/tmp/never.bin"), "mgpu_tokens_save");
    CHECK(mgpu_tokens_count(NULL) == 0 && mgpu_tokens_data(NULL) == NULL && mgpu_tokens_max_id(NULL) == -1, "tokens getters (NULL)");
    CHECK(mgpu_tokens_destroy(NULL) == MGPU_OK, "tokens_destroy(NULL)");
    CHECK(mgpu_tokens_to_text(NULL, 3, NULL, 0) == 0, "tokens_to_text(NULL)");
    EXPECT_NULL(mgpu_dataset_tokens(NULL, 4), "mgpu_dataset_tokens");
    EXPECT_NULL(mgpu_safetensors_open(NULL), "mgpu_safetensors_open");
    CHECK(mgpu_safetensors_count(NULL) == 0, "safetensors_count(NULL)");
    EXPECT_FAIL(mgpu_safetensors_get_info(NULL, 0, &sinfo), "mgpu_safetensors_get_info");
    CHECK(mgpu_safetensors_find(NULL, "x") == -1, "safetensors_find(NULL)");
    EXPECT_NULL(mgpu_safetensors_read(NULL, "x", cpu), "mgpu_safetensors_read");
    CHECK(mgpu_safetensors_metadata_count(NULL) == 0, "metadata_count(NULL)");
    CHECK(mgpu_safetensors_metadata_key(NULL, 0) == NULL, "metadata_key(NULL)");
    CHECK(mgpu_safetensors_metadata(NULL, "format") == NULL, "metadata(NULL)");
    mgpu_tensor_destroy(t);
    mgpu_tensor_destroy(lab);
}

/* NULLs inside otherwise good calls: a model's own arguments, a loader's outputs */
static void test_null_args(void) {
    mgpu_model* m = small_model(NULL);
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, NULL) : NULL;
    mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 4));
    mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(2));
    float loss;
    header("null_args");
    if (!m || !o || !x || !y) { CHECK(0, "setup: %s", mgpu_last_error()); goto done; }
    mgpu_tensor_zero(x);
    mgpu_tensor_zero(y);
    EXPECT_FAIL(mgpu_model_train_step(m, NULL, x, y, &loss), "mgpu_model_train_step");
    EXPECT_FAIL(mgpu_model_train_step(m, o, NULL, y, &loss), "mgpu_model_train_step");
    EXPECT_FAIL(mgpu_model_train_step(m, o, x, NULL, &loss), "mgpu_model_train_step");
    CHECK(mgpu_model_train_step(m, o, x, y, NULL) == MGPU_OK, "train_step with loss NULL: %s", mgpu_last_error());
    EXPECT_FAIL(mgpu_model_accumulate(m, NULL, y, 0, NULL), "mgpu_model_accumulate");
    EXPECT_FAIL(mgpu_model_evaluate(m, x, NULL, NULL, NULL), "mgpu_model_evaluate");
    EXPECT_FAIL(mgpu_model_apply(m, NULL), "mgpu_model_apply");
    EXPECT_NULL(mgpu_model_forward(m, 0, NULL, 0), "mgpu_model_forward");
    EXPECT_FAIL(mgpu_model_backward(m, 0, NULL), "mgpu_model_backward");
    EXPECT_FAIL(mgpu_model_save(m, o, NULL), "mgpu_model_save");
    EXPECT_FAIL(mgpu_model_load(m, o, NULL), "mgpu_model_load");
    EXPECT_NULL(mgpu_model_param(m, 0, NULL), "mgpu_model_param");
    EXPECT_NULL(mgpu_optimizer_state(o, 0, NULL, "momentum_buffer"), "mgpu_optimizer_state");
    EXPECT_NULL(mgpu_optimizer_state(o, 0, "0.weight", NULL), "mgpu_optimizer_state");
done:
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

static void test_indices(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu:2");
    mgpu_model* m = set ? small_model(set) : NULL;
    mgpu_optimizer* o = NULL;
    mgpu_tensor* t = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 3));
    header("indices");
    if (!set || !m || !t) { CHECK(0, "setup: %s", mgpu_last_error()); goto done; }
    o = mgpu_optimizer_create(m, NULL);
    EXPECT_NULL(mgpu_device_set_get(set, 2), "mgpu_device_set_get");
    EXPECT_NULL(mgpu_device_set_get(set, -1), "mgpu_device_set_get");
    EXPECT_NULL(mgpu_model_device(m, 2), "mgpu_model_device");
    EXPECT_NULL(mgpu_model_device(m, -1), "mgpu_model_device");
    EXPECT_NULL(mgpu_model_params(m, 5), "mgpu_model_params");
    EXPECT_NULL(mgpu_model_grads(m, -3), "mgpu_model_grads");
    EXPECT_NULL(mgpu_model_tensor_name(m, 4), "mgpu_model_tensor_name");
    EXPECT_NULL(mgpu_model_tensor_name(m, -1), "mgpu_model_tensor_name");
    EXPECT_NULL(mgpu_model_tensor(m, 0, 4), "mgpu_model_tensor");
    EXPECT_NULL(mgpu_model_tensor(m, 2, 0), "mgpu_model_tensor");
    EXPECT_NULL(mgpu_model_param(m, 0, "9.weight"), "mgpu_model_param");
    EXPECT_NULL(mgpu_model_grad(m, 7, "0.weight"), "mgpu_model_grad");
    EXPECT_NULL(mgpu_model_forward(m, 2, t, 0), "mgpu_model_forward");
    EXPECT_FAIL(mgpu_model_backward(m, -1, t), "mgpu_model_backward");
    if (o) {
        EXPECT_NULL(mgpu_optimizer_state(o, 2, "0.weight", "momentum_buffer"), "mgpu_optimizer_state");
        EXPECT_NULL(mgpu_optimizer_state(o, 0, "0.weight", "exp_avg"), "mgpu_optimizer_state");
    }
    CHECK(mgpu_tensor_dim(t, 0) == 2 && mgpu_tensor_dim(t, -1) == 3, "tensor_dim in range");
    mgpu_clear_error();
    CHECK(mgpu_tensor_dim(t, 2) == -1 && strstr(mgpu_last_error(), "mgpu_tensor_dim"), "tensor_dim(2): %s", mgpu_last_error());
    mgpu_clear_error();
    CHECK(mgpu_tensor_dim(t, -3) == -1 && strstr(mgpu_last_error(), "mgpu_tensor_dim"), "tensor_dim(-3): %s", mgpu_last_error());
    mgpu_clear_error();
    CHECK(mgpu_tensor_dim(t, 1 << 30) == -1, "tensor_dim(2^30)");
    EXPECT_NULL(mgpu_tensor_view_rows(t, 1, 2), "mgpu_tensor_view_rows");
    EXPECT_NULL(mgpu_tensor_view_rows(t, -1, 1), "mgpu_tensor_view_rows");
    EXPECT_NULL(mgpu_tensor_view_rows(t, INT64_MAX, INT64_MAX), "mgpu_tensor_view_rows");
    EXPECT_NULL(mgpu_tensor_view_reshape(t, mgpu_shape1(7)), "mgpu_tensor_view_reshape");
    EXPECT_FAIL(mgpu_tensor_upload(t, "abc", 3), "mgpu_tensor_upload");
    EXPECT_FAIL(mgpu_sum(t, t, 2), "mgpu_sum");
    EXPECT_FAIL(mgpu_mean(t, t, -1), "mgpu_mean");
    {   /* a safetensors file's entries */
        mgpu_safetensors* st;
        mgpu_safetensors_info info;
        char path[512];
        test_tmp_path(path, sizeof path, "mgpu_misuse_idx.safetensors");
        CHECK(mgpu_model_save(m, o, path) == MGPU_OK, "save: %s", mgpu_last_error());
        st = mgpu_safetensors_open(path);
        CHECK(st != NULL, "open: %s", mgpu_last_error());
        if (st) {
            int n = mgpu_safetensors_count(st);
            EXPECT_FAIL(mgpu_safetensors_get_info(st, n, &info), "mgpu_safetensors_get_info");
            EXPECT_FAIL(mgpu_safetensors_get_info(st, -1, &info), "mgpu_safetensors_get_info");
            EXPECT_FAIL(mgpu_safetensors_get_info(st, 0, NULL), "mgpu_safetensors_get_info");
            mgpu_clear_error();
            CHECK(mgpu_safetensors_find(st, "nope") == -1 && strstr(mgpu_last_error(), "nope"), "find: %s", mgpu_last_error());
            EXPECT_NULL(mgpu_safetensors_read(st, "nope", NULL), "mgpu_safetensors_read");
            EXPECT_NULL(mgpu_safetensors_read(st, NULL, NULL), "mgpu_safetensors_read");
            mgpu_clear_error();
            CHECK(mgpu_safetensors_metadata_key(st, 1000) == NULL, "metadata_key(1000)");
            CHECK(mgpu_safetensors_metadata_key(st, -1) == NULL, "metadata_key(-1)");
            CHECK(mgpu_safetensors_metadata(st, NULL) == NULL, "metadata(NULL key)");
            mgpu_safetensors_close(st);
        }
        remove(path);
    }
done:
    mgpu_tensor_destroy(t);
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

static void test_shapes(void) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_memory_stats before, after;
    mgpu_shape bad;
    header("shapes");
    CHECK(mgpu_shape_numel(mgpu_shape4(INT64_MAX, 2, 1, 1)) == -1, "numel overflow is -1");
    CHECK(mgpu_shape_numel(mgpu_shape2((int64_t)1 << 32, (int64_t)1 << 32)) == -1, "2^64 elements is -1");
    CHECK(mgpu_shape_numel(mgpu_shape2((int64_t)1 << 31, (int64_t)1 << 31)) == (int64_t)1 << 62, "2^62 elements fit");
    CHECK(mgpu_shape_numel(mgpu_shape2(-1, 4)) == -1, "negative dimension is -1");
    CHECK(mgpu_shape_numel(mgpu_shape2(0, INT64_MAX)) == 0, "a zero dimension is 0 elements");
    memset(&bad, 0, sizeof bad);
    bad.ndim = 5;
    CHECK(mgpu_shape_numel(bad) == -1, "5 dimensions is -1");
    bad.ndim = -1;
    CHECK(mgpu_shape_numel(bad) == -1, "-1 dimensions is -1");
    mgpu_memory_get_stats(cpu, &before);
    EXPECT_NULL(mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape4(INT64_MAX, 2, 1, 1)), "mgpu_tensor_create");
    EXPECT_NULL(mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape2((int64_t)1 << 32, (int64_t)1 << 32)), "mgpu_tensor_create");
    /* the element count fits int64 but the bytes do not fit size_t */
    EXPECT_NULL(mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape2((int64_t)1 << 31, (int64_t)1 << 31)), "mgpu_tensor_create");
    EXPECT_NULL(mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape1(-5)), "mgpu_tensor_create");
    EXPECT_NULL(mgpu_tensor_create(cpu, MGPU_F32, bad), "mgpu_tensor_create");
    EXPECT_NULL(mgpu_tensor_create(cpu, (mgpu_dtype)7, mgpu_shape1(1)), "mgpu_tensor_create");
    mgpu_memory_get_stats(cpu, &after);
    CHECK(after.backend_allocs == before.backend_allocs, "no allocation was attempted for impossible shapes");
    {   /* a model whose parameter count overflows fails at create, no allocation of a wrapped size */
        mgpu_layer* l = mgpu_layer_linear(1 << 30, 1 << 30);
        mgpu_model_desc d;
        mgpu_model* m;
        memset(&d, 0, sizeof d);
        d.input = mgpu_shape1(1 << 30);
        d.layers = &l;
        d.layer_count = 1;
        mgpu_clear_error();
        m = mgpu_model_create(&d);
        CHECK(m == NULL && mgpu_last_result() == MGPU_ERROR_OUT_OF_MEMORY, "a 2^60-parameter model: %s", mgpu_last_error());
        mgpu_model_destroy(m);
    }
    {   /* reshape to an overflowing shape */
        mgpu_tensor* t = mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape1(4));
        EXPECT_NULL(mgpu_tensor_view_reshape(t, mgpu_shape2(INT64_MAX, 4)), "mgpu_tensor_view_reshape");
        EXPECT_NULL(mgpu_tensor_view_reshape(t, mgpu_shape2(-2, -2)), "mgpu_tensor_view_reshape");
        mgpu_tensor_destroy(t);
    }
}

static int g_user_destroyed;
static mgpu_result ident_forward(const mgpu_layer* l, const mgpu_layer_ctx* c, const mgpu_tensor* x, mgpu_tensor* y) {
    (void)l; (void)c;
    return mgpu_tensor_copy(y, x);
}
static mgpu_result ident_backward(const mgpu_layer* l, const mgpu_layer_ctx* c, const mgpu_tensor* x, const mgpu_tensor* y,
                                  const mgpu_tensor* dy, mgpu_tensor* dx) {
    (void)l; (void)c; (void)x; (void)y;
    return dx ? mgpu_tensor_copy(dx, dy) : MGPU_OK;
}
static void ident_destroy(mgpu_layer* l) { (void)l; g_user_destroyed++; }
static const mgpu_layer_vtable ident_vt = { "Identity", NULL, NULL, NULL, NULL, NULL, NULL, ident_forward, ident_backward, NULL, ident_destroy, NULL, NULL };

static void test_lifetimes(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu:2");
    mgpu_model* m = NULL;
    mgpu_optimizer* o = NULL;
    mgpu_tensor *t = NULL, *v = NULL;
    mgpu_allreduce* ar = NULL;
    header("lifetimes");
    if (!set) { CHECK(0, "set: %s", mgpu_last_error()); return; }
    /* a set with a tensor, a view, a model, an optimizer and a communicator on it */
    t = mgpu_tensor_create(mgpu_device_set_get(set, 1), MGPU_F32, mgpu_shape2(4, 4));
    v = t ? mgpu_tensor_view_rows(t, 1, 2) : NULL;
    m = small_model(set);
    o = m ? mgpu_optimizer_create(m, NULL) : NULL;
    ar = mgpu_allreduce_create(set, MGPU_ALLREDUCE_AUTO);
    if (!t || !v || !m || !o || !ar) { CHECK(0, "setup: %s", mgpu_last_error()); return; }
    mgpu_clear_error();
    CHECK(mgpu_device_set_destroy(set) == MGPU_ERROR_IN_USE, "set in use: refused");
    CHECK(strstr(mgpu_last_error(), "mgpu_device_set_destroy") && strstr(mgpu_last_error(), "1 model") &&
          strstr(mgpu_last_error(), "1 communicator") && strstr(mgpu_last_error(), "tensors"), "message: %s", mgpu_last_error());
    CHECK(mgpu_device_set_count(set) == 2 && mgpu_device_set_get(set, 0) != NULL, "the set still works");
    mgpu_clear_error();
    CHECK(mgpu_model_destroy(m) == MGPU_ERROR_IN_USE && strstr(mgpu_last_error(), "mgpu_model_destroy") &&
          strstr(mgpu_last_error(), "1 optimizer"), "model with an optimizer: %s", mgpu_last_error());
    {   /* both still work */
        mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(4, 4));
        mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(4));
        float loss = -1;
        mgpu_tensor_fill(x, 0.5);
        mgpu_tensor_zero(y);
        CHECK(mgpu_model_train_step(m, o, x, y, &loss) == MGPU_OK && loss > 0, "train after refusals: %s", mgpu_last_error());
        mgpu_tensor_destroy(x);
        mgpu_tensor_destroy(y);
    }
    mgpu_optimizer_destroy(o);
    CHECK(mgpu_model_destroy(m) == MGPU_OK, "model without optimizers: %s", mgpu_last_error());
    mgpu_clear_error();
    CHECK(mgpu_device_set_destroy(set) == MGPU_ERROR_IN_USE && !strstr(mgpu_last_error(), "model") &&
          strstr(mgpu_last_error(), "1 communicator and 1 tensor"), "set with a communicator and a tensor: %s", mgpu_last_error());
    mgpu_allreduce_destroy(ar);
    mgpu_tensor_destroy(t);
    mgpu_clear_error();
    CHECK(mgpu_device_set_destroy(set) == MGPU_ERROR_IN_USE && strstr(mgpu_last_error(), "1 tensor still uses"),
          "a view keeps the storage: %s", mgpu_last_error());
    mgpu_tensor_destroy(v);
    {   /* a set's first CPU device is mgpu_device_cpu(), which outlives the set: its tensors do not count */
        mgpu_tensor* c = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(4));
        CHECK(mgpu_device_set_get(set, 0) == mgpu_device_cpu(), "cpu:2's device 0 is the library's CPU device");
        CHECK(mgpu_device_set_destroy(set) == MGPU_OK, "set without users: %s", mgpu_last_error());
        CHECK(mgpu_tensor_fill(c, 1.0) == MGPU_OK, "the CPU tensor lives on: %s", mgpu_last_error());
        mgpu_tensor_destroy(c);
    }

    {   /* data set and loader */
        mgpu_dataset* ds = (mgpu_dataset*)calloc(1, sizeof *ds);
        mgpu_loader* l;
        ds->count = 4;
        ds->rows = ds->cols = 2;
        ds->images = (uint8_t*)calloc(16, 1);
        ds->labels = (uint8_t*)calloc(4, 1);
        l = mgpu_loader_create(ds, NULL);
        CHECK(l != NULL, "loader: %s", mgpu_last_error());
        mgpu_clear_error();
        CHECK(mgpu_dataset_destroy(ds) == MGPU_ERROR_IN_USE && strstr(mgpu_last_error(), "1 loader"), "data set read by a loader: %s",
              mgpu_last_error());
        {
            const mgpu_tensor *bx, *by;
            CHECK(mgpu_loader_next(l, &bx, &by) == 1 && mgpu_tensor_numel(bx) == 16, "the loader still works");
            mgpu_clear_error();
            CHECK(mgpu_tensor_destroy((mgpu_tensor*)bx) == MGPU_ERROR_IN_USE, "a loader's batch: %s", mgpu_last_error());
        }
        mgpu_loader_destroy(l);
        CHECK(mgpu_dataset_destroy(ds) == MGPU_OK, "data set without loaders");
    }

    {   /* layers: owned by their model */
        mgpu_layer* a = mgpu_layer_linear(4, 4);
        mgpu_layer* r = mgpu_layer_relu();
        mgpu_layer* layers[3];
        mgpu_model_desc d;
        mgpu_model *m1, *m2;
        memset(&d, 0, sizeof d);
        d.input = mgpu_shape1(4);
        layers[0] = a; layers[1] = r; layers[2] = a;   /* the same Linear twice */
        d.layers = layers;
        d.layer_count = 3;
        mgpu_clear_error();
        m1 = mgpu_model_create(&d);
        CHECK(m1 == NULL && strstr(mgpu_last_error(), "layers 0 and 2 are the same"), "a layer twice: %s", mgpu_last_error());
        /* the model owned both (freed once each; ASan and the leak checker watch) */
        a = mgpu_layer_linear(4, 4);
        layers[0] = a; layers[1] = mgpu_layer_relu(); layers[2] = NULL;
        d.layer_count = 2;
        m1 = mgpu_model_create(&d);
        CHECK(m1 != NULL, "model: %s", mgpu_last_error());
        mgpu_clear_error();
        CHECK(mgpu_layer_destroy(a) == MGPU_ERROR_IN_USE && strstr(mgpu_last_error(), "mgpu_layer_destroy"), "owned layer: %s",
              mgpu_last_error());
        /* a layer of m1 in a second model, beside a fresh one that the failed create destroys */
        g_user_destroyed = 0;
        layers[0] = mgpu_layer_create(&ident_vt, NULL);
        layers[1] = a;
        mgpu_clear_error();
        m2 = mgpu_model_create(&d);
        CHECK(m2 == NULL && mgpu_last_result() == MGPU_ERROR_IN_USE && strstr(mgpu_last_error(), "another model"),
              "another model's layer: %s", mgpu_last_error());
        CHECK(g_user_destroyed == 1, "the failed create destroyed its own layer once (%d)", g_user_destroyed);
        CHECK(mgpu_model_param_count(m1) == 20, "m1 untouched");
        {   /* m1 still trains its layer */
            mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 4));
            const mgpu_tensor* out;
            mgpu_tensor_fill(x, 1.0);
            out = mgpu_model_forward(m1, 0, x, 0);
            CHECK(out && mgpu_tensor_numel(out) == 8, "m1 forward: %s", mgpu_last_error());
            mgpu_clear_error();
            CHECK(mgpu_tensor_destroy((mgpu_tensor*)out) == MGPU_ERROR_IN_USE, "a model's output: %s", mgpu_last_error());
            mgpu_tensor_destroy(x);
        }
        /* a layer twice and NULL after it: each distinct layer freed once */
        g_user_destroyed = 0;
        layers[0] = mgpu_layer_create(&ident_vt, NULL);
        layers[1] = layers[0];
        layers[2] = NULL;
        d.layer_count = 3;
        mgpu_clear_error();
        CHECK(mgpu_model_create(&d) == NULL && g_user_destroyed == 1, "twice then NULL: %d destroys, %s", g_user_destroyed,
              mgpu_last_error());
        CHECK(mgpu_model_destroy(m1) == MGPU_OK, "m1 destroyed");
    }
}

static void test_owned(void) {
    mgpu_model* m = small_model(NULL);
    mgpu_optimizer* o = m ? mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .momentum = 0.9f }) : NULL;
    header("owned");
    if (!m || !o) { CHECK(0, "setup: %s", mgpu_last_error()); return; }
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_model_params(m, 0)), "mgpu_tensor_destroy");
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_model_grads(m, 0)), "mgpu_tensor_destroy");
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_model_tensor(m, 0, 1)), "mgpu_tensor_destroy");
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_model_param(m, 0, "2.weight")), "mgpu_tensor_destroy");
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_model_grad(m, 0, "2.bias")), "mgpu_tensor_destroy");
    EXPECT_FAIL(mgpu_tensor_destroy(mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer")), "mgpu_tensor_destroy");
    CHECK(mgpu_tensor_numel(mgpu_model_params(m, 0)) > 0, "the parameters are still there");
    {   /* a view of an owned tensor is the caller's */
        mgpu_tensor* v = mgpu_tensor_view_rows(mgpu_model_params(m, 0), 0, 4);
        CHECK(v && mgpu_tensor_destroy(v) == MGPU_OK, "a view the caller made: %s", mgpu_last_error());
    }
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

/* Handles listed while they live: a second destroy, or a use at create time after the destroy,
   is refused (LIFETIMES). No allocation happens between the two destroys, so the address is
   not reused. */
static void test_double_destroy(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu:2");
    mgpu_model* m;
    mgpu_optimizer* o;
    mgpu_allreduce* ar;
    mgpu_safetensors* st;
    mgpu_loader* l;
    mgpu_dataset ds;
    uint8_t images[8], labels[2] = { 0, 1 };
    char path[512];
    header("double_destroy");
    if (!set) { CHECK(0, "set: %s", mgpu_last_error()); return; }
    m = small_model(set);
    o = m ? mgpu_optimizer_create(m, NULL) : NULL;
    ar = mgpu_allreduce_create(set, MGPU_ALLREDUCE_AUTO);
    if (!m || !o || !ar) { CHECK(0, "setup: %s", mgpu_last_error()); return; }
    test_tmp_path(path, sizeof path, "mgpu_misuse_dd.safetensors");
    CHECK(mgpu_model_save(m, o, path) == MGPU_OK, "save: %s", mgpu_last_error());
    st = mgpu_safetensors_open(path);
    remove(path);
    memset(&ds, 0, sizeof ds);
    memset(images, 0, sizeof images);
    ds.count = 2; ds.rows = 2; ds.cols = 2; ds.images = images; ds.labels = labels;
    l = mgpu_loader_create(&ds, NULL);
    if (!st || !l) { CHECK(0, "setup: %s", mgpu_last_error()); return; }

    mgpu_safetensors_close(st);
    mgpu_clear_error();
    mgpu_safetensors_close(st);
    CHECK(strstr(mgpu_last_error(), "mgpu_safetensors_close") && strstr(mgpu_last_error(), "not a live"), "close twice: %s",
          mgpu_last_error());
    mgpu_loader_destroy(l);
    mgpu_clear_error();
    mgpu_loader_destroy(l);
    CHECK(strstr(mgpu_last_error(), "mgpu_loader_destroy") && strstr(mgpu_last_error(), "not a live"), "loader twice: %s",
          mgpu_last_error());
    CHECK(ds.loaders == 0, "the data set's count went down once (%d)", ds.loaders);
    mgpu_allreduce_destroy(ar);
    mgpu_clear_error();
    mgpu_allreduce_destroy(ar);
    CHECK(strstr(mgpu_last_error(), "mgpu_allreduce_destroy") && strstr(mgpu_last_error(), "not a live"), "communicator twice: %s",
          mgpu_last_error());
    mgpu_optimizer_destroy(o);
    mgpu_clear_error();
    mgpu_optimizer_destroy(o);
    CHECK(strstr(mgpu_last_error(), "mgpu_optimizer_destroy") && strstr(mgpu_last_error(), "not a live"), "optimizer twice: %s",
          mgpu_last_error());
    EXPECT_FAIL(mgpu_optimizer_step(o), "mgpu_optimizer_step");
    {
        float norm;
        EXPECT_FAIL(mgpu_optimizer_last_grad_norm(o, &norm), "mgpu_optimizer_last_grad_norm");   /* (looked up: refused) */
    }
    EXPECT_FAIL(mgpu_model_apply(m, o), "mgpu_model_apply");
    CHECK(mgpu_model_destroy(m) == MGPU_OK, "model: %s", mgpu_last_error());
    EXPECT_FAIL(mgpu_model_destroy(m), "mgpu_model_destroy");
    EXPECT_FAIL(mgpu_model_accumulate(m, NULL, NULL, 0, NULL), "mgpu_model_accumulate");
    EXPECT_FAIL(mgpu_model_evaluate(m, NULL, NULL, NULL, NULL), "mgpu_model_evaluate");
    EXPECT_NULL(mgpu_optimizer_create(m, NULL), "mgpu_optimizer_create");
    CHECK(mgpu_device_set_destroy(set) == MGPU_OK, "set: %s", mgpu_last_error());
    EXPECT_FAIL(mgpu_device_set_destroy(set), "mgpu_device_set_destroy");
    EXPECT_NULL(mgpu_allreduce_create(set, MGPU_ALLREDUCE_AUTO), "mgpu_allreduce_create");
    {   /* a model on a destroyed set: refused, and its layers freed (the desc's promise) */
        mgpu_layer* layers[1];
        mgpu_model_desc d;
        g_user_destroyed = 0;
        memset(&d, 0, sizeof d);
        layers[0] = mgpu_layer_create(&ident_vt, NULL);
        d.input = mgpu_shape1(4);
        d.layers = layers;
        d.layer_count = 1;
        d.devices = set;
        EXPECT_NULL(mgpu_model_create(&d), "mgpu_model_create");
        CHECK(strstr(mgpu_last_error(), "not a live device set") && g_user_destroyed == 1, "model on a destroyed set: %s",
              mgpu_last_error());
    }
}

/* The CPU devices of "cpu:2" are kept apart as two GPUs are: an op or a replica given a tensor of
   the other device fails with MGPU_ERROR_DEVICE_MISMATCH naming both; a training step, which
   splits a host batch itself, takes it from any CPU device. */
static void test_devices(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu:2");
    mgpu_model* m = set ? small_model(set) : NULL;
    mgpu_device *d0 = set ? mgpu_device_set_get(set, 0) : NULL, *d1 = set ? mgpu_device_set_get(set, 1) : NULL;
    mgpu_tensor *x0 = NULL, *x1 = NULL, *y1 = NULL, *s1 = NULL;
    header("devices");
    if (!m) { CHECK(0, "cpu:2 model: %s", mgpu_last_error()); mgpu_device_set_destroy(set); return; }
    x0 = mgpu_tensor_create(d0, MGPU_F32, mgpu_shape2(2, 4));
    x1 = mgpu_tensor_create(d1, MGPU_F32, mgpu_shape2(2, 4));
    y1 = mgpu_tensor_create(d1, MGPU_I32, mgpu_shape1(2));
    s1 = mgpu_tensor_create(d1, MGPU_F32, mgpu_shape2(2, 4));
    if (!x0 || !x1 || !y1 || !s1) CHECK(0, "tensors: %s", mgpu_last_error());
    else {
        const mgpu_tensor* out;
        mgpu_optimizer_desc od;
        mgpu_optimizer* opt;
        float loss = -1.0f;
        CHECK(mgpu_tensor_fill(x0, 0.5) == MGPU_OK && mgpu_tensor_fill(x1, 0.5) == MGPU_OK && mgpu_tensor_zero(y1) == MGPU_OK,
              "fill: %s", mgpu_last_error());
        EXPECT_FAIL(mgpu_add(s1, x1, x0), "mgpu_add");
        CHECK(mgpu_last_result() == MGPU_ERROR_DEVICE_MISMATCH && strstr(mgpu_last_error(), "@cpu#1") &&
              strstr(mgpu_last_error(), "f32[2,4]@cpu ") && strstr(mgpu_last_error(), "are on different devices"),
              "add of cpu#1 and cpu: %s", mgpu_last_error());
        EXPECT_NULL(mgpu_model_forward(m, 1, x0, 0), "mgpu_model_forward");
        CHECK(mgpu_last_result() == MGPU_ERROR_DEVICE_MISMATCH && strstr(mgpu_last_error(), "f32[2,4]@cpu ") &&
              strstr(mgpu_last_error(), "replica 1's device cpu#1"), "replica 1 given x on cpu: %s", mgpu_last_error());
        EXPECT_NULL(mgpu_model_forward(m, 0, x1, 0), "mgpu_model_forward");
        CHECK(mgpu_last_result() == MGPU_ERROR_DEVICE_MISMATCH, "replica 0 given x on cpu#1: %s", mgpu_last_error());
        out = mgpu_model_forward(m, 1, x1, 0);
        CHECK(out && mgpu_tensor_device(out) == d1, "replica 1 given x on cpu#1: %s", mgpu_last_error());
        memset(&od, 0, sizeof od);
        od.kind = MGPU_SGD;
        od.lr = 0.1f;
        opt = mgpu_optimizer_create(m, &od);
        CHECK(opt && mgpu_model_train_step(m, opt, x1, y1, &loss) == MGPU_OK && loss > 0.0f,
              "a step on a batch of cpu#1 (split by the library): %s", mgpu_last_error());
        mgpu_optimizer_destroy(opt);
    }
    mgpu_tensor_destroy(s1); mgpu_tensor_destroy(y1); mgpu_tensor_destroy(x1); mgpu_tensor_destroy(x0);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

/* ---- long inputs: the message keeps its start (the op) and its end (the reason) ---- */
static int ends_with(const char* s, const char* tail) {
    const size_t n = strlen(s), t = strlen(tail);
    return n >= t && strcmp(s + n - t, tail) == 0;
}
/* The message ends with the reason: the system's words for this path (POSIX); on Windows, whose
   words for a long path vary, some words after the path's end ("m.safetensors...: Path not found"). */
static int ends_with_reason(const char* s, const char* reason) {
#ifdef _WIN32
    const char *p = strstr(s, "m.safetensors"), *q;
    (void)reason;
    while (p && (q = strstr(p + 1, "m.safetensors")) != NULL) p = q;
    return p && (q = strstr(p, ": ")) != NULL && q[2] != 0;
#else
    return ends_with(s, reason);
#endif
}
/* whole UTF-8 sequences only: the cut in the middle never splits a character */
static int utf8_whole(const char* s) {
    const unsigned char* p = (const unsigned char*)s;
    while (*p) {
        int more = *p < 0x80 ? 0 : (*p & 0xE0) == 0xC0 ? 1 : (*p & 0xF0) == 0xE0 ? 2 : (*p & 0xF8) == 0xF0 ? 3 : -1;
        if (more < 0) return 0;
        for (++p; more > 0; --more, ++p)
            if ((*p & 0xC0) != 0x80) return 0;
    }
    return 1;
}
/* The last error: shortened (at most 1,023 bytes, with "..." in it), from `op`, ending in `reason`
   (EXPECT_SHORTENED) or in the reason for a path (EXPECT_SHORTENED_PATH). */
#define EXPECT_SHORTENED_BY(what, op, reason, ends)                                                           \
    CHECK(strlen(mgpu_last_error()) <= 1023 && strncmp(mgpu_last_error(), op, strlen(op)) == 0 &&              \
              strstr(mgpu_last_error(), "...") && ends(mgpu_last_error(), reason) && utf8_whole(mgpu_last_error()), \
          "%s: want '%s: ...%s' in at most 1,023 bytes, got %u bytes '%s'", what, op, reason,                        \
          (unsigned)strlen(mgpu_last_error()), mgpu_last_error())
#define EXPECT_SHORTENED(what, op, reason) EXPECT_SHORTENED_BY(what, op, reason, ends_with)
#define EXPECT_SHORTENED_PATH(what, op, reason) EXPECT_SHORTENED_BY(what, op, reason, ends_with_reason)

static char g_warning[2048];
static void keep_warning(mgpu_log_level level, const char* message, void* user) {
    (void)user;
    if (level == MGPU_LOG_WARN) snprintf(g_warning, sizeof g_warning, "%s", message);
}

static void test_long_inputs(void) {
    static char spec[100 * 1000 + 16], path[5200];
    const size_t spec_len = 100 * 1000;
    mgpu_model* m = small_model(NULL);
    mgpu_tokens* tokens = mgpu_tokens_from_text("README.md");
    char reason[256];
    size_t i;
    header("long inputs");
    /* device specs of 100 kB: the rule the spec broke survives */
    memcpy(spec, "cpu:", 4);
    memset(spec + 4, '1', spec_len);
    spec[4 + spec_len] = 0;
    EXPECT_NULL(mgpu_device_set_create(spec), "mgpu_device_set_create");
    EXPECT_SHORTENED("cpu:111...", "mgpu_device_set_create: bad device spec 'cpu:111", "' (cpu:N wants 1 <= N <= 256)");
    memset(spec, 'x', spec_len);
    spec[spec_len] = 0;
    EXPECT_NULL(mgpu_device_set_create(spec), "mgpu_device_set_create");
    EXPECT_SHORTENED("xxx...", "mgpu_device_set_create: unknown device spec 'xxx", "' (want auto, cpu, cpu:N, cuda, cuda:0,1,...)");
    spec[20000] = 0;   /* Windows' variables hold at most 32,767 characters */
    test_setenv("MGPU_DEVICES", spec);
    EXPECT_NULL(mgpu_device_set_create("auto"), "mgpu_device_set_create");
    EXPECT_SHORTENED("MGPU_DEVICES=xxx...", "mgpu_device_set_create: unknown device spec 'xxx",
                     "' (from MGPU_DEVICES) (want auto, cpu, cpu:N, cuda, cuda:0,1,...)");
    test_unsetenv("MGPU_DEVICES");
    /* 257 devices: the limit said */
    strcpy(spec, "cuda:0");
    for (i = 1; i < 257; ++i) strcat(spec, ",0");
    EXPECT_NULL(mgpu_device_set_create(spec), "mgpu_device_set_create");
    CHECK(ends_with(mgpu_last_error(), "names more than 256 devices, the most a set has"), "257 GPUs: '%s'", mgpu_last_error());
    EXPECT_NULL(mgpu_device_set_create("cpu:257"), "mgpu_device_set_create");
    CHECK(strstr(mgpu_last_error(), "1 <= N <= 256") != NULL, "cpu:257: '%s'", mgpu_last_error());
    {   /* 256 CPU replicas are a set (its resolved spec: tests/emu/test_emu.c's "long spec" for 256 GPUs) */
        mgpu_device_set* set = mgpu_device_set_create("cpu:256");
        CHECK(set && mgpu_device_set_count(set) == 256 && !strcmp(mgpu_device_set_spec(set), "cpu:256"), "cpu:256: %s",
              set ? mgpu_device_set_spec(set) : mgpu_last_error());
        mgpu_device_set_destroy(set);
    }
    /* a path of 5,000 bytes, in folders of 49 'a's (with a 2-byte character among them) under a
       missing one: every call that takes a path says why it failed */
    snprintf(path, sizeof path, "%smgpu_no_such_folder_%ld/", test_tmp_base(), test_getpid());
    for (i = strlen(path); i < 5000; ++i) path[i] = i % 50 == 49 ? '/' : 'a';
    memcpy(path + 2500, "\xc3\xa9", 2);   /* U+00E9 */
    strcpy(path + 5000, "m.safetensors");
    {
        FILE* f = fopen(path, "rb");   /* the reason the system gives for this path */
        snprintf(reason, sizeof reason, "': %s", strerror(errno));
        if (f) fclose(f);
    }
    CHECK(m != NULL && tokens != NULL, "a model and tokens: %s", mgpu_last_error());
    if (m && tokens) {
        EXPECT_FAIL(mgpu_model_load(m, NULL, path), "mgpu_model_load");
        EXPECT_SHORTENED_PATH("load", "mgpu_model_load: cannot open '", reason);
        EXPECT_NULL(mgpu_safetensors_open(path), "mgpu_safetensors_open");
        EXPECT_SHORTENED_PATH("safetensors", "mgpu_safetensors_open: cannot open '", reason);
        EXPECT_NULL(mgpu_tokens_load(path), "mgpu_tokens_load");
        EXPECT_SHORTENED_PATH("tokens", "mgpu_tokens_load: cannot open '", reason);
        EXPECT_NULL(mgpu_tokens_from_text(path), "mgpu_tokens_from_text");
        EXPECT_SHORTENED_PATH("text", "mgpu_tokens_from_text: cannot open '", reason);
        EXPECT_NULL(mgpu_dataset_load_idx(path, path), "mgpu_dataset_load_idx");
        EXPECT_SHORTENED_PATH("idx", "mgpu_dataset_load_idx: cannot open '", reason);
        /* writes name their temporary file beside the target, and the reason after it */
        EXPECT_FAIL(mgpu_model_save(m, NULL, path), "mgpu_model_save");
        EXPECT_SHORTENED_PATH("save", "mgpu_model_save: ", reason + 1);
        EXPECT_FAIL(mgpu_tokens_save(tokens, path), "mgpu_tokens_save");
        EXPECT_SHORTENED_PATH("tokens save", "mgpu_tokens_save: ", reason + 1);
        CHECK(mgpu_model_trace_start(m) == MGPU_OK, "trace start: %s", mgpu_last_error());
        EXPECT_FAIL(mgpu_model_trace_stop(m, path), "mgpu_model_trace_stop");
        CHECK(strlen(mgpu_last_error()) <= 1023 && strstr(mgpu_last_error(), "...") && strstr(mgpu_last_error(), "m.safetensors") &&
                  utf8_whole(mgpu_last_error()),
              "trace: the path's end and what follows it survive: '%s'", mgpu_last_error());
        /* an error re-prefixed with where it happened keeps its end too */
        mgpu_fail(MGPU_ERROR_INVALID_ARGUMENT, "my_layer: %s: the reason", path);
        mgpu__refail("mgpu_model_train_step");
        EXPECT_SHORTENED("refail", "mgpu_model_train_step: my_layer: ", ": the reason");
    }
    /* a warning with a long value: the log line keeps what is used instead */
    memset(spec, 'x', 3000);
    spec[3000] = 0;
    test_setenv("MGPU_DETERMINISTIC", spec);
    mgpu_log_set_callback(keep_warning, NULL);
    CHECK(mgpu__deterministic_from_env() == 0 && strlen(g_warning) <= 1023 && strstr(g_warning, "MGPU_DETERMINISTIC='xxx") &&
              strstr(g_warning, "...") && ends_with(g_warning, "xxx' is not 0/1, true/false, on/off or yes/no; using 0 (off)"),
          "a 3,000-byte MGPU_DETERMINISTIC: '%s'", g_warning);
    mgpu_log_set_callback(NULL, NULL);
    test_unsetenv("MGPU_DETERMINISTIC");
    mgpu_tokens_destroy(tokens);
    mgpu_model_destroy(m);
}

/* The whole of a small file in buf (at most size bytes); its length, or -1. */
static long read_small(const char* path, char* buf, size_t size) {
    FILE* f = fopen(path, "rb");
    size_t n;
    if (!f) return -1;
    n = fread(buf, 1, size, f);
    fclose(f);
    return (long)n;
}
/* How many entries (other than . and ..) folder has: a failed write leaves no temporary file. */
static int entry_count(const char* folder) {
    DIR* d = opendir(folder);
    struct dirent* e;
    int n = 0;
    while (d && (e = readdir(d)) != NULL) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

/* Traces are written as checkpoints are (issue 37): a failed mgpu_model_trace_stop (a folder, a
   missing folder, /dev/full, a FIFO, a symlink) returns MGPU_ERROR_IO naming the op and the path,
   at once, leaves nothing behind and keeps the trace, so a retry to a good path writes it; a
   symlink to a checkpoint leaves the checkpoint as it was. */
static void test_trace_files(void) {
    mgpu_device_set* set = mgpu_device_set_create("cpu");
    mgpu_model* m = set ? small_model(set) : NULL;
    mgpu_optimizer* opt = m ? mgpu_optimizer_create(m, NULL) : NULL;
    mgpu_tensor* x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(2, 4));
    mgpu_tensor* y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(2));
    char dir[512], path[640], ckpt[640], after[4096], bad[4][640];
    int i, nbad = 0, entries;
    header("trace_files");
    test_tmp_path(dir, sizeof dir, "mgpu_trace_XXXXXX");
    if (!opt || !x || !y || !test_mkdtemp(dir, sizeof dir)) {
        CHECK(0, "setup: %s", mgpu_last_error());
        goto done;
    }
    CHECK(mgpu_tensor_fill(x, 0.5) == MGPU_OK && mgpu_tensor_zero(y) == MGPU_OK, "fill: %s", mgpu_last_error());
    CHECK(mgpu_model_trace_start(m) == MGPU_OK && mgpu_model_train_step(m, opt, x, y, NULL) == MGPU_OK, "traced step: %s",
          mgpu_last_error());
    snprintf(ckpt, sizeof ckpt, "%s/model.safetensors", dir);
    CHECK(mgpu_model_save(m, NULL, ckpt) == MGPU_OK, "save: %s", mgpu_last_error());
    snprintf(bad[nbad++], sizeof bad[0], "%s", dir);                                   /* a folder */
    snprintf(bad[nbad++], sizeof bad[0], "%s/missing/trace.json", dir);                /* in a missing folder */
#if defined(__unix__) || defined(__APPLE__)
    if (access("/dev/full", W_OK) == 0) snprintf(bad[nbad++], sizeof bad[0], "/dev/full");
    snprintf(bad[nbad], sizeof bad[0], "%s/fifo.json", dir);   /* opened for writing, it would wait for a reader forever */
    if (mkfifo(bad[nbad], 0600) == 0) ++nbad;
    else SKIP("mkfifo: %s", strerror(errno));
#endif
    entries = entry_count(dir);
    for (i = 0; i < nbad; ++i) {
        double t0 = mgpu_seconds();
        EXPECT_FAIL(mgpu_model_trace_stop(m, bad[i]), "mgpu_model_trace_stop");
        CHECK(mgpu_last_result() == MGPU_ERROR_IO && strstr(mgpu_last_error(), bad[i]) && mgpu_seconds() - t0 < 5.0,
              "trace to '%s': %s, '%s' after %.1f s", bad[i], mgpu_result_string(mgpu_last_result()), mgpu_last_error(), mgpu_seconds() - t0);
        CHECK(entry_count(dir) == entries, "trace to '%s' left %d entries in its folder, not %d", bad[i], entry_count(dir), entries);
    }
#if defined(__unix__) || defined(__APPLE__)
    {   /* a symlink to the checkpoint: refused, the checkpoint and the link as they were */
        struct stat st;
        char before[4096];
        long n0 = read_small(ckpt, before, sizeof before), n1;
        snprintf(path, sizeof path, "%s/trace.json", dir);
        CHECK(symlink(ckpt, path) == 0, "symlink: %s", strerror(errno));
        EXPECT_FAIL(mgpu_model_trace_stop(m, path), "mgpu_model_trace_stop");
        CHECK(mgpu_last_result() == MGPU_ERROR_IO && strstr(mgpu_last_error(), "symbolic link"), "trace to a symlink: %s", mgpu_last_error());
        n1 = read_small(ckpt, after, sizeof after);
        CHECK(n0 > 0 && n1 == n0 && memcmp(before, after, (size_t)n0) == 0, "the checkpoint behind the link changed (%ld bytes, then %ld)", n0, n1);
        CHECK(lstat(path, &st) == 0 && S_ISLNK(st.st_mode), "the link itself was replaced");
        remove(path);
    }
#endif
    /* the retry to a good path: the trace was kept, with its slices; written, it is gone */
    snprintf(path, sizeof path, "%s/trace.json", dir);
    CHECK(mgpu_model_trace_stop(m, path) == MGPU_OK, "retry to a good path: %s", mgpu_last_error());
    CHECK(read_small(path, after, sizeof after - 1) > 0 && (after[sizeof after - 1] = 0, strstr(after, "\"ph\": \"X\"") != NULL),
          "the retried trace has no slices");
    EXPECT_FAIL(mgpu_model_trace_stop(m, path), "mgpu_model_trace_stop");   /* stopped: nothing left to write */
    /* a write that goes on tracing fails the same way and keeps tracing */
    CHECK(mgpu_model_trace_start(m) == MGPU_OK, "trace_start again: %s", mgpu_last_error());
    EXPECT_FAIL(mgpu_model_trace_write(m, dir), "mgpu_model_trace_write");
    snprintf(path, sizeof path, "%s/trace.svg", dir);
    CHECK(mgpu_model_trace_stop(m, path) == MGPU_OK, "stop after a failed write: %s", mgpu_last_error());
done:
    test_remove_tree(dir);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_device_set_destroy(set);
}

int main(int argc, char** argv) {
    (void)test_rel_error;   /* test.h's, unused here */
    test_start("test_misuse");
    test_select(argc, argv);
    TEST_GROUP(test_nulls());
    TEST_GROUP(test_null_args());
    TEST_GROUP(test_indices());
    TEST_GROUP(test_shapes());
    TEST_GROUP(test_lifetimes());
    TEST_GROUP(test_owned());
    TEST_GROUP(test_double_destroy());
    TEST_GROUP(test_devices());
    TEST_GROUP(test_long_inputs());
    TEST_GROUP(test_trace_files());
    return test_summary("test_misuse");
}
