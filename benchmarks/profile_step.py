"""Time and profile one decode step of the torch backend at a given batch.

Builds BATCH requests of CONTEXT random prompt tokens on the embedded model
(or --model), prefills them, then times --steps decode steps and (with
--profile) prints torch.profiler's top operators for a few of them.

    .venv/bin/python benchmarks/profile_step.py --batch 32 --context 160 \
        [--dtype float32] [--threads 2] [--profile]

Steps of the prefix-cache workloads (benchmarks/workloads.py), bf16:
shared-prefix admission ``--batch 12 --context 1000 --shared-prefix
--prefill-rows 5``; multi-turn, a later turn's suffix over its cached history
``--batch 15 --context 700 --prefill-rows 1``, a first turn among running
conversations ``--batch 15 --context 460 --prefill-rows 1 --prefill-len 444
--chunk-context 0``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput  # noqa: E402
from backends.loader import load_model, resolve_model_path  # noqa: E402
from backends.device import DTYPES  # noqa: E402
from backends.execution import ExecutionOptions  # noqa: E402
from backends.factory import BackendConfig, create_backend  # noqa: E402
from backends.quantization.spec import QuantizationSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill-rows", type=int, default=0,
                    help="also prefill this many chunks per step, each attending to a "
                         "cached prefix of --context tokens (a shared-prefix step)")
    ap.add_argument("--prefill-len", type=int, default=100,
                    help="tokens of each --prefill-rows chunk")
    ap.add_argument("--chunk-context", type=int, default=None,
                    help="tokens cached before each --prefill-rows chunk (default --context; "
                         "0: the chunks are fresh prompts, as a new conversation's first turn)")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="every request's prompt is the same --context tokens and their "
                         "full blocks are shared (the prefix cache's layout): decodes of "
                         "many users of one system prompt")
    ap.add_argument("--no-cascade", action="store_true",
                    help="with --shared-prefix: decode attention without the shared-prefix "
                         "cascade (each row walks its whole table)")
    ap.add_argument("--cpu-kind", default="auto",
                    choices=["auto", "portable", "avx2", "avx512", "avx512_bf16"],
                    help="run this CPU kind's path (backends/execution.py)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"],
                    help="weight-only quantization (gguf: keep a GGUF file's blocks)")
    ap.add_argument("--no-amx", action="store_true",
                    help="decode batches on oneDNN, not the AMX tile linear (backends/execution.py)")
    ap.add_argument("--no-amx-attention", action="store_true",
                    help="bf16 decode attention scores on VDPBF16PS, not AMX tiles "
                         "(backends/kernels/paged_attention.c)")
    ap.add_argument("--enforce-eager", dest="compile", action="store_false",
                    help="the eager forward for token-row steps (as the server's "
                         "--enforce-eager; by default, as the server, they run the "
                         "compiled step wherever the plan can)")
    ap.add_argument("--no-fast-paths", action="store_true",
                    help="portable torch ops only (no native kernels, no oneDNN prepacking)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_amx_attention:
        from backends import kernels as native
        native.attention_amx("avx512_bf16", 0)
    path = resolve_model_path(args.model)
    if args.quantization == "gguf":  # as the engine loads it: the file's blocks kept
        from backends.loader.gguf import load_gguf
        from backends.quantization import gguf_block_types
        loaded = load_gguf(path, dtype=DTYPES[args.dtype], keep_quantized=gguf_block_types())
    else:
        loaded = load_model(path, dtype=DTYPES[args.dtype])
    bs = args.block_size
    chunk_ctx = args.context if args.chunk_context is None else args.chunk_context
    if args.shared_prefix and chunk_ctx != args.context:
        ap.error("--shared-prefix chunks attend to the shared --context tokens")
    max_ctx = max(args.context + args.steps * 2, chunk_ctx + args.prefill_len) + 8
    blocks_per = -(-max_ctx // bs)
    num_seqs = args.batch + args.prefill_rows
    backend = create_backend(loaded, BackendConfig(
        dtype=args.dtype, block_size=bs, num_kv_blocks=num_seqs * blocks_per + 1,
        threads=args.threads, quantization=QuantizationSpec(args.quantization),
        execution=ExecutionOptions(fast_paths=not args.no_fast_paths,
                                   cpu_kind=args.cpu_kind, amx=not args.no_amx,
                                   compile=args.compile)))
    if args.no_cascade:
        import dataclasses
        backend.plan = dataclasses.replace(backend.plan, shared_prefix_decode="none")
    print(f"plan: {backend.plan.describe()}")
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    reqs = []
    shared = torch.randint(100, vocab, (args.context,), generator=gen).tolist()
    for i in range(num_seqs):
        table = list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per))
        prompt = torch.randint(100, vocab, (args.context,), generator=gen).tolist()
        if args.shared_prefix:
            # request 0's full prompt blocks, then its own (each prefill
            # writes the same values into the shared blocks)
            full = args.context // bs
            table = list(range(1, 1 + full)) + table[full:]
            prompt = shared
        reqs.append([f"r{i}", prompt, table])
    # Prefill one request at a time (the chunks' requests: their cached part).
    last = {}
    for i, (rid, prompt, table) in enumerate(reqs):
        if i >= args.batch:
            prompt = prompt[:chunk_ctx]
            if not prompt:
                continue
        res = backend.execute(SchedulerOutput([ScheduledRequest(
            rid, prompt, 0, table, True, params, 0, prompt)]))
        last[rid] = res.token_ids[0]
    pos = args.context
    decodes, chunks = reqs[:args.batch], reqs[args.batch:]
    suffix = torch.randint(100, vocab, (args.prefill_len,), generator=gen).tolist()

    def step():
        nonlocal pos
        # The chunks recompute the same positions every step (same cost).
        out = SchedulerOutput([ScheduledRequest(rid, [last[rid]], pos, table, True, params, 1)
                               for rid, _p, table in decodes]
                              + [ScheduledRequest(rid, suffix, chunk_ctx, table, True,
                                                  params, 0, None if chunk_ctx else suffix)
                                 for rid, _p, table in chunks])
        t = time.perf_counter()
        res = backend.execute(out)
        dt = time.perf_counter() - t
        for rid, tok in zip(res.request_ids, res.token_ids):
            last[rid] = tok
        pos += 1
        return dt, res.timings

    t = time.perf_counter()
    step()
    step()
    print(f"first two decode steps: {time.perf_counter() - t:.1f} s")
    times = [step() for _ in range(args.steps)]
    ms = [t * 1e3 for t, _ in times]
    fwd = statistics.median(tm.forward for _, tm in times) * 1e3
    print(f"batch {args.batch} context {args.context} {args.dtype} threads "
          f"{torch.get_num_threads()}: step p50 {statistics.median(ms):.1f} ms "
          f"(min {min(ms):.1f}), forward p50 {fwd:.1f} ms, "
          f"{args.batch / statistics.median(ms) * 1e3:.0f} tok/s"
          + (f" (+ {args.prefill_rows} chunks of {args.prefill_len} over {chunk_ctx} cached)"
             if chunks else ""))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
