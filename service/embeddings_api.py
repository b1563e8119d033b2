"""POST /v1/embeddings (OpenAI's shape): each input is prefilled through the
same scheduler as generation, pooled by the backend (backends/pooling.py) and
answered as floats or base64 little-endian float32.

What a request may ask, checked before anything is queued (each a 400 naming
its field): ``input`` a non-empty string, list of strings, list of token ids
or list of token-id lists, at most ``MAX_INPUTS`` of them, each within the
context (or cut by ``truncate_prompt_tokens``); ``encoding_format`` float or
base64; ``dimensions`` only where the model is Matryoshka-trained (else only
its full size). The inputs of one request are queued all or nothing.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web

from backends.errors import BatonError, InvalidRequestError
from backends.interface import PoolingParams, SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.outputs import ModelInfo, RequestOutput
from scheduler.request import FinishReason
from service.app import (STATE, ServerState, _check_model, _decode, _read,
                         refuse_when_queue_full)
from service.embeddings_protocol import (Embedding, EmbeddingRequest, EmbeddingResponse,
                                         EmbeddingUsage)
from service.http_errors import APIError, from_invalid_request

# OpenAI's limit on inputs in one request.
MAX_INPUTS = 2048
# Unused by an embedding request (nothing is sampled); the engine's Request
# needs one.
_NO_SAMPLING = SamplingParams(max_tokens=1)
_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class PreparedEmbeddings:
    """A validated request: token ids per input and how to pool them."""

    prompts: list[list[int]]
    pooling: PoolingParams
    encoding_format: str
    priority: int
    texts: list[str]  # the text inputs (for --log-prompts); empty for token ids


def prepare_embeddings(req: EmbeddingRequest, tokenizer, model: ModelInfo
                       ) -> PreparedEmbeddings:
    """Check the request against the model and tokenize its inputs (on a
    preprocessing thread). Raises APIError (400) naming the field at fault."""
    pooling = model.pooling
    if pooling.unsupported is not None:
        raise APIError(400, pooling.unsupported, param="model")
    dimensions = _dimensions(req.dimensions, model)
    items = _inputs(req.input)
    keep = _truncation(req.truncate_prompt_tokens, model.max_model_len)
    prompts: list[list[int]] = []
    texts: list[str] = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            texts.append(item)
        else:
            ids = list(item)
        if keep is not None:
            ids = ids[-keep:]
        if not ids:
            raise APIError(400, "an input tokenizes to no tokens at all", param="input")
        if len(ids) > model.max_model_len:
            raise APIError(400, f"This model's maximum context length is "
                                f"{model.max_model_len} tokens. However, input "
                                f"{len(prompts)} holds {len(ids)} tokens. Shorten it, or send "
                                f"truncate_prompt_tokens to keep only its last tokens.",
                           param="input", code="context_length_exceeded")
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"input token id {bad} is outside the vocabulary "
                                f"(0..{model.vocab_size - 1})", param="input")
        prompts.append(ids)
    return PreparedEmbeddings(prompts, PoolingParams(pooling.pooling_type, dimensions),
                              req.encoding_format, req.priority, texts)


def _inputs(value) -> list:
    """A list of inputs, each a string or a list of token ids."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise APIError(400, "input must not be empty", param="input")
    if all(isinstance(v, int) for v in value):
        value = [value]
    elif not (all(isinstance(v, str) for v in value)
              or all(isinstance(v, list) for v in value)):
        raise APIError(400, "input must be a string, a list of strings, a list of token "
                            "ids or a list of token-id lists, not a mix", param="input")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(value)} items; at most {MAX_INPUTS} may be "
                            f"embedded in one request", param="input")
    if any(len(v) == 0 for v in value):
        raise APIError(400, "input must not hold an empty string or an empty token list",
                       param="input")
    return value


def _dimensions(dimensions: int | None, model: ModelInfo) -> int | None:
    """The length to cut vectors to (None: the whole vector)."""
    full = model.hidden_size
    pooling = model.pooling
    if dimensions is None or dimensions == full:
        return None
    if dimensions < 1:
        raise APIError(400, f"dimensions must be at least 1, got {dimensions}",
                       param="dimensions")
    if not pooling.matryoshka:
        raise APIError(400, f"dimensions {dimensions} is not supported: this model's "
                            f"embeddings are {full} wide and it is not Matryoshka-trained "
                            f"(its config.json sets neither matryoshka_dimensions nor "
                            f"is_matryoshka), so a cut vector would not be an embedding; "
                            f"leave dimensions out or send {full}", param="dimensions")
    if dimensions > full:
        raise APIError(400, f"dimensions {dimensions} exceeds the model's embedding size "
                            f"{full}", param="dimensions")
    allowed = pooling.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        raise APIError(400, f"dimensions {dimensions} is not one this model was trained "
                            f"for: {', '.join(map(str, allowed))}", param="dimensions")
    return dimensions


def _truncation(k: int | None, max_model_len: int) -> int | None:
    """How many trailing tokens of each input to keep (None: all)."""
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k < 1:
        raise APIError(400, f"truncate_prompt_tokens must be at least 1, or -1 for the "
                            f"context length, got {k}", param="truncate_prompt_tokens")
    if k > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens {k} exceeds the context length "
                            f"{max_model_len}", param="truncate_prompt_tokens")
    return k


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


# ------------------------------------------------------------------ admission

def _admit(state: ServerState, engine: AsyncEngine, prepared: PreparedEmbeddings) -> None:
    """The queue limits every route keeps (--max-waiting-requests and
    --max-waiting-tokens): a request that could never fit is a 400, one that
    does not fit now a 429."""
    cfg = state.config
    count = len(prepared.prompts)
    tokens = sum(len(p) for p in prepared.prompts)
    if count > cfg.max_waiting_requests:
        raise APIError(400, f"input holds {count} items, more than this server queues at "
                            f"once ({cfg.max_waiting_requests})", param="input")
    if tokens > cfg.max_waiting_tokens:
        raise APIError(400, f"the inputs hold {tokens} tokens, more than this server queues "
                            f"at once ({cfg.max_waiting_tokens})", param="input")
    refuse_when_queue_full(state, engine.load(), count, tokens)


# -------------------------------------------------------------------- the run

async def _run(engine: AsyncEngine, prepared: PreparedEmbeddings, timeout: float | None,
               telemetry) -> list[RequestOutput]:
    """Queue every input (all or nothing), wait for their vectors, in input
    order. Leaving early (a disconnect) aborts whatever has not finished."""
    response_id = f"embd-{uuid.uuid4().hex}"
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    ids: list[str] = []
    try:
        for i, prompt in enumerate(prepared.prompts):
            rid = f"{response_id}-{i}"
            engine.add_request(prompt, _NO_SAMPLING, rid, queue, prepared.priority,
                               pooling=prepared.pooling)
            ids.append(rid)
    except BaseException as exc:
        for rid in ids:
            engine.abort(rid)
        if isinstance(exc, InvalidRequestError):
            raise from_invalid_request(exc) from exc
        if isinstance(exc, BatonError):
            raise APIError(503, str(exc)) from exc
        raise
    if telemetry is not None:
        telemetry.started(response_id, ids, len(ids))
    index = {rid: i for i, rid in enumerate(ids)}
    finals: list[RequestOutput | None] = [None] * len(ids)

    def time_out() -> None:
        for rid in ids:
            engine.abort(rid, FinishReason.TIMEOUT)

    timer = None if timeout is None else \
        asyncio.get_running_loop().call_later(timeout, time_out)
    stream = engine.stream_group(ids)
    try:
        async for out in stream:
            if out.finished:
                finals[index[out.request_id]] = out
                if telemetry is not None:
                    telemetry.on_output(index[out.request_id], out)
    finally:
        if timer is not None:
            timer.cancel()
        await stream.aclose()
    return _checked(finals, timeout)


def _checked(finals: list[RequestOutput | None], timeout: float | None) -> list[RequestOutput]:
    """Every input's vector, or the error that kept one from it."""
    for out in finals:
        if out is None or out.finish_reason == FinishReason.ABORT.value:
            raise APIError(503, "the server shut down before the request finished")
        if out.finish_reason == FinishReason.ERROR.value:
            raise APIError(500, out.error or "engine fault", error_type="internal_error")
        if out.finish_reason == FinishReason.TIMEOUT.value:
            raise APIError(408, f"the request did not finish within the server's request "
                                f"timeout ({timeout:g} s, --request-timeout)")
        if out.embedding is None:
            raise APIError(500, "the engine finished an input without its vector",
                           error_type="internal_error")
    return finals  # type: ignore[return-value]


async def embeddings(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    telemetry = state.obs.begin("embeddings", request.headers) if state.obs else None
    error_type: str | None = None
    try:
        engine = state.ready_engine()
        req = _decode(await _read(request), EmbeddingRequest)
        _check_model(state, req.model)
        prepared = await state.off_loop(prepare_embeddings, req, engine.tokenizer,
                                        engine.model)
        if telemetry is not None:
            text = "\n".join(prepared.texts) if state.obs.log_prompts else None
            width = prepared.pooling.dimensions or engine.model.hidden_size
            telemetry.validated_request(None, 1, None, text, attributes={
                "choice_count": None, "stream": None,
                "gen_ai.request.encoding_formats": [prepared.encoding_format],
                "gen_ai.embeddings.dimension.count": width})
        _admit(state, engine, prepared)
        state.in_flight += 1
        try:
            finals = await _run(engine, prepared, state.config.request_timeout, telemetry)
        finally:
            state.in_flight -= 1
        tokens = sum(out.num_prompt_tokens for out in finals)
        body = EmbeddingResponse(
            [Embedding(i, encode_vector(out.embedding, prepared.encoding_format))
             for i, out in enumerate(finals)],
            state.model_name, EmbeddingUsage(tokens, tokens))
        return web.Response(body=_encoder.encode(body), content_type="application/json")
    except APIError as exc:
        error_type = exc.code or exc.error_type
        raise
    except InvalidRequestError:
        error_type = "invalid_request_error"
        raise
    except asyncio.CancelledError:
        error_type = "client_disconnected"
        raise
    except Exception as exc:
        error_type = type(exc).__name__
        raise
    finally:
        if telemetry is not None:
            telemetry.finish(error_type)

