"""benchmarks/serve_load.py against a fake OpenAI-compatible streaming server:
exact token counts, errors counted but not fatal, fresh prompts for every
request of every run, exactly `concurrency` requests in flight, and the CLI's
markdown table and JSON report."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from benchmarks.serve_load import (
    MIN_TOKEN_ID, TABLE_HEADER, SSEDecoder, make_prompt, run_load,
)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
MODEL_ID = "fake-model"


@dataclass
class FakeOpenAI:
    """State of one fake server. `faults` maps the arrival index of a request
    (0-based) to what goes wrong with it: "429", "error_event" (an error event
    after two tokens), "stall" (two tokens, then silence)."""

    faults: dict[int, str] = field(default_factory=dict)
    tokens_per_chunk: int = 1
    send_usage: bool = True
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    @property
    def prompts(self) -> list:
        return [b["prompt"] for b in self.bodies]


STATE = web.AppKey("state", FakeOpenAI)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})


def _cached_tokens(prompt, earlier: list[dict]) -> int:
    """As a prefix cache with 16-token blocks would find: the longest common
    prefix with an earlier token-id prompt, in whole blocks, short of the end."""
    if not isinstance(prompt, list):
        return 0
    best = 0
    for body in earlier:
        other = body.get("prompt")
        if isinstance(other, list):
            n = 0
            while n < min(len(prompt), len(other)) and prompt[n] == other[n]:
                n += 1
            best = max(best, n)
    return min(best, len(prompt) - 1) // 16 * 16


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await request.json()
    fault = state.faults.get(len(state.bodies))
    cached = _cached_tokens(body["prompt"], state.bodies)
    state.bodies.append(body)
    if fault == "429":
        return web.json_response({"error": {"message": "busy", "type": "rate_limit"}},
                                 status=429)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        await resp.write(b": keep-alive\n\n")
        for i in range(0, n, state.tokens_per_chunk):
            await asyncio.sleep(0.002)
            if fault and i == 2:
                if fault == "stall":
                    await asyncio.sleep(30)
                await resp.write(_sse({"error": {"message": "boom", "type": "server_error"}}))
                break
            k = min(state.tokens_per_chunk, n - i)
            await resp.write(_sse({"object": "text_completion", "model": MODEL_ID, "choices": [
                {"index": 0, "text": "".join(f" t{i + j}" for j in range(k)),
                 "finish_reason": "length" if i + k == n else None}], "usage": None}))
        if state.send_usage:
            await resp.write(_sse({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                "total_tokens": len(body["prompt"]) + n,
                "prompt_tokens_details": {"cached_tokens": cached}}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        state.in_flight -= 1


async def _chat(request: web.Request) -> web.StreamResponse:
    """A chat stream as servers send it: a role-only chunk first, then content."""
    state = request.app[STATE]
    body = await request.json()
    state.bodies.append(body)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                              "content": ""}}]}))
    await asyncio.sleep(0.02)
    n = body["max_tokens"]
    for i in range(n):
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                            "finish_reason": "length" if i == n - 1
                                            else None}]}))
    prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
    await resp.write(_sse({"choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": n,
        "total_tokens": prompt_tokens + n}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def fake_server():
    runners = []

    async def start(**kwargs) -> tuple[str, FakeOpenAI]:
        state = FakeOpenAI(**kwargs)
        app = web.Application()
        app[STATE] = state
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", _completions)
        app.router.add_post("/v1/chat/completions", _chat)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", state

    yield start
    for runner in runners:
        await runner.cleanup()


def _assert_all_distinct(prompts: list) -> None:
    keys = [json.dumps(p) for p in prompts]
    assert len(set(keys)) == len(keys)


async def test_counts_tokens_exactly_with_concurrency_in_flight(fake_server):
    url, server = await fake_server()
    result = await run_load(url + "/v1/", MODEL_ID, concurrency=4, num_requests=24,
                            prompt_len=16, output_len=8, seed=7)
    assert (result.num_ok, result.num_errors, result.errors) == (24, 0, {})
    assert result.output_tokens == 24 * 8 and result.num_short == 0
    assert all(r.output_tokens == 8 and len(r.itl_s) == 7 for r in result.requests)
    assert server.max_in_flight == 4
    assert 0 < result.ttft_p50_ms <= result.ttft_p99_ms
    assert 0 < result.itl_p50_ms <= result.itl_p99_ms
    assert 0 < result.e2e_p50_s <= result.e2e_p99_s and result.wall_s > 0
    assert result.output_tok_per_s > 0 and result.req_per_s > 0

    assert len(server.bodies) == 24
    _assert_all_distinct(server.prompts)
    for body in server.bodies:
        assert len(body["prompt"]) == 16
        assert all(MIN_TOKEN_ID <= t < 49152 for t in body["prompt"])
        assert body["model"] == MODEL_ID and body["max_tokens"] == 8
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}


async def test_prompts_fresh_across_runs_and_reproducible(fake_server):
    url, server = await fake_server()
    first = await run_load(url, None, 2, 6, prompt_len=8, output_len=2, seed=3)
    await run_load(url, None, 3, 6, prompt_len=8, output_len=2, seed=3, first_request=6)
    await run_load(url, None, 2, 4, prompt_len=8, output_len=2)  # seed None: a fresh one
    await run_load(url, None, 2, 4, prompt_len=8, output_len=2)
    assert first.model == MODEL_ID and {b["model"] for b in server.bodies} == {MODEL_ID}
    _assert_all_distinct(server.prompts)
    assert len(server.prompts) == 20
    assert sorted(map(json.dumps, server.prompts[:6])) == sorted(
        json.dumps(make_prompt(3, k, 8)) for k in range(6))


async def test_text_prompts_are_distinct_strings(fake_server):
    url, server = await fake_server()
    result = await run_load(url, MODEL_ID, 2, 6, prompt_len=12, output_len=3,
                            text_prompts=True)
    assert result.num_ok == 6
    assert all(isinstance(p, str) and len(p.split()) == 12 for p in server.prompts)
    _assert_all_distinct(server.prompts)


async def test_errors_are_counted_not_fatal(fake_server):
    url, server = await fake_server(faults={1: "429", 3: "error_event", 5: "stall", 8: "429"})
    result = await run_load(url, MODEL_ID, concurrency=3, num_requests=12, prompt_len=8,
                            output_len=6, timeout=0.5)
    assert result.errors == {"http 429": 2, "error event": 1, "timeout": 1}
    assert (result.num_ok, result.num_errors) == (8, 4)
    assert result.output_tokens == 8 * 6
    assert result.ttft_p50_ms <= result.ttft_p99_ms
    failed = [r for r in result.requests if r.error]
    assert any("busy" in r.error_detail for r in failed)


async def test_unreachable_server_counts_every_request_as_error():
    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = await run_load(f"http://127.0.0.1:{port}", MODEL_ID, 2, 5, 4, 4, timeout=2)
    assert (result.num_ok, result.num_errors, result.output_tokens) == (0, 5, 0)
    assert list(result.errors) == ["connection: ClientConnectorError"]
    assert result.ttft_p50_ms is None and result.output_tok_per_s == 0


@pytest.mark.parametrize("send_usage", [True, False])
async def test_multi_token_chunks_count_once_for_latency(fake_server, send_usage):
    url, _ = await fake_server(tokens_per_chunk=3, send_usage=send_usage)
    result = await run_load(url, MODEL_ID, 2, 4, prompt_len=4, output_len=9)
    assert result.num_ok == 4
    assert all(r.token_events == 3 and len(r.itl_s) == 2 for r in result.requests)
    # Without a usage chunk the only count left is one per content event.
    assert result.output_tokens == 4 * (9 if send_usage else 3)


def test_sse_decoder_handles_splits_crlf_comments_and_multiline():
    stream = (b": ping\r\n\r\ndata: {\"a\": 1}\r\n\r\nevent: x\nid: 3\ndata:{\"b\": 2}\n\n"
              b"data: line1\ndata: line2\n\n\n\ndata: [DONE]\n\ndata: tail")
    decoder, events = SSEDecoder(), []
    for i in range(len(stream)):  # one byte at a time: the worst split there is
        events += decoder.feed(stream[i:i + 1])
    events += decoder.finish()
    assert events == ['{"a": 1}', '{"b": 2}', "line1\nline2", "[DONE]", "tail"]


async def test_cli_prints_markdown_table_and_writes_json(fake_server, tmp_path):
    url, server = await fake_server()
    out = tmp_path / "load.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), "--base-url", url, "--concurrency", "1", "2",
        "--prompt-len", "8", "--output-len", "4", "--json", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    assert url in lines[0] and MODEL_ID in lines[0]
    table = [line for line in lines if line.startswith("|")]
    assert table[:2] == TABLE_HEADER.splitlines()
    assert [row.split("|")[1:3] for row in table[2:]] == [[" 1 ", " 8 / 0 "],
                                                          [" 2 ", " 8 / 0 "]]
    report = json.loads(out.read_text())
    assert report["model"] == MODEL_ID
    assert [(r["concurrency"], r["output_tokens"]) for r in report["runs"]] == [(1, 32), (2, 32)]
    assert len(server.prompts) == 1 + 8 + 8  # warm-up, then 8 per run
    _assert_all_distinct(server.prompts)


# --------------------------------------------------- prefix-cache workloads

async def test_shared_prefix_workload_shares_exactly_the_prefix(fake_server):
    from benchmarks.workloads import run_shared_prefix
    url, state = await fake_server()
    r = await run_shared_prefix(url, MODEL_ID, users=4, requests_per_user=2, prefix_len=64,
                                question_len=8, output_len=5, seed=3, vocab=5000)
    assert r.num_ok == 8 and r.num_errors == 0 and r.output_tokens == 40
    prompts = state.prompts
    assert len(prompts) == 9  # the warm-up, then the measured ones
    assert all(p[:64] == prompts[0][:64] for p in prompts)
    _assert_all_distinct([p[64:] for p in prompts])
    assert all(MIN_TOKEN_ID <= t < 5000 for p in prompts for t in p)
    # the fake reports what a 16-token-block cache finds: the whole prefix
    assert r.cached_share == pytest.approx(64 / 72)
    assert r.prompt_tokens == 8 * 72


async def test_multi_turn_workload_resends_the_history(fake_server):
    from benchmarks.workloads import run_multi_turn
    url, state = await fake_server()
    everything, later = await run_multi_turn(url, MODEL_ID, users=3, turns=3,
                                             context_words=20, question_words=4,
                                             output_len=3, seed=1)
    assert everything.num_ok == 9 and later.num_ok == 6
    assert everything.output_tokens == 27
    # TTFT is the first content, after the role chunk's 20 ms
    assert everything.ttft_p50_ms >= 20
    by_context: dict[str, list[list[dict]]] = {}
    for body in state.bodies:
        assert body["stream"] and body["max_tokens"] == 3
        by_context.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_context) == 3  # a context per user
    for turns in by_context.values():
        assert [len(m) for m in turns] == [2, 4, 6]
        for before, after in zip(turns, turns[1:]):
            assert after[:len(before)] == before
            assert after[len(before)] == {"role": "assistant", "content": "w0 w1 w2 "}
            assert after[-1]["role"] == "user"


async def test_long_prefill_workload_times_shorts_idle_and_during(fake_server):
    from benchmarks.workloads import run_long_prefill
    url, state = await fake_server()
    figures = await run_long_prefill(url, MODEL_ID, long_len=50, short_len=6, num_short=3,
                                     spacing_s=0.01, delay_s=0.01, output_len=4, seed=2,
                                     vocab=4000)
    lengths = [len(p) for p in state.prompts]
    assert lengths[:3] == [6, 6, 6] and sorted(lengths[3:]) == [6, 6, 6, 50]
    _assert_all_distinct(state.prompts)
    for key in ("short_ttft_p50_idle_ms", "short_ttft_p50_during_ms",
                "short_ttft_max_during_ms", "long_ttft_ms", "slowdown_p50"):
        assert figures[key] > 0, key
    assert figures["short_ttft_max_during_ms"] >= figures["short_ttft_p50_during_ms"]
