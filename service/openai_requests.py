"""Turn decoded OpenAI requests into engine inputs: prompts as token ids and
one SamplingParams, validated here so errors name the request's own params."""

from __future__ import annotations

from dataclasses import dataclass

from backends.config import GenerationDefaults
from backends.errors import InvalidRequestError
from backends.interface import SamplingParams
from backends.tokenizer import Tokenizer
from service.chat_template import tokenize_chat
from service.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

MAX_N = 128


@dataclass(slots=True)
class PreparedRequest:
    """``prompts[i]`` becomes choices ``i * n .. i * n + n - 1``."""

    kind: str                       # "text_completion" or "chat"
    prompts: list[list[int]]
    prompt_texts: list[str]         # for echo
    params: SamplingParams
    n: int
    num_logprobs: int | None        # top-N per token; None: no logprobs at all
    echo: bool
    stream: bool
    include_usage: bool
    priority: int = 0               # the scheduler's, under --scheduling-policy priority


def _sampling_params(req, max_tokens: int | None, logprobs: int | None,
                     defaults: GenerationDefaults,
                     prompt_logprobs: int | None = None) -> SamplingParams:
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
        skip_special_tokens=req.skip_special_tokens)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer,
                       defaults: GenerationDefaults,
                       trust_control_tokens: bool = False) -> PreparedRequest:
    # A completion prompt is the client's own text, control tokens included;
    # ``trust_control_tokens`` concerns chat messages only.
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
    prompts: list[list[int]] = []
    texts: list[str] = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            prompts.append(tokenizer.encode(item))
            texts.append(item)
        else:
            if not item:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            prompts.append(list(item))
            texts.append(tokenizer.decode(list(item), skip_special_tokens=False)
                         if req.echo else "")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    # echo with logprobs lists the prompt's tokens too, each scored given
    # the ones before it.
    prompt_logprobs = req.logprobs if req.echo else None
    params = _sampling_params(req, max_tokens, req.logprobs, defaults, prompt_logprobs)
    return PreparedRequest(
        "text_completion", prompts, texts, params, req.n, req.logprobs, req.echo, req.stream,
        bool(req.stream_options and req.stream_options.include_usage), req.priority)


def message_dict(message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported by this "
                    f"text-only model", "messages")
            texts.append(part.text)
        content = "".join(texts)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer,
                    add_generation_prompt: bool = True,
                    trust_control_tokens: bool = False) -> list[int]:
    """Message content is tokenized as text: control-token strings in it do
    not become control tokens unless ``trust_control_tokens``."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    return tokenize_chat(tokenizer, [message_dict(m) for m in messages],
                         add_generation_prompt=add_generation_prompt,
                         trust_control_tokens=trust_control_tokens)


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer,
                 defaults: GenerationDefaults,
                 trust_control_tokens: bool = False) -> PreparedRequest:
    ids = chat_prompt_ids(req.messages, tokenizer, req.add_generation_prompt,
                          trust_control_tokens)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequestError(
            f"top_logprobs must be between 0 and 20, got {req.top_logprobs}", "top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(req, max_tokens, num_logprobs, defaults)
    return PreparedRequest(
        "chat", [ids], [""], params, req.n, num_logprobs, False, req.stream,
        bool(req.stream_options and req.stream_options.include_usage), req.priority)
