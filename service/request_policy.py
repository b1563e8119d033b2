"""Fields Baton knows but honours only at some values: anything else is a
400 naming the field, never a value silently dropped. docs/serving.md lists
every request field and what it does."""

from __future__ import annotations

from backends.errors import InvalidRequestError

# A client's own request id is echoed in the response's id and logged.
MAX_REQUEST_ID_CHARS = 128


def _refuse(param: str, why: str) -> None:
    raise InvalidRequestError(f"{param} {why}", param)


def check_common_fields(req) -> None:
    """Completions and chat alike (vLLM's sampling extras, stream_options)."""
    if req.use_beam_search:
        _refuse("use_beam_search", "is not supported (no beam search)")
    if req.length_penalty != 1.0:
        _refuse("length_penalty", "applies to beam search, which is not supported")
    if req.include_stop_str_in_output:
        _refuse("include_stop_str_in_output", "is not supported")
    if not req.spaces_between_special_tokens:
        _refuse("spaces_between_special_tokens", "false is not supported")
    if req.allowed_token_ids is not None:
        _refuse("allowed_token_ids", "is not supported; use logit_bias or structured_outputs")
    if req.bad_words:
        _refuse("bad_words", "is not supported")
    if req.prompt_logprobs is not None:
        _refuse("prompt_logprobs", "is not supported; completions give prompt logprobs "
                                   "with echo and logprobs")
    request_id = req.request_id
    if request_id is not None:
        if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            _refuse("request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters long, got "
                                  f"{len(request_id)}")
        if not request_id.isprintable():
            _refuse("request_id", "must not hold control characters (it is logged)")
    opts = req.stream_options
    if opts is not None:
        if not req.stream:
            _refuse("stream_options", "is only allowed when stream is true")
        if opts.include_obfuscation:
            _refuse("stream_options", "include_obfuscation is not supported")


def check_chat_fields(req) -> None:
    """OpenAI chat fields outside a text-only, self-hosted model's reach."""
    for name, why in (
            ("audio", "output is not supported by this text-only model"),
            ("prediction", "(predicted outputs) is not supported"),
            ("web_search_options", "is not supported: this server has no web search"),
            ("functions", "is deprecated and not supported; send tools"),
            ("function_call", "is deprecated and not supported; send tool_choice")):
        if getattr(req, name) is not None:
            _refuse(name, why)
    if req.modalities is not None and req.modalities != ["text"]:
        _refuse("modalities", f"{req.modalities!r} is not supported; only [\"text\"]")
    if req.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", f"{req.service_tier!r} is not supported; one tier serves all")
    if not req.include_reasoning:
        _refuse("include_reasoning", "false is not supported: Baton does not separate "
                                     "reasoning from the reply")
    if req.echo:
        _refuse("echo", "is not supported for chat completions")
