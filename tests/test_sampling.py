"""Sampling through the engine on a tiny model: per-row parameters never leak,
seeds reproduce alone and in a crowd, and each control does what it says."""

from __future__ import annotations

import pytest
import torch

from backends.errors import ContextLengthExceededError, InvalidRequestError
from backends.interface import SamplingParams
from tests.engine_helpers import assert_all_free, make_engine, run_all

PROMPT = [5, 17, 99, 230, 41, 8, 77]


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _next_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def test_params_do_not_leak_between_rows(core):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = run_all(core, {"g": PROMPT, "s": PROMPT[:4]}, {"g": greedy, "s": seeded})
    crowd_params = {
        "g": greedy, "s": seeded,
        "hot": SamplingParams(temperature=2.5, max_tokens=10, ignore_eos=True),
        "topk": SamplingParams(temperature=1.0, top_k=3, max_tokens=7, ignore_eos=True),
        "topp": SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, max_tokens=4,
                               ignore_eos=True),
        "pen": SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=1.0,
                              repetition_penalty=1.5, max_tokens=3, ignore_eos=True),
        "bias": SamplingParams(temperature=0.0, logit_bias=((PROMPT[0], 100.0),),
                               max_tokens=5, ignore_eos=True),
    }
    crowd_prompts = {"g": PROMPT, "s": PROMPT[:4], "hot": PROMPT[::-1], "topk": PROMPT[2:],
                     "topp": PROMPT * 2, "pen": PROMPT[:3], "bias": PROMPT[1:]}
    crowd = run_all(core, crowd_prompts, crowd_params)
    assert crowd["g"].token_ids == alone["g"].token_ids
    assert crowd["s"].token_ids == alone["s"].token_ids
    assert crowd["bias"].token_ids == [PROMPT[0]] * 5
    # requests finished mid-batch at their own lengths
    assert [len(crowd[k].token_ids) for k in ("topp", "pen", "topk")] == [4, 3, 7]


def test_seed_reproducible_and_seeds_differ(core):
    def run(seed, rid):
        p = SamplingParams(temperature=1.2, seed=seed, max_tokens=16, ignore_eos=True)
        return run_all(core, {rid: PROMPT}, p)[rid].token_ids
    assert run(7, "a") == run(7, "b")
    assert run(7, "c") != run(8, "d")


def test_top_k_one_is_greedy(core):
    greedy = run_all(core, {"a": PROMPT}, SamplingParams(temperature=0.0, max_tokens=8,
                                                         ignore_eos=True))["a"]
    topk1 = run_all(core, {"b": PROMPT}, SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                        ignore_eos=True))["b"]
    assert greedy.token_ids == topk1.token_ids


def _first_token_counts(core, params: SamplingParams, n: int) -> torch.Tensor:
    prompts = {f"r{i}": PROMPT for i in range(n)}
    results = run_all(core, prompts, params)
    counts = torch.zeros(core.vocab_size)
    for r in results.values():
        counts[r.token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_matches_softmax(core, hf_model, temperature):
    n = 700
    counts = _first_token_counts(core, SamplingParams(temperature=temperature, max_tokens=1), n)
    probs = torch.softmax(_next_logits(hf_model, PROMPT) / temperature, -1)
    # Each of the likeliest tokens' frequency within 4.5 binomial standard
    # deviations of its probability (a wrong temperature or a biased race
    # moves the head of the distribution by far more).
    for token in probs.argsort(descending=True)[:8].tolist():
        p = probs[token].item()
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(counts[token].item() / n - p) < 4.5 * sigma + 1 / n, (token, p)


def test_top_k_top_p_min_p_restrict_support(core, hf_model):
    logits = _next_logits(hf_model, PROMPT)
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    k = 4
    counts = _first_token_counts(core, SamplingParams(temperature=1.0, top_k=k, max_tokens=1),
                                 300)
    assert set(counts.nonzero().flatten().tolist()) <= set(order[:k].tolist())
    # nucleus: the smallest prefix whose mass reaches top_p
    top_p = 0.5
    cum = probs[order].cumsum(0)
    nucleus = order[:int((cum < top_p).sum()) + 1].tolist()
    counts = _first_token_counts(core, SamplingParams(temperature=1.0, top_p=top_p,
                                                      max_tokens=1), 300)
    assert set(counts.nonzero().flatten().tolist()) <= set(nucleus)
    min_p = 0.3
    allowed = (probs >= min_p * probs.max()).nonzero().flatten().tolist()
    counts = _first_token_counts(core, SamplingParams(temperature=1.0, min_p=min_p,
                                                      max_tokens=1), 300)
    assert set(counts.nonzero().flatten().tolist()) <= set(allowed)


def test_penalties_match_reference_formula(core, hf_model):
    # A bias on one token, so bias and penalties are applied in the right order.
    favourite = 300
    bias = ((favourite, 6.0),)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias=bias,
                            presence_penalty=0.8, frequency_penalty=1.5,
                            repetition_penalty=1.4)
    got = run_all(core, {"a": PROMPT}, params)["a"].token_ids
    ids = list(PROMPT)
    expected = []
    for _ in range(10):
        logits = _next_logits(hf_model, ids)
        logits[favourite] += 6.0
        counts = torch.zeros_like(logits)
        for t in expected:
            counts[t] += 1
        seen = counts > 0
        seen[torch.tensor(PROMPT)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.4, logits * 1.4), logits)
        logits = logits - 1.5 * counts - 0.8 * (counts > 0).float()
        token = int(logits.argmax())
        expected.append(token)
        ids.append(token)
    plain = run_all(core, {"b": PROMPT}, SamplingParams(temperature=0.0, max_tokens=10,
                                                        ignore_eos=True,
                                                        logit_bias=bias))["b"].token_ids
    assert got == expected
    assert got != plain
    assert len(set(got)) > len(set(plain))  # penalties make repeats rarer


def test_min_tokens_holds_back_eos(core):
    eos = 2  # the tiny models' <|im_end|>
    push_eos = ((eos, 100.0),)
    res = run_all(core, {"a": PROMPT}, SamplingParams(temperature=0.0, logit_bias=push_eos,
                                                      min_tokens=5, max_tokens=20))["a"]
    assert len(res.token_ids) == 6 and eos not in res.token_ids[:5]
    assert res.token_ids[5] == eos and res.finish_reason == "stop"
    res = run_all(core, {"b": PROMPT}, SamplingParams(temperature=0.0, logit_bias=push_eos,
                                                      max_tokens=20))["b"]
    assert res.token_ids == [eos] and res.finish_reason == "stop"
    res = run_all(core, {"c": PROMPT}, SamplingParams(temperature=0.0, logit_bias=push_eos,
                                                      ignore_eos=True, max_tokens=4))["c"]
    assert res.token_ids == [eos] * 4 and res.finish_reason == "length"


def test_stop_token_ids_and_stop_strings(core):
    base = run_all(core, {"a": PROMPT}, SamplingParams(temperature=0.0, max_tokens=24,
                                                       ignore_eos=True))["a"]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    res = run_all(core, {"b": PROMPT}, SamplingParams(temperature=0.0, max_tokens=24,
                                                      stop_token_ids=(stop_id,),
                                                      ignore_eos=True))["b"]
    assert res.token_ids == base.token_ids[:first + 1]
    assert res.finish_reason == "stop" and res.stop_reason == stop_id

    text = base.text
    assert len(text) > 12, text
    stop = text[6:9]
    cut = text.index(stop)
    res = run_all(core, {"c": PROMPT}, SamplingParams(temperature=0.0, max_tokens=24,
                                                      stop=(stop, "\u2603never"),
                                                      ignore_eos=True))["c"]
    assert res.text == text[:cut]
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.token_ids == base.token_ids[:len(res.token_ids)]


def test_max_tokens_none_runs_to_context_length(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_model_len=24)
    res = run_all(core, {"a": PROMPT}, SamplingParams(temperature=0.0, max_tokens=None,
                                                      ignore_eos=True))["a"]
    assert len(res.token_ids) == 24 - len(PROMPT) and res.finish_reason == "length"


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=-1), "max_tokens"),  # 0 scores the prompt (test_prompt_scoring.py)
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(logprobs=-1), "logprobs"),  # the upper bound is the engine's (--max-logprobs)
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params_are_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_bad_requests_rejected_before_any_compute(tiny_llama_dir, monkeypatch):
    core = make_engine(tiny_llama_dir, max_model_len=64)
    calls = []
    monkeypatch.setattr(core.backend, "execute", lambda out: calls.append(out))
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ContextLengthExceededError) as info:
        core.add_request("long", [5] * 64, ok)
    assert "64" in str(info.value)
    with pytest.raises(ContextLengthExceededError):
        core.add_request("long2", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("empty", [], ok)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        core.add_request("oov", [5, 100_000], ok)
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("bias", [5], SamplingParams(logit_bias=((100_000, 1.0),)))
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError):
        core.add_request("stopid", [5], SamplingParams(stop_token_ids=(-1,)))
    assert not core.has_unfinished() and calls == []
    assert_all_free(core)


@pytest.mark.parametrize("vocab", [96, 100, 130])
def test_token_bitmask_masks_exactly_its_rows_and_bits(vocab):
    """Bit j of word w allows token 32 * w + j on the listed rows only;
    tokens past the bitmask's width are disallowed; other rows are untouched."""
    from backends.sampler import apply_token_bitmask
    gen = torch.Generator().manual_seed(7)
    width = 3                                     # 96 tokens' worth of bits
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, width), dtype=torch.int32, generator=gen)
    bitmask[1, 0] = 0                             # a whole word disallowed
    bitmask[1, 1] = -1                            # a whole word allowed
    rows = torch.tensor([3, 1])
    out = logits.clone()
    apply_token_bitmask(out, rows, bitmask)
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            word = int(bitmask[i, t // 32]) if t < 32 * width else 0
            allowed = (word >> (t % 32)) & 1
            assert out[row, t].item() == (logits[row, t].item() if allowed else float("-inf"))
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])


def _random_bitmask(gen: torch.Generator, rows: int, vocab: int, density: float) -> torch.Tensor:
    width = (vocab + 31) // 32
    bits = torch.rand(rows, width * 32, generator=gen) < density
    words = (bits.view(rows, width, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_masked_argmax_equals_masking_then_argmax():
    """The sparse masked argmax (rows the grammar rejected) picks what
    masking the whole row and taking argmax picks: ties go to the lowest id,
    an all -inf or empty row gives 0, bits past the vocabulary are ignored."""
    from backends.sampler import apply_token_bitmask, masked_argmax
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        vocab = (100, 130, 1000)[trial % 3]
        logits = torch.randint(-3, 3, (6, vocab), generator=gen).float()  # many ties
        logits[logits == -3] = float("-inf")
        rows = torch.randperm(6, generator=gen)[:4]
        if trial % 7 == 0:
            logits[rows[0]] = float("-inf")
        bitmask = _random_bitmask(gen, 4, vocab, (0.0, 0.002, 0.02, 0.5, 1.0)[trial % 5])
        full = logits.clone()
        apply_token_bitmask(full, rows, bitmask)
        assert torch.equal(masked_argmax(logits, rows, bitmask), full[rows].argmax(dim=-1)), trial


def test_greedy_argmax_equals_argmax():
    """The blockwise greedy argmax gives torch's argmax on every row: ties
    (to the lowest id, across blocks and inside one), a maximum in the tail
    past the last whole block, rows of only -inf (0), NaN (the first NaN),
    a non-contiguous view, vocabularies under two blocks."""
    from backends.sampler import _ARGMAX_BLOCK, greedy_argmax
    gen = torch.Generator().manual_seed(5)
    vocabs = (_ARGMAX_BLOCK - 1, 2 * _ARGMAX_BLOCK, 3 * _ARGMAX_BLOCK + 17, 49152, 49157)
    for trial in range(100):
        vocab = vocabs[trial % len(vocabs)]
        logits = torch.randint(-4, 4, (7, vocab), generator=gen).float()  # many ties
        if trial % 2:
            logits = torch.randn(7, vocab, generator=gen)
        logits[logits == -4] = float("-inf")
        logits[1] = float("-inf")
        logits[2, -3:] = 10.0            # the maximum in the tail (or the last block)
        logits[3, vocab // 2] = float("nan")
        logits[4, _ARGMAX_BLOCK - 1:_ARGMAX_BLOCK + 1] = 20.0  # a tie across two blocks
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1)), trial
        wide = torch.randn(3, vocab + 5, generator=gen)[:, 2:vocab + 2]  # strided rows
        assert torch.equal(greedy_argmax(wide), wide.argmax(dim=-1)), trial
    assert greedy_argmax(torch.empty(0, 49152)).shape == (0,)


def _batch(vocab: int, greedy: list[bool], seeds: list[int], allowed=None, deferred=None,
           top_p: float | None = None, logprobs: int | None = None):
    from backends.sampler import SamplingBatch
    n = len(greedy)
    return SamplingBatch(
        temperature=torch.tensor([1.0 if g else 0.7 for g in greedy]),
        greedy=None if all(greedy) or not any(greedy) else torch.tensor(greedy),
        all_greedy=all(greedy), top_k=None,
        top_p=None if top_p is None else torch.tensor([top_p] * n), min_p=None,
        penalties=None, bias=None, banned=None, allowed=allowed,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
        shared_generator=torch.Generator().manual_seed(99), num_logprobs=logprobs,
        deferred=deferred)


@pytest.mark.parametrize("mix", ["greedy", "sampled", "mixed"])
def test_deferred_masks_pick_what_the_masked_path_picks(mix):
    """Constrained rows that pick unmasked first and are picked again masked
    only where their grammar (here: their bitmask) rejects the pick get the
    tokens and logprobs of masking every constrained row first, greedy and
    seeded sampled alike, beside free rows; both branches are taken."""
    from backends.sampler import DeferredMasks, mask_can_wait, sample
    gen = torch.Generator().manual_seed(11)
    vocab, n = 300, 8
    greedy = {"greedy": [True] * n, "sampled": [False] * n,
              "mixed": [i % 2 == 0 for i in range(n)]}[mix]
    constrained = [0, 2, 3, 5, 6]
    accepted = rejected = 0
    for trial in range(40):
        # Peaked logits, so unmasked picks often fall inside the allowed set.
        logits = torch.randn(n, vocab, generator=gen) * 4
        density = (0.02, 0.3, 0.9, 1.0)[trial % 4]
        bitmask = _random_bitmask(gen, len(constrained), vocab, density)
        seeds = [trial * 10 + i for i in range(n)]
        masked = sample(logits.clone(), _batch(
            vocab, greedy, seeds, (torch.tensor(constrained), bitmask), logprobs=2))
        allowed_bits = [[bool((int(bitmask[k, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                        for k in range(len(constrained))]

        def resolve(tokens, allowed_bits=allowed_bits, bitmask=bitmask):
            nonlocal accepted, rejected
            bad = [k for k, t in enumerate(tokens) if t is None or not allowed_bits[k][t]]
            accepted += len(tokens) - len(bad)
            rejected += len(bad)
            return bad, (bitmask[bad] if bad else None)

        batch = _batch(vocab, greedy, seeds, None, DeferredMasks(constrained, resolve),
                       logprobs=2)
        assert all(mask_can_wait(batch, greedy[i]) for i in constrained)
        deferred = sample(logits.clone(), batch)
        assert deferred.token_ids.tolist() == masked.token_ids.tolist(), trial
        assert torch.equal(deferred.token_logprobs, masked.token_logprobs)
        assert torch.equal(deferred.top_ids, masked.top_ids)
    assert accepted > 20 and rejected > 20, (accepted, rejected)


def test_only_cut_free_sampled_rows_may_defer_their_mask():
    """Top-k, top-p and min-p choose their cut from the row's distribution,
    which the mask changes: a sampled row defers only where no cut acts on
    the batch; a greedy row always may."""
    from backends.sampler import mask_can_wait
    plain = _batch(10, [False, True], [1, 2])
    cut = _batch(10, [False, True], [1, 2], top_p=0.9)
    assert mask_can_wait(plain, False) and mask_can_wait(plain, True)
    assert not mask_can_wait(cut, False) and mask_can_wait(cut, True)


def test_a_close_race_is_left_to_the_mask(monkeypatch):
    """A sampled row whose unmasked pick wins its race (p / E) by less than
    float rounding could decide is not vouched for: the grammar gets None
    and the row is picked again masked; a clear winner is asked about."""
    import backends.sampler as sampler
    monkeypatch.setattr(sampler, "_exponential_noise", lambda probs, batch: torch.ones_like(probs))
    logits = torch.full((3, 64), -5.0)
    logits[0, 7] = logits[0, 9] = 2.0          # a tie
    logits[1, 7] = 2.0                         # a clear winner
    logits[2, 9] = logits[2, 7] = 2.0          # a tie, greedy: argmax is exact
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[:, 0] = (1 << 7) | (1 << 9)
    seen = []

    def resolve(tokens):
        seen.extend(tokens)
        bad = [k for k, t in enumerate(tokens) if t is None]
        return bad, bitmask[bad]

    batch = _batch(64, [False, False, True], [1, 2, 3],
                   deferred=sampler.DeferredMasks([0, 1, 2], resolve))
    out = sampler.sample(logits.clone(), batch)
    assert seen == [None, 7, 7]
    assert out.token_ids.tolist() == [7, 7, 7]
