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
