"""Prompt scoring: /v1/completions with echo, logprobs and max_tokens 0 (as
the legacy OpenAI API and vLLM take it, what lm-eval's loglikelihood tasks
send) answers the prompt with its logprobs and generates nothing; the
engine computes the prompt, samples no token, and frees every block."""

from __future__ import annotations

import pytest
from openai import OpenAI

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import patched_execute, running_server

PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A small step budget, so a long prompt is prefilled in several chunks.
    core = make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
    with running_server(core, ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def ends_idle(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle(timeout=10)


def _score(client, server, prompt, **kwargs):
    return client.completions.create(model=server.state.model_name, prompt=prompt,
                                     echo=True, logprobs=1, max_tokens=0, **kwargs)


def test_scoring_returns_the_prompt_and_its_logprobs(server, client):
    resp = _score(client, server, PROMPT)
    choice = resp.choices[0]
    ids = server.core.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    # The same numbers as echo with one generated token gives for the prompt.
    one = client.completions.create(model=server.state.model_name, prompt=PROMPT, echo=True,
                                    logprobs=1, max_tokens=1).choices[0].logprobs
    assert one.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert one.tokens[:len(ids)] == lp.tokens


def test_scoring_streamed_gives_the_same(server, client):
    whole = _score(client, server, PROMPT).choices[0]
    chunks = list(_score(client, server, PROMPT, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = [v for c in chunks if c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])


def test_no_token_is_sampled_for_a_scored_prompt(server, client):
    sampled = []

    def wrap(real):
        def execute(output):
            sampled.extend(r.request_id for r in output.requests if r.sample)
            return real(output)
        return execute

    long_prompt = [7 + i for i in range(50)]   # four chunks of 16 tokens
    with patched_execute(server.core, wrap):
        resp = _score(client, server, long_prompt)
    assert len(resp.choices[0].logprobs.token_logprobs) == 50
    assert not any(rid.startswith(resp.id) for rid in sampled)


def test_a_prompt_as_long_as_the_context_can_be_scored(server, client):
    ids = [5 + i % 200 for i in range(MAX_MODEL_LEN)]
    resp = _score(client, server, ids)
    assert len(resp.choices[0].logprobs.tokens) == MAX_MODEL_LEN
    assert resp.usage.prompt_tokens == MAX_MODEL_LEN and resp.usage.completion_tokens == 0


def test_max_tokens_zero_needs_echo(server):
    import openai
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.state.model_name, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "echo" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, max_tokens=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["param"] == "max_tokens"
