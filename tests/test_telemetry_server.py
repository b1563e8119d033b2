"""Telemetry through a live server: the span tree of a streamed chat request
and of a failing one, step spans linked to request spans, /metrics moving
as requests finish, and log lines carrying the span's trace id."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
import requests
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from service.config import ServerConfig
from telemetry.logs import configure_logging
from telemetry.tracing import setup_tracing
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

MODEL = "tiny-llama"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, exporter):
    tracing = setup_tracing(exporter=exporter, detail="step")
    core = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    with running_server(core, ServerConfig(), model_name=MODEL, tracing=tracing) as srv:
        yield srv
    tracing.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _spans(exporter, trace_id: int):
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_streamed_chat_span_tree(server, client, exporter):
    exporter.clear()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there, how are you? " * 3}],
        max_tokens=6, temperature=0.7, top_p=0.9, seed=3, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": TRACEPARENT})
    chunks = list(stream)
    response_id = chunks[0].id
    trace_id = int(TRACEPARENT.split("-")[1], 16)
    _wait_for(lambda: any(s.name == f"chat {MODEL}" for s in _spans(exporter, trace_id)))
    spans = _spans(exporter, trace_id)
    [root] = [s for s in spans if s.name == f"chat {MODEL}"]
    assert root.kind is SpanKind.SERVER
    assert root.parent.span_id == int(TRACEPARENT.split("-")[2], 16)  # traceparent honoured
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "baton"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.seed"] == 3
    assert a["gen_ai.request.choice.count"] == 1
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.response.id"] == response_id
    assert a["gen_ai.response.model"] == MODEL
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.usage.input_tokens"] > 20
    for key in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill",
                "time_in_model_decode"):
        assert a[f"gen_ai.latency.{key}"] >= 0, key
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    children = [s for s in spans if s.parent and s.parent.span_id == root.context.span_id]
    names = [s.name for s in children]
    for name in ("validate_and_tokenize", "queue_wait", "decode"):
        assert names.count(name) == 1, names
    # the prompt is longer than the 16-token budget: one prefill span per chunk
    assert names.count("prefill") >= 2, names
    for child in children:
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time + 10**6

    # step spans: their own traces, linked to the request span they served
    root_ctx = root.context
    steps = [s for s in exporter.get_finished_spans() if s.name == "engine_step"
             and any(link.context.span_id == root_ctx.span_id for link in s.links)]
    assert len(steps) >= 6  # >= 2 prefill chunks + 5 more decode steps
    for step in steps:
        assert step.attributes["baton.step.batch_size"] >= 1
        assert "baton.kv.blocks_used" in step.attributes
        assert step.attributes["baton.step.time.forward"] > 0


def test_failing_request_marks_span_error(server, client, exporter):
    exporter.clear()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1,
                                  extra_headers={"traceparent": TRACEPARENT})
    trace_id = int(TRACEPARENT.split("-")[1], 16)
    _wait_for(lambda: _spans(exporter, trace_id))
    [root] = [s for s in _spans(exporter, trace_id) if s.name == f"text_completion {MODEL}"]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] == "invalid_request_error"


def test_engine_fault_marks_span_error(server, client, exporter):
    from tests.server_helpers import patched_execute

    def wrap(real):
        def broken(output):
            raise RuntimeError("simulated fault")
        return broken

    exporter.clear()
    with patched_execute(server.core, wrap):
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    _wait_for(lambda: any(s.name == f"text_completion {MODEL}"
                          for s in exporter.get_finished_spans()))
    [root] = [s for s in exporter.get_finished_spans() if s.name == f"text_completion {MODEL}"]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["error.type"] in ("internal_error", "engine_fault")


def _metrics(server) -> dict:
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            samples[key] = sample.value
    return samples


def _value(samples, name, **labels):
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def test_metrics_move_as_requests_finish(server, client):
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt="one two three", max_tokens=4,
                              extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=3, extra_body={"ignore_eos": True})
    _wait_for(lambda: _value(_metrics(server), "gen_ai_server_request_duration_seconds_count")
              >= _value(before, "gen_ai_server_request_duration_seconds_count") + 2)
    after = _metrics(server)
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert _value(after, ttft, model_name=MODEL) == _value(before, ttft, model_name=MODEL) + 2
    assert _value(after, ttft, gen_ai_operation_name="chat") == \
        _value(before, ttft, gen_ai_operation_name="chat") + 1
    assert _value(after, "baton_generation_tokens_total") == \
        _value(before, "baton_generation_tokens_total") + 7
    assert _value(after, "baton_requests_total", finish_reason="length") == \
        _value(before, "baton_requests_total", finish_reason="length") + 2
    assert _value(after, "baton_engine_step_duration_seconds_count") > \
        _value(before, "baton_engine_step_duration_seconds_count")
    assert _value(after, "baton_num_requests_running") == 0
    # a rejected request counts as an error by type
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    errors = _metrics(server)
    assert _value(errors, "baton_request_errors_total", error_type="model_not_found") >= 1


def test_log_line_carries_the_span_trace_id(server, client, exporter):
    buffer = io.StringIO()
    configure_logging(json=True, stream=buffer)
    try:
        exporter.clear()
        client.completions.create(model=MODEL, prompt="log me", max_tokens=2,
                                  extra_body={"ignore_eos": True})
        _wait_for(lambda: "request finished" in buffer.getvalue()
                  or "request_finished" in buffer.getvalue())
    finally:
        configure_logging(json=True)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    [line] = [entry for entry in lines if entry.get("status") == "ok"]
    [span] = [s for s in exporter.get_finished_spans() if s.name == f"text_completion {MODEL}"]
    assert line["trace_id"] == format(span.context.trace_id, "032x")
    assert line["span_id"] == format(span.context.span_id, "016x")
    assert line["output_tokens"] == 2 and line["finish_reason"] == "length"
    assert "log me" not in buffer.getvalue()  # prompts stay out without --log-prompts
