"""Where the gateway meets telemetry: one RequestTelemetry per HTTP request,
one step observer for the engine. Called at request boundaries and once per
step, never per token per layer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backends.interface import SamplingParams
from scheduler.outputs import RequestOutput, SchedulerStats
from service.live_stats import LiveStats
from telemetry.logs import log_request_finished
from telemetry.metrics import Metrics
from telemetry.records import RequestRecord, StepRecord
from telemetry.tracing import RequestSpan, Tracing, monotonic_to_epoch_ns


@dataclass(slots=True)
class _ChoiceStats:
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    finish_reason: str | None = None
    text: str = ""


class Observability:
    def __init__(self, model_name: str, metrics: Metrics, tracing: Tracing,
                 log_prompts: bool = False, log_requests: bool = True) -> None:
        self.model_name = model_name
        self.metrics = metrics
        self.tracing = tracing
        self.log_prompts = log_prompts
        self.log_requests = log_requests  # --disable-log-requests turns the lines off
        # engine request id -> the telemetry of the HTTP request it serves
        self.active: dict[str, RequestTelemetry] = {}
        # recent figures for GET /dashboard; None turns them off
        self.live: LiveStats | None = LiveStats(model_name)

    def begin(self, operation: str, headers) -> RequestTelemetry:
        return RequestTelemetry(self, operation, headers)

    def attach(self, engine) -> None:
        """Observe ``engine`` (an AsyncEngine): its steps, its faults, and the
        sizes of every per-request table (``baton_request_state_entries``)."""
        engine.step_observers.append(self.on_step)
        engine.fault_observers.append(self.on_fault)
        self.metrics.watch_request_state(
            lambda: {**engine.state_sizes(), "telemetry": len(self.active)})

    def on_fault(self, count: int, reason: str) -> None:
        """An engine fault failed ``count`` requests (the engine logged why)."""
        self.metrics.engine_faults(count)

    def on_step(self, stats: SchedulerStats) -> None:
        t = stats.timings
        step = StepRecord(
            batch_size=stats.num_scheduled, prefill_tokens=stats.num_prefill_tokens,
            decode_tokens=stats.num_decode_tokens, preempted=stats.num_preempted,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_free=stats.kv_blocks_free,
            kv_usage=stats.kv_usage, num_running=stats.num_running,
            num_waiting=stats.num_waiting, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, spec_method=stats.spec_method,
            spec_proposed=stats.spec_proposed, spec_accepted=stats.spec_accepted,
            spec_verified_rows=stats.spec_verified_rows, schedule=t.schedule, prepare=t.prepare,
            forward=t.forward, sample=t.sample, emit=t.emit)
        self.metrics.observe_step(step)
        if self.live is not None:
            self.live.observe_step(step)
        if not self.tracing.enabled:
            return
        active = self.active
        for rid in stats.prefill_request_ids:
            telemetry = active.get(rid)
            if telemetry is not None:
                telemetry.prefill_chunks.append((stats.start_ns, stats.end_ns))
        if self.tracing.step_spans:
            # n choices of one HTTP request share a span: link it once
            served = {id(t): t for t in map(active.get, stats.request_ids) if t is not None}
            self.tracing.record_step(step, stats.start_ns, stats.end_ns,
                                     [t.span_context for t in served.values()])


class RequestTelemetry:
    """Span, per-choice timings and the final record of one HTTP request."""

    def __init__(self, obs: Observability, operation: str, headers) -> None:
        self.obs = obs
        self.operation = operation
        self.headers = headers
        self.arrival = time.monotonic()
        self.validated: float | None = None
        self.span: RequestSpan | None = None
        self.choices: dict[int, _ChoiceStats] = {}
        self.prefill_chunks: list[tuple[int, int]] = []
        self.request_ids: list[str] = []
        self.prompt_text: str | None = None
        self.response_id: str | None = None
        self.n = 1
        self._done = False

    @property
    def span_context(self):
        return self.span.span_context if self.span is not None else None

    def validated_request(self, params: SamplingParams | None, n: int, stream: bool | None,
                          prompt_text: str | None, attributes: dict | None = None) -> None:
        """Validation and tokenization are over: open the span (backdated to
        arrival) with the request's GenAI attributes (``attributes``: more
        of them, by short name or OTel key; None values are left out)."""
        self.validated = time.monotonic()
        self.prompt_text = prompt_text
        self.n = n
        self._open_span(params, n, stream, attributes)

    def _open_span(self, params: SamplingParams | None, n: int | None,
                   stream: bool | None, extra: dict | None = None) -> None:
        tracing = self.obs.tracing
        if not tracing.enabled or self.span is not None:
            return
        attributes = {"choice_count": n, "stream": stream}
        if params is not None:
            attributes.update(
                max_tokens=params.max_tokens, temperature=params.temperature,
                top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else None,
                seed=params.seed, stop_sequences=list(params.stop) or None,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty)
        attributes.update(extra or {})
        self.span = tracing.start_request_span(
            self.operation, self.obs.model_name, attributes, self.headers,
            start_time=monotonic_to_epoch_ns(self.arrival))
        if self.span is not None:
            end = self.validated or time.monotonic()
            self.span.child("validate_and_tokenize", monotonic_to_epoch_ns(self.arrival),
                            monotonic_to_epoch_ns(end))

    def started(self, response_id: str, request_ids: list[str], num_choices: int) -> None:
        self.response_id = response_id
        self.request_ids = list(request_ids)
        self.choices = {i: _ChoiceStats() for i in range(num_choices)}
        for rid in request_ids:
            self.obs.active[rid] = self

    def on_output(self, index: int, out: RequestOutput) -> None:
        c = self.choices[index]
        if out.new_token_ids:
            c.token_times.append(time.monotonic())
        c.first_scheduled = out.first_scheduled_time
        c.first_token = out.first_token_time
        c.prompt_tokens = out.num_prompt_tokens
        c.cached_tokens = out.num_cached_tokens
        c.output_tokens = out.num_output_tokens
        c.spec_proposed, c.spec_accepted = out.spec_proposed, out.spec_accepted
        if self.obs.log_prompts:
            c.text += out.text
        if out.finished:
            c.finish_reason = out.finish_reason

    def finish(self, error_type: str | None = None) -> None:
        """Record metrics, end the span, write the log line. Idempotent."""
        if self._done:
            return
        self._done = True
        for rid in self.request_ids:
            self.obs.active.pop(rid, None)
        now = time.monotonic()
        if error_type is None and any(c.finish_reason == "error"
                                      for c in self.choices.values()):
            error_type = "engine_fault"
        status = "ok" if error_type is None else "error"
        metrics = self.obs.metrics
        records = [self._record(c, now, status, error_type) for c in self.choices.values()]
        for record in records:
            metrics.observe_request(record)
        combined = self._combined(records, now, status, error_type)
        if not records:
            metrics.observe_request(combined)
        if self.obs.live is not None:
            self.obs.live.observe_request(combined, records, now)
        self._open_span(None, None, None)  # a request that failed validation
        span = self.span
        if span is not None:
            for start_ns, end_ns in self.prefill_chunks:
                span.child("prefill", start_ns, end_ns)
            reasons = [r.finish_reason for r in records if r.finish_reason]
            span.finish(combined, self.response_id, self.obs.model_name, reasons or None)
        if not self.obs.log_requests:
            return
        output_text = None
        if self.obs.log_prompts:
            output_text = [c.text for c in self.choices.values()]
        log_request_finished(combined, span.trace_id if span else None,
                             span.span_id if span else None,
                             prompt_text=self.prompt_text, output_text=output_text,
                             log_prompts=self.obs.log_prompts)

    def _record(self, c: _ChoiceStats, now: float, status: str,
                error_type: str | None) -> RequestRecord:
        return RequestRecord(
            request_id=self.response_id or "", operation=self.operation,
            model=self.obs.model_name, status=status, finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens, output_tokens=c.output_tokens,
            cached_tokens=c.cached_tokens, spec_proposed=c.spec_proposed,
            spec_accepted=c.spec_accepted,
            arrival=self.arrival, finished=now, first_scheduled=c.first_scheduled,
            first_token=c.first_token, error_type=error_type, token_times=c.token_times)

    def _combined(self, records: list[RequestRecord], now: float, status: str,
                  error_type: str | None) -> RequestRecord:
        def first(values):
            values = [v for v in values if v is not None]
            return min(values) if values else None

        reasons = [r.finish_reason for r in records if r.finish_reason]
        return RequestRecord(
            request_id=self.response_id or "", operation=self.operation,
            model=self.obs.model_name, status=status,
            finish_reason=reasons[-1] if reasons else None,
            # each prompt once, however many choices it has
            prompt_tokens=sum(r.prompt_tokens for r in records[::self.n]),
            cached_tokens=sum(r.cached_tokens for r in records[::self.n]),
            output_tokens=sum(r.output_tokens for r in records),
            spec_proposed=sum(r.spec_proposed for r in records),
            spec_accepted=sum(r.spec_accepted for r in records),
            arrival=self.arrival, finished=now,
            first_scheduled=first(r.first_scheduled for r in records),
            first_token=first(r.first_token for r in records), error_type=error_type)
