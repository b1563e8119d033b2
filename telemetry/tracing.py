"""OpenTelemetry traces: one SERVER span per request, optional span per engine step.

Configured the standard way. Tracing is on when an OTLP endpoint is given,
either ``otlp_endpoint`` (the ``--otlp-traces-endpoint`` flag) or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, and
off otherwise, or when ``detail`` is "none", ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none``. The protocol comes from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` and is
``http/protobuf`` when unset, the default the OTLP exporter specification
asks for. The service name is ``OTEL_SERVICE_NAME`` (or ``service.name`` in
``OTEL_RESOURCE_ATTRIBUTES``), else ``service_name_default``; the sampler is
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, read by the SDK itself.

Off costs nothing: ``start_request_span`` returns None and ``record_step``
returns at its first line. The provider is private to each ``Tracing`` (never
the global one), so tests can build several.

Timestamps given to spans are epoch nanoseconds, as OpenTelemetry wants;
``monotonic_to_epoch_ns`` converts the scheduler's ``time.monotonic()`` stamps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from telemetry.records import RequestRecord, StepRecord

DETAILS = ("none", "request", "step")
PROVIDER_NAME = "baton"

# Short names accepted in start_request_span(attributes=...) and their
# GenAI semantic-convention keys. Keys with a dot pass through unchanged.
REQUEST_ATTRIBUTES = {
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "choice_count": "gen_ai.request.choice.count",
    "stream": "gen_ai.request.stream",
    "stop_sequences": "gen_ai.request.stop_sequences",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")


# One offset for the process: computing it per call jitters by a few hundred
# ns, enough to put a child's start before its parent's.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def monotonic_to_epoch_ns(t: float) -> int:
    """A ``time.monotonic()`` stamp as epoch nanoseconds (for span times)."""
    return int(t * 1e9) + _EPOCH_OFFSET_NS


class RequestSpan:
    """The SERVER span of one request, and its children.

    Made by ``Tracing.start_request_span``; ended by ``finish`` (once; later
    calls do nothing). ``span`` is the OpenTelemetry span itself, for anything
    not covered here (``span.record_exception(exc)``).
    """

    __slots__ = ("span", "_tracer", "_context", "_children", "_finished")

    def __init__(self, span: Span, tracer: Any) -> None:
        self.span = span
        self._tracer = tracer
        self._context = set_span_in_context(span)
        self._children: set[str] = set()
        self._finished = False

    @property
    def span_context(self) -> SpanContext:
        """For links from engine step spans."""
        return self.span.get_span_context()

    @property
    def trace_id(self) -> str:
        """32 hex digits, for log correlation."""
        return format(self.span.get_span_context().trace_id, "032x")

    @property
    def span_id(self) -> str:
        """16 hex digits, for log correlation."""
        return format(self.span.get_span_context().span_id, "016x")

    def child(self, name: str, start_time: int | None = None, end_time: int | None = None,
              attributes: Mapping[str, Any] | None = None) -> Span:
        """Start a child span ("validate_and_tokenize", "queue_wait", "prefill",
        "decode"). Times are epoch ns (``monotonic_to_epoch_ns``); with
        ``end_time`` the span is recorded after the fact and already ended,
        without it the caller ends it, e.g. ``with rs.child("validate_and_tokenize"):``.
        """
        self._children.add(name)
        span = self._tracer.start_span(name, context=self._context, start_time=start_time,
                                       attributes=attributes)
        if end_time is not None:
            span.end(end_time=end_time)
        return span

    def finish(self, record: RequestRecord, response_id: str | None = None,
               response_model: str | None = None,
               finish_reasons: Iterable[str] | None = None) -> None:
        """Set the response, usage and latency attributes and end the span.

        Children not recorded through ``child`` are derived from the record's
        timestamps: "queue_wait" (arrival to first scheduled), "prefill" (first
        scheduled to first token) and "decode" (first token to finish).
        A record with status "error" marks the span ERROR with ``error.type``.
        """
        if self._finished:
            return
        self._finished = True
        span = self.span
        if span.is_recording():
            self._derive_children(record)
            span.set_attributes(_response_attributes(record, response_id, response_model,
                                                     finish_reasons))
            if record.status != "ok":
                error_type = record.error_type or "_OTHER"
                span.set_attribute("error.type", error_type)
                span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()

    def _derive_children(self, record: RequestRecord) -> None:
        ns = monotonic_to_epoch_ns
        phases = (("queue_wait", record.arrival, record.first_scheduled),
                  ("prefill", record.first_scheduled, record.first_token),
                  ("decode", record.first_token, record.finished))
        for name, start, end in phases:
            if name in self._children or start is None or end is None:
                continue
            self.child(name, ns(start), ns(end))


def _response_attributes(record: RequestRecord, response_id: str | None,
                         response_model: str | None,
                         finish_reasons: Iterable[str] | None) -> dict[str, Any]:
    if finish_reasons is None:
        finish_reasons = () if record.finish_reason is None else (record.finish_reason,)
    attrs: dict[str, Any] = {
        "gen_ai.response.model": response_model or record.model,
        "gen_ai.response.finish_reasons": list(finish_reasons),
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.output_tokens,
        # OTel GenAI: input tokens served from a cache (included in input_tokens)
        "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
        "gen_ai.latency.e2e": record.e2e,
    }
    if response_id is not None:
        attrs["gen_ai.response.id"] = response_id
    if record.spec_proposed:
        attrs["baton.spec_decode.proposed_tokens"] = record.spec_proposed
        attrs["baton.spec_decode.accepted_tokens"] = record.spec_accepted
    for key, value in (("gen_ai.latency.time_in_queue", record.queue_time),
                       ("gen_ai.latency.time_to_first_token", record.ttft),
                       ("gen_ai.latency.time_in_model_prefill", record.model_prefill_time),
                       ("gen_ai.latency.time_in_model_decode", record.model_decode_time)):
        if value is not None:
            attrs[key] = value
    return attrs


def _request_attributes(operation: str, model: str,
                        given: Mapping[str, Any] | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": model,
    }
    for key, value in (given or {}).items():
        if value is None:
            continue
        if "." not in key:
            if key not in REQUEST_ATTRIBUTES:
                raise ValueError(f"unknown request attribute {key!r}; expected one of "
                                 f"{sorted(REQUEST_ATTRIBUTES)} or a dotted OTel key")
            key = REQUEST_ATTRIBUTES[key]
        attrs[key] = value
    return attrs


def _step_attributes(step: StepRecord) -> dict[str, Any]:
    return {
        "baton.step.batch_size": step.batch_size,
        "baton.step.prefill_tokens": step.prefill_tokens,
        "baton.step.decode_tokens": step.decode_tokens,
        "baton.step.preempted": step.preempted,
        "baton.step.num_running": step.num_running,
        "baton.step.num_waiting": step.num_waiting,
        "baton.kv.blocks_used": step.kv_blocks_used,
        "baton.kv.blocks_free": step.kv_blocks_free,
        "baton.kv.usage": step.kv_usage,
        "baton.prefix_cache.queries": step.prefix_cache_queries,
        "baton.prefix_cache.hits": step.prefix_cache_hits,
        "baton.step.time.schedule": step.schedule,
        "baton.step.time.prepare": step.prepare,
        "baton.step.time.forward": step.forward,
        "baton.step.time.sample": step.sample,
        "baton.step.time.emit": step.emit,
        "baton.step.host_overhead_share": step.host_overhead_share,
    }


class Tracing:
    """A tracer of its own, or nothing at all (``enabled`` False)."""

    def __init__(self, provider: TracerProvider | None = None, detail: str = "none") -> None:
        self._provider = provider
        self.enabled = provider is not None
        self.detail = detail if self.enabled else "none"
        self.step_spans = self.detail == "step"
        self._tracer = provider.get_tracer("baton.telemetry") if provider is not None else None

    def start_request_span(self, operation: str, model: str,
                           attributes: Mapping[str, Any] | None = None,
                           headers: Mapping[str, str] | None = None,
                           start_time: int | None = None) -> RequestSpan | None:
        """Open the SERVER span "{operation} {model}" of one HTTP request.

        ``attributes`` holds request parameters by short name (see
        ``REQUEST_ATTRIBUTES``; None values are skipped) or full OTel keys.
        ``headers`` are the incoming HTTP headers: a W3C ``traceparent``
        there makes this span its child. None when tracing is off.
        """
        if self._tracer is None:
            return None
        context = None
        if headers:
            carrier = {k.lower(): v for k, v in headers.items() if k.lower() in _TRACE_HEADERS}
            if carrier:
                context = _PROPAGATOR.extract(carrier)
        span = self._tracer.start_span(
            f"{operation} {model}", context=context, kind=SpanKind.SERVER,
            attributes=_request_attributes(operation, model, attributes),
            start_time=start_time)
        return RequestSpan(span, self._tracer)

    def record_step(self, step: StepRecord, start_ns: int, end_ns: int,
                    linked_span_contexts: Iterable[SpanContext | None] = ()) -> None:
        """Record one engine step as span "engine_step", linked to the request
        spans it served. Does nothing unless detail is "step"."""
        if not self.step_spans:
            return
        links = [Link(ctx) for ctx in linked_span_contexts if ctx is not None and ctx.is_valid]
        # A root span of its own: a step serves many requests, so it links to
        # them rather than belonging to one.
        span = self._tracer.start_span("engine_step", context=Context(),
                                       kind=SpanKind.INTERNAL, links=links,
                                       attributes=_step_attributes(step), start_time=start_ns)
        span.end(end_time=end_ns)

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        """Export what is buffered now; True when done in time."""
        if self._provider is None:
            return True
        return self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush and stop the exporter. Call once, at server stop."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
            self.enabled = False
            self.step_spans = False


def setup_tracing(service_name_default: str = "baton", otlp_endpoint: str | None = None,
                  detail: str = "request", exporter: SpanExporter | None = None) -> Tracing:
    """Build the process's ``Tracing`` from the flag and the OTEL_* environment.

    ``exporter`` replaces the OTLP exporter (tests pass an
    ``InMemorySpanExporter``); it is then fed synchronously by a
    ``SimpleSpanProcessor``, where OTLP goes through a ``BatchSpanProcessor``.
    """
    if detail not in DETAILS:
        raise ValueError(f"trace detail must be one of {DETAILS}, got {detail!r}")
    if detail == "none" or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Tracing()
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            return Tracing()
        if not (otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
            return Tracing()
        processor = BatchSpanProcessor(_otlp_exporter(otlp_endpoint))
    provider = TracerProvider(resource=_resource(service_name_default), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return Tracing(provider, detail)


def otlp_protocol() -> str:
    """The configured OTLP traces protocol: "grpc" or "http/protobuf"."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    protocol = protocol.strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; "
                         "set OTEL_EXPORTER_OTLP_PROTOCOL to grpc or http/protobuf")
    return protocol


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    """The OTLP exporter; with ``endpoint`` None it reads the OTEL_* variables."""
    # Imported here: the gRPC stack is heavy and unused when tracing is off.
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    if endpoint is not None and urlparse(endpoint).path in ("", "/"):
        # The flag names the collector, like OTEL_EXPORTER_OTLP_ENDPOINT does.
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


def _resource(service_name_default: str) -> Resource:
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES but
    # would let an explicit service.name win over them, so the default goes in
    # only where neither variable named the service.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name_default}))
    return resource
