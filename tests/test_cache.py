"""Block pool and KV cache manager: exact block ids, ref counts, integrity."""

import pytest

from cache.block_pool import BlockPool, NoFreeBlocksError
from cache.kv_cache_manager import KVCacheManager, blocks_needed


def test_pool_allocates_in_order_and_reuses_oldest_freed_first():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1])
    pool.free([0])
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [3, 1, 0]
    pool.check_integrity()


def test_pool_allocation_is_all_or_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_pool_ref_counts_keep_shared_block_until_last_owner_frees():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref(block)
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.free([block])
    pool.check_integrity()


def test_integrity_catches_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a block off the free list with no owner
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_manager_grows_tables_block_by_block():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 3)
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("a", 4)          # still fits in block 0
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("a", 5)
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("b", 9)
    assert kv.block_table("b") == [2, 3, 4]
    assert not kv.allocate_slots("a", 9)      # needs one more, none free
    assert kv.block_table("a") == [0, 1]      # nothing taken on failure
    assert not kv.allocate_slots("c", 1)
    assert kv.block_table("c") == []
    kv.check_integrity()
    assert kv.free("b") == 3
    assert kv.free("b") == 0                  # idempotent
    assert kv.allocate_slots("c", 1)
    assert kv.block_table("c") == [4]         # tail of b's table came back first
    kv.free("a")
    kv.free("c")
    assert kv.num_free_blocks == 5
    assert kv.usage == 0.0
    kv.check_integrity()


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
