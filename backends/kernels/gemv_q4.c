/* y = x @ W^T for a few rows x (bf16 values) and int4 weights W in groups
 * along the input dimension, rounded as torch's CPU int4 kernel rounds
 * (aten::_weight_int4pack_mm_for_cpu, what Int4Linear runs).
 *
 * That kernel computes, per output n, strictly in input order k:
 *
 *   w   = dequant(q[n, k], scale[n, g], zero[n, g])          (g = k / G)
 *   acc = fma(x[k], w, acc)                                   (float32)
 *   y   = bf16(acc)                      (then + bias, in the caller's dtype)
 *
 * with scale and zero bfloat16 values and, by the instruction set torch's
 * own dispatch picked ("form"):
 *   form 0 (torch at AVX-512):  w = fma(q - 8, scale, zero)
 *   form 1 (torch at AVX2):     w = fma(q, scale, fma(scale, -8, zero))
 * Every kind here computes both forms exactly: one FMA chain per output, in
 * the same order, so the results are bit-identical to torch's whatever the
 * vector width (the portable build calls fmaf).
 *
 * Layout ("panels", built by backends/quantization/int4.py: int4_panels):
 * output rows in panels of 64 (N padded with zero rows), each panel's groups
 * one after another, one group a block of 32 * G + 256 bytes:
 *   codes  [G/2][64] bytes: byte (j, r) holds q(r, 2j) in its low nibble and
 *          q(r, 2j + 1) in its high nibble;
 *   scale  [64] bf16, zero [64] bf16.
 * A thread streams whole panels: one contiguous range per panel. One
 * accumulator chain per output row means a panel's 64 rows are the
 * independent chains that hide the FMA latency (4 vectors at AVX-512).
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define PANEL BATON_Q4_PANEL_ROWS

static inline int64_t block_bytes(int64_t G) { return 32 * G + 4 * PANEL; }

/* One panel's 64 results of M rows (out[m * 64 + r]): y = bf16(acc), then
 * + bias, rounded to bf16 again when round_out. */
static inline void store_panel(const float *out, const float *bias, float *y, int64_t p,
                               int64_t M, int64_t N, int round_out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < PANEL && p * PANEL + r < N; r++) {
            const int64_t n = p * PANEL + r;
            float v = baton_round_bf16(out[m * PANEL + r]);
            if (bias != 0) {
                v += bias[n];
                if (round_out) v = baton_round_bf16(v);
            }
            y[m * N + n] = v;
        }
}

#if defined(__AVX512F__) && defined(BATON_AVX2)
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* A panel of 64 rows as four 16-lane chains per input row. */
static inline __attribute__((always_inline)) void panel_avx512(
        const float *x, int64_t ldx, const uint8_t *pw, int64_t K, int64_t G, int form,
        const int M, float *out) {
    /* q - 8 (form 0) or q (form 1) for the low four bits of each lane */
    const __m512 lut = form
        ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
        : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 acc[BATON_GEMV_MAX_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
    const int64_t bb = block_bytes(G);
    for (int64_t g = 0; g < K / G; g++) {
        const uint8_t *blk = pw + g * bb;
        const uint16_t *sz = (const uint16_t *)(blk + 32 * G);
        __m512 s[4], z[4];
        for (int v = 0; v < 4; v++) {
            s[v] = bf16x16(sz + 16 * v);
            z[v] = bf16x16(sz + PANEL + 16 * v);
            if (form) z[v] = _mm512_fmadd_ps(s[v], _mm512_set1_ps(-8.0f), z[v]);
        }
        const float *xg = x + g * G;
        for (int64_t j = 0; j < G / 2; j++) {
            for (int v = 0; v < 4; v++) {
                const __m512i c = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(blk + j * PANEL + 16 * v)));
                const __m512 lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(c, lut), s[v], z[v]);
                const __m512 hi = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut), s[v], z[v]);
                for (int m = 0; m < M; m++) {
                    acc[m][v] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + 2 * j]), lo,
                                                acc[m][v]);
                    acc[m][v] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + 2 * j + 1]), hi,
                                                acc[m][v]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + m * PANEL + 16 * v, acc[m][v]);
}
#endif

#if defined(BATON_AVX2) && !defined(__AVX512F__)
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Rows r0 .. r0 + 8 * NV - 1 of a panel as NV 8-lane chains per input row
 * (as many as stay in sixteen registers). */
static inline __attribute__((always_inline)) void pass_avx2(
        const float *x, int64_t ldx, const uint8_t *pw, int64_t K, int64_t G, int form,
        const int M, const int r0, const int NV, float *out) {
    const __m256 qoff = _mm256_set1_ps(form ? 0.0f : 8.0f);
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 acc[BATON_GEMV_MAX_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(G);
    for (int64_t g = 0; g < K / G; g++) {
        const uint8_t *blk = pw + g * bb;
        const uint16_t *sz = (const uint16_t *)(blk + 32 * G);
        __m256 s[4], z[4];
        for (int v = 0; v < NV; v++) {
            s[v] = bf16x8(sz + r0 + 8 * v);
            z[v] = bf16x8(sz + PANEL + r0 + 8 * v);
            if (form) z[v] = _mm256_fmadd_ps(s[v], _mm256_set1_ps(-8.0f), z[v]);
        }
        const float *xg = x + g * G;
        for (int64_t j = 0; j < G / 2; j++) {
            for (int v = 0; v < NV; v++) {
                const __m256i c = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(blk + j * PANEL + r0 + 8 * v)));
                /* q as float is exact, and so is q - 8 */
                const __m256 lo = _mm256_fmadd_ps(
                    _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, low)), qoff), s[v], z[v]);
                const __m256 hi = _mm256_fmadd_ps(
                    _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), qoff), s[v], z[v]);
                for (int m = 0; m < M; m++) {
                    acc[m][v] = _mm256_fmadd_ps(_mm256_set1_ps(xg[m * ldx + 2 * j]), lo,
                                                acc[m][v]);
                    acc[m][v] = _mm256_fmadd_ps(_mm256_set1_ps(xg[m * ldx + 2 * j + 1]), hi,
                                                acc[m][v]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + m * PANEL + r0 + 8 * v, acc[m][v]);
}

static inline __attribute__((always_inline)) void panel_avx2(
        const float *x, int64_t ldx, const uint8_t *pw, int64_t K, int64_t G, int form,
        const int M, float *out) {
    const int nv = M == 1 ? 4 : 2;
    for (int r0 = 0; r0 < PANEL; r0 += 8 * nv)
        pass_avx2(x, ldx, pw, K, G, form, M, r0, nv, out);
}
#endif

#if !defined(BATON_AVX2)
/* Portable: the same chains one output at a time, with fmaf. */
static void panel_portable(const float *x, int64_t ldx, const uint8_t *pw, int64_t K,
                           int64_t G, int form, int64_t M, float *out) {
    const float qoff = form ? 0.0f : 8.0f;
    for (int64_t i = 0; i < M * PANEL; i++) out[i] = 0.0f;
    const int64_t bb = block_bytes(G);
    for (int64_t g = 0; g < K / G; g++) {
        const uint8_t *blk = pw + g * bb;
        const uint16_t *sz = (const uint16_t *)(blk + 32 * G);
        const float *xg = x + g * G;
        for (int64_t r = 0; r < PANEL; r++) {
            const float s = baton_bf16_to_f32(sz[r]);
            float z = baton_bf16_to_f32(sz[PANEL + r]);
            if (form) z = fmaf(s, -8.0f, z);
            for (int64_t m = 0; m < M; m++) {
                float acc = out[m * PANEL + r];
                for (int64_t j = 0; j < G / 2; j++) {
                    const uint8_t b = blk[j * PANEL + r];
                    const float lo = fmaf((float)(b & 0x0F) - qoff, s, z);
                    const float hi = fmaf((float)(b >> 4) - qoff, s, z);
                    acc = fmaf(xg[m * ldx + 2 * j], lo, acc);
                    acc = fmaf(xg[m * ldx + 2 * j + 1], hi, acc);
                }
                out[m * PANEL + r] = acc;
            }
        }
    }
}
#endif

static inline void panel(const float *x, int64_t ldx, const uint8_t *pw, int64_t K, int64_t G,
                         int form, int64_t M, float *out) {
#if defined(__AVX512F__) && defined(BATON_AVX2)
    switch (M) {  /* constant M: the accumulators stay in registers */
    case 1: panel_avx512(x, ldx, pw, K, G, form, 1, out); break;
    case 2: panel_avx512(x, ldx, pw, K, G, form, 2, out); break;
    case 3: panel_avx512(x, ldx, pw, K, G, form, 3, out); break;
    default: panel_avx512(x, ldx, pw, K, G, form, 4, out); break;
    }
#elif defined(BATON_AVX2)
    switch (M) {
    case 1: panel_avx2(x, ldx, pw, K, G, form, 1, out); break;
    case 2: panel_avx2(x, ldx, pw, K, G, form, 2, out); break;
    case 3: panel_avx2(x, ldx, pw, K, G, form, 3, out); break;
    default: panel_avx2(x, ldx, pw, K, G, form, 4, out); break;
    }
#else
    panel_portable(x, ldx, pw, K, G, form, M, out);
#endif
}

void baton_gemv_q4_tiles(const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                         float *y, int64_t M, int64_t N, int64_t K, int64_t G, int form,
                         int round_out) {
    const int64_t panels = baton_round_up(N, PANEL) / PANEL;
    const int64_t panel_bytes = K / G * block_bytes(G);
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float out[BATON_GEMV_MAX_ROWS * PANEL];
        panel(x, ldx, w + p * panel_bytes, K, G, form, M, out);
        store_panel(out, bias, y, p, M, N, round_out);
    }
}

/* The gemv of bf16 rows as Int4Linear computes it with bf16 activations:
 * x [M, K], bias [N] (or NULL) and y [M, N] bfloat16; y = bf16(bf16(acc) +
 * bias). 1 <= M <= BATON_GEMV_MAX_ROWS, K a multiple of the (even) group G. */
int baton_gemv_q4(const uint16_t *x, const uint8_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t M, int64_t N, int64_t K, int64_t G, int form, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS || G < 2 || G % 2 || K % G || (form != 0 && form != 1))
        return 1;
    float *buf = (float *)malloc(sizeof(float) * (M * K + N + M * N));
    if (buf == NULL) return 2;
    float *bf = buf + M * K, *yf = bf + N;
    baton_load_bf16(x, buf, M * K);
    if (bias != 0) baton_load_bf16(bias, bf, N);
    #pragma omp parallel num_threads(num_threads)
    baton_gemv_q4_tiles(buf, K, w, bias ? bf : 0, yf, M, N, K, G, form, 1);
    baton_store_bf16(yf, y, M * N);
    free(buf);
    return 0;
}
