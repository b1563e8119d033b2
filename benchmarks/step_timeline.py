"""Where a served step's time goes: a timeline of every engine step of a real
server run, set beside what the client saw.

Starts `baton serve` in this process (the real CLI, its flags after `--`),
records each engine step as the server's own step observer sees it (start,
end, schedule / prepare / forward / sample / emit, prefill and decode
tokens), runs `benchmarks/serve_load.py` against it as a separate process
(the client competes for the same cores, as in `compare.py`), and prints:

- decode-only steps and steps with prefill rows: count, duration p50,
  forward p50;
- the gaps between steps while requests were in flight (the event loop's
  turn: delivering outputs, SSE writes, new requests);
- host overhead as a share of the served time: everything that is not the
  model's forward pass (schedule + prepare + sample + emit + gaps) over the
  wall time from the first step's start to the last step's end;
- CPU seconds used by each thread of the server (event loop, step thread,
  OpenMP workers) and by the client process, over the run.

    .venv/bin/python benchmarks/step_timeline.py --concurrency 32 --num-requests 32 \
        [--json OUT.json] -- --port 8420 [baton serve flags]

``--workload multi-turn`` (or shared-prefix, long-prefill) runs that workload
of benchmarks/workloads.py instead; the steps with prefill rows are also
grouped by how many prefill tokens they carried.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(slots=True)
class StepSpan:
    start_ns: int
    end_ns: int
    schedule: float
    prepare: float
    forward: float
    sample: float
    emit: float
    prefill_tokens: int
    decode_tokens: int
    # EngineCore.step on the step thread (time.time_ns): what lies between
    # these and start_ns / end_ns is the hand-off between the event loop and
    # the step thread, and the delivery of the step's outputs.
    thread_start_ns: int = 0
    thread_end_ns: int = 0


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed by tid."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[task.name] = (int(fields[11]) + int(fields[12])) / ticks
    return out


# Steps with prefill rows, grouped by how many prefill tokens they carried.
PREFILL_BUCKETS = ((1, 128), (129, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 1 << 30))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(steps: list[StepSpan]) -> dict:
    if not steps:
        return {}
    decode = [s for s in steps if s.prefill_tokens == 0]
    mixed = [s for s in steps if s.prefill_tokens > 0]
    widest = max(x.decode_tokens for x in steps)
    full = [s for s in decode if s.decode_tokens == widest]
    gaps = [(b.start_ns - a.end_ns) / 1e9 for a, b in zip(steps, steps[1:])]
    wall = (steps[-1].end_ns - steps[0].start_ns) / 1e9
    forward = sum(s.forward for s in steps)
    parts = {k: sum(getattr(s, k) for s in steps)
             for k in ("schedule", "prepare", "forward", "sample", "emit")}
    step_time = sum((s.end_ns - s.start_ns) / 1e9 for s in steps)
    in_step_other = step_time - sum(parts.values())

    handoff_in = [(s.thread_start_ns - s.start_ns) / 1e6 for s in steps]
    handoff_out = [(s.end_ns - s.thread_end_ns) / 1e6 for s in steps]
    in_thread = [(s.thread_end_ns - s.thread_start_ns) / 1e6
                 - 1e3 * (s.schedule + s.prepare + s.forward + s.sample + s.emit) for s in steps]

    def group(rows: list[StepSpan]) -> dict:
        return {"steps": len(rows),
                "duration_p50_ms": 1e3 * _pct([(s.end_ns - s.start_ns) / 1e9 for s in rows], .5),
                "forward_p50_ms": 1e3 * _pct([s.forward for s in rows], .5),
                "sample_p50_ms": 1e3 * _pct([s.sample for s in rows], .5),
                "host_p50_ms": 1e3 * _pct([(s.end_ns - s.start_ns) / 1e9 - s.forward
                                           for s in rows], .5)}

    return {
        "steps": len(steps), "wall_s": wall, "step_s": step_time,
        "components_s": parts, "in_step_unaccounted_s": in_step_other,
        "gaps_s": sum(gaps), "gap_p50_ms": 1e3 * _pct(gaps, .5),
        "gap_p90_ms": 1e3 * _pct(gaps, .9),
        "handoff_to_thread_p50_ms": _pct(handoff_in, .5),
        "back_to_loop_p50_ms": _pct(handoff_out, .5),
        "thread_unaccounted_p50_ms": _pct(in_thread, .5),
        "host_share": (wall - forward) / wall,
        "host_share_excl_sample": (wall - forward - parts["sample"]) / wall,
        "decode_only": group(decode), "full_decode": group(full), "with_prefill": group(mixed),
        "by_prefill_tokens": {
            f"{lo}-{hi}": {**group(rows), "step_s": sum((s.end_ns - s.start_ns) / 1e9
                                                        for s in rows),
                           "prefill_tokens": sum(s.prefill_tokens for s in rows)}
            for lo, hi in PREFILL_BUCKETS
            if (rows := [s for s in mixed if lo <= s.prefill_tokens <= hi])},
    }


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=77)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workload", nargs="+", default=None,
                    choices=("shared-prefix", "multi-turn", "long-prefill"),
                    help="run these workloads of benchmarks/workloads.py (serve_load "
                         "--workload) instead of --concurrency/--num-requests random prompts")
    ap.add_argument("--requests-per-user", type=int, default=1, help="shared-prefix")
    ap.add_argument("--users", type=int, default=None, help="the workload's users")
    args = ap.parse_args(own)
    port = serve_flags[serve_flags.index("--port") + 1] if "--port" in serve_flags else "8000"
    url = f"http://127.0.0.1:{port}"
    client_json = tempfile.mktemp(suffix=".json", prefix="step_timeline_")

    from service import cli
    from scheduler.engine import EngineCore
    from service.observability import Observability

    steps: list[StepSpan] = []
    recording = threading.Event()
    original = Observability.on_step

    thread_spans: list[tuple[int, int]] = []

    def on_step(self, stats):  # the server's own observer, plus a record
        original(self, stats)
        if recording.is_set() and thread_spans:
            t = stats.timings
            steps.append(StepSpan(stats.start_ns, stats.end_ns, t.schedule, t.prepare,
                                  t.forward, t.sample, t.emit, stats.num_prefill_tokens,
                                  stats.num_decode_tokens, *thread_spans[-1]))

    Observability.on_step = on_step
    step_tids: set[str] = set()
    original_step = EngineCore.step

    def step(self):  # which thread runs the steps (OpenMP's master), and when
        step_tids.add(str(threading.get_native_id()))
        start = time.time_ns()
        outcome = original_step(self)
        thread_spans.append((start, time.time_ns()))
        return outcome

    EngineCore.step = step
    report: dict = {}

    def drive() -> None:
        try:
            _wait_ready(url, 600)
            load = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"),
                    "--base-url", url, "--seed", str(args.seed),
                    "--output-len", str(args.output_len), "--no-warmup", "--json", client_json]
            if args.workload:
                load += ["--workload", *args.workload,
                         "--requests-per-user", str(args.requests_per_user)]
                if args.users:
                    load += ["--users", str(args.users)]
            else:
                load += ["--concurrency", str(args.concurrency),
                         "--num-requests", str(args.num_requests),
                         "--prompt-len", str(args.prompt_len)]
            cpu0 = _thread_cpu()
            child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            recording.set()
            done = subprocess.run(load, capture_output=True, text=True, check=False)
            recording.clear()
            child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu1 = _thread_cpu()
            report["client_cpu_s"] = ((child1.ru_utime + child1.ru_stime)
                                      - (child0.ru_utime + child0.ru_stime))
            threads: dict[str, float] = {}
            for tid, value in cpu1.items():
                name = ("event-loop" if tid == str(os.getpid()) else
                        "step-thread" if tid in step_tids else f"thread-{tid}")
                used = value - cpu0.get(tid, 0.0)
                if used > 0.005:
                    threads[name] = threads.get(name, 0.0) + used
            report["server_thread_cpu_s"] = {k: round(v, 2) for k, v in
                                             sorted(threads.items(), key=lambda kv: -kv[1])}
            report["client_table"] = done.stdout.strip()
            report["client_stderr_tail"] = done.stderr[-1500:]
            with contextlib.suppress(OSError, ValueError):
                client = json.loads(Path(client_json).read_text())
                report["client"] = (client["workloads"] if args.workload
                                    else client["runs"][0])
        except Exception as exc:  # noqa: BLE001 - reported, then the server stops
            report["error"] = repr(exc)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=drive, daemon=True).start()
    cli.main(["serve", *serve_flags])
    report["timeline"] = summarize(steps)
    report["steps"] = [asdict(s) for s in steps]
    print(report.pop("client_table", ""))
    out = {k: v for k, v in report.items() if k not in ("steps", "client")}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
