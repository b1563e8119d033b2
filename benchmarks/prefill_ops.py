"""The operators of a prefill step one by one, at the row counts prefill steps
have: oneDNN's bf16 linear (the path prefill rows take) by rows, plain and
cut into row pieces or padded; torch's SDPA for a fresh prompt and a chunk
over a cached prefix, with the additive bias Baton passes, a bool mask, and
is_causal; Baton's silu_mul and add_rms_norm kernels.

Shapes: SmolLM2-135M's layer (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; 9 query heads, 3 KV heads of 64). Each figure is the best of
--rounds rounds, the variants alternated within each round (this VM's speed
drifts). The same weights are reused, so the linears run from cache: a
prefill step is bound by arithmetic, not by streaming its weights.

    .venv/bin/python benchmarks/prefill_ops.py --part linears --rows 128 459 2048 \
        [--threads 2] [--rounds 3]
    .venv/bin/python benchmarks/prefill_ops.py --part sdpa
    .venv/bin/python benchmarks/prefill_ops.py --part elementwise --rows 128 459
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per linear
H, KVH, D = 9, 3, 64


def _best(fn, rounds: int, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def linears(rows: list[int], rounds: int) -> None:
    def lin(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def pieces(x, w, c):
        return lin(x, w) if x.shape[0] <= c else torch.cat([lin(y, w) for y in x.split(c)])

    def padded(x, w, m):
        pad = -x.shape[0] % m
        return lin(x, w) if not pad else lin(F.pad(x, (0, 0, 0, pad)), w)[:x.shape[0]]

    variants = {"plain": lin, "pieces of 128": lambda x, w: pieces(x, w, 128),
                "pieces of 256": lambda x, w: pieces(x, w, 256),
                "padded to 64": lambda x, w: padded(x, w, 64)}
    total = {(m, v): 0.0 for m in rows for v in variants}
    for n, k in LAYER:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 32)
        xs = {m: torch.randn(m, k).bfloat16() for m in rows}
        best = {key: float("inf") for key in total}
        for _ in range(rounds):
            for m in rows:
                for v, fn in variants.items():
                    best[m, v] = min(best[m, v], _best(lambda: fn(xs[m], w), 1))
        for key, t in best.items():
            total[key] += t
        print(f"{n}x{k}: " + "; ".join(
            f"{m} rows " + "/".join(f"{2 * m * n * k / best[m, v] / 1e9:.0f}" for v in variants)
            for m in rows) + f" GFLOP/s ({' / '.join(variants)})")
    for m in rows:
        flops = sum(2 * m * n * k for n, k in LAYER)
        print(f"{m} rows, one layer's four linears: " + ", ".join(
            f"{v} {total[m, v] * 1e3:.2f} ms" for v in variants)
            + f" (plain {flops / total[m, 'plain'] / 1e9:.0f} GFLOP/s)")


def sdpa(rounds: int) -> None:
    for n, cached in ((444, 0), (128, 0), (100, 600)):
        s = -(-(cached + n) // 16) * 16
        q = torch.randn(1, H, n, D).bfloat16()
        k = torch.randn(1, KVH, s, D).bfloat16()
        v = torch.randn(1, KVH, s, D).bfloat16()
        mask = torch.arange(s)[None, :] <= torch.arange(cached, cached + n)[:, None]
        bias = torch.zeros(n, s, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
        run = {"bias": lambda: F.scaled_dot_product_attention(
                   q, k, v, attn_mask=bias, scale=0.125, enable_gqa=True),
               "bool mask": lambda: F.scaled_dot_product_attention(
                   q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)}
        if not cached:
            run["is_causal"] = lambda: F.scaled_dot_product_attention(
                q, k[:, :, :n], v[:, :, :n], is_causal=True, scale=0.125, enable_gqa=True)
        best = {name: _best(fn, rounds * 3) for name, fn in run.items()}
        flops = 4 * H * n * s * D
        print(f"{n} queries over {cached} cached ({s} keys): " + ", ".join(
            f"{name} {t * 1e3:.3f} ms" for name, t in best.items())
            + f" ({flops / best['bias'] / 1e9:.0f} GFLOP/s with the bias, unmasked count)")


def elementwise(rows: list[int], rounds: int) -> None:
    from backends.execution import CpuFeatures
    from backends.ops import native_cpu_ops
    ops = native_cpu_ops(CpuFeatures.detect().kind)
    for t in rows:
        gate_up = torch.randn(t, 3072).bfloat16()
        res, delta = torch.randn(t, 576).bfloat16(), torch.randn(t, 576).bfloat16()
        w = torch.randn(576).bfloat16()
        silu = _best(lambda: ops.silu_mul(gate_up), rounds * 3, 10)
        norm = _best(lambda: ops.add_rms_norm(res, delta, w, 1e-5), rounds * 3, 10)
        copy = _best(lambda: gate_up.clone(), rounds * 3, 10)
        print(f"{t} rows: silu_mul {silu * 1e3:.3f} ms, add_rms_norm {norm * 1e3:.3f} ms, "
              f"copy of gate_up {copy * 1e3:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["linears", "sdpa", "elementwise"], required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 459, 512, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}")
    if args.part == "linears":
        linears(args.rows, args.rounds)
    elif args.part == "sdpa":
        sdpa(args.rounds)
    else:
        elementwise(args.rows, args.rounds)


if __name__ == "__main__":
    main()
