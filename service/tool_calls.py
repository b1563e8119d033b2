"""Tool calling: what the model is shown, what it may write, and how its
output becomes OpenAI ``tool_calls``.

Three output formats, chosen from the chat template (or ``--tool-call-parser``):

- ``hermes``: the template handles ``tools`` and writes ``<tool_call>`` (Qwen2.5,
  Qwen3, Hermes). Calls are ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one per block.
- ``llama3_json``: the template handles ``tools`` the Llama 3.1-3.3 way
  (``<|python_tag|>`` / ipython). A call is ``{"name": ..., "parameters": {...}}``,
  several separated by ``; ``.
- ``generic``: the template knows nothing of tools (SmolLM2, ChatML). As
  llama-server does for such templates, a system preamble describes the tools
  and the whole reply is one JSON object, ``{"tool_calls": [{"name", "arguments"}]}``
  or ``{"response": ...}``, enforced by the grammar engine even for ``auto``.

``required`` and a named function are always enforced with a grammar, so the
output is a valid call whatever the model; ``auto`` in the native formats is
left free and parsed afterwards.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from backends.errors import InvalidRequestError
from backends.interface import StructuredOutputSpec
from service.chat_template import template_variables

HERMES, LLAMA3_JSON, GENERIC = "hermes", "llama3_json", "generic"
TOOL_FORMATS = (HERMES, LLAMA3_JSON, GENERIC)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def detect_format(template: str | None) -> str:
    if not template or "tools" not in template_variables(template):
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return GENERIC


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolPlan:
    """One request's tools. ``choice`` is "auto", "required" or "named"."""

    format: str
    functions: dict[str, dict[str, Any]]     # name -> {name, description, parameters}
    choice: str
    named: str | None = None
    parallel: bool = True
    answer_schema: dict[str, Any] | None = None   # response_format beside tools (auto)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` variable for a template that handles tools."""
        if self.format == GENERIC:
            return None
        return [{"type": "function", "function": f} for f in self._offered().values()]

    def _offered(self) -> dict[str, dict[str, Any]]:
        if self.named is not None:
            return {self.named: self.functions[self.named]}
        return self.functions

    def preamble(self) -> str | None:
        """The generic format's system text (docs/serving.md shows it)."""
        if self.format != GENERIC:
            return None
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self._offered().values())
        call = '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}'
        if self.choice == "auto":
            how = (f"To call tools, reply with only the JSON object {call}. To answer "
                   "(for example once the tool results you need are in the conversation), "
                   'reply with only {"response": <your answer>}.')
        else:
            how = f"You must call a tool: reply with only the JSON object {call}."
        return f"You can call these tools:\n{listing}\n\n{how}"

    # --------------------------------------------------------- constraint
    def constraint(self) -> StructuredOutputSpec | None:
        if self.format == GENERIC:
            calls = {"type": "object", "properties": {"tool_calls": {
                "type": "array", "items": self._one_call("arguments"), "minItems": 1,
                **({} if self.parallel and self.named is None else {"maxItems": 1})}},
                "required": ["tool_calls"], "additionalProperties": False}
            if self.choice == "auto":
                answer = {"type": "object", "properties": {
                    "response": self.answer_schema or {"type": "string"}},
                    "required": ["response"], "additionalProperties": False}
                calls = {"anyOf": [calls, answer]}
            return StructuredOutputSpec("json", json.dumps(calls), param="tools")
        if self.choice == "auto" and self.answer_schema is None:
            return None
        key = "parameters" if self.format == LLAMA3_JSON else "arguments"
        one = _lark_json(self._one_call(key))
        if self.format == HERMES:
            rules = [f'call: "<tool_call>\\n" {one} "\\n</tool_call>"']
            sep = '"\\n"'
        else:
            rules = [f"call: {one}"]
            sep = '"; "'
        calls = f"call ({sep} call)*" if self.parallel and self.named is None else "call"
        if self.choice == "auto":
            rules.insert(0, f"start: {calls} | {_lark_json(self.answer_schema)}")
        else:
            rules.insert(0, f"start: {calls}")
        return StructuredOutputSpec("grammar", "\n".join(rules), param="tools")

    def _one_call(self, key: str) -> dict[str, Any]:
        options = []
        for name, f in self._offered().items():
            params = f.get("parameters") or {"type": "object", "properties": {},
                                             "additionalProperties": False}
            options.append({"type": "object", "properties": {
                "name": {"const": name}, key: params},
                "required": ["name", key], "additionalProperties": False})
        return options[0] if len(options) == 1 else {"anyOf": options}


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


def plan_tools(tools, tool_choice, parallel_tool_calls: bool | None, fmt: str,
               answer: StructuredOutputSpec | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice``; None when no tool may be called."""
    choice, named = _choice(tool_choice)
    if not tools:
        if choice in ("required", "named"):
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequestError(
                f"tools[{i}]: only tools of type function are supported, got {tool.type!r}",
                "tools")
        f = tool.function
        if not _NAME.match(f.name):
            raise InvalidRequestError(
                f"tools[{i}]: function names are 1-64 letters, digits, _ or -, got {f.name!r}",
                "tools")
        if f.name in functions:
            raise InvalidRequestError(f"tools: the function {f.name!r} is given twice", "tools")
        entry: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            entry["description"] = f.description
        entry["parameters"] = f.parameters if f.parameters is not None else {
            "type": "object", "properties": {}}
        functions[f.name] = entry
    if choice == "none":
        return None
    if named is not None and named not in functions:
        raise InvalidRequestError(f"tool_choice names {named!r}, which is not among the tools",
                                  "tool_choice")
    answer_schema = None
    if answer is not None:
        if choice != "auto":
            raise InvalidRequestError(
                "response_format / structured_outputs cannot be combined with tool_choice "
                "required or a named function (the reply must be a tool call)",
                answer.param)
        if answer.kind != "json":
            raise InvalidRequestError("beside tools, only a JSON constraint can shape the "
                                      "answer", answer.param)
        answer_schema = json.loads(answer.source)
    # Several calls per reply: as OpenAI, unless the client says false; in the
    # generic format only when it says true, as models never trained on tools
    # tend to repeat one call until max_tokens when an array is open to them.
    parallel = parallel_tool_calls is True if fmt == GENERIC else parallel_tool_calls is not False
    return ToolPlan(fmt, functions, choice, named, parallel=parallel,
                    answer_schema=answer_schema)


def _choice(tool_choice) -> tuple[str, str | None]:
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if isinstance(tool_choice, str):
        return tool_choice, None
    if tool_choice.type != "function" or tool_choice.function is None:
        raise InvalidRequestError(
            f"tool_choice of type {tool_choice.type!r} is not supported; use none, auto, "
            "required or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return "named", tool_choice.function.name


# ------------------------------------------------------------- history

def history_tool_calls(calls, fmt: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """An assistant message's ``tool_calls`` for the template: (tool_calls
    for a template that renders them, or text to append to the content)."""
    rendered = [{"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments_value(c.function.arguments)}}
                for c in calls]
    if fmt != GENERIC:
        return rendered, None
    body = {"tool_calls": [{"name": c["function"]["name"],
                            "arguments": c["function"]["arguments"]} for c in rendered]}
    return None, json.dumps(body, ensure_ascii=False)


def _arguments_value(arguments: str) -> Any:
    # Templates write arguments with tojson (Llama) or as given (Qwen): a
    # dict serves both, as vLLM passes them.
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# --------------------------------------------------------------- output

@dataclass(slots=True)
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParserDelta:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser:
    """Splits a reply into content and tool calls as its text arrives.

    ``feed`` returns what can be told now (content that cannot be the start of
    a call, calls whose text is complete); ``finish`` the rest. Fed the whole
    text at once it gives the non-streaming answer, so both agree.
    """

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buffer = ""
        self.in_call = False
        self.mode: str | None = None       # llama3 / generic: decided by the first text
        self.num_calls = 0
        self.streamed = 0                  # generic: chars of the response string sent

    def feed(self, text: str) -> ParserDelta:
        self.buffer += text
        if self.plan.format == HERMES:
            return self._hermes(final=False)
        if self.plan.format == LLAMA3_JSON:
            return self._llama(final=False)
        return self._generic(final=False)

    def finish(self) -> ParserDelta:
        if self.plan.format == HERMES:
            return self._hermes(final=True)
        if self.plan.format == LLAMA3_JSON:
            return self._llama(final=True)
        return self._generic(final=True)

    def _call(self, name: str, arguments: Any) -> ParsedCall:
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = ParsedCall(self.num_calls, new_call_id(), name, arguments)
        self.num_calls += 1
        return call

    def _from_object(self, obj: Any, key: str) -> ParsedCall | None:
        if (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and (key in obj or "arguments" in obj)):
            return self._call(obj["name"], obj.get(key, obj.get("arguments")))
        return None

    # ------------------------------------------------------------ hermes
    def _hermes(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        while True:
            if not self.in_call:
                at = self.buffer.find(self._OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, self._OPEN)
                    cut = len(self.buffer) - keep
                    out.content += self._between_calls(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return out
                out.content += self._between_calls(self.buffer[:at])
                self.buffer = self.buffer[at + len(self._OPEN):]
                self.in_call = True
            end = self.buffer.find(self._CLOSE)
            if end < 0 and not final:
                return out
            body = self.buffer if end < 0 else self.buffer[:end]
            call = self._from_object(_loads(body.strip()), "arguments")
            if call is None:   # not a call after all: keep the text
                out.content += self._OPEN + (body if end < 0 else body + self._CLOSE)
            else:
                out.calls.append(call)
            self.buffer = "" if end < 0 else self.buffer[end + len(self._CLOSE):]
            self.in_call = False
            if end < 0:
                return out

    def _between_calls(self, text: str) -> str:
        # The newlines between calls are layout, not content.
        return text if self.num_calls == 0 or text.strip() else ""

    # ------------------------------------------------------------- llama
    def _llama(self, final: bool) -> ParserDelta:
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith("<|python_tag|>"):
                head = head[len("<|python_tag|>"):].lstrip()
            if not head and not final:
                return ParserDelta()
            self.mode = "calls" if head.startswith("{") else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return ParserDelta(content=text)
        if not final:
            return ParserDelta()
        text = self.buffer.strip()
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>"):]
        calls = self._json_sequence(text)
        self.buffer = ""
        return ParserDelta(calls=calls) if calls else ParserDelta(content=text)

    def _json_sequence(self, text: str) -> list[ParsedCall]:
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(text):
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            if at == len(text):
                break
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                self.num_calls -= len(calls)
                return []
            call = self._from_object(obj, "parameters")
            if call is None:
                self.num_calls -= len(calls)
                return []
            calls.append(call)
        return calls

    # ----------------------------------------------------------- generic
    _RESPONSE = '{"response": "'

    def _generic(self, final: bool) -> ParserDelta:
        text = self.buffer
        if self.mode is None and (len(text) >= len(self._RESPONSE) or final):
            self.mode = "string" if text.startswith(self._RESPONSE) else "json"
        if self.mode == "string" and not final:
            decoded, _, _ = _json_string_prefix(text[len(self._RESPONSE):])
            new, self.streamed = decoded[self.streamed:], len(decoded)
            return ParserDelta(content=new)
        if not final:
            return ParserDelta()
        obj = _loads(text)
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            calls = [self._from_object(c, "arguments") for c in obj["tool_calls"]]
            if calls and all(calls):
                return ParserDelta(calls=calls)
            self.num_calls = 0
        if isinstance(obj, dict) and "response" in obj:
            answer = obj["response"]
            answer = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
        elif self.mode == "string":
            # cut short (length): what the string held so far
            answer = _json_string_prefix(text[len(self._RESPONSE):])[0]
        else:
            answer = text
        return ParserDelta(content=answer[self.streamed:])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_string_prefix(body: str) -> tuple[str, int, bool]:
    """Decode the complete part of a JSON string body (after its opening
    quote): (text, characters used, whether the closing quote was seen)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            break
        if body[i + 1] != "u":
            out.append(json.loads(f'"{body[i:i + 2]}"'))
            i += 2
            continue
        width = 6
        if i + 6 <= len(body) and 0xD800 <= int(body[i + 2:i + 6], 16) < 0xDC00:
            width = 12      # a surrogate pair
        if i + width > len(body):
            break
        out.append(json.loads(f'"{body[i:i + width]}"'))
        i += width
    return "".join(out), i, False
