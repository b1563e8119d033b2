"""benchmarks/compare.py: two fake OpenAI servers measured in
one run, ratios against the issue's goals, servers it starts itself stopped
afterwards, and no prompt ever sent twice across servers."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import compare
from tests.test_serve_load import fake_server  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]


async def test_two_servers_ratios_and_fresh_prompts(fake_server, tmp_path, capsys):  # noqa: F811
    fast_url, fast = await fake_server()
    slow_url, slow = await fake_server(tokens_per_chunk=1)
    out = tmp_path / "cmp.json"
    args = compare.parse_args([
        "--server", f"fast={fast_url}", "--server", f"slow={slow_url}",
        "--concurrency", "1", "8", "32", "--num-requests", "2", "8", "32",
        "--prompt-len", "8", "--output-len", "6", "--seed", "5", "--rounds", "2",
        "--json", str(out)])
    assert await compare._main(args) == 0
    printed = capsys.readouterr().out
    assert "| server | c=1 tok/s | c=1 inter-token p50 (ms) | c=8 tok/s | c=32 tok/s |" in printed
    assert "| fast |" in printed and "| slow |" in printed
    for goal in ("c=32 output tok/s ratio", "c=1 inter-token p50 ratio", "c=32 TTFT p50 ratio"):
        assert f"fast / slow: {goal}" in printed
    report = json.loads(out.read_text())
    assert set(report["servers"]) == {"fast", "slow"}
    assert "median of 2 round(s)" in printed
    for name, state in (("fast", fast), ("slow", slow)):
        assert len(report["servers"][name]) == 2
        for runs in report["servers"][name]:
            assert [runs[c]["num_ok"] for c in ("1", "8", "32")] == [2, 8, 32]
            assert all(runs[c]["output_tokens"] == runs[c]["num_ok"] * 6 for c in runs)
        assert len(state.bodies) == 2 * (1 + 2 + 8 + 32)  # warm-up + runs, per round
    prompts = [json.dumps(b["prompt"]) for b in fast.bodies + slow.bodies]
    assert len(set(prompts)) == len(prompts)
    assert len(report["ratios"]) == 3
    for r in report["ratios"]:
        assert r["ratio"] > 0 and isinstance(r["met"], bool)


async def test_a_peers_failed_requests_are_counted_not_fatal(fake_server, tmp_path,  # noqa: F811
                                                             capsys):
    """A peer that drops or errors a request (llama-server once dropped a
    connection) is measured on the rest and its failures counted."""
    good_url, _good = await fake_server()
    # arrival 0 is the warm-up; then c=1 gets 1..2, c=4 gets 3..10
    flaky_url, _flaky = await fake_server(faults={2: "error_event", 5: "429", 7: "error_event"})
    out = tmp_path / "cmp.json"
    args = compare.parse_args([
        "--server", f"good={good_url}", "--server", f"flaky={flaky_url}",
        "--concurrency", "1", "4", "--num-requests", "2", "8", "--prompt-len", "8",
        "--output-len", "6", "--seed", "9", "--json", str(out)])
    assert await compare._main(args) == 0
    printed = capsys.readouterr().out
    assert "| server | c=1 tok/s |" in printed and "| failed requests |" in printed
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines()
            if line.startswith("| good |") or line.startswith("| flaky |")}
    assert rows["good"].rstrip().endswith("| 0 |")
    assert rows["flaky"].rstrip().endswith("| 3 |")
    assert "flaky c=4: 2 requests failed" in printed
    runs = json.loads(out.read_text())["servers"]["flaky"][0]
    assert (runs["1"]["num_ok"], runs["4"]["num_ok"]) == (1, 6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_SERVER = textwrap.dedent("""
    import asyncio, json, sys
    from aiohttp import web
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m"}]})
    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.001)
            await resp.write(b"data: " + json.dumps({"choices": [
                {"index": 0, "text": "x", "finish_reason": None}]}).encode() + b"\\n\\n")
        await resp.write(b"data: [DONE]\\n\\n")
        return resp
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
""")


@pytest.mark.slow
def test_started_servers_are_measured_then_stopped(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    ports = [_free_port(), _free_port()]
    argv = [sys.executable, str(ROOT / "benchmarks" / "compare.py"),
            "--concurrency", "1", "2", "--num-requests", "2", "2",
            "--prompt-len", "4", "--output-len", "3", "--log-dir", str(tmp_path / "logs"),
            "--rounds", "2"]
    for name, port in zip(("a", "b"), ports):
        argv += ["--server", f"{name}=http://127.0.0.1:{port}",
                 "--start", f"{name}={sys.executable} {script} {port}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| a |" in out.stdout and "| b |" in out.stdout
    # The log folder is created when missing; each started server has one
    # log, which keeps every round (a slow round's log is not overwritten).
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["compare-a.log", "compare-b.log"]
    for name in ("a", "b"):
        headers = [line for line in (logs / f"compare-{name}.log").read_text().splitlines()
                   if line.startswith("=== compare.py: round")]
        assert [h.split(",")[0] for h in headers] == [
            "=== compare.py: round 1", "=== compare.py: round 2"]
    time.sleep(0.5)
    for port in ports:  # both stopped: nothing listens any more
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_needs_two_servers_and_known_pairs():
    with pytest.raises(SystemExit):
        compare.parse_args(["--server", "a=http://127.0.0.1:1"])
    two = ["--server", "a=http://127.0.0.1:1", "--server", "b=http://127.0.0.1:2"]
    with pytest.raises(SystemExit):
        compare.parse_args(two + ["--pair", "a:c"])
    assert compare.parse_args(two + ["--pair", "b:a"]).pairs == [("b", "a")]


async def test_workload_table_same_prompts_for_each_server_and_pair_bounds(
        fake_server, tmp_path, capsys):  # noqa: F811
    a_url, a = await fake_server()
    b_url, b = await fake_server(tokens_per_chunk=1)
    out = tmp_path / "w.json"
    args = compare.parse_args([
        "--server", f"on={a_url}", "--server", f"off={b_url}",
        "--workload", "shared-prefix", "long-prefill", "--long-len", "40", "--short-len", "5",
        "--num-short", "2", "--users", "3", "--requests-per-user", "2", "--prefix-len", "40",
        "--question-len", "5", "--output-len", "4", "--seed", "9", "--vocab", "3000",
        "--pair", "on:off:0.25", "--json", str(out)])
    assert await compare._main(args) == 0
    printed = capsys.readouterr().out
    assert "| server | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | e2e p50 (s) " \
           "| cached share |" in printed
    assert "on / off: TTFT p50 ratio" in printed and "(goal <= 0.25)" in printed
    assert "on / off: output tok/s ratio" in printed and "(goal >= 1.0)" in printed
    assert "| server | short TTFT p50 idle (ms) | short TTFT p50 during (ms) |" in printed
    # the pair's bound is for the cache's TTFT goal, not the fairness one
    assert "on / off: short TTFT p50 during long prefill ratio" in printed
    assert re.search(r"long prefill ratio [0-9.]+ \(goal <= 1\.0\)", printed)
    # the workloads' prompts are the same for both servers (after each warm-up)
    assert a.prompts[1:] == b.prompts[1:]
    assert len(a.prompts) == 1 + (1 + 6) + (2 + 1 + 2)
    report = json.loads(out.read_text())
    figures = report["servers"]["on"][0]["shared-prefix"]
    assert figures["num_ok"] == 6
    assert figures["cached_share"] == pytest.approx(32 / 45)
    ratios = report["workloads"]["shared-prefix"]["ratios"]
    assert [r["bound"] for r in ratios] == [0.25, 1.0]
    assert report["servers"]["off"][0]["long-prefill"]["long_ttft_ms"] > 0
    assert report["workloads"]["long-prefill"]["options"]["output_len"] == 4


async def test_contention_measures_quiet_and_contended(fake_server, capsys):  # noqa: F811
    """benchmarks/contention.py: c=1 quiet, then with a busy process that it
    starts and stops itself; one row per server."""
    from benchmarks import contention
    url, state = await fake_server()
    args = contention.parse_args(["--server", f"fake={url}", "--hogs", "1", "--settle", "0",
                                  "--num-requests", "2", "--prompt-len", "8",
                                  "--output-len", "5"])
    assert await contention._main(args) == 0
    printed = capsys.readouterr().out
    assert "| server | quiet tok/s | quiet ITL p50 (ms) |" in printed
    [row] = [line for line in printed.splitlines() if line.startswith("| fake |")]
    assert "-" not in row.split("|")[2]  # a figure, not a blank
    # two warm-ups and 2 + 2 measured requests, every prompt distinct
    measured = [json.dumps(b["prompt"]) for b in state.bodies if b.get("max_tokens") == 5]
    assert len(measured) == 4 and len(set(measured)) == 4


def test_stop_waits_for_the_whole_process_group(tmp_path):
    """A started server is a shell command; stop() returns only when every
    process of its group is gone. (vLLM's API server outlives its shell by
    seconds; the next server on the same port then found it answering 500.)"""
    from benchmarks.compare import StartedServer, _group_alive
    lingering = (f"{sys.executable} -c 'import signal, time; "
                 "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), exit(0))); "
                 "time.sleep(60)' & sleep 60")
    server = StartedServer("slow", lingering, tmp_path)
    time.sleep(0.5)
    server.stop()
    assert not _group_alive(server.proc.pid)
