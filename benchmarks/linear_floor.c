/* The decode step's linears on the AMX tile linear against the floor: a
 * read-only pass over the same tiled weight blocks, split over the threads
 * the same way, per call. Standalone C (no torch), so that the per-call cost
 * of the kernel can be told apart from Python's and from the weights'
 * stream; benchmarks/linear_rows.py times the same linears through the ops.
 *
 * Shapes: SmolLM2-135M (30 layers of qkv 960x576, o 576x576, gate_up
 * 3072x576, down 576x1536, and the 49152x576 output projection: 269 MB of
 * bf16). Two copies of the weights, alternated per repetition, and (unless
 * the third argument is 0) a 4.7 MB read of a 141 MB "KV" buffer before each
 * layer's o projection, as a decode step of 32 x 200 tokens reads between
 * them: so the weights come from memory, as in serving, not from the L3.
 * Columns per row count, interleaved per repetition (min and median of
 * REPS, ms per step, and per shape at the min):
 *   tile linear   baton_linear_amx_bf16 as built from backends/kernels
 *   read-only     the same per-call work (row copy, threads, split of block
 *                 pairs) with the tile loop replaced by 512-bit loads
 *   overhead      the per-call work alone (fork/join, row copy)
 *   gemv 1 row    baton_gemv_bf16_act16 at one row (the c=1 stream)
 *
 * Build and run (AMX machines only; the avx512_bf16 kind's flags):
 *   gcc -O3 -fno-math-errno -fopenmp -mavx2 -mfma -mf16c -mavx512f -mavx512bw \
 *       -mavx512vl -mavx512dq -mavx512bf16 benchmarks/linear_floor.c -o /tmp/linear_floor
 *   /tmp/linear_floor 32,16,8 [REPS=8] [KV=1]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../backends/kernels/kernels.h"
#include "../backends/kernels/amx_bf16.c"
#include "../backends/kernels/gemv_bf16.c"

#ifndef BATON_AMX
#error "build with the avx512_bf16 kind's flags (see the header)"
#endif

#define LAYERS 30
#define CALLS (4 * LAYERS + 1)
typedef struct { int64_t n, k; } shape;
static shape S[CALLS];
static uint16_t *W[2][CALLS];
static uint16_t *KV;
static int64_t kv_n;
static volatile int64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

BATON_AMX_TARGET static int64_t read_blocks(const uint16_t *p, const uint16_t *e) {
    __m512i a = _mm512_setzero_si512(), b = a;
    for (; p < e; p += 128) {
        a = _mm512_xor_si512(a, _mm512_load_si512(p));
        b = _mm512_xor_si512(b, _mm512_load_si512(p + 32));
        a = _mm512_xor_si512(a, _mm512_load_si512(p + 64));
        b = _mm512_xor_si512(b, _mm512_load_si512(p + 96));
    }
    return _mm512_reduce_add_epi32(_mm512_xor_si512(a, b));
}

/* mode 1: read-only pass, 2: overhead only; the per-call work of
 * baton_linear_amx_bf16 (padded row copy, one parallel region, a contiguous
 * run of block pairs per thread) around it */
static void pass(int mode, const uint16_t *x, const uint16_t *w, int64_t M, int64_t N, int64_t K) {
    const int64_t kp = baton_round_up(K, 32), mp = baton_round_up(M, 16);
    const int64_t groups = baton_round_up(N, 16) / 16, pairs = (groups + 1) / 2;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, baton_round_up(sizeof(uint16_t) * mp * kp, 64));
    #pragma omp parallel num_threads(2)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        for (int64_t m = mp * me / nt; m < mp * (me + 1) / nt; m++) {
            const int64_t n = m < M ? K : 0;
            if (n) memcpy(xp + m * kp, x + m * K, sizeof(uint16_t) * K);
            memset(xp + m * kp + n, 0, sizeof(uint16_t) * (kp - n));
        }
        const int64_t g0 = 2 * (pairs * me / nt), g1 = 2 * (pairs * (me + 1) / nt);
        #pragma omp barrier
        if (mode == 1) sink += read_blocks(w + g0 * 16 * kp, w + (g1 < groups ? g1 : groups) * 16 * kp);
    }
    free(xp);
}

static void kv_read(int layer) {
    const int64_t per = kv_n / LAYERS / 128 * 128;
    const uint16_t *b = KV + layer * per;
    #pragma omp parallel num_threads(2)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        sink += read_blocks(b + per * me / nt / 128 * 128, b + per * (me + 1) / nt / 128 * 128);
    }
}

static int cmp(const void *a, const void *b) {
    const double d = *(const double *)a - *(const double *)b;
    return (d > 0) - (d < 0);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s ROWS[,ROWS...] [REPS] [KV]\n", argv[0]);
        return 2;
    }
    const int reps = argc > 2 ? atoi(argv[2]) : 8, kv = argc > 3 ? atoi(argv[3]) : 1;
    if (reps < 1 || reps > 64) return 2;
    if (!baton_amx_bf16_ready()) {
        fprintf(stderr, "no AMX tile data here\n");
        return 1;
    }
    const shape layer[4] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    double bytes = 0;
    for (int i = 0; i < CALLS; i++) {
        S[i] = i == CALLS - 1 ? (shape){49152, 576} : layer[i % 4];
        const int64_t n = baton_round_up(S[i].n, 16) * baton_round_up(S[i].k, 32);
        for (int c = 0; c < 2; c++) {
            W[c][i] = (uint16_t *)aligned_alloc(4096, n * 2);
            for (int64_t k = 0; k < n; k++) W[c][i][k] = (uint16_t)(0x3c00 + (k * 7 + c) % 128);
        }
        bytes += n * 2.0;
    }
    kv_n = 141000000 / 2;
    KV = (uint16_t *)aligned_alloc(4096, kv_n * 2);
    for (int64_t i = 0; i < kv_n; i++) KV[i] = (uint16_t)i;
    uint16_t *x = (uint16_t *)aligned_alloc(64, 64 * 1536 * 2);
    uint16_t *y = (uint16_t *)aligned_alloc(64, 64 * 49152 * 2);
    for (int i = 0; i < 64 * 1536; i++) x[i] = (uint16_t)(0x3f00 + i % 64);
    const char *names[4] = {"tile linear", "read-only", "overhead", "gemv 1 row"};
    printf("%.0f MB of bf16 weights per step (two copies alternated), KV reads %s\n", bytes / 1e6,
           kv ? "on" : "off");
    for (char *tok = strtok(argv[1], ","); tok; tok = strtok(NULL, ",")) {
        const int64_t M = atoi(tok);
        if (M < 1 || M > 64) return 2;
        double t[4][64], best[4][5], low[4] = {1e9, 1e9, 1e9, 1e9};
        for (int r = 0; r < reps; r++)
            for (int v = 0; v < 4; v++) {
                double part[5] = {0}, total = 0;
                for (int i = 0; i < CALLS; i++) {
                    if (kv && i % 4 == 1) kv_read(i / 4);
                    const uint16_t *w = W[r & 1][i];
                    const double a = now();
                    if (v == 0) baton_linear_amx_bf16(x, w, NULL, y, M, S[i].n, S[i].k, 2);
                    else if (v == 3) baton_gemv_bf16_act16(x, w, NULL, y, 1, S[i].n, S[i].k, 2);
                    else pass(v, x, w, M, S[i].n, S[i].k);
                    const double e = now() - a;
                    part[i == CALLS - 1 ? 4 : i % 4] += e;
                    total += e;
                }
                t[v][r] = total;
                if (total < low[v]) {
                    low[v] = total;
                    memcpy(best[v], part, sizeof part);
                }
            }
        for (int v = 0; v < 4; v++) {
            qsort(t[v], reps, sizeof(double), cmp);
            printf("rows %2lld  %-11s min %6.2f  median %6.2f ms  (%4.1f GB/s at the min) | qkv %.2f  o %.2f  "
                   "gate_up %.2f  down %.2f  lm_head %.2f\n", (long long)M, names[v], t[v][0] * 1e3,
                   t[v][reps / 2] * 1e3, bytes / t[v][0] / 1e9, best[v][0] * 1e3, best[v][1] * 1e3,
                   best[v][2] * 1e3, best[v][3] * 1e3, best[v][4] * 1e3);
        }
        fflush(stdout);
    }
    return (int)(sink & 0);
}
