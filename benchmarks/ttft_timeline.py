"""Where time to first token goes: a timeline of one served load.

Runs `baton serve` in this process (the same server, with one more step
observer) and `serve_load.py` against it in a child process, then prints, for
every request: when it arrived, when it was handed to the engine, the step
that computed the last chunk of its prompt, when the engine sampled its first
token and when the handler got it; and for every step: its start, duration,
decode rows, prefill tokens and how many prompts it finished.

    .venv/bin/python benchmarks/ttft_timeline.py [--concurrency 32] \
        [--num-requests 32] [--prompt-len 128] [--output-len 128] \
        [--steps 40] [--json OUT.json] -- [baton serve flags ...]

All times are milliseconds from the first request's arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler import async_engine  # noqa: E402
from scheduler.async_engine import AsyncEngine  # noqa: E402
from service import observability  # noqa: E402
from service.cli import parse_serve_argv  # noqa: E402
from service.serve import serve  # noqa: E402
from service.tensor_parallel import free_port  # noqa: E402

EPOCH_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


class Recorder:
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.added: dict[str, float] = {}
        self.requests: list[dict] = []
        self.engine: AsyncEngine | None = None

    def on_step(self, stats) -> None:
        t = stats.timings
        self.steps.append(dict(
            start=(stats.start_ns - EPOCH_MINUS_MONOTONIC_NS) / 1e9,
            end=(stats.end_ns - EPOCH_MINUS_MONOTONIC_NS) / 1e9,
            decode=stats.num_decode_tokens, prefill=stats.num_prefill_tokens,
            prefill_ids=list(stats.prefill_request_ids), running=stats.num_running,
            waiting=stats.num_waiting, schedule=t.schedule, prepare=t.prepare,
            forward=t.forward, sample=t.sample, emit=t.emit,
            threads=self.threads()))

    def threads(self) -> int | None:
        """torch threads the backend's thread governor gave the last step."""
        governor = getattr(self.engine.core.backend, "_governor", None) if self.engine else None
        return None if governor is None else governor.threads

    def install(self) -> None:
        rec = self
        attach = observability.Observability.attach
        finish = observability.RequestTelemetry.finish
        add_request = AsyncEngine.add_request

        def attach_and_record(obs, engine):
            attach(obs, engine)
            rec.engine = engine
            engine.step_observers.append(rec.on_step)

        def finish_and_record(tel, error_type=None):
            for index, c in tel.choices.items():
                rid = tel.request_ids[index] if index < len(tel.request_ids) else None
                rec.requests.append(dict(
                    request_id=rid, arrival=tel.arrival, validated=tel.validated,
                    first_scheduled=c.first_scheduled, first_token=c.first_token,
                    first_delivered=c.token_times[0] if c.token_times else None,
                    prompt_tokens=c.prompt_tokens, output_tokens=c.output_tokens))
            finish(tel, error_type)

        def add_and_record(engine, *args, **kwargs):
            request_id = add_request(engine, *args, **kwargs)
            rec.added[request_id] = time.monotonic()
            return request_id

        observability.Observability.attach = attach_and_record
        observability.RequestTelemetry.finish = finish_and_record
        AsyncEngine.add_request = add_and_record


async def drive(rec: Recorder, args: argparse.Namespace, port: int) -> int:
    while rec.engine is None:
        await asyncio.sleep(0.2)
    base = f"http://127.0.0.1:{port}"
    # the load generator in its own process: its event loop must not share
    # this one's (nor the GIL) with the server's
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--base-url", base,
           "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    for _ in range(20):
        try:
            proc = await asyncio.create_subprocess_exec(*cmd)
            rc = await proc.wait()
            break
        except OSError:
            await asyncio.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)  # serve() drains and returns
    return rc


async def main_async(args: argparse.Namespace, serve_argv: list[str]) -> int:
    port = free_port("127.0.0.1")
    engine_args, config = parse_serve_argv([*serve_argv, "--port", str(port),
                                            "--disable-log-requests"])
    rec = Recorder()
    rec.install()
    driver = asyncio.create_task(drive(rec, args, port))
    await serve(engine_args, config)
    rc = await driver
    report(rec, args)
    return rc


def report(rec: Recorder, args: argparse.Namespace) -> None:
    # the last num_requests requests are the load; earlier ones the warm-up
    reqs = sorted(rec.requests, key=lambda r: r["arrival"])[-args.num_requests:]
    t0 = reqs[0]["arrival"]
    steps = [s for s in rec.steps if s["end"] >= t0]
    done_in: dict[str, int] = {}
    for i, s in enumerate(steps):
        for rid in s["prefill_ids"]:
            done_in[rid] = i  # the last step that computed prompt tokens of it

    def ms(t):
        return "-" if t is None else f"{(t - t0) * 1e3:7.0f}"

    print("\nrequests (ms from the first arrival)")
    print("   # arrived  added  sched  prompt-done-step  sampled  delivered  ttft")
    ttfts = []
    for k, r in enumerate(reqs):
        rid = r["request_id"]
        step = done_in.get(rid)
        ttft = None if r["first_delivered"] is None else r["first_delivered"] - r["arrival"]
        if ttft is not None:
            ttfts.append(ttft)
        print(f"{k:4d} {ms(r['arrival'])} {ms(rec.added.get(rid))} {ms(r['first_scheduled'])}"
              f"  {'-' if step is None else step:>4}  {ms(r['first_token'])} "
              f"{ms(r['first_delivered'])}  {'-' if ttft is None else f'{ttft*1e3:6.0f}'}")
    print(f"\nserver-side TTFT p50 {statistics.median(ttfts)*1e3:.0f} ms, "
          f"max {max(ttfts)*1e3:.0f} ms; last arrival {ms(reqs[-1]['arrival'])} ms, "
          f"last added {ms(max(rec.added.get(r['request_id'], 0) for r in reqs))} ms")
    print("\nsteps  start   ms  gap-before  decode prefill  prompts-done  forward  prepare "
          "sample emit sched threads")
    prev_end = None
    for i, s in enumerate(steps[:args.steps]):
        finished = sum(1 for rid in s["prefill_ids"] if done_in.get(rid) == i)
        gap = "-" if prev_end is None else f"{(s['start'] - prev_end) * 1e3:5.1f}"
        print(f"{i:4d} {ms(s['start'])} {(s['end'] - s['start']) * 1e3:6.1f} {gap:>8} "
              f"{s['decode']:6d} {s['prefill']:6d} {finished:6d} "
              f"{s['forward']*1e3:9.1f} {s['prepare']*1e3:6.1f} {s['sample']*1e3:6.1f} "
              f"{s['emit']*1e3:5.1f} {s['schedule']*1e3:5.1f} {s['threads']}")
        prev_end = s["end"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(t0=t0, requests=reqs, added=rec.added, steps=steps), f)


def main() -> int:
    argv = sys.argv[1:]
    serve_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_argv = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40, help="steps to print")
    ap.add_argument("--json", default=None)
    ap.add_argument("--admission-window", type=float, default=None, metavar="S",
                    help="override scheduler/async_engine.py's ADMISSION_WINDOW_S "
                         "(0: the first step starts with the first request)")
    args = ap.parse_args(argv)
    if args.admission_window is not None:
        async_engine.ADMISSION_WINDOW_S = args.admission_window
    from backends.host_malloc import tune_malloc
    tune_malloc()  # as `baton serve` does
    try:  # as `baton serve` runs
        import uvloop
        return uvloop.run(main_async(args, serve_argv))
    except ImportError:
        return asyncio.run(main_async(args, serve_argv))


if __name__ == "__main__":
    sys.exit(main())
