"""A Responses API request as the chat completion request it amounts to.

``instructions`` and the input items become chat messages (function_call
items join the assistant message before them as tool_calls;
function_call_output items become tool messages); function tools become
chat tools (strict unless they say otherwise, as OpenAI's Responses API
has it); ``text.format`` becomes response_format, ``reasoning.effort`` and
``text.verbosity`` the template variables chat gives them. Fields with no
chat counterpart are checked here: honoured, or a 400 naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from service.http_errors import APIError
from service.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall,
                              FunctionDefinition, JsonSchemaFormat, NamedFunction,
                              NamedToolChoice, ResponseFormat, Tool, ToolCall)
from service.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, InputItem,
                                        InputPart, MessageItem, ResponsesRequest, TextConfig)
from service.responses_store import ResponsesStore

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat's parameter names -> the Responses API's, for errors the chat path raises.
PARAM_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens":
               "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text.format", "reasoning_effort": "reasoning.effort",
               "verbosity": "text.verbosity"}


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} {why}", param=param)


def check_fields(req: ResponsesRequest, store: ResponsesStore) -> None:
    """Fields Baton knows but honours only at some values."""
    if req.background:
        _refuse("background", "true is not supported: Baton answers within the request; "
                              "leave it out (stream for long answers)")
    for name, why in (
            ("conversation", "is not supported: conversations are OpenAI-hosted; continue a "
                             "stored response with previous_response_id"),
            ("prompt", "(a prompt template stored at OpenAI) is not supported; send "
                       "instructions and input"),
            ("max_tool_calls", "is not supported; parallel_tool_calls false allows one call "
                               "per response"),
            ("context_management", "is not supported"),
            ("prompt_cache_options", "is not supported: Baton caches prompt prefixes by "
                                     "itself (docs/serving.md, \"Prefix caching\")")):
        if getattr(req, name) is not None:
            _refuse(name, why)
    if req.truncation not in (None, "disabled"):
        _refuse("truncation", f"{req.truncation!r} is not supported: the input is never "
                              "cut; a conversation longer than the context is a 400")
    if req.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", f"{req.service_tier!r} is not supported; one tier serves all")
    if req.stream_options is not None:
        if not req.stream:
            _refuse("stream_options", "is only allowed when stream is true")
        if req.stream_options.include_obfuscation:
            _refuse("stream_options", "include_obfuscation is not supported")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        _refuse("reasoning.summary", "is not supported: Baton does not separate reasoning "
                                     "from the reply")
    for value in req.include or ():
        if value != LOGPROBS_INCLUDE:
            _refuse("include", f"{value!r} is not supported; Baton can include only "
                               f"{LOGPROBS_INCLUDE!r}")
    if req.top_logprobs is not None and not wants_logprobs(req):
        _refuse("top_logprobs", f"needs include [{LOGPROBS_INCLUDE!r}]")
    if wants_logprobs(req) and req.tools and req.tool_choice != "none":
        _refuse("include", f"{LOGPROBS_INCLUDE!r} cannot be combined with tools (a reply's "
                           "tokens may be a tool call's)")
    if req.store is True and not store.enabled:
        _refuse("store", "true is not possible: this server keeps no responses "
                         "(--responses-store-size 0)")


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or ())


def chat_request(req: ResponsesRequest, conversation: tuple[InputItem, ...]
                 ) -> ChatCompletionRequest:
    messages = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    messages += chat_messages(conversation)
    logprobs = wants_logprobs(req)
    return ChatCompletionRequest(
        messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        verbosity=req.text.verbosity if req.text is not None else None,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        logprobs=logprobs, top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        stream=req.stream)


def chat_messages(items: tuple[InputItem, ...]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            # developer messages are the system's (templates know no developer role)
            role = "system" if item.role == "developer" else item.role
            out.append(ChatMessage(role=role, content=_text(item.content, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            _direct_caller(item, i)
            call = ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            _direct_caller(item, i)
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, f"input[{i}].output")))
    return out


def _direct_caller(item: FunctionCallItem | FunctionCallOutputItem, i: int) -> None:
    if item.namespace is not None:
        _refuse(f"input[{i}].namespace", "is not supported (no tool namespaces)")
    if item.caller not in (None, {"type": "direct"}):
        _refuse(f"input[{i}].caller", "is not supported: every call is the model's own")


def _text(content: str | list[InputPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text") and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in ("input_image", "input_file", "input_audio"):
            _refuse(f"{where}.content[{j}]", f"of type {part.type!r} is not supported by this "
                                             f"text-only model")
        else:
            _refuse(f"{where}.content[{j}]", f"of type {part.type!r} is not a text part "
                                             f"(input_text, output_text or refusal)")
    return "".join(texts)


def _tools(tools) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            _refuse(f"tools[{i}].type", f"{t.type!r}: built-in tools run in OpenAI's service, "
                                        f"and Baton runs no tools itself; declare a function "
                                        f"tool and run it in your application")
        if t.name is None:
            _refuse(f"tools[{i}].name", "is required for a function tool")
        for name in ("defer_loading", "output_schema"):
            if getattr(t, name) not in (None, False):
                _refuse(f"tools[{i}].{name}", "is not supported")
        if t.allowed_callers not in (None, ["direct"]):
            _refuse(f"tools[{i}].allowed_callers", "is not supported: only the model calls tools")
        # The Responses API's function tools are strict unless they say otherwise.
        out.append(Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters,
            strict=t.strict is not False)))
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        _refuse("tool_choice", f"of type {choice.type!r} is not supported; use none, auto, "
                               "required or {\"type\": \"function\", \"name\": ...}")
    return NamedToolChoice(type="function", function=NamedFunction(choice.name))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            _refuse("text.format.schema", "is required for a json_schema format")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name or "response", description=fmt.description, schema_=fmt.schema_,
            strict=fmt.strict))
    _refuse("text.format.type", f"must be text, json_object or json_schema, got {fmt.type!r}")


def echo_text(text: TextConfig | None) -> dict[str, Any]:
    """The response's ``text`` field: the format in effect."""
    out = msgspec.to_builtins(text) if text is not None else {}
    out.setdefault("format", {"type": "text"})
    return out
