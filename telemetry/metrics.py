"""Prometheus metrics for one served model.

Each ``Metrics`` owns its own ``CollectorRegistry`` (tests build several, and
nothing leaks into prometheus_client's global registry). Every series carries
``model_name``. The three ``gen_ai_server_*`` histograms follow the
OpenTelemetry GenAI semantic conventions, bucket boundaries included; the rest
are ``baton_*``. docs/metrics.md lists them all.

``observe_step`` runs once per engine step, so every labelled child it touches
is resolved once in ``__init__`` and held as a bound method, and the gauges
and per-component sums are read from plain attributes when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from telemetry.records import RequestRecord, StepRecord

# OpenTelemetry GenAI semantic conventions, "Generative AI model server metrics":
# each metric "SHOULD be specified with ExplicitBucketBoundaries of" these.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                            5.12, 10.24, 20.48, 40.96, 81.92)

# Ours. Inter-token latency starts below the TPOT buckets: small models decode
# in a few milliseconds per token.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32,
                      0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
STEP_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                         0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

OPERATIONS = ("chat", "text_completion")
STEP_COMPONENTS = ("schedule", "prepare", "forward", "sample", "emit")


class Metrics:
    """Every metric of one model, and the calls that move them."""

    def __init__(self, model_name: str) -> None:
        # The *_created series would double the text exposition for nothing
        # Prometheus uses; the switch is process-wide, and only telemetry
        # creates metrics in this process.
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self._define_request_metrics()
        self._define_step_metrics()

    # -- definitions ------------------------------------------------------

    def _define_request_metrics(self) -> None:
        r, m = self.registry, self.model_name
        op_labels = ("model_name", "gen_ai_operation_name")
        self._ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token, for successful responses.",
            op_labels, buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first, for successful responses.",
            op_labels, buckets=TPOT_BUCKETS, registry=r)
        self._duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Arrival to last output token; error_type is empty on success.",
            (*op_labels, "error_type"), buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self._itl = Histogram(
            "baton_inter_token_latency_seconds",
            "Time between consecutive output deltas of a request.",
            ("model_name",), buckets=ITL_BUCKETS, registry=r).labels(m)
        self._queue_time = Histogram(
            "baton_request_queue_time_seconds",
            "Arrival to first scheduled.",
            ("model_name",), buckets=QUEUE_TIME_BUCKETS, registry=r).labels(m)
        self._prompt_tokens = Counter(
            "baton_prompt_tokens", "Prompt tokens of finished requests.",
            ("model_name",), registry=r).labels(m)
        self._generation_tokens = Counter(
            "baton_generation_tokens", "Output tokens of finished requests.",
            ("model_name",), registry=r).labels(m)
        self._requests = Counter(
            "baton_requests", "Finished requests by finish reason.",
            ("model_name", "finish_reason"), registry=r)
        self._errors = Counter(
            "baton_request_errors", "Failed requests by error type.",
            ("model_name", "error_type"), registry=r)
        self._rejections = Counter(
            "baton_admission_rejections", "Requests refused at admission, by reason.",
            ("model_name", "reason"), registry=r)
        # Children for the usual label values up front; others on first use.
        self._ttft_by_op = {op: self._ttft.labels(m, op) for op in OPERATIONS}
        self._tpot_by_op = {op: self._tpot.labels(m, op) for op in OPERATIONS}
        self._ok_duration_by_op = {op: self._duration.labels(m, op, "") for op in OPERATIONS}

    def _define_step_metrics(self) -> None:
        r, m = self.registry, self.model_name
        # Gauges read the last step when scraped, so a step costs them nothing.
        self._last_step = StepRecord(0, 0, 0, 0, 0, 0, 0.0, 0, 0)
        self._last_overhead = 0.0

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, ("model_name",), registry=r).labels(m).set_function(read)

        def histogram(name: str, doc: str, buckets: tuple) -> Callable[[float], None]:
            return Histogram(name, doc, ("model_name",), buckets=buckets,
                             registry=r).labels(m).observe

        gauge("baton_num_requests_running", "Requests in the running batch after the last step.",
              lambda: self._last_step.num_running)
        gauge("baton_num_requests_waiting", "Requests waiting to be scheduled after the last step.",
              lambda: self._last_step.num_waiting)
        gauge("baton_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).",
              lambda: self._last_step.kv_usage)
        gauge("baton_kv_cache_blocks_used", "KV cache blocks in use.",
              lambda: self._last_step.kv_blocks_used)
        gauge("baton_kv_cache_blocks_free", "KV cache blocks free.",
              lambda: self._last_step.kv_blocks_free)
        gauge("baton_engine_host_overhead_ratio",
              "Host overhead share of the last step that ran: (schedule+prepare+emit)/total.",
              lambda: self._last_overhead)
        self._inc_preemptions = Counter(
            "baton_preemptions", "Requests preempted to free KV cache blocks.",
            ("model_name",), registry=r).labels(m).inc
        # vLLM's prefix_cache_queries / prefix_cache_hits: hit rate is
        # rate(hits) / rate(queries).
        self._inc_prefix_queries = Counter(
            "baton_prefix_cache_queries",
            "Tokens of admitted requests looked up in the prefix cache.",
            ("model_name",), registry=r).labels(m).inc
        self._inc_prefix_hits = Counter(
            "baton_prefix_cache_hits",
            "Tokens of admitted requests found in the prefix cache (not computed).",
            ("model_name",), registry=r).labels(m).inc
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens /
        # _num_drafts: acceptance is rate(accepted) / rate(proposed), the mean
        # tokens a verifying row yields 1 + rate(accepted) / rate(verified).
        spec = ("model_name", "method")
        self._spec_proposed = Counter(
            "baton_spec_decode_proposed_tokens",
            "Tokens proposed by speculative decoding and verified by the model.", spec,
            registry=r)
        self._spec_accepted = Counter(
            "baton_spec_decode_accepted_tokens",
            "Proposed tokens the model's own samples confirmed.", spec, registry=r)
        self._spec_rows = Counter(
            "baton_spec_decode_verified_rows",
            "Decode rows that verified proposals (one per request and step).", spec,
            registry=r)
        self._inc_engine_faults = Counter(
            "baton_engine_faults", "Requests an engine fault failed (the request's own "
            "fault, or one that could not be pinned on fewer requests).",
            ("model_name",), registry=r).labels(m).inc
        self._state_sizes: Callable[[], dict[str, int]] | None = None
        r.register(_RequestStateEntries(m, lambda: self._state_sizes))
        self._observe_step_duration = histogram(
            "baton_engine_step_duration_seconds",
            "Wall time of one engine step (all components).", STEP_DURATION_BUCKETS)
        self._observe_batch_size = histogram(
            "baton_engine_batch_size", "Requests in one engine step.", BATCH_SIZE_BUCKETS)
        self._observe_step_tokens = histogram(
            "baton_engine_step_tokens", "Tokens (prefill + decode) computed in one step.",
            STEP_TOKENS_BUCKETS)
        self._observe_overhead = histogram(
            "baton_engine_step_host_overhead_ratio",
            "Host overhead share per step: (schedule+prepare+emit)/total.", RATIO_BUCKETS)
        self._components = _StepComponentSeconds(m)
        r.register(self._components)

    # -- the calls ----------------------------------------------------------

    def observe_request(self, record: RequestRecord) -> None:
        """Count one finished request (or choice). Call once, at its end."""
        m, op = self.model_name, record.operation
        self._prompt_tokens.inc(record.prompt_tokens)
        self._generation_tokens.inc(record.output_tokens)
        self._requests.labels(m, record.finish_reason or "unknown").inc()
        queue_time = record.queue_time
        if queue_time is not None:
            self._queue_time.observe(queue_time)
        if record.status != "ok":
            error_type = record.error_type or "_OTHER"
            self._errors.labels(m, error_type).inc()
            self._duration.labels(m, op, error_type).observe(record.e2e)
            return
        duration = self._ok_duration_by_op.get(op) or self._duration.labels(m, op, "")
        duration.observe(record.e2e)
        ttft = record.ttft
        if ttft is not None:
            (self._ttft_by_op.get(op) or self._ttft.labels(m, op)).observe(ttft)
        tpot = record.time_per_output_token
        if tpot is not None:
            (self._tpot_by_op.get(op) or self._tpot.labels(m, op)).observe(tpot)
        times = record.token_times
        observe_itl = self._itl.observe
        for i in range(1, len(times)):
            observe_itl(times[i] - times[i - 1])

    def observe_step(self, step: StepRecord) -> None:
        """Record one engine step. The gauges follow every step (the record
        is kept until the next one: do not change it afterwards); a step that
        ran no request (batch_size 0) leaves the per-step histograms alone."""
        self._last_step = step
        if step.preempted:
            self._inc_preemptions(step.preempted)
        if step.prefix_cache_queries:
            self._inc_prefix_queries(step.prefix_cache_queries)
            self._inc_prefix_hits(step.prefix_cache_hits)
        if step.spec_verified_rows:
            labels = (self.model_name, step.spec_method)
            self._spec_proposed.labels(*labels).inc(step.spec_proposed)
            self._spec_accepted.labels(*labels).inc(step.spec_accepted)
            self._spec_rows.labels(*labels).inc(step.spec_verified_rows)
        if step.batch_size <= 0:
            return
        overhead = step.host_overhead_share
        self._last_overhead = overhead
        self._observe_overhead(overhead)
        self._observe_step_duration(step.total)
        self._observe_batch_size(step.batch_size)
        self._observe_step_tokens(step.prefill_tokens + step.decode_tokens)
        c = self._components
        c.schedule += step.schedule
        c.prepare += step.prepare
        c.forward += step.forward
        c.sample += step.sample
        c.emit += step.emit

    def engine_faults(self, count: int) -> None:
        """Count requests failed by an engine fault."""
        self._inc_engine_faults(count)

    def watch_request_state(self, sizes: Callable[[], dict[str, int]] | None) -> None:
        """Report ``sizes()`` (per-request table -> entries) as
        ``baton_request_state_entries`` when scraped: leak detection."""
        self._state_sizes = sizes

    def admission_rejected(self, reason: str) -> None:
        """Count a request refused before it reached the engine (queue full,
        prompt too long, draining ...). ``reason`` must be low-cardinality."""
        self._rejections.labels(self.model_name, reason).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition for a /metrics response: (body, content type).

        ``accept`` is the request's Accept header; Prometheus text format
        unless it asks for OpenMetrics.
        """
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class _StepComponentSeconds:
    """``baton_engine_step_component_seconds_total``, summed in plain floats
    and turned into a counter family when scraped: five ``Counter.inc`` calls
    a step would cost more than the rest of ``observe_step``. Only the engine
    loop adds; a scrape may read a sum one step old."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.schedule = self.prepare = self.forward = self.sample = self.emit = 0.0

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "baton_engine_step_component_seconds",
            "Seconds spent per step component, summed over steps.",
            labels=("model_name", "component"))
        for component in STEP_COMPONENTS:
            family.add_metric((self.model_name, component), getattr(self, component))
        yield family


class _RequestStateEntries:
    """``baton_request_state_entries{table}``: entries in each per-request
    table (scheduler, detokenizers, backend, queues, telemetry ...), read at
    scrape time. All of them go back to zero when the server is idle."""

    def __init__(self, model_name: str, source: Callable[[], Callable | None]) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "baton_request_state_entries",
            "Entries in each per-request table; zero on an idle server.",
            labels=("model_name", "table"))
        sizes = self._source()
        for table, size in sorted((sizes() if sizes is not None else {}).items()):
            family.add_metric([self._model_name, table], size)
        yield family
