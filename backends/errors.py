"""Typed errors shared by every layer.

Each carries a message a user can act on. The gateway maps them onto OpenAI's
error envelope; the CLI prints them. Pure Python: no torch here.
"""

from __future__ import annotations


class BatonError(Exception):
    """Base class of every error Baton raises on purpose."""


class InvalidRequestError(BatonError):
    """A request parameter is out of range or malformed; raised at admission."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt (plus what was asked to generate) does not fit the context."""

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message, param)


class ConstraintError(InvalidRequestError):
    """A structured-output constraint the grammar engine cannot keep: it does
    not compile, admits no output, or exceeds the engine's limits. Known
    before the first token, so the request is refused (400)."""

    code = "grammar_error"


# The error type of a request whose constraint failed after it started
# (a 500, or an SSE error event, with this type; docs/serving.md).
GRAMMAR_ERROR = "grammar_error"


class ModelLoadError(BatonError):
    """Model files are missing, corrupt or inconsistent."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one Baton implements."""

    def __init__(self, architecture: str, supported: tuple[str, ...],
                 note: str = "") -> None:
        super().__init__(
            f"unsupported model architecture {architecture!r}; "
            f"Baton supports: {', '.join(supported)}{note}"
        )
        self.architecture = architecture
        self.supported = supported
