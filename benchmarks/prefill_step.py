"""Time steps that prefill fresh prompts: what a step of N prompts costs.

For each N of --prompts, builds steps of N fresh prompts of --prompt-len
random tokens (from position 0, as the scheduler hands them to the backend)
plus --decodes decode rows at --context, on the embedded model (or --model),
and prints the step's time: whether the cost of a prefill step is per token
or per step, which is what the scheduler's token budget trades
(``--max-num-batched-tokens``, scheduler/config.py).

    .venv/bin/python benchmarks/prefill_step.py [--prompts 1 2 4 8 16] \
        [--prompt-len 128] [--decodes 0] [--context 160] [--dtype bfloat16] \
        [--steps 5] [--profile N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.device import DTYPES  # noqa: E402
from backends.execution import ExecutionOptions  # noqa: E402
from backends.factory import BackendConfig, create_backend  # noqa: E402
from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput  # noqa: E402
from backends.loader import load_model, resolve_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decodes", type=int, default=0)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile three steps of N prompts and print the top operators")
    ap.add_argument("--verbose", action="store_true", help="print every step's time")
    ap.add_argument("--in-thread", action="store_true",
                    help="run the steps on a worker thread, as the server does (its "
                         "allocations then come from a thread's malloc arena)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model_path(args.model), dtype=DTYPES[args.dtype])
    bs = 16
    most = max(args.prompts + [args.profile])
    per_prompt = -(-args.prompt_len // bs)
    per_decode = -(-(args.context + args.steps * 4 + 8) // bs)
    num_blocks = most * per_prompt + args.decodes * per_decode + 1
    backend = create_backend(loaded, BackendConfig(
        dtype=args.dtype, block_size=bs, num_kv_blocks=num_blocks, threads=args.threads,
        execution=ExecutionOptions()))
    print(f"plan: {backend.plan.describe()}")
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab, (n,), generator=gen).tolist()

    decodes = []
    for i in range(args.decodes):
        table = list(range(1 + most * per_prompt + i * per_decode,
                           1 + most * per_prompt + (i + 1) * per_decode))
        prompt = tokens(args.context)
        res = backend.execute(SchedulerOutput([ScheduledRequest(
            f"d{i}", prompt, 0, table, True, params, 0, prompt)]))
        decodes.append([f"d{i}", table, args.context, res.token_ids[0]])
    serial = iter(range(10**9))

    def step(n: int) -> float:
        out = [ScheduledRequest(rid, [tok], pos, table, True, params, 1)
               for rid, table, pos, tok in decodes]
        for j in range(n):  # fresh request ids: the backend sees new prompts
            prompt = tokens(args.prompt_len)
            table = list(range(1 + j * per_prompt, 1 + (j + 1) * per_prompt))
            out.append(ScheduledRequest(f"p{next(serial)}", prompt, 0, table, True, params,
                                        0, prompt))
        t = time.perf_counter()
        res = backend.execute(SchedulerOutput(out))
        dt = time.perf_counter() - t
        for d, tok in zip(decodes, res.token_ids):
            d[2] += 1
            d[3] = tok
        finished = [r.request_id for r in out[len(decodes):]]
        backend.execute(SchedulerOutput([], finished))
        return dt

    pool = ThreadPoolExecutor(1) if args.in_thread else None

    def run(fn, *a):
        return pool.submit(fn, *a).result() if pool is not None else fn(*a)

    run(step, min(args.prompts))
    run(step, max(args.prompts))
    print(f"{args.dtype}, threads {torch.get_num_threads()}, prompts of {args.prompt_len}"
          f" + {args.decodes} decodes at context {args.context}")
    print("| prompts | tokens | step p50 (ms) | min (ms) | ms per prompt token (p50) "
          "| page faults per step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.prompts:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ms = [run(step, n) * 1e3 for _ in range(args.steps)]
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
        p50 = statistics.median(ms)
        print(f"| {n} | {n * args.prompt_len} | {p50:.1f} | {min(ms):.1f} | "
              f"{p50 / (n * args.prompt_len):.3f} | {faults:.0f} |", flush=True)
        if args.verbose:
            print("  steps (ms):", " ".join(f"{t:.0f}" for t in ms), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step(args.profile)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
