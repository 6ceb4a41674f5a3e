/* tests/test_save_faults.c - checkpoint saves under faults (issue 12).

   1. kill -9 during saves: a child process (this program re-executed, so that it starts with no
      threads of ours) saves a model of a few MB in a loop, each save with its own parameter
      value; the parent kills it at a random moment. After every kill the checkpoint must be the
      old file or one of the child's, loadable and exact (every parameter the value of one save),
      and the parent's next successful save must remove the temporary file the killed child
      left. MGPU_SAVE_FAULT_TRIALS=N sets the number of trials (default 24).
   2. disk full: a save that does not fit on a small tmpfs fails with MGPU_ERROR_IO, leaves the old
      file as it was and no temporary file. Needs root and a working `mount -t tmpfs`; skipped
      with the reason otherwise.
   Usage: build/test_save_faults [GROUP]   (GROUP: kill or full) */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>

#define IN_FEATURES 1024
#define OUT_FEATURES 1024   /* 4 MiB of weights, and as much again of momentum */

static char g_dir[256];

static mgpu_model* make_model(int in, int out) {
    mgpu_layer* layers[1];
    mgpu_model_desc d;
    memset(&d, 0, sizeof d);
    layers[0] = mgpu_layer_linear(in, out);
    d.input = mgpu_shape1(in);
    d.layers = layers;
    d.layer_count = 1;
    d.seed = 1;
    return mgpu_model_create(&d);
}
static mgpu_optimizer* make_optimizer(mgpu_model* m) {
    mgpu_optimizer_desc d;
    memset(&d, 0, sizeof d);
    d.kind = MGPU_SGD;
    d.lr = 0.1f;
    d.momentum = 0.9f;
    return mgpu_optimizer_create(m, &d);
}

/* Every parameter (and momentum) set to v: a file then says which save wrote it. */
static int set_value(mgpu_model* m, mgpu_optimizer* o, double v) {
    mgpu_tensor* mom = mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer");
    return mgpu_tensor_fill(mgpu_model_params(m, 0), v) == MGPU_OK && mom && mgpu_tensor_fill(mom, v) == MGPU_OK;
}
/* The value every parameter and momentum of m holds, or NAN if they differ. */
static double common_value(mgpu_model* m, mgpu_optimizer* o) {
    const mgpu_tensor* p = mgpu_model_params(m, 0);
    const mgpu_tensor* mom = mgpu_optimizer_state(o, 0, "0.weight", "momentum_buffer");
    size_t n = (size_t)mgpu_tensor_numel(p), k = (size_t)mgpu_tensor_numel(mom), i;
    float* h = (float*)malloc((n + k) * sizeof(float));
    double v = NAN;
    if (h && mgpu_tensor_download(p, h, n * sizeof(float)) == MGPU_OK && mgpu_tensor_download(mom, h + n, k * sizeof(float)) == MGPU_OK) {
        v = h[0];
        for (i = 1; i < n + k; ++i)
            if (h[i] != h[0]) { v = NAN; break; }
    }
    free(h);
    return v;
}

static int count_tmp(const char* dir) {
    DIR* d = opendir(dir);
    struct dirent* e;
    int n = 0;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) n += strstr(e->d_name, ".tmp") != NULL;
    closedir(d);
    return n;
}

/* The child: saves path over and over, save i with the value first + i; tells the parent on fd
   ready once it is about to start. Never returns. */
static void child_main(const char* path, double first, int ready) {
    mgpu_model* m = make_model(IN_FEATURES, OUT_FEATURES);
    mgpu_optimizer* o = m ? make_optimizer(m) : NULL;
    double v = first;
    if (!o) _exit(3);
    if (write(ready, "r", 1) != 1) _exit(4);
    for (;; v += 1.0) {
        if (!set_value(m, o, v) || mgpu_model_save(m, o, path) != MGPU_OK) _exit(5);
    }
}

static void test_kill_during_save(const char* self) {
    char path[400];
    mgpu_model* m = make_model(IN_FEATURES, OUT_FEATURES);
    mgpu_optimizer* o = m ? make_optimizer(m) : NULL;
    const char* env = getenv("MGPU_SAVE_FAULT_TRIALS");
    int trials = env ? atoi(env) : 24, t, torn = 0, left = 0, bad = 0;
    double old = 0.0, save_s, t0;
    header("kill -9 during saves");
    if (!o) { CHECK(0, "model: %s", mgpu_last_error()); mgpu_model_destroy(m); return; }
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    t0 = now_seconds();
    CHECK(set_value(m, o, old) && mgpu_model_save(m, o, path) == MGPU_OK, "first save: %s", mgpu_last_error());
    save_s = now_seconds() - t0;
    printf("   a save of %.1f MiB takes %.1f ms here\n", 2.0 * IN_FEATURES * (OUT_FEATURES + 1) * 4 / 1048576.0, save_s * 1e3);
    for (t = 0; t < trials; ++t) {
        const double first = 1000.0 * (t + 1);
        int fds[2], status = 0;
        pid_t pid;
        char c, arg[32];
        double v, delay;
        if (pipe(fds) != 0) { CHECK(0, "pipe: %s", strerror(errno)); break; }
        snprintf(arg, sizeof arg, "%.0f", first);
        fflush(stdout);
        pid = fork();
        if (pid == 0) {
            char fd_text[16];
            close(fds[0]);
            snprintf(fd_text, sizeof fd_text, "%d", fds[1]);
            execl(self, self, "--child", path, arg, fd_text, (char*)NULL);
            _exit(127);
        }
        close(fds[1]);
        if (read(fds[0], &c, 1) != 1) { CHECK(0, "trial %d: the child did not start (pid %d)", t, (int)pid); close(fds[0]); waitpid(pid, &status, 0); break; }
        close(fds[0]);
        /* a random moment within the first few saves: before, inside or between them */
        delay = rng_unit() * 3.0 * (save_s + 0.002);
        {
            struct timespec ts;
            ts.tv_sec = 0;
            ts.tv_nsec = (long)(delay * 1e9);
            nanosleep(&ts, NULL);
        }
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "trial %d: the child was killed (status %d)", t, status);
        left += count_tmp(g_dir) > 0;
        /* the checkpoint: loadable, and exactly the old one or one of the child's */
        if (mgpu_model_load(m, o, path) != MGPU_OK) {
            bad++;
            CHECK(0, "trial %d: the checkpoint does not load after a kill at %.1f ms: %s", t, delay * 1e3, mgpu_last_error());
            continue;
        }
        v = common_value(m, o);
        if (!(v == old || (v >= first && v < first + 1000.0 && v == floor(v)))) {
            bad++;
            CHECK(0, "trial %d: the checkpoint holds %g, neither the old %g nor one of the child's saves (%g...)", t, v, old, first);
        }
        torn += v != old;
        old = v;
        /* the next successful save removes what the killed child left */
        CHECK(mgpu_model_save(m, o, path) == MGPU_OK && count_tmp(g_dir) == 0,
              "trial %d: after a successful save, %d temporary files are left", t, count_tmp(g_dir));
    }
    CHECK(bad == 0, "%d trials: every checkpoint old or new, loadable and exact (%d bad)", trials, bad);
    printf("   %d trials: %d kills after a new save had landed, %d left a temporary file (each removed by the next save)\n",
           trials, torn, left);
    mgpu_optimizer_destroy(o);
    mgpu_model_destroy(m);
}

/* A save that does not fit: on a 1 MiB tmpfs, the old small file stays. */
static void test_disk_full(void) {
    char mnt[400], cmd[600], path[500];
    mgpu_model *small, *big;
    mgpu_optimizer *so, *bo;
    mgpu_result rc;
    header("disk full");
    snprintf(mnt, sizeof mnt, "%s/full", g_dir);
    mkdir(mnt, 0755);
    if (geteuid() != 0) { SKIP("disk full: needs root to mount a small tmpfs"); return; }
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=1m tmpfs '%s' 2>/dev/null", mnt);
    if (system(cmd) != 0) { SKIP("disk full: 'mount -t tmpfs' failed here (no CAP_SYS_ADMIN?)"); return; }
    snprintf(path, sizeof path, "%s/model.safetensors", mnt);
    small = make_model(16, 16);
    big = make_model(IN_FEATURES, OUT_FEATURES);
    so = small ? make_optimizer(small) : NULL;
    bo = big ? make_optimizer(big) : NULL;
    if (so && bo) {
        CHECK(set_value(small, so, 7.0) && mgpu_model_save(small, so, path) == MGPU_OK, "the old file fits: %s", mgpu_last_error());
        rc = mgpu_model_save(big, bo, path);
        CHECK(rc == MGPU_ERROR_IO && strstr(mgpu_last_error(), path) && strstr(mgpu_last_error(), "No space left"),
              "a save that does not fit fails with MGPU_ERROR_IO naming the path and ENOSPC (%s: %s)", mgpu_result_string(rc),
              mgpu_last_error());
        CHECK(count_tmp(mnt) == 0, "no temporary file left on the full disk");
        CHECK(set_value(small, so, 0.0) && mgpu_model_load(small, so, path) == MGPU_OK && common_value(small, so) == 7.0,
              "the old file is intact: %s", mgpu_last_error());
    } else {
        CHECK(0, "models: %s", mgpu_last_error());
    }
    mgpu_optimizer_destroy(so);
    mgpu_optimizer_destroy(bo);
    mgpu_model_destroy(small);
    mgpu_model_destroy(big);
    snprintf(cmd, sizeof cmd, "umount '%s'", mnt);
    if (system(cmd) != 0) printf("note: could not unmount %s\n", mnt);
}

int main(int argc, char** argv) {
    char cmd[300];
    double t0;
    (void)test_rel_error;   /* test.h's, unused here */
    if (argc == 5 && !strcmp(argv[1], "--child")) child_main(argv[2], atof(argv[3]), atoi(argv[4]));
    t0 = test_start("test_save_faults");
    test_select(argc, argv);
    strcpy(g_dir, "/tmp/mgpu_save_faults.XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    TEST_GROUP(test_kill_during_save(argv[0]));
    TEST_GROUP(test_disk_full());
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", g_dir);
    printf("(%.1f s)\n", now_seconds() - t0);
    return test_summary("test_save_faults");
}
