"""Constrained decoding with llguidance: compile a constraint once, then keep
one matcher per request that says, before each sampled token, which tokens
may come next (a bitmask over the vocabulary) and advances with each token
the request accepts.

Why llguidance (not xgrammar): no dependencies (xgrammar pulls in triton and
transformers), schema compiles 4-6x faster on SmolLM2's vocabulary, and Lark
grammars embed JSON schemas (``%json{...}``), which tool calling needs. Its
per-token mask (~28 us median here; xgrammar's ~2.5 us) is far below a
decode step (``BitmaskFiller`` says where it is computed).
docs/benchmarks.md has the figures (``benchmarks/grammar_engines.py``).

Compiling happens at admission (the gateway runs it off the event loop) and
is cached by constraint; the backend then only copies a ready matcher.

A constraint is never broken silently. What fails at compile time (it does
not compile, admits nothing, or its first token exceeds the engine's limits)
is a ConstraintError, a 400. What fails later (a token the matcher rejects,
a lexer or parser limit reached mid-output, a request whose grammar work
outruns its budget) fails that request alone: ``settle_tokens`` says which
rows, and the backend reports them in ``StepResult.failed`` with the type
``grammar_error``. Every grammar has llguidance's limits (``PARSER_LIMITS``)
and every request a budget of grammar time (``MASK_BUDGET_*``), so no
grammar makes a step wait long; docs/security.md lists them.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from backends.errors import ConstraintError
from backends.grammar_cache import GrammarCache, heap_bytes_in_use
from backends.interface import StructuredOutputSpec

log = logging.getLogger("baton.backend")

# ", " and ": " as json.dumps writes them: the layout models have seen most.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# llguidance's budgets for one grammar (LLParserLimits), tighter than its
# defaults so that one mask costs at most tens of milliseconds and one
# grammar's lexer tens of megabytes: a pattern like ``x{1000000}`` then fails
# at compile time in ~0.1 s instead of costing ~0.4-1.5 s of the step per
# mask and ~80 MB of cache, and one met mid-output costs one ~20 ms mask.
# verbose_errors off: errors then carry no grammar text and no parser state.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,       # default; a choice list is one lexeme, not a row
    "initial_lexer_fuel": 100_000,  # default 1,000,000
    "step_lexer_fuel": 50_000,      # default 200,000
    "step_max_items": 20_000,       # default 50,000
    "max_lexer_states": 50_000,     # default 250,000 (1-2 kB each)
    "max_grammar_size": 200_000,    # default 500,000
    "verbose_errors": False,
}
# A request's grammar work (masks and token checks, on whichever thread) may
# take this much in all, plus this much per token it has accepted; past it
# the request fails with a grammar error. A JSON schema needs 0.01-0.5 ms a
# token, a pattern like x{30000} ~28 ms.
MASK_BUDGET_BASE_S = 0.1
MASK_BUDGET_PER_TOKEN_S = 0.002
_MAX_ERROR_CHARS = 200


def parser_limits():
    import llguidance
    return llguidance.LLParserLimits(**PARSER_LIMITS)


class CompiledGrammar:
    """A validated constraint; ``new_matcher()`` is cheap (a copy that
    shares the compiled grammar's lexer). ``entry`` is its cache entry, told
    of its matchers' work and failures."""

    def __init__(self, matcher: Any, param: str) -> None:
        self._pristine = matcher
        self.param = param
        self.entry = None
        self._lock = threading.Lock()

    def new_matcher(self) -> "GrammarMatcher":
        with self._lock:
            return GrammarMatcher(self._pristine.deep_copy(), self)

    def _add_work(self, seconds: float) -> None:
        if self.entry is not None:
            self.entry.add_work(seconds)

    def _failed(self) -> None:
        if self.entry is not None:
            self.entry.drop()


class GrammarMatcher:
    """One request's position in its grammar. Owned by the backend.

    Every call into llguidance is timed: ``spent`` is the request's grammar
    work so far, against a budget that grows with the tokens it accepted
    (``failure`` says when it is spent)."""

    __slots__ = ("matcher", "spent", "tokens", "_grammar")

    def __init__(self, matcher: Any, grammar: CompiledGrammar | None = None) -> None:
        self.matcher = matcher
        self.spent = 0.0
        self.tokens = 0
        self._grammar = grammar

    def _charge(self, start: float) -> None:
        seconds = time.perf_counter() - start
        self.spent += seconds
        if self._grammar is not None:
            self._grammar._add_work(seconds)

    def fill_bitmask(self, bitmask_row: Any) -> None:
        """Write the allowed-next-token bits into one contiguous int32 row."""
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(),
                                             bitmask_row.numel() * bitmask_row.element_size())
        self._charge(start)

    def fill_bitmasks_along(self, proposals: list[int], bitmask_rows: Any) -> None:
        """The masks of a verification row's ``len(proposals) + 1``
        positions, one row of ``bitmask_rows`` each: position j's is the
        mask after the first j proposals. Past a proposal the grammar
        refuses, the rows repeat the last mask: that proposal is rejected
        there, so no later position is kept. The matcher ends where it began."""
        start = time.perf_counter()
        taken = 0
        try:
            for j in range(len(proposals) + 1):
                if j > taken:
                    bitmask_rows[j].copy_(bitmask_rows[taken])
                    continue
                row = bitmask_rows[j]
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(),
                                                     row.numel() * row.element_size())
                if j < len(proposals) and self.matcher.try_consume_tokens([proposals[j]]) == 1:
                    taken += 1
        finally:
            if taken:
                self.matcher.rollback(taken)
            self._charge(start)

    def accept(self, token_id: int) -> bool:
        start = time.perf_counter()
        ok = self.matcher.consume_token(token_id)
        self._charge(start)
        self.tokens += ok
        return ok

    def try_accept_unmasked(self, token_id: int) -> bool:
        """Advance by ``token_id`` if ``fill_bitmask`` would allow it, and
        say so; otherwise change nothing and answer False. ~2-3 us, against
        10-500 us for a mask.

        Where the grammar forces bytes (a JSON key, the ``": "`` after it),
        llguidance's mask allows only their canonical tokenization, while
        consuming accepts any tokens that spell them: there this answers
        False without trying, and the caller fills the mask. Elsewhere the
        mask is exactly the set of tokens the matcher accepts
        (tests/test_structured_engine.py checks it token by token)."""
        start = time.perf_counter()
        try:
            if self.matcher.compute_ff_bytes():
                return False
            ok = self.matcher.try_consume_tokens([token_id]) == 1
        finally:
            self._charge(start)
        self.tokens += ok
        return ok

    @property
    def budget(self) -> float:
        return MASK_BUDGET_BASE_S + MASK_BUDGET_PER_TOKEN_S * self.tokens

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def failure(self) -> str | None:
        """Why this request's constraint can no longer be kept (the matcher
        failed, or its grammar work outran its budget), else None. A failed
        grammar leaves the cache."""
        param = self._grammar.param if self._grammar is not None else "response_format"
        if self.matcher.is_error():
            if self._grammar is not None:
                self._grammar._failed()
            return (f"the output could not be kept to its constraint ({param}) after "
                    f"{self.tokens} tokens: {short_error(self.matcher.get_error())}")
        if self.spent > self.budget:
            if self._grammar is not None:
                self._grammar._failed()
            return (f"the output constraint ({param}) needed {self.spent:.2f} s of grammar "
                    f"work for {self.tokens} tokens, more than its budget ("
                    f"{MASK_BUDGET_BASE_S:g} s plus {MASK_BUDGET_PER_TOKEN_S * 1000:g} ms a "
                    f"token)")
        return None


def settle_tokens(accepting: list[tuple[int, GrammarMatcher]],
                  rows: list[tuple[int, GrammarMatcher]], token_ids: list[int],
                  request_ids: list[str]) -> dict[int, str]:
    """Advance each ``accepting`` row's matcher by its sampled token (a
    negative id: the row failed already), then say which of ``rows`` (every
    constrained row of the step) can no longer keep its constraint, by batch
    row, with why. Each failure is logged in one short line that holds no
    request content."""
    for i, matcher in accepting:
        if token_ids[i] >= 0:
            matcher.accept(token_ids[i])
    failures: dict[int, str] = {}
    for i, matcher in rows:
        if token_ids[i] < 0:
            continue
        why = matcher.failure()
        if why is not None:
            failures[i] = why
            log.warning("request %s: %s", request_ids[i], _log_safe(why))
    return failures


def settle_kept(matcher: GrammarMatcher, token_ids: tuple[int, ...], request_id: str
                ) -> str | None:
    """Advance a speculative row's matcher by the tokens it kept (its
    accepted proposals and its own token); why its constraint can no longer
    be kept, if so (logged as ``settle_tokens`` does)."""
    for token_id in token_ids:
        matcher.accept(token_id)
    why = matcher.failure()
    if why is not None:
        log.warning("request %s: %s", request_id, _log_safe(why))
    return why


def short_error(message: str) -> str:
    """llguidance's error as one line of at most ``_MAX_ERROR_CHARS``."""
    line = message.strip().splitlines()[0] if message.strip() else \
        "rejected by the grammar engine"
    return line if len(line) <= _MAX_ERROR_CHARS else line[:_MAX_ERROR_CHARS - 3] + "..."


_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'|`[^`]*`")


def _log_safe(text: str) -> str:
    """A failure for the log: quoted text (tokens, labels) left out."""
    return _QUOTED.sub("<...>", text)


class GrammarCompiler:
    """Turns a StructuredOutputSpec into a CompiledGrammar for one tokenizer.

    Thread-safe. The tokenizer table (about 0.7 s for a 50k vocabulary) is
    built on first use or by ``warm_up()``. Compiled grammars are kept in a
    GrammarCache (backends/grammar_cache.py: bounded by entries and bytes;
    failed and heavily worked grammars leave it).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256, cache_bytes: int | None = None) -> None:
        self._hf_tokenizer = tokenizer          # tokenizers.Tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self.cache = GrammarCache(cache_size) if cache_bytes is None \
            else GrammarCache(cache_size, cache_bytes)
        self._tokenizer_lock = threading.Lock()

    def warm_up(self) -> None:
        self._tokenizer()

    @property
    def ready(self) -> bool:
        """Whether the tokenizer table is built (compiles need no more set-up)."""
        return self._ll_tokenizer is not None

    def _tokenizer(self):
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Raises ConstraintError (an InvalidRequestError naming
        ``spec.param``) for a constraint that does not compile, admits no
        output, or fails its first token within the engine's limits."""
        entry = self.cache.get(spec)
        if entry is not None:
            return entry.value
        self._tokenizer()  # built once, not charged to the first grammar
        before = heap_bytes_in_use()
        compiled, size = self._compile(spec)
        after = heap_bytes_in_use()
        if before is not None and after is not None:
            size = max(size, after - before)
        compiled.entry = self.cache.put(spec, compiled, size)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> tuple[CompiledGrammar, int]:
        """The compiled grammar, probed, and its text's length."""
        import llguidance
        tokenizer = self._tokenizer()
        try:
            grammar = _grammar_text(spec)
        except Exception as exc:  # noqa: BLE001 - converters raise assorted types
            raise ConstraintError(f"invalid {spec.kind} constraint: {short_error(str(exc))}",
                                  spec.param) from exc
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ConstraintError(
                f"invalid {spec.kind} constraint: {short_error(matcher.get_error())}",
                spec.param)
        self._probe(matcher, spec)
        return CompiledGrammar(matcher, spec.param), len(grammar)

    def _probe(self, matcher: Any, spec: StructuredOutputSpec) -> None:
        """The first token's mask, and one allowed token taken, on a copy:
        what fails there (nothing allowed, a lexer or parser limit reached)
        fails every request, so it is a 400 before any of them runs. Its
        lexer states stay with the grammar: the first step needs them."""
        import numpy as np
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:self.vocab_size])
        if not probe.is_error():
            if allowed.size == 0:
                raise ConstraintError(f"the {spec.kind} constraint admits no output",
                                      spec.param)
            eos = set(self.eos_token_ids)
            first = next((int(t) for t in allowed if int(t) not in eos), None)
            if first is None or probe.consume_token(first):
                return
        error = short_error(probe.get_error())
        if " " not in error:  # a stop reason (NoExtension...): no output can complete it
            raise ConstraintError(f"the {spec.kind} constraint admits no complete output "
                                  f"(the grammar engine stops: {error})", spec.param)
        raise ConstraintError(
            f"the {spec.kind} constraint cannot be kept within the grammar engine's limits: "
            f"{error}", spec.param)


def _grammar_text(spec: StructuredOutputSpec) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark
    options = dict(_COMPACT)
    if spec.whitespace_pattern is not None:
        options = {"whitespace_pattern": spec.whitespace_pattern}
    elif spec.any_whitespace:
        options = {"whitespace_flexible": True}
    if spec.kind == "json":
        schema = json.loads(spec.source)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema,
                                                  overrides={**options, "lenient": spec.lenient})
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return LLMatcher.grammar_from_lark(choice_lark(choices))
    if spec.kind == "grammar":
        # Lark, or GBNF (llama.cpp's EBNF, what vLLM's xgrammar backend reads)
        return LLMatcher.grammar_from_lark(any_to_lark(spec.source))
    raise ValueError(f"unknown constraint kind {spec.kind!r}")


def exactness_problem(schema: Any) -> str | None:
    """Why the JSON schema ``schema`` cannot be enforced exactly (a keyword
    or format the grammar engine does not implement, named as it says it),
    or None. No tokenizer needed: a strict schema is checked with this
    before it joins a lenient grammar (where, having nothing to relax, it is
    enforced exactly all the same)."""
    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    return _exactness_problem(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _exactness_problem(schema_json: str) -> str | None:
    from llguidance import LLMatcher
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, overrides={"lenient": False})
    except Exception as exc:  # noqa: BLE001 - converters raise assorted types
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return _first_line(messages[0]) if is_error and messages else None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar engine"


def choice_lark(choices: list[str]) -> str:
    """One lexeme that matches exactly one of ``choices``, as a JSON schema's
    ``enum`` compiles: an alternation of literals, which the lexer follows
    as one automaton. (A rule ``"a" | "b" | ...`` puts every label in one
    parser row, and llguidance fails a row of over 2,000 items.) Every
    character but ASCII letters and digits is written ``\\x{hex}``, so no
    label can be read as regex syntax or end the literal."""
    def literal(text: str) -> str:
        return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
    return "start: /" + "|".join(literal(c) for c in choices) + "/"


class BitmaskFiller:
    """Computes one step's bitmasks, on a helper thread that overlaps the
    forward pass where that is free, else at once on the calling thread.

    llguidance drops the GIL while it computes, so a helper thread runs
    beside the forward pass; that only pays where a core is spare (or the
    forward runs on a GPU). Where the forward uses every core (2 torch
    threads on 2 cores), the helper thread preempts a torch thread that the
    others then wait for at their next barrier: it slowed the forward by
    about as much as filling the masks beforehand costs (~3 ms for 32 rows
    of a records schema; benchmarks/profile_structured_step.py), and in the
    server, where the event loop is a third busy thread, by more
    (docs/benchmarks.md, "Structured outputs"). llguidance's parallel
    executor was no faster than this loop there either.
    """

    def __init__(self, vocab_size: int) -> None:
        self.width = (vocab_size + 31) // 32
        self._pool = None

    def start(self, matchers: list[GrammarMatcher], overlap: bool) -> Future:
        """A Future of the [len(matchers), width] int32 bitmask; with
        ``overlap`` false it is filled before this returns."""
        if not overlap:
            done: Future = Future()
            done.set_result(self._fill(matchers))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-grammar")
        return self._pool.submit(self._fill, matchers)

    def _fill(self, matchers: list[GrammarMatcher]):
        import torch
        bitmask = torch.empty((len(matchers), self.width), dtype=torch.int32)
        for i, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask[i])
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
