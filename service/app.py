"""The aiohttp application: routes, authentication, admission and errors.

State lives in one ServerState under an AppKey. The engine may not exist yet
(loading) or be refusing work (draining): both answer 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files

import msgspec
from aiohttp import web

from backends.errors import InvalidRequestError
from scheduler.async_engine import AsyncEngine
from service.admission import PromptLimits, check_n, check_nesting
from service.config import ServerConfig
from service.cors import setup_cors
from service.generation import respond_stream, respond_whole, start_run
from service.observability import Observability
from service.guards import check_api_key, install_malformed_request_filter, read_json_body
from service.http_errors import APIError, from_decode_error, from_invalid_request
from service.openai_requests import (ChatOptions, chat_prompt, message_chars, prepare_chat,
                                     prepare_completion)
from service.messages_api import MESSAGES_PATH, MessagesTurn, anthropic_error
from service.messages_protocol import MessagesRequest
from service.openapi import openapi_document
from service.responses_api import ResponsesTurn, delete_response, stored_response
from service.responses_protocol import ResponsesRequest
from service.responses_store import ResponsesStore
from service.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                              DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                              TokenizeResponse, TokenizerInfoResponse, VersionResponse)

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
    # Tokenization and chat-template rendering run here, off the event loop;
    # the semaphore bounds the work handed over at once (a waiter that
    # disconnects simply leaves).
    preprocess_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=PREPROCESS_THREADS, thread_name_prefix="baton-preprocess"))
    preprocess_slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(2 * PREPROCESS_THREADS))
    # Stored responses (the Responses API's store); made by create_app from the config.
    responses: ResponsesStore | None = None

    def ready_engine(self) -> AsyncEngine:
        if self.phase == "loading" or self.engine is None:
            self._reject("loading")
            raise APIError(503, "the model is still loading; retry shortly",
                           headers={"Retry-After": "5"})
        if self.phase != "ready":
            self._reject("draining")
            # Another replica may take it (and this one may come back).
            raise APIError(503, "the server is shutting down and takes no new requests",
                           headers={"Retry-After": "5"})
        if not self.engine.is_running:
            raise APIError(503, "the engine loop has stopped", headers={"Retry-After": "5"})
        fatal = self.engine.fatal_error
        if fatal:
            # Another replica may take it; this one needs a restart.
            raise APIError(503, f"the engine cannot serve: {fatal}",
                           headers={"Retry-After": "5"})
        return self.engine

    async def off_loop(self, fn, *args, cancel: threading.Event | None = None):
        """``fn(*args)`` on the preprocessing threads: one at a time for the
        calling request (it awaits each). When the caller is cancelled (its
        client went away) ``cancel`` is set, for ``fn`` to stop at its next
        check; a job not yet started is dropped."""
        async with self.preprocess_slots:
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self.preprocess_pool, fn, *args)
            except asyncio.CancelledError:
                if cancel is not None:
                    cancel.set()
                raise


    def _reject(self, reason: str) -> None:
        if self.obs is not None:
            self.obs.metrics.admission_rejected(reason)


STATE = web.AppKey("state", ServerState)
PREPROCESS_THREADS = 2


def _json(payload, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(payload),
                        content_type="application/json")


def _decode(body: bytes, type_):
    check_nesting(body)
    try:
        return msgspec.json.decode(body, type=type_)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_decode_error(exc) from exc
    except RecursionError:  # check_nesting bounds it; this is the backstop
        raise APIError(400, "the request body nests too deeply to decode") from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name and \
            model not in state.config.served_model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model", code="model_not_found")


# ---------------------------------------------------------------- middleware

@web.middleware
async def error_middleware(request: web.Request, handler):
    # Each API's own error envelope: Anthropic's on its route, OpenAI's elsewhere.
    render = anthropic_error if request.path.startswith(MESSAGES_PATH) else APIError.response
    try:
        return await handler(request)
    except APIError as exc:
        response = render(exc)
        if exc.status == 408:
            response.force_close()  # the rest of that body is not worth waiting for
        return response
    except InvalidRequestError as exc:
        return render(from_invalid_request(exc))
    except RecursionError:
        # Anything that walks a request's JSON (schemas, tool parameters,
        # templates) recursing past Python's limit: the body's fault.
        log.warning("%s %s: the request nests too deeply to process", request.method,
                    request.path)
        return render(APIError(400, "the request nests too deeply to process"))
    except web.HTTPRequestEntityTooLarge as exc:
        return render(APIError(413, f"request body too large: {exc.text}"))
    except web.HTTPNotFound:
        return render(APIError(404, f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return render(APIError(405, f"method {request.method} not allowed on {request.path} "
                                    f"(allowed: {allowed})", headers={"Allow": allowed}))
    except web.HTTPException:
        raise
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - the envelope beats a stack trace to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        return render(APIError(500, f"internal error: {type(exc).__name__}"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    check_api_key(request, request.app[STATE].config)
    return await handler(request)


async def _read(request: web.Request) -> bytes:
    return await read_json_body(request, request.app[STATE].config.body_read_timeout)


# ------------------------------------------------------------------ handlers

class _ChatAnswer:
    """How completions and chat answer (service/generation.py); the
    Responses and Messages APIs bring their own (service/responses_api.py,
    service/messages_api.py), with their own names for chat's parameters."""

    param_names: dict[str, str] = {}
    whole = staticmethod(respond_whole)
    stream = staticmethod(respond_stream)


async def _generate(request: web.Request, type_, prepare, operation: str,
                    answer=_ChatAnswer) -> web.StreamResponse:
    state = request.app[STATE]
    telemetry = state.obs.begin(operation, request.headers) if state.obs else None
    error_type: str | None = None
    run = None
    try:
        engine = state.ready_engine()
        req = _decode(await _read(request), type_)
        _check_model(state, req.model)
        # The Responses and Messages APIs have no n: one choice each.
        check_n(getattr(req, "n", 1), engine.model.max_num_seqs)
        cancel = threading.Event()
        prepared = await state.off_loop(prepare, req, engine.tokenizer,
                                        engine.model.generation, _chat_options(state),
                                        _prompt_limits(state, engine, cancel), cancel=cancel)
        _apply_default_max_tokens(state.config, engine, req, prepared)
        await _compile_constraint(state, engine, prepared)
        if telemetry is not None:
            prompt_text = "\n".join(prepared.prompt_texts) if state.obs.log_prompts else None
            telemetry.validated_request(prepared.params, prepared.n, prepared.stream,
                                        prompt_text)
        _admit(state, engine, prepared)
        run = start_run(engine, prepared, state.model_name, state.config.request_timeout,
                        telemetry)
        state.in_flight += 1
        if prepared.stream:
            return await answer.stream(run, request)
        return await answer.whole(run)
    except (APIError, InvalidRequestError) as exc:
        error_type = getattr(exc, "code", None) or getattr(exc, "error_type",
                                                            "invalid_request_error")
        exc.param = answer.param_names.get(exc.param, exc.param)   # the API's own names
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


def _apply_default_max_tokens(cfg, engine: AsyncEngine, req, prepared) -> None:
    """--default-max-tokens for a request that sends none, cut to what the
    context leaves (the client asked for no particular length)."""
    if cfg.default_max_tokens is None or any(
            getattr(req, name, None) is not None
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        return
    room = engine.model.max_model_len - max(len(p) for p in prepared.prompts)
    max_tokens = max(1, min(cfg.default_max_tokens, room))
    cap = engine.model.generation.max_new_tokens  # generation_config.json's, as in vLLM
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    min_tokens = min(prepared.params.min_tokens, max_tokens)
    prepared.params = dataclasses.replace(prepared.params, max_tokens=max_tokens,
                                          min_tokens=min_tokens)


def _prompt_limits(state: ServerState, engine: AsyncEngine,
                   cancel: threading.Event) -> PromptLimits:
    cfg = state.config
    return PromptLimits(cfg.max_waiting_requests, engine.model.max_model_len,
                        cfg.max_waiting_tokens, engine.tokenizer.max_chars_per_token, cancel)


def _chat_options(state: ServerState) -> ChatOptions:
    cfg = state.config
    max_logprobs = state.engine.model.max_logprobs if state.engine is not None else 20
    return ChatOptions(cfg.tool_call_parser, cfg.trust_request_chat_template,
                       cfg.trust_message_control_tokens, max_logprobs)


async def _compile_constraint(state: ServerState, engine: AsyncEngine, prepared) -> None:
    """Compile a structured-output constraint off the event loop (a large
    schema takes milliseconds); the engine then finds it in its cache."""
    spec = prepared.params.structured
    if spec is not None and engine.grammar is not None:
        await state.off_loop(engine.grammar.compile, spec)


def _admit(state: ServerState, engine: AsyncEngine, prepared) -> None:
    cfg = state.config
    count = len(prepared.prompts) * prepared.n
    tokens = sum(len(p) for p in prepared.prompts) * prepared.n
    load = engine.load()
    # A request that could never fit the queue gets 400, not a 429 that an
    # obedient client would retry for ever.
    if len(prepared.prompts) > cfg.max_waiting_requests:
        raise APIError(400, f"the request holds {len(prepared.prompts)} prompts, more than "
                            f"this server queues at once ({cfg.max_waiting_requests})",
                       param="prompt")
    if count > cfg.max_waiting_requests:
        raise APIError(400, f"the request asks for {len(prepared.prompts)} x {prepared.n} = "
                            f"{count} choices, more than this server queues at once "
                            f"({cfg.max_waiting_requests})", param="n")
    if tokens > cfg.max_waiting_tokens:
        raise APIError(400, f"the request's prompts hold {tokens} tokens, more than this "
                            f"server queues at once ({cfg.max_waiting_tokens})",
                       param="prompt" if prepared.n == 1 or
                       tokens // prepared.n > cfg.max_waiting_tokens else "n")
    refuse_when_queue_full(state, load, count, tokens)


def refuse_when_queue_full(state: ServerState, load, count: int, tokens: int) -> None:
    """429 (Retry-After) where ``count`` more requests holding ``tokens``
    prompt tokens would overfill the waiting queue, counted by reason."""
    cfg = state.config
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


async def create_response(request: web.Request) -> web.StreamResponse:
    turn = ResponsesTurn(request.app[STATE].responses)
    return await _generate(request, ResponsesRequest, turn.prepare, "chat", turn)


async def get_response(request: web.Request) -> web.Response:
    return stored_response(request, request.app[STATE].responses,
                           request.match_info["response_id"])


async def delete_stored_response(request: web.Request) -> web.Response:
    return delete_response(request, request.app[STATE].responses,
                           request.match_info["response_id"])


async def create_message(request: web.Request) -> web.StreamResponse:
    turn = MessagesTurn()
    return await _generate(request, MessagesRequest, turn.prepare, "chat", turn)


def _served_names(state: ServerState) -> list[str]:
    return [state.model_name] + [n for n in state.config.served_model_names
                                 if n != state.model_name]


def _model_card(state: ServerState, name: str) -> ModelCard:
    max_len = state.engine.model.max_model_len if state.engine else None
    return ModelCard(name, int(state.started), max_model_len=max_len)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _json(ModelList([_model_card(state, name) for name in _served_names(state)]))


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    _check_model(state, name)
    return _json(_model_card(state, name))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    req = _decode(await _read(request), TokenizeRequest)
    _check_model(state, req.model)
    tok = engine.tokenizer
    cancel = threading.Event()
    limits = _prompt_limits(state, engine, cancel)
    if req.messages is not None:
        limits.check_text(message_chars(req.messages), "messages")
        ids = (await state.off_loop(chat_prompt, req, tok, _chat_options(state),
                                    cancel=cancel)).ids
    elif req.prompt is not None:
        limits.check_text(len(req.prompt))
        ids = await state.off_loop(tok.encode, req.prompt, req.add_special_tokens is not False,
                                   cancel=cancel)
    else:
        raise APIError(400, "give either prompt or messages", param="prompt")
    strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return _json(TokenizeResponse(ids, len(ids), engine.model.max_model_len, strs))


async def tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    spec = engine.tokenizer.spec
    # Baton reads tokenizer.json with the tokenizers library: in transformers'
    # terms, a PreTrainedTokenizerFast.
    return _json(TokenizerInfoResponse(
        "PreTrainedTokenizerFast", engine.tokenizer.vocab_size, engine.model.max_model_len,
        spec.add_bos_token, spec.bos_token, spec.eos_token, spec.chat_template))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    req = _decode(await _read(request), DetokenizeRequest)
    _check_model(state, req.model)
    vocab = engine.model.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="tokens")
    # Special tokens stay, so /tokenize -> /detokenize gives back the chat prompt.
    text = await state.off_loop(engine.tokenizer.decode, req.tokens, False)
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
    install_malformed_request_filter()
    app = web.Application(client_max_size=state.config.max_body_bytes,
                          middlewares=[error_middleware, auth_middleware])
    app[STATE] = state
    if state.responses is None:
        state.responses = ResponsesStore(state.config.responses_store_bytes,
                                         state.config.responses_store_ttl)
    setup_cors(app, state.config.allowed_origins)

    async def stop_preprocessing(_app: web.Application) -> None:
        state.preprocess_pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_preprocessing)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_stored_response)
    app.router.add_post("/v1/messages", create_message)
    # Imported here: the embeddings route module builds on this one's helpers.
    from service.embeddings_api import embeddings
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/stats", dashboard_stats)
    app.router.add_get("/version", version_handler)
    app.router.add_get("/openapi.json", openapi)
    return app
