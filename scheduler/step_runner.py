"""Running a step on the backend, with its faults contained.

``StepRunner.run`` hands a SchedulerOutput to the backend. When the backend
raises (or, with ``step_timeout``, does not come back in time), the step's
requests are run again in halves until the requests that fail on their own are
found: only those are reported failed, and the others get their results as if
nothing had happened. Re-running a row is safe: its KV writes are the same
values at the same slots, and the backend keeps per-request state (seeded
generators, penalty counts) only once a row has been sampled.

A hung step cannot be stopped (a thread cannot be killed): it is abandoned and
later steps use a new forward thread. If it ever comes back, it may have
written KV blocks that other requests own by then, so the runner is *tainted*
and the engine reports itself unhealthy.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from backends.interface import Backend, SchedulerOutput, StepResult, StepTimings
from scheduler.errors import StepTimeoutError

log = logging.getLogger("baton.engine")


class StepRunner:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # Seconds a backend step may take before it is abandoned as hung
        # (None: wait for ever). Set by the AsyncEngine from its FaultPolicy.
        self.step_timeout: float | None = None
        self.num_abandoned_steps = 0
        self.tainted: str | None = None
        self._forward: ThreadPoolExecutor | None = None

    def run(self, output: SchedulerOutput) -> tuple[StepResult, dict[str, str]]:
        """The step's result and, per request that failed on its own, why
        (rows the backend itself reports failed included)."""
        try:
            result = self._execute(output)
        except Exception as exc:  # noqa: BLE001 - contained below
            requests = output.requests
            if len(requests) == 1:
                log.error("engine step failed for request %s: %s: %s",
                          requests[0].request_id, type(exc).__name__, exc)
                return _empty_result(), {requests[0].request_id: fault_text(exc)}
            log.warning("engine step with %d requests failed (%s: %s); running it again "
                        "in halves to find the request that causes it",
                        len(requests), type(exc).__name__, exc)
            mid = len(requests) // 2
            first = SchedulerOutput(requests[:mid], output.finished_request_ids,
                                    output.num_preempted)
            second = SchedulerOutput(requests[mid:], [], 0)
            result_a, faults_a = self.run(first)
            result_b, faults_b = self.run(second)
            return _merge(result_a, result_b), {**faults_a, **faults_b}
        return result, dict(result.failed)

    def release(self, output: SchedulerOutput) -> None:
        """Tell the backend which requests ended, with nothing to run."""
        try:
            self.backend.execute(output)
        except Exception:  # noqa: BLE001 - the ids ride again with the next step
            log.exception("releasing finished requests in the backend failed")

    def close(self) -> None:
        """Stop the forward thread (a hung one is left to itself)."""
        if self._forward is not None:
            self._forward.shutdown(wait=False)
            self._forward = None

    def _execute(self, output: SchedulerOutput) -> StepResult:
        if self.step_timeout is None:
            return self.backend.execute(output)
        if self._forward is None:
            self._forward = ThreadPoolExecutor(1, thread_name_prefix="baton-forward")
        future = self._forward.submit(self.backend.execute, output)
        try:
            return future.result(timeout=self.step_timeout)
        except FutureTimeout:
            self._forward.shutdown(wait=False)
            self._forward = None
            self.num_abandoned_steps += 1
            future.add_done_callback(self._abandoned_step_returned)
            raise StepTimeoutError(
                f"the step did not finish within {self.step_timeout:g} s "
                f"(--step-timeout)") from None

    def _abandoned_step_returned(self, future: Future) -> None:
        self.tainted = ("a step abandoned as hung came back later; the KV cache may "
                        "hold its writes, so restart the server")
        log.error("%s", self.tainted)


def fault_text(exc: BaseException, what: str = "engine fault") -> str:
    return f"{what}: {type(exc).__name__}: {exc}"


def _empty_result() -> StepResult:
    return StepResult([], [], [], StepTimings())


def _merge(a: StepResult, b: StepResult) -> StepResult:
    timings = StepTimings(prepare=a.timings.prepare + b.timings.prepare,
                          forward=a.timings.forward + b.timings.forward,
                          sample=a.timings.sample + b.timings.sample)
    return StepResult(a.request_ids + b.request_ids, a.token_ids + b.token_ids,
                      a.logprobs + b.logprobs, timings,
                      {**a.prompt_logprobs, **b.prompt_logprobs}, {**a.failed, **b.failed},
                      {**a.error_types, **b.error_types}, {**a.pooled, **b.pooled},
                      {**a.accepted, **b.accepted},
                      {**a.accepted_logprobs, **b.accepted_logprobs})
