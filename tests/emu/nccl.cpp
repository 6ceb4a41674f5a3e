/* tests/emu/nccl.cpp - a fake NCCL for the GPU emulator (libnccl_emu.so), loaded by mgpu's own
   dlopen path through MGPU_NCCL_LIBRARY. The calls mgpu makes: ncclCommInitAll, ncclCommDestroy,
   ncclGroupStart/End, ncclAllReduce (float32 sum), ncclBroadcast (float32), ncclGetErrorString;
   and across processes ncclGetUniqueId, ncclCommInitRank, ncclCommGetAsyncError.

   A collective is queued on each rank's stream; each rank's task waits there until every rank
   has reached the same collective (the n-th call on each communicator), then the last one adds
   the buffers in rank order ((r0 + r1) + r2) + ... (an all-reduce), or takes the root's (a
   broadcast), and writes the result to every rank. Calls must match across ranks (kind, count,
   type, op, root), as NCCL requires; a mismatch or a rank that never comes aborts with a report.
   Across processes (ncclCommInitRank), the ranks meet in a POSIX shared-memory segment named by
   the unique id (rank 0 makes it; the name is unlinked once every rank has joined): each round a
   rank copies up to 1 MiB of its buffer into its slot, the last to arrive adds the slots in rank
   order into the sum slot (a broadcast: the root's slot), and every rank copies it out; a process-shared mutex and
   condition variable order them, with the emulator's timeout.
   A group holds at most MGPU_EMU_NCCL_GROUP_OPS collectives (default 2048, NCCL's documented limit):
   past it the call fails (ncclInvalidUsage), as NCCL's does.
   MGPU_EMU_NCCL_FAIL=init makes ncclCommInitAll fail as NCCL does without a usable GPU;
   MGPU_EMU_NCCL_FAIL=hang:R makes global rank R's all-reduces across processes never finish (a
   GPU stuck in NCCL's kernel as when a peer is gone): they, and the other ranks' that wait for
   them, end only when their communicator is aborted (ncclCommAbort);
   MGPU_EMU_NCCL_FAIL=async:R makes global rank R's communicator report ncclRemoteError through
   ncclCommGetAsyncError after its first all-reduce (a peer gone, as NCCL sees it). */
#include "emu.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <vector>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NCCL_EXPORT extern "C" __attribute__((visibility("default")))

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6
};
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
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
    int root = -1;   // a broadcast's root; -1: an all-reduce
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
    // each rank's collectives that have run: the next one's number, counted when it runs (not when
    // queued), so a captured graph's collective is a new one on every replay
    std::vector<uint64_t> ran;
};

// sum[i] = ((src(0)[i] + src(1)[i]) + src(2)[i]) + ...: every rank's buffer, in rank order
template <class Src> void sum_in_rank_order(float* sum, int ranks, size_t count, Src src) {
    memcpy(sum, src(0), count * sizeof(float));
    for (int r = 1; r < ranks; ++r) {
        const float* s = src(r);
        for (size_t i = 0; i < count; ++i) sum[i] += s[i];
    }
}

struct call {
    clique* c;
    int rank;
    const float* send;
    float* recv;
    size_t count;
    int root;   // a broadcast's root; -1: an all-reduce
};
const char* call_name(int root) { return root < 0 ? "ncclAllReduce" : "ncclBroadcast"; }

void run_collective(void* arg) {
    const call* k = (const call*)arg;
    clique* c = k->c;
    {
        std::unique_lock<std::mutex> lock(c->mu);
        const uint64_t seq = c->ran[k->rank]++;
        collective& coll = c->pending[seq];
        if (coll.send.empty()) {
            coll.count = k->count;
            coll.root = k->root;
            coll.send.assign(c->n, nullptr);
            coll.recv.assign(c->n, nullptr);
        }
        if (coll.count != k->count || coll.root != k->root)
            die("%s #%llu: rank %d passes %zu elements (root %d), another rank's %s %zu (root %d)", call_name(k->root),
                (unsigned long long)seq, k->rank, k->count, k->root, call_name(coll.root), coll.count, coll.root);
        coll.send[k->rank] = k->send;
        coll.recv[k->rank] = k->recv;
        if (++coll.arrived == c->n) {
            std::vector<float> sum(coll.count);
            if (coll.root < 0) sum_in_rank_order(sum.data(), c->n, coll.count, [&](int r) { return coll.send[r]; });
            else memcpy(sum.data(), coll.send[coll.root], coll.count * sizeof(float));
            for (int r = 0; r < c->n; ++r) memcpy(coll.recv[r], sum.data(), coll.count * sizeof(float));
            coll.done = true;
            c->cv.notify_all();
        } else if (!c->cv.wait_for(lock, std::chrono::duration<double>(mgpu_emu_timeout_seconds()),
                                   [&] { return coll.done; })) {
            die("%s #%llu: rank %d waited %.0f s for the other ranks (%d of %d arrived)", call_name(k->root),
                (unsigned long long)seq, k->rank, mgpu_emu_timeout_seconds(), coll.arrived, c->n);
        }
        if (++coll.left == c->n) c->pending.erase(seq);
    }
}
void delete_call(void* arg) { delete (call*)arg; }

thread_local int tl_group_depth = 0;
thread_local long tl_group_ops = 0;   // collectives queued in this thread's open group
struct shared_clique;
thread_local std::vector<std::pair<shared_clique*, int>> tl_joining;   // ncclCommInitRank's in this group: (clique, rank)
void wait_joined(shared_clique* sc, int rank);

// ---- across processes: a clique in shared memory ----
const size_t kRoundFloats = (size_t)1 << 18;   // floats per rank per round
const char kIdMagic[] = "mgpu-emu-nccl";
const uint32_t kReady = 0x6d677075;

struct shared_clique {
    uint32_t ready;          // kReady once rank 0 has set it up (atomic)
    int n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int joined, arrived, departed, draining;
    uint64_t round, seq;     // rounds done; the collective of this round
    size_t count;            // floats of this round
    int root;                // its root (a broadcast), or -1 (an all-reduce)
    float data[1];           // n + 1 slots of kRoundFloats: each rank's, then the sum
};
size_t shared_bytes(int n) { return sizeof(shared_clique) + (size_t)(n + 1) * kRoundFloats * sizeof(float); }

// Waits on the shared condition variable until pred() holds, or dies after the emulator's timeout.
template <class P> void shared_wait(shared_clique* sc, P pred, const char* what, int rank) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)mgpu_emu_timeout_seconds();
    while (!pred())
        if (pthread_cond_timedwait(&sc->cv, &sc->mu, &deadline) == ETIMEDOUT && !pred())
            die("%s: rank %d waited %.0f s for the other processes' ranks (%d of %d arrived)", what, rank,
                mgpu_emu_timeout_seconds(), sc->arrived, sc->n);
}

void wait_joined(shared_clique* sc, int rank) {   // NCCL's initialisation is collective: every rank or none
    pthread_mutex_lock(&sc->mu);
    shared_wait(sc, [&] { return sc->joined == sc->n; }, "ncclCommInitRank", rank);
    pthread_mutex_unlock(&sc->mu);
}

}  // namespace

struct ncclComm {
    clique* c;
    int rank, dev;
    uint64_t seq = 0;
    shared_clique* shared = nullptr;   // across processes
    int async_error = 0;               // what ncclCommGetAsyncError reports
    bool fail_async = false;           // MGPU_EMU_NCCL_FAIL=async:R for this rank
    bool hang = false;                 // MGPU_EMU_NCCL_FAIL=hang:R for this rank
    int aborted = 0;                   // ncclCommAbort was called (atomic)
};
typedef ncclComm* ncclComm_t;

namespace {
struct shared_call {
    ncclComm* comm;
    uint64_t seq;
    const float* send;
    float* recv;
    size_t count;
    int root;   // a broadcast's root; -1: an all-reduce
};

bool aborted(const ncclComm* comm) { return __atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE) != 0; }

// A hung rank's all-reduce (MGPU_EMU_NCCL_FAIL=hang:R), and the others' that wait for it: until
// the communicator is aborted, as NCCL's kernels spin until ncclCommAbort stops them.
void wait_aborted(shared_call* k) {
    shared_clique* sc = k->comm->shared;
    pthread_mutex_lock(&sc->mu);
    while (!aborted(k->comm)) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += 1;   // (an abort from this process also broadcasts; another's may not reach us)
        pthread_cond_timedwait(&sc->cv, &sc->mu, &t);
    }
    pthread_mutex_unlock(&sc->mu);
    k->comm->async_error = ncclRemoteError;
}

void run_collective_shared(void* arg) {
    shared_call* k = (shared_call*)arg;
    shared_clique* sc = k->comm->shared;
    const int rank = k->comm->rank;
    char what[64];
    snprintf(what, sizeof what, "%s across processes", call_name(k->root));
    if (k->comm->hang) return wait_aborted(k);
    for (size_t off = 0; off < k->count; off += kRoundFloats) {
        const size_t len = k->count - off < kRoundFloats ? k->count - off : kRoundFloats;
        pthread_mutex_lock(&sc->mu);
        shared_wait(sc, [&] { return !sc->draining; }, what, rank);
        if (sc->arrived == 0) {
            sc->count = len;
            sc->seq = k->seq;
            sc->root = k->root;
        } else if (sc->count != len || sc->seq != k->seq || sc->root != k->root) {
            die("%s #%llu: rank %d passes %zu elements (root %d), another rank's #%llu %zu (root %d)", what,
                (unsigned long long)k->seq, rank, k->count, k->root, (unsigned long long)sc->seq, sc->count, sc->root);
        }
        if (k->root < 0 || k->root == rank) memcpy(sc->data + (size_t)rank * kRoundFloats, k->send + off, len * sizeof(float));
        const uint64_t mine = sc->round;
        if (++sc->arrived == sc->n) {   // the last one sums, in rank order (or takes the root's)
            float* result = sc->data + (size_t)sc->n * kRoundFloats;
            if (k->root < 0)
                sum_in_rank_order(result, sc->n, len, [&](int r) { return (const float*)sc->data + (size_t)r * kRoundFloats; });
            else memcpy(result, sc->data + (size_t)k->root * kRoundFloats, len * sizeof(float));
            sc->arrived = 0;
            sc->draining = 1;
            pthread_cond_broadcast(&sc->cv);
        } else {
            shared_wait(sc, [&] { return (sc->draining && sc->round == mine) || aborted(k->comm); }, what, rank);
            if (aborted(k->comm)) {   // the job is ending: this rank's share of the round is left as it is
                pthread_mutex_unlock(&sc->mu);
                k->comm->async_error = ncclRemoteError;
                return;
            }
        }
        memcpy(k->recv + off, sc->data + (size_t)sc->n * kRoundFloats, len * sizeof(float));
        if (++sc->departed == sc->n) {
            sc->departed = 0;
            sc->draining = 0;
            sc->round++;
            pthread_cond_broadcast(&sc->cv);
        }
        pthread_mutex_unlock(&sc->mu);
    }
    if (k->comm->fail_async) k->comm->async_error = ncclRemoteError;
}
void delete_shared_call(void* arg) { delete (shared_call*)arg; }
}  // namespace

NCCL_EXPORT const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
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
    c->ran.assign(ndev, 0);
    for (int r = 0; r < ndev; ++r) comms[r] = new ncclComm{c, r, devlist ? devlist[r] : r};
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static int made = 0;
    struct timespec t;
    if (!id) return ncclInvalidArgument;
    clock_gettime(CLOCK_REALTIME, &t);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "%s /mgpu-emu-nccl-%d-%d-%lld%09ld", kIdMagic, (int)getpid(),
             __atomic_fetch_add(&made, 1, __ATOMIC_RELAXED), (long long)t.tv_sec, (long)t.tv_nsec);
    return ncclSuccess;
}

// Joins rank `rank` of the clique the id names, on the current device, and waits until every
// rank has joined: at once, or inside a group at ncclGroupEnd, as NCCL does.
NCCL_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    char name[NCCL_UNIQUE_ID_BYTES];
    const char* fail = getenv("MGPU_EMU_NCCL_FAIL");
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    if (fail && strcmp(fail, "init") == 0) return ncclUnhandledCudaError;
    if (strncmp(id.internal, kIdMagic, sizeof kIdMagic - 1) != 0 || id.internal[sizeof kIdMagic - 1] != ' ') return ncclInvalidArgument;
    snprintf(name, sizeof name, "%s", id.internal + sizeof kIdMagic);
    const size_t bytes = shared_bytes(nranks);
    int fd = -1;
    if (rank == 0) {
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
            fprintf(stderr, "mgpu-emu nccl: shm_open/ftruncate(%s, %zu bytes): %s\n", name, bytes, strerror(errno));
            if (fd >= 0) close(fd);
            return ncclSystemError;
        }
    } else {   // until rank 0 has made it
        const double give_up = mgpu_emu_timeout_seconds();
        struct stat st;
        for (double waited = 0; ; waited += 1e-3) {
            if (fd < 0) fd = shm_open(name, O_RDWR, 0600);
            if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= bytes) break;
            if (waited > give_up)
                die("ncclCommInitRank: rank %d of %d waited %.0f s for rank 0's %s of %zu bytes (%s)", rank, nranks, give_up, name,
                    bytes, fd < 0 ? "never made" : "another size: do the ranks agree on nranks?");
            usleep(1000);
        }
    }
    shared_clique* sc = (shared_clique*)mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sc == MAP_FAILED) return ncclSystemError;
    if (rank == 0) {
        pthread_mutexattr_t ma;
        pthread_condattr_t ca;
        pthread_mutexattr_init(&ma);
        pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
        pthread_mutex_init(&sc->mu, &ma);
        pthread_condattr_init(&ca);
        pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
        pthread_cond_init(&sc->cv, &ca);
        sc->n = nranks;
        __atomic_store_n(&sc->ready, kReady, __ATOMIC_RELEASE);
    } else {
        for (double waited = 0; __atomic_load_n(&sc->ready, __ATOMIC_ACQUIRE) != kReady; waited += 1e-3) {
            if (waited > mgpu_emu_timeout_seconds()) die("ncclCommInitRank: rank %d: %s was never set up", rank, name);
            usleep(1000);
        }
        if (sc->n != nranks) die("ncclCommInitRank: rank %d says %d ranks, rank 0 said %d", rank, nranks, sc->n);
    }
    pthread_mutex_lock(&sc->mu);
    if (++sc->joined == nranks) shm_unlink(name);   // everyone has it mapped: no file left behind
    pthread_cond_broadcast(&sc->cv);
    pthread_mutex_unlock(&sc->mu);
    if (tl_group_depth > 0) tl_joining.push_back({sc, rank});   // waits at ncclGroupEnd, as NCCL's does
    else wait_joined(sc, rank);
    ncclComm* c = new ncclComm{nullptr, rank, mgpu_emu_stream_device(NULL)};
    c->shared = sc;
    c->fail_async = fail && strncmp(fail, "async:", 6) == 0 && atoi(fail + 6) == rank;
    c->hang = fail && strncmp(fail, "hang:", 5) == 0 && atoi(fail + 5) == rank;
    *comm = c;
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
    if (!comm || !async_error) return ncclInvalidArgument;
    *async_error = __atomic_load_n(&comm->async_error, __ATOMIC_ACQUIRE);
    return ncclSuccess;
}

// Stops the communicator's pending all-reduce (which then ends), as NCCL's does. The communicator
// itself is kept: a stream may still be inside its last collective, and the process is ending.
NCCL_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    __atomic_store_n(&comm->aborted, 1, __ATOMIC_RELEASE);
    if (comm->shared) {
        pthread_mutex_lock(&comm->shared->mu);
        pthread_cond_broadcast(&comm->shared->cv);
        pthread_mutex_unlock(&comm->shared->mu);
    }
    return ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    if (comm->shared) {
        munmap(comm->shared, shared_bytes(comm->shared->n));
        delete comm;
        return ncclSuccess;
    }
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
    if (--tl_group_depth == 0) {
        for (auto& j : tl_joining) wait_joined(j.first, j.second);
        tl_joining.clear();
        tl_group_ops = 0;
    }
    return ncclSuccess;
}

// Queues rank comm->rank's part of a collective (root < 0: an all-reduce; else a broadcast from
// root) on its stream.
static ncclResult_t enqueue(const char* name, const void* send, void* recv, size_t count, int datatype, int root, ncclComm_t comm,
                            void* stream) {
    if (!comm || !recv || (!send && (root < 0 || root == comm->rank))) return ncclInvalidArgument;
    if (datatype != ncclFloat32) return ncclInvalidArgument;   // all mgpu asks for
    const int n = comm->shared ? comm->shared->n : comm->c->n;
    if (root >= n) return ncclInvalidArgument;
    const int dev = mgpu_emu_stream_device(stream);
    if (dev != comm->dev) {
        fprintf(stderr, "mgpu-emu nccl: %s on rank %d (device %d) given a stream of device %d\n", name, comm->rank, comm->dev, dev);
        return ncclInvalidArgument;
    }
    if (tl_group_depth > 0) {   // NCCL's limit on a group's operations (MGPU_EMU_NCCL_GROUP_OPS to lower it)
        static const long most = (long)mgpu_emu_setting_number("MGPU_EMU_NCCL_GROUP_OPS", 1, 1 << 20, 2048, 1, "operations");
        if (++tl_group_ops > most) {
            fprintf(stderr, "mgpu-emu nccl: %s: more than %ld operations in one group (ncclGroupStart .. ncclGroupEnd)\n", name, most);
            return ncclInvalidUsage;
        }
    }
    if (count == 0) return ncclSuccess;
    if (root < 0 || root == comm->rank) mgpu_emu_check_device_range("NCCL send buffer", send, count * sizeof(float), comm->dev);
    mgpu_emu_check_device_range("NCCL receive buffer", recv, count * sizeof(float), comm->dev);
    mgpu_emu_count_collective();
    if (comm->shared) {   // (the stream keeps the name: a literal)
        shared_call* k = new shared_call{comm, comm->seq++, (const float*)send, (float*)recv, count, root};
        return mgpu_emu_enqueue(stream, run_collective_shared, k, delete_shared_call,
                                root < 0 ? "ncclAllReduce across processes" : "ncclBroadcast across processes")
                   ? ncclUnhandledCudaError : ncclSuccess;
    }
    call* k = new call{comm->c, comm->rank, (const float*)send, (float*)recv, count, root};
    return mgpu_emu_enqueue(stream, run_collective, k, delete_call, name) ? ncclUnhandledCudaError : ncclSuccess;
}

NCCL_EXPORT ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op,
                                       ncclComm_t comm, void* stream) {
    if (op != ncclSum) return ncclInvalidArgument;   // all mgpu asks for
    return enqueue("ncclAllReduce", send, recv, count, datatype, -1, comm, stream);
}

// Root's send[count] into every rank's recv (in place on the root when send == recv).
NCCL_EXPORT ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, int datatype, int root, ncclComm_t comm,
                                       void* stream) {
    if (root < 0) return ncclInvalidArgument;
    return enqueue("ncclBroadcast", send, recv, count, datatype, root, comm, stream);
}
