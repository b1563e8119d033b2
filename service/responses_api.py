"""POST /v1/responses (the OpenAI Responses API), answered whole or as its
typed event stream, and the stored responses behind ``previous_response_id``.

One request model underneath: the request is translated into a chat
completion request (service/responses_input.py) and prepared by the chat
path (service/openai_requests.py): the same chat template, tool plan,
structured outputs and sampling; the same engine run. Only the answer is
the Responses API's: output items (a message per text block, a
function_call per tool call; service/reply.py) and, streamed, the events

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta ...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

each with its ``sequence_number`` (0, 1, 2 ... in stream order).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import msgspec
from aiohttp import web

from backends.tokenizer import Tokenizer
from service.generation import GenerationRun, chat_logprobs
from service.http_errors import APIError
from service.admission import PromptLimits
from service.openai_requests import ChatOptions, PreparedRequest, prepare_chat
from service.reply import CALL, Block, BlockEvent, Reply, ReplyBlocks, collect_reply, failure
from service.responses_input import (PARAM_NAMES, chat_request, check_fields, echo_text,
                                     wants_logprobs)
from service.responses_protocol import (ContentPartAdded, ContentPartDone, DeletedResponse,
                                        FunctionCallArgumentsDelta, FunctionCallArgumentsDone,
                                        FunctionCallItem, IncompleteDetails, InputItem,
                                        InputPart, InputTokensDetails, MessageItem,
                                        OutputFunctionCall, OutputItem, OutputItemAdded,
                                        OutputItemDone, OutputMessage, OutputText,
                                        OutputTextDelta, OutputTextDone, OutputTokensDetails,
                                        Response, ResponseCompleted, ResponseCreated,
                                        ResponseError, ResponseEvent, ResponseFailed,
                                        ResponseIncomplete, ResponseInProgress,
                                        ResponsesRequest, ResponseUsage, parse_input_items)
from service.responses_store import ResponsesStore

_encoder = msgspec.json.Encoder()
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id {response_id!r} not found.", param=param,
                    code="previous_response_not_found" if param else None,
                    error_type="invalid_request_error")


class ResponsesTurn:
    """One POST /v1/responses: ``prepare`` runs on a preprocessing thread,
    ``whole`` or ``stream`` on the event loop once the run has started."""

    param_names = PARAM_NAMES

    def __init__(self, store: ResponsesStore) -> None:
        self.store = store
        self.created = int(time.time())
        self.req: ResponsesRequest | None = None
        self.prepared: PreparedRequest | None = None
        self.conversation: tuple[InputItem, ...] = ()
        self.item_ids: dict[int, str] = {}      # block index -> output item id

    # ------------------------------------------------------------- prepare
    def prepare(self, req: ResponsesRequest, tokenizer: Tokenizer, defaults,
                chat: ChatOptions | None = None,
                limits: PromptLimits | None = None) -> PreparedRequest:
        self.req = req
        check_fields(req, self.store)
        previous: tuple[InputItem, ...] = ()
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id)
            if entry is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            previous = entry.conversation
        self.conversation = previous + tuple(parse_input_items(req.input))
        if not self.conversation:
            raise APIError(400, "input must not be empty", param="input")
        prepared = prepare_chat(chat_request(req, self.conversation), tokenizer, defaults, chat,
                                limits)
        spec = prepared.params.structured
        if spec is not None and spec.param in PARAM_NAMES:   # compiled later, named ours
            prepared.params = dataclasses.replace(prepared.params, structured=dataclasses.replace(
                spec, param=PARAM_NAMES[spec.param]))
        prepared.kind = "response"
        self.prepared = prepared
        return prepared

    @property
    def stores(self) -> bool:
        return self.store.enabled and self.req.store is not False

    # --------------------------------------------------------------- whole
    async def whole(self, run: GenerationRun) -> web.Response:
        reply = await collect_reply(run)
        blocks = ReplyBlocks(self.prepared.tools)
        blocks.feed(reply.text, final=True)
        blocks.empty_text_block()
        status = _status(reply)
        items = [self._item(run, b, _item_status(b, blocks, status), reply) for b in blocks.blocks]
        response = self._response(run, status, items, reply)
        self._keep(response, items)
        return web.Response(body=_encoder.encode(response), content_type="application/json")

    # -------------------------------------------------------------- stream
    async def stream(self, run: GenerationRun, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        events = _EventWriter(resp)
        started = self._response(run, "in_progress", [], None)
        await events.send(ResponseCreated, response=started)
        await events.send(ResponseInProgress, response=started)
        blocks = ReplyBlocks(self.prepared.tools)
        reply = Reply()
        items: list[OutputItem] = []
        async for _, out in run.outputs():
            reply.update(out)
            error = failure(out) if out.finished else None
            if error is not None:
                failed = self._response(run, "failed", items, reply)
                failed.error = ResponseError("server_error" if error.status == 500
                                             else "service_unavailable", error.message)
                await events.send(ResponseFailed, response=failed)
                return resp
            logprobs = self._logprobs(run, out.logprobs) if out.logprobs else []
            pieces = blocks.feed(out.text, final=out.finished)
            if out.finished:
                pieces += blocks.empty_text_block()
            status = _status(reply) if out.finished else "in_progress"
            for piece in pieces:
                await self._send_block(events, run, piece, blocks, status, reply, logprobs,
                                       items)
                logprobs = []     # a piece's tokens go with its first text delta
        status = _status(reply)
        final = self._response(run, status, items, reply)
        self._keep(final, items)
        await events.send(ResponseCompleted if status == "completed" else ResponseIncomplete,
                          response=final)
        return resp

    async def _send_block(self, events: "_EventWriter", run: GenerationRun, piece: BlockEvent,
                          blocks: ReplyBlocks, status: str, reply: Reply, logprobs: list,
                          items: list[OutputItem]) -> None:
        block, index = piece.block, piece.block.index
        item_id = self._item_id(block)
        if piece.kind == "open":
            item = self._item(run, block, "in_progress", None)
            if block.kind != CALL:
                item.content = []
            await events.send(OutputItemAdded, output_index=index, item=item)
            if block.kind != CALL:
                await events.send(ContentPartAdded, item_id=item_id, output_index=index,
                                  content_index=0, part=OutputText(""))
        elif piece.kind == "delta" and block.kind == CALL:
            await events.send(FunctionCallArgumentsDelta, item_id=item_id, output_index=index,
                              delta=piece.text)
        elif piece.kind == "delta":
            await events.send(OutputTextDelta, item_id=item_id, output_index=index,
                              content_index=0, delta=piece.text, logprobs=logprobs)
        else:
            item = self._item(run, block, _item_status(block, blocks, status), reply)
            items.append(item)
            if block.kind == CALL:
                await events.send(FunctionCallArgumentsDone, item_id=item_id,
                                  output_index=index, name=block.name, arguments=block.text)
            else:
                part = item.content[0]
                await events.send(OutputTextDone, item_id=item_id, output_index=index,
                                  content_index=0, text=part.text, logprobs=part.logprobs)
                await events.send(ContentPartDone, item_id=item_id, output_index=index,
                                  content_index=0, part=part)
            await events.send(OutputItemDone, output_index=index, item=item)

    # ---------------------------------------------------------- the answer
    def _item_id(self, block: Block) -> str:
        if block.index not in self.item_ids:
            prefix = "fc" if block.kind == CALL else "msg"
            self.item_ids[block.index] = f"{prefix}_{uuid.uuid4().hex}"
        return self.item_ids[block.index]

    def _item(self, run: GenerationRun, block: Block, status: str,
              reply: Reply | None) -> OutputItem:
        if block.kind == CALL:
            return OutputFunctionCall(self._item_id(block), block.call_id, block.name,
                                      block.text, status)
        logprobs = self._logprobs(run, reply.logprobs) \
            if reply is not None and wants_logprobs(self.req) else []
        return OutputMessage(self._item_id(block), status, [OutputText(block.text,
                                                                       logprobs=logprobs)])

    def _logprobs(self, run: GenerationRun, entries) -> list:
        if not wants_logprobs(self.req):
            return []
        return chat_logprobs(run.engine, entries).content or []

    def _response(self, run: GenerationRun, status: str, items: list[OutputItem],
                  reply: Reply | None) -> Response:
        req, params = self.req, self.prepared.params
        usage = None
        if reply is not None and status != "in_progress":
            usage = ResponseUsage(reply.prompt_tokens, InputTokensDetails(reply.cached_tokens),
                                  reply.output_tokens, OutputTokensDetails(),
                                  reply.prompt_tokens + reply.output_tokens)
        return Response(
            id=run.id, created_at=self.created, model=run.model, status=status,
            output=list(items), instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=self.prepared.tools.parallel if self.prepared.tools is not None
            else req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, store=self.stores,
            temperature=params.temperature, top_p=params.top_p,
            tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
            tools=msgspec.to_builtins(req.tools or []), text=echo_text(req.text),
            metadata=req.metadata or {},
            reasoning=msgspec.to_builtins(req.reasoning) if req.reasoning else None,
            usage=usage, top_logprobs=req.top_logprobs, user=req.user,
            incomplete_details=IncompleteDetails("max_output_tokens")
            if status == "incomplete" else None)

    def _keep(self, response: Response, items: list[OutputItem]) -> None:
        """Store a finished response with its conversation (the outputs as
        input items), when the request and the server want it stored."""
        if not self.stores:
            return
        conversation = self.conversation + tuple(_as_input(item) for item in items)
        self.store.put(response.id, _encoder.encode(response), conversation,
                       len(_encoder.encode(conversation)))


def _status(reply: Reply) -> str:
    return "incomplete" if reply.finish_reason == "length" else "completed"


def _item_status(block: Block, blocks: ReplyBlocks, status: str) -> str:
    # The block that was cut by max_output_tokens is the last one.
    return "incomplete" if status == "incomplete" and block is blocks.blocks[-1] else "completed"


def _as_input(item: OutputItem) -> InputItem:
    if isinstance(item, OutputFunctionCall):
        return FunctionCallItem(call_id=item.call_id, name=item.name, arguments=item.arguments,
                                id=item.id)
    return MessageItem(role="assistant", id=item.id, content=[
        InputPart(type="output_text", text=part.text) for part in item.content])


class _EventWriter:
    """Server-sent events ``event: <type>`` / ``data: <JSON>``, numbered."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.sequence_number = 0

    async def send(self, event_type: type[ResponseEvent], **fields) -> None:
        event = event_type(sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        tag = event_type.__struct_config__.tag
        await self.resp.write(b"event: " + tag.encode() + b"\ndata: " + _encoder.encode(event)
                              + b"\n\n")


# ------------------------------------------------------- GET and DELETE by id

def _no_query(request: web.Request) -> None:
    if request.query:   # OpenAI's stream / include / starting_after replays: not kept
        names = ", ".join(sorted(request.query))
        raise APIError(400, f"query parameters are not supported on this route: {names}",
                       param=sorted(request.query)[0])


def stored_response(request: web.Request, store: ResponsesStore,
                    response_id: str) -> web.Response:
    _no_query(request)
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return web.Response(body=entry.response_json, content_type="application/json")


def delete_response(request: web.Request, store: ResponsesStore,
                    response_id: str) -> web.Response:
    _no_query(request)
    if not store.delete(response_id):
        raise not_found(response_id)
    return web.Response(body=_encoder.encode(DeletedResponse(response_id)),
                        content_type="application/json")
