"""How long a server takes from its start to serving, and what its first
requests cost: each `--start NAME=COMMAND` is started `--rounds` times, one
at a time; per run this prints the seconds from the process's start until
`--ready-path` answers 200 (`/health` for Baton), then the latency of the
first and second request (a 16-token greedy completion of a short prompt)
and, from a Baton JSON log, the seconds its load phases logged.

    .venv/bin/python benchmarks/start_time.py --rounds 3 \\
        --start 'baton=.venv/bin/baton serve --port {port}' \\
        --start 'hf-folder=.venv/bin/baton serve /work/peers/smollm2-hf --port {port}'

`{port}` in a command becomes a free port. Figures are medians over the
rounds; every run is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime

PROMPT = "The capital of France is"


@dataclass
class Run:
    ready_s: float
    first_request_s: float
    second_request_s: float
    phases: dict[str, float] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _complete(base: str, model: str | None) -> float:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as resp:
        resp.read()
    return time.perf_counter() - start


def _model_id(base: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError):
        return None


_SECONDS = re.compile(r"([\d.]+)s\b")


def _phases(log_text: str, started_at: float) -> dict[str, float]:
    """Seconds Baton's JSON log lines give for its load phases, and when it
    began listening (its "loading" line, seconds after ``started_at``, a
    time.time(): interpreter start and imports)."""
    phases = {}
    for line in log_text.splitlines():
        try:
            record = json.loads(line)
            event = record.get("event", "")
        except (ValueError, AttributeError):
            continue
        if event == "loading" and "timestamp" in record:
            at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
            phases["listening"] = at.timestamp() - started_at
        for key, prefix in (("model loaded", "model loaded:"), ("warm-up", "warm-up:"),
                            ("cache read", "conversion cache: ")):
            if key == "cache read" and " read from " not in event:
                continue
            if event.startswith(prefix):
                found = _SECONDS.findall(event)
                if found:
                    phases[key] = float(found[-1])
    return phases


def measure(command: str, ready_path: str, timeout: float) -> Run:
    port = _free_port()
    argv = shlex.split(command.replace("{port}", str(port)))
    env = {**os.environ, "BATON_LOG_FORMAT": "json"}
    with tempfile.TemporaryFile("w+") as log:
        start, started_at = time.perf_counter(), time.time()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            while _get(base + ready_path) != 200:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{argv[0]} exited ({proc.returncode}):\n"
                                       + log.read()[-2000:])
                if time.perf_counter() - start > timeout:
                    raise RuntimeError(f"not ready after {timeout:.0f}s")
                time.sleep(0.05)
            ready = time.perf_counter() - start
            model = _model_id(base)
            first = _complete(base, model)
            second = _complete(base, model)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return Run(ready, first, second, _phases(log.read(), started_at))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", action="append", required=True, metavar="NAME=COMMAND")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ready-path", default="/health")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--prime", action="append", default=[], metavar="NAME",
                    help="start NAME once, unmeasured, before the rounds (fills on-disk caches "
                         "such as Baton's conversion cache, so every round sees them warm)")
    args = ap.parse_args(argv)
    servers = [s.split("=", 1) for s in args.start]
    results: dict[str, list[Run]] = {name: [] for name, _ in servers}
    for name, command in servers:
        if name in args.prime:
            run = measure(command, args.ready_path, args.timeout)
            print(f"prime {name}: ready {run.ready_s:.2f}s (not counted), {run.phases}",
                  flush=True)
    for round_ in range(args.rounds):
        for name, command in servers:
            run = measure(command, args.ready_path, args.timeout)
            results[name].append(run)
            print(f"round {round_ + 1} {name}: ready {run.ready_s:.2f}s, first request "
                  f"{run.first_request_s * 1000:.0f} ms, second {run.second_request_s * 1000:.0f}"
                  f" ms, {run.phases}", flush=True)
    print("\n| server | start to ready (s) | first request (ms) | second request (ms) "
          "| listening (s) | model loaded (s) | warm-up (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        def med(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else float("nan")
        print(f"| {name} | {med(r.ready_s for r in runs):.2f} | "
              f"{med(r.first_request_s for r in runs) * 1000:.0f} | "
              f"{med(r.second_request_s for r in runs) * 1000:.0f} | "
              f"{med(r.phases.get('listening') for r in runs):.2f} | "
              f"{med(r.phases.get('model loaded') for r in runs):.2f} | "
              f"{med(r.phases.get('warm-up') for r in runs):.2f} |")
    for name, runs in results.items():
        print(f"{name}: slowest round ready in {max(r.ready_s for r in runs):.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
