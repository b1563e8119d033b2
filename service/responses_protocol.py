"""The OpenAI Responses API's shapes (POST /v1/responses and its stream),
decoded and validated by msgspec as service/protocol.py does for chat.

Every struct forbids unknown fields: a field Baton does not know is a 400
naming it. Fields Baton knows but honours only at some values are checked in
service/responses_api.py. Input items arrive as plain objects and are
converted one by one (``parse_input_items``), so an error names the item.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from service.http_errors import APIError
from service.protocol import _Strict

# ----------------------------------------------------------------- requests


class InputPart(_Strict):
    """A content part of an input message: input_text / output_text /
    refusal are text; images, files and audio are refused (text-only models)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    image_url: Any = None
    file_id: Any = None
    file_url: Any = None
    file_data: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None


class MessageItem(_Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputPart]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: Any = None


class FunctionCallOutputItem(_Strict):
    call_id: str
    output: Union[str, list[InputPart]]
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: Any = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}


def parse_input_items(raw: str | list[dict[str, Any]]) -> list[InputItem]:
    """``input`` as typed items: a string is one user message."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        cls = _ITEM_TYPES.get(kind)
        if cls is None:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported; Baton "
                                f"takes message, function_call and function_call_output items "
                                f"(use previous_response_id to continue a stored response)",
                           param=f"input[{i}].type")
        try:
            items.append(msgspec.convert(item, cls))
        except msgspec.ValidationError as exc:
            raise APIError(400, f"input[{i}]: {exc}", param=f"input[{i}]") from exc
    return items


class FunctionTool(_Strict):
    """A tool as the Responses API declares it (flat: no ``function`` wrapper)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Built-in tools' own fields, so that they are refused by their type.
    defer_loading: Any = None
    output_schema: Any = None
    allowed_callers: Any = None


class ToolChoiceObject(_Strict):
    type: str
    name: str | None = None
    mode: Any = None
    tools: Any = None
    server_label: Any = None


class TextFormat(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: bool = False


class ResponsesRequest(_Strict, kw_only=True, omit_defaults=True):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]] = msgspec.field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceObject, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    truncation: str | None = None
    # Metadata only: recorded in the response, change nothing (docs/serving.md).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # Refused unless absent, null or their default (docs/serving.md says why).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    prompt_cache_options: Any = None


# ---------------------------------------------------------------- responses


class OutputText(msgspec.Struct):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "output_text"


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = Union[OutputMessage, OutputFunctionCall]


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class Response(msgspec.Struct):
    """A response object, as POST returns it, the stream carries it and GET
    returns it stored."""

    id: str
    created_at: int
    model: str
    status: str                      # in_progress | completed | incomplete | failed
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[Any]
    text: Any
    metadata: dict[str, str]
    reasoning: Any = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    service_tier: str = "default"
    object: str = "response"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response"


# ------------------------------------------------------------------- events
# Each streamed event is ``event: <type>`` and ``data: <the event as JSON>``;
# sequence_number counts the stream's events from 0.


class ResponseEvent(msgspec.Struct, tag_field="type"):
    sequence_number: int


class ResponseCreated(ResponseEvent, tag="response.created"):
    response: Response


class ResponseInProgress(ResponseEvent, tag="response.in_progress"):
    response: Response


class ResponseCompleted(ResponseEvent, tag="response.completed"):
    response: Response


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"):
    response: Response


class ResponseFailed(ResponseEvent, tag="response.failed"):
    response: Response


class OutputItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ResponseEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDone(ResponseEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class FunctionCallArgumentsDelta(ResponseEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(ResponseEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str
