"""The gateway over raw HTTP: every bad request gets OpenAI's error envelope
with the right status and param and leaves the server serving; the utility
routes; and an engine fault after a stream began arrives as an SSE error event."""

from __future__ import annotations

import json

import aiohttp
import pytest

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import patched_execute, running_server

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN)
    with running_server(core, ServerConfig(max_body_bytes=1024 * 1024)) as srv:
        yield srv


@pytest.fixture
async def http(server):
    async with aiohttp.ClientSession(base_url=server.base_url,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
    server.wait_idle(timeout=10)


async def _error(resp: aiohttp.ClientResponse, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


async def _good_completion(http, n: int = 1) -> dict:
    async with http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "n": n,
                                                  "ignore_eos": True}) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert len(body["choices"]) == n
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * n
    return body


def _sse_events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


# ------------------------------------------------------------- bad requests

BAD_BODIES = [
    # (route, body bytes, status, param or None, a word the message must hold)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "JSON"),
    ("/v1/completions", b"not json at all", 400, None, "JSON"),
    ("/v1/completions", b"", 400, None, "JSON"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "a"}', 400, "max_tokens", "int"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", "float"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 5}', 400, "stop", "stop"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt", "prompt"),
    ("/v1/completions", b'[1, 2, 3]', 400, None, "object"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": [[]]}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": ["a", ""]}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": ["a", 5]}', 400, "prompt", "mixture"),
    ("/v1/completions", b'{"prompt": "a", "n": 1000}', 400, "n", "n"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"x": 1}}', 400, "logit_bias", "x"),
    ("/v1/completions", '{"prompt": "caf\u00e9'.encode("latin-1") + b'"}', 400, None, "UTF-8"),
    ("/v1/completions", b'{"prompt": "ok \xff\xfe"}', 400, None, "UTF-8"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400,
     "messages", "role"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages", "image_url"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"logprobs": true, "top_logprobs": 50}', 400, "top_logprobs", "20"),
    ("/tokenize", b'{}', 400, "prompt", "prompt"),
    ("/detokenize", b'{"tokens": [1, 99999]}', 400, "tokens", "99999"),
    ("/detokenize", b'{"tokens": "abc"}', 400, "tokens", "array"),
]


@pytest.mark.parametrize("route,body,status,param,word", BAD_BODIES)
async def test_bad_request_gets_envelope(http, route, body, status, param, word):
    async with http.post(route, data=body, headers={"Content-Type": "application/json"}) as r:
        err = await _error(r, status)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert word.lower() in err["message"].lower(), err["message"]


async def test_body_too_large_is_413(http):
    body = b'{"prompt": "' + b"a" * (2 * 1024 * 1024) + b'"}'
    try:
        async with http.post("/v1/completions", data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            err = await _error(resp, 413)
    except aiohttp.ClientOSError as exc:
        pytest.fail(f"the server dropped the connection instead of answering 413: {exc}")
    assert "too large" in err["message"]
    await _good_completion(http)


async def test_ten_megabyte_body_is_413(tiny_llama_dir):
    # The default limit (8 MiB) against a 10 MB body.
    with running_server(make_engine(tiny_llama_dir, num_kv_blocks=16)) as srv:
        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            body = b'{"prompt": "' + b"a" * (10 * 1000 * 1000) + b'"}'
            async with http.post("/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as resp:
                err = await _error(resp, 413)
            assert "too large" in err["message"]
            await _good_completion(http)


@pytest.mark.parametrize("extra,asked", [
    (dict(prompt=list(range(10, 10 + MAX_MODEL_LEN + 20)), max_tokens=4), MAX_MODEL_LEN + 24),
    (dict(prompt=list(range(10, 10 + MAX_MODEL_LEN)), max_tokens=1), MAX_MODEL_LEN + 1),
    (dict(prompt=list(range(10, 110)), max_tokens=MAX_MODEL_LEN), 100 + MAX_MODEL_LEN),
])
async def test_context_length_exceeded(http, extra, asked):
    async with http.post("/v1/completions", json=extra) as resp:
        err = await _error(resp, 400)
    assert err["code"] == "context_length_exceeded"
    # the prompt when it alone is too long, else the completion asked for
    assert err["param"] == ("prompt" if len(extra["prompt"]) >= MAX_MODEL_LEN else "max_tokens")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert f"requested {asked} tokens" in err["message"]


async def test_prompt_that_exactly_fits_is_served(http):
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 8))
    async with http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                  "ignore_eos": True}) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


async def test_long_text_prompt_context_length(http):
    async with http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "The quick brown fox. " * 100}]}) as resp:
        err = await _error(resp, 400)
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in err["message"]


async def test_unknown_route_and_method(http):
    async with http.get("/v1/nothing-here") as resp:
        err = await _error(resp, 404)
    assert "/v1/nothing-here" in err["message"]
    async with http.get("/v1/completions") as resp:
        await _error(resp, 405)


async def test_unknown_model_is_404(http):
    async with http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}) as resp:
        err = await _error(resp, 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


async def test_server_serves_normally_after_bad_requests(server, http):
    """Every kind of bad request above, back to back on one connection, then a
    good one: it is answered in full and every KV block is free again."""
    for route, body, status, _, _ in BAD_BODIES:
        async with http.post(route, data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            await _error(resp, status)
    async with http.post("/v1/completions", json={"prompt": list(range(500))}) as resp:
        await _error(resp, 400)
    await _good_completion(http)
    await _good_completion(http, n=2)
    server.wait_idle()
    kv = server.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


# ------------------------------------------------------------ utility routes

async def test_tokenize_detokenize_round_trip(server, http):
    text = "Hello, world! Café 🙂"
    async with http.post("/tokenize", json={"prompt": text}) as resp:
        assert resp.status == 200
        tok = await resp.json()
    assert tok["tokens"] == server.core.tokenizer.encode(text)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    async with http.post("/detokenize", json={"tokens": tok["tokens"]}) as resp:
        assert resp.status == 200
        assert (await resp.json())["prompt"] == text


async def test_tokenize_returns_token_strings_and_tokenizer_info(server, http):
    async with http.post("/tokenize", json={"prompt": "Hello world",
                                            "return_token_strs": True}) as resp:
        tok = await resp.json()
    vocab = server.core.tokenizer
    assert tok["token_strs"] == [vocab.id_to_token(i) for i in tok["tokens"]]
    assert "".join(tok["token_strs"]).replace("\u0120", " ") == "Hello world"  # byte-level BPE
    async with http.post("/tokenize", json={"prompt": "Hello"}) as resp:
        assert (await resp.json())["token_strs"] is None
    async with http.get("/tokenizer_info") as resp:
        assert resp.status == 200
        info = await resp.json()
    spec = vocab.spec
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["vocab_size"] == vocab.vocab_size and info["model_max_length"] == MAX_MODEL_LEN
    assert (info["bos_token"], info["eos_token"]) == (spec.bos_token, spec.eos_token)
    assert info["add_bos_token"] is spec.add_bos_token
    assert info["chat_template"] == spec.chat_template


async def test_tokenize_messages_matches_chat_prompt(http):
    messages = [{"role": "user", "content": "Hi"}]
    async with http.post("/tokenize", json={"messages": messages}) as resp:
        ids = (await resp.json())["tokens"]
    async with http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}
                         ) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == len(ids)
    async with http.post("/detokenize", json={"tokens": ids}) as resp:
        text = (await resp.json())["prompt"]
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


async def test_health_version_openapi(http):
    async with http.get("/health") as resp:
        assert resp.status == 200 and await resp.text() == "ok"
    async with http.get("/version") as resp:
        assert resp.status == 200
        assert (await resp.json())["version"]
    async with http.get("/openapi.json") as resp:
        assert resp.status == 200
        doc = json.loads(await resp.read())
    assert doc["openapi"] == "3.1.0"
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert "messages" in schema["properties"] and "messages" in schema["required"]
    assert "/v1/completions" in doc["paths"] and "/v1/models" in doc["paths"]


@pytest.mark.parametrize("phase,retry_after", [("loading", "5"), ("draining", "5")])
async def test_not_ready_is_503(server, http, phase, retry_after):
    server.call(lambda: setattr(server.state, "phase", phase))
    try:
        async with http.get("/health") as resp:
            assert resp.status == 503 and await resp.text() == phase
        async with http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            err = await _error(resp, 503)
            assert resp.headers.get("Retry-After") == retry_after
        assert err["type"] == "service_unavailable"
        async with http.post("/tokenize", json={"prompt": "hi"}) as resp:
            await _error(resp, 503)
    finally:
        server.call(lambda: setattr(server.state, "phase", "ready"))
    await _good_completion(http)


# -------------------------------------------------------------- engine faults

def _fail_on_call(number: int):
    """Let calls 1..number-1 through, raise on call ``number``, then pass again."""
    calls = {"n": 0}

    def wrap(real):
        def execute(output):
            calls["n"] += 1
            if calls["n"] == number:
                raise RuntimeError("simulated device fault")
            return real(output)
        return execute
    return wrap


async def test_fault_mid_stream_is_an_sse_error_event(server, http):
    with patched_execute(server.core, _fail_on_call(5)):
        async with http.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
            assert r.status == 200
            assert r.content_type == "text/event-stream"
            events = _sse_events(await r.read())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error"
        assert "simulated device fault" in error["message"]
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
        server.wait_idle()
        # Only that step's requests failed: the next one is served in full.
        await _good_completion(http)
        async with http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "stream": True}) as r:
            assert r.status == 200
            assert _sse_events(await r.read())[-1] == "[DONE]"


async def test_fault_in_whole_request_is_500(server, http):
    with patched_execute(server.core, _fail_on_call(3)):
        async with http.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 20, "ignore_eos": True}) as resp:
            err = await _error(resp, 500)
        assert err["type"] == "internal_error"
        assert "simulated device fault" in err["message"]
        server.wait_idle()
        await _good_completion(http)
