"""Render a model's own chat template (Jinja) the way Hugging Face does.

As transformers' ``apply_chat_template``: a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks`` and loop controls, the helpers it gives
templates (``raise_exception``, ``strftime_now``, ``tojson`` with its
``indent`` / ``separators`` / ``sort_keys``, the ``{% generation %}`` block),
and the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the special tokens, plus any caller keywords
(``chat_template_kwargs``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.errors import InvalidRequestError


class TemplateError(InvalidRequestError):
    """The template rejected the conversation (raise_exception) or failed."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template error: {message}", "messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens
    for training masks; for rendering it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template does not parse: {exc}",
                                  "chat_template") from exc


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads from its context (``messages``, ``tools``,
    ``enable_thinking`` ...): what a caller's keywords can change."""
    env = _environment()
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template does not parse: {exc}",
                                  "chat_template") from exc


def render_chat(template: str | None, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                bos_token: str | None = None, eos_token: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    """The prompt text for ``messages``. Raises InvalidRequestError when the
    model has no template or the template rejects the conversation.

    ``continue_final_message`` leaves the last message open (no end-of-turn
    after it), so the model continues it, as transformers does.
    """
    if not template:
        raise InvalidRequestError(
            "this model has no chat template; use the completions endpoint "
            "with a plain prompt instead", "messages")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message")
    context = {"messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token or "", "eos_token": eos_token or "", **extra}
    if tools is not None:
        context["tools"] = tools
    if documents is not None:
        context["documents"] = documents
    try:
        text = _compile(template).render(**context)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template failed to render: {exc}", "messages") from exc
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    final = (messages[-1].get("content") or "") if messages else ""
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequestError("continue_final_message needs a final message with text "
                                  "content", "continue_final_message")
    # Templates may strip or trim the content; cut after its last appearance.
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[:at + len(needle)]
    raise InvalidRequestError("continue_final_message: the chat template does not write the "
                              "final message's content as given", "continue_final_message")


# Put inside control-token strings found in message fields, so that the
# rendered prompt cannot read them as control tokens; a Unicode noncharacter
# ("for internal use"), removed again before the text is tokenized.
_BREAK = "\ufdd0"


def tokenize_chat(tokenizer, messages: list[dict[str, Any]], *,
                  template: str | None = None, add_special_tokens: bool = False,
                  trust_control_tokens: bool = False, **render: Any) -> list[int]:
    """Render ``messages`` with ``template`` (default: the model's) and
    tokenize the prompt; ``render`` goes to ``render_chat``.

    The template writes any BOS itself, as Hugging Face's apply_chat_template
    assumes; ``add_special_tokens`` (vLLM's field) adds the tokenizer's BOS on
    top when the model uses one.

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
        for name in ("tools", "documents"):
            if render.get(name) is not None:
                render[name], changed = _defang(render[name], specials)
                defanged = defanged or changed
    spec = tokenizer.spec
    text = render_chat(template if template is not None else tokenizer.chat_template,
                       messages, bos_token=spec.bos_token, eos_token=spec.eos_token, **render)
    if not defanged:
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = _encode_with_markup_only(tokenizer, text)
    bos = spec.bos_token_id
    if add_special_tokens and spec.add_bos_token and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


def _defang_messages(messages: list[dict[str, Any]],
                     specials: list[str]) -> tuple[list[dict[str, Any]], bool]:
    out, changed = _defang(messages, specials)
    return out, changed


def _defang(value: Any, specials: list[str]) -> tuple[Any, bool]:
    """``value`` with every control-token string in it broken, looking into
    lists and dicts (tool calls, tool definitions, documents)."""
    if isinstance(value, str):
        # The marker is removed from the text first: kept, it would be taken
        # out only after the control tokens around it were found (and a
        # "\ufdd0<|im_end|>" would open a real turn); and it must not make a
        # control token of what it split either.
        changed = _BREAK in value
        value = value.replace(_BREAK, "")
        for special in specials:
            if special in value:
                value = value.replace(special, special[0] + _BREAK + special[1:])
                changed = True
        return value, changed
    if isinstance(value, list):
        items = [_defang(v, specials) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    if isinstance(value, dict):
        items = {k: _defang(v, specials) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, any(c for _, c in items.values())
    return value, False


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
