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
 *
 * baton_int4_linear_q8 computes with 8-bit rows (the bf16-weights mode's
 * numerics, llama.cpp's for 4-bit GGUF types): each block of 32 columns of a
 * row of x is rounded to int8 codes c on its own scale d = max|x| / 127
 * (c = nearest-even(x * (127 / max|x|))), so a block's products are exact
 * integer sums:
 *
 *   y[m, n] = sum_b isum[b] * (scale[n, g(b)] * d[m, b]) + sum_g min[n, g] * xsum[m, g]
 *
 * with isum[b] = sum_{k in b} c[m, k] q[n, k] (u8 x s8 pairs, VPMADDUBSW) and
 * xsum the group's float32 sum of x, at every row count, each row's sums in
 * one order whatever the rows beside it.
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

/* 8-bit rows: c [K] in pair layout (blocks 2i and 2i + 1 in 64 bytes: even
 * columns of 2i, of 2i + 1, odd columns of 2i, of 2i + 1; a last block alone
 * is [even | odd]), matching a 32-byte load of two blocks' codes split into
 * low and high nibbles; d [K / 32] the blocks' scales.
 *
 * Where block b of B holds its even and its odd columns in that layout: */
static inline void q8_columns(int64_t b, int64_t B, int64_t *even, int64_t *odd) {
    const int64_t pair = b & ~(int64_t)1;
    const int single = pair + 1 >= B;
    *even = single ? 32 * b : 32 * pair + 16 * (b - pair);
    *odd = *even + (single ? 16 : 32);
}

/* Scale (or min) i, float32 or float16 (half). */
static inline __attribute__((always_inline)) float q8_scale(const void *s, int64_t i,
                                                            const int half) {
    return half ? baton_f16_to_f32(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* Row x [K] to c and d (above), and xs [K / group] its groups' sums. */
static void q8_quantize_row(const float *x, int64_t K, int64_t group, int8_t *c, float *d,
                            float *xs) {
    const int64_t B = K / 32, per = group / 32;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + 32 * b;
        /* the block's max|x| (a NaN anywhere becomes it, and so the
         * result's) and its sum, added into its group's */
        float a = 0.0f, sum = 0.0f;
#ifdef BATON_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], peak = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[i]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 p = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
        p = _mm_max_ps(p, _mm_movehl_ps(p, p));
        a = _mm_cvtss_f32(_mm_max_ss(p, _mm_shuffle_ps(p, p, 1)));
        if (_mm256_movemask_ps(nan)) a = NAN;
        sum = baton_hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
#else
        for (int k = 0; k < 32; k++) {
            const float m = fabsf(xb[k]);
            a = m > a || m != m ? m : a;
            sum += xb[k];
        }
#endif
        const float id = a > 0.0f ? 127.0f / a : 0.0f;
        int64_t even, odd;
        q8_columns(b, B, &even, &odd);
        for (int j = 0; j < 16; j++) {  /* lrintf: nearest-even, inlined */
            c[even + j] = (int8_t)lrintf(xb[2 * j] * id);
            c[odd + j] = (int8_t)lrintf(xb[2 * j + 1] * id);
        }
        d[b] = a / 127.0f;
        xs[b / per] = b % per ? xs[b / per] + sum : sum;
    }
}

#ifdef BATON_AVX2
/* acc + (8 blocks' integer sums) * (their weight scales s * row scales d):
 * p[i] holds blocks 2i and 2i + 1 in its low and high four lanes; the
 * horizontal adds leave block j in lane (0, 4, 1, 5, 2, 6, 3, 7)[j]. */
static inline __attribute__((always_inline)) __m256 q8_fold8(const __m256i p[4], __m256 s,
                                                             const float *d, __m256 acc) {
    const __m256i isum = _mm256_permutevar8x32_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s, _mm256_loadu_ps(d)), acc);
}

/* Eight scales (or mins) from i on, float32 or float16 (half). */
static inline __attribute__((always_inline)) __m256 q8_scales8(const void *s, int64_t i,
                                                               const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + i)))
                : _mm256_loadu_ps((const float *)s + i);
}

static inline __attribute__((always_inline)) void q8_rows(
        const uint8_t *q, const void *scale, const void *min, const int half, const int8_t *c,
        const float *d, const float *xs, int64_t K, int64_t G, int ratio, __m256i order,
        __m256i mask, const int rows, float *out) {
    const int64_t B = K / 32;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[INT4_ROWS];
    __m128 tail[INT4_ROWS];
    for (int m = 0; m < rows; m++) {
        acc[m] = _mm256_setzero_ps();
        tail[m] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 8 <= B; b += 8) {  /* 8 blocks: 4 loads of two blocks' codes */
        __m256i lo[4], hi[4];
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * (b + 2 * p)));
            lo[p] = _mm256_and_si256(v, nibble);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        /* the 8 blocks' weight scales (a group of 32 * ratio columns has one;
         * float16 scales come in groups of 32) */
        const __m256 s = ratio == 1 ? q8_scales8(scale, b, half)
            : _mm256_permutevar8x32_ps(
                  _mm256_maskload_ps((const float *)scale + b / ratio, mask), order);
        for (int m = 0; m < rows; m++) {
            const int8_t *cm = c + m * K + 32 * b;
            __m256i p32[4];
            for (int p = 0; p < 4; p++) {
                const __m256i e = _mm256_maddubs_epi16(
                    lo[p], _mm256_loadu_si256((const __m256i *)(cm + 64 * p)));
                const __m256i o = _mm256_maddubs_epi16(
                    hi[p], _mm256_loadu_si256((const __m256i *)(cm + 64 * p + 32)));
                p32[p] = _mm256_madd_epi16(_mm256_add_epi16(e, o), ones);
            }
            acc[m] = q8_fold8(p32, s, d + m * B + b, acc[m]);
        }
    }
    for (; b < B; b++) {  /* the last B % 8 blocks one at a time */
        const __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        const __m128i lo = _mm_and_si128(v, _mm256_castsi256_si128(nibble));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm256_castsi256_si128(nibble));
        int64_t even, odd;
        q8_columns(b, B, &even, &odd);
        for (int m = 0; m < rows; m++) {
            const int8_t *cm = c + m * K;
            const __m128i e = _mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)(cm + even)));
            const __m128i o = _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(cm + odd)));
            const __m128i p = _mm_madd_epi16(_mm_add_epi16(e, o), _mm256_castsi256_si128(ones));
            tail[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(p),
                                   _mm_set1_ps(q8_scale(scale, b / ratio, half) * d[m * B + b]),
                                   tail[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        __m256 mv = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= G; g += 8)
            mv = _mm256_fmadd_ps(q8_scales8(min, g, half), _mm256_loadu_ps(xs + m * G + g), mv);
        float mt = 0.0f;
        for (; g < G; g++) mt = fmaf(q8_scale(min, g, half), xs[m * G + g], mt);
        out[m] = baton_hsum256(_mm256_add_ps(acc[m], _mm256_zextps128_ps256(tail[m])))
               + (baton_hsum256(mv) + mt);
    }
}

/* Q8_0 weights (int8 codes w in the rows' pair layout, one scale a block of
 * 32): the same sums with signed codes, |w| against sign(c, w) (VPSIGNB) so
 * that VPMADDUBSW's unsigned operand is |w| <= 128. */
static inline __attribute__((always_inline)) void q8w_rows(
        const int8_t *w, const void *scale, const int half, const int8_t *c, const float *d,
        int64_t K, const int rows, float *out) {
    const int64_t B = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[INT4_ROWS];
    __m128 tail[INT4_ROWS];
    for (int m = 0; m < rows; m++) {
        acc[m] = _mm256_setzero_ps();
        tail[m] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 8 <= B; b += 8) {
        const __m256 s = q8_scales8(scale, b, half);
        for (int m = 0; m < rows; m++) {
            const int8_t *cm = c + m * K + 32 * b, *wb = w + 32 * b;
            __m256i p32[4];
            for (int p = 0; p < 8; p += 2) {
                __m256i h[2];
                for (int i = 0; i < 2; i++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * (p + i)));
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(cm + 32 * (p + i)));
                    h[i] = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v)), ones);
                }
                p32[p / 2] = _mm256_add_epi32(h[0], h[1]);
            }
            acc[m] = q8_fold8(p32, s, d + m * B + b, acc[m]);
        }
    }
    for (; b < B; b++) {
        int64_t even, odd;
        q8_columns(b, B, &even, &odd);
        const __m128i ve = _mm_loadu_si128((const __m128i *)(w + even));
        const __m128i vo = _mm_loadu_si128((const __m128i *)(w + odd));
        for (int m = 0; m < rows; m++) {
            const int8_t *cm = c + m * K;
            const __m128i e = _mm_maddubs_epi16(
                _mm_abs_epi8(ve), _mm_sign_epi8(_mm_loadu_si128((const __m128i *)(cm + even)), ve));
            const __m128i o = _mm_maddubs_epi16(
                _mm_abs_epi8(vo), _mm_sign_epi8(_mm_loadu_si128((const __m128i *)(cm + odd)), vo));
            const __m128i p = _mm_add_epi32(_mm_madd_epi16(e, _mm256_castsi256_si128(ones)),
                                            _mm_madd_epi16(o, _mm256_castsi256_si128(ones)));
            tail[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(p),
                                   _mm_set1_ps(q8_scale(scale, b, half) * d[m * B + b]), tail[m]);
        }
    }
    for (int m = 0; m < rows; m++)
        out[m] = baton_hsum256(_mm256_add_ps(acc[m], _mm256_zextps128_ps256(tail[m])));
}
#endif

#ifndef BATON_AVX2
/* The same sums in plain C: each block's integer sum exact, the float terms
 * in block order (bits differ from the AVX2 order within float32 rounding). */
static void q8_rows_generic(const uint8_t *q, const void *scale, const void *min, int half,
                            const int8_t *c, const float *d, const float *xs, int64_t K,
                            int64_t G, int ratio, int bits, int rows, float *out) {
    const int64_t B = K / 32;
    for (int m = 0; m < rows; m++) {
        const int8_t *cm = c + m * K;
        float acc = 0.0f;
        for (int64_t b = 0; b < B; b++) {
            int64_t even, odd;
            q8_columns(b, B, &even, &odd);
            int32_t isum = 0;
            for (int j = 0; j < 16; j++) {
                if (bits == 4) {
                    isum += (q[16 * b + j] & 0xF) * cm[even + j] + (q[16 * b + j] >> 4) * cm[odd + j];
                } else {
                    const int8_t *w = (const int8_t *)q;
                    isum += w[even + j] * cm[even + j] + w[odd + j] * cm[odd + j];
                }
            }
            acc = fmaf((float)isum, q8_scale(scale, b / ratio, half) * d[m * B + b], acc);
        }
        float mt = 0.0f;
        for (int64_t g = 0; min != NULL && g < G; g++)
            mt = fmaf(q8_scale(min, g, half), xs[m * G + g], mt);
        out[m] = acc + mt;
    }
}
#endif

/* The 8-bit rows of x against 4-bit (bits 4: codes [N, K/2], mins) or
 * 8-bit weights (bits 8: int8 codes [N, K] in the rows' pair layout, no
 * mins, group 32). Scales and mins [N, K/group] float32, or float16 bits
 * (half, group 32 only): a GGUF file's own, a sixth less to read a step at
 * 4 bits, widened exactly where they are loaded: the same sums. */
static int q8_linear(const float *x, const uint8_t *codes, const void *scales,
                     const void *mins, int half, const float *bias, float *y, int64_t M,
                     int64_t N, int64_t K, int64_t group, int bits, int num_threads) {
    if (group < 32 || group > 256 || group % 32 || K % group || (half && group != 32)) return 1;
    const int64_t stride = bits == 4 ? K / 2 : K, G = K / group, B = K / 32;
    const int ratio = (int)(group / 32);
    int8_t *c = (int8_t *)malloc(M * K + sizeof(float) * M * (B + G));
    if (c == NULL) return 2;
    float *d = (float *)(c + M * K), *xs = d + M * B;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        q8_quantize_row(x + m * K, K, group, c + m * K, d + m * B, xs + m * G);
#ifdef BATON_AVX2
    int32_t order[8], mask[8];  /* lane i of a run of 8 blocks: scale i / ratio */
    for (int i = 0; i < 8; i++) {
        order[i] = i / ratio;
        mask[i] = i < 8 / ratio ? -1 : 0;
    }
    const __m256i vorder = _mm256_loadu_si256((const __m256i *)order);
    const __m256i vmask = _mm256_loadu_si256((const __m256i *)mask);
#endif
    const int64_t chunks = (N + INT4_CHUNK - 1) / INT4_CHUNK;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < chunks; t++) {
        const int64_t n1 = t * INT4_CHUNK + INT4_CHUNK < N ? t * INT4_CHUNK + INT4_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += INT4_ROWS) {
            const int rows = M - m0 < INT4_ROWS ? (int)(M - m0) : INT4_ROWS;
            const int8_t *cm = c + m0 * K;
            const float *dm = d + m0 * B, *xsm = xs + m0 * G;
            for (int64_t n = t * INT4_CHUNK; n < n1; n++) {
                const uint8_t *q = codes + n * stride;
                const int64_t at = n * G * (half ? 2 : 4);  /* bytes */
                const void *sc = (const char *)scales + at;
                const void *mn = mins ? (const char *)mins + at : NULL;
                float out[INT4_ROWS];
#ifdef BATON_AVX2
#define Q8_ROWS(r, h)                                                                \
    if (bits == 4) q8_rows(q, sc, mn, h, cm, dm, xsm, K, G, ratio, vorder, vmask, r, out); \
    else q8w_rows((const int8_t *)q, sc, h, cm, dm, K, r, out)
#define Q8_CASE(r) if (half) { Q8_ROWS(r, 1); } else { Q8_ROWS(r, 0); }
                switch (rows) {  /* constant row counts: accumulators in registers */
                case 1: Q8_CASE(1); break;
                case 2: Q8_CASE(2); break;
                case 3: Q8_CASE(3); break;
                default: Q8_CASE(4); break;
                }
#undef Q8_CASE
#undef Q8_ROWS
#else
                q8_rows_generic(q, sc, mn, half, cm, dm, xsm, K, G, ratio, bits, rows, out);
#endif
                for (int m = 0; m < rows; m++)
                    y[(m0 + m) * N + n] = out[m] + (bias ? bias[n] : 0.0f);
            }
        }
    }
    free(c);
    return 0;
}

int baton_int4_linear_q8(const float *x, const uint8_t *codes, const void *scales,
                         const void *mins, int half, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t group, int num_threads) {
    return q8_linear(x, codes, scales, mins, half, bias, y, M, N, K, group, 4, num_threads);
}

int baton_int8_linear_q8(const float *x, const int8_t *codes, const void *scales, int half,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                         int num_threads) {
    return q8_linear(x, (const uint8_t *)codes, scales, NULL, half, bias, y, M, N, K, 32, 8,
                     num_threads);
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
