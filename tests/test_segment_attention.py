"""Which attention a step's prefill chunks take (backends/torch_backend.py,
``segment_attention_pays``): short rows go to the decode kernel as token rows,
a long chunk over a long context sends the step to SDPA one chunk at a time,
and both routes give the same tokens and logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from backends import torch_backend
from backends.interface import SamplingParams
from backends.torch_backend import segment_attention_pays
from tests.engine_helpers import make_engine, run_all
from tests.test_engine_agreement import _prompts


def _row(tokens: int, start: int) -> SimpleNamespace:
    return SimpleNamespace(token_ids=[1] * tokens, start_pos=start)


@pytest.mark.parametrize("rows, pays", [
    ([_row(1, 3000)] * 32, False),                 # decodes
    ([_row(5, 900)], False),                       # a verification row
    ([_row(16, 3000)], False),                     # short, however long the context
    ([_row(64, 192)] * 4, False),                  # 64 x 256 pairs: too few
    ([_row(63, 4000)], False),                     # one token short
    ([_row(64, 448)], True),                       # 64 x 512 = 32,768 pairs
    ([_row(1, 100)] * 28 + [_row(120, 192)], True),  # decodes beside a long chunk
    ([_row(512, 0)], True),                        # a first chunk of a long prompt
])
def test_the_rule(rows, pays):
    assert segment_attention_pays(rows) is pays


def test_long_chunks_give_the_token_row_results(tiny_llama_dir, monkeypatch):
    """Prompts of 300, 140 and 20 tokens in chunks of at most 256: the steps
    holding a long chunk take the segment path, the rest token rows; with
    the threshold out of reach every step takes token rows, and the tokens
    and logprobs agree (float32)."""
    routes: list[bool] = []
    rule = torch_backend.segment_attention_pays

    def spy(rows):
        routes.append(rule(rows))
        return routes[-1]

    monkeypatch.setattr(torch_backend, "segment_attention_pays", spy)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    mixed = make_engine(tiny_llama_dir, max_num_batched_tokens=256)
    if not mixed.backend._token_rows:
        pytest.skip(f"no native decode attention here ({mixed.backend.plan.describe()}): "
                    "every step takes the segment path")
    prompts = _prompts(mixed.vocab_size, seed=5, lengths=(300, 140, 20))
    got = run_all(mixed, prompts, params)
    assert True in routes and False in routes, routes

    monkeypatch.setattr(torch_backend, "SEGMENT_MIN_TOKENS", 10**9)
    routes.clear()
    rows_only = make_engine(tiny_llama_dir, max_num_batched_tokens=256)
    want = run_all(rows_only, prompts, params)
    assert routes and not any(routes)
    for rid in prompts:
        assert got[rid].token_ids == want[rid].token_ids, rid
        for x, y in zip(got[rid].logprobs, want[rid].logprobs, strict=True):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) <= 1e-4, (rid, x, y)
