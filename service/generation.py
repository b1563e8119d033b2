"""Completions and chat completions: run a prepared request on the engine and
answer it as one JSON body or as a server-sent event stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from backends.errors import BatonError, InvalidRequestError
from backends.interface import TokenLogprobs
from scheduler.async_engine import AsyncEngine
from scheduler.outputs import RequestOutput
from scheduler.request import FinishReason
from service.http_errors import APIError, from_invalid_request
from service.openai_requests import PreparedRequest
from service.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                              ChatCompletionResponse, ChatDelta, ChatLogprobs,
                              ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
                              CompletionChunk, CompletionLogprobs, CompletionResponse,
                              DeltaFunction, DeltaToolCall, ErrorBody, ErrorResponse,
                              PromptTokensDetails, ToolCallFunction, ToolCallOut, TopLogprob,
                              Usage)
from service.tool_call_parser import CallDelta, ToolCallParser, coalesce, merge_calls

_encoder = msgspec.json.Encoder()
# Response ids as each API writes them (PreparedRequest.kind -> prefix).
_ID_PREFIXES = {"chat": "chatcmpl-", "text_completion": "cmpl-", "response": "resp_",
                "message": "msg_"}


def client_finish_reason(reason: str | None) -> str | None:
    # OpenAI clients know stop and length; a request cut by its time limit
    # ends with what it has, which is what "length" tells them.
    return "length" if reason == FinishReason.TIMEOUT.value else reason


@dataclass(slots=True)
class Choice:
    text: str = ""
    num_tokens: int = 0  # the ids themselves are the engine's (Request.output_token_ids)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_type: str | None = None


class GenerationRun:
    """The engine requests behind one HTTP request (prompts x n choices)."""

    def __init__(self, engine: AsyncEngine, prepared: PreparedRequest, model: str,
                 timeout: float | None, telemetry=None) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.prepared = prepared
        self.model = model
        self.timeout = timeout
        self.id = f"{_ID_PREFIXES[prepared.kind]}{prepared.request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.request_ids: list[str] = []
        self.index_of: dict[str, int] = {}
        self._streams: list = []

    def start(self) -> None:
        """Queue every choice; all or nothing, so a bad prompt leaves nothing behind."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        p = self.prepared
        try:
            for i, prompt in enumerate(p.prompts):
                for j in range(p.n):
                    params = p.params
                    if p.n > 1 and params.seed is not None:
                        # n seeded choices: reproducible, yet not n copies
                        # (wrapping within the signed 64-bit range of a seed).
                        seed = (params.seed + j + 2**63) % 2**64 - 2**63
                        params = dataclasses.replace(params, seed=seed)
                    rid = f"{self.id}-{i * p.n + j}"
                    self.engine.add_request(prompt, params, rid, queue, p.priority)
                    self.request_ids.append(rid)
                    self.index_of[rid] = i * p.n + j
        except BaseException:
            for rid in self.request_ids:
                self.engine.abort(rid)
            raise
        if self.telemetry is not None:
            self.telemetry.started(self.id, self.request_ids, len(self.request_ids))

    async def outputs(self):
        """(choice index, RequestOutput) until every choice has finished; on
        the time limit, unfinished choices end with what they have."""
        stream = self.engine.stream_group(self.request_ids)
        self._streams.append(stream)
        # A timer, not wait_for around the stream: cancelling the stream's
        # pending get would close it and lose the final (timed-out) outputs.
        timer = None if self.timeout is None else \
            asyncio.get_running_loop().call_later(self.timeout, self._time_out)
        try:
            telemetry = self.telemetry
            async for out in stream:
                index = self.index_of[out.request_id]
                if telemetry is not None:
                    telemetry.on_output(index, out)
                yield index, out
        finally:
            if timer is not None:
                timer.cancel()
            await stream.aclose()

    async def close(self) -> None:
        """Abort whatever is unfinished now, rather than whenever the
        abandoned stream is garbage-collected (a disconnect mid-write)."""
        for stream in self._streams:
            await stream.aclose()
        for rid in self.request_ids:
            self.engine.abort(rid)

    def _time_out(self) -> None:
        for rid in self.request_ids:
            self.engine.abort(rid, FinishReason.TIMEOUT)


def make_usage(prompt_tokens: list[int], cached_tokens: list[int],
               completion_tokens: int) -> Usage:
    """Usage of one response: each prompt counted once (its first choice),
    however many choices it has; cached tokens as OpenAI reports them."""
    prompt = sum(prompt_tokens)
    return Usage(prompt, completion_tokens, prompt + completion_tokens,
                 PromptTokensDetails(sum(cached_tokens)))


# ------------------------------------------------------------------ logprobs

def _token_text(engine: AsyncEngine, token_id: int) -> str:
    return engine.tokenizer.token_bytes_text(token_id)


def completion_logprobs(engine: AsyncEngine, entries: list[TokenLogprobs],
                        offset: int, echo_prompt: list[int] | None = None,
                        prompt_entries: list[TokenLogprobs] | None = None
                        ) -> CompletionLogprobs:
    """OpenAI's legacy logprobs. With ``echo_prompt`` the prompt's tokens come
    first: the first has no logprob (nothing precedes it), the rest carry
    ``prompt_entries``."""
    tokens, values, tops, offsets = [], [], [], []

    def add(token_id: int, logprob: float | None, top) -> None:
        nonlocal offset
        text = _token_text(engine, token_id)
        tokens.append(text)
        values.append(logprob)
        tops.append({_token_text(engine, t): v for t, v in top} if top else None)
        offsets.append(offset)
        offset += len(text)

    if echo_prompt:
        add(echo_prompt[0], None, None)
        for entry in prompt_entries or []:
            add(entry.token_id, entry.logprob, entry.top)
    for entry in entries:
        add(entry.token_id, entry.logprob, entry.top)
    return CompletionLogprobs(tokens, values, tops, offsets)


def chat_logprobs(engine: AsyncEngine, entries: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text = _token_text(engine, entry.token_id)
        top = [TopLogprob(_token_text(engine, t), v, list(_token_text(engine, t).encode()))
               for t, v in entry.top]
        content.append(ChatTokenLogprob(text, entry.logprob, list(text.encode()), top))
    return ChatLogprobs(content)


# ------------------------------------------------------------ non-streaming

async def respond_whole(run: GenerationRun) -> web.Response:
    p = run.prepared
    choices = [Choice() for _ in range(len(p.prompts) * p.n)]
    async for index, out in run.outputs():
        c = choices[index]
        c.text += out.text
        c.num_tokens += len(out.new_token_ids)
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.num_prompt_tokens = out.num_prompt_tokens
        c.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            c.finish_reason = out.finish_reason
            c.error = out.error
            c.error_type = out.error_type
    failed = next((c for c in choices if c.finish_reason == FinishReason.ERROR.value), None)
    if failed is not None:
        raise APIError(500, failed.error or "engine fault",
                       error_type=failed.error_type or "internal_error", code=failed.error_type)
    if any(c.finish_reason == FinishReason.ABORT.value for c in choices):
        # Only the server aborts a request whose client is still here: shutdown.
        raise APIError(503, "the server shut down before the request finished")
    firsts = [choices[i * p.n] for i in range(len(p.prompts))]
    usage = make_usage([c.num_prompt_tokens for c in firsts],
                       [c.num_cached_tokens for c in firsts],
                       sum(c.num_tokens for c in choices))
    if p.kind == "chat":
        out = []
        for i, c in enumerate(choices):
            message, finish = _chat_message(p, c)
            out.append(ChatChoice(i, message, chat_logprobs(run.engine, c.logprobs)
                                  if p.num_logprobs is not None else None, finish))
        body = ChatCompletionResponse(run.id, run.created, run.model, out, usage)
    else:
        out_choices = []
        for i, c in enumerate(choices):
            prefix = p.prompt_texts[i // p.n] if p.echo else ""
            logprobs = None
            if p.num_logprobs is not None:
                logprobs = completion_logprobs(
                    run.engine, c.logprobs, 0,
                    p.prompts[i // p.n] if p.echo else None, c.prompt_logprobs)
            out_choices.append(CompletionChoice(i, prefix + c.text, logprobs,
                                                client_finish_reason(c.finish_reason)))
        body = CompletionResponse(run.id, run.created, run.model, out_choices, usage)
    return web.Response(body=_encoder.encode(body), content_type="application/json")


def _chat_message(p: PreparedRequest, c: Choice) -> tuple[ChatResponseMessage, str | None]:
    finish = client_finish_reason(c.finish_reason)
    if p.tools is None:
        return ChatResponseMessage("assistant", c.text), finish
    parser = ToolCallParser(p.tools)
    reply = parser.feed(c.text).extend(parser.finish())
    calls, content = merge_calls(reply.calls), reply.content
    if not calls:
        return ChatResponseMessage("assistant", content), finish
    tool_calls = [ToolCallOut(call.id, ToolCallFunction(call.name, call.arguments))
                  for call in calls]
    return (ChatResponseMessage("assistant", content.strip() or None, tool_calls),
            tool_finish_reason(finish))


def tool_finish_reason(finish: str | None) -> str | None:
    # A reply that ended by itself after calling tools waits for their results.
    return "tool_calls" if finish == "stop" else finish


def _delta_calls(calls: list[CallDelta]) -> list[DeltaToolCall] | None:
    """A chunk's tool-call deltas, one per call: a call's first carries its
    id, type and name, every one the next piece of its arguments."""
    if not calls:
        return None
    return [DeltaToolCall(c.index, c.id, "function" if c.id else None,
                          DeltaFunction(c.name, c.arguments))
            for c in coalesce(calls)]


# ---------------------------------------------------------------- streaming

async def _send(resp: web.StreamResponse, payload) -> None:
    await resp.write(b"data: " + _encoder.encode(payload) + b"\n\n")


async def respond_stream(run: GenerationRun, request: web.Request) -> web.StreamResponse:
    p = run.prepared
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    num_choices = len(p.prompts) * p.n
    chat = p.kind == "chat"
    offsets = [0] * num_choices
    echo_pending = [p.echo] * num_choices
    prompt_tokens = [0] * num_choices
    cached_tokens = [0] * num_choices
    completion_tokens = 0
    parsers = [ToolCallParser(p.tools) if p.tools is not None else None
               for _ in range(num_choices)]
    called = [False] * num_choices
    if chat:
        for i in range(num_choices):
            await _send(resp, ChatCompletionChunk(run.id, run.created, run.model, [
                ChatChunkChoice(i, ChatDelta(role="assistant", content=""))]))
    async for index, out in run.outputs():
        prompt_tokens[index] = out.num_prompt_tokens
        cached_tokens[index] = out.num_cached_tokens
        completion_tokens += len(out.new_token_ids)
        running_usage = None
        if p.continuous_usage:
            firsts = range(0, num_choices, p.n)
            running_usage = make_usage([prompt_tokens[i] for i in firsts],
                                       [cached_tokens[i] for i in firsts], completion_tokens)
        if out.finish_reason in (FinishReason.ERROR.value, FinishReason.ABORT.value):
            error = ErrorBody(out.error or "engine fault", out.error_type or "internal_error",
                              None, out.error_type) \
                if out.finish_reason == FinishReason.ERROR.value else \
                ErrorBody("the server shut down before the request finished",
                          "service_unavailable", None, None)
            await _send(resp, ErrorResponse(error))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        text, calls = out.text, None
        parser = parsers[index]
        if parser is not None:
            delta = parser.feed(text)
            if out.finished:
                delta.extend(parser.finish())
            text, calls = delta.content, _delta_calls(delta.calls)
            called[index] = called[index] or bool(calls)
        if (not text and not calls and not out.finished and p.num_logprobs is None
                and not (p.echo and echo_pending[index])):
            continue  # a token that completes no character yet
        finish = client_finish_reason(out.finish_reason) if out.finished else None
        if called[index]:
            finish = tool_finish_reason(finish)
        if chat:
            logprobs = chat_logprobs(run.engine, out.logprobs) \
                if p.num_logprobs is not None and out.logprobs else None
            chunk = ChatCompletionChunk(run.id, run.created, run.model, [
                ChatChunkChoice(index, ChatDelta(content=text if text or not calls else None,
                                                 tool_calls=calls), logprobs, finish)],
                running_usage)
        else:
            # echo: the prompt goes out with the first delta, with its logprobs
            echo = p.prompts[index // p.n] if echo_pending[index] else None
            text = (p.prompt_texts[index // p.n] if echo else "") + out.text
            echo_pending[index] = False
            logprobs = completion_logprobs(run.engine, out.logprobs or [], offsets[index], echo,
                                           out.prompt_logprobs) \
                if p.num_logprobs is not None else None
            offsets[index] += len(text)
            chunk = CompletionChunk(run.id, run.created, run.model, [
                CompletionChoice(index, text, logprobs, finish)], running_usage)
        await _send(resp, chunk)
    if p.include_usage:
        firsts = range(0, num_choices, p.n)
        usage = make_usage([prompt_tokens[i] for i in firsts], [cached_tokens[i] for i in firsts],
                           completion_tokens)
        cls = ChatCompletionChunk if chat else CompletionChunk
        await _send(resp, cls(run.id, run.created, run.model, [], usage))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def start_run(engine: AsyncEngine, prepared: PreparedRequest, model: str,
              timeout: float | None, telemetry=None) -> GenerationRun:
    run = GenerationRun(engine, prepared, model, timeout, telemetry)
    try:
        run.start()
    except InvalidRequestError as exc:
        raise from_invalid_request(exc) from exc
    except BatonError as exc:
        raise APIError(503, str(exc)) from exc
    return run
