/* 10_ex1.c - lesson 10, exercise 1: ignored labels, as unevenly as they come.

   7 windows on 3 replicas: rows 0-2, 3-4 and 5-6 (B/N each, the first B%N one more). Half of row
   0's labels are MGPU_IGNORE_INDEX, and ALL of replica 2's: it has no target at all. The batch's
   loss is the mean over its targets, wherever they lie, and every replica's gradient is scaled by
   that one count (mgpu counts the batch's valid labels before the split), so cpu:3 must still train
   to one device's parameters. The mean of the replicas' own means would weigh a target of
   replica 1 (16 targets) as much as all of replica 0's (20): the program prints it beside the
   batch's loss.

   Run:  build/course/10_ex1 cpu:3                                            */
// course-run: cpu:3
// course-expect: targets per replica: 20 16 0
// course-expect: the batch's loss = one device's: yes
// course-expect: cpu:3 = one device within 1e-4 after 3 steps: yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>
#include <math.h>

#define T 8
#define B 7
#define WIDTH 16
#define STEPS 3

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

/* wte, wpe, one block h.0, ln_f, lm_head tied to wte */
static mgpu_model* make_gpt(const mgpu_device_set* set) {
    static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(WIDTH, 2, 0.0f), "attn") };
    mgpu_layer* mlp[3] = { mgpu_layer_name(mgpu_layer_conv1d(WIDTH, 4 * WIDTH), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * WIDTH, WIDTH), "c_proj") };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 3), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), ""),
                            mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL), "") };
    mgpu_layer* layers[5] = { mgpu_layer_name(mgpu_layer_embedding(MGPU_TOKENS_BYTE_VOCAB, WIDTH), "wte"),
                              mgpu_layer_name(mgpu_layer_position_embedding(T, WIDTH), "wpe"),
                              mgpu_layer_name(mgpu_layer_sequential(both, 2), "h.0"),
                              mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_f"),
                              mgpu_layer_name(mgpu_layer_linear_no_bias(WIDTH, MGPU_TOKENS_BYTE_VOCAB), "lm_head") };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(T), .input_dtype = MGPU_I32, .layers = layers,
                                                  .layer_count = 5, .devices = set, .seed = 1, .ties = &head_is_wte, .tie_count = 1 });
}

int main(int argc, char** argv) {
    static const char text[] = "the next byte of a sentence, learnt on three replicas at once: the same as one.";
    mgpu_device_set* set = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:3");
    mgpu_device_set* cpu = mgpu_device_set_create("cpu");
    mgpu_model *one, *many;
    mgpu_optimizer *opt_one, *opt_many;
    mgpu_tensor *x, *y;
    int32_t xs[B * T], ys[B * T];
    int valid[3] = { 0, 0, 0 }, rows[3] = { 3, 2, 2 };
    float l1 = 0, l3 = 0, first = 0, r[3];
    double worst = 0, plain = 0, weighted = 0;
    int i, j, step, with = 0;
    NEED(set && cpu);
    if (mgpu_device_set_count(set) != 3) { fprintf(stderr, "want 3 devices, e.g. cpu:3\n"); return 1; }
    for (i = 0; i < B * T; ++i) {   /* window i / T: the text from byte (i / T) * T on */
        xs[i] = (uint8_t)text[i];
        ys[i] = (uint8_t)text[i + 1];
        if ((i < T / 2) || i >= 5 * T) ys[i] = MGPU_IGNORE_INDEX;   /* half of row 0, all of rows 5-6 */
    }
    for (i = 0, j = 0; j < 3; ++j) {
        int k;
        for (k = 0; k < rows[j] * T; ++k, ++i) valid[j] += ys[i] != MGPU_IGNORE_INDEX;
    }
    printf("rows per replica: %d %d %d\n", rows[0], rows[1], rows[2]);
    printf("targets per replica: %d %d %d\n", valid[0], valid[1], valid[2]);
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(B, T)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape2(B, T)));
    CHECK(mgpu_tensor_upload(x, xs, sizeof xs));
    CHECK(mgpu_tensor_upload(y, ys, sizeof ys));
    NEED((one = make_gpt(cpu)) && (many = make_gpt(set)));
    NEED((opt_one = mgpu_optimizer_create(one, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = 1e-2f })));
    NEED((opt_many = mgpu_optimizer_create(many, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = 1e-2f })));
    for (step = 0; step < STEPS; ++step) {
        CHECK(mgpu_model_train_step(one, opt_one, x, y, &l1));
        CHECK(mgpu_model_train_step(many, opt_many, x, y, &l3));
        if (step == 0) {
            first = l1;
            for (j = 0; j < 3; ++j) CHECK(mgpu_model_replica_loss(many, j, &r[j]));
        }
        printf("step %d  loss: one device %.4f  %s %.4f\n", step, (double)l1, mgpu_device_set_spec(set), (double)l3);
    }
    for (j = 0; j < 3; ++j) {   /* the mean of the replicas' means: over those with a target */
        if (valid[j]) { plain += r[j]; ++with; }
        weighted += (double)r[j] * valid[j];
    }
    plain /= with;
    weighted /= valid[0] + valid[1] + valid[2];
    printf("step 0: replica losses %.4f %.4f %.4f; mean of the replicas' means %.4f, over every target %.4f, one device %.4f\n",
           (double)r[0], (double)r[1], (double)r[2], plain, weighted, (double)first);
    printf("the batch's loss = one device's: %s\n", fabs(weighted - first) < 1e-4 ? "yes" : "NO");
    for (i = 0; i < mgpu_model_tensor_count(one); ++i) {
        static float a[MGPU_TOKENS_BYTE_VOCAB * WIDTH], b[MGPU_TOKENS_BYTE_VOCAB * WIDTH];
        const mgpu_tensor *ta = mgpu_model_tensor(one, 0, i), *tb = mgpu_model_tensor(many, 0, i);
        CHECK(mgpu_tensor_download(ta, a, mgpu_tensor_bytes(ta)));
        CHECK(mgpu_tensor_download(tb, b, mgpu_tensor_bytes(tb)));
        for (j = 0; j < (int)mgpu_tensor_numel(ta); ++j) worst = fmax(worst, fabs((double)a[j] - b[j]));
    }
    printf("%s = one device within 1e-4 after %d steps: %s (largest difference %.0e)\n", mgpu_device_set_spec(set), STEPS,
           worst <= 1e-4 ? "yes" : "NO", worst);
    mgpu_optimizer_destroy(opt_one); mgpu_optimizer_destroy(opt_many);
    mgpu_model_destroy(one); mgpu_model_destroy(many);
    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y);
    mgpu_device_set_destroy(set); mgpu_device_set_destroy(cpu);
    return fabs(weighted - first) < 1e-4 && worst <= 1e-4 ? 0 : 1;
}
