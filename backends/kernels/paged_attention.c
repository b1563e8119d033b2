/* Decode attention that reads the paged KV pool in place (CPU, float32).
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
 *   k_cache, v_cache  [num_slots, KVH, D], slot = block * block_size + offset
 *   block_tables      [T, max_blocks]  (int64)
 *   ctx_lens          [T]              (int64, >= 1)
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

void baton_attention_task(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *ctx_lens, float *out,
                          int64_t t, int64_t h0, int64_t h1, int64_t H, int64_t KVH,
                          int64_t D, int64_t max_blocks, int64_t block_size, float scale,
                          float *scores, float *acc) {
    const int64_t G = H / KVH;
    const int64_t row = KVH * D;              /* floats per slot */
    const int64_t n = ctx_lens[t];
    const int64_t *table = block_tables + t * max_blocks;
    const float *qt = q + t * H * D;

    /* scores[h][p]: a block's slots are contiguous, so the K pass and the V
     * pass each stream whole blocks through the cache once. */
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const float *kb = k_cache + table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        for (int64_t i = 0; i < m; i++) {
            const float *kp = kb + i * row;
            for (int64_t h = h0; h < h1; h++) {
                const float *qh = qt + h * D;
                const float *kh = kp + (h / G) * D;
                float s = 0.0f;
                #pragma omp simd reduction(+:s)
                for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                scores[h * n + p0 + i] = s * scale;
            }
        }
    }
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
    memset(acc + h0 * D, 0, sizeof(float) * (h1 - h0) * D);
    for (int64_t p0 = 0; p0 < n; p0 += block_size) {
        const float *vb = v_cache + table[p0 / block_size] * block_size * row;
        const int64_t m = (n - p0) < block_size ? (n - p0) : block_size;
        for (int64_t i = 0; i < m; i++) {
            const float *vp = vb + i * row;
            for (int64_t h = h0; h < h1; h++) {
                const float w = scores[h * n + p0 + i];
                const float *vh = vp + (h / G) * D;
                float *ah = acc + h * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) ah[d] += w * vh[d];
            }
        }
    }
    memcpy(out + (t * H + h0) * D, acc + h0 * D, sizeof(float) * (h1 - h0) * D);
}

int baton_paged_decode_attention_f32(
        const float *q, const float *k_cache, const float *v_cache,
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
            baton_attention_task(q, k_cache, v_cache, block_tables, ctx_lens, out,
                                 task / splits, h0, h0 + per_task, H, KVH, D, max_blocks,
                                 block_size, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
