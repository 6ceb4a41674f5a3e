/* tests/emu/emu.h - what the GPU emulator's runtime (libmgpuemu.so) offers beyond the CUDA API:
   to the fake NCCL (tests/emu/nccl.cpp), and to programs that read its counters (bench). */
#ifndef MGPU_EMU_H
#define MGPU_EMU_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Totals since the program started; a step's figures are the difference of two readings. */
typedef struct mgpu_emu_counters {
    uint64_t launches;     /* kernels, cuBLAS GEMMs included */
    uint64_t syncs;        /* the host waited for a device: stream/event/device synchronize, a copy to pageable memory */
    uint64_t allocs;       /* cudaMalloc calls that succeeded */
    uint64_t frees;
    uint64_t h2d_bytes, d2h_bytes;
    uint64_t peer_bytes;   /* device to another device */
    uint64_t d2d_bytes;    /* within one device */
    uint64_t collectives;  /* NCCL all-reduce calls (one per rank) */
    /* Calls from the host, counted when made (during a capture too); the nodes a graph launch
       replays count nothing: a graphed step shows 1 graph launch and 0 launches. */
    uint64_t set_device, get_device;   /* cudaSetDevice, cudaGetDevice calls */
    uint64_t gemms;                    /* cublasSgemm, cublasGemmEx and cublasLtMatmul calls (in launches too) */
    uint64_t copies_h2d, copies_d2h;   /* copy calls between the host (pageable or pinned) and a device */
    uint64_t copies_peer;              /* device to another device */
    uint64_t copies_d2d;               /* within one device */
    uint64_t event_records, event_waits;   /* cudaEventRecord, cudaStreamWaitEvent calls */
    uint64_t graph_launches;           /* cudaGraphLaunch calls */
    uint64_t captures;                 /* cudaStreamEndCapture calls that gave a graph */
    uint64_t lt_heuristics;            /* cublasLtMatmulAlgoGetHeuristic calls (mgpu caches their answers) */
} mgpu_emu_counters;
void mgpu_emu_get_counters(mgpu_emu_counters* out);

/* Fault injection from a test: the next `count` calls of `what` ("malloc": cudaMalloc; "launch":
   kernel launches; "capture": cudaStreamBeginCapture) fail (cudaErrorMemoryAllocation;
   cudaErrorLaunchOutOfResources; cudaErrorStreamCaptureUnsupported). */
void mgpu_emu_fail_next(const char* what, long count);
/* The same from the nth call from now (1: the next; nth <= 0 cancels any planned failure), and
   how many calls of `what` were made so far (the numbering MGPU_EMU_FAIL_* counts in): a test
   counts the launches of a step, then fails each in turn. Tests that are also built without the
   emulator look both up with dlsym. */
void mgpu_emu_fail_at(const char* what, long nth, long count);
long mgpu_emu_calls(const char* what);

/* for the fake NCCL */
int mgpu_emu_device_count(void);
int mgpu_emu_stream_device(void* stream);   /* -1: not a live stream; NULL is the current device's */
/* Runs fn(arg) on stream's worker, in order with its other work; what names it in reports. On a
   capturing stream it becomes a node of the graph, run on every launch of it: fn must leave arg
   as it found it, and destroy(arg) (unless NULL) frees it once no queue or graph holds it.
   Returns 0, or the cudaError_t of a capture that has been invalidated (then nothing is queued). */
int mgpu_emu_enqueue(void* stream, void (*fn)(void*), void* arg, void (*destroy)(void*), const char* what);
/* Aborts with a report unless [p, p + bytes) lies in one live allocation of device dev. */
void mgpu_emu_check_device_range(const char* what, const void* p, size_t bytes, int dev);
void mgpu_emu_count_collective(void);
/* Waits on cv-like state with the emulator's timeout; aborts with `what` if it runs out. */
double mgpu_emu_timeout_seconds(void);

/* The emulator's copy of mgpu.h's settings parser (mgpu__setting_number, mgpu__setting_whole when
   whole != 0, mgpu__setting_flag), for test_emu to check that the two agree; its warnings go to
   stderr as "mgpu-emu: NAME='value' why; using X". */
double mgpu_emu_setting_number(const char* name, double min, double max, double def, int whole, const char* unit);
int mgpu_emu_setting_flag(const char* name, int def);

#ifdef __cplusplus
}
#endif
#endif
