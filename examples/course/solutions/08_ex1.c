/* 08_ex1.c - lesson 08, exercise 1: what ring and one-shot move, and in how many steps.

   Simulates both on R ranks of n floats (R = 2 .. 8) in plain C, counting the floats each rank
   sends and receives and the steps one after the other, checks every rank ends with the sum,
   and checks the counts against the formulas:
     ring      every rank sends and receives 2(R-1)/R x n, in 2(R-1) steps
     one-shot  rank 0 receives x n and sends x n, in 2 steps
   The ring spreads the traffic evenly (its busiest rank moves less than 2n, whatever R); the
   one-shot piles it on rank 0 but takes 2 steps: few steps for small buffers, even links for
   large ones. (The library's one-shot kernel on a GPU reads every peer's buffer directly, the
   same traffic through replica 0.)
     ./08_ex1 */
// course-run:
// course-expect: both give every rank the sum, with the counts of the formulas
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>

#define N 840   /* divisible by 2 .. 8 */

static float value(int r, int i) { return (float)((r + 1) * (i % 97) - 40); }

/* every rank's traffic, in floats */
typedef struct { long sent[8], received[8]; int steps; } traffic;

static void ring(float (*buf)[N], int R, traffic* t) {
    static float out[8][N];
    const int chunk = N / R;
    int phase, s, r, i;
    for (phase = 0; phase < 2; ++phase)
        for (s = 0; s < R - 1; ++s, t->steps++) {
            for (r = 0; r < R; ++r)   /* all ranks send at once: what they send is taken first */
                for (i = 0; i < N; ++i) out[r][i] = buf[r][i];
            for (r = 0; r < R; ++r) {
                const int k = phase == 0 ? ((r - s) % R + R) % R : ((r + 1 - s) % R + R) % R, to = (r + 1) % R;
                for (i = k * chunk; i < (k + 1) * chunk; ++i) buf[to][i] = phase == 0 ? buf[to][i] + out[r][i] : out[r][i];
                t->sent[r] += chunk;
                t->received[to] += chunk;
            }
        }
}

static void oneshot(float (*buf)[N], int R, traffic* t) {
    int r, i;
    for (r = 1; r < R; ++r) {   /* step 1: rank 0 gathers and adds, in rank order */
        for (i = 0; i < N; ++i) buf[0][i] += buf[r][i];
        t->sent[r] += N;
        t->received[0] += N;
    }
    for (r = 1; r < R; ++r) {   /* step 2: rank 0 sends the sum back */
        for (i = 0; i < N; ++i) buf[r][i] = buf[0][i];
        t->sent[0] += N;
        t->received[r] += N;
    }
    t->steps = 2;
}

int main(void) {
    static float buf[8][N];
    int R, algo, r, i, ok = 1;
    printf(" R  algorithm  steps  busiest rank sends  receives   formula\n");
    for (R = 2; R <= 8; ++R)
        for (algo = 0; algo < 2; ++algo) {
            traffic t = { { 0 }, { 0 }, 0 };
            long most_sent = 0, most_received = 0, want;
            for (r = 0; r < R; ++r)
                for (i = 0; i < N; ++i) buf[r][i] = value(r, i);
            if (algo == 0) ring(buf, R, &t);
            else oneshot(buf, R, &t);
            for (r = 0; r < R; ++r)
                for (i = 0; i < N; ++i) {
                    float sum = 0.0f;
                    int q;
                    for (q = 0; q < R; ++q) sum += value(q, i);
                    ok &= buf[r][i] == sum;
                }
            for (r = 0; r < R; ++r) {
                if (t.sent[r] > most_sent) most_sent = t.sent[r];
                if (t.received[r] > most_received) most_received = t.received[r];
            }
            want = algo == 0 ? 2L * (R - 1) * N / R : (long)(R - 1) * N;
            ok &= most_sent == want && most_received == want && t.steps == (algo == 0 ? 2 * (R - 1) : 2);
            printf("%2d  %-9s  %5d  %18ld  %8ld   %s = %ld\n", R, algo == 0 ? "ring" : "one-shot", t.steps, most_sent,
                   most_received, algo == 0 ? "2(R-1)/R x n" : "(R-1) x n", want);
        }
    printf(ok ? "both give every rank the sum, with the counts of the formulas\n" : "a sum or a count is WRONG\n");
    return ok ? 0 : 1;
}
