"""Render a model's own chat template (Jinja) the way Hugging Face does."""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.errors import InvalidRequestError


class TemplateError(InvalidRequestError):
    """The template rejected the conversation (raise_exception) or failed."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template error: {message}", "messages")


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    import json
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def render_chat(template: str | None, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, bos_token: str | None = None,
                eos_token: str | None = None, **extra: Any) -> str:
    """The prompt text for ``messages``. Raises InvalidRequestError when the
    model has no template or the template rejects the conversation."""
    if not template:
        raise InvalidRequestError(
            "this model has no chat template; use the completions endpoint "
            "with a plain prompt instead", "messages")
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "", eos_token=eos_token or "", **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template failed to render: {exc}", "messages") from exc


# Put inside control-token strings found in message fields, so that the
# rendered prompt cannot read them as control tokens; a Unicode noncharacter
# ("for internal use"), removed again before the text is tokenized.
_BREAK = "\ufdd0"


def tokenize_chat(tokenizer, messages: list[dict[str, Any]], *,
                  add_generation_prompt: bool = True,
                  trust_control_tokens: bool = False) -> list[int]:
    """Render ``messages`` with the model's template and tokenize the prompt.

    Control tokens (``<|im_end|>``, ``<|im_start|>`` ...) come only from the
    template's own markup: their text inside a message is tokenized as
    ordinary text, so a user cannot close their turn and open a system one.
    ``trust_control_tokens`` restores reading them as control tokens (for
    trusted clients only). With no control-token text in any message the
    tokens are exactly those of tokenizing the rendered prompt as a whole.
    """
    specials = [s for s in tokenizer.special_tokens if len(s) > 1]
    defanged = False
    if not trust_control_tokens and specials:
        messages, defanged = _defang_messages(messages, specials)
    spec = tokenizer.spec
    text = render_chat(tokenizer.chat_template, messages,
                       add_generation_prompt=add_generation_prompt,
                       bos_token=spec.bos_token, eos_token=spec.eos_token)
    # The template writes any BOS itself, as Hugging Face's apply_chat_template assumes.
    if not defanged:
        return tokenizer.encode(text, add_special_tokens=False)
    return _encode_with_markup_only(tokenizer, text)


def _defang_messages(messages: list[dict[str, Any]],
                     specials: list[str]) -> tuple[list[dict[str, Any]], bool]:
    changed = False
    out = []
    for message in messages:
        fields = {}
        for key, value in message.items():
            if isinstance(value, str) and _BREAK not in value:
                for special in specials:
                    if special in value:
                        value = value.replace(special, special[0] + _BREAK + special[1:])
                        changed = True
            elif isinstance(value, str):
                changed = True  # the marker itself must not survive either
            fields[key] = value
        out.append(fields)
    return out, changed


def _encode_with_markup_only(tokenizer, text: str) -> list[int]:
    """Split ``text`` where the tokenizer finds control tokens (only the
    template's now: those in messages are broken), as Hugging Face does
    before tokenizing the pieces between them, and tokenize each piece with
    the break markers removed and control-token strings read as text."""
    encoding = tokenizer.backend.encode_batch([text], add_special_tokens=False)[0]
    special_ids = tokenizer.special_ids
    ids: list[int] = []
    start = 0
    for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
        if token_id in special_ids:
            ids += _encode_piece(tokenizer, text[start:begin])
            ids.append(token_id)
            start = end
    ids += _encode_piece(tokenizer, text[start:])
    return ids


def _encode_piece(tokenizer, piece: str) -> list[int]:
    piece = piece.replace(_BREAK, "")
    return tokenizer.encode_as_text(piece) if piece else []
