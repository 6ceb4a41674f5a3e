/* gru.c - a GRU (or an LSTM) written from tape ops, with no backward of its own, reading
   Fashion-MNIST images row by row: 28 steps of 28 pixels, then a Linear on the last hidden state.

   build/gru --data /usr/share/datasets/fashion-mnist --epochs 2
   build/gru --cell lstm --devices cpu:2

   The cell is the equations of nn.GRU (and nn.LSTM) as PyTorch's documentation gives them,
   written with mgpu_tape_* ops; mgpu_layer_from_ops (>>autograd) derives the backward, on the
   CPU, on GPUs and across replicas alike. Its parameters carry nn.GRU's names and initialisation
   ("0.weight_ih_l0" [3H, 28], "0.weight_hh_l0" [3H, H], "0.bias_ih_l0", "0.bias_hh_l0", each
   U(-1/sqrt(H), 1/sqrt(H))), so a checkpoint loads into torch.nn.GRU(28, H, batch_first=True).

   Flags as build/train's: --data DIR, --epochs N [2], --batch N [64], --lr F [0.002, AdamW],
   --devices SPEC [auto], --seed N [1], --save FILE, --max-steps N [0: no limit], and --cell
   gru|lstm [gru], --hidden H [128], --eval-rows N [0: the whole test set; fewer for a smoke
   test]. The last line is key=value pairs ending in test_acc=X. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEAN 0.2860f   /* the training set's pixel mean and deviation, as build/train's */
#define STD 0.3530f
#define STEPS 28       /* an image's rows, one per step */
#define INPUTS 28      /* and its columns, the features of a step */
#define FAIL(...) do { fprintf(stderr, "gru: " __VA_ARGS__); fprintf(stderr, "\n"); return 1; } while (0)

typedef struct cell { int lstm, hidden; } cell;

/* ---- the recurrent layer: its whole definition ---- */
static const mgpu_tensor* cell_forward(void* user, mgpu_tape* t, const mgpu_tensor* x, const mgpu_tensor* const* p) {
    const cell* c = (const cell*)user;
    const int64_t b = mgpu_tensor_dim(x, 0), h_ = c->hidden, g = c->lstm ? 4 : 3;
    /* every step's input part at once: x W_ih^T + b_ih, [b, STEPS, g*H] */
    const mgpu_tensor* xs = mgpu_tape_reshape(t, x, mgpu_shape2(b * STEPS, INPUTS));
    const mgpu_tensor* gx = mgpu_tape_reshape(t, mgpu_tape_add(t, mgpu_tape_matmul(t, xs, p[0], MGPU_NO_TRANS, MGPU_TRANS), p[2]),
                                              mgpu_shape3(b, STEPS, g * h_));
    const mgpu_tensor *h = mgpu_tape_full(t, mgpu_shape2(b, h_), 0.0f), *cs = h;
    for (int s = 0; s < STEPS; ++s) {
        const mgpu_tensor* gi = mgpu_tape_reshape(t, mgpu_tape_slice(t, gx, 1, s, 1), mgpu_shape2(b, g * h_));
        const mgpu_tensor* gh = mgpu_tape_add(t, mgpu_tape_matmul(t, h, p[1], MGPU_NO_TRANS, MGPU_TRANS), p[3]);
        if (c->lstm) {   /* i, f, g, o = gates; c' = f c + i g; h' = o tanh(c') */
            const mgpu_tensor* a = mgpu_tape_add(t, gi, gh);
            const mgpu_tensor* i = mgpu_tape_sigmoid(t, mgpu_tape_slice(t, a, 1, 0, h_));
            const mgpu_tensor* f = mgpu_tape_sigmoid(t, mgpu_tape_slice(t, a, 1, h_, h_));
            const mgpu_tensor* gg = mgpu_tape_tanh(t, mgpu_tape_slice(t, a, 1, 2 * h_, h_));
            const mgpu_tensor* o = mgpu_tape_sigmoid(t, mgpu_tape_slice(t, a, 1, 3 * h_, h_));
            cs = mgpu_tape_add(t, mgpu_tape_mul(t, f, cs), mgpu_tape_mul(t, i, gg));
            h = mgpu_tape_mul(t, o, mgpu_tape_tanh(t, cs));
        } else {         /* r, z, n; h' = (1 - z) n + z h = n + z (h - n) */
            const mgpu_tensor* r = mgpu_tape_sigmoid(t, mgpu_tape_add(t, mgpu_tape_slice(t, gi, 1, 0, h_), mgpu_tape_slice(t, gh, 1, 0, h_)));
            const mgpu_tensor* z = mgpu_tape_sigmoid(t, mgpu_tape_add(t, mgpu_tape_slice(t, gi, 1, h_, h_), mgpu_tape_slice(t, gh, 1, h_, h_)));
            const mgpu_tensor* n = mgpu_tape_tanh(t, mgpu_tape_add(t, mgpu_tape_slice(t, gi, 1, 2 * h_, h_),
                                                                   mgpu_tape_mul(t, r, mgpu_tape_slice(t, gh, 1, 2 * h_, h_))));
            h = mgpu_tape_add(t, n, mgpu_tape_mul(t, z, mgpu_tape_sub(t, h, n)));
        }
    }
    return h;   /* the last hidden state, [b, H] */
}
/* ---- */

static mgpu_result cell_shape(void* user, mgpu_shape x, mgpu_shape* y) {
    if (x.ndim != 4 || x.dim[1] * x.dim[2] != STEPS || x.dim[3] != INPUTS)
        return mgpu_fail(MGPU_ERROR_SHAPE_MISMATCH, "GRU: want images [batch, 1, 28, 28]");
    *y = mgpu_shape2(x.dim[0], ((const cell*)user)->hidden);
    return MGPU_OK;
}
static mgpu_layer* recurrent_layer(cell* c) {
    const int g = c->lstm ? 4 : 3;
    const float k = 1.0f / sqrtf((float)c->hidden);   /* nn.GRU's and nn.LSTM's U(-k, k) */
    const mgpu_op_param_desc params[4] = {
        { "weight_ih_l0", mgpu_shape2(g * c->hidden, INPUTS), MGPU_INIT_UNIFORM, k, 0 },
        { "weight_hh_l0", mgpu_shape2(g * c->hidden, c->hidden), MGPU_INIT_UNIFORM, k, 0 },
        { "bias_ih_l0", mgpu_shape1(g * c->hidden), MGPU_INIT_UNIFORM, k, 0 },
        { "bias_hh_l0", mgpu_shape1(g * c->hidden), MGPU_INIT_UNIFORM, k, 0 },
    };
    return mgpu_layer_from_ops(&(mgpu_op_layer_desc){ .type = c->lstm ? "LSTM" : "GRU", .params = params, .param_count = 4,
                                                      .forward = cell_forward, .output_shape = cell_shape, .user = c });
}

/* the IDX files, plain or gzipped, as build/train finds them */
static mgpu_dataset* load(const char* dir, const char* split) {
    char ip[1024], lp[1024];
    mgpu_dataset* ds;
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    if ((ds = mgpu_dataset_load_idx(ip, lp)) != NULL) return ds;
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte", dir, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte", dir, split);
    return mgpu_dataset_load_idx(ip, lp);
}

int main(int argc, char** argv) {
    const char *data = "/usr/share/datasets/fashion-mnist", *devices = "auto", *save = NULL;
    int epochs = 2, batch = 64, i;
    unsigned long long seed = 1;
    float lr = 0.002f, loss = 0.0f, test_loss = 0.0f;
    int64_t correct = 0, steps = 0, max_steps = 0, eval_rows = 0, rows = 0;
    cell c = { 0, 128 };
    for (i = 1; i < argc; ++i) {
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--help")) { printf("usage: gru [--data DIR] [--epochs N] [--batch N] [--lr F] [--devices SPEC] [--seed N] [--save FILE] [--max-steps N] [--cell gru|lstm] [--hidden H] [--eval-rows N]\n"); return 0; }
        if (!v) FAIL("unknown option or missing value: '%s' (see --help)", argv[i]);
        if (!strcmp(argv[i], "--data")) data = v;
        else if (!strcmp(argv[i], "--devices")) devices = v;
        else if (!strcmp(argv[i], "--save")) save = v;
        else if (!strcmp(argv[i], "--epochs")) epochs = atoi(v);
        else if (!strcmp(argv[i], "--batch")) batch = atoi(v);
        else if (!strcmp(argv[i], "--lr")) lr = (float)atof(v);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(argv[i], "--max-steps")) max_steps = atoll(v);
        else if (!strcmp(argv[i], "--hidden")) c.hidden = atoi(v);
        else if (!strcmp(argv[i], "--eval-rows")) eval_rows = atoll(v);
        else if (!strcmp(argv[i], "--cell") && (!strcmp(v, "gru") || !strcmp(v, "lstm"))) c.lstm = !strcmp(v, "lstm");
        else FAIL("unknown option '%s %s' (see --help)", argv[i], v);
        ++i;
    }
    if (epochs < 1 || batch < 1 || !(lr > 0.0f) || c.hidden < 1) FAIL("--epochs, --batch and --hidden must be at least 1, --lr positive");
    mgpu_device_set* set = mgpu_device_set_create(devices);
    mgpu_dataset *train = set ? load(data, "train") : NULL, *test = train ? load(data, "t10k") : NULL;
    if (!set || !train || !test) FAIL("%s", mgpu_last_error());
    if (eval_rows <= 0 || eval_rows > test->count) eval_rows = test->count;
    double t0 = mgpu_seconds();

    mgpu_layer* layers[] = { recurrent_layer(&c), mgpu_layer_linear(c.hidden, 10) };
    mgpu_model* model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape3(1, 28, 28), .layers = layers, .layer_count = 2,
                                                              .devices = set, .seed = seed });
    mgpu_loader* loader = model ? mgpu_loader_create(train, &(mgpu_loader_desc){ .batch = batch, .shuffle = 1, .seed = seed,
                                                                                  .mean = MEAN, .std = STD }) : NULL;
    mgpu_loader* all = loader ? mgpu_loader_create(test, &(mgpu_loader_desc){ .batch = eval_rows < 1000 ? (int)eval_rows : 1000, .mean = MEAN, .std = STD }) : NULL;
    mgpu_optimizer* opt = all ? mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .kind = MGPU_ADAMW, .lr = lr, .weight_decay = 0.0f,
                                                  .schedule = MGPU_SCHEDULE_COSINE, .total_steps = (int)(epochs * mgpu_loader_batches(loader)) }) : NULL;
    const mgpu_tensor *x, *y;
    if (!opt) FAIL("%s", mgpu_last_error());
    for (int epoch = 0; epoch < epochs; ++epoch) {
        float part_loss;
        int64_t part_correct;
        mgpu_loader_start(loader, epoch);
        while ((!max_steps || steps < max_steps) && mgpu_loader_next(loader, &x, &y)) {
            const int report = ++steps % 100 == 0 || steps == max_steps;
            if (mgpu_model_train_step(model, opt, x, y, report ? &loss : NULL) != MGPU_OK) FAIL("%s", mgpu_last_error());
            if (steps % 100 == 0) { printf("\repoch %d step %lld loss %.4f", epoch + 1, (long long)steps, (double)loss); fflush(stdout); }
        }
        /* the test set in batches of 1000 (a tape keeps every step's activations) */
        correct = rows = 0;
        test_loss = 0.0f;
        mgpu_loader_start(all, 0);
        while (rows < eval_rows && mgpu_loader_next(all, &x, &y)) {
            if (mgpu_model_evaluate(model, x, y, &part_loss, &part_correct) != MGPU_OK) FAIL("%s", mgpu_last_error());
            correct += part_correct;
            rows += mgpu_tensor_dim(x, 0);
            test_loss += part_loss * (float)mgpu_tensor_dim(x, 0);
        }
        test_loss /= (float)rows;
        printf("\nepoch %d: test accuracy %.4f, test loss %.4f (%lld images)\n", epoch + 1, (double)correct / (double)rows,
               (double)test_loss, (long long)rows);
        if (save && mgpu_model_save(model, opt, save) != MGPU_OK) FAIL("%s", mgpu_last_error());
    }

    printf("model=%s devices=%s replicas=%d hidden=%d batch=%d epochs=%d steps=%lld train_loss=%.4f test_loss=%.4f test_acc=%.4f "
           "seconds=%.1f\n", c.lstm ? "lstm" : "gru", mgpu_device_set_spec(set), mgpu_model_replica_count(model), c.hidden, batch, epochs,
           (long long)steps, (double)loss, (double)test_loss, (double)correct / (double)rows, mgpu_seconds() - t0);
    mgpu_optimizer_destroy(opt);
    mgpu_loader_destroy(all);
    mgpu_loader_destroy(loader);
    mgpu_model_destroy(model);
    mgpu_dataset_destroy(test);
    mgpu_dataset_destroy(train);
    mgpu_device_set_destroy(set);
    return 0;
}
