"""POST /v1/messages (the Anthropic Messages API), answered whole or as its
event stream, with Anthropic's error envelope on the route.

One request model underneath: the request is translated into a chat
completion request (service/messages_input.py) and prepared by the chat
path (service/openai_requests.py). Only the answer is Anthropic's: content
blocks (text and tool_use; service/reply.py), ``stop_reason`` (end_turn,
max_tokens, stop_sequence, tool_use) and, streamed, the events

    message_start, ping,
    per block: content_block_start, content_block_delta (text_delta |
               input_json_delta) ..., content_block_stop
    message_delta (stop_reason, usage), message_stop

An error after the stream began is an ``error`` event. Usage counts prompt
tokens found in the prefix cache as ``cache_read_input_tokens`` and the
rest as ``input_tokens``, as Anthropic does; ``cache_creation_input_tokens``
is 0 (Baton caches without being asked).
"""

from __future__ import annotations

import json

import msgspec
from aiohttp import web

from backends.tokenizer import Tokenizer
from service.generation import GenerationRun
from service.http_errors import APIError
from service.messages_input import PARAM_NAMES, chat_request
from service.messages_protocol import (BlockOut, ContentBlockDelta, ContentBlockStart,
                                       ContentBlockStop, DeltaUsage, ErrorDetail, ErrorEvent,
                                       InputJsonDelta, MessageDelta, MessageOut, MessagesRequest,
                                       MessageStart, MessageStop, MessageUsage, Ping, StopDelta,
                                       StreamEvent, TextDelta, TextOut, ToolUseOut)
from service.admission import PromptLimits
from service.openai_requests import ChatOptions, PreparedRequest, prepare_chat
from service.reply import CALL, Block, BlockEvent, Reply, ReplyBlocks, collect_reply, failure
from service.responses_api import SSE_HEADERS

MESSAGES_PATH = "/v1/messages"
_encoder = msgspec.json.Encoder()
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(exc: APIError) -> web.Response:
    """``{"type": "error", "error": {"type", "message"}}``, Anthropic's envelope."""
    body = ErrorEvent(_error_detail(exc))
    return web.Response(status=exc.status, body=_encoder.encode(body),
                        content_type="application/json", headers=exc.headers)


def _error_detail(exc: APIError) -> ErrorDetail:
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500
                            else "api_error")
    return ErrorDetail(kind, exc.message)


class MessagesTurn:
    """One POST /v1/messages: ``prepare`` runs on a preprocessing thread,
    ``whole`` or ``stream`` on the event loop once the run has started."""

    param_names = PARAM_NAMES

    def __init__(self) -> None:
        self.prepared: PreparedRequest | None = None

    def prepare(self, req: MessagesRequest, tokenizer: Tokenizer, defaults,
                chat: ChatOptions | None = None,
                limits: PromptLimits | None = None) -> PreparedRequest:
        prepared = prepare_chat(chat_request(req), tokenizer, defaults, chat, limits)
        prepared.kind = "message"
        self.prepared = prepared
        return prepared

    async def whole(self, run: GenerationRun) -> web.Response:
        reply = await collect_reply(run)
        blocks = ReplyBlocks(self.prepared.tools)
        blocks.feed(reply.text, final=True)
        stop_reason, stop_sequence = _stop(reply, blocks)
        message = MessageOut(run.id, run.model, [_block(b) for b in blocks.blocks],
                             stop_reason, stop_sequence, _usage(reply))
        return web.Response(body=_encoder.encode(message), content_type="application/json")

    async def stream(self, run: GenerationRun, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        reply = Reply()
        blocks = ReplyBlocks(self.prepared.tools)
        # What is cached of the prompt is known later: message_delta's usage says.
        await _send(resp, MessageStart(MessageOut(run.id, run.model, [], None, None,
                                                  MessageUsage(len(self.prepared.prompts[0]),
                                                               0))))
        await _send(resp, Ping())
        async for _, out in run.outputs():
            reply.update(out)
            error = failure(out) if out.finished else None
            if error is not None:
                await _send(resp, ErrorEvent(_error_detail(error)))
                return resp
            for piece in blocks.feed(out.text, final=out.finished):
                await _send(resp, _block_event(piece))
        stop_reason, stop_sequence = _stop(reply, blocks)
        usage = _usage(reply)
        await _send(resp, MessageDelta(StopDelta(stop_reason, stop_sequence), DeltaUsage(
            usage.output_tokens, usage.input_tokens, usage.cache_read_input_tokens)))
        await _send(resp, MessageStop())
        return resp


async def _send(resp: web.StreamResponse, event: StreamEvent) -> None:
    tag = type(event).__struct_config__.tag
    await resp.write(b"event: " + tag.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n")


def _block_event(piece: BlockEvent) -> StreamEvent:
    block = piece.block
    if piece.kind == "open":
        start = ToolUseOut(block.call_id, block.name, {}) if block.kind == CALL else TextOut("")
        return ContentBlockStart(block.index, start)
    if piece.kind == "delta":
        delta = InputJsonDelta(piece.text) if block.kind == CALL else TextDelta(piece.text)
        return ContentBlockDelta(block.index, delta)
    return ContentBlockStop(block.index)


def _block(block: Block) -> BlockOut:
    if block.kind != CALL:
        return TextOut(block.text)
    try:
        arguments = json.loads(block.text)
    except json.JSONDecodeError:
        arguments = None     # a call cut short by max_tokens (stop_reason says so)
    return ToolUseOut(block.call_id, block.name, arguments if isinstance(arguments, dict) else {})


def _stop(reply: Reply, blocks: ReplyBlocks) -> tuple[str, str | None]:
    if reply.finish_reason == "length":
        return "max_tokens", None
    if isinstance(reply.stop_reason, str):
        return "stop_sequence", reply.stop_reason
    if blocks.has_calls:
        return "tool_use", None
    return "end_turn", None


def _usage(reply: Reply) -> MessageUsage:
    return MessageUsage(reply.prompt_tokens - reply.cached_tokens, reply.output_tokens,
                        reply.cached_tokens)
