/* How fast this machine's AMX tile unit multiplies now: a loop of
 * TDPBF16PS on tiles already loaded (four independent C tiles, no memory
 * traffic), on every OpenMP thread, timed. On a VM the tile unit of a
 * physical core can be shared with other tenants' work: the figure says what
 * the tile linear and oneDNN's bf16 kernels can reach at best in this
 * moment, beside benchmarks/read_floor.py (memory). A TDPBF16PS of 16 x 16 x
 * 32 bf16 products is 16,384 flops; the Xeon model 207 issues one about every
 * 16 cycles when the unit is its own.
 *
 * Build and run (CPUs with AMX-BF16 only):
 *   gcc -O2 -fopenmp -mamx-tile -mamx-bf16 benchmarks/amx_peak.c -o /tmp/amx_peak
 *   OMP_NUM_THREADS=2 /tmp/amx_peak [ITERATIONS=2000000]
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "the OS grants no AMX tile data to this process\n");
        return 1;
    }
    const long iters = argc > 1 ? atol(argv[1]) : 2000000;
    const double t0 = now();
    #pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) {
            cfg.rows[i] = 16;
            cfg.colsb[i] = 64;
        }
        _tile_loadconfig(&cfg);
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
    const double dt = now() - t0;
    const int nt = omp_get_max_threads();
    const double per = dt / (4.0 * iters);
    printf("%d threads: %.2f ns per TDPBF16PS on each thread, %.2f TFLOP/s in all\n", nt,
           per * 1e9, nt * 16.0 * 16 * 32 * 2 / per / 1e12);
    return 0;
}
