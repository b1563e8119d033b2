"""The gateway through the official ``openai`` SDK, as users will call it:
completions and chat, streamed and whole, n, logprobs, stop strings, seeds,
usage, token-id prompts, echo, and errors as the SDK's typed exceptions."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import gated_backend, patched_execute, running_server

MESSAGES = [{"role": "user", "content": "Hello, world! How are you doing today?"}]
PROMPT = "The quick brown fox"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir), ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def ends_idle(request):
    """After every scenario on the shared server, nothing runs and no block leaks."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle(timeout=10)


def _model(server) -> str:
    return server.state.model_name


# ------------------------------------------------------------------- basics

def test_models_lists_the_served_name(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [_model(server)]
    assert models.data[0].max_model_len == server.core.max_model_len


def test_completion_whole(server, client):
    resp = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=8,
                                     temperature=0, extra_body=NO_EOS)
    assert resp.object == "text_completion" and resp.model == _model(server)
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].text
    prompt_len = len(server.core.tokenizer.encode(PROMPT))
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == prompt_len + 8


def test_chat_whole(server, client):
    resp = client.chat.completions.create(model=_model(server), messages=MESSAGES,
                                          max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6


def test_model_may_be_omitted_by_raw_clients(server):
    # The SDK always sends model; raw clients often do not.
    req = urllib.request.Request(f"{server.base_url}/v1/completions",
                                 data=b'{"prompt": "Hi", "max_tokens": 2}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


# ---------------------------------------------------------------- streaming

def test_completion_stream_equals_whole_for_a_seed(server, client):
    kwargs = dict(model=_model(server), prompt=PROMPT, max_tokens=24, temperature=1.0,
                  seed=11, extra_body=NO_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_equals_whole_for_a_seed(server, client):
    kwargs = dict(model=_model(server), messages=MESSAGES, max_tokens=24, temperature=1.0,
                  seed=12, extra_body=NO_EOS)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_include_usage(server, client):
    chunks = list(client.chat.completions.create(
        model=_model(server), messages=MESSAGES, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None for c in chunks[:-1])

    chunks = list(client.completions.create(
        model=_model(server), prompt=PROMPT, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_stream_without_usage_has_none(server, client):
    chunks = list(client.completions.create(model=_model(server), prompt=PROMPT,
                                            max_tokens=3, stream=True, extra_body=NO_EOS))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)


# ----------------------------------------------------------------- n, seeds

def test_n2_whole_has_two_distinct_choices(server, client):
    resp = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=16,
                                     n=2, temperature=1.0, seed=5, extra_body=NO_EOS)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text != resp.choices[1].text
    assert resp.usage.completion_tokens == 32


def test_n2_stream_interleaves_choices(server, client):
    chunks = list(client.chat.completions.create(
        model=_model(server), messages=MESSAGES, max_tokens=12, n=2, temperature=1.0,
        seed=5, stream=True, extra_body=NO_EOS))
    order = [c.choices[0].index for c in chunks]
    assert set(order) == {0, 1}
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches > 2, f"choices were not streamed interleaved: {order}"
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}


def test_seed_reproducible_and_different_seeds_differ(server, client):
    def sample(seed):
        return client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=20,
                                         temperature=1.0, seed=seed,
                                         extra_body=NO_EOS).choices[0].text
    first = sample(123)
    assert sample(123) == first
    assert sample(124) != first


# ----------------------------------------------------------------- logprobs

def test_completion_logprobs(server, client):
    resp = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=6,
                                     logprobs=3, temperature=0, extra_body=NO_EOS)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        # Partial UTF-8 tokens may share a display string, so a dict can hold fewer.
        assert 1 <= len(top) <= 3
        assert all(v <= 0.0 for v in top.values())
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs_with_top_logprobs(server, client):
    resp = client.chat.completions.create(model=_model(server), messages=MESSAGES,
                                          max_tokens=5, logprobs=True, top_logprobs=2,
                                          extra_body=NO_EOS)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5 == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == resp.choices[0].message.content


def test_no_logprobs_unless_asked(server, client):
    resp = client.chat.completions.create(model=_model(server), messages=MESSAGES,
                                          max_tokens=3)
    assert resp.choices[0].logprobs is None


# -------------------------------------------------------------- stop strings

@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, client, stream):
    base = dict(model=_model(server), prompt=PROMPT, max_tokens=40, temperature=0,
                extra_body=NO_EOS)
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(stop) == 2 and stop in full
    expected = full[:full.index(stop)]
    if stream:
        chunks = list(client.completions.create(stop=[stop], stream=True, **base))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(stop=stop, **base).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert stop not in text
    assert text == expected
    assert reason == "stop"


# ------------------------------------------------------------ prompt shapes

def test_token_id_prompt(server, client):
    ids = server.core.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=_model(server), prompt=ids, max_tokens=8,
                                       temperature=0, extra_body=NO_EOS)
    by_text = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=8,
                                        temperature=0, extra_body=NO_EOS)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_list_of_prompts(server, client):
    prompts = [PROMPT, "Once upon a time", "Hello"]
    resp = client.completions.create(model=_model(server), prompt=prompts, max_tokens=4,
                                     temperature=0, extra_body=NO_EOS)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    tok = server.core.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == 12
    for p, c in zip(prompts, resp.choices):
        alone = client.completions.create(model=_model(server), prompt=p, max_tokens=4,
                                          temperature=0, extra_body=NO_EOS)
        assert c.text == alone.choices[0].text


def test_list_of_token_id_prompts_with_n(server, client):
    tok = server.core.tokenizer
    prompts = [tok.encode("Hello"), tok.encode("Once upon a time")]
    resp = client.completions.create(model=_model(server), prompt=prompts, max_tokens=3,
                                     n=2, temperature=0, extra_body=NO_EOS)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    # Greedy: both choices of a prompt agree; choices i*n..i*n+n-1 belong to prompt i.
    assert resp.choices[0].text == resp.choices[1].text
    assert resp.choices[2].text == resp.choices[3].text


@pytest.mark.parametrize("stream", [False, True])
def test_echo(server, client, stream):
    kwargs = dict(model=_model(server), prompt=PROMPT, max_tokens=5, temperature=0,
                  echo=True, extra_body=NO_EOS)
    plain = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=5,
                                      temperature=0, extra_body=NO_EOS).choices[0].text
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True,
                                                                              **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == PROMPT + plain


# ------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),
    (dict(prompt=[100000]), "prompt"),
])
def test_bad_parameters_are_bad_request(server, client, kwargs, param):
    args = dict(model=_model(server), prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "invalid_request_error"
    assert err.body["param"] == param == err.param
    assert err.body["message"]


def test_chat_bad_parameters(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(server), messages=MESSAGES,
                                       top_logprobs=2)
    assert info.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(server), messages=[])
    assert info.value.param == "messages"


def test_unknown_model_is_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.param == "model"
    assert "no-such-model" in info.value.body["message"]


def test_api_key_required(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir), ServerConfig(api_key="sesame")) as srv:
        url = f"{srv.base_url}/v1"
        good = OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=30)
        assert good.completions.create(model=srv.state.model_name, prompt=PROMPT,
                                       max_tokens=2).choices[0].text is not None
        wrong = OpenAI(base_url=url, api_key="open", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model=srv.state.model_name, prompt=PROMPT, max_tokens=2)
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        # No Authorization header at all.
        req = urllib.request.Request(f"{url}/models")
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(req, timeout=30)
        assert http_info.value.code == 401
        # Health stays open to probes.
        with urllib.request.urlopen(f"{srv.base_url}/health", timeout=30) as resp:
            assert resp.status == 200
        srv.wait_idle()


def test_queue_full_is_rate_limited(tiny_llama_dir):
    """One running, one waiting (the queue's limit): the next is refused at
    once with 429 and Retry-After, and both admitted requests still finish."""
    core = make_engine(tiny_llama_dir, max_num_seqs=1)
    with running_server(core, ServerConfig(max_waiting_requests=1)) as srv:
        client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        model = srv.state.model_name
        results: dict[str, object] = {}

        def call(name):
            try:
                results[name] = client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=10, extra_body=NO_EOS)
            except Exception as exc:  # noqa: BLE001 - inspected below
                results[name] = exc

        with gated_backend(core) as gate:
            threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
            threads[0].start()
            srv.wait_until(lambda: core.scheduler.num_running == 1, what="a running")
            threads[1].start()
            srv.wait_until(lambda: core.scheduler.num_waiting == 1, what="b waiting")
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=model, prompt=PROMPT, max_tokens=10)
            gate.set()
            for t in threads:
                t.join(30)
        err = info.value
        assert err.status_code == 429
        assert err.response.headers["retry-after"] == "1"
        assert err.body["type"] == "rate_limit_error" and err.body["code"] == "queue_full"
        for name in ("a", "b"):
            assert not isinstance(results[name], Exception), results[name]
            assert results[name].usage.completion_tokens == 10
        srv.wait_idle()


def test_fault_mid_stream_raises_in_the_sdk(server, client):
    """An engine fault after the stream began arrives as an SSE error event,
    which the SDK raises as APIError; the server serves the next request."""
    calls = {"n": 0}

    def wrap(real):
        def execute(output):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("simulated device fault")
            return real(output)
        return execute

    with patched_execute(server.core, wrap):
        stream = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=30,
                                           stream=True, extra_body=NO_EOS)
        received = []
        with pytest.raises(openai.APIError, match="simulated device fault"):
            for chunk in stream:
                received.append(chunk.choices[0].text)
        assert received, "the fault came before any chunk"
        server.wait_idle()
        resp = client.completions.create(model=_model(server), prompt=PROMPT, max_tokens=3,
                                         extra_body=NO_EOS)
        assert resp.usage.completion_tokens == 3
