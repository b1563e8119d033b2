"""Schemas with keywords the grammar engine does not implement (Pydantic's
``set[str]`` writes ``uniqueItems``, its ``Path`` writes ``format: path``):
accepted and left unenforced where OpenAI is lenient (non-strict tools,
non-strict response_format), refused by name where the client asked for
strict (docs/serving.md, "Lenient schemas")."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server
from tests.test_tool_calls import HERMES_TEMPLATE

# What Pydantic writes for {"tags": set[str], "where": Path}.
TAGGED = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "uniqueItems": True,
             "maxItems": 2},
    "where": {"type": "string", "format": "path", "maxLength": 6}},
    "required": ["tags", "where"], "additionalProperties": False}
# The same with the unenforceable keywords taken out: what the output must satisfy.
ENFORCED = json.loads(json.dumps(TAGGED).replace(', "uniqueItems": true', "")
                      .replace('"format": "path", ', ""))
MESSAGES = [{"role": "user", "content": "Tag the file."}]


def _tool(strict: bool | None = None) -> dict:
    function = {"name": "tag_file", "parameters": TAGGED}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


@pytest.fixture(scope="module", params=["generic", "hermes"])
def server(request, tiny_llama_dir, tiny_qwen2_dir):
    if request.param == "generic":
        core = make_engine(tiny_llama_dir)   # ChatML without tools: the generic format
    else:
        core = create_engine(EngineArgs(model=str(tiny_qwen2_dir), dtype="float32",
                                        num_kv_blocks=256, seed=1,
                                        chat_template=HERMES_TEMPLATE))
    with running_server(core, ServerConfig()) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    server.wait_idle()


def test_non_strict_tool_keywords_are_left_unenforced(server, client):
    assert ENFORCED != TAGGED and "uniqueItems" not in json.dumps(ENFORCED)
    for strict, choice in ((None, "auto"), (False, "required"), (None, "required")):
        resp = client.chat.completions.create(
            model=server.state.model_name, messages=MESSAGES, tools=[_tool(strict)],
            tool_choice=choice, parallel_tool_calls=False, max_tokens=110, temperature=1.0,
            seed=3)
        if choice == "required":
            assert resp.choices[0].finish_reason == "tool_calls"
            calls = resp.choices[0].message.tool_calls
            jsonschema.validate(json.loads(calls[0].function.arguments), ENFORCED)


def test_a_strict_tool_is_enforced_exactly_or_refused_by_keyword(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, messages=MESSAGES,
                                       tools=[_tool(strict=True)], max_tokens=4)
    assert info.value.body["param"] == "tools"
    assert "uniqueItems" in info.value.body["message"] and "strict" in info.value.body["message"]


def test_non_strict_response_format_is_lenient_strict_is_exact(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": TAGGED}}
    resp = client.chat.completions.create(model=server.state.model_name, messages=MESSAGES,
                                          response_format=fmt, max_tokens=80, seed=1)
    if resp.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(resp.choices[0].message.content), ENFORCED)
    strict = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": TAGGED,
                                                     "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, messages=MESSAGES,
                                       response_format=strict, max_tokens=4)
    assert info.value.body["param"] == "response_format"
    assert "uniqueItems" in info.value.body["message"]
    # vLLM's structured_outputs asks for that constraint itself: exact, as before.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.state.model_name, messages=MESSAGES,
                                       max_tokens=4, extra_body={
                                           "structured_outputs": {"json": TAGGED}})
    assert info.value.body["param"] == "structured_outputs"


def test_an_unknown_format_alone_is_relaxed_too(server, client):
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": "path",
                                                     "maxLength": 10}},
              "required": ["p"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=MESSAGES, max_tokens=120, seed=2,
        tools=[{"type": "function", "function": {"name": "open_file", "parameters": schema}}],
        tool_choice="required", parallel_tool_calls=False)
    call = resp.choices[0].message.tool_calls[0]
    assert isinstance(json.loads(call.function.arguments)["p"], str)
