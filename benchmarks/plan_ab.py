"""A/B of one decode step in one process: the plan as chosen against the same
plan with some of its parts replaced (what retiring a native kernel would
leave, for instance), alternating single steps.

Two backends of the same model run BATCH requests of CONTEXT random prompt
tokens each; the script then alternates one decode step of each, --pairs
times (which goes first alternates too), so both see the same drift of the
machine. Prints each side's plan line, the median step of each, the ratio of
the medians and the median ratio of a pair (B over A: above 1, A is faster).

    .venv/bin/python benchmarks/plan_ab.py --replace norm=torch,activation=torch,rope_kv_store=torch \\
        [--model M] [--quantization gguf] [--batch 1] [--pairs 300] [--enforce-eager]

The backend built second ran ~2% faster on the AVX2 EPYC whatever it held
(memory placement): run each comparison both ways, the second with
``--build-b-first``.

With ``--b-through-dynamo`` (``--replace`` then optional), B's compiled
step calls its graphs through Dynamo at every step, as it did before
each graph's code was called directly (backends/compiled_step.py).

The fields are those of ``backends.execution.ExecutionPlan`` (its
``describe()`` line names them); an unknown field fails, but a value the
backend does not know is not always refused (an unknown ``lm_head`` runs as
torch's): read B's plan line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import factory  # noqa: E402
from backends.device import DTYPES  # noqa: E402
from backends.execution import ExecutionOptions  # noqa: E402
from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput  # noqa: E402
from backends.loader import load_model, resolve_model_path  # noqa: E402
from backends.quantization.spec import QuantizationSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replace", default="",
                    help="FIELD=VALUE[,FIELD=VALUE...] of the execution plan for side B")
    ap.add_argument("--build-b-first", action="store_true",
                    help="build side B's backend before A's (the second one built runs faster)")
    ap.add_argument("--b-through-dynamo", action="store_true",
                    help="B's compiled step calls its graphs through Dynamo every step")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--enforce-eager", dest="compile", action="store_false")
    args = ap.parse_args()
    changes = dict(item.split("=", 1) for item in args.replace.split(",") if item)
    if not changes and not args.b_through_dynamo:
        ap.error("name what side B changes: --replace, --b-through-dynamo or both")

    path = resolve_model_path(args.model)
    bs = 16
    blocks_per = -(-(args.context + args.pairs + 24) // bs)

    def load():
        if args.quantization == "gguf":  # as the engine loads it: the file's blocks kept
            from backends.loader.gguf import load_gguf
            from backends.quantization import gguf_block_types
            return load_gguf(path, dtype=DTYPES[args.dtype], keep_quantized=gguf_block_types())
        return load_model(path, dtype=DTYPES[args.dtype])

    planned = factory.make_plan

    def side(replace: bool) -> dict:
        if replace:
            factory.make_plan = lambda *a, **k: dataclasses.replace(planned(*a, **k), **changes)
        try:
            loaded = load()
            backend = factory.create_backend(loaded, factory.BackendConfig(
                dtype=args.dtype, block_size=bs, num_kv_blocks=args.batch * blocks_per + 1,
                quantization=QuantizationSpec(args.quantization),
                execution=ExecutionOptions(compile=args.compile)))
        finally:
            factory.make_plan = planned
        if replace and args.b_through_dynamo:
            if backend._compiled is None:
                ap.error("--b-through-dynamo: B's plan has no compiled step")
            backend._compiled._graphs = dict.fromkeys(backend._compiled._graphs,
                                                      backend._compiled._fn)
        print(f"{'B' if replace else 'A'}: {backend.plan.describe()}"
              f"{', graphs through Dynamo' if replace and args.b_through_dynamo else ''}",
              flush=True)
        gen = torch.Generator().manual_seed(0)
        rows = {}
        for i in range(args.batch):
            table = list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per))
            prompt = torch.randint(100, loaded.config.vocab_size, (args.context,),
                                   generator=gen).tolist()
            res = backend.execute(SchedulerOutput([ScheduledRequest(
                f"r{i}", prompt, 0, table, True, params, 0, prompt)]))
            rows[f"r{i}"] = [res.token_ids[0], table]
        return {"backend": backend, "rows": rows, "pos": args.context, "times": []}

    def step(s: dict) -> None:
        out = SchedulerOutput([ScheduledRequest(rid, [tok], s["pos"], table, True, params, 1)
                               for rid, (tok, table) in s["rows"].items()])
        t = time.perf_counter()
        res = s["backend"].execute(out)
        s["times"].append(time.perf_counter() - t)
        for rid, tok in zip(res.request_ids, res.token_ids):
            s["rows"][rid][0] = tok
        s["pos"] += 1

    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    if args.build_b_first:
        b = side(True)
        a = side(False)
    else:
        a, b = side(False), side(True)
    for _ in range(3):  # warm
        step(a)
        step(b)
    a["times"].clear()
    b["times"].clear()
    for i in range(args.pairs):
        for s in ((a, b) if i % 2 else (b, a)):
            step(s)
    ta, tb = a["times"], b["times"]
    ratios = [y / x for x, y in zip(ta, tb)]
    print(f"{args.pairs} pairs of single steps, batch {args.batch}, context {args.context}+: "
          f"A {statistics.median(ta) * 1e3:.3f} ms, B {statistics.median(tb) * 1e3:.3f} ms "
          f"(p50); B/A {statistics.median(tb) / statistics.median(ta):.3f} of the medians, "
          f"{statistics.median(ratios):.3f} median of the pairs, B faster in "
          f"{sum(r < 1 for r in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
