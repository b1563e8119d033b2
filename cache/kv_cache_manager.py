"""Per-request block tables over a BlockPool.

The scheduler asks for room (``allocate_slots``) before it schedules tokens and
releases it (``free``) on every exit path: finish, stop, abort, error and
preemption. The pool itself stays hidden behind this class.
"""

from __future__ import annotations

from cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (a copy; the manager owns it)."""
        return list(self._block_tables.get(request_id, ()))

    def num_request_blocks(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        have = len(self._block_tables.get(request_id, ()))
        return blocks_needed(num_tokens, self.block_size) - have <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens in total.

        Returns False, allocating nothing, when the pool lacks the blocks.
        """
        table = self._block_tables.setdefault(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._block_tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> int:
        """Release all of the request's blocks; safe to call when it has none.
        Returns the number of blocks released."""
        table = self._block_tables.pop(request_id, None)
        if not table:
            return 0
        # Freed in reverse so the tail (least likely to be shared later) is
        # reused first.
        self.pool.free(list(reversed(table)))
        return len(table)

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
