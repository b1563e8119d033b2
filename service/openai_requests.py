"""Turn decoded OpenAI requests into engine inputs: prompts as token ids and
one SamplingParams, validated here so errors name the request's own params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.config import GenerationDefaults
from backends.errors import InvalidRequestError
from backends.interface import SamplingParams, StructuredOutputSpec
from backends.tokenizer import Tokenizer
from service.admission import PromptLimits
from service.chat_template import template_variables, tokenize_chat
from service.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from service.request_policy import check_chat_fields, check_common_fields
from service.structured_outputs import request_spec
from service.tool_calls import ToolPlan, detect_format, history_tool_calls, plan_tools

MAX_N = 128
# Template variables a caller's chat_template_kwargs may not replace.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                       "bos_token", "eos_token", "raise_exception", "strftime_now"})
_THINKING_SWITCHES = frozenset({"enable_thinking", "thinking"})


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """Server-wide chat settings (CLI flags)."""

    tool_call_parser: str | None = None        # None: detect from the template
    trust_request_chat_template: bool = False
    # Control-token text in messages stays text unless the clients are
    # trusted (docs/security.md).
    trust_control_tokens: bool = False
    max_logprobs: int = 20      # --max-logprobs: the most top_logprobs a request may ask for


@dataclass(slots=True)
class PreparedRequest:
    """``prompts[i]`` becomes choices ``i * n .. i * n + n - 1``."""

    kind: str                       # "text_completion", "chat"; "response", "message"
    prompts: list[list[int]]
    prompt_texts: list[str]         # for echo
    params: SamplingParams
    n: int
    num_logprobs: int | None        # top-N per token; None: no logprobs at all
    echo: bool
    stream: bool
    include_usage: bool
    priority: int = 0               # the scheduler's, under --scheduling-policy priority
    tools: ToolPlan | None = None       # chat: parse the reply into tool_calls
    request_id: str | None = None       # the client's own id (vLLM's request_id)
    continuous_usage: bool = False      # vLLM: usage on every streamed chunk


def _sampling_params(req, max_tokens: int | None, logprobs: int | None,
                     defaults: GenerationDefaults,
                     prompt_logprobs: int | None = None,
                     structured: StructuredOutputSpec | None = None) -> SamplingParams:
    def pick(value, default, fallback):
        if value is not None:
            return value
        return default if default is not None else fallback

    if not 1 <= req.n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            bias.append((int(key), float(value)))
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    if defaults.max_new_tokens is not None:  # generation_config.json's cap, as in vLLM
        max_tokens = defaults.max_new_tokens if max_tokens is None \
            else min(max_tokens, defaults.max_new_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pick(req.temperature, defaults.temperature, 1.0),
        top_p=pick(req.top_p, defaults.top_p, 1.0),
        top_k=pick(req.top_k, defaults.top_k, -1),
        min_p=pick(req.min_p, defaults.min_p, 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
        logit_bias=tuple(bias), seed=req.seed, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens, structured=structured)


def _truncate(ids: list[int], req) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be at least 1, got {k}",
                                  "truncate_prompt_tokens")
    return ids[-k:]


def _stream_flags(req) -> tuple[bool, bool]:
    opts = req.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer,
                       defaults: GenerationDefaults,
                       chat: ChatOptions | None = None,
                       limits: PromptLimits | None = None) -> PreparedRequest:
    """``limits`` are checked before each prompt is tokenized and after
    (counts, characters, tokens so far), so a request over them stops early."""
    # A completion prompt is the client's own text, control tokens included;
    # ChatOptions.trust_control_tokens concerns chat messages only.
    limits = limits or PromptLimits()
    check_common_fields(req)
    if req.suffix is not None:
        raise InvalidRequestError("suffix (fill-in-the-middle) is not supported", "suffix")
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise InvalidRequestError("best_of other than n is not supported (it needs beam "
                                  "scoring); leave it out or equal to n", "best_of")
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    elif any(isinstance(p, int) for p in prompt):
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists, not a mixture", "prompt")
    limits.check_count(len(prompt))
    prompts: list[list[int]] = []
    texts: list[str] = []
    total = 0
    for item in prompt:
        if not item:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if isinstance(item, str):
            if req.truncate_prompt_tokens is None:  # a truncated prompt may be any length
                limits.check_text(len(item))
            limits.check_cancelled()
            ids = tokenizer.encode(item, add_special_tokens=add_special)
            texts.append(item)
        else:
            limits.check_cancelled()
            ids = list(item)
            texts.append(tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
        prompts.append(_truncate(ids, req))
        total += len(prompts[-1])
        limits.check_tokens(total, req.n)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise InvalidRequestError("max_tokens 0 scores the prompt without generating: it "
                                  "needs echo (with logprobs for the scores)", "max_tokens")
    # echo with logprobs lists the prompt's tokens too, each scored given
    # the ones before it.
    prompt_logprobs = req.logprobs if req.echo else None
    params = _sampling_params(req, max_tokens, req.logprobs, defaults, prompt_logprobs,
                              request_spec(req.response_format, req.structured_outputs))
    usage, continuous = _stream_flags(req)
    return PreparedRequest(
        "text_completion", prompts, texts, params, req.n, req.logprobs, req.echo, req.stream,
        usage, req.priority, request_id=req.request_id, continuous_usage=continuous)


def message_dict(message: ChatMessage, tool_format: str) -> dict[str, Any]:
    """One message as a chat template reads it (transformers' layout)."""
    if message.function_call is not None:
        raise InvalidRequestError("messages: function_call is deprecated and not supported; "
                                  "send tool_calls", "messages")
    if message.audio is not None:
        raise InvalidRequestError("messages: audio is not supported by this text-only model",
                                  "messages")
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.text if part.type == "text" else \
                part.refusal if part.type == "refusal" else None
            if text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported by this "
                    f"text-only model", "messages")
            texts.append(text)
        content = "".join(texts)
    if content is None and message.refusal is not None:
        content = message.refusal
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.tool_calls:
        calls, text = history_tool_calls(message.tool_calls, tool_format)
        if calls is not None:
            out["tool_calls"] = calls
        else:
            out["content"] = f"{out['content']}\n{text}" if out["content"] else text
    return out


def message_chars(messages: list[ChatMessage]) -> int:
    """The characters of text in ``messages`` (contents, text parts,
    reasoning, tool-call arguments): what their rendering holds at least."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text or part.refusal or "") for part in content)
        total += len(message.reasoning_content or message.reasoning or "")
        total += sum(len(call.function.arguments) for call in message.tool_calls or ())
    return total


def _template_keywords(req, template: str) -> dict[str, Any]:
    """chat_template_kwargs and the fields templates read by name
    (reasoning_effort, verbosity): each must be one the template uses, or it
    would change nothing."""
    used = template_variables(template)
    keywords: dict[str, Any] = {}
    for name in ("reasoning_effort", "verbosity"):
        value = getattr(req, name, None)
        if value is not None:
            if name not in used:
                raise InvalidRequestError(
                    f"{name} is not supported by this model (its chat template does not "
                    f"read it)", name)
            keywords[name] = value
    for key, value in (getattr(req, "chat_template_kwargs", None) or {}).items():
        if key in _RESERVED:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}; use the "
                                      "request field instead", "chat_template_kwargs")
        if key not in used:
            if _thinking_switch_is_moot(key, value, template):
                continue    # what the template does anyway: nothing is lost
            raise InvalidRequestError(
                f"chat_template_kwargs: the chat template does not read {key!r}, so it "
                f"would have no effect", "chat_template_kwargs")
        keywords[key] = value
    documents = getattr(req, "documents", None)
    if documents is not None and "documents" not in used:
        raise InvalidRequestError("documents: the chat template does not read documents",
                                  "documents")
    return keywords


def _thinking_switch_is_moot(key: str, value: Any, template: str) -> bool:
    """A thinking switch (Qwen3's ``enable_thinking``, DeepSeek's
    ``thinking``) that the template does not read asks for what it does
    anyway when it is off for a template that never writes a think tag, or
    on for one that always does: clients that send it to every model work."""
    if key not in _THINKING_SWITCHES or not isinstance(value, bool):
        return False
    return value == ("<think>" in template)


def _template(req, tokenizer: Tokenizer, chat: ChatOptions) -> str | None:
    if req.chat_template is None:
        return tokenizer.chat_template
    if not chat.trust_request_chat_template:
        raise InvalidRequestError("chat_template in a request is refused unless the server "
                                  "runs with --trust-request-chat-template", "chat_template")
    return req.chat_template


@dataclass(slots=True)
class ChatPrompt:
    ids: list[int]
    tools: ToolPlan | None
    structured: StructuredOutputSpec | None


def chat_prompt(req, tokenizer: Tokenizer, chat: ChatOptions | None = None,
                answer: StructuredOutputSpec | None = None) -> ChatPrompt:
    """Render ``req.messages`` (with tools) and tokenize. ``req`` is a chat
    completion or a /tokenize request."""
    chat = chat or ChatOptions()
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    template = _template(req, tokenizer, chat)
    tool_format = chat.tool_call_parser or detect_format(template)
    plan = plan_tools(req.tools, getattr(req, "tool_choice", None),
                      getattr(req, "parallel_tool_calls", None), tool_format, answer)
    messages = [message_dict(m, tool_format) for m in req.messages]
    preamble = plan.preamble() if plan is not None else None
    if preamble:
        if messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    keywords = _template_keywords(req, template) if template else {}
    ids = tokenize_chat(tokenizer, messages, template=template,
                        add_special_tokens=bool(getattr(req, "add_special_tokens", False)),
                        trust_control_tokens=chat.trust_control_tokens,
                        add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        tools=plan.template_tools() if plan is not None else None,
                        documents=getattr(req, "documents", None), **keywords)
    structured = plan.constraint() if plan is not None else None
    return ChatPrompt(ids, plan, structured if plan is not None else answer)


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer,
                 defaults: GenerationDefaults,
                 chat: ChatOptions | None = None,
                 limits: PromptLimits | None = None) -> PreparedRequest:
    limits = limits or PromptLimits()
    check_common_fields(req)
    check_chat_fields(req)
    answer = request_spec(req.response_format, req.structured_outputs)
    if req.truncate_prompt_tokens is None:
        limits.check_text(message_chars(req.messages), "messages")
    limits.check_cancelled()
    prompt = chat_prompt(req, tokenizer, chat, answer)
    limits.check_cancelled()
    if req.truncate_prompt_tokens is None:
        limits.check_tokens(len(prompt.ids), req.n)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}",
                                  "max_completion_tokens" if req.max_completion_tokens
                                  is not None else "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    limit = (chat or ChatOptions()).max_logprobs
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= limit:
        raise InvalidRequestError(
            f"top_logprobs must be between 0 and {limit}, got {req.top_logprobs}",
            "top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(req, max_tokens, num_logprobs, defaults,
                              structured=prompt.structured)
    usage, continuous = _stream_flags(req)
    return PreparedRequest(
        "chat", [_truncate(prompt.ids, req)], [""], params, req.n, num_logprobs, False,
        req.stream, usage, req.priority, tools=prompt.tools, request_id=req.request_id,
        continuous_usage=continuous)
