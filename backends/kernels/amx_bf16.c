/* y = x @ W^T (+ bias) for many bf16 rows on AMX tiles (TDPBF16PS), reading
 * the same tiled bf16 weights the gemv streams (kernels.h: blocks of sixteen
 * features by thirty-two columns, contiguous per sixteen features).
 *
 * Why hand-written: a decode step of 5..64 rows is bound by reading the
 * weights (270 MB a step for SmolLM2-135M in bf16), not by arithmetic.
 * oneDNN's bf16 linear (AMX) on its own packed copy reaches ~1 TFLOP/s when
 * the weights sit in cache, but a whole model's worth of distinct weights
 * streamed at 32 rows took ~31 ms a step on the Xeon (model 207) against ~21
 * ms at 8 rows: at 32 rows it splits the rows over the threads, so both
 * threads read every weight. Here each thread streams its own share of the
 * output features once, for every row (docs/benchmarks.md has the figures).
 * On AMX machines the plan gives it prefill chunks too, calls of up to 1024
 * rows (linear bf16-amx+onednn: a row's bits independent of the row count,
 * which keeps prefix-cache hits consistent). Up to sixteen rows stream the
 * weights past the rows as they are; more (a c=32 decode step, prefill
 * chunks) take the many-row path below.
 *
 * Full-size tiles: a weight block (16 column pairs x 16 features x 2, 1 KB
 * contiguous) is the B operand as stored (16 rows x 64 bytes); sixteen input
 * rows by 32 columns, read straight from a zero-padded copy of x, are the A
 * operand (16 rows x 64 bytes); C is [16 rows][16 features] in float32, so
 * each result row is stored as it stands. Each TDPBF16PS does 16 x 16 x 32
 * products. The few-row path holds one row block by two feature blocks (two
 * C, one A, two B tiles); the many-row path two by two (all eight).
 *
 * Numerics: bf16 products are exact in float32 and accumulate in float32 (as
 * VDPBF16PS: denormal inputs and outputs flushed, round to nearest even); the
 * bias is added to the float32 sum and the result rounded once to bf16, as
 * oneDNN's bf16 linear and the gemv do. Only the summation order differs,
 * and it is the same for a row whatever the number of rows beside it: each
 * C element sums its row's A tiles against the same B tiles in the same
 * order (prefill/prefix-cache consistency depends on it).
 *
 * Only the avx512_bf16 kind builds the tile code (its functions carry the
 * amx target attribute, so no global flag changes); every other kind, and a
 * CPU or kernel without AMX tile data, answers 0 from baton_amx_bf16_ready and
 * the plan never calls baton_linear_amx_bf16.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef BATON_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1;  /* -1 not asked yet, 0 no, 1 yes */

/* 1 when this CPU has AMX-BF16 and the kernel lets this process use tile
 * data (Linux asks for it once per process: arch_prctl ARCH_REQ_XCOMP_PERM;
 * oneDNN asks the same, which is harmless). */
int baton_amx_bf16_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state >= 0) return state;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_state, ok, __ATOMIC_RELEASE);
    return ok;
}

/* The eight tiles as every caller here uses them, 64-byte rows: tiles 0-5
 * (C and A) of a_rows rows (16, or fewer for a call of fewer rows), 6 and 7
 * (B, the weights) of 16. */
BATON_AMX_TARGET static void load_tile_config(int a_rows) {
    baton_amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = (uint8_t)(i < 6 ? a_rows : 16);
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A [16 rows][16 features] float32 block (c, row stride 16) plus bias to
 * row m0 + m, features n0 + f of the result, for f < nr, m < mr, rounded
 * once to bf16: into y16 (bf16), or, when y16 is NULL, into yf as float32
 * holding the bf16 value. */
BATON_AMX_TARGET static void store_block(const float *c, const float *bias, uint16_t *y16, float *yf,
                                   int64_t N, int64_t n0, int64_t m0, int nr, int mr) {
    const __mmask16 keep = (__mmask16)((1u << nr) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mr; m++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * m), b);
        const __m256i h = baton_narrow16(v);
        if (y16)
            _mm256_mask_storeu_epi16(y16 + (m0 + m) * N + n0, keep, h);
        else
            _mm512_mask_storeu_ps(yf + (m0 + m) * N + n0, keep, baton_widen16(h));
    }
}

/* The C tiles of row blocks rb (and rb + 1 when twom) by feature blocks g
 * (and g + 1 when two), C[mi][gi] in tmm(2 * mi + gi), rounded into y16 or
 * yf by store_block; rows past M and features past N are dropped. */
BATON_AMX_TARGET static void store_tiles(const float *bias, uint16_t *y16, float *yf, int64_t M,
                                         int64_t N, int64_t g, int two, int64_t rb, int twom) {
    float c[4][16][16];
    _tile_stored(0, c[0], 64);
    if (two) _tile_stored(1, c[1], 64);
    if (twom) {
        _tile_stored(2, c[2], 64);
        if (two) _tile_stored(3, c[3], 64);
    }
    for (int h = 0; h < 1 + twom; h++) {
        const int64_t m0 = (rb + h) * 16;
        const int mr = (int)(M - m0 < 16 ? M - m0 : 16);
        if (mr <= 0) continue;
        for (int q = 0; q < 1 + two; q++) {
            const int64_t n0 = (g + q) * 16;
            const int nr = (int)(N - n0 < 16 ? N - n0 : 16);
            if (nr > 0) store_block(&c[2 * h + q][0][0], bias, y16, yf, N, n0, m0, nr, mr);
        }
    }
}

/* Feature blocks [g0, g1) for the rows of xp [mp][kp] (bf16, zero-padded
 * to kp columns; mp = 16, or mp = M < 16 rows exactly: the A and C tiles
 * then hold M rows): C[gi] in tmm(gi), the rows (A) in tmm 4, the weights
 * (B) in tmm 6 and 7. A row's sums do not depend on the rows configured
 * beside it. Results into y16 (bf16) or, when y16 is NULL, yf (store_block). */
BATON_AMX_TARGET static void amx_groups(const uint16_t *xp, int64_t mp, int64_t kp,
                                  const uint16_t *w, const float *bias, uint16_t *y16,
                                  float *yf, int64_t M, int64_t N, int64_t g0, int64_t g1) {
    load_tile_config(mp < 16 ? (int)mp : 16);
    const int64_t kb = kp / BATON_GEMV_TILE_COLS, xstride = kp * 2;
    const int64_t wrow = BATON_GEMV_TILE_ROWS * kp;  /* bf16 values per feature block */
    for (int64_t g = g0; g < g1; g += 2) {
        const int two = g + 1 < g1;
        const uint16_t *w0 = w + g * wrow, *w1 = w0 + wrow;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            for (int64_t j = 0; j < kb; j++) {
                baton_prefetch_block(w0, j);
                baton_prefetch_block(w1, j);
                _tile_loadd(6, w0 + j * BATON_GEMV_BLOCK, 64);
                _tile_loadd(4, xp + j * 32, xstride);
                _tile_loadd(7, w1 + j * BATON_GEMV_BLOCK, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
        } else {
            for (int64_t j = 0; j < kb; j++) {
                baton_prefetch_block(w0, j);
                _tile_loadd(6, w0 + j * BATON_GEMV_BLOCK, 64);
                _tile_loadd(4, xp + j * 32, xstride);
                _tile_dpbf16ps(0, 4, 6);
            }
        }
        store_tiles(bias, y16, yf, M, N, g, two, 0, 0);
    }
    _tile_release();
}

/* Thread me of nt's feature blocks [*g0, *g1) of groups: a contiguous run of
 * block pairs, so that each thread reads one stream of weights. */
static inline void thread_groups(int64_t groups, int64_t me, int64_t nt, int64_t *g0,
                                 int64_t *g1) {
    const int64_t pairs = (groups + 1) / 2, p1 = pairs * (me + 1) / nt;
    *g0 = 2 * (pairs * me / nt);
    *g1 = 2 * p1 < groups ? 2 * p1 : groups;
}

/* ---- Many rows: more than BATON_AMX_MANY_ROWS (decode batches of 17-32
 * rows here; prefill chunks pack the same way, then take amx_rows_thread) ----
 * The rows are packed once into tile order (row block r, column block j: 16
 * rows x 32 columns, 1 KB contiguous), so an A tile is one contiguous
 * kilobyte the prefetcher follows. (Read with the stride of a row, sixteen
 * lines a row apart, as the few-row path reads its one row block, a 32-row
 * decode step's linears took ~10% longer: medians of 16-20 interleaved runs,
 * benchmarks/linear_floor.c's shapes, Xeon model 207, 2026-12-01.) Each
 * thread takes its contiguous run of feature-block pairs, as the few-row
 * path does, and passes over it once per panel of rows small
 * enough to stay in L2 (AMX_PANEL_BYTES of packed rows), reusing each pair
 * of weight blocks from L1 for every row block of the panel. Panels of
 * 256 KB measured ahead of 512 KB-1.5 MB at 2048 rows on the Xeon model 207
 * (docs/benchmarks.md, session 8), though each panel reads the weights once
 * more; since calls of more than 128 rows take the row-major order below,
 * panels of 1 MB: one panel, the weights read once, for up to 128 rows of
 * up to 4096 columns (1.7B shape at 48-80 rows 1.1-1.3x faster, an 8B
 * model's shape at 48-128 rows 1.2-1.35x, two pairs each; the smaller
 * shapes' panels held 128 rows already). The weight blocks are prefetched
 * as in amx_groups. A C element is
 * summed over the same column blocks in the same order, from zero, as in
 * amx_groups, and rounded by store_block: a row's bits are those of the
 * few-row path, whatever the number of rows. */
#define BATON_AMX_MANY_ROWS 16
#define AMX_PANEL_BYTES (1024 * 1024)

/* Rows [16 * r0, 16 * r1) of x [M][K] into xa in tile order (block (r, j)
 * at xa + (r * kb + j) * 512), zero past row M and column K. */
static void pack_row_blocks(const uint16_t *x, uint16_t *xa, int64_t M, int64_t K, int64_t kb,
                            int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        for (int i = 0; i < 16; i++) {
            const int64_t m = 16 * r + i;
            const uint16_t *src = x + m * K;
            for (int64_t j = 0; j < kb; j++) {
                uint16_t *dst = xa + ((r * kb + j) * 16 + i) * 32;
                const int64_t k0 = j * 32;
                const int64_t n = m >= M ? 0 : (K - k0 < 32 ? K - k0 : 32);
                if (n) memcpy(dst, src + k0, sizeof(uint16_t) * n);
                if (n < 32) memset(dst + n, 0, sizeof(uint16_t) * (32 - n));
            }
        }
    }
}

/* C[mi][gi] in tmm(2 * mi + gi), from zero (or from the four C tiles at c,
 * 4 KB: a sum so far): the packed row blocks a0 and a1 (A, tmm 4 and 5)
 * times the weight blocks w0 and w1 (B, tmm 6 and 7) over column blocks
 * [j0, j1) in order; with prefetch, each weight block two ahead is
 * asked for into L1 (baton_prefetch_block), for weights streaming from
 * memory. (Marked always_inline, GCC 12 dropped those prefetches from the
 * inlined copy and 32-row calls took ~35% longer; as a plain static function
 * it is inlined with them, as fast as the loop written out.) */
BATON_AMX_TARGET static void amx_block_2x2(const uint16_t *a0, const uint16_t *a1,
                                           const uint16_t *w0, const uint16_t *w1, int64_t j0,
                                           int64_t j1, int prefetch, const float *c) {
    if (c) {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + 256, 64);
        _tile_loadd(2, c + 512, 64);
        _tile_loadd(3, c + 768, 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t j = j0; j < j1; j++) {
        const int64_t o = j * BATON_GEMV_BLOCK;
        if (prefetch) {
            baton_prefetch_block(w0, j);
            baton_prefetch_block(w1, j);
        }
        _tile_loadd(6, w0 + o, 64);
        _tile_loadd(4, a0 + o, 64);
        _tile_loadd(7, w1 + o, 64);
        _tile_loadd(5, a1 + o, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Feature blocks [g0, g1) for row blocks [r0, r1) of the packed rows xa:
 * C[mi][gi] in tmm(2 * mi + gi), A in tmm 4 and 5, B in tmm 6 and 7, as in
 * amx_groups. Results into y16 (bf16) or, when y16 is NULL, yf (store_block). */
BATON_AMX_TARGET static void amx_many_panel(const uint16_t *xa, int64_t kb, const uint16_t *w,
                                            const float *bias, uint16_t *y16, float *yf,
                                            int64_t M, int64_t N, int64_t g0, int64_t g1,
                                            int64_t r0, int64_t r1) {
    const int64_t wrow = BATON_GEMV_BLOCK * kb;  /* bf16 values per feature block */
    for (int64_t g = g0; g < g1; g += 2) {
        const int two = g + 1 < g1;
        const uint16_t *w0 = w + g * wrow, *w1 = two ? w0 + wrow : w0;
        for (int64_t r = r0; r < r1; r += 2) {
            const int twom = r + 1 < r1;
            const uint16_t *a0 = xa + r * kb * BATON_GEMV_BLOCK;
            const uint16_t *a1 = twom ? a0 + kb * BATON_GEMV_BLOCK : a0;
            amx_block_2x2(a0, a1, w0, w1, 0, kb, 1, NULL);
            store_tiles(bias, y16, yf, M, N, g, two, r, twom);
        }
    }
}

/* One thread's feature blocks [g0, g1) for every row block, panel by panel. */
BATON_AMX_TARGET static void amx_many_thread(const uint16_t *xa, int64_t kb, const uint16_t *w,
                                             const float *bias, uint16_t *y16, float *yf,
                                             int64_t M, int64_t N, int64_t g0, int64_t g1,
                                             int64_t rblocks, int64_t panel) {
    load_tile_config(16);
    for (int64_t r0 = 0; r0 < rblocks; r0 += panel)
        amx_many_panel(xa, kb, w, bias, y16, yf, M, N, g0, g1, r0,
                       r0 + panel < rblocks ? r0 + panel : rblocks);
    _tile_release();
}

/* ---- More than 128 rows (prefill chunks): row pairs outside, weights inside.
 * The thread's run of feature-block pairs is cut into chunks of at most
 * AMX_WEIGHT_CHUNK bytes of weights (they stay in L2); for each chunk, every
 * pair of row blocks (its packed rows, a K slice at a time: below) across the
 * chunk meets every pair of weight blocks of the chunk. The results are then
 * written row by row across the chunk's features (contiguous runs of a row)
 * instead of sixteen-feature columns down every row of the panel, as the
 * panel order above writes them: with [512 x 576] x [3072 x 576] that column
 * order spent ~25% of the call on its stores (TLB and write-allocate over
 * 6 KB-strided rows). With one such weight over and over (in cache),
 * row-major took 0.63-0.74 TFLOP/s against 0.54-0.60 on two threads, and the
 * [512 x 1536] x [576 x 1536] down projection 0.57-0.70 against 0.43-0.52
 * (Xeon model 207, 2026-12-01; chunks of 512 KB - 1 MB alike, 256 KB and 1.5
 * MB slower). With a model's worth of distinct weights streamed from memory
 * (30 layers of SmolLM2's four projections, old and new alternating in one
 * process), 0.74-1.02 of the time a pass at 512 rows in ten runs (median
 * 0.95), 0.80-0.87 at 2048.
 * Each chunk is also cut along K, into slices of AMX_K_SLICE column blocks
 * at most: a row pair's slice (2 x 8 KB) then stays in L1 across the
 * chunk's feature pairs, where a row pair's whole K (60 KB for SmolLM2-360M's
 * 960 columns, 512 KB for 8192) came from L2 beside the weights for every
 * feature pair. Between slices a 2 x 2 block's four C tiles wait in a
 * float32 buffer (cbuf: at most AMX_C_BYTES a thread, which bounds the
 * chunk); a float32 sum stored and loaded back is the same sum. With a
 * model's worth of weights (benchmarks/linear_rows.py, Xeon model 167,
 * 2026-12-06) a pass at 300-512 rows took 1.1-1.3x less time on SmolLM2's
 * 135M, 360M and 1.7B shapes; at 1024 rows level; slices of 4 blocks as fast,
 * of 12 and 16 slower. The next slice's weights are prefetched into L2
 * meanwhile. Each 2 x 2 block is amx_block_2x2 without its L1 prefetch of
 * the weight blocks (they come from L2 here). A C element is summed over the
 * same column blocks in the same order as in amx_many_panel and amx_groups:
 * the same bits. */
#define AMX_WEIGHT_CHUNK (768 * 1024)
/* Row blocks above which a call takes this order. Since the K slices,
 * 160-256 rows 1.1-1.4x faster than in the panel order (360M and 1.7B
 * shapes, two pairs each); at 80-128 rows the panel order stays ahead on
 * the 360M shape (by 1.2x), level on the 1.7B shape. (Before the slices,
 * 128-256 rows measured level or 2-5% ahead in the panel order.) */
#define AMX_ROW_MAJOR_BLOCKS 8
#define AMX_K_SLICE 8
#define AMX_C_BYTES (512 * 1024)
/* feature blocks a chunk holds at most when cut into slices */
#define AMX_C_CHUNK 16

BATON_AMX_TARGET static void amx_rows_thread(const uint16_t *xa, int64_t kb, const uint16_t *w,
                                             const float *bias, uint16_t *y, int64_t M,
                                             int64_t N, int64_t g0, int64_t g1,
                                             int64_t rblocks, float *cbuf) {
    load_tile_config(16);
    const int64_t wrow = BATON_GEMV_BLOCK * kb;  /* bf16 values per feature block */
    const int64_t slices = (kb + AMX_K_SLICE - 1) / AMX_K_SLICE;
    const int64_t kc = (kb + slices - 1) / slices;
    int64_t chunk = AMX_WEIGHT_CHUNK / (kc * BATON_GEMV_BLOCK * 2);
    chunk = chunk < 2 ? 2 : chunk - (chunk & 1);
    if (slices > 1) {
        /* the sums between slices (1 KB a row block and feature block) within
         * AMX_C_BYTES */
        int64_t most = AMX_C_BYTES / 1024 / rblocks;
        most = most < 2 ? 2 : most - (most & 1);
        if (most > AMX_C_CHUNK) most = AMX_C_CHUNK;
        if (chunk > most) chunk = most;
    }
    for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < g1 ? c0 + chunk : g1;
        for (int64_t s = 0; s < slices; s++) {
            const int64_t j0 = s * kc, j1 = j0 + kc < kb ? j0 + kc : kb;
            /* the next slice's weights into L2 while this one is multiplied:
             * an equal share of its lines at each (row pair, feature pair) step */
            const int next_chunk = j1 == kb;
            const int64_t n0 = next_chunk ? c1 : c0;
            const int64_t n1 = next_chunk ? (c1 + chunk < g1 ? c1 + chunk : g1) : c1;
            const int64_t nj0 = next_chunk ? 0 : j1;
            const int64_t nj1 = next_chunk ? (kc < kb ? kc : kb) : (j1 + kc < kb ? j1 + kc : kb);
            const int64_t run_lines = (nj1 - nj0) * BATON_GEMV_BLOCK * 2 / 64;
            const int64_t next_lines = n1 > n0 ? (n1 - n0) * run_lines : 0;
            const int64_t steps = ((rblocks + 1) / 2) * ((c1 - c0 + 1) / 2);
            const int64_t per_step = (next_lines + steps - 1) / steps;
            int64_t pf = 0;
            for (int64_t r = 0; r < rblocks; r += 2) {
                const int twom = r + 1 < rblocks;
                const uint16_t *a0 = xa + r * kb * BATON_GEMV_BLOCK;
                const uint16_t *a1 = twom ? a0 + kb * BATON_GEMV_BLOCK : a0;
                for (int64_t g = c0; g < c1; g += 2) {
                    const int two = g + 1 < c1;
                    const uint16_t *w0 = w + g * wrow, *w1 = two ? w0 + wrow : w0;
                    for (int64_t e = pf + per_step; pf < e && pf < next_lines; pf++) {
                        const char *line = (const char *)(w + (n0 + pf / run_lines) * wrow +
                                                          nj0 * BATON_GEMV_BLOCK) +
                                           pf % run_lines * 64;
                        _mm_prefetch(line, _MM_HINT_T1);
                    }
                    float *c = cbuf + ((r / 2) * (chunk / 2) + (g - c0) / 2) * 1024;
                    amx_block_2x2(a0, a1, w0, w1, j0, j1, 0, s ? c : NULL);
                    if (j1 == kb) {
                        store_tiles(bias, y, 0, M, N, g, two, r, twom);
                    } else {
                        _tile_stored(0, c, 64);
                        _tile_stored(1, c + 256, 64);
                        _tile_stored(2, c + 512, 64);
                        _tile_stored(3, c + 768, 64);
                    }
                }
            }
        }
    }
    _tile_release();
}

/* Row blocks per panel (an even number, at least two; panels of nearly
 * equal sizes) for rblocks row blocks of kb column blocks. */
static int64_t many_panel(int64_t kb, int64_t rblocks) {
    int64_t panel = AMX_PANEL_BYTES / (kb * BATON_GEMV_BLOCK * 2);
    panel = panel < 2 ? 2 : panel;
    const int64_t npanels = (rblocks + panel - 1) / panel;
    panel = (rblocks + npanels - 1) / npanels;
    return panel + (panel & 1);
}

static int amx_linear_many(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t kb = baton_round_up(K, BATON_GEMV_TILE_COLS) / BATON_GEMV_TILE_COLS;
    const int64_t rblocks = baton_round_up(M, 16) / 16;
    const int64_t groups = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    const int64_t panel = many_panel(kb, rblocks);
    uint16_t *xa = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * rblocks * kb * BATON_GEMV_BLOCK);
    float *bf = (float *)malloc(sizeof(float) * (N + 1));
    /* the row-major path's float32 sums between K slices: per thread, a
     * 4 KB set of C tiles for each (row pair, feature pair) of a chunk */
    const int64_t cfloats = (rblocks + 1) / 2 * (AMX_C_CHUNK / 2) * 1024;
    /* the row-major order above AMX_ROW_MAJOR_BLOCKS, and where the panel
     * order would read the weights three times or more (wide K: an 8B
     * model's shape at 80-128 rows 1.15-1.35x faster) */
    const int row_major = rblocks > AMX_ROW_MAJOR_BLOCKS || 2 * panel < rblocks;
    const int slices = row_major && kb > AMX_K_SLICE;
    float *cb = slices ? (float *)aligned_alloc(64, sizeof(float) * cfloats * num_threads) : NULL;
    if (xa == NULL || bf == NULL || (slices && cb == NULL)) {
        free(xa);
        free(bf);
        free(cb);
        return 2;
    }
    if (bias) baton_load_bf16(bias, bf, N);
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        pack_row_blocks(x, xa, M, K, kb, rblocks * me / nt, rblocks * (me + 1) / nt);
        int64_t g0, g1;
        thread_groups(groups, me, nt, &g0, &g1);
        #pragma omp barrier
        if (g0 < g1 && row_major)
            amx_rows_thread(xa, kb, w, bias ? bf : 0, y, M, N, g0, g1, rblocks,
                            cb ? cb + me * cfloats : NULL);
        else if (g0 < g1)
            amx_many_thread(xa, kb, w, bias ? bf : 0, y, 0, M, N, g0, g1, rblocks, panel);
    }
    free(xa);
    free(bf);
    free(cb);
    return 0;
}

int baton_linear_amx_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1) return 1;
    if (!baton_amx_bf16_ready()) return 3;
    if (M > BATON_AMX_MANY_ROWS) return amx_linear_many(x, w, bias, y, M, N, K, num_threads);
    const int64_t kp = baton_round_up(K, BATON_GEMV_TILE_COLS);
    const int64_t mp = baton_round_up(M, 16);
    const int64_t groups = baton_round_up(N, BATON_GEMV_TILE_ROWS) / BATON_GEMV_TILE_ROWS;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, baton_round_up(sizeof(uint16_t) * mp * kp, 64));
    float *bf = (float *)malloc(sizeof(float) * (N + 1));
    if (xp == NULL || bf == NULL) {
        free(xp);
        free(bf);
        return 2;
    }
    if (bias) baton_load_bf16(bias, bf, N);
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        /* the rows, zero-padded to [mp][kp], each thread its share */
        for (int64_t m = mp * me / nt; m < mp * (me + 1) / nt; m++) {
            uint16_t *dst = xp + m * kp;
            const int64_t n = m < M ? K : 0;
            if (n) memcpy(dst, x + m * K, sizeof(uint16_t) * K);
            memset(dst + n, 0, sizeof(uint16_t) * (kp - n));
        }
        int64_t g0, g1;
        thread_groups(groups, me, nt, &g0, &g1);
        #pragma omp barrier
        if (g0 < g1) amx_groups(xp, mp, kp, w, bias ? bf : 0, y, 0, M, N, g0, g1);
    }
    free(xp);
    free(bf);
    return 0;
}

#else
int baton_amx_bf16_ready(void) { return 0; }

int baton_linear_amx_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return 3;
}
#endif
