"""Compare Baton with another OpenAI-compatible server on one workload, in one run.

Each server is measured in turn with serve_load's workload (streaming
`/v1/completions`, PROMPT random token ids, OUTPUT tokens with ignore_eos) at
each concurrency; every request of every server gets a fresh prompt (both
servers cache prefixes). With `--start NAME=COMMAND` this script starts that
server itself, waits for `GET /v1/models`, measures, and stops it before the
next one, so only one server holds the CPU at a time.

Prints, per server, the row of figures the performance issue tracks
(c=1 tok/s, c=1 inter-token p50, c=8 tok/s, c=32 tok/s, c=32 TTFT p50), then the
ratios of the first server (`--server` order; Baton by convention) to each
other one (or the `--pair`s named), against the issue's goals. With
`--rounds N` every server is measured N times, alternating, and the figures
are medians over the rounds.

`--workload shared-prefix multi-turn long-prefill` (any of them) measures the
prefix-cache and fairness workloads of benchmarks/workloads.py instead, each in
turn on each server while it is up, with the same prompts for every server (the
point is what each one's cache makes of them); a table and goal ratios per
workload. `--pair NAME:PEER:BOUND` replaces the bound of the TTFT goal of
shared-prefix and multi-turn for that pair (e.g. cache on against cache off,
TTFT p50 <= 0.25); long-prefill keeps its own.

Each measurement's line also says how many CPUs the server (a started one's
process group), this client and every other process used meanwhile
(benchmarks/machine_load.py); a measurement during which other processes
used more than DISTURBED_CPUS is marked DISTURBED and listed after the
tables: on a 2-core machine one busy process halves a server's speed, so such
a round compares nothing. Server logs keep every round (`compare-NAME.log`).

    .venv/bin/python benchmarks/compare.py \\
        --server baton=http://127.0.0.1:8000 --server vllm=http://127.0.0.1:8001 \\
        [--start 'baton=baton serve --port 8000'] \\
        [--start 'vllm=VLLM_CPU_KVCACHE_SPACE=2 /path/venv/bin/python -m \\
            vllm.entrypoints.openai.api_server --model DIR --port 8001 ...'] \\
        [--concurrency 1 8 32] [--num-requests 4 16 64] [--prompt-len 128] \\
        [--output-len 128] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine_load import LoadReport, LoadWindow  # noqa: E402
from benchmarks.serve_load import (LoadResult, LoadSetupError, fetch_model_id,  # noqa: E402
                                   normalize_base_url, run_cli, run_load,
                                   wait_until_serving)
from benchmarks.workloads import (add_workload_args, check_workload_args,  # noqa: E402
                                  run_workload, workload_options)

# (label, concurrency, LoadResult attribute, format)
COLUMNS = [
    ("c=1 tok/s", 1, "output_tok_per_s", "{:.1f}"),
    ("c=1 inter-token p50 (ms)", 1, "itl_p50_ms", "{:.1f}"),
    ("c=8 tok/s", 8, "output_tok_per_s", "{:.1f}"),
    ("c=32 tok/s", 32, "output_tok_per_s", "{:.1f}"),
    ("c=32 TTFT p50 (ms)", 32, "ttft_p50_ms", "{:.0f}"),
]
# (description, concurrency, attribute, comparison, bound): ratio = first / other.
# The current performance issue's (33): c=32 output at least 1.5x the better
# peer's, c=1 inter-token p50 at most llama.cpp's; and a first token no later.
GOALS = [
    ("c=32 output tok/s ratio", 32, "output_tok_per_s", ">=", 1.5),
    ("c=1 inter-token p50 ratio", 1, "itl_p50_ms", "<=", 1.0),
    ("c=32 TTFT p50 ratio", 32, "ttft_p50_ms", "<=", 1.0),
]


# --workload: (label, figure, format) columns and (description, figure, op, bound) goals
_TTFT_TOKS = [("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
              ("output tok/s", "output_tok_per_s", "{:.1f}"), ("e2e p50 (s)", "e2e_p50_s", "{:.2f}"),
              ("cached share", "cached_share", "{:.2f}")]
WORKLOAD_COLUMNS = {
    "shared-prefix": _TTFT_TOKS,
    "multi-turn": _TTFT_TOKS[:1] + [("TTFT p50 turns 2+ (ms)", "later_ttft_p50_ms", "{:.0f}")]
    + _TTFT_TOKS[1:],
    "long-prefill": [("short TTFT p50 idle (ms)", "short_ttft_p50_idle_ms", "{:.0f}"),
                     ("short TTFT p50 during (ms)", "short_ttft_p50_during_ms", "{:.0f}"),
                     ("short TTFT max during (ms)", "short_ttft_max_during_ms", "{:.0f}"),
                     ("long prompt TTFT (ms)", "long_ttft_ms", "{:.0f}"),
                     ("slowdown p50", "slowdown_p50", "{:.2f}")],
    "grounded": [("output tok/s", "output_tok_per_s", "{:.1f}"),
                 ("inter-chunk p50 (ms)", "itl_p50_ms", "{:.1f}"),
                 ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("e2e p50 (s)", "e2e_p50_s", "{:.2f}"),
                 ("acceptance", "spec_acceptance", "{:.2f}"),
                 ("failed", "num_errors", "{:.0f}")],
}
WORKLOAD_COLUMNS["chat"] = WORKLOAD_COLUMNS["grounded"]
WORKLOAD_GOALS = {
    "shared-prefix": [("TTFT p50 ratio", "ttft_p50_ms", "<=", 1.0),
                      ("output tok/s ratio", "output_tok_per_s", ">=", 1.0)],
    "multi-turn": [("TTFT p50 ratio", "ttft_p50_ms", "<=", 1.0),
                   ("output tok/s ratio", "output_tok_per_s", ">=", 1.0)],
    "long-prefill": [("short TTFT p50 during long prefill ratio", "short_ttft_p50_during_ms",
                      "<=", 1.0)],
    # speculative decoding (issue 34): against the same server without it
    # (--pair baton-ngram:baton:2.0) or a peer's best speculative setting
    "grounded": [("output tok/s ratio", "output_tok_per_s", ">=", 1.2)],
    "chat": [("output tok/s ratio", "output_tok_per_s", ">=", 1.0)],
}
# the workloads whose first goal (TTFT p50) a --pair NAME:PEER:BOUND may re-bound
PAIR_BOUND_WORKLOADS = ("shared-prefix", "multi-turn", "grounded", "chat")


def parse_pairs(values: list[str], what: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"{what} takes NAME=VALUE, got {value!r}")
        pairs[name] = rest
    return pairs


class StartedServer:
    """A server command run in its own process group; stopped on exit.
    Its output goes to ``compare-NAME.log``; round > 1 appends to the log of
    the rounds before (each round begins with a header line), so a slow
    round's server log is still there to read."""

    def __init__(self, name: str, command: str, log_dir: Path, round_number: int = 1) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"compare-{name}.log"
        self._log = open(self.log_path, "w" if round_number <= 1 else "a")
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S UTC")
        self._log.write(f"=== compare.py: round {round_number}, started {stamp}: {command}\n")
        self._log.flush()
        self.proc = subprocess.Popen(command, shell=True, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, base_url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LoadSetupError(f"{self.name} exited with code {self.proc.returncode} "
                                     f"before it was ready; see {self.log_path}")
            try:
                await fetch_model_id(base_url, None, 5.0)
                return
            except (LoadSetupError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
                await asyncio.sleep(1.0)
        raise LoadSetupError(f"{self.name} was not ready within {timeout:.0f} s; "
                             f"see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the process group, then wait until every process of it
        is gone (SIGKILL after 30 s): the command is a shell, and a server it
        started (vLLM's API server) can outlive it by seconds, still holding
        the port the next server is about to take."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30.0
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = float("inf")
            self.proc.poll()  # reap the shell, whose group it leads
            time.sleep(0.1)
        self.proc.wait(timeout=10)
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


async def measure(name: str, base_url: str, args: argparse.Namespace,
                  seed: int, server_pgid: int | None = None) -> dict[int, LoadResult]:
    """Every concurrency against one server; request indices never repeat."""
    model = await fetch_model_id(base_url, args.api_key, 30.0)
    common = dict(prompt_len=args.prompt_len, seed=seed, vocab=args.vocab,
                  api_key=args.api_key, timeout=args.timeout)
    await _warm_up(name, base_url, model, args, common)
    results: dict[int, LoadResult] = {}
    next_request = 1
    for concurrency, n in zip(args.concurrency, args.num_requests):
        window = LoadWindow(server_pgid)
        window.start()
        result = await run_load(base_url, model, concurrency, n, output_len=args.output_len,
                                first_request=next_request, **common)
        load = window.stop()
        next_request += n
        results[concurrency] = result
        print(f"  {name} c={concurrency}: {result.output_tok_per_s:.1f} tok/s, "
              f"ok {result.num_ok}/{n}, TTFT p50 {_fmt(result.ttft_p50_ms, '{:.0f}')} ms, "
              f"ITL p50 {_fmt(result.itl_p50_ms, '{:.1f}')} ms{_load_note(load)}", flush=True)
        # A peer's failed or short request is counted (the table's last
        # column) and the comparison goes on; its figures cover the rest.
        if result.num_errors:
            print(f"  {name} c={concurrency}: {result.num_errors} requests failed: "
                  f"{result.errors}", flush=True)
        if result.num_short:
            print(f"  {name} c={concurrency}: {result.num_short} requests came back short "
                  f"(ignore_eos not honoured?)", flush=True)
    return results


async def _warm_up(name: str, base_url: str, model: str, args: argparse.Namespace,
                   common: dict) -> None:
    try:
        await wait_until_serving(base_url, model, args.api_key, args.start_timeout,
                                 seed=common["seed"], vocab=args.vocab)
    except LoadSetupError as exc:
        raise LoadSetupError(f"{name}: {exc}") from None


async def measure_workloads(name: str, base_url: str, args: argparse.Namespace,
                            seed: int, server_pgid: int | None = None) -> dict[str, dict]:
    """Each --workload against one server, in turn: {workload: figures}."""
    model = await fetch_model_id(base_url, args.api_key, 30.0)
    # the warm-up's prompt is drawn from another seed than the workloads'
    await _warm_up(name, base_url, model, args, dict(seed=seed + 1))
    out = {}
    for workload in args.workload_names:
        window = LoadWindow(server_pgid)
        window.start()
        try:
            figures = await run_workload(workload, base_url, model, seed,
                                         workload_options(args, workload))
        except RuntimeError as exc:
            raise LoadSetupError(f"{name}: {workload}: {exc}") from None
        load = window.stop()
        if load is not None:
            figures["cpu_use"] = load.to_dict()
        cells = [f"{label} {_fmt(figures.get(key), fmt)}"
                 for label, key, fmt in WORKLOAD_COLUMNS[workload]]
        print(f"  {name} {workload}: " + ", ".join(cells) + _load_note(load), flush=True)
        out[workload] = figures
    return out


# Other processes using more than this many CPUs on average during a
# measurement: its figures are flagged as disturbed.
DISTURBED_CPUS = 0.25


def _load_note(load: LoadReport | None) -> str:
    """What the rest of the machine used during a measurement, for its line."""
    if load is None:
        return ""
    if load.others is None:
        return f"; CPUs busy {load.machine:.2f} (client {load.client:.2f})"
    flag = " DISTURBED" if load.others > DISTURBED_CPUS else ""
    return (f"; CPUs: server {load.server:.2f}, client {load.client:.2f}, "
            f"other processes {load.others:.2f}{flag}")


def disturbed_rounds(all_figures: dict[str, list[dict]]) -> list[str]:
    """'NAME round R WORKLOAD: other processes X CPUs' for every measurement
    during which other processes used more than DISTURBED_CPUS."""
    lines = []
    for name, rounds in all_figures.items():
        for r, workloads in enumerate(rounds, 1):
            for workload, figures in workloads.items():
                others = (figures.get("cpu_use") or {}).get("other_cpus")
                if others is not None and others > DISTURBED_CPUS:
                    lines.append(f"{name} round {r} {workload}: other processes used "
                                 f"{others:.2f} CPUs")
    return lines


def figure_table(all_figures: dict[str, list[dict]], workload: str) -> list[str]:
    """``all_figures``: per server, per round, {workload: figures}."""
    columns = WORKLOAD_COLUMNS[workload]
    lines = ["| server | " + " | ".join(c[0] for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, rounds in all_figures.items():
        rounds = [r[workload] for r in rounds]
        cells = [_fmt(_median(rounds, key), fmt) for _label, key, fmt in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _median(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def figure_ratios(all_figures: dict[str, list[dict]], workload: str,
                  pairs: list[tuple[str, str]], bounds: dict[tuple[str, str], float]
                  ) -> tuple[list[str], list[dict]]:
    names = list(all_figures)
    pairs = pairs or [(names[0], other) for other in names[1:]]
    lines, report = [], []
    for first, other in pairs:
        for index, (desc, key, op, bound) in enumerate(WORKLOAD_GOALS[workload]):
            if index == 0 and workload in PAIR_BOUND_WORKLOADS:
                bound = bounds.get((first, other), bound)
            a = _median([r[workload] for r in all_figures[first]], key)
            b = _median([r[workload] for r in all_figures[other]], key)
            if a is None or not b:
                continue
            ratio = a / b
            met = ratio >= bound if op == ">=" else ratio <= bound
            lines.append(f"{first} / {other}: {desc} {ratio:.2f} (goal {op} {bound}) "
                         f"{'met' if met else 'NOT met'}")
            report.append({"server": first, "peer": other, "goal": desc, "ratio": ratio,
                           "bound": bound, "op": op, "met": met})
    return lines, report


def _fmt(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _value(results: list[dict[int, LoadResult]], concurrency: int,
           attr: str) -> float | None:
    """The median over rounds of one figure."""
    values = [getattr(r[concurrency], attr) for r in results
              if concurrency in r and getattr(r[concurrency], attr) is not None]
    return statistics.median(values) if values else None


def failed_requests(results: list[dict[int, LoadResult]]) -> int:
    """Requests that failed or came back short, over every round and concurrency."""
    return sum(r.num_errors + r.num_short for rounds in results for r in rounds.values())


def table(all_results: dict[str, list[dict[int, LoadResult]]]) -> list[str]:
    lines = ["| server | " + " | ".join(c[0] for c in COLUMNS) + " | failed requests |",
             "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name, results in all_results.items():
        cells = [_fmt(_value(results, c, attr), fmt) for _label, c, attr, fmt in COLUMNS]
        cells.append(str(failed_requests(results)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def ratios(all_results: dict[str, list[dict[int, LoadResult]]],
           pairs: list[tuple[str, str]] | None = None) -> tuple[list[str], list[dict]]:
    """Goal ratios for each (server, peer) pair; default: the first server
    against each other one."""
    names = list(all_results)
    if not pairs:
        pairs = [(names[0], other) for other in names[1:]]
    lines: list[str] = []
    report: list[dict] = []
    for first, other in pairs:
        for desc, c, attr, op, bound in GOALS:
            a = _value(all_results[first], c, attr)
            b = _value(all_results[other], c, attr)
            if a is None or b is None or b == 0:
                continue
            ratio = a / b
            met = ratio >= bound if op == ">=" else ratio <= bound
            lines.append(f"{first} / {other}: {desc} {ratio:.2f} (goal {op} {bound}) "
                         f"{'met' if met else 'NOT met'}")
            report.append({"server": first, "peer": other, "goal": desc, "ratio": ratio,
                           "bound": bound, "op": op, "met": met})
    return lines, report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                    help="a server to measure (at least two; the first is compared "
                         "with each other one)")
    ap.add_argument("--start", action="append", default=[], metavar="NAME=COMMAND",
                    help="start this server with a shell command before measuring it "
                         "and stop it afterwards")
    ap.add_argument("--pair", action="append", default=[], metavar="NAME:PEER",
                    help="report goal ratios of NAME against PEER (repeatable; default: "
                         "the first server against each other one); NAME:PEER:BOUND also "
                         "replaces the TTFT goal's bound of shared-prefix and multi-turn "
                         "for this pair")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every server this many times, alternating; the table "
                         "and ratios use the median of the rounds")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, nargs="+", default=None,
                    help="one per concurrency; default max(8, 4 * concurrency) each")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--log-dir", default=".", help="where started servers' output goes")
    ap.add_argument("--json", default=None, metavar="OUT.json")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    check_workload_args(ap, args)
    args.servers = parse_pairs(args.server, "--server")
    args.starts = parse_pairs(args.start, "--start")
    if len(args.servers) < 2:
        ap.error("give at least two --server NAME=URL")
    unknown = set(args.starts) - set(args.servers)
    if unknown:
        ap.error(f"--start names a server not given with --server: {sorted(unknown)}")
    args.pairs = []
    args.pair_bounds = {}
    for pair in args.pair:
        a, sep, rest = pair.partition(":")
        b, _, bound = rest.partition(":")
        if not sep or a not in args.servers or b not in args.servers:
            ap.error(f"--pair takes NAME:PEER[:BOUND] of two --server names, got {pair!r}")
        args.pairs.append((a, b))
        if bound:
            try:
                args.pair_bounds[(a, b)] = float(bound)
            except ValueError:
                ap.error(f"--pair {pair!r}: BOUND must be a number")
    if args.num_requests is None:
        args.num_requests = [max(8, 4 * c) for c in args.concurrency]
    if len(args.num_requests) != len(args.concurrency):
        ap.error("--num-requests needs one value per --concurrency")
    return args


async def _main(args: argparse.Namespace) -> int:
    seed = secrets.randbits(62) if args.seed is None else args.seed
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    all_results: dict[str, list[dict[int, LoadResult]]] = {name: [] for name in args.servers}
    # Rounds alternate the servers, so a machine whose speed drifts over time
    # (shared or virtual CPUs) drifts for all of them alike.
    for round_index in range(args.rounds):
        for k, (name, url) in enumerate(args.servers.items()):
            base = normalize_base_url(url)
            started = None
            pgid = None  # the server's process group, when started here (its own session)
            if name in args.starts:
                started = StartedServer(name, args.starts[name], Path(args.log_dir),
                                        round_index + 1)
                pgid = started.proc.pid
            try:
                if started:
                    print(f"starting {name} (round {round_index + 1}) ...", flush=True)
                    await started.wait_ready(base, args.start_timeout)
                if args.workload_names:
                    # the same prompts for every server; a fresh seed per
                    # round (a server kept running would still have them)
                    run_seed = seed + 7_919_993 * round_index
                    all_results[name].append(
                        await measure_workloads(name, base, args, run_seed, pgid))
                    continue
                # A distinct seed per server and round: no prompt is ever resent.
                run_seed = seed + 1_000_003 * k + 7_919_993 * round_index
                all_results[name].append(await measure(name, base, args, run_seed, pgid))
            finally:
                if started:
                    started.stop()
    if args.workload_names:
        return _report_workloads(args, date, seed, all_results)
    print()
    print(f"{date} · prompt {args.prompt_len} random token ids · output {args.output_len} "
          f"tokens (ignore_eos, temperature 0, streaming) · requests per concurrency "
          f"{dict(zip(args.concurrency, args.num_requests))} · median of {args.rounds} "
          f"round(s)")
    print()
    for line in table(all_results):
        print(line)
    lines, report = ratios(all_results, args.pairs)
    print()
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date, "seed": seed, "prompt_len": args.prompt_len,
                       "output_len": args.output_len,
                       "rounds": args.rounds,
                       "servers": {n: [{str(c): r.to_dict() for c, r in res.items()}
                                       for res in rounds]
                                   for n, rounds in all_results.items()},
                       "ratios": report}, f, indent=2)
    return 0


def _report_workloads(args: argparse.Namespace, date: str, seed: int,
                      all_results: dict[str, list[dict]]) -> int:
    report = {"date": date, "seed": seed, "rounds": args.rounds, "servers": all_results,
              "workloads": {}}
    for workload in args.workload_names:
        options = workload_options(args, workload) | {"api_key": None}
        print()
        print(f"{date} · workload {workload} · {options} · median of {args.rounds} round(s)")
        print()
        for line in figure_table(all_results, workload):
            print(line)
        lines, ratios_report = figure_ratios(all_results, workload, args.pairs,
                                             args.pair_bounds)
        print()
        for line in lines:
            print(line)
        report["workloads"][workload] = {"options": options, "ratios": ratios_report}
    disturbed = disturbed_rounds(all_results)
    if disturbed:
        print()
        print(f"Disturbed (other processes used more than {DISTURBED_CPUS} CPUs on average; "
              "those rounds' figures say little about the server):")
        for line in disturbed:
            print(f"  {line}")
    report["disturbed"] = disturbed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("compare", _main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
