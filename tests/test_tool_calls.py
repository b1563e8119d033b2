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
from service.tool_call_parser import CallDelta, ToolCallParser, merge_calls
from service.tool_calls import GENERIC, HERMES, LLAMA3_JSON, ToolPlan, detect_format, plan_tools
from tests.server_helpers import patched_execute, running_server

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


def _pieces(parser: ToolCallParser, text: str, step: int) -> tuple[str, list[CallDelta]]:
    """Content and call deltas as a stream of ``step``-character pieces gives them."""
    content, deltas = "", []
    for i in range(0, len(text), step):
        delta = parser.feed(text[i:i + step])
        content += delta.content
        deltas += delta.calls
    delta = parser.finish()
    return content + delta.content, deltas + delta.calls


def _run(parser: ToolCallParser, text: str, step: int):
    content, deltas = _pieces(parser, text, step)
    return content, merge_calls(deltas)


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


STREAMED_REPLIES = {
    HERMES: ("Let me check.\n", HERMES_REPLY),
    LLAMA3_JSON: ("", '<|python_tag|>{"name": "lookup", "parameters": {"word": "fox", '
                      '"lang": "fr"}}; {"name": "count", "parameters": {"n": 3}}'),
    GENERIC: ("", '{"tool_calls": [{"name": "lookup", "arguments": {"word": "fox", '
                  '"lang": "fr"}}, {"name": "count", "arguments": {"n": 3}}]}'),
}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, GENERIC])
def test_calls_stream_as_openai_streams_them(fmt):
    """Fed a character at a time: a call opens with its id and name and
    empty arguments, then its arguments arrive in pieces; no character of a
    call is ever content; the pieces add up to the whole-reply answer."""
    content_text, reply = STREAMED_REPLIES[fmt]
    content, deltas = _pieces(ToolCallParser(_plan(fmt)), reply, 1)
    assert content == content_text
    for index, name, arguments in [(0, "lookup", {"word": "fox", "lang": "fr"}),
                                   (1, "count", {"n": 3})]:
        mine = [d for d in deltas if d.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id.startswith("call_") and first.name == name and first.arguments == ""
        assert all(d.id is None and d.name is None and d.arguments for d in rest)
        assert len(rest) > 3
        assert json.loads("".join(d.arguments for d in rest)) == arguments
    # Calls come out in order: the second opens after the first's last piece.
    indices = [d.index for d in deltas]
    assert indices == sorted(indices)
    whole = _run(ToolCallParser(_plan(fmt)), reply, len(reply))
    assert whole[0] == content_text
    assert [(c.index, c.name, c.arguments) for c in whole[1]] == \
        [(c.index, c.name, c.arguments) for c in merge_calls(deltas)]


def test_content_before_a_call_is_held_only_while_it_may_be_one():
    parser = ToolCallParser(_plan(HERMES))
    assert parser.feed("Sure <tool").content == "Sure "
    assert parser.feed("box>").content == "<toolbox>"
    assert parser.feed(" <tool_call>\n{").content == " "
    delta = parser.feed('"name": "count", "arguments": {"n": 1')
    assert delta.content == "" and [(d.name, d.arguments) for d in delta.calls] == [
        ("count", ""), (None, '{"n": 1')]


def test_a_call_cut_short_keeps_what_was_written():
    """max_tokens inside the arguments: the call stands with its partial
    arguments (finish_reason length tells the client), as OpenAI returns it."""
    text = '<tool_call>\n{"name": "lookup", "arguments": {"word": "fo'
    content, calls = _run(ToolCallParser(_plan(HERMES)), text, 3)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("lookup", '{"word": "fo')]


@pytest.mark.parametrize("step", [1, 1000])
def test_arguments_written_as_a_string_or_left_out(step):
    text = ('<tool_call>\n{"name": "count", "arguments": "{\\"n\\": 3}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup"}\n</tool_call>')
    content, calls = _run(ToolCallParser(_plan(HERMES)), text, step)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("count", '{"n": 3}'), ("lookup", "{}")]


@pytest.mark.parametrize("text", ['{"answer": 42}', '{"name": "unknown", "parameters": {}}',
                                  '{"name": 7}', '{"name": "count", "parameters": {"n": 1}} ok',
                                  '{"name": "count", "parameters": {"n": 1}}; {"name": "co'])
def test_llama3_json_that_is_no_call_is_content(text):
    content, calls = _run(ToolCallParser(_plan(LLAMA3_JSON)), text, 2)
    if text.endswith(" ok"):   # a call, then text: the text after it is content
        assert [c.name for c in calls] == ["count"] and content == "ok"
    elif text.endswith('"co'):   # a call, then one cut short before its name
        assert [c.name for c in calls] == ["count"] and content == '{"name": "co'
    else:
        assert calls == [] and content == text


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


def test_parallel_tool_calls_decides_how_many_calls_the_grammar_allows():
    """false (or a named function) allows one call; the native formats allow
    several unless told false; the generic one only when told true."""
    from service.protocol import FunctionDefinition, Tool
    tools = [Tool("function", FunctionDefinition(n, parameters=PARAMS[n])) for n in PARAMS]

    def several(fmt, parallel, choice="required") -> bool:
        spec = plan_tools(tools, choice, parallel, fmt, None).constraint()
        if fmt == GENERIC:
            return "maxItems" not in json.loads(spec.source)["properties"]["tool_calls"]
        return "call)*" in spec.source
    assert [several(HERMES, p) for p in (None, True, False)] == [True, True, False]
    assert [several(LLAMA3_JSON, p) for p in (None, True, False)] == [True, True, False]
    assert [several(GENERIC, p) for p in (None, True, False)] == [False, True, False]
    named = NamedToolChoice(function=NamedFunction("count"))
    assert not several(HERMES, True, named) and not several(GENERIC, True, named)


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
            first, pieces = deltas[0], deltas[1:]
            assert first.id.startswith("call_") and first.type == "function"
            assert first.function.arguments == ""
            assert len(pieces) > 1 and all(d.index == 0 and d.id is None for d in pieces)
            calls = [(first.function.name, "".join(d.function.arguments for d in pieces))]
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


def _scripted(core, reply: str):
    """Make every sampled token the next token of ``reply`` (then end of
    sequence), whatever the model computes: a model that calls tools."""
    script = core.tokenizer.encode(reply, add_special_tokens=False) + [min(core.eos_token_ids)]
    made: dict[str, int] = {}

    def wrap(real):
        def execute(output):
            result = real(output)
            for i, rid in enumerate(result.request_ids):
                n = made.get(rid, 0)
                result.token_ids[i] = script[min(n, len(script) - 1)]
                made[rid] = n + 1
            return result
        return execute
    return patched_execute(core, wrap)


# Two calls in each native format (short: the tiny models have 512 positions).
SCRIPTED = {HERMES: ("Let me count.\n", '<tool_call>\n{"name": "count", "arguments": {"n": 3}}'
                                         '\n</tool_call>\n<tool_call>\n{"name": "count", '
                                         '"arguments": {"n": 12}}\n</tool_call>'),
            LLAMA3_JSON: ("", '{"name": "count", "parameters": {"n": 3}}; '
                              '{"name": "count", "parameters": {"n": 12}}')}


def test_parallel_calls_stream_through_the_sdk(tool_server):
    """A reply with text and two calls (tool_choice auto, the template's own
    format) streams as OpenAI's chunks: the SDK's stream accumulates valid
    calls, each opened by one delta and filled by several."""
    fmt = detect_format(tool_server.core.tokenizer.chat_template)
    content, reply = SCRIPTED[fmt]
    client = OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0,
                    timeout=60)
    with _scripted(tool_server.core, content + reply), client.chat.completions.stream(
            model=tool_server.state.model_name, tools=[COUNT],
            messages=[{"role": "user", "content": "Count 3 and 12."}]) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "") == content
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert calls == [("count", {"n": 3}), ("count", {"n": 12})]
    for name, arguments in calls:
        jsonschema.validate(arguments, PARAMS[name])
    assert len({c.id for c in choice.message.tool_calls}) == 2
    opened = [c.choices[0].delta.tool_calls[0] for c in (e.chunk for e in events
                                                        if e.type == "chunk")
              if c.choices and c.choices[0].delta.tool_calls
              and c.choices[0].delta.tool_calls[0].id]
    assert [(d.index, d.function.name, d.function.arguments) for d in opened] == [
        (0, "count", ""), (1, "count", "")]
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert {e.index for e in pieces} == {0, 1} and len(pieces) > 4
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
