"""Scheduler policy without a model: budgets, chunking, preemption, stops."""

import pytest

from backends.interface import SamplingParams, StepResult, StepTimings
from cache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=16, max_seqs=8, max_len=64):
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len),
                     KVCacheManager(num_blocks, block_size))


def req(rid, n_prompt, max_tokens=8, first=1, priority=0, **params):
    """Prompt ``first .. first + n_prompt - 1``: requests with the same
    ``first`` share a prefix (and so prefix-cache blocks)."""
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens,
                   eos_token_ids=frozenset({0}), priority=priority)


def run_step(s, token=7):
    out = s.schedule()
    sampled = [r.request_id for r in out.requests if r.sample]
    res = StepResult(sampled, [token] * len(sampled), [None] * len(sampled), StepTimings())
    return out, s.update_from_output(out, res)


def test_long_prompt_is_chunked_and_never_stalls_decodes():
    s = make(budget=8)
    s.add_request(req("a", 3))
    out, _ = run_step(s)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [("a", 3, True)]
    s.add_request(req("long", 20))
    out, _ = run_step(s)
    # a's decode first, then 7 tokens of the long prompt
    assert [(r.request_id, len(r.token_ids), r.start_pos, r.sample) for r in out.requests] == \
        [("a", 1, 3, True), ("long", 7, 0, False)]
    out, _ = run_step(s)
    assert [(r.request_id, len(r.token_ids), r.start_pos) for r in out.requests] == \
        [("a", 1, 4), ("long", 7, 7)]
    out, _ = run_step(s)
    assert [(r.request_id, len(r.token_ids), r.start_pos, r.sample) for r in out.requests] == \
        [("a", 1, 5, True), ("long", 6, 14, True)]
    s.check_integrity()


def test_first_schedule_carries_prompt_once():
    s = make()
    s.add_request(req("a", 5))
    out, _ = run_step(s)
    assert out.requests[0].prompt_token_ids == [1, 2, 3, 4, 5]
    out, _ = run_step(s)
    assert out.requests[0].prompt_token_ids is None


def test_max_num_seqs_limits_running():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_admission_waits_for_blocks():
    s = make(num_blocks=3, block_size=4, budget=64)
    s.add_request(req("a", 8))   # 2 blocks
    s.add_request(req("b", 8))   # would need 2 more; only 1 free
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["a"]
    assert s.waiting[0].request_id == "b"
    s.check_integrity()


def test_preemption_takes_most_recently_admitted_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("a", 4, max_tokens=20, first=100))   # 1 block each
    s.add_request(req("b", 4, max_tokens=20, first=200))
    s.add_request(req("c", 8, max_tokens=20, first=300))   # 2 blocks
    run_step(s)
    assert s.kv_cache.num_free_blocks == 0
    # a needs a second block for its 5th token -> c (admitted last) is preempted
    out, _ = run_step(s)
    assert out.num_preempted == 1
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert s.waiting[0].request_id == "c"
    c = s.waiting[0]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_output_tokens == 1 and c.num_preemptions == 1
    assert s.kv_cache.num_request_blocks("c") == 0
    assert s.num_preemptions_total == 1
    s.check_integrity()
    # when blocks return, c is recomputed: prompt + its sampled token, then samples
    s.finish_request("a", FinishReason.ABORT)
    s.finish_request("b", FinishReason.ABORT)
    out, _ = run_step(s)
    (rc,) = out.requests
    assert rc.request_id == "c" and rc.start_pos == 0 and len(rc.token_ids) == 9 and rc.sample
    assert rc.token_ids[-1] == 7
    s.check_integrity()


def test_request_preempting_itself_when_alone_is_not_possible_with_room():
    # a lone running request that cannot grow preempts itself and waits
    s = make(num_blocks=2, block_size=4, budget=64, max_len=64)
    s.add_request(req("a", 8, max_tokens=20))
    run_step(s)
    out, _ = run_step(s)
    assert out.requests == [] and out.num_preempted == 1
    assert s.waiting[0].request_id == "a"
    s.check_integrity()


def test_stop_conditions():
    s = make()
    s.add_request(req("len", 2, max_tokens=1))
    s.add_request(req("eos", 2))
    s.add_request(req("ign", 2, max_tokens=3, ignore_eos=True))
    s.add_request(req("stopid", 2, stop_token_ids=(0,), ignore_eos=True))
    _, ups = run_step(s, token=5)
    assert [u.request.finish_reason for u in ups] == [FinishReason.LENGTH, None, None, None]
    _, ups = run_step(s, token=0)
    reasons = {u.request.request_id: (u.request.finish_reason, u.request.stop_reason)
               for u in ups}
    assert reasons["eos"] == (FinishReason.STOP, None)
    assert reasons["ign"] == (None, None)
    assert reasons["stopid"] == (FinishReason.STOP, 0)
    _, ups = run_step(s, token=0)
    assert ups[0].request.finish_reason is FinishReason.LENGTH
    assert not s.has_unfinished()
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    s.check_integrity()


def test_min_tokens_defers_eos():
    s = make()
    s.add_request(req("a", 2, min_tokens=2))
    _, ups = run_step(s, token=0)
    assert ups[0].request.finish_reason is None
    _, ups = run_step(s, token=0)
    assert ups[0].request.finish_reason is FinishReason.STOP


def test_context_length_stop():
    s = make(max_len=6)
    s.add_request(req("a", 4, max_tokens=100))
    run_step(s)
    _, ups = run_step(s)
    assert ups[0].request.finish_reason is FinishReason.LENGTH
    assert ups[0].request.num_tokens == 6


def test_abort_while_waiting_and_running_frees_everything():
    s = make(max_seqs=1)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    run_step(s)
    assert s.finish_request("b", FinishReason.ABORT).status is RequestStatus.FINISHED
    assert s.finish_request("a", FinishReason.ABORT) is not None
    assert s.finish_request("a", FinishReason.ABORT) is None
    # Handed over even with nothing to run (b was never scheduled), once.
    assert s.schedule().finished_request_ids == ["a"]
    s.add_request(req("c", 2))
    out = s.schedule()
    assert out.finished_request_ids == []
    s.finish_request("c", FinishReason.ABORT)
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    s.check_integrity()


def test_tokens_for_aborted_request_are_dropped():
    s = make()
    s.add_request(req("a", 3))
    out = s.schedule()
    s.finish_request("a", FinishReason.ABORT)
    res = StepResult(["a"], [5], [None], StepTimings())
    assert s.update_from_output(out, res) == []


def test_duplicate_id_rejected():
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError):
        s.add_request(req("a", 3))


def make_prefill_only(budget, prefill_only, max_seqs=32, num_blocks=64):
    return Scheduler(SchedulerConfig(max_seqs, budget, 64,
                                     prefill_only_step_tokens=prefill_only),
                     KVCacheManager(num_blocks, 4))


def test_a_step_without_decodes_admits_short_prompts_up_to_the_prefill_only_budget():
    s = make_prefill_only(budget=16, prefill_only=32)  # threshold 4
    for i in range(12):
        s.add_request(req(f"r{i}", 4, first=100 * i + 1))
    out, _ = run_step(s)
    # An idle engine's first step: 8 whole prompts (32 tokens), not 4.
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == \
        [(f"r{i}", 4) for i in range(8)]
    out, _ = run_step(s)
    # Now 8 decodes: the plain budget, 8 decode tokens and 2 prompts.
    assert sum(len(r.token_ids) for r in out.requests) == 16
    assert [r.request_id for r in out.requests if r.start_pos == 0] == ["r8", "r9"]
    s.check_integrity()


def test_without_the_setting_or_below_the_budget_nothing_changes():
    for prefill_only in (None, 8, 16):
        s = make_prefill_only(budget=16, prefill_only=prefill_only)
        for i in range(12):
            s.add_request(req(f"r{i}", 4, first=100 * i + 1))
        out, _ = run_step(s)
        assert [r.request_id for r in out.requests] == [f"r{i}" for i in range(4)]


def test_a_long_prompt_never_takes_the_prefill_only_bonus():
    s = make_prefill_only(budget=16, prefill_only=64)  # threshold 4
    s.add_request(req("long", 40))
    out, _ = run_step(s)
    # Alone on an idle engine it gets the plain budget, as before.
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 16)]
    s.add_request(req("short", 4, first=500))
    out, _ = run_step(s)
    # No decodes yet: the short prompt comes out of the bonus; the long chunk
    # still gets at most the plain budget (its threshold share, then what
    # the budget leaves).
    assert {r.request_id: len(r.token_ids) for r in out.requests} == {"long": 16, "short": 4}
    s.check_integrity()
