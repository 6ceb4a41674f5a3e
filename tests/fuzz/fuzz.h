/* fuzz.h - what the libFuzzer harnesses in tests/fuzz share: the input as a file that the
   library opens by name. An anonymous memfd (no file on disk to clean up, no name two processes
   could share) reached through /proc/self/fd; a per-process file under /tmp where memfd_create
   is missing, removed at exit. */
#ifndef MGPU_FUZZ_H
#define MGPU_FUZZ_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/syscall.h>

typedef struct fuzz_file { int fd; char path[64]; } fuzz_file;

static char fuzz__tmp_path[64];
static inline void fuzz__remove_tmp(void) { if (fuzz__tmp_path[0]) unlink(fuzz__tmp_path); }

/* A file (memfd or /tmp) for the life of the process. */
static inline void fuzz_file_open(fuzz_file* f) {
    f->fd = -1;
#ifdef SYS_memfd_create
    f->fd = (int)syscall(SYS_memfd_create, "mgpu-fuzz", 0);
    if (f->fd >= 0) snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
#endif
    if (f->fd < 0) {
        static int n;
        snprintf(f->path, sizeof f->path, "/tmp/mgpu-fuzz-%ld-%d", (long)getpid(), n++);
        f->fd = open(f->path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (f->fd < 0) { perror(f->path); abort(); }
        if (!fuzz__tmp_path[0]) { memcpy(fuzz__tmp_path, f->path, sizeof fuzz__tmp_path); atexit(fuzz__remove_tmp); }
    }
}

/* The file's contents become data[0..size). */
static inline void fuzz_file_write(fuzz_file* f, const uint8_t* data, size_t size) {
    size_t done = 0;
    if (ftruncate(f->fd, 0) != 0) { perror("ftruncate"); abort(); }
    while (done < size) {
        ssize_t n = pwrite(f->fd, data + done, size - done, (off_t)done);
        if (n <= 0) { perror("pwrite"); abort(); }
        done += (size_t)n;
    }
}

/* mgpu's log lines (warnings about files without optimizer state, ...) are noise here. */
static inline void fuzz_quiet(mgpu_log_level level, const char* message, void* user) { (void)level; (void)message; (void)user; }
#endif
