/* 10_gpt.c - lesson 10: a transformer on many devices.

     ./10_gpt cpu:2 cpu        data parallelism on cpu:2 and a 2-stage pipeline, against one device
     MGPU_EMU_DEVICES=2 build/emu/10_gpt cuda:0,1 cuda:0              the same on 2 emulated GPUs

   A tiny GPT-2 (Hugging Face's names, as examples/gpt.c builds it) learns the next byte of a short
   text that the program holds itself: windows of T bytes, a label per position.
   Part 1, data parallelism: whole sequences are split across the replicas, and some labels are
   MGPU_IGNORE_INDEX, unevenly (replica 0 gets most of them). The loss is the mean over every
   target of the batch, so the replicas must train to one device's parameters (to rounding: the
   sums are split differently); the mean of the replicas' own means would be another number.
   Part 2, a pipeline: a cut between blocks puts the token embedding (stage 0) and the head tied
   to it (stage 1) on different devices. The last stage holds a copy of wte as lm_head; each
   update adds the copy's gradient into wte's, moves wte and copies it back. The same tied GPT is
   trained on 2 stages with 2 micro-batches and must give one device's parameters (bit for bit on
   CPU devices, within 1e-4 on GPUs), its copy equal to wte. */
// course-run: cpu:2 cpu
// course-run-emu 2: cuda:0,1 cuda:0
// course-expect: = one device within 1e-4 (largest difference
// course-expect: part 2: 2 stages = one device
// course-expect: lm_head.weight = wte.weight: yes, bit for bit
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>
#include <math.h>

#define T 16          /* tokens per window (and the model's positions) */
#define B 8           /* windows per batch */
#define WIDTH 32
#define HEADS 4
#define BLOCKS 2
#define STEPS 6
#define PROMPT 12     /* rows 0-2 of each batch: their first PROMPT labels are not trained on */

#define TRY(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "line %d: %s\n", __LINE__, mgpu_last_error()); return 1; } } while (0)

static const char text[] =
    "Data parallelism copies the model and splits the batch; model parallelism cuts the model and\n"
    "passes the activations on. A GPT is a list of blocks: an embedding, blocks of attention and\n"
    "a small MLP, a last norm and a head that reads the next token. Every block sees the tokens\n"
    "before it, never after: that is what causal means. Train it on a few lines of text and the\n"
    "loss goes down, on one device or on many, with the same numbers.\n";

/* One block, Hugging Face's h.i: x + attn(ln_1(x)), then x + mlp(ln_2(x)). One entry of the list. */
static mgpu_layer* block(int i) {
    char name[16];
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(WIDTH, HEADS, 0.0f), "attn") };
    mgpu_layer* mlp[3] = { mgpu_layer_name(mgpu_layer_conv1d(WIDTH, 4 * WIDTH), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * WIDTH, WIDTH), "c_proj") };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 3), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL), ""),
                            mgpu_layer_name(mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL), "") };
    snprintf(name, sizeof name, "h.%d", i);
    return mgpu_layer_name(mgpu_layer_sequential(both, 2), name);
}

/* wte, wpe, h.0, h.1, ln_f, lm_head: 6 entries; the head tied to wte or not. */
static mgpu_model* make_gpt(const mgpu_device_set* set, int tied, int stages) {
    static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
    mgpu_layer* layers[4 + BLOCKS];
    int n = 0, i;
    layers[n++] = mgpu_layer_name(mgpu_layer_embedding(MGPU_TOKENS_BYTE_VOCAB, WIDTH), "wte");
    layers[n++] = mgpu_layer_name(mgpu_layer_position_embedding(T, WIDTH), "wpe");
    for (i = 0; i < BLOCKS; ++i) layers[n++] = block(i);
    layers[n++] = mgpu_layer_name(mgpu_layer_layer_norm(WIDTH), "ln_f");
    layers[n++] = mgpu_layer_name(mgpu_layer_linear_no_bias(WIDTH, MGPU_TOKENS_BYTE_VOCAB), "lm_head");
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(T), .input_dtype = MGPU_I32, .layers = layers,
                                                  .layer_count = n, .devices = set, .seed = 10, .ties = &head_is_wte,
                                                  .tie_count = tied, .stages = stages, .micro_batches = stages > 1 ? 2 : 1 });
}

static mgpu_optimizer* make_opt(mgpu_model* m) {
    return mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f });
}

/* The largest difference between two models of the same layers, over every named parameter. */
static float max_diff(const mgpu_model* a, const mgpu_model* b) {
    static float ha[MGPU_TOKENS_BYTE_VOCAB * WIDTH], hb[MGPU_TOKENS_BYTE_VOCAB * WIDTH];
    float worst = 0.0f;
    int i;
    int64_t j;
    for (i = 0; i < mgpu_model_tensor_count(a); ++i) {
        const mgpu_tensor *ta = mgpu_model_tensor(a, 0, i), *tb = mgpu_model_tensor(b, 0, i);
        if (mgpu_tensor_download(ta, ha, mgpu_tensor_bytes(ta)) != MGPU_OK || mgpu_tensor_download(tb, hb, mgpu_tensor_bytes(tb)) != MGPU_OK)
            return INFINITY;
        for (j = 0; j < mgpu_tensor_numel(ta); ++j) {
            const float d = fabsf(ha[j] - hb[j]);
            if (d != d) return INFINITY;   /* a NaN */
            if (d > worst) worst = d;
        }
    }
    return worst;
}

int main(int argc, char** argv) {
    mgpu_device_set* many = mgpu_device_set_create(argc > 1 ? argv[1] : "cpu:2");
    mgpu_device_set* one_set = mgpu_device_set_create(argc > 2 ? argv[2] : "cpu");
    static uint16_t ids[sizeof text];
    mgpu_tokens* tokens;
    mgpu_dataset* windows;
    mgpu_loader* loader;
    mgpu_tensor *x[STEPS], *y[STEPS];
    int32_t labels[B * T];
    int step, i, on_gpu, failed = 0;
    NEED(many && one_set);
    on_gpu = mgpu_device_kind_of(mgpu_device_set_get(many, 0)) == MGPU_DEVICE_CUDA;
    if (mgpu_device_set_count(many) != 2) { fprintf(stderr, "want 2 devices, e.g. cpu:2\n"); return 1; }

    /* ---- the data: the text's bytes are its tokens; windows of T, the next byte as the label ---- */
    for (i = 0; i < (int)sizeof text - 1; ++i) ids[i] = (uint8_t)text[i];
    NEED(tokens = mgpu_tokens_from_memory(ids, (int64_t)sizeof text - 1));
    NEED(windows = mgpu_dataset_tokens(tokens, T));
    NEED(loader = mgpu_loader_create(windows, &(mgpu_loader_desc){ .batch = B, .wrap = 1 }));
    printf("text: %lld bytes = tokens, %lld windows of %d, batches of %d windows [%d, %d]\n",
           (long long)mgpu_tokens_count(tokens), (long long)windows->count, T, B, B, T);
    mgpu_loader_start(loader, 0);
    for (step = 0; step < STEPS; ++step) {   /* the batches, kept: every model trains on the same ones */
        const mgpu_tensor *bx, *by;
        if (!mgpu_loader_next(loader, &bx, &by)) { mgpu_loader_start(loader, 1); mgpu_loader_next(loader, &bx, &by); }
        NEED(x[step] = mgpu_tensor_to(bx, mgpu_device_cpu()));
        NEED(y[step] = mgpu_tensor_to(by, mgpu_device_cpu()));
        /* uneven ignored labels: rows 0-2 are "prompts" whose first PROMPT positions are not targets */
        TRY(mgpu_tensor_download(y[step], labels, sizeof labels));
        for (i = 0; i < 3 * T; ++i)
            if (i % T < PROMPT) labels[i] = MGPU_IGNORE_INDEX;
        TRY(mgpu_tensor_upload(y[step], labels, sizeof labels));
    }
    mgpu_loader_destroy(loader);

    /* ---- Part 1: data parallelism, a tied GPT on one device and on two replicas ---- */
    {
        mgpu_model *one = make_gpt(one_set, 1, 1), *dp = make_gpt(many, 1, 1);
        mgpu_optimizer *opt_one, *opt_dp;
        float l1 = 0, l2 = 0, first = 0, r0 = 0, r1 = 0, worst;
        double plain, weighted;
        int valid[2] = { 0, 0 };
        NEED(one && dp);
        NEED((opt_one = make_opt(one)) && (opt_dp = make_opt(dp)));
        printf("GPT: %d blocks, width %d, %d heads, %lld parameters (lm_head tied to wte); %d list entries\n", BLOCKS, WIDTH,
               HEADS, (long long)mgpu_model_param_count(one), mgpu_model_stage_first_layer(one, 1));
        for (i = 0; i < B * T; ++i) valid[i / T >= B / 2] += labels[i] != MGPU_IGNORE_INDEX;   /* rows 0-3: replica 0 */
        printf("part 1: replica 0 gets rows 0-3 (%d targets), replica 1 rows 4-7 (%d targets)\n", valid[0], valid[1]);
        for (step = 0; step < STEPS; ++step) {
            TRY(mgpu_model_train_step(one, opt_one, x[step], y[step], &l1));
            TRY(mgpu_model_train_step(dp, opt_dp, x[step], y[step], &l2));
            if (step == 0) {
                first = l1;
                TRY(mgpu_model_replica_loss(dp, 0, &r0));
                TRY(mgpu_model_replica_loss(dp, 1, &r1));
            }
            printf("step %d  loss: one device %.4f  %s %.4f\n", step, (double)l1, mgpu_device_set_spec(many), (double)l2);
        }
        /* each replica's loss is the mean over ITS targets; the batch's weighs them by their targets */
        plain = 0.5 * ((double)r0 + (double)r1);
        weighted = ((double)r0 * valid[0] + (double)r1 * valid[1]) / (valid[0] + valid[1]);
        printf("part 1: step 0, replica losses %.4f and %.4f: their plain mean %.4f, weighted by targets %.4f\n", (double)r0,
               (double)r1, plain, weighted);
        if (fabs(weighted - (double)first) > 1e-4 || fabs(plain - (double)first) < 1e-3) {
            printf("part 1: the weighted mean is not one device's loss, %.4f\n", (double)first);
            failed = 1;
        }
        worst = max_diff(one, dp);
        TRY(mgpu_model_verify_replicas(dp));
        if (worst <= 1e-4f)
            printf("part 1: %s = one device within 1e-4 (largest difference %.0e)\n", mgpu_device_set_spec(many), (double)worst);
        else { printf("part 1: the parameters DIFFER by %g\n", (double)worst); failed = 1; }
        mgpu_optimizer_destroy(opt_one); mgpu_optimizer_destroy(opt_dp);
        mgpu_model_destroy(one); mgpu_model_destroy(dp);
    }

    /* ---- Part 2: the same tied GPT in a pipeline of 2 stages, cut between entries of the list ---- */
    {
        mgpu_model *one = make_gpt(one_set, 1, 1), *pp = make_gpt(many, 1, 2);
        mgpu_optimizer *opt_one, *opt_pp;
        mgpu_tensor *head, *wte;
        float l1 = 0, l2 = 0, worst;
        int s, copy_ok;
        NEED(one && pp);
        NEED((opt_one = make_opt(one)) && (opt_pp = make_opt(pp)));
        NEED((head = mgpu_model_param(pp, 0, "lm_head.weight")) && (wte = mgpu_model_param(pp, 0, "wte.weight")));
        printf("part 2: tied, %lld parameters, on 2 stages of 2 micro-batches\n", (long long)mgpu_model_param_count(pp));
        for (s = 0; s < 2; ++s)   /* a stage's floats: its parameters, the head's copy of wte included */
            printf("part 2: stage %d: entries %d-%d on %s, %lld floats\n", s, mgpu_model_stage_first_layer(pp, s),
                   mgpu_model_stage_first_layer(pp, s + 1) - 1, mgpu_device_label(mgpu_model_stage_device(pp, 0, s)),
                   (long long)mgpu_tensor_numel(mgpu_model_stage_params(pp, 0, s)));
        printf("part 2: lm_head.weight on %s is a copy of wte.weight on %s\n", mgpu_device_label(mgpu_tensor_device(head)),
               mgpu_device_label(mgpu_tensor_device(wte)));
        for (step = 0; step < STEPS; ++step) {
            TRY(mgpu_model_train_step(one, opt_one, x[step], y[step], &l1));
            TRY(mgpu_model_train_step(pp, opt_pp, x[step], y[step], &l2));
            printf("step %d  loss: one device %.4f  2 stages %.4f\n", step, (double)l1, (double)l2);
        }
        {   /* after every update the copy is the twin's values again, on any device: bit for bit */
            static float hh[MGPU_TOKENS_BYTE_VOCAB * WIDTH], hw[MGPU_TOKENS_BYTE_VOCAB * WIDTH];
            TRY(mgpu_tensor_download(head, hh, sizeof hh));
            TRY(mgpu_tensor_download(wte, hw, sizeof hw));
            copy_ok = memcmp(hh, hw, sizeof hh) == 0;
        }
        printf("part 2: after %d steps lm_head.weight = wte.weight: %s\n", STEPS, copy_ok ? "yes, bit for bit" : "NO");
        worst = max_diff(one, pp);
        if (copy_ok && (worst == 0.0f || (on_gpu && worst <= 1e-4f)))   /* GPUs: cuBLAS promises no order; AdamW magnifies rounding */
            printf("part 2: 2 stages = one device (%s)\n", worst == 0.0f ? "bit for bit" : "to rounding");
        else { printf("part 2: the parameters DIFFER by %g\n", (double)worst); failed = 1; }
        mgpu_optimizer_destroy(opt_one); mgpu_optimizer_destroy(opt_pp);
        mgpu_model_destroy(one); mgpu_model_destroy(pp);
    }
    for (step = 0; step < STEPS; ++step) { mgpu_tensor_destroy(x[step]); mgpu_tensor_destroy(y[step]); }
    mgpu_dataset_destroy(windows);
    mgpu_tokens_destroy(tokens);
    mgpu_device_set_destroy(many);
    mgpu_device_set_destroy(one_set);
    return failed;
}
