/* gpt.c - a GPT-2 of any size trained on a token file or a text file, with mgpu, on every device
   present (or on the CPU): progress, validation loss, a checkpoint and text sampled at the end.

   build/gpt --text /usr/share/games/fortunes/fortunes --steps 500          (a byte-level GPT)
   build/gpt --data train.bin --val val.bin --layers 12 --width 768 --heads 12 --seq 1024
   build/gpt --load model.safetensors --heads 12 --val val.bin --eval-only   (Hugging Face's GPT-2)
   build/gpt --help

   The model is Hugging Face's GPT2LMHeadModel, names and all: token and position embeddings, a
   dropout, blocks of LayerNorm -> causal self-attention and LayerNorm -> MLP (Conv1D, GELU in
   its tanh form, Conv1D) each added to its input, a last LayerNorm, and the output head tied to
   the token embedding. --load reads a file in its layout (save_pretrained's "transformer.wte.
   weight", ..., or the hub's "wte.weight", ...) and --save writes one that GPT2LMHeadModel
   loads. The last line it prints is key=value pairs (val_loss=, none without validation tokens;
   train_loss=, steps=, ...).

   Built with mpicc -DMGPU_MPI (make mpi: build/gpt_mpi) it is one job over many processes:
   mpirun -np 8 build/gpt_mpi --zero1 ... trains one model on every rank's devices, each rank on
   its share of every batch; rank 0 prints, evaluates and samples, and a rank that fails ends the
   job. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef struct options {
    const char *load, *data, *text, *val, *optimizer, *devices, *save, *precision;
    int heads, layers, width, seq, batch, steps, sample, shuffle, eval_only, every, top_k, graph, recompute, zero1;
    float lr, dropout, temperature, weight_decay, clip;
    unsigned long long seed;
} options;

static void usage(FILE* f) {
    fprintf(f,
            "usage: gpt [options]\n"
            "  --load FILE         a GPT-2 in Hugging Face's layout (safetensors); its sizes come from the file\n"
            "  --heads N           attention heads [4; 12 for GPT-2's files]\n"
            "  --layers N          blocks, without --load [4]\n"
            "  --width N           the embedding width, without --load [128]\n"
            "  --data FILE         training tokens, llm.c's format (a header of 256 int32, then uint16 tokens)\n"
            "  --text FILE         training text, byte-level tokens (vocabulary 256); 10%% held out for validation\n"
            "  --val FILE          validation tokens (llm.c's format; with --text: text)\n"
            "  --seq T             tokens per window [64]\n"
            "  --batch B           windows per step, split across the devices [16]\n"
            "  --steps N           training steps [200]\n"
            "  --optimizer NAME    sgd | adamw [adamw]\n"
            "  --lr L              constant learning rate [0.001 adamw, 0.1 sgd]; plain SGD: no momentum\n"
            "  --weight-decay F    on the weight matrices alone (GPT-2's rule: no biases, norms) [0]\n"
            "  --clip F            clip the gradients' global norm to F, 0: off [0]\n"
            "  --dropout P         embedding, attention and residual dropout [0]\n"
            "  --no-shuffle        batch k holds windows kB .. kB+B-1 in order, wrapping at the end\n"
            "  --devices SPEC      auto | cpu | cpu:4 | cuda | cuda:0,1 ... [auto]\n"
            "  --graph             each training step on GPUs as one CUDA graph launch (the same bits as without;\n"
            "                      graph_steps= on the last line counts them)\n"
            "  --precision NAME    fp32 | bf16 (mixed: bf16 activations and products, f32 parameters) [fp32]\n"
            "  --recompute         LayerNorm and GELU outputs computed again in backward, not kept (less memory,\n"
            "                      the same bits)\n"
            "  --zero1             each device holds and updates 1/N of the optimizer's state (ZeRO-1; the same bits)\n"
            "  --save FILE         the trained model in Hugging Face's layout (transformer.*)\n"
            "  --sample N          tokens of text sampled at the end [200 with --text, else 0]\n"
            "  --temperature F     of the samples [0.8]\n"
            "  --top-k K           sample from the K likeliest tokens, 0 for all [40]\n"
            "  --eval-only         print the validation loss (val_loss=X, nats per token) and stop\n"
            "  --every N           a progress line every N steps [20]\n"
            "  --seed N            initialisation, shuffling, dropout and sampling [1]\n");
}

static int parse_args(int argc, char** argv, options* o) {
    int i;
    memset(o, 0, sizeof *o);
    o->heads = 4; o->layers = 4; o->width = 128; o->seq = 64; o->batch = 16; o->steps = 200; o->shuffle = 1;
    o->every = 20; o->top_k = 40; o->temperature = 0.8f; o->seed = 1; o->sample = -1; o->optimizer = "adamw"; o->precision = "fp32";
    o->devices = "auto"; o->lr = -1.0f;
    for (i = 1; i < argc; ++i) {
        const char* a = argv[i];
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        char* end = NULL;
        long long n = 0;
        double f = 0;
        int flag = !strcmp(a, "--no-shuffle") || !strcmp(a, "--eval-only") || !strcmp(a, "--graph") || !strcmp(a, "--recompute") ||
                   !strcmp(a, "--zero1") || !strcmp(a, "--help") || !strcmp(a, "-h");
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); exit(0); }
        if (!strcmp(a, "--no-shuffle")) { o->shuffle = 0; continue; }
        if (!strcmp(a, "--eval-only")) { o->eval_only = 1; continue; }
        if (!strcmp(a, "--graph")) { o->graph = 1; continue; }
        if (!strcmp(a, "--recompute")) { o->recompute = 1; continue; }
        if (!strcmp(a, "--zero1")) { o->zero1 = 1; continue; }
        if (!flag && !v) { fprintf(stderr, "gpt: %s needs a value (--help)\n", a); return 0; }
        if (v) { n = strtoll(v, &end, 10); f = strtod(v, NULL); }
#define GPT_INT(name, field, lo, hi)                                                                       \
        if (!strcmp(a, name)) {                                                                            \
            if (!end || *end || n < (lo) || n > (hi)) {                                                    \
                fprintf(stderr, "gpt: %s %s: want a whole number from %lld to %lld\n", a, v, (long long)(lo), (long long)(hi)); \
                return 0;                                                                                  \
            }                                                                                              \
            o->field = (int)n; ++i; continue;                                                              \
        }
        GPT_INT("--heads", heads, 1, 1024) GPT_INT("--layers", layers, 1, 256) GPT_INT("--width", width, 1, 65536)
        GPT_INT("--seq", seq, 1, 1 << 20) GPT_INT("--batch", batch, 1, 1 << 24) GPT_INT("--steps", steps, 0, 1 << 30)
        GPT_INT("--sample", sample, 0, 1 << 24) GPT_INT("--every", every, 1, 1 << 30) GPT_INT("--top-k", top_k, 0, 1 << 30)
#undef GPT_INT
        if (!strcmp(a, "--seed")) { o->seed = strtoull(v, &end, 10); if (!end || *end) goto bad; ++i; continue; }
        if (!strcmp(a, "--lr") || !strcmp(a, "--dropout") || !strcmp(a, "--temperature") || !strcmp(a, "--weight-decay") ||
            !strcmp(a, "--clip")) {
            strtod(v, &end);
            if (!end || *end || !(f >= 0.0) || (!strcmp(a, "--dropout") && f >= 1.0)) goto bad;
            if (!strcmp(a, "--lr")) o->lr = (float)f;
            else if (!strcmp(a, "--dropout")) o->dropout = (float)f;
            else if (!strcmp(a, "--temperature")) o->temperature = (float)f;
            else if (!strcmp(a, "--clip")) o->clip = (float)f;
            else o->weight_decay = (float)f;
            ++i;
            continue;
        }
        if (!strcmp(a, "--load")) o->load = v;
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--text")) o->text = v;
        else if (!strcmp(a, "--val")) o->val = v;
        else if (!strcmp(a, "--optimizer")) o->optimizer = v;
        else if (!strcmp(a, "--devices")) o->devices = v;
        else if (!strcmp(a, "--save")) o->save = v;
        else if (!strcmp(a, "--precision")) o->precision = v;
        else { fprintf(stderr, "gpt: unknown option %s (--help)\n", a); return 0; }
        ++i;
        continue;
    bad:
        fprintf(stderr, "gpt: %s %s: not a valid value (--help)\n", a, v);
        return 0;
    }
    if (strcmp(o->optimizer, "sgd") && strcmp(o->optimizer, "adamw")) {
        fprintf(stderr, "gpt: --optimizer %s: want sgd or adamw\n", o->optimizer);
        return 0;
    }
    if (strcmp(o->precision, "fp32") && strcmp(o->precision, "bf16")) {
        fprintf(stderr, "gpt: --precision %s: want fp32 or bf16\n", o->precision);
        return 0;
    }
    if (o->data && o->text) { fprintf(stderr, "gpt: --data or --text, not both\n"); return 0; }
    if (!o->eval_only && !o->data && !o->text) { fprintf(stderr, "gpt: nothing to train on: --data FILE or --text FILE (--help)\n"); return 0; }
    if (o->eval_only && !o->val && !o->text) { fprintf(stderr, "gpt: --eval-only needs --val FILE (or --text)\n"); return 0; }
    if (o->lr < 0.0f) o->lr = strcmp(o->optimizer, "sgd") ? 0.001f : 0.1f;
    if (o->sample < 0) o->sample = o->text ? 200 : 0;
    return 1;
}

/* ---- the model: GPT-2 in mgpu's layers, with Hugging Face's names ---- */
typedef struct gpt_shape { int vocab, positions, layers, width, heads; } gpt_shape;

static mgpu_layer* gpt_block(int i, int C, int H, float p) {
    char name[32];
    mgpu_layer* attn[2] = { mgpu_layer_name(mgpu_layer_layer_norm(C), "ln_1"),
                            mgpu_layer_name(mgpu_layer_causal_self_attention(C, H, p), "attn") };
    mgpu_layer* mlp[4] = { mgpu_layer_name(mgpu_layer_conv1d(C, 4 * C), "c_fc"), mgpu_layer_gelu_tanh(),
                           mgpu_layer_name(mgpu_layer_conv1d(4 * C, C), "c_proj"), mgpu_layer_dropout(p) };
    mgpu_layer* ff[2] = { mgpu_layer_name(mgpu_layer_layer_norm(C), "ln_2"), mgpu_layer_name(mgpu_layer_sequential(mlp, 4), "mlp") };
    mgpu_layer* both[2] = { mgpu_layer_residual(mgpu_layer_sequential(attn, 2), NULL),    /* x + attn(ln_1(x)) */
                            mgpu_layer_residual(mgpu_layer_sequential(ff, 2), NULL) };    /* x + mlp(ln_2(x)) */
    snprintf(name, sizeof name, "h.%d", i);
    both[0] = mgpu_layer_name(both[0], "");   /* their children's names as they are: h.0.ln_1.weight */
    both[1] = mgpu_layer_name(both[1], "");
    return mgpu_layer_name(mgpu_layer_sequential(both, 2), name);
}

static mgpu_model* gpt_create(const gpt_shape* g, const options* o, const mgpu_device_set* set) {
    static const mgpu_tie head_is_wte = { "lm_head.weight", "wte.weight" };
    mgpu_layer* layers[256 + 6];
    int n = 0, i;
    layers[n++] = mgpu_layer_name(mgpu_layer_embedding(g->vocab, g->width), "wte");
    layers[n++] = mgpu_layer_name(mgpu_layer_position_embedding(g->positions, g->width), "wpe");
    layers[n++] = mgpu_layer_dropout(o->dropout);
    for (i = 0; i < g->layers; ++i) layers[n++] = gpt_block(i, g->width, g->heads, o->dropout);
    layers[n++] = mgpu_layer_name(mgpu_layer_layer_norm(g->width), "ln_f");
    layers[n++] = mgpu_layer_name(mgpu_layer_linear_no_bias(g->width, g->vocab), "lm_head");
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(o->seq), .input_dtype = MGPU_I32, .layers = layers,
                                                 .layer_count = n, .devices = set, .seed = o->seed, .ties = &head_is_wte,
                                                 .tie_count = 1, .graph = o->graph, .recompute = o->recompute, .zero1 = o->zero1,
                                                 .distributed = 1 /* every process of an MPI job; one process without one */,
                                                 .precision = strcmp(o->precision, "bf16") ? MGPU_F32 : MGPU_BF16 });
}

/* The sizes of a GPT-2 file, and the prefix its names have ("transformer." or none). */
static int gpt_shape_of_file(const char* path, int heads, gpt_shape* g, const char** prefix) {
    mgpu_safetensors* st = mgpu_safetensors_open(path);
    mgpu_safetensors_info wte, wpe;
    char name[64];
    if (!st) { fprintf(stderr, "gpt: %s\n", mgpu_last_error()); return 0; }
    *prefix = mgpu_safetensors_find(st, "transformer.wte.weight") >= 0 ? "transformer." : "";
    snprintf(name, sizeof name, "%swpe.weight", *prefix);
    if (mgpu_safetensors_get_info(st, mgpu_safetensors_find(st, name) >= 0 ? mgpu_safetensors_find(st, name) : -1, &wpe) != MGPU_OK ||
        (snprintf(name, sizeof name, "%swte.weight", *prefix),
         mgpu_safetensors_get_info(st, mgpu_safetensors_find(st, name), &wte)) != MGPU_OK ||
        wte.ndim != 2 || wpe.ndim != 2 || wte.shape[1] != wpe.shape[1]) {
        fprintf(stderr, "gpt: '%s' is not a GPT-2 in Hugging Face's layout (no [vocab, width] wte.weight and [positions, "
                "width] wpe.weight, with or without 'transformer.')\n", path);
        mgpu_safetensors_close(st);
        return 0;
    }
    g->vocab = (int)wte.shape[0];
    g->positions = (int)wpe.shape[0];
    g->width = (int)wte.shape[1];
    g->heads = heads;
    for (g->layers = 0; g->layers < 256; ++g->layers) {
        snprintf(name, sizeof name, "%sh.%d.ln_1.weight", *prefix, g->layers);
        if (mgpu_safetensors_find(st, name) < 0) break;
    }
    mgpu_clear_error();
    mgpu_safetensors_close(st);
    return 1;
}

/* The mean next-token loss over every window of `val` (each token weighs the same), in batches of B. */
static int gpt_eval(mgpu_model* m, mgpu_dataset* val, int B, double* mean) {
    mgpu_loader* l = mgpu_loader_create(val, &(mgpu_loader_desc){ .batch = B });
    const mgpu_tensor *x, *y;
    double sum = 0.0;
    int64_t tokens = 0;
    if (!l) return 0;
    mgpu_loader_start(l, 0);
    while (mgpu_loader_next(l, &x, &y)) {
        float loss;
        if (mgpu_model_evaluate(m, x, y, &loss, NULL) != MGPU_OK) { mgpu_loader_destroy(l); return 0; }
        sum += (double)loss * (double)mgpu_tensor_numel(y);
        tokens += mgpu_tensor_numel(y);
    }
    mgpu_loader_destroy(l);
    *mean = tokens ? sum / (double)tokens : 0.0;
    return 1;
}

/* N tokens after `start`, each drawn from softmax(logits / temperature) over the top k. */
static int gpt_sample(mgpu_model* m, int T, int vocab, int N, int start, float temperature, int top_k, uint64_t seed) {
    mgpu_tensor* x = mgpu_tensor_create(mgpu_model_device(m, 0), MGPU_I32, mgpu_shape2(1, T));
    int32_t* ctx = (int32_t*)calloc((size_t)T + (size_t)N + 1, sizeof(int32_t));
    float* logits = (float*)malloc((size_t)T * (size_t)vocab * sizeof(float));
    double* p = (double*)malloc((size_t)vocab * sizeof(double));
    int32_t* window = (int32_t*)malloc((size_t)T * sizeof(int32_t));
    int n = 1, i, ok = x && ctx && logits && p && window;
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    ctx[0] = start;
    for (i = 0; ok && i < N; ++i) {
        const int len = n < T ? n : T, at = n - len;   /* the last T tokens, padded after them */
        const mgpu_tensor* out;
        const float* row = logits + (size_t)(len - 1) * vocab;   /* causal: position len - 1 saw the context alone */
        double total = 0.0, r, kth = -INFINITY, mx = -INFINITY;
        int j, k;
        memset(window, 0, sizeof(int32_t) * (size_t)T);
        memcpy(window, ctx + at, sizeof(int32_t) * (size_t)len);
        ok = mgpu_tensor_upload(x, window, sizeof(int32_t) * (size_t)T) == MGPU_OK && (out = mgpu_model_forward(m, 0, x, 0)) != NULL &&
             mgpu_tensor_download(out, logits, sizeof(float) * (size_t)T * (size_t)vocab) == MGPU_OK;
        if (!ok) break;
        if (top_k > 0 && top_k < vocab) {   /* the k-th largest logit, by k passes (small k) */
            double prev = INFINITY;
            for (k = 0; k < top_k; ++k) {
                double best = -INFINITY;
                for (j = 0; j < vocab; ++j)
                    if (row[j] < prev && row[j] > best) best = row[j];
                prev = kth = best;
            }
        }
        for (j = 0; j < vocab; ++j) mx = row[j] > mx ? row[j] : mx;
        for (j = 0; j < vocab; ++j) {
            p[j] = row[j] < kth ? 0.0 : exp((row[j] - mx) / (temperature > 0 ? temperature : 1e-6));
            total += p[j];
        }
        s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
        r = (double)((s * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0 * total;
        for (j = 0; j < vocab - 1 && (r -= p[j]) > 0; ++j) {}
        ctx[n++] = j;
    }
    if (ok && vocab <= 256) {
        char text[8192];
        mgpu_tokens_to_text(ctx + 1, n - 1, text, sizeof text);
        printf("---- sample ----\n%s\n----------------\n", text);
    } else if (ok) {
        printf("---- sample (token ids) ----\n");
        for (i = 1; i < n; ++i) printf("%d%c", ctx[i], i % 20 == 0 ? '\n' : ' ');
        printf("\n");
    }
    mgpu_tensor_destroy(x);
    free(ctx); free(logits); free(p); free(window);
    return ok;
}

/* Token files, or the byte-level tokens of a text (90% to train on, the rest to validate). */
static int gpt_data(const options* o, mgpu_tokens** train, mgpu_tokens** val) {
    *train = *val = NULL;
    if (o->text) {
        mgpu_tokens* all = mgpu_tokens_from_text(o->text);
        int64_t n = mgpu_tokens_count(all), cut = n - n / 10;
        if (!all) return 0;
        *train = mgpu_tokens_from_memory(mgpu_tokens_data(all), cut);
        *val = o->val ? mgpu_tokens_from_text(o->val) : mgpu_tokens_from_memory(mgpu_tokens_data(all) + cut, n - cut);
        mgpu_tokens_destroy(all);
        return *train && *val;
    }
    if (o->data && !(*train = mgpu_tokens_load(o->data))) return 0;
    if (o->val && !(*val = mgpu_tokens_load(o->val))) return 0;
    return 1;
}

int main(int argc, char** argv) {
    options o;
    gpt_shape g;
    const char* prefix = "transformer.";
    mgpu_tokens *train = NULL, *val = NULL;
    mgpu_dataset *train_set = NULL, *val_set = NULL;
    mgpu_device_set* set = NULL;
    mgpu_model* m = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_loader* loader = NULL;
    double val_loss = NAN, t0;
    float loss = NAN;
    int step = 0, epoch = 0, rc = 1, rank;
    setvbuf(stdout, NULL, _IOLBF, 0);   /* progress lines as they come, also into a pipe */
    if (mgpu_dist_init(&argc, &argv) != MGPU_OK) { fprintf(stderr, "gpt: %s\n", mgpu_last_error()); return 1; }
    rank = mgpu_dist_rank();   /* 0 of 1 without MPI: rank 0 speaks, evaluates and samples for the job */
    if (!parse_args(argc, argv, &o)) { rc = 2; goto done; }
    if (!gpt_data(&o, &train, &val)) goto fail;
    g.vocab = o.text ? MGPU_TOKENS_BYTE_VOCAB : 50257;
    g.positions = o.seq; g.layers = o.layers; g.width = o.width; g.heads = o.heads;
    if (o.load && !gpt_shape_of_file(o.load, o.heads, &g, &prefix)) goto done;
    if (o.seq > g.positions) { fprintf(stderr, "gpt: --seq %d is longer than the model's %d positions\n", o.seq, g.positions); goto done; }
    if ((train && mgpu_tokens_max_id(train) >= g.vocab) || (val && mgpu_tokens_max_id(val) >= g.vocab)) {
        fprintf(stderr, "gpt: token %d of '%s' is past the model's vocabulary of %d\n",
                mgpu_tokens_max_id(train && mgpu_tokens_max_id(train) >= g.vocab ? train : val),
                train && mgpu_tokens_max_id(train) >= g.vocab ? (o.data ? o.data : o.text) : (o.val ? o.val : o.text), g.vocab);
        goto done;
    }
    if (!(set = mgpu_device_set_create(o.devices)) || !(m = gpt_create(&g, &o, set))) goto fail;
    if (o.load && mgpu_model_load_ex(m, NULL, o.load, &(mgpu_load_desc){ .prefix = prefix, .allow_extra = 1 }) != MGPU_OK) goto fail;
    if (rank == 0)
        printf("GPT: %d layers, %d heads, width %d, vocabulary %d, %d positions, %lld parameters, on %s%s\n", g.layers, g.heads,
               g.width, g.vocab, g.positions, (long long)mgpu_model_param_count(m), mgpu_device_set_spec(set),
               mgpu_dist_size() > 1 ? " on every rank" : "");
    if (val && !(val_set = mgpu_dataset_tokens(val, o.seq))) goto fail;
    if (o.eval_only) {
        if (rank == 0 && !gpt_eval(m, val_set, o.batch, &val_loss)) goto fail;
        if (rank == 0) printf("val_loss=%.6f\n", val_loss);
        rc = 0;
        goto done;
    }
    /* ---- training: the loop of any mgpu program ---- */
    if (!(train_set = mgpu_dataset_tokens(train, o.seq)) ||
        !(loader = mgpu_loader_create(train_set, &(mgpu_loader_desc){ .batch = o.batch, .shuffle = o.shuffle, .seed = o.seed,
                                                                        .wrap = 1, .shard_for = m })) ||
        !(opt = mgpu_optimizer_create(m, &(mgpu_optimizer_desc){ .kind = strcmp(o.optimizer, "sgd") ? MGPU_ADAMW : MGPU_SGD,
                                                                  .lr = o.lr, .weight_decay = o.weight_decay,
                                                                  .decay_matrices_only = 1, .clip_norm = o.clip,
                                                                  .beta1 = 0.9f, .beta2 = 0.95f })))
        goto fail;
    t0 = mgpu_seconds();
    mgpu_loader_start(loader, epoch);
    for (step = 1; step <= o.steps; ++step) {
        const mgpu_tensor *x, *y;
        if (!mgpu_loader_next(loader, &x, &y)) {   /* the next epoch */
            mgpu_loader_start(loader, ++epoch);
            if (!mgpu_loader_next(loader, &x, &y)) break;
        }
        if (mgpu_model_train_step(m, opt, x, y, step % o.every == 0 || step == o.steps ? &loss : NULL) != MGPU_OK) goto fail;
        if (rank == 0 && (step % o.every == 0 || step == o.steps))
            printf("step %5d  loss %.4f  %.1f ms/step\n", step, (double)loss, 1e3 * (mgpu_seconds() - t0) / step);
    }
    if (rank == 0 && val_set && !gpt_eval(m, val_set, o.batch, &val_loss)) goto fail;
    if (o.save && mgpu_model_save_ex(m, NULL, o.save, &(mgpu_save_desc){ .prefix = "transformer." }) != MGPU_OK) goto fail;
    if (rank == 0 && o.sample > 0 &&
        !gpt_sample(m, o.seq, g.vocab, o.sample, o.text ? '\n' : 50256 % g.vocab, o.temperature, o.top_k, o.seed))
        goto fail;
    if (rank != 0) { rc = 0; goto done; }
    if (val_set) printf("val_loss=%.6f ", val_loss);
    else printf("val_loss=none ");   /* --data without --val: nothing held out */
    printf("train_loss=%.6f steps=%d seconds=%.1f", (double)loss, step - 1, mgpu_seconds() - t0);
    if (o.graph) printf(" graph_steps=%lld", (long long)mgpu_model_graph_steps(m));
    printf("\n");
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "gpt: %s\n", mgpu_last_error());
done:
    /* a failure every rank shares ("rank 1 of 4: ...", a step, a save) ends each rank by itself; one of
       this rank alone (its data, its arguments) ends the others too, now */
    if (rc != 0 && mgpu_dist_size() > 1 && strncmp(mgpu_last_error(), "rank ", 5) != 0) mgpu_dist_abort(rc);
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(m);
    mgpu_dataset_destroy(train_set);
    mgpu_dataset_destroy(val_set);
    mgpu_tokens_destroy(train);
    mgpu_tokens_destroy(val);
    mgpu_device_set_destroy(set);
    mgpu_dist_shutdown();
    return rc;
}
