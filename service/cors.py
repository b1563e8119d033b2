"""CORS for browser clients, off unless ``--allowed-origins`` names some.

A request whose ``Origin`` is allowed gets ``Access-Control-Allow-Origin``
(the origin itself, or ``*`` when any is allowed) on every answer, errors
included, so a page can read the OpenAI error envelope. A preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) to an existing route is
answered here, before authentication: browsers send no credentials on a
preflight. Credentials mode (cookies) is not offered; an API key travels in
the ``Authorization`` header, which preflights allow.
"""

from __future__ import annotations

from aiohttp import web

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, OpenAI-Organization, OpenAI-Project"
PREFLIGHT_MAX_AGE = "600"


def setup_cors(app: web.Application, allowed_origins: tuple[str, ...]) -> None:
    """Answer preflights and label every response, streams included (the
    labels go on in ``on_response_prepare``, just before headers are sent)."""
    if not allowed_origins:
        return
    any_origin = "*" in allowed_origins
    allowed = frozenset(o.rstrip("/") for o in allowed_origins)

    def allow_value(request: web.BaseRequest) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if any_origin:
            return "*"
        return origin if origin.rstrip("/") in allowed else None

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers \
                or isinstance(request.match_info.http_exception, web.HTTPNotFound):
            return await handler(request)
        if allow_value(request) is None:
            return web.Response(status=403, text="origin not allowed")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": request.headers.get(
                "Access-Control-Request-Headers", ALLOWED_HEADERS),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE})

    async def label(request: web.BaseRequest, response: web.StreamResponse) -> None:
        allow = allow_value(request)
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            if allow != "*":
                response.headers.add("Vary", "Origin")

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(label)
