"""Tool calling: what the model is shown and what it may write
(service/tool_call_parser.py turns what it wrote into OpenAI ``tool_calls``).

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
from dataclasses import dataclass
from typing import Any

from backends.errors import InvalidRequestError
from backends.grammar import exactness_problem
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
            return StructuredOutputSpec("json", json.dumps(calls), param="tools", lenient=True)
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
    # Lenient: a non-strict tool's keywords the grammar engine does not
    # implement are left unenforced (as OpenAI does); strict tools were
    # checked to have none (plan_tools), so nothing of theirs is relaxed.
    return "%json " + json.dumps({**schema, "x-guidance": {**_COMPACT, "lenient": True}})


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
        if f.strict and (problem := exactness_problem(entry["parameters"])) is not None:
            raise InvalidRequestError(
                f"tools[{i}] ({f.name}) is strict, and the grammar engine cannot enforce its "
                f"parameters exactly: {problem}. Without strict: true, keywords and formats "
                f"it does not implement are left unenforced", "tools")
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
        if not answer.lenient and (problem := exactness_problem(answer_schema)) is not None:
            # Beside tools the answer joins a lenient grammar: refuse here what
            # its own constraint would have refused.
            raise InvalidRequestError(f"invalid json constraint: {problem}", answer.param)
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
