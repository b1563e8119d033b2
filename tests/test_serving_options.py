"""`baton serve` options a client or operator notices: several served model
names, CORS for browser clients (off unless asked for), request log lines
that --disable-log-requests turns off, and --generation-config's three
meanings (auto, vllm, a folder) as vLLM gives them."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import urllib.request

import pytest
import structlog

from backends.config import GenerationDefaults
from backends.errors import ModelLoadError
from backends.loader.generation_config import apply_generation_config
from service.config import EngineArgs, ServerConfig
from service.openai_requests import prepare_completion
from service.protocol import CompletionRequest
from telemetry.logs import configure_logging
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


def _call(url: str, body: dict | None = None, method: str | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_several_served_model_names(core):
    config = ServerConfig(served_model_names=("tiny", "gpt-4o-mini"))
    with running_server(core, config) as server:
        status, _, body = _call(f"{server.base_url}/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == ["tiny", "gpt-4o-mini"]
        for alias in ("tiny", "gpt-4o-mini"):
            status, _, body = _call(f"{server.base_url}/v1/completions",
                                    {"model": alias, "prompt": "hello", "max_tokens": 2})
            assert status == 200 and json.loads(body)["model"] == "tiny"
        status, _, body = _call(f"{server.base_url}/v1/completions",
                                {"model": "other", "prompt": "hello", "max_tokens": 2})
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_no_cors_headers_unless_origins_are_allowed(core):
    with running_server(core, ServerConfig()) as server:
        _, headers, _ = _call(f"{server.base_url}/v1/models",
                              headers={"Origin": "https://app.example"})
        assert "Access-Control-Allow-Origin" not in headers
        status, _, _ = _call(f"{server.base_url}/v1/completions", method="OPTIONS", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert status == 405  # no preflight answered: browsers refuse the call


def test_cors_for_allowed_origins_on_answers_errors_and_streams(core):
    origin = "https://app.example"
    config = ServerConfig(allowed_origins=(origin,), api_key="sekret")
    with running_server(core, config) as server:
        url = f"{server.base_url}/v1/chat/completions"
        # a preflight needs no key and names what the browser asked for
        status, headers, _ = _call(url, method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204
        assert headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        body = {"max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        # an error (no key) still carries the header, so the page can read it
        status, headers, _ = _call(url, body, headers={"Origin": origin})
        assert status == 401 and headers["Access-Control-Allow-Origin"] == origin
        assert "Origin" in headers.get("Vary", "")
        auth = {"Origin": origin, "Authorization": "Bearer sekret"}
        status, headers, _ = _call(url, body, headers=auth)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        status, headers, stream = _call(url, {**body, "stream": True}, headers=auth)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        assert stream.rstrip().endswith(b"data: [DONE]")
        # another origin gets no header, and its preflight is refused
        _, headers, _ = _call(url, body, headers={**auth, "Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in headers
        status, _, _ = _call(url, method="OPTIONS", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert status == 403
    with running_server(core, ServerConfig(allowed_origins=("*",))) as server:
        _, headers, _ = _call(f"{server.base_url}/v1/models", headers={"Origin": "http://x"})
        assert headers["Access-Control-Allow-Origin"] == "*"


@pytest.fixture
def log_lines():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    configure_logging(json=True, level="INFO", stream=buf)
    yield lambda: [json.loads(line) for line in buf.getvalue().splitlines()]
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.mark.parametrize("log_requests", [True, False])
def test_disable_log_requests(core, log_lines, log_requests):
    with running_server(core, ServerConfig(log_requests=log_requests)) as server:
        status, _, _ = _call(f"{server.base_url}/v1/completions",
                             {"prompt": "hello", "max_tokens": 2})
        assert status == 200
        server.wait_idle()
    lines = [line for line in log_lines() if line.get("logger") == "baton.request"]
    assert len(lines) == (1 if log_requests else 0)


# ------------------------------------------------------------ generation config

MODEL = GenerationDefaults(eos_token_ids=(2, 7), bos_token_id=1, temperature=0.6, top_p=0.9,
                           top_k=20, min_p=0.05, repetition_penalty=1.1, max_new_tokens=None)


def test_generation_config_modes(tmp_path):
    assert apply_generation_config("auto", MODEL) == MODEL
    vllm = apply_generation_config("vllm", MODEL)
    assert vllm == GenerationDefaults(eos_token_ids=(2, 7), bos_token_id=1)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "max_new_tokens": 5, "eos_token_id": [9]}))
    for where in (tmp_path, tmp_path / "generation_config.json"):
        own = apply_generation_config(str(where), MODEL)
        assert own == GenerationDefaults(eos_token_ids=(9,), bos_token_id=1, temperature=0.3,
                                         max_new_tokens=5)
    with pytest.raises(ModelLoadError, match="no generation_config.json there"):
        apply_generation_config(str(tmp_path / "missing"), MODEL)


def test_defaults_reach_sampling_params_and_max_new_tokens_caps(core):
    tok = core.tokenizer
    req = CompletionRequest(prompt="hello", max_tokens=100)
    params = prepare_completion(req, tok, MODEL).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    own = CompletionRequest(prompt="hello", temperature=1.0, min_p=0.0, max_tokens=100)
    assert prepare_completion(own, tok, MODEL).params.temperature == 1.0
    assert prepare_completion(own, tok, MODEL).params.min_p == 0.0
    capped = dataclasses.replace(MODEL, max_new_tokens=5)
    assert prepare_completion(req, tok, capped).params.max_tokens == 5
    small = CompletionRequest(prompt="hello", max_tokens=3)
    assert prepare_completion(small, tok, capped).params.max_tokens == 3


def test_engine_serves_with_the_chosen_generation_config(tiny_llama_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    core = make_engine(tiny_llama_dir, generation_config=str(tmp_path))
    assert core.generation.max_new_tokens == 3
    with running_server(core, ServerConfig()) as server:
        status, _, body = _call(f"{server.base_url}/v1/completions",
                                {"prompt": "hello", "max_tokens": 50, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    with pytest.raises(ModelLoadError, match="no generation_config.json"):
        make_engine(tiny_llama_dir, generation_config=str(tmp_path / "nope"))
    assert EngineArgs().generation_config == "auto"


def test_serving_beyond_loopback_without_a_key_is_flagged():
    from service.serve import _is_loopback

    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.1.2.3")
    assert not _is_loopback("baton.internal")
