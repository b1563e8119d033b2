"""The memory floor of a decode step on this machine, now: how fast the
threads can read memory they did not just write, and what that makes the
shortest possible c=1 and c=32 decode steps of the embedded model.

A decode step must read every weight once (SmolLM2-135M in bf16: 269 MB,
the tied 49152x576 output projection included) and every live request's KV
cache (30 layers x 3 KV heads x 64 x K and V x 2 bytes = 23,040 bytes a
token). This script reads a buffer of that many bytes, distinct from the
last one read (two copies, alternated, each larger than any cache), with
torch's max over int32 on THREADS threads (the arithmetic is far cheaper
than the memory), and prints the best and median rate over --reps and the
step floors that follow. Run it beside a comparison (this VM's speed drifts
over minutes) to tell how far a measured step is from its floor.

    .venv/bin/python benchmarks/read_floor.py [--threads 2] [--reps 8] \
        [--batch 32] [--context 200] [--model DIR]

``--model DIR`` (an HF folder) also prints the c=1 floor of that model: the
bytes of its safetensors weights (a tied output projection is stored, and
read, once) over the same rates.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

WEIGHT_BYTES = 269_000_000   # SmolLM2-135M in bf16, output projection included
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2


def read_rates(nbytes: int, reps: int) -> list[float]:
    """GB/s of `reps` reads of `nbytes`, alternating two buffers."""
    bufs = [torch.ones(nbytes // 4, dtype=torch.int32) for _ in range(2)]
    for b in bufs:
        b.max()
    rates = []
    for i in range(reps):
        b = bufs[i % 2]
        t = time.perf_counter()
        b.max()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=200,
                    help="mean context of the batch's requests (128 prompt + 128 output "
                         "tokens average 192)")
    ap.add_argument("--model", type=Path, default=None,
                    help="an HF folder: also print its c=1 floor (its safetensors bytes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kv = args.batch * args.context * KV_BYTES_PER_TOKEN
    rates = read_rates(WEIGHT_BYTES + kv, args.reps)
    best, median = max(rates), statistics.median(rates)
    print(f"read {(WEIGHT_BYTES + kv) / 1e6:.0f} MB on {args.threads} threads: "
          f"best {best:.1f} GB/s, median {median:.1f} GB/s ({args.reps} reads)")
    for name, nbytes, rows in (("c=1", WEIGHT_BYTES, 1),
                               (f"c={args.batch}", WEIGHT_BYTES + kv, args.batch)):
        floor_ms = nbytes / best / 1e6
        print(f"{name} decode step floor: {nbytes / 1e6:.0f} MB -> {floor_ms:.1f} ms at the "
              f"best rate ({nbytes / median / 1e6:.1f} at the median): at most "
              f"{rows * 1e3 / floor_ms:.0f} tok/s of decode")
    if args.model is not None:
        nbytes = sum(p.stat().st_size for p in args.model.glob("*.safetensors"))
        print(f"{args.model.name} c=1 decode step floor: {nbytes / 1e6:.0f} MB -> "
              f"{nbytes / best / 1e6:.1f} ms at the best rate "
              f"({nbytes / median / 1e6:.1f} at the median)")


if __name__ == "__main__":
    main()
