"""Stored responses (``store`` and ``previous_response_id`` of the Responses
API, ``GET`` / ``DELETE /v1/responses/{id}``), kept in this process's memory.

Bounded: the entries' sizes (their JSON) add up to at most ``max_bytes``;
when a new one would pass that, the oldest go first. Each entry expires
``ttl`` seconds after it was stored. A server restart forgets them all, and
each replica of ``--data-parallel-size`` keeps its own (docs/serving.md).

An entry holds the response as its JSON (what GET returns) and the
conversation that a later ``previous_response_id`` continues: the input items
that led to it (its own previous conversation included) and its output items,
as input items. Thread-safe: previous ids are read on the preprocessing
threads, entries are written on the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from service.responses_protocol import InputItem

DEFAULT_MAX_BYTES = 128 * 2**20
DEFAULT_TTL = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_json: bytes
    conversation: tuple[InputItem, ...]
    stored_at: float
    size: int


class ResponsesStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl: float = DEFAULT_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response_json: bytes,
            conversation: tuple[InputItem, ...], conversation_bytes: int) -> bool:
        """Store (replacing an entry of that id); False when the entry alone
        is larger than the whole store."""
        size = len(response_json) + conversation_bytes
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response_id)
            self._expire()
            while self._entries and self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[response_id] = StoredResponse(response_json, conversation,
                                                        self._clock(), size)
            self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                return
            self._drop(next(iter(self._entries)))

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(e.size for e in self._entries.values())
            if total != self._bytes:
                raise AssertionError(f"stored responses hold {total} bytes, counted {self._bytes}")
            if self._bytes > self.max_bytes:
                raise AssertionError(f"stored responses hold {self._bytes} bytes, over the "
                                     f"limit of {self.max_bytes}")
            times = [e.stored_at for e in self._entries.values()]
            if times != sorted(times):
                raise AssertionError("stored responses out of age order")
