"""The contract between the scheduler and an execution backend.

Plain data only, and no torch import: the scheduler and the cache import this
module, and they never touch tensors.

Flow of one engine step::

    Scheduler.schedule() -> SchedulerOutput -> Backend.execute() -> StepResult

The backend keeps per-request sampling state (seeded generator, token counts
for penalties) keyed by request id from the first step a request is scheduled
until its id appears in ``SchedulerOutput.finished_request_ids``. Preemption
does not end that state: a preempted request keeps its random stream, so a
seeded request yields the same tokens whether or not it was preempted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backends.errors import InvalidRequestError

if TYPE_CHECKING:
    from backends.quantization.spec import QuantizationSpec


# Admission limits on what a request may ask for; each bounds work or memory
# that one request could otherwise make everyone pay for (docs/security.md).
MAX_STOP_STRINGS = 16            # OpenAI allows 4; vLLM-style clients send more
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024    # OpenAI allows 300
MAX_STOP_TOKEN_IDS = 1024
# A signed 64-bit integer, as in OpenAI's API and vLLM (a wider value reached
# torch.Generator.manual_seed and failed the whole step).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**31 - 1
# A structured-output constraint's source (a JSON schema, regex, grammar or
# choice list as text): compiling costs about a second per 100 KB of schema,
# on a thread other requests wait for. OpenAI caps a schema's names and
# enum values at 120,000 characters.
MAX_CONSTRAINT_CHARS = 128 * 1024
MAX_CHOICES = 10_000
# Below this a temperature is greedy (as in vLLM): dividing logits by it
# would overflow float32.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """A constraint the output must satisfy, as plain data (the backend's
    grammar engine compiles it; see backends/grammar.py).

    ``kind`` is "json" (``source`` is a JSON schema as JSON text), "regex",
    "choice" (``source`` is a JSON list of strings) or "grammar" (Lark, or
    GBNF when it uses ``::=``). JSON is written compactly (", " and ": ")
    unless ``any_whitespace`` or a ``whitespace_pattern`` allows more.
    ``param`` is the request field it came from, for error messages.
    ``lenient`` (a JSON schema only): keywords and formats the grammar engine
    does not implement (``uniqueItems``, ``format: path`` ...) are left
    unenforced instead of refused, as OpenAI treats non-strict schemas.
    """

    kind: str
    source: str
    any_whitespace: bool = False
    whitespace_pattern: str | None = None
    param: str = field(default="response_format", compare=False)
    lenient: bool = False

    def __post_init__(self) -> None:
        if len(self.source) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} constraint is {len(self.source)} characters long, more than "
                f"the {MAX_CONSTRAINT_CHARS} this server compiles", self.param)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    ``max_tokens=None`` means "until the context is full"; 0 means "compute
    the prompt only" (prompt scoring: its logprobs, no token sampled). ``top_k`` of -1 or 0
    disables top-k. ``logprobs`` is the number of top alternatives to return
    beside the chosen token's logprob (0 returns only the chosen one); None
    returns none.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 1 (or 0 to score the prompt only), got "
                f"{self.max_tokens}", "max_tokens")
        _check_finite(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature")
        _check_finite(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled), 0 (disabled) or between 1 and {MAX_TOP_K}, "
                f"got {self.top_k}", "top_k")
        _check_finite(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(value, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        _check_finite(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                f"{len(self.logit_bias)}", "logit_bias")
        for token_id, bias in self.logit_bias:
            _check_finite(bias, "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
                    "logit_bias")
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens")
        # The upper bound is the server's (--max-logprobs): EngineCore.validate.
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequestError(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidRequestError(
                f"prompt logprobs must be >= 0, got {self.prompt_logprobs}", "logprobs")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                "stop")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long, "
                f"got one of {longest}", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                f"{len(self.stop_token_ids)}", "stop_token_ids")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError(
                f"seed must be between {SEED_MIN} and {SEED_MAX}, got {self.seed}", "seed")
        if self.structured is not None:
            # A constrained output ends with EOS once its grammar completes.
            if self.ignore_eos:
                raise InvalidRequestError(
                    "ignore_eos cannot be combined with a structured output constraint "
                    f"({self.structured.param}): the output ends when the constraint is "
                    "complete", "ignore_eos")
            if self.min_tokens:
                raise InvalidRequestError(
                    "min_tokens cannot be combined with a structured output constraint "
                    f"({self.structured.param}): the constraint decides where the output "
                    "ends", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_top_k_top_p(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request: the prompt is prefilled, nothing is sampled, and
    the backend returns one vector pooled from its hidden states (after the
    final norm). ``pooling_type`` is "last" (the last position's) or "mean"
    (every position's average, across however many chunks the prefill
    takes). The vector is cut to its first ``dimensions`` values when given
    (Matryoshka), then L2-normalised."""

    pooling_type: str = "last"
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in ("last", "mean"):
            raise InvalidRequestError(
                f"pooling type must be last or mean, got {self.pooling_type!r}", "pooling")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(
                f"dimensions must be at least 1, got {self.dimensions}", "dimensions")

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads every prompt position's hidden state, so no
        position may be skipped as a prefix-cache hit."""
        return self.pooling_type == "mean"


def _check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise InvalidRequestError(f"{param} must be a finite number, got {value}", param)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are the tokens whose K/V this step computes, at positions
    ``start_pos .. start_pos + len(token_ids) - 1``. ``block_table`` covers at
    least ``start_pos + len(token_ids)`` tokens. When ``sample`` is true the
    chunk reaches the end of the known tokens and the backend samples one new
    token from the last position. ``prompt_token_ids`` is set only on the
    first step this request is ever scheduled (the backend keeps it for the
    repetition penalty). ``pooling`` is set for an embedding request: it is
    never sampled (``sample`` is false), and the chunk that reaches the end
    of its prompt returns its pooled vector (``StepResult.pooled``).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: list[int] | None = None
    # Leading entries of block_table the backend was sent before and still
    # holds (0 on the first step and after a preemption): the table's diff.
    num_known_blocks: int = 0
    # Speculative decoding: the last of token_ids are this many proposals
    # (these tokens) to verify; the backend samples every one's position.
    spec_token_ids: list[int] = field(default_factory=list)
    pooling: PoolingParams | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the backend needs for one step; no references to Request."""

    requests: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the chosen token and of the top alternatives (raw model
    distribution, before penalties and temperature)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class StepTimings:
    """Seconds spent in each part of a step, measured on the host."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    emit: float = 0.0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.emit


@dataclass(slots=True)
class StepResult:
    """Sampled tokens, one per scheduled request with ``sample=True``, in the
    order those requests appear in the SchedulerOutput."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    timings: StepTimings
    # Logprobs of prompt tokens 1.. (each given the tokens before it), for
    # requests that asked; a long prompt's entries arrive chunk by chunk.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose row could not be sampled this step (e.g. non-finite
    # logits, a broken output constraint), with why; they have no entry in
    # ``token_ids``, and the engine fails them alone.
    failed: dict[str, str] = field(default_factory=dict)
    # The error type of a failed request where it is not "internal_error"
    # (backends.errors.GRAMMAR_ERROR for a constraint that failed).
    error_types: dict[str, str] = field(default_factory=dict)
    # Embedding requests whose prompt this step finished: the pooled,
    # normalised vector (float32 values), by request id.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Speculative rows: the proposals accepted before the row's own token
    # (``token_ids``), and their logprobs where asked, by request id.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class Backend(Protocol):
    """An execution backend: owns weights, the KV tensors and the sampler.
    Built by ``backends.factory.create_backend``."""

    num_kv_blocks: int
    block_size: int
    kv_capacity_tokens: int   # num_kv_blocks * block_size
    num_parameters: int       # the trained model's, whatever the storage
    weight_bytes: int         # memory the weights occupy (for the load log)
    quantization: QuantizationSpec  # as applied (an int4 group size resolved)

    def execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        """Run one forward pass over the scheduled tokens and sample."""
        ...

    def shutdown(self) -> None:
        """Release device memory."""
        ...

    def request_state_ids(self) -> set[str]:
        """Ids of the requests the backend holds per-request state for (for
        integrity checks and leak gauges)."""
        ...

    # Optional: ``fatal_error: str | None``, set when the backend can never
    # run a step again (a tensor-parallel rank died); /health reports it.
