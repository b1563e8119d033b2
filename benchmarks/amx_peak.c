/* How fast this machine's AMX tile unit multiplies now: a loop of
 * TDPBF16PS on tiles already loaded (four independent C tiles, no memory
 * traffic), on every OpenMP thread, timed; and beside it the same for
 * VDPBF16PS on zmm registers (24 independent chains; what the gemv and
 * oneDNN's bf16 kernels reach at best on an AVX512_BF16 CPU without tiles).
 * On a VM the tile unit of a
 * physical core can be shared with other tenants' work: the figure says what
 * the tile linear and oneDNN's bf16 kernels can reach at best in this
 * moment, beside benchmarks/read_floor.py (memory). A TDPBF16PS of 16 x 16 x
 * 32 bf16 products is 16,384 flops; the Xeon model 207 issues one about every
 * 16 cycles when the unit is its own. The tiles are configured and the tile
 * data asked of the OS as the tile linear does (backends/kernels/amx_bf16.c).
 *
 * The chains start from different values and the operands pass through an
 * empty asm statement each round: twelve chains of equal values, as in an
 * earlier scratch version, GCC folded into one, which read 3x this rate.
 *
 * Build and run (the avx512_bf16 kind's flags; the tile loop on AMX machines):
 *   gcc -O2 -fno-math-errno -fopenmp -mavx2 -mfma -mf16c -mavx512f -mavx512bw \
 *       -mavx512vl -mavx512dq -mavx512bf16 benchmarks/amx_peak.c -o /tmp/amx_peak
 *   OMP_NUM_THREADS=2 /tmp/amx_peak [ITERATIONS=2000000]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../backends/kernels/kernels.h"
#include "../backends/kernels/amx_bf16.c"

#ifndef BATON_AMX
#error "build with the avx512_bf16 kind's flags (see the header)"
#endif

#define DP_CHAINS 24

static double vector_loop(long iters) {
    __m512 a[DP_CHAINS];
    for (int c = 0; c < DP_CHAINS; c++) a[c] = _mm512_set1_ps((float)c);
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = x;  /* bf16 pairs (1, 1) */
    for (long i = 0; i < iters; i++) {
        #pragma GCC unroll 24
        for (int c = 0; c < DP_CHAINS; c++) a[c] = _mm512_dpbf16_ps(a[c], x, y);
        __asm__ volatile("" : "+v"(x), "+v"(y));
    }
    __m512 s = a[0];
    for (int c = 1; c < DP_CHAINS; c++) s = _mm512_add_ps(s, a[c]);
    return _mm512_reduce_add_ps(s);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

BATON_AMX_TARGET static void tile_loop(long iters) {
    load_tile_config(16);
    uint16_t ones[16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) ones[i] = 0x3f80;  /* bf16 1.0 */
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
}

int main(int argc, char **argv) {
    const long iters = argc > 1 ? atol(argv[1]) : 2000000;
    const int nt = omp_get_max_threads();
    double t0 = now(), sink = 0;
    #pragma omp parallel reduction(+ : sink)
    sink += vector_loop(iters * 16);
    double dt = now() - t0;
    printf("%d threads: %.2f G VDPBF16PS/s on each thread, %.0f GFLOP/s in all (%g)\n", nt,
           iters * 16.0 * DP_CHAINS / dt / 1e9, nt * iters * 16.0 * DP_CHAINS * 64 / dt / 1e9,
           sink > 0 ? 1.0 : 0.0);
    if (!baton_amx_bf16_ready()) {
        fprintf(stderr, "this CPU or OS gives no AMX-BF16 tile data to this process\n");
        return 1;
    }
    t0 = now();
    #pragma omp parallel
    tile_loop(iters);
    dt = now() - t0;
    const double per = dt / (4.0 * iters);
    printf("%d threads: %.2f ns per TDPBF16PS on each thread, %.2f TFLOP/s in all\n", nt,
           per * 1e9, nt * 16.0 * 16 * 32 * 2 / per / 1e12);
    return 0;
}
