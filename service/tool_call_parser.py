"""Turning a reply's text into content and OpenAI tool calls as it arrives.

A call streams as OpenAI streams one: a first delta with its index, id and
function name (arguments ""), as soon as the name is complete; then the
arguments' JSON text piece by piece while the model writes it. Content is
held back while it may still be the start of a call (a partial
``<tool_call>``, an opening ``{`` in the Llama 3 format), so no text that
belongs to a call is ever sent as content. Fed the whole reply at once the
parser gives the non-streaming answer, so both agree.

When a text is a call: in ``hermes``, a ``<tool_call>`` block whose JSON
object has a string ``name``; in ``llama3_json``, a reply that starts with a
JSON object (after an optional ``<|python_tag|>``) whose ``name`` is one of
the tools (a bare ``{`` is weak evidence: an answer may be JSON too); in
``generic``, a member of ``tool_calls``. A block that turns out to be no
call before its name is complete stays content. Arguments are the JSON text
the model wrote for ``arguments`` (``parameters`` in Llama 3; a JSON string
there is decoded); a call cut short by ``max_tokens`` keeps what was written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from service.json_scan import ObjectScan
from service.tool_calls import HERMES, LLAMA3_JSON, ToolPlan, new_call_id

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_SPACE = " \t\r\n"


@dataclass(slots=True)
class CallDelta:
    """A piece of the call at ``index``: its first piece carries ``id`` and
    ``name``; every piece may carry more of the arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParserDelta:
    """New content and call pieces; ``order`` holds both as the reply wrote
    them (a text is a ``str``), for answers that keep text and calls apart
    as blocks (service/reply.py)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    order: list[str | CallDelta] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.order:
            self.order = ([self.content] if self.content else []) + list(self.calls)

    def add_text(self, text: str) -> None:
        if text:
            self.content += text
            self.order.append(text)

    def add_calls(self, calls: list[CallDelta]) -> None:
        self.calls += calls
        self.order += calls

    def extend(self, other: "ParserDelta") -> "ParserDelta":
        self.content += other.content
        self.calls += other.calls
        self.order += other.order
        return self


def merge_calls(deltas: list[CallDelta]) -> list[ParsedCall]:
    """Whole calls from their pieces, in index order."""
    calls: dict[int, ParsedCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ParsedCall(d.index, "", "", ""))
        call.id = d.id or call.id
        call.name = d.name or call.name
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def coalesce(deltas: list[CallDelta]) -> list[CallDelta]:
    """One piece per call (pieces of one call merged, in order), for one chunk."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            last.id, last.name = last.id or d.id, last.name or d.name
            last.arguments += d.arguments
        else:
            out.append(CallDelta(d.index, d.id, d.name, d.arguments))
    return out


class _CallStream:
    """One call's JSON object in ``text`` from ``start``: says when it is a
    call and hands out its arguments text as it grows."""

    def __init__(self, index: int, start: int, args_key: str) -> None:
        self.index = index
        self.scan = ObjectScan(start)
        self.args_key = args_key
        self.name: str | None = None     # set once the first delta has gone out
        self.sent = 0                    # characters of the arguments text sent

    def name_so_far(self, text: str) -> str | None | bool:
        """The complete name; None while it may still come; False if this is no call."""
        name = self.scan.complete_value(text, "name")
        if isinstance(name, str):
            return name
        if "name" in self.scan.members and self.scan.members["name"].end is not None:
            return False            # a name that is not a string
        return False if (self.scan.done or self.scan.broken) else None

    def _arguments(self, text: str) -> str | None:
        key = self.args_key if self.args_key in self.scan.members else "arguments"
        raw = self.scan.value_text(text, key)
        if raw is None or not raw.startswith('"'):
            return raw
        return _json_string_prefix(raw[1:])[0]   # arguments written as a JSON string

    def advance(self, text: str, name: str | None = None) -> list[CallDelta]:
        """New pieces; ``name`` (once known to be a call) opens it."""
        out = []
        if self.name is None:
            if name is None:
                return out
            self.name = name
            out.append(CallDelta(self.index, new_call_id(), name, ""))
        arguments = self._arguments(text) or ""
        if self.scan.done and not arguments and self.args_key not in self.scan.members \
                and "arguments" not in self.scan.members:
            arguments = "{}"        # a call without arguments takes none
        if len(arguments) > self.sent:
            out.append(CallDelta(self.index, arguments=arguments[self.sent:]))
            self.sent = len(arguments)
        return out


class ToolCallParser:
    """``feed`` returns what can be told now, ``finish`` the rest."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.pos = 0                         # text before pos is dealt with
        self.num_calls = 0
        self.call: _CallStream | None = None
        self.mode: str | None = None         # llama3 / generic: decided by the first text
        self.streamed = 0                    # generic: characters of the response sent

    def feed(self, text: str) -> ParserDelta:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> ParserDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParserDelta:
        if self.plan.format == HERMES:
            return self._hermes(final)
        if self.plan.format == LLAMA3_JSON:
            return self._llama(final)
        return self._generic(final)

    def _new_call(self, start: int, args_key: str = "arguments") -> _CallStream:
        self.call = _CallStream(self.num_calls, start, args_key)
        return self.call

    def _open_call(self, name: str, text: str | None = None) -> list[CallDelta]:
        self.num_calls += 1
        return self.call.advance(self.text if text is None else text, name)

    # ------------------------------------------------------------ hermes
    def _hermes(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        while True:
            text = self.text
            if self.call is None:
                at = text.find(_OPEN, self.pos)
                if at < 0:
                    keep = 0 if final else _partial_suffix(text[self.pos:], _OPEN)
                    cut = len(text) - keep
                    out.add_text(self._between_calls(text[self.pos:cut]))
                    self.pos = cut
                    return out
                out.add_text(self._between_calls(text[self.pos:at]))
                self.pos = at
                self._new_call(at + len(_OPEN))
            call = self.call
            # The block ends at </tool_call> (even where the model left its
            # object open); a partial marker at the end is held back.
            close = text.find(_CLOSE, self.pos + len(_OPEN))
            body_end = close if close >= 0 else (
                len(text) if final else len(text) - _partial_suffix(text, _CLOSE))
            body = text[:body_end]
            call.scan.advance(body)
            if call.name is None:
                name = call.name_so_far(body)
                if isinstance(name, str):
                    out.add_calls(self._open_call(name, body))
            else:
                out.add_calls(call.advance(body))
            if close < 0 and not final:
                return out
            end = len(text) if close < 0 else close + len(_CLOSE)
            if call.name is None:    # not a call after all: the block is content
                out.add_text(text[self.pos:end])
            self.pos, self.call = end, None
            if close < 0:
                return out

    def _between_calls(self, text: str) -> str:
        # The newlines between calls are layout, not content.
        return text if self.num_calls == 0 or text.strip(_SPACE) else ""

    # ------------------------------------------------------------- llama
    def _llama(self, final: bool) -> ParserDelta:
        text = self.text
        if self.mode is None:
            head = text.lstrip(_SPACE)
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG):].lstrip(_SPACE)
            elif _PYTHON_TAG.startswith(head) and not final:
                return ParserDelta()     # nothing yet, or a partial tag
            if not head and not final:
                return ParserDelta()
            self.mode = "calls" if head.startswith("{") else "content"
            self.pos = len(text) - len(head) if self.mode == "calls" else 0
        out = ParserDelta()
        if self.mode == "calls":
            out.add_calls(self._llama_calls(text, final))
        if self.mode == "content":
            out.add_text(text[self.pos:])
            self.pos = len(text)
        return out

    def _llama_calls(self, text: str, final: bool) -> list[CallDelta]:
        calls: list[CallDelta] = []
        while True:
            if self.call is None:
                start = _skip(text, self.pos, _SPACE + ";")
                if start < len(text) and text[start] != "{":
                    self.mode, self.pos = "content", start   # text after the calls
                if start == len(text) or self.mode != "calls":
                    return calls
                self.pos = start
                self._new_call(start, "parameters")
            call = self.call
            call.scan.advance(text)
            if call.name is None:
                name = call.name_so_far(text)
                if name is None and final:
                    name = False
                if name is False or (isinstance(name, str) and name not in self.plan.functions):
                    # No call: content from here (from the start if no call went out).
                    self.mode, self.call = "content", None
                    self.pos = self.pos if self.num_calls else 0
                    return calls
                if name is None:
                    return calls
                calls += self._open_call(name)
            else:
                calls += call.advance(text)
            if call.scan.broken:
                self.mode, self.call = "ended", None   # a call gone wrong ends the reply
                return calls
            if not call.scan.done:
                return calls
            self.pos, self.call = call.scan.end, None

    # ----------------------------------------------------------- generic
    _RESPONSE = '{"response": "'
    _CALLS = '{"tool_calls": ['

    def _generic(self, final: bool) -> ParserDelta:
        text = self.text
        if self.mode is None:
            for mode, head in (("string", self._RESPONSE), ("calls", self._CALLS)):
                if text.startswith(head):
                    self.mode, self.pos = mode, len(head)
            if self.mode is None and (final or not (self._RESPONSE.startswith(text)
                                                    or self._CALLS.startswith(text))):
                self.mode = "json"
        if self.mode == "string":
            decoded, _, _ = _json_string_prefix(text[self.pos:])
            new, self.streamed = decoded[self.streamed:], len(decoded)
            return ParserDelta(content=new)
        if self.mode == "calls":
            out = self._generic_calls(text)
            if final and self.num_calls == 0:
                out.add_text(text)      # cut short before a call's name: as written
            return out
        if not final:
            return ParserDelta()
        # Another layout (an answer under a response_format that is not a
        # string, or text outside the grammar): judged whole.
        obj = _loads(text)
        calls = obj.get("tool_calls") if isinstance(obj, dict) else None
        if isinstance(calls, list) and calls and all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return ParserDelta(calls=[
                CallDelta(i, new_call_id(), c["name"],
                          json.dumps(c.get("arguments", {}), ensure_ascii=False))
                for i, c in enumerate(calls)])
        if isinstance(obj, dict) and "response" in obj:
            answer = obj["response"]
            return ParserDelta(answer if isinstance(answer, str)
                               else json.dumps(answer, ensure_ascii=False))
        return ParserDelta(text)

    def _generic_calls(self, text: str) -> ParserDelta:
        out = ParserDelta()
        while True:
            if self.call is None:
                start = _skip(text, self.pos, _SPACE + ",")
                if start == len(text) or text[start] != "{":
                    self.pos = start
                    return out
                self._new_call(start)
            call = self.call
            call.scan.advance(text)
            if call.name is None:
                name = call.name_so_far(text)
                if not isinstance(name, str):
                    if name is False:
                        self.pos, self.call = len(text), None
                    return out
                out.add_calls(self._open_call(name))
            else:
                out.add_calls(call.advance(text))
            if not call.scan.done:
                return out
            self.pos, self.call = call.scan.end, None


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_string_prefix(body: str) -> tuple[str, int, bool]:
    """Decode the complete part of a JSON string body (after its opening
    quote): (text, characters used, whether the closing quote was seen)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            break
        if body[i + 1] != "u":
            out.append(json.loads(f'"{body[i:i + 2]}"'))
            i += 2
            continue
        width = 6
        if i + 6 <= len(body) and 0xD800 <= int(body[i + 2:i + 6], 16) < 0xDC00:
            width = 12      # a surrogate pair
        if i + width > len(body):
            break
        out.append(json.loads(f'"{body[i:i + width]}"'))
        i += width
    return "".join(out), i, False
