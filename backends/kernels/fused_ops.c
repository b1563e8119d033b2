/* Fused elementwise steps of a decoder layer (CPU, float32).
 *
 * In eager torch each of these is five to twenty small operators, and at
 * decode batch sizes the per-operator dispatch costs more than the arithmetic.
 * Each function here is one call:
 *   rms_norm        [residual += delta;] out = rms_norm(residual) * w
 *   silu_mul        out = silu(gate) * up, gate_up = [T, 2 * I]
 *   qkv_rope_store  per-head q/k RMSNorm (Qwen3, optional), rotary embedding
 *                   (rotate-half layout), K/V written into their cache slots
 *                   (float32 or bfloat16 caches), rotated q written out.
 * Row-parallel on the process's OpenMP pool (torch's libgomp).
 */
#include "kernels.h"

/* Rows of work below which a parallel region costs more than it saves. */
#define PAR_MIN_ELEMS 16384

int baton_rms_norm_f32(float *residual, const float *delta, const float *w, float *out,
                       int64_t T, int64_t n, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * n >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++)
        baton_rms_norm_row(residual + t * n, delta ? delta + t * n : 0, w, out + t * n, n, eps);
    return 0;
}

int baton_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I,
                       int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++)
        baton_silu_mul_row(gate_up + t * 2 * I, gate_up + t * 2 * I + I, out + t * I, I);
    return 0;
}

static inline void rope_row(const float *x, float *dst, const float *cos_p, const float *sin_p,
                            int64_t D) {
    const int64_t half = D / 2;
    #pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        dst[i] = a * cos_p[i] - b * sin_p[i];
        dst[i + half] = b * cos_p[i + half] + a * sin_p[i + half];
    }
}

void baton_qkv_rope_store_row(const float *row, int64_t H, int64_t KVH, int64_t D,
                              int64_t position, const float *cos_table,
                              const float *sin_table, const float *q_norm,
                              const float *k_norm, float eps, int64_t slot,
                              void *k_cache, void *v_cache, int kv_bf16, float *q_out) {
    const float *cos_p = cos_table + position * D;
    const float *sin_p = sin_table + position * D;
    float tmp[1024], rot[1024];
    for (int64_t h = 0; h < H + KVH; h++) {
        const float *x = row + h * D;
        const float *nw = h < H ? q_norm : k_norm;
        if (nw != 0) {
            const float inv = baton_inv_rms(x, D, eps);
            for (int64_t i = 0; i < D; i++) tmp[i] = nw[i] * (x[i] * inv);
            x = tmp;
        }
        if (h < H) {
            rope_row(x, q_out + h * D, cos_p, sin_p, D);
        } else if (kv_bf16) {
            rope_row(x, rot, cos_p, sin_p, D);
            baton_store_bf16(rot, (uint16_t *)k_cache + (slot * KVH + (h - H)) * D, D);
        } else {
            rope_row(x, (float *)k_cache + (slot * KVH + (h - H)) * D, cos_p, sin_p, D);
        }
    }
    const float *v = row + (H + KVH) * D;
    if (kv_bf16) {
        baton_store_bf16(v, (uint16_t *)v_cache + slot * KVH * D, KVH * D);
    } else {
        float *vdst = (float *)v_cache + slot * KVH * D;
        for (int64_t i = 0; i < KVH * D; i++) vdst[i] = v[i];
    }
}

int baton_qkv_rope_store_f32(
        const float *qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
        const int64_t *positions, const float *cos_table, const float *sin_table,
        const float *q_norm, const float *k_norm, float eps,
        const int64_t *slot_mapping, void *k_cache, void *v_cache, int kv_bf16, float *q_out,
        int num_threads) {
    if (D > 1024) return 1;
    const int64_t width = (H + 2 * KVH) * D;
    #pragma omp parallel for num_threads(num_threads) if (T * width >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++)
        baton_qkv_rope_store_row(qkv + t * width, H, KVH, D, positions[t], cos_table,
                                 sin_table, q_norm, k_norm, eps, slot_mapping[t], k_cache,
                                 v_cache, kv_bf16, q_out + t * H * D);
    return 0;
}
