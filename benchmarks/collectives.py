"""What tensor parallelism costs per decode step in communication alone.

Two ranks (processes pinned to a core each, as `baton serve
--tensor-parallel-size 2` runs them on CPU) time, over gloo, every collective
one decode step of a model makes, at the sizes the model gives them:

* the step broadcast (rank 0's rows, pickled: ~100 bytes a row);
* 2 all-reduces per layer (after o_proj and down_proj) plus one after the
  embedding, of [rows, hidden] activations;
* the gather of the vocabulary-parallel logits to rank 0, [rows, vocab / 2].

Prints the median of each, and the total per step at each batch size, beside
which docs/benchmarks.md puts the measured step times. Defaults are
SmolLM2-135M's shape (30 layers, hidden 576, vocabulary 49152).

    .venv/bin/python benchmarks/collectives.py [--rows 1 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from backends.parallel.group import ForwardRow
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    dtype = getattr(torch, args.dtype)
    results = {}
    for rows in args.rows:
        hidden = torch.randn(rows, args.hidden, dtype=dtype)
        logits = torch.randn(rows, args.vocab // 2, dtype=dtype)
        message = ([ForwardRow([1], 500, list(range(40)), True) for _ in range(rows)], [])
        timings = {"broadcast": [], "all_reduce": [], "gather": []}
        for i in range(args.iterations + 10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast_object_list([message if rank == 0 else None], src=0)
            t1 = time.perf_counter()
            for _ in range(args.layers * 2 + 1):
                dist.all_reduce(hidden)
            t2 = time.perf_counter()
            parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
            dist.gather(logits, parts, dst=0)
            t3 = time.perf_counter()
            if i >= 10:
                timings["broadcast"].append(t1 - t0)
                timings["all_reduce"].append((t2 - t1) / (args.layers * 2 + 1))
                timings["gather"].append(t3 - t2)
        results[rows] = {k: statistics.median(v) for k, v in timings.items()}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from service.tensor_parallel import free_port
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join()
    per_step = args.layers * 2 + 1
    print(f"gloo, 2 ranks on one core each, {args.dtype}, hidden {args.hidden}, "
          f"vocabulary {args.vocab}, {args.layers} layers ({per_step} all-reduces a step)")
    print(f"{'rows':>5} {'broadcast us':>13} {'all-reduce us':>14} {'gather us':>10} "
          f"{'per step ms':>12}")
    for rows, r in results.items():
        total = r["broadcast"] + per_step * r["all_reduce"] + r["gather"]
        print(f"{rows:>5} {r['broadcast'] * 1e6:>13.0f} {r['all_reduce'] * 1e6:>14.0f} "
              f"{r['gather'] * 1e6:>10.0f} {total * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
