"""Admission as a hostile client meets it: every per-request value that could
reach a tensor, a C call or a quadratic loop is bounded with a 400 naming it;
a request that can never fit the queue gets 400, not a 429 retried for ever;
prompts are tokenized off the event loop; --default-max-tokens."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

MAX_MODEL_LEN = 128
MAX_WAITING = 8


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN)
    with running_server(core, ServerConfig(max_waiting_requests=MAX_WAITING)) as srv:
        yield srv


@pytest.fixture
async def http(server):
    async with aiohttp.ClientSession(base_url=server.base_url,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session
    server.wait_idle(timeout=10)


async def _post(http, body: dict, route: str = "/v1/completions") -> tuple[int, dict]:
    async with http.post(route, json=body) as resp:
        return resp.status, await resp.json()


async def _bad(http, body: dict, param: str, route: str = "/v1/completions") -> str:
    status, payload = await _post(http, body, route)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    return payload["error"]["message"]


# ------------------------------------------------------ defect 1: stop strings

async def test_one_huge_stop_string_is_refused(http):
    message = await _bad(http, {"prompt": "Hi", "max_tokens": 2, "stop": "x" * 60_000}, "stop")
    assert "256" in message


async def test_too_many_stop_strings_are_refused(http):
    message = await _bad(http, {"prompt": "Hi", "max_tokens": 2,
                                "stop": [f"s{i}" for i in range(17)]}, "stop")
    assert "16" in message


async def test_stop_strings_at_the_limits_are_served(http):
    stops = [f"{i:02d}" + "y" * 254 for i in range(16)]
    status, body = await _post(http, {"prompt": "Hi", "max_tokens": 4, "stop": stops,
                                      "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


# ------------------------------------------- defect 2: values reaching C calls

@pytest.mark.parametrize("body,param", [
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
async def test_out_of_range_values_are_refused(http, body, param):
    await _bad(http, {"prompt": "Hi", "max_tokens": 2, **body}, param)


async def test_extreme_but_valid_values_are_served(http):
    """The largest seed with n=2 (the second choice's seed wraps), a top_k past
    the vocabulary, a temperature too small to divide by: all run."""
    status, body = await _post(http, {"prompt": "Hi", "max_tokens": 3, "n": 2,
                                      "seed": 2**63 - 1, "top_k": 2**31 - 1,
                                      "temperature": 1e-30, "ignore_eos": True})
    assert status == 200, body
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]


# ----------------------------------- defect 5: more than the queue ever holds

async def test_more_prompts_than_the_queue_holds_is_400(http):
    message = await _bad(http, {"prompt": ["Hi"] * (MAX_WAITING + 1), "max_tokens": 1},
                         "prompt")
    assert str(MAX_WAITING) in message


async def test_more_choices_than_the_queue_holds_is_400(http):
    message = await _bad(http, {"prompt": ["Hi", "Ho"], "n": MAX_WAITING // 2 + 1,
                                "max_tokens": 1}, "n")
    assert str(MAX_WAITING) in message


async def test_exactly_the_queue_bound_is_served(http):
    status, body = await _post(http, {"prompt": ["Hi", "Ho"], "n": MAX_WAITING // 2,
                                      "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == MAX_WAITING


# --------------------------- defect 9: the context error names what overflows

async def test_context_error_names_max_tokens_when_the_completion_overflows(http):
    message = await _bad(http, {"prompt": list(range(10, 110)), "max_tokens": MAX_MODEL_LEN},
                         "max_tokens")
    assert f"requested {100 + MAX_MODEL_LEN} tokens" in message
    await _bad(http, {"prompt": list(range(10, 10 + MAX_MODEL_LEN)), "max_tokens": 1},
               "prompt")


# ------------------------------------ defect 11: tokenization off the loop

async def test_prompts_are_tokenized_and_rendered_off_the_event_loop(server, http):
    tokenizer = server.engine.tokenizer
    threads: list[str] = []
    real = type(tokenizer).encode

    def encode(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    tokenizer.encode = encode.__get__(tokenizer)
    try:
        assert (await _post(http, {"prompt": "Hello there", "max_tokens": 1}))[0] == 200
        assert (await _post(http, {"messages": [{"role": "user", "content": "Hi"}],
                                   "max_tokens": 1}, "/v1/chat/completions"))[0] == 200
        async with http.post("/tokenize", json={"prompt": "Hello"}) as resp:
            assert resp.status == 200
    finally:
        del tokenizer.encode
    loop_thread = server.loop._thread_id  # noqa: SLF001 - the server loop's own thread
    names = {t.ident: t.name for t in threading.enumerate()}
    assert len(threads) == 3
    assert names.get(loop_thread) not in threads
    assert all(name.startswith("baton-preprocess") for name in threads), threads


# --------------------------------------------- defect 12: --default-max-tokens

def test_default_max_tokens_applies_when_the_request_sends_none(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN)
    config = ServerConfig(default_max_tokens=3)
    import urllib.request, json  # noqa: E401 - a synchronous client is enough here

    def post(route, body):
        req = urllib.request.Request(f"{srv.base_url}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)

    with running_server(core, config) as srv:
        chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                             "ignore_eos": True})
        assert chat["usage"]["completion_tokens"] == 3
        completion = post("/v1/completions", {"prompt": "Hi", "ignore_eos": True})
        assert completion["usage"]["completion_tokens"] == 3
        # An explicit max_tokens wins; a default past the context is cut to fit.
        explicit = post("/v1/completions", {"prompt": "Hi", "max_tokens": 5,
                                            "ignore_eos": True})
        assert explicit["usage"]["completion_tokens"] == 5
        srv.wait_idle()
    config = ServerConfig(default_max_tokens=10_000)
    with running_server(make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN), config) as srv:
        long = post("/v1/completions", {"prompt": list(range(10, 10 + MAX_MODEL_LEN - 2)),
                                        "ignore_eos": True})
        assert long["usage"]["completion_tokens"] == 2
        srv.wait_idle()


# ------------------------------------ hardening II: cheap checks come first

class _CountedEncode:
    """Counts (and can slow) the tokenizer's encode calls on the server."""

    def __init__(self, tokenizer, delay: float = 0.0) -> None:
        self.tokenizer, self.delay, self.calls = tokenizer, delay, 0
        self.real = type(tokenizer).encode

    def __enter__(self):
        import time

        def encode(tok, *args, **kwargs):
            self.calls += 1
            time.sleep(self.delay)
            return self.real(tok, *args, **kwargs)
        self.tokenizer.encode = encode.__get__(self.tokenizer)
        return self

    def __exit__(self, *exc):
        del self.tokenizer.encode


async def test_too_many_prompts_are_refused_before_any_is_tokenized(server, http):
    """Before: a list of 1,000,000 strings was tokenized in full (~45 s on
    the threads every request shares) before the count answered 400."""
    with _CountedEncode(server.engine.tokenizer) as counted:
        message = await _bad(http, {"prompt": ["Hi there"] * 100_000, "max_tokens": 1},
                             "prompt")
    assert "100000 prompts" in message and counted.calls == 0


async def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server, http):
    """Before: a 6.7 MB prompt was tokenized (seconds, ~1 GB resident) and
    only then found too long. Its characters alone prove it too many tokens."""
    longest = MAX_MODEL_LEN * server.engine.tokenizer.max_chars_per_token
    with _CountedEncode(server.engine.tokenizer) as counted:
        status, body = await _post(http, {"prompt": "word " * (longest // 5 + 1),
                                          "max_tokens": 1})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        message = await _bad(http, {"messages": [{"role": "user", "content": "x" * longest},
                                                 {"role": "user", "content": "y"}]},
                             "messages", "/v1/chat/completions")
        assert "characters" in message
    assert counted.calls == 0
    # One that might fit is tokenized and judged by its tokens.
    assert (await _post(http, {"prompt": "Hi " * 10, "max_tokens": 1}))[0] == 200


DEEP = "__deep__"


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("where", ["metadata", "json_schema", "tool_parameters",
                                   "structured_outputs_string", "shallow_but_over_the_limit"])
async def test_deep_nesting_is_a_400_not_a_500(http, where):
    """Before: ~3,000 levels anywhere in a body raised RecursionError: 500
    "internal error" and a traceback per request."""
    body: dict = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if where == "metadata":
        body["metadata"] = {"a": DEEP}
    elif where == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "default": DEEP}}}
    elif where == "tool_parameters":
        body["tools"] = [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "default": DEEP}}}]
    elif where == "structured_outputs_string":
        body["structured_outputs"] = {"json": '{"type": "object", "default": %s}' % _nested(3000)}
    else:
        body["metadata"] = {"a": DEEP}
    depth = 100 if where.startswith("shallow") else 3000
    text = json.dumps(body).replace(f'"{DEEP}"', _nested(depth))
    async with http.post("/v1/chat/completions", data=text,
                         headers={"Content-Type": "application/json"}) as resp:
        status, payload = resp.status, await resp.json()
    assert status == 400, payload
    assert "nests" in payload["error"]["message"]


async def test_a_request_id_is_bounded(http):
    await _bad(http, {"prompt": "Hi", "max_tokens": 1, "request_id": "x" * 129}, "request_id")
    await _bad(http, {"prompt": "Hi", "max_tokens": 1, "request_id": "a\nforged log line"},
               "request_id")
    status, body = await _post(http, {"prompt": "Hi", "max_tokens": 1, "request_id": "x" * 128})
    assert status == 200 and body["id"] == "cmpl-" + "x" * 128


async def test_too_many_choice_labels_are_refused_before_compiling(http):
    message = await _bad(http, {"prompt": "Hi", "max_tokens": 1, "structured_outputs": {
        "choice": [f"c{i}" for i in range(10_001)]}}, "structured_outputs")
    assert "10000" in message


def test_n_cannot_take_every_running_slot(tiny_llama_dir):
    """Before: one request with n at least --max-num-seqs held every slot
    (an innocent request waited ~58 s behind it)."""
    import urllib.error
    import urllib.request

    with running_server(make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=4)) as srv:
        def post(n: int) -> tuple[int, dict]:
            req = urllib.request.Request(
                f"{srv.base_url}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"prompt": "Hi", "max_tokens": 1, "n": n}).encode())
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status, json.load(resp)
            except urllib.error.HTTPError as exc:
                return exc.code, json.load(exc)

        status, body = post(3)
        assert status == 400 and body["error"]["param"] == "n", body
        assert "at most 2" in body["error"]["message"]
        assert post(2)[0] == 200
        srv.wait_idle()


async def test_a_disconnect_stops_the_tokenizing(server, http):
    """Before: a client that went away left its prompts being tokenized to
    the end on the threads every request shares."""
    with _CountedEncode(server.engine.tokenizer, delay=0.2) as counted:
        task = asyncio.create_task(http.post("/v1/completions", json={
            "prompt": ["Hello there"] * MAX_WAITING, "max_tokens": 1}))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if counted.calls:
                break
        task.cancel()  # the client goes away while its first prompt is tokenized
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2 * MAX_WAITING + 0.5)
        assert 1 <= counted.calls <= 2, counted.calls
