"""Cheap checks before expensive work: what a request holds is counted and
measured before anything is tokenized, rendered or compiled.

A body's JSON nesting depth is read from its bytes before it is decoded
(``check_nesting``); a prompt's characters bound its tokens from below, so a
prompt that could only be too long is refused before it is tokenized
(``PromptLimits.check_text``); prompts are counted and their tokens summed
as they are tokenized, stopping at the first bound crossed; and the work
stops between prompts once its client has gone (``PromptLimits.cancel``).
docs/security.md lists the limits.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import numpy as np

from backends.errors import ContextLengthExceededError, InvalidRequestError

# Deepest nesting of arrays and objects a request body (or a JSON document
# inside one, such as structured_outputs.json) may have. Deeper bodies made
# the decoders recurse until Python's limit (a 500 before); real schemas and
# tool parameters nest a dozen levels.
MAX_JSON_DEPTH = 64
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_CHUNK = 1 << 20


class PreprocessingCancelled(Exception):
    """The client went away: the work for its request stopped."""


def check_nesting(document: bytes | str, param: str | None = None,
                  limit: int = MAX_JSON_DEPTH) -> None:
    """400 (InvalidRequestError naming ``param``) when the JSON text nests
    arrays and objects deeper than ``limit``. Reads brackets outside strings
    only; malformed JSON is left to the decoder. ~30 ms for 8 MB."""
    data = document.encode() if isinstance(document, str) else document
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    deepest = depth = 0
    for start in range(0, len(brackets), _CHUNK):  # small temporaries, however long
        chunk = np.frombuffer(brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - start),
                              offset=start)
        # "[" 0x5b and "{" 0x7b open; "]" 0x5d and "}" 0x7d close.
        running = np.cumsum(np.where((chunk == 0x5B) | (chunk == 0x7B), 1, -1).astype(np.int8),
                            dtype=np.int32) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    if deepest > limit:
        where = f"{param} nests" if param else "the request body nests"
        raise InvalidRequestError(f"{where} arrays and objects {deepest} deep, more than the "
                                  f"{limit} this server reads", param)


def check_n(n: int, running_slots: int) -> None:
    """At most half the engine's running slots (``--max-num-seqs``) for one
    request's choices, so that no request holds every slot while others
    wait (0 slots: not known, no bound)."""
    most = max(1, running_slots // 2) if running_slots else None
    if most is not None and n > most:
        raise InvalidRequestError(f"n may be at most {most} on this server (half of the "
                                  f"{running_slots} requests it runs at once), got {n}", "n")


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What one request's prompts may hold, checked as they are prepared
    (None: no bound). ``chars_per_token`` is the most input characters one
    token can stand for (``Tokenizer.max_chars_per_token``): a text longer
    than that many times a token bound holds more tokens than the bound."""

    max_prompts: int | None = None          # the queue's request bound
    max_prompt_tokens: int | None = None    # the model's context
    max_total_tokens: int | None = None     # the queue's token bound
    chars_per_token: int | None = None
    cancel: threading.Event | None = None   # set when the client has gone

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PreprocessingCancelled()

    def check_count(self, count: int, param: str = "prompt") -> None:
        if self.max_prompts is not None and count > self.max_prompts:
            raise InvalidRequestError(
                f"the request holds {count} prompts, more than this server queues at once "
                f"({self.max_prompts})", param)

    def check_text(self, chars: int, param: str = "prompt") -> None:
        """Refuse a text whose length alone proves it too many tokens."""
        self.check_cancelled()
        if self.chars_per_token is None or self.max_prompt_tokens is None:
            return
        bound = self.max_prompt_tokens * self.chars_per_token
        if chars > bound:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_prompt_tokens} tokens. "
                f"However, the {param} holds {chars} characters, more than that many tokens "
                f"can spell ({bound}). Please reduce the length of the {param}.", param)

    def check_tokens(self, total_tokens: int, n: int = 1) -> None:
        """After each prompt is tokenized: stop at once when the request's
        prompts (times ``n``) already hold more tokens than the queue takes,
        rather than tokenize the rest. (A prompt over the context is refused
        with the engine's message, naming what was asked.)"""
        if self.max_total_tokens is not None and total_tokens * n > self.max_total_tokens:
            raise InvalidRequestError(
                f"the request's prompts hold at least {total_tokens * n} tokens, more than "
                f"this server queues at once ({self.max_total_tokens})",
                "prompt" if n == 1 or total_tokens > self.max_total_tokens else "n")
