/* y = x @ W^T (+ bias) for a few rows x (float32) and bfloat16 weights W.
 *
 * Decoding a handful of sequences is bound by reading the weights, so they
 * stay in bfloat16 (half the bytes of float32) and are widened to float32 in
 * registers; products accumulate in float32.
 *
 * W is stored tiled (kernels.h): eight rows at a time, sixteen columns at a
 * time, so a thread's share of W is one contiguous stream and every 32-byte
 * load feeds eight products per row. Measured on a 2-core AVX2 machine, the
 * tiled stream reaches ~25 GB/s against ~17 GB/s for four separate row
 * streams (a plain read reaches ~28 GB/s there).
 *
 *   x [M, K] float32, W tiled bfloat16 bits, bias [N] float32 or NULL,
 *   y [M, N] float32; 1 <= M <= BATON_GEMV_MAX_ROWS.
 *
 * With bfloat16 activations (CPUs with native bf16 run the model in bf16)
 * x holds bf16 values and y is rounded to bf16, as oneDNN's bf16 linear
 * rounds its output. Builds for AVX512_BF16 then multiply the bf16 pairs
 * with VDPBF16PS straight from the tile (each product of two bf16 values is
 * exact in float32, so this is the float32 kernel's arithmetic in another
 * summation order); other builds widen x to float32 and run the float32 tiles.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef BATON_AVX2
#define BATON_GEMV_AVX2 1
#endif

int baton_gemv_bf16_max_rows(void) { return BATON_GEMV_MAX_ROWS; }

/* 1 when this build has the AVX2/FMA paths, 0 when only the portable ones. */
int baton_kernels_avx2(void) {
#ifdef BATON_AVX2
    return 1;
#else
    return 0;
#endif
}

/* One tile's eight output features for M rows (out[r * M + m]) plus the
 * bias, stored into y[m * N + n], rounded to bf16 when asked. */
static inline void store_tile(const float *out, const float *bias, float *y, int64_t g,
                              int64_t M, int64_t N, int round_bf16) {
    for (int64_t r = 0; r < 8 && g * 8 + r < N; r++) {
        const int64_t n = g * 8 + r;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) {
            const float v = out[r * M + m] + b;
            y[m * N + n] = round_bf16 ? baton_round_bf16(v) : v;
        }
    }
}

#ifdef BATON_GEMV_AVX2
/* Sixteen bf16 values: the even ones and the odd ones as float32. */
static inline __m256 bf16_even(__m256i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __m256 bf16_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* One input row against one tile: 16 independent FMA chains. */
static inline void tile_one_row(const float *xp, const uint16_t *tile, int64_t kb,
                                float *out) {
    __m256 a[8], b[8];
    for (int r = 0; r < 8; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kb; j++) {
        const __m256 xe = _mm256_loadu_ps(xp + 16 * j), xo = _mm256_loadu_ps(xp + 16 * j + 8);
        const uint16_t *blk = tile + j * 128;
        for (int r = 0; r < 8; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 * r));
            a[r] = _mm256_fmadd_ps(bf16_even(v), xe, a[r]);
            b[r] = _mm256_fmadd_ps(bf16_odd(v), xo, b[r]);
        }
    }
    for (int r = 0; r < 8; r++) out[r] = baton_hsum256(_mm256_add_ps(a[r], b[r]));
}

/* Two input rows against one tile: 16 accumulators, the most that stay in
 * registers next to the weights. */
static inline void tile_two_rows(const float *xp, int64_t kp, const uint16_t *tile,
                                 int64_t kb, float *out) {
    __m256 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kb; j++) {
        const uint16_t *blk = tile + j * 128;
        for (int r = 0; r < 8; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 * r));
            const __m256 e = bf16_even(v), o = bf16_odd(v);
            for (int m = 0; m < 2; m++) {
                const float *xm = xp + m * kp + 16 * j;
                acc[r * 2 + m] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xm), acc[r * 2 + m]);
                acc[r * 2 + m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xm + 8), acc[r * 2 + m]);
            }
        }
    }
    for (int i = 0; i < 16; i++) out[i] = baton_hsum256(acc[i]);
}
#endif

#ifdef BATON_GEMV_DP
/* M bf16 input rows (natural order, zero-padded to kp) against one tile with
 * VDPBF16PS: a 512-bit load holds two tile rows of 16 columns, and each
 * 32-bit lane multiplies one column pair of one row by the same pair of x
 * (x's 16 columns broadcast to both halves). Four accumulators per input
 * row cover the tile's eight rows; at most 16 for four rows, with the
 * weights and x in registers beside them. out[r * M + m]. */
static inline __attribute__((always_inline)) void tile_dp(
        const uint16_t *xb, int64_t kp, const uint16_t *tile, int64_t kb, const int M,
        float *out) {
    __m512 acc[BATON_GEMV_MAX_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int p = 0; p < 4; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kb; j++) {
        const uint16_t *blk = tile + j * 128;
        __m512i w[4];
        for (int p = 0; p < 4; p++) w[p] = _mm512_loadu_si512((const void *)(blk + 32 * p));
        for (int m = 0; m < M; m++) {
            const __m512i xv = _mm512_broadcast_i32x8(
                _mm256_loadu_si256((const __m256i *)(xb + m * kp + 16 * j)));
            for (int p = 0; p < 4; p++)
                acc[m][p] = _mm512_dpbf16_ps(acc[m][p], (__m512bh)w[p], (__m512bh)xv);
        }
    }
    for (int m = 0; m < M; m++)
        for (int p = 0; p < 4; p++) {
            out[(2 * p) * M + m] = baton_hsum256(_mm512_castps512_ps256(acc[m][p]));
            out[(2 * p + 1) * M + m] = baton_hsum256(_mm512_extractf32x8_ps(acc[m][p], 1));
        }
}

void baton_gemv_tiles_bf16x(const uint16_t *xb, const uint16_t *w, const float *bias, float *y,
                            int64_t M, int64_t N, int64_t K) {
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    const int64_t kb = kp / BATON_GEMV_TILE_COLS;
    const int64_t tiles = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < tiles; g++) {
        const uint16_t *tile = w + g * 8 * kp;
        float out[8 * BATON_GEMV_MAX_ROWS];
        switch (M) {  /* constant M: the accumulators stay in registers */
        case 1: tile_dp(xb, kp, tile, kb, 1, out); break;
        case 2: tile_dp(xb, kp, tile, kb, 2, out); break;
        case 3: tile_dp(xb, kp, tile, kb, 3, out); break;
        default: tile_dp(xb, kp, tile, kb, 4, out); break;
        }
        store_tile(out, bias, y, g, M, N, 1);
    }
}
#endif

#ifndef BATON_GEMV_AVX2
/* Portable fallback (compilers without AVX2/FMA for this CPU). */
static void tile_generic(const float *xp, int64_t kp, const uint16_t *tile, int64_t kb,
                         int64_t M, float *out) {
    for (int64_t i = 0; i < 8 * M; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < kb; j++)
        for (int64_t r = 0; r < 8; r++) {
            const uint16_t *v = tile + j * 128 + r * 16;
            for (int64_t m = 0; m < M; m++) {
                const float *xm = xp + m * kp + 16 * j;
                float s = 0.0f;
                for (int64_t i = 0; i < 8; i++)
                    s += baton_bf16_to_f32(v[2 * i]) * xm[i] + baton_bf16_to_f32(v[2 * i + 1]) * xm[8 + i];
                out[r * M + m] += s;
            }
        }
}
#endif

void baton_gemv_tiles(const float *xp, const uint16_t *w, const float *bias, float *y,
                      int64_t M, int64_t N, int64_t K, int round_bf16) {
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    const int64_t kb = kp / BATON_GEMV_TILE_COLS;
    const int64_t tiles = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < tiles; g++) {
        const uint16_t *tile = w + g * 8 * kp;
        float out[8 * BATON_GEMV_MAX_ROWS];
#ifdef BATON_GEMV_AVX2
        /* Two input rows against all eight tile rows is the widest that
         * stays in registers; a third and fourth row take a second pass over
         * the tile, which is in L1 by then. out[r * M + m]. */
        float a[16], b[16];
        switch (M) {
        case 1: tile_one_row(xp, tile, kb, out); break;
        case 2: tile_two_rows(xp, kp, tile, kb, out); break;
        default:
            tile_two_rows(xp, kp, tile, kb, a);
            if (M == 3) tile_one_row(xp + 2 * kp, tile, kb, b);
            else tile_two_rows(xp + 2 * kp, kp, tile, kb, b);
            for (int r = 0; r < 8; r++) {
                out[r * M] = a[r * 2];
                out[r * M + 1] = a[r * 2 + 1];
                if (M == 3) {
                    out[r * 3 + 2] = b[r];
                } else {
                    out[r * 4 + 2] = b[r * 2];
                    out[r * 4 + 3] = b[r * 2 + 1];
                }
            }
            break;
        }
#else
        tile_generic(xp, kp, tile, kb, M, out);
#endif
        store_tile(out, bias, y, g, M, N, round_bf16);
    }
}

int baton_gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS) return 1;
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    float *xp = (float *)malloc(sizeof(float) * M * kp);
    if (xp == NULL) return 2;
    for (int64_t m = 0; m < M; m++) baton_gemv_permute(x + m * K, xp + m * kp, K);
    #pragma omp parallel num_threads(num_threads)
    baton_gemv_tiles(xp, w, bias, y, M, N, K, 0);
    free(xp);
    return 0;
}

/* The gemv of bf16 rows: x [M, K], bias [N] (or NULL) and y [M, N] bf16. */
int baton_gemv_bf16_act16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS) return 1;
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    /* the input rows (bf16 or permuted float32), one widened row, the
     * float32 bias and the float32 result */
    float *buf = (float *)malloc(sizeof(float) * (M * kp + kp + N + M * N));
    if (buf == NULL) return 2;
    float *row = buf + M * kp, *bf = row + kp, *yf = bf + N;
    if (bias != 0) baton_load_bf16(bias, bf, N);
#ifdef BATON_GEMV_DP
    uint16_t *xb = (uint16_t *)buf;
    for (int64_t m = 0; m < M; m++) {
        memcpy(xb + m * kp, x + m * K, sizeof(uint16_t) * K);
        memset(xb + m * kp + K, 0, sizeof(uint16_t) * (kp - K));
    }
    #pragma omp parallel num_threads(num_threads)
    baton_gemv_tiles_bf16x(xb, w, bias ? bf : 0, yf, M, N, K);
#else
    for (int64_t m = 0; m < M; m++) {
        baton_load_bf16(x + m * K, row, K);
        baton_gemv_permute(row, buf + m * kp, K);
    }
    #pragma omp parallel num_threads(num_threads)
    baton_gemv_tiles(buf, w, bias ? bf : 0, yf, M, N, K, 0);
#endif
    baton_store_bf16(yf, y, M * N);
    free(buf);
    return 0;
}
