"""Block pool, KV cache manager and prefix cache: exact block ids, ref
counts, LRU eviction, integrity."""

from dataclasses import dataclass

import pytest

from cache.block_pool import BlockPool, NoFreeBlocksError
from cache.kv_cache_manager import (ROOT_HASH, KVCacheManager, blocks_needed,
                                    hash_block_tokens)


@dataclass
class Seq:
    """A request's tokens, as the cache sees them."""

    tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]


def seq(first: int, n: int) -> Seq:
    return Seq(list(range(first, first + n)))


def admit(kv: KVCacheManager, rid: str, s: Seq) -> tuple[int, ...]:
    """Look up, allocate the whole sequence, and mark it written (as the
    scheduler does after the step); returns the hit's block ids."""
    hit = kv.find_cached_prefix(rid, s)
    assert kv.allocate_slots(rid, s.num_tokens, hit)
    kv.cache_computed_blocks(rid, s, s.num_tokens)
    return hit.block_ids


def assert_all_released(kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(kv.num_blocks))


# ------------------------------------------------------------------ the pool

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
    with pytest.raises(ValueError):
        pool.touch([block])           # unnamed blocks are never shared
    assert pool.cache(block, b"h")
    pool.touch([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 2
    assert pool.is_evictable(block) and pool.lookup(b"h") == block
    with pytest.raises(ValueError):
        pool.free([block])
    pool.check_integrity()


def test_pool_caches_only_written_blocks_and_one_block_per_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.cache(2, b"x")           # free: nothing was written there
    assert pool.cache(a, b"x")
    assert not pool.cache(b, b"x")    # an identical block came first
    assert not pool.cache(a, b"y")    # a block keeps its one name
    assert pool.block_hash(b) is None and pool.lookup(b"x") == a
    pool.free([a, b])
    assert pool.evictable_blocks() == [a]
    assert pool.allocate(2) == [2, b]  # free blocks go before evictable ones
    assert pool.allocate(1) == [a]     # then the evictable one, unnamed
    assert pool.lookup(b"x") is None and pool.num_evictions == 1
    pool.check_integrity()


def test_integrity_catches_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a block off the free list with no owner
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    del pool._block_of[b"h"]  # a named block the map forgot
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool = BlockPool(2)
    pool._evictable[1] = None  # evictable yet free, and without a hash
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ------------------------------------------------------- block tables

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


# ----------------------------------------------------------- prefix cache

def test_block_hash_chains_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    # the same tokens after another prefix are another block
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], extra_keys=("adapter-1",))
    assert len(h1) == 32


def test_second_request_with_same_prefix_reuses_the_first_ones_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert admit(kv, "a", seq(1, 10)) == ()                 # blocks 0, 1 full; 2 partial
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_cached_blocks == 2                        # the partial block is not named
    assert kv.take_stats().queries == 10                    # a's lookup: nothing found
    hit = kv.find_cached_prefix("b", Seq(list(range(1, 9)) + [50, 51, 52]))
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8 and hit.num_queried_tokens == 11
    assert kv.allocate_slots("b", 11, hit)
    assert kv.block_table("b") == [0, 1, 3]                 # shared prefix, own tail
    assert [kv.pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    stats = kv.take_stats()
    assert (stats.queries, stats.hits) == (11, 8)
    assert (kv.take_stats().queries, kv.take_stats().hits) == (0, 0)
    kv.check_integrity()
    kv.forget("a")
    kv.forget("b")
    assert_all_released(kv)
    assert kv.num_cached_blocks == 2 and kv.pool.evictable_blocks() == [1, 0]


def test_the_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, "a", seq(1, 8))                               # exactly two full blocks
    hit = kv.find_cached_prefix("b", seq(1, 8))
    # both blocks are cached, but the last token must be computed to sample
    assert hit.block_ids == (0,) and hit.num_tokens == 4
    assert kv.find_cached_prefix("c", seq(1, 9)).block_ids == (0, 1)
    assert kv.find_cached_prefix("d", seq(1, 1)).block_ids == ()
    for rid in "abcd":
        kv.forget(rid)
    assert_all_released(kv)


def test_a_block_being_written_is_never_shared():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = seq(1, 9)
    assert kv.allocate_slots("a", 9)           # scheduled, not yet computed
    assert kv.find_cached_prefix("b", s).block_ids == ()
    kv.cache_computed_blocks("a", s, 6)        # one chunk done: block 0 written, 1 half
    assert kv.find_cached_prefix("b", s).block_ids == (0,)
    kv.cache_computed_blocks("a", s, 9)
    assert kv.find_cached_prefix("b", s).block_ids == (0, 1)
    kv.forget("a")
    kv.forget("b")
    assert_all_released(kv)


def test_eviction_is_lru_and_only_when_no_free_block_is_left():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    admit(kv, "a", seq(100, 8))                # blocks 0, 1
    admit(kv, "b", seq(200, 8))                # blocks 2, 3
    kv.forget("a")
    kv.forget("b")
    # released tail first: a's 1, 0, then b's 3, 2
    assert kv.pool.evictable_blocks() == [1, 0, 3, 2]
    assert kv.num_free_blocks == 6 and kv.usage == 0.0
    # a hit on a brings its blocks back into use: b's are now the oldest
    assert admit(kv, "a2", seq(100, 9)) == (0, 1)
    assert kv.block_table("a2") == [0, 1, 4]   # a free block, no eviction
    assert kv.pool.num_evictions == 0
    assert kv.allocate_slots("c", 8)
    assert kv.block_table("c") == [5, 3]       # the last free block, then b's tail
    assert kv.pool.num_evictions == 1
    assert kv.find_cached_prefix("b2", seq(200, 9)).block_ids == (2,)
    assert kv.allocate_slots("c", 12)
    assert kv.block_table("c") == [5, 3, 2]
    assert kv.find_cached_prefix("b3", seq(200, 9)).block_ids == ()
    for rid in ("a2", "b2", "b3", "c"):
        kv.forget(rid)
    assert_all_released(kv)


def test_blocks_held_by_a_request_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    admit(kv, "a", seq(1, 8))                  # cached blocks 0, 1, held by a
    assert kv.allocate_slots("b", 8)           # blocks 2, 3
    assert not kv.allocate_slots("c", 1)       # nothing free; a's blocks stay
    assert kv.find_cached_prefix("d", seq(1, 9)).block_ids == (0, 1)
    kv.check_integrity()
    for rid in "abcd":
        kv.forget(rid)
    assert_all_released(kv)


def test_a_hit_is_taken_whole_or_not_at_all():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    admit(kv, "a", seq(1, 8))
    kv.forget("a")                             # blocks 0, 1 evictable
    assert kv.allocate_slots("x", 8)           # takes the free blocks 2, 3
    kv.take_stats()
    hit = kv.find_cached_prefix("b", seq(1, 13))
    assert hit.block_ids == (0, 1)
    # 13 tokens need 4 blocks: 2 from the hit, 2 more; the only ones
    # allocatable are the hit's own evictable blocks, so it does not fit
    assert not kv.allocate_slots("b", 13, hit)
    assert kv.block_table("b") == [] and kv.pool.evictable_blocks() == [1, 0]
    assert kv.take_stats().queries == 0        # counted only when taken
    assert kv.allocate_slots("b", 8, hit)      # just the hit: fits
    assert kv.block_table("b") == [0, 1]
    for rid in "bx":
        kv.forget(rid)
    assert_all_released(kv)


def test_a_preempted_request_finds_its_own_blocks_again():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = seq(1, 10)
    admit(kv, "a", s)
    s.tokens += [77, 78]                        # two decoded tokens, computed
    assert kv.allocate_slots("a", 12)
    kv.cache_computed_blocks("a", s, 12)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.free("a") == 3                    # preempted: hashes kept
    s.tokens.append(79)                         # the token sampled last, not computed
    hit = kv.find_cached_prefix("a", s)
    assert hit.block_ids == (0, 1, 2) and hit.num_tokens == 12
    assert kv.allocate_slots("a", 13, hit)
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.forget("a")
    assert kv.request_ids == set()
    assert_all_released(kv)


def test_prefix_caching_off_shares_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    assert admit(kv, "a", seq(1, 9)) == ()
    assert admit(kv, "b", seq(1, 9)) == ()
    assert kv.block_table("b") == [3, 4, 5] and kv.num_cached_blocks == 0
    kv.forget("a")
    kv.forget("b")
    assert_all_released(kv)
    assert kv.pool.evictable_blocks() == []


def test_manager_integrity_catches_a_table_out_of_step():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    admit(kv, "a", seq(1, 8))
    kv._block_tables["a"].append(3)             # a block the pool never handed out
    with pytest.raises(AssertionError):
        kv.check_integrity()
