"""Scheduler policy without a model: prefix-cache hits at admission, the
long-prefill share of a step, priority order and preemption order."""

from cache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.request import FinishReason, RequestStatus
from scheduler.scheduler import Scheduler
from tests.test_scheduler import req, run_step


def make(num_blocks=32, block_size=4, budget=16, max_seqs=8, max_len=128, **config):
    config = SchedulerConfig(max_seqs, budget, max_len, **config)
    return Scheduler(config, KVCacheManager(num_blocks, block_size,
                                            config.enable_prefix_caching))


def rows(out):
    return [(r.request_id, r.start_pos, len(r.token_ids), r.sample) for r in out.requests]


def drain(s, max_steps=200):
    """Run to the end; every block must come back, free or evictable."""
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        run_step(s)
    assert not s.has_unfinished()
    s.check_integrity()
    kv = s.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert kv.request_ids == set()


# ---------------------------------------------------------- prefix caching

def test_admission_reuses_the_cached_prefix_and_computes_the_rest():
    s = make()
    s.add_request(req("a", 10))                     # tokens 1..10
    assert rows(run_step(s)[0]) == [("a", 0, 10, True)]
    assert s.kv_cache.block_table("a") == [0, 1, 2]
    s.add_request(req("b", 12))                     # tokens 1..12: 2 blocks cached
    out, _ = run_step(s)
    assert rows(out) == [("a", 10, 1, True), ("b", 8, 4, True)]
    assert out.requests[1].block_table == [0, 1, 3]
    b = s.requests["b"]
    assert b.num_cached_tokens == 8
    assert out.requests[1].prompt_token_ids == list(range(1, 13))  # the backend's copy
    drain(s)


def test_requests_admitted_in_the_same_step_share_nothing():
    # The first one's blocks are being written in that very step.
    s = make(budget=64)
    s.add_request(req("a", 9))
    s.add_request(req("b", 9))
    out, _ = run_step(s)
    assert rows(out) == [("a", 0, 9, True), ("b", 0, 9, True)]
    assert set(out.requests[0].block_table).isdisjoint(out.requests[1].block_table)
    assert s.requests["b"].num_cached_tokens == 0
    s.add_request(req("c", 9))
    out, _ = run_step(s)
    assert ("c", 8, 1, True) in rows(out)           # only the last token computed
    drain(s)


def test_prompt_logprobs_skip_the_lookup_but_fill_the_cache():
    s = make()
    s.add_request(req("a", 9))
    run_step(s)
    s.add_request(req("echo", 13, prompt_logprobs=1))
    out, _ = run_step(s)
    assert ("echo", 0, 13, True) in rows(out)
    s.add_request(req("c", 14))
    out, _ = run_step(s)
    assert ("c", 12, 2, True) in rows(out)          # echo's three blocks
    drain(s)


def test_prefix_caching_off():
    s = make(enable_prefix_caching=False)
    s.add_request(req("a", 9))
    run_step(s)
    s.add_request(req("b", 9))
    out, _ = run_step(s)
    assert ("b", 0, 9, True) in rows(out)
    assert s.kv_cache.num_cached_blocks == 0
    drain(s)


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    s = make(num_blocks=7, budget=64)
    s.add_request(req("a", 8, max_tokens=20, first=100))   # 2 blocks each
    s.add_request(req("b", 8, max_tokens=20, first=200))
    s.add_request(req("c", 8, max_tokens=20, first=300))
    run_step(s)
    c_blocks = s.kv_cache.block_table("c")
    # a's decode takes the free block; b's finds none: c, admitted last, is
    # preempted and b takes c's tail block (released first, evicted first)
    out, _ = run_step(s)
    assert out.num_preempted == 1 and [r.request_id for r in out.requests] == ["a", "b"]
    assert s.kv_cache.block_table("b")[-1] == c_blocks[1]
    s.finish_request("a", FinishReason.ABORT)
    s.finish_request("b", FinishReason.ABORT)
    out, _ = run_step(s)
    # c's first block survived in the cache: only the rest is recomputed
    assert rows(out) == [("c", 4, 5, True)]
    assert out.requests[0].token_ids == [304, 305, 306, 307, 7]
    assert out.requests[0].block_table[0] == c_blocks[0]
    assert s.requests["c"].num_cached_tokens == 0  # as first admitted
    drain(s)


def test_aborted_mid_prefill_leaves_only_written_blocks():
    s = make(budget=6)                              # threshold 1: chunks of 6
    s.add_request(req("a", 20))
    run_step(s)                                     # tokens 0..5 computed
    s.finish_request("a", FinishReason.ABORT)
    assert s.kv_cache.num_cached_blocks == 1        # block 0 full; block 1 half
    s.add_request(req("b", 20))
    out, _ = run_step(s)
    assert rows(out) == [("b", 4, 6, False)]
    drain(s)


# ---------------------------------------------------------------- fairness

def test_a_long_prompt_alone_gets_the_whole_budget():
    s = make(budget=16)                             # threshold 4
    s.add_request(req("long", 40))
    assert rows(run_step(s)[0]) == [("long", 0, 16, False)]
    assert rows(run_step(s)[0]) == [("long", 16, 16, False)]
    drain(s)


def test_decodes_and_short_requests_flow_while_a_long_prompt_prefills():
    s = make(budget=16)                             # threshold 4
    s.add_request(req("a", 3, max_tokens=30, first=500))
    run_step(s)
    s.add_request(req("long", 60))
    out, _ = run_step(s)
    assert rows(out) == [("a", 3, 1, True), ("long", 0, 15, False)]
    s.add_request(req("long2", 60, first=1000))     # waits: one long prefill at a time
    s.add_request(req("short", 3, first=2000))      # passes long2
    out, _ = run_step(s)
    # a's decode, the long chunk's threshold share, the short prompt whole,
    # then the long chunk gets what is left
    assert rows(out) == [("a", 4, 1, True), ("long", 15, 12, False), ("short", 0, 3, True)]
    assert [r.request_id for r in s.waiting] == ["long2"]
    for _ in range(3):
        out, _ = run_step(s)
        assert ("a", s.requests["a"].num_tokens - 2, 1, True) in rows(out)
    assert s.requests["long"].num_computed_tokens == 60  # done: long2 may start
    out, _ = run_step(s)
    assert [r[:2] for r in rows(out) if r[0] == "long2"] == [("long2", 0)]
    drain(s)


def test_a_cached_prompt_is_short_and_not_held_behind_a_long_prefill():
    s = make(budget=16)                             # threshold 4
    s.add_request(req("warm", 23, first=3000))
    drain(s)                                        # 5 blocks of it cached
    s.add_request(req("long", 60))
    run_step(s)
    s.add_request(req("again", 24, first=3000))     # 20 cached, 4 to compute
    out, _ = run_step(s)
    assert ("again", 20, 4, True) in rows(out)
    drain(s)


# ---------------------------------------------------------------- priority

def test_priority_orders_admission_ties_by_arrival():
    s = make(policy="priority", max_seqs=1)
    for rid, priority in (("p5", 5), ("p0a", 0), ("p0b", 0), ("m1", -1)):
        s.add_request(req(rid, 2, max_tokens=1, first=100 * len(rid) + priority,
                          priority=priority))
    order = []
    while s.has_unfinished():
        out, _ = run_step(s)
        order += [r.request_id for r in out.requests]
    assert order == ["m1", "p0a", "p0b", "p5"]
    drain(s)


def test_fcfs_admits_in_arrival_order_whatever_the_priority_field():
    s = make(max_seqs=1)
    for rid in ("x", "y", "z"):
        s.add_request(req(rid, 2, max_tokens=1, first=ord(rid) * 10))
    order = []
    while s.has_unfinished():
        order += [r.request_id for r in run_step(s)[0].requests]
    assert order == ["x", "y", "z"]


def _preemption_scenario(policy: str):
    """low (priority 10) is admitted first, high (priority 0) a step later;
    then high's decode needs a block and none is free."""
    s = make(num_blocks=4, budget=64, policy=policy)
    s.add_request(req("low", 4, max_tokens=8, first=100, priority=10 if policy != "fcfs" else 0))
    run_step(s)
    s.add_request(req("high", 8, max_tokens=8, first=200))
    run_step(s)                                      # pool full: low 2, high 2
    assert s.kv_cache.num_free_blocks == 0
    out, _ = run_step(s)
    return s, out


def test_priority_preempts_the_lowest_priority_running_request():
    s, out = _preemption_scenario("priority")
    assert out.num_preempted == 1
    assert s.requests["low"].status is RequestStatus.WAITING
    assert [r.request_id for r in out.requests] == ["high"]
    drain(s)


def test_fcfs_preempts_the_most_recently_admitted():
    s, out = _preemption_scenario("fcfs")
    assert out.num_preempted == 1
    assert s.requests["high"].status is RequestStatus.WAITING
    assert [r.request_id for r in out.requests] == ["low"]
    drain(s)


def test_priority_runs_decodes_in_priority_order_when_the_budget_is_short():
    s = make(policy="priority", budget=2, max_seqs=4)
    for rid, priority in (("c", 3), ("a", 1), ("b", 2)):
        s.add_request(req(rid, 1, max_tokens=5, first=ord(rid), priority=priority))
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]  # c waits its turn
    drain(s)
