/* tests/emu/runtime.cpp - the GPU emulator: the CUDA runtime, cuBLAS and cuBLASLt subset mgpu uses, on the
   CPU (built as libmgpuemu.so, linked in place of -lcudart -lcublas -lcublasLt).

   - Devices: MGPU_EMU_DEVICES (default 1, at most 8), each with MGPU_EMU_MEMORY MiB (default
     16384); launch limits MGPU_EMU_MAX_THREADS (threads per block, default 1024) and
     MGPU_EMU_MAX_SHARED (dynamic shared bytes, default 49152), and up to MGPU_EMU_MAX_SHARED_OPTIN
     (default 232448, an H100's) for a kernel given more by cudaFuncSetAttribute on that device.
   - Memory: cudaMalloc is a heap block of the exact size (so AddressSanitizer sees a kernel's
     out-of-bounds access), 256-byte aligned, filled with 0xFF bytes (NaN floats, -1 integers).
     A registry of live allocations checks every copy, memset, GEMM and NCCL operand, and every
     pointer a kernel receives, against the device that uses it (or a peer with access enabled).
   - Streams: ordered queues, each run by its own worker thread; events; waits with CUDA's
     semantics (a wait is for the event's latest record at the time of the call). Not emulated:
     the legacy default stream's implicit synchronisation with blocking streams (mgpu creates
     only non-blocking ones).
   - Graphs: stream capture in the three modes, as CUDA documents it. Work queued on a capturing
     stream (kernels, GEMMs, copies, memsets, the fake NCCL's calls) becomes a node that depends on
     the stream's previous node; an event recorded in the capture marks a position, and a stream
     that waits on it joins the capture (any device's). EndCapture checks that every stream was
     joined back into the origin. What a capture forbids fails with CUDA's error and invalidates it:
     synchronizing the stream or a captured event, a copy to or from pageable memory, a wait on
     work outside the capture, and cudaMalloc/cudaFree/cudaHostAlloc/cudaFreeHost/
     cudaDeviceSynchronize during a global capture or one of the thread's own (not relaxed).
     cudaGraphLaunch runs the nodes on one stream per captured stream, made at instantiate, each
     node after those it depends on (chaos delays them as other work, so a missing edge shows);
     the launch stream's later work, and the exec's next launch, come after all of them.
     Destroying a graph or exec while a launch runs is safe. Not emulated: graphs built or edited
     node by node (cudaGraphAdd*, cudaGraphExecUpdate), a graph launched inside a capture (refused
     as unsupported), the legacy stream in a capture (refused), event record nodes, conditional
     nodes, and the cost model (a replay is as slow as the eager work).
   - Kernels: the blocks of a launch run one after another on the stream's worker; the threads of
     a block run as fibers (a small hand-written context switch) that switch only at __syncthreads
     and the shuffles. The warps leave each barrier in a pseudo-random order, and a warp whose
     shuffle completes goes on first, as far as its next barrier, ahead of the block's other warps:
     a missing __syncthreads between two uses of shared memory shows. A divergent barrier, a
     shuffle with missing lanes or a deadlock aborts the program with the kernel's name.
   - Chaos: MGPU_EMU_CHAOS=SEED delays each queued task by 0..MGPU_EMU_CHAOS_US (default 300)
     microseconds, and on every third stream (which ones, from the seed) by up to
     MGPU_EMU_CHAOS_SLOW (default 10) times that, so work that is not ordered by an event runs in
     a different order; the order of the warps leaving a barrier comes from that seed too.
   - Faults: MGPU_EMU_FAIL_MALLOC=N (the Nth cudaMalloc fails, and the MGPU_EMU_FAIL_MALLOC_COUNT - 1
     after it), MGPU_EMU_FAIL_LAUNCH=N (the Nth
     launch fails), MGPU_EMU_NO_PEER=1 (no peer access between devices), MGPU_EMU_NO_LT=1 (cuBLASLt's
     heuristic finds no algorithm); a test sets the first two
     at run time (mgpu_emu_fail_next, mgpu_emu_fail_at, counting with mgpu_emu_calls: emu.h).
   - A misuse the real GPU would not report reliably (an operand outside any allocation, a pointer
     to another device's memory without peer access, a wait that never ends: MGPU_EMU_TIMEOUT
     seconds, default 600) is printed with "mgpu-emu:" and aborts, so the run fails loudly.
   - Races: MGPU_EMU_RACECHECK=1 checks that work on two streams touching the same memory is
     ordered: a vector clock per stream, advanced by each task, joined through events, graph edges
     and the host's synchronisations (what the host queues after it saw work done comes after
     that work; one host clock for all the host's threads). Each task's memory is what the checks
     of the registry above see: the ranges of a copy, a memset, a GEMM's operands, cuBLASLt's
     bias, aux and workspace and the emulated NCCL's buffers (read or written), and only the byte
     each pointer argument of a kernel points at (its extent is not known), written unless it is
     a pointer to const (a functor's pointers count as written). Two readers in no order are
     fine; a writer and anything else in no order is printed with "mgpu-emu:" naming both tasks,
     and aborts. Most often: a block of a device's cache (which that device's stream
     alone orders) used by another stream while work of the first on it was still queued.
   - MGPU_EMU_COUNTERS=1 prints the counters (emu.h) at exit. They count the host's calls: the
     nodes a graph launch replays count nothing.
   - MGPU_EMU_STACK_KIB: a kernel thread's stack (default and least 64 KiB, 256 under ASan).
   - Every setting is read by mgpu.h's rules (setting_number below; docs/guide.md has the ranges). */
#include "cuda_runtime.h"
#include "cublas_v2.h"
#include "cublasLt.h"
#include "emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---- configuration and reports ---------------------------------------------------------------
constexpr int kMaxDevices = 8;

struct config {
    int devices = 1;
    size_t memory = (size_t)16384 << 20;
    int max_threads = 1024;
    size_t max_shared = 49152, max_shared_optin = 232448;
    long fail_malloc = 0, fail_malloc_count = 1, fail_launch = 0, fail_launch_count = 1, fail_capture = 0;
    bool no_peer = false;
    uint64_t chaos = 0;
    int chaos_us = 300;
    int chaos_slow = 10;
    double timeout = 600.0;
    size_t stack = 0;
    bool print_counters = false;
    bool racecheck = false;
};

// The emulator's settings, read by mgpu.h's rules (>>impl threads, settings), of which this is a
// copy (runtime.cpp is C++ built apart from the header): surrounding spaces ignored, an empty value
// is the default; a decimal number only (no inf, nan, hex, "12us"), whole where it counts
// something, one outside the range is the nearest end; flags 0/1, true/false, on/off, yes/no in any
// case; anything else warns once per variable and value ("mgpu-emu: NAME='v' why; using X") and
// the default is used. test_emu checks that this copy and the header's agree, row by row.
bool setting_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

bool setting_text(const char* name, const char** at, size_t* len) {
    const char* v = getenv(name);
    if (!v) return false;
    while (setting_space(*v)) ++v;
    size_t n = strlen(v);
    while (n > 0 && setting_space(v[n - 1])) --n;
    *at = v;
    *len = n;
    return n > 0;
}

void setting_warn(const char* name, const char* why, const char* instead) {
    static std::mutex lock;
    static std::set<std::pair<std::string, uint64_t>> warned;
    const char* v = getenv(name);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; v && v[i]; ++i) h = (h ^ (unsigned char)v[i]) * 1099511628211ull;
    {
        std::lock_guard<std::mutex> hold(lock);
        if (!warned.insert(std::make_pair(std::string(name), h)).second) return;
    }
    fprintf(stderr, "mgpu-emu: %s='%s' %s; using %s\n", name, v ? v : "", why, instead);
}

double setting_number(const char* name, double min, double max, double def, bool whole, const char* unit) {
    const char* at;
    size_t len, i;
    char text[64], *end = nullptr, why[160], instead[64];
    if (!setting_text(name, &at, &len)) return def;
    for (i = 0; i < len && i < sizeof text - 1; ++i) {   // decimal only: no inf, nan, hex; 63 characters at most
        const char c = at[i];
        if (!((c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.' || c == 'e' || c == 'E')) break;
        text[i] = c;
    }
    text[i] = 0;
    const double v = i == len ? strtod(text, &end) : 0.0;
    if (i != len || end != text + len || v != v) {
        snprintf(why, sizeof why, "is not %s number of %s", whole ? "a whole" : "a", unit);
        snprintf(instead, sizeof instead, "%.15g", def);
        setting_warn(name, why, instead);
        return def;
    }
    if (whole && v >= min && v <= max && v != floor(v)) {
        snprintf(why, sizeof why, "is not a whole number of %s", unit);
        snprintf(instead, sizeof instead, "%.15g", def);
        setting_warn(name, why, instead);
        return def;
    }
    if (v < min || v > max) {
        const double nearest = v < min ? min : max;
        snprintf(why, sizeof why, "is outside %.15g..%.15g %s", min, max, unit);
        snprintf(instead, sizeof instead, "%.15g", nearest);
        setting_warn(name, why, instead);
        return nearest;
    }
    return v;
}
long setting_whole(const char* name, long min, long max, long def, const char* unit) {
    return (long)setting_number(name, (double)min, (double)max, (double)def, true, unit);
}

bool setting_is(const char* s, size_t n, const char* word) {
    for (size_t i = 0; i < n; ++i) {
        const char a = s[i] >= 'A' && s[i] <= 'Z' ? (char)(s[i] - 'A' + 'a') : s[i];
        if (!word[i] || a != word[i]) return false;
    }
    return word[n] == 0;
}

bool setting_flag(const char* name, bool def) {
    static const char* const words[8] = {"0", "1", "false", "true", "off", "on", "no", "yes"};
    const char* at;
    size_t len;
    if (!setting_text(name, &at, &len)) return def;
    for (int i = 0; i < 8; ++i)
        if (setting_is(at, len, words[i])) return i % 2 != 0;
    setting_warn(name, "is not 0/1, true/false, on/off or yes/no", def ? "1 (on)" : "0 (off)");
    return def;
}

std::atomic<uint64_t> c_launches{0}, c_syncs{0}, c_allocs{0}, c_frees{0}, c_h2d{0}, c_d2h{0}, c_peer{0}, c_d2d{0},
    c_collectives{0}, c_set_device{0}, c_get_device{0}, c_gemms{0}, c_copies_h2d{0}, c_copies_d2h{0},
    c_copies_peer{0}, c_copies_d2d{0}, c_event_records{0}, c_event_waits{0}, c_graph_launches{0}, c_captures{0},
    c_lt_heuristics{0};

void print_counters_at_exit() {
    fprintf(stderr,
            "mgpu-emu counters: launches %llu (gemms %llu), syncs %llu, allocs %llu, frees %llu, h2d %llu B in %llu "
            "copies, d2h %llu B in %llu, peer %llu B in %llu, d2d %llu B in %llu, collectives %llu, set_device %llu, "
            "get_device %llu, event records %llu, event waits %llu, graph launches %llu, captures %llu\n",
            (unsigned long long)c_launches, (unsigned long long)c_gemms, (unsigned long long)c_syncs,
            (unsigned long long)c_allocs, (unsigned long long)c_frees, (unsigned long long)c_h2d,
            (unsigned long long)c_copies_h2d, (unsigned long long)c_d2h, (unsigned long long)c_copies_d2h,
            (unsigned long long)c_peer, (unsigned long long)c_copies_peer, (unsigned long long)c_d2d,
            (unsigned long long)c_copies_d2d, (unsigned long long)c_collectives, (unsigned long long)c_set_device,
            (unsigned long long)c_get_device, (unsigned long long)c_event_records, (unsigned long long)c_event_waits,
            (unsigned long long)c_graph_launches, (unsigned long long)c_captures);
}

void join_retired_at_exit(void);   // (below: the retired stream workers)

const config& conf() {
    static config c;
    static std::once_flag once;
    std::call_once(once, [] {
        const long big = 1000000000000000L;   // counts of calls: more than a program makes
        c.devices = (int)setting_whole("MGPU_EMU_DEVICES", 0, kMaxDevices, 1, "devices");
        c.memory = (size_t)setting_whole("MGPU_EMU_MEMORY", 1, 1L << 20, 16384, "MiB") << 20;
        c.max_threads = (int)setting_whole("MGPU_EMU_MAX_THREADS", 1, 1024, 1024, "threads per block");
        c.max_shared = (size_t)setting_whole("MGPU_EMU_MAX_SHARED", 0, 1L << 20, 49152, "bytes");
        c.max_shared_optin = std::max(c.max_shared, (size_t)setting_whole("MGPU_EMU_MAX_SHARED_OPTIN", 0, 1L << 20, 232448, "bytes"));
        c.fail_malloc = setting_whole("MGPU_EMU_FAIL_MALLOC", 0, big, 0, "cudaMalloc calls");
        c.fail_malloc_count = setting_whole("MGPU_EMU_FAIL_MALLOC_COUNT", 1, big, 1, "cudaMalloc calls");
        c.fail_launch = setting_whole("MGPU_EMU_FAIL_LAUNCH", 0, big, 0, "launches");
        c.no_peer = setting_flag("MGPU_EMU_NO_PEER", false);
        c.chaos = (uint64_t)setting_whole("MGPU_EMU_CHAOS", 0, 1L << 53, 0, "(a seed; 0: off)");
        c.chaos_us = (int)setting_whole("MGPU_EMU_CHAOS_US", 0, 1000000, 300, "microseconds");
        c.chaos_slow = (int)setting_whole("MGPU_EMU_CHAOS_SLOW", 1, 1000, 10, "times");
        c.timeout = setting_number("MGPU_EMU_TIMEOUT", 1, 1e9, 600, false, "seconds");
        // a kernel's thread runs on a stack of this size: less than the default (what every kernel
        // is tested with; ASan's frames are larger) would overflow it, so the default is the least
#ifdef EMU_ASAN
        c.stack = (size_t)setting_whole("MGPU_EMU_STACK_KIB", 256, 1L << 20, 256, "KiB") << 10;
#else
        c.stack = (size_t)setting_whole("MGPU_EMU_STACK_KIB", 64, 1L << 20, 64, "KiB") << 10;
#endif
        c.print_counters = setting_flag("MGPU_EMU_COUNTERS", false);
        c.racecheck = setting_flag("MGPU_EMU_RACECHECK", false);
        if (c.print_counters) atexit(print_counters_at_exit);
        atexit(join_retired_at_exit);   // (registered after the sanitizers' own: runs before their check)
    });
    return c;
}

__attribute__((format(printf, 1, 2), noreturn)) void die(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "mgpu-emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

double now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

thread_local int tl_device = 0;
thread_local cudaError_t tl_last = cudaSuccess;

cudaError_t fail(cudaError_t e) {
    tl_last = e;
    return e;
}

// ---- streams ---------------------------------------------------------------------------------
struct capture_state;

struct task {
    std::function<void()> fn;
    const char* what;
};

// Retired workers (a destroyed graph exec's streams, mid-way through their last work) until they
// have ended: joined by later retires once they have, and at exit (join_retired_at_exit, before
// LeakSanitizer's check: a thread still ending while that check stops the world can crash its
// tracer, "Tracer caught signal 11", which fails a run that leaked nothing).
struct retired_worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> ended;   // set by the worker as its last act but returning
};
std::mutex g_retired_mu;
// guarded by g_retired_mu; never destroyed (a joinable thread's destructor would end the program),
// and a forked child leaves its parent's alone
std::vector<retired_worker>* g_retired = new std::vector<retired_worker>();
pid_t g_retired_pid = getpid();

// Joins the retired workers that have ended (all: waits for them, up to a minute, then leaves any
// still running to end with the process)
void join_retired(bool all) {
    std::vector<retired_worker> ended;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    if (getpid() != g_retired_pid) return;
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(g_retired_mu);
            std::vector<retired_worker>& r = *g_retired;
            for (size_t i = 0; i < r.size();)
                if (r[i].ended->load()) {
                    ended.push_back(std::move(r[i]));
                    if (i + 1 < r.size()) r[i] = std::move(r.back());
                    r.pop_back();
                } else {
                    ++i;
                }
            if (!all || r.empty() || std::chrono::steady_clock::now() > deadline) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (retired_worker& w : ended) w.thread.join();
    if (all) {   // (still running after a minute: left to end with the process, as before)
        std::lock_guard<std::mutex> lock(g_retired_mu);
        for (retired_worker& w : *g_retired) w.thread.detach();
        g_retired->clear();
    }
}
void join_retired_at_exit(void) { join_retired(true); }

}  // namespace

namespace {   // (MGPU_EMU_RACECHECK, below)
void race_host_saw_stream(int stream);
void race_stream_made(int stream, int dev);
}
struct CUstream_st {
    int dev = 0;
    unsigned flags = 0;
    int id = 0;
    std::mutex mu;
    std::condition_variable cv_work, cv_done;
    std::deque<task> queue;
    uint64_t enqueued = 0, done = 0;
    const char* running = nullptr;
    bool stop = false;
    bool retired = false;   // the worker frees the stream once its queue is empty
    std::shared_ptr<std::atomic<bool>> ended;   // retired: set as the worker's last act
    uint64_t rng = 0;
    int slow = 1;   // chaos: this stream's delays are this many times longer
    std::thread worker;
    std::shared_ptr<capture_state> cap;   // the capture it belongs to, if any (guarded by g_cap_mu)

    void run() {
        for (;;) {
            task t;
            {
                std::unique_lock<std::mutex> lock(mu);
                cv_work.wait(lock, [&] { return stop || !queue.empty(); });
                if (queue.empty()) {
                    if (!retired) return;
                    std::shared_ptr<std::atomic<bool>> last = ended;
                    lock.unlock();
                    delete this;
                    last->store(true);
                    return;
                }
                t = std::move(queue.front());
                queue.pop_front();
                running = t.what;
            }
            if (conf().chaos) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                const int us = (int)(rng % ((uint64_t)conf().chaos_us * slow + 1));
                if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
            }
            t.fn();
            t.fn = nullptr;   // what it holds (a kernel's arguments) is freed before the stream counts it done
            {
                std::lock_guard<std::mutex> lock(mu);
                ++done;
                running = nullptr;
            }
            cv_done.notify_all();
        }
    }
    void push(std::function<void()> fn, const char* what) {
        {
            std::lock_guard<std::mutex> lock(mu);
            queue.push_back(task{std::move(fn), what});
            ++enqueued;
        }
        cv_work.notify_one();
    }
    // Ends the worker once the queue drains, without waiting for it: a graph exec's streams, which
    // a launch still in flight may use after the exec is destroyed. The stream is not to be touched
    // after; its thread goes to g_retired, to be joined once it has ended.
    void retire() {
        join_retired(false);
        retired_worker w{std::move(worker), std::make_shared<std::atomic<bool>>(false)};
        {
            std::lock_guard<std::mutex> lock(g_retired_mu);
            g_retired->push_back(std::move(w));
            ended = g_retired->back().ended;
        }
        std::lock_guard<std::mutex> lock(mu);
        stop = retired = true;
        cv_work.notify_all();
    }
    void sync(const char* why) {
        std::unique_lock<std::mutex> lock(mu);
        const uint64_t target = enqueued;
        if (!cv_done.wait_for(lock, std::chrono::duration<double>(conf().timeout), [&] { return done >= target; }))
            die("%s: stream %d of device %d still busy after %.0f s (running: %s, %zu queued): a wait that never ends?",
                why, id, dev, conf().timeout, running ? running : "nothing", queue.size());
        lock.unlock();
        if (conf().racecheck) race_host_saw_stream(id);   // what the host queues next comes after this
    }
};

struct CUevent_st {
    int dev = 0;
    unsigned flags = 0;
    std::mutex mu;
    std::condition_variable cv;
    uint64_t recorded = 0, completed = 0;
    double time_ms = 0.0;
    // recorded last on a capturing stream: the capture, and the nodes a wait on it then depends on
    // (guarded by g_cap_mu)
    std::shared_ptr<capture_state> cap;
    std::vector<int> cap_pos;
    bool wait_for(uint64_t target, double seconds) {
        std::unique_lock<std::mutex> lock(mu);
        return cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return completed >= target; });
    }
};

namespace {

struct allocation {
    size_t size;
    int dev;   // -1: pinned host memory
};

struct device_state {
    size_t used = 0;
    bool peer[kMaxDevices] = {};
    cudaStream_t legacy = nullptr;
};

std::mutex g_mu;   // guards everything below
// (device, kernel): the dynamic shared bytes cudaFuncSetAttribute allowed it there
std::map<std::pair<int, const void*>, size_t> g_func_shared;
std::map<uintptr_t, allocation> g_allocs;
device_state g_dev[kMaxDevices];
std::set<cudaStream_t> g_streams;
std::set<cudaEvent_t> g_events;
int g_next_stream_id = 0;
long g_malloc_calls = 0, g_launch_calls = 0;

cudaStream_t make_stream(int dev, unsigned flags) {
    cudaStream_t s = new CUstream_st();
    s->dev = dev;
    s->flags = flags;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        s->id = g_next_stream_id++;
        g_streams.insert(s);
    }
    s->rng = (conf().chaos * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)(s->id + 1) * 0xBF58476D1CE4E5B9ull);
    if (!s->rng) s->rng = 1;
    // chaos: every third stream (which ones, from the seed) lags far behind the others, all the
    // time, so that a stream that should wait for it but does not runs ahead by many tasks, not by
    // a few microseconds
    if (conf().chaos && (s->id + conf().chaos) % 3 == 0) s->slow = conf().chaos_slow;
    if (conf().racecheck) race_stream_made(s->id, dev);
    s->worker = std::thread([s] { s->run(); });
    return s;
}

// The stream a call names (NULL: the current device's legacy stream), or NULL if not live.
std::mutex g_legacy_mu;
cudaStream_t resolve(cudaStream_t s) {
    if (!s) {
        std::lock_guard<std::mutex> made(g_legacy_mu);
        cudaStream_t* legacy;
        {
            std::lock_guard<std::mutex> lock(g_mu);
            legacy = &g_dev[tl_device].legacy;
            if (*legacy) return *legacy;
        }
        cudaStream_t n = make_stream(tl_device, cudaStreamDefault);
        std::lock_guard<std::mutex> lock(g_mu);
        *legacy = n;
        return n;
    }
    std::lock_guard<std::mutex> lock(g_mu);
    return g_streams.count(s) ? s : nullptr;
}

// The live allocation that contains p, or end. *base gets its start.
std::map<uintptr_t, allocation>::iterator find_alloc(const void* p) {
    const uintptr_t a = (uintptr_t)p;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return g_allocs.end();
    --it;
    if (a >= it->first && a < it->first + (it->second.size ? it->second.size : 1)) return it;
    return g_allocs.end();
}

enum mem_kind { PAGEABLE, PINNED, DEVICE };
struct where {
    mem_kind kind;
    int dev;
};

// Classifies [p, p + bytes); a range that starts in an allocation and runs past its end aborts.
where classify(const char* what, const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = find_alloc(p);
    if (it == g_allocs.end()) return where{PAGEABLE, -1};
    const uintptr_t end = it->first + it->second.size;
    if ((uintptr_t)p + bytes > end)
        die("%s: %zu bytes at %p run %zu bytes past the end of a %zu-byte %s allocation at %p", what, bytes, p,
            (size_t)((uintptr_t)p + bytes - end), it->second.size,
            it->second.dev < 0 ? "pinned host" : "device", (void*)it->first);
    return it->second.dev < 0 ? where{PINNED, -1} : where{DEVICE, it->second.dev};
}

bool peer_enabled(int from, int to) {
    return from == to || g_dev[from].peer[to];
}

// The device memory the calls of this host thread checked since it last queued a task: what that
// task touches (MGPU_EMU_RACECHECK).
struct touch { uintptr_t lo, hi; bool write; };
thread_local std::vector<touch> tl_touch;
void note_touch(uintptr_t lo, uintptr_t hi, bool write) {
    if (conf().racecheck) tl_touch.push_back(touch{lo, hi, write});
}
// An API call that queues work: what it notes is its own task's (cleared at the start), and none
// is left for a later task when it returns without queueing (cleared at the end).
struct touch_scope {
    explicit touch_scope(bool clear_now = true) { if (clear_now) tl_touch.clear(); }
    ~touch_scope() { tl_touch.clear(); }
    touch_scope(const touch_scope&) = delete;
    touch_scope& operator=(const touch_scope&) = delete;
};

// [p, p + bytes) must be device memory of dev, or of a peer that dev reaches (when allow_peer);
// the task queued next reads it, or writes it (MGPU_EMU_RACECHECK).
void check_device(const char* what, const void* p, size_t bytes, int dev, bool allow_peer, bool write = true) {
    where w = classify(what, p, bytes);
    note_touch((uintptr_t)p, (uintptr_t)p + bytes, write);
    if (w.kind != DEVICE)
        die("%s: %p (%zu bytes) is not in a live device allocation%s", what, p, bytes,
            w.kind == PINNED ? " (it is pinned host memory)" : "");
    std::lock_guard<std::mutex> lock(g_mu);
    if (w.dev != dev && !(allow_peer && peer_enabled(dev, w.dev)))
        die("%s: %p is memory of device %d, used on device %d%s", what, p, w.dev, dev,
            allow_peer ? " without peer access enabled" : "");
}

// ---- races (MGPU_EMU_RACECHECK) ----------------------------------------------------------------
// Happens-before by vector clocks: clock[t] of stream s is how many tasks of stream t are known to
// come before s's current one. Memory: per allocation, the last touch of each stream.
typedef std::vector<uint64_t> vclock;
typedef std::vector<touch> touches;
struct race_touch { int stream; uint64_t tick; uintptr_t lo, hi; bool write; const char* what; };
std::mutex g_race_mu;
std::map<int, vclock> g_stream_clock;
std::map<int, int> g_stream_device;
vclock g_host_clock;                                              // what the host saw done
std::map<const void*, std::deque<std::pair<uint64_t, vclock>>> g_event_clock;   // an event's latest records
std::map<uintptr_t, std::vector<race_touch>> g_race_memory;     // allocation base -> touches

void clock_join(vclock& a, const vclock& b) {
    if (a.size() < b.size()) a.resize(b.size(), 0);
    for (size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
}
vclock race_host() {
    std::lock_guard<std::mutex> lock(g_race_mu);
    return g_host_clock;
}
vclock race_stream(int stream) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    return g_stream_clock[stream];
}
// A task of `stream` begins: after `before` (what the host had seen when it queued it, or a graph
// node's dependencies); each range it touches is checked against the other streams' last touches.
void race_task(int stream, const vclock& before, const touches& touch, const char* what) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    vclock& now = g_stream_clock[stream];
    clock_join(now, before);
    if ((int)now.size() <= stream) now.resize((size_t)stream + 1, 0);
    const uint64_t tick = ++now[(size_t)stream];
    for (const auto& r : touch) {
        uintptr_t base;
        allocation block;
        {
            std::lock_guard<std::mutex> g(g_mu);
            auto it = find_alloc((const void*)r.lo);
            if (it == g_allocs.end()) continue;
            base = it->first;
            block = it->second;
        }
        std::vector<race_touch>& seen = g_race_memory[base];
        bool kept = false;
        for (race_touch& t : seen) {
            if (t.stream != stream && (t.write || r.write) && t.lo < r.hi && r.lo < t.hi &&
                (now.size() <= (size_t)t.stream || now[(size_t)t.stream] < t.tick))
                die("MGPU_EMU_RACECHECK: %s on stream %d (device %d) %s and %s on stream %d (device %d) %s the same memory in "
                    "no order: [%p, +%zu) and [%p, +%zu) of device %d's %zu-byte block at %p", t.what, t.stream,
                    g_stream_device[t.stream], t.write ? "writes" : "reads", what, stream, g_stream_device[stream],
                    r.write ? "writes" : "reads", (void*)t.lo, (size_t)(t.hi - t.lo), (void*)r.lo, (size_t)(r.hi - r.lo), block.dev,
                    block.size, (void*)base);
            if (t.stream == stream && t.lo == r.lo && t.hi == r.hi && t.write == r.write) {
                t.tick = tick;
                t.what = what;
                kept = true;
            }
        }
        if (!kept) seen.push_back(race_touch{stream, tick, r.lo, r.hi, r.write, what});
        if (seen.size() > 4096) seen.erase(seen.begin());   // (views of ever new ranges: the oldest go)
    }
}
void race_record(const void* event, uint64_t target, int stream) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    std::deque<std::pair<uint64_t, vclock>>& q = g_event_clock[event];
    q.emplace_back(target, g_stream_clock[stream]);
    if (q.size() > 256) q.pop_front();
}
// the clock of an event's record `target` joined into `into` (a stream's, or the host's)
void race_event(const void* event, uint64_t target, vclock* into) {
    for (const auto& r : g_event_clock[event])
        if (r.first == target) clock_join(*into, r.second);
}
void race_wait(const void* event, uint64_t target, int stream) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    race_event(event, target, &g_stream_clock[stream]);
}
void race_host_saw_event(const void* event, uint64_t target) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    race_event(event, target, &g_host_clock);
}
void race_stream_made(int stream, int dev) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    g_stream_device[stream] = dev;
}
void race_host_saw_stream(int stream) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    clock_join(g_host_clock, g_stream_clock[stream]);
}
// "kernel (file:line)", kept for the program's life: a report names where it was launched
const char* race_name(const char* name, const char* file, int line) {
    static std::set<std::string> names;
    std::lock_guard<std::mutex> lock(g_race_mu);
    return names.insert(std::string(name) + " (launched at " + file + ":" + std::to_string(line) + ")").first->c_str();
}
void race_freed(uintptr_t base) {
    std::lock_guard<std::mutex> lock(g_race_mu);
    g_race_memory.erase(base);
}

// ---- stream capture --------------------------------------------------------------------------
// A captured graph: its nodes in the order they were queued (so every edge points back), each
// with the captured stream that queued it. Work is queued as closures that a graph may run again
// on every launch.
struct graph_node {
    std::function<void()> fn;
    const char* what;
    int slot;                 // the captured stream, an index into slot_dev
    std::vector<int> deps;    // earlier nodes it runs after
    touches touch;            // the memory it touches (MGPU_EMU_RACECHECK)
};
struct graph_body {
    std::vector<graph_node> nodes;
    std::vector<int> slot_dev;   // the device of each captured stream
};

struct capture_state {
    cudaStreamCaptureMode mode;
    std::thread::id thread;   // that began it (thread-local mode)
    cudaStream_t origin;
    bool invalidated = false, ended = false;
    std::shared_ptr<graph_body> body;
    struct member {
        int slot;
        std::vector<int> tail;   // what the stream's next node depends on
    };
    std::map<cudaStream_t, member> streams;
};

std::mutex g_cap_mu;   // guards the captures, and the streams' and events' cap fields
std::set<capture_state*> g_captures;   // those under way

cudaError_t result(cudaError_t e) { return e == cudaSuccess ? e : fail(e); }

// Work for s: run by its worker, or, while s is being captured, a node of the capture's graph.
cudaError_t submit(cudaStream_t s, std::function<void()> fn, const char* what) {
    {
        std::lock_guard<std::mutex> lock(g_cap_mu);
        if (capture_state* c = s->cap.get()) {
            if (c->invalidated) return cudaErrorStreamCaptureInvalidated;
            capture_state::member& m = c->streams[s];
            c->body->nodes.push_back(graph_node{std::move(fn), what, m.slot, m.tail, tl_touch});
            tl_touch.clear();
            m.tail.assign(1, (int)c->body->nodes.size() - 1);
            return cudaSuccess;
        }
    }
    if (conf().racecheck) {
        const int stream = s->id;
        fn = [inner = std::move(fn), touch = tl_touch, before = race_host(), stream, what] {
            race_task(stream, before, touch, what);
            inner();
        };
        tl_touch.clear();
    }
    s->push(std::move(fn), what);
    return cudaSuccess;
}

// A call that a capture of s forbids: CUDA invalidates the capture and refuses the call.
cudaError_t forbid_in_capture(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    if (!s->cap) return cudaSuccess;
    if (s->cap->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    s->cap->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
}

// cudaMalloc, cudaFree, cudaHostAlloc, cudaFreeHost, cudaDeviceSynchronize: refused (and the
// capture invalidated) while a global-mode capture is under way in the process, or one of this
// thread's that is not relaxed.
cudaError_t unsafe_during_capture() {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    bool hit = false;
    for (capture_state* c : g_captures)
        if (c->mode == cudaStreamCaptureModeGlobal ||
            (c->mode == cudaStreamCaptureModeThreadLocal && c->thread == std::this_thread::get_id())) {
            c->invalidated = true;
            hit = true;
        }
    return hit ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

// Every stream of the capture back to normal; the graph, if any, is the caller's.
void end_capture(std::shared_ptr<capture_state> c) {
    for (auto& m : c->streams) m.first->cap.reset();
    c->streams.clear();
    c->ended = true;
    g_captures.erase(c.get());
}

// Is every stream's last work an ancestor of the origin's next node (joined back into it)?
bool all_joined(const capture_state& c) {
    std::vector<char> seen(c.body->nodes.size());
    std::vector<int> todo = c.streams.at(c.origin).tail;
    while (!todo.empty()) {
        const int n = todo.back();
        todo.pop_back();
        if (seen[n]) continue;
        seen[n] = 1;
        for (int d : c.body->nodes[n].deps) todo.push_back(d);
    }
    for (auto& m : c.streams)
        for (int n : m.second.tail)
            if (!seen[n]) return false;
    return true;
}

// ---- kernels: the threads of a block as fibers ------------------------------------------------
extern "C" void emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void emu_ctx_entry(void);
// emu_ctx_switch saves the callee-saved registers and the FPU/SSE control words on the current
// stack, stores its stack pointer in *save_sp, and resumes the context saved at load_sp.
// emu_ctx_entry is where a new context starts: it calls r13(r12) and never returns.
asm(R"(
    .text
    .globl emu_ctx_switch
    .type emu_ctx_switch, @function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch
    .globl emu_ctx_entry
    .type emu_ctx_entry, @function
emu_ctx_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_ctx_entry, .-emu_ctx_entry
)");

enum thread_state { T_UNSTARTED, T_RUNNING, T_BARRIER, T_SHUFFLE, T_DONE };

struct fiber {
    void* sp = nullptr;
    char* stack = nullptr;   // lowest usable byte
    int tid = -1;            // the emulated thread it runs now
    bool finished = false;
};

struct warp_state {
    unsigned arrived = 0, want = 0;
    uint64_t val[32], res[32];
    int src[32];
};

struct block_run {
    const char* name;
    const char* file;
    int line;
    dim3 grid, block;
    uint3 index;
    mgpu_emu::thread_body body;
    const void* args;
    int threads;
    std::vector<unsigned char> dynamic_shared;   // the launch's bytes, 0xFF again for each block
    std::vector<unsigned char> state;
    std::vector<fiber*> owner;
    std::vector<warp_state> warps;
    std::deque<fiber*> runnable;
    int next_unstarted = 0, done = 0, at_barrier = 0, at_shuffle = 0;
    fiber* current = nullptr;
    void* sched_sp = nullptr;
};

thread_local block_run* tl_block = nullptr;
// free fiber stacks, shared by the workers (a block holds at most one per thread)
std::mutex g_stack_mu;
std::vector<char*> g_stacks;
#ifdef EMU_ASAN
thread_local const void* tl_sched_bottom = nullptr;
thread_local size_t tl_sched_size = 0;
#endif

// the scheduling choices (the order of the warps leaving a barrier), per worker thread: seeded by
// MGPU_EMU_CHAOS in chaos mode, else by a fixed seed
thread_local uint64_t tl_chaos = 0;
uint64_t chaos_next() {
    if (!tl_chaos) {
        static std::atomic<uint64_t> workers{0};
        tl_chaos = (conf().chaos + 0x9E3779B97F4A7C15ull * ++workers) | 1;
    }
    tl_chaos ^= tl_chaos << 13;
    tl_chaos ^= tl_chaos >> 7;
    tl_chaos ^= tl_chaos << 17;
    return tl_chaos;
}

__attribute__((format(printf, 2, 3), noreturn)) void kernel_die(const block_run* b, const char* fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    die("kernel %s (launched at %s:%d), block (%u,%u,%u) of grid (%u,%u,%u), %u x %u x %u threads: %s", b->name,
        b->file, b->line, b->index.x, b->index.y, b->index.z, b->grid.x, b->grid.y, b->grid.z, b->block.x, b->block.y,
        b->block.z, msg);
}

char* get_stack() {
    {
        std::lock_guard<std::mutex> lock(g_stack_mu);
        if (!g_stacks.empty()) {
            char* s = g_stacks.back();
            g_stacks.pop_back();
#ifdef EMU_ASAN
            __asan_unpoison_memory_region(s, conf().stack);   // frames of the thread it ran before
#endif
            return s;
        }
    }
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), size = conf().stack;
    void* m = mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) die("out of memory for a fiber stack of %zu bytes", size);
    if (mprotect(m, page, PROT_NONE) != 0) die("mprotect of a fiber stack's guard page failed");
    return (char*)m + page;
}

void set_coords(const block_run* b, int tid) {
    mgpu_emu::coords.thread.x = (unsigned)tid % b->block.x;
    mgpu_emu::coords.thread.y = (unsigned)tid / b->block.x % b->block.y;
    mgpu_emu::coords.thread.z = (unsigned)tid / (b->block.x * b->block.y);
}

// from a fiber back to the block's scheduler (for good when the fiber finished)
void to_scheduler(fiber* f) {
    block_run* b = tl_block;
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(f->finished ? nullptr : &fake, tl_sched_bottom, tl_sched_size);
    emu_ctx_switch(&f->sp, b->sched_sp);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    emu_ctx_switch(&f->sp, b->sched_sp);
#endif
}

// from the scheduler into a fiber
void resume(block_run* b, fiber* f) {
    b->current = f;
    if (f->tid >= 0) set_coords(b, f->tid);
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack, conf().stack);
    emu_ctx_switch(&b->sched_sp, f->sp);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    emu_ctx_switch(&b->sched_sp, f->sp);
#endif
}

// A fiber runs unstarted threads one after another until none is left; a thread that waits at a
// barrier or shuffle keeps the fiber, and the scheduler starts a new one for the rest.
void fiber_main(void* arg) {
    fiber* f = (fiber*)arg;
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &tl_sched_bottom, &tl_sched_size);
#endif
    block_run* b = tl_block;
    while (b->next_unstarted < b->threads) {
        const int tid = b->next_unstarted++;
        f->tid = tid;
        b->state[tid] = T_RUNNING;
        b->owner[tid] = f;
        set_coords(b, tid);
        b->body(b->args);
        b->state[tid] = T_DONE;
        ++b->done;
    }
    f->finished = true;
    to_scheduler(f);
    __builtin_unreachable();
}

fiber* new_fiber() {
    fiber* f = new fiber();
    f->stack = get_stack();
    uintptr_t top = ((uintptr_t)f->stack + conf().stack) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)(top - 64);
    uint32_t mxcsr;
    uint16_t fpcw;
    __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(fpcw));
    sp[0] = (uint64_t)mxcsr | ((uint64_t)fpcw << 32);
    sp[1] = 0;                                // r15
    sp[2] = 0;                                // r14
    sp[3] = (uint64_t)(uintptr_t)&fiber_main; // r13: the function
    sp[4] = (uint64_t)(uintptr_t)f;           // r12: its argument
    sp[5] = 0;                                // rbx
    sp[6] = 0;                                // rbp
    sp[7] = (uint64_t)(uintptr_t)&emu_ctx_entry;
    f->sp = sp;
    return f;
}

void describe_waits(const block_run* b, char* out, size_t size) {
    int at_barrier = 0, at_shuffle = 0, done = 0, first_done = -1, first_barrier = -1, first_shuffle = -1;
    for (int t = 0; t < b->threads; ++t) {
        if (b->state[t] == T_BARRIER) { ++at_barrier; if (first_barrier < 0) first_barrier = t; }
        if (b->state[t] == T_SHUFFLE) { ++at_shuffle; if (first_shuffle < 0) first_shuffle = t; }
        if (b->state[t] == T_DONE) { ++done; if (first_done < 0) first_done = t; }
    }
    snprintf(out, size,
             "%d threads wait at __syncthreads (first: %d), %d at a warp shuffle (first: %d), %d have exited "
             "(first: %d)",
             at_barrier, first_barrier, at_shuffle, first_shuffle, done, first_done);
}

void run_block(block_run* b) {
    tl_block = b;
    std::fill(b->dynamic_shared.begin(), b->dynamic_shared.end(), (unsigned char)0xFF);
    b->next_unstarted = b->done = b->at_barrier = b->at_shuffle = 0;
    std::fill(b->state.begin(), b->state.end(), (unsigned char)T_UNSTARTED);
    for (warp_state& w : b->warps) w.arrived = 0;
    b->runnable.clear();
    for (;;) {
        fiber* f = nullptr;
        if (!b->runnable.empty()) {
            f = b->runnable.front();
            b->runnable.pop_front();
        } else if (b->next_unstarted < b->threads) {
            f = new_fiber();
        } else if (b->done == b->threads) {
            break;
        } else if (b->at_barrier > 0 && b->at_barrier + b->done == b->threads) {
            if (b->done > 0) {
                char why[256];
                describe_waits(b, why, sizeof why);
                kernel_die(b, "divergent __syncthreads: some threads exited while others wait at a barrier (%s)", why);
            }
            for (int t = 0; t < b->threads; ++t)
                if (b->state[t] == T_BARRIER) {
                    b->state[t] = T_RUNNING;
                    b->runnable.push_back(b->owner[t]);
                }
            {   // the warps leave the barrier in a random order
                const size_t warps = (b->runnable.size() + 31) / 32;
                std::vector<size_t> order(warps);
                for (size_t w = 0; w < warps; ++w) order[w] = w;
                for (size_t i = warps; i > 1; --i) std::swap(order[i - 1], order[chaos_next() % i]);
                std::deque<fiber*> shuffled;
                for (size_t w : order)
                    for (size_t t = w * 32; t < w * 32 + 32 && t < b->runnable.size(); ++t) shuffled.push_back(b->runnable[t]);
                b->runnable.swap(shuffled);
            }
            b->at_barrier = 0;
            continue;
        } else {
            char why[256];
            describe_waits(b, why, sizeof why);
            for (size_t w = 0; w < b->warps.size(); ++w) {   // a shuffle whose missing lanes are gone
                const warp_state& ws = b->warps[w];
                for (int l = 0; ws.arrived && l < 32; ++l)
                    if ((ws.want & ~ws.arrived & (1u << l)) && b->state[w * 32 + l] == T_DONE)
                        kernel_die(b, "a warp shuffle with missing lanes: warp %zu waits with mask 0x%08x, but lane %d "
                                   "(thread %zu) has exited without joining it (%s)", w, ws.want, l, w * 32 + l, why);
            }
            kernel_die(b, "deadlock: no thread can go on (%s)", why);
        }
        resume(b, f);
        if (f->finished) {
            std::lock_guard<std::mutex> lock(g_stack_mu);
            g_stacks.push_back(f->stack);
            delete f;
        }
    }
    tl_block = nullptr;
}

struct kernel_launch {
    const char* name;
    const char* file;
    int line;
    mgpu_emu::launch_cfg c;
    std::shared_ptr<void> args;   // freed with the last task or graph that holds the launch
    mgpu_emu::thread_body body;
};

void run_kernel(const kernel_launch& k) {
    block_run b;
    b.name = k.name;
    b.file = k.file;
    b.line = k.line;
    b.grid = k.c.grid;
    b.block = k.c.block;
    b.body = k.body;
    b.args = k.args.get();
    b.threads = (int)(k.c.block.x * k.c.block.y * k.c.block.z);
    b.dynamic_shared.resize(k.c.shared);
    b.state.resize(b.threads);
    b.owner.resize(b.threads);
    b.warps.resize((b.threads + 31) / 32);
    mgpu_emu::coords.block_dim = k.c.block;
    mgpu_emu::coords.grid_dim = k.c.grid;
    for (unsigned z = 0; z < k.c.grid.z; ++z)
        for (unsigned y = 0; y < k.c.grid.y; ++y)
            for (unsigned x = 0; x < k.c.grid.x; ++x) {
                b.index = uint3{x, y, z};
                mgpu_emu::coords.block = b.index;
                run_block(&b);
            }
}

// ---- cuBLAS state ----------------------------------------------------------------------------
}  // namespace

struct cublasContext {
    int dev;
    cudaStream_t stream = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
    cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
    cublasAtomicsMode_t atomics = CUBLAS_ATOMICS_NOT_ALLOWED;
};

namespace mgpu_emu {
thread_local thread_coords coords;

void syncthreads(void) {
    block_run* b = tl_block;
    if (!b) die("__syncthreads outside a kernel");
    fiber* f = b->current;
    b->state[f->tid] = T_BARRIER;
    ++b->at_barrier;
    to_scheduler(f);
}

uint64_t shfl(unsigned mask, uint64_t bits, int kind, int arg, int width) {
    block_run* b = tl_block;
    if (!b) die("a warp shuffle outside a kernel");
    fiber* f = b->current;
    const int tid = f->tid, lane = tid & 31, warp = tid >> 5;
    static const char* const names[] = {"__shfl_sync", "__shfl_down_sync", "__shfl_xor_sync", "__shfl_up_sync"};
    const char* name = names[kind];
    if (width < 1 || width > 32 || (width & (width - 1)))
        kernel_die(b, "thread %d: %s with width %d (a power of two up to 32)", tid, name, width);
    if (!(mask & (1u << lane))) kernel_die(b, "thread %d: %s with mask 0x%08x, which lacks its own lane %d", tid, name, mask, lane);
    const int lanes = b->threads - warp * 32 < 32 ? b->threads - warp * 32 : 32;
    if (lanes < 32 && (mask >> lanes))
        kernel_die(b, "thread %d: %s with mask 0x%08x, but warp %d has only %d lanes", tid, name, mask, warp, lanes);
    for (int l = 0; l < lanes; ++l)
        if ((mask & (1u << l)) && b->state[warp * 32 + l] == T_DONE)
            kernel_die(b, "thread %d: %s with mask 0x%08x, but lane %d (thread %d) has exited", tid, name, mask, l,
                       warp * 32 + l);
    warp_state& w = b->warps[warp];
    if (w.arrived == 0)
        w.want = mask;
    else if (w.want != mask)
        kernel_die(b, "thread %d: %s with mask 0x%08x while other lanes of warp %d wait with mask 0x%08x", tid, name,
                   mask, warp, w.want);
    const int base = lane & ~(width - 1), idx = lane & (width - 1);
    int src = lane;
    switch (kind) {
    case SHFL_IDX: src = base + (arg & (width - 1)); break;
    case SHFL_DOWN: src = idx + arg < width ? lane + arg : lane; break;
    case SHFL_UP: src = idx - arg >= 0 ? lane - arg : lane; break;
    case SHFL_XOR: src = (idx ^ arg) < width ? base + (idx ^ arg) : lane; break;
    }
    if (!(mask & (1u << src)))
        kernel_die(b, "thread %d: %s reads lane %d, which is not in the mask 0x%08x", tid, name, src, mask);
    w.val[lane] = bits;
    w.src[lane] = src;
    w.arrived |= 1u << lane;
    if (w.arrived == w.want) {   // the last lane: everyone's result, and the others go on
        for (int l = 0; l < 32; ++l)
            if (w.want & (1u << l)) {
                w.res[l] = w.val[w.src[l]];
                if (l != lane) {
                    b->state[warp * 32 + l] = T_RUNNING;
                    --b->at_shuffle;
                    // the woken lanes go first: the warp goes on as one, ahead of the others,
                    // so a block's other warps see what it writes next before they read what it
                    // wrote before (a missing barrier between two uses of shared memory shows)
                    b->runnable.push_front(b->owner[warp * 32 + l]);
                }
            }
        w.arrived = 0;
        return w.res[lane];
    }
    b->state[tid] = T_SHUFFLE;
    ++b->at_shuffle;
    to_scheduler(f);
    return w.res[lane];
}

void* dynamic_shared(void) { return tl_block->dynamic_shared.data(); }

void launch_raw(const char* name, const char* file, int line, const launch_cfg& c, const void* entry, void* args,
                const uintptr_t* words, const unsigned char* reads, size_t word_count, thread_body body, void (*destroy)(void*)) {
    const config& cf = conf();
    const uint64_t threads = (uint64_t)c.block.x * c.block.y * c.block.z;
    std::shared_ptr<void> owned(args, destroy);
    touch_scope touches_of_this_call;
    size_t max_shared = cf.max_shared;
    long call;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        call = ++g_launch_calls;
        auto it = g_func_shared.find(std::make_pair(tl_device, entry));
        if (it != g_func_shared.end()) max_shared = std::max(max_shared, it->second);
    }
    if (!c.grid.x || !c.grid.y || !c.grid.z || !c.block.x || !c.block.y || !c.block.z || threads > (uint64_t)cf.max_threads ||
        c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64 || c.grid.x > 2147483647u || c.grid.y > 65535 ||
        c.grid.z > 65535) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    if (c.shared > max_shared) {   // (CUDA's answer: "invalid argument")
        fail(cudaErrorInvalidValue);
        return;
    }
    if (cf.fail_launch && call >= cf.fail_launch && call < cf.fail_launch + cf.fail_launch_count) {
        fail(cudaErrorLaunchOutOfResources);
        return;
    }
    cudaStream_t s = resolve(c.stream);
    if (!s || s->dev != tl_device) {
        fail(cudaErrorInvalidResourceHandle);
        return;
    }
    // every pointer among the arguments must be memory this device reaches
    {
        std::lock_guard<std::mutex> lock(g_mu);
        for (size_t i = 0; i < word_count; ++i) {
            const uintptr_t v = words[i];
            if (v < 4096) continue;
            auto it = find_alloc((const void*)v);
            if (it == g_allocs.end() || it->second.dev < 0) continue;
            note_touch(v, v + 1, !reads[i]);   // (how far it reads or writes from there is not known: the byte it points at)
            if (!peer_enabled(s->dev, it->second.dev))
                die("kernel %s (launched at %s:%d) on device %d receives %p, memory of device %d, without peer access",
                    name, file, line, s->dev, (void*)v, it->second.dev);
        }
    }
    kernel_launch k{name, file, line, c, std::move(owned), body};
    if (result(submit(s, [k] { run_kernel(k); }, conf().racecheck ? race_name(name, file, line) : name)) == cudaSuccess) ++c_launches;
}
}  // namespace mgpu_emu

// ---- the CUDA runtime API ----------------------------------------------------------------------
extern "C" {

static const char* error_name(cudaError_t e) {
    switch (e) {
#define E(x) case x: return #x;
        E(cudaSuccess) E(cudaErrorInvalidValue) E(cudaErrorMemoryAllocation) E(cudaErrorInitializationError)
        E(cudaErrorInvalidConfiguration) E(cudaErrorInvalidDevicePointer) E(cudaErrorInsufficientDriver)
        E(cudaErrorNoDevice) E(cudaErrorInvalidDevice) E(cudaErrorStubLibrary) E(cudaErrorInvalidResourceHandle)
        E(cudaErrorNotReady) E(cudaErrorPeerAccessUnsupported) E(cudaErrorPeerAccessAlreadyEnabled)
        E(cudaErrorPeerAccessNotEnabled) E(cudaErrorLaunchOutOfResources) E(cudaErrorLaunchFailure)
        E(cudaErrorIllegalState) E(cudaErrorStreamCaptureUnsupported) E(cudaErrorStreamCaptureInvalidated)
        E(cudaErrorStreamCaptureMerge) E(cudaErrorStreamCaptureUnmatched) E(cudaErrorStreamCaptureUnjoined)
        E(cudaErrorStreamCaptureIsolation) E(cudaErrorStreamCaptureImplicit) E(cudaErrorCapturedEvent)
        E(cudaErrorStreamCaptureWrongThread)
#undef E
    }
    return "cudaErrorUnknown";
}

EMU_EXPORT const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }

EMU_EXPORT const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge: return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched: return "capture was not ended in the same stream as it began";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from another thread";
    default: return "unknown error";
    }
}

EMU_EXPORT cudaError_t cudaGetLastError(void) {
    cudaError_t e = tl_last;
    tl_last = cudaSuccess;
    return e;
}

EMU_EXPORT cudaError_t cudaPeekAtLastError(void) { return tl_last; }

EMU_EXPORT cudaError_t cudaGetDeviceCount(int* count) {
    if (!count) return fail(cudaErrorInvalidValue);
    *count = conf().devices;
    if (*count == 0) return fail(cudaErrorNoDevice);
    return cudaSuccess;
}

static bool valid_device(int dev) { return dev >= 0 && dev < conf().devices; }

EMU_EXPORT cudaError_t cudaGetDevice(int* dev) {
    ++c_get_device;
    if (!dev) return fail(cudaErrorInvalidValue);
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    *dev = tl_device;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaSetDevice(int dev) {
    ++c_set_device;
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
    tl_device = dev;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int dev) {
    if (!value || attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return fail(cudaErrorInvalidValue);
    if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
    *value = (int)conf().max_shared_optin;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int dev) {
    if (!prop) return fail(cudaErrorInvalidValue);
    if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "mgpu-emu GPU %d (emulated on the CPU)", dev);
    prop->totalGlobalMem = conf().memory;
    prop->sharedMemPerBlock = conf().max_shared;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = conf().max_threads;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    prop->unifiedAddressing = 1;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    std::lock_guard<std::mutex> lock(g_mu);
    if (free_bytes) *free_bytes = conf().memory - g_dev[tl_device].used;
    if (total_bytes) *total_bytes = conf().memory;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaDeviceCanAccessPeer(int* can, int dev, int peer) {
    if (!can) return fail(cudaErrorInvalidValue);
    if (!valid_device(dev) || !valid_device(peer)) return fail(cudaErrorInvalidDevice);
    *can = dev != peer && !conf().no_peer;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
    if (flags != 0) return fail(cudaErrorInvalidValue);
    if (!valid_device(peer) || peer == tl_device) return fail(cudaErrorInvalidDevice);
    if (conf().no_peer) return fail(cudaErrorPeerAccessUnsupported);
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_dev[tl_device].peer[peer]) return fail(cudaErrorPeerAccessAlreadyEnabled);
    g_dev[tl_device].peer[peer] = true;
    return cudaSuccess;
}

static std::vector<cudaStream_t> streams_of(int dev) {
    std::vector<cudaStream_t> out;
    std::lock_guard<std::mutex> lock(g_mu);
    for (cudaStream_t s : g_streams)
        if (s->dev == dev) out.push_back(s);
    return out;
}

static void sync_device(int dev, const char* why) {
    for (cudaStream_t s : streams_of(dev)) s->sync(why);
}

EMU_EXPORT cudaError_t cudaDeviceSynchronize(void) {
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    if (cudaError_t e = unsafe_during_capture()) return e;
    ++c_syncs;
    sync_device(tl_device, "cudaDeviceSynchronize");
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
    if (!stream || flags > 1) return fail(cudaErrorInvalidValue);
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    *stream = make_stream(tl_device, flags);
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!stream || !g_streams.count(stream)) return fail(cudaErrorInvalidResourceHandle);
        g_streams.erase(stream);
    }
    {   // a capture loses it: invalidated, or ended when it was the origin
        std::lock_guard<std::mutex> lock(g_cap_mu);
        if (capture_state* c = stream->cap.get()) {
            c->invalidated = true;
            if (c->origin == stream) {
                c->body.reset();
                end_capture(stream->cap);
            } else {
                c->streams.erase(stream);
                stream->cap.reset();
            }
        }
    }
    // pending work completes first (CUDA releases the stream once its work is done)
    stream->sync("cudaStreamDestroy");
    {
        std::lock_guard<std::mutex> lock(stream->mu);
        stream->stop = true;
    }
    stream->cv_work.notify_all();
    stream->worker.join();
    delete stream;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (cudaError_t e = forbid_in_capture(s)) return e;
    ++c_syncs;
    s->sync("cudaStreamSynchronize");
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    if (!event || flags > 3) return fail(cudaErrorInvalidValue);
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    cudaEvent_t e = new CUevent_st();
    e->dev = tl_device;
    e->flags = flags;
    std::lock_guard<std::mutex> lock(g_mu);
    g_events.insert(e);
    *event = e;
    return cudaSuccess;
}

static bool live_event(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(g_mu);
    return e && g_events.count(e);
}

// Destroyed events stay allocated: a record or wait still queued may refer to one, and CUDA lets
// cudaEventDestroy return at once. (A vector never destroyed, so LeakSanitizer sees them at exit.)
static std::vector<cudaEvent_t>* g_dead_events = new std::vector<cudaEvent_t>();   // guarded by g_mu

EMU_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!event || !g_events.count(event)) return fail(cudaErrorInvalidResourceHandle);
    g_events.erase(event);
    g_dead_events->push_back(event);
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (!live_event(event)) return fail(cudaErrorInvalidResourceHandle);
    cudaStream_t s = resolve(stream);
    if (!s || s->dev != event->dev) return fail(cudaErrorInvalidResourceHandle);
    ++c_event_records;
    {   // on a capturing stream: no node, only the position that a wait on the event depends on
        std::lock_guard<std::mutex> lock(g_cap_mu);
        if (capture_state* c = s->cap.get()) {
            if (c->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
            event->cap = s->cap;
            event->cap_pos = c->streams[s].tail;
            return cudaSuccess;
        }
        event->cap.reset();
    }
    uint64_t target;
    {
        std::lock_guard<std::mutex> lock(event->mu);
        target = ++event->recorded;
    }
    const int sid = s->id;
    s->push([event, target, sid, before = conf().racecheck ? race_host() : vclock()] {
        if (conf().racecheck) {
            race_task(sid, before, touches(), "cudaEventRecord");
            race_record(event, target, sid);
        }
        {
            std::lock_guard<std::mutex> lock(event->mu);
            if (event->completed < target) {
                event->completed = target;
                event->time_ms = now_ms();
            }
        }
        event->cv.notify_all();
    }, "cudaEventRecord");
    return cudaSuccess;
}

// the capture still under way in which e was recorded last, if any
static std::shared_ptr<capture_state> capture_of(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(g_cap_mu);
    return e->cap && !e->cap->ended ? e->cap : nullptr;
}

EMU_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) {
    if (!live_event(event)) return fail(cudaErrorInvalidResourceHandle);
    if (capture_of(event)) return fail(cudaErrorCapturedEvent);
    uint64_t target;
    bool done;
    {
        std::lock_guard<std::mutex> lock(event->mu);
        done = event->completed >= event->recorded;
        target = event->recorded;
    }
    if (done && conf().racecheck) race_host_saw_event(event, target);
    return done ? cudaSuccess : cudaErrorNotReady;
}

EMU_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if (flags != 0) return fail(cudaErrorInvalidValue);
    if (!live_event(event)) return fail(cudaErrorInvalidResourceHandle);
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    uint64_t target;
    {
        std::lock_guard<std::mutex> lock(event->mu);
        target = event->recorded;   // the latest record at the time of the call
    }
    ++c_event_waits;
    {
        std::lock_guard<std::mutex> lock(g_cap_mu);
        capture_state* c = event->cap && !event->cap->ended ? event->cap.get() : nullptr;
        if (s->cap && s->cap->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
        if (c && s->cap && s->cap.get() != c) {   // two captures would merge
            s->cap->invalidated = c->invalidated = true;
            return fail(cudaErrorStreamCaptureMerge);
        }
        if (c) {   // a captured event: s joins the capture, or depends on the event's position
            if (c->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
            if (!s->cap) {
                s->cap = event->cap;
                c->streams[s] = capture_state::member{(int)c->body->slot_dev.size(), event->cap_pos};
                c->body->slot_dev.push_back(s->dev);
            } else {
                std::vector<int>& tail = c->streams[s].tail;
                for (int n : event->cap_pos)
                    if (std::find(tail.begin(), tail.end(), n) == tail.end()) tail.push_back(n);
            }
            return cudaSuccess;
        }
        if (s->cap && target) {   // a capture cannot wait for work outside it
            s->cap->invalidated = true;
            return fail(cudaErrorStreamCaptureIsolation);
        }
    }
    if (target == 0) return cudaSuccess;   // never recorded: nothing to wait for
    const int sid = s->id;
    s->push([event, target, sid] {
        if (!event->wait_for(target, conf().timeout))
            die("cudaStreamWaitEvent: the event's record never completed (waited %.0f s)", conf().timeout);
        if (conf().racecheck) race_wait(event, target, sid);
    }, "cudaStreamWaitEvent");
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (!live_event(event)) return fail(cudaErrorInvalidResourceHandle);
    if (std::shared_ptr<capture_state> c = capture_of(event)) {   // its record is no work that will run
        std::lock_guard<std::mutex> lock(g_cap_mu);
        c->invalidated = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    uint64_t target;
    {
        std::lock_guard<std::mutex> lock(event->mu);
        target = event->recorded;
    }
    ++c_syncs;
    if (!event->wait_for(target, conf().timeout)) die("cudaEventSynchronize: the event never completed");
    if (conf().racecheck) race_host_saw_event(event, target);
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms) return fail(cudaErrorInvalidValue);
    if (!live_event(start) || !live_event(end)) return fail(cudaErrorInvalidResourceHandle);
    if ((start->flags | end->flags) & cudaEventDisableTiming) return fail(cudaErrorInvalidResourceHandle);
    // one event for both (CUDA gives 0), or two locked together (never in an order that deadlocks)
    std::unique_lock<std::mutex> l1(start->mu, std::defer_lock), l2;
    if (start == end) {
        l1.lock();
    } else {
        l2 = std::unique_lock<std::mutex>(end->mu, std::defer_lock);
        std::lock(l1, l2);
    }
    if (!start->recorded || !end->recorded) return fail(cudaErrorInvalidResourceHandle);
    if (start->completed < start->recorded || end->completed < end->recorded) return fail(cudaErrorNotReady);
    *ms = (float)(end->time_ms - start->time_ms);
    return cudaSuccess;
}

// ---- stream capture and graphs -------------------------------------------------------------------
EMU_EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
    if ((unsigned)mode > cudaStreamCaptureModeRelaxed) return fail(cudaErrorInvalidValue);
    if (!stream) return fail(cudaErrorStreamCaptureUnsupported);   // the legacy stream cannot be captured
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    {   // an injected fault (mgpu_emu_fail_next("capture")): what a call that capture forbids gives
        config& cf = const_cast<config&>(conf());
        std::lock_guard<std::mutex> lock(g_mu);
        if (cf.fail_capture > 0) {
            --cf.fail_capture;
            return fail(cudaErrorStreamCaptureUnsupported);
        }
    }
    std::lock_guard<std::mutex> lock(g_cap_mu);
    if (s->cap) return fail(cudaErrorIllegalState);
    std::shared_ptr<capture_state> c = std::make_shared<capture_state>();
    c->mode = mode;
    c->thread = std::this_thread::get_id();
    c->origin = s;
    c->body = std::make_shared<graph_body>();
    c->body->slot_dev.push_back(s->dev);
    c->streams[s] = capture_state::member{0, {}};
    s->cap = c;
    g_captures.insert(c.get());
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
    if (!status) return fail(cudaErrorInvalidValue);
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    std::lock_guard<std::mutex> lock(g_cap_mu);
    *status = !s->cap ? cudaStreamCaptureStatusNone
              : s->cap->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

}  // extern "C"

struct CUgraph_st {
    std::shared_ptr<const graph_body> body;
};

namespace {
// One launch of an exec: started when the launch stream reaches it, done node by node.
struct graph_run {
    std::mutex mu;
    std::condition_variable cv;
    bool started = false;
    std::vector<char> done;
    vclock start_clock;               // MGPU_EMU_RACECHECK: the launch's, and each node's when it ran
    std::vector<vclock> node_clock;
    size_t left = 0;
    template <class P> void wait(P ready, const char* what) {
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::duration<double>(conf().timeout), ready))
            die("cudaGraphLaunch: %s waited %.0f s for what it depends on: a wait that never ends?", what, conf().timeout);
    }
    void mark(int node) {
        {
            std::lock_guard<std::mutex> lock(mu);
            if (node < 0) {
                started = true;
            } else {
                done[node] = 1;
                --left;
            }
        }
        cv.notify_all();
    }
};
}  // namespace

struct CUgraphExec_st {
    std::shared_ptr<const graph_body> body;
    std::vector<cudaStream_t> workers;   // one per captured stream, on its device
    std::mutex mu;                       // a launch queues all its tasks at once
    std::shared_ptr<graph_run> last;     // the next launch starts after it
};

namespace {
std::set<cudaGraph_t> g_graphs;        // guarded by g_mu
std::set<cudaGraphExec_t> g_execs;     // guarded by g_mu
}  // namespace

extern "C" {

EMU_EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
    if (!graph) return fail(cudaErrorInvalidValue);
    *graph = nullptr;
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<graph_body> body;
    cudaError_t e;
    {
        std::lock_guard<std::mutex> lock(g_cap_mu);
        std::shared_ptr<capture_state> c = s->cap;
        if (!c) return fail(cudaErrorIllegalState);
        if (c->origin != s) return fail(cudaErrorStreamCaptureUnmatched);
        if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
            return fail(cudaErrorStreamCaptureWrongThread);
        e = c->invalidated ? cudaErrorStreamCaptureInvalidated
            : !all_joined(*c) ? cudaErrorStreamCaptureUnjoined : cudaSuccess;
        body = std::move(c->body);
        end_capture(c);
    }
    if (e != cudaSuccess) return fail(e);
    cudaGraph_t g = new CUgraph_st{std::move(body)};
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_graphs.insert(g);
    }
    ++c_captures;
    *graph = g;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
    if (!func || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || (size_t)value > conf().max_shared_optin)
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(g_mu);
    g_func_shared[std::make_pair(tl_device, func)] = (size_t)value;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_graphs.erase(graph)) return fail(cudaErrorInvalidValue);
    }
    delete graph;   // its execs hold the nodes they run
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
    if (!exec || flags > 0xF) return fail(cudaErrorInvalidValue);
    *exec = nullptr;
    cudaGraphExec_t x = new CUgraphExec_st();
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_graphs.count(graph)) {
            delete x;
            return fail(cudaErrorInvalidValue);
        }
        x->body = graph->body;
    }
    // streams of their own, so chaos mode delays the nodes as any other work
    for (int dev : x->body->slot_dev) x->workers.push_back(make_stream(dev, cudaStreamNonBlocking));
    std::lock_guard<std::mutex> lock(g_mu);
    g_execs.insert(x);
    *exec = x;
    return cudaSuccess;
}

// The name CUDA 11.4 to 13 all have (cudaGraphInstantiate's third argument changed in 12).
EMU_EXPORT cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
    return cudaGraphInstantiate(exec, graph, flags);
}

EMU_EXPORT cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_execs.erase(exec)) return fail(cudaErrorInvalidValue);
        for (cudaStream_t w : exec->workers) g_streams.erase(w);
    }
    // a launch in flight goes on: its tasks hold the nodes, and the streams end once drained
    for (cudaStream_t w : exec->workers) w->retire();
    delete exec;
    return cudaSuccess;
}

// Each node is queued on its captured stream's worker, behind a wait for the nodes it depends on;
// the launch stream starts them and waits for them all.
EMU_EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_execs.count(exec)) return fail(cudaErrorInvalidResourceHandle);
    }
    // a graph launched inside a capture (a child graph node) is not emulated
    if (cudaError_t e = forbid_in_capture(s)) return e;
    std::shared_ptr<const graph_body> body = exec->body;
    std::shared_ptr<graph_run> run = std::make_shared<graph_run>();
    run->done.assign(body->nodes.size(), 0);
    run->left = body->nodes.size();
    std::lock_guard<std::mutex> order(exec->mu);
    std::shared_ptr<graph_run> prev = std::move(exec->last);
    exec->last = run;
    run->node_clock.resize(body->nodes.size());
    const int sid = s->id;
    s->push([run, prev, sid, before = conf().racecheck ? race_host() : vclock()] {
        if (prev) prev->wait([&] { return prev->left == 0; }, "a launch of a graph (the one before it)");
        if (conf().racecheck) {   // after the launch before it too (on another stream, its end need not be ordered)
            vclock after = before;
            if (prev)
                for (const vclock& c : prev->node_clock) clock_join(after, c);
            race_task(sid, after, touches(), "cudaGraphLaunch");
            run->start_clock = race_stream(sid);
        }
        run->mark(-1);
    }, "cudaGraphLaunch");
    for (size_t i = 0; i < body->nodes.size(); ++i) {
        const int worker = exec->workers[body->nodes[i].slot]->id;
        exec->workers[body->nodes[i].slot]->push([run, body, i, worker] {
            const graph_node& n = body->nodes[i];
            run->wait([&] {
                if (!run->started) return false;
                for (int d : n.deps)
                    if (!run->done[d]) return false;
                return true;
            }, n.what);
            if (conf().racecheck) {   // after the launch and the nodes it depends on (their clocks are final: done)
                vclock before = run->start_clock;
                for (int d : n.deps) clock_join(before, run->node_clock[(size_t)d]);
                race_task(worker, before, n.touch, n.what);
                run->node_clock[i] = race_stream(worker);
            }
            n.fn();
            run->mark((int)i);
        }, body->nodes[i].what);
    }
    s->push([run, sid] {
        run->wait([&] { return run->left == 0; }, "the end of a graph launch");
        if (conf().racecheck) {
            vclock all;
            for (const vclock& c : run->node_clock) clock_join(all, c);
            race_task(sid, all, touches(), "the end of cudaGraphLaunch");
        }
    }, "cudaGraphLaunch");
    ++c_graph_launches;
    return cudaSuccess;
}

// ---- memory ------------------------------------------------------------------------------------
EMU_EXPORT cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    if (!ptr) return fail(cudaErrorInvalidValue);
    if (conf().devices == 0) return fail(cudaErrorNoDevice);
    *ptr = nullptr;
    if (cudaError_t e = unsafe_during_capture()) return e;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        const long call = ++g_malloc_calls;
        if (conf().fail_malloc && call >= conf().fail_malloc && call < conf().fail_malloc + conf().fail_malloc_count)
            return fail(cudaErrorMemoryAllocation);
        if (bytes > conf().memory - g_dev[tl_device].used) return fail(cudaErrorMemoryAllocation);
    }
    if (bytes == 0) return cudaSuccess;
    void* p = nullptr;
    if (posix_memalign(&p, 256, bytes) != 0 || !p) return fail(cudaErrorMemoryAllocation);
    memset(p, 0xFF, bytes);   // NaN floats, -1 integers: never-written memory shows in results
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (bytes > conf().memory - g_dev[tl_device].used) {   // another thread got there first
            free(p);
            return fail(cudaErrorMemoryAllocation);
        }
        g_dev[tl_device].used += bytes;
        g_allocs[(uintptr_t)p] = allocation{bytes, tl_device};
    }
    ++c_allocs;
    *ptr = p;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaFree(void* ptr) {
    if (!ptr) return cudaSuccess;
    if (cudaError_t e = unsafe_during_capture()) return e;
    int dev;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        auto it = g_allocs.find((uintptr_t)ptr);
        if (it == g_allocs.end() || it->second.dev < 0) return fail(cudaErrorInvalidValue);
        dev = it->second.dev;
    }
    sync_device(dev, "cudaFree");   // cudaFree waits for the device's work, as CUDA's does
    {
        std::lock_guard<std::mutex> lock(g_mu);
        auto it = g_allocs.find((uintptr_t)ptr);
        if (it == g_allocs.end()) return fail(cudaErrorInvalidValue);
        g_dev[dev].used -= it->second.size;
        g_allocs.erase(it);
    }
    if (conf().racecheck) race_freed((uintptr_t)ptr);
    free(ptr);
    ++c_frees;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags) {
    if (!ptr || flags > 0xF) return fail(cudaErrorInvalidValue);
    *ptr = nullptr;
    if (cudaError_t e = unsafe_during_capture()) return e;
    void* p = nullptr;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0 || !p) return fail(cudaErrorMemoryAllocation);
    std::lock_guard<std::mutex> lock(g_mu);
    g_allocs[(uintptr_t)p] = allocation{bytes ? bytes : 1, -1};
    *ptr = p;
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaFreeHost(void* ptr) {
    if (!ptr) return cudaSuccess;
    if (cudaError_t e = unsafe_during_capture()) return e;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        auto it = g_allocs.find((uintptr_t)ptr);
        if (it == g_allocs.end() || it->second.dev >= 0) return fail(cudaErrorInvalidValue);
        g_allocs.erase(it);
    }
    // pending copies from or to it finish first
    for (int d = 0; d < conf().devices; ++d) sync_device(d, "cudaFreeHost");
    free(ptr);
    return cudaSuccess;
}

// A copy queued on s; from pageable memory the source is staged at once, and into pageable memory
// the call returns when the copy is done (as the driver does).
// (A capture refuses both: the caller checked.)
static cudaError_t queue_copy(void* dst, const void* src, size_t bytes, cudaStream_t s, where wd, where ws) {
    if (ws.kind == PAGEABLE && wd.kind != PAGEABLE) {
        std::shared_ptr<std::vector<char>> staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
        return submit(s, [dst, staged] { memcpy(dst, staged->data(), staged->size()); }, "cudaMemcpyAsync from pageable memory");
    }
    if (cudaError_t e = submit(s, [dst, src, bytes] { memmove(dst, src, bytes); }, "cudaMemcpyAsync")) return fail(e);
    if (wd.kind == PAGEABLE) {
        ++c_syncs;
        s->sync("cudaMemcpyAsync to pageable memory");
    }
    return cudaSuccess;
}

static void count_copy(where wd, where ws, size_t bytes) {
    if (wd.kind == DEVICE && ws.kind == DEVICE) {
        (wd.dev == ws.dev ? c_d2d : c_peer) += bytes;
        ++(wd.dev == ws.dev ? c_copies_d2d : c_copies_peer);
    } else if (wd.kind == DEVICE) {
        c_h2d += bytes;
        ++c_copies_h2d;
    } else if (ws.kind == DEVICE) {
        c_d2h += bytes;
        ++c_copies_d2h;
    }
}

EMU_EXPORT cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind kind,
                                       cudaStream_t stream) {
    touch_scope touches_of_this_call;
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (bytes == 0) return cudaSuccess;
    if (!dst || !src) return fail(cudaErrorInvalidValue);
    const where wd = classify("cudaMemcpyAsync destination", dst, bytes);
    const where ws = classify("cudaMemcpyAsync source", src, bytes);
    if (wd.kind == DEVICE) note_touch((uintptr_t)dst, (uintptr_t)dst + bytes, true);
    if (ws.kind == DEVICE) note_touch((uintptr_t)src, (uintptr_t)src + bytes, false);
    const bool want_dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool want_src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind != cudaMemcpyDefault && ((wd.kind == DEVICE) != want_dst_dev || (ws.kind == DEVICE) != want_src_dev))
        return fail(cudaErrorInvalidValue);
    // pageable memory is read or written at the call, which a graph could not repeat
    if (ws.kind == PAGEABLE || wd.kind == PAGEABLE)
        if (cudaError_t e = forbid_in_capture(s)) return e;
    const cudaError_t e = queue_copy(dst, src, bytes, s, wd, ws);
    if (e == cudaSuccess) count_copy(wd, ws, bytes);
    return e;
}

EMU_EXPORT cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t bytes,
                                           cudaStream_t stream) {
    if (!valid_device(dst_dev) || !valid_device(src_dev)) return fail(cudaErrorInvalidDevice);
    touch_scope touches_of_this_call;
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (bytes == 0) return cudaSuccess;
    char what[96];
    snprintf(what, sizeof what, "cudaMemcpyPeerAsync destination on device %d", dst_dev);
    check_device(what, dst, bytes, dst_dev, false);
    snprintf(what, sizeof what, "cudaMemcpyPeerAsync source on device %d", src_dev);
    check_device(what, src, bytes, src_dev, false, false);
    if (cudaError_t e = submit(s, [dst, src, bytes] { memmove(dst, src, bytes); }, "cudaMemcpyPeerAsync")) return fail(e);
    count_copy(where{DEVICE, dst_dev}, where{DEVICE, src_dev}, bytes);
    return cudaSuccess;
}

EMU_EXPORT cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
    touch_scope touches_of_this_call;
    cudaStream_t s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (bytes == 0) return cudaSuccess;
    check_device("cudaMemsetAsync", ptr, bytes, s->dev, true);
    return result(submit(s, [ptr, value, bytes] { memset(ptr, value, bytes); }, "cudaMemsetAsync"));
}

// ---- cuBLAS ------------------------------------------------------------------------------------
static std::set<cublasHandle_t> g_handles;   // guarded by g_mu

static bool live_handle(cublasHandle_t h) {
    std::lock_guard<std::mutex> lock(g_mu);
    return h && g_handles.count(h);
}

EMU_EXPORT cublasStatus_t cublasCreate(cublasHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    if (conf().devices == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
    cublasHandle_t h = new cublasContext();
    h->dev = tl_device;
    std::lock_guard<std::mutex> lock(g_mu);
    g_handles.insert(h);
    *handle = h;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasDestroy(cublasHandle_t handle) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!handle || !g_handles.count(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
        g_handles.erase(handle);
    }
    sync_device(handle->dev, "cublasDestroy");
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (stream) {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_streams.count(stream)) return CUBLAS_STATUS_INVALID_VALUE;
        if (stream->dev != handle->dev)
            die("cublasSetStream: a stream of device %d for a handle of device %d", stream->dev, handle->dev);
    }
    handle->stream = stream;
    handle->workspace = nullptr;   // cuBLAS goes back to its own workspace on a new stream
    handle->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = handle->stream;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t bytes) {
    touch_scope touches_of_this_call;   // (it queues nothing)
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspace && bytes) check_device("cublasSetWorkspace", workspace, bytes, handle->dev, false);
    if (workspace && ((uintptr_t)workspace % 256)) return CUBLAS_STATUS_INVALID_VALUE;
    handle->workspace = workspace;
    handle->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_ATOMICS_NOT_ALLOWED && mode != CUBLAS_ATOMICS_ALLOWED) return CUBLAS_STATUS_INVALID_VALUE;
    handle->atomics = mode;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetPointerMode(cublasHandle_t handle, cublasPointerMode_t mode) {
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
    handle->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_DEFAULT_MATH && mode != CUBLAS_TENSOR_OP_MATH && mode != CUBLAS_PEDANTIC_MATH &&
        mode != CUBLAS_TF32_TENSOR_OP_MATH)
        return CUBLAS_STATUS_INVALID_VALUE;
    handle->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

// TF32: the 10 explicit mantissa bits of the tensor cores, rounded to nearest (ties away).
static inline float tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) != 0x7F800000u) u = (u + 0x1000u) & 0xFFFFE000u;
    memcpy(&x, &u, 4);
    return x;
}

// bfloat16 (CUDA_R_16BF): a float's upper half; to it rounded to nearest even, as the GPU's
// conversion (a NaN stays a NaN)
static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct gemm_args {
    int m, n, k, lda, ldb, ldc;
    bool ta, tb, tf32;
    bool ab_bf16, c_bf16;   // cublasGemmEx's CUDA_R_16BF operands, C
    float alpha, beta;
    const float* alpha_dev;
    const float* beta_dev;
    const void* a;
    const void* b;
    void* c;
    // cublasLtMatmul's epilogue (0: none): the f32 bias (or the bias gradient, written), and aux:
    // the ReLU bit mask, bit i + j aux_ld for D's entry (i, j), or the GELU's f32 input (read by
    // DGELU, written by GELU_AUX_BIAS), entry i + j aux_ld
    unsigned epilogue;
    float* bias;
    void* aux;
    int64_t aux_ld;
};

// GELU's tanh form (cuBLASLt's GELU), 0.5 x (1 + t), and its derivative 0.5 (1 + t) +
// 0.5 x (1 - t^2) u', with u = sqrt(2 / pi) (x + 0.044715 x^3) and t = tanh(u), in double,
// rounded once
static float gelu_tanh(float x, bool derivative) {
    const double c = 0.7978845608028654, xd = x, u = c * (xd + 0.044715 * xd * xd * xd), t = tanh(u);
    if (!derivative) return (float)(0.5 * xd * (1.0 + t));
    return (float)(0.5 * (1.0 + t) + 0.5 * xd * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * xd * xd));
}

// cuBLASLt's epilogues (cublasLt.h), on D's entry (i, j) after alpha AB + beta C: the bias of row
// i added (BIAS, RELU_AUX_BIAS, GELU_AUX_BIAS), then ReLU as fmaxf (NaN gives 0) with its bit in
// the mask (RELU_AUX_BIAS), or GELU with its input into aux (GELU_AUX_BIAS); or the mask's bit
// applied (DRELU); or times GELU's derivative at aux's entry (DGELU)
static float epilogue_element(const gemm_args& g, int i, int j, float v) {
    const int64_t bit = i + (int64_t)j * g.aux_ld;
    uint8_t* mask = (uint8_t*)g.aux;
    if (g.epilogue == CUBLASLT_EPILOGUE_BIAS || g.epilogue == CUBLASLT_EPILOGUE_RELU_AUX_BIAS || g.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
        v += g.bias[i];
    if (g.epilogue == CUBLASLT_EPILOGUE_RELU_AUX_BIAS) {
        v = v > 0.0f ? v : 0.0f;
        if (v > 0.0f) mask[bit / 8] |= (uint8_t)(1u << (bit % 8));
        else mask[bit / 8] &= (uint8_t)~(1u << (bit % 8));
    }
    if (g.epilogue == CUBLASLT_EPILOGUE_DRELU) v = (mask[bit / 8] >> (bit % 8)) & 1u ? v : 0.0f;
    if (g.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        ((float*)g.aux)[bit] = v;
        v = gelu_tanh(v, false);
    }
    if (g.epilogue == CUBLASLT_EPILOGUE_DGELU) v *= gelu_tanh(((const float*)g.aux)[bit], true);
    return v;
}
// The bias gradient of BGRADB, each of op(B)'s n columns summed over k, or of BGRADA, each of
// op(A)'s m rows (packed: `count` runs of k), in double, rounded once
static void epilogue_bias_gradient(const gemm_args& g, const std::vector<float>& packed, int count) {
    for (int j = 0; j < count; ++j) {
        double s = 0;
        for (int l = 0; l < g.k; ++l) s += packed[(size_t)j * g.k + l];
        g.bias[j] = (float)s;
    }
}

// The GPU's product: each C entry one dot product of exact products summed in double (closer
// than any GPU's fp32 sums: tests bound the GPU's error against float64), rounded to float, then
// to bf16 for a bf16 C.
static void run_gemm(const gemm_args& g) {
    const float alpha = g.alpha_dev ? *g.alpha_dev : g.alpha, beta = g.beta_dev ? *g.beta_dev : g.beta;
    auto in = [&g](const void* p, size_t i) {
        const float v = g.ab_bf16 ? from_bf16(((const uint16_t*)p)[i]) : ((const float*)p)[i];
        return g.tf32 && !g.ab_bf16 ? tf32(v) : v;
    };
    // op(A) rows and op(B) columns packed contiguous, so each C entry is one dot product
    std::vector<float> ap((size_t)g.m * g.k), bp((size_t)g.n * g.k);
    for (int i = 0; i < g.m; ++i)
        for (int l = 0; l < g.k; ++l) ap[(size_t)i * g.k + l] = in(g.a, g.ta ? (size_t)i * g.lda + l : i + (size_t)l * g.lda);
    for (int j = 0; j < g.n; ++j)
        for (int l = 0; l < g.k; ++l) bp[(size_t)j * g.k + l] = in(g.b, g.tb ? j + (size_t)l * g.ldb : l + (size_t)j * g.ldb);
    for (int j = 0; j < g.n; ++j) {
        const float* bj = &bp[(size_t)j * g.k];
        for (int i = 0; i < g.m; ++i) {
            const float* ai = &ap[(size_t)i * g.k];
            double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int l = 0;
            for (; l + 3 < g.k; l += 4) {
                s0 += (double)ai[l] * bj[l];
                s1 += (double)ai[l + 1] * bj[l + 1];
                s2 += (double)ai[l + 2] * bj[l + 2];
                s3 += (double)ai[l + 3] * bj[l + 3];
            }
            for (; l < g.k; ++l) s0 += (double)ai[l] * bj[l];
            const size_t at = i + (size_t)j * g.ldc;
            const float prod = (float)((s0 + s1) + (s2 + s3));
            float v;
            if (g.c_bf16) v = beta == 0.0f ? alpha * prod : alpha * prod + beta * from_bf16(((uint16_t*)g.c)[at]);   // beta 0: C is not read
            else v = beta == 0.0f ? alpha * prod : alpha * prod + beta * ((float*)g.c)[at];
            if (g.epilogue) v = epilogue_element(g, i, j, v);
            if (g.c_bf16) ((uint16_t*)g.c)[at] = to_bf16(v);
            else ((float*)g.c)[at] = v;
        }
    }
    if (g.epilogue == CUBLASLT_EPILOGUE_BGRADB) epilogue_bias_gradient(g, bp, g.n);
    if (g.epilogue == CUBLASLT_EPILOGUE_BGRADA) epilogue_bias_gradient(g, ap, g.m);
}

// cublasSgemm and cublasGemmEx: the checks of cuBLAS's arguments, then the product on the stream.
static cublasStatus_t gemm(const char* call, cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                           int m, int n, int k, const float* alpha, const void* a, int lda, const void* b, int ldb,
                           const float* beta, void* c, int ldc, bool ab_bf16, bool c_bf16) {
    touch_scope touches_of_this_call;
    if (!live_handle(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (tl_device != handle->dev)
        die("%s: a handle of device %d used while device %d is current", call, handle->dev, tl_device);
    if (transa > CUBLAS_OP_C || transb > CUBLAS_OP_C || m < 0 || n < 0 || k < 0 || !alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
    const int rows_a = ta ? k : m, rows_b = tb ? n : k;
    if (lda < (rows_a > 1 ? rows_a : 1) || ldb < (rows_b > 1 ? rows_b : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    cudaStream_t s = resolve(handle->stream);
    if (!s) return CUBLAS_STATUS_INVALID_VALUE;
    const int dev = handle->dev;
    const size_t ab_size = ab_bf16 ? 2 : 4, c_size = c_bf16 ? 2 : 4;
    std::string what = std::string(call);
    if (k > 0) {
        const int cols_a = ta ? m : k, cols_b = tb ? k : n;
        check_device((what + " A").c_str(), a, ((size_t)(cols_a - 1) * lda + rows_a) * ab_size, dev, true, false);
        check_device((what + " B").c_str(), b, ((size_t)(cols_b - 1) * ldb + rows_b) * ab_size, dev, true, false);
    }
    check_device((what + " C").c_str(), c, ((size_t)(n - 1) * ldc + m) * c_size, dev, true);
    gemm_args g{m, n, k, lda, ldb, ldc, ta, tb, handle->math == CUBLAS_TF32_TENSOR_OP_MATH, ab_bf16, c_bf16, 0.0f, 0.0f,
                nullptr, nullptr, a, b, c, 0, nullptr, nullptr, 0};
    if (handle->pointer_mode == CUBLAS_POINTER_MODE_HOST) {
        g.alpha = *alpha;
        g.beta = *beta;
    } else {
        check_device((what + " alpha").c_str(), alpha, sizeof(float), dev, true, false);
        check_device((what + " beta").c_str(), beta, sizeof(float), dev, true, false);
        g.alpha_dev = alpha;
        g.beta_dev = beta;
    }
    if (result(submit(s, [g] { run_gemm(g); }, call)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    ++c_launches;
    ++c_gemms;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                      int m, int n, int k, const float* alpha, const float* a, int lda, const float* b,
                                      int ldb, const float* beta, float* c, int ldc) {
    return gemm("cublasSgemm", handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, false, false);
}

// The combinations cuBLAS documents for CUBLAS_COMPUTE_32F that mgpu uses (others: NOT_SUPPORTED,
// as cuBLAS answers an unsupported one); alpha and beta are floats.
EMU_EXPORT cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                       int n, int k, const void* alpha, const void* a, cudaDataType atype, int lda,
                                       const void* b, cudaDataType btype, int ldb, const void* beta, void* c,
                                       cudaDataType ctype, int ldc, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    const bool all32 = atype == CUDA_R_32F && btype == CUDA_R_32F && ctype == CUDA_R_32F;
    const bool bf16 = atype == CUDA_R_16BF && btype == CUDA_R_16BF && (ctype == CUDA_R_32F || ctype == CUDA_R_16BF);
    if (compute != CUBLAS_COMPUTE_32F || algo != CUBLAS_GEMM_DEFAULT || (!all32 && !bf16)) return CUBLAS_STATUS_NOT_SUPPORTED;
    return gemm("cublasGemmEx", handle, transa, transb, m, n, k, (const float*)alpha, a, lda, b, ldb, (const float*)beta, c,
                ldc, bf16, ctype == CUDA_R_16BF);
}

// ---- cuBLASLt: cublasLtMatmul with the epilogues mgpu uses --------------------------------------
// A descriptor is the opaque struct of cublasLt.h, its fields kept in its words. The heuristic
// finds one algorithm for what the emulator computes, or none (CUBLAS_STATUS_NOT_SUPPORTED, as
// cuBLASLt answers a combination it lacks) for an epilogue it does not know, or for every
// query with MGPU_EMU_NO_LT=1 (mgpu's plain path then runs).
struct lt_desc {
    int32_t compute, scale, pointer_mode, transa, transb, bias_type;
    uint32_t epilogue;
    void* bias;
    void* aux;
    int64_t aux_ld;
    uint32_t magic;
};
struct lt_layout {
    int32_t type;
    uint64_t rows, cols;
    int64_t ld;
    uint32_t magic;
};
static_assert(sizeof(lt_desc) <= sizeof(cublasLtMatmulDescOpaque_t), "lt_desc fits the opaque descriptor");
static_assert(sizeof(lt_layout) <= sizeof(cublasLtMatrixLayoutOpaque_t), "lt_layout fits the opaque layout");
static const uint32_t lt_desc_magic = 0x4c54444du, lt_layout_magic = 0x4c544c61u;
struct cublasLtContext { int dev; };
static std::set<cublasLtHandle_t> g_lt_handles;   // guarded by g_mu

EMU_EXPORT cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    std::lock_guard<std::mutex> lock(g_mu);
    *handle = new cublasLtContext{tl_device};
    g_lt_handles.insert(*handle);
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_lt_handles.erase(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}
static lt_desc* lt_desc_of(cublasLtMatmulDesc_t d) {
    lt_desc* x = (lt_desc*)d;
    if (!d || x->magic != lt_desc_magic) die("cuBLASLt: a matmul descriptor that was not created (or was destroyed)");
    return x;
}
static lt_layout* lt_layout_of(cublasLtMatrixLayout_t l) {
    lt_layout* x = (lt_layout*)l;
    if (!l || x->magic != lt_layout_magic) die("cuBLASLt: a matrix layout that was not created (or was destroyed)");
    return x;
}
EMU_EXPORT cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
    if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
    lt_desc* d = (lt_desc*)calloc(1, sizeof(cublasLtMatmulDescOpaque_t));
    d->compute = compute;
    d->scale = scale;
    d->bias_type = -1;   // D's type
    d->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    d->magic = lt_desc_magic;
    *desc = (cublasLtMatmulDesc_t)d;
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    if (desc) lt_desc_of(desc)->magic = 0;
    free(desc);
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                                         const void* buf, size_t bytes) {
    lt_desc* d = lt_desc_of(desc);
    void* field;
    size_t size;
    switch (attr) {   // each attribute's size, as cuBLASLt checks it
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: field = &d->compute; size = 4; break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: field = &d->scale; size = 4; break;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: field = &d->pointer_mode; size = 4; break;
    case CUBLASLT_MATMUL_DESC_TRANSA: field = &d->transa; size = 4; break;
    case CUBLASLT_MATMUL_DESC_TRANSB: field = &d->transb; size = 4; break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: field = &d->epilogue; size = 4; break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: field = &d->bias; size = sizeof(void*); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: field = &d->aux; size = sizeof(void*); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: field = &d->aux_ld; size = 8; break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: field = &d->bias_type; size = 4; break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!buf || bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                                     uint64_t cols, int64_t ld) {
    if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
    lt_layout* l = (lt_layout*)calloc(1, sizeof(cublasLtMatrixLayoutOpaque_t));
    *l = lt_layout{type, rows, cols, ld, lt_layout_magic};
    *layout = (cublasLtMatrixLayout_t)l;
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    if (layout) lt_layout_of(layout)->magic = 0;
    free(layout);
    return CUBLAS_STATUS_SUCCESS;
}
// A preference: data[0] the workspace bound, data[1 + i] the alignment promised of A, B, C, D
EMU_EXPORT cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = (cublasLtMatmulPreference_t)calloc(1, sizeof(cublasLtMatmulPreferenceOpaque_t));
    for (int i = 1; i <= 4; ++i) (*pref)->data[i] = 256;
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    free(pref);
    return CUBLAS_STATUS_SUCCESS;
}
EMU_EXPORT cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                               cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                               size_t bytes) {
    if (!pref || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (bytes != 8) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(pref->data, buf, 8);
        return CUBLAS_STATUS_SUCCESS;
    }
    if (attr < CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES || attr > CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES || bytes != 4)
        return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t v;
    memcpy(&v, buf, 4);
    pref->data[1 + (attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES)] = v;
    return CUBLAS_STATUS_SUCCESS;
}

// What the emulator computes: D = C (one buffer and layout), f32 operands with a 32F or
// 32F_FAST_TF32 compute, or bf16 operands with an f32 or bf16 D; scale f32; one of the epilogues
// mgpu uses, with what it needs (a bias pointer; the mask's pointer and a leading
// dimension divisible by 128 and no less than D's rows; the GELU's f32 aux (DGELU, GELU_AUX_BIAS)
// of D's type, its leading dimension divisible by 8 and no less than D's rows; the pointers only at the matmul: the
// heuristic does not need them).
static cublasStatus_t lt_check(const lt_desc& d, const lt_layout& a, const lt_layout& b, const lt_layout& c, const lt_layout& dd,
                               bool pointers) {
    const bool f32 = a.type == CUDA_R_32F && b.type == CUDA_R_32F && c.type == CUDA_R_32F;
    const bool bf16 = a.type == CUDA_R_16BF && b.type == CUDA_R_16BF && (c.type == CUDA_R_32F || c.type == CUDA_R_16BF);
    const int64_t m = (int64_t)c.rows, n = (int64_t)c.cols;
    const int64_t k = (int64_t)(d.transa != CUBLAS_OP_N ? a.rows : a.cols);
    if (memcmp(&c, &dd, sizeof c) != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!(f32 && (d.compute == CUBLAS_COMPUTE_32F || d.compute == CUBLAS_COMPUTE_32F_FAST_TF32)) && !(bf16 && d.compute == CUBLAS_COMPUTE_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d.scale != CUDA_R_32F || d.pointer_mode != CUBLASLT_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d.transa > CUBLAS_OP_T || d.transb > CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
    if ((int64_t)(d.transa != CUBLAS_OP_N ? a.cols : a.rows) != m || (int64_t)(d.transb != CUBLAS_OP_N ? b.cols : b.rows) != k ||
        (int64_t)(d.transb != CUBLAS_OP_N ? b.rows : b.cols) != n)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (a.ld < (int64_t)std::max<uint64_t>(a.rows, 1) || b.ld < (int64_t)std::max<uint64_t>(b.rows, 1) || c.ld < std::max<int64_t>(m, 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    switch (d.epilogue) {   // the ones mgpu uses (what the emulator computes)
    case CUBLASLT_EPILOGUE_BIAS: case CUBLASLT_EPILOGUE_RELU_AUX_BIAS: case CUBLASLT_EPILOGUE_DRELU: case CUBLASLT_EPILOGUE_BGRADB:
    case CUBLASLT_EPILOGUE_BGRADA:
    case CUBLASLT_EPILOGUE_DGELU: case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    // the bias (or bias gradient) of D's type, as cublasLt.h's BIAS_DATA_TYPE says (its exceptions
    // are integer and fp8 kernels): here f32, the emulator's one
    const bool has_bias = d.epilogue != CUBLASLT_EPILOGUE_DRELU && d.epilogue != CUBLASLT_EPILOGUE_DGELU;
    if (has_bias && (c.type != CUDA_R_32F || (d.bias_type != -1 && d.bias_type != CUDA_R_32F))) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (pointers && has_bias && !d.bias) return CUBLAS_STATUS_INVALID_VALUE;
    const bool has_mask = d.epilogue == CUBLASLT_EPILOGUE_RELU_AUX_BIAS || d.epilogue == CUBLASLT_EPILOGUE_DRELU;
    if (has_mask && ((pointers && !d.aux) || d.aux_ld % 128 != 0 || d.aux_ld < m)) return CUBLAS_STATUS_INVALID_VALUE;
    if (d.epilogue == CUBLASLT_EPILOGUE_DGELU || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {   // (the emulator's aux is f32: D's type, as cuBLASLt's default)
        if (c.type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
        if ((pointers && !d.aux) || d.aux_ld % 8 != 0 || d.aux_ld < m) return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                         cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                         cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                         cublasLtMatmulPreference_t pref, int requested,
                                                         cublasLtMatmulHeuristicResult_t results[], int* returned) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_lt_handles.count(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (!pref || requested <= 0 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
    ++c_lt_heuristics;
    if (setting_flag("MGPU_EMU_NO_LT", false)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const cublasStatus_t st = lt_check(*lt_desc_of(desc), *lt_layout_of(a), *lt_layout_of(b), *lt_layout_of(c), *lt_layout_of(d), false);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    memset(&results[0], 0, sizeof results[0]);
    results[0].algo.data[0] = 0x656d75;   // the emulator's one algorithm, for operands aligned as promised
    for (int i = 1; i <= 4; ++i) results[0].algo.data[i] = pref->data[i];
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                                         cublasLtMatrixLayout_t adesc, const void* b, cublasLtMatrixLayout_t bdesc,
                                         const void* beta, const void* c, cublasLtMatrixLayout_t cdesc, void* d,
                                         cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream) {
    static const char* call = "cublasLtMatmul";
    int dev;
    touch_scope touches_of_this_call;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_lt_handles.count(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
        dev = handle->dev;
    }
    if (tl_device != dev) die("%s: a handle of device %d used while device %d is current", call, dev, tl_device);
    const lt_desc& x = *lt_desc_of(desc);
    const lt_layout &la = *lt_layout_of(adesc), &lb = *lt_layout_of(bdesc), &lc = *lt_layout_of(cdesc);
    if (!alpha || !beta || !algo || algo->data[0] != 0x656d75) return CUBLAS_STATUS_INVALID_VALUE;
    if (cublasStatus_t st = lt_check(x, la, lb, lc, *lt_layout_of(ddesc), true)) return st;
    if (c != d) return CUBLAS_STATUS_NOT_SUPPORTED;
    // an operand less aligned than the heuristic was promised: what a GPU's kernel cannot read
    // (cuBLASLt answers NOT_SUPPORTED, as on Hopper for an 8-byte-aligned f32 operand)
    const void* operands[4] = {a, b, c, d};
    for (int i = 0; i < 4; ++i)
        if (algo->data[1 + i] > 1 && (uintptr_t)operands[i] % algo->data[1 + i] != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
    cudaStream_t s = resolve(stream);
    if (!s) return CUBLAS_STATUS_INVALID_VALUE;
    if (workspace && workspace_bytes) check_device("cublasLtMatmul workspace", workspace, workspace_bytes, dev, false);
    const int m = (int)lc.rows, n = (int)lc.cols, k = (int)(x.transa != CUBLAS_OP_N ? la.rows : la.cols);
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    const bool ab_bf16 = la.type == CUDA_R_16BF, c_bf16 = lc.type == CUDA_R_16BF;
    const size_t ab_size = ab_bf16 ? 2 : 4, c_size = c_bf16 ? 2 : 4;
    if (k > 0) {
        check_device("cublasLtMatmul A", a, ((size_t)(la.cols - 1) * la.ld + la.rows) * ab_size, dev, true, false);
        check_device("cublasLtMatmul B", b, ((size_t)(lb.cols - 1) * lb.ld + lb.rows) * ab_size, dev, true, false);
    }
    check_device("cublasLtMatmul D", d, ((size_t)(n - 1) * lc.ld + m) * c_size, dev, true);
    const int bias_count = x.epilogue == CUBLASLT_EPILOGUE_BGRADB ? n : m;
    if (x.epilogue != CUBLASLT_EPILOGUE_DRELU && x.epilogue != CUBLASLT_EPILOGUE_DGELU)
        check_device("cublasLtMatmul bias", x.bias, (size_t)bias_count * 4, dev, true,
                     x.epilogue == CUBLASLT_EPILOGUE_BGRADA || x.epilogue == CUBLASLT_EPILOGUE_BGRADB);   // (a bias gradient: written)
    if (x.epilogue == CUBLASLT_EPILOGUE_RELU_AUX_BIAS || x.epilogue == CUBLASLT_EPILOGUE_DRELU)
        check_device("cublasLtMatmul aux", x.aux, (size_t)((x.aux_ld * n + 7) / 8), dev, true,
                     x.epilogue == CUBLASLT_EPILOGUE_RELU_AUX_BIAS);
    if (x.epilogue == CUBLASLT_EPILOGUE_DGELU || x.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
        check_device("cublasLtMatmul aux", x.aux, ((size_t)(n - 1) * x.aux_ld + m) * 4, dev, true,
                     x.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
    gemm_args g{m, n, k, (int)la.ld, (int)lb.ld, (int)lc.ld, x.transa != CUBLAS_OP_N, x.transb != CUBLAS_OP_N,
                x.compute == CUBLAS_COMPUTE_32F_FAST_TF32, ab_bf16, c_bf16, *(const float*)alpha, *(const float*)beta,
                nullptr, nullptr, a, b, d, x.epilogue, (float*)x.bias, x.aux, x.aux_ld};
    if (result(submit(s, [g] { run_gemm(g); }, call)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    ++c_launches;
    ++c_gemms;
    return CUBLAS_STATUS_SUCCESS;
}

// ---- for the fake NCCL and the benchmarks ------------------------------------------------------
EMU_EXPORT void mgpu_emu_get_counters(mgpu_emu_counters* out) {
    out->launches = c_launches;
    out->syncs = c_syncs;
    out->allocs = c_allocs;
    out->frees = c_frees;
    out->h2d_bytes = c_h2d;
    out->d2h_bytes = c_d2h;
    out->peer_bytes = c_peer;
    out->d2d_bytes = c_d2d;
    out->collectives = c_collectives;
    out->set_device = c_set_device;
    out->get_device = c_get_device;
    out->gemms = c_gemms;
    out->lt_heuristics = c_lt_heuristics;
    out->copies_h2d = c_copies_h2d;
    out->copies_d2h = c_copies_d2h;
    out->copies_peer = c_copies_peer;
    out->copies_d2d = c_copies_d2d;
    out->event_records = c_event_records;
    out->event_waits = c_event_waits;
    out->graph_launches = c_graph_launches;
    out->captures = c_captures;
}

EMU_EXPORT int mgpu_emu_device_count(void) { return conf().devices; }

EMU_EXPORT void mgpu_emu_fail_next(const char* what, long count) {
    config& c = const_cast<config&>(conf());
    std::lock_guard<std::mutex> lock(g_mu);
    if (!strcmp(what, "malloc")) {
        c.fail_malloc = g_malloc_calls + 1;
        c.fail_malloc_count = count;
    } else if (!strcmp(what, "launch")) {
        c.fail_launch = g_launch_calls + 1;
        c.fail_launch_count = count;
    } else if (!strcmp(what, "capture")) {
        c.fail_capture = count;
    } else {
        die("mgpu_emu_fail_next: unknown fault \"%s\" (malloc, launch or capture)", what);
    }
}

EMU_EXPORT void mgpu_emu_fail_at(const char* what, long nth, long count) {
    config& c = const_cast<config&>(conf());
    std::lock_guard<std::mutex> lock(g_mu);
    if (!strcmp(what, "malloc")) {
        c.fail_malloc = nth > 0 ? g_malloc_calls + nth : 0;
        c.fail_malloc_count = count;
    } else if (!strcmp(what, "launch")) {
        c.fail_launch = nth > 0 ? g_launch_calls + nth : 0;
        c.fail_launch_count = count;
    } else {
        die("mgpu_emu_fail_at: unknown fault \"%s\" (malloc or launch)", what);
    }
}

EMU_EXPORT long mgpu_emu_calls(const char* what) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!strcmp(what, "malloc")) return g_malloc_calls;
    if (!strcmp(what, "launch")) return g_launch_calls;
    die("mgpu_emu_calls: unknown call \"%s\" (malloc or launch)", what);
    return 0;
}

EMU_EXPORT int mgpu_emu_stream_device(void* stream) {
    cudaStream_t s = resolve((cudaStream_t)stream);
    return s ? s->dev : -1;
}

EMU_EXPORT int mgpu_emu_enqueue(void* stream, void (*fn)(void*), void* arg, void (*destroy)(void*), const char* what) {
    touch_scope touches_of_this_call(false);   // (the emulated NCCL checked its buffers just before)
    cudaStream_t s = resolve((cudaStream_t)stream);
    if (!s) die("%s: not a live stream: %p", what, stream);
    std::shared_ptr<void> owned(arg, [destroy](void* a) { if (destroy) destroy(a); });
    return result(submit(s, [fn, owned] { fn(owned.get()); }, what));
}

EMU_EXPORT void mgpu_emu_check_device_range(const char* what, const void* p, size_t bytes, int dev) {
    check_device(what, p, bytes, dev, false);
}

EMU_EXPORT void mgpu_emu_count_collective(void) { ++c_collectives; }

EMU_EXPORT double mgpu_emu_timeout_seconds(void) { return conf().timeout; }
EMU_EXPORT double mgpu_emu_setting_number(const char* name, double min, double max, double def, int whole, const char* unit) {
    return setting_number(name, min, max, def, whole != 0, unit);
}
EMU_EXPORT int mgpu_emu_setting_flag(const char* name, int def) { return setting_flag(name, def != 0) ? 1 : 0; }

}  // extern "C"
