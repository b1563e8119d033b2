"""Constrained decoding through the engine: per-row grammars in a shared
batch, greedy and sampled, through chunked prefill and preemption, on the
embedded SmolLM2 and on random-weight Qwen2 / Llama models."""

from __future__ import annotations

import json

import jsonschema
import pytest

from backends.errors import InvalidRequestError
from backends.interface import SamplingParams, StructuredOutputSpec
from service.chat_template import render_chat
from tests.engine_helpers import make_engine, run_all

SCHEMAS = {
    "nested_enum": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "weather": {"type": "object", "properties": {
            "sky": {"enum": ["sunny", "cloudy", "rainy"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["sky", "unit"], "additionalProperties": False}},
        "required": ["city", "weather"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                   "minItems": 1, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "optional_and_null": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16},
        "year": {"anyOf": [{"type": "integer", "minimum": 1800, "maximum": 2100},
                           {"type": "null"}]},
        "note": {"type": "string", "maxLength": 12}},
        "required": ["title", "year"], "additionalProperties": False},
}
QUESTIONS = {"nested_enum": "What is the weather like in Paris?",
             "array": "Name some colours of the rainbow.",
             "optional_and_null": "Tell me about a classic film."}


def _spec(schema: dict) -> StructuredOutputSpec:
    return StructuredOutputSpec("json", json.dumps(schema))


@pytest.fixture(scope="module")
def smol():
    return make_engine(None, num_kv_blocks=256, max_num_batched_tokens=256)


def _chat_ids(core, question: str) -> list[int]:
    tok = core.tokenizer
    text = render_chat(tok.chat_template, [
        {"role": "system", "content": "You answer with one JSON object."},
        {"role": "user", "content": question}],
        bos_token=tok.spec.bos_token, eos_token=tok.spec.eos_token)
    return tok.encode(text, add_special_tokens=False)


def test_schemas_hold_greedy_and_sampled_beside_free_rows(smol):
    """Every schema, greedy and sampled (seeded), shares each step with
    unconstrained requests; each row obeys its own constraint only."""
    prompts, params = {}, {}
    for name, schema in SCHEMAS.items():
        ids = _chat_ids(smol, QUESTIONS[name])
        prompts[f"{name}-greedy"] = ids
        params[f"{name}-greedy"] = SamplingParams(temperature=0, max_tokens=48,
                                                  structured=_spec(schema))
        if name != "optional_and_null":
            prompts[f"{name}-sampled"] = ids
            params[f"{name}-sampled"] = SamplingParams(
                temperature=1.0, top_p=0.95, seed=7, max_tokens=48, structured=_spec(schema))
    free_ids = _chat_ids(smol, "What is the capital of France?")
    prompts["free"] = free_ids
    params["free"] = SamplingParams(temperature=0, max_tokens=24)
    out = run_all(smol, prompts, params)
    for rid, res in out.items():
        if rid == "free":
            continue
        assert res.finish_reason == "stop", (rid, res.text)
        jsonschema.validate(json.loads(res.text), SCHEMAS[rid.rsplit("-", 1)[0]])
    # The free row is the same as when it runs alone: masks never leak.
    alone = run_all(smol, {"free": free_ids}, {"free": params["free"]})
    assert out["free"].token_ids == alone["free"].token_ids
    assert not out["free"].text.lstrip().startswith("{")


# The schema features OpenAI's structured outputs list beyond the ones above:
# string formats, number bounds, multipleOf, const, $defs and $ref.
FEATURES = {"type": "object", "properties": {
    "kind": {"const": "order"},
    "id": {"type": "string", "format": "uuid"},
    "placed": {"type": "string", "format": "date-time"},
    "day": {"type": "string", "format": "date"},
    "server": {"type": "string", "format": "ipv4"},
    "price": {"type": "number", "minimum": 0, "exclusiveMaximum": 100},
    "quantity": {"type": "integer", "multipleOf": 5, "minimum": 5, "maximum": 50},
    "parts": {"type": "array", "items": {"$ref": "#/$defs/part"}, "minItems": 1,
              "maxItems": 2}},
    "required": ["kind", "id", "placed", "day", "server", "price", "quantity", "parts"],
    "additionalProperties": False,
    "$defs": {"part": {"type": "object", "properties": {
        "name": {"enum": ["bolt", "nut", "gear"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "count"], "additionalProperties": False}}}
# A recursive schema (a model may nest it without end, so only compiled here).
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["name", "children"], "additionalProperties": False}}}


@pytest.mark.slow
def test_openai_schema_features_hold(smol):
    import datetime
    import ipaddress
    import uuid
    res = run_all(smol, {"r": _chat_ids(smol, "Write one order record as JSON.")},
                  SamplingParams(temperature=0, max_tokens=200,
                                 structured=_spec(FEATURES)))["r"]
    assert res.finish_reason == "stop", res.text
    record = json.loads(res.text)
    jsonschema.validate(record, FEATURES)
    # Formats, which jsonschema does not check by default.
    uuid.UUID(record["id"])
    datetime.datetime.fromisoformat(record["placed"].replace("Z", "+00:00"))
    datetime.date.fromisoformat(record["day"])
    ipaddress.IPv4Address(record["server"])
    smol.grammar.compile(_spec(TREE))   # accepted, not refused as unsupported


def test_max_tokens_first_ends_with_length_and_a_valid_prefix(smol):
    spec = _spec(SCHEMAS["nested_enum"])
    res = run_all(smol, {"r": _chat_ids(smol, QUESTIONS["nested_enum"])},
                  SamplingParams(temperature=0, max_tokens=5, structured=spec))["r"]
    assert res.finish_reason == "length" and len(res.token_ids) == 5
    assert res.text.startswith('{"city": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(res.text)


def test_choice_regex_and_grammar(tiny_qwen2_dir):
    core = make_engine(tiny_qwen2_dir)
    ids = [5, 17, 99, 230, 41]
    specs = {
        "choice": StructuredOutputSpec("choice", json.dumps(["yes", "no", "maybe"])),
        "regex": StructuredOutputSpec("regex", r"[A-Z][a-z]{2,5} [0-9]{2}"),
        "lark": StructuredOutputSpec("grammar", 'start: "The answer is " ("yes" | "no") "."'),
        "gbnf": StructuredOutputSpec("grammar", 'root ::= "colour: " ("red" | "blue")'),
    }
    out = run_all(core, {k: ids for k in specs},
                  {k: SamplingParams(temperature=0.8, seed=3, max_tokens=20, structured=s)
                   for k, s in specs.items()})
    assert out["choice"].text in ("yes", "no", "maybe")
    assert __import__("re").fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", out["regex"].text)
    assert out["lark"].text in ("The answer is yes.", "The answer is no.")
    assert out["gbnf"].text in ("colour: red", "colour: blue")
    assert all(r.finish_reason == "stop" for r in out.values())


@pytest.mark.parametrize("spec,param", [
    (StructuredOutputSpec("json", '{"type": "strin"}'), "response_format"),
    (StructuredOutputSpec("json", '{"$ref": "#/$defs/missing"}', param="structured_outputs"),
     "structured_outputs"),
    (StructuredOutputSpec("regex", "(unclosed", param="structured_outputs"),
     "structured_outputs"),
    (StructuredOutputSpec("grammar", "start: undefined_rule", param="structured_outputs"),
     "structured_outputs"),
])
def test_invalid_constraint_is_rejected_at_admission(smol, spec, param):
    with pytest.raises(InvalidRequestError) as info:
        smol.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
    assert info.value.param == param
    assert not smol.has_unfinished()


def test_constraint_conflicts_are_rejected():
    spec = _spec(SCHEMAS["array"])
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(ignore_eos=True, structured=spec)
    assert info.value.param == "ignore_eos"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=3, max_tokens=8, structured=spec)
    assert info.value.param == "min_tokens"


# A schema whose every value is bounded, so even a random model must finish it.
BOUNDED = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "level": {"enum": ["low", "mid", "high"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
    "required": ["ok", "level", "tags", "code"], "additionalProperties": False}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_model_obeys_and_survives_preemption_and_chunking(request, arch):
    """A random-weight model cannot produce the JSON by chance. Chunked
    prefill (16-token budget) and a KV pool too small for the batch force
    recompute preemptions; every seeded output equals its unpreempted twin."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    roomy = make_engine(model_dir)
    tight = make_engine(model_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    # Masks first on the roomy engine, deferred (picked unmasked first) on
    # the tight one: the order changes no token either.
    roomy.backend.defer_grammar_masks = False
    tight.backend.defer_grammar_masks = True
    prompts = {f"r{i}": [5 + i, 17, 99, 230, 41, 8, 77, 12, 300, 44, 9, 51][: 6 + 2 * i]
               for i in range(4)}
    params = {rid: SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=64,
                                  structured=_spec(BOUNDED))
              for i, rid in enumerate(prompts)}
    expected = run_all(roomy, prompts, params)
    got = run_all(tight, prompts, params)
    assert tight.scheduler.num_preemptions_total > 0
    for rid, res in got.items():
        assert res.finish_reason == "stop", (rid, res.text)
        jsonschema.validate(json.loads(res.text), BOUNDED)
        assert res.token_ids == expected[rid].token_ids, rid
    assert roomy.backend.grammar_rows["unmasked"] == 0
    counts = tight.backend.grammar_rows
    # (A random model's unmasked picks rarely fit; accepted ones are
    # covered by test_deferred_masks_change_no_token_or_logprob.)
    assert counts["masked"] == 0 and counts["repicked"] > 0, counts


@pytest.mark.slow
def test_deferred_masks_change_no_token_or_logprob():
    """Constrained rows pick unmasked first and fill their mask only when the
    grammar rejects the pick (the default on a CPU whose cores all run the
    forward pass). Greedy and seeded sampled rows, beside free rows, with
    logprobs: the same tokens and logprobs as masking every row first. A
    top-p row in the batch keeps the sampled rows masked first."""
    core = make_engine(None, num_kv_blocks=256, max_num_batched_tokens=256,
                       enable_prefix_caching=False)
    prompts, params = {}, {}
    for name in ("nested_enum", "array"):
        ids = _chat_ids(core, QUESTIONS[name])
        prompts[f"{name}-greedy"] = ids
        params[f"{name}-greedy"] = SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                                                  structured=_spec(SCHEMAS[name]))
        prompts[f"{name}-sampled"] = ids
        params[f"{name}-sampled"] = SamplingParams(temperature=0.8, seed=5, max_tokens=24,
                                                   logprobs=1, structured=_spec(SCHEMAS[name]))
    prompts["free"] = _chat_ids(core, "What is the capital of France?")
    params["free"] = SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=1)
    cut = {"nested_enum-greedy": params["nested_enum-greedy"], "free": params["free"],
           "array-sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24,
                                           structured=_spec(SCHEMAS["array"]))}
    backend = core.backend
    for batch_params in (params, cut):
        runs, counts = [], []
        for defer in (False, True):
            backend.defer_grammar_masks = defer
            before = dict(backend.grammar_rows)
            runs.append(run_all(core, {f"{k}/{defer}": prompts[k] for k in batch_params},
                                {f"{k}/{defer}": v for k, v in batch_params.items()}))
            counts.append({k: v - before[k] for k, v in backend.grammar_rows.items()})
        for rid in batch_params:
            masked, deferred = runs[0][f"{rid}/False"], runs[1][f"{rid}/True"]
            assert deferred.token_ids == masked.token_ids, rid
            assert deferred.logprobs == masked.logprobs, rid
            if rid != "free" and masked.finish_reason == "stop":
                jsonschema.validate(json.loads(deferred.text), SCHEMAS[rid.rsplit("-", 1)[0]])
        assert counts[0]["unmasked"] == counts[0]["repicked"] == 0, counts
        assert counts[1]["unmasked"] > 0 and counts[1]["repicked"] > 0, counts
        # Without a cut every constrained row defers; with one, the sampled
        # rows (and only they) are masked first.
        assert (counts[1]["masked"] > 0) == (batch_params is cut), counts


def test_a_mask_allows_exactly_what_the_matcher_accepts_unless_bytes_are_forced(smol):
    """The deferred order relies on this: outside forced bytes, the tokens
    llguidance's mask allows are exactly those its matcher consumes, token
    by token over the whole vocabulary, along a walk through several
    grammars; where bytes are forced the mask is narrower (only their
    canonical tokenization) and ``try_accept_unmasked`` declines."""
    import random
    import torch
    rng = random.Random(0)
    vocab = smol.grammar.vocab_size
    width = (vocab + 31) // 32
    specs = [_spec(SCHEMAS["nested_enum"]), _spec(BOUNDED), _spec(TREE),
             StructuredOutputSpec("regex", r"[a-z]{2,5}-\d+")]
    checked = declined = 0
    for spec in specs:
        matcher = smol.grammar.compile(spec).new_matcher()
        for _ in range(12):
            bitmask = torch.empty(width, dtype=torch.int32)
            matcher.fill_bitmask(bitmask)
            bits = ((bitmask.view(torch.uint8).long().unsqueeze(1) >> torch.arange(8)) & 1)
            mask = bits.view(-1)[:vocab].bool().tolist()
            allowed = [t for t in range(vocab) if mask[t]]
            if not allowed:
                break
            if matcher.matcher.compute_ff_bytes():
                declined += 1
                assert not matcher.try_accept_unmasked(allowed[0])
            else:
                checked += 1
                accepts = [matcher.matcher.validate_tokens([t]) == 1 for t in range(vocab)]
                assert accepts == mask
                token = rng.choice(allowed)
                assert matcher.try_accept_unmasked(token)
                matcher.matcher.rollback(1)
            assert matcher.accept(rng.choice(allowed))
    assert checked >= 10 and declined >= 5, (checked, declined)


def test_warm_up_prepares_the_grammar_engine(tiny_llama_dir):
    """The server's warm-up runs one constrained request, so the first user's
    does not build the grammar engine's tokenizer table."""
    from service.warmup import warm_up
    core = make_engine(tiny_llama_dir)
    assert not core.grammar.ready
    report = warm_up(core)
    assert core.grammar.ready and report.requests == 7


def test_bitmasks_are_the_same_overlapped_or_not(smol):
    """The helper-thread path (a spare core or a GPU) and the at-once path
    (every core busy with the forward pass) fill the same masks."""
    from backends.grammar import BitmaskFiller
    compiled = smol.grammar.compile(_spec(SCHEMAS["nested_enum"]))
    matchers = [compiled.new_matcher() for _ in range(3)]
    for token in smol.tokenizer.encode('{"city": "Pa', add_special_tokens=False):
        assert matchers[1].accept(token)
    filler = BitmaskFiller(smol.grammar.vocab_size)
    try:
        at_once = filler.start(matchers, overlap=False).result()
        overlapped = filler.start(matchers, overlap=True).result()
    finally:
        filler.shutdown()
    assert at_once.equal(overlapped)
    assert at_once[0].equal(at_once[2]) and not at_once[0].equal(at_once[1])



def test_compiled_constraints_are_cached_by_constraint(smol):
    first = smol.grammar.compile(_spec(SCHEMAS["array"]))
    assert smol.grammar.compile(_spec(SCHEMAS["array"])) is first
    assert smol.grammar.compile(StructuredOutputSpec("json", json.dumps(SCHEMAS["array"]),
                                                     param="structured_outputs")) is first
    assert smol.grammar.compile(_spec(SCHEMAS["nested_enum"])) is not first


# ------------------------------------- a constraint is never broken silently

def test_a_choice_of_three_thousand_labels_answers_one_of_them(smol):
    """Before: every label in one parser row; llguidance failed the row of
    over 2,000 items at the first token, the dead matcher allowed only EOS,
    and the request ended with "stop" and the text "label"."""
    labels = [f"label number {i}" for i in range(3000)]
    spec = StructuredOutputSpec("choice", json.dumps(labels), param="structured_outputs")
    res = run_all(smol, {"r": _chat_ids(smol, "Pick a label.")},
                  SamplingParams(temperature=0, max_tokens=16, structured=spec))["r"]
    assert res.finish_reason == "stop" and res.text in labels, res.text


MID_OUTPUT_FAILURE = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "a": {"type": "string", "pattern": "^x{1000000}$"}},
    "required": ["n", "a"], "additionalProperties": False}


@pytest.mark.slow
def test_a_grammar_that_fails_mid_output_fails_its_request_alone(smol, caplog):
    """The pattern's lexeme is past the lexer's limits only once the output
    reaches it: the request ends with a grammar error (not "stop" and a
    broken JSON), its grammar leaves the cache, the request beside it
    finishes as if alone, and the log line is short."""
    spec = _spec(MID_OUTPUT_FAILURE)
    free = SamplingParams(temperature=0, max_tokens=12)
    prompt = _chat_ids(smol, "Write a record.")
    with caplog.at_level("WARNING", logger="baton.backend"):
        out = run_all(smol, {"bad": prompt, "free": prompt},
                      {"bad": SamplingParams(temperature=0, max_tokens=40, structured=spec),
                       "free": free})
    assert out["bad"].finish_reason == "error", out["bad"]
    assert smol.grammar.cache.get(spec) is None
    alone = run_all(smol, {"free": prompt}, {"free": free})
    assert out["free"].token_ids == alone["free"].token_ids
    lines = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert lines and all(len(line) < 400 and "x{1000000}" not in line for line in lines)


def test_grammar_errors_carry_their_type_to_the_output(smol, monkeypatch):
    import backends.grammar as grammar_module
    monkeypatch.setattr(grammar_module, "MASK_BUDGET_BASE_S", -1.0)  # every row over budget
    smol.add_request("g", _chat_ids(smol, "Hi"),
                     SamplingParams(temperature=0, max_tokens=8,
                                    structured=_spec(SCHEMAS["array"])))
    smol.add_request("f", _chat_ids(smol, "Hi"), SamplingParams(temperature=0, max_tokens=3))
    finals = {}
    while smol.has_unfinished():
        for output in smol.step().outputs:
            if output.finished:
                finals[output.request_id] = output
    assert finals["g"].finish_reason == "error" and finals["g"].error_type == "grammar_error"
    assert "budget" in finals["g"].error and not finals["g"].new_token_ids
    assert finals["f"].finish_reason == "length" and finals["f"].error_type is None
    run_all(smol)  # every block back, every table empty
