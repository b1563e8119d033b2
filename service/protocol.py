"""OpenAI-compatible request and response shapes, decoded and validated by msgspec.

Every request struct forbids unknown fields: a field Baton does not know is a
400 naming it, never silently dropped (docs/serving.md lists what each known
field does). Some known fields are accepted only with the values Baton can
honour; ``service/request_policy.py`` checks those. Requests are decoded
straight from the body bytes; ``msgspec.ValidationError`` messages name the
offending field, which the gateway turns into the error's ``param``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

# ----------------------------------------------------------------- requests


class _Strict(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    video_url: Any = None
    audio_url: Any = None


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCall(_Strict):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # Assistant history as the SDK echoes it back.
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    annotations: list[Any] | None = None
    function_call: Any = None       # deprecated; refused unless null
    audio: Any = None               # refused unless null


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: str
    function: FunctionDefinition | None = None
    custom: Any = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: str = "function"
    function: NamedFunction | None = None
    allowed_tools: Any = None
    custom: Any = None


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag formats (refused, with a message saying so)
    format: Any = None
    structures: Any = None
    triggers: Any = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its form since 0.12; 0.32 accepts only this)."""

    json: Union[str, dict[str, Any], None] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Metadata only: recorded nowhere, change nothing (docs/serving.md).
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    # vLLM extras Baton accepts only at their default value.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None


class CompletionRequest(_SamplingFields, kw_only=True, omit_defaults=True):
    # A string, a list of strings, a list of token ids, or a list of token-id
    # lists; msgspec takes one list type per union, so items are checked later.
    prompt: Union[str, list[Union[str, int, list[int]]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    include_reasoning: bool = True
    echo: bool = False
    # Metadata only (docs/serving.md).
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    modalities: list[str] | None = None
    # Refused unless absent or null (docs/serving.md says why).
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # default: true for prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False     # vLLM's: each token's vocabulary string too


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str      # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct):
    id: str
    function: ToolCallFunction
    type: str = "function"


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "baton"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class TokenizerInfoResponse(msgspec.Struct, omit_defaults=True):
    """GET /tokenizer_info, as vLLM serves it: the tokenizer's settings."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    add_bos_token: bool
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
