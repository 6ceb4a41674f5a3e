/* 10_ex3.c - lesson 10, exercise 3: where may a GPT's pipeline be cut?

   The GPT of the lesson is a list of 6 entries: wte, wpe, h.0, h.1, ln_f, lm_head. A 2-stage
   pipeline starts stage 1 at one of entries 1 to 5 (.split = (int[]){ k }); a cut inside a block is
   not offered, since a block is one entry. For every k the program trains 2 steps on the stages
   and on one device, compares every parameter bit for bit (CPU devices), and prints each stage's
   parameters. Then the tied GPT (lm_head tied to wte): every k puts the head's stage after the
   embedding's, and mgpu accepts each one: stage 1 holds a copy of wte as lm_head (vocab x WIDTH
   floats, whatever the cut), and each step its gradient goes to stage 0 and wte's values come
   back. Each tied cut is checked against the tied GPT on one device, bit for bit.

   Run:  build/course/10_ex3 cpu:2                                            */
// course-run: cpu:2
// course-expect: every cut between entries = one device (bit for bit): yes
// course-expect: tied head: 5 of 5 cuts accepted, = one device (bit for bit): yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define T 8
#define WIDTH 16
#define B 4

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

static mgpu_layer* block(const char* name) {
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(WIDTH, 2, 0.0f), "attn") };
    mgpu_layer* mlp[3] = { mgpu_layer_name(mgpu_layer_conv1d(WIDTH, 4 * WIDTH), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * WIDTH, WIDTH), "c_proj") };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 3), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), ""),
                            mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL), "") };
    return mgpu_layer_name(mgpu_layer_sequential(both, 2), name);
}

/* stages 1: one device; 2: stage 1 starts at entry `cut` */
static mgpu_model* make_gpt(const mgpu_device_set* set, int tied, int cut) {
    static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
    mgpu_layer* layers[6] = { mgpu_layer_name(mgpu_layer_embedding(MGPU_TOKENS_BYTE_VOCAB, WIDTH), "wte"),
                              mgpu_layer_name(mgpu_layer_position_embedding(T, WIDTH), "wpe"), block("h.0"), block("h.1"),
                              mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_f"),
                              mgpu_layer_name(mgpu_layer_linear_no_bias(WIDTH, MGPU_TOKENS_BYTE_VOCAB), "lm_head") };
    int split[1];
    split[0] = cut;
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(T), .input_dtype = MGPU_I32, .layers = layers,
                                                  .layer_count = 6, .devices = set, .seed = 2, .ties = &head_is_wte,
                                                  .tie_count = tied, .stages = cut ? 2 : 1, .split = cut ? split : NULL,
                                                  .micro_batches = cut ? 2 : 1 });
}

/* Trains the GPT (tied or not) 2 steps on one device and on 2 stages cut before entry `cut`, prints
   each stage's floats, and returns whether every parameter has one device's bits; -1 on an error. */
static int try_cut(mgpu_device_set* set, mgpu_device_set* cpu, int tied, int cut, const mgpu_tensor* x, const mgpu_tensor* y) {
    static const char* entries[6] = { "wte", "wpe", "h.0", "h.1", "ln_f", "lm_head" };
    static float a[MGPU_TOKENS_BYTE_VOCAB * WIDTH], b[MGPU_TOKENS_BYTE_VOCAB * WIDTH];
    mgpu_model *one = make_gpt(cpu, tied, 0), *pp = make_gpt(set, tied, cut);
    mgpu_optimizer *o1 = NULL, *o2 = NULL;
    int i, step, same = 1;
    if (!one || !pp || !(o1 = mgpu_optimizer_create(one, NULL)) || !(o2 = mgpu_optimizer_create(pp, NULL))) same = -1;
    for (step = 0; step < 2 && same == 1; ++step)
        if (mgpu_model_train_step(one, o1, x, y, NULL) != MGPU_OK || mgpu_model_train_step(pp, o2, x, y, NULL) != MGPU_OK) same = -1;
    for (i = 0; same == 1 && i < mgpu_model_tensor_count(one); ++i) {
        const mgpu_tensor *ta = mgpu_model_tensor(one, 0, i), *tb = mgpu_model_tensor(pp, 0, i);
        if (mgpu_tensor_download(ta, a, mgpu_tensor_bytes(ta)) != MGPU_OK || mgpu_tensor_download(tb, b, mgpu_tensor_bytes(tb)) != MGPU_OK)
            same = -1;
        else if (memcmp(a, b, mgpu_tensor_bytes(ta)) != 0) same = 0;
    }
    if (same < 0) fprintf(stderr, "%s, cut before %s: %s\n", tied ? "tied" : "untied", entries[cut], mgpu_last_error());
    else printf("%s cut before %-7s stage 0: %5lld floats, stage 1: %5lld floats, = one device: %s\n", tied ? "tied  " : "untied",
                entries[cut], (long long)mgpu_tensor_numel(mgpu_model_stage_params(pp, 0, 0)),
                (long long)mgpu_tensor_numel(mgpu_model_stage_params(pp, 0, 1)), same ? "bit for bit" : "NO");
    mgpu_optimizer_destroy(o1); mgpu_optimizer_destroy(o2);
    mgpu_model_destroy(one); mgpu_model_destroy(pp);
    return same;
}

int main(int argc, char** argv) {
    static const char text[] = "one block is one entry: a pipeline cuts between them.";
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_device_set* cpu = mgpu_device_set_create("cpu");
    mgpu_tensor *x, *y;
    int32_t xs[B * T], ys[B * T];
    int i, cut, same, all_equal = 1, accepted = 0, tied_equal = 1;
    NEED(set && cpu);
    if (mgpu_device_set_count(set) != 2) { fprintf(stderr, "want 2 devices, e.g. cpu:2\n"); return 1; }
    for (i = 0; i < B * T; ++i) { xs[i] = (uint8_t)text[i]; ys[i] = (uint8_t)text[i + 1]; }
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(B, T)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(B, T)));
    CHECK(mgpu_tensor_upload(x, xs, sizeof xs));
    CHECK(mgpu_tensor_upload(y, ys, sizeof ys));
    for (cut = 1; cut <= 5; ++cut) {
        if ((same = try_cut(set, cpu, 0, cut, x, y)) < 0) return 1;
        all_equal &= same;
    }
    printf("every cut between entries = one device (bit for bit): %s\n", all_equal ? "yes" : "NO");
    for (cut = 1; cut <= 5; ++cut) {   /* the tied GPT: a refusal would be an error here */
        if ((same = try_cut(set, cpu, 1, cut, x, y)) < 0) continue;
        ++accepted;
        tied_equal &= same;
    }
    printf("tied head: %d of 5 cuts accepted, = one device (bit for bit): %s\n", accepted, tied_equal ? "yes" : "NO");
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(cpu);
    return all_equal && accepted == 5 && tied_equal ? 0 : 1;
}
