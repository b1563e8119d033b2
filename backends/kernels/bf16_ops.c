/* The fused steps and decode attention for bfloat16 activations (CPUs with
 * native bf16 run the whole model in bf16). Each widens its bf16 inputs to
 * float32, computes in float32 as the float32 kernels do, and rounds once,
 * to nearest even, when it stores a bf16 result (torch's bf16 ops round after
 * every elementary op; these round once per fused step, so they are at least
 * as accurate).
 *
 *   rms_norm_bf16        [residual += delta (rounded);] out = w * bf16(rms_norm(residual)),
 *                        rounded in the reference's order (two roundings)
 *   silu_mul_bf16        out = silu(gate) * up
 *   qkv_rope_store_bf16  q/k norm, rotary, K/V into the cache (bf16 or f32), q out
 *   paged_decode_attention_bf16  q and out bf16; the cache bf16 or float32
 *
 * Norm weights, rotary tables and q/k norm weights are bf16 like the model.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define PAR_MIN_ELEMS 16384


/* One row of rms_norm_bf16: x and d (n floats of scratch), wf (the weight
 * widened), xr (n bf16 of scratch). Where the build has AVX512_BF16 the row
 * takes two passes over sixteen lanes at a time (the residual add, its
 * rounding and the widened copy; then the norm, its two roundings and the
 * weight), the same operations on each element as the pass-per-step code
 * below, which the other builds and the last n % 16 elements take. */
static inline void rms_norm_bf16_row(uint16_t *r, const uint16_t *delta, const float *wf,
                                     uint16_t *out, float *x, float *d, uint16_t *xr,
                                     int64_t n, float eps) {
    int64_t i0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    i0 = n / 16 * 16;
    for (int64_t i = 0; i < i0; i += 16) {
        __m512 v = baton_widen16(_mm256_loadu_si256((const __m256i *)(r + i)));
        if (delta != 0) {
            const __m256i h = baton_narrow16(_mm512_add_ps(
                v, baton_widen16(_mm256_loadu_si256((const __m256i *)(delta + i)))));
            _mm256_storeu_si256((__m256i *)(r + i), h);
            v = baton_widen16(h);
        }
        _mm512_storeu_ps(x + i, v);
    }
#endif
    const int64_t m = n - i0;
    if (m > 0) {
        float *xt = x + i0;
        baton_load_bf16(r + i0, xt, m);
        if (delta != 0) {
            baton_load_bf16(delta + i0, d, m);
            #pragma omp simd
            for (int64_t i = 0; i < m; i++) xt[i] += d[i];
            /* The residual stream stays bf16: round, and norm the rounded values. */
            baton_store_bf16(xt, r + i0, m);
            baton_load_bf16(r + i0, xt, m);
        }
    }
    const float inv = baton_inv_rms(x, n, eps);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < i0; i += 16) {
        /* The reference's order: the normed row is rounded to bf16 before
         * the weight multiplies it (then the product is rounded). Rounding
         * once instead is no less accurate, but it moves near-ties of the
         * greedy choice away from what transformers and the torch ops
         * pick in bf16. */
        const __m512 normed =
            baton_widen16(baton_narrow16(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv)));
        _mm256_storeu_si256((__m256i *)(out + i),
                            baton_narrow16(_mm512_mul_ps(normed, _mm512_loadu_ps(wf + i))));
    }
#endif
    if (m > 0) {
        float *xt = x + i0;
        #pragma omp simd
        for (int64_t i = 0; i < m; i++) xt[i] *= inv;
        baton_store_bf16(xt, xr, m);
        baton_load_bf16(xr, xt, m);
        #pragma omp simd
        for (int64_t i = 0; i < m; i++) xt[i] *= wf[i0 + i];
        baton_store_bf16(xt, out + i0, m);
    }
}

int baton_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *w,
                        uint16_t *out, int64_t T, int64_t n, float eps, int num_threads) {
    #pragma omp parallel num_threads(num_threads) if (T * n >= PAR_MIN_ELEMS)
    {
        /* x, delta and w widened, plus n bf16 values for the rounded norm */
        float *buf = (float *)malloc(sizeof(float) * 3 * n + sizeof(uint16_t) * n);
        float *x = buf, *d = buf + n, *wf = buf + 2 * n;
        uint16_t *xr = (uint16_t *)(buf + 3 * n);
        if (buf != NULL) baton_load_bf16(w, wf, n);
        #pragma omp for
        for (int64_t t = 0; t < T; t++) {
            if (buf == NULL) continue;
            rms_norm_bf16_row(residual + t * n, delta != 0 ? delta + t * n : 0, wf,
                              out + t * n, x, d, xr, n, eps);
        }
        free(buf);
    }
    return 0;
}

int baton_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I,
                        int num_threads) {
    #pragma omp parallel num_threads(num_threads) if (T * I >= PAR_MIN_ELEMS)
    {
        float *buf = (float *)malloc(sizeof(float) * 3 * I);
        #pragma omp for
        for (int64_t t = 0; t < T; t++) {
            if (buf == NULL) continue;
            const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
            uint16_t *o = out + t * I;
            int64_t i0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
            /* Straight from bf16 to bf16, sixteen lanes at a time: the
             * operations of baton_silu_mul_row's sixteen-lane loop. */
            i0 = I / 16 * 16;
            const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
            for (int64_t i = 0; i < i0; i += 16) {
                const __m512 gv = baton_widen16(_mm256_loadu_si256((const __m256i *)(g + i)));
                const __m512 e = baton_exp512(_mm512_sub_ps(zero, gv));
                _mm256_storeu_si256((__m256i *)(o + i), baton_narrow16(_mm512_mul_ps(
                    _mm512_div_ps(gv, _mm512_add_ps(one, e)),
                    baton_widen16(_mm256_loadu_si256((const __m256i *)(u + i))))));
            }
#endif
            const int64_t m = I - i0;
            if (m > 0) {
                baton_load_bf16(g + i0, buf, m);
                baton_load_bf16(u + i0, buf + I, m);
                baton_silu_mul_row(buf, buf + I, buf + 2 * I, m);
                baton_store_bf16(buf + 2 * I, o + i0, m);
            }
        }
        free(buf);
    }
    return 0;
}

int baton_qkv_rope_store_bf16(
        const uint16_t *qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
        const int64_t *positions, const uint16_t *cos_table, const uint16_t *sin_table,
        const uint16_t *q_norm, const uint16_t *k_norm, float eps,
        const int64_t *slot_mapping, void *k_cache, void *v_cache, int kv_bf16,
        uint16_t *q_out, int num_threads) {
    if (D > 1024) return 1;
    const int64_t width = (H + 2 * KVH) * D;
    float qn[1024], kn[1024];
    if (q_norm != 0) {
        baton_load_bf16(q_norm, qn, D);
        baton_load_bf16(k_norm, kn, D);
    }
    #pragma omp parallel num_threads(num_threads) if (T * width >= PAR_MIN_ELEMS)
    {
        /* the row, its q out, and the position's cos and sin rows */
        float *buf = (float *)malloc(sizeof(float) * (width + H * D + 2 * D));
        float *row = buf, *q = buf + width, *cs = q + H * D, *sn = cs + D;
        #pragma omp for
        for (int64_t t = 0; t < T; t++) {
            if (buf == NULL) continue;
            baton_load_bf16(qkv + t * width, row, width);
            baton_load_bf16(cos_table + positions[t] * D, cs, D);
            baton_load_bf16(sin_table + positions[t] * D, sn, D);
            baton_qkv_rope_store_row(row, H, KVH, D, 0, cs, sn, q_norm ? qn : 0,
                                     k_norm ? kn : 0, eps, slot_mapping[t], k_cache, v_cache,
                                     kv_bf16, q);
            baton_store_bf16(q, q_out + t * H * D, H * D);
        }
        free(buf);
    }
    return 0;
}

int baton_paged_decode_attention_f32(
        const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
        const int64_t *block_tables, const int64_t *ctx_lens, float *out, float *lse,
        int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads);

int baton_paged_decode_attention_bf16(
        const uint16_t *q, const void *k_cache, const void *v_cache, int kv_bf16,
        const int64_t *block_tables, const int64_t *ctx_lens, uint16_t *out, float *lse,
        int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads) {
    /* q and out are T * H * D values: small next to the cache the kernel reads. */
    float *buf = (float *)malloc(sizeof(float) * 2 * T * H * D);
    if (buf == NULL) return 2;
    baton_load_bf16(q, buf, T * H * D);
    const int rc = baton_paged_decode_attention_qb(
        buf, q, k_cache, v_cache, kv_bf16, block_tables, ctx_lens, buf + T * H * D, lse, T, H,
        KVH, D, max_blocks, block_size, max_ctx, scale, num_threads);
    if (rc == 0) baton_store_bf16(buf + T * H * D, out, T * H * D);
    free(buf);
    return rc;
}
