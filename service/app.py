"""The aiohttp application: routes, authentication, admission and errors.

State lives in one ServerState under an AppKey. The engine may not exist yet
(loading) or be refusing work (draining): both answer 503.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files

import msgspec
from aiohttp import web

from backends.errors import InvalidRequestError
from scheduler.async_engine import AsyncEngine
from service.config import ServerConfig
from service.generation import respond_stream, respond_whole, start_run
from service.observability import Observability
from service.http_errors import APIError, from_decode_error, from_invalid_request
from service.openai_requests import chat_prompt_ids, prepare_chat, prepare_completion
from service.openapi import openapi_document
from service.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                              DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                              TokenizeResponse, VersionResponse)

log = logging.getLogger("baton.http")
_encoder = msgspec.json.Encoder()


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    model_name: str = "model"
    phase: str = "loading"          # loading | ready | draining | stopped
    in_flight: int = 0
    started: float = field(default_factory=time.time)
    obs: Observability | None = None

    def ready_engine(self) -> AsyncEngine:
        if self.phase == "loading" or self.engine is None:
            self._reject("loading")
            raise APIError(503, "the model is still loading; retry shortly",
                           headers={"Retry-After": "5"})
        if self.phase != "ready":
            self._reject("draining")
            raise APIError(503, "the server is shutting down and takes no new requests")
        if not self.engine.is_running:
            raise APIError(503, "the engine loop has stopped")
        return self.engine


    def _reject(self, reason: str) -> None:
        if self.obs is not None:
            self.obs.metrics.admission_rejected(reason)


STATE = web.AppKey("state", ServerState)


def _json(payload, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(payload),
                        content_type="application/json")


def _decode(body: bytes, type_):
    try:
        return msgspec.json.decode(body, type=type_)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_decode_error(exc) from exc


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model", code="model_not_found")


# ---------------------------------------------------------------- middleware

@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except InvalidRequestError as exc:
        return from_invalid_request(exc).response()
    except web.HTTPRequestEntityTooLarge as exc:
        return APIError(413, f"request body too large: {exc.text}").response()
    except web.HTTPNotFound:
        return APIError(404, f"no route for {request.method} {request.path}").response()
    except web.HTTPMethodNotAllowed:
        return APIError(405, f"method {request.method} not allowed on {request.path}",
                        ).response()
    except web.HTTPException:
        raise
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - the envelope beats a stack trace to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE].config.api_key
    if key and request.path.startswith("/v1"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")
    return await handler(request)


# ------------------------------------------------------------------ handlers

async def _generate(request: web.Request, type_, prepare,
                    operation: str) -> web.StreamResponse:
    state = request.app[STATE]
    telemetry = state.obs.begin(operation, request.headers) if state.obs else None
    error_type: str | None = None
    run = None
    try:
        engine = state.ready_engine()
        req = _decode(await request.read(), type_)
        _check_model(state, req.model)
        prepared = prepare(req, engine.tokenizer, engine.model.generation)
        if telemetry is not None:
            prompt_text = "\n".join(prepared.prompt_texts) if state.obs.log_prompts else None
            telemetry.validated_request(prepared.params, prepared.n, prepared.stream,
                                        prompt_text)
        _admit(state, engine, prepared)
        run = start_run(engine, prepared, state.model_name, state.config.request_timeout,
                        telemetry)
        state.in_flight += 1
        if prepared.stream:
            return await respond_stream(run, request)
        return await respond_whole(run)
    except APIError as exc:
        error_type = exc.code or exc.error_type
        raise
    except InvalidRequestError as exc:
        error_type = "invalid_request_error"
        raise
    except asyncio.CancelledError:
        error_type = "client_disconnected"
        raise
    except Exception as exc:
        error_type = type(exc).__name__
        raise
    finally:
        if run is not None:
            state.in_flight -= 1
            await run.close()
        if telemetry is not None:
            telemetry.finish(error_type)


def _admit(state: ServerState, engine: AsyncEngine, prepared) -> None:
    cfg = state.config
    count = len(prepared.prompts) * prepared.n
    tokens = sum(len(p) for p in prepared.prompts) * prepared.n
    load = engine.load()
    if tokens > cfg.max_waiting_tokens:
        raise APIError(400, f"the request's prompts hold {tokens} tokens, more than this "
                            f"server queues at once ({cfg.max_waiting_tokens})", param="prompt")
    reason = None
    if load.num_waiting + count > cfg.max_waiting_requests:
        reason, what = "queue_full", f"too many requests waiting ({load.num_waiting})"
    elif load.num_waiting_tokens + tokens > cfg.max_waiting_tokens:
        reason, what = "queue_tokens_full", \
            f"too many prompt tokens waiting ({load.num_waiting_tokens})"
    if reason is not None:
        if state.obs is not None:
            state.obs.metrics.admission_rejected(reason)
        raise APIError(429, f"{what}; retry shortly", headers={"Retry-After": "1"},
                       code="queue_full")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest, prepare_completion, "text_completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatCompletionRequest, prepare_chat, "chat")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    max_len = state.engine.model.max_model_len if state.engine else None
    return _json(ModelList([ModelCard(state.model_name, int(state.started),
                                      max_model_len=max_len)]))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    req = _decode(await request.read(), TokenizeRequest)
    _check_model(state, req.model)
    tok = engine.tokenizer
    if req.messages is not None:
        ids = chat_prompt_ids(req.messages, tok, req.add_generation_prompt)
    elif req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise APIError(400, "give either prompt or messages", param="prompt")
    return _json(TokenizeResponse(ids, len(ids), engine.model.max_model_len))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    req = _decode(await request.read(), DetokenizeRequest)
    _check_model(state, req.model)
    vocab = engine.model.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="tokens")
    # Special tokens stay, so /tokenize -> /detokenize gives back the chat prompt.
    text = engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return _json(DetokenizeResponse(text))


async def metrics(request: web.Request) -> web.Response:
    obs = request.app[STATE].obs
    if obs is None:
        raise APIError(404, "metrics are not enabled on this server")
    body, content_type = obs.metrics.render(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


@cache
def _dashboard_page() -> bytes:
    return (files("service") / "static" / "dashboard.html").read_bytes()


async def dashboard(request: web.Request) -> web.Response:
    """The built-in live dashboard: one self-contained page polling /dashboard/stats."""
    return web.Response(body=_dashboard_page(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def dashboard_stats(request: web.Request) -> web.Response:
    obs = request.app[STATE].obs
    if obs is None or obs.live is None:
        raise APIError(404, "live statistics are not enabled on this server")
    return web.Response(body=_encoder.encode(obs.live.snapshot()),
                        content_type="application/json", headers={"Cache-Control": "no-store"})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    if state.phase != "ready" or engine is None:
        return web.Response(status=503, text=state.phase)
    health = engine.health()
    return web.Response(status=200 if health.ok else 503, text=health.reason)


def baton_version() -> str:
    try:
        return version("baton")
    except PackageNotFoundError:
        return "0.0.0+unknown"


async def version_handler(request: web.Request) -> web.Response:
    return _json(VersionResponse(baton_version()))


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=openapi_document(baton_version()),
                        content_type="application/json")


def create_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=state.config.max_body_bytes,
                          middlewares=[error_middleware, auth_middleware])
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/stats", dashboard_stats)
    app.router.add_get("/version", version_handler)
    app.router.add_get("/openapi.json", openapi)
    return app
