"""Output token ids to streamed text, with stop strings.

Two stages, one class each:

- ``IncrementalDetokenizer`` turns token ids into text. Each push decodes only
  a short window of recent tokens and diffs it against the text that window
  had already produced (the prefix/read offset technique), so a push costs
  O(window), never O(output). It never releases half a character.
- ``StopStringMatcher`` cuts that text at the first stop string, holding back
  a tail that could still turn out to be the start of one.

No torch here: the only dependency is a ``tokenizers.Tokenizer``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

# What both tokenizer families decode an unfinished UTF-8 character to:
# byte-level BPE via lossy UTF-8 decoding, SentencePiece byte fallback with
# one U+FFFD per byte token of an invalid run.
_REPLACEMENT = "\ufffd"

# A character is at most 4 bytes, so with byte-sized tokens it completes
# within 4 tokens; tokens that straddle two characters (a BPE merge of the
# end of one CJK character with the start of the next) chain a little longer.
# Past this many unresolved tokens the bytes are taken to be invalid and are
# released as they decode (with U+FFFD), which keeps every decode bounded.
MAX_PENDING_TOKENS = 32

# Left context kept in front of the read offset. Decoders are not
# concatenative at the start of a sequence (SentencePiece strips the first
# space), so the window always keeps the last read tokens as context and
# slides once this many have piled up.
PREFIX_WINDOW_TOKENS = 8


class DetokenizerFinishedError(RuntimeError):
    """``push`` after a stop string matched or after ``flush``: the request
    has already ended, and the caller should have stopped generating."""


@dataclass(slots=True)
class DetokenizerUpdate:
    """What one push released."""

    text: str  # new text safe to emit now (may be "")
    # the stop string that matched, if one did: the request must finish with
    # reason "stop"; text after the stop string has been dropped
    stop_string: str | None


class StopStringMatcher:
    """Cuts a stream of text at the first stop string, in time linear in the
    text and memory linear in the stop strings.

    Invariants: released text contains no stop string, and no stop string can
    start inside released text, because every suffix of the stream that is a
    proper prefix of some stop string is still held. The held tail is at most
    ``len(longest stop) - 1`` characters.

    "First" means the match that completes first in the text (smallest end,
    then smallest start), which is what a character-by-character stream would
    see, so the result does not depend on how the text was chunked.

    Each stop string is followed by its own Knuth-Morris-Pratt state (the
    length of its longest prefix that ends the stream so far); the held tail
    is the longest of those prefixes. Per character that is amortised O(1)
    work per stop string, and nothing is materialised per prefix.
    """

    __slots__ = ("_stops", "_fallback", "_state", "_include_stop", "_held", "matched")

    def __init__(self, stop: Iterable[str], *, include_stop_in_output: bool = False) -> None:
        stops = tuple(dict.fromkeys(stop))
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = stops
        self._fallback = [_prefix_function(s) for s in stops]
        self._state = [0] * len(stops)
        self._include_stop = include_stop_in_output
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text now safe to release. Sets ``matched`` when a stop string
        completes; the caller must not feed after that."""
        if not self._stops or not text:
            return text
        stops, fallback, state = self._stops, self._fallback, self._state
        for i, ch in enumerate(text):
            best: str | None = None
            for k, stop in enumerate(stops):
                q = state[k]
                while q and stop[q] != ch:
                    q = fallback[k][q - 1]
                if stop[q] == ch:
                    q += 1
                    if q == len(stop):
                        if best is None or q > len(best):
                            best = stop  # the longest of those ending here starts first
                        q = fallback[k][q - 1]
                state[k] = q
            if best is not None:
                buffer = self._held + text[:i + 1]
                self.matched = best
                self._held = ""
                return buffer if self._include_stop else buffer[:len(buffer) - len(best)]
        buffer = self._held + text
        keep = max(state)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """Release the held tail: the stream ended without completing a stop."""
        held, self._held = self._held, ""
        self._state = [0] * len(self._stops)
        return held


def _prefix_function(s: str) -> list[int]:
    """``pi[i]``: length of the longest proper prefix of ``s[:i + 1]`` that is
    also its suffix (KMP's failure function)."""
    pi = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = pi[q - 1]
        if s[i] == s[q]:
            q += 1
        pi[i] = q
    return pi


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens.

    Contract: the concatenation of every ``push(...).text`` plus ``flush()``
    equals ``tokenizer.decode(token_ids, skip_special_tokens=...)`` of all the
    pushed ids, however they were chunked, cut at the first stop string; no
    delta contains U+FFFD. Both hold whenever the ids decode to valid UTF-8.
    For invalid bytes, U+FFFD appears where a one-shot decode puts it with
    byte-level BPE; with SentencePiece byte fallback a one-shot decode
    replaces a whole run of byte tokens, including characters the stream
    has already shown, so the texts can differ there.

    After a stop string matched, or after ``flush``, ``push`` raises
    ``DetokenizerFinishedError`` and ``flush`` returns "". Ids after the one
    that completed the stop string in the same push are dropped, as is their
    text.

    Window invariants. ``_window`` holds the recent ids the decoder sees
    (skipped special tokens never enter it): ``_window[:_read_offset]`` is
    left context whose text was released, the rest is unresolved. The
    window start and ``_read_offset`` are character boundaries of the
    decoded bytes (unless MAX_PENDING_TOKENS forced a release), so no decode
    starts inside a character. ``_prefix_len`` is
    ``len(decode(_window[:_read_offset]))``, and ``_pending_emitted``
    characters after it were released too (complete characters ahead of an
    unfinished one). Each decode sees the whole window: normally at most
    PREFIX_WINDOW_TOKENS + the tokens of one character, never more than
    2 * MAX_PENDING_TOKENS.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True,
                 include_stop_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Dropping skipped ids before they reach the window keeps the decoder
        # seeing exactly the token sequence a one-shot decode sees; otherwise a
        # window starting at a special token would strip the next token's space.
        self._skipped_ids: frozenset[int] = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special) if skip_special_tokens else frozenset()
        self._stop = StopStringMatcher(stop, include_stop_in_output=include_stop_in_output)
        # No history of ids or text: the request keeps its ids, the client its
        # text. Only the short decode window lives here.
        self._window: list[int] = []
        self._read_offset = 0
        self._prefix_len = 0
        self._pending_emitted = 0
        self._finished = False

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop.matched

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add output tokens; returns the text that became safe to show.

        Tokens are taken one at a time, so a stop string completed by one of
        them drops the rest. Raises DetokenizerFinishedError once finished.
        """
        if self._finished:
            raise DetokenizerFinishedError(
                "push() after the output finished (stop string or flush)")
        parts: list[str] = []
        for token_id in token_ids:
            if token_id in self._skipped_ids:
                continue
            released = self._stop.feed(self._decode_next(token_id))
            if released:
                parts.append(released)
            if self._stop.matched is not None:
                self._finished = True
                break
        return DetokenizerUpdate("".join(parts), self._stop.matched)

    def flush(self) -> str:
        """The output ended without a stop string (EOS, length, abort):
        release unfinished characters (as U+FFFD, as a one-shot decode would)
        and any text held back for stop strings. Idempotent."""
        if self._finished:
            return ""
        self._finished = True
        tail = ""
        if self._read_offset < len(self._window):
            text = self._decode(self._window)
            tail = text[self._prefix_len + self._pending_emitted:]
        released = self._stop.feed(tail)
        if self._stop.matched is None:
            released += self._stop.flush()
        return released

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        """Append one id to the window; the text it completes."""
        window = self._window
        window.append(token_id)
        text = self._decode(window)
        start = self._prefix_len + self._pending_emitted
        if text.endswith(_REPLACEMENT) and len(window) - self._read_offset < MAX_PENDING_TOKENS:
            # The last character is unfinished. Characters before it are final
            # (UTF-8 resynchronises), so release them without moving the offsets.
            safe = len(text.rstrip(_REPLACEMENT))
            if safe <= start:
                return ""
            self._pending_emitted = safe - self._prefix_len
            return text[start:safe]
        self._advance(len(text))
        return text[start:]

    def _advance(self, text_len: int) -> None:
        """Everything decoded so far is released: move the read offset to the
        end, and slide the window start when the context has grown too long."""
        old_read = self._read_offset
        self._read_offset = len(self._window)
        self._pending_emitted = 0
        if self._read_offset <= PREFIX_WINDOW_TOKENS:
            self._prefix_len = text_len
            return
        # The tokens just read become the whole context: old_read is a
        # character boundary. Their text alone must be decoded again because
        # the decoder treats the first token of a sequence specially.
        del self._window[:old_read]
        self._read_offset -= old_read
        self._prefix_len = len(self._decode(self._window))
