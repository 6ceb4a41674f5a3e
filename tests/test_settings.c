/* tests/test_settings.c - every MGPU_* environment variable read one way (issue 37): one table of
   each variable in each form (valid, surrounding spaces, another case, a bad word, trailing
   garbage, a fraction, out of range, inf, nan, empty) with the value the library then uses and
   whether it warns on stderr. Each row runs in a forked child, so that the settings the library
   keeps in statics (the thread count, the warnings given) start fresh, with its stderr in a file.
     table     the rows
     once      a bad value read many times warns once; another bad value warns again
   The emulator's MGPU_EMU_* variables: tests/emu/test_emu.c ("settings"), which checks that its
   copy of the parser agrees with this one. MGPU_NCCL_LIBRARY is a path, used as given.
   Usage: build/test_settings [GROUP] */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"
#ifndef _WIN32
#include <fcntl.h>
#include <sys/wait.h>
#endif

#ifndef _WIN32   /* the rows run in forked children: POSIX only (one skip says so on Windows) */
#define CORES (-1.0)   /* the value of MGPU_CPU_THREADS's default: every core (at most 256) */
#define ERR (-2.0)     /* MGPU_DEVICES: the set is refused, with an error naming the variable */

typedef struct row { const char* name; const char* form; const char* value; double want; int warns; } row;
static const row rows[] = {
    /* 0..256 whole threads, 0 or nothing for every core */
    { "MGPU_CPU_THREADS", "unset", NULL, CORES, 0 },
    { "MGPU_CPU_THREADS", "valid", "3", 3, 0 },
    { "MGPU_CPU_THREADS", "spaces", " 3 ", 3, 0 },
    { "MGPU_CPU_THREADS", "tab and newline", "\t3\n", 3, 0 },
    { "MGPU_CPU_THREADS", "zero: every core", "0", CORES, 0 },
    { "MGPU_CPU_THREADS", "exponent", "2e0", 2, 0 },
    { "MGPU_CPU_THREADS", "bad word", "abc", CORES, 1 },
    { "MGPU_CPU_THREADS", "trailing garbage", "3x", CORES, 1 },
    { "MGPU_CPU_THREADS", "inner space", "3 4", CORES, 1 },
    { "MGPU_CPU_THREADS", "fraction", "2.5", CORES, 1 },
    { "MGPU_CPU_THREADS", "hex", "0x10", CORES, 1 },
    { "MGPU_CPU_THREADS", "below range", "-3", CORES, 1 },
    { "MGPU_CPU_THREADS", "above range", "1e3", 256, 1 },
    { "MGPU_CPU_THREADS", "far above range", "1e999", 256, 1 },
    { "MGPU_CPU_THREADS", "inf", "inf", CORES, 1 },
    { "MGPU_CPU_THREADS", "nan", "nan", CORES, 1 },
    { "MGPU_CPU_THREADS", "empty", "", CORES, 0 },
    { "MGPU_CPU_THREADS", "only spaces", "   ", CORES, 0 },
    /* 0..1000000 whole microseconds, default 1000 (the table's values in microseconds) */
    { "MGPU_CPU_SPIN_US", "unset", NULL, 1000, 0 },
    { "MGPU_CPU_SPIN_US", "valid", "250", 250, 0 },
    { "MGPU_CPU_SPIN_US", "zero", "0", 0, 0 },
    { "MGPU_CPU_SPIN_US", "spaces", "  250 ", 250, 0 },
    { "MGPU_CPU_SPIN_US", "bad word", "fast", 1000, 1 },
    { "MGPU_CPU_SPIN_US", "trailing garbage", "12us", 1000, 1 },
    { "MGPU_CPU_SPIN_US", "fraction", "0.5", 1000, 1 },
    { "MGPU_CPU_SPIN_US", "below range", "-3", 0, 1 },
    { "MGPU_CPU_SPIN_US", "above range", "5000000", 1000000, 1 },
    { "MGPU_CPU_SPIN_US", "far above range", "99999999999999999999999", 1000000, 1 },
    { "MGPU_CPU_SPIN_US", "inf", "inf", 1000, 1 },
    { "MGPU_CPU_SPIN_US", "nan", "nan", 1000, 1 },
    { "MGPU_CPU_SPIN_US", "empty", "", 1000, 0 },
    /* 0 (no timeout) or 1..1e9 seconds, default 300 */
    { "MGPU_DIST_TIMEOUT", "unset", NULL, 300, 0 },
    { "MGPU_DIST_TIMEOUT", "valid", "10", 10, 0 },
    { "MGPU_DIST_TIMEOUT", "fraction", "2.5", 2.5, 0 },
    { "MGPU_DIST_TIMEOUT", "zero: none", "0", 0, 0 },
    { "MGPU_DIST_TIMEOUT", "space before", " 2", 2, 0 },
    { "MGPU_DIST_TIMEOUT", "space after", "2 ", 2, 0 },
    { "MGPU_DIST_TIMEOUT", "largest", "1e9", 1e9, 0 },
    { "MGPU_DIST_TIMEOUT", "bad word", "abc", 300, 1 },
    { "MGPU_DIST_TIMEOUT", "trailing garbage", "5s", 300, 1 },
    { "MGPU_DIST_TIMEOUT", "below the least", "1e-6", 1, 1 },
    { "MGPU_DIST_TIMEOUT", "below range", "-1", 0, 1 },
    { "MGPU_DIST_TIMEOUT", "above range", "1e10", 1e9, 1 },
    { "MGPU_DIST_TIMEOUT", "inf", "inf", 300, 1 },
    { "MGPU_DIST_TIMEOUT", "infinity", "Infinity", 300, 1 },
    { "MGPU_DIST_TIMEOUT", "nan", "nan", 300, 1 },
    { "MGPU_DIST_TIMEOUT", "empty", "", 300, 0 },
    /* a flag, default off */
    { "MGPU_DETERMINISTIC", "unset", NULL, 0, 0 },
    { "MGPU_DETERMINISTIC", "1", "1", 1, 0 },
    { "MGPU_DETERMINISTIC", "0", "0", 0, 0 },
    { "MGPU_DETERMINISTIC", "true", "true", 1, 0 },
    { "MGPU_DETERMINISTIC", "false", "false", 0, 0 },
    { "MGPU_DETERMINISTIC", "FALSE", "FALSE", 0, 0 },
    { "MGPU_DETERMINISTIC", "on, another case", "On", 1, 0 },
    { "MGPU_DETERMINISTIC", "off, spaces", " off ", 0, 0 },
    { "MGPU_DETERMINISTIC", "yes", "YES", 1, 0 },
    { "MGPU_DETERMINISTIC", "no", "no", 0, 0 },
    { "MGPU_DETERMINISTIC", "bad word", "maybe", 0, 1 },
    { "MGPU_DETERMINISTIC", "trailing garbage", "1x", 0, 1 },
    { "MGPU_DETERMINISTIC", "out of range", "2", 0, 1 },
    { "MGPU_DETERMINISTIC", "inf", "inf", 0, 1 },
    { "MGPU_DETERMINISTIC", "nan", "nan", 0, 1 },
    { "MGPU_DETERMINISTIC", "empty", "", 0, 0 },
    /* a flag, default on */
    { "MGPU_EPILOGUES", "unset", NULL, 1, 0 },
    { "MGPU_EPILOGUES", "0", "0", 0, 0 },
    { "MGPU_EPILOGUES", "off, another case, spaces", " OFF ", 0, 0 },
    { "MGPU_EPILOGUES", "yes", "yes", 1, 0 },
    { "MGPU_EPILOGUES", "bad word", "fast", 1, 1 },
    { "MGPU_EPILOGUES", "out of range", "2", 1, 1 },
    { "MGPU_EPILOGUES", "empty", "", 1, 0 },
    /* a flag, default off (and off whenever MGPU_EPILOGUES is) */
    { "MGPU_FUSE_RELU", "unset", NULL, 0, 0 },
    { "MGPU_FUSE_RELU", "1", "1", 1, 0 },
    { "MGPU_FUSE_RELU", "true, another case", "True", 1, 0 },
    { "MGPU_FUSE_RELU", "bad word", "relu", 0, 1 },
    { "MGPU_FUSE_RELU", "trailing garbage", "1x", 0, 1 },
    { "MGPU_FUSE_RELU", "empty", "", 0, 0 },
    { "MGPU_FUSE_GELU", "unset", NULL, 0, 0 },
    { "MGPU_FUSE_GELU", "on", "on", 1, 0 },
    { "MGPU_FUSE_GELU", "bad word", "gelu", 0, 1 },
    { "MGPU_FUSE_GELU", "trailing garbage", "1x", 0, 1 },
    { "MGPU_FUSE_GELU", "empty", "", 0, 0 },
    /* a flag, default on */
    { "MGPU_OVERLAP_UPDATE", "unset", NULL, 1, 0 },
    { "MGPU_OVERLAP_UPDATE", "off", "off", 0, 0 },
    { "MGPU_OVERLAP_UPDATE", "0, spaces", " 0 ", 0, 0 },
    { "MGPU_OVERLAP_UPDATE", "bad word", "later", 1, 1 },
    { "MGPU_OVERLAP_UPDATE", "trailing garbage", "0x", 1, 1 },
    { "MGPU_OVERLAP_UPDATE", "empty", "", 1, 0 },
    /* a word: auto, nccl, p2p, host (the table's values: mgpu_allreduce_kind) */
    { "MGPU_ALLREDUCE", "unset", NULL, MGPU_ALLREDUCE_AUTO, 0 },
    { "MGPU_ALLREDUCE", "valid", "p2p", MGPU_ALLREDUCE_P2P, 0 },
    { "MGPU_ALLREDUCE", "another case, spaces", " NCCL ", MGPU_ALLREDUCE_NCCL, 0 },
    { "MGPU_ALLREDUCE", "host", "host", MGPU_ALLREDUCE_HOST, 0 },
    { "MGPU_ALLREDUCE", "auto", "auto", MGPU_ALLREDUCE_AUTO, 0 },
    { "MGPU_ALLREDUCE", "bad word", "tcp", MGPU_ALLREDUCE_AUTO, 1 },
    { "MGPU_ALLREDUCE", "trailing garbage", "p2px", MGPU_ALLREDUCE_AUTO, 1 },
    { "MGPU_ALLREDUCE", "a number", "1", MGPU_ALLREDUCE_AUTO, 1 },
    { "MGPU_ALLREDUCE", "inf", "inf", MGPU_ALLREDUCE_AUTO, 1 },
    { "MGPU_ALLREDUCE", "nan", "nan", MGPU_ALLREDUCE_AUTO, 1 },
    { "MGPU_ALLREDUCE", "empty", "", MGPU_ALLREDUCE_AUTO, 0 },
    /* a word: auto, ring, oneshot */
    { "MGPU_P2P", "unset", NULL, MGPU__P2P_AUTO, 0 },
    { "MGPU_P2P", "valid", "ring", MGPU__P2P_RING, 0 },
    { "MGPU_P2P", "another case, spaces", "\tOneShot ", MGPU__P2P_ONESHOT, 0 },
    { "MGPU_P2P", "bad word", "tree", MGPU__P2P_AUTO, 1 },
    { "MGPU_P2P", "trailing garbage", "ring2", MGPU__P2P_AUTO, 1 },
    { "MGPU_P2P", "inf", "inf", MGPU__P2P_AUTO, 1 },
    { "MGPU_P2P", "nan", "nan", MGPU__P2P_AUTO, 1 },
    { "MGPU_P2P", "empty", "", MGPU__P2P_AUTO, 0 },
    /* a device spec, what "auto" means (the table's values: the set's device count); a bad one
       is the create's error, not a warning: the program asked for those devices */
    { "MGPU_DEVICES", "unset", NULL, 1, 0 },
    { "MGPU_DEVICES", "valid", "cpu:2", 2, 0 },
    { "MGPU_DEVICES", "spaces", " cpu:3\t", 3, 0 },
    { "MGPU_DEVICES", "auto", "auto", 1, 0 },
    { "MGPU_DEVICES", "bad word", "gpu", ERR, 0 },
    { "MGPU_DEVICES", "trailing garbage", "cpu:2x", ERR, 0 },
    { "MGPU_DEVICES", "out of range", "cpu:300", ERR, 0 },
    { "MGPU_DEVICES", "inf", "cpu:inf", ERR, 0 },
    { "MGPU_DEVICES", "nan", "nan", ERR, 0 },
    { "MGPU_DEVICES", "empty", "", 1, 0 },
};

/* What the library uses for r->name, read the way the library reads it. */
static double setting_used(const row* r, char* error, size_t size) {
    const char* n = r->name;
    error[0] = 0;
    if (!strcmp(n, "MGPU_CPU_THREADS")) return mgpu_cpu_threads();
    if (!strcmp(n, "MGPU_CPU_SPIN_US")) return floor(mgpu__pool_spin_from_env() * 1e6 + 0.5);
    if (!strcmp(n, "MGPU_DIST_TIMEOUT")) return mgpu__dist_timeout_from_env();
    if (!strcmp(n, "MGPU_DETERMINISTIC")) return mgpu__deterministic_from_env();
    if (!strcmp(n, "MGPU_EPILOGUES")) return mgpu__epilogues_on();
    if (!strcmp(n, "MGPU_FUSE_RELU")) return mgpu__fuse_relu_on();
    if (!strcmp(n, "MGPU_FUSE_GELU")) return mgpu__fuse_gelu_on();
    if (!strcmp(n, "MGPU_OVERLAP_UPDATE")) return mgpu__overlap_update_on();
    if (!strcmp(n, "MGPU_ALLREDUCE")) return mgpu__allreduce_from_env(MGPU_ALLREDUCE_AUTO);
    if (!strcmp(n, "MGPU_P2P")) return mgpu__p2p_choice_from_env();
    if (!strcmp(n, "MGPU_DEVICES")) {
        mgpu_device_set* set = mgpu_device_set_create("auto");
        const int count = mgpu_device_set_count(set);
        if (!set) snprintf(error, size, "%s", mgpu_last_error());
        mgpu_device_set_destroy(set);
        return set ? count : ERR;
    }
    return -99.0;
}

/* Runs the row in a child: the value used (and the error, for MGPU_DEVICES) through a pipe, what
   it printed on stderr in `err`. 0 when the child ended well. */
static int run_row(const row* r, double* used, char* error, size_t error_size, char* err, size_t err_size) {
    char path[64];
    int fds[2], fd, status = 0;
    size_t got = 0;
    ssize_t n;
    pid_t pid;
    snprintf(path, sizeof path, "/tmp/mgpu_settings_%ld.err", test_getpid());
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || pipe(fds) != 0) return -1;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        double v;
        char e[1024];
        close(fds[0]);
        if (r->value) test_setenv(r->name, r->value);
        else test_unsetenv(r->name);
        dup2(fd, 2);
        v = setting_used(r, e, sizeof e);
        if (write(fds[1], &v, sizeof v) != (ssize_t)sizeof v || write(fds[1], e, sizeof e) != (ssize_t)sizeof e) _exit(3);
        _exit(0);
    }
    close(fds[1]);
    *used = -98.0;
    if (read(fds[0], used, sizeof *used) != (ssize_t)sizeof *used) *used = -97.0;
    error[0] = 0;
    while (got + 1 < error_size && (n = read(fds[0], error + got, error_size - 1 - got)) > 0) got += (size_t)n;
    error[got] = 0;
    close(fds[0]);
    waitpid(pid, &status, 0);
    got = 0;
    lseek(fd, 0, SEEK_SET);
    while (got + 1 < err_size && (n = read(fd, err + got, err_size - 1 - got)) > 0) got += (size_t)n;
    err[got] = 0;
    close(fd);
    remove(path);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

static int count_lines(const char* s) {
    int n = 0;
    for (; *s; ++s) n += *s == '\n';
    return n;
}
#endif

static void test_table(void) {
    header("every MGPU_* variable in every form");
#ifdef _WIN32
    SKIP("settings table: a forked child per row (POSIX)");
#else
    {
        const double cores = (double)MGPU__MIN(mgpu__core_count() > 0 ? mgpu__core_count() : 1, 256);
        size_t i;
        for (i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
            const row* r = &rows[i];
            const double want = r->want == CORES ? cores : r->want;
            char err[4096], error[1024], quoted[128];
            double used = 0;
            const int rc = run_row(r, &used, error, sizeof error, err, sizeof err);
            snprintf(quoted, sizeof quoted, "mgpu: %s='%s' ", r->name, r->value ? r->value : "");
            CHECK(rc == 0 && used == want, "%s %s ('%s'): uses %.15g, want %.15g (child %d)", r->name, r->form,
                  r->value ? r->value : "(unset)", used, want, rc);
            if (r->warns)
                CHECK(count_lines(err) == 1 && strstr(err, quoted) == err && strstr(err, "; using "),
                      "%s %s: one warning naming the variable, the value and what is used, got '%s'", r->name, r->form, err);
            else
                CHECK(err[0] == 0, "%s %s ('%s'): no warning, got '%s'", r->name, r->form, r->value ? r->value : "(unset)", err);
            if (want == ERR)
                CHECK(strstr(error, "mgpu_device_set_create") && strstr(error, "(from MGPU_DEVICES)") &&
                          (strcmp(r->value, "cpu:300") != 0 || strstr(error, "256")),
                      "%s %s: the error names the op and the variable (and the limit): '%s'", r->name, r->form, error);
        }
    }
#endif
}

/* A bad value read again and again (a model made every epoch) warns once; another bad value of
   the same variable warns again, once. Run in this process, after the table's children. */
static void test_once(void) {
    header("a warning once per variable and value");
#ifdef _WIN32
    SKIP("warnings once: a forked child (POSIX)");
#else
    {
        static const row again = { "MGPU_DETERMINISTIC", "read 3 times, then another value twice", "maybe", 0, 1 };
        char path[64], err[4096];
        int fd, saved, i, on = 0;
        size_t got = 0;
        ssize_t n;
        snprintf(path, sizeof path, "/tmp/mgpu_settings_once_%ld.err", test_getpid());
        fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        saved = dup(2);
        if (fd < 0 || saved < 0) { CHECK(0, "cannot capture stderr: %s", strerror(errno)); return; }
        fflush(stderr);
        dup2(fd, 2);
        test_setenv(again.name, again.value);
        for (i = 0; i < 3; ++i) on += mgpu__deterministic_from_env();
        test_setenv(again.name, "sometimes");
        for (i = 0; i < 2; ++i) on += mgpu__deterministic_from_env();
        test_setenv(again.name, "TRUE");
        on += mgpu__deterministic_from_env();
        test_unsetenv(again.name);
        fflush(stderr);
        dup2(saved, 2);
        close(saved);
        lseek(fd, 0, SEEK_SET);
        while (got + 1 < sizeof err && (n = read(fd, err + got, sizeof err - 1 - got)) > 0) got += (size_t)n;
        err[got] = 0;
        close(fd);
        remove(path);
        CHECK(on == 1, "maybe x3, sometimes x2: off; TRUE: on (%d reads on, want 1)", on);
        CHECK(count_lines(err) == 2 && strstr(err, "MGPU_DETERMINISTIC='maybe' ") &&
                  strstr(err, "MGPU_DETERMINISTIC='sometimes' ") && strstr(err, "using 0 (off)"),
              "one warning per bad value, 2 in all: '%s'", err);
    }
#endif
}

int main(int argc, char** argv) {
    (void)test_rel_error;   /* test.h's, unused here */
    test_start("test_settings");
    test_select(argc, argv);
    TEST_GROUP(test_table());
    TEST_GROUP(test_once());
    return test_summary("test_settings");
}
