"""Prometheus metrics: what a scrape shows after requests and steps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.metrics import Metrics
from telemetry.records import RequestRecord, StepRecord

MODEL = "SmolLM2-135M-Instruct"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

# OpenTelemetry GenAI semantic conventions, model server metrics.
OTEL_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
             2.5, 5.0, 7.5, 10.0]
OTEL_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
OTEL_DURATION = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                 20.48, 40.96, 81.92]


def ok_record(operation: str = "chat", t0: float = 100.0) -> RequestRecord:
    # queue 0.1 s, TTFT 0.3 s, 4 tokens, e2e 1.0 s -> TPOT (1.0-0.3)/3
    return RequestRecord(
        request_id="r1", operation=operation, model=MODEL, status="ok",
        finish_reason="stop", prompt_tokens=7, output_tokens=4,
        arrival=t0, first_scheduled=t0 + 0.1, first_token=t0 + 0.3, finished=t0 + 1.0,
        token_times=[t0 + 0.3, t0 + 0.32, t0 + 0.6, t0 + 1.0])


def failed_record() -> RequestRecord:
    return RequestRecord(
        request_id="r2", operation="text_completion", model=MODEL, status="error",
        finish_reason="error", error_type="RuntimeError", prompt_tokens=3, output_tokens=0,
        arrival=10.0, first_scheduled=10.05, finished=10.5)


def step(batch_size: int = 4, preempted: int = 0) -> StepRecord:
    return StepRecord(batch_size=batch_size, prefill_tokens=32, decode_tokens=3,
                      preempted=preempted, kv_blocks_used=40, kv_blocks_free=60, kv_usage=0.4,
                      num_running=batch_size, num_waiting=2, schedule=0.001, prepare=0.002,
                      forward=0.012, sample=0.004, emit=0.001)


def scrape(metrics: Metrics) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} from the rendered text."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x
                                                         for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def bucket_bounds(samples: dict, name: str, **labels: str) -> list[float]:
    return [float(lab["le"]) for lab, _ in samples[name + "_bucket"]
            if lab["le"] != "+Inf" and all(lab.get(k) == x for k, x in labels.items())]


def test_bucket_boundaries_are_the_otel_ones():
    metrics = Metrics(MODEL)
    metrics.observe_request(ok_record())
    samples = scrape(metrics)
    chat = {"gen_ai_operation_name": "chat"}
    assert bucket_bounds(samples, "gen_ai_server_time_to_first_token_seconds", **chat) == OTEL_TTFT
    assert bucket_bounds(samples, "gen_ai_server_time_per_output_token_seconds",
                         **chat) == OTEL_TPOT
    assert bucket_bounds(samples, "gen_ai_server_request_duration_seconds",
                         **chat, error_type="") == OTEL_DURATION


def test_request_moves_histograms_and_counters():
    metrics = Metrics(MODEL)
    before = scrape(metrics)
    assert value(before, "gen_ai_server_time_to_first_token_seconds_count",
                 gen_ai_operation_name="chat") == 0
    metrics.observe_request(ok_record())
    metrics.observe_request(ok_record(operation="text_completion"))
    s = scrape(metrics)
    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert value(s, ttft + "_count", gen_ai_operation_name="chat") == 1
    assert value(s, ttft + "_count", gen_ai_operation_name="text_completion") == 1
    assert value(s, ttft + "_sum", gen_ai_operation_name="chat") == pytest.approx(0.3)
    # 0.3 s lands between the 0.25 and 0.5 boundaries
    assert value(s, ttft + "_bucket", gen_ai_operation_name="chat", le="0.25") == 0
    assert value(s, ttft + "_bucket", gen_ai_operation_name="chat", le="0.5") == 1
    tpot = "gen_ai_server_time_per_output_token_seconds"
    assert value(s, tpot + "_sum", gen_ai_operation_name="chat") == pytest.approx(0.7 / 3)
    duration = "gen_ai_server_request_duration_seconds"
    assert value(s, duration + "_count", gen_ai_operation_name="chat", error_type="") == 1
    assert value(s, duration + "_sum", gen_ai_operation_name="chat",
                 error_type="") == pytest.approx(1.0)
    assert value(s, "baton_inter_token_latency_seconds_count") == 6  # 3 gaps per request
    assert value(s, "baton_inter_token_latency_seconds_bucket", le="0.025") == 2  # 0.02 gaps
    assert value(s, "baton_request_queue_time_seconds_count") == 2
    assert value(s, "baton_prompt_tokens_total") == 14
    assert value(s, "baton_generation_tokens_total") == 8
    assert value(s, "baton_requests_total", finish_reason="stop") == 2
    assert "baton_request_errors_total" not in s


def test_failed_request_counts_error_and_no_latency_of_success():
    metrics = Metrics(MODEL)
    metrics.observe_request(failed_record())
    s = scrape(metrics)
    assert value(s, "baton_request_errors_total", error_type="RuntimeError") == 1
    assert value(s, "baton_requests_total", finish_reason="error") == 1
    assert value(s, "gen_ai_server_request_duration_seconds_count",
                 gen_ai_operation_name="text_completion", error_type="RuntimeError") == 1
    # TTFT and TPOT are for successful responses only
    assert value(s, "gen_ai_server_time_to_first_token_seconds_count",
                 gen_ai_operation_name="text_completion") == 0
    assert value(s, "gen_ai_server_request_duration_seconds_count",
                 gen_ai_operation_name="text_completion", error_type="") == 0
    assert value(s, "baton_prompt_tokens_total") == 3


def test_every_series_carries_model_name_and_instances_are_separate():
    a, b = Metrics("model-a"), Metrics("model-b")
    a.observe_request(ok_record())
    a.observe_step(step())
    a.admission_rejected("queue_full")
    sa, sb = scrape(a), scrape(b)
    for name, series in sa.items():
        if name.startswith("process_"):
            continue
        for labels, _ in series:
            assert labels.get("model_name") == "model-a", (name, labels)
    assert value(sa, "baton_admission_rejections_total", reason="queue_full") == 1
    assert value(sb, "gen_ai_server_time_to_first_token_seconds_count",
                 gen_ai_operation_name="chat") == 0
    assert "baton_admission_rejections_total" not in sb


def test_observe_step_many_times():
    metrics = Metrics(MODEL)
    n = 2000
    for i in range(n):
        metrics.observe_step(step(batch_size=1 + i % 8, preempted=1 if i % 100 == 0 else 0))
    metrics.observe_step(step(batch_size=0))  # idle step: gauges only
    s = scrape(metrics)
    assert value(s, "baton_engine_step_duration_seconds_count") == n
    assert value(s, "baton_engine_step_duration_seconds_sum") == pytest.approx(n * 0.02)
    assert value(s, "baton_engine_batch_size_count") == n
    assert value(s, "baton_engine_batch_size_bucket", le="4.0") == n / 2  # sizes 1..4 of 1..8
    assert value(s, "baton_engine_step_tokens_sum") == n * 35
    assert value(s, "baton_engine_step_component_seconds_total",
                 component="forward") == pytest.approx(n * 0.012)
    assert value(s, "baton_engine_step_component_seconds_total",
                 component="schedule") == pytest.approx(n * 0.001)
    assert value(s, "baton_preemptions_total") == n / 100
    assert value(s, "baton_num_requests_running") == 0  # the idle step came last
    assert value(s, "baton_num_requests_waiting") == 2
    assert value(s, "baton_kv_cache_usage_ratio") == 0.4
    assert value(s, "baton_kv_cache_blocks_used") == 40
    assert value(s, "baton_kv_cache_blocks_free") == 60
    assert value(s, "baton_engine_host_overhead_ratio") == pytest.approx(0.004 / 0.02)
    assert value(s, "baton_engine_step_host_overhead_ratio_count") == n


def test_openmetrics_on_request():
    body, content_type = Metrics(MODEL).render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_docs_list_exactly_the_exposed_metrics():
    body, _ = Metrics(MODEL).render()
    exposed = set()
    for family in text_string_to_metric_families(body.decode()):
        if family.name.startswith("process_"):
            continue
        exposed.add(family.name + "_total" if family.type == "counter" else family.name)
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(), re.MULTILINE))
    assert documented == exposed

