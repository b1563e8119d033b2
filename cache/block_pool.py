"""A fixed pool of KV blocks: a free list and reference counts.

Pure bookkeeping; the KV tensors live in the backend, indexed by block id.
Invariant (checked by ``check_integrity``): every block id is either on the
free list with ref count 0, or off it with ref count >= 1; never both.
"""

from __future__ import annotations

from collections import deque


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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks off the free list with ref count 1.

        All or nothing: on failure nothing is taken.
        """
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free; cannot share it")
        self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go back on
        the free list, in the order given."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice on the free list")
        for block_id, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"block {block_id} has negative ref count {count}")
            if (count == 0) != (block_id in free):
                raise AssertionError(
                    f"block {block_id}: ref count {count} but "
                    f"{'on' if block_id in free else 'off'} the free list")
