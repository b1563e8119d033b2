"""What telemetry is told: one finished request, one engine step.

Plain data, filled in by the service (requests) and the engine loop (steps).
Telemetry imports nothing from service/, scheduler/, backends/ or cache/, so
callers convert their own types into these.

All request timestamps are ``time.monotonic()`` seconds, the clock the
scheduler stamps ``Request`` with; durations are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One finished generation (one choice of an HTTP request).

    ``status`` is "ok" or "error"; a client abort or a timeout with a partial
    answer is "ok" with finish_reason abort/timeout, an exception is "error"
    with ``error_type`` a low-cardinality name (``"ValueError"``, ``"timeout"``).
    """

    request_id: str
    operation: str  # "chat" | "text_completion" (gen_ai.operation.name)
    model: str
    status: str  # "ok" | "error"
    finish_reason: str | None  # stop | length | abort | timeout | error
    prompt_tokens: int
    output_tokens: int
    arrival: float
    finished: float
    first_scheduled: float | None = None  # None: never scheduled
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # speculative decoding: proposals verified for it, and accepted
    spec_proposed: int = 0
    spec_accepted: int = 0
    first_token: float | None = None  # None: no token produced
    error_type: str | None = None
    # monotonic time of each output delta, for inter-token latency
    token_times: list[float] = field(default_factory=list)
    prefill_time: float | None = None  # seconds in the model for the prompt
    decode_time: float | None = None  # seconds in the model after the first token

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled; None when never scheduled."""
        if self.first_scheduled is None:
            return None
        return self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        """Arrival to first output token; None when none came."""
        if self.first_token is None:
            return None
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def time_per_output_token(self) -> float | None:
        """Decode time per token after the first (the OTel TPOT definition)."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    @property
    def model_prefill_time(self) -> float | None:
        """``prefill_time`` if known, else first scheduled to first token."""
        if self.prefill_time is not None:
            return self.prefill_time
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def model_decode_time(self) -> float | None:
        """``decode_time`` if known, else first token to finish."""
        if self.decode_time is not None:
            return self.decode_time
        if self.first_token is None:
            return None
        return self.finished - self.first_token


@dataclass(slots=True)
class StepRecord:
    """One engine step: what ran, the cache after it, and where the time went."""

    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    preempted: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float  # 0..1
    num_running: int
    num_waiting: int
    # prefix cache: tokens looked up by the requests admitted in this step, and found
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding (method "" without): proposals, accepted ones, and
    # the rows that verified proposals, this step
    spec_method: str = ""
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verified_rows: int = 0
    # seconds per phase; host overhead is everything but forward and sample
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    emit: float = 0.0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.emit

    @property
    def host_overhead_share(self) -> float:
        """(schedule + prepare + emit) / total; 0 for an empty step."""
        total = self.total
        if total <= 0.0:
            return 0.0
        return (self.schedule + self.prepare + self.emit) / total
