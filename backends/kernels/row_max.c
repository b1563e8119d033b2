/* The greedy pick: each row's largest value and the first index that holds
 * it, exactly as torch.max(x, dim=-1) / torch.argmax give them: a NaN counts
 * as larger than everything (the first NaN wins), -0.0 and 0.0 tie (the
 * first of them wins), an all -inf row gives index 0.
 *
 * torch's argmax over [32, 49152] logits keeps an index per lane and costs
 * ~1.6 ms (float32) to ~3.5 ms (bfloat16) on two cores, while its plain max
 * reduction takes ~0.13 ms. Here the vector kinds run a max reduction over
 * the row (with a NaN test alongside), then look for the first element equal
 * to that maximum: the second pass stops there and reads what the first one
 * just left in cache. The portable kind scans once with scalar compares.
 *
 * Rows are float32 or bfloat16 (widened exactly: the order of bf16 values is
 * the order of their float32 widening). values[r] is x[r, indices[r]]
 * widened to float32.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* Rows below this many elements in all run on one thread. */
#define PAR_MIN_ELEMS 65536

static inline float elem(const void *x, int bf16, int64_t i) {
    return bf16 ? baton_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* One pass, scalar: a strict > keeps the first of equal values. */
__attribute__((unused)) static int64_t scan_scalar(const void *x, int bf16, int64_t n) {
    float best = elem(x, bf16, 0);
    int64_t at = 0;
    if (isnan(best)) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = elem(x, bf16, i);
        if (v > best) {
            best = v;
            at = i;
        } else if (isnan(v)) {
            return i;
        }
    }
    return at;
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))),
            16));
    return _mm512_loadu_ps((const float *)x + i);
}

static int64_t scan_vector(const void *x, int bf16, int64_t n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 a = load16(x, bf16, i), b = load16(x, bf16, i + 16);
        nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
    }
    float best = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    for (int64_t j = i; j < n; j++) {
        const float v = elem(x, bf16, j);
        if (isnan(v)) nan = 1;
        else if (v > best) best = v;
    }
    const __m512 target = _mm512_set1_ps(best);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++) {
        const float v = elem(x, bf16, i);
        if (nan ? isnan(v) : v == best) return i;
    }
    return 0; /* not reached: the maximum (or a NaN) is in the row */
}
#elif defined(BATON_AVX2)
static inline __m256 load8(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))),
            16));
    return _mm256_loadu_ps((const float *)x + i);
}

static int64_t scan_vector(const void *x, int bf16, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = load8(x, bf16, i), b = load8(x, bf16, i + 8);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float best = lanes[0];
    for (int k = 1; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < n; j++) {
        const float v = elem(x, bf16, j);
        if (isnan(v)) any_nan = 1;
        else if (v > best) best = v;
    }
    const __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, bf16, i);
        const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++) {
        const float v = elem(x, bf16, i);
        if (any_nan ? isnan(v) : v == best) return i;
    }
    return 0; /* not reached */
}
#else
static int64_t scan_vector(const void *x, int bf16, int64_t n) { return scan_scalar(x, bf16, n); }
#endif

static int row_max(const void *x, int bf16, int64_t rows, int64_t n, float *values,
                   int64_t *indices, int num_threads) {
    if (rows < 0 || n <= 0) return 1;
    const size_t row_bytes = (size_t)n * (bf16 ? 2 : 4);
    #pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * n >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)x + (size_t)r * row_bytes;
        const int64_t at = scan_vector(row, bf16, n);
        indices[r] = at;
        values[r] = elem(row, bf16, at);
    }
    return 0;
}

int baton_row_max_f32(const float *x, int64_t rows, int64_t n, float *values, int64_t *indices,
                      int num_threads) {
    return row_max(x, 0, rows, n, values, indices, num_threads);
}

int baton_row_max_bf16(const uint16_t *x, int64_t rows, int64_t n, float *values,
                       int64_t *indices, int num_threads) {
    return row_max(x, 1, rows, n, values, indices, num_threads);
}
