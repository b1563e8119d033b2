/* What the kernel sources share: row-level helpers (inline) and the
 * exported names of every CPU kind's build.
 *
 * Float32 everywhere except the weights of the bf16 matrix-vector kernel.
 */
#ifndef BATON_KERNELS_H
#define BATON_KERNELS_H

/* Every source is compiled once per CPU kind (-DBATON_KIND=avx2 and that
 * kind's -m flags) into one library: each exported name gets the kind as a
 * suffix (baton_silu_mul_f32 -> baton_silu_mul_f32_avx2), and ops.cpp picks
 * the kind at run time. */
#ifdef BATON_KIND
#define BATON_CAT2(a, b) a##_##b
#define BATON_CAT(a, b) BATON_CAT2(a, b)
#define BATON_FN(name) BATON_CAT(name, BATON_KIND)
#else
#define BATON_FN(name) name
#endif
#define baton_rms_norm_f32 BATON_FN(baton_rms_norm_f32)
#define baton_silu_mul_f32 BATON_FN(baton_silu_mul_f32)
#define baton_qkv_rope_store_f32 BATON_FN(baton_qkv_rope_store_f32)
#define baton_qkv_rope_store_row BATON_FN(baton_qkv_rope_store_row)
#define baton_rms_norm_bf16 BATON_FN(baton_rms_norm_bf16)
#define baton_silu_mul_bf16 BATON_FN(baton_silu_mul_bf16)
#define baton_qkv_rope_store_bf16 BATON_FN(baton_qkv_rope_store_bf16)
#define baton_paged_decode_attention_f32 BATON_FN(baton_paged_decode_attention_f32)
#define baton_paged_decode_attention_bf16 BATON_FN(baton_paged_decode_attention_bf16)
#define baton_paged_decode_attention_qb BATON_FN(baton_paged_decode_attention_qb)
#define baton_gemv_bf16 BATON_FN(baton_gemv_bf16)
#define baton_gemv_bf16_act16 BATON_FN(baton_gemv_bf16_act16)
#define baton_gemv_bf16_max_rows BATON_FN(baton_gemv_bf16_max_rows)
#define baton_kernels_avx2 BATON_FN(baton_kernels_avx2)
#define baton_amx_bf16_ready BATON_FN(baton_amx_bf16_ready)
#define baton_attention_amx BATON_FN(baton_attention_amx)
#define baton_linear_amx_bf16 BATON_FN(baton_linear_amx_bf16)
#define baton_int4_linear BATON_FN(baton_int4_linear)
#define baton_int4_decode BATON_FN(baton_int4_decode)
#define baton_int4_linear_q8 BATON_FN(baton_int4_linear_q8)
#define baton_int8_linear_q8 BATON_FN(baton_int8_linear_q8)

#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BATON_AVX2 1
#endif
/* bf16 pair dot products (VDPBF16PS) for the gemv of bf16 activations */
#if defined(BATON_AVX2) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define BATON_GEMV_DP 1
#endif
/* AMX tile code (TDPBF16PS): only in the build that has VDPBF16PS, in
 * functions carrying BATON_AMX_TARGET (no global flag changes), taken only
 * where baton_amx_bf16_ready() says the CPU and the OS allow it. */
#if defined(BATON_GEMV_DP) && defined(__x86_64__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define BATON_AMX 1
#define BATON_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl")))
/* The 64-byte operand of LDTILECFG (palette 1). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} baton_amx_config;
#endif

#ifdef BATON_AVX2
/* The constants of baton_exp256 and baton_exp512 (one arithmetic, two widths). */
#define BATON_EXP_MIN (-87.3365448f)
#define BATON_EXP_MAX 88.0f
#define BATON_EXP_LOG2E 1.44269504f
#define BATON_EXP_LN2_HI 0.693359375f
#define BATON_EXP_LN2_LO (-2.12194440e-4f)
#define BATON_EXP_P0 1.9875691500e-4f
#define BATON_EXP_P1 1.3981999507e-3f
#define BATON_EXP_P2 8.3334519073e-3f
#define BATON_EXP_P3 4.1665795894e-2f
#define BATON_EXP_P4 1.6666665459e-1f
#define BATON_EXP_P5 5.0000001201e-1f

/* exp(x) for eight floats, within ~2 ulp over the normal range (range
 * reduction by ln 2, a degree-6 polynomial, the exponent put in by integer
 * arithmetic). Written here rather than left to the compiler: vectorised expf
 * from glibc's libmvec needs -ffast-math, and -ffast-math at link time makes
 * GCC add crtfastmath, which switches the whole process to flush-to-zero.
 * Inputs are clamped to [-87.34, 88.0] (results 2^-126 .. 1.65e38); NaN
 * stays NaN. */
static inline __m256 baton_exp256(__m256 x) {
    /* min/max return their second operand when one is NaN: x goes second. */
    x = _mm256_max_ps(_mm256_set1_ps(BATON_EXP_MIN),
                      _mm256_min_ps(_mm256_set1_ps(BATON_EXP_MAX), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(BATON_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(BATON_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(BATON_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(BATON_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BATON_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BATON_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BATON_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BATON_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BATON_EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
/* baton_exp256's arithmetic on sixteen lanes: each lane's result is the one
 * baton_exp256 gives. */
static inline __m512 baton_exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(BATON_EXP_MIN),
                      _mm512_min_ps(_mm512_set1_ps(BATON_EXP_MAX), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(BATON_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(BATON_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(BATON_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(BATON_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BATON_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BATON_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BATON_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BATON_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BATON_EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

/* The sum of a vector's eight lanes. */
static inline float baton_hsum256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
    return _mm_cvtss_f32(r);
}
#endif

/* ------------------------------------------------------------ bfloat16 */
static inline float baton_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t baton_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#if defined(BATON_AVX2) && defined(__AVX512F__)
/* Sixteen bf16 values widened to float32 (exact). */
static inline __m512 baton_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* Sixteen float32 values rounded to bf16, to nearest even. */
static inline __m256i baton_narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#endif

/* dst[i] = bf16(x[i]), rounded to nearest even (NaN stays NaN). */
static inline void baton_store_bf16(const float *x, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), baton_narrow16(_mm512_loadu_ps(x + i)));
#elif defined(BATON_AVX2)
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16),
                                                  _mm256_set1_epi32(0x40)), nan);
        /* eight 32-bit lanes -> eight 16-bit values (packus works per 128-bit half) */
        const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi32(lo, hi));
    }
#endif
    for (; i < n; i++) dst[i] = baton_f32_to_bf16(x[i]);
}

/* dst[i] = float(src[i]) (exact). */
static inline void baton_load_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(BATON_AVX2) && defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, baton_widen16(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
#ifdef BATON_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
#endif
    for (; i < n; i++) dst[i] = baton_bf16_to_f32(src[i]);
}

/* ------------------------------------------------------------ float16 */
/* IEEE binary16 bits to float32, exactly (GGUF's block scales). */
static inline float baton_f16_to_f32(uint16_t h) {
#if defined(BATON_AVX2) && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in float32 */
        v.f = (float)m * 0x1p-24f;
        v.u |= sign;
    } else {       /* normal, or infinity / NaN (exponent 31 -> 255) */
        v.u = sign | (e == 31 ? 0xFFu << 23 : (e + 112) << 23) | m << 13;
    }
    return v.f;
#endif
}

/* sum(x[i] * y[i]) with y in bfloat16 */
static inline float baton_dot_bf16(const float *x, const uint16_t *y, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef BATON_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256i y16 = _mm256_loadu_si256((const __m256i *)(y + i));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm256_castsi256_si128(y16)), 16));
        const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(y16, 1)), 16));
        a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i + 8), a1);
    }
    s = baton_hsum256(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; i++) s += x[i] * baton_bf16_to_f32(y[i]);
    return s;
}

/* acc[i] += a * y[i] with y in bfloat16 */
static inline void baton_axpy_bf16(float a, const uint16_t *y, float *acc, int64_t n) {
    int64_t i = 0;
#ifdef BATON_AVX2
    const __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) {
        const __m256 yv = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(y + i))), 16));
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(av, yv, _mm256_loadu_ps(acc + i)));
    }
#endif
    for (; i < n; i++) acc[i] += a * baton_bf16_to_f32(y[i]);
}

/* ---------------------------------------------------------------- rows */
static inline float baton_inv_rms(const float *x, int64_t n, float eps) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* [x += delta;] out = rms_norm(x) * w */
static inline void baton_rms_norm_row(float *x, const float *delta, const float *w, float *out,
                                      int64_t n, float eps) {
    if (delta != 0) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) x[i] += delta[i];
    }
    const float inv = baton_inv_rms(x, n, eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = silu(gate) * up */
static inline void baton_silu_mul_row(const float *gate, const float *up, float *out,
                                      int64_t n) {
    int64_t i = 0;
#if defined(BATON_AVX2) && defined(__AVX512F__)
    /* Sixteen lanes where the build has them: each lane's result is the one
     * the eight-lane loop gives (the same exp, IEEE division and product). */
    const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = baton_exp512(_mm512_sub_ps(zero16, g));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one16, e)),
                                                _mm512_loadu_ps(up + i)));
    }
#endif
#ifdef BATON_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = baton_exp256(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* x[i] = exp(x[i] - shift); returns the sum of the new x. */
static inline float baton_exp_shifted_sum(float *x, int64_t n, float shift) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef BATON_AVX2
    const __m256 s = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = baton_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = baton_hsum256(acc);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

/* One token's q/k/v row [(H + 2 * KVH) * D]: optional per-head RMSNorm of q
 * and k, rotary embedding at `position`, k and v stored at `slot` of the
 * caches [slots, KVH, D] (float32, or bfloat16 when kv_bf16), rotated q
 * written to q_out [H, D]. D <= 1024. */
void baton_qkv_rope_store_row(const float *row, int64_t H, int64_t KVH, int64_t D,
                              int64_t position, const float *cos_table,
                              const float *sin_table, const float *q_norm,
                              const float *k_norm, float eps, int64_t slot,
                              void *k_cache, void *v_cache, int kv_bf16, float *q_out);

/* ------------------------------------------------------------ attention */
/* The float32 decode attention (q, out [T, H, D] float32), given also the
 * query rounded to bf16 when that is exact (qb, or NULL): with AVX512_BF16
 * and a bf16 cache the scores are then bf16 dot products. lse [T, H] (or
 * NULL): each head's log-sum-exp of its scaled scores. */
int baton_paged_decode_attention_qb(
        const float *q, const uint16_t *qb, const void *k_cache, const void *v_cache,
        int kv_bf16, const int64_t *block_tables, const int64_t *ctx_lens, float *out,
        float *lse, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
        int64_t block_size, int64_t max_ctx, float scale, int num_threads);

/* 1 when this CPU has AMX-BF16 and the process may use tile data (amx_bf16.c). */
int baton_amx_bf16_ready(void);

/* Whether baton_paged_decode_attention_qb takes its bf16 scores on AMX
 * tiles (avx512_bf16 kind, AMX ready): mode 1 lets it (the default), 0
 * keeps VDPBF16PS, -1 only asks. Answers whether AMX is now used. */
int baton_attention_amx(int mode);

/* ------------------------------------------------------- bf16 gemv */
/* Weights for the gemv and the AMX tile linear are
 * stored in blocks of 16 output features by 32 input columns (rows padded
 * with zeros to a multiple of 16, columns to a multiple of 32), blocks
 * [N/16][K/32], each block 1 KB holding [16 column pairs][16 features][2]:
 * feature f's values at columns 2p and 2p + 1 of the block share a 32-bit
 * word, and the sixteen features' words for pair p are one 64-byte line.
 * That is AMX's B operand as it stands (TDPBF16PS: 16 pairs x 16 columns of
 * bf16 pairs) and, for the vector gemv, one 512-bit load gives sixteen
 * features' products with one broadcast pair of the input row (VDPBF16PS,
 * or two float32 FMAs per 8 features): each feature's sum stays in its own
 * lane, with no horizontal reduction. A thread's share of W (whole blocks of
 * 16 features) is one contiguous stream. Input rows are read in their own
 * column order, zero-padded to round_up(K, 32). */
#define BATON_GEMV_TILE_ROWS 16
#define BATON_GEMV_TILE_COLS 32
#define BATON_GEMV_BLOCK (BATON_GEMV_TILE_ROWS * BATON_GEMV_TILE_COLS)
#define BATON_GEMV_MAX_ROWS 4

/* Block j + BATON_GEMV_PF_AHEAD of a stream of tiled blocks (all sixteen
 * lines of the 1 KB block), asked for ahead of its use; the gemv and the AMX
 * tile linear stream W this way (for 17-32 rows, a pair of blocks asked for
 * 8 ahead into L2 and 1 into L1 measured slower, once the tile linear packed
 * those rows: docs/benchmarks.md, session 10). With it a whole-step decode
 * (retired since) of one row took 16-17 ms instead of 20-21 on the Xeon (model 207), four
 * rows 25 ms instead of 33, and the avx2 build's gemv streamed ~20% faster
 * there too (docs/benchmarks.md, session 7). Past a block row's end it
 * fetches the next one, which the same thread reads next (a static share of
 * rows). */
#ifndef BATON_GEMV_PF_AHEAD
#define BATON_GEMV_PF_AHEAD 2
#endif
static inline void baton_prefetch_block(const uint16_t *base, int64_t j) {
#if defined(BATON_AVX2) && BATON_GEMV_PF_AHEAD > 0
    const char *p = (const char *)(base + (j + BATON_GEMV_PF_AHEAD) * BATON_GEMV_BLOCK);
    for (int l = 0; l < BATON_GEMV_BLOCK * 2; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
#else
    (void)base;
    (void)j;
#endif
}

static inline int64_t baton_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }



#endif
