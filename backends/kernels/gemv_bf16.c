/* y = x @ W^T (+ bias) for a few rows x (float32) and bfloat16 weights W.
 *
 * Decoding a handful of sequences is bound by reading the weights, so they
 * stay in bfloat16 (half the bytes of float32) and are widened to float32 in
 * registers; products accumulate in float32.
 *
 * W is stored in blocks of 16 features by 32 columns (kernels.h), so a
 * thread's share of W is one contiguous stream, and each 32-bit word holds
 * one feature's values at two adjacent columns: a 256-bit load is eight
 * features at one column pair, widened to float32 (even and odd column) by
 * one shift and one mask, multiplied by the row's two values broadcast.
 * Every feature's sum stays in its own lane (no horizontal reduction).
 *
 *   x [M, K] float32, W tiled bfloat16 bits, bias [N] float32 or NULL,
 *   y [M, N] float32; 1 <= M <= BATON_GEMV_MAX_ROWS.
 *
 * With bfloat16 activations (CPUs with native bf16 run the model in bf16)
 * x holds bf16 values and y is rounded to bf16, as oneDNN's bf16 linear
 * rounds its output. Builds for AVX512_BF16 then multiply the bf16 pairs
 * with VDPBF16PS straight from the block (a 512-bit load: sixteen features
 * at one column pair; each product of two bf16 values is exact in float32,
 * so this is the float32 kernel's arithmetic in another summation order);
 * other builds widen x to float32 and run the float32 blocks.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef BATON_AVX2
#define BATON_GEMV_AVX2 1
#endif

/* x [K] -> xp [round_up(K, 32)], zero-padded */
static inline void gemv_pad(const float *x, float *xp, int64_t K) {
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    for (int64_t k = 0; k < K; k++) xp[k] = x[k];
    for (int64_t k = K; k < kp; k++) xp[k] = 0.0f;
}

int baton_gemv_bf16_max_rows(void) { return BATON_GEMV_MAX_ROWS; }

/* 1 when this build has the AVX2/FMA paths, 0 when only the portable ones. */
int baton_kernels_avx2(void) {
#ifdef BATON_AVX2
    return 1;
#else
    return 0;
#endif
}

/* One block row's sixteen output features for M rows (out[m * 16 + f]) plus
 * the bias, stored into y[m * N + n]. */
static inline void store_features(const float *out, const float *bias, float *y, int64_t g,
                                  int64_t M, int64_t N) {
    for (int64_t f = 0; f < 16 && g * 16 + f < N; f++) {
        const int64_t n = g * 16 + f;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) {
            const float v = out[m * 16 + f] + b;
            y[m * N + n] = v;
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

/* R (1 or 2) input rows against one block row (16 features, all of K): per
 * row four FMA chains (two halves of the features, even and odd columns),
 * eight for two rows, next to the four widened weight vectors and the two
 * broadcasts: what fits in sixteen registers. out[m * 16 + f]. */
static inline __attribute__((always_inline)) void block_rows(
        const float *xp, int64_t kp, const uint16_t *row, int64_t kb, const int R, float *out) {
    __m256 acc[2][4];
    for (int m = 0; m < R; m++)
        for (int i = 0; i < 4; i++) acc[m][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kb; j++) {
        const uint16_t *blk = row + j * BATON_GEMV_BLOCK;
        baton_prefetch_block(row, j);
        for (int p = 0; p < 16; p++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + 32 * p));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + 32 * p + 16));
            const __m256 e0 = bf16_even(v0), o0 = bf16_odd(v0);
            const __m256 e1 = bf16_even(v1), o1 = bf16_odd(v1);
            for (int m = 0; m < R; m++) {
                const float *xm = xp + m * kp + 32 * j + 2 * p;
                const __m256 xe = _mm256_broadcast_ss(xm), xo = _mm256_broadcast_ss(xm + 1);
                acc[m][0] = _mm256_fmadd_ps(e0, xe, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(o0, xo, acc[m][1]);
                acc[m][2] = _mm256_fmadd_ps(e1, xe, acc[m][2]);
                acc[m][3] = _mm256_fmadd_ps(o1, xo, acc[m][3]);
            }
        }
    }
    for (int m = 0; m < R; m++) {
        _mm256_storeu_ps(out + m * 16, _mm256_add_ps(acc[m][0], acc[m][1]));
        _mm256_storeu_ps(out + m * 16 + 8, _mm256_add_ps(acc[m][2], acc[m][3]));
    }
}
#endif

#ifdef BATON_GEMV_DP
/* A row's two bf16 values at a column pair in every lane: one broadcast
 * load (VBROADCASTSS of the pair's 32 bits). Moved through a general
 * register instead (GCC's code for a 64-bit load of two pairs), a four-row
 * block's VDPBF16PS waited on port 5's transfers: the 135M model's linears
 * at four rows 18.0-18.4 ms against 14.2-14.5 now (in-process, Xeon model
 * 167, the tiles off). */
static inline __m512bh pair_bcast(const uint16_t *p) {
    float bits;
    memcpy(&bits, p, sizeof(bits));
    return (__m512bh)_mm512_set1_ps(bits);
}

/* M bf16 input rows (zero-padded to kp) against one block row with
 * VDPBF16PS: a 512-bit load holds sixteen features at one column pair, the
 * row's pair is broadcast to every lane. Two chains per row (even and odd
 * pairs, each chain's index fixed in the unrolled pair loop, so the eight
 * chains of four rows stay in registers), beside the block's sixteen loads.
 * out[m * 16 + f]. */
static inline __attribute__((always_inline)) void block_dp(
        const uint16_t *xb, int64_t kp, const uint16_t *row, int64_t kb, const int M,
        float *out) {
    __m512 acc[BATON_GEMV_MAX_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kb; j++) {
        const uint16_t *blk = row + j * BATON_GEMV_BLOCK;
        baton_prefetch_block(row, j);
        for (int p = 0; p < 16; p += 2) {
            const __m512i w0 = _mm512_loadu_si512((const void *)(blk + 32 * p));
            const __m512i w1 = _mm512_loadu_si512((const void *)(blk + 32 * p + 32));
            for (int m = 0; m < M; m++) {
                const uint16_t *xm = xb + m * kp + 32 * j + 2 * p;
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, pair_bcast(xm));
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, pair_bcast(xm + 2));
            }
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * 16, _mm512_add_ps(acc[m][0], acc[m][1]));
}

/* y [M, N] = xb @ W^T (+ bias) for bf16 rows xb [M, round_up(K, 32)]
 * (zero-padded), with VDPBF16PS. Worksharing loop: call from every thread of
 * a parallel region. */
static void gemv_tiles_bf16x(const uint16_t *xb, const uint16_t *w, const float *bias, float *y,
                             int64_t M, int64_t N, int64_t K) {
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    const int64_t kb = kp / BATON_GEMV_TILE_COLS;
    const int64_t groups = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *row = w + g * BATON_GEMV_TILE_ROWS * kp;
        float out[16 * BATON_GEMV_MAX_ROWS];
        switch (M) {  /* constant M: the accumulators stay in registers */
        case 1: block_dp(xb, kp, row, kb, 1, out); break;
        case 2: block_dp(xb, kp, row, kb, 2, out); break;
        case 3: block_dp(xb, kp, row, kb, 3, out); break;
        default: block_dp(xb, kp, row, kb, 4, out); break;
        }
        store_features(out, bias, y, g, M, N);
    }
}
#endif

#ifndef BATON_GEMV_AVX2
/* Portable fallback (compilers without AVX2/FMA for this CPU): the AVX2
 * path's four chains per feature, in the same order. */
static void block_generic(const float *xp, int64_t kp, const uint16_t *row, int64_t kb,
                          int64_t M, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int f = 0; f < 16; f++) {
            float e = 0.0f, o = 0.0f;
            for (int64_t j = 0; j < kb; j++) {
                const uint16_t *blk = row + j * BATON_GEMV_BLOCK;
                const float *xm = xp + m * kp + 32 * j;
                for (int p = 0; p < 16; p++) {
                    e += baton_bf16_to_f32(blk[32 * p + 2 * f]) * xm[2 * p];
                    o += baton_bf16_to_f32(blk[32 * p + 2 * f + 1]) * xm[2 * p + 1];
                }
            }
            out[m * 16 + f] = e + o;
        }
}
#endif

/* y [M, N] = x @ W^T (+ bias) with xp [M, round_up(K, 32)] zero-padded rows.
 * Worksharing loop: call from every thread of a parallel region. */
static void gemv_tiles(const float *xp, const uint16_t *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    const int64_t kb = kp / BATON_GEMV_TILE_COLS;
    const int64_t groups = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *row = w + g * BATON_GEMV_TILE_ROWS * kp;
        float out[16 * BATON_GEMV_MAX_ROWS];
#ifdef BATON_GEMV_AVX2
        /* Two input rows is the widest that stays in registers; a third and
         * fourth row take a second pass over the block row, which is in L1
         * or L2 by then. */
        switch (M) {
        case 1: block_rows(xp, kp, row, kb, 1, out); break;
        case 2: block_rows(xp, kp, row, kb, 2, out); break;
        case 3:
            block_rows(xp, kp, row, kb, 2, out);
            block_rows(xp + 2 * kp, kp, row, kb, 1, out + 32);
            break;
        default:
            block_rows(xp, kp, row, kb, 2, out);
            block_rows(xp + 2 * kp, kp, row, kb, 2, out + 32);
            break;
        }
#else
        block_generic(xp, kp, row, kb, M, out);
#endif
        store_features(out, bias, y, g, M, N);
    }
}

int baton_gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS) return 1;
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    float *xp = (float *)malloc(sizeof(float) * M * kp);
    if (xp == NULL) return 2;
    for (int64_t m = 0; m < M; m++) gemv_pad(x + m * K, xp + m * kp, K);
    #pragma omp parallel num_threads(num_threads)
    gemv_tiles(xp, w, bias, y, M, N, K);
    free(xp);
    return 0;
}

/* The gemv of bf16 rows: x [M, K], bias [N] (or NULL) and y [M, N] bf16. */
int baton_gemv_bf16_act16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS) return 1;
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    /* the input rows (bf16 or float32, zero-padded), one widened row, the
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
    gemv_tiles_bf16x(xb, w, bias ? bf : 0, yf, M, N, K);
#else
    for (int64_t m = 0; m < M; m++) {
        baton_load_bf16(x + m * K, row, K);
        gemv_pad(row, buf + m * kp, K);
    }
    #pragma omp parallel num_threads(num_threads)
    gemv_tiles(buf, w, bias ? bf : 0, yf, M, N, K);
#endif
    baton_store_bf16(yf, y, M * N);
    free(buf);
    return 0;
}
