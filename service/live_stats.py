"""Recent figures for the built-in dashboard (``GET /dashboard``).

Fed by the same hooks as telemetry: ``observe_step`` once per engine step,
``observe_request`` once per finished HTTP request. Everything is bounded:
steps are folded into one-second buckets (the last ``history_s`` of them),
latency samples and recent requests live in fixed-size deques, so memory does
not grow with traffic. Both hooks and ``snapshot`` run on the event loop
thread, so nothing here locks.

Unlike Prometheus' counters this is a view of the last minute, for a person
watching, not a store: percentiles are exact over the samples kept.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from telemetry.records import RequestRecord, StepRecord

STEP_COMPONENTS = ("schedule", "prepare", "forward", "sample", "emit")


# ---------------------------------------------------------- what /stats sends

class Percentiles(msgspec.Struct):
    """Seconds; None when no sample falls in the window."""
    count: int
    p50: float | None
    p95: float | None
    p99: float | None


class StepSplit(msgspec.Struct):
    """Mean seconds per step for each component, over the window."""
    schedule: float
    prepare: float
    forward: float
    sample: float
    emit: float
    host_overhead_share: float  # (schedule + prepare + emit) / total


class SecondPoint(msgspec.Struct):
    """One second of history; ``t`` is seconds before now (0 = this second).
    Gauges are the second's peaks; a second without steps keeps the state the
    last step before it left."""
    t: int
    tokens_in: int
    tokens_out: int
    steps: int
    batch_size: float  # mean over the second's steps that ran a request
    running: int
    waiting: int
    kv_usage: float


class RecentRequest(msgspec.Struct):
    id: str
    operation: str
    status: str  # ok | error
    finish_reason: str | None
    error_type: str | None
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    e2e: float
    itl_mean: float | None
    finished_at: float  # unix seconds


class LiveSnapshot(msgspec.Struct):
    model: str
    time: float  # unix seconds
    uptime_s: float
    window_s: float
    requests_finished: int
    requests_failed: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    tokens_in_per_s: float  # prompt tokens computed, last rate_window_s
    tokens_out_per_s: float  # output tokens of decode steps, last rate_window_s
    running: int
    waiting: int
    kv_usage: float
    kv_blocks_used: int
    kv_blocks_free: int
    batch_size: int  # the last step that ran a request
    batch_size_mean: float  # over the window
    preemptions: int
    # prompt tokens of admitted requests looked up in the prefix cache and
    # found there, in all; the hit rate is over the window (None: no lookup)
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float | None
    # speculative decoding ("" without): proposals and accepted ones in all;
    # over the window, the accepted share and the tokens a verifying row
    # yields on average (None: no verifying row)
    spec_method: str
    spec_proposed: int
    spec_accepted: int
    spec_acceptance: float | None
    spec_tokens_per_row: float | None
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    step_split: StepSplit
    history: list[SecondPoint]
    recent: list[RecentRequest]


# ------------------------------------------------------------------ the class

@dataclass(slots=True)
class _Second:
    second: int
    steps: int = 0
    busy_steps: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    batch_sum: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_rows: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    emit: float = 0.0
    # peaks over the second, and the state after its last step
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    last: StepRecord | None = None


class LiveStats:
    """Ring buffers of recent steps and requests, and their summary."""

    def __init__(self, model: str = "model", *, window_s: float = 60.0,
                 rate_window_s: float = 5.0, history_s: int = 60, recent: int = 20,
                 max_samples: int = 8192, started: float | None = None) -> None:
        self.model = model
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.history_s = history_s
        self.started = time.monotonic() if started is None else started
        self._seconds: deque[_Second] = deque(maxlen=max(history_s, int(window_s)) + 1)
        self._recent: deque[RecentRequest] = deque(maxlen=recent)
        # (monotonic time the sample was taken, seconds)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._e2e: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._itl: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._last_step = StepRecord(0, 0, 0, 0, 0, 0, 0.0, 0, 0)
        self._last_batch = 0
        self.steps = 0
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_method = ""
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.requests_finished = 0
        self.requests_failed = 0
        self.prompt_tokens = 0
        self.output_tokens = 0

    # -- the hooks ----------------------------------------------------------

    def observe_step(self, step: StepRecord, now: float | None = None) -> None:
        """One engine step. Cheap: a few additions into this second's bucket."""
        now = time.monotonic() if now is None else now
        second = int(now)
        seconds = self._seconds
        if not seconds or seconds[-1].second != second:
            seconds.append(_Second(second))
        b = seconds[-1]
        b.steps += 1
        b.running = max(b.running, step.num_running)
        b.waiting = max(b.waiting, step.num_waiting)
        b.kv_usage = max(b.kv_usage, step.kv_usage)
        b.last = step
        self._last_step = step
        self.steps += 1
        self.preemptions += step.preempted
        if step.prefix_cache_queries:
            b.prefix_queries += step.prefix_cache_queries
            b.prefix_hits += step.prefix_cache_hits
            self.prefix_cache_queries += step.prefix_cache_queries
            self.prefix_cache_hits += step.prefix_cache_hits
        if step.spec_verified_rows:
            self.spec_method = step.spec_method
            b.spec_proposed += step.spec_proposed
            b.spec_accepted += step.spec_accepted
            b.spec_rows += step.spec_verified_rows
            self.spec_proposed += step.spec_proposed
            self.spec_accepted += step.spec_accepted
        if step.batch_size <= 0:
            return
        self._last_batch = step.batch_size
        b.busy_steps += 1
        b.batch_sum += step.batch_size
        b.tokens_in += step.prefill_tokens
        # a decode row yields one output token, and its accepted proposals
        # more; a request's first token comes with its last prefill chunk and
        # is not counted here
        b.tokens_out += step.decode_tokens + step.spec_accepted
        b.schedule += step.schedule
        b.prepare += step.prepare
        b.forward += step.forward
        b.sample += step.sample
        b.emit += step.emit

    def observe_request(self, request: RequestRecord,
                        choices: Iterable[RequestRecord] = (),
                        now: float | None = None) -> None:
        """One finished HTTP request: ``request`` sums its choices (the row in
        the recent list and its end-to-end latency), ``choices`` give TTFT and
        inter-token samples."""
        now = time.monotonic() if now is None else now
        self.requests_finished += 1
        self.prompt_tokens += request.prompt_tokens
        self.output_tokens += request.output_tokens
        gaps: list[float] = []
        if request.status == "ok":
            self._e2e.append((now, request.e2e))
            for choice in choices:
                ttft = choice.ttft
                if ttft is not None:
                    self._ttft.append((now, ttft))
                times = choice.token_times
                gaps.extend(times[i] - times[i - 1] for i in range(1, len(times)))
            self._itl.extend((now, gap) for gap in gaps)
        else:
            self.requests_failed += 1
        self._recent.append(RecentRequest(
            id=request.request_id, operation=request.operation, status=request.status,
            finish_reason=request.finish_reason, error_type=request.error_type,
            prompt_tokens=request.prompt_tokens, output_tokens=request.output_tokens,
            ttft=request.ttft, e2e=request.e2e,
            itl_mean=sum(gaps) / len(gaps) if gaps else None,
            finished_at=time.time() - (time.monotonic() - now)))

    # -- the summary --------------------------------------------------------

    def snapshot(self, now: float | None = None) -> LiveSnapshot:
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        current = int(now)
        in_window = [b for b in self._seconds if b.second >= current - int(self.window_s)]
        # whole seconds before this one, and this one so far
        rate_start = current - int(self.rate_window_s)
        rated = [b for b in self._seconds if b.second >= rate_start]
        covered = max(min(now - rate_start, now - self.started), 1e-3)
        busy = sum(b.busy_steps for b in in_window)
        queries = sum(b.prefix_queries for b in in_window)
        proposed = sum(b.spec_proposed for b in in_window)
        accepted = sum(b.spec_accepted for b in in_window)
        spec_rows = sum(b.spec_rows for b in in_window)
        last = self._last_step
        return LiveSnapshot(
            model=self.model, time=time.time(), uptime_s=now - self.started,
            window_s=self.window_s, requests_finished=self.requests_finished,
            requests_failed=self.requests_failed, prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens, steps=self.steps,
            tokens_in_per_s=sum(b.tokens_in for b in rated) / covered,
            tokens_out_per_s=sum(b.tokens_out for b in rated) / covered,
            running=last.num_running, waiting=last.num_waiting, kv_usage=last.kv_usage,
            kv_blocks_used=last.kv_blocks_used, kv_blocks_free=last.kv_blocks_free,
            batch_size=self._last_batch,
            batch_size_mean=sum(b.batch_sum for b in in_window) / busy if busy else 0.0,
            preemptions=self.preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_hit_rate=(sum(b.prefix_hits for b in in_window) / queries
                                   if queries else None),
            spec_method=self.spec_method, spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted,
            spec_acceptance=accepted / proposed if proposed else None,
            spec_tokens_per_row=1 + accepted / spec_rows if spec_rows else None,
            ttft=percentiles(v for t, v in self._ttft if t >= since),
            itl=percentiles(v for t, v in self._itl if t >= since),
            e2e=percentiles(v for t, v in self._e2e if t >= since),
            step_split=_split(in_window, busy),
            history=self._history(current),
            recent=list(reversed(self._recent)))

    def _history(self, current: int) -> list[SecondPoint]:
        """One point per second for the last ``history_s`` seconds, oldest
        first; a second without steps repeats the gauges of the one before."""
        by_second = {b.second: b for b in self._seconds}
        points: list[SecondPoint] = []
        first = current - self.history_s + 1
        earlier = [b for b in self._seconds if b.second < first]
        after: StepRecord | None = earlier[-1].last if earlier else None
        for second in range(first, current + 1):
            b = by_second.get(second)
            if b is None:
                points.append(SecondPoint(
                    t=second - current, tokens_in=0, tokens_out=0, steps=0, batch_size=0.0,
                    running=after.num_running if after else 0,
                    waiting=after.num_waiting if after else 0,
                    kv_usage=after.kv_usage if after else 0.0))
                continue
            after = b.last
            points.append(SecondPoint(
                t=second - current, tokens_in=b.tokens_in, tokens_out=b.tokens_out,
                steps=b.steps, batch_size=b.batch_sum / b.busy_steps if b.busy_steps else 0.0,
                running=b.running, waiting=b.waiting, kv_usage=b.kv_usage))
        return points


def percentiles(values: Iterable[float]) -> Percentiles:
    """Nearest-rank p50 / p95 / p99 of ``values``."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return Percentiles(0, None, None, None)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return Percentiles(n, rank(0.50), rank(0.95), rank(0.99))


def _split(seconds: list[_Second], busy_steps: int) -> StepSplit:
    sums = {c: sum(getattr(b, c) for b in seconds) for c in STEP_COMPONENTS}
    total = sum(sums.values())
    host = sums["schedule"] + sums["prepare"] + sums["emit"]
    per = busy_steps or 1
    return StepSplit(**{c: v / per for c, v in sums.items()},
                     host_overhead_share=host / total if total > 0 else 0.0)
