/* y = x @ W^T (+ bias) for many bf16 rows on AMX tiles (TDPBF16PS), reading
 * the same tiled bf16 weights the gemv streams (kernels.h: eight output rows
 * by sixteen columns, contiguous per group of eight rows).
 *
 * Why hand-written: a decode step of 5..64 rows is bound by reading the
 * weights (270 MB a step for SmolLM2-135M in bf16), not by arithmetic.
 * oneDNN's bf16 linear (AMX) on its own packed copy reaches ~1 TFLOP/s when
 * the weights sit in cache, but a whole model's worth of distinct weights
 * streamed at 32 rows took ~31 ms a step on the Xeon (model 207) against ~21
 * ms at 8 rows: at 32 rows it splits the rows over the threads, so both
 * threads read every weight. Here each thread streams its own share of the
 * output features once, for every row (docs/benchmarks.md has the figures).
 *
 * Tiles: a weight block (8 features x 16 columns, 256 contiguous bytes) is
 * the A operand (8 rows x 32 bytes); the input rows, transposed once per call
 * into column pairs (xt [K/2][Mp] of 32-bit bf16 pairs), are the B operand
 * (8 pairs x 16 rows); C is [8 features][16 rows] in float32. Two feature
 * groups by two blocks of sixteen rows use all eight tile registers.
 *
 * Numerics: bf16 products are exact in float32 and accumulate in float32 (as
 * VDPBF16PS: denormal inputs and outputs flushed, round to nearest even); the
 * bias is added to the float32 sum and the result rounded once to bf16, as
 * oneDNN's bf16 linear and the gemv do. Only the summation order differs.
 *
 * Only the avx512_bf16 kind builds the tile code (its functions carry the
 * amx target attribute, so no global flag changes); every other kind, and a
 * CPU or kernel without AMX tile data, answers 0 from baton_amx_bf16_ready and
 * the plan never calls baton_linear_amx_bf16.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(BATON_GEMV_DP) && defined(__x86_64__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define BATON_AMX 1
#endif

#ifdef BATON_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* the weight block PF_AHEAD blocks ahead of j (four cache lines) */
#ifndef PF_AHEAD
#define PF_AHEAD 8
#endif
#if PF_AHEAD == 0
#define PREFETCH_W(base, j) do { } while (0)
#else
#define PREFETCH_W(base, j)                                                   \
    do {                                                                      \
        const char *pf_ = (const char *)((base) + ((j) + PF_AHEAD) * 128);    \
        for (int l_ = 0; l_ < 256; l_ += 64) _mm_prefetch(pf_ + l_, _MM_HINT_T0); \
    } while (0)
#endif

static int amx_state = -1;  /* -1 not asked yet, 0 no, 1 yes */

/* 1 when this CPU has AMX-BF16 and the kernel lets this process use tile
 * data (Linux asks for it once per process: arch_prctl ARCH_REQ_XCOMP_PERM;
 * oneDNN asks the same, which is harmless). */
int baton_amx_bf16_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state >= 0) return state;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_state, ok, __ATOMIC_RELEASE);
    return ok;
}

/* A [16 features][16 rows] float32 block (c, row stride 16) plus bias to
 * y[m * N + n0 + r] in bf16, for r < nr, m < mr: row m of the result is
 * column m of the block (a gather), rounded once. */
AMX_TARGET static void store_block(const float *c, const float *bias, uint16_t *y, int64_t N,
                                   int64_t n0, int64_t m0, int nr, int mr) {
    const __mmask16 keep = (__mmask16)((1u << nr) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mr; m++) {
        const __m512 v = _mm512_add_ps(
            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep,
                                     _mm512_add_epi32(rows, _mm512_set1_epi32(m)), c, 4), b);
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* xt[p][m] = the bf16 pair (x[m][2p], x[m][2p + 1]) for p in [p0, p1), zero
 * past K (odd K: the last pair's second half) and for m in [M, mp). */
AMX_TARGET static void transpose_pairs(const uint16_t *x, uint32_t *xt, int64_t M, int64_t mp,
                                       int64_t K, int64_t p0, int64_t p1) {
    const int64_t whole = K / 2;  /* pairs wholly inside a row */
    for (int64_t mb = 0; mb < mp; mb += 16) {
        const int mr = (int)(M - mb < 16 ? (M - mb > 0 ? M - mb : 0) : 16);
        const __mmask16 keep = (__mmask16)((1u << mr) - 1u);
        /* 32-bit offsets of rows mb.. (a row is K bf16 values: K / 2 words
         * when K is even; odd K rows start mid-word, handled below) */
        const __m512i rows = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32((int)K));  /* in bf16 units */
        for (int64_t p = p0; p < p1; p++) {
            uint32_t *dst = xt + p * mp + mb;
            if ((K & 1) == 0 && p < whole) {
                /* byte offsets: (m * K + 2p) * 2 */
                const __m512i off = _mm512_add_epi32(rows, _mm512_set1_epi32((int)(2 * p)));
                const __m512i v = _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), keep, off, x + mb * K, 2);
                _mm512_storeu_si512(dst, v);
            } else {
                for (int m = 0; m < 16; m++) {
                    uint32_t v = 0;
                    if (m < mr && 2 * p < K) {
                        const uint16_t *xm = x + (mb + m) * K;
                        v = xm[2 * p];
                        if (2 * p + 1 < K) v |= (uint32_t)xm[2 * p + 1] << 16;
                    }
                    dst[m] = v;
                }
            }
        }
    }
}

/* Feature groups [g0, g1) for every row: C[gi][mi] in tmm(2 * gi + mi). */
AMX_TARGET static void amx_groups(const uint32_t *xt, int64_t mp, const uint16_t *w,
                                  const float *bias, uint16_t *y, int64_t M, int64_t N,
                                  int64_t kb, int64_t g0, int64_t g1) {
    amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 8;
        cfg.colsb[i] = (i == 4 || i == 5) ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
    const int64_t mblocks = mp / 16, stride = mp * 4;
    float c[4][8][16];
    for (int64_t g = g0; g < g1; g += 2) {
        const int two = g + 1 < g1;
        const uint16_t *w0 = w + g * kb * 128, *w1 = w0 + kb * 128;
        for (int64_t mb = 0; mb < mblocks; mb += 2) {
            const int twom = mb + 1 < mblocks;
            const uint32_t *x0 = xt + mb * 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (two && twom) {
                for (int64_t j = 0; j < kb; j++) {
                    PREFETCH_W(w0, j);
                    PREFETCH_W(w1, j);
                    _tile_loadd(4, w0 + j * 128, 32);
                    _tile_loadd(6, x0 + 8 * j * mp, stride);
                    _tile_loadd(7, x0 + 8 * j * mp + 16, stride);
                    _tile_loadd(5, w1 + j * 128, 32);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            } else if (two) {
                for (int64_t j = 0; j < kb; j++) {
                    _tile_loadd(4, w0 + j * 128, 32);
                    _tile_loadd(6, x0 + 8 * j * mp, stride);
                    _tile_loadd(5, w1 + j * 128, 32);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                }
            } else if (twom) {
                for (int64_t j = 0; j < kb; j++) {
                    _tile_loadd(4, w0 + j * 128, 32);
                    _tile_loadd(6, x0 + 8 * j * mp, stride);
                    _tile_loadd(7, x0 + 8 * j * mp + 16, stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
            } else {
                for (int64_t j = 0; j < kb; j++) {
                    _tile_loadd(4, w0 + j * 128, 32);
                    _tile_loadd(6, x0 + 8 * j * mp, stride);
                    _tile_dpbf16ps(0, 4, 6);
                }
            }
            /* c[0], c[2]: features g*8.. and g*8+8.. for rows mb*16..;
             * c[1], c[3] the next sixteen rows: [16 features][16 rows] each */
            _tile_stored(0, c[0], 64);
            _tile_stored(2, c[1], 64);
            _tile_stored(1, c[2], 64);
            _tile_stored(3, c[3], 64);
            const int64_t n0 = g * 8;
            const int nr = (int)((N - n0) < (two ? 16 : 8) ? (N - n0) : (two ? 16 : 8));
            for (int h = 0; h < 1 + twom; h++) {
                const int64_t m0 = (mb + h) * 16;
                const int mr = (int)(M - m0 < 16 ? M - m0 : 16);
                if (mr > 0) store_block(&c[2 * h][0][0], bias, y, N, n0, m0, nr, mr);
            }
        }
    }
    _tile_release();
}

int baton_linear_amx_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1) return 1;
    if (!baton_amx_bf16_ready()) return 3;
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS), kb = kp / BATON_GEMV_TILE_COLS;
    const int64_t mp = baton_round_up(M, 16);
    const int64_t groups = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    uint32_t *xt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (kp / 2) * mp + 64);
    float *bf = (float *)malloc(sizeof(float) * (N + 1));
    if (xt == NULL || bf == NULL) {
        free(xt);
        free(bf);
        return 2;
    }
    if (bias) baton_load_bf16(bias, bf, N);
    /* each thread a contiguous run of group pairs: one stream of weights */
    const int64_t pairs = (groups + 1) / 2;
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        transpose_pairs(x, xt, M, mp, K, (kp / 2) * me / nt, (kp / 2) * (me + 1) / nt);
        const int64_t p0 = pairs * me / nt, p1 = pairs * (me + 1) / nt;
        const int64_t g1 = 2 * p1 < groups ? 2 * p1 : groups;
        #pragma omp barrier
        if (2 * p0 < g1)
            amx_groups(xt, mp, w, bias ? bf : 0, y, M, N, kb, 2 * p0, g1);
    }
    free(xt);
    free(bf);
    return 0;
}
#else
int baton_amx_bf16_ready(void) { return 0; }

int baton_linear_amx_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return 3;
}
#endif
