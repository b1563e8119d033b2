/* A whole decode step of a Llama/Qwen2/Qwen3 decoder in one call, for a few
 * sequences (1..BATON_GEMV_MAX_ROWS), with bfloat16 weights (kernels.h's
 * tiled layout), float32 arithmetic and activations, and a float32 or
 * bfloat16 KV cache.
 *
 * Decoding one sequence is bound by reading the weights: ~270 MB for
 * SmolLM2-135M in bf16, ~10 ms at this class of machine's memory bandwidth.
 * Driven layer by layer from Python the same step costs ~300 calls (norm,
 * four matmuls, rope/store, attention, silu per layer), each with its own
 * interpreter, ctypes and OpenMP fork/join overhead, several milliseconds in
 * all. Here the step runs in one OpenMP parallel region: phases are
 * worksharing loops separated by barriers.
 *
 * Per layer, for each row t (the residual stream `hidden` updated in place):
 *   x      = rms_norm(hidden [+ previous delta]) * input_norm
 *   qkv    = x @ Wqkv^T (+ bias)
 *   q      = rope(q_norm(q)); k, v -> cache slot (rope(k_norm(k)), v)
 *   attn   = paged decode attention of q over the sequence's blocks
 *   hidden += attn @ Wo^T
 *   x      = rms_norm(hidden) * post_norm
 *   delta  = (silu(x @ Wgate^T) * (x @ Wup^T)) @ Wdown^T
 * and at the end out = rms_norm(hidden + delta) * final_norm.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const float *input_norm, *post_norm, *qkv_bias, *q_norm, *k_norm;  /* bias, q/k norms may be NULL */
    const uint16_t *qkv_w, *o_w, *gate_up_w, *down_w;                   /* tiled bf16 */
    void *k_cache, *v_cache;                     /* [slots, KVH, D], float32 or bf16 */
} baton_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t kv_bf16;                                                    /* cache dtype */
    float eps, scale;
    const float *cos_table, *sin_table, *final_norm;
    const baton_layer *layers;
} baton_model;

/* The caller's mirror of the two structs (ctypes) checks its sizes here. */
int baton_decode_bf16_struct_sizes(int64_t *layer, int64_t *model) {
    *layer = (int64_t)sizeof(baton_layer);
    *model = (int64_t)sizeof(baton_model);
    return 0;
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

int baton_decode_bf16(const baton_model *m, float *hidden, int64_t M,
                      const int64_t *positions, const int64_t *slot_mapping,
                      const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *ctx_lens, int64_t max_ctx, float *out, int num_threads) {
    if (M < 1 || M > BATON_GEMV_MAX_ROWS) return 1;
    if (m->num_kv_heads < 1 || m->num_heads % m->num_kv_heads != 0 || m->head_dim > 1024)
        return 1;
    const int64_t Hd = m->hidden, H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim;
    const int64_t I = m->intermediate, Q = H * D, NQKV = (H + 2 * KVH) * D;
    const float eps = m->eps;
    const int64_t kp_h = baton_round_up(Hd, BATON_GEMV_TILE_COLS);
    const int64_t kp_q = baton_round_up(Q, BATON_GEMV_TILE_COLS);
    const int64_t kp_i = baton_round_up(I, BATON_GEMV_TILE_COLS);

    /* Scratch for the step, one allocation. */
    const int64_t n_xp = M * max64(kp_h, max64(kp_q, kp_i));
    const int64_t n_x = M * max64(Hd, Q);
    const int64_t total = n_xp + n_x + M * NQKV + 2 * M * Q + M * Hd + 3 * M * I;
    float *buf = (float *)malloc(sizeof(float) * total);
    if (buf == NULL) return 2;
    float *xp = buf, *x = xp + n_xp, *qkv = x + n_x, *q = qkv + M * NQKV, *attn = q + M * Q;
    float *delta = attn + M * Q, *gu = delta + M * Hd, *act = gu + 2 * M * I;
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * H * (max_ctx > 0 ? max_ctx : 1));
        float *acc = (float *)malloc(sizeof(float) * H * D);
        int ok = scores != NULL && acc != NULL;
        if (!ok) {
            #pragma omp atomic write
            failed = 2;
        }
        #pragma omp barrier
        for (int64_t l = 0; l < m->num_layers && !failed; l++) {
            const baton_layer *ly = m->layers + l;

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                baton_rms_norm_row(hidden + t * Hd, l ? delta + t * Hd : 0, ly->input_norm,
                                   x + t * Hd, Hd, eps);
                baton_gemv_permute(x + t * Hd, xp + t * kp_h, Hd);
            }
            baton_gemv_tiles(xp, ly->qkv_w, ly->qkv_bias, qkv, M, NQKV, Hd);

            #pragma omp for
            for (int64_t t = 0; t < M; t++)
                baton_qkv_rope_store_row(qkv + t * NQKV, H, KVH, D, positions[t],
                                         m->cos_table, m->sin_table, ly->q_norm, ly->k_norm,
                                         eps, slot_mapping[t], ly->k_cache, ly->v_cache,
                                         (int)m->kv_bf16, q + t * Q);

            /* One task per (row, kv head): with one row, every thread works. */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < M * KVH; task++) {
                if (!ok) continue;
                const int64_t h0 = (task % KVH) * (H / KVH);
                baton_attention_task(q, ly->k_cache, ly->v_cache, (int)m->kv_bf16,
                                     block_tables, ctx_lens,
                                     attn, task / KVH, h0, h0 + H / KVH, H, KVH, D,
                                     max_blocks, m->block_size, m->scale, scores, acc);
            }

            #pragma omp for
            for (int64_t t = 0; t < M; t++) baton_gemv_permute(attn + t * Q, xp + t * kp_q, Q);
            baton_gemv_tiles(xp, ly->o_w, 0, delta, M, Hd, Q);

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                baton_rms_norm_row(hidden + t * Hd, delta + t * Hd, ly->post_norm, x + t * Hd,
                                   Hd, eps);
                baton_gemv_permute(x + t * Hd, xp + t * kp_h, Hd);
            }
            baton_gemv_tiles(xp, ly->gate_up_w, 0, gu, M, 2 * I, Hd);

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                baton_silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
                baton_gemv_permute(act + t * I, xp + t * kp_i, I);
            }
            baton_gemv_tiles(xp, ly->down_w, 0, delta, M, Hd, I);
        }
        #pragma omp for
        for (int64_t t = 0; t < M; t++)
            baton_rms_norm_row(hidden + t * Hd, m->num_layers ? delta + t * Hd : 0,
                               m->final_norm, out + t * Hd, Hd, eps);
        free(scores);
        free(acc);
    }
    free(buf);
    return failed;
}
