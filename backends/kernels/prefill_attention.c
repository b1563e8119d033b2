/* Causal prefill attention over the paged KV pool on AMX tiles (bf16 query
 * and cache, float32 scores and softmax), the path a prefill chunk takes
 * where baton_amx_bf16_ready() says the CPU and the OS allow tiles; torch's
 * SDPA (flash attention) stays the path everywhere else.
 *
 * A segment is one request's chunk: query rows [row0, row1) of q, at
 * positions start, start + 1, ... of its sequence, whose K/V (the cached
 * prefix and the chunk itself, already stored) live in the blocks of its
 * table. Query i attends to positions 0 .. start + i.
 *
 * Two phases in one OpenMP region:
 * 1. for each (segment, kv head), its keys and values are packed once into
 *    AMX's B operand: K as [16 keys x 32 dims] pieces of dim pairs
 *    (kt: TDPBF16PS's B for q . k), V as [32 keys x 16 dims] pieces of key
 *    pairs (vt: B for p . v); positions past the segment's last are zeros;
 * 2. for each (segment, kv head, block of 16 query rows), each query head
 *    of the group: scores S = Q K^T on tiles (float32), the causal softmax
 *    per row in float32 (exp of scale * (s - max)), the weights rounded to
 *    bf16 as P, O = P V on tiles (float32), O / sum rounded once to bf16.
 *
 * Products of bf16 values are exact in float32 and summed in float32, in
 * another order than torch's flash attention; P in bf16 as flash attention
 * takes it for its second product. A query row's result depends on its own
 * query and keys alone (the key blocks in one order): the same bits whichever
 * other rows share the call, so a prompt computes the same attention in one
 * chunk or many (prefix caching).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef BATON_AMX
#include <immintrin.h>
#include <omp.h>

/* Element offset of position p's slot (kv head g) in a [slots, KVH, D] pool. */
static inline int64_t slot_at(const int64_t *blocks, int64_t block_size, int64_t p,
                              int64_t KVH, int64_t D, int64_t g) {
    return ((blocks[p / block_size] * block_size + p % block_size) * KVH + g) * D;
}

/* kt[j][x]: B tile of keys 16j .. 16j + 15, dims 32x .. 32x + 31: dword
 * [dp][n] = key n's dims (2dp, 2dp + 1). Keys >= npos are zeros. */
static void pack_keys(const uint16_t *k_cache, const int64_t *blocks, int64_t block_size,
                      int64_t KVH, int64_t D, int64_t g, int64_t npos, int64_t groups,
                      uint32_t *kt) {
    const int64_t pieces = D / 32;
    for (int64_t j = 0; j < groups; j++) {
        uint32_t *dst = kt + j * pieces * 256;
        for (int64_t n = 0; n < 16; n++) {
            const int64_t p = 16 * j + n;
            if (p >= npos) {
                for (int64_t x = 0; x < pieces; x++)
                    for (int dp = 0; dp < 16; dp++) dst[x * 256 + dp * 16 + n] = 0;
                continue;
            }
            const uint32_t *src =
                (const uint32_t *)(k_cache + slot_at(blocks, block_size, p, KVH, D, g));
            for (int64_t x = 0; x < pieces; x++)
                for (int dp = 0; dp < 16; dp++) dst[x * 256 + dp * 16 + n] = src[16 * x + dp];
        }
    }
}

/* vt[s][c]: B tile of keys 32s .. 32s + 31, dims 16c .. 16c + 15: dword
 * [kp][n] = dim 16c + n of keys 32s + 2kp (low half) and 32s + 2kp + 1
 * (high half). Keys >= npos are zeros. */
static void pack_values(const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                        int64_t KVH, int64_t D, int64_t g, int64_t npos, int64_t steps,
                        uint32_t *vt) {
    const int64_t dgroups = D / 16;
    for (int64_t s = 0; s < steps; s++)
        for (int64_t kp = 0; kp < 16; kp++) {
            const int64_t p = 32 * s + 2 * kp;
            const uint16_t *a = p < npos ? v_cache + slot_at(blocks, block_size, p, KVH, D, g)
                                         : NULL;
            const uint16_t *b = p + 1 < npos
                                    ? v_cache + slot_at(blocks, block_size, p + 1, KVH, D, g)
                                    : NULL;
            for (int64_t d = 0; d < D; d++) {
                const uint32_t lo = a ? a[d] : 0, hi = b ? b[d] : 0;
                vt[((s * dgroups + d / 16) * 16 + kp) * 16 + d % 16] = lo | hi << 16;
            }
        }
}

/* The tiles as every step here uses them: 16 rows of 64 bytes. A constant
 * in memory: built on the stack in a small function, GCC 12 dropped the
 * stores of rows and colsb before LDTILECFG as dead (an invalid
 * configuration, and a fault). */
static const baton_amx_config tiles16 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

BATON_AMX_TARGET static void config_tiles(void) { _tile_loadconfig(&tiles16); }

BATON_AMX_TARGET static void release_tiles(void) { _tile_release(); }

/* Scratch of one thread: the query block, scores, weights, values. */
typedef struct {
    uint16_t *qb;   /* [16][D] bf16 */
    float *S;       /* [16][keys32] */
    uint16_t *P;    /* [16][keys32] bf16 */
    float *O;       /* [16][D] */
} prefill_scratch;

/* One query head h, query rows t0 .. t0 + m - 1 of a segment (positions
 * start + t0 + i), keys 0 .. start + t0 + m - 1 from kt / vt. */
BATON_AMX_TARGET static void query_block(const uint16_t *q, int64_t row0, int64_t t0,
                                         int64_t m, int64_t start, int64_t h, int64_t H,
                                         int64_t D, const uint32_t *kt, const uint32_t *vt,
                                         float scale, prefill_scratch *w, uint16_t *out) {
    const int64_t last = start + t0 + m;             /* keys the block needs */
    const int64_t groups = (last + 15) / 16, steps = (last + 31) / 32;
    const int64_t ld = 32 * steps, pieces = D / 32, dgroups = D / 16;
    memset(w->qb, 0, sizeof(uint16_t) * 16 * D);
    for (int64_t i = 0; i < m; i++)
        memcpy(w->qb + i * D, q + ((row0 + t0 + i) * H + h) * D, sizeof(uint16_t) * D);
    /* S = Q K^T, 16 keys at a time; the query's pieces stay in tiles 4.. */
    for (int64_t x = 0; x < pieces; x++) {
        switch (x) {
        case 0: _tile_loadd(4, w->qb, D * 2); break;
        case 1: _tile_loadd(5, w->qb + 32, D * 2); break;
        case 2: _tile_loadd(6, w->qb + 64, D * 2); break;
        default: _tile_loadd(7, w->qb + 96, D * 2); break;
        }
    }
    /* two groups of keys at a time (C tiles 0 and 1, their B tiles 2 and
     * 3): two independent chains of products in flight */
    for (int64_t j = 0; j < groups; j += 2) {
        const int two = j + 1 < groups;
        const uint32_t *k0 = kt + j * pieces * 256, *k1 = k0 + pieces * 256;
        _tile_zero(0);
        if (two) _tile_zero(1);
        for (int64_t x = 0; x < pieces; x++) {
            _tile_loadd(2, k0 + x * 256, 64);
            if (two) _tile_loadd(3, k1 + x * 256, 64);
            switch (x) {
            case 0: _tile_dpbf16ps(0, 4, 2); if (two) _tile_dpbf16ps(1, 4, 3); break;
            case 1: _tile_dpbf16ps(0, 5, 2); if (two) _tile_dpbf16ps(1, 5, 3); break;
            case 2: _tile_dpbf16ps(0, 6, 2); if (two) _tile_dpbf16ps(1, 6, 3); break;
            default: _tile_dpbf16ps(0, 7, 2); if (two) _tile_dpbf16ps(1, 7, 3); break;
            }
        }
        _tile_stored(0, w->S + 16 * j, ld * 4);
        if (two) _tile_stored(1, w->S + 16 * (j + 1), ld * 4);
    }
    /* causal softmax per row: weights of keys 0 .. start + t0 + i, zero after */
    float inv[16];
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < 16; i++) {
        uint16_t *p = w->P + i * ld;
        if (i >= m) {
            memset(p, 0, sizeof(uint16_t) * ld);
            continue;
        }
        const float *s = w->S + i * ld;
        const int64_t n = start + t0 + i + 1;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t k = 0; k < n; k += 16) {
            const __mmask16 km = n - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - k)) - 1u);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, km, s + k));
        }
        const __m512 shift = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), sv);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < ld; k += 16) {
            const __mmask16 km = n - k >= 16 ? (__mmask16)0xffff
                                 : n > k ? (__mmask16)((1u << (n - k)) - 1u) : (__mmask16)0;
            const __m512 e = _mm512_maskz_mov_ps(
                km, baton_exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(km, s + k), sv, shift)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(p + k), baton_narrow16(e));
        }
        inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* O = P V, four dim groups of 16 at a time in tiles 0-3 */
    for (int64_t c0 = 0; c0 < dgroups; c0 += 4) {
        const int64_t nc = dgroups - c0 < 4 ? dgroups - c0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const uint32_t *vs = vt + (s * dgroups + c0) * 256;
            _tile_loadd(4, w->P + 32 * s, ld * 2);
            _tile_loadd(5, vs, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nc > 1) {
                _tile_loadd(6, vs + 256, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nc > 2) {
                _tile_loadd(7, vs + 512, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nc > 3) {
                _tile_loadd(5, vs + 768, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, w->O + 16 * c0, D * 4);
        if (nc > 1) _tile_stored(1, w->O + 16 * (c0 + 1), D * 4);
        if (nc > 2) _tile_stored(2, w->O + 16 * (c0 + 2), D * 4);
        if (nc > 3) _tile_stored(3, w->O + 16 * (c0 + 3), D * 4);
    }
    for (int64_t i = 0; i < m; i++) {
        const __m512 r = _mm512_set1_ps(inv[i]);
        uint16_t *o = out + ((row0 + t0 + i) * H + h) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d), baton_narrow16(
                _mm512_mul_ps(_mm512_loadu_ps(w->O + i * D + d), r)));
    }
}

/* Segment s's keys (its start position plus its rows) and their steps of 32. */
static inline int64_t seg_keys(const int64_t *segs, int64_t s) {
    return segs[3 * s + 2] + segs[3 * s + 1] - segs[3 * s];
}
static inline int64_t seg_steps(const int64_t *segs, int64_t s) {
    return (seg_keys(segs, s) + 31) / 32;
}

int baton_prefill_attention_amx(const uint16_t *q, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *segs,
                                const int64_t *tables, int64_t S, int64_t max_blocks,
                                int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                float scale, uint16_t *out, int num_threads) {
    if (!baton_amx_bf16_ready()) return 3;
    if (S < 1 || KVH < 1 || H % KVH || D % 32 || D > 128 || block_size % 16) return 1;
    const int64_t G = H / KVH, pieces = D / 32;
    /* each (segment, kv head)'s packed keys and values, and the tasks */
    int64_t *pack_at = (int64_t *)malloc(sizeof(int64_t) * (S * KVH + 1));
    int64_t *task_at = (int64_t *)malloc(sizeof(int64_t) * (S + 1));
    if (pack_at == NULL || task_at == NULL) {
        free(pack_at);
        free(task_at);
        return 2;
    }
    int64_t words = 0, tasks = 0, most = 32;
    for (int64_t s = 0; s < S; s++) {
        const int64_t rows = segs[3 * s + 1] - segs[3 * s], steps = seg_steps(segs, s);
        for (int64_t g = 0; g < KVH; g++) {
            pack_at[s * KVH + g] = words;
            /* kt: 2 * steps groups of 16 keys, pieces tiles each; vt: steps x D/16 */
            words += 2 * steps * pieces * 256 + steps * (D / 16) * 256;
        }
        task_at[s] = tasks;
        tasks += KVH * ((rows + 15) / 16);
        most = 32 * steps > most ? 32 * steps : most;
    }
    pack_at[S * KVH] = words;
    task_at[S] = tasks;
    uint32_t *packed = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (words + 16));
    if (packed == NULL) {
        free(pack_at);
        free(task_at);
        return 2;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t sg = 0; sg < S * KVH; sg++) {
            const int64_t s = sg / KVH, g = sg % KVH;
            const int64_t npos = seg_keys(segs, s), steps = seg_steps(segs, s);
            uint32_t *kt = packed + pack_at[sg];
            pack_keys(k_cache, tables + s * max_blocks, block_size, KVH, D, g, npos,
                      2 * steps, kt);
            pack_values(v_cache, tables + s * max_blocks, block_size, KVH, D, g, npos, steps,
                        kt + 2 * steps * pieces * 256);
        }
        prefill_scratch w;
        w.qb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 16 * D);
        w.S = (float *)aligned_alloc(64, sizeof(float) * 16 * most);
        w.P = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 16 * most);
        w.O = (float *)aligned_alloc(64, sizeof(float) * 16 * D);
        const int ok = w.qb != NULL && w.S != NULL && w.P != NULL && w.O != NULL;
        if (!ok) {
            #pragma omp atomic write
            failed = 2;
        }
        if (ok) config_tiles();
        /* within each segment, its longest query blocks (its last) first */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!ok) continue;
            int64_t s = 0;
            while (task_at[s + 1] <= task) s++;
            const int64_t row0 = segs[3 * s], rows = segs[3 * s + 1] - row0;
            const int64_t start = segs[3 * s + 2], qblocks = (rows + 15) / 16;
            const int64_t local = task - task_at[s];
            const int64_t g = local % KVH, qblock = qblocks - 1 - local / KVH;
            const int64_t t0 = 16 * qblock, m = rows - t0 < 16 ? rows - t0 : 16;
            const uint32_t *kt = packed + pack_at[s * KVH + g];
            const uint32_t *vt = kt + 2 * seg_steps(segs, s) * pieces * 256;
            for (int64_t h = g * G; h < (g + 1) * G; h++)
                query_block(q, row0, t0, m, start, h, H, D, kt, vt, scale, &w, out);
        }
        if (ok) release_tiles();
        free(w.qb);
        free(w.S);
        free(w.P);
        free(w.O);
    }
    free(packed);
    free(pack_at);
    free(task_at);
    return failed;
}
#else
int baton_prefill_attention_amx(const uint16_t *q, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *segs,
                                const int64_t *tables, int64_t S, int64_t max_blocks,
                                int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                float scale, uint16_t *out, int num_threads) {
    (void)q; (void)k_cache; (void)v_cache; (void)segs; (void)tables; (void)S;
    (void)max_blocks; (void)H; (void)KVH; (void)D; (void)block_size; (void)scale; (void)out;
    (void)num_threads;
    return 3;
}
#endif
