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
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from backends.errors import InvalidRequestError
from backends.interface import StructuredOutputSpec

# ", " and ": " as json.dumps writes them: the layout models have seen most.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class CompiledGrammar:
    """A validated constraint; ``new_matcher()`` is cheap (a copy)."""

    def __init__(self, matcher: Any) -> None:
        self._pristine = matcher
        self._lock = threading.Lock()

    def new_matcher(self) -> "GrammarMatcher":
        with self._lock:
            return GrammarMatcher(self._pristine.deep_copy())


class GrammarMatcher:
    """One request's position in its grammar. Owned by the backend."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask_row: Any) -> None:
        """Write the allowed-next-token bits into one contiguous int32 row."""
        self.matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(),
                                             bitmask_row.numel() * bitmask_row.element_size())

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

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
        if self.matcher.compute_ff_bytes():
            return False
        return self.matcher.try_consume_tokens([token_id]) == 1

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """Turns a StructuredOutputSpec into a CompiledGrammar for one tokenizer.

    Thread-safe. The tokenizer table (about 0.7 s for a 50k vocabulary) is
    built on first use or by ``warm_up()``; compiled grammars are kept in an
    LRU of ``cache_size`` entries.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        self._hf_tokenizer = tokenizer          # tokenizers.Tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
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
        """Raises InvalidRequestError (naming ``spec.param``) for a constraint
        that does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        import llguidance
        tokenizer = self._tokenizer()
        try:
            grammar = _grammar_text(spec)
        except Exception as exc:  # noqa: BLE001 - converters raise assorted types
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {exc}", spec.param) from exc
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {spec.kind} constraint: {_first_line(matcher.get_error())}", spec.param)
        return CompiledGrammar(matcher)


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
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
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
