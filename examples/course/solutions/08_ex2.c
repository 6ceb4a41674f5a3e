/* 08_ex2.c - lesson 08, exercise 2: algbw and busbw from measured times.

   nccl-tests define, for an all-reduce of S bytes on R ranks that took t seconds:
     algbw = S / t                   (how fast the buffer was "done")
     busbw = algbw x 2(R-1)/R        (what each link of a ring carried per second: comparable
                                      across R, and with the hardware's link bandwidth)
   The program recomputes both from the times that bench/results/2026-11-27-h200-cuda.md measured
   on one H200 (several replicas of one GPU, "cuda:0,0,0,0": their "links" are that GPU's own
   memory) and checks them against the figures recorded there.
     ./08_ex2 */
// course-run:
// course-expect: every recorded algbw and busbw recomputed
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <math.h>

typedef struct { const char* row; double kib; int R; double us, algbw, busbw; } measured;

int main(void) {
    /* workload, bytes / 1024, replicas, time (us), algbw and busbw (GB/s) as recorded */
    static const measured rows[] = {
        { "allreduce_p2p-oneshot_4KiB",           4, 4,     19.7,  0.208,  0.312 },
        { "allreduce_p2p-oneshot_1048576KiB", 1048576, 2,   1363,  788,    788 },
        { "allreduce_p2p-oneshot_1048576KiB", 1048576, 4,   2191,  490,    735 },
        { "allreduce_p2p-ring-forced_65536KiB", 65536, 4,   364.6, 184,    276.1 },
        { "allreduce_p2p-ring-forced_1048576KiB", 1048576, 4, 5262, 204.1, 306.1 },
        { "allreduce_host_1048576KiB",        1048576, 4, 3.366e5, 3.19,   4.785 },
    };
    int i, ok = 1;
    printf("%-38s %2s %10s %10s %10s\n", "row (H200, one GPU)", "R", "time us", "algbw", "busbw");
    for (i = 0; i < (int)(sizeof rows / sizeof rows[0]); ++i) {
        const measured* m = &rows[i];
        const double algbw = m->kib * 1024.0 / (m->us * 1e-6) / 1e9, busbw = algbw * 2.0 * (m->R - 1) / m->R;
        /* the recorded figures have 4 significant digits, the times too: agree to 0.5% */
        const int same = fabs(algbw / m->algbw - 1.0) < 5e-3 && fabs(busbw / m->busbw - 1.0) < 5e-3;
        printf("%-38s %2d %10.1f %10.3f %10.3f %s\n", m->row, m->R, m->us, algbw, busbw, same ? "= recorded" : "DIFFERS from the record");
        ok &= same;
    }
    printf(ok ? "every recorded algbw and busbw recomputed\n" : "a recorded figure does NOT follow from its time\n");
    return ok ? 0 : 1;
}
