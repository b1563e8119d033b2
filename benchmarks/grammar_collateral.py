"""What expensive grammars cost everyone else: an innocent stream's time
beside hostile structured-output requests, and the server's resident memory
after many distinct fuel-exhausting schemas (docs/security.md).

Starts `baton serve` from ``--root`` (a checkout: this one by default, or
another to compare against) on the embedded model, then for each scenario
runs one innocent greedy chat stream (64 tokens) alone and beside
``--hostile`` constrained requests sent at the same moment, and prints the
innocent stream's seconds, the hostile requests' outcomes, and the server's
RSS before and after ``--schemas`` distinct fuel-exhausting schemas.

    .venv/bin/python benchmarks/grammar_collateral.py [--root PATH] [--hostile 8] \
        [--schemas 16] [--repeat 2] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parents[1]
INNOCENT = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}


def _schema_pattern(i: int) -> dict:
    """Refused at compile time now: the pattern's lexer is past the limits."""
    return {"type": "object", "properties": {"a": {"type": "string",
                                                   "pattern": f"^x{{{1000000 + i}}}$"}},
            "required": ["a"]}


def _schema_mid_output(i: int) -> dict:
    """Compiles; fails once the output reaches the pattern."""
    return {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "a": {"type": "string", "pattern": f"^x{{{1000000 + i}}}$"}},
        "required": ["n", "a"], "additionalProperties": False}


def _regex_heavy(i: int) -> dict:
    """Valid but ~28 ms a mask: the per-request budget's case."""
    return {"regex": f"x{{{30000 + i}}}"}


SCENARIOS = {
    "no constraint (the batch's cost)": lambda i: {"seed": i},
    "pattern x{1e6} (json)": lambda i: {"response_format": {
        "type": "json_schema", "json_schema": {"name": "h", "schema": _schema_pattern(i)}}},
    "pattern after a field": lambda i: {"response_format": {
        "type": "json_schema", "json_schema": {"name": "h", "schema": _schema_mid_output(i)}}},
    "regex x{30000}": lambda i: {"structured_outputs": _regex_heavy(i)},
    "choice of 3,000": lambda i: {"structured_outputs": {
        "choice": [f"label {i} number {k}" for k in range(3000)]}},
}


async def _innocent(http: aiohttp.ClientSession) -> float:
    start = time.perf_counter()
    async with http.post("/v1/chat/completions", json=INNOCENT) as resp:
        async for _ in resp.content:
            pass
    return time.perf_counter() - start


async def _hostile(http: aiohttp.ClientSession, extra: dict) -> str:
    body = {"messages": [{"role": "user", "content": "Write a record."}], "max_tokens": 64,
            "temperature": 0, **extra}
    async with http.post("/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        if resp.status == 200:
            return f"200 {payload['choices'][0]['finish_reason']}"
        error = payload["error"]
        return f"{resp.status} {error.get('code') or error['type']}"


async def _scenario(base: str, make, hostile: int, offset: int) -> tuple[float, Counter]:
    async with aiohttp.ClientSession(base_url=base,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = [asyncio.create_task(_hostile(http, make(offset + i))) for i in range(hostile)]
        innocent = await _innocent(http)
        outcomes = Counter(await asyncio.gather(*tasks))
    return innocent, outcomes


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run(args, base: str, pid: int) -> None:
    async with aiohttp.ClientSession(base_url=base) as http:
        await _innocent(http)  # warm
        alone = sorted([await _innocent(http) for _ in range(args.repeat + 1)])
    print(f"innocent stream alone: {alone[len(alone) // 2]:.2f} s (median of {len(alone)})")
    print(f"{'beside ' + str(args.hostile) + ' requests with':32s} innocent s   hostile outcomes")
    offset = 0
    for name, make in SCENARIOS.items():
        for _ in range(args.repeat):
            offset += args.hostile
            innocent, outcomes = await _scenario(base, make, args.hostile, offset)
            print(f"{name:32s} {innocent:9.2f}   {dict(outcomes)}", flush=True)
    before = _rss_mib(pid)
    async with aiohttp.ClientSession(base_url=base,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        outcomes = Counter()
        for i in range(args.schemas):
            outcomes[await _hostile(http, SCENARIOS["pattern after a field"](10_000 + i))] += 1
            outcomes[await _hostile(http, SCENARIOS["pattern x{1e6} (json)"](20_000 + i))] += 1
    after = _rss_mib(pid)
    print(f"RSS after {args.schemas} x 2 distinct fuel-exhausting schemas: {before:.0f} -> "
          f"{after:.0f} MiB (+{after - before:.0f}); outcomes {dict(outcomes)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout to serve")
    parser.add_argument("--hostile", type=int, default=8)
    parser.add_argument("--schemas", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("serve_args", nargs="*", help="more `baton serve` flags (after --)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from benchmarks.soak import _wait_ready, free_port
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port),
           "--max-model-len", "1024", "--kv-cache-memory", "256MiB", *args.serve_args]
    root = args.root.resolve()
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}"
          f"  {os.cpu_count()} CPUs  {root} @ {commit}  {' '.join(cmd[2:])}", flush=True)
    log = tempfile.NamedTemporaryFile(prefix="baton-grammar-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(root),
                                   "BATON_LOG_FORMAT": "json"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, server)
        asyncio.run(run(args, base, server.pid))
    finally:
        server.terminate()
        server.wait(timeout=60)
        print(f"# server log: {log.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
