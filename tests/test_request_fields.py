"""No request field is silently ignored: every field Baton does not honour is
a 400 naming it; metadata fields are accepted; chat-template fields
(chat_template_kwargs, continue_final_message, add_generation_prompt,
documents) change the prompt; GET /v1/models/{id}."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from tests.server_helpers import running_server

# A template that reads enable_thinking and documents, as Qwen3's and RAG
# templates do (ChatML otherwise).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if documents %}<|im_start|>system\n{% for d in documents %}[{{ d.title }}] "
    "{{ d.text }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    core = create_engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=128, seed=1, chat_template=TEMPLATE))
    with running_server(core, ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _prompt(server, **fields) -> str:
    status, body = _post(server, "/tokenize", {"messages": MESSAGES, **fields})
    assert status == 200, body
    return _post(server, "/detokenize", {"tokens": body["tokens"]})[1]["prompt"]


CHAT_REFUSED = [
    ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
    ("modalities", ["text", "audio"], "modalities"),
    ("prediction", {"type": "content", "content": "Hi"}, "prediction"),
    ("web_search_options", {}, "web_search_options"),
    ("functions", [{"name": "f", "parameters": {}}], "functions"),
    ("function_call", "auto", "function_call"),
    ("service_tier", "flex", "service_tier"),
    ("reasoning_effort", "low", "reasoning_effort"),
    ("verbosity", "low", "verbosity"),
    ("chat_template_kwargs", {"no_such_variable": 1}, "chat_template_kwargs"),
    ("chat_template_kwargs", {"messages": []}, "chat_template_kwargs"),
    ("chat_template", "{{ messages }}", "chat_template"),
    ("response_format", {"type": "bogus"}, "response_format"),
    ("response_format", {"type": "structural_tag", "format": {}}, "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format"),
    ("structured_outputs", {"structural_tag": "{}"}, "structured_outputs"),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ("tools", [{"type": "custom", "custom": {"name": "x"}}], "tools"),
    ("tool_choice", {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice"),
    ("tool_choice", "required", "tool_choice"),
    ("guided_json", {"type": "object"}, "guided_json"),
    ("guided_choice", ["a", "b"], "guided_choice"),
    ("use_beam_search", True, "use_beam_search"),
    ("length_penalty", 0.5, "length_penalty"),
    ("include_stop_str_in_output", True, "include_stop_str_in_output"),
    ("spaces_between_special_tokens", False, "spaces_between_special_tokens"),
    ("allowed_token_ids", [1, 2], "allowed_token_ids"),
    ("bad_words", ["x"], "bad_words"),
    ("prompt_logprobs", 1, "prompt_logprobs"),
    ("include_reasoning", False, "include_reasoning"),
    ("echo", True, "echo"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("truncate_prompt_tokens", 0, "truncate_prompt_tokens"),
    ("continue_final_message", True, "continue_final_message"),
    ("ignore_eos", True, "ignore_eos"),   # with the constraint below
    ("cache_salt", "abc", "cache_salt"),
    ("logits_processors", ["x"], "logits_processors"),
    ("no_such_field", 1, "no_such_field"),
]


@pytest.mark.parametrize("field,value,param", CHAT_REFUSED,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(CHAT_REFUSED)])
def test_chat_field_is_honoured_or_refused_by_name(server, field, value, param):
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    if field == "ignore_eos":
        body["response_format"] = {"type": "json_object"}
    status, reply = _post(server, "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param, reply
    assert param.split(".")[0] in reply["error"]["message"] or field in reply["error"]["message"]


@pytest.mark.parametrize("field,value,param", [
    ("suffix", "tail", "suffix"), ("best_of", 3, "best_of"),
    ("no_such_field", True, "no_such_field"), ("guided_regex", "a+", "guided_regex"),
    ("structured_outputs", {"json": "{not json"}, "structured_outputs"),
])
def test_completion_field_is_honoured_or_refused_by_name(server, field, value, param):
    status, reply = _post(server, "/v1/completions",
                          {"prompt": "Hello", "max_tokens": 2, field: value})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_nested_unknown_fields_are_named(server):
    status, reply = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "colour": "blue"}], "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "messages[0].colour"
    status, reply = _post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                   "extra": 1}}})
    assert status == 400 and reply["error"]["param"] == "response_format.json_schema.extra"


def test_metadata_fields_are_accepted(server, client):
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=MESSAGES, max_tokens=2, user="u-1",
        metadata={"team": "a"}, store=False, service_tier="auto", modalities=["text"],
        parallel_tool_calls=True, extra_body={"safety_identifier": "s", "priority": 0,
                                              "prompt_cache_key": "k", "request_id": "mine-1"})
    assert resp.id == "chatcmpl-mine-1"
    assert resp.usage.completion_tokens == 2


def test_template_fields_change_the_prompt(server):
    plain = _prompt(server)
    assert plain.endswith("<|im_start|>assistant\n")
    assert _prompt(server, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<think>\n\n</think>\n\n")
    assert not _prompt(server, add_generation_prompt=False).endswith("assistant\n")
    docs = _prompt(server, documents=[{"title": "T1", "text": "Some fact."}])
    assert "[T1] Some fact." in docs
    prefill = _post(server, "/tokenize", {"messages": MESSAGES + [
        {"role": "assistant", "content": "Bonjour, le"}], "add_generation_prompt": False,
        "continue_final_message": True})[1]
    text = _post(server, "/detokenize", {"tokens": prefill["tokens"]})[1]["prompt"]
    assert text.endswith("<|im_start|>assistant\nBonjour, le")


def test_a_thinking_switch_the_template_cannot_honour(tiny_llama_dir):
    # The fixture's plain ChatML template reads no enable_thinking and never
    # thinks: "off" changes nothing and is accepted; "on" is a 400.
    with running_server(create_engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                                 num_kv_blocks=64)), ServerConfig()) as srv:
        plain = _prompt(srv)
        for switch in ({"enable_thinking": False}, {"thinking": False}):
            assert _prompt(srv, chat_template_kwargs=switch) == plain
            status, _ = _post(srv, "/v1/chat/completions", {
                "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": switch})
            assert status == 200
        for bad in ({"enable_thinking": True}, {"enable_thinking": "no"}, {"other": False}):
            status, reply = _post(srv, "/v1/chat/completions", {
                "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": bad})
            assert status == 400 and reply["error"]["param"] == "chat_template_kwargs"
            assert next(iter(bad)) in reply["error"]["message"]
        srv.wait_idle()


def test_a_template_that_always_thinks_cannot_switch_it_off():
    from backends.errors import InvalidRequestError
    from service.openai_requests import _template_keywords
    from service.protocol import ChatCompletionRequest, ChatMessage
    always = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n"

    def request(**kwargs):
        return ChatCompletionRequest(messages=[ChatMessage("user", "hi")],
                                     chat_template_kwargs=kwargs)
    assert _template_keywords(request(enable_thinking=True), always) == {}
    with pytest.raises(InvalidRequestError, match="enable_thinking"):
        _template_keywords(request(enable_thinking=False), always)


def test_truncate_prompt_tokens_keeps_the_end(server, client):
    resp = client.completions.create(model=server.state.model_name, prompt="Hello, world! " * 5,
                                     max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert resp.usage.prompt_tokens == 3


def test_model_retrieve(server, client):
    card = client.models.retrieve(server.state.model_name)
    assert card.id == server.state.model_name and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
