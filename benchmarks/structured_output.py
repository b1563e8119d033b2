"""The per-token cost of constrained decoding, in one run: streaming
completions at each concurrency without a constraint and with a JSON-schema
constraint (`response_format`), alternating, plus schema compile times.

Both kinds of request produce exactly OUTPUT tokens: unconstrained ones with
`ignore_eos`, constrained ones because the schema (an array of at least 200
records) cannot be complete within OUTPUT tokens, so end-of-sequence is never
allowed and every request ends by `max_tokens`. Prompts are fresh random
token ids (serve_load's workload), temperature 0.

    .venv/bin/python benchmarks/structured_output.py \\
        [--start 'baton serve --port 8000' | --base-url http://127.0.0.1:8000] \\
        [--concurrency 1 32] [--num-requests 6 64] [--output-len 128] [--rounds 2]

Prints a markdown table (ITL p50 / p99 and output tok/s per concurrency, each
plain and constrained, and the constrained/plain ratios) and the compile time
of a few schemas on the embedded model's tokenizer with a cold cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import fetch_model_id, run_load, wait_until_serving  # noqa: E402

RECORDS = {"type": "object", "properties": {"records": {
    "type": "array", "minItems": 200, "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"}},
        "required": ["name", "age", "city", "role", "active"],
        "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
CONSTRAINED = {"ignore_eos": None, "response_format": {
    "type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}}


def compile_times() -> dict[str, float]:
    """Milliseconds to compile each schema with a cold cache (tokenizer table
    built first, as a warmed-up server has it)."""
    import torch
    from backends.grammar import GrammarCompiler
    from backends.interface import StructuredOutputSpec
    from backends.loader import load_model
    from grammar_engines import SCHEMAS
    loaded = load_model(None, dtype=torch.float32)
    compiler = GrammarCompiler(loaded.tokenizer.tokenizer, loaded.config.vocab_size,
                               loaded.generation.eos_token_ids)
    t0 = time.perf_counter()
    compiler.warm_up()
    out = {"tokenizer table (once)": (time.perf_counter() - t0) * 1e3}
    for name, schema in {"records (benchmark)": RECORDS,
                         **{k: v[0] for k, v in SCHEMAS.items()}}.items():
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputSpec("json", json.dumps(schema)))
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


async def wait_ready(base_url: str, timeout: float = 300.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fetch_model_id(base_url, timeout=5.0)
        except Exception:  # noqa: BLE001 - still starting
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def measure(args) -> list[dict]:
    model = await wait_ready(args.base_url)
    # A server listens (and lists its model) before its warm-up ends: 503 until then.
    await wait_until_serving(args.base_url, model, seed=args.seed)
    # Warm-up: both paths once (kernels built, grammar cached).
    for extra in (None, CONSTRAINED):
        await run_load(args.base_url, model, 1, 1, args.prompt_len, 8, seed=args.seed,
                       first_request=10**6, extra_body=extra)
    rows, next_request = [], 0
    for round_ in range(args.rounds):
        for conc, num in zip(args.concurrency, args.num_requests):
            for label, extra in (("plain", None), ("json_schema", CONSTRAINED)):
                r = await run_load(args.base_url, model, conc, num, args.prompt_len,
                                   args.output_len, seed=args.seed, first_request=next_request,
                                   extra_body=extra)
                next_request += num
                if r.num_errors:
                    raise SystemExit(f"{label} c={conc}: errors {r.errors}")
                rows.append({"round": round_, "concurrency": conc, "kind": label,
                             "tok_s": r.output_tok_per_s, "itl_p50": r.itl_p50_ms,
                             "itl_p99": r.itl_p99_ms, "short": r.num_short})
                print(f"# round {round_} c={conc} {label}: {r.output_tok_per_s:.1f} tok/s, "
                      f"ITL p50 {r.itl_p50_ms:.1f} ms p99 {r.itl_p99_ms:.1f} ms, "
                      f"short {r.num_short}", flush=True)
    return rows


def report(rows: list[dict], concurrency: list[int]) -> None:
    def med(conc, kind, key):
        return statistics.median(r[key] for r in rows
                                 if r["concurrency"] == conc and r["kind"] == kind)
    print("| concurrency | plain tok/s | json_schema tok/s | tok/s ratio | plain ITL p50 (ms) "
          "| json_schema ITL p50 (ms) | ITL ratio | plain ITL p99 | json_schema ITL p99 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in concurrency:
        pt, ct = med(c, "plain", "tok_s"), med(c, "json_schema", "tok_s")
        pi, ci = med(c, "plain", "itl_p50"), med(c, "json_schema", "itl_p50")
        print(f"| {c} | {pt:.1f} | {ct:.1f} | {ct / pt:.3f} | {pi:.2f} | {ci:.2f} | "
              f"{ci / pi:.3f} | {med(c, 'plain', 'itl_p99'):.2f} | "
              f"{med(c, 'json_schema', 'itl_p99'):.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--start", default=None, help="command that starts the server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-requests", type=int, nargs="+", default=[6, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server-log", default=None,
                        help="file for the started server's output (its last line says "
                             "how constrained rows were masked)")
    args = parser.parse_args()
    if len(args.num_requests) != len(args.concurrency):
        parser.error("give one --num-requests per --concurrency")
    for name, ms in compile_times().items():
        print(f"compile {name}: {ms:.1f} ms")
    server = None
    if args.start:
        log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
        server = subprocess.Popen(shlex.split(args.start), start_new_session=True,
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        rows = asyncio.run(measure(args))
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    report(rows, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
