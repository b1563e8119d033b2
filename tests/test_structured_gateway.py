"""Structured outputs and tool calling through the official ``openai`` SDK on
the embedded SmolLM2: JSON schemas (streamed and whole), ``parse()`` with a
Pydantic model, vLLM's ``structured_outputs``, ``tool_choice`` required and
named (streamed and whole), and a multi-turn tool loop."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

BOOK = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24},
    "author": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2024}},
        "required": ["name", "born"], "additionalProperties": False},
    "genres": {"type": "array", "items": {"enum": ["novel", "poetry", "science", "history"]},
               "minItems": 1, "maxItems": 3}},
    "required": ["title", "author", "genres"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    # dtype auto: bfloat16 where the CPU computes it natively (faster); these
    # tests check validity, not exact tokens.
    with running_server(make_engine(None, dtype="auto", num_kv_blocks=256),
                        ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def ends_idle(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle(timeout=30)


def _model(server) -> str:
    return server.state.model_name


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("stream,temperature", [(False, 0.0), (True, 1.0)],
                         ids=["greedy-whole", "sampled-streamed"])
def test_json_schema_output_validates(server, client, stream, temperature):
    """(The engine's tests cover greedy and sampled rows in one batch.)"""
    kwargs = dict(model=_model(server), messages=_ask("Tell me about a famous book."),
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "book", "schema": BOOK, "strict": True}},
                  temperature=temperature, seed=5, max_tokens=120)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), BOOK)


def test_text_response_format_is_no_constraint(server, client):
    kwargs = dict(model=_model(server), messages=_ask("Say hello."), temperature=0,
                  max_tokens=12)
    # Compared with a plain request that found the same prompt in the prefix
    # cache, as the text one does: the first one's prefill computed every row
    # (oneDNN's bf16 linear sums a row in an order that depends on how many
    # rows it is given, so a cache hit may tip a near tie).
    client.chat.completions.create(**kwargs)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text = client.chat.completions.create(response_format={"type": "text"},
                                          **kwargs).choices[0].message.content
    assert text == plain and not text.lstrip().startswith("{")


def test_json_object_and_vllm_structured_outputs(server, client):
    model = _model(server)
    obj = client.chat.completions.create(
        model=model, messages=_ask("Give me a JSON object about cats."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=30)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    choice = client.chat.completions.create(
        model=model, messages=_ask("Is water wet?"), temperature=0, max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(
        model=model, prompt="The date today is", temperature=0, max_tokens=12,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert __import__("re").fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", regex.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    loose = client.chat.completions.create(
        model=model, messages=_ask("Are you ok?"), temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"json": json.dumps(schema)}})
    jsonschema.validate(json.loads(loose.choices[0].message.content), schema)


class Author(BaseModel):
    name: str = Field(max_length=30)
    born: int = Field(ge=1000, le=2024)


class Book(BaseModel):
    title: str = Field(max_length=24)
    author: Author
    kind: Literal["novel", "poetry", "essay"]


def test_sdk_parse_returns_a_pydantic_object(server, client):
    parse = (client.beta.chat.completions.parse if hasattr(client, "beta")
             and hasattr(client.beta, "chat") else client.chat.completions.parse)
    resp = parse(model=_model(server), messages=_ask("Describe a classic novel."),
                 response_format=Book, temperature=0, max_tokens=120)
    book = resp.choices[0].message.parsed
    assert isinstance(book, Book) and isinstance(book.author, Author)
    assert book.kind in ("novel", "poetry", "essay")


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """Assemble streamed tool-call deltas the way the SDK's users do."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_required_and_named_tool_choice_yield_valid_calls(server, client, stream, tool_choice):
    choice = "required" if tool_choice == "required" else \
        {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=_model(server), messages=_ask("Hello! How are you today?"),
                  tools=TOOLS, tool_choice=choice, temperature=0.7, seed=2, max_tokens=80)
    allowed = {"get_weather", "get_time"} if tool_choice == "required" else {"get_time"}
    if stream:
        calls, finish = _streamed_calls(list(client.chat.completions.create(stream=True,
                                                                             **kwargs)))
        assert finish == "tool_calls"
        assert calls and all(c["id"].startswith("call_") and c["name"] in allowed
                             for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    else:
        choice0 = client.chat.completions.create(**kwargs).choices[0]
        assert choice0.finish_reason == "tool_calls"
        _check_calls(choice0.message.tool_calls, allowed)


def test_tool_loop_with_the_sdk(server, client):
    """Call, tool result, answer: the assistant's tool_calls and the tool
    message reach the prompt, and the conversation carries on."""
    model = _model(server)
    messages = _ask("What is the weather in Paris?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=80)
    message = first.choices[0].message
    _check_calls(message.tool_calls, {"get_weather", "get_time"})
    call = message.tool_calls[0]
    messages += [message, {"role": "tool", "tool_call_id": call.id,
                           "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    # The tool call and its result are in the prompt, not dropped.
    prompt = _post(server, "/tokenize", {
        "model": model, "messages": [m if isinstance(m, dict) else m.model_dump(
            exclude_none=True) for m in messages], "tools": TOOLS})
    text = _post(server, "/detokenize", {"model": model, "tokens": prompt["tokens"]})["prompt"]
    assert call.function.name in text and '"sky": "sunny"' in text
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=40)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_invalid_schema_is_a_400_naming_response_format(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=_model(server), messages=_ask("hi"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"type": "strnig"}}}}})
    assert info.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(server), messages=_ask("hi"), max_tokens=4,
                                       response_format={"type": "bogus"})
    assert info.value.param == "response_format"


# ------------------------------------- a constraint is never broken silently

MID_OUTPUT_FAILURE = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "a": {"type": "string", "pattern": "^x{1000000}$"}},
    "required": ["n", "a"], "additionalProperties": False}


def _raw(server, body: dict, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    req = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_fails_mid_output_is_a_grammar_error(server, stream):
    """Before: 200, finish_reason "stop" and the text '{"n": 1,'."""
    status, body = _raw(server, {
        "model": _model(server), "messages": _ask("Write a record."), "temperature": 0,
        "max_tokens": 40, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": MID_OUTPUT_FAILURE}}})
    if not stream:
        assert status == 500, body
        error = json.loads(body)["error"]
    else:
        assert status == 200
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]
        assert not any(c.get("choices") and c["choices"][0].get("finish_reason") == "stop"
                       for c in events)
        error = events[-1]["error"]
        assert body.decode().rstrip().endswith("data: [DONE]")
    assert error["type"] == "grammar_error" and "response_format" in error["message"]


def test_a_constraint_that_cannot_start_is_a_400(server):
    status, body = _raw(server, {
        "model": _model(server), "prompt": "x", "max_tokens": 4,
        "structured_outputs": {"regex": "a{1000000}"}}, "/v1/completions")
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "structured_outputs", body
    assert error["code"] == "grammar_error" and "limits" in error["message"]
