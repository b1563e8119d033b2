"""What the engine hands back to the service, and step statistics for telemetry."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.config import GenerationDefaults, PoolingConfig
from backends.interface import StepTimings, TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A delta: the tokens and text a request gained in one step.

    The last output of a request has ``finished`` set and ``finish_reason``
    one of stop, length, abort, timeout or error (``error`` then says why).
    Concatenating every ``text`` gives the whole completion.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    # On the first output only, when asked for: logprobs of prompt tokens 1..
    prompt_logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # With ``error``: its type for the client (None: "internal_error";
    # "grammar_error" when the output could not be kept to its constraint).
    error_type: str | None = None
    # monotonic seconds, for latency attributes and metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # prompt tokens found in the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # speculative decoding: proposals verified for it so far, and accepted
    spec_proposed: int = 0
    spec_accepted: int = 0
    # An embedding request's final output: its pooled, normalised vector.
    embedding: list[float] | None = None


@dataclass(slots=True)
class SchedulerStats:
    """One step, as telemetry sees it."""

    num_running: int
    num_waiting: int
    num_scheduled: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    timings: StepTimings = field(default_factory=StepTimings)
    # requests this step failed with an engine fault (their own, or one that
    # could not be narrowed down further); see EngineCore.step
    num_faulted: int = 0
    request_ids: list[str] = field(default_factory=list)
    prefill_request_ids: list[str] = field(default_factory=list)  # computed prompt tokens
    # tokens looked up in the prefix cache by requests admitted this step, and found
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding: its method ("" without), and this step's
    # proposals, accepted proposals and rows that verified proposals
    spec_method: str = ""
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verified_rows: int = 0
    start_ns: int = 0   # wall clock (epoch ns), set by the AsyncEngine
    end_ns: int = 0


@dataclass(slots=True)
class StepOutcome:
    """What one ``EngineCore.step()`` did: the deltas to deliver and, when a
    step ran, its statistics. ``failed`` is true when the backend raised
    for every request the step scheduled (a broken engine, not a bad request);
    ``fault`` then says why."""

    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None
    failed: bool = False
    fault: str | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model as the gateway sees it (immutable, safe to share)."""

    name: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    generation: GenerationDefaults
    max_logprobs: int = 20      # top alternatives a request may ask for (--max-logprobs)
    max_num_seqs: int = 0   # requests that run at once (0: not said)
    pooling: PoolingConfig = PoolingConfig()
    hidden_size: int = 0  # the width of an embedding (0: unknown)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Queue load for admission control and health, read as one snapshot."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int
