"""Who runs this step: a synchronous, deterministic continuous-batching policy.

One token budget per step, spent in four passes:

1. one token for every running request that is decoding;
2. a chunk for every running request still prefilling, at most
   ``long_prefill_threshold`` tokens each;
3. admissions from the waiting queue, in policy order: each looks up its
   longest cached prefix and computes only the rest, in a chunk of at most
   the threshold. Only one *long* prompt (more than the threshold left to
   compute) is prefilled at a time: while one is, later short requests are
   admitted past waiting long ones;
4. budget still left extends the chunks the threshold cut.

A step that holds no decodes (pass 1 found none) may admit short prompts
beyond the budget, up to ``prefill_only_step_tokens`` in all: nobody's next
token waits for that step, and a burst reaching an idle engine gets its first
tokens in one bigger step instead of several (each prefill step has a fixed
cost, and every decode after the first waits for the next one). Long
prompts never use that bonus, so a request arriving while one prefills
still waits one normal step at most.

So a long prompt never holds back decodes or new short requests for more
than the threshold's share of a step, and alone it still gets the whole step.

When blocks run out for a running request, the lowest-priority running
request (fcfs: the most recently admitted) is preempted by recompute: its
blocks are released (those that were full stay in the prefix cache, so it
finds them again when it is readmitted) and it goes back to the waiting queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from collections.abc import Callable

from backends.interface import ScheduledRequest, SchedulerOutput, StepResult, TokenLogprobs
from cache.kv_cache_manager import NO_HIT, KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.request_queue import RequestQueue, priority_key
from scheduler.speculative import ProposalBudget, SpeculationStats


@dataclass(slots=True)
class TokenUpdate:
    """One request's new tokens from a step (one, or a speculative step's
    accepted proposals and its own token); ``request.finish_reason`` is set
    when one of them ended it (the tokens after it are dropped). ``text`` is
    what the text hook released for them. No tokens: a scored prompt
    (max_tokens 0) was computed."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    text: str = ""


# Text-level stop conditions, decided with the token-level ones in one pass:
# given the request and its new token, the text that token released and the
# stop string it completed (or None).
TextHook = Callable[[Request, int], tuple[str, str | None]]


@dataclass(slots=True)
class _StepPlan:
    """Tokens granted so far this step, by request id, in output order."""

    budget: int
    tokens: dict[str, int] = field(default_factory=dict)
    num_preempted: int = 0
    bonus: int = 0  # for short admissions only, spent before the budget


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = RequestQueue(config.policy)
        self.running: list[Request] = []   # admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._next_arrival = 0
        self.num_preemptions_total = 0
        # Speculative decoding (scheduler/speculative.py): proposals verified
        # since the metrics last took them, and each request's share.
        self.spec_stats = SpeculationStats()
        self.proposal_budget: ProposalBudget | None = None

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
        self.kv_cache.forget(request.request_id)
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

    @property
    def num_finished_pending(self) -> int:
        """Finished requests whose ids the backend has not been told yet."""
        return len(self._finished_ids)

    @property
    def finished_pending_ids(self) -> tuple[str, ...]:
        return tuple(self._finished_ids)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens)
        threshold = self.config.long_prefill_threshold
        order = (sorted(self.running, key=priority_key) if self.config.policy == "priority"
                 else list(self.running))
        for request in order:            # 1. decodes (and their proposals)
            if plan.budget <= 0:
                break
            if request.status is RequestStatus.RUNNING and _remaining(request) == 1:
                self._reserve_decode(plan, request)
        decodes = bool(plan.tokens)
        for request in order:            # 2. running prefills, capped
            if plan.budget <= 0:
                break
            if (request.status is RequestStatus.RUNNING
                    and request.request_id not in plan.tokens):
                self._reserve(plan, request, min(_remaining(request), threshold))
        # 3. Admitting while preempting would thrash: the blocks just freed
        # are what the running requests need next step.
        if plan.num_preempted == 0:
            if not decodes:
                plan.bonus = max(0, (self.config.prefill_only_step_tokens or 0)
                                 - self.config.max_num_batched_tokens)
            self._admit(plan, threshold)
        self._extend_chunks(plan)        # 4. what is left

        scheduled = [self._scheduled(self.requests[rid], n) for rid, n in plan.tokens.items()]
        # Finished ids ride with the next step (the backend drops its
        # per-request state then); an output with nothing but finished ids
        # is executed too, so that state never outlives an idle engine.
        finished, self._finished_ids = self._finished_ids, []
        self.num_preemptions_total += plan.num_preempted
        return SchedulerOutput(scheduled, finished, plan.num_preempted)

    def _reserve(self, plan: _StepPlan, request: Request, num_new: int) -> None:
        """Grant a running request ``num_new`` tokens (within the budget),
        preempting lower-priority requests while blocks are short; the
        request may end up preempting itself."""
        num_new = min(num_new, plan.budget)
        target = request.num_computed_tokens + num_new
        while not self.kv_cache.allocate_slots(request.request_id, target):
            victim = self._preemption_victim()
            self._preempt(victim)
            plan.num_preempted += 1
            plan.budget += plan.tokens.pop(victim.request_id, 0)
            if victim is request:
                return
        plan.tokens[request.request_id] = num_new
        plan.budget -= num_new

    def _reserve_decode(self, plan: _StepPlan, request: Request) -> None:
        """A decode's token and, where it proposed some and budget and blocks
        allow without preempting anyone, its proposals (dropped otherwise)."""
        proposals = request.spec_token_ids
        if proposals:
            keep = min(len(proposals), plan.budget - 1)
            if keep > 0 and self.kv_cache.allocate_slots(
                    request.request_id, request.num_computed_tokens + 1 + keep):
                request.spec_token_ids = proposals[:keep]
                plan.tokens[request.request_id] = 1 + keep
                plan.budget -= 1 + keep
                return
            request.spec_token_ids = []
        self._reserve(plan, request, 1)

    def _admit(self, plan: _StepPlan, threshold: int) -> None:
        long_prefilling = any(_remaining(r) > threshold for r in self.running)
        for request in list(self.waiting):
            if plan.budget + plan.bonus <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            # Prompt logprobs and mean pooling need every prompt position
            # computed; last-token pooling only the last (never a hit).
            every = (request.sampling_params.prompt_logprobs is not None
                     or (request.pooling is not None and request.pooling.needs_every_position))
            hit = NO_HIT if every \
                else self.kv_cache.find_cached_prefix(request.request_id, request)
            remaining = request.num_tokens - hit.num_tokens
            is_long = remaining > threshold
            if is_long and long_prefilling:
                continue  # one long prefill at a time; shorter ones may pass
            available = plan.budget if is_long else plan.budget + plan.bonus
            if available <= 0:
                continue
            num_new = min(remaining, threshold, available)
            if not self.kv_cache.allocate_slots(request.request_id,
                                                hit.num_tokens + num_new, hit):
                return  # out of blocks: nobody passes the head of the line
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            self.running.append(request)
            plan.tokens[request.request_id] = num_new
            from_bonus = 0 if is_long else min(num_new, plan.bonus)
            plan.bonus -= from_bonus
            plan.budget -= num_new - from_bonus
            long_prefilling |= is_long

    def _extend_chunks(self, plan: _StepPlan) -> None:
        """Give budget nobody else wanted to the prefill chunks the threshold
        cut, in order. No preemption for this: it is only a bonus."""
        for request_id, num_new in plan.tokens.items():
            if plan.budget <= 0:
                return
            request = self.requests[request_id]
            start = request.num_computed_tokens + num_new
            extra = min(request.num_tokens - start, plan.budget)
            if extra > 0 and self.kv_cache.allocate_slots(request_id, start + extra):
                plan.tokens[request_id] = num_new + extra
                plan.budget -= extra

    def _preemption_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        first = not request.ever_scheduled
        if first:
            request.ever_scheduled = True
            request.first_scheduled_time = time.monotonic()
        # A decode's proposals ride after its token: computed this step, but
        # counted only once accepted (update_from_output).
        proposals = request.spec_token_ids
        num_own = num_new - len(proposals)
        request.num_computed_tokens = start + num_own
        table = self.kv_cache.block_table(request.request_id)
        known, request.num_blocks_sent = request.num_blocks_sent, len(table)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_own) + proposals,
            start_pos=start,
            block_table=table,
            num_known_blocks=known,
            # A scored prompt (max_tokens 0) only needs its positions computed;
            # an embedding request's last chunk is marked to be pooled.
            sample=(request.num_computed_tokens == request.num_tokens
                    and (request.max_tokens > 0 or request.pooling is not None)),
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=list(request.prompt_token_ids) if first else None,
            pooling=request.pooling,
            spec_token_ids=list(proposals),
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_blocks_sent = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.add_preempted(request)

    # ------------------------------------------------------------ postprocess
    def update_from_output(self, output: SchedulerOutput, result: StepResult,
                           text_hook: TextHook | None = None) -> list[TokenUpdate]:
        """Append sampled tokens and decide every stop condition in one pass:
        EOS and stop token ids, then a stop string (from ``text_hook``), then
        max_tokens and the context length, token by token (a speculative
        step's accepted proposals, then its own token: a stop drops the rest).
        A request ends here at most once. Each request's full blocks are named
        in the prefix cache before it can end, so that requests ending in this
        step leave them cached too; a speculative step's blocks past its
        tokens (rejected proposals') are released."""
        sampled = {rid: (token_id, logprobs) for rid, token_id, logprobs in zip(
            result.request_ids, result.token_ids, result.logprobs)}
        updates: list[TokenUpdate] = []
        for scheduled in output.requests:
            request_id = scheduled.request_id
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (aborted, failed) while the step ran
            request.spec_token_ids = []
            if request_id not in sampled:
                self.kv_cache.cache_computed_blocks(request_id, request,
                                                    request.num_computed_tokens)
                if (request.max_tokens == 0 and request.pooling is None
                        and request.num_computed_tokens == request.num_tokens):
                    # A scored prompt ends once it is computed: nothing sampled.
                    updates.append(TokenUpdate(request, [], None))
                    self.finish_request(request_id, FinishReason.LENGTH)
                continue
            token_id, last_logprobs = sampled[request_id]
            accepted = result.accepted.get(request_id, [])
            tokens = accepted + [token_id]
            entries = (result.accepted_logprobs.get(request_id) or [None] * len(accepted)) \
                + [last_logprobs]
            update = TokenUpdate(request, [], [] if last_logprobs is not None else None)
            reason = stop_reason = None
            for token, entry in zip(tokens, entries):
                request.output_token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                text, stop_string = text_hook(request, token) if text_hook else ("", None)
                update.token_ids.append(token)
                update.text += text
                if update.logprobs is not None:
                    update.logprobs.append(entry)
                reason, stop_reason = self._check_stop(request, token, stop_string)
                if reason is not None:
                    break
            # Every token but the newest has its KV in place (the accepted
            # proposals' were computed this step).
            request.num_computed_tokens = request.num_tokens - 1
            if scheduled.spec_token_ids:
                request.num_spec_proposed += len(scheduled.spec_token_ids)
                request.num_spec_accepted += len(tokens) - 1
                self.spec_stats.proposed += len(scheduled.spec_token_ids)
                self.spec_stats.accepted += len(tokens) - 1
                self.spec_stats.verified_rows += 1
                if self.proposal_budget is not None:
                    self.proposal_budget.record(request_id, len(scheduled.spec_token_ids),
                                                len(tokens) - 1)
            self.kv_cache.cache_computed_blocks(request_id, request,
                                                request.num_computed_tokens)
            if scheduled.spec_token_ids and self.kv_cache.trim(request_id, request.num_tokens):
                request.num_blocks_sent = min(request.num_blocks_sent,
                                              self.kv_cache.num_request_blocks(request_id))
            updates.append(update)
            if reason is not None:
                self.finish_request(request_id, reason, stop_reason)
        return updates

    def finish_pooled(self, output: SchedulerOutput, result: StepResult
                      ) -> tuple[list[tuple[Request, list[float]]], list[Request]]:
        """End the embedding requests whose prompt this step finished (after
        ``update_from_output``, which names their computed blocks in the
        prefix cache): those with a vector, and (finished with ERROR) any the
        backend returned none for, which would otherwise stay running with
        nothing left to compute. A request that ended while the step ran
        (aborted, or failed by a fault) is skipped."""
        done, missing = [], []
        for scheduled in output.requests:
            if scheduled.pooling is None or not scheduled.sample:
                continue
            request = self.requests.get(scheduled.request_id)
            if request is None:
                continue
            vector = result.pooled.get(scheduled.request_id)
            self.finish_request(scheduled.request_id,
                                FinishReason.STOP if vector is not None else FinishReason.ERROR)
            if vector is not None:
                done.append((request, vector))
            else:
                missing.append(request)
        return done, missing

    def _check_stop(self, request: Request, token_id: int, stop_string: str | None = None
                    ) -> tuple[FinishReason | None, int | str | None]:
        params = request.sampling_params
        if (not params.ignore_eos and token_id in request.eos_token_ids
                and request.num_output_tokens >= params.min_tokens):
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if stop_string is not None:
            return FinishReason.STOP, stop_string
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

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
        self.waiting.check_order()
        stray = self.kv_cache.request_ids - set(self.requests)
        if stray:
            raise AssertionError(f"the KV cache keeps state for ended requests {sorted(stray)}")


def _remaining(request: Request) -> int:
    """Tokens the request has yet to compute (1 for a decode)."""
    return request.num_tokens - request.num_computed_tokens
