"""Per-request block tables over a BlockPool, and automatic prefix caching.

The scheduler asks for room (``allocate_slots``) before it schedules tokens and
releases it (``free``) on every exit path: finish, stop, abort, error and
preemption. The pool itself stays hidden behind this class.

Prefix caching: once a step has written a request's full block, that block is
named by a hash chained over its parent block's hash, its token ids and any
extra keys (``cache_computed_blocks``). A request being admitted looks up the
longest run of such blocks at the start of its tokens
(``find_cached_prefix``) and shares them instead of computing them again. A
block is shared only after the step that wrote it has finished, so a block
being written is never handed to anyone else; a partly filled block is never
named at all.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


ROOT_HASH = hashlib.sha256(b"baton-prefix-cache-v1").digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> bytes:
    """The identity of one full block: SHA-256 over the parent block's hash
    (``ROOT_HASH`` for the first block), the block's token ids and anything
    else that changes its KV (``extra_keys``: e.g. an adapter or a cache salt;
    nothing in Baton sets one yet). A cryptographic hash, so a crafted prompt
    cannot collide with another user's blocks."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class TokenSequence(Protocol):
    """What the cache needs to know of a request: its tokens so far."""

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, stop: int) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks found at the start of a request's tokens.

    ``num_tokens`` (a whole number of blocks) need not be computed;
    ``num_queried_tokens`` is how many tokens the lookup covered (the
    request's length, for the hit-rate counters; 0 when nothing was looked up).
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_queried_tokens: int = 0


NO_HIT = PrefixHit()


@dataclass(slots=True)
class PrefixCacheStats:
    """Tokens looked up and tokens found, since the last ``take_stats``."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        # The hash chain of each live request's full blocks, as far as known;
        # it survives preemption (the tokens only grow) and goes with forget().
        self._hashes: dict[str, list[bytes]] = {}
        # How many leading blocks of each table are named in the pool (found
        # there or cached after being written).
        self._num_cached: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request can get: free plus evictable cached ones."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0.0 .. 1.0 (cached blocks
        nobody holds count as free: they are reclaimed on demand)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def request_ids(self) -> set[str]:
        """Every request this manager keeps state for."""
        return set(self._block_tables) | set(self._hashes)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (a copy; the manager owns it)."""
        return list(self._block_tables.get(request_id, ()))

    def num_request_blocks(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))

    # ------------------------------------------------------------ lookup
    def find_cached_prefix(self, request_id: str, tokens: TokenSequence) -> PrefixHit:
        """The longest run of cached full blocks at the start of the
        request's tokens, stopping short of the last token (which is always
        computed, so that there are logits to sample from). Takes nothing:
        pass the hit to ``allocate_slots``."""
        if not self.enable_prefix_caching:
            return NO_HIT
        num_tokens = tokens.num_tokens
        limit = (num_tokens - 1) // self.block_size
        hashes = self._hash_chain(request_id, tokens, limit)
        blocks = []
        for block_hash in hashes[:limit]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size, num_tokens)

    def _hash_chain(self, request_id: str, tokens: TokenSequence,
                    num_blocks: int) -> list[bytes]:
        """The request's block hashes, extended to ``num_blocks`` full blocks."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for index in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens.token_slice(index * bs, (index + 1) * bs))
            hashes.append(parent)
        return hashes

    # -------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, num_tokens: int,
                       prefix: PrefixHit = NO_HIT) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens in total,
        starting a new table with ``prefix``'s shared blocks when given.

        Returns False, taking nothing, when the pool lacks the blocks.
        """
        table = self._block_tables.get(request_id)
        if prefix.block_ids and table:
            raise ValueError(f"{request_id}: a prefix hit only starts a new block table")
        have = len(table) if table else len(prefix.block_ids)
        missing = blocks_needed(num_tokens, self.block_size) - have
        # Hit blocks nobody holds are counted as free by the pool; they are
        # about to be taken, so they cannot also serve the missing blocks.
        reclaiming = sum(1 for b in prefix.block_ids if self.pool.ref_count(b) == 0)
        if missing > self.pool.num_free_blocks - reclaiming:
            return False
        if table is None:
            table = self._block_tables[request_id] = []
        if prefix.block_ids:
            self.pool.touch(prefix.block_ids)
            table.extend(prefix.block_ids)
            self._num_cached[request_id] = len(prefix.block_ids)
        if prefix.num_queried_tokens:
            self._stats.queries += prefix.num_queried_tokens
            self._stats.hits += prefix.num_tokens
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def cache_computed_blocks(self, request_id: str, tokens: TokenSequence,
                              num_computed_tokens: int) -> None:
        """Name the request's blocks that are full and written (the first
        ``num_computed_tokens`` tokens' KV is in place), so that later
        requests can share them. Call after the step that wrote them."""
        if not self.enable_prefix_caching:
            return
        table = self._block_tables.get(request_id)
        if not table:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        done = self._num_cached.get(request_id, 0)
        if num_full <= done:
            return
        hashes = self._hash_chain(request_id, tokens, num_full)
        for index in range(done, num_full):
            # False when an identical block was cached first (two requests
            # computed the same prefix at once): this copy stays private.
            self.pool.cache(table[index], hashes[index])
        self._num_cached[request_id] = num_full

    # ------------------------------------------------------------ release
    def free(self, request_id: str) -> int:
        """Release all of the request's blocks; safe to call when it has none.
        Its hash chain is kept (a preempted request looks itself up again).
        Returns the number of blocks released."""
        self._num_cached.pop(request_id, None)
        table = self._block_tables.pop(request_id, None)
        if not table:
            return 0
        # Released tail first: its blocks are evicted before the prefix
        # blocks, which more requests are likely to share.
        self.pool.free(reversed(table))
        return len(table)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Release the blocks past those ``num_tokens`` tokens need (a
        speculative step allocated slots for proposals that were rejected).
        Never releases a cached (full, named) block. Returns how many were
        released."""
        table = self._block_tables.get(request_id)
        if not table:
            return 0
        keep = max(blocks_needed(num_tokens, self.block_size),
                   self._num_cached.get(request_id, 0))
        if keep >= len(table):
            return 0
        extra = table[keep:]
        del table[keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def forget(self, request_id: str) -> None:
        """The request has ended: release its blocks and drop its hashes."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    def take_stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups since the last call (counted when a hit is
        taken by ``allocate_slots``)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned: dict[int, int] = {}
        for table in self._block_tables.values():
            for block_id in table:
                owned[block_id] = owned.get(block_id, 0) + 1
        for block_id, count in owned.items():
            if self.pool.ref_count(block_id) != count:
                raise AssertionError(
                    f"block {block_id}: {count} tables hold it, ref count "
                    f"{self.pool.ref_count(block_id)}")
        if len(owned) != self.pool.num_used_blocks:
            raise AssertionError(
                f"{self.pool.num_used_blocks} blocks in use but tables hold {len(owned)}")
        for request_id, num_cached in self._num_cached.items():
            table = self._block_tables.get(request_id, [])
            hashes = self._hashes.get(request_id, [])
            if num_cached > len(table) or num_cached > len(hashes):
                raise AssertionError(f"{request_id}: {num_cached} cached blocks counted")
            for index in range(num_cached):
                # A named block holds this hash, or none: an identical block
                # was cached first and this copy stayed private.
                if self.pool.block_hash(table[index]) not in (None, hashes[index]):
                    raise AssertionError(f"{request_id}: block {table[index]} has another hash")
        if not self.enable_prefix_caching and self.pool.num_cached_blocks:
            raise AssertionError("blocks cached with prefix caching off")
