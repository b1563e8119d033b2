"""POST /v1/responses through the official ``openai`` SDK: plain and
streamed (the typed events in order, numbered), a function-call round trip,
``previous_response_id`` against the store (and 404 for a missing one),
``text.format``, GET / DELETE of stored responses, and fields refused by
name. The chat path underneath is the one the chat tests check."""

from __future__ import annotations

import json
import urllib.error
from typing import Literal
import urllib.request

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from tests.engine_helpers import make_engine
from tests.server_helpers import captured_prompts, running_server
from tests.test_tool_calls import HERMES_TEMPLATE, SCRIPTED, _scripted

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir), ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def ends_idle(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        srv.wait_idle(timeout=10)
        srv.call(srv.state.responses.check_integrity)


def _model(server) -> str:
    return server.state.model_name


def _collapse(types: list[str]) -> list[str]:
    """Event types with runs of deltas folded into one."""
    out: list[str] = []
    for t in types:
        if not (out and t == out[-1] and t.endswith(".delta")):
            out.append(t)
    return out


# -------------------------------------------------------------------- plain

def test_plain_response(server, client):
    resp = client.responses.create(model=_model(server), input="Hello there",
                                   instructions="Be brief.", max_output_tokens=6,
                                   temperature=0, metadata={"team": "a"})
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert resp.output_text == item.content[0].text and resp.output_text
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.instructions == "Be brief." and resp.metadata == {"team": "a"}
    assert resp.temperature == 0 and resp.max_output_tokens == 6 and resp.store is True
    # The same request again: its prompt comes from the prefix cache.
    again = client.responses.create(model=_model(server), input="Hello there",
                                    instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    assert again.output_text == resp.output_text
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_instructions_and_input_items_reach_the_template(server, client):
    with captured_prompts(server) as prompts:
        client.responses.create(model=_model(server), instructions="You are terse.",
                                max_output_tokens=1, input=[
                                    {"role": "developer", "content": "Answer in French."},
                                    {"role": "user", "content": [
                                        {"type": "input_text", "text": "Hi "},
                                        {"type": "input_text", "text": "there"}]}])
    assert prompts == ["<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>system\n"
                       "Answer in French.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                       "<|im_start|>assistant\n"]


# ---------------------------------------------------------------- streaming

def test_streamed_events_in_order_and_equal_to_whole(server, client):
    kwargs = dict(model=_model(server), input="Tell me a story", max_output_tokens=12,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert _collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.output[0].id == item_id
    assert final.usage.output_tokens == 12 and final.status == "incomplete"


def test_streamed_response_is_stored(server, client):
    events = list(client.responses.create(model=_model(server), input="Hi", stream=True,
                                          max_output_tokens=3))
    final = events[-1].response
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == final.status


# ------------------------------------------------------ function call round trip

def test_function_call_round_trip(server, client):
    first = client.responses.create(model=_model(server), input="Weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=100, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather"
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(
        exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                             "output": "Sunny, 24 C"}]
    with captured_prompts(server) as prompts:
        second = client.responses.create(model=_model(server), input=history,
                                         tools=[WEATHER], tool_choice="none",
                                         max_output_tokens=5, temperature=0)
    assert second.output[0].type == "message"
    # The call and its result reached the model, as the chat path renders them.
    assert f'"name": "get_weather", "arguments": {json.dumps(args)}' in prompts[0]
    assert "<|im_start|>tool\nSunny, 24 C<|im_end|>" in prompts[0]


def test_function_call_streams_its_arguments(server, client):
    events = list(client.responses.create(
        model=_model(server), input="Weather in Oslo?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
        temperature=0, stream=True))
    types = _collapse([e.type for e in events])
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2], next(e for e in events if e.type == "response.output_item.done")
    assert added.item.type == "function_call" and added.item.arguments == ""
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == done.item.arguments == events[-1].response.output[0].arguments
    assert done.item.call_id == added.item.call_id and done.item.name == "get_weather"


# ---------------------------------------------------- previous_response_id, store

def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model=_model(server), input="My name is Ada.",
                                    max_output_tokens=4, temperature=0)
    with captured_prompts(server) as prompts:
        second = client.responses.create(model=_model(server), input="What is my name?",
                                         previous_response_id=first.id, max_output_tokens=4,
                                         temperature=0, instructions="Be kind.")
    assert second.previous_response_id == first.id
    assert prompts[0] == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nMy name is Ada.<|im_end|>\n"
        f"<|im_start|>assistant\n{first.output_text}<|im_end|>\n"
        "<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n")
    # A chain of three: the first turn's instructions are not carried over.
    with captured_prompts(server) as prompts:
        client.responses.create(model=_model(server), input="Bye",
                                previous_response_id=second.id, max_output_tokens=1)
    assert "Be kind." not in prompts[0] and "My name is Ada." in prompts[0]
    assert second.output_text in prompts[0]


def test_a_missing_previous_response_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=_model(server), input="Hi",
                                previous_response_id="resp_does_not_exist")
    body = info.value.body
    assert body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found"
    assert body["type"] == "invalid_request_error" and "resp_does_not_exist" in body["message"]


def test_get_and_delete_a_stored_response(server, client):
    resp = client.responses.create(model=_model(server), input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    deleted = client.responses.delete(resp.id)   # the SDK returns None for 200
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=_model(server), input="Hi", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_query_parameters_on_a_stored_response_are_refused(server, client):
    resp = client.responses.create(model=_model(server), input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve(resp.id, extra_query={"stream": "true"})
    assert info.value.body["param"] == "stream"


def test_delete_answers_with_the_deleted_object(server, client):
    resp = client.responses.create(model=_model(server), input="Hi", max_output_tokens=1)
    req = urllib.request.Request(f"{server.base_url}/v1/responses/{resp.id}", method="DELETE")
    with urllib.request.urlopen(req, timeout=30) as answer:
        assert json.loads(answer.read()) == {"id": resp.id, "deleted": True,
                                             "object": "response"}


# ---------------------------------------------------------------- text.format

class Colour(BaseModel):
    colour: Literal["red", "green"]


def test_text_format_json_schema(server, client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"], "additionalProperties": False}
    resp = client.responses.create(model=_model(server), input="Pick a colour",
                                   max_output_tokens=30, text={"format": {
                                       "type": "json_schema", "name": "pick",
                                       "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    parsed = client.responses.parse(model=_model(server), input="Pick a colour",
                                    max_output_tokens=30, text_format=Colour)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Colour)
    obj = client.responses.create(model=_model(server), input="JSON please",
                                  max_output_tokens=20, text={"format": {"type": "json_object"}})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


# ------------------------------------------------------------------- refusals

@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": "hello " * 600}, "input"),      # context_length_exceeded, named ours
    ({"no_such_field": 1}, "no_such_field"),
])
def test_fields_it_cannot_honour_are_refused_by_name(server, extra, param):
    body = {"model": _model(server), "input": "Hi", "max_output_tokens": 2, **extra}
    req = urllib.request.Request(f"{server.base_url}/v1/responses",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_logprobs_are_included_when_asked(server, client):
    resp = client.responses.create(model=_model(server), input="Hi", max_output_tokens=3,
                                   include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    joined = "".join(lp.token for lp in logprobs)
    for special in server.core.tokenizer.special_tokens:   # left out of the text
        joined = joined.replace(special, "")
    assert joined == resp.output_text


# ------------------------------------------ text and calls in a native format

@pytest.fixture(scope="module")
def hermes_server(tiny_qwen2_dir):
    core = create_engine(EngineArgs(model=str(tiny_qwen2_dir), dtype="float32",
                                    num_kv_blocks=256, seed=1, chat_template=HERMES_TEMPLATE))
    with running_server(core, ServerConfig()) as srv:
        yield srv


COUNT = {"type": "function", "name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}


@pytest.mark.parametrize("stream", [False, True])
def test_text_then_two_calls_become_three_output_items(hermes_server, stream):
    client = OpenAI(base_url=f"{hermes_server.base_url}/v1", api_key="x", max_retries=0)
    text, calls = SCRIPTED["hermes"]
    with _scripted(hermes_server.core, text + calls):
        kwargs = dict(model=hermes_server.state.model_name, input="Count", tools=[COUNT],
                      max_output_tokens=120)
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            call_events = ["response.output_item.added",
                           "response.function_call_arguments.delta",
                           "response.function_call_arguments.done",
                           "response.output_item.done"]
            assert _collapse([e.type for e in events]) == [
                "response.created", "response.in_progress", *TEXT_EVENTS, *call_events,
                *call_events, "response.completed"]
            assert [e.output_index for e in events if e.type == "response.output_item.added"
                    ] == [0, 1, 2]
            resp = events[-1].response
        else:
            resp = client.responses.create(**kwargs)
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    assert resp.output[0].content[0].text == text
    assert [json.loads(o.arguments) for o in resp.output[1:]] == [{"n": 3}, {"n": 12}]
    assert resp.output[1].call_id != resp.output[2].call_id
    hermes_server.wait_idle()
