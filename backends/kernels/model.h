/* A model as the whole-step decode (decode_bf16.c) takes it: plain C
 * types, shared with ops.cpp, whose baton::decode_step fills them from the
 * tensors it is given. */
#ifndef BATON_MODEL_H
#define BATON_MODEL_H

#include <stdint.h>

typedef struct {
    const float *input_norm, *post_norm, *qkv_bias, *q_norm, *k_norm;  /* bias, q/k norms may be NULL */
    const uint16_t *qkv_w, *o_w, *gate_up_w, *down_w;  /* tiled bf16 */
    void *k_cache, *v_cache;                     /* [slots, KVH, D], float32 or bf16 */
} baton_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t kv_bf16;                                                    /* cache dtype */
    int64_t act_bf16;                               /* activations rounded to bf16 */
    float eps, scale;
    const void *cos_table, *sin_table;    /* [positions, D]: float32, bf16 for act_bf16 */
    const float *final_norm;
    const baton_layer *layers;
    /* 1: the bf16 linears (act_bf16) on AMX tiles (baton_linear_amx_tiles);
     * the caller has checked that this CPU and process may use them. */
    int64_t amx;
} baton_model;

#endif
