"""Speculative decoding: its configuration, the n-gram (prompt lookup)
proposer, and how many tokens each request may propose in a step.

A decoding request proposes up to k tokens; the next step computes its last
token and the proposals as one row of k + 1 tokens (each attending to its
own context: backends/attention.py's token rows), and the backend samples
the target's own token at every one of those positions, exactly as k + 1
plain steps would (the same raw logits, processing and random draws:
backends/speculative.py). The proposals are accepted while they equal those
samples, and the first sample that differs, or the one after the last
proposal, is the step's own new token. So the output is token for token the
output without speculation, greedy or seeded, and every token is a sample of
the target's distribution; rejected positions cost a little compute and
their KV slots are rewritten later.

Proposals are cheap where a step is bound by reading the weights (a few
rows cost what one does) and not where it is bound by arithmetic, so the
number of tokens a step may spend on proposals is bounded by the backend's
``speculative_tokens_budget`` (the rows its whole-step decode takes at once),
shared among the decoding requests, and each request's own share follows
its recent acceptance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "model", "quantization", "disable_by_batch_size", "draft_tensor_parallel_size"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config`` as vLLM spells it: ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max":
    5}`` or ``{"method": "draft_model", "model": PATH_OR_ID,
    "num_speculative_tokens": 4, "quantization": "gguf"}``.
    ``disable_by_batch_size``: no speculation in steps with at least this many
    running requests (None: the budget alone decides)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    quantization: str = "none"
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32:
                raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy "
                                 "1 <= min <= max <= 32, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
            if self.model is not None:
                raise ValueError("the ngram method takes no model (that is draft_model)")
        elif not self.model:
            raise ValueError('the draft_model method needs "model": a model Baton loads '
                             "(a folder, a .gguf file or a Hub id) sharing the target's "
                             "tokenizer")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; unknown keys and wrong types are errors naming
        them."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(_KEYS))})")
        if raw.pop("draft_tensor_parallel_size", 1) != 1:
            raise ValueError("--speculative-config: a draft model runs on one rank "
                             "(draft_tensor_parallel_size 1)")
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ValueError('--speculative-config needs "method" and "num_speculative_tokens"')
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "disable_by_batch_size"):
            if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        for key in ("method", "model", "quantization"):
            if key in raw and not isinstance(raw[key], str):
                raise ValueError(f"--speculative-config: {key} must be a string")
        if raw.get("method") == "ngram" and "prompt_lookup_max" in raw \
                and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(2, raw["prompt_lookup_max"])
        return cls(**raw)

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"ngram, {self.num_speculative_tokens} tokens, n-grams of "
                    f"{self.prompt_lookup_min}-{self.prompt_lookup_max}")
        return (f"draft model {self.model}"
                + (f" ({self.quantization})" if self.quantization != "none" else "")
                + f", {self.num_speculative_tokens} tokens")


@dataclass(slots=True)
class _NgramIndex:
    """For each n, the position following the latest earlier occurrence of
    every n-gram of the tokens indexed so far."""

    follows: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """Prompt lookup: the longest suffix of a request's tokens (from
    ``max_n`` down to ``min_n`` tokens) that occurred earlier in its prompt
    or output proposes the tokens that followed its latest occurrence. The
    index grows with each new token (O(max_n) a token), so a proposal costs
    a few dictionary lookups however long the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the request's prompt and
        output so far); [] when no suffix recurs."""
        index = self._index.setdefault(request_id, _NgramIndex(
            {n: {} for n in range(self.min_n, self.max_n + 1)}))
        end = len(tokens) - 1  # index n-grams that have a following token
        for p in range(index.indexed, end):
            for n, table in index.follows.items():
                if p + 1 >= n:
                    table[tuple(tokens[p + 1 - n:p + 1])] = p + 1
        index.indexed = max(index.indexed, end)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) < n:
                continue
            follow = index.follows[n].get(tuple(tokens[-n:]))
            if follow is not None:
                return tokens[follow:follow + k]
        return []

    def propose_for(self, wanted, kv_cache=None) -> dict[str, list[int]]:
        """Proposals by request id for each (request, k) in ``wanted``."""
        return {request.request_id: self.propose(
                    request.request_id, request.prompt_token_ids + request.output_token_ids, k)
                for request, k in wanted}

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._index.pop(request_id, None)

    @property
    def request_ids(self) -> set[str]:
        return set(self._index)


# A request's acceptance estimate: an exponential moving average of the
# fraction of its proposals accepted, starting optimistic.
ACCEPTANCE_PRIOR = 0.6
ACCEPTANCE_WEIGHT = 0.3
# Below this a request proposes one token a step (a probe: cheap, and the
# estimate recovers when the text turns repetitive); a draft model, whose
# every proposal costs a forward pass, stops proposing instead.
LOW_ACCEPTANCE = 0.15


# A draft's cost is measured (ProposalBudget.draft_cost) after this many
# draft rounds and target steps; the averages then weigh a new step by
# COST_WEIGHT.
COST_SAMPLES = 4
COST_WEIGHT = 0.2
# A draft proposes only where it is expected to yield at least this many
# times the tokens per second of plain decoding (a margin over measuring
# noise, so a draft that barely pays does not flap on and off).
MIN_DRAFT_GAIN = 1.1


def _average(mean: float, value: float, count: int) -> float:
    if count < COST_SAMPLES:  # a plain mean of the first samples
        return (mean * count + value) / (count + 1)
    return (1 - COST_WEIGHT) * mean + COST_WEIGHT * value


def _draft_k(rate: float, cost: float, k_max: int) -> int:
    """Proposals for a draft whose round costs ``cost`` target steps, at
    acceptance ``rate``: the k with the most tokens per unit of time, k
    proposals yielding 1 + a + ... + a^k tokens for 1 + k * cost steps'
    time (a verification row costs about a decode's step); 0 where no k
    beats plain decoding by MIN_DRAFT_GAIN. A draft as costly as its target
    (a quantized copy of a model whose step is bound by dispatch, not by
    its weights' bytes) never pays: at rate 1, k + 1 tokens for 1 + k steps."""
    best_k, best, tokens = 0, MIN_DRAFT_GAIN, 1.0
    for k in range(1, k_max + 1):
        tokens += rate ** k
        gain = tokens / (1 + k * cost)
        if gain > best:
            best_k, best = k, gain
    return best_k


@dataclass(slots=True)
class SpeculationStats:
    """Counts since the last ``take`` (for the metrics): proposals and
    accepted tokens, and the steps that verified proposals."""

    proposed: int = 0
    accepted: int = 0
    verified_rows: int = 0

    def take(self) -> SpeculationStats:
        taken = SpeculationStats(self.proposed, self.accepted, self.verified_rows)
        self.proposed = self.accepted = self.verified_rows = 0
        return taken


class ProposalBudget:
    """How many tokens each decoding request may propose this step: at most
    ``num_speculative_tokens``, in all at most ``budget`` beyond the decode
    tokens themselves (the step stays as cheap as a decode step), fewer for a
    request whose proposals are seldom accepted (its expected gain, k
    proposals accepted at rate a: a + a^2 + ... + a^k tokens, falls off
    quickly), none past ``disable_by_batch_size`` running requests."""

    def __init__(self, config: SpeculativeConfig, budget: int) -> None:
        self.config = config
        self.budget = budget
        self._acceptance: dict[str, float] = {}
        # A draft model's cost: moving averages of a draft round of one row
        # (one request's token) and of a target step of one row (one plain
        # decode), each with how many it has seen. Both of one row, so that
        # their ratio does not drift with the batch: a target step of more
        # rows is not a reason to draft (its proposers and verification rows
        # grow with it).
        self.forget_costs()

    def forget_costs(self) -> None:
        """Drop the cost measurements so far (the warm-up's first, cold
        passes: one-time costs are not a draft's cost)."""
        self._draft_s = self._target_s = 0.0
        self._draft_n = self._target_n = 0
        self._after_plain = False

    def observe_draft(self, seconds: float) -> None:
        """A draft round of one row's forward time."""
        self._draft_s = _average(self._draft_s, seconds, self._draft_n)
        self._draft_n += 1

    def observe_target(self, seconds: float | None, rows: int = 1,
                       requests: int = 1) -> None:
        """A target step's forward time, token rows and requests, or None
        for a step with prompt tokens (a prefill's time is not a decode's).
        Only a plain step (no proposals) of one row is measured."""
        self._after_plain = seconds is not None and rows == requests
        if self._after_plain and rows == 1:
            self._target_s = _average(self._target_s, seconds, self._target_n)
            self._target_n += 1

    @property
    def draft_cost(self) -> float | None:
        """A draft round's time over a target step's, once both are measured
        (None before: a draft proposes until its cost is known)."""
        if self._draft_n < COST_SAMPLES or self._target_n < COST_SAMPLES or self._target_s <= 0:
            return None
        return self._draft_s / self._target_s

    def shares(self, request_ids: list[str]) -> dict[str, int]:
        cap = self.config.disable_by_batch_size
        if not request_ids or (cap is not None and len(request_ids) >= cap):
            return {}
        spare = self.budget - len(request_ids)
        if spare <= 0:
            return {}
        k_max = self.config.num_speculative_tokens
        if self.config.method == "draft_model" and self.draft_cost is None:
            # Until a draft's cost is measured (the server's warm-up does, so
            # this is a fallback), one request proposes, every other step:
            # after a plain step, so that a lone request's plain decode is
            # timed between the draft's rounds. A new request's first
            # proposal makes the draft prefill its prompt, which a draft that
            # turns out not to pay should do once, not for the whole batch.
            if not self._after_plain:
                return {}
            request_ids = request_ids[:1]
        wanted = {rid: self._wanted(rid, k_max) for rid in request_ids}
        # The best acceptors first; each gets what it wants while budget lasts.
        shares: dict[str, int] = {}
        for rid in sorted(request_ids, key=lambda r: -self._acceptance.get(r, ACCEPTANCE_PRIOR)):
            take = min(wanted[rid], spare)
            if take > 0:
                shares[rid] = take
                spare -= take
        cost = self.draft_cost if self.config.method == "draft_model" else None
        if shares and cost is not None and not self._pays(shares, len(request_ids), cost):
            return {}
        return shares

    def _pays(self, shares: dict[str, int], decoding: int, cost: float) -> bool:
        """Whether the step's proposals pay for the draft rounds they take:
        the batch's expected tokens (each decoding request's one, plus the
        proposers' expected accepted ones) over its time (a target step plus
        max(k) draft rounds), against one token per request a plain step."""
        extra = 0.0
        for rid, k in shares.items():
            rate = self._acceptance.get(rid, ACCEPTANCE_PRIOR)
            extra += sum(rate ** i for i in range(1, k + 1))
        gain = (1 + extra / decoding) / (1 + max(shares.values()) * cost)
        return gain >= MIN_DRAFT_GAIN

    def _wanted(self, request_id: str, k_max: int) -> int:
        rate = self._acceptance.get(request_id, ACCEPTANCE_PRIOR)
        if rate < LOW_ACCEPTANCE:
            return 0 if self.config.method == "draft_model" else 1
        cost = self.draft_cost if self.config.method == "draft_model" else None
        if cost is not None:
            return _draft_k(rate, cost, k_max)
        # Proposals past the point where another accepted token is less
        # likely than a third are not worth their compute.
        k = 1
        while k < k_max and rate ** (k + 1) >= 1 / 3:
            k += 1
        return k

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        rate = self._acceptance.get(request_id, ACCEPTANCE_PRIOR)
        self._acceptance[request_id] = ((1 - ACCEPTANCE_WEIGHT) * rate
                                        + ACCEPTANCE_WEIGHT * accepted / proposed)

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)

    @property
    def request_ids(self) -> set[str]:
        return set(self._acceptance)


class Speculator:
    """Proposes the next step's tokens for the decoding requests: which ones
    may (not past max_tokens or the context; a structured-output
    constraint's grammar masks each verified position: backends/grammar.py,
    ``fill_bitmasks_along``), how many (ProposalBudget), and what (the proposer: n-gram
    lookup, or a draft model: scheduler/draft.py)."""

    def __init__(self, config: SpeculativeConfig, budget: int, proposer=None) -> None:
        self.config = config
        self.budget = ProposalBudget(config, budget)
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min,
                                                  config.prompt_lookup_max)

    def propose(self, running, max_model_len: int, kv_cache) -> None:
        """Set ``spec_token_ids`` of each request in ``running`` that decodes
        next step (its newest token is all it has left to compute)."""
        decoding = [r for r in running
                    if r.num_computed_tokens == r.num_tokens - 1 and r.pooling is None]
        for request in running:
            request.spec_token_ids = []
        shares = self.budget.shares([r.request_id for r in decoding])
        wanted = []
        for request in decoding:
            k = min(shares.get(request.request_id, 0),
                    request.max_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens - 1)
            if k > 0:
                wanted.append((request, k))
        if wanted:
            proposals = self.proposer.propose_for(wanted, kv_cache)
            for request, _ in wanted:
                request.spec_token_ids = proposals.get(request.request_id, [])
            for seconds in getattr(self.proposer, "take_round_times", list)():
                self.budget.observe_draft(seconds)

    def observe_step(self, seconds: float | None, rows: int = 1, requests: int = 1) -> None:
        """The target's forward time of a step without prompt tokens, its
        token rows and requests (a plain step of one row is what a draft's
        cost is measured against), None after one with prompt tokens."""
        self.budget.observe_target(seconds, rows, requests)

    def release(self, live_ids: set[str]) -> None:
        """Drop the state of requests no longer live."""
        gone = (self.budget.request_ids | self.proposer.request_ids) - live_ids
        if gone:
            self.budget.release(gone)
            self.proposer.release(gone)

    @property
    def request_ids(self) -> set[str]:
        return self.budget.request_ids | self.proposer.request_ids
