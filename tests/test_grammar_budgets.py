"""The grammar engine's budgets (backends/grammar.py, grammar_cache.py), on
the tiny fixture's tokenizer: a constraint that fails at its first token is
refused at compile time; a choice list is one lexeme however long; a
matcher whose grammar work outruns its budget, or that fails, says so (and
its grammar leaves the cache); the cache is bounded by bytes as well as
entries; errors are short and carry no grammar text."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

import backends.grammar as grammar_module
from backends.errors import ConstraintError
from backends.grammar import GrammarCompiler, settle_tokens
from backends.grammar_cache import GrammarCache
from backends.interface import StructuredOutputSpec
from tests.conftest import IM_END_ID, TOKENIZER_VOCAB_SIZE

HEAVY = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x{1000000}$"}},
         "required": ["a"]}


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir) -> GrammarCompiler:
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    return GrammarCompiler(tokenizer, TOKENIZER_VOCAB_SIZE, (IM_END_ID,))


def _ids(compiler: GrammarCompiler, text: str) -> list[int]:
    return compiler._tokenizer().tokenize_str(text)


def _run(matcher, ids: list[int]) -> bool:
    return all(matcher.accept(t) for t in ids)


@pytest.mark.parametrize("spec", [
    StructuredOutputSpec("regex", "a{1000000}", param="structured_outputs"),
    StructuredOutputSpec("json", json.dumps(HEAVY)),
    StructuredOutputSpec("json", json.dumps({"$ref": "#"})),
    StructuredOutputSpec("grammar", 'start: "a" b\nb: /x{1000000}/', param="structured_outputs"),
])
def test_a_constraint_that_fails_its_first_token_is_refused_at_compile_time(compiler, spec):
    """Before: compiled and cached (~80 MB each for the patterns), then the
    request got 200 with whatever the dead matcher let through."""
    with pytest.raises(ConstraintError) as refused:
        compiler.compile(spec)
    assert refused.value.param == spec.param
    assert refused.value.code == "grammar_error"
    message = refused.value.message
    assert len(message) < 300 and "x{1000000}" not in message and "\n" not in message
    assert compiler.cache.get(spec) is None


def test_a_choice_of_thousands_of_labels_is_one_lexeme(compiler):
    """Before: one parser row per label, and llguidance fails rows of over
    2,000 items on the first token, leaving a matcher that allowed only EOS."""
    labels = [f"label {i:04d}" for i in range(3000)] + ["a/b|c", "x{3}", "new\nline", ""]
    compiled = compiler.compile(StructuredOutputSpec("choice", json.dumps(labels)))
    for label in ("label 2999", "label 0000", "a/b|c", "x{3}", "new\nline"):
        matcher = compiled.new_matcher()
        assert _run(matcher, _ids(compiler, label)), (label, matcher.error)
        assert matcher.matcher.is_accepting() and matcher.failure() is None
    matcher = compiled.new_matcher()
    assert _run(matcher, _ids(compiler, "label")) and not matcher.matcher.is_accepting()
    assert not _run(compiled.new_matcher(), _ids(compiler, "xxx"))  # x{3} is a literal


def test_a_failed_matcher_says_why_briefly_and_its_grammar_leaves_the_cache(compiler):
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "a": {"type": "string", "pattern": "^x{1000000}$"}},
        "required": ["n", "a"]}
    spec = StructuredOutputSpec("json", json.dumps(schema))
    compiled = compiler.compile(spec)  # the probe's first token is fine
    assert compiler.cache.get(spec) is not None
    matcher = compiled.new_matcher()
    assert _run(matcher, _ids(compiler, '{"n": 1, "a": "'))
    row = torch.zeros((TOKENIZER_VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)  # the pattern's lexeme starts here, past the lexer's limits
    matcher.accept(_ids(compiler, "x")[0])
    why = matcher.failure()
    assert why is not None and "(response_format)" in why
    assert len(why) < 400 and "x{1000000}" not in why and "\n" not in why
    assert compiler.cache.get(spec) is None
    compiler.cache.check_integrity()


def test_grammar_work_past_the_budget_fails_the_request(compiler, monkeypatch):
    compiled = compiler.compile(StructuredOutputSpec("regex", "[a-z]{1,20}"))
    matcher = compiled.new_matcher()
    row = torch.zeros((TOKENIZER_VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)
    assert matcher.spent > 0 and matcher.failure() is None
    monkeypatch.setattr(grammar_module, "MASK_BUDGET_BASE_S", matcher.spent / 2)
    monkeypatch.setattr(grammar_module, "MASK_BUDGET_PER_TOKEN_S", 0.0)
    assert "budget" in matcher.failure()


def test_settle_tokens_accepts_and_reports_failures_by_row(compiler, caplog):
    ok = compiler.compile(StructuredOutputSpec("regex", "ab+")).new_matcher()
    labels = ["secret-label-one", "secret-label-two"]
    bad = compiler.compile(StructuredOutputSpec("choice", json.dumps(labels))).new_matcher()
    a, b = _ids(compiler, "a")[0], _ids(compiler, "b")[0]
    rows = [(0, ok), (2, bad)]
    with caplog.at_level("WARNING", logger="baton.backend"):
        failed = settle_tokens(rows, rows, [a, -1, b], ["r0", "r1", "r2"])
    assert list(failed) == [2] and ok.tokens == 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "r2" in logged and "secret" not in logged and len(logged) < 400


def test_the_cache_is_bounded_by_bytes_as_well_as_entries(compiler):
    """Before: 256 entries whatever their size (2.6 GB for 32 heavy patterns)."""
    heavy = [StructuredOutputSpec("regex", f"x{{{20000 + i}}}") for i in range(4)]
    sizes = []
    for spec in heavy:
        compiler.compile(spec)
        sizes.append(compiler.cache.get(spec).nbytes)
    assert min(sizes) > 1_000_000, sizes  # measured, not the text's dozen bytes
    small = GrammarCompiler(compiler._hf_tokenizer, TOKENIZER_VOCAB_SIZE, (IM_END_ID,),
                            cache_bytes=2 * min(sizes))
    for spec in heavy:
        small.compile(spec)
        assert small.cache.nbytes <= 2 * min(sizes)
        small.cache.check_integrity()
    assert len(small.cache) < len(heavy) and small.cache.get(heavy[-1]) is not None


def test_cache_entries_leave_after_heavy_work_or_a_failure():
    cache = GrammarCache(max_entries=3, max_bytes=100, work_limit=1.0)
    entries = [cache.put(k, object(), 30) for k in "abc"]
    assert cache.nbytes == 90 and len(cache) == 3
    cache.put("d", object(), 30)  # over 100 bytes: "a" goes
    assert cache.get("a") is None and cache.nbytes == 90
    entries[1].add_work(0.6)
    assert cache.get("b") is not None
    entries[1].add_work(0.6)  # 1.2 s of work in all
    assert cache.get("b") is None and entries[1].dropped
    entries[2].drop()
    assert cache.get("c") is None and cache.nbytes == 30
    assert cache.put("huge", object(), 101).dropped and cache.get("huge") is None
    cache.check_integrity()
