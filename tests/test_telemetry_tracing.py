"""OpenTelemetry traces: request spans, their children, step spans, OTLP export."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from telemetry.records import RequestRecord, StepRecord
from telemetry.tracing import monotonic_to_epoch_ns, setup_tracing

MODEL = "SmolLM2-135M-Instruct"
INCOMING_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
INCOMING_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{INCOMING_TRACE_ID}-{INCOMING_SPAN_ID}-01"


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    """Each test configures tracing itself; none sees the caller's OTEL_*."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                 "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


def record(status: str = "ok", **overrides) -> RequestRecord:
    now = time.monotonic()
    fields = dict(request_id="chatcmpl-1", operation="chat", model=MODEL, status=status,
                  finish_reason="stop" if status == "ok" else "error", prompt_tokens=9,
                  output_tokens=5, arrival=now - 1.0, first_scheduled=now - 0.9,
                  first_token=now - 0.6, finished=now, token_times=[now - 0.6, now])
    fields.update(overrides)
    return RequestRecord(**fields)


def by_name(spans) -> dict:
    out = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_request_span_attributes_and_children(exporter):
    tracing = setup_tracing(exporter=exporter)
    assert tracing.enabled and not tracing.step_spans
    params = {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": None, "seed": 3,
              "choice_count": 1, "stream": True, "stop_sequences": ["\n\n"],
              "server.port": 8000}
    rs = tracing.start_request_span("chat", MODEL, params, headers={})
    with rs.child("validate_and_tokenize", attributes={"baton.prompt_tokens": 9}):
        pass
    rec = record()
    # two prefill chunks recorded after the fact; no derived "prefill" then
    mid = (rec.first_scheduled + rec.first_token) / 2
    rs.child("prefill", monotonic_to_epoch_ns(rec.first_scheduled), monotonic_to_epoch_ns(mid))
    rs.child("prefill", monotonic_to_epoch_ns(mid), monotonic_to_epoch_ns(rec.first_token))
    rs.finish(rec, response_id="chatcmpl-1", finish_reasons=["stop"])
    rs.finish(rec)  # a second finish changes nothing

    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == sorted(["chat " + MODEL, "validate_and_tokenize", "queue_wait",
                                    "prefill", "decode"])
    [root] = spans["chat " + MODEL]
    assert root.kind is SpanKind.SERVER
    assert root.parent is None
    assert root.status.status_code is StatusCode.UNSET
    attrs = dict(root.attributes)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "baton"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert "gen_ai.request.top_k" not in attrs  # None: not given
    assert attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.request.choice.count"] == 1
    assert attrs["gen_ai.request.stream"] is True
    assert list(attrs["gen_ai.request.stop_sequences"]) == ["\n\n"]
    assert attrs["server.port"] == 8000
    assert attrs["gen_ai.response.id"] == "chatcmpl-1"
    assert attrs["gen_ai.response.model"] == MODEL
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["stop"]
    assert attrs["gen_ai.usage.input_tokens"] == 9
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.1)
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.4)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(1.0)
    assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.3)
    assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.6)
    assert "error.type" not in attrs

    root_ctx = root.get_span_context()
    assert rs.trace_id == format(root_ctx.trace_id, "032x")
    assert rs.span_id == format(root_ctx.span_id, "016x")
    for name in ("validate_and_tokenize", "queue_wait", "prefill", "decode"):
        for child in spans[name]:
            assert child.parent.span_id == root_ctx.span_id, name
            assert child.context.trace_id == root_ctx.trace_id
    assert len(spans["prefill"]) == 2
    [queue_wait] = spans["queue_wait"]
    assert (queue_wait.end_time - queue_wait.start_time) / 1e9 == pytest.approx(0.1, abs=1e-3)
    [decode] = spans["decode"]
    assert (decode.end_time - decode.start_time) / 1e9 == pytest.approx(0.6, abs=1e-3)
    assert dict(spans["validate_and_tokenize"][0].attributes) == {"baton.prompt_tokens": 9}


def test_incoming_traceparent_is_the_parent(exporter):
    tracing = setup_tracing(exporter=exporter)
    # header names are case-insensitive on the wire
    rs = tracing.start_request_span("text_completion", MODEL,
                                    headers={"Traceparent": TRACEPARENT, "Accept": "*/*"})
    assert rs.trace_id == INCOMING_TRACE_ID
    rs.finish(record(operation="text_completion"))
    spans = by_name(exporter.get_finished_spans())
    [root] = spans["text_completion " + MODEL]
    assert format(root.context.trace_id, "032x") == INCOMING_TRACE_ID
    assert format(root.parent.span_id, "016x") == INCOMING_SPAN_ID
    assert root.parent.is_remote
    assert format(spans["decode"][0].context.trace_id, "032x") == INCOMING_TRACE_ID


def test_failed_request_marks_span_error(exporter):
    tracing = setup_tracing(exporter=exporter)
    rs = tracing.start_request_span("chat", MODEL)
    rs.finish(record("error", error_type="RuntimeError", first_token=None, output_tokens=0,
                     token_times=[]))
    spans = by_name(exporter.get_finished_spans())
    [root] = spans["chat " + MODEL]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] == "RuntimeError"
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["error"]
    assert "gen_ai.latency.time_to_first_token" not in root.attributes
    assert "decode" not in spans and "prefill" not in spans  # no token, no such phase
    assert "queue_wait" in spans


def test_step_span_links_to_request_spans(exporter):
    tracing = setup_tracing(exporter=exporter, detail="step")
    a = tracing.start_request_span("chat", MODEL)
    b = tracing.start_request_span("chat", MODEL, headers={"traceparent": TRACEPARENT})
    step = StepRecord(batch_size=2, prefill_tokens=12, decode_tokens=1, preempted=0,
                      kv_blocks_used=7, kv_blocks_free=93, kv_usage=0.07, num_running=2,
                      num_waiting=1, schedule=0.001, prepare=0.002, forward=0.01,
                      sample=0.002, emit=0.005)
    start = time.time_ns()
    tracing.record_step(step, start, start + 20_000_000, [a.span_context, b.span_context, None])
    [span] = by_name(exporter.get_finished_spans())["engine_step"]
    assert span.parent is None
    assert span.end_time - span.start_time == 20_000_000
    assert [link.context for link in span.links] == [a.span_context, b.span_context]
    assert span.attributes["baton.step.batch_size"] == 2
    assert span.attributes["baton.step.prefill_tokens"] == 12
    assert span.attributes["baton.kv.blocks_free"] == 93
    assert span.attributes["baton.step.time.forward"] == 0.01
    assert span.attributes["baton.step.host_overhead_share"] == pytest.approx(0.4)


def test_no_step_spans_at_request_detail(exporter):
    tracing = setup_tracing(exporter=exporter, detail="request")
    step = StepRecord(1, 1, 0, 0, 1, 1, 0.5, 1, 0)
    tracing.record_step(step, time.time_ns(), time.time_ns(), [])
    assert exporter.get_finished_spans() == ()


def test_disabled_tracing_is_inert(exporter):
    for tracing in (setup_tracing(), setup_tracing(otlp_endpoint=None, detail="step"),
                    setup_tracing(exporter=exporter, detail="none")):
        assert not tracing.enabled and not tracing.step_spans
        assert tracing._provider is None
        assert tracing.start_request_span("chat", MODEL, {"max_tokens": 1}) is None
        tracing.record_step(StepRecord(1, 1, 0, 0, 1, 1, 0.5, 1, 0), 0, 1, [])
        assert tracing.force_flush()
        tracing.shutdown()
    assert exporter.get_finished_spans() == ()


def test_otel_switches_off(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not setup_tracing().enabled
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not setup_tracing().enabled


def test_service_name_and_sampler_from_environment(monkeypatch, exporter):
    tracing = setup_tracing(exporter=exporter)
    assert tracing._provider.resource.attributes["service.name"] == "baton"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "baton-eu-1")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = setup_tracing(exporter=exporter)
    assert tracing._provider.resource.attributes["service.name"] == "baton-eu-1"
    rs = tracing.start_request_span("chat", MODEL)
    assert not rs.span.is_recording()
    assert len(rs.trace_id) == 32  # logs still get an id
    rs.finish(record())
    assert exporter.get_finished_spans() == ()


def test_bad_configuration_is_refused(monkeypatch, exporter):
    with pytest.raises(ValueError, match="trace detail"):
        setup_tracing(detail="steps")
    tracing = setup_tracing(exporter=exporter)
    with pytest.raises(ValueError, match="max_token"):
        tracing.start_request_span("chat", MODEL, {"max_token": 3})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        setup_tracing(otlp_endpoint="http://127.0.0.1:9")


# -- real OTLP receivers ------------------------------------------------------

def export_one_span(tracing, model: str) -> None:
    assert tracing.enabled
    rs = tracing.start_request_span("chat", model)
    rs.finish(record(model=model))
    assert tracing.force_flush(10_000)
    tracing.shutdown()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.received: queue.Queue = queue.Queue()

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self.received.put(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def span_names(request: trace_service_pb2.ExportTraceServiceRequest) -> set[str]:
    return {span.name for rs in request.resource_spans for ss in rs.scope_spans
            for span in ss.spans}


def service_name(request: trace_service_pb2.ExportTraceServiceRequest) -> str:
    [attr] = [a for a in request.resource_spans[0].resource.attributes
              if a.key == "service.name"]
    return attr.value.string_value


def test_otlp_grpc_export_reaches_a_receiver(monkeypatch):
    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}")
        export_one_span(setup_tracing(), "grpc-model")
        request = service.received.get(timeout=10)
        assert "chat grpc-model" in span_names(request)
        assert service_name(request) == "baton"
    finally:
        server.stop(grace=None)


def test_otlp_http_export_reaches_a_receiver():
    received: queue.Queue = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.put((self.path, self.headers.get("Content-Type"), request))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):  # keep test output quiet
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        # default protocol (http/protobuf); the flag names the collector root
        export_one_span(setup_tracing(otlp_endpoint=f"http://127.0.0.1:{httpd.server_port}"),
                        "http-model")
        path, content_type, request = received.get(timeout=10)
        assert path == "/v1/traces"
        assert content_type == "application/x-protobuf"
        assert "chat http-model" in span_names(request)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


OTELSINK = shutil.which("otelsink") or shutil.which("otelsink",
                                                 path=os.path.dirname(sys.executable))


@pytest.mark.skipif(OTELSINK is None, reason="oteltest is not installed")
def test_otlp_export_reaches_otelsink(monkeypatch):
    """oteltest's ``otelsink``, a stand-alone OTLP gRPC receiver, prints every
    export it gets. It always listens on port 4317."""
    if _port_in_use(4317):
        pytest.skip("port 4317 is taken (a collector is running?)")
    sink = subprocess.Popen([OTELSINK], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in sink.stdout],
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 15
        while not _port_in_use(4317):
            assert sink.poll() is None, "otelsink exited"
            assert time.monotonic() < deadline, "otelsink did not start listening"
            time.sleep(0.05)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        export_one_span(setup_tracing(otlp_endpoint="http://127.0.0.1:4317"), "sink-model")
        deadline = time.monotonic() + 10
        while True:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if "chat sink-model" in line:
                break
    finally:
        sink.kill()
        sink.wait(timeout=5)
        reader.join(timeout=5)
