"""Who runs this step: a synchronous, deterministic continuous-batching policy.

One token budget per step. Running requests come first, in admission order,
each taking what it still needs (one token for a decode, a chunk for a
partially prefilled prompt); waiting prompts then fill the rest in chunks.
When blocks run out for a running request, the most recently admitted
running request is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue with ``num_computed_tokens = 0``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from backends.interface import ScheduledRequest, SchedulerOutput, StepResult, TokenLogprobs
from cache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class TokenUpdate:
    """One request's new token from a step; ``request.finish_reason`` is set
    when the token ended it."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason,
                       stop_reason: int | str | None = None) -> Request | None:
        """End a request on any exit path and free its blocks. Idempotent:
        returns None when the request is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason, stop_reason)
        return request

    def _finish(self, request: Request, reason: FinishReason,
                stop_reason: int | str | None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache.free(request.request_id)
        if request.ever_scheduled:
            self._finished_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (admission control)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_new
            while not self.kv_cache.allocate_slots(request.request_id, target):
                victim = self.running[-1]
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing below it is left either
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1

        # Admitting while preempting would thrash: the blocks just freed are
        # what the running requests need next step.
        while (self.waiting and budget > 0 and num_preempted == 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(
                    request.request_id, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        # Finished ids ride with the next real step (the backend drops its
        # per-request state then); an empty output is never executed.
        finished: list[str] = []
        if scheduled:
            finished, self._finished_ids = self._finished_ids, []
        self.num_preemptions_total += num_preempted
        return SchedulerOutput(scheduled, finished, num_preempted)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        first = not request.ever_scheduled
        if first:
            request.ever_scheduled = True
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_new),
            start_pos=start,
            block_table=self.kv_cache.block_table(request.request_id),
            sample=request.num_computed_tokens == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=list(request.prompt_token_ids) if first else None,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------ postprocess
    def update_from_output(self, output: SchedulerOutput,
                           result: StepResult) -> list[TokenUpdate]:
        """Append sampled tokens and apply the token-level stop conditions
        (EOS, stop token ids, max_tokens, context length)."""
        updates: list[TokenUpdate] = []
        for request_id, token_id, logprobs in zip(
                result.request_ids, result.token_ids, result.logprobs):
            request = self.requests.get(request_id)
            if request is None:  # finished (aborted) while the step ran
                continue
            request.output_token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            updates.append(TokenUpdate(request, token_id, logprobs))
            reason, stop_reason = self._check_stop(request, token_id)
            if reason is not None:
                self.finish_request(request_id, reason, stop_reason)
        return updates

    def _check_stop(self, request: Request,
                    token_id: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        if (not params.ignore_eos and token_id in request.eos_token_ids
                and request.num_output_tokens >= params.min_tokens):
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def fail_step(self, output: SchedulerOutput) -> list[Request]:
        """An engine fault in this step: finish exactly its requests with ERROR."""
        failed = []
        for scheduled in output.requests:
            request = self.finish_request(scheduled.request_id, FinishReason.ERROR)
            if request is not None:
                failed.append(request)
        return failed

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        for request in self.running:
            if request.status is not RequestStatus.RUNNING:
                raise AssertionError(f"{request.request_id} in running with {request.status}")
        for request in self.waiting:
            if request.status is not RequestStatus.WAITING:
                raise AssertionError(f"{request.request_id} in waiting with {request.status}")
            if self.kv_cache.num_request_blocks(request.request_id):
                raise AssertionError(f"waiting {request.request_id} holds blocks")
        if len(self.running) + len(self.waiting) != len(self.requests):
            raise AssertionError("request table out of sync with the queues")
