"""Tool calling in each output format: the parser (streamed in any split,
and whole), the templates' view of tools and history, and grammar-enforced
calls from random-weight Qwen2 (Hermes template) and Llama (Llama 3 JSON
template) models served with --chat-template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from backends.errors import InvalidRequestError
from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from service.protocol import NamedFunction, NamedToolChoice
from service.tool_calls import (GENERIC, HERMES, LLAMA3_JSON, ToolCallParser, ToolPlan,
                                detect_format, plan_tools)
from tests.server_helpers import running_server

# Templates written for these tests in the shape of Qwen2.5's (Hermes
# <tool_call> blocks) and Llama 3.1's (ipython, JSON with "parameters").
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

Today Date: {{ strftime_now("%d %b %Y") }}
{%- if tools %}
Environment: ipython
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {
        "word": {"enum": ["cat", "dog", "fox"]}, "lang": {"enum": ["en", "fr"]}},
        "required": ["word", "lang"], "additionalProperties": False}}}
COUNT = {"type": "function", "function": {
    "name": "count", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}
PARAMS = {"lookup": LOOKUP["function"]["parameters"], "count": COUNT["function"]["parameters"]}


def _plan(fmt: str, choice: str = "auto") -> ToolPlan:
    return ToolPlan(fmt, {"lookup": LOOKUP["function"], "count": COUNT["function"]}, choice)


def _run(parser: ToolCallParser, text: str, step: int):
    content, calls = "", []
    for i in range(0, len(text), step):
        delta = parser.feed(text[i:i + step])
        content += delta.content
        calls += delta.calls
    delta = parser.finish()
    return content + delta.content, calls + delta.calls


HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"word": "fox", '
                '"lang": "fr"}}\n</tool_call>\n<tool_call>\n{"name": "count", "arguments": '
                '{"n": 3}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_parser_in_any_split(step):
    content, calls = _run(ToolCallParser(_plan(HERMES)), HERMES_REPLY, step)
    assert content == "Let me check.\n"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "lookup", {"word": "fox", "lang": "fr"}), (1, "count", {"n": 3})]
    assert len({c.id for c in calls}) == 2


def test_hermes_parser_keeps_text_that_is_not_a_call():
    text = "Use <tool_call> tags like <tool_call>not json</tool_call> here."
    content, calls = _run(ToolCallParser(_plan(HERMES)), text, 4)
    assert calls == [] and content == text
    # A call cut short by max_tokens stays text too.
    content, calls = _run(ToolCallParser(_plan(HERMES)), '<tool_call>\n{"name": "loo', 5)
    assert calls == [] and content == '<tool_call>\n{"name": "loo'


@pytest.mark.parametrize("step", [2, 1000])
def test_llama3_json_parser(step):
    text = ('{"name": "lookup", "parameters": {"word": "cat", "lang": "en"}}; '
            '{"name": "count", "parameters": {"n": 0}}')
    content, calls = _run(ToolCallParser(_plan(LLAMA3_JSON)), text, step)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("lookup", {"word": "cat", "lang": "en"}), ("count", {"n": 0})]
    content, calls = _run(ToolCallParser(_plan(LLAMA3_JSON)), "Plain answer {x}", step)
    assert content == "Plain answer {x}" and calls == []


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_generic_parser_streams_the_response_string(step):
    parser = ToolCallParser(_plan(GENERIC))
    text = '{"response": "Caf\\u00e9 \\"ol\\u00e9\\" \\ud83d\\ude00 done"}'
    pieces = [parser.feed(text[i:i + step]).content for i in range(0, len(text), step)]
    pieces.append(parser.finish().content)
    assert "".join(pieces) == 'Café "olé" 😀 done'
    if step == 1:
        assert sum(1 for p in pieces if p) > 5   # it streamed, not one lump at the end
    content, calls = _run(ToolCallParser(_plan(GENERIC)),
                          '{"tool_calls": [{"name": "count", "arguments": {"n": 4}}]}', step)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("count", '{"n": 4}')]


def test_format_detection_and_plan_validation(tiny_llama_dir):
    assert detect_format(HERMES_TEMPLATE) == HERMES
    assert detect_format(LLAMA3_TEMPLATE) == LLAMA3_JSON
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == GENERIC
    from service.protocol import Tool, FunctionDefinition
    tools = [Tool("function", FunctionDefinition("lookup", parameters=PARAMS["lookup"]))]
    assert plan_tools(tools, "none", None, HERMES, None) is None
    named = NamedToolChoice(function=NamedFunction("nope"))
    with pytest.raises(InvalidRequestError) as info:
        plan_tools(tools, named, None, HERMES, None)
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as info:
        plan_tools(None, "required", None, HERMES, None)
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as info:
        plan_tools([Tool("custom", custom={"name": "x"})], "auto", None, HERMES, None)
    assert info.value.param == "tools"


@pytest.fixture(scope="module", params=[("qwen2", HERMES_TEMPLATE), ("llama", LLAMA3_TEMPLATE)],
                ids=["qwen2-hermes", "llama-llama3_json"])
def tool_server(request):
    arch, template = request.param
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    core = create_engine(EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=256,
                                    seed=1, chat_template=template))
    with running_server(core, ServerConfig()) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_random_model_makes_valid_calls_in_its_template_format(tool_server, stream):
    """A random-weight model cannot write a call by chance: the grammar
    makes every required / named reply a valid call in the template's format."""
    client = OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0,
                    timeout=60)
    model = tool_server.state.model_name
    for seed, choice in enumerate(["required", {"type": "function",
                                                "function": {"name": "count"}}]):
        kwargs = dict(model=model, messages=[{"role": "user", "content": "Hello, world!"}],
                      tools=[LOOKUP, COUNT], tool_choice=choice, parallel_tool_calls=False,
                      temperature=1.0, seed=seed, max_tokens=64)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            finish = chunks[-1].choices[0].finish_reason
            calls = [(d.function.name, d.function.arguments) for d in deltas]
        else:
            choice0 = client.chat.completions.create(**kwargs).choices[0]
            finish = choice0.finish_reason
            calls = [(c.function.name, c.function.arguments) for c in choice0.message.tool_calls]
        assert finish == "tool_calls"
        assert len(calls) == 1
        name, arguments = calls[0]
        assert name in (("lookup", "count") if choice == "required" else ("count",))
        jsonschema.validate(json.loads(arguments), PARAMS[name])
    tool_server.wait_idle()


def test_history_reaches_the_template(tool_server):
    """tools, the assistant's tool_calls and the tool result are rendered by
    the model's template, in its own format."""
    import urllib.request
    body = {"messages": [
        {"role": "user", "content": "Count the foxes."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "count", "arguments": "{\"n\": 7}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "seven foxes"}],
        "tools": [COUNT]}

    def post(path, payload):
        req = urllib.request.Request(f"{tool_server.base_url}{path}",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    ids = post("/tokenize", body)["tokens"]
    text = post("/detokenize", {"tokens": ids})["prompt"]
    assert '"name": "count"' in text and "seven foxes" in text
    if "<tool_call>" in text:      # the Hermes template
        assert '<tool_call>\n{"name": "count", "arguments": {"n": 7}}\n</tool_call>' in text
    else:                          # the Llama 3 template, with strftime_now
        assert '{"name": "count", "parameters": {"n": 7}}' in text
        assert "Environment: ipython" in text and "Today Date: " in text
