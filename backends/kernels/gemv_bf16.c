/* y = x @ W^T (+ bias) for a few rows x (float32) and bfloat16 weights W.
 *
 * Decoding a handful of sequences is bound by reading the weights, so they
 * stay in bfloat16 (half the bytes of float32) and are widened to float32 in
 * registers; products accumulate in float32. Rows of W are split across the
 * OpenMP pool in contiguous ranges so each thread streams its own part.
 *
 *   x [M, K] float32, w [N, K] bfloat16 bits, bias [N] float32 or NULL,
 *   y [M, N] float32; M <= GEMV_MAX_ROWS.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define GEMV_MAX_ROWS 4

int baton_gemv_bf16_max_rows(void) { return GEMV_MAX_ROWS; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* One input row: four weight rows at a time, so four independent FMA chains
 * hide the FMA latency (one chain alone runs at a fraction of the bandwidth). */
static void gemv_one_row(const float *x, const uint16_t *w, const float *bias, float *y,
                         int64_t N, int64_t K, int num_threads) {
    const int64_t groups = N / 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = g * 4;
        const uint16_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(load_bf16x8(w0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(load_bf16x8(w1 + k), xv, a1);
            a2 = _mm256_fmadd_ps(load_bf16x8(w2 + k), xv, a2);
            a3 = _mm256_fmadd_ps(load_bf16x8(w3 + k), xv, a3);
        }
        float o[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};
        for (; k < K; k++) {
            o[0] += bf16_to_f32(w0[k]) * x[k];
            o[1] += bf16_to_f32(w1[k]) * x[k];
            o[2] += bf16_to_f32(w2[k]) * x[k];
            o[3] += bf16_to_f32(w3[k]) * x[k];
        }
        for (int r = 0; r < 4; r++) y[n + r] = o[r] + (bias ? bias[n + r] : 0.0f);
    }
    for (int64_t n = groups * 4; n < N; n++) {
        float o = 0.0f;
        for (int64_t k = 0; k < K; k++) o += bf16_to_f32(w[n * K + k]) * x[k];
        y[n] = o + (bias ? bias[n] : 0.0f);
    }
}

/* M input rows (2..4), two weight rows at a time: 2 * M independent chains.
 * Called with a literal M so the compiler unrolls the m loops and keeps the
 * accumulators in registers. */
static inline void gemv_rows(const float *x, const uint16_t *w, const float *bias, float *y,
                             const int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t pairs = N / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < pairs; g++) {
        const int64_t n = g * 2;
        const uint16_t *w0 = w + n * K, *w1 = w0 + K;
        __m256 a0[GEMV_MAX_ROWS], a1[GEMV_MAX_ROWS];
        for (int64_t m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v0 = load_bf16x8(w0 + k), v1 = load_bf16x8(w1 + k);
            for (int64_t m = 0; m < M; m++) {
                const __m256 xv = _mm256_loadu_ps(x + m * K + k);
                a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
                a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float o0 = hsum256(a0[m]), o1 = hsum256(a1[m]);
            for (int64_t kk = k; kk < K; kk++) {
                o0 += bf16_to_f32(w0[kk]) * x[m * K + kk];
                o1 += bf16_to_f32(w1[kk]) * x[m * K + kk];
            }
            y[m * N + n] = o0 + (bias ? bias[n] : 0.0f);
            y[m * N + n + 1] = o1 + (bias ? bias[n + 1] : 0.0f);
        }
    }
    for (int64_t n = pairs * 2; n < N; n++) {
        for (int64_t m = 0; m < M; m++) {
            float o = 0.0f;
            for (int64_t k = 0; k < K; k++) o += bf16_to_f32(w[n * K + k]) * x[m * K + k];
            y[m * N + n] = o + (bias ? bias[n] : 0.0f);
        }
    }
}
#endif

int baton_gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > GEMV_MAX_ROWS) return 1;
#if defined(__AVX2__) && defined(__FMA__)
    switch (M) {
    case 1: gemv_one_row(x, w, bias, y, N, K, num_threads); return 0;
    case 2: gemv_rows(x, w, bias, y, 2, N, K, num_threads); return 0;
    case 3: gemv_rows(x, w, bias, y, 3, N, K, num_threads); return 0;
    case 4: gemv_rows(x, w, bias, y, 4, N, K, num_threads); return 0;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        float out[GEMV_MAX_ROWS] = {0};
        int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc[GEMV_MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            const __m256 wv = load_bf16x8(wn + k);
            for (int64_t m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) out[m] = hsum256(acc[m]);
#endif
        for (; k < K; k++) {
            const float wk = bf16_to_f32(wn[k]);
            for (int64_t m = 0; m < M; m++) out[m] += wk * x[m * K + k];
        }
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) y[m * N + n] = out[m] + b;
    }
    return 0;
}
