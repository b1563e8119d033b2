"""The compiled-grammar cache: an LRU bounded by entries and by bytes.

llguidance gives no size for a compiled grammar, so an entry is charged what
the C heap grew by while it was built and its first mask computed
(``heap_bytes_in_use`` before and after, glibc's ``mallinfo2``; where that is
missing, the grammar text's length). That is where a grammar's memory goes
at compile time: its lexer's first states (~80 MB for a pattern like
``x{1000000}`` under llguidance's default limits, 2.6 GB for 32 of them in
the old count-only cache). Other threads allocating at the same moment blur
the figure by little against the entries that matter.

A cached grammar keeps growing after that: its requests' matchers are
copies that share its lexer, which adds states as masks are computed. The
cache cannot see by how much, so an entry whose matchers have done more than
``work_limit`` seconds of grammar work in all is dropped (its live copies
keep working; the next request compiles afresh), and so is one whose matcher
failed: an errored matcher is never cached. Thread-safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict
from typing import Any, Callable

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 256 * 2**20
# Seconds of mask work (all of an entry's matchers together) after which a
# cached entry is dropped, because its shared lexer grew with that work.
DEFAULT_WORK_LIMIT_S = 0.25


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], Any] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes_in_use() -> int | None:
    """Bytes the C heap has handed out and not had back (arenas and mapped
    blocks), or None where the C library cannot say. ~0.1 ms: for cache
    misses, not for every token."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class CacheEntry:
    """One compiled grammar as the cache keeps it. ``work`` (seconds of mask
    work by the matchers copied from it) is added to by those matchers, on
    whichever thread computes their masks."""

    __slots__ = ("key", "value", "nbytes", "work", "dropped", "_cache")

    def __init__(self, key: Any, value: Any, nbytes: int, cache: "GrammarCache") -> None:
        self.key = key
        self.value = value
        self.nbytes = nbytes
        self.work = 0.0
        self.dropped = False
        self._cache = cache

    def add_work(self, seconds: float) -> None:
        self.work += seconds
        if not self.dropped and self.work > self._cache.work_limit:
            self._cache.drop(self)

    def drop(self) -> None:
        """Never hand this entry out again (its matcher failed)."""
        if not self.dropped:
            self._cache.drop(self)


class GrammarCache:
    """``get`` / ``put`` by key; evicts the least recently used entries while
    more than ``max_entries`` are kept or their bytes exceed ``max_bytes``.
    An entry larger than ``max_bytes`` alone is handed back uncached."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 work_limit: float = DEFAULT_WORK_LIMIT_S) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.work_limit = work_limit
        self._entries: OrderedDict[Any, CacheEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Any, value: Any, nbytes: int) -> CacheEntry:
        """Keep ``value`` (charged ``nbytes``) unless it alone is over the
        byte bound; returns its entry either way."""
        entry = CacheEntry(key, value, nbytes, self)
        if nbytes > self.max_bytes:
            entry.dropped = True
            return entry
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                old.dropped = True
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                evicted.dropped = True
                self._bytes -= evicted.nbytes
        return entry

    def drop(self, entry: CacheEntry) -> None:
        with self._lock:
            entry.dropped = True
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self._bytes -= entry.nbytes

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            if total != self._bytes:
                raise AssertionError(f"grammar cache counts {self._bytes} bytes, holds {total}")
            if len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                raise AssertionError("grammar cache over its bounds")
            if any(e.dropped for e in self._entries.values()):
                raise AssertionError("grammar cache holds a dropped entry")
