"""Errors as OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from backends.errors import ContextLengthExceededError, InvalidRequestError
from service.protocol import ErrorBody, ErrorResponse
from service.structured_outputs import REMOVED_GUIDED_FIELDS

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a handler; rendered by the error middleware."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status, "api_error")
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.error_type, self.param, self.code))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def from_invalid_request(exc: InvalidRequestError) -> APIError:
    code = "context_length_exceeded" if isinstance(exc, ContextLengthExceededError) \
        else getattr(exc, "code", None)
    return APIError(400, exc.message, param=exc.param, code=code)


_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
# A required top-level field left out: "Object missing required field `input`"
# (a nested one also says where, and _PATH names that).
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def from_decode_error(exc: msgspec.DecodeError | msgspec.ValidationError) -> APIError:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`"."""
    text = str(exc)
    unknown = _UNKNOWN.search(text)
    if unknown is not None:
        # Honoured or refused, never ignored: name the field it does not know.
        name, where = unknown.groups()
        param = f"{where}.{name}" if where else name
        if param in REMOVED_GUIDED_FIELDS:
            return APIError(400, f"{param} was removed in vLLM 0.12 and is not accepted; "
                                 f"use {REMOVED_GUIDED_FIELDS[param]}", param=param)
        return APIError(400, f"unknown or unsupported request field {param!r}: Baton does "
                             "not implement it (docs/serving.md lists the fields it takes)",
                        param=param)
    match = _PATH.search(text) or _MISSING.search(text)
    param = match.group(1) if match else None
    if isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"invalid request: {text}", param=param)
    return APIError(400, f"the request body is not valid JSON: {text}")
