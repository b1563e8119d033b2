/* Decode attention that reads the paged KV pool in place (CPU, float32
 * arithmetic; the pool holds float32 or bfloat16).
 *
 * One query token per row t attends to the first ctx_lens[t] positions of its
 * sequence, whose K/V live in the blocks listed in block_tables[t]. Nothing is
 * gathered: each (row, kv head) task walks the block table, scores the group
 * of query heads that share the kv head, takes a softmax over the scores and
 * accumulates V. Tasks run in parallel on the process's OpenMP pool (the same
 * libgomp torch uses, so no second set of threads competes for the cores).
 * With fewer rows than two per thread, each row's context is also cut into
 * chunks of whole blocks, one task each, whose partial results merge by
 * their log-sum-exps (split_context): a lone long row keeps both cores busy.
 *
 * The builds agree to rounding, not bit for bit: the AVX-512 kinds take the
 * softmax's sum over sixteen lanes (the AVX2 kind over eight), the
 * AVX512_BF16 kind its bf16 scores in another order (on AMX tiles where the
 * CPU has them, else VDPBF16PS: baton_attention_amx), and the split-context
 * path depends on the thread count. Within a build, scores path and thread
 * count the result is one function of the inputs (with or without lse).
 *
 * Every AVX2 and AVX-512 path prefetches the next sixteen positions of its
 * walk while it works on the current ones, of each slot the kv heads the
 * task reads (all of them for a task of a whole row, one for a task of one
 * kv head): K's blocks in turn, then V's first, then V's; the AMX and float32
 * scores and the values in parts spread over that work (prefetch_part), the
 * VDPBF16PS scores at once. The hardware prefetchers start afresh at every
 * scattered block, and the arithmetic otherwise runs while few loads are in
 * flight (the AVX2 kind's, added 2026-12-07: a 135M gguf one-row step on
 * the AVX2 EPYC 0.92x as long; docs/benchmarks.md). (Until 2026-12-06 the
 * AVX-512 paths fetched whole slots whatever the task read: a one-kv-head
 * task of SmolLM2-1.7B's shape, 32 kv heads, read 32 times the bytes it
 * used; docs/benchmarks.md.)
 *
 * Layouts (all contiguous):
 *   q, out            [T, H, D]
 *   k_cache, v_cache  [num_slots, KVH, D], slot = block * block_size + offset,
 *                     float32, or bfloat16 when kv_bf16
 *   block_tables      [T, max_blocks]  (int64)
 *   ctx_lens          [T]              (int64, >= 1)
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* 1: scores on AMX tiles where the CPU and kernel allow it (the default);
 * 0: never. Process-wide; tests force each path on a CPU that has both. */
static int attention_amx_wanted = 1;

#if defined(BATON_AVX2) && defined(__AVX512F__)
/* baton_exp_shifted_sum on sixteen lanes, the tail masked: each exp as
 * there, the sum in another order. */
static inline float exp_shifted_sum(float *x, int64_t n, float shift) {
    const __m512 s = _mm512_set1_ps(shift);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = baton_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), s));
        _mm512_mask_storeu_ps(x + i, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
#else
#define exp_shifted_sum baton_exp_shifted_sum
#endif

/* Each head's scores[h][0..n) -> softmax weights, in place; with lse, also
 * lse[h] = log(sum(exp(scores[h]))) (cascade attention merges partial
 * results by it). */
static inline void softmax_rows(float *scores, int64_t n, int64_t h0, int64_t h1,
                                float *lse) {
    for (int64_t h = h0; h < h1; h++) {
        float *sh = scores + h * n;
        /* A vector max (the scalar loop waited on each max's latency). */
        float mx = sh[0];
        #pragma omp simd reduction(max:mx)
        for (int64_t p = 1; p < n; p++) mx = sh[p] > mx ? sh[p] : mx;
        const float sum = exp_shifted_sum(sh, n, mx);
        const float inv = 1.0f / sum;
        if (lse != NULL) lse[h] = mx + logf(sum);
        #pragma omp simd
        for (int64_t p = 0; p < n; p++) sh[p] *= inv;
    }
}

#ifdef BATON_AVX2
/* One line into L1 by an asm statement the compiler keeps: GCC 12 deleted
 * these loops of _mm_prefetch (the builtin has no effect it must keep) once
 * their addresses came through piece_run from the block table. */
static inline void prefetch_line(const char *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
}

/* Software prefetch (to L1) of the next piece of a walk: the first
 * min(16, n - p) positions of the block holding position p (p a multiple of
 * 16 and < n; blocks of block_size, slots of `bytes`), and of each slot only
 * the bytes [off, off + len) that the task reads (its kv heads: a task of
 * one kv head of SmolLM2-1.7B's 32 reads 128 bytes of each 4 KB slot). The
 * kernels ask, while they work on one piece of sixteen positions, for the
 * next piece of their walk, K's blocks and then V's first, so the scattered
 * block's lines are in flight while the arithmetic runs (the hardware
 * prefetchers start afresh at each block). A run is asked for in parts
 * (prefetch_part) spread over the steps of the work on the current piece
 * rather than at once: they interleave with that work (measured 2026-12-01,
 * one thread, 16 x 200 and 8 x 1000: ~8-10% faster than all at once).
 * `at` NULL when p >= n. */
typedef struct { const char *at; int64_t slots, lines, stride; } prefetch_run;

static inline prefetch_run piece_run(const void *cache, const int64_t *table, int64_t p,
                                     int64_t n, int64_t block_size, int64_t bytes,
                                     int64_t off, int64_t len) {
    prefetch_run r = {NULL, 0, 0, bytes};
    if (p < n) {
        const char *first = (const char *)cache +
                            (table[p / block_size] * block_size + p % block_size) * bytes + off;
        r.at = (const char *)((uintptr_t)first & ~(uintptr_t)63);
        r.lines = (first + len - r.at + 63) / 64;
        r.slots = n - p < 16 ? n - p : 16;
        if (off == 0 && len == bytes) {  /* whole slots: one contiguous run */
            r.lines = (r.slots * bytes + 63) / 64;
            r.slots = 1;
        }
    }
    return r;
}

/* Part i of `parts` of the run's lines (the last part to its end). */
static inline void prefetch_part(prefetch_run r, int64_t i, int64_t parts) {
    if (r.at == NULL) return;
    const int64_t total = r.slots * r.lines;
    const int64_t lo = i * total / parts, hi = i + 1 == parts ? total : (i + 1) * total / parts;
    for (int64_t s = lo / r.lines, first = lo - s * r.lines; s * r.lines < hi; s++, first = 0) {
        const int64_t end = hi - s * r.lines < r.lines ? hi - s * r.lines : r.lines;
        for (int64_t l = first; l < end; l++) prefetch_line(r.at + s * r.stride + 64 * l);
    }
}

/* Eight float32 values of a cache row, from float32 or bfloat16 storage. */
static inline __m256 load8_f32(const void *base, int64_t i) {
    return _mm256_loadu_ps((const float *)base + i);
}
static inline __m256 load8_bf16(const void *base, int64_t i) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 load8(const void *base, int64_t i, const int bf16) {
    return bf16 ? load8_bf16(base, i) : load8_f32(base, i);
}

/* Query heads sharing a kv head: each K and V vector is loaded (for bf16,
 * widened) once for all of them. Scores take four positions by up to three
 * heads at a time: 12 independent FMA chains (one dot product at a time
 * waited on each FMA's latency).
 *
 * Scores of NH heads (rows qh, qh + D, ...) at four positions (at[]: element
 * offsets of their K vectors), written to sh[h * n + p + 0..3]. */
static inline void qk_four(const float *qh, int64_t D, const void *k_cache,
                           const int64_t *at, float *sh, int64_t n, int64_t p, float scale,
                           const int NH, const int bf16) {
    __m256 a[3][4];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 q[3];
        for (int h = 0; h < NH; h++) q[h] = _mm256_loadu_ps(qh + h * D + d);
        for (int j = 0; j < 4; j++) {
            const __m256 k = load8(k_cache, at[j] + d, bf16);
            for (int h = 0; h < NH; h++) a[h][j] = _mm256_fmadd_ps(k, q[h], a[h][j]);
        }
    }
    const __m128 sv = _mm_set1_ps(scale);
    for (int h = 0; h < NH; h++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]),
                                        _mm256_hadd_ps(a[h][2], a[h][3]));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        _mm_storeu_ps(sh + h * n + p, _mm_mul_ps(r, sv));
    }
}

#define BATON_NH_SWITCH(nh, CALL) \
    switch (nh) { case 1: CALL(1); break; case 2: CALL(2); break; default: CALL(3); break; }

/* One pass over the context for K and one for V, each slot (all its kv
 * heads) used whole while it is in L1, so the pool streams from memory in
 * order; a pass per kv head (every third 128-byte piece) ran at a fraction of
 * the bandwidth once the context outgrew the caches. */
static inline void scores_grouped(const float *qt, const void *k_cache, const void *v_cache,
                                  const int64_t *table, int64_t n, int64_t h0, int64_t h1,
                                  int64_t G, int64_t KVH, int64_t D, int64_t block_size,
                                  float scale, float *scores, float *lse, const int bf16) {
    const int64_t row = KVH * D;
    const int64_t g0 = h0 / G, g1 = h1 / G;
    int64_t b = 0, o = 0, p = 0;
    /* While a block is scored, the next one's slots (after K's last, V's
     * first) are asked for, a part each four positions: of each slot (bytes)
     * the task's kv heads' (len bytes from off). */
    const int64_t es = bf16 ? 2 : 4, bytes = row * es, off = g0 * D * es,
                  len = (g1 - g0) * D * es, parts = (block_size + 3) / 4;
    prefetch_run next = {NULL, 0, 0, 0};
    for (; p + 4 <= n; p += 4) {
        if (o < 4)
            next = p + block_size < n
                       ? piece_run(k_cache, table, p + block_size, n, block_size, bytes, off, len)
                       : piece_run(v_cache, table, 0, n, block_size, bytes, off, len);
        prefetch_part(next, o / 4, parts);
        int64_t slot[4];
        for (int j = 0; j < 4; j++) {
            slot[j] = (table[b] * block_size + o) * row;
            if (++o == block_size) { o = 0; b++; }
        }
        for (int64_t g = g0; g < g1; g++) {
            const int64_t at[4] = {slot[0] + g * D, slot[1] + g * D, slot[2] + g * D,
                                   slot[3] + g * D};
            for (int64_t hs = g * G; hs < (g + 1) * G; hs += 3) {
                const int nh = (int)((g + 1) * G - hs < 3 ? (g + 1) * G - hs : 3);
#define QK(NH) qk_four(qt + hs * D, D, k_cache, at, scores + hs * n, n, p, scale, NH, bf16)
                BATON_NH_SWITCH(nh, QK)
#undef QK
            }
        }
    }
    for (; p < n; p++) {
        const int64_t slot = (table[b] * block_size + o) * row;
        if (++o == block_size) { o = 0; b++; }
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = qt + h * D;
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(load8(k_cache, slot + (h / G) * D + d, bf16),
                                    _mm256_loadu_ps(qh + d), a);
            scores[h * n + p] = baton_hsum256(a) * scale;
        }
    }
    softmax_rows(scores, n, h0, h1, lse);
}

/* acc[h][0..16) += w[h][i] * V[i][0..16) for NH <= 3 heads (rows h * D of
 * acc, h * n of w) over the m slots at v_cache + at + i * row, the
 * accumulators in registers for the whole block: the same FMAs in the same
 * order as the loop below, without its load and store of every
 * accumulator at every position. */
static inline __attribute__((always_inline)) void pv_block16(
        const void *v_cache, int64_t at, int64_t row, int64_t m, const float *w, int64_t n,
        float *acc, int64_t D, const int NH, const int bf16) {
    __m256 a[3][2];
    for (int h = 0; h < NH; h++)
        for (int x = 0; x < 2; x++) a[h][x] = _mm256_loadu_ps(acc + h * D + 8 * x);
    for (int64_t i = 0; i < m; i++) {
        const __m256 v0 = load8(v_cache, at + i * row, bf16);
        const __m256 v1 = load8(v_cache, at + i * row + 8, bf16);
        for (int h = 0; h < NH; h++) {
            const __m256 wv = _mm256_set1_ps(w[h * n + i]);
            a[h][0] = _mm256_fmadd_ps(wv, v0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(wv, v1, a[h][1]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int x = 0; x < 2; x++) _mm256_storeu_ps(acc + h * D + 8 * x, a[h][x]);
}

/* acc[h] += w[h][p] * V[p]: each V vector loaded (widened) once for the
 * G heads of its kv head; the accumulators in registers over a block
 * (pv_block16) where D is a multiple of 16, else in L1. */
static inline void values_grouped(const void *v_cache, const int64_t *table, int64_t n,
                                  int64_t h0, int64_t h1, int64_t G, int64_t KVH, int64_t D,
                                  int64_t block_size, const float *scores, float *acc,
                                  const int bf16) {
    const int64_t row = KVH * D;
    const int64_t g0 = h0 / G, g1 = h1 / G;
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
    if (D % 16 == 0) {
        const int64_t es = bf16 ? 2 : 4;
        for (int64_t p0 = 0; p0 < n; p0 += block_size) {
            const int64_t base = table[p0 / block_size] * block_size * row;
            const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
            /* the next block's first sixteen positions, a part per kv group */
            const prefetch_run next = piece_run(v_cache, table, p0 + block_size, n, block_size,
                                                row * es, g0 * D * es, (g1 - g0) * D * es);
            for (int64_t g = g0; g < g1; g++) {
                prefetch_part(next, g - g0, g1 - g0);
                for (int64_t hs = g * G; hs < (g + 1) * G; hs += 3) {
                    const int64_t nh = (g + 1) * G - hs < 3 ? (g + 1) * G - hs : 3;
                    for (int64_t x0 = 0; x0 < D; x0 += 16) {
#define PV(NH) pv_block16(v_cache, base + g * D + x0, row, m, scores + hs * n + p0, n, \
                          acc + hs * D + x0, D, NH, bf16)
                        BATON_NH_SWITCH(nh, PV)
#undef PV
                    }
                }
            }
        }
        return;
    }
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const int64_t base = table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        for (int64_t i = 0; i < m; i++) {
            const int64_t slot = base + i * row;
            for (int64_t g = g0; g < g1; g++) {
                int64_t x0 = 0;
                for (; x0 + 32 <= D; x0 += 32) {
                    __m256 v[4];
                    for (int x = 0; x < 4; x++)
                        v[x] = load8(v_cache, slot + g * D + x0 + 8 * x, bf16);
                    for (int64_t h = g * G; h < (g + 1) * G; h++) {
                        const __m256 wv = _mm256_set1_ps(scores[h * n + p0 + i]);
                        float *ah = acc + h * D + x0;
                        for (int x = 0; x < 4; x++)
                            _mm256_storeu_ps(ah + 8 * x, _mm256_fmadd_ps(
                                wv, v[x], _mm256_loadu_ps(ah + 8 * x)));
                    }
                }
                for (; x0 < D; x0 += 8) {
                    const __m256 v = load8(v_cache, slot + g * D + x0, bf16);
                    for (int64_t h = g * G; h < (g + 1) * G; h++) {
                        float *ah = acc + h * D + x0;
                        _mm256_storeu_ps(ah, _mm256_fmadd_ps(
                            _mm256_set1_ps(scores[h * n + p0 + i]), v, _mm256_loadu_ps(ah)));
                    }
                }
            }
        }
    }
}

static inline void attention_task_grouped(const float *qt, const void *k_cache,
                                          const void *v_cache, const int64_t *table,
                                          int64_t n, int64_t h0, int64_t h1, int64_t G,
                                          int64_t KVH, int64_t D, int64_t block_size,
                                          float scale, float *scores, float *acc, float *lse,
                                          const int bf16) {
    scores_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size, scale,
                   scores, lse, bf16);
    values_grouped(v_cache, table, n, h0, h1, G, KVH, D, block_size, scores, acc, bf16);
}

static void attention_task_grouped_f32(const float *qt, const void *k_cache,
                                       const void *v_cache, const int64_t *table, int64_t n,
                                       int64_t h0, int64_t h1, int64_t G, int64_t KVH,
                                       int64_t D, int64_t block_size, float scale,
                                       float *scores, float *acc, float *lse) {
    attention_task_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size,
                           scale, scores, acc, lse, 0);
}

static void attention_task_grouped_bf16(const float *qt, const void *k_cache,
                                        const void *v_cache, const int64_t *table, int64_t n,
                                        int64_t h0, int64_t h1, int64_t G, int64_t KVH,
                                        int64_t D, int64_t block_size, float scale,
                                        float *scores, float *acc, float *lse) {
    attention_task_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size,
                           scale, scores, acc, lse, 1);
}
#endif

#if defined(BATON_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
/* The AVX-512 kinds. Values (attention weights times V) accumulate in
 * registers over a whole block, for as many heads of a kv group as 24 zmm
 * hold (the AVX2 path holds 16 values of up to three heads): the same FMAs
 * in the same order as the AVX2 path. Scores, with AVX512_BF16 and a
 * bf16 query and cache, are vdpbf16ps dot products (bf16 products are exact
 * in float32; the sums run in another order than the float32 loop), sixteen
 * positions of a block at a time, their sixteen horizontal sums folded into
 * one vector by a shuffle tree. */
#define BATON_PV_REGS 24

static inline __m512 load16(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        return baton_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* acc[h][0..16*DV) += w[h * wh + i * wp] * V[i] for the NH heads (rows
 * h * D of acc) and the m slots at v_cache + at + i * row: the weights
 * head-major (wh = n, wp = 1) or position-major (wh = 1, wp = the row of
 * all heads' weights of one position, scores_amx's). With a bf16 cache
 * each 32 values of acc hold V's even elements, then its odd ones
 * (deinterleave_pairs puts them back in order). */
static inline __attribute__((always_inline)) void pv_block(
        const void *v_cache, int64_t at, int64_t row, int64_t m, const float *w, int64_t wh,
        int64_t wp, float *acc, int64_t D, const int NH, const int DV, const int bf16) {
    __m512 a[BATON_PV_REGS];
    #pragma GCC unroll 24
    for (int h = 0; h < NH; h++)
        #pragma GCC unroll 8
        for (int x = 0; x < DV; x++) a[h * DV + x] = _mm512_loadu_ps(acc + h * D + 16 * x);
    for (int64_t i = 0; i < m; i++) {
        __m512 v[8];
        if (bf16) {
            /* 32 bf16 values at once, widened by a shift (the even ones) and
             * a mask (the odd ones): two instructions per 32 values where a
             * zero-extension and a shift took four. */
            const uint16_t *vi = (const uint16_t *)v_cache + at + i * row;
            #pragma GCC unroll 4
            for (int x = 0; x < DV / 2; x++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(vi + 32 * x));
                v[2 * x] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                v[2 * x + 1] = _mm512_castsi512_ps(
                    _mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
            }
        } else {
            #pragma GCC unroll 8
            for (int x = 0; x < DV; x++) v[x] = load16(v_cache, at + i * row + 16 * x, bf16);
        }
        #pragma GCC unroll 24
        for (int h = 0; h < NH; h++) {
            const __m512 wv = _mm512_set1_ps(w[h * wh + i * wp]);
            #pragma GCC unroll 8
            for (int x = 0; x < DV; x++) a[h * DV + x] = _mm512_fmadd_ps(wv, v[x], a[h * DV + x]);
        }
    }
    #pragma GCC unroll 24
    for (int h = 0; h < NH; h++)
        #pragma GCC unroll 8
        for (int x = 0; x < DV; x++) _mm512_storeu_ps(acc + h * D + 16 * x, a[h * DV + x]);
}

#define BATON_PV_CASE(NH_, DV_) \
    case NH_: pv_block(v_cache, at, row, m, w, wh, wp, acc, D, NH_, DV_, bf16); break;
/* NH <= BATON_PV_REGS / DV, as pv_heads chunks them. */
static inline void pv_dispatch(const void *v_cache, int64_t at, int64_t row, int64_t m,
                               const float *w, int64_t wh, int64_t wp, float *acc, int64_t D,
                               int NH, const int bf16) {
    switch (D / 16) {
    case 2: switch (NH) { BATON_PV_CASE(1, 2) BATON_PV_CASE(2, 2) BATON_PV_CASE(3, 2)
        BATON_PV_CASE(4, 2) BATON_PV_CASE(5, 2) BATON_PV_CASE(6, 2) BATON_PV_CASE(7, 2)
        BATON_PV_CASE(8, 2) BATON_PV_CASE(9, 2) BATON_PV_CASE(10, 2) BATON_PV_CASE(11, 2)
        default: pv_block(v_cache, at, row, m, w, wh, wp, acc, D, 12, 2, bf16); } break;
    case 4: switch (NH) { BATON_PV_CASE(1, 4) BATON_PV_CASE(2, 4) BATON_PV_CASE(3, 4)
        BATON_PV_CASE(4, 4) BATON_PV_CASE(5, 4)
        default: pv_block(v_cache, at, row, m, w, wh, wp, acc, D, 6, 4, bf16); } break;
    case 8: switch (NH) { BATON_PV_CASE(1, 8) BATON_PV_CASE(2, 8)
        default: pv_block(v_cache, at, row, m, w, wh, wp, acc, D, 3, 8, bf16); } break;
    }
}
#undef BATON_PV_CASE

static inline int pv_fits(int64_t D) { return D == 32 || D == 64 || D == 128; }

/* Rows of D values (D a multiple of 32) whose every 32 hold 16 even
 * elements then 16 odd ones -> in order. */
static inline void deinterleave_pairs(float *x, int64_t rows, int64_t D) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t c = 0; c < rows * D; c += 32) {
        const __m512 even = _mm512_loadu_ps(x + c), odd = _mm512_loadu_ps(x + c + 16);
        _mm512_storeu_ps(x + c, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(x + c + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}

#if defined(__AVX512BF16__)
/* Lane j of the result: the sum of a[j]'s sixteen lanes. */
static inline __attribute__((always_inline)) __m512 hsum16x16(__m512 a[16]) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d x = _mm512_castps_pd(t[2 * k]), y = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* u[k]'s 128-bit chunk c: partial sums of a[4k .. 4k+3] over chunk c */
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* scores[h][p0 + j] = scale * q_h . K[slot j] for the m <= 16 slots of one
 * block (element offset `at` of slot 0's kv head, `row` apart); q_h in bf16,
 * D = 32 * DQ. */
static inline __attribute__((always_inline)) void qk_block_bf16(
        const uint16_t *qh, const uint16_t *k_cache, int64_t at, int64_t row, int64_t m,
        float scale, float *sh, const int DQ) {
    __m512bh q[4];
    #pragma GCC unroll 4
    for (int x = 0; x < DQ; x++) q[x] = (__m512bh)_mm512_loadu_si512((const void *)(qh + 32 * x));
    __m512 a[16];
    #pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        a[j] = _mm512_setzero_ps();
        if (j < m) {
            const uint16_t *kj = k_cache + at + j * row;
            #pragma GCC unroll 4
            for (int x = 0; x < DQ; x++)
                a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(
                    (const void *)(kj + 32 * x)), q[x]);
        }
    }
    const __m512 r = _mm512_mul_ps(hsum16x16(a), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(sh, (__mmask16)((1u << m) - 1u), r);
}

static inline void qk_block_dispatch(const uint16_t *qh, const uint16_t *k_cache, int64_t at,
                                     int64_t row, int64_t m, int64_t D, float scale,
                                     float *sh) {
    switch (D / 32) {
    case 1: qk_block_bf16(qh, k_cache, at, row, m, scale, sh, 1); break;
    case 2: qk_block_bf16(qh, k_cache, at, row, m, scale, sh, 2); break;
    default: qk_block_bf16(qh, k_cache, at, row, m, scale, sh, 4); break;
    }
}

#ifdef BATON_AMX
/* Scores on AMX tiles (TDPBF16PS), where baton_amx_bf16_ready() and
 * baton_attention_amx() leave them: sixteen positions of a block (K rows
 * straight from the pool, 64 bytes of one slot each, the slot row apart) are
 * the A operand; the query heads of up to sixteen heads' worth of kv groups,
 * packed once per task as bf16 pairs (zero where a head's kv head is not the
 * one that piece of the slot holds), are B; C holds the sixteen positions'
 * scores of every head, no horizontal sums, and is stored as it is into a
 * position-major scores array (softmax_cols and the values read it so: no
 * transposition). The products are exact in float32 and summed in float32
 * as VDPBF16PS does (another order). */
/* Pieces of 32 dims a tile pass takes at most (the packed query: 1 KB each). */
#define ATTN_AMX_PIECES 16

/* scores[p * W + h - h0] = q_h . K[p] (unscaled) for the heads [h0, h1)
 * (whole kv groups of G heads, G <= 16) and p < round_up(n, 16) (rows
 * from n on: whatever the rest of the last block holds, never read), K in
 * bf16 blocks of block_size (a multiple of 16) positions, D a multiple of
 * 32, W = round_up(h1 - h0, 16). */
BATON_AMX_TARGET static void scores_amx(const uint16_t *qb, const uint16_t *k_cache,
                                       const uint16_t *v_cache,
                                       const int64_t *table, int64_t n, int64_t h0,
                                       int64_t h1, int64_t G, int64_t KVH, int64_t D,
                                       int64_t block_size, float *scores) {
    const int64_t row = KVH * D, per_group = D / 32, W = (h1 - h0 + 15) / 16 * 16;
    /* kv groups per tile pass: at most 16 heads and ATTN_AMX_PIECES pieces */
    int64_t groups = 16 / G;
    if (groups * per_group > ATTN_AMX_PIECES) groups = ATTN_AMX_PIECES / per_group;
    uint32_t qp[ATTN_AMX_PIECES][16][16] __attribute__((aligned(64)));
    for (int64_t ga = h0 / G; ga < h1 / G; ga += groups) {
        const int64_t gb = ga + groups < h1 / G ? ga + groups : h1 / G;
        const int64_t N = (gb - ga) * G, pieces = (gb - ga) * per_group;
        const int64_t hs = ga * G;
        /* qp[piece][k][j]: head hs + j's dims (2k, 2k + 1) of the piece's 32,
         * zero unless the piece lies in that head's kv head */
        memset(qp, 0, sizeof(uint32_t) * 256 * pieces);
        for (int64_t j = 0; j < N; j++) {
            const int64_t g = (hs + j) / G - ga;
            const uint32_t *qh = (const uint32_t *)(qb + (hs + j) * D);
            for (int64_t x = 0; x < per_group; x++)
                for (int k = 0; k < 16; k++) qp[g * per_group + x][k][j] = qh[16 * x + k];
        }
        baton_amx_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette = 1;
        cfg.rows[0] = 16; cfg.colsb[0] = (uint16_t)(4 * N);   /* C: positions x heads */
        cfg.rows[1] = 16; cfg.colsb[1] = 64;                 /* A: positions x 32 dims */
        cfg.rows[2] = 16; cfg.colsb[2] = (uint16_t)(4 * N);   /* B: dim pairs x heads */
        _tile_loadconfig(&cfg);
        for (int64_t p0 = 0; p0 < n; p0 += 16) {
            const int64_t slot = table[p0 / block_size] * block_size + p0 % block_size;
            const uint16_t *k0 = k_cache + slot * row + ga * D;
            /* the next piece of K, or after the last (of the last pass) V's
             * first, a part before each tile step */
            const prefetch_run next =
                p0 + 16 < n ? piece_run(k_cache, table, p0 + 16, n, block_size, row * 2,
                                        ga * D * 2, (gb - ga) * D * 2)
                : gb == h1 / G ? piece_run(v_cache, table, 0, n, block_size, row * 2,
                                           h0 / G * D * 2, (h1 - h0) / G * D * 2)
                : (prefetch_run){NULL, 0, 0, 0};
            _tile_zero(0);
            for (int64_t x = 0; x < pieces; x++) {
                prefetch_part(next, x, pieces);
                _tile_loadd(1, k0 + 32 * x, row * 2);
                _tile_loadd(2, qp[x], 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, scores + p0 * W + (hs - h0), W * 4);
        }
        _tile_release();
    }
}

/* scores_amx's position-major scores (rows of W, p < n; W a multiple of 16)
 * -> exp(scale * s - scale * max over p), in place, unnormalized, in the
 * columns c < nh (the rest, never written by scores_amx, read as zeros); for
 * each: inv[c] = 1 / its sum, and with lse, lse[c] = log(sum of
 * exp(scale * s)). The values are divided by the sum once, at the end
 * (attention_task_avx512): no pass over the weights for it. */
static void softmax_cols(float *S, int64_t n, int64_t W, int64_t nh, float scale, float *inv,
                         float *lse) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < W; c += 16) {
        const __mmask16 k = nh - c >= 16 ? (__mmask16)0xffff
                                         : (__mmask16)((1u << (nh - c > 0 ? nh - c : 0)) - 1u);
        float *col = S + c;
        __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
        int64_t p = 0;
        for (; p + 2 <= n; p += 2) {
            m0 = _mm512_max_ps(m0, _mm512_maskz_loadu_ps(k, col + p * W));
            m1 = _mm512_max_ps(m1, _mm512_maskz_loadu_ps(k, col + (p + 1) * W));
        }
        if (p < n) m0 = _mm512_max_ps(m0, _mm512_maskz_loadu_ps(k, col + p * W));
        const __m512 shift = _mm512_mul_ps(_mm512_max_ps(m0, m1), sv);
        __m512 s0 = _mm512_setzero_ps(), s1 = s0;
        for (p = 0; p + 2 <= n; p += 2) {
            const __m512 e0 = baton_exp512(
                _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, col + p * W), sv, shift));
            const __m512 e1 = baton_exp512(
                _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, col + (p + 1) * W), sv, shift));
            _mm512_mask_storeu_ps(col + p * W, k, e0);
            _mm512_mask_storeu_ps(col + (p + 1) * W, k, e1);
            s0 = _mm512_add_ps(s0, e0);
            s1 = _mm512_add_ps(s1, e1);
        }
        if (p < n) {
            const __m512 e0 = baton_exp512(
                _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, col + p * W), sv, shift));
            _mm512_mask_storeu_ps(col + p * W, k, e0);
            s0 = _mm512_add_ps(s0, e0);
        }
        float sum[16], sh[16];
        _mm512_storeu_ps(sum, _mm512_add_ps(s0, s1));
        _mm512_storeu_ps(sh, shift);
        for (int64_t j = 0; j < 16 && c + j < nh; j++) {
            inv[c + j] = 1.0f / sum[j];
            if (lse != NULL) lse[c + j] = sh[j] + logf(sum[j]);
        }
    }
}
#endif
#endif


/* attention_task_grouped's job on AVX-512; qb: the query in bf16 (exact)
 * for the vdpbf16ps scores, else NULL (scores as the AVX2 loop takes them). */
static void attention_task_avx512(const float *qt, const uint16_t *qb, const void *k_cache,
                                  const void *v_cache, const int64_t *table, int64_t n,
                                  int64_t h0, int64_t h1, int64_t G, int64_t KVH, int64_t D,
                                  int64_t block_size, float scale, float *scores, float *acc,
                                  float *lse, const int bf16) {
    const int64_t row = KVH * D;
    /* the weights' layout: head-major scores[h * n + p] (wh = n, wp = 1), or
     * scores_amx's position-major rows of W (w0: the first head's column) */
    int64_t wh = n, wp = 1, w0 = h0 * n;
    /* the task's kv heads within a slot, in elements (what it prefetches) */
    const int64_t heads_at = h0 / G * D, heads_len = (h1 - h0) / G * D;
    float *inv = NULL;
    (void)qb;
#if defined(__AVX512BF16__)
#ifdef BATON_AMX
    float inv_heads[h1 - h0];
    /* Tiles pay where a kv head serves several query heads: with one
     * (SmolLM2-1.7B's 32 of 32) a B tile holds one head's column and the
     * VDPBF16PS scores were 1.1-1.2x faster (attention_bw.py --shape 1.7b);
     * with three or four (135m, 360m, 8b) the tiles 1.2-1.3x. */
    if (qb != NULL && bf16 && block_size % 16 == 0 && G >= 2 && G <= 16 &&
        __atomic_load_n(&attention_amx_wanted, __ATOMIC_RELAXED) && baton_amx_bf16_ready()) {
        const int64_t W = (h1 - h0 + 15) / 16 * 16;
        scores_amx(qb, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, n, h0, h1,
                   G, KVH, D, block_size, scores);
        inv = inv_heads;
        softmax_cols(scores, n, W, h1 - h0, scale, inv, lse == NULL ? NULL : lse + h0);
        wh = 1, wp = W, w0 = 0;
    } else
#endif
    if (qb != NULL && bf16 && (D == 32 || D == 64 || D == 128) && block_size <= 16) {
        for (int64_t p0 = 0; p0 < n; p0 += block_size) {
            const int64_t base = table[p0 / block_size] * block_size * row;
            const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
            prefetch_part(p0 + block_size < n
                              ? piece_run(k_cache, table, p0 + block_size, n, block_size,
                                          row * 2, heads_at * 2, heads_len * 2)
                              : piece_run(v_cache, table, 0, n, block_size, row * 2,
                                          heads_at * 2, heads_len * 2), 0, 1);
            for (int64_t h = h0; h < h1; h++)
                qk_block_dispatch(qb + h * D, (const uint16_t *)k_cache, base + (h / G) * D,
                                  row, m, D, scale, scores + h * n + p0);
        }
        softmax_rows(scores, n, h0, h1, lse);
    } else
#endif
        scores_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size, scale,
                       scores, lse, bf16);
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
    const int64_t most = BATON_PV_REGS / (D / 16);
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const int64_t base = table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        /* the next block's first sixteen positions, a part per kv group */
        const int64_t es = bf16 ? 2 : 4;
        const prefetch_run next = piece_run(v_cache, table, p0 + block_size, n, block_size,
                                            row * es, heads_at * es, heads_len * es);
        for (int64_t g = h0 / G; g < h1 / G; g++) {
            prefetch_part(next, g - h0 / G, h1 / G - h0 / G);
            for (int64_t hs = g * G; hs < (g + 1) * G; hs += most) {
                const int64_t nh = (g + 1) * G - hs < most ? (g + 1) * G - hs : most;
                pv_dispatch(v_cache, base + g * D, row, m,
                            scores + w0 + (hs - h0) * wh + p0 * wp, wh, wp, acc + hs * D, D,
                            (int)nh, bf16);
            }
        }
    }
    if (inv != NULL)
        for (int64_t h = h0; h < h1; h++) {
            const __m512 s = _mm512_set1_ps(inv[h - h0]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + h * D + d, _mm512_mul_ps(s, _mm512_loadu_ps(acc + h * D + d)));
        }
    if (bf16) deinterleave_pairs(acc + h0 * D, h1 - h0, D);
}
#endif

static void attention_task_generic(const float *q, const void *k_cache, const void *v_cache,
                          int kv_bf16,
                          const int64_t *block_tables, const int64_t *ctx_lens, float *out,
                          int64_t t, int64_t h0, int64_t h1, int64_t H, int64_t KVH,
                          int64_t D, int64_t max_blocks, int64_t block_size, float scale,
                          float *scores, float *acc, float *lse) {
    const int64_t G = H / KVH;
    const int64_t row = KVH * D;              /* elements per slot */
    const int64_t n = ctx_lens[t];
    const int64_t *table = block_tables + t * max_blocks;
    const float *qt = q + t * H * D;

    /* scores[h][p]: a block's slots are contiguous, so the K pass and the V
     * pass each stream whole blocks through the cache once. */
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const int64_t base = table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        for (int64_t i = 0; i < m; i++) {
            for (int64_t h = h0; h < h1; h++) {
                const float *qh = qt + h * D;
                const int64_t at = base + i * row + (h / G) * D;
                float s;
                if (kv_bf16) {
                    s = baton_dot_bf16(qh, (const uint16_t *)k_cache + at, D);
                } else {
                    const float *kh = (const float *)k_cache + at;
                    s = 0.0f;
                    #pragma omp simd reduction(+:s)
                    for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                }
                scores[h * n + p0 + i] = s * scale;
            }
        }
    }
    softmax_rows(scores, n, h0, h1, lse);
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const int64_t base = table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        for (int64_t i = 0; i < m; i++) {
            for (int64_t h = h0; h < h1; h++) {
                const float w = scores[h * n + p0 + i];
                const int64_t at = base + i * row + (h / G) * D;
                float *ah = acc + h * D;
                if (kv_bf16) {
                    baton_axpy_bf16(w, (const uint16_t *)v_cache + at, ah, D);
                } else {
                    const float *vh = (const float *)v_cache + at;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) ah[d] += w * vh[d];
                }
            }
        }
    }
    memcpy(out + (t * H + h0) * D, acc + h0 * D, sizeof(float) * (h1 - h0) * D);
}

/* Decode attention of query row t over its first ctx_lens[t] positions, for
 * query heads h0..h1-1 (whole kv-head groups); the caches hold float32, or
 * bfloat16 when kv_bf16. Given the query in bf16 too (qb [T, H, D], exact
 * copies of q's values; or NULL), with AVX512_BF16 and a bf16 cache the
 * scores are bf16 dot products (on AMX tiles where baton_attention_amx
 * allows). scores: H * max_ctx floats (with qb, round_up(H, 16) *
 * round_up(max_ctx, 16)), acc: H * D floats, both owned by the calling
 * thread; each head's log-sum-exp into lse when it is not NULL. */
static void attention_task(const float *q, const uint16_t *qb, const void *k_cache,
                           const void *v_cache, int kv_bf16, const int64_t *block_tables,
                           const int64_t *ctx_lens, float *out, int64_t t, int64_t h0,
                           int64_t h1, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                           int64_t block_size, float scale, float *scores, float *acc,
                           float *lse) {
    float *lse_t = lse == NULL ? NULL : lse + t * H;
#ifdef BATON_AVX2
    if (D % 8 == 0) {
        const int64_t n = ctx_lens[t];
        const int64_t *table = block_tables + t * max_blocks;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (pv_fits(D))
            attention_task_avx512(q + t * H * D, qb == NULL ? NULL : qb + t * H * D, k_cache,
                                  v_cache, table, n, h0, h1, H / KVH, KVH, D, block_size,
                                  scale, scores, acc, lse_t, kv_bf16);
        else
#endif
        (kv_bf16 ? attention_task_grouped_bf16 : attention_task_grouped_f32)(
            q + t * H * D, k_cache, v_cache, table, n, h0, h1, H / KVH, KVH, D, block_size,
            scale, scores, acc, lse_t);
        memcpy(out + (t * H + h0) * D, acc + h0 * D, sizeof(float) * (h1 - h0) * D);
        return;
    }
#endif
    (void)qb;
    attention_task_generic(q, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, out, t, h0,
                           h1, H, KVH, D, max_blocks, block_size, scale, scores, acc, lse_t);
}

int baton_paged_decode_attention_f32(
        const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
        const int64_t *block_tables, const int64_t *ctx_lens, float *out, float *lse,
        int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads) {
    return baton_paged_decode_attention_qb(q, NULL, k_cache, v_cache, kv_bf16, block_tables,
                                           ctx_lens, out, lse, T, H, KVH, D, max_blocks,
                                           block_size, max_ctx, scale, num_threads);
}

/* Floats of a task's scores buffer for H heads and up to ctx positions:
 * head-major H x ctx, or scores_amx's position-major rows of
 * round_up(heads, 16) over round_up(ctx, 16) positions. */
static int64_t scores_floats(int64_t H, int64_t ctx) {
    if (ctx < 1) ctx = 1;
    return (H + 15) / 16 * 16 * ((ctx + 15) / 16 * 16);
}

/* Context chunks of at least this many positions, when few rows split
 * their contexts across the threads. */
#define BATON_MIN_CHUNK 128
#define BATON_MAX_CHUNKS 64

/* How many chunks each row's context is cut into: one with enough rows to
 * keep every thread busy (or one thread); with fewer, enough chunks for
 * about eight tasks per thread (a kv head's walk over a chunk each), none
 * shorter than BATON_MIN_CHUNK positions. */
static int64_t context_chunks(int64_t T, int64_t KVH, int64_t max_ctx, int num_threads) {
    if (num_threads < 2 || T >= 2 * (int64_t)num_threads) return 1;
    const int64_t want = (8 * (int64_t)num_threads + T * KVH - 1) / (T * KVH);
    int64_t most = max_ctx / BATON_MIN_CHUNK;
    most = most < BATON_MAX_CHUNKS ? most : BATON_MAX_CHUNKS;
    return want < most ? want : most;
}

/* out[t][h] (and lse[t][h]) from the row's chunks' partial results: each
 * chunk's softmax-weighted values and log-sum-exp, weighted by the share of
 * the whole softmax its scores hold. */
static void merge_chunks(const float *part, const float *part_lse, int64_t chunks,
                         int64_t chunk_len, const int64_t *ctx_lens, int64_t t, int64_t h,
                         int64_t H, int64_t D, float *out, float *lse) {
    const int64_t used = (ctx_lens[t] + chunk_len - 1) / chunk_len;
    const float *l = part_lse + t * chunks * H + h;
    float mx = l[0];
    for (int64_t c = 1; c < used; c++) mx = l[c * H] > mx ? l[c * H] : mx;
    float w[BATON_MAX_CHUNKS], sum = 0.0f;
    for (int64_t c = 0; c < used; c++) sum += w[c] = expf(l[c * H] - mx);
    float *o = out + (t * H + h) * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t c = 0; c < used; c++) {
        const float wc = w[c] / sum;
        const float *pc = part + ((t * chunks + c) * H + h) * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += wc * pc[d];
    }
    if (lse != NULL) lse[t * H + h] = mx + logf(sum);
}

/* baton_paged_decode_attention_qb's job, each row's context cut into
 * `chunks` pieces of whole blocks. */
static int split_context(const float *q, const uint16_t *qb, const void *k_cache,
                         const void *v_cache, int kv_bf16, const int64_t *block_tables,
                         const int64_t *ctx_lens, float *out, float *lse, int64_t T, int64_t H,
                         int64_t KVH, int64_t D, int64_t max_blocks, int64_t block_size,
                         int64_t max_ctx, float scale, int num_threads, int64_t chunks) {
    const int64_t chunk_blocks = ((max_ctx + chunks - 1) / chunks + block_size - 1) / block_size;
    const int64_t chunk_len = chunk_blocks * block_size;
    chunks = (max_ctx + chunk_len - 1) / chunk_len;
    const int64_t G = H / KVH;
    float *part = (float *)malloc(sizeof(float) * T * chunks * H * (D + 1));
    if (part == NULL) return 2;
    float *part_lse = part + T * chunks * H * D;
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * scores_floats(H, chunk_len));
        float *acc = (float *)malloc(sizeof(float) * H * D);
        if (scores == NULL || acc == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * chunks * KVH; task++) {
            const int64_t t = task / (chunks * KVH), c = task / KVH % chunks;
            const int64_t h0 = task % KVH * G;
            const int64_t start = c * chunk_len, n = ctx_lens[t] - start;
            if (scores == NULL || acc == NULL || n <= 0) continue;
            /* The chunk as a row of its own: the row's query, the table from
             * the chunk's first block, its length. */
            const int64_t len = n < chunk_len ? n : chunk_len;
            const int64_t rc = t * chunks + c;
            attention_task(q + t * H * D, qb == NULL ? NULL : qb + t * H * D, k_cache, v_cache,
                           kv_bf16, block_tables + t * max_blocks + c * chunk_blocks, &len,
                           part + rc * H * D, 0, h0, h0 + G, H, KVH, D, 0, block_size, scale,
                           scores, acc, part_lse + rc * H);
        }
        #pragma omp for
        for (int64_t th = 0; th < T * H; th++)
            if (!failed)
                merge_chunks(part, part_lse, chunks, chunk_len, ctx_lens, th / H, th % H, H, D,
                             out, lse);
        free(scores);
        free(acc);
    }
    free(part);
    return failed;
}

/* Tasks per row: one with two rows per thread or more; with fewer, the
 * row's kv heads in d groups, d the smallest divisor of KVH that gives the
 * threads equal numbers of tasks, else one task per kv head. A task walks
 * the context once for its heads, reading their bytes of each slot: a few
 * large runs stream faster than many small ones (SmolLM2-1.7B's shape, 32
 * kv heads, one row: 1.4x with two tasks of sixteen against 32 of one). */
static int64_t attention_splits(int64_t T, int64_t KVH, int num_threads) {
    if (num_threads < 2 || T >= 2 * (int64_t)num_threads) return 1;
    for (int64_t d = 1; d <= KVH; d++)
        if (KVH % d == 0 && T * d >= num_threads && T * d % num_threads == 0) return d;
    return KVH;
}

int baton_paged_decode_attention_qb(
        const float *q, const uint16_t *qb, const void *k_cache, const void *v_cache,
        int kv_bf16, const int64_t *block_tables, const int64_t *ctx_lens, float *out,
        float *lse, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads) {
    if (KVH < 1 || H % KVH != 0) return 1;
    /* One task per query row when there are enough rows; with few rows, one
     * task per (row, kv head), and with few rows and long contexts, per
     * (row, kv head, chunk of the context) whose partial results are merged
     * by their log-sum-exps (flash-decoding): every thread busy. */
    const int64_t splits = attention_splits(T, KVH, num_threads);
    const int64_t per_task = H / splits;
    int64_t chunks = context_chunks(T, KVH, max_ctx, num_threads);
    if (chunks > 1)
        return split_context(q, qb, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, out,
                             lse, T, H, KVH, D, max_blocks, block_size, max_ctx, scale,
                             num_threads, chunks);
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * scores_floats(H, max_ctx));
        float *acc = (float *)malloc(sizeof(float) * H * D);
        if (scores == NULL || acc == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * splits; task++) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t h0 = (task % splits) * per_task;
            attention_task(q, qb, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, out,
                           task / splits, h0, h0 + per_task, H, KVH, D, max_blocks,
                           block_size, scale, scores, acc, lse);
        }
        free(scores);
        free(acc);
    }
    return failed;
}

/* baton_attention_amx: mode 0 or 1 sets attention_amx_wanted (-1 leaves
 * it); answers whether scores now run on AMX tiles. */
int baton_attention_amx(int mode) {
#ifdef BATON_AMX
    if (mode >= 0) __atomic_store_n(&attention_amx_wanted, mode ? 1 : 0, __ATOMIC_RELEASE);
    return __atomic_load_n(&attention_amx_wanted, __ATOMIC_ACQUIRE) && baton_amx_bf16_ready();
#else
    (void)mode;
    (void)attention_amx_wanted;
    return 0;
#endif
}
