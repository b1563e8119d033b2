"""Paged decode attention: milliseconds and KV bytes per second, per kernel build.

Times `baton::paged_decode_attention` (each CPU kind this CPU runs, each its
own build) and the library path it replaces (gather + torch SDPA, what
backends/attention.py runs without a kernel) on an attention shape
(--shape: SmolLM2-135M's 9 query heads, 3 kv heads and head_dim 64 by
default; 360m and 1.7b the benchmark models' shapes, 8b an 8B model's
(32, 8, 128: Llama-3-8B, Qwen3-8B); blocks of --block-sizes
positions, 16 by default, the server's default) over a
realistic pool: block tables scattered at random over a pool larger than
the touched blocks, and enough distinct layer pools in turn that the KV a
pass reads (>= --footprint-mb) never stays in the caches between calls, as
in a decode step where 30 layers and the weights pass between two reads of
one layer's pool.

    .venv/bin/python benchmarks/attention_bw.py [--cases 32x200,32x1100,4x500,1x2000]
        [--shape 135m|360m|1.7b|8b]
        [--kv bfloat16,float32] [--kinds portable,avx2,avx512,avx512_bf16,sdpa]
        [--block-sizes 16,32,64,128]   # each case at each block size, in turn
        [--pools slot-major,kvh-major]  # the pool's layout (kvh-major: one call per kv head)
        [--repo PATH]   # import backends from another checkout (the baseline)

GB/s counts the K and V bytes of each row's first ctx positions once (what
any decode attention must read); ms is per call (one layer): a step takes
it once per layer (30 in the 135M model, 32 in the 360M, 24 in the 1.7B).
The query is bf16 where the engine runs bf16 activations (a bf16 cache on the
avx512_bf16 kind, and SDPA beside it), float32 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

SHAPES = {"135m": (9, 3, 64), "360m": (15, 5, 64), "1.7b": (32, 32, 64), "8b": (32, 8, 128)}
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
ap.add_argument("--cases", default="32x200,32x1100,4x500,1x2000")
ap.add_argument("--kv", default="bfloat16,float32")
ap.add_argument("--kinds", default="portable,avx2,avx512,avx512_bf16,sdpa")
ap.add_argument("--block-sizes", default="16",
                help="positions per KV block; several (comma-separated) run in turn per case")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--footprint-mb", type=float, default=256.0,
                help="KV bytes read per pass over all layer pools")
ap.add_argument("--seconds", type=float, default=0.4, help="timed per measurement")
ap.add_argument("--layout", default="scattered", choices=["scattered", "contiguous"])
ap.add_argument("--pools", default="slot-major",
                help="slot-major (the engine's [slots, kv heads, head_dim]), kvh-major "
                     "(each block's kv heads apart, [blocks, kv heads, block, head_dim]: "
                     "one kv head's block one contiguous run), or both in turn")
ap.add_argument("--shape", default="135m", choices=sorted(SHAPES),
                help="the attention shape: query heads, kv heads, head_dim of SmolLM2-135M "
                     "(9, 3, 64), -360M (15, 5, 64), -1.7B (32, 32, 64), or an 8B model's "
                     "such as Llama-3-8B or Qwen3-8B (32, 8, 128)")
args = ap.parse_args()
sys.path.insert(0, args.repo)

from backends import kernels as native  # noqa: E402
from backends.attention import AttentionMetadata, paged_attention  # noqa: E402
from backends.execution import CpuFeatures  # noqa: E402

H, KVH, D = SHAPES[args.shape]
SCALE = D ** -0.5


def make_pools(rows: int, ctx: int, kv: torch.dtype, gen: torch.Generator, BS: int,
               kvh_major: bool = False):
    """[(k_cache, v_cache, tables)] x layers, lens; each pool 1.5x its blocks.
    kvh_major: the pool as [blocks * kv heads * BS, 1, D] and tables [kv heads,
    rows, blocks] (kv head g of block b is block b * KVH + g), the same bytes."""
    nb = -(-ctx // BS)
    need = rows * nb
    touched = 2 * rows * ctx * KVH * D * kv.itemsize
    layers = max(4, math.ceil(args.footprint_mb * 2**20 / touched))
    pool_blocks = need + need // 2 + 1
    base = torch.randn(pool_blocks * BS, KVH, D, generator=gen).to(kv)
    pools = []
    for i in range(layers):
        # Distinct memory per layer; content a cheap shuffle of one random pool.
        k = base.roll(i * 7, 0).contiguous()
        v = base.roll(i * 13 + 5, 0).contiguous()
        if args.layout == "scattered":
            order = torch.randperm(pool_blocks, generator=gen)[:need]
        else:
            order = torch.arange(need)
        tables = order.view(rows, nb).contiguous()
        if kvh_major:
            k, v = k.view(-1, 1, D), v.view(-1, 1, D)
            tables = torch.stack([tables * KVH + g for g in range(KVH)])
        pools.append((k, v, tables))
    lens = torch.full((rows,), ctx, dtype=torch.long)
    return pools, lens, touched


def timed(fn, pools) -> float:
    """Seconds per call: whole passes over the pools until --seconds elapsed."""
    for p in pools:
        fn(*p)
    calls, start = 0, time.perf_counter()
    while True:
        for p in pools:
            fn(*p)
        calls += len(pools)
        elapsed = time.perf_counter() - start
        if elapsed >= args.seconds:
            return elapsed / calls


def main() -> None:
    torch.set_num_threads(args.threads)
    cpu = CpuFeatures.detect()
    print(f"repo {args.repo}  cpu kind {cpu.kind}  threads {torch.get_num_threads()}  "
          f"layout {args.layout}  footprint >= {args.footprint_mb:.0f} MB  shape {args.shape} "
          f"({H} heads, {KVH} kv heads, head_dim {D})")
    gen = torch.Generator().manual_seed(0)
    kinds = args.kinds.split(",")
    for kv_name in args.kv.split(","):
        kv = getattr(torch, kv_name)
        for case in args.cases.split(","):
            rows, ctx = (int(x) for x in case.split("x"))
            q32 = torch.randn(rows, H, D, generator=gen)
            for BS, layout in ((int(b), p) for b in args.block_sizes.split(",")
                               for p in args.pools.split(",")):
                kvh_major = layout == "kvh-major"
                pools, lens, touched = make_pools(rows, ctx, kv, gen, BS, kvh_major)
                line = [f"kv {kv_name:8s} rows {rows:2d} ctx {ctx:4d} block {BS:3d} "
                        f"{layout} ({len(pools)} pools)"]
                for label in kinds:
                    kind, _, variant = label.partition(":")
                    if variant not in ("", "no-amx"):
                        raise SystemExit(f"unknown variant {label!r} (only :no-amx)")
                    if kind in native.KINDS and native.available(kind)[0]:
                        native.attention_amx(kind, 0 if variant else 1)
                    qdt = torch.bfloat16 if kv == torch.bfloat16 and (
                        kind == "avx512_bf16" or (kind == "sdpa" and cpu.native_bf16)) else kv
                    if qdt == torch.bfloat16 and kv != torch.bfloat16:
                        qdt = torch.float32
                    q = q32.to(qdt)
                    if kind == "sdpa" and kvh_major:
                        continue
                    if kind == "sdpa":
                        fn = _sdpa(q, lens, ctx, BS)
                    elif kvh_major:
                        # One call per kv head over its own runs: the kernel's
                        # inner loops as with KVH heads (G query heads a group).
                        if kind not in cpu.kinds or not native.available(kind)[0]:
                            continue
                        fn = _per_kv_head(q, lens, ctx, BS, native.kind_id(kind))
                    else:
                        if kind not in cpu.kinds or not native.available(kind)[0]:
                            line.append(f"{label}: -")
                            continue
                        k_id = native.kind_id(kind)

                        def fn(k, v, t, q=q, k_id=k_id, BS=BS):
                            return torch.ops.baton.paged_decode_attention(
                                q, k, v, t, lens, ctx, BS, SCALE, k_id)
                    s = timed(fn, pools)
                    line.append(f"{label} {s * 1e3:.3f} ms {touched / s / 1e9:.1f} GB/s")
                print("  ".join(line), flush=True)
                del pools


def _per_kv_head(q, lens, ctx, BS, k_id):
    G = H // KVH
    qs = [q[:, g * G:(g + 1) * G].contiguous() for g in range(KVH)]

    def fn(k, v, tables):
        return [torch.ops.baton.paged_decode_attention(qs[g], k, v, tables[g], lens, ctx, BS,
                                                       SCALE, k_id) for g in range(KVH)]
    return fn


def _sdpa(q, lens, ctx, BS):
    nb = -(-ctx // BS)  # the mask is made once per step, as the backend does
    mask = (torch.arange(nb * BS)[None] < lens[:, None]).view(-1, 1, 1, nb * BS)

    def fn(k, v, tables):
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                                 num_decode=q.shape[0], decode_blocks=tables,
                                 decode_mask=mask, prefills=[])
        return paged_attention(q, k, v, meta, SCALE)
    return fn


if __name__ == "__main__":
    main()
