"""Where a constrained decode step's extra time goes: three batches of BATCH
decoding requests on the torch backend, one free and two under a json_schema
constraint (masks filled before sampling, and deferred), stepped in turn, with each step split into prepare / forward /
sample; then the grammar's own costs timed alone (filling BATCH masks one
after another and with llguidance's parallel executor, applying them to the
logits).

    .venv/bin/python benchmarks/profile_structured_step.py --batch 32 \\
        [--context 128] [--steps 80] [--dtype bfloat16]

Uses the schema of benchmarks/structured_output.py (an array of at least
200 records, so no request completes its grammar within the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends.device import DTYPES  # noqa: E402
from backends.factory import BackendConfig, create_backend  # noqa: E402
from backends.interface import (SamplingParams, ScheduledRequest,  # noqa: E402
                                SchedulerOutput, StructuredOutputSpec)
from backends.loader import load_model, resolve_model_path  # noqa: E402
from backends.sampler import apply_token_bitmask  # noqa: E402
from structured_output import RECORDS  # noqa: E402


class Batch:
    """BATCH requests of one kind, prefilled, that step together."""

    def __init__(self, backend, tag: str, params: SamplingParams, batch: int,
                 context: int, blocks_per: int, first_block: int, vocab: int) -> None:
        self.backend, self.params = backend, params
        gen = torch.Generator().manual_seed(0)
        self.reqs = []
        for i in range(batch):
            lo = first_block + i * blocks_per
            prompt = torch.randint(100, vocab, (context,), generator=gen).tolist()
            self.reqs.append((f"{tag}{i}", prompt, list(range(lo, lo + blocks_per))))
        self.last: dict[str, int] = {}
        for rid, prompt, table in self.reqs:
            res = backend.execute(SchedulerOutput([ScheduledRequest(
                rid, prompt, 0, table, True, params, 0, prompt)]))
            self.last[rid] = res.token_ids[0]
        self.pos = context

    def step(self):
        out = SchedulerOutput([ScheduledRequest(rid, [self.last[rid]], self.pos, table, True,
                                                self.params, 1)
                               for rid, _p, table in self.reqs])
        t = time.perf_counter()
        res = self.backend.execute(out)
        dt = time.perf_counter() - t
        self.last.update(zip(res.request_ids, res.token_ids))
        self.pos += 1
        return dt, res.timings


def summarise(label: str, samples) -> None:
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"  {label:<12} step p50 {ms([d for d, _ in samples]):7.2f} ms | "
          f"prepare {ms([t.prepare for _, t in samples]):6.2f}  "
          f"forward {ms([t.forward for _, t in samples]):7.2f}  "
          f"sample {ms([t.sample for _, t in samples]):6.2f}")


def grammar_costs(backend, matchers, vocab: int, repeat: int = 20) -> None:
    """The grammar work of one step, timed alone on an idle machine."""
    import llguidance
    import llguidance.torch as llt
    width = (vocab + 31) // 32
    n = len(matchers)
    bitmask = torch.empty((n, width), dtype=torch.int32)

    def timed(fn) -> float:
        xs = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t)
        return statistics.median(xs) * 1e3

    serial = timed(lambda: [m.fill_bitmask(bitmask[i]) for i, m in enumerate(matchers)])
    print(f"  fill {n} masks serially:            {serial:7.2f} ms "
          f"({serial / n * 1e3:.0f} us each)")
    for threads in (1, 2):
        ex = llguidance.LLExecutor(num_threads=threads)
        pairs = [(m.matcher, i) for i, m in enumerate(matchers)]
        par = timed(lambda: llt.fill_next_token_bitmask_par(ex, pairs, bitmask))
        print(f"  fill {n} masks, LLExecutor({threads}):     {par:7.2f} ms")
    logits = torch.randn(n, vocab)
    rows = torch.arange(n)
    work = logits.clone()
    apply = timed(lambda: apply_token_bitmask(work.copy_(logits), rows, bitmask))
    clone = timed(lambda: work.copy_(logits))
    print(f"  apply_token_bitmask [{n}, {vocab}]:  {apply - clone:7.2f} ms")
    allowed = bitmask.ne(0).sum().item()
    print(f"  nonzero mask words: {allowed} of {bitmask.numel()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    loaded = load_model(resolve_model_path(args.model), dtype=DTYPES[args.dtype])
    vocab = loaded.config.vocab_size
    bs = args.block_size
    max_ctx = args.context + args.steps + 8
    blocks_per = -(-max_ctx // bs)
    backend = create_backend(loaded, BackendConfig(
        dtype=args.dtype, block_size=bs, num_kv_blocks=3 * args.batch * blocks_per + 1))
    print(f"plan: {backend.plan.describe()}; torch threads {torch.get_num_threads()}")
    plain = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    spec = StructuredOutputSpec("json", json.dumps(RECORDS))
    constrained = SamplingParams(temperature=0.0, max_tokens=10**6,
                                 structured=spec)
    # One batch per kind, stepped in turn (one step each), so all decode at
    # the same positions and drifts in the machine's speed touch all alike.
    # The two constrained batches differ only in when their masks are filled:
    # before sampling ("masked") or only for rows whose unmasked pick the
    # grammar rejects ("deferred"); both produce the same tokens.
    span = args.batch * blocks_per
    batches = {"plain": Batch(backend, "p", plain, args.batch, args.context, blocks_per, 1,
                              vocab),
               "json masked": Batch(backend, "c", constrained, args.batch, args.context,
                                    blocks_per, 1 + span, vocab),
               "json deferred": Batch(backend, "d", constrained, args.batch, args.context,
                                      blocks_per, 1 + 2 * span, vocab)}
    orders = {"plain": None, "json masked": False, "json deferred": True}
    samples: dict[str, list] = {k: [] for k in batches}
    counts = dict(backend.grammar_rows)
    for step in range(args.steps + 1):
        for label, b in batches.items():
            backend.defer_grammar_masks = orders[label]
            if label == "json deferred" and step == 1:
                counts = dict(backend.grammar_rows)
            sample = b.step()
            if step:           # the first is a warm-up
                samples[label].append(sample)
    print(f"batch {args.batch}, context {args.context}, {args.dtype}, "
          f"{args.steps} steps each, interleaved:")
    for label, xs in samples.items():
        summarise(label, xs)
    unmasked = backend.grammar_rows["unmasked"] - counts["unmasked"]
    repicked = backend.grammar_rows["repicked"] - counts["repicked"]
    print(f"  deferred rows: {unmasked} picks allowed unmasked, {repicked} rejected and "
          f"picked again masked ({unmasked / max(1, unmasked + repicked):.1%} without a mask)")
    same = all(batches["json masked"].last[f"c{i}"] == batches["json deferred"].last[f"d{i}"]
               for i in range(args.batch))
    print(f"  masked and deferred batches end on the same tokens: {same}")
    matchers = [backend._states[rid].grammar for rid, _p, _t in batches["json masked"].reqs]
    print("grammar work alone (state after the run above):")
    grammar_costs(backend, matchers, vocab)
    backend.shutdown()


if __name__ == "__main__":
    main()
