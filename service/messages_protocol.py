"""The Anthropic Messages API's shapes (POST /v1/messages and its stream),
decoded and validated by msgspec.

Every struct forbids unknown fields: a field Baton does not know is a 400
naming it (in Anthropic's error envelope on this route). Content blocks and
tools of types Baton does not take are refused by their type
(service/messages_input.py).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from service.protocol import _Strict

# ----------------------------------------------------------------- requests


class ContentBlock(_Strict):
    """Any content block; its ``type`` says which fields it may carry."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Union[str, list[ContentBlock], None] = None
    is_error: bool | None = None
    cache_control: Any = None
    citations: Any = None
    source: Any = None
    title: Any = None
    context: Any = None
    thinking: Any = None
    signature: Any = None
    data: Any = None
    caller: Any = None


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class ToolDef(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: Any = None
    input_examples: Any = None
    defer_loading: bool | None = None
    allowed_callers: Any = None
    eager_input_streaming: bool | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: str
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Strict):
    type: str
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class OutputConfig(_Strict):
    effort: str | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = None


class MessagesRequest(_Strict, kw_only=True, omit_defaults=True):
    model: str | None = None
    max_tokens: int                 # required, as Anthropic requires it
    messages: list[MessageParam]
    system: Union[str, list[ContentBlock], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Tools arrive as objects and are checked one by one, so that a built-in
    # tool is refused by its type rather than by its first unknown field.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Metadata only (docs/serving.md): recorded nowhere, change nothing.
    metadata: Metadata | None = None
    cache_control: Any = None       # Baton caches prompt prefixes by itself
    service_tier: str | None = None
    # Refused unless absent or null.
    container: Any = None
    mcp_servers: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


# ---------------------------------------------------------------- responses


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


BlockOut = Union[TextOut, ToolUseOut]


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageOut(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[BlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    role: str = "assistant"


# ------------------------------------------------------------------- events
# Each streamed event is ``event: <type>`` and ``data: <the event as JSON>``.


class StreamEvent(msgspec.Struct, tag_field="type"):
    pass


class MessageStart(StreamEvent, tag="message_start"):
    message: MessageOut


class Ping(StreamEvent, tag="ping"):
    pass


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockStart(StreamEvent, tag="content_block_start"):
    index: int
    content_block: BlockOut


class ContentBlockDelta(StreamEvent, tag="content_block_delta"):
    index: int
    delta: Union[TextDelta, InputJsonDelta]


class ContentBlockStop(StreamEvent, tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct):
    output_tokens: int
    input_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageDelta(StreamEvent, tag="message_delta"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(StreamEvent, tag="message_stop"):
    pass


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorEvent(StreamEvent, tag="error"):
    error: ErrorDetail
