/* The screened greedy pick's first pass: for each of R <= 4 rows x (bf16)
 * and each of V vocabulary rows w_v of a bf16 output projection, an
 * approximate logit A_v from an int8 copy of the weights (half the bytes of
 * the bf16 ones), and a bound E_v on how far the logit the real projection
 * computes (float32 sums of exact bf16 products, rounded once to bf16) can
 * lie from it. The pick needs the exact logits only of the rows whose upper
 * bound A_v + E_v reaches the largest lower bound A_u - E_u: the argmax is
 * among them (backends/greedy_screen.py computes those few exactly, with the
 * projection's own kernel, and picks among them).
 *
 * The int8 copy: q_v = round(w_v / s_v), s_v = max |w_v| / 127 (float32),
 * so |w_vk - s_v q_vk| <= s_v (0.5 + 1e-5) (backends/greedy_screen.py).
 * With n1 = sum |x_k| (rounded up) and u = 2^-24, the pieces of E_v:
 *   quantization          s_v n1 (0.5 + 1e-5)
 *   this pass's float32 sum and the projection's (any order, FMA or not):
 *                          each <= (K + 2) u sum |x_k| 127 s_v
 *   the projection's bf16 rounding  <= 2^-8 |S_v| <= 2^-8 (|A_v| + the above)
 *   this pass's product by s_v and the sum A_v + E_v: 2^-22 |A_v|
 * all widened by 1e-4 and 1e-30 (bf16 denormal products that AMX and
 * VDPBF16PS treat as zero). A value with |A_v| >= 1e30 (near bf16's overflow
 * to infinity), or a row that is not finite, makes lo_max NaN: the caller
 * then computes every logit.
 *
 * Layout of q: [ceil(V / 16)][K][16] (sixteen vocabulary rows side by side
 * for each column), so one 16-byte load feeds sixteen accumulators.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define SCREEN_LANES 16
#define SCREEN_MAX_ROWS 4

/* acc[r][j] = sum_k x[r][k] * q[k][j] for one block of 16 vocabulary rows,
 * in four partial sums over k (k mod 4) so that the FMA chains overlap. R is
 * a constant at each call (screen_rows), so the partial sums stay in
 * registers. */
__attribute__((unused)) static inline __attribute__((always_inline)) void screen_block(
        const float *xf, const int R, int64_t K, const int8_t *qb,
        float acc[SCREEN_MAX_ROWS][SCREEN_LANES]) {
    float part[SCREEN_MAX_ROWS][4][SCREEN_LANES];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < 4; p++)
            for (int j = 0; j < SCREEN_LANES; j++) part[r][p][j] = 0.0f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        for (int p = 0; p < 4; p++) {
            const int8_t *qk = qb + (k + p) * SCREEN_LANES;
            float w[SCREEN_LANES];
            for (int j = 0; j < SCREEN_LANES; j++) w[j] = (float)qk[j];
            for (int r = 0; r < R; r++) {
                const float xv = xf[r * K + k + p];
                for (int j = 0; j < SCREEN_LANES; j++) part[r][p][j] += xv * w[j];
            }
        }
    }
    for (; k < K; k++) {
        const int8_t *qk = qb + k * SCREEN_LANES;
        for (int r = 0; r < R; r++) {
            const float xv = xf[r * K + k];
            for (int j = 0; j < SCREEN_LANES; j++) part[r][0][j] += xv * (float)qk[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < SCREEN_LANES; j++)
            acc[r][j] = (part[r][0][j] + part[r][1][j]) + (part[r][2][j] + part[r][3][j]);
}

#if defined(__AVX512F__)
#define SCREEN_AHEAD 2
/* screen_block in 512-bit registers: one int8 load widened to sixteen floats
 * per column, an FMA per row. */
static inline __attribute__((always_inline)) void screen_block512(
        const float *xf, const int R, int64_t K, const int8_t *qb,
        float acc[SCREEN_MAX_ROWS][SCREEN_LANES]) {
    __m512 part[SCREEN_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < 4; p++) part[r][p] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        /* one 64-byte line of the block SCREEN_AHEAD blocks on per four
         * columns: the stream ahead of the hardware prefetcher */
        _mm_prefetch((const char *)(qb + (SCREEN_AHEAD * K + k) * SCREEN_LANES), _MM_HINT_T0);
        for (int p = 0; p < 4; p++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qb + (k + p) * SCREEN_LANES))));
            for (int r = 0; r < R; r++)
                part[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xf[r * K + k + p]), w, part[r][p]);
        }
    }
    for (; k < K; k++) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(qb + k * SCREEN_LANES))));
        for (int r = 0; r < R; r++)
            part[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(xf[r * K + k]), w, part[r][0]);
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(acc[r], _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                               _mm512_add_ps(part[r][2], part[r][3])));
}
#define SCREEN_BLOCK screen_block512
#else
#define SCREEN_BLOCK screen_block
#endif

static void screen_rows(const float *xf, int64_t R, int64_t K, const int8_t *qb,
                        float acc[SCREEN_MAX_ROWS][SCREEN_LANES]) {
    switch (R) {
        case 1: SCREEN_BLOCK(xf, 1, K, qb, acc); break;
        case 2: SCREEN_BLOCK(xf, 2, K, qb, acc); break;
        case 3: SCREEN_BLOCK(xf, 3, K, qb, acc); break;
        default: SCREEN_BLOCK(xf, 4, K, qb, acc); break;
    }
}

int baton_greedy_screen(const uint16_t *x, const int8_t *q, const float *s, int64_t R,
                        int64_t V, int64_t K, float *hi, float *lo_max, int num_threads) {
    if (R < 1 || R > SCREEN_MAX_ROWS || K < 1 || V < 1) return 1;
    float *xf = (float *)malloc(sizeof(float) * R * K);
    if (xf == NULL) return 2;
    const double u = ldexp(1.0, -24);
    const float per_n1 = (float)((0.5 + 1e-5 + 2.0 * 127.0 * (double)(K + 2) * u * 1.01)
                                 * (1.0 + ldexp(1.0, -8)) * 1.0001);
    const float rel = (float)((ldexp(1.0, -8) + ldexp(1.0, -22)) * 1.0001);
    float span[SCREEN_MAX_ROWS];
    int bad = 0;
    baton_load_bf16(x, xf, R * K);
    for (int64_t r = 0; r < R; r++) {
        double n1 = 0.0;
        for (int64_t k = 0; k < K; k++) n1 += fabs((double)xf[r * K + k]);
        span[r] = (float)(n1 * (1.0 + 1e-6)) * per_n1;
        if (!isfinite(span[r])) bad = 1;
        lo_max[r] = -INFINITY;
    }
    const int64_t blocks = (V + SCREEN_LANES - 1) / SCREEN_LANES;
    if (!bad) {
        #pragma omp parallel num_threads(num_threads)
        {
            float mine[SCREEN_MAX_ROWS];
            int mine_bad = 0;
            for (int64_t r = 0; r < R; r++) mine[r] = -INFINITY;
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                float acc[SCREEN_MAX_ROWS][SCREEN_LANES];
                screen_rows(xf, R, K, q + b * K * SCREEN_LANES, acc);
                const int lanes = (int)(V - b * SCREEN_LANES < SCREEN_LANES
                                        ? V - b * SCREEN_LANES : SCREEN_LANES);
                for (int64_t r = 0; r < R; r++) {
                    for (int j = 0; j < lanes; j++) {
                        const int64_t v = b * SCREEN_LANES + j;
                        const float a = acc[r][j] * s[v];
                        const float e = s[v] * span[r] + fabsf(a) * rel + 1e-30f;
                        if (!(fabsf(a) < 1e30f)) mine_bad = 1;
                        hi[r * V + v] = a + e;
                        if (a - e > mine[r]) mine[r] = a - e;
                    }
                }
            }
            #pragma omp critical
            {
                for (int64_t r = 0; r < R; r++)
                    if (mine[r] > lo_max[r]) lo_max[r] = mine[r];
                bad |= mine_bad;
            }
        }
    }
    if (bad)
        for (int64_t r = 0; r < R; r++) lo_max[r] = NAN;
    free(xf);
    return 0;
}
