"""An Anthropic Messages request as the chat completion request it amounts to.

``system`` becomes a system message; each message's text blocks its
content; ``tool_use`` blocks an assistant message's tool_calls (``input``
as the arguments' JSON); ``tool_result`` blocks tool messages, before the
user's text. A final assistant message is a prefill the reply continues
(chat's ``continue_final_message``). Tools become chat function tools
(``input_schema`` as parameters), ``tool_choice`` auto / any / tool / none
chat's auto / required / named / none, ``stop_sequences`` stop strings,
``thinking`` the template's ``enable_thinking``, ``output_config`` the
template's ``reasoning_effort`` and a strict JSON schema. Everything else
is honoured or refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from service.http_errors import APIError
from service.messages_protocol import ContentBlock, MessagesRequest, ToolDef
from service.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall,
                              FunctionDefinition, JsonSchemaFormat, NamedFunction,
                              NamedToolChoice, ResponseFormat, Tool, ToolCall)

# Chat's parameter names -> the Messages API's, for errors the chat path raises.
PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
               "response_format": "output_config.format",
               "reasoning_effort": "output_config.effort",
               "chat_template_kwargs": "thinking", "continue_final_message": "messages",
               "prompt": "messages"}


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} {why}", param=param)


def check_fields(req: MessagesRequest) -> None:
    for name in ("container", "mcp_servers", "inference_geo", "speed", "diagnostics",
                 "user_profile_id", "workspace_id"):
        if getattr(req, name) is not None:
            _refuse(name, "is not supported by this server")
    if req.service_tier not in (None, "auto", "standard_only"):
        _refuse("service_tier", f"{req.service_tier!r} is not supported")
    if req.max_tokens < 1:
        _refuse("max_tokens", f"must be at least 1, got {req.max_tokens}")
    if req.thinking is not None and req.thinking.type not in ("disabled",):
        _refuse("thinking", f"{req.thinking.type!r} is not supported: Baton does not separate "
                            "thinking from the reply, so it cannot answer in thinking blocks")


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    check_fields(req)
    messages: list[ChatMessage] = []
    if req.system:
        messages.append(ChatMessage(role="system", content=_system_text(req.system)))
    for i, message in enumerate(req.messages):
        messages += _chat_messages(message.role, message.content, i)
    if not req.messages:
        _refuse("messages", "must not be empty")
    prefill = req.messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls:
        _refuse(f"messages[{len(req.messages) - 1}]", "a final assistant message may hold "
                                                      "text to continue, not tool_use blocks")
    choice, parallel = _tool_choice(req.tool_choice)
    kwargs = {"enable_thinking": False} \
        if req.thinking is not None and req.thinking.type == "disabled" else None
    return ChatCompletionRequest(
        messages=messages, max_completion_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, tools=_tools(req.tools),
        tool_choice=choice, parallel_tool_calls=parallel,
        response_format=_output_format(req.output_config),
        reasoning_effort=req.output_config.effort if req.output_config is not None else None,
        chat_template_kwargs=kwargs, add_generation_prompt=not prefill,
        continue_final_message=prefill, stream=req.stream)


def _system_text(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        if block.type != "text" or block.text is None:
            _refuse(f"system[{j}]", f"must be a text block, got {block.type!r}")
        texts.append(block.text)
    return "\n".join(texts)


def _chat_messages(role: str, content: str | list[ContentBlock], i: int) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            if block.citations not in (None, []):
                _refuse(f"{where}.citations", "are not supported")
            texts.append(block.text or "")
        elif block.type == "tool_use" and role == "assistant":
            if block.id is None or block.name is None or not isinstance(block.input, dict):
                _refuse(where, "a tool_use block needs id, name and an input object")
            calls.append(ToolCall(id=block.id, function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif block.type == "tool_result" and role == "user":
            if block.tool_use_id is None:
                _refuse(where, "a tool_result block needs tool_use_id")
            text = _result_text(block.content, where)
            # Chat has no error flag on a tool message; the text says so.
            results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                       content=f"Error: {text}" if block.is_error else text))
        elif block.type in ("image", "document", "search_result"):
            _refuse(f"{where}.type", f"{block.type!r} blocks are not supported by this "
                                     "text-only model")
        elif block.type in ("thinking", "redacted_thinking"):
            _refuse(f"{where}.type", f"{block.type!r} blocks are not supported: Baton never "
                                     "answers with them")
        else:
            _refuse(f"{where}.type", f"{block.type!r} blocks are not supported in a "
                                     f"{role} message")
    out = list(results)
    if texts or calls or not results:
        out.append(ChatMessage(role=role, content="".join(texts) if texts or not calls
                               else None, tool_calls=calls or None))
    return out


def _result_text(content: str | list[ContentBlock] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, block in enumerate(content):
        if block.type != "text":
            _refuse(f"{where}.content[{k}].type", f"{block.type!r} is not supported in a "
                                                  "tool result by this text-only model")
        texts.append(block.text or "")
    return "".join(texts)


def _tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            _refuse(f"tools[{i}].type", f"{kind!r}: Anthropic's built-in tools are not "
                                        f"supported (Baton runs no tools); declare a custom "
                                        f"tool with an input_schema")
        try:
            tool = msgspec.convert(raw, ToolDef)
        except msgspec.ValidationError as exc:
            raise APIError(400, f"tools[{i}]: {exc}", param=f"tools[{i}]") from exc
        if tool.defer_loading or tool.allowed_callers not in (None, ["direct"]):
            _refuse(f"tools[{i}]", "defer_loading and allowed_callers are not supported")
        out.append(Tool(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema,
            strict=tool.strict)))
    return out


def _tool_choice(choice) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    if choice.type == "none":
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "auto":
        return "auto", parallel
    if choice.type == "any":
        return "required", parallel
    if choice.name is None:
        _refuse("tool_choice.name", "is required for tool_choice of type tool")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel


def _output_format(config) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    if config.format.type != "json_schema" or config.format.schema_ is None:
        _refuse("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": ...}")
    # Anthropic's structured outputs are exact: a schema the grammar engine
    # cannot enforce wholly is refused, naming the keyword.
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", schema_=config.format.schema_, strict=True))
