"""Prefix caching through the whole engine: greedy tokens (and logprobs) with
the cache on are those with it off, for each architecture, batched, chunked,
with preemption and after an abort mid-prefill; priorities order admission."""

from __future__ import annotations

import pytest
import torch

from backends.errors import InvalidRequestError
from backends.interface import SamplingParams
from tests.engine_helpers import assert_all_free, make_engine, run_all

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)

# block_size 4 gives many block boundaries on short prompts.
SCENARIOS = {
    "batched": dict(block_size=4),
    # threshold 1: every prompt is long, chunks of what the budget leaves
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    # the second wave needs more blocks than the pool has: preemption, with
    # shared prefix blocks held by some requests and released by others
    "preemption": dict(block_size=4, num_kv_blocks=26, max_model_len=64),
    "abort_mid_prefill": dict(block_size=4, max_num_batched_tokens=7),
}


def _waves(vocab: int, seed: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    prefix = rand(21)
    first = {"w1-a": prefix + rand(6), "w1-b": rand(13)}
    second = {f"w2-{i}": prefix + rand(4 + 3 * i) for i in range(3)}
    second["w2-same"] = list(first["w1-a"])     # a prompt seen before, whole
    second["w2-half"] = prefix[:10] + rand(9)   # shares two blocks
    second["w2-b"] = first["w1-b"] + rand(8)    # extends a prompt seen before
    return [first, second]


def _run(core, waves, abort_mid_prefill: bool) -> dict:
    results = {}
    if abort_mid_prefill:
        # computes some of the shared prefix, then goes away mid-prefill
        core.add_request("gone", waves[1]["w2-2"] + [5, 6, 7], GREEDY)
        for _ in range(2):
            assert core.step().outputs == []
        # 14 of the 21 shared tokens: three full blocks and half of one
        assert core.scheduler.requests["gone"].num_computed_tokens == 14
        core.abort("gone")
        assert_all_free(core)
    for wave in waves:
        results |= run_all(core, wave, GREEDY)
    return results


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_with_prefix_cache_equals_without(tiny_model_dir, scenario):
    arch, path = tiny_model_dir
    _check_cache_agrees(arch, path, scenario)


# Windows of 6 (Gemma 2, soft-capped too) and 5 (Gemma 3's local layers)
# tokens: cached blocks hold whole windows and more, and a request that
# resumes from them must attend exactly the window it would have computed.
@pytest.mark.parametrize("arch, scenario", [("gemma2", "preemption"), ("gemma3", "chunked")])
def test_prefix_cache_with_sliding_windows_equals_without(new_arch_dirs, arch, scenario):
    _check_cache_agrees(arch, new_arch_dirs(arch), scenario)


def _check_cache_agrees(arch, path, scenario):
    config = SCENARIOS[scenario]
    abort = scenario == "abort_mid_prefill"
    waves = _waves(512, seed=len(arch) + 7)
    off_core = make_engine(path, enable_prefix_caching=False, **config)
    off = _run(off_core, waves, abort)
    on_core = make_engine(path, **config)
    on = _run(on_core, waves, abort)
    for rid in off:
        assert on[rid].token_ids == off[rid].token_ids, f"{arch}/{scenario}/{rid}"
        for a, b in zip(on[rid].logprobs, off[rid].logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert off[rid].num_cached_tokens == 0
    # the second wave found its prefixes (block size 4)
    cached = {rid: r.num_cached_tokens for rid, r in on.items()}
    # after the abort, the first wave finds the three blocks it left written
    assert cached["w1-a"] == (12 if abort else 0) and cached["w1-b"] == 0
    assert cached["w2-same"] == 24                       # all but the last partial block
    assert cached["w2-half"] == 8
    assert cached["w2-b"] == 12
    assert all(cached[f"w2-{i}"] >= 20 for i in range(3))
    if scenario == "preemption":
        assert on_core.scheduler.num_preemptions_total > 0
        assert off_core.scheduler.num_preemptions_total > 0


def test_priority_policy_orders_admission_and_fcfs_refuses_priorities(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for rid, priority in (("late", 5), ("first", -2), ("second", 0), ("third", 0)):
        core.add_request(rid, [10 + len(rid), 11, 12], params, priority=priority)
    order = []
    while core.has_unfinished():
        for out in core.step().outputs:
            if out.finished:
                order.append(out.request_id)
    assert order == ["first", "second", "third", "late"]
    assert_all_free(core)

    fcfs = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError) as err:
        fcfs.add_request("p", [10, 11], params, priority=1)
    assert err.value.param == "priority"
    assert "--scheduling-policy priority" in str(err.value)
    fcfs.add_request("q", [10, 11], params, priority=0)
    run_all(fcfs)
