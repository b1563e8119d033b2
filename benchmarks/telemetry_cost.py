"""What step-level tracing costs: serve_load against `baton serve` with
telemetry off and with step-level tracing exported over OTLP gRPC to a local
receiver (oteltest's `otelsink`), alternating, in one run.

    .venv/bin/python benchmarks/telemetry_cost.py [--concurrency 32] [--requests 64]
        [--prompt-len 128] [--output-len 128] [--rounds 2] [--model M] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import run_load  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("baton serve exited while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("baton serve did not become healthy")


def run_mode(args, tracing: bool, first_request: int) -> float:
    port = free_port()
    cmd = [str(ROOT / ".venv/bin/baton"), "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.concurrency), "--log-format", "json"]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if tracing:
        cmd += ["--otlp-traces-endpoint", "http://127.0.0.1:4317", "--trace-detail", "step"]
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        result = asyncio.run(run_load(
            f"http://127.0.0.1:{port}", None, args.concurrency, args.requests,
            args.prompt_len, args.output_len, seed=args.seed, first_request=first_request))
        if result.num_errors:
            raise RuntimeError(f"{result.num_errors} requests failed: {result.errors}")
        return result.output_tok_per_s
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    sink_bin = shutil.which("otelsink") or str(ROOT / ".venv/bin/otelsink")
    sink = subprocess.Popen([sink_bin], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    figures: dict[bool, list[float]] = {False: [], True: []}
    try:
        time.sleep(2)
        first = 0
        for _ in range(args.rounds):
            for tracing in (False, True):
                figures[tracing].append(run_mode(args, tracing, first))
                first += args.requests
                print(f"tracing={'step' if tracing else 'off'}: "
                      f"{figures[tracing][-1]:.1f} tok/s", flush=True)
    finally:
        sink.kill()
    off = sum(figures[False]) / len(figures[False])
    on = sum(figures[True]) / len(figures[True])
    print(f"\n# {time.strftime('%Y-%m-%d')} concurrency {args.concurrency}, {args.requests} "
          f"requests x {args.prompt_len}+{args.output_len} tokens, {args.rounds} rounds")
    print("| telemetry | output tok/s (mean) | runs |")
    print("|---|---|---|")
    print(f"| off | {off:.1f} | {', '.join(f'{v:.1f}' for v in figures[False])} |")
    print(f"| step-level tracing -> OTLP gRPC (otelsink) | {on:.1f} | "
          f"{', '.join(f'{v:.1f}' for v in figures[True])} |")
    print(f"\nchange with tracing: {100 * (on - off) / off:+.1f}%")


if __name__ == "__main__":
    main()
