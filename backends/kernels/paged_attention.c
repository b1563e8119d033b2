/* Decode attention that reads the paged KV pool in place (CPU, float32
 * arithmetic; the pool holds float32 or bfloat16).
 *
 * One query token per row t attends to the first ctx_lens[t] positions of its
 * sequence, whose K/V live in the blocks listed in block_tables[t]. Nothing is
 * gathered: each (row, kv head) task walks the block table, scores the group
 * of query heads that share the kv head, takes a softmax over the scores and
 * accumulates V. Tasks run in parallel on the process's OpenMP pool (the same
 * libgomp torch uses, so no second set of threads competes for the cores).
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

/* Each head's scores[h][0..n) -> softmax weights, in place. */
static inline void softmax_rows(float *scores, int64_t n, int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; h++) {
        float *sh = scores + h * n;
        float mx = sh[0];
        for (int64_t p = 1; p < n; p++) mx = sh[p] > mx ? sh[p] : mx;
        const float sum = baton_exp_shifted_sum(sh, n, mx);
        const float inv = 1.0f / sum;
        #pragma omp simd
        for (int64_t p = 0; p < n; p++) sh[p] *= inv;
    }
}

#ifdef BATON_AVX2
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
static inline void attention_task_grouped(const float *qt, const void *k_cache,
                                          const void *v_cache, const int64_t *table,
                                          int64_t n, int64_t h0, int64_t h1, int64_t G,
                                          int64_t KVH, int64_t D, int64_t block_size,
                                          float scale, float *scores, float *acc,
                                          const int bf16) {
    const int64_t row = KVH * D;
    const int64_t g0 = h0 / G, g1 = h1 / G;
    int64_t b = 0, o = 0, p = 0;
    for (; p + 4 <= n; p += 4) {
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
    softmax_rows(scores, n, h0, h1);
    /* acc[h] += w[h][p] * V[p]: each V vector loaded (widened) once for the
     * G heads of its kv head; the accumulators (H * D floats) stay in L1. */
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
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

static void attention_task_grouped_f32(const float *qt, const void *k_cache,
                                       const void *v_cache, const int64_t *table, int64_t n,
                                       int64_t h0, int64_t h1, int64_t G, int64_t KVH,
                                       int64_t D, int64_t block_size, float scale,
                                       float *scores, float *acc) {
    attention_task_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size,
                           scale, scores, acc, 0);
}

static void attention_task_grouped_bf16(const float *qt, const void *k_cache,
                                        const void *v_cache, const int64_t *table, int64_t n,
                                        int64_t h0, int64_t h1, int64_t G, int64_t KVH,
                                        int64_t D, int64_t block_size, float scale,
                                        float *scores, float *acc) {
    attention_task_grouped(qt, k_cache, v_cache, table, n, h0, h1, G, KVH, D, block_size,
                           scale, scores, acc, 1);
}
#endif

static void attention_task_generic(const float *q, const void *k_cache, const void *v_cache,
                          int kv_bf16,
                          const int64_t *block_tables, const int64_t *ctx_lens, float *out,
                          int64_t t, int64_t h0, int64_t h1, int64_t H, int64_t KVH,
                          int64_t D, int64_t max_blocks, int64_t block_size, float scale,
                          float *scores, float *acc) {
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
    softmax_rows(scores, n, h0, h1);
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

void baton_attention_task(const float *q, const void *k_cache, const void *v_cache,
                          int kv_bf16,
                          const int64_t *block_tables, const int64_t *ctx_lens, float *out,
                          int64_t t, int64_t h0, int64_t h1, int64_t H, int64_t KVH,
                          int64_t D, int64_t max_blocks, int64_t block_size, float scale,
                          float *scores, float *acc) {
#ifdef BATON_AVX2
    if (D % 8 == 0) {
        const int64_t n = ctx_lens[t];
        const int64_t *table = block_tables + t * max_blocks;
        (kv_bf16 ? attention_task_grouped_bf16 : attention_task_grouped_f32)(
            q + t * H * D, k_cache, v_cache, table, n, h0, h1, H / KVH, KVH, D, block_size,
            scale, scores, acc);
        memcpy(out + (t * H + h0) * D, acc + h0 * D, sizeof(float) * (h1 - h0) * D);
        return;
    }
#endif
    attention_task_generic(q, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, out, t, h0,
                           h1, H, KVH, D, max_blocks, block_size, scale, scores, acc);
}

int baton_paged_decode_attention_f32(
        const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
        const int64_t *block_tables, const int64_t *ctx_lens, float *out,
        int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads) {
    if (KVH < 1 || H % KVH != 0) return 1;
    /* One task per query row when there are enough rows; with few rows, one
     * task per (row, kv head) keeps every thread busy. */
    const int64_t splits = T >= 2 * (int64_t)num_threads ? 1 : KVH;
    const int64_t per_task = H / splits;
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * H * (max_ctx > 0 ? max_ctx : 1));
        float *acc = (float *)malloc(sizeof(float) * H * D);
        if (scores == NULL || acc == NULL) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * splits; task++) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t h0 = (task % splits) * per_task;
            baton_attention_task(q, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, out,
                                 task / splits, h0, h0 + per_task, H, KVH, D, max_blocks,
                                 block_size, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
