"""Speculative decoding (scheduler/speculative.py, scheduler/draft.py,
backends/speculative.py): the configuration, the n-gram proposer, the
per-step budget, and the engine's output with speculation token for token
its output without, greedy, seeded and with every sampling parameter, for
proposals that are always right, always wrong or right half the time, with
every KV block returned; the draft model; the metrics and the span."""

from __future__ import annotations

import json
import math

import pytest
import torch

from backends.interface import SamplingParams
from scheduler.speculative import (NgramProposer, ProposalBudget, SpeculativeConfig)
from tests.engine_helpers import OracleProposer, assert_all_free, make_engine, run_all

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


# ------------------------------------------------------------ configuration
def test_config_parses_vllm_spelling():
    spec = SpeculativeConfig.parse(NGRAM)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 4, 2, 3)
    draft = SpeculativeConfig.parse(json.dumps({
        "method": "draft_model", "model": "some/model", "num_speculative_tokens": 3,
        "quantization": "gguf", "draft_tensor_parallel_size": 1}))
    assert (draft.model, draft.quantization) == ("some/model", "gguf")
    assert "draft model some/model (gguf), 3 tokens" == draft.describe()


@pytest.mark.parametrize("text,error", [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "between 1 and"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "speed": 3}', "unknown key(s) speed"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"method": "draft_model", "model": "m", "num_speculative_tokens": 2, '
     '"draft_tensor_parallel_size": 2}', "one rank"),
])
def test_config_refuses_what_it_cannot_honour(text, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(text)


def test_cli_flag_is_checked_at_parse_time(capsys):
    from service.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "x"}'])
    assert "--speculative-config" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--speculative-config", NGRAM])
    assert SpeculativeConfig.parse(ns.speculative_config).method == "ngram"


# --------------------------------------------------------------- proposers
def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search_as_tokens_arrive():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    proposer = NgramProposer(2, 4)
    for end in range(1, len(tokens) + 1, 7):  # the index grows incrementally
        assert proposer.propose("r", tokens[:end], 3) == _brute_force(tokens[:end], 3, 2, 4)
    assert proposer.propose("s", [1, 2, 3, 4, 9, 1, 2, 3], 5) == [4, 9, 1, 2, 3]
    assert proposer.propose("t", [5, 6, 7], 4) == []
    proposer.release(["r", "s", "t"])
    assert proposer.request_ids == set()


def test_budget_shares_the_cheap_rows_by_acceptance():
    spec = SpeculativeConfig("ngram", 4, disable_by_batch_size=8)
    budget = ProposalBudget(spec, 8)
    assert budget.shares(["a"]) == {"a": 2}       # the prior: two proposals are worth it
    for _ in range(10):
        budget.record("a", 4, 4)
    assert budget.shares(["a"]) == {"a": 4}       # always right: all it may
    for _ in range(10):
        budget.record("b", 4, 0)
    assert budget.shares(["b"]) == {"b": 1}       # never right: a one-token probe
    assert sum(budget.shares(["a", "b", "c", "d", "e"]).values()) <= 8 - 5
    assert budget.shares([f"r{i}" for i in range(8)]) == {}  # disable_by_batch_size
    draft = ProposalBudget(SpeculativeConfig("draft_model", 4, model="m"), 8)
    for _ in range(10):
        draft.record("b", 4, 0)
    assert draft.shares(["b"]) == {}              # a draft's proposal costs a forward pass


def test_a_draft_proposes_only_where_its_cost_pays():
    """k proposals yield 1 + a + ... + a^k tokens for 1 + k * cost steps of
    time: a draft a tenth of the target's cost proposes all it may, one as
    costly as the target nothing, even if always right."""
    from scheduler.speculative import COST_SAMPLES, _draft_k
    assert _draft_k(0.9, 0.1, 4) == 4
    assert _draft_k(1.0, 1.0, 4) == 0             # k + 1 tokens for k + 1 steps
    assert _draft_k(0.9, 0.3, 8) == 5             # 4.69 tokens in 2.5 steps; 6: 5.22 in 2.8
    assert _draft_k(0.3, 0.1, 4) == 1
    budget = ProposalBudget(SpeculativeConfig("draft_model", 4, model="m"), 8)
    for _ in range(10):
        budget.record("a", 4, 4)
    for _ in range(COST_SAMPLES - 1):
        budget.observe_draft(0.010)
        budget.observe_target(0.011)
    assert budget.draft_cost is None and budget.shares(["a"]) == {"a": 4}  # not measured yet
    assert budget.shares(["a", "b", "c"]) == {"a": 4}  # and only one request measures it
    budget.observe_target(None)                   # a step with prompt tokens: not now
    assert budget.shares(["a"]) == {}
    budget.observe_target(0.013, rows=3)          # a verification step: not timed,
    assert budget.shares(["a"]) == {}             # and the next step is a plain one
    budget.observe_target(0.030, rows=4, requests=4)  # plain, of four rows: not timed
    assert budget.shares(["a", "b", "c", "d"]) == {"a": 4}  # but one may probe after it
    assert budget.draft_cost is None
    budget.observe_target(0.011)
    budget.observe_draft(0.010)
    assert budget.draft_cost == pytest.approx(0.010 / 0.011)
    assert budget.shares(["a"]) == {}             # measured as costly as the target
    for _ in range(20):                           # steps of many rows do not move it:
        budget.observe_target(0.100, rows=8, requests=8)  # a draft's rounds grow with the batch too
    assert budget.draft_cost == pytest.approx(0.010 / 0.011)
    assert budget.shares(["a"]) == {}
    budget.forget_costs()                         # the warm-up's cold passes
    assert budget.draft_cost is None
    # A batch: the draft's rounds delay every decoding request, proposing or
    # not. 8 decodes, a draft round a tenth of a step: two good proposers
    # pay (1 + 2 * 3.69 / 8 tokens for 1.4 steps' time: 1.37x), one does not.
    wide = ProposalBudget(SpeculativeConfig("draft_model", 4, model="m"), 16)
    for _ in range(COST_SAMPLES):
        wide.observe_draft(0.010)
        wide.observe_target(0.100)
    for rid in ("a", "b", "c"):
        for _ in range(10):
            wide.record(rid, 4, 4 if rid != "c" else 0)
    batch = ["a", "b"] + [f"d{i}" for i in range(6)]
    assert wide.shares(batch) == {"a": 4, "b": 4}
    assert wide.shares(["a"] + [f"d{i}" for i in range(11)]) == {}
    ngram = ProposalBudget(SpeculativeConfig("ngram", 4), 8)
    ngram.observe_target(0.01)                    # an n-gram lookup costs no forward pass
    assert ngram.draft_cost is None



def _check_acceptance(results, mode: str) -> None:
    """Proposals were made, and an oracle of ``mode`` had all, none or some
    of them accepted."""
    proposed = sum(r.spec_proposed for r in results.values())
    accepted = sum(r.spec_accepted for r in results.values())
    assert proposed > 0
    if mode == "right":
        assert accepted == proposed
    elif mode == "wrong":
        assert accepted == 0
    else:
        assert 0 < accepted < proposed

# ------------------------------------------------------------------ engine
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=24,
                             ignore_eos=True, logprobs=1),
    "processed": SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5,
                                frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.01,
                                logit_bias=((7, 2.0),), min_tokens=6, max_tokens=24),
}


def _prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {f"p{n}": torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 30)}


def _same(a, b) -> None:
    for rid in a:
        assert a[rid].token_ids == b[rid].token_ids, rid
        assert a[rid].finish_reason == b[rid].finish_reason, rid
        # (architectures whose verification rows take the eager path's
        # prefill attention, SDPA, sum in another order: ~1e-6)
        for x, y in zip(a[rid].logprobs, b[rid].logprobs, strict=True):
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-5)
            assert all(math.isclose(p, q, abs_tol=1e-5) for (_, p), (_, q) in zip(x.top, y.top))


@pytest.mark.parametrize("params", list(PARAMS))
# "half" (accepted, then rejected) in the quick loop; all right, all wrong: slow
@pytest.mark.parametrize("mode", [pytest.param("right", marks=pytest.mark.slow),
                                  pytest.param("wrong", marks=pytest.mark.slow), "half"])
def test_output_is_the_output_without_speculation(tiny_llama_dir, params, mode):
    """Every proposal verified; the accepted ones exactly those the oracle
    got right; the tokens, logprobs and finish reasons those of the plain
    run; every block back."""
    plain = make_engine(tiny_llama_dir)
    prompts = _prompts(plain.vocab_size)
    reference = run_all(plain, prompts, PARAMS[params])
    core = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    oracle = OracleProposer({r: v.token_ids for r, v in reference.items()}, mode, core.vocab_size)
    core.speculator.proposer = oracle
    spec = run_all(core, prompts, PARAMS[params])   # also checks every block came back
    _same(reference, spec)
    _check_acceptance(spec, mode)
    assert oracle.calls > 0


@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=pytest.mark.slow), "qwen3",
                                  pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_greedy_equal_for_each_architecture(request, new_arch_dirs, arch):
    path = (request.getfixturevalue(f"tiny_{arch}_dir") if arch in ("qwen2", "qwen3")
            else new_arch_dirs(arch))
    plain = make_engine(path)
    prompts = _prompts(plain.vocab_size)
    reference = run_all(plain, prompts, PARAMS["greedy"])
    core = make_engine(path, speculative_config=NGRAM)
    core.speculator.proposer = OracleProposer({r: v.token_ids for r, v in reference.items()},
                                              "half", core.vocab_size)
    _same(reference, run_all(core, prompts, PARAMS["greedy"]))


@pytest.mark.slow
def test_bf16_and_the_compiled_step(tiny_llama_dir, monkeypatch, tmp_path):
    """bf16 (verification rows on the bf16 gemv where they fit, oneDNN
    above) and the compiled step: the same tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for extra in ({"dtype": "bfloat16"}, {"compile": True}):
        plain = make_engine(tiny_llama_dir, **extra)
        prompts = _prompts(plain.vocab_size)
        reference = run_all(plain, prompts, PARAMS["seeded"])
        core = make_engine(tiny_llama_dir, speculative_config=NGRAM, **extra)
        core.speculator.proposer = OracleProposer({r: v.token_ids for r, v in reference.items()},
                                                  "half", core.vocab_size)
        spec = run_all(core, prompts, PARAMS["seeded"])
        assert [v.token_ids for v in spec.values()] == [v.token_ids for v in reference.values()]


def test_stops_inside_accepted_proposals(tiny_llama_dir):
    """A stop token id, a stop string and max_tokens that fall inside a run
    of accepted proposals end the request there, as without speculation."""
    plain = make_engine(tiny_llama_dir)
    prompts = _prompts(plain.vocab_size)
    free = run_all(plain, prompts, PARAMS["greedy"])
    rid = next(iter(prompts))
    stop_id = free[rid].token_ids[9]
    text = free[rid].text
    variants = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_id,)),
                SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)]
    if len(text) > 12:
        variants.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                       stop=(text[8:12],)))
    for params in variants:
        reference = run_all(make_engine(tiny_llama_dir), prompts, params)
        core = make_engine(tiny_llama_dir, speculative_config=NGRAM)
        core.speculator.proposer = OracleProposer({r: v.token_ids for r, v in free.items()},
                                                  "right", core.vocab_size)
        spec = run_all(core, prompts, params)
        for r in prompts:
            assert spec[r].token_ids == reference[r].token_ids
            assert spec[r].text == reference[r].text
            assert (spec[r].finish_reason, spec[r].stop_reason) == (
                reference[r].finish_reason, reference[r].stop_reason)


def test_preemption_prefix_caching_and_aborts(tiny_llama_dir):
    """A pool small enough to preempt, a shared prefix found in the cache,
    and a request aborted between steps: the same tokens for the others,
    every block back."""
    prompts = {f"q{i}": [5, 9, 13, 21, 34, 55, 89, 144] + [3 + i] * (9 + i) for i in range(5)}
    small = dict(num_kv_blocks=26, block_size=4, max_model_len=64)
    reference = run_all(make_engine(tiny_llama_dir, **small), prompts, PARAMS["greedy"])
    core = make_engine(tiny_llama_dir, speculative_config=NGRAM, **small)
    core.speculator.proposer = OracleProposer({r: v.token_ids for r, v in reference.items()},
                                              "half", core.vocab_size)
    spec = run_all(core, prompts, PARAMS["greedy"])
    assert core.scheduler.num_preemptions_total > 0
    _same(reference, spec)
    core = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    core.speculator.proposer = OracleProposer({r: v.token_ids for r, v in reference.items()},
                                              "right", core.vocab_size)
    for rid, ids in prompts.items():
        core.add_request(rid, ids, PARAMS["greedy"])
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(200):
        if not core.has_unfinished():
            break
        if step == 3:
            core.abort("q2")
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    for rid in prompts:
        if rid != "q2":
            assert tokens[rid] == reference[rid].token_ids, rid
    assert_all_free(core)


def test_rejected_proposals_return_their_blocks(tiny_llama_dir):
    """After every step a speculating request holds no block beyond what its
    tokens need (the proposals' slots come back when they are rejected)."""
    core = make_engine(tiny_llama_dir, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 8}), block_size=4)
    prompts = _prompts(core.vocab_size)
    core.speculator.proposer = OracleProposer({r: [0] * 64 for r in prompts}, "wrong",
                                              core.vocab_size)
    for rid, ids in prompts.items():
        core.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=20,
                                                  ignore_eos=True))
    while core.has_unfinished():
        core.step()
        for rid, request in core.scheduler.requests.items():
            held = core.kv_cache.num_request_blocks(rid)
            # its tokens, plus the next step's proposals (allocated by now)
            assert held <= -(-(request.num_tokens + len(request.spec_token_ids)) // 4)
    core.check_integrity()


def test_ngram_speculates_on_repetitive_text_and_reports_it(tiny_llama_dir):
    """The real n-gram proposer on a prompt that repeats itself: proposals
    are found and verified, the tokens are the plain run's, and the engine's
    statistics and the request's output carry the same counts."""
    plain = make_engine(tiny_llama_dir)
    seed = [11, 22, 33, 44]
    first = run_all(plain, {"s": seed}, SamplingParams(temperature=0.0, max_tokens=30,
                                                       ignore_eos=True))["s"].token_ids
    # the prompt holds the continuation the model will produce: copy-like text
    prompt = seed + first + seed
    reference = run_all(make_engine(tiny_llama_dir), {"c": prompt},
                        PARAMS["greedy"])
    core = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    seen = []
    original = core._stats
    core._stats = lambda *a, **k: seen.append(original(*a, **k)) or seen[-1]
    spec = run_all(core, {"c": prompt}, PARAMS["greedy"])
    _same(reference, spec)
    # (a random model need not continue as its context did: proposals are
    # made and verified, acceptance is whatever the model gives)
    assert sum(s.spec_proposed for s in seen) == spec["c"].spec_proposed > 0
    assert sum(s.spec_accepted for s in seen) == spec["c"].spec_accepted
    assert {s.spec_method for s in seen if s.spec_verified_rows} == {"ngram"}


# Every value bounded, so even a random-weight model must finish it.
_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["ok", "level", "tags"], "additionalProperties": False}


def _structured(**kw) -> SamplingParams:
    from backends.interface import StructuredOutputSpec
    return SamplingParams(max_tokens=48, structured=StructuredOutputSpec(
        "json", json.dumps(_SCHEMA)), **kw)


def test_masks_along_proposals_are_the_masks_step_by_step_and_roll_back(tiny_llama_dir):
    """Position j's mask is the grammar's after the first j proposals; past
    a refused proposal the masks repeat; the matcher ends where it began."""
    from backends.grammar import settle_kept
    core = make_engine(tiny_llama_dir)
    grammar = core.backend.grammar
    reference = run_all(core, {"r": [5, 6, 7]}, _structured(temperature=0.0))["r"].token_ids
    width = (grammar.vocab_size + 31) // 32
    along = grammar.compile(_structured().structured).new_matcher()
    step = grammar.compile(_structured().structured).new_matcher()
    tokens = reference[:6]
    settle_kept(along, tuple(tokens[:2]), "r")   # somewhere inside the output
    settle_kept(step, tuple(tokens[:2]), "r")
    proposals = tokens[2:5] + [0]
    assert along.matcher.validate_tokens(proposals) == 3  # token 0 is no JSON
    masks = torch.empty((len(proposals) + 1, width), dtype=torch.int32)
    along.fill_bitmasks_along(proposals, masks)
    one = torch.empty(width, dtype=torch.int32)
    for j in range(len(proposals) + 1):
        step.fill_bitmask(one)
        if j <= 3:
            assert torch.equal(masks[j], one), j
        else:   # past the refused proposal the last mask repeats
            assert torch.equal(masks[j], masks[3])
        if j < 3:
            assert step.accept(proposals[j])
    assert along.matcher.validate_tokens(tokens[2:]) == len(tokens) - 2  # still at token 2


@pytest.mark.parametrize("mode", ["right", "wrong", "half"])
def test_structured_output_with_speculation_is_the_output_without(tiny_llama_dir, mode):
    """The grammar masks every verified position at its own state and takes
    only the kept tokens (rolling back what it tried): greedy and seeded
    outputs equal the plain run's and hold the schema."""
    plain = make_engine(tiny_llama_dir)
    prompts = {"g": [5, 6, 7], "s": [9, 10, 11, 12]}
    params = {"g": _structured(temperature=0.0, logprobs=2),
              "s": _structured(temperature=0.9, seed=4, logprobs=2)}
    reference = run_all(plain, prompts, params)
    core = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    oracle = OracleProposer({r: v.token_ids for r, v in reference.items()}, mode,
                            core.vocab_size)
    core.speculator.proposer = oracle
    spec = run_all(core, prompts, params)
    _same(reference, spec)
    for res in spec.values():
        assert res.finish_reason == "stop"
        assert set(json.loads(res.text)) == {"ok", "level", "tags"}
    _check_acceptance(spec, mode)


@pytest.mark.slow
def test_seeded_sampling_keeps_its_distribution(tiny_llama_dir):
    """Unseeded sampling with speculation against without: the first three
    tokens' joint frequencies over many runs agree (a chi-square test on the
    most frequent outcomes, fixed seeds for the engines)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    prompt = [5, 17, 40]
    runs = 150

    def counts(core):
        out = {}
        for i in range(runs):
            res = run_all(core, {f"r{i}": prompt}, params)[f"r{i}"].token_ids
            out[tuple(res)] = out.get(tuple(res), 0) + 1
        return out

    plain = counts(make_engine(tiny_llama_dir, seed=1))
    core = make_engine(tiny_llama_dir, seed=2, speculative_config=NGRAM)
    # proposals: always the plain run's most frequent continuation
    top = max(plain, key=plain.get)
    core.speculator.proposer = OracleProposer({f"r{i}": list(top) for i in range(runs)}, "right",
                                              core.vocab_size)
    spec = counts(core)
    keys = sorted(set(plain) | set(spec), key=lambda k: -(plain.get(k, 0) + spec.get(k, 0)))
    common = keys[:6]
    table = [[plain.get(k, 0) for k in common] + [runs - sum(plain.get(k, 0) for k in common)],
             [spec.get(k, 0) for k in common] + [runs - sum(spec.get(k, 0) for k in common)]]
    cols = [c for c in range(len(table[0])) if table[0][c] + table[1][c] > 0]
    chi2 = 0.0
    for c in cols:
        total = table[0][c] + table[1][c]
        for r in (0, 1):
            expected = total / 2
            chi2 += (table[r][c] - expected) ** 2 / expected
    # 99.9th percentile of chi-square with up to 6 degrees of freedom
    assert chi2 < 22.46, (table, chi2)


# -------------------------------------------------------------- draft model
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_draft_model_proposes_and_changes_nothing(tiny_llama_dir, quantization):
    """The target itself (or its int8 copy) as its own draft: nearly every
    greedy proposal is accepted; the tokens are the plain run's; the draft
    backend holds no state once the requests end."""
    spec = json.dumps({"method": "draft_model", "model": str(tiny_llama_dir),
                       "num_speculative_tokens": 3, "quantization": quantization})
    plain = make_engine(tiny_llama_dir)
    prompts = _prompts(plain.vocab_size)
    for params in ("greedy", "seeded"):
        reference = run_all(plain, prompts, PARAMS[params])
        core = make_engine(tiny_llama_dir, speculative_config=spec)
        results = run_all(core, prompts, PARAMS[params])
        _same(reference, results)
        draft = core.speculator.proposer
        assert draft.request_ids == set() and draft.backend.request_state_ids() == set()
        if params == "greedy":
            proposed = sum(r.spec_proposed for r in results.values())
            accepted = sum(r.spec_accepted for r in results.values())
            assert proposed > 0 and accepted >= 0.7 * proposed  # int8 rounds differently
        # Its cost is timed on steps of one row (a batch only probes): the
        # server's warm-up times it. What the timing says is the machine's
        # business; what follows from it is checked on given costs: a draft
        # that costs what the target does stops proposing, a cheap one goes on.
        from scheduler.speculative import COST_SAMPLES
        from service.warmup import warm_up
        warm_up(core)
        budget = core.speculator.budget
        assert budget.draft_cost is not None and budget.draft_cost > 0
        for draft_s, proposes in ((0.010, False), (0.0005, True)):
            budget.forget_costs()
            for _ in range(COST_SAMPLES):
                budget.observe_draft(draft_s)
                budget.observe_target(0.010)
            assert budget.draft_cost == pytest.approx(draft_s / 0.010)
            assert bool(budget.shares(["x"])) is proposes, draft_s


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama_dir):
    from backends.loader import resolve_model_path
    embedded = str(resolve_model_path(None))  # SmolLM2's 49,152 tokens, not the fixture's
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(tiny_llama_dir, speculative_config=json.dumps(
            {"method": "draft_model", "model": embedded, "num_speculative_tokens": 2}))


# ------------------------------------------------------------------ serving
def test_served_streams_metrics_and_dashboard(tiny_llama_dir):
    """Through the gateway: a streamed completion's text is the plain
    server's (a chunk may carry several tokens), and /metrics and
    /dashboard/stats report the proposals by method."""
    import openai

    from tests.server_helpers import running_server
    body = dict(model="m", prompt="hello hello hello hello", max_tokens=24, temperature=0.0)
    texts, reference_ids = [], []
    for spec in (None, NGRAM):
        core = make_engine(tiny_llama_dir, speculative_config=spec)
        if spec is not None:  # proposals: the plain server's continuation
            core.speculator.proposer = OracleProposer(_Reference(reference_ids), "right",
                                                      core.vocab_size)
        with running_server(core, model_name="m") as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
            stream = client.completions.create(stream=True, **body)
            texts.append("".join(c.choices[0].text for c in stream if c.choices))
            if spec is None:
                reference_ids = core.tokenizer.encode(texts[0], add_special_tokens=False)
                continue
            import urllib.request
            metrics = urllib.request.urlopen(f"{server.base_url}/metrics").read().decode()
            stats = json.loads(urllib.request.urlopen(
                f"{server.base_url}/dashboard/stats").read())
    assert texts[0] == texts[1]
    accepted = [line for line in metrics.splitlines()
                if line.startswith("baton_spec_decode_accepted_tokens_total{")]
    assert accepted and 'method="ngram"' in accepted[0] and float(accepted[0].split()[-1]) > 0
    assert stats["spec_method"] == "ngram" and stats["spec_accepted"] > 0
    assert stats["spec_tokens_per_row"] > 1


class _Reference(dict):
    """Every request's reference continuation is the same token list."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    def __getitem__(self, key):
        return self.ids
