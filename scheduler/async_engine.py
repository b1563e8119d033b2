"""AsyncEngine: the only async part of the engine, and the gateway's one door.

One background task runs the step loop: each ``EngineCore.step()`` (schedule,
forward, postprocess) runs on a single worker thread, so the event loop keeps
serving sockets and timers while the model computes and while stop strings
are matched. Each request gets an ``asyncio.Queue`` of RequestOutput deltas; a
consumer that goes away (disconnect, cancellation) aborts its request, which
frees its blocks at once (the EngineCore is thread-safe).

The gateway uses only this façade: ``model`` (what is served), ``tokenizer``,
``load()`` (queue load for admission), ``health()``, ``add_request`` /
``stream_group`` / ``abort``. ``core`` is there for tests and tools.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from backends.interface import PoolingParams, SamplingParams
from backends.tokenizer import Tokenizer
from scheduler.config import FaultPolicy
from scheduler.engine import EngineCore
from scheduler.errors import EngineDeadError
from scheduler.outputs import EngineLoad, ModelInfo, RequestOutput, SchedulerStats
from scheduler.request import FinishReason

log = logging.getLogger("baton.engine")

StepObserver = Callable[[SchedulerStats], None]
# (number of requests an engine fault failed, why)
FaultObserver = Callable[[int, str], None]

# A burst of requests reaching an idle engine (clients that connect at once)
# arrives over a few milliseconds, each handler adding its request in turn.
# Woken by the first one, the loop waits until no request has been added for
# ADMISSION_QUIET_S (at most ADMISSION_WINDOW_S in all) before the first step,
# so that the burst is prefilled together instead of one step holding only
# the first arrivals while the rest wait for it (~0.1-0.2 s on a 2-core CPU).
# A lone request pays one quiet period; a busy engine never waits.
ADMISSION_QUIET_S = 0.005
ADMISSION_WINDOW_S = 0.03

# The most outputs one request's queue (every choice of one HTTP request
# together) may hold unread. A consumer that keeps up holds at most a step's
# worth; one whose client stopped reading its stream (its socket full) lets
# them pile up, ~3 MB/s for n=32 with logprobs. Past the bound the request
# is ended (see ``_overrun``).
MAX_QUEUED_OUTPUTS = 1024
# The error type of a request ended because its client read too slowly.
SLOW_CONSUMER = "client_too_slow"


@dataclass(frozen=True, slots=True)
class EngineHealth:
    ok: bool
    reason: str  # "ok", or what is wrong, for /health and the logs


class AsyncEngine:
    def __init__(self, core: EngineCore, policy: FaultPolicy | None = None) -> None:
        self._core = core
        self.policy = policy or FaultPolicy()
        core.step_timeout = self.policy.step_timeout
        self.model: ModelInfo = core.info
        self.tokenizer: Tokenizer = core.tokenizer
        # Compiles structured-output constraints (thread-safe, cached).
        self.grammar = core.grammar
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._work = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-step")
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._num_added = 0
        self.max_queued_outputs = MAX_QUEUED_OUTPUTS
        self.num_overruns = 0
        self.step_observers: list[StepObserver] = []
        self.fault_observers: list[FaultObserver] = []
        self.last_progress = time.monotonic()
        self.num_steps = 0
        self.num_faulted_requests = 0
        self.consecutive_failed_steps = 0
        self.last_fault: str | None = None

    @property
    def core(self) -> EngineCore:
        """The synchronous engine underneath (tests and tools; the gateway
        never reaches through it)."""
        return self._core

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="baton-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        # A step still on the worker thread finishes before anything is torn down.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        for output in self._core.abort_all(FinishReason.ABORT):
            self._deliver(output)
        self._core.release_finished()
        self._core.close()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---------------------------------------------------------------- state
    def load(self) -> EngineLoad:
        return self._core.load()

    @property
    def num_running(self) -> int:
        return self._core.load().num_running

    @property
    def num_waiting(self) -> int:
        return self._core.load().num_waiting

    def health(self) -> EngineHealth:
        """Unhealthy when the loop has stopped, when the backend reports a
        fatal error, when the last
        ``policy.unhealthy_after_failed_steps`` steps all failed, or when a
        busy engine has finished no step for ``policy.stall_timeout``."""
        if not self.is_running:
            return EngineHealth(False, "the engine loop has stopped")
        fatal = self.fatal_error
        if fatal:
            return EngineHealth(False, fatal)
        failed = self.consecutive_failed_steps
        if failed >= self.policy.unhealthy_after_failed_steps:
            return EngineHealth(False, f"the last {failed} engine steps failed for every "
                                       f"request in them; last fault: {self.last_fault}")
        idle_for = time.monotonic() - self.last_progress
        if idle_for > self.policy.stall_timeout and self._core.has_unfinished():
            return EngineHealth(False, f"no engine step has finished for {idle_for:.0f} s "
                                       f"while requests wait")
        return EngineHealth(True, "ok")

    @property
    def fatal_error(self) -> str | None:
        """Why this engine can never serve again (a tensor-parallel rank died
        or hangs; a step abandoned as hung came back), else None. New
        requests are refused with 503 from then on."""
        # A backend that can never step again (a tensor-parallel rank died).
        return getattr(self._core.backend, "fatal_error", None) or self._core.tainted

    def state_sizes(self) -> dict[str, int]:
        """Entries in every per-request table, this façade's included."""
        return {**self._core.state_sizes(), "async_queues": len(self._queues)}

    async def check_integrity(self) -> None:
        """``EngineCore.check_integrity`` on the step thread, between steps."""
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self._core.check_integrity)

    # ------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    queue: asyncio.Queue[RequestOutput] | None = None,
                    priority: int = 0, pooling: PoolingParams | None = None) -> str:
        """Validate and queue now (raising typed errors at once); returns the
        request id to pass to ``stream``. Requests given the same ``queue``
        can be consumed together with ``stream_group``. With ``pooling`` it
        is an embedding request (EngineCore.add_request)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        self._core.add_request(request_id, prompt_token_ids, params, priority, pooling)
        self._queues[request_id] = queue if queue is not None else asyncio.Queue()
        self._num_added += 1
        self._work.set()
        return request_id

    async def encode(self, text: str) -> list[int]:
        """Tokenize off the event loop thread."""
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def stream_group(self, request_ids: list[str]) -> AsyncIterator[RequestOutput]:
        """Interleaved deltas of requests that share one queue, until all have
        finished. Leaving early aborts the unfinished ones."""
        if not request_ids:
            return
        queue = self._queues[request_ids[0]]
        unfinished = set(request_ids)
        try:
            while unfinished:
                output = await queue.get()
                if output.finished:
                    unfinished.discard(output.request_id)
                yield output
        finally:
            for request_id in unfinished:
                self.abort(request_id)
            for request_id in request_ids:
                self._queues.pop(request_id, None)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Deltas of one request until its final output. Leaving early (break,
        cancellation, disconnect) aborts the request."""
        async for output in self.stream_group([request_id]):
            yield output

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        token_ids = await self.encode(prompt) if isinstance(prompt, str) else prompt
        request_id = self.add_request(token_ids, params, request_id)
        async for output in self.stream(request_id):
            yield output

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self._deliver(self._core.abort(request_id, reason))
        self._work.set()  # the backend's state for it is released by the next step

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        queue = self._queues.get(output.request_id)
        if queue is not None and not getattr(queue, "overrun", False):
            queue.put_nowait(output)
            if queue.qsize() > self.max_queued_outputs and not output.finished:
                self._overrun(queue)

    def _overrun(self, queue: asyncio.Queue[RequestOutput]) -> None:
        """End every unfinished request of a queue its consumer no longer
        drains, with an error its client finds if it reads on.

        Ended, not paused: a paused request would keep its KV blocks and its
        running slot for as long as its client stays away, so clients that
        stop reading could pin the server's whole capacity; ending it frees
        both at once. A client that reads at all never falls this far behind
        (the socket's buffers come on top of the bound)."""
        error = (f"the client read its stream too slowly: more than "
                 f"{self.max_queued_outputs} outputs waited unread, so the request was ended")
        ids = [rid for rid, q in self._queues.items() if q is queue]
        queue.overrun = True  # what the step still had for them is dropped: they have ended
        ended = 0
        for request_id in ids:
            output = self._core.abort(request_id, FinishReason.ERROR, error)
            if output is not None:
                output.error_type = SLOW_CONSUMER
                queue.put_nowait(output)
                ended += 1
        if ended:
            self.num_overruns += 1
            log.warning("requests %s: their client fell more than %d outputs behind its "
                        "stream; ended", ", ".join(ids), self.max_queued_outputs)
            self._work.set()

    # ------------------------------------------------------------ step loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self._core
        while True:
            if not core.has_work():
                self._work.clear()
                await self._work.wait()
                await self._settle_admissions()
                self.last_progress = time.monotonic()
            step_start = time.time_ns()
            try:
                outcome = await loop.run_in_executor(self._executor, core.step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - outside the backend: see below
                self._engine_fault(exc)
                await asyncio.sleep(0.01)
                continue
            for output in outcome.outputs:
                self._deliver(output)
            self.last_progress = time.monotonic()
            stats = outcome.stats
            if stats is not None:
                self.num_steps += 1
                if outcome.failed:
                    self.consecutive_failed_steps += 1
                    self.last_fault = outcome.fault
                else:
                    self.consecutive_failed_steps = 0
                if stats.num_faulted:
                    self._notify_fault(stats.num_faulted, outcome.fault or "engine fault")
                stats.start_ns, stats.end_ns = step_start, time.time_ns()
                for observer in self.step_observers:
                    try:
                        observer(stats)
                    except Exception:  # telemetry must never stop the engine
                        log.exception("step observer failed")
            # Let handlers run (new requests, aborts) between steps.
            await asyncio.sleep(0)

    async def _settle_admissions(self) -> None:
        """Woken from idle: let a burst of arriving requests all be added
        (see ADMISSION_QUIET_S) before the first step schedules."""
        deadline = time.monotonic() + ADMISSION_WINDOW_S
        while time.monotonic() < deadline:
            added = self._num_added
            await asyncio.sleep(ADMISSION_QUIET_S)
            if self._num_added == added:
                return

    def _engine_fault(self, exc: Exception) -> None:
        """A fault outside the backend (scheduling, postprocessing): the
        engine's view of the requests in flight cannot be trusted, so every
        one of them fails; the loop goes on with new requests."""
        log.exception("engine step failed outside the backend")
        reason = f"engine fault: {type(exc).__name__}: {exc}"
        self.consecutive_failed_steps += 1
        self.last_fault = reason
        failed = self._core.abort_all(FinishReason.ERROR, reason)
        for output in failed:
            self._deliver(output)
        self._notify_fault(len(failed), reason)

    def _notify_fault(self, count: int, reason: str) -> None:
        self.num_faulted_requests += count
        for observer in self.fault_observers:
            try:
                observer(count, reason)
            except Exception:  # noqa: BLE001
                log.exception("fault observer failed")
