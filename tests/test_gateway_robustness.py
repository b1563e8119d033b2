"""The gateway under stress, on loopback, every wait bounded: clients that
vanish mid-generation, more requests than the queue takes, requests past
their time limit, and a SIGTERM while a stream is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import (Server, free_port, gated_backend, patched_execute,
                                  running_server)

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}


async def _until(predicate, timeout: float, what: str) -> None:
    """Poll without blocking the test's own loop (clients must keep closing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _until_idle(server: Server, timeout: float = 10.0) -> None:
    await _until(lambda: server.call(server.is_idle), timeout,
                 "every request to end and free its blocks")
    server.call(server.engine.check_integrity)
    await _until(lambda: not any(server.call(server.state_sizes).values()), timeout,
                 "every per-request table to empty")


def _events(raw: bytes) -> list[str]:
    return [e[len("data: "):] for e in raw.decode().split("\n\n") if e]


# --------------------------------------------------------------- disconnects

async def test_disconnects_free_everything(tiny_llama_dir):
    """20 streaming clients leave after a few chunks and 5 waiting for a whole
    response give up: every request is aborted, not run to its 400 tokens."""
    core = make_engine(tiny_llama_dir, num_kv_blocks=1024)
    with running_server(core) as srv:
        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            async def stream_and_leave(i: int) -> int:
                resp = await http.post("/v1/completions", json={**LONG, "stream": True,
                                                                "seed": i})
                assert resp.status == 200
                seen = 0
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        seen += 1
                        if seen == 3:
                            break
                resp.close()  # drops the connection mid-stream
                return seen

            async def wait_whole() -> None:
                async with http.post("/v1/completions", json=LONG) as resp:
                    await resp.read()

            whole = [asyncio.create_task(wait_whole()) for _ in range(5)]
            streamed = await asyncio.wait_for(
                asyncio.gather(*(stream_and_leave(i) for i in range(20))), 30)
            assert streamed == [3] * 20
            await _until(lambda: srv.state.in_flight == 5, 10, "the whole requests to start")
            assert srv.engine.num_running + srv.engine.num_waiting == 5
            assert not any(t.done() for t in whole), "a 400-token request finished already"
            steps_at_leave = srv.engine.num_steps
            for task in whole:
                task.cancel()
            await asyncio.gather(*whole, return_exceptions=True)
            await _until_idle(srv)
            # Aborted, not finished: far fewer steps than the 400 each wanted.
            assert srv.engine.num_steps - steps_at_leave < 200
            # The server is none the worse.
            async with http.post("/v1/completions", json={**LONG, "max_tokens": 5}) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 5
            await _until_idle(srv)


async def test_disconnect_while_queued_leaves_the_queue(tiny_llama_dir):
    """Clients that give up before their request was ever scheduled take it
    out of the waiting queue at once; the running one is unaffected."""
    core = make_engine(tiny_llama_dir, max_num_seqs=1)
    with running_server(core) as srv:
        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            async def post(body):
                async with http.post("/v1/completions", json=body) as resp:
                    return resp.status, await resp.read()

            with gated_backend(core) as gate:
                running = asyncio.create_task(post({**LONG, "max_tokens": 8}))
                await _until(lambda: srv.engine.num_running == 1, 10, "one running")
                queued = [asyncio.create_task(post({**LONG, "stream": i % 2 == 0}))
                          for i in range(6)]
                await _until(lambda: srv.engine.num_waiting == 6, 10, "six waiting")
                for task in queued:
                    task.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
                await _until(lambda: srv.engine.num_waiting == 0, 10, "the queue to empty")
                assert srv.engine.num_running == 1 and not running.done()
                gate.set()
                status, raw = await asyncio.wait_for(running, 30)
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 8
            await _until_idle(srv)


# ------------------------------------------------------------------ overload

async def test_overload_gets_429_and_admitted_complete(tiny_llama_dir):
    """15 at once against 2 running + 3 waiting: the excess is refused at once
    with Retry-After; every admitted request completes at full length."""
    core = make_engine(tiny_llama_dir, max_num_seqs=2)
    with running_server(core, ServerConfig(max_waiting_requests=3)) as srv:
        refused = 0

        async def one(http, i: int):
            nonlocal refused
            stream = i % 2 == 1
            body = {"prompt": "Hello", "max_tokens": 30, "ignore_eos": True, "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None}
            async with http.post("/v1/completions", json=body) as resp:
                raw = await resp.read()
                if resp.status == 429:
                    refused += 1
                return resp.status, dict(resp.headers), raw, stream

        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            # Hold the engine inside its first step, so admission sees a full
            # batch and queue no matter how fast this machine is.
            with gated_backend(core) as gate:
                tasks = [asyncio.create_task(one(http, i)) for i in range(15)]
                await _until(lambda: srv.state.in_flight + refused == 15, 20,
                             "every request to be admitted or refused")
                gate.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429}
        admitted = [r for r in results if r[0] == 200]
        assert 3 <= len(admitted) <= 5, statuses
        for status, headers, raw, _ in results:
            if status == 429:
                assert headers["Retry-After"] == "1"
                err = json.loads(raw)["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        for _, _, raw, stream in admitted:
            if stream:
                events = _events(raw)
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["usage"]["completion_tokens"] == 30
            else:
                body = json.loads(raw)
                assert body["usage"]["completion_tokens"] == 30
                assert body["choices"][0]["finish_reason"] == "length"
        await _until_idle(srv)


# ------------------------------------------------------------------- timeout

def _slow_steps(seconds: float):
    def wrap(real):
        def execute(output):
            time.sleep(seconds)
            return real(output)
        return execute
    return wrap


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", dict(LONG)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 400, "ignore_eos": True, "n": 2}),
])
async def test_request_timeout_returns_partial_text(tiny_llama_dir, route, body):
    core = make_engine(tiny_llama_dir)
    with running_server(core, ServerConfig(request_timeout=0.3)) as srv, \
            patched_execute(core, _slow_steps(0.01)):
        async with aiohttp.ClientSession(base_url=srv.base_url,
                                         timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.post(route, json=body) as resp:
                assert resp.status == 200
                out = await resp.json()
            n = body.get("n", 1)
            assert len(out["choices"]) == n
            for choice in out["choices"]:
                assert choice["finish_reason"] == "length"
                text = choice.get("text") or choice["message"]["content"]
                assert text
            assert 0 < out["usage"]["completion_tokens"] < 400 * n
            await _until_idle(srv)

            async with http.post(route, json={**body, "stream": True}) as resp:
                assert resp.status == 200
                events = _events(await resp.read())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks
                        if c["choices"][0]["finish_reason"]]
            assert finishes == ["length"] * n
            await _until_idle(srv)


# --------------------------------------------------------------- SIGTERM drain

# `baton serve` as its console script would run it; with a prelude, the same
# CLI after some monkeypatching.
_CLI = "import sys\n{prelude}\nfrom service.cli import main\nsys.exit(main(sys.argv[1:]))"


@contextlib.asynccontextmanager
async def _baton_serve(tmp_path: Path, *args: str, prelude: str = ""):
    """Start `baton serve --port P ARGS` and yield (process, base url, health()),
    health() being /health's status or None while nothing listens. Prints the
    server's log when the body fails; kills the process if it outlives the body."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLI.format(prelude=prelude), "serve",
             "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
            # One intra-op thread: on a busy shared CPU, torch's spinning OpenMP
            # workers make each step of the tiny model several times slower.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                async def health() -> int | None:
                    try:
                        async with http.get(f"{base}/health") as resp:
                            return resp.status
                    except aiohttp.ClientConnectionError:
                        return None
                yield proc, base, http, health
        except BaseException:
            print(log_path.read_text()[-4000:])  # shown with the failure
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


async def _wait_for_status(proc, health, wanted: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (status := await health()) != wanted:
        assert proc.poll() is None, f"baton serve exited (rc {proc.returncode})"
        assert time.monotonic() < deadline, f"/health was not {wanted} within {timeout}s " \
                                            f"(last {status})"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_sigterm_drains_in_flight_stream(tiny_llama_dir, tmp_path):
    """SIGTERM mid-stream: new requests get 503, the stream still runs to
    [DONE] at full length, and the process exits 0."""
    async with _baton_serve(tmp_path, "--model", str(tiny_llama_dir), "--dtype", "float32",
                            "--drain-timeout", "20",
                            # the 2 GiB default takes seconds to allocate
                            "--kv-cache-memory", "16MiB") as (proc, base, http, health):
        await _wait_for_status(proc, health, 200, 90)
        async with http.post(f"{base}/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as stream:
            assert stream.status == 200
            first = [await stream.content.readline() for _ in range(4)]
            assert first[0].startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)

            await _wait_for_status(proc, health, 503, 10)
            async with http.post(f"{base}/v1/completions",
                                 json={"prompt": "Hi", "max_tokens": 2}) as refused:
                assert refused.status == 503
                err = (await refused.json())["error"]
            assert "shutting down" in err["message"]
            rest = await asyncio.wait_for(stream.content.read(), 30)
        events = _events(b"".join(first) + rest)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
async def test_sigterm_while_loading_exits_at_once(tiny_llama_dir, tmp_path):
    """A stop during a (long) model load must not wait for the load to end."""
    never_loads = ("import threading, service.serve\n"
                   "service.serve.create_engine = lambda args: threading.Event().wait()")
    async with _baton_serve(tmp_path, "--model", str(tiny_llama_dir),
                            prelude=never_loads) as (proc, _, _, health):
        await _wait_for_status(proc, health, 503, 90)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


# -------------------------------------------------------------- backpressure

def test_a_stream_whose_client_stops_reading_is_ended(tiny_llama_dir):
    """Before: a client that stopped reading let its outputs pile up in an
    unbounded queue (~3 MB/s for n=32 with logprobs) until the request's time
    limit. Now, past the bound, its requests end (blocks freed) with an error
    the client finds if it reads on."""
    import socket

    core = make_engine(tiny_llama_dir)
    with running_server(core) as srv:
        srv.engine.max_queued_outputs = 16
        host, port = srv.base_url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        # Small buffers at the server's end too (loopback's grow to megabytes),
        # so that the queue, not the kernel, is what fills.
        srv.wait_until(lambda: srv.limiter.num_open == 1, what="the connection")
        (transport,) = srv.limiter._open.values()
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       4096)
        srv.call(lambda: transport.set_write_buffer_limits(high=16384))
        body = json.dumps({**LONG, "n": 8, "logprobs": 20, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            srv.wait_until(lambda: srv.engine.num_running == 8, what="the stream to start")
            # Not reading: the stream ends once its outputs back up past the bound,
            # and its blocks and slots are free while its client still reads nothing.
            srv.wait_until(srv.is_idle, timeout=60, what="the unread stream to be ended")
            assert srv.engine.num_overruns == 1
            assert srv.call(lambda: srv.engine.state_sizes())["scheduler"] == 0
            sock.settimeout(30)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        finally:
            sock.close()
        srv.wait_idle()
    text = raw.decode(errors="replace").replace(" ", "")
    assert '"type":"client_too_slow"' in text, text[-500:]
    assert '"finish_reason":"length"' not in text
    assert "data:[DONE]" in text[-100:]


async def test_sigterm_while_the_model_loads_exits_cleanly(tmp_path):
    """An orchestrator's SIGTERM during start-up, while the embedded model is
    converted and loaded on the loading thread: the process says it stopped
    while loading and exits 0 (it aborted in C++ teardown, rc 134, while that
    thread was still in torch)."""
    async with _baton_serve(tmp_path, "--conversion-cache", "none",
                            "--kv-cache-memory", "64MiB") as (proc, base, http, health):
        await _wait_for_status(proc, health, 503, 90)   # listening, loading
        await asyncio.sleep(1.0)                        # well inside the load
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    log = (tmp_path / "serve.log").read_text()
    assert '"during": "loading"' in log and "terminate called" not in log
