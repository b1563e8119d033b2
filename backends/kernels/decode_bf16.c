/* A whole decode step of a Llama/Qwen2/Qwen3 decoder in one call, for a few
 * sequences (1..BATON_GEMV_MAX_ROWS; up to BATON_WHOLE_STEP_AMX_ROWS where
 * the linears run on AMX tiles), with bfloat16 weights (kernels.h's tiled
 * layout), float32 arithmetic and activations, and a float32 or bfloat16 KV
 * cache.
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
 *
 * With act_bf16 (CPUs with native bf16 run the model in bf16) every
 * activation is rounded to a bf16 value where the layer-by-layer path stores
 * a bf16 tensor: the residual stream after each add, the norm (twice, in the
 * reference's order, as bf16_ops.c), each linear's output, q after rotary,
 * attention's output, silu(gate) * up. The step then computes what the bf16
 * kernels and oneDNN's bf16 linears compute, in another summation order;
 * builds for AVX512_BF16 multiply with VDPBF16PS (gemv_bf16.c), or, where
 * the plan gives decode batches to the AMX tile linear (amx), on AMX tiles
 * (baton_linear_amx_tiles, and above 16 rows baton_linear_amx_tiles_many:
 * a row's result is the tile linear's, bit for bit). Above
 * BATON_GEMV_MAX_ROWS rows (a c=32 step) the attention scores are bf16 dot
 * products of a bf16 copy of q (on AMX tiles), one task a row once there
 * are two rows a thread, as baton_paged_decode_attention_bf16 takes them.
 *
 * Norm weights and bias are passed as float32 (bf16 values widened, for
 * act_bf16); the rotary tables are the model's own, bf16 for act_bf16.
 * ops.cpp's baton::decode_step builds the model's description (kernels.h's
 * baton_model) from the tensors it is given.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* [x += delta;] out = rms_norm(x) * w, rounded as rms_norm_bf16 rounds. */
static inline void norm_row(const baton_model *m, float *x, const float *delta, const float *w,
                            float *out, int64_t n) {
    if (!m->act_bf16) {
        baton_rms_norm_row(x, delta, w, out, n, m->eps);
        return;
    }
    if (delta != 0) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) x[i] += delta[i];
        baton_round_bf16_row(x, n);
    }
    const float inv = baton_inv_rms(x, n, m->eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv;
    baton_round_bf16_row(out, n);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] *= w[i];
    baton_round_bf16_row(out, n);
}

/* Row t of a gemv's input: zero-padded float32 (xp), or, for bf16 activations
 * in a VDPBF16PS build, the row's bf16 values (xb, exact: the row holds bf16
 * values), zero-padded. */
static inline void gemv_input(const baton_model *m, const float *x, float *xp, uint16_t *xb,
                              int64_t K) {
#ifdef BATON_GEMV_DP
    if (m->act_bf16) {
        const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
        baton_store_bf16(x, xb, K);
        for (int64_t k = K; k < kp; k++) xb[k] = 0;
        return;
    }
#endif
    (void)m;
    (void)xb;
    baton_gemv_pad(x, xp, K);
}

/* y [M, N] = rows @ W^T (+ bias), from gemv_input's rows; worksharing
 * (xa: the many-row tile linear's packed rows, for more than 16 on AMX). */
static inline void gemv(const baton_model *m, const float *xp, const uint16_t *xb,
                        uint16_t *xa, const uint16_t *w, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K) {
    (void)xa;
#ifdef BATON_GEMV_DP
    if (m->act_bf16) {
#ifdef BATON_AMX
        if (m->amx && M > 16) {
            baton_linear_amx_tiles_many(xb, xa, w, bias, y, M, N, K);
            return;
        }
#endif
        if (m->amx) baton_linear_amx_tiles(xb, w, bias, y, M, N, K);
        else baton_gemv_tiles_bf16x(xb, w, bias, y, M, N, K);
        return;
    }
#endif
    (void)xb;
    baton_gemv_tiles(xp, w, bias, y, M, N, K, (int)m->act_bf16);
}

/* Rows a step may have: BATON_WHOLE_STEP_AMX_ROWS where the linears run on
 * AMX tiles (bf16 activations; the many-row tile linear above 16 rows, the
 * bf16 attention scores above BATON_GEMV_MAX_ROWS), else the gemv's. */
static int64_t decode_max_rows(const baton_model *m) {
#ifdef BATON_AMX
    if (m->amx && m->act_bf16) return BATON_WHOLE_STEP_AMX_ROWS;
#endif
    (void)m;
    return BATON_GEMV_MAX_ROWS;
}

int baton_decode_bf16(const baton_model *m, float *hidden, int64_t M,
                      const int64_t *positions, const int64_t *slot_mapping,
                      const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *ctx_lens, int64_t max_ctx, float *out, int num_threads) {
    if (M < 1 || M > decode_max_rows(m)) return 1;
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
    /* xb (bf16 input rows) takes half of n_xp floats */
    /* Above BATON_GEMV_MAX_ROWS: the query in bf16 (M * Q values) for the
     * attention's bf16 scores, and the many-row tile linear's packed rows
     * (xa: whole row blocks) */
    const int64_t wide = M > BATON_GEMV_MAX_ROWS;
    const int64_t n_xa = wide ? baton_round_up(M, 16) * max64(kp_h, max64(kp_q, kp_i)) : 0;
    const int64_t total = 2 * n_xp + n_x + M * NQKV + 2 * M * Q + M * Hd + 3 * M * I +
                          (wide ? (M * Q + n_xa) / 2 + 32 : 0);
    float *buf = (float *)malloc(sizeof(float) * total);
    if (buf == NULL) return 2;
    float *xp = buf, *x = xp + n_xp, *qkv = x + n_x, *q = qkv + M * NQKV, *attn = q + M * Q;
    float *delta = attn + M * Q, *gu = delta + M * Hd, *act = gu + 2 * M * I;
    uint16_t *xb = (uint16_t *)(act + M * I);
    /* after xb (n_xp floats' room, half of it used): qb, then xa 64-byte aligned */
    uint16_t *qb = (uint16_t *)(act + M * I + n_xp);
    uint16_t *xa = wide ? (uint16_t *)(((uintptr_t)(qb + M * Q) + 63) & ~(uintptr_t)63) : NULL;
    const int rb = (int)m->act_bf16;
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        /* the bf16 scores (wide steps) take rows of round_up(H, 16) over
         * round_up(max_ctx, 16) positions */
        const int64_t ctx = max_ctx > 0 ? max_ctx : 1;
        float *scores = (float *)malloc(sizeof(float) * (wide ? (H + 15) / 16 * 16 *
                                                         baton_round_up(ctx, 16) : H * ctx));
        const int64_t nt = omp_get_num_threads();
        float *acc = (float *)malloc(sizeof(float) * (H * D + 2 * D));
        float *rope = acc + H * D;  /* a position's cos and sin rows, widened (act_bf16) */
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
                norm_row(m, hidden + t * Hd, l ? delta + t * Hd : 0, ly->input_norm,
                         x + t * Hd, Hd);
                gemv_input(m, x + t * Hd, xp + t * kp_h, xb + t * kp_h, Hd);
            }
            gemv(m, xp, xb, xa, ly->qkv_w, ly->qkv_bias, qkv, M, NQKV, Hd);

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                if (!ok) continue;
                const float *cs = (const float *)m->cos_table, *sn = (const float *)m->sin_table;
                int64_t pos = positions[t];
                if (rb) {
                    baton_load_bf16((const uint16_t *)m->cos_table + pos * D, rope, D);
                    baton_load_bf16((const uint16_t *)m->sin_table + pos * D, rope + D, D);
                    cs = rope;
                    sn = rope + D;
                    pos = 0;
                }
                baton_qkv_rope_store_row(qkv + t * NQKV, H, KVH, D, pos, cs, sn, ly->q_norm,
                                         ly->k_norm, eps, slot_mapping[t], ly->k_cache,
                                         ly->v_cache, (int)m->kv_bf16, q + t * Q);
                if (rb) baton_round_bf16_row(q + t * Q, Q);
            }

            /* The layer path's tasks (baton_attention_splits): whole rows
             * once there are two rows per thread, else groups of kv heads
             * that keep every thread busy. A wide step (more rows than the
             * gemv's) scores in bf16 from a bf16 copy of q (exact: q holds
             * bf16 values). */
            if (wide) {
                #pragma omp for
                for (int64_t t = 0; t < M; t++) baton_store_bf16(q + t * Q, qb + t * Q, Q);
            }
            const int64_t splits = baton_attention_splits(M, KVH, (int)nt), per = H / splits;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < M * splits; task++) {
                if (!ok) continue;
                const int64_t h0 = (task % splits) * per;
                baton_attention_task_qb(q, wide ? qb : NULL, ly->k_cache, ly->v_cache,
                                        (int)m->kv_bf16, block_tables, ctx_lens,
                                        attn, task / splits, h0, h0 + per, H, KVH, D,
                                        max_blocks, m->block_size, m->scale, scores, acc);
            }

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                if (rb) baton_round_bf16_row(attn + t * Q, Q);
                gemv_input(m, attn + t * Q, xp + t * kp_q, xb + t * kp_q, Q);
            }
            gemv(m, xp, xb, xa, ly->o_w, 0, delta, M, Hd, Q);

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                norm_row(m, hidden + t * Hd, delta + t * Hd, ly->post_norm, x + t * Hd, Hd);
                gemv_input(m, x + t * Hd, xp + t * kp_h, xb + t * kp_h, Hd);
            }
            gemv(m, xp, xb, xa, ly->gate_up_w, 0, gu, M, 2 * I, Hd);

            #pragma omp for
            for (int64_t t = 0; t < M; t++) {
                baton_silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
                if (rb) baton_round_bf16_row(act + t * I, I);
                gemv_input(m, act + t * I, xp + t * kp_i, xb + t * kp_i, I);
            }
            gemv(m, xp, xb, xa, ly->down_w, 0, delta, M, Hd, I);
        }
        #pragma omp for
        for (int64_t t = 0; t < M; t++)
            norm_row(m, hidden + t * Hd, m->num_layers ? delta + t * Hd : 0, m->final_norm,
                     out + t * Hd, Hd);
        free(scores);
        free(acc);
    }
    free(buf);
    return failed;
}
