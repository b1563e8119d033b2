"""The linears of one decode step, by implementation and rows: oneDNN's bf16
linear on its packed copy against Baton's AMX tile linear and bf16 gemv on
the tiled copy (backends/kernels), over a whole model's worth of distinct
weights, so each step streams them from memory as serving does (the same
weights over and over would sit in cache and measure arithmetic only).

Default shapes: SmolLM2-135M (30 layers of qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, and the 49152x576 output projection: 270 MB of
bf16). Prints milliseconds per step (min and median over --reps).

    .venv/bin/python benchmarks/linear_rows.py --rows 4 8 16 32 64 [--threads 2] [--kind avx2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import kernels as native  # noqa: E402
from backends.execution import CpuFeatures  # noqa: E402
from backends.linear import _reorder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kind", default=None, choices=native.KINDS,
                    help="this CPU kind's kernels instead of the best one here (e.g. avx2: "
                         "the gemv an AVX2-only CPU runs; the tile linear is avx512_bf16's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h = args.hidden
    shapes = [(args.qkv, h), (h, h), (2 * args.intermediate, h), (h, args.intermediate)]
    gen = torch.Generator().manual_seed(0)
    raw = [[(torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16) for n, k in shapes]
           for _ in range(args.layers)]
    raw.append([(torch.randn(args.vocab, h, generator=gen) * 0.05).to(torch.bfloat16)])
    packed = [[_reorder(w) for w in layer] for layer in raw]
    tiled = [[native.GemvBf16.tile(w) for w in layer] for layer in raw]
    total = sum(w.numel() * 2 for layer in raw for w in layer)
    cpu = CpuFeatures.detect()
    kind = args.kind or cpu.kind
    ok, why = native.available(kind)
    gemv = native.GemvBf16(kind) if ok else None
    amx_ok, amx_why = native.amx_ready(kind) if ok else (False, why)
    amx = native.LinearAmx(kind, 1 << 30) if amx_ok else None
    print(f"CPU {cpu.describe()}, {kind} kernels, {args.threads} threads, {total / 1e6:.0f} MB of bf16 weights "
          f"per step; amx tile linear: {'yes' if amx else amx_why}")

    def timed(fn) -> str:
        fn()
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return f"{min(ts) * 1e3:6.2f} / {statistics.median(ts) * 1e3:6.2f}"

    print("| rows | oneDNN bf16 (ms, min / median) | AMX tile linear | bf16 gemv |")
    print("|---:|---:|---:|---:|")
    for m in args.rows:
        xs = [torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16) for w in raw[0]]
        xl = torch.randn(m, h, generator=gen).to(torch.bfloat16)

        def inputs(i, j):
            return xl if i == len(raw) - 1 else xs[j]

        def onednn():
            for i, layer in enumerate(packed):
                for j, w in enumerate(layer):
                    torch.ops.mkldnn._linear_pointwise(inputs(i, j), w, None, "none", [], "")

        def tiles(fn):
            def run():
                for i, layer in enumerate(tiled):
                    for j, w in enumerate(layer):
                        fn(inputs(i, j), w, raw[i][j].shape[0])
            return run
        row = [timed(onednn),
               timed(tiles(amx)) if amx else "-",
               timed(tiles(gemv)) if gemv and m <= gemv.max_rows else "-"]
        print(f"| {m} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
