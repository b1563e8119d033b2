"""POST /v1/messages through the official ``anthropic`` SDK: plain and
streamed (the event types in order), a tool round trip, stop sequences and
stop reasons, a prefilled assistant turn, Anthropic's error envelope on the
route, and ``x-api-key`` where the server wants a key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import captured_prompts, running_server

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Hello there"}]
# This SDK version takes sampling parameters only as extra body fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir), ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                               timeout=60)


@pytest.fixture(autouse=True)
def ends_idle(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle(timeout=10)


def _model(server) -> str:
    return server.state.model_name


def test_plain_message(server, client):
    msg = client.messages.create(model=_model(server), max_tokens=6, messages=HELLO,
                                 system="Be brief.", extra_body=GREEDY, metadata={"user_id": "u1"})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    [block] = msg.content
    assert block.type == "text" and block.text
    assert msg.usage.output_tokens == 6
    prompt = len(server.core.tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n", add_special_tokens=False))
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    again = client.messages.create(model=_model(server), max_tokens=6, messages=HELLO,
                                   system=[{"type": "text", "text": "Be brief."}],
                                   extra_body=GREEDY)
    assert again.content[0].text == block.text     # greedy: the same reply
    assert again.usage.cache_read_input_tokens > 0   # the prompt's prefix was cached


def test_streamed_events_in_order_and_equal_to_whole(server, client):
    kwargs = dict(model=_model(server), max_tokens=10, messages=HELLO, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert types == ["message_start", "content_block_start",
                     *["content_block_delta"] * len(deltas), "content_block_stop",
                     "message_delta", "message_stop"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.id != whole.id and start.content == []
    assert start.stop_reason is None
    assert all(d.delta.type == "text_delta" and d.index == 0 for d in deltas)
    assert "".join(d.delta.text for d in deltas) == whole.content[0].text
    end = events[-2]
    assert end.delta.stop_reason == "max_tokens" and end.usage.output_tokens == 10
    assert end.usage.input_tokens + end.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with client.messages.stream(**kwargs) as stream:   # the SDK's own accumulation
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"


def test_raw_stream_carries_event_lines_and_a_ping(server):
    body = json.dumps({"model": _model(server), "max_tokens": 2, "messages": HELLO,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{server.base_url}/v1/messages", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        raw = resp.read().decode()
    names = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    datas = [json.loads(line[len("data: "):]) for line in raw.splitlines()
             if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names


def test_tool_round_trip(server, client):
    first = client.messages.create(model=_model(server), max_tokens=100, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("call_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                 for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "Sunny, 24 C"}]},
                   {"type": "text", "text": "And so?"}]}]
    with captured_prompts(server) as prompts:
        second = client.messages.create(model=_model(server), max_tokens=5, messages=history,
                                        tools=[WEATHER], tool_choice={"type": "none"},
                                        extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"]
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert f'"name": "get_weather", "arguments": {json.dumps(use.input)}' in prompts[0]
    assert ("<|im_start|>tool\nSunny, 24 C<|im_end|>\n<|im_start|>user\nAnd so?<|im_end|>"
            in prompts[0])


def test_tool_use_streams_as_input_json_deltas(server, client):
    with client.messages.stream(model=_model(server), max_tokens=100, messages=[
            {"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type in ("content_block_start", "content_block_delta")]
    assert raw[0].content_block.type == "tool_use" and raw[0].content_block.input == {}
    pieces = [e.delta.partial_json for e in raw[1:]]
    assert len(pieces) > 1 and all(e.delta.type == "input_json_delta" for e in raw[1:])
    [use] = final.content
    assert json.loads("".join(pieces)) == use.input and final.stop_reason == "tool_use"


def test_stop_sequences_and_the_stop_reason(server, client):
    free = client.messages.create(model=_model(server), max_tokens=12, messages=HELLO,
                                  extra_body=GREEDY).content[0].text
    stop = free[3:6]
    assert stop and stop not in free[:3]
    msg = client.messages.create(model=_model(server), max_tokens=12, messages=HELLO,
                                 extra_body=GREEDY, stop_sequences=[stop, "\u2603never"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == free[:3]


def test_a_final_assistant_message_is_continued(server, client):
    with captured_prompts(server) as prompts:
        client.messages.create(model=_model(server), max_tokens=2, extra_body=GREEDY, messages=[
            *HELLO, {"role": "assistant", "content": "Well, the"}])
    assert prompts[0].endswith("<|im_start|>assistant\nWell, the")


@pytest.mark.parametrize("body,param_in_message", [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": HELLO, "thinking": {"type": "enabled",
                                                       "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305",
                                                     "name": "web_search"}]}, "tools[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "image"),
    ({"max_tokens": 4, "messages": HELLO, "colour": "blue"}, "colour"),
])
def test_errors_use_anthropics_envelope(server, client, body, param_in_message):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": _model(server), **body},
                    cast_to=anthropic.types.Message)
    err = info.value
    assert err.status_code == 400
    assert err.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": err.body["error"]["message"]}}
    assert param_in_message in err.body["error"]["message"]


def test_unknown_model_and_route_errors_on_this_route(server):
    req = urllib.request.Request(f"{server.base_url}/v1/messages", data=json.dumps(
        {"model": "claude-nothing", "max_tokens": 2, "messages": HELLO}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 404
    assert json.loads(info.value.read())["error"]["type"] == "not_found_error"


def test_x_api_key_is_accepted_where_a_key_is_required(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir, num_kv_blocks=64),
                        ServerConfig(api_key="sekret")) as srv:
        good = anthropic.Anthropic(base_url=srv.base_url, api_key="sekret", max_retries=0)
        msg = good.messages.create(model=srv.state.model_name, max_tokens=2, messages=HELLO)
        assert msg.usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(model=srv.state.model_name, max_tokens=2, messages=HELLO)
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "authentication_error"
        # The header works on the OpenAI routes too; a wrong one does not.
        for key, status in (("sekret", 200), ("wrong", 401)):
            req = urllib.request.Request(f"{srv.base_url}/v1/models", headers={"x-api-key": key})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    assert resp.status == status
            except urllib.error.HTTPError as exc:
                assert exc.code == status
                assert json.loads(exc.read())["error"]["code"] == "invalid_api_key"
        srv.wait_idle()
