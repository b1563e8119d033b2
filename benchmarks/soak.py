"""Soak: mixed load on a live `baton serve` for a chosen time, watching for leaks.

Clients loop over a seeded mix of requests: completions and chat, streamed and
whole, n = 1 or 2, stop strings, logprobs, and about 20% that disconnect early
(a stream closed after a few chunks, a whole request given up after a moment).
Every --interval seconds it prints the server's RSS, the KV blocks requests hold,
the entries of every per-request table (``baton_request_state_entries``) and the
request counts; at the end it stops the load, waits for the server to go idle and
prints the final sizes (all should be 0) and the RSS growth after warm-up.

    .venv/bin/python benchmarks/soak.py --duration 1800 [--concurrency 16] \
        [--disconnect 0.2] [--interval 15] [--warmup 120] [--model PATH] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "List three colours:", "Explain paged attention."]
QUESTIONS = ["What is the capital of France?", "Tell me a joke about computers.",
             "Summarise the plot of Hamlet in two sentences.", "How do I boil an egg?"]
_SAMPLE = re.compile(r'^(\w+)(?:\{([^}]*)\})? ([0-9.e+-]+)$', re.MULTILINE)


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(8, 96), "temperature": rng.choice([0.0, 0.8]),
                  "n": 2 if rng.random() < 0.3 else 1, "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["\n\n"], [".", "!"], ["the"]])
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        return "/v1/chat/completions", body
    body["prompt"] = rng.choice(PROMPTS)
    return "/v1/completions", body


async def client(http: aiohttp.ClientSession, seed: int, deadline: float,
                 disconnect: float, counts: Counter) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        route, body = request_body(rng)
        leave = rng.random() < disconnect
        try:
            if body["stream"]:
                async with http.post(route, json=body) as resp:
                    counts[f"status_{resp.status}"] += 1
                    chunks = 0
                    async for _ in resp.content:
                        chunks += 1
                        if leave and chunks >= rng.randint(1, 6):
                            counts["disconnected"] += 1
                            resp.close()
                            break
            elif leave:
                task = asyncio.ensure_future(_whole(http, route, body, counts))
                await asyncio.sleep(rng.uniform(0.02, 0.8))
                if not task.done():
                    counts["disconnected"] += 1
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            else:
                await _whole(http, route, body, counts)
            counts["requests"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            counts[f"client_error_{type(exc).__name__}"] += 1


async def _whole(http, route, body, counts) -> None:
    async with http.post(route, json=body) as resp:
        await resp.read()
        counts[f"status_{resp.status}"] += 1


async def scrape(http: aiohttp.ClientSession) -> dict:
    async with http.get("/metrics") as resp:
        text = await resp.text()
    out: dict = {"tables": {}}
    for name, labels, value in _SAMPLE.findall(text):
        if name == "process_resident_memory_bytes":
            out["rss"] = float(value)
        elif name == "baton_request_state_entries":
            table = re.search(r'table="([^"]+)"', labels).group(1)
            out["tables"][table] = int(float(value))
        elif name in ("baton_num_requests_running", "baton_num_requests_waiting"):
            out[name] = int(float(value))
    return out


def line(t: float, sample: dict, counts: Counter) -> str:
    tables = sample["tables"]
    held = tables.get("kv_blocks_held", 0)
    others = {k: v for k, v in tables.items() if k != "kv_blocks_held"}
    errors = sum(v for k, v in counts.items() if k.startswith("status_5"))
    return (f"{t:7.0f} s  rss {sample['rss'] / 2**20:8.1f} MiB  kv_blocks_held {held:4d}  "
            f"tables {sum(others.values()):4d} {dict(sorted(others.items()))}  "
            f"requests {counts['requests']:6d}  disconnected {counts['disconnected']:5d}  "
            f"5xx {errors}")


async def soak(args, base: str) -> int:
    counts: Counter = Counter()
    timeout = aiohttp.ClientTimeout(total=600)
    series: list[tuple[float, dict]] = []
    async with aiohttp.ClientSession(base_url=base, timeout=timeout) as http, \
            aiohttp.ClientSession(base_url=base, timeout=timeout) as monitor:
        t0 = time.monotonic()
        deadline = t0 + args.duration
        clients = [asyncio.create_task(client(http, 1000 + i, deadline, args.disconnect, counts))
                   for i in range(args.concurrency)]
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
            sample = await scrape(monitor)
            series.append((time.monotonic() - t0, sample))
            print(line(series[-1][0], sample, counts), flush=True)
        await asyncio.gather(*clients)
        # Idle: every table must come back to zero.
        for _ in range(300):
            sample = await scrape(monitor)
            if not any(sample["tables"].values()):
                break
            await asyncio.sleep(0.1)
        print("idle   " + line(time.monotonic() - t0, sample, counts), flush=True)
    warm = [s for t, s in series if t >= args.warmup] or [series[0][1]]
    base_rss, end_rss = warm[0]["rss"], sample["rss"]
    peak_rss = max(s["rss"] for s in warm)
    growth = (end_rss - base_rss) / base_rss * 100
    print(f"\nrequests {counts['requests']}, disconnected {counts['disconnected']}, "
          f"statuses {dict(sorted((k, v) for k, v in counts.items() if k.startswith('status')))}, "
          f"client errors {sum(v for k, v in counts.items() if k.startswith('client_error'))}")
    print(f"RSS after warm-up ({args.warmup:.0f} s) {base_rss / 2**20:.1f} MiB, peak "
          f"{peak_rss / 2**20:.1f} MiB, at the end {end_rss / 2**20:.1f} MiB: "
          f"growth {growth:+.2f}%")
    print(f"per-request tables when idle: {sample['tables']}")
    leaked = any(sample["tables"].values())
    server_errors = sum(v for k, v in counts.items() if k.startswith("status_5"))
    return 1 if leaked or server_errors else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.2,
                        help="share of requests whose client leaves early")
    parser.add_argument("--interval", type=float, default=15)
    parser.add_argument("--warmup", type=float, default=120,
                        help="seconds after which RSS growth is measured")
    parser.add_argument("--model", default=None)
    parser.add_argument("serve_args", nargs="*", help="more `baton serve` flags (after --)")
    args = parser.parse_args()

    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port),
           "--max-model-len", "1024", "--kv-cache-memory", "256MiB", *args.serve_args]
    if args.model:
        cmd += ["--model", args.model]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.processor() or platform.machine()}"
          f"  {os.cpu_count()} CPUs  {' '.join(cmd[2:])}")
    print(f"# concurrency {args.concurrency}, disconnect {args.disconnect:.0%}, "
          f"duration {args.duration:.0f} s, sample every {args.interval:.0f} s", flush=True)
    log = tempfile.NamedTemporaryFile(prefix="baton-soak-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "BATON_LOG_FORMAT": "json"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, server)
        return asyncio.run(soak(args, base))
    finally:
        server.terminate()
        server.wait(timeout=60)
        print(f"# server log: {log.name}")


def _wait_ready(base: str, server: subprocess.Popen) -> None:
    import urllib.request
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"baton serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("baton serve did not become ready")


if __name__ == "__main__":
    sys.exit(main())
