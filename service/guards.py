"""What stands between the network and the handlers: the API key, the request
body (media type, time to arrive, content encoding), the connection cap, and
quiet logging of malformed HTTP. docs/security.md says what each guards."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from service.config import ServerConfig
from service.http_errors import APIError

log = logging.getLogger("baton.http")

# /dashboard is a static page that holds no data; it asks for the key before
# it fetches /dashboard/stats (which is guarded).
_ALWAYS_PUBLIC = frozenset({"/health", "/dashboard"})


def is_public(path: str, config: ServerConfig) -> bool:
    return path in _ALWAYS_PUBLIC or (path == "/metrics" and config.metrics_public)


def api_key_matches(authorization: str | None, key: str) -> bool:
    """``Authorization: Bearer KEY``, the scheme in any case. Digests are
    compared, in constant time, so the time taken tells nothing about the
    key, not even its length."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                               hashlib.sha256(key.encode()).digest())


def check_api_key(request: web.Request, config: ServerConfig) -> None:
    """``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's
    clients send it."""
    if not config.api_key or is_public(request.path, config):
        return
    x_api_key = request.headers.get("x-api-key")
    if api_key_matches(request.headers.get(hdrs.AUTHORIZATION), config.api_key) or (
            x_api_key is not None and api_key_matches(f"Bearer {x_api_key}", config.api_key)):
        return
    raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY, or "
                        "x-api-key: KEY)", code="invalid_api_key",
                   headers={"WWW-Authenticate": "Bearer"})


async def read_json_body(request: web.Request, timeout: float | None) -> bytes:
    """The body of a JSON route: 415 for another media type (none at all is
    taken as JSON, as curl -d users expect), 408 when it does not arrive in
    ``timeout`` seconds, 400 when its content encoding does not decode."""
    content_type = request.headers.get(hdrs.CONTENT_TYPE)
    if content_type is not None:
        mime = content_type.partition(";")[0].strip().lower()
        if mime != "application/json" and not mime.endswith("+json"):
            raise APIError(415, f"this route takes application/json, not {mime or '(empty)'!r}",
                           code="unsupported_media_type")
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except RequestPayloadError as exc:
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity")
        raise APIError(400, f"the request body could not be read (Content-Encoding "
                            f"{encoding!r}): {_payload_reason(exc)}") from None


def _payload_reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return getattr(cause, "message", None) or str(cause)


# ---------------------------------------------------------------- connections

def runner_options(config: ServerConfig) -> dict:
    """aiohttp's connection settings for an AppRunner: a connection with no
    request in progress (none yet, or between two) is closed after
    ``idle_timeout`` seconds; aiohttp's keep-alive timer runs from the moment
    a connection opens, so it is also the time a client has to send its
    first request's headers."""
    return {"handler_cancellation": True, "access_log": None,
            "keepalive_timeout": config.idle_timeout}


class ConnectionLimiter:
    """At most ``limit`` open client connections. At the limit a new
    connection displaces the one that has been idle longest (no request in
    progress: silent since it opened, or between requests), which is closed.
    When every connection has a request in progress, up to
    ``health_overflow`` more are taken in all the same, to answer /health:
    any other request on them gets 503 with Retry-After (and the connection
    closes); past those, a new connection is answered the same 503 and closed
    before anything is parsed. So idle sockets, however many, never lock out
    a request, /health is answered even when the server is full of work, and
    a full server still sheds load."""

    _REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s")
    _BODY = (b'{"error": {"message": "too many open connections; retry shortly", '
             b'"type": "service_unavailable", "param": null, "code": "too_many_connections"}}')

    def __init__(self, server: web.Server, limit: int, health_overflow: int = 32) -> None:
        self.limit = limit
        self.health_overflow = health_overflow
        self.num_refused = 0
        self.num_displaced = 0
        # Open connections (handler -> transport), in the order they last
        # became idle: the first idle one has been idle longest.
        self._open: dict = {}
        self._busy: dict = {}   # connection -> requests in progress on it
        self._overflow: set = set()  # past the limit, for /health only
        self._made = server.connection_made
        self._lost = server.connection_lost
        self._handle = server.request_handler
        server.connection_made = self._connection_made  # type: ignore[method-assign]
        server.connection_lost = self._connection_lost  # type: ignore[method-assign]
        server.request_handler = self._request  # type: ignore[method-assign]

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_busy(self) -> int:
        """Connections with a request in progress."""
        return len(self._busy)

    def _connection_made(self, handler, transport) -> None:
        if len(self._open) >= self.limit:
            self._displace_idle()
        if len(self._open) >= self.limit:
            if len(self._overflow) >= self.health_overflow:
                self.num_refused += 1
                transport.write(self._REFUSAL % (len(self._BODY), self._BODY))
                transport.close()
                return
            self._overflow.add(handler)
        self._open[handler] = transport
        self._made(handler, transport)

    def _displace_idle(self) -> bool:
        """Close the connection idle longest; False when none is idle."""
        for handler, transport in self._open.items():  # insertion order: idle longest first
            if not self._busy.get(handler):
                del self._open[handler]
                self.num_displaced += 1
                transport.close()
                return True
        return False

    def _connection_lost(self, handler, exc=None) -> None:
        self._open.pop(handler, None)
        self._busy.pop(handler, None)
        self._overflow.discard(handler)
        self._lost(handler, exc)

    async def _request(self, request: web.BaseRequest):
        handler = request.protocol
        if handler in self._overflow and request.path != "/health":
            self.num_refused += 1
            response = web.Response(status=503, body=self._BODY, content_type="application/json",
                                    headers={"Retry-After": "1"})
            response.force_close()
            return response
        self._busy[handler] = self._busy.get(handler, 0) + 1
        try:
            return await self._handle(request)
        finally:
            left = self._busy.get(handler, 1) - 1
            if left:
                self._busy[handler] = left
            else:
                self._busy.pop(handler, None)
                if handler in self._open:  # idle from now: the back of the line
                    self._open[handler] = self._open.pop(handler)


def limit_connections(runner: web.AppRunner, limit: int | None) -> ConnectionLimiter | None:
    """Cap ``runner``'s open connections (call after ``runner.setup()``)."""
    if not limit or runner.server is None:
        return None
    return ConnectionLimiter(runner.server, limit)


# -------------------------------------------------------------------- logging

class MalformedRequestLogFilter(logging.Filter):
    """aiohttp logs a client's malformed HTTP (bad request line, bad headers,
    a body that does not decode) as an error with a traceback. It is the
    client's fault: one warning line, no traceback, at most one per
    ``interval`` seconds (the next says how many were left out)."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return False
        self._last = now
        note = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self._suppressed = 0
        reason = _payload_reason(exc).replace("\n", " ").strip()
        record.msg = "malformed HTTP request from a client: %s%s"
        record.args = (reason, note)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = None
        record.exc_text = None
        return True


def install_malformed_request_filter() -> None:
    """Once per process, on aiohttp's server logger."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLogFilter) for f in logger.filters):
        logger.addFilter(MalformedRequestLogFilter())
