/* train.c - train a classifier on Fashion-MNIST with mgpu, on every GPU present or on the CPU.

   make demo                   (or: build/train --data /usr/share/datasets/fashion-mnist)
   build/train --model cnn --epochs 5 --devices cuda:0,1 --save fashion.safetensors
   build/train --help

   The last line it prints is key=value pairs (test_acc=, steps=, samples_per_s=, seconds=, ...),
   easy to grep from scripts and tests.

   Built with MGPU_MPI (make mpi: build/train_mpi), it is one job over many processes:
   mpirun -np 4 build/train_mpi --devices cpu (or srun build/train_mpi): every rank trains its
   replicas on its share of each batch, rank 0 prints and saves, and a rank that fails ends the job. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <math.h>
#include <limits.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/stat.h>
#include <unistd.h>
#endif

#define MAX_EPOCHS 1000000

typedef struct options {
    const char* data;
    const char* model;       /* mlp | cnn */
    const char* optimizer;   /* sgd | adamw */
    const char* devices;
    const char* save;
    const char* load;
    const char* schedule;    /* cosine | step | constant */
    const char* pipeline;    /* 1f1b | gpipe */
    const char* split;       /* "2,5": the first layer of stages 1, 2, ... */
    const char* trace;       /* a trace of three steps: Chrome's JSON, or an SVG picture */
    const char* precision;   /* fp32 | tf32 | bf16 */
    int stages, micro_batches, split_at[64];
    float dropout;
    int epochs, batch, quiet, graph, verbose, zero1;
    int64_t max_steps;
    float lr, momentum, weight_decay;
    float mean, std;         /* the input x = (pixel / 255 - mean) / std */
    unsigned long long seed;
} options;

static void usage(FILE* f) {
    fprintf(f,
            "usage: train [options]\n"
            "  --data DIR          Fashion-MNIST IDX files (.gz or plain) [/usr/share/datasets/fashion-mnist]\n"
            "  --model mlp|cnn     mlp: 784-128-10 with ReLU; cnn: two conv blocks and two linear layers [mlp]\n"
            "  --epochs N          passes over the training set [5]\n"
            "  --batch N           global batch, split across the devices [64]\n"
            "  --lr F              learning rate [0.05 sgd, 0.001 adamw]\n"
            "  --momentum F        SGD momentum [0.9]\n"
            "  --weight-decay F    [0 sgd, 0.01 adamw]\n"
            "  --optimizer NAME    sgd | adamw [sgd]\n"
            "  --schedule NAME     cosine | step | constant [cosine]\n"
            "  --seed N            initialisation, shuffling and dropout [1]\n"
            "  --mean F, --std F   the input normalisation, x = (pixel / 255 - mean) / std [0.2860, 0.3530: the\n"
            "                      training set's]; --mean 0 --std 1 is ToTensor() alone, as PyTorch's tutorials\n"
            "  --devices SPEC      auto, cpu, cpu:4, cuda, cuda:0,1, cuda:0,0 [auto]; with --stages S, R x S\n"
            "                      devices hold R replicas of an S-stage pipeline (replica r's stage s on device\n"
            "                      r * S + s): cpu:2 --stages 2, or cuda:0,1,2,3 --stages 2 for 2 x 2\n"
            "  --stages S          pipeline stages per replica, cut to balance the parameters [1]\n"
            "  --split L1,L2,...   the cut: the first layer of stages 1, 2, ... (sets --stages)\n"
            "  --micro-batches M   micro-batches per batch and replica [1; 2 x stages with stages]\n"
            "  --pipeline NAME     1f1b | gpipe: the order of the micro-batches' passes [1f1b]\n"
            "  --dropout P         a Dropout(P) after each hidden ReLU of the linear layers [none]\n"
            "  --precision NAME    fp32 | tf32 (fp32 with TF32 products on GPUs) | bf16 (mixed: bf16 activations and\n"
            "                      products, f32 parameters and optimizer) [fp32]\n"
            "  --trace FILE.json   a trace of three steps (the 6th to the 8th, or the first ones of a short run) in\n"
            "                      Chrome's trace format: open it in https://ui.perfetto.dev or chrome://tracing;\n"
            "  --trace FILE.svg    or as a picture that any browser opens (a row per device, a box per pass)\n"
            "  --max-steps N       stop after N optimizer steps in all (0: no limit) [0]\n"
            "  --graph             on GPUs, each step as one CUDA graph launch after the first of its batch shape\n"
            "                      (same results; steps a graph cannot hold run op by op, saying why once)\n"
            "  --zero1             each replica (of every process, with mpirun) holds and updates 1/N of the\n"
            "                      optimizer's state (ZeRO-1; the same results, the checkpoint whole)\n"
            "  --save FILE         write a safetensors checkpoint (model and optimizer) after each epoch, with the\n"
            "                      input normalisation in its metadata (input.mean, input.std)\n"
            "  --load FILE         resume from a checkpoint written by --save (or a PyTorch state_dict)\n"
            "  --quiet             no progress bars\n"
            "  --verbose           with each progress line, one line per replica: its rows and loss in that\n"
            "                      step, the bytes it all-reduced, and its counters since the start (ops,\n"
            "                      copies, waits for the device: mgpu_device_get_counters)\n"
            "  --help              this text\n");
}

/* An integer flag's value, whole and within [min, max]; else a message naming the flag. */
static int parse_int(const char* flag, const char* v, long long min, long long max, long long* out) {
    char* end = NULL;
    long long x;
    errno = 0;
    x = strtoll(v, &end, 10);
    if (end == v || *end) { fprintf(stderr, "train: %s: '%s' is not a whole number\n", flag, v); return 0; }
    if (errno == ERANGE || x < min || x > max) {
        fprintf(stderr, "train: %s: %s is out of range (%lld to %lld)\n", flag, v, min, max);
        return 0;
    }
    *out = x;
    return 1;
}
/* A float flag's value: a finite number (inf and nan are not learning rates). */
static int parse_float(const char* flag, const char* v, float* out) {
    char* end = NULL;
    double x;
    errno = 0;
    x = strtod(v, &end);
    if (end == v || *end) { fprintf(stderr, "train: %s: '%s' is not a number\n", flag, v); return 0; }
    if (!isfinite(x) || errno == ERANGE || fabs(x) > 3.0e38) { fprintf(stderr, "train: %s: %s is not a finite float\n", flag, v); return 0; }
    *out = (float)x;
    return 1;
}

/* --save is checked before any training: its folder must exist and be writable, and the path,
   its symlinks followed, must not be a directory, FIFO or device (mgpu_model_save would refuse
   it too, but only after an epoch of work). */
static int check_save_path(const char* path) {
#if defined(__unix__) || defined(__APPLE__)
    struct stat st;
    char dir[4096];
    const char* slash = strrchr(path, '/');
    if (!*path) { fprintf(stderr, "train: --save: empty path\n"); return 0; }
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        fprintf(stderr, "train: --save: '%s' is %s, not a regular file\n", path,
                S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO"
                : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device" : "something else");
        return 0;
    }
    if (!slash) strcpy(dir, ".");
    else if ((size_t)(slash - path) + 1 >= sizeof dir) { fprintf(stderr, "train: --save: '%s': path too long\n", path); return 0; }
    else {
        memcpy(dir, path, (size_t)(slash - path) + 1);   /* keeps the slash: "/" stays the root */
        dir[slash - path + 1] = 0;
    }
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "train: --save: '%s': the folder '%s' does not exist\n", path, dir);
        return 0;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        fprintf(stderr, "train: --save: '%s': cannot write in the folder '%s': %s\n", path, dir, strerror(errno));
        return 0;
    }
#else
    (void)path;
#endif
    return 1;
}

static int parse_args(int argc, char** argv, options* o) {
    int i, have_lr = 0, have_wd = 0;
    long long n;
    memset(o, 0, sizeof *o);
    o->data = "/usr/share/datasets/fashion-mnist";
    o->model = "mlp";
    o->optimizer = "sgd";
    o->devices = "auto";
    o->precision = "fp32";
    o->schedule = "cosine";
    o->epochs = 5;
    o->batch = 64;
    o->momentum = 0.9f;
    o->mean = 0.2860f;   /* Fashion-MNIST training-set pixel statistics */
    o->std = 0.3530f;
    o->seed = 1;
    for (i = 1; i < argc; ++i) {
        const char* a = argv[i];
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1, ok = 1;
        static const char* valued[] = { "--data", "--model", "--optimizer", "--schedule", "--devices", "--save", "--load",
                                        "--epochs", "--batch", "--max-steps", "--seed", "--lr", "--momentum", "--weight-decay", "--mean", "--std",
                                        "--stages", "--split", "--micro-batches", "--pipeline", "--dropout", "--trace", "--precision" };
        int known = 0;
        size_t k;
        for (k = 0; k < sizeof valued / sizeof valued[0]; ++k) known |= !strcmp(a, valued[k]);
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); exit(0); }
        else if (!strcmp(a, "--quiet")) { o->quiet = 1; takes = 0; }
        else if (!strcmp(a, "--graph")) { o->graph = 1; takes = 0; }
        else if (!strcmp(a, "--zero1")) { o->zero1 = 1; takes = 0; }
        else if (!strcmp(a, "--verbose")) { o->verbose = 1; takes = 0; }
        else if (!known) { fprintf(stderr, "train: unknown option '%s' (see --help)\n", a); return 0; }
        else if (!v) { fprintf(stderr, "train: %s needs a value (see --help)\n", a); return 0; }
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--optimizer")) o->optimizer = v;
        else if (!strcmp(a, "--schedule")) o->schedule = v;
        else if (!strcmp(a, "--devices")) o->devices = v;
        else if (!strcmp(a, "--stages")) { ok = parse_int(a, v, 1, 64, &n); o->stages = (int)n; }
        else if (!strcmp(a, "--micro-batches")) { ok = parse_int(a, v, 1, 4096, &n); o->micro_batches = (int)n; }
        else if (!strcmp(a, "--pipeline")) o->pipeline = v;
        else if (!strcmp(a, "--trace")) o->trace = v;
        else if (!strcmp(a, "--precision")) o->precision = v;
        else if (!strcmp(a, "--dropout")) ok = parse_float(a, v, &o->dropout);
        else if (!strcmp(a, "--split")) {   /* a list of layer numbers, each parsed like --stages */
            char item[32];
            const char* c = v;
            o->split = v;
            o->stages = 1;
            while (ok && *c) {
                size_t len = strcspn(c, ",");
                if (len == 0 || len >= sizeof item || o->stages > 63) { ok = 0; fprintf(stderr, "train: --split '%s' is not a list like 2,5\n", v); break; }
                memcpy(item, c, len);
                item[len] = 0;
                ok = parse_int(a, item, 1, 1 << 20, &n);
                o->split_at[o->stages - 1] = (int)n;
                o->stages++;
                c += len + (c[len] == ',');
            }
        }
        else if (!strcmp(a, "--save")) o->save = v;
        else if (!strcmp(a, "--load")) o->load = v;
        else if (!strcmp(a, "--epochs")) { ok = parse_int(a, v, 1, MAX_EPOCHS, &n); o->epochs = (int)n; }
        else if (!strcmp(a, "--batch")) { ok = parse_int(a, v, 1, 1 << 24, &n); o->batch = (int)n; }
        else if (!strcmp(a, "--max-steps")) { ok = parse_int(a, v, 0, (long long)1 << 53, &n); o->max_steps = n; }
        else if (!strcmp(a, "--seed")) {
            char* end = NULL;
            errno = 0;
            o->seed = strtoull(v, &end, 10);
            if (end == v || *end || errno == ERANGE || *v == '-') { fprintf(stderr, "train: --seed: '%s' is not a count from 0 to 2^64-1\n", v); return 0; }
        }
        else if (!strcmp(a, "--lr")) { ok = parse_float(a, v, &o->lr); have_lr = 1; }
        else if (!strcmp(a, "--momentum")) ok = parse_float(a, v, &o->momentum);
        else if (!strcmp(a, "--mean")) ok = parse_float(a, v, &o->mean);
        else if (!strcmp(a, "--std")) ok = parse_float(a, v, &o->std);
        else if (!strcmp(a, "--weight-decay")) { ok = parse_float(a, v, &o->weight_decay); have_wd = 1; }
        else { fprintf(stderr, "train: unknown option '%s' (see --help)\n", a); return 0; }
        if (!ok) return 0;
        i += takes;
    }
    if (strcmp(o->model, "mlp") && strcmp(o->model, "cnn")) { fprintf(stderr, "train: --model must be mlp or cnn, not '%s'\n", o->model); return 0; }
    if (strcmp(o->optimizer, "sgd") && strcmp(o->optimizer, "adamw")) { fprintf(stderr, "train: --optimizer must be sgd or adamw, not '%s'\n", o->optimizer); return 0; }
    if (strcmp(o->schedule, "cosine") && strcmp(o->schedule, "step") && strcmp(o->schedule, "constant")) { fprintf(stderr, "train: --schedule must be cosine, step or constant\n"); return 0; }
    if (o->pipeline && strcmp(o->pipeline, "1f1b") && strcmp(o->pipeline, "gpipe")) { fprintf(stderr, "train: --pipeline must be 1f1b or gpipe, not '%s'\n", o->pipeline); return 0; }
    if (strcmp(o->precision, "fp32") && strcmp(o->precision, "tf32") && strcmp(o->precision, "bf16")) {
        fprintf(stderr, "train: --precision must be fp32, tf32 or bf16, not '%s'\n", o->precision);
        return 0;
    }
    if (!(o->dropout >= 0 && o->dropout < 1)) { fprintf(stderr, "train: --dropout must be in [0, 1), not %g\n", (double)o->dropout); return 0; }
    if (!o->stages) o->stages = 1;
    if (!o->micro_batches) o->micro_batches = o->stages > 1 ? 2 * o->stages : 1;
    if (have_lr && !(o->lr > 0)) { fprintf(stderr, "train: --lr must be > 0, not %g\n", (double)o->lr); return 0; }
    if (have_wd && !(o->weight_decay >= 0)) { fprintf(stderr, "train: --weight-decay must be >= 0, not %g\n", (double)o->weight_decay); return 0; }
    if (!(o->std > 0)) { fprintf(stderr, "train: --std must be > 0, not %g\n", (double)o->std); return 0; }
    if (!(o->momentum >= 0 && o->momentum < 1)) { fprintf(stderr, "train: --momentum must be in [0, 1), not %g\n", (double)o->momentum); return 0; }
    if (!have_lr) o->lr = strcmp(o->optimizer, "adamw") ? 0.05f : 0.001f;
    if (!have_wd) o->weight_decay = strcmp(o->optimizer, "adamw") ? 0.0f : 0.01f;
    if (o->save && !check_save_path(o->save)) return 0;
    return 1;
}

/* The IDX file NAME in dir, gzipped or not; NULL (with a message) if neither is there. */
static const char* find_file(const char* dir, const char* name, char* buf, size_t size) {
    FILE* f;
    snprintf(buf, size, "%s/%s.gz", dir, name);
    if ((f = fopen(buf, "rb")) != NULL) { fclose(f); return buf; }
    snprintf(buf, size, "%s/%s", dir, name);
    if ((f = fopen(buf, "rb")) != NULL) { fclose(f); return buf; }
    fprintf(stderr,
            "train: Fashion-MNIST not found: no %s(.gz) in '%s'.\n"
            "  On Debian or Ubuntu:  sudo apt-get install dataset-fashion-mnist   (installs /usr/share/datasets/fashion-mnist)\n"
            "  Elsewhere: download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and\n"
            "  t10k-labels-idx1-ubyte.gz from https://github.com/zalandoresearch/fashion-mnist (folder data/fashion)\n"
            "  into one folder, and pass it with --data DIR.\n",
            name, dir);
    return NULL;
}

static mgpu_dataset* load_split(const char* dir, const char* prefix) {
    char ip[1024], lp[1024], in[64], ln[64];
    mgpu_dataset* ds;
    snprintf(in, sizeof in, "%s-images-idx3-ubyte", prefix);
    snprintf(ln, sizeof ln, "%s-labels-idx1-ubyte", prefix);
    if (!find_file(dir, in, ip, sizeof ip) || !find_file(dir, ln, lp, sizeof lp)) return NULL;
    ds = mgpu_dataset_load_idx(ip, lp);
    if (!ds) fprintf(stderr, "train: %s\n", mgpu_last_error());
    return ds;
}

static mgpu_model* build_model(const options* o, const mgpu_device_set* set) {
    /* the rest: defaults. MGPU_VERIFY_EVERY=N checks every N steps that the replicas hold the same
       parameters, bit for bit (the emulated multi-GPU tests use it) */
    mgpu_model_desc d = { .input = mgpu_shape3(1, 28, 28), .devices = set, .seed = o->seed,
                          .verify_every = getenv("MGPU_VERIFY_EVERY") ? atoi(getenv("MGPU_VERIFY_EVERY")) : 0,
                          .stages = o->stages, .split = o->split ? o->split_at : NULL, .micro_batches = o->micro_batches,
                          .schedule = o->pipeline && !strcmp(o->pipeline, "gpipe") ? MGPU_PIPELINE_GPIPE : MGPU_PIPELINE_1F1B,
                          .distributed = 1 /* every process of an MPI job; one process without one */,
                          .graph = o->graph, .zero1 = o->zero1,
                          .precision = strcmp(o->precision, "bf16") ? MGPU_F32 : MGPU_BF16 };
    int i;
    const int drop = o->dropout > 0;
    for (i = 0; !strcmp(o->precision, "tf32") && i < mgpu_device_set_count(set); ++i)
        if (mgpu_device_allow_tf32(mgpu_device_set_get(set, i), 1) != MGPU_OK) return NULL;
    if (!strcmp(o->model, "mlp")) {
        mgpu_layer* layers[5];
        int n = 0;
        layers[n++] = mgpu_layer_flatten();
        layers[n++] = mgpu_layer_linear(784, 128);
        layers[n++] = mgpu_layer_relu();
        if (drop) layers[n++] = mgpu_layer_dropout(o->dropout);
        layers[n++] = mgpu_layer_linear(128, 10);
        d.layers = layers;
        d.layer_count = n;
        return mgpu_model_create(&d);
    } else {
        mgpu_layer* layers[11];
        layers[0] = mgpu_layer_conv2d(1, 16, 3, 1, 1);    /* 16 x 28 x 28 */
        layers[1] = mgpu_layer_relu();
        layers[2] = mgpu_layer_maxpool2d(2, 2);          /* 16 x 14 x 14 */
        layers[3] = mgpu_layer_conv2d(16, 32, 3, 1, 1);   /* 32 x 14 x 14 */
        layers[4] = mgpu_layer_relu();
        layers[5] = mgpu_layer_maxpool2d(2, 2);          /* 32 x 7 x 7 */
        layers[6] = mgpu_layer_flatten();
        layers[7] = mgpu_layer_linear(32 * 7 * 7, 128);
        layers[8] = mgpu_layer_relu();
        if (drop) layers[9] = mgpu_layer_dropout(o->dropout);
        layers[9 + drop] = mgpu_layer_linear(128, 10);
        d.layers = layers;
        d.layer_count = 10 + drop;
        return mgpu_model_create(&d);
    }
}

/* Test-set tensors on the CPU, normalised like the training batches. */
static int make_test_tensors(const mgpu_dataset* ds, float mean, float std, mgpu_tensor** x, mgpu_tensor** y) {
    mgpu_device* cpu = mgpu_device_cpu();
    mgpu_tensor* raw = mgpu_tensor_create(cpu, MGPU_U8, mgpu_shape4(ds->count, 1, ds->rows, ds->cols));
    mgpu_tensor* lab = mgpu_tensor_create(cpu, MGPU_U8, mgpu_shape1(ds->count));
    int ok;
    *x = mgpu_tensor_create(cpu, MGPU_F32, mgpu_shape4(ds->count, 1, ds->rows, ds->cols));
    *y = mgpu_tensor_create(cpu, MGPU_I32, mgpu_shape1(ds->count));
    ok = raw && lab && *x && *y &&
         !mgpu_tensor_upload(raw, ds->images, (size_t)ds->count * ds->rows * ds->cols) &&
         !mgpu_tensor_upload(lab, ds->labels, (size_t)ds->count) &&
         !mgpu_tensor_convert(*x, raw, 1.0f / (255.0f * std), -mean / std) &&
         !mgpu_tensor_convert(*y, lab, 1.0f, 0.0f);
    mgpu_tensor_destroy(raw);
    mgpu_tensor_destroy(lab);
    return ok;
}

/* The checkpoint, with the input normalisation in its metadata: whoever loads the model (PyTorch
   included: safetensors.safe_open(path, "pt").metadata()) must feed it (pixel/255 - mean) / std. */
static int save_checkpoint(const mgpu_model* model, const mgpu_optimizer* opt, const char* path, float mean, float std) {
    char mean_text[32], std_text[32];
    mgpu_metadata meta[3];
    mgpu_save_desc sd;
    snprintf(mean_text, sizeof mean_text, "%.4f", (double)mean);
    snprintf(std_text, sizeof std_text, "%.4f", (double)std);
    meta[0].key = "input.mean";      meta[0].value = mean_text;
    meta[1].key = "input.std";       meta[1].value = std_text;
    meta[2].key = "input.transform"; meta[2].value = "(pixel / 255 - input.mean) / input.std";
    memset(&sd, 0, sizeof sd);
    sd.metadata = meta;
    sd.metadata_count = 3;
    return mgpu_model_save_ex(model, opt, path, &sd) == MGPU_OK;
}

/* One line per epoch, redrawn: progress, loss, throughput, and where it runs ("4 x cpu, host"). */
static void progress(const options* o, const char* where, int epoch, int64_t done, int64_t total, float loss, double rate,
                     int final) {
    int width = 30, filled = total ? (int)(width * done / total) : width, i;
    char bar[64];
    if (o->quiet) return;
    for (i = 0; i < width; ++i) bar[i] = i < filled ? '#' : '.';
    bar[width] = 0;
    printf("\repoch %d [%s] %5lld/%lld  loss %.4f  %8.0f samples/s  %s", epoch + 1, bar, (long long)done, (long long)total,
           (double)loss, rate, where);
    if (final) printf("\n");
    fflush(stdout);
}

/* --verbose: replica r's counters, summed over its stages' devices (its first stage's rows). */
#define MAX_VERBOSE 64
static void replica_counters(mgpu_model* model, int r, mgpu_device_counters* sum) {
    int s;
    memset(sum, 0, sizeof *sum);
    for (s = 0; s < mgpu_model_stage_count(model); ++s) {
        mgpu_device_counters k;
        mgpu_device_get_counters(mgpu_model_stage_device(model, r, s), &k);
        if (s == 0) { sum->rows_forward = k.rows_forward; sum->rows_backward = k.rows_backward; }
        sum->ops += k.ops;
        sum->bytes_allreduced += k.bytes_allreduced;
        sum->bytes_host_to_device += k.bytes_host_to_device;
        sum->bytes_device_to_host += k.bytes_device_to_host;
        sum->bytes_device_to_device += k.bytes_device_to_device;
        sum->host_waits += k.host_waits;
    }
}
/* What each replica did in the step just run (its counters now minus `before`, taken just
   before the step by replica_snapshot) and since the start. */
static void replica_lines(mgpu_model* model, int64_t step, const mgpu_device_counters* before) {
    int r;
    for (r = 0; r < mgpu_model_replica_count(model) && r < MAX_VERBOSE; ++r) {
        mgpu_device_counters sum;
        float loss = 0.0f;
        replica_counters(model, r, &sum);
        mgpu_model_replica_loss(model, r, &loss);
        printf("  replica %d on %s: step %lld rows=%llu loss=%.4f allreduced=%llu | since the start: rows=%llu allreduced=%llu "
               "ops=%llu h2d=%llu d2h=%llu d2d=%llu waits=%llu\n", r, mgpu_device_label(mgpu_model_device(model, r)), (long long)step,
               (unsigned long long)(sum.rows_backward - before[r].rows_backward), (double)loss,
               (unsigned long long)(sum.bytes_allreduced - before[r].bytes_allreduced), (unsigned long long)sum.rows_backward,
               (unsigned long long)sum.bytes_allreduced, (unsigned long long)sum.ops, (unsigned long long)sum.bytes_host_to_device,
               (unsigned long long)sum.bytes_device_to_host, (unsigned long long)sum.bytes_device_to_device,
               (unsigned long long)sum.host_waits);
    }
}
static void replica_snapshot(mgpu_model* model, mgpu_device_counters* before) {
    int r;
    for (r = 0; r < mgpu_model_replica_count(model) && r < MAX_VERBOSE; ++r) replica_counters(model, r, &before[r]);
}

int main(int argc, char** argv) {
    options o;
    mgpu_device_set* set = NULL;
    mgpu_dataset *train = NULL, *test = NULL;
    mgpu_model* model = NULL;
    mgpu_optimizer* opt = NULL;
    mgpu_loader* loader = NULL;
    mgpu_tensor *test_x = NULL, *test_y = NULL;
    float mean, std;   /* the input normalisation (--mean, --std) */
    int64_t batches, steps = 0, samples = 0, correct = 0, first_step, trace_from = 0;
    int traced = 0;
    double train_seconds = 0.0, start = mgpu_seconds();
    float loss = 0.0f, test_loss = 0.0f, test_acc = 0.0f;
    int64_t epoch;
    int status = 1, interactive = 0, stop = 0, rank, ranks;
    char where[128];
    mgpu_device_counters before[MAX_VERBOSE];
    if (mgpu_dist_init(&argc, &argv) != MGPU_OK) { fprintf(stderr, "train: %s\n", mgpu_last_error()); return 1; }
    rank = mgpu_dist_rank();   /* 0 of 1 without MPI */
    ranks = mgpu_dist_size();
#if defined(__unix__) || defined(__APPLE__)
    interactive = isatty(1);
#endif
    if (!parse_args(argc, argv, &o)) { status = 2; goto done; }
    mean = o.mean;
    std = o.std;
    if (rank != 0) o.quiet = 1;   /* rank 0 speaks for the job */
    set = mgpu_device_set_create(o.devices);   /* before the data: a bad --devices fails at once */
    if (!set) { fprintf(stderr, "train: --devices: %s\n", mgpu_last_error()); status = 2; goto done; }
    if (!(train = load_split(o.data, "train")) || !(test = load_split(o.data, "t10k"))) { status = 2; goto done; }
    model = build_model(&o, set);
    if (!model) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
    if (o.batch < mgpu_model_total_replica_count(model) * mgpu_model_micro_batches(model)) {
        fprintf(stderr, "train: --batch %d is smaller than the %d replicas x %d micro-batches of '%s'%s\n", o.batch,
                mgpu_model_total_replica_count(model), mgpu_model_micro_batches(model), o.devices, ranks > 1 ? " on every rank" : "");
        status = 2;
        goto done;
    }
    /* with several processes, each rank's loader gives its rows of the same global batches */
    loader = mgpu_loader_create(train, &(mgpu_loader_desc){ .batch = o.batch, .shuffle = 1, .seed = o.seed, .mean = mean, .std = std,
                                                           .shard_for = model });
    if (!loader || !make_test_tensors(test, mean, std, &test_x, &test_y)) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
    batches = mgpu_loader_batches(loader);
    if (batches < 1 || batches * o.epochs > INT_MAX) {   /* the schedule counts steps in an int */
        fprintf(stderr, "train: --epochs %d: %lld batches per epoch make %lld steps, more than %d\n", o.epochs, (long long)batches,
                (long long)batches * o.epochs, INT_MAX);
        status = 2;
        goto done;
    }
    {
        const int adamw = !strcmp(o.optimizer, "adamw");
        opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){
            .kind = adamw ? MGPU_ADAMW : MGPU_SGD,
            .lr = o.lr,
            .momentum = adamw ? 0.0f : o.momentum,
            .weight_decay = o.weight_decay,
            .schedule = !strcmp(o.schedule, "cosine") ? MGPU_SCHEDULE_COSINE
                      : !strcmp(o.schedule, "step") ? MGPU_SCHEDULE_STEP : MGPU_SCHEDULE_CONSTANT,
            .total_steps = (int)(batches * o.epochs),
            .step_size = (int)(batches * 2 < INT_MAX ? batches * 2 : INT_MAX) });
    }
    if (!opt) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
    if (o.load && mgpu_model_load(model, opt, o.load) != MGPU_OK) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
    if (!o.quiet) {
        mgpu_model_summary(model, stdout);
        printf("training %s on %s (%d device%s, all-reduce: %s), %lld images, batch %d, %s lr %g, %d epochs\n", o.model,
               mgpu_device_set_spec(set), mgpu_device_set_count(set), mgpu_device_set_count(set) == 1 ? "" : "s",
               mgpu_allreduce_name(mgpu_model_allreduce_backend(model)), (long long)train->count, o.batch, o.optimizer, (double)o.lr, o.epochs);
    }
    if (mgpu_model_stage_count(model) > 1)   /* the layout: R x S devices, M micro-batches */
        snprintf(where, sizeof where, "[%d x %d stages, %d micro-batches %s, all-reduce %s]", mgpu_model_replica_count(model),
                 mgpu_model_stage_count(model), mgpu_model_micro_batches(model), o.pipeline ? o.pipeline : "1f1b",
                 mgpu_allreduce_name(mgpu_model_allreduce_backend(model)));
    else if (ranks > 1)   /* a job of processes: each with its devices */
        snprintf(where, sizeof where, "[%d processes x %d device%s, all-reduce %s]", ranks, mgpu_device_set_count(set),
                 mgpu_device_set_count(set) == 1 ? "" : "s", mgpu_allreduce_name(mgpu_model_allreduce_backend(model)));
    else
        snprintf(where, sizeof where, "[%d device%s, all-reduce %s]", mgpu_device_set_count(set),
                 mgpu_device_set_count(set) == 1 ? "" : "s", mgpu_allreduce_name(mgpu_model_allreduce_backend(model)));
    steps = first_step = mgpu_optimizer_step_count(opt);   /* resuming: continue where the checkpoint stopped */
    {   /* the traced steps: the 6th to the 8th of this run, or its first ones when it is short */
        const int64_t planned = o.max_steps ? o.max_steps - first_step : batches * o.epochs - first_step;
        trace_from = first_step + (planned >= 8 ? 5 : 0);
    }
    if (o.verbose) {   /* --verbose counts from the first step: not the setup's copies (the test set, the replicas' first weights) */
        int d;
        for (d = 0; d < mgpu_device_set_count(set); ++d) mgpu_device_reset_counters(mgpu_device_set_get(set, d));
    }
    /* 64-bit: a checkpoint may hold up to 2^53 steps, far past an int's epochs */
    for (epoch = steps / batches; epoch < o.epochs && !stop; ++epoch) {
        const mgpu_tensor *x, *y;
        int64_t b = 0, epoch_samples = 0;
        double t0 = mgpu_seconds(), rate = 0.0;
        mgpu_memory_stats ms;
        mgpu_loader_start(loader, (int)epoch);
        for (; b < steps - epoch * batches; ++b) mgpu_loader_next(loader, NULL, NULL);   /* resumed mid-epoch */
        while (mgpu_loader_next(loader, &x, &y)) {
            if (o.max_steps && steps >= o.max_steps) { stop = 1; break; }
            /* the loss only when a line shows it: reading it waits for the GPU, which otherwise
               runs behind the host, one step queued after another */
            const int64_t every = interactive ? 20 : (batches / 4 > 0 ? batches / 4 : 1);
            const int show = (b + 1) % every == 0, last = b + 1 == batches || (o.max_steps && steps + 1 >= o.max_steps);
            if (o.trace && rank == 0 && steps == trace_from && mgpu_model_trace_start(model) != MGPU_OK) {
                fprintf(stderr, "\ntrain: --trace: %s\n", mgpu_last_error());
                goto done;
            }
            if (o.verbose && (show || last)) replica_snapshot(model, before);
            if (mgpu_model_train_step(model, opt, x, y, show || last ? &loss : NULL) != MGPU_OK) {
                fprintf(stderr, "\ntrain: %s\n", mgpu_last_error());
                goto done;
            }
            ++steps;
            if (o.trace && rank == 0 && (steps == trace_from + 3 || last) && steps > trace_from && !traced) {
                if (mgpu_model_trace_stop(model, o.trace) != MGPU_OK) { fprintf(stderr, "\ntrain: --trace: %s\n", mgpu_last_error()); goto done; }
                traced = 1;
            }
            ++b;
            epoch_samples = b * (int64_t)o.batch < train->count ? b * (int64_t)o.batch : train->count;   /* every rank's */
            rate = epoch_samples / (mgpu_seconds() - t0 + 1e-9);
            if (show) progress(&o, where, (int)epoch, b, batches, loss, rate, !interactive);
            if (o.verbose && rank == 0 && (show || last)) {   /* (after a redrawn bar: below it) */
                if (interactive && !o.quiet && show) printf("\n");
                replica_lines(model, steps, before);
            }
        }
        train_seconds += mgpu_seconds() - t0;
        samples += epoch_samples;
        progress(&o, where, (int)epoch, b, batches, loss, rate, 1);
        /* the replicas of all ranks are the same: rank 0 evaluates for the job */
        if (rank == 0 && mgpu_model_evaluate(model, test_x, test_y, &test_loss, &correct) != MGPU_OK) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
        test_acc = (float)correct / (float)test->count;
        mgpu_memory_get_stats(mgpu_model_device(model, 0), &ms);
        if (!o.quiet)
            printf("epoch %d: test accuracy %.4f, test loss %.4f, lr %.4g, device memory %.1f MiB in use (peak %.1f MiB) on %s\n",
                   (int)epoch + 1, (double)test_acc, (double)test_loss, (double)mgpu_optimizer_lr(opt),
                   ms.bytes_in_use / 1048576.0, ms.peak_bytes_in_use / 1048576.0, mgpu_device_label(mgpu_model_device(model, 0)));
        if (!o.quiet && mgpu_model_stage_count(model) > 1) {   /* the point of stages: each device holds its share */
            int s;
            printf("         per stage of replica 0, MiB in use (peak):");
            for (s = 0; s < mgpu_model_stage_count(model); ++s) {
                mgpu_memory_get_stats(mgpu_model_stage_device(model, 0, s), &ms);
                printf(" %s %.1f (%.1f)", mgpu_device_label(mgpu_model_stage_device(model, 0, s)), ms.bytes_in_use / 1048576.0,
                       ms.peak_bytes_in_use / 1048576.0);
            }
            printf("\n");
        }
        if (o.save && !save_checkpoint(model, opt, o.save, mean, std)) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
    }
    if (o.trace && rank == 0 && !traced) {   /* the run ended inside the traced steps, or before them */
        if (steps <= trace_from) fprintf(stderr, "train: --trace: the run ended before its step %lld\n", (long long)trace_from + 1);
        else if (mgpu_model_trace_stop(model, o.trace) != MGPU_OK) { fprintf(stderr, "train: --trace: %s\n", mgpu_last_error()); goto done; }
    }
    if (steps == first_step) {   /* nothing trained (a finished checkpoint): still report the model */
        if (mgpu_model_evaluate(model, test_x, test_y, &test_loss, &correct) != MGPU_OK) { fprintf(stderr, "train: %s\n", mgpu_last_error()); goto done; }
        test_acc = (float)correct / (float)test->count;
    }
    if (rank == 0)   /* replicas: of the whole job; devices: rank 0's */
        printf("model=%s processes=%d devices=%s replicas=%d stages=%d micro_batches=%d allreduce=%s optimizer=%s batch=%d "
               "epochs=%d steps=%lld train_loss=%.4f test_loss=%.4f test_acc=%.4f samples_per_s=%.0f seconds=%.2f\n",
               o.model, ranks, mgpu_device_set_spec(set), mgpu_model_total_replica_count(model), mgpu_model_stage_count(model),
               mgpu_model_micro_batches(model), mgpu_allreduce_name(mgpu_model_allreduce_backend(model)),
               o.optimizer, o.batch, o.epochs, (long long)steps,
               (double)loss, (double)test_loss, (double)test_acc, train_seconds > 0 ? samples / train_seconds : 0.0, mgpu_seconds() - start);
    if (rank == 0 && o.graph) printf("graph_steps=%lld\n", (long long)mgpu_model_graph_steps(model));
    status = 0;
done:
    /* one destroy per create, in reverse order; each takes NULL */
    mgpu_tensor_destroy(test_x);
    mgpu_tensor_destroy(test_y);
    mgpu_loader_destroy(loader);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    mgpu_device_set_destroy(set);
    mgpu_dataset_destroy(train);
    mgpu_dataset_destroy(test);
    /* A failure every rank shares ("rank 1 of 4: ...": a step, a save) ends each rank by itself;
       one of this rank alone (its data, its arguments) ends the others too, now, not at their next
       step's vote. */
    if (status != 0 && ranks > 1 && strncmp(mgpu_last_error(), "rank ", 5) != 0) mgpu_dist_abort(status);
    mgpu_dist_shutdown();
    return status;
}
