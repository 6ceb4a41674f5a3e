/* fuzz_gpt_load.c - libFuzzer harness: any bytes as a checkpoint in Hugging Face's GPT-2 layout
   (transformer.wte.weight, transformer.h.0.attn.c_attn.weight stored [in, out], lm_head tied and
   absent) for a tiny GPT (vocabulary 8, 4 positions, width 4, 2 heads, 1 block) on the CPU, loaded
   as build/gpt loads it: with the prefix "transformer." and with none (the hub's layout), other
   tensors ignored (the attention's mask buffers older files carry), and once strictly. A failed
   load leaves the parameters as they were; a load that succeeds is saved again in the same
   layout and that file loads into a second model to the same bits, and a forward pass runs on
   what was loaded. Built and run by tests/fuzz/run.sh. */
#define _GNU_SOURCE
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "fuzz.h"

#define GPT_FLOATS 1024   /* more than the tiny GPT's 300 parameters */

static mgpu_device_set* fuzz_set;
static mgpu_model *fuzz_model, *fuzz_twin;
static char fuzz_saved[64];   /* a plain file: a save writes beside it and renames */

/* examples/gpt.c's model, shrunk: the names are what the layout maps */
static mgpu_model* tiny_gpt(void) {
    static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(4), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(4, 2, 0.0f), "attn") };
    mgpu_layer* mlp[3] = { mgpu_layer_name(mgpu_layer_conv1d(4, 16), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(16, 4), "c_proj") };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(4), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 3), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), ""),
                            mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL), "") };
    mgpu_layer* layers[5] = { mgpu_layer_name(mgpu_layer_embedding(8, 4), "wte"),
                              mgpu_layer_name(mgpu_layer_position_embedding(4, 4), "wpe"),
                              mgpu_layer_name(mgpu_layer_sequential(both, 2), "h.0"),
                              mgpu_layer_name(mgpu_layer_layer_norm(4), "ln_f"),
                              mgpu_layer_name(mgpu_layer_linear_no_bias(4, 8), "lm_head") };
    mgpu_model_desc md;
    mgpu_model* m;
    memset(&md, 0, sizeof md);
    md.input = mgpu_shape1(4);
    md.input_dtype = MGPU_I32;
    md.layers = layers;
    md.layer_count = 5;
    md.devices = fuzz_set;
    md.ties = &head_is_wte;
    md.tie_count = 1;
    m = mgpu_model_create(&md);
    if (!m || mgpu_model_param_count(m) > GPT_FLOATS) { fprintf(stderr, "model: %s\n", mgpu_last_error()); abort(); }
    return m;
}

static void fuzz_free(void) {
    mgpu_model_destroy(fuzz_model);
    mgpu_model_destroy(fuzz_twin);
    mgpu_device_set_destroy(fuzz_set);
    unlink(fuzz_saved);
}

static size_t params_of(mgpu_model* m, float* out) {
    const mgpu_tensor* p = mgpu_model_params(m, 0);
    const size_t bytes = mgpu_tensor_bytes(p);
    if (bytes > GPT_FLOATS * sizeof(float) || mgpu_tensor_download(p, out, bytes)) abort();
    return bytes;
}

static void load_as(const char* path, const char* prefix, int allow_extra) {
    static const int32_t ids[2 * 4] = { 0, 7, 3, 3, 5, 1, 6, 2 };
    static float before[GPT_FLOATS], after[GPT_FLOATS], twin[GPT_FLOATS];
    mgpu_load_desc ld;
    mgpu_save_desc sd;
    size_t bytes = params_of(fuzz_model, before);
    memset(&ld, 0, sizeof ld);
    ld.prefix = prefix;
    ld.allow_extra = allow_extra;
    if (mgpu_model_load_ex(fuzz_model, NULL, path, &ld) != MGPU_OK) {
        if (params_of(fuzz_model, after) != bytes || memcmp(before, after, bytes) != 0) {
            fprintf(stderr, "a failed load changed the parameters\n");
            abort();
        }
        return;
    }
    /* what loaded, written in the same layout, reads back to the same bits */
    memset(&sd, 0, sizeof sd);
    sd.prefix = prefix;
    ld.allow_extra = 0;
    if (mgpu_model_save_ex(fuzz_model, NULL, fuzz_saved, &sd) != MGPU_OK ||
        mgpu_model_load_ex(fuzz_twin, NULL, fuzz_saved, &ld) != MGPU_OK) {
        fprintf(stderr, "a loaded model did not save and load again: %s\n", mgpu_last_error());
        abort();
    }
    if (params_of(fuzz_model, after) != params_of(fuzz_twin, twin) || memcmp(after, twin, bytes) != 0) {
        fprintf(stderr, "saved and loaded again, the parameters differ\n");
        abort();
    }
    {   /* a forward pass on what was loaded: NaN and infinities are fine, UB is not */
        mgpu_tensor* x = mgpu_tensor_create(mgpu_device_set_get(fuzz_set, 0), MGPU_I32, mgpu_shape2(2, 4));
        if (!x || mgpu_tensor_upload(x, ids, sizeof ids) || !mgpu_model_forward(fuzz_model, 0, x, 0)) {
            fprintf(stderr, "forward: %s\n", mgpu_last_error());
            abort();
        }
        mgpu_tensor_destroy(x);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static fuzz_file f;
    if (!f.path[0]) {
        fuzz_file_open(&f);
        snprintf(fuzz_saved, sizeof fuzz_saved, "/tmp/mgpu-fuzz-gpt-%ld.safetensors", (long)getpid());
        mgpu_log_set_callback(fuzz_quiet, NULL);
        if (!(fuzz_set = mgpu_device_set_create("cpu"))) abort();
        fuzz_model = tiny_gpt();
        fuzz_twin = tiny_gpt();
        atexit(fuzz_free);
    }
    fuzz_file_write(&f, data, size);
    load_as(f.path, "transformer.", 1);   /* GPT2LMHeadModel.save_pretrained's layout */
    load_as(f.path, NULL, 1);             /* the hub's (GPT2Model's) */
    load_as(f.path, "transformer.", 0);
    return 0;
}
