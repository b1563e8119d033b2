"""Helpers for driving an EngineCore to completion in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.interface import SamplingParams
from scheduler.engine import EngineCore
from service.config import EngineArgs
from service.engine_factory import create_engine


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0


def make_engine(model, **kwargs) -> EngineCore:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("seed", 1234)
    return create_engine(EngineArgs(model=str(model) if model else None, **kwargs))


def run_all(core: EngineCore, prompts: dict[str, list[int]] | None = None,
            params: SamplingParams | dict[str, SamplingParams] | None = None,
            max_steps: int = 10_000) -> dict[str, Finished]:
    """Add the prompts (if any), step until every request is finished, and
    check that every KV block came back."""
    results: dict[str, Finished] = {}
    for rid, ids in (prompts or {}).items():
        p = params[rid] if isinstance(params, dict) else params
        core.add_request(rid, ids, p or SamplingParams())
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for out in core.step().outputs:
            res = results.setdefault(out.request_id, Finished())
            res.token_ids.extend(out.new_token_ids)
            res.text += out.text
            if out.logprobs:
                res.logprobs.extend(out.logprobs)
            res.num_prompt_tokens = out.num_prompt_tokens
            res.num_cached_tokens = out.num_cached_tokens
            res.spec_proposed, res.spec_accepted = out.spec_proposed, out.spec_accepted
            if out.finished:
                res.finish_reason = out.finish_reason
                res.stop_reason = out.stop_reason
    else:
        raise AssertionError("engine did not finish within max_steps")
    assert_all_free(core)
    return results


def assert_all_free(core: EngineCore) -> None:
    """Every block back (free, or evictable in the prefix cache, none
    referenced) and every per-request table empty (the backend's included,
    once it has been told which requests ended)."""
    core.check_integrity()
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    assert all(kv.pool.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert not core.scheduler.running and not core.scheduler.waiting
    core.release_finished()
    sizes = core.state_sizes()
    assert not any(sizes.values()), f"per-request state left behind: {sizes}"


class OracleProposer:
    """Proposals from a reference run: always right, always wrong, or right
    at every other position."""

    def __init__(self, reference: dict[str, list[int]], mode: str, vocab: int) -> None:
        self.reference, self.mode, self.vocab = reference, mode, vocab
        self.request_ids: set[str] = set()
        self.calls = 0

    def propose_for(self, wanted, kv_cache=None) -> dict[str, list[int]]:
        self.calls += 1
        out = {}
        for request, k in wanted:
            n = request.num_output_tokens
            right = self.reference[request.request_id][n:n + k]
            wrong = [(t + 1) % self.vocab for t in right]
            out[request.request_id] = {"right": right, "wrong": wrong,
                                       "half": [w if i % 2 else r for i, (r, w) in
                                                enumerate(zip(right, wrong))]}[self.mode]
        return out

    def release(self, request_ids) -> None:
        pass
