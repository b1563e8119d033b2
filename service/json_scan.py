"""Following a JSON object's text as a model writes it, a character at a time.

``ObjectScan`` knows, for the object that starts at ``start`` in a growing
text, where each top-level member's value begins and (once written) ends, so
that a tool call's name can be read as soon as it is complete and its
arguments passed on piece by piece while they are still being written. It
checks the structure (strings, escapes, nesting, ``:`` and ``,`` between
members), not the grammar of the values: the parsed result is still judged
by ``json.loads`` where it matters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_SPACE = " \t\r\n"


@dataclass(slots=True)
class Member:
    key: str
    start: int              # offset of the value's first character
    end: int | None = None  # offset just past its last character, once complete


class ObjectScan:
    """Scans ``text[start:]``; call ``advance(text)`` each time the text has
    grown (always the whole text, of which earlier calls saw a prefix).

    ``done`` once the object's closing brace is read (``end`` is just past
    it); ``broken`` when the text stopped being a JSON object; neither
    changes afterwards.
    """

    def __init__(self, start: int = 0) -> None:
        self.pos = start
        self.state = "open"      # open, first, key, colon, value, after, done, broken
        self.members: dict[str, Member] = {}
        self.end: int | None = None
        self._key_start = 0
        self._key = ""
        self._current: Member | None = None
        self._depth = 0          # brackets open inside the current value
        self._in_string = False
        self._escape = False

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def broken(self) -> bool:
        return self.state == "broken"

    def value_text(self, text: str, key: str) -> str | None:
        """The raw text of ``key``'s value so far (trailing whitespace left
        out: it may still turn out to lie between members); None before it
        starts."""
        member = self.members.get(key)
        if member is None:
            return None
        end = member.end if member.end is not None else self.pos
        return text[member.start:end].rstrip(_SPACE)

    def complete_value(self, text: str, key: str):
        """``key``'s value parsed, once complete; None before (or if it is no JSON)."""
        member = self.members.get(key)
        if member is None or member.end is None:
            return None
        try:
            return json.loads(text[member.start:member.end])
        except json.JSONDecodeError:
            return None

    def advance(self, text: str) -> None:
        while self.pos < len(text) and self.state not in ("done", "broken"):
            self._step(text, text[self.pos])
            self.pos += 1

    def _step(self, text: str, c: str) -> None:
        state = self.state
        if state == "value":
            self._value_char(text, c)
        elif state == "key":
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                try:
                    self._key = json.loads(text[self._key_start:self.pos + 1])
                except json.JSONDecodeError:
                    self.state = "broken"
                    return
                self.state = "colon"
        elif c in _SPACE:
            return
        elif state == "open":
            self.state = "first" if c == "{" else "broken"
        elif state in ("first", "next"):
            if c == '"':
                self._key_start = self.pos
                self.state = "key"
            elif c == "}" and state == "first":
                self._close()
            else:
                self.state = "broken"
        elif state == "colon":
            self.state = "start" if c == ":" else "broken"
        elif state == "start":
            self._current = self.members[self._key] = Member(self._key, self.pos)
            self.state = "value"
            self._value_char(text, c)

    def _value_char(self, text: str, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            if self._depth:
                self._depth -= 1
                return
            self._end_value(text)
            if c == "}":
                self._close()
            else:
                self.state = "broken"
        elif c == "," and not self._depth:
            self._end_value(text)
            self.state = "next"

    def _end_value(self, text: str) -> None:
        member = self._current
        member.end = member.start + len(text[member.start:self.pos].rstrip(_SPACE))
        self._current = None

    def _close(self) -> None:
        self.state = "done"
        self.end = self.pos + 1

