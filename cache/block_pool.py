"""A fixed pool of KV blocks: reference counts, a free list, and the prefix
cache's map of full blocks by content hash.

Pure bookkeeping; the KV tensors live in the backend, indexed by block id.
Every block is in exactly one of three states (``check_integrity`` proves it):

- **free**: ref count 0, no hash, on the free list;
- **in use**: ref count >= 1, with or without a hash (a hashed block in use
  can be shared: a new owner takes a reference);
- **evictable**: ref count 0 with a hash, on the evictable list, oldest
  release first. Its KV is still valid: a lookup can bring it back into use.

A hash names at most one block and a hashed block is in the hash map. An
evictable block loses its hash only when ``allocate`` needs it because the
free list is empty, least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class NoFreeBlocksError(Exception):
    """Raised by ``allocate`` when the pool cannot satisfy a request."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO reuse: the block freed longest ago is handed out first, which
        # keeps allocation order deterministic and easy to assert in tests.
        self._free: deque[int] = deque(range(num_blocks))
        # Released blocks whose content is known, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a known hash, in use or evictable."""
        return len(self._block_of)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks with ref count 1 and no hash: free blocks
        first, then evictable ones, least recently released first.

        All or nothing: on failure nothing is taken.
        """
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block_id)]
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each cached block (a prefix hit); an
        evictable block goes back into use."""
        for block_id in block_ids:
            if block_id not in self._hash_of:
                raise ValueError(f"block {block_id} has no hash; only cached blocks are shared")
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. A block reaching zero goes on the
        evictable list if it has a hash (most recently released last), else
        on the free list, in the order given."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in self._hash_of:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Name an in-use, full block by its content hash so later requests
        can share it. False (nothing changes) when another block already holds
        that hash or this block already has one."""
        if self._ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is not in use; only written blocks are cached")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this content, in use or evictable; None if none."""
        return self._block_of.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first)."""
        return list(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice on the free list")
        evictable = set(self._evictable)
        if free & evictable:
            raise AssertionError(f"blocks {sorted(free & evictable)} both free and evictable")
        if len(self._hash_of) != len(self._block_of) or any(
                self._block_of.get(h) != b for b, h in self._hash_of.items()):
            raise AssertionError("the hash map and the block hashes disagree")
        for block_id, count in enumerate(self._ref_counts):
            hashed = block_id in self._hash_of
            if count < 0:
                raise AssertionError(f"block {block_id} has negative ref count {count}")
            if count > 0 and (block_id in free or block_id in evictable):
                raise AssertionError(f"block {block_id} has ref count {count} but is released")
            if count == 0 and hashed and block_id not in evictable:
                raise AssertionError(f"cached block {block_id} is unowned but not evictable")
            if count == 0 and not hashed and block_id not in free:
                raise AssertionError(f"block {block_id} is unowned but not on the free list")
            if block_id in evictable and not hashed:
                raise AssertionError(f"evictable block {block_id} has no hash")
