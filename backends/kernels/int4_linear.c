/* y = x @ W^T (+ bias) for float32 rows x and 4-bit weights in groups along K
 * (Int4Weights, backends/quantization/int4.py: GGUF's Q4_0 / Q4_1 / Q4_K
 * blocks and --quantization int4), on CPUs without native bf16 arithmetic,
 * where torch's int4 kernel needs bf16 activations and emulates them.
 *
 *   w[n, k] = q[n, k] * scale[n, g] + min[n, g],  g = k / group, q in 0..15
 *   y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] q[n, k])
 *           + sum_g min[n, g] * (sum_{k in g} x[m, k])
 *
 * float32 throughout, the scales and minimums exact as given. codes [N, K/2]
 * bytes: column 2j in the low nibble, column 2j + 1 in the high one; x's even
 * and odd columns are split apart once a call (and each group's sum taken),
 * so eight bytes are sixteen codes against two runs of x. Up to four rows
 * share one pass over a weight row, each row's sums in one order whatever the
 * rows beside it: a row's result never depends on its neighbours.
 * Batches of more rows than ops.cpp's kInt4NativeRows (48) go another way:
 * baton_int4_decode writes slices of W in float32 for torch's matmul.
 */
#include <stdlib.h>

#include "kernels.h"

#define INT4_ROWS 4     /* rows of x one decoding of a weight row serves */
#define INT4_CHUNK 16   /* output features a task */

#ifdef BATON_AVX2
static inline __attribute__((always_inline)) void int4_rows(
        const uint8_t *q, const float *scale, const float *min, const float *xe,
        const float *xo, const float *xs, int64_t half, int64_t G, int64_t gb, const int rows,
        float *out) {
    const __m256i nibble = _mm256_set1_epi32(0xF);
    __m256 tot[INT4_ROWS];
    float mt[INT4_ROWS];
    for (int m = 0; m < rows; m++) {
        tot[m] = _mm256_setzero_ps();
        mt[m] = 0.0f;
    }
    for (int64_t g = 0, j = 0; g < G; g++) {
        __m256 acc[INT4_ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
        for (const int64_t end = j + gb; j < end; j += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            for (int m = 0; m < rows; m++) {
                acc[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + m * half + j), acc[m]);
                acc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + m * half + j), acc[m]);
            }
        }
        const __m256 s = _mm256_broadcast_ss(scale + g);
        for (int m = 0; m < rows; m++) {
            tot[m] = _mm256_fmadd_ps(acc[m], s, tot[m]);
            mt[m] = fmaf(min[g], xs[m * G + g], mt[m]);
        }
    }
    for (int m = 0; m < rows; m++)
        out[m] = baton_hsum256(tot[m]) + mt[m];
}
#endif

static void int4_rows_generic(const uint8_t *q, const float *scale, const float *min,
                              const float *xe, const float *xo, const float *xs, int64_t half,
                              int64_t G, int64_t gb, int rows, float *out) {
    for (int m = 0; m < rows; m++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < half; j++) {
            const float s = scale[j / gb], mn = min[j / gb];
            acc += ((float)(q[j] & 0xF) * s + mn) * xe[m * half + j];
            acc += ((float)(q[j] >> 4) * s + mn) * xo[m * half + j];
        }
        out[m] = acc;
    }
}

int baton_int4_linear(const float *x, const uint8_t *codes, const float *scales,
                      const float *mins, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int64_t group, int num_threads) {
    if (group < 32 || group % 32 || K % group) return 1;
    const int64_t half = K / 2, G = K / group, gb = group / 2;
    float *xe = (float *)malloc(sizeof(float) * M * (K + G));
    if (xe == NULL) return 2;
    float *xo = xe + M * half, *xs = xo + M * half;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < half; j++) {
            xe[m * half + j] = x[m * K + 2 * j];
            xo[m * half + j] = x[m * K + 2 * j + 1];
        }
        for (int64_t g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k++) sum += x[m * K + k];
            xs[m * G + g] = sum;
        }
    }
    const int64_t chunks = (N + INT4_CHUNK - 1) / INT4_CHUNK;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = c * INT4_CHUNK + INT4_CHUNK < N ? c * INT4_CHUNK + INT4_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += INT4_ROWS) {
            const int rows = M - m0 < INT4_ROWS ? (int)(M - m0) : INT4_ROWS;
            const float *e = xe + m0 * half, *o = xo + m0 * half, *xsm = xs + m0 * G;
            for (int64_t n = c * INT4_CHUNK; n < n1; n++) {
                const uint8_t *q = codes + n * half;
                const float *sc = scales + n * G, *mn = mins + n * G;
                float out[INT4_ROWS];
#ifdef BATON_AVX2
                switch (rows) {  /* constant row counts: accumulators in registers */
                case 1: int4_rows(q, sc, mn, e, o, xsm, half, G, gb, 1, out); break;
                case 2: int4_rows(q, sc, mn, e, o, xsm, half, G, gb, 2, out); break;
                case 3: int4_rows(q, sc, mn, e, o, xsm, half, G, gb, 3, out); break;
                default: int4_rows(q, sc, mn, e, o, xsm, half, G, gb, 4, out); break;
                }
#else
                int4_rows_generic(q, sc, mn, e, o, xsm, half, G, gb, rows, out);
#endif
                for (int m = 0; m < rows; m++)
                    y[(m0 + m) * N + n] = out[m] + (bias ? bias[n] : 0.0f);
            }
        }
    }
    free(xe);
    return 0;
}

/* W's rows [N, K] in float32 (w = q * scale + min), for a batch of many rows
 * that a float32 matmul serves better than decoding W again every four rows. */
int baton_int4_decode(const uint8_t *codes, const float *scales, const float *mins, float *w,
                      int64_t N, int64_t K, int64_t group, int num_threads) {
    if (group < 32 || group % 32 || K % group) return 1;
    const int64_t half = K / 2, G = K / group, gb = group / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = codes + n * half;
        float *row = w + n * K;
        for (int64_t g = 0, j = 0; g < G; g++) {
            const float s = scales[n * G + g], mn = mins[n * G + g];
#ifdef BATON_AVX2
            const __m256i nibble = _mm256_set1_epi32(0xF);
            const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(mn);
            for (const int64_t end = j + gb; j < end; j += 8) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
                const __m256 lo = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), vs, vm);
                const __m256 hi = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), vs, vm);
                /* even columns in lo, odd in hi: back to column order */
                const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
                _mm256_storeu_ps(row + 2 * j, _mm256_permute2f128_ps(a, b, 0x20));
                _mm256_storeu_ps(row + 2 * j + 8, _mm256_permute2f128_ps(a, b, 0x31));
            }
#else
            for (const int64_t end = j + gb; j < end; j++) {
                row[2 * j] = fmaf((float)(q[j] & 0xF), s, mn);
                row[2 * j + 1] = fmaf((float)(q[j] >> 4), s, mn);
            }
#endif
        }
    }
    return 0;
}
