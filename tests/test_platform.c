/* tests/test_platform.c - what the operating system gives the library, on each platform:
   the core count and memory, the clock, file names in UTF-8, and saves that replace a checkpoint
   atomically, also one that another process holds open, and tidy up after a killed writer.
   On Windows (MinGW, run under wine in make test-windows) a killed save is CreateProcess plus
   TerminateProcess; on POSIX tests/test_save_faults.c kills saves with signals instead. */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "test.h"

#ifdef _WIN32
#define TEST_SEP "\\"
#else
#define TEST_SEP "/"
#endif

/* ---- small portable helpers (the system's own: tests/test.h) ---- */
static char g_root[500];  /* this run's folder */
static char g_dir[512];   /* the same, ending in a separator */

static void make_dir(void) {
    snprintf(g_root, sizeof g_root, "/tmp/mgpu-platform-XXXXXX");
    if (!test_mkdtemp(g_root, sizeof g_root)) { perror("mkdtemp"); exit(1); }
    snprintf(g_dir, sizeof g_dir, "%s" TEST_SEP, g_root);
}

static void path_in_dir(char* out, size_t size, const char* name) { snprintf(out, size, "%s%s", g_dir, name); }

static int file_exists(const char* path) {
#ifdef _WIN32
    wchar_t w[1024];
    if (!MultiByteToWideChar(CP_UTF8, 0, path, -1, w, 1024)) return 0;
    return GetFileAttributesW(w) != INVALID_FILE_ATTRIBUTES;
#else
    struct stat st;
    return stat(path, &st) == 0;
#endif
}

static void remove_file(const char* path) {
#ifdef _WIN32
    wchar_t w[1024];
    if (MultiByteToWideChar(CP_UTF8, 0, path, -1, w, 1024)) DeleteFileW(w);
#else
    remove(path);
#endif
}

/* A tiny model whose parameters come from seed: two seeds, two different models. */
static mgpu_model* make_model(mgpu_device_set* set, uint64_t seed, int width) {
    mgpu_layer* layers[3];
    mgpu_model_desc d;
    layers[0] = mgpu_layer_linear(16, width);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(width, 4);
    memset(&d, 0, sizeof d);
    d.input = mgpu_shape1(16);
    d.layers = layers;
    d.layer_count = 3;
    d.devices = set;
    d.seed = seed;
    return mgpu_model_create(&d);
}

/* 1 when the two models hold the same parameters, bit for bit */
static int same_params(const mgpu_model* a, const mgpu_model* b) {
    const mgpu_tensor* pa = mgpu_model_params(a, 0);
    const mgpu_tensor* pb = mgpu_model_params(b, 0);
    return mgpu_tensor_numel(pa) == mgpu_tensor_numel(pb) &&
           memcmp(mgpu_tensor_data(pa), mgpu_tensor_data(pb), mgpu_tensor_bytes(pa)) == 0;
}

#ifdef _WIN32
/* How many temporary files of a save to NAME (".<name>.<hash>.<pid>.<n>.tmp") are in g_dir. */
static int count_tmp(const char* name) {
    int count = 0;
    char pattern[600];
    WIN32_FIND_DATAA e;
    HANDLE h;
    snprintf(pattern, sizeof pattern, "%s.%s.*.tmp", g_dir, name);
    h = FindFirstFileA(pattern, &e);
    if (h == INVALID_HANDLE_VALUE) return 0;
    do count++; while (FindNextFileA(h, &e));
    FindClose(h);
    return count;
}
#endif

/* ---- the cores, memory and clock ---- */
static void test_system(void) {
    mgpu_device_info info;
    long cores;
    double t0, t1;
    header("system: cores, memory, clock");
#ifdef _WIN32
    cores = (long)GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
#else
    cores = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (getenv("MGPU_CPU_THREADS")) SKIP("cpu threads: MGPU_CPU_THREADS is set");
    else CHECK(mgpu_cpu_threads() == (cores > 256 ? 256 : cores) && cores >= 1,
               "the CPU backend uses every core by default: %d threads, %ld cores", mgpu_cpu_threads(), cores);
    CHECK(mgpu_device_get_info(mgpu_device_cpu(), &info) == MGPU_OK, "cpu info: %s", mgpu_last_error());
    CHECK(info.total_memory > ((size_t)64 << 20), "cpu total memory %zu bytes", info.total_memory);
    CHECK(info.free_memory > 0 && info.free_memory <= info.total_memory, "cpu free memory %zu of %zu bytes",
          info.free_memory, info.total_memory);
    t0 = mgpu_seconds();
    test_sleep_ms(30);
    t1 = mgpu_seconds();
    CHECK(t1 - t0 >= 0.025, "mgpu_seconds advances with the wall clock: %.4f s across a 30 ms sleep", t1 - t0);
    CHECK(t1 >= t0, "mgpu_seconds is monotonic");
}

/* ---- names ---- */
static void test_utf8_names(mgpu_device_set* set) {
    /* "model-Ω-模型-ü.safetensors" in UTF-8 */
    static const char name[] = "model-\xce\xa9-\xe6\xa8\xa1\xe5\x9e\x8b-\xc3\xbc.safetensors";
    char path[700];
    mgpu_model *a = make_model(set, 1, 8), *b = make_model(set, 2, 8);
    header("UTF-8 file names");
    path_in_dir(path, sizeof path, name);
    CHECK(a && b && !same_params(a, b), "two seeds make two models");
    CHECK(mgpu_model_save(a, NULL, path) == MGPU_OK, "save to a UTF-8 name: %s", mgpu_last_error());
    CHECK(file_exists(path), "the file has the UTF-8 name (as the system's wide-character calls see it)");
#ifdef _WIN32
    {   /* and not a name in the local code page ("mojibake") */
        const wchar_t* wname = L"model-\x03a9-\x6a21\x578b-\x00fc.safetensors";
        wchar_t wdir[600], wpath[700];
        MultiByteToWideChar(CP_UTF8, 0, g_dir, -1, wdir, 600);
        _snwprintf(wpath, 700, L"%ls%ls", wdir, wname);
        CHECK(GetFileAttributesW(wpath) != INVALID_FILE_ATTRIBUTES, "Windows sees the file as model-\\u03a9-\\u6a21\\u578b-\\u00fc");
    }
#endif
    CHECK(mgpu_model_load(b, NULL, path) == MGPU_OK, "load from a UTF-8 name: %s", mgpu_last_error());
    CHECK(same_params(a, b), "what was saved is what loads");
    {
        char bad[700];   /* not UTF-8: refused with a message, never a crash */
        mgpu_result r;
        snprintf(bad, sizeof bad, "%sbad-\xff\xfe.safetensors", g_dir);
        r = mgpu_model_load(b, NULL, bad);
        CHECK(r != MGPU_OK, "a name that does not exist or is not UTF-8 fails to load: %s", mgpu_last_error());
    }
    remove_file(path);
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
}

/* ---- a save over a file another process holds open ---- */
#ifdef _WIN32
/* Runs this program again with args; returns its process handle (NULL on failure). */
static HANDLE spawn_self(const char* args) {
    char exe[MAX_PATH], cmd[2 * MAX_PATH + 700];
    STARTUPINFOA si;
    PROCESS_INFORMATION pi;
    if (!GetModuleFileNameA(NULL, exe, sizeof exe)) return NULL;
    snprintf(cmd, sizeof cmd, "\"%s\" %s", exe, args);
    memset(&si, 0, sizeof si);
    si.cb = sizeof si;
    if (!CreateProcessA(NULL, cmd, NULL, NULL, FALSE, 0, NULL, NULL, &si, &pi)) return NULL;
    CloseHandle(pi.hThread);
    return pi.hProcess;
}
static int wait_for_file(const char* path, int seconds) {
    int i;
    for (i = 0; i < seconds * 100; ++i) {
        if (file_exists(path)) return 1;
        test_sleep_ms(10);
    }
    return 0;
}
/* child: "hold SHARE PATH READY STOP": open PATH (sharing delete access when SHARE is 1), make
   READY, keep it open until STOP appears (at most 60 s) */
static int child_hold(int share, const char* path, const char* ready, const char* stop) {
    HANDLE h = CreateFileA(path, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | (share ? FILE_SHARE_DELETE : 0), NULL,
                           OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, NULL);
    FILE* f;
    if (h == INVALID_HANDLE_VALUE) return 2;
    f = fopen(ready, "w");
    if (f) fclose(f);
    wait_for_file(stop, 60);
    CloseHandle(h);
    return 0;
}
/* Starts a child that holds path open (sharing delete access or not) and waits for it to have
   opened it; stop gets the name of the file that tells it to close and end. NULL on failure. */
static HANDLE start_reader(int share, const char* path, char* stop, size_t stop_size) {
    char ready[700], args[2200];
    HANDLE child;
    path_in_dir(ready, sizeof ready, share ? "ready1" : "ready0");
    path_in_dir(stop, stop_size, share ? "stop1" : "stop0");
    remove_file(ready);   /* (wine gives a new process the ids of earlier runs: so the folder's name) */
    remove_file(stop);
    snprintf(args, sizeof args, "hold %d \"%s\" \"%s\" \"%s\"", share, path, ready, stop);
    child = spawn_self(args);
    CHECK(child != NULL, "start a reader process");
    if (child && !wait_for_file(ready, 60)) {
        CHECK(0, "the reader (sharing delete access: %d) did not open the checkpoint within 60 s", share);
        TerminateProcess(child, 1);
        CloseHandle(child);
        return NULL;
    }
    remove_file(ready);
    return child;
}
/* child: "save PATH": save a large model to PATH over and over, until killed (at most 60 s) */
static int child_save_loop(const char* path) {
    mgpu_device_set* set = mgpu_device_set_create("cpu");
    mgpu_model* m = make_model(set, 3, 4096);   /* 16 x 4096 + 4096 x 4: about 0.3 MB a save */
    double until = mgpu_seconds() + 60;
    if (!m) return 2;
    while (mgpu_seconds() < until)
        if (mgpu_model_save(m, NULL, path) != MGPU_OK) return 3;
    return 0;
}
#endif

static void test_save_over_open_file(mgpu_device_set* set) {
    char path[700];
    mgpu_model *a = make_model(set, 4, 8), *b = make_model(set, 5, 8), *c = make_model(set, 6, 8);
    header("a save over a checkpoint another process reads");
    path_in_dir(path, sizeof path, "held.safetensors");
    CHECK(mgpu_model_save(a, NULL, path) == MGPU_OK, "first save: %s", mgpu_last_error());
#ifdef _WIN32
    {
        char stop[700];
        HANDLE child;
        DWORD code = 1;
        /* a reader that shares delete access (as mgpu's own reads do): the save replaces the file */
        child = start_reader(1, path, stop, sizeof stop);
        if (child) {
            CHECK(mgpu_model_save(b, NULL, path) == MGPU_OK, "a save over a file another process holds open (sharing "
                  "delete access) succeeds: %s", mgpu_last_error());
            CHECK(mgpu_model_load(c, NULL, path) == MGPU_OK && same_params(b, c), "and the new checkpoint loads: %s",
                  mgpu_last_error());
            fclose(fopen(stop, "w"));
            WaitForSingleObject(child, 60000);
            GetExitCodeProcess(child, &code);
            CloseHandle(child);
            remove_file(stop);
            CHECK(code == 0, "the reader ended well (exit %lu)", (unsigned long)code);
        }
        /* a reader that does not share delete access: Windows can then not replace the file (wine
           can: its rename is the host's); either way nothing is lost. A failed save says why and
           leaves the old file; a save that went through left the new one. */
        child = start_reader(0, path, stop, sizeof stop);
        if (child) {
            mgpu_result r;
            r = mgpu_model_save(a, NULL, path);
            if (r != MGPU_OK) {
                CHECK(r == MGPU_ERROR_IO && strstr(mgpu_last_error(), "held.safetensors") &&
                      strstr(mgpu_last_error(), "another program"),
                      "a save over a file held without FILE_SHARE_DELETE fails with a clear message: %s", mgpu_last_error());
                printf("  (as on Windows: the save over a file held without FILE_SHARE_DELETE failed)\n");
            } else {
                printf("  (as under wine: the save over a file held without FILE_SHARE_DELETE went through)\n");
            }
            CHECK(count_tmp("held.safetensors") == 0, "no temporary file is left");
            fclose(fopen(stop, "w"));
            WaitForSingleObject(child, 60000);
            CloseHandle(child);
            remove_file(stop);
            CHECK(mgpu_model_load(c, NULL, path) == MGPU_OK && same_params(r == MGPU_OK ? a : b, c),
                  "the checkpoint is the %s one, whole: %s", r == MGPU_OK ? "new" : "old", mgpu_last_error());
        }
    }
#else
    {   /* POSIX: a rename replaces the name; an open file keeps its old contents */
        FILE* held = fopen(path, "rb");
        CHECK(held != NULL, "open the checkpoint");
        CHECK(mgpu_model_save(b, NULL, path) == MGPU_OK, "a save over a file held open succeeds: %s", mgpu_last_error());
        CHECK(mgpu_model_load(c, NULL, path) == MGPU_OK && same_params(b, c), "and the new checkpoint loads: %s",
              mgpu_last_error());
        if (held) fclose(held);
    }
#endif
    remove_file(path);
    mgpu_model_destroy(a);
    mgpu_model_destroy(b);
    mgpu_model_destroy(c);
}

/* ---- a save killed half way, and the tidying after it ---- */
static void test_killed_save(mgpu_device_set* set) {
    header("a save killed half way");
#ifdef _WIN32
    {
        char path[700], args[800], stale[900];
        mgpu_model* big = make_model(set, 3, 4096);
        mgpu_model* old = make_model(set, 7, 4096);
        mgpu_model* got = make_model(set, 8, 4096);
        HANDLE child;
        DWORD dead_pid;
        int round, left_tmp = 0, loads = 0;
        path_in_dir(path, sizeof path, "killed.safetensors");
        CHECK(big && old && got, "models: %s", mgpu_last_error());
        /* a temporary file of a process that has ended: the next save removes it; this
           process's own and a live process's are kept */
        child = spawn_self("exit");
        CHECK(child != NULL, "start a process that exits");
        if (!child) return;
        WaitForSingleObject(child, 60000);
        dead_pid = GetProcessId(child);
        CloseHandle(child);
        {
            char prefix[300];
            size_t dir_len;
            FILE* f;
            mgpu__tmp_prefix(path, &dir_len, prefix, sizeof prefix);
            snprintf(stale, sizeof stale, "%s%s%lu.1234.tmp", g_dir, prefix, (unsigned long)dead_pid);
            f = fopen(stale, "wb");
            if (f) { fputs("half a checkpoint", f); fclose(f); }
        }
        CHECK(file_exists(stale), "a stale temporary file of pid %lu", (unsigned long)dead_pid);
        CHECK(mgpu_model_save(old, NULL, path) == MGPU_OK, "save: %s", mgpu_last_error());
        CHECK(!file_exists(stale), "a successful save removed the temporary file of the process that ended");
        /* kill a process that saves in a loop, at different moments: the checkpoint is always the
           old one or the new one, whole */
        for (round = 0; round < 6; ++round) {
            snprintf(args, sizeof args, "save \"%s\"", path);
            child = spawn_self(args);
            if (!child) { CHECK(0, "start a saving process"); break; }
            test_sleep_ms(150 + 97 * round);
            TerminateProcess(child, 9);
            WaitForSingleObject(child, 60000);
            CloseHandle(child);
            left_tmp += count_tmp("killed.safetensors") > 0;
            if (mgpu_model_load(got, NULL, path) == MGPU_OK && (same_params(got, old) || same_params(got, big))) loads++;
            else CHECK(0, "round %d: the checkpoint after a kill is neither the old nor the new one: %s", round, mgpu_last_error());
        }
        CHECK(loads == round, "after %d kills the checkpoint always loaded whole (old or new)", loads);
        printf("  (%d of %d kills left a temporary file behind)\n", left_tmp, round);
        CHECK(mgpu_model_save(old, NULL, path) == MGPU_OK, "save after the kills: %s", mgpu_last_error());
        CHECK(count_tmp("killed.safetensors") == 0, "and no temporary file of a killed writer is left");
        remove_file(path);
        mgpu_model_destroy(big);
        mgpu_model_destroy(old);
        mgpu_model_destroy(got);
    }
#else
    (void)set;
    SKIP("killed save: on POSIX tests/test_save_faults.c kills saves with signals");
#endif
}

int main(int argc, char** argv) {
    mgpu_device_set* set;
    (void)test_rel_error;
#ifdef _WIN32
    if (argc > 1 && strcmp(argv[1], "exit") == 0) return 0;
    if (argc > 5 && strcmp(argv[1], "hold") == 0) return child_hold(atoi(argv[2]), argv[3], argv[4], argv[5]);
    if (argc > 2 && strcmp(argv[1], "save") == 0) return child_save_loop(argv[2]);
#endif
    test_start("test_platform");
    test_select(argc, argv);
    make_dir();
    set = mgpu_device_set_create("cpu");
    if (!set) { printf("cpu set: %s\n", mgpu_last_error()); return 1; }
    TEST_GROUP(test_system());
    TEST_GROUP(test_utf8_names(set));
    TEST_GROUP(test_save_over_open_file(set));
    TEST_GROUP(test_killed_save(set));
    mgpu_device_set_destroy(set);
    test_remove_tree(g_root);
    return test_summary("test_platform");
}
