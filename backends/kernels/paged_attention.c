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
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t p = 0; p < n; p++) {
            const float e = expf(sh[p] - mx);
            sh[p] = e;
            sum += e;
        }
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

/* [sum(a0), sum(a1), ..., sum(a7)] */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* acc[0..8*NV) += sum over positions of w[p] * v[p][d0..d0+8*NV), the
 * accumulators in registers; called with a literal NV. */
#define DEFINE_PV_CHUNK(NAME, LOAD)                                                    \
static inline void NAME(const float *w, const void *v_cache, const int64_t *table,     \
                        int64_t n, int64_t block_size, int64_t row, int64_t off,       \
                        float *acc, const int NV) {                                    \
    __m256 a[8];                                                                       \
    for (int v = 0; v < NV; v++) a[v] = _mm256_setzero_ps();                           \
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {                                   \
        const int64_t base = table[p0 / block_size] * block_size * row + off;          \
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;               \
        for (int64_t i = 0; i < m; i++) {                                              \
            const __m256 wv = _mm256_set1_ps(w[p0 + i]);                               \
            for (int v = 0; v < NV; v++)                                               \
                a[v] = _mm256_fmadd_ps(wv, LOAD(v_cache, base + i * row + 8 * v), a[v]); \
        }                                                                              \
    }                                                                                  \
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(acc + 8 * v, a[v]);                  \
}

/* The task with D a multiple of 8. Scores: eight positions at a time per
 * head, eight independent FMA chains (one dot product at a time would wait
 * on each FMA's latency), reduced together. Values: each head's output in
 * registers while the positions stream by. */
#define DEFINE_ATTENTION_TASK(NAME, LOAD, PV)                                          \
DEFINE_PV_CHUNK(PV, LOAD)                                                              \
static void NAME(const float *qt, const void *k_cache, const void *v_cache,            \
                 const int64_t *table, int64_t n, int64_t h0, int64_t h1, int64_t G,   \
                 int64_t KVH, int64_t D, int64_t block_size, float scale,              \
                 float *scores, float *acc) {                                          \
    const int64_t row = KVH * D;                                                       \
    const __m256 sv = _mm256_set1_ps(scale);                                           \
    for (int64_t h = h0; h < h1; h++) {                                                \
        const float *qh = qt + h * D;                                                  \
        const int64_t koff = (h / G) * D;                                              \
        float *sh = scores + h * n;                                                    \
        int64_t b = 0, o = 0;                 /* block index and offset of p */        \
        int64_t p = 0;                                                                 \
        for (; p + 8 <= n; p += 8) {                                                   \
            int64_t at[8];                                                             \
            for (int j = 0; j < 8; j++) {                                              \
                at[j] = (table[b] * block_size + o) * row + koff;                      \
                if (++o == block_size) { o = 0; b++; }                                 \
            }                                                                          \
            __m256 a[8];                                                               \
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();                    \
            for (int64_t d = 0; d < D; d += 8) {                                       \
                const __m256 qv = _mm256_loadu_ps(qh + d);                             \
                for (int j = 0; j < 8; j++)                                            \
                    a[j] = _mm256_fmadd_ps(LOAD(k_cache, at[j] + d), qv, a[j]);        \
            }                                                                          \
            _mm256_storeu_ps(sh + p, _mm256_mul_ps(hsum8x8(a), sv));                   \
        }                                                                              \
        for (; p < n; p++) {                                                           \
            const int64_t at = (table[b] * block_size + o) * row + koff;               \
            if (++o == block_size) { o = 0; b++; }                                     \
            __m256 a = _mm256_setzero_ps();                                            \
            for (int64_t d = 0; d < D; d += 8)                                         \
                a = _mm256_fmadd_ps(LOAD(k_cache, at + d), _mm256_loadu_ps(qh + d), a); \
            __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); \
            r = _mm_add_ps(r, _mm_movehl_ps(r, r));                                    \
            r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));                                \
            sh[p] = _mm_cvtss_f32(r) * scale;                                          \
        }                                                                              \
    }                                                                                  \
    softmax_rows(scores, n, h0, h1);                                                   \
    for (int64_t h = h0; h < h1; h++) {                                                \
        const float *w = scores + h * n;                                               \
        const int64_t voff = (h / G) * D;                                              \
        int64_t d0 = 0;                                                                \
        for (; d0 + 64 <= D; d0 += 64)                                                 \
            PV(w, v_cache, table, n, block_size, row, voff + d0, acc + h * D + d0, 8); \
        for (; d0 + 32 <= D; d0 += 32)                                                 \
            PV(w, v_cache, table, n, block_size, row, voff + d0, acc + h * D + d0, 4); \
        for (; d0 < D; d0 += 8)                                                        \
            PV(w, v_cache, table, n, block_size, row, voff + d0, acc + h * D + d0, 1); \
    }                                                                                  \
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

#ifdef BATON_AVX2
DEFINE_ATTENTION_TASK(attention_task_f32, load8_f32, pv_chunk_f32)
DEFINE_ATTENTION_TASK(attention_task_bf16, load8_bf16, pv_chunk_bf16)
#endif

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
        (kv_bf16 ? attention_task_bf16 : attention_task_f32)(
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
