"""Inter-token latency with and without a competing busy process.

For each ``--start NAME=COMMAND`` (a server command carrying ``--port``
matching ``--server NAME=URL``): start the server, run ``--num-requests``
streaming completions one at a time on a quiet machine, then the same while
``--hogs`` other processes spin on the CPU (pure-Python busy loops, one core
each), and stop the server. Prints one row per server: c=1 tok/s and
inter-token p50 / p99, quiet and contended. Run it under
``/work/coord/bin/cpu-exclusive`` (or on an otherwise idle machine).

    .venv/bin/python benchmarks/contention.py \
        --server adaptive=http://127.0.0.1:8311 \
        --start 'adaptive=.venv/bin/baton serve --port 8311' \
        --server fixed2=http://127.0.0.1:8312 \
        --start 'fixed2=.venv/bin/baton serve --port 8312 --threads 2'
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import StartedServer, parse_pairs  # noqa: E402
from serve_load import (fetch_model_id, normalize_base_url, run_cli, run_load,  # noqa: E402
                        wait_until_serving)

_SPIN = "while True: pass"


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


async def _measure(name: str, base: str, args: argparse.Namespace, first: int):
    model = await fetch_model_id(base, None, 30.0)
    await wait_until_serving(base, model, None, args.start_timeout, seed=args.seed)
    return await run_load(base, model, 1, args.num_requests, args.prompt_len, args.output_len,
                          seed=args.seed, first_request=first)


async def _main(args: argparse.Namespace) -> int:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for k, (name, url) in enumerate(args.servers.items()):
        base = normalize_base_url(url)
        server = StartedServer(name, args.starts[name], Path(args.log_dir)) \
            if name in args.starts else None
        hogs: list[subprocess.Popen] = []
        try:
            if server:
                print(f"starting {name} ...", flush=True)
                await server.wait_ready(base, args.start_timeout)
            first = 1000 * k
            quiet = await _measure(name, base, args, first)
            hogs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(args.hogs)]
            time.sleep(args.settle)
            busy = await _measure(name, base, args, first + args.num_requests)
            rows.append((name, quiet, busy))
            print(f"  {name}: quiet ITL p50 {_fmt(quiet.itl_p50_ms, '{:.1f}')} ms, "
                  f"with {args.hogs} busy process(es) {_fmt(busy.itl_p50_ms, '{:.1f}')} ms",
                  flush=True)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
            if server:
                server.stop()
    print()
    print(f"{date} · c=1 · prompt {args.prompt_len} random ids · output {args.output_len} "
          f"tokens · {args.num_requests} requests each · {args.hogs} competing busy "
          f"process(es)")
    print("| server | quiet tok/s | quiet ITL p50 (ms) | quiet ITL p99 (ms) "
          "| contended tok/s | contended ITL p50 (ms) | contended ITL p99 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, quiet, busy in rows:
        cells = [f"{r.output_tok_per_s:.1f} | {_fmt(r.itl_p50_ms, '{:.1f}')} | "
                 f"{_fmt(r.itl_p99_ms, '{:.1f}')}" for r in (quiet, busy)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, metavar="NAME=URL")
    ap.add_argument("--start", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--hogs", type=int, default=1, help="competing busy processes")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds between starting the hogs and measuring")
    ap.add_argument("--num-requests", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default="/tmp/contention-logs")
    args = ap.parse_args(argv)
    args.servers = parse_pairs(args.server, "--server")
    args.starts = parse_pairs(args.start, "--start")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_cli("contention", _main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
