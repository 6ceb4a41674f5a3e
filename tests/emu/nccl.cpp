/* tests/emu/nccl.cpp - a fake NCCL for the GPU emulator (libnccl_emu.so), loaded by mgpu's own
   dlopen path through MGPU_NCCL_LIBRARY. The calls mgpu makes: ncclCommInitAll, ncclCommDestroy,
   ncclGroupStart/End, ncclAllReduce (float32 sum), ncclGetErrorString.

   An all-reduce is queued on each rank's stream; each rank's task waits there until every rank
   has reached the same collective (the n-th call on each communicator), then the last one adds
   the buffers in rank order ((r0 + r1) + r2) + ... and writes the sum to every rank. Calls must
   match across ranks (count, type, op), as NCCL requires; a mismatch or a rank that never comes
   aborts with a report.
   MGPU_EMU_NCCL_FAIL=init makes ncclCommInitAll fail as NCCL does without a usable GPU. */
#include "emu.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <vector>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NCCL_EXPORT extern "C" __attribute__((visibility("default")))

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5
};
enum { ncclSum = 0, ncclFloat32 = 7 };

namespace {

__attribute__((format(printf, 1, 2), noreturn)) void die(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "mgpu-emu nccl: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

struct collective {
    size_t count = 0;
    std::vector<const float*> send;
    std::vector<float*> recv;
    int arrived = 0, left = 0;
    bool done = false;
};

struct clique {
    int n = 0;
    int alive = 0;
    std::mutex mu;
    std::condition_variable cv;
    std::map<uint64_t, collective> pending;
};

struct call {
    clique* c;
    int rank;
    uint64_t seq;
    const float* send;
    float* recv;
    size_t count;
};

void run_allreduce(void* arg) {
    call* k = (call*)arg;
    clique* c = k->c;
    {
        std::unique_lock<std::mutex> lock(c->mu);
        collective& coll = c->pending[k->seq];
        if (coll.send.empty()) {
            coll.count = k->count;
            coll.send.assign(c->n, nullptr);
            coll.recv.assign(c->n, nullptr);
        }
        if (coll.count != k->count)
            die("ncclAllReduce #%llu: rank %d passes %zu elements, another rank %zu", (unsigned long long)k->seq,
                k->rank, k->count, coll.count);
        coll.send[k->rank] = k->send;
        coll.recv[k->rank] = k->recv;
        if (++coll.arrived == c->n) {
            std::vector<float> sum(coll.send[0], coll.send[0] + coll.count);
            for (int r = 1; r < c->n; ++r)
                for (size_t i = 0; i < coll.count; ++i) sum[i] += coll.send[r][i];
            for (int r = 0; r < c->n; ++r) memcpy(coll.recv[r], sum.data(), coll.count * sizeof(float));
            coll.done = true;
            c->cv.notify_all();
        } else if (!c->cv.wait_for(lock, std::chrono::duration<double>(mgpu_emu_timeout_seconds()),
                                   [&] { return coll.done; })) {
            die("ncclAllReduce #%llu: rank %d waited %.0f s for the other ranks (%d of %d arrived)",
                (unsigned long long)k->seq, k->rank, mgpu_emu_timeout_seconds(), coll.arrived, c->n);
        }
        if (++coll.left == c->n) c->pending.erase(k->seq);
    }
    delete k;
}

thread_local int tl_group_depth = 0;

}  // namespace

struct ncclComm {
    clique* c;
    int rank, dev;
    uint64_t seq = 0;
};
typedef ncclComm* ncclComm_t;

NCCL_EXPORT const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    default: return "unknown result code";
    }
}

NCCL_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
    const char* fail = getenv("MGPU_EMU_NCCL_FAIL");
    if (fail && strcmp(fail, "init") == 0) return ncclUnhandledCudaError;
    if (!comms || ndev < 1) return ncclInvalidArgument;
    const int count = mgpu_emu_device_count();
    for (int r = 0; r < ndev; ++r) {
        const int d = devlist ? devlist[r] : r;
        if (d < 0 || d >= count) return ncclInvalidArgument;
        for (int q = 0; q < r; ++q)
            if ((devlist ? devlist[q] : q) == d) return ncclInvalidUsage;   // "Duplicate GPU detected"
    }
    clique* c = new clique();
    c->n = c->alive = ndev;
    for (int r = 0; r < ndev; ++r) comms[r] = new ncclComm{c, r, devlist ? devlist[r] : r};
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    clique* c = comm->c;
    bool last;
    {
        std::lock_guard<std::mutex> lock(c->mu);
        last = --c->alive == 0;
    }
    delete comm;
    if (last) delete c;
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclGroupStart(void) {
    ++tl_group_depth;
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclGroupEnd(void) {
    if (tl_group_depth == 0) return ncclInvalidUsage;
    --tl_group_depth;
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op,
                                       ncclComm_t comm, void* stream) {
    if (!comm || !send || !recv) return ncclInvalidArgument;
    if (datatype != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;   // all mgpu asks for
    const int dev = mgpu_emu_stream_device(stream);
    if (dev != comm->dev) {
        fprintf(stderr, "mgpu-emu nccl: ncclAllReduce on rank %d (device %d) given a stream of device %d\n",
                comm->rank, comm->dev, dev);
        return ncclInvalidArgument;
    }
    if (count == 0) return ncclSuccess;
    mgpu_emu_check_device_range("ncclAllReduce send buffer", send, count * sizeof(float), comm->dev);
    mgpu_emu_check_device_range("ncclAllReduce receive buffer", recv, count * sizeof(float), comm->dev);
    mgpu_emu_count_collective();
    call* k = new call{comm->c, comm->rank, comm->seq++, (const float*)send, (float*)recv, count};
    mgpu_emu_enqueue(stream, run_allreduce, k, "ncclAllReduce");
    return ncclSuccess;
}
