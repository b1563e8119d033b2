"""One reply of a single-choice generation run, for the APIs that answer in
blocks of text and tool calls: the Responses API's output items and the
Anthropic Messages API's content blocks (service/responses_api.py,
service/messages_api.py). The chat and completions APIs answer in choices
instead (service/generation.py).

``ReplyBlocks`` turns the reply's text, as it arrives, into blocks that
open, grow and close in order (never two open at once; a block's index is
its place in the reply), using the chat path's ToolCallParser for the tool
format. Whitespace-only text before, between or after calls is layout, not
a block. Fed the whole reply at once it yields the same blocks as fed piece
by piece, so a streamed answer and a whole one agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.interface import TokenLogprobs
from scheduler.outputs import RequestOutput
from scheduler.request import FinishReason
from service.generation import GenerationRun, client_finish_reason
from service.http_errors import APIError
from service.tool_call_parser import ParserDelta, ToolCallParser
from service.tool_calls import ToolPlan

TEXT, CALL = "text", "call"


@dataclass(slots=True)
class Block:
    """A text block (``text``) or a tool call (``text`` is its arguments JSON)."""

    kind: str
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class BlockEvent:
    """``open`` (with the block), ``delta`` (``text``: new text or arguments),
    ``close``."""

    kind: str
    block: Block
    text: str = ""


class ReplyBlocks:
    def __init__(self, plan: ToolPlan | None) -> None:
        self._parser = ToolCallParser(plan) if plan is not None else None
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._held = ""          # whitespace not yet known to be content

    @property
    def has_calls(self) -> bool:
        return any(b.kind == CALL for b in self.blocks)

    def feed(self, text: str, final: bool = False) -> list[BlockEvent]:
        """Events for the next piece of the reply; ``final``: it has ended
        (every block is closed then)."""
        if self._parser is None:
            delta = ParserDelta(content=text)
        else:
            delta = self._parser.feed(text)
            if final:
                delta.extend(self._parser.finish())
        events: list[BlockEvent] = []
        for piece in delta.order:     # text and calls in the order the reply wrote them
            if isinstance(piece, str):
                self._text(piece, events)
            else:
                self._call(piece, events)
        if final:
            if self._held and not self.has_calls:   # a reply of whitespace alone
                self._open_text(self._held, events)
            self._held = ""
            self._close(events)
        return events

    def empty_text_block(self) -> list[BlockEvent]:
        """A reply with no block at all gets one empty text block (for APIs
        whose answer always holds a message)."""
        if self.blocks:
            return []
        block = self._new(TEXT)
        self._open = None
        return [BlockEvent("open", block), BlockEvent("close", block)]

    def _text(self, text: str, events: list[BlockEvent]) -> None:
        if not text:
            return
        if self._open is not None and self._open.kind == TEXT:
            self._open.text += text
            events.append(BlockEvent("delta", self._open, text))
            return
        pending, self._held = self._held + text, ""
        if not pending.strip():
            self._held = pending
            return
        if self.has_calls:
            pending = pending.lstrip()   # the layout after a call is not content
        self._open_text(pending, events)

    def _open_text(self, text: str, events: list[BlockEvent]) -> None:
        self._close(events)
        block = self._new(TEXT)
        events.append(BlockEvent("open", block))
        block.text = text
        events.append(BlockEvent("delta", block, text))

    def _call(self, call, events: list[BlockEvent]) -> None:
        if call.id is not None:
            self._held = ""
            self._close(events)
            block = self._new(CALL)
            block.call_id, block.name = call.id, call.name
            events.append(BlockEvent("open", block))
        block = self._open
        if call.arguments and block is not None:
            block.text += call.arguments
            events.append(BlockEvent("delta", block, call.arguments))

    def _new(self, kind: str) -> Block:
        block = Block(kind, len(self.blocks))
        self.blocks.append(block)
        self._open = block
        return block

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", self._open))
            self._open = None


# ------------------------------------------------------------------- the run

@dataclass(slots=True)
class Reply:
    """What one run produced, with the numbers its usage block needs."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None     # as OpenAI clients know it (stop, length)
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def update(self, out: RequestOutput) -> None:
        self.text += out.text
        self.output_tokens += len(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = client_finish_reason(out.finish_reason)
            self.stop_reason = out.stop_reason


def failure(out: RequestOutput) -> APIError | None:
    """The error a finished output stands for: an engine fault (500) or a
    shutdown that aborted it (503); None for a normal end."""
    if out.finish_reason == FinishReason.ERROR.value:
        return APIError(500, out.error or "engine fault", error_type="internal_error")
    if out.finish_reason == FinishReason.ABORT.value:
        # Only the server aborts a request whose client is still here: shutdown.
        return APIError(503, "the server shut down before the request finished")
    return None


async def collect_reply(run: GenerationRun) -> Reply:
    """The whole reply of a one-choice run; raises the APIError of a failed one."""
    reply = Reply()
    async for _, out in run.outputs():
        reply.update(out)
        if out.finished and (error := failure(out)) is not None:
            raise error
    return reply
