"""LiveStats, the figures behind GET /dashboard, on made-up steps and requests
with an explicit clock: rates, percentiles, windows, history and bounds."""

from __future__ import annotations

import pytest

from service.live_stats import LiveStats, percentiles
from telemetry.records import RequestRecord, StepRecord

T0 = 1000.0


def _step(batch=2, prefill=0, decode=2, running=2, waiting=0, kv=0.25, preempted=0,
          forward=0.008, schedule=0.001, prepare=0.001, sample=0.0005,
          emit=0.0005) -> StepRecord:
    return StepRecord(batch_size=batch, prefill_tokens=prefill, decode_tokens=decode,
                      preempted=preempted, kv_blocks_used=int(kv * 100),
                      kv_blocks_free=100 - int(kv * 100), kv_usage=kv, num_running=running,
                      num_waiting=waiting, schedule=schedule, prepare=prepare,
                      forward=forward, sample=sample, emit=emit)


def _request(rid="r", arrival=T0, ttft=0.1, gaps=(0.02, 0.02, 0.02), status="ok",
             error_type=None, prompt=10) -> tuple[RequestRecord, list[RequestRecord]]:
    first = arrival + ttft if ttft is not None else None
    times = [first] if first is not None else []
    for gap in gaps:
        times.append(times[-1] + gap)
    finished = times[-1] if times else arrival + 0.001
    choice = RequestRecord(
        request_id=rid, operation="chat", model="m", status=status,
        finish_reason="stop" if status == "ok" else None, prompt_tokens=prompt,
        output_tokens=len(times), arrival=arrival, finished=finished, first_scheduled=arrival,
        first_token=first, error_type=error_type, token_times=times)
    combined = RequestRecord(
        request_id=rid, operation="chat", model="m", status=status,
        finish_reason=choice.finish_reason, prompt_tokens=prompt, output_tokens=len(times),
        arrival=arrival, finished=finished, first_scheduled=arrival, first_token=first,
        error_type=error_type)
    return combined, ([choice] if status == "ok" else [])


def test_percentiles_nearest_rank():
    p = percentiles(float(i) for i in range(1, 101))
    assert (p.count, p.p50, p.p95, p.p99) == (100, 50.0, 95.0, 99.0)
    assert percentiles([]).p50 is None and percentiles([]).count == 0
    one = percentiles([0.3])
    assert one.p50 == one.p95 == one.p99 == 0.3


def test_token_rates_and_gauges_follow_steps():
    live = LiveStats("m", rate_window_s=5.0, started=T0 - 100)
    # 10 steps a second for 5 seconds: 20 decode tokens and 40 prompt tokens a second
    for i in range(50):
        live.observe_step(_step(prefill=4, decode=2, running=3, waiting=1, kv=0.5),
                          now=T0 + i * 0.1)
    snap = live.snapshot(now=T0 + 5.0)
    assert snap.tokens_out_per_s == pytest.approx(20.0, rel=0.05)
    assert snap.tokens_in_per_s == pytest.approx(40.0, rel=0.05)
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 1, 0.5)
    assert snap.batch_size == 2 and snap.batch_size_mean == pytest.approx(2.0)
    assert snap.steps == 50
    split = snap.step_split
    assert split.forward == pytest.approx(0.008)
    assert split.host_overhead_share == pytest.approx(0.0025 / 0.011)
    # an idle step moves the gauges, not the batch figures or the split
    live.observe_step(_step(batch=0, decode=0, running=0, waiting=0, kv=0.0, forward=0.0),
                      now=T0 + 5.5)
    snap = live.snapshot(now=T0 + 5.6)
    assert (snap.running, snap.kv_usage, snap.batch_size) == (0, 0.0, 2)
    assert snap.step_split.forward == pytest.approx(0.008)
    # and nothing moves for a while: the rate falls to zero
    assert live.snapshot(now=T0 + 30).tokens_out_per_s == 0.0


def test_history_has_one_point_per_second_and_carries_gauges():
    live = LiveStats("m", history_s=10, started=T0)
    live.observe_step(_step(decode=3, running=4, waiting=2, kv=0.4), now=T0 + 0.5)
    live.observe_step(_step(decode=5, running=5, waiting=1, kv=0.5), now=T0 + 0.7)
    live.observe_step(_step(decode=1, running=1, waiting=0, kv=0.1), now=T0 + 3.2)
    history = live.snapshot(now=T0 + 5.1).history
    assert [p.t for p in history] == list(range(-9, 1))
    by_t = {p.t: p for p in history}
    assert by_t[-5].tokens_out == 8 and by_t[-5].steps == 2 and by_t[-5].batch_size == 2.0
    # a second's gauges are its peaks ...
    assert (by_t[-5].running, by_t[-5].waiting, by_t[-5].kv_usage) == (5, 2, 0.5)
    # ... and a quiet second keeps the state the last step left
    assert (by_t[-4].running, by_t[-4].waiting, by_t[-4].tokens_out) == (5, 1, 0)
    assert by_t[-2].tokens_out == 1 and by_t[0].running == 1 and by_t[0].kv_usage == 0.1
    assert by_t[-9].running == 0  # before the first step


def test_requests_give_latency_percentiles_and_the_recent_list():
    live = LiveStats("m", recent=5, window_s=60.0, started=T0)
    for i in range(8):
        combined, choices = _request(rid=f"r{i}", arrival=T0 + i, ttft=0.1 * (i + 1))
        live.observe_request(combined, choices, now=combined.finished)
    bad, _ = _request(rid="bad", arrival=T0 + 9, ttft=None, gaps=(), status="error",
                      error_type="invalid_request_error")
    live.observe_request(bad, [], now=T0 + 9.01)
    snap = live.snapshot(now=T0 + 10)
    assert snap.requests_finished == 9 and snap.requests_failed == 1
    assert snap.prompt_tokens == 90 and snap.output_tokens == 32
    assert snap.ttft.count == 8
    assert snap.ttft.p50 == pytest.approx(0.4) and snap.ttft.p99 == pytest.approx(0.8)
    assert snap.itl.count == 24 and snap.itl.p95 == pytest.approx(0.02)
    assert snap.e2e.count == 8  # failures are not latencies
    assert [r.id for r in snap.recent] == ["bad", "r7", "r6", "r5", "r4"]  # newest first
    assert snap.recent[0].status == "error"
    assert snap.recent[0].error_type == "invalid_request_error"
    assert snap.recent[1].itl_mean == pytest.approx(0.02)
    assert snap.recent[1].ttft == pytest.approx(0.8)
    # a minute later the samples have left the window; the totals stay
    later = live.snapshot(now=T0 + 80)
    assert later.ttft.count == 0 and later.ttft.p50 is None
    assert later.requests_finished == 9


def test_memory_is_bounded():
    live = LiveStats("m", recent=3, max_samples=100, history_s=30, window_s=30, started=T0)
    for i in range(500):
        combined, choices = _request(rid=str(i), arrival=T0 + i * 0.01)
        live.observe_request(combined, choices, now=T0 + i * 0.01)
    for i in range(5000):
        live.observe_step(_step(), now=T0 + i * 0.1)
    assert len(live._recent) == 3
    assert len(live._ttft) == len(live._itl) == len(live._e2e) == 100
    assert len(live._seconds) <= 31
    assert len(live.snapshot(now=T0 + 500).history) == 30
