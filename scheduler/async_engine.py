"""AsyncEngine: the only async part of the engine.

One background task runs the step loop. Scheduling and postprocessing happen
on the event loop thread (they are cheap and own all mutable state); the
forward pass runs on a single worker thread, so the loop keeps serving
sockets and timers while the model computes. Each request gets an
``asyncio.Queue`` of RequestOutput deltas; a consumer that goes away
(disconnect, cancellation) aborts its request, which frees its blocks before
the next step is scheduled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from backends.errors import EngineDeadError
from backends.interface import SamplingParams
from scheduler.engine import EngineCore
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import FinishReason

log = logging.getLogger("baton.engine")

StepObserver = Callable[[SchedulerStats], None]


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._work = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-forward")
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.step_observers: list[StepObserver] = []
        self.last_progress = time.monotonic()
        self.num_steps = 0

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
        for request_id in list(self._queues):
            self._deliver(self.core.abort(request_id))
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting

    # ------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None,
                    queue: asyncio.Queue[RequestOutput] | None = None,
                    priority: int = 0) -> str:
        """Validate and queue now (raising typed errors at once); returns the
        request id to pass to ``stream``. Requests given the same ``queue``
        can be consumed together with ``stream_group``."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.core.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        self.core.add_request(request_id, token_ids, params, priority)
        self._queues[request_id] = queue if queue is not None else asyncio.Queue()
        self._work.set()
        return request_id

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
        queue = self._queues[request_id]
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)
            self._queues.pop(request_id, None)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = self.add_request(prompt, params, request_id)
        async for output in self.stream(request_id):
            yield output

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self._deliver(self.core.abort(request_id, reason))

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        queue = self._queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    # ------------------------------------------------------------ step loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            if not core.has_unfinished():
                self._work.clear()
                await self._work.wait()
            self.last_progress = time.monotonic()
            step_start = time.time_ns()
            output = core.schedule()
            if output.is_empty:
                # Nothing fits this step (should not happen with a sane pool);
                # yield so aborts and new requests can change that.
                await asyncio.sleep(0.001)
                continue
            try:
                result = await loop.run_in_executor(self._executor, core.backend.execute, output)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an engine fault fails this step's requests only
                log.exception("engine step failed")
                for failed in core.fail_step(output, f"engine fault: {type(exc).__name__}: {exc}"):
                    self._deliver(failed)
                continue
            for request_output in core.postprocess(output, result):
                self._deliver(request_output)
            self.num_steps += 1
            self.last_progress = time.monotonic()
            stats = core.last_stats
            if stats is not None:
                stats.start_ns, stats.end_ns = step_start, time.time_ns()
                for observer in self.step_observers:
                    try:
                        observer(stats)
                    except Exception:  # telemetry must never stop the engine
                        log.exception("step observer failed")
            # Let handlers run (new requests, aborts) between steps.
            await asyncio.sleep(0)
